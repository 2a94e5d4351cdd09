// Cutting a packed batch across CP ranks (see deltacp/cp_plan.h).
#include "deltacp/cp_plan.h"

#include <algorithm>

#include "deltacp/error.h"

namespace deltacp {
namespace {

// Rank holding global token t, given rank starts `begins` (sorted, begins[0] == 0).
int rank_of(const std::vector<int64_t>& begins, int64_t t) {
  return static_cast<int>(std::upper_bound(begins.begin(), begins.end(), t) - begins.begin()) - 1;
}

}  // namespace

std::vector<CpRankPlan> cp_plan_from_cuts(const std::vector<int64_t>& cu, const std::vector<int64_t>& cuts) {
  DELTACP_CHECK(!cu.empty(), "cu_seqlens", "expected at least [0, T], got an empty array");
  const int64_t T = cu.back();
  check_cu_seqlens(cu.data(), static_cast<int64_t>(cu.size()), T);
  for (size_t i = 0; i < cuts.size(); ++i) {
    DELTACP_CHECK(cuts[i] > 0 && cuts[i] < T, "cuts", "expected every cut inside (0, T = ", T, "), got cuts[", i,
                  "] = ", cuts[i]);
    if (i > 0)
      DELTACP_CHECK(cuts[i] > cuts[i - 1], "cuts", "expected strictly increasing cuts, got cuts[", i, "] = ", cuts[i],
                    " after ", cuts[i - 1]);
  }
  const int world = static_cast<int>(cuts.size()) + 1;
  std::vector<int64_t> begins{0};
  begins.insert(begins.end(), cuts.begin(), cuts.end());

  std::vector<CpRankPlan> plans(world);
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
  for (int r = 0; r < world; ++r) {
    CpRankPlan& pl = plans[r];
    pl.rank = r;
    pl.world = world;
    pl.begin = begins[r];
    pl.end = r + 1 < world ? begins[r + 1] : T;
    pl.cu_seqlens.push_back(0);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t lo = std::max(cu[n], pl.begin), hi = std::min(cu[n + 1], pl.end);
      if (hi <= lo) continue;  // no tokens of sequence n here (empty sequences belong to no rank)
      pl.seq_ids.push_back(n);
      pl.cu_seqlens.push_back(hi - pl.begin);
    }
    if (!pl.seq_ids.empty()) {
      const int64_t first = pl.seq_ids.front(), last = pl.seq_ids.back();
      pl.pre_ranks = r - rank_of(begins, cu[first]);
      pl.post_ranks = rank_of(begins, cu[last + 1] - 1) - r;
    }
  }
  return plans;
}

std::vector<CpRankPlan> cp_plan_even(const std::vector<int64_t>& cu, int world) {
  DELTACP_CHECK(world >= 1, "world", "expected a world size >= 1, got ", world);
  DELTACP_CHECK(!cu.empty(), "cu_seqlens", "expected at least [0, T], got an empty array");
  const int64_t T = cu.back();
  DELTACP_CHECK(T % world == 0, "cu_seqlens",
                "expected the total token count T divisible by the CP world size (each rank holds T / world "
                "tokens; pad the packed batch), got T = ",
                T, ", world = ", world);
  DELTACP_CHECK(T >= world, "cu_seqlens", "expected at least one token per rank, got T = ", T, ", world = ", world);
  std::vector<int64_t> cuts;
  for (int r = 1; r < world; ++r) cuts.push_back(T / world * r);
  return cp_plan_from_cuts(cu, cuts);
}

}  // namespace deltacp
