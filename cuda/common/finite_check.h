// cuda/common/finite_check.h — the numeric checks of docs/errors.md on GPU tensors, on request.
//
// With DELTACP_CHECK=1 in the environment, deltacp::cuda::forward / backward (every tier, cuda/dispatch.cu)
// check before the kernels that every input is finite and that the log decay g is <= 0 (gdn, kda),
// and after them that o and ht (forward) or every gradient written (backward) are finite. A failure
// throws deltacp::NumericError with the message the CPU reference gives (reference/src/validate.cpp):
// the tensor, the first bad index [b, t, h, d], the value and the likely cause.
//
// Cost: off (unset or "0"), one getenv per call and nothing on the GPU. On, one reduction kernel per
// tensor (reads every element once, atomicMin of the first bad flat index) and one synchronisation of
// p.stream per check: for debugging runs, not for timing. Inside a CUDA graph capture (torch.cuda.graph)
// they cannot run: with DELTACP_CHECK set, a captured call raises deltacp::Error naming DELTACP_CHECK.
#pragma once

#include "deltacp/params.h"

namespace deltacp::cuda {

// DELTACP_CHECK is set to a value other than "" and "0".
bool numeric_checks_requested();

// Inputs q, k, v, g, beta, a, b, initial_state (and do, dht for the backward): finite; g <= 0 for gdn, kda.
void check_inputs_on_device(const Params& p, bool backward);
// Outputs o, ht (forward) or dq, dk, dv, dg, dbeta, da, db, dh0 (backward), where given: finite.
void check_outputs_on_device(const Params& p, bool backward);

}  // namespace deltacp::cuda
