// cuda/common/workspace_pool.h — stream-ordered scratch memory that stays mapped between calls.
//
//   void* ws = workspace_alloc(bytes, stream);   // throws deltacp::Error("cuda", ...) when out of memory
//   ... kernels on `stream` use ws ...
//   workspace_free(ws, stream);                  // stream-ordered: the kernels finish first
//
// Why not plain cudaMallocAsync: it draws from the device's default memory pool, whose release
// threshold is 0, so at every synchronisation the pool hands its unused memory back to the driver
// and the next call maps it again. The tiled backward's workspace at (1, 32768, 16, 128) is about
// 1.5 GB; a training step synchronises between calls, and on 2x H200 (2026-11-22) a synchronised
// forward + backward took 32.8 ms of wall time around 19.3 ms of kernels. This pool (one per device,
// created on first use) keeps what it has mapped, like torch's caching allocator, and leaves the
// default pool (which other libraries may use) alone. release_workspace_memory() hands the cached
// memory back (deltacp.cuda_release_workspace() in Python).
// Host-only header (CUDA runtime API); one pool per device per process (C++17 inline statics).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "check.h"

namespace deltacp::cuda {

namespace detail {
struct WorkspacePools {
  std::mutex mutex;
  std::vector<cudaMemPool_t> pools;  // by device ordinal; nullptr until first used
};
inline WorkspacePools& workspace_pools() {
  static WorkspacePools p;  // never destroyed before the process's last CUDA call that uses it
  return p;
}
}  // namespace detail

// The pool of the current device, created on first use with "keep everything" as release threshold.
inline cudaMemPool_t workspace_pool() {
  int device = 0;
  DELTACP_CUDA_CHECK(cudaGetDevice(&device));
  auto& all = detail::workspace_pools();
  std::lock_guard<std::mutex> lock(all.mutex);
  if (static_cast<int>(all.pools.size()) <= device) all.pools.resize(device + 1, nullptr);
  if (!all.pools[device]) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    DELTACP_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
    uint64_t keep = UINT64_MAX;
    DELTACP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    all.pools[device] = pool;
  }
  return all.pools[device];
}

// Throws deltacp::OutOfMemory (Python: deltacp.OutOfMemoryError) saying what was asked and what is
// free when the allocation does not fit.
inline void* workspace_alloc(size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return nullptr;
  void* ptr = nullptr;
  const cudaError_t err = cudaMallocFromPoolAsync(&ptr, bytes, workspace_pool(), stream);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // not sticky: clear it so a later check does not report it again
    size_t free_b = 0, total_b = 0;
    (void)cudaMemGetInfo(&free_b, &total_b);
    uint64_t cached = 0;
    (void)cudaMemPoolGetAttribute(workspace_pool(), cudaMemPoolAttrReservedMemCurrent, &cached);
    const double GiB = 1024.0 * 1024.0 * 1024.0;
    ::deltacp::throw_error_as<::deltacp::OutOfMemory>(
        "cuda", "out of device memory for the kernels' workspace: requested ", bytes, " bytes (",
        bytes / GiB, " GiB), free on the device ", free_b, " bytes (", free_b / GiB, " GiB) of ", total_b,
        " (", total_b / GiB, " GiB); deltacp's workspace pool holds ", cached,
        " bytes (deltacp.cuda_release_workspace() hands its unused part back)");
  }
  if (err != cudaSuccess) ::deltacp::cuda::detail::throw_cuda_error(err, "cudaMallocFromPoolAsync", __FILE__, __LINE__);
  return ptr;
}

// Stream-ordered free; errors are left to the next checked call (this runs in destructors).
inline void workspace_free(void* ptr, cudaStream_t stream) noexcept {
  if (ptr) (void)cudaFreeAsync(ptr, stream);
}

// Hands every device's cached, unused workspace memory back to the driver (after a device sync, so
// pending stream-ordered frees have landed). A no-op when no pool was ever created.
inline void release_workspace_memory() {
  auto& all = detail::workspace_pools();
  std::lock_guard<std::mutex> lock(all.mutex);
  bool any = false;
  for (cudaMemPool_t pool : all.pools) any = any || pool != nullptr;
  if (!any) return;  // nothing was ever allocated (also: no device at all)
  int current = 0;
  DELTACP_CUDA_CHECK(cudaGetDevice(&current));
  for (size_t d = 0; d < all.pools.size(); ++d) {
    if (!all.pools[d]) continue;
    DELTACP_CUDA_CHECK(cudaSetDevice(static_cast<int>(d)));
    DELTACP_CUDA_CHECK(cudaDeviceSynchronize());
    DELTACP_CUDA_CHECK(cudaMemPoolTrimTo(all.pools[d], 0));
  }
  DELTACP_CUDA_CHECK(cudaSetDevice(current));
}

}  // namespace deltacp::cuda
