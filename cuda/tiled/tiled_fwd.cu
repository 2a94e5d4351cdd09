// cuda/tiled/tiled_fwd.cu — the tiled tier's forward: the chunked WY algorithm, one kernel per stage.
//
// Algorithm (docs/design.md section 3; reference/include/deltacp/reference/chunked.h). Each sequence is
// cut into chunks of C = p.chunk_size <= 64 tokens (restarting at every sequence start; the last
// chunk may be short). For a chunk with state S at its start, G = within-chunk cumsum of g:
//
//   A  = strict_tril( Beta (K e^G)(K e^-G)^T )       T = (I + A)^-1
//   W  = T Beta (K e^G)          U = T Beta V
//   Vn = U - W S                 S' = D_n S + (K e^(G_n - G))^T Vn
//   O  = scale ( (Q e^G) S + tril((Q e^G)(K e^-G)^T) Vn )
//
// Kernels (4 warps = 128 threads each; tiles of 64 rows in shared memory; products on tensor cores
// through mma.sync m16n8k16 with fp32 accumulation for bf16/fp16, FFMA for fp32 — fwd_mma.cuh):
//
//   1 chunk_cumsum_kernel      grid (chunks, ceil(HV*Dg/128))  G = cumsum g per chunk (Dg = 1 gdn, K kda)
//   2 chunk_wy_kernel          grid (chunks, HV)               A -> T (blocked forward substitution in
//                                                              fp32) -> W, U (and Kd for kda)
//     (or, on Hopper for 16-bit gdn / delta at K = 128 with V = 128 or 256 and at K = V = 64, wy_wgmma_kernel in
//     wy_wgmma.cuh: TMA tiles and warpgroup products, the fused forward's token-parallel stage)
//   3 chunk_state_scan_kernel  grid (seqs, HV, Vp/BV)          sequential over the sequence's chunks
//     (or, on Hopper with wide grids, chunk_state_scan_wgmma_kernel in scan_wgmma.cuh; with a few long
//     sequences, in pieces side by side: scan_split.cu, whose pass 1 runs in prepare);
//                                                              S (K x BV) stays in fp32 registers; writes
//                                                              h_c (chunk-start state) and Vn
//   4 chunk_output_kernel      grid (chunks, HV)               O, parallel over chunks
//
// Staged (deltacp::cuda::StagedForward, api.h; the CP forward): prepare = stages 1 and 2 (nothing reads
// h0 there), then any number of state_pieces = stage 3 alone, final-state-only, over pieces made of the
// prepared chunks with a state wider than V (ScanRows: rows shifted into the prepared intermediates, and
// only the first V columns read U: the CP pre-pass's [H | M] maps), then finish = stages 3 and 4 from
// h0. FwdState keeps the chunk table and the workspace between the calls; run_forward is prepare +
// finish in one call, so both give bitwise equal o and ht.
//
// Decays are never formed as e^-G (it overflows): gdn uses e^(G_i - G_j) with the mask j <= i
// applied before the exponential; kda (a decay per key dimension, so it cannot be pulled out of
// the dot product) splits the 64 x 64 triangle into 16 x 16 blocks: a block (a, b < a) is
// X_r Y_r^T with X_r = X e^(G - G_r), Y_r = Y e^(G_r - G) around the reference row r = 16 a
// (both exponents <= 0, a tensor-core product), and the 4 diagonal blocks are summed element by
// element with e^(G_i,d - G_j,d), j <= i. Rows past a short chunk are zero in every tile, and
// their G rows repeat the chunk's last G row, so every exponent stays finite.
//
// What changed from the naive tier (cuda/naive): the naive tier walks tokens one at a time with the
// state in registers (one rank-1 update per token: memory- and latency-bound, no tensor cores).
// Here the per-token work inside a chunk becomes dense 64-row matrix products (tensor cores) and
// only the chunk-to-chunk state pass (stage 3) is sequential: 64x fewer sequential steps. The
// price: h per chunk (Kp x Vp per chunk and head) round-trips HBM between stages 3 and 4.
//
// Work per chunk and head (C = 64, K = V = D, 16-bit I/O; fwd_cost() below counts it for any shape):
//   FLOPs  2 C^2 D (A) + 4 C^2 D (W, U) + 4 C D^2 (stage 3: W S, K^T Vn) + 2 C D^2 (Q h)
//          + 4 C^2 D (Q K^T, P Vn) = 10 C^2 D + 6 C D^2      D = 128: 11.5 MFLOP (180 kFLOP / token)
//   bytes  stage 2: k, v in, W, U out (8 C D); stage 3: W, U, k in, Vn, h out (8 C D + 2 D^2);
//          stage 4: q, k, Vn, h in, o out (8 C D + 2 D^2)  ->  24 C D + 4 D^2 = 262 kB (4.1 kB / token)
//   At (1,8192,96,128) that is 3.2 GB: 0.76 ms at the 4.25 TB/s an H200 copies (bench_gpu.py's copy rate),
//   1.1 ms at ~3 TB/s on an H100; its 1.4e11 FLOPs are ~0.2-0.3 ms of mma.sync. So: memory-bound.
//
// Kernels, dynamic shared memory (bf16, K = V = 128) and registers (nvcc 13.0 --resource-usage,
// sm_90; the 16-bit paths spill at most a few bytes, up to ~100 B in the BV = 64 two-stage scan):
//   chunk_cumsum_kernel       128 thr   0 KB                     32 regs
//   chunk_wy_kernel           128 thr   74 KB (3 CTAs/SM)        72-80 regs   (kda 107 KB, 167 regs: the
//                                       fused stage's row norms, 32 partial sums a thread)
//   chunk_state_scan_kernel   256 thr   BV 32: 96 KB with two load stages (2 CTAs/SM); BV 64: 117 KB
//                                       (1 CTA/SM); K <= 64 runs 128 threads       <= 128 regs
//   chunk_output_kernel       128 thr   70.5 KB (3 CTAs/SM)      71-72 regs   (kda 103.5 KB)
//   kda_prepare_kernel        128 thr   109.75 KB (2 CTAs/SM)    168 regs (fp16 174), no spills (nvcc 13.0,
//                                       sm_90a): the fused forward's kda stage, chunk_wy_kernel<T, true> and
//                                       kda_chain_operands_kernel in one
//   kda_prepare_wgmma_kernel  256 thr   104.3 KB (2 CTAs/SM)     127 regs (fp16 126), no spills (nvcc 13.0, sm_90a):
//                                       the same stage on wgmma (kda_prepare_wgmma.cuh; the default on
//                                       compute capability 9.0, DELTACP_FUSED_KDA_PREPARE_WGMMA=0 turns it off);
//                                       its backward mode (the kda backward's recompute with B0): 112.3 KB
//                                       (2 CTAs/SM), 127 regs (fp16 124), no spills
// fp32 inputs need about twice the shared memory (the scan then runs one load stage); fp32 with
// K or V = 256 does not fit an sm_80 (an Error names K). bf16/fp16 fit up to K = V = 256.
//
// Measured (NVIDIA H200, 2026-11-22, bf16 GDN, median of do_bench, FLA 0.5.2 in the same
// run): (B,T,H,D) = (4,2048,16,128) 0.387 ms (FLA 0.436), (1,8192,96,128) 1.941 ms (FLA
// 1.405), (2,16384,16,128) 1.410 ms (FLA 1.040), (4,4096,64,128) 2.369 ms (FLA 1.712); KDA
// (4,2048,16,128) 1.595 ms (FLA 1.305, before the scan rework). Per kernel at (2,16384,16,128):
// scan 0.50 ms (was 1.05: see stage 3 below for why), wy 0.44, output 0.38. Nsight Compute puts
// the wy and output stages at ~0.4 issued instructions per scheduler cycle with 12 warps per SM:
// issue-bound on their element-wise tile loops; they are what to attack next.
// On Hopper, stage 3 runs on wgmma where the grid is wide (scan_wgmma.cuh; H200, same harness):
// (1,8192,96,128) 1.701 ms (FLA 1.399), (4,4096,64,128) 2.128 ms (FLA 1.706); the other two shapes
// keep the mma.sync scan (0.391, 1.427 ms).
// Stage 2 on Hopper (wy_wgmma.cuh): 0.259 ms at (2,16384,16,128) and 0.379 at (1,8192,96,128) against this
// file's chunk_wy_kernel's 0.447 and 0.652 (H200, kernel time, 2026-11-25; as the fused forward's stage, with P
// and without T); the tiled forward and the backward's recompute run it where it applies (=0: not).
// Where a few long sequences leave the scan's grid narrow, stage 3 runs in pieces (scan_split.cu:
// pass 1 in prepare, a fold, pass 2; H200): (1,32768,16,128) 1.541 ms (FLA 1.286; 1.971 unsplit),
// (1,65536,16,128) 2.782 ms (FLA 2.513; 3.765 unsplit).
// kda's G tile loads by cp.async (load_key_gate, kda_scores.cuh), not element by element (H100, kda
// (2,16384,16,128)): wy 2.90 -> 2.01 ms, output 2.69 -> 1.87 ms. Then eight keys per thread in the decay
// scalings (kda_scores' rescaled rows, Kd and K e^G here, Q e^G in kda_output_operands), whose per-element
// loops with an integer division each had half of the wy stage's warp samples (Nsight Compute), and bf16's
// diagonal 16 x 16 blocks on the tensor cores: wy 1.97 -> 0.96 ms, output 1.85 -> 0.98 ms (H100, kernel time);
// the kda forward 4.55 -> 2.66 ms of kernels. As the fused forward's kda stage (launch_kda_fused_prepare) the wy
// kernel and kda_chain_operands_kernel sum the gate themselves and normalise q, k where they load them: 0.99 and
// 0.76 ms, against 0.96 + 0.74 + the cumsum's 0.22 (H100, (2,16384,16,128), kernel time, no l2 norm). Then the
// decay scalings' exponentials without subnormal handling, their range check per row and the piece indices by
// shifts (fused_fwd.cu has the profile that found them): the kda forward end to end 3.13 -> 2.85 ms on this tier
// and 2.63 -> 2.10 on the fused one (H100, (2,16384,16,128), with FLA's l2 norm and safe gate keywords).
// The fused forward's kda stage then runs as one kernel, kda_prepare_kernel (the pair's loads, gate sum, l2 norm
// and the scores' shared Y-row scaling done once; the same bits; DELTACP_FUSED_KDA_PREPARE=0: the pair): the
// fused kda forward end to end 2.10 -> 1.70 ms (FLA 2.27; (1,8192,96,128) 2.93 -> 2.60, (4,4096,64,128)
// 3.99 -> 2.93; H100, (2,16384,16,128), FLA's keywords), and 1.54 ms once safe_gate's range check stopped
// synchronising before the launches (deltacp/_library.py).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/check.h"
#include "../common/dev_rows.cuh"
#include "../common/gate_range.cuh"
#include "../common/gate_range.h"
#include "../common/kda_gate.cuh"
#include "../common/device_info.h"
#include "../common/kernel_switch.h"
#include "../common/load_store.cuh"
#include "chunk_table.cuh"
#include "deltacp/cuda/tiers.h"
#include "deltacp/error.h"
#include "deltacp/params.h"
#include "fwd_mma.cuh"
#include "fwd_stages.cuh"
#include "kda_scores.cuh"
#include "wy_solve.cuh"
#include "wy_wgmma.cuh"
#include "scan_config.h"

