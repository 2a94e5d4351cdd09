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
// dq, dk go to fp32 per-value-head workspaces that stages B3 and B4 add to; dG too for kda, while gdn's
// scalar gate needs only its row sums (a.dGr, [R, HV]).
//
// One CTA of 8 warps per (chunk, value head). The four products accumulate in registers, as mma
// accumulators, across the walk over V in tiles of BV columns: warp w owns rows 16 (w % 4) .. + 16 of
// every output, and half w / 4 of its columns (KP / 2 key columns of dQG, dWa, dKr; 32 of dP), 112
// fp32 registers at KP = 128. The epilogue above runs on those registers directly. The V tiles (dO, Vn,
// S and dS' in the input dtype, dVn in fp32, rounded to the input dtype in shared memory; dGs is summed
// in fp32 over the products of the 16-bit dS' and S) come by cp.async, NS stages deep: with NS = 2 tile
// t + 1 loads while tile t multiplies.
// The chunk's q, k and G (what the epilogue reads) load once, by cp.async, at the start.
// Measured (NVIDIA H100, bf16 GDN (1, 32768, 16, 128), one launch under Nsight Compute, 2026-11-23):
// 1.53 ms, DRAM throughput 55%, 248 registers, one CTA (8 warps) per SM. The previous version, with the
// accumulators in fp32 shared memory (153 KB), element-wise tile loads and the epilogue reading q, k and
// G from global memory element by element, took 7.07 ms with 19% of issue slots busy, stalled on global
// loads; a first register-accumulator version 2.13 ms, a third of it in the dGs sum (a warp-wide shuffle
// reduction per element).
#pragma once

#include "bwd_common.cuh"

namespace deltacp::cuda::tiled::bwd {

template <class Op>
constexpr int dqkg_vtile() {
  return kIs16Bit<Op> ? 32 : 16;
}

template <class Op, int KP, bool PERKEY, int NS>
struct DqkgSmem {
  static constexpr int BV = dqkg_vtile<Op>();
  static constexpr int PT = kIs16Bit<Op> ? BV + 8 : BV + 4;  // operand tiles (ldmatrix rows 16-byte aligned)
  static constexpr int PF = BV + 4;                          // fp32 staging of dVn (16-byte rows)
  static constexpr int PK = kIs16Bit<Op> ? KP + 8 : KP + 4;  // q, k
  static constexpr int PG = KP + 4;                          // kda's G tile
  size_t dO = 0, Vn = 0, S = 0, dVnf = 0, dSf = 0, stage = 0, dVnb = 0, dSb = 0, q = 0, k = 0, G = 0, dGs = 0,
         kr_part = 0, kr_sum = 0, total = 0;
  __host__ __device__ constexpr DqkgSmem() {
    Carve c;
    dO = c.take(sizeof(Op) * kRows * PT);
    Vn = c.take(sizeof(Op) * kRows * PT);
    S = c.take(sizeof(Op) * KP * PT);
    dVnf = c.take(sizeof(float) * kRows * PF);
    dSf = c.take(sizeof(Op) * KP * PT);  // dS' as stored by B1 (input dtype)
    stage = c.off;
    c.off = stage * NS;
    dVnb = c.take(sizeof(Op) * kRows * PT);
    dSb = c.take(sizeof(Op) * KP * PT);
    q = c.take(sizeof(Op) * kRows * PK);
    k = c.take(sizeof(Op) * kRows * PK);
    G = c.take(sizeof(float) * (PERKEY ? kRows * PG : kRows));
    dGs = c.take(sizeof(float) * KP);
    kr_part = c.take(sizeof(float) * 4 * KP);  // KrSum partials of the four 16-row blocks
    kr_sum = c.take(sizeof(float) * KP);
    total = c.off;
  }
};

// x summed over the N lanes of each aligned group of N (N a power of two, at most 32); every lane gets it.
template <int N>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int s = N / 2; s > 0; s >>= 1) x += __shfl_xor_sync(0xffffffffu, x, s);
  return x;
}

