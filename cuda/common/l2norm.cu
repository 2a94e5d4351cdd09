// cuda/common/l2norm.cu — x / sqrt(sum(x^2) + eps) along the last dimension of a batch of rows, one pass
// (FLA's use_qk_l2norm_in_kernel for q and k), and its backward.
//
//   forward   y = x r,  r = (sum_d x_d^2 + eps)^(-1/2)          (fp32 math; y in x's dtype; r kept, fp32)
//   backward  dx = r (dy - y (y . dy)),  y = x r recomputed in fp32 from x and r
//
// One warp per row, each lane holding D / 32 elements in registers (D <= 256): every element is read
// once and written once, with a warp-shuffle sum. Rows of 128 16-bit elements (q and k at K = 128) go through
// shared memory 32 rows a block, with the same arithmetic (l2norm_rows128_kernel below). Measured (H200, bf16,
// (2,16384,16,128), q and k together, torch.profiler): forward 0.133 ms, backward 0.209 ms. The torch expression it replaces (cast to fp32, square,
// sum, rsqrt, multiply, cast back) makes about six passes with fp32 intermediates.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

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

// Rows of 128 16-bit elements with 16-byte aligned pointers (q and k at K = 128, the case FLA's benchmark times): a
// block of 256 threads takes 32 rows (8 KB) through shared memory, each thread moving 16-byte pieces between global
// and shared memory, and warp w computes rows 4 w .. 4 w + 3 with the lane mapping and the arithmetic of the kernels
// above (lane l: elements l, l + 32, l + 64, l + 96), so y, rstd and dx are their bits. The one-row kernels keep at
// most 256 bytes a warp in flight: on an H200 the forward over q and k took 0.180 ms at (2, 16384, 16, 128) bf16,
// 2.98 TB/s of the 4.25 the device copy reaches (four rows a warp in registers instead was slower, 0.307 ms).
constexpr int kTileRows = 32, kTileD = 128;

// Rows 0 .. nrows - 1 of a 32 x 128 tile from src to dst (kTileD apart in both), 16 bytes a thread per step.
template <class T>
__device__ __forceinline__ void copy_tile_rows(T* dst, const T* src, int nrows) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int p = static_cast<int>(threadIdx.x) + 256 * j, r = p >> 4, c = 8 * (p & 15);
    if (r < nrows)
      *reinterpret_cast<uint4*>(dst + r * kTileD + c) = *reinterpret_cast<const uint4*>(src + r * kTileD + c);
  }
}

template <class T>
__global__ void __launch_bounds__(256) l2norm_rows128_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                             float* __restrict__ rstd, int64_t rows, float eps) {
  __shared__ __align__(16) T tile[kTileRows * kTileD];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int nrows = static_cast<int>(rows - row0 < kTileRows ? rows - row0 : kTileRows);
  copy_tile_rows(tile, x + row0 * kTileD, nrows);
  __syncthreads();
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    const int r = 4 * w + rr;
    if (r >= nrows) break;
    T* tr = tile + r * kTileD;
    float v[4];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = load_f(tr + lane + 32 * i);
      ss += v[i] * v[i];
    }
    const float rn = rsqrtf(warp_sum(ss) + eps);
#pragma unroll
    for (int i = 0; i < 4; ++i) store_f(tr + lane + 32 * i, v[i] * rn);
    if (lane == 0 && rstd != nullptr) rstd[row0 + r] = rn;
  }
  __syncthreads();
  copy_tile_rows(y + row0 * kTileD, tile, nrows);
}

template <class T>
__global__ void __launch_bounds__(256) l2norm_rows128_backward_kernel(const T* __restrict__ x,
                                                                      const float* __restrict__ rstd,
                                                                      const T* __restrict__ dy, T* __restrict__ dx,
                                                                      int64_t rows) {
  __shared__ __align__(16) T xt[kTileRows * kTileD];
  __shared__ __align__(16) T gt[kTileRows * kTileD];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int nrows = static_cast<int>(rows - row0 < kTileRows ? rows - row0 : kTileRows);
  copy_tile_rows(xt, x + row0 * kTileD, nrows);
  copy_tile_rows(gt, dy + row0 * kTileD, nrows);
  __syncthreads();
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    const int r = 4 * w + rr;
    if (r >= nrows) break;
    const float rn = rstd[row0 + r];
    float yv[4], g[4];
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      yv[i] = load_f(xt + r * kTileD + lane + 32 * i) * rn;
      g[i] = load_f(gt + r * kTileD + lane + 32 * i);
      dot += yv[i] * g[i];
    }
    dot = warp_sum(dot);
#pragma unroll
    for (int i = 0; i < 4; ++i) store_f(gt + r * kTileD + lane + 32 * i, rn * (g[i] - yv[i] * dot));
  }
  __syncthreads();
  copy_tile_rows(dx + row0 * kTileD, gt, nrows);
}

// Whether the 128-element tile kernels take rows of 16-bit elements: D = 128, every pointer 16-byte aligned.
bool rows128(int64_t D, std::initializer_list<const void*> ptrs) {
  if (D != kTileD) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
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
    if constexpr (sizeof(T) == 2) {
      if (rows128(D, {x, y})) {
        const unsigned blocks = static_cast<unsigned>((rows + kTileRows - 1) / kTileRows);
        l2norm_rows128_kernel<T><<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
            static_cast<const T*>(x), static_cast<T*>(y), rstd, rows, eps);
        DELTACP_CUDA_CHECK_LAUNCH();
        return;
      }
    }
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
    if constexpr (sizeof(T) == 2) {
      if (rows128(D, {x, dy, dx})) {
        const unsigned blocks = static_cast<unsigned>((rows + kTileRows - 1) / kTileRows);
        l2norm_rows128_backward_kernel<T><<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
            static_cast<const T*>(x), rstd, static_cast<const T*>(dy), static_cast<T*>(dx), rows);
        DELTACP_CUDA_CHECK_LAUNCH();
        return;
      }
    }
    const unsigned blocks = static_cast<unsigned>((rows + 7) / 8);
    l2norm_rows_backward_kernel<T><<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(x), rstd, static_cast<const T*>(dy), static_cast<T*>(dx), rows, static_cast<int>(D));
    DELTACP_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace deltacp::cuda
