// cuda/tiled/dplr_bwd_local_wgmma.cuh — the tiled DPLR backward's chunk-local gradients (dplr_bwd.cu's kernels 5
// and 6: dUt', dv, the four score gradients, dq, dk, da, db, dgk) as one kernel on Hopper's warpgroup products,
// with every intermediate kept on chip. Launched instead of dplr_bwd_dv_kernel + dplr_bwd_dk_kernel for bf16 /
// fp16 at K = V = 64 and K = V = 128, chunk 64, compute capability 9.0 (dplr_local_refusal says why not;
// DELTACP_TILED_DPLR_BWD_LOCAL=0 keeps the two kernels). K = V = 128: see "K = V = 128" below (the same kernel,
// template parameter NV = K / 64, one CTA per key half).
//
// Notation of dplr_bwd.cu's opening comment. One CTA of two warpgroups (256 threads) per (chunk, head); every
// product is one wgmma over the whole chunk (64 x 64 x 64), both operands in shared memory with the 128-byte
// swizzle. Token x value products have their B operand MN-major (value columns along the swizzled row), which
// cannot be split between the warpgroups inside a swizzle row, so the warpgroups split the products, not their
// columns: each result is one 64 x 64 accumulator of one warpgroup (32 registers a thread).
//
//   phase A   wg0: dUt' = T^T dUt                          wg1: dO V^T, dO Ut^T
//             -> dUt' (16-bit) and dM_qk = scale tril_incl(dO V^T), dM_qb = scale tril_incl(dO Ut^T) (16-bit)
//   phase B   wg0: dv = scale P_qk^T dO + Kd dS + A_ak^T dUt'   (staged, stored)
//                  F_q = dO S^T, F_a = dUt' S^T
//             wg1: dA_ak = strict_tril(dUt' V^T), dA_ab = strict_tril(dUt' Ut^T)  (16-bit)
//                  F_k = V dS^T, F_b = Ut dS^T
//   phase C   the score gradients back through the scores (the gram gradients), per key column d about a
//             reference c_d = G_{len-1, d} / 2 (the chunk's midpoint decay):
//             wg0: R_q = dM_qk Ks + dM_qb Bs,      R_a = dA_ak Ks + dA_ab Bs
//             wg1: R_k = dM_qk^T Qs + dA_ak^T As,  R_b = dM_qb^T Qs + dA_ab^T As
//             with Qs = q e^(G - c), As = a e^(Gp - c), Ks = k e^(c - G), Bs = b e^(c - G) (16-bit, built while
//             phase A runs). Exact algebra: sum_j dM_ij Y_jd e^(Gl_id - Gr_jd) = e^(Gl_id - c_d) sum_j dM_ij
//             [Y_jd e^(c_d - Gr_jd)], and the same on the transposed side; the reference may differ per key
//             column because the gram contracts over tokens, not keys. The masked dM are zero wherever the decay
//             would be a growth, so no exponent of the product ever exceeds the factors' own range.
//   combine   dq = scale e^G F_q + e^(G - c) R_q          da = e^Gp F_a + e^(Gp - c) R_a
//             dk = e^(Gn - G) F_k + e^(c - G) R_k         db = e^(Gn - G) F_b + e^(c - G) R_b
//             wg0 holds dq, da, wg1 dk, db, element for element the same layout. dG = q dq + a da - k dk - b db
//             (raw q, k, a, b), plus on the last row e^Gn rowsum(dS S) + colsum(k e^(Gn - G) F_k + b e^(Gn - G)
//             F_b); dgk = reverse_cumsum(dG) - a da, one thread per key column over fp32 tiles.
//
// The gate range. Every factor of the mid reference lies in [e^(-s_d / 2), e^(s_d / 2)], s_d = -G_{len-1, d}
// (gk <= 0: G falls monotonically from 0). A column takes the tensor-core gram where s_d / 2 <= kHalfMax (bf16:
// 64, the bound of dplr_scores.cuh's bf16 diagonal blocks; fp16: 8, its narrow range) and every scaled value is
// finite and below kScaledMax. Other columns (steep gates: a log decay of -5 per token spans about 320 over a
// chunk) fall back, per column, to an element-by-element gram in fp32 with every exponent <= 0 (mask first, then
// exp): dq_i += (dM_qk_ij k_j + dM_qb_ij b_j) e^(G_i - G_j) over j <= i, and the like for da, dk, db, from the same
// 16-bit dM. The fallback runs on the CUDA cores while phase C's products are in flight, writes fp32 tiles over
// the dead phase-A/B inputs, and the combine selects (never multiplies: the unused factor may be inf) the
// fallback's value for those columns. So the result is exact in fp32 for any gk in the chunk form's range; only
// the time depends on the gates.
//
// Numerics: the 16-bit operands are the inputs and what kernels 5 and 6 round too (dUt', the four dM), plus the
// scaled gram operands (relative rounding 2^-9 for bf16 as any 16-bit operand; only the reference point differs
// from kernel 6's 16-row reference blocks). Not bitwise equal to kernels 5 + 6 (other summation order and
// reference), within the same tolerance of the fp64 reference. Deterministic: no atomics, one writer per element.
//
// Shared memory (bytes from a 1024-aligned base; 8 KB per 64 x 64 16-bit tile): the phase-A/B inputs dO, V, Ut,
// dUt, T, P_qk, A_ak, Kd (64 KB, by TMA on two mbarriers: phase A's five tiles first), S, dS (16 KB), q, k, a, b
// (32 KB, a third mbarrier), dUt' (8 KB), the four dM (32 KB), Qs, As, Ks, Bs (32 KB), G as 65 fp32 rows (row 0 =
// 0, row i + 1 = G_i; rows past len repeat G_{len-1}), and per-column data: 209,464 bytes with the alignment
// slack, one CTA per SM. dv is staged over T, the fallback's fp32 tiles lie over the phase-A/B inputs, the
// staged dq, da, dk, db and the fp32 dG tiles over the dM, scaled operands and S, dS.
//
// K = V = 128 (NV = 2). One CTA per (chunk, head) would not fit (the tiles double and the F and R accumulators
// would reach 256 registers a thread), so the grid is (chunks, H, 2) and CTA kh owns key columns 64 kh .. 64 kh +
// 63 of dq, dk, da, db, dgk and value columns 64 kh .. of dv, with the K = 64 kernel's warpgroup roles and
// accumulators (the F and R products, the reference, the scaled operands, the span test, the fallback, the combine
// and dG are per key column, so a key half is a K = 64 problem with its own 64 columns of q, k, a, b, G). What
// contracts over all 128 value or key columns is formed whole in both CTAs of a chunk: dUt' = T^T dUt (wg0, both
// value tiles, P1 and P2), dO V^T and dO Ut^T (wg1, 8 K steps), dA_ak and dA_ab (wg1), the K = values steps of the
// F products (S and dS: the CTA's 64 key rows over all 128 value columns), and dv's Kd dS over all 128 keys (both
// Kd tiles against this half's rows of dS and dSo, the other half's rows at this value half). Twice per chunk: dUt'
// and the four score gradients (10 of the 30 products of 64 x 64 x 64 a CTA issues) and the loads of dO, V, Ut,
// dUt, T, P_qk, A_ak, Kd. Shared memory (DplrLocalSmem<2>, 217,672 bytes, one CTA per SM): dO, V, Ut, dUt (two
// tiles each), T, P_qk, A_ak, Kd (two), dSo on the first two mbarriers; this half's q, k, a, b on the third into
// four tiles that S and dS (this half's rows, two tiles each, a fourth mbarrier issued once phase A's scaled
// operands are built) take over for phase B; then q, k, a, b again (a fifth mbarrier, issued after phase B, awaited
// by the fallback and the combine) over S and dS. dUt' lies over dUt (read by wg0 only, in phase A), dA_ak and
// dA_ab over V (read by wg1 only), the fallback's tiles over Ut .. Kd, the staged outputs over dO and V, the fp32
// dG tiles over Ut .. P_qk. wg0 issues phase B's products that need no S or dS rows of its half first (P_qk^T dO,
// A_ak^T dUt', Kd dSo), wg1 dA_ak, dA_ab, while the fourth mbarrier's tiles land.
//
// Measured (NVIDIA H100, 2026-11-27, bf16, gates logsigmoid(randn) clamped to [-5, 0], bench/gpu/stage_times.py
// --variant dplr --backend tiled --backward, kernel time per call): (4,4096,32,64) 1.17 ms where kernels 5 + 6
// took 0.71 + 3.08; the forward + backward's kernels 6.42 -> 3.81 ms. K = V = 128:
// (1,16384,16,128) 1.69 ms where kernels 5 + 6 took 0.52 + 3.09; the forward + backward's kernels 8.10 -> 6.15 ms. ptxas (nvcc 13, sm_90a, bf16 and
// fp16): 189 registers (NV = 1) and 191 (NV = 2), no spills; it reports (C7520) that the per-warpgroup product
// branches serialise the wgmma instructions, so the products of the two warpgroups do not overlap as they could.
// Yet with the warpgroup index made uniform to ptxas (through a shuffle from lane 0) the note went away and the
// kernel got slower: NVIDIA H200, (1,16384,16,128), bf16, 1.369 ms against 1.303 serialised (2026-11-29).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/device_info.h"
#include "../common/kernel_switch.h"
#include "../common/tma.cuh"
#include "dplr_stages.cuh"
#include "wgmma_ops.cuh"

