// cuda/common/device_info.h — what the current GPU offers, for launchers that size grids and pick
// tile configurations (shared by the tiled forward and backward).
//
//   max_smem_optin()          dynamic shared memory one block may opt into (bytes)
//   sm_count()                streaming multiprocessors
//   ctas_per_sm(bytes, cap)   blocks of `bytes` dynamic shared memory one SM holds, at most `cap`
//                             (the launch bounds' limit); 1 KB per block is reserved by the runtime
//   opt_in_smem(kernel, bytes, arg, why...)   the kernel opted into `bytes` of dynamic shared memory, or an
//                             Error naming `arg` (why..., "; this GPU allows <limit>") past the GPU's limit
// Host-only header; errors throw deltacp::Error("cuda", ...) through DELTACP_CUDA_CHECK.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>

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

// Every launcher that needs more than the default 48 KB of dynamic shared memory: checked against the opt-in
// limit first (the message's parts are only joined when it is thrown), then set on the kernel.
template <class Kernel, class... Why>
void opt_in_smem(Kernel kernel, int64_t bytes, const char* arg, const Why&... why) {
  const int limit = max_smem_optin();
  if (bytes > limit) ::deltacp::throw_error(arg, why..., "; this GPU allows ", limit);
  DELTACP_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace deltacp::cuda
