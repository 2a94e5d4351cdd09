// cuda/fused/fused_fwd.cu — the fused tier's forward (Hopper, sm_90a): the state stays on chip from a
// sequence's first chunk to its last, and each chunk's output is produced where its state is.
//
// Algorithm (docs/design.md, the chunked WY form; reference/include/deltacp/reference/chunked.h). For a
// chunk of n <= 64 tokens with state S (K x V, fp32) at its start and G the within-chunk cumulative log
// decay, with W = T Beta (K e^G) and U = T Beta V from the WY stage:
//
//   Vn = U - W S
//   O  = scale ( e^G (Q S) + P Vn ),   P = tril(Q K^T) o e^(G_i - G_j)  (j <= i, diagonal included)
//   S' = e^(G_n) S + (K e^(G_n - G))^T Vn
//
// Pipeline. What does not depend on the state runs token-parallel first, on every chunk at once: the tiled
// tier's stage 1 (G = cumsum g, cuda/tiled/fwd_stages.cuh) and fused_wy_kernel (fused_wy.cuh: W, U and P =
// 128 bytes per token and head of 16-bit scores, from one read of q, k and v). Then one kernel,
// fused_chain_kernel, walks each sequence's chunks with S in registers and does every product that
// touches S, and the output:
//
//   CTA       one per (sequence or piece, value head, 64 NWG state columns); NWG = 1 or 2 warpgroups
//             of 128 threads, each owning 64 state columns (all 128 key rows) as an fp32 wgmma
//             accumulator (64 registers per thread), written transposed (S^T) so that every product
//             that reads S takes it straight from registers as the A operand
//   loads     the next chunk's W, K, Q tiles (64 tokens x 128 keys, 16-bit, 128-byte swizzle), its P
//             tile (64 x 64, swizzled), U's columns and G, by cp.async two stages deep, while this
//             chunk computes
//   per chunk (each warpgroup; "rs": A from registers)
//     (1) Va = S^T W^T,  Oa = S^T Q^T        16 x wgmma m64n64k16 rs, one group
//     (2) Vn^T = U^T - Va;  Oa *= e^(G_i) per token;  Vns^T = Vn^T e^(G_n - G_j); both to A fragments
//         (with qk_l2norm also Oa *= rq_i and Vns^T *= rk_j: the raw q and k tiles act as normalised ones)
//     (3) S^T <- e^(G_n) S^T + Vns^T K       4 x wgmma m64n128k16 rs (K's tile MN-major)
//         Oa  += Vn^T P^T                   4 x wgmma m64n64k16 rs (P's tile K-major), same group
//     (4) O = scale Oa^T: staged transposed through shared memory (stmatrix.trans), stored as
//         16-byte pieces of whole rows while the next chunk's first products run
//   So per chunk q, k, W, U, P, g come in and o goes out; no per-chunk state (h) and no v_new, which
//   the tiled tier's stages 3 and 4 move through HBM. Why P is made outside the chain: ptxas waits for
//   every outstanding wgmma group before reading any register a wgmma wrote, so a Q K^T issued beside
//   the state's products could not overlap them; computed in the chain it cost a serial group, 64
//   exponentials per thread and a barrier per chunk.
//
// Long sequences with few chains (B * HV CTAs would leave most SMs idle): exact intra-card context
// parallelism. The sequences are cut into pieces of whole chunks; each piece's affine map [H_j | M_j]
// (the state it leaves when entered with [0 | I]) comes from the tiled tier's state-only scan (pass 1,
// side by side), a fold gives every piece its true start state S_{j+1} = M_j S_j + H_j in fp32, and the
// fused kernel runs every piece from it (cuda/tiled/scan_split.cu has the algebra). No gate-threshold
// shortcut: the start states are exact up to rounding. fused_plan below picks the piece length.
//
// Numerics: the tiled tier's roundings (S, Vn, P to 16 bits for the products, fp32 accumulation, fp32
// state), so the fused forward agrees with the tiled one to bf16 rounding and with fp64 within 1e-2.
//
// Applies to: gdn and delta; bf16 / fp16 inputs; K = V = 128; q, k, o 16-byte aligned rows; compute
// capability 9.0 in a build with sm_90a code (fused_forward_refusal says why not, and the dispatch falls
// back to the tiled tier or, when the fused tier was asked for by name, raises an error with the reason).
//
// Shared memory (bf16, NWG = 2): two load stages of W, K, Q (16 KB each), P (8 KB), U (64 x 136) and G:
// 148 KB; per warpgroup an output staging tile (9 KB): 167 KB in all, one CTA per SM (NWG = 1: 141 KB).
// Registers: 209 per thread (nvcc 13.0), no spills.
//
// Measured (NVIDIA H200, 2026-11-25, bf16 gdn, bench/gpu/bench_gpu.py with FLA 0.5.2 in the same run, both
// with use_qk_l2norm_in_kernel=True, which this tier folds into its kernels; docs/perf.md has the table):
// forward (4,2048,16,128) 0.225 ms (FLA 0.781), (1,8192,96,128) 0.989 (1.642), (2,16384,16,128) 0.944
// (1.084), (4,4096,64,128) 1.184 (1.967), (1,65536,8,128) 0.963 (2.029). Per kernel at (2,16384,16,128)
// (bench/gpu/stage_times.py, plain call): whole sequences 0.996 ms = chain 0.682 (256 chunks on 64 CTAs:
// 2.7 us a chunk) + WY and scores 0.282 + cumsum 0.029; the default plan, pieces of 4096 tokens, 0.830 ms =
// WY and scores 0.283 + pass-1 maps 0.257 + chain 0.210 (64 chunks on 128 CTAs: 3.3 us a chunk) + cumsum,
// fold and the rest 0.080. Before fused_wy_kernel the token-parallel part was the tiled tier's mma.sync WY
// stage (0.463 ms) and a scores kernel (0.093 ms). What is left: the chain step, whose tensor-core work is
// about 1 us a chunk (3.5 M multiply-adds for 128 state columns), so 2.7 us is mostly the latency of its
// two dependent product groups and the barrier, which a warp-specialised CTA (an output warpgroup beside
// the state's) would overlap; pass 1 (a state 256 columns wide, on the tiled tier's scan); and the WY
// kernel at about half the copy rate (Nsight Compute: barrier stalls between its phases, three CTAs per SM).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "../common/check.h"
#include "../common/dev_rows.cuh"
#include "../common/device_info.h"
#include "../common/load_store.cuh"
#include "../common/workspace_pool.h"
#include "../tiled/chunk_table.cuh"
#include "../tiled/fwd_mma.cuh"
#include "../tiled/fwd_stages.cuh"
#include "../tiled/wgmma_ops.cuh"
#include "fused_wy.cuh"
#include "deltacp/cuda/tiers.h"
#include "deltacp/error.h"
#include "deltacp/params.h"

