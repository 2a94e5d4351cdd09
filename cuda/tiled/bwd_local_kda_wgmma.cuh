// cuda/tiled/bwd_local_kda_wgmma.cuh — kda's backward stages B2 and B3 (the V side and the WY side of the
// chunk-local gradients) as one kernel on Hopper's warpgroup products. Launched instead of bwd_dqkg_kernel and
// bwd_wy_kernel (bwd_dqkg.cuh, bwd_wy.cuh: the same algebra on mma.sync) for 16-bit kda at K = V = 128, chunk 64,
// compute capability 9.0 (local_kda_refusal says where it cannot run; DELTACP_TILED_BWD_LOCAL_KDA=0 keeps the
// two). Measured on H100 (bf16, (2, 16384, 16, 128), CUDA time of the kernels): 1.26 ms where B2 + B3 take
// 1.37 + 1.45 ms; the fused-tier forward + backward's kernels 8.83 -> 7.26 ms. As B2 + B3 alone (kDecay false) it
// hands stage B4 (bwd_decay_kda_tc_kernel) the buffers B2 and B3 hand it, with the same meaning: dP and dA (fp32
// 64 x 64, masked), the fp32 per-value-head parts of dq, dk and dG, and B3's part of dbeta; dv is final here as in
// B3. dW, which B2 writes for B3 only, stays in shared memory.
// With kDecay (bf16 by default, use_local_kda_decay) it runs B4 as well, after the WY side, and writes dq, dk, dg
// and dbeta final: none of dP, dA and the parts goes through global memory (about 2 KB per token-head, written once
// and read once before), nor do q, k and G a second time. Measured on H200 (bf16, (2, 16384, 16, 128), FLA's
// benchmark keywords, kernel time): 1.784 ms where this kernel and B4 take 1.132 + 1.610. That needed the code
// small: the kernel runs once per CTA, straight through, one CTA per SM, so its instructions have to stay in the
// instruction cache from one CTA to the next. With the decay side over all 64 columns of a warpgroup at once it had
// 9,000 SASS instructions and took 3.04 ms (Nsight Compute: 46% of its cycles per issued instruction waiting on
// instruction fetch); with the decay side in two passes of 32 columns (swap_halves) it has 7,500 and takes 1.784
// ms. The first build, whose fallback for refused diagonal blocks was unrolled over each thread's 32 elements
// (25,800 instructions), took 5.64.
//
// The algebra is bwd_local_wgmma.cuh's (gdn) with kda's decay per key: Gam_id = e^(G_id) and e^(Gn_d - G_id)
// are element scales, read from the chunk's G tile, where gdn has row scales. For one chunk (bwd_common.cuh's
// notation) with S = h[c], dS' = dh[c], Vn, dU = dVn (B1), T and dO:
//
//   V side   dq    = scale (dO S^T) o Gam                        (B2's dq part)
//            minus = (Vn dS'^T) o e^(Gn - G)                     (B2's dk part: the Kr term)
//            dW    = -dU S^T     dP = scale dO Vn^T (j <= i < len)     Y = T^T dU,  dv = diag(beta) Y
//   WY side  plus  = (T^T dW) o Gam                              (B3: dk += beta plus)
//            dT    = (dU V^T + dW (K o Gam)^T) diag(beta)        dA = -(T^T dT) T^T (j < i < len)
//   parts    dqw = dq,  dkw = minus + diag(beta) plus,
//            dGw = q o dq - k o minus + diag(beta) k o plus  (+ on the last row: e^Gn o <dS', S>_rows + KrSum)
//            dbw_i = Y_i . v_i + k_i . plus_i
//
// where <dS', S>_d = sum_v dS'_dv S_dv and KrSum_d = sum_{j < len} k_jd minus_jd (the last row's share of dG from
// the decay of S and from Gn in Kr, per key). dT's operand K o Gam (Gam of the key's own row j, so it cannot be
// moved onto dW) is a scaled copy of k, built while the V side's products run. tests/python/
// test_chunk_backward_algebra.py ties these formulas (with B4's decay products) to autograd in fp64.
//
// Numerics: every product takes 16-bit operands and accumulates in fp32, as B2 and B3 do; the operands rounded
// are the same ones (dU, T from fp32; dW; dT; T^T dT), except that B3 rounds beta k e^G and beta v where this
// kernel rounds k e^G and applies beta to dT's fp32 columns. Summation orders differ (wgmma against mma.sync
// over V tiles), so the parts are not bitwise B2's and B3's: within the bf16 / fp16 tolerances.
//
// One CTA of two warpgroups (256 threads) per (chunk, value head); warpgroup h owns columns 64 h .. 64 h + 63 of
// every 64 x 128 result and 32 h .. 32 h + 31 of every 64 x 64 one (T^T dT: all 64, its operand would be split
// inside a swizzle row), so a thread holds dq, minus and plus of the same elements and finishes the parts in
// registers. Steps (every product wgmma with both operands in shared memory):
//   loads     dO, S (h[c]); Vn, dS' (dh[c]); v, q, k by TMA on three mbarriers (gdn's kernel's boxes); dU and T
//             (fp32, or 16-bit with Args::dvn16 / t16) by 16-byte loads rounded into the swizzled layout; G
//             (fp32 64 x 128, rows past a short chunk repeating its last row) by cp.async
//   V side    dO S^T, dU S^T, Vn dS'^T (K = 128), dO Vn^T (n32), T^T dU (K = 64): 144 accumulator registers;
//             meanwhile K o Gam (16-bit, swizzled) and <dS', S> per key row from shared memory
//   epilogue  dW to shared memory (over S), dP to global (fp32), dv = beta Y staged over dO for 16-byte stores,
//             Y . v per row, minus scaled and its KrSum parts per warp
//   WY side   T^T dW, dU V^T + dW (K o Gam)^T; dT (over S); T^T dT (over S); dA = -(T^T dT) T^T to global
//   epilogue  dq and plus scaled by Gam; dqw, dkw, dGw (fp32 pairs), dbw per row
// Shared memory (bytes from a 1024-byte aligned base; LocalKdaSmem):
//   S, dS' 32 KB each; dO, Vn, dU, v, q, k, K o Gam 16 KB each; T 8 KB; G 34 KB (rows of 136 floats: the
//   epilogue's pairs fall on 32 banks); per row and per key 3.8 KB; with alignment slack 228,120 bytes: one CTA
//   per SM. dW, dT and T^T dT reuse S's bytes after the V side, the staged dv dO's.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/check.h"
#include "../common/device_info.h"
#include "../common/kernel_switch.h"
#include "../common/tma.cuh"
#include "bwd_common.cuh"
#include "bwd_decay.cuh"
#include "bwd_local_wgmma.cuh"
#include "kda_scores.cuh"
#include "wgmma_ops.cuh"

