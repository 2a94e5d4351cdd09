// cuda/tiled/wy_wgmma.cuh — the WY stage on Hopper's warpgroup products: for every (chunk, value head) at once,
// the WY representation W, U (and T), and the decayed scores P, from one read of the chunk's q, k and v. The
// tiled tier's forward and its backward's recompute run it where it applies (16-bit gdn / delta at K = 128 and
// V = 128 or 256 on sm_90a: wy_wgmma_refusal); the fused forward runs it as its token-parallel stage.
//
// For a chunk of n <= 64 tokens, G the within-chunk cumulative log decay (zero for delta):
//
//   A = strict_tril(K K^T) o beta_i e^(G_i - G_j)        T = (I + A)^-1  (fp32, wy_solve.cuh)
//   W = (T Beta e^G) K        U = (T Beta) V             P = tril(Q K^T) o e^(G_i - G_j)   (j <= i)
//
// One warpgroup (128 threads) per (chunk, value head):
//   loads     Q, K, V tiles (64 tokens x 128, 16-bit) by TMA (../common/tma.cuh), each as two 64 x 64 boxes
//             (one at K = V = 64, where every product below is n64 instead of n128 and the k-steps halve)
//             with the 128-byte swizzle the wgmma descriptors read: Q and K on one mbarrier, V on another,
//             so V lands while A, P and T are computed. A box covers 64 rows whatever the chunk's length:
//             in a chunk of n < 64 tokens rows n .. 63 are zeroed in shared memory before use, as masked
//             loads would have left them
//   products  Q K^T and K K^T: 2 x 8 wgmma m64n64k16 with both operands in shared memory, one group
//   P         masked and decayed in registers, stored (16-bit, 128 bytes per token and head) when asked for
//             (the fused forward's chain reads it; the tiled tier's output stage makes its own)
//   A         masked and scaled in registers, to shared memory (fp32); T by blocked substitution (fp32
//             diagonal blocks, tf32 tensor-core products below them: wy_solve.cuh); T stored (fp32, 256 bytes
//             per token and head) when asked for (the tiled backward's stage B3 reads it)
//   W, U      each 4 x wgmma m64n128k16, A = T Beta (e^G) as 16-bit register fragments (each warp's 16 rows
//             of T), B = the K or V tile read MN-major; staged in shared memory (16-byte pieces swizzled
//             by row) and stored as whole rows. At V = 256, U in two rounds of 128 columns through the one V
//             tile: the second half's copy goes out once the first round's products have read the tile
// The T Beta form (kTBeta: the fused chain's, fused_chain.cuh): T Beta, the 16-bit operand of U's product, goes
// out (128 bytes per token and head) in place of W and U; no V tile is loaded and the K tile is dead once the
// products have read it, so T sits where K was and the CTA takes 38,160 bytes (94 registers a thread), five per SM;
// and for gdn the gate is summed here from the raw g in chunk_cumsum's order (the same bits) and written for the
// chain, so the forward launches no cumsum. Measured (H200, bf16 gdn, FLA's benchmark keywords, kernel time):
// (4,4096,64,128) 0.482 ms (W, U, P; cumsum 0.026 before it) -> 0.362 (T Beta, P; three CTAs per SM) -> 0.325
// (four) -> 0.357 with the gate sum (no cumsum launch: at (4,2048,16,128) the forward's kernels went 0.149 -> 0.122
// ms, at (2,16384,16,128) 0.683 -> 0.672) -> 0.325 with five CTAs per SM (T in K's place; (2,16384,16,128) 0.178
// -> 0.165, (1,8192,96,128) 0.276 -> 0.251).
// With qk_l2norm (FLA's use_qk_l2norm_in_kernel, no gradient: params.h) each row's 1 / sqrt(|x|^2 + eps) is
// summed from the tiles while Q K^T and K K^T run and folded into P (rq_i rk_j), A (rk_i rk_j) and W's
// operand (rk_j); the scales go out (8 bytes per token and head) for the fused chain and its map mode (the
// pieces' pass 1), which fold them into their products the same way, so q and k are read once and never
// written normalised.
// In the backward's recompute (kDvLocal) it also does stage B0 from the P it forms anyway: dVn_local = scale P^T dO
// (bwd_dv_local.cuh's product, P rounded to 16 bits the same way), one wgmma m64n128k16 x 4 with P^T read from
// a swizzled block of shared memory and dO (a third TMA tile, on its own mbarrier) MN-major, written in fp32;
// the backward then launches no B0. A forward that keeps its stage for the backward (Params::wy_stage) writes P and
// T (t16) in the same launch, and that backward runs B0 alone from the kept P (kda_prepare_wgmma.cuh
// b0_kept_kernel) instead of this kernel.
// The mma.sync WY stage (tiled_fwd.cu, chunk_wy_kernel: every dtype, K and variant) computes the same W, U
// and T with the same roundings (T in fp32, T Beta (e^G) rounded to 16 bits, fp32 accumulation).
// Measured (NVIDIA H200, bf16 gdn, kernel time per call, 2026-11-25): 0.259 ms at (2,16384,16,128) and 0.379 ms
// at (1,8192,96,128), with P and without T (the fused forward), against chunk_wy_kernel's 0.447 and 0.652. In
// the backward's recompute with T and B0 (NVIDIA H100, 2026-11-27): 0.460 ms at (2,16384,16,128) against
// chunk_wy_kernel 0.460 + bwd_dv_local 0.322. DELTACP_TILED_WY_WGMMA=0 keeps chunk_wy_kernel (and B0).
// With qk_l2norm (NVIDIA H200, 2026-11-29): 0.248 ms at (2,16384,16,128) and 0.489 ms at (4,4096,64,128), and 0.364
// at (2,16384,16,128) in the backward's recompute (T and B0); in earlier runs 0.278 and 0.555 before the grid took
// the chunks first (below) and G and beta were loaded together, 0.327 and 0.637 while row_rnorm's loads took 8-way
// bank conflicts. Nsight Compute (same shape): about 38% of issue slots busy, three CTAs of four warps per SM;
// 29% of the warps' stall samples were at the head of each CTA (the chunk's table entry, then G and beta, then
// the barrier after them), the rest the solve's barriers and the products' waits.
//
// Shared memory (1024-byte aligned base): Q tile, then A (64 x 68 fp32) in its place, then W's staging;
// K tile; V tile; T (64 x 68 fp32), then U's staging; beta, G, e^G, the row scales and two mbarriers:
// 69,392 bytes plus 1 KB of alignment slack: three CTAs per SM on an H100/H200. With B0 (kDvLocal) P's block
// and the dO tile after them: 95,240 bytes and the slack, two CTAs per SM. The T Beta form: Q tile, then A, then
// T Beta's staging; K tile, then T; the rest as above: 37,136 bytes and the slack.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/check.h"
#include "../common/dev_rows.cuh"
#include "../common/device_info.h"
#include "../common/tma.cuh"
#include "chunk_table.cuh"
#include "fwd_mma.cuh"
#include "wgmma_ops.cuh"
#include "wy_solve.cuh"
#include "deltacp/params.h"

