// cuda/tiled/bwd_local_wgmma.cuh — backward stages B2, B3 and B4 (the chunk-local gradients) as one kernel on
// Hopper's warpgroup products. Launched instead of bwd_dqkg_kernel, bwd_wy_kernel and bwd_decay_scalar_kernel
// (bwd_dqkg.cuh, bwd_wy.cuh, bwd_decay.cuh: the same algebra, three kernels on mma.sync) wherever it applies:
// gdn and delta, bf16 / fp16, K = V = 128, chunk 64, compute capability 9.0 (local_wgmma_refusal says why not;
// DELTACP_TILED_BWD_LOCAL_WGMMA=0 keeps the three kernels). The regrouped algebra below is tied to the chain
// rule on the CPU by tests/python/test_chunk_backward_algebra.py (autograd in fp64), the kernel to the three
// mma.sync kernels and the fp64 reference by test_fused_local_backward_matches_the_three_stages.
// Measured (NVIDIA H100, bf16 gdn, (2,16384,16,128), kernel time per call, stage_times.py, 2026-11-27): 1.03 ms
// against 3.15 for the three kernels (B2 1.30, B3 1.04, B4 0.81); the forward + backward's kernels 6.01 ->
// 3.90 ms with it, and the step's peak memory 675 -> 482 MiB at (4,2048,16,128) (FLA 531), bench_gpu.py.
//
// For one chunk (notation of bwd_common.cuh; Gam_i = e^(G_i), E_ij = e^(G_i - G_j) for i >= j, a scalar per
// (i, j) for a scalar gate) with S = h[c], dS' = dh[c] (B1), Vn, dU = dVn (B1), T and dO, the three stages'
// gradients regroup into three accumulators per (token row, key column) and one per (token row, value column):
//
//   dq     =  diag(scale Gam) dO S^T               +  (dP o E) K
//   minus  =  diag(e^(Gn - G)) Vn dS'^T            +  (dP o E)^T Q  +  (diag(beta) dA o E)^T K
//   plus   =  diag(Gam) T^T dW                     +  (dA o E) K
//   Y      =  T^T dU
//
//   dk = minus + diag(beta) plus      dv = diag(beta) Y      dbeta_i = Y_i . v_i + k_i . plus_i
//   dG_i = q_i . dq_i + beta_i k_i . plus_i - k_i . minus_i  (+ on the last row: e^Gn <dS', S> + sum_j k_j . Kr-part_j)
//   dg = the reverse cumulative sum of dG over the chunk
//
// with the 64 x 64 intermediates  dP = scale dO Vn^T (j <= i < len),  dW = -dU S^T,
// dT = (dU V^T + (dW K^T) diag(Gam)) diag(beta),  dA = -(T^T dT) T^T (j < i < len). Each accumulator takes a
// row scale (Gam, e^(Gn - G)) between its first product and the ones added after it, so no scaled copy of an
// operand is made; dT's column scales act on the accumulators too. The Kr-part of minus is summed (k . minus
// over the chunk) before the decay products join it: that sum is the last row's share of dG from Gn in Kr.
//
// One CTA of two warpgroups (256 threads) per (chunk, value head); warpgroup h owns columns 64 h .. 64 h + 63 of
// every 64 x 128 result and 32 h .. 32 h + 31 of every 64 x 64 one (T^T dT, 64 columns in both: its operand
// would be split inside a swizzle row), so each thread holds dq, minus and plus of the same elements and
// finishes dk and dG in registers. Steps (every product wgmma with both operands in shared memory):
//   loads     by TMA on three mbarriers, in the order of first use: dO and S (h[c], 128 x 128), then Vn and dS'
//             (dh[c]), then v, q, k (64 tokens x 128, 64 x 64 boxes, 128-byte swizzle; rows past a short chunk
//             zeroed in shared memory); dU (fp32) and T (fp32) by 16-byte loads, rounded to the input dtype into
//             the same swizzled layout (or, with Args::dvn16 / t16, as B1 / the WY stage rounded them: the same
//             bits, half the bytes)
//   V side    dO S^T, dU S^T, Vn dS'^T (K = 128), dO Vn^T, dU V^T (n32), T^T dU (K = 64): 160 accumulator
//             registers a thread; meanwhile <dS', S> from shared memory
//   epilogue  dW, dP o E to shared memory (over S); dv = beta Y staged (over dU) and stored as 16-byte pieces
//             of whole rows; Y . v per row; the row scales
//   WY side   T^T dW, dW K^T, then dT, T^T dT, dA = -(T^T dT) T^T, dA o E and diag(beta) dA o E to shared memory
//   decay     (dP o E) K, (dA o E) K, (dP o E)^T Q, (diag(beta) dA o E)^T K into dq, plus and minus
//   epilogue  dq, dk staged (over dO and Vn) and stored like dv (with grouped value heads: per value head to
//             the fp32 workspaces that stage B5 sums); dbeta, and dg as the reverse cumulative sum of the rows' dG
// Nothing of a chunk goes through global memory between the three stages: the mma.sync kernels write and read
// dW (bf16), dP and dA (fp32 64 x 64), and the fp32 dq, dk, dG parts (1800 bytes per token and head).
// Shared memory: S and dS' 32 KB each, dO, Vn, dU, v, q, k 16 KB each, T 8 KB; the intermediates reuse S's and
// dS''s bytes, the staged outputs dO's, Vn's and dU's; with the per-row data 175,448 bytes (1 KB of it alignment
// slack): one CTA per SM.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/check.h"
#include "../common/device_info.h"
#include "../common/kernel_switch.h"
#include "../common/tma.cuh"
#include "bwd_common.cuh"
#include "wgmma_ops.cuh"

