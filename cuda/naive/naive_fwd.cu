// cuda/naive/naive_fwd.cu — naive tier, forward: the token recurrence, one block per
// (sequence, value head, tile of value columns), the fp32 state in registers.
//
// Algorithm (docs/design.md section 2), for each token t of the block's sequence, in order:
//   gdn, kda, delta:  Sd = D_t S;  u = beta_t (v_t - Sd^T k_t);  S = Sd + k_t u^T
//   dplr:             S = D_t S + k_t v_t^T + b_t (a_t^T S)
//   o_t = S^T (scale q_t)
// starting from h0 (or zero) and writing ht = S after the last token when asked. With o null (the
// final-state-only forward of params.h, the CP pre-pass) the output dot products and stores are
// skipped: only ht is written.
//
// Work split (naive_common.cuh): the block owns kFwdWarps * CPW value columns; each warp owns CPW
// of them; lane l holds rows l, l + 32, ... of each column (KPT rows, K <= 32 KPT). A column's
// dot products (k . S[:, j], a . S[:, j], q . S[:, j]) are warp sums, so the warps never talk and
// the kernel has no __syncthreads and no shared memory. The key-side vectors of a token are read
// by every warp of the block from global memory (L1 serves the repeats).
//
// What changed from the previous tier: this is the first tier (the baseline after the Eigen
// reference, reference/src/recurrence.cpp, which it mirrors line by line).
// Measured (NVIDIA H200, 2026-11-22, bf16 GDN forward): (4,2048,16,128) 5.39 ms, (1,8192,96,128)
// 22.0 ms, (2,16384,16,128) 42.0 ms, (4,4096,64,128) 22.8 ms; KDA (4,2048,16,128) 10.0 ms: one token
// after another, the baseline the tiled tier is measured against (docs/perf.md).
#include <cuda_runtime.h>

#include <climits>

#include "../common/check.h"
#include "../common/load_store.cuh"
#include "deltacp/cuda/tiers.h"
#include "naive_common.cuh"

namespace deltacp::cuda {
namespace naive {
namespace {

constexpr int kFwdWarps = 4;
constexpr int kFwdThreads = kFwdWarps * kWarpSize;

template <int KPT>
__host__ __device__ constexpr int fwd_cols_per_warp() {
  return 32 / KPT;  // 8 columns (K <= 128) or 4 (K <= 256): 32 fp32 state registers per lane
}
template <int KPT>
__host__ __device__ constexpr int fwd_block_cols() {
  return kFwdWarps * fwd_cols_per_warp<KPT>();
}

template <Variant VAR, class T, int KPT>
__global__ void __launch_bounds__(kFwdThreads)
    naive_forward_kernel(Inputs<T> in, Strided<T> o, float* ht, int64_t num_vtiles) {
  constexpr int CPW = fwd_cols_per_warp<KPT>();
  constexpr int BV = fwd_block_cols<KPT>();
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  // blockIdx.x = (n * HV + hv) * num_vtiles + vt  (a 1-D grid: no 65535 limit on N or HV)
  const int64_t blk = blockIdx.x;
  const int64_t vt = blk % num_vtiles;
  const int64_t hv = (blk / num_vtiles) % in.HV;
  const int64_t n = blk / (num_vtiles * in.HV);
  const int64_t h = hv / in.group;
  const Span sp = sequence_span(in.cu_seqlens, n, in.T);
  const int64_t col0 = vt * BV + static_cast<int64_t>(warp) * CPW;  // this warp's first value column

  float s[CPW][KPT];
  load_state_columns<CPW, KPT>(s, in.h0, n, hv, col0, lane, in.HV, in.K, in.V);
  const bool write_o = o.ptr != nullptr;  // false: final-state-only forward (uniform over the grid)

  for (int64_t t = sp.bos; t < sp.eos; ++t) {
    TokenKeys<KPT> tk;
    load_token<VAR, true>(tk, in, sp.batch, t, h, hv, lane);
    const T* vrow = in.v.at(sp.batch, t, hv);
#pragma unroll
    for (int c = 0; c < CPW; ++c) {
      const int64_t col = col0 + c;
      if (col < in.V) {  // uniform across the warp: the warp sums inside stay convergent
        step_column<VAR, KPT>(s[c], tk, load_f(vrow + col));
        if (write_o) {
          float out = 0.f;
#pragma unroll
          for (int i = 0; i < KPT; ++i) out += tk.q[i] * s[c][i];
          out = warp_sum(out);
          if (lane == 0) store_f(o.at(sp.batch, t, hv) + col, out);
        }
      }
    }
  }
  if (ht) store_state_columns<CPW, KPT>(ht, s, n, hv, col0, lane, in.HV, in.K, in.V);
}

template <Variant VAR, class T, int KPT>
void launch_forward(const Params& p, cudaStream_t stream) {
  constexpr int BV = fwd_block_cols<KPT>();
  const int64_t num_vtiles = (p.V + BV - 1) / BV;
  const int64_t blocks = p.num_seqs * p.HV * num_vtiles;
  DELTACP_CHECK(blocks <= INT_MAX, "num_seqs", "expected num_seqs * HV * ceil(V / ", BV, ") <= ", INT_MAX,
                " blocks for the naive forward, got ", blocks);
  if (blocks == 0) return;
  naive_forward_kernel<VAR, T, KPT><<<static_cast<unsigned>(blocks), kFwdThreads, 0, stream>>>(
      make_inputs<T>(p), strided<T>(p.o), static_cast<float*>(p.ht), num_vtiles);
  DELTACP_CUDA_CHECK_LAUNCH();
}

}  // namespace
}  // namespace naive

void naive_forward(const Params& p) {
  const int kpt = naive::rows_per_lane(p.K);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  dispatch_dtype(p.dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    naive::dispatch_variant(p.variant, [&](auto variant_tag) {
      constexpr Variant VAR = decltype(variant_tag)::value;
      if (kpt == 4)
        naive::launch_forward<VAR, T, 4>(p, stream);
      else
        naive::launch_forward<VAR, T, 8>(p, stream);
    });
  });
}

}  // namespace deltacp::cuda
