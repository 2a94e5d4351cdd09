// cuda/tiled/bwd_dh_scan_wgmma.cuh — backward stage B1 (the reverse state-gradient scan) on Hopper:
// dS in wgmma accumulators, every tile brought in by TMA. Launched instead of bwd_dh_scan_kernel
// (bwd_dh_scan.cuh, the same algebra on mma.sync) where it applies: gdn, delta and kda, bf16 / fp16,
// K = V = 128, compute capability 9.0 (dh_scan_wgmma_refusal says why not). kda reads its gated tiles as the
// mma.sync scan does: Kr = Kd (the forward's K e^(Gn - G)) and Q*Gam = Qg (stage B0's Q e^G) come by TMA in
// place of k and q, the per-token factors below are 1, and dS' decays by e^(Gn_d) per key row d.
//
// Walking the chunks of one sequence from last to first, with dS' = dL/d(end state of the chunk) (dht, or 0,
// for the last chunk), G the chunk's cumulative log decay and Gn its last value:
//
//   dh[c]  = dS'                                             (for stage B2, rounded to the input dtype)
//   dVn    = dVn_local + diag(e^(Gn - G)) K dS'              (dVn_local from stage B0; written over it)
//   dS     = e^Gn dS' + scale (Q e^G)^T dO - W^T dVn         (= dS' of the previous chunk)
//   dh0    = dS of the first chunk
//
// The same design as the fused forward's chain (cuda/fused/fused_chain.cuh), mirrored:
//   CTA       one or two warpgroups (128 threads each) per (sequence or piece, value head, 64 or 128 state
//             columns): each holds dS^T of its 64 columns x 128 key rows as an fp32 m64n128 accumulator (64
//             registers per thread), so the products that read dS' take it from registers as the A operand;
//             two share one copy of each chunk's K, Q, W tiles (dh_scan_warpgroups picks the count)
//   loads     by TMA, three chunks in flight (two with two warpgroups): K, Q, W (64 tokens x 128 keys, two
//             64 x 64 boxes each, 128-byte swizzle) and dO's 64 columns per warpgroup (one box); dVn_local
//             (fp32, padded rows) and G by cp.async. Rows n .. 63 of a chunk of n < 64 tokens are zeroed in
//             shared memory, as masked loads leave them
//   per chunk ("rs": A from registers)
//     (1) X^T = dS'^T K^T                       8 x wgmma m64n64k16 rs
//         meanwhile: the next loads, B1^T = scale e^(G_i) dO^T (dO^T by ldmatrix.trans from the swizzled
//         box) and the factors e^(Gn - G_i)
//     (2) dVn^T = dVn_local^T + e^(Gn - G_i) X^T, staged over dVn_local
//     (3) dS^T = e^Gn dS'^T + B1^T Q - dVn^T W   8 x wgmma m64n128k16 rs (Q and W MN-major)
//         meanwhile: dh[c] = dS' staged through the K tile (free once (1) is done; stmatrix.trans, swizzled
//         rows; the second warpgroup's in the two dO boxes), then dh[c] and dVn stored as 16-byte pieces of
//         whole rows
//   Only (1), (2) and (3) are on the chain of dependent steps; what "meanwhile" lists runs in their shadow.
//   With Args::handoff (bwd_handoff.cuh) each CTA counts itself in when it starts and, one step after it, the
//   chunk whose dh and dVn it stored, for the chunk-local kernel running beside it.
//   So dS never leaves the SM; per chunk it reads q, k, W, dO, dVn_local and writes dh and dVn, as the
//   mma.sync scan does, but at one TMA instruction per 8 KB tile and 3x fewer product instructions.
//
// Shared memory: a stage is K, Q, W (16 KB each), per warpgroup dO (8 KB) and dVn_local (64 x 68 floats:
// 17 KB), G (256 B), rounded to 1 KB: one warpgroup 74 KB x 3 stages = 222 KB (of the 227 KB an H100 / H200
// block may take), two 99 KB x 2 = 198 KB. One CTA per SM.
//
// Measured (NVIDIA H200, 2026-11-25, bf16 gdn, bench/gpu/stage_times.py --backward, kernel time per call):
// (2,16384,16,128) 0.724 ms with one warpgroup per CTA (64 CTAs x 256 chunks: 2.8 us a step; two per CTA:
// 1.11), against 1.06 for the mma.sync scan; (1,8192,96,128) 0.542 with two (one: 0.78; mma.sync 1.77);
// (4,4096,64,128) 0.697 with two (one: 0.94); (1,65536,8,128) 3.01 (16 CTAs x 1024 chunks: the few-heads
// case, which pieces would spread over the GPU as the forward does). Before dVn was staged and the loads moved
// behind (1): 1.04 ms at (2,16384,16,128), of which the element-by-element dVn stores took 0.23.
// bf16 kda (NVIDIA H100, 2026-11-27, same measure): (2,16384,16,128) 0.723 ms against 0.99 for the mma.sync
// scan (the per-key decay of dS costs nothing visible beside gdn's scalar one).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "../common/check.h"
#include "../common/device_info.h"
#include "../common/kernel_switch.h"
#include "../common/tma.cuh"
#include "bwd_common.cuh"
#include "wgmma_ops.cuh"