namespace deltacp::cuda::tiled {
namespace {

constexpr int kThreads = 128;  // 4 warps per CTA in every kernel
constexpr int kBT = kTileRows;  // 64 rows per chunk tile

// Everything a stage kernel reads from Params, as plain device-side values.
template <class T>
struct FwdArgs {
  DevRows<const T> q, k, v, beta;  // g is read by stage 1 only, in its own dtype (p.gate_dtype())
  DevRows<T> o;
  const ChunkEntry* chunks = nullptr;
  const SeqEntry* seqs = nullptr;
  int64_t Tlen = 0, HV = 0, K = 0, V = 0;
  int64_t group = 1;  // HV / H: the query/key head of value head hv is hv / group
  int Kp = 0, Vp = 0, chunk_size = 0;
  // Where the state scan reads U: rows of width Up (Vp unless the rows belong to a prepared problem, see
  // ScanRows in fwd_stages.cuh), of which the first u_cols columns are read; the state's columns from
  // u_cols on see zero values. ws_row0 shifts every workspace row (G, W, U, Kd, v_new) the scan reads.
  int Up = 0, u_cols = 0;
  int64_t ws_row0 = 0;
  float scale = 1.f;
  bool has_gate = false;  // false for delta (G = 0)
  bool o_pairs = false;   // o rows allow 2-element stores (aligned base, even strides, V even)
  // kda in the fused forward's token-parallel stage (launch_kda_fused_prepare): the gate read raw and summed
  // within each chunk in shared memory (load_raw_gate, chunk_sum_gate) instead of from stage 1's G workspace:
  // g in fp32 or in T (the one whose ptr is set), and G's last row of each chunk written to g_last ([R, HV, K]
  // rows; the only rows the chain and its pieces read). qk_l2norm: q and k l2-normalised in shared memory.
  DevRows<const float> g32;
  DevRows<const T> g16;
  float* g_last = nullptr;
  bool qk_l2norm = false;
  // Rows of q and k with norm at most 1 (Params::qk_l2norm or qk_unit_rows): kda's diagonal score blocks take the
  // wider decay bound (kda_scores.cuh diag_refused).
  bool unit_rows = false;
  // kda's in-kernel gate (Params::gate_A_log): the raw g becomes kda_gate_value(g, e^A_log, dt_bias, lower_bound)
  // where chunk_sum_gate sums it (gate_A_log null: g is the log decay already).
  const float* gate_A_log = nullptr;
  const float* gate_dt_bias = nullptr;
  float gate_lower_bound = 0.f;
  // safe_gate's range check folded into the gate load (Params::gate_range; kda_prepare_wgmma_kernel only): the
  // smallest and largest raw value in common/gate_range.cuh's integer form, or nullptr.
  int* gate_range = nullptr;
  __host__ __device__ bool gate_in_kernel() const { return g32.ptr != nullptr || g16.ptr != nullptr; }
};

template <class T>
FwdArgs<T> make_args(const Params& p, const ChunkTable& table) {
  FwdArgs<T> a;
  a.q = dev_rows<const T>(p.q);
  a.k = dev_rows<const T>(p.k);
  a.v = dev_rows<const T>(p.v);
  a.beta = dev_rows<const T>(p.beta);
  a.o = dev_rows<T>(p.o);
  a.chunks = table.chunks();
  a.seqs = table.seqs();
  a.Tlen = p.T;
  a.HV = p.HV;
  a.K = p.K;
  a.V = p.V;
  a.group = p.HV / p.H;
  a.Kp = static_cast<int>(padded_dim(p.K));
  a.Vp = static_cast<int>(padded_dim(p.V));
  a.Up = a.Vp;
  a.u_cols = a.Vp;
  a.chunk_size = p.chunk_size;
  a.scale = static_cast<float>(p.scale);
  a.has_gate = p.variant != Variant::delta;
  a.o_pairs = (reinterpret_cast<uintptr_t>(p.o.ptr) % (2 * sizeof(T)) == 0) && p.o.stride_b % 2 == 0 &&
              p.o.stride_t % 2 == 0 && p.o.stride_h % 2 == 0 && p.V % 2 == 0;
  a.unit_rows = p.qk_l2norm || p.qk_unit_rows;
  return a;
}

// ---- shared-memory layouts (host and device compute the same offsets) ------------------------
__host__ __device__ inline int carve(int& offset, int bytes) {
  const int at = offset;
  offset += (bytes + 127) / 128 * 128;
  return at;
}

// Stage 2. Phase 1 (scores, kda) and phases 2-4 (solve, products) share the `scratch` region;
// the 16-bit operands Tb1, Tb2 (built after the solve) take the place of A (dead by then). For
// bf16 and K = V = 128 that is 74 KB: three CTAs per SM on an H100/H200.
struct WyLayout {
  int ldk, ldv, ldg, lda, ldt;  // leading dims (elements): K, V tiles (T); Gk (f32); A, T (f32); Tb (T)
  int k, v, beta, g, eg, gk, a;
  int tb1, tb2;             // inside A's region
  int xr, yr;               // kda scores scratch (inside the scratch region)
  int t, scr;               // solve (inside the scratch region)
  int bytes;
};
__host__ __device__ inline WyLayout wy_layout(int Kp, int Vp, int esize, bool kda) {
  WyLayout L;
  L.ldk = Kp + 8;
  L.ldv = Vp + 8;
  L.ldg = Kp + 4;
  L.lda = kBT + 4;
  L.ldt = kBT + 8;
  int o = 0;
  L.k = carve(o, kBT * L.ldk * esize);
  L.v = carve(o, kBT * L.ldv * esize);
  L.beta = carve(o, kBT * 4);
  L.g = carve(o, kBT * 4);
  L.eg = carve(o, kBT * 4);
  L.gk = kda ? carve(o, kBT * L.ldg * 4) : 0;
  const int a_bytes = kBT * L.lda * 4, tb_bytes = kBT * L.ldt * esize;  // tb_bytes: a multiple of 128
  L.a = carve(o, a_bytes > 2 * tb_bytes ? a_bytes : 2 * tb_bytes);
  L.tb1 = L.a;
  L.tb2 = L.a + tb_bytes;
  const int scratch = o;
  int s1 = scratch;  // phase 1 (kda only)
  L.xr = kda ? carve(s1, 16 * L.ldk * esize) : 0;
  L.yr = kda ? carve(s1, kda_scores_y_rows(esize) * L.ldk * esize) : 0;
  int s2 = scratch;  // phases 2-4
  L.t = carve(s2, kBT * L.lda * 4);
  L.scr = carve(s2, 4 * 16 * 16 * 4);
  L.bytes = s1 > s2 ? s1 : s2;
  return L;
}

// Stage 3. The chunk inputs (W, K, U tiles and the gate values) are NS-deep ring buffers: with
// NS = 2 chunk c + 1 loads while chunk c computes.
struct ScanLayout {
  int ldk, ldb;  // W/K tiles (T); the BV-wide tiles U, S, Vn (T)
  int w, k, u, gbuf;  // stage 0's buffers; stage s adds s * stage
  int stage;
  int s, vn;
  int bytes;
};
__host__ __device__ inline ScanLayout scan_layout(int Kp, int BV, int esize, int NS) {
  ScanLayout L;
  L.ldk = Kp + 8;
  L.ldb = BV + 8;
  int o = 0;
  L.w = carve(o, kBT * L.ldk * esize);
  L.k = carve(o, kBT * L.ldk * esize);
  L.u = carve(o, kBT * L.ldb * esize);
  L.gbuf = carve(o, (Kp > kBT ? Kp : kBT) * 4);  // gdn: G of the chunk's rows; kda: G of its last row
  L.stage = o;
  o *= NS;
  L.s = carve(o, Kp * L.ldb * esize);
  L.vn = carve(o, kBT * L.ldb * esize);
  L.bytes = o;
  return L;
}

// Stage 4. h_c and Vn pass through in slabs of kOutSlab value columns; for kda the scores
// scratch (Xr, Yr) shares their region (the slabs are loaded after the scores are done).
constexpr int kOutSlab = 64;
struct OutLayout {
  int ldk, ldg, ldp, lds;  // Q/K tiles (T); Gk (f32); P (T); the h and Vn slabs (T)
  int q, k, p, g, eg, gk, h, vn, xr, yr;
  int bytes;
};
__host__ __device__ inline OutLayout out_layout(int Kp, int esize, bool kda) {
  OutLayout L;
  L.ldk = Kp + 8;
  L.ldg = Kp + 4;
  L.ldp = kBT + 8;
  L.lds = kOutSlab + 8;
  int o = 0;
  L.q = carve(o, kBT * L.ldk * esize);
  L.k = carve(o, kBT * L.ldk * esize);
  L.p = carve(o, kBT * L.ldp * esize);
  L.g = carve(o, kBT * 4);
  L.eg = carve(o, kBT * 4);
  L.gk = kda ? carve(o, kBT * L.ldg * 4) : 0;
  const int region = o;
  int s1 = region;
  L.h = carve(s1, Kp * L.lds * esize);
  L.vn = carve(s1, kBT * L.lds * esize);
  int s2 = region;
  L.xr = kda ? carve(s2, 16 * L.ldk * esize) : 0;
  L.yr = kda ? carve(s2, kda_scores_y_rows(esize) * L.ldk * esize) : 0;
  L.bytes = s1 > s2 ? s1 : s2;
  return L;
}

// The fused kda stage in one kernel (kda_prepare_kernel): regions reused as they die. For bf16 / fp16 and
// K = V = 128: K 17 KB + beta + A 17 KB (fp32; the solve's N in place, then Tb1) for the whole kernel, then one
// region of 75.5 KB that holds Q 17 KB, G 33 KB (fp32, ldg = 132) and the scores' scratch (Xr of K 4.25 KB, Xr
// of Q 4.25 KB, Yr 17 KB) up to phase 3, and V (over Q) and T (fp32, over the scratch) after it: 112,384 bytes,
// two CTAs per SM with their 1 KB reserves (2 x 110.75 KB of the 228 KB). P is not staged in shared memory
// (its 9 KB tile would leave one CTA per SM); its 16-bit values go to global memory as the scores produce them.
struct KdaPrepLayout {
  int ldk, ldv, ldg, lda, ldt;  // K, Q, V tiles (T); G (f32); A, T (f32); Tb1 (T)
  int k, beta, a;               // the whole kernel (Tb1 in A's place)
  int q, gk, xk, xq, yr;        // phases 0-3
  int v, t;                     // phases 4-5: V over Q, T over the scratch
  int bytes;
};
__host__ __device__ inline KdaPrepLayout kda_prep_layout(int Kp, int Vp, int esize) {
  KdaPrepLayout L;
  L.ldk = Kp + 8;
  L.ldv = Vp + 8;
  L.ldg = Kp + 4;
  L.lda = kBT + 4;
  L.ldt = kBT + 8;
  int o = 0;
  L.k = carve(o, kBT * L.ldk * esize);
  L.beta = carve(o, kBT * 4);
  const int a_bytes = kBT * L.lda * 4, tb_bytes = kBT * L.ldt * esize;
  L.a = carve(o, a_bytes > tb_bytes ? a_bytes : tb_bytes);
  const int region = o;
  L.q = carve(o, kBT * L.ldk * esize);
  L.gk = carve(o, kBT * L.ldg * 4);
  const int scratch = o;
  L.xk = carve(o, 16 * L.ldk * esize);
  L.xq = carve(o, 16 * L.ldk * esize);
  L.yr = carve(o, kda_scores_y_rows(esize) * L.ldk * esize);
  int o2 = region;  // after phase 3: V where Q was, T in the scratch (or past it, were V wider than Q and G)
  L.v = carve(o2, kBT * L.ldv * esize);
  if (o2 < scratch) o2 = scratch;
  L.t = carve(o2, kBT * L.lda * 4);
  L.bytes = o > o2 ? o : o2;
  return L;
}

// Fills the per-row gate values of a chunk tile (gdn / delta): g_s[i] = G of row min(i, len - 1)
// (rows past a short chunk repeat the last row: their relative decays are e^0 and finite),
// eg_s[i] = e^(g_s[i]). Zero gate for delta. Threads 0..63.
template <class T>
__device__ __forceinline__ void load_scalar_gate(float* g_s, float* eg_s, const float* G, int64_t row0, int64_t HV,
                                                 int64_t hv, int len, bool has_gate) {
  const int i = threadIdx.x;
  if (i < kBT) {
    const float gi = has_gate ? G[(row0 + min(i, len - 1)) * HV + hv] : 0.f;
    g_s[i] = gi;
    eg_s[i] = exp_t<T>(gi);
  }
}

// kda with the gate summed in the kernel (FwdArgs::gate_in_kernel), in two steps around the barrier after the
// chunk's loads. First the raw gate into Gk (fp32, zero past len and K): fp32 g by cp.async with the tiles (the
// caller commits and waits), 16-bit g converted through registers, eight elements per 16-byte load.
template <class T>
__device__ __forceinline__ void load_raw_gate(float* Gk, int ldg, const FwdArgs<T>& args, const ChunkEntry& ce,
                                              int64_t hv) {
  const int len = static_cast<int>(ce.len), K = static_cast<int>(args.K), Kp = args.Kp;
  if (args.g32.ptr != nullptr) {
    const float* src = args.g32.at(ce.batch, ce.t0, hv);
    load_tile(Gk, ldg, src, args.g32.st, len, kBT, K, Kp, vec_ok(src, args.g32.st));
    return;
  }
  const T* src = args.g16.at(ce.batch, ce.t0, hv);
  const bool vec = vec_ok(src, args.g16.st);
  const int pieces = Kp / 8;
  const PieceRows rows_of(pieces);
  for (int idx = threadIdx.x; idx < kBT * pieces; idx += blockDim.x) {
    const int i = rows_of.row(idx), d0 = 8 * (idx - i * pieces);
    float x[8];
    load8_upto(src + i * args.g16.st + d0, i < len ? K - d0 : 0, vec, x);
    store8(Gk + i * ldg + d0, x);
  }
}
// Then, once it landed and a barrier made it visible, G in place: Gk[i][d] = g_0d + ... + g_id, summed in the
// order chunk_cumsum_kernel sums (the same bits as stage 1's G); rows past len equal the last (their g is zero,
// as load_key_gate repeats the last row). G's last row goes to args.g_last. One thread per key column, 16 rows
// at a time. (Summing from global memory in registers cost the WY and operands kernels 0.12 ms each at
// (2,16384,16,128) on an H100: four exposed load latencies a column.)
// With the in-kernel gate (args.gate_A_log) each raw value of the chunk's rows becomes its gate here (rows past len
// stay zero), from the thread's column's e^A_log and dt_bias read once. kRange: the thread's smallest and largest raw
// value of the chunk's rows and keys also go into *lo, *hi (common/gate_range.cuh's keys; safe_gate's check).
template <class T, bool kRange = false>
__device__ __forceinline__ void chunk_sum_gate(float* Gk, int ldg, const FwdArgs<T>& args, const ChunkEntry& ce,
                                               int64_t hv, int* lo = nullptr, int* hi = nullptr) {
  const int len = static_cast<int>(ce.len);
  const bool gate = args.gate_A_log != nullptr;
  const float ga = gate ? expf(args.gate_A_log[hv]) : 0.f;
  for (int d = threadIdx.x; d < args.Kp; d += blockDim.x) {
    const float gb = gate && args.gate_dt_bias != nullptr && d < args.K ? args.gate_dt_bias[hv * args.K + d] : 0.f;
    const bool gate_col = gate && d < args.K;
    float acc = 0.f;
#pragma unroll 1
    for (int i0 = 0; i0 < kBT; i0 += 16) {
      float x[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = Gk[(i0 + i) * ldg + d];
      if constexpr (kRange) {
        if (d < args.K) {
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            if (i0 + i < len) {
              const int key = gate_order_key(x[i]);
              *lo = min(*lo, key);
              *hi = max(*hi, key);
            }
          }
        }
      }
      if (gate_col) {
#pragma unroll
        for (int i = 0; i < 16; ++i) x[i] = i0 + i < len ? kda_gate_value(x[i], ga, gb, args.gate_lower_bound) : 0.f;
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        acc += x[i];
        Gk[(i0 + i) * ldg + d] = acc;
      }
    }
    if (d < args.K && args.g_last != nullptr) args.g_last[((ce.row0 + len - 1) * args.HV + hv) * args.K + d] = acc;
  }
}

// qk_l2norm in shared memory for rows of 128 or 64 keys (the fused kda stage): each of the tile's 64 rows (ld
// apart) times 1 / sqrt(|x|^2 + eps), rounded to T, with the arithmetic of cuda/common/l2norm.cu's kernel: there
// lane l sums the squares of elements l, l + 32, l + 64, l + 96 in that order and a butterfly adds the 32 lane
// sums; here one thread forms the same 32 sums from 16-byte pieces and adds them in the butterfly's tree, so the
// rows get the bits that pass writes. Threads thread0 .. thread0 + 63 take a row each. (A warp per row, 16 rows a
// warp in turn, cost 0.28 ms of the fused kda forward at (2,16384,16,128) on an H100.)
// One row of 8 kPieces keys whose 8-key pieces lie at piece(pc), pc = 0 .. kPieces - 1 (plain or swizzled rows).
template <class T, class Piece, int kPieces = 16>
__device__ __forceinline__ void l2norm_row_pieces(Piece piece) {
  float a[32];
#pragma unroll
  for (int l = 0; l < 32; ++l) a[l] = 0.f;
#pragma unroll
  for (int pc = 0; pc < kPieces; ++pc) {
    float x[8];
    load8(piece(pc), x);
#pragma unroll
    for (int e = 0; e < 8; ++e) a[(8 * pc + e) & 31] = fmaf(x[e], x[e], a[(8 * pc + e) & 31]);
  }
#pragma unroll
  for (int step = 0; step < 5; ++step)  // o = 16, 8, 4, 2, 1 (constant trip counts: a[] stays in registers)
#pragma unroll
    for (int l = 0; l < 16; ++l)
      if (l < (16 >> step)) a[l] += a[l + (16 >> step)];
  const float rn = rsqrtf(a[0] + kQkL2normEps);
#pragma unroll
  for (int pc = 0; pc < kPieces; ++pc) {
    T* p = piece(pc);
    float x[8];
    load8(p, x);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] *= rn;
    store8(p, x);
  }
}
// Rows of Kp = 128 or 64 keys (the fused kda stage's K).
template <class T>
__device__ __forceinline__ void l2norm_rows(T* tile, int ld, int thread0, int Kp) {
  const int r = static_cast<int>(threadIdx.x) - thread0;
  if (r < 0 || r >= kBT) return;
  T* row = tile + r * ld;
  auto piece = [&](int pc) { return row + 8 * pc; };
  if (Kp == 128) {
    l2norm_row_pieces<T, decltype(piece), 16>(piece);
  } else {
    l2norm_row_pieces<T, decltype(piece), 8>(piece);
  }
}

// ============================================================================================
// Stage 1: G = within-chunk cumulative sum of g (fp32). One thread per (head, key dim) column,
// sequential over the chunk's tokens; consecutive threads read consecutive columns.
// ============================================================================================
template <class T>
__global__ void __launch_bounds__(kThreads) chunk_cumsum_kernel(DevRows<const T> g, const ChunkEntry* chunks,
                                                                int64_t HV, int64_t Dg, float* G) {
  const ChunkEntry ce = chunks[blockIdx.x];
  const int64_t col = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x;
  if (col >= HV * Dg) return;
  const int64_t h = col / Dg, d = col - h * Dg;
  float acc = 0.f;
  for (int64_t i = 0; i < ce.len; ++i) {
    acc += to_f(g.at(ce.batch, ce.t0 + i, h)[d]);
    G[(ce.row0 + i) * HV * Dg + col] = acc;
  }
}

// ============================================================================================
// The WY products of one chunk: out = Tm X (W = Tb2 K or Tb1 (K e^G), U = Tb1 V), Tm 64 x 64 and X 64 x Np
// 16-bit in shared memory; warp `warp` computes row block `warp`, whose Tm row block has nonzeros only in
// columns < 16 (warp + 1), and stores its rows < len at out_row(i) + column.
// ============================================================================================
template <class T, class OutRow>
__device__ __forceinline__ void wy_products(int warp, const T* Tm, int ldt, const T* X, int ldx, int Np, int len,
                                            OutRow out_row) {
  const int kend = 16 * (warp + 1);
  for (int n0 = 0; n0 < Np; n0 += 64) {
    float acc[1][8][4];
    zero_acc(acc);
    const int nt_active = min(8, (Np - n0) / 8);
    warp_mma<T, 1, 8, Lay::rowmajor, Lay::rowmajor>(acc, Tm, ldt, 16 * warp, X, ldx, n0, 0, kend, 1, nt_active);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt < nt_active) {
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int i = 16 * warp + acc_row(0, 2 * h2);
          if (i < len) store_pair(out_row(i) + n0 + acc_col(nt, 0), acc[0][nt][2 * h2], acc[0][nt][2 * h2 + 1]);
        }
      }
    }
  }
}

