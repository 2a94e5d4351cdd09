// Telling 2: the chunked WY form (docs/design.md section 3; the formulas are in chunked.h) and its
// backward, derived line by line by reverse mode through the same formulas.
//
// One primitive carries every decayed product so that no exponential can overflow:
//   decay_gram(X, Gl, Y, Gr)_ij = sum_d X_id Y_jd e^(Gl_id - Gr_jd)   for j < i (or j <= i), else 0
// It is evaluated only on the causal triangle, where Gl_i - Gr_j <= 0 for log decays <= 0.
// Its backward is dX_id = sum_j dM_ij Y_jd E_ijd, dY_jd = sum_i dM_ij X_id E_ijd, and
// d(Gl) = X * dX, d(Gr) = -(Y * dY) (elementwise), because d/dGl of e^(Gl - Gr) is the term itself.
#include "deltacp/reference/chunked.h"

#include <cmath>

#include "deltacp/error.h"

namespace deltacp::ref {
namespace {

bool scalar_gate(Variant v) { return v == Variant::gdn || v == Variant::delta; }

template <class S>
Mat<S> decay_gram(const Mat<S>& X, const Mat<S>& Gl, const Mat<S>& Y, const Mat<S>& Gr, bool inclusive,
                  bool scalar) {
  const int64_t n = X.rows(), K = X.cols();
  Mat<S> M = Mat<S>::Zero(n, Y.rows());
  if (scalar) {
    const Mat<S> XY = X * Y.transpose();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < (inclusive ? i + 1 : i); ++j) M(i, j) = XY(i, j) * std::exp(Gl(i, 0) - Gr(j, 0));
    return M;
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < (inclusive ? i + 1 : i); ++j) {
      S acc = 0;
      for (int64_t d = 0; d < K; ++d) acc += X(i, d) * Y(j, d) * std::exp(Gl(i, d) - Gr(j, d));
      M(i, j) = acc;
    }
  return M;
}

// Gradients of decay_gram for an upstream dM that is zero outside the causal triangle.
template <class S>
struct GramGrads {
  Mat<S> dX, dY;  // d(Gl) = X * dX, d(Gr) = -(Y * dY)
};
template <class S>
GramGrads<S> decay_gram_backward(const Mat<S>& dM, const Mat<S>& X, const Mat<S>& Gl, const Mat<S>& Y,
                                 const Mat<S>& Gr, bool scalar) {
  const int64_t n = X.rows(), K = X.cols();
  GramGrads<S> gr{Mat<S>::Zero(n, K), Mat<S>::Zero(Y.rows(), K)};
  if (scalar) {
    Mat<S> dME = Mat<S>::Zero(n, Y.rows());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j <= i; ++j) dME(i, j) = dM(i, j) * std::exp(Gl(i, 0) - Gr(j, 0));
    gr.dX = dME * Y;
    gr.dY = dME.transpose() * X;
    return gr;
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      if (dM(i, j) == S(0)) continue;
      for (int64_t d = 0; d < K; ++d) {
        const S e = dM(i, j) * std::exp(Gl(i, d) - Gr(j, d));
        gr.dX(i, d) += e * Y(j, d);
        gr.dY(j, d) += e * X(i, d);
      }
    }
  return gr;
}

template <class S>
Mat<S> strict_lower(const Mat<S>& M) {
  Mat<S> L = M;
  for (int64_t i = 0; i < L.rows(); ++i)
    for (int64_t j = i; j < L.cols(); ++j) L(i, j) = 0;
  return L;
}
template <class S>
Mat<S> lower_inclusive(const Mat<S>& M) {
  Mat<S> L = M;
  for (int64_t i = 0; i < L.rows(); ++i)
    for (int64_t j = i + 1; j < L.cols(); ++j) L(i, j) = 0;
  return L;
}

// Rows scaled by e^(Gn - G_i): the "decayed to chunk end" keys (K e^(G_n - G)). With a scalar
// gate (gdn, delta) every column of G is the same, so one exponential per row suffices.
template <class S>
Mat<S> decayed_to_end(const Mat<S>& X, const Mat<S>& G, bool scalar) {
  const int64_t n = G.rows();
  if (scalar) {
    const Vec<S> f = (G(n - 1, 0) - G.col(0).array()).exp();
    return f.asDiagonal() * X;
  }
  return (X.array() * (G.row(n - 1).replicate(n, 1) - G).array().exp()).matrix();
}

