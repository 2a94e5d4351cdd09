// The two state-only modes of Params (params.h), which the context-parallel pre-pass runs:
//
//   final-state-only forward   o null, ht given          -> only ht is written
//   dh0-only backward          every input gradient null -> only dh0 is written
//
// Each must give exactly (bitwise) the ht / dh0 of the full run of the same telling, for every
// variant and telling (recurrent, chunked, affine; the simulated CP too), touch nothing else, and
// the augmented run of the pre-pass ([v | 0] from [start | I]) must give the span's affine map.
// Bad input: o and ht both missing, and a partial set of input gradients, name the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <tuple>

#include "deltacp/error.h"
#include "deltacp/reference/batch.h"
#include "expect_error.h"
#include "shapes.h"

using namespace deltacp;
using namespace deltacp::ref;
using namespace deltacp::test;

namespace {

// Bitwise equality of two buffers (NaN never equals, so an unwritten NaN-filled slot fails).
template <class S>
void expect_bitwise(const std::vector<S>& got, const std::vector<S>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i])) ++bad;
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements differ";
}

template <class S>
bool all_nan(const std::vector<S>& x) {
  for (S e : x)
    if (!std::isnan(e)) return false;
  return true;
}

// Shapes: a packed batch with an initial state (a sequence longer than a chunk, one shorter, an
// empty one) and a fixed batch without one; grouped values except for dplr.
Shape shape_for(Variant v, bool packed) {
  const int64_t HV = v == Variant::dplr ? 2 : 4;
  if (packed) return varlen({0, 70, 70, 93, 130}, 2, HV, 16, 12);
  Shape s = fixed(2, 45, 2, HV, 16, 12);
  s.h0 = false;
  return s;
}

using Case = std::tuple<Variant, Method, bool>;  // variant, telling, packed

class StateOnly : public testing::TestWithParam<Case> {};

TEST_P(StateOnly, FinalStateOnlyForwardEqualsFullRun) {
  const auto [variant, method, packed] = GetParam();
  const Problem pr(variant, shape_for(variant, packed), 11);
  Buffers<double> full(pr, 16), only(pr, 16);
  ref::forward<double>(full.p, method);
  only.p.o = TensorRef{};  // final-state-only: no output buffer at all
  ref::forward<double>(only.p, method);
  expect_bitwise(only.ht, full.ht, "ht");
  EXPECT_TRUE(all_nan(only.o)) << "the output buffer must not be touched";
}

TEST_P(StateOnly, Dh0OnlyBackwardEqualsFullRun) {
  const auto [variant, method, packed] = GetParam();
  Problem pr(variant, shape_for(variant, packed), 12);
  if (pr.h0.empty()) pr.h0.assign(pr.N * pr.s.HV * pr.s.K * pr.s.V, 0.0);  // Buffers gives dh0 with h0
  Buffers<double> full(pr, 16), only(pr, 16);
  ref::backward<double>(full.p, method);
  only.p.dq = only.p.dk = only.p.dv = only.p.dg = only.p.dbeta = only.p.da = only.p.db = TensorRef{};
  ref::backward<double>(only.p, method);
  expect_bitwise(only.dh0, full.dh0, "dh0");
  for (const auto* buf : {&only.dq, &only.dk, &only.dv, &only.dg, &only.dbeta, &only.da, &only.db})
    EXPECT_TRUE(all_nan(*buf)) << "an input gradient buffer was written";
}

INSTANTIATE_TEST_SUITE_P(
    Reference, StateOnly,
    testing::Combine(testing::Values(Variant::gdn, Variant::kda, Variant::delta, Variant::dplr),
                     testing::Values(Method::recurrent, Method::chunked, Method::affine), testing::Bool()),
    [](const testing::TestParamInfo<Case>& i) {
      return std::string(to_string(std::get<0>(i.param))) + "_" + to_string(std::get<1>(i.param)) +
             (std::get<2>(i.param) ? "_packed" : "_fixed");
    });

class StateOnlyByVariant : public testing::TestWithParam<Variant> {};

// The simulated CP writes the same ht / dh0 in the state-only modes.
TEST_P(StateOnlyByVariant, SimulatedCpStateOnly) {
  const Problem pr(GetParam(), varlen({0, 30, 110, 160}, 1, GetParam() == Variant::dplr ? 1 : 2, 8, 6), 14);
  const std::vector<int64_t> cuts{50, 75, 120};
  Buffers<double> full(pr, 16), only(pr, 16);
  ref::cp_forward<double>(full.p, cuts);
  only.p.o = TensorRef{};
  ref::cp_forward<double>(only.p, cuts);
  expect_bitwise(only.ht, full.ht, "cp ht");
  Buffers<double> bfull(pr, 16), bonly(pr, 16);
  ref::cp_backward<double>(bfull.p, cuts);
  bonly.p.dq = bonly.p.dk = bonly.p.dv = bonly.p.dg = bonly.p.dbeta = bonly.p.da = bonly.p.db = TensorRef{};
  ref::cp_backward<double>(bonly.p, cuts);
  expect_bitwise(bonly.dh0, bfull.dh0, "cp dh0");
}

