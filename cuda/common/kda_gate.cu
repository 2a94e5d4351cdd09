// cuda/common/kda_gate.cu — kda's gate from the raw g (FLA's use_gate_in_kernel; kda_gate.cuh has the formula):
//
//   kda_gate                 into fp32 workspace, one pass: what the naive and tiled forwards read in place of the
//                            raw g (cuda/dispatch.cu, run_forward_on_gated). The fused forward does not run it: its
//                            token-parallel stage applies the same kda_gate_value where it sums the gate within each
//                            chunk, so the gate never goes through HBM.
//   kda_gate_rows(_backward) the gate as a differentiable op (deltacp/_kda_gate.py) for calls with a gradient: one
//                            pass each way, where torch's expression makes about five (cast, add, multiply, sigmoid,
//                            scale) forward and as many backward, each over fp32 [B, T, HV, K].
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "check.h"
#include "deltacp/cuda/api.h"
#include "deltacp/error.h"
#include "kda_gate.cuh"
#include "load_store.cuh"

namespace deltacp::cuda {
namespace {

// One thread per element of g [B, T, HV, K] (any strides but the last), out contiguous.
template <class T>
__global__ void __launch_bounds__(256) kda_gate_kernel(const T* __restrict__ g, int64_t sb, int64_t st, int64_t sh,
                                                       int64_t T_, int64_t HV, int64_t K, int64_t n,
                                                       const float* __restrict__ A_log,
                                                       const float* __restrict__ dt_bias, float lower_bound,
                                                       float* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t k = i % K, row = i / K, h = row % HV, t = (row / HV) % T_, b = row / (HV * T_);
    const float x = load_f(g + b * sb + t * st + h * sh + k);
    out[i] = kda_gate_value(x, expf(A_log[h]), dt_bias != nullptr ? dt_bias[h * K + k] : 0.f, lower_bound);
  }
}

// The gate as a differentiable op of its own (deltacp/_kda_gate.py: training, where the kernels' in-kernel gate
// does not apply): rows = B * T * HV contiguous rows of K, row r of head r % HV. One warp per row.
template <class T>
__global__ void __launch_bounds__(256) kda_gate_rows_kernel(const T* __restrict__ g, float* __restrict__ y,
                                                            int64_t rows, int64_t HV, int K,
                                                            const float* __restrict__ A_log,
                                                            const float* __restrict__ dt_bias, float lower_bound) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int64_t h = row % HV;
  const float a = expf(A_log[h]);
  for (int k = threadIdx.x & 31; k < K; k += 32)
    y[row * K + k] = kda_gate_value(load_f(g + row * K + k), a, dt_bias != nullptr ? dt_bias[h * K + k] : 0.f,
                                    lower_bound);
}

// dx (fp32, [rows, K]: the raw gate's gradient and, summed over rows of a head, dt_bias's) and dA[row] = the row's
// sum of dg d(gate)/d(A_log) (A_log's gradient is their sum over a head's rows).
template <class T>
__global__ void __launch_bounds__(256) kda_gate_rows_backward_kernel(const T* __restrict__ g, const float* __restrict__ dg,
                                                                     float* __restrict__ dx, float* __restrict__ dA,
                                                                     int64_t rows, int64_t HV, int K,
                                                                     const float* __restrict__ A_log,
                                                                     const float* __restrict__ dt_bias,
                                                                     float lower_bound) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int lane = threadIdx.x & 31;
  const int64_t h = row % HV;
  const float a = expf(A_log[h]);
  float acc = 0.f;
  for (int k = lane; k < K; k += 32) {
    float d = 0.f;
    acc += kda_gate_grad(load_f(g + row * K + k), a, dt_bias != nullptr ? dt_bias[h * K + k] : 0.f, lower_bound,
                         dg[row * K + k], &d);
    dx[row * K + k] = d;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) dA[row] = acc;
}

}  // namespace

void kda_gate_rows(const void* g, DType gate_dtype, float* y, int64_t rows, int64_t HV, int64_t K, const float* A_log,
                   const float* dt_bias, float lower_bound, void* stream) {
  DELTACP_CHECK(rows >= 0 && HV > 0 && K > 0 && rows % HV == 0, "g", "expected rows of B * T * HV, got ", rows,
                " rows for HV = ", HV);
  if (rows == 0) return;
  dispatch_dtype(gate_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    kda_gate_rows_kernel<T><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const T*>(g), y, rows, HV, static_cast<int>(K), A_log, dt_bias, lower_bound);
  });
  DELTACP_CUDA_CHECK_LAUNCH();
}

void kda_gate_rows_backward(const void* g, DType gate_dtype, const float* dg, float* dx, float* dA, int64_t rows,
                            int64_t HV, int64_t K, const float* A_log, const float* dt_bias, float lower_bound,
                            void* stream) {
  DELTACP_CHECK(rows >= 0 && HV > 0 && K > 0 && rows % HV == 0, "g", "expected rows of B * T * HV, got ", rows,
                " rows for HV = ", HV);
  if (rows == 0) return;
  dispatch_dtype(gate_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    kda_gate_rows_backward_kernel<T>
        <<<static_cast<unsigned>((rows + 7) / 8), 256, 0, static_cast<cudaStream_t>(stream)>>>(
            static_cast<const T*>(g), dg, dx, dA, rows, HV, static_cast<int>(K), A_log, dt_bias, lower_bound);
  });
  DELTACP_CUDA_CHECK_LAUNCH();
}

void kda_gate(const Params& p, float* out, void* stream) {
  DELTACP_CHECK(p.variant == Variant::kda && p.gate_in_kernel(), "A_log",
                "internal: the in-kernel gate is kda's and needs A_log");
  const int64_t n = p.B * p.T * p.HV * p.K;
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 8192));
  auto launch = [&](auto* g) {
    kda_gate_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
        g, p.g.stride_b, p.g.stride_t, p.g.stride_h, p.T, p.HV, p.K, n, p.gate_A_log, p.gate_dt_bias,
        p.gate_lower_bound, out);
  };
  dispatch_dtype(p.gate_dtype(), [&](auto tag) {  // g in fp32 or in q's 16-bit type
    using T = typename decltype(tag)::type;
    launch(static_cast<const T*>(p.g.ptr));
  });
  DELTACP_CUDA_CHECK_LAUNCH();
}

}  // namespace deltacp::cuda
