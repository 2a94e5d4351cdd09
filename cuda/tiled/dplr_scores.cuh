// cuda/tiled/dplr_scores.cuh — DPLR's decay-masked chunk scores on the tensor cores (the tiled DPLR
// forward, dplr_fwd.cu).
//
// DPLR's chunk form (reference/src/chunked.cpp, chunk_wy / chunk_output) needs, per chunk of <= 64 tokens
// with G the within-chunk cumulative log decay (a vector per token) and Gp_i = G_{i-1} (G_{-1} = 0):
//
//   A_ab(i, j) = sum_d a_id b_jd e^(Gp_id - G_jd)    j < i        A_ak: the same with k for b
//   P_qk(i, j) = sum_d q_id k_jd e^(G_id  - G_jd)    j <= i       P_qb: the same with b for k
//
// i.e. P(i, j) = sum_d X_id Y_jd e^(Gl_id - Gr_jd) with a "left" and a "right" cumulative gate. As in
// kda_scores.cuh (whose scheme this is, with Gl and Gr separate), the decay cannot leave the dot product
// and e^-G overflows, so the 64 x 64 lower triangle is cut into 16 x 16 blocks:
//
//   off-diagonal block (a, b < a), reference row r = 16 a:
//       X_r(i) = X_i e^(Gl_i - Gl_r)   (i in [r, r + 16))      Y_r(j) = Y_j e^(Gl_r - Gr_j)   (j < r)
//       P(i, j) = X_r(i) . Y_r(j)  — one tensor-core product per block row; X_r Y_r^T has the exact
//       exponent Gl_i - Gr_j split in two;
//   diagonal blocks: element by element with e^(Gl_id - Gr_jd), masked before the exponential.
//
// Both factors' exponents are <= 0 whenever gk <= 0: Gl is non-increasing down the chunk (G and Gp both
// are), and Gl_r <= Gr_j for j < r (G_r <= G_j; Gp_r = G_{r-1} <= G_j for j <= r - 1). So no factor
// exceeds |X| or |Y|, and a factor that underflows belongs to a term below the underflow threshold
// times |X||Y|. With gk > 0 that guarantee is gone (deltacp.dplr's gate range keeps such inputs off the
// chunk form).
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
// the same array or one row apart). Xr (16 x ld), Yr (48 x ld): scratch, contiguous or not. Called by all
// NThreads threads of the block (4 warps or more: warps 0..3 own the diagonal blocks); contains
// __syncthreads, and ends with one.
template <class T, int NThreads, class Write>
__device__ void dplr_scores(const T* X, const T* Y, int ld, const float* Gl, const float* Gr, int ldg, T* Xr, T* Yr,
                            int Kp, int len, bool inclusive, Write write) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int a = 1; a < 4; ++a) {
    const int r = 16 * a;
    const bool active = r < len;  // uniform over the block
    if (active) {
      const float* Glr = Gl + r * ldg;
      const int rows = r + 16;  // Yr: rows [0, r); Xr: rows [r, r + 16)
      for (int idx = tid; idx < rows * Kp; idx += NThreads) {
        const int i = idx / Kp, d = idx - i * Kp;
        if (i < r) {
          Yr[i * ld + d] = from_f<T>(to_f(Y[i * ld + d]) * exp_t<T>(Glr[d] - Gr[i * ldg + d]));
        } else {
          Xr[(i - r) * ld + d] = from_f<T>(to_f(X[i * ld + d]) * exp_t<T>(Gl[i * ldg + d] - Glr[d]));
        }
      }
    }
    __syncthreads();
    if (warp < a) {  // warp w: block (a, w)
      float acc[1][2][4];
      zero_acc(acc);
      if (active) warp_mma<T, 1, 2, Lay::rowmajor, Lay::colmajor>(acc, Xr, ld, 0, Yr, ld, 16 * warp, 0, Kp);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) write(r + acc_row(0, e), 16 * warp + acc_col(nt, e), acc[0][nt][e]);
    }
    __syncthreads();
  }
  // Diagonal blocks: warp a < 4 owns block (a, a). Lane: row i = 16 a + (lane % 16), half the d range.
  if (warp < 4) {
    const int a = warp, il = lane & 15, half = lane >> 4;
    const int i = 16 * a + il;
    const bool active = 16 * a < len;  // uniform over the warp
    float part[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) part[j] = 0.f;
    if (active) {
      const int dh = Kp / 2;  // a multiple of 8
      for (int d0 = half * dh; d0 < (half + 1) * dh; d0 += 8) {
        float xi[8], gi[8];
        load8(X + i * ld + d0, xi);
        load8f(Gl + i * ldg + d0, gi);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int jj = 16 * a + j;
          const bool lower = inclusive ? (j <= il) : (j < il);
          float yj[8], gj[8];
          load8(Y + jj * ld + d0, yj);
          load8f(Gr + jj * ldg + d0, gj);
#pragma unroll
          for (int e = 0; e < 8; ++e) part[j] = fmaf(xi[e] * yj[e], exp_t<T>(lower ? gi[e] - gj[e] : 0.f), part[j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) part[j] += __shfl_xor_sync(0xffffffffu, part[j], 16);
    if (half == 0) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const bool lower = inclusive ? (j <= il) : (j < il);
        write(i, 16 * a + j, (active && lower) ? part[j] : 0.f);
      }
    }
  }
  __syncthreads();
}

}  // namespace deltacp::cuda::tiled
