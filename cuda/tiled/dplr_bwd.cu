// cuda/tiled/dplr_bwd.cu — the tiled tier's full DPLR backward: dq, dk, dv, da, db, dgk and dh0 (dht in), the
// chunk form's reverse mode (reference/src/chunked.cpp, chunk_backward) as stages on the tensor cores.
//
// Notation of dplr_fwd.cu's opening comment (per chunk of n <= 64 tokens: G, Gp, A_ab, A_ak, T, W, U, Ut, Kd,
// Bd, D_n, P_qk, P_qb, q e^G); S = the chunk's start state, dS = dL/dS at its end, dO_s = scale dO. The
// reference's chunk backward, regrouped so that every product over the value axis is one of a few matrices:
//
//   dUt  = P_qb^T dO_s + Bd dS                      dS_start = D_n dS + (q e^G)^T dO_s + W^T dUt
//   dUt' = T^T dUt                                  (dL/d(A_ak V), through U = T A_ak V)
//   dv   = P_qk^T dO_s + Kd dS + A_ak^T dUt'
//   dM_qk = tril_incl(dO_s V^T)     dM_qb = tril_incl(dO_s Ut^T)                  (the score gradients)
//   dA_ak = strict_tril(dUt' V^T)   dA_ab = strict_tril(dUt' Ut^T)
//   (the last: T^T dT T^T with dT = dW (a e^Gp)^T + dUt (A_ak V)^T and dW = dUt S^T is dUt' (W S + U)^T
//   = dUt' Ut^T, since W = T (a e^Gp) and U = T A_ak V)
//   dq = (dO_s S^T) e^G + gram_X(dM_qk; q, k) + gram_X(dM_qb; q, b)
//   da = (dUt' S^T) e^Gp + gram_X(dA_ab; a, b) + gram_X(dA_ak; a, k)
//   dk = (V dS^T) e^(G_n - G) + gram_Y(dM_qk) + gram_Y(dA_ak)
//   db = (Ut dS^T) e^(G_n - G) + gram_Y(dM_qb) + gram_Y(dA_ab)
// where, for a score M(i, j) = sum_d X_id Y_jd e^(Gl_id - Gr_jd), gram_X_id = sum_j dM_ij Y_jd e^(Gl_id - Gr_jd)
// and gram_Y_jd = sum_i dM_ij X_id e^(Gl_id - Gr_jd). The gate: every e^(..) factor is differentiated where it
// stands (docs/design.md section 3.3), which sums to
//   dG  = q dq - k dk - b db + dGp,   dGp = a da   (elementwise)
//   dG_{n-1} += D_n rowsum(dS S) + colsum(k (V dS^T) e^(G_n - G) + b (Ut dS^T) e^(G_n - G))
//   dgk = reverse_cumsum(dG) - dGp                  (within the chunk)
// A numpy emulation of exactly these stages (the 16 x 16 blocks below included) equals the fp64 reference's
// backward to 1e-15.
//
// The score gradients go back through the scores' 16 x 16 blocks (dplr_scores.cuh) with the same reference rows,
// so every exponent stays <= 0 for gk <= 0 (deltacp.dplr routes other gates to the naive tier). The scores come in
// pairs that share X and the gates (P_qk, P_qb: X = q, Gl = Gr = G; A_ab, A_ak: X = a, Gl = Gp, Gr = G), and each
// pair goes back together (dplr_gram_backward_pair): with reference row r = 16 a (a = 1..3),
// Ys_j = Y_j e^(Gl_r - Gr_j) for j < r, for both Y's, and Xs_i = X_i e^(Gl_i - Gl_r) for i >= r, then
//   gram_X over block row a (i in [r, r + 16), j < r):      e^(Gl_i - Gl_r) (dM1[i, :r] Y1s + dM2[i, :r] Y2s)
//   gram_Y over block column a - 1 (j in [r - 16, r), i >= r): e^(Gl_r - Gr_j) (dMk[r:, j]^T Xs), k = 1, 2
// on the tensor cores; a diagonal block (warp a, a lane per key column) forms each pair (i, j) inside the mask once,
// with one exponential e^(Gl_id - Gr_jd) for the four sums it enters (dX_i for both scores, dY1_j, dY2_j): a
// quarter of the exponentials of summing gram_X and gram_Y of each score on its own, element by element (at
// K = 64: 256 a thread, against about 1,024 in the first version's serial loops of dependent shared-memory loads).
//
// Kernels (128 threads each; the forward's stages first, then the reverse scan, then two chunk-parallel ones):
//   1 dplr_wy_kernel        (dplr_stages.cuh) as in the forward, also keeping T and A_ak
//   2 dplr_scan_kernel      the forward's state scan: chunk-start states h_c and Ut (no o, no ht)
//   3 dplr_output_kernel    without o: q e^G, P_qb and P_qk
//   4 dplr_dh0_scan_kernel  grid (N * H, VP / BV): the reverse scan above, dS in fp32 registers; keeps dS at
//                           each chunk's end (dh_c) and dUt; dh0. BV = 16 value columns per CTA where the 32-column
//                           grid would fill at most half the GPU's resident CTA slots (a few long sequences), else
//                           32 (dplr_scan_narrow; the same for kernel 2)
//   5 dplr_bwd_dv_kernel    grid (chunks, H): per 32 value columns dUt' (kept), dv; the four score gradients
//                           (two passes over the value blocks, two 64 x 64 accumulators each)
//   6 dplr_bwd_dk_kernel    grid (chunks * KP / 32, H): per 32 key columns, G (the WY stage's, by cp.async with the
//                           q, k, b columns), the four [n, 32] products over the value axis (16-column value blocks
//                           in two stages of tiles: the next block's copies in flight during this block's products;
//                           four 16 x 32 accumulators per warp), then the gram gradients by pairs (the first pair's
//                           score gradients copied in during the last value block, the first terms and dL/dG_{n-1};
//                           the second pair with the a columns once dq is out), dG, dgk (the reverse sum down the
//                           chunk by four warps of 16 rows); writes dq (after the first pair), dk, da, db, dgk
// On compute capability 9.0, for bf16 / fp16 at K = V = 64 or K = V = 128 and chunk 64, kernels 5 and 6 are
// replaced by one Hopper kernel, dplr_bwd_local_wgmma.cuh (DELTACP_TILED_DPLR_BWD_LOCAL=0 keeps them; "1" requires
// it): one CTA of 256 threads per (chunk, head) at K = 64, one per (chunk, head, key half) at K = 128 (each forms
// dUt' and the four score gradients whole, and its 64 key columns of dq, dk, da, db, dgk and value columns of
// dv), the same products as whole-chunk wgmma products, dUt' and the four score gradients kept in shared memory
// (neither they nor the triangles go through HBM), and the gram gradients taken about one reference per key column
// (the chunk's midpoint decay, c_d = G_{n-1,d} / 2) instead of the 16-row reference blocks below: one product per
// score and side, with an element-by-element fp32 fallback for columns whose span would leave the 16-bit range
// (steep gates). Its opening comment gives the algorithm and its speed (H100, (4,4096,32,64): 1.17 ms where
// kernels 5 + 6 took 0.71 + 3.08; (1,16384,16,128): 1.69 ms where they took 0.52 + 3.09). Everything else (fp32,
// other K / V, other GPUs, chunk sizes below 64) runs the six kernels below.
//
// Intermediates (workspace, beyond the forward's): T, A_ak, P_qk, P_qb p.dtype [chunks, H, 64, 64]; q e^G
// p.dtype [R, H, KP]; Ut, dUt, dUt' p.dtype [R, H, VP]; h_c, dh_c p.dtype [chunks, H, KP, VP]; the score
// gradients p.dtype [chunks, H, 4, 64, 64] (tensor-core operands of kernel 6 anyway; kernel 6 reads only their
// lower block triangles). The chunk-local kernel needs neither dUt' nor the score gradients.
//
// Kernel 6 is latency-bound: about 8,000 instructions a warp (exponentials included) against the ~57 us a CTA took
// in the previous version at (2,8192,32,64) (3.55 ms for 62 waves of 264 CTAs), spent in some 25 barrier-separated
// phases and five exposed global round trips with two CTAs (8 warps) per SM. So this version cuts the exposed
// round trips (G by cp.async with the inputs instead of a cumulative sum of the gates behind a chain of global
// loads and three barriers; the value blocks double-buffered; the first pair of score gradients in flight during
// the last value block) and raises the warps per SM to hide the rest: 16-bit inputs fit three CTAs per H100 / H200
// SM (73,616 bytes, 94,096 before), from four changes of layout that do the same math:
//   - the score gradients held as their lower block triangles only (block row a: 16 (a + 1) columns; 6,144 bytes
//     each at 16 bits instead of 9,216), gram_Y's column of blocks taken one block row at a time;
//   - a over q: a is read only by the second pair and by dG; q only by the first pair and dG, so q dq goes to
//     registers (16 a thread, the dgk phase's layout) and dq out once the first pair is done, and a comes in with
//     the second pair's copies;
//   - da over dq (da's first term kept in registers until then);
//   - 16-column value blocks, two stages, the second over dq, dk, db (written only after the last block).
// Registers are held to 168 for three CTAs (__launch_bounds__(128, 3)); ptxas reports no spills.
//
// Dynamic shared memory (bytes, BdvSmem / BdkSmem in dplr_stages.cuh; kernels 1-4 as in dplr_fwd.cu):
//                 bf16/fp16 K <= 64   K <= 128     fp32 K <= 64   K <= 128
//   dv            67,584              80,896       124,928        150,528
//   dk            73,616              73,616       103,312        103,312     (previous version: 94,096 / 134,032;
//                                                                              first version: 92,304 / 129,168)
//   dk: see BdkSmem (16-bit: three CTAs per H100 / H200 SM, two before; fp32: two, one before). As for the
//   forward, 16-bit K <= 64 fits every sm_80+ GPU, 16-bit K <= 128 and fp32 K <= 64 need sm_80 / sm_90, fp32
//   K <= 128 Hopper only; tests/cuda/test_smem_fit.cu checks these layouts on the host.
// Registers (nvcc 13 -Xptxas -v, sm_80 / sm_90a, no spills): dv 140 / 142 (KP 64), 188 / 186 (KP 128) at 16 bits,
// 207-214 at fp32 (unchanged); dk 168 / 168 at 16 bits (its cap for three CTAs), 226 / 224 at fp32 (previous
// version: 128 / 128 and 250 / 234). Kernels 1-4 as in dplr_fwd.cu.
// Speed (NVIDIA H100, bf16, bench/gpu/bench_dplr.py beside FLA 0.5.2, 2026-11-28): forward + backward 3.76 ms at
// (4,4096,32,64), 3.88 at (2,8192,32,64) and 5.21 at (1,16384,16,128) with the chunk-local kernel, the two scans side
// by side and, at K = 128, on 8 warps: 1.65, 1.70 and 1.60x the speed of FLA's faster configuration (6.19, 6.62, 8.35
// ms); at (1,16384,16,128) 5.73 ms with the scans on 4 warps, 6.13 with them in order as well. With kernels 5 and 6
// everywhere: 6.33, 6.60 and 7.90 ms (0.98, 1.00 and 1.06x) on 2026-11-27, before the chunk-local kernel; the first
// version took 12.5, 13.0 and 18.3 ms on the same GPU, the previous one (kernel 6 at two CTAs per SM, 32-column scans)
// 7.10, 7.30 and 9.41. Kernel time per forward + backward (bench/gpu/stage_times.py --variant dplr --backward, scans in
// order, 2026-11-28): (1,16384,16,128) 6.17 ms: the chunk-local kernel 1.71, the scan's two launches 1.46, wy 1.23,
// output 0.89, the reverse scan 0.85 (all on 4 warps); side by side the elapsed time per call went 6.43 -> 6.09 ms.
// Kernels 5 and 6 (where the chunk-local kernel does not run) as before: kernel 5 passes over the value blocks twice
// (four 64 x 64 accumulators at once would hold 128 registers per thread); kernel 6 loads every value tile once per 32
// key columns (4 times at K = 128, through L2: the key blocks of a chunk are neighbours in the grid); the workspace
// holds 10 per-chunk intermediates in HBM (the forward's, plus T, A_ak, P_qk, dh_c, dUt, dUt' and the score gradients).
#include "../common/kernel_switch.h"
#include "../common/side_stream.h"
#include "dplr_bwd_local_wgmma.cuh"
#include "dplr_stages.cuh"