namespace deltacp::cuda::tiled {

template <class T>
struct WyWgmmaArgs {
  TileMap16 tm_q, tm_k, tm_v;  // [B, T, H or HV, K or V] as the caller strides them: boxes of 64 columns x 64 tokens
  DevRows<const T> beta;
  const tiled::ChunkEntry* chunks = nullptr;
  const float* G = nullptr;  // [R, HV] fp32 (gdn), nullptr for delta
  T* W = nullptr;            // [R, HV, K]
  T* U = nullptr;            // [R, HV, V]: V = 128 or 256 at K = 128 (rounds of 128 columns), V = 64 at K = 64
  T* P = nullptr;            // [R, HV, 64]: row i of its chunk's P (nullptr: not stored)
  T* TB = nullptr;           // kTBeta: [R, HV, 64], row i of its chunk's T Beta rounded to 16 bits, in place of W, U
  // kTBeta, gdn: the gate sum made here (no chunk_cumsum pass): g read raw (g32 where it is fp32, else g16), G of the
  // chunk's rows summed in chunk_cumsum_kernel's order (the same bits) and written to G_out ([R, HV] fp32).
  DevRows<const T> g16;
  DevRows<const float> g32;
  float* G_out = nullptr;
  float* Tinv = nullptr;     // [R, HV, 64] fp32: row i of its chunk's T (nullptr: not stored)
  bool t16 = false;          // T rounded to T's type instead, in the first 128 bytes of each 256-byte row
                             // (the chunk-local backward kernel's operand, the bits it rounded T to itself)
  // qk_l2norm (params.h): rq, rk [R, HV] fp32 receive each row's 1 / sqrt(|x|^2 + eps) (nullptr: no l2 norm);
  float* rq = nullptr;
  float* rk = nullptr;
  int64_t HV = 0, group = 1;
  // The backward's recompute (kDvLocal): stage B0's dVn_local = scale P^T dO into dvl ([R, HV, 128] fp32, the
  // rows of the chunk), dO read through tm_do ([B, T, HV, 128]).
  TileMap16 tm_do;
  float* dvl = nullptr;
  float scale = 1.f;
};

// Byte offsets of the shared-memory regions (from the 1024-byte aligned base). kNoV: the T Beta form's kernel,
// which loads no V: T where the K tile was, 38,160 bytes with the slack, five CTAs per SM (the opening comment).
template <bool kNoV = false>
struct WyWgmmaSmemT {
  static constexpr int kLdA = 68;                // A and T rows (floats): 4 mod 32, as wy_solve.cuh's tf32 solve wants
  static constexpr int q = 0;                    // Q tile (16 KB); A (17,408 B); W staging (16 KB)
  static constexpr int k = 18432;                // K tile
  static constexpr int v = k + 16384;            // V tile
  // T (17,408 B); U staging (16 KB). The T Beta form has no V tile and no W: the K tile is dead once the products
  // have read it, so T takes its place.
  static constexpr int t = kNoV ? k : v + 16384;
  static constexpr int beta = t + 64 * kLdA * 4;
  static constexpr int g = beta + 256;
  static constexpr int eg = g + 256;
  static constexpr int rq = eg + 256;            // the rows' l2-norm scales (1 without qk_l2norm)
  static constexpr int rk = rq + 256;
  static constexpr int bar = rk + 256;           // two mbarriers: Q and K, then V
  static constexpr int bytes = bar + 16 + 1024;  // plus the alignment slack
  // kDvLocal only: P (64 x 64, 16-bit, swizzled: the transposed A operand of P^T dO), the dO tile and its mbarrier.
  static constexpr int p = (bar + 16 + 1023) / 1024 * 1024;
  static constexpr int dO = p + 8192;
  static constexpr int bar_do = dO + 16384;
  static constexpr int bytes_dvl = bar_do + 8 + 1024;
};
using WyWgmmaSmem = WyWgmmaSmemT<false>;
static_assert(64 * WyWgmmaSmem::kLdA * 4 <= WyWgmmaSmem::k, "A must fit in the Q tile's region");
static_assert(WyWgmmaSmem::bytes_dvl == 95240 + 1024, "the size the opening comment gives");
static_assert(WyWgmmaSmemT<true>::bytes == 38160, "the size the comment gives: five CTAs per SM");

#ifdef DELTACP_WGMMA_DEVICE
// An m64nN accumulator (this warpgroup's 64 rows x N columns, N = 64 or 128) as 16-bit rows of 2N bytes, the
// 16-byte piece nb of row r at piece nb ^ (r % 8): a warp's 4-byte stores of one n-block land on 32 distinct banks.
template <class T, int N>
__device__ __forceinline__ void stage_rows(unsigned char* dst, const float (&acc)[N / 2]) {
  static_assert(N == 64 || N == 128, "rows of 8 or 16 pieces");
  const int lane = static_cast<int>(threadIdx.x) & 31, wi = (static_cast<int>(threadIdx.x) >> 5) & 3;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nb = 0; nb < N / 8; ++nb)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * wi + g + 8 * h;
      *reinterpret_cast<uint32_t*>(dst + r * (2 * N) + ((nb ^ (r & 7)) << 4) + 4 * t) =
          tiled::pack2<T>(acc[4 * nb + 2 * h], acc[4 * nb + 2 * h + 1]);
    }
}
// The first len rows staged by stage_rows<T, N> to columns col0 .. col0 + N - 1 of rows row0 .. row0 + len - 1 of
// a [R, HV, ld] tensor (head hv), 16 bytes a thread, whole rows per N / 8 threads.
template <class T, int N>
__device__ __forceinline__ void store_rows(T* dst, const unsigned char* src, int64_t row0, int64_t HV, int64_t hv,
                                           int len, int ld, int col0 = 0) {
  constexpr int kPieces = N / 8, kRowsPerPass = 128 / kPieces;
  const int piece = static_cast<int>(threadIdx.x) % kPieces, r0 = static_cast<int>(threadIdx.x) / kPieces;
#pragma unroll
  for (int it = 0; it < 64 / kRowsPerPass; ++it) {
    const int r = r0 + kRowsPerPass * it;
    if (r < len)
      *reinterpret_cast<uint4*>(dst + ((row0 + r) * HV + hv) * ld + col0 + piece * 8) =
          *reinterpret_cast<const uint4*>(src + r * (2 * N) + ((piece ^ (r & 7)) << 4));
  }
}
// 1 / sqrt(|x_r|^2 + eps) of row r = tid / 2 of a swizzled 64 x kK tile (kK = 128: two 64-column blocks; 64: one):
// each of the row's two threads sums the squares of one block at kK = 128, of half the row's pieces at kK = 64
// (the swizzle only permutes a row's pieces inside its block). tid: the thread's index in its warpgroup.
// Bank conflicts: a quarter-warp's 16-byte loads (rows r0 .. r0 + 3, both halves) read 128-byte rows, so reading
// piece pc at 16 pc put all 8 threads on one 16-byte bank group (8-way). Reading the 128-byte row's piece
// pc ^ (r % 8) ^ 4 h instead puts them on 8 distinct groups; per thread it is the same set of pieces in another
// order (at kK = 64, pc < 4: h's half of the row, whatever the swizzle did to it).
template <class T, int kK>
__device__ __forceinline__ float row_rnorm(const unsigned char* tile, int tid) {
  const int r = tid >> 1, h = tid & 1;
  const unsigned char* row = kK == 128 ? tile + h * 8192 + r * 128 : tile + r * 128;
  const int spread = (r & 7) ^ (4 * h);
  float ss = 0.f;
#pragma unroll
  for (int pc = 0; pc < kK / 16; ++pc) {
    const uint4 v = *reinterpret_cast<const uint4*>(row + 16 * (pc ^ spread));
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = tiled::unpack2<T>(w[e]);
      ss = fmaf(f.x, f.x, fmaf(f.y, f.y, ss));
    }
  }
  ss += __shfl_xor_sync(0xffffffffu, ss, 1);
  return rsqrtf(ss + kQkL2normEps);
}
#endif