namespace deltacp::cuda::tiled::bwd {

struct LocalKdaSmem {
  static constexpr int kBox = 64 * 128;
  static constexpr int S = 0, dS = S + 4 * kBox, dO = dS + 4 * kBox, Vn = dO + 2 * kBox, dU = Vn + 2 * kBox;
  static constexpr int v = dU + 2 * kBox, q = v + 2 * kBox, k = q + 2 * kBox, Kg = k + 2 * kBox, T = Kg + 2 * kBox;
  // After the V side, over S: dW (64 x 128), dT and T^T dT (64 x 64); dv staged over dO.
  static constexpr int dW = 0, dT = dW + 2 * kBox, M1 = dT + kBox;
  static constexpr int kPG = 136;  // G's row pitch in floats
  static constexpr int G = T + kBox;
  // beta per row; the rows' dbeta parts per warpgroup; <dS', S> per key row and half of the value columns;
  // KrSum per key and warp of a warpgroup; three mbarriers.
  static constexpr int beta = G + 64 * kPG * 4, part = beta + 256, dgs = part + 2 * 256, krp = dgs + 2 * 512;
  static constexpr int bar = krp + 4 * 512;
  static constexpr int dflags = bar + 3 * 8;  // with B4: per diagonal block, 1 where it is summed element by element
  static constexpr int bytes = dflags + 4 * 4 + 1024;  // + slack for the alignment
};
// Stage B4 inside the kernel (bwd_local_kda_wgmma_kernel<T, true>), over bytes dead by then: dP, dA and beta dA in
// 16 bits (ldmatrix pitch 72) and the diagonal blocks of dP and dA in fp32 over dS' (dead after the V side) and dO
// (dead once dv is stored); the off-diagonal operands Kr over S, Qs and Ks over dO's tail, Vn, dU and v once the
// WY side is done; dG of the chunk (fp32, pitch 132) over Qs and Ks once every warp's products have read them.
struct LocalKdaDecaySmem {
  using L = LocalKdaSmem;
  static constexpr int P64 = 72, PK = 136, PD = 17, PGd = 132, kOperandRows = 96;
  static constexpr int Mp = L::dS, Ma = Mp + 64 * P64 * 2, Mb = Ma + 64 * P64 * 2, dPd = Mb + 64 * P64 * 2;
  static constexpr int dAd = L::dO, Kr = L::S, Qs = dAd + 4 * 16 * PD * 4, Ks = Qs + kOperandRows * PK * 2, dG = Qs;
};
static_assert(LocalKdaDecaySmem::dPd + 4 * 16 * 17 * 4 <= LocalKdaSmem::dO, "dP's blocks fit over dS'");
static_assert(LocalKdaDecaySmem::dAd + 4 * 16 * 17 * 4 <= LocalKdaSmem::Vn, "dA's diagonal blocks fit over dO");
static_assert(LocalKdaDecaySmem::Kr + 96 * 136 * 2 <= LocalKdaSmem::dS, "Kr fits over S");
static_assert(LocalKdaDecaySmem::Ks + 96 * 136 * 2 <= LocalKdaSmem::q, "Qs and Ks fit over dO, Vn, dU and v");
static_assert(LocalKdaDecaySmem::dG + 64 * 132 * 4 <= LocalKdaSmem::q, "dG fits over Qs and Ks");
static_assert(LocalKdaDecaySmem::Qs % 16 == 0 && LocalKdaDecaySmem::Ks % 16 == 0, "16-byte operand rows");
static_assert(LocalKdaSmem::M1 + LocalKdaSmem::kBox <= LocalKdaSmem::dS, "the intermediates fit over S");
static_assert(LocalKdaSmem::G % 16 == 0 && (LocalKdaSmem::kPG * 4) % 16 == 0, "G rows take 16-byte copies");
static_assert(LocalKdaSmem::bytes == 228136, "the size the opening comment gives");
static_assert(LocalKdaSmem::bytes <= 227 * 1024, "one CTA within sm_90's opt-in shared memory");

#ifdef DELTACP_WGMMA_DEVICE
// A 64 x 64 score gradient from this warpgroup's m64n32 accumulator (its 32 columns) into fp32 dst, as stage B4
// reads it: f(x) on the causal triangle of rows i < len (j <= i with the diagonal, j < i without), zero elsewhere.
template <bool kDiagonal, class F>
__device__ __forceinline__ void store_causal_scores(float* dst, const float (&acc)[16], int wg, int ra, int t, int len,
                                                    F f) {
#pragma unroll
  for (int nb = 0; nb < 4; ++nb)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = ra + 8 * hh, j = 32 * wg + 8 * nb + 2 * t, e0 = 4 * nb + 2 * hh;
      const bool in0 = kDiagonal ? j <= i : j < i, in1 = kDiagonal ? j + 1 <= i : j + 1 < i;
      const float x0 = (in0 && i < len) ? f(acc[e0]) : 0.f;
      const float x1 = (in1 && i < len) ? f(acc[e0 + 1]) : 0.f;
      *reinterpret_cast<float2*>(dst + i * 64 + j) = make_float2(x0, x1);
    }
}

// ---- stage B4 inside the kernel (kDecay) ---------------------------------------------------------------------
// A 64 x 64 score gradient from this warpgroup's m64n32 accumulator into 16-bit M (pitch 72; and beta_i x into M2
// when given) and its diagonal 16 x 16 blocks in fp32 (D, [4][16][17]): f(x) on the causal triangle of rows
// i < len, zero elsewhere; flags[block] = 1 where a diagonal element passes kDiagGradMax.
template <class T, bool kDiagonal, class F>
__device__ __forceinline__ void stage_scores16(T* M, T* M2, const float* bs, float* D, int* flags,
                                               const float (&acc)[16], int wg, int ra, int t, int len, F f) {
#pragma unroll
  for (int nb = 0; nb < 4; ++nb)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = ra + 8 * hh, j = 32 * wg + 8 * nb + 2 * t, e0 = 4 * nb + 2 * hh;
      const bool in0 = kDiagonal ? j <= i : j < i, in1 = kDiagonal ? j + 1 <= i : j + 1 < i;
      const float x0 = (in0 && i < len) ? f(acc[e0]) : 0.f;
      const float x1 = (in1 && i < len) ? f(acc[e0 + 1]) : 0.f;
      store_pair(M + i * 72 + j, x0, x1);
      if (M2 != nullptr) store_pair(M2 + i * 72 + j, bs[i] * x0, bs[i] * x1);
      if ((i >> 4) == (j >> 4)) {
        float* d = D + (i >> 4) * 16 * 17 + (i & 15) * 17 + (j & 15);
        d[0] = x0, d[1] = x1;
        const float b = M2 != nullptr ? fabsf(bs[i]) : 0.f;
        const float m = fmaxf(fmaxf(fabsf(x0), fabsf(x1)), b * fmaxf(fabsf(x0), fabsf(x1)));
        if (!(m <= kDiagGradMax)) flags[i >> 4] = 1;  // every writer stores the same value
      }
    }
}

