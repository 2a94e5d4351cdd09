// cuda/fused/fused_chain.cuh — the fused forward's serial part: one CTA walks a sequence's (or a piece's)
// chunks with the state S in registers, doing every product that touches S, and writes the output.
//
// For a chunk of n <= 64 tokens with state S (K x V, fp32) at its start, G the within-chunk cumulative log
// decay, and W, U, P from the wgmma WY stage (cuda/tiled/wy_wgmma.cuh):
//
//   Vn = U - W S
//   O  = scale ( e^G (Q S) + P Vn )
//   S' = e^(G_n) S + (K e^(G_n - G))^T Vn
//
//   CTA       one per (sequence or piece, value head, 64 NWG state columns); NWG = 1 or 2 warpgroups of
//             128 threads, each owning 64 state columns (all 128 key rows) as an fp32 wgmma accumulator
//             (64 registers per thread), written transposed (S^T) so that every product that reads S takes
//             it straight from registers as the A operand
//   K = 64    (V = 64: KK = 64) the same steps on 64 key rows: one 64-column box per W, K and Q
//             tile, S^T an m64n64 accumulator (32 registers), half the k-steps in (1) and n64 products in (3);
//             one warpgroup per CTA (one column tile), two in the map mode (V + K = 128 columns)
//   loads     by TMA (../common/tma.cuh), kStages deep (3 with one warpgroup, 2 with two: what fits in
//             shared memory): thread 0 issues a chunk's W, K, Q tiles (64 tokens x 128 keys, 16-bit, as two
//             64 x 64 boxes with the 128-byte swizzle the wgmma descriptors read), its P box (64 x 64) and U's
//             columns (64 x 64 boxes), kStages - 1 chunks ahead, completing on the stage's mbarrier; G and
//             qk_l2norm's row scales (64 floats each, one per row of a strided [R, HV] array: too narrow for a
//             TMA box) come by cp.async. A box covers 64 rows whatever the chunk's length, so in a chunk of
//             n < 64 tokens rows n .. 63 (the next sequence's or piece's rows, or TMA's zero fill past the
//             tensor) are zeroed in shared memory before use: every product then sees what it saw with
//             masked loads, bit for bit
//   per chunk (each warpgroup; "rs": A from registers)
//     (1) Va = S^T W^T,  Oa = S^T Q^T        16 x wgmma m64n64k16 rs, one group
//     (2) Vn^T = U^T - Va (U^T by ldmatrix.trans from the swizzled box);  Oa *= e^(G_i) per token;
//         Vns^T = Vn^T e^(G_n - G_j); both to A fragments (with qk_l2norm also Oa *= rq_i and Vns^T *= rk_j:
//         the raw q and k tiles act as normalised ones)
//     (3) S^T <- e^(G_n) S^T + Vns^T K       4 x wgmma m64n128k16 rs (K's tile MN-major)
//         Oa  += Vn^T P^T                   4 x wgmma m64n64k16 rs (P's tile K-major), same group
//     (4) O = scale Oa^T: staged transposed through shared memory (stmatrix.trans), stored as 16-byte
//         pieces of whole rows while the next chunk's first products run
//   the factors of (2) and (3) (e^(G_n - G_j) rk_j, e^(G_i) rq_i, the T Beta form's e^(G_j) rk_j; kda: e^(G_n) per key)
//   depend on no product: made once per chunk in the stage's shared memory (a token or key a thread) while (1)'s
//   products run, then read by every thread (chain_token_factors). Each thread made its own 48 exponentials after
//   (1)'s wait before: H200, bf16, FLA's benchmark keywords, the chain 0.388 -> 0.374 ms at (4,4096,64,128), 0.379
//   -> 0.365 at (1,8192,96,128), 0.490 -> 0.487 at (2,16384,16,128) (its step is bound by the products' latency),
//   and in pieces at (1,65536,8,128) the chain 0.208 -> 0.193 and the maps 0.247 -> 0.222; kda's chain 1.68 -> 1.58
//   us a chunk at (2,16384,16,128). Made in registers while (1) ran instead, they took the kernel to 255 registers
//   and the chain got slower (0.490 -> 0.523 ms at (2,16384,16,128)).
//   kda (a decay per key, kKda): the same steps on the operands the tiled tier's WY and output stages make
//   (kda_chain_operands_kernel in cuda/tiled/tiled_fwd.cu): Q e^G and K e^(G_n - G) come in place of Q and
//   K (as [R, HV, K] rows, 16-bit), P is kda's decayed score matrix, and the per-token factors of (2) are
//   already in them; (3) scales S^T's key columns by e^(G_n) of each key (the chunk's last row of G, K
//   floats by cp.async). So a kda chunk brings in W, U, P, Q e^G, K e^(G_n - G) and that row of G.
//   So per chunk q, k, W, U, P, g come in and o goes out; no per-chunk state (h) and no v_new unless the
//   backward keeps them (below). Why P is made
//   outside the chain: ptxas waits for every outstanding wgmma group before reading any register a wgmma
//   wrote, so a Q K^T issued beside the state's products could not overlap them; computed in the chain it
//   cost a serial group, 64 exponentials per thread and a barrier per chunk.
//
// The T Beta form (gdn and delta, kTBeta, in the chain and in its map mode, whose identity columns' V is zero; the
// default without a gradient, fused_fwd.cu's chain_takes_tbeta). W = T Beta e^G K and U = T Beta V are never
// formed: the WY stage writes T Beta (the 16-bit operand it would have multiplied K and V by, 128 bytes per
// token-head in place of W's and U's 512) and reads no v, and the chain, which reads K anyway, makes
//   Vn = T Beta (V - e^G (K S))        (with qk_l2norm: K's rows times rk as well)
// (1) reads S^T K^T in place of S^T W^T; (2) scales its token columns by e^(G_j) rk_j, subtracts them from V^T (V's
// columns in U's boxes, loaded by TMA from v itself) and multiplies by (T Beta)^T (its box in W's place; one more
// group, 4 x wgmma m64n64k16 rs). The same algebra with other roundings (V - e^G K S rounded to 16 bits in place
// of W and U): as close to the fp64 reference (tests/python/test_cuda_fused.py). The forward moves 2066 bytes per
// token-head in place of 2834 (notebooks/06_kernel_tiers.py). Measured (H200, bf16 gdn, FLA's benchmark keywords,
// kernels per forward, bench/gpu/stage_times.py, the W, U form -> this one with its WY stage's gate sum):
// (4,4096,64,128) 0.884 -> 0.748 ms (the WY stage and cumsum 0.508 -> 0.357, the chain 0.373 -> 0.388),
// (1,8192,96,128) 0.745 -> 0.658, (2,16384,16,128) 0.733 -> 0.672 (the chain 0.457 -> 0.490: its step is
// latency-bound there, one CTA per SM on 64 SMs), (4,2048,16,128) 0.164 -> 0.122.
//
// Saved states (a forward whose backward follows, Params::chunk_h / chunk_vnew): each chunk's start state S, as the
// 16-bit values step (1) reads, and Vn go to HBM as the tiled tier's state scan writes them (h [NC, HV, K, V],
// v_new [R, HV, V]: 768 bytes per token-head at K = V = 128), so the backward skips its recompute's state scan.
// S is staged (stmatrix.trans into key rows) before (1) and stored while (1) runs; Vn is staged in the output
// tile after (2), whose previous chunk's rows went out during (1), and stored while (3) runs. Measured (H200, bf16,
// (2,16384,16,128), 64 CTAs of one warpgroup): the chain 0.452 -> 0.611 ms (gdn) and 0.430 -> 0.583 (kda) with
// the stores, against the backward's state scan of 0.65 and 0.50 ms that they remove.
//
// Shared memory (bf16): a stage is W, K, Q (16 KB each), P (8 KB), U (8 KB per warpgroup) and G, rq, rk
// (768 B), rounded to 1 KB (the T Beta form: T Beta in W's first box, V's columns in U's); plus an output staging tile
// (9 KB) per warpgroup and the stages' mbarriers.
// NWG = 1: 3 stages, 205 KB; NWG = 2: 2 stages, 165 KB; the map mode (NWG = 2, W, K and U only): 3 stages,
// 148 KB. Saved states add S's staging tile (18 KB per warpgroup at K = 128): 223 and 201 KB. One CTA per SM.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "../common/check.h"
#include "../common/dev_rows.cuh"
#include "../common/device_info.h"
#include "../common/tma.cuh"
#include "../tiled/chunk_table.cuh"
#include "../tiled/fwd_mma.cuh"
#include "../tiled/wgmma_ops.cuh"
#include "deltacp/error.h"
#include "deltacp/params.h"

