// cuda/fused/fused_windows.h — the fused forward's windows along time (host only): where a call's workspace
// (W, U, P, G and the row scales: 652 bytes per token and value head at K = V = 128, bf16, growing with the
// tokens) would pass a budget, the forward runs as windows of whole chunks, one after another, each from the
// fp32 state the last one left, so the workspace is bounded by the window however long the input is.
//
//   fixed-length batches: every batch row's tokens [t0, t1), t0 and t1 multiples of the chunk size (or T);
//   packed varlen batches (cu_seqlens): ranges [t0, t1) of the packed axis. A boundary inside a sequence sits
//   at a chunk start of that sequence (bos + a multiple of the chunk size), so every window's chunks are the
//   whole call's chunks; a window's segments are the sequences that meet it, the first one perhaps entered
//   with the state the previous window left (continues_in), the last perhaps leaving its state to the next
//   (continues_out). An empty sequence belongs to the window whose range holds its offset (the last window
//   takes those at the end).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace deltacp::cuda::fused {

struct FusedWindow {
  int64_t t0 = 0, t1 = 0;          // the window's tokens on the packed axis
  int64_t seq_first = 0;           // its segments are the sequences seq_first .. seq_first + cu.size() - 2
  std::vector<int64_t> cu;         // the segments' offsets relative to t0: cu[0] = 0, cu.back() = t1 - t0
  bool continues_in = false;       // its first segment starts before t0 (a sequence cut by the last boundary)
  bool continues_out = false;      // its last segment ends after t1
};

// Windows of at most about `window` tokens over a packed batch of N sequences (cu: N + 1 host offsets, cu[0] = 0,
// non-decreasing). Each window holds at least one whole chunk, so a window of fewer tokens than the chunk size
// still advances.
inline std::vector<FusedWindow> plan_varlen_windows(const int64_t* cu, int64_t N, int64_t window, int chunk_size) {
  std::vector<FusedWindow> out;
  const int64_t T = cu[N];
  const int64_t cs = chunk_size;
  int64_t t0 = 0, s = 0;  // s: the first sequence that meets the window (its end is past t0, or it is empty at t0)
  while (true) {
    // The end: t0 + window, moved back to a chunk start of the sequence it falls in (at least one chunk on).
    int64_t t1 = std::min(T, t0 + std::max<int64_t>(window, 1));
    if (t1 < T) {
      int64_t j = static_cast<int64_t>(std::upper_bound(cu, cu + N + 1, t1) - cu) - 1;  // cu[j] <= t1 < cu[j + 1]
      j = std::min(j, N - 1);
      const int64_t bos = cu[j];
      int64_t cut = bos + (t1 - bos) / cs * cs;
      if (cut <= t0) cut = std::min(cu[j + 1], std::max(t0, bos) + cs);  // t0 lies in sequence j: one chunk on
      t1 = cut;
    }
    FusedWindow w;
    w.t0 = t0;
    w.t1 = t1;
    w.seq_first = s;
    w.cu.push_back(0);
    w.continues_in = cu[s] < t0;
    int64_t n = s;
    // Sequences that meet [t0, t1): start before t1, or empty at t1 == T (the last window takes them).
    while (n < N && (cu[n] < t1 || (t1 == T && cu[n] == T))) {
      w.cu.push_back(std::min(cu[n + 1], t1) - t0);
      ++n;
    }
    w.continues_out = n > s && cu[n] > t1;
    out.push_back(w);
    if (t1 >= T) break;
    // The next window's first sequence: the last one here if it goes on, else the next.
    s = w.continues_out ? n - 1 : n;
    t0 = t1;
  }
  return out;
}

}  // namespace deltacp::cuda::fused
