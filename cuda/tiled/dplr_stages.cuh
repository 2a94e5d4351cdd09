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
__device__ __forceinline__ float load_gate(const DplrArgs<T>& x, int64_t b, int64_t t, int64_t h, int64_t d) {
  const int64_t off = b * x.gk_sb + t * x.gk_st + h * x.gk_sh + d;
  return x.gk_fp32 ? static_cast<const float*>(x.gk)[off] : to_f(static_cast<const T*>(x.gk)[off]);
}
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
  const int64_t mat0 = (int64_t(blockIdx.x) * x.H + h) * kDRows * kDRows;  // this chunk's 64 x 64 matrices
  for (int idx = tid; idx < kDRows * kDRows; idx += kDThreads) {
    const int i = idx >> 6, j = idx & 63;
    const T t = from_f<T>(Tm[i * L::ldf + j]);
    Tt[i * L::ld64 + j] = t;
    if (x.Tg != nullptr) {  // the full backward keeps T and A_ak (A_ak's tile is overwritten by T A_ak below)
      x.Tg[mat0 + idx] = t;
      x.Akg[mat0 + idx] = Ak[i * L::ld64 + j];
    }
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
    // The chunk-start state: a T operand in shared memory, and h_c in the workspace (for the output stage and
    // the backward; a final-state-only run, the CP pre-pass's maps, keeps none: x.h null).
    T* hc = x.h == nullptr ? nullptr : x.h + (c * x.H + h) * KP * x.VP + v0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int r = m0 + acc_row(mt, e), col = acc_col(nt, e);
          store_pair(sS + r * L::ldv + col, S[mt][nt][e], S[mt][nt][e + 1]);
          if (hc != nullptr) store_pair(hc + int64_t(r) * x.VP + col, S[mt][nt][e], S[mt][nt][e + 1]);
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
      T* ut = x.Ut == nullptr ? nullptr : x.Ut + wrow * x.VP + v0;  // null: final-state-only, as h
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int i = 16 * warp + acc_row(0, e), col = acc_col(nt, e);
          store_pair(sUt + i * L::ldv + col, acc[0][nt][e], acc[0][nt][e + 1]);
          if (ut != nullptr && i < len) store_pair(ut + int64_t(i) * ldv_g + col, acc[0][nt][e], acc[0][nt][e + 1]);
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
  const bool with_o = x.o.ptr != nullptr;  // false: the backward's preparation (q e^G, P_qb; P_qk when x.Pk)
  if (with_o || x.Pk != nullptr)
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
  if (x.Pk != nullptr)  // the full backward
    for (int idx = tid; idx < kDRows * kDRows; idx += kDThreads)
      x.Pk[(c * x.H + h) * kDRows * kDRows + idx] = Pk[(idx >> 6) * L::ld64 + (idx & 63)];
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

// ---- the reverse state-gradient scan (the dh0-only backward, and stage 4 of the full one) ---------------------
// With dS = dL/dS at a chunk's end (dht at the sequence's end), the chunk form's backward (chunk_backward in
// reference/src/chunked.cpp) gives the gradient at the chunk's start as
//   dUt = P_qb^T (scale dO) + Bd dS          (dL/dUt, the low-rank read-outs)
//   dS' = D_n dS + (q e^G)^T (scale dO) + W^T dUt
// and dh0 is dS' of a sequence's first chunk. The mirror of dplr_scan_kernel: the 32 columns of dS in fp32
// registers, sequential over the chunks from the last; W, Bd, D_n from the WY stage, q e^G and P_qb from the
// output stage run without o. Alone it is the dh0-only backward (the CP backward pre-pass); in the full backward
// (dplr_bwd.cu) it also keeps dS at each chunk's end (x.dh) and dUt (x.dUt) for the chunk-parallel stages.
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
    // dS at the chunk's end: a T operand in shared memory and, for the full backward, dh_c in the workspace.
    T* dhc = x.dh == nullptr ? nullptr : x.dh + (c * x.H + h) * KP * x.VP + v0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int r = m0 + acc_row(mt, e), col = acc_col(nt, e);
          store_pair(sS + r * L::ldv + col, S[mt][nt][e], S[mt][nt][e + 1]);
          if (dhc != nullptr) store_pair(dhc + int64_t(r) * x.VP + col, S[mt][nt][e], S[mt][nt][e + 1]);
        }
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
      T* dut = x.dUt == nullptr ? nullptr : x.dUt + wrow * x.VP + v0;  // the full backward keeps dUt
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          const int i = 16 * warp + acc_row(0, e), col = acc_col(nt, e);
          store_pair(sdUt + i * L::ldv + col, acc[0][nt][e], acc[0][nt][e + 1]);
          if (dut != nullptr && i < len)
            store_pair(dut + int64_t(i) * x.H * x.VP + col, acc[0][nt][e], acc[0][nt][e + 1]);
        }
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
  if (x.dh0 != nullptr) store_acc(S, x.dh0 + state0 + v0, x.V, m0, K, Vleft);
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