namespace deltacp::cuda::fused {

constexpr int kCols = 64;    // state columns per warpgroup
constexpr int kLdStage = 72; // leading dimension (elements) of the output staging tile

// Load stages of a CTA of nwg warpgroups: three chunks in flight where they fit (the map mode has no Q and P).
__host__ __device__ constexpr int chain_stages(int nwg, bool map) { return map || nwg == 1 ? 3 : 2; }

template <class T>
struct ChainArgs {
  TileMap16 tm_w, tm_u, tm_p;  // [R, HV, K], [R, HV, V], [R, HV, 64]: boxes of 64 columns x 64 rows; the T Beta
                               // form: tm_w T Beta ([R, HV, 64]), tm_u v ([B, T, HV, V] as the caller strides it)
  TileMap16 tm_k, tm_q;        // [B, T, H, K] as the caller strides them: boxes of 64 keys x 64 tokens
  DevRows<T> o;
  const tiled::SeqEntry* seqs = nullptr;
  const float* G = nullptr;  // [R, HV] fp32 (gdn), [R, HV, K] (kda), nullptr for delta
  const float* rq = nullptr; // [R, HV] fp32: qk_l2norm's row scales of q and k (the wgmma WY stage), or nullptr
  const float* rk = nullptr;
  const float* h0 = nullptr; // [N, HV, K, V] (N: the table's sequences or pieces), or nullptr
  float* ht = nullptr;       // the same shape, or nullptr; the map mode: [N, HV, K, V + K]
  // Kept for the backward (Params::chunk_h, chunk_vnew), or nullptr: S at each chunk's start, 16-bit [NC, HV, K, V]
  // (NC: the flat chunk index, SeqEntry::first_chunk + c), and Vn = U - W S as [R, HV, V] rows.
  T* h_out = nullptr;
  T* vnew_out = nullptr;
  int64_t Tlen = 0, HV = 0, group = 1;
  int V = 128;  // value columns of the state: 128 or 256 (the map mode's state is V + K wide)
  int chunk_size = 64;
  float scale = 1.f;
};

// Shared memory of one CTA (offsets from a 1024-byte aligned base: the swizzled boxes need it). Within a
// stage the boxes are consecutive 64-row blocks of 128-byte rows: W (K / 64), K (K / 64), Q (K / 64), P (1),
// U (nwg); the map mode has no Q, P or output staging.
struct ChainLayout {
  int w, k, q, p, u, g, rq, rk;  // stage 0's buffers; stage s adds s * stage
  int blocks;                    // 64-row blocks of a stage, from offset 0
  int stage, stages;
  int os;     // per-warpgroup output staging tiles (with saved states also v_new's, at another time of the step)
  int hs;     // per-warpgroup staging of S (K rows x 64 columns) when the states are saved, else -1
  int bar;    // the stages' mbarriers
  int bytes;  // everything, plus 1024 bytes of slack for the alignment
};
__host__ __device__ inline ChainLayout chain_layout(int nwg, int esize, bool map, int stages, int K, bool save = false) {
  auto up = [](int x, int a) { return (x + a - 1) / a * a; };
  constexpr int kBlock = 64 * 128;
  const int kb = K / 64;  // 64-column boxes of a W, K or Q tile
  ChainLayout L;
  L.w = 0;
  L.k = kb * kBlock;
  L.q = map ? -1 : 2 * kb * kBlock;
  L.p = map ? -1 : 3 * kb * kBlock;
  L.u = (map ? 2 * kb : 3 * kb + 1) * kBlock;
  L.blocks = (map ? 2 * kb : 3 * kb + 1) + nwg;
  int o = L.blocks * kBlock;
  L.g = o;  // gdn: G of the chunk's 64 rows; kda: G of its last row (K <= 128 keys)
  o += 128 * 4;
  L.rq = o;
  o += 64 * 4;
  L.rk = o;
  o += 64 * 4;
  L.stage = up(o, 1024);
  L.stages = stages;
  o = L.stages * L.stage;
  L.os = o;
  if (!map) o += nwg * 64 * kLdStage * esize;
  L.hs = save && !map ? o : -1;
  if (L.hs >= 0) o += nwg * K * kLdStage * esize;
  L.bar = up(o, 8);
  o = L.bar + 8 * L.stages;
  L.bytes = o + 1024;
  return L;
}

#ifdef DELTACP_WGMMA_DEVICE
// Va <- U^T - Va for an m64n64 accumulator (this warpgroup's 64 state columns x 64 tokens), U^T's fragments
// read by ldmatrix.trans from a 64 x 64 box with the 128-byte swizzle (16-byte piece j of row r at j ^ (r % 8)).
// srow, scol: this lane's row and column in the box (as for an unswizzled tile, see u_minus_acc_trans).
template <class T>
__device__ __forceinline__ void u_minus_acc_trans_sw128(float (&Va)[32], const unsigned char* box, int srow, int scol) {
  const int piece = scol >> 3;
#pragma unroll
  for (int np = 0; np < 4; ++np) {
    const int row = 16 * np + srow;
    uint32_t u[4];
    tiled::ldmatrix_x4_trans(u, box + row * 128 + ((piece ^ (row & 7)) << 4));
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int at = 8 * np + 2 * q;  // n-block 2 np + q / 2, row half q % 2
      const float2 uf = tiled::unpack2<T>(u[q]);
      Va[at] = uf.x - Va[at];
      Va[at + 1] = uf.y - Va[at + 1];
    }
  }
}