// kK, kV: K and V, (128, 128), (128, 256) or (64, 64). U's product runs in kV / kK rounds of kK columns (a
// compile-time count: with a runtime one the V = 128 kernels took 148 and 255 registers instead of 128 and 174).
// kTBeta: the fused chain's T Beta form (fused_chain.cuh): T Beta (the 16-bit operand U's product would take) goes
// out in place of W and U, and the V tile is not loaded; P and the row scales as always.
template <class T, bool kDvLocal, int kK, int kV, bool kTBeta = false>
__global__ void __launch_bounds__(128) wy_wgmma_kernel(const __grid_constant__ WyWgmmaArgs<T> a) {
  static_assert((kK == 128 && (kV == 128 || kV == 256)) || (kK == 64 && kV == 64),
                "K = 128 with V = 128 or 256, or K = V = 64");
  static_assert(!kDvLocal || (kK == 128 && kV == 128), "B0's product is made at K = V = 128 only");
  static_assert(!kTBeta || (!kDvLocal && kV == kK), "the T Beta form is the forward's, one instance per K");
  constexpr int kRounds = kV / kK, kBoxes = kK / 64;  // U's rounds; 64-column boxes of a q, k, v or U tile
#ifdef DELTACP_WGMMA_DEVICE
  using S = WyWgmmaSmemT<kTBeta>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  float* As = reinterpret_cast<float*>(smem + S::q);
  float* Ts = reinterpret_cast<float*>(smem + S::t);
  float* bs = reinterpret_cast<float*>(smem + S::beta);
  float* gs = reinterpret_cast<float*>(smem + S::g);
  float* egs = reinterpret_cast<float*>(smem + S::eg);
  float* rqs = reinterpret_cast<float*>(smem + S::rq);
  float* rks = reinterpret_cast<float*>(smem + S::rk);
  const bool l2 = a.rq != nullptr;
  const int tid = threadIdx.x, wi = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  // One CTA per (chunk, value head), the heads of a chunk consecutive. Measured on an H200 (bf16 gdn, one run):
  // 0.248 against 0.267 ms at (2,16384,16,128), 0.489 against 0.528 at (4,4096,64,128) with the chunks of a head
  // consecutive; CTAs that run at the same time now read neighbouring rows of [token, head, :] tensors.
  const int64_t HV = a.HV, item = blockIdx.x, chunk = item / HV, hv = item - chunk * HV, hk = hv / a.group;
  const ChunkEntry ce = a.chunks[chunk];
  const int len = static_cast<int>(ce.len);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + S::bar);

  uint64_t* bar_do = reinterpret_cast<uint64_t*>(smem + S::bar_do);
  if (tid == 0) {
    mbar_init(bars, 1);
    mbar_init(bars + 1, 1);
    if constexpr (kDvLocal) mbar_init(bar_do, 1);
    fence_mbar_init();
    const int t0 = static_cast<int>(ce.t0), b = static_cast<int>(ce.batch);
    const int h = static_cast<int>(hk), hvi = static_cast<int>(hv);
    mbar_expect_tx(bars, 2 * kBoxes * 8192);
    for (int x = 0; x < kBoxes; ++x) {
      tma_load_4d(smem + S::q + x * 8192, &a.tm_q.map, bars, 64 * x, h, t0, b);
      tma_load_4d(smem + S::k + x * 8192, &a.tm_k.map, bars, 64 * x, h, t0, b);
    }
    if constexpr (!kTBeta) {
      mbar_expect_tx(bars + 1, kBoxes * 8192);
      for (int x = 0; x < kBoxes; ++x) tma_load_4d(smem + S::v + x * 8192, &a.tm_v.map, bars + 1, 64 * x, hvi, t0, b);
    }
    if constexpr (kDvLocal) {
      mbar_expect_tx(bar_do, 2 * 8192);
      tma_load_4d(smem + S::dO, &a.tm_do.map, bar_do, 0, hvi, t0, b);
      tma_load_4d(smem + S::dO + 8192, &a.tm_do.map, bar_do, 64, hvi, t0, b);
    }
  }
  // Rows len .. 63 of the `boxes` 64-row blocks at tile: zero (after the boxes have landed).
  auto zero_tail_rows = [&](unsigned char* tile, int boxes) {
    if (len < 64)
      for (int idx = tid; idx < boxes * 64 * 8; idx += 128) {
        const int row = (idx >> 3) & 63;
        if (row >= len) *reinterpret_cast<uint4*>(tile + idx * 16) = make_uint4(0u, 0u, 0u, 0u);
      }
  };
  const bool sum_gate = kTBeta && a.G_out != nullptr;  // the T Beta form sums the gate itself (WyWgmmaArgs)
  if (tid < 64) {
    // rows past a short chunk repeat its last G (every decay stays finite) and have beta = 0. Both loads read a
    // row of the chunk, so that they are in flight together (Nsight Compute found the beta load issued only after
    // G's had returned, at the head of every CTA's critical path).
    const int r = min(tid, len - 1);
    const float bi = to_f(*a.beta.at(ce.batch, ce.t0 + r, hv));
    if (sum_gate) {  // the raw g of row r, summed below
      egs[tid] = a.g32.ptr != nullptr ? *a.g32.at(ce.batch, ce.t0 + r, hv) : to_f(*a.g16.at(ce.batch, ce.t0 + r, hv));
    } else {
      const float gi = a.G != nullptr ? a.G[(ce.row0 + r) * HV + hv] : 0.f;
      gs[tid] = gi;
      egs[tid] = exp_t<T>(gi);
    }
    bs[tid] = tid < len ? bi : 0.f;
  }
  __syncthreads();  // the barriers are initialised
  if (sum_gate) {
    // G of row r: g_0 + ... + g_r added left to right, as chunk_cumsum_kernel adds them (the same bits); rows past
    // the chunk get its last row's. Each of 64 threads sums its own prefix: 64 predicated dependent adds over
    // 16-byte loads issued together (a loop up to r, one shared load per add, cost the stage 0.04 ms at
    // (4,4096,64,128)).
    float gi = 0.f;
    if (tid < 64) {
      const int r = min(tid, len - 1);
#pragma unroll
      for (int i4 = 0; i4 < 16; ++i4) {
        const float4 x = reinterpret_cast<const float4*>(egs)[i4];
        gi = 4 * i4 <= r ? gi + x.x : gi;
        gi = 4 * i4 + 1 <= r ? gi + x.y : gi;
        gi = 4 * i4 + 2 <= r ? gi + x.z : gi;
        gi = 4 * i4 + 3 <= r ? gi + x.w : gi;
      }
      if (tid < len) a.G_out[(ce.row0 + tid) * HV + hv] = gi;
    }
    __syncthreads();  // every thread has read the raw g
    if (tid < 64) {
      gs[tid] = gi;
      egs[tid] = exp_t<T>(gi);
    }  // published by the barrier after the Q and K tiles land
  }
  mbar_wait(bars, 0);  // Q and K (V may still be in flight)
  zero_tail_rows(smem + S::q, kBoxes);
  zero_tail_rows(smem + S::k, kBoxes);
  fence_proxy_async();
  __syncthreads();

  // Q K^T and K K^T, one group.
  float Pacc[32], Aacc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) Pacc[i] = Aacc[i] = 0.f;
  const uint32_t q_addr = smem_u32(smem + S::q), k_addr = smem_u32(smem + S::k), v_addr = smem_u32(smem + S::v);
  wg_fence();
  reg_fence(Pacc);
  reg_fence(Aacc);
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    const uint32_t off = (kk >> 2) * 8192 + (kk & 3) * 32;
    const uint64_t kd = wg_desc(k_addr + off, 16, 1024);
    wgmma_n64_ss<T>(Pacc, wg_desc(q_addr + off, 16, 1024), kd, kk > 0);
    wgmma_n64_ss<T>(Aacc, kd, kd, kk > 0);
  }
  wg_commit();
  // qk_l2norm: the rows' scales while the products run (published by the barrier below). With
  // q_n = rq q and k_n = rk k, every product below takes them as row and column scales.
  {
    const float sq = l2 ? row_rnorm<T, kK>(smem + S::q, tid) : 1.f, sk = l2 ? row_rnorm<T, kK>(smem + S::k, tid) : 1.f;
    const int r = tid >> 1;
    if ((tid & 1) == 0) {
      rqs[r] = sq;
      rks[r] = sk;
      if (l2 && r < len) {
        a.rq[(ce.row0 + r) * HV + hv] = sq;
        a.rk[(ce.row0 + r) * HV + hv] = sk;
      }
    }
  }
  wg_wait_all();
  reg_fence(Pacc);
  reg_fence(Aacc);
  __syncthreads();  // every warp's products have read the Q tile: A takes its place

  // P (diagonal included) to global; A (strictly lower, scaled by beta_i) to shared memory. The masks come
  // before the exponentials, whose exponents are positive above the diagonal.
  const int i0 = 16 * wi + g, i1 = i0 + 8;
  const float gi0 = gs[i0], gi1 = gs[i1];
  const float b0 = bs[i0] * rks[i0], b1 = bs[i1] * rks[i1];  // A's row scales: beta_i rk_i
  const float q0 = rqs[i0], q1 = rqs[i1];                    // P's row scales
  T* prow0 = a.P + ((ce.row0 + i0) * HV + hv) * 64;
  T* prow1 = a.P + ((ce.row0 + i1) * HV + hv) * 64;
