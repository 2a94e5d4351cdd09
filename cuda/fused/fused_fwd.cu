// cuda/fused/fused_fwd.cu — the fused tier's forward (Hopper, sm_90a): the state stays on chip from a
// sequence's first chunk to its last, and each chunk's output is produced where its state is.
//
// Algorithm (docs/design.md, the chunked WY form; reference/include/deltacp/reference/chunked.h). For a
// chunk of n <= 64 tokens with state S (K x V, fp32) at its start and G the within-chunk cumulative log
// decay, with W = T Beta (K e^G) and U = T Beta V from the WY stage:
//
//   Vn = U - W S
//   O  = scale ( e^G (Q S) + P Vn ),   P = tril(Q K^T) o e^(G_i - G_j)  (j <= i, diagonal included)
//   S' = e^(G_n) S + (K e^(G_n - G))^T Vn
//
// Pipeline. What does not depend on the state runs token-parallel first, on every chunk at once: the tiled
// tier's stage 1 (G = cumsum g, cuda/tiled/fwd_stages.cuh) and its Hopper WY stage (cuda/tiled/wy_wgmma.cuh:
// W, U and P = 128 bytes per token and head of 16-bit scores, from one read of q, k and v). Then fused_chain_kernel
// (fused_chain.cuh: its CTA, loads and steps) walks each sequence's chunks with S in registers, does every
// product that touches S, and writes the output. Per chunk q, k, W, U, P, g come in and o goes out: no
// per-chunk state (h) and no v_new, which the tiled tier's stages 3 and 4 move through HBM. Every 16-bit tile
// comes in by TMA. gdn and delta without a gradient run the chain's T Beta form (chain_takes_tbeta below,
// fused_chain.cuh): the WY stage writes T Beta in place of W and U, sums the gate itself (no cumsum launch) and
// reads no v; the chain (and the pieces' map mode) reads v and makes Vn = T Beta (V - e^G K S): 2066 bytes per
// token-head in place of 2834 (the times below).
//
// Long sequences with few chains (B * HV CTAs would leave most SMs idle): exact intra-card context
// parallelism. The sequences are cut into pieces of whole chunks; each piece's affine map [H_j | M_j]
// (the state it leaves when entered with [0 | I]) comes from the chain kernel's map mode (pass 1, side by
// side), a fold gives every piece its true start state S_{j+1} = M_j S_j + H_j in fp32, and the chain runs
// every piece from it (cuda/tiled/scan_split.cu has the algebra and the fold). No gate-threshold shortcut:
// the start states are exact up to rounding. fused_piece_chunks below picks the piece length from a time
// model of the three kernels.
//
// In stages (deltacp/cuda/api.h forward_prepare(p, Method::fused); the CP op's local forward): prepare runs the
// token-parallel stage and pass 1 over every piece (the last one's map too: a CP rank's pre-pass is its last
// sequence's maps composed), finish the fold from h0 and the chain; one window, the same o and ht as forward().
//
// Memory: the workspace (G, W, U, P: 652 bytes per token-head; kda 1,664 with its 128 gates per token and
// K e^(G_n - G), Q e^G) grows with the tokens, so a call whose workspace would pass 1 GiB runs in windows of
// whole chunks along time (forward below), each from the fp32 state the previous one left; fixed-length
// windows overlap the next window's WY stage with this window's chain (forward_windows_overlapped).
//
// Numerics: the tiled tier's roundings (S, Vn, P to 16 bits for the products, fp32 accumulation, fp32
// state), so the fused forward agrees with the tiled one to bf16 rounding and with fp64 within 1e-2.
//
// kda (a decay per key): the token-parallel stage is one kernel, on compute capability 9.0 kda_prepare_wgmma_kernel
// (cuda/tiled/kda_prepare_wgmma.cuh: wgmma, 0.60 ms against 1.01 at (2,16384,16,128) on an H100), else
// kda_prepare_kernel (cuda/tiled/tiled_fwd.cu, mma.sync): W, U and K e^(G_n - G) as the tiled tier's WY stage makes them, P and Q e^G (the output stage's
// operands) as kda_chain_operands_kernel does, from one read of q, k, v, g, one gate sum within the chunk, one
// l2 norm of q, k in shared memory and one rescaling of K's rows for both score matrices
// (launch_kda_fused_prepare; DELTACP_FUSED_KDA_PREPARE=0 runs that pair of kernels instead, with the same bits);
// the chain runs its kda mode on them (fused_chain.cuh). With FLA's use_gate_in_kernel and no gradient
// (Params::gate_A_log) the gate sum turns each raw value into its gate first (common/kda_gate.cuh), so the gate
// is never written: at (2,16384,16,128) on an H200 the call with the gate in it took 1.968 ms against 2.129 with
// the gate computed by torch first.
//
// Applies to: gdn, kda and delta; bf16 / fp16 inputs; K = V = 128, K = 128 with V = 256 (gdn's and delta's WY stage
// makes U in two rounds of 128 columns, the chain has four 64-column tiles) and K = V = 64 (the same kernels on one
// 64-column box per tile, the state a 64 x 64 accumulator of one warpgroup; kda's token-parallel stage is
// kda_prepare_kernel on mma.sync at K = V = 64 and the wgmma one at K = 128, launch_kda_fused_prepare); q, k, v, o
// 16-byte aligned rows with positive strides (TMA; kda: o only); B * T < 2^31; compute capability 9.0 in a build
// with sm_90a code (forward_refusal says why not, and the dispatch falls back to the tiled tier or, when the fused
// tier was asked for by name, raises an error with the reason).
//
// Measured (NVIDIA H200, 2026-11-29, bf16 gdn, FLA's benchmark keywords: use_qk_l2norm_in_kernel=True, which
// this tier folds into its kernels; docs/perf.md has the table beside FLA). Kernels per forward (bench/gpu/
// stage_times.py), default plan, the T Beta form: (2,16384,16,128) whole sequences 0.638 ms = chain 0.472 (256
// chunks on 64 CTAs: 1.84 us a chunk) + WY 0.163; (1,65536,8,128) pieces 0.644 = WY 0.162 + pass-1 maps 0.222 +
// chain 0.193 + fold 0.058; (1,8192,96,128) 0.618 = WY 0.251 + chain 0.365; (4,4096,64,128) 0.701 = WY 0.325 +
// chain 0.374. In the W, U form (2026-11-25): 0.733, 0.742, 0.746 and 0.919 ms. With the 16-bit tiles loaded by
// cp.async instead of TMA the chain took 0.672 ms at
// (2,16384,16,128) (2.6 us a chunk: its loads were half of it although issued a chunk ahead), the WY kernel
// 0.284, and pass 1 on the tiled tier's scan 0.259 (the map mode: 0.205). The WY kernel moves 88 KB per chunk
// and head (q, k, v in; W, U, P out) at about 2.8 TB/s, and the chain reads W, U, P back. fused_one_kernel.cuh
// keeps them on chip (the WY work of the next chunk done by a second warpgroup of the chain's CTA; gdn and delta
// at K = V = 128, DELTACP_FUSED_ONE_KERNEL=1): the same bits, but slower (1.19 ms against 0.72 at
// (2,16384,16,128) on an H200), its WY warpgroup's latency per chunk twice the chain's step (its header). Nor does
// the WY stage pay running beside the chain of one window, the chain loading each chunk once a per-chunk flag says
// its WY CTA has stored it (tried on an H200, 2026-11-29, (2,16384,16,128), 64 chain CTAs): the chain slowed from
// 0.46 to 0.74-0.79 ms beside the WY grid and the call took as long. (The WY grid has to be queued first there: two
// streams may share one hardware queue, and a chain queued ahead of the grid it waits for hung.)
// K = 128, V = 256 (NVIDIA H100, 2026-11-28, bf16 gdn, B = 8, T = 2048, H = 32, bench_gpu.py beside FLA): 1.025 ms
// end to end (FLA 1.778; the tiled tier 1.849), of which the chain 0.527 (512 CTAs of two warpgroups in 4 waves, 32
// chunks each: 4.12 us a chunk). K = V = 64 (same GPU and run conditions, (4,4096,32,64)): 0.467 ms (FLA 0.704; the
// tiled tier 0.761), of which the chain 0.173 (128 CTAs of one warpgroup, 64 chunks each: 2.70 us a chunk, its
// loads and stores at about 2.3 TB/s across the GPU).
// kda at K = V = 64 and K = 128 with V = 256 (NVIDIA H200, 2026-11-28, bf16, bench_gpu.py beside FLA 0.5.2 with its
// benchmark keywords): (4,4096,32,64) 0.874 ms (FLA 1.222), of which the chain 0.114 (1.78 us a chunk on 128 CTAs);
// (8,2048,32,128,256) 1.596 ms (FLA 2.459) with kda_prepare_kernel, of which the chain 0.366 (2.86 us a chunk);
// with the wgmma stage, which took V = 256 after that run, 1.128 ms (FLA 2.440 in that later run). With the pair
// of kernels kda_prepare_kernel replaces (DELTACP_FUSED_KDA_PREPARE=0) the forward took 0.910
// and 2.642 ms (the tiled tier 1.211 and 3.483) in an earlier run.
// kda (NVIDIA H100, 2026-11-27, bf16, (2,16384,16,128), kernels per forward): 2.17 ms = the WY stage 0.99 +
// kda_chain_operands_kernel 0.76 + chain 0.41 (the gate summed and q, k normalised inside the first two: the
// cumsum kernel's 0.22 ms and the l2 norm's pass over q and k are gone), against the tiled tier's 2.66 (its
// output stage 0.98 and state scan 0.50 in place of the operands and the chain); end to end 2.36 ms with the
// in-kernel l2 norm (2.18 without), against FLA's 2.27 (docs/perf.md). The chain is as fast as gdn's; the two
// token-parallel kernels, on mma.sync, are what is left to move to wgmma. Nsight Compute found them issue-bound
// (12.5% occupancy, 1.6 instructions per cycle, HMMA about 1% of the instructions): half their instructions were
// the decay scalings' exponentials with subnormal handling, per-element range checks behind branches and integer
// divisions per 16-byte piece. Without those (exp_t and PieceRows in cuda/tiled/fwd_mma.cuh, the per-row check in
// kda_scores.cuh) the kda forward took 2.10 ms end to end at (2,16384,16,128) against FLA's 2.28, and 0.65, 2.93
// and 3.99 ms at (4,2048,16,128), (1,8192,96,128) and (4,4096,64,128) (FLA 0.99, 3.24, 4.24; H100, 2026-11-27).
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "../common/check.h"
#include "../common/device_info.h"
#include "../common/kernel_switch.h"
#include "../common/load_store.cuh"
#include "../common/side_stream.h"
#include "../common/workspace_pool.h"
#include "../tiled/chunk_table.cuh"
#include "../tiled/fwd_mma.cuh"
#include "../tiled/fwd_stages.cuh"
#include "fused_chain.cuh"
#include "fused_one_kernel.cuh"
#include "fused_windows.h"
#include "../tiled/wy_wgmma.cuh"
#include "deltacp/cuda/tiers.h"
#include "deltacp/error.h"
#include "deltacp/params.h"

