// cuda/tiled/kda_prepare_wgmma.cuh — the fused forward's kda stage on Hopper's warpgroup products: for every
// (chunk, value head) the outputs of kda_prepare_kernel (tiled_fwd.cu) — W, U, K e^(G_n - G), P, Q e^G and G's
// last row — from one read of q, k, v, g and beta. Included by tiled_fwd.cu (it reads FwdArgs and the gate and
// l2-norm helpers there); launch_kda_fused_prepare runs it where kda_prepare_wgmma_refusal allows and the switch
// DELTACP_FUSED_KDA_PREPARE_WGMMA does not turn it off (unset: wherever it applies; 0: kda_prepare_kernel).
//
// Algorithm (the same as kda_prepare_kernel's; docs/design.md section 3). For a chunk of n <= 64 tokens, G the
// within-chunk cumulative sum of the per-key log decay g (summed here), q and k l2-normalised here on request:
//
//   A = strict_tril( beta_i sum_d K_id K_jd e^(G_id - G_jd) )      T = (I + A)^-1  (fp32, wy_solve.cuh)
//   P = tril( sum_d Q_id K_jd e^(G_id - G_jd) )  (diagonal included; 16-bit, zero right of the block diagonal)
//   W = (T Beta) (K e^G)     U = (T Beta) V     Kd = K e^(G_n - G)     Qg = Q e^G
//
// The decayed scores keep kda_scores.cuh's overflow strategy exactly: row block a (rows 16 a .. 16 a + 15) takes
// the reference row r = 16 a; its X rows are scaled by e^(G_i - G_r) (exponent <= 0), Y's rows j < r by
// e^(G_r - G_j) (<= 0), both rounded to 16 bits, and the product of the two gives the off-diagonal blocks (a, b < a)
// on the tensor cores. The diagonal block (a, a): bf16 on the tensor cores through the same reference row (Y rows
// r .. r + 15 scaled by e^(G_r - G_j) >= 0) where every such exponent is at most kDiagExpMax and every scaled
// element at most 1e30 in magnitude (checked per chunk and block), element by element in fp32 with e^(G_id - G_jd)
// (j <= i) elsewhere and always for fp16. Every scaled operand is the same expression as in kda_scores.cuh on the
// same inputs (so the same bits); what differs is that the products are wgmma's instead of mma.sync's.
//
// One CTA of two warpgroups (256 threads) per (chunk, value head). Warpgroup 0 makes A (X = K) and solves T;
// warpgroup 1 makes P (X = Q) and the element-wise outputs; then warpgroup 0 computes W, warpgroup 1 U.
//   phase 0  q, k tiles (64 tokens x 128 keys, two 64 x 64 boxes each, 128-byte swizzle) by TMA on one mbarrier;
//            the raw gate into G (fp32; cp.async for fp32 g, converted for 16-bit g: load_raw_gate); beta
//   phase 1  warpgroup 0: G in place (chunk_sum_gate, which first makes each raw value its gate with
//            Params::gate_A_log; G's last row out; with Params::gate_range also the smallest and largest raw value,
//            two atomics a CTA: safe_gate's check without a pass over g); warpgroup 1: q, k rows normalised in
//            place (l2norm_rows's arithmetic on the swizzled rows)
//   phase 2  the scores. Each warp w scales its 16 rows of X around its own reference row 16 w into wgmma A
//            fragments (registers; in the round that keeps its rows, zeros in the other: each warp scales once and
//            no fragments stay live across a round, which kept the kernel at 128 registers without spills); Y's
//            rescaled rows Yr_a (rows 0 .. 16 a + 15 of K e^(G_16a - G), K-major,
//            swizzled) are built in two rounds, {Yr_3, Yr_0} then {Yr_2, Yr_1} (80 rows, 20 KB each round), and
//            each warpgroup issues wgmma m64n(16 (a + 1))k16 x 8 with its fragments against each Yr_a of the round:
//            warp a keeps rows 16 a .. 16 a + 15 of the product with Yr_a (the other warps' rows of that product
//            are not used). Warpgroup 0 writes beta_i x into A (fp32, shared memory), warpgroup 1 writes P's rows
//            (16-bit, with the zeros right of the block diagonal) to global memory. Then the diagonal blocks that
//            go element by element (kda_scores.cuh's loop, warp a of each warpgroup)
//   phase 3  warpgroup 0: T = (I + A)^-1 (unit_lower_inverse_64_tf32 on a named barrier); warpgroup 1 meanwhile:
//            Qg = Q e^G and Kd out, K <- K e^G in place (one e^G per element for both), then the v tile by TMA
//            into Q's dead bytes
//   phase 4  both warpgroups build T Beta as 16-bit A fragments; warpgroup 0: W = (T Beta)(K e^G), warpgroup 1:
//            U = (T Beta) V, each 4 x wgmma m64n128k16 (B MN-major), staged (swizzled rows) and stored as whole rows.
//            V = 256 (the forward): V's columns 128 .. 255 land by TMA in T's dead bytes once every warp has its
//            fragments, and warpgroup 0 computes U's second half after W, staged where W was
//
// Numerics: every rounding of kda_prepare_kernel is kept (16-bit scaled operands, fp32 A and T with tf32 block
// products, T Beta rounded to 16 bits, fp32 accumulation). The score and W, U products accumulate in wgmma's order
// instead of mma.sync's, so outputs agree with kda_prepare_kernel's to 16-bit rounding (P, W, U: a last-bit
// difference where the fp32 sums differ in their last bits), not bit for bit; Kd, Qg and G's last row are
// bit-identical (the same element expressions on the same inputs).
//
// Backward recompute (kda_prepare_wgmma_kernel<T, true>, launch_kda_bwd_recompute_wgmma; the tiled backward's
// default on Hopper, DELTACP_TILED_BWD_KDA_RECOMPUTE_WGMMA=0 keeps the three kernels, tiled_bwd.cu): in place of the backward's gate cumsum,
// chunk_wy_kernel<T, true> and stage B0 (bwd_dv_local.cuh), the same kernel over the backward's chunk table writes
//   G        every row (fp32 [R, HV, 128]; the cumsum's bits: chunk_sum_gate sums in its order), by warpgroup 1 in
//            phase 3 beside Q e^G and Kd (the forward writes G's last row only)
//   T        fp32 [R, HV, 64] rows < len, or (t16, for the chunk-local kernel) rounded to 16 bits in the first 128
//            bytes of each row: warpgroup 0 right after the solve
//   Qg, Kd, W, U   as the forward (Q e^G is B0's write, which B1 reads)
//   dVn      B0's scale P^T dO (fp32 [R, HV, 128] rows < len): P's rows (all 64: those past len are zero, q's rows
//            are) go to a 64 x 64 16-bit block in shared memory (128-byte swizzle) instead of global memory, with the
//            rounding B0 gives them; dO (two 64 x 64 boxes by TMA, a third mbarrier) lands in A's bytes as soon as
//            warpgroup 0 has solved T, so its load runs under phases 3 and 4; phase 5: warpgroup h computes columns
//            64 h .. 64 h + 63, 4 x wgmma m64n64k16 with P^T read M-major and dO's block h MN-major (dO's rows past
//            len zeroed first, as B0's masked loads leave them)
// q and k are read as given (the backward takes them normalised: no qk_l2norm) and no P goes to global memory.
//
// Kept for the backward (Params::wy_stage; launch_kda_prepare_wgmma with G_rows and Tinv): a forward with a gradient
// writes, beside its usual outputs, every row of G (in place of G's last rows) and T rounded to 16 bits, with the
// code of the backward mode above, into the stage's planes, where W, Kd, Q e^G and P go too. The backward then reads
// them and runs only stage B0: b0_kept_kernel loads P's rows into the swizzled block the backward mode builds in
// shared memory (zero past len, as there) and runs the same phase 5 (b0_columns), so its gradients are the
// recompute's bits. It moves P and dO in and dVn out, 896 bytes per token-head where the recompute moves 3714 (q, k,
// v, g, beta and dO in: 1538; G, T, Q e^G, Kd, W, U and dVn out: 2176); the forward writes 640 more (G's rows, T).
// Against the three kernels it replaces: G, Kd and Q e^G are the same bits; A, P, W, U and dVn accumulate in wgmma's
// k order (as the forward stage against kda_prepare_kernel); the contract is agreement within the bf16 / fp16
// tolerances, and on the GPU tests the gradients came out the same bits. Measured (H100, bf16, (2,16384,16,128),
// stage_times.py --variant kda --backward): 0.81 ms where cumsum + chunk_wy + B0 took 0.22 + 0.86 + 0.53.
//
// Shared memory (bytes from a 1024-byte aligned base; KdaPrepWgSmem): Q 16 KB (later V), K 16 KB (later K e^G),
// Yr 20 KB (later T, 17 KB), G 34 KB (rows of 136 floats; later the W and U staging), A 17 KB (64 x 68 fp32),
// beta, the diagonal blocks' range flags and two mbarriers: 105,760 bytes, with the alignment slack 106,784:
// two CTAs per SM (16 warps) on an H100/H200. The backward mode adds P's block (8 KB, after A) and a third mbarrier:
// 113,960 bytes, 114,984 with the slack, still two CTAs per SM. 32 bytes of static shared memory beside it: the
// four warps' range of the raw gate for safe_gate's check (phase 1).
//
// V = 256 (NVIDIA H200, 2026-11-28, bf16 kda (8,2048,32,128,256), FLA's benchmark keywords, the fused forward in
// bench_gpu.py beside FLA 0.5.2): 1.128 ms with this stage (FLA 2.440) against 1.596 with kda_prepare_kernel (FLA
// 2.459, an earlier run).
// Measured (NVIDIA H100, 2026-11-27, bf16, bench/gpu/stage_times.py --variant kda --backend fused, kernel time
// per forward): (2,16384,16,128) 0.597 ms where kda_prepare_kernel takes 1.009 (its bytes alone, 2442 per token
// and head, are about 0.43 ms at 3 TB/s); the fused kda forward 1.431 -> 1.017 ms of kernels. Beside FLA (same
// run, bench_gpu.py): kda forward 1.155 ms at (2,16384,16,128) (FLA 2.274), 1.520 at (1,8192,96,128) (3.231),
// 2.014 at (4,4096,64,128) (4.236), 0.324 at (4,2048,16,128) (1.298).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "../common/check.h"
#include "../common/device_info.h"
#include "../common/gate_range.cuh"
#include "../common/tma.cuh"
#include "chunk_table.cuh"
#include "fwd_mma.cuh"
#include "fwd_stages.cuh"
#include "kda_scores.cuh"
#include "wgmma_ops.cuh"
#include "wy_solve.cuh"
#include "deltacp/params.h"

