// Telling 1: the token recurrence (docs/design.md section 2) and its exact reverse-mode backward.
//
// Forward, gdn / kda / delta, one token:          Forward, dplr, one token:
//   Sd  = D_t S_{t-1}                               S_t = D_t S_{t-1} + k_t v_t^T + b_t (a_t^T S_{t-1})
//   u_t = beta_t (v_t - Sd^T k_t)                   o_t = S_t^T (scale q_t)
//   S_t = Sd + k_t u_t^T
//   o_t = S_t^T (scale q_t)
// D_t = diag(e^{g_t}) (gdn: the scalar broadcast; delta: I).
//
// Backward: with dS = dL/dS_t (starting from dht), each token in reverse:
//   dS += scale q_t do_t^T,  dq_t = scale S_t do_t
//   gdn/kda/delta:  dk = dS u,  du = dS^T k,  dbeta = du . (v - Sd^T k),  dv = beta du,
//                   dpred = -beta du (pred = Sd^T k),  dSd = dS + k dpred^T,  dk += Sd dpred,
//                   dlogD_i = sum_v dSd_iv Sd_iv,  dS_{t-1} = D dSd
//   dplr:           dk = dS v,  dv = dS^T k,  db = dS (S_{t-1}^T a),  da = S_{t-1} (dS^T b),
//                   dgk_i = sum_v dS_iv (D S_{t-1})_iv,  dS_{t-1} = D dS + a (b^T dS)
// The states S_0..S_T are kept (clarity over memory).
#include "deltacp/reference/recurrence.h"

#include <cmath>

namespace deltacp::ref {
namespace {

template <class S>
Mat<S> initial(const Mat<S>& h0, int64_t K, int64_t V) {
  return h0.size() ? h0 : Mat<S>(Mat<S>::Zero(K, V));
}

// One token forward: returns S_t from S_{t-1}.
template <class S>
Mat<S> token_step(const HeadInputs<S>& x, int64_t t, const Mat<S>& Sprev) {
  const Vec<S> d = x.log_decay(t).array().exp();
  const Vec<S> kt = x.k.row(t).transpose();
  const Vec<S> vt = x.v.row(t).transpose();
  if (x.variant == Variant::dplr) {
    const Vec<S> at = x.a.row(t).transpose(), bt = x.b.row(t).transpose();
    const Vec<S> readout = Sprev.transpose() * at;  // a^T S_{t-1}, as a V-vector
    return d.asDiagonal() * Sprev + kt * vt.transpose() + bt * readout.transpose();
  }
  const Mat<S> Sd = d.asDiagonal() * Sprev;
  const Vec<S> u = x.beta(t) * (vt - Sd.transpose() * kt);
  return Sd + kt * u.transpose();
}

}  // namespace

template <class S>
HeadOutputs<S> recurrent_forward(const HeadInputs<S>& x, const Mat<S>& h0, bool with_outputs) {
  const int64_t n = x.n(), K = x.K(), V = x.V();
  HeadOutputs<S> out;
  if (with_outputs) out.o.resize(n, V);
  Mat<S> St = initial(h0, K, V);
  for (int64_t t = 0; t < n; ++t) {
    St = token_step(x, t, St);
    if (with_outputs) out.o.row(t) = (St.transpose() * (x.scale * x.q.row(t).transpose())).transpose();
  }
  out.ht = St;
  return out;
}

template <class S>
HeadGrads<S> recurrent_backward(const HeadInputs<S>& x, const Mat<S>& h0, const Mat<S>& dout, const Mat<S>& dht) {
  const int64_t n = x.n(), K = x.K(), V = x.V();
  // Forward, keeping every state: states[t] = S_t (states[0] = h0).
  std::vector<Mat<S>> states(n + 1);
  states[0] = initial(h0, K, V);
  for (int64_t t = 0; t < n; ++t) states[t + 1] = token_step(x, t, states[t]);

  HeadGrads<S> gr = HeadGrads<S>::zeros_like(x);
  Mat<S> dS = dht.size() ? dht : Mat<S>(Mat<S>::Zero(K, V));
  for (int64_t t = n - 1; t >= 0; --t) {
    const Mat<S>& Sprev = states[t];
    const Mat<S>& St = states[t + 1];
    const Vec<S> qt = x.q.row(t).transpose(), kt = x.k.row(t).transpose(), vt = x.v.row(t).transpose();
    const Vec<S> dot = dout.row(t).transpose();
    const Vec<S> d = x.log_decay(t).array().exp();

    // o_t = S_t^T (scale q_t)
    dS += x.scale * qt * dot.transpose();
    gr.dq.row(t) = (x.scale * St * dot).transpose();

    Vec<S> dlogd;  // dL/d(log decay) along each key dimension
    if (x.variant == Variant::dplr) {
      const Vec<S> at = x.a.row(t).transpose(), bt = x.b.row(t).transpose();
      gr.dk.row(t) = (dS * vt).transpose();
      gr.dv.row(t) = (dS.transpose() * kt).transpose();
      gr.db.row(t) = (dS * (Sprev.transpose() * at)).transpose();
      const Vec<S> dSb = dS.transpose() * bt;  // V
      gr.da.row(t) = (Sprev * dSb).transpose();
      dlogd = (dS.array() * (d.asDiagonal() * Sprev).array()).rowwise().sum();
      dS = d.asDiagonal() * dS + at * dSb.transpose();
    } else {
      const Mat<S> Sd = d.asDiagonal() * Sprev;
      const Vec<S> resid = vt - Sd.transpose() * kt;  // v - Sd^T k
      const Vec<S> u = x.beta(t) * resid;
      // S_t = Sd + k u^T
      const Vec<S> du = dS.transpose() * kt;
      Vec<S> dk = dS * u;
      // u = beta (v - Sd^T k)
      gr.dbeta(t) = du.dot(resid);
      gr.dv.row(t) = (x.beta(t) * du).transpose();
      const Vec<S> dpred = -x.beta(t) * du;  // gradient of pred = Sd^T k
      Mat<S> dSd = dS + kt * dpred.transpose();
      dk += Sd * dpred;
      gr.dk.row(t) = dk.transpose();
      // Sd = D S_{t-1}
      dlogd = (dSd.array() * Sd.array()).rowwise().sum();
      dS = d.asDiagonal() * dSd;
    }
    if (x.variant == Variant::gdn) gr.dg(t, 0) = dlogd.sum();
    if (x.variant == Variant::kda || x.variant == Variant::dplr) gr.dg.row(t) = dlogd.transpose();
  }
  gr.dh0 = dS;
  return gr;
}

#define DELTACP_INSTANTIATE(S)                                                              \
  template HeadOutputs<S> recurrent_forward<S>(const HeadInputs<S>&, const Mat<S>&, bool);  \
  template HeadGrads<S> recurrent_backward<S>(const HeadInputs<S>&, const Mat<S>&, const Mat<S>&, \
                                              const Mat<S>&);
DELTACP_INSTANTIATE(double)
DELTACP_INSTANTIATE(float)
#undef DELTACP_INSTANTIATE

}  // namespace deltacp::ref