namespace deltacp::cuda::fused {
namespace {

using tiled::ChunkTable;
using tiled::SeqEntry;

// The time model of the piece choice, in microseconds, for the sequences seqs cut into pieces of L chunks
// (L = 0: whole sequences). A chain step is one chunk of one CTA; the kernels run one CTA per SM, so CTAs
// beyond the SM count run in further waves.
//   chain (whole or every piece):  waves(pieces x HV x V / (64 x warpgroups)) x L x step_us(warpgroups per CTA)
//   pass 1 (maps of all but each sequence's last piece: the chain's map mode, a state V + K columns wide,
//          CTAs of 128 columns):  waves(maps x HV x (V + K) / 128) x L x map_step_us
//   fold:  (most pieces - 1) x fold_us
// The steps as measured on an H200 (bench/gpu/stage_times.py, bf16 gdn, 2026-11-25): the chain 1.73 us a
// chunk with one warpgroup per CTA ((2,16384,16,128) whole: 0.442 ms over 256 chunks on 64 CTAs; 2.0 us on
// 128 CTAs), 2.9 us with two (pieces of 4096 tokens at (2,16384,16,128) and (1,65536,8,128): 0.185 ms over
// 64 chunks); the map mode 1.6 us a chunk per wave (0.205 ms: 64 chunks in 2 waves); the fold 3.8 us a piece
// (the tiled tier's, cuda/tiled/scan_split.cu).
double fused_predicted_us(const std::vector<SeqEntry>& seqs, int64_t HV, int64_t K, int64_t V, int64_t L, int sms) {
  constexpr double map_step_us = 1.6, fold_us = 3.8;
  int64_t pieces = 0, maps = 0, most = 1, longest = 0;
  for (const SeqEntry& s : seqs) {
    const int64_t P = L > 0 ? std::max<int64_t>(1, (s.num_chunks + L - 1) / L) : 1;
    pieces += P;
    maps += P - 1;
    most = std::max(most, P);
    longest = std::max(longest, L > 0 ? std::min(L, s.num_chunks) : s.num_chunks);
  }
  auto waves = [&](int64_t ctas) { return static_cast<double>((ctas + sms - 1) / sms); };
  const int nwg = chain_warpgroups(pieces * HV, V, sms);
  const double step_us = nwg == 1 ? 1.9 : 2.9;
  const double chain = waves(pieces * HV * (V / (kCols * nwg))) * static_cast<double>(longest) * step_us;
  const double pass1 =
      maps > 0 ? waves(maps * HV * ((V + K) / (2 * kCols))) * static_cast<double>(longest) * map_step_us : 0.0;
  return chain + pass1 + fold_us * static_cast<double>(most - 1);
}

}  // namespace

const char* forward_refusal(const Params& p) {
  // The token-parallel stage's needs (q, k, v, the GPU), then the chain's: it writes o in 16-byte pieces.
  if (p.variant == Variant::kda) {
    // kda's token-parallel stages are the tiled tier's (any strides) and the chain reads only their rows: an
    // sm_90a build, 16-bit inputs, the GPU, and the chain's shape.
    if (const char* why = tiled::kda_fused_prepare_refusal(p)) return why;
    if (!((p.K == 128 && (p.V == 128 || p.V == 256)) || (p.K == 64 && p.V == 64)))
      return "it takes K = 128 with V = 128 or 256, or K = V = 64";
    if (p.chunk_size < 1 || p.chunk_size > 64) return "it takes chunk_size <= 64";
    if (p.HV % p.H != 0 || p.HV > 65535) return "it takes HV a multiple of H and at most 65535";
    if (p.B * p.T >= (int64_t{1} << 31)) return "it addresses token rows by TMA's 32-bit coordinates (B * T < 2^31)";
  } else if (const char* why = tiled::wy_wgmma_refusal(p)) {
    return why;
  }
  if (p.final_state_only()) return "it computes the output (a final-state-only call runs on the tiled tier)";
  if (!rows_aligned16(p.o, dtype_size(p.dtype)))
    return "it writes o in 16-byte pieces (o's pointer or strides are not 16-byte aligned)";
  return nullptr;
}

namespace {
// Chunks per piece for intra-card CP (0: whole sequences): DELTACP_FUSED_PIECE=<tokens> forces it (0 never
// cuts); unset, the length the time model predicts fastest, if it beats whole sequences by 25%.
int64_t fused_piece_chunks(const Params& p, const std::vector<SeqEntry>& seqs) {
  const int64_t env = tiled::piece_tokens_from_env("DELTACP_FUSED_PIECE");
  if (env == 0 || seqs.empty()) return 0;
  int64_t most = 0;
  for (const SeqEntry& s : seqs) most = std::max(most, s.num_chunks);
  if (env > 0) {
    const int64_t L = std::max<int64_t>(1, (env + p.chunk_size - 1) / p.chunk_size);
    return most > L ? L : 0;
  }
  const int sms = sm_count();
  const double whole = fused_predicted_us(seqs, p.HV, p.K, p.V, 0, sms);
  int64_t best_L = 0;
  double best = 0.75 * whole;  // cut only for a clear predicted gain (pass 1, the fold and the piece tables cost launches too)
  for (int64_t L : {8, 16, 32, 64, 128, 256}) {
    if (L >= most) break;
    const double us = fused_predicted_us(seqs, p.HV, p.K, p.V, L, sms);
    if (us < best) best = us, best_L = L;
  }
  return best_L;
}

}  // namespace

namespace {
// The token-parallel stage's workspace over a call's B * T rows: G (gdn, kda), W, U, P, qk_l2norm's row scales
// (gdn, delta) and kda's Q e^G and K e^(G_n - G).
struct WindowBuffers {
  float* G = nullptr;
  void* W = nullptr;
  void* U = nullptr;
  void* P = nullptr;
  float* rq = nullptr;
  float* rk = nullptr;
  void* Kd = nullptr;
  void* Qg = nullptr;
  bool tbeta = false;  // the chain's T Beta form: W's buffer holds T Beta, U's is unused (chain_takes_tbeta)
  float* Tinv = nullptr;  // the stage kept for the backward (Params::wy_stage): T goes here (kda: G takes every row)
  ChainOperands operands() const { return {G, W, U, P, Kd, Qg, rq, rk, tbeta}; }
};
constexpr int kWindowParts = 8;
// Bytes of each buffer over R token rows, in carve order: G, W, U, P, qk_l2norm's rq and rk, kda's Kd and Qg.
// The one place that knows the layout: the workspace size, the carve and the window budget all read it.
std::array<int64_t, kWindowParts> window_buffer_sizes(const Params& p, int64_t R) {
  const bool kda = p.variant == Variant::kda;
  const int64_t es = dtype_size(p.dtype), rows = R * p.HV, scales = p.qk_l2norm && !kda ? rows * 4 : 0;
  const int64_t G = p.variant == Variant::gdn ? rows * 4 : (kda ? rows * p.K * 4 : 0);
  const int64_t kda_tile = kda ? rows * p.K * es : 0;
  return {G, rows * p.K * es, rows * p.V * es, rows * 64 * es, scales, scales, kda_tile, kda_tile};
}
int64_t align256(int64_t b) { return (b + 255) / 256 * 256; }
int64_t window_buffers_bytes(const Params& p) {
  int64_t total = 0;
  for (int64_t b : window_buffer_sizes(p, p.B * p.T)) total += align256(b);
  return total;
}
WindowBuffers carve_window_buffers(char* at, const Params& p) {
  const auto sizes = window_buffer_sizes(p, p.B * p.T);
  char* part[kWindowParts] = {};
  for (int i = 0; i < kWindowParts; ++i) {
    part[i] = sizes[i] > 0 ? at : nullptr;
    at += align256(sizes[i]);
  }
  WindowBuffers b;
  b.G = reinterpret_cast<float*>(part[0]);
  b.W = part[1];
  b.U = part[2];
  b.P = part[3];
  b.rq = reinterpret_cast<float*>(part[4]);
  b.rk = reinterpret_cast<float*>(part[5]);
  b.Kd = part[6];
  b.Qg = part[7];
  return b;
}

// The token-parallel stage of a window: G = cumsum g, then W, U, P (and the row scales) by the wgmma WY stage;
// kda: W, U, K e^(G_n - G), P and Q e^G by kda_prepare_kernel (or the pair it replaces: the tiled tier's WY stage
// and kda_chain_operands_kernel; they read the gates per key, which the wgmma WY stage does not implement),
// summing the gate within the chunk and normalising q, k itself (no cumsum or l2-norm pass; only G's last rows
// are written).
void prepare_window(const Params& p, const ChunkTable& table, const WindowBuffers& b, cudaStream_t stream) {
  if (p.variant == Variant::kda) {
    tiled::launch_kda_fused_prepare(p, table, b.G, b.W, b.U, b.Kd, b.P, b.Qg, stream, b.Tinv);
    return;
  }
  if (!b.tbeta) tiled::launch_chunk_cumsum(p, table, b.G, stream);  // the T Beta form's WY stage sums g itself
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (tiled::kIs16Bit<T>) {
      if (b.tbeta) {
        tiled::launch_wy_wgmma_tbeta<T>(p, table, b.G, static_cast<T*>(b.W), static_cast<T*>(b.P), b.rq, b.rk, stream);
      } else {
        tiled::launch_wy_wgmma<T>(p, table, b.G, static_cast<T*>(b.W), static_cast<T*>(b.U), static_cast<T*>(b.P),
                                  b.Tinv, b.rq, b.rk, stream, /*dvl=*/nullptr, /*t16=*/b.Tinv != nullptr);
      }
    }
  });
}