template <class Op, int KP, bool PERKEY, int NS>
__global__ void __launch_bounds__(kThreads, 1) bwd_dqkg_kernel(const Args a) {
  constexpr DqkgSmem<Op, KP, PERKEY, NS> L{};
  constexpr int BV = L.BV, PT = L.PT, PF = L.PF, PK = L.PK, PG = L.PG;
  constexpr int NTK = KP / 16;  // n-tiles of 8 in a warp's half of the key columns
  extern __shared__ __align__(16) unsigned char smem[];
  Op* dVnb = reinterpret_cast<Op*>(smem + L.dVnb);
  Op* dSb = reinterpret_cast<Op*>(smem + L.dSb);
  Op* qs = reinterpret_cast<Op*>(smem + L.q);
  Op* ks = reinterpret_cast<Op*>(smem + L.k);
  float* Gs = reinterpret_cast<float*>(smem + L.G);
  float* dGs = reinterpret_cast<float*>(smem + L.dGs);
  float* kr_part = reinterpret_cast<float*>(smem + L.kr_part);
  float* kr_sum = reinterpret_cast<float*>(smem + L.kr_sum);
  auto at = [&](size_t base, int t) { return smem + base + static_cast<size_t>(t % NS) * L.stage; };

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t c = blockIdx.x, hv = blockIdx.y, hk = hv / a.group;
  const ChunkEntry ch = a.chunks[c];
  const int len = static_cast<int>(ch.len);
  const int K = static_cast<int>(a.K);
  const int V = static_cast<int>(a.V);
  const int ntiles = (V + BV - 1) / BV;
  const Op* hp = static_cast<const Op*>(a.h) + (c * a.HV + hv) * a.Kp * a.Vp;  // S = h[c], [Kp, Vp]
  const Op* dhp = static_cast<const Op*>(a.dh) + (c * a.HV + hv) * a.K * a.V;   // dS' = dh[c], [K, V]
  const Op* vnp = static_cast<const Op*>(a.vnew) + (ch.row0 * a.HV + hv) * a.Vp;  // Vn rows, HV * Vp apart
  const float* dvnp = a.dvnew + ws_row(ch, 0, a.HV, hv, a.V);                    // dVn rows, HV * V apart
  const Op* dop = static_cast<const Op*>(a.dout.ptr) + off(a.dout, ch.batch, ch.t0, hv);

  // The chunk's q, k, G (the epilogue's; gated variants only): one cp.async group, before tile 0's.
  if (a.gated) {
    load_chunk_rows<Op, KP>(qs, PK, a.q, ch, hk, len, K);
    load_chunk_rows<Op, KP>(ks, PK, a.k, ch, hk, len, K);
    load_chunk_G<KP, PERKEY>(Gs, PG, a, ch, hv, len);
  }
  cp_async_commit();
  // V tile t (columns v0 .. v0 + BV) into stage t % NS: one cp.async group. Rows past len (or K) and
  // columns past V are zero, so they add nothing to the products.
  auto issue = [&](int t) {
    const int v0 = t * BV, vw = min(BV, V - v0);
    Op* dOs = reinterpret_cast<Op*>(at(L.dO, t));
    Op* Vns = reinterpret_cast<Op*>(at(L.Vn, t));
    Op* Ss = reinterpret_cast<Op*>(at(L.S, t));
    float* dVnf = reinterpret_cast<float*>(at(L.dVnf, t));
    Op* dSf = reinterpret_cast<Op*>(at(L.dSf, t));
    load_tile<Op, kThreads>(dOs, PT, dop + v0, a.dout.stride_t, len, kRows, vw, BV, vec_ok(dop + v0, a.dout.stride_t));
    load_tile<Op, kThreads>(Vns, PT, vnp + v0, a.HV * a.Vp, len, kRows, vw, BV, vec_ok(vnp + v0, a.HV * a.Vp));
    load_tile<Op, kThreads>(Ss, PT, hp + v0, a.Vp, K, KP, vw, BV, vec_ok(hp + v0, a.Vp));
    load_tile<float, kThreads>(dVnf, PF, dvnp + v0, a.HV * a.V, len, kRows, vw, BV, vec_ok(dvnp + v0, a.HV * a.V));
    load_tile<Op, kThreads>(dSf, PT, dhp + v0, a.V, K, KP, vw, BV, vec_ok(dhp + v0, a.V));
    cp_async_commit();
  };

  for (int d = tid; d < KP; d += kThreads) dGs[d] = 0.f;
  const int mt_row = 16 * (warp & 3);       // this warp's 16 rows of every output
  const int half = warp >> 2;               // and its half of the columns
  const int n0k = half * (KP / 2), n0p = half * 32;
  float qg[1][NTK][4], wa[1][NTK][4], kr[1][NTK][4], dp[1][4][4];
  zero_acc(qg);
  zero_acc(wa);
  zero_acc(kr);
  zero_acc(dp);

  issue(0);  // V >= 1 (validate.cpp): at least one tile, and the loop's first wait covers q, k, G too
  for (int t = 0; t < ntiles; ++t) {
    await_tile<NS>(t, ntiles, issue);  // tile t (and the chunk's tiles loaded before the walk) landed
    __syncthreads();
    const Op* dOs = reinterpret_cast<const Op*>(at(L.dO, t));
    const Op* Vns = reinterpret_cast<const Op*>(at(L.Vn, t));
    const Op* Ss = reinterpret_cast<const Op*>(at(L.S, t));
    const float* dVnf = reinterpret_cast<const float*>(at(L.dVnf, t));
    const Op* dSf = reinterpret_cast<const Op*>(at(L.dSf, t));
    // dVn and dS' as operands in the input dtype, and dGs_d += sum_v dS'_dv S_dv in fp32. Each thread takes
    // EPT adjacent elements of one row (16-byte reads of the fp32 dVn staging); the TPR threads of a row d
    // then sum their parts in a fixed order and the first adds it to dGs[d] (deterministic).
    {
      constexpr int EPV = kRows * BV / kThreads, TPV = BV / EPV;  // dVn: elements per thread, threads per row
      static_assert(EPV % 4 == 0 && TPV * EPV == BV, "dVn conversion: whole float4 pieces per thread");
      const int i = tid / TPV, v = (tid % TPV) * EPV;
#pragma unroll
      for (int e = 0; e < EPV; e += 4) {
        const float4 x = *reinterpret_cast<const float4*>(dVnf + i * PF + v + e);
        store_pair(dVnb + i * PT + v + e, x.x, x.y);
        store_pair(dVnb + i * PT + v + e + 2, x.z, x.w);
      }
      constexpr int EPS = KP * BV / kThreads, TPS = BV / EPS;  // dS': elements per thread, threads per row
      static_assert(EPS % 4 == 0 && TPS * EPS == BV && (TPS & (TPS - 1)) == 0, "dS' conversion: float4 pieces");
      const int d = tid / TPS, w = (tid % TPS) * EPS;
      float part = 0.f;
#pragma unroll
      for (int e = 0; e < EPS; e += 4) {
        const Op* xs = dSf + d * PT + w + e;
        Op* xb = dSb + d * PT + w + e;
        xb[0] = xs[0], xb[1] = xs[1], xb[2] = xs[2], xb[3] = xs[3];
        const float x0 = to_f(xs[0]), x1 = to_f(xs[1]), x2 = to_f(xs[2]), x3 = to_f(xs[3]);
        const Op* sr = Ss + d * PT + w + e;
        part += x0 * to_f(sr[0]) + x1 * to_f(sr[1]) + x2 * to_f(sr[2]) + x3 * to_f(sr[3]);
      }
      part = group_sum<TPS>(part);
      if (tid % TPS == 0) dGs[d] += part;
    }
    __syncthreads();
    // B operands are transposed views (column-major): B(v, j) = Vn[j][v], B(v, d) = S[d][v], dS'[d][v].
    warp_mma<Op, 1, 4, Lay::rowmajor, Lay::colmajor>(dp, dOs, PT, mt_row, Vns, PT, n0p, 0, BV);
    warp_mma<Op, 1, NTK, Lay::rowmajor, Lay::colmajor>(qg, dOs, PT, mt_row, Ss, PT, n0k, 0, BV);
    warp_mma<Op, 1, NTK, Lay::rowmajor, Lay::colmajor>(wa, dVnb, PT, mt_row, Ss, PT, n0k, 0, BV);
    warp_mma<Op, 1, NTK, Lay::rowmajor, Lay::colmajor>(kr, Vns, PT, mt_row, dSb, PT, n0k, 0, BV);
    __syncthreads();  // the stage and dVnb / dSb are free for the next tile
  }

  // G of (row i, column d), rows clamped to the chunk (only rows < len are used).
  auto G_of = [&](int i, int d) -> float {
    if constexpr (PERKEY) return d < K ? Gs[i * PG + d] : 0.f;
    return Gs[i];
  };
  // KrSum_d = sum_{j < len} dKr_jd Kr_jd, Kr_jd = k_jd e^(Gn_d - G_jd): per warp over its 16 rows (its two
  // rows per lane, then the 8 lanes of a column), the four row blocks then summed in order.
  if (a.gated) {
#pragma unroll
    for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int d = n0k + acc_col(nt, j);
        float s = 0.f;
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int i = mt_row + acc_row(0, 2 * h2);
          if (i < len && d < K)
            s += kr[0][nt][2 * h2 + j] * to_f(ks[i * PK + d]) * exp_t<Op>(G_of(len - 1, d) - G_of(i, d));
        }
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        s += __shfl_xor_sync(0xffffffffu, s, 8);
        s += __shfl_xor_sync(0xffffffffu, s, 16);
        if (lane < 4) kr_part[(warp & 3) * KP + d] = s;
      }
    __syncthreads();
    for (int d = tid; d < KP; d += kThreads) kr_sum[d] = ((kr_part[d] + kr_part[KP + d]) + kr_part[2 * KP + d]) +
                                                         kr_part[3 * KP + d];
    __syncthreads();
  }

  // The epilogue on the accumulators: (row i, columns d, d + 1) per lane and n-tile.
  const bool pairs = (K % 2) == 0;  // rows of the [R, HV, K] workspaces stay 8-byte aligned
  float grow[2] = {0.f, 0.f};       // gdn: dG of rows mt_row + g (+ 8) summed over this lane's columns
