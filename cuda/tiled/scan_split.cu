// cuda/tiled/scan_split.cu — stage 3 of the tiled forward in pieces: the state scan when a few long
// sequences would leave most SMs idle.
//
// Why. The state scan (tiled_fwd.cu stage 3, scan_wgmma.cuh) walks a sequence's chunks one after another,
// one CTA per (sequence, value head, column tile). A chunk step takes about 2 us whichever kernel runs it
// (Nsight Compute: latency-bound, one warp per scheduler), so one 32K-token sequence with 16 heads is 512
// steps on 16-64 CTAs of an H200's 132 SMs: 1.05 ms, half of the whole forward. The CP pre-pass
// (docs/design.md section 4.2) already cuts a span into pieces whose affine maps are computed side by side.
// The same algebra inside one GPU, for a sequence cut into pieces j = 0 .. P-1 of whole chunks:
//
//   pass 1  pieces 0 .. P-2, each from [0 | I], final state only, a state V + K columns wide whose last K
//           columns see zero values: [H_j | M_j], so that a piece entered with S leaves with M_j S + H_j
//   fold    S_0 = h0 (or 0), S_{j+1} = M_j S_j + H_j, sequential over the pieces: fp32-accurate (split TF32
//           on the tensor cores, carry_tile)
//   pass 2  every piece from S_j (as one varlen scan over the pieces), storing h per chunk and v_new at the
//           chunk indices and rows of the whole sequence: the output stage reads them unchanged; the last
//           piece's final state is ht
//
// Every chunk is the one-piece scan's chunk, with the same products; a piece's start state differs from
// the one-piece scan's only by rounding: M_j is carried through the same 16-bit products as the state, and
// the fold rounds at fp32 level. Work: about three one-piece scans (pass 1 carries V + K columns), on
// (pieces x heads) CTAs instead of heads.
//
// When (plan_scan). DELTACP_TILED_SCAN_PIECE=<tokens> cuts every sequence longer than that into pieces of
// that many tokens (rounded up to whole chunks); 0 never cuts. Unset: only where the Hopper scan runs
// (scan_wgmma.cuh: bf16/fp16, K = 128), the whole scan's grid is narrow (fewer than half a CTA per SM at
// two warpgroups) and a model of the step times predicts at most 0.85x of the whole scan's time. The
// model's constants were measured on an H200 (bench/gpu/bench_scan.py, 2026-11-22):
// a step of the narrow whole scan 2.05 us; a wave of pass 1's state-only steps 2.1 us; a wave of pass 2's
// steps, which store h and v_new, 3.4 us (a full wave moves ~3.5 TB/s); a fold step 3.8 us (the
// tensor-core fold, measured on H100; 10.5 us with the earlier FMA loop, from
// traces: 0.073 ms for 7 maps, 16 heads; a first model assumed 3 us, but measured ~16). Never for a
// final-state-only problem (the CP pre-pass cuts its own pieces), nor where V + K padded exceeds 256 (the
// widest state the scans take).
//
// Measured (bench/gpu/bench_scan.py, bf16 GDN, 2026-11-22): H200, (1,32768,16,128) scan
// 1.048 -> 0.593 ms, forward 1.971 -> 1.533 ms; (1,65536,16,128) scan 2.060 -> 1.052 ms, forward 3.765 ->
// 2.784 ms. H100, (2,32768,8,128) forward 1.888 -> 1.593 ms. (2,16384,16,128) is not cut: forced pieces
// of 2048 / 8192 tokens took the scan from 0.50 to 0.72 / 0.64 ms (H100).
//
// The forward runs pass 1 in its prepare stage over every piece of every cut sequence, the last ones too
// (pass1_pieces): a CP rank's pre-pass is then these maps composed where they lie, one launch of
// compose_maps_kernel (deltacp/cuda/api.h forward_composed_map; bindings/python/deltacp/cp/exchange.py
// _composed_local_maps), and prepare also builds pass 2's tables (PieceTables), so finish only launches.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "../common/check.h"
#include "../common/device_info.h"
#include "../common/workspace_pool.h"
#include "chunk_table.cuh"
#include "deltacp/error.h"
#include "deltacp/params.h"
#include "fwd_mma.cuh"
#include "fwd_stages.cuh"