namespace deltacp::cuda::tiled::bwd {

constexpr int kLocalKeys = 128;  // K = V = 128

struct LocalWgArgs {
  TileMap16 tm_q, tm_k;     // [B, T, H, 128] as the caller strides them: boxes of 64 columns x 64 tokens
  TileMap16 tm_v, tm_do;    // [B, T, HV, 128]
  TileMap16 tm_vn;          // [R, HV, 128] v_new (the recompute's state scan)
  TileMap16 tm_h, tm_dh;    // [chunks * HV * 128, 128]: h[c] and dh[c] of (chunk, value head), 64 x 64 boxes
  Args a;
};

// Byte offsets from a 1024-byte aligned base. A 64-column block of a tile is its rows of 128 bytes (the
// 128-byte swizzle: 16-byte piece p of row r at p ^ (r % 8)); a 64 x 128 tile is two 8 KB blocks, S and dS'
// (128 rows) two 16 KB blocks.
struct LocalWgSmem {
  static constexpr int kBox = 64 * 128;
  static constexpr int S = 0, dS = S + 4 * kBox, dO = dS + 4 * kBox, Vn = dO + 2 * kBox, dU = Vn + 2 * kBox;
  static constexpr int v = dU + 2 * kBox, q = v + 2 * kBox, k = q + 2 * kBox, T = k + 2 * kBox;
  // After the V side, over S and dS': dW (64 x 128), dP o E, dA o E, diag(beta) dA o E, dT, T^T dT (64 x 64).
  static constexpr int dW = 0, dPE = dW + 2 * kBox, dAE = dPE + kBox, dAEb = dAE + kBox, dT = dAEb + kBox,
                       M1 = dT + kBox;
  // Per token row: G, e^G, e^(Gn - G), beta, the final dG; the rows' parts of dbeta and dG per warpgroup; the
  // per-warp parts of the two chunk sums (<dS', S>, k . Kr-part); three mbarriers.
  static constexpr int g = T + kBox, eg = g + 256, ek = eg + 256, beta = ek + 256, dG = beta + 256;
  static constexpr int part = dG + 256;  // [2 (dbeta, dG)][2 warpgroups][64]
  static constexpr int red = part + 4 * 256;  // [2][8]
  static constexpr int bar = red + 64;
  static constexpr int bytes = bar + 3 * 8 + 1024;  // + slack for the alignment
};
static_assert(LocalWgSmem::M1 + LocalWgSmem::kBox <= LocalWgSmem::dO, "the intermediates fit over S and dS'");
static_assert(LocalWgSmem::bytes == 175448, "the size the opening comment gives");

#ifdef DELTACP_WGMMA_DEVICE
// dU (dL/dVn, fp32 [R, HV, 128]) and T (fp32 [R, HV, 64]) of one chunk, rows < len (zeros past them), as 8-column
// pieces: dU's piece tid % 16 of rows tid / 16 + 16 it, T's piece tid % 8 of rows tid / 8 + 32 it (a thread's rows
// keep one swizzle phase). The chunk-local kernels load them (load_du_t), do their own per-row set-up while the
// loads are in flight, then round them into shared memory (store_du_t).
struct DuTPieces {
  float4 du[4][2], tv[2][2];
};
__device__ __forceinline__ void load_du_t(DuTPieces& p, const Args& a, const ChunkEntry& ch, int64_t hv, int64_t HV,
                                          int len, int tid) {
  const int pu = tid & 15, ru = tid >> 4, pt = tid & 7, rt = tid >> 3;
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int r = ru + 16 * it;
    p.du[it][0] = p.du[it][1] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < len && a.dvn16) {  // B1 wrote dVn in 16 bits (Args::dvn16): the piece's 8 values as raw bits
      p.du[it][0] = __ldg(reinterpret_cast<const float4*>(reinterpret_cast<const char*>(a.dvnew) +
                                                          dvn16_at(ch.row0 + r, hv, HV, kLocalKeys, 8 * pu)));
    } else if (r < len) {
      const float4* src = reinterpret_cast<const float4*>(a.dvnew + ((ch.row0 + r) * HV + hv) * kLocalKeys + 8 * pu);
      p.du[it][0] = __ldg(src);
      p.du[it][1] = __ldg(src + 1);
    }
  }
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int r = rt + 32 * it;
    p.tv[it][0] = p.tv[it][1] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < len && a.t16) {  // the WY stage wrote T in 16 bits (Args::t16): the piece's 8 values as raw bits
      p.tv[it][0] = __ldg(reinterpret_cast<const float4*>(
          reinterpret_cast<const char*>(a.Tinv + ((ch.row0 + r) * HV + hv) * 64) + 16 * pt));
    } else if (r < len) {
      const float4* src = reinterpret_cast<const float4*>(a.Tinv + ((ch.row0 + r) * HV + hv) * 64 + 8 * pt);
      p.tv[it][0] = __ldg(src);
      p.tv[it][1] = __ldg(src + 1);
    }
  }
}
// The pieces into the swizzled dU (two 64-column blocks of kBox bytes at dU_at) and T (one block at T_at) tiles, in
// 16 bits: the raw bits where the writer already rounded them (Args::dvn16 / t16), else rounded here.
template <class T>
__device__ __forceinline__ void store_du_t(unsigned char* smem, int dU_at, int T_at, int kBox, const DuTPieces& p,
                                           const Args& a, int tid) {
  const int pu = tid & 15, ru = tid >> 4, pt = tid & 7, rt = tid >> 3;
  auto piece16 = [](bool rounded, float4 x, float4 y) {
    return rounded ? make_uint4(__float_as_uint(x.x), __float_as_uint(x.y), __float_as_uint(x.z), __float_as_uint(x.w))
                   : make_uint4(pack2<T>(x.x, x.y), pack2<T>(x.z, x.w), pack2<T>(y.x, y.y), pack2<T>(y.z, y.w));
  };
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int r = ru + 16 * it;
    *reinterpret_cast<uint4*>(smem + dU_at + (pu >> 3) * kBox + r * 128 + (((pu & 7) ^ (r & 7)) << 4)) =
        piece16(a.dvn16, p.du[it][0], p.du[it][1]);
  }
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    const int r = rt + 32 * it;
    *reinterpret_cast<uint4*>(smem + T_at + r * 128 + ((pt ^ (r & 7)) << 4)) = piece16(a.t16, p.tv[it][0], p.tv[it][1]);
  }
  fence_proxy_async();
}
// Rows len .. 63 of a 64 x 128 token tile (two 64-row blocks) at tile: zero, after its boxes have landed, so that
// a short chunk's products see the zeros that masked loads would have left. nthreads threads share the work.
template <int nthreads>
__device__ __forceinline__ void zero_tail_rows(unsigned char* tile, int len, int tid) {
  if (len < 64)
    for (int idx = tid; idx < 2 * 64 * 8; idx += nthreads) {
      const int row = (idx >> 3) & 63;
      if (row >= len) *reinterpret_cast<uint4*>(tile + idx * 16) = make_uint4(0u, 0u, 0u, 0u);
    }
}

