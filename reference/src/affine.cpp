// Telling 3: spans of tokens as affine maps of the state, S_end = M S_start + H (affine.h).
#include "deltacp/reference/affine.h"

#include <cmath>

namespace deltacp::ref {

template <class S>
Affine<S> Affine<S>::identity(int64_t K, int64_t V) {
  return Affine{Mat<S>::Identity(K, K), Mat<S>::Zero(K, V)};
}

template <class S>
Affine<S> compose(const Affine<S>& later, const Affine<S>& earlier) {
  return Affine<S>{later.M * earlier.M, later.M * earlier.H + later.H};
}

template <class S>
Affine<S> chunk_affine(const HeadInputs<S>& c, const ChunkWY<S>& wy) {
  const int64_t n = c.n(), K = c.K();
  // Rows decayed to the chunk end: X e^(G_n - G).
  auto to_end = [&](const Mat<S>& X) {
    Mat<S> R(n, K);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < K; ++d) R(i, d) = X(i, d) * std::exp(wy.G(n - 1, d) - wy.G(i, d));
    return R;
  };
  const Vec<S> dn = wy.G.row(n - 1).transpose().array().exp();
  const Mat<S> Kr = to_end(c.k);
  Affine<S> f;
  if (c.variant == Variant::dplr) {
    const Mat<S> Br = to_end(c.b);
    f.M = Mat<S>(dn.asDiagonal()) + Br.transpose() * wy.W;  // the plus sign of DPLR
    f.H = Kr.transpose() * c.v + Br.transpose() * wy.U;
  } else {
    f.M = Mat<S>(dn.asDiagonal()) - Kr.transpose() * wy.W;  // the minus sign of the delta rule
    f.H = Kr.transpose() * wy.U;
  }
  return f;
}

template <class S>
Affine<S> span_affine(const HeadInputs<S>& x, int64_t t0, int64_t t1, int chunk_size) {
  Affine<S> f = Affine<S>::identity(x.K(), x.V());
  for (auto [c0, c1] : chunk_ranges(t1 - t0, chunk_size)) {
    const HeadInputs<S> c = x.slice(t0 + c0, t0 + c1);
    f = compose(chunk_affine(c, chunk_wy(c)), f);
  }
  return f;
}

template <class S>
Affine<S> span_affine_tokens(const HeadInputs<S>& x, int64_t t0, int64_t t1) {
  const int64_t K = x.K();
  Affine<S> f = Affine<S>::identity(K, x.V());
  for (int64_t t = t0; t < t1; ++t) {
    const Vec<S> d = x.log_decay(t).array().exp();
    const Vec<S> kt = x.k.row(t).transpose(), vt = x.v.row(t).transpose();
    Affine<S> tok;
    if (x.variant == Variant::dplr) {  // P_t = D_t + b_t a_t^T,  bias k_t v_t^T
      tok.M = Mat<S>(d.asDiagonal()) + x.b.row(t).transpose() * x.a.row(t);
      tok.H = kt * vt.transpose();
    } else {  // P_t = (I - beta_t k_t k_t^T) D_t,  bias beta_t k_t v_t^T
      tok.M = (Mat<S>::Identity(K, K) - x.beta(t) * kt * kt.transpose()) * d.asDiagonal();
      tok.H = x.beta(t) * kt * vt.transpose();
    }
    f = compose(tok, f);
  }
  return f;
}

template <class S>
HeadOutputs<S> affine_forward(const HeadInputs<S>& x, const Mat<S>& h0, int chunk_size, bool with_outputs) {
  HeadOutputs<S> out;
  if (with_outputs) out.o.resize(x.n(), x.V());
  Mat<S> St = h0.size() ? h0 : Mat<S>(Mat<S>::Zero(x.K(), x.V()));
  for (auto [t0, t1] : chunk_ranges(x.n(), chunk_size)) {
    const HeadInputs<S> c = x.slice(t0, t1);
    const ChunkWY<S> wy = chunk_wy(c);
    if (with_outputs) out.o.middleRows(t0, t1 - t0) = chunk_step(c, wy, St).o;  // outputs from the chunk formula
    St = chunk_affine(c, wy).apply(St);                       // state from the affine map
  }
  out.ht = St;
  return out;
}

template <class S>
AffineBackward<S> span_affine_backward(const HeadInputs<S>& x, int64_t t0, int64_t t1, const Mat<S>& dout,
                                       int chunk_size) {
  AffineBackward<S> b;
  b.Mt = span_affine(x, t0, t1, chunk_size).M.transpose();
  // dH: what the span's own outputs send to S_start. o is affine in S_start, so this does not
  // depend on S_start: run the chunked backward from a zero state with no upstream dS_end.
  const HeadInputs<S> span = x.slice(t0, t1);
  b.dH = chunked_backward(span, Mat<S>(), dout, Mat<S>(), chunk_size).dh0;
  return b;
}

#define DELTACP_INSTANTIATE(S)                                                                         \
  template struct Affine<S>;                                                                           \
  template Affine<S> compose<S>(const Affine<S>&, const Affine<S>&);                                   \
  template Affine<S> chunk_affine<S>(const HeadInputs<S>&, const ChunkWY<S>&);                         \
  template Affine<S> span_affine<S>(const HeadInputs<S>&, int64_t, int64_t, int);                      \
  template Affine<S> span_affine_tokens<S>(const HeadInputs<S>&, int64_t, int64_t);                    \
  template HeadOutputs<S> affine_forward<S>(const HeadInputs<S>&, const Mat<S>&, int, bool);           \
  template AffineBackward<S> span_affine_backward<S>(const HeadInputs<S>&, int64_t, int64_t, const Mat<S>&, int);
DELTACP_INSTANTIATE(double)
DELTACP_INSTANTIATE(float)
#undef DELTACP_INSTANTIATE

}  // namespace deltacp::ref