namespace deltacp::cuda::fused {
namespace {

using tiled::ChunkTable;
using tiled::SeqEntry;

constexpr int kKeys = 128;   // K: key rows of the state
constexpr int kCols = 64;    // state columns per warpgroup
constexpr int kLdStage = 72; // leading dimension (elements) of the output staging tile

template <class T>
struct ChainArgs {
  DevRows<const T> q, k;
  DevRows<T> o;
  const SeqEntry* seqs = nullptr;
  const float* G = nullptr;  // [R, HV] fp32 (gdn), nullptr for delta
  const T* W = nullptr;      // [R, HV, 128]
  const T* U = nullptr;      // [R, HV, 128]
  const T* P = nullptr;      // [R, HV, 64]: row i of its chunk's P (fused_wy_kernel)
  const float* rq = nullptr; // [R, HV] fp32: qk_l2norm's row scales of q and k (fused_wy_kernel), or nullptr
  const float* rk = nullptr;
  const float* h0 = nullptr; // [N, HV, K, V] (N: the table's sequences or pieces), or nullptr
  float* ht = nullptr;       // the same shape, or nullptr
  int64_t Tlen = 0, HV = 0, group = 1;
  int chunk_size = 64;
  float scale = 1.f;
};

// Shared memory of one CTA (offsets from a 1024-byte aligned base: the swizzled tiles need it).
struct ChainLayout {
  int w, k, q, p, u, g, rq, rk;  // stage 0's buffers; stage s adds s * stage
  int stage;
  int ldu;               // U tile leading dimension (elements)
  int os;                // per-warpgroup output staging tiles
  int bytes;          // everything, plus 1024 bytes of slack for the alignment
};
__host__ __device__ inline ChainLayout chain_layout(int nwg, int esize) {
  auto up = [](int x, int a) { return (x + a - 1) / a * a; };
  ChainLayout L;
  L.ldu = kCols * nwg + 8;
  int o = 0;
  L.w = o;
  o += 64 * 2 * 128;  // two blocks of 64 rows x 128 B
  L.k = o;
  o += 64 * 2 * 128;
  L.q = o;
  o += 64 * 2 * 128;
  L.p = o;
  o += 64 * 128;  // one block of 64 rows x 128 B
  L.u = o;
  o += up(64 * L.ldu * esize, 128);
  L.g = o;
  o += 64 * 4;
  L.rq = o;
  o += 64 * 4;
  L.rk = o;
  o += 64 * 4;
  L.stage = up(o, 1024);
  o = 2 * L.stage;
  L.os = o;
  o += nwg * 64 * kLdStage * esize;
  L.bytes = o + 1024;
  return L;
}

// A 64 x 64 tile of 16-bit rows (src row r at src + r * ld, 16-byte aligned) into one 64-row block of
// 128-byte rows with the 128-byte swizzle (16-byte piece j of row r at piece j ^ (r % 8)); rows >= len are
// zero. cp.async for the valid rows (the caller commits). A thread's rows are kThr / 8 apart, a multiple of
// 8, so its swizzle phase stays fixed.
template <class T, int kThr>
__device__ __forceinline__ void load_tile_p(unsigned char* dst, const T* src, int64_t ld, int len) {
  constexpr int kRowStep = kThr / 8;
  static_assert(kRowStep % 8 == 0, "the swizzle phase of a thread's rows must stay fixed");
  const int piece = static_cast<int>(threadIdx.x) & 7, r0 = static_cast<int>(threadIdx.x) >> 3;
  unsigned char* d = dst + r0 * 128 + ((piece ^ (r0 & 7)) << 4);
  const T* sp = src + r0 * ld + piece * 8;
#pragma unroll
  for (int it = 0; it < 64 / kRowStep; ++it) {
    if (r0 + it * kRowStep < len) {
      tiled::cp_async_16(d + it * kRowStep * 128, sp + it * kRowStep * ld);
    } else {
      *reinterpret_cast<uint4*>(d + it * kRowStep * 128) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// One CTA of NWG warpgroups per (sequence or piece, value head, 64 NWG state columns), sequential over
// the sequence's chunks (the file comment gives the steps).
template <class T, int NWG>
__global__ void __launch_bounds__(128 * NWG, 1) fused_chain_kernel(ChainArgs<T> args) {
#ifdef DELTACP_WGMMA_DEVICE
  using namespace tiled;
  constexpr int kThr = 128 * NWG, BVC = kCols * NWG;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const ChainLayout L = chain_layout(NWG, sizeof(T));

  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, wi = wtid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t n = blockIdx.x, hv = blockIdx.y, HV = args.HV;
  const int v0 = blockIdx.z * BVC;   // the CTA's first state column
  const int vw = v0 + kCols * wg;    // this warpgroup's first state column
  const int jr = 16 * wi + g;        // this thread's rows of S^T: jr and jr + 8
  const int64_t hk = hv / args.group;
  const SeqEntry se = args.seqs[n];
  const int cs = args.chunk_size;
  const bool has_gate = args.G != nullptr;

  // S^T in the m64n128 accumulator layout: S[4 nb + e] = state (key row 8 nb + 2 t + (e & 1),
  // column vw + jr + 8 (e >> 1)).
  const int64_t state0 = (n * HV + hv) * kKeys * kKeys;
  float S[64];
#pragma unroll
  for (int nb = 0; nb < 16; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t col = vw + jr + 8 * (e >> 1), d = 8 * nb + 2 * t + (e & 1);
      S[4 * nb + e] = args.h0 != nullptr ? args.h0[state0 + d * kKeys + col] : 0.f;
    }

  auto chunk_row0 = [&](int64_t c) { return se.batch * args.Tlen + se.bos + c * cs; };
  auto chunk_len = [&](int64_t c) { return static_cast<int>(min(static_cast<int64_t>(cs), se.len - c * cs)); };
  auto issue = [&](int64_t c) {
    const int64_t row0 = chunk_row0(c), t0 = se.bos + c * cs;
    const int len = chunk_len(c);
    unsigned char* st = smem + static_cast<int>(c & 1) * L.stage;
    load_tile_sw128<T, kThr>(st + L.w, args.W + (row0 * HV + hv) * kKeys, HV * kKeys, len);
    load_tile_sw128<T, kThr>(st + L.k, args.k.at(se.batch, t0, hk), args.k.st, len);
    load_tile_sw128<T, kThr>(st + L.q, args.q.at(se.batch, t0, hk), args.q.st, len);
    load_tile_p<T, kThr>(st + L.p, args.P + (row0 * HV + hv) * 64, HV * 64, len);
    load_tile_u<T, kThr, BVC>(reinterpret_cast<T*>(st + L.u), L.ldu, args.U + (row0 * HV + hv) * kKeys + v0,
                              HV * kKeys, len, BVC);
    float* gbuf = reinterpret_cast<float*>(st + L.g);
    if (tid < 64) {
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
        cp_async_4(rkb + i, args.rk + (row0 + i) * HV + hv);
      } else {
        rqb[i] = 1.f;
        rkb[i] = 1.f;
      }
    }
    cp_async_commit();
  };
  T* os = reinterpret_cast<T*>(smem + L.os) + wg * 64 * kLdStage;
  // stmatrix / ldmatrix row addresses: lane -> matrix q = lane / 8 (n-block parity q / 2, row half q % 2).
  const int sq = lane >> 3, srr = lane & 7;
  const int srow = 8 * (sq >> 1) + srr, scol = 16 * wi + 8 * (sq & 1);

  // The staged output rows of a chunk (tokens t0 .. t0 + len - 1) as 16-byte pieces of whole rows.
  auto store_staged = [&](int64_t t0, int len) {
    const int i0 = wtid >> 3, pc = (wtid & 7) * 8;
#pragma unroll
    for (int it = 0; it < 4; ++it) {
      const int i = i0 + 16 * it;
      if (i < len)
        *reinterpret_cast<uint4*>(args.o.at(se.batch, t0 + i, hv) + vw + pc) =
            *reinterpret_cast<const uint4*>(os + i * kLdStage + pc);
    }
  };

  const int64_t nchunks = se.num_chunks;
  if (nchunks > 0) issue(0);
  for (int64_t c = 0; c < nchunks; ++c) {
    const int len = chunk_len(c);
    const int64_t t0 = se.bos + c * cs;
    const unsigned char* st = smem + static_cast<int>(c & 1) * L.stage;
    if (c + 1 < nchunks) {
      issue(c + 1);  // stage (c + 1) % 2 was released by the barrier that ended chunk c - 1
    } else {
      cp_async_commit();
    }
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    const float* gbuf = reinterpret_cast<const float*>(st + L.g);
    const float* rqb = reinterpret_cast<const float*>(st + L.rq);
    const float* rkb = reinterpret_cast<const float*>(st + L.rk);
    const T* Us = reinterpret_cast<const T*>(st + L.u);
    const uint32_t w_addr = smem_u32(st + L.w), k_addr = smem_u32(st + L.k), q_addr = smem_u32(st + L.q);

    const uint32_t p_addr = smem_u32(st + L.p);

    // (1) Va = S^T W^T and Oa = S^T Q^T, A = bf16(S^T) from registers.
    float Va[32], Oa[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) Va[i] = Oa[i] = 0.f;
    uint32_t sa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) sa[kk][r] = pack2<T>(S[8 * kk + 2 * r], S[8 * kk + 2 * r + 1]);
    wg_fence();
    reg_fence(Va);
    reg_fence(Oa);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const uint32_t off = (kk >> 2) * 8192 + (kk & 3) * 32;
      wgmma_n64_rs<T>(Va, sa[kk], wg_desc(w_addr + off, 16, 1024), kk > 0);
      wgmma_n64_rs<T>(Oa, sa[kk], wg_desc(q_addr + off, 16, 1024), kk > 0);
    }
    wg_commit();
    // The previous chunk's output, staged at its end (the barrier that ended it made the tile visible),
    // goes out while the products run.
    if (c > 0) store_staged(t0 - cs, cs);
    wg_wait_all();
    reg_fence(Va);
    reg_fence(Oa);
    reg_fence(sa);

    // (2) Vn^T = U^T - Va (U^T fragments through ldmatrix.trans); Oa *= e^(G_i) per token column i.
    u_minus_acc_trans<T>(Va, Us, L.ldu, kCols * wg, srow, scol);
    const float glast = gbuf[len - 1];
    uint32_t va[4][4], vo[4][4];  // Vns^T (state update) and Vn^T (output) as A fragments
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      // tokens 16 kk + 2 t (+1) and 16 kk + 8 + 2 t (+1)
      const float2 ga = *reinterpret_cast<const float2*>(gbuf + 16 * kk + 2 * t);
      const float2 gb = *reinterpret_cast<const float2*>(gbuf + 16 * kk + 8 + 2 * t);
      const float2 ka = *reinterpret_cast<const float2*>(rkb + 16 * kk + 2 * t);  // K's rows: k_n = rk k
      const float2 kb = *reinterpret_cast<const float2*>(rkb + 16 * kk + 8 + 2 * t);
      const float2 qa = *reinterpret_cast<const float2*>(rqb + 16 * kk + 2 * t);  // Q's rows: q_n = rq q
      const float2 qb = *reinterpret_cast<const float2*>(rqb + 16 * kk + 8 + 2 * t);
      const float f0 = exp_t<T>(glast - ga.x) * ka.x, f1 = exp_t<T>(glast - ga.y) * ka.y;
      const float f2 = exp_t<T>(glast - gb.x) * kb.x, f3 = exp_t<T>(glast - gb.y) * kb.y;
      va[kk][0] = pack2<T>(Va[8 * kk] * f0, Va[8 * kk + 1] * f1);
      va[kk][1] = pack2<T>(Va[8 * kk + 2] * f0, Va[8 * kk + 3] * f1);
      va[kk][2] = pack2<T>(Va[8 * kk + 4] * f2, Va[8 * kk + 5] * f3);
      va[kk][3] = pack2<T>(Va[8 * kk + 6] * f2, Va[8 * kk + 7] * f3);
#pragma unroll
      for (int r = 0; r < 4; ++r) vo[kk][r] = pack2<T>(Va[8 * kk + 2 * r], Va[8 * kk + 2 * r + 1]);
      const float e0 = exp_t<T>(ga.x) * qa.x, e1 = exp_t<T>(ga.y) * qa.y;
      const float e2 = exp_t<T>(gb.x) * qb.x, e3 = exp_t<T>(gb.y) * qb.y;
      Oa[8 * kk] *= e0;
      Oa[8 * kk + 1] *= e1;
      Oa[8 * kk + 2] *= e0;
      Oa[8 * kk + 3] *= e1;
      Oa[8 * kk + 4] *= e2;
      Oa[8 * kk + 5] *= e3;
      Oa[8 * kk + 6] *= e2;
      Oa[8 * kk + 7] *= e3;
    }

    // (3) S^T = e^(G_n) S^T + Vns^T K;  Oa += Vn^T P^T.
    const float eg = exp_t<T>(glast);
#pragma unroll
    for (int i = 0; i < 64; ++i) S[i] *= eg;
    wg_fence();
    reg_fence(S);
    reg_fence(Oa);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_n128_rs_tb<T>(S, va[kk], wg_desc(k_addr + kk * 2048, 8192, 1024));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_n64_rs<T>(Oa, vo[kk], wg_desc(p_addr + kk * 32, 16, 1024), 1);
    wg_commit();
    wg_wait_all();
    reg_fence(S);
    reg_fence(Oa);
    reg_fence(va);
    reg_fence(vo);

    // (4) O = scale Oa^T, staged tokens x 64 columns (after every thread of the warpgroup has stored the
    // previous chunk's rows from the tile); stored during the next chunk's first products.
    warpgroup_bar(wg);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      const float s = args.scale;
      const uint32_t r[4] = {pack2<T>(s * Oa[8 * np], s * Oa[8 * np + 1]),
                             pack2<T>(s * Oa[8 * np + 2], s * Oa[8 * np + 3]),
                             pack2<T>(s * Oa[8 * np + 4], s * Oa[8 * np + 5]),
                             pack2<T>(s * Oa[8 * np + 6], s * Oa[8 * np + 7])};
      stmatrix_x4_trans(os + (16 * np + srow) * kLdStage + scol, r);
    }
    __syncthreads();  // this stage is free; the staged output is visible to the warpgroup
  }
  if (nchunks > 0) store_staged(se.bos + (nchunks - 1) * cs, chunk_len(nchunks - 1));