// The chunk-local kernels' loads by TMA, issued by one thread in the order of first use: dO and h[c] on mbarrier 0,
// Vn and dh[c] on 1, v, q and k on 2 (64 x 64 boxes; L is the kernel's shared-memory layout: its S, dS, dO, Vn, v,
// q and k offsets).
template <class L>
__device__ __forceinline__ void issue_local_loads(unsigned char* smem, uint64_t* bars, const LocalWgArgs& args,
                                                  const ChunkEntry& ch, int64_t c, int64_t hv, int64_t HV,
                                                  int64_t hk) {
  constexpr int kBox = L::kBox;
  for (int i = 0; i < 3; ++i) mbar_init(bars + i, 1);
  fence_mbar_init();
  const int t0 = static_cast<int>(ch.t0), b = static_cast<int>(ch.batch), h = static_cast<int>(hk);
  const int hvi = static_cast<int>(hv), srow = static_cast<int>((c * HV + hv) * kLocalKeys);
  const int row0 = static_cast<int>(ch.row0);
  mbar_expect_tx(bars, 6 * kBox);
  tma_load_4d(smem + L::dO, &args.tm_do.map, bars, 0, hvi, t0, b);
  tma_load_4d(smem + L::dO + kBox, &args.tm_do.map, bars, 64, hvi, t0, b);
  for (int blk = 0; blk < 2; ++blk)
    for (int rh = 0; rh < 2; ++rh)
      tma_load_2d(smem + L::S + (2 * blk + rh) * kBox, &args.tm_h.map, bars, 64 * blk, srow + 64 * rh);
  mbar_expect_tx(bars + 1, 6 * kBox);
  tma_load_3d(smem + L::Vn, &args.tm_vn.map, bars + 1, 0, hvi, row0);
  tma_load_3d(smem + L::Vn + kBox, &args.tm_vn.map, bars + 1, 64, hvi, row0);
  for (int blk = 0; blk < 2; ++blk)
    for (int rh = 0; rh < 2; ++rh)
      tma_load_2d(smem + L::dS + (2 * blk + rh) * kBox, &args.tm_dh.map, bars + 1, 64 * blk, srow + 64 * rh);
  mbar_expect_tx(bars + 2, 6 * kBox);
  tma_load_4d(smem + L::v, &args.tm_v.map, bars + 2, 0, hvi, t0, b);
  tma_load_4d(smem + L::v + kBox, &args.tm_v.map, bars + 2, 64, hvi, t0, b);
  tma_load_4d(smem + L::q, &args.tm_q.map, bars + 2, 0, h, t0, b);
  tma_load_4d(smem + L::q + kBox, &args.tm_q.map, bars + 2, 64, h, t0, b);
  tma_load_4d(smem + L::k, &args.tm_k.map, bars + 2, 0, h, t0, b);
  tma_load_4d(smem + L::k + kBox, &args.tm_k.map, bars + 2, 64, h, t0, b);
}

// Byte offset of the 16-bit pair (row r, columns c, c + 1; c even, < 64) inside a swizzled 64-column block.
__device__ __forceinline__ int sw_pair(int r, int c) { return r * 128 + ((((c >> 3) ^ r) & 7) << 4) + (c & 7) * 2; }

