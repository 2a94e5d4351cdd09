// cuda/common/dev_rows.cuh — a [B, T, heads, D] tensor of Params (a TensorRef) as a kernel sees it: base
// pointer and int64 element strides, D contiguous. Shared by the tiled and fused tiers' kernels.
#pragma once

#include <cstdint>

#include "deltacp/params.h"

namespace deltacp::cuda {

template <class E>
struct DevRows {
  E* ptr = nullptr;
  int64_t sb = 0, st = 0, sh = 0;
  __device__ __forceinline__ E* at(int64_t b, int64_t t, int64_t h) const { return ptr + b * sb + t * st + h * sh; }
};

template <class E>
DevRows<E> dev_rows(const TensorRef& r) {
  return DevRows<E>{static_cast<E*>(r.ptr), r.stride_b, r.stride_t, r.stride_h};
}

}  // namespace deltacp::cuda
