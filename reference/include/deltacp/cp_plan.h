// deltacp/cp_plan.h — how a packed varlen batch (B = 1, global cu_seqlens) is cut across ranks.
//
// Pure host logic shared by the simulated CP of the reference and the real CP over NCCL in
// distributed/: rank r holds the global tokens [begin_r, end_r). A sequence cut by a rank
// boundary continues on the next rank; the rank's FIRST local segment may continue a sequence
// from earlier ranks and its LAST local segment may continue into later ranks.
#pragma once

#include <cstdint>
#include <vector>

namespace deltacp {

struct CpRankPlan {
  int rank = 0, world = 1;
  int64_t begin = 0, end = 0;        // global token range [begin, end)
  std::vector<int64_t> cu_seqlens;   // rank-local offsets, [0, ..., end - begin]
  std::vector<int64_t> seq_ids;      // global sequence index of each local segment
  int64_t pre_ranks = 0;             // earlier ranks holding part of the first segment's sequence
  int64_t post_ranks = 0;            // later ranks holding part of the last segment's sequence
  bool first_continues() const { return pre_ranks > 0; }  // first segment started on an earlier rank
  bool last_continues() const { return post_ranks > 0; }  // last segment goes on to a later rank
  int64_t num_local_seqs() const { return static_cast<int64_t>(seq_ids.size()); }
  int64_t local_tokens() const { return end - begin; }
};

// Ranks cut at the given global token positions: cuts strictly increasing inside (0, T), so there
// are cuts.size() + 1 ranks, none empty. Throws deltacp::Error naming 'cuts' or 'cu_seqlens'.
std::vector<CpRankPlan> cp_plan_from_cuts(const std::vector<int64_t>& cu_seqlens, const std::vector<int64_t>& cuts);

// Equal split as torch/FLA do it: T must be divisible by world (each rank T / world tokens);
// otherwise throws deltacp::Error naming 'cu_seqlens' with T and world in the message.
std::vector<CpRankPlan> cp_plan_even(const std::vector<int64_t>& cu_seqlens, int world);

// Validates global cu_seqlens (starts at 0, non-decreasing, ends at T). Throws naming 'cu_seqlens'.
void check_cu_seqlens(const int64_t* cu, int64_t count, int64_t T);

}  // namespace deltacp