namespace deltacp::cuda::tiled {
namespace {

// ---- stage 5: dUt' = T^T dUt, dv, the four score gradients ---------------------------------------------------
template <class T, int KP>
__global__ void __launch_bounds__(kDThreads) dplr_bwd_dv_kernel(const DplrArgs<T> x) {
  using L = BdvSmem<T, KP>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sT = smem_at<T>(smem, L::Tt);
  T* sAk = smem_at<T>(smem, L::Ak);
  T* sPk = smem_at<T>(smem, L::Pk);
  T* sKd = smem_at<T>(smem, L::Kd);
  T* sdUt = smem_at<T>(smem, L::dUt);
  T* sdUtp = smem_at<T>(smem, L::dUtp);
  T* sdO = smem_at<T>(smem, L::dO);
  T* sV = smem_at<T>(smem, L::V);
  T* sUt = smem_at<T>(smem, L::Ut);
  T* sdS = smem_at<T>(smem, L::dS);

  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t c = blockIdx.x, h = blockIdx.y;
  const ChunkEntry ch = x.chunks[c];
  const int len = static_cast<int>(ch.len);
  const int Vn = static_cast<int>(x.V);
  const int64_t wrow = ch.row0 * x.H + h;
  const int64_t ldk_g = x.H * KP, ldv_g = x.H * x.VP;
  const int64_t mat0 = (c * x.H + h) * kDRows * kDRows;
  {
    const T* pT = x.Tg + mat0;
    const T* pA = x.Akg + mat0;
    const T* pP = x.Pk + mat0;
    const T* pK = x.Kd + wrow * KP;
    load_tile<T, kDThreads>(sT, L::ld64, pT, kDRows, kDRows, kDRows, kDRows, kDRows, vec_ok(pT, kDRows));
    load_tile<T, kDThreads>(sAk, L::ld64, pA, kDRows, kDRows, kDRows, kDRows, kDRows, vec_ok(pA, kDRows));
    load_tile<T, kDThreads>(sPk, L::ld64, pP, kDRows, kDRows, kDRows, kDRows, kDRows, vec_ok(pP, kDRows));
    load_tile<T, kDThreads>(sKd, L::ldk, pK, ldk_g, len, kDRows, KP, KP, vec_ok(pK, ldk_g));
    cp_async_commit();  // waited for with the first value block
  }
  const T* pdo = x.dout.at(ch.batch, ch.t0, h);
  const T* pv = x.v.at(ch.batch, ch.t0, h);
  const T* put = x.Ut + wrow * x.VP;
  const T* pdut = x.dUt + wrow * x.VP;
  T* pdutp = x.dUtp + wrow * x.VP;
  const T* pdh = x.dh + (c * x.H + h) * KP * x.VP;

  // Pass 1, per value block: dUt' (to shared memory and the workspace), dv, and dA_ab, dA_ak accumulated over the
  // blocks (warp w: rows [16 w, 16 w + 16) of each).
  float accA[1][8][4], accAk[1][8][4];
  zero_acc(accA);
  zero_acc(accAk);
#pragma unroll 1
  for (int v0 = 0; v0 < x.VP; v0 += kDBV) {
    load_tile<T, kDThreads>(sdUt, L::ldv, pdut + v0, ldv_g, len, kDRows, kDBV, kDBV, vec_ok(pdut + v0, ldv_g));
    load_tile<T, kDThreads>(sdO, L::ldv, pdo + v0, x.dout.st, len, kDRows, Vn - v0, kDBV, vec_ok(pdo + v0, x.dout.st));
    load_tile<T, kDThreads>(sV, L::ldv, pv + v0, x.v.st, len, kDRows, Vn - v0, kDBV, vec_ok(pv + v0, x.v.st));
    load_tile<T, kDThreads>(sUt, L::ldv, put + v0, ldv_g, len, kDRows, kDBV, kDBV, vec_ok(put + v0, ldv_g));
    load_tile<T, kDThreads>(sdS, L::ldv, pdh + v0, x.VP, KP, KP, kDBV, kDBV, vec_ok(pdh + v0, x.VP));
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    {  // dUt' = T^T dUt (T read as [j, i]: column-major)
      float acc[1][4][4];
      zero_acc(acc);
      warp_mma<T, 1, 4, Lay::colmajor, Lay::rowmajor>(acc, sT, L::ld64, 16 * warp, sdUt, L::ldv, 0, 0, kDRows);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int i = 16 * warp + acc_row(0, e), col = acc_col(nt, e);
          store_pair(sdUtp + i * L::ldv + col, acc[0][nt][e], acc[0][nt][e + 1]);
          if (i < len) store_pair(pdutp + int64_t(i) * ldv_g + v0 + col, acc[0][nt][e], acc[0][nt][e + 1]);
        }
    }
    // dv = scale P_qk^T dO + Kd dS + A_ak^T dUt'
    float dv[1][4][4];
    zero_acc(dv);
    warp_mma<T, 1, 4, Lay::colmajor, Lay::rowmajor>(dv, sPk, L::ld64, 16 * warp, sdO, L::ldv, 0, 0, kDRows);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dv[0][nt][e] *= x.scale;
    warp_mma<T, 1, 4, Lay::rowmajor, Lay::rowmajor>(dv, sKd, L::ldk, 16 * warp, sdS, L::ldv, 0, 0, KP);
    __syncthreads();  // every row of dUt' is in shared memory
    warp_mma<T, 1, 4, Lay::colmajor, Lay::rowmajor>(dv, sAk, L::ld64, 16 * warp, sdUtp, L::ldv, 0, 0, kDRows);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + acc_row(0, e), col = v0 + acc_col(nt, e);
        if (i < len && col < Vn) store_f(x.dv.at(ch.batch, ch.t0 + i, h) + col, dv[0][nt][e]);
      }
    // dA_ab += dUt' Ut^T, dA_ak += dUt' V^T (Ut, V read as [token, value]: column-major B operands)
    warp_mma<T, 1, 8, Lay::rowmajor, Lay::colmajor>(accA, sdUtp, L::ldv, 16 * warp, sUt, L::ldv, 0, 0, kDBV);
    warp_mma<T, 1, 8, Lay::rowmajor, Lay::colmajor>(accAk, sdUtp, L::ldv, 16 * warp, sV, L::ldv, 0, 0, kDBV);
    __syncthreads();  // the next block's loads overwrite the tiles
  }
  // The score gradients, masked (strict lower for A_ab / A_ak, inclusive for P_qk / P_qb; rows and columns past
  // len are zero already), whole 64 x 64 matrices so that the next stage loads them unmasked.
  T* pM = x.dM + (c * x.H + h) * 4 * kDRows * kDRows;
  auto store_mask = [&](float(&acc)[1][8][4], T* M, float mul, bool inclusive) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int i = 16 * warp + acc_row(0, e), j = acc_col(nt, e);
        const bool ok0 = i < len && (inclusive ? j <= i : j < i), ok1 = i < len && (inclusive ? j + 1 <= i : j + 1 < i);
        store_pair(M + i * kDRows + j, ok0 ? mul * acc[0][nt][e] : 0.f, ok1 ? mul * acc[0][nt][e + 1] : 0.f);
      }
  };
  store_mask(accA, pM + 2 * kDRows * kDRows, 1.f, false);
  store_mask(accAk, pM + 3 * kDRows * kDRows, 1.f, false);

  // Pass 2: dM_qk = dO V^T and dM_qb = dO Ut^T over the value blocks, times scale.
  float accQk[1][8][4], accQb[1][8][4];
  zero_acc(accQk);
  zero_acc(accQb);