namespace deltacp::cuda::tiled {
namespace {

// [0 | I] for every piece of pass 1: states [P, HV, K, V + K]. Grid (P, HV), 256 threads.
__global__ void fill_zero_identity_kernel(float* __restrict__ x, int64_t HV, int64_t K, int64_t V) {
  const int64_t W = V + K;
  float* base = x + (static_cast<int64_t>(blockIdx.x) * HV + blockIdx.y) * K * W;
  for (int64_t i = threadIdx.x; i < K * W; i += blockDim.x) {
    const int64_t r = i / W, c = i % W;
    base[i] = (c - V == r) ? 1.f : 0.f;
  }
}

// The fold and the composition carry a K x 16 column tile of a state through a sequence's maps, one
// CTA of 256 threads (8 warps) per (sequence, value head, tile): S' = M_j S + add_j, on the tensor cores
// in split TF32 ("3xTF32"): every fp32 operand x = hi + lo (split_tf32) and M S ~ M_hi S_hi + M_hi S_lo +
// M_lo S_hi (mma.sync.m16n8k8 tf32, fp32 accumulation). The dropped M_lo S_lo and the tf32 reading of lo
// cost ~2^-21 of each product, and each k step's products are added into the accumulator in fp32: fp32-level
// accuracy (against fp64 in tests/python/test_cuda.py:
// test_compose_state_maps_any_shape, test_composed_map_is_the_pieces_maps_folded, the scan in pieces).
// Deterministic: fixed tiles and k order.
//
// Why not FMAs: a step is a (K x K) x (K x 16) product per CTA fed from shared memory. Nsight Compute (H100,
// the fold of the 7 maps of a 32K-token sequence, 16 heads, K = V = 128; under the profiler's clocks):
// a plain FMA loop (512 threads, a runtime slab loop, 10 instructions per 4 FMAs) 93 us, 21K cycles a
// step; a register-tiled, unrolled FMA loop (2 rows x 4 columns a thread) 48 us, waiting on shared loads;
// this kernel 35 us before the fp32 add per k step (first with cvt.rna.tf32, ~5 instructions on sm_90:
// 45 us). At the boost clock (bench/gpu/bench_scan.py, H100): the fold 0.028 ms (4 us a step);
// compose_state_maps of 8 maps 0.030 ms at width V, 0.057 ms at V + K (the plain FMA loop: 0.050, 0.070). What is left per step
// (~7K cycles under the profiler, before the fp32 adds): the mma chains, the step's end (barrier,
// state split, the fold's global stores) and the slab copies.
//
// Warp w owns the 16-row blocks w (+ 8) and both 8-column halves of the tile (ROWS = K rounded up to 64,
// 128 or 256; with 64 rows the 4 blocks x 2 halves go one per warp). M_j (K x K, rows V + K apart in the
// maps) streams through shared memory in slabs of 64 columns (32 when K > 128), three buffers deep
// (cp.async). The state lives in shared memory already split, (hi, lo) pairs [ROWS][36], rewritten at a
// step's end after a barrier; add_{j+1} (global) is loaded into registers during step j. State rows past K
// are zero; a last slab's columns past K hold zeros or stale (finite unless M had Inf / NaN) entries of
// earlier slabs, multiplied by those zero rows only up to the next multiple of 8 (the k loop stops there).
// Without 16-byte alignment (V or K not a multiple of 4) the slabs are copied 4 bytes at a time.
constexpr int kFoldCols = 16;
constexpr int kFoldThreads = 256;
constexpr int kFoldStages = 3;
constexpr int kFoldStateRow = 36;  // words a row of the split state: 16 (hi, lo) pairs, 4 words of padding

int fold_rows(int64_t K) { return K <= 64 ? 64 : K <= 128 ? 128 : 256; }
// Columns of M per slab; a slab row is padded by 8 words (72 or 40: the A fragments' 8-byte loads of a
// half warp hit 32 banks).
__host__ __device__ constexpr int fold_slab(int rows) { return rows <= 128 ? 64 : 32; }
// Shared memory of a fold / composition CTA: the split state [ROWS][36], then three slabs [ROWS][slab + 8]
// (K <= 64: 63 KiB; K <= 128: 126 KiB; K <= 256: 156 KiB, which sm_80 and sm_90 allow, not sm_86 / sm_89).
// The caller's S_0 ([ROWS][16] fp32) lies over the state.
size_t fold_smem_bytes(int64_t K) {
  const int rows = fold_rows(K);
  return static_cast<size_t>(rows) * (kFoldStateRow + kFoldStages * (fold_slab(rows) + 8)) * 4;
}

// x = hi + lo: hi = x rounded to tf32 (10 mantissa bits, to nearest, ties away), lo = x - hi (exact in
// fp32; the tensor cores read its top 19 bits, so ~2^-21 |x| is lost). Two integer operations instead of
// cvt.rna.tf32.f32, which sm_90 runs as ~5 instructions guarding Inf / NaN. Here an Inf, and a finite
// |x| >= 3.4025e38 (bits >= 0x7f7ff000), become hi = Inf, lo = NaN or -Inf: the product is NaN; a NaN stays NaN.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
}
// d += a b, m16n8k8, tf32 operands, fp32 accumulators. a: A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4];
// b: B[t][g], B[t+4][g]; d: D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1] (g = lane / 4, t = lane % 4).
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// S <- M_j S + add(j, r, c) for j = 0 .. count - 1 (map(j): M_j's first element, rows W apart), then
// stored(j, r, c, value) for every element of this thread (r < K). smem: on entry S_0 as [ROWS][16] fp32
// (rows past K zero), filled by every thread before a barrier; then the slab buffers.
template <int ROWS, class MapAt, class Add, class Stored>
__device__ __forceinline__ void carry_tile(int64_t count, MapAt map, int64_t W, int K, bool aligned,
                                           float* __restrict__ smem, Add add, Stored stored) {
  constexpr int SLAB = fold_slab(ROWS), ROW = SLAB + 8, BUF = ROWS * ROW;
  constexpr int RB = ROWS == 256 ? 2 : 1, NB = ROWS == 64 ? 1 : 2;  // row blocks, column halves a warp
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4;
  const int rb0 = ROWS == 64 ? warp % 4 : warp, nb0 = ROWS == 64 ? warp / 4 : 0;
  uint32_t* const state = reinterpret_cast<uint32_t*>(smem);  // [ROWS][36]: (hi, lo) of S[r][c] at 2c, 2c + 1
  float* const bufs = smem + ROWS * kFoldStateRow;            // [kFoldStages][ROWS][ROW]
  const int nslab = (K + SLAB - 1) / SLAB;
  if (count <= 0) return;  // no map (a sequence of one piece): nothing to fetch

  // S_0 split into the state (through registers: S_0 lies over it), and the slab buffers zeroed once:
  // columns past K of a last slab (stale or zero) then multiply zero rows of S.
  float s0[ROWS * kFoldCols / kFoldThreads];
#pragma unroll
  for (int e = 0; e < ROWS * kFoldCols / kFoldThreads; ++e) s0[e] = smem[tid + e * kFoldThreads];
  __syncthreads();
#pragma unroll
  for (int e = 0; e < ROWS * kFoldCols / kFoldThreads; ++e) {
    const int i = tid + e * kFoldThreads, r = i / kFoldCols, c = i % kFoldCols;
    uint2 hl;
    split_tf32(s0[e], hl.x, hl.y);
    *reinterpret_cast<uint2*>(state + r * kFoldStateRow + 2 * c) = hl;
  }
  for (int i = tid; i < kFoldStages * BUF; i += kFoldThreads) bufs[i] = 0.f;
  __syncthreads();

  int64_t fj = 0;  // the next slab to fetch: slab fs of map fj, into buffer fb
  int fs = 0, fb = 0;
  auto fetch = [&]() {
    if (fj < count) {
      const float* M = map(fj) + fs * SLAB;
      const int kn = min(SLAB, K - fs * SLAB);
      float* dst = bufs + fb * BUF;
      if (aligned) {  // 16-byte copies: thread tid takes column quad tid % (SLAB / 4) of every RSTEP-th row
        constexpr int CPR = SLAB / 4, RSTEP = kFoldThreads / CPR;
        const int r0 = tid / CPR, q = 4 * (tid % CPR);
        if (q < kn) {
          const float* src = M + r0 * W + q;
#pragma unroll
          for (int it = 0; it < ROWS / RSTEP; ++it)
            if (r0 + it * RSTEP < K) cp_async_16(dst + (r0 + it * RSTEP) * ROW + q, src + it * RSTEP * W);
        }
      } else {
        constexpr int RSTEP = kFoldThreads / SLAB;
        const int r0 = tid / SLAB, kk = tid % SLAB;
        if (kk < kn) {
          const float* src = M + r0 * W + kk;
#pragma unroll
          for (int it = 0; it < ROWS / RSTEP; ++it)
            if (r0 + it * RSTEP < K) cp_async_4(dst + (r0 + it * RSTEP) * ROW + kk, src + it * RSTEP * W);
        }
      }
      if (++fs == nslab) fs = 0, ++fj;
      fb = fb + 1 == kFoldStages ? 0 : fb + 1;
    }
    cp_async_commit();  // an empty group past the end keeps the wait count uniform
  };

  // This thread's accumulator elements: block i (rows 16 (rb0 + 8 i) + g, + 8), half n (columns
  // 8 (nb0 + n) + 2 t, + 1); e = 2 (row + 8) + column.
  auto row_of = [&](int i, int e) { return 16 * (rb0 + 8 * i) + g + 8 * (e / 2); };
  auto col_of = [&](int n, int e) { return 8 * (nb0 + n) + 2 * t + e % 2; };
  float acc[RB][NB][4], next[RB][NB][4];
  auto load_add = [&](int64_t j) {
#pragma unroll
    for (int i = 0; i < RB; ++i)
#pragma unroll
      for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) next[i][n][e] = row_of(i, e) < K ? add(j, row_of(i, e), col_of(n, e)) : 0.f;
  };
  load_add(0);
#pragma unroll
  for (int st = 0; st < kFoldStages - 1; ++st) fetch();
  int b = 0;  // the buffer of the slab being multiplied
  for (int64_t j = 0; j < count; ++j) {
    for (int s = 0; s < nslab; ++s) {
      cp_async_wait<kFoldStages - 2>();  // this thread's copies of this slab
      __syncthreads();  // every thread's: the slab complete; every warp past the previous slab (refilled now)
      fetch();
      if (s == 0) {
#pragma unroll
        for (int i = 0; i < RB; ++i)
#pragma unroll
          for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][n][e] = next[i][n][e];
        if (j + 1 < count) load_add(j + 1);  // consumed a step later: its latency hides behind this step
      }
      const float* Ms = bufs + b * BUF;
      const int kend = (min(SLAB, K - s * SLAB) + 7) / 8 * 8;  // the slab's columns, to a whole k step
      // An 8-wide k step, its k order permuted alike in A and B (the instruction's k = t, t + 4 read the
      // columns 2t, 2t + 1 of M and rows 2t, 2t + 1 of S): every fragment is two 8-byte loads.
#pragma unroll
      for (int kk = 0; kk < SLAB; kk += 8) {
        if (kk >= kend) break;  // uniform over the CTA: past K (a last slab), nothing but zero rows of S
        const int k = s * SLAB + kk;  // row of S
        uint32_t bh[NB][2], bl[NB][2];
#pragma unroll
        for (int n = 0; n < NB; ++n) {
          const int c = 8 * (nb0 + n) + g;
          const uint2 x0 = *reinterpret_cast<const uint2*>(state + (k + 2 * t) * kFoldStateRow + 2 * c);
          const uint2 x1 = *reinterpret_cast<const uint2*>(state + (k + 2 * t + 1) * kFoldStateRow + 2 * c);
          bh[n][0] = x0.x, bl[n][0] = x0.y, bh[n][1] = x1.x, bl[n][1] = x1.y;
        }
#pragma unroll
        for (int i = 0; i < RB; ++i) {
          const float* Ar = Ms + (16 * (rb0 + 8 * i) + g) * ROW + kk + 2 * t;
          const float2 p = *reinterpret_cast<const float2*>(Ar), q = *reinterpret_cast<const float2*>(Ar + 8 * ROW);
          const float x[4] = {p.x, q.x, p.y, q.y};
          uint32_t ah[4], al[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) split_tf32(x[e], ah[e], al[e]);
#pragma unroll
          for (int n = 0; n < NB; ++n) {
            // The k step's three products (small terms first) from zero, then one fp32 add (round to
            // nearest) into the accumulator: the tensor cores' accumulation truncates, and carried through
            // the 3 K / 8 products of a step it cost 1e-6 to 4e-6 relative (test_compose_state_maps_any_shape, H100).
            float part[4] = {0.f, 0.f, 0.f, 0.f};
            mma_tf32(part, al, bh[n][0], bh[n][1]);
            mma_tf32(part, ah, bl[n][0], bl[n][1]);
            mma_tf32(part, ah, bh[n][0], bh[n][1]);
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][n][e] += part[e];
          }
        }
      }
      b = b + 1 == kFoldStages ? 0 : b + 1;
    }
    __syncthreads();  // every warp past S_j: S_{j+1} replaces it
