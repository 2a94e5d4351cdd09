// cuda/common/side_stream.h — a second stream for work that runs beside the caller's.
//
//   side_stream()          the current device's stream of the highest priority (non-blocking; created once per
//                          device, kept for the process). Its CTAs are placed before those queued at a lower
//                          priority, so the serial chain given to it takes its SMs first and the token-parallel
//                          work beside it fills the rest (the fused forward's windows, the tiled backward's dh
//                          scan beside the recompute's state scan).
// One per device for the process: callers on several threads share it (correct, by events; their work on it
// is ordered, so two callers' side work does not overlap). The callers keep their work on the caller's stream
// while it is captured into a CUDA graph (tiled/chunk_table.cuh stream_capturing), so that a captured graph
// holds no fork they did not ask for.
// Host-only.
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <vector>

#include "check.h"

namespace deltacp::cuda {

inline cudaStream_t side_stream() {
  static std::mutex mutex;
  static std::vector<cudaStream_t> streams;
  int dev = 0;
  DELTACP_CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<int>(streams.size()) <= dev) streams.resize(static_cast<size_t>(dev) + 1, nullptr);
  if (streams[static_cast<size_t>(dev)] == nullptr) {
    int lo = 0, hi = 0;
    DELTACP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    DELTACP_CUDA_CHECK(cudaStreamCreateWithPriority(&streams[static_cast<size_t>(dev)], cudaStreamNonBlocking, hi));
  }
  return streams[static_cast<size_t>(dev)];
}

}  // namespace deltacp::cuda