  if (args.ht != nullptr) {
#pragma unroll
    for (int nb = 0; nb < 16; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t col = vw + jr + 8 * (e >> 1), d = 8 * nb + 2 * t + (e & 1);
        args.ht[state0 + d * kKeys + col] = S[4 * nb + e];
      }
  }
#else
  __trap();  // never launched: the host selects this kernel only for builds with sm_90a code
#endif
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }
bool rows_aligned16(const TensorRef& r, int64_t es) {
  return aligned16(r.ptr) && (r.stride_b * es) % 16 == 0 && (r.stride_t * es) % 16 == 0 &&
         (r.stride_h * es) % 16 == 0;
}

// DELTACP_FUSED_WG: 0 (unset) = by the grid's width, else 1 or 2 warpgroups per CTA.
int warpgroups_from_env() {
  const char* env = std::getenv("DELTACP_FUSED_WG");
  if (env == nullptr || *env == '\0') return 0;
  DELTACP_CHECK(std::string(env) == "1" || std::string(env) == "2", "DELTACP_FUSED_WG", "expected 1 or 2, got '",
                env, "'");
  return std::atoi(env);
}

// Warpgroups per CTA: two share one copy of each chunk's tiles; one doubles the CTAs, which pays where
// two per CTA would leave SMs idle. DELTACP_FUSED_WG forces it.
int chain_warpgroups(int64_t seqs_x_heads, int sms) {
  const int env = warpgroups_from_env();
  if (env != 0) return env;
  return 2 * seqs_x_heads >= sms ? 2 : 1;
}

