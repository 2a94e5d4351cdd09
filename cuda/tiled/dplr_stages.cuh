// cuda/tiled/dplr_stages.cuh — the tiled DPLR tier's shared pieces: the kernel arguments, the shared-memory
// layouts, the forward's three stages and the reverse state-gradient scan, and the host helpers. The forward
// (dplr_fwd.cu, whose opening comment describes these stages) and the backward (dplr_bwd.cu) both launch them;
// everything sits in an anonymous namespace, so each of the two files compiles its own copy of the kernels.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../common/check.h"
#include "../common/dev_rows.cuh"
#include "../common/device_info.h"
#include "../common/kernel_switch.h"
#include "../common/load_store.cuh"
#include "../common/workspace_pool.h"
#include "chunk_table.cuh"
#include "deltacp/cuda/tiers.h"
#include "deltacp/error.h"
#include "deltacp/params.h"
#include "dplr_scores.cuh"
#include "fwd_mma.cuh"
#include "wy_solve.cuh"

namespace deltacp::cuda::tiled {
namespace {

constexpr int kDThreads = 128;  // 4 warps per CTA in every kernel
constexpr int kDRows = 64;      // rows of the chunk tile
constexpr int kDBV = 32;        // state / value columns per block

// Leading dimension of a shared tile of `cols` elements: 16-bit tiles pad by 8 (ldmatrix rows in distinct
// bank groups, fwd_mma.cuh), fp32 tiles by 4 (rows stay 16-byte aligned for cp.async and float4 loads).
template <class T>
__host__ __device__ constexpr int tile_ld(int cols) {
  return cols + (kIs16Bit<T> ? 8 : 4);
}
__host__ __device__ constexpr int gate_ld(int kp) { return kp + 4; }

// Row i of a 64-row tile (KP columns, leading dimension ld) times e^(G row i), in place, eight keys per thread;
// each scaled piece of eight is also handed to also(i, d0, values) (the q e^G workspace; a no-op elsewhere).
// Called by all kDThreads threads; the caller orders it with barriers.
template <class T, int KP, class Also>
__device__ __forceinline__ void scale_rows_by_exp(T* tile, int ld, const float* G, int ldg, Also also) {
  for (int idx = threadIdx.x; idx < kDRows * (KP / 8); idx += kDThreads) {
    const int i = idx / (KP / 8), d0 = 8 * (idx - i * (KP / 8));
    float v[8], g[8];
    load8(tile + i * ld + d0, v);
    load8f(G + i * ldg + d0, g);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] *= exp_t<T>(g[e]);
    store8(tile + i * ld + d0, v);
    also(i, d0, v);
  }
}

// Rows i < len of a tile (KP columns, leading dimension ld) decayed to the chunk's end, x e^(G_n - G_i), into the
// [R, H, KP] workspace `out` at rows wrow + i * H (wrow: the chunk's first row there), eight keys per thread. G_i is
// row i + 1 of the cumulative gates G (row 0 is the zero row before the chunk), G_n row len; each piece's workspace
// offset and G_i values also go to also(offset, values) (the wy stage stores G beside Bd).
template <class T, int KP, class Also>
__device__ __forceinline__ void decay_rows_to_end(const T* tile, int ld, const float* G, int ldg, int len, T* out,
                                                  int64_t wrow, int64_t H, Also also) {
  const float* Gn = G + len * ldg;
  for (int idx = threadIdx.x; idx < len * (KP / 8); idx += kDThreads) {
    const int i = idx / (KP / 8), d0 = 8 * (idx - i * (KP / 8));
    const int64_t w = (wrow + i * H) * KP + d0;
    float v[8], gi[8], gn[8];
    load8f(G + (i + 1) * ldg + d0, gi);
    load8f(Gn + d0, gn);
    load8(tile + i * ld + d0, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] *= exp_t<T>(gn[e] - gi[e]);
    store8(out + w, v);
    also(w, gi);
  }
}

// A chunk's rows [wrow, wrow + len) of a [R, H, KP] workspace (W, Kd, Bd, q e^G: rows ldg = H * KP apart) into
// a 64-row shared tile of leading dimension ldk, zeros past len (cp.async; the caller commits): the scans'
// per-chunk key-side tiles.
template <class T, int KP, int NThreads = kDThreads>
__device__ __forceinline__ void load_key_rows(T* dst, int ldk, const T* ws, int64_t wrow, int64_t ldg, int len) {
  const T* src = ws + wrow * KP;
  load_tile<T, NThreads>(dst, ldk, src, ldg, len, kDRows, KP, KP, vec_ok(src, ldg));
}
__host__ __device__ constexpr int64_t align16(int64_t x) { return (x + 15) / 16 * 16; }

template <class T>
struct DplrArgs {
  DevRows<const T> q, k, v, a, b;
  DevRows<T> o;
  const void* gk = nullptr;  // fp32 (gk_fp32) or T
  int64_t gk_sb = 0, gk_st = 0, gk_sh = 0;
  bool gk_fp32 = false;
  const ChunkEntry* chunks = nullptr;
  const SeqEntry* seqs = nullptr;
  int64_t H = 0, K = 0, V = 0;
  int VP = 0;
  float scale = 1.f;
  // workspace
  float* G = nullptr;
  T* W = nullptr;
  T* U = nullptr;
  T* Kd = nullptr;
  T* Bd = nullptr;
  float* Dn = nullptr;
  T* h = nullptr;
  T* Ut = nullptr;
  const float* h0 = nullptr;
  float* ht = nullptr;
  // The backward (dplr_dh0_scan_kernel): the output stage stores scale-free q e^G and P_qb for it.
  T* QG = nullptr;  // [R, H, KP]
  T* Pb = nullptr;  // [chunks, H, 64, 64]
  DevRows<const T> dout;
  const float* dht = nullptr;
  float* dh0 = nullptr;  // may be null in the full backward
  // The full backward (dplr_bwd.cu): what the forward stages keep for it, what the reverse scan keeps, and
  // what its first local stage hands to the second. Null in the forward and in the dh0-only backward.
  T* Tg = nullptr;    // T = (I - A_ab)^-1, [chunks, H, 64, 64] (WY stage)
  T* Akg = nullptr;   // A_ak, [chunks, H, 64, 64] (WY stage)
  T* Pk = nullptr;    // P_qk, [chunks, H, 64, 64] (output stage without o)
  T* dh = nullptr;    // dL/dS at each chunk's end, [chunks, H, KP, VP] (reverse scan)
  T* dUt = nullptr;   // dL/dUt, [R, H, VP] (reverse scan)
  T* dUtp = nullptr;  // T^T dUt, [R, H, VP] (dplr_bwd_dv_kernel)
  T* dM = nullptr;    // the four masked score gradients, [chunks, H, 4, 64, 64] (dplr_bwd_dv_kernel)
  DevRows<T> dq, dk, dv, da, db;
  void* dgk = nullptr;  // fp32 (gk_fp32) or T
  int64_t dgk_sb = 0, dgk_st = 0, dgk_sh = 0;
};

template <class T>
__device__ __forceinline__ void store_gate_grad(const DplrArgs<T>& x, int64_t b, int64_t t, int64_t h, int64_t d,
                                                float val) {
  const int64_t off = b * x.dgk_sb + t * x.dgk_st + h * x.dgk_sh + d;
  if (x.gk_fp32) {
    static_cast<float*>(x.dgk)[off] = val;
  } else {
    static_cast<T*>(x.dgk)[off] = from_f<T>(val);
  }
}

// ---- shared-memory layouts (element offsets in bytes, 16-byte aligned) ------------------------------------
// The wy stage, laid out so that what dies early hands its space on (16-bit inputs: 71,952 bytes at K <= 64,
// three CTAs per H100 / H200 SM; 109,328 at K <= 128, two):
//   a            the a tile (64 x KP)
//   bk           the b tile, then (copied in once A_ab is made and Bd is out) the k tile
//   G            65 rows fp32: row 0 = 0, row i + 1 = G_i (so row i = Gp_i)
//   A            -A_ab in fp32 (lda = 4 mod 32: wy_solve.cuh's fragment loads are conflict-free); after the
//                inverse, T as an operand tile, then A_ak (later T A_ak) as a second one
//   scratch      the scores' reference-row tiles (16 X rows, dplr_scores_y_rows Y rows); between the two scores
//                T in fp32 (and the fp32 solve's 4 x 256 scratch); after them a V tile
template <class T, int KP>
struct WySmem {
  static constexpr int ldk = tile_ld<T>(KP), ld64 = tile_ld<T>(64), ldv = tile_ld<T>(kDBV), ldg = gate_ld(KP);
  static constexpr int lda = 68;  // fp32 64 x 64 matrices (A, T)
  static constexpr int kYRows = dplr_scores_y_rows<T>();
  static constexpr int64_t tileK = align16(int64_t(kDRows) * ldk * sizeof(T));
  static constexpr int64_t tileF = align16(int64_t(kDRows) * lda * 4);
  static constexpr int64_t tile64 = align16(int64_t(kDRows) * ld64 * sizeof(T));
  static constexpr int64_t a = 0, bk = a + tileK;
  static constexpr int64_t G = bk + tileK;
  static constexpr int64_t A = G + align16(int64_t(kDRows + 1) * ldg * 4), Tt = A, Ak = A + tile64;
  static constexpr int64_t scratch = A + std::max<int64_t>(tileF, 2 * tile64), Tf = scratch, Vt = scratch;
  static constexpr int64_t scratch_bytes = std::max<int64_t>(
      std::max<int64_t>(align16(int64_t(16 + kYRows) * ldk * sizeof(T)), tileF + (kIs16Bit<T> ? 0 : 4 * 256 * 4)),
      align16(int64_t(kDRows) * ldv * sizeof(T)));
  static constexpr int64_t bytes = scratch + scratch_bytes;
};

// The shared-memory budget a layout of this tier keeps to, by configuration: 16-bit K <= 64 every sm_80+ GPU
// (sm_86 / sm_89: 99 KB), 16-bit K <= 128 and fp32 K <= 64 sm_80 (163 KB), fp32 K <= 128 sm_90 (227 KB). The
// scans take a second stage of their per-chunk tiles (the next chunk's copies in flight during this chunk's
// products) where it fits that budget.
template <class T, int KP>
constexpr int64_t dplr_smem_budget() {
  return (kIs16Bit<T> && KP == 64) ? 99 * 1024 : (kIs16Bit<T> || KP == 64) ? 163 * 1024 : 227 * 1024;
}

// The forward scan: per stage the W, Kd, Bd tiles, the U and V tiles (BV = 32 or 16 columns, dplr_scan_narrow)
// and D_n; then Ut and S.
template <class T, int KP, int BV = kDBV>
struct ScanSmem {
  static constexpr int ldk = tile_ld<T>(KP), ldv = tile_ld<T>(BV);
  static constexpr int64_t tileK = align16(int64_t(kDRows) * ldk * sizeof(T));
  static constexpr int64_t tileV = align16(int64_t(kDRows) * ldv * sizeof(T));
  static constexpr int64_t W = 0, Kd = W + tileK, Bd = Kd + tileK;  // offsets within a stage
  static constexpr int64_t U = Bd + tileK, V = U + tileV, Dn = V + tileV;
  static constexpr int64_t stage = Dn + align16(int64_t(KP) * 4);
  static constexpr int64_t tail = tileV + align16(int64_t(KP) * ldv * sizeof(T));  // Ut, S
  static constexpr int kStages = 2 * stage + tail <= dplr_smem_budget<T, KP>() ? 2 : 1;
  static constexpr int64_t Ut = kStages * stage, S = Ut + tileV;
  static constexpr int64_t bytes = S + align16(int64_t(KP) * ldv * sizeof(T));
};

// The output stage: the q, k, b tiles, the scores' scratch (16 X rows, dplr_scores_y_rows Y rows), G, P_qk and
// P_qb; per value block the h, V and Ut tiles over k, b and the scratch (free once the scores are made). At
// KP = 128 k and b share one tile, b copied in once P_qk is made (kShareKB: 108,800 bytes at 16 bits, two CTAs
// per H100 / H200 SM instead of one, for one more exposed copy per CTA; at KP = 64 three CTAs fit either way).
// A value block is kBV = 64 columns where its three tiles fit over k, b and the scratch (all but fp32 KP = 128),
// else 32: at V = 64 one round of copies, one wait and one barrier instead of two.
template <class T, int KP>
struct OutSmem {
  static constexpr bool kShareKB = KP > 64;
  static constexpr int kYRows = dplr_scores_y_rows<T>();
  static constexpr int ldk = tile_ld<T>(KP), ld64 = tile_ld<T>(64), ldg = gate_ld(KP);
  static constexpr int64_t tileK = align16(int64_t(kDRows) * ldk * sizeof(T));
  static constexpr int64_t q = 0, k = q + tileK, b = kShareKB ? k : k + tileK;
  static constexpr int64_t scratch = b + tileK;
  static constexpr int64_t G = scratch + align16(int64_t(16 + kYRows) * ldk * sizeof(T));
  static constexpr int64_t Pk = G + align16(int64_t(kDRows) * ldg * 4);
  static constexpr int64_t Pb = Pk + align16(int64_t(kDRows) * ld64 * sizeof(T));
  static constexpr int64_t bytes = Pb + align16(int64_t(kDRows) * ld64 * sizeof(T));
  // per value block of bv columns, from the k tile on: h (KP rows), V, Ut (64 rows)
  static constexpr int64_t value_end(int bv) {
    const int64_t row = int64_t(tile_ld<T>(bv)) * sizeof(T);
    return k + align16(KP * row) + align16(kDRows * row) + kDRows * row;
  }
  static constexpr int kBV = value_end(64) <= G ? 64 : kDBV;
  static constexpr int ldv = tile_ld<T>(kBV);
  static constexpr int64_t hS = k;
  static constexpr int64_t vS = hS + align16(int64_t(KP) * ldv * sizeof(T));
  static constexpr int64_t utS = vS + align16(int64_t(kDRows) * ldv * sizeof(T));
  static_assert(utS + int64_t(kDRows) * ldv * sizeof(T) == value_end(kBV) && value_end(kBV) <= G,
                "the value-block tiles must fit over k, b, scratch");
};

template <class P>
__device__ __forceinline__ P* smem_at(unsigned char* base, int64_t off) {
  return reinterpret_cast<P*>(base + off);
}

// ---- the gates: sG row 0 = 0, row i + 1 = G_i (i < 64) for NC columns from d0 ----------------------------------
// G_i = sum_{t <= i} gk_t within the chunk; rows past len repeat G_{len-1} (finite exponents on the zero rows),
// columns from ncols on are zero. kDThreads / NC threads per column, each over a run of rows: 16 gates loaded at a
// time into registers (independent global loads in flight together, not one load's latency per gate), summed
// there, and the runs joined by adding the sums of the runs above. Ends with __syncthreads.
template <class T, int NC>
__device__ __forceinline__ void dplr_gate_cumsum(const DplrArgs<T>& x, const ChunkEntry& ch, int64_t h, int d0,
                                                 int ncols, float* sG, int ldg, int len) {
  constexpr int kSeg = kDThreads / NC, kRows = kDRows / kSeg, kBatch = 16;
  static_assert(kSeg * NC == kDThreads && kRows % kBatch == 0, "threads per column");
  const int tid = threadIdx.x, d = tid % NC, seg = tid / NC, i0 = seg * kRows;
  const bool col_ok = d < ncols;
  const int64_t base = ch.batch * x.gk_sb + ch.t0 * x.gk_st + h * x.gk_sh + d0 + d;
  float run = 0.f;
#pragma unroll 1
  for (int b0 = 0; b0 < kRows; b0 += kBatch) {
    float g[kBatch];
    if (x.gk_fp32) {
      const float* p = static_cast<const float*>(x.gk) + base;
#pragma unroll
      for (int e = 0; e < kBatch; ++e) {
        const int i = i0 + b0 + e;
        g[e] = (col_ok && i < len) ? p[int64_t(i) * x.gk_st] : 0.f;
      }
    } else {
      const T* p = static_cast<const T*>(x.gk) + base;
#pragma unroll
      for (int e = 0; e < kBatch; ++e) {
        const int i = i0 + b0 + e;
        g[e] = (col_ok && i < len) ? to_f(p[int64_t(i) * x.gk_st]) : 0.f;
      }
    }
#pragma unroll
    for (int e = 0; e < kBatch; ++e) {
      run += g[e];
      sG[(i0 + b0 + e + 1) * ldg + d] = run;
    }
  }
  if (seg == 0) sG[d] = 0.f;
  __syncthreads();
  if constexpr (kSeg > 1) {
    float off = 0.f;  // the sums of the runs above (their last rows, before any run is shifted)
    for (int s = 0; s < seg; ++s) off += sG[(s * kRows + kRows) * ldg + d];
    __syncthreads();
    if (seg > 0)
#pragma unroll 4
      for (int i = 1; i <= kRows; ++i) sG[(i0 + i) * ldg + d] += off;
    __syncthreads();
  }
}

// ---- stage 1: G, the scores, T, W, U, Kd, Bd, D_n ------------------------------------------------------------
template <class T, int KP>
__global__ void __launch_bounds__(kDThreads) dplr_wy_kernel(const DplrArgs<T> x) {
  using L = WySmem<T, KP>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sa = smem_at<T>(smem, L::a);
  T* sb = smem_at<T>(smem, L::bk);               // b, then k
  T* sk = smem_at<T>(smem, L::bk);
  float* sG = smem_at<float>(smem, L::G);
  float* As = smem_at<float>(smem, L::A);        // -A_ab (fp32) until the inverse
  T* Tt = smem_at<T>(smem, L::Tt);               // then T and A_ak as operands
  T* Ak = smem_at<T>(smem, L::Ak);
  T* Xr = smem_at<T>(smem, L::scratch);          // the scores' reference-row tiles
  T* Yr = Xr + 16 * L::ldk;
  float* Ts = smem_at<float>(smem, L::Tf);       // between the scores: T in fp32
  float* solve_scr = Ts + kDRows * L::lda;       // (the fp32 solve's scratch)
  T* Vt = smem_at<T>(smem, L::Vt);               // after the scores: a V tile

  const int tid = threadIdx.x, warp = tid >> 5;
  const ChunkEntry ch = x.chunks[blockIdx.x];
  const int64_t h = blockIdx.y;
  const int len = static_cast<int>(ch.len);
  const int K = static_cast<int>(x.K);
  const T* pk = x.k.at(ch.batch, ch.t0, h);

  // Inputs: a, b tiles (zero past len and K); G.
  {
    const T* pa = x.a.at(ch.batch, ch.t0, h);
    const T* pb = x.b.at(ch.batch, ch.t0, h);
    load_tile<T, kDThreads>(sa, L::ldk, pa, x.a.st, len, kDRows, K, KP, vec_ok(pa, x.a.st));
    load_tile<T, kDThreads>(sb, L::ldk, pb, x.b.st, len, kDRows, K, KP, vec_ok(pb, x.b.st));
    cp_async_commit();
    dplr_gate_cumsum<T, KP>(x, ch, h, 0, K, sG, L::ldg, len);
    cp_async_wait<0>();
    __syncthreads();
  }
  // Bd = b e^(G_n - G), G and D_n to the workspace (the b tile gives way to k once A_ab is made); eight keys per
  // thread.
  const float* Gn = sG + len * L::ldg;  // G_{len-1}
  decay_rows_to_end<T, KP>(sb, L::ldk, sG, L::ldg, len, x.Bd, ch.row0 * x.H + h, x.H,
                           [&](int64_t w, const float(&gi)[8]) { store8(x.G + w, gi); });
  for (int d = tid; d < KP; d += kDThreads)
    x.Dn[(blockIdx.x * x.H + h) * KP + d] = d < K ? exp_t<T>(Gn[d]) : 0.f;

  // -A_ab (fp32, for the inverse): Gl = Gp (rows of sG), Gr = G. bf16: the diagonal blocks go through the tensor
  // cores too where their decay allows (dplr_scores.cuh). The blocks above the block diagonal stay unwritten (the
  // inverse never reads them).
  dplr_scores<T, kDThreads>(sa, sb, L::ldk, sG, sG + L::ldg, L::ldg, Xr, Yr, KP, len, false,
                            [&](int i, int j, float val) { As[i * L::lda + j] = -val; });
  // The k tile over b (the scores end with __syncthreads), in flight during the inverse.
  load_tile<T, kDThreads>(sk, L::ldk, pk, x.k.st, len, kDRows, K, KP, vec_ok(pk, x.k.st));
  cp_async_commit();

  // T = (I - A_ab)^-1 = (I + A)^-1 (wy_solve.cuh): the diagonal 16 x 16 blocks by substitution (one warp each),
  // the blocks below by sub-diagonal level; 16-bit inputs on mma.sync in tf32 (T is rounded to 16 bits before it
  // multiplies anything), fp32 inputs in fp32 FMA. Rows past len have A = 0 and come out as rows of I.
  if constexpr (kIs16Bit<T>) {
    unit_lower_inverse_64_tf32(As, Ts, L::lda);
  } else {
    unit_lower_inverse_64(As, Ts, L::lda, solve_scr);
  }
  // T as an operand (over A, dead now), eight columns per thread; the full backward keeps it.
  const int64_t mat0 = (int64_t(blockIdx.x) * x.H + h) * kDRows * kDRows;  // this chunk's 64 x 64 matrices
  for (int idx = tid; idx < kDRows * 8; idx += kDThreads) {
    const int i = idx >> 3, j0 = 8 * (idx & 7);
    float t[8];
    load8f(Ts + i * L::lda + j0, t);
    store8(Tt + i * L::ld64 + j0, t);
    if (x.Tg != nullptr) store8(x.Tg + mat0 + i * kDRows + j0, t);
    if ((j0 >> 4) > (i >> 4)) {  // A_ak's blocks above the block diagonal (its scores leave them; T A_ak reads them)
      const float z[8] = {};
      store8(Ak + i * L::ld64 + j0, z);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the k tile; T's fp32 copy is dead (the scratch is the scores' again)

  // Kd = k e^(G_n - G) to the workspace.
  decay_rows_to_end<T, KP>(sk, L::ldk, sG, L::ldg, len, x.Kd, ch.row0 * x.H + h, x.H,
                           [](int64_t, const float(&)[8]) {});
  // A_ak (a tensor-core operand), the same gates.
  dplr_scores<T, kDThreads>(sa, sk, L::ldk, sG, sG + L::ldg, L::ldg, Xr, Yr, KP, len, false,
                            [&](int i, int j, float val) { Ak[i * L::ld64 + j] = from_f<T>(val); });

  // The first V tile (over the scratch), in flight during a e^Gp, W and T A_ak.
  const T* pv = x.v.at(ch.batch, ch.t0, h);
  load_tile<T, kDThreads>(Vt, L::ldv, pv, x.v.st, len, kDRows, static_cast<int>(x.V), kDBV, vec_ok(pv, x.v.st));
  cp_async_commit();
  // a e^Gp in place (a is no longer read by the scores), eight keys per thread; the full backward keeps A_ak
  // (its tile is overwritten by T A_ak below).
  scale_rows_by_exp<T, KP>(sa, L::ldk, sG, L::ldg, [](int, int, const float(&)[8]) {});
  if (x.Akg != nullptr)
    for (int idx = tid; idx < kDRows * 8; idx += kDThreads) {
      const int i = idx >> 3, j0 = 8 * (idx & 7);
      float ak[8];
      load8(Ak + i * L::ld64 + j0, ak);
      store8(x.Akg + mat0 + i * kDRows + j0, ak);
    }
  __syncthreads();  // a e^Gp

  // W = T (a e^Gp): warp w owns rows [16 w, 16 w + 16), 64 columns at a time; T's row block w is zero right of
  // column 16 (w + 1).
  const int kend = 16 * (warp + 1);
#pragma unroll 1
  for (int n0 = 0; n0 < KP; n0 += 64) {
    float acc[1][8][4];
    zero_acc(acc);
    warp_mma<T, 1, 8, Lay::rowmajor, Lay::rowmajor>(acc, Tt, L::ld64, 16 * warp, sa, L::ldk, n0, 0, kend);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int i = 16 * warp + acc_row(0, e), d = n0 + acc_col(nt, e);
        if (i < len) store_pair(x.W + ((ch.row0 + i) * x.H + h) * KP + d, acc[0][nt][e], acc[0][nt][e + 1]);
      }
  }
  // T A_ak (strictly lower, as A_ak), into A_ak's tile once every warp has read it.
  {
    float acc[1][8][4];
    zero_acc(acc);
    warp_mma<T, 1, 8, Lay::rowmajor, Lay::rowmajor>(acc, Tt, L::ld64, 16 * warp, Ak, L::ld64, 0, 0, kend);
    __syncthreads();
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2)
        store_pair(Ak + (16 * warp + acc_row(0, e)) * L::ld64 + acc_col(nt, e), acc[0][nt][e], acc[0][nt][e + 1]);
  }
  // U = (T A_ak) V, 32 value columns at a time.
#pragma unroll 1
  for (int v0 = 0; v0 < x.VP; v0 += kDBV) {
    if (v0 > 0) {
      load_tile<T, kDThreads>(Vt, L::ldv, pv + v0, x.v.st, len, kDRows, static_cast<int>(x.V) - v0, kDBV,
                              vec_ok(pv + v0, x.v.st));
      cp_async_commit();
    }
    cp_async_wait<0>();
    __syncthreads();
    float acc[1][4][4];
    zero_acc(acc);
    warp_mma<T, 1, 4, Lay::rowmajor, Lay::rowmajor>(acc, Ak, L::ld64, 16 * warp, Vt, L::ldv, 0, 0, kend);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int i = 16 * warp + acc_row(0, e), c = v0 + acc_col(nt, e);
        if (i < len) store_pair(x.U + ((ch.row0 + i) * x.H + h) * x.VP + c, acc[0][nt][e], acc[0][nt][e + 1]);
      }
    __syncthreads();
  }
}

