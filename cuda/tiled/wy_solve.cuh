// cuda/tiled/wy_solve.cuh — T = (I + A)^-1 for one chunk's 64 x 64 strictly lower A: the inverse of the WY
// representation (docs/design.md section 3), shared by the WY stages: the mma.sync one (tiled_fwd.cu) and the
// Hopper one (wy_wgmma.cuh, which the fused forward runs too).
//
// Blocked forward substitution over 16 x 16 blocks: the four diagonal blocks D_a = (I + A_aa)^-1 one per
// warp in fp32 (lane = column, rows in registers), then the blocks below the diagonal by sub-diagonal level
// (1, 2, 3), each level one barrier. Two versions of the second step:
//   unit_lower_inverse_64       T_ab = -D_a sum_{b <= c < a} A_ac T_cb in fp32 FMA (fp32 inputs: 1e-5 against
//                               fp64 is the contract there)
//   unit_lower_inverse_64_tf32  T_ab = -sum_c N_ac T_cb with N_ac = D_a A_ac, on mma.sync in tf32 (16-bit
//                               inputs, where T is rounded to 16 bits before it multiplies anything)
// T multiplies everything the chunk's tokens write into the state, and its entries grow with the chunk's
// coupling, so it is kept in fp32 (or tf32 operands with fp32 accumulation) and rounded to 16 bits only when
// it becomes a tensor-core operand.
#pragma once

#include "fwd_mma.cuh"  // load8f

namespace deltacp::cuda::tiled {

// D_a = (I + A_aa)^-1 for a = warp, into T's diagonal block a: lane column c (lanes 16..31 duplicate lanes
// 0..15), rows in registers: d[i] = -sum_{c <= j < i} A[i][j] d[j] for i > c, d[c] = 1, d[i < c] = 0. Row i
// of A's block is read as float4 broadcasts (every lane reads the same row): a quarter of the scalar loads,
// which kept the shared-memory pipe busy (the wgmma WY stage, Nsight Compute on an H200: 75% of its
// wavefronts were the solve's). Needs 16-byte aligned rows: lda a multiple of 4, As 16-byte aligned.
__device__ __forceinline__ void diag_inverse_16(const float* As, float* Ts, int lda, int warp, int lane) {
  const int a = warp, c = lane & 15;
  const float* Ab = As + (16 * a) * lda + 16 * a;
  float d[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < (i + 3) / 4; ++q) {
      const float4 v = *reinterpret_cast<const float4*>(Ab + i * lda + 4 * q);
      const float x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (4 * q + e < i) s = fmaf(x[e], d[4 * q + e], s);
    }
    d[i] = (i == c) ? 1.f : (i > c ? -s : 0.f);
  }
  if (lane < 16) {
#pragma unroll
    for (int i = 0; i < 16; ++i) Ts[(16 * a + i) * lda + 16 * a + c] = d[i];
  }
}

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
  diag_inverse_16(As, Ts, lda, warp, lane);
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

