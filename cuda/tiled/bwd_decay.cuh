// cuda/tiled/bwd_decay.cuh — backward stage B4: the decay-masked products, then the final
// per-value-head gradients dbeta and dg.
//
// P_ij = sum_d q_id k_jd E_ij^d and A_ij = beta_i sum_d k_id k_jd E_ij^d (E_ij^d = e^(G_id - G_jd))
// give, with dP from stage B2 and dA from stage B3 (both already masked):
//
//   Yq_id = sum_{j<=i} dP_ij k_jd E_ij^d          dq += Yq,          dG += q * Yq
//   Yr_id = sum_{j< i} dA_ij k_jd E_ij^d          dk += beta * Yr,   dG += beta k * Yr,  dbeta_i += k_i . Yr_i
//   Yc_jd = sum_{i>=j} (dP_ij q_id + beta_i dA_ij k_id) E_ij^d
//                                                 dk += Yc,          dG -= k * Yc
//
// (the k_i and G_i sides of each product, and the k_j and G_j sides; DESIGN.md section 3.)
//   gdn / delta: E_ij is one scalar per (i, j): the products are four tensor-core GEMMs on the
//                decayed 64 x 64 matrices dP o E, dA o E, diag(beta) dA o E.
//   kda:         E depends on d: each (row, key column) sums over the chunk element by element.
// Finally, per token: dbeta = (stage B3's part) + k . Yr, and dg = reverse cumulative sum over the
// chunk of dG (G_i = g_1 + ... + g_i), summed over d first for gdn's scalar gate.
// One CTA per (chunk, value head), 256 threads.
// Measured: not yet (no GPU timing recorded; see tiled_bwd.cu).
#pragma once

#include "bwd_common.cuh"