namespace deltacp::cuda::tiled {

template <class T>
struct KdaPrepWgArgs {
  TileMap16 tm_q, tm_k, tm_v;  // [B, T, H or HV, 128] as the caller strides them: boxes of 64 columns x 64 tokens
  FwdArgs<T> f;                // chunks, beta, the raw gate (g32 or g16), g_last, qk_l2norm, HV, group
  T* W = nullptr;              // [R, HV, 128]
  T* U = nullptr;              // [R, HV, vcols]
  int vcols = 128;             // V: 128, or 256 in the forward (the second half of U by warpgroup 0 after W)
  T* Kd = nullptr;             // [R, HV, 128]
  T* P = nullptr;              // [R, HV, 64] (the forward; the backward's recompute keeps P in shared memory)
  T* Qg = nullptr;             // [R, HV, 128]
  // The backward's recompute (kda_prepare_wgmma_kernel<T, true>): every row of G, T and B0's scale P^T dO.
  TileMap16 tm_do;             // dO [B, T, HV, 128]: boxes of 64 columns x 64 tokens
  float* G = nullptr;          // [R, HV, 128] fp32: G of every token (the cumsum stage's bits)
  float* Tinv = nullptr;       // [R, HV, 64] fp32: row i of the chunk's T (t16: rounded, the first 128 bytes)
  float* dvl = nullptr;        // [R, HV, 128] fp32: scale P^T dO
  float scale = 1.f;
  bool t16 = false;
};

// Byte offsets of the shared-memory regions (from the 1024-byte aligned base). kBwd (the backward's recompute) adds
// P's 64 x 64 block (16-bit, 128-byte swizzle: B0's A operand, read M-major) after A and a third mbarrier (dO);
// dO lands in A's bytes once T is solved.
template <bool kBwd = false>
struct KdaPrepWgSmemT {
  static constexpr int kBox = 64 * 128;           // one 64 x 64 box of 16-bit elements
  static constexpr int kLdg = 136;                // G's rows (floats)
  static constexpr int kLdA = 68;                 // A and T rows (floats): 4 mod 32, as wy_solve.cuh wants
  static constexpr int kYrBytes = 80 * 256;       // one round of rescaled Y rows (80 rows of 128 keys)
  static constexpr int q = 0;                     // Q tile; V after phase 3
  static constexpr int k = q + 2 * kBox;          // K tile; K e^G after phase 3
  static constexpr int yr = k + 2 * kBox;         // Yr; T after phase 2
  static constexpr int g = yr + kYrBytes;         // G (fp32); W and U staged after phase 3
  static constexpr int a = g + 64 * kLdg * 4;     // A (fp32; the solve's N in place); dO after the solve (kBwd)
  static constexpr int p = a + 64 * kLdA * 4;     // P (kBwd only)
  static constexpr int beta = p + (kBwd ? kBox : 0);  // beta per row (0 past the chunk)
  static constexpr int flags = beta + 256;        // bit a: block (a, a) left the tensor cores' safe range
  static constexpr int bar = flags + 16;          // mbarriers: Q and K, then V (then dO)
  static constexpr int bytes = bar + (kBwd ? 24 : 16) + 1024;  // plus the alignment slack
  static constexpr int v = q, t = yr, w_stage = g, u_stage = g + 2 * kBox, dO = a;
};
using KdaPrepWgSmem = KdaPrepWgSmemT<false>;
static_assert(64 * KdaPrepWgSmem::kLdA * 4 <= KdaPrepWgSmem::kYrBytes, "T must fit in Yr's region");
static_assert(4 * KdaPrepWgSmem::kBox <= 64 * KdaPrepWgSmem::kLdg * 4, "the W and U staging must fit in G's region");
static_assert(KdaPrepWgSmem::bytes == 106784, "the size the opening comment gives");
static_assert(2 * (KdaPrepWgSmem::bytes + 1024) <= 228 * 1024, "two CTAs per SM on sm_90");
static_assert(KdaPrepWgSmemT<true>::dO % 1024 == 0 && KdaPrepWgSmemT<true>::p % 1024 == 0,
              "the dO tile and P's block take the 128-byte swizzle: 1024-byte aligned");
static_assert(2 * KdaPrepWgSmem::kBox <= 64 * KdaPrepWgSmem::kLdA * 4, "dO must fit in A's region");
static_assert(KdaPrepWgSmemT<true>::bytes == 114984, "the size the opening comment gives (backward)");
static_assert(2 * (KdaPrepWgSmemT<true>::bytes + 1024) <= 228 * 1024, "two CTAs per SM on sm_90 (backward)");


#ifdef DELTACP_WGMMA_DEVICE
// d (64 x N fp32; N = 16, 32, 48 or 64) = A (64 x 16, registers) B (16 x N, K-major descriptor) + (scale_d ? d : 0).
template <class T, int N>
__device__ __forceinline__ void wgmma_rs_kmajor(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, int scale_d) {
  constexpr bool kBf = std::is_same<T, __nv_bfloat16>::value;
  static_assert(N == 16 || N == 32 || N == 48 || N == 64, "m64n16, n32, n48 or n64");
  if constexpr (N == 64) {
    wgmma_n64_rs<T>(d, a, b, scale_d);
  } else if constexpr (N == 16) {
    if constexpr (kBf) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
    } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
    }
  } else if constexpr (N == 32) {
    if constexpr (kBf) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
    } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
    }
  } else if constexpr (N == 48) {
    if constexpr (kBf) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
    } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, {%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
    }
  }
}
#endif