// Step (2)'s per-token factors (gdn, delta) of token i (one thread each, i < 64), made once per chunk in the stage's
// shared memory, in place: rk_i <- e^(G_n - G_i) rk_i (the state update's), rq_i <- e^(G_i) rq_i (the output's) and,
// in the T Beta form, G's free second half at 64 + i <- e^(G_i) rk_i. Each of the warpgroup's threads made the 48 of
// its tokens' exponentials itself while the chain waited (the same values; 64 x 3 of them per chunk).
template <class T, bool kTBeta>
__device__ __forceinline__ void chain_token_factors(float* gbuf, float* rqb, float* rkb, int len, int i) {
  using tiled::exp_t;
  const float gi = gbuf[i], glast = gbuf[len - 1], ki = rkb[i], qi = rqb[i];
  if constexpr (kTBeta) gbuf[64 + i] = exp_t<T>(gi) * ki;
  rkb[i] = exp_t<T>(glast - gi) * ki;
  rqb[i] = exp_t<T>(gi) * qi;
}

// Tokens j and j + 1 of a shared-memory array of 64 floats.
__device__ __forceinline__ auto token_pair_at(const float* f) {
  return [f](int j) { return *reinterpret_cast<const float2*>(f + j); };
}

// X's token columns (an m64n64 accumulator: this warpgroup's 64 rows x 64 tokens) times a factor per token: pair(j)
// gives those of tokens j and j + 1 as a float2; the thread's columns are 16 kk + 2 t (+1) and 16 kk + 8 + 2 t (+1).
template <class F>
__device__ __forceinline__ void scale_token_columns(float (&X)[32], int t, F&& pair) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const float2 a = pair(16 * kk + 2 * t), b = pair(16 * kk + 8 + 2 * t);
    X[8 * kk] *= a.x;
    X[8 * kk + 1] *= a.y;
    X[8 * kk + 2] *= a.x;
    X[8 * kk + 3] *= a.y;
    X[8 * kk + 4] *= b.x;
    X[8 * kk + 5] *= b.y;
    X[8 * kk + 6] *= b.x;
    X[8 * kk + 7] *= b.y;
  }
}

// Step (2)'s scalings (gdn, delta): Vns^T = Vn^T e^(G_n - G_j) rk_j (the state update's A operand, va), Vn^T as it is
// (the output's, vo), and Oa's token columns times e^(G_i) rq_i; the raw q and k tiles then act as normalised ones.
// Va holds Vn^T (this warpgroup's 64 columns x 64 tokens, m64n64 layout). fk(j), fo(j): the two factors of tokens
// j and j + 1 as a float2 (chain_token_factors' rk and rq, read by token_pair_at; the one-kernel forward makes them
// itself).
template <class T, class FK, class FO>
__device__ __forceinline__ void chain_decays(const float (&Va)[32], float (&Oa)[32], uint32_t (&va)[4][4],
                                             uint32_t (&vo)[4][4], int t, FK&& fk, FO&& fo) {
  using tiled::pack2;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    // tokens 16 kk + 2 t (+1) and 16 kk + 8 + 2 t (+1)
    const float2 ka = fk(16 * kk + 2 * t), kb = fk(16 * kk + 8 + 2 * t);
    const float f0 = ka.x, f1 = ka.y, f2 = kb.x, f3 = kb.y;
    va[kk][0] = pack2<T>(Va[8 * kk] * f0, Va[8 * kk + 1] * f1);
    va[kk][1] = pack2<T>(Va[8 * kk + 2] * f0, Va[8 * kk + 3] * f1);
    va[kk][2] = pack2<T>(Va[8 * kk + 4] * f2, Va[8 * kk + 5] * f3);
    va[kk][3] = pack2<T>(Va[8 * kk + 6] * f2, Va[8 * kk + 7] * f3);
#pragma unroll
    for (int r = 0; r < 4; ++r) vo[kk][r] = pack2<T>(Va[8 * kk + 2 * r], Va[8 * kk + 2 * r + 1]);
  }
  scale_token_columns(Oa, t, fo);
}

