// deltacp/reference/affine.h — telling 3: every span of tokens is an affine map of the state.
//
//   S_end = M S_start + H                  (M: K x K, H: K x V)
//   chunk:  M = D_n - (K e^(G_n - G))^T W,  H = (K e^(G_n - G))^T U          (gdn / kda / delta)
//           M = D_n + (B e^(G_n - G))^T W,  H = (K e^(G_n - G))^T V + (B e^(G_n - G))^T U   (dplr)
//   composition (later after earlier):  (M2, H2) o (M1, H1) = (M2 M1, M2 H1 + H2)
//
// Backward mirror: dL/dS_start = M^T dL/dS_end + dH, where dH is the gradient reaching S_start from
// the span's own outputs (independent of S_start, since o is affine in it).
#pragma once

#include "deltacp/reference/chunked.h"

namespace deltacp::ref {

template <class S>
struct Affine {
  Mat<S> M;  // K x K
  Mat<S> H;  // K x V
  static Affine identity(int64_t K, int64_t V);
  Mat<S> apply(const Mat<S>& S0) const { return M * S0 + H; }
};

// later o earlier.
template <class S>
Affine<S> compose(const Affine<S>& later, const Affine<S>& earlier);

// (M, H) of one chunk from its WY factors.
template <class S>
Affine<S> chunk_affine(const HeadInputs<S>& chunk, const ChunkWY<S>& wy);

// (M, H) of tokens [t0, t1) of a slice: the chunk maps (chunks aligned at t0) folded in order.
template <class S>
Affine<S> span_affine(const HeadInputs<S>& x, int64_t t0, int64_t t1, int chunk_size);

// (M, H) of the same span by multiplying the per-token transitions: the definition itself, slow.
template <class S>
Affine<S> span_affine_tokens(const HeadInputs<S>& x, int64_t t0, int64_t t1);

// Forward through affine folds: chunk-start states S_{c+1} = M_c S_c + H_c, then each chunk's
// outputs from the chunk formula. Same results as chunked_forward, computed the CP way.
// with_outputs = false: only the final state (o stays empty).
template <class S>
HeadOutputs<S> affine_forward(const HeadInputs<S>& x, const Mat<S>& h0, int chunk_size, bool with_outputs = true);

// Backward map of a span: dS_start = Mt dS_end + dH (Mt = M^T). dout covers the span's rows.
template <class S>
struct AffineBackward {
  Mat<S> Mt;  // K x K
  Mat<S> dH;  // K x V
};
template <class S>
AffineBackward<S> span_affine_backward(const HeadInputs<S>& x, int64_t t0, int64_t t1, const Mat<S>& dout,
                                       int chunk_size);

}  // namespace deltacp::ref