#ifdef DELTACP_WGMMA_DEVICE
namespace kda_prep_wg {
constexpr int kLdg = KdaPrepWgSmem::kLdg, kLdA = KdaPrepWgSmem::kLdA;

// Where P's element (i, j) goes: row i of the chunk's P in global memory (rows p_ld apart), or (kPs, the backward)
// the swizzled 64 x 64 block in shared memory (row i at 128 i, 16-byte piece j / 8 at ((j / 8) ^ i) % 8).
template <bool kPs, class T>
__device__ __forceinline__ T* p_at(T* Pc, int p_ld, int i, int j) {
  if constexpr (kPs)
    return reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(Pc) + i * 128 + ((((j >> 3) ^ i) & 7) << 4) +
                                (j & 7) * 2);
  else
    return Pc + static_cast<int64_t>(i) * p_ld + j;
}

// Byte offset of the 16-byte piece pc (keys 8 pc .. 8 pc + 7) of row r in a swizzled tile of n rows x 128 keys
// (two blocks of n rows x 64 keys, n * 128 bytes apart): the piece's place in its 128-byte row is pc ^ (r % 8).
__device__ __forceinline__ int piece_at(int n, int r, int pc) {
  return (pc >> 3) * n * 128 + r * 128 + (((pc & 7) ^ (r & 7)) << 4);
}
// Byte offset of keys c, c + 1 (c even) of row r in a swizzled 64 x 128 tile.
__device__ __forceinline__ int pair_at(int r, int c) { return piece_at(64, r, c >> 3) + (c & 7) * 2; }

// Rows len .. 63 of a swizzled 64 x 128 tile: zero (after its boxes landed), by nthr threads from thread 0 of them.
__device__ __forceinline__ void zero_tail_rows(unsigned char* tile, int len, int thr, int nthr) {
  if (len < 64)
    for (int idx = thr; idx < 2 * 64 * 8; idx += nthr) {
      const int row = (idx >> 3) & 63;
      if (row >= len) *reinterpret_cast<uint4*>(tile + idx * 16) = make_uint4(0u, 0u, 0u, 0u);
    }
}

// l2norm_rows's arithmetic (tiled_fwd.cu's l2norm_row_pieces) on row r of a swizzled tile, so the row gets the
// bits that function (and cuda/common/l2norm.cu) gives.
template <class T>
__device__ __forceinline__ void l2norm_row(unsigned char* tile, int r) {
  l2norm_row_pieces<T>([&](int pc) { return reinterpret_cast<T*>(tile + piece_at(64, r, pc)); });
}

// This warp's 16 rows of X scaled around its reference row r = 16 w, X_id e^(G_id - G_rd) rounded to T, as the
// A fragments of the 8 k-steps (keys 16 kk .. 16 kk + 15): xf[kk][2 h + rr] holds row 16 w + g + 8 rr, keys
// 16 kk + 8 h + 2 t and + 1 (wgmma_ops.cuh's fragment layout).
// Only warp w's own product rows use them, and a round keeps the rows of two warps: the others pass zeros
// (needed = false) and each warp scales its rows once.
template <class T>
__device__ __forceinline__ void scaled_row_fragments(uint32_t (&xf)[8][4], const unsigned char* X, const float* G,
                                                     int w, int g, int t, bool needed) {
  if (!needed) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) xf[kk][e] = 0u;
    return;
  }
  const int r = 16 * w;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = 16 * kk + 8 * h + 2 * t;
      const float2 gr = *reinterpret_cast<const float2*>(G + r * kLdg + c);
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int i = r + g + 8 * rr;
        const float2 x = unpack2<T>(*reinterpret_cast<const uint32_t*>(X + pair_at(i, c)));
        const float2 gi = *reinterpret_cast<const float2*>(G + i * kLdg + c);
        xf[kk][2 * h + rr] = pack2<T>(x.x * exp_t<T>(gi.x - gr.x), x.y * exp_t<T>(gi.y - gr.y));
      }
    }
}

// One round of Y's rescaled rows: Yr_AB (rows 0 .. 16 AB + 15, at yr) and Yr_AS (rows 0 .. 16 AS + 15, after it),
// Yr_a's row j = K_j e^(G_r - G_j) with r = 16 a, rounded to T, in the swizzled K-major layout (piece_at with n =
// the block's rows). Rows j >= r (the diagonal block's) only for bf16, with kda_scores.cuh's range check: returns
// bit a set where one of them leaves it. 256 threads, 16-byte pieces.
template <class T, int AB, int AS>
__device__ __forceinline__ unsigned scale_y_round(unsigned char* yr, const unsigned char* K, const float* G, int tid,
                                                  bool unit_rows) {
  constexpr bool kDiagTc = std::is_same<T, __nv_bfloat16>::value;
  constexpr int NB = 16 * (AB + 1), NS = 16 * (AS + 1);
  static_assert((NB + NS) * 16 % 256 == 0, "whole rounds of 256 pieces");
  unsigned bad = 0;
#pragma unroll
  for (int it = 0; it < (NB + NS) * 16 / 256; ++it) {
    const int idx = tid + 256 * it, q = idx >> 4, pc = idx & 15;
    const bool big = q < NB;
    const int a = big ? AB : AS, j = big ? q : q - NB, n = big ? NB : NS, r = 16 * a;
    if (!kDiagTc && j >= r) continue;  // fp16: the diagonal blocks go element by element
    float x[8], gj[8], gr[8], ex[8];
    load8f(G + r * kLdg + 8 * pc, gr);
    load8(reinterpret_cast<const T*>(K + piece_at(64, j, pc)), x);
    load8f(G + j * kLdg + 8 * pc, gj);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      ex[e] = gr[e] - gj[e];
      x[e] *= exp_t<T>(ex[e]);
    }
    if (j >= r) {
      bool b = false;
#pragma unroll
      for (int e = 0; e < 8; ++e) b |= diag_refused(ex[e], x[e], unit_rows);
      if (b) bad |= 1u << a;
    }
    store8(reinterpret_cast<T*>(yr + (big ? 0 : 2 * NB * 128) + piece_at(n, j, pc)), x);
  }
  return bad;
}