#pragma unroll 1
  for (int v0 = 0; v0 < x.VP; v0 += kDBV) {
    load_tile<T, kDThreads>(sdO, L::ldv, pdo + v0, x.dout.st, len, kDRows, Vn - v0, kDBV, vec_ok(pdo + v0, x.dout.st));
    load_tile<T, kDThreads>(sV, L::ldv, pv + v0, x.v.st, len, kDRows, Vn - v0, kDBV, vec_ok(pv + v0, x.v.st));
    load_tile<T, kDThreads>(sUt, L::ldv, put + v0, ldv_g, len, kDRows, kDBV, kDBV, vec_ok(put + v0, ldv_g));
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    warp_mma<T, 1, 8, Lay::rowmajor, Lay::colmajor>(accQk, sdO, L::ldv, 16 * warp, sV, L::ldv, 0, 0, kDBV);
    warp_mma<T, 1, 8, Lay::rowmajor, Lay::colmajor>(accQb, sdO, L::ldv, 16 * warp, sUt, L::ldv, 0, 0, kDBV);
    __syncthreads();
  }
  store_mask(accQk, pM, x.scale, true);
  store_mask(accQb, pM + kDRows * kDRows, x.scale, true);
}

// ---- stage 6: dq, dk, da, db, dgk for 32 key columns -----------------------------------------------------------
// gram_X / gram_Y of two scores that share X and the gates, M1(i, j) = sum_d X_id Y1_jd e^(Gl_id - Gr_jd) and M2
// the same with Y2 (P_qk, P_qb: X = q, Gl = Gr = G; A_ab, A_ak: X = a, Gl = Gp, Gr = G), for this CTA's key
// columns (j < i, or j <= i when kIncl), added to dX, dY1 and dY2 (fp32, ldf; three distinct arrays). dM1, dM2:
// the score gradients, each its lower block triangle (BdkSmem::dm_ld / dm_off: block row a holds columns
// [0, 16 (a + 1)); zero outside the triangle and past len). X, Y1, Y2: 64 x kDKB tiles (ldx,
// zero past len); Gl, Gr: 64 rows (ldg). scr: a 64 x kDKB scratch tile, scr2: 48 rows. All 128 threads; ends
// with __syncthreads.
//
// Off-diagonal blocks, reference row r = 16 a (a = 1..3), every exponent <= 0: scr rows j < r hold
// Y1_j e^(Gl_r - Gr_j) (scr2: Y2's, the same factor), rows i >= r hold X_i e^(Gl_i - Gl_r) (shared by both
// scores); then warps 0, 1 form gram_X of block row a, e^(Gl_i - Gl_r) (dM1[i, :r] Y1s + dM2[i, :r] Y2s), and
// warps 2, 3 gram_Y of block column a - 1 for both scores, e^(Gl_r - Gr_j) (dMk[r:, j]^T Xs).
// Diagonal blocks (warp a: block (a, a), lane: key column): each pair (i, j) of the block takes its factor
// E = e^(Gl_id - Gr_jd) (<= 0 in the exponent: only pairs inside the mask are formed) once for the four sums it
// enters: dX_i += (dM1_ij Y1_j + dM2_ij Y2_j) E, dY1_j += dM1_ij X_i E, dY2_j += dM2_ij X_i E. That is a quarter
// of the exponentials of summing gram_X and gram_Y of each score on its own.
template <class T, bool kIncl>
__device__ void dplr_gram_backward_pair(const T* dM1, const T* dM2, const T* X, const T* Y1, const T* Y2,
                                        const float* Gl, const float* Gr, float* dX, float* dY1, float* dY2, T* scr,
                                        T* scr2, int len) {
  using L = BdkSmem<T>;
  constexpr int ldx = L::ldx, ldg = L::ldg, ldf = L::ldf;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
#pragma unroll 1
  for (int a = 1; a < 4; ++a) {
    const int r = 16 * a;
    if (r >= len) break;  // uniform: rows and columns from r on are zero
    const float* Glr = Gl + r * ldg;
    for (int idx = tid; idx < kDRows * (kDKB / 8); idx += kDThreads) {  // eight keys per thread
      const int i = idx / (kDKB / 8), d0 = 8 * (idx - i * (kDKB / 8));
      float gr[8], g[8], v[8];
      load8f(Glr + d0, gr);
      if (i < r) {
        float v2[8];
        load8f(Gr + i * ldg + d0, g);
        load8(Y1 + i * ldx + d0, v);
        load8(Y2 + i * ldx + d0, v2);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float f = exp_t<T>(gr[e] - g[e]);
          v[e] *= f;
          v2[e] *= f;
        }
        store8(scr + i * ldx + d0, v);
        store8(scr2 + i * ldx + d0, v2);
      } else {
        load8f(Gl + i * ldg + d0, g);
        load8(X + i * ldx + d0, v);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] *= exp_t<T>(g[e] - gr[e]);
        store8(scr + i * ldx + d0, v);
      }
    }
    __syncthreads();
    const int n0 = 16 * (warp & 1);
    if (warp < 2) {
      const int lda = L::dm_ld(a), off = L::dm_off(a);  // block row a: rows [r, r + 16), columns [0, r) here
      float acc[1][2][4];
      zero_acc(acc);
      warp_mma<T, 1, 2, Lay::rowmajor, Lay::rowmajor>(acc, dM1 + off, lda, 0, scr, ldx, n0, 0, r);
      warp_mma<T, 1, 2, Lay::rowmajor, Lay::rowmajor>(acc, dM2 + off, lda, 0, scr2, ldx, n0, 0, r);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = r + acc_row(0, e), d = n0 + acc_col(nt, e);
          dX[i * ldf + d] += acc[0][nt][e] * exp_t<T>(Gl[i * ldg + d] - Glr[d]);
        }
    } else {  // dM read as [j, i]: column-major
      float acc1[1][2][4], acc2[1][2][4];
      zero_acc(acc1);
      zero_acc(acc2);
      // block column a - 1 (columns [r - 16, r)) down the block rows from a, one 16-row block row at a time
      // (rows from len on are zero: skipped)
#pragma unroll 1
      for (int rb = a; rb < 4 && 16 * rb < len; ++rb) {
        const int lda = L::dm_ld(rb), off = L::dm_off(rb);
        const T* xs = scr + 16 * rb * ldx;
        warp_mma<T, 1, 2, Lay::colmajor, Lay::rowmajor>(acc1, dM1 + off, lda, r - 16, xs, ldx, n0, 0, 16);
        warp_mma<T, 1, 2, Lay::colmajor, Lay::rowmajor>(acc2, dM2 + off, lda, r - 16, xs, ldx, n0, 0, 16);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = r - 16 + acc_row(0, e), d = n0 + acc_col(nt, e);
          const float f = exp_t<T>(Glr[d] - Gr[j * ldg + d]);
          dY1[j * ldf + d] += acc1[0][nt][e] * f;
          dY2[j * ldf + d] += acc2[0][nt][e] * f;
        }
    }
    __syncthreads();  // the next reference row rewrites the scratch
  }
  // Diagonal blocks.
  static_assert(kDKB == 32, "a lane per key column");
  if (16 * warp < len) {  // uniform over the warp
    const int r = 16 * warp, d = lane;
    const int ldm = L::dm_ld(warp);  // block row warp of the triangles
    const T* M1 = dM1 + L::dm_off(warp);
    const T* M2 = dM2 + L::dm_off(warp);
    float xv[16], gl[16], sx[16];
#pragma unroll
    for (int il = 0; il < 16; ++il) {
      xv[il] = to_f(X[(r + il) * ldx + d]);
      gl[il] = Gl[(r + il) * ldg + d];
      sx[il] = 0.f;
    }
#pragma unroll
    for (int jl = 0; jl < 16; ++jl) {
      const int j = r + jl;
      const float y1 = to_f(Y1[j * ldx + d]), y2 = to_f(Y2[j * ldx + d]), gr = Gr[j * ldg + d];
      float sy1 = 0.f, sy2 = 0.f;
#pragma unroll
      for (int il = kIncl ? jl : jl + 1; il < 16; ++il) {
        const float m1 = to_f(M1[il * ldm + j]), m2 = to_f(M2[il * ldm + j]);
        const float ef = exp_t<T>(gl[il] - gr);
        sx[il] = fmaf(fmaf(m1, y1, m2 * y2), ef, sx[il]);
        const float xe = xv[il] * ef;
        sy1 = fmaf(m1, xe, sy1);
        sy2 = fmaf(m2, xe, sy2);
      }
      dY1[j * ldf + d] += sy1;
      dY2[j * ldf + d] += sy2;
    }
#pragma unroll
    for (int il = 0; il < 16; ++il) dX[(r + il) * ldf + d] += sx[il];
  }
  __syncthreads();
}