// ============================================================================================
// Stage 2: A, T = (I + A)^-1, W, U per (chunk, value head).
//   phase 0  K tile, V tile (cp.async), beta, gates
//   phase 1  A (gdn: tensor-core K K^T scaled by beta_i e^(G_i - G_j); kda: kda_scores)
//   phase 2  T by blocked forward substitution in fp32: the four 16 x 16 diagonal blocks
//            D_a = (I + A_aa)^-1 one per warp (registers), then T_ab = -D_a sum_{b<=c<a} A_ac T_cb
//            by sub-diagonal level (levels 1, 2, 3: 3, 2, 1 blocks, one warp each)
//   phase 3  Tb1 = T Beta (and gdn: Tb2 = T Beta e^G) as 16-bit operands; kda: Kd out, K <- K e^G
//   phase 4  W = Tb2 K (gdn) or Tb1 (K e^G) (kda), U = Tb1 V on tensor cores; store
// ============================================================================================
template <class T, bool kKda>
__global__ void __launch_bounds__(kThreads) chunk_wy_kernel(FwdArgs<T> args, const float* __restrict__ G,
                                                            T* __restrict__ W, T* __restrict__ U,
                                                            T* __restrict__ Kd, float* __restrict__ Tinv) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int Kp = args.Kp, Vp = args.Vp;
  const WyLayout L = wy_layout(Kp, Vp, sizeof(T), kKda);
  T* Ks = reinterpret_cast<T*>(smem + L.k);
  T* Vs = reinterpret_cast<T*>(smem + L.v);
  float* beta_s = reinterpret_cast<float*>(smem + L.beta);
  float* g_s = reinterpret_cast<float*>(smem + L.g);
  float* eg_s = reinterpret_cast<float*>(smem + L.eg);
  float* Gk = reinterpret_cast<float*>(smem + L.gk);
  float* As = reinterpret_cast<float*>(smem + L.a);
  T* Xr = reinterpret_cast<T*>(smem + L.xr);
  T* Yr = reinterpret_cast<T*>(smem + L.yr);
  float* Ts = reinterpret_cast<float*>(smem + L.t);
  T* Tb1 = reinterpret_cast<T*>(smem + L.tb1);
  T* Tb2 = reinterpret_cast<T*>(smem + L.tb2);
  float* scr = reinterpret_cast<float*>(smem + L.scr);
  const int lda = L.lda, ldt = L.ldt, ldk = L.ldk, ldv = L.ldv;

  const int tid = threadIdx.x, warp = tid >> 5;
  const ChunkEntry ce = args.chunks[blockIdx.x];
  const int64_t hv = blockIdx.y, hk = hv / args.group, HV = args.HV;
  const int len = static_cast<int>(ce.len);

  // ---- phase 0: loads ----
  {
    const T* ksrc = args.k.at(ce.batch, ce.t0, hk);
    load_tile(Ks, ldk, ksrc, args.k.st, len, kBT, static_cast<int>(args.K), Kp, vec_ok(ksrc, args.k.st));
    if constexpr (kKda) {  // with K
      if (args.gate_in_kernel()) {
        load_raw_gate(Gk, L.ldg, args, ce, hv);
      } else {
        load_key_gate(Gk, L.ldg, G, ce.row0, HV, hv, args.K, Kp, len);
      }
    }
    cp_async_commit();
    const T* vsrc = args.v.at(ce.batch, ce.t0, hv);
    load_tile(Vs, ldv, vsrc, args.v.st, len, kBT, static_cast<int>(args.V), Vp, vec_ok(vsrc, args.v.st));
    cp_async_commit();
  }
  if (tid < kBT) beta_s[tid] = tid < len ? to_f(*args.beta.at(ce.batch, ce.t0 + tid, hv)) : 0.f;
  if constexpr (!kKda) load_scalar_gate<T>(g_s, eg_s, G, ce.row0, HV, hv, len, args.has_gate);
  cp_async_wait<1>();  // the K tile and kda's gates (V may still be in flight)
  __syncthreads();
  if constexpr (kKda) {  // the fused forward's kda stage (launch_kda_fused_prepare)
    const bool sum_gate = args.gate_in_kernel();
    if (sum_gate) chunk_sum_gate(Gk, L.ldg, args, ce, hv);
    if (args.qk_l2norm) l2norm_rows(Ks, ldk, 0, Kp);  // Kp = 128 or 64 (launch_kda_fused_prepare)
    if (sum_gate || args.qk_l2norm) __syncthreads();
  }

  // ---- phase 1: A (strictly lower; row block a is written in columns < 16 (a + 1)) ----
  if constexpr (kKda) {
    kda_scores<T, kThreads>(Ks, Ks, ldk, Gk, L.ldg, Xr, Yr, Kp, len, /*inclusive=*/false,
                  [&](int i, int j, float x) { As[i * lda + j] = beta_s[i] * x; }, args.unit_rows);
  } else {
    float acc[1][8][4];
    zero_acc(acc);
    const int nt_active = 2 * (warp + 1);
    warp_mma<T, 1, 8, Lay::rowmajor, Lay::colmajor>(acc, Ks, ldk, 16 * warp, Ks, ldk, 0, 0, Kp, 1, nt_active);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt < nt_active) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 16 * warp + acc_row(0, e), j = acc_col(nt, e);
          // mask before the exponential: for j >= i the exponent may be positive
          As[i * lda + j] = (j < i) ? beta_s[i] * exp_t<T>(g_s[i] - g_s[j]) * acc[0][nt][e] : 0.f;
        }
      }
    }
  }
  __syncthreads();

  // ---- phase 2: T = (I + A)^-1 (wy_solve.cuh; A is dead after it, its region becomes Tb1 and Tb2) ----
  if constexpr (kIs16Bit<T>) {
    unit_lower_inverse_64_tf32(As, Ts, lda);
  } else {
    unit_lower_inverse_64(As, Ts, lda, scr);
  }
  if (Tinv) {
    for (int idx = tid; idx < len * kBT; idx += kThreads) {
      const int i = idx / kBT, j = idx - i * kBT;
      Tinv[((ce.row0 + i) * HV + hv) * kBT + j] = j < len ? Ts[i * lda + j] : 0.f;
    }
  }

  // ---- phase 3: 16-bit operands ----
  for (int idx = tid; idx < kBT * kBT; idx += kThreads) {
    const int i = idx / kBT, j = idx - i * kBT;
    const float t = Ts[i * lda + j] * beta_s[j];
    Tb1[i * ldt + j] = from_f<T>(t);
    if constexpr (!kKda) Tb2[i * ldt + j] = from_f<T>(t * eg_s[j]);
  }
  if constexpr (kKda) {
    // Kd = K e^(G_last - G) for stage 3 (exponent <= 0), then K <- K e^G in place for W; eight keys per
    // thread (16-byte rows and stores).
    const float* Glast = Gk + (len - 1) * L.ldg;
    const int pieces = Kp / 8;
    const PieceRows rows_of(pieces);
    for (int idx = tid; idx < kBT * pieces; idx += kThreads) {
      const int i = rows_of.row(idx), d0 = 8 * (idx - i * pieces);
      float kv[8], g[8], gl[8], kd[8];
      load8(Ks + i * ldk + d0, kv);
      load8f(Gk + i * L.ldg + d0, g);
      load8f(Glast + d0, gl);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        kd[e] = kv[e] * exp_t<T>(gl[e] - g[e]);
        kv[e] *= exp_t<T>(g[e]);
      }
      if (i < len) store8(Kd + ((ce.row0 + i) * HV + hv) * Kp + d0, kd);
      store8(Ks + i * ldk + d0, kv);
    }
  }
  cp_async_wait<0>();  // the V tile
  __syncthreads();

  // ---- phase 4: W, U ----
  const T* TW = kKda ? Tb1 : Tb2;
  wy_products(warp, TW, ldt, Ks, ldk, Kp, len, [&](int i) { return W + ((ce.row0 + i) * HV + hv) * Kp; });
  wy_products(warp, Tb1, ldt, Vs, ldv, Vp, len, [&](int i) { return U + ((ce.row0 + i) * HV + hv) * Vp; });
}

