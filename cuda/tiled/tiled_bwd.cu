// cuda/tiled/tiled_bwd.cu — tiled tier, backward: the chunked WY algorithm (docs/design.md section 3)
// differentiated by reverse mode, one kernel per stage, tensor-core tiles.
//
// Gradients of L = sum(o * do) + sum(ht * dht) for gdn, kda and delta. For one chunk (notation in
// bwd_common.cuh), given dO and dS' = dL/d(end state):
//
//   dVn = scale P^T dO + Kr dS'
//   dS  = scale (Q*Gam)^T dO + e^Gn o dS' - W^T dVn                (dS' of the previous chunk)
//   dW  = -dVn S^T,  dU = dVn,  dP = scale dO Vn^T (i >= j),  dKr = Vn dS'^T
//   dq  = scale (dO S^T) o Gam + (dP o E) K
//   dk  = (dP o E)^T Q + dKr o e^(Gn - G) + diag(beta) T^T dW o Gam + diag(beta) (dA o E) K + (dA o E)^T diag(beta) K
//   dv  = diag(beta) T^T dU
//   dbeta_i = (T^T dW)_i . X_i + (T^T dU)_i . v_i + sum_j dA_ij sum_d k_id k_jd E_ij^d
//   dT  = dW (diag(beta) X)^T + dU (diag(beta) V)^T,   dA = -(T^T dT T^T) strictly lower
//   dG  = (every G_i term: +, every G_j term: -, the Gn terms on the last row), dg = reverse cumsum of dG
//   dh0 = dS of the first chunk
//
// Where the forward kept the chunk-start states and v_new (Params::chunk_h, chunk_vnew; the eager autograd path
// by default) the recompute skips its state scan and B2 reads those (docs/design.md section 5). Where a gdn or kda
// forward also kept its WY stage (Params::wy_stage) the recompute is stage B0 alone (b0_kept_kernel, from the kept
// P) and every later stage reads G, T, W (kda: Kd and Q e^G) from the stage's planes.
//
// Stages (launch order; on p.stream, except B1 beside the state scan below):
//   recompute (fwd_stages.cuh, the forward's own kernels): G, T = (I + A)^-1 (fp32, [R, HV, 64]),
//             W, U, and the chunk-start states h and v_new from h0 (W, U and T on Hopper's warpgroup
//             products for 16-bit gdn / delta at K = V = 128: wy_wgmma.cuh, which then also does B0 from
//             the P it forms anyway, so B0 is not launched; for 16-bit kda at K = V = 128
//             (DELTACP_TILED_BWD_KDA_RECOMPUTE_WGMMA=0 keeps the three kernels), kda_prepare_wgmma.cuh's kernel in
//             its backward mode: G of every row, W, U, Kd, T, Q e^G and B0 in one kernel from the raw gate, no cumsum and no B0 launched).
//             Where B1's grid is narrow the one-shot backward
//             runs the state scan beside B1, B1 on a second stream (beside_b1_switch); where it runs no state
//             scan, B1 runs beside the chunk-local kernel instead, handing it chunk after chunk (bwd_handoff.cuh,
//             handoff_plan)
//   B0 bwd_dv_local   per (chunk, head)            dVn <- scale P^T dO
//   B1 bwd_dh_scan    per (sequence, head, V/32)   reverse scan: dh per chunk, dVn += Kr dS', dh0 (on Hopper,
//                                                  16-bit gdn / delta / kda at K = V = 128: bwd_dh_scan_wgmma.cuh)
//   B2 bwd_dqkg       per (chunk, head)            V contractions: dP, dq/dk/dG partials, dW
//   B3 bwd_wy         per (chunk, head)            WY backward: dv (final), dT, dA, dk/dG/dbeta partials
//   B4 bwd_decay      per (chunk, head)            decay-masked products, dbeta and dg (final)
//      (B2..B4 as one kernel for 16-bit gdn / delta at K = V = 128 on Hopper:
//       bwd_local_wgmma.cuh; none of dW, dP, dA and the dq / dk / dG parts goes through global memory.
//       B2 and B3 as one kernel for 16-bit kda at K = V = 128 on Hopper: bwd_local_kda_wgmma.cuh, which
//       hands B4 what B2 and B3 do, less dW; for bf16 it runs B4 too, and none of those goes through global
//       memory)
//   B5 reduce_heads   per token element            dq, dk: sum the value heads of each group, cast (only when
//                                                  HV > H: with one value head per key head B4, or the
//                                                  kernel that runs it, writes them)
// Every workspace element is written by exactly one thread per kernel; no atomics, so two runs give
// bitwise equal results.
//
// Staged (deltacp::cuda::StagedBackward, api.h; the CP backward): prepare = the recompute's cumsum and
// WY stages and B0 (no dht needed), then any number of dh0_pieces = B1 alone in dh0-only mode over
// pieces made of the prepared chunks (the CP pre-pass), optionally states = the recompute's state scan
// (h, v_new: only B2..B5 read them) on any stream, then finish = (states if not yet run) B1..B5 with dht. One BwdState keeps the chunk
// table, the workspace and the kernels' arguments between the calls; run_backward is the same three
// steps in one call, so both give bitwise equal gradients.
//
// Precision: fp32 inputs use fp32 FFMA everywhere (no TF32); bf16/fp16 inputs use
// mma.sync.m16n8k16 with fp32 accumulation, operands rounded to the input type (also fp32
// intermediates such as S, dS', T when they are operands). States, accumulators, exponentials and
// the workspaces are fp32, except what the forward stages store in the input dtype (W, U, v_new, h)
// and two that are only ever read as tensor-core operands, so they are stored as rounded as the
// operand is: dh (B1 -> B2) and dW (B2 -> B3). dW is bitwise what B3 rounded before; dh also feeds B2's
// dGs_d = sum_v dS'_dv S_dv (the decay of S in dg at a chunk's last row), which now sums the 16-bit dS'
// that B2's products already use (FLA's dh is 16-bit too).
//
// Workspace (one allocation per backward, carved by lifetime; bytes per token and value head at
// K = V = 128, bf16, chunk 64: per-chunk buffers are divided by the chunk's 64 tokens):
//
//   buffer     dtype   written -> last read     gdn   kda   before (gdn / kda)
//   region 1, the whole backward
//   G          fp32    cumsum -> B4               4   512   (0 where the forward kept its WY stage: wy_stage)
//   Tinv       fp32    WY -> B3                 256   256   (0 likewise)
//   h          bf16    state scan -> B2         512   512   (0 where the forward kept them: Params::chunk_h)
//   v_new      bf16    state scan -> B2         256   256   (0 likewise: Params::chunk_vnew)
//   dVn        fp32    B0 -> B3                 512   512   (16-bit over the same bytes from B1 on, and T
//                                                               from the WY stage on, where the chunk-local
//                                                               kernel runs: local_inputs_16bit)
//   U | dh     bf16    WY -> state scan | B1 -> B2  512   512   U 256 + dh (fp32) 1024, apart; apart again
//                                                               (768) where the scan runs beside B1
//   region 2, W, Kd, Q e^G until B1, then the buffers of one slice of the chunks for B2..B5
//   W          bf16    WY -> B1                 256   256
//   Kd         bf16    WY -> B1                   -   256
//   Q e^G      bf16    B0 -> B1                   -   256   (the kda wgmma recompute writes it in B0's place)
//                                                               W, Kd and Q e^G: 0 where the WY stage was kept
//                                                               (Params::wy_stage; then B0 alone runs, from its P)
//   slice: dW (bf16; was fp32 512) 256, dP 256, dA 256, dq_w 512, dk_w 512, dG_w (kda) 512, dG rows (gdn) 4,
//          dbeta_w 4: 1800 (gdn) / 2308 (kda) per token-head of the slice: all the chunks when that is at
//          most 256 MiB, else at least 16 * SMs / HV chunks (16 waves of B2's CTAs), or as many as fit
//          region 2's first use if more; with the fused chunk-local kernel only dq_w and dk_w, and only with
//          grouped value heads (HV > H, for B5): 0 or 1024 per token-head; with kda's (B2 and B3 as one
//          kernel) all but dW: 2052 per token-head
//   total                                     2308  3328   5132 / 6660 (every buffer at once)
//
// At (2, 16384, 16, 128) on a 132-SM GPU: gdn 1,154 MiB (was 2,566) plus what a slice needs beyond W's
// 128 MiB (4 slices of 128 chunks of 1.84 MB: 97 MiB), kda 1,664 MiB (was 3,330). Slices give bitwise the
// gradients of one slice over
// every chunk (each element is still written by one thread; tests/python/test_cuda_memory.py). The
// workspace comes from workspace_pool.h's allocator: torch's caching allocator when called from torch.
//
// Limits: K <= 128 (tiles of KP = 64 or 128 key columns), V <= 256 and chunk_size <= 64 (the forward
// stages' limits). Shared memory per CTA: up to 187 KB (B2 with two V stages, kda, fp32, K > 64) where
// it fits (227 KB on sm_90); B2 and B3 fall back to one stage elsewhere, 16-bit kda's B4 to its
// element-by-element kernel (the tensor-core one takes 180 KB at K > 64), and every stage's fallback
// configuration fits the 163 KB of sm_80 (at most 156 KB).
//
// What changed from the previous tier (naive: token-by-token reverse recurrence with checkpoints):
// the work is chunked; the only sequential part is the dh scan over chunks (K x V state gradient per
// CTA); everything else is per-chunk matrix products on tensor cores.
// kda's decay-masked products (P in B0, B4's three) factorise their off-diagonal 16 x 16 blocks around a
// reference row onto the tensor cores (kda_scores.cuh; bwd_decay.cuh), as FLA's sub-chunks do; only the
// diagonal blocks are summed element by element (fp32 inputs: B4 wholly element by element).
//
// Measured (NVIDIA H100, 2026-11-27, bf16 gdn, bench/gpu/stage_times.py --backward with the fused forward,
// kernel time per call): (2,16384,16,128) 3.60 ms of kernels for forward + backward: bwd_local_wgmma (B2-B4)
// 1.04, bwd_dh_scan (wgmma) 0.73, the recompute's state scan 0.54 and wy_wgmma with B0 0.46, and the forward
// 0.80 (4.18 ms elapsed in order, 4.03 with the state scan beside B1); (1,8192,96,128) 4.61 ms (bwd_local_wgmma
// 1.66, bwd_dh_scan 0.81, wy_wgmma with B0 0.70, state scan 0.50). The same harness on the same H100 before the
// chunk-local kernel and B0 in the WY stage: 6.01 ms at (2,16384,16,128) (bwd_dqkg 1.30, bwd_wy 1.04,
// bwd_decay 0.81, chunk_wy 0.46, bwd_dv_local 0.32). On an H200 (2026-11-25), before them: 5.72 and 7.37 ms.
// The steps that got there: the per-chunk stages accumulating in
// registers with cp.async tiles (17.9 -> 6.87 ms of kernels, 2026-11-22 .. 23), the Hopper dh scan (1.06 ->
// 0.72 ms), and B3 / B4 reading B2's dq / dk parts before their stores instead of element by element between
// them (B3 1.15 -> 1.02, B4 0.94 -> 0.67 ms), and B1 in pieces where few long sequences leave its grid narrow
// (below; (1,65536,8,128): B1 2.99 -> 0.65 ms, plus 0.26 ms of the pieces' maps, 0.03 of the fold and 0.06 of
// the reverse maps). Tried and not kept: B2 storing dq and dk through shared memory as whole rows (1.24 ->
// 1.32 ms); B3 ending with B4's work in the same CTA (dA o E built from B3's accumulators, no dA round trip,
// no second read of k and of the dk parts; bitwise the same gradients): 1.64 ms against B3 1.01 + B4 0.66 at
// (2,16384,16,128), 2.60 against 1.57 + 1.05 at (1,8192,96,128). B4's time is its products and epilogue in
// series behind B3's, not its traffic; two CTAs of 8 warps per SM hide little of either.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/check.h"
#include "../common/device_info.h"
#include "../common/kernel_switch.h"
#include "../common/load_store.cuh"
#include "../common/side_stream.h"
#include "bwd_common.cuh"
#include "bwd_decay.cuh"
#include "bwd_dh_scan.cuh"
#include "bwd_dh_scan_wgmma.cuh"
#include "bwd_dqkg.cuh"
#include "bwd_dv_local.cuh"
#include "bwd_local_kda_wgmma.cuh"
#include "bwd_local_wgmma.cuh"
#include "bwd_wy.cuh"
#include "chunk_table.cuh"
#include "deltacp/cuda/tiers.h"
#include "deltacp/error.h"
#include "fwd_stages.cuh"
#include "scan_config.h"

