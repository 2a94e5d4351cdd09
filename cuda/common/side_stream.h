// cuda/common/side_stream.h — a second stream for work that runs beside the caller's.
//
//   side_stream()          the current device's stream of the highest priority (non-blocking; created once per
//                          device, kept for the process). Its CTAs are placed before those queued at a lower
//                          priority, so the serial chain given to it takes its SMs first and the token-parallel
//                          work beside it fills the rest (the fused forward's windows, the tiled backward's dh
//                          scan beside the recompute's state scan).
//   ForkJoin               a fork of the side stream from the caller's (it waits for all queued there) and the
//                          join back, also on an exception.
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

// A fork of `side` from `main` (side waits for everything queued on main so far) and the join back (main waits
// for everything queued on side): join() checks the two calls; the destructor joins when join() did not run or
// failed (an exception between the two), so that whatever main frees afterwards, stream-ordered, outlives the
// side stream's use of it. A pending event may be destroyed: its resources go once it completes.
class ForkJoin {
 public:
  ForkJoin(cudaStream_t main, cudaStream_t side) : main_(main), side_(side) {
    DELTACP_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    const cudaError_t err = cudaEventCreateWithFlags(&join_, cudaEventDisableTiming);
    if (err != cudaSuccess) {
      (void)cudaEventDestroy(fork_);
      DELTACP_CUDA_CHECK(err);
    }
    const cudaError_t rec = cudaEventRecord(fork_, main_);
    const cudaError_t wait = rec == cudaSuccess ? cudaStreamWaitEvent(side_, fork_, 0) : rec;
    if (wait != cudaSuccess) {
      destroy();
      DELTACP_CUDA_CHECK(wait);
    }
  }
  void join() {
    DELTACP_CUDA_CHECK(cudaEventRecord(join_, side_));
    DELTACP_CUDA_CHECK(cudaStreamWaitEvent(main_, join_, 0));
    joined_ = true;
  }
  ~ForkJoin() {
    if (!joined_ && cudaEventRecord(join_, side_) == cudaSuccess) (void)cudaStreamWaitEvent(main_, join_, 0);
    destroy();
  }
  ForkJoin(const ForkJoin&) = delete;
  ForkJoin& operator=(const ForkJoin&) = delete;

 private:
  void destroy() {
    (void)cudaEventDestroy(fork_);
    (void)cudaEventDestroy(join_);
  }
  cudaStream_t main_, side_;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  bool joined_ = false;
};

}  // namespace deltacp::cuda