// The products of one round: accB = X' Yr_AB^T (64 x NB), accS = X' Yr_AS^T (64 x NS), X' this warpgroup's scaled
// rows (fragments), K = the 128 keys in 8 steps.
template <class T, int AB, int AS>
__device__ __forceinline__ void score_round(uint32_t (&xf)[8][4], uint32_t yr, float (&accB)[8 * (AB + 1)],
                                            float (&accS)[8 * (AS + 1)]) {
  constexpr int NB = 16 * (AB + 1), NS = 16 * (AS + 1);
#pragma unroll
  for (int i = 0; i < NB / 2; ++i) accB[i] = 0.f;
#pragma unroll
  for (int i = 0; i < NS / 2; ++i) accS[i] = 0.f;
  wg_fence();
  reg_fence(accB);
  reg_fence(accS);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const uint32_t off = (kk & 3) * 32;
    wgmma_rs_kmajor<T, NB>(accB, xf[kk], wg_desc(yr + (kk >> 2) * NB * 128 + off, 16, 1024), 1);
    wgmma_rs_kmajor<T, NS>(accS, xf[kk], wg_desc(yr + 2 * NB * 128 + (kk >> 2) * NS * 128 + off, 16, 1024), 1);
  }
  wg_commit();
  wg_wait_all();
  reg_fence(accB);
  reg_fence(accS);
  reg_fence(xf);
}

// Row block a = N / 16 - 1 of A (warpgroup 0: As[i][j] = beta_i x, strict) or of P (warpgroup 1: rows < len to
// global, 16-bit, inclusive, zeros right of the diagonal block) from the product with Yr_a, by warp a. The diagonal
// block's columns are written here only when it went through the tensor cores (tc_diag). kPs: P into the
// shared-memory block (p_at).
template <class T, int N, bool kPs = false>
__device__ __forceinline__ void score_rows_out(const float (&acc)[N / 2], int wg, bool tc_diag, float* As,
                                               const float* bs, T* Pc, int p_ld, int len, int g, int t) {
  constexpr int a = N / 16 - 1;
  const int i0 = 16 * a + g, i1 = i0 + 8;
  if (wg == 0) {
    const float b0 = bs[i0], b1 = bs[i1];
#pragma unroll
    for (int nb = 0; nb < N / 8; ++nb) {
      const int j = 8 * nb + 2 * t;
      if (nb < 2 * a) {
        *reinterpret_cast<float2*>(As + i0 * kLdA + j) = make_float2(b0 * acc[4 * nb], b0 * acc[4 * nb + 1]);
        *reinterpret_cast<float2*>(As + i1 * kLdA + j) = make_float2(b1 * acc[4 * nb + 2], b1 * acc[4 * nb + 3]);
      } else if (tc_diag) {  // mask before scaling, as kda_scores' diagonal block writes 0 above the diagonal
        *reinterpret_cast<float2*>(As + i0 * kLdA + j) =
            make_float2(b0 * (j < i0 ? acc[4 * nb] : 0.f), b0 * (j + 1 < i0 ? acc[4 * nb + 1] : 0.f));
        *reinterpret_cast<float2*>(As + i1 * kLdA + j) =
            make_float2(b1 * (j < i1 ? acc[4 * nb + 2] : 0.f), b1 * (j + 1 < i1 ? acc[4 * nb + 3] : 0.f));
      }
    }
  } else {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int i = rr ? i1 : i0;
      if (i >= len) continue;
#pragma unroll
      for (int nb = 0; nb < 8; ++nb) {
        const int j = 8 * nb + 2 * t;
        uint32_t v = 0u;
        if (nb < 2 * a) {
          v = pack2<T>(acc[4 * nb + 2 * rr], acc[4 * nb + 2 * rr + 1]);
        } else if (nb < 2 * a + 2) {
          if (!tc_diag) continue;  // element by element below
          v = pack2<T>(j <= i ? acc[4 * nb + 2 * rr] : 0.f, j + 1 <= i ? acc[4 * nb + 2 * rr + 1] : 0.f);
        }
        *reinterpret_cast<uint32_t*>(p_at<kPs>(Pc, p_ld, i, j)) = v;
      }
    }
  }
}

// Diagonal block (a, a) element by element: kda_scores.cuh's loop (lane: row 16 a + lane % 16, half the keys;
// the same fmaf order and e^(G_id - G_jd) masked to 0 before the exponential above the diagonal), X = K and the
// strict mask into A (warpgroup 0) or X = Q and the inclusive mask into P (warpgroup 1; kPs: p_at).
template <class T, bool kPs = false>
__device__ __forceinline__ void diag_block_elementwise(const unsigned char* X, const unsigned char* Y, const float* G,
                                                       int a, int lane, int len, int wg, float* As, const float* bs,
                                                       T* Pc, int p_ld) {
  const bool inclusive = wg == 1;
  const int il = lane & 15, half = lane >> 4;
  const int i = 16 * a + il;
  const bool active = 16 * a < len;
  float part[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) part[j] = 0.f;
  if (active) {
    for (int d0 = half * 64; d0 < (half + 1) * 64; d0 += 8) {
      float xi[8], gi[8];
      load8(reinterpret_cast<const T*>(X + piece_at(64, i, d0 >> 3)), xi);
      load8f(G + i * kLdg + d0, gi);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int jj = 16 * a + j;
        const bool lower = inclusive ? (j <= il) : (j < il);
        float yj[8], gj[8];
        load8(reinterpret_cast<const T*>(Y + piece_at(64, jj, d0 >> 3)), yj);
        load8f(G + jj * kLdg + d0, gj);
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
      const float x = (active && lower) ? part[j] : 0.f;
      if (wg == 0) {
        As[i * kLdA + 16 * a + j] = bs[i] * x;
      } else if (i < len) {
        *p_at<kPs>(Pc, p_ld, i, 16 * a + j) = from_f<T>(x);
      }
    }
  }
}