// Three CTAs per SM at 16 bits (BdkSmem: 73,616 bytes; registers held to 168 for it), two at fp32.
template <class T, int KP>
__global__ void __launch_bounds__(kDThreads, kIs16Bit<T> ? 3 : 2) dplr_bwd_dk_kernel(const DplrArgs<T> x) {
  using L = BdkSmem<T>;
  constexpr int KB = kDKB, VB = L::kVB;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sq = smem_at<T>(smem, L::q);
  T* sa = smem_at<T>(smem, L::a);  // over q, once dq is out
  T* sk = smem_at<T>(smem, L::k);
  T* sb = smem_at<T>(smem, L::b);
  float* sG = smem_at<float>(smem, L::G);
  float* sdq = smem_at<float>(smem, L::dq);
  float* sda = smem_at<float>(smem, L::da);  // over dq, once dq is out
  float* sdk = smem_at<float>(smem, L::dk);
  float* sdb = smem_at<float>(smem, L::db);
  T* sM = smem_at<T>(smem, L::dM);
  T* scr = smem_at<T>(smem, L::scr);
  T* scr2 = smem_at<T>(smem, L::scr2);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // blockIdx.x = chunk * (KP / 32) + key block: the key blocks of one (chunk, head) run side by side and read
  // its value tiles and score gradients through L2 once.
  constexpr int kBlocks = KP / KB;
  const int64_t c = blockIdx.x / kBlocks, h = blockIdx.y;
  const int kb0 = static_cast<int>(blockIdx.x % kBlocks) * KB;
  const int K = static_cast<int>(x.K);
  if (kb0 >= K) return;  // uniform: a key block wholly past K
  const int Kleft = K - kb0;
  const ChunkEntry ch = x.chunks[c];
  const int len = static_cast<int>(ch.len);
  const int Vn = static_cast<int>(x.V);
  const int64_t wrow = ch.row0 * x.H + h;
  const int64_t ldv_g = x.H * x.VP;

  // Inputs: the q, k, b columns (zero past len and K; a comes over q later) and G, the WY stage's (fp32 [R, H, KP],
  // zero past K) by cp.async into rows 1..64 of sG (rows past len repeat G_{len-1}: finite exponents on the zero
  // rows; row 0 = 0): one copy group with the tiles, not a cumulative sum of the gates of its own (a chain of
  // global loads and three barriers before the first value block).
  const T* pa = x.a.at(ch.batch, ch.t0, h) + kb0;
  {
    const T* pq = x.q.at(ch.batch, ch.t0, h) + kb0;
    const T* pk = x.k.at(ch.batch, ch.t0, h) + kb0;
    const T* pb = x.b.at(ch.batch, ch.t0, h) + kb0;
    load_tile<T, kDThreads>(sq, L::ldx, pq, x.q.st, len, kDRows, Kleft, KB, vec_ok(pq, x.q.st));
    load_tile<T, kDThreads>(sk, L::ldx, pk, x.k.st, len, kDRows, Kleft, KB, vec_ok(pk, x.k.st));
    load_tile<T, kDThreads>(sb, L::ldx, pb, x.b.st, len, kDRows, Kleft, KB, vec_ok(pb, x.b.st));
    load_key_gate(sG + L::ldg, L::ldg, x.G + kb0, ch.row0, x.H, h, KP, KB, len);
    if (tid < KB) sG[tid] = 0.f;
    cp_async_commit();
    // the first value block's wait and __syncthreads cover them
  }
  // Two score gradients into the region (their lower block triangles; one copy group with whatever the caller
  // issued before).
  const T* pM = x.dM + (c * x.H + h) * 4 * kDRows * kDRows;
  const int64_t mstride = L::tileM / int64_t(sizeof(T));
  auto issue_pair = [&](int slot) {
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
      for (int rb = 0; rb < 4; ++rb) {
        const T* src = pM + (slot + m) * kDRows * kDRows + 16 * rb * kDRows;
        load_tile<T, kDThreads>(sM + m * mstride + L::dm_off(rb), L::dm_ld(rb), src, kDRows, 16, 16, 16 * (rb + 1),
                                16 * (rb + 1), vec_ok(src, kDRows));
      }
    }
    cp_async_commit();
  };
  auto wait_pair = [&]() {
    cp_async_wait<0>();
    __syncthreads();
  };

  // The four products over the value axis for these key columns (warp w: rows [16 w, 16 w + 16)):
  //   dO S^T, dUt' S^T, V dS^T, Ut dS^T  (S, dS rows [kb0, kb0 + 32) of h_c / dh_c read as [key, value]:
  //   column-major B operands); and sum_v dS_dv S_dv for key row tid / 4 (four values of a block a thread, the
  //   four threads of a row joined by shuffles after the last block).
  // 16-column value blocks in two stages of tiles, block vb in stage vb & 1 (0: the region, 1: over dq, dk, db),
  // the next block's copies in flight during this block's products. The last block is odd (VP / 16 is even), so
  // the region is free from the last block on: the first pair of score gradients goes there then, in flight
  // during the last block, the first terms and dL/dG_{n-1}.
  float aq[1][4][4], aa[1][4][4], ak[1][4][4], ab[1][4][4];
  zero_acc(aq);
  zero_acc(aa);
  zero_acc(ak);
  zero_acc(ab);
  float rs = 0.f;
  {
    const T* pdo = x.dout.at(ch.batch, ch.t0, h);
    const T* pv = x.v.at(ch.batch, ch.t0, h);
    const T* put = x.Ut + wrow * x.VP;
    const T* pdutp = x.dUtp + wrow * x.VP;
    const T* ps = x.h + ((c * x.H + h) * KP + kb0) * x.VP;
    const T* pds = x.dh + ((c * x.H + h) * KP + kb0) * x.VP;
    auto issue_v = [&](int v0, int st) {
      unsigned char* base = smem + (st == 0 ? L::vA : L::vB);
      load_tile<T, kDThreads>(smem_at<T>(base, L::vdO), L::ldv, pdo + v0, x.dout.st, len, kDRows, Vn - v0, VB,
                              vec_ok(pdo + v0, x.dout.st));
      load_tile<T, kDThreads>(smem_at<T>(base, L::vdUtp), L::ldv, pdutp + v0, ldv_g, len, kDRows, VB, VB,
                              vec_ok(pdutp + v0, ldv_g));
      load_tile<T, kDThreads>(smem_at<T>(base, L::vV), L::ldv, pv + v0, x.v.st, len, kDRows, Vn - v0, VB,
                              vec_ok(pv + v0, x.v.st));
      load_tile<T, kDThreads>(smem_at<T>(base, L::vUt), L::ldv, put + v0, ldv_g, len, kDRows, VB, VB,
                              vec_ok(put + v0, ldv_g));
      load_tile<T, kDThreads>(smem_at<T>(base, L::vS), L::ldv, ps + v0, x.VP, KB, KB, VB, VB, vec_ok(ps + v0, x.VP));
      load_tile<T, kDThreads>(smem_at<T>(base, L::vdS), L::ldv, pds + v0, x.VP, KB, KB, VB, VB,
                              vec_ok(pds + v0, x.VP));
      cp_async_commit();
    };
    const int nvb = x.VP / VB;  // even
    issue_v(0, 0);
#pragma unroll 1
    for (int vb = 0; vb < nvb; ++vb) {
      const int st = vb & 1;
      if (vb + 1 < nvb) {
        issue_v((vb + 1) * VB, st ^ 1);  // that stage was last read by block vb - 1 (ended with __syncthreads)
      } else {
        issue_pair(0);  // P_qk, P_qb into the region, last read by block vb - 1
      }
      cp_async_wait<1>();  // block vb's group (the one just issued may stay in flight)
      __syncthreads();
      unsigned char* base = smem + (st == 0 ? L::vA : L::vB);
      const T* sdO = smem_at<T>(base, L::vdO);
      const T* sdUtp = smem_at<T>(base, L::vdUtp);
      const T* sV = smem_at<T>(base, L::vV);
      const T* sUt = smem_at<T>(base, L::vUt);
      const T* sS = smem_at<T>(base, L::vS);
      const T* sdS = smem_at<T>(base, L::vdS);
      warp_mma<T, 1, 4, Lay::rowmajor, Lay::colmajor>(aq, sdO, L::ldv, 16 * warp, sS, L::ldv, 0, 0, VB);
      warp_mma<T, 1, 4, Lay::rowmajor, Lay::colmajor>(aa, sdUtp, L::ldv, 16 * warp, sS, L::ldv, 0, 0, VB);
      warp_mma<T, 1, 4, Lay::rowmajor, Lay::colmajor>(ak, sV, L::ldv, 16 * warp, sdS, L::ldv, 0, 0, VB);
      warp_mma<T, 1, 4, Lay::rowmajor, Lay::colmajor>(ab, sUt, L::ldv, 16 * warp, sdS, L::ldv, 0, 0, VB);
      {
        static_assert(kDThreads == 4 * KB && VB == 16, "four threads per key row, four values each");
        const int r = tid >> 2, c0 = 4 * (tid & 3);
#pragma unroll
        for (int e = 0; e < 4; ++e) rs = fmaf(to_f(sdS[r * L::ldv + c0 + e]), to_f(sS[r * L::ldv + c0 + e]), rs);
      }
      __syncthreads();  // the next block's copies overwrite this stage's tiles
    }
  }
  rs += __shfl_xor_sync(0xffffffffu, rs, 1);
  rs += __shfl_xor_sync(0xffffffffu, rs, 2);  // every thread of key row tid / 4: sum_v dS S over all blocks
  // The gradients' first terms, with their gate factors: dq = scale (dO S^T) e^G, dk = (V dS^T) e^(G_n - G),
  // db = (Ut dS^T) e^(G_n - G) over the second value stage (its last reads ended with the loop's __syncthreads);
  // da = (dUt' S^T) e^Gp stays in registers until dq is out (da's tile is dq's).
  const float* Gn = sG + len * L::ldg;  // G_{len-1}
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * warp + acc_row(0, e), d = acc_col(nt, e);
      const float gi = sG[(i + 1) * L::ldg + d], gpi = sG[i * L::ldg + d];
      const float fe = exp_t<T>(Gn[d] - gi);
      sdq[i * L::ldf + d] = x.scale * aq[0][nt][e] * exp_t<T>(gi);
      aa[0][nt][e] *= exp_t<T>(gpi);
      sdk[i * L::ldf + d] = ak[0][nt][e] * fe;
      sdb[i * L::ldf + d] = ab[0][nt][e] * fe;
    }
  __syncthreads();
  // dL/dG_{n-1} through the decayed-to-end rows, colsum(k dk + b db) of the first terms: warp w sums rows
  // [16 w, 16 w + 16) of column lane (kept in a register; the warps' sums meet in the dgk phase below, with the
  // D_n term e^(G_n) sum_v dS S).
  float gnp = 0.f;