#pragma unroll
    for (int i = 0; i < RB; ++i)
#pragma unroll
      for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = row_of(i, e), c = col_of(n, e);
          const float x = r < K ? acc[i][n][e] : 0.f;
          uint2 hl;
          split_tf32(x, hl.x, hl.y);
          *reinterpret_cast<uint2*>(state + r * kFoldStateRow + 2 * c) = hl;
          if (r < K) stored(j, r, c, x);
        }
    // The next step's first barrier orders these writes before its reads.
  }
  cp_async_wait<0>();
}

// The fold: every piece's start state, starts [P_total, HV, K, V]. Grid (N, HV, ceil(V / 16)).
// S_0 = h0 (or 0), S_{j+1} = M_j S_j + H_j.
template <int ROWS>
__global__ void __launch_bounds__(kFoldThreads, 1)
    fold_piece_states_kernel(const FoldSeq* __restrict__ seqs, int64_t HV, int64_t K, int64_t V,
                             const float* __restrict__ h0, float* __restrict__ starts, bool aligned) {
  extern __shared__ __align__(16) float smem[];  // S_0 [ROWS][16] (carry_tile splits it), then the slab buffers
  const FoldSeq sq = seqs[blockIdx.x];
  const int64_t n = blockIdx.x, hv = blockIdx.y, c0 = static_cast<int64_t>(blockIdx.z) * kFoldCols;
  const int ncol = static_cast<int>(min(static_cast<int64_t>(kFoldCols), V - c0));
  const int64_t W = V + K;
  auto state_row = [&](int64_t piece, int64_t r) { return starts + ((piece * HV + hv) * K + r) * V + c0; };
  auto map = [&](int64_t j) { return sq.maps + (j * HV + hv) * K * W; };  // row r: H_j at [0, V), M_j after

  for (int i = threadIdx.x; i < ROWS * kFoldCols; i += kFoldThreads) {
    const int r = i / kFoldCols, c = i % kFoldCols;
    const float x = (h0 != nullptr && r < K && c < ncol) ? h0[((n * HV + hv) * K + r) * V + c0 + c] : 0.f;
    smem[i] = x;
    if (r < K && c < ncol) state_row(sq.first_piece, r)[c] = x;
  }
  __syncthreads();  // S_0 complete before carry_tile reads it
  carry_tile<ROWS>(
      sq.count - 1, [&](int64_t j) { return map(j) + V; }, W, static_cast<int>(K), aligned, smem,
      [&](int64_t j, int r, int c) { return c < ncol ? map(j)[r * W + c0 + c] : 0.f; },
      [&](int64_t j, int r, int c, float x) {
        if (c < ncol) state_row(sq.first_piece + j + 1, r)[c] = x;
      });
}