// Step (2) of the T Beta form (gdn, delta): W S = T Beta e^G (K S) without W. Va holds S^T K^T (this warpgroup's 64
// state columns x 64 tokens, m64n64 layout); its token columns j are scaled by ft_j = e^(G_j) rk_j (rk: qk_l2norm's row
// scales, 1 without; chain_token_factors made them), subtracted from V^T (V's swizzled box, as u_minus_acc_trans_sw128
// reads U's), rounded to 16 bits as A fragments, and multiplied by (T Beta)^T (its 64 x 64 box, rows i K-major, at
// tb_addr): Va then holds Vn^T = (T Beta (V - e^G rk K S))^T. One more group to wait for than the W, U form; the WY
// stage writes T Beta (128 bytes per token and head) in place of W and U (512) and reads no v. vbox nullptr: the map
// mode's identity columns, whose V is zero (Va is negated instead).
template <class T>
__device__ __forceinline__ void chain_tbeta_values(float (&Va)[32], const unsigned char* vbox, uint32_t tb_addr,
                                                   const float* ft, int srow, int scol, int t) {
  using namespace tiled;
  scale_token_columns(Va, t, token_pair_at(ft));
  if (vbox != nullptr) {
    u_minus_acc_trans_sw128<T>(Va, vbox, srow, scol);
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) Va[i] = -Va[i];
  }
  uint32_t vt[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) vt[kk][r] = pack2<T>(Va[8 * kk + 2 * r], Va[8 * kk + 2 * r + 1]);
  wg_fence();
  reg_fence(Va);
  reg_fence(vt);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_n64_rs<T>(Va, vt[kk], wg_desc(tb_addr + kk * 32, 16, 1024), kk > 0);
  wg_commit();
  wg_wait_all();
  reg_fence(Va);
  reg_fence(vt);
}

// Step (4): O = scale Oa^T into the warpgroup's staging tile (tokens x 64 columns, rows kLdStage apart) by
// stmatrix.trans; srow, scol: this lane's row and column (the matrix it addresses, as the kernel computes them).
template <class T>
__device__ __forceinline__ void chain_stage_output(T* os, const float (&Oa)[32], float sc, int srow, int scol) {
  using tiled::pack2;
#pragma unroll
  for (int np = 0; np < 4; ++np) {
    const uint32_t r[4] = {pack2<T>(sc * Oa[8 * np], sc * Oa[8 * np + 1]),
                           pack2<T>(sc * Oa[8 * np + 2], sc * Oa[8 * np + 3]),
                           pack2<T>(sc * Oa[8 * np + 4], sc * Oa[8 * np + 5]),
                           pack2<T>(sc * Oa[8 * np + 6], sc * Oa[8 * np + 7])};
    tiled::stmatrix_x4_trans(os + (16 * np + srow) * kLdStage + scol, r);
  }
}

// Step (1)'s products as one group (the caller waits for it): Va = S^T W^T and, with the output (kOut), Oa = S^T
// Q^T, A = S^T rounded to 16 bits into sa (the register fragments), W's and Q's tiles K-major at w_addr, q_addr.
template <class T, int KK, bool kOut>
__device__ __forceinline__ void chain_issue_state_reads(float (&Va)[32], float (&Oa)[32], uint32_t (&sa)[KK / 16][4],
                                                        const float (&S)[KK / 2], uint32_t w_addr, uint32_t q_addr) {
  using namespace tiled;
#pragma unroll
  for (int i = 0; i < 32; ++i) Va[i] = Oa[i] = 0.f;
#pragma unroll
  for (int kk = 0; kk < KK / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) sa[kk][r] = pack2<T>(S[8 * kk + 2 * r], S[8 * kk + 2 * r + 1]);
  wg_fence();
  reg_fence(Va);
  if constexpr (kOut) reg_fence(Oa);
#pragma unroll
  for (int kk = 0; kk < KK / 16; ++kk) {
    const uint32_t off = (kk >> 2) * 8192 + (kk & 3) * 32;
    wgmma_n64_rs<T>(Va, sa[kk], wg_desc(w_addr + off, 16, 1024), kk > 0);
    if constexpr (kOut) wgmma_n64_rs<T>(Oa, sa[kk], wg_desc(q_addr + off, 16, 1024), kk > 0);
  }
  wg_commit();
}

// Step (3)'s products, waited for: S^T += Vns^T K (K's tile MN-major at k_addr) and, with the output, Oa += Vn^T
// P^T (P's tile K-major at p_addr). meanwhile() runs while they do (the saved v_new's stores).
template <class T, int KK, bool kOut, class F>
__device__ __forceinline__ void chain_update_state(float (&S)[KK / 2], float (&Oa)[32], uint32_t (&va)[4][4],
                                                   uint32_t (&vo)[4][4], uint32_t k_addr, uint32_t p_addr,
                                                   F&& meanwhile) {
  using namespace tiled;
  wg_fence();
  reg_fence(S);
  if constexpr (kOut) reg_fence(Oa);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_rs_tb<T, KK>(S, va[kk], wg_desc(k_addr + kk * 2048, 8192, 1024));
  if constexpr (kOut)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_n64_rs<T>(Oa, vo[kk], wg_desc(p_addr + kk * 32, 16, 1024), 1);
  wg_commit();
  meanwhile();
  wg_wait_all();
  reg_fence(S);
  reg_fence(va);
  if constexpr (kOut) {
    reg_fence(Oa);
    reg_fence(vo);
  }
}
#endif