// Whether the chain runs its T Beta form (fused_chain.cuh): the WY stage writes T Beta (128 bytes per token and head)
// in place of W and U (512) and reads no v, and the chain reads v and T Beta in place of U and W and makes
// Vn = T Beta (V - e^G K S) with one more product: 768 fewer bytes per token-head through HBM (2834 -> 2066 at
// K = V = 128, notebooks/06_kernel_tiers.py), one more dependent group in the chain's step; the pieces' map mode
// (intra-card CP) the same way. gdn and delta, without a gradient: a forward that keeps its states for the backward
// (Params::chunk_h) keeps the W, U form, whose v_new has the roundings of the tiled backward's own recompute, and so
// does a forward whose backward recomputes them (Params::backward_recomputes: the CP op's; in the T Beta form a CP
// step's o moved 4.2e-3 and its gradients 3.3e-3 from one process's, which kept the states).
// DELTACP_FUSED_TBETA: 0 keeps W and U, 1 asks for it (an error says why not), unset: where it applies.
const char* tbeta_refusal(const Params& p) {
  if (p.variant == Variant::kda) return "it implements gdn and delta (kda's chain reads W with its decays per key)";
  if (p.chunk_h != nullptr) return "the forward keeps its states for the backward (the W, U form's roundings)";
  if (p.backward_recomputes) return "a backward recomputes the forward's states (the W, U form's roundings)";
  return nullptr;
}
bool chain_takes_tbeta(const Params& p) {
  return kernel_switch("DELTACP_FUSED_TBETA", "the chain's T Beta form", [&] { return tbeta_refusal(p); });
}

