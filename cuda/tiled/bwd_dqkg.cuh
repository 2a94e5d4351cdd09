// cuda/tiled/bwd_dqkg.cuh — backward stage B2: everything that contracts over V.
//
// For one chunk with start state S = h[c], dS' = dh[c] (stage B1), Vn, dVn (B1) and dO:
//
//   dP   = scale dO Vn^T, masked to j <= i < len          -> a.dP   (stage B4 applies the decay)
//   dQG  = dO S^T        dWa = dVn S^T        dKr = Vn dS'^T           (n x K, summed over V tiles)
//   dGs  = sum_v dS'_dv S_dv                                            (K)
//
// and then, element by element (token row i < len, key column d < K):
//
//   dq_id  = scale dQG_id Gam_id                                        (the (Q*Gam) S term)
//   dk_id  = dKr_id e^(Gn_d - G_id)                                     (the Kr term)
//   dW_id  = -dWa_id                                                    (Vn = U - W S)
//   dG_id  = scale dQG_id q_id Gam_id - dKr_id Kr_id
//            + [i = len-1] ( e^(Gn_d) dGs_d + sum_j dKr_jd Kr_jd )      (decay of S, and Kr's Gn)
//
// dq, dk, dG go to fp32 per-value-head workspaces that stages B3 and B4 add to.
// One CTA per (chunk, value head), 256 threads. V is walked in tiles of 16 (fp32) or 32 (16-bit)
// columns; the four accumulators live in fp32 shared memory.
// Measured: not yet (no GPU timing recorded; see tiled_bwd.cu).
#pragma once

#include "bwd_common.cuh"

