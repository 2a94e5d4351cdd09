// cuda/tiled/bwd_dh_scan.cuh — backward stage B1: the reverse state-gradient scan.
//
// Walking the chunks of one sequence from last to first, with dS' = dL/d(end state of the chunk)
// (dht, or 0, for the last chunk):
//
//   dh[c]  = dS'                                             (kept for stage B2, in the input dtype)
//   dVn    = dVn_local + Kr dS'                              (dVn_local from stage B0)
//   dS     = e^Gn o dS' + scale (Q*Gam)^T dO - W^T dVn       (= dS' of the previous chunk)
//   dh0    = dS of the first chunk                           (when p.dh0 is given)
// In the dh0-only mode (Params::dh0_only) neither dh[c] nor dVn is stored.
//
// Kr = K e^(Gn - G). For gdn (one decay per row) the row factors move onto the narrow operands:
// Kr dS' = diag(e^(Gn - G)) (K dS') and (Q*Gam)^T dO = Q^T (diag(e^G) dO), so q and k are read as
// they are. For kda (a decay per key column) the gated tiles come precomputed: Kr is the forward's
// Kd (stage 2 of tiled_fwd.cu) and Q*Gam is written by stage B0 (a.Qg).
//
// The same shape as the forward scan (chunk_state_scan_kernel in tiled_fwd.cu): one CTA of NW
// warps per (sequence, value head, BV-column slice of V); the fp32 slice of dS (KP x BV) lives in
// registers as mma accumulators (warp w owns rows [KP/NW w, KP/NW (w + 1))). Wide slices (BV = 64,
// 8 warps for KP = 128) because every CTA of a head reads the head's whole q, k, W tiles: traffic
// through L2 is (V / BV) x their bytes, and that traffic is what bounded the step. Per chunk:
//   (a) dS -> dSb (operand) and dh[c] (global, rounded to the input dtype as dSb is)
//   (b) X = Kr dSb (64 x KP x BV; warp w rows 16 (w % 4)); dVn = dVn_local + X -> global (fp32);
//       B1 = scale (e^G) o dO and B2 = -dVn into shared memory as operands
//   (c) dS = e^Gn o dS + Q^T B1 + W^T B2        (two k = 64 products)
// The chunk's q, k (or Qg, Kd), W, dO, dVn_local tiles and gate values are loaded by cp.async into
// an NS-deep ring: with NS = 2 chunk c - 1 loads while chunk c computes, so each step costs its
// products and two barriers rather than a round trip to memory.
// Measured (H200, bf16 GDN (2,16384,16,128)): 0.94 ms, 3.7 us per chunk step (the previous version,
// with dS in shared memory, element-wise tile loads and no prefetch, took 12.0 ms).
#pragma once

#include "bwd_common.cuh"