// The accumulator of an m64nN product (N / 2 registers): element e of n-block nb is (row 16 wi + g + 8 (e >> 1),
// column 8 nb + 2 t + (e & 1)) of the warpgroup's columns (wgmma_ops.cuh).
template <int N>
__device__ __forceinline__ void zero(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) d[i] = 0.f;
}
// N accumulator columns (starting at this warpgroup's column 0 of the block) as 16-bit pairs into a swizzled
// block at dst, rows 16 wi + g (+ 8); f(value, row, column) gives what is stored.
template <class T, int N, class F>
__device__ __forceinline__ void acc_to_block(unsigned char* dst, const float (&d)[N / 2], int col0, F&& f) {
  const int lane = static_cast<int>(threadIdx.x) & 31, wi = (static_cast<int>(threadIdx.x) >> 5) & 3;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nb = 0; nb < N / 8; ++nb)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * wi + g + 8 * hh, c = col0 + 8 * nb + 2 * t;
      *reinterpret_cast<uint32_t*>(dst + sw_pair(r, c)) =
          pack2<T>(f(d[4 * nb + 2 * hh], r, c), f(d[4 * nb + 2 * hh + 1], r, c + 1));
    }
}
// The 16-bit pair (row r, columns c, c + 1) of a swizzled block.
template <class T>
__device__ __forceinline__ float2 block_pair(const unsigned char* blk, int r, int c) {
  return unpack2<T>(*reinterpret_cast<const uint32_t*>(blk + sw_pair(r, c)));
}
// This warpgroup's 64 columns of a 64 x 128 result as 16-bit rows of 256 bytes, 16-byte piece p of row r at
// p ^ (r % 8) (stage_rows' layout in wy_wgmma.cuh, which stages a whole m64n128 accumulator); f(value, row).
template <class T, class F>
__device__ __forceinline__ void stage_half_rows(unsigned char* dst, const float (&d)[32], int wg, F&& f) {
  const int lane = static_cast<int>(threadIdx.x) & 31, wi = (static_cast<int>(threadIdx.x) >> 5) & 3;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * wi + g + 8 * hh;
      *reinterpret_cast<uint32_t*>(dst + r * 256 + (((8 * wg + nb) ^ (r & 7)) << 4) + 4 * t) =
          pack2<T>(f(d[4 * nb + 2 * hh], r), f(d[4 * nb + 2 * hh + 1], r));
    }
}
// Staged rows < len to rows t0 .. t0 + len - 1 of batch b, head `head` of a [B, T, heads, 128] view: 16 bytes a
// thread, 16 threads a row (element by element where the view's rows are not 16-byte aligned).
template <class T>
__device__ __forceinline__ void store_staged_rows(const TensorRef& out, int64_t b, int64_t t0, int64_t head,
                                                  const unsigned char* src, int len) {
  const int piece = static_cast<int>(threadIdx.x) & 15, r0 = static_cast<int>(threadIdx.x) >> 4;
  T* base = static_cast<T*>(out.ptr);
  const bool vec = reinterpret_cast<uintptr_t>(base) % 16 == 0 && (out.stride_b * 2) % 16 == 0 &&
                   (out.stride_t * 2) % 16 == 0 && (out.stride_h * 2) % 16 == 0;
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int r = r0 + 16 * it;
    if (r >= len) continue;
    const unsigned char* at = src + r * 256 + ((piece ^ (r & 7)) << 4);
    T* dst = base + off(out, b, t0 + r, head) + 8 * piece;
    if (vec) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(at);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[j] = reinterpret_cast<const T*>(at)[j];
    }
  }
}
// Descriptors: a K-major operand (rows of the tile are the M or N index, K along the row) at byte `at`; an
// MN-major one (rows of the tile are the K index).
__device__ __forceinline__ uint64_t kmajor(uint32_t at) { return wg_desc(at, 16, 1024); }
__device__ __forceinline__ uint64_t mnmajor(uint32_t at) { return wg_desc(at, 8192, 1024); }

// The V side's products, issued and not waited for: dO S^T, dU S^T and Vn dS'^T (this warpgroup's 64 columns of
// each) and dO Vn^T (its 32 columns) over the 128 value columns, T^T dU over the 64 tokens. Addresses are of the
// tiles in shared memory (S and dS': two 16 KB blocks of 64 key columns; the others 64 x 128, two 8 KB blocks).
template <class T>
__device__ __forceinline__ void issue_v_side(float (&qg)[32], float (&wa)[32], float (&mi)[32], float (&y)[32],
                                             float (&dp)[16], uint32_t sS, uint32_t sdS, uint32_t sdO, uint32_t sVn,
                                             uint32_t sdU, uint32_t sT, int wg) {
  constexpr int kBox = 64 * 128;  // LocalWgSmem::kBox and LocalKdaSmem::kBox
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {  // K = the 128 value columns: block kk / 4, 32 bytes a step inside it
    const uint32_t ko = (kk >> 2) * kBox + (kk & 3) * 32, kS = (kk >> 2) * 2 * kBox + wg * kBox + (kk & 3) * 32;
    wgmma_ss<T, 64, 0, 0>(qg, kmajor(sdO + ko), kmajor(sS + kS), 1);         // dO S^T
    wgmma_ss<T, 64, 0, 0>(wa, kmajor(sdU + ko), kmajor(sS + kS), 1);         // dU S^T
    wgmma_ss<T, 64, 0, 0>(mi, kmajor(sVn + ko), kmajor(sdS + kS), 1);        // Vn dS'^T
    wgmma_ss<T, 32, 0, 0>(dp, kmajor(sdO + ko), kmajor(sVn + ko + wg * 4096), 1);  // dO Vn^T
  }
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)  // T^T dU: K = the 64 tokens, 16 rows (2 KB) a step
    wgmma_ss<T, 64, 1, 1>(y, mnmajor(sT + kk * 2048), mnmajor(sdU + wg * kBox + kk * 2048), 1);
}

