// cuda/common/finite_check.cu — the device side of the numeric checks (finite_check.h).
//
// One kernel walks a strided [B, T, heads, D] view (states: a contiguous run) with a grid-stride loop
// and records the smallest flat index of a bad element by atomicMin; the host copies that index back,
// decodes it to [b, t, h, d], reads the one element and formats the message the CPU reference gives.
#include "finite_check.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "check.h"
#include "deltacp/dtype.h"
#include "deltacp/error.h"
#include "deltacp/validate.h"
#include "load_store.cuh"
#include "workspace_pool.h"

namespace deltacp::cuda {
namespace {

constexpr unsigned long long kNone = ~0ull;

template <class T>
__global__ void first_bad_kernel(const T* __restrict__ ptr, int64_t n, int64_t T_, int64_t heads, int64_t D,
                                 int64_t sb, int64_t st, int64_t sh, bool log_decay,
                                 unsigned long long* __restrict__ first) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = i % D, h = (i / D) % heads, t = (i / (D * heads)) % T_, b = i / (D * heads * T_);
    const float x = load_f(ptr + b * sb + t * st + h * sh + d);
    if (!isfinite(x) || (log_decay && x > 0.f)) atomicMin(first, static_cast<unsigned long long>(i));
  }
}

size_t element_bytes(DType dt) { return dt == DType::f64 ? 8 : dt == DType::f32 ? 4 : 2; }

struct View {
  const void* ptr;
  DType dtype;
  int64_t B, T, heads, D, sb, st, sh;
};

View tensor_view(const Params& p, const TensorRef& t, int64_t heads, int64_t D, DType dt) {
  return View{t.ptr, dt, p.B, p.T, heads, D, t.stride_b, t.stride_t, t.stride_h};
}
View state_view(const Params& p, const void* ptr) {
  const int64_t n = p.state_elems();
  return View{ptr, p.state_dtype, 1, 1, 1, n, 0, 0, n};
}

// The flat index of the first bad element of v, or -1. Synchronises the stream.
int64_t first_bad(const View& v, bool log_decay, cudaStream_t stream) {
  const int64_t n = v.B * v.T * v.heads * v.D;
  if (v.ptr == nullptr || n == 0) return -1;
  auto* flag = static_cast<unsigned long long*>(workspace_alloc(sizeof(unsigned long long), stream));
  DELTACP_CUDA_CHECK(cudaMemsetAsync(flag, 0xff, sizeof(unsigned long long), stream));
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 4096));
  dispatch_dtype(v.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    first_bad_kernel<T><<<blocks, threads, 0, stream>>>(static_cast<const T*>(v.ptr), n, v.T, v.heads, v.D, v.sb,
                                                         v.st, v.sh, log_decay, flag);
  });
  DELTACP_CUDA_CHECK_LAUNCH();
  unsigned long long found = kNone;
  DELTACP_CUDA_CHECK(cudaMemcpyAsync(&found, flag, sizeof found, cudaMemcpyDeviceToHost, stream));
  DELTACP_CUDA_CHECK(cudaStreamSynchronize(stream));
  workspace_free(flag, stream);
  return found == kNone ? -1 : static_cast<int64_t>(found);
}

// Throws NumericError for the first bad element of v, if any ("input", "output" or "gradient").
void check_view(const View& v, const char* name, const char* what, bool log_decay, cudaStream_t stream) {
  const int64_t i = first_bad(v, log_decay, stream);
  if (i < 0) return;
  const int64_t d = i % v.D, h = (i / v.D) % v.heads, t = (i / (v.D * v.heads)) % v.T, b = i / (v.D * v.heads * v.T);
  const int64_t offset = b * v.sb + t * v.st + h * v.sh + d;
  const size_t bytes = element_bytes(v.dtype);
  unsigned char buf[8] = {};
  DELTACP_CUDA_CHECK(cudaMemcpy(buf, static_cast<const unsigned char*>(v.ptr) + offset * bytes, bytes,
                                cudaMemcpyDeviceToHost));
  const double x = load_as<double>(buf, 0, v.dtype);
  const bool is_state = v.B == 1 && v.T == 1 && v.heads == 1;
  const std::string where = is_state ? "flat index " + std::to_string(i) + " of [N, HV, K, V]"
                                     : "[" + std::to_string(b) + ", " + std::to_string(t) + ", " + std::to_string(h) +
                                           ", " + std::to_string(d) + "]";
  if (std::isfinite(x) && log_decay) throw NumericError(name, positive_gate_message(x, where));
  throw NumericError(name, nonfinite_message(what, x, where));
}