// ============================================================================================
// Stage 3: the state scan. One CTA of NW warps per (sequence, value head, BV-wide column tile of
// the state), sequential over the sequence's chunks. The state tile S (Kp x BV) lives in fp32
// registers as mma accumulators: warp w owns rows [16 KMT w, 16 KMT (w + 1)). Per chunk:
//   (a) S -> Sb (16-bit operand) ; h_c = Sb to global (skipped when h is null: final state only)
//   (b) Vn = U - W Sb (tensor cores, k = Kp) ; Vn to global (unless null) ; Vns = Vn e^(G_n - G) (gdn) or Vn (kda)
//   (c) S = D_n S + Kd^T Vns   (Kd = K for gdn/delta, K e^(G_n - G) from stage 2 for kda; k = 64)
// Every CTA of a head reads the head's whole W and K tiles, so the scan moves (Vp / BV) x their
// bytes through L2: with BV = 16 at (2,16384,16,128) that is ~2.1 GB, and the scan ran at the
// ~2.5 TB/s that L2 delivered (4 us per chunk step) whatever the load latency hiding. Hence wide
// tiles (BV = 64: 4x less traffic) on 8 warps for K <= 128: warp w computes rows 16 (w % 4) of Vn
// for half of the columns in (b) and owns 16 state rows in (c). With NS = 2 stages chunk c + 1's
// W, K, U and gates are issued (cp.async) before chunk c starts computing.
// ============================================================================================
template <class T, bool kKda, int BV, int KMT, int NS, int NW>
__global__ void __launch_bounds__(32 * NW, NW == 4 ? 4 : 2)
    chunk_state_scan_kernel(FwdArgs<T> args, const float* __restrict__ G, const T* __restrict__ W,
                            const T* __restrict__ U, const T* __restrict__ Kd, T* __restrict__ h,
                            T* __restrict__ vnew, const float* __restrict__ h0, float* __restrict__ ht) {
  static_assert(NS == 1 || NS == 2, "one or two stages");
  static_assert(NW == 4 || NW == 8, "4 or 8 warps");
  constexpr int NT = BV / 8;                  // n-tiles of the state slice (step (c))
  constexpr int NTB = NT / (NW / 4);          // n-tiles of a warp's share of Vn (step (b))
  constexpr int kScanThreads = 32 * NW;
  // The warps' rows cover KPT >= Kp state rows; tiles are KPT wide (a compile-time width: the
  // step is issue-bound, and constant tile loops cost a fraction of the instructions). Rows and
  // columns in [Kp, KPT) are zero in every tile and stay zero in S.
  constexpr int KPT = 16 * KMT * NW;
  static_assert(!kIs16Bit<T> || NTB % 2 == 0, "16-bit products take n-tiles in pairs");
  extern __shared__ __align__(128) unsigned char smem[];
  const int Kp = args.Kp, Vp = args.Vp;
  const ScanLayout L = scan_layout(KPT, BV, sizeof(T), NS);
  T* Sb = reinterpret_cast<T*>(smem + L.s);
  T* Vns = reinterpret_cast<T*>(smem + L.vn);
  const int ldk = L.ldk, ldb = L.ldb;

  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t n = blockIdx.x, hv = blockIdx.y, HV = args.HV, K = args.K, V = args.V;
  const int v0 = blockIdx.z * BV;
  const int64_t hk = hv / args.group;
  const SeqEntry se = args.seqs[n];
  const int cs = args.chunk_size;
  const int m0 = 16 * KMT * warp;                                   // first state row of this warp
  const int bv_valid = min(BV, Vp - v0);                            // columns of this tile inside Vp

  // S from h0 (fp32 [N, HV, K, V]) or zero.
  const int64_t state0 = (n * HV + hv) * K * V + v0;  // (n, hv, 0, v0) of h0 / ht
  float S[KMT][NT][4];
  load_acc(S, h0 != nullptr ? h0 + state0 : nullptr, V, m0, static_cast<int>(K), static_cast<int>(V - v0));

  auto chunk_row0 = [&](int64_t c) { return args.ws_row0 + se.batch * args.Tlen + se.bos + c * cs; };
  const int u_valid = max(0, min(BV, args.u_cols - v0));  // columns of this tile that read U
  auto chunk_len = [&](int64_t c) { return static_cast<int>(min(static_cast<int64_t>(cs), se.len - c * cs)); };
  auto stage_ptr = [&](int base, int64_t c) { return smem + base + static_cast<int>(c % NS) * L.stage; };
  // Chunk c's W, K (Kd for kda), U and gate values into stage c % NS; one cp.async group.
  auto issue = [&](int64_t c) {
    const int64_t row0 = chunk_row0(c);
    const int len = chunk_len(c);
    T* Ws = reinterpret_cast<T*>(stage_ptr(L.w, c));
    T* Ks = reinterpret_cast<T*>(stage_ptr(L.k, c));
    T* Us = reinterpret_cast<T*>(stage_ptr(L.u, c));
    float* gbuf = reinterpret_cast<float*>(stage_ptr(L.gbuf, c));
    load_tile<T, kScanThreads>(Ws, ldk, W + (row0 * HV + hv) * Kp, HV * Kp, len, kBT, Kp, KPT, true);
    // A tile past u_cols is all zero values: zeroed once per stage buffer, then left alone.
    if (u_valid > 0 || c < NS)
      load_tile<T, kScanThreads>(Us, ldb, U + (row0 * HV + hv) * args.Up + v0, HV * args.Up, len, kBT, u_valid, BV,
                                 true);
    if constexpr (kKda) {
      load_tile<T, kScanThreads>(Ks, ldk, Kd + (row0 * HV + hv) * Kp, HV * Kp, len, kBT, Kp, KPT, true);
      // G of the chunk's last row, per key dimension (zero past K)
      for (int d = tid; d < KPT; d += kScanThreads) {
        if (d < K) {
          cp_async_4(gbuf + d, G + ((row0 + len - 1) * HV + hv) * K + d);
        } else {
          gbuf[d] = 0.f;
        }
      }
    } else {
      const T* src = args.k.at(se.batch, se.bos + c * cs, hk);
      load_tile<T, kScanThreads>(Ks, ldk, src, args.k.st, len, kBT, static_cast<int>(K), KPT, vec_ok(src, args.k.st));
      if (tid < kBT) {
        if (args.has_gate) {
          cp_async_4(gbuf + tid, G + (row0 + min(tid, len - 1)) * HV + hv);
        } else {
          gbuf[tid] = 0.f;
        }
      }
    }
    cp_async_commit();
  };

  const int64_t nchunks = se.num_chunks;
  if (nchunks > 0) issue(0);
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t row0 = chunk_row0(c);
    const int len = chunk_len(c);
    const int64_t fc = se.first_chunk + c;
    const T* Ws = reinterpret_cast<const T*>(stage_ptr(L.w, c));
    const T* Ks = reinterpret_cast<const T*>(stage_ptr(L.k, c));
    const T* Us = reinterpret_cast<const T*>(stage_ptr(L.u, c));
    const float* gbuf = reinterpret_cast<const float*>(stage_ptr(L.gbuf, c));
    // Stage (c + 1) % 2 was last read by chunk c - 1, which the barrier ending its step released.
    if constexpr (NS == 2) {
      if (c + 1 < nchunks) issue(c + 1);
      else cp_async_commit();  // an empty group keeps the count below uniform
    }

    // (a) S -> Sb
#pragma unroll
    for (int mt = 0; mt < KMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2)
          store_pair(Sb + (m0 + acc_row(mt, 2 * h2)) * ldb + acc_col(nt, 0), S[mt][nt][2 * h2],
                     S[mt][nt][2 * h2 + 1]);
    cp_async_wait<NS - 1>();  // chunk c's group (chunk c + 1's may still be in flight)
    __syncthreads();
    if (h != nullptr) {
      // h_c = S (columns v0 .. v0 + bv_valid of rows < Kp), 16-byte pieces
      constexpr int kPiece = 16 / sizeof(T), kPieces = BV / kPiece;
      T* hdst = h + (fc * HV + hv) * Kp * Vp + v0;
      constexpr int kIters = (KPT * kPieces + kScanThreads - 1) / kScanThreads;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int idx = tid + it * kScanThreads;
        const int d = idx / kPieces, pc = (idx % kPieces) * kPiece;
        if (idx < KPT * kPieces && d < Kp && pc < bv_valid)
          *reinterpret_cast<uint4*>(hdst + static_cast<int64_t>(d) * Vp + pc) =
              *reinterpret_cast<const uint4*>(Sb + d * ldb + pc);
      }
    }
    // (b) Vn = U - W Sb
    float glast = 0.f;
    float dec[KMT][2];  // kda: e^(G_last, d) for this lane's state rows
    if constexpr (kKda) {
#pragma unroll
      for (int mt = 0; mt < KMT; ++mt)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) dec[mt][h2] = exp_t<T>(gbuf[m0 + acc_row(mt, 2 * h2)]);
    } else {
      glast = gbuf[len - 1];
    }
    {
      // warp w: rows 16 (w % 4) .. + 15 of Vn, columns nb .. nb + 8 NTB (all BV of them with 4 warps)
      const int rb = 16 * (warp & 3), nb = 8 * NTB * (warp >> 2);
      float acc[1][NTB][4];
      zero_acc(acc);
      warp_mma<T, 1, NTB, Lay::rowmajor, Lay::rowmajor>(acc, Ws, ldk, rb, Sb, ldb, nb, 0, KPT);
#pragma unroll
      for (int nt = 0; nt < NTB; ++nt)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int i = rb + acc_row(0, 2 * h2), col = nb + acc_col(nt, 0);
          const float vn0 = to_f(Us[i * ldb + col]) - acc[0][nt][2 * h2];
          const float vn1 = to_f(Us[i * ldb + col + 1]) - acc[0][nt][2 * h2 + 1];
          if (vnew != nullptr && i < len && col < bv_valid)
            store_pair(vnew + ((row0 + i) * HV + hv) * Vp + v0 + col, vn0, vn1);
          float f = 1.f;
          if constexpr (!kKda) f = exp_t<T>(glast - gbuf[i]);  // rows past len: e^0, and Vn = 0 there
          store_pair(Vns + i * ldb + col, vn0 * f, vn1 * f);
        }
    }
    __syncthreads();  // Vns is complete; Sb is free
    // (c) S = D_n S + Kd^T Vns
    {
      const float eg = exp_t<T>(glast);
#pragma unroll
      for (int mt = 0; mt < KMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) S[mt][nt][e] *= kKda ? dec[mt][e >> 1] : eg;
      warp_mma<T, KMT, NT, Lay::colmajor, Lay::rowmajor>(S, Ks, ldk, m0, Vns, ldb, 0, 0, kBT);
    }
    __syncthreads();  // stage c % NS and Vns are free
    if constexpr (NS == 1) {
      if (c + 1 < nchunks) issue(c + 1);
    }
  }

  if (ht != nullptr) store_acc(S, ht + state0, V, m0, static_cast<int>(K), static_cast<int>(V - v0));
}

// Stage 3 on Hopper tensor cores (wgmma, sm_90a): launched instead of the kernel above where it applies.
// (The header opens its own namespace and reads FwdArgs / SeqEntry from this file's.)
}  // namespace
}  // namespace deltacp::cuda::tiled
#include "scan_wgmma.cuh"
namespace deltacp::cuda::tiled {
namespace {

// kda's output operands of one chunk in shared memory, from its Q, K tiles and gates Gk (landed and visible):
// Pb = P = tril((Q e^G)(K e^-G)^T) (diagonal included; kda_scores) in 16 bits, then Q <- Q e^G in place (e^G
// alone is at most 1 for g <= 0). after_scores() runs once the scores' scratch (Xr, Yr) is free. Called by
// all kThreads threads; contains __syncthreads. The output stage and the fused forward's kda operands
// (kda_chain_operands_kernel) share it, so the fused chain multiplies the same bits.
template <class T, class AfterScores>
__device__ void kda_output_operands(T* Qs, const T* Ks, const float* Gk, T* Pb, T* Xr, T* Yr, const OutLayout& L,
                                    int Kp, int len, AfterScores after_scores, bool unit_rows = false) {
  kda_scores<T, kThreads>(Qs, Ks, L.ldk, Gk, L.ldg, Xr, Yr, Kp, len, /*inclusive=*/true,
                          [&](int i, int j, float x) { Pb[i * L.ldp + j] = from_f<T>(x); }, unit_rows);
  after_scores();
  __syncthreads();  // the scores' diagonal blocks read Q until here
  const int pieces = Kp / 8;  // eight keys per thread (16-byte rows)
  const PieceRows rows_of(pieces);
  for (int idx = threadIdx.x; idx < kBT * pieces; idx += kThreads) {
    const int i = rows_of.row(idx), d0 = 8 * (idx - i * pieces);
    float x[8], g[8];
    load8(Qs + i * L.ldk + d0, x);
    load8f(Gk + i * L.ldg + d0, g);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] *= exp_t<T>(g[e]);
    store8(Qs + i * L.ldk + d0, x);
  }
}

// ============================================================================================
// Stage 4: O = scale ((Q e^G) h_c + P Vn),  P = tril((Q e^G)(K e^-G)^T) (diagonal included).
// One CTA per (chunk, value head); warp w owns output rows 16 w .. 16 w + 15. The value columns go
// by slabs of kOutSlab: h_c[:, slab] and Vn[:, slab] are loaded into one shared buffer pair (gdn:
// slab 0 is prefetched with Q and K; kda: after the scores, whose scratch shares the buffers).
// ============================================================================================
template <class T, bool kKda>
__global__ void __launch_bounds__(kThreads) chunk_output_kernel(FwdArgs<T> args, const float* __restrict__ G,
                                                                const T* __restrict__ h,
                                                                const T* __restrict__ vnew) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int Kp = args.Kp, Vp = args.Vp;
  const OutLayout L = out_layout(Kp, sizeof(T), kKda);
  T* Qs = reinterpret_cast<T*>(smem + L.q);
  T* Ks = reinterpret_cast<T*>(smem + L.k);
  T* Pb = reinterpret_cast<T*>(smem + L.p);
  float* g_s = reinterpret_cast<float*>(smem + L.g);
  float* eg_s = reinterpret_cast<float*>(smem + L.eg);
  float* Gk = reinterpret_cast<float*>(smem + L.gk);
  T* Hs = reinterpret_cast<T*>(smem + L.h);
  T* Vns = reinterpret_cast<T*>(smem + L.vn);
  T* Xr = reinterpret_cast<T*>(smem + L.xr);
  T* Yr = reinterpret_cast<T*>(smem + L.yr);
  const int ldk = L.ldk, ldp = L.ldp, lds = L.lds;

  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t c = blockIdx.x;
  const ChunkEntry ce = args.chunks[c];
  const int64_t hv = blockIdx.y, hk = hv / args.group, HV = args.HV;
  const int len = static_cast<int>(ce.len);
  const T* hsrc = h + (c * HV + hv) * Kp * Vp;      // h_c: Kp x Vp, row-major
  const T* vsrc = vnew + (ce.row0 * HV + hv) * Vp;  // Vn rows of the chunk, HV * Vp apart
  // Issues the cp.async copies of slab [n0, n0 + width) of h_c and Vn (width a multiple of 16).
  auto issue_slab = [&](int n0) {
    const int width = min(kOutSlab, Vp - n0);
    load_tile(Hs, lds, hsrc + n0, Vp, Kp, Kp, width, width, true);
    load_tile(Vns, lds, vsrc + n0, HV * Vp, len, kBT, width, width, true);
  };

  {
    const T* qsrc = args.q.at(ce.batch, ce.t0, hk);
    const T* ksrc = args.k.at(ce.batch, ce.t0, hk);
    load_tile(Qs, ldk, qsrc, args.q.st, len, kBT, static_cast<int>(args.K), Kp, vec_ok(qsrc, args.q.st));
    load_tile(Ks, ldk, ksrc, args.k.st, len, kBT, static_cast<int>(args.K), Kp, vec_ok(ksrc, args.k.st));
    if constexpr (kKda) load_key_gate(Gk, L.ldg, G, ce.row0, HV, hv, args.K, Kp, len);  // with Q, K
    cp_async_commit();
    if constexpr (!kKda) issue_slab(0);
    cp_async_commit();
  }
  if constexpr (!kKda) load_scalar_gate<T>(g_s, eg_s, G, ce.row0, HV, hv, len, args.has_gate);
  cp_async_wait<1>();  // Q, K (and kda's gates)
  __syncthreads();