namespace deltacp::cuda::tiled::bwd {

template <class Op, int KP, int NS, int BV_>
struct DhScanSmem {
  static constexpr int BV = BV_;
  static constexpr int PK = kIs16Bit<Op> ? KP + 8 : KP + 4;  // q, k, W tiles
  static constexpr int PB = kIs16Bit<Op> ? BV + 8 : BV + 4;  // dO, dS operand, B1, B2 tiles
  static constexpr int PF = BV + 4;                          // dVn_local (fp32)
  size_t q = 0, k = 0, w = 0, dO = 0, dvl = 0, g = 0, stage = 0, dSb = 0, B1 = 0, B2 = 0, total = 0;
  __host__ __device__ constexpr DhScanSmem() {
    Carve c;
    q = c.take(sizeof(Op) * kRows * PK);
    k = c.take(sizeof(Op) * kRows * PK);
    w = c.take(sizeof(Op) * kRows * PK);
    dO = c.take(sizeof(Op) * kRows * PB);
    dvl = c.take(sizeof(float) * kRows * PF);
    g = c.take(sizeof(float) * (KP > kRows ? KP : kRows));  // gdn: G of the rows; kda: Gn per key column
    stage = c.off;
    c.off = stage * NS;
    dSb = c.take(sizeof(Op) * KP * PB);
    B1 = c.take(sizeof(Op) * kRows * PB);
    B2 = c.take(sizeof(Op) * kRows * PB);
    total = c.off;
  }
};

template <class Op, int KP, bool PERKEY, int NS, int BV, int NW>
__global__ void __launch_bounds__(32 * NW) bwd_dh_scan_kernel(const Args a) {
  static_assert(NS == 1 || NS == 2, "one or two stages");
  static_assert(NW == 4 || NW == 8, "4 or 8 warps");
  constexpr DhScanSmem<Op, KP, NS, BV> L{};
  constexpr int PK = L.PK, PB = L.PB, PF = L.PF;
  constexpr int kScanThreads = 32 * NW;
  constexpr int NT = BV / 8, KMT = KP / (16 * NW);  // NW warps x KMT m-tiles of 16 rows = KP state rows
  constexpr int NTB = NT / (NW / 4);                // n-tiles of a warp's share of dVn (step (b))
  static_assert(KMT >= 1 && KP == 16 * KMT * NW, "the warps cover the KP state rows");
  static_assert(!kIs16Bit<Op> || NTB % 2 == 0, "16-bit products take n-tiles in pairs");
  extern __shared__ __align__(16) unsigned char smem[];
  Op* dSb = reinterpret_cast<Op*>(smem + L.dSb);
  Op* B1 = reinterpret_cast<Op*>(smem + L.B1);
  Op* B2 = reinterpret_cast<Op*>(smem + L.B2);

  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t n = blockIdx.x, hv = blockIdx.y, hk = hv / a.group;
  const int64_t v0 = int64_t(blockIdx.z) * BV;
  const int vw = static_cast<int>(a.V - v0 < BV ? a.V - v0 : BV);  // valid columns of this slice
  const int K = static_cast<int>(a.K), Kp = static_cast<int>(a.Kp);
  const SeqEntry sq = a.seqs[n];
  const int cs = a.chunk_size;
  const int64_t state0 = (n * a.HV + hv) * a.K * a.V;  // [N, HV, K, V] offset of (n, hv)
  const int m0 = 16 * KMT * warp;                      // this warp's first state row

  // dS from dht, or zero. (Written out rather than fwd_mma.cuh's load_acc / store_acc, which the
  // forward scan uses: with them nvcc 13.0 spills 20-32 bytes in this kernel's bf16 instantiations.)
  float dS[KMT][NT][4];
#pragma unroll
  for (int mt = 0; mt < KMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = m0 + acc_row(mt, e), v = acc_col(nt, e);
        dS[mt][nt][e] = (a.dht && d < K && v < vw) ? a.dht[state0 + int64_t(d) * a.V + v0 + v] : 0.f;
      }

  const Op* qp = static_cast<const Op*>(a.q.ptr);
  const Op* kp = static_cast<const Op*>(a.k.ptr);
  const Op* Wp = static_cast<const Op*>(a.W);
  const Op* Qg = static_cast<const Op*>(a.Qg);
  const Op* Kd = static_cast<const Op*>(a.Kd);
  const Op* dout = static_cast<const Op*>(a.dout.ptr);
  auto t0_of = [&](int64_t ci) { return sq.bos + ci * cs; };
  auto row0_of = [&](int64_t ci) { return sq.batch * a.T + sq.bos + ci * cs; };
  auto len_of = [&](int64_t ci) { return static_cast<int>(min(static_cast<int64_t>(cs), sq.len - ci * cs)); };
  auto at = [&](size_t base, int64_t ci) { return smem + base + static_cast<size_t>(ci % NS) * L.stage; };

  // Chunk ci's tiles into stage ci % NS: one cp.async group.
  auto issue = [&](int64_t ci) {
    const int64_t t0 = t0_of(ci), row0 = row0_of(ci);
    const int len = len_of(ci);
    Op* qs = reinterpret_cast<Op*>(at(L.q, ci));
    Op* ks = reinterpret_cast<Op*>(at(L.k, ci));
    Op* ws = reinterpret_cast<Op*>(at(L.w, ci));
    Op* dOs = reinterpret_cast<Op*>(at(L.dO, ci));
    float* dvl = reinterpret_cast<float*>(at(L.dvl, ci));
    float* gs = reinterpret_cast<float*>(at(L.g, ci));
    if constexpr (PERKEY) {
      const Op* qsrc = Qg + (row0 * a.HV + hv) * Kp;
      const Op* ksrc = Kd + (row0 * a.HV + hv) * Kp;
      load_tile<Op, kScanThreads>(qs, PK, qsrc, a.HV * Kp, len, kRows, Kp, KP, vec_ok(qsrc, a.HV * Kp));
      load_tile<Op, kScanThreads>(ks, PK, ksrc, a.HV * Kp, len, kRows, Kp, KP, vec_ok(ksrc, a.HV * Kp));
    } else {
      const Op* qsrc = qp + off(a.q, sq.batch, t0, hk);
      const Op* ksrc = kp + off(a.k, sq.batch, t0, hk);
      load_tile<Op, kScanThreads>(qs, PK, qsrc, a.q.stride_t, len, kRows, K, KP, vec_ok(qsrc, a.q.stride_t));
      load_tile<Op, kScanThreads>(ks, PK, ksrc, a.k.stride_t, len, kRows, K, KP, vec_ok(ksrc, a.k.stride_t));
    }
    const Op* wsrc = Wp + (row0 * a.HV + hv) * Kp;
    load_tile<Op, kScanThreads>(ws, PK, wsrc, a.HV * Kp, len, kRows, Kp, KP, vec_ok(wsrc, a.HV * Kp));
    const Op* osrc = dout + off(a.dout, sq.batch, t0, hv) + v0;
    load_tile<Op, kScanThreads>(dOs, PB, osrc, a.dout.stride_t, len, kRows, vw, BV, vec_ok(osrc, a.dout.stride_t));
    const float* vsrc = a.dvnew + (row0 * a.HV + hv) * a.V + v0;
    load_tile<float, kScanThreads>(dvl, PF, vsrc, a.HV * a.V, len, kRows, vw, BV, vec_ok(vsrc, a.HV * a.V));
    if (a.gated) {
      if constexpr (PERKEY) {
        for (int d = tid; d < KP; d += kScanThreads) {
          if (d < K) cp_async_4(gs + d, a.G + ((row0 + len - 1) * a.HV + hv) * a.K + d);
          else gs[d] = 0.f;
        }
      } else {
        if (tid < kRows) cp_async_4(gs + tid, a.G + (row0 + min(tid, len - 1)) * a.HV + hv);
      }
    } else {
      for (int d = tid; d < (KP > kRows ? KP : kRows); d += kScanThreads) gs[d] = 0.f;
    }
    cp_async_commit();
  };

  const int64_t nc = sq.num_chunks;
  if (nc > 0) issue(nc - 1);
  for (int64_t ci = nc - 1; ci >= 0; --ci) {
    const int64_t row0 = row0_of(ci), c = sq.first_chunk + ci;
    const int len = len_of(ci);
    const Op* qs = reinterpret_cast<const Op*>(at(L.q, ci));
    const Op* ks = reinterpret_cast<const Op*>(at(L.k, ci));
    const Op* ws = reinterpret_cast<const Op*>(at(L.w, ci));
    const Op* dOs = reinterpret_cast<const Op*>(at(L.dO, ci));
    const float* dvl = reinterpret_cast<const float*>(at(L.dvl, ci));
    const float* gs = reinterpret_cast<const float*>(at(L.g, ci));
    // Stage (ci - 1) % 2 was last read by chunk ci + 1, released by the barrier ending its step.
    if constexpr (NS == 2) {
      if (ci > 0) issue(ci - 1);
      else cp_async_commit();  // an empty group keeps the wait count uniform
    }

    // (a) dS -> dSb and dh[c]
    const int64_t hc = (c * a.HV + hv) * a.K * a.V + v0;  // [num_chunks, HV, K, V] offset of (c, hv, 0, v0)
#pragma unroll
    for (int mt = 0; mt < KMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int d = m0 + acc_row(mt, 2 * h2), v = acc_col(nt, 0);
          const float x0 = dS[mt][nt][2 * h2], x1 = dS[mt][nt][2 * h2 + 1];
          store_pair(dSb + d * PB + v, x0, x1);
          if (a.dh != nullptr && d < K) {
            Op* dh = static_cast<Op*>(a.dh) + hc + int64_t(d) * a.V + v;
            if (v < vw) dh[0] = from_f<Op>(x0);
            if (v + 1 < vw) dh[1] = from_f<Op>(x1);
          }
        }
    cp_async_wait<NS - 1>();  // chunk ci's tiles (chunk ci - 1's may still be in flight)
    __syncthreads();

    // (b) dVn = dVn_local + Kr dS'; B1 = scale e^G o dO; B2 = -dVn
    const float gn = (a.gated && !PERKEY) ? gs[len - 1] : 0.f;
    {
      // warp w: rows 16 (w % 4) .. + 15 of dVn, columns nb .. nb + 8 NTB (all BV of them with 4 warps)
      const int rb = 16 * (warp & 3), nb = 8 * NTB * (warp >> 2);
      float acc[1][NTB][4];
      zero_acc(acc);
      warp_mma<Op, 1, NTB, Lay::rowmajor, Lay::rowmajor>(acc, ks, PK, rb, dSb, PB, nb, 0, KP);
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int i = rb + acc_row(0, 2 * h2);
        // gdn: the row factors e^(Gn - G_i) (on Kr) and e^(G_i) (on dO); exponents <= 0 for g <= 0
        float fk = 1.f, fo = a.scale;
        if (a.gated && !PERKEY) {
          fk = exp_t<Op>(gn - gs[i]);
          fo = a.scale * exp_t<Op>(gs[i]);
        }
        const bool row_ok = i < len;
#pragma unroll
        for (int nt = 0; nt < NTB; ++nt) {
          const int v = nb + acc_col(nt, 0);
          float dv0 = 0.f, dv1 = 0.f;
          if (row_ok) {
            dv0 = dvl[i * PF + v] + fk * acc[0][nt][2 * h2];
            dv1 = dvl[i * PF + v + 1] + fk * acc[0][nt][2 * h2 + 1];
          }
          if (row_ok && !a.dh0_only) {
            float* dst = a.dvnew + (row0 + i) * a.HV * a.V + hv * a.V + v0 + v;
            if (v < vw) dst[0] = dv0;
            if (v + 1 < vw) dst[1] = dv1;
          }
          store_pair(B2 + i * PB + v, -dv0, -dv1);
          store_pair(B1 + i * PB + v, fo * to_f(dOs[i * PB + v]), fo * to_f(dOs[i * PB + v + 1]));
        }
      }
    }
    __syncthreads();  // B1, B2 complete; dSb is free

    // (c) dS = e^Gn o dS + Q^T B1 + W^T B2
#pragma unroll
    for (int mt = 0; mt < KMT; ++mt)
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        float decay = 1.f;
        if (a.gated) decay = exp_t<Op>(PERKEY ? gs[m0 + acc_row(mt, 2 * h2)] : gn);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          dS[mt][nt][2 * h2] *= decay;
          dS[mt][nt][2 * h2 + 1] *= decay;
        }
      }
    warp_mma<Op, KMT, NT, Lay::colmajor, Lay::rowmajor>(dS, qs, PK, m0, B1, PB, 0, 0, kRows);
    warp_mma<Op, KMT, NT, Lay::colmajor, Lay::rowmajor>(dS, ws, PK, m0, B2, PB, 0, 0, kRows);
    __syncthreads();  // stage ci % NS, B1 and B2 are free
    if constexpr (NS == 1) {
      if (ci > 0) issue(ci - 1);
    }
  }

  if (a.dh0) {
#pragma unroll
    for (int mt = 0; mt < KMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = m0 + acc_row(mt, e), v = acc_col(nt, e);
          if (d < K && v < vw) a.dh0[state0 + int64_t(d) * a.V + v0 + v] = dS[mt][nt][e];
        }
  }
}

}  // namespace deltacp::cuda::tiled::bwd