namespace deltacp::cuda::tiled {
namespace {

constexpr int kDLCols = 64;  // key / value columns a CTA owns: K = V = 64 NV (NV = 1, 2), one CTA per key half

// Where a key column takes the tensor-core gram: half its span at most kHalfMax (the factors' exponents) and
// every scaled operand finite and at most kScaledMax after scaling.
template <class T>
struct DplrLocalBound {
  static constexpr float kHalfMax = 64.f, kScaledMax = 1e30f;  // bf16: a range of about e^88
};
template <>
struct DplrLocalBound<__half> {
  static constexpr float kHalfMax = 8.f, kScaledMax = 3e4f;  // fp16: at most 65504, normal down to e^-9.7
};

template <class T>
struct DplrLocalArgs {
  TileMap16 tm_q, tm_k, tm_a, tm_b, tm_v, tm_do;  // [B, T, H, 64 NV] user tensors: 64 x 64 boxes
  TileMap16 tm_kd, tm_ut, tm_dut;                 // [R, H, 64 NV] workspaces
  TileMap16 tm_T, tm_pk, tm_ak;                   // [chunks * H * 64, 64] per-chunk matrices
  TileMap16 tm_h, tm_dh;                          // [chunks * H * 64 NV, 64 NV] chunk states (key rows)
  DplrArgs<T> x;
};

// Shared memory of a CTA at K = V = 64 NV (offsets from the 1024-aligned base; tiles of 64 x 64 16-bit elements,
// 128-byte swizzled rows; a 64-row operand over 64 NV columns is NV tiles, column block after column block).
// Names: the operands (dO, V, Ut, dUt over all value columns; Kd over all key columns; S, dS = the CTA's key rows
// of S and dS over all value columns; dSo = the other key half's rows of dS at the CTA's value columns, NV = 2),
// the CTA's key columns of q, k, a, b, dUt', the four score gradients, the scaled operands, G (65 fp32 rows) and
// the per-column data; then what lies over dead bytes later (see the opening comment).
template <int NV>
struct DplrLocalSmem;
template <>
struct DplrLocalSmem<1> {
  static constexpr int kTile = 64 * 128;  // a 64 x 64 16-bit tile, 128-byte swizzled rows
  static constexpr int dO = 0, V = dO + kTile, Ut = V + kTile, dUt = Ut + kTile, T = dUt + kTile,
                       Pk = T + kTile, Ak = Pk + kTile, Kd = Ak + kTile;
  static constexpr int S = Kd + kTile, dS = S + kTile, dSo = dS;  // (no other key half)
  static constexpr int q = dS + kTile, k = q + kTile, a = k + kTile, b = a + kTile;
  static constexpr int dUtp = b + kTile;
  static constexpr int Mqk = dUtp + kTile, Mqb = Mqk + kTile, Aak = Mqb + kTile, Aab = Aak + kTile;
  static constexpr int Qs = Aab + kTile, As = Qs + kTile, Ks = As + kTile, Bs = Ks + kTile;
  static constexpr int ldg = 68;  // fp32 G rows (16-byte aligned)
  static constexpr int G = Bs + kTile;
  static constexpr int cref = G + 65 * ldg * 4;  // [64] c_d
  static constexpr int egn = cref + 256;          // [64] e^(G_{len-1})
  static constexpr int bad = egn + 256;           // [64] int: the column falls back
  static constexpr int badlist = bad + 256;       // [64] int: the falling-back columns, in order
  static constexpr int nbad = badlist + 256;      // int (16 bytes)
  static constexpr int rs = nbad + 16;            // [64] rowsum(dS S) per key row
  static constexpr int colsum = rs + 256;         // [4 warps][64] wg1's colsum(k e^(Gn-G) F_k + b e^(Gn-G) F_b)
  static constexpr int kBars = 3;                 // phase A's inputs, phase B's, q k a b
  static constexpr int bar = colsum + 1024;
  static constexpr int bytes = bar + kBars * 8 + 1024;  // + slack for the alignment
  // Over dead regions: dv staged over T (after phase A); the fallback's fp32 gram tiles (dq, da, dk, db parts,
  // 64 x 64 each) over dO .. Kd (after phase B); the staged 16-bit outputs dq, da, dk, db over the dM, the fp32
  // dG tiles over the scaled operands and S, dS (after phase C).
  static constexpr int dvStage = T;
  static constexpr int fb = 0, kFbTile = 64 * 64 * 4;
  static constexpr int outStage = Mqk;                   // dq, da, dk, db: 4 tiles
  static constexpr int P0 = Qs, P1 = Ks, Pa = S;         // q dq, -k dk - b db, a da (fp32, 16 KB each)
};
static_assert(DplrLocalSmem<1>::fb + 4 * DplrLocalSmem<1>::kFbTile <= DplrLocalSmem<1>::S,
              "fallback tiles over the inputs");
static_assert(DplrLocalSmem<1>::bytes == 209464, "the size the opening comment gives");
// K = V = 128, one key half a CTA. q, k, a, b come twice: for the scaled operands during phase A (then S and dS,
// the CTA's key rows, take their bytes for phase B) and again after phase B (for the fallback, the combine and
// dG). dUt' over dUt (wg0 alone reads dUt, in phase A), dA_ak and dA_ab over V (wg1 alone reads V, in phases A
// and B), the fallback's fp32 tiles over Ut .. Kd, the staged outputs over dO and V, the fp32 dG tiles over
// Ut .. P_qk.
template <>
struct DplrLocalSmem<2> {
  static constexpr int kTile = 64 * 128;
  static constexpr int dO = 0, V = dO + 2 * kTile, Ut = V + 2 * kTile, dUt = Ut + 2 * kTile, T = dUt + 2 * kTile,
                       Pk = T + kTile, Ak = Pk + kTile, Kd = Ak + kTile, dSo = Kd + 2 * kTile;
  static constexpr int X = dSo + kTile;  // 4 tiles: q, k, a, b (phase A; again from phase C) / S, dS (phase B)
  static constexpr int q = X, k = q + kTile, a = k + kTile, b = a + kTile;
  static constexpr int S = X, dS = X + 2 * kTile;
  static constexpr int dUtp = dUt;
  static constexpr int Mqk = X + 4 * kTile, Mqb = Mqk + kTile, Aak = V, Aab = V + kTile;
  static constexpr int Qs = Mqb + kTile, As = Qs + kTile, Ks = As + kTile, Bs = Ks + kTile;
  static constexpr int ldg = 68;
  static constexpr int G = Bs + kTile;
  static constexpr int cref = G + 65 * ldg * 4, egn = cref + 256, bad = egn + 256, badlist = bad + 256,
                       nbad = badlist + 256, rs = nbad + 16, colsum = rs + 256;
  static constexpr int kBars = 5;  // phase A's inputs, phase B's first, q k a b, S and dS, q k a b again
  static constexpr int bar = colsum + 1024;
  static constexpr int bytes = bar + kBars * 8 + 1024;
  static constexpr int dvStage = T;
  static constexpr int fb = Ut, kFbTile = 64 * 64 * 4;
  static constexpr int outStage = dO;                    // dq, da, dk, db over dO, V
  static constexpr int P0 = Ut, P1 = P0 + 4 * kTile / 2, Pa = P1 + 4 * kTile / 2;  // fp32 16 KB each
};
static_assert(DplrLocalSmem<2>::fb + 4 * DplrLocalSmem<2>::kFbTile <= DplrLocalSmem<2>::X,
              "fallback tiles over dead inputs, clear of the second q, k, a, b");
static_assert(DplrLocalSmem<2>::Pa + 2 * DplrLocalSmem<2>::kTile <= DplrLocalSmem<2>::G, "dG tiles below G");
static_assert(DplrLocalSmem<2>::bytes == 217672, "the size the opening comment gives");
static_assert(DplrLocalSmem<2>::bytes <= 227 * 1024, "one CTA per SM");

#ifdef DELTACP_WGMMA_DEVICE
// Byte offset of 16-bit element (r, c) / of the pair (r, c), (r, c + 1) inside a swizzled 64-column tile.
__device__ __forceinline__ int dl_sw(int r, int c) { return r * 128 + ((((c >> 3) ^ r) & 7) << 4) + (c & 7) * 2; }
__device__ __forceinline__ uint64_t dl_kmajor(uint32_t at) { return wg_desc(at, 16, 1024); }
__device__ __forceinline__ uint64_t dl_mnmajor(uint32_t at) { return wg_desc(at, 8192, 1024); }
template <int N>
__device__ __forceinline__ void dl_zero(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) d[i] = 0.f;
}
// A whole m64n64 accumulator (32 registers: d[4 nb + e] is row 16 wi + g + 8 (e >> 1), column 8 nb + 2 t +
// (e & 1)) as 16-bit pairs into a swizzled tile; f(value, row, column) gives what is stored.
template <class T, class F>
__device__ __forceinline__ void dl_acc_to_tile(unsigned char* dst, const float (&d)[32], F&& f) {
  const int lane = static_cast<int>(threadIdx.x) & 31, wi = (static_cast<int>(threadIdx.x) >> 5) & 3;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * wi + g + 8 * hh, c = 8 * nb + 2 * t;
      *reinterpret_cast<uint32_t*>(dst + dl_sw(r, c)) =
          pack2<T>(f(d[4 * nb + 2 * hh], r, c), f(d[4 * nb + 2 * hh + 1], r, c + 1));
    }
}
template <class T>
__device__ __forceinline__ float dl_elem(const unsigned char* tile, int r, int c) {
  return to_f(*reinterpret_cast<const T*>(tile + dl_sw(r, c)));
}
// Rows < len of a staged swizzled tile to rows t0 .., columns col0 .. col0 + 63 of head h of a [B, T, H, D]
// output: 16 bytes a thread (element by element where the output's rows are not 16-byte aligned). nthr threads
// from thread `first`.
template <class T>
__device__ __forceinline__ void dl_store_tile(const DevRows<T>& out, int64_t b, int64_t t0, int64_t h, int col0,
                                              const unsigned char* src, int len, int first, int nthr) {
  const bool vec = reinterpret_cast<uintptr_t>(out.ptr) % 16 == 0 && (out.sb * 2) % 16 == 0 &&
                   (out.st * 2) % 16 == 0 && (out.sh * 2) % 16 == 0;
  for (int idx = static_cast<int>(threadIdx.x) - first; idx < 64 * 8; idx += nthr) {
    const int r = idx >> 3, p = idx & 7;
    if (r >= len) break;  // idx grows with r
    const unsigned char* at = src + r * 128 + ((p ^ (r & 7)) << 4);
    T* dst = out.at(b, t0 + r, h) + col0 + 8 * p;
    if (vec) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(at);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[j] = reinterpret_cast<const T*>(at)[j];
    }
  }
}
#endif