// ---- stage 2: the state scan --------------------------------------------------------------------------------
// The chunk fields the scans read, and the copies of one chunk's per-chunk tiles into a stage of the scan's shared
// memory (one cp.async group; the caller waits).
struct ScanChunk {
  int64_t batch, t0, row0;
  int len;
};
__device__ __forceinline__ ScanChunk scan_chunk(const ChunkEntry* chunks, int64_t c) {
  const ChunkEntry& e = chunks[c];
  return ScanChunk{e.batch, e.t0, e.row0, static_cast<int>(e.len)};
}

// The scans' warps (NW = 4 or 8; dplr_scan_warps): which part of the state and of the chunk's 64 rows each warp
// owns. The state's KP x BV block: KP / 16 row tiles of 16 when NW = 8 and KP = 128 (one per warp), else four row
// groups of KP / 4 rows, times NW / 4 column groups. The chunk's 64 x BV low-rank read-outs (Ut, dUt): four row
// blocks of 16 tokens, times two column halves when NW = 8 and BV = 32; with NW = 8 and BV = 16 only warps 0-3
// make them (a half of 16 columns would be one 8-column tile), and warps 4-7 make the state's part that does not
// wait for them meanwhile. Every element's products run over the same k-steps in the same order for either NW,
// so both give the same bits.
template <int NW, int KP, int BV>
struct ScanWarps {
  static_assert(NW == 4 || NW == 8, "the scans run 4 or 8 warps");
  static constexpr int kThreads = 32 * NW;
  static constexpr int kRowGroups = (NW == 8 && KP == 128) ? 8 : 4;
  static constexpr int kColGroups = NW / kRowGroups;
  static constexpr int MT = KP / (16 * kRowGroups);  // 16-row tiles of the state per warp
  static constexpr int NT = BV / (8 * kColGroups);   // 8-column tiles of the state per warp
  static constexpr int kUtCols = (NW == 8 && BV == 32) ? 2 : 1;
  static constexpr int kUtWarps = 4 * kUtCols;
  static constexpr int NTU = BV / (8 * kUtCols);     // 8-column tiles of the read-outs per warp
  __device__ static int m0(int warp) { return (warp % kRowGroups) * (KP / kRowGroups); }
  __device__ static int c0(int warp) { return (warp / kRowGroups) * (BV / kColGroups); }
  __device__ static int u0(int warp) { return (warp / 4) * (BV / kUtCols); }
};