// The WY side's last two products, in both chunk-local kernels (this one and kda's): -dA = (T^T dT) T^T, the 32
// columns of warpgroup wg, into da. dT (64 x 64, 16-bit, 128B-swizzled) is at smem offset dT_at, T at sT; T^T dT
// passes through M1_at (16-bit, both warpgroups' halves). Entered right after dT is staged (it synchronises the
// block before each product); the caller masks and scales what it gets.
template <class T>
__device__ __forceinline__ void wy_minus_dA(unsigned char* smem, uint32_t base, int dT_at, int M1_at, uint32_t sT,
                                            int wg, int ra, int t, float (&da)[16]) {
  fence_proxy_async();
  __syncthreads();
  {
    float m1[32];  // T^T dT, all 64 columns (both warpgroups); each stores its 32
    zero(m1);
    reg_fence(m1);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_ss<T, 64, 1, 1>(m1, mnmajor(sT + kk * 2048), mnmajor(base + dT_at + kk * 2048), 1);
    wg_commit();
    wg_wait<0>();
    reg_fence(m1);
#pragma unroll
    for (int nb = 0; nb < 4; ++nb)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        // columns 32 wg + 8 nb + 2 t: n-block nb or 4 + nb, picked by a select (a register array indexed by
        // the warpgroup, a run-time value, would go to local memory)
        const int r = ra + 8 * hh, cc = 32 * wg + 8 * nb + 2 * t, e0 = 4 * nb + 2 * hh, e1 = e0 + 16;
        const float x0 = wg ? m1[e1] : m1[e0], x1 = wg ? m1[e1 + 1] : m1[e0 + 1];
        *reinterpret_cast<uint32_t*>(smem + M1_at + sw_pair(r, cc)) = pack2<T>(x0, x1);
      }
  }
  fence_proxy_async();
  __syncthreads();
  zero(da);
  reg_fence(da);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_ss<T, 32, 0, 0>(da, kmajor(base + M1_at + kk * 32), kmajor(sT + wg * 4096 + kk * 32), 1);
  wg_commit();
  wg_wait<0>();
  reg_fence(da);
}
#endif

