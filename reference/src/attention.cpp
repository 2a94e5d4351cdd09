// Softmax attention reference: plain, blockwise, the online-softmax merge and their backwards
// (see deltacp/reference/attention.h for the formulas).
#include "deltacp/reference/attention.h"

#include <cmath>
#include <limits>

#include "deltacp/error.h"

namespace deltacp::ref {

namespace {

Positions iota_positions(int64_t n) {
  Positions p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[static_cast<size_t>(i)] = i;
  return p;
}

template <class S>
void check_qkv(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, const Positions& qpos, const Positions& kpos) {
  DELTACP_CHECK(k.cols() == q.cols(), "k", "expected as many columns as q (head dim ", q.cols(), "), got ", k.cols());
  DELTACP_CHECK(v.rows() == k.rows(), "v", "expected as many rows as k (", k.rows(), " keys), got ", v.rows());
  DELTACP_CHECK(qpos.empty() || static_cast<int64_t>(qpos.size()) == q.rows(), "qpos",
                "expected one position per query (", q.rows(), "), got ", qpos.size());
  DELTACP_CHECK(kpos.empty() || static_cast<int64_t>(kpos.size()) == k.rows(), "kpos",
                "expected one position per key (", k.rows(), "), got ", kpos.size());
}

// Scaled, masked scores: n x m, -inf where masked.
template <class S>
Mat<S> scores(const Mat<S>& q, const Mat<S>& k, S scale, bool causal, const Positions& qpos, const Positions& kpos) {
  Mat<S> s = (q * k.transpose()) * scale;
  if (causal) {
    const Positions qp = qpos.empty() ? iota_positions(q.rows()) : qpos;
    const Positions kp = kpos.empty() ? iota_positions(k.rows()) : kpos;
    for (int64_t i = 0; i < s.rows(); ++i)
      for (int64_t j = 0; j < s.cols(); ++j)
        if (kp[static_cast<size_t>(j)] > qp[static_cast<size_t>(i)]) s(i, j) = -std::numeric_limits<S>::infinity();
  }
  return s;
}

// Row-wise log-sum-exp with the row max subtracted first (exact for any magnitudes).
template <class S>
Vec<S> row_lse(const Mat<S>& s) {
  Vec<S> lse(s.rows());
  for (int64_t i = 0; i < s.rows(); ++i) {
    const S m = s.row(i).size() ? s.row(i).maxCoeff() : -std::numeric_limits<S>::infinity();
    if (!std::isfinite(m)) {
      lse(i) = -std::numeric_limits<S>::infinity();
      continue;
    }
    lse(i) = m + std::log((s.row(i).array() - m).exp().sum());
  }
  return lse;
}

// P = e^{S - lse} (0 on rows with lse = -inf and on masked entries).
template <class S>
Mat<S> probabilities(const Mat<S>& s, const Vec<S>& lse) {
  Mat<S> p = Mat<S>::Zero(s.rows(), s.cols());
  for (int64_t i = 0; i < s.rows(); ++i)
    if (std::isfinite(lse(i))) p.row(i) = (s.row(i).array() - lse(i)).exp().matrix();
  return p;
}

}  // namespace

template <class S>
AttnPartial<S> attention_forward(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, S scale, bool causal,
                                 const Positions& qpos, const Positions& kpos) {
  check_qkv(q, k, v, qpos, kpos);
  const Mat<S> s = scores(q, k, scale, causal, qpos, kpos);
  AttnPartial<S> out;
  out.lse = row_lse(s);
  out.o = probabilities(s, out.lse) * v;
  return out;
}

template <class S>
AttnGrads<S> attention_backward(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, const Mat<S>& dout, S scale,
                                bool causal, const Positions& qpos, const Positions& kpos) {
  check_qkv(q, k, v, qpos, kpos);
  DELTACP_CHECK(dout.rows() == q.rows() && dout.cols() == v.cols(), "dout", "expected ", q.rows(), " x ", v.cols(),
                ", got ", dout.rows(), " x ", dout.cols());
  const Mat<S> s = scores(q, k, scale, causal, qpos, kpos);
  const Mat<S> p = probabilities(s, row_lse(s));
  const Mat<S> dp = dout * v.transpose();
  const Vec<S> rowsum = p.cwiseProduct(dp).rowwise().sum();
  const Mat<S> ds = p.cwiseProduct(dp - rowsum.replicate(1, dp.cols()));
  AttnGrads<S> g;
  g.dv = p.transpose() * dout;
  g.dq = (ds * k) * scale;
  g.dk = (ds.transpose() * q) * scale;
  return g;
}

template <class S>
AttnPartial<S> attention_block_forward(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, S scale, bool causal,
                                       const Positions& qpos, const Positions& kpos) {
  return attention_forward(q, k, v, scale, causal, qpos, kpos);
}

template <class S>
AttnGrads<S> attention_block_backward(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, const Mat<S>& o,
                                      const Vec<S>& lse, const Mat<S>& dout, const Vec<S>& dlse, S scale, bool causal,
                                      const Positions& qpos, const Positions& kpos) {
  check_qkv(q, k, v, qpos, kpos);
  DELTACP_CHECK(o.rows() == q.rows() && o.cols() == v.cols(), "o", "expected ", q.rows(), " x ", v.cols(), ", got ",
                o.rows(), " x ", o.cols());
  DELTACP_CHECK(dout.rows() == q.rows() && dout.cols() == v.cols(), "dout", "expected ", q.rows(), " x ", v.cols(),
                ", got ", dout.rows(), " x ", dout.cols());
  DELTACP_CHECK(lse.size() == q.rows(), "lse", "expected one value per query (", q.rows(), "), got ", lse.size());
  DELTACP_CHECK(dlse.size() == 0 || dlse.size() == q.rows(), "dlse", "expected empty or one value per query (",
                q.rows(), "), got ", dlse.size());
  const Mat<S> s = scores(q, k, scale, causal, qpos, kpos);
  const Mat<S> p = probabilities(s, lse);
  const Mat<S> dp = dout * v.transpose();
  Vec<S> shift = -dout.cwiseProduct(o).rowwise().sum();  // -rowdot(dO, O) + dlse
  if (dlse.size()) shift += dlse;
  const Mat<S> ds = p.cwiseProduct(dp + shift.replicate(1, dp.cols()));
  AttnGrads<S> g;
  g.dv = p.transpose() * dout;
  g.dq = (ds * k) * scale;
  g.dk = (ds.transpose() * q) * scale;
  return g;
}

namespace {
// w_a, w_b and L of a merge, row by row (0, 0, -inf where neither part saw a key).
template <class S>
void merge_weights(const Vec<S>& la, const Vec<S>& lb, Vec<S>& wa, Vec<S>& wb, Vec<S>& L) {
  const int64_t n = la.size();
  wa.resize(n);
  wb.resize(n);
  L.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const S m = std::max(la(i), lb(i));
    if (!std::isfinite(m)) {
      wa(i) = wb(i) = S(0);
      L(i) = -std::numeric_limits<S>::infinity();
      continue;
    }
    L(i) = m + std::log(std::exp(la(i) - m) + std::exp(lb(i) - m));
    wa(i) = std::exp(la(i) - L(i));
    wb(i) = std::exp(lb(i) - L(i));
  }
}

template <class S>
void check_pair(const AttnPartial<S>& a, const AttnPartial<S>& b) {
  DELTACP_CHECK(a.lse.size() == a.o.rows(), "a", "expected one lse per row of o (", a.o.rows(), "), got ",
                a.lse.size());
  DELTACP_CHECK(b.o.rows() == a.o.rows() && b.o.cols() == a.o.cols(), "b", "expected o of ", a.o.rows(), " x ",
                a.o.cols(), " as in a, got ", b.o.rows(), " x ", b.o.cols());
  DELTACP_CHECK(b.lse.size() == b.o.rows(), "b", "expected one lse per row of o (", b.o.rows(), "), got ",
                b.lse.size());
}
}  // namespace

