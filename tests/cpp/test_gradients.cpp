// Backward against central finite differences in fp64, for every input (q, k, v, g, beta, h0;
// dplr: a, b, gk), through both the recurrence's and the chunked form's backward.
// L = sum(o * do) + sum(ht * dht); each analytic gradient entry is compared with
// (L(x + eps) - L(x - eps)) / (2 eps) on a sample of entries.
#include <gtest/gtest.h>

#include "deltacp/reference/batch.h"
#include "shapes.h"

using namespace deltacp;
using namespace deltacp::test;

namespace {

double loss(const Problem& pr, Method m) {
  Buffers<double> r(pr, 16);
  ref::forward<double>(r.p, m);
  double L = 0;
  for (size_t i = 0; i < r.o.size(); ++i) L += r.o[i] * pr.dout[i];
  for (size_t i = 0; i < r.ht.size(); ++i) L += r.ht[i] * pr.dht[i];
  return L;
}

struct Case {
  Variant variant;
  Method method;
};

void PrintTo(const Case& c, std::ostream* os) { *os << to_string(c.variant) << "/" << to_string(c.method); }

class Gradients : public testing::TestWithParam<Case> {};

TEST_P(Gradients, MatchCentralDifferences) {
  const auto [variant, method] = GetParam();
  // Two sequences (varlen), 37 tokens with C = 16: several chunks, a short last chunk.
  const Problem base(variant, varlen({0, 21, 37}, 1, 1, 6, 5), 21);
  Buffers<double> an(base, 16);
  ref::backward<double>(an.p, method);

  std::vector<std::pair<const char*, const std::vector<double>*>> grads{
      {"q", &an.dq}, {"k", &an.dk}, {"v", &an.dv}, {"h0", &an.dh0}};
  if (variant != Variant::delta) grads.push_back({"g", &an.dg});
  if (variant != Variant::dplr) grads.push_back({"beta", &an.dbeta});
  if (variant == Variant::dplr) {
    grads.push_back({"a", &an.da});
    grads.push_back({"b", &an.db});
  }
  std::mt19937_64 rng(3);
  const double eps = 1e-6;
  for (auto [name, grad] : grads) {
    Problem pr = base;
    std::vector<double>& x = *pr.input(name);
    double max_err = 0, max_ref = 0;
    for (int trial = 0; trial < 24; ++trial) {
      const size_t i = rng() % x.size();
      const double x0 = x[i];
      x[i] = x0 + eps;
      const double lp = loss(pr, Method::recurrent);
      x[i] = x0 - eps;
      const double lm = loss(pr, Method::recurrent);
      x[i] = x0;
      const double fd = (lp - lm) / (2 * eps);
      max_err = std::max(max_err, std::abs(fd - (*grad)[i]));
      max_ref = std::max(max_ref, std::abs(fd));
    }
    EXPECT_LT(max_err, 1e-6 * std::max(1.0, max_ref)) << "d" << name << ": max |fd - analytic| = " << max_err
                                                      << " (max |fd| = " << max_ref << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Reference, Gradients,
    testing::Values(Case{Variant::delta, Method::recurrent}, Case{Variant::delta, Method::chunked},
                    Case{Variant::gdn, Method::recurrent}, Case{Variant::gdn, Method::chunked},
                    Case{Variant::kda, Method::recurrent}, Case{Variant::kda, Method::chunked},
                    Case{Variant::dplr, Method::recurrent}, Case{Variant::dplr, Method::chunked}),
    [](const testing::TestParamInfo<Case>& i) {
      return std::string(to_string(i.param.variant)) + "_" + to_string(i.param.method);
    });

}  // namespace
