// cuda/fused/fused_one_kernel.cuh — the fused gdn / delta forward as one kernel: the WY stage of each chunk made
// on chip, beside the serial chain, so that W, U and P never go through HBM.
//
// The two-kernel fused forward (fused_fwd.cu) runs the wgmma WY stage (cuda/tiled/wy_wgmma.cuh) over every chunk
// first, writing W, U, P and the row scales (648 bytes per token and value head at K = V = 128), and the chain
// (fused_chain.cuh) reads them back: 2834 bytes per token-head in all. Here one CTA per (sequence, value head, 64
// state columns) does both, for K = V = 128:
//
//   warpgroup 0 (chain)  loads: thread 0 issues chunk c + 2's Q and K tiles (64 tokens x 128 keys, two 64 x 64
//                        boxes each) and the CTA's 64 columns of V by TMA, threads 0-63 its 64 values of G by
//                        cp.async, all completing on the input stage's mbarrier (3 stages);
//                        then chunk c's chain step, fused_chain_kernel's (1)-(4) unchanged, reading Q, K, G from
//                        the input stage and W, U, P and the row scales from the WY ring slot c % 2
//   warpgroup 1 (WY)     chunk c + 1 (its ring slot is free once chunk c - 1's step is done): wy_wgmma_kernel's
//                        steps on the input stage (Q K^T and K K^T, the masks and decays, the fp32 solve for T,
//                        W = T Beta e^G K, U = T Beta V for the CTA's 64 columns), the results written in the
//                        swizzled 64 x 64 boxes the chain's descriptors and ldmatrix read; beta read from global one
//                        chunk ahead into registers
//
// Synchronisation (mbarriers; each warpgroup keeps its own barrier for its internal steps, bar.sync 1 and 2):
//   in_full[s]   the stage's TMA bytes and the 64 threads' cp.async of G (cp.async.mbarrier.arrive.noinc): 65
//                arrivals and the transaction count; the WY warpgroup waits for it, the chain too (for G)
//   out_full[j]  the WY warpgroup's 128 threads after writing slot j (and fence.proxy.async for the chain's
//                wgmma reads)
//   out_empty[j] the chain's 128 threads once chunk c's products have read slot j: WY may write chunk c + 2 there
// The input stage of chunk c + 2 is the one chunk c - 1 used; the chain issues its loads at the start of step c,
// after its own barrier ended step c - 1 (and the WY step of chunk c - 1 ended before step c - 1 began).
//
// What stays on chip: S (fp32, registers of warpgroup 0), A and T (fp32, in the ring slot before W, U, P take
// their place), W, U (the CTA's columns), P and the row scales. What moves through HBM per token and value head
// (bf16): q, k (256 bytes each per CTA, two CTAs per head), G (4 per CTA), beta (2 per CTA), the CTA's v columns
// (128 each), o (256), and the cumsum's g in and G out (8): 1556 bytes at K = V = 128, against 2834 for the
// two-kernel forward with W and U, and 2066 in its T Beta form (notebooks/06_kernel_tiers.py counts them). The WY work
// (all but U's product) is done by both
// CTAs of a head.
//
// Numerics: the two-kernel forward's in its W, U form (DELTACP_FUSED_TBETA=0), bit for bit: the same products in
// the same order with the same roundings (W, U, P rounded to 16 bits where they were stored; the row scales of rows
// past a short chunk set to 1, the value the chain gave them).
//
// Measured (NVIDIA H200, bf16 gdn, plain call, 2026-11-28; bench/gpu/stage_times.py and the probe below): slower
// than the two kernels at every shape tried, so the forward runs it only when asked (DELTACP_FUSED_ONE_KERNEL=1).
//   (2,16384,16,128): 1.190 ms against 0.716 (chain 0.431 + WY 0.257 + cumsum 0.028); (4,4096,64,128): 1.179
//   against 0.911; (1,8192,96,128): 1.188 against 0.737; (4,2048,16,128): 0.154 against 0.135 (kernel times).
// Cycles per chunk at (2,16384,16,128): the WY warpgroup 7834 (waits 566, K K^T and Q K^T 1063, A 1686, the solve
// 2735, T's fragments 978, W, U, P 806); the chain's own work about 3800 (its loads 959, products 2742, output 106),
// and it waits 4033 for the WY warpgroup. Without the chain's products the WY warpgroup still took 6935: the two
// warpgroups hardly contend; one warpgroup's latency through a chunk's WY steps is the bound, about twice the
// chain's step. What would close it: the WY steps of alternate chunks on the two CTAs of a head (a cluster of two
// exchanging W, P, T Beta and the row scales through distributed shared memory), which halves the WY period per
// chunk; a second WY warpgroup per CTA does not fit (four input stages and three ring slots: about 330 KB).
//
// Shared memory (1024-byte aligned base): 3 input stages of 41 KB (Q, K, V's columns, G), 2 ring slots of 35 KB
// (A and T, then W, U, P; the row scales), beta and e^G of the WY chunk, the output staging tile (9 KB), seven
// mbarriers: 208,696 bytes with the alignment slack. One CTA of 256 threads per SM (registers: at most 255 each).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <algorithm>