namespace deltacp::cuda::tiled::bwd {

constexpr int kDhKeys = 128;  // K = V = 128
constexpr int kDhCols = 64;   // state columns per CTA
constexpr int kDhPF = kDhCols + 4;  // dVn_local's padded row (floats): conflict-free accumulator-layout reads

struct DhWgArgs {
  TileMap16 tm_k, tm_q;  // [B, T, H, 128] as the caller strides them (kda: the [R, HV, 128] workspaces Kd and
                         // Qg): boxes of 64 keys x 64 tokens
  TileMap16 tm_w;        // [R, HV, 128] workspace
  TileMap16 tm_do;       // [B, T, HV, 128] dO: boxes of 64 columns x 64 tokens
  Args a;
};

// CTAs per (sequence, value head): the grid's z, one per 64 NWG state columns (the handoff counts on it too).
__host__ __device__ constexpr int dh_scan_col_blocks(int nwg) { return kDhKeys / (kDhCols * nwg); }

// Load stages: three chunks in flight with one warpgroup per CTA, two with two (what shared memory allows).
__host__ __device__ constexpr int dh_wg_stages(int nwg) { return nwg == 1 ? 3 : 2; }

// Offsets from a 1024-byte aligned base; stage s adds s * stage. Within a stage: K, Q, W (two 64 x 64 boxes
// each), dO (a box per warpgroup), then per warpgroup dVn_local (64 x kDhPF floats), then G.
template <int NWG>
struct DhWgLayout {
  static constexpr int kBlock = 64 * 128;  // one 64 x 64 box of 16-bit elements
  static constexpr int k = 0, q = 2 * kBlock, w = 4 * kBlock, dO = 6 * kBlock, blocks = 6 + NWG;
  static constexpr int dvl = blocks * kBlock, dvl_bytes = 64 * kDhPF * 4;
  static constexpr int g = dvl + NWG * dvl_bytes;
  static constexpr int stage = (g + 128 * 4 + 1023) / 1024 * 1024;  // G: 64 rows (gdn) or 128 keys (kda)
  static constexpr int stages = dh_wg_stages(NWG);
  static constexpr int bar = stages * stage;
  static constexpr int bytes = bar + 8 * stages + 1024;  // + slack for the alignment
};

#ifdef DELTACP_WGMMA_DEVICE
// X = box^T for an m64n64 accumulator (64 columns of this CTA x 64 tokens) from a 64 x 64 box of 16-bit rows
// with the 128-byte swizzle, by ldmatrix.trans (srow, scol as in fused_chain.cuh's u_minus_acc_trans_sw128).
template <class T>
__device__ __forceinline__ void acc_from_box_trans_sw128(float (&X)[32], const unsigned char* box, int srow, int scol) {
  const int piece = scol >> 3;
#pragma unroll
  for (int np = 0; np < 4; ++np) {
    const int row = 16 * np + srow;
    uint32_t u[4];
    ldmatrix_x4_trans(u, box + row * 128 + ((piece ^ (row & 7)) << 4));
#pragma unroll
    for (int qq = 0; qq < 4; ++qq) {
      const float2 f = unpack2<T>(u[qq]);
      X[8 * np + 2 * qq] = f.x;
      X[8 * np + 2 * qq + 1] = f.y;
    }
  }
}
#endif

// One CTA of NWG warpgroups per (sequence or piece, value head, 64 NWG state columns); the warpgroups of a CTA
// share one copy of each chunk's K, Q and W tiles (the file comment gives the steps).
// kKda: K and Q come as kda's Kd = K e^(Gn - G) and Qg = Q e^G (the forward's WY stage, stage B0), so the
// per-token factors of (1)-(3) are 1, and dS' decays by e^(Gn) per key row (G's last row of the chunk, 128 floats).
template <class T, int NWG, bool kKda>
__global__ void __launch_bounds__(128 * NWG, 1) bwd_dh_scan_wgmma_kernel(const __grid_constant__ DhWgArgs args) {
#ifdef DELTACP_WGMMA_DEVICE
  using L = DhWgLayout<NWG>;
  constexpr int kStages = L::stages, kThr = 128 * NWG;
  const Args& a = args.a;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::bar);

  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, wi = wtid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t n = blockIdx.x, hv = blockIdx.y, HV = a.HV;
  const int v0 = blockIdx.z * kDhCols * NWG;  // the CTA's first state column
  const int vw = v0 + kDhCols * wg;           // this warpgroup's first state column
  const int jr = 16 * wi + g;                 // this thread's rows of dS^T (columns of dS): vw + jr, + 8
  const int hk = static_cast<int>(hv / a.group);
  const SeqEntry se = a.seqs[n];
  const int cs = a.chunk_size;
  const bool store = !a.dh0_only;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(bars + s, 1);
    fence_mbar_init();
    if (a.handoff.started != nullptr) atomicAdd(a.handoff.started, 1);  // the gate's count (bwd_handoff.cuh)
  }
  if (tid == 0 && se.num_chunks > 0) {
    tma_prefetch_map(&args.tm_k.map);
    tma_prefetch_map(&args.tm_q.map);
    tma_prefetch_map(&args.tm_w.map);
    tma_prefetch_map(&args.tm_do.map);
  }

  // dS^T in the m64n128 accumulator layout: D[4 nb + e] = dS(key row 8 nb + 2 t + (e & 1), column vw + jr +
  // 8 (e >> 1)).
  const int64_t state0 = (n * HV + hv) * kDhKeys * kDhKeys;
  float D[64];
