// deltacp/reference/types.h — Eigen types and the per-(sequence, head) slice every telling works on.
//
// The four tellings (recurrence.h, chunked.h, affine.h, cp.h) are written for ONE sequence and
// ONE value head: rows are tokens, so a newcomer reads the math without layout noise. batch.h
// gathers such slices out of a Params (any dtype, any strides), runs a telling, and scatters back.
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <vector>

#include "deltacp/params.h"

namespace deltacp::ref {

template <class S>
using Mat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class S>
using Vec = Eigen::Matrix<S, Eigen::Dynamic, 1>;

// One sequence, one value head, n tokens (rows).
template <class S>
struct HeadInputs {
  Variant variant = Variant::gdn;
  Mat<S> q, k;  // n x K
  Mat<S> v;     // n x V
  Mat<S> g;     // gdn: n x 1; kda, dplr: n x K (dplr's gk); delta: n x 0
  Vec<S> beta;  // n (gdn, kda, delta); empty for dplr
  Mat<S> a, b;  // n x K (dplr); empty otherwise
  S scale = S(1);

  int64_t n() const { return q.rows(); }
  int64_t K() const { return q.cols(); }
  int64_t V() const { return v.cols(); }
  // Token t's log decay along every key dimension (gdn broadcasts its scalar; delta is 0).
  Vec<S> log_decay(int64_t t) const;
  // Rows [t0, t1) of every tensor (a chunk, or a rank's share of the sequence).
  HeadInputs slice(int64_t t0, int64_t t1) const;
};

// Gradients of L = sum(o * dout) + sum(ht * dht) with respect to every input of one slice.
template <class S>
struct HeadGrads {
  Mat<S> dq, dk, dv, dg, da, db;  // shaped like the inputs (dg like g; da, db dplr only)
  Vec<S> dbeta;                   // like beta
  Mat<S> dh0;                     // K x V
  // Zeroed gradients shaped like x.
  static HeadGrads zeros_like(const HeadInputs<S>& x);
  // Writes these gradients into rows [t0, t0 + n) of `into` (used to assemble chunks or ranks).
  void place_into(HeadGrads& into, int64_t t0) const;
};

template <class S>
struct HeadOutputs {
  Mat<S> o;   // n x V
  Mat<S> ht;  // K x V final state
};

}  // namespace deltacp::ref