// NV = K / 64 = V / 64: grid (chunks, H, NV), blockIdx.z the CTA's key half kh (its key columns 64 kh .. and
// value columns 64 kh .. of dv).
template <class T, int NV>
__global__ void __launch_bounds__(256, 1) dplr_bwd_local_wgmma_kernel(const __grid_constant__ DplrLocalArgs<T> args) {
#ifdef DELTACP_WGMMA_DEVICE
  static_assert(NV == 1 || NV == 2, "K = V = 64 or 128");
  using L = DplrLocalSmem<NV>;
  constexpr int kTile = L::kTile, KP = 64 * NV;
  using Bound = DplrLocalBound<T>;
  constexpr int ldg = L::ldg;
  const DplrArgs<T>& x = args.x;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::bar);
  float* sG = reinterpret_cast<float*>(smem + L::G);
  float* scref = reinterpret_cast<float*>(smem + L::cref);
  float* segn = reinterpret_cast<float*>(smem + L::egn);
  int* sbad = reinterpret_cast<int*>(smem + L::bad);
  int* sbadlist = reinterpret_cast<int*>(smem + L::badlist);
  int* snbad = reinterpret_cast<int*>(smem + L::nbad);
  float* srs = reinterpret_cast<float*>(smem + L::rs);
  float* scol = reinterpret_cast<float*>(smem + L::colsum);

  const int tid = threadIdx.x, wg = tid >> 7, wi = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t c = blockIdx.x, h = blockIdx.y, H = x.H;
  const int kh = NV == 1 ? 0 : static_cast<int>(blockIdx.z), vh = kh, k0 = 64 * kh;
  const ChunkEntry ch = x.chunks[c];
  const int len = static_cast<int>(ch.len);
  const uint32_t base = smem_u32(smem);
  const float scale = x.scale;

  if (tid == 0) {
    for (int i = 0; i < L::kBars; ++i) mbar_init(bars + i, 1);
    fence_mbar_init();
    const int t0 = static_cast<int>(ch.t0), b = static_cast<int>(ch.batch), hh = static_cast<int>(h);
    const int row0 = static_cast<int>(ch.row0), mrow = static_cast<int>((c * H + h) * 64);
    const int srow = static_cast<int>((c * H + h) * KP);  // the chunk's S / dS rows
    // phase A's inputs, then phase B's (NV = 2: all but S and dS, which come after phase A), then q, k, a, b
    mbar_expect_tx(bars, (1 + 4 * NV) * kTile);
    tma_load_2d(smem + L::T, &args.tm_T.map, bars, 0, mrow);
#pragma unroll
    for (int vt = 0; vt < NV; ++vt) {
      tma_load_3d(smem + L::dUt + vt * kTile, &args.tm_dut.map, bars, 64 * vt, hh, row0);
      tma_load_4d(smem + L::dO + vt * kTile, &args.tm_do.map, bars, 64 * vt, hh, t0, b);
      tma_load_4d(smem + L::V + vt * kTile, &args.tm_v.map, bars, 64 * vt, hh, t0, b);
      tma_load_3d(smem + L::Ut + vt * kTile, &args.tm_ut.map, bars, 64 * vt, hh, row0);
    }
    mbar_expect_tx(bars + 1, 5 * kTile);
    tma_load_2d(smem + L::Pk, &args.tm_pk.map, bars + 1, 0, mrow);
    if constexpr (NV == 1) {
      tma_load_2d(smem + L::S, &args.tm_h.map, bars + 1, 0, mrow);
      tma_load_2d(smem + L::dS, &args.tm_dh.map, bars + 1, 0, mrow);
    } else {
      tma_load_2d(smem + L::dSo, &args.tm_dh.map, bars + 1, 64 * vh, srow + 64 * (1 - kh));
    }
    tma_load_2d(smem + L::Ak, &args.tm_ak.map, bars + 1, 0, mrow);
#pragma unroll
    for (int kt = 0; kt < NV; ++kt)
      tma_load_3d(smem + L::Kd + kt * kTile, &args.tm_kd.map, bars + 1, 64 * kt, hh, row0);
    mbar_expect_tx(bars + 2, 4 * kTile);
    tma_load_4d(smem + L::q, &args.tm_q.map, bars + 2, k0, hh, t0, b);
    tma_load_4d(smem + L::k, &args.tm_k.map, bars + 2, k0, hh, t0, b);
    tma_load_4d(smem + L::a, &args.tm_a.map, bars + 2, k0, hh, t0, b);
    tma_load_4d(smem + L::b, &args.tm_b.map, bars + 2, k0, hh, t0, b);
  }
  // G (the WY stage's fp32 [R, H, KP], rows < len, the CTA's key columns) into rows 1..64; rows past len repeat
  // G_{len-1} (finite factors on the zero rows); row 0 = 0 (Gp_0).
  {
    const float* pG = x.G + (ch.row0 * H + h) * KP + k0;
    float4 v[4];
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int idx = tid + 256 * it, i = idx >> 4, p = idx & 15;
      v[it] = __ldg(reinterpret_cast<const float4*>(pG + int64_t(min(i, len - 1)) * H * KP) + p);
    }
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int idx = tid + 256 * it, i = idx >> 4, p = idx & 15;
      *reinterpret_cast<float4*>(sG + (i + 1) * ldg + 4 * p) = v[it];
    }
    if (tid < 64) sG[tid] = 0.f;
  }
  __syncthreads();  // the mbarriers are initialised; G is in shared memory
  if (tid < 64) {     // per key column: the reference, e^Gn, and the span test
    const float gn = sG[len * ldg + tid];
    scref[tid] = 0.5f * gn;
    segn[tid] = exp_t<T>(gn);
    sbad[tid] = (gn >= -2.f * Bound::kHalfMax) ? 0 : 1;  // NaN falls back too
  }
  // Rows len .. 63 of a token tile (TMA brings the next chunk's rows there): zero, after its box has landed.
  auto zero_tail = [&](int at) {
    if (len < 64)
      for (int idx = tid; idx < 64 * 8; idx += 256) {
        const int row = idx >> 3;
        if (row >= len) *reinterpret_cast<uint4*>(smem + at + idx * 16) = make_uint4(0u, 0u, 0u, 0u);
      }
  };
  mbar_wait(bars, 0);
