// cuda/tiled/wy_solve.cuh — T = (I + A)^-1 for one chunk's 64 x 64 strictly lower A, in fp32: the inverse of
// the WY representation (docs/design.md section 3), shared by the tiled tier's WY stage (tiled_fwd.cu) and the
// fused tier's (cuda/fused/fused_wy.cuh).
//
// Blocked forward substitution over 16 x 16 blocks: the four diagonal blocks D_a = (I + A_aa)^-1 one per
// warp (lane = column, rows in registers), then T_ab = -D_a sum_{b <= c < a} A_ac T_cb by sub-diagonal
// level (levels 1, 2, 3: 3, 2, 1 blocks, one warp each). fp32 throughout: T multiplies everything the
// chunk's tokens write into the state, and its entries grow with the chunk's coupling, so it is rounded to
// 16 bits only when it becomes a tensor-core operand.
#pragma once

#include "kda_scores.cuh"  // load8f

namespace deltacp::cuda::tiled {

// As: A (fp32, strictly lower, rows lda floats apart); Ts: T written there (same leading dimension; every
// element of the 64 x 64 tile, zero above the diagonal blocks); scr: 4 x 256 floats of scratch. Called by
// all 128 threads (4 warps) of the CTA after A is visible to them; ends with a __syncthreads, so T is
// visible to every thread on return.
__device__ __forceinline__ void unit_lower_inverse_64(const float* As, float* Ts, int lda, float* scr) {
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  // Blocks above the block diagonal are zero.
  for (int idx = tid; idx < 64 * 64; idx += 128) {
    const int i = idx / 64, j = idx - i * 64;
    if ((j >> 4) > (i >> 4)) Ts[i * lda + j] = 0.f;
  }
  {
    // D_a = (I + A_aa)^-1, a = warp: lane column c (lanes 16..31 duplicate lanes 0..15), rows in
    // registers: d[i] = -sum_{c <= j < i} A[i][j] d[j] for i > c, d[c] = 1, d[i < c] = 0.
    const int a = warp, c = lane & 15;
    const float* Ab = As + (16 * a) * lda + 16 * a;
    float d[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < i; ++j) s = fmaf(Ab[i * lda + j], d[j], s);
      d[i] = (i == c) ? 1.f : (i > c ? -s : 0.f);
    }
    if (lane < 16) {
#pragma unroll
      for (int i = 0; i < 16; ++i) Ts[(16 * a + i) * lda + 16 * a + c] = d[i];
    }
  }
  __syncthreads();
  for (int level = 1; level < 4; ++level) {
    if (warp < 4 - level) {
      // block (a, b) = (warp + level, warp): P = A[a rows, 16b .. 16a) T[16b .. 16a, b cols]
      const int a = warp + level, b = warp;
      const int r = lane >> 1, c0 = (lane & 1) * 8;  // the lane's row and 8 columns of the block
      float acc[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.f;
      for (int kb = b; kb < a; ++kb) {  // 16-wide k blocks, unrolled so the loads pipeline
#pragma unroll
        for (int kk = 0; kk < 16; ++kk) {
          const int k = 16 * kb + kk;
          const float av = As[(16 * a + r) * lda + k];
          float tv[8];
          load8f(Ts + k * lda + 16 * b + c0, tv);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] = fmaf(av, tv[e], acc[e]);
        }
      }
      float* P = scr + warp * 256;  // this warp's 16 x 16 scratch
#pragma unroll
      for (int e = 0; e < 8; ++e) P[r * 16 + c0 + e] = acc[e];
      __syncwarp();
      // T_ab = -D_a P
      float out[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] = 0.f;
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const float dv = Ts[(16 * a + r) * lda + 16 * a + k];
        float pv[8];
        load8f(P + k * 16 + c0, pv);
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = fmaf(dv, pv[e], out[e]);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) Ts[(16 * a + r) * lda + 16 * b + c0 + e] = -out[e];
    }
    __syncthreads();
  }
}

}  // namespace deltacp::cuda::tiled
