// cuda/naive/naive_bwd.cu — naive tier, backward: the token recurrence in reverse, one block per
// (sequence, value head, tile of value columns), S and dS in registers, states recomputed from
// checkpoints.
//
// Gradients of L = sum(o * do) + sum(ht * dht). With dS = dL/dS_t, starting from dht (or zero),
// each token t = last .. first (the same formulas as reference/src/recurrence.cpp):
//   dS += (scale q_t) do_t^T;          dq_t = scale S_t do_t
//   gdn, kda, delta (Sd = D_t S_{t-1}, pred = Sd^T k_t, u = beta_t (v_t - pred)):
//     du = dS^T k_t;  dv_t = beta_t du;  dbeta_t = du . (v_t - pred);  dpred = -beta_t du
//     dk_t = dS u + Sd dpred;  dSd = dS + k_t dpred^T;  dlogD_i = sum_j dSd_ij Sd_ij;  dS = D_t dSd
//     (gdn: dg_t = sum_i dlogD_i; kda: dg_t = dlogD)
//   dplr (r = S_{t-1}^T a_t):
//     dk_t = dS v_t;  dv_t = dS^T k_t;  db_t = dS r;  w = dS^T b_t;  da_t = S_{t-1} w
//     dgk_t,i = sum_j dS_ij (D_t S_{t-1})_ij;  dS = D_t dS + a_t w^T
//   dh0 = dS after the first token.
//
// Each column j of S and dS evolves on its own (naive_common.cuh), so a block owns a tile of
// BV = kBwdWarps * CPW value columns: warp w owns CPW columns, lane l rows l, l + 32, ... .
// dv_t[j] and dh0[:, j] belong to one column and are written directly. dq, dk, dg, da, db, dbeta
// sum over all V columns: per token, each lane sums its rows over its warp's columns in
// registers, the warps add through shared memory (double-buffered: one __syncthreads per token),
// and the block writes its tile's partial sum to an fp32 workspace [grad][vtile][B*T][HV][K].
// A second kernel adds the tiles (and, for dq/dk, the value heads of a group) in a fixed order and
// writes the gradients in the input dtype. No atomics: two runs give bitwise equal results.
//
// States for the reverse walk (S_{t-1} at each token) come from recomputation:
//   phase 1: run the forward from h0, saving S at the start of every interval of C = 64 tokens
//            (global fp32 checkpoints [slot][HV][V][K], column-major per state for coalescing);
//   phase 2: for each interval, last to first: reload its checkpoint, recompute its (<= C) states
//            forward into per-block global scratch [C][BV][K], then walk its tokens in reverse.
// Each thread reads back only what it wrote itself, so the scratch needs no synchronisation.
// Memory: checkpoints (B*T/C + N) HV V K floats, scratch N HV V min(C, longest) K floats,
// partials (#grads) ceil(V/BV) B*T HV K floats; compute is two forwards plus the reverse walk.
//
// dh0-only backward (params.h: dh0 given, every input gradient null; the CP backward pre-pass):
// the same reverse walk of dS, but no dv store, no per-token block reduction (no barriers, no
// shared memory), no partials workspace and no reduce kernels; only dh0 is written.
//
// What changed from the previous tier: first tier (mirrors the reference's recurrent_backward,
// which keeps every state on the host; here only checkpoints and one interval of states).
// Measured (NVIDIA H200, 2026-11-22, bf16, forward+backward at (4,2048,16,128)): GDN 30.6 ms,
// KDA 45.8 ms.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "../common/check.h"
#include "../common/device_info.h"
#include "../common/load_store.cuh"
#include "../common/seq_bounds.h"
#include "../common/workspace_pool.h"
#include "deltacp/cuda/tiers.h"
#include "naive_common.cuh"