// The serial stage of a window: the chain over whole sequences, or in pieces (pass 1 on the chain's map mode,
// the fold, the chain over the pieces). chain_stages: 0 = the default (fused_chain.cuh).
void chain_window(const Params& p, const ChunkTable& table, const WindowBuffers& b, cudaStream_t stream,
                  int chain_stages = 0) {
  const int64_t Lc = fused_piece_chunks(p, table.host_seqs());
  tiled::ScanPlan plan;
  if (Lc > 0) plan = tiled::plan_pieces(p, table.host_seqs(), Lc);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (tiled::kIs16Bit<T>) {
      if (!plan.cut()) {
        launch_chain<T>(p, table, b.operands(), static_cast<const float*>(p.h0), static_cast<float*>(p.ht), stream,
                        chain_stages);
        return;
      }
      const int64_t N = table.num_seqs(), KV = p.K * p.V;
      std::vector<int64_t> pass1;  // every piece but each cut sequence's last
      std::vector<const float*> seq_maps(static_cast<size_t>(N), nullptr);
      std::vector<int64_t> pass1_first(static_cast<size_t>(N), -1);
      for (int64_t s = 0; s < N; ++s) {
        if (plan.pieces_of(s) < 2) continue;
        pass1_first[static_cast<size_t>(s)] = static_cast<int64_t>(pass1.size());
        for (int64_t i = plan.first_piece[s]; i + 1 < plan.first_piece[s + 1]; ++i) pass1.push_back(i);
      }
      const int64_t P = static_cast<int64_t>(plan.pieces.size());
      const int64_t bytes_maps = align256(static_cast<int64_t>(pass1.size()) * p.HV * p.K * (p.V + p.K) * 4);
      const int64_t bytes_starts = align256(P * p.HV * KV * 4), bytes_pht = p.ht != nullptr ? bytes_starts : 0;
      char* ws = static_cast<char*>(workspace_alloc(static_cast<size_t>(bytes_maps + bytes_starts + bytes_pht), stream));
      try {
        float* maps = reinterpret_cast<float*>(ws);
        float* starts = reinterpret_cast<float*>(ws + bytes_maps);
        float* piece_ht = bytes_pht > 0 ? reinterpret_cast<float*>(ws + bytes_maps + bytes_starts) : nullptr;
        for (int64_t s = 0; s < N; ++s)
          if (pass1_first[static_cast<size_t>(s)] >= 0)
            seq_maps[static_cast<size_t>(s)] = maps + pass1_first[static_cast<size_t>(s)] * p.HV * p.K * (p.V + p.K);
        std::vector<tiled::SeqEntry> mapped;  // pass 1: the chain's map mode over those pieces
        mapped.reserve(pass1.size());
        for (int64_t i : pass1) mapped.push_back(plan.pieces[static_cast<size_t>(i)]);
        const tiled::ChunkTable map_table(std::move(mapped), p.chunk_size, stream);
        launch_chain_maps<T>(p, map_table, b.operands(), maps, stream);
        const tiled::PieceTables tables(p, plan, seq_maps, stream);
        tiled::launch_fold_starts(p, tables, N, static_cast<const float*>(p.h0), starts, stream);
        launch_chain<T>(p, tables.pieces(), b.operands(), starts, piece_ht, stream, chain_stages);
        if (p.ht != nullptr)
          tiled::launch_gather_final_states(p, tables, N, piece_ht, static_cast<float*>(p.ht), stream);
      } catch (...) {
        workspace_free(ws, stream);
        throw;
      }
      workspace_free(ws, stream);
    }
  });
}