// Eight keys (columns c .. c + 7, c a multiple of 8) of row r of a 64 x 128 16-bit tile held as two swizzled
// 64-column blocks (the TMA layout of q and k here), as floats.
template <class T>
__device__ __forceinline__ void tile_row8(const unsigned char* tile, int r, int c, float (&x)[8]) {
  const unsigned char* p = tile + (c >> 6) * LocalKdaSmem::kBox + r * 128 + (((((c & 63) >> 3) ^ r) & 7) << 4);
  load8(reinterpret_cast<const T*>(p), x);
}

// One element of a 64-column swizzled 16-bit block (row r, column c < 64).
template <class T>
__device__ __forceinline__ float block_elem(const unsigned char* blk, int r, int c) {
  return to_f(*reinterpret_cast<const T*>(blk + sw_pair(r, c & ~1) + 2 * (c & 1)));
}

// Swaps the halves of a 32-register array: the decay side works on columns c0 .. c0 + 31 of a warpgroup's 64 in a
// rolled loop of two passes, each on the first half, so that its code is there once (the kernel's instruction
// fetch, not its arithmetic, bounded it with the whole 64 columns unrolled).
__device__ __forceinline__ void swap_halves(float (&x)[32]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float y = x[i];
    x[i] = x[i + 16];
    x[i + 16] = y;
  }
}
__device__ __forceinline__ float (&first_half(float (&x)[32]))[16] { return *reinterpret_cast<float(*)[16]>(x); }

// Whether this warp's diagonal block (rows r0 .. r0 + 15, its warpgroup's 64 columns) can take the tensor cores:
// every growth exponent (row side e^(G_r0 - G_j), column side e^(G_i - G_s)) at most kDiagExpMax and every q, k
// element at most 160 in magnitude (so that a scaled operand stays below 1e30). Warp-uniform.
template <class T>
__device__ __forceinline__ bool diag_block_fits(const unsigned char* qblk, const unsigned char* kblk, const float* Gt,
                                                int PG, int r0, int s, int cw, int len) {
  const int lane = threadIdx.x & 31;
  bool bad = false;
#pragma unroll 2
  for (int e = lane; e < 16 * 64; e += 32) {
    const int i = e >> 6, c = e & 63, r = r0 + i;
    if (r >= len) continue;
    const float g = Gt[r * PG + cw + c];
    const float exr = Gt[r0 * PG + cw + c] - g, exs = g - Gt[s * PG + cw + c];
    const float kv = block_elem<T>(kblk, r, c), qv = block_elem<T>(qblk, r, c);
    bad |= !(exr <= kDiagExpMax) | !(exs <= kDiagExpMax) | !(fabsf(kv) <= 160.f) | !(fabsf(qv) <= 160.f);
  }
  return !__any_sync(0xffffffffu, bad);
}

// Row side of the diagonal block in tf32: yq, yr += A B with A = dP (pairs j >= i left out), dA, and B[j][d] =
// k_jd e^(G_r0,d - G_jd) computed here. The fragment's k slots t and t + 4 take columns 2t, 2t + 1.
template <class T>
__device__ __forceinline__ void diag_row_side_tf32(float (&yq)[16], float (&yr)[16], const float* dPb,
                                                   const float* dAb, const unsigned char* kblk, const float* Gt,
                                                   int PG, int r0, int cw, int c0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    const int k0 = 8 * ks + 2 * t, k1 = k0 + 1;
    auto ap = [&](int i, int j) { return j >= i ? 0.f : dPb[i * 17 + j]; };
    auto aa = [&](int i, int j) { return dAb[i * 17 + j]; };
    const uint32_t fp[4] = {to_tf32(ap(g, k0)), to_tf32(ap(g + 8, k0)), to_tf32(ap(g, k1)), to_tf32(ap(g + 8, k1))};
    const uint32_t fa[4] = {to_tf32(aa(g, k0)), to_tf32(aa(g + 8, k0)), to_tf32(aa(g, k1)), to_tf32(aa(g + 8, k1))};
#pragma unroll
    for (int nb = 0; nb < 4; ++nb) {
      const int c = c0 + 8 * nb + g;
      const float gr = Gt[r0 * PG + cw + c];
      const float b0 = block_elem<T>(kblk, r0 + k0, c) * exp_t<T>(gr - Gt[(r0 + k0) * PG + cw + c]);
      const float b1 = block_elem<T>(kblk, r0 + k1, c) * exp_t<T>(gr - Gt[(r0 + k1) * PG + cw + c]);
      const uint32_t fb[2] = {to_tf32(b0), to_tf32(b1)};
      float dq4[4] = {yq[4 * nb], yq[4 * nb + 1], yq[4 * nb + 2], yq[4 * nb + 3]};
      float dr4[4] = {yr[4 * nb], yr[4 * nb + 1], yr[4 * nb + 2], yr[4 * nb + 3]};
      mma_tf32_m16n8k8(dq4, fp, fb);
      mma_tf32_m16n8k8(dr4, fa, fb);
#pragma unroll
      for (int u = 0; u < 4; ++u) yq[4 * nb + u] = dq4[u], yr[4 * nb + u] = dr4[u];
    }
  }
}

// Column side of the diagonal block in tf32: yc (rows = the block's columns j) += dP^T Qd + (beta dA)^T Kd with
// Qd[i][d] = q_id e^(G_id - G_sd), Kd[i][d] = k_id e^(G_id - G_sd) (pairs i <= j left out of dP).
template <class T>
__device__ __forceinline__ void diag_col_side_tf32(float (&yc)[16], const float* dPb, const float* dAb,
                                                   const float* bs, const unsigned char* qblk,
                                                   const unsigned char* kblk, const float* Gt, int PG, int r0, int s,
                                                   int cw, int c0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    const int k0 = 8 * ks + 2 * t, k1 = k0 + 1;
    auto ap = [&](int j, int i) { return i <= j ? 0.f : dPb[i * 17 + j]; };
    auto ab = [&](int j, int i) { return bs[r0 + i] * dAb[i * 17 + j]; };
    const uint32_t fp[4] = {to_tf32(ap(g, k0)), to_tf32(ap(g + 8, k0)), to_tf32(ap(g, k1)), to_tf32(ap(g + 8, k1))};
    const uint32_t fb4[4] = {to_tf32(ab(g, k0)), to_tf32(ab(g + 8, k0)), to_tf32(ab(g, k1)), to_tf32(ab(g + 8, k1))};
#pragma unroll
    for (int nb = 0; nb < 4; ++nb) {
      const int c = c0 + 8 * nb + g;
      const float gs = Gt[s * PG + cw + c];
      const float e0 = exp_t<T>(Gt[(r0 + k0) * PG + cw + c] - gs), e1 = exp_t<T>(Gt[(r0 + k1) * PG + cw + c] - gs);
      const uint32_t bq[2] = {to_tf32(block_elem<T>(qblk, r0 + k0, c) * e0),
                              to_tf32(block_elem<T>(qblk, r0 + k1, c) * e1)};
      const uint32_t bk[2] = {to_tf32(block_elem<T>(kblk, r0 + k0, c) * e0),
                              to_tf32(block_elem<T>(kblk, r0 + k1, c) * e1)};
      float d4[4] = {yc[4 * nb], yc[4 * nb + 1], yc[4 * nb + 2], yc[4 * nb + 3]};
      mma_tf32_m16n8k8(d4, fp, bq);
      mma_tf32_m16n8k8(d4, fb4, bk);
#pragma unroll
      for (int u = 0; u < 4; ++u) yc[4 * nb + u] = d4[u];
    }
  }
}

