// cuda/tiled/dplr_fwd.cu — the tiled tier's DPLR forward (and its dh0-only backward): the chunked WY form with
// separate a and b, one kernel per stage, products on the tensor cores.
//
// Recurrence (per token, state S [K, V]):  S_t = diag(e^gk_t) S_{t-1} + k_t v_t^T + b_t (a_t^T S_{t-1}),
// o_t = S_t^T (scale q_t). Chunk form (reference/src/chunked.cpp: chunk_wy, chunk_state_update,
// chunk_output), per chunk of n <= 64 tokens, G = within-chunk cumsum of gk, Gp_i = G_{i-1} (Gp_0 = 0):
//
//   A_ab = strict_tril(sum_d a_id b_jd e^(Gp_id - G_jd))     A_ak = the same with k for b
//   T    = (I - A_ab)^-1                                     (unit lower triangular, fp32)
//   W    = T (a e^Gp)           U = (T A_ak) V                (the WY-like representation)
//   Ut   = U + W S              (a_i^T S_{i-1} for every token of the chunk: the low-rank read-outs)
//   S'   = D_n S + (k e^(G_n - G))^T V + (b e^(G_n - G))^T Ut,   D_n = diag(e^G_n)
//   O    = scale ((q e^G) S + tril_incl(P_qk) V + tril_incl(P_qb) Ut)
//
// The decay-masked products A_ab, A_ak, P_qk, P_qb go through dplr_scores.cuh (16 x 16 sub-blocks around
// reference rows, every exponent <= 0 for gk <= 0). Every other exponential here is <= 0 too: e^Gp,
// e^G, e^(G_n - G), e^G_n. The kernels assume gk <= 0 (deltacp.dplr routes other gates to the naive tier).
//
// Kernels (128 threads = 4 warps each; 64-row tiles in shared memory; mma.sync m16n8k16 with fp32
// accumulation for bf16 / fp16, FFMA for fp32, through fwd_mma.cuh's warp_mma; KP = 64 for K <= 64, 128
// for K <= 128; VP = V rounded up to 32):
//
//   1 dplr_wy_kernel      grid (chunks, H)          G (cumsum), A_ab, A_ak (scores), T (fp32, by 16 x 16
//                                                   blocks: diagonal ones by substitution), W, U,
//                                                   Kd = k e^(G_n - G), Bd = b e^(G_n - G), D_n
//   2 dplr_scan_kernel    grid (N * H, VP / 32)     sequential over a sequence's chunks; the state's 32
//                                                   columns stay in fp32 registers (warp w: rows
//                                                   [w KP/4, (w+1) KP/4)); writes h_c (chunk-start state)
//                                                   and Ut; ht
//   3 dplr_output_kernel  grid (chunks, H)          P_qk, P_qb (scores), then O over 32-column blocks
//
// The dh0-only backward (Params::dh0_only: the CP backward pre-pass; the first stage of a tiled DPLR backward),
// from the reference's chunk backward: with dS = dL/dS at a chunk's end (dht at the sequence's end),
//   dUt = P_qb^T (scale dO) + Bd dS,   dS <- D_n dS + (q e^G)^T (scale dO) + W^T dUt,   dh0 = the last dS.
//   kernels 1 (W, Bd, D_n), 3 without o (storing q e^G and P_qb instead), then
//   4 dplr_dh0_scan_kernel  grid (N * H, VP / 32)   the mirror of kernel 2, from the last chunk back
//
// Intermediates (workspace, row-major; R = B * T rows of the flat token axis of chunk_table.cuh):
//   G fp32 [R, H, KP]; W, Kd, Bd p.dtype [R, H, KP]; U, Ut p.dtype [R, H, VP]; Dn fp32 [chunks, H, KP];
//   h p.dtype [chunks, H, KP, VP]; dh0-only: QG p.dtype [R, H, KP], P_qb p.dtype [chunks, H, 64, 64].
//   p.dtype for what feeds 16-bit tensor-core operands anyway (the state itself is carried in fp32 registers
//   through stage 2, as in the gdn / kda path of tiled_fwd.cu).
//
// Dynamic shared memory (bytes, from the layout structs WySmem / ScanSmem / OutSmem / Dh0Smem; each launch checks
// it against the GPU's opt-in limit and throws an Error naming K when it does not fit):
//                 bf16/fp16 K <= 64   K <= 128     fp32 K <= 64   K <= 128
//   wy            100,112             142,096      141,840        224,016
//   scan          48,384              78,336       89,344         147,968
//   output        72,704              121,856      121,856        203,776
//   dh0 scan      52,480              82,432       97,536         156,160
//   wy: a, b, k tiles 64 x (KP+pad); G 65 x (KP+4) fp32; scratch (the scores' reference-row tiles, then T in
//   fp32, then a V tile); A_ab 64 x 65 fp32; A_ak and T as 64 x (64+pad) tiles; 3 x 16 x 16 fp32 for T's
//   blocks. scan: W, Kd, Bd tiles; U, V, Ut 64 x (32+pad); S as a KP x (32+pad) operand; D_n. output: q, k, b
//   tiles; G fp32; scratch; P_qk, P_qb (the per-block h, V, Ut tiles reuse k and b). So 16-bit K <= 64 fits
//   every sm_80+ GPU (sm_86 / sm_89: 99 KB), 16-bit K <= 128 and fp32 K <= 64 need sm_80 / sm_90's 163 / 227
//   KB, fp32 K <= 128 Hopper only.
// Registers (nvcc 13 --resource-usage; sm_80 / sm_90a, 16-bit inputs): wy 80 / 72-79 (KP 64), 128 / 72 (KP
// 128); scan 122 / 91, 96 / 80; output 118 / 87, 88-89 / 76-77; dh0 scan 128 / 127, 122 / 117. Spills: none
// except 4-16 bytes in some wy kernels (fp16 KP 64 sm_80, fp32 KP 64 sm_80, fp16 KP 128, bf16 KP 64 and fp32
// KP 128 on sm_90a).
// Speed: not yet timed (no GPU run yet). This is the straightforward first version: T's blocks are products
// of fp32 loops (not tensor cores), the wy stage at K = 128 runs one 142 KB CTA per SM, and the scan's grid is
// N * H * VP / 32 CTAs.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../common/check.h"
#include "../common/dev_rows.cuh"
#include "../common/device_info.h"
#include "../common/load_store.cuh"
#include "../common/workspace_pool.h"
#include "chunk_table.cuh"
#include "deltacp/cuda/tiers.h"
#include "deltacp/error.h"
#include "deltacp/params.h"
#include "dplr_scores.cuh"
#include "fwd_mma.cuh"

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
  // The dh0-only backward (dplr_dh0_scan_kernel): the output stage stores scale-free q e^G and P_qb for it.
  T* QG = nullptr;  // [R, H, KP]
  T* Pb = nullptr;  // [chunks, H, 64, 64]
  DevRows<const T> dout;
  const float* dht = nullptr;
  float* dh0 = nullptr;
};

