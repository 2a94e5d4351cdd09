// cuda/tiled/bwd_dv_local.cuh — backward stage B0: the intra-chunk part of dL/dVn.
//
//   P_ij   = sum_d q_id k_jd e^(G_id - G_jd)   for j <= i < len, else 0
//   dVn   <- scale P^T dO                      (the dh scan, bwd_dh_scan.cuh, adds Kr dS')
//
// One CTA per (chunk, value head), 256 threads. P (64 x 64) is formed once, then dO is walked in
// V tiles of 32 columns: dVn tile = P^T (64 x 64) * dO tile (64 x 32).
//   gdn / delta: P = (Q K^T) o E with the scalar decay E_ij = e^(G_i - G_j): one tensor-core product.
//   kda:         the decay differs per key column, so P is summed element by element
//                (2080 pairs x K exponentials per chunk); see "what is not done" in tiled_bwd.cu.
// Writes a.dvnew (fp32) for every token of the chunk and every V column, and for kda a.Qg = Q e^G.
// Measured: not yet (no GPU timing recorded; see tiled_bwd.cu).
#pragma once

#include "bwd_common.cuh"

namespace deltacp::cuda::tiled::bwd {

template <class Op, int KP, bool PERKEY>
struct DvLocalSmem {
  static constexpr int PK = pitch_of<Op>(KP), PP = pitch_of<Op>(kRows), PV = pitch_of<Op>(kVTile);
  static constexpr int PG = PERKEY ? KP + 1 : 1;
  size_t q = 0, k = 0, G = 0, P = 0, dO = 0, total = 0;
  __host__ __device__ constexpr DvLocalSmem() {
    Carve c;
    q = c.take(sizeof(Op) * kRows * PK);
    k = c.take(sizeof(Op) * kRows * PK);
    G = c.take(sizeof(float) * kRows * PG);
    P = c.take(sizeof(Op) * kRows * PP);
    dO = c.take(sizeof(Op) * kRows * PV);
    total = c.off;
  }
};

template <class Op, int KP, bool PERKEY>
__global__ void __launch_bounds__(kThreads) bwd_dv_local_kernel(const Args a) {
  constexpr DvLocalSmem<Op, KP, PERKEY> L{};
  constexpr int PK = L.PK, PP = L.PP, PV = L.PV, PG = L.PG;
  extern __shared__ __align__(16) unsigned char smem[];
  Op* qs = reinterpret_cast<Op*>(smem + L.q);
  Op* ks = reinterpret_cast<Op*>(smem + L.k);
  float* Gs = reinterpret_cast<float*>(smem + L.G);
  Op* Ps = reinterpret_cast<Op*>(smem + L.P);
  Op* dOs = reinterpret_cast<Op*>(smem + L.dO);

  const int tid = threadIdx.x;
  const int64_t c = blockIdx.x, hv = blockIdx.y, hk = hv / a.group;
  const ChunkEntry ch = a.chunks[c];
  const int len = static_cast<int>(ch.len);
  const int K = static_cast<int>(a.K);

  for (int e = tid; e < kRows * KP; e += kThreads) {
    const int i = e / KP, d = e % KP;
    const bool ok = i < len && d < K;
    const int64_t o = ok ? off(a.q, ch.batch, ch.t0 + i, hk) + d : 0;
    qs[i * PK + d] = ok ? static_cast<const Op*>(a.q.ptr)[o] : from_f<Op>(0.f);
    const int64_t ok_off = ok ? off(a.k, ch.batch, ch.t0 + i, hk) + d : 0;
    ks[i * PK + d] = ok ? static_cast<const Op*>(a.k.ptr)[ok_off] : from_f<Op>(0.f);
  }
  if (a.gated) {
    if constexpr (PERKEY) {
      for (int e = tid; e < kRows * KP; e += kThreads) {
        const int i = e / KP, d = e % KP;
        Gs[i * PG + d] = G_at(a, true, ch, len, hv, i, d);
      }
    } else {
      for (int i = tid; i < kRows; i += kThreads) Gs[i] = G_at(a, false, ch, len, hv, i, 0);
    }
  }
  __syncthreads();
  if constexpr (PERKEY) {
    // Q e^G for the dh scan (B1), which cannot fold a per-key-column decay into its narrow operands.
    Op* qg = static_cast<Op*>(a.Qg);
    for (int e = tid; e < kRows * a.Kp; e += kThreads) {
      const int i = e / a.Kp, d = e % a.Kp;
      if (i < len) {
        const float x = d < K ? to_f(qs[i * PK + d]) * exp_t<Op>(Gs[i * PG + d]) : 0.f;
        qg[ws_row(ch, i, a.HV, hv, a.Kp) + d] = from_f<Op>(x);
      }
    }
  }

  // P, masked to j <= i < len (the exponential is evaluated only inside the mask).
  if constexpr (!PERKEY) {
    block_gemm<Op, kRows, kRows, Lay::rowmajor, Lay::colmajor>(qs, PK, ks, PK, KP, [&](int i, int j, float x) {
      float p = 0.f;
      if (i >= j && i < len) p = a.gated ? x * exp_t<Op>(Gs[i] - Gs[j]) : x;
      Ps[i * PP + j] = from_f<Op>(p);
    });
  } else {
    for (int e = tid; e < kRows * kRows; e += kThreads) {
      const int i = e / kRows, j = e % kRows;
      float p = 0.f;
      if (i >= j && i < len) {
        for (int d = 0; d < K; ++d)
          p = fmaf(to_f(qs[i * PK + d]) * to_f(ks[j * PK + d]), exp_t<Op>(Gs[i * PG + d] - Gs[j * PG + d]), p);
      }
      Ps[i * PP + j] = from_f<Op>(p);
    }
  }

  const Op* dout = static_cast<const Op*>(a.dout.ptr);
  for (int v0 = 0; v0 < a.V; v0 += kVTile) {
    __syncthreads();  // P complete; the previous tile's product has finished reading dOs
    for (int e = tid; e < kRows * kVTile; e += kThreads) {
      const int i = e / kVTile, v = e % kVTile;
      const bool ok = i < len && v0 + v < a.V;
      dOs[i * PV + v] = ok ? dout[off(a.dout, ch.batch, ch.t0 + i, hv) + v0 + v] : from_f<Op>(0.f);
    }
    __syncthreads();
    // dVn(j, v) = scale sum_i P_ij dO_iv: A = P^T (column-major view of P).
    block_gemm<Op, kRows, kVTile, Lay::colmajor, Lay::rowmajor>(Ps, PP, dOs, PV, kRows, [&](int j, int v, float x) {
      if (j < len && v0 + v < a.V) a.dvnew[ws_row(ch, j, a.HV, hv, a.V) + v0 + v] = a.scale * x;
    });
  }
}

}  // namespace deltacp::cuda::tiled::bwd