// The forward scan, NW warps (ScanWarps). Per chunk: S to shared memory (and h_c out); then, after one barrier,
// Ut = U + W S, and meanwhile S <- D_n S + Kd^T V (neither reads the other's result); after a second barrier,
// S += Bd^T Ut. With two stages the next chunk's copies are issued right after the first barrier: every warp has
// then finished the previous chunk, the last reader of the stage they overwrite, so a chunk takes two barriers
// (three before: the copies went out at the top, and a barrier at the end kept them off the stage still being
// read). With one stage the copies go out at the top and the chunk ends with that third barrier.
template <class T, int KP, int BV, int NW>
__global__ void __launch_bounds__(32 * NW) dplr_scan_kernel(const DplrArgs<T> x) {
  using L = ScanSmem<T, KP, BV>;
  using Wp = ScanWarps<NW, KP, BV>;
  constexpr int MT = Wp::MT, NT = Wp::NT, NTU = Wp::NTU, kThreads = Wp::kThreads;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sUt = smem_at<T>(smem, L::Ut);
  T* sS = smem_at<T>(smem, L::S);

  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t nh = blockIdx.x, n = nh / x.H, h = nh - n * x.H;
  const int v0 = blockIdx.y * BV;
  const int m0 = Wp::m0(warp), c0 = Wp::c0(warp);  // this warp's first state row and column (within the block)
  const int t0 = 16 * (warp & 3), u0 = Wp::u0(warp);  // and its read-outs' first token row and column
  const bool makes_ut = warp < Wp::kUtWarps;
  const SeqEntry seq = x.seqs[n];
  const int64_t state0 = (n * x.H + h) * x.K * x.V;
  const int64_t ldk_g = x.H * KP, ldv_g = x.H * x.VP;

  // Chunk ci's W, Kd, Bd, U, V tiles and D_n into stage `st` (cp.async, one group).
  auto issue = [&](const ScanChunk& ch, int64_t c, int st) {
    unsigned char* base = smem + st * L::stage;
    const int64_t wrow = ch.row0 * x.H + h;
    load_key_rows<T, KP, kThreads>(smem_at<T>(base, L::W), L::ldk, x.W, wrow, ldk_g, ch.len);
    load_key_rows<T, KP, kThreads>(smem_at<T>(base, L::Kd), L::ldk, x.Kd, wrow, ldk_g, ch.len);
    load_key_rows<T, KP, kThreads>(smem_at<T>(base, L::Bd), L::ldk, x.Bd, wrow, ldk_g, ch.len);
    load_tile<T, kThreads>(smem_at<T>(base, L::U), L::ldv, x.U + wrow * x.VP + v0, ldv_g, ch.len, kDRows, BV, BV,
                           vec_ok(x.U + wrow * x.VP + v0, ldv_g));
    const T* pv = x.v.at(ch.batch, ch.t0, h) + v0;
    load_tile<T, kThreads>(smem_at<T>(base, L::V), L::ldv, pv, x.v.st, ch.len, kDRows, static_cast<int>(x.V) - v0,
                           BV, vec_ok(pv, x.v.st));
    const float* pdn = x.Dn + (c * x.H + h) * KP;
    load_tile<float, kThreads>(smem_at<float>(base, L::Dn), KP, pdn, KP, 1, 1, KP, KP, vec_ok(pdn, KP));
    cp_async_commit();
  };

  float S[MT][NT][4];
  load_acc(S, x.h0 == nullptr ? nullptr : x.h0 + state0 + v0 + c0, x.V, m0, static_cast<int>(x.K),
           static_cast<int>(x.V) - v0 - c0);

  // The chunk fields run one chunk ahead of the copies (a register load in flight during a chunk's work).
  ScanChunk cur{}, nxt{};
  if (seq.num_chunks > 0) cur = scan_chunk(x.chunks, seq.first_chunk);
  if (seq.num_chunks > 1) nxt = scan_chunk(x.chunks, seq.first_chunk + 1);
  if (L::kStages == 2 && seq.num_chunks > 0) issue(cur, seq.first_chunk, 0);
#pragma unroll 1
  for (int64_t ci = 0; ci < seq.num_chunks; ++ci) {
    const int64_t c = seq.first_chunk + ci;
    const int st = L::kStages == 2 ? static_cast<int>(ci & 1) : 0;
    const bool more = ci + 1 < seq.num_chunks;
    ScanChunk after{};
    if (ci + 2 < seq.num_chunks) after = scan_chunk(x.chunks, c + 2);
    if (L::kStages == 1) issue(cur, c, 0);
    unsigned char* base = smem + st * L::stage;
    const T* sW = smem_at<T>(base, L::W);
    const T* sKd = smem_at<T>(base, L::Kd);
    const T* sBd = smem_at<T>(base, L::Bd);
    const T* sU = smem_at<T>(base, L::U);
    const T* sV = smem_at<T>(base, L::V);
    const float* sDn = smem_at<float>(base, L::Dn);
    const int len = cur.len;
    const int64_t wrow = (cur.row0 * x.H + h);
    // The chunk-start state: a T operand in shared memory, and h_c in the workspace (for the output stage and
    // the backward; a final-state-only run, the CP pre-pass's maps, keeps none: x.h null).
    T* hc = x.h == nullptr ? nullptr : x.h + (c * x.H + h) * KP * x.VP + v0 + c0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int r = m0 + acc_row(mt, e), col = acc_col(nt, e);
          store_pair(sS + r * L::ldv + c0 + col, S[mt][nt][e], S[mt][nt][e + 1]);
          if (hc != nullptr) store_pair(hc + int64_t(r) * x.VP + col, S[mt][nt][e], S[mt][nt][e + 1]);
        }
    cp_async_wait<0>();  // chunk ci's group (the only one in flight)
    __syncthreads();
    if (L::kStages == 2 && more) issue(nxt, c + 1, st ^ 1);

    // Ut = U + W S: rows [t0, t0 + 16), columns [u0, u0 + 8 NTU).
    if (makes_ut) {
      float acc[1][NTU][4];
#pragma unroll
      for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][nt][e] = to_f(sU[(t0 + acc_row(0, e)) * L::ldv + u0 + acc_col(nt, e)]);
      warp_mma<T, 1, NTU, Lay::rowmajor, Lay::rowmajor>(acc, sW, L::ldk, t0, sS, L::ldv, u0, 0, KP);
      T* ut = x.Ut == nullptr ? nullptr : x.Ut + wrow * x.VP + v0 + u0;  // null: final-state-only, as h
#pragma unroll
      for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int i = t0 + acc_row(0, e), col = acc_col(nt, e);
          store_pair(sUt + i * L::ldv + u0 + col, acc[0][nt][e], acc[0][nt][e + 1]);
          if (ut != nullptr && i < len) store_pair(ut + int64_t(i) * ldv_g + col, acc[0][nt][e], acc[0][nt][e + 1]);
        }
    }
    // S <- D_n S + Kd^T V (Kd read as [key, token]: a column-major A operand), beside Ut.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[mt][nt][e] *= sDn[m0 + acc_row(mt, e)];
    warp_mma<T, MT, NT, Lay::colmajor, Lay::rowmajor>(S, sKd, L::ldk, m0, sV, L::ldv, c0, 0, kDRows);
    __syncthreads();  // Ut

    // S += Bd^T Ut.
    warp_mma<T, MT, NT, Lay::colmajor, Lay::rowmajor>(S, sBd, L::ldk, m0, sUt, L::ldv, c0, 0, kDRows);
    if (L::kStages == 1) __syncthreads();  // the next chunk's copies overwrite this stage at the top
    cur = nxt;
    nxt = after;
  }
  if (x.ht != nullptr)
    store_acc(S, x.ht + state0 + v0 + c0, x.V, m0, static_cast<int>(x.K), static_cast<int>(x.V) - v0 - c0);
}