#include "../common/check.h"
#include "../common/dev_rows.cuh"
#include "../common/device_info.h"
#include "../common/tma.cuh"
#include "../tiled/chunk_table.cuh"
#include "../tiled/fwd_mma.cuh"
#include "../tiled/wgmma_ops.cuh"
#include "../tiled/wy_solve.cuh"
#include "../tiled/wy_wgmma.cuh"
#include "fused_chain.cuh"
#include "deltacp/params.h"

namespace deltacp::cuda::fused {

// Built with -DDELTACP_ONE_KERNEL_PROBE (e.g. CUDAFLAGS at configure time), the kernel times its phases in clock
// cycles on the CTA of sequence 0, value head 0, columns 0..63 (one thread of each warpgroup) and the launch
// prints them per chunk; DELTACP_ONE_KERNEL_PROBE_SKIP=1 leaves the chain's products out (the WY warpgroup
// alone on the SM; o and ht are then wrong). A tuning instrument: the phases in the opening comment come from it.
#ifdef DELTACP_ONE_KERNEL_PROBE
constexpr bool kOneKernelProbe = true;
#else
constexpr bool kOneKernelProbe = false;
#endif
constexpr int kProbePhases = 8;
struct PhaseClock {
  long long acc[kProbePhases] = {};
  long long last = 0;
  bool on = false;
  __device__ void start(bool enable) {
    on = kOneKernelProbe && enable;
    if (on) last = clock64();
  }
  __device__ void mark(int phase) {
    if (!on) return;
    const long long now = clock64();
    acc[phase] += now - last;
    last = now;
  }
  __device__ void write(long long* out) const {
    if (on)
      for (int i = 0; i < kProbePhases; ++i) out[i] = acc[i];
  }
};

template <class T>
struct OneKernelArgs {
  TileMap16 tm_q, tm_k, tm_v;  // [B, T, H or HV, 128] as the caller strides them: boxes of 64 columns x 64 tokens
  DevRows<const T> beta;
  DevRows<T> o;
  const tiled::SeqEntry* seqs = nullptr;
  const float* G = nullptr;   // [R, HV] fp32 (gdn), nullptr for delta
  const float* h0 = nullptr;  // [N, HV, 128, 128] or nullptr
  float* ht = nullptr;
  bool l2 = false;            // qk_l2norm: the row scales 1 / sqrt(|x|^2 + eps) of q and k
  int64_t Tlen = 0, HV = 0, group = 1;
  int chunk_size = 64;
  float scale = 1.f;
  long long* probe = nullptr;  // kOneKernelProbe: 2 x kProbePhases cycle counts (WY, chain)
  bool probe_skip_chain = false;
};

// Byte offsets from the 1024-byte aligned base (the opening comment has the regions).
struct OneKernelSmem {
  static constexpr int kLdA = tiled::WyWgmmaSmem::kLdA;  // A and T rows (floats), as the tf32 solve wants them
  static constexpr int kStages = 3, kSlots = 2;
  // an input stage
  static constexpr int q = 0, k = 16384, v = 32768, g = 40960;
  static constexpr int stage = 41984;
  // a ring slot: A, T; then W (two boxes), U, P over them; the row scales after them
  static constexpr int slots = kStages * stage;
  static constexpr int a = 0, t = 64 * kLdA * 4;
  static constexpr int w = 0, u = 16384, p = 24576, rq = 2 * 64 * kLdA * 4, rk = rq + 256;
  static constexpr int slot = 35840;
  static constexpr int beta = slots + kSlots * slot, eg = beta + 256, ek = eg + 256;  // ek: e^G rk per row
  static constexpr int os = ek + 256;                        // the chain's output staging tile
  static constexpr int bar = os + 64 * kLdStage * 2;         // in_full[3], out_full[2], out_empty[2]
  static constexpr int bytes = bar + 8 * (kStages + 2 * kSlots) + 1024;
};
static_assert(OneKernelSmem::rk + 256 <= OneKernelSmem::slot, "the row scales fit in the slot");
static_assert(OneKernelSmem::p + 8192 <= OneKernelSmem::rq, "W, U and P fit below the row scales");
static_assert(OneKernelSmem::g + 256 <= OneKernelSmem::stage && OneKernelSmem::stage % 1024 == 0 &&
                  OneKernelSmem::slot % 1024 == 0,
              "the boxes stay 1024-byte aligned");
static_assert(OneKernelSmem::bytes == 208696, "the size the opening comment gives");

#ifdef DELTACP_WGMMA_DEVICE
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(tma_smem_u32(bar)) : "memory");
}
// The barrier's arrival once every cp.async this thread issued before it has landed (counted in its init count).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(tma_smem_u32(bar)) : "memory");
}
// An m64nN accumulator (rows: the warpgroup's 64 tokens) as 16-bit values in N / 64 boxes of 64 x 64 with the
// 128-byte swizzle TMA would have written (16-byte piece j of row r at j ^ (r % 8); boxes 8 KB apart).
template <class T, int N>
__device__ __forceinline__ void store_boxes(unsigned char* dst, const float (&acc)[N / 2], float row_scale0 = 1.f,
                                            float row_scale1 = 1.f) {
  const int lane = static_cast<int>(threadIdx.x) & 31, wi = (static_cast<int>(threadIdx.x) >> 5) & 3;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nb = 0; nb < N / 8; ++nb)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * wi + g + 8 * h;
      const float s = h == 0 ? row_scale0 : row_scale1;
      *reinterpret_cast<uint32_t*>(dst + (nb >> 3) * 8192 + r * 128 + (((nb & 7) ^ (r & 7)) << 4) + 4 * t) =
          tiled::pack2<T>(s * acc[4 * nb + 2 * h], s * acc[4 * nb + 2 * h + 1]);
    }
}
#endif