template <class T>
__global__ void __launch_bounds__(256, 1) bwd_local_wgmma_kernel(const __grid_constant__ LocalWgArgs args) {
#ifdef DELTACP_WGMMA_DEVICE
  using L = LocalWgSmem;
  constexpr int kBox = L::kBox;
  const Args& a = args.a;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::bar);
  float* gs = reinterpret_cast<float*>(smem + L::g);
  float* egs = reinterpret_cast<float*>(smem + L::eg);
  float* eks = reinterpret_cast<float*>(smem + L::ek);
  float* bs = reinterpret_cast<float*>(smem + L::beta);
  float* dGf = reinterpret_cast<float*>(smem + L::dG);
  float* part = reinterpret_cast<float*>(smem + L::part);
  float* red = reinterpret_cast<float*>(smem + L::red);

  const int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t HV = a.HV;
  int64_t c, hv;  // blockIdx, or with B1 beside this kernel its order (bwd_handoff.cuh)
  handoff_block(a.handoff, HV, c, hv);
  const int64_t hk = hv / a.group;
  const ChunkEntry ch = a.chunks[c];
  const int len = static_cast<int>(ch.len);
  const bool gated = a.gated;
  const uint32_t base = smem_u32(smem);

  handoff_wait(a.handoff, c, hv, HV);  // with B1 beside: until it has stored dh[c] and dVn of c
  if (tid == 0) issue_local_loads<L>(smem, bars, args, ch, c, hv, HV, hk);
  {
    DuTPieces pieces;
    load_du_t(pieces, a, ch, hv, HV, len, tid);
    if (tid < 64) {  // rows past a short chunk repeat its last G (every decay stays finite) and have beta = 0
      const float gi = gated ? a.G[(ch.row0 + min(tid, len - 1)) * HV + hv] : 0.f;
      const float gn = gated ? a.G[(ch.row0 + len - 1) * HV + hv] : 0.f;
      gs[tid] = gi;
      egs[tid] = exp_t<T>(gi);
      eks[tid] = exp_t<T>(gn - gi);
      bs[tid] = tid < len ? ld<T>(a.beta, off(a.beta, ch.batch, ch.t0 + tid, hv)) : 0.f;
    }
    store_du_t<T>(smem, L::dU, L::T, kBox, pieces, a, tid);
  }
  __syncthreads();  // the mbarriers are initialised; dU, T and the row factors are in shared memory
  mbar_wait(bars, 0);
  mbar_wait(bars + 1, 0);
  zero_tail_rows<256>(smem + L::dO, len, tid);
  zero_tail_rows<256>(smem + L::Vn, len, tid);
  fence_proxy_async();
  __syncthreads();

  // ---- the V side --------------------------------------------------------------------------------------
  const uint32_t sS = base + L::S, sdS = base + L::dS, sdO = base + L::dO, sVn = base + L::Vn, sdU = base + L::dU;
  const uint32_t sv = base + L::v, sq = base + L::q, sk = base + L::k, sT = base + L::T, sdW = base + L::dW;
  float qg[32], wa[32], mi[32], y[32], dp[16], dt1[16];
  zero(qg), zero(wa), zero(mi), zero(y), zero(dp), zero(dt1);
  reg_fence(qg), reg_fence(wa), reg_fence(mi), reg_fence(y), reg_fence(dp), reg_fence(dt1);
  wg_fence();
  issue_v_side<T>(qg, wa, mi, y, dp, sS, sdS, sdO, sVn, sdU, sT, wg);
  wg_commit();
  mbar_wait(bars + 2, 0);
  zero_tail_rows<256>(smem + L::v, len, tid);
  zero_tail_rows<256>(smem + L::q, len, tid);
  zero_tail_rows<256>(smem + L::k, len, tid);
  fence_proxy_async();
  __syncthreads();
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {  // dU V^T
    const uint32_t ko = (kk >> 2) * kBox + (kk & 3) * 32;
    wgmma_ss<T, 32, 0, 0>(dt1, kmajor(sdU + ko), kmajor(sv + ko + wg * 4096), 1);
  }
  wg_commit();
  // <dS', S> (the last row's share of dG from the decay of S) while the products run: both tiles have the same
  // layout, so the sum runs over their bytes in any order; per thread 8 pieces of each, then the warp's sum.
  float s_gs = 0.f;
  if (gated) {
#pragma unroll
    for (int it = 0; it < 8; ++it) {
      const int o = (tid + 256 * it) * 16;
      const uint4 x = *reinterpret_cast<const uint4*>(smem + L::S + o);
      const uint4 z = *reinterpret_cast<const uint4*>(smem + L::dS + o);
      const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, zs[4] = {z.x, z.y, z.z, z.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = unpack2<T>(xs[e]), h2 = unpack2<T>(zs[e]);
        s_gs = fmaf(f.x, h2.x, fmaf(f.y, h2.y, s_gs));
      }
    }
    s_gs = warp_sum(s_gs);
  }
  wg_wait<0>();
  reg_fence(qg), reg_fence(wa), reg_fence(mi), reg_fence(y), reg_fence(dp), reg_fence(dt1);
  __syncthreads();  // both warpgroups' products have read S, dS', dO and Vn: the intermediates take their bytes

  // ---- epilogue of the V side --------------------------------------------------------------------------
  const int ra = 16 * wi + g;  // this thread's rows ra and ra + 8 (register e: row ra + 8 (e >> 1))
  const int cw = 64 * wg;      // its warpgroup's first column of the 128-wide results
  const unsigned char* vblk = smem + L::v + wg * kBox;
  const unsigned char* kblk = smem + L::k + wg * kBox;
  const unsigned char* qblk = smem + L::q + wg * kBox;
  float yv[2] = {0.f, 0.f};  // per row: Y . v over this thread's columns
  float s_kr = 0.f;           // sum over the chunk of k . (Kr-part of minus)
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = ra + 8 * hh, cb = 8 * nb + 2 * t, e0 = 4 * nb + 2 * hh;
      const float sq_r = a.scale * egs[r], ek_r = eks[r];
      qg[e0] *= sq_r, qg[e0 + 1] *= sq_r;
      mi[e0] *= ek_r, mi[e0 + 1] *= ek_r;
      const float2 kv = block_pair<T>(kblk, r, cb), vv = block_pair<T>(vblk, r, cb);
      if (r < len) s_kr += kv.x * mi[e0] + kv.y * mi[e0 + 1];
      yv[hh] += y[e0] * vv.x + y[e0 + 1] * vv.y;
    }
  // dv = diag(beta) Y, staged over dU (read by the V side only) for 16-byte stores after the barrier below.
  stage_half_rows<T>(smem + L::dU, y, wg, [&](float x, int r) { return bs[r] * x; });
  // dW = -dU S^T (this warpgroup's column block), dP o E (its 32 columns).
  acc_to_block<T, 64>(smem + L::dW + wg * kBox, wa, 0, [](float x, int, int) { return -x; });
  acc_to_block<T, 32>(smem + L::dPE, dp, 32 * wg, [&](float x, int i, int j) {
    return (j <= i && i < len) ? a.scale * x * (gated ? exp_t<T>(gs[i] - gs[j]) : 1.f) : 0.f;
  });
  if (gated) {
    s_kr = warp_sum(s_kr);
    if (lane == 0) red[warp] = s_gs, red[8 + warp] = s_kr;
  }
  fence_proxy_async();
  __syncthreads();
  store_staged_rows<T>(a.dv, ch.batch, ch.t0, hv, smem + L::dU, len);

  // ---- the WY side ---------------------------------------------------------------------------------------
  float pl[32], dt2[16];
  zero(pl), zero(dt2);
  reg_fence(pl), reg_fence(dt2);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)  // T^T dW
    wgmma_ss<T, 64, 1, 1>(pl, mnmajor(sT + kk * 2048), mnmajor(sdW + wg * kBox + kk * 2048), 1);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {  // dW K^T
    const uint32_t ko = (kk >> 2) * kBox + (kk & 3) * 32;
    wgmma_ss<T, 32, 0, 0>(dt2, kmajor(sdW + ko), kmajor(sk + ko + wg * 4096), 1);
  }
  wg_commit();
  wg_wait<0>();
  reg_fence(pl), reg_fence(dt2);