namespace deltacp::cuda {
namespace naive {
namespace {

constexpr int kBwdWarps = 8;
constexpr int kBwdThreads = kBwdWarps * kWarpSize;
constexpr int64_t kCheckpointInterval = 64;  // C: tokens between saved states

template <int KPT>
__host__ __device__ constexpr int bwd_cols_per_warp() {
  return 32 / KPT;  // S and dS: 2 * 32 fp32 registers per lane
}
template <int KPT>
__host__ __device__ constexpr int bwd_block_cols() {
  return kBwdWarps * bwd_cols_per_warp<KPT>();  // 64 (K <= 128) or 32 (K <= 256)
}

// Which gradients need a sum over value columns, per variant.
//   K-vector slots: 0 dq, 1 dk, 2 dg (kda) / dgk (dplr), 3 da, 4 db (dplr)
//   scalar slots:   0 dbeta (gdn, kda, delta), 1 dg (gdn)
template <Variant VAR>
struct GradSlots {
  static constexpr int kVec = VAR == Variant::dplr ? 5 : VAR == Variant::kda ? 3 : 2;
  static constexpr int kScalar = VAR == Variant::gdn ? 2 : VAR == Variant::dplr ? 0 : 1;
};

template <class T>
struct GradArgs {
  Strided<const T> dout;     // do [B, T, HV, V]
  const float* dht;          // [N, HV, K, V] or null
  Strided<T> dv;             // [B, T, HV, V], written per column
  float* dh0;                // [N, HV, K, V] or null, written per column
  float* partial_vec;        // [kVec][num_vtiles][tokens][HV][K]
  float* partial_scalar;     // [kScalar][num_vtiles][tokens][HV]
  float* checkpoints;        // [slots][HV][V][K]
  float* scratch;            // [blocks][scratch_tokens][BV][K]
  int64_t tokens;            // B * T (the flat token axis of the partials)
  int64_t num_vtiles;
  int64_t scratch_tokens;    // min(C, longest sequence), >= 1
  bool input_grads;          // false: dh0-only backward (dv, partials unused and null)
};

template <Variant VAR, class T, int KPT>
__global__ void __launch_bounds__(kBwdThreads) naive_backward_kernel(Inputs<T> in, GradArgs<T> gr) {
  using Slots = GradSlots<VAR>;
  constexpr int CPW = bwd_cols_per_warp<KPT>();
  constexpr int BV = bwd_block_cols<KPT>();
  constexpr int KP = kWarpSize * KPT;                        // padded rows per K-vector
  constexpr int kWarpStride = Slots::kVec * KP + Slots::kScalar;  // floats per warp in one buffer
  constexpr int64_t C = kCheckpointInterval;
  extern __shared__ float reduce_buffers[];  // [2][kBwdWarps][kWarpStride]

  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int64_t blk = blockIdx.x;  // (n * HV + hv) * num_vtiles + vt
  const int64_t vt = blk % gr.num_vtiles;
  const int64_t hv = (blk / gr.num_vtiles) % in.HV;
  const int64_t n = blk / (gr.num_vtiles * in.HV);
  const int64_t h = hv / in.group;
  const int64_t K = in.K, V = in.V, HV = in.HV;
  const Span sp = sequence_span(in.cu_seqlens, n, in.T);
  const int64_t local_col0 = static_cast<int64_t>(warp) * CPW;  // this warp's first column in the tile
  const int64_t col0 = vt * BV + local_col0;                     // ... and in V
  const int64_t num_intervals = (sp.eos - sp.bos + C - 1) / C;
  // Checkpoint slots of this sequence: floor(flat start / C) + n + interval. Slot ranges of
  // consecutive sequences never overlap and all fit in floor(B*T / C) + N slots.
  const int64_t slot0 = (sp.batch * in.T + sp.bos) / C + n;
  float* scratch = gr.scratch + blk * gr.scratch_tokens * BV * K;

  auto checkpoint_at = [&](int64_t interval, int c, int64_t row) -> float* {
    return gr.checkpoints + (((slot0 + interval) * HV + hv) * V + col0 + c) * K + row;
  };
  auto scratch_at = [&](int64_t token_in_interval, int c, int64_t row) -> float* {
    return scratch + (token_in_interval * BV + local_col0 + c) * K + row;
  };

  // ---- phase 1: forward from h0, checkpoint S at the start of every interval ---------------
  float s[CPW][KPT];
  load_state_columns<CPW, KPT>(s, in.h0, n, hv, col0, lane, HV, K, V);
  for (int64_t iv = 0; iv < num_intervals; ++iv) {
#pragma unroll
    for (int c = 0; c < CPW; ++c)
#pragma unroll
      for (int i = 0; i < KPT; ++i) {
        const int64_t row = lane + kWarpSize * i;
        if (row < K && col0 + c < V) *checkpoint_at(iv, c, row) = s[c][i];
      }
    if (iv + 1 == num_intervals) break;  // the last interval's states are recomputed in phase 2
    for (int64_t t = sp.bos + iv * C; t < sp.bos + (iv + 1) * C; ++t) {
      TokenKeys<KPT> tk;
      load_token<VAR, false>(tk, in, sp.batch, t, h, hv, lane);
      const T* vrow = in.v.at(sp.batch, t, hv);
#pragma unroll
      for (int c = 0; c < CPW; ++c)
        if (col0 + c < V) step_column<VAR, KPT>(s[c], tk, load_f(vrow + col0 + c));
    }
  }

  // ---- phase 2: intervals last to first; recompute, then walk the tokens in reverse ---------
  float ds[CPW][KPT];
  load_state_columns<CPW, KPT>(ds, gr.dht, n, hv, col0, lane, HV, K, V);
  int buffer = 0;
  for (int64_t iv = num_intervals - 1; iv >= 0; --iv) {
    const int64_t t0 = sp.bos + iv * C;
    const int64_t t1 = t0 + C < sp.eos ? t0 + C : sp.eos;
    // Recompute S_{t-1} for t in [t0, t1) into the scratch.
#pragma unroll
    for (int c = 0; c < CPW; ++c)
#pragma unroll
      for (int i = 0; i < KPT; ++i) {
        const int64_t row = lane + kWarpSize * i;
        s[c][i] = (row < K && col0 + c < V) ? *checkpoint_at(iv, c, row) : 0.f;
      }
    for (int64_t t = t0; t < t1; ++t) {
#pragma unroll
      for (int c = 0; c < CPW; ++c)
#pragma unroll
        for (int i = 0; i < KPT; ++i) {
          const int64_t row = lane + kWarpSize * i;
          if (row < K && col0 + c < V) *scratch_at(t - t0, c, row) = s[c][i];
        }
      if (t + 1 == t1) break;  // S_{t1-1} itself is not needed
      TokenKeys<KPT> tk;
      load_token<VAR, false>(tk, in, sp.batch, t, h, hv, lane);
      const T* vrow = in.v.at(sp.batch, t, hv);
#pragma unroll
      for (int c = 0; c < CPW; ++c)
        if (col0 + c < V) step_column<VAR, KPT>(s[c], tk, load_f(vrow + col0 + c));
    }

    for (int64_t t = t1 - 1; t >= t0; --t) {
      TokenKeys<KPT> tk;
      load_token<VAR, true>(tk, in, sp.batch, t, h, hv, lane);
      const T* vrow = in.v.at(sp.batch, t, hv);
      const T* dorow = gr.dout.at(sp.batch, t, hv);
      T* dvrow = gr.input_grads ? gr.dv.at(sp.batch, t, hv) : nullptr;

      // Per-lane sums over this warp's columns of the gradients that reduce over V.
      float acc[Slots::kVec][KPT];
#pragma unroll
      for (int gi = 0; gi < Slots::kVec; ++gi)
#pragma unroll
        for (int i = 0; i < KPT; ++i) acc[gi][i] = 0.f;
      float dbeta_acc = 0.f;  // identical on every lane (built from warp sums)
      float dg_lane = 0.f;    // gdn: this lane's rows of sum_ij dSd_ij Sd_ij

#pragma unroll
      for (int c = 0; c < CPW; ++c) {
        const int64_t col = col0 + c;
        if (col >= V) continue;  // uniform across the warp
        float (&sc)[KPT] = s[c];
        float (&dsc)[KPT] = ds[c];
#pragma unroll
        for (int i = 0; i < KPT; ++i) {
          const int64_t row = lane + kWarpSize * i;
          sc[i] = row < K ? *scratch_at(t - t0, c, row) : 0.f;  // S_{t-1}[:, col]
        }
        const float vj = load_f(vrow + col);
        const float doj = load_f(dorow + col);

        if constexpr (VAR == Variant::dplr) {
          float readout = 0.f;  // r_j = a_t . S_{t-1}[:, j]
#pragma unroll
          for (int i = 0; i < KPT; ++i) readout += tk.a[i] * sc[i];
          readout = warp_sum(readout);
#pragma unroll
          for (int i = 0; i < KPT; ++i) {
            const float st = tk.dec[i] * sc[i] + tk.k[i] * vj + tk.b[i] * readout;  // S_t
            acc[0][i] += st * doj;
            dsc[i] += tk.q[i] * doj;
            acc[1][i] += dsc[i] * vj;
            acc[4][i] += dsc[i] * readout;
          }
          float dvj = 0.f, w = 0.f;  // dv_t[j] = k . dS[:, j];  w_j = b . dS[:, j]
#pragma unroll
          for (int i = 0; i < KPT; ++i) {
            dvj += tk.k[i] * dsc[i];
            w += tk.b[i] * dsc[i];
          }
          dvj = warp_sum(dvj);
          w = warp_sum(w);
          if (lane == 0 && dvrow) store_f(dvrow + col, dvj);
#pragma unroll
          for (int i = 0; i < KPT; ++i) {
            acc[3][i] += sc[i] * w;
            acc[2][i] += dsc[i] * tk.dec[i] * sc[i];
            dsc[i] = tk.dec[i] * dsc[i] + tk.a[i] * w;
          }
        } else {
          float pred = 0.f;  // k_t . Sd[:, j]
#pragma unroll
          for (int i = 0; i < KPT; ++i) {
            if constexpr (VAR != Variant::delta) sc[i] *= tk.dec[i];  // sc = Sd
            pred += tk.k[i] * sc[i];
          }
          pred = warp_sum(pred);
          const float resid = vj - pred;
          const float u = tk.beta * resid;
          float du = 0.f;  // k_t . dS[:, j] after adding q do^T
#pragma unroll
          for (int i = 0; i < KPT; ++i) {
            acc[0][i] += (sc[i] + tk.k[i] * u) * doj;  // S_t = Sd + k u^T
            dsc[i] += tk.q[i] * doj;
            du += tk.k[i] * dsc[i];
          }
          du = warp_sum(du);
          if (lane == 0 && dvrow) store_f(dvrow + col, tk.beta * du);
          dbeta_acc += du * resid;
          const float dpred = -tk.beta * du;
#pragma unroll
          for (int i = 0; i < KPT; ++i) {
            acc[1][i] += dsc[i] * u + sc[i] * dpred;
            dsc[i] += tk.k[i] * dpred;  // dSd
            if constexpr (VAR == Variant::kda) acc[2][i] += dsc[i] * sc[i];
            if constexpr (VAR == Variant::gdn) dg_lane += dsc[i] * sc[i];
            if constexpr (VAR != Variant::delta) dsc[i] *= tk.dec[i];  // dS_{t-1} = D dSd
          }
        }
      }

      // dh0-only backward: nothing reduces over V (uniform over the grid, so no barrier is skipped
      // by only part of a block).
      if (!gr.input_grads) continue;
      // Add the warps: each writes its partial sums into the current buffer, then the block
      // sums the kBwdWarps copies in warp order and writes this tile's partial to global memory.
      // Double buffering makes one barrier per token enough: a warp can only write buffer b again
      // two tokens later, after the barrier that every reader of b has passed.
      float* mine = reduce_buffers + (buffer * kBwdWarps + warp) * kWarpStride;
#pragma unroll
      for (int gi = 0; gi < Slots::kVec; ++gi)
#pragma unroll
        for (int i = 0; i < KPT; ++i) mine[gi * KP + lane + kWarpSize * i] = gi == 0 ? in.scale * acc[0][i] : acc[gi][i];
      if constexpr (VAR == Variant::gdn) dg_lane = warp_sum(dg_lane);
      if (lane == 0) {
        if constexpr (Slots::kScalar >= 1) mine[Slots::kVec * KP + 0] = dbeta_acc;
        if constexpr (Slots::kScalar >= 2) mine[Slots::kVec * KP + 1] = dg_lane;
      }
      __syncthreads();
      const float* all = reduce_buffers + buffer * kBwdWarps * kWarpStride;
      const int64_t token = sp.batch * in.T + t;  // flat token index
      const int64_t vec_elems = Slots::kVec * K;
      for (int64_t e = threadIdx.x; e < vec_elems + Slots::kScalar; e += kBwdThreads) {
        const bool is_vec = e < vec_elems;
        const int64_t gi = is_vec ? e / K : e - vec_elems;
        const int64_t row = is_vec ? e % K : 0;
        const int64_t off = is_vec ? gi * KP + row : Slots::kVec * KP + gi;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kBwdWarps; ++w) sum += all[w * kWarpStride + off];
        if (is_vec)
          gr.partial_vec[(((gi * gr.num_vtiles + vt) * gr.tokens + token) * HV + hv) * K + row] = sum;
        else
          gr.partial_scalar[((gi * gr.num_vtiles + vt) * gr.tokens + token) * HV + hv] = sum;
      }
      buffer ^= 1;
    }
  }
  if (gr.dh0) store_state_columns<CPW, KPT>(gr.dh0, ds, n, hv, col0, lane, HV, K, V);
}

// out[b, t, ho, i] = sum over tiles vt, over the `group` value heads ho*group .. of partial
//                    [vt][b*T + t][ho*group + gg][i]   (fixed order: deterministic)
template <class T>
__global__ void reduce_partials_kernel(const float* partial, int64_t num_vtiles, int64_t tokens, int64_t HV,
                                       int64_t D, int64_t heads_out, int64_t group, int64_t seq_len, Strided<T> out) {
  const int64_t total = tokens * heads_out * D;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % D;
    const int64_t ho = (idx / D) % heads_out;
    const int64_t token = idx / (D * heads_out);
    float sum = 0.f;
    for (int64_t vt = 0; vt < num_vtiles; ++vt)
      for (int64_t gg = 0; gg < group; ++gg) sum += partial[((vt * tokens + token) * HV + ho * group + gg) * D + i];
    store_f(out.at(token / seq_len, token % seq_len, ho) + i, sum);  // token = b * T + t
  }
}

template <class T>
void launch_reduce(const float* partial, int64_t num_vtiles, int64_t tokens, int64_t HV, int64_t D,
                   int64_t heads_out, int64_t group, int64_t seq_len, const TensorRef& out, cudaStream_t stream) {
  if (!out.defined()) return;  // not asked for (validate_backward allows only the dh0-only mode)
  constexpr int kThreads = 256;
  const int64_t total = tokens * heads_out * D;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t{1} << 20);
  if (blocks == 0) return;
  reduce_partials_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      partial, num_vtiles, tokens, HV, D, heads_out, group, seq_len, strided<T>(out));
  DELTACP_CUDA_CHECK_LAUNCH();
}