template <class T>
__device__ __forceinline__ float load_gate(const DplrArgs<T>& x, int64_t b, int64_t t, int64_t h, int64_t d) {
  const int64_t off = b * x.gk_sb + t * x.gk_st + h * x.gk_sh + d;
  return x.gk_fp32 ? static_cast<const float*>(x.gk)[off] : to_f(static_cast<const T*>(x.gk)[off]);
}

// ---- shared-memory layouts (element offsets in bytes, 16-byte aligned) ------------------------------------
template <class T, int KP>
struct WySmem {
  static constexpr int ldk = tile_ld<T>(KP), ld64 = tile_ld<T>(64), ldv = tile_ld<T>(kDBV), ldg = gate_ld(KP);
  static constexpr int ldf = 65;  // fp32 64 x 64 matrices: column walks hit distinct banks
  static constexpr int64_t tileK = align16(int64_t(kDRows) * ldk * sizeof(T));
  static constexpr int64_t a = 0, b = a + tileK, k = b + tileK;
  static constexpr int64_t G = k + tileK;  // 65 rows: row 0 = 0, row i + 1 = G_i (so row i = Gp_i)
  static constexpr int64_t scratch = G + align16(int64_t(kDRows + 1) * ldg * 4);
  static constexpr int64_t scratch_bytes =
      align16(std::max<int64_t>(std::max<int64_t>(tileK, int64_t(kDRows) * ldf * 4),
                                int64_t(kDRows) * ldv * sizeof(T)));
  static constexpr int64_t Aab = scratch + scratch_bytes;
  static constexpr int64_t Ak = Aab + align16(int64_t(kDRows) * ldf * 4);
  static constexpr int64_t Tt = Ak + align16(int64_t(kDRows) * ld64 * sizeof(T));
  static constexpr int64_t Xb = Tt + align16(int64_t(kDRows) * ld64 * sizeof(T));  // 3 blocks of 16 x 16 fp32
  static constexpr int64_t bytes = Xb + 3 * 256 * 4;
};

template <class T, int KP>
struct ScanSmem {
  static constexpr int ldk = tile_ld<T>(KP), ldv = tile_ld<T>(kDBV);
  static constexpr int64_t tileK = align16(int64_t(kDRows) * ldk * sizeof(T));
  static constexpr int64_t tileV = align16(int64_t(kDRows) * ldv * sizeof(T));
  static constexpr int64_t W = 0, Kd = W + tileK, Bd = Kd + tileK;
  static constexpr int64_t U = Bd + tileK, V = U + tileV, Ut = V + tileV;
  static constexpr int64_t S = Ut + tileV;
  static constexpr int64_t Dn = S + align16(int64_t(KP) * ldv * sizeof(T));
  static constexpr int64_t bytes = Dn + align16(int64_t(KP) * 4);
};

template <class T, int KP>
struct OutSmem {
  static constexpr int ldk = tile_ld<T>(KP), ld64 = tile_ld<T>(64), ldv = tile_ld<T>(kDBV), ldg = gate_ld(KP);
  static constexpr int64_t tileK = align16(int64_t(kDRows) * ldk * sizeof(T));
  static constexpr int64_t q = 0, k = q + tileK, b = k + tileK;
  static constexpr int64_t G = b + tileK;
  static constexpr int64_t scratch = G + align16(int64_t(kDRows) * ldg * 4);
  static constexpr int64_t Pk = scratch + tileK;
  static constexpr int64_t Pb = Pk + align16(int64_t(kDRows) * ld64 * sizeof(T));
  static constexpr int64_t bytes = Pb + align16(int64_t(kDRows) * ld64 * sizeof(T));
  // per value block, over the k and b tiles (free once the scores are made)
  static constexpr int64_t hS = k;
  static constexpr int64_t vS = hS + align16(int64_t(KP) * ldv * sizeof(T));
  static constexpr int64_t utS = vS + align16(int64_t(kDRows) * ldv * sizeof(T));
  static_assert(utS + int64_t(kDRows) * ldv * sizeof(T) <= G, "the value-block tiles must fit over k and b");
};

template <class P>
__device__ __forceinline__ P* smem_at(unsigned char* base, int64_t off) {
  return reinterpret_cast<P*>(base + off);
}

