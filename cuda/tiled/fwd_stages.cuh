// cuda/tiled/fwd_stages.cuh — the four forward stages of the tiled tier, as launchers the forward
// (tiled_fwd.cu) and the backward (tiled_bwd.cu, which recomputes them) both call.
//
// The chunked WY form (DESIGN.md section 3; reference/include/deltacp/reference/chunked.h), for a
// chunk of n <= 64 tokens with state S at its start, G the within-chunk cumulative log decay:
//
//   stage 1  chunk_cumsum      G    = cumsum of g inside each chunk                      (gdn, kda)
//   stage 2  chunk_wy          A    = strict_tril(Beta (K e^G)(K e^-G)^T),  T = (I + A)^-1
//                              W    = T Beta (K e^G),   U = T Beta V
//                              Kd   = K e^(G_n - G)                          (kda only: for stage 3)
//   stage 3  chunk_state_scan  h_c  = S at the start of chunk c (sequential over the chunks)
//                              Vn   = U - W S;   S' = D_n S + (K e^(G_n - G))^T Vn
//   stage 4  chunk_output      O    = scale ((Q e^G) S + tril((Q e^G)(K e^-G)^T) Vn)
//
// Intermediates (all device memory, row-major, allocated by the caller; R = B * T rows in the flat
// token axis of chunk_table.cuh; Kp = padded_dim(K), Vp = padded_dim(V); padding columns are
// written as zeros; every token row is written, rows of the padded 64-row tiles past a short chunk
// are not):
//
//   G      fp32     gdn [R, HV]; kda [R, HV, K] (not padded); not used for delta (pass nullptr)
//   W      p.dtype  [R, HV, Kp]
//   U      p.dtype  [R, HV, Vp]
//   Kd     p.dtype  [R, HV, Kp]   kda only (nullptr otherwise)
//   Tinv   fp32     [R, HV, 64]   optional (nullptr = not written): row i of chunk c's T = (I + A)^-1
//                                 at the token row of token i; columns >= the chunk length are zero
//   v_new  p.dtype  [R, HV, Vp]
//   h      p.dtype  [num_chunks, HV, Kp, Vp]   chunk-start states, chunk index of chunk_table.cuh
//
// Why p.dtype for W, U, v_new and h: stages 3 and 4 feed them to bf16/fp16 tensor-core products,
// whose operands are 16-bit anyway; storing them rounded halves their HBM traffic (h is the largest
// stream: Kp * Vp per chunk). The state itself is carried in fp32 registers through stage 3, so the
// rounding does not accumulate along the sequence. For fp32 inputs everything is fp32.
//
// All launchers run on `stream`, read p's device pointers and p.chunk_size (<= 64), and use the
// ChunkTable built for p with p.chunk_size.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "chunk_table.cuh"
#include "deltacp/cuda/api.h"
#include "deltacp/params.h"