// The time model of the piece choice, in microseconds, for the sequences seqs cut into pieces of L chunks
// (L = 0: whole sequences). A chain step is one chunk of one CTA; the kernels run one CTA per SM, so CTAs
// beyond the SM count run in further waves.
//   chain (whole or every piece):  waves(pieces x HV x column tiles) x L x step_us
//   pass 1 (maps of all but each sequence's last piece, a state V + K = 256 columns wide, the tiled tier's
//          state-only scan: two CTAs of 128 columns per piece and head):  waves(maps x HV x 2) x L x map_step_us
//   fold:  (most pieces - 1) x fold_us
// step_us is the fused chain step as measured on an H200 in pieces (bf16 gdn, (2,16384,16,128): 3.2 to 3.4 us;
// 2.6 us over whole sequences, where fewer CTAs share the memory system);
// map_step_us and fold_us are the tiled tier's (cuda/tiled/scan_split.cu).
double fused_predicted_us(const std::vector<SeqEntry>& seqs, int64_t HV, int64_t L, int sms) {
  constexpr double step_us = 3.4, map_step_us = 2.1, fold_us = 3.8;
  int64_t pieces = 0, maps = 0, most = 1, longest = 0;
  for (const SeqEntry& s : seqs) {
    const int64_t P = L > 0 ? std::max<int64_t>(1, (s.num_chunks + L - 1) / L) : 1;
    pieces += P;
    maps += P - 1;
    most = std::max(most, P);
    longest = std::max(longest, L > 0 ? std::min(L, s.num_chunks) : s.num_chunks);
  }
  auto waves = [&](int64_t ctas) { return static_cast<double>((ctas + sms - 1) / sms); };
  const int64_t tiles = 2 / chain_warpgroups(pieces * HV, sms);
  const double chain = waves(pieces * HV * tiles) * static_cast<double>(longest) * step_us;
  const double pass1 = maps > 0 ? waves(maps * HV * 2) * static_cast<double>(longest) * map_step_us : 0.0;
  return chain + pass1 + fold_us * static_cast<double>(most - 1);
}

}  // namespace