// X e^G, rowwise elementwise (one exponential per row for a scalar gate).
template <class S>
Mat<S> times_exp(const Mat<S>& X, const Mat<S>& G, bool scalar) {
  if (scalar) return Vec<S>(G.col(0).array().exp()).asDiagonal() * X;
  return (X.array() * G.array().exp()).matrix();
}

// Reverse cumulative sum over rows within the chunk: d(cumsum)^T.
template <class S>
Mat<S> reverse_cumsum_rows(const Mat<S>& M) {
  Mat<S> R = M;
  for (int64_t i = R.rows() - 2; i >= 0; --i) R.row(i) += R.row(i + 1);
  return R;
}

// The log-decay gradient of one chunk (dL/dG per token and key dim) mapped back to the
// variant's g: cumulative sum -> reverse cumulative sum; gdn sums its broadcast dimension.
template <class S>
Mat<S> gate_gradient(Variant v, const Mat<S>& dG) {
  if (v == Variant::delta) return Mat<S>(dG.rows(), 0);
  Mat<S> dg = reverse_cumsum_rows(dG);
  if (v == Variant::gdn) return dg.rowwise().sum();
  return dg;
}

}  // namespace

template <class S>
Mat<S> unit_lower_inverse(const Mat<S>& A) {
  const int64_t n = A.rows();
  // (I + A) T = I with A strictly lower: row i of T is e_i - sum_{j < i} A_ij T_j.
  Mat<S> T = Mat<S>::Identity(n, n);
  for (int64_t i = 1; i < n; ++i)
    for (int64_t j = 0; j < i; ++j)
      if (A(i, j) != S(0)) T.row(i) -= A(i, j) * T.row(j);
  return T;
}

template <class S>
Mat<S> chunk_cumulative_decay(const HeadInputs<S>& c) {
  Mat<S> G = Mat<S>::Zero(c.n(), c.K());
  if (c.variant == Variant::delta) return G;
  Vec<S> run = Vec<S>::Zero(c.K());
  for (int64_t t = 0; t < c.n(); ++t) {
    run += c.log_decay(t);
    G.row(t) = run.transpose();
  }
  return G;
}

template <class S>
ChunkWY<S> chunk_wy(const HeadInputs<S>& c) {
  ChunkWY<S> wy;
  const bool sc = scalar_gate(c.variant);
  wy.G = chunk_cumulative_decay(c);
  if (c.variant == Variant::dplr) {
    const Mat<S> Gp = wy.G - c.g;  // decay before each token: G_{i-1}
    wy.A = decay_gram(c.a, Gp, c.b, wy.G, /*inclusive=*/false, sc);
    wy.Ak = decay_gram(c.a, Gp, c.k, wy.G, false, sc);
    wy.T = unit_lower_inverse<S>(-wy.A);  // (I - A_ab)^-1
    wy.W = wy.T * times_exp(c.a, Gp, sc);
    wy.U = wy.T * (wy.Ak * c.v);
    return wy;
  }
  wy.A = c.beta.asDiagonal() * decay_gram(c.k, wy.G, c.k, wy.G, false, sc);
  wy.T = unit_lower_inverse(wy.A);
  wy.W = wy.T * (c.beta.asDiagonal() * times_exp(c.k, wy.G, sc));
  wy.U = wy.T * (c.beta.asDiagonal() * c.v);
  return wy;
}

template <class S>
ChunkStep<S> chunk_state_update(const HeadInputs<S>& c, const ChunkWY<S>& wy, const Mat<S>& S0) {
  const bool sc = scalar_gate(c.variant);
  const int64_t n = c.n();
  const Vec<S> dn = wy.G.row(n - 1).transpose().array().exp();  // D_n
  ChunkStep<S> st;
  if (c.variant == Variant::dplr) {
    st.v_new = wy.U + wy.W * S0;  // Ut: the low-rank read-outs a_i^T S_{i-1}
    st.S_end = dn.asDiagonal() * S0 + decayed_to_end(c.k, wy.G, sc).transpose() * c.v +
               decayed_to_end(c.b, wy.G, sc).transpose() * st.v_new;
    return st;
  }
  st.v_new = wy.U - wy.W * S0;
  st.S_end = dn.asDiagonal() * S0 + decayed_to_end(c.k, wy.G, sc).transpose() * st.v_new;
  return st;
}

