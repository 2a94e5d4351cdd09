// cuda/common/device_info.h — what the current GPU offers, for launchers that size grids and pick
// tile configurations (shared by the tiled forward and backward).
//
//   max_smem_optin()          dynamic shared memory one block may opt into (bytes)
//   sm_count()                streaming multiprocessors
//   ctas_per_sm(bytes, cap)   blocks of `bytes` dynamic shared memory one SM holds, at most `cap`
//                             (the launch bounds' limit); 1 KB per block is reserved by the runtime
//   opt_in_smem(kernel, bytes, arg, why...)   the kernel opted into `bytes` of dynamic shared memory, or an
//                             Error naming `arg` (why..., "; this GPU allows <limit>") past the GPU's limit
//   allow_dynamic_smem(kernel, bytes)   cudaFuncSetAttribute's opt-in, raised only when a launch needs more
// Host-only header; errors throw deltacp::Error("cuda", ...) through DELTACP_CUDA_CHECK.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <map>
#include <mutex>
#include <utility>

#include "check.h"

namespace deltacp::cuda {

inline int device_attribute(cudaDeviceAttr attr) {
  int dev = 0, value = 0;
  DELTACP_CUDA_CHECK(cudaGetDevice(&dev));
  DELTACP_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, dev));
  return value;
}
inline int max_smem_optin() { return device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin); }
inline int sm_count() { return device_attribute(cudaDevAttrMultiProcessorCount); }
inline int ctas_per_sm(size_t bytes, int cap = 32) {
  const int per_sm = device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor);
  return std::max(1, std::min(cap, static_cast<int>(per_sm / (bytes + 1024))));
}

// The opt-in into at least `bytes` of dynamic shared memory, for the kernel on the current device. The runtime keeps
// the attribute for the life of the context and any launch up to it runs, so each (device, kernel) is raised only
// when a launch needs more than it was given (never lowered: a lower value would refuse a later, larger launch).
// A training step launches the same kernels every call, and the runtime call costs host time on the launch path.
inline void allow_dynamic_smem(const void* kernel, int bytes) {
  int dev = 0;
  DELTACP_CUDA_CHECK(cudaGetDevice(&dev));
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> given;
  std::lock_guard<std::mutex> lock(mutex);
  int& now = given[{dev, kernel}];  // 0 when new
  if (bytes <= now) return;
  DELTACP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  now = bytes;
}
template <class Kernel>
void allow_dynamic_smem(Kernel kernel, size_t bytes) {
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), static_cast<int>(bytes));
}

// Every launcher that needs more than the default 48 KB of dynamic shared memory: checked against the opt-in
// limit first (the message's parts are only joined when it is thrown), then set on the kernel.
template <class Kernel, class... Why>
void opt_in_smem(Kernel kernel, int64_t bytes, const char* arg, const Why&... why) {
  const int limit = max_smem_optin();
  if (bytes > limit) ::deltacp::throw_error(arg, why..., "; this GPU allows ", limit);
  allow_dynamic_smem(kernel, static_cast<size_t>(bytes));
}

}  // namespace deltacp::cuda