// The CP pre-pass as the Python layer runs it through the state-only modes: values [v | 0] from
// [start | I] give ht = [M start + H | M]; upstream [do | 0] with dht = [dend | I] give
// dh0 = [M^T dend + dH | M^T] (affine.h), for every value head of a one-sequence span.
TEST_P(StateOnlyByVariant, AugmentedRunsGiveTheSpanMaps) {
  const Variant variant = GetParam();
  const int64_t T = 75, K = 8, V = 5, W = V + K, HV = variant == Variant::dplr ? 1 : 2;
  Problem pr(variant, fixed(1, T, 1, HV, K, W), 15);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t hv = 0; hv < HV; ++hv)
      for (int64_t j = V; j < W; ++j) {
        pr.v[(t * HV + hv) * W + j] = 0.0;
        pr.dout[(t * HV + hv) * W + j] = 0.0;
      }
  for (int64_t hv = 0; hv < HV; ++hv)
    for (int64_t d = 0; d < K; ++d)
      for (int64_t j = V; j < W; ++j) {
        pr.h0[(hv * K + d) * W + j] = (j - V == d) ? 1.0 : 0.0;
        pr.dht[(hv * K + d) * W + j] = (j - V == d) ? 1.0 : 0.0;
      }
  Buffers<double> fwd(pr, 16), bwd(pr, 16);
  fwd.p.o = TensorRef{};
  ref::forward<double>(fwd.p, Method::chunked);
  bwd.p.h0 = nullptr;  // the backward map does not depend on the start state
  bwd.p.dq = bwd.p.dk = bwd.p.dv = bwd.p.dg = bwd.p.dbeta = bwd.p.da = bwd.p.db = TensorRef{};
  ref::backward<double>(bwd.p, Method::chunked);

  auto block = [&](const std::vector<double>& buf, int64_t hv, int64_t c0, int64_t cols) {
    Mat<double> m(K, cols);
    for (int64_t d = 0; d < K; ++d)
      for (int64_t j = 0; j < cols; ++j) m(d, j) = buf[(hv * K + d) * W + c0 + j];
    return m;
  };
  auto rel = [](const Mat<double>& a, const Mat<double>& b) { return (a - b).norm() / std::max(1e-300, b.norm()); };
  for (int64_t hv = 0; hv < HV; ++hv) {
    HeadInputs<double> x = gather_head<double>(fwd.p, 0, hv);
    x.v = Mat<double>(x.v.leftCols(V));
    const Affine<double> f = span_affine(x, 0, T, 16);
    const Mat<double> start = block(pr.h0, hv, 0, V), dend = block(pr.dht, hv, 0, V);
    EXPECT_LT(rel(block(fwd.ht, hv, 0, V), f.M * start + f.H), 1e-12) << "H, head " << hv;
    EXPECT_LT(rel(block(fwd.ht, hv, V, K), f.M), 1e-12) << "M, head " << hv;
    Mat<double> dout(T, V);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < V; ++j) dout(t, j) = pr.dout[(t * HV + hv) * W + j];
    const AffineBackward<double> b = span_affine_backward(x, 0, T, dout, 16);
    EXPECT_LT(rel(block(bwd.dh0, hv, 0, V), b.Mt * dend + b.dH), 1e-12) << "dH, head " << hv;
    EXPECT_LT(rel(block(bwd.dh0, hv, V, K), b.Mt), 1e-12) << "M^T, head " << hv;
  }
}

INSTANTIATE_TEST_SUITE_P(Reference, StateOnlyByVariant,
                         testing::Values(Variant::gdn, Variant::kda, Variant::delta, Variant::dplr),
                         [](const testing::TestParamInfo<Variant>& i) { return to_string(i.param); });

// ---- bad input ------------------------------------------------------------------------------
struct StateOnlyBadInput : testing::Test {
  Problem pr{Variant::gdn, varlen({0, 10, 25}, 2, 2, 8, 4), 1};
};

TEST_F(StateOnlyBadInput, NoOutputAndNoFinalState) {
  Buffers<double> r(pr);
  r.p.o = TensorRef{};
  r.p.ht = nullptr;
  expect_error([&] { ref::forward<double>(r.p, Method::chunked); }, "o", "only when ht is given");
}

TEST_F(StateOnlyBadInput, PartialGradientsQWithoutK) {
  Buffers<double> r(pr);
  r.p.dk = r.p.dv = r.p.dg = r.p.dbeta = TensorRef{};  // dq given, dk missing
  expect_error([&] { ref::backward<double>(r.p, Method::chunked); }, "dk", "omitted together only when dh0");
}

TEST_F(StateOnlyBadInput, PartialGradientsOnlyGateMissing) {
  Buffers<double> r(pr);
  r.p.dg = TensorRef{};
  expect_error([&] { ref::backward<double>(r.p, Method::recurrent); }, "dg", "expected a tensor");
}

TEST_F(StateOnlyBadInput, NoGradientsAndNoDh0) {
  Buffers<double> r(pr);
  r.p.dq = r.p.dk = r.p.dv = r.p.dg = r.p.dbeta = TensorRef{};
  r.p.dh0 = nullptr;
  expect_error([&] { ref::backward<double>(r.p, Method::chunked); }, "dq", "only when dh0 is given");
}

TEST_F(StateOnlyBadInput, Dh0OnlyStillNeedsTheUpstreamGradient) {
  Buffers<double> r(pr);
  r.p.dq = r.p.dk = r.p.dv = r.p.dg = r.p.dbeta = TensorRef{};
  r.p.dout = TensorRef{};
  expect_error([&] { ref::backward<double>(r.p, Method::chunked); }, "do", "expected a tensor");
}

TEST(StateOnlyBadInputDplr, PartialGradientsNameTheDplrGate) {
  const Problem pr(Variant::dplr, fixed(1, 10, 1, 1, 8, 4), 2);
  Buffers<double> r(pr);
  r.p.dg = TensorRef{};
  expect_error([&] { ref::backward<double>(r.p, Method::chunked); }, "dgk", "expected a tensor");
}

}  // namespace