const char* forward_refusal(const Params& p) {
#ifndef DELTACP_HAVE_SM90A
  (void)p;
  return "this build has no sm_90a code (DELTACP_CUDA_ARCHS without 90a)";
#else
  if (p.variant != Variant::gdn && p.variant != Variant::delta)
    return "it implements gdn and delta (kda and dplr run on the tiled and naive tiers)";
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return "it takes bf16 or fp16 inputs";
  if (p.K != kKeys || p.V != kKeys) return "it takes K = V = 128";
  if (p.chunk_size < 1 || p.chunk_size > 64) return "it takes chunk_size <= 64";
  if (p.final_state_only()) return "it computes the output (a final-state-only call runs on the tiled tier)";
  const int64_t es = dtype_size(p.dtype);
  if (!rows_aligned16(p.q, es)) return "it reads q in 16-byte pieces (q's pointer or strides are not 16-byte aligned)";
  if (!rows_aligned16(p.v, es)) return "it reads v in 16-byte pieces (v's pointer or strides are not 16-byte aligned)";
  if (!rows_aligned16(p.o, es)) return "it writes o in 16-byte pieces (o's pointer or strides are not 16-byte aligned)";
  if (p.HV % p.H != 0 || p.HV > 65535) return "it takes HV a multiple of H and at most 65535";
  // k's alignment and the GPU: what the wgmma state scan (its pass 1 of the pieces) needs too.
  return tiled::wgmma_scan_refusal(p, /*h_and_vnew_agree=*/true);
#endif
}