#pragma unroll
  for (int vt = 0; vt < NV; ++vt) {
    zero_tail(L::dO + vt * kTile);
    zero_tail(L::V + vt * kTile);
    zero_tail(L::Ut + vt * kTile);
    zero_tail(L::dUt + vt * kTile);
  }
  fence_proxy_async();
  __syncthreads();

  const uint32_t sdO = base + L::dO, sV = base + L::V, sUt = base + L::Ut, sdUt = base + L::dUt, sT = base + L::T;
  const uint32_t sPk = base + L::Pk, sAk = base + L::Ak, sKd = base + L::Kd, sS = base + L::S, sdS = base + L::dS,
                 sdSo = base + L::dSo;
  const uint32_t sdUtp = base + L::dUtp, sMqk = base + L::Mqk, sMqb = base + L::Mqb, sAak = base + L::Aak,
                 sAab = base + L::Aab;
  const uint32_t sQs = base + L::Qs, sAs = base + L::As, sKs = base + L::Ks, sBs = base + L::Bs;

  // Byte offset of K step kk (16 columns) in a K-major operand of NV column tiles.
  auto kstep = [](int kk) { return (kk >> 2) * kTile + (kk & 3) * 32; };

  // ---- phase A: wg0 dUt' = T^T dUt (NV = 2: value tiles into P1, P2); wg1 dO V^T, dO Ut^T ----------------
  float P1[32], P2[32];
  dl_zero(P1), dl_zero(P2);
  reg_fence(P1), reg_fence(P2);
  wg_fence();
  if (wg == 0) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)  // K = the 64 tokens j, 16 rows (2 KB) a step
      wgmma_ss<T, 64, 1, 1>(P1, dl_mnmajor(sT + kk * 2048), dl_mnmajor(sdUt + kk * 2048), 1);
    if constexpr (NV == 2) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_ss<T, 64, 1, 1>(P2, dl_mnmajor(sT + kk * 2048), dl_mnmajor(sdUt + kTile + kk * 2048), 1);
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < 4 * NV; ++kk) {  // K = the value columns, 32 bytes a step
      wgmma_ss<T, 64, 0, 0>(P1, dl_kmajor(sdO + kstep(kk)), dl_kmajor(sV + kstep(kk)), 1);
      wgmma_ss<T, 64, 0, 0>(P2, dl_kmajor(sdO + kstep(kk)), dl_kmajor(sUt + kstep(kk)), 1);
    }
  }
  wg_commit();
  // Meanwhile: the scaled gram operands Qs = q e^(G - c), As = a e^(Gp - c), Ks = k e^(c - G), Bs = b e^(c - G)
  // (rows past len zero), in the inputs' swizzled layout: a thread takes 16-byte pieces, physical piece pp of row
  // r holding columns 8 (pp ^ (r % 8)) ..; a column whose scaled values leave the bound falls back.
  mbar_wait(bars + 2, 0);