// ---- stage 1: G, the scores, T, W, U, Kd, Bd, D_n ------------------------------------------------------------
template <class T, int KP>
__global__ void __launch_bounds__(kDThreads) dplr_wy_kernel(const DplrArgs<T> x) {
  using L = WySmem<T, KP>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sa = smem_at<T>(smem, L::a);
  T* sb = smem_at<T>(smem, L::b);
  T* sk = smem_at<T>(smem, L::k);
  float* sG = smem_at<float>(smem, L::G);
  T* Xr = smem_at<T>(smem, L::scratch);
  T* Yr = Xr + 16 * L::ldk;
  float* Tm = smem_at<float>(smem, L::scratch);  // after the scores
  T* Vt = smem_at<T>(smem, L::scratch);          // after T is converted
  float* Aab = smem_at<float>(smem, L::Aab);
  T* Ak = smem_at<T>(smem, L::Ak);
  T* Tt = smem_at<T>(smem, L::Tt);
  float* Xb = smem_at<float>(smem, L::Xb);

  const int tid = threadIdx.x, warp = tid >> 5;
  const ChunkEntry ch = x.chunks[blockIdx.x];
  const int64_t h = blockIdx.y;
  const int len = static_cast<int>(ch.len);
  const int K = static_cast<int>(x.K);

  // Inputs: a, b, k tiles (zero past len and K); gk into rows 1..64 of sG; A_ak zeroed (the scores leave the
  // blocks above the block diagonal unwritten, and T A_ak reads every column).
  {
    const T* pa = x.a.at(ch.batch, ch.t0, h);
    const T* pb = x.b.at(ch.batch, ch.t0, h);
    const T* pk = x.k.at(ch.batch, ch.t0, h);
    load_tile<T, kDThreads>(sa, L::ldk, pa, x.a.st, len, kDRows, K, KP, vec_ok(pa, x.a.st));
    load_tile<T, kDThreads>(sb, L::ldk, pb, x.b.st, len, kDRows, K, KP, vec_ok(pb, x.b.st));
    load_tile<T, kDThreads>(sk, L::ldk, pk, x.k.st, len, kDRows, K, KP, vec_ok(pk, x.k.st));
    cp_async_commit();
    for (int idx = tid; idx < (kDRows + 1) * KP; idx += kDThreads) {
      const int i = idx / KP, d = idx - i * KP;  // sG row i holds token i - 1's gate
      sG[i * L::ldg + d] = (i >= 1 && i - 1 < len && d < K) ? load_gate(x, ch.batch, ch.t0 + i - 1, h, d) : 0.f;
    }
    for (int idx = tid; idx < kDRows * L::ld64; idx += kDThreads) Ak[idx] = from_f<T>(0.f);
    cp_async_wait<0>();
    __syncthreads();
  }
  // Within-chunk cumulative sums, one thread per column: sG row i + 1 = G_i; rows past len repeat G_{len-1}.
  if (tid < KP) {
    float run = 0.f;
    for (int i = 1; i <= kDRows; ++i) {
      run += sG[i * L::ldg + tid];
      sG[i * L::ldg + tid] = run;
    }
  }
  __syncthreads();

  // A_ab (fp32, for the substitution) and A_ak (T, a tensor-core operand): Gl = Gp (rows of sG), Gr = G.
  dplr_scores<T, kDThreads>(sa, sb, L::ldk, sG, sG + L::ldg, L::ldg, Xr, Yr, KP, len, false,
                            [&](int i, int j, float val) { Aab[i * L::ldf + j] = val; });
  dplr_scores<T, kDThreads>(sa, sk, L::ldk, sG, sG + L::ldg, L::ldg, Xr, Yr, KP, len, false,
                            [&](int i, int j, float val) { Ak[i * L::ld64 + j] = from_f<T>(val); });

  // T = (I - A_ab)^-1 in fp32, by 16 x 16 blocks. (I - A) T = I gives, for block rows i > j,
  //   T_ii = (I - A_ii)^-1,   T_ij = T_ii sum_{j <= k < i} A_ik T_kj,
  // so: the 4 diagonal blocks by forward substitution (thread (a, c): column c of block a, 16 steps), then
  // block rows 1..3 in turn, each from the rows above it (two 16 x 16 products per block, all 128 threads).
  // Rows past len have A = 0 and come out as rows of I.
  if (tid < kDRows) {
    const int base = 16 * (tid >> 4), c = tid & 15;
    for (int i = 0; i < 16; ++i) {
      float s = (i == c) ? 1.f : 0.f;  // T_ic = [i == c] + sum_{c <= j < i} A_ij T_jc (0 for i < c)
      for (int j = c; j < i; ++j) s = fmaf(Aab[(base + i) * L::ldf + base + j], Tm[(base + j) * L::ldf + base + c], s);
      Tm[(base + i) * L::ldf + base + c] = s;
    }
  }
  for (int idx = tid; idx < kDRows * kDRows; idx += kDThreads) {  // blocks above the block diagonal: 0
    const int i = idx >> 6, j = idx & 63;
    if ((j >> 4) > (i >> 4)) Tm[i * L::ldf + j] = 0.f;
  }
  __syncthreads();
#pragma unroll 1
  for (int bi = 1; bi < 4; ++bi) {
    for (int idx = tid; idx < bi * 256; idx += kDThreads) {  // Xb[j] = sum_{j <= k < bi} A_{bi,k} T_{k,j}
      const int j = idx >> 8, r = (idx >> 4) & 15, c = idx & 15;
      const float* arow = Aab + (16 * bi + r) * L::ldf;
      float s = 0.f;
      for (int m = 16 * j; m < 16 * bi; ++m) s = fmaf(arow[m], Tm[m * L::ldf + 16 * j + c], s);
      Xb[idx] = s;
    }
    __syncthreads();
    for (int idx = tid; idx < bi * 256; idx += kDThreads) {  // T_{bi,j} = T_{bi,bi} Xb[j]
      const int j = idx >> 8, r = (idx >> 4) & 15, c = idx & 15;
      const float* trow = Tm + (16 * bi + r) * L::ldf + 16 * bi;
      float s = 0.f;
#pragma unroll
      for (int m = 0; m < 16; ++m) s = fmaf(trow[m], Xb[(j << 8) + (m << 4) + c], s);
      Tm[(16 * bi + r) * L::ldf + 16 * j + c] = s;
    }
    __syncthreads();
  }
  for (int idx = tid; idx < kDRows * kDRows; idx += kDThreads) {
    const int i = idx >> 6, j = idx & 63;
    Tt[i * L::ld64 + j] = from_f<T>(Tm[i * L::ldf + j]);
  }
  // a e^Gp in place (a is no longer read by the scores); Kd, Bd, G, D_n to the workspace.
  const float* Gn = sG + len * L::ldg;  // G_{len-1}
  for (int idx = tid; idx < kDRows * KP; idx += kDThreads) {
    const int i = idx / KP, d = idx - i * KP;
    sa[i * L::ldk + d] = from_f<T>(to_f(sa[i * L::ldk + d]) * exp_t<T>(sG[i * L::ldg + d]));
    if (i < len) {
      const int64_t w = ((ch.row0 + i) * x.H + h) * KP + d;
      const float gi = sG[(i + 1) * L::ldg + d];
      const float f = exp_t<T>(Gn[d] - gi);
      x.Kd[w] = from_f<T>(to_f(sk[i * L::ldk + d]) * f);
      x.Bd[w] = from_f<T>(to_f(sb[i * L::ldk + d]) * f);
      x.G[w] = gi;
    }
  }
  for (int d = tid; d < KP; d += kDThreads)
    x.Dn[(blockIdx.x * x.H + h) * KP + d] = d < K ? exp_t<T>(Gn[d]) : 0.f;
  __syncthreads();

  // W = T (a e^Gp): warp w owns rows [16 w, 16 w + 16), 64 columns at a time.
#pragma unroll 1
  for (int n0 = 0; n0 < KP; n0 += 64) {
    float acc[1][8][4];
    zero_acc(acc);
    warp_mma<T, 1, 8, Lay::rowmajor, Lay::rowmajor>(acc, Tt, L::ld64, 16 * warp, sa, L::ldk, n0, 0, kDRows);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + acc_row(0, e), d = n0 + acc_col(nt, e);
        if (i < len) x.W[((ch.row0 + i) * x.H + h) * KP + d] = from_f<T>(acc[0][nt][e]);
      }
  }
  // T A_ak, into A_ak's tile once every warp has read it.
  {
    float acc[1][8][4];
    zero_acc(acc);
    warp_mma<T, 1, 8, Lay::rowmajor, Lay::rowmajor>(acc, Tt, L::ld64, 16 * warp, Ak, L::ld64, 0, 0, kDRows);
    __syncthreads();
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) Ak[(16 * warp + acc_row(0, e)) * L::ld64 + acc_col(nt, e)] = from_f<T>(acc[0][nt][e]);
    __syncthreads();
  }
  // U = (T A_ak) V, 32 value columns at a time (V tile in the scratch: T is no longer needed in fp32).
  const T* pv = x.v.at(ch.batch, ch.t0, h);