#pragma unroll
  for (int il = 0; il < 16; ++il) {
    const int i = 16 * warp + il;
    gnp += to_f(sk[i * L::ldx + lane]) * sdk[i * L::ldf + lane] + to_f(sb[i * L::ldx + lane]) * sdb[i * L::ldf + lane];
  }
  const float* Gc = sG + L::ldg;  // row i: G_i
  const float* Gpv = sG;          // row i: Gp_i = G_{i-1}
  wait_pair();
  dplr_gram_backward_pair<T, true>(sM, sM + mstride, sq, sk, sb, Gc, Gc, sdq, sdk, sdb, scr, scr2, len);
  // dq is complete: out, and q dq for dG kept in registers (warp w: rows [16 w, 16 w + 16), lane: key column, as
  // the dgk phase below takes them).
  float dgq[16];
#pragma unroll
  for (int il = 0; il < 16; ++il) {
    const int i = 16 * warp + il;
    const float v = sdq[i * L::ldf + lane];
    dgq[il] = to_f(sq[i * L::ldx + lane]) * v;
    if (i < len && lane < Kleft) store_f(x.dq.at(ch.batch, ch.t0 + i, h) + kb0 + lane, v);
  }
  __syncthreads();  // q and dq are read: a comes over q, da over dq
  load_tile<T, kDThreads>(sa, L::ldx, pa, x.a.st, len, kDRows, Kleft, KB, vec_ok(pa, x.a.st));
  issue_pair(2);  // A_ab, A_ak (one copy group with a)
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) sda[(16 * warp + acc_row(0, e)) * L::ldf + acc_col(nt, e)] = aa[0][nt][e];
  wait_pair();
  dplr_gram_backward_pair<T, false>(sM, sM + mstride, sa, sb, sk, Gpv, Gc, sda, sdb, sdk, scr, scr2, len);

  // Out: dk, da, db.
  for (int idx = tid; idx < len * KB; idx += kDThreads) {
    const int i = idx / KB, d = idx - i * KB;
    if (d >= Kleft) continue;
    const int64_t t = ch.t0 + i;
    store_f(x.dk.at(ch.batch, t, h) + kb0 + d, sdk[i * L::ldf + d]);
    store_f(x.da.at(ch.batch, t, h) + kb0 + d, sda[i * L::ldf + d]);
    store_f(x.db.at(ch.batch, t, h) + kb0 + d, sdb[i * L::ldf + d]);
  }
  // dgk: dG_i = q dq - k dk - b db + dGp (plus dL/dG_{n-1} at row len - 1), summed from the chunk's end up each
  // column. Warp w takes rows [16 w, 16 w + 16) (lane: key column); the warps' sums and dL/dG_{n-1} meet in the
  // scratch tile (free after the gram gradients). Rows past len hold zeros (their q, k, a, b rows are zero).
  // [4][KB] the warps' dG sums, [4][KB] their dL/dG_{n-1} sums, [KB] the D_n term
  float* red = reinterpret_cast<float*>(scr);
  float dg[16], dgp[16];
  {
    float sum = 0.f;
#pragma unroll
    for (int il = 0; il < 16; ++il) {
      const int i = 16 * warp + il;
      dgp[il] = to_f(sa[i * L::ldx + lane]) * sda[i * L::ldf + lane];
      dg[il] = dgq[il] - to_f(sk[i * L::ldx + lane]) * sdk[i * L::ldf + lane] -
               to_f(sb[i * L::ldx + lane]) * sdb[i * L::ldf + lane] + dgp[il];
      sum += dg[il];
    }
    red[warp * KB + lane] = sum;
    red[4 * KB + warp * KB + lane] = gnp;
    if ((tid & 3) == 0) red[8 * KB + (tid >> 2)] = exp_t<T>(Gn[tid >> 2]) * rs;
  }
  __syncthreads();
  if (lane < Kleft && 16 * warp < len) {
    float run = red[8 * KB + lane];
    for (int w = 0; w < 4; ++w) run += red[4 * KB + w * KB + lane];
    for (int w = warp + 1; w < 4; ++w) run += red[w * KB + lane];
#pragma unroll
    for (int il = 15; il >= 0; --il) {
      const int i = 16 * warp + il;
      run += dg[il];
      if (i < len) store_gate_grad(x, ch.batch, ch.t0 + i, h, kb0 + lane, run - dgp[il]);
    }
  }
}

