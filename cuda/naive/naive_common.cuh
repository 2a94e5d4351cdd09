// cuda/naive/naive_common.cuh — pieces shared by the naive tier's forward and backward kernels.
//
// The naive tier runs the token recurrence of docs/design.md section 2 directly:
//
//   gdn, kda, delta:  Sd = D_t S_{t-1};  u = beta_t (v_t - Sd^T k_t);  S_t = Sd + k_t u^T
//   dplr:             S_t = D_t S_{t-1} + k_t v_t^T + b_t (a_t^T S_{t-1})
//   all:              o_t = S_t^T (scale q_t)
//
// Column j of the state (value index j) evolves on its own given the key-side vectors of the
// token (k, q, D, a, b, beta): every coupling is a K-vector dot product down one column
// (k . S[:, j], a . S[:, j]). So the work splits over value columns with no communication:
//
//   block  = one (sequence n, value head hv, tile of value columns)
//   warp   = CPW = 32 / KPT columns of that tile
//   lane   = rows lane, lane + 32, ..., lane + 32 (KPT - 1) of each of its columns, in registers
//
// The column dot products are warp sums (shuffles, fixed order: deterministic). KPT (rows per
// lane) is 4 for K <= 128 and 8 for K <= 256: the only compile-time size; K, V are runtime, rows
// >= K and columns >= V are masked. This file holds the device views of Params, the per-token
// loads of the key-side vectors and the one-column forward step.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../common/load_store.cuh"
#include "deltacp/error.h"
#include "deltacp/params.h"