namespace deltacp::cuda::tiled::bwd {

template <class Op>
constexpr int dqkg_vtile() {
  return kIs16Bit<Op> ? 32 : 16;
}

template <class Op, int KP>
struct DqkgSmem {
  static constexpr int BV = dqkg_vtile<Op>();
  static constexpr int PP = kRows + 1, PF = KP + 1, PT = pitch_of<Op>(BV);
  size_t dP = 0, dQG = 0, dWa = 0, dKr = 0, dO = 0, Vn = 0, dVn = 0, S = 0, dSt = 0, dGs = 0, KrSum = 0, Gn = 0,
         total = 0;
  __host__ __device__ constexpr DqkgSmem() {
    Carve c;
    dP = c.take(sizeof(float) * kRows * PP);
    dQG = c.take(sizeof(float) * kRows * PF);
    dWa = c.take(sizeof(float) * kRows * PF);
    dKr = c.take(sizeof(float) * kRows * PF);
    dO = c.take(sizeof(Op) * kRows * PT);
    Vn = c.take(sizeof(Op) * kRows * PT);
    dVn = c.take(sizeof(Op) * kRows * PT);
    S = c.take(sizeof(Op) * KP * PT);
    dSt = c.take(sizeof(Op) * KP * PT);
    dGs = c.take(sizeof(float) * KP);
    KrSum = c.take(sizeof(float) * KP);
    Gn = c.take(sizeof(float) * KP);
    total = c.off;
  }
};

template <class Op, int KP, bool PERKEY>
__global__ void __launch_bounds__(kThreads) bwd_dqkg_kernel(const Args a) {
  constexpr DqkgSmem<Op, KP> L{};
  constexpr int BV = L.BV, PP = L.PP, PF = L.PF, PT = L.PT;
  extern __shared__ __align__(16) unsigned char smem[];
  float* dPa = reinterpret_cast<float*>(smem + L.dP);
  float* dQG = reinterpret_cast<float*>(smem + L.dQG);
  float* dWa = reinterpret_cast<float*>(smem + L.dWa);
  float* dKr = reinterpret_cast<float*>(smem + L.dKr);
  Op* dOs = reinterpret_cast<Op*>(smem + L.dO);
  Op* Vns = reinterpret_cast<Op*>(smem + L.Vn);
  Op* dVns = reinterpret_cast<Op*>(smem + L.dVn);
  Op* Ss = reinterpret_cast<Op*>(smem + L.S);
  Op* dSs = reinterpret_cast<Op*>(smem + L.dSt);
  float* dGs = reinterpret_cast<float*>(smem + L.dGs);
  float* KrSum = reinterpret_cast<float*>(smem + L.KrSum);
  float* Gn = reinterpret_cast<float*>(smem + L.Gn);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t c = blockIdx.x, hv = blockIdx.y, hk = hv / a.group;
  const ChunkEntry ch = a.chunks[c];
  const int len = static_cast<int>(ch.len);
  const int K = static_cast<int>(a.K);
  const Op* hp = static_cast<const Op*>(a.h) + (c * a.HV + hv) * a.Kp * a.Vp;  // S = h[c], [Kp, Vp]
  const float* dhp = a.dh + (c * a.HV + hv) * a.K * a.V;                         // dS' = dh[c], [K, V]
  const Op* vnp = static_cast<const Op*>(a.vnew);
  const Op* dout = static_cast<const Op*>(a.dout.ptr);

  for (int e = tid; e < kRows * PP; e += kThreads) dPa[e] = 0.f;
  for (int e = tid; e < kRows * PF; e += kThreads) dQG[e] = dWa[e] = dKr[e] = 0.f;
  // dGs_d = sum_v dS'_dv S_dv: one warp per key row, lanes along v, fixed reduction order.
  for (int d = warp; d < KP; d += kWarps) {
    float s = 0.f;
    if (d < K)
      for (int64_t v = lane; v < a.V; v += 32) s = fmaf(dhp[d * a.V + v], to_f(hp[d * a.Vp + v]), s);
    s = warp_sum(s);
    if (lane == 0) dGs[d] = s;
  }
  for (int d = tid; d < KP; d += kThreads) Gn[d] = a.gated ? G_at(a, PERKEY, ch, len, hv, len - 1, d) : 0.f;

  for (int64_t v0 = 0; v0 < a.V; v0 += BV) {
    __syncthreads();  // accumulators zeroed / previous tile's products done reading the tiles
    for (int e = tid; e < kRows * BV; e += kThreads) {
      const int i = e / BV, v = e % BV;
      const bool ok = i < len && v0 + v < a.V;
      dOs[i * PT + v] = ok ? dout[off(a.dout, ch.batch, ch.t0 + i, hv) + v0 + v] : from_f<Op>(0.f);
      Vns[i * PT + v] = ok ? vnp[((ch.row0 + i) * a.HV + hv) * a.Vp + v0 + v] : from_f<Op>(0.f);
      dVns[i * PT + v] = from_f<Op>(ok ? a.dvnew[ws_row(ch, i, a.HV, hv, a.V) + v0 + v] : 0.f);
    }
    for (int e = tid; e < KP * BV; e += kThreads) {
      const int d = e / BV, v = e % BV;
      const bool ok = d < K && v0 + v < a.V;
      Ss[d * PT + v] = ok ? hp[d * a.Vp + v0 + v] : from_f<Op>(0.f);
      dSs[d * PT + v] = from_f<Op>(ok ? dhp[d * a.V + v0 + v] : 0.f);
    }
    __syncthreads();
    // B operands are transposed views (column-major): B(v, j) = Vn[j][v], B(v, d) = S[d][v].
    block_gemm<Op, kRows, kRows, Lay::rowmajor, Lay::colmajor>(dOs, PT, Vns, PT, BV,
                                                               [&](int i, int j, float x) { dPa[i * PP + j] += x; });
    block_gemm<Op, kRows, KP, Lay::rowmajor, Lay::colmajor>(dOs, PT, Ss, PT, BV,
                                                            [&](int i, int d, float x) { dQG[i * PF + d] += x; });
    block_gemm<Op, kRows, KP, Lay::rowmajor, Lay::colmajor>(dVns, PT, Ss, PT, BV,
                                                            [&](int i, int d, float x) { dWa[i * PF + d] += x; });
    block_gemm<Op, kRows, KP, Lay::rowmajor, Lay::colmajor>(Vns, PT, dSs, PT, BV,
                                                            [&](int i, int d, float x) { dKr[i * PF + d] += x; });
  }
  __syncthreads();

  const Op* qp = static_cast<const Op*>(a.q.ptr);
  const Op* kp = static_cast<const Op*>(a.k.ptr);
  // KrSum_d = sum_{j < len} dKr_jd Kr_jd (the Gn dependence of Kr), one thread per key column.
  if (a.gated) {
    for (int d = tid; d < KP; d += kThreads) {
      float s = 0.f;
      if (d < K)
        for (int j = 0; j < len; ++j) {
          const float kr = to_f(kp[off(a.k, ch.batch, ch.t0 + j, hk) + d]) *
                           exp_t<Op>(Gn[d] - G_at(a, PERKEY, ch, len, hv, j, d));
          s = fmaf(dKr[j * PF + d], kr, s);
        }
      KrSum[d] = s;
    }
    __syncthreads();
  }

  for (int e = tid; e < len * K; e += kThreads) {
    const int i = e / K, d = e % K;
    const int64_t o = ws_row(ch, i, a.HV, hv, a.K) + d;
    const float dqg = dQG[i * PF + d], dkr = dKr[i * PF + d];
    float gam = 1.f, kdec = 1.f, Gid = 0.f;
    if (a.gated) {
      Gid = G_at(a, PERKEY, ch, len, hv, i, d);
      gam = exp_t<Op>(Gid);
      kdec = exp_t<Op>(Gn[d] - Gid);
    }
    a.dqw[o] = a.scale * dqg * gam;
    a.dkw[o] = dkr * kdec;
    a.dW[o] = -dWa[i * PF + d];
    if (a.gated) {
      const float qv = to_f(qp[off(a.q, ch.batch, ch.t0 + i, hk) + d]);
      const float kv = to_f(kp[off(a.k, ch.batch, ch.t0 + i, hk) + d]);
      float dG = a.scale * dqg * qv * gam - dkr * kv * kdec;
      if (i == len - 1) dG += exp_t<Op>(Gn[d]) * dGs[d] + KrSum[d];
      a.dGw[o] = dG;
    }
  }
  float* dPg = a.dP + (c * a.HV + hv) * kRows * kRows;
  for (int e = tid; e < kRows * kRows; e += kThreads) {
    const int i = e / kRows, j = e % kRows;
    dPg[e] = (i >= j && i < len) ? a.scale * dPa[i * PP + j] : 0.f;
  }
}

}  // namespace deltacp::cuda::tiled::bwd
