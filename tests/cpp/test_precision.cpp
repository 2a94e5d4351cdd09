// float agrees with double on random problems of realistic scale (T = 4096, K = V = 128):
// the reference instantiated in fp32 stays within ~1e-5 relative of the fp64 one.
#include <gtest/gtest.h>

#include "deltacp/reference/batch.h"
#include "shapes.h"

using namespace deltacp;
using namespace deltacp::test;

namespace {

class FloatVsDouble : public testing::TestWithParam<Variant> {};

TEST_P(FloatVsDouble, ForwardT4096K128) {
  const Problem pr(GetParam(), fixed(1, 4096, 1, 1, 128, 128), 31);
  Buffers<double> d(pr);
  Buffers<float> f(pr);
  ref::forward<double>(d.p, Method::chunked);
  ref::forward<float>(f.p, Method::chunked);
  const auto want = d.results(false), got = f.results(false);
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = rel_err(got[i].second, want[i].second);
    std::printf("  %s fp32 vs fp64 %s: %.3e\n", to_string(GetParam()), want[i].first, e);
    EXPECT_LT(e, 1e-5) << want[i].first;
  }
}

TEST_P(FloatVsDouble, BackwardT1024K128) {
  const Problem pr(GetParam(), fixed(1, 1024, 1, 1, 128, 128), 32);
  Buffers<double> d(pr);
  Buffers<float> f(pr);
  ref::backward<double>(d.p, Method::chunked);
  ref::backward<float>(f.p, Method::chunked);
  const auto want = d.results(true), got = f.results(true);
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = rel_err(got[i].second, want[i].second);
    std::printf("  %s fp32 vs fp64 %s: %.3e\n", to_string(GetParam()), want[i].first, e);
    EXPECT_LT(e, 1e-5) << want[i].first;
  }
}

TEST(FloatVsDoubleRecurrence, GdnForwardT4096K128) {
  const Problem pr(Variant::gdn, fixed(1, 4096, 1, 1, 128, 128), 33);
  Buffers<double> d(pr);
  Buffers<float> f(pr);
  ref::forward<double>(d.p, Method::recurrent);
  ref::forward<float>(f.p, Method::recurrent);
  EXPECT_LT(rel_err(f.results(false)[0].second, d.results(false)[0].second), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Reference, FloatVsDouble,
                         testing::Values(Variant::delta, Variant::gdn, Variant::kda, Variant::dplr),
                         [](const testing::TestParamInfo<Variant>& i) { return to_string(i.param); });

}  // namespace
