// cuda/common/gate_range.cu — the range pass of safe_gate's check (gate_range.h), for every forward whose kernels do
// not fold it in: one read of g, each thread's smallest and largest key, a warp and a block reduction, two atomics
// per block into Params::gate_range.
#include "gate_range.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "check.h"
#include "gate_range.cuh"

namespace deltacp::cuda {
namespace {

__device__ __forceinline__ float gate_to_float(float x) { return x; }
__device__ __forceinline__ float gate_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float gate_to_float(__half x) { return __half2float(x); }

// Elements (row r, column d) of rows = B * T * HV rows of `width` values each; row r = (b, t, h) by its strides.
template <class G>
__global__ void gate_range_kernel(const G* g, int64_t sb, int64_t st, int64_t sh, int64_t T, int64_t HV,
                                  int64_t width, int64_t rows, int* range) {
  int lo = INT_MAX, hi = INT_MIN;
  const int64_t n = rows * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, d = i - r * width;
    const int64_t bt = r / HV, h = r - bt * HV, b = bt / T, t = bt - b * T;
    const int key = gate_order_key(gate_to_float(g[b * sb + t * st + h * sh + d]));
    lo = min(lo, key);
    hi = max(hi, key);
  }
  warp_key_range(lo, hi);
  __shared__ int part[2][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  if (lane == 0) {
    part[0][warp] = lo;
    part[1][warp] = hi;
  }
  __syncthreads();
  if (warp == 0) {
    lo = lane < warps ? part[0][lane] : INT_MAX;
    hi = lane < warps ? part[1][lane] : INT_MIN;
    warp_key_range(lo, hi);
    if (lane == 0) publish_key_range(range, lo, hi);
  }
}

template <class G>
void launch(const Params& p, cudaStream_t stream) {
  const int64_t width = p.variant == Variant::gdn ? 1 : p.K;
  const int64_t rows = p.B * p.T * p.HV, n = rows * width;
  if (n == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 4096);
  gate_range_kernel<G><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const G*>(p.g.ptr), p.g.stride_b, p.g.stride_t, p.g.stride_h, p.T, p.HV, width, rows, p.gate_range);
  DELTACP_CUDA_CHECK_LAUNCH();
}

}  // namespace

void gate_range_init(int* range, cudaStream_t stream) {
  DELTACP_CUDA_CHECK(cudaMemsetAsync(range, 0x7f, sizeof(int), stream));
  DELTACP_CUDA_CHECK(cudaMemsetAsync(range + 1, 0x80, sizeof(int), stream));
}

void gate_range_pass(const Params& p, cudaStream_t stream) {
  DELTACP_CHECK(p.g.ptr != nullptr, "g", "safe_gate's range check needs the log decay g");
  const DType gate_dtype = p.g_fp32 ? DType::f32 : p.dtype;
  switch (gate_dtype) {
    case DType::f32: launch<float>(p, stream); return;
    case DType::bf16: launch<__nv_bfloat16>(p, stream); return;
    case DType::f16: launch<__half>(p, stream); return;
    default: throw_error("g", "safe_gate's range check on the GPU takes a float32, bfloat16 or float16 g");
  }
}

}  // namespace deltacp::cuda