namespace {
// Chunks per piece for intra-card CP (0: whole sequences): DELTACP_FUSED_PIECE=<tokens> forces it (0 never
// cuts); unset, the length the time model predicts fastest, if it beats whole sequences by 25%.
int64_t fused_piece_chunks(const Params& p, const std::vector<SeqEntry>& seqs) {
  const int64_t env = tiled::piece_tokens_from_env("DELTACP_FUSED_PIECE");
  if (env == 0 || seqs.empty()) return 0;
  int64_t most = 0;
  for (const SeqEntry& s : seqs) most = std::max(most, s.num_chunks);
  if (env > 0) {
    const int64_t L = std::max<int64_t>(1, (env + p.chunk_size - 1) / p.chunk_size);
    return most > L ? L : 0;
  }
  const int sms = sm_count();
  const double whole = fused_predicted_us(seqs, p.HV, 0, sms);
  int64_t best_L = 0;
  double best = 0.75 * whole;  // cut only for a clear predicted gain (pass 1, the fold and the piece tables cost launches too)
  for (int64_t L : {8, 16, 32, 64, 128, 256}) {
    if (L >= most) break;
    const double us = fused_predicted_us(seqs, p.HV, L, sms);
    if (us < best) best = us, best_L = L;
  }
  return best_L;
}

template <class T>
void launch_chain(const Params& p, const ChunkTable& table, const float* G, const void* W, const void* U,
                  const void* P, const float* rq, const float* rk, const float* h0, float* ht, cudaStream_t stream) {
  if (table.num_seqs() == 0) return;
  ChainArgs<T> a;
  a.q = dev_rows<const T>(p.q);
  a.k = dev_rows<const T>(p.k);
  a.o = dev_rows<T>(p.o);
  a.seqs = table.seqs();
  a.G = p.variant == Variant::delta ? nullptr : G;
  a.W = static_cast<const T*>(W);
  a.U = static_cast<const T*>(U);
  a.P = static_cast<const T*>(P);
  a.rq = rq;
  a.rk = rk;
  a.h0 = h0;
  a.ht = ht;
  a.Tlen = p.T;
  a.HV = p.HV;
  a.group = p.HV / p.H;
  a.chunk_size = p.chunk_size;
  a.scale = static_cast<float>(p.scale);
  const int nwg = chain_warpgroups(table.num_seqs() * p.HV, sm_count());
  const ChainLayout L = chain_layout(nwg, sizeof(T));
  auto kernel = nwg == 2 ? fused_chain_kernel<T, 2> : fused_chain_kernel<T, 1>;
  opt_in_smem(kernel, L.bytes, "K", "the fused forward needs ", L.bytes, " bytes of shared memory");
  const dim3 grid(static_cast<unsigned>(table.num_seqs()), static_cast<unsigned>(p.HV),
                  static_cast<unsigned>(kKeys / (kCols * nwg)));
  kernel<<<grid, 128 * nwg, L.bytes, stream>>>(a);
  DELTACP_CUDA_CHECK_LAUNCH();
}
}  // namespace

