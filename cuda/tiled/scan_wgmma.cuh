// cuda/tiled/scan_wgmma.cuh — stage 3 of the tiled forward (the state scan) on Hopper's warpgroup
// tensor-core instruction wgmma (sm_90a). Included by tiled_fwd.cu, which falls back to the mma.sync
// scan (chunk_state_scan_kernel there) wherever this one does not apply.
//
// Algorithm: the same chunk step as chunk_state_scan_kernel (DESIGN.md section 3), written for the
// transposed state S^T (state columns x key rows) so that both products of a step take their left
// operand straight from registers:
//
//   (b)  Vn^T  = U^T - S^T W^T         wgmma m64n64k16,  A = bf16(S^T) (registers), B = W   (K-major)
//   (c)  S^T  <- D_n S^T + Vns^T Kd    wgmma m64n128k16, A = bf16(Vns^T) (registers), B = Kd (MN-major)
//
// with Vns = Vn e^(G_n - G) per token for gdn (Vn for kda, whose Kd = K e^(G_n - G) comes from stage
// 2). One warpgroup (4 warps) owns 64 state columns, all 128 key rows, as the fp32 accumulator of
// step (c) (64 registers per thread). The accumulator layout of one product is the register-A layout
// of the next after a bf16 conversion (the trick FlashAttention-3 uses for P V), so a step needs no
// shared-memory round trip for S or Vn and no barrier between its products: the only shared-memory
// operands are the chunk's W and K tiles, which every warpgroup of the CTA reads once per step
// (mma.sync re-reads them per warp: four times the shared-memory traffic).
//
// Layouts: W and K tiles (64 tokens x 128 key dims, 16-bit) are stored as two 64-column blocks of
// 64 rows x 128 B with the 128-byte swizzle (16-byte piece j of row r at piece j ^ (r % 8)), filled
// by cp.async, two stages deep. W is the K-major B operand of (b) (descriptor: SBO = 1024 B between
// 8-row groups; a k-step of 16 key dims advances the start address by 32 B inside the swizzle atom).
// K is the MN-major ("transposed") B operand of (c) (LBO = 8192 B between the two 64-column blocks,
// SBO = 1024 B between 8-token groups; a k-step of 16 tokens advances 2048 B). U^T enters through
// ldmatrix.trans; h_c and v_new leave through stmatrix.trans into a staging tile, then 16-byte stores
// of whole 128-byte rows issued while the next product runs (issued right before a wgmma.fence, the
// stores held it until their registers drained: the step's top stall in Nsight Compute; one bulk copy
// per row through the copy engine was slower still).
//
// Applies to 16-bit inputs with K = 128 (Kp = 128) on a compute capability 9.0 device in a build
// with sm_90a code (DELTACP_HAVE_SM90A), when h and v_new are stored both or neither, and (gdn, delta)
// when k's pointer and strides are 16-byte aligned (wgmma_scan_refusal in tiled_fwd.cu). By default it
// runs where its grid is wide enough to beat the mma.sync scan (use_wgmma_scan says why);
// DELTACP_TILED_SCAN_WGMMA=0 turns it off, =1 requires it, and with the switch unset, forcing the
// mma.sync scan's tile (DELTACP_TILED_SCAN_BV / _STAGES) selects that scan. DELTACP_TILED_SCAN_WG=1|2
// forces the warpgroups per CTA (default 2, sharing one copy of W and K; 1 for a state of <= 64 columns).
// Builds list sm_90a for Hopper (DELTACP_CUDA_ARCHS "80;90a"): a list with plain 90 as well as 90a is
// not supported (the driver could pick the sm_90 image, where this kernel only traps).
//
// Measured (H200, 2026-11-22, bench/gpu/bench_scan.py, bf16 GDN, ms of this kernel per forward):
// the CP pre-pass's pieces (4 x 8192 tokens, 16 heads, 256 state columns, final state only) 0.261
// (mma.sync scan 0.486); (4, 4096, 64, 128) with h and v_new stored 0.439 (0.690). With a narrow grid
// (one 32K-token sequence, 16 heads: 16 CTAs) it is slower, 1.667 against 1.046: a chunk step takes
// ~2 us in either kernel, ~1170 instructions per warp at 3-5 cycles each with one warp per scheduler
// (Nsight Compute, H100), so the launcher keeps the mma.sync scan there.
//
// Numerics: the same roundings as the mma.sync scan (S and Vns to 16 bits for the products, fp32
// accumulation, fp32 state, the k-steps in the same order). At every shape of bench_scan.py the
// outputs came out bit-identical to the mma.sync scan's; the test requires bf16 agreement only
// (tests/python/test_cuda.py::test_wgmma_scan_matches_the_mma_sync_scan).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "fwd_mma.cuh"
#include "wgmma_ops.cuh"