// Why the one-kernel forward (fused_one_kernel.cuh) cannot run p over the table's sequences, or nullptr. It needs
// what the two-kernel forward needs (forward_refusal) and runs whole sequences: where the piece plan cuts them
// (intra-card CP), the maps of pass 1 read W and U from the token-parallel stage's workspace.
const char* one_kernel_refusal(const Params& p, const ChunkTable& table) {
  if (p.variant == Variant::kda) return "it implements gdn and delta";
  if (p.chunk_h != nullptr) return "it keeps no states for the backward (Params::chunk_h)";
  if (p.K != 128 || p.V != 128) return "it takes K = V = 128";
  if (fused_piece_chunks(p, table.host_seqs()) > 0) return "the piece plan cuts these sequences (intra-card CP)";
  return nullptr;
}

// Why this forward does not write Params::wy_stage for its backward (nullptr: it does). A call that keeps its
// per-chunk states (chunk_h) runs as one window, so the stage runs once over every chunk.
const char* wy_stage_refusal(const Params& p) {
  if (p.wy_stage == nullptr) return "none was given";
  if (p.chunk_h == nullptr) return "it is kept beside the per-chunk states (chunk_h)";
  if (p.qk_l2norm || p.gate_in_kernel()) return "the backward reads q, k and g as given (no in-kernel options)";
  if (!tiled::wy_stage_kept_by(p)) return "the stage does not run on Hopper's warpgroup products at K = V = 128";
  if (chain_takes_tbeta(p)) return "the chain's T Beta form writes no W";  // (chunk_h keeps the W, U form)
  return nullptr;
}

// One window of the forward (the whole call when it is not cut): both stages on p's stream, or G and the one
// kernel. DELTACP_FUSED_ONE_KERNEL=1 asks for the one kernel (an error says why where it cannot run); unset or 0,
// the two kernels: on an H200 the one kernel is slower at every shape measured (fused_one_kernel.cuh).
void forward_window(const Params& p) {
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const ChunkTable table(p, p.chunk_size, stream);
  if (table.num_seqs() == 0) return;
  if (kernel_switch(
          "DELTACP_FUSED_ONE_KERNEL", "the one-kernel fused forward", [&] { return one_kernel_refusal(p, table); },
          /*unset_on=*/false)) {
    const bool gated = p.variant == Variant::gdn;
    const size_t g_bytes = static_cast<size_t>(p.B * p.T * p.HV * 4);
    float* G = gated ? static_cast<float*>(workspace_alloc(g_bytes, stream)) : nullptr;
    try {
      if (gated) tiled::launch_chunk_cumsum(p, table, G, stream);
      dispatch_dtype(p.dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        if constexpr (tiled::kIs16Bit<T>)
          launch_one_kernel<T>(p, table, G, static_cast<const float*>(p.h0), static_cast<float*>(p.ht), stream);
      });
    } catch (...) {
      if (G != nullptr) workspace_free(G, stream);
      throw;
    }
    if (G != nullptr) workspace_free(G, stream);
    return;
  }
  // The stage kept for the backward (keeps_wy_stage): G, T, W, P (kda: Kd, Q e^G) in Params::wy_stage's planes,
  // only U in workspace.
  const bool keep = keeps_wy_stage(p);
  const int64_t rows = p.B * p.T * p.HV;
  const int64_t ws_bytes = keep ? align256(rows * p.V * dtype_size(p.dtype)) : window_buffers_bytes(p);
  char* ws = static_cast<char*>(workspace_alloc(static_cast<size_t>(ws_bytes), stream));
  try {
    WindowBuffers b;
    if (keep) {
      const WyStagePlanes pl = WyStagePlanes::of(p.variant);
      auto plane = [&](int64_t start) { return start < 0 ? nullptr : WyStagePlanes::at(p.wy_stage, start, rows); };
      b.G = static_cast<float*>(plane(pl.G));
      b.Tinv = static_cast<float*>(plane(pl.T));
      b.W = plane(pl.W);
      b.Kd = plane(pl.Kd);
      b.Qg = plane(pl.Qg);
      b.P = plane(pl.P);
      b.U = ws;
    } else {
      b = carve_window_buffers(ws, p);
    }
    b.tbeta = chain_takes_tbeta(p);
    prepare_window(p, table, b, stream);
    chain_window(p, table, b, stream);
  } catch (...) {
    workspace_free(ws, stream);
    throw;
  }
  workspace_free(ws, stream);
}

// Workspace of one window, bytes per token row (every value head).
int64_t window_bytes_per_row(const Params& p) {
  int64_t total = 0;
  for (int64_t b : window_buffer_sizes(p, 1)) total += b;
  return total;
}

// Tokens per window (0: one window): on the time axis of a fixed-length batch, or of the packed axis of a varlen
// one. DELTACP_FUSED_WINDOW=<tokens> forces it (rounded down to whole chunks; 0 never cuts); unset, windows
// only where the whole call's workspace would pass kWindowBytes, each as long as that budget allows.
constexpr int64_t kWindowBytes = int64_t{1} << 30;
int64_t fused_window_tokens(const Params& p) {
  // Saved states (Params::chunk_h) are indexed by the whole call's chunks; the backward that follows takes more
  // workspace than the windows would save, so such a call runs whole.
  if (p.T <= p.chunk_size || p.chunk_h != nullptr) return 0;
  int64_t tokens = tiled::piece_tokens_from_env("DELTACP_FUSED_WINDOW");
  if (tokens == 0) return 0;
  if (tokens < 0) {
    const int64_t per_token = p.B * window_bytes_per_row(p);
    if (per_token * p.T <= kWindowBytes) return 0;
    tokens = kWindowBytes / per_token;
  }
  tokens = std::max<int64_t>(1, tokens / p.chunk_size) * p.chunk_size;
  return tokens < p.T ? tokens : 0;
}

// The view of p's tensors from token t0 on, T = len (fixed-length batches: every batch row's tokens t0 ..).
TensorRef shifted(const TensorRef& r, int64_t t0, int64_t es) {
  TensorRef s = r;
  if (s.ptr != nullptr) s.ptr = static_cast<char*>(s.ptr) + t0 * r.stride_t * es;
  return s;
}

