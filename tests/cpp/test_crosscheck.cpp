// The cross-validation chain in fp64 (docs/design.md section 7): the token recurrence == the chunked
// WY form (C = 16, 32, 64) == the affine (M, H) folds == simulated context parallelism (1..8
// ranks, cuts inside chunks, a sequence spanning 3+ ranks) to 1e-12 relative, forward and backward,
// for delta, gdn, kda and dplr over the shapes that bite.
#include <gtest/gtest.h>

#include "deltacp/reference/batch.h"
#include "shapes.h"

using namespace deltacp;
using namespace deltacp::test;

namespace {

constexpr double kTol = 1e-12;

struct Case {
  Variant variant;
  std::string shape;
};
std::string case_name(const testing::TestParamInfo<Case>& i) {
  return std::string(to_string(i.param.variant)) + "_" + i.param.shape;
}
std::vector<Case> all_cases() {
  std::vector<Case> c;
  for (Variant v : {Variant::delta, Variant::gdn, Variant::kda, Variant::dplr})
    for (const auto& [n, s] : biting_shapes())
      if (!(v == Variant::dplr && s.HV != s.H)) c.push_back({v, n});  // dplr has no grouped values
  return c;
}
void PrintTo(const Case& c, std::ostream* os) { *os << to_string(c.variant) << "/" << c.shape; }

// CP cut sets for a packed batch of T tokens: 1..8 ranks, random cuts and cuts inside chunks.
std::vector<std::vector<int64_t>> cut_sets(int64_t T, uint64_t seed) {
  std::vector<std::vector<int64_t>> sets{{}};  // one rank
  std::mt19937_64 rng(seed);
  for (int R : {2, 3, 5, 8}) {
    if (T < R) break;
    std::vector<int64_t> cuts;
    // Random distinct cuts inside (0, T).
    while (static_cast<int>(cuts.size()) < R - 1) {
      int64_t c = 1 + static_cast<int64_t>(rng() % (T - 1));
      if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
    }
    std::sort(cuts.begin(), cuts.end());
    sets.push_back(cuts);
  }
  if (T > 140) sets.push_back({37, 70, 101, 130});  // all inside 64-chunks; the long sequence spans 3+ ranks
  return sets;
}

void expect_close(const std::vector<std::pair<const char*, std::vector<double>>>& got,
                  const std::vector<std::pair<const char*, std::vector<double>>>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = rel_err(got[i].second, want[i].second);
    EXPECT_LT(e, kTol) << what << ": " << got[i].first << " relative error " << e;
  }
}

class CrossCheck : public testing::TestWithParam<Case> {};

TEST_P(CrossCheck, ForwardTellingsAgree) {
  const Case c = GetParam();
  const Problem pr(c.variant, biting_shapes()[c.shape], 11);
  Buffers<double> ref(pr);
  ref::forward<double>(ref.p, Method::recurrent);
  const auto want = ref.results(false);
  for (int C : {16, 32, 64}) {
    Buffers<double> r(pr, C);
    ref::forward<double>(r.p, Method::chunked);
    expect_close(r.results(false), want, "chunked C=" + std::to_string(C));
  }
  Buffers<double> af(pr, 32);
  ref::forward<double>(af.p, Method::affine);
  expect_close(af.results(false), want, "affine");
  if (pr.s.B == 1) {
    for (const auto& cuts : cut_sets(pr.s.T, 3)) {
      Buffers<double> cp(pr);
      ref::cp_forward<double>(cp.p, cuts);
      expect_close(cp.results(false), want, "cp ranks=" + std::to_string(cuts.size() + 1));
    }
  }
}

TEST_P(CrossCheck, BackwardTellingsAgree) {
  const Case c = GetParam();
  const Problem pr(c.variant, biting_shapes()[c.shape], 12);
  Buffers<double> ref(pr);
  ref::backward<double>(ref.p, Method::recurrent);
  const auto want = ref.results(true);
  for (int C : {16, 64}) {
    Buffers<double> r(pr, C);
    ref::backward<double>(r.p, Method::chunked);
    expect_close(r.results(true), want, "chunked C=" + std::to_string(C));
  }
  if (pr.s.B == 1) {
    for (const auto& cuts : cut_sets(pr.s.T, 4)) {
      Buffers<double> cp(pr);
      ref::cp_backward<double>(cp.p, cuts);
      expect_close(cp.results(true), want, "cp ranks=" + std::to_string(cuts.size() + 1));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Reference, CrossCheck, testing::ValuesIn(all_cases()), case_name);

// Strided inputs (a view into a wider buffer) give the same answer as contiguous ones.
TEST(CrossCheckLayout, StridedViewsMatchContiguous) {
  const Problem pr(Variant::kda, fixed(2, 50, 2, 2, 16, 8), 5);
  Buffers<double> ref(pr);
  ref::forward<double>(ref.p, Method::chunked);
  // q inside a [B, T, H, 3K] buffer (as if split from a fused projection): stride_h stays K.
  Buffers<double> r(pr);
  std::vector<double> wide(pr.s.B * pr.s.T * pr.s.H * pr.s.K * 3, 1e300);
  for (int64_t bt = 0; bt < pr.s.B * pr.s.T; ++bt)
    for (int64_t h = 0; h < pr.s.H; ++h)
      for (int64_t d = 0; d < pr.s.K; ++d)
        wide[bt * pr.s.H * pr.s.K * 3 + h * pr.s.K + d] = pr.q[(bt * pr.s.H + h) * pr.s.K + d];
  r.p.q = TensorRef{wide.data(), pr.s.T * pr.s.H * pr.s.K * 3, pr.s.H * pr.s.K * 3, pr.s.K};
  ref::forward<double>(r.p, Method::chunked);
  expect_close(r.results(false), ref.results(false), "strided q");
}

}  // namespace

namespace {
// g in fp32 beside fp64 inputs (Params::g_fp32, as FLA keeps the log decay in fp32 beside bf16
// q, k, v): same result as g in fp64 holding the same values.
TEST(CrossCheckLayout, GateInFp32) {
  Problem pr(Variant::kda, varlen({0, 30, 77}, 1, 1, 16, 8), 6);
  for (auto& x : pr.g) x = static_cast<float>(x);  // values representable in fp32
  Buffers<double> ref(pr);
  ref::backward<double>(ref.p, Method::chunked);
  Buffers<double> r(pr);
  std::vector<float> g32(pr.g.begin(), pr.g.end()), dg32(pr.g.size(), NAN);
  r.p.g_fp32 = true;
  r.p.g = TensorRef{g32.data(), pr.s.T * pr.s.HV * pr.s.K, pr.s.HV * pr.s.K, pr.s.K};
  r.p.dg = TensorRef{dg32.data(), pr.s.T * pr.s.HV * pr.s.K, pr.s.HV * pr.s.K, pr.s.K};
  ref::backward<double>(r.p, Method::chunked);
  EXPECT_LT(rel_err(std::vector<double>(dg32.begin(), dg32.end()), ref.results(true)[3].second), 1e-6);  // dg
  EXPECT_LT(rel_err(r.results(true)[0].second, ref.results(true)[0].second), 1e-12);                     // dq
}
}  // namespace
