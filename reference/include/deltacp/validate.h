// deltacp/validate.h — checks every backend runs on a Params before touching memory.
#pragma once

#include <string>

#include "deltacp/params.h"

namespace deltacp {

// Shapes, sizes, chunk size, head grouping, cu_seqlens (host copy) and which pointers each
// variant needs. Throws deltacp::Error naming the argument. Host-only and cheap (O(N)).
void validate_forward(const Params& p);
// validate_forward plus the backward's tensors (dout, dq, dk, dv, and the variant's gradients).
void validate_backward(const Params& p);
// The numeric input checks of docs/errors.md on host memory: every input finite, and the log decay
// g <= 0 for gdn and kda. The reference runs them on every call; the CUDA tiers run the same checks
// on the device when DELTACP_CHECK=1 (cuda/common/finite_check.h). Throws NumericError naming the
// tensor, the first bad index [b, t, h, d] and the likely cause.
void check_finite_host(const Params& p, bool backward);
// The output check: o and ht (forward) or every gradient written (backward) finite. Throws
// NumericError naming the tensor and the likely cause (keys of large norm).
void check_outputs_host(const Params& p, bool backward);

// The messages both the host and the device checks give (one wording for every backend).
// what: "input" / "output" / "gradient"; index: "[b, t, h, d]" or "flat index i".
std::string nonfinite_message(const char* what, double value, const std::string& index);
std::string positive_gate_message(double value, const std::string& index);

}  // namespace deltacp