#pragma unroll 2
  for (int it = 0; it < 8; ++it) {
    const int idx = tid + 256 * it, s = idx >> 9, r = (idx >> 3) & 63, pp = idx & 7;
    const int c0 = 8 * (pp ^ (r & 7)), o = r * 128 + pp * 16;
    const int src = s == 0 ? L::q : s == 1 ? L::a : s == 2 ? L::k : L::b;
    const int dst = s == 0 ? L::Qs : s == 1 ? L::As : s == 2 ? L::Ks : L::Bs;
    uint4 out = make_uint4(0u, 0u, 0u, 0u);
    if (r < len) {
      const uint4 in = *reinterpret_cast<const uint4*>(smem + src + o);
      const float* gr = sG + (s == 1 ? r : r + 1) * ldg + c0;  // Gp_r for As, G_r otherwise
      const float sgn = s < 2 ? 1.f : -1.f;
      const uint32_t iw[4] = {in.x, in.y, in.z, in.w};
      uint32_t ow[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 xv = unpack2<T>(iw[e]);
        const int d0 = c0 + 2 * e;
        const float v0 = xv.x * exp_t<T>(sgn * (gr[2 * e] - scref[d0]));
        const float v1 = xv.y * exp_t<T>(sgn * (gr[2 * e + 1] - scref[d0 + 1]));
        if (!(fabsf(v0) <= Bound::kScaledMax)) sbad[d0] = 1;
        if (!(fabsf(v1) <= Bound::kScaledMax)) sbad[d0 + 1] = 1;
        ow[e] = pack2<T>(v0, v1);
      }
      out = make_uint4(ow[0], ow[1], ow[2], ow[3]);
    }
    *reinterpret_cast<uint4*>(smem + dst + o) = out;
  }
  wg_wait<0>();
  reg_fence(P1), reg_fence(P2);
  if (wg == 0) {  // dUt' (rows past len are zero: dUt's are, and T is unit lower triangular); NV = 2: over dUt
    dl_acc_to_tile<T>(smem + L::dUtp, P1, [](float v, int, int) { return v; });
    if constexpr (NV == 2) dl_acc_to_tile<T>(smem + L::dUtp + kTile, P2, [](float v, int, int) { return v; });
  } else {
    dl_acc_to_tile<T>(smem + L::Mqk, P1, [&](float v, int i, int j) { return (j <= i && i < len) ? scale * v : 0.f; });
    dl_acc_to_tile<T>(smem + L::Mqb, P2, [&](float v, int i, int j) { return (j <= i && i < len) ? scale * v : 0.f; });
  }
  mbar_wait(bars + 1, 0);
#pragma unroll
  for (int kt = 0; kt < NV; ++kt) zero_tail(L::Kd + kt * kTile);
  fence_proxy_async();
  __syncthreads();  // dUt', dM_qk, dM_qb, the scaled operands and every span / range flag are in place
  if (tid == 0) {   // the falling-back columns, in order (read after the next barrier)
    if constexpr (NV == 2) {  // q, k, a, b are read: the CTA's key rows of S and dS over them
      fence_proxy_async();
      const int srow = static_cast<int>((c * H + h) * KP) + k0;
      mbar_expect_tx(bars + 3, 4 * kTile);
#pragma unroll
      for (int vt = 0; vt < NV; ++vt) {
        tma_load_2d(smem + L::S + vt * kTile, &args.tm_h.map, bars + 3, 64 * vt, srow);
        tma_load_2d(smem + L::dS + vt * kTile, &args.tm_dh.map, bars + 3, 64 * vt, srow);
      }
    }
    int n = 0;
    for (int d = 0; d < kDLCols; ++d)
      if (sbad[d]) sbadlist[n++] = d;
    *snbad = n;
  }

  // ---- phase B ---------------------------------------------------------------------------------------------
  float F1[32], F2[32];
  dl_zero(P1), dl_zero(P2), dl_zero(F1), dl_zero(F2);
  reg_fence(P1), reg_fence(P2), reg_fence(F1), reg_fence(F2);
  wg_fence();
  // dv's value columns (NV = 2: the CTA's value half vh) and the CTA's key rows of S, dS.
  const uint32_t sdOv = sdO + vh * kTile, sdUtpv = sdUtp + vh * kTile;
  if (wg == 0) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)  // P_qk^T dO (K = tokens)
      wgmma_ss<T, 64, 1, 1>(P1, dl_mnmajor(sPk + kk * 2048), dl_mnmajor(sdOv + kk * 2048), 1);
    wg_commit();
    if constexpr (NV == 1) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)  // F_q = dO S^T (K = values)
        wgmma_ss<T, 64, 0, 0>(F1, dl_kmajor(sdO + kk * 32), dl_kmajor(sS + kk * 32), 1);
      wg_commit();
      wg_wait<1>();
    } else {
      wg_wait<0>();
    }
    reg_fence(P1);
#pragma unroll
    for (int e = 0; e < 32; ++e) P1[e] *= scale;
    reg_fence(P1);
    wg_fence();
    if constexpr (NV == 1) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma_ss<T, 64, 0, 1>(P1, dl_kmajor(sKd + kk * 32), dl_mnmajor(sdS + kk * 2048), 1);     // Kd dS (K = keys)
        wgmma_ss<T, 64, 1, 1>(P1, dl_mnmajor(sAk + kk * 2048), dl_mnmajor(sdUtp + kk * 2048), 1);  // A_ak^T dUt'
        wgmma_ss<T, 64, 0, 0>(F2, dl_kmajor(sdUtp + kk * 32), dl_kmajor(sS + kk * 32), 1);        // F_a = dUt' S^T
      }
    } else {  // first what needs no S, dS rows of this key half, then the rest once they have landed
      const uint32_t sKdo = sKd + (1 - kh) * kTile, sKdh = sKd + kh * kTile;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma_ss<T, 64, 1, 1>(P1, dl_mnmajor(sAk + kk * 2048), dl_mnmajor(sdUtpv + kk * 2048), 1);  // A_ak^T dUt'
        wgmma_ss<T, 64, 0, 1>(P1, dl_kmajor(sKdo + kk * 32), dl_mnmajor(sdSo + kk * 2048), 1);  // Kd dS, other keys
      }
      mbar_wait(bars + 3, 0);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)  // Kd dS, this half's keys
        wgmma_ss<T, 64, 0, 1>(P1, dl_kmajor(sKdh + kk * 32), dl_mnmajor(sdS + vh * kTile + kk * 2048), 1);