// The composition: out [HV, K, width] = the state after all P maps from init ([HV, K, width], or [0 | I]).
// Grid (HV, ceil(width / 16)). Columns from V on see no offset: they carry M_{P-1} ... M_0 init.
template <int ROWS>
__global__ void __launch_bounds__(kFoldThreads, 1)
    compose_maps_kernel(const float* __restrict__ maps, int64_t P, int64_t HV, int64_t K, int64_t V, int64_t width,
                        const float* __restrict__ init, float* __restrict__ out, bool aligned) {
  extern __shared__ __align__(16) float smem[];  // S_0 [ROWS][16] (carry_tile splits it), then the slab buffers
  const int64_t hv = blockIdx.x, c0 = static_cast<int64_t>(blockIdx.y) * kFoldCols;
  const int ncol = static_cast<int>(min(static_cast<int64_t>(kFoldCols), width - c0));
  const int64_t W = V + K;
  auto map = [&](int64_t j) { return maps + (j * HV + hv) * K * W; };
  for (int i = threadIdx.x; i < ROWS * kFoldCols; i += kFoldThreads) {
    const int64_t r = i / kFoldCols, c = c0 + i % kFoldCols;
    smem[i] = (r >= K || c >= width) ? 0.f : init != nullptr ? init[(hv * K + r) * width + c] : (c - V == r ? 1.f : 0.f);
  }
  __syncthreads();  // S_0 complete before carry_tile reads it
  carry_tile<ROWS>(
      P, [&](int64_t j) { return map(j) + V; }, W, static_cast<int>(K), aligned, smem,
      [&](int64_t j, int r, int c) { return c < ncol && c0 + c < V ? map(j)[r * W + c0 + c] : 0.f; },
      [&](int64_t j, int r, int c, float x) {
        if (j + 1 == P && c < ncol) out[(hv * K + r) * width + c0 + c] = x;
      });
}

