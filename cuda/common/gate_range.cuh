// cuda/common/gate_range.cuh — safe_gate's range check (FLA's promise lower_bound <= g <= 0 on a precomputed log
// decay) as a reduction into Params::gate_range, by a kernel that reads g anyway or by gate_range.cu's own pass.
//
// The two int slots hold the smallest and the largest value of g in an order-preserving integer form (gate_order_key:
// a float's bits, those of negative floats with the magnitude bits flipped), so that atomicMin / atomicMax on ints
// reduce floats, and a NaN is not lost as fminf / fmaxf would lose it: a positive NaN sorts above +inf, a negative
// one below -inf, so either ends up in a slot and decodes to NaN, which fails the promise (deltacp/_library.py
// GateRangeCheck decodes them on the host). gate_range_init writes the slots' starting values on the stream:
// 0x7f7f7f7f (3.4e38) and 0x80808080 (-3.4e38 in this form).
#pragma once

#include <cuda_runtime.h>

#include <climits>

namespace deltacp::cuda {

__device__ __forceinline__ int gate_order_key(float x) {
  const int b = __float_as_int(x);
  return b >= 0 ? b : b ^ 0x7fffffff;
}

// The smallest and largest key of the warp in every lane.
__device__ __forceinline__ void warp_key_range(int& lo, int& hi) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
}

__device__ __forceinline__ void publish_key_range(int* range, int lo, int hi) {
  atomicMin(range, lo);
  atomicMax(range + 1, hi);
}

}  // namespace deltacp::cuda