  // P (16-bit operand); row block w is written in columns < 16 (w + 1)
  if constexpr (kKda) {
    // The scratch (Xr, Yr) is free after the scores: slab 0 may land there.
    kda_output_operands<T>(Qs, Ks, Gk, Pb, Xr, Yr, L, Kp, len, [&] {
      issue_slab(0);
      cp_async_commit();
    }, args.unit_rows);
  } else {
    float acc[1][8][4];
    zero_acc(acc);
    const int nt_active = 2 * (warp + 1);
    warp_mma<T, 1, 8, Lay::rowmajor, Lay::colmajor>(acc, Qs, ldk, 16 * warp, Ks, ldk, 0, 0, Kp, 1, nt_active);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt < nt_active) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 16 * warp + acc_row(0, e), j = acc_col(nt, e);
          // mask before the exponential: for j > i the exponent may be positive
          Pb[i * ldp + j] = from_f<T>((j <= i) ? exp_t<T>(g_s[i] - g_s[j]) * acc[0][nt][e] : 0.f);
        }
      }
    }
  }

  const int kend = 16 * (warp + 1);
  for (int n0 = 0; n0 < Vp; n0 += kOutSlab) {
    if (n0 > 0) {
      __syncthreads();  // every warp is done with the previous slab
      issue_slab(n0);
      cp_async_commit();
    }
    cp_async_wait<0>();  // this slab
    __syncthreads();     // (and, the first time, P and the scaled Q of every warp)
    float acc[1][8][4];
    zero_acc(acc);
    const int nt_active = min(kOutSlab, Vp - n0) / 8;
    warp_mma<T, 1, 8, Lay::rowmajor, Lay::rowmajor>(acc, Qs, ldk, 16 * warp, Hs, lds, 0, 0, Kp, 1, nt_active);
    if constexpr (!kKda) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][nt][e] *= eg_s[16 * warp + acc_row(0, e)];
    }
    warp_mma<T, 1, 8, Lay::rowmajor, Lay::rowmajor>(acc, Pb, ldp, 16 * warp, Vns, lds, 0, 0, kend, 1, nt_active);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt < nt_active) {
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int i = 16 * warp + acc_row(0, 2 * h2);
          const int col = n0 + acc_col(nt, 0);
          if (i < len) {
            T* dst = args.o.at(ce.batch, ce.t0 + i, hv) + col;
            const float x0 = args.scale * acc[0][nt][2 * h2], x1 = args.scale * acc[0][nt][2 * h2 + 1];
            if (args.o_pairs && col + 1 < args.V) {
              store_pair(dst, x0, x1);
            } else {
              if (col < args.V) store_f(dst, x0);
              if (col + 1 < args.V) store_f(dst + 1, x1);
            }
          }
        }
      }
    }
  }
}

// ============================================================================================
// The fused forward's kda operands (cuda/fused/fused_chain.cuh reads them by TMA): per (chunk, value head)
// the output stage's P ([R, HV, 64] rows, 16-bit, zero above the diagonal) and Q e^G ([R, HV, Kp] rows,
// 16-bit), the bits the output stage multiplies (kda_output_operands). 16-bit inputs, Kp = 128 or 64. The gate is
// summed here from g (args.gate_in_kernel()), and q, k l2-normalised here with args.qk_l2norm.
// ============================================================================================
template <class T>
__global__ void __launch_bounds__(kThreads) kda_chain_operands_kernel(FwdArgs<T> args, T* __restrict__ P,
                                                                      T* __restrict__ Qg) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int Kp = args.Kp;
  const OutLayout L = out_layout(Kp, sizeof(T), /*kda=*/true);
  T* Qs = reinterpret_cast<T*>(smem + L.q);
  T* Ks = reinterpret_cast<T*>(smem + L.k);
  T* Pb = reinterpret_cast<T*>(smem + L.p);
  float* Gk = reinterpret_cast<float*>(smem + L.gk);
  T* Xr = reinterpret_cast<T*>(smem + L.xr);
  T* Yr = reinterpret_cast<T*>(smem + L.yr);
  const int tid = threadIdx.x;
  const ChunkEntry ce = args.chunks[blockIdx.x];
  const int64_t hv = blockIdx.y, hk = hv / args.group, HV = args.HV;
  const int len = static_cast<int>(ce.len);
  {
    const T* qsrc = args.q.at(ce.batch, ce.t0, hk);
    const T* ksrc = args.k.at(ce.batch, ce.t0, hk);
    load_tile(Qs, L.ldk, qsrc, args.q.st, len, kBT, static_cast<int>(args.K), Kp, vec_ok(qsrc, args.q.st));
    load_tile(Ks, L.ldk, ksrc, args.k.st, len, kBT, static_cast<int>(args.K), Kp, vec_ok(ksrc, args.k.st));
    load_raw_gate(Gk, L.ldg, args, ce, hv);
    cp_async_commit();
  }
  cp_async_wait<0>();
  __syncthreads();
  chunk_sum_gate(Gk, L.ldg, args, ce, hv);
  if (args.qk_l2norm) {  // q's rows by threads 0..63, k's by 64..127
    l2norm_rows(Qs, L.ldk, 0, Kp);
    l2norm_rows(Ks, L.ldk, 64, Kp);
  }
  __syncthreads();
  kda_output_operands<T>(Qs, Ks, Gk, Pb, Xr, Yr, L, Kp, len, [] {}, args.unit_rows);
  __syncthreads();
  // The chunk's rows out as 16-byte pieces (8 elements): P's 8 per row, then Q e^G's Kp / 8. Row block a of P
  // holds the scores in columns < 16 (a + 1), zeros past them.
  for (int idx = tid; idx < len * 8; idx += kThreads) {
    const int i = idx >> 3, j0 = 8 * (idx & 7);
    const uint4 x = j0 < 16 * (i / 16 + 1) ? *reinterpret_cast<const uint4*>(Pb + i * L.ldp + j0)
                                           : make_uint4(0u, 0u, 0u, 0u);
    *reinterpret_cast<uint4*>(P + ((ce.row0 + i) * HV + hv) * kBT + j0) = x;
  }
  const int qp = Kp / 8;
  const PieceRows rows_of(qp);
  for (int idx = tid; idx < len * qp; idx += kThreads) {
    const int i = rows_of.row(idx), d0 = 8 * (idx - i * qp);
    *reinterpret_cast<uint4*>(Qg + ((ce.row0 + i) * HV + hv) * Kp + d0) =
        *reinterpret_cast<const uint4*>(Qs + i * L.ldk + d0);
  }
}

// ============================================================================================
// The fused forward's kda stage in one kernel: chunk_wy_kernel<T, true>'s outputs (W, U, Kd, G's last row) and
// kda_chain_operands_kernel's (P, Q e^G) from one CTA per (chunk, value head). The two kernels load the same k
// and g, sum the same gate, normalise the same k, and both score matrices (A from (K, K), P from (Q, K)) rescale
// the same Y rows K e^(G_r - G) around the same reference rows: the decay scalings were most of their issued
// instructions (Nsight Compute: issue-bound, HMMA about 1%). Here q, k, v, beta and g are read once, the gate is
// summed and k normalised once, and kda_scores_pair scales the Y rows once for both matrices.
//   phase 0  Q, K tiles and the raw gate (cp.async), beta
//   phase 1  G in place (chunk_sum_gate; G's last row out), q and k l2-normalised (threads 0..63 and 64..127)
//   phase 2  A = beta_i (strict scores of (K, K)) in fp32, P = (inclusive scores of (Q, K)) in 16 bits straight
//            to global (kda_scores_pair: shared Yr, Xr for K and for Q)
//   phase 3  Q e^G out, Kd = K e^(G_n - G) out, K <- K e^G in place (one e^G per element for Q and K); P's
//            zeros above the block diagonal. The gates, Q and the scores' scratch die here
//   phase 4  V by cp.async into Q's dead tile; T = (I + A)^-1 into the dead scratch (wy_solve.cuh); Tb1 = T Beta
//            in A's place
//   phase 5  W = Tb1 (K e^G), U = Tb1 V on the tensor cores (chunk_wy_kernel's loops)
// Every stored value takes the operations of the kernel it replaces, in the same order (the same helpers:
// chunk_sum_gate, l2norm_rows, decayed_scores_impl, unit_lower_inverse_64_tf32, the same warp_mma calls
// and the same element expressions), so the outputs are bit-identical to the pair's; only where and when they
// are stored changed. 128 threads, 109.75 KB of shared memory for K = 128 with V = 128 or 256 (KdaPrepLayout; less
// at K = V = 64): two CTAs per SM, as each of the pair ran, so one CTA's barriers overlap the other's work.
// ============================================================================================
template <class T>
__global__ void __launch_bounds__(kThreads, 2) kda_prepare_kernel(FwdArgs<T> args, T* __restrict__ W,
                                                                  T* __restrict__ U, T* __restrict__ Kd,
                                                                  T* __restrict__ P, T* __restrict__ Qg) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int Kp = args.Kp, Vp = args.Vp;
  const KdaPrepLayout L = kda_prep_layout(Kp, Vp, sizeof(T));
  T* Ks = reinterpret_cast<T*>(smem + L.k);
  float* beta_s = reinterpret_cast<float*>(smem + L.beta);
  float* As = reinterpret_cast<float*>(smem + L.a);
  T* Tb1 = reinterpret_cast<T*>(smem + L.a);
  T* Qs = reinterpret_cast<T*>(smem + L.q);
  float* Gk = reinterpret_cast<float*>(smem + L.gk);
  T* Xk = reinterpret_cast<T*>(smem + L.xk);
  T* Xq = reinterpret_cast<T*>(smem + L.xq);
  T* Yr = reinterpret_cast<T*>(smem + L.yr);
  T* Vs = reinterpret_cast<T*>(smem + L.v);
  float* Ts = reinterpret_cast<float*>(smem + L.t);
  const int lda = L.lda, ldt = L.ldt, ldk = L.ldk, ldv = L.ldv, ldg = L.ldg;

  const int tid = threadIdx.x, warp = tid >> 5;
  const ChunkEntry ce = args.chunks[blockIdx.x];
  const int64_t hv = blockIdx.y, hk = hv / args.group, HV = args.HV;
  const int len = static_cast<int>(ce.len);

  // ---- phase 0: loads (V waits for phase 4: its tile takes Q's place) ----
  {
    const T* qsrc = args.q.at(ce.batch, ce.t0, hk);
    const T* ksrc = args.k.at(ce.batch, ce.t0, hk);
    load_tile(Qs, ldk, qsrc, args.q.st, len, kBT, static_cast<int>(args.K), Kp, vec_ok(qsrc, args.q.st));
    load_tile(Ks, ldk, ksrc, args.k.st, len, kBT, static_cast<int>(args.K), Kp, vec_ok(ksrc, args.k.st));
    load_raw_gate(Gk, ldg, args, ce, hv);
    cp_async_commit();
  }
  if (tid < kBT) beta_s[tid] = tid < len ? to_f(*args.beta.at(ce.batch, ce.t0 + tid, hv)) : 0.f;
  cp_async_wait<0>();
  __syncthreads();

  // ---- phase 1: G in place (G's last row to args.g_last), q and k normalised ----
  chunk_sum_gate(Gk, ldg, args, ce, hv);
  if (args.qk_l2norm) {  // Kp = 128 or 64 (launch_kda_fused_prepare)
    l2norm_rows(Qs, ldk, 0, Kp);
    l2norm_rows(Ks, ldk, 64, Kp);
  }
  __syncthreads();

  // ---- phase 2: A (chunk_wy_kernel's write) and P (16-bit, rows < len, straight to global: no P tile) ----
  T* Pc = P + (ce.row0 * HV + hv) * kBT;  // row i of the chunk at Pc + i * p_ld
  const int p_ld = static_cast<int>(HV * kBT);  // HV <= 65535: 64 rows of it stay below 2^31
  kda_scores_pair<T, kThreads>(Ks, Qs, Ks, ldk, Gk, ldg, Xk, Xq, Yr, Kp, len, /*inclusive=*/false,
                               /*inclusive2=*/true, [&](int i, int j, float x) { As[i * lda + j] = beta_s[i] * x; },
                               [&](int i, int j, float x) {
                                 if (i < len) Pc[i * p_ld + j] = from_f<T>(x);
                               }, args.unit_rows);

  // ---- phase 3: Q e^G and Kd out, K <- K e^G; P's zeros right of the block diagonal ----
  {
    const float* Glast = Gk + (len - 1) * ldg;
    const int pieces = Kp / 8;  // eight keys per thread (16-byte rows)
    const PieceRows rows_of(pieces);
    for (int idx = tid; idx < kBT * pieces; idx += kThreads) {
      const int i = rows_of.row(idx), d0 = 8 * (idx - i * pieces);
      float qv[8], kv[8], g[8], gl[8], kd[8];
      load8(Qs + i * ldk + d0, qv);
      load8(Ks + i * ldk + d0, kv);
      load8f(Gk + i * ldg + d0, g);
      load8f(Glast + d0, gl);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float eg = exp_t<T>(g[e]);  // kda_output_operands' and chunk_wy_kernel's e^G: the same value
        qv[e] *= eg;
        kd[e] = kv[e] * exp_t<T>(gl[e] - g[e]);
        kv[e] *= eg;
      }
      if (i < len) {
        const int64_t row = (ce.row0 + i) * HV + hv;
        store8(Qg + row * Kp + d0, qv);
        store8(Kd + row * Kp + d0, kd);
      }
      store8(Ks + i * ldk + d0, kv);
    }
    // Row block a of P holds the scores in columns < 16 (a + 1) (written above), zeros past them.
    for (int idx = tid; idx < len * 8; idx += kThreads) {
      const int i = idx >> 3, j0 = 8 * (idx & 7);
      if (j0 >= 16 * (i / 16 + 1)) *reinterpret_cast<uint4*>(Pc + i * p_ld + j0) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  __syncthreads();  // Q, the gates and the scores' scratch are dead; K e^G is in place

  // ---- phase 4: V in flight over Q's tile while T = (I + A)^-1 goes to the scratch; Tb1 = T Beta ----
  {
    const T* vsrc = args.v.at(ce.batch, ce.t0, hv);
    load_tile(Vs, ldv, vsrc, args.v.st, len, kBT, static_cast<int>(args.V), Vp, vec_ok(vsrc, args.v.st));
    cp_async_commit();
  }
  unit_lower_inverse_64_tf32(As, Ts, lda);  // ends with a barrier: A (now N) is dead, its region becomes Tb1
  for (int idx = tid; idx < kBT * kBT; idx += kThreads) {
    const int i = idx / kBT, j = idx - i * kBT;
    const float t = Ts[i * lda + j] * beta_s[j];
    Tb1[i * ldt + j] = from_f<T>(t);
  }
  cp_async_wait<0>();  // the V tile
  __syncthreads();

  // ---- phase 5: W, U ----
  wy_products(warp, Tb1, ldt, Ks, ldk, Kp, len, [&](int i) { return W + ((ce.row0 + i) * HV + hv) * Kp; });
  wy_products(warp, Tb1, ldt, Vs, ldv, Vp, len, [&](int i) { return U + ((ce.row0 + i) * HV + hv) * Vp; });
}