void forward(const Params& p) {
  if (const char* why = forward_refusal(p))
    throw_error("backend", "the fused tier cannot run this call: ", why, "; backend='tiled' runs it");
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const ChunkTable table(p, p.chunk_size, stream);
  if (table.num_seqs() == 0) return;
  const int64_t R = p.B * p.T, es = dtype_size(p.dtype);
  auto align = [](int64_t b) { return (b + 255) / 256 * 256; };
  const bool gated = p.variant == Variant::gdn;
  const int64_t bytes_G = gated ? align(R * p.HV * 4) : 0;
  const int64_t bytes_W = align(R * p.HV * kKeys * es), bytes_U = align(R * p.HV * kKeys * es);
  const int64_t bytes_P = align(R * p.HV * 64 * es);

  // The plan: whole sequences, or pieces of L chunks (intra-card CP).
  const int64_t Lc = fused_piece_chunks(p, table.host_seqs());
  tiled::ScanPlan plan;
  if (Lc > 0) plan = tiled::plan_pieces(p, table.host_seqs(), Lc);
  const int64_t N = table.num_seqs(), KV = p.K * p.V;
  std::vector<int64_t> pass1;                 // every piece but each cut sequence's last
  std::vector<const float*> seq_maps(static_cast<size_t>(N), nullptr);
  std::vector<int64_t> pass1_first(static_cast<size_t>(N), -1);
  if (plan.cut())
    for (int64_t s = 0; s < N; ++s) {
      if (plan.pieces_of(s) < 2) continue;
      pass1_first[static_cast<size_t>(s)] = static_cast<int64_t>(pass1.size());
      for (int64_t i = plan.first_piece[s]; i + 1 < plan.first_piece[s + 1]; ++i) pass1.push_back(i);
    }
  const int64_t P = plan.cut() ? static_cast<int64_t>(plan.pieces.size()) : 0;
  const int64_t bytes_maps = align(static_cast<int64_t>(pass1.size()) * p.HV * p.K * (p.V + p.K) * 4);
  const int64_t bytes_starts = align(P * p.HV * KV * 4), bytes_pht = p.ht != nullptr ? bytes_starts : 0;
  // qk_l2norm: the rows' scales, and for the pieces' pass 1 (the tiled scan, which reads k) the normalised k.
  const bool l2 = p.qk_l2norm;
  const int64_t bytes_r = l2 ? align(R * p.HV * 4) : 0;
  const int64_t bytes_kn = l2 && plan.cut() ? align(R * p.H * kKeys * es) : 0;
  const int64_t total = bytes_G + bytes_W + bytes_U + bytes_P + bytes_maps + bytes_starts + bytes_pht + 2 * bytes_r +
                        bytes_kn;
  char* ws = static_cast<char*>(workspace_alloc(static_cast<size_t>(total), stream));
  try {
    char* at = ws;
    auto take = [&](int64_t b) {
      char* r = b > 0 ? at : nullptr;
      at += b;
      return r;
    };
    float* G = reinterpret_cast<float*>(take(bytes_G));
    void* W = take(bytes_W);
    void* U = take(bytes_U);
    void* Pw = take(bytes_P);
    float* maps = reinterpret_cast<float*>(take(bytes_maps));
    float* starts = reinterpret_cast<float*>(take(bytes_starts));
    float* piece_ht = reinterpret_cast<float*>(take(bytes_pht));
    float* rq = reinterpret_cast<float*>(take(bytes_r));
    float* rk = reinterpret_cast<float*>(take(bytes_r));
    void* Kn = take(bytes_kn);
    tiled::launch_chunk_cumsum(p, table, G, stream);
    dispatch_dtype(p.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (tiled::kIs16Bit<T>) {
        launch_fused_wy<T>(p, table, G, static_cast<T*>(W), static_cast<T*>(U), static_cast<T*>(Pw), rq, rk,
                           static_cast<T*>(Kn), stream);
        if (!plan.cut()) {
          launch_chain<T>(p, table, G, W, U, Pw, rq, rk, static_cast<const float*>(p.h0), static_cast<float*>(p.ht),
                          stream);
          return;
        }
        for (int64_t s = 0; s < N; ++s)
          if (pass1_first[static_cast<size_t>(s)] >= 0)
            seq_maps[static_cast<size_t>(s)] = maps + pass1_first[static_cast<size_t>(s)] * p.HV * p.K * (p.V + p.K);
        Params pk = p;  // pass 1 reads k itself: with qk_l2norm, the normalised rows
        if (l2) {
          pk.qk_l2norm = false;
          pk.k = contiguous_ref(Kn, p.T, p.H, kKeys);
        }
        tiled::launch_pass1(pk, plan, pass1, G, W, U, nullptr, maps, stream);
        const tiled::PieceTables tables(p, plan, seq_maps, stream);
        tiled::launch_fold_starts(p, tables, N, static_cast<const float*>(p.h0), starts, stream);
        launch_chain<T>(p, tables.pieces(), G, W, U, Pw, rq, rk, starts, piece_ht, stream);
        if (p.ht != nullptr) tiled::launch_gather_final_states(p, tables, N, piece_ht, static_cast<float*>(p.ht), stream);
      }
    });
  } catch (...) {
    workspace_free(ws, stream);
    throw;
  }
  workspace_free(ws, stream);
}

}  // namespace deltacp::cuda::fused
