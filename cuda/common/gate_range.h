// cuda/common/gate_range.h — safe_gate's range check of a CUDA forward (Params::gate_range; gate_range.cuh has the
// slots' integer form). forward() in cuda/dispatch.cu starts it: the slots initialised on the stream, then either the
// fused kda stage folds the reduction into its gate load (kda_prepare_wgmma.cuh, phase 1: no pass of its own) or
// gate_range_pass reads g once. Measured (H200, bf16 kda, FLA's benchmark keywords): the pass it replaces there,
// torch.aminmax over g, took 0.131 ms of the 1.82 ms forward at (4,4096,64,128) and 0.069 of 1.11 at
// (2,16384,16,128).
#pragma once

#include <cuda_runtime.h>

#include "deltacp/params.h"

namespace deltacp::cuda {

// The slots' starting values (two memsets on the stream).
void gate_range_init(int* range, cudaStream_t stream);

// The smallest and largest value of g ([B, T, HV, K] for kda and dplr, [B, T, HV] for gdn) reduced into
// p.gate_range, in one pass over g on `stream`.
void gate_range_pass(const Params& p, cudaStream_t stream);

}  // namespace deltacp::cuda