// The same stage on Hopper's warpgroup products (two warpgroups, TMA tiles; DELTACP_FUSED_KDA_PREPARE_WGMMA).
// (The header opens its own namespace and reads FwdArgs and the gate and l2-norm helpers above from this file's.)
}  // namespace
}  // namespace deltacp::cuda::tiled
#include "kda_prepare_wgmma.cuh"
namespace deltacp::cuda::tiled {
namespace {

// ---- host helpers ---------------------------------------------------------------------------
// Opts the kernel into `bytes` of dynamic shared memory; names the arguments when it cannot fit.
template <class Kernel>
void prepare_smem(Kernel kernel, int bytes, const Params& p, const char* stage) {
  opt_in_smem(kernel, bytes, "K", "the tiled tier's ", stage, " needs ", bytes, " bytes of shared memory for K = ",
              p.K, ", V = ", p.V, " and dtype ", to_string(p.dtype));
}

// Grid dimensions y and z are limited to 65535.
void check_grid_yz(int64_t y, const char* what) {
  DELTACP_CHECK(y <= 65535, what, "expected at most 65535 for the tiled tier's grid, got ", y);
}

template <class F>
void dispatch_kda(Variant v, F&& f) {
  if (v == Variant::kda) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

}  // namespace

// ---- the stage launchers (fwd_stages.cuh) ---------------------------------------------------
FwdSizes fwd_sizes(const Params& p, const ChunkTable& table) {
  const int64_t R = p.B * p.T, Kp = padded_dim(p.K), Vp = padded_dim(p.V);
  FwdSizes s;
  s.G = p.variant == Variant::gdn ? R * p.HV : (p.variant == Variant::kda ? R * p.HV * p.K : 0);
  s.W = R * p.HV * Kp;
  s.U = R * p.HV * Vp;
  s.Kd = p.variant == Variant::kda ? R * p.HV * Kp : 0;
  s.Tinv = R * p.HV * kTileRows;
  s.v_new = R * p.HV * Vp;
  s.h = table.num_chunks() * p.HV * Kp * Vp;
  return s;
}

FwdCost fwd_cost(const Params& p, const ChunkTable& table) {
  const double K = static_cast<double>(p.K), V = static_cast<double>(p.V), HV = static_cast<double>(p.HV);
  const double es = static_cast<double>(dtype_size(p.dtype));
  const bool kda = p.variant == Variant::kda, gdn = p.variant == Variant::gdn;
  FwdCost c;
  for (const ChunkEntry& ch : table.host_chunks()) {
    const double n = static_cast<double>(ch.len);
    c.flops += HV * (2 * n * n * K + 2 * n * n * (K + V)  // A; W, U
                     + 4 * n * K * V                       // stage 3: W S, K^T Vn
                     + 2 * n * K * V + 2 * n * n * (K + V));  // stage 4: Q h; Q K^T, P Vn
    double b = es * (n * (K + V) + n * (K + V) + n)   // stage 2: k, v in; W, U out; beta
               + es * (n * (2 * K + V) + n * V + K * V)  // stage 3: W, k, U in; Vn, h out
               + es * (n * (2 * K + V) + K * V + n * V);  // stage 4: q, k, Vn, h in; o out
    if (gdn) b += es * n + 4 * n + 3 * 4 * n;                      // g in, G out; G read by stages 2-4
    if (kda) b += es * n * K + 4 * n * K + 2 * 4 * n * K + 2 * es * n * K;  // g, G, G x2; Kd out + in
    c.bytes += HV * b;
  }
  const double state_bytes = 4.0 * static_cast<double>(p.num_seqs) * HV * K * V;
  if (p.h0) c.bytes += state_bytes;
  if (p.ht) c.bytes += state_bytes;
  return c;
}

void check_tiled_supported(const Params& p) {
  DELTACP_CHECK(p.variant == Variant::gdn || p.variant == Variant::kda || p.variant == Variant::delta, "variant",
                "expected gdn, kda or delta for the tiled tier, got ", to_string(p.variant));
  DELTACP_CHECK(p.dtype == DType::f32 || p.dtype == DType::bf16 || p.dtype == DType::f16, "dtype",
                "expected f32, bf16 or f16 on the GPU, got ", to_string(p.dtype));
  DELTACP_CHECK(p.state_dtype == DType::f32 || (p.h0 == nullptr && p.ht == nullptr), "state_dtype",
                "expected f32 states on the GPU, got ", to_string(p.state_dtype));
  DELTACP_CHECK(p.K >= 1 && p.K <= kMaxHeadDim, "K", "expected 1 <= K <= ", kMaxHeadDim,
                " for the tiled tier, got ", p.K);
  DELTACP_CHECK(p.V >= 1 && p.V <= kMaxHeadDim, "V", "expected 1 <= V <= ", kMaxHeadDim,
                " for the tiled tier, got ", p.V);
  DELTACP_CHECK(p.chunk_size >= 1 && p.chunk_size <= kTileRows, "chunk_size", "expected 1 <= chunk_size <= ",
                kTileRows, " for the tiled tier, got ", p.chunk_size);
  DELTACP_CHECK(p.H >= 1 && p.HV % p.H == 0, "HV", "expected a multiple of H = ", p.H, ", got ", p.HV);
  check_grid_yz(p.HV, "HV");
}

void launch_chunk_cumsum(const Params& p, const ChunkTable& table, float* G, cudaStream_t stream) {
  if (table.num_chunks() == 0 || p.variant == Variant::delta) return;
  const int64_t Dg = p.variant == Variant::kda ? p.K : 1;
  const int64_t cols = p.HV * Dg;
  const int64_t gy = (cols + kThreads - 1) / kThreads;
  check_grid_yz(gy, "HV");
  // g has its own dtype (p.gate_dtype(): fp32 beside 16-bit inputs, as FLA keeps it).
  dispatch_dtype(p.gate_dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const dim3 grid(static_cast<unsigned>(table.num_chunks()), static_cast<unsigned>(gy));
    chunk_cumsum_kernel<T><<<grid, kThreads, 0, stream>>>(dev_rows<const T>(p.g), table.chunks(), p.HV, Dg, G);
    DELTACP_CUDA_CHECK_LAUNCH();
  });
}

#ifdef DELTACP_HAVE_SM90A
namespace {
// What every Hopper kernel that reads k through 16-byte pieces or tensor maps needs beyond its shapes: gdn and delta
// read k itself (kda its scaled rows), and the GPU is compute capability 9.0.
const char* k_rows_and_gpu_refusal(const Params& p) {
  if (p.variant != Variant::kda) {
    const int64_t es = dtype_size(p.dtype);
    if (reinterpret_cast<uintptr_t>(p.k.ptr) % 16 != 0 || (p.k.stride_t * es) % 16 != 0 ||
        (p.k.stride_h * es) % 16 != 0 || (p.k.stride_b * es) % 16 != 0)
      return "it reads k in 16-byte pieces (k's pointer and strides are not 16-byte aligned)";
  }
  if (device_attribute(cudaDevAttrComputeCapabilityMajor) != 9 ||
      device_attribute(cudaDevAttrComputeCapabilityMinor) != 0)
    return "it runs on compute capability 9.0 (H100 / H200) only";
  return nullptr;
}
}  // namespace
#endif

const char* wy_wgmma_refusal(const Params& p) {
#ifndef DELTACP_HAVE_SM90A
  (void)p;
  return "this build has no sm_90a code (DELTACP_CUDA_ARCHS without 90a)";
#else
  if (p.variant != Variant::gdn && p.variant != Variant::delta)
    return "it implements gdn and delta (kda and dplr run on the tiled and naive tiers)";
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return "it takes bf16 or fp16 inputs";
  if (!((p.K == 128 && (p.V == 128 || p.V == 256)) || (p.K == 64 && p.V == 64)))
    return "it takes K = 128 with V = 128 or 256, or K = V = 64";
  if (p.chunk_size < 1 || p.chunk_size > 64) return "it takes chunk_size <= 64";
  const int64_t es = dtype_size(p.dtype);
  if (!rows_aligned16(p.q, es)) return "it reads q in 16-byte pieces (q's pointer or strides are not 16-byte aligned)";
  if (!rows_aligned16(p.v, es)) return "it reads v in 16-byte pieces (v's pointer or strides are not 16-byte aligned)";
  if (p.HV % p.H != 0 || p.HV > 65535) return "it takes HV a multiple of H and at most 65535";
  // TMA boxes: int32 coordinates, strides positive wherever a dim is stepped.
  if (p.B * p.T >= (int64_t{1} << 31)) return "it addresses token rows by TMA's 32-bit coordinates (B * T < 2^31)";
  for (const TensorRef* r : {&p.q, &p.k, &p.v})
    if (!steps_forward(*r, p.B, p.T, r == &p.v ? p.HV : p.H))
      return "it reads q, k and v through TMA tensor maps, which need positive strides";
  return k_rows_and_gpu_refusal(p);
#endif
}

namespace {
// DELTACP_TILED_WY_WGMMA (common/kernel_switch.h): unset = the Hopper WY stage (wy_wgmma.cuh) in the tiled
// forward and the backward's recompute where it applies; 0 = the mma.sync one (chunk_wy_kernel); 1 = required
// (an error names why it cannot run).
bool use_wy_wgmma(const Params& p) {
  return kernel_switch("DELTACP_TILED_WY_WGMMA", "the wgmma WY stage", [&] { return wy_wgmma_refusal(p); });
}
}  // namespace

WyDone launch_chunk_wy(const Params& p, const ChunkTable& table, const float* G, void* W, void* U, void* Kd,
                       float* Tinv, cudaStream_t stream, float* dv_local, bool t16) {
  if (table.num_chunks() == 0) return {};
  if (use_wy_wgmma(p)) {  // 16-bit gdn / delta at K = 128 (V = 128, 256), K = V = 64 on Hopper (as the fused
                          // forward's stage: 0.45 -> 0.26 ms at (2,16384,16,128), H200)
    float* dvl = dv_local != nullptr && wy_wgmma_takes_dout(p) ? dv_local : nullptr;
    dispatch_dtype(p.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (kIs16Bit<T>)
        launch_wy_wgmma<T>(p, table, p.variant == Variant::delta ? nullptr : G, static_cast<T*>(W),
                           static_cast<T*>(U), /*P=*/nullptr, Tinv, /*rq=*/nullptr, /*rk=*/nullptr, stream, dvl,
                           t16 && Tinv != nullptr);
    });
    return {dvl != nullptr, t16 && Tinv != nullptr};
  }
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_kda(p.variant, [&](auto kda) {
      constexpr bool kKda = decltype(kda)::value;
      const FwdArgs<T> args = make_args<T>(p, table);
      const WyLayout L = wy_layout(args.Kp, args.Vp, sizeof(T), kKda);
      auto kernel = chunk_wy_kernel<T, kKda>;
      prepare_smem(kernel, L.bytes, p, "A/T/W/U stage");
      const dim3 grid(static_cast<unsigned>(table.num_chunks()), static_cast<unsigned>(p.HV));
      kernel<<<grid, kThreads, L.bytes, stream>>>(args, G, static_cast<T*>(W), static_cast<T*>(U),
                                                  static_cast<T*>(Kd), Tinv);
      DELTACP_CUDA_CHECK_LAUNCH();
    });
  });
  return {};
}

// ---- the Hopper state scan's choice (scan_wgmma.cuh) -------------------------------------------
namespace {
// DELTACP_TILED_SCAN_WGMMA: unset = where it applies and the grid is wide enough (below); 0 = never;
// 1 = required (an error names why it cannot run; DELTACP_TILED_SCAN_BV / _STAGES are then unused).
// With the switch unset, forcing the mma.sync scan's tile (DELTACP_TILED_SCAN_BV / _STAGES) selects
// that scan.
//
// Why "wide enough": a chunk step of the wgmma scan issues ~3x fewer products but its latency is no
// shorter (~2 us), so with few CTAs (one long sequence and 16 heads: 16-32 CTAs) the mma.sync scan,
// whose narrower tiles give 2-4x the CTAs, is faster (H200, bench/gpu/bench_scan.py, scan kernel:
// 1.05 ms against 1.22 with one warpgroup per CTA, 1.67 with two). From half a CTA per SM at two
// warpgroups per CTA on, the wgmma scan wins: the CP pre-pass's pieces (4 x 8192 tokens, 16 heads,
// 256 columns, final state only) 0.26 ms against 0.49; (4, 4096, 64, 128) 0.44 ms against 0.69.
}  // namespace

const char* kda_fused_prepare_refusal(const Params& p) {
#ifndef DELTACP_HAVE_SM90A
  (void)p;
  return "this build has no sm_90a code (DELTACP_CUDA_ARCHS without 90a)";
#else
  if (p.variant != Variant::kda) return "it implements kda";
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return "it takes bf16 or fp16 inputs";
  if (p.K != 128 && p.K != 64) return "it takes K = 128 or K = 64";
  return k_rows_and_gpu_refusal(p);
#endif
}

// Returns the reason the wgmma scan does not apply, or nullptr when it does.
const char* wgmma_scan_refusal(const Params& p, bool h_and_vnew_agree) {
#ifndef DELTACP_HAVE_SM90A
  (void)p, (void)h_and_vnew_agree;
  return "this build has no sm_90a code (DELTACP_CUDA_ARCHS without 90a)";
#else
  if (p.dtype != DType::bf16 && p.dtype != DType::f16) return "it takes bf16 or fp16 inputs";
  if (p.K != kWgKeys) return "it takes K = 128";
  if (!h_and_vnew_agree) return "it stores h and v_new together or neither";
  return k_rows_and_gpu_refusal(p);
#endif
}

