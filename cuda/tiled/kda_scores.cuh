// cuda/tiled/kda_scores.cuh — decay-masked chunk scores on the tensor cores: kda's, shared by the forward's
// wy and output stages (tiled_fwd.cu) and the backward's stage B0 (bwd_dv_local.cuh), and DPLR's
// (dplr_scores.cuh: a left and a right gate, decayed_scores below).
//
// With a decay per key column, P_ij = sum_d X_id Y_jd e^(G_id - G_jd) cannot pull the decay out of the dot
// product, and e^-G overflows. kda_scores cuts the 64 x 64 lower triangle into 16 x 16 blocks: an
// off-diagonal block (a, b < a) is (X_a e^(G - G_r)) (Y_b e^(G_r - G))^T around the reference row
// r = 16 a (both exponents <= 0 since G decreases along the chunk: one tensor-core product per block row),
// and the 4 diagonal blocks are summed element by element with e^(G_id - G_jd), j <= i (a quarter of the
// exponentials of the element-by-element sum over the whole triangle).
// bf16: a diagonal block (a, a) goes through the same reference row r = 16 a on the tensor cores, as
// (X_a e^(G - G_r)) (Y_a e^(G_r - G))^T: the Y factor's exponent is now >= 0 (at most the block's decay over
// 15 tokens), so the block takes that path only where every scaled Y element stays below 1e30 and every
// exponent below kDiagExpMax (checked per chunk and block, __syncthreads_or); elsewhere, and for fp16 (whose
// range is too narrow) and fp32 (tf32 products would miss its 1e-5 tolerance), element by element. The
// products then round X and Y times their decays to bf16, as the off-diagonal blocks already do. With the
// rescaling eight keys per thread, that took the kda WY stage from 1.97 to 0.96 ms and the output stage from
// 1.85 to 0.98 ms (H100, bf16 kda (2,16384,16,128), kernel time); the worst bf16 error against fp64 in
// bench_gpu.py's accuracy check went from 3.6e-3 to 4.0e-3 (FLA 3.7e-3).
// Where the rows of q and k are l2-normalised, inside the call or by the front end before it (Params::qk_l2norm,
// qk_unit_rows), the bound is e^76 (kDiagExpMaxUnit below: FLA's safe-gate range over a block), so FLA's
// in-kernel gate with lower_bound -5, whose blocks decay by up to e^75, keeps every diagonal
// block on the tensor cores: its forward took 1.968 -> 1.247 ms at (2,16384,16,128) and 2.659 -> 1.540 ms at
// (1,8192,96,128) (H200, bf16, bench_gpu.py's kda_gate); with a gradient (the bound in the forward and the
// backward's recompute) forward + backward 7.564 -> 6.773 and 9.949 -> 8.704 ms.
#pragma once

#include <cstdint>
#include <type_traits>

#include "fwd_mma.cuh"