template <class S>
Mat<S> chunk_output(const HeadInputs<S>& c, const ChunkWY<S>& wy, const Mat<S>& S0, const Mat<S>& v_new) {
  const bool sc = scalar_gate(c.variant);
  const Mat<S> QG = times_exp(c.q, wy.G, sc);
  const Mat<S> Pqk = decay_gram(c.q, wy.G, c.k, wy.G, /*inclusive=*/true, sc);
  if (c.variant == Variant::dplr) {
    const Mat<S> Pqb = decay_gram(c.q, wy.G, c.b, wy.G, true, sc);
    return c.scale * (QG * S0 + Pqk * c.v + Pqb * v_new);
  }
  return c.scale * (QG * S0 + Pqk * v_new);
}

template <class S>
ChunkStep<S> chunk_step(const HeadInputs<S>& c, const ChunkWY<S>& wy, const Mat<S>& S0) {
  ChunkStep<S> st = chunk_state_update(c, wy, S0);
  st.o = chunk_output(c, wy, S0, st.v_new);
  return st;
}

std::vector<std::pair<int64_t, int64_t>> chunk_ranges(int64_t n, int chunk_size) {
  std::vector<std::pair<int64_t, int64_t>> r;
  for (int64_t t0 = 0; t0 < n; t0 += chunk_size) r.emplace_back(t0, std::min<int64_t>(n, t0 + chunk_size));
  return r;
}

// Three stages, the structure of the GPU tiled tier: (1) the WY factors of every chunk, which
// need no state and run in parallel; (2) the state scan, the only sequential part:
// v_new = U - W S, S <- D_n S + (K e^(G_n - G))^T v_new; (3) every chunk's output from its
// start state, in parallel again.
template <class S>
ChunkedForward<S> chunked_forward(const HeadInputs<S>& x, const Mat<S>& h0, int chunk_size, bool with_outputs) {
  DELTACP_CHECK(chunk_size == 16 || chunk_size == 32 || chunk_size == 64, "chunk_size",
                "expected 16, 32 or 64, got ", chunk_size);
  const auto ranges = chunk_ranges(x.n(), chunk_size);
  const int64_t nc = static_cast<int64_t>(ranges.size());
  std::vector<HeadInputs<S>> chunks(nc);
  std::vector<ChunkWY<S>> wy(nc);
#pragma omp parallel for schedule(dynamic) if (nc >= 8)
  for (int64_t c = 0; c < nc; ++c) {
    chunks[c] = x.slice(ranges[c].first, ranges[c].second);
    wy[c] = chunk_wy(chunks[c]);
  }
  ChunkedForward<S> f;
  f.v_new.resize(x.n(), x.V());
  f.states.push_back(h0.size() ? h0 : Mat<S>(Mat<S>::Zero(x.K(), x.V())));
  for (int64_t c = 0; c < nc; ++c) {
    ChunkStep<S> st = chunk_state_update(chunks[c], wy[c], f.states.back());
    f.v_new.middleRows(ranges[c].first, chunks[c].n()) = st.v_new;
    f.states.push_back(std::move(st.S_end));
  }
  if (!with_outputs) return f;
  f.o.resize(x.n(), x.V());
#pragma omp parallel for schedule(dynamic) if (nc >= 8)
  for (int64_t c = 0; c < nc; ++c)
    f.o.middleRows(ranges[c].first, chunks[c].n()) =
        chunk_output(chunks[c], wy[c], f.states[c], Mat<S>(f.v_new.middleRows(ranges[c].first, chunks[c].n())));
  return f;
}

