// cuda/common/kda_gate.cuh — one element of kda's in-kernel gate (FLA's use_gate_in_kernel; Params::gate_A_log),
// shared by the fused forward's gate sum (cuda/tiled/tiled_fwd.cu, chunk_sum_gate) and the one-pass kernel the
// other tiers take the gate from (kda_gate.cu), so both compute the same bits:
//
//   lower_bound < 0:  g = lower_bound sigmoid(a (x + bias))        a = e^(A_log[hv]), bias = dt_bias[hv, k]
//   lower_bound = 0:  g = -a softplus(x + bias)                     softplus(y) = y past 20 (torch's threshold)
//
// fp32 math with the accurate expf / log1pf, as FLA's Triton kernels and deltacp.fla_options.kda_gate compute it.
#pragma once

#include <cuda_runtime.h>

namespace deltacp::cuda {

__device__ __forceinline__ float kda_gate_value(float x, float a, float bias, float lower_bound) {
  const float y = x + bias;
  if (lower_bound < 0.f) return lower_bound / (1.f + expf(-a * y));
  return -a * (y > 20.f ? y : log1pf(expf(y)));
}

// Its derivatives, times the upstream gradient dg: *dx = dg d(gate)/dx (also d(gate)/d(bias)), and the return value
// dg d(gate)/d(A_log), with a = e^A_log so that d/dA_log = a d/da:
//   lower_bound < 0:  s = sigmoid(a y):  d/dx = lower_bound s (1 - s) a,  d/dA_log = lower_bound s (1 - s) a y
//   lower_bound = 0:  d/dx = -a sigmoid(y) (softplus' derivative; 1 past 20),  d/dA_log = the gate itself
__device__ __forceinline__ float kda_gate_grad(float x, float a, float bias, float lower_bound, float dg, float* dx) {
  const float y = x + bias;
  if (lower_bound < 0.f) {
    const float s = 1.f / (1.f + expf(-a * y));
    const float ds = dg * lower_bound * s * (1.f - s) * a;
    *dx = ds;
    return ds * y;
  }
  *dx = y > 20.f ? -a * dg : -a * dg / (1.f + expf(-y));
  return dg * -a * (y > 20.f ? y : log1pf(expf(y)));
}

}  // namespace deltacp::cuda
