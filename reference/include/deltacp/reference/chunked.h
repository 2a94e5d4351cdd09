// deltacp/reference/chunked.h — telling 2: the chunked WY form (docs/design.md section 3).
//
// For one chunk of n tokens that starts in state S, with G the within-chunk cumulative sum of the
// log decay (row i = g_1 + ... + g_i, a K-vector; 0 for delta) and Beta = diag(beta):
//
//   gdn / kda / delta:
//     A  = strict_tril( Beta (K e^G)(K e^-G)^T )    A_ij = beta_i sum_d k_id k_jd e^(G_id - G_jd), i > j
//     T  = (I + A)^-1                                 unit lower triangular, forward substitution
//     W  = T Beta (K e^G)        U = T Beta V         the WY representation
//     Vn = U - W S                                    "v_new"
//     O  = scale ( (Q e^G) S + tril((Q e^G)(K e^-G)^T) Vn )
//     S' = D_n S + (K e^(G_n - G))^T Vn
//
//   dplr (the plus sign; shared/seeds/dplr-chunkwise-affine.txt, written here with G_{i-1} the
//   decay before token i, G_0 = 0):
//     A  = strict_tril( (A_lr e^{G_prev})(B_lr e^-G)^T )   A_ij = sum_d a_id b_jd e^(G_{i-1,d} - G_jd)
//     Ak = strict_tril( (A_lr e^{G_prev})(K e^-G)^T )
//     T  = (I - A)^-1,   W = T (A_lr e^{G_prev}),   U = T Ak V
//     Ut = U + W S                                   ũ_i = a_i^T S_{i-1}  (the low-rank read-out)
//     O  = scale ( (Q e^G) S + tril(Q e^G (K e^-G)^T) V + tril(Q e^G (B_lr e^-G)^T) Ut )
//     S' = D_n S + (K e^(G_n - G))^T V + (B_lr e^(G_n - G))^T Ut
//
// Every exponential is of a difference G_i - G_j with i >= j (or of G alone), so nothing
// overflows in float: e^-G is never formed. Chunk boundaries restart at each sequence start;
// the last chunk of a sequence may be shorter than chunk_size.
#pragma once

#include <vector>

#include "deltacp/reference/types.h"

namespace deltacp::ref {

// (I + A)^-1 for strictly lower-triangular A, by forward substitution (row by row).
template <class S>
Mat<S> unit_lower_inverse(const Mat<S>& A);

// Within-chunk cumulative log decay: n x K (zeros for delta; gdn broadcast along K).
template <class S>
Mat<S> chunk_cumulative_decay(const HeadInputs<S>& chunk);

// The WY factors of one chunk (every piece reachable so notebooks and tests can show it).
template <class S>
struct ChunkWY {
  Mat<S> G;   // n x K, within-chunk cumulative log decay
  Mat<S> A;   // n x n strictly lower (dplr: A_ab)
  Mat<S> T;   // (I + A)^-1  (dplr: (I - A_ab)^-1)
  Mat<S> W;   // n x K
  Mat<S> U;   // n x V
  Mat<S> Ak;  // dplr only: n x n strictly lower A_ak
};
template <class S>
ChunkWY<S> chunk_wy(const HeadInputs<S>& chunk);

// One chunk applied to a state S: v_new (dplr: Ut), the chunk's outputs and its end state.
template <class S>
struct ChunkStep {
  Mat<S> v_new;  // n x V
  Mat<S> o;      // n x V
  Mat<S> S_end;  // K x V
};
template <class S>
ChunkStep<S> chunk_step(const HeadInputs<S>& chunk, const ChunkWY<S>& wy, const Mat<S>& S0);
// The two halves of chunk_step: the sequential state update (v_new and S_end; o left empty) and
// the output, which needs only the chunk's start state and v_new.
template <class S>
ChunkStep<S> chunk_state_update(const HeadInputs<S>& chunk, const ChunkWY<S>& wy, const Mat<S>& S0);
template <class S>
Mat<S> chunk_output(const HeadInputs<S>& chunk, const ChunkWY<S>& wy, const Mat<S>& S0, const Mat<S>& v_new);

// The whole slice, chunk by chunk from h0 (may be empty = zero). With with_outputs = false the
// output stage is skipped (o stays empty): the final-state-only forward and the backward's
// recompute of the chunk-start states need only `states`.
template <class S>
struct ChunkedForward {
  std::vector<Mat<S>> states;  // state at the start of each chunk, then the final state (nchunks + 1)
  Mat<S> v_new;                // n x V
  Mat<S> o;                    // n x V (empty when with_outputs is false)
};
template <class S>
ChunkedForward<S> chunked_forward(const HeadInputs<S>& x, const Mat<S>& h0, int chunk_size, bool with_outputs = true);

// Backward of one chunk: given the chunk's start state S0, dL/dO (n x V) and dL/dS_end, returns
// the gradients of the chunk's inputs and, in dh0, dL/dS0. Derived by reverse-mode through the
// formulas above (docs/notation.md spells out each line).
template <class S>
HeadGrads<S> chunk_backward(const HeadInputs<S>& chunk, const Mat<S>& S0, const Mat<S>& dout, const Mat<S>& dS_end);

// The whole slice: recompute chunk-start states forward, then walk chunks in reverse.
template <class S>
HeadGrads<S> chunked_backward(const HeadInputs<S>& x, const Mat<S>& h0, const Mat<S>& dout, const Mat<S>& dht,
                              int chunk_size);

// [t0, t1) chunk ranges of a slice of n tokens.
std::vector<std::pair<int64_t, int64_t>> chunk_ranges(int64_t n, int chunk_size);

}  // namespace deltacp::ref
