// cuda/common/workspace_pool.h — stream-ordered scratch memory for the kernels, from one process-wide
// allocator: deltacp's own pool by default, or the caller's (torch's caching allocator, installed by
// the Python package).
//
//   void* ws = workspace_alloc(bytes, stream);   // throws deltacp::OutOfMemory when it does not fit
//   ... kernels on `stream` use ws ...
//   workspace_free(ws, stream);                  // stream-ordered: the kernels finish first
//
// The allocator hook. set_workspace_allocator(&{alloc, free, ctx, name}) routes every later
// workspace_alloc to alloc(bytes, stream, ctx) and its workspace_free to free(ptr, stream, ctx); nullptr
// restores the pool. Each
// live allocation remembers the allocator that made it, so a block is always handed back to its own
// allocator, also across a switch. The hook's contract is that of a stream-ordered caching allocator
// (torch's): a block freed on the stream it was allocated on may be reused at once by later work on that
// stream, which the stream orders after the kernels that used it. A block freed on another stream than
// its own is made safe here: the allocation's stream first waits (an event) for the freeing stream's
// work, then the block goes back on its own stream. alloc throws deltacp::OutOfMemory (with the bytes
// requested and free) or deltacp::Error("cuda", ...); free must not throw.
//
// Why a hook: inside a torch training step every other tensor comes from torch's caching allocator;
// memory that deltacp's pool keeps after a call is memory torch cannot reuse for the next layer's
// activations. Measured on H200 (bf16 GDN forward + backward at (2, 16384, 16, 128)): 515 MiB through
// torch plus 3,234 MiB kept by the pool (KDA: 769 + 4,386 MiB), against FLA's 1,863 MiB (3,596 MiB)
// peak. With the hook, deltacp's workspaces are torch blocks: they count in
// torch.cuda.max_memory_allocated, and what one stage frees the next layer reuses.
//
// The default pool (no hook: the C++ API, tests and benchmarks without torch). Plain cudaMallocAsync
// draws from the device's default memory pool, whose release threshold is 0, so at every
// synchronisation it hands its unused memory back to the driver and the next call maps it again: on 2x
// H200 (2026-11-22) a synchronised forward + backward took 32.8 ms of wall time around 19.3 ms of
// kernels. This pool (one per device, created on first use) keeps what it has mapped ("keep
// everything" release threshold), like torch's caching allocator, and leaves the default pool (which
// other libraries may use) alone. release_workspace_memory() hands the cached memory back
// (deltacp.cuda_release_workspace() in Python).
//
// Accounting: workspace_stats() gives the bytes in use outside the hook (the pool's blocks) and their
// high-water mark, the pool's mapped bytes and their high-water mark, and the same in-use numbers for
// the hook's blocks (those are already inside torch's own statistics); reset_workspace_peaks() starts
// the high-water marks again from the current values (deltacp.cuda_workspace_stats() in Python).
// Host-only header (CUDA runtime API); one pool per device and one hook per process (C++17 inline
// statics, in the one binary that links deltacp_cuda statically).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "check.h"