#pragma unroll 1
  for (int v0 = 0; v0 < x.VP; v0 += kDBV) {
    load_tile<T, kDThreads>(Vt, L::ldv, pv + v0, x.v.st, len, kDRows, static_cast<int>(x.V) - v0, kDBV,
                            vec_ok(pv + v0, x.v.st));
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    float acc[1][4][4];
    zero_acc(acc);
    warp_mma<T, 1, 4, Lay::rowmajor, Lay::rowmajor>(acc, Ak, L::ld64, 16 * warp, Vt, L::ldv, 0, 0, kDRows);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + acc_row(0, e), c = v0 + acc_col(nt, e);
        if (i < len) x.U[((ch.row0 + i) * x.H + h) * x.VP + c] = from_f<T>(acc[0][nt][e]);
      }
    __syncthreads();
  }
}

// ---- stage 2: the state scan --------------------------------------------------------------------------------
template <class T, int KP>
__global__ void __launch_bounds__(kDThreads) dplr_scan_kernel(const DplrArgs<T> x) {
  using L = ScanSmem<T, KP>;
  constexpr int MT = KP / 64;  // 16-row tiles of the state per warp
  extern __shared__ __align__(16) unsigned char smem[];
  T* sW = smem_at<T>(smem, L::W);
  T* sKd = smem_at<T>(smem, L::Kd);
  T* sBd = smem_at<T>(smem, L::Bd);
  T* sU = smem_at<T>(smem, L::U);
  T* sV = smem_at<T>(smem, L::V);
  T* sUt = smem_at<T>(smem, L::Ut);
  T* sS = smem_at<T>(smem, L::S);
  float* sDn = smem_at<float>(smem, L::Dn);

  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t nh = blockIdx.x, n = nh / x.H, h = nh - n * x.H;
  const int v0 = blockIdx.y * kDBV;
  const int m0 = warp * (KP / 4);  // this warp's first state row
  const SeqEntry seq = x.seqs[n];
  const int64_t state0 = (n * x.H + h) * x.K * x.V;

  float S[MT][4][4];
  load_acc(S, x.h0 == nullptr ? nullptr : x.h0 + state0 + v0, x.V, m0, static_cast<int>(x.K),
           static_cast<int>(x.V) - v0);

#pragma unroll 1
  for (int64_t ci = 0; ci < seq.num_chunks; ++ci) {
    const int64_t c = seq.first_chunk + ci;
    const ChunkEntry ch = x.chunks[c];
    const int len = static_cast<int>(ch.len);
    const int64_t wrow = (ch.row0 * x.H + h);
    const int64_t ldk_g = x.H * KP, ldv_g = x.H * x.VP;
    load_tile<T, kDThreads>(sW, L::ldk, x.W + wrow * KP, ldk_g, len, kDRows, KP, KP, vec_ok(x.W + wrow * KP, ldk_g));
    load_tile<T, kDThreads>(sKd, L::ldk, x.Kd + wrow * KP, ldk_g, len, kDRows, KP, KP,
                            vec_ok(x.Kd + wrow * KP, ldk_g));
    load_tile<T, kDThreads>(sBd, L::ldk, x.Bd + wrow * KP, ldk_g, len, kDRows, KP, KP,
                            vec_ok(x.Bd + wrow * KP, ldk_g));
    load_tile<T, kDThreads>(sU, L::ldv, x.U + wrow * x.VP + v0, ldv_g, len, kDRows, kDBV, kDBV,
                            vec_ok(x.U + wrow * x.VP + v0, ldv_g));
    const T* pv = x.v.at(ch.batch, ch.t0, h) + v0;
    load_tile<T, kDThreads>(sV, L::ldv, pv, x.v.st, len, kDRows, static_cast<int>(x.V) - v0, kDBV, vec_ok(pv, x.v.st));
    cp_async_commit();
    for (int d = tid; d < KP; d += kDThreads) sDn[d] = x.Dn[(c * x.H + h) * KP + d];
    // The chunk-start state: a T operand in shared memory, and h_c in the workspace.
    T* hc = x.h + (c * x.H + h) * KP * x.VP + v0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int r = m0 + acc_row(mt, e), col = acc_col(nt, e);
          store_pair(sS + r * L::ldv + col, S[mt][nt][e], S[mt][nt][e + 1]);
          store_pair(hc + int64_t(r) * x.VP + col, S[mt][nt][e], S[mt][nt][e + 1]);
        }
    cp_async_wait<0>();
    __syncthreads();

    // Ut = U + W S: warp w owns rows [16 w, 16 w + 16).
    {
      float acc[1][4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][nt][e] = to_f(sU[(16 * warp + acc_row(0, e)) * L::ldv + acc_col(nt, e)]);
      warp_mma<T, 1, 4, Lay::rowmajor, Lay::rowmajor>(acc, sW, L::ldk, 16 * warp, sS, L::ldv, 0, 0, KP);
      T* ut = x.Ut + wrow * x.VP + v0;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int i = 16 * warp + acc_row(0, e), col = acc_col(nt, e);
          store_pair(sUt + i * L::ldv + col, acc[0][nt][e], acc[0][nt][e + 1]);
          if (i < len) store_pair(ut + int64_t(i) * ldv_g + col, acc[0][nt][e], acc[0][nt][e + 1]);
        }
    }
    __syncthreads();

    // S' = D_n S + Kd^T V + Bd^T Ut (Kd, Bd read as [key, token]: column-major A operands).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[mt][nt][e] *= sDn[m0 + acc_row(mt, e)];
    warp_mma<T, MT, 4, Lay::colmajor, Lay::rowmajor>(S, sKd, L::ldk, m0, sV, L::ldv, 0, 0, kDRows);
    warp_mma<T, MT, 4, Lay::colmajor, Lay::rowmajor>(S, sBd, L::ldk, m0, sUt, L::ldv, 0, 0, kDRows);
    __syncthreads();  // the next chunk's loads overwrite the tiles
  }
  if (x.ht != nullptr) store_acc(S, x.ht + state0 + v0, x.V, m0, static_cast<int>(x.K), static_cast<int>(x.V) - v0);
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
  {
    const T* pq = x.q.at(ch.batch, ch.t0, h);
    const T* pk = x.k.at(ch.batch, ch.t0, h);
    const T* pb = x.b.at(ch.batch, ch.t0, h);
    load_tile<T, kDThreads>(sq, L::ldk, pq, x.q.st, len, kDRows, K, KP, vec_ok(pq, x.q.st));
    load_tile<T, kDThreads>(sk, L::ldk, pk, x.k.st, len, kDRows, K, KP, vec_ok(pk, x.k.st));
    load_tile<T, kDThreads>(sb, L::ldk, pb, x.b.st, len, kDRows, K, KP, vec_ok(pb, x.b.st));
    cp_async_commit();
    // G rows past len repeat G_{len-1} (finite exponents on the zero rows).
    for (int idx = tid; idx < kDRows * KP; idx += kDThreads) {
      const int i = idx / KP, d = idx - i * KP;
      sG[i * L::ldg + d] = x.G[(wrow + int64_t(min(i, len - 1)) * x.H) * KP + d];
    }
    for (int idx = tid; idx < kDRows * L::ld64; idx += kDThreads) {
      Pk[idx] = from_f<T>(0.f);
      Pb[idx] = from_f<T>(0.f);
    }
    cp_async_wait<0>();
    __syncthreads();
  }
  const bool with_o = x.o.ptr != nullptr;  // false: the dh0-only backward's preparation (QG, P_qb only)
  if (with_o)
    dplr_scores<T, kDThreads>(sq, sk, L::ldk, sG, sG, L::ldg, Xr, Yr, KP, len, true,
                              [&](int i, int j, float val) { Pk[i * L::ld64 + j] = from_f<T>(val); });
  dplr_scores<T, kDThreads>(sq, sb, L::ldk, sG, sG, L::ldg, Xr, Yr, KP, len, true,
                            [&](int i, int j, float val) { Pb[i * L::ld64 + j] = from_f<T>(val); });
  // q e^G in place.
  for (int idx = tid; idx < kDRows * KP; idx += kDThreads) {
    const int i = idx / KP, d = idx - i * KP;
    const T qg = from_f<T>(to_f(sq[i * L::ldk + d]) * exp_t<T>(sG[i * L::ldg + d]));
    sq[i * L::ldk + d] = qg;
    if (x.QG != nullptr && i < len) x.QG[(wrow + int64_t(i) * x.H) * KP + d] = qg;
  }
  if (x.Pb != nullptr)
    for (int idx = tid; idx < kDRows * kDRows; idx += kDThreads)
      x.Pb[(c * x.H + h) * kDRows * kDRows + idx] = Pb[(idx >> 6) * L::ld64 + (idx & 63)];
  if (!with_o) return;  // uniform over the CTA
  __syncthreads();

  const T* hc = x.h + (c * x.H + h) * KP * x.VP;
  const T* pv = x.v.at(ch.batch, ch.t0, h);
  const T* put = x.Ut + wrow * x.VP;
  const int64_t ldv_g = x.H * x.VP;