namespace deltacp::cuda::naive {

constexpr int kWarpSize = 32;
constexpr int64_t kMaxK = 256;  // KPT = 8 rows per lane

// A [B, T, heads, D] view on the device: base pointer and int64 element strides (D contiguous).
template <class T>
struct Strided {
  T* ptr = nullptr;
  int64_t stride_b = 0, stride_t = 0, stride_h = 0;
  __device__ __forceinline__ T* at(int64_t b, int64_t t, int64_t h) const {
    return ptr + b * stride_b + t * stride_t + h * stride_h;
  }
};

template <class T>
inline Strided<T> strided(const TensorRef& r) {
  return Strided<T>{static_cast<T*>(r.ptr), r.stride_b, r.stride_t, r.stride_h};
}

// The forward inputs as the kernels see them (element type E = float, __nv_bfloat16 or __half).
template <class E>
struct Inputs {
  Strided<const E> q, k, v, g, beta, a, b;
  Strided<const float> g32;  // g when Params::g_fp32 (the log decay kept in fp32 beside 16-bit inputs)
  bool g_fp32 = false;
  const float* h0 = nullptr;          // [N, HV, K, V] fp32, or null (zero initial state)
  const int64_t* cu_seqlens = nullptr;  // device [N + 1], or null for a fixed-length batch
  int64_t T = 0, HV = 0, K = 0, V = 0;
  int64_t group = 1;  // HV / H: value heads per query/key head; query head of hv = hv / group
  float scale = 1.f;
};

template <class T>
inline Inputs<T> make_inputs(const Params& p) {
  Inputs<T> in;
  in.q = strided<const T>(p.q);
  in.k = strided<const T>(p.k);
  in.v = strided<const T>(p.v);
  in.g = strided<const T>(p.g);
  in.g32 = strided<const float>(p.g);
  in.g_fp32 = p.g_fp32;
  in.beta = strided<const T>(p.beta);
  in.a = strided<const T>(p.a);
  in.b = strided<const T>(p.b);
  in.h0 = static_cast<const float*>(p.h0);
  in.cu_seqlens = p.varlen() ? p.cu_seqlens : nullptr;
  in.T = p.T;
  in.HV = p.HV;
  in.K = p.K;
  in.V = p.V;
  in.group = p.HV / p.H;
  in.scale = static_cast<float>(p.scale);
  return in;
}

// Sequence n: row `batch` of the [B, T] time axis, tokens [bos, eos).
struct Span {
  int64_t batch, bos, eos;
};
__device__ __forceinline__ Span sequence_span(const int64_t* cu_seqlens, int64_t n, int64_t T) {
  return cu_seqlens ? Span{0, cu_seqlens[n], cu_seqlens[n + 1]} : Span{n, 0, T};
}

// Sum over the 32 lanes of a warp; every lane receives the same value (butterfly, fixed order).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// The key-side vectors of one token, the lane's KPT rows of each (zero beyond K).
template <int KPT>
struct TokenKeys {
  float q[KPT];    // scale * q_t (so o = q . S and dS += q do^T need no extra multiply)
  float k[KPT];    // k_t
  float dec[KPT];  // D_t = e^{g_t} per row (gdn: the scalar broadcast; delta: unused)
  float a[KPT];    // dplr only
  float b[KPT];    // dplr only
  float beta;      // gdn, kda, delta
};

// Element `row` of g at (batch, t, hv), in g's own dtype.
template <class T>
__device__ __forceinline__ float load_gate(const Inputs<T>& in, int64_t batch, int64_t t, int64_t hv, int64_t row) {
  return in.g_fp32 ? in.g32.at(batch, t, hv)[row] : load_f(in.g.at(batch, t, hv) + row);
}

// Loads token t (on row `batch`) of query/key head h and value head hv. With kWithQ false the
// query is skipped (the backward's forward recompute does not need it).
template <Variant VAR, bool kWithQ, int KPT, class T>
__device__ __forceinline__ void load_token(TokenKeys<KPT>& tk, const Inputs<T>& in, int64_t batch, int64_t t,
                                           int64_t h, int64_t hv, int lane) {
  const T* kp = in.k.at(batch, t, h);
  const T* qp = in.q.at(batch, t, h);
  float gate = 0.f;
  if constexpr (VAR == Variant::gdn) gate = expf(load_gate(in, batch, t, hv, 0));
#pragma unroll
  for (int i = 0; i < KPT; ++i) {
    const int64_t row = lane + kWarpSize * i;
    const bool ok = row < in.K;
    tk.k[i] = ok ? load_f(kp + row) : 0.f;
    if constexpr (kWithQ) tk.q[i] = ok ? in.scale * load_f(qp + row) : 0.f;
    if constexpr (VAR == Variant::gdn) tk.dec[i] = gate;
    if constexpr (VAR == Variant::kda || VAR == Variant::dplr)
      tk.dec[i] = ok ? expf(load_gate(in, batch, t, hv, row)) : 0.f;
    if constexpr (VAR == Variant::dplr) {
      tk.a[i] = ok ? load_f(in.a.at(batch, t, hv) + row) : 0.f;
      tk.b[i] = ok ? load_f(in.b.at(batch, t, hv) + row) : 0.f;
    }
  }
  if constexpr (VAR != Variant::dplr) tk.beta = load_f(in.beta.at(batch, t, hv));
}

// One token forward on one column: s = the lane's rows of S_{t-1}[:, j] in, S_t[:, j] out.
// vj = v_t[j]. Every lane of the warp must call it (warp sums inside).
template <Variant VAR, int KPT>
__device__ __forceinline__ void step_column(float (&s)[KPT], const TokenKeys<KPT>& tk, float vj) {
  if constexpr (VAR == Variant::dplr) {
    float readout = 0.f;  // a_t . S_{t-1}[:, j]
#pragma unroll
    for (int i = 0; i < KPT; ++i) readout += tk.a[i] * s[i];
    readout = warp_sum(readout);
#pragma unroll
    for (int i = 0; i < KPT; ++i) s[i] = tk.dec[i] * s[i] + tk.k[i] * vj + tk.b[i] * readout;
  } else {
    float pred = 0.f;  // k_t . Sd[:, j]
#pragma unroll
    for (int i = 0; i < KPT; ++i) {
      if constexpr (VAR != Variant::delta) s[i] *= tk.dec[i];
      pred += tk.k[i] * s[i];
    }
    pred = warp_sum(pred);
    const float u = tk.beta * (vj - pred);
#pragma unroll
    for (int i = 0; i < KPT; ++i) s[i] += tk.k[i] * u;
  }
}

// State [N, HV, K, V] fp32, row-major K x V per (n, hv): element (row, col).
__device__ __forceinline__ int64_t state_index(int64_t n, int64_t hv, int64_t row, int64_t col, int64_t HV,
                                               int64_t K, int64_t V) {
  return ((n * HV + hv) * K + row) * V + col;
}

// Loads the lane's rows of CPW columns col0 .. col0 + CPW - 1 of a state (zero when null or out of range).
template <int CPW, int KPT>
__device__ __forceinline__ void load_state_columns(float (&s)[CPW][KPT], const float* state, int64_t n, int64_t hv,
                                                   int64_t col0, int lane, int64_t HV, int64_t K, int64_t V) {
#pragma unroll
  for (int c = 0; c < CPW; ++c)
#pragma unroll
    for (int i = 0; i < KPT; ++i) {
      const int64_t row = lane + kWarpSize * i, col = col0 + c;
      s[c][i] = (state && row < K && col < V) ? state[state_index(n, hv, row, col, HV, K, V)] : 0.f;
    }
}

template <int CPW, int KPT>
__device__ __forceinline__ void store_state_columns(float* state, const float (&s)[CPW][KPT], int64_t n,
                                                    int64_t hv, int64_t col0, int lane, int64_t HV, int64_t K,
                                                    int64_t V) {
#pragma unroll
  for (int c = 0; c < CPW; ++c)
#pragma unroll
    for (int i = 0; i < KPT; ++i) {
      const int64_t row = lane + kWarpSize * i, col = col0 + c;
      if (row < K && col < V) state[state_index(n, hv, row, col, HV, K, V)] = s[c][i];
    }
}

// ---- host dispatch helpers ------------------------------------------------------------------
template <Variant V>
using VariantTag = std::integral_constant<Variant, V>;

// Calls f(VariantTag<v>{}) so a launcher can use the variant as a template argument.
template <class F>
inline void dispatch_variant(Variant v, F&& f) {
  switch (v) {
    case Variant::delta: f(VariantTag<Variant::delta>{}); return;
    case Variant::gdn: f(VariantTag<Variant::gdn>{}); return;
    case Variant::kda: f(VariantTag<Variant::kda>{}); return;
    case Variant::dplr: f(VariantTag<Variant::dplr>{}); return;
  }
  throw_error("variant", "expected delta, gdn, kda or dplr, got ", static_cast<int>(v));
}

// Rows per lane for a key dimension: 4 (K <= 128) or 8 (K <= 256); deltacp::Error naming 'K' beyond.
inline int rows_per_lane(int64_t K) {
  DELTACP_CHECK(K >= 1 && K <= kMaxK, "K", "expected 1 <= K <= ", kMaxK, " for the naive tier, got ", K);
  return K <= 128 ? 4 : 8;
}

}  // namespace deltacp::cuda::naive
