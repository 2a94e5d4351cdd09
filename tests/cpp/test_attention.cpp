// Softmax attention reference: blockwise attention merged with the online softmax equals plain
// attention (forward and every gradient), in fp64 and fp32, causal and not, for key blocks dealt in
// the zig-zag layout of ring attention; the merge's and the block's backwards against finite
// differences; rows that see no key; bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "deltacp/reference/attention.h"
#include "expect_error.h"

using namespace deltacp::ref;

namespace {

template <class S>
Mat<S> randn(int64_t r, int64_t c, std::mt19937_64& gen) {
  std::normal_distribution<double> d(0.0, 1.0);
  Mat<S> m(r, c);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) m(i, j) = static_cast<S>(d(gen));
  return m;
}

template <class S>
double rel(const Mat<S>& a, const Mat<S>& b) {
  return (a - b).template cast<double>().norm() / std::max(b.template cast<double>().norm(), 1e-300);
}

template <class S>
double rel(const Vec<S>& a, const Vec<S>& b) {
  return (a - b).template cast<double>().norm() / std::max(b.template cast<double>().norm(), 1e-300);
}

template <class S>
Mat<S> rows(const Mat<S>& m, const Positions& idx) {
  Mat<S> out(static_cast<int64_t>(idx.size()), m.cols());
  for (size_t i = 0; i < idx.size(); ++i) out.row(static_cast<int64_t>(i)) = m.row(idx[i]);
  return out;
}

// The zig-zag deal of T tokens to N ranks in blocks of `block`: folds of N blocks, every other fold
// reversed. Returns each rank's global positions in local order.
std::vector<Positions> zigzag(int64_t T, int64_t N, int64_t block) {
  std::vector<Positions> out(static_cast<size_t>(N));
  for (int64_t b = 0; b * block < T; ++b) {
    const int64_t fold = b / N, within = b % N;
    const int64_t r = fold % 2 == 0 ? within : N - 1 - within;
    for (int64_t t = b * block; t < (b + 1) * block; ++t) out[static_cast<size_t>(r)].push_back(t);
  }
  return out;
}

template <class S>
double tol() {
  return std::is_same_v<S, double> ? 1e-12 : 2e-5;
}

template <class S>
class AttentionTest : public ::testing::Test {};
using Scalars = ::testing::Types<double, float>;
TYPED_TEST_SUITE(AttentionTest, Scalars);

// A naive, loop-by-loop softmax attention in long double: what "plain attention" means.
template <class S>
Mat<S> naive(const Mat<S>& q, const Mat<S>& k, const Mat<S>& v, S scale, bool causal) {
  Mat<S> o = Mat<S>::Zero(q.rows(), v.cols());
  for (int64_t i = 0; i < q.rows(); ++i) {
    const int64_t m = causal ? i + 1 : k.rows();
    std::vector<long double> s(static_cast<size_t>(m));
    long double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < m; ++j) {
      long double d = 0;
      for (int64_t c = 0; c < q.cols(); ++c) d += static_cast<long double>(q(i, c)) * k(j, c);
      s[static_cast<size_t>(j)] = d * scale;
      mx = std::max(mx, s[static_cast<size_t>(j)]);
    }
    for (auto& x : s) sum += (x = std::exp(x - mx));
    for (int64_t c = 0; c < v.cols(); ++c) {
      long double acc = 0;
      for (int64_t j = 0; j < m; ++j) acc += s[static_cast<size_t>(j)] * v(j, c);
      o(i, c) = static_cast<S>(acc / sum);
    }
  }
  return o;
}

}  // namespace

TYPED_TEST(AttentionTest, PlainEqualsNaive) {
  using S = TypeParam;
  std::mt19937_64 gen(1);
  const Mat<S> q = randn<S>(37, 16, gen), k = randn<S>(37, 16, gen), v = randn<S>(37, 12, gen);
  for (bool causal : {true, false}) {
    const auto out = attention_forward<S>(q, k, v, S(0.25), causal);
    EXPECT_LT(rel(out.o, naive<S>(q, k, v, S(0.25), causal)), tol<S>()) << "causal " << causal;
    // Row 0 under the causal mask sees key 0 alone: its output is v_0, its lse the one score.
    if (causal) {
      EXPECT_LT(rel(Mat<S>(out.o.row(0)), Mat<S>(v.row(0))), tol<S>());
      EXPECT_NEAR(out.lse(0), q.row(0).dot(k.row(0)) * S(0.25), 10 * tol<S>());
    }
  }
}