// One CTA of two warpgroups per (sequence, value head, 64 state columns): the opening comment has the roles.
template <class T>
__global__ void __launch_bounds__(256, 1) fused_one_kernel(const __grid_constant__ OneKernelArgs<T> args) {
#ifdef DELTACP_WGMMA_DEVICE
  using namespace tiled;
  using L = OneKernelSmem;
  constexpr int kK = 128;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  uint64_t* in_full = reinterpret_cast<uint64_t*>(smem + L::bar);
  uint64_t* out_full = in_full + L::kStages;
  uint64_t* out_empty = out_full + L::kSlots;

  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, wi = wtid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t n = blockIdx.x, hv = blockIdx.y, HV = args.HV;
  const int v0 = blockIdx.z * kCols;  // the CTA's first state column
  const int hk = static_cast<int>(hv / args.group);
  const SeqEntry se = args.seqs[n];
  const int cs = args.chunk_size;
  const int64_t nchunks = se.num_chunks;
  auto chunk_row0 = [&](int64_t c) { return se.batch * args.Tlen + se.bos + c * cs; };
  auto chunk_len = [&](int64_t c) { return static_cast<int>(min(static_cast<int64_t>(cs), se.len - c * cs)); };
  auto stage_of = [&](int64_t c) { return smem + static_cast<int>(c % L::kStages) * L::stage; };
  auto slot_of = [&](int64_t c) { return smem + L::slots + static_cast<int>(c % L::kSlots) * L::slot; };

  if (tid == 0) {
    for (int s = 0; s < L::kStages; ++s) mbar_init(in_full + s, 1 + 64);
    for (int j = 0; j < L::kSlots; ++j) {
      mbar_init(out_full + j, 128);
      mbar_init(out_empty + j, 128);
    }
    fence_mbar_init();
    if (nchunks > 0) {
      tma_prefetch_map(&args.tm_q.map);
      tma_prefetch_map(&args.tm_k.map);
      tma_prefetch_map(&args.tm_v.map);
    }
  }
  if (args.G == nullptr && tid < 64)  // delta: G = 0 in every stage, written once
    for (int s = 0; s < L::kStages; ++s) reinterpret_cast<float*>(smem + s * L::stage + L::g)[tid] = 0.f;
  __syncthreads();  // the barriers are initialised, delta's G is written

  if (wg == 1) {
    // ---- the WY warpgroup ----
    auto wy_bar = [] { warpgroup_bar(1); };
    float* bs = reinterpret_cast<float*>(smem + L::beta);
    float* egs = reinterpret_cast<float*>(smem + L::eg);
    float* eks = reinterpret_cast<float*>(smem + L::ek);
    PhaseClock clk;
    clk.start(args.probe != nullptr && wtid == 0 && n == 0 && hv == 0 && blockIdx.z == 0);
    // This thread's beta of chunk c (rows past the chunk: 0), read a chunk ahead and kept in its 16-bit type until
    // it is used: converted at once, the load's latency (about 1000 cycles) stalled every chunk of this warpgroup.
    auto beta_of = [&](int64_t c) {
      return wtid < chunk_len(c) ? *args.beta.at(se.batch, se.bos + c * cs + wtid, hv) : T(0.f);
    };
    T b_next = nchunks > 0 && wtid < 64 ? beta_of(0) : T(0.f);
    for (int64_t c = 0; c < nchunks; ++c) {
      const int len = chunk_len(c);
      unsigned char* st = stage_of(c);
      unsigned char* sl = slot_of(c);
      const float b_cur = to_f(b_next);
      if (wtid < 64 && c + 1 < nchunks) b_next = beta_of(c + 1);
      mbar_wait(in_full + c % L::kStages, static_cast<uint32_t>((c / L::kStages) & 1));
      if (c >= L::kSlots)  // chunk c - 2's products have read the slot
        mbar_wait(out_empty + c % L::kSlots, static_cast<uint32_t>(((c - L::kSlots) / L::kSlots) & 1));
      clk.mark(0);
      const float* gs = reinterpret_cast<const float*>(st + L::g);
      if (wtid < 64) {  // (every WY thread has read the last chunk's beta and e^G: its barrier after T)
        bs[wtid] = b_cur;
        egs[wtid] = exp_t<T>(gs[wtid]);
      }
      if (len < 64)  // rows len .. 63 of Q, K and V's box: zero, as the two-kernel forward's loads left them
        for (int idx = wtid; idx < 5 * 64 * 8; idx += 128) {
          const int row = (idx >> 3) & 63;
          if (row >= len) *reinterpret_cast<uint4*>(st + idx * 16) = make_uint4(0u, 0u, 0u, 0u);
        }
      fence_proxy_async();
      wy_bar();

      // K K^T (A's products, which the solve waits for) as one group, then Q K^T (P's) as a second one; the row
      // scales meanwhile.
      float Pacc[32], Aacc[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) Pacc[i] = Aacc[i] = 0.f;
      const uint32_t q_addr = smem_u32(st + L::q), k_addr = smem_u32(st + L::k), v_addr = smem_u32(st + L::v);
      wg_fence();
      reg_fence(Pacc);
      reg_fence(Aacc);
#pragma unroll
      for (int kk = 0; kk < kK / 16; ++kk) {
        const uint64_t kd = wg_desc(k_addr + (kk >> 2) * 8192 + (kk & 3) * 32, 16, 1024);
        wgmma_n64_ss<T>(Aacc, kd, kd, kk > 0);
      }
      wg_commit();
#pragma unroll
      for (int kk = 0; kk < kK / 16; ++kk) {
        const uint32_t off = (kk >> 2) * 8192 + (kk & 3) * 32;
        wgmma_n64_ss<T>(Pacc, wg_desc(q_addr + off, 16, 1024), wg_desc(k_addr + off, 16, 1024), kk > 0);
      }
      wg_commit();
      float* rqs = reinterpret_cast<float*>(sl + L::rq);
      float* rks = reinterpret_cast<float*>(sl + L::rk);
      {
        // row_rnorm's thread mapping: row wtid / 2, one 64-column block per thread of the pair
        const float sq = args.l2 ? row_rnorm<T, kK>(st + L::q, wtid) : 1.f;
        const float sk = args.l2 ? row_rnorm<T, kK>(st + L::k, wtid) : 1.f;
        const int r = wtid >> 1;
        if ((wtid & 1) == 0) {
          rqs[r] = r < len ? sq : 1.f;
          rks[r] = r < len ? sk : 1.f;
        }
      }
      wg_wait<1>();
      reg_fence(Aacc);
      wy_bar();  // the row scales are visible
      clk.mark(1);

      // A (strictly lower, beta_i rk_i rk_j e^(G_i - G_j)) to the slot, masks before the exponentials (positive
      // above the diagonal); the decays kept for P (diagonal included), scaled once Q K^T is in.
      float* As = reinterpret_cast<float*>(sl + L::a);
      float* Ts = reinterpret_cast<float*>(sl + L::t);
      const int i0 = 16 * wi + g, i1 = i0 + 8;
      const float gi0 = gs[i0], gi1 = gs[i1];
      const float b0 = bs[i0] * rks[i0], b1 = bs[i1] * rks[i1];
      float dec[32];  // dec[4 nb + e]: e^(G_i - G_j) rk_j at P's accumulator position (0 above the diagonal)
#pragma unroll
      for (int nb = 0; nb < 8; ++nb) {
        const int j = 8 * nb + 2 * t;
        const float gj0 = gs[j], gj1 = gs[j + 1], kj0 = rks[j], kj1 = rks[j + 1];
        dec[4 * nb] = j <= i0 ? exp_t<T>(gi0 - gj0) * kj0 : 0.f;
        dec[4 * nb + 1] = j + 1 <= i0 ? exp_t<T>(gi0 - gj1) * kj1 : 0.f;
        dec[4 * nb + 2] = j <= i1 ? exp_t<T>(gi1 - gj0) * kj0 : 0.f;
        dec[4 * nb + 3] = j + 1 <= i1 ? exp_t<T>(gi1 - gj1) * kj1 : 0.f;
        *reinterpret_cast<float2*>(As + i0 * L::kLdA + j) = make_float2(
            j < i0 ? b0 * dec[4 * nb] * Aacc[4 * nb] : 0.f, j + 1 < i0 ? b0 * dec[4 * nb + 1] * Aacc[4 * nb + 1] : 0.f);
        *reinterpret_cast<float2*>(As + i1 * L::kLdA + j) =
            make_float2(j < i1 ? b1 * dec[4 * nb + 2] * Aacc[4 * nb + 2] : 0.f,
                        j + 1 < i1 ? b1 * dec[4 * nb + 3] * Aacc[4 * nb + 3] : 0.f);
      }
      if (wtid < 64) eks[wtid] = egs[wtid] * rks[wtid];  // W's column factor e^(G_j) rk_j
      // P = (rq_i e^(G_i - G_j) rk_j) o Q K^T, kept in registers until its box is free.
      wg_wait_all();
      reg_fence(Pacc);
      {
        const float q0 = rqs[i0], q1 = rqs[i1];
#pragma unroll
        for (int nb = 0; nb < 8; ++nb) {
          Pacc[4 * nb] *= q0 * dec[4 * nb];
          Pacc[4 * nb + 1] *= q0 * dec[4 * nb + 1];
          Pacc[4 * nb + 2] *= q1 * dec[4 * nb + 2];
          Pacc[4 * nb + 3] *= q1 * dec[4 * nb + 3];
        }
      }
      wy_bar();  // A is visible
      clk.mark(2);
      unit_lower_inverse_64_tf32(As, Ts, L::kLdA, wtid, wy_bar);  // ends on the warpgroup's barrier
      clk.mark(3);

      // T Beta e^G rk (W's operand) and T Beta (U's), this warp's rows i0, i1 of T.
      uint32_t fw[4][4], fu[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int j = 16 * kk + 8 * h + 2 * t;
          const float2 t0 = *reinterpret_cast<const float2*>(Ts + i0 * L::kLdA + j);
          const float2 t1 = *reinterpret_cast<const float2*>(Ts + i1 * L::kLdA + j);
          const float2 s = *reinterpret_cast<const float2*>(bs + j), e = *reinterpret_cast<const float2*>(eks + j);
          fu[kk][2 * h] = pack2<T>(t0.x * s.x, t0.y * s.y);
          fu[kk][2 * h + 1] = pack2<T>(t1.x * s.x, t1.y * s.y);
          fw[kk][2 * h] = pack2<T>(t0.x * s.x * e.x, t0.y * s.y * e.y);
          fw[kk][2 * h + 1] = pack2<T>(t1.x * s.x * e.x, t1.y * s.y * e.y);
        }
      wy_bar();  // every warp has read T (and beta, e^G): W, U and P take the slot
      clk.mark(4);

      // W = (T Beta e^G rk) K, n128 (the K tile read MN-major); U = (T Beta) V for the CTA's 64 columns, n64.
      float acc[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.f;
      float accu[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) accu[i] = 0.f;
      wg_fence();
      reg_fence(acc);
      reg_fence(accu);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs_tb<T, 128>(acc, fw[kk], wg_desc(k_addr + kk * 2048, 8192, 1024));
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs_tb<T, 64>(accu, fu[kk], wg_desc(v_addr + kk * 2048, 8192, 1024));
      wg_commit();
      store_boxes<T, 64>(sl + L::p, Pacc);  // P's box while the products run
      wg_wait_all();
      reg_fence(acc);
      reg_fence(accu);
      reg_fence(fw);
      reg_fence(fu);
      store_boxes<T, 128>(sl + L::w, acc);
      store_boxes<T, 64>(sl + L::u, accu);
      fence_proxy_async();  // the generic writes before the chain's wgmma reads them
      mbar_arrive(out_full + c % L::kSlots);
      clk.mark(5);
    }
    clk.write(args.probe);
  } else {
    // ---- the chain warpgroup: fused_chain_kernel's step (NWG = 1, K = V = 128) on the ring ----
    auto chain_bar = [] { warpgroup_bar(0); };
    const int jr = 16 * wi + g;
    const int64_t state0 = (n * HV + hv) * kK * kK;
    float S[kK / 2];
#pragma unroll
    for (int nb = 0; nb < kK / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t col = v0 + jr + 8 * (e >> 1), d = 8 * nb + 2 * t + (e & 1);
        S[4 * nb + e] = args.h0 != nullptr ? args.h0[state0 + d * kK + col] : 0.f;
      }
    // Chunk c's loads into its input stage (the chunk that used it last, c - 3, is done on both warpgroups).
    auto issue = [&](int64_t c) {
      const int64_t row0 = chunk_row0(c), t0 = se.bos + c * cs;
      const int len = chunk_len(c);
      unsigned char* st = stage_of(c);
      uint64_t* bar = in_full + c % L::kStages;
      if (tid == 0) {
        const int tt = static_cast<int>(t0), b = static_cast<int>(se.batch), h = static_cast<int>(hv);
        fence_proxy_async();  // the WY warpgroup's zeroed rows of this stage's last use, before the copies
        mbar_expect_tx(bar, 5 * 8192);
        tma_load_4d(st + L::q, &args.tm_q.map, bar, 0, hk, tt, b);
        tma_load_4d(st + L::q + 8192, &args.tm_q.map, bar, 64, hk, tt, b);
        tma_load_4d(st + L::k, &args.tm_k.map, bar, 0, hk, tt, b);
        tma_load_4d(st + L::k + 8192, &args.tm_k.map, bar, 64, hk, tt, b);
        tma_load_4d(st + L::v, &args.tm_v.map, bar, v0, h, tt, b);
      }
      if (tid < 64) {
        if (args.G != nullptr)
          cp_async_4(reinterpret_cast<float*>(st + L::g) + tid, args.G + (row0 + min(tid, len - 1)) * HV + hv);
        cp_async_mbar_arrive_noinc(bar);
      }
    };
    T* os = reinterpret_cast<T*>(smem + L::os);
    const int sq = lane >> 3, srr = lane & 7;
    const int srow = 8 * (sq >> 1) + srr, scol = 16 * wi + 8 * (sq & 1);
    auto store_staged = [&](int64_t t0, int len) {
      const int i0 = wtid >> 3, pc = (wtid & 7) * 8;
#pragma unroll
      for (int it = 0; it < 4; ++it) {
        const int i = i0 + 16 * it;
        if (i < len)
          *reinterpret_cast<uint4*>(args.o.at(se.batch, t0 + i, hv) + v0 + pc) =
              *reinterpret_cast<const uint4*>(os + i * kLdStage + pc);
      }
    };
    PhaseClock clk;
    clk.start(args.probe != nullptr && tid == 0 && n == 0 && hv == 0 && blockIdx.z == 0);
    const bool products = !kOneKernelProbe || !args.probe_skip_chain;
    for (int64_t c = 0; c < 2 && c < nchunks; ++c) issue(c);
    for (int64_t c = 0; c < nchunks; ++c) {
      const int len = chunk_len(c);
      const int64_t t0 = se.bos + c * cs;
      unsigned char* st = stage_of(c);
      unsigned char* sl = slot_of(c);
      if (c + 2 < nchunks) issue(c + 2);
      mbar_wait(in_full + c % L::kStages, static_cast<uint32_t>((c / L::kStages) & 1));
      clk.mark(0);
      mbar_wait(out_full + c % L::kSlots, static_cast<uint32_t>((c / L::kSlots) & 1));
      clk.mark(1);
      if (!products) {
        mbar_arrive(out_empty + c % L::kSlots);
        chain_bar();
        continue;
      }
      const float* gbuf = reinterpret_cast<const float*>(st + L::g);
      const float* rqb = reinterpret_cast<const float*>(sl + L::rq);
      const float* rkb = reinterpret_cast<const float*>(sl + L::rk);
      const uint32_t w_addr = smem_u32(sl + L::w), k_addr = smem_u32(st + L::k), q_addr = smem_u32(st + L::q);
      const uint32_t p_addr = smem_u32(sl + L::p);

      // (1) Va = S^T W^T and Oa = S^T Q^T, A = bf16(S^T) from registers.
      float Va[32], Oa[32];
      uint32_t sa[kK / 16][4];
      chain_issue_state_reads<T, kK, true>(Va, Oa, sa, S, w_addr, q_addr);
      if (c > 0) store_staged(t0 - cs, cs);  // the previous chunk's output while the products run
      wg_wait_all();
      reg_fence(Va);
      reg_fence(Oa);
      reg_fence(sa);

      // (2) Vn^T = U^T - Va; the per-token decays and row scales (fused_chain.cuh, chain_decays).
      u_minus_acc_trans_sw128<T>(Va, sl + L::u, srow, scol);
      uint32_t va[4][4], vo[4][4];
      const float glast = gbuf[len - 1];
      chain_decays<T>(
          Va, Oa, va, vo, t,
          [&](int j) {
            return make_float2(exp_t<T>(glast - gbuf[j]) * rkb[j], exp_t<T>(glast - gbuf[j + 1]) * rkb[j + 1]);
          },
          [&](int j) { return make_float2(exp_t<T>(gbuf[j]) * rqb[j], exp_t<T>(gbuf[j + 1]) * rqb[j + 1]); });

      // (3) S^T = e^(G_n) S^T + Vns^T K;  Oa += Vn^T P^T.
      const float eg = exp_t<T>(gbuf[len - 1]);
#pragma unroll
      for (int i = 0; i < kK / 2; ++i) S[i] *= eg;
      chain_update_state<T, kK, true>(S, Oa, va, vo, k_addr, p_addr, [] {});
      mbar_arrive(out_empty + c % L::kSlots);  // slot c % 2 is read: the WY warpgroup may fill it with chunk c + 2
      clk.mark(2);

      // (4) O = scale Oa^T, staged (after every thread has stored the previous chunk's rows from the tile).
      chain_bar();
      chain_stage_output<T>(os, Oa, args.scale, srow, scol);
      chain_bar();  // the staged output is visible; this chunk's input stage is free
      clk.mark(3);
    }
    clk.write(args.probe + kProbePhases);
    if (nchunks > 0) store_staged(se.bos + (nchunks - 1) * cs, chunk_len(nchunks - 1));
    if (args.ht != nullptr) {
#pragma unroll
      for (int nb = 0; nb < kK / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t col = v0 + jr + 8 * (e >> 1), d = 8 * nb + 2 * t + (e & 1);
          args.ht[state0 + d * kK + col] = S[4 * nb + e];
        }
    }
  }
#else
  __trap();  // never launched: the host selects this kernel only for builds with sm_90a code
#endif
}

// The one-kernel forward over the table's sequences (gdn or delta, K = V = 128, 16-bit; G from the tiled tier's
// stage 1, nullptr for delta; h0, ht per sequence, [N, HV, 128, 128], or nullptr).
template <class T>
void launch_one_kernel(const Params& p, const tiled::ChunkTable& table, const float* G, const float* h0, float* ht,
                       cudaStream_t stream) {
  if (table.num_seqs() == 0) return;
  OneKernelArgs<T> a;
  if (p.B * p.T > 0) {
    a.tm_q = token_rows_map(p.q, p.B, p.T, p.H, p.K, "q");
    a.tm_k = token_rows_map(p.k, p.B, p.T, p.H, p.K, "k");
    a.tm_v = token_rows_map(p.v, p.B, p.T, p.HV, p.V, "v");
  }
  a.beta = dev_rows<const T>(p.beta);
  a.o = dev_rows<T>(p.o);
  a.seqs = table.seqs();
  a.G = p.variant == Variant::delta ? nullptr : G;
  a.h0 = h0;
  a.ht = ht;
  a.l2 = p.qk_l2norm;
  a.Tlen = p.T;
  a.HV = p.HV;
  a.group = p.HV / p.H;
  a.chunk_size = p.chunk_size;
  a.scale = static_cast<float>(p.scale);
  opt_in_smem(fused_one_kernel<T>, OneKernelSmem::bytes, "K", "the one-kernel fused forward needs ",
              OneKernelSmem::bytes, " bytes of shared memory");
  const dim3 grid(static_cast<unsigned>(table.num_seqs()), static_cast<unsigned>(p.HV),
                  static_cast<unsigned>(p.V / kCols));
  if constexpr (kOneKernelProbe) {  // the tuning instrument (see kOneKernelProbe)
    static long long* probe = nullptr;
    if (probe == nullptr) DELTACP_CUDA_CHECK(cudaMalloc(&probe, 2 * kProbePhases * sizeof(long long)));
    DELTACP_CUDA_CHECK(cudaMemsetAsync(probe, 0, 2 * kProbePhases * sizeof(long long), stream));
    a.probe = probe;
    const char* skip = std::getenv("DELTACP_ONE_KERNEL_PROBE_SKIP");
    a.probe_skip_chain = skip != nullptr && std::string(skip) == "1";
  }
  fused_one_kernel<T><<<grid, 256, OneKernelSmem::bytes, stream>>>(a);
  DELTACP_CUDA_CHECK_LAUNCH();
  if constexpr (kOneKernelProbe) {
    long long h[2 * kProbePhases];
    DELTACP_CUDA_CHECK(cudaMemcpyAsync(h, a.probe, sizeof(h), cudaMemcpyDeviceToHost, stream));
    DELTACP_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double nc = std::max<double>(1.0, static_cast<double>(table.host_seqs()[0].num_chunks));
    std::printf("fused_one_kernel cycles per chunk: WY waits %.0f, K K^T %.0f, A %.0f, solve %.0f, fragments %.0f, "
                "W U P %.0f | chain loads %.0f, waits for WY %.0f, products %.0f, output %.0f\n",
                h[0] / nc, h[1] / nc, h[2] / nc, h[3] / nc, h[4] / nc, h[5] / nc, h[8] / nc, h[9] / nc, h[10] / nc,
                h[11] / nc);
  }
}

}  // namespace deltacp::cuda::fused