// ---- stage 3: the output -------------------------------------------------------------------------------------
template <class T, int KP>
__global__ void __launch_bounds__(kDThreads) dplr_output_kernel(const DplrArgs<T> x) {
  using L = OutSmem<T, KP>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sq = smem_at<T>(smem, L::q);
  T* sk = smem_at<T>(smem, L::k);
  T* sb = smem_at<T>(smem, L::b);
  float* sG = smem_at<float>(smem, L::G);
  T* Xr = smem_at<T>(smem, L::scratch);
  T* Yr = Xr + 16 * L::ldk;
  T* Pk = smem_at<T>(smem, L::Pk);
  T* Pb = smem_at<T>(smem, L::Pb);
  T* sh = smem_at<T>(smem, L::hS);
  T* sv = smem_at<T>(smem, L::vS);
  T* sut = smem_at<T>(smem, L::utS);

  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t c = blockIdx.x;
  const ChunkEntry ch = x.chunks[c];
  const int64_t h = blockIdx.y;
  const int len = static_cast<int>(ch.len);
  const int K = static_cast<int>(x.K);
  const int64_t wrow = ch.row0 * x.H + h;
  const bool with_o = x.o.ptr != nullptr;  // false: the backward's preparation (q e^G, P_qb; P_qk when x.Pk)
  const bool need_pk = with_o || x.Pk != nullptr;
  const T* pk = x.k.at(ch.batch, ch.t0, h);
  const T* pb = x.b.at(ch.batch, ch.t0, h);
  {
    const T* pq = x.q.at(ch.batch, ch.t0, h);
    load_tile<T, kDThreads>(sq, L::ldk, pq, x.q.st, len, kDRows, K, KP, vec_ok(pq, x.q.st));
    if (need_pk) load_tile<T, kDThreads>(sk, L::ldk, pk, x.k.st, len, kDRows, K, KP, vec_ok(pk, x.k.st));
    if (!L::kShareKB || !need_pk)
      load_tile<T, kDThreads>(sb, L::ldk, pb, x.b.st, len, kDRows, K, KP, vec_ok(pb, x.b.st));
    // G (the WY stage's, fp32 [R, H, KP]) by cp.async; rows past len repeat G_{len-1} (finite exponents on the
    // zero rows).
    load_key_gate(sG, L::ldg, x.G, ch.row0, x.H, h, KP, KP, len);
    cp_async_commit();
    for (int idx = tid; idx < kDRows * 8; idx += kDThreads) {  // the blocks above the block diagonal: zero
      const int i = idx >> 3, j0 = 8 * (idx & 7);                // (the scores write every other block)
      if ((j0 >> 4) > (i >> 4)) {
        const float z[8] = {};
        store8(Pk + i * L::ld64 + j0, z);
        store8(Pb + i * L::ld64 + j0, z);
      }
    }
    cp_async_wait<0>();
    __syncthreads();
  }
  // The scores (Gl = Gr = G: kda's case; bf16's diagonal blocks on the tensor cores where their decay allows).
  if (need_pk) {
    dplr_scores<T, kDThreads>(sq, sk, L::ldk, sG, sG, L::ldg, Xr, Yr, KP, len, true,
                              [&](int i, int j, float val) { Pk[i * L::ld64 + j] = from_f<T>(val); });
    if (L::kShareKB) {  // b over k (the scores end with __syncthreads)
      load_tile<T, kDThreads>(sb, L::ldk, pb, x.b.st, len, kDRows, K, KP, vec_ok(pb, x.b.st));
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
    }
  }
  dplr_scores<T, kDThreads>(sq, sb, L::ldk, sG, sG, L::ldg, Xr, Yr, KP, len, true,
                            [&](int i, int j, float val) { Pb[i * L::ld64 + j] = from_f<T>(val); });
  // q e^G in place, eight keys per thread.
  scale_rows_by_exp<T, KP>(sq, L::ldk, sG, L::ldg, [&](int i, int d0, const float(&qv)[8]) {
    if (x.QG != nullptr && i < len) store8(x.QG + (wrow + int64_t(i) * x.H) * KP + d0, qv);
  });
  const int64_t mat0 = (c * x.H + h) * kDRows * kDRows;
  if (x.Pb != nullptr || x.Pk != nullptr)  // the backward
    for (int idx = tid; idx < kDRows * 8; idx += kDThreads) {
      const int i = idx >> 3, j0 = 8 * (idx & 7);
      float pv[8];
      if (x.Pb != nullptr) {
        load8(Pb + i * L::ld64 + j0, pv);
        store8(x.Pb + mat0 + i * kDRows + j0, pv);
      }
      if (x.Pk != nullptr) {
        load8(Pk + i * L::ld64 + j0, pv);
        store8(x.Pk + mat0 + i * kDRows + j0, pv);
      }
    }
  if (!with_o) return;  // uniform over the CTA
  __syncthreads();

  const T* hc = x.h + (c * x.H + h) * KP * x.VP;
  const T* pv = x.v.at(ch.batch, ch.t0, h);
  const T* put = x.Ut + wrow * x.VP;
  const int64_t ldk_g = x.H * KP, ldv_g = x.H * x.VP;
  constexpr int BV = L::kBV, NT = BV / 8;
#pragma unroll 1
  for (int v0 = 0; v0 < x.VP; v0 += BV) {
    const int cols = min(BV, x.VP - v0);  // h and Ut have VP columns; V's past x.V are zero
    load_tile<T, kDThreads>(sh, L::ldv, hc + v0, x.VP, KP, KP, cols, BV, vec_ok(hc + v0, x.VP));
    load_tile<T, kDThreads>(sv, L::ldv, pv + v0, x.v.st, len, kDRows, static_cast<int>(x.V) - v0, BV,
                            vec_ok(pv + v0, x.v.st));
    load_tile<T, kDThreads>(sut, L::ldv, put + v0, ldv_g, len, kDRows, cols, BV, vec_ok(put + v0, ldv_g));
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    float acc[1][NT][4];
    zero_acc(acc);
    warp_mma<T, 1, NT, Lay::rowmajor, Lay::rowmajor>(acc, sq, L::ldk, 16 * warp, sh, L::ldv, 0, 0, KP);
    // P_qk, P_qb: row block w is zero right of column 16 (w + 1)
    warp_mma<T, 1, NT, Lay::rowmajor, Lay::rowmajor>(acc, Pk, L::ld64, 16 * warp, sv, L::ldv, 0, 0, 16 * (warp + 1));
    warp_mma<T, 1, NT, Lay::rowmajor, Lay::rowmajor>(acc, Pb, L::ld64, 16 * warp, sut, L::ldv, 0, 0, 16 * (warp + 1));
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + acc_row(0, e), col = v0 + acc_col(nt, e);
        if (i < len && col < x.V) store_f(x.o.at(ch.batch, ch.t0 + i, h) + col, x.scale * acc[0][nt][e]);
      }
    __syncthreads();
  }
}