namespace deltacp::cuda {
namespace tiled::bwd {
namespace {

// B5: dq[b, t, h, :] = sum over the group's value heads of the per-value-head workspace (fixed order), for
// the token rows row0 .. row0 + rows - 1 (those of one slice of the chunks).
template <class Op>
__global__ void __launch_bounds__(kThreads) bwd_reduce_heads_kernel(const Args a, int64_t row0, int64_t rows) {
  const int64_t total = rows * a.H * a.K;
  for (int64_t e = int64_t(blockIdx.x) * kThreads + threadIdx.x; e < total; e += int64_t(gridDim.x) * kThreads) {
    const int64_t d = e % a.K, rest = e / a.K;
    const int64_t hk = rest % a.H, row = row0 + rest / a.H;  // row = b * T + t
    const int64_t b = row / a.T, t = row % a.T;
    float sq = 0.f, sk = 0.f;
    for (int64_t j = 0; j < a.group; ++j) {
      const int64_t o = (row * a.HV + hk * a.group + j) * a.K + d;
      sq += a.dqw[o];
      sk += a.dkw[o];
    }
    st<Op>(a.dq, off(a.dq, b, t, hk) + d, sq);
    st<Op>(a.dk, off(a.dk, b, t, hk) + d, sk);
  }
}

template <class Kernel>
void prepare(Kernel kernel, size_t bytes, const char* stage) {
  const int limit = max_smem_optin();
  DELTACP_CHECK(bytes <= static_cast<size_t>(limit), "K",
                "expected a key/value size whose tiled backward ", stage, " stage fits in shared memory (",
                limit, " bytes per block on this GPU), got one needing ", bytes, " bytes");
  allow_dynamic_smem(kernel, bytes);
}

// A per-chunk stage: grid (chunks, value heads), 8 warps, `bytes` of dynamic shared memory.
template <class Kernel>
void launch_per_chunk(Kernel kernel, size_t bytes, const char* stage, const Args& a, cudaStream_t stream) {
  prepare(kernel, bytes, stage);
  kernel<<<dim3(static_cast<unsigned>(a.num_chunks), static_cast<unsigned>(a.HV)), kThreads, bytes, stream>>>(a);
  DELTACP_CUDA_CHECK_LAUNCH();
}
// B2 and B3 walk V in tiles: two cp.async stages where they fit a CTA's shared memory (sm_90: every shape;
// sm_80: not kda at K > 64), else one.
template <template <class, int, bool, int> class Smem, class Op, int KP, bool PERKEY>
bool two_stages_fit() {
  return Smem<Op, KP, PERKEY, 2>{}.total <= static_cast<size_t>(max_smem_optin());
}

// B1, the sequential dh scan: column tile BV 64 or 32 and one or two load stages (scan_config.h).
template <class Op, int KP, bool PERKEY, int BV, int NW>
void launch_dh_scan_bv(const Args& a, int64_t num_seqs, cudaStream_t stream) {
  constexpr DhScanSmem<Op, KP, 1, BV> L1{};
  constexpr DhScanSmem<Op, KP, 2, BV> L2{};
  const int64_t nvt = (a.V + BV - 1) / BV, ctas = num_seqs * a.HV * nvt;
  const bool two = scan_two_stages(ctas, L1.total, L2.total, /*cap=*/32);
  DELTACP_CHECK(a.HV <= 65535 && nvt <= 65535, "HV", "expected at most 65535 value heads and V slices, got ", a.HV,
                " and ", nvt);
  const dim3 grid(static_cast<unsigned>(num_seqs), static_cast<unsigned>(a.HV), static_cast<unsigned>(nvt));
  if (two) {
    auto k = bwd_dh_scan_kernel<Op, KP, PERKEY, 2, BV, NW>;
    prepare(k, L2.total, "dh scan");
    k<<<grid, 32 * NW, L2.total, stream>>>(a);
  } else {
    auto k = bwd_dh_scan_kernel<Op, KP, PERKEY, 1, BV, NW>;
    prepare(k, L1.total, "dh scan");
    k<<<grid, 32 * NW, L1.total, stream>>>(a);
  }
  DELTACP_CUDA_CHECK_LAUNCH();
}
template <class Op, int KP, bool PERKEY>
void launch_dh_scan(const Args& a, int64_t num_seqs, cudaStream_t stream) {
  auto ctas_of = [&](int64_t bv) { return num_seqs * a.HV * ((a.V + bv - 1) / bv); };
  constexpr int NW = KP / 16;  // one 16-row m-tile of the state per warp
  // BV 64 only where its one-stage CTA fits: fp32 at K > 64 takes 206 KB (sm_80 gives 163 KB), at K <= 64
  // 140 KB (sm_86 / sm_89: 99 KB); BV 32 fits both (157 KB, 98.5 KB).
  const bool fits64 = DhScanSmem<Op, KP, 1, 64>{}.total <= static_cast<size_t>(max_smem_optin());
  if (fits64 && scan_tile_width({64, 32}, ctas_of) == 64)
    launch_dh_scan_bv<Op, KP, PERKEY, 64, NW>(a, num_seqs, stream);
  else
    launch_dh_scan_bv<Op, KP, PERKEY, 32, NW>(a, num_seqs, stream);
}

// Which of B0..B5 one run_stages call runs: all of them (one-shot backward), or the two halves of
// the staged backward around dht (B0 needs no dht; B1 on need it), or B1 alone (dh0 of pieces).
enum class Stages { all, through_b0, after_b0, dh_scan_only };

// B0 and B1 over every chunk (B2..B5 are launch_slice's, slice by slice).
template <class Op, int KP, bool PERKEY>
void launch_stages(const Args& a, int64_t num_seqs, cudaStream_t stream, Stages which) {
  const int64_t NC = a.num_chunks;
  DELTACP_CHECK(num_seqs <= INT_MAX, "B", "expected at most ", INT_MAX,
                " sequences for the tiled backward scan, got ", num_seqs);

  if (NC > 0 && !a.dv_local_done && (which == Stages::all || which == Stages::through_b0))
    launch_per_chunk(bwd_dv_local_kernel<Op, KP, PERKEY>, DvLocalSmem<Op, KP, PERKEY>{}.total, "dv_local", a, stream);
  if (which == Stages::through_b0) return;
  if (num_seqs * a.HV > 0 && a.V > 0) {
    if (use_dh_scan_wgmma(a, kIs16Bit<Op>, PERKEY)) {  // Hopper: dS in wgmma accumulators, tiles by TMA
      if constexpr (kIs16Bit<Op>) {
        launch_dh_scan_wgmma<Op, PERKEY>(a, num_seqs, stream);
        return;
      }
    }
    DELTACP_CHECK(!a.dvn16 || a.dh0_only, "DELTACP_TILED_BWD_LOCAL16",
                  "expected the Hopper dh scan for dVn in 16 bits (chosen with it)");
    launch_dh_scan<Op, KP, PERKEY>(a, num_seqs, stream);
  }
}

// B2..B5 on the chunks of one slice (slice_args: a.chunks, a.num_chunks and the slice buffers), whose token
// rows are row0 .. row0 + rows - 1. local: B2, B3 and B4 as one kernel on Hopper (bwd_local_wgmma.cuh);
// local_kda: kda's B2 and B3 as one kernel on Hopper (bwd_local_kda_wgmma.cuh), then B4 as without it, or
// (local_kda_decay) B4 inside that kernel.
template <class Op, int KP, bool PERKEY>
void launch_slice(const Args& a, int64_t row0, int64_t rows, bool local, bool local_kda, bool local_kda_decay,
                  cudaStream_t stream) {
  const int64_t NC = a.num_chunks;
  bool local_ran = false, b2b3_ran = false;
  if constexpr (kIs16Bit<Op> && !PERKEY && KP == kLocalKeys) {
    if (local && NC > 0) {
      launch_local_wgmma<Op>(a, stream);
      local_ran = true;
    }
  }
  if constexpr (kIs16Bit<Op> && PERKEY && KP == kLocalKeys) {
    if (local_kda && NC > 0) {
      if (local_kda_decay) {
        launch_local_kda<Op, true>(a, stream);
        local_ran = true;  // B2, B3 and B4
      } else {
        launch_local_kda<Op>(a, stream);
      }
      b2b3_ran = true;
    }
  }
  if (NC > 0 && !local_ran) {
    if (!b2b3_ran) {
      if (two_stages_fit<DqkgSmem, Op, KP, PERKEY>())
        launch_per_chunk(bwd_dqkg_kernel<Op, KP, PERKEY, 2>, DqkgSmem<Op, KP, PERKEY, 2>{}.total, "dq/dk/dg", a,
                         stream);
      else
        launch_per_chunk(bwd_dqkg_kernel<Op, KP, PERKEY, 1>, DqkgSmem<Op, KP, PERKEY, 1>{}.total, "dq/dk/dg", a,
                         stream);
      if (two_stages_fit<WyBwdSmem, Op, KP, PERKEY>())
        launch_per_chunk(bwd_wy_kernel<Op, KP, PERKEY, 2>, WyBwdSmem<Op, KP, PERKEY, 2>{}.total, "WY", a, stream);
      else
        launch_per_chunk(bwd_wy_kernel<Op, KP, PERKEY, 1>, WyBwdSmem<Op, KP, PERKEY, 1>{}.total, "WY", a, stream);
    }
    if constexpr (PERKEY) {
      // 16-bit kda: the off-diagonal blocks on the tensor cores where the CTA fits (sm_90: every K; sm_80:
      // K <= 64); fp32 (and the rest) sums element by element.
      bool on_tensor_cores = false;
      if constexpr (kIs16Bit<Op>) {
        constexpr size_t bytes = DecayKdaTcSmem<Op, KP>{}.total;
        on_tensor_cores = bytes <= static_cast<size_t>(max_smem_optin());
        if (on_tensor_cores) launch_per_chunk(bwd_decay_kda_tc_kernel<Op, KP>, bytes, "decay", a, stream);
      }
      if (!on_tensor_cores)
        launch_per_chunk(bwd_decay_kda_kernel<Op, KP>, DecayKdaSmem<Op, KP>{}.total, "decay", a, stream);
    } else
      launch_per_chunk(bwd_decay_scalar_kernel<Op, KP>, DecayScalarSmem<Op, KP>{}.total, "decay", a, stream);
  }
  if (NC > 0) {
    if (a.group > 1 && rows > 0) {  // with one value head per key head, B4 wrote dq and dk itself
      const int64_t total = rows * a.H * a.K;
      const int64_t blocks = (total + kThreads - 1) / kThreads;
      const unsigned grid = static_cast<unsigned>(blocks < 65536 * 16 ? blocks : 65536 * 16);  // grid-stride beyond
      bwd_reduce_heads_kernel<Op><<<grid, kThreads, 0, stream>>>(a, row0, rows);
      DELTACP_CUDA_CHECK_LAUNCH();
    }
  }
}

// Owns one stream-ordered device allocation (carved by start_backward).
class Workspace {
 public:
  explicit Workspace(cudaStream_t s) : stream_(s) {}
  ~Workspace() {
    workspace_free(base_, stream_);  // errors surface at the next checked call
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  void allocate(size_t bytes) { base_ = workspace_alloc(bytes, stream_); }
  // The piece at `offset`, or nullptr for an empty piece.
  template <class E>
  E* at(size_t offset, int64_t bytes) const {
    return bytes > 0 ? reinterpret_cast<E*>(static_cast<char*>(base_) + offset) : nullptr;
  }

 private:
  cudaStream_t stream_;
  void* base_ = nullptr;
};

// Offsets of consecutive 256-byte aligned pieces.
struct Carver {
  size_t off = 0;
  size_t take(int64_t bytes) {
    const size_t o = off;
    off += static_cast<size_t>((bytes + 255) / 256 * 256);
    return o;
  }
};

// The buffers of B2..B5 for one slice of at most `chunks` chunks and `rows` token rows (offsets from the
// start of the slice region). With the fused chunk-local kernel (local) only dq and dk per value head, and
// only with grouped value heads (for B5); with kda's chunk-local kernel (no_dW) all but dW, which that kernel
// keeps in shared memory.
struct SliceLayout {
  int64_t chunks = 0, rows = 0;
  bool perkey = false, row_sums = false;  // kda's dG per key column; gdn's dG row sums
  size_t dW = 0, dP = 0, dA = 0, dq = 0, dk = 0, dG = 0, dGr = 0, db = 0, total = 0;
};
SliceLayout slice_layout(const Params& p, int64_t chunks, int64_t rows, bool local, bool no_dW) {
  SliceLayout L;
  L.chunks = chunks;
  L.rows = rows;
  Carver c;
  if (local) {
    const int64_t rk = p.HV > p.H ? rows * p.HV * p.K : 0;
    L.dq = c.take(rk * 4);
    L.dk = c.take(rk * 4);
    L.total = c.off;
    return L;
  }
  L.perkey = p.variant == Variant::kda;
  L.row_sums = p.variant == Variant::gdn;
  const int64_t es = dtype_size(p.dtype), rk = rows * p.HV * p.K, mat = chunks * p.HV * kRows * kRows * 4;
  L.dW = c.take(no_dW ? 0 : rk * es);
  L.dP = c.take(mat);
  L.dA = c.take(mat);
  L.dq = c.take(rk * 4);
  L.dk = c.take(rk * 4);
  L.dG = c.take(L.perkey ? rk * 4 : 0);
  L.dGr = c.take(L.row_sums ? rows * p.HV * 4 : 0);
  L.db = c.take(rows * p.HV * 4);
  L.total = c.off;
  return L;
}

// How many chunks one slice of B2..B5 takes. The slice region reuses the bytes of W, Kd and Q e^G (dead
// once B1 has run), so a slice that fits them costs no memory; but each slice is a launch of B2, B3, B4
// (and B5), and a launch of few CTAs leaves SMs idle in its last wave: below 256 MiB of slice buffers
// there is one slice; above, a slice takes at least 16 waves of (chunk, value head) CTAs (one CTA per SM at
// a time in B2), and then the slices are made equal (so no short last one; each may end a little under). DELTACP_BWD_SLICE_CHUNKS=n sets it (tests: several
// slices on small problems).
int64_t slice_chunks(const Params& p, int64_t num_chunks, size_t free_bytes, bool local, bool no_dW) {
  if (const char* env = std::getenv("DELTACP_BWD_SLICE_CHUNKS")) {
    const long long n = std::strtoll(env, nullptr, 10);
    if (n > 0) return std::min<int64_t>(n, num_chunks);
  }
  const int64_t es = dtype_size(p.dtype), K = p.K;
  const int64_t per_row = local ? (p.HV > p.H ? 2 * K * 4 : 0)
                                : (no_dW ? 0 : K * es) + 2 * K * 4 + (p.variant == Variant::kda ? K * 4 : 0) +
                                      (p.variant == Variant::gdn ? 4 : 0) + 4;
  const int64_t per_chunk = local ? p.HV * int64_t(p.chunk_size) * per_row
                                  : p.HV * (2 * kRows * kRows * 4 + int64_t(p.chunk_size) * per_row);
  // Small problems take one slice: their buffers are small, and each extra slice is four more launches with
  // a partial last wave (H200, tiled gdn forward + backward under torch's allocator: (4, 2048, 16, 128) 2.45 ms
  // in 2 slices against 1.80 in one; (2, 16384, 16, 128) 7.33 ms in 8 slices of 8 waves against 7.01 in one).
  constexpr int64_t kOneSliceBytes = int64_t(256) << 20;
  if (num_chunks * per_chunk <= kOneSliceBytes) return num_chunks;
  const int64_t fit = static_cast<int64_t>(free_bytes) / std::max<int64_t>(per_chunk, 1);
  const int64_t waves = (16 * int64_t(sm_count()) + p.HV - 1) / p.HV;
  const int64_t cap = std::max<int64_t>(1, std::min(num_chunks, std::max(fit, waves)));
  const int64_t n = (num_chunks + cap - 1) / cap;  // slices; then equal ones (no short last launch)
  return (num_chunks + n - 1) / n;
}

// Everything one backward keeps between its stages: the chunk table, the workspace and the kernels'
// arguments. run_backward uses it for one call; the staged backward (api.h) across three.
struct BwdState final : StagedBackward {
  BwdState(const Params& params, cudaStream_t stream) : p(params), table(params, params.chunk_size, stream),
                                                       ws(stream) {}
  Params p;  // the prepared problem (its tensors must outlive the state: the caller keeps them)
  ChunkTable table;
  Workspace ws;
  Args a;  // B0, B1 (B2..B5: slice_args of it)
  void *U = nullptr, *h = nullptr, *vnew = nullptr;  // the state scan's input and outputs (Args has them const)
  std::vector<int64_t> slices;  // B2..B5 run on chunks [slices[i], slices[i + 1])
  SliceLayout slice;
  char* slice_base = nullptr;
  bool local = false;        // B2..B4 as one kernel (bwd_local_wgmma.cuh)
  bool local_kda = false;    // kda's B2 and B3 as one kernel (bwd_local_kda_wgmma.cuh)
  bool local_kda_decay = false;  // and B4 inside it
  bool beside = false;       // the one-shot backward runs the state scan beside B1 (run_backward)
  bool states_done = false;  // the forward's state scan (h, v_new) has been launched
  bool finished = false;
};

// The arguments a finishing call may change: dht and where the gradients go.
void set_gradient_outputs(Args& a, const Params& p) {
  a.dq = p.dq;
  a.dk = p.dk;
  a.dv = p.dv;
  a.dg = p.dg;
  a.dbeta = p.dbeta;
  a.dht = static_cast<const float*>(p.dht);
  a.dh0 = static_cast<float*>(p.dh0);
}

// The arguments of B2..B5 on chunks [c0, c1) (Args' comment on slices); *row0, *rows: their token rows.
Args slice_args(const BwdState& s, const Args& a, int64_t c0, int64_t c1, int64_t* row0, int64_t* rows) {
  const auto& hc = s.table.host_chunks();
  const int64_t r0 = hc[c0].row0, r1 = hc[c1 - 1].row0 + hc[c1 - 1].len;  // a slice's rows are contiguous
  *row0 = r0;
  *rows = r1 - r0;
  const int64_t es = dtype_size(s.p.dtype), HV = a.HV, K = a.K;
  const SliceLayout& L = s.slice;
  Args x = a;
  x.chunks = a.chunks + c0;
  x.num_chunks = c1 - c0;
  x.h = static_cast<const char*>(a.h) + c0 * HV * a.Kp * a.Vp * es;
  x.dh = static_cast<char*>(a.dh) + c0 * HV * K * a.V * es;
  // A row buffer holds rows r0 .. r1 - 1; the kernels index it by the global row, so they get the address
  // its row 0 would have (unsigned arithmetic: that address lies before the allocation).
  auto rows_at = [&](size_t off, int64_t width, int64_t elem) -> void* {
    return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(s.slice_base + off) -
                                   static_cast<uintptr_t>(r0 * HV * width * elem));
  };
  x.dW = rows_at(L.dW, K, es);
  x.dP = reinterpret_cast<float*>(s.slice_base + L.dP);
  x.dA = reinterpret_cast<float*>(s.slice_base + L.dA);
  x.dqw = static_cast<float*>(rows_at(L.dq, K, 4));
  x.dkw = static_cast<float*>(rows_at(L.dk, K, 4));
  x.dGw = L.perkey ? static_cast<float*>(rows_at(L.dG, K, 4)) : nullptr;
  x.dGr = L.row_sums ? static_cast<float*>(rows_at(L.dGr, 1, 4)) : nullptr;
  x.dbw = static_cast<float*>(rows_at(L.db, 1, 4));
  return x;
}

// The forward recompute's state scan: h (chunk-start states) and v_new from h0, which B2..B5 read (B0 and
// B1 do not), on `stream`.
void launch_states(BwdState& s, cudaStream_t stream) {
  launch_state_scan(s.p, s.table, plan_scan(s.p, s.table.host_seqs()), s.a.G, s.a.W, s.U, s.a.Kd, s.h, s.vnew,
                    static_cast<const float*>(s.p.h0), /*ht=*/nullptr, stream);
  s.states_done = true;
}

// The one-shot backward's state scan beside B1 (B1 on the side stream of common/side_stream.h, at the higher
// priority: it is the longer chain; the scan on the caller's stream; joined before B2). Both are chains over
// a sequence's chunks whose grids leave SMs idle where few sequences x heads run, and they share no buffer
// once U and dh have their own bytes (256 bytes per token and value head more). The gradients are bitwise
// the same either way (the same kernels on the same data; only their order changes).
// DELTACP_TILED_BWD_BESIDE (common/kernel_switch.h): unset = for 16-bit gdn / delta (where it was measured)
// where B1's whole-sequence grid (V / 64 CTAs per sequence and head, one per SM) takes at most half the SMs
// and B1 is not cut into pieces; 0 = never; 1 = wherever there is a state scan (a dh0-only backward has none
// and runs as with 0; a stream being captured into a CUDA graph is an error: the captured graph would hold a
// fork the caller did not ask for). Measured (NVIDIA H100, bf16 gdn, fused forward + this backward, elapsed
// per call, stage_times.py, two runs): (2,16384,16,128), 64 CTAs of B1: 4.18 -> 4.03 ms and 4.48 -> 4.22 ms,
// the two kernels each slower beside the other (B1 0.73 -> 1.18 ms, the scan 0.54 -> 0.71) but together
// shorter; (1,8192,96,128), 192 CTAs: 5.10 -> 5.52 ms, so not there.
enum class Beside { never, where_narrow, always };
Beside beside_b1_switch(const Params& p) {
  if (p.dh0_only()) return Beside::never;
  const bool on = kernel_switch("DELTACP_TILED_BWD_BESIDE", "the state scan beside B1", [&]() -> const char* {
    if (stream_capturing(static_cast<cudaStream_t>(p.stream)))
      return "the stream is being captured into a CUDA graph (the backward then runs on the caller's stream)";
    return nullptr;
  });
  if (!on) return Beside::never;
  const char* env = std::getenv("DELTACP_TILED_BWD_BESIDE");
  if (env != nullptr && std::string(env) == "1") return Beside::always;
  const bool measured = (p.dtype == DType::bf16 || p.dtype == DType::f16) && p.variant != Variant::kda;
  return measured ? Beside::where_narrow : Beside::never;
}

ScanPlan dh_piece_plan(const Params& p, const std::vector<SeqEntry>& seqs);  // below, with B1 in pieces

// DELTACP_TILED_BWD_LOCAL16 (common/kernel_switch.h: unset = wherever the chunk-local kernel runs, 0 = never,
// 1 = required): the chunk-local kernel's two fp32 inputs handed to it in the input dtype, each written over the
// bytes of its fp32 form by a Hopper kernel: dVn by B1 (Args::dvn16, bwd_common.cuh dvn16_at) and T by the WY
// stage (Args::t16, the first half of each row). The local kernel rounds both to the input dtype for its
// products anyway, so the gradients are the same bits (test_local_inputs_in_16_bits_give_the_same_bits), and
// the hand-offs' traffic halves: 512 (dVn: B1's store, the local load) + 256 (T: the WY store, the local load)
// of the backward's 10,274 bytes per token-head. Each applies where its writer is the Hopper kernel (the dh
// scan, the WY stage). Measured (H100, bf16 gdn, fused forward + backward kernels per call): (1,8192,96,128)
// 4.64 -> 4.48 ms (elapsed 4.98 -> 4.71); (2,16384,16,128) 4.24 -> 4.24 (the local kernel overlaps the state
// scan there; elapsed within noise). kda's chunk-local kernel (bwd_local_kda_wgmma.cuh) reads them the same way;
// for kda only dVn applies where its WY stage is the mma.sync one (which writes T in fp32), both with the wgmma
// recompute (DELTACP_TILED_BWD_KDA_RECOMPUTE_WGMMA).
bool local_inputs_16bit(const Params& p, bool local) {
  if (p.dh0_only()) return false;  // no chunk-local stage
  return kernel_switch("DELTACP_TILED_BWD_LOCAL16", "the chunk-local kernel's inputs in 16 bits",
                       [&]() -> const char* {
                         return local ? nullptr : "it needs a chunk-local kernel (bwd_local_wgmma.cuh, or "
                                                  "bwd_local_kda_wgmma.cuh), "
                                                  "which does not run these inputs";
                       },
                       /*unset_on=*/true);
}

// DELTACP_TILED_BWD_KDA_RECOMPUTE_WGMMA (common/kernel_switch.h): unset = on where it applies (16-bit kda, K = V =
// 128, compute capability 9.0): kda's recompute on Hopper's warpgroup products, kda_prepare_wgmma.cuh's kernel in
// its backward mode (launch_kda_bwd_recompute, fwd_stages.cuh), one kernel in place of the gate cumsum,
// chunk_wy_kernel<T, true> and stage B0 (it sums the gate, writes every row of G, and forms P and Q e^G anyway, so
// B0's scale P^T dO is one more product in the same CTA); 1 = required (an error names why it cannot run these
// inputs); 0 = the three kernels. A, P, W, U and dVn accumulate in wgmma's k order, which on the GPU tests gave the
// mma.sync path's bits. Measured (H100, bf16, (2,16384,16,128), bench/gpu/stage_times.py --variant kda
// --backward): 0.81 ms where the three kernels took 0.22 + 0.86 + 0.53; kda's forward + backward kernels
// 7.03 -> 6.04 ms.
bool use_kda_recompute_wgmma(const Params& p) {
  return kernel_switch("DELTACP_TILED_BWD_KDA_RECOMPUTE_WGMMA", "the wgmma kda recompute",
                       [&] { return kda_bwd_recompute_refusal(p); }, /*unset_on=*/true);
}

bool b1_grid_narrow(const Params& p, const ChunkTable& table) {
  const int64_t ctas = table.num_seqs() * p.HV * ((p.V + 63) / 64);
  return 2 * ctas <= sm_count() && !dh_piece_plan(p, table.host_seqs()).cut();
}

// Checks, the chunk table, the workspace, the kernels' arguments and the forward recompute (the state
// scan only when with_states and not beside B1: the staged backward may run it later, on another stream,
// and run_backward beside B1). With the scan beside B1, U and dh get their own bytes (the scan reads U, B1
// writes dh).
std::unique_ptr<BwdState> start_backward(const Params& p, bool with_states, Beside beside = Beside::never) {
  check_tiled_supported(p);
  DELTACP_CHECK(p.K <= kMaxKeyDim, "K", "expected K <= ", kMaxKeyDim, " for the tiled backward, got ", p.K);
  DELTACP_CHECK(p.state_dtype == DType::f32, "state_dtype", "expected float32 states on the GPU, got ",
                to_string(p.state_dtype));
  DELTACP_CHECK(p.HV <= 65535, "HV", "expected at most 65535 value heads for the tiled backward, got ", p.HV);
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  auto state = std::make_unique<BwdState>(p, stream);
  const ChunkTable& table = state->table;
  Workspace& ws = state->ws;
  DELTACP_CHECK(table.num_chunks() <= INT_MAX, "T", "expected at most ", INT_MAX,
                " chunks for the tiled backward, got ", table.num_chunks());

  const bool gated = p.variant != Variant::delta;
  const int64_t R = p.B * p.T, NC = table.num_chunks();
  const int64_t es = dtype_size(p.dtype);
  const FwdSizes fs = fwd_sizes(p, table);

  // dh0-only (Params::dh0_only, the CP backward pre-pass): dh0 needs only W, Kd (B1's operands) and
  // B0's dVn_local, so the forward's state scan (h, v_new) and stages B2-B5 are skipped with their
  // workspaces, and B1 writes neither dh per chunk nor dVn.
  const bool dh0_only = p.dh0_only();
  // The forward kept h and v_new (Params::chunk_h): no state scan, and no workspace for them.
  const bool kept = p.chunk_h != nullptr;  // dispatch.cu refuses them with dh0_only
  state->beside = with_states && !dh0_only && !kept &&
                  (beside == Beside::always || (beside == Beside::where_narrow && b1_grid_narrow(p, table)));
  const bool u_apart = state->beside;
  state->local = !dh0_only && use_local_wgmma(p);
  state->local_kda = !dh0_only && use_local_kda(p);  // kda only, so never beside local (gdn, delta)
  state->local_kda_decay = state->local_kda && use_local_kda_decay(p);
  const bool local16 = local_inputs_16bit(p, state->local || state->local_kda);
  // The WY stage kept by the forward (Params::wy_stage): G, T (16-bit), W (kda: Kd and Q e^G) read from its planes,
  // and stage B0 alone in place of the recompute, where the recompute would write exactly those (its wgmma kernel
  // with B0, T in 16 bits for the chunk-local kernel) and the forward kept its states (no state scan reads U).
  const bool recompute_matches = p.variant == Variant::kda ? state->local_kda && use_kda_recompute_wgmma(p)
                                                           : gdn_recompute_matches_wy_stage(p);
  const bool stage_kept = kept && p.wy_stage != nullptr && local16 && recompute_matches;
  const int64_t bG = stage_kept ? 0 : fs.G * 4, bW = stage_kept ? 0 : fs.W * es, bU = fs.U * es,
                bKd = stage_kept ? 0 : fs.Kd * es, bT = stage_kept ? 0 : fs.Tinv * 4,
                bvn = dh0_only || kept ? 0 : fs.v_new * es, bh = dh0_only || kept ? 0 : fs.h * es;
  const int64_t bQg = p.variant == Variant::kda && !stage_kept ? R * p.HV * padded_dim(p.K) * es : 0;  // Q e^G
  const int64_t bdh = dh0_only ? 0 : NC * p.HV * p.K * p.V * es, bdvn = R * p.HV * p.V * 4;
  // Region 1, live through the whole backward. U is read by the state scan only and dh is written from
  // B1 on: where B1 runs after the scan (the staged backward, and the one-shot one with the scan on the same
  // stream) they share bytes; beside it (u_apart) U takes its own.
  Carver c;
  const size_t oG = c.take(bG), oT = c.take(bT), oh = c.take(bh), ovn = c.take(bvn), odvn = c.take(bdvn),
               odh = c.take(u_apart ? bdh : std::max(bU, bdh)), oU = u_apart ? c.take(bU) : odh;
  // Region 2: W, Kd and Q e^G until B1 has read them, then the buffers of one slice of B2..B5.
  const size_t x0 = c.off;
  Carver before;
  const size_t oW = x0 + before.take(bW), oKd = x0 + before.take(bKd), oQg = x0 + before.take(bQg);
  // With no stage B4 the slice keeps what the fused gdn / delta kernel's does: dq and dk of grouped value heads.
  const bool slice_local = state->local || state->local_kda_decay;
  if (!dh0_only && NC > 0) {
    const int64_t cap = slice_chunks(p, NC, before.off, slice_local, state->local_kda);
    const auto& hc = table.host_chunks();
    int64_t max_rows = 0;
    for (int64_t c0 = 0; c0 < NC; c0 += cap) {
      const int64_t c1 = std::min(NC, c0 + cap);
      state->slices.push_back(c0);
      max_rows = std::max(max_rows, hc[c1 - 1].row0 + hc[c1 - 1].len - hc[c0].row0);
    }
    state->slices.push_back(NC);
    state->slice = slice_layout(p, cap, max_rows, slice_local, state->local_kda);
  }
  ws.allocate(x0 + std::max(before.off, state->slice.total));
  state->slice_base = ws.at<char>(x0, 1);

  const WyStagePlanes pl = WyStagePlanes::of(p.variant);
  auto plane = [&](int64_t start) { return start < 0 ? nullptr : WyStagePlanes::at(p.wy_stage, start, R * p.HV); };
  float* G = stage_kept ? static_cast<float*>(plane(pl.G)) : ws.at<float>(oG, bG);
  void* W = stage_kept ? plane(pl.W) : ws.at<void>(oW, bW);
  void* U = ws.at<void>(oU, bU);
  void* Kd = stage_kept ? plane(pl.Kd) : ws.at<void>(oKd, bKd);
  float* Tinv = stage_kept ? static_cast<float*>(plane(pl.T)) : ws.at<float>(oT, bT);
  void* vnew = kept ? p.chunk_vnew : ws.at<void>(ovn, bvn);
  void* h = kept ? p.chunk_h : ws.at<void>(oh, bh);

  float* dvnew = ws.at<float>(odvn, bdvn);
  void* Qg = stage_kept ? plane(pl.Qg) : ws.at<void>(oQg, bQg);
  WyDone wy;
  if (stage_kept) {
    launch_bwd_b0_kept(p, table, plane(pl.P), dvnew, stream);
    wy.dv_local = true;
    wy.t16 = true;
  } else if (use_kda_recompute_wgmma(p)) {  // (=1 for gdn / delta raises: the refusal says it implements kda)
    // T in 16 bits only for the chunk-local kernel (B3's fallback reads it in fp32): local16 implies it for kda.
    const bool t16 = local16 && state->local_kda;
    launch_kda_bwd_recompute(p, table, G, W, U, Kd, Tinv, t16, Qg, dvnew, stream);
    wy.dv_local = true;
    wy.t16 = t16;
  } else {
    launch_chunk_cumsum(p, table, G, stream);
    wy = launch_chunk_wy(p, table, G, W, U, Kd, Tinv, stream, dvnew, local16);
  }
  state->U = U;
  state->h = h;
  state->vnew = vnew;

  Args& a = state->a;
  a.B = p.B;
  a.T = p.T;
  a.H = p.H;
  a.HV = p.HV;
  a.K = p.K;
  a.V = p.V;
  a.group = p.HV / p.H;
  a.num_chunks = NC;
  a.Kp = padded_dim(p.K);
  a.Vp = padded_dim(p.V);
  a.scale = static_cast<float>(p.scale);
  a.gated = gated;
  a.q = p.q;
  a.k = p.k;
  a.v = p.v;
  a.g = p.g;
  a.beta = p.beta;
  a.dout = p.dout;
  a.g_fp32 = p.g_fp32;
  set_gradient_outputs(a, p);
  a.chunks = table.chunks();
  a.seqs = table.seqs();
  a.G = G;
  a.Tinv = Tinv;
  a.W = W;
  a.vnew = vnew;
  a.h = h;
  a.Kd = Kd;
  a.Qg = Qg;
  a.chunk_size = p.chunk_size;
  a.dh = ws.at<void>(odh, bdh);  // null in the dh0-only mode (bdh = 0)
  a.dh0_only = dh0_only;
  a.dvnew = dvnew;
  a.dv_local_done = wy.dv_local;
  a.t16 = wy.t16;
  a.dvn16 = local16 && use_dh_scan_wgmma(a, p.dtype == DType::bf16 || p.dtype == DType::f16,
                                         p.variant == Variant::kda);
  // dW .. dbw: per slice (slice_args).

  if (dh0_only || kept) state->states_done = true;  // nothing reads h, or the forward wrote it
  else if (with_states && !state->beside) launch_states(*state, stream);
  return state;
}

// ---- B1 in pieces: intra-card CP of the reverse chain ---------------------------------------------------
// Where a few long sequences leave B1's grid narrow (its CTAs walk every chunk of a sequence: 16 CTAs of 1024
// chunks at (1, 65536, 8, 128)), B1 runs on pieces of whole chunks side by side, each from its true dS' at the
// piece's end. The algebra is the forward's (section 3.2 of docs/design.md) transposed: a piece j entered with
// S leaves with M_j S + H_j, so dL/d(its start) = M_j^T dL/d(its end) + dH_j, where dH_j is what the piece's
// own outputs contribute (B1's dh0-only mode over the piece from a zero dS'). For a sequence of pieces
// 0 .. P-1 and dS'_{P-1} = dht:
//   maps   M_j of pieces P-1 .. 1 (the forward's pass 1, launch_pass1: [H_j | M_j] from [0 | I]; M_j reads
//          W, K and G only, not U, whose bytes B1 takes for dh unless the state scan runs beside B1)
//   dH     dH_j of the same pieces, side by side (B1 dh0-only from zero)
//   fold   dS'_{j-1} = M_j^T dS'_j + dH_j for j = P-1 .. 1: the forward's fold (launch_fold_starts) over the
//          pieces in reverse order with the maps [dH_j | M_j^T] (build_reverse_maps_kernel)
//   B1     every piece from its dS'_j, storing dh and dVn; dh0 of the sequence = dS of piece 0's first chunk
// Exact like the forward's pieces: M_j is carried through the scan's 16-bit products, the fold is fp32-level.
// DELTACP_TILED_DH_PIECE=<tokens> forces the piece length (0: never cut); unset, dh_piece_plan below.
// Measured (NVIDIA H200, bf16, (1,65536,8,128), stage_times.py --backward, 2026-11-25): gdn's wgmma B1 2.99 ms
// whole, 0.65 in the default plan's 8 pieces of 128 chunks, 0.56 in pieces of 64 chunks (maps and fold about
// the same: the heuristic's length is not tuned), 1.29 in pieces of 256; kda's mma.sync B1 4.26 -> 1.47 ms.
// Around them: the pieces' maps 0.26 ms, the fold 0.03, the reverse maps 0.06.

// maps_out[r] = [dH[r] | M[r]^T] for r < rows: dH [rows, HV, K, V], maps [rows, HV, K, V + K] ([H | M]; M is
// the last K columns), maps_out the same shape as maps. Grid (rows, HV), 256 threads.
__global__ void build_reverse_maps_kernel(const float* __restrict__ maps, const float* __restrict__ dH,
                                          float* __restrict__ maps_out, int64_t HV, int64_t K, int64_t V) {
  const int64_t W = V + K, rh = static_cast<int64_t>(blockIdx.x) * HV + blockIdx.y;
  const float* M = maps + rh * K * W + V;
  const float* d = dH + rh * K * V;
  float* out = maps_out + rh * K * W;
  for (int64_t i = threadIdx.x; i < K * W; i += blockDim.x) {
    const int64_t r = i / W, c = i % W;
    out[i] = c < V ? d[r * V + c] : M[(c - V) * W + r];
  }
}

// The pieces B1 runs on, or an uncut plan. Unset, B1 is cut where its whole-sequence grid (V / 64 CTAs per
// sequence and head) fills less than half the SMs and the longest sequence has more than two pieces' chunks:
// pieces of L chunks with L such that the pieces' CTAs about fill the SMs (at least 16 chunks a piece, so
// that a piece's maps, dH and its share of the fold stay small beside its walk). Never where the maps' state
// (V + K columns, padded) is wider than the scans take.
ScanPlan dh_piece_plan(const Params& p, const std::vector<SeqEntry>& seqs) {
  const int64_t env = piece_tokens_from_env("DELTACP_TILED_DH_PIECE");
  if (env == 0 || seqs.empty() || p.dh0_only()) return {};
  int64_t most = 0;
  for (const SeqEntry& s : seqs) most = std::max(most, s.num_chunks);
  const bool fits = padded_dim(p.V) + padded_dim(p.K) <= kMaxHeadDim;
  if (env > 0) {
    const int64_t L = std::max<int64_t>(1, (env + p.chunk_size - 1) / p.chunk_size);
    if (most <= L) return {};
    DELTACP_CHECK(fits, "DELTACP_TILED_DH_PIECE", "B1 in pieces folds a state V + K wide, at most ", kMaxHeadDim,
                  " columns padded; got K = ", p.K, ", V = ", p.V);
    return plan_pieces(p, seqs, L);
  }
  if (!fits) return {};
  const int64_t sms = sm_count();
  const int64_t ctas = static_cast<int64_t>(seqs.size()) * p.HV * ((p.V + 63) / 64);
  if (2 * ctas >= sms) return {};
  int64_t L = (most * ctas + sms - 1) / sms;
  L = std::max<int64_t>(16, (L + 15) / 16 * 16);
  if (most <= 2 * L) return {};
  return plan_pieces(p, seqs, L);
}

template <class Op, int KP, bool PERKEY>
void launch_dh_scan_in_pieces(const BwdState& s, const Args& a, const ScanPlan& plan, cudaStream_t stream) {
  const Params& p = s.p;
  const int64_t N = s.table.num_seqs(), HV = p.HV, K = p.K, V = p.V, W = V + K;
  // Pieces P-1 .. 1 of every cut sequence, in that order: row r of the maps, dH and the reverse maps.
  std::vector<int64_t> back;
  std::vector<int64_t> first_back(static_cast<size_t>(N), -1);
  for (int64_t n = 0; n < N; ++n) {
    if (plan.pieces_of(n) < 2) continue;
    first_back[static_cast<size_t>(n)] = static_cast<int64_t>(back.size());
    for (int64_t i = plan.first_piece[n + 1] - 1; i > plan.first_piece[n]; --i) back.push_back(i);
  }
  // The plan with every sequence's pieces in reverse order: the fold's and the last B1's table.
  ScanPlan rev = plan;
  for (int64_t n = 0; n < N; ++n)
    std::reverse(rev.pieces.begin() + plan.first_piece[n], rev.pieces.begin() + plan.first_piece[n + 1]);
  const int64_t R = static_cast<int64_t>(back.size()), P = static_cast<int64_t>(plan.pieces.size());
  auto align = [](size_t b) { return (b + 255) / 256 * 256; };
  const size_t b_maps = align(static_cast<size_t>(R * HV * K * W) * 4), b_dH = align(static_cast<size_t>(R * HV * K * V) * 4);
  const size_t b_starts = align(static_cast<size_t>(P * HV * K * V) * 4);
  const size_t b_dh0 = a.dh0 != nullptr ? b_starts : 0;
  char* ws = static_cast<char*>(workspace_alloc(2 * b_maps + b_dH + b_starts + b_dh0, stream));
  try {
    float* maps = reinterpret_cast<float*>(ws);
    float* rmaps = reinterpret_cast<float*>(ws + b_maps);
    float* dH = reinterpret_cast<float*>(ws + 2 * b_maps);
    float* starts = reinterpret_cast<float*>(ws + 2 * b_maps + b_dH);
    float* piece_dh0 = b_dh0 ? reinterpret_cast<float*>(ws + 2 * b_maps + b_dH + b_starts) : nullptr;
    if (R > 0) {
      launch_pass1(p, plan, back, a.G, a.W, s.U, a.Kd, maps, stream);
      std::vector<SeqEntry> back_pieces;
      for (int64_t i : back) back_pieces.push_back(plan.pieces[static_cast<size_t>(i)]);
      const ChunkTable bt(std::move(back_pieces), p.chunk_size, stream);
      Args d = a;
      d.seqs = bt.seqs();
      d.dht = nullptr;
      d.dh0 = dH;
      d.dh = nullptr;
      d.dh0_only = true;
      launch_stages<Op, KP, PERKEY>(d, R, stream, Stages::dh_scan_only);
      build_reverse_maps_kernel<<<dim3(static_cast<unsigned>(R), static_cast<unsigned>(HV)), 256, 0, stream>>>(
          maps, dH, rmaps, HV, K, V);
      DELTACP_CUDA_CHECK_LAUNCH();
    }
    std::vector<const float*> seq_maps(static_cast<size_t>(N), nullptr);
    for (int64_t n = 0; n < N; ++n)
      if (first_back[static_cast<size_t>(n)] >= 0) seq_maps[static_cast<size_t>(n)] = rmaps + first_back[static_cast<size_t>(n)] * HV * K * W;
    const PieceTables tables(p, rev, seq_maps, stream);
    launch_fold_starts(p, tables, N, a.dht, starts, stream);  // starts[first + j'] = dS' of piece P-1-j'
    Args f = a;
    f.seqs = tables.pieces().seqs();
    f.dht = starts;
    f.dh0 = piece_dh0;
    launch_stages<Op, KP, PERKEY>(f, P, stream, Stages::dh_scan_only);
    if (a.dh0 != nullptr) launch_gather_final_states(p, tables, N, piece_dh0, a.dh0, stream);  // piece 0 is last
  } catch (...) {
    workspace_free(ws, stream);
    throw;
  }
  workspace_free(ws, stream);
}

// B1 beside the chunk-local kernel, chunk by chunk (bwd_handoff.cuh): where and with how many B1 CTAs.
// DELTACP_TILED_BWD_HANDOFF (common/kernel_switch.h): unset = where it applies; 0 = never (B1, then the chunk-local
// kernel); 1 = required (an error names why it cannot run).
struct HandoffPlan {
  bool on = false;
  int need = 0, ctas = 0;  // B1 CTAs per value head, in all
  int64_t per_seq = 0;     // chunks of every sequence
};
HandoffPlan handoff_plan(const BwdState& s, const Args& a, int64_t num_seqs, bool pieces, bool scan_beside) {
  HandoffPlan h;
  h.on = kernel_switch("DELTACP_TILED_BWD_HANDOFF", "B1 beside the chunk-local kernel", [&]() -> const char* {
    if (a.dh0_only || a.num_chunks == 0 || num_seqs <= 0) return "there are no chunk-local gradients to compute";
    if (!(s.local || s.local_kda_decay))
      return "the chunk-local stages do not run as one kernel (16-bit inputs, K = V = 128, Hopper; kda: bf16)";
    if (s.slices.size() != 2 || s.slice.total != 0)
      return "the chunk-local stages take more than one slice, or buffers of their own (grouped value heads)";
    if (pieces) return "B1 runs in pieces (few long sequences)";
    if (scan_beside) return "B1 runs beside the recompute's state scan (the forward kept no chunk states)";
    const bool is16 = s.p.dtype == DType::bf16 || s.p.dtype == DType::f16;
    if (!use_dh_scan_wgmma(a, is16, s.p.variant == Variant::kda)) return "B1 does not run on the wgmma scan";
    const auto& seqs = s.table.host_seqs();
    h.per_seq = seqs.front().num_chunks;
    for (const SeqEntry& q : seqs)
      if (q.num_chunks != h.per_seq) return "the sequences do not all have the same number of chunks";
    const int nwg = dh_scan_warpgroups(num_seqs * a.HV);
    h.need = dh_scan_col_blocks(nwg);
    const int64_t ctas = num_seqs * a.HV * h.need;
    if (ctas >= sm_count()) return "B1's CTAs fill every SM";
    h.ctas = static_cast<int>(ctas);
    if (stream_capturing(static_cast<cudaStream_t>(s.p.stream)))
      return "the stream is being captured into a CUDA graph (a graph may run the two branches one after the other)";
    return nullptr;
  });
  return h;
}

// The kernels' template configuration of p: f(op tag, KP, PERKEY) with compile-time KP and PERKEY.
template <class F>
void with_config(const Params& p, F&& f) {
  dispatch_dtype(p.dtype, [&](auto tag) {
    const bool perkey = p.variant == Variant::kda;
    if (p.K <= 64) {
      if (perkey) f(tag, std::integral_constant<int, 64>{}, std::true_type{});
      else f(tag, std::integral_constant<int, 64>{}, std::false_type{});
    } else {
      if (perkey) f(tag, std::integral_constant<int, 128>{}, std::true_type{});
      else f(tag, std::integral_constant<int, 128>{}, std::false_type{});
    }
  });
}

// B0 and B1 as `which` says, then (all, after_b0) B2..B5 slice after slice, on the prepared stream. With
// beside_b1 (the one-shot backward's state scan), B1 runs on the side stream (common/side_stream.h) after
// everything before it, beside_b1() on the prepared stream meanwhile, and B2.. after both.
void run_stages(const BwdState& s, const Args& a, int64_t num_seqs, Stages which,
                const std::function<void()>& beside_b1 = {}) {
  with_config(s.p, [&](auto tag, auto kp, auto perkey) {
    using Op = typename decltype(tag)::type;
    constexpr int KP = decltype(kp)::value;
    constexpr bool PERKEY = decltype(perkey)::value;
    const cudaStream_t stream = static_cast<cudaStream_t>(s.p.stream);
    const bool full = !a.dh0_only && (which == Stages::all || which == Stages::after_b0);
    const ScanPlan pieces = full ? dh_piece_plan(s.p, s.table.host_seqs()) : ScanPlan{};
    auto b1 = [&](cudaStream_t on) {
      if (pieces.cut()) {
        if (num_seqs * a.HV > 0 && a.V > 0) launch_dh_scan_in_pieces<Op, KP, PERKEY>(s, a, pieces, on);
      } else {
        launch_stages<Op, KP, PERKEY>(a, num_seqs, on, Stages::after_b0);
      }
    };
    if (which == Stages::all || which == Stages::through_b0)
      launch_stages<Op, KP, PERKEY>(a, num_seqs, stream, Stages::through_b0);
    if (which == Stages::through_b0) return;
    const HandoffPlan h = full ? handoff_plan(s, a, num_seqs, pieces.cut(), static_cast<bool>(beside_b1))
                               : HandoffPlan{};
    if (which == Stages::dh_scan_only) {
      launch_stages<Op, KP, PERKEY>(a, num_seqs, stream, which);
    } else if (beside_b1) {
      const cudaStream_t side = side_stream();
      ForkJoin fork(stream, side);  // on an exception, its destructor still joins
      b1(side);
      beside_b1();
      fork.join();
    } else if (h.on) {
      // B1 on the side stream, the gate and the chunk-local kernel on the caller's (bwd_handoff.cuh).
      const int64_t counts = a.num_chunks * a.HV + 1;
      int* flags = static_cast<int*>(workspace_alloc(static_cast<size_t>(counts) * sizeof(int), stream));
      try {
        DELTACP_CUDA_CHECK(cudaMemsetAsync(flags, 0, static_cast<size_t>(counts) * sizeof(int), stream));
        Args b = a;
        b.handoff.ready = flags;
        b.handoff.started = flags + a.num_chunks * a.HV;
        b.handoff.need = h.need;
        b.handoff.seqs = num_seqs;
        b.handoff.per_seq = h.per_seq;
        const cudaStream_t side = side_stream();
        ForkJoin fork(stream, side);  // the side stream waits for the zeroed counts; on an exception it still joins
        launch_stages<Op, KP, PERKEY>(b, num_seqs, side, Stages::after_b0);
        b1_started_gate_kernel<<<1, 32, 0, stream>>>(b.handoff.started, h.ctas);
        DELTACP_CUDA_CHECK_LAUNCH();
        int64_t row0 = 0, rows = 0;
        Args x = slice_args(s, a, s.slices[0], s.slices[1], &row0, &rows);
        x.handoff = b.handoff;
        launch_slice<Op, KP, PERKEY>(x, row0, rows, s.local, s.local_kda, s.local_kda_decay, stream);
        fork.join();
      } catch (...) {
        workspace_free(flags, stream);
        throw;
      }
      workspace_free(flags, stream);
      return;
    } else {
      b1(stream);
    }
    if (!full) return;
    for (size_t i = 0; i + 1 < s.slices.size(); ++i) {
      int64_t row0 = 0, rows = 0;
      const Args x = slice_args(s, a, s.slices[i], s.slices[i + 1], &row0, &rows);
      launch_slice<Op, KP, PERKEY>(x, row0, rows, s.local, s.local_kda, s.local_kda_decay, stream);
    }
  });
}

void run_backward(const Params& p) {
  const auto s = start_backward(p, /*with_states=*/true, beside_b1_switch(p));
  if (s->beside) {
    BwdState& st = *s;
    run_stages(st, st.a, st.table.num_seqs(), Stages::all,
               [&] { launch_states(st, static_cast<cudaStream_t>(st.p.stream)); });
  } else {
    run_stages(*s, s->a, s->table.num_seqs(), Stages::all);
  }
  // s's workspace and table free themselves stream-ordered, after the kernels above (the side stream's
  // work is joined to the caller's stream before B2).
}

// ---- the staged backward (api.h) ----------------------------------------------------------------
void same_problem(const Params& a, const Params& b, const char* what) {
  DELTACP_CHECK(a.variant == b.variant && a.dtype == b.dtype && a.B == b.B && a.H == b.H && a.HV == b.HV &&
                    a.K == b.K && a.V == b.V && a.chunk_size == b.chunk_size && a.q.ptr == b.q.ptr &&
                    a.k.ptr == b.k.ptr && a.v.ptr == b.v.ptr && a.dout.ptr == b.dout.ptr,
                "params", what, ": expected the prepared problem (the same variant, dtype, shapes, chunk size and "
                "q, k, v, do tensors)");
}

std::unique_ptr<StagedBackward> prepare_backward(const Params& p) {
  DELTACP_CHECK(!p.dh0_only(), "dq", "expected input gradients for a staged backward (the dh0-only mode runs "
                "in one call)");
  auto s = start_backward(p, /*with_states=*/false);
  run_stages(*s, s->a, s->table.num_seqs(), Stages::through_b0);
  return s;
}

void backward_states(StagedBackward& staged, void* stream) {
  auto& s = dynamic_cast<BwdState&>(staged);
  DELTACP_CHECK(!s.finished, "state", "expected a prepared backward that has not finished yet");
  DELTACP_CHECK(!s.states_done, "state", "expected a prepared backward whose states have not been recomputed yet");
  launch_states(s, static_cast<cudaStream_t>(stream));
}

void backward_dh0_pieces(StagedBackward& staged, const Params& pieces) {
  auto& s = dynamic_cast<BwdState&>(staged);
  DELTACP_CHECK(!s.finished, "state", "expected a prepared backward that has not finished yet");
  DELTACP_CHECK(pieces.dh0_only(), "dh0", "expected a dh0-only problem for the pieces (dh0 and no input "
                "gradients)");
  DELTACP_CHECK(s.p.B == 1 && pieces.B == 1 && pieces.T <= s.p.T, "cu_seqlens",
                "expected packed sequences (B = 1) and pieces over the first rows of the prepared problem");
  same_problem(s.p, pieces, "the pieces");
  cudaStream_t stream = static_cast<cudaStream_t>(pieces.stream);
  const ChunkTable table(pieces, s.p.chunk_size, stream);
  // B1 then reads the prepared W, Kd, G, Q e^G and B0's dVn rows of the pieces' chunks (all indexed by token row).
  check_pieces_on_prepared_chunks(s.table, table, 0, "backward");
  Args a = s.a;
  a.T = pieces.T;
  a.chunks = table.chunks();
  a.seqs = table.seqs();
  a.num_chunks = table.num_chunks();
  a.dht = static_cast<const float*>(pieces.dht);
  a.dh0 = static_cast<float*>(pieces.dh0);
  a.dh = nullptr;
  a.dh0_only = true;
  with_config(s.p, [&](auto tag, auto kp, auto perkey) {
    using Op = typename decltype(tag)::type;
    launch_stages<Op, decltype(kp)::value, decltype(perkey)::value>(a, table.num_seqs(), stream,
                                                                     Stages::dh_scan_only);
  });
}

void finish_backward(StagedBackward& staged, const Params& p) {
  auto& s = dynamic_cast<BwdState&>(staged);
  DELTACP_CHECK(!s.finished, "state", "expected a prepared backward that has not finished yet");
  same_problem(s.p, p, "finish");
  DELTACP_CHECK(same_sequences(p, s.p), "cu_seqlens", "finish: expected the prepared sequences");
  set_gradient_outputs(s.a, p);
  s.finished = true;
  if (!s.states_done) launch_states(s, static_cast<cudaStream_t>(s.p.stream));
  run_stages(s, s.a, s.table.num_seqs(), Stages::after_b0);
}
}  // namespace
}  // namespace tiled::bwd

void tiled_backward(const Params& p) { tiled::bwd::run_backward(p); }
std::unique_ptr<StagedBackward> tiled_backward_prepare(const Params& p) { return tiled::bwd::prepare_backward(p); }
void tiled_backward_dh0_pieces(StagedBackward& s, const Params& pieces) {
  tiled::bwd::backward_dh0_pieces(s, pieces);
}
void tiled_backward_finish(StagedBackward& s, const Params& p) { tiled::bwd::finish_backward(s, p); }
void tiled_backward_states(StagedBackward& s, void* stream) { tiled::bwd::backward_states(s, stream); }

}  // namespace deltacp::cuda