namespace deltacp::cuda::tiled {

constexpr int kWgKeys = 128;  // key rows of the state this scan handles (K = Kp = 128)
constexpr int kWgCols = 64;   // state columns per warpgroup
constexpr int kWgLdStage = 72;  // leading dimension (elements) of the h / v_new staging tiles

// Shared memory of one CTA (offsets from a 1024-byte aligned base; the swizzled tiles need it).
struct WgScanLayout {
  int w, k, u, gbuf;  // stage 0's buffers; stage s adds s * stage
  int stage;
  int ldu;            // U tile leading dimension (elements)
  int hs, vs;         // per-warpgroup staging of h_c (128 x 64) and v_new (64 x 64); -1 when not stored
  int bytes;          // everything, plus 1024 bytes of slack for the alignment
};
__host__ __device__ inline WgScanLayout wg_scan_layout(int nwg, int esize, bool store_h) {
  auto up = [](int x, int a) { return (x + a - 1) / a * a; };
  WgScanLayout L;
  L.ldu = kWgCols * nwg + 8;
  int o = 0;
  L.w = o;
  o += 64 * 2 * 128;  // two blocks of 64 rows x 128 B
  L.k = o;
  o += 64 * 2 * 128;
  L.u = o;
  o += up(64 * L.ldu * esize, 128);
  L.gbuf = o;
  o += kWgKeys * 4;  // gdn: G of the chunk's rows; kda: G of its last row per key dimension
  L.stage = up(o, 1024);
  o = 2 * L.stage;
  L.hs = L.vs = -1;
  if (store_h) {
    L.hs = o;
    o += nwg * kWgKeys * kWgLdStage * esize;
    L.vs = o;
    o += nwg * 64 * kWgLdStage * esize;
  }
  L.bytes = o + 1024;
  return L;
}


// One CTA of NWG warpgroups per (sequence, value head, 64 NWG state columns), sequential over the
// sequence's chunks. Arguments as chunk_state_scan_kernel's.
template <class T, bool kKda, int NWG>
__global__ void __launch_bounds__(128 * NWG, 1)
    chunk_state_scan_wgmma_kernel(FwdArgs<T> args, const float* __restrict__ G, const T* __restrict__ W,
                                  const T* __restrict__ U, const T* __restrict__ Kd, T* __restrict__ h,
                                  T* __restrict__ vnew, const float* __restrict__ h0,
                                  float* __restrict__ ht) {
#ifdef DELTACP_WGMMA_DEVICE
  constexpr int kThr = 128 * NWG, BVC = kWgCols * NWG;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const WgScanLayout L = wg_scan_layout(NWG, sizeof(T), h != nullptr);

  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, wi = wtid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t n = blockIdx.x, hv = blockIdx.y, HV = args.HV, K = args.K, V = args.V;
  const int Vp = args.Vp;
  const int v0 = blockIdx.z * BVC;     // the CTA's first state column
  const int vw = v0 + kWgCols * wg;    // this warpgroup's first state column
  const int jr = 16 * wi + g;          // this thread's rows of S^T: jr and jr + 8 (state columns vw + ...)
  const int64_t hk = hv / args.group;
  const SeqEntry se = args.seqs[n];
  const int cs = args.chunk_size;

  // S^T in the m64n128 accumulator layout: S[4 nb + e] = state (key row 8 nb + 2 t + (e & 1),
  // column vw + jr + 8 (e >> 1)).
  const int64_t state0 = (n * HV + hv) * K * V;
  float S[64];
#pragma unroll
  for (int nb = 0; nb < 16; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t col = vw + jr + 8 * (e >> 1), d = 8 * nb + 2 * t + (e & 1);
      S[4 * nb + e] = (h0 != nullptr && col < V) ? h0[state0 + d * V + col] : 0.f;
    }

  auto chunk_row0 = [&](int64_t c) { return args.ws_row0 + se.batch * args.Tlen + se.bos + c * cs; };
  auto chunk_len = [&](int64_t c) { return static_cast<int>(min(static_cast<int64_t>(cs), se.len - c * cs)); };
  const int u_valid = max(0, min(BVC, args.u_cols - v0));  // columns of the CTA's U tile that read U
  auto issue = [&](int64_t c) {
    const int64_t row0 = chunk_row0(c);
    const int len = chunk_len(c);
    unsigned char* st = smem + static_cast<int>(c & 1) * L.stage;
    load_tile_sw128<T, kThr>(st + L.w, W + (row0 * HV + hv) * kWgKeys, HV * kWgKeys, len);
    if constexpr (kKda) {
      load_tile_sw128<T, kThr>(st + L.k, Kd + (row0 * HV + hv) * kWgKeys, HV * kWgKeys, len);
    } else {
      load_tile_sw128<T, kThr>(st + L.k, args.k.at(se.batch, se.bos + c * cs, hk), args.k.st, len);
    }
    if (u_valid > 0 || c < 2)  // a tile past u_cols is zero: zeroed once per stage buffer
      load_tile_u<T, kThr, BVC>(reinterpret_cast<T*>(st + L.u), L.ldu, U + (row0 * HV + hv) * args.Up + v0,
                                HV * args.Up, len, u_valid);
    float* gbuf = reinterpret_cast<float*>(st + L.gbuf);
    if constexpr (kKda) {
      if (tid < kWgKeys) cp_async_4(gbuf + tid, G + ((row0 + len - 1) * HV + hv) * K + tid);
    } else if (tid < 64) {
      if (args.has_gate) {
        cp_async_4(gbuf + tid, G + (row0 + min(tid, len - 1)) * HV + hv);
      } else {
        gbuf[tid] = 0.f;
      }
    }
    cp_async_commit();
  };
  T* hs = L.hs >= 0 ? reinterpret_cast<T*>(smem + L.hs) + wg * kWgKeys * kWgLdStage : nullptr;
  T* vs = L.vs >= 0 ? reinterpret_cast<T*>(smem + L.vs) + wg * 64 * kWgLdStage : nullptr;
  // stmatrix row addresses: lane -> matrix q = lane / 8 (n-block parity q / 2, row half q % 2), row lane % 8.
  const int sq = lane >> 3, srr = lane & 7;
  const int srow = 8 * (sq >> 1) + srr, scol = 16 * wi + 8 * (sq & 1);

  const int64_t nchunks = se.num_chunks;
  if (nchunks > 0) issue(0);
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t row0 = chunk_row0(c);
    const int len = chunk_len(c);
    const int64_t fc = se.first_chunk + c;
    const unsigned char* st = smem + static_cast<int>(c & 1) * L.stage;
    if (c + 1 < nchunks) {
      issue(c + 1);  // stage (c + 1) % 2 was released by the barrier that ended chunk c - 1
    } else {
      cp_async_commit();
    }
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    const float* gbuf = reinterpret_cast<const float*>(st + L.gbuf);
    const T* Us = reinterpret_cast<const T*>(st + L.u);

    // (a) S^T -> 16-bit A fragments: k-step kk = key rows 16 kk .. 16 kk + 15 (n-blocks 2 kk, 2 kk + 1).
    uint32_t sa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) sa[kk][r] = pack2<T>(S[8 * kk + 2 * r], S[8 * kk + 2 * r + 1]);
    if (hs != nullptr) {  // h_c = S (16-bit), staged key rows x 64 columns
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) stmatrix_x4_trans(hs + (16 * kk + srow) * kWgLdStage + scol, sa[kk]);
      warpgroup_bar(wg);  // stored below, while (b) runs
    }

    // (b) Va = S^T W^T (64 state columns x 64 tokens).
    float Va[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) Va[i] = 0.f;
    const uint32_t w_addr = smem_u32(st + L.w), k_addr = smem_u32(st + L.k);
    wg_fence();
    reg_fence(Va);
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_n64_rs<T>(Va, sa[kk], wg_desc(w_addr + (kk >> 2) * 8192 + (kk & 3) * 32, 16, 1024), kk > 0);
    wg_commit();
    if (hs != nullptr) {  // 128-byte row pieces of the staged h_c, 8 per thread
      const int d0 = wtid >> 3, pc = (wtid & 7) * 8;
      if (vw + pc < Vp) {
        T* hdst = h + ((fc * HV + hv) * kWgKeys + d0) * Vp + vw + pc;
#pragma unroll
        for (int it = 0; it < kWgKeys / 16; ++it)
          *reinterpret_cast<uint4*>(hdst + static_cast<int64_t>(16 * it) * Vp) =
              *reinterpret_cast<const uint4*>(hs + (d0 + 16 * it) * kWgLdStage + pc);
      }
    }
    wg_wait_all();
    reg_fence(Va);
    reg_fence(sa);

    // Vn^T = U^T - Va (U^T fragments straight from the U tile through ldmatrix.trans); v_new out;
    // Vns^T = Vn^T e^(G_n - G_i) (gdn) -> the A fragments of (c).
    u_minus_acc_trans<T>(Va, Us, L.ldu, kWgCols * wg, srow, scol);
    const bool store_vnew = vs != nullptr && vnew != nullptr;
    if (store_vnew) {  // staged tokens x 64 columns
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        const uint32_t r[4] = {pack2<T>(Va[8 * np], Va[8 * np + 1]), pack2<T>(Va[8 * np + 2], Va[8 * np + 3]),
                               pack2<T>(Va[8 * np + 4], Va[8 * np + 5]), pack2<T>(Va[8 * np + 6], Va[8 * np + 7])};
        stmatrix_x4_trans(vs + (16 * np + srow) * kWgLdStage + scol, r);
      }
      warpgroup_bar(wg);  // stored below, while (c) runs
    }
    float glast = 0.f;
    if constexpr (!kKda) glast = gbuf[len - 1];
    uint32_t va[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      float f0 = 1.f, f1 = 1.f, f2 = 1.f, f3 = 1.f;  // tokens 16 kk + 2 t (+1), 16 kk + 8 + 2 t (+1)
      if constexpr (!kKda) {
        const float2 ga = *reinterpret_cast<const float2*>(gbuf + 16 * kk + 2 * t);
        const float2 gb = *reinterpret_cast<const float2*>(gbuf + 16 * kk + 8 + 2 * t);
        f0 = exp_t<T>(glast - ga.x);
        f1 = exp_t<T>(glast - ga.y);
        f2 = exp_t<T>(glast - gb.x);
        f3 = exp_t<T>(glast - gb.y);
      }
      va[kk][0] = pack2<T>(Va[8 * kk] * f0, Va[8 * kk + 1] * f1);
      va[kk][1] = pack2<T>(Va[8 * kk + 2] * f0, Va[8 * kk + 3] * f1);
      va[kk][2] = pack2<T>(Va[8 * kk + 4] * f2, Va[8 * kk + 5] * f3);
      va[kk][3] = pack2<T>(Va[8 * kk + 6] * f2, Va[8 * kk + 7] * f3);
    }

    // (c) S^T = D_n S^T + Vns^T Kd.
    if constexpr (kKda) {
#pragma unroll
      for (int nb = 0; nb < 16; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[4 * nb + e] *= exp_t<T>(gbuf[8 * nb + 2 * t + (e & 1)]);
    } else {
      const float eg = exp_t<T>(glast);
#pragma unroll
      for (int i = 0; i < 64; ++i) S[i] *= eg;
    }
    wg_fence();
    reg_fence(S);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_n128_rs_tb<T>(S, va[kk], wg_desc(k_addr + kk * 2048, 8192, 1024));
    wg_commit();
    if (store_vnew) {  // 128-byte row pieces of the staged v_new, rows of the chunk only
      const int i0 = wtid >> 3, pc = (wtid & 7) * 8;
      if (vw + pc < Vp) {
#pragma unroll
        for (int it = 0; it < 4; ++it) {
          const int i = i0 + 16 * it;
          if (i < len)
            *reinterpret_cast<uint4*>(vnew + ((row0 + i) * HV + hv) * Vp + vw + pc) =
                *reinterpret_cast<const uint4*>(vs + i * kWgLdStage + pc);
        }
      }
    }
    wg_wait_all();
    reg_fence(S);
    reg_fence(va);
    __syncthreads();  // this stage, and the staging tiles, are free
  }

  if (ht != nullptr) {
#pragma unroll
    for (int nb = 0; nb < 16; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t col = vw + jr + 8 * (e >> 1), d = 8 * nb + 2 * t + (e & 1);
        if (col < V) ht[state0 + d * V + col] = S[4 * nb + e];
      }
  }
#else
  __trap();  // never launched: the host selects this kernel only for builds with sm_90a code
#endif
}

}  // namespace deltacp::cuda::tiled
