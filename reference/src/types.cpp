// Small helpers on the per-head slice types (types.h).
#include "deltacp/reference/types.h"

namespace deltacp::ref {

template <class S>
Vec<S> HeadInputs<S>::log_decay(int64_t t) const {
  switch (variant) {
    case Variant::delta: return Vec<S>::Zero(K());
    case Variant::gdn: return Vec<S>::Constant(K(), g(t, 0));
    case Variant::kda:
    case Variant::dplr: return g.row(t).transpose();
  }
  return Vec<S>::Zero(K());
}

template <class S>
HeadInputs<S> HeadInputs<S>::slice(int64_t t0, int64_t t1) const {
  HeadInputs out;
  out.variant = variant;
  out.scale = scale;
  const int64_t n = t1 - t0;
  auto rows = [&](const Mat<S>& m) { return m.size() ? Mat<S>(m.middleRows(t0, n)) : Mat<S>(n, m.cols()); };
  out.q = rows(q);
  out.k = rows(k);
  out.v = rows(v);
  out.g = rows(g);
  out.a = rows(a);
  out.b = rows(b);
  out.beta = beta.size() ? Vec<S>(beta.segment(t0, n)) : Vec<S>();
  return out;
}

template <class S>
HeadGrads<S> HeadGrads<S>::zeros_like(const HeadInputs<S>& x) {
  HeadGrads gr;
  gr.dq = Mat<S>::Zero(x.q.rows(), x.q.cols());
  gr.dk = Mat<S>::Zero(x.k.rows(), x.k.cols());
  gr.dv = Mat<S>::Zero(x.v.rows(), x.v.cols());
  gr.dg = Mat<S>::Zero(x.g.rows(), x.g.cols());
  gr.da = Mat<S>::Zero(x.a.rows(), x.a.cols());
  gr.db = Mat<S>::Zero(x.b.rows(), x.b.cols());
  gr.dbeta = Vec<S>::Zero(x.beta.size());
  gr.dh0 = Mat<S>::Zero(x.K(), x.V());
  return gr;
}

template <class S>
void HeadGrads<S>::place_into(HeadGrads& into, int64_t t0) const {
  auto put = [&](Mat<S>& dst, const Mat<S>& src) {
    if (src.size()) dst.middleRows(t0, src.rows()) = src;
  };
  put(into.dq, dq);
  put(into.dk, dk);
  put(into.dv, dv);
  put(into.dg, dg);
  put(into.da, da);
  put(into.db, db);
  if (dbeta.size()) into.dbeta.segment(t0, dbeta.size()) = dbeta;
}

template struct HeadInputs<double>;
template struct HeadInputs<float>;
template struct HeadGrads<double>;
template struct HeadGrads<float>;

}  // namespace deltacp::ref