// ---- the same inverse with its block products on the tensor cores (tf32), for 16-bit inputs ----------------
// With N_ac = D_a A_ac (c < a; D = the diagonal blocks' inverses), T = (I + N)^-1 D, and
// by sub-diagonal level l = a - b:  T_ab = -sum_{b <= c < a} N_ac T_cb  (T_bb = D_b). Warp a owns row block a
// throughout (its N blocks overwrite A's in place), so a level's only barrier is the one that publishes the
// previous level's blocks. The 16 x 16 products run on mma.sync m16n8k8 in tf32 (10-bit mantissa, fp32
// accumulation): T is rounded to 16 bits (T Beta) before it multiplies anything, so tf32's 2^-11 relative
// rounding of the operands is below what follows. fp32 inputs keep unit_lower_inverse_64 (fp32 FMA).
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void mma_tf32_m16n8k8(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// acc (16 x 16 as two 16 x 8 accumulators) += X (16 x 8 ks, rows ldx apart) Y (8 ks x 16, rows ldy apart).
// Inside a k-step the fragment's k index t <-> column 2 t and t + 4 <-> 2 t + 1 (any order works when X and Y
// agree): X's two values are one float2 and Y's rows 2 t, 2 t + 1 fall on distinct banks for ldy = 4 mod 32.
__device__ __forceinline__ void block_mma_tf32(float (&acc)[2][4], const float* X, int ldx, const float* Y, int ldy,
                                               int ksteps, int g, int t) {
  for (int ks = 0; ks < ksteps; ++ks) {
    const float2 x0 = *reinterpret_cast<const float2*>(X + g * ldx + 8 * ks + 2 * t);
    const float2 x1 = *reinterpret_cast<const float2*>(X + (g + 8) * ldx + 8 * ks + 2 * t);
    const uint32_t a[4] = {to_tf32(x0.x), to_tf32(x1.x), to_tf32(x0.y), to_tf32(x1.y)};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const uint32_t b[2] = {to_tf32(Y[(8 * ks + 2 * t) * ldy + 8 * nt + g]),
                             to_tf32(Y[(8 * ks + 2 * t + 1) * ldy + 8 * nt + g])};
      mma_tf32_m16n8k8(acc[nt], a, b);
    }
  }
}
// Writes s * acc (16 x 16, the m16n8 accumulator layout) at Z (rows ldz apart).
__device__ __forceinline__ void block_store(float* Z, int ldz, const float (&acc)[2][4], float s, int g, int t) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    *reinterpret_cast<float2*>(Z + g * ldz + 8 * nt + 2 * t) = make_float2(s * acc[nt][0], s * acc[nt][1]);
    *reinterpret_cast<float2*>(Z + (g + 8) * ldz + 8 * nt + 2 * t) = make_float2(s * acc[nt][2], s * acc[nt][3]);
  }
}

// As, Ts, lda as for unit_lower_inverse_64 (lda = 4 mod 32 keeps the fragment loads conflict-free), except
// that A's strictly lower blocks are overwritten (with N). Run by 128 threads, tid = 0 .. 127 among them (warp
// tid / 32 owns row block tid / 32), with sync() a barrier over exactly those threads; ends with one. The
// overload below is the CTA of 128 threads with __syncthreads; kda's wgmma stage (kda_prepare_wgmma.cuh) runs it
// on one warpgroup of two with a named barrier.
template <class Sync>
__device__ __forceinline__ void unit_lower_inverse_64_tf32(float* As, float* Ts, int lda, int tid, Sync sync) {
  const int a = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  // Row block a: zero right of the diagonal block, D_a on it.
  for (int idx = lane; idx < 16 * 48; idx += 32) {
    const int i = idx / 48, j = 16 * (a + 1) + idx % 48;
    if (j < 64) Ts[(16 * a + i) * lda + j] = 0.f;
  }
  diag_inverse_16(As, Ts, lda, a, lane);
  __syncwarp();
  // N_ac = D_a A_ac for c < a, all read before any is written (each block is read by every lane).
  float n[3][2][4];
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    if (c < a) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) n[c][nt][e] = 0.f;
      block_mma_tf32(n[c], Ts + 16 * a * lda + 16 * a, lda, As + 16 * a * lda + 16 * c, lda, 2, g, t);
    }
  }
  __syncwarp();
#pragma unroll
  for (int c = 0; c < 3; ++c)
    if (c < a) block_store(As + 16 * a * lda + 16 * c, lda, n[c], 1.f, g, t);
  for (int level = 1; level < 4; ++level) {
    sync();  // the diagonal blocks (level 1) or the previous level's blocks, and N, are visible
    if (a >= level) {
      const int b = a - level;
      float acc[2][4] = {};
      // sum over c = b .. a - 1 of N_ac T_cb: k runs over rows 16 b .. 16 a of T's column block b
      block_mma_tf32(acc, As + 16 * a * lda + 16 * b, lda, Ts + 16 * b * lda + 16 * b, lda, 2 * level, g, t);
      block_store(Ts + 16 * a * lda + 16 * b, lda, acc, -1.f, g, t);
    }
  }
  sync();
}
__device__ __forceinline__ void unit_lower_inverse_64_tf32(float* As, float* Ts, int lda) {
  unit_lower_inverse_64_tf32(As, Ts, lda, static_cast<int>(threadIdx.x), [] { __syncthreads(); });
}

}  // namespace deltacp::cuda::tiled
