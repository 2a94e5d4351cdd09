// tests/cpp/problem.h — random problems and error measures shared by the reference tests.
//
// A Problem owns host buffers for every tensor of one variant and hands out a Params view of
// them, in double or float, for a packed varlen batch (B = 1, cu_seqlens) or a fixed batch.
#pragma once

#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <vector>

#include "deltacp/params.h"

namespace deltacp {
inline void PrintTo(Variant v, std::ostream* os) { *os << to_string(v); }
}  // namespace deltacp

namespace deltacp::test {

struct Shape {
  int64_t B = 1, T = 100, H = 2, HV = 2, K = 32, V = 24;
  std::vector<int64_t> cu;  // empty: fixed-length batch
  bool h0 = true;
};

inline double rel_err(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

// Inputs held in double; converted to the run's scalar type on demand.
struct Problem {
  Variant variant;
  Shape s;
  int64_t N = 0;
  std::vector<double> q, k, v, g, beta, a, b, h0, dout, dht;

  int64_t gate_dim() const { return variant == Variant::gdn ? 1 : (variant == Variant::delta ? 0 : s.K); }
  int64_t rows() const { return s.B * s.T; }

  Problem(Variant var, Shape shape, uint64_t seed) : variant(var), s(std::move(shape)) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal;
    std::uniform_real_distribution<double> unif(0.0, 1.0);
    N = s.cu.empty() ? s.B : static_cast<int64_t>(s.cu.size()) - 1;
    auto randn = [&](int64_t n, double sc) {
      std::vector<double> x(n);
      for (auto& e : x) e = sc * normal(rng);
      return x;
    };
    q = randn(rows() * s.H * s.K, 1);
    k = randn(rows() * s.H * s.K, 1);
    for (int64_t r = 0; r < rows() * s.H; ++r) {  // L2-normalised keys, as the models use
      double n2 = 0;
      for (int64_t d = 0; d < s.K; ++d) n2 += k[r * s.K + d] * k[r * s.K + d];
      for (int64_t d = 0; d < s.K; ++d) k[r * s.K + d] /= std::sqrt(n2);
    }
    v = randn(rows() * s.HV * s.V, 1);
    g.resize(rows() * s.HV * gate_dim());
    for (auto& e : g) e = -0.5 * std::log1p(std::exp(-normal(rng)));  // logsigmoid(x) / 2 in (-inf, 0)
    if (variant != Variant::dplr) {
      beta.resize(rows() * s.HV);
      for (auto& e : beta) e = 0.05 + 0.9 * unif(rng);
    } else {
      a = randn(rows() * s.HV * s.K, 0.5 / std::sqrt(double(s.K)));
      b = randn(rows() * s.HV * s.K, 0.5 / std::sqrt(double(s.K)));
    }
    if (s.h0) h0 = randn(N * s.HV * s.K * s.V, 0.3);
    dout = randn(rows() * s.HV * s.V, 1);
    dht = randn(N * s.HV * s.K * s.V, 1);
  }

  std::vector<double>* input(const char* name) {
    std::string n = name;
    if (n == "q") return &q;
    if (n == "k") return &k;
    if (n == "v") return &v;
    if (n == "g") return &g;
    if (n == "beta") return &beta;
    if (n == "a") return &a;
    if (n == "b") return &b;
    if (n == "h0") return &h0;
    return nullptr;
  }
};

// Buffers of scalar type S (inputs converted, outputs allocated) and the Params over them.
template <class S>
struct Buffers {
  std::vector<S> q, k, v, g, beta, a, b, h0, dout, dht;
  std::vector<S> o, ht, dq, dk, dv, dg, dbeta, da, db, dh0;
  Params p;

  explicit Buffers(const Problem& pr, int chunk = 64) {
    auto cv = [](const std::vector<double>& x) { return std::vector<S>(x.begin(), x.end()); };
    q = cv(pr.q); k = cv(pr.k); v = cv(pr.v); g = cv(pr.g); beta = cv(pr.beta);
    a = cv(pr.a); b = cv(pr.b); h0 = cv(pr.h0); dout = cv(pr.dout); dht = cv(pr.dht);
    const Shape& s = pr.s;
    const DType dt = sizeof(S) == 8 ? DType::f64 : DType::f32;
    const int64_t st = pr.N * s.HV * s.K * s.V;
    o.assign(pr.rows() * s.HV * s.V, S(NAN));
    ht.assign(st, S(NAN));
    dq.assign(q.size(), S(NAN)); dk.assign(k.size(), S(NAN)); dv.assign(v.size(), S(NAN));
    dg.assign(g.size(), S(NAN)); dbeta.assign(beta.size(), S(NAN));
    da.assign(a.size(), S(NAN)); db.assign(b.size(), S(NAN)); dh0.assign(st, S(NAN));
    p.variant = pr.variant;
    p.dtype = dt;
    p.state_dtype = dt;
    p.B = s.B; p.T = s.T; p.H = s.H; p.HV = s.HV; p.K = s.K; p.V = s.V;
    p.num_seqs = pr.N;
    if (!s.cu.empty()) p.cu_seqlens = s.cu.data();
    p.scale = 1.0 / std::sqrt(double(s.K));
    p.chunk_size = chunk;
    auto ref = [&](std::vector<S>& x, int64_t heads, int64_t D) {
      return x.empty() ? TensorRef{} : TensorRef{x.data(), s.T * heads * D, heads * D, D};
    };
    p.q = ref(q, s.H, s.K); p.k = ref(k, s.H, s.K); p.v = ref(v, s.HV, s.V);
    p.g = ref(g, s.HV, pr.gate_dim()); p.beta = ref(beta, s.HV, 1);
    p.a = ref(a, s.HV, s.K); p.b = ref(b, s.HV, s.K);
    p.h0 = h0.empty() ? nullptr : h0.data();
    p.o = ref(o, s.HV, s.V); p.ht = ht.data();
    p.dout = ref(dout, s.HV, s.V); p.dht = dht.data();
    p.dq = ref(dq, s.H, s.K); p.dk = ref(dk, s.H, s.K); p.dv = ref(dv, s.HV, s.V);
    p.dg = ref(dg, s.HV, pr.gate_dim()); p.dbeta = ref(dbeta, s.HV, 1);
    p.da = ref(da, s.HV, s.K); p.db = ref(db, s.HV, s.K);
    p.dh0 = h0.empty() ? nullptr : dh0.data();
  }

  // The outputs and gradients by name, in double, for comparisons.
  std::vector<std::pair<const char*, std::vector<double>>> results(bool backward) const {
    auto d = [](const std::vector<S>& x) { return std::vector<double>(x.begin(), x.end()); };
    std::vector<std::pair<const char*, std::vector<double>>> r{{"o", d(o)}, {"ht", d(ht)}};
    if (backward) {
      r = {{"dq", d(dq)}, {"dk", d(dk)}, {"dv", d(dv)}};
      if (!dg.empty()) r.push_back({"dg", d(dg)});
      if (!dbeta.empty()) r.push_back({"dbeta", d(dbeta)});
      if (!da.empty()) r.push_back({"da", d(da)});
      if (!db.empty()) r.push_back({"db", d(db)});
      if (p.dh0) r.push_back({"dh0", d(dh0)});
    }
    return r;
  }
};

inline const char* name(Variant v) { return to_string(v); }

}  // namespace deltacp::test