// The first len rows staged by stage_rows<T, 128> (wy_wgmma.cuh's layout) to columns col0 .. col0 + 127 of rows
// row0 .. of a [R, HV, ld] tensor, by one warpgroup (thr = 0 .. 127 within it): 16 bytes a thread, whole rows per 16
// threads.
template <class T>
__device__ __forceinline__ void store_staged_rows(T* dst, const unsigned char* src, int64_t row0, int64_t HV,
                                                  int64_t hv, int len, int thr, int ld = 128, int col0 = 0) {
  const int piece = thr & 15, r0 = thr >> 4;
#pragma unroll
  for (int it = 0; it < 8; ++it) {
    const int r = r0 + 8 * it;
    if (r < len)
      *reinterpret_cast<uint4*>(dst + ((row0 + r) * HV + hv) * ld + col0 + piece * 8) =
          *reinterpret_cast<const uint4*>(src + r * 256 + ((piece ^ (r & 7)) << 4));
  }
}
// B0's dVn_local = scale P^T dO for warpgroup wg's value columns 64 wg .. 64 wg + 63, into a.dvl: A = P^T (P's
// swizzled 64 x 64 block at p_addr, read M-major), B = dO's block wg at dob (64 tokens x 64 columns, swizzled, landed;
// its rows past len are zeroed here, as B0's masked loads leave them; P's rows there are zero), K = the chunk's 64
// tokens. The recompute's phase 5 and b0_kept_kernel both run this, so the two give the same bits.
template <class T>
__device__ __forceinline__ void b0_columns(const KdaPrepWgArgs<T>& a, uint32_t p_addr, unsigned char* dob,
                                           int64_t row0, int64_t hv, int len, int wg, int thr, int wi, int g, int t) {
  const int64_t HV = a.f.HV;
  if (len < 64)
    for (int idx = thr; idx < 64 * 8; idx += 128)
      if ((idx >> 3) >= len) *reinterpret_cast<uint4*>(dob + idx * 16) = make_uint4(0u, 0u, 0u, 0u);
  fence_proxy_async();
  warpgroup_bar(wg);
  float dv[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) dv[i] = 0.f;
  wg_fence();
  reg_fence(dv);
  const uint32_t do_addr = smem_u32(dob);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_ss<T, 64, 1, 1>(dv, wg_desc(p_addr + kk * 2048, 8192, 1024), wg_desc(do_addr + kk * 2048, 8192, 1024), 1);
  wg_commit();
  wg_wait_all();
  reg_fence(dv);
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * wi + g + 8 * h;
      if (r < len)
        *reinterpret_cast<float2*>(a.dvl + ((row0 + r) * HV + hv) * 128 + 64 * wg + 8 * nb + 2 * t) =
            make_float2(a.scale * dv[4 * nb + 2 * h], a.scale * dv[4 * nb + 2 * h + 1]);
    }
}
}  // namespace kda_prep_wg
#endif  // DELTACP_WGMMA_DEVICE