#pragma unroll 1
  for (int v0 = 0; v0 < x.VP; v0 += kDBV) {
    load_tile<T, kDThreads>(sh, L::ldv, hc + v0, x.VP, KP, KP, kDBV, kDBV, vec_ok(hc + v0, x.VP));
    load_tile<T, kDThreads>(sv, L::ldv, pv + v0, x.v.st, len, kDRows, static_cast<int>(x.V) - v0, kDBV,
                            vec_ok(pv + v0, x.v.st));
    load_tile<T, kDThreads>(sut, L::ldv, put + v0, ldv_g, len, kDRows, kDBV, kDBV, vec_ok(put + v0, ldv_g));
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    float acc[1][4][4];
    zero_acc(acc);
    warp_mma<T, 1, 4, Lay::rowmajor, Lay::rowmajor>(acc, sq, L::ldk, 16 * warp, sh, L::ldv, 0, 0, KP);
    warp_mma<T, 1, 4, Lay::rowmajor, Lay::rowmajor>(acc, Pk, L::ld64, 16 * warp, sv, L::ldv, 0, 0, kDRows);
    warp_mma<T, 1, 4, Lay::rowmajor, Lay::rowmajor>(acc, Pb, L::ld64, 16 * warp, sut, L::ldv, 0, 0, kDRows);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + acc_row(0, e), col = v0 + acc_col(nt, e);
        if (i < len && col < x.V) store_f(x.o.at(ch.batch, ch.t0 + i, h) + col, x.scale * acc[0][nt][e]);
      }
    __syncthreads();
  }
}

