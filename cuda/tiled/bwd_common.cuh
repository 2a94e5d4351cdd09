// cuda/tiled/bwd_common.cuh — shared pieces of the tiled backward (tiled_bwd.cu): the argument
// block every backward kernel takes, shared-memory carving, and one block-wide matrix product.
//
// Notation (one chunk of n <= 64 tokens, one value head; docs/design.md section 3), used by every
// bwd_*.cuh file:
//   G     within-chunk cumulative log decay (n x K; gdn: one scalar per row; delta: 0)
//   E_ij^d = e^(G_id - G_jd) for i >= j (mask first, then exp: never e^-G)
//   Gam   = e^G,  Gn = G of the chunk's last token,  Kr_j = k_j * e^(Gn - G_j)
//   A, T = (I + A)^-1, X = K*Gam, W = T diag(beta) X, U = T diag(beta) V, Vn = U - W S
//   P_ij  = sum_d q_id k_jd E_ij^d (i >= j),  O = scale((Q*Gam) S + P Vn),  S' = e^Gn S + Kr^T Vn
//
// Tiles: every per-chunk tile has 64 rows (a shorter chunk is a zero-padded tile: rows >= len are
// zero in every operand, so they add nothing) and KP in {64, 128} key columns (K zero-padded).
// Operand tiles are stored in the input element type Op (= the input dtype: fp32, bf16 or fp16)
// and multiplied with fwd_mma.cuh's warp_mma: mma.sync.m16n8k16 with fp32 accumulation for 16-bit
// types, exact fp32 FFMA for fp32 (TF32 would miss the 1e-5 fp32 tolerance). Accumulators,
// gradients and every exponential are fp32.
//
// Pitches (leading dimensions, in elements): 16-bit tiles use cols + 8 (ldmatrix rows 16-byte
// aligned, conflict-free); fp32 tiles cols + 4 (16-byte rows for cp.async and vector loads), except the
// element-by-element kda B4's cols + 1 (odd: its column walks hit 32 different banks).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "bwd_handoff.cuh"
#include "chunk_table.cuh"
#include "deltacp/params.h"
#include "fwd_mma.cuh"