// dg goes out in g's dtype: fp32 when Params::g_fp32, else the input dtype T.
template <class T>
void launch_gate_reduce(const Params& p, const float* partial, int64_t num_vtiles, int64_t tokens, int64_t D,
                        cudaStream_t stream) {
  if (p.g_fp32) {
    launch_reduce<float>(partial, num_vtiles, tokens, p.HV, D, p.HV, 1, p.T, p.dg, stream);
  } else {
    launch_reduce<T>(partial, num_vtiles, tokens, p.HV, D, p.HV, 1, p.T, p.dg, stream);
  }
}

// The reduce kernels of every gradient that sums over value columns (not for dh0-only).
template <Variant VAR, class T>
void launch_grad_reductions(const Params& p, const GradArgs<T>& gr, int64_t num_vtiles, int64_t tokens,
                            cudaStream_t stream) {
  const int64_t group = p.HV / p.H;
  const float* vec = gr.partial_vec;
  const int64_t vec_stride = num_vtiles * tokens * p.HV * p.K;  // one gradient's partials
  launch_reduce<T>(vec + 0 * vec_stride, num_vtiles, tokens, p.HV, p.K, p.H, group, p.T, p.dq, stream);
  launch_reduce<T>(vec + 1 * vec_stride, num_vtiles, tokens, p.HV, p.K, p.H, group, p.T, p.dk, stream);
  if constexpr (VAR == Variant::kda || VAR == Variant::dplr)
    launch_gate_reduce<T>(p, vec + 2 * vec_stride, num_vtiles, tokens, p.K, stream);
  if constexpr (VAR == Variant::dplr) {
    launch_reduce<T>(vec + 3 * vec_stride, num_vtiles, tokens, p.HV, p.K, p.HV, 1, p.T, p.da, stream);
    launch_reduce<T>(vec + 4 * vec_stride, num_vtiles, tokens, p.HV, p.K, p.HV, 1, p.T, p.db, stream);
  }
  const float* scal = gr.partial_scalar;
  const int64_t scalar_stride = num_vtiles * tokens * p.HV;
  if constexpr (VAR != Variant::dplr)
    launch_reduce<T>(scal + 0 * scalar_stride, num_vtiles, tokens, p.HV, 1, p.HV, 1, p.T, p.dbeta, stream);
  if constexpr (VAR == Variant::gdn)
  launch_gate_reduce<T>(p, scal + 1 * scalar_stride, num_vtiles, tokens, 1, stream);
}