#pragma unroll
  for (int nb = 0; nb < 8; ++nb) {
    const int j = 8 * nb + 2 * t;
    const float gj0 = gs[j], gj1 = gs[j + 1], kj0 = rks[j], kj1 = rks[j + 1];
    const float e00 = j <= i0 ? exp_t<T>(gi0 - gj0) * kj0 : 0.f, e01 = j + 1 <= i0 ? exp_t<T>(gi0 - gj1) * kj1 : 0.f;
    const float e10 = j <= i1 ? exp_t<T>(gi1 - gj0) * kj0 : 0.f, e11 = j + 1 <= i1 ? exp_t<T>(gi1 - gj1) * kj1 : 0.f;
    if (a.P != nullptr && i0 < len)
      *reinterpret_cast<uint32_t*>(prow0 + j) = pack2<T>(q0 * e00 * Pacc[4 * nb], q0 * e01 * Pacc[4 * nb + 1]);
    if (a.P != nullptr && i1 < len)
      *reinterpret_cast<uint32_t*>(prow1 + j) = pack2<T>(q1 * e10 * Pacc[4 * nb + 2], q1 * e11 * Pacc[4 * nb + 3]);
    if constexpr (kDvLocal) {  // P (rows past len are zero: their Q rows were) into the swizzled 64 x 64 block
      unsigned char* ps = smem + S::p;
      *reinterpret_cast<uint32_t*>(ps + i0 * 128 + (((nb ^ i0) & 7) << 4) + 4 * t) =
          pack2<T>(q0 * e00 * Pacc[4 * nb], q0 * e01 * Pacc[4 * nb + 1]);
      *reinterpret_cast<uint32_t*>(ps + i1 * 128 + (((nb ^ i1) & 7) << 4) + 4 * t) =
          pack2<T>(q1 * e10 * Pacc[4 * nb + 2], q1 * e11 * Pacc[4 * nb + 3]);
    }
    *reinterpret_cast<float2*>(As + i0 * S::kLdA + j) =
        make_float2(j < i0 ? b0 * e00 * Aacc[4 * nb] : 0.f, j + 1 < i0 ? b0 * e01 * Aacc[4 * nb + 1] : 0.f);
    *reinterpret_cast<float2*>(As + i1 * S::kLdA + j) =
        make_float2(j < i1 ? b1 * e10 * Aacc[4 * nb + 2] : 0.f, j + 1 < i1 ? b1 * e11 * Aacc[4 * nb + 3] : 0.f);
  }
  if constexpr (!kTBeta) {
    mbar_wait(bars + 1, 0);  // the V tile
    zero_tail_rows(smem + S::v, kBoxes);
  }
  if constexpr (kDvLocal) {
    mbar_wait(bar_do, 0);
    zero_tail_rows(smem + S::dO, 2);
  }
  fence_proxy_async();
  __syncthreads();
  unit_lower_inverse_64_tf32(As, Ts, S::kLdA);

  if constexpr (kTBeta) {
    // T Beta rounded to 16 bits (U's operand below, bit for bit), staged where A was (the solve is done with it)
    // as 128-byte rows of swizzled 16-byte pieces (stage_rows' layout) and stored as whole rows.
    unsigned char* tb = smem + S::q;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = 16 * kk + 8 * h + 2 * t, nb = 2 * kk + h;
        const float2 t0 = *reinterpret_cast<const float2*>(Ts + i0 * S::kLdA + j);
        const float2 t1 = *reinterpret_cast<const float2*>(Ts + i1 * S::kLdA + j);
        const float s0 = bs[j], s1 = bs[j + 1];
        *reinterpret_cast<uint32_t*>(tb + i0 * 128 + ((nb ^ (i0 & 7)) << 4) + 4 * t) = pack2<T>(t0.x * s0, t0.y * s1);
        *reinterpret_cast<uint32_t*>(tb + i1 * 128 + ((nb ^ (i1 & 7)) << 4) + 4 * t) = pack2<T>(t1.x * s0, t1.y * s1);
      }
    __syncthreads();
    store_rows<T, 64>(a.TB, tb, ce.row0, HV, hv, len, 64);
  } else {  // W and U
    // T Beta e^G (for W) and T Beta (for U) as A fragments: this warp's rows i0, i1 of T, k-step kk covering
    // tokens 16 kk .. 16 kk + 15 (register 2 h + row half: columns 16 kk + 8 h + 2 t, + 1).
    uint32_t fw[4][4], fu[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = 16 * kk + 8 * h + 2 * t;
        const float2 t0 = *reinterpret_cast<const float2*>(Ts + i0 * S::kLdA + j);
        const float2 t1 = *reinterpret_cast<const float2*>(Ts + i1 * S::kLdA + j);
        const float s0 = bs[j], s1 = bs[j + 1], e0 = egs[j] * rks[j], e1 = egs[j + 1] * rks[j + 1];
        fu[kk][2 * h] = pack2<T>(t0.x * s0, t0.y * s1);
        fu[kk][2 * h + 1] = pack2<T>(t1.x * s0, t1.y * s1);
        fw[kk][2 * h] = pack2<T>(t0.x * s0 * e0, t0.y * s1 * e1);
        fw[kk][2 * h + 1] = pack2<T>(t1.x * s0 * e0, t1.y * s1 * e1);
      }
    if (a.Tinv != nullptr && a.t16) {  // T's rows < len rounded, 8 values (16 bytes) a thread
      for (int idx = tid; idx < 64 * 8; idx += 128) {
        const int r = idx >> 3, c8 = idx & 7;
        if (r < len) {
          const float4 x = *reinterpret_cast<const float4*>(Ts + r * S::kLdA + 8 * c8);
          const float4 y = *reinterpret_cast<const float4*>(Ts + r * S::kLdA + 8 * c8 + 4);
          *reinterpret_cast<uint4*>(reinterpret_cast<char*>(a.Tinv + ((ce.row0 + r) * HV + hv) * 64) + 16 * c8) =
              make_uint4(pack2<T>(x.x, x.y), pack2<T>(x.z, x.w), pack2<T>(y.x, y.y), pack2<T>(y.z, y.w));
        }
      }
    } else if (a.Tinv != nullptr)  // T's rows < len, 16 bytes a thread (rows of 68 floats: 16-byte aligned)
      for (int idx = tid; idx < 64 * 16; idx += 128) {
        const int r = idx >> 4, c4 = idx & 15;
        if (r < len)
          *reinterpret_cast<float4*>(a.Tinv + ((ce.row0 + r) * HV + hv) * 64 + 4 * c4) =
              *reinterpret_cast<const float4*>(Ts + r * S::kLdA + 4 * c4);
      }
    __syncthreads();  // every warp has read T: U's staging takes its place

    float acc[kK / 2];
#pragma unroll
    for (int i = 0; i < kK / 2; ++i) acc[i] = 0.f;
    wg_fence();
    reg_fence(acc);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs_tb<T, kK>(acc, fw[kk], wg_desc(k_addr + kk * 2048, 8192, 1024));
    wg_commit();
    wg_wait_all();
    reg_fence(acc);
    reg_fence(fw);
    stage_rows<T, kK>(smem + S::q, acc);
    // U = (T Beta) V in rounds of kK value columns (one round unless V = 256): the V tile holds columns kK vb ..
    // kK vb + kK - 1; the next round's copy goes out once every warp's products have read the tile, and lands while
    // this round's rows are staged and stored.
#pragma unroll
    for (int vb = 0; vb < kRounds; ++vb) {
      if (vb > 0) {
        mbar_wait(bars + 1, static_cast<uint32_t>(vb & 1));
        zero_tail_rows(smem + S::v, kBoxes);
        fence_proxy_async();
        __syncthreads();
      }
#pragma unroll
      for (int i = 0; i < kK / 2; ++i) acc[i] = 0.f;
      wg_fence();
      reg_fence(acc);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs_tb<T, kK>(acc, fu[kk], wg_desc(v_addr + kk * 2048, 8192, 1024));
      wg_commit();
      wg_wait_all();
      reg_fence(acc);
      reg_fence(fu);
      if (vb + 1 < kRounds) {
        __syncthreads();  // every warp's products have read the V tile
        if (tid == 0) {
          fence_proxy_async();  // the zeroed rows (generic writes) before the copy
          const int t0 = static_cast<int>(ce.t0), b = static_cast<int>(ce.batch), hvi = static_cast<int>(hv);
          mbar_expect_tx(bars + 1, kBoxes * 8192);
          for (int x = 0; x < kBoxes; ++x)
            tma_load_4d(smem + S::v + x * 8192, &a.tm_v.map, bars + 1, kK * (vb + 1) + 64 * x, hvi, t0, b);
        }
      }
      stage_rows<T, kK>(smem + S::t, acc);
      if constexpr (kDvLocal) {  // (one round: K = V = 128)
        // dVn_local = scale P^T dO (stage B0 of the backward): A = P^T (the P block read M-major), B = dO (MN-major,
        // its two 64-column blocks 8 KB apart), K = the chunk's 64 tokens.
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.f;
        reg_fence(acc);
        wg_fence();
        const uint32_t p_addr = smem_u32(smem + S::p), do_addr = smem_u32(smem + S::dO);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_ss<T, 128, 1, 1>(acc, wg_desc(p_addr + kk * 2048, 8192, 1024), wg_desc(do_addr + kk * 2048, 8192, 1024),
                                 1);
        wg_commit();
        wg_wait_all();
        reg_fence(acc);
#pragma unroll
        for (int nb = 0; nb < 16; ++nb)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = 16 * wi + g + 8 * h;
            if (r < len)
              *reinterpret_cast<float2*>(a.dvl + ((ce.row0 + r) * HV + hv) * 128 + 8 * nb + 2 * t) =
                  make_float2(a.scale * acc[4 * nb + 2 * h], a.scale * acc[4 * nb + 2 * h + 1]);
          }
      }
      __syncthreads();
      if (vb == 0) store_rows<T, kK>(a.W, smem + S::q, ce.row0, HV, hv, len, kK);
      store_rows<T, kK>(a.U, smem + S::t, ce.row0, HV, hv, len, kV, kK * vb);
      if (vb + 1 < kRounds) __syncthreads();  // the staged rows are read before the next round stages its own
    }
  }