namespace deltacp::cuda::tiled {

// Rows of kda_scores' Yr scratch (esize: bytes of T): 64 for 16-bit inputs (the diagonal blocks' scaled Y rows
// after the off-diagonal ones), 48 for fp32.
__host__ __device__ constexpr int kda_scores_y_rows(int esize) { return esize == 2 ? 64 : 48; }
// The largest decay exponent G_r - G_j a diagonal block takes on the tensor cores (e^64 ~ 6e27).
constexpr float kDiagExpMax = 64.f;
// With l2-normalised rows (unit_rows: Params::qk_l2norm or qk_unit_rows, |x|, |y| <= 1) the bounds widen to FLA's
// safe-gate range: per-token decays of at least -5 make at most e^75 over a block's 15 rows. A scaled Y element is
// then at most e^76 ~ 1e33, a scaled X element at most 1 (and at least |x| e^-76, a normal bf16 number for
// |x| > 1.2e-5; smaller terms are below the products' rounding), and a sum of 128 products stays below 1.3e35, far
// from fp32's 3.4e38.
constexpr float kDiagExpMaxUnit = 76.f;
// Whether a scaled Y element x of a diagonal block (exponent ex) keeps the block off the tensor cores.
__device__ __forceinline__ bool diag_refused(float ex, float x, bool unit_rows) {
  return unit_rows ? !(ex <= kDiagExpMaxUnit) | !(fabsf(x) <= 1e34f) : !(ex <= kDiagExpMax) | !(fabsf(x) <= 1e30f);
}

// kda: Gk[i][d] (64 rows) = G[row min(i, len - 1)][d] for d < K, zero for K <= d < Kp, by cp.async in 16-byte pieces
// where G's rows allow it (the caller commits and waits; ldg a multiple of 4). Element-by-element loads
// here cost the kda wy and output stages a third of their time: each thread waited on 64 dependent global
// loads (Nsight Compute, H100, kda (1, 32768, 16, 128): 32% and 34% of their stall samples on that loop).
__device__ __forceinline__ void load_key_gate(float* Gk, int ldg, const float* G, int64_t row0, int64_t HV,
                                              int64_t hv, int64_t K, int Kp, int len) {
  const float* src = G + (row0 * HV + hv) * K;
  const int64_t ld = HV * K;
  const bool vec = vec_ok(src, ld);
  const int pieces = Kp / 4;  // 16-byte pieces per row
  const PieceRows rows_of(pieces);
  for (int idx = threadIdx.x; idx < 64 * pieces; idx += blockDim.x) {
    const int i = rows_of.row(idx), d = (idx - i * pieces) * 4;
    float* dst = Gk + i * ldg + d;
    const float* s = src + min(i, len - 1) * ld + d;
    if (vec && d + 4 <= K) {
      cp_async_16(dst, s);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[e] = d + e < K ? s[e] : 0.f;
    }
  }
}

// The decayed scores of one chunk (see the file comment), with a "left" and a "right" cumulative gate:
//   P(i, j) = sum_d X[i][d] Y[j][d] e^(Gl[i][d] - Gr[j][d])   for j < i (j <= i when `inclusive`)
// (kda: Gl = Gr = G; dplr_scores.cuh: Gl = G or its row before), handed to write(i, j, value) for every (i, j)
// of the 16 x 16 blocks on or below the block diagonal (value 0 above the diagonal inside diagonal blocks, and
// for row blocks at or past len); blocks above the block diagonal are not written. X, Y: 64 x Kp tiles (ld),
// zero past len. Gl, Gr: 64 rows of Kp fp32 (ldg; the same array or one row apart; rows past len repeat the
// last valid one), non-increasing down the chunk and Gl_r <= Gr_j for j < r. Xr (16 x ld), Yr (y_rows x ld):
// scratch; the diagonal blocks use the tensor cores only with y_rows >= 64 (bf16). Rows of X, Y, Xr, Yr, Gl and
// Gr 16-byte aligned (8 keys per thread). Called by all NThreads threads of the block (4 warps or more: warps
// 0..3 own the diagonal blocks); contains __syncthreads, and ends with one.
//
// kPair: a second score matrix against the same Y in the same pass, P2(i, j) = sum_d X2[i][d] Y[j][d] e^(...)
// with its own mask (inclusive2), scratch X2r (16 x ld) and write2 (the fused kda stage: A from (K, K) and P from
// (Q, K), kda_scores_pair). The scaled Y rows (Yr), the range check of the diagonal blocks (a property of Y and
// the gates alone) and the barriers are shared; every value of either matrix goes through the same operations in
// the same order as in a call of its own (X2's rows scaled by the same expression into X2r, the same warp_mma
// calls on (X2r, Yr), the same element-by-element diagonal loop), so each comes out with the same bits.
// kPair = false compiles to the single-matrix form.
template <class T, int NThreads, bool kPair, class Write, class Write2>
__device__ void decayed_scores_impl(const T* X, const T* X2, const T* Y, int ld, const float* Gl, const float* Gr,
                                    int ldg, T* Xr, T* X2r, T* Yr, int y_rows, int Kp, int len, bool inclusive,
                                    bool inclusive2, Write write, Write2 write2, bool unit_rows = false) {
  const bool diag_tc = std::is_same<T, __nv_bfloat16>::value && y_rows >= 64;  // uniform
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  unsigned diag_done = 0;  // bit a: block (a, a) done on the tensor cores (uniform over the block)
  // Off-diagonal blocks (a, b < a) through the reference row r = 16 a; bf16: block (a, a) too where it may.
  for (int a = diag_tc ? 0 : 1; a < 4; ++a) {
    const int r = 16 * a;
    const bool active = r < len;  // uniform over the block
    // Yr: rows [0, r) (and the diagonal block's rows [r, r + 16)); Xr: rows [r, r + 16)
    bool too_wide = false;  // a scaled Y row of the diagonal block leaves the safe range
    if (active) {
      // Eight keys per thread (16-byte rows): the element-by-element loop, with an integer division per
      // element, took half the mma.sync WY stage's time (Nsight Compute, H100, kda (2,16384,16,128)). The
      // diagonal block's range check runs per row, on the exponents and products already in registers: checked
      // per element behind a branch it cost more instructions than the scaling itself.
      const float* Glr = Gl + r * ldg;
      const int yrows = diag_tc ? r + 16 : r, rows = yrows + (kPair ? 32 : 16), pieces = Kp / 8;
      const PieceRows rows_of(pieces);
      for (int idx = tid; idx < rows * pieces; idx += NThreads) {
        const int i = rows_of.row(idx), d0 = 8 * (idx - i * pieces);
        float x[8], g[8], gr[8];
        load8f(Glr + d0, gr);
        if (i < yrows) {
          load8(Y + i * ld + d0, x);
          load8f(Gr + i * ldg + d0, g);
          float ex[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            ex[e] = gr[e] - g[e];
            x[e] *= exp_t<T>(ex[e]);
          }
          if (i >= r) {  // a row of the diagonal block (two rows per warp: nearly always uniform)
            bool bad = false;
#pragma unroll
            for (int e = 0; e < 8; ++e) bad |= diag_refused(ex[e], x[e], unit_rows);
            too_wide |= bad;
          }
          store8(Yr + i * ld + d0, x);
        } else {  // X's rows [r, r + 16) (kPair: then X2's)
          const bool second = kPair && i >= yrows + 16;
          const int xi = r + i - yrows - (second ? 16 : 0);
          load8((second ? X2 : X) + xi * ld + d0, x);
          load8f(Gl + xi * ldg + d0, g);
#pragma unroll
          for (int e = 0; e < 8; ++e) x[e] *= exp_t<T>(g[e] - gr[e]);
          store8((second ? X2r : Xr) + (xi - r) * ld + d0, x);
        }
      }
    }
    // The barrier after the scaling (every thread, every iteration), and whether block (a, a) may run on the
    // tensor cores.
    const bool any_wide = __syncthreads_or(too_wide);
    const bool tensor_diag = diag_tc && active && !any_wide;
    // warp w < a: block (a, w); warp a: block (a, a) masked to its lower triangle (kPair: each for X, then X2)
    auto off_block = [&](const T* Xs, auto& wr) {
      float acc[1][2][4];
      zero_acc(acc);
      if (active) warp_mma<T, 1, 2, Lay::rowmajor, Lay::colmajor>(acc, Xs, ld, 0, Yr, ld, 16 * warp, 0, Kp);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) wr(r + acc_row(0, e), 16 * warp + acc_col(nt, e), acc[0][nt][e]);
    };
    auto diag_block = [&](const T* Xs, bool incl, auto& wr) {
      float acc[1][2][4];
      zero_acc(acc);
      warp_mma<T, 1, 2, Lay::rowmajor, Lay::colmajor>(acc, Xs, ld, 0, Yr, ld, r, 0, Kp);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int il = acc_row(0, e), jl = acc_col(nt, e);
          const bool lower = incl ? (jl <= il) : (jl < il);
          wr(r + il, r + jl, lower ? acc[0][nt][e] : 0.f);
        }
    };
    if (warp < a) {
      off_block(Xr, write);
      if constexpr (kPair) off_block(X2r, write2);
    } else if (warp == a && tensor_diag) {
      diag_block(Xr, inclusive, write);
      if constexpr (kPair) diag_block(X2r, inclusive2, write2);
    }
    if (tensor_diag) diag_done |= 1u << a;
    __syncthreads();
  }
  // Diagonal blocks left: warp a < 4 owns block (a, a). Lane: row i = 16 a + (lane % 16), half the d range.
  auto diag_elementwise = [&](const T* X, bool inclusive, auto& write) {
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
  };
  if (warp < 4 && !((diag_done >> warp) & 1u)) {
    diag_elementwise(X, inclusive, write);
    if constexpr (kPair) diag_elementwise(X2, inclusive2, write2);
  }
  __syncthreads();
}

