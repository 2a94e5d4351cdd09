// cuda/tiled/bwd_handoff.cuh — the reverse state-gradient scan (stage B1, bwd_dh_scan_wgmma.cuh) and the
// chunk-local kernel after it (bwd_local_wgmma.cuh, bwd_local_kda_wgmma.cuh) run side by side, chunk by chunk.
//
// Why: B1 is a serial chain with one CTA per (sequence, value head, 64 or 128 state columns). With few chains it
// holds a fraction of the SMs (64 of 132 at (2,16384,16,128)) for its whole walk while the rest idle, and the
// chunk-local kernel, which needs each chunk's dh and dVn from B1, starts only after it. Here the chunk-local
// kernel starts beside B1 and its CTA for chunk c waits until B1 has stored dh[c] and dVn of c:
//
//   B1     on the high-priority side stream; each CTA counts itself into `started` when it begins and, one
//          step after storing chunk c's dh and dVn (every thread's stores behind the step's barriers), adds
//          1 to ready[c * HV + hv] after a fence (release).
//   gate   one thread on the caller's stream, spinning until all of B1's CTAs have begun: only then may the
//          chunk-local kernel's CTAs take SMs and wait, since B1, once resident, depends on nothing.
//   local  its grid walks the chunks in B1's order (last chunk of every sequence first; handoff_block), and
//          thread 0 of a CTA waits (acquire) until ready[c * HV + hv] counts every B1 CTA of that head.
//
// Only where the chunk table's sequences all have the same number of chunks (the walk's order is then a
// closed form), B1 runs whole (not in pieces) with fewer CTAs than SMs, the chunk-local kernel runs on all the
// chunks in one slice that has no buffers of its own (the slice region reuses B1's inputs' bytes otherwise),
// and the stream is not being captured (a graph may serialise the two branches). A wait that lasts more than
// kHandoffTimeoutNs ends the kernel with a trap (an error at the next synchronisation), never a silent hang.
// The gradients are the same bits as one kernel after the other (DELTACP_TILED_BWD_HANDOFF=0).
//
// Measured (NVIDIA H200, 2026-11-29, bf16, FLA's benchmark keywords, (2,16384,16,128)): stage_times.py kernel
// times in one run, gdn B1 0.707 + chunk-local 0.968 ms one after the other, a span of 1.398 beside (B1 0.923 in
// it); kda 0.762 + 1.716, a span of 2.337 (its larger chunk-local kernel and B1 slow each other down). bench_gpu.py
// forward + backward beside FLA 0.5.2, the previous results -> with it: gdn 3.347 -> 3.072 ms, (1,8192,96,128)
// 4.023 -> 3.854; kda 4.924 -> 4.809, (1,8192,96,128) 6.266 -> 6.224.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace deltacp::cuda::tiled::bwd {

struct BwdHandoff {
  int* ready = nullptr;    // [num_chunks * HV]: B1 CTAs done with chunk c of value head hv (zeroed before B1)
  int* started = nullptr;  // B1 CTAs that have begun
  int need = 0;            // B1 CTAs per value head (V / the state columns of one CTA)
  int64_t seqs = 0;        // sequences, each of
  int64_t per_seq = 0;     // chunks
};

constexpr unsigned long long kHandoffTimeoutNs = 20ull * 1000 * 1000 * 1000;

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Spins (one thread) until *p >= need; traps after kHandoffTimeoutNs. (No printf here: a call inside a kernel makes
// ptxas serialise every wgmma of it, "wgmma pipeline crossing function boundary".)
__device__ __forceinline__ void wait_count(const int* p, int need) {
  if (load_acquire(p) >= need) return;
  const unsigned long long t0 = global_ns();
  while (load_acquire(p) < need) {
    __nanosleep(200);
    if (global_ns() - t0 > kHandoffTimeoutNs) __trap();
  }
}
// The generic stores before it (by every thread of the CTA, ordered by a barrier before the call) become visible
// to whoever acquires the count.
__device__ __forceinline__ void release_add(int* p) {
  __threadfence();
  atomicAdd(p, 1);
}

// The (chunk, value head) of this CTA of the chunk-local kernel: blockIdx as is, or with a handoff the linear
// block index in B1's order: distance from the end of the sequence, then sequence, then value head.
__device__ __forceinline__ void handoff_block(const BwdHandoff& h, int64_t HV, int64_t& c, int64_t& hv) {
  if (h.ready == nullptr) {
    c = blockIdx.x;
    hv = blockIdx.y;
    return;
  }
  const int64_t L = blockIdx.x + static_cast<int64_t>(gridDim.x) * blockIdx.y, per = h.seqs * HV;
  const int64_t d = L / per, r = L - d * per, s = r / HV;
  hv = r - s * HV;
  c = s * h.per_seq + (h.per_seq - 1 - d);
}
// With a handoff: the CTA waits until B1 has finished chunk c of value head hv (every thread of the CTA calls it;
// it ends on a barrier, and the async proxy's reads (TMA) are ordered after the acquire).
__device__ __forceinline__ void handoff_wait(const BwdHandoff& h, int64_t c, int64_t hv, int64_t HV) {
  if (h.ready == nullptr) return;
  if (threadIdx.x == 0) {
    wait_count(h.ready + c * HV + hv, h.need);
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  __syncthreads();
}

// The gate: one thread until every B1 CTA has begun.
__global__ void b1_started_gate_kernel(const int* started, int ctas) { wait_count(started, ctas); }

}  // namespace deltacp::cuda::tiled::bwd
