// deltacp/cuda/tiers.h — entry points of each tier, called only by the dispatch (cuda/dispatch.cu).
// Each takes an already validated Params with device pointers.
#pragma once

#include "deltacp/params.h"

namespace deltacp::cuda {

void naive_forward(const Params& p);   // cuda/naive/naive_fwd.cu
void naive_backward(const Params& p);  // cuda/naive/naive_bwd.cu
void tiled_forward(const Params& p);   // cuda/tiled/tiled_fwd.cu
void tiled_backward(const Params& p);  // cuda/tiled/tiled_bwd.cu

}  // namespace deltacp::cuda