#pragma unroll
  for (int nb = 0; nb < 16; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t col = vw + jr + 8 * (e >> 1), d = 8 * nb + 2 * t + (e & 1);
      D[4 * nb + e] = a.dht != nullptr ? a.dht[state0 + d * kDhKeys + col] : 0.f;
    }
  __syncthreads();  // the barriers are initialised

  const int64_t nchunks = se.num_chunks;
  auto chunk_of = [&](int64_t it) { return nchunks - 1 - it; };  // step it walks chunk nchunks - 1 - it
  auto chunk_row0 = [&](int64_t c) { return se.batch * a.T + se.bos + c * cs; };
  auto chunk_len = [&](int64_t c) { return static_cast<int>(min(static_cast<int64_t>(cs), se.len - c * cs)); };
  // Step it's loads into stage it % kStages (its previous readers are past the barrier that ended them).
  auto issue = [&](int64_t it) {
    const int64_t c = chunk_of(it), row0 = chunk_row0(c), t0 = se.bos + c * cs;
    const int len = chunk_len(c);
    unsigned char* st = smem + static_cast<int>(it % kStages) * L::stage;
    uint64_t* bar = bars + it % kStages;
    if (tid == 0) {
      const int r = static_cast<int>(row0), tt = static_cast<int>(t0), b = static_cast<int>(se.batch);
      const int h = static_cast<int>(hv);
      fence_proxy_async();  // generic writes of this stage's last use (zeroed rows, staged dh) before the copies
      mbar_expect_tx(bar, L::blocks * L::kBlock);
      if constexpr (kKda) {  // the workspaces' rows of this value head
        tma_load_3d(st + L::k, &args.tm_k.map, bar, 0, h, r);
        tma_load_3d(st + L::k + L::kBlock, &args.tm_k.map, bar, 64, h, r);
        tma_load_3d(st + L::q, &args.tm_q.map, bar, 0, h, r);
        tma_load_3d(st + L::q + L::kBlock, &args.tm_q.map, bar, 64, h, r);
      } else {
        tma_load_4d(st + L::k, &args.tm_k.map, bar, 0, hk, tt, b);
        tma_load_4d(st + L::k + L::kBlock, &args.tm_k.map, bar, 64, hk, tt, b);
        tma_load_4d(st + L::q, &args.tm_q.map, bar, 0, hk, tt, b);
        tma_load_4d(st + L::q + L::kBlock, &args.tm_q.map, bar, 64, hk, tt, b);
      }
      tma_load_3d(st + L::w, &args.tm_w.map, bar, 0, h, r);
      tma_load_3d(st + L::w + L::kBlock, &args.tm_w.map, bar, 64, h, r);
#pragma unroll
      for (int u = 0; u < NWG; ++u)
        tma_load_4d(st + L::dO + u * L::kBlock, &args.tm_do.map, bar, v0 + 64 * u, h, tt, b);
    }
    // This warpgroup's dVn_local: 64 rows x 64 floats as 16-byte pieces (8 per thread); rows >= len zero.
    float* dvl = reinterpret_cast<float*>(st + L::dvl + wg * L::dvl_bytes);
    const int pc = wtid & 15, r0 = wtid >> 4;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int i = r0 + 8 * k;
      float* dst = dvl + i * kDhPF + 4 * pc;
      if (i < len) {
        cp_async_16(dst, a.dvnew + ((row0 + i) * HV + hv) * a.V + vw + 4 * pc);
      } else {
        *reinterpret_cast<float4*>(dst) = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    float* gbuf = reinterpret_cast<float*>(st + L::g);
    if constexpr (kKda) {  // G of the chunk's last row, per key
      if (tid < 32) cp_async_16(gbuf + 4 * tid, a.G + ((row0 + len - 1) * HV + hv) * kDhKeys + 4 * tid);
    } else if (tid < 64) {
      if (a.gated) {
        cp_async_4(gbuf + tid, a.G + (row0 + min(tid, len - 1)) * HV + hv);
      } else {
        gbuf[tid] = 0.f;
      }
    }
    cp_async_commit();
  };

  // stmatrix / ldmatrix row addresses: lane -> matrix q = lane / 8 (n-block parity q / 2, row half q % 2).
  const int sq = lane >> 3, srr = lane & 7;
  const int srow = 8 * (sq >> 1) + srr, scol = 16 * wi + 8 * (sq & 1);

#pragma unroll
  for (int it = 0; it + 1 < kStages; ++it) {
    if (it < nchunks) {
      issue(it);
    } else {
      cp_async_commit();
    }
  }
  for (int64_t it = 0; it < nchunks; ++it) {
    const int64_t c = chunk_of(it), row0 = chunk_row0(c);
    const int len = chunk_len(c);
    unsigned char* st = smem + static_cast<int>(it % kStages) * L::stage;
    cp_async_wait<kStages - 2>();  // this step's group (the next one's may be in flight)
    mbar_wait(bars + it % kStages, static_cast<uint32_t>((it / kStages) & 1));
    if (len < 64) {  // rows len .. 63 of every box: zero, as masked loads would have left them
      for (int idx = tid; idx < L::blocks * 64 * 8; idx += kThr) {
        const int row = (idx >> 3) & 63;
        if (row >= len) *reinterpret_cast<uint4*>(st + idx * 16) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    fence_proxy_async();
    __syncthreads();
    const float* gbuf = reinterpret_cast<const float*>(st + L::g);
    float* dvl = reinterpret_cast<float*>(st + L::dvl + wg * L::dvl_bytes);
    const uint32_t k_addr = smem_u32(st + L::k), q_addr = smem_u32(st + L::q), w_addr = smem_u32(st + L::w);

    // (1) X^T = dS'^T K^T, A = 16-bit dS'^T from registers.
    float X[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) X[i] = 0.f;
    uint32_t sa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) sa[kk][r] = pack2<T>(D[8 * kk + 2 * r], D[8 * kk + 2 * r + 1]);
    wg_fence();
    reg_fence(X);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const uint32_t off = (kk >> 2) * L::kBlock + (kk & 3) * 32;
      wgmma_n64_rs<T>(X, sa[kk], wg_desc(k_addr + off, 16, 1024), kk > 0);
    }
    wg_commit();
    // Meanwhile, off the chain of dependent products: with a handoff, the chunk-local kernel's go for the previous
    // step's chunk (its dh and dVn stores, every thread's, behind the two barriers since, released here: before
    // this step's loads are issued, so that the fence has no fresh load of this thread to wait for), ...
    if (a.handoff.ready != nullptr && tid == 0 && it > 0)
      release_add(a.handoff.ready + (se.first_chunk + chunk_of(it - 1)) * HV + hv);
    // ... the loads of step it + kStages - 1 into the stage the last step freed (issued here rather than before
    // (1), they no longer delay it), ...
    if (it + kStages - 1 < nchunks) {
      issue(it + kStages - 1);
    } else {
      cp_async_commit();
    }
    // ... B1^T = scale e^(G_i) dO^T as A fragments (token i = 8 nb + 2 t + (e & 1) of element 4 nb + e) and
    // the factors e^(Gn - G_i) of step (2).
    const float glast = kKda ? 0.f : gbuf[len - 1];
    uint32_t b1[4][4];
    {
      float B[32];
      acc_from_box_trans_sw128<T>(B, st + L::dO + wg * L::kBlock, srow, scol);
#pragma unroll
      for (int nb = 0; nb < 8; ++nb) {
        const float2 gi = kKda ? make_float2(0.f, 0.f) : *reinterpret_cast<const float2*>(gbuf + 8 * nb + 2 * t);
        const float f0 = kKda ? a.scale : a.scale * exp_t<T>(gi.x), f1 = kKda ? a.scale : a.scale * exp_t<T>(gi.y);
        B[4 * nb] *= f0;
        B[4 * nb + 1] *= f1;
        B[4 * nb + 2] *= f0;
        B[4 * nb + 3] *= f1;
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) b1[kk][r] = pack2<T>(B[8 * kk + 2 * r], B[8 * kk + 2 * r + 1]);
    }
    float fk[16];  // e^(Gn - G_i) for the tokens 8 nb + 2 t and 8 nb + 2 t + 1 of this thread's elements
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
      if constexpr (kKda) {  // Kd carries its decay
        fk[2 * nb] = fk[2 * nb + 1] = 1.f;
      } else {
        const float2 gi = *reinterpret_cast<const float2*>(gbuf + 8 * nb + 2 * t);
        fk[2 * nb] = exp_t<T>(glast - gi.x);
        fk[2 * nb + 1] = exp_t<T>(glast - gi.y);
      }
    }
    wg_wait_all();
    reg_fence(X);
    reg_fence(sa);

    // (2) dVn^T = dVn_local^T + e^(Gn - G_i) X^T, written over dVn_local in shared memory (each element by the
    // thread that read it) and stored from there during (3); X <- -dVn^T, the second product's operand.
    // (Stored element by element from registers here, dVn cost 0.9 us of a 4 us step: H200, (2,16384,16,128).)
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 8 * nb + 2 * t + (e & 1), v = jr + 8 * (e >> 1);
        const float dvn = i < len ? dvl[i * kDhPF + v] + fk[2 * nb + (e & 1)] * X[4 * nb + e] : 0.f;
        dvl[i * kDhPF + v] = dvn;
        X[4 * nb + e] = -dvn;
      }
    }
    uint32_t b2[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) b2[kk][r] = pack2<T>(X[8 * kk + 2 * r], X[8 * kk + 2 * r + 1]);

    // (3) dS^T = e^Gn dS'^T + B1^T Q + B2^T W (kda: e^(Gn_d) on key row d = 8 nb + 2 t + (e & 1) of D[4 nb + e]).
    if constexpr (kKda) {
      scale_key_columns_exp<T>(D, gbuf);
    } else {
      const float eg = exp_t<T>(glast);
#pragma unroll
      for (int i = 0; i < 64; ++i) D[i] *= eg;
    }
    wg_fence();
    reg_fence(D);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_n128_rs_tb<T>(D, b1[kk], wg_desc(q_addr + kk * 2048, 8192, 1024));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_n128_rs_tb<T>(D, b2[kk], wg_desc(w_addr + kk * 2048, 8192, 1024));
    wg_commit();
    // While (3) runs: dh[c] = dS' (the 16-bit A fragments of (1)) staged as 128 key rows x 64 columns (the K
    // tile, free since (1) is done; the second warpgroup's in the two dO boxes, free since its B1 is made),
    // 16-byte piece p of row d at ((p ^ (d % 8)) << 4): stmatrix.trans turns the fragments' (column, key)
    // layout into (key, column) rows. Then dh[c] and dVn go out from the staged tiles as 16-byte pieces of
    // whole rows.
    unsigned char* dhs = st + (wg == 0 ? L::k : L::dO);
    if (store) {
      if constexpr (NWG == 1) {
        warpgroup_bar(0);  // every warp's part of (1) is done
      } else {
        __syncthreads();  // both warpgroups' (1) and B1 are done
      }
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        const int d = 16 * kk + srow, p = scol >> 3;
        stmatrix_x4_trans(dhs + d * 128 + ((p ^ (d & 7)) << 4), sa[kk]);
      }
      warpgroup_bar(wg);  // the staged tiles are complete
      {  // dVn: thread -> piece (wtid % 16) of token rows wtid / 16 + 8 j (Args::dvn16: rounded to 16 bits, over
         // the row's own fp32 bytes, which this warpgroup read for this chunk before (1))
        const int pc = wtid & 15;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int i = (wtid >> 4) + 8 * j;
          if (i >= len) continue;
          const float4 x = *reinterpret_cast<const float4*>(dvl + i * kDhPF + 4 * pc);
          if (a.dvn16) {
            *reinterpret_cast<uint2*>(reinterpret_cast<char*>(a.dvnew) + dvn16_at(row0 + i, hv, HV, a.V, vw + 4 * pc)) =
                make_uint2(pack2<T>(x.x, x.y), pack2<T>(x.z, x.w));
          } else {
            *reinterpret_cast<float4*>(a.dvnew + ((row0 + i) * HV + hv) * a.V + vw + 4 * pc) = x;
          }
        }
      }
      // dh: thread -> piece (wtid % 8) of key rows wtid / 8 + 16 j
      T* dh = static_cast<T*>(a.dh) + ((se.first_chunk + c) * HV + hv) * kDhKeys * kDhKeys + vw;
      const int p = wtid & 7;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int d = (wtid >> 3) + 16 * j;
        *reinterpret_cast<uint4*>(dh + d * kDhKeys + 8 * p) =
            *reinterpret_cast<const uint4*>(dhs + d * 128 + ((p ^ (d & 7)) << 4));
      }
    }
    wg_wait_all();
    reg_fence(D);
    reg_fence(b1);
    reg_fence(b2);
    __syncthreads();  // this stage is free
  }
  if (a.handoff.ready != nullptr && tid == 0 && nchunks > 0)
    release_add(a.handoff.ready + (se.first_chunk + chunk_of(nchunks - 1)) * HV + hv);

  if (a.dh0 != nullptr) {
#pragma unroll
    for (int nb = 0; nb < 16; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t col = vw + jr + 8 * (e >> 1), d = 8 * nb + 2 * t + (e & 1);
        a.dh0[state0 + d * kDhKeys + col] = D[4 * nb + e];
      }
  }
