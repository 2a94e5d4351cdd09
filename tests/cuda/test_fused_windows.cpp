// Host-only (no GPU needed, so CI runs it): the fused forward's windows along a packed batch
// (cuda/fused/fused_windows.h). For random packed batches, with empty sequences, sequences shorter and longer
// than a window, and windows shorter than a chunk:
//   - the windows tile [0, T) in order, none longer than the budget (or one chunk, when the budget is shorter);
//   - a boundary inside a sequence sits at a chunk start of that sequence, so the windows' chunks are the
//     whole call's chunks;
//   - every sequence's segments, window after window, add up to the sequence, each sequence (empty ones too)
//     starts in exactly one window, and continues_in / continues_out say where a sequence goes on.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "fused/fused_windows.h"

namespace {

using deltacp::cuda::fused::FusedWindow;
using deltacp::cuda::fused::plan_varlen_windows;

void check_plan(const std::vector<int64_t>& cu, int64_t window, int cs) {
  const int64_t N = static_cast<int64_t>(cu.size()) - 1, T = cu.back();
  const std::vector<FusedWindow> ws = plan_varlen_windows(cu.data(), N, window, cs);
  ASSERT_FALSE(ws.empty());
  std::vector<int64_t> covered(static_cast<size_t>(N), 0), starts(static_cast<size_t>(N), 0);
  int64_t t = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    const FusedWindow& w = ws[i];
    SCOPED_TRACE("window " + std::to_string(i) + " [" + std::to_string(w.t0) + ", " + std::to_string(w.t1) + ")");
    EXPECT_EQ(w.t0, t);
    EXPECT_LE(w.t1 - w.t0, std::max<int64_t>(window, cs));
    if (T > 0) EXPECT_GT(w.t1, w.t0);
    t = w.t1;
    ASSERT_GE(w.cu.size(), 1u);
    EXPECT_EQ(w.cu.front(), 0);
    EXPECT_EQ(w.cu.back(), w.t1 - w.t0);
    for (size_t j = 0; j + 1 < w.cu.size(); ++j) {
      const int64_t n = w.seq_first + static_cast<int64_t>(j);
      ASSERT_LT(n, N);
      const int64_t a = w.t0 + w.cu[j], b = w.t0 + w.cu[j + 1];
      EXPECT_LE(a, b);
      EXPECT_EQ(a, j == 0 && w.continues_in ? w.t0 : cu[n]) << "sequence " << n << "'s segment starts wrong";
      EXPECT_EQ(b, std::min(cu[n + 1], w.t1)) << "sequence " << n << "'s segment ends wrong";
      EXPECT_EQ((a - cu[n]) % cs, 0) << "a boundary inside sequence " << n << " is not at one of its chunk starts";
      covered[static_cast<size_t>(n)] += b - a;
      if (a == cu[n]) ++starts[static_cast<size_t>(n)];
    }
    const int64_t lastn = w.seq_first + static_cast<int64_t>(w.cu.size()) - 2;
    if (w.cu.size() >= 2) {
      EXPECT_EQ(w.continues_in, cu[w.seq_first] < w.t0);
      EXPECT_EQ(w.continues_out, cu[lastn + 1] > w.t1);
    }
    if (i + 1 < ws.size()) EXPECT_EQ(ws[i + 1].continues_in, w.continues_out);
  }
  EXPECT_EQ(t, T);
  for (int64_t n = 0; n < N; ++n) {
    EXPECT_EQ(covered[static_cast<size_t>(n)], cu[n + 1] - cu[n]) << "sequence " << n;
    EXPECT_EQ(starts[static_cast<size_t>(n)], 1) << "sequence " << n << " should start in exactly one window";
  }
}

TEST(FusedWindows, RandomPackedBatches) {
  std::mt19937_64 rng(20261125);
  for (int trial = 0; trial < 400; ++trial) {
    const int cs = trial % 3 == 0 ? 16 : 64;
    const int64_t N = 1 + static_cast<int64_t>(rng() % 12);
    std::vector<int64_t> cu{0};
    for (int64_t n = 0; n < N; ++n) {
      const uint64_t kind = rng() % 4;  // empty, short, around a window, long
      const int64_t len = kind == 0 ? 0 : kind == 1 ? 1 + rng() % 70 : kind == 2 ? 100 + rng() % 300 : 500 + rng() % 2000;
      cu.push_back(cu.back() + len);
    }
    const int64_t window = trial % 5 == 0 ? 1 + static_cast<int64_t>(rng() % cs) : 64 + static_cast<int64_t>(rng() % 700);
    SCOPED_TRACE("trial " + std::to_string(trial));
    check_plan(cu, window, cs);
  }
}

TEST(FusedWindows, EdgeCases) {
  check_plan({0, 1000}, 256, 64);              // one sequence over four windows
  check_plan({0, 0, 0, 300, 300}, 128, 64);    // empty sequences at the start and the end
  check_plan({0, 64, 128, 192}, 64, 64);       // boundaries that are sequence boundaries too
  check_plan({0, 100, 100, 230}, 100, 64);     // an empty sequence exactly at a window's end
  check_plan({0, 5000}, 10, 64);               // a budget shorter than a chunk: a chunk a window
}

}  // namespace