// One CTA of NWG warpgroups per (sequence or piece, value head, 64 NWG state columns), sequential over
// the sequence's chunks (the file comment gives the steps).
//
// kMap: the map mode, the pieces' pass 1 of intra-card CP. A piece entered with [0 | I] (a state V + K columns
// wide, 256 or 384: the value columns from zero, then the identity) leaves with [H | M], so that entered with S it
// leaves with M S + H (cuda/tiled/scan_split.cu has the algebra). The same chain step without the output:
// no Q or P tile, no output products; the identity columns' CTAs (v0 >= V) see U = 0 and load no U. The
// start state is made in registers and [H | M] goes to ht, rows V + K apart. A CTA covers 64 NWG of the V + K
// columns (two CTAs at K = V = 128, three at V = 256, one at K = V = 64).
//
// KS: the load stages (chain_stages; two with one warpgroup leave room on the SM for a CTA of the wgmma WY stage
// beside the chain's, which the windows' overlap in fused_fwd.cu needs). kKda: tm_q and tm_k are the rows of
// Q e^G and K e^(G_n - G) ([R, HV, KK]), and the decay is per key (the file comment). kTBeta: the T Beta form (the
// file comment; the map mode too): a stage holds T Beta in W's first box and v's columns in U's boxes.
template <class T, int NWG, bool kMap, int KS, bool kKda, int KK, bool kTBeta = false>
__global__ void __launch_bounds__(128 * NWG, 1) fused_chain_kernel(const __grid_constant__ ChainArgs<T> args) {
#ifdef DELTACP_WGMMA_DEVICE
  using namespace tiled;
  static_assert(KK == 128 || KK == 64, "K = 128 or 64");
  static_assert(!kTBeta || !kKda, "the T Beta form is gdn's and delta's");
  constexpr int kThr = 128 * NWG, BVC = kCols * NWG, kStages = KS, kKB = KK / 64;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const bool save = !kMap && args.h_out != nullptr;  // the host gives h_out and vnew_out both or neither
  const ChainLayout L = chain_layout(NWG, sizeof(T), kMap, KS, KK, save);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L.bar);

  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, wi = wtid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t n = blockIdx.x, hv = blockIdx.y, HV = args.HV;
  const int v0 = blockIdx.z * BVC;   // the CTA's first state column
  const int vw = v0 + kCols * wg;    // this warpgroup's first state column
  const int jr = 16 * wi + g;        // this thread's rows of S^T: jr and jr + 8
  const int hk = static_cast<int>(hv / args.group);
  const SeqEntry se = args.seqs[n];
  const int cs = args.chunk_size;
  const bool has_gate = args.G != nullptr;
  // The map mode's identity columns (v >= V) see U = 0: this warpgroup's, and the U boxes the CTA loads (those of
  // its warpgroups' value columns; at K = V = 64 one CTA holds both kinds).
  const bool u_zero = kMap && vw >= args.V;
  const int u_boxes = kMap ? max(0, min(NWG, (args.V - v0) / kCols)) : NWG;
  const int64_t state_cols = kMap ? args.V + KK : args.V;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(bars + s, 1);
    fence_mbar_init();
  }
  if (tid == 0 && se.num_chunks > 0) {
    tma_prefetch_map(&args.tm_w.map);
    tma_prefetch_map(&args.tm_u.map);
    tma_prefetch_map(&args.tm_p.map);
    tma_prefetch_map(&args.tm_k.map);
    tma_prefetch_map(&args.tm_q.map);
  }

  // S^T in the m64nK accumulator layout: S[4 nb + e] = state (key row 8 nb + 2 t + (e & 1),
  // column vw + jr + 8 (e >> 1)).
  const int64_t state0 = (n * HV + hv) * KK * state_cols;
  float S[KK / 2];
#pragma unroll
  for (int nb = 0; nb < KK / 8; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t col = vw + jr + 8 * (e >> 1), d = 8 * nb + 2 * t + (e & 1);
      if constexpr (kMap) {
        S[4 * nb + e] = col - args.V == d ? 1.f : 0.f;
      } else {
        S[4 * nb + e] = args.h0 != nullptr ? args.h0[state0 + d * state_cols + col] : 0.f;
      }
    }
  __syncthreads();  // the barriers are initialised

  auto chunk_row0 = [&](int64_t c) { return se.batch * args.Tlen + se.bos + c * cs; };
  auto chunk_len = [&](int64_t c) { return static_cast<int>(min(static_cast<int64_t>(cs), se.len - c * cs)); };
  // Chunk c's loads into stage c % kStages (its previous chunk's readers are past the barrier that ended it).
  auto issue = [&](int64_t c) {
    const int64_t row0 = chunk_row0(c), t0 = se.bos + c * cs;
    const int len = chunk_len(c);
    const int s = static_cast<int>(c % kStages);
    unsigned char* st = smem + s * L.stage;
    if (tid == 0) {
      const uint32_t bytes = ((kTBeta ? 1 : kKB) + kKB + (kMap ? 0 : kKB + 1) + u_boxes) * 8192;
      const int r = static_cast<int>(row0), tt = static_cast<int>(t0), b = static_cast<int>(se.batch);
      const int h = static_cast<int>(hv);
      fence_proxy_async();  // the zeroed rows of this stage's last use (generic writes) before the copies
      mbar_expect_tx(bars + s, bytes);
      if constexpr (kTBeta) {
        tma_load_3d(st + L.w, &args.tm_w.map, bars + s, 0, h, r);
      } else {
#pragma unroll
        for (int x = 0; x < kKB; ++x) tma_load_3d(st + L.w + x * 8192, &args.tm_w.map, bars + s, 64 * x, h, r);
      }
      if constexpr (kKda) {  // K e^(G_n - G) and Q e^G: rows of the value head
#pragma unroll
        for (int x = 0; x < kKB; ++x) {
          tma_load_3d(st + L.k + x * 8192, &args.tm_k.map, bars + s, 64 * x, h, r);
          if constexpr (!kMap) tma_load_3d(st + L.q + x * 8192, &args.tm_q.map, bars + s, 64 * x, h, r);
        }
      } else {
#pragma unroll
        for (int x = 0; x < kKB; ++x) {
          tma_load_4d(st + L.k + x * 8192, &args.tm_k.map, bars + s, 64 * x, hk, tt, b);
          if constexpr (!kMap) tma_load_4d(st + L.q + x * 8192, &args.tm_q.map, bars + s, 64 * x, hk, tt, b);
        }
      }
      if constexpr (!kMap) tma_load_3d(st + L.p, &args.tm_p.map, bars + s, 0, h, r);
      for (int u = 0; u < u_boxes; ++u) {
        if constexpr (kTBeta) {
          tma_load_4d(st + L.u + u * 8192, &args.tm_u.map, bars + s, v0 + 64 * u, h, tt, b);
        } else {
          tma_load_3d(st + L.u + u * 8192, &args.tm_u.map, bars + s, v0 + 64 * u, h, r);
        }
      }
    }
    float* gbuf = reinterpret_cast<float*>(st + L.g);
    if constexpr (kKda) {  // G of the chunk's last row: e^(G_n) per key (qk_l2norm is applied before kda's stages)
      if (tid < KK / 4) cp_async_16(gbuf + 4 * tid, args.G + ((row0 + len - 1) * HV + hv) * KK + 4 * tid);
    } else if (tid < 64) {
      if (has_gate) {
        cp_async_4(gbuf + tid, args.G + (row0 + min(tid, len - 1)) * HV + hv);
      } else {
        gbuf[tid] = 0.f;
      }
    } else if (tid < 128) {  // qk_l2norm's row scales (1 without it); rows past the chunk: 1
      const int i = tid - 64;
      float* rqb = reinterpret_cast<float*>(st + L.rq);
      float* rkb = reinterpret_cast<float*>(st + L.rk);
      if (args.rq != nullptr && i < len) {
        cp_async_4(rqb + i, args.rq + (row0 + i) * HV + hv);
      } else {
        rqb[i] = 1.f;
      }
      if (args.rk != nullptr && i < len) {  // the map mode has rk without rq
        cp_async_4(rkb + i, args.rk + (row0 + i) * HV + hv);
      } else {
        rkb[i] = 1.f;
      }
    }
    cp_async_commit();
  };
  T* os = reinterpret_cast<T*>(smem + L.os) + wg * 64 * kLdStage;
  T* hs = save ? reinterpret_cast<T*>(smem + L.hs) + wg * KK * kLdStage : nullptr;
  // stmatrix / ldmatrix row addresses: lane -> matrix q = lane / 8 (n-block parity q / 2, row half q % 2).
  const int sq = lane >> 3, srr = lane & 7;
  const int srow = 8 * (sq >> 1) + srr, scol = 16 * wi + 8 * (sq & 1);

  // The staged tile's rows 0 .. len - 1 (a chunk's tokens) as 16-byte pieces of whole rows, row i to row_at(i) (the
  // output o, or the saved v_new's [R, HV, V] rows).
  auto store_staged = [&](int len, auto row_at) {
    const int i0 = wtid >> 3, pc = (wtid & 7) * 8;
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int i = i0 + 16 * it;
      if (i < len)
        *reinterpret_cast<uint4*>(row_at(i) + vw + pc) = *reinterpret_cast<const uint4*>(os + i * kLdStage + pc);
    }
  };
  // Saved states: the staged S (key rows x this warpgroup's 64 columns) of flat chunk fc as 16-byte pieces of whole
  // rows, as the tiled tier's wgmma state scan stores h (cuda/tiled/scan_wgmma.cuh).
  auto store_h = [&](int64_t fc) {
    const int d0 = wtid >> 3, pc = (wtid & 7) * 8;
    T* dst = args.h_out + ((fc * HV + hv) * KK + d0) * args.V + vw + pc;
#pragma unroll
    for (int it = 0; it < KK / 16; ++it)
      *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(16 * it) * args.V) =
          *reinterpret_cast<const uint4*>(hs + (d0 + 16 * it) * kLdStage + pc);
  };

  const int64_t nchunks = se.num_chunks;
