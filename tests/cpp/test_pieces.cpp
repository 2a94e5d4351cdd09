// The pieces each telling is built from, checked on their own in fp64:
// T = (I + A)^-1, WY factors against the product of per-token transitions, (M, H) composition,
// the CP plan's rank bookkeeping, and the exchanged (M, H) of simulated ranks.
#include <gtest/gtest.h>

#include "deltacp/cp_plan.h"
#include "deltacp/reference/batch.h"
#include "shapes.h"

using namespace deltacp;
using namespace deltacp::ref;
using namespace deltacp::test;

namespace {

double rel(const Mat<double>& a, const Mat<double>& b) { return (a - b).norm() / std::max(1e-300, b.norm()); }

HeadInputs<double> head(Variant v, int64_t T, int64_t K, int64_t V, uint64_t seed) {
  const Problem pr(v, fixed(1, T, 1, 1, K, V), seed);
  Buffers<double> r(pr);
  return gather_head<double>(r.p, 0, 0);
}

TEST(Pieces, UnitLowerInverseSolvesTheSystem) {
  const HeadInputs<double> x = head(Variant::kda, 64, 16, 8, 1);
  const ChunkWY<double> wy = chunk_wy(x);
  const Mat<double> I = Mat<double>::Identity(64, 64);
  EXPECT_LT(rel((I + wy.A) * wy.T, I), 1e-13);
  for (int64_t i = 0; i < 64; ++i)
    for (int64_t j = i; j < 64; ++j) EXPECT_EQ(wy.A(i, j), 0.0);  // strictly lower
}

class PiecesByVariant : public testing::TestWithParam<Variant> {};

// The chunk's (M, H) from the WY factors equals the product of the per-token transitions.
TEST_P(PiecesByVariant, ChunkAffineEqualsProductOfTransitions) {
  const HeadInputs<double> x = head(GetParam(), 50, 12, 7, 2);
  const Affine<double> wy = chunk_affine(x, chunk_wy(x));
  const Affine<double> tok = span_affine_tokens(x, 0, 50);
  EXPECT_LT(rel(wy.M, tok.M), 1e-13);
  EXPECT_LT(rel(wy.H, tok.H), 1e-13);
}

// Spans compose: (M, H) of [0, 90) = (M, H) of [40, 90) o (M, H) of [0, 40), and applying it to
// h0 gives the recurrence's final state.
TEST_P(PiecesByVariant, SpansCompose) {
  const HeadInputs<double> x = head(GetParam(), 90, 12, 7, 3);
  const Affine<double> whole = span_affine(x, 0, 90, 16);
  const Affine<double> parts = compose(span_affine(x, 40, 90, 32), span_affine(x, 0, 40, 16));
  EXPECT_LT(rel(parts.M, whole.M), 1e-12);
  EXPECT_LT(rel(parts.H, whole.H), 1e-12);
  const Mat<double> h0 = Mat<double>::Random(12, 7);
  EXPECT_LT(rel(whole.apply(h0), recurrent_forward(x, h0).ht), 1e-12);
}

// The backward map of a span: dL/dS_start = M^T dS_end + dH equals the recurrence's dh0.
TEST_P(PiecesByVariant, BackwardSpanMap) {
  const HeadInputs<double> x = head(GetParam(), 70, 10, 6, 4);
  const Mat<double> h0 = Mat<double>::Random(10, 6), dout = Mat<double>::Random(70, 6),
                    dht = Mat<double>::Random(10, 6);
  const AffineBackward<double> b = span_affine_backward(x, 0, 70, dout, 16);
  EXPECT_LT(rel(b.Mt * dht + b.dH, recurrent_backward(x, h0, dout, dht).dh0), 1e-12);
}

// v_new (U - W S) is what the recurrence's u_t / beta_t would be: u_t = beta_t (v_t - S_{t-1}'^T k_t).
TEST_P(PiecesByVariant, ChunkedStatesMatchRecurrence) {
  const HeadInputs<double> x = head(GetParam(), 100, 12, 9, 5);
  const Mat<double> h0 = Mat<double>::Random(12, 9);
  const ChunkedForward<double> f = chunked_forward(x, h0, 32);
  ASSERT_EQ(f.states.size(), 5u);  // 4 chunks (32, 32, 32, 4) + the final state
  for (int c = 0; c <= 4; ++c) {
    const int64_t t = std::min<int64_t>(100, 32 * c);
    const Mat<double> want = t == 0 ? h0 : recurrent_forward(x.slice(0, t), h0).ht;
    EXPECT_LT(rel(f.states[c], want), 1e-12) << "chunk " << c;
  }
}

INSTANTIATE_TEST_SUITE_P(Reference, PiecesByVariant,
                         testing::Values(Variant::delta, Variant::gdn, Variant::kda, Variant::dplr),
                         [](const testing::TestParamInfo<Variant>& i) { return to_string(i.param); });

TEST(CpPlan, RanksKnowWhoSharesTheirSequences) {
  // Sequences [0,5) [5,40) [40,41) [41,60); ranks cut at 10, 20, 45.
  const auto plans = cp_plan_from_cuts({0, 5, 40, 41, 60}, {10, 20, 45});
  ASSERT_EQ(plans.size(), 4u);
  EXPECT_EQ(plans[0].seq_ids, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(plans[0].cu_seqlens, (std::vector<int64_t>{0, 5, 10}));
  EXPECT_EQ(plans[0].pre_ranks, 0);
  EXPECT_EQ(plans[0].post_ranks, 2);  // sequence 1 goes on to ranks 1 and 2
  EXPECT_EQ(plans[1].seq_ids, (std::vector<int64_t>{1}));
  EXPECT_EQ(plans[1].pre_ranks, 1);
  EXPECT_EQ(plans[1].post_ranks, 1);
  EXPECT_EQ(plans[2].seq_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(plans[2].cu_seqlens, (std::vector<int64_t>{0, 20, 21, 25}));
  EXPECT_EQ(plans[2].pre_ranks, 2);
  EXPECT_EQ(plans[2].post_ranks, 1);
  EXPECT_EQ(plans[3].seq_ids, (std::vector<int64_t>{3}));
  EXPECT_EQ(plans[3].pre_ranks, 1);
  EXPECT_EQ(plans[3].post_ranks, 0);
}

TEST(CpPlan, EvenSplit) {
  const auto plans = cp_plan_even({0, 100, 128}, 4);
  ASSERT_EQ(plans.size(), 4u);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(plans[r].local_tokens(), 32);
  EXPECT_EQ(plans[3].seq_ids, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(plans[3].pre_ranks, 3);
}

// What the simulated ranks exchange is the (M, H) of their last segments: folding them reproduces
// the recurrence's state at each cut.
TEST(CpExchangeTest, GatheredMapsReproduceStatesAtCuts) {
  const Problem pr(Variant::gdn, fixed(1, 200, 1, 1, 8, 5), 9);
  Buffers<double> r(pr);
  CpExchange<double> ex;
  ref::cp_forward<double>(r.p, {50, 120, 150}, &ex);
  ASSERT_EQ(ex.fwd.size(), 4u);
  const HeadInputs<double> x = gather_head<double>(r.p, 0, 0);
  const Mat<double> h0 = gather_state<double>(r.p.h0, r.p.state_dtype, r.p, 0, 0);
  Mat<double> St = h0;
  const int64_t cuts[] = {50, 120, 150};
  for (int j = 0; j < 3; ++j) {
    St = ex.fwd[j].apply(St);
    EXPECT_LT(rel(St, recurrent_forward(x.slice(0, cuts[j]), h0).ht), 1e-12) << "after rank " << j;
  }
}

}  // namespace