#else
  __trap();  // never launched: the host selects this kernel only for builds with sm_90a code
#endif
}

// Why wy_wgmma_kernel cannot run p's inputs (variant, dtype, K, V, chunk size, alignment, TMA's limits, the
// GPU), or nullptr when it can. The fused forward adds what its chain needs (fused_fwd.cu, forward_refusal).
const char* wy_wgmma_refusal(const Params& p);

// Whether wy_wgmma_kernel can also compute the backward's B0 for p: dO read through a tensor map.
inline bool wy_wgmma_takes_dout(const Params& p) {
  return p.K == 128 && p.V == 128 && p.dout.ptr != nullptr && rows_aligned16(p.dout, 2) &&
         steps_forward(p.dout, p.B, p.T, p.HV);
}

// The arguments both launches below set alike: q's and k's tiles, beta, the chunk table, P, the row scales and the
// heads; and the grid (one CTA per chunk and value head), checked against CUDA's limit.
template <class T>
WyWgmmaArgs<T> wy_wgmma_args(const Params& p, const ChunkTable& table, T* P, float* rq, float* rk, dim3& grid) {
  WyWgmmaArgs<T> a;
  a.tm_q = token_rows_map(p.q, p.B, p.T, p.H, p.K, "q");
  a.tm_k = token_rows_map(p.k, p.B, p.T, p.H, p.K, "k");
  a.beta = dev_rows<const T>(p.beta);
  a.chunks = table.chunks();
  a.P = P;
  a.rq = rq;
  a.rk = rk;
  a.HV = p.HV;
  a.group = p.HV / p.H;
  DELTACP_CHECK(table.num_chunks() * p.HV < (int64_t{1} << 31), "q",
                "the wgmma WY stage takes fewer than 2^31 chunks x value heads, got ", table.num_chunks(), " x ", p.HV);
  grid = dim3(static_cast<unsigned>(table.num_chunks() * p.HV));
  return a;
}