#pragma unroll
  for (int e = 0; e < 32; ++e) pl[e] *= egs[ra + 8 * ((e >> 1) & 1)];  // plus = diag(Gam) T^T dW so far
  // dT = (dU V^T + (dW K^T) diag(Gam)) diag(beta), its 32 columns.
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    const int j = 32 * wg + 8 * (e >> 2) + 2 * t + (e & 1);
    dt1[e] = bs[j] * (dt1[e] + egs[j] * dt2[e]);
  }
  acc_to_block<T, 32>(smem + L::dT, dt1, 32 * wg, [](float x, int, int) { return x; });
  {
    float da[16];  // (T^T dT) T^T = -dA, its 32 columns
    wy_minus_dA<T>(smem, base, L::dT, L::M1, sT, wg, ra, t, da);
    auto dae = [&](float x, int i, int j) {
      return (j < i && i < len) ? -x * (gated ? exp_t<T>(gs[i] - gs[j]) : 1.f) : 0.f;
    };
    acc_to_block<T, 32>(smem + L::dAE, da, 32 * wg, dae);
    acc_to_block<T, 32>(smem + L::dAEb, da, 32 * wg, [&](float x, int i, int j) { return bs[i] * dae(x, i, j); });
  }
  fence_proxy_async();
  __syncthreads();

  // ---- the decay products ----------------------------------------------------------------------------------
  reg_fence(qg), reg_fence(pl), reg_fence(mi);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {  // K = the 64 tokens j (or i for the transposed ones)
    const uint64_t bk = mnmajor(sk + wg * kBox + kk * 2048), bq = mnmajor(sq + wg * kBox + kk * 2048);
    wgmma_ss<T, 64, 0, 1>(qg, kmajor(base + L::dPE + kk * 32), bk, 1);        // (dP o E) K
    wgmma_ss<T, 64, 0, 1>(pl, kmajor(base + L::dAE + kk * 32), bk, 1);        // (dA o E) K
    wgmma_ss<T, 64, 1, 1>(mi, mnmajor(base + L::dPE + kk * 2048), bq, 1);     // (dP o E)^T Q
    wgmma_ss<T, 64, 1, 1>(mi, mnmajor(base + L::dAEb + kk * 2048), bk, 1);    // (diag(beta) dA o E)^T K
  }
  wg_commit();
  wg_wait<0>();
  reg_fence(qg), reg_fence(pl), reg_fence(mi);

  // ---- epilogue: dq, dk out; dbeta and dG per row -----------------------------------------------------------
  float db[2] = {yv[0], yv[1]}, dG[2] = {0.f, 0.f};
  const bool final_out = a.group == 1;  // else per value head to the workspaces (stage B5 sums the group)
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = ra + 8 * hh, cb = 8 * nb + 2 * t, e0 = 4 * nb + 2 * hh;
      const float b = bs[r];
      const float2 qv = block_pair<T>(qblk, r, cb), kv = block_pair<T>(kblk, r, cb);
      const float kp = kv.x * pl[e0] + kv.y * pl[e0 + 1];
      db[hh] += kp;
      dG[hh] += qv.x * qg[e0] + qv.y * qg[e0 + 1] + b * kp - (kv.x * mi[e0] + kv.y * mi[e0 + 1]);
      mi[e0] += b * pl[e0];  // minus becomes dk
      mi[e0 + 1] += b * pl[e0 + 1];
      if (!final_out && r < len) {
        const int64_t o = ws_row(ch, r, HV, hv, kLocalKeys) + cw + cb;
        *reinterpret_cast<float2*>(a.dqw + o) = make_float2(qg[e0], qg[e0 + 1]);
        *reinterpret_cast<float2*>(a.dkw + o) = make_float2(mi[e0], mi[e0 + 1]);
      }
    }
  if (final_out) {  // dq and dk staged over dO and Vn (free since the V side) for 16-byte stores
    stage_half_rows<T>(smem + L::dO, qg, wg, [](float x, int) { return x; });
    stage_half_rows<T>(smem + L::Vn, mi, wg, [](float x, int) { return x; });
  }
  // Per row: the four lanes of a row, then lane 4 g writes this warpgroup's parts (a fixed order).
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    db[hh] += __shfl_xor_sync(0xffffffffu, db[hh], 1);
    db[hh] += __shfl_xor_sync(0xffffffffu, db[hh], 2);
    dG[hh] += __shfl_xor_sync(0xffffffffu, dG[hh], 1);
    dG[hh] += __shfl_xor_sync(0xffffffffu, dG[hh], 2);
    if (t == 0) {
      const int r = ra + 8 * hh;
      part[wg * 64 + r] = db[hh];
      part[128 + wg * 64 + r] = dG[hh];
    }
  }
  __syncthreads();
  if (final_out) {
    store_staged_rows<T>(a.dq, ch.batch, ch.t0, hk, smem + L::dO, len);
    store_staged_rows<T>(a.dk, ch.batch, ch.t0, hk, smem + L::Vn, len);
  }
  if (tid < len) {
    st<T>(a.dbeta, off(a.dbeta, ch.batch, ch.t0 + tid, hv), part[tid] + part[64 + tid]);
    if (gated) {
      float x = part[128 + tid] + part[192 + tid];
      if (tid == len - 1) {  // the decay of S (e^Gn <dS', S>) and Kr's Gn (sum_j k_j . Kr-part_j)
        float sg = 0.f, sk2 = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) sg += red[w], sk2 += red[8 + w];
        x += egs[len - 1] * sg + sk2;
      }
      dGf[tid] = x;
    }
  }
  if (!gated) return;
  __syncthreads();
  if (tid < len) {  // dg: the reverse cumulative sum of dG over the chunk (G_i = g_1 + ... + g_i, chunk-local)
    float acc = 0.f;
    for (int i = len - 1; i >= tid; --i) acc += dGf[i];
    store_gate<T>(a, off(a.dg, ch.batch, ch.t0 + tid, hv), acc);
  }