// ---- the dh0-only backward: the reverse state-gradient scan ---------------------------------------------------
// With dS = dL/dS at a chunk's end (dht at the sequence's end), the chunk form's backward (chunk_backward in
// reference/src/chunked.cpp) gives the gradient at the chunk's start as
//   dUt = P_qb^T (scale dO) + Bd dS          (dL/dUt, the low-rank read-outs)
//   dS' = D_n dS + (q e^G)^T (scale dO) + W^T dUt
// and dh0 is dS' of a sequence's first chunk. The mirror of dplr_scan_kernel: the 32 columns of dS in fp32
// registers, sequential over the chunks from the last; W, Bd, D_n from the WY stage, q e^G and P_qb from the
// output stage run without o. This is the first stage of the tiled DPLR backward (the full one also needs
// dS and dUt per chunk, which this kernel has in hand) and what the CP backward pre-pass runs.
template <class T, int KP>
struct Dh0Smem {
  static constexpr int ldk = tile_ld<T>(KP), ld64 = tile_ld<T>(64), ldv = tile_ld<T>(kDBV);
  static constexpr int64_t tileK = align16(int64_t(kDRows) * ldk * sizeof(T));
  static constexpr int64_t tileV = align16(int64_t(kDRows) * ldv * sizeof(T));
  static constexpr int64_t W = 0, Bd = W + tileK, QG = Bd + tileK;
  static constexpr int64_t P = QG + tileK;
  static constexpr int64_t dO = P + align16(int64_t(kDRows) * ld64 * sizeof(T));
  static constexpr int64_t dUt = dO + tileV;
  static constexpr int64_t S = dUt + tileV;
  static constexpr int64_t Dn = S + align16(int64_t(KP) * ldv * sizeof(T));
  static constexpr int64_t bytes = Dn + align16(int64_t(KP) * 4);
};

