// cuda/tiled/bwd_dv_local.cuh — backward stage B0: the intra-chunk part of dL/dVn.
//
//   P_ij   = sum_d q_id k_jd e^(G_id - G_jd)   for j <= i < len, else 0
//   dVn   <- scale P^T dO                      (the dh scan, bwd_dh_scan.cuh, adds Kr dS')
//
// One CTA per (chunk, value head), 256 threads. q, k, G come by cp.async; P (64 x 64) is formed once,
// then dO is walked in V tiles of 32 columns loaded by cp.async two stages deep: dVn tile = P^T (64 x 64)
// * dO tile (64 x 32).
//   gdn / delta: P = (Q K^T) o E with the scalar decay E_ij = e^(G_i - G_j): one tensor-core product.
//   kda:         the decay differs per key column: kda_scores (kda_scores.cuh, the forward's own) sums
//                the off-diagonal 16 x 16 blocks on the tensor cores around a reference row and only
//                the four diagonal blocks element by element.
// Writes a.dvnew (fp32) for every token of the chunk and every V column, and for kda a.Qg = Q e^G.
// Measured (H100, bf16 (2, 16384, 16, 128), torch.profiler, 2026-11-23): gdn 0.32 ms, kda 1.31 ms; kda 0.81 ->
// 0.59 ms (2026-11-27) with Q e^G written eight keys per thread (16-byte stores instead of 2-byte ones).
// Before, with every tile loaded element by element and kda's P summed element by element over the whole
// triangle (2080 pairs x K exponentials a chunk): 0.88 and 3.75 ms (kda at (1, 32768, 16, 128) under Nsight
// Compute: 4.53 ms).
#pragma once

#include "bwd_common.cuh"
#include "kda_scores.cuh"