// kBwd: the backward's recompute (the opening comment's "Backward recompute").
template <class T, bool kBwd = false>
__global__ void __launch_bounds__(256, 2) kda_prepare_wgmma_kernel(const __grid_constant__ KdaPrepWgArgs<T> a) {
#ifdef DELTACP_WGMMA_DEVICE
  using S = KdaPrepWgSmemT<kBwd>;
  using namespace kda_prep_wg;
  constexpr bool kDiagTc = std::is_same<T, __nv_bfloat16>::value;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const FwdArgs<T>& f = a.f;
  float* Gt = reinterpret_cast<float*>(smem + S::g);
  float* As = reinterpret_cast<float*>(smem + S::a);
  float* Ts = reinterpret_cast<float*>(smem + S::t);
  float* bs = reinterpret_cast<float*>(smem + S::beta);
  volatile unsigned* flags = reinterpret_cast<volatile unsigned*>(smem + S::flags);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + S::bar);
  const int tid = threadIdx.x, wg = tid >> 7, thr = tid & 127, wi = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const ChunkEntry ce = f.chunks[blockIdx.x];
  const int64_t hv = blockIdx.y, HV = f.HV, hk = hv / f.group;
  const int len = static_cast<int>(ce.len);
  const int t0 = static_cast<int>(ce.t0), b = static_cast<int>(ce.batch);

  // ---- phase 0: loads ----
  if (tid == 0) {
    mbar_init(bars, 1);
    mbar_init(bars + 1, 1);
    if constexpr (kBwd) mbar_init(bars + 2, 1);
    fence_mbar_init();
    *flags = 0u;
    const int h = static_cast<int>(hk);
    mbar_expect_tx(bars, 4 * S::kBox);
    tma_load_4d(smem + S::q, &a.tm_q.map, bars, 0, h, t0, b);
    tma_load_4d(smem + S::q + S::kBox, &a.tm_q.map, bars, 64, h, t0, b);
    tma_load_4d(smem + S::k, &a.tm_k.map, bars, 0, h, t0, b);
    tma_load_4d(smem + S::k + S::kBox, &a.tm_k.map, bars, 64, h, t0, b);
  }
  load_raw_gate(Gt, kLdg, f, ce, hv);  // zero past len (the sums below then repeat G's last row there)
  cp_async_commit();
  if (tid < 64) bs[tid] = tid < len ? to_f(*f.beta.at(ce.batch, ce.t0 + tid, hv)) : 0.f;
  cp_async_wait<0>();
  __syncthreads();  // the mbarriers are initialised; the raw gate and beta are in shared memory
  mbar_wait(bars, 0);
  zero_tail_rows(smem + S::q, len, tid, 256);
  zero_tail_rows(smem + S::k, len, tid, 256);
  __syncthreads();

  // ---- phase 1: G in place (G's last row out) beside the l2 norm of q's and k's rows ----
  // With safe_gate's range check (f.gate_range) the sum also takes each column's smallest and largest raw value, a
  // warp's in gate_red, and thread 0 publishes the chunk's after the barrier: two atomics a CTA.
  __shared__ int gate_red[2][4];
  if (wg == 0) {
    if (!kBwd && f.gate_range != nullptr) {
      int lo = INT_MAX, hi = INT_MIN;
      chunk_sum_gate<T, true>(Gt, kLdg, f, ce, hv, &lo, &hi);  // one thread per key column (threads 0 .. 127)
      warp_key_range(lo, hi);
      if (lane == 0) {
        gate_red[0][wi] = lo;
        gate_red[1][wi] = hi;
      }
    } else {
      chunk_sum_gate(Gt, kLdg, f, ce, hv);  // one thread per key column (threads 0 .. 127)
    }
  } else if (f.qk_l2norm) {
    l2norm_row<T>(smem + (thr < 64 ? S::q : S::k), thr & 63);
  }
  __syncthreads();
  if (!kBwd && f.gate_range != nullptr && tid == 0) {
    publish_key_range(f.gate_range, min(min(gate_red[0][0], gate_red[0][1]), min(gate_red[0][2], gate_red[0][3])),
                      max(max(gate_red[1][0], gate_red[1][1]), max(gate_red[1][2], gate_red[1][3])));
  }

  // ---- phase 2: A (warpgroup 0, X = K) and P (warpgroup 1, X = Q) ----
  // Row i of the chunk's P at Pc + i * p_ld; the backward's in the shared-memory block (p_at), every row (those
  // past len are zero: q's rows are), as B0's product reads them all.
  T* Pc = kBwd ? reinterpret_cast<T*>(smem + S::p) : a.P + (ce.row0 * HV + hv) * 64;
  const int p_ld = static_cast<int>(HV * 64);    // HV <= 65535: 64 rows of it stay below 2^31
  const int plen = kBwd ? 64 : len;
  const uint32_t yr = smem_u32(smem + S::yr);
  {
    const unsigned bad = scale_y_round<T, 3, 0>(smem + S::yr, smem + S::k, Gt, tid, f.unit_rows);
    if (bad) atomicOr(const_cast<unsigned*>(flags), bad);
    fence_proxy_async();  // Yr: read by the products
    __syncthreads();
    uint32_t xf[8][4];
    scaled_row_fragments<T>(xf, smem + (wg == 0 ? S::k : S::q), Gt, wi, g, t, wi == 3 || wi == 0);
    float accB[32], accS[8];
    score_round<T, 3, 0>(xf, yr, accB, accS);
    const unsigned wide = *flags;
    if (wi == 3) score_rows_out<T, 64, kBwd>(accB, wg, kDiagTc && !((wide >> 3) & 1u), As, bs, Pc, p_ld, plen, g, t);
    if (wi == 0) score_rows_out<T, 16, kBwd>(accS, wg, kDiagTc && !(wide & 1u), As, bs, Pc, p_ld, plen, g, t);
  }
  __syncthreads();  // both warpgroups' products have read Yr
  {
    const unsigned bad = scale_y_round<T, 2, 1>(smem + S::yr, smem + S::k, Gt, tid, f.unit_rows);
    if (bad) atomicOr(const_cast<unsigned*>(flags), bad);
    fence_proxy_async();
    __syncthreads();
    uint32_t xf[8][4];
    scaled_row_fragments<T>(xf, smem + (wg == 0 ? S::k : S::q), Gt, wi, g, t, wi == 2 || wi == 1);
    float accB[24], accS[16];
    score_round<T, 2, 1>(xf, yr, accB, accS);
    const unsigned wide = *flags;
    if (wi == 2) score_rows_out<T, 48, kBwd>(accB, wg, kDiagTc && !((wide >> 2) & 1u), As, bs, Pc, p_ld, plen, g, t);
    if (wi == 1) score_rows_out<T, 32, kBwd>(accS, wg, kDiagTc && !((wide >> 1) & 1u), As, bs, Pc, p_ld, plen, g, t);
  }
  {  // the diagonal blocks that stayed off the tensor cores (fp16: all of them)
    const unsigned wide = *flags;
    if (!kDiagTc || ((wide >> wi) & 1u))
      diag_block_elementwise<T, kBwd>(smem + (wg == 0 ? S::k : S::q), smem + S::k, Gt, wi, lane, wg == 0 ? len : plen,
                                      wg, As, bs, Pc, p_ld);
  }
  if constexpr (kBwd) fence_proxy_async();  // P's block: read by B0's products
  __syncthreads();  // A is complete; Yr, and Q and K as the scores read them, are dead

  // ---- phase 3: T (warpgroup 0) beside Q e^G, Kd out and K <- K e^G (warpgroup 1), then V ----
  if (wg == 0) {
    unit_lower_inverse_64_tf32(As, Ts, kLdA, thr, [] { warpgroup_bar(0); });  // ends on the warpgroup's barrier
    if constexpr (kBwd) {
      fence_proxy_async();
      warpgroup_bar(0);  // every read of A is done: dO may land there
      if (thr == 0) {
        mbar_expect_tx(bars + 2, 2 * S::kBox);
        tma_load_4d(smem + S::dO, &a.tm_do.map, bars + 2, 0, static_cast<int>(hv), t0, b);
        tma_load_4d(smem + S::dO + S::kBox, &a.tm_do.map, bars + 2, 64, static_cast<int>(hv), t0, b);
      }
    }
    if (kBwd || a.Tinv != nullptr) {  // the backward's recompute, or a forward that keeps its stage (a.Tinv set)
      // T's rows < len (B3 / the chunk-local kernel): fp32, or rounded (t16) in the first 128 bytes of each row.
      if (a.t16) {
        for (int idx = thr; idx < 64 * 8; idx += 128) {
          const int r = idx >> 3, c8 = idx & 7;
          if (r < len) {
            const float4 x = *reinterpret_cast<const float4*>(Ts + r * kLdA + 8 * c8);
            const float4 y = *reinterpret_cast<const float4*>(Ts + r * kLdA + 8 * c8 + 4);
            *reinterpret_cast<uint4*>(reinterpret_cast<char*>(a.Tinv + ((ce.row0 + r) * HV + hv) * 64) + 16 * c8) =
                make_uint4(pack2<T>(x.x, x.y), pack2<T>(x.z, x.w), pack2<T>(y.x, y.y), pack2<T>(y.z, y.w));
          }
        }
      } else {
        for (int idx = thr; idx < 64 * 16; idx += 128) {
          const int r = idx >> 4, c4 = idx & 15;
          if (r < len)
            *reinterpret_cast<float4*>(a.Tinv + ((ce.row0 + r) * HV + hv) * 64 + 4 * c4) =
                *reinterpret_cast<const float4*>(Ts + r * kLdA + 4 * c4);
        }
      }
    }
  } else {
    const float* Glast = Gt + (len - 1) * kLdg;
    const int pc = thr & 15;
#pragma unroll 2
    for (int it = 0; it < 8; ++it) {
      const int i = (thr >> 4) + 8 * it, o = piece_at(64, i, pc);
      float qv[8], kv[8], gv[8], gl[8], kd[8];
      load8(reinterpret_cast<const T*>(smem + S::q + o), qv);
      load8(reinterpret_cast<const T*>(smem + S::k + o), kv);
      load8f(Gt + i * kLdg + 8 * pc, gv);
      load8f(Glast + 8 * pc, gl);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float eg = exp_t<T>(gv[e]);  // kda_prepare_kernel's e^G for Q and K: the same value
        qv[e] *= eg;
        kd[e] = kv[e] * exp_t<T>(gl[e] - gv[e]);
        kv[e] *= eg;
      }
      if (i < len) {
        const int64_t row = (ce.row0 + i) * HV + hv;
        store8(a.Qg + row * 128 + 8 * pc, qv);
        store8(a.Kd + row * 128 + 8 * pc, kd);
        if (kBwd || a.G != nullptr) {  // G's row (the cumsum stage's bits: chunk_sum_gate sums in its order)
          float4* gd = reinterpret_cast<float4*>(a.G + row * 128 + 8 * pc);
          gd[0] = make_float4(gv[0], gv[1], gv[2], gv[3]);
          gd[1] = make_float4(gv[4], gv[5], gv[6], gv[7]);
        }
      }
      store8(reinterpret_cast<T*>(smem + S::k + o), kv);
    }
    fence_proxy_async();  // K e^G: read by W's products
    warpgroup_bar(1);     // every read of Q is done: V may land there
    if (thr == 0) {
      mbar_expect_tx(bars + 1, 2 * S::kBox);
      tma_load_4d(smem + S::v, &a.tm_v.map, bars + 1, 0, static_cast<int>(hv), t0, b);
      tma_load_4d(smem + S::v + S::kBox, &a.tm_v.map, bars + 1, 64, static_cast<int>(hv), t0, b);
    }
  }
  __syncthreads();  // T and K e^G are complete; G is dead

  // ---- phase 4: W = (T Beta)(K e^G) (warpgroup 0), U = (T Beta) V (warpgroup 1) ----
  uint32_t fr[4][4];  // T Beta, this warp's rows 16 wi + g (+ 8), k-step kk: tokens 16 kk .. 16 kk + 15
  {
    const int i0 = 16 * wi + g, i1 = i0 + 8;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = 16 * kk + 8 * h + 2 * t;
        const float2 ta = *reinterpret_cast<const float2*>(Ts + i0 * kLdA + j);
        const float2 tb = *reinterpret_cast<const float2*>(Ts + i1 * kLdA + j);
        const float s0 = bs[j], s1 = bs[j + 1];
        fr[kk][2 * h] = pack2<T>(ta.x * s0, ta.y * s1);
        fr[kk][2 * h + 1] = pack2<T>(tb.x * s0, tb.y * s1);
      }
  }
  // V = 256 (the forward): T's bytes (Yr's region, 20 KB) are dead once every warp has its T Beta fragments; V's
  // columns 128 .. 255 land there, on the Q and K tiles' mbarrier in its second phase.
  const bool wide_v = !kBwd && a.vcols == 256;
  if (wide_v) {
    fence_proxy_async();
    __syncthreads();
    if (tid == 0) {
      mbar_expect_tx(bars, 2 * S::kBox);
      tma_load_4d(smem + S::yr, &a.tm_v.map, bars, 128, static_cast<int>(hv), t0, b);
      tma_load_4d(smem + S::yr + S::kBox, &a.tm_v.map, bars, 192, static_cast<int>(hv), t0, b);
    }
  }
  if (wg == 1) {
    mbar_wait(bars + 1, 0);
    zero_tail_rows(smem + S::v, len, thr, 128);
    fence_proxy_async();
    warpgroup_bar(1);
  }
  const uint32_t bt = smem_u32(smem + (wg == 0 ? S::k : S::v));
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;
  wg_fence();
  reg_fence(acc);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_n128_rs_tb<T>(acc, fr[kk], wg_desc(bt + kk * 2048, 8192, 1024));
  wg_commit();
  wg_wait_all();
  reg_fence(acc);
  reg_fence(fr);
  unsigned char* stage = smem + (wg == 0 ? S::w_stage : S::u_stage);
  stage_rows<T, 128>(stage, acc);
  warpgroup_bar(wg);
  if (wg == 0) {
    store_staged_rows<T>(a.W, stage, ce.row0, HV, hv, len, thr);
  } else {
    store_staged_rows<T>(a.U, stage, ce.row0, HV, hv, len, thr, a.vcols, 0);
  }
  if (wide_v && wg == 0) {  // U's columns 128 .. 255 = (T Beta) V[:, 128:], staged where W was
    mbar_wait(bars, 1);
    zero_tail_rows(smem + S::yr, len, thr, 128);
    fence_proxy_async();
    warpgroup_bar(0);  // also: every thread has stored its W rows from the staging tile
    const uint32_t bv = smem_u32(smem + S::yr);
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    wg_fence();
    reg_fence(acc);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_n128_rs_tb<T>(acc, fr[kk], wg_desc(bv + kk * 2048, 8192, 1024));
    wg_commit();
    wg_wait_all();
    reg_fence(acc);
    stage_rows<T, 128>(stage, acc);
    warpgroup_bar(0);
    store_staged_rows<T>(a.U, stage, ce.row0, HV, hv, len, thr, 256, 128);
  }

  // ---- phase 5 (the backward): B0's dVn_local = scale P^T dO, warpgroup wg the value columns 64 wg .. 64 wg + 63:
  // A = P^T (P's block read M-major), B = dO's block wg (MN-major), K = the chunk's 64 tokens ----
  if constexpr (kBwd) {
    mbar_wait(bars + 2, 0);
    b0_columns<T>(a, smem_u32(smem + S::p), smem + S::dO + wg * S::kBox, ce.row0, hv, len, wg, thr, wi, g, t);
  }