template <class S>
HeadGrads<S> chunk_backward(const HeadInputs<S>& c, const Mat<S>& S0, const Mat<S>& dO, const Mat<S>& dS1) {
  const bool sc = scalar_gate(c.variant);
  const int64_t n = c.n();
  const S scale = c.scale;
  // ---- recompute the forward pieces ----
  const ChunkWY<S> wy = chunk_wy(c);
  const Mat<S>& G = wy.G;
  const Vec<S> dn = G.row(n - 1).transpose().array().exp();
  const Mat<S> QG = times_exp(c.q, G, sc);
  const Mat<S> Pqk = decay_gram(c.q, G, c.k, G, true, sc);
  const Mat<S> Kr = decayed_to_end(c.k, G, sc);

  HeadGrads<S> gr = HeadGrads<S>::zeros_like(c);
  Mat<S> dG = Mat<S>::Zero(n, c.K());  // dL/dG (cumulative log decay), per token and key dim
  Vec<S> dGn = Vec<S>::Zero(c.K());     // dL/dG_n through D_n and the decayed-to-end factors

  // Shared terms: O = scale (QG S0 + ...), S_end = D_n S0 + ...
  const Mat<S> dQG = scale * dO * S0.transpose();
  gr.dq += (dQG.array() * G.array().exp()).matrix();
  dG += (dQG.array() * QG.array()).matrix();
  gr.dh0 = scale * QG.transpose() * dO + dn.asDiagonal() * dS1;
  dGn += (dn.array() * (dS1.array() * S0.array()).rowwise().sum()).matrix();

  // Backward of a decayed gram M = decay_gram(X, Gl, Y, Gr) into dX, dY, dGl, dGr.
  auto gram_back = [&](const Mat<S>& dM, const Mat<S>& X, const Mat<S>& Gl, const Mat<S>& Y, const Mat<S>& Gr,
                       Mat<S>& dX, Mat<S>& dY, Mat<S>& dGl, Mat<S>& dGr) {
    const GramGrads<S> g2 = decay_gram_backward(dM, X, Gl, Y, Gr, sc);
    dX += g2.dX;
    dY += g2.dY;
    dGl += (X.array() * g2.dX.array()).matrix();
    dGr -= (Y.array() * g2.dY.array()).matrix();
  };
  // Backward of the decayed-to-end rows R = X e^(G_n - G): into dX, dG, dG_n.
  auto end_back = [&](const Mat<S>& dR, const Mat<S>& R, Mat<S>& dX) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < c.K(); ++d) dX(i, d) += dR(i, d) * std::exp(G(n - 1, d) - G(i, d));
    const Mat<S> dRR = (dR.array() * R.array()).matrix();
    dG -= dRR;
    dGn += dRR.colwise().sum().transpose();
  };

  if (c.variant == Variant::dplr) {
    const Mat<S> Gp = G - c.g;
    const Mat<S> Pqb = decay_gram(c.q, G, c.b, G, true, sc);
    const Mat<S> Br = decayed_to_end(c.b, G, sc);
    const Mat<S> Ag = times_exp(c.a, Gp, sc);
    const Mat<S> Ut = wy.U + wy.W * S0;
    Mat<S> dGp = Mat<S>::Zero(n, c.K());
    // O = scale (QG S0 + Pqk V + Pqb Ut);  S_end = D_n S0 + Kr^T V + Br^T Ut
    const Mat<S> dUt = scale * Pqb.transpose() * dO + Br * dS1;
    gr.dv += scale * Pqk.transpose() * dO + Kr * dS1;
    gram_back(lower_inclusive<S>(scale * dO * c.v.transpose()), c.q, G, c.k, G, gr.dq, gr.dk, dG, dG);
    gram_back(lower_inclusive<S>(scale * dO * Ut.transpose()), c.q, G, c.b, G, gr.dq, gr.db, dG, dG);
    end_back(c.v * dS1.transpose(), Kr, gr.dk);
    end_back(Ut * dS1.transpose(), Br, gr.db);
    // Ut = U + W S0
    gr.dh0 += wy.W.transpose() * dUt;
    const Mat<S> dW = dUt * S0.transpose();
    const Mat<S>& dU = dUt;
    // W = T Ag,  U = T (Ak V)
    const Mat<S> AkV = wy.Ak * c.v;
    const Mat<S> dT = dW * Ag.transpose() + dU * AkV.transpose();
    const Mat<S> dAg = wy.T.transpose() * dW;
    gr.da += (dAg.array() * Gp.array().exp()).matrix();
    dGp += (dAg.array() * Ag.array()).matrix();
    const Mat<S> dAkV = wy.T.transpose() * dU;
    gr.dv += wy.Ak.transpose() * dAkV;
    const Mat<S> dAk = strict_lower<S>(dAkV * c.v.transpose());
    // T = (I - A)^-1  =>  dA = +T^T dT T^T on the strict lower triangle
    const Mat<S> dA = strict_lower<S>(wy.T.transpose() * dT * wy.T.transpose());
    gram_back(dA, c.a, Gp, c.b, G, gr.da, gr.db, dGp, dG);
    gram_back(dAk, c.a, Gp, c.k, G, gr.da, gr.dk, dGp, dG);
    // Gp = G - gk
    dG += dGp;
    dG.row(n - 1) += dGn.transpose();
    gr.dg = gate_gradient(c.variant, dG) - dGp;
    return gr;
  }

  // ---- gdn / kda / delta ----
  const Mat<S> Vn = wy.U - wy.W * S0;
  // O = scale (QG S0 + P Vn);  S_end = D_n S0 + Kr^T Vn
  const Mat<S> dVn = scale * Pqk.transpose() * dO + Kr * dS1;
  gram_back(lower_inclusive<S>(scale * dO * Vn.transpose()), c.q, G, c.k, G, gr.dq, gr.dk, dG, dG);
  end_back(Vn * dS1.transpose(), Kr, gr.dk);
  // Vn = U - W S0
  gr.dh0 -= wy.W.transpose() * dVn;
  const Mat<S> dW = -dVn * S0.transpose();
  const Mat<S>& dU = dVn;
  // W = T (Beta X), U = T (Beta V), X = K e^G
  const Mat<S> X = times_exp(c.k, G, sc);
  const Mat<S> BX = c.beta.asDiagonal() * X, BV = c.beta.asDiagonal() * c.v;
  const Mat<S> dT = dW * BX.transpose() + dU * BV.transpose();
  const Mat<S> dBX = wy.T.transpose() * dW, dBV = wy.T.transpose() * dU;
  gr.dbeta += (dBX.array() * X.array()).rowwise().sum().matrix() + (dBV.array() * c.v.array()).rowwise().sum().matrix();
  const Mat<S> dX = c.beta.asDiagonal() * dBX;
  gr.dk += (dX.array() * G.array().exp()).matrix();
  dG += (dX.array() * X.array()).matrix();
  gr.dv += c.beta.asDiagonal() * dBV;
  // T = (I + A)^-1  =>  dA = -T^T dT T^T on the strict lower triangle;  A = Beta Araw
  const Mat<S> dA = strict_lower<S>(-(wy.T.transpose() * dT * wy.T.transpose()));
  const Mat<S> Araw = decay_gram(c.k, G, c.k, G, false, sc);
  gr.dbeta += (dA.array() * Araw.array()).rowwise().sum().matrix();
  gram_back(c.beta.asDiagonal() * dA, c.k, G, c.k, G, gr.dk, gr.dk, dG, dG);
  dG.row(n - 1) += dGn.transpose();
  gr.dg = gate_gradient(c.variant, dG);
  return gr;
}