namespace deltacp::cuda::tiled {

// What every staged forward keeps between its stages (the tiled tier's FwdState, the fused tier's
// FusedFwdState): the prepared problem, its chunk table, the stream its kernels run on and one workspace,
// freed stream-ordered after those kernels when the state is destroyed. Each tier adds its own buffers.
struct StagedForwardState : StagedForward {
  StagedForwardState(const Params& params, cudaStream_t s)
      : p(params), table(params, params.chunk_size, s), stream(s) {}
  ~StagedForwardState() override { workspace_free(ws, stream); }
  StagedForwardState(const StagedForwardState&) = delete;
  StagedForwardState& operator=(const StagedForwardState&) = delete;
  Params p;  // the prepared problem (its tensors must outlive the state: the caller keeps them)
  ChunkTable table;
  cudaStream_t stream;
  char* ws = nullptr;
};

// Rows of the per-chunk tile: every chunk size up to 64 runs on the same 64-row tiles (a shorter
// chunk is a masked tile).
constexpr int kTileRows = 64;
// Largest head dimensions the tiles support.
constexpr int64_t kMaxHeadDim = 256;

// K or V rounded up to the 16-column granularity of the tensor-core tiles.
inline int64_t padded_dim(int64_t d) { return (d + 15) / 16 * 16; }

// Element counts of the intermediates (multiply by the element size of their dtype).
struct FwdSizes {
  int64_t G = 0, W = 0, U = 0, Kd = 0, Tinv = 0, v_new = 0, h = 0;
};
FwdSizes fwd_sizes(const Params& p, const ChunkTable& table);

// FLOPs and HBM bytes of the tiled forward as implemented (stages 1-4; triangular products counted
// in full, as the tensor cores compute them; per chunk of n tokens), for benchmark reports.
struct FwdCost {
  double flops = 0, bytes = 0;
};
FwdCost fwd_cost(const Params& p, const ChunkTable& table);

// Checks what the tiled tier supports beyond validate_forward (dtype, state dtype, K, V,
// chunk_size); throws deltacp::Error naming the argument.
void check_tiled_supported(const Params& p);

void launch_chunk_cumsum(const Params& p, const ChunkTable& table, float* G, cudaStream_t stream);

// The WY stage: W, U (Kd for kda) and, where Tinv is given, T. dv_local (the backward's recompute): where the
// Hopper WY stage runs (wy_wgmma.cuh) and can read p.dout, it also writes stage B0's scale P^T dO there
// ([R, HV, 128] fp32): dv_local in the result; otherwise B0 is still to run. t16: where the Hopper WY stage
// runs, T goes out rounded to the input dtype in the first half of each fp32 row (the chunk-local backward
// kernel's operand): t16 in the result; otherwise T is fp32.
struct WyDone {
  bool dv_local = false;
  bool t16 = false;
};
WyDone launch_chunk_wy(const Params& p, const ChunkTable& table, const float* G, void* W, void* U, void* Kd,
                       float* Tinv, cudaStream_t stream, float* dv_local = nullptr, bool t16 = false);

// The kda backward's recompute on Hopper's warpgroup products (kda_prepare_wgmma.cuh, kda_prepare_wgmma_kernel in
// its backward mode), in place of launch_chunk_cumsum, launch_chunk_wy and stage B0: from the raw gate p.g, q, k, v,
// beta and dO, G (every row, [R, HV, K] fp32: the cumsum's bits), W, U, Kd, T ([R, HV, 64]: fp32, or with t16 rounded
// to the input dtype in the first 128 bytes of each row), Q e^G ([R, HV, 128], B0's) and B0's scale P^T dO (dvl,
// [R, HV, 128] fp32). kda_bwd_recompute_refusal: why it cannot run p (nullptr: it can).
const char* kda_bwd_recompute_refusal(const Params& p);
void launch_kda_bwd_recompute(const Params& p, const ChunkTable& table, float* G, void* W, void* U, void* Kd,
                              float* Tinv, bool t16, void* Qg, float* dvl, cudaStream_t stream);
// Stage B0 alone over the WY stage a forward kept (Params::wy_stage's P plane): dvl = scale P^T dO from the same
// shared-memory operands the recompute builds (kda_prepare_wgmma.cuh b0_kept_kernel; kda: the recompute's bits).
// Runs where the recompute's wgmma kernel with B0 would (kda_bwd_recompute_refusal; gdn:
// gdn_recompute_matches_wy_stage).
void launch_bwd_b0_kept(const Params& p, const ChunkTable& table, const void* P, float* dvl, cudaStream_t stream);
// Whether gdn's recompute (launch_chunk_cumsum, then launch_chunk_wy with dv_local) runs the wgmma WY stage with
// B0, so that it would write what a kept WY stage holds (G, W, T in 16 bits with t16) and may be replaced by
// launch_bwd_b0_kept.
bool gdn_recompute_matches_wy_stage(const Params& p);

// Where a state scan reads its per-row intermediates when they were made for another problem: the
// staged forward's pieces (api.h StagedForward) scan rows [row0, row0 + p.T) of the prepared problem's
// G, W, U, Kd, whose U is u_width columns wide (padded); the state's first u_cols columns (a multiple
// of 16, or 0) evolve with those U columns and the others with zero values (the [H | M] maps of the
// CP pre-pass: M's columns start from I and never see v).
struct ScanRows {
  int64_t row0 = 0;
  int64_t u_width = 0;
  int64_t u_cols = 0;
};

// h0: optional [N, HV, K, V] fp32; ht: optional [N, HV, K, V] fp32 (the final states). rows: null for
// p's own intermediates. ctas_two_wg: the grid width that picks the scan kernel (use_wgmma_scan in
// tiled_fwd.cu); 0 = this launch's own. The scan in pieces passes one width to every launch of its pass 1,
// so that a piece's map comes from the same kernel whichever call runs it.
void launch_chunk_state_scan(const Params& p, const ChunkTable& table, const float* G, const void* W,
                             const void* U, const void* Kd, void* h, void* v_new, const float* h0, float* ht,
                             cudaStream_t stream, const ScanRows* rows = nullptr, int64_t ctas_two_wg = 0);

// Why the Hopper (wgmma) state scan cannot run for p, or nullptr when it can (tiled_fwd.cu).
// h_and_vnew_agree: h and v_new are both stored or neither.
const char* wgmma_scan_refusal(const Params& p, bool h_and_vnew_agree);

// ---- stage 3 in pieces (scan_split.cu) --------------------------------------------------------------
// Where a few long sequences leave most SMs idle, stage 3 cuts them into pieces of whole chunks that scan
// side by side: pass 1 gives each piece's affine map [H_j | M_j] (from [0 | I], a state V + K wide),
// a fold gives each piece's start state S_{j+1} = M_j S_j + H_j, pass 2 scans every piece from its start
// and stores h and v_new as the whole scan does. scan_split.cu says why and when.
struct ScanPlan {
  std::vector<SeqEntry> pieces;      // every piece of every sequence, in order (an uncut sequence is one)
  std::vector<int64_t> first_piece;  // [N + 1]: sequence n's pieces are first_piece[n] .. first_piece[n + 1] - 1
  int64_t ctas_two_wg = 0;           // pass 1's kernel choice: its CTAs if every piece of every cut sequence ran
  bool cut() const { return !pieces.empty(); }  // false: the whole-sequence scan runs
  int64_t pieces_of(int64_t n) const { return cut() ? first_piece[n + 1] - first_piece[n] : 1; }
};

// The plan for p's sequences (seqs: ChunkTable::host_seqs() of p): cut where that is predicted faster, or
// as DELTACP_TILED_SCAN_PIECE=<tokens> says (0: never). Never for a final-state-only problem. Host only.
ScanPlan plan_scan(const Params& p, const std::vector<SeqEntry>& seqs);

// Sequence n's piece boundaries under `plan` (seqs: the plan's sequences), as token offsets from the
// sequence's start: [0, ..., len] ({0, len} where the plan does not cut it). Host only.
std::vector<int64_t> piece_bounds(const ScanPlan& plan, const std::vector<SeqEntry>& seqs, int64_t n);

// Pass 1 over pieces `which` (indices into plan.pieces): maps [which.size(), HV, K, V + K] fp32, piece i's
// [H_i | M_i] from [0 | I]. Every launch picks its kernel from plan.ctas_two_wg, so a piece's map is the
// same bits whichever call makes it.
void launch_pass1(const Params& p, const ScanPlan& plan, const std::vector<int64_t>& which, const float* G,
                  const void* W, const void* U, const void* Kd, float* maps, cudaStream_t stream);

// The pieces the forward's pass 1 maps: every piece of every cut sequence, in order. Stage 3 reads all
// but each sequence's last; the last one's is the CP pre-pass's (it composes them all), and in one
// launch it usually costs no extra wave (32K tokens, 16 heads: 256 CTAs instead of 224 on 132 SMs).
std::vector<int64_t> pass1_pieces(const ScanPlan& plan);

// One sequence of the fold (scan_split.cu): its pieces in pass 2's table and where its pass-1 maps are.
struct FoldSeq {
  int64_t first_piece;  // index of its first piece among every piece (pass 2's table)
  int64_t count;        // its pieces
  const float* maps;    // [count (at least count - 1 read), HV, K, V + K] fp32, or nullptr when count == 1
};

// Pass 2's device tables: plan.pieces as a chunk table and one FoldSeq per sequence, seq_maps[n] being
// sequence n's pass-1 maps (nullptr for a sequence the plan does not cut). launch_state_scan makes them
// per call; the staged forward makes them once, at prepare, so that its finish launches kernels only.
class PieceTables {
 public:
  PieceTables(const Params& p, const ScanPlan& plan, const std::vector<const float*>& seq_maps, cudaStream_t stream);
  ~PieceTables();
  PieceTables(const PieceTables&) = delete;
  PieceTables& operator=(const PieceTables&) = delete;
  const ChunkTable& pieces() const { return pieces_; }
  const FoldSeq* fold_seqs() const { return fold_seqs_; }  // device, [N]
  bool maps_aligned() const { return aligned_; }             // every map fit for 16-byte copies