struct NoScoresWrite {
  __device__ void operator()(int, int, float) const {}
};

// The single score matrix (see the file comment and decayed_scores_impl).
template <class T, int NThreads, class Write>
__device__ void decayed_scores(const T* X, const T* Y, int ld, const float* Gl, const float* Gr, int ldg, T* Xr,
                               T* Yr, int y_rows, int Kp, int len, bool inclusive, Write write) {
  NoScoresWrite none;
  decayed_scores_impl<T, NThreads, false>(X, static_cast<const T*>(nullptr), Y, ld, Gl, Gr, ldg, Xr,
                                          static_cast<T*>(nullptr), Yr, y_rows, Kp, len, inclusive, false, write, none);
}

// kda's scores: the decay the same on both sides (Gl = Gr = Gk), Yr kda_scores_y_rows(sizeof(T)) rows.
template <class T, int NThreads, class Write>
__device__ void kda_scores(const T* X, const T* Y, int ld, const float* Gk, int ldg, T* Xr, T* Yr, int Kp, int len,
                           bool inclusive, Write write, bool unit_rows = false) {
  NoScoresWrite none;
  decayed_scores_impl<T, NThreads, false>(X, static_cast<const T*>(nullptr), Y, ld, Gk, Gk, ldg, Xr,
                                          static_cast<T*>(nullptr), Yr, kda_scores_y_rows(sizeof(T)), Kp, len,
                                          inclusive, false, write, none, unit_rows);
}

// kda's two score matrices of one chunk against the same Y, in one pass (decayed_scores_impl's kPair): X (scratch
// Xr, mask inclusive, write) and X2 (X2r, inclusive2, write2). The fused kda stage (kda_prepare_kernel in
// tiled_fwd.cu): A from (K, K) and P from (Q, K) share K's rescaled rows, scaled once instead of once per matrix.
template <class T, int NThreads, class Write, class Write2>
__device__ void kda_scores_pair(const T* X, const T* X2, const T* Y, int ld, const float* Gk, int ldg, T* Xr, T* X2r,
                                T* Yr, int Kp, int len, bool inclusive, bool inclusive2, Write write, Write2 write2,
                                bool unit_rows = false) {
  decayed_scores_impl<T, NThreads, true>(X, X2, Y, ld, Gk, Gk, ldg, Xr, X2r, Yr, kda_scores_y_rows(sizeof(T)), Kp, len,
                                         inclusive, inclusive2, write, write2, unit_rows);
}

}  // namespace deltacp::cuda::tiled