template <class S>
HeadGrads<S> chunked_backward(const HeadInputs<S>& x, const Mat<S>& h0, const Mat<S>& dout, const Mat<S>& dht,
                              int chunk_size) {
  const ChunkedForward<S> f = chunked_forward(x, h0, chunk_size, /*with_outputs=*/false);  // chunk-start states
  const auto ranges = chunk_ranges(x.n(), chunk_size);
  HeadGrads<S> gr = HeadGrads<S>::zeros_like(x);
  Mat<S> dS = dht.size() ? dht : Mat<S>(Mat<S>::Zero(x.K(), x.V()));
  for (int64_t ci = static_cast<int64_t>(ranges.size()) - 1; ci >= 0; --ci) {
    const auto [t0, t1] = ranges[ci];
    const HeadGrads<S> gc = chunk_backward(x.slice(t0, t1), f.states[ci], Mat<S>(dout.middleRows(t0, t1 - t0)), dS);
    gc.place_into(gr, t0);
    dS = gc.dh0;
  }
  gr.dh0 = dS;
  return gr;
}

#define DELTACP_INSTANTIATE(S)                                                                              \
  template Mat<S> unit_lower_inverse<S>(const Mat<S>&);                                                     \
  template Mat<S> chunk_cumulative_decay<S>(const HeadInputs<S>&);                                          \
  template ChunkWY<S> chunk_wy<S>(const HeadInputs<S>&);                                                    \
  template ChunkStep<S> chunk_step<S>(const HeadInputs<S>&, const ChunkWY<S>&, const Mat<S>&);              \
  template ChunkStep<S> chunk_state_update<S>(const HeadInputs<S>&, const ChunkWY<S>&, const Mat<S>&);      \
  template Mat<S> chunk_output<S>(const HeadInputs<S>&, const ChunkWY<S>&, const Mat<S>&, const Mat<S>&);   \
  template ChunkedForward<S> chunked_forward<S>(const HeadInputs<S>&, const Mat<S>&, int, bool);            \
  template HeadGrads<S> chunk_backward<S>(const HeadInputs<S>&, const Mat<S>&, const Mat<S>&, const Mat<S>&); \
  template HeadGrads<S> chunked_backward<S>(const HeadInputs<S>&, const Mat<S>&, const Mat<S>&, const Mat<S>&, int);
DELTACP_INSTANTIATE(double)
DELTACP_INSTANTIATE(float)
#undef DELTACP_INSTANTIATE

}  // namespace deltacp::ref