bool per_key_gate(Variant v) { return v == Variant::kda || v == Variant::dplr; }

// The checks read a flag back and synchronise the stream, which a stream capture (torch.cuda.graph) cannot
// record: refused by name before any of it is issued, so the capture stays valid and the caller learns why.
void refuse_under_capture(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();  // the legacy stream while another stream captures: not checkable either
    status = cudaStreamCaptureStatusActive;
  }
  DELTACP_CHECK(status == cudaStreamCaptureStatusNone, "DELTACP_CHECK",
                "the numeric checks copy a result to the host and synchronise the stream, which a CUDA graph "
                "capture cannot record; unset DELTACP_CHECK (or set it to 0) while capturing");
}

}  // namespace

bool numeric_checks_requested() {
  const char* s = std::getenv("DELTACP_CHECK");
  return s != nullptr && s[0] != '\0' && std::strcmp(s, "0") != 0;
}

void check_inputs_on_device(const Params& p, bool backward) {
  auto stream = static_cast<cudaStream_t>(p.stream);
  refuse_under_capture(stream);
  const int64_t gdim = per_key_gate(p.variant) ? p.K : 1;
  // A raw in-kernel gate (Params::gate_A_log) may be positive: only its finiteness is checked.
  const bool decay = (p.variant == Variant::gdn || p.variant == Variant::kda) && !p.gate_in_kernel();
  check_view(tensor_view(p, p.q, p.H, p.K, p.dtype), "q", "input", false, stream);
  check_view(tensor_view(p, p.k, p.H, p.K, p.dtype), "k", "input", false, stream);
  check_view(tensor_view(p, p.v, p.HV, p.V, p.dtype), "v", "input", false, stream);
  check_view(tensor_view(p, p.g, p.HV, gdim, p.gate_dtype()), p.variant == Variant::dplr ? "gk" : "g", "input", decay,
             stream);
  check_view(tensor_view(p, p.beta, p.HV, 1, p.dtype), "beta", "input", false, stream);
  check_view(tensor_view(p, p.a, p.HV, p.K, p.dtype), "a", "input", false, stream);
  check_view(tensor_view(p, p.b, p.HV, p.K, p.dtype), "b", "input", false, stream);
  check_view(state_view(p, p.h0), "initial_state", "input", false, stream);
  if (backward) {
    check_view(tensor_view(p, p.dout, p.HV, p.V, p.dtype), "do", "input", false, stream);
    check_view(state_view(p, p.dht), "dht", "input", false, stream);
  }
}

void check_outputs_on_device(const Params& p, bool backward) {
  auto stream = static_cast<cudaStream_t>(p.stream);
  refuse_under_capture(stream);
  if (!backward) {
    check_view(tensor_view(p, p.o, p.HV, p.V, p.dtype), "o", "output", false, stream);
    check_view(state_view(p, p.ht), "ht", "output", false, stream);
    return;
  }
  const int64_t gdim = per_key_gate(p.variant) ? p.K : 1;
  check_view(tensor_view(p, p.dq, p.H, p.K, p.dtype), "dq", "gradient", false, stream);
  check_view(tensor_view(p, p.dk, p.H, p.K, p.dtype), "dk", "gradient", false, stream);
  check_view(tensor_view(p, p.dv, p.HV, p.V, p.dtype), "dv", "gradient", false, stream);
  check_view(tensor_view(p, p.dg, p.HV, gdim, p.gate_dtype()), p.variant == Variant::dplr ? "dgk" : "dg", "gradient",
             false, stream);
  check_view(tensor_view(p, p.dbeta, p.HV, 1, p.dtype), "dbeta", "gradient", false, stream);
  check_view(tensor_view(p, p.da, p.HV, p.K, p.dtype), "da", "gradient", false, stream);
  check_view(tensor_view(p, p.db, p.HV, p.K, p.dtype), "db", "gradient", false, stream);
  check_view(state_view(p, p.dh0), "dh0", "gradient", false, stream);
}

}  // namespace deltacp::cuda