// dplr_bwd_dk_kernel, one CTA per (chunk, head, 32 key columns): the q, k, a, b columns, G (65 rows: row 0 = 0,
// row i + 1 = G_i), the fp32 gradients dq, dk, da, db of those columns, then one region used three times: per
// value block dO, T^T dUt, V, Ut (64 rows) and S, dS (32 rows); then two of the four score gradients at a time
// (the two of q's scores, then the two of a's) and a scratch tile. Two at a time keeps 16-bit inputs within
// sm_86 / sm_89's 99 KB (all four: 108,688 bytes).
template <class T>
struct BdkSmem {
  static constexpr int ldx = tile_ld<T>(kDKB), ldf = kDKB + 4, ldg = gate_ld(kDKB);
  static constexpr int ld64 = tile_ld<T>(64), ldv = tile_ld<T>(kDBV);
  static constexpr int64_t tileX = align16(int64_t(kDRows) * ldx * sizeof(T));
  static constexpr int64_t tileF = align16(int64_t(kDRows) * ldf * 4);
  static constexpr int64_t q = 0, k = q + tileX, a = k + tileX, b = a + tileX;
  static constexpr int64_t G = b + tileX;
  static constexpr int64_t dq = G + align16(int64_t(kDRows + 1) * ldg * 4);
  static constexpr int64_t dk = dq + tileF, da = dk + tileF, db = da + tileF;
  static constexpr int64_t region = db + tileF;
  // value phase
  static constexpr int64_t tileV = align16(int64_t(kDRows) * ldv * sizeof(T));
  static constexpr int64_t tileS = align16(int64_t(kDKB) * ldv * sizeof(T));
  static constexpr int64_t dO = region, dUtp = dO + tileV, V = dUtp + tileV, Ut = V + tileV;
  static constexpr int64_t S = Ut + tileV, dS = S + tileS;
  static constexpr int64_t value_end = dS + tileS;
  // key phase
  static constexpr int64_t tileM = align16(int64_t(kDRows) * ld64 * sizeof(T));
  static constexpr int64_t dM = region;  // 2 tiles: dM_qk, dM_qb, then dA_ab, dA_ak
  static constexpr int64_t scr = dM + 2 * tileM;
  static constexpr int64_t key_end = scr + tileX;
  static constexpr int64_t bytes = value_end > key_end ? value_end : key_end;
};

// ---- host ------------------------------------------------------------------------------------------------------
template <class Kernel>
void dplr_prepare_smem(Kernel kernel, int64_t bytes, const Params& p, const char* stage) {
  opt_in_smem(kernel, bytes, "K", "the tiled DPLR ", stage, " needs ", bytes, " bytes of shared memory for K = ", p.K,
              " and dtype ", to_string(p.dtype), " (use the naive tier, or 16-bit inputs)");
}

// One stage: its shared memory checked and opted into (dplr_prepare_smem), then launched with kDThreads threads.
template <class Kernel, class Args>
void dplr_launch(Kernel kernel, int64_t bytes, dim3 grid, const Params& p, const char* stage, cudaStream_t stream,
                 const Args& x) {
  dplr_prepare_smem(kernel, bytes, p, stage);
  kernel<<<grid, kDThreads, static_cast<size_t>(bytes), stream>>>(x);
  DELTACP_CUDA_CHECK_LAUNCH();
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
