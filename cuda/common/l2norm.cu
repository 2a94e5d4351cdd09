// cuda/common/l2norm.cu — x / sqrt(sum(x^2) + eps) along the last dimension of a batch of rows, one pass
// (FLA's use_qk_l2norm_in_kernel for q and k), and its backward.
//
//   forward   y = x r,  r = (sum_d x_d^2 + eps)^(-1/2)          (fp32 math; y in x's dtype; r kept, fp32)
//   backward  dx = r (dy - y (y . dy)),  y = x r recomputed in fp32 from x and r
//
// One warp per row, each lane holding D / 32 elements in registers (D <= 256): every element is read
// once and written once, with a warp-shuffle sum. The torch expression it replaces (cast to fp32, square,
// sum, rsqrt, multiply, cast back) makes about six passes with fp32 intermediates.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "check.h"
#include "deltacp/cuda/api.h"
#include "deltacp/error.h"
#include "load_store.cuh"

namespace deltacp::cuda {
namespace {

constexpr int kMaxPerLane = 8;  // D <= 32 * 8 = 256

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class T>
__global__ void __launch_bounds__(256) l2norm_rows_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                          float* __restrict__ rstd, int64_t rows, int D, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* xr = x + row * D;
  float v[kMaxPerLane];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int d = lane + 32 * i;
    v[i] = d < D ? load_f(xr + d) : 0.f;
    ss += v[i] * v[i];
  }
  const float r = rsqrtf(warp_sum(ss) + eps);
  T* yr = y + row * D;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < D) store_f(yr + d, v[i] * r);
  }
  if (lane == 0 && rstd != nullptr) rstd[row] = r;
}

template <class T>
__global__ void __launch_bounds__(256) l2norm_rows_backward_kernel(const T* __restrict__ x, const float* __restrict__ rstd,
                                                                   const T* __restrict__ dy, T* __restrict__ dx,
                                                                   int64_t rows, int D) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float r = rstd[row];
  float yv[kMaxPerLane], g[kMaxPerLane];
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int d = lane + 32 * i;
    yv[i] = d < D ? load_f(x + row * D + d) * r : 0.f;
    g[i] = d < D ? load_f(dy + row * D + d) : 0.f;
    dot += yv[i] * g[i];
  }
  dot = warp_sum(dot);
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int d = lane + 32 * i;
    if (d < D) store_f(dx + row * D + d, r * (g[i] - yv[i] * dot));
  }
}

void check_rows(int64_t rows, int64_t D) {
  DELTACP_CHECK(D >= 1 && D <= 32 * kMaxPerLane, "D", "expected 1 <= D <= ", 32 * kMaxPerLane,
                " for the l2 norm kernel, got ", D);
  DELTACP_CHECK(rows >= 0, "rows", "expected >= 0, got ", rows);
}

}  // namespace

void l2norm_rows(const void* x, void* y, float* rstd, int64_t rows, int64_t D, DType dtype, float eps, void* stream) {
  check_rows(rows, D);
  if (rows == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned blocks = static_cast<unsigned>((rows + 7) / 8);
    l2norm_rows_kernel<T><<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), static_cast<T*>(y), rstd, rows, static_cast<int>(D), eps);
    DELTACP_CUDA_CHECK_LAUNCH();
  });
}

void l2norm_rows_backward(const void* x, const float* rstd, const void* dy, void* dx, int64_t rows, int64_t D,
                          DType dtype, void* stream) {
  check_rows(rows, D);
  if (rows == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned blocks = static_cast<unsigned>((rows + 7) / 8);
    l2norm_rows_backward_kernel<T><<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), rstd, static_cast<const T*>(dy), static_cast<T*>(dx), rows, static_cast<int>(D));
    DELTACP_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace deltacp::cuda