namespace {
// ctas_two_wg: the CTAs of the wgmma scan at two warpgroups per CTA.
bool use_wgmma_scan(const Params& p, bool h_and_vnew_agree, int64_t ctas_two_wg) {
  const char* env = std::getenv("DELTACP_TILED_SCAN_WGMMA");
  const bool required = env != nullptr && std::string(env) == "1";
  if (env != nullptr) {
    DELTACP_CHECK(std::string(env) == "0" || required, "DELTACP_TILED_SCAN_WGMMA", "expected 0 or 1, got ", env);
    if (!required) return false;
  } else if (std::getenv("DELTACP_TILED_SCAN_BV") != nullptr || std::getenv("DELTACP_TILED_SCAN_STAGES") != nullptr) {
    return false;
  }
  const char* why = wgmma_scan_refusal(p, h_and_vnew_agree);
  if (why != nullptr && required) throw_error("DELTACP_TILED_SCAN_WGMMA", "the wgmma state scan cannot run: ", why);
  return why == nullptr && (required || 2 * ctas_two_wg >= sm_count());
}

template <class T, bool kKda>
void launch_scan_wgmma(const Params& p, const ChunkTable& table, const FwdArgs<T>& args, const float* G,
                       const void* W, const void* U, const void* Kd, void* h, void* v_new, const float* h0,
                       float* ht, cudaStream_t stream) {
  // Two warpgroups per CTA share one copy of each chunk's W and K tiles (one warpgroup: twice the CTAs,
  // slower wherever use_wgmma_scan picks this scan; DELTACP_TILED_SCAN_WG=1 forces it). A state at most
  // 64 columns wide takes one: a second warpgroup would only multiply zeros.
  int nwg = args.Vp <= kWgCols ? 1 : 2;
  if (const char* env = std::getenv("DELTACP_TILED_SCAN_WG")) {
    DELTACP_CHECK(std::string(env) == "1" || std::string(env) == "2", "DELTACP_TILED_SCAN_WG", "expected 1 or 2, got ",
                  env);
    nwg = std::atoi(env);
  }
  const WgScanLayout L = wg_scan_layout(nwg, sizeof(T), h != nullptr);
  auto kernel = nwg == 2 ? chunk_state_scan_wgmma_kernel<T, kKda, 2> : chunk_state_scan_wgmma_kernel<T, kKda, 1>;
  prepare_smem(kernel, L.bytes, p, "state scan (wgmma)");
  const int64_t gz = (args.Vp + 64 * nwg - 1) / (64 * nwg);
  check_grid_yz(gz, "V");
  const dim3 grid(static_cast<unsigned>(table.num_seqs()), static_cast<unsigned>(p.HV), static_cast<unsigned>(gz));
  kernel<<<grid, 128 * nwg, L.bytes, stream>>>(args, G, static_cast<const T*>(W), static_cast<const T*>(U),
                                               static_cast<const T*>(Kd), static_cast<T*>(h), static_cast<T*>(v_new),
                                               h0, ht);
  DELTACP_CUDA_CHECK_LAUNCH();
}
}  // namespace

void launch_chunk_state_scan(const Params& p, const ChunkTable& table, const float* G, const void* W,
                             const void* U, const void* Kd, void* h, void* v_new, const float* h0, float* ht,
                             cudaStream_t stream, const ScanRows* rows, int64_t ctas_two_wg) {
  if (table.num_seqs() == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_kda(p.variant, [&](auto kda) {
      constexpr bool kKda = decltype(kda)::value;
      FwdArgs<T> args = make_args<T>(p, table);
      if (rows != nullptr) {
        args.ws_row0 = rows->row0;
        args.Up = static_cast<int>(rows->u_width);
        args.u_cols = static_cast<int>(rows->u_cols);
      }
      if (ctas_two_wg <= 0) ctas_two_wg = table.num_seqs() * p.HV * ((args.Vp + 127) / 128);
      if (use_wgmma_scan(p, (h == nullptr) == (v_new == nullptr), ctas_two_wg)) {
        if constexpr (kIs16Bit<T>) launch_scan_wgmma<T, kKda>(p, table, args, G, W, U, Kd, h, v_new, h0, ht, stream);
        return;
      }
      // Column tile and load stages: scan_config.h (K <= 64: 4 warps, BV 64/32/16; K <= 128: 8 warps,
      // BV 64/32; K > 128: 4 warps of 64 rows, BV 16).
      auto ctas_of = [&](int bv) { return table.num_seqs() * p.HV * ((args.Vp + bv - 1) / bv); };
      const int bv = p.K <= 64    ? scan_tile_width({64, 32, 16}, ctas_of)
                     : p.K <= 128 ? scan_tile_width({64, 32}, ctas_of)
                                  : scan_tile_width({16}, ctas_of);
      auto launch = [&](auto kernel1, auto kernel2, int BV, int NW, int KPT) {
        const int cap = NW == 4 ? 4 : 2;  // CTAs per SM allowed by the launch bounds' registers
        const bool two = scan_two_stages(ctas_of(BV), scan_layout(KPT, BV, sizeof(T), 1).bytes,
                                         scan_layout(KPT, BV, sizeof(T), 2).bytes, cap);
        const ScanLayout L = scan_layout(KPT, BV, sizeof(T), two ? 2 : 1);
        auto kernel = two ? kernel2 : kernel1;
        prepare_smem(kernel, L.bytes, p, "state scan");
        const int64_t gz = (args.Vp + BV - 1) / BV;
        check_grid_yz(gz, "V");
        const dim3 grid(static_cast<unsigned>(table.num_seqs()), static_cast<unsigned>(p.HV),
                        static_cast<unsigned>(gz));
        kernel<<<grid, 32 * NW, L.bytes, stream>>>(args, G, static_cast<const T*>(W), static_cast<const T*>(U),
                                                   static_cast<const T*>(Kd), static_cast<T*>(h),
                                                   static_cast<T*>(v_new), h0, ht);
        DELTACP_CUDA_CHECK_LAUNCH();
      };
#define DELTACP_SCAN(BV, KMT, NW)                                                    \
  launch(chunk_state_scan_kernel<T, kKda, BV, KMT, 1, NW>, chunk_state_scan_kernel<T, kKda, BV, KMT, 2, NW>, \
         BV, NW, 16 * (KMT) * (NW))
      if (p.K <= 64) {  // 4 warps x 16 rows
        if (bv == 64) DELTACP_SCAN(64, 1, 4);
        else if (bv == 32) DELTACP_SCAN(32, 1, 4);
        else DELTACP_SCAN(16, 1, 4);
      } else if (p.K <= 128) {  // 8 warps x 16 rows
        if (bv == 64) DELTACP_SCAN(64, 1, 8);
        else DELTACP_SCAN(32, 1, 8);
      } else {  // 4 warps x 64 rows
        DELTACP_SCAN(16, 4, 4);
      }
#undef DELTACP_SCAN
    });
  });
}

void launch_chunk_output(const Params& p, const ChunkTable& table, const float* G, const void* h,
                         const void* v_new, cudaStream_t stream) {
  if (table.num_chunks() == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_kda(p.variant, [&](auto kda) {
      constexpr bool kKda = decltype(kda)::value;
      const FwdArgs<T> args = make_args<T>(p, table);
      const OutLayout L = out_layout(args.Kp, sizeof(T), kKda);
      auto kernel = chunk_output_kernel<T, kKda>;
      prepare_smem(kernel, L.bytes, p, "output stage");
      const dim3 grid(static_cast<unsigned>(table.num_chunks()), static_cast<unsigned>(p.HV));
      kernel<<<grid, kThreads, L.bytes, stream>>>(args, G, static_cast<const T*>(h), static_cast<const T*>(v_new));
      DELTACP_CUDA_CHECK_LAUNCH();
    });
  });
}

namespace {
// DELTACP_FUSED_KDA_PREPARE (common/kernel_switch.h): unset = the fused kda stage in one kernel
// (kda_prepare_kernel); 0 = the pair it replaces (chunk_wy_kernel<T, true>, then kda_chain_operands_kernel),
// with the same bits; 1 = required (an error names why it cannot run).
bool use_kda_prepare_kernel(const Params& p) {
  return kernel_switch("DELTACP_FUSED_KDA_PREPARE", "the one-kernel kda stage", [&]() -> const char* {
    // The fused tier's shapes: its layout (kda_prep_layout) keeps two CTAs per SM at each (109.75 KB at K = 128
    // with V = 128 or 256: V lands in the dead Q and gate rows), and the pair takes any other K, V.
    const bool fits = (p.K == 128 && (p.V == 128 || p.V == 256)) || (p.K == 64 && p.V == 64);
    return fits ? nullptr : "it takes K = 128 with V = 128 or 256, or K = V = 64";
  });
}
// DELTACP_FUSED_KDA_PREPARE_WGMMA: unset = the stage on wgmma (kda_prepare_wgmma.cuh) wherever
// kda_prepare_wgmma_refusal allows (H100, (2,16384,16,128): 0.60 ms against kda_prepare_kernel's 1.01); 1 = the
// same, and an error names why it cannot run these inputs; 0 = kda_prepare_kernel (or, with
// DELTACP_FUSED_KDA_PREPARE=0, the pair). Checked ahead of DELTACP_FUSED_KDA_PREPARE.
bool use_kda_prepare_wgmma(const Params& p) {
  return kernel_switch("DELTACP_FUSED_KDA_PREPARE_WGMMA", "the wgmma kda stage",
                       [&] { return kda_prepare_wgmma_refusal(p); });
}
}  // namespace

bool wy_stage_kept_by(const Params& p) {
  if (p.K != 128 || p.V != 128 || (p.dtype != DType::bf16 && p.dtype != DType::f16)) return false;
  if (p.variant == Variant::kda) return use_kda_prepare_wgmma(p);
  return p.variant == Variant::gdn && wy_wgmma_refusal(p) == nullptr;  // the fused forward's gdn stage
}

void launch_kda_fused_prepare(const Params& p, const ChunkTable& table, float* G_last, void* W, void* U, void* Kd,
                              void* P, void* Qg, cudaStream_t stream, float* Tinv) {
  if (table.num_chunks() == 0) return;
  DELTACP_CHECK(Tinv == nullptr || wy_stage_kept_by(p), "wy_stage",
                "internal: the kda stage is kept only where its wgmma kernel runs at K = V = 128");
  DELTACP_CHECK(p.variant == Variant::kda && (p.K == 128 || p.K == 64), "variant",
                "expected kda with K = 128 or 64 for the fused forward's kda stage, got ", to_string(p.variant),
                " with K = ", p.K);
  // safe_gate's range check (Params::gate_range): the wgmma stage folds it in; the other kernels take one pass first.
  if (p.gate_range != nullptr && !use_kda_prepare_wgmma(p)) gate_range_pass(p, stream);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (kIs16Bit<T>) {
      FwdArgs<T> args = make_args<T>(p, table);
      if (p.g_fp32) {
        args.g32 = dev_rows<const float>(p.g);
      } else {
        args.g16 = dev_rows<const T>(p.g);
      }
      args.qk_l2norm = p.qk_l2norm;
      args.gate_A_log = p.gate_A_log;
      args.gate_dt_bias = p.gate_dt_bias;
      args.gate_lower_bound = p.gate_lower_bound;
      const dim3 grid(static_cast<unsigned>(table.num_chunks()), static_cast<unsigned>(p.HV));
      if (use_kda_prepare_wgmma(p)) {  // everything in one kernel, on wgmma
        args.g_last = Tinv != nullptr ? nullptr : G_last;  // kept: every row of G instead
        args.gate_range = p.gate_range;  // safe_gate's range check folded into its gate load
        launch_kda_prepare_wgmma<T>(p, table, args, static_cast<T*>(W), static_cast<T*>(U), static_cast<T*>(Kd),
                                    static_cast<T*>(P), static_cast<T*>(Qg), stream,
                                    Tinv != nullptr ? G_last : nullptr, Tinv);
        return;
      }
      if (use_kda_prepare_kernel(p)) {  // everything in one kernel
        args.g_last = G_last;
        const KdaPrepLayout L = kda_prep_layout(args.Kp, args.Vp, sizeof(T));
        auto kernel = kda_prepare_kernel<T>;
        prepare_smem(kernel, L.bytes, p, "kda stage of the fused forward");
        kernel<<<grid, kThreads, L.bytes, stream>>>(args, static_cast<T*>(W), static_cast<T*>(U), static_cast<T*>(Kd),
                                                    static_cast<T*>(P), static_cast<T*>(Qg));
        DELTACP_CUDA_CHECK_LAUNCH();
        return;
      }
      {  // W, U, K e^(G_n - G), and G's last rows
        args.g_last = G_last;
        const WyLayout L = wy_layout(args.Kp, args.Vp, sizeof(T), /*kda=*/true);
        auto kernel = chunk_wy_kernel<T, true>;
        prepare_smem(kernel, L.bytes, p, "A/T/W/U stage");
        kernel<<<grid, kThreads, L.bytes, stream>>>(args, /*G=*/nullptr, static_cast<T*>(W), static_cast<T*>(U),
                                                    static_cast<T*>(Kd), /*Tinv=*/nullptr);
        DELTACP_CUDA_CHECK_LAUNCH();
      }
      {  // P, Q e^G
        args.g_last = nullptr;
        const OutLayout L = out_layout(args.Kp, sizeof(T), /*kda=*/true);
        auto kernel = kda_chain_operands_kernel<T>;
        prepare_smem(kernel, L.bytes, p, "kda operands of the fused chain");
        kernel<<<grid, kThreads, L.bytes, stream>>>(args, static_cast<T*>(P), static_cast<T*>(Qg));
        DELTACP_CUDA_CHECK_LAUNCH();
      }
    } else {
      throw_error("dtype", "expected bf16 or fp16 for the fused forward's kda stage, got ", to_string(p.dtype));
    }
  });
}

const char* kda_bwd_recompute_refusal(const Params& p) { return kda_bwd_recompute_wgmma_refusal(p); }