// ---- host ------------------------------------------------------------------------------------------------------
// Kernels 2 and 4 are chains over a sequence's chunks whose grids leave SMs idle where few sequences x heads run,
// and neither reads what the other writes (kernel 4 takes W, Bd, D_n from kernel 1 and q e^G, P_qb from kernel 3;
// kernel 2 writes h_c and Ut for kernels 5-6), so after kernel 3 they run side by side: the reverse scan on the
// side stream of common/side_stream.h (the higher priority: the longer chain), the forward scan on the caller's,
// joined before kernels 5-6; both at 32 columns where their two grids together leave half the GPU's CTA slots
// free (dplr_scan_narrow with grids = 2). The gradients are the same arithmetic per value column either way.
// DELTACP_TILED_DPLR_BWD_BESIDE (common/kernel_switch.h): unset = side by side; 0 = one after the other (kernels
// 1, 2, 3, 4); 1 = required (an error where the stream is being captured into a CUDA graph: the captured graph
// would hold a fork the caller did not ask for; unset runs in order there).
bool dplr_scans_beside(const Params& p) {
  return kernel_switch("DELTACP_TILED_DPLR_BWD_BESIDE", "the DPLR backward's scans side by side",
                       [&]() -> const char* {
                         if (stream_capturing(static_cast<cudaStream_t>(p.stream)))
                           return "the stream is being captured into a CUDA graph (the backward then runs in order)";
                         return nullptr;
                       });
}