// ---- the reverse state-gradient scan (the dh0-only backward, and stage 4 of the full one) ---------------------
// With dS = dL/dS at a chunk's end (dht at the sequence's end), the chunk form's backward (chunk_backward in
// reference/src/chunked.cpp) gives the gradient at the chunk's start as
//   dUt = P_qb^T (scale dO) + Bd dS          (dL/dUt, the low-rank read-outs)
//   dS' = D_n dS + (q e^G)^T (scale dO) + W^T dUt
// and dh0 is dS' of a sequence's first chunk. The mirror of dplr_scan_kernel: BV columns of dS (32, or 16) in fp32
// registers, sequential over the chunks from the last; W, Bd, D_n from the WY stage, q e^G and P_qb from the
// output stage run without o. Alone it is the dh0-only backward (the CP backward pre-pass); in the full backward
// (dplr_bwd.cu) it also keeps dS at each chunk's end (x.dh) and dUt (x.dUt) for the chunk-parallel stages.
template <class T, int KP, int BV = kDBV>
struct Dh0Smem {
  static constexpr int ldk = tile_ld<T>(KP), ld64 = tile_ld<T>(64), ldv = tile_ld<T>(BV);
  static constexpr int64_t tileK = align16(int64_t(kDRows) * ldk * sizeof(T));
  static constexpr int64_t tileV = align16(int64_t(kDRows) * ldv * sizeof(T));
  static constexpr int64_t W = 0, Bd = W + tileK, QG = Bd + tileK;  // offsets within a stage
  static constexpr int64_t P = QG + tileK;
  static constexpr int64_t dO = P + align16(int64_t(kDRows) * ld64 * sizeof(T));
  static constexpr int64_t Dn = dO + tileV;
  static constexpr int64_t stage = Dn + align16(int64_t(KP) * 4);
  static constexpr int64_t tail = tileV + align16(int64_t(KP) * ldv * sizeof(T));  // dUt, S
  static constexpr int kStages = 2 * stage + tail <= dplr_smem_budget<T, KP>() ? 2 : 1;
  static constexpr int64_t dUt = kStages * stage, S = dUt + tileV;
  static constexpr int64_t bytes = S + align16(int64_t(KP) * ldv * sizeof(T));
};