#pragma unroll
      for (int kk = 0; kk < 4 * NV; ++kk) {  // K = values
        wgmma_ss<T, 64, 0, 0>(F1, dl_kmajor(sdO + kstep(kk)), dl_kmajor(sS + kstep(kk)), 1);    // F_q = dO S^T
        wgmma_ss<T, 64, 0, 0>(F2, dl_kmajor(sdUtp + kstep(kk)), dl_kmajor(sS + kstep(kk)), 1);  // F_a = dUt' S^T
      }
    }
    wg_commit();
  } else {
    if constexpr (NV == 1) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {  // K = values
        wgmma_ss<T, 64, 0, 0>(P1, dl_kmajor(sdUtp + kk * 32), dl_kmajor(sV + kk * 32), 1);   // dUt' V^T
        wgmma_ss<T, 64, 0, 0>(P2, dl_kmajor(sdUtp + kk * 32), dl_kmajor(sUt + kk * 32), 1);  // dUt' Ut^T
        wgmma_ss<T, 64, 0, 0>(F1, dl_kmajor(sV + kk * 32), dl_kmajor(sdS + kk * 32), 1);     // F_k = V dS^T
        wgmma_ss<T, 64, 0, 0>(F2, dl_kmajor(sUt + kk * 32), dl_kmajor(sdS + kk * 32), 1);    // F_b = Ut dS^T
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < 4 * NV; ++kk) {  // K = values
        wgmma_ss<T, 64, 0, 0>(P1, dl_kmajor(sdUtp + kstep(kk)), dl_kmajor(sV + kstep(kk)), 1);   // dUt' V^T
        wgmma_ss<T, 64, 0, 0>(P2, dl_kmajor(sdUtp + kstep(kk)), dl_kmajor(sUt + kstep(kk)), 1);  // dUt' Ut^T
      }
      mbar_wait(bars + 3, 0);
#pragma unroll
      for (int kk = 0; kk < 4 * NV; ++kk) {
        wgmma_ss<T, 64, 0, 0>(F1, dl_kmajor(sV + kstep(kk)), dl_kmajor(sdS + kstep(kk)), 1);   // F_k = V dS^T
        wgmma_ss<T, 64, 0, 0>(F2, dl_kmajor(sUt + kstep(kk)), dl_kmajor(sdS + kstep(kk)), 1);  // F_b = Ut dS^T
      }
    }
    wg_commit();
  }
  // rowsum(dS S) per key row while the products run (both operands share one layout: any order of the bytes of
  // a row): four threads a row, two 16-byte pieces of each of the NV tiles each.
  if constexpr (NV == 2) mbar_wait(bars + 3, 0);
  {
    const int r = tid >> 2, p0 = 2 * (tid & 3);
    float acc = 0.f;
#pragma unroll
    for (int pp = 0; pp < 2 * NV; ++pp) {
      const int at = (pp >> 1) * kTile + r * 128 + (p0 + (pp & 1)) * 16;
      const uint4 xs = *reinterpret_cast<const uint4*>(smem + L::S + at);
      const uint4 zs = *reinterpret_cast<const uint4*>(smem + L::dS + at);
      const uint32_t xa[4] = {xs.x, xs.y, xs.z, xs.w}, za[4] = {zs.x, zs.y, zs.z, zs.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = unpack2<T>(xa[e]), z = unpack2<T>(za[e]);
        acc = fmaf(f.x, z.x, fmaf(f.y, z.y, acc));
      }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    if ((tid & 3) == 0) srs[r] = acc;
  }
  wg_wait<0>();
  reg_fence(P1), reg_fence(P2), reg_fence(F1), reg_fence(F2);
  if (wg == 0) {  // dv staged over T (read by phase A only), then out by this warpgroup
    dl_acc_to_tile<T>(smem + L::dvStage, P1, [](float v, int, int) { return v; });
    warpgroup_bar(0);
    dl_store_tile<T>(x.dv, ch.batch, ch.t0, h, 64 * vh, smem + L::dvStage, len, 0, 128);
  } else {  // (NV = 2: over V, which only this warpgroup read)
    dl_acc_to_tile<T>(smem + L::Aak, P1, [&](float v, int i, int j) { return (j < i && i < len) ? v : 0.f; });
    dl_acc_to_tile<T>(smem + L::Aab, P2, [&](float v, int i, int j) { return (j < i && i < len) ? v : 0.f; });
  }
  fence_proxy_async();
  __syncthreads();  // dA_ak, dA_ab in place; dv is out; the phase-A/B inputs are dead
  if constexpr (NV == 2) {  // q, k, a, b again, over S and dS, for the fallback and the combine
    if (tid == 0) {
      fence_proxy_async();
      const int t0 = static_cast<int>(ch.t0), b = static_cast<int>(ch.batch), hh = static_cast<int>(h);
      mbar_expect_tx(bars + 4, 4 * kTile);
      tma_load_4d(smem + L::q, &args.tm_q.map, bars + 4, k0, hh, t0, b);
      tma_load_4d(smem + L::k, &args.tm_k.map, bars + 4, k0, hh, t0, b);
      tma_load_4d(smem + L::a, &args.tm_a.map, bars + 4, k0, hh, t0, b);
      tma_load_4d(smem + L::b, &args.tm_b.map, bars + 4, k0, hh, t0, b);
    }
  }

  // ---- phase C: the gram gradients about the mid reference ---------------------------------------------------
  dl_zero(P1), dl_zero(P2);
  reg_fence(P1), reg_fence(P2);
  wg_fence();
  if (wg == 0) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // K = tokens j
      const uint64_t bk = dl_mnmajor(sKs + kk * 2048), bb = dl_mnmajor(sBs + kk * 2048);
      wgmma_ss<T, 64, 0, 1>(P1, dl_kmajor(sMqk + kk * 32), bk, 1);  // R_q
      wgmma_ss<T, 64, 0, 1>(P1, dl_kmajor(sMqb + kk * 32), bb, 1);
      wgmma_ss<T, 64, 0, 1>(P2, dl_kmajor(sAak + kk * 32), bk, 1);  // R_a
      wgmma_ss<T, 64, 0, 1>(P2, dl_kmajor(sAab + kk * 32), bb, 1);
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // K = tokens i
      const uint64_t bq = dl_mnmajor(sQs + kk * 2048), ba = dl_mnmajor(sAs + kk * 2048);
      wgmma_ss<T, 64, 1, 1>(P1, dl_mnmajor(sMqk + kk * 2048), bq, 1);  // R_k
      wgmma_ss<T, 64, 1, 1>(P1, dl_mnmajor(sAak + kk * 2048), ba, 1);
      wgmma_ss<T, 64, 1, 1>(P2, dl_mnmajor(sMqb + kk * 2048), bq, 1);  // R_b
      wgmma_ss<T, 64, 1, 1>(P2, dl_mnmajor(sAab + kk * 2048), ba, 1);
    }
  }
  wg_commit();
  // The element-by-element gram of the falling-back columns (CTA-uniform: none for gates of moderate span),
  // into fp32 tiles over the dead inputs. Four columns at a time, 64 threads each: threads 0..31 of the group
  // form dq_i, da_i for rows idx and 63 - idx (balanced: 65 pairs), threads 32..63 dk_j, db_j for columns idx
  // and 63 - idx. Every exponent is <= 0: G falls along the chunk and only pairs inside the masks are formed.
  const int nbad = *snbad;
  if (nbad > 0) {
    if constexpr (NV == 2) mbar_wait(bars + 4, 0);  // the second q, k, a, b
    float* fq = reinterpret_cast<float*>(smem + L::fb);
    float* fa = fq + 64 * 64;
    float* fk = fa + 64 * 64;
    float* fbb = fk + 64 * 64;
    const unsigned char *tq = smem + L::q, *tk = smem + L::k, *ta = smem + L::a, *tb = smem + L::b;
    const unsigned char *mqk = smem + L::Mqk, *mqb = smem + L::Mqb, *aak = smem + L::Aak, *aab = smem + L::Aab;
    const int grp = tid >> 6, l = tid & 63, side = l >> 5, idx = l & 31;
#pragma unroll 1
    for (int bi = grp; bi < nbad; bi += 4) {
      const int d = sbadlist[bi];
#pragma unroll 1
      for (int half = 0; half < 2; ++half) {
        const int m = half == 0 ? idx : 63 - idx;
        float s1 = 0.f, s2 = 0.f;
        if (side == 0) {  // row i = m: dq_i (j <= i), da_i (j < i)
          const int i = m;
          if (i < len) {
            const float gi = sG[(i + 1) * ldg + d], gpi = sG[i * ldg + d];
#pragma unroll 1
            for (int j = 0; j <= i; ++j) {
              const float gj = sG[(j + 1) * ldg + d];
              const float kj = dl_elem<T>(tk, j, d), bj = dl_elem<T>(tb, j, d);
              s1 = fmaf(fmaf(dl_elem<T>(mqk, i, j), kj, dl_elem<T>(mqb, i, j) * bj), exp_t<T>(gi - gj), s1);
              if (j < i)
                s2 = fmaf(fmaf(dl_elem<T>(aak, i, j), kj, dl_elem<T>(aab, i, j) * bj), exp_t<T>(gpi - gj), s2);
            }
          }
          fq[i * 64 + d] = s1;
          fa[i * 64 + d] = s2;
        } else {  // column j = m: dk_j, db_j (i >= j for the q pair, i > j for the a pair)
          const int j = m;
          if (j < len) {
            const float gj = sG[(j + 1) * ldg + d];
#pragma unroll 1
            for (int i = j; i < len; ++i) {
              const float qe = dl_elem<T>(tq, i, d) * exp_t<T>(sG[(i + 1) * ldg + d] - gj);
              s1 = fmaf(dl_elem<T>(mqk, i, j), qe, s1);
              s2 = fmaf(dl_elem<T>(mqb, i, j), qe, s2);
              if (i > j) {
                const float ae = dl_elem<T>(ta, i, d) * exp_t<T>(sG[i * ldg + d] - gj);
                s1 = fmaf(dl_elem<T>(aak, i, j), ae, s1);
                s2 = fmaf(dl_elem<T>(aab, i, j), ae, s2);
              }
            }
          }
          fk[j * 64 + d] = s1;
          fbb[j * 64 + d] = s2;
        }
      }
    }
  }
  wg_wait<0>();
  reg_fence(P1), reg_fence(P2);
  if constexpr (NV == 2) mbar_wait(bars + 4, 0);
  __syncthreads();  // the fallback's tiles are complete; the dM and scaled operands are dead

  // ---- combine ---------------------------------------------------------------------------------------------
  // wg0: (F1, P1) -> dq, (F2, P2) -> da; wg1: (F1, P1) -> dk, (F2, P2) -> db. The gram part is selected, never
  // multiplied, for falling-back columns (their factor may be inf).
  const int ra = 16 * wi + g;
  const float* fb1 = reinterpret_cast<const float*>(smem + L::fb) + (2 * wg) * 64 * 64;
  const float* fb2 = fb1 + 64 * 64;
  float cs[16];  // wg1: this thread's columns' share of colsum(k e^(Gn - G) F_k + b e^(Gn - G) F_b)
