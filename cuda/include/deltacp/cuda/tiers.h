// deltacp/cuda/tiers.h — entry points of each tier, called only by the dispatch (cuda/dispatch.cu).
// Each takes an already validated Params with device pointers.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "deltacp/cuda/api.h"
#include "deltacp/params.h"

namespace deltacp::cuda {

void naive_forward(const Params& p);   // cuda/naive/naive_fwd.cu
void naive_backward(const Params& p);  // cuda/naive/naive_bwd.cu
void tiled_forward(const Params& p);   // cuda/tiled/tiled_fwd.cu
void tiled_backward(const Params& p);  // cuda/tiled/tiled_bwd.cu
// The tiled DPLR forward (cuda/tiled/dplr_fwd.cu): opt-in, forward(p, Method::tiled) runs it for dplr while
// supports() does not list it (dispatch.cu, opt_in).
void tiled_dplr_forward(const Params& p);
// Its dh0-only backward (Params::dh0_only; opt-in like the forward): the reverse state-gradient scan.
void tiled_dplr_dh0(const Params& p);
// The full tiled DPLR backward (cuda/tiled/dplr_bwd.cu; opt-in like the forward): every input gradient and dh0;
// a dh0-only call goes to tiled_dplr_dh0.
void tiled_dplr_backward(const Params& p);
namespace fused {                      // cuda/fused/fused_fwd.cu
// Why the fused forward cannot run p (variant, dtype, shape, alignment, GPU), or nullptr when it can.
const char* forward_refusal(const Params& p);
void forward(const Params& p);         // throws deltacp::Error naming 'backend' with the refusal
// Whether forward(p) writes Params::wy_stage for the backward (given, beside chunk_h, 16-bit gdn or kda at
// K = V = 128 with its stage on Hopper's warpgroup products, no in-kernel options).
bool keeps_wy_stage(const Params& p);
// The staged forward (api.h) on the fused tier.
std::unique_ptr<StagedForward> forward_prepare(const Params& p);
void forward_finish(StagedForward& s, const Params& p);
std::vector<int64_t> scan_pieces(const Params& p, int64_t n);
void forward_piece_maps(StagedForward& s, int64_t n, float* maps, int64_t numel);
void forward_composed_map(StagedForward& s, int64_t n, const float* init, float* out, int64_t width, int64_t numel);
}  // namespace fused
// The staged forward (api.h), cuda/tiled/tiled_fwd.cu.
std::unique_ptr<StagedForward> tiled_forward_prepare(const Params& p);
void tiled_forward_state_pieces(StagedForward& s, const Params& pieces, int64_t row0, bool with_values);
void tiled_forward_finish(StagedForward& s, const Params& p);
std::vector<int64_t> tiled_scan_pieces(const Params& p, int64_t n);
void tiled_forward_piece_maps(StagedForward& s, int64_t n, float* maps, int64_t numel);
void tiled_forward_composed_map(StagedForward& s, int64_t n, const float* init, float* out, int64_t width,
                                int64_t numel);
void tiled_compose_state_maps(const float* maps, int64_t P, int64_t HV, int64_t K, int64_t V, int64_t width,
                              const float* init, float* out, void* stream);
// The staged backward (api.h), cuda/tiled/tiled_bwd.cu.
std::unique_ptr<StagedBackward> tiled_backward_prepare(const Params& p);
void tiled_backward_dh0_pieces(StagedBackward& s, const Params& pieces);
void tiled_backward_states(StagedBackward& s, void* stream);
void tiled_backward_finish(StagedBackward& s, const Params& p);

}  // namespace deltacp::cuda
