// cuda/common/seq_bounds.h — host-side sequence bounds of a (validated) Params.
//
// Sequence n of a batch lives on row `batch` of the [B, T] time axis, tokens [begin, end):
//   fixed-length batch:  batch = n, begin = 0, end = T
//   varlen (B == 1):     batch = 0, begin = cu_seqlens_host[n], end = cu_seqlens_host[n + 1]
// The flat token index used by workspaces ([B * T, ...] row-major) of token t on row b is b * T + t.
//
// GPU launchers size grids, checkpoint tables and scratch from these bounds; they read only
// p.cu_seqlens_host (never the device array p.cu_seqlens). Host-only header.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "deltacp/error.h"
#include "deltacp/params.h"

namespace deltacp::cuda {

struct SeqBounds {
  int64_t batch = 0;  // row of the [B, T] time axis
  int64_t begin = 0;  // first token on that row
  int64_t end = 0;    // one past the last token
  int64_t length() const { return end - begin; }
  int64_t flat_begin(int64_t T) const { return batch * T + begin; }  // first row in a [B * T] workspace
};

// Bounds of every sequence; p must be validated (varlen needs p.cu_seqlens_host).
inline std::vector<SeqBounds> sequence_bounds(const Params& p) {
  std::vector<SeqBounds> out(static_cast<size_t>(p.num_seqs));
  if (p.varlen()) {
    DELTACP_CHECK(p.cu_seqlens_host != nullptr, "cu_seqlens_host",
                  "expected a host copy of cu_seqlens for a varlen batch on the GPU, got none");
    for (int64_t n = 0; n < p.num_seqs; ++n) out[n] = {0, p.cu_seqlens_host[n], p.cu_seqlens_host[n + 1]};
  } else {
    for (int64_t n = 0; n < p.num_seqs; ++n) out[n] = {n, 0, p.T};
  }
  return out;
}

// Length of the longest sequence (0 when every sequence is empty).
inline int64_t max_sequence_length(const std::vector<SeqBounds>& bounds) {
  int64_t m = 0;
  for (const SeqBounds& s : bounds) m = std::max(m, s.length());
  return m;
}

}  // namespace deltacp::cuda