#pragma unroll
  for (int e = 0; e < 16; ++e) cs[e] = 0.f;
  // The gate gradient's parts go to F1 (wg0: q dq, wg1: -k dk - b db) and F2 (wg0: a da). A score pair (i, j)
  // enters dG twice with opposite signs (q_i dq_i and k_j dk_j hold the same q_i dM_ij k_j e^(G_i - G_j)), and the
  // reverse sum cancels the two for every row up to j. So the gram parts of dG are formed from the very operands
  // the gram multiplied, Qs R_q and Ks R_k (rounded Qs, Ks: q_i e^(G_i - c) Ks_j against Qs_i k_j e^(c - G_j)
  // would leave 2^-9 of every pair uncancelled in every row above it); the fallback's columns use the raw inputs
  // (its exponentials are shared by both sides).
  const unsigned char *tQs = smem + L::Qs, *tAs = smem + L::As, *tKs = smem + L::Ks, *tBs = smem + L::Bs;
  const unsigned char *tq = smem + L::q, *ta = smem + L::a, *tk = smem + L::k, *tb = smem + L::b;
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = ra + 8 * (e >> 1), cc = 8 * nb + 2 * t + (e & 1), ri = 4 * nb + e;
      const float gr = sG[(r + 1) * ldg + cc], gpr = sG[r * ldg + cc], cr = scref[cc];
      const bool good = sbad[cc] == 0;
      if (wg == 0) {
        const float f1 = scale * exp_t<T>(gr) * F1[ri], f2 = exp_t<T>(gpr) * F2[ri];
        const float qv = dl_elem<T>(tq, r, cc), av = dl_elem<T>(ta, r, cc);
        float g1, g2, dgq, dga;
        if (good) {
          g1 = exp_t<T>(gr - cr) * P1[ri];
          g2 = exp_t<T>(gpr - cr) * P2[ri];
          dgq = fmaf(qv, f1, dl_elem<T>(tQs, r, cc) * P1[ri]);
          dga = fmaf(av, f2, dl_elem<T>(tAs, r, cc) * P2[ri]);
        } else {
          g1 = fb1[r * 64 + cc];
          g2 = fb2[r * 64 + cc];
          dgq = qv * (f1 + g1);
          dga = av * (f2 + g2);
        }
        P1[ri] = f1 + g1;  // dq
        P2[ri] = f2 + g2;  // da
        F1[ri] = dgq;
        F2[ri] = dga;
      } else {
        const float fe = exp_t<T>(sG[len * ldg + cc] - gr);
        const float f1 = fe * F1[ri], f2 = fe * F2[ri];
        const float kv = dl_elem<T>(tk, r, cc), bv = dl_elem<T>(tb, r, cc);
        if (r < len) cs[2 * nb + (e & 1)] += kv * f1 + bv * f2;
        float g1, g2, dgk;
        if (good) {
          const float eg = exp_t<T>(cr - gr);
          g1 = eg * P1[ri];
          g2 = eg * P2[ri];
          dgk = -(kv * f1 + dl_elem<T>(tKs, r, cc) * P1[ri]) - (bv * f2 + dl_elem<T>(tBs, r, cc) * P2[ri]);
        } else {
          g1 = fb1[r * 64 + cc];
          g2 = fb2[r * 64 + cc];
          dgk = -kv * (f1 + g1) - bv * (f2 + g2);
        }
        P1[ri] = f1 + g1;  // dk
        P2[ri] = f2 + g2;  // db
        F1[ri] = dgk;
      }
    }
  __syncthreads();  // the scaled operands and the fallback's tiles are read: the staging may take their bytes
  // The outputs staged (16-bit) and the fp32 dG parts (rows past len are never read).
  {
    unsigned char* st1 = smem + L::outStage + (2 * wg) * L::kTile;
    dl_acc_to_tile<T>(st1, P1, [](float v, int, int) { return v; });
    dl_acc_to_tile<T>(st1 + L::kTile, P2, [](float v, int, int) { return v; });
    float* pg = reinterpret_cast<float*>(smem + (wg == 0 ? L::P0 : L::P1));
    float* pa = reinterpret_cast<float*>(smem + L::Pa);
#pragma unroll
    for (int nb = 0; nb < 8; ++nb)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = ra + 8 * hh, cc = 8 * nb + 2 * t, e0 = 4 * nb + 2 * hh;
        if (r >= len) continue;
        *reinterpret_cast<float2*>(pg + r * 64 + cc) = make_float2(F1[e0], F1[e0 + 1]);
        if (wg == 0) *reinterpret_cast<float2*>(pa + r * 64 + cc) = make_float2(F2[e0], F2[e0 + 1]);
      }
    if (wg == 1) {  // the colsum over the warp's rows (lanes of one t share columns), then per warp
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        cs[e] += __shfl_xor_sync(0xffffffffu, cs[e], 4);
        cs[e] += __shfl_xor_sync(0xffffffffu, cs[e], 8);
        cs[e] += __shfl_xor_sync(0xffffffffu, cs[e], 16);
      }
      if (g == 0)