void launch_kda_bwd_recompute(const Params& p, const ChunkTable& table, float* G, void* W, void* U, void* Kd,
                              float* Tinv, bool t16, void* Qg, float* dvl, cudaStream_t stream) {
  if (table.num_chunks() == 0) return;
  if (const char* why = kda_bwd_recompute_wgmma_refusal(p))
    throw_error("variant", "the wgmma kda recompute cannot run: ", why);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (kIs16Bit<T>)
      launch_kda_bwd_recompute_wgmma<T>(p, table, G, static_cast<T*>(W), static_cast<T*>(U), static_cast<T*>(Kd), Tinv,
                                        t16, static_cast<T*>(Qg), dvl, stream);
  });
}

bool gdn_recompute_matches_wy_stage(const Params& p) {
  return p.variant == Variant::gdn && use_wy_wgmma(p) && wy_wgmma_takes_dout(p);
}

void launch_bwd_b0_kept(const Params& p, const ChunkTable& table, const void* P, float* dvl, cudaStream_t stream) {
  if (table.num_chunks() == 0) return;
  const char* why = p.variant == Variant::kda ? kda_bwd_recompute_wgmma_refusal(p) : wy_wgmma_refusal(p);
  if (why == nullptr && !wy_wgmma_takes_dout(p)) why = "it reads do by TMA (16-byte aligned rows, positive strides)";
  if (why != nullptr) throw_error("wy_stage", "stage B0 over the kept WY stage cannot run: ", why);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (kIs16Bit<T>) launch_b0_kept_wgmma<T>(p, table, static_cast<const T*>(P), dvl, stream);
  });
}

// ---- the tier entry point and the staged forward (api.h) -------------------------------------
// Everything one forward keeps between its stages: the chunk table, the workspace (G, W, U, Kd, and
// v_new and h unless final-state-only) and whether it has finished. run_forward is prepare + finish in
// one call, so the staged forward gives bitwise the same o and ht.
struct FwdState final : StagedForwardState {
  using StagedForwardState::StagedForwardState;
  Method tier() const override { return Method::tiled; }
  float* G = nullptr;
  void *W = nullptr, *U = nullptr, *Kd = nullptr, *vn = nullptr, *h = nullptr;
  ScanPlan plan;                          // how stage 3 cuts the sequences (scan_split.cu)
  float* maps = nullptr;                  // pass 1's maps of every piece of every cut sequence
  std::vector<const float*> seq_maps;     // per sequence: its first map in `maps`, or nullptr (not cut)
  std::unique_ptr<PieceTables> tables;    // pass 2's tables (cut plans): made here, so finish only launches
  bool finished = false;
};

// Checks, the chunk table, one workspace allocation (256-byte aligned pieces), stages 1 and 2.
std::unique_ptr<FwdState> start_forward(const Params& p) {
  check_tiled_supported(p);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  auto s = std::make_unique<FwdState>(p, stream);
  if (s->table.num_seqs() == 0) return s;
  const FwdSizes sz = fwd_sizes(p, s->table);
  const int64_t esize = dtype_size(p.dtype);
  auto align = [](int64_t b) { return (b + 255) / 256 * 256; };
  const int64_t bytes_G = align(sz.G * 4), bytes_W = align(sz.W * esize), bytes_U = align(sz.U * esize),
                bytes_Kd = align(sz.Kd * esize);
  // Final-state-only (Params::final_state_only, the CP pre-pass): no output stage, so neither h per
  // chunk nor v_new is stored (the scan skips those writes).
  const bool states_only = p.final_state_only();
  // h and v_new go to the caller's buffers when it keeps them for the backward (Params::chunk_h; never with
  // states_only: dispatch.cu refuses that).
  const bool kept = p.chunk_h != nullptr;
  const int64_t bytes_vn = states_only || kept ? 0 : align(sz.v_new * esize);
  const int64_t bytes_h = states_only || kept ? 0 : align(sz.h * esize);
  // Stage 3 in pieces (scan_split.cu): pass 1 needs no h0, so it runs here, with stages 1 and 2.
  s->plan = plan_scan(p, s->table.host_seqs());
  const std::vector<int64_t> pass1 = pass1_pieces(s->plan);
  const int64_t map_elems = p.HV * p.K * (p.V + p.K);
  const int64_t bytes_maps = align(static_cast<int64_t>(pass1.size()) * map_elems * 4);
  const int64_t total = bytes_G + bytes_W + bytes_U + bytes_Kd + bytes_vn + bytes_h + bytes_maps;
  if (total > 0) s->ws = static_cast<char*>(workspace_alloc(static_cast<size_t>(total), stream));
  char* at = s->ws;
  auto take = [&](int64_t b) {
    char* r = b > 0 ? at : nullptr;
    at += b;
    return r;
  };
  s->G = reinterpret_cast<float*>(take(bytes_G));
  s->W = take(bytes_W);
  s->U = take(bytes_U);
  s->Kd = take(bytes_Kd);
  s->vn = kept ? p.chunk_vnew : take(bytes_vn);
  s->h = kept ? p.chunk_h : take(bytes_h);
  s->maps = reinterpret_cast<float*>(take(bytes_maps));
  s->seq_maps.assign(static_cast<size_t>(s->table.num_seqs()), nullptr);
  for (int64_t n = 0, at_map = 0; s->plan.cut() && n < s->table.num_seqs(); ++n) {
    if (s->plan.pieces_of(n) < 2) continue;
    s->seq_maps[static_cast<size_t>(n)] = s->maps + at_map * map_elems;
    at_map += s->plan.pieces_of(n);
  }
  launch_chunk_cumsum(p, s->table, s->G, stream);
  launch_chunk_wy(p, s->table, s->G, s->W, s->U, s->Kd, /*Tinv=*/nullptr, stream);
  launch_pass1(p, s->plan, pass1, s->G, s->W, s->U, s->Kd, s->maps, stream);
  if (s->plan.cut()) s->tables = std::make_unique<PieceTables>(p, s->plan, s->seq_maps, stream);
  return s;
}

// Stages 3 and 4 from p.h0 (p: the prepared problem, or the same tensors with h0 / ht set).
void finish_forward(FwdState& s, const Params& p) {
  s.finished = true;
  if (s.table.num_seqs() == 0) return;
  launch_state_scan(p, s.table, s.plan, s.G, s.W, s.U, s.Kd, s.h, s.vn, static_cast<const float*>(p.h0),
                    static_cast<float*>(p.ht), s.stream, s.tables.get());
  if (!s.p.final_state_only()) launch_chunk_output(p, s.table, s.G, s.h, s.vn, s.stream);
}

void run_forward(const Params& p) {
  auto s = start_forward(p);
  finish_forward(*s, p);
}

void same_forward_problem(const Params& a, const Params& b, const char* what) {
  DELTACP_CHECK(a.variant == b.variant && a.dtype == b.dtype && a.g_fp32 == b.g_fp32 && a.B == b.B && a.H == b.H &&
                    a.HV == b.HV && a.K == b.K && a.chunk_size == b.chunk_size,
                "params", what, ": expected the prepared problem's variant, dtype, B, H, HV, K and chunk size");
}

void forward_state_pieces(StagedForward& staged, const Params& pieces, int64_t row0, bool with_values) {
  auto& s = dynamic_cast<FwdState&>(staged);
  DELTACP_CHECK(!s.finished, "state", "expected a prepared forward that has not finished yet");
  DELTACP_CHECK(pieces.final_state_only(), "ht", "expected a final-state-only problem for the pieces (ht and no o)");
  same_forward_problem(s.p, pieces, "the pieces");
  DELTACP_CHECK(s.p.B == 1 && pieces.B == 1 && row0 >= 0 && row0 + pieces.T <= s.p.T, "cu_seqlens",
                "expected packed sequences (B = 1) and pieces over rows [row0, row0 + T) of the prepared problem's ",
                s.p.T, ", got row0 = ", row0, " and T = ", pieces.T);
  DELTACP_CHECK(!with_values || pieces.V >= s.p.V, "v", "expected a state at least as wide as the prepared V = ",
                s.p.V, " when the pieces take its values, got ", pieces.V);
  // gdn and delta read k itself in the scan: it must be the prepared k from row0 on.
  const int64_t esize = dtype_size(s.p.dtype);
  const char* k_at_row0 = static_cast<const char*>(s.p.k.ptr) + row0 * s.p.k.stride_t * esize;
  DELTACP_CHECK(pieces.k.ptr == k_at_row0 && pieces.k.stride_t == s.p.k.stride_t &&
                    pieces.k.stride_h == s.p.k.stride_h,
                "k", "expected the prepared problem's k from row ", row0, " on");
  const ChunkTable table(pieces, s.p.chunk_size, s.stream);
  // The scan reads the prepared G, W, U, Kd rows of the pieces' chunks.
  check_pieces_on_prepared_chunks(s.table, table, row0, "forward");
  if (table.num_seqs() == 0) return;
  ScanRows rows;
  rows.row0 = row0;
  rows.u_width = padded_dim(s.p.V);
  rows.u_cols = with_values ? padded_dim(s.p.V) : 0;
  launch_chunk_state_scan(pieces, table, s.G, s.W, s.U, s.Kd, /*h=*/nullptr, /*v_new=*/nullptr,
                          static_cast<const float*>(pieces.h0), static_cast<float*>(pieces.ht), s.stream, &rows);
}

std::vector<int64_t> scan_pieces(const Params& p, int64_t n) {
  std::vector<ChunkEntry> chunks;
  std::vector<SeqEntry> seqs;
  build_chunk_entries(p, p.chunk_size, chunks, seqs);
  DELTACP_CHECK(n >= 0 && n < static_cast<int64_t>(seqs.size()), "n", "expected a sequence index in [0, ",
                seqs.size(), "), got ", n);
  return piece_bounds(plan_scan(p, seqs), seqs, n);
}

std::vector<int64_t> piece_bounds(const ScanPlan& plan, const std::vector<SeqEntry>& seqs, int64_t n) {
  std::vector<int64_t> bounds{0};
  for (int64_t i = plan.cut() ? plan.first_piece[n] : 0; plan.cut() && i < plan.first_piece[n + 1]; ++i)
    bounds.push_back(plan.pieces[i].bos + plan.pieces[i].len - seqs[n].bos);
  if (!plan.cut()) bounds.push_back(seqs[n].len);
  return bounds;
}

// The prepared forward's sequence n, which its state scan cuts into pieces (else an error naming n).
void check_cut_sequence(const FwdState& s, int64_t n) {
  DELTACP_CHECK(!s.finished, "state", "expected a prepared forward that has not finished yet");
  DELTACP_CHECK(n >= 0 && n < s.table.num_seqs() && s.plan.pieces_of(n) > 1, "n",
                "expected a prepared sequence that the state scan cuts into pieces (scan_pieces), got ", n);
}

void forward_piece_maps(StagedForward& staged, int64_t n, float* maps, int64_t numel) {
  auto& s = dynamic_cast<FwdState&>(staged);
  check_cut_sequence(s, n);
  const int64_t expected = s.plan.pieces_of(n) * s.p.HV * s.p.K * (s.p.V + s.p.K);
  DELTACP_CHECK(maps != nullptr && numel == expected, "maps", "expected ", expected, " fp32 elements ([",
                s.plan.pieces_of(n), ", ", s.p.HV, ", ", s.p.K, ", ", s.p.V + s.p.K, "]), got ", numel);
  // prepare's pass 1 made every piece's map (pass1_pieces)
  const int64_t P = s.plan.pieces_of(n), map_elems = s.p.HV * s.p.K * (s.p.V + s.p.K);
  DELTACP_CUDA_CHECK(cudaMemcpyAsync(maps, s.seq_maps[static_cast<size_t>(n)], static_cast<size_t>(P * map_elems) * 4,
                                     cudaMemcpyDeviceToDevice, s.stream));
}

void forward_composed_map(StagedForward& staged, int64_t n, const float* init, float* out, int64_t width,
                          int64_t numel) {
  auto& s = dynamic_cast<FwdState&>(staged);
  check_cut_sequence(s, n);  // launch_compose_maps checks width
  DELTACP_CHECK(out != nullptr && numel == s.p.HV * s.p.K * width, "out", "expected ", s.p.HV * s.p.K * width,
                " fp32 elements ([", s.p.HV, ", ", s.p.K, ", ", width, "]), got ", numel);
  launch_compose_maps(s.seq_maps[static_cast<size_t>(n)], s.plan.pieces_of(n), s.p.HV, s.p.K, s.p.V, width, init, out,
                      s.stream);
}

void forward_finish(StagedForward& staged, const Params& p) {
  auto& s = dynamic_cast<FwdState&>(staged);
  DELTACP_CHECK(!s.finished, "state", "expected a prepared forward that has not finished yet");
  same_forward_problem(s.p, p, "finish");
  DELTACP_CHECK(p.V == s.p.V && p.q.ptr == s.p.q.ptr && p.k.ptr == s.p.k.ptr && p.v.ptr == s.p.v.ptr &&
                    p.o.ptr == s.p.o.ptr,
                "params", "finish: expected the prepared problem (the same q, k, v, o tensors)");
  DELTACP_CHECK(same_sequences(p, s.p), "cu_seqlens", "finish: expected the prepared sequences");
  finish_forward(s, p);
}

}  // namespace deltacp::cuda::tiled

namespace deltacp::cuda {
void tiled_forward(const Params& p) { tiled::run_forward(p); }
std::unique_ptr<StagedForward> tiled_forward_prepare(const Params& p) { return tiled::start_forward(p); }
void tiled_forward_state_pieces(StagedForward& s, const Params& pieces, int64_t row0, bool with_values) {
  tiled::forward_state_pieces(s, pieces, row0, with_values);
}
void tiled_forward_finish(StagedForward& s, const Params& p) { tiled::forward_finish(s, p); }
std::vector<int64_t> tiled_scan_pieces(const Params& p, int64_t n) { return tiled::scan_pieces(p, n); }
void tiled_forward_piece_maps(StagedForward& s, int64_t n, float* maps, int64_t numel) {
  tiled::forward_piece_maps(s, n, maps, numel);
}
void tiled_forward_composed_map(StagedForward& s, int64_t n, const float* init, float* out, int64_t width,
                                int64_t numel) {
  tiled::forward_composed_map(s, n, init, out, width, numel);
}
void tiled_compose_state_maps(const float* maps, int64_t P, int64_t HV, int64_t K, int64_t V, int64_t width,
                              const float* init, float* out, void* stream) {
  tiled::launch_compose_maps(maps, P, HV, K, V, width, init, out, static_cast<cudaStream_t>(stream));
}
}  // namespace deltacp::cuda
