// Bad input raises deltacp::Error naming the argument with the expected and the actual value.
// One test per case; each checks the argument name and the key words of the message.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "deltacp/cp_plan.h"
#include "deltacp/error.h"
#include "deltacp/reference/batch.h"
#include "expect_error.h"
#include "shapes.h"

using namespace deltacp;
using namespace deltacp::test;

namespace {

struct BadInput : testing::Test {
  Problem pr{Variant::gdn, varlen({0, 10, 25}, 2, 2, 8, 4), 1};
};

TEST_F(BadInput, CuSeqlensNotStartingAtZero) {
  pr.s.cu = {3, 10, 25};
  Buffers<double> r(pr);
  expect_error([&] { ref::forward<double>(r.p, Method::chunked); }, "cu_seqlens", "cu_seqlens[0] == 0, got 3");
}

TEST_F(BadInput, CuSeqlensDecreasing) {
  pr.s.cu = {0, 12, 10, 25};
  Buffers<double> r(pr);
  expect_error([&] { ref::forward<double>(r.p, Method::chunked); }, "cu_seqlens", "non-decreasing");
}

TEST_F(BadInput, CuSeqlensNotEndingAtT) {
  pr.s.cu = {0, 10, 24};
  Buffers<double> r(pr);
  expect_error([&] { ref::forward<double>(r.p, Method::chunked); }, "cu_seqlens", "equal T = 25, got 24");
}

TEST_F(BadInput, CuSeqlensWithBatchAboveOne) {
  Buffers<double> r(pr);
  r.p.B = 2;
  expect_error([&] { ref::forward<double>(r.p, Method::chunked); }, "cu_seqlens", "B == 1");
}

TEST_F(BadInput, ChunkSizeNotSupported) {
  Buffers<double> r(pr, 48);
  expect_error([&] { ref::forward<double>(r.p, Method::chunked); }, "chunk_size", "16, 32 or 64, got 48");
}

TEST_F(BadInput, ZeroKeyDimension) {
  Buffers<double> r(pr);
  r.p.K = 0;
  expect_error([&] { ref::forward<double>(r.p, Method::recurrent); }, "K", "> 0, got 0");
}

TEST_F(BadInput, ZeroValueDimension) {
  Buffers<double> r(pr);
  r.p.V = 0;
  expect_error([&] { ref::forward<double>(r.p, Method::recurrent); }, "V", "> 0, got 0");
}

TEST_F(BadInput, ValueHeadsNotAMultipleOfKeyHeads) {
  Buffers<double> r(pr);
  r.p.HV = 3;
  expect_error([&] { ref::forward<double>(r.p, Method::recurrent); }, "HV", "multiple of H = 2 (grouped values), got 3");
}

TEST_F(BadInput, NaNInQueries) {
  pr.q[5] = NAN;
  Buffers<double> r(pr);
  expect_error([&] { ref::forward<double>(r.p, Method::chunked); }, "q", "finite");
}

TEST_F(BadInput, InfInGate) {
  pr.g[3] = -INFINITY;
  Buffers<double> r(pr);
  expect_error([&] { ref::forward<double>(r.p, Method::chunked); }, "g", "finite");
}

TEST_F(BadInput, NaNInInitialState) {
  pr.h0[7] = NAN;
  Buffers<double> r(pr);
  expect_error([&] { ref::forward<double>(r.p, Method::chunked); }, "initial_state", "finite");
}

TEST_F(BadInput, NaNInUpstreamGradient) {
  pr.dout[2] = NAN;
  Buffers<double> r(pr);
  expect_error([&] { ref::backward<double>(r.p, Method::chunked); }, "do", "finite");
}

TEST_F(BadInput, MissingBeta) {
  Buffers<double> r(pr);
  r.p.beta = TensorRef{};
  expect_error([&] { ref::forward<double>(r.p, Method::chunked); }, "beta", "expected a tensor");
}

TEST_F(BadInput, GateGivenForDelta) {
  Buffers<double> r(pr);
  r.p.variant = Variant::delta;
  expect_error([&] { ref::forward<double>(r.p, Method::chunked); }, "g", "delta has no gate");
}

TEST_F(BadInput, MissingGradientBuffer) {
  Buffers<double> r(pr);
  r.p.dg = TensorRef{};
  expect_error([&] { ref::backward<double>(r.p, Method::chunked); }, "dg", "expected a tensor");
}

TEST_F(BadInput, GpuTierOnTheReference) {
  Buffers<double> r(pr);
  expect_error([&] { ref::forward<double>(r.p, Method::tiled); }, "method", "got tiled");
}

TEST_F(BadInput, NonFiniteScale) {
  Buffers<double> r(pr);
  r.p.scale = NAN;
  expect_error([&] { ref::forward<double>(r.p, Method::chunked); }, "scale", "finite");
}

TEST_F(BadInput, CpCutOutsideSequence) {
  Buffers<double> r(pr);
  expect_error([&] { ref::cp_forward<double>(r.p, {10, 25}); }, "cuts", "inside (0, T = 25), got cuts[1] = 25");
}

TEST_F(BadInput, CpCutsNotIncreasing) {
  Buffers<double> r(pr);
  expect_error([&] { ref::cp_forward<double>(r.p, {12, 12}); }, "cuts", "strictly increasing");
}

TEST(BadInputPlan, EvenSplitNeedsDivisibleT) {
  expect_error([] { cp_plan_even({0, 10, 25}, 2); }, "cu_seqlens", "T = 25, world = 2");
}

TEST(BadInputNames, UnknownVariant) {
  expect_error([] { variant_from_string("mamba"); }, "variant", "got 'mamba'");
}

}  // namespace

namespace {
TEST(BadInputDplr, GroupedValuesRefused) {
  const Problem pr(Variant::dplr, fixed(1, 10, 1, 2, 8, 4), 1);
  Buffers<double> r(pr);
  expect_error([&] { ref::forward<double>(r.p, Method::chunked); }, "HV", "HV == H = 1 for dplr, got 2");
}
}  // namespace

// deltacp/error.h builds messages without iostreams (an ostream << long crashed inside torch processes
// on the GPU machines); every kind of piece still reads as before.
TEST(ErrorMessage, FormatsEveryKindOfPiece) {
  try {
    throw_error("x", "ints ", int64_t{-5}, " ", size_t{7}, " ", 3u, ", reals ", 2.5, " ", 1e-7f, ", char ", 'z',
                ", bool ", true, ", strings ", std::string("s"), " ", static_cast<const char*>("p"));
    FAIL() << "throw_error returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "x");
    EXPECT_STREQ(e.what(), "deltacp: argument 'x': ints -5 7 3, reals 2.5 1e-07, char z, bool 1, strings s p");
  }
}