// Ring attention's decomposition: each rank's queries against every rank's key block (in ring
// order: its own first), merged one block at a time, equal plain attention's rows, forward and
// backward, for both zig-zag block sizes and N = 1..4.
TYPED_TEST(AttentionTest, ZigzagBlocksMergedEqualPlain) {
  using S = TypeParam;
  const int64_t D = 8, Dv = 6;
  for (int64_t N = 1; N <= 4; ++N) {
    const int64_t T = 8 * N;
    std::mt19937_64 gen(static_cast<uint64_t>(N));
    const Mat<S> q = randn<S>(T, D, gen), k = randn<S>(T, D, gen), v = randn<S>(T, Dv, gen);
    const Mat<S> dout = randn<S>(T, Dv, gen);
    const S scale = S(1) / std::sqrt(S(D));
    for (int64_t block : {T / (2 * N), int64_t(1)}) {
      for (bool causal : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "N " << N << " block " << block << " causal " << causal);
        const auto plain = attention_forward<S>(q, k, v, scale, causal);
        const auto grads = attention_backward<S>(q, k, v, dout, scale, causal);
        const auto deal = zigzag(T, N, block);
        Mat<S> dk_sum = Mat<S>::Zero(T, D), dv_sum = Mat<S>::Zero(T, Dv);
        Mat<S> dk_merge = Mat<S>::Zero(T, D), dv_merge = Mat<S>::Zero(T, Dv);
        for (int64_t r = 0; r < N; ++r) {
          const Positions& qp = deal[static_cast<size_t>(r)];
          const Mat<S> qr = rows(q, qp), dr = rows(dout, qp);
          // Forward: blocks in ring order r, r-1, ..., merged as they arrive.
          std::vector<AttnPartial<S>> parts, running;
          std::vector<int64_t> src;
          for (int64_t step = 0; step < N; ++step) {
            const int64_t s = (r - step + N) % N;
            const Positions& kp = deal[static_cast<size_t>(s)];
            parts.push_back(attention_block_forward<S>(qr, rows(k, kp), rows(v, kp), scale, causal, qp, kp));
            running.push_back(step == 0 ? parts.back() : attention_merge(running.back(), parts.back()));
            src.push_back(s);
          }
          const AttnPartial<S>& fin = running.back();
          EXPECT_LT(rel(fin.o, rows(plain.o, qp)), tol<S>());
          Vec<S> lse_plain(static_cast<int64_t>(qp.size()));
          for (size_t i = 0; i < qp.size(); ++i) lse_plain(static_cast<int64_t>(i)) = plain.lse(qp[i]);
          EXPECT_LT(rel(fin.lse, lse_plain), tol<S>());

          // Backward 1 (the ring's): every block with the final (o, lse) and dlse = 0.
          Mat<S> dq = Mat<S>::Zero(qr.rows(), D);
          for (int64_t step = 0; step < N; ++step) {
            const Positions& kp = deal[static_cast<size_t>(src[static_cast<size_t>(step)])];
            const auto g = attention_block_backward<S>(qr, rows(k, kp), rows(v, kp), fin.o, fin.lse, dr, Vec<S>(),
                                                       scale, causal, qp, kp);
            dq += g.dq;
            for (size_t j = 0; j < kp.size(); ++j) {
              dk_sum.row(kp[j]) += g.dk.row(static_cast<int64_t>(j));
              dv_sum.row(kp[j]) += g.dv.row(static_cast<int64_t>(j));
            }
          }
          EXPECT_LT(rel(dq, rows(grads.dq, qp)), tol<S>());

          // Backward 2: the chain of merges undone one by one, each block with its own (o, lse).
          Mat<S> d_run = dr;
          Vec<S> dl_run = Vec<S>::Zero(qr.rows());
          Mat<S> dq2 = Mat<S>::Zero(qr.rows(), D);
          for (int64_t step = N - 1; step >= 0; --step) {
            Mat<S> d_part = d_run;
            Vec<S> dl_part = dl_run;
            if (step > 0) {
              const auto mg = attention_merge_backward(running[static_cast<size_t>(step - 1)],
                                                       parts[static_cast<size_t>(step)],
                                                       running[static_cast<size_t>(step)], d_run, dl_run);
              d_part = mg.do_b;
              dl_part = mg.dlse_b;
              d_run = mg.do_a;
              dl_run = mg.dlse_a;
            }
            const Positions& kp = deal[static_cast<size_t>(src[static_cast<size_t>(step)])];
            const auto& p = parts[static_cast<size_t>(step)];
            const auto g = attention_block_backward<S>(qr, rows(k, kp), rows(v, kp), p.o, p.lse, d_part, dl_part,
                                                       scale, causal, qp, kp);
            dq2 += g.dq;
            for (size_t j = 0; j < kp.size(); ++j) {
              dk_merge.row(kp[j]) += g.dk.row(static_cast<int64_t>(j));
              dv_merge.row(kp[j]) += g.dv.row(static_cast<int64_t>(j));
            }
          }
          EXPECT_LT(rel(dq2, rows(grads.dq, qp)), tol<S>());
        }
        EXPECT_LT(rel(dk_sum, grads.dk), tol<S>());
        EXPECT_LT(rel(dv_sum, grads.dv), tol<S>());
        EXPECT_LT(rel(dk_merge, grads.dk), tol<S>());
        EXPECT_LT(rel(dv_merge, grads.dv), tol<S>());
      }
    }
  }
}