// cp.async's 16-byte copies need every slab row 16-byte aligned: maps (the base), V and K multiples of 4.
bool maps_fit_16b(const float* maps, int64_t K, int64_t V) {
  return reinterpret_cast<uintptr_t>(maps) % 16 == 0 && K % 4 == 0 && V % 4 == 0;
}

// f(std::integral_constant<int, ROWS>) with ROWS = fold_rows(K): the carry_tile instantiation for K <= 256.
template <class F>
void with_fold_rows(int64_t K, F&& f) {
  DELTACP_CHECK(K >= 1 && K <= kMaxHeadDim, "K", "expected 1 <= K <= ", kMaxHeadDim,
                " for the fold and the composition, got ", K);
  switch (fold_rows(K)) {
    case 64: f(std::integral_constant<int, 64>{}); break;
    case 128: f(std::integral_constant<int, 128>{}); break;
    default: f(std::integral_constant<int, 256>{}); break;
  }
}

// ht[n] = the final state of sequence n's last piece. Grid (N, HV), 256 threads.
__global__ void gather_final_states_kernel(const FoldSeq* __restrict__ seqs, int64_t HV, int64_t KV,
                                           const float* __restrict__ piece_ht, float* __restrict__ ht) {
  const FoldSeq sq = seqs[blockIdx.x];
  const float* src = piece_ht + ((sq.first_piece + sq.count - 1) * HV + blockIdx.y) * KV;
  float* dst = ht + (static_cast<int64_t>(blockIdx.x) * HV + blockIdx.y) * KV;
  for (int64_t i = threadIdx.x; i < KV; i += blockDim.x) dst[i] = src[i];
}