#pragma unroll
  for (int c = 0; c + 1 < kStages; ++c) {
    if (c < nchunks) {
      issue(c);
    } else {
      cp_async_commit();
    }
  }
  for (int64_t c = 0; c < nchunks; ++c) {
    const int len = chunk_len(c);
    const int64_t t0 = se.bos + c * cs;
    const int s = static_cast<int>(c % kStages);
    unsigned char* st = smem + s * L.stage;
    cp_async_wait<kStages - 2>();  // chunk c's copies (the next chunks' may be in flight)
    mbar_wait(bars + s, static_cast<uint32_t>((c / kStages) & 1));
    if (len < 64) {  // rows len .. 63 of every box: zero, as masked loads would have left them
      for (int idx = tid; idx < L.blocks * 64 * 8; idx += kThr) {
        const int row = (idx >> 3) & 63;
        if (row >= len) *reinterpret_cast<uint4*>(st + idx * 16) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    fence_proxy_async();
    __syncthreads();
    float* gbuf = reinterpret_cast<float*>(st + L.g);
    float* rqb = reinterpret_cast<float*>(st + L.rq);
    float* rkb = reinterpret_cast<float*>(st + L.rk);
    const uint32_t w_addr = smem_u32(st + L.w), k_addr = smem_u32(st + L.k), q_addr = smem_u32(st + (kMap ? 0 : L.q));
    const uint32_t p_addr = smem_u32(st + (kMap ? 0 : L.p));

    // (1) Va = S^T W^T and Oa = S^T Q^T, A = bf16(S^T) from registers. Saved states: S staged first (transposed
    // back to key rows by stmatrix.trans, the 16-bit values the products read), stored while they run. (Stored by
    // TMA from a swizzled tile, one thread issuing, the chain took as long: 0.605 against 0.611 ms at
    // (2,16384,16,128) on an H200; the stores' bytes and instructions are not what it waits for.)
    if (save) {
#pragma unroll
      for (int kk = 0; kk < KK / 16; ++kk) {
        const uint32_t r[4] = {pack2<T>(S[8 * kk], S[8 * kk + 1]), pack2<T>(S[8 * kk + 2], S[8 * kk + 3]),
                               pack2<T>(S[8 * kk + 4], S[8 * kk + 5]), pack2<T>(S[8 * kk + 6], S[8 * kk + 7])};
        stmatrix_x4_trans(hs + (16 * kk + srow) * kLdStage + scol, r);
      }
      warpgroup_bar(wg);
    }
    float Va[32], Oa[32];
    uint32_t sa[KK / 16][4];
    chain_issue_state_reads<T, KK, !kMap>(Va, Oa, sa, S, kTBeta ? k_addr : w_addr, q_addr);
    // Chunk c + kStages - 1's loads into the stage the last chunk freed, while the products run. Issued at the step's
    // head, thread 0's issue held every thread at the barrier after it: the chain 0.487 -> 0.472 ms at
    // (2,16384,16,128), kda's 0.404 -> 0.388 (H200, bf16, FLA's keywords).
    if (c + kStages - 1 < nchunks) {
      issue(c + kStages - 1);
    } else {
      cp_async_commit();
    }
    // The previous chunk's output, staged at its end (the barrier that ended it made the tile visible),
    // goes out while the products run; so are steps (2) and (3)'s factors made (gdn, delta: per token; kda: per key).
    if (!kMap && c > 0) store_staged(cs, [&](int i) { return args.o.at(se.batch, t0 - cs + i, hv); });
    if (save) store_h(se.first_chunk + c);
    if constexpr (kKda) {  // e^(G_n) of each key, in place (one key a thread)
      if (tid < KK) gbuf[tid] = exp_t<T>(gbuf[tid]);
    } else {
      if (tid < 64) chain_token_factors<T, kTBeta>(gbuf, rqb, rkb, len, tid);
    }
    __syncthreads();  // the factors are visible
    wg_wait_all();
    reg_fence(Va);
    if constexpr (!kMap) reg_fence(Oa);
    reg_fence(sa);

    // (2) Vn^T = U^T - Va (U^T fragments through ldmatrix.trans); Oa *= e^(G_i) per token column i. The T Beta
    // form: Vn^T = (V^T - Va e^(G_j) rk_j) (T Beta)^T.
    if constexpr (kTBeta) {
      chain_tbeta_values<T>(Va, u_zero ? nullptr : st + L.u + wg * 8192, w_addr, gbuf + 64, srow, scol, t);
    } else if (u_zero) {
#pragma unroll
      for (int i = 0; i < 32; ++i) Va[i] = -Va[i];
    } else {
      u_minus_acc_trans_sw128<T>(Va, st + L.u + wg * 8192, srow, scol);
    }
    if (save) {  // v_new = Vn (16-bit) staged in the output tile, whose previous rows went out in (1)
      warpgroup_bar(wg);
      chain_stage_output<T>(os, Va, 1.f, srow, scol);
      warpgroup_bar(wg);
    }
    uint32_t va[4][4], vo[4][4];  // Vns^T (state update) and Vn^T (output) as A fragments
    if constexpr (kKda) {  // the per-token factors are in Q e^G and K e^(G_n - G): Vns = Vn
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) va[kk][r] = vo[kk][r] = pack2<T>(Va[8 * kk + 2 * r], Va[8 * kk + 2 * r + 1]);
    } else {
      chain_decays<T>(Va, Oa, va, vo, t, token_pair_at(rkb), token_pair_at(rqb));
    }

    // (3) S^T = e^(G_n) S^T + Vns^T K;  Oa += Vn^T P^T.  kda: S^T's key column d times e^(G_n,d), K e^(G_n - G).
    if constexpr (kKda) {  // keys 8 nb + 2 t and 8 nb + 2 t + 1 (e^(G_n) made while (1) ran)
#pragma unroll
      for (int nb = 0; nb < KK / 8; ++nb) {
        const float2 e = *reinterpret_cast<const float2*>(gbuf + 8 * nb + 2 * t);
        S[4 * nb] *= e.x;
        S[4 * nb + 1] *= e.y;
        S[4 * nb + 2] *= e.x;
        S[4 * nb + 3] *= e.y;
      }
    } else {
      const float eg = exp_t<T>(gbuf[len - 1]);
#pragma unroll
      for (int i = 0; i < KK / 2; ++i) S[i] *= eg;
    }
    chain_update_state<T, KK, !kMap>(S, Oa, va, vo, k_addr, p_addr, [&] {
      if (save) store_staged(len, [&](int i) { return args.vnew_out + ((chunk_row0(c) + i) * HV + hv) * args.V; });
    });
    if constexpr (kMap) {
      __syncthreads();  // this stage is free
      continue;
    }

    // (4) O = scale Oa^T, staged tokens x 64 columns (after every thread of the warpgroup has stored the
    // previous chunk's rows from the tile); stored during the next chunk's first products.
    warpgroup_bar(wg);
    chain_stage_output<T>(os, Oa, args.scale, srow, scol);
    __syncthreads();  // this stage is free; the staged output is visible to the warpgroup
  }
  if (!kMap && nchunks > 0) {
    const int64_t t_last = se.bos + (nchunks - 1) * cs;
    store_staged(chunk_len(nchunks - 1), [&](int i) { return args.o.at(se.batch, t_last + i, hv); });
  }

  if (args.ht != nullptr) {
#pragma unroll
    for (int nb = 0; nb < KK / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t col = vw + jr + 8 * (e >> 1), d = 8 * nb + 2 * t + (e & 1);
        args.ht[state0 + d * state_cols + col] = S[4 * nb + e];
      }
  }
#else
  __trap();  // never launched: the host selects this kernel only for builds with sm_90a code
#endif
}