namespace deltacp::cuda {

// A stream-ordered allocator for the workspaces (see above); ctx is handed to both calls. name: what
// workspace_stats reports.
struct WorkspaceAllocator {
  void* (*alloc)(size_t bytes, cudaStream_t stream, void* ctx) = nullptr;
  void (*free)(void* ptr, cudaStream_t stream, void* ctx) noexcept = nullptr;
  void* ctx = nullptr;
  const char* name = "pool";
};

struct WorkspaceStats {
  const char* allocator = "pool";  // where new workspaces come from now
  uint64_t current_bytes = 0;      // in use now from deltacp's own pool (outside any hook)
  uint64_t peak_bytes = 0;         // high-water mark of current_bytes since the last reset
  uint64_t reserved_bytes = 0;     // mapped by deltacp's pools now (in use + cached), every device
  uint64_t peak_reserved_bytes = 0;  // high-water mark of the pools' mapped bytes since the last reset
  uint64_t hooked_current_bytes = 0;  // in use now from the hook (torch's blocks)
  uint64_t hooked_peak_bytes = 0;     // high-water mark of hooked_current_bytes since the last reset
};

namespace detail {
struct WorkspacePools {
  std::mutex mutex;
  std::vector<cudaMemPool_t> pools;  // by device ordinal; nullptr until first used
};
inline WorkspacePools& workspace_pools() {
  static WorkspacePools p;  // never destroyed before the process's last CUDA call that uses it
  return p;
}

struct LiveBlock {
  size_t bytes = 0;
  cudaStream_t stream = nullptr;  // the stream it was allocated on
  const WorkspaceAllocator* from = nullptr;  // nullptr: the pool
};
struct WorkspaceBook {
  std::mutex mutex;  // never held while an allocator runs (the hook may take the GIL)
  const WorkspaceAllocator* hook = nullptr;
  std::unordered_map<void*, LiveBlock> live;
  uint64_t pool_current = 0, pool_peak = 0, hook_current = 0, hook_peak = 0;
};
inline WorkspaceBook& workspace_book() {
  static WorkspaceBook* b = new WorkspaceBook;  // leaked on purpose: frees may run during process exit
  return *b;
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

// Routes later workspace allocations to `a` (which must outlive every block it hands out);
// nullptr restores deltacp's pool.
inline void set_workspace_allocator(const WorkspaceAllocator* a) {
  auto& book = detail::workspace_book();
  std::lock_guard<std::mutex> lock(book.mutex);
  book.hook = a;
}

namespace detail {
// From deltacp's pool; throws deltacp::OutOfMemory saying what was asked and what is free.
inline void* pool_alloc(size_t bytes, cudaStream_t stream) {
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
}  // namespace detail

inline void* workspace_alloc(size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return nullptr;
  auto& book = detail::workspace_book();
  const WorkspaceAllocator* hook = nullptr;
  {
    std::lock_guard<std::mutex> lock(book.mutex);
    hook = book.hook;
  }
  void* ptr = hook ? hook->alloc(bytes, stream, hook->ctx) : detail::pool_alloc(bytes, stream);  // outside the lock
  std::lock_guard<std::mutex> lock(book.mutex);
  book.live[ptr] = detail::LiveBlock{bytes, stream, hook};
  uint64_t& cur = hook ? book.hook_current : book.pool_current;
  uint64_t& peak = hook ? book.hook_peak : book.pool_peak;
  cur += bytes;
  peak = std::max(peak, cur);
  return ptr;
}

// Stream-ordered free; errors are left to the next checked call (this runs in destructors).
inline void workspace_free(void* ptr, cudaStream_t stream) noexcept {
  if (!ptr) return;
  auto& book = detail::workspace_book();
  detail::LiveBlock block;
  bool known = false;
  {
    std::lock_guard<std::mutex> lock(book.mutex);
    auto it = book.live.find(ptr);
    if (it != book.live.end()) {
      block = it->second;
      known = true;
      book.live.erase(it);
      (block.from ? book.hook_current : book.pool_current) -= block.bytes;
    }
  }
  if (!known || !block.from) {  // the pool's (or, defensively, unknown: cudaFreeAsync is the pool's free)
    (void)cudaFreeAsync(ptr, stream);
    return;
  }
  if (stream != block.stream) {  // the block's own stream waits for the freeing stream's work first
    cudaEvent_t done = nullptr;
    if (cudaEventCreateWithFlags(&done, cudaEventDisableTiming) == cudaSuccess) {
      (void)cudaEventRecord(done, stream);
      (void)cudaStreamWaitEvent(block.stream, done, 0);
      (void)cudaEventDestroy(done);  // released once the wait is satisfied
    }
  }
  block.from->free(ptr, block.stream, block.from->ctx);
}

// Bytes in use and high-water marks (see the opening comment).
inline WorkspaceStats workspace_stats() {
  WorkspaceStats s;
  {
    auto& book = detail::workspace_book();
    std::lock_guard<std::mutex> lock(book.mutex);
    if (book.hook) s.allocator = book.hook->name;
    s.current_bytes = book.pool_current;
    s.peak_bytes = book.pool_peak;
    s.hooked_current_bytes = book.hook_current;
    s.hooked_peak_bytes = book.hook_peak;
  }
  auto& all = detail::workspace_pools();
  std::lock_guard<std::mutex> lock(all.mutex);
  for (cudaMemPool_t pool : all.pools) {
    if (!pool) continue;
    uint64_t cur = 0, high = 0;
    (void)cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &cur);
    (void)cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &high);
    s.reserved_bytes += cur;
    s.peak_reserved_bytes += high;
  }
  return s;
}

// Starts every high-water mark again from the current value.
inline void reset_workspace_peaks() {
  {
    auto& book = detail::workspace_book();
    std::lock_guard<std::mutex> lock(book.mutex);
    book.pool_peak = book.pool_current;
    book.hook_peak = book.hook_current;
  }
  auto& all = detail::workspace_pools();
  std::lock_guard<std::mutex> lock(all.mutex);
  for (cudaMemPool_t pool : all.pools) {
    if (!pool) continue;
    uint64_t zero = 0;  // "set to 0": the high-water marks restart from the current values
    (void)cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero);
    (void)cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero);
  }
}

// Hands every device's cached, unused workspace memory back to the driver (after a device sync, so
// pending stream-ordered frees have landed). A no-op when no pool was ever created. Blocks of the hook
// are the hook's to cache (torch: torch.cuda.empty_cache()).
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