// Launches wy_wgmma_kernel over every chunk of the table (K = 128, V = 128 or 256, 16-bit T; G from the tiled tier's
// stage 1, nullptr for delta; P and Tinv as in WyWgmmaArgs; rq, rk as there: nullptr without p.qk_l2norm). With
// dvl (the backward's recompute, wy_wgmma_takes_dout(p)), it also writes stage B0's scale P^T dO there.
template <class T>
void launch_wy_wgmma(const Params& p, const ChunkTable& table, const float* G, T* W, T* U, T* P, float* Tinv,
                     float* rq, float* rk, cudaStream_t stream, float* dvl = nullptr, bool t16 = false) {
  if (table.num_chunks() == 0) return;
  dim3 grid;
  WyWgmmaArgs<T> a = wy_wgmma_args(p, table, P, rq, rk, grid);
  a.tm_v = token_rows_map(p.v, p.B, p.T, p.HV, p.V, "v");
  a.G = p.variant == Variant::delta ? nullptr : G;
  a.W = W;
  a.U = U;
  a.Tinv = Tinv;
  a.t16 = t16;
  if (dvl != nullptr) {
    a.tm_do = token_rows_map(p.dout, p.B, p.T, p.HV, 128, "do");
    a.dvl = dvl;
    a.scale = static_cast<float>(p.scale);
    DELTACP_CHECK(p.K == 128 && p.V == 128, "v", "internal: the WY stage makes B0's product at K = V = 128 only, got K = ",
                  p.K, ", V = ", p.V);
    opt_in_smem(wy_wgmma_kernel<T, true, 128, 128>, WyWgmmaSmem::bytes_dvl, "K", "the wgmma WY stage needs ",
                WyWgmmaSmem::bytes_dvl, " bytes of shared memory");
    wy_wgmma_kernel<T, true, 128, 128><<<grid, 128, WyWgmmaSmem::bytes_dvl, stream>>>(a);
  } else {
    auto kernel = p.K == 64    ? wy_wgmma_kernel<T, false, 64, 64>
                  : p.V == 256 ? wy_wgmma_kernel<T, false, 128, 256>
                               : wy_wgmma_kernel<T, false, 128, 128>;
    opt_in_smem(kernel, WyWgmmaSmem::bytes, "K", "the wgmma WY stage needs ", WyWgmmaSmem::bytes,
                " bytes of shared memory");
    kernel<<<grid, 128, WyWgmmaSmem::bytes, stream>>>(a);
  }
  DELTACP_CUDA_CHECK_LAUNCH();
}