 private:
  ChunkTable pieces_;
  FoldSeq* fold_seqs_ = nullptr;
  bool aligned_ = true;
  cudaStream_t stream_;
};

// Stage 3 as planned: h, v_new (and ht) from h0, like launch_chunk_state_scan. tables: null (pass 1 then
// maps all but the last piece of every cut sequence here), or tables whose maps were made by launch_pass1.
void launch_state_scan(const Params& p, const ChunkTable& table, const ScanPlan& plan, const float* G,
                       const void* W, const void* U, const void* Kd, void* h, void* v_new, const float* h0,
                       float* ht, cudaStream_t stream, const PieceTables* tables = nullptr);

// The pieces of L chunks each that the scan in pieces would cut p's sequences into (a sequence of at most
// L chunks stays whole). Host only. The fused tier (cuda/fused/) plans its own piece length with it.
ScanPlan plan_pieces(const Params& p, const std::vector<SeqEntry>& seqs, int64_t L);

// A piece-length variable (DELTACP_TILED_SCAN_PIECE, DELTACP_FUSED_PIECE): -1 when unset, else tokens per
// piece (0: never cut); deltacp::Error naming the variable for anything else. Host only.
int64_t piece_tokens_from_env(const char* var);

// The fold alone: starts [P, HV, K, V] fp32 = every piece's start state from h0 (nullptr: zero) and the
// tables' pass-1 maps (N sequences). And the last piece's final state of each sequence into ht [N, HV, K, V],
// from piece_ht [P, HV, K, V]. launch_state_scan runs both around its pass 2; the fused tier runs its own
// pass 2 between them.
void launch_fold_starts(const Params& p, const PieceTables& tables, int64_t N, const float* h0, float* starts,
                        cudaStream_t stream);
void launch_gather_final_states(const Params& p, const PieceTables& tables, int64_t N, const float* piece_ht,
                                float* ht, cudaStream_t stream);

// The CP pre-pass of a cut sequence: its P pieces' maps [P, HV, K, V + K] (launch_pass1, every piece)
// composed in fp32 into out [HV, K, width] = the state leaving the sequence when it is entered with init
// ([HV, K, width] fp32; nullptr: [0 | I], the identity in the columns from V on). width = V + K gives
// the sequence's [H | M]; width = V the offset alone (from init = h0, or 0).
void launch_compose_maps(const float* maps, int64_t P, int64_t HV, int64_t K, int64_t V, int64_t width,
                         const float* init, float* out, cudaStream_t stream);

// Writes p.o.
void launch_chunk_output(const Params& p, const ChunkTable& table, const float* G, const void* h,
                         const void* v_new, cudaStream_t stream);

// The fused forward's kda token-parallel stage, from the raw gate p.g (summed within each chunk in shared memory,
// the bits of launch_chunk_cumsum: no G workspace pass) and q, k (l2-normalised in shared memory when
// p.qk_l2norm): the WY stage's W, U and K e^(G_n - G) (chunk_wy_kernel's), G's last row of every chunk into G_last
// ([R, HV, K] fp32 rows: the only rows the chain and its pieces read), and P ([R, HV, 64], the output stage's
// decayed scores, zero above the diagonal) and Q e^G ([R, HV, K]), 16-bit. kda, 16-bit inputs, K = 128 or 64.
// One kernel: kda_prepare_wgmma_kernel on wgmma where K = 128 (V = 128 or 256), else kda_prepare_kernel
// (mma.sync); with DELTACP_FUSED_KDA_PREPARE=0 the pair it replaces, chunk_wy_kernel and kda_chain_operands_kernel,
// with the same bits as kda_prepare_kernel.
// With Tinv (a forward that keeps its stage for the backward, Params::wy_stage; only where wy_stage_kept_by says
// so): G_last takes every row of G, and T goes to Tinv as the backward's recompute writes it with t16.
void launch_kda_fused_prepare(const Params& p, const ChunkTable& table, float* G_last, void* W, void* U, void* Kd,
                              void* P, void* Qg, cudaStream_t stream, float* Tinv = nullptr);
// Whether the fused forward's token-parallel stage can write every plane of Params::wy_stage for p (16-bit, K = V =
// 128; kda: launch_kda_fused_prepare's wgmma kernel runs p; gdn: the wgmma WY stage does), so that the tiled
// backward may read them in place of its recompute.
bool wy_stage_kept_by(const Params& p);
// Why launch_kda_fused_prepare cannot run p (nullptr: it can): an sm_90a build, kda, bf16 / fp16, K = 128 or 64,
// compute capability 9.0.
const char* kda_fused_prepare_refusal(const Params& p);

}  // namespace deltacp::cuda::tiled