// A block refused by the tensor cores: every pair element by element in fp32 with e^(G_i - G_j), into this lane's
// 32 elements. Rare (steep gates, fp16), so the loops stay rolled: unrolled, this code tripled the kernel's size
// and its instruction fetches. The result joins its register by a select over the 32 (a register array cannot be
// indexed at run time without going to local memory). Row side: yq += sum_{j <= i} dP_ij k_j E, yr += dA_ij k_j E;
// column side (yr unused): yq += sum_{i >= j} (dP_ij q_i + beta_i dA_ij k_i) E.
template <class T, bool kRowSide>
__device__ __forceinline__ void diag_every_pair(float (&yq)[32], float (&yr)[32], const float* dPb, const float* dAb,
                                                const float* bs, const unsigned char* qblk,
                                                const unsigned char* kblk, const float* Gt, int PG, int r0, int cw) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll 1
  for (int e = 0; e < 32; ++e) {
    const int li = g + 8 * ((e >> 1) & 1), c = 8 * (e >> 2) + 2 * t + (e & 1);
    const float gl = Gt[(r0 + li) * PG + cw + c];
    float s1 = 0.f, s2 = 0.f;
    if constexpr (kRowSide) {
#pragma unroll 1
      for (int j = 0; j <= li; ++j) {
        const float E = exp_t<T>(gl - Gt[(r0 + j) * PG + cw + c]), kj = block_elem<T>(kblk, r0 + j, c);
        s1 = fmaf(dPb[li * 17 + j] * kj, E, s1);
        s2 = fmaf(dAb[li * 17 + j] * kj, E, s2);
      }
    } else {
#pragma unroll 1
      for (int i = li; i < 16; ++i) {  // rows past len: dP, dA and beta are zero
        const float E = exp_t<T>(Gt[(r0 + i) * PG + cw + c] - gl);
        s1 = fmaf(dPb[i * 17 + li] * block_elem<T>(qblk, r0 + i, c) +
                      bs[r0 + i] * dAb[i * 17 + li] * block_elem<T>(kblk, r0 + i, c),
                  E, s1);
      }
    }
#pragma unroll
    for (int u = 0; u < 32; ++u)
      if (u == e) {
        yq[u] += s1;
        if constexpr (kRowSide) yr[u] += s2;
      }
  }
}

// dq or dk of the chunk, written over q's or k's tile in its own layout (two swizzled 64-column blocks), to an
// output [B, T, heads, 128] in 16-byte pieces: 16 threads a row.
template <class T>
__device__ __forceinline__ void store_tile_rows(const TensorRef& out, int64_t b, int64_t t0, int64_t head,
                                                const unsigned char* tile, int len) {
  T* base = static_cast<T*>(out.ptr);
  const bool vec = reinterpret_cast<uintptr_t>(base) % 16 == 0 && (out.stride_b * 2) % 16 == 0 &&
                   (out.stride_t * 2) % 16 == 0 && (out.stride_h * 2) % 16 == 0;
  for (int e = threadIdx.x; e < 64 * 16; e += blockDim.x) {
    const int r = e >> 4, p = e & 15;
    if (r >= len) break;
    const unsigned char* at = tile + (p >> 3) * LocalKdaSmem::kBox + r * 128 + ((((p & 7) ^ r) & 7) << 4);
    T* dst = base + off(out, b, t0 + r, head) + 8 * p;
    if (vec) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(at);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[j] = reinterpret_cast<const T*>(at)[j];
    }
  }
}
#endif