// The fused chain's T Beta form of the stage (wy_wgmma_kernel<..., kTBeta>: K = V = 128 or 64, any V at K = 128):
// T Beta to TB and P to P ([R, HV, 64] rows, 16-bit), the row scales to rq, rk (qk_l2norm, else nullptr), and for
// gdn the gate summed within each chunk from p.g into G ([R, HV] fp32: chunk_cumsum's bits; no cumsum launch).
template <class T>
void launch_wy_wgmma_tbeta(const Params& p, const ChunkTable& table, float* G, T* TB, T* P, float* rq, float* rk,
                           cudaStream_t stream) {
  if (table.num_chunks() == 0) return;
  dim3 grid;
  WyWgmmaArgs<T> a = wy_wgmma_args(p, table, P, rq, rk, grid);
  if (p.variant == Variant::gdn) {
    a.G_out = G;
    if (p.g_fp32) {
      a.g32 = dev_rows<const float>(p.g);
    } else {
      a.g16 = dev_rows<const T>(p.g);
    }
  }
  a.TB = TB;
  auto kernel = p.K == 64 ? wy_wgmma_kernel<T, false, 64, 64, true> : wy_wgmma_kernel<T, false, 128, 128, true>;
  constexpr int bytes = WyWgmmaSmemT<true>::bytes;
  opt_in_smem(kernel, bytes, "K", "the wgmma WY stage needs ", bytes, " bytes of shared memory");
  kernel<<<grid, 128, bytes, stream>>>(a);
  DELTACP_CUDA_CHECK_LAUNCH();
}

}  // namespace deltacp::cuda::tiled