namespace deltacp::cuda::tiled::bwd {

template <class Op, int KP, bool PERKEY>
struct DvLocalSmem {
  static constexpr int PK = kIs16Bit<Op> ? KP + 8 : KP + 4;        // q, k (and kda's scratch): 16-byte rows
  static constexpr int PP = kIs16Bit<Op> ? kRows + 8 : kRows + 4;  // P
  static constexpr int PV = kIs16Bit<Op> ? kVTile + 8 : kVTile + 4;
  static constexpr int PG = PERKEY ? KP + 4 : 1;                   // kda's G tile (16-byte rows)
  size_t q = 0, k = 0, G = 0, P = 0, dO = 0, xr = 0, yr = 0, total = 0;
  __host__ __device__ constexpr DvLocalSmem() {
    Carve c;
    q = c.take(sizeof(Op) * kRows * PK);
    k = c.take(sizeof(Op) * kRows * PK);
    G = c.take(sizeof(float) * kRows * PG);
    P = c.take(sizeof(Op) * kRows * PP);
    // kda_scores' scratch (kda), then the dO tiles over it (kda issues tile 0 once P is formed): fp32 kda at
    // K = 128 keeps to 149 KB (sm_80 gives 163 KB), at K <= 64 to 86 KB (sm_86 / sm_89: 99 KB).
    Carve s = c;
    dO = s.take(sizeof(Op) * 2 * kRows * PV);  // two stages
    Carve x = c;
    xr = PERKEY ? x.take(sizeof(Op) * 16 * PK) : 0;
    yr = PERKEY ? x.take(sizeof(Op) * kda_scores_y_rows(sizeof(Op)) * PK) : 0;
    total = s.off > x.off ? s.off : x.off;
  }
};

template <class Op, int KP, bool PERKEY>
__global__ void __launch_bounds__(kThreads, 2) bwd_dv_local_kernel(const Args a) {
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
  const int V = static_cast<int>(a.V);

  // q, k and G: one cp.async group (kda's G rows past len repeat the last row, as kda_scores needs; gdn's
  // are never read there: P is masked to i < len first).
  load_chunk_rows<Op, KP>(qs, PK, a.q, ch, hk, len, K);
  load_chunk_rows<Op, KP>(ks, PK, a.k, ch, hk, len, K);
  if (a.gated) {
    if constexpr (PERKEY) load_key_gate(Gs, PG, a.G, ch.row0, a.HV, hv, a.K, KP, len);
    else load_chunk_G<KP, false>(Gs, PG, a, ch, hv, len);
  }
  cp_async_commit();
  // dO tile t (columns 32 t ..) into stage t % 2: one group. Rows past len and columns past V are zero.
  const Op* dop = static_cast<const Op*>(a.dout.ptr) + off(a.dout, ch.batch, ch.t0, hv);
  const int64_t ldo = a.dout.stride_t;
  auto issue = [&](int t) {
    const int v0 = t * kVTile;
    load_tile<Op, kThreads>(dOs + (t % 2) * kRows * PV, PV, dop + v0, ldo, len, kRows, min(kVTile, V - v0), kVTile,
                            vec_ok(dop + v0, ldo));
    cp_async_commit();
  };
  if constexpr (!PERKEY) {
    issue(0);  // overlaps P
    cp_async_wait<1>();  // q, k, G
  } else {
    cp_async_wait<0>();  // q, k, G (tile 0 lands over kda_scores' scratch: issued after P below)
  }
  __syncthreads();

  if constexpr (PERKEY) {
    // Q e^G for the dh scan (B1), which cannot fold a per-key-column decay into its narrow operands: eight keys
    // per thread (16-byte rows; q and G are zero from K on), the workspace's rows Kp elements apart.
    Op* qg = static_cast<Op*>(a.Qg);
    const int pieces = static_cast<int>(a.Kp) / 8;
    const PieceRows rows_of(pieces);
    for (int e = tid; e < len * pieces; e += kThreads) {
      const int i = rows_of.row(e), d0 = 8 * (e - i * pieces);
      float x[8], g[8];
      load8(qs + i * PK + d0, x);
      load8f(Gs + i * PG + d0, g);
#pragma unroll
      for (int h = 0; h < 8; ++h) x[h] = d0 + h < K ? x[h] * exp_t<Op>(g[h]) : 0.f;
      store8(qg + ws_row(ch, i, a.HV, hv, a.Kp) + d0, x);
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
    // kda_scores writes the blocks on and below the block diagonal (rows past len: q is zero there);
    // the blocks above it are zero.
    for (int e = tid; e < kRows * kRows; e += kThreads) {
      const int i = e / kRows, j = e % kRows;
      if ((j >> 4) > (i >> 4)) Ps[i * PP + j] = from_f<Op>(0.f);
    }
    Op* xr = reinterpret_cast<Op*>(smem + L.xr);
    Op* yr = reinterpret_cast<Op*>(smem + L.yr);
    kda_scores<Op, kThreads>(qs, ks, PK, Gs, PG, xr, yr, KP, len, /*inclusive=*/true,
                             [&](int i, int j, float x) { Ps[i * PP + j] = from_f<Op>(x); });
    // The scratch was last read before kda_scores' last barrier (its diagonal blocks read q, k, G only).
    issue(0);
  }

  const int ntiles = (V + kVTile - 1) / kVTile;
  for (int t = 0; t < ntiles; ++t) {
    await_tile<2>(t, ntiles, issue);
    __syncthreads();  // P complete (t = 0); dO tile t landed for every thread
    const int v0 = t * kVTile;
    // dVn(j, v) = scale sum_i P_ij dO_iv: A = P^T (column-major view of P).
    block_gemm<Op, kRows, kVTile, Lay::colmajor, Lay::rowmajor>(Ps, PP, dOs + (t % 2) * kRows * PV, PV, kRows,
                                                                 [&](int j, int v, float x) {
      if (j < len && v0 + v < V) a.dvnew[ws_row(ch, j, a.HV, hv, a.V) + v0 + v] = a.scale * x;
    });
    __syncthreads();  // stage t % 2 is free for tile t + 2
  }
}

}  // namespace deltacp::cuda::tiled::bwd
