// deltacp/cuda/api.h — the CUDA backend: one dispatch over the tiers, on the shared Params.
//
// Every pointer in Params is device memory, except cu_seqlens_host (a host copy of cu_seqlens,
// required for varlen: launchers size grids and chunk tables from it). Work is launched on
// p.stream (a cudaStream_t; nullptr = the legacy default stream); the calls are asynchronous
// except where they must read something back. Workspace is stream-ordered on p.stream, from a per-device pool that
// keeps its memory mapped between calls (cuda/common/workspace_pool.h; release_workspace_memory()).
// Inputs fp32, bf16 or fp16 (p.dtype); states fp32 (p.state_dtype must be f32).
//
//   tier    Method::naive  one block per (sequence, value head), token loop      cuda/naive/
//           Method::tiled  chunked WY algorithm, one kernel per stage, mma       cuda/tiled/
//           Method::fused  Hopper: the state on chip through a sequence, forward  cuda/fused/
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "deltacp/params.h"

namespace deltacp::cuda {

// True when a CUDA device is usable (tests skip otherwise).
bool device_available();

// Hands the kernels' cached workspace memory back to the driver (it stays mapped between calls
// otherwise; cuda/common/workspace_pool.h says why). Synchronises every device that has a pool.
void release_workspace();

// Validates p (deltacp::Error naming the argument) and launches the tier's forward:
// writes o, and ht when p.ht is set.
void forward(const Params& p, Method tier);

// Validates p and launches the tier's backward: writes dq, dk, dv, dg (gdn/kda/dplr), dbeta
// (gdn/kda/delta), da/db (dplr) and dh0 when p.dh0 is set. Recomputes forward states itself.
void backward(const Params& p, Method tier);

// The forward with the tier chosen for p (choose_forward_tier in dispatch.cu): fused where its kernels
// apply (cuda/include/deltacp/cuda/tiers.h fused::forward_refusal), else tiled, else naive. Returns it.
Method forward_auto(const Params& p);
// The backward on the fastest tier that implements p's variant (tiled, else naive). Returns it.
Method backward_auto(const Params& p);
// Which tier the last forward or backward launched by this thread ran, and why that one.
struct TierChoice {
  Method tier;
  std::string why;
};
TierChoice last_tier_choice();
// Whether the last forward launched by this thread wrote Params::wy_stage (fused::keeps_wy_stage): a caller that
// passes it to the backward only then lets the backward skip its recompute.
bool last_forward_kept_wy_stage();
// The tier forward_auto would run p on, and why; launches nothing (the CP op picks each rank's local tier).
TierChoice forward_tier(const Params& p);

// x / sqrt(sum(x^2) + eps) over the last dimension of `rows` contiguous rows of D elements (D <= 256): fp32
// math, y in x's dtype; rstd (fp32 [rows], optional) keeps 1 / norm for the backward, which writes
// dx = r (dy - y (y . dy)) (cuda/common/l2norm.cu). FLA's use_qk_l2norm_in_kernel for q and k, in one pass
// each way, on `stream`.
void l2norm_rows(const void* x, void* y, float* rstd, int64_t rows, int64_t D, DType dtype, float eps, void* stream);
void l2norm_rows_backward(const void* x, const float* rstd, const void* dy, void* dx, int64_t rows, int64_t D,
                          DType dtype, void* stream);
// kda's in-kernel gate (Params::gate_A_log) of p.g into out, fp32 [B, T, HV, K] contiguous, on `stream`
// (cuda/common/kda_gate.cu): the naive and tiled forwards read it in place of the raw gate.
void kda_gate(const Params& p, float* out, void* stream);
// The same gate over `rows` contiguous rows of K (rows = B * T * HV; row r belongs to head r % HV), from g of
// gate_dtype into fp32 y; and its backward from dg (fp32): dx (fp32 [rows, K], also dt_bias's gradient before the
// sum over rows) and dA (fp32 [rows]: each row's part of A_log's gradient). lower_bound < 0: the sigmoid form; 0:
// the softplus form. dt_bias may be null.
void kda_gate_rows(const void* g, DType gate_dtype, float* y, int64_t rows, int64_t HV, int64_t K, const float* A_log,
                   const float* dt_bias, float lower_bound, void* stream);
void kda_gate_rows_backward(const void* g, DType gate_dtype, const float* dg, float* dx, float* dA, int64_t rows,
                            int64_t HV, int64_t K, const float* A_log, const float* dt_bias, float lower_bound,
                            void* stream);

// The forward in stages around h0, for context parallelism (the tiled tier only):
//
//   auto s = forward_prepare(p, Method::tiled);   // the stages that do not read h0: the cumulative
//                                                 // gates and the WY stage (p.h0, p.ht ignored)
//   forward_state_pieces(*s, pieces, row0, true); // optional, any number of times: the final states of
//                                                 // pieces (a final-state-only problem over rows
//                                                 // [row0, row0 + pieces.T) of p, cut at p's own chunk
//                                                 // boundaries) from s's stages, each from pieces.h0
//   forward_finish(*s, p_with_h0);                // the state scan from h0 and the output; the same
//                                                 // tensors
//
// The same o and ht, bit for bit, as forward(p_with_h0, Method::tiled). A piece's state may be wider
// than p's values (pieces.V >= p.V): with_values = true gives its first p.V columns p's values and the
// rest zero values; with_values = false gives every column zero values. That is the CP pre-pass's
// [H | M] from [h | I] (and M alone from I) without a widened [v | 0] input: a rank prepares its local
// forward, takes its pre-pass from the prepared stages, and finishes after the exchange.
// The tensors of p must stay alive until finish's kernels have run.
//
// The fused tier (Hopper) stages the same way: forward_prepare(p, Method::fused) runs its token-parallel stage
// (W, U, P; kda's operands) and, where its chain cuts the sequences into pieces (exact intra-card CP), every
// piece's map [H_j | M_j] by the chain's map mode, the last piece's too; forward_piece_maps and
// forward_composed_map read those maps; finish folds them from h0 and runs the chain over the pieces (or over
// whole sequences from h0). It has no forward_state_pieces (its chain always makes the output); the same o
// and ht, bit for bit, as forward(p_with_h0, Method::fused) run as one window.
class StagedForward {
 public:
  virtual ~StagedForward() = default;
  virtual Method tier() const = 0;  // the tier that prepared it: its steps run there
};
std::unique_ptr<StagedForward> forward_prepare(const Params& p, Method tier);
void forward_state_pieces(StagedForward& s, const Params& pieces, int64_t row0, bool with_values);
void forward_finish(StagedForward& s, const Params& p);

// The tiled forward's state scan in pieces (cuda/tiled/scan_split.cu): where a few long sequences would
// leave most SMs idle, it cuts them into pieces of whole chunks, computes each piece's affine map
// [H_j | M_j] (pass 1: no h0 needed, so forward_prepare runs it), folds the maps into each piece's start
// state and scans the pieces side by side (finish).
//
// scan_pieces(p, n, tier): where the tiled (or the fused) forward of p cuts sequence n, as token offsets from
// the sequence's start, [0, ..., len] ({0, len}: not cut). No GPU work; the same answer for the prepared
// problem, the one-shot forward of it and (tiled) its backward's recompute.
//
// forward_piece_maps(s, n, maps, numel): every piece's [H_j | M_j] of prepared sequence n, from [0 | I],
// into maps (fp32 device memory, [P, HV, K, V + K], numel = its elements, P = scan_pieces(p, n).size() - 1
// >= 2), on the prepared stream: a copy of what prepare's pass 1 made (it maps the last piece too, which
// stage 3 does not need). A CP rank's pre-pass of a cut last segment is these maps composed: the pre-pass
// costs the local forward the last piece's map (in the same launch) and the composition.
//
// forward_composed_map(s, n, init, out, width, numel): those maps composed in fp32 on the prepared stream,
// in one kernel, without the copy: out [HV, K, width] (numel = HV K width elements, fp32 device memory)
// = the state leaving sequence n when it is entered with init (the same shape; nullptr: [0 | I], the
// identity in the columns from V on). width = V + K: the sequence's [H | M]; width = V: the offset alone.
// The CP pre-pass of a cut last segment is this one launch.
std::vector<int64_t> scan_pieces(const Params& p, int64_t n, Method tier = Method::tiled);
void forward_piece_maps(StagedForward& s, int64_t n, float* maps, int64_t numel);
void forward_composed_map(StagedForward& s, int64_t n, const float* init, float* out, int64_t width, int64_t numel);
// The same composition of any maps [P, HV, K, V + K] (fp32 device memory, P >= 1) on `stream`: the CP
// pre-pass runs it on maps it computed itself, so that every route composes a cut's maps alike.
void compose_state_maps(const float* maps, int64_t P, int64_t HV, int64_t K, int64_t V, int64_t width,
                        const float* init, float* out, void* stream);

// The backward in stages around dht, for context parallelism (the tiled tier only):
//
//   auto s = backward_prepare(p, Method::tiled);  // every stage that does not read dht: the forward
//                                                 // recompute and the intra-chunk B0 (p.dht ignored)
//   backward_dh0_pieces(*s, pieces);              // optional, any number of times: dh0 of each piece
//                                                 // (a dh0-only problem over the first rows of p, cut
//                                                 // at p's own chunk boundaries) from s's stages
//   backward_states(*s, stream);                  // optional, once: the recompute's state scan (only
//                                                 // finish's later stages read it) on `stream`, which
//                                                 // must be ordered after prepare and before finish
//   backward_finish(*s, p_with_dht);              // the rest: (the states,) B1..B5 with dht; the same
//                                                 // tensors
//
// The same results, bit for bit, as backward(p_with_dht, Method::tiled). A rank of a CP backward
// prepares while it waits for the exchange, and its pre-pass reuses the prepared stages. The tensors
// of p must stay alive until finish's kernels have run; the state frees its workspace when destroyed.
class StagedBackward {
 public:
  virtual ~StagedBackward() = default;
};
std::unique_ptr<StagedBackward> backward_prepare(const Params& p, Method tier);
void backward_dh0_pieces(StagedBackward& s, const Params& pieces);
void backward_states(StagedBackward& s, void* stream);
void backward_finish(StagedBackward& s, const Params& p);

// Which (variant, tier, direction) combinations exist in this build.
bool supports(Variant v, Method tier, bool backward);

}  // namespace deltacp::cuda
