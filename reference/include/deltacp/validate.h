// deltacp/validate.h — checks every backend runs on a Params before touching memory.
#pragma once

#include "deltacp/params.h"

namespace deltacp {

// Shapes, sizes, chunk size, head grouping, cu_seqlens (host copy) and which pointers each
// variant needs. Throws deltacp::Error naming the argument. Host-only and cheap (O(N)).
void validate_forward(const Params& p);
// validate_forward plus the backward's tensors (dout, dq, dk, dv, and the variant's gradients).
void validate_backward(const Params& p);
// Scans every input that lives in host memory for NaN/Inf (the reference calls this; GPU
// backends run it only on request since it reads every byte). Throws naming the tensor.
void check_finite_host(const Params& p, bool backward);

}  // namespace deltacp