// The step-time model of the file comment: predicted microseconds of the scan in pieces of L chunks.
double predicted_cut_us(const std::vector<SeqEntry>& seqs, const Params& p, int64_t L, int sms) {
  const int64_t Vp = padded_dim(p.V), Kp = padded_dim(p.K);
  int64_t pieces = 0, maps = 0, most = 0;
  for (const SeqEntry& s : seqs) {
    const int64_t P = std::max<int64_t>(1, (s.num_chunks + L - 1) / L);
    pieces += P;
    maps += P > 1 ? P : 0;  // the forward's pass 1 maps every piece of a cut sequence (pass1_pieces)
    most = std::max(most, P);
  }
  auto waves = [&](int64_t ctas) { return static_cast<double>((ctas + sms - 1) / sms); };
  const double pass1 = waves(maps * p.HV * ((Vp + Kp + 127) / 128)) * static_cast<double>(L) * 2.1;
  const double pass2 = waves(pieces * p.HV * ((Vp + 127) / 128)) * static_cast<double>(L) * 3.4;
  return pass1 + pass2 + 3.8 * static_cast<double>(most - 1);
}

ScanPlan make_plan(const std::vector<SeqEntry>& seqs, const Params& p, int64_t L) {
  ScanPlan plan;
  plan.first_piece.reserve(seqs.size() + 1);
  int64_t cut_pieces = 0;
  for (const SeqEntry& s : seqs) {
    plan.first_piece.push_back(static_cast<int64_t>(plan.pieces.size()));
    const int64_t P = std::max<int64_t>(1, (s.num_chunks + L - 1) / L);
    if (P > 1) cut_pieces += P;
    for (int64_t j = 0; j < P; ++j) {
      SeqEntry e = s;
      e.first_chunk = s.first_chunk + j * L;
      e.num_chunks = std::min(L, s.num_chunks - j * L);
      e.bos = s.bos + j * L * p.chunk_size;
      e.len = P == 1 ? s.len : std::min(L * p.chunk_size, s.len - j * L * p.chunk_size);
      plan.pieces.push_back(e);
    }
  }
  plan.first_piece.push_back(static_cast<int64_t>(plan.pieces.size()));
  const int64_t width = padded_dim(p.V) + padded_dim(p.K);
  plan.ctas_two_wg = cut_pieces * p.HV * ((width + 127) / 128);
  return plan;
}

// The pass-1 problem: p with a state V + K wide, final state only.
Params maps_problem(const Params& p) {
  Params q = p;
  q.V = p.V + p.K;
  q.o = TensorRef{};
  q.h0 = nullptr;
  q.ht = nullptr;
  return q;
}

}  // namespace

void launch_pass1(const Params& p, const ScanPlan& plan, const std::vector<int64_t>& which, const float* G,
                  const void* W, const void* U, const void* Kd, float* maps, cudaStream_t stream) {
  if (which.empty()) return;
  std::vector<SeqEntry> pieces;
  pieces.reserve(which.size());
  for (int64_t i : which) {
    DELTACP_CHECK(i >= 0 && i < static_cast<int64_t>(plan.pieces.size()), "pieces", "expected piece indices in [0, ",
                  plan.pieces.size(), "), got ", i);
    pieces.push_back(plan.pieces[static_cast<size_t>(i)]);
  }
  const int64_t P = static_cast<int64_t>(pieces.size());
  const int64_t width = p.V + p.K;
  float* init = static_cast<float*>(workspace_alloc(static_cast<size_t>(P * p.HV * p.K * width) * 4, stream));
  try {
    fill_zero_identity_kernel<<<dim3(static_cast<unsigned>(P), static_cast<unsigned>(p.HV)), 256, 0, stream>>>(
        init, p.HV, p.K, p.V);
    DELTACP_CUDA_CHECK_LAUNCH();
    const ChunkTable table(std::move(pieces), p.chunk_size, stream);
    Params q = maps_problem(p);
    q.h0 = init;
    q.ht = maps;
    ScanRows rows;
    rows.row0 = 0;
    rows.u_width = padded_dim(p.V);
    rows.u_cols = padded_dim(p.V);
    launch_chunk_state_scan(q, table, G, W, U, Kd, /*h=*/nullptr, /*v_new=*/nullptr, init, maps, stream, &rows,
                            plan.ctas_two_wg);
  } catch (...) {
    workspace_free(init, stream);
    throw;
  }
  workspace_free(init, stream);
}

std::vector<int64_t> pass1_pieces(const ScanPlan& plan) {
  std::vector<int64_t> which;
  for (size_t n = 0; n + 1 < plan.first_piece.size(); ++n)
    if (plan.first_piece[n + 1] - plan.first_piece[n] > 1)
      for (int64_t i = plan.first_piece[n]; i < plan.first_piece[n + 1]; ++i) which.push_back(i);
  return which;
}