namespace deltacp::cuda::tiled::bwd {

constexpr int kRows = 64;                  // tile rows: one chunk of up to 64 tokens
constexpr int kThreads = 256;              // every backward kernel runs 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kMaxKeyDim = 128;            // KP in {64, 128}
constexpr int kVTile = 32;                 // V columns per step of the per-chunk kernels' V loops

// Everything a backward kernel reads or writes. Plain data, passed by value to every kernel.
struct Args {
  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  int64_t group = 1;        // HV / H: value head hv reads query/key head hv / group
  int64_t num_chunks = 0;   // chunks in the table (all sequences)
  int64_t Kp = 0, Vp = 0;   // padded K, V of the forward stages' W / v_new / h buffers
  int chunk_size = 64;      // tokens per chunk (the last chunk of a sequence may be shorter)
  float scale = 1.f;
  bool gated = false;       // gdn and kda: a log decay g exists
  bool g_fp32 = false;      // g and dg are fp32 (Params::g_fp32), whatever the input dtype
  bool dh0_only = false;    // Params::dh0_only: stages B0 and B1 only, B1 writes dh0 and nothing else
  bool dv_local_done = false;  // the recompute wrote B0's dVn_local (wy_wgmma.cuh; kda: kda_prepare_wgmma.cuh's
                               // backward mode, which also writes Q e^G): B0 is skipped
  // Inputs and outputs: [B, T, heads, D] views in the input dtype (see params.h).
  TensorRef q, k, v, g, beta, dout;
  TensorRef dq, dk, dv, dg, dbeta;
  const float* dht = nullptr;  // [N, HV, K, V] optional
  float* dh0 = nullptr;        // [N, HV, K, V] optional
  const ChunkEntry* chunks = nullptr;
  const SeqEntry* seqs = nullptr;
  // Forward recompute (fwd_stages.cuh layouts; R = B * T token rows):
  const float* G = nullptr;     // gdn [R, HV]; kda [R, HV, K]; delta: nullptr
  const float* Tinv = nullptr;  // [R, HV, 64]: row i of the chunk's T at the row of token i
  const void* W = nullptr;      // input dtype [R, HV, Kp]
  const void* vnew = nullptr;   // input dtype [R, HV, Vp]
  const void* h = nullptr;      // input dtype [num_chunks, HV, Kp, Vp]: state at each chunk's start
  const void* Kd = nullptr;     // kda: input dtype [R, HV, Kp]: K e^(Gn - G) (the forward's stage 2)
  void* Qg = nullptr;           // kda: input dtype [R, HV, Kp]: Q e^G (written by B0, read by B1)
  // Backward workspaces (fp32 unless said otherwise). B2..B5 may run over a slice of the chunks
  // (tiled_bwd.cu): then chunks points at the slice's first entry, h and dh at its first chunk, dP and dA
  // hold the slice's chunks only (indexed by the slice's own chunk index), and the [R, HV, ...] buffers
  // from dW on hold the slice's rows only, their pointers offset so that the global row indexes them.
  void* dh = nullptr;      // input dtype [num_chunks, HV, K, V]: dL/d(end state of chunk c); B2 reads it
                           // only as the 16-bit operand (and for dGs), so B1 stores it rounded
  float* dvnew = nullptr;  // [R, HV, V]: dL/dVn (B0's part, then B1's sum over it)
  // B1 (the Hopper dh scan) writes dVn in the input dtype over the bytes of its fp32 input, and the chunk-local
  // kernel reads it so (tiled_bwd.cu, local_inputs_16bit): dvn16_at(r, c) below. Only with both of those kernels.
  bool dvn16 = false;
  // The WY stage (wy_wgmma.cuh, or kda's wgmma recompute) wrote T in the input dtype, in the first 128 bytes of
  // each 256-byte row of Tinv, which the chunk-local kernel reads (local_inputs_16bit).
  bool t16 = false;
  void* dW = nullptr;      // input dtype [R, HV, K]: B3 reads it only as a tensor-core operand
  float* dP = nullptr;     // [num_chunks, HV, 64, 64]: scale * dO Vn^T, masked to i >= j
  float* dA = nullptr;     // [num_chunks, HV, 64, 64]: dL/dA, masked to i > j
  float* dqw = nullptr;    // [R, HV, K]: dq per value head
  float* dkw = nullptr;    // [R, HV, K]: dk per value head
  float* dGw = nullptr;    // kda [R, HV, K]: dL/dG (before the reverse cumsum)
  float* dGr = nullptr;    // gdn [R, HV]: dL/dG summed over the key columns (B2 writes, B3 adds, B4 reads):
                           // a scalar gate needs only the row sums, a K-times smaller stream than dGw
  float* dbw = nullptr;    // [R, HV]: dbeta from the WY stage (the decay stage adds the rest)
  BwdHandoff handoff;      // B1 beside the chunk-local kernel (bwd_handoff.cuh); empty: one after the other
};

// With Args::dvn16: the byte offset of dVn's 16-bit element (token row `row`, value head hv, column c) inside
// the fp32 [R, HV, V] buffer dvnew: row (row, hv)'s 16-bit values sit in its own 4 V bytes, the 64 columns of
// block c / 64 at 256 (c / 64) + 2 (c % 64), i.e. inside the bytes of the fp32 columns the same block's writer
// read (B1's warpgroup of those 64 columns), so B1 may overwrite its input row by row in place.
__host__ __device__ inline int64_t dvn16_at(int64_t row, int64_t hv, int64_t HV, int64_t V, int64_t c) {
  return (row * HV + hv) * V * 4 + (c / 64) * 256 + (c % 64) * 2;
}

// ---- indexing ---------------------------------------------------------------------------------
// Element offset of (b, t, head, 0) in a [B, T, heads, D] view.
__device__ __forceinline__ int64_t off(const TensorRef& r, int64_t b, int64_t t, int64_t head) {
  return b * r.stride_b + t * r.stride_t + head * r.stride_h;
}
// Offset of (token row i of chunk ch, value head hv, column 0) in an [R, HV, D] workspace.
__device__ __forceinline__ int64_t ws_row(const ChunkEntry& ch, int i, int64_t HV, int64_t hv, int64_t D) {
  return ((ch.row0 + i) * HV + hv) * D;
}
template <class T>
__device__ __forceinline__ float ld(const TensorRef& r, int64_t o) {
  return to_f(static_cast<const T*>(r.ptr)[o]);
}
template <class T>
__device__ __forceinline__ void st(const TensorRef& r, int64_t o, float x) {
  static_cast<T*>(r.ptr)[o] = from_f<T>(x);
}
// Output elements o and o + 1 (the second only when `both`) of a view in the input dtype: one paired store
// when aligned.
template <class Op>
__device__ __forceinline__ void st2(const TensorRef& r, int64_t o, float x0, float x1, bool both) {
  Op* p = static_cast<Op*>(r.ptr) + o;
  if (both && reinterpret_cast<uintptr_t>(p) % (2 * sizeof(Op)) == 0) {
    store_pair(p, x0, x1);
  } else {
    p[0] = from_f<Op>(x0);
    if (both) p[1] = from_f<Op>(x1);
  }
}
// dg is stored in g's dtype: fp32 when Params::g_fp32, else the input dtype T.
template <class T, class Args>
__device__ __forceinline__ void store_gate(const Args& a, int64_t o, float x) {
  if (a.g_fp32) {
    static_cast<float*>(a.dg.ptr)[o] = x;
  } else {
    st<T>(a.dg, o, x);
  }
}
// G of token row i (clamped to the chunk's last token, so padding rows repeat it) and key column d.
__device__ __forceinline__ float G_at(const Args& a, bool perkey, const ChunkEntry& ch, int len, int64_t hv, int i,
                                      int d) {
  const int r = i < len ? i : len - 1;
  if (perkey) return d < a.K ? a.G[ws_row(ch, r, a.HV, hv, a.K) + d] : 0.f;
  return a.G[(ch.row0 + r) * a.HV + hv];
}

// ---- the chunk's tiles, by cp.async (the caller commits and waits) ---------------------------------
// Rows [0, len) of a [B, T, heads, D] input (q, k) at the chunk's tokens and head `head`, columns < D, into
// a 64 x KP tile of leading dimension ld; zeros elsewhere. Unaligned rows are copied with ordinary loads.
template <class Op, int KP>
__device__ __forceinline__ void load_chunk_rows(Op* dst, int ld, const TensorRef& r, const ChunkEntry& ch,
                                                int64_t head, int len, int D) {
  const Op* src = static_cast<const Op*>(r.ptr) + off(r, ch.batch, ch.t0, head);
  load_tile<Op, kThreads>(dst, ld, src, r.stride_t, len, kRows, D, KP, vec_ok(src, r.stride_t));
}
// The chunk's cumulative log decay G of value head hv, rows < len: kda a 64 x KP tile (leading dimension
// ld, zero past K and len), gdn one value per row. Every thread of the block calls it.
template <int KP, bool PERKEY>
__device__ __forceinline__ void load_chunk_G(float* dst, int ld, const Args& a, const ChunkEntry& ch, int64_t hv,
                                             int len) {
  if constexpr (PERKEY) {
    const float* src = a.G + ws_row(ch, 0, a.HV, hv, a.K);
    load_tile<float, kThreads>(dst, ld, src, a.HV * a.K, len, kRows, static_cast<int>(a.K), KP,
                               vec_ok(src, a.HV * a.K));
  } else {
    const int i = static_cast<int>(threadIdx.x);
    if (i < len) cp_async_4(dst + i, a.G + (ch.row0 + i) * a.HV + hv);
  }
}
// The walk over V tiles of B2 and B3, NS (1 or 2) cp.async stages deep: at step t, after tile 0 was issued
// before the walk (issue(t) loads tile t into stage t % NS and commits one group), start tile t + 1 (two
// stages; its stage was last read by tile t - 1, released by the barrier that ended that step) or tile t
// (one stage), then wait until tile t and every group before it have landed. The caller's barrier follows.
template <int NS, class Issue>
__device__ __forceinline__ void await_tile(int t, int ntiles, Issue&& issue) {
  static_assert(NS == 1 || NS == 2, "one or two stages");
  if constexpr (NS == 2) {
    if (t + 1 < ntiles) issue(t + 1);
    else cp_async_commit();  // an empty group keeps the wait count uniform
    cp_async_wait<1>();
  } else {
    if (t > 0) issue(t);
    cp_async_wait<0>();
  }
}
// A warp's accumulator block (rows m0 + 16 x 1, columns n0 + 8 NT) rounded into an operand tile of the
// input dtype (leading dimension ld), two adjacent columns per store.
template <class Op, int NT>
__device__ __forceinline__ void acc_to_tile(const float (&acc)[1][NT][4], Op* dst, int ld, int m0, int n0) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2)
      store_pair(dst + (m0 + acc_row(0, 2 * h2)) * ld + n0 + acc_col(nt, 0), acc[0][nt][2 * h2],
                 acc[0][nt][2 * h2 + 1]);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) x += __shfl_xor_sync(0xffffffffu, x, s);
  return x;
}

