// deltacp/reference/attention.h — softmax attention, blockwise with the online-softmax merge, and
// every backward: the reference that ring attention (deltacp.cp.ring_attention) is checked against.
//
// One head, one sequence; rows are tokens. Every token carries its global position, so a block of
// queries and a block of keys may be any two pieces of a sequence (the zig-zag layout deals a rank
// two distant pieces). With causal masking key j is visible to query i iff kpos[j] <= qpos[i].
//
//   plain:   S = scale Q K^T (masked: -inf),  P = softmax_rows(S),  O = P V
//   block:   (O_b, lse_b) over one key block: O_b = softmax over the block's keys, lse_b = log sum e^S
//   merge:   L = log(e^{lse_a} + e^{lse_b}),  O = e^{lse_a - L} O_a + e^{lse_b - L} O_b
//
// Merging the blocks of all keys in any order gives plain attention's O and L = log sum_j e^{S_ij}
// (the running max of the seeds' formulation is folded into the log-sum-exp: lse = max + log sum).
// A row with no visible key has lse = -inf and O = 0; merging it is the identity.
//
// Backward (upstream dO, and dlse for a partial result that was merged):
//   merge:   dO_x = w_x dO,  dlse_x = w_x (dO . O_x - dO . O + dL),  w_x = e^{lse_x - L}
//   block:   P = e^{S - lse},  dV = P^T dO,  dS = P o (dO V^T - rowdot(dO, O) + dlse),
//            dQ = scale dS K,  dK = scale dS^T Q
// Called with the FINAL (O, L) of a row and dlse = 0, the block backward gives that key block's
// exact share of the gradients: the ring backward needs no merge backward (flash attention's trick).
#pragma once

#include <cstdint>
#include <vector>

#include "deltacp/reference/types.h"

namespace deltacp::ref {

// Global positions of a block's tokens (causal masking); empty = 0, 1, ..., n-1.
using Positions = std::vector<int64_t>;

template <class S>
struct AttnPartial {
  Mat<S> o;    // n x Dv, normalised over the keys seen so far (0 where none is visible)
  Vec<S> lse;  // n, log sum_j e^{S_ij} over those keys (-inf where none is visible)
};

template <class S>
struct AttnGrads {
  Mat<S> dq, dk, dv;
};

template <class S>
struct AttnMergeGrads {
  Mat<S> do_a, do_b;
  Vec<S> dlse_a, dlse_b;
};

// Plain attention over all keys (materialises P). q: n x D, k: m x D, v: m x Dv.
template <class S>
AttnPartial<S> attention_forward(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, S scale, bool causal,
                                 const Positions& qpos = {}, const Positions& kpos = {});

// Plain attention's backward (dS = P o (dP - rowsum(P o dP)), from P recomputed).
template <class S>
AttnGrads<S> attention_backward(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, const Mat<S>& dout, S scale,
                                bool causal, const Positions& qpos = {}, const Positions& kpos = {});

// The partial result of q against one key block (the same numbers as attention_forward restricted
// to those keys; kept separate so the block path reads as the ring step does).
template <class S>
AttnPartial<S> attention_block_forward(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, S scale, bool causal,
                                       const Positions& qpos, const Positions& kpos);

// One key block's gradients given the row statistics (o, lse) and upstream (dout, dlse; dlse may be
// empty = 0). With the block's own (o, lse) it is the block's backward; with the final ones and
// dlse = 0 it is the block's share of the whole backward.
template <class S>
AttnGrads<S> attention_block_backward(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, const Mat<S>& o,
                                      const Vec<S>& lse, const Mat<S>& dout, const Vec<S>& dlse, S scale, bool causal,
                                      const Positions& qpos, const Positions& kpos);

// The online-softmax merge of two partial results over disjoint key sets.
template <class S>
AttnPartial<S> attention_merge(const AttnPartial<S>& a, const AttnPartial<S>& b);

// Its backward: upstream (dout, dlse) of the merged result (dlse may be empty = 0).
template <class S>
AttnMergeGrads<S> attention_merge_backward(const AttnPartial<S>& a, const AttnPartial<S>& b,
                                           const AttnPartial<S>& merged, const Mat<S>& dout, const Vec<S>& dlse);

}  // namespace deltacp::ref