template <Variant VAR, class T, int KPT>
void launch_backward(const Params& p, cudaStream_t stream) {
  using Slots = GradSlots<VAR>;
  constexpr int BV = bwd_block_cols<KPT>();
  constexpr int KP = kWarpSize * KPT;
  const int64_t num_vtiles = (p.V + BV - 1) / BV;
  const int64_t blocks = p.num_seqs * p.HV * num_vtiles;
  DELTACP_CHECK(blocks <= INT_MAX, "num_seqs", "expected num_seqs * HV * ceil(V / ", BV, ") <= ", INT_MAX,
                " blocks for the naive backward, got ", blocks);
  if (blocks == 0) return;
  const std::vector<SeqBounds> bounds = sequence_bounds(p);
  const int64_t tokens = p.B * p.T;
  const int64_t slots = tokens / kCheckpointInterval + p.num_seqs;
  const int64_t scratch_tokens = std::max<int64_t>(1, std::min(kCheckpointInterval, max_sequence_length(bounds)));
  const bool input_grads = !p.dh0_only();

  // One workspace: partials (vector then scalar; none for the dh0-only backward), checkpoints,
  // scratch (all fp32).
  const int64_t vec_floats = input_grads ? Slots::kVec * num_vtiles * tokens * p.HV * p.K : 0;
  const int64_t scalar_floats = input_grads ? Slots::kScalar * num_vtiles * tokens * p.HV : 0;
  const int64_t checkpoint_floats = slots * p.HV * p.V * p.K;
  const int64_t scratch_floats = blocks * scratch_tokens * BV * p.K;
  const int64_t total_floats = vec_floats + scalar_floats + checkpoint_floats + scratch_floats;
  float* workspace = nullptr;
  workspace = static_cast<float*>(workspace_alloc(static_cast<size_t>(total_floats) * sizeof(float), stream));

  GradArgs<T> gr;
  gr.dout = strided<const T>(p.dout);
  gr.dht = static_cast<const float*>(p.dht);
  gr.dv = strided<T>(p.dv);
  gr.dh0 = static_cast<float*>(p.dh0);
  gr.partial_vec = workspace;
  gr.partial_scalar = workspace + vec_floats;
  gr.checkpoints = workspace + vec_floats + scalar_floats;
  gr.scratch = workspace + vec_floats + scalar_floats + checkpoint_floats;
  gr.tokens = tokens;
  gr.num_vtiles = num_vtiles;
  gr.scratch_tokens = scratch_tokens;
  gr.input_grads = input_grads;

  const size_t smem = input_grads ? sizeof(float) * 2 * kBwdWarps * (Slots::kVec * KP + Slots::kScalar) : 0;
  try {
    auto kernel = naive_backward_kernel<VAR, T, KPT>;
    allow_dynamic_smem(kernel, smem);
    kernel<<<static_cast<unsigned>(blocks), kBwdThreads, smem, stream>>>(make_inputs<T>(p), gr);
    DELTACP_CUDA_CHECK_LAUNCH();
    if (input_grads) launch_grad_reductions<VAR, T>(p, gr, num_vtiles, tokens, stream);
  } catch (...) {
    workspace_free(workspace, stream);  // best effort; the original error is the one to report
    throw;
  }
  workspace_free(workspace, stream);
}

}  // namespace
}  // namespace naive

void naive_backward(const Params& p) {
  const int kpt = naive::rows_per_lane(p.K);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  dispatch_dtype(p.dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    naive::dispatch_variant(p.variant, [&](auto variant_tag) {
      constexpr Variant VAR = decltype(variant_tag)::value;
      if (kpt == 4)
        naive::launch_backward<VAR, T, 4>(p, stream);
      else
        naive::launch_backward<VAR, T, 8>(p, stream);
    });
  });
}

}  // namespace deltacp::cuda