template <class T, bool kDecay = false>
__global__ void __launch_bounds__(256, 1) bwd_local_kda_wgmma_kernel(const __grid_constant__ LocalWgArgs args) {
#ifdef DELTACP_WGMMA_DEVICE
  using L = LocalKdaSmem;
  constexpr int kBox = L::kBox, PG = L::kPG;
  const Args& a = args.a;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::bar);
  float* Gt = reinterpret_cast<float*>(smem + L::G);
  float* bs = reinterpret_cast<float*>(smem + L::beta);
  float* part = reinterpret_cast<float*>(smem + L::part);
  float* dgs = reinterpret_cast<float*>(smem + L::dgs);
  float* krp = reinterpret_cast<float*>(smem + L::krp);
  int* dflags = reinterpret_cast<int*>(smem + L::dflags);
  using D = LocalKdaDecaySmem;

  const int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t HV = a.HV;
  int64_t c, hv;  // blockIdx, or with B1 beside this kernel its order (bwd_handoff.cuh)
  handoff_block(a.handoff, HV, c, hv);
  const int64_t hk = hv / a.group;
  const ChunkEntry ch = a.chunks[c];
  const int len = static_cast<int>(ch.len);
  const uint32_t base = smem_u32(smem);

  handoff_wait(a.handoff, c, hv, HV);  // with B1 beside: until it has stored dh[c] and dVn of c
  if (tid == 0) issue_local_loads<L>(smem, bars, args, ch, c, hv, HV, hk);  // gdn's kernel's loads
  // G (fp32 [R, HV, 128]): one cp.async group, in flight while dU and T load; rows past len repeat the last row,
  // so every exponent below stays finite.
  load_key_gate(Gt, PG, a.G, ch.row0, HV, hv, kLocalKeys, kLocalKeys, len);
  cp_async_commit();
  // dU and T (load_du_t / store_du_t, as in gdn's kernel); beta while they load.
  {
    DuTPieces pieces;
    load_du_t(pieces, a, ch, hv, HV, len, tid);
    if (tid < 64) bs[tid] = tid < len ? ld<T>(a.beta, off(a.beta, ch.batch, ch.t0 + tid, hv)) : 0.f;
    if constexpr (kDecay) {
      if (tid < 4) dflags[tid] = std::is_same_v<T, __half> || 16 * tid >= len;  // fp16: element by element
    }
    store_du_t<T>(smem, L::dU, L::T, kBox, pieces, a, tid);
  }
  cp_async_wait<0>();
  __syncthreads();  // the mbarriers are initialised; dU, T, G and beta are in shared memory
  mbar_wait(bars, 0);
  mbar_wait(bars + 1, 0);
  zero_tail_rows<256>(smem + L::dO, len, tid);
  zero_tail_rows<256>(smem + L::Vn, len, tid);
  fence_proxy_async();
  __syncthreads();

  // ---- the V side --------------------------------------------------------------------------------------
  const uint32_t sS = base + L::S, sdS = base + L::dS, sdO = base + L::dO, sVn = base + L::Vn, sdU = base + L::dU;
  const uint32_t sv = base + L::v, sKg = base + L::Kg, sT = base + L::T, sdW = base + L::dW;
  float qg[32], wa[32], mi[32], y[32], dp[16];
  zero(qg), zero(wa), zero(mi), zero(y), zero(dp);
  reg_fence(qg), reg_fence(wa), reg_fence(mi), reg_fence(y), reg_fence(dp);
  wg_fence();
  issue_v_side<T>(qg, wa, mi, y, dp, sS, sdS, sdO, sVn, sdU, sT, wg);
  wg_commit();
  mbar_wait(bars + 2, 0);
  zero_tail_rows<256>(smem + L::v, len, tid);
  zero_tail_rows<256>(smem + L::q, len, tid);
  zero_tail_rows<256>(smem + L::k, len, tid);
  fence_proxy_async();
  __syncthreads();
  // While the products run: K o Gam (dT's operand; rows past len are zero with k's), 8 keys a thread in k's
  // swizzled layout, and <dS', S> per key row d (S and dS' share one layout, so a row's 16-byte pieces pair up
  // in any order; thread (d = tid % 128, value half tid / 128) walks its row's pieces rotated by the row, so the
  // 8 threads of a 16-byte access phase fall on 8 different bank groups).
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int p = tid & 15, r = (tid >> 4) + 16 * it;
    const int o = (p >> 3) * kBox + r * 128 + (((p & 7) ^ (r & 7)) << 4);
    const uint4 kx = *reinterpret_cast<const uint4*>(smem + L::k + o);
    const float4 g0 = *reinterpret_cast<const float4*>(Gt + r * PG + 8 * p);
    const float4 g1 = *reinterpret_cast<const float4*>(Gt + r * PG + 8 * p + 4);
    const float2 k0 = unpack2<T>(kx.x), k1 = unpack2<T>(kx.y), k2 = unpack2<T>(kx.z), k3 = unpack2<T>(kx.w);
    *reinterpret_cast<uint4*>(smem + L::Kg + o) =
        make_uint4(pack2<T>(k0.x * exp_t<T>(g0.x), k0.y * exp_t<T>(g0.y)),
                   pack2<T>(k1.x * exp_t<T>(g0.z), k1.y * exp_t<T>(g0.w)),
                   pack2<T>(k2.x * exp_t<T>(g1.x), k2.y * exp_t<T>(g1.y)),
                   pack2<T>(k3.x * exp_t<T>(g1.z), k3.y * exp_t<T>(g1.w)));
  }
  {
    const int d = tid & 127, vh = tid >> 7;
    const int o = (2 * vh + (d >> 6)) * kBox + (d & 63) * 128;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int pc = ((i + d) & 7) << 4;
      const uint4 x = *reinterpret_cast<const uint4*>(smem + L::S + o + pc);
      const uint4 z = *reinterpret_cast<const uint4*>(smem + L::dS + o + pc);
      const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, zs[4] = {z.x, z.y, z.z, z.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = unpack2<T>(xs[e]), h2 = unpack2<T>(zs[e]);
        s = fmaf(f.x, h2.x, fmaf(f.y, h2.y, s));
      }
    }
    dgs[vh * 128 + d] = s;
  }
  fence_proxy_async();  // K o Gam: read by the WY side's products
  wg_wait<0>();
  reg_fence(qg), reg_fence(wa), reg_fence(mi), reg_fence(y), reg_fence(dp);
  __syncthreads();  // both warpgroups' products have read S, dS', dO and Vn: the intermediates take their bytes

  // ---- epilogue of the V side --------------------------------------------------------------------------
  const int ra = 16 * wi + g;  // this thread's rows ra and ra + 8 (register e: row ra + 8 ((e >> 1) & 1))
  const int cw = 64 * wg;      // its warpgroup's first column of the 128-wide results
  const unsigned char* vblk = smem + L::v + wg * kBox;
  const unsigned char* kblk = smem + L::k + wg * kBox;
  const unsigned char* qblk = smem + L::q + wg * kBox;
  // dW = -dU S^T (this warpgroup's column block) for the WY side's products.
  acc_to_block<T, 64>(smem + L::dW + wg * kBox, wa, 0, [](float x, int, int) { return -x; });
  // dP = scale dO Vn^T on j <= i < len, zero elsewhere: this warpgroup's 32 columns of every row, as B2 writes it.
  if constexpr (kDecay)
    stage_scores16<T, true>(reinterpret_cast<T*>(smem + D::Mp), nullptr, bs, reinterpret_cast<float*>(smem + D::dPd),
                            dflags, dp, wg, ra, t, len, [&](float x) { return a.scale * x; });
  else
    store_causal_scores<true>(a.dP + (c * HV + hv) * 64 * 64, dp, wg, ra, t, len,
                              [&](float x) { return a.scale * x; });
  // dv = diag(beta) Y, staged over dO for 16-byte stores after the barrier below; Y . v per row.
  stage_half_rows<T>(smem + L::dO, y, wg, [&](float x, int r) { return bs[r] * x; });
  float yv[2] = {0.f, 0.f};
  // minus = (Vn dS'^T) o e^(Gn - G), and KrSum's parts: per column, this thread's two rows, then the 8 lanes of
  // a column (rows of the warp), stored per warp.