#pragma unroll
        for (int e = 0; e < 16; ++e) scol[wi * 64 + 8 * (e >> 1) + 2 * t + (e & 1)] = cs[e];
    }
  }
  __syncthreads();
  // Out: dq, da, dk, db (two warps each), and dgk: one thread per key column (warps 0, 1), from the chunk's end
  // up: dgk_i = X + sum_{t >= i} (q dq - k dk - b db)_t + sum_{t > i} (a da)_t, X = e^Gn rowsum(dS S) + colsum.
  {
    const int which = tid >> 6;  // 0 dq, 1 da, 2 dk, 3 db
    const DevRows<T>& out = which == 0 ? x.dq : which == 1 ? x.da : which == 2 ? x.dk : x.db;
    dl_store_tile<T>(out, ch.batch, ch.t0, h, k0, smem + L::outStage + which * L::kTile, len, 64 * which, 64);
  }
  if (tid < 64) {
    const int d = tid;
    const float* p0 = reinterpret_cast<const float*>(smem + L::P0);
    const float* p1 = reinterpret_cast<const float*>(smem + L::P1);
    const float* pa = reinterpret_cast<const float*>(smem + L::Pa);
    float run = segn[d] * srs[d] + scol[d] + scol[64 + d] + scol[128 + d] + scol[192 + d];
#pragma unroll 1
    for (int i = len - 1; i >= 0; --i) {
      run += p0[i * 64 + d] + p1[i * 64 + d];
      store_gate_grad(x, ch.batch, ch.t0 + i, h, k0 + d, run);
      run += pa[i * 64 + d];
    }
  }
#else
  __trap();  // never launched: the host selects this kernel only for builds with sm_90a code
#endif
}

// ---- host ----------------------------------------------------------------------------------------
// Why the chunk-local kernel cannot run p with `chunks` chunks (nullptr: it can).
inline const char* dplr_local_refusal(const Params& p, int64_t chunks) {
#ifndef DELTACP_HAVE_SM90A
  (void)p;
  (void)chunks;
  return "this build has no sm_90a code";
#else
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return "it takes bf16 or fp16 inputs";
  if (!((p.K == 64 && p.V == 64) || (p.K == 128 && p.V == 128))) return "it takes K = V = 64 or K = V = 128";
  if (p.chunk_size != 64) return "it takes chunk_size = 64";
  if (p.B * p.T >= (int64_t{1} << 31)) return "TMA coordinates are 32-bit (B * T < 2^31)";
  if (chunks * p.H * p.K >= (int64_t{1} << 31)) return "TMA coordinates are 32-bit (chunks * H * K < 2^31)";
  for (const TensorRef* r : {&p.q, &p.k, &p.a, &p.b, &p.v, &p.dout}) {
    if (!rows_aligned16(*r, 2))
      return "TMA reads q, k, a, b, v and dO in 16-byte pieces (a pointer or stride is not 16-byte aligned)";
    if (!steps_forward(*r, p.B, p.T, p.H))
      return "TMA reads q, k, a, b, v and dO through tensor maps, which need positive strides";
  }
  if (device_attribute(cudaDevAttrComputeCapabilityMajor) != 9 ||
      device_attribute(cudaDevAttrComputeCapabilityMinor) != 0)
    return "it runs on compute capability 9.0 (H100 / H200) only";
  const int need = p.K == 64 ? DplrLocalSmem<1>::bytes : DplrLocalSmem<2>::bytes;
  if (max_smem_optin() < need) return "the GPU gives a block less shared memory than it needs";
  return nullptr;
#endif
}

// DELTACP_TILED_DPLR_BWD_LOCAL (common/kernel_switch.h): unset = this kernel instead of kernels 5 and 6 wherever
// it applies (K = V = 64 or 128); 0 = kernels 5 and 6; 1 = required (an error names why it cannot run these inputs).
inline bool use_dplr_local(const Params& p, int64_t chunks) {
  return kernel_switch("DELTACP_TILED_DPLR_BWD_LOCAL", "the DPLR chunk-local backward kernel",
                       [&] { return dplr_local_refusal(p, chunks); }, /*unset_on=*/true);
}

// After the forward stages and the reverse scan have filled x's workspace (G, Kd, T, A_ak, P_qk, Ut, h, dh, dUt).
// NV = K / 64 (= V / 64 = KP / 64 = VP / 64: dplr_local_refusal admits nothing else).
template <class T, int NV>
void launch_dplr_local(const Params& p, const DplrArgs<T>& x, int64_t chunks, cudaStream_t stream) {
  if (chunks == 0) return;
  constexpr int D = 64 * NV;
  const int64_t R = p.B * p.T, mats = chunks * p.H * 64;
  DplrLocalArgs<T> w;
  w.x = x;
  w.tm_q = token_rows_map(p.q, p.B, p.T, p.H, D, "q");
  w.tm_k = token_rows_map(p.k, p.B, p.T, p.H, D, "k");
  w.tm_a = token_rows_map(p.a, p.B, p.T, p.H, D, "a");
  w.tm_b = token_rows_map(p.b, p.B, p.T, p.H, D, "b");
  w.tm_v = token_rows_map(p.v, p.B, p.T, p.H, D, "v");
  w.tm_do = token_rows_map(p.dout, p.B, p.T, p.H, D, "do");
  w.tm_kd = workspace_rows_map(x.Kd, R, p.H, D, "Kd");
  w.tm_ut = workspace_rows_map(x.Ut, R, p.H, D, "Ut");
  w.tm_dut = workspace_rows_map(x.dUt, R, p.H, D, "dUt");
  w.tm_T = tile_map_16bit(x.Tg, {64, mats}, {64}, {64, 64}, "T");
  w.tm_pk = tile_map_16bit(x.Pk, {64, mats}, {64}, {64, 64}, "P_qk");
  w.tm_ak = tile_map_16bit(x.Akg, {64, mats}, {64}, {64, 64}, "A_ak");
  w.tm_h = tile_map_16bit(x.h, {D, mats * NV}, {D}, {64, 64}, "h");
  w.tm_dh = tile_map_16bit(x.dh, {D, mats * NV}, {D}, {64, 64}, "dh");
  auto kernel = dplr_bwd_local_wgmma_kernel<T, NV>;
  constexpr int bytes = DplrLocalSmem<NV>::bytes;
  opt_in_smem(kernel, bytes, "K", "the DPLR chunk-local backward needs ", bytes, " bytes of shared memory");
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(p.H), NV);
  kernel<<<grid, 256, bytes, stream>>>(w);
  DELTACP_CUDA_CHECK_LAUNCH();
}

}  // namespace
}  // namespace deltacp::cuda::tiled
