// distributed/src/cp_kernels.cu — the CP pre-pass and merge kernels (algorithm: cp_body.h).
//
//   prep   grid (chunks, value heads)       the WY factors of each chunk -> fp32 workspace (parallel)
//   scan   grid (column tiles, value heads)  [H | M] (or [dH | M^T]) tile in shared memory, serial over
//                                            chunks: the V + K columns evolve independently
//   merge  grid (column tiles, value heads)  S <- A_j S + B_j over the gathered ranks, fp32
//
// Measured (2 x NVIDIA H200, 2026-11-22, bf16 GDN, H = 16, K = V = 128, 32768 tokens per rank):
// pre-pass 51.8 ms against a 7.4 ms local forward: these plain fp32 loops are the CP bottleneck
// (their time measured by bench/cp/bench_cp.py). Correct: within 2.2e-7 of the reference on GPUs
// (distributed/tests/run_gpu_cp.sh) and checked on the host by cp_body_host_test.
#include <cuda_runtime.h>

#include <string>

#include "deltacp/distributed/cp.h"
#include "deltacp/error.h"

namespace deltacp::dist {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kScanCols = 32;   // columns of [H | M] per scan block
constexpr int64_t kMergeCols = 32;  // columns of S per merge block

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("deltacp: CUDA error in ") + what + ": " +
                                                 cudaGetErrorString(e));
}

__global__ void prep_kernel(Span s, Work w, bool backward) {
  extern __shared__ float smem[];
  prep_body(Lane{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)}, s, w, blockIdx.x, blockIdx.y,
            backward, smem);
}

__global__ void scan_kernel(Span s, Work w, bool backward, const float* init, float* out) {
  extern __shared__ float smem[];
  scan_body(Lane{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)}, s, w, blockIdx.y,
            static_cast<int64_t>(blockIdx.x) * kScanCols, kScanCols, backward, init, out, smem);
}

__global__ void merge_kernel(const float* gathered, int64_t HV, int64_t K, int64_t V, int64_t first, int64_t count,
                             int64_t step, float* out) {
  extern __shared__ float smem[];
  merge_body(Lane{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)}, gathered, HV, K, V, blockIdx.y,
             static_cast<int64_t>(blockIdx.x) * kMergeCols, kMergeCols, first, count, step, out, smem);
}

// Opts the kernel into `bytes` of dynamic shared memory, or throws naming K when the device has less.
template <class Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  int device = 0, optin = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "attribute");
  DELTACP_CHECK(bytes <= static_cast<size_t>(optin), "K",
                "the CP pre-pass needs ", bytes, " bytes of shared memory per block for this K and chunk size, "
                "the device allows ", optin, "; use a smaller chunk_size");
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
             "cudaFuncSetAttribute");
}

void check_span(const Span& s) {
  DELTACP_CHECK(s.n >= 1, "T", "expected a span of at least one token, got ", s.n);
  DELTACP_CHECK(s.K >= 1 && s.V >= 1, "K", "expected K, V >= 1, got K = ", s.K, ", V = ", s.V);
  DELTACP_CHECK(s.H >= 1 && s.HV % s.H == 0, "HV", "expected HV a multiple of H = ", s.H, ", got ", s.HV);
  DELTACP_CHECK(s.HV <= 65535, "HV", "expected at most 65535 value heads, got ", s.HV);
  DELTACP_CHECK(s.chunk == 16 || s.chunk == 32 || s.chunk == 64, "chunk_size", "expected 16, 32 or 64, got ",
                s.chunk);
  DELTACP_CHECK(s.variant >= kDelta && s.variant <= kDplr, "variant", "expected 0..3, got ", s.variant);
  DELTACP_CHECK(s.dtype >= kF64 && s.dtype <= kF16, "dtype", "expected 0..3, got ", s.dtype);
  DELTACP_CHECK(s.g_dtype == -1 || s.g_dtype == s.dtype || s.g_dtype == kF32, "g",
                "expected g in the inputs' dtype or float32, got dtype code ", s.g_dtype);
}

void run_prepass(const Span& s, bool backward, const float* init, float* out, void* stream_ptr) {
  check_span(s);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t NC = s.nchunks(), K = s.K, V = s.V, HV = s.HV;
  const int64_t rows = (s.variant == kDplr && !backward) ? 2 * s.chunk : s.chunk;
  const int64_t nrows = HV * NC * rows;
  // One allocation for the whole workspace: Wx, Kbx, Qg [nrows, K]; Ux, dO [nrows, V]; d [HV * NC, K].
  const size_t floats = static_cast<size_t>(nrows) * (3 * K + 2 * V) + static_cast<size_t>(HV * NC * K);
  float* base = nullptr;
  cuda_check(cudaMallocAsync(reinterpret_cast<void**>(&base), floats * sizeof(float), stream), "cudaMallocAsync");
  Work w;
  w.rows = rows;
  w.Wx = base;
  w.Kbx = w.Wx + nrows * K;
  w.Qg = w.Kbx + nrows * K;
  w.Ux = w.Qg + nrows * K;
  w.dO = w.Ux + nrows * V;
  w.d = w.dO + nrows * V;

  const size_t prep_bytes = prep_smem_floats(s.chunk, K, s.variant, backward) * sizeof(float);
  allow_smem(prep_kernel, prep_bytes);
  prep_kernel<<<dim3(static_cast<unsigned>(NC), static_cast<unsigned>(HV)), kThreads, prep_bytes, stream>>>(
      s, w, backward);
  cuda_check(cudaGetLastError(), "prep_kernel launch");

  const size_t scan_bytes = scan_smem_floats(rows, K, kScanCols) * sizeof(float);
  allow_smem(scan_kernel, scan_bytes);
  const int64_t tiles = (V + K + kScanCols - 1) / kScanCols;
  scan_kernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(HV)), kThreads, scan_bytes, stream>>>(
      s, w, backward, init, out);
  cuda_check(cudaGetLastError(), "scan_kernel launch");
  cuda_check(cudaFreeAsync(base, stream), "cudaFreeAsync");
}

}  // namespace

void prepass_forward(const Span& s, const float* start, float* out, void* stream) {
  run_prepass(s, false, start, out, stream);
}

void prepass_backward(const Span& s, const float* dend, float* out, void* stream) {
  DELTACP_CHECK(s.dout.ptr != nullptr, "do", "expected the upstream gradient of the span, got none");
  run_prepass(s, true, dend, out, stream);
}

void merge(const float* gathered, int64_t HV, int64_t K, int64_t V, int64_t first, int64_t count, int64_t step,
           float* out, void* stream_ptr) {
  DELTACP_CHECK(count >= 0, "count", "expected >= 0, got ", count);
  DELTACP_CHECK(step == 1 || step == -1, "step", "expected +1 or -1, got ", step);
  DELTACP_CHECK(HV >= 1 && HV <= 65535, "HV", "expected 1..65535, got ", HV);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const size_t bytes = merge_smem_floats(K, kMergeCols) * sizeof(float);
  allow_smem(merge_kernel, bytes);
  const int64_t tiles = (V + kMergeCols - 1) / kMergeCols;
  merge_kernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(HV)), kThreads, bytes, stream>>>(
      gathered, HV, K, V, first, count, step, out);
  cuda_check(cudaGetLastError(), "merge_kernel launch");
}

}  // namespace deltacp::dist