// p over tokens [t0, t1) of its time axis (packed for varlen): every input and o shifted, no sequences set.
Params time_range(const Params& p, int64_t t0, int64_t t1) {
  const int64_t es = dtype_size(p.dtype), ges = p.g_fp32 ? 4 : es;
  Params q = p;
  q.T = t1 - t0;
  q.q = shifted(p.q, t0, es);
  q.k = shifted(p.k, t0, es);
  q.v = shifted(p.v, t0, es);
  q.g = shifted(p.g, t0, ges);
  q.beta = shifted(p.beta, t0, es);
  q.o = shifted(p.o, t0, es);
  return q;
}

// Whether the windows of a fixed-length batch overlap (forward_windows_overlapped) or run one after another on
// the caller's stream. Overlap is the default: measured on an H200 (bf16 gdn, end to end per call), windows of
// 2048 / 4096 tokens took 1.11 / 0.86 ms with it against 1.42 / 1.02 ms without at (2,16384,16,128) (64 chain
// CTAs), 2.80 / 1.92 against 3.68 / 2.45 ms at (1,65536,8,128), and the same within noise at (4,4096,64,128)
// (256 chain CTAs, no idle SMs). A call captured into a CUDA graph runs them in order (one stream, the path
// the graph tests replay). DELTACP_FUSED_OVERLAP=0 or 1 forces the choice.
bool windows_overlap(cudaStream_t stream) {
  const char* env = std::getenv("DELTACP_FUSED_OVERLAP");
  if (env != nullptr && *env != '\0') {
    DELTACP_CHECK(std::string(env) == "0" || std::string(env) == "1", "DELTACP_FUSED_OVERLAP",
                  "expected 0 or 1, got '", env, "'");
    return std::string(env) == "1";
  }
  return !tiled::stream_capturing(stream);
}

// Windows of a fixed-length batch with the next window's token-parallel stage beside this window's chain. The
// chain of a window runs B * HV * (1 or 2) CTAs, one per SM, which leaves the other SMs idle when that is below
// the SM count (64 of an H200's 132 at (2,16384,16,128)); the wgmma WY stage of the next window fills them. The
// caller's stream runs the tables and the WY stage of every window, the chain stream the chains:
//   caller:  [table, WY](0) -> ready0   [table, WY](1) -> ready1   wait freed0, [table, WY](2) -> ready0 ...
//   chain:   wait ready0, chain(0) -> freed0   wait ready1, chain(1) -> freed1   ...
// with two slots of W, U, P (a window's stage writes the slot the chain two windows back has freed), the
// state carried between windows on the chain stream, and the caller's stream joined to the chain stream at the
// end. The chain runs two load stages, so that a CTA of the WY kernel (70 KB of shared memory) fits on an SM
// beside it (141 KB): three stages (205 KB) would leave the chain's SMs to the chain and its CTAs waiting for
// SMs the WY grid has taken.
void forward_windows_overlapped(const Params& p, int64_t Tw, float* carry0, float* carry1) {
  cudaStream_t main = static_cast<cudaStream_t>(p.stream), hi = side_stream();  // the chain's CTAs are placed before the next window's WY CTAs
  const int64_t n = (p.T + Tw - 1) / Tw;
  const int64_t slot = window_buffers_bytes(time_range(p, 0, Tw));
  float* carry[2] = {carry0, carry1};
  cudaEvent_t ev[6] = {};  // start, done, ready[2], freed[2]
  for (cudaEvent_t& e : ev) DELTACP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaEvent_t start = ev[0], done = ev[1], ready[2] = {ev[2], ev[3]}, freed[2] = {ev[4], ev[5]};
  char* ws = static_cast<char*>(workspace_alloc(static_cast<size_t>(2 * slot), main));
  std::vector<std::unique_ptr<ChunkTable>> tables;
  auto release = [&] {
    tables.clear();
    workspace_free(ws, main);
    for (cudaEvent_t e : ev) (void)cudaEventDestroy(e);
  };
  try {
    DELTACP_CUDA_CHECK(cudaEventRecord(start, main));
    DELTACP_CUDA_CHECK(cudaStreamWaitEvent(hi, start, 0));  // the inputs, and anything before the call
    for (int64_t w = 0; w < n; ++w) {
      const int64_t t0 = w * Tw, t1 = std::min(p.T, t0 + Tw);
      Params q = time_range(p, t0, t1);
      q.h0 = t0 == 0 ? p.h0 : carry[(w + 1) % 2];
      q.ht = t1 == p.T ? p.ht : carry[w % 2];
      WindowBuffers b = carve_window_buffers(ws + (w % 2) * slot, q);
      if (w >= 2) DELTACP_CUDA_CHECK(cudaStreamWaitEvent(main, freed[w % 2], 0));
      tables.push_back(std::make_unique<ChunkTable>(q, q.chunk_size, main));
      b.tbeta = chain_takes_tbeta(q);
      prepare_window(q, *tables.back(), b, main);
      DELTACP_CUDA_CHECK(cudaEventRecord(ready[w % 2], main));
      DELTACP_CUDA_CHECK(cudaStreamWaitEvent(hi, ready[w % 2], 0));
      q.stream = hi;
      chain_window(q, *tables.back(), b, hi, /*chain_stages=*/2);
      DELTACP_CUDA_CHECK(cudaEventRecord(freed[w % 2], hi));
    }
    DELTACP_CUDA_CHECK(cudaEventRecord(done, hi));
    DELTACP_CUDA_CHECK(cudaStreamWaitEvent(main, done, 0));  // o and ht, and the end of every use of ws
  } catch (...) {
    (void)cudaEventRecord(done, hi);
    (void)cudaStreamWaitEvent(main, done, 0);
    release();
    throw;
  }
  release();
}