template <class S>
AttnPartial<S> attention_merge(const AttnPartial<S>& a, const AttnPartial<S>& b) {
  check_pair(a, b);
  Vec<S> wa, wb;
  AttnPartial<S> out;
  merge_weights(a.lse, b.lse, wa, wb, out.lse);
  out.o = wa.asDiagonal() * a.o + wb.asDiagonal() * b.o;
  return out;
}

template <class S>
AttnMergeGrads<S> attention_merge_backward(const AttnPartial<S>& a, const AttnPartial<S>& b,
                                           const AttnPartial<S>& merged, const Mat<S>& dout, const Vec<S>& dlse) {
  check_pair(a, b);
  DELTACP_CHECK(dout.rows() == a.o.rows() && dout.cols() == a.o.cols(), "dout", "expected ", a.o.rows(), " x ",
                a.o.cols(), ", got ", dout.rows(), " x ", dout.cols());
  DELTACP_CHECK(dlse.size() == 0 || dlse.size() == a.o.rows(), "dlse", "expected empty or one value per row (",
                a.o.rows(), "), got ", dlse.size());
  Vec<S> wa, wb, L;
  merge_weights(a.lse, b.lse, wa, wb, L);
  const Vec<S> dot = dout.cwiseProduct(merged.o).rowwise().sum();
  Vec<S> base = -dot;
  if (dlse.size()) base += dlse;
  AttnMergeGrads<S> g;
  g.do_a = wa.asDiagonal() * dout;
  g.do_b = wb.asDiagonal() * dout;
  g.dlse_a = wa.cwiseProduct(dout.cwiseProduct(a.o).rowwise().sum() + base);
  g.dlse_b = wb.cwiseProduct(dout.cwiseProduct(b.o).rowwise().sum() + base);
  return g;
}

#define DELTACP_INSTANTIATE(S)                                                                                        \
  template AttnPartial<S> attention_forward(const Mat<S>&, const Mat<S>&, const Mat<S>&, S, bool, const Positions&,  \
                                            const Positions&);                                                       \
  template AttnGrads<S> attention_backward(const Mat<S>&, const Mat<S>&, const Mat<S>&, const Mat<S>&, S, bool,     \
                                           const Positions&, const Positions&);                                      \
  template AttnPartial<S> attention_block_forward(const Mat<S>&, const Mat<S>&, const Mat<S>&, S, bool,              \
                                                  const Positions&, const Positions&);                               \
  template AttnGrads<S> attention_block_backward(const Mat<S>&, const Mat<S>&, const Mat<S>&, const Mat<S>&,         \
                                                 const Vec<S>&, const Mat<S>&, const Vec<S>&, S, bool,               \
                                                 const Positions&, const Positions&);                                \
  template AttnPartial<S> attention_merge(const AttnPartial<S>&, const AttnPartial<S>&);                              \
  template AttnMergeGrads<S> attention_merge_backward(const AttnPartial<S>&, const AttnPartial<S>&,                   \
                                                      const AttnPartial<S>&, const Mat<S>&, const Vec<S>&);
DELTACP_INSTANTIATE(double)
DELTACP_INSTANTIATE(float)
#undef DELTACP_INSTANTIATE

}  // namespace deltacp::ref