ScanPlan plan_scan(const Params& p, const std::vector<SeqEntry>& seqs) {
  const int64_t env = piece_tokens_from_env("DELTACP_TILED_SCAN_PIECE");
  if (p.final_state_only() || env == 0 || seqs.empty()) return {};
  int64_t most = 0;  // chunks of the longest sequence
  for (const SeqEntry& s : seqs) most = std::max(most, s.num_chunks);
  const bool fits = padded_dim(p.V) + padded_dim(p.K) <= kMaxHeadDim;
  if (env > 0) {
    const int64_t L = std::max<int64_t>(1, (env + p.chunk_size - 1) / p.chunk_size);
    if (most <= L) return {};  // nothing to cut: any state width is fine
    DELTACP_CHECK(fits, "DELTACP_TILED_SCAN_PIECE", "the state scan in pieces carries a state V + K wide, at most ",
                  kMaxHeadDim, " columns padded; got K = ", p.K, ", V = ", p.V, " and a sequence of ", most,
                  " chunks to cut into pieces of ", L);
    return make_plan(seqs, p, L);
  }
  if (!fits || wgmma_scan_refusal(p, true) != nullptr) return {};
  const int sms = sm_count();
  const int64_t ctas_whole = static_cast<int64_t>(seqs.size()) * p.HV * ((padded_dim(p.V) + 127) / 128);
  if (2 * ctas_whole >= sms) return {};  // wide enough: the whole scan fills the GPU
  const double whole_us = 2.05 * static_cast<double>(most);
  int64_t best_L = 0;
  double best_us = 0.85 * whole_us;
  for (int64_t L : {16, 32, 64, 128, 256}) {
    if (L >= most) break;
    const double us = predicted_cut_us(seqs, p, L, sms);
    if (us < best_us) best_us = us, best_L = L;
  }
  return best_L > 0 ? make_plan(seqs, p, best_L) : ScanPlan{};
}

PieceTables::PieceTables(const Params& p, const ScanPlan& plan, const std::vector<const float*>& seq_maps,
                         cudaStream_t stream)
    : pieces_(plan.pieces, p.chunk_size, stream), stream_(stream) {
  const int64_t N = static_cast<int64_t>(plan.first_piece.size()) - 1;
  DELTACP_CHECK(plan.cut() && static_cast<int64_t>(seq_maps.size()) == N, "maps",
                "expected a cut plan and one entry per sequence");
  std::vector<FoldSeq> host(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    FoldSeq& f = host[static_cast<size_t>(n)];
    f.first_piece = plan.first_piece[n];
    f.count = plan.pieces_of(n);
    f.maps = f.count > 1 ? seq_maps[static_cast<size_t>(n)] : nullptr;
    DELTACP_CHECK(f.count == 1 || f.maps != nullptr, "maps", "expected pass-1 maps for cut sequence ", n);
    if (f.maps != nullptr) aligned_ = aligned_ && maps_fit_16b(f.maps, p.K, p.V);
  }
  const size_t bytes = host.size() * sizeof(FoldSeq);
  fold_seqs_ = static_cast<FoldSeq*>(workspace_alloc(bytes, stream));
  // upload_table (chunk_table.cuh): `host` may go when it returns, also under graph capture, where the
  // maps' addresses in it are the graph's own workspace and stay valid for every replay.
  try {
    upload_table(fold_seqs_, host.data(), bytes, stream);
  } catch (...) {
    workspace_free(fold_seqs_, stream);
    throw;
  }
}

PieceTables::~PieceTables() { workspace_free(fold_seqs_, stream_); }  // stream-ordered, after the kernels

ScanPlan plan_pieces(const Params& p, const std::vector<SeqEntry>& seqs, int64_t L) { return make_plan(seqs, p, L); }

int64_t piece_tokens_from_env(const char* var) {
  const char* env = std::getenv(var);
  if (env == nullptr || *env == '\0') return -1;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  DELTACP_CHECK(end != nullptr && *end == '\0' && v >= 0, var,
                "expected 0 (never cut into pieces) or a positive number of tokens per piece, got '", env, "'");
  return v;
}

void launch_fold_starts(const Params& p, const PieceTables& tables, int64_t N, const float* h0, float* starts,
                        cudaStream_t stream) {
  const int64_t HV = p.HV, K = p.K, V = p.V;
  const int64_t gz = (V + kFoldCols - 1) / kFoldCols;
  with_fold_rows(K, [&](auto rows) {
    auto kernel = fold_piece_states_kernel<decltype(rows)::value>;
    const size_t smem = fold_smem_bytes(K);  // K <= 256: at most 156 KiB
    allow_dynamic_smem(kernel, smem);  // every fold / composition instantiation: at least 63 KiB
    kernel<<<dim3(static_cast<unsigned>(N), static_cast<unsigned>(HV), static_cast<unsigned>(gz)), kFoldThreads, smem,
             stream>>>(tables.fold_seqs(), HV, K, V, h0, starts, tables.maps_aligned());
    DELTACP_CUDA_CHECK_LAUNCH();
  });
}