template <class T, int KP>
__global__ void __launch_bounds__(kDThreads) dplr_dh0_scan_kernel(const DplrArgs<T> x) {
  using L = Dh0Smem<T, KP>;
  constexpr int MT = KP / 64;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sW = smem_at<T>(smem, L::W);
  T* sBd = smem_at<T>(smem, L::Bd);
  T* sQG = smem_at<T>(smem, L::QG);
  T* sP = smem_at<T>(smem, L::P);
  T* sdO = smem_at<T>(smem, L::dO);
  T* sdUt = smem_at<T>(smem, L::dUt);
  T* sS = smem_at<T>(smem, L::S);
  float* sDn = smem_at<float>(smem, L::Dn);

  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t nh = blockIdx.x, n = nh / x.H, h = nh - n * x.H;
  const int v0 = blockIdx.y * kDBV;
  const int m0 = warp * (KP / 4);
  const SeqEntry seq = x.seqs[n];
  const int64_t state0 = (n * x.H + h) * x.K * x.V;
  const int K = static_cast<int>(x.K), Vleft = static_cast<int>(x.V) - v0;

  float S[MT][4][4];  // dL/dS, rows [m0, m0 + KP/4), 32 columns from v0
  load_acc(S, x.dht == nullptr ? nullptr : x.dht + state0 + v0, x.V, m0, K, Vleft);

#pragma unroll 1
  for (int64_t ci = seq.num_chunks - 1; ci >= 0; --ci) {
    const int64_t c = seq.first_chunk + ci;
    const ChunkEntry ch = x.chunks[c];
    const int len = static_cast<int>(ch.len);
    const int64_t wrow = ch.row0 * x.H + h;
    const int64_t ldk_g = x.H * KP;
    load_tile<T, kDThreads>(sW, L::ldk, x.W + wrow * KP, ldk_g, len, kDRows, KP, KP, vec_ok(x.W + wrow * KP, ldk_g));
    load_tile<T, kDThreads>(sBd, L::ldk, x.Bd + wrow * KP, ldk_g, len, kDRows, KP, KP,
                            vec_ok(x.Bd + wrow * KP, ldk_g));
    load_tile<T, kDThreads>(sQG, L::ldk, x.QG + wrow * KP, ldk_g, len, kDRows, KP, KP,
                            vec_ok(x.QG + wrow * KP, ldk_g));
    const T* pP = x.Pb + (c * x.H + h) * kDRows * kDRows;
    load_tile<T, kDThreads>(sP, L::ld64, pP, kDRows, kDRows, kDRows, kDRows, kDRows, vec_ok(pP, kDRows));
    const T* pdo = x.dout.at(ch.batch, ch.t0, h) + v0;
    load_tile<T, kDThreads>(sdO, L::ldv, pdo, x.dout.st, len, kDRows, Vleft, kDBV, vec_ok(pdo, x.dout.st));
    cp_async_commit();
    for (int d = tid; d < KP; d += kDThreads) sDn[d] = x.Dn[(c * x.H + h) * KP + d];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          store_pair(sS + (m0 + acc_row(mt, e)) * L::ldv + acc_col(nt, e), S[mt][nt][e], S[mt][nt][e + 1]);
    cp_async_wait<0>();
    __syncthreads();
    for (int idx = tid; idx < kDRows * kDBV; idx += kDThreads) {  // scale dO, in place
      T* e = sdO + (idx / kDBV) * L::ldv + (idx % kDBV);
      *e = from_f<T>(x.scale * to_f(*e));
    }
    __syncthreads();

    // dUt = P_qb^T (scale dO) + Bd dS: warp w owns rows [16 w, 16 w + 16) (P_qb read as [j, i]: column-major).
    {
      float acc[1][4][4];
      zero_acc(acc);
      warp_mma<T, 1, 4, Lay::colmajor, Lay::rowmajor>(acc, sP, L::ld64, 16 * warp, sdO, L::ldv, 0, 0, kDRows);
      warp_mma<T, 1, 4, Lay::rowmajor, Lay::rowmajor>(acc, sBd, L::ldk, 16 * warp, sS, L::ldv, 0, 0, KP);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2)
          store_pair(sdUt + (16 * warp + acc_row(0, e)) * L::ldv + acc_col(nt, e), acc[0][nt][e], acc[0][nt][e + 1]);
    }
    __syncthreads();

    // dS <- D_n dS + (q e^G)^T (scale dO) + W^T dUt.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[mt][nt][e] *= sDn[m0 + acc_row(mt, e)];
    warp_mma<T, MT, 4, Lay::colmajor, Lay::rowmajor>(S, sQG, L::ldk, m0, sdO, L::ldv, 0, 0, kDRows);
    warp_mma<T, MT, 4, Lay::colmajor, Lay::rowmajor>(S, sW, L::ldk, m0, sdUt, L::ldv, 0, 0, kDRows);
    __syncthreads();  // the next chunk's loads overwrite the tiles
  }
  store_acc(S, x.dh0 + state0 + v0, x.V, m0, K, Vleft);
}

// ---- host ------------------------------------------------------------------------------------------------------
template <class Kernel>
void dplr_prepare_smem(Kernel kernel, int64_t bytes, const Params& p, const char* stage) {
  const int limit = max_smem_optin();
  if (bytes > limit)
    throw_error("K", "the tiled DPLR ", stage, " needs ", bytes, " bytes of shared memory for K = ", p.K,
                " and dtype ", to_string(p.dtype), "; this GPU allows ", limit,
                " (use the naive tier, or 16-bit inputs)");
  DELTACP_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
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
    void* p = workspace_alloc(static_cast<size_t>(elems) * sizeof(E), stream_);
    ptrs_[n_++] = p;
    return static_cast<E*>(p);
  }

 private:
  cudaStream_t stream_;
  void* ptrs_[10] = {};
  int n_ = 0;
};

