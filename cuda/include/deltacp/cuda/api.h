// deltacp/cuda/api.h — the CUDA backend: one dispatch over the tiers, on the shared Params.
//
// Every pointer in Params is device memory, except cu_seqlens_host (a host copy of cu_seqlens,
// required for varlen: launchers size grids and chunk tables from it). Work is launched on
// p.stream (a cudaStream_t; nullptr = the legacy default stream); the calls are asynchronous
// except where they must read something back. Workspace is stream-ordered on p.stream, from a per-device pool that
// keeps its memory mapped between calls (cuda/common/workspace_pool.h; release_workspace_memory()).
// Inputs fp32, bf16 or fp16 (p.dtype); states fp32 (p.state_dtype must be f32).
//
//   tier    Method::naive  one block per (sequence, value head), token loop      cuda/naive/
//           Method::tiled  chunked WY algorithm, one kernel per stage, mma       cuda/tiled/
//           Method::fused  Hopper fused kernels (later)                          cuda/fused/
#pragma once

#include <memory>

#include "deltacp/params.h"

namespace deltacp::cuda {

// True when a CUDA device is usable (tests skip otherwise).
bool device_available();

// Hands the kernels' cached workspace memory back to the driver (it stays mapped between calls
// otherwise; cuda/common/workspace_pool.h says why). Synchronises every device that has a pool.
void release_workspace();

// Validates p (deltacp::Error naming the argument) and launches the tier's forward:
// writes o, and ht when p.ht is set.
void forward(const Params& p, Method tier);

// Validates p and launches the tier's backward: writes dq, dk, dv, dg (gdn/kda/dplr), dbeta
// (gdn/kda/delta), da/db (dplr) and dh0 when p.dh0 is set. Recomputes forward states itself.
void backward(const Params& p, Method tier);

// The backward in stages around dht, for context parallelism (the tiled tier only):
//
//   auto s = backward_prepare(p, Method::tiled);  // every stage that does not read dht: the forward
//                                                 // recompute and the intra-chunk B0 (p.dht ignored)
//   backward_dh0_pieces(*s, pieces);              // optional, any number of times: dh0 of each piece
//                                                 // (a dh0-only problem over the first rows of p, cut
//                                                 // at p's own chunk boundaries) from s's stages
//   backward_finish(*s, p_with_dht);              // the rest: B1..B5 with dht; the same tensors
//
// The same results, bit for bit, as backward(p_with_dht, Method::tiled). A rank of a CP backward
// prepares while it waits for the exchange, and its pre-pass reuses the prepared stages. The tensors
// of p must stay alive until finish's kernels have run; the state frees its workspace when destroyed.
class StagedBackward {
 public:
  virtual ~StagedBackward() = default;
};
std::unique_ptr<StagedBackward> backward_prepare(const Params& p, Method tier);
void backward_dh0_pieces(StagedBackward& s, const Params& pieces);
void backward_finish(StagedBackward& s, const Params& p);

// Which (variant, tier, direction) combinations exist in this build.
bool supports(Variant v, Method tier, bool backward);

}  // namespace deltacp::cuda
