// cuda/attention/ring_step.cu — ring attention's per-step kernels (see ring_step.h).
//
// Work split. Forward and dQ: a CTA of 8 warps owns 16 query rows of one (batch, head), each warp 2
// rows held in registers (lane l keeps dims l, l + 32, ...: D / 32 values per row); the CTA walks the
// key block in tiles of 32 keys staged in shared memory as fp32, and each warp scores its rows against
// every key of the tile (a dot product reduced across the warp by shuffles). dK/dV: the same with the
// roles swapped: a CTA owns 16 key rows of one (batch, key/value head) and walks the query rows of
// every query head of its group, so each dK/dV row has one writer (no atomics).
//
// Causal skipping: a tile whose smallest key position exceeds the largest query position of the CTA
// (forward, dQ) — or whose largest query position is below the smallest key position (dK/dV) — is
// skipped whole; inside a tile the mask is per (row, key).
#include "attention/ring_step.h"

#include <cmath>

#include "common/check.h"
#include "common/load_store.cuh"

namespace deltacp::cuda::attention {

namespace {

constexpr int kWarps = 8;
constexpr int kRows = 2;  // rows per warp
constexpr int kRowsPerCta = kWarps * kRows;
constexpr int kTile = 32;  // keys (forward, dQ) or queries (dK/dV) per shared-memory tile
constexpr int kThreads = kWarps * 32;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Loads rows [t0, t0 + kTile) of a [B, T, heads, D] tensor (batch b, head h) into smem as fp32,
// times `mul`; rows past T become zeros.
template <class T, int D>
__device__ __forceinline__ void load_tile(float (*dst)[D], const T* src, const int64_t* s, int64_t b, int64_t h,
                                          int64_t t0, int64_t T_len, float mul) {
  for (int idx = threadIdx.x; idx < kTile * D; idx += kThreads) {
    const int j = idx / D, d = idx % D;
    const int64_t t = t0 + j;
    dst[j][d] = t < T_len ? load_f(src + b * s[0] + t * s[1] + h * s[2] + d) * mul : 0.f;
  }
}

// ---------------------------------------------------------------------------------------------
// forward: (o_acc, lse_acc) <- merge with this block
// ---------------------------------------------------------------------------------------------
template <class T, int D>
__global__ void __launch_bounds__(kThreads) ring_step_fwd_kernel(RingStepArgs a) {
  constexpr int P = D / 32;
  __shared__ float ks[kTile][D];
  __shared__ float vs[kTile][D];
  __shared__ int64_t kp[kTile];
  __shared__ int64_t q_max;
  const int64_t bh = blockIdx.y, b = bh / a.H, h = bh % a.H, hk = h / (a.H / a.HKV);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = int64_t(blockIdx.x) * kRowsPerCta;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);

  float qr[kRows][P], o[kRows][P], m[kRows], l[kRows];
  int64_t qp[kRows];
  bool live[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = row0 + warp * kRows + r;
    live[r] = i < a.Tq;
    qp[r] = live[r] ? a.qpos[i] : INT64_MIN;
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < P; ++c) {
      // the scale folded into q: s = (scale q) . k
      qr[r][c] = live[r] ? load_f(q + b * a.q_s[0] + i * a.q_s[1] + h * a.q_s[2] + lane + 32 * c) * a.scale : 0.f;
      o[r][c] = 0.f;
    }
  }
  if (threadIdx.x == 0) {
    int64_t mx = INT64_MIN;
    for (int64_t i = row0; i < row0 + kRowsPerCta && i < a.Tq; ++i) mx = max(mx, a.qpos[i]);
    q_max = mx;
  }
  for (int64_t j0 = 0; j0 < a.Tk; j0 += kTile) {
    __syncthreads();  // the previous tile is consumed
    if (threadIdx.x < kTile) kp[threadIdx.x] = j0 + threadIdx.x < a.Tk ? a.kpos[j0 + threadIdx.x] : INT64_MAX;
    __syncthreads();
    if (a.causal) {
      int64_t mn = INT64_MAX;
      for (int j = 0; j < kTile; ++j) mn = min(mn, kp[j]);
      if (mn > q_max) continue;  // every key of the tile after every query of the CTA (uniform)
    }
    load_tile<T, D>(ks, k, a.k_s, b, hk, j0, a.Tk, 1.f);
    load_tile<T, D>(vs, v, a.v_s, b, hk, j0, a.Tk, 1.f);
    __syncthreads();
    const int n = static_cast<int>(a.Tk - j0 < kTile ? a.Tk - j0 : kTile);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (!live[r]) continue;
      for (int j = 0; j < n; ++j) {
        if (a.causal && kp[j] > qp[r]) continue;
        float s = 0.f;
#pragma unroll
        for (int c = 0; c < P; ++c) s += qr[r][c] * ks[j][lane + 32 * c];
        s = warp_sum(s);
        const float m_new = fmaxf(m[r], s);
        const float corr = __expf(m[r] - m_new);  // m = -inf at first: corr = 0
        const float p = __expf(s - m_new);
        l[r] = l[r] * corr + p;
#pragma unroll
        for (int c = 0; c < P; ++c) o[r][c] = o[r][c] * corr + p * vs[j][lane + 32 * c];
        m[r] = m_new;
      }
    }
  }
  // Merge this block's (o / l, m + log l) into the accumulators.
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (!live[r] || l[r] == 0.f) continue;  // no visible key in this block: the merge is the identity
    const int64_t i = row0 + warp * kRows + r;
    const int64_t row = (b * a.H + h) * a.Tq + i;
    const float lse_b = m[r] + __logf(l[r]);
    const float lse_a = a.lse_acc[row];
    __syncwarp();  // every lane has read lse_acc before lane 0 writes it
    const float mx = fmaxf(lse_a, lse_b);
    const float L = mx + __logf(__expf(lse_a - mx) + __expf(lse_b - mx));
    const float wa = __expf(lse_a - L), wb = __expf(lse_b - L) / l[r];
    float* out = a.o_acc + row * D;