// The reverse scan, NW warps (ScanWarps, as the forward scan). Per chunk: dS to shared memory (and dh_c out);
// after one barrier, dO scaled in place; after a second, dUt = P_qb^T (scale dO) + Bd dS, and meanwhile
// dS <- D_n dS + (q e^G)^T (scale dO); after a third, dS += W^T dUt. The next chunk's copies go out after the
// first barrier, as in the forward scan.
template <class T, int KP, int BV, int NW>
__global__ void __launch_bounds__(32 * NW) dplr_dh0_scan_kernel(const DplrArgs<T> x) {
  using L = Dh0Smem<T, KP, BV>;
  using Wp = ScanWarps<NW, KP, BV>;
  constexpr int MT = Wp::MT, NT = Wp::NT, NTU = Wp::NTU, kThreads = Wp::kThreads;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sdUt = smem_at<T>(smem, L::dUt);
  T* sS = smem_at<T>(smem, L::S);

  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t nh = blockIdx.x, n = nh / x.H, h = nh - n * x.H;
  const int v0 = blockIdx.y * BV;
  const int m0 = Wp::m0(warp), c0 = Wp::c0(warp);
  const int t0 = 16 * (warp & 3), u0 = Wp::u0(warp);
  const bool makes_ut = warp < Wp::kUtWarps;
  const SeqEntry seq = x.seqs[n];
  const int64_t state0 = (n * x.H + h) * x.K * x.V;
  const int K = static_cast<int>(x.K), Vleft = static_cast<int>(x.V) - v0;
  const int64_t ldk_g = x.H * KP;

  // Chunk c's W, Bd, q e^G, P_qb, dO tiles and D_n into stage `st` (cp.async, one group).
  auto issue = [&](const ScanChunk& ch, int64_t c, int st) {
    unsigned char* base = smem + st * L::stage;
    const int64_t wrow = ch.row0 * x.H + h;
    load_key_rows<T, KP, kThreads>(smem_at<T>(base, L::W), L::ldk, x.W, wrow, ldk_g, ch.len);
    load_key_rows<T, KP, kThreads>(smem_at<T>(base, L::Bd), L::ldk, x.Bd, wrow, ldk_g, ch.len);
    load_key_rows<T, KP, kThreads>(smem_at<T>(base, L::QG), L::ldk, x.QG, wrow, ldk_g, ch.len);
    const T* pP = x.Pb + (c * x.H + h) * kDRows * kDRows;
    load_tile<T, kThreads>(smem_at<T>(base, L::P), L::ld64, pP, kDRows, kDRows, kDRows, kDRows, kDRows,
                           vec_ok(pP, kDRows));
    const T* pdo = x.dout.at(ch.batch, ch.t0, h) + v0;
    load_tile<T, kThreads>(smem_at<T>(base, L::dO), L::ldv, pdo, x.dout.st, ch.len, kDRows, Vleft, BV,
                           vec_ok(pdo, x.dout.st));
    const float* pdn = x.Dn + (c * x.H + h) * KP;
    load_tile<float, kThreads>(smem_at<float>(base, L::Dn), KP, pdn, KP, 1, 1, KP, KP, vec_ok(pdn, KP));
    cp_async_commit();
  };

  float S[MT][NT][4];  // dL/dS: this warp's rows from m0, columns from v0 + c0
  load_acc(S, x.dht == nullptr ? nullptr : x.dht + state0 + v0 + c0, x.V, m0, K, Vleft - c0);

  // From the last chunk back; two stages as in dplr_scan_kernel (the next chunk down in flight).
  const int64_t last = seq.first_chunk + seq.num_chunks - 1;
  ScanChunk cur{}, nxt{};
  if (seq.num_chunks > 0) cur = scan_chunk(x.chunks, last);
  if (seq.num_chunks > 1) nxt = scan_chunk(x.chunks, last - 1);
  if (L::kStages == 2 && seq.num_chunks > 0) issue(cur, last, 0);
#pragma unroll 1
  for (int64_t k = 0; k < seq.num_chunks; ++k) {
    const int64_t c = last - k;
    const int st = L::kStages == 2 ? static_cast<int>(k & 1) : 0;
    const bool more = k + 1 < seq.num_chunks;
    ScanChunk after{};
    if (k + 2 < seq.num_chunks) after = scan_chunk(x.chunks, c - 2);
    if (L::kStages == 1) issue(cur, c, 0);
    unsigned char* base = smem + st * L::stage;
    const T* sW = smem_at<T>(base, L::W);
    const T* sBd = smem_at<T>(base, L::Bd);
    const T* sQG = smem_at<T>(base, L::QG);
    const T* sP = smem_at<T>(base, L::P);
    T* sdO = smem_at<T>(base, L::dO);
    const float* sDn = smem_at<float>(base, L::Dn);
    const int len = cur.len;
    const int64_t wrow = cur.row0 * x.H + h;
    // dS at the chunk's end: a T operand in shared memory and, for the full backward, dh_c in the workspace.
    T* dhc = x.dh == nullptr ? nullptr : x.dh + (c * x.H + h) * KP * x.VP + v0 + c0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int r = m0 + acc_row(mt, e), col = acc_col(nt, e);
          store_pair(sS + r * L::ldv + c0 + col, S[mt][nt][e], S[mt][nt][e + 1]);
          if (dhc != nullptr) store_pair(dhc + int64_t(r) * x.VP + col, S[mt][nt][e], S[mt][nt][e + 1]);
        }
    cp_async_wait<0>();  // this chunk's group (the only one in flight)
    __syncthreads();
    if (L::kStages == 2 && more) issue(nxt, c - 1, st ^ 1);
    for (int idx = tid; idx < kDRows * BV; idx += kThreads) {  // scale dO, in place
      T* e = sdO + (idx / BV) * L::ldv + (idx % BV);
      *e = from_f<T>(x.scale * to_f(*e));
    }
    __syncthreads();

    // dUt = P_qb^T (scale dO) + Bd dS: rows [t0, t0 + 16), columns [u0, u0 + 8 NTU) (P_qb read as [j, i]:
    // column-major).
    if (makes_ut) {
      float acc[1][NTU][4];
      zero_acc(acc);
      warp_mma<T, 1, NTU, Lay::colmajor, Lay::rowmajor>(acc, sP, L::ld64, t0, sdO, L::ldv, u0, 0, kDRows);
      warp_mma<T, 1, NTU, Lay::rowmajor, Lay::rowmajor>(acc, sBd, L::ldk, t0, sS, L::ldv, u0, 0, KP);
      T* dut = x.dUt == nullptr ? nullptr : x.dUt + wrow * x.VP + v0 + u0;  // the full backward keeps dUt
#pragma unroll
      for (int nt = 0; nt < NTU; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int i = t0 + acc_row(0, e), col = acc_col(nt, e);
          store_pair(sdUt + i * L::ldv + u0 + col, acc[0][nt][e], acc[0][nt][e + 1]);
          if (dut != nullptr && i < len)
            store_pair(dut + int64_t(i) * x.H * x.VP + col, acc[0][nt][e], acc[0][nt][e + 1]);
        }
    }
    // dS <- D_n dS + (q e^G)^T (scale dO), beside dUt.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[mt][nt][e] *= sDn[m0 + acc_row(mt, e)];
    warp_mma<T, MT, NT, Lay::colmajor, Lay::rowmajor>(S, sQG, L::ldk, m0, sdO, L::ldv, c0, 0, kDRows);
    __syncthreads();  // dUt

    // dS += W^T dUt.
    warp_mma<T, MT, NT, Lay::colmajor, Lay::rowmajor>(S, sW, L::ldk, m0, sdUt, L::ldv, c0, 0, kDRows);
    if (L::kStages == 1) __syncthreads();  // the next chunk's copies overwrite this stage at the top
    cur = nxt;
    nxt = after;
  }
  if (x.dh0 != nullptr) store_acc(S, x.dh0 + state0 + v0 + c0, x.V, m0, K, Vleft - c0);
}