#else
  __trap();  // never launched: the host selects this kernel only for builds with sm_90a code
#endif
}

// ---- host ----------------------------------------------------------------------------------------
// Why the wgmma scan cannot run this backward (nullptr: it can). is16: the input dtype is bf16 or fp16.
inline const char* dh_scan_wgmma_refusal(const Args& a, bool is16, bool perkey) {
#ifndef DELTACP_HAVE_SM90A
  (void)a, (void)is16, (void)perkey;
  return "this build has no sm_90a code";
#else
  if (!is16) return "it takes bf16 or fp16 inputs";
  if (a.K != kDhKeys || a.V != kDhKeys || a.Kp != kDhKeys) return "it takes K = V = 128";
  if (a.B * a.T >= (int64_t{1} << 31)) return "TMA coordinates are 32-bit (B * T < 2^31)";
  // kda reads the workspaces Kd and Qg in place of k and q.
  for (const TensorRef* r : {&a.q, &a.k, &a.dout}) {
    if (perkey && r != &a.dout) continue;
    if (!rows_aligned16(*r, 2)) return "TMA reads q, k and dO in 16-byte pieces (a pointer or stride is not 16-byte aligned)";
    if (!steps_forward(*r, a.B, a.T, r == &a.dout ? a.HV : a.H))
      return "TMA reads q, k and dO through tensor maps, which need positive strides";
  }
  if (reinterpret_cast<uintptr_t>(a.dvnew) % 16 != 0 ||
      (a.dh != nullptr && reinterpret_cast<uintptr_t>(a.dh) % 16 != 0) ||
      (perkey && (reinterpret_cast<uintptr_t>(a.Kd) % 16 != 0 || reinterpret_cast<uintptr_t>(a.Qg) % 16 != 0)))
    return "the workspaces are not 16-byte aligned";
  if (device_attribute(cudaDevAttrComputeCapabilityMajor) != 9 ||
      device_attribute(cudaDevAttrComputeCapabilityMinor) != 0)
    return "it runs on compute capability 9.0 (H100 / H200) only";
  if (max_smem_optin() < DhWgLayout<1>::bytes || max_smem_optin() < DhWgLayout<2>::bytes)
    return "the GPU gives a block less shared memory than it needs";
  return nullptr;
#endif
}