#pragma unroll
    for (int c = 0; c < P; ++c) out[lane + 32 * c] = wa * out[lane + 32 * c] + wb * o[r][c];
    if (lane == 0) a.lse_acc[row] = L;
  }
}

// ---------------------------------------------------------------------------------------------
// backward, dQ: dq_acc += scale sum_j dS_ij k_j with P = e^{S - lse}, dS = P (dO . v_j - delta)
// ---------------------------------------------------------------------------------------------
template <class T, int D>
__global__ void __launch_bounds__(kThreads) ring_step_dq_kernel(RingStepArgs a) {
  constexpr int P = D / 32;
  __shared__ float ks[kTile][D];
  __shared__ float vs[kTile][D];
  __shared__ int64_t kp[kTile];
  __shared__ int64_t q_max;
  const int64_t bh = blockIdx.y, b = bh / a.H, h = bh % a.H, hk = h / (a.H / a.HKV);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = int64_t(blockIdx.x) * kRowsPerCta;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  const T* dout = static_cast<const T*>(a.dout);

  float qr[kRows][P], dor[kRows][P], dq[kRows][P], lse[kRows], delta[kRows];
  int64_t qp[kRows];
  bool live[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = row0 + warp * kRows + r;
    const int64_t row = (b * a.H + h) * a.Tq + i;
    live[r] = i < a.Tq && isfinite(a.lse[row]);  // a row that saw no key at all has no gradient
    qp[r] = i < a.Tq ? a.qpos[i] : INT64_MIN;
    lse[r] = live[r] ? a.lse[row] : 0.f;
    delta[r] = live[r] ? a.delta[row] : 0.f;
#pragma unroll
    for (int c = 0; c < P; ++c) {
      qr[r][c] = live[r] ? load_f(q + b * a.q_s[0] + i * a.q_s[1] + h * a.q_s[2] + lane + 32 * c) * a.scale : 0.f;
      dor[r][c] = live[r] ? load_f(dout + b * a.do_s[0] + i * a.do_s[1] + h * a.do_s[2] + lane + 32 * c) : 0.f;
      dq[r][c] = 0.f;
    }
  }
  if (threadIdx.x == 0) {
    int64_t mx = INT64_MIN;
    for (int64_t i = row0; i < row0 + kRowsPerCta && i < a.Tq; ++i) mx = max(mx, a.qpos[i]);
    q_max = mx;
  }
  for (int64_t j0 = 0; j0 < a.Tk; j0 += kTile) {
    __syncthreads();
    if (threadIdx.x < kTile) kp[threadIdx.x] = j0 + threadIdx.x < a.Tk ? a.kpos[j0 + threadIdx.x] : INT64_MAX;
    __syncthreads();
    if (a.causal) {
      int64_t mn = INT64_MAX;
      for (int j = 0; j < kTile; ++j) mn = min(mn, kp[j]);
      if (mn > q_max) continue;
    }
    load_tile<T, D>(ks, k, a.k_s, b, hk, j0, a.Tk, 1.f);
    load_tile<T, D>(vs, v, a.v_s, b, hk, j0, a.Tk, 1.f);
    __syncthreads();
    const int n = static_cast<int>(a.Tk - j0 < kTile ? a.Tk - j0 : kTile);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (!live[r]) continue;
      for (int j = 0; j < n; ++j) {
        if (a.causal && kp[j] > qp[r]) continue;
        float s = 0.f, dp = 0.f;
#pragma unroll
        for (int c = 0; c < P; ++c) {
          s += qr[r][c] * ks[j][lane + 32 * c];
          dp += dor[r][c] * vs[j][lane + 32 * c];
        }
        s = warp_sum(s);
        dp = warp_sum(dp);
        const float ds = __expf(s - lse[r]) * (dp - delta[r]);
#pragma unroll
        for (int c = 0; c < P; ++c) dq[r][c] += ds * ks[j][lane + 32 * c];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (!live[r]) continue;
    const int64_t i = row0 + warp * kRows + r;
    float* out = a.dq_acc + ((b * a.H + h) * a.Tq + i) * D;
#pragma unroll
    for (int c = 0; c < P; ++c) out[lane + 32 * c] += a.scale * dq[r][c];
  }
}

// ---------------------------------------------------------------------------------------------
// backward, dK and dV of one key/value head: over the query heads of its group and all query rows,
//   dv_j += P_ij dO_i,  dk_j += scale dS_ij q_i
// ---------------------------------------------------------------------------------------------
template <class T, int D>
__global__ void __launch_bounds__(kThreads) ring_step_dkv_kernel(RingStepArgs a) {
  constexpr int P = D / 32;
  __shared__ float qs[kTile][D];  // scale q
  __shared__ float dos[kTile][D];
  __shared__ int64_t qp[kTile];
  __shared__ float lse_s[kTile], delta_s[kTile];
  __shared__ int64_t k_min;
  const int64_t bh = blockIdx.y, b = bh / a.HKV, hk = bh % a.HKV;
  const int64_t group = a.H / a.HKV;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = int64_t(blockIdx.x) * kRowsPerCta;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  const T* dout = static_cast<const T*>(a.dout);

  float kr[kRows][P], vr[kRows][P], dk[kRows][P], dv[kRows][P];
  int64_t kpos[kRows];
  bool live[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t j = row0 + warp * kRows + r;
    live[r] = j < a.Tk;
    kpos[r] = live[r] ? a.kpos[j] : INT64_MAX;
#pragma unroll
    for (int c = 0; c < P; ++c) {
      kr[r][c] = live[r] ? load_f(k + b * a.k_s[0] + j * a.k_s[1] + hk * a.k_s[2] + lane + 32 * c) : 0.f;
      vr[r][c] = live[r] ? load_f(v + b * a.v_s[0] + j * a.v_s[1] + hk * a.v_s[2] + lane + 32 * c) : 0.f;
      dk[r][c] = dv[r][c] = 0.f;
    }
  }
  if (threadIdx.x == 0) {
    int64_t mn = INT64_MAX;
    for (int64_t j = row0; j < row0 + kRowsPerCta && j < a.Tk; ++j) mn = min(mn, a.kpos[j]);
    k_min = mn;
  }
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = hk * group + g;
    for (int64_t i0 = 0; i0 < a.Tq; i0 += kTile) {
      __syncthreads();
      if (threadIdx.x < kTile) {
        const int64_t i = i0 + threadIdx.x;
        const int64_t row = (b * a.H + h) * a.Tq + i;
        const bool ok = i < a.Tq && isfinite(a.lse[row]);
        qp[threadIdx.x] = ok ? a.qpos[i] : INT64_MIN;  // a row that saw no key has no gradient
        lse_s[threadIdx.x] = ok ? a.lse[row] : 0.f;
        delta_s[threadIdx.x] = ok ? a.delta[row] : 0.f;
      }
      __syncthreads();
      int64_t q_hi = INT64_MIN;
      for (int i = 0; i < kTile; ++i) q_hi = max(q_hi, qp[i]);
      if (q_hi == INT64_MIN || (a.causal && q_hi < k_min)) continue;  // uniform across the CTA
      load_tile<T, D>(qs, q, a.q_s, b, h, i0, a.Tq, a.scale);
      load_tile<T, D>(dos, dout, a.do_s, b, h, i0, a.Tq, 1.f);
      __syncthreads();
      const int n = static_cast<int>(a.Tq - i0 < kTile ? a.Tq - i0 : kTile);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (!live[r]) continue;
        for (int i = 0; i < n; ++i) {
          if (qp[i] == INT64_MIN || (a.causal && kpos[r] > qp[i])) continue;
          float s = 0.f, dp = 0.f;
#pragma unroll
          for (int c = 0; c < P; ++c) {
            s += kr[r][c] * qs[i][lane + 32 * c];
            dp += vr[r][c] * dos[i][lane + 32 * c];
          }
          s = warp_sum(s);
          dp = warp_sum(dp);
          const float p = __expf(s - lse_s[i]);
          const float ds = p * (dp - delta_s[i]);
#pragma unroll
          for (int c = 0; c < P; ++c) {
            dv[r][c] += p * dos[i][lane + 32 * c];
            dk[r][c] += ds * qs[i][lane + 32 * c];  // qs holds scale q: dk = scale sum dS q
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (!live[r]) continue;
    const int64_t j = row0 + warp * kRows + r;
    const int64_t row = (b * a.HKV + hk) * a.Tk + j;
#pragma unroll
    for (int c = 0; c < P; ++c) {
      a.dk_acc[row * D + lane + 32 * c] += dk[r][c];
      a.dv_acc[row * D + lane + 32 * c] += dv[r][c];
    }
  }
}

void check_args(const RingStepArgs& a, bool backward) {
  DELTACP_CHECK(a.D == 64 || a.D == 128, "q", "expected head dim 64 or 128 for the CUDA ring step, got ", a.D);
  DELTACP_CHECK(a.HKV >= 1 && a.H % a.HKV == 0, "k", "expected key/value heads dividing the ", a.H,
                " query heads, got ", a.HKV);
  DELTACP_CHECK(a.B >= 1 && a.Tq >= 0 && a.Tk >= 0, "q", "expected B >= 1 and non-negative lengths, got B ", a.B,
                ", Tq ", a.Tq, ", Tk ", a.Tk);
  DELTACP_CHECK(a.B * a.H <= 65535 && a.B * a.HKV <= 65535, "q", "expected B x H <= 65535, got ", a.B * a.H);
  DELTACP_CHECK(a.q && a.k && a.v && a.qpos && a.kpos, "q", "expected q, k, v, qpos and kpos on the device");
  if (backward) {
    DELTACP_CHECK(a.dout && a.lse && a.delta && a.dq_acc && a.dk_acc && a.dv_acc, "dout",
                  "expected dout, lse, delta and the gradient accumulators on the device");
  } else {
    DELTACP_CHECK(a.o_acc && a.lse_acc, "o_acc", "expected the fp32 accumulators o_acc and lse_acc on the device");
  }
}

template <class F>
void dispatch_dim(int64_t D, F&& f) {
  if (D == 64) f(std::integral_constant<int, 64>{});
  else f(std::integral_constant<int, 128>{});
}

}  // namespace

void ring_step_forward(const RingStepArgs& a, cudaStream_t stream) {
  check_args(a, false);
  if (a.Tq == 0 || a.Tk == 0) return;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_dim(a.D, [&](auto dim) {
      const dim3 grid(static_cast<unsigned>((a.Tq + kRowsPerCta - 1) / kRowsPerCta), static_cast<unsigned>(a.B * a.H));
      ring_step_fwd_kernel<T, decltype(dim)::value><<<grid, kThreads, 0, stream>>>(a);
      DELTACP_CUDA_CHECK_LAUNCH();
    });
  });
}

void ring_step_backward(const RingStepArgs& a, cudaStream_t stream) {
  check_args(a, true);
  if (a.Tq == 0 || a.Tk == 0) return;
  dispatch_dtype(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_dim(a.D, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      const dim3 gq(static_cast<unsigned>((a.Tq + kRowsPerCta - 1) / kRowsPerCta), static_cast<unsigned>(a.B * a.H));
      ring_step_dq_kernel<T, D><<<gq, kThreads, 0, stream>>>(a);
      DELTACP_CUDA_CHECK_LAUNCH();
      const dim3 gk(static_cast<unsigned>((a.Tk + kRowsPerCta - 1) / kRowsPerCta),
                    static_cast<unsigned>(a.B * a.HKV));
      ring_step_dkv_kernel<T, D><<<gk, kThreads, 0, stream>>>(a);
      DELTACP_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace deltacp::cuda::attention