namespace deltacp::cuda::tiled::bwd {

template <class Op, int KP, bool PERKEY>
struct DecaySmem {
  static constexpr int PA = kRows + 1, PF = KP + 1;                       // fp32 tiles
  static constexpr int P64 = pitch_of<Op>(kRows), PK = pitch_of<Op>(KP);  // operand tiles
  // gdn / delta: Mp = dP o E, Ma = dA o E, Mb = diag(beta) Ma (operands), K, Q (operands), kYr (fp32).
  // kda: dP, dA, dB = diag(beta) dA (fp32), q, k, G (fp32), per-warp partial sums of k . Yr.
  size_t m0 = 0, m1 = 0, m2 = 0, x0 = 0, x1 = 0, x2 = 0, G = 0, beta = 0, rowsum = 0, total = 0;
  __host__ __device__ constexpr DecaySmem() {
    Carve c;
    const size_t mat = PERKEY ? sizeof(float) * kRows * PA : sizeof(Op) * kRows * P64;
    const size_t key = PERKEY ? sizeof(float) * kRows * PF : sizeof(Op) * kRows * PK;
    m0 = c.take(mat);
    m1 = c.take(mat);
    m2 = c.take(mat);
    x0 = c.take(key);
    x1 = c.take(key);
    x2 = c.take(PERKEY ? key : sizeof(float) * kRows * PF);
    G = c.take(sizeof(float) * kRows);
    beta = c.take(sizeof(float) * kRows);
    rowsum = c.take(sizeof(float) * kRows * (KP / 32));
    total = c.off;
  }
};

template <class Op, int KP, bool PERKEY>
__global__ void __launch_bounds__(kThreads) bwd_decay_kernel(const Args a) {
  constexpr DecaySmem<Op, KP, PERKEY> L{};
  constexpr int PA = L.PA, PF = L.PF, P64 = L.P64, PK = L.PK;
  constexpr int kParts = KP / 32;  // warps per key row in the kda loop
  extern __shared__ __align__(16) unsigned char smem[];
  float* Gs = reinterpret_cast<float*>(smem + L.G);  // gdn: G per row
  float* betas = reinterpret_cast<float*>(smem + L.beta);
  float* rowsum = reinterpret_cast<float*>(smem + L.rowsum);  // [64][kParts]

  const int tid = threadIdx.x;
  const int64_t c = blockIdx.x, hv = blockIdx.y, hk = hv / a.group;
  const ChunkEntry ch = a.chunks[c];
  const int len = static_cast<int>(ch.len);
  const int K = static_cast<int>(a.K);
  const Op* qp = static_cast<const Op*>(a.q.ptr);
  const Op* kp = static_cast<const Op*>(a.k.ptr);
  const float* dPg = a.dP + (c * a.HV + hv) * kRows * kRows;
  const float* dAg = a.dA + (c * a.HV + hv) * kRows * kRows;

  for (int i = tid; i < kRows; i += kThreads) {
    betas[i] = i < len ? ld<Op>(a.beta, off(a.beta, ch.batch, ch.t0 + i, hv)) : 0.f;
    Gs[i] = (a.gated && !PERKEY) ? G_at(a, false, ch, len, hv, i, 0) : 0.f;
  }
  for (int e = tid; e < kRows * kParts; e += kThreads) rowsum[e] = 0.f;
  __syncthreads();

  if constexpr (!PERKEY) {
    Op* Mp = reinterpret_cast<Op*>(smem + L.m0);
    Op* Ma = reinterpret_cast<Op*>(smem + L.m1);
    Op* Mb = reinterpret_cast<Op*>(smem + L.m2);
    Op* Ks = reinterpret_cast<Op*>(smem + L.x0);
    Op* Qs = reinterpret_cast<Op*>(smem + L.x1);
    float* kYr = reinterpret_cast<float*>(smem + L.x2);
    for (int e = tid; e < kRows * kRows; e += kThreads) {
      const int i = e / kRows, j = e % kRows;
      // dP, dA are zero outside i >= j; the exponential is only evaluated inside that mask.
      const float E = (a.gated && i >= j) ? exp_t<Op>(Gs[i] - Gs[j]) : 1.f;
      const float dp = dPg[e] * E, da = dAg[e] * E;
      Mp[i * P64 + j] = from_f<Op>(dp);
      Ma[i * P64 + j] = from_f<Op>(da);
      Mb[i * P64 + j] = from_f<Op>(betas[i] * da);
    }
    for (int e = tid; e < kRows * KP; e += kThreads) {
      const int i = e / KP, d = e % KP;
      const bool ok = i < len && d < K;
      Ks[i * PK + d] = ok ? kp[off(a.k, ch.batch, ch.t0 + i, hk) + d] : from_f<Op>(0.f);
      Qs[i * PK + d] = ok ? qp[off(a.q, ch.batch, ch.t0 + i, hk) + d] : from_f<Op>(0.f);
    }
    __syncthreads();
    // Yq = (dP o E) K
    block_gemm<Op, kRows, KP, Lay::rowmajor, Lay::rowmajor>(Mp, P64, Ks, PK, kRows, [&](int i, int d, float y) {
      if (i < len && d < K) {
        const int64_t o = ws_row(ch, i, a.HV, hv, a.K) + d;
        a.dqw[o] += y;
        if (a.gated) a.dGw[o] += to_f(Qs[i * PK + d]) * y;
      }
    });
    __syncthreads();  // the next product's epilogue may touch the same elements from another thread
    // Yr = (dA o E) K
    block_gemm<Op, kRows, KP, Lay::rowmajor, Lay::rowmajor>(Ma, P64, Ks, PK, kRows, [&](int i, int d, float y) {
      float ky = 0.f;
      if (i < len && d < K) {
        const float kv = to_f(Ks[i * PK + d]);
        const int64_t o = ws_row(ch, i, a.HV, hv, a.K) + d;
        a.dkw[o] += betas[i] * y;
        if (a.gated) a.dGw[o] += betas[i] * kv * y;
        ky = kv * y;
      }
      kYr[i * PF + d] = ky;
    });
    __syncthreads();
    // Yc = (dP o E)^T Q + (diag(beta) dA o E)^T K  (A operands: column-major views)
    auto yc = [&](int j, int d, float y) {
      if (j < len && d < K) {
        const int64_t o = ws_row(ch, j, a.HV, hv, a.K) + d;
        a.dkw[o] += y;
        if (a.gated) a.dGw[o] -= to_f(Ks[j * PK + d]) * y;
      }
    };
    block_gemm<Op, kRows, KP, Lay::colmajor, Lay::rowmajor>(Mp, P64, Qs, PK, kRows, yc);
    __syncthreads();
    block_gemm<Op, kRows, KP, Lay::colmajor, Lay::rowmajor>(Mb, P64, Ks, PK, kRows, yc);
    __syncthreads();
    if (tid < kRows) {
      float s = 0.f;
      for (int d = 0; d < KP; ++d) s += kYr[tid * PF + d];
      rowsum[tid * kParts] = s;
    }
  } else {
    float* dPs = reinterpret_cast<float*>(smem + L.m0);
    float* dAs = reinterpret_cast<float*>(smem + L.m1);
    float* dBs = reinterpret_cast<float*>(smem + L.m2);
    float* qs = reinterpret_cast<float*>(smem + L.x0);
    float* ks = reinterpret_cast<float*>(smem + L.x1);
    float* Gk = reinterpret_cast<float*>(smem + L.x2);
    for (int e = tid; e < kRows * kRows; e += kThreads) {
      const int i = e / kRows, j = e % kRows;
      dPs[i * PA + j] = dPg[e];
      dAs[i * PA + j] = dAg[e];
      dBs[i * PA + j] = betas[i] * dAg[e];
    }
    for (int e = tid; e < kRows * KP; e += kThreads) {
      const int i = e / KP, d = e % KP;
      const bool ok = i < len && d < K;
      qs[i * PF + d] = ok ? to_f(qp[off(a.q, ch.batch, ch.t0 + i, hk) + d]) : 0.f;
      ks[i * PF + d] = ok ? to_f(kp[off(a.k, ch.batch, ch.t0 + i, hk) + d]) : 0.f;
      Gk[i * PF + d] = G_at(a, true, ch, len, hv, i, d);  // padding rows repeat the last row; d >= K: 0
    }
    __syncthreads();
    // Thread (row group r, key column d): rows i = r, r + RS, ... below len. A warp shares i
    // (KP >= 32 consecutive threads per row), so the loop bound is warp-uniform for the shuffles.
    constexpr int RS = kThreads / KP;
    const int d = tid % KP, r = tid / KP;
    for (int i = r; i < len; i += RS) {
      const float Gi = Gk[i * PF + d];
      float yq = 0.f, yr = 0.f, ycol = 0.f;
      for (int j = 0; j <= i; ++j) {  // row i: E_ij^d = e^(G_id - G_jd), j <= i
        const float kj = ks[j * PF + d] * exp_t<Op>(Gi - Gk[j * PF + d]);
        yq = fmaf(dPs[i * PA + j], kj, yq);
        yr = fmaf(dAs[i * PA + j], kj, yr);
      }
      for (int i2 = i; i2 < len; ++i2) {  // column i: E_{i2,i}^d = e^(G_{i2,d} - G_id), i2 >= i
        const float z = dPs[i2 * PA + i] * qs[i2 * PF + d] + dBs[i2 * PA + i] * ks[i2 * PF + d];
        ycol = fmaf(z, exp_t<Op>(Gk[i2 * PF + d] - Gi), ycol);
      }
      const float qv = qs[i * PF + d], kv = ks[i * PF + d], b = betas[i];
      if (d < K) {
        const int64_t o = ws_row(ch, i, a.HV, hv, a.K) + d;
        a.dqw[o] += yq;
        a.dkw[o] += b * yr + ycol;
        a.dGw[o] += qv * yq + b * kv * yr - kv * ycol;
      }
      const float part = warp_sum(kv * yr);  // kv = 0 for d >= K
      if ((tid & 31) == 0) rowsum[i * kParts + d / 32] = part;
    }
  }
  __syncthreads();

  // dbeta = stage B3's part + k . Yr (fixed summation order).
  if (tid < len) {
    float s = a.dbw[(ch.row0 + tid) * a.HV + hv];
    for (int p = 0; p < kParts; ++p) s += rowsum[tid * kParts + p];
    st<Op>(a.dbeta, off(a.dbeta, ch.batch, ch.t0 + tid, hv), s);
  }
  if (!a.gated) return;
  // dg: reverse cumulative sum of dG over the chunk's tokens (G_i = g_1 + ... + g_i, chunk-local).
  if constexpr (PERKEY) {
    for (int d = tid; d < K; d += kThreads) {
      float acc = 0.f;
      for (int i = len - 1; i >= 0; --i) {
        acc += a.dGw[ws_row(ch, i, a.HV, hv, a.K) + d];
        store_gate<Op>(a, off(a.dg, ch.batch, ch.t0 + i, hv) + d, acc);
      }
    }
  } else {
    __syncthreads();  // rowsum is reused for the per-row sums over d
    float* rs = rowsum;
    if (tid < len) {
      float s = 0.f;
      for (int d = 0; d < K; ++d) s += a.dGw[ws_row(ch, tid, a.HV, hv, a.K) + d];
      rs[tid] = s;
    }
    __syncthreads();
    if (tid < len) {
      float acc = 0.f;
      for (int i = len - 1; i >= tid; --i) acc += rs[i];
      store_gate<Op>(a, off(a.dg, ch.batch, ch.t0 + tid, hv), acc);
    }
  }
}

}  // namespace deltacp::cuda::tiled::bwd
