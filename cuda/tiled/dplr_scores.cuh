// cuda/tiled/dplr_scores.cuh — DPLR's decay-masked chunk scores on the tensor cores (the tiled DPLR
// forward, dplr_fwd.cu).
//
// DPLR's chunk form (reference/src/chunked.cpp, chunk_wy / chunk_output) needs, per chunk of <= 64 tokens
// with G the within-chunk cumulative log decay (a vector per token) and Gp_i = G_{i-1} (G_{-1} = 0):
//
//   A_ab(i, j) = sum_d a_id b_jd e^(Gp_id - G_jd)    j < i        A_ak: the same with k for b
//   P_qk(i, j) = sum_d q_id k_jd e^(G_id  - G_jd)    j <= i       P_qb: the same with b for k
//
// i.e. P(i, j) = sum_d X_id Y_jd e^(Gl_id - Gr_jd) with a "left" and a "right" cumulative gate, which
// kda_scores.cuh's decayed_scores computes (kda is the case Gl = Gr). The decay cannot leave the dot product
// and e^-G overflows, so the 64 x 64 lower triangle is cut into 16 x 16 blocks:
//
//   off-diagonal block (a, b < a), reference row r = 16 a:
//       X_r(i) = X_i e^(Gl_i - Gl_r)   (i in [r, r + 16))      Y_r(j) = Y_j e^(Gl_r - Gr_j)   (j < r)
//       P(i, j) = X_r(i) . Y_r(j)  — one tensor-core product per block row; X_r Y_r^T has the exact
//       exponent Gl_i - Gr_j split in two;
//   diagonal blocks: bf16 through the same reference row on the tensor cores, where the block's decay keeps the
//       Y factor e^(Gl_r - Gr_j) (j >= r: an exponent >= 0, at most the decay over the block's 16 tokens) below
//       kda_scores.cuh's bounds (e^64, and 1e30 for a scaled element), checked per chunk and block; elsewhere,
//       and for fp16 / fp32, element by element with e^(Gl_id - Gr_jd), masked before the exponential.
//
// Off the block diagonal both factors' exponents are <= 0 whenever gk <= 0: Gl is non-increasing down the
// chunk (G and Gp both are), and Gl_r <= Gr_j for j < r (G_r <= G_j; Gp_r = G_{r-1} <= G_j for j <= r - 1). So
// no factor exceeds |X| or |Y|, and a factor that underflows belongs to a term below the underflow threshold
// times |X||Y|. With gk > 0 that guarantee is gone (deltacp.dplr's gate range keeps such inputs off the
// chunk form). A bf16 diagonal block on the tensor cores rounds X and Y times their decays to bf16, as the
// off-diagonal blocks already do: in a numpy emulation of the WY stage (bench_dplr.py's inputs, 20 chunks, the
// same draws both ways) the worst relative error against fp64 of U = T A_ak V went from 3.4e-3 / 3.6e-3 to
// 4.5e-3 / 4.6e-3 (K = 64 / 128), of T from 1.0e-3 to 1.1e-3 / 1.0e-3, of W = T (a e^Gp) stayed 2.4e-3 / 2.1e-3
// (with wy_solve.cuh's tf32 inverse; element-by-element diagonal blocks and an fp32 inverse before).
//
// Rows past a short chunk: X and Y rows are zero and the callers repeat the last valid gate row in Gl
// and Gr past the chunk, so every exponent stays finite.
#pragma once

#include <cstdint>

#include "fwd_mma.cuh"
#include "kda_scores.cuh"

namespace deltacp::cuda::tiled {

// P(i, j) = sum_d X[i][d] Y[j][d] e^(Gl[i][d] - Gr[j][d]) for j < i (j <= i when `inclusive`), handed to
// write(i, j, value) for every (i, j) of the 16 x 16 blocks on or below the block diagonal (value 0 above
// the diagonal inside diagonal blocks and for row blocks at or past len); blocks above the block diagonal
// are not written. X, Y: 64 x Kp tiles (ld), zero past len. Gl, Gr: 64 rows of Kp fp32 (ldg; they may be
// the same array or one row apart). Xr (16 x ld), Yr (dplr_scores_y_rows<T>() x ld): scratch, contiguous or
// not. Rows of X, Y, Xr, Yr, Gl and Gr 16-byte aligned. Called by all NThreads threads of the block (4 warps
// or more: warps 0..3 own the diagonal blocks); contains __syncthreads, and ends with one. kda_scores.cuh's
// decayed_scores does it.
template <class T>
__host__ __device__ constexpr int dplr_scores_y_rows() {
  return kda_scores_y_rows(sizeof(T));  // 64 for 16-bit inputs (bf16's diagonal blocks), 48 for fp32
}
template <class T, int NThreads, class Write>
__device__ void dplr_scores(const T* X, const T* Y, int ld, const float* Gl, const float* Gr, int ldg, T* Xr, T* Yr,
                            int Kp, int len, bool inclusive, Write write) {
  decayed_scores<T, NThreads>(X, Y, ld, Gl, Gr, ldg, Xr, Yr, dplr_scores_y_rows<T>(), Kp, len, inclusive, write);
}

}  // namespace deltacp::cuda::tiled