// ---- shared memory ----------------------------------------------------------------------------
// Hands out 16-byte aligned byte offsets in order; the same arithmetic runs on host (launch size)
// and device (pointers), from a constexpr layout struct per kernel.
struct Carve {
  size_t off = 0;
  __host__ __device__ constexpr size_t take(size_t bytes) {
    const size_t o = off;
    off = (off + bytes + 15) / 16 * 16;
    return o;
  }
};

// ---- the block-wide product -------------------------------------------------------------------
// C (M x N) = A (M x Kd) B (Kd x N) with A, B tiles in shared memory (layouts as in fwd_mma.cuh:
// LA rowmajor A(m,k) = a[m*lda+k], colmajor A(m,k) = a[k*lda+m]; LB rowmajor B(k,n) = b[k*ldb+n],
// colmajor B(k,n) = b[n*ldb+k]). The 8 warps take the 16 x 32 blocks of C round-robin; epi(m, n, c)
// is then called exactly once per element of C, by the thread that holds it. Every thread of the
// block must call it. Kd must be a multiple of 16 for 16-bit operands. It does not synchronise:
// callers put __syncthreads() between a product and anything that reads what its epilogue wrote.
template <class Op, int M, int N, Lay LA, Lay LB, class Epi>
__device__ __forceinline__ void block_gemm(const Op* a, int lda, const Op* b, int ldb, int Kd, Epi&& epi) {
  static_assert(M % 16 == 0 && N % 32 == 0, "block_gemm works on 16 x 32 blocks");
  constexpr int kBlocksN = N / 32;
  constexpr int kBlocks = (M / 16) * kBlocksN;
  const int warp = threadIdx.x >> 5;
  for (int blk = warp; blk < kBlocks; blk += kWarps) {
    const int m0 = (blk / kBlocksN) * 16, n0 = (blk % kBlocksN) * 32;
    float acc[1][4][4];
    zero_acc(acc);
    warp_mma<Op, 1, 4, LA, LB>(acc, a, lda, m0, b, ldb, n0, 0, Kd);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) epi(m0 + acc_row(0, e), n0 + acc_col(nt, e), acc[0][nt][e]);
  }
}

}  // namespace deltacp::cuda::tiled::bwd