#pragma unroll
  for (int nb = 0; nb < 8; ++nb) {
    float kr[2] = {0.f, 0.f};
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = ra + 8 * hh, cb = 8 * nb + 2 * t, e0 = 4 * nb + 2 * hh;
      const float2 gr = *reinterpret_cast<const float2*>(Gt + r * PG + cw + cb);
      const float2 gn = *reinterpret_cast<const float2*>(Gt + (len - 1) * PG + cw + cb);
      mi[e0] *= exp_t<T>(gn.x - gr.x);
      mi[e0 + 1] *= exp_t<T>(gn.y - gr.y);
      const float2 kv = block_pair<T>(kblk, r, cb), vv = block_pair<T>(vblk, r, cb);
      kr[0] += kv.x * mi[e0];  // k and mi are zero on rows past len
      kr[1] += kv.y * mi[e0 + 1];
      yv[hh] += y[e0] * vv.x + y[e0 + 1] * vv.y;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      kr[e] += __shfl_xor_sync(0xffffffffu, kr[e], 4);
      kr[e] += __shfl_xor_sync(0xffffffffu, kr[e], 8);
      kr[e] += __shfl_xor_sync(0xffffffffu, kr[e], 16);
    }
    if (g == 0) *reinterpret_cast<float2*>(krp + wi * 128 + cw + 8 * nb + 2 * t) = make_float2(kr[0], kr[1]);
  }
  fence_proxy_async();
  __syncthreads();
  store_staged_rows<T>(a.dv, ch.batch, ch.t0, hv, smem + L::dO, len);

  // ---- the WY side ---------------------------------------------------------------------------------------
  float pl[32], dt[16];
  zero(pl), zero(dt);
  reg_fence(pl), reg_fence(dt);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)  // T^T dW
    wgmma_ss<T, 64, 1, 1>(pl, mnmajor(sT + kk * 2048), mnmajor(sdW + wg * kBox + kk * 2048), 1);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {  // dU V^T + dW (K o Gam)^T: K = 128 (value, then key columns)
    const uint32_t ko = (kk >> 2) * kBox + (kk & 3) * 32;
    wgmma_ss<T, 32, 0, 0>(dt, kmajor(sdU + ko), kmajor(sv + ko + wg * 4096), 1);
  }
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const uint32_t ko = (kk >> 2) * kBox + (kk & 3) * 32;
    wgmma_ss<T, 32, 0, 0>(dt, kmajor(sdW + ko), kmajor(sKg + ko + wg * 4096), 1);
  }
  wg_commit();
  wg_wait<0>();
  reg_fence(pl), reg_fence(dt);
  // dT = (dU V^T + dW (K o Gam)^T) diag(beta), its 32 columns.