// A varlen call in windows of the packed axis (fused_windows.h). A window runs as up to three calls, so that
// every state comes from and goes to where it lives without a gathered copy of the batch's states: the
// segment that continues the previous window's sequence (one sequence, from the carried state), the whole
// sequences (h0 and ht in place in the caller's arrays), and the segment its sequence continues past the
// window (one sequence, its state to the carry). carry[0], carry[1]: the state in and out, swapped per window.
void forward_varlen_windows(const Params& p, int64_t Tw, float* carry0, float* carry1) {
  const int64_t state = p.HV * p.K * p.V;
  const auto windows = plan_varlen_windows(p.host_cu(), p.num_seqs, Tw, p.chunk_size);
  const float* h0 = static_cast<const float*>(p.h0);
  float* ht = static_cast<float*>(p.ht);
  float* in = carry0;
  float* out = carry1;
  for (const FusedWindow& w : windows) {
    const int64_t nseg = static_cast<int64_t>(w.cu.size()) - 1;
    if (nseg == 0) continue;
    auto one = [&](int64_t a, int64_t b, const void* s0, void* s1) {  // one sequence, tokens [t0 + a, t0 + b)
      Params q = time_range(p, w.t0 + a, w.t0 + b);
      q.cu_seqlens = q.cu_seqlens_host = nullptr;
      q.num_seqs = 1;
      q.h0 = s0;
      q.ht = s1;
      forward_window(q);
    };
    const int64_t first = w.continues_in ? 1 : 0, last = nseg - (w.continues_out ? 1 : 0);  // whole: [first, last)
    if (w.continues_in && w.continues_out && nseg == 1) {
      one(0, w.cu[1], in, out);
    } else {
      if (w.continues_in) one(0, w.cu[1], in, ht != nullptr ? ht + w.seq_first * state : nullptr);
      if (last > first) {
        std::vector<int64_t> cu(w.cu.begin() + first, w.cu.begin() + last + 1);
        const int64_t a = cu.front();
        for (int64_t& x : cu) x -= a;
        Params q = time_range(p, w.t0 + a, w.t0 + a + cu.back());
        q.cu_seqlens = q.cu_seqlens_host = cu.data();
        q.num_seqs = last - first;
        q.h0 = h0 != nullptr ? h0 + (w.seq_first + first) * state : nullptr;
        q.ht = ht != nullptr ? ht + (w.seq_first + first) * state : nullptr;
        forward_window(q);
      }
      if (w.continues_out) {
        const int64_t s = w.seq_first + nseg - 1;
        one(w.cu[nseg - 1], w.cu[nseg], h0 != nullptr ? h0 + s * state : nullptr, out);
      }
    }
    if (w.continues_out) std::swap(in, out);
  }
}
}  // namespace

// ---- the staged forward (api.h): prepare before the initial state is known, finish from it ----------------
// What the CP op runs around its exchange: prepare = the token-parallel stage and, where the chain cuts the
// sequences into pieces, pass 1 over every piece of every cut sequence (the last one too: a CP rank's
// pre-pass is its last sequence's maps composed, forward_composed_map, one launch); finish = the fold from h0
// and the chain over the pieces (or the chain over whole sequences from h0). One window however long the call
// (the workspace lives from prepare to finish, which the window budget cannot shorten); the same kernels and
// the same piece plan as chain_window, so o and ht are bit for bit forward()'s for a call of one window.
struct FusedFwdState final : tiled::StagedForwardState {
  using StagedForwardState::StagedForwardState;
  Method tier() const override { return Method::fused; }
  WindowBuffers b;
  tiled::ScanPlan plan;                        // the chain's pieces (chain_window's plan)
  float* maps = nullptr;                       // pass 1's [H | M] of every piece of every cut sequence
  float* starts = nullptr;                     // [pieces, HV, K, V]: the fold's start states
  float* piece_ht = nullptr;                   // [pieces, HV, K, V]: each piece's final state
  std::vector<const float*> seq_maps;          // per sequence: its first map in `maps`, or nullptr (not cut)
  std::unique_ptr<tiled::PieceTables> tables;  // the pieces' chunk table and fold tables (cut plans)
  bool finished = false;
};

// The plan chain_window makes for p's sequences.
tiled::ScanPlan chain_plan(const Params& p, const std::vector<SeqEntry>& seqs) {
  const int64_t Lc = fused_piece_chunks(p, seqs);
  return Lc > 0 ? tiled::plan_pieces(p, seqs, Lc) : tiled::ScanPlan{};
}

std::unique_ptr<FusedFwdState> start_staged(const Params& p) {
  if (const char* why = forward_refusal(p))
    throw_error("backend", "the fused tier cannot run this call: ", why, "; backend='tiled' runs it");
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  auto s = std::make_unique<FusedFwdState>(p, stream);
  if (s->table.num_seqs() == 0) return s;
  s->plan = chain_plan(p, s->table.host_seqs());
  const std::vector<int64_t> pass1 = tiled::pass1_pieces(s->plan);  // every piece of every cut sequence
  const int64_t P = static_cast<int64_t>(s->plan.pieces.size()), KV = p.K * p.V;
  const int64_t map_elems = p.HV * p.K * (p.V + p.K);
  const int64_t bytes_b = window_buffers_bytes(p), bytes_maps = align256(static_cast<int64_t>(pass1.size()) * map_elems * 4);
  const int64_t bytes_states = align256(P * p.HV * KV * 4);
  s->ws = static_cast<char*>(workspace_alloc(static_cast<size_t>(bytes_b + bytes_maps + 2 * bytes_states), stream));
  s->b = carve_window_buffers(s->ws, p);
  s->b.tbeta = chain_takes_tbeta(p);
  if (P > 0) {
    s->maps = reinterpret_cast<float*>(s->ws + bytes_b);
    s->starts = reinterpret_cast<float*>(s->ws + bytes_b + bytes_maps);
    s->piece_ht = reinterpret_cast<float*>(s->ws + bytes_b + bytes_maps + bytes_states);
  }
  const int64_t N = s->table.num_seqs();
  s->seq_maps.assign(static_cast<size_t>(N), nullptr);
  for (int64_t n = 0, at = 0; s->plan.cut() && n < N; ++n) {
    if (s->plan.pieces_of(n) < 2) continue;
    s->seq_maps[static_cast<size_t>(n)] = s->maps + at * map_elems;
    at += s->plan.pieces_of(n);
  }
  prepare_window(p, s->table, s->b, stream);
  if (!pass1.empty()) {
    dispatch_dtype(p.dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (tiled::kIs16Bit<T>) {
        std::vector<SeqEntry> mapped;
        mapped.reserve(pass1.size());
        for (int64_t i : pass1) mapped.push_back(s->plan.pieces[static_cast<size_t>(i)]);
        const ChunkTable map_table(std::move(mapped), p.chunk_size, stream);
        launch_chain_maps<T>(p, map_table, s->b.operands(), s->maps, stream);
      }
    });
  }
  if (s->plan.cut()) s->tables = std::make_unique<tiled::PieceTables>(p, s->plan, s->seq_maps, stream);
  return s;
}