// ---- the full backward's local stages (dplr_bwd.cu): shared-memory layouts ----------------------------------
constexpr int kDKB = 32;  // key columns per CTA of dplr_bwd_dk_kernel

// dplr_bwd_dv_kernel: T, A_ak, P_qk and Kd whole; per 32-column value block dUt, T^T dUt, dO, V, Ut (64 rows)
// and dS (KP rows).
template <class T, int KP>
struct BdvSmem {
  static constexpr int ldk = tile_ld<T>(KP), ld64 = tile_ld<T>(64), ldv = tile_ld<T>(kDBV);
  static constexpr int64_t tile64 = align16(int64_t(kDRows) * ld64 * sizeof(T));
  static constexpr int64_t tileV = align16(int64_t(kDRows) * ldv * sizeof(T));
  static constexpr int64_t Tt = 0, Ak = Tt + tile64, Pk = Ak + tile64;
  static constexpr int64_t Kd = Pk + tile64;
  static constexpr int64_t dUt = Kd + align16(int64_t(kDRows) * ldk * sizeof(T));
  static constexpr int64_t dUtp = dUt + tileV, dO = dUtp + tileV, V = dO + tileV, Ut = V + tileV;
  static constexpr int64_t dS = Ut + tileV;
  static constexpr int64_t bytes = dS + align16(int64_t(KP) * ldv * sizeof(T));
};

// dplr_bwd_dk_kernel, one CTA per (chunk, head, 32 key columns), laid out for three CTAs per H100 / H200 SM at 16
// bits (73,616 bytes; the previous layout's 94,096 held two):
//   qa         the q columns, then (once the q scores' gradients are done and dq is out) the a columns
//   k, b       the k and b columns
//   G          65 rows fp32: row 0 = 0, row i + 1 = G_i (so row i = Gp_i)
//   dqa        fp32 dq, then da (its first term kept in registers until dq is out); dk, db fp32
//   region     the key phase: two score gradients (the q pair, then the a pair), each stored as its lower block
//              triangle only (block row a, a = 0..3: 16 rows of 16 (a + 1) columns, padded), then a scratch tile and
//              the second score's 48 scaled rows (dplr_gram_backward_pair)
// The value phase runs over 16-column value blocks in two stages of tiles (dO, T^T dUt, V, Ut: 64 rows; S, dS:
// 32 rows), the first over the region, the second over dq, dk, db (written only after the last block, which is
// always an odd one: VP is a multiple of 32), so the next block's copies are in flight during this block's
// products and the first pair of score gradients during the last block's.
template <class T>
struct BdkSmem {
  static constexpr int ldx = tile_ld<T>(kDKB), ldf = kDKB + 4, ldg = gate_ld(kDKB);
  static constexpr int kVB = 16;  // value columns per block of the value phase
  static constexpr int ldv = tile_ld<T>(kVB);
  static constexpr int64_t tileX = align16(int64_t(kDRows) * ldx * sizeof(T));
  static constexpr int64_t tileF = align16(int64_t(kDRows) * ldf * 4);
  static constexpr int64_t q = 0, a = q, k = q + tileX, b = k + tileX;
  static constexpr int64_t G = b + tileX;
  static constexpr int64_t dq = G + align16(int64_t(kDRows + 1) * ldg * 4), da = dq;
  static constexpr int64_t dk = dq + tileF, db = dk + tileF;
  static constexpr int64_t region = db + tileF;
  // a score gradient's lower block triangle: block row r16 (0..3) has 16 (r16 + 1) columns, leading dimension
  // dm_ld (16-byte rows, ldmatrix rows in distinct bank groups), element offset dm_off
  __host__ __device__ static constexpr int dm_ld(int r16) { return 16 * (r16 + 1) + (kIs16Bit<T> ? 8 : 4); }
  __host__ __device__ static constexpr int dm_off(int r16) {  // 16 * sum of dm_ld over the block rows above
    return 128 * r16 * (r16 + 1) + 16 * (kIs16Bit<T> ? 8 : 4) * r16;
  }
  static constexpr int64_t tileM = align16(int64_t(dm_off(4)) * sizeof(T));
  // value phase (offsets within a stage)
  static constexpr int64_t tileV = align16(int64_t(kDRows) * ldv * sizeof(T));
  static constexpr int64_t tileS = align16(int64_t(kDKB) * ldv * sizeof(T));
  static constexpr int64_t vdO = 0, vdUtp = vdO + tileV, vV = vdUtp + tileV, vUt = vV + tileV;
  static constexpr int64_t vS = vUt + tileV, vdS = vS + tileS, vstage = vdS + tileS;
  static constexpr int64_t vA = region, vB = dq;  // the stages' bases
  static_assert(vB + vstage <= region, "the second value stage must fit over dq, dk, db");
  static constexpr int64_t dO = region + vdO, dUtp = region + vdUtp, V = region + vV, Ut = region + vUt;
  static constexpr int64_t S = region + vS, dS = region + vdS;
  static constexpr int64_t value_end = region + vstage;
  // key phase
  static constexpr int64_t dM = region;  // 2 tiles: dM_qk, dM_qb, then dA_ab, dA_ak
  static constexpr int64_t scr = dM + 2 * tileM;
  static constexpr int64_t scr2 = scr + tileX;  // 48 rows: the second score's scaled Y rows
  static constexpr int64_t key_end = scr2 + align16(int64_t(48) * ldx * sizeof(T));
  static constexpr int64_t bytes = value_end > key_end ? value_end : key_end;
};

// ---- host ------------------------------------------------------------------------------------------------------
template <class Kernel>
void dplr_prepare_smem(Kernel kernel, int64_t bytes, const Params& p, const char* stage) {
  opt_in_smem(kernel, bytes, "K", "the tiled DPLR ", stage, " needs ", bytes, " bytes of shared memory for K = ", p.K,
              " and dtype ", to_string(p.dtype), " (use the naive tier, or 16-bit inputs)");
}

// One stage: its shared memory checked and opted into (dplr_prepare_smem), then launched with kDThreads threads
// (the scans: ScanWarps' count).
template <class Kernel, class Args>
void dplr_launch(Kernel kernel, int64_t bytes, dim3 grid, const Params& p, const char* stage, cudaStream_t stream,
                 const Args& x, int threads = kDThreads) {
  dplr_prepare_smem(kernel, bytes, p, stage);
  kernel<<<grid, threads, static_cast<size_t>(bytes), stream>>>(x);
  DELTACP_CUDA_CHECK_LAUNCH();
}

// The scans' value-column block. Each CTA of a scan walks one sequence's chunks one after another for BV of the
// state's columns (the columns are independent given W, Kd, Bd, D_n: every product of the chunk step is per
// column block), so the grid is N * H * VP / BV CTAs. With 32 columns a few long sequences leave most SMs idle
// (N * H * VP / 32 = 64 CTAs at (1, 16384, 16, 128) on a 132-SM GPU); there the scans take 16 columns: twice the
// CTAs, each with half the products per chunk (its chain of chunks is the critical path), at the price of every
// CTA copying the chunk's W, Kd, Bd (and W, Bd, q e^G, P_qb) tiles, shared by twice as many CTAs through L2.
// Narrow where twice the 32-column grid still fits the GPU's resident CTA slots for the 32-column layout, and the
// 16-column layout fits this GPU's opt-in limit. `grids` scans of this size running side by side (the full
// backward's two, dplr_bwd.cu) count together: narrow only where twice all their 32-column CTAs fit.
inline bool dplr_scan_narrow(const Params& p, int VP, int64_t wide_bytes, int64_t narrow_bytes, int grids = 1) {
  const int64_t wide = p.num_seqs * p.H * (VP / kDBV);
  if (wide <= 0 || VP / 16 > 65535 || narrow_bytes > max_smem_optin()) return false;
  return 2 * grids * wide <= int64_t(sm_count()) * ctas_per_sm(static_cast<size_t>(wide_bytes));
}

