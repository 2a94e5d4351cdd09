// cuda/tiled/bwd_local_kda_wgmma.cuh — kda's backward stages B2 and B3 (the V side and the WY side of the
// chunk-local gradients) as one kernel on Hopper's warpgroup products. Launched instead of bwd_dqkg_kernel and
// bwd_wy_kernel (bwd_dqkg.cuh, bwd_wy.cuh: the same algebra on mma.sync) for 16-bit kda at K = V = 128, chunk 64,
// compute capability 9.0 (local_kda_refusal says where it cannot run; DELTACP_TILED_BWD_LOCAL_KDA=0 keeps the
// two). Measured on H100 (bf16, (2, 16384, 16, 128), CUDA time of the kernels): 1.26 ms where B2 + B3 take
// 1.37 + 1.45 ms; the fused-tier forward + backward's kernels 8.83 -> 7.26 ms. It hands stage B4
// (bwd_decay_kda_tc_kernel, unchanged) the buffers B2 and B3 hand it, with the same meaning: dP and dA (fp32
// 64 x 64, masked), the fp32 per-value-head parts of dq, dk and dG, and B3's part of dbeta; dv is final here as in
// B3. dW, which B2 writes for B3 only, stays in shared memory.
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
  static constexpr int bytes = bar + 3 * 8 + 1024;  // + slack for the alignment
};
static_assert(LocalKdaSmem::M1 + LocalKdaSmem::kBox <= LocalKdaSmem::dS, "the intermediates fit over S");
static_assert(LocalKdaSmem::G % 16 == 0 && (LocalKdaSmem::kPG * 4) % 16 == 0, "G rows take 16-byte copies");
static_assert(LocalKdaSmem::bytes == 228120, "the size the opening comment gives");
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
#endif

template <class T>
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

  const int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t c = blockIdx.x, hv = blockIdx.y, HV = a.HV, hk = hv / a.group;
  const ChunkEntry ch = a.chunks[c];
  const int len = static_cast<int>(ch.len);
  const uint32_t base = smem_u32(smem);

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
    store_causal_scores<false>(a.dA + (c * HV + hv) * 64 * 64, da, wg, ra, t, len, [](float x) { return -x; });
  }

  // ---- epilogue: B2's and B3's parts of dq, dk, dG and dbeta --------------------------------------------------
  float db[2] = {yv[0], yv[1]};
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = ra + 8 * hh, cb = 8 * nb + 2 * t, e0 = 4 * nb + 2 * hh, col = cw + cb;
      const float b = bs[r];
      const float2 gr = *reinterpret_cast<const float2*>(Gt + r * PG + col);
      const float gam0 = exp_t<T>(gr.x), gam1 = exp_t<T>(gr.y);
      const float2 qv = block_pair<T>(qblk, r, cb), kv = block_pair<T>(kblk, r, cb);
      const float dq0 = a.scale * qg[e0] * gam0, dq1 = a.scale * qg[e0 + 1] * gam1;
      const float p0 = pl[e0] * gam0, p1 = pl[e0 + 1] * gam1;
      db[hh] += kv.x * p0 + kv.y * p1;
      float g0 = qv.x * dq0 - kv.x * mi[e0] + b * kv.x * p0;
      float g1 = qv.y * dq1 - kv.y * mi[e0 + 1] + b * kv.y * p1;
      if (r == len - 1) {  // the decay of S (e^Gn <dS', S>) and Gn in Kr (KrSum), per key
        const float2 s0 = *reinterpret_cast<const float2*>(dgs + col);
        const float2 s1 = *reinterpret_cast<const float2*>(dgs + 128 + col);
        const float2 k0 = *reinterpret_cast<const float2*>(krp + col);
        const float2 k1 = *reinterpret_cast<const float2*>(krp + 128 + col);
        const float2 k2 = *reinterpret_cast<const float2*>(krp + 256 + col);
        const float2 k3 = *reinterpret_cast<const float2*>(krp + 384 + col);
        g0 += gam0 * (s0.x + s1.x) + (((k0.x + k1.x) + k2.x) + k3.x);
        g1 += gam1 * (s0.y + s1.y) + (((k0.y + k1.y) + k2.y) + k3.y);
      }
      if (r < len) {
        const int64_t o = ws_row(ch, r, HV, hv, kLocalKeys) + col;
        *reinterpret_cast<float2*>(a.dqw + o) = make_float2(dq0, dq1);
        *reinterpret_cast<float2*>(a.dkw + o) = make_float2(mi[e0] + b * p0, mi[e0 + 1] + b * p1);
        *reinterpret_cast<float2*>(a.dGw + o) = make_float2(g0, g1);
      }
    }
  // dbeta's part per row: the four lanes of a row, then lane 4 g writes this warpgroup's part (a fixed order).
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    db[hh] += __shfl_xor_sync(0xffffffffu, db[hh], 1);
    db[hh] += __shfl_xor_sync(0xffffffffu, db[hh], 2);
    if (t == 0) part[wg * 64 + ra + 8 * hh] = db[hh];
  }
  __syncthreads();
  if (tid < len) a.dbw[(ch.row0 + tid) * HV + hv] = part[tid] + part[64 + tid];
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

// Over the a.num_chunks chunks of a (a slice: a.chunks, a.h, a.dh, a.dP and a.dA start at its first chunk).
template <class T>
void launch_local_kda(const Args& a, cudaStream_t stream) {
  if (a.num_chunks == 0) return;
  const LocalWgArgs w = local_wg_args(a);
  auto kernel = bwd_local_kda_wgmma_kernel<T>;
  opt_in_smem(kernel, LocalKdaSmem::bytes, "K", "the kda chunk-local backward needs ", LocalKdaSmem::bytes,
              " bytes of shared memory");
  const dim3 grid(static_cast<unsigned>(a.num_chunks), static_cast<unsigned>(a.HV));
  kernel<<<grid, 256, LocalKdaSmem::bytes, stream>>>(w);
  DELTACP_CUDA_CHECK_LAUNCH();
}

}  // namespace deltacp::cuda::tiled::bwd