#else
  __trap();  // never launched: the host selects this kernel only for builds with sm_90a code
#endif
}

// ---- host ----------------------------------------------------------------------------------------
#ifdef DELTACP_HAVE_SM90A
// What both Hopper chunk-local kernels (this one and kda's, bwd_local_kda_wgmma.cuh) need beyond their dtype
// and variant, given the shared memory they take: why they cannot run p (nullptr: they can).
inline const char* local_tma_refusal(const Params& p, int smem_bytes) {
  if (p.K != kLocalKeys || p.V != kLocalKeys) return "it takes K = V = 128";
  if (p.chunk_size != 64) return "it takes chunk_size = 64";
  if (p.B * p.T >= (int64_t{1} << 31)) return "TMA coordinates are 32-bit (B * T < 2^31)";
  for (const TensorRef* r : {&p.q, &p.k, &p.v, &p.dout}) {
    if (!rows_aligned16(*r, 2)) return "TMA reads q, k, v and dO in 16-byte pieces (a pointer or stride is not 16-byte aligned)";
    if (!steps_forward(*r, p.B, p.T, (r == &p.q || r == &p.k) ? p.H : p.HV))
      return "TMA reads q, k, v and dO through tensor maps, which need positive strides";
  }
  if (device_attribute(cudaDevAttrComputeCapabilityMajor) != 9 ||
      device_attribute(cudaDevAttrComputeCapabilityMinor) != 0)
    return "it runs on compute capability 9.0 (H100 / H200) only";
  if (max_smem_optin() < smem_bytes) return "the GPU gives a block less shared memory than it needs";
  return nullptr;
}
#endif

// Why the fused chunk-local backward cannot run p (nullptr: it can).
inline const char* local_wgmma_refusal(const Params& p) {
#ifndef DELTACP_HAVE_SM90A
  (void)p;
  return "this build has no sm_90a code";
#else
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return "it takes bf16 or fp16 inputs";
  if (p.variant != Variant::gdn && p.variant != Variant::delta) return "it takes a scalar gate (gdn, delta)";
  return local_tma_refusal(p, LocalWgSmem::bytes);
#endif
}

// DELTACP_TILED_BWD_LOCAL_WGMMA (common/kernel_switch.h): unset = this kernel instead of stages B2, B3 and B4
// where it applies; 0 = the three mma.sync kernels; 1 = required (an error names why it cannot run).
inline bool use_local_wgmma(const Params& p) {
  return kernel_switch("DELTACP_TILED_BWD_LOCAL_WGMMA", "the fused chunk-local backward",
                       [&] { return local_wgmma_refusal(p); });
}

// Both Hopper chunk-local kernels' arguments over the a.num_chunks chunks of a: a and the tensor maps of q, k,
// v, dO, v_new and the slice's h and dh, which TMA reads.
inline LocalWgArgs local_wg_args(const Args& a) {
  const int64_t state_rows = a.num_chunks * a.HV * kLocalKeys;
  DELTACP_CHECK(state_rows < (int64_t{1} << 31), "T", "expected fewer than 2^31 rows of chunk states for TMA's ",
                "32-bit coordinates, got ", state_rows);
  DELTACP_CHECK(a.HV <= 65535, "HV", "expected at most 65535 value heads, got ", a.HV);
  LocalWgArgs w;
  w.a = a;
  w.tm_q = token_rows_map(a.q, a.B, a.T, a.H, kLocalKeys, "q");
  w.tm_k = token_rows_map(a.k, a.B, a.T, a.H, kLocalKeys, "k");
  w.tm_v = token_rows_map(a.v, a.B, a.T, a.HV, kLocalKeys, "v");
  w.tm_do = token_rows_map(a.dout, a.B, a.T, a.HV, kLocalKeys, "do");
  w.tm_vn = workspace_rows_map(a.vnew, a.B * a.T, a.HV, kLocalKeys, "v_new");
  w.tm_h = tile_map_16bit(a.h, {kLocalKeys, state_rows}, {kLocalKeys}, {64, 64}, "h");
  w.tm_dh = tile_map_16bit(a.dh, {kLocalKeys, state_rows}, {kLocalKeys}, {64, 64}, "dh");
  return w;
}

// Over the a.num_chunks chunks of a (a slice: a.chunks, a.h and a.dh start at its first chunk).
template <class T>
void launch_local_wgmma(const Args& a, cudaStream_t stream) {
  if (a.num_chunks == 0) return;
  const LocalWgArgs w = local_wg_args(a);
  auto kernel = bwd_local_wgmma_kernel<T>;
  opt_in_smem(kernel, LocalWgSmem::bytes, "K", "the fused chunk-local backward needs ", LocalWgSmem::bytes,
              " bytes of shared memory");
  const dim3 grid(static_cast<unsigned>(a.num_chunks), static_cast<unsigned>(a.HV));
  kernel<<<grid, 256, LocalWgSmem::bytes, stream>>>(w);
  DELTACP_CUDA_CHECK_LAUNCH();
}

}  // namespace deltacp::cuda::tiled::bwd