#pragma unroll
  for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int i = mt_row + acc_row(0, 2 * h2), d = n0k + acc_col(nt, 0);
      if (i >= len || d >= K) continue;
      const int64_t o = ws_row(ch, i, a.HV, hv, a.K) + d;
      float dq[2], dk[2], dw[2], dg[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float dqg = qg[0][nt][2 * h2 + j], dkr = kr[0][nt][2 * h2 + j];
        dw[j] = -wa[0][nt][2 * h2 + j];
        if (a.gated && d + j < K) {
          const float Gid = G_of(i, d + j), Gn = G_of(len - 1, d + j);
          const float gam = exp_t<Op>(Gid), kdec = exp_t<Op>(Gn - Gid);
          dq[j] = a.scale * dqg * gam;
          dk[j] = dkr * kdec;
          dg[j] = a.scale * dqg * to_f(qs[i * PK + d + j]) * gam - dkr * to_f(ks[i * PK + d + j]) * kdec;
          if (i == len - 1) dg[j] += exp_t<Op>(Gn) * dGs[d + j] + kr_sum[d + j];
        } else {
          dq[j] = a.scale * dqg;
          dk[j] = dkr;
          dg[j] = 0.f;
        }
      }
      if (pairs) {  // d + 1 < K as well (K even, d even)
        *reinterpret_cast<float2*>(a.dqw + o) = make_float2(dq[0], dq[1]);
        *reinterpret_cast<float2*>(a.dkw + o) = make_float2(dk[0], dk[1]);
        store_pair(static_cast<Op*>(a.dW) + o, dw[0], dw[1]);
        if constexpr (PERKEY) *reinterpret_cast<float2*>(a.dGw + o) = make_float2(dg[0], dg[1]);
        else grow[h2] += dg[0] + dg[1];
      } else {
#pragma unroll
        for (int j = 0; j < 2; ++j)
          if (d + j < K) {
            a.dqw[o + j] = dq[j];
            a.dkw[o + j] = dk[j];
            static_cast<Op*>(a.dW)[o + j] = from_f<Op>(dw[j]);
            if constexpr (PERKEY) a.dGw[o + j] = dg[j];
            else grow[h2] += dg[j];
          }
      }
    }
  if constexpr (!PERKEY) {
    if (a.gated) {  // gdn: dGr = each row's dG summed over d, the four lanes of a row and then the two
                    // column halves in a fixed order (kr_part's bytes are free since kr_sum was formed)
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const float s = group_sum<4>(grow[h2]);
        if ((lane & 3) == 0) kr_part[half * kRows + mt_row + (lane >> 2) + 8 * h2] = s;
      }
      __syncthreads();
      if (tid < len) a.dGr[(ch.row0 + tid) * a.HV + hv] = kr_part[tid] + kr_part[kRows + tid];
    }
  }
  // dP = scale dO Vn^T on j <= i < len, zero elsewhere (every element of the 64 x 64 block written).
  float* dPg = a.dP + (c * a.HV + hv) * kRows * kRows;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int i = mt_row + acc_row(0, 2 * h2), j = n0p + acc_col(nt, 0);
      const float x0 = (i >= j && i < len) ? a.scale * dp[0][nt][2 * h2] : 0.f;
      const float x1 = (i >= j + 1 && i < len) ? a.scale * dp[0][nt][2 * h2 + 1] : 0.f;
      *reinterpret_cast<float2*>(dPg + i * kRows + j) = make_float2(x0, x1);
    }
}

}  // namespace deltacp::cuda::tiled::bwd