// DELTACP_TILED_DH_WGMMA (common/kernel_switch.h): unset = where it applies; 0 = never (the mma.sync scan);
// 1 = required (an error names why it cannot run).
inline bool use_dh_scan_wgmma(const Args& a, bool is16, bool perkey) {
  return kernel_switch("DELTACP_TILED_DH_WGMMA", "the wgmma dh scan",
                       [&] { return dh_scan_wgmma_refusal(a, is16, perkey); });
}

// Warpgroups per CTA: two share one copy of each chunk's K, Q and W tiles and halve the CTAs, which pays once
// one warpgroup per CTA would fill the SMs (one CTA per SM); below that, one per CTA spreads the heads over
// twice the SMs. DELTACP_TILED_DH_WG=1 or 2 forces it.
inline int dh_scan_warpgroups(int64_t seqs_x_heads) {
  const char* env = std::getenv("DELTACP_TILED_DH_WG");
  if (env != nullptr && *env != '\0') {
    DELTACP_CHECK(std::string(env) == "1" || std::string(env) == "2", "DELTACP_TILED_DH_WG", "expected 1 or 2, got '",
                  env, "'");
    return std::atoi(env);
  }
  return 2 * seqs_x_heads >= sm_count() ? 2 : 1;
}

template <class T, bool kKda>
void launch_dh_scan_wgmma(const Args& a, int64_t num_seqs, cudaStream_t stream) {
  DhWgArgs w;
  w.a = a;
  const int64_t R = a.B * a.T;
  if (R > 0) {  // else no sequence has a chunk: the kernel only carries dht to dh0
    if constexpr (kKda) {
      w.tm_k = workspace_rows_map(a.Kd, R, a.HV, kDhKeys, "Kd");
      w.tm_q = workspace_rows_map(a.Qg, R, a.HV, kDhKeys, "Qg");
    } else {
      w.tm_k = token_rows_map(a.k, a.B, a.T, a.H, kDhKeys, "k");
      w.tm_q = token_rows_map(a.q, a.B, a.T, a.H, kDhKeys, "q");
    }
    w.tm_do = token_rows_map(a.dout, a.B, a.T, a.HV, kDhKeys, "do");
    w.tm_w = workspace_rows_map(a.W, R, a.HV, kDhKeys, "W");
  }
  DELTACP_CHECK(a.HV <= 65535, "HV", "expected at most 65535 value heads, got ", a.HV);
  const int nwg = dh_scan_warpgroups(num_seqs * a.HV);
  const int bytes = nwg == 2 ? DhWgLayout<2>::bytes : DhWgLayout<1>::bytes;
  auto kernel = nwg == 2 ? bwd_dh_scan_wgmma_kernel<T, 2, kKda> : bwd_dh_scan_wgmma_kernel<T, 1, kKda>;
  opt_in_smem(kernel, bytes, "K", "the wgmma dh scan needs ", bytes, " bytes of shared memory");
  const dim3 grid(static_cast<unsigned>(num_seqs), static_cast<unsigned>(a.HV),
                  static_cast<unsigned>(dh_scan_col_blocks(nwg)));
  kernel<<<grid, 128 * nwg, bytes, stream>>>(w);
  DELTACP_CUDA_CHECK_LAUNCH();
}

}  // namespace deltacp::cuda::tiled::bwd