FusedFwdState& prepared_state(StagedForward& staged) {
  auto* s = dynamic_cast<FusedFwdState*>(&staged);
  DELTACP_CHECK(s != nullptr, "state", "expected a forward prepared on the fused tier");
  DELTACP_CHECK(!s->finished, "state", "expected a prepared forward that has not finished yet");
  return *s;
}

// The prepared sequence n, which the chain cuts into pieces (else an error naming n).
void check_cut(const FusedFwdState& s, int64_t n) {
  DELTACP_CHECK(n >= 0 && n < s.table.num_seqs() && s.plan.pieces_of(n) > 1, "n",
                "expected a prepared sequence that the fused chain cuts into pieces (scan_pieces), got ", n);
}

// The forward. A call whose workspace (W, U, P and G grow with the tokens) would pass kWindowBytes runs as
// windows of whole chunks along time (fused_windows.h), one after another, each from the state the last left
// (fp32, so a window boundary changes nothing over whole sequences: the chain carries the same fp32 state
// through registers); so the workspace stays under the budget however long the sequences are.
void forward(const Params& p) {
  if (const char* why = forward_refusal(p))
    throw_error("backend", "the fused tier cannot run this call: ", why, "; backend='tiled' runs it");
  const int64_t Tw = fused_window_tokens(p);
  if (Tw == 0) {
    forward_window(p);
    return;
  }
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const int64_t state_bytes = (p.varlen() ? 1 : p.B) * p.HV * p.K * p.V * 4;
  float* carry = static_cast<float*>(workspace_alloc(static_cast<size_t>(2 * state_bytes), stream));
  try {
    if (p.varlen()) {
      forward_varlen_windows(p, Tw, carry, carry + state_bytes / 4);
      workspace_free(carry, stream);
      return;
    }
    if (windows_overlap(stream)) {
      forward_windows_overlapped(p, Tw, carry, carry + state_bytes / 4);
      workspace_free(carry, stream);
      return;
    }
    int w = 0;
    for (int64_t t0 = 0; t0 < p.T; t0 += Tw, ++w) {
      const int64_t t1 = std::min(p.T, t0 + Tw);
      Params q = time_range(p, t0, t1);
      float* in = carry + static_cast<int64_t>((w + 1) % 2) * (state_bytes / 4);
      float* out = carry + static_cast<int64_t>(w % 2) * (state_bytes / 4);
      q.h0 = t0 == 0 ? p.h0 : in;
      q.ht = t1 == p.T ? p.ht : out;
      forward_window(q);
    }
  } catch (...) {
    workspace_free(carry, stream);
    throw;
  }
  workspace_free(carry, stream);
}

std::unique_ptr<StagedForward> forward_prepare(const Params& p) { return start_staged(p); }

void forward_finish(StagedForward& staged, const Params& p) {
  FusedFwdState& s = prepared_state(staged);
  DELTACP_CHECK(p.variant == s.p.variant && p.dtype == s.p.dtype && p.g_fp32 == s.p.g_fp32 && p.B == s.p.B &&
                    p.T == s.p.T && p.H == s.p.H && p.HV == s.p.HV && p.K == s.p.K && p.V == s.p.V &&
                    p.chunk_size == s.p.chunk_size && p.q.ptr == s.p.q.ptr && p.k.ptr == s.p.k.ptr &&
                    p.v.ptr == s.p.v.ptr && p.o.ptr == s.p.o.ptr && p.num_seqs == s.p.num_seqs,
                "params", "finish: expected the prepared problem (the same q, k, v, o tensors and sequences)");
  s.finished = true;
  if (s.table.num_seqs() == 0) return;
  const float* h0 = static_cast<const float*>(p.h0);
  float* ht = static_cast<float*>(p.ht);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (tiled::kIs16Bit<T>) {
      if (!s.plan.cut()) {
        launch_chain<T>(p, s.table, s.b.operands(), h0, ht, s.stream, 0);
        return;
      }
      const int64_t N = s.table.num_seqs();
      tiled::launch_fold_starts(p, *s.tables, N, h0, s.starts, s.stream);
      launch_chain<T>(p, s.tables->pieces(), s.b.operands(), s.starts, ht != nullptr ? s.piece_ht : nullptr, s.stream,
                      0);
      if (ht != nullptr) tiled::launch_gather_final_states(p, *s.tables, N, s.piece_ht, ht, s.stream);
    }
  });
}

std::vector<int64_t> scan_pieces(const Params& p, int64_t n) {
  std::vector<tiled::ChunkEntry> chunks;
  std::vector<SeqEntry> seqs;
  tiled::build_chunk_entries(p, p.chunk_size, chunks, seqs);
  DELTACP_CHECK(n >= 0 && n < static_cast<int64_t>(seqs.size()), "n", "expected a sequence index in [0, ",
                seqs.size(), "), got ", n);
  return tiled::piece_bounds(chain_plan(p, seqs), seqs, n);
}

void forward_piece_maps(StagedForward& staged, int64_t n, float* maps, int64_t numel) {
  FusedFwdState& s = prepared_state(staged);
  check_cut(s, n);
  const int64_t P = s.plan.pieces_of(n), map_elems = s.p.HV * s.p.K * (s.p.V + s.p.K);
  DELTACP_CHECK(maps != nullptr && numel == P * map_elems, "maps", "expected ", P * map_elems, " fp32 elements ([",
                P, ", ", s.p.HV, ", ", s.p.K, ", ", s.p.V + s.p.K, "]), got ", numel);
  DELTACP_CUDA_CHECK(cudaMemcpyAsync(maps, s.seq_maps[static_cast<size_t>(n)], static_cast<size_t>(P * map_elems) * 4,
                                     cudaMemcpyDeviceToDevice, s.stream));
}

void forward_composed_map(StagedForward& staged, int64_t n, const float* init, float* out, int64_t width,
                          int64_t numel) {
  FusedFwdState& s = prepared_state(staged);
  check_cut(s, n);
  DELTACP_CHECK(out != nullptr && numel == s.p.HV * s.p.K * width, "out", "expected ", s.p.HV * s.p.K * width,
                " fp32 elements ([", s.p.HV, ", ", s.p.K, ", ", width, "]), got ", numel);
  tiled::launch_compose_maps(s.seq_maps[static_cast<size_t>(n)], s.plan.pieces_of(n), s.p.HV, s.p.K, s.p.V, width,
                             init, out, s.stream);
}

bool keeps_wy_stage(const Params& p) { return wy_stage_refusal(p) == nullptr; }

}  // namespace deltacp::cuda::fused