// DELTACP_FUSED_WG: 0 (unset) = by the grid's width, else 1 or 2 warpgroups per CTA.
inline int warpgroups_from_env() {
  const char* env = std::getenv("DELTACP_FUSED_WG");
  if (env == nullptr || *env == '\0') return 0;
  DELTACP_CHECK(std::string(env) == "1" || std::string(env) == "2", "DELTACP_FUSED_WG", "expected 1 or 2, got '",
                env, "'");
  return std::atoi(env);
}

// Warpgroups per CTA: two share one copy of each chunk's tiles; one doubles the CTAs, which pays where
// two per CTA would leave SMs idle (V / 64 column tiles per sequence and head). DELTACP_FUSED_WG forces it where
// there are two tiles or more (V = 64: one warpgroup).
inline int chain_warpgroups(int64_t seqs_x_heads, int64_t V, int sms) {
  if (V < 2 * kCols) return 1;
  const int env = warpgroups_from_env();
  if (env != 0) return env;
  return (V / kCols) * seqs_x_heads >= sms ? 2 : 1;
}

// The token-parallel operands of the chain, [R, HV, width] rows (16-bit) unless said otherwise: W (K wide), U (V
// wide), P (64) from the WY stage (gdn, delta: wgmma_wy.cuh; kda: chunk_wy_kernel and
// kda_chain_operands_kernel); G ([R, HV] fp32 for gdn, [R, HV, K] for kda, ignored for delta); kda only:
// Kd = K e^(G_n - G) and Qg = Q e^G (K wide; the other variants read k and q themselves); rq / rk:
// qk_l2norm's row scales (gdn, delta), or nullptr. tbeta: the T Beta form (gdn, delta; the chain and its map mode):
// W holds T Beta ([R, HV, 64]), U is unused and the chain reads v.
struct ChainOperands {
  const float* G = nullptr;
  const void* W = nullptr;
  const void* U = nullptr;
  const void* P = nullptr;
  const void* Kd = nullptr;
  const void* Qg = nullptr;
  const float* rq = nullptr;
  const float* rk = nullptr;
  bool tbeta = false;
};