#pragma unroll
  for (int e = 0; e < 16; ++e) dt[e] *= bs[32 * wg + 8 * (e >> 2) + 2 * t + (e & 1)];
  acc_to_block<T, 32>(smem + L::dT, dt, 32 * wg, [](float x, int, int) { return x; });
  {
    float da[16];  // (T^T dT) T^T = -dA, its 32 columns
    wy_minus_dA<T>(smem, base, L::dT, L::M1, sT, wg, ra, t, da);
    // dA on j < i < len, zero elsewhere, as B3 writes it.
    if constexpr (kDecay)
      stage_scores16<T, false>(reinterpret_cast<T*>(smem + D::Ma), reinterpret_cast<T*>(smem + D::Mb), bs,
                               reinterpret_cast<float*>(smem + D::dAd), dflags, da, wg, ra, t, len,
                               [](float x) { return -x; });
    else
      store_causal_scores<false>(a.dA + (c * HV + hv) * 64 * 64, da, wg, ra, t, len, [](float x) { return -x; });
  }

  // ---- stage B4's decay products (bwd_decay.cuh's algebra) into this warp's rows and columns (kDecay) -----------
  // Warp wi takes row block a = wi and column block b = wi of every 64 x 64 score gradient, on its warpgroup's 64
  // key columns: the accumulators of B2 and B3 already hold those rows and columns. qg ends as the final dq, pl as
  // plus' (plus o Gam + Yr) and mi as minus + Yc (Yc's products in tc until the epilogue). The off-diagonal blocks
  // go through bwd_decay_kda_tc_kernel's reference rows (Kr, Qs, Ks built once for the CTA), the diagonal ones
  // through the same rows in tf32 with their operands built in registers, or element by element where refused.
  float tc[kDecay ? 32 : 1];
  float ec_on = 0.f;
  const float* dP_self = nullptr;
  int m0_dec = 0, cref_dec = 0;
  if constexpr (kDecay) {
    using DK = DecayKdaTcSmem<T, 128>;  // its operand row offsets (kr_row0, qs_row0)
    constexpr int PK = D::PK;
    T* Mp = reinterpret_cast<T*>(smem + D::Mp);
    T* Ma = reinterpret_cast<T*>(smem + D::Ma);
    T* Mb = reinterpret_cast<T*>(smem + D::Mb);
    T* Kr = reinterpret_cast<T*>(smem + D::Kr);
    T* Qs = reinterpret_cast<T*>(smem + D::Qs);
    const unsigned char* qtile = smem + L::q;
    const unsigned char* ktile = smem + L::k;
    __syncthreads();  // the WY side is done: S, Vn, dU, v free; dA staged
    T* Ks = reinterpret_cast<T*>(smem + D::Ks);
    // Kr, Qs and Ks (bwd_decay.cuh's decay_operand_piece), eight keys a thread, in a rolled loop (instruction cache).
#pragma unroll 1
    for (int e = tid; e < D::kOperandRows * 16; e += 256)
      decay_operand_piece<T, 16>(
          e, Kr, Qs, Ks, PK, Gt, PG, len, [&](int i, int d0, float(&x)[8]) { tile_row8<T>(qtile, i, d0, x); },
          [&](int i, int d0, float(&x)[8]) { tile_row8<T>(ktile, i, d0, x); });
    __syncthreads();
    const int m0 = 16 * wi, sref = m0 + 16, cref = col_ref_row(wi);
    const float* dPb = reinterpret_cast<const float*>(smem + D::dPd) + wi * 16 * 17;
    const float* dAb = reinterpret_cast<const float*>(smem + D::dAd) + wi * 16 * 17;
    const bool live = m0 < len;
    const bool fits = live && dflags[wi] == 0 && diag_block_fits<T>(qblk, kblk, Gt, PG, m0, cref, cw, len);
    {  // the row side: Yq into dq, Yr into plus', 32 columns a pass (swap_halves)
      const bool offd = wi >= 1 && live;
      const float er_on = (fits || offd) ? 1.f : 0.f;  // sides with no product keep their zeros
      const T* Kra = Kr + DK::kr_row0(wi) * PK;
#pragma unroll 1
      for (int pass = 0; pass < 2; ++pass) {
        const int c0 = 32 * pass;
        float tq[16], tr[16];
        zero(tq), zero(tr);
        auto& aq = *reinterpret_cast<float(*)[1][4][4]>(tq);
        auto& ar = *reinterpret_cast<float(*)[1][4][4]>(tr);
        if (offd) {
          warp_mma<T, 1, 4, Lay::rowmajor, Lay::rowmajor>(aq, Mp, D::P64, m0, Kra, PK, cw + c0, 0, m0);
          warp_mma<T, 1, 4, Lay::rowmajor, Lay::rowmajor>(ar, Ma, D::P64, m0, Kra, PK, cw + c0, 0, m0);
        }
        if (fits) diag_row_side_tf32<T>(tq, tr, dPb, dAb, kblk, Gt, PG, m0, cw, c0);
        // Scaled back from the reference row (e^(G_r - G_m0)), the pairs j = i of a block on the tensor cores
        // (dP_ii k_i), then into dq (scale (dO S^T) o Gam + Yq) and plus' (plus o Gam + Yr).
        float (&q16)[16] = first_half(qg);
        float (&p16)[16] = first_half(pl);
#pragma unroll
        for (int nb = 0; nb < 4; ++nb)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int r = ra + 8 * hh, cb = c0 + 8 * nb + 2 * t, e0 = 4 * nb + 2 * hh, col = cw + cb;
            const float2 gr = *reinterpret_cast<const float2*>(Gt + r * PG + col);
            const float2 g0 = *reinterpret_cast<const float2*>(Gt + m0 * PG + col);
            const float2 kv = block_pair<T>(kblk, r, cb);
            const float pii = fits ? dPb[(r - m0) * 17 + (r - m0)] : 0.f;  // rows past len: 0
            const float er0 = er_on * exp_t<T>(gr.x - g0.x), er1 = er_on * exp_t<T>(gr.y - g0.y);
            const float gam0 = exp_t<T>(gr.x), gam1 = exp_t<T>(gr.y);
            q16[e0] = a.scale * q16[e0] * gam0 + fmaf(tq[e0], er0, pii * kv.x);
            q16[e0 + 1] = a.scale * q16[e0 + 1] * gam1 + fmaf(tq[e0 + 1], er1, pii * kv.y);
            p16[e0] = p16[e0] * gam0 + tr[e0] * er0;
            p16[e0 + 1] = p16[e0 + 1] * gam1 + tr[e0 + 1] * er1;
          }
        swap_halves(qg), swap_halves(pl);
      }
      if (!fits && live) diag_every_pair<T, true>(qg, pl, dPb, dAb, bs, qblk, kblk, Gt, PG, m0, cw);
    }
    zero(tc);
    auto& ac = *reinterpret_cast<float(*)[1][8][4]>(tc);
    if (wi <= 2 && sref < len) {
      const int o = DK::qs_row0(wi) * PK;
      warp_mma<T, 1, 8, Lay::colmajor, Lay::rowmajor>(ac, Mp + sref * D::P64, D::P64, m0, Qs + o, PK, cw, 0, 64 - sref);
      warp_mma<T, 1, 8, Lay::colmajor, Lay::rowmajor>(ac, Mb + sref * D::P64, D::P64, m0, Ks + o, PK, cw, 0, 64 - sref);
    }
    __syncthreads();  // Kr, Qs and Ks are read: dG takes their bytes
    // The column side's diagonal block; a refused block's pairs straight into minus; the scale-back and the pairs
    // j = i of the rest join minus in the epilogue.
    if (!fits && live) diag_every_pair<T, false>(mi, mi, dPb, dAb, bs, qblk, kblk, Gt, PG, m0, cw);
    ec_on = (fits || (wi <= 2 && sref < len)) ? 1.f : 0.f;
    dP_self = fits ? dPb : nullptr;
    m0_dec = m0, cref_dec = cref;
  }

  // ---- epilogue: B2's and B3's parts of dq, dk, dG and dbeta (with the decay products: the final ones) ---------
  // On this thread's elements of columns c0 + 8 nb + 2 t (+1) of its warpgroup's 64, nb < NB (the arrays' length / 4).
  float db[2] = {yv[0], yv[1]};
  auto epilogue = [&](auto& qa, auto& pa, auto& ma, auto& ta, int c0) {
    constexpr int NB = sizeof(qa) / (4 * sizeof(float));
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = ra + 8 * hh, cb = c0 + 8 * nb + 2 * t, e0 = 4 * nb + 2 * hh, col = cw + cb;
        const float b = bs[r];
        const float2 gr = *reinterpret_cast<const float2*>(Gt + r * PG + col);
        const float2 qv = block_pair<T>(qblk, r, cb), kv = block_pair<T>(kblk, r, cb);
        float dq0, dq1, p0, p1;
        if constexpr (kDecay) {  // minus += Yc: ta scaled back by e^(G_s - G_r), and the pairs j = i (dP_jj q_j)
          const float2 gc = *reinterpret_cast<const float2*>(Gt + cref_dec * PG + col);
          const float pjj = dP_self != nullptr ? dP_self[(r - m0_dec) * 17 + (r - m0_dec)] : 0.f;
          ma[e0] += fmaf(ta[e0], ec_on * exp_t<T>(gc.x - gr.x), pjj * qv.x);
          ma[e0 + 1] += fmaf(ta[e0 + 1], ec_on * exp_t<T>(gc.y - gr.y), pjj * qv.y);
          dq0 = qa[e0], dq1 = qa[e0 + 1], p0 = pa[e0], p1 = pa[e0 + 1];  // final already: dq and plus'
        } else {
          const float gam0 = exp_t<T>(gr.x), gam1 = exp_t<T>(gr.y);
          dq0 = a.scale * qa[e0] * gam0, dq1 = a.scale * qa[e0 + 1] * gam1;
          p0 = pa[e0] * gam0, p1 = pa[e0 + 1] * gam1;
        }
        db[hh] += kv.x * p0 + kv.y * p1;
        float g0 = qv.x * dq0 - kv.x * ma[e0] + b * kv.x * p0;
        float g1 = qv.y * dq1 - kv.y * ma[e0 + 1] + b * kv.y * p1;
        if constexpr (!kDecay) {  // (with the decay side: added before dg's sum)
          if (r == len - 1) {  // the decay of S (e^Gn <dS', S>) and Gn in Kr (KrSum), per key
            const float gam0 = exp_t<T>(gr.x), gam1 = exp_t<T>(gr.y);
            const float2 s0 = *reinterpret_cast<const float2*>(dgs + col);
            const float2 s1 = *reinterpret_cast<const float2*>(dgs + 128 + col);
            const float2 k0 = *reinterpret_cast<const float2*>(krp + col);
            const float2 k1 = *reinterpret_cast<const float2*>(krp + 128 + col);
            const float2 k2 = *reinterpret_cast<const float2*>(krp + 256 + col);
            const float2 k3 = *reinterpret_cast<const float2*>(krp + 384 + col);
            g0 += gam0 * (s0.x + s1.x) + (((k0.x + k1.x) + k2.x) + k3.x);
            g1 += gam1 * (s0.y + s1.y) + (((k0.y + k1.y) + k2.y) + k3.y);
          }
        }
        if (r < len) {
          const int64_t o = ws_row(ch, r, HV, hv, kLocalKeys) + col;
          const float dk0 = ma[e0] + b * p0, dk1 = ma[e0 + 1] + b * p1;
          if (!kDecay || a.group > 1) {  // B4's inputs, or (with the decay products) the heads' reduction's
            *reinterpret_cast<float2*>(a.dqw + o) = make_float2(dq0, dq1);
            *reinterpret_cast<float2*>(a.dkw + o) = make_float2(dk0, dk1);
          } else {  // over this thread's own q and k elements (read above; no other thread reads them now)
            *reinterpret_cast<uint32_t*>(smem + L::q + wg * kBox + sw_pair(r, cb)) = pack2<T>(dq0, dq1);
            *reinterpret_cast<uint32_t*>(smem + L::k + wg * kBox + sw_pair(r, cb)) = pack2<T>(dk0, dk1);
          }
          if constexpr (kDecay)
            *reinterpret_cast<float2*>(reinterpret_cast<float*>(smem + D::dG) + r * D::PGd + col) = make_float2(g0, g1);
          else
            *reinterpret_cast<float2*>(a.dGw + o) = make_float2(g0, g1);
        }
      }
  };
  if constexpr (kDecay) {
    const float* dPb = reinterpret_cast<const float*>(smem + D::dPd) + wi * 16 * 17;
    const float* dAb = reinterpret_cast<const float*>(smem + D::dAd) + wi * 16 * 17;
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {
      const int c0 = 32 * pass;
      if (dP_self != nullptr)  // the column side's diagonal block on the tensor cores
        diag_col_side_tf32<T>(first_half(tc), dPb, dAb, bs, qblk, kblk, Gt, PG, m0_dec, cref_dec, cw, c0);
      epilogue(first_half(qg), first_half(pl), first_half(mi), first_half(tc), c0);
      swap_halves(qg), swap_halves(pl), swap_halves(mi), swap_halves(tc);
    }
  } else {
    epilogue(qg, pl, mi, qg, 0);
  }
  // dbeta's part per row: the four lanes of a row, then lane 4 g writes this warpgroup's part (a fixed order).
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    db[hh] += __shfl_xor_sync(0xffffffffu, db[hh], 1);
    db[hh] += __shfl_xor_sync(0xffffffffu, db[hh], 2);
    if (t == 0) part[wg * 64 + ra + 8 * hh] = db[hh];
  }
  __syncthreads();
  if constexpr (kDecay) {
    // dbeta whole; dg = the reverse cumulative sum of dG over the chunk (finish_kda_chunk's order).
    if (tid < len) st<T>(a.dbeta, off(a.dbeta, ch.batch, ch.t0 + tid, hv), part[tid] + part[64 + tid]);
    if (a.group == 1) {
      store_tile_rows<T>(a.dq, ch.batch, ch.t0, hk, smem + L::q, len);
      store_tile_rows<T>(a.dk, ch.batch, ch.t0, hk, smem + L::k, len);
    }
    const float* dGs = reinterpret_cast<const float*>(smem + D::dG);
    if (tid < kLocalKeys) {  // starting from the last row's decay of S and Gn in Kr (KrSum), per key
      const int d = tid;
      float acc = exp_t<T>(Gt[(len - 1) * PG + d]) * (dgs[d] + dgs[128 + d]) +
                  (((krp[d] + krp[128 + d]) + krp[256 + d]) + krp[384 + d]);
      for (int i = len - 1; i >= 0; --i) {
        acc += dGs[i * D::PGd + tid];
        store_gate<T>(a, off(a.dg, ch.batch, ch.t0 + i, hv) + tid, acc);
      }
    }
  } else {
    if (tid < len) a.dbw[(ch.row0 + tid) * HV + hv] = part[tid] + part[64 + tid];
  }