template <class T, int KP>
void run_dplr_backward(const Params& p, cudaStream_t stream) {
  check_dplr_grid(p);
  // The chunk-local kernel (dplr_bwd_local_wgmma.cuh) in place of kernels 5 and 6 where it applies. Its
  // refusal depends on the number of chunks, which the table knows; the table is built only after the checks,
  // so the bound is taken from the sizes here (chunks <= B * T / 64 + num_seqs, rounded up). The switch is read for
  // every dtype and K: its refusal covers fp32 and K / V other than 64 / 64 and 128 / 128, so "1" names why such
  // inputs cannot take the kernel.
  const bool local = use_dplr_local(p, (p.B * p.T + 63) / 64 + p.num_seqs);
  const bool beside = dplr_scans_beside(p);
  check_dplr_smem<T, KP>(p, kDplrWy | kDplrScan | kDplrOut | kDplrDh0Scan | (local ? 0u : kDplrBwdDv | kDplrBwdDk));
  const ChunkTable table(p, p.chunk_size, stream);  // (after the checks: a refusal launches nothing)
  const int64_t R = p.B * p.T, H = p.H, C = table.num_chunks();
  const int VP = dplr_vp(p);
  DplrWorkspace ws(stream);
  DplrArgs<T> x = dplr_args<T>(p, table, VP);
  constexpr int64_t kMat = int64_t(kDRows) * kDRows;
  // stage 1
  x.G = ws.get<float>(R * H * KP);
  x.W = ws.get<T>(R * H * KP);
  x.Kd = ws.get<T>(R * H * KP);
  x.Bd = ws.get<T>(R * H * KP);
  x.U = ws.get<T>(R * H * VP);
  x.Dn = ws.get<float>(C * H * KP);
  x.Tg = ws.get<T>(C * H * kMat);
  x.Akg = ws.get<T>(C * H * kMat);
  // stage 2 (no ht: the forward ran already)
  x.Ut = ws.get<T>(R * H * VP);
  x.h = ws.get<T>(C * H * KP * VP);
  x.h0 = static_cast<const float*>(p.h0);
  // stage 3 (no o)
  x.QG = ws.get<T>(R * H * KP);
  x.Pb = ws.get<T>(C * H * kMat);
  x.Pk = ws.get<T>(C * H * kMat);
  // stage 4
  x.dout = dev_rows<const T>(p.dout);
  x.dht = static_cast<const float*>(p.dht);
  x.dh0 = static_cast<float*>(p.dh0);
  x.dh = ws.get<T>(C * H * KP * VP);
  x.dUt = ws.get<T>(R * H * VP);
  // stages 5, 6 (their hand-offs: none for the chunk-local kernel)
  if (!local) {
    x.dUtp = ws.get<T>(R * H * VP);
    x.dM = ws.get<T>(C * H * 4 * kMat);
  }
  x.dq = dev_rows<T>(p.dq);
  x.dk = dev_rows<T>(p.dk);
  x.dv = dev_rows<T>(p.dv);
  x.da = dev_rows<T>(p.da);
  x.db = dev_rows<T>(p.db);
  x.dgk = p.dg.ptr;
  x.dgk_sb = p.dg.stride_b;
  x.dgk_st = p.dg.stride_t;
  x.dgk_sh = p.dg.stride_h;

  const dim3 per_chunk(static_cast<unsigned>(C), static_cast<unsigned>(H));
  DELTACP_CHECK(C * (KP / kDKB) <= 0x7fffffff, "T", "expected fewer than ", 0x7fffffff / (KP / kDKB),
                " chunks for the tiled DPLR backward, got ", C);
  const dim3 per_key_block(static_cast<unsigned>(C * (KP / kDKB)), static_cast<unsigned>(H));
  if (C > 0) {
    dplr_launch(dplr_wy_kernel<T, KP>, WySmem<T, KP>::bytes, per_chunk, p, "WY stage", stream, x);
  }
  if (beside) {  // kernel 3 first, then the two scans side by side (the reverse one on the side stream)
    if (C > 0) {
      dplr_launch(dplr_output_kernel<T, KP>, OutSmem<T, KP>::bytes, per_chunk, p, "output stage", stream, x);
    }
    if (p.num_seqs > 0) {
      ForkJoin fork(stream, side_stream());  // on an exception, its destructor still joins
      dplr_launch_dh0_scan<T, KP>(p, VP, "reverse state-gradient scan", side_stream(), x, /*grids=*/2);
      dplr_launch_scan<T, KP>(p, VP, stream, x, /*grids=*/2);
      fork.join();
    }
  } else {
    if (p.num_seqs > 0) {
      dplr_launch_scan<T, KP>(p, VP, stream, x);
    }
    if (C > 0) {
      dplr_launch(dplr_output_kernel<T, KP>, OutSmem<T, KP>::bytes, per_chunk, p, "output stage", stream, x);
    }
    if (p.num_seqs > 0) {
      dplr_launch_dh0_scan<T, KP>(p, VP, "reverse state-gradient scan", stream, x);
    }
  }
  if (C > 0 && local) {
    if constexpr (kIs16Bit<T>) launch_dplr_local<T, KP / 64>(p, x, C, stream);
  } else if (C > 0) {
    dplr_launch(dplr_bwd_dv_kernel<T, KP>, BdvSmem<T, KP>::bytes, per_chunk, p, "backward dv stage", stream, x);
    dplr_launch(dplr_bwd_dk_kernel<T, KP>, BdkSmem<T>::bytes, per_key_block, p, "backward dk stage", stream, x);
  }
}

}  // namespace

void tiled_dplr_backward(const Params& p) {
  if (p.dh0_only()) return tiled_dplr_dh0(p);  // the reverse scan alone (dplr_fwd.cu)
  check_dplr_tiled(p);
  DELTACP_CHECK(p.dq.defined() && p.dk.defined() && p.dv.defined() && p.da.defined() && p.db.defined() &&
                    p.dg.defined(),
                "dq", "expected every input gradient (dq, dk, dv, da, db, dgk) for the tiled DPLR backward");
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (p.K <= 64) {
      run_dplr_backward<T, 64>(p, stream);
    } else {
      run_dplr_backward<T, 128>(p, stream);
    }
  });
}

}  // namespace deltacp::cuda::tiled

namespace deltacp::cuda {
void tiled_dplr_backward(const Params& p) { tiled::tiled_dplr_backward(p); }
}  // namespace deltacp::cuda