// The kernel of nwg warpgroups per CTA and `stages` load stages (stages as launch_chain_kernel checks them). At
// K = V = 64 the state is one 64-column tile: one warpgroup per CTA, and two in the map mode (V + K = 128 columns).
template <class T, bool kMap, bool kKda, int KK, bool kTB = false>
auto chain_kernel(int nwg, int stages) {
  if constexpr (KK == 64) {
    if constexpr (kMap) {
      return fused_chain_kernel<T, 2, true, chain_stages(2, true), kKda, 64, kTB>;
    } else {
      DELTACP_CHECK(nwg == 1, "DELTACP_FUSED_WG", "expected one warpgroup per CTA at V = 64, got ", nwg);
      return stages == 2 ? fused_chain_kernel<T, 1, false, 2, kKda, 64, kTB>
                         : fused_chain_kernel<T, 1, false, 3, kKda, 64, kTB>;
    }
  } else {
    return nwg == 2 ? fused_chain_kernel<T, 2, kMap, chain_stages(2, kMap), kKda, 128, kTB>
                    : (stages == 2 ? fused_chain_kernel<T, 1, kMap, 2, kKda, 128, kTB>
                                   : fused_chain_kernel<T, 1, kMap, 3, kKda, 128, kTB>);
  }
}

// The chain kernel over the table's sequences (or pieces), h0 / ht per table entry (the map mode: h0 unused,
// ht = the maps [N, HV, K, V + K]).
template <class T, bool kMap, bool kKda>
void launch_chain_kernel(const Params& p, const tiled::ChunkTable& table, const ChainOperands& in, const float* h0,
                         float* ht, int nwg, int stages, cudaStream_t stream) {
  if (table.num_seqs() == 0) return;
  const int64_t R = p.B * p.T, HV = p.HV;
  ChainArgs<T> a;
  const bool tbeta = !kKda && in.tbeta;
  if (R > 0) {  // else no sequence has a chunk: the kernel only carries h0 to ht and never reads a map
    a.tm_w = tbeta ? workspace_rows_map(in.W, R, HV, 64, "T Beta") : workspace_rows_map(in.W, R, HV, p.K, "W");
    a.tm_u = tbeta ? token_rows_map(p.v, p.B, p.T, p.HV, p.V, "v") : workspace_rows_map(in.U, R, HV, p.V, "U");
    a.tm_k = kKda ? workspace_rows_map(in.Kd, R, HV, p.K, "Kd") : token_rows_map(p.k, p.B, p.T, p.H, p.K, "k");
    if (!kMap) {
      a.tm_p = workspace_rows_map(in.P, R, HV, 64, "P");
      a.tm_q = kKda ? workspace_rows_map(in.Qg, R, HV, p.K, "Qg") : token_rows_map(p.q, p.B, p.T, p.H, p.K, "q");
    }
  }
  if (!kMap) a.o = dev_rows<T>(p.o);
  a.seqs = table.seqs();
  a.G = p.variant == Variant::delta ? nullptr : in.G;
  a.rq = kKda ? nullptr : in.rq;
  a.rk = kKda ? nullptr : in.rk;
  a.h0 = h0;
  a.ht = ht;
  if (!kMap) {  // the states kept for the backward (Params::chunk_h; both or neither: dispatch.cu checks)
    a.h_out = static_cast<T*>(p.chunk_h);
    a.vnew_out = static_cast<T*>(p.chunk_vnew);
  }
  a.Tlen = p.T;
  a.HV = p.HV;
  a.group = p.HV / p.H;
  a.V = static_cast<int>(p.V);
  a.chunk_size = p.chunk_size;
  a.scale = static_cast<float>(p.scale);
  if (stages == 0) stages = chain_stages(nwg, kMap);
  DELTACP_CHECK(stages == chain_stages(nwg, kMap) || (!kMap && nwg == 1 && stages == 2), "stages",
                "expected ", chain_stages(nwg, kMap), kMap || nwg == 2 ? "" : " or 2", " load stages, got ", stages);
  const ChainLayout L = chain_layout(nwg, sizeof(T), kMap, stages, static_cast<int>(p.K), a.h_out != nullptr);
  DELTACP_CHECK(!in.tbeta || tbeta, "W", "internal: the T Beta form is gdn's and delta's chain");
  auto kernel = [&] {
    if constexpr (!kKda) {
      if (tbeta)
        return p.K == 64 ? chain_kernel<T, kMap, kKda, 64, true>(nwg, stages)
                         : chain_kernel<T, kMap, kKda, 128, true>(nwg, stages);
    }
    return p.K == 64 ? chain_kernel<T, kMap, kKda, 64>(nwg, stages) : chain_kernel<T, kMap, kKda, 128>(nwg, stages);
  }();
  opt_in_smem(kernel, L.bytes, "K", "the fused forward needs ", L.bytes, " bytes of shared memory");
  const int64_t cols = kMap ? p.V + p.K : p.V;
  const dim3 grid(static_cast<unsigned>(table.num_seqs()), static_cast<unsigned>(p.HV),
                  static_cast<unsigned>(cols / (kCols * nwg)));
  kernel<<<grid, 128 * nwg, L.bytes, stream>>>(a);
  DELTACP_CUDA_CHECK_LAUNCH();
}

// The chain with the output (warpgroups per CTA: chain_warpgroups).
// stages: 0 = chain_stages; 2 with one warpgroup per CTA to share the SM with the WY kernel.
template <class T>
void launch_chain(const Params& p, const tiled::ChunkTable& table, const ChainOperands& in, const float* h0,
                  float* ht, cudaStream_t stream, int stages = 0) {
  const int nwg = chain_warpgroups(table.num_seqs() * p.HV, p.V, sm_count());
  if (p.variant == Variant::kda) {
    launch_chain_kernel<T, false, true>(p, table, in, h0, ht, nwg, nwg == 1 ? stages : 0, stream);
  } else {
    launch_chain_kernel<T, false, false>(p, table, in, h0, ht, nwg, nwg == 1 ? stages : 0, stream);
  }
}

// The map mode over the pieces of `table`: maps [pieces, HV, K, V + K] = [H | M] of each (two warpgroups per
// CTA, (V + K) / 128 CTAs per piece and head: one shared copy of each chunk's W and K per 128 columns).
template <class T>
void launch_chain_maps(const Params& p, const tiled::ChunkTable& table, const ChainOperands& in, float* maps,
                       cudaStream_t stream) {
  ChainOperands m = in;
  m.P = m.Qg = nullptr;  // no output
  m.rq = nullptr;
  if (p.variant == Variant::kda) {
    launch_chain_kernel<T, true, true>(p, table, m, nullptr, maps, 2, 0, stream);
  } else {
    launch_chain_kernel<T, true, false>(p, table, m, nullptr, maps, 2, 0, stream);
  }
}

}  // namespace deltacp::cuda::fused