// dh0_only: the dh0-only backward of p (Params::dh0_only), else p's forward.
template <class T, int KP>
void run_dplr(const Params& p, cudaStream_t stream, bool dh0_only) {
  const ChunkTable table(p, p.chunk_size, stream);
  const int64_t R = p.B * p.T, H = p.H, C = table.num_chunks();
  const int VP = static_cast<int>((p.V + kDBV - 1) / kDBV * kDBV);
  DELTACP_CHECK(H <= 65535, "H", "expected at most 65535 heads for the tiled DPLR tier, got ", H);
  DELTACP_CHECK(p.num_seqs * H <= 0x7fffffff, "num_seqs", "expected num_seqs * H < 2^31, got ", p.num_seqs * H);
  DplrWorkspace ws(stream);
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
  x.H = H;
  x.K = p.K;
  x.V = p.V;
  x.VP = VP;
  x.scale = static_cast<float>(p.scale);
  x.G = ws.get<float>(R * H * KP);
  x.W = ws.get<T>(R * H * KP);
  x.Kd = ws.get<T>(R * H * KP);
  x.Bd = ws.get<T>(R * H * KP);
  x.U = ws.get<T>(R * H * VP);
  x.Dn = ws.get<float>(C * H * KP);
  if (dh0_only) {
    x.QG = ws.get<T>(R * H * KP);
    x.Pb = ws.get<T>(C * H * kDRows * kDRows);
    x.dout = dev_rows<const T>(p.dout);
    x.dht = static_cast<const float*>(p.dht);
    x.dh0 = static_cast<float*>(p.dh0);
  } else {
    x.o = dev_rows<T>(p.o);
    x.Ut = ws.get<T>(R * H * VP);
    x.h = ws.get<T>(C * H * KP * VP);
    x.h0 = static_cast<const float*>(p.h0);
    x.ht = static_cast<float*>(p.ht);
  }
  const dim3 per_chunk(static_cast<unsigned>(C), static_cast<unsigned>(H));
  const dim3 per_seq(static_cast<unsigned>(p.num_seqs * H), static_cast<unsigned>(VP / kDBV));

  if (C > 0) {
    const auto wy = dplr_wy_kernel<T, KP>;
    dplr_prepare_smem(wy, WySmem<T, KP>::bytes, p, "WY stage");
    wy<<<per_chunk, kDThreads, WySmem<T, KP>::bytes, stream>>>(x);
    DELTACP_CUDA_CHECK_LAUNCH();
  }
  if (dh0_only) {
    if (C > 0) {  // the output stage without o: q e^G and P_qb for the reverse scan
      const auto out = dplr_output_kernel<T, KP>;
      dplr_prepare_smem(out, OutSmem<T, KP>::bytes, p, "output stage");
      out<<<per_chunk, kDThreads, OutSmem<T, KP>::bytes, stream>>>(x);
      DELTACP_CUDA_CHECK_LAUNCH();
    }
    if (p.num_seqs > 0) {
      const auto scan = dplr_dh0_scan_kernel<T, KP>;
      dplr_prepare_smem(scan, Dh0Smem<T, KP>::bytes, p, "dh0 scan");
      scan<<<per_seq, kDThreads, Dh0Smem<T, KP>::bytes, stream>>>(x);
      DELTACP_CUDA_CHECK_LAUNCH();
    }
    return;
  }
  if (p.num_seqs > 0) {
    const auto scan = dplr_scan_kernel<T, KP>;
    dplr_prepare_smem(scan, ScanSmem<T, KP>::bytes, p, "state scan");
    scan<<<per_seq, kDThreads, ScanSmem<T, KP>::bytes, stream>>>(x);
    DELTACP_CUDA_CHECK_LAUNCH();
  }
  if (C > 0 && p.o.defined()) {
    const auto out = dplr_output_kernel<T, KP>;
    dplr_prepare_smem(out, OutSmem<T, KP>::bytes, p, "output stage");
    out<<<per_chunk, kDThreads, OutSmem<T, KP>::bytes, stream>>>(x);
    DELTACP_CUDA_CHECK_LAUNCH();
  }
}

void check_dplr_tiled(const Params& p) {
  DELTACP_CHECK(p.variant == Variant::dplr, "variant", "expected dplr for the tiled DPLR kernels, got ",
                to_string(p.variant));
  DELTACP_CHECK(p.K >= 1 && p.K <= 128, "K", "expected 1 <= K <= 128 for the tiled DPLR kernels, got ", p.K);
  DELTACP_CHECK(p.chunk_size >= 1 && p.chunk_size <= kDRows, "chunk_size",
                "expected 1 <= chunk_size <= 64 for the tiled DPLR kernels, got ", p.chunk_size);
  DELTACP_CHECK(p.V + kDBV <= 65535LL * kDBV, "V", "expected V < ", 65535LL * kDBV, ", got ", p.V);
}

void run_dplr_any(const Params& p, bool dh0_only) {
  check_dplr_tiled(p);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (p.K <= 64) {
      run_dplr<T, 64>(p, stream, dh0_only);
    } else {
      run_dplr<T, 128>(p, stream, dh0_only);
    }
  });
}

}  // namespace

void tiled_dplr_forward(const Params& p) { run_dplr_any(p, false); }

void tiled_dplr_dh0(const Params& p) {
  DELTACP_CHECK(p.dh0_only(), "dh0", "expected a dh0-only backward (dh0 given, every input gradient null) for the "
                "tiled DPLR backward; the full tiled DPLR backward does not exist yet (use the naive tier)");
  run_dplr_any(p, true);
}

}  // namespace deltacp::cuda::tiled

namespace deltacp::cuda {
void tiled_dplr_forward(const Params& p) { tiled::tiled_dplr_forward(p); }
void tiled_dplr_dh0(const Params& p) { tiled::tiled_dplr_dh0(p); }
}  // namespace deltacp::cuda
