// deltacp_agree — the C++ main job: the four tellings of each variant on one random packed
// problem, and how closely they agree (relative error against the token recurrence, in fp64).
//
//   deltacp_agree [--T 1000] [--K 64] [--V 48] [--H 2] [--ranks 4] [--seed 1]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "deltacp/error.h"
#include "deltacp/reference/batch.h"

using namespace deltacp;

namespace {

double rel_err(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

}  // namespace

int main(int argc, char** argv) {
  int64_t T = 1000, K = 64, V = 48, H = 2;
  int ranks = 4;
  unsigned seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const long long x = std::atoll(argv[i + 1]);
    if (a == "--T") T = x;
    else if (a == "--K") K = x;
    else if (a == "--V") V = x;
    else if (a == "--H") H = x;
    else if (a == "--ranks") ranks = static_cast<int>(x);
    else if (a == "--seed") seed = static_cast<unsigned>(x);
    else { std::fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
  }
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> unif(0.05, 0.95);
  // A packed batch of sequences of random lengths: [0, ..., T].
  std::vector<int64_t> cu{0};
  while (cu.back() < T) cu.push_back(std::min<int64_t>(T, cu.back() + 1 + static_cast<int64_t>(rng() % (T / 3 + 1))));
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
  std::vector<int64_t> cuts;
  for (int r = 1; r < ranks; ++r) cuts.push_back(T * r / ranks + (r % 2 ? 7 : -3));

  std::printf("deltacp: four tellings of one algorithm, fp64, T=%lld (%lld sequences), H=%lld, K=%lld, V=%lld, "
              "%d CP ranks\n",
              (long long)T, (long long)N, (long long)H, (long long)K, (long long)V, ranks);
  std::printf("%-6s %-22s %-14s %-14s\n", "variant", "telling", "rel.err o", "rel.err ht");
  bool ok = true;
  for (Variant var : {Variant::delta, Variant::gdn, Variant::kda, Variant::dplr}) {
    auto randn = [&](size_t n, double s) {
      std::vector<double> x(n);
      for (auto& e : x) e = s * normal(rng);
      return x;
    };
    std::vector<double> q = randn(T * H * K, 1), k = randn(T * H * K, 1), v = randn(T * H * V, 1);
    for (int64_t r = 0; r < T * H; ++r) {  // L2-normalise keys (and dplr's a) along K
      double s = 0;
      for (int64_t d = 0; d < K; ++d) s += k[r * K + d] * k[r * K + d];
      for (int64_t d = 0; d < K; ++d) k[r * K + d] /= std::sqrt(s);
    }
    const int64_t gd = var == Variant::gdn ? 1 : K;
    std::vector<double> g(T * H * gd), beta(T * H), a, b;
    for (auto& e : g) e = std::log(unif(rng)) * 0.1;  // log decay in (-0.3, 0)
    for (auto& e : beta) e = unif(rng);
    if (var == Variant::dplr) {
      a = randn(T * H * K, 1.0 / std::sqrt(double(K)));
      b = randn(T * H * K, 1.0 / std::sqrt(double(K)));
    }
    std::vector<double> h0 = randn(N * H * K * V, 0.1);
    Params p;
    p.variant = var;
    p.dtype = DType::f64;
    p.state_dtype = DType::f64;
    p.B = 1; p.T = T; p.H = H; p.HV = H; p.K = K; p.V = V;
    p.cu_seqlens = cu.data();
    p.num_seqs = N;
    p.scale = 1.0 / std::sqrt(double(K));
    p.chunk_size = 64;
    p.q = contiguous_ref(q.data(), T, H, K);
    p.k = contiguous_ref(k.data(), T, H, K);
    p.v = contiguous_ref(v.data(), T, H, V);
    if (var != Variant::delta) p.g = contiguous_ref(g.data(), T, H, gd);
    if (var != Variant::dplr) p.beta = contiguous_ref(beta.data(), T, H, 1);
    if (var == Variant::dplr) {
      p.a = contiguous_ref(a.data(), T, H, K);
      p.b = contiguous_ref(b.data(), T, H, K);
    }
    p.h0 = h0.data();
    std::vector<double> o_ref(T * H * V), ht_ref(N * H * K * V);
    p.o = contiguous_ref(o_ref.data(), T, H, V);
    p.ht = ht_ref.data();
    try {
      ref::forward<double>(p, Method::recurrent);
      auto run = [&](const char* name, auto fn) {
        std::vector<double> o(o_ref.size(), NAN), ht(ht_ref.size(), NAN);
        Params q2 = p;
        q2.o = contiguous_ref(o.data(), T, H, V);
        q2.ht = ht.data();
        fn(q2);
        const double eo = rel_err(o, o_ref), eh = rel_err(ht, ht_ref);
        ok = ok && eo < 1e-12 && eh < 1e-12;
        std::printf("%-7s %-22s %-14.3e %-14.3e\n", to_string(var), name, eo, eh);
      };
      run("chunked (C=64)", [](const Params& x) { ref::forward<double>(x, Method::chunked); });
      run("affine (M, H) folds", [](const Params& x) { ref::forward<double>(x, Method::affine); });
      run("simulated CP", [&](const Params& x) { ref::cp_forward<double>(x, cuts); });
    } catch (const Error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
  }
  std::printf(ok ? "all tellings agree to 1e-12\n" : "DISAGREEMENT above 1e-12\n");
  return ok ? 0 : 1;
}