#else
  __trap();  // never launched: the host selects this kernel only for builds with sm_90a code
#endif
}

// Stage B0 alone over a stage the forward kept (Params::wy_stage): P's rows < len from its plane into the swizzled
// block (zero past len: the recompute's block holds zeros there), dO by TMA, then the recompute's phase 5
// (b0_columns): the same operands in shared memory, so kda's bits. gdn's P (wy_wgmma.cuh, the same block layout)
// goes through the same products; its recompute makes them as one m64n128 product per k-step where this kernel
// makes two m64n64 ones. One CTA of two warpgroups per (chunk, value head); 25 KB of shared memory. a: f.chunks
// and f.HV, P (the kept plane), tm_do, dvl and scale.
struct B0KeptSmem {
  static constexpr int kBox = KdaPrepWgSmem::kBox;
  static constexpr int p = 0, dO = kBox, bar = 3 * kBox;
  static constexpr int bytes = bar + 16 + 1024;  // plus the alignment slack
};
template <class T>
__global__ void __launch_bounds__(256) b0_kept_kernel(const __grid_constant__ KdaPrepWgArgs<T> a) {
#ifdef DELTACP_WGMMA_DEVICE
  using S = B0KeptSmem;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + S::bar);
  const int tid = threadIdx.x, wg = tid >> 7, thr = tid & 127, wi = (tid >> 5) & 3, lane = tid & 31;
  const ChunkEntry ce = a.f.chunks[blockIdx.x];
  const int64_t hv = blockIdx.y, HV = a.f.HV;
  const int len = static_cast<int>(ce.len);
  if (tid == 0) {
    mbar_init(bar, 1);
    fence_mbar_init();
    mbar_expect_tx(bar, 2 * S::kBox);
    tma_load_4d(smem + S::dO, &a.tm_do.map, bar, 0, static_cast<int>(hv), static_cast<int>(ce.t0),
                static_cast<int>(ce.batch));
    tma_load_4d(smem + S::dO + S::kBox, &a.tm_do.map, bar, 64, static_cast<int>(hv), static_cast<int>(ce.t0),
                static_cast<int>(ce.batch));
  }
  for (int idx = tid; idx < 64 * 8; idx += 256) {  // row r's 16-byte piece pc goes to piece (pc ^ r) % 8 of its row
    const int r = idx >> 3, pc = idx & 7;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (r < len) x = *reinterpret_cast<const uint4*>(a.P + ((ce.row0 + r) * HV + hv) * 64 + 8 * pc);
    *reinterpret_cast<uint4*>(smem + S::p + r * 128 + (((pc ^ r) & 7) << 4)) = x;
  }
  fence_proxy_async();  // P's block: read by the products
  __syncthreads();      // P is complete; the mbarrier is initialised
  mbar_wait(bar, 0);
  kda_prep_wg::b0_columns<T>(a, smem_u32(smem + S::p), smem + S::dO + wg * S::kBox, ce.row0, hv, len, wg, thr, wi,
                             lane >> 2, lane & 3);
#else
  __trap();  // never launched: the host selects this kernel only for builds with sm_90a code
#endif
}