void launch_gather_final_states(const Params& p, const PieceTables& tables, int64_t N, const float* piece_ht,
                                float* ht, cudaStream_t stream) {
  gather_final_states_kernel<<<dim3(static_cast<unsigned>(N), static_cast<unsigned>(p.HV)), 256, 0, stream>>>(
      tables.fold_seqs(), p.HV, p.K * p.V, piece_ht, ht);
  DELTACP_CUDA_CHECK_LAUNCH();
}

void launch_state_scan(const Params& p, const ChunkTable& table, const ScanPlan& plan, const float* G, const void* W,
                       const void* U, const void* Kd, void* h, void* v_new, const float* h0, float* ht,
                       cudaStream_t stream, const PieceTables* tables) {
  if (!plan.cut()) {
    launch_chunk_state_scan(p, table, G, W, U, Kd, h, v_new, h0, ht, stream);
    return;
  }
  const int64_t N = table.num_seqs(), HV = p.HV, K = p.K, V = p.V;
  DELTACP_CHECK(static_cast<int64_t>(plan.first_piece.size()) == N + 1, "plan",
                "expected a plan for the table's ", N, " sequences");
  // Without prepared tables, pass 1 maps all but the last piece of every cut sequence here.
  std::vector<int64_t> pass1;
  std::vector<int64_t> pass1_first(static_cast<size_t>(N), -1);
  if (tables == nullptr)
    for (int64_t n = 0; n < N; ++n) {
      if (plan.pieces_of(n) < 2) continue;
      pass1_first[static_cast<size_t>(n)] = static_cast<int64_t>(pass1.size());
      for (int64_t i = plan.first_piece[n]; i + 1 < plan.first_piece[n + 1]; ++i) pass1.push_back(i);
    }
  const int64_t P1 = static_cast<int64_t>(pass1.size()), P = static_cast<int64_t>(plan.pieces.size());
  const size_t bytes_maps = static_cast<size_t>(P1 * HV * K * (V + K)) * 4;
  const size_t bytes_starts = static_cast<size_t>(P * HV * K * V) * 4;
  const size_t bytes_ht = ht != nullptr ? bytes_starts : 0;
  auto align = [](size_t b) { return (b + 255) / 256 * 256; };
  char* ws = static_cast<char*>(workspace_alloc(align(bytes_maps) + align(bytes_starts) + align(bytes_ht), stream));
  try {
    float* maps = reinterpret_cast<float*>(ws);
    float* starts = reinterpret_cast<float*>(ws + align(bytes_maps));
    float* piece_ht = bytes_ht ? reinterpret_cast<float*>(ws + align(bytes_maps) + align(bytes_starts)) : nullptr;
    std::unique_ptr<PieceTables> own;
    if (tables == nullptr) {
      std::vector<const float*> seq_maps(static_cast<size_t>(N), nullptr);
      for (int64_t n = 0; n < N; ++n)
        if (pass1_first[static_cast<size_t>(n)] >= 0)
          seq_maps[static_cast<size_t>(n)] = maps + pass1_first[static_cast<size_t>(n)] * HV * K * (V + K);
      own = std::make_unique<PieceTables>(p, plan, seq_maps, stream);
      tables = own.get();
      launch_pass1(p, plan, pass1, G, W, U, Kd, maps, stream);
    }
    DELTACP_CHECK(tables->pieces().num_seqs() == P, "tables", "expected the plan's ", P, " pieces");
    launch_fold_starts(p, *tables, N, h0, starts, stream);
    launch_chunk_state_scan(p, tables->pieces(), G, W, U, Kd, h, v_new, starts, piece_ht, stream);
    if (ht != nullptr) launch_gather_final_states(p, *tables, N, piece_ht, ht, stream);
  } catch (...) {
    workspace_free(ws, stream);
    throw;
  }
  workspace_free(ws, stream);
}

void launch_compose_maps(const float* maps, int64_t P, int64_t HV, int64_t K, int64_t V, int64_t width,
                         const float* init, float* out, cudaStream_t stream) {
  DELTACP_CHECK(P >= 1 && maps != nullptr, "maps", "expected at least one map, got ", P);
  DELTACP_CHECK(width == V || width == V + K, "width", "expected V = ", V, " or V + K = ", V + K, ", got ", width);
  DELTACP_CHECK(out != nullptr, "out", "expected an output buffer");  // K: with_fold_rows
  const int64_t gy = (width + kFoldCols - 1) / kFoldCols;
  with_fold_rows(K, [&](auto rows) {
    auto kernel = compose_maps_kernel<decltype(rows)::value>;
    const size_t smem = fold_smem_bytes(K);
    allow_dynamic_smem(kernel, smem);  // every fold / composition instantiation: at least 63 KiB
    kernel<<<dim3(static_cast<unsigned>(HV), static_cast<unsigned>(gy)), kFoldThreads, smem, stream>>>(
        maps, P, HV, K, V, width, init, out, maps_fit_16b(maps, K, V));
    DELTACP_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace deltacp::cuda::tiled