// A causal block whose keys all lie after the queries: lse = -inf, o = 0, the merge is the
// identity and the backward gives zeros (no NaN anywhere).
TYPED_TEST(AttentionTest, RowsWithoutVisibleKeys) {
  using S = TypeParam;
  std::mt19937_64 gen(3);
  const Mat<S> q = randn<S>(4, 8, gen), k = randn<S>(4, 8, gen), v = randn<S>(4, 5, gen);
  const Positions early{0, 1, 2, 3}, late{4, 5, 6, 7};
  const auto none = attention_block_forward<S>(q, k, v, S(1), true, early, late);
  for (int64_t i = 0; i < 4; ++i) EXPECT_TRUE(std::isinf(none.lse(i)) && none.lse(i) < 0);
  EXPECT_EQ(none.o.norm(), S(0));
  const auto own = attention_block_forward<S>(q, k, v, S(1), true, early, early);
  const auto merged = attention_merge(own, none);
  EXPECT_EQ(rel(merged.o, own.o), 0.0);
  EXPECT_EQ(rel(merged.lse, own.lse), 0.0);
  const auto both_empty = attention_merge(none, none);
  EXPECT_TRUE(both_empty.o.allFinite());
  const Mat<S> dout = randn<S>(4, 5, gen);
  const auto g = attention_block_backward<S>(q, k, v, merged.o, merged.lse, dout, Vec<S>(), S(1), true, early, late);
  EXPECT_EQ(g.dq.norm() + g.dk.norm() + g.dv.norm(), S(0));
  const auto mg = attention_merge_backward<S>(own, none, merged, dout, Vec<S>::Ones(4));
  EXPECT_TRUE(mg.do_b.allFinite() && mg.dlse_b.allFinite());
  EXPECT_EQ(mg.do_b.norm(), S(0));
}