#else
  __trap();  // never launched: the host selects this kernel only for builds with sm_90a code
#endif
}

// ---- host ----------------------------------------------------------------------------------------
// Why the kda chunk-local kernel cannot run p (nullptr: it can).
inline const char* local_kda_refusal(const Params& p) {
#ifndef DELTACP_HAVE_SM90A
  (void)p;
  return "this build has no sm_90a code";
#else
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return "it takes bf16 or fp16 inputs";
  if (p.variant != Variant::kda) return "it takes kda's per-key gate (gdn and delta have bwd_local_wgmma.cuh)";
  return local_tma_refusal(p, LocalKdaSmem::bytes);
#endif
}

// DELTACP_TILED_BWD_LOCAL_KDA (common/kernel_switch.h): unset = this kernel instead of stages B2 and B3 where
// it applies; 0 = the two mma.sync kernels; 1 = required (an error names why it cannot run these inputs).
inline bool use_local_kda(const Params& p) {
  return kernel_switch("DELTACP_TILED_BWD_LOCAL_KDA", "the kda chunk-local kernel",
                       [&] { return local_kda_refusal(p); });
}

// DELTACP_TILED_BWD_LOCAL_KDA_DECAY (common/kernel_switch.h), where the kda chunk-local kernel runs: unset = stage
// B4 inside it for bf16 (fp16 keeps bwd_decay_kda_tc_kernel: every fp16 diagonal block is summed element by
// element, which this kernel does in rolled loops, there for rare blocks: H200, fp16 kda forward + backward,
// stage_times.py without FLA's keywords, 6.96 ms elapsed with B4 apart against 8.43 inside at (2,16384,16,128),
// 9.16 against 11.62 at (1,8192,96,128)); 0 = B4 apart; 1 = B4 inside for bf16 and fp16.
inline bool use_local_kda_decay(const Params& p) {
  return kernel_switch("DELTACP_TILED_BWD_LOCAL_KDA_DECAY", "the kda chunk-local kernel with stage B4",
                       [&] { return local_kda_refusal(p); }, p.dtype == DType::bf16);
}

// Over the a.num_chunks chunks of a (a slice: a.chunks, a.h, a.dh, a.dP and a.dA start at its first chunk); with
// kDecay, stage B4 too.
template <class T, bool kDecay = false>
void launch_local_kda(const Args& a, cudaStream_t stream) {
  if (a.num_chunks == 0) return;
  const LocalWgArgs w = local_wg_args(a);
  auto kernel = bwd_local_kda_wgmma_kernel<T, kDecay>;
  opt_in_smem(kernel, LocalKdaSmem::bytes, "K", "the kda chunk-local backward needs ", LocalKdaSmem::bytes,
              " bytes of shared memory");
  const dim3 grid(static_cast<unsigned>(a.num_chunks), static_cast<unsigned>(a.HV));
  kernel<<<grid, 256, LocalKdaSmem::bytes, stream>>>(w);
  DELTACP_CUDA_CHECK_LAUNCH();
}

}  // namespace deltacp::cuda::tiled::bwd