// ---- host ----------------------------------------------------------------------------------------
// Why kda_prepare_wgmma_kernel cannot run p (nullptr: it can): the fused kda stage's needs (an sm_90a build, kda,
// 16-bit inputs, compute capability 9.0), then this kernel's own.
inline const char* kda_prepare_wgmma_refusal(const Params& p) {
  if (const char* why = kda_fused_prepare_refusal(p)) return why;
  if (p.K != 128 || (p.V != 128 && p.V != 256)) return "it takes K = 128 with V = 128 or 256";
  if (p.chunk_size < 1 || p.chunk_size > 64) return "it takes chunk_size <= 64";
  if (p.HV % p.H != 0 || p.HV > 65535) return "it takes HV a multiple of H and at most 65535";
  const int64_t es = dtype_size(p.dtype);
  for (const TensorRef* r : {&p.q, &p.k, &p.v}) {
    if (!rows_aligned16(*r, es))
      return "it reads q, k and v by TMA (their pointers and strides must be 16-byte aligned)";
    if (!steps_forward(*r, p.B, p.T, r == &p.v ? p.HV : p.H))
      return "it reads q, k and v through TMA tensor maps, which need positive strides";
  }
  if (p.B * p.T >= (int64_t{1} << 31)) return "it addresses token rows by TMA's 32-bit coordinates (B * T < 2^31)";
  return nullptr;
}

// Launches kda_prepare_wgmma_kernel over every chunk of the table: f as launch_kda_fused_prepare sets it up (the raw
// gate, g_last, qk_l2norm), outputs as kda_prepare_kernel's. A forward that keeps its stage for the backward
// (Params::wy_stage) also passes G_rows and Tinv: every row of G (f.g_last null) and T rounded to T's type in the
// first 128 bytes of each row, as the backward's recompute writes them.
template <class T>
void launch_kda_prepare_wgmma(const Params& p, const ChunkTable& table, const FwdArgs<T>& f, T* W, T* U, T* Kd, T* P,
                              T* Qg, cudaStream_t stream, float* G_rows = nullptr, float* Tinv = nullptr) {
  if (table.num_chunks() == 0) return;
  KdaPrepWgArgs<T> a;
  a.tm_q = token_rows_map(p.q, p.B, p.T, p.H, 128, "q");
  a.tm_k = token_rows_map(p.k, p.B, p.T, p.H, 128, "k");
  a.tm_v = token_rows_map(p.v, p.B, p.T, p.HV, p.V, "v");
  a.vcols = static_cast<int>(p.V);
  a.f = f;
  a.W = W;
  a.U = U;
  a.Kd = Kd;
  a.P = P;
  a.Qg = Qg;
  a.G = G_rows;
  a.Tinv = Tinv;
  a.t16 = Tinv != nullptr;
  auto kernel = kda_prepare_wgmma_kernel<T>;
  opt_in_smem(kernel, KdaPrepWgSmem::bytes, "K", "the wgmma kda stage needs ", KdaPrepWgSmem::bytes,
              " bytes of shared memory");
  const dim3 grid(static_cast<unsigned>(table.num_chunks()), static_cast<unsigned>(p.HV));
  kernel<<<grid, 256, KdaPrepWgSmem::bytes, stream>>>(a);
  DELTACP_CUDA_CHECK_LAUNCH();
}

// Why kda_prepare_wgmma_kernel<T, true> (the backward's recompute) cannot run p (nullptr: it can): the forward
// stage's limits, and dO read through a tensor map (B0's operand).
inline const char* kda_bwd_recompute_wgmma_refusal(const Params& p) {
  if (const char* why = kda_prepare_wgmma_refusal(p)) return why;
  if (p.V != 128) return "it takes K = V = 128";
  if (p.dout.ptr == nullptr) return "it folds in stage B0, which reads do (none given)";
  if (!rows_aligned16(p.dout, dtype_size(p.dtype)) || !steps_forward(p.dout, p.B, p.T, p.HV))
    return "it reads do by TMA (its pointer and strides must be 16-byte aligned and positive)";
  return nullptr;
}

// The kda backward's recompute over every chunk of the table: G (every row, fp32), W, U, Kd, T (fp32, or 16-bit
// with t16), Q e^G and stage B0's scale P^T dO into dvl ([R, HV, 128] fp32), from the raw gate p.g (q and k as
// given: the backward takes them normalised).
template <class T>
void launch_kda_bwd_recompute_wgmma(const Params& p, const ChunkTable& table, float* G, T* W, T* U, T* Kd,
                                    float* Tinv, bool t16, T* Qg, float* dvl, cudaStream_t stream) {
  if (table.num_chunks() == 0) return;
  KdaPrepWgArgs<T> a;
  a.tm_q = token_rows_map(p.q, p.B, p.T, p.H, 128, "q");
  a.tm_k = token_rows_map(p.k, p.B, p.T, p.H, 128, "k");
  a.tm_v = token_rows_map(p.v, p.B, p.T, p.HV, 128, "v");
  a.tm_do = token_rows_map(p.dout, p.B, p.T, p.HV, 128, "do");
  a.f = make_args<T>(p, table);
  if (p.g_fp32) {
    a.f.g32 = dev_rows<const float>(p.g);
  } else {
    a.f.g16 = dev_rows<const T>(p.g);
  }
  a.f.g_last = nullptr;  // every row goes to G
  a.f.qk_l2norm = false;  // (unit_rows from p: the backward's rows were normalised with the forward's)
  a.W = W;
  a.U = U;
  a.Kd = Kd;
  a.Qg = Qg;
  a.G = G;
  a.Tinv = Tinv;
  a.t16 = t16;
  a.dvl = dvl;
  a.scale = static_cast<float>(p.scale);
  using S = KdaPrepWgSmemT<true>;
  auto kernel = kda_prepare_wgmma_kernel<T, true>;
  opt_in_smem(kernel, S::bytes, "K", "the wgmma kda recompute needs ", S::bytes, " bytes of shared memory");
  const dim3 grid(static_cast<unsigned>(table.num_chunks()), static_cast<unsigned>(p.HV));
  kernel<<<grid, 256, S::bytes, stream>>>(a);
  DELTACP_CUDA_CHECK_LAUNCH();
}

// Stage B0 alone over the WY stage a forward kept (Params::wy_stage, gdn or kda): dvl ([R, HV, 128] fp32) =
// scale P^T dO from its P plane (launch_bwd_b0_kept checks that the recompute's wgmma kernel would run).
template <class T>
void launch_b0_kept_wgmma(const Params& p, const ChunkTable& table, const T* P, float* dvl, cudaStream_t stream) {
  if (table.num_chunks() == 0) return;
  KdaPrepWgArgs<T> a;
  a.tm_do = token_rows_map(p.dout, p.B, p.T, p.HV, 128, "do");
  a.f.chunks = table.chunks();
  a.f.HV = p.HV;
  a.P = const_cast<T*>(P);
  a.dvl = dvl;
  a.scale = static_cast<float>(p.scale);
  auto kernel = b0_kept_kernel<T>;
  opt_in_smem(kernel, B0KeptSmem::bytes, "K", "stage B0 over the kept WY stage needs ", B0KeptSmem::bytes,
              " bytes of shared memory");
  const dim3 grid(static_cast<unsigned>(table.num_chunks()), static_cast<unsigned>(p.HV));
  kernel<<<grid, 256, B0KeptSmem::bytes, stream>>>(a);
  DELTACP_CUDA_CHECK_LAUNCH();
}

}  // namespace deltacp::cuda::tiled