// The merge's and the block's backwards with a nonzero dlse, against central differences of
// f = sum(W o O) + sum(c o lse) (fp64 only).
TEST(AttentionGradients, MergeAndBlockBackwardMatchFiniteDifferences) {
  using S = double;
  std::mt19937_64 gen(7);
  const int64_t n = 5, m1 = 4, m2 = 6, D = 3, Dv = 4;
  Mat<S> q = randn<S>(n, D, gen), k1 = randn<S>(m1, D, gen), v1 = randn<S>(m1, Dv, gen);
  const Mat<S> k2 = randn<S>(m2, D, gen), v2 = randn<S>(m2, Dv, gen);
  const Mat<S> W = randn<S>(n, Dv, gen);
  const Vec<S> c = randn<S>(n, 1, gen);
  const Positions qp{3, 5, 7, 9, 11}, kp1{0, 4, 8, 12}, kp2{1, 2, 6, 10, 13, 14};
  const S scale = 0.7;
  auto f = [&](const Mat<S>& qq, const Mat<S>& kk1, const Mat<S>& vv1) {
    const auto a = attention_block_forward<S>(qq, kk1, vv1, scale, true, qp, kp1);
    const auto b = attention_block_forward<S>(qq, k2, v2, scale, true, qp, kp2);
    const auto mgd = attention_merge(a, b);
    return W.cwiseProduct(mgd.o).sum() + c.dot(mgd.lse);
  };
  const auto a = attention_block_forward<S>(q, k1, v1, scale, true, qp, kp1);
  const auto b = attention_block_forward<S>(q, k2, v2, scale, true, qp, kp2);
  const auto mgd = attention_merge(a, b);
  const auto mg = attention_merge_backward(a, b, mgd, W, c);
  const auto ga = attention_block_backward<S>(q, k1, v1, a.o, a.lse, mg.do_a, mg.dlse_a, scale, true, qp, kp1);
  const auto gb = attention_block_backward<S>(q, k2, v2, b.o, b.lse, mg.do_b, mg.dlse_b, scale, true, qp, kp2);
  const Mat<S> dq = ga.dq + gb.dq;
  const double h = 1e-6;
  auto numeric = [&](Mat<S>& x, int which) {
    Mat<S> g(x.rows(), x.cols());
    for (int64_t i = 0; i < x.rows(); ++i)
      for (int64_t j = 0; j < x.cols(); ++j) {
        const S keep = x(i, j);
        x(i, j) = keep + h;
        const double up = which == 0 ? f(x, k1, v1) : which == 1 ? f(q, x, v1) : f(q, k1, x);
        x(i, j) = keep - h;
        const double down = which == 0 ? f(x, k1, v1) : which == 1 ? f(q, x, v1) : f(q, k1, x);
        x(i, j) = keep;
        g(i, j) = (up - down) / (2 * h);
      }
    return g;
  };
  EXPECT_LT(rel(dq, numeric(q, 0)), 1e-7);
  EXPECT_LT(rel(ga.dk, numeric(k1, 1)), 1e-7);
  EXPECT_LT(rel(ga.dv, numeric(v1, 2)), 1e-7);
}

TEST(AttentionBadInput, NamesTheArgument) {
  using S = double;
  std::mt19937_64 gen(9);
  const Mat<S> q = randn<S>(4, 8, gen), k = randn<S>(5, 8, gen), v = randn<S>(5, 3, gen);
  using deltacp::test::expect_error;
  expect_error([&] { attention_forward<S>(q, randn<S>(5, 7, gen), v, 1.0, false); }, "k", "head dim 8");
  expect_error([&] { attention_forward<S>(q, k, randn<S>(4, 3, gen), 1.0, false); }, "v", "5 keys");
  expect_error([&] { attention_forward<S>(q, k, v, 1.0, true, Positions{0, 1}, {}); }, "qpos", "one position");
  expect_error([&] { attention_forward<S>(q, k, v, 1.0, true, {}, Positions{0}); }, "kpos", "one position");
  expect_error([&] { attention_backward<S>(q, k, v, randn<S>(4, 2, gen), 1.0, false); }, "dout", "4 x 3");
  const auto a = attention_forward<S>(q, k, v, 1.0, false);
  AttnPartial<S> b{randn<S>(3, 3, gen), Vec<S>::Zero(3)};
  expect_error([&] { attention_merge(a, b); }, "b", "4 x 3");
  expect_error([&] { attention_block_backward<S>(q, k, v, a.o, Vec<S>::Zero(2), a.o, Vec<S>(), 1.0, false, {}, {}); },
               "lse", "one value per query");
}