// The scans' warps: 8 (ScanWarps) at K > 64, else 4. A scan's CTA walks its chain of chunks alone, and at K = 128
// the grids are small and their CTAs large (one per SM at (1, 16384, 16, 128)), so with four warps each SM
// sub-partition holds one warp of the chain and waits out every latency of it; eight halve each warp's products
// per chunk and give every sub-partition a second warp. Measured (H100, bf16, (1, 16384, 16, 128), kernel time
// per forward + backward): forward scans 1.65 -> 1.14 ms, reverse scan 1.18 -> 0.82 ms. At K = 64 two or three
// CTAs share an SM already and eight warps gained nothing ((4, 4096, 32, 64): forward scans 0.510 -> 0.515 ms,
// reverse 0.459 -> 0.528 ms), so unset keeps four there. DELTACP_TILED_DPLR_SCAN8 (common/kernel_switch.h):
// unset = as above, 0 = 4 warps, 1 = 8 or an Error where the layout does not apply: K <= 64 with 16-column blocks,
// where a warp's half of the state's columns would be one 8-column tile, below what the 16-bit products take.
inline int dplr_scan_warps(int KP, int BV) {
  const auto why_not = [&]() -> const char* {
    return (KP <= 64 && BV < 32) ? "K <= 64 with 16-column state blocks (few sequences and heads)" : nullptr;
  };
  return kernel_switch("DELTACP_TILED_DPLR_SCAN8", "the 8-warp DPLR scans", why_not, /*unset_on=*/KP > 64) ? 8 : 4;
}

// Launches a scan kernel template Kernel<BV, NW> (a generic lambda taking the two as integral constants) with the
// column block from dplr_scan_narrow and the warps from dplr_scan_warps (never 8 warps on 16 columns at K <= 64).
template <int KP, class Smem16, class Smem32, class Launch>
void dplr_launch_scan_kernel(const Params& p, int VP, int grids, Launch launch) {
  using std::integral_constant;
  const bool narrow = dplr_scan_narrow(p, VP, Smem32::bytes, Smem16::bytes, grids);
  const bool eight = dplr_scan_warps(KP, narrow ? 16 : kDBV) == 8;
  if (narrow) {
    if constexpr (KP > 64) {
      if (eight) return launch(integral_constant<int, 16>{}, integral_constant<int, 8>{});
    }
    launch(integral_constant<int, 16>{}, integral_constant<int, 4>{});
  } else if (eight) {
    launch(integral_constant<int, kDBV>{}, integral_constant<int, 8>{});
  } else {
    launch(integral_constant<int, kDBV>{}, integral_constant<int, 4>{});
  }
}

// The forward state scan, grid (N * H, VP / BV) with BV from dplr_scan_narrow (`grids`: see there).
template <class T, int KP>
void dplr_launch_scan(const Params& p, int VP, cudaStream_t stream, const DplrArgs<T>& x, int grids = 1) {
  const unsigned nh = static_cast<unsigned>(p.num_seqs * p.H);
  dplr_launch_scan_kernel<KP, ScanSmem<T, KP, 16>, ScanSmem<T, KP, kDBV>>(p, VP, grids, [&](auto bv, auto nw) {
    constexpr int BV = decltype(bv)::value, NW = decltype(nw)::value;
    dplr_launch(dplr_scan_kernel<T, KP, BV, NW>, ScanSmem<T, KP, BV>::bytes,
                dim3(nh, static_cast<unsigned>(VP / BV)), p, "state scan", stream, x, 32 * NW);
  });
}
// The reverse state-gradient scan, the same way.
template <class T, int KP>
void dplr_launch_dh0_scan(const Params& p, int VP, const char* stage, cudaStream_t stream, const DplrArgs<T>& x,
                          int grids = 1) {
  const unsigned nh = static_cast<unsigned>(p.num_seqs * p.H);
  dplr_launch_scan_kernel<KP, Dh0Smem<T, KP, 16>, Dh0Smem<T, KP, kDBV>>(p, VP, grids, [&](auto bv, auto nw) {
    constexpr int BV = decltype(bv)::value, NW = decltype(nw)::value;
    dplr_launch(dplr_dh0_scan_kernel<T, KP, BV, NW>, Dh0Smem<T, KP, BV>::bytes,
                dim3(nh, static_cast<unsigned>(VP / BV)), p, stage, stream, x, 32 * NW);
  });
}

// The stages a run launches (DplrStage bits), each stage's shared memory against the GPU's opt-in limit, before
// anything is launched: a refusal (an Error naming K, the message of dplr_prepare_smem) leaves no partial work
// behind, and depends on the dtype, K and the GPU only (not on the sizes of the problem), so a caller that gets
// it may run the naive tier instead (deltacp.cp does, per rank).
enum DplrStage : unsigned {
  kDplrWy = 1u,
  kDplrScan = 2u,
  kDplrOut = 4u,
  kDplrDh0Scan = 8u,
  kDplrBwdDv = 16u,
  kDplrBwdDk = 32u,
};
template <class T, int KP>
void check_dplr_smem(const Params& p, unsigned stages) {
  const int limit = max_smem_optin();
  const struct {
    unsigned bit;
    const char* name;
    int64_t bytes;
  } table[] = {{kDplrWy, "WY stage", WySmem<T, KP>::bytes},
               {kDplrScan, "state scan", ScanSmem<T, KP>::bytes},
               {kDplrOut, "output stage", OutSmem<T, KP>::bytes},
               {kDplrDh0Scan, "reverse state-gradient scan", Dh0Smem<T, KP>::bytes},
               {kDplrBwdDv, "backward dv stage", BdvSmem<T, KP>::bytes},
               {kDplrBwdDk, "backward dk stage", BdkSmem<T>::bytes}};
  for (const auto& st : table)
    if ((stages & st.bit) != 0 && st.bytes > limit)
      ::deltacp::throw_error("K", "the tiled DPLR ", st.name, " needs ", st.bytes, " bytes of shared memory for K = ",
                             p.K, " and dtype ", to_string(p.dtype), " (use the naive tier, or 16-bit inputs)",
                             "; this GPU allows ", limit);
}

// Stream-ordered workspace buffers, freed on the stream when the forward returns.
class DplrWorkspace {
 public:
  explicit DplrWorkspace(cudaStream_t s) : stream_(s) {}
  ~DplrWorkspace() {
    for (void* p : ptrs_) workspace_free(p, stream_);
  }
  DplrWorkspace(const DplrWorkspace&) = delete;
  DplrWorkspace& operator=(const DplrWorkspace&) = delete;
  template <class E>
  E* get(int64_t elems) {
    if (elems <= 0) return nullptr;
    DELTACP_CHECK(n_ < 20, "workspace", "expected at most 20 tiled DPLR workspace buffers");
    void* p = workspace_alloc(static_cast<size_t>(elems) * sizeof(E), stream_);
    ptrs_[n_++] = p;
    return static_cast<E*>(p);
  }

 private:
  cudaStream_t stream_;
  void* ptrs_[20] = {};
  int n_ = 0;
};

inline void check_dplr_tiled(const Params& p) {
  DELTACP_CHECK(p.variant == Variant::dplr, "variant", "expected dplr for the tiled DPLR kernels, got ",
                to_string(p.variant));
  DELTACP_CHECK(p.K >= 1 && p.K <= 128, "K", "expected 1 <= K <= 128 for the tiled DPLR kernels, got ", p.K);
  DELTACP_CHECK(p.chunk_size >= 1 && p.chunk_size <= kDRows, "chunk_size",
                "expected 1 <= chunk_size <= 64 for the tiled DPLR kernels, got ", p.chunk_size);
  DELTACP_CHECK(p.V + kDBV <= 65535LL * kDBV, "V", "expected V < ", 65535LL * kDBV, ", got ", p.V);
}

// The inputs, sizes and chunk table of p in kernel arguments (the workspace is the caller's).
template <class T>
DplrArgs<T> dplr_args(const Params& p, const ChunkTable& table, int VP) {
  DplrArgs<T> x;
  x.q = dev_rows<const T>(p.q);
  x.k = dev_rows<const T>(p.k);
  x.v = dev_rows<const T>(p.v);
  x.a = dev_rows<const T>(p.a);
  x.b = dev_rows<const T>(p.b);
  x.gk = p.g.ptr;
  x.gk_sb = p.g.stride_b;
  x.gk_st = p.g.stride_t;
  x.gk_sh = p.g.stride_h;
  x.gk_fp32 = p.gate_dtype() == DType::f32;
  x.chunks = table.chunks();
  x.seqs = table.seqs();
  x.H = p.H;
  x.K = p.K;
  x.V = p.V;
  x.VP = VP;
  x.scale = static_cast<float>(p.scale);
  return x;
}

inline int dplr_vp(const Params& p) { return static_cast<int>((p.V + kDBV - 1) / kDBV * kDBV); }

inline void check_dplr_grid(const Params& p) {
  DELTACP_CHECK(p.H <= 65535, "H", "expected at most 65535 heads for the tiled DPLR tier, got ", p.H);
  DELTACP_CHECK(p.num_seqs * p.H <= 0x7fffffff, "num_seqs", "expected num_seqs * H < 2^31, got ",
                p.num_seqs * p.H);
}

}  // namespace
}  // namespace deltacp::cuda::tiled
