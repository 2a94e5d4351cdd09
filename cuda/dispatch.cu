// cuda/dispatch.cu — the CUDA backend's one entry point (cuda/include/deltacp/cuda/api.h).
//
// forward(p, tier) / backward(p, tier):
//   1. the tier exists in this build              else deltacp::Error naming 'tier'
//   2. GPU-specific checks: inputs f32/bf16/f16 ('dtype'), states f32 ('state_dtype'),
//      a varlen batch carries cu_seqlens_host ('cu_seqlens_host': launchers size grids from it,
//      and validation must never read the device array on the host)
//   3. deltacp::validate_forward / validate_backward (shapes, sizes, cu_seqlens, required tensors;
//      they accept the state-only modes of params.h: a forward with o null and ht given, a backward
//      with every input gradient null and dh0 given, which every tier implements)
//   4. the tier implements the variant             else deltacp::Error naming 'variant'
//   5. every pointer the call reads or writes is GPU-accessible memory (device, managed or pinned
//      host), else deltacp::Error naming it: a host pointer would otherwise become an illegal
//      address inside a kernel and poison the whole CUDA context
//   6. switch on the tier, like llm.c's kernel_num switch.
// Steps 1-4 run on the host only, so bad arguments are reported even on a machine without a GPU.
// Launches are asynchronous on p.stream; CUDA errors become deltacp::Error("cuda", ...).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "common/check.h"
#include "common/finite_check.h"
#include "common/gate_range.h"
#include "common/workspace_pool.h"
#include "deltacp/cuda/api.h"
#include "deltacp/cuda/tiers.h"
#include "deltacp/error.h"
#include "deltacp/validate.h"

namespace deltacp::cuda {
namespace {

constexpr bool kHaveTiledForward =
#ifdef DELTACP_HAVE_TILED_FWD
    true;
#else
    false;
#endif
constexpr bool kHaveTiledBackward =
#ifdef DELTACP_HAVE_TILED_BWD
    true;
#else
    false;
#endif
constexpr bool kHaveFusedForward =
#ifdef DELTACP_HAVE_FUSED_FWD
    true;
#else
    false;
#endif

// What the last forward or backward of this thread ran, and why (last_tier_choice, api.h).
thread_local TierChoice g_last_choice{Method::naive, "no CUDA call yet"};
// Whether the last forward of this thread wrote Params::wy_stage (last_forward_kept_wy_stage, api.h).
thread_local bool g_last_kept_wy_stage = false;

bool tier_built(Method tier, bool backward) {
  switch (tier) {
    case Method::naive: return true;
    case Method::tiled: return backward ? kHaveTiledBackward : kHaveTiledForward;
    case Method::fused: return !backward && kHaveFusedForward;
    default: return false;
  }
}

std::string built_tiers(bool backward) {
  std::string s = "naive";
  if (tier_built(Method::tiled, backward)) s += ", tiled";
  if (tier_built(Method::fused, backward)) s += ", fused";
  return s;
}

void check_tier(Method tier, bool backward) {
  DELTACP_CHECK(tier_built(tier, backward), "tier", "expected ", built_tiers(backward), " for the CUDA ",
                backward ? "backward" : "forward", " in this build, got ", to_string(tier));
}

void check_gpu_params(const Params& p) {
  DELTACP_CHECK(p.dtype == DType::f32 || p.dtype == DType::bf16 || p.dtype == DType::f16, "dtype",
                "expected float32, bfloat16 or float16 inputs on the GPU, got ", to_string(p.dtype));
  DELTACP_CHECK(p.state_dtype == DType::f32, "state_dtype", "expected float32 states on the GPU, got ",
                to_string(p.state_dtype));
  if (p.varlen())
    DELTACP_CHECK(p.cu_seqlens_host != nullptr, "cu_seqlens_host",
                  "expected a host copy of cu_seqlens for a varlen batch on the GPU, got none");
}

// Kernels a tier has that supports() does not list yet, because they have not run on a GPU: they run only
// when forward(p, tier) / backward(p, tier) name the tier, never from a default pick (dplr_fwd.cu: the tiled
// DPLR forward and its dh0-only backward, Params::dh0_only; dplr_bwd.cu: the full tiled DPLR backward).
bool opt_in(const Params& p, Method tier, bool backward) {
#ifdef DELTACP_HAVE_TILED_DPLR_FWD
#ifdef DELTACP_HAVE_TILED_DPLR_BWD
  constexpr bool kFullDplrBackward = true;
#else
  constexpr bool kFullDplrBackward = false;
#endif
  if (p.variant == Variant::dplr && tier == Method::tiled && (!backward || p.dh0_only() || kFullDplrBackward))
    return true;
#endif
  (void)p, (void)tier, (void)backward;
  return false;
}

void check_variant(const Params& p, Method tier, bool backward, bool by_name = false) {
  DELTACP_CHECK(supports(p.variant, tier, backward) || (by_name && opt_in(p, tier, backward)), "variant",
                "expected a variant the ", to_string(tier), " ", backward ? "backward" : "forward",
                " implements, got ", to_string(p.variant));
}

// The pointer must be usable by a kernel: device, managed, or pinned (page-locked) host memory.
void check_gpu_pointer(const void* ptr, const char* name) {
  if (!ptr) return;
  cudaPointerAttributes attr{};
  DELTACP_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
  DELTACP_CHECK(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged ||
                    attr.type == cudaMemoryTypeHost,
                name, "expected GPU-accessible memory (device, managed or pinned host), got ",
                attr.type == cudaMemoryTypeUnregistered ? "pageable host memory" : "unknown memory");
}

void check_gpu_pointers(const Params& p, bool backward) {
  check_gpu_pointer(p.q.ptr, "q");
  check_gpu_pointer(p.k.ptr, "k");
  check_gpu_pointer(p.v.ptr, "v");
  check_gpu_pointer(p.g.ptr, "g");
  check_gpu_pointer(p.beta.ptr, "beta");
  check_gpu_pointer(p.a.ptr, "a");
  check_gpu_pointer(p.b.ptr, "b");
  check_gpu_pointer(p.h0, "h0");
  if (p.varlen()) check_gpu_pointer(p.cu_seqlens, "cu_seqlens");
  if (!backward) {
    check_gpu_pointer(p.o.ptr, "o");
    check_gpu_pointer(p.ht, "ht");
    return;
  }
  check_gpu_pointer(p.dout.ptr, "do");
  check_gpu_pointer(p.dht, "dht");
  check_gpu_pointer(p.dq.ptr, "dq");
  check_gpu_pointer(p.dk.ptr, "dk");
  check_gpu_pointer(p.dv.ptr, "dv");
  check_gpu_pointer(p.dg.ptr, "dg");
  check_gpu_pointer(p.dbeta.ptr, "dbeta");
  check_gpu_pointer(p.da.ptr, "da");
  check_gpu_pointer(p.db.ptr, "db");
  check_gpu_pointer(p.dh0, "dh0");
}

// The arguments of a CUDA forward or backward of `tier`: shapes and values (the reference's checks),
// the variant the tier implements, device pointers.
void validate_on_gpu(const Params& p, Method tier, bool backward, bool by_name = false) {
  check_gpu_params(p);
  if (backward) {
    validate_backward(p);
  } else {
    validate_forward(p);
  }
  check_variant(p, tier, backward, by_name);
  check_gpu_pointers(p, backward);
  if (p.chunk_h != nullptr || p.chunk_vnew != nullptr) {  // params.h: the states a forward keeps for the backward
    DELTACP_CHECK(p.chunk_h != nullptr && p.chunk_vnew != nullptr, p.chunk_h ? "chunk_vnew" : "chunk_h",
                  "expected chunk_h and chunk_vnew both or neither");
    DELTACP_CHECK(tier == Method::tiled || (tier == Method::fused && !backward), "chunk_h", "the ", to_string(tier),
                  backward ? " backward" : " forward", " keeps no per-chunk states (the tiled and fused forwards and "
                  "the tiled backward do); pass none");
    DELTACP_CHECK(p.variant != Variant::dplr, "chunk_h", "dplr's kernels keep no per-chunk states; pass none");
    DELTACP_CHECK(!p.final_state_only(), "chunk_h", "a final-state-only forward keeps no per-chunk states; pass none");
    DELTACP_CHECK(!(backward && p.dh0_only()), "chunk_h", "the dh0-only backward reads no per-chunk states; pass none");
    check_gpu_pointer(p.chunk_h, "chunk_h");
    check_gpu_pointer(p.chunk_vnew, "chunk_vnew");
  }
  if (p.wy_stage != nullptr) {  // params.h: the WY stage, written by the fused forward, read by the tiled backward
    DELTACP_CHECK(p.chunk_h != nullptr, "wy_stage", "expected chunk_h and chunk_vnew beside it (it is kept with the "
                  "per-chunk states)");
    DELTACP_CHECK((p.variant == Variant::kda || p.variant == Variant::gdn) && p.K == 128 && p.V == 128, "wy_stage",
                  "expected gdn or kda with K = V = 128, got ", to_string(p.variant), " with K = ", p.K, " and V = ",
                  p.V);
    DELTACP_CHECK(p.dtype == DType::bf16 || p.dtype == DType::f16, "wy_stage", "expected bfloat16 or float16 "
                  "inputs, got ", to_string(p.dtype));
    check_gpu_pointer(p.wy_stage, "wy_stage");
  }
  if (p.gate_in_kernel()) {  // params.h: kda's raw gate with A_log (and dt_bias), a forward option
    DELTACP_CHECK(!backward && p.variant == Variant::kda, "A_log", "the in-kernel gate is an option of kda's forward");
    check_gpu_pointer(p.gate_A_log, "A_log");
    check_gpu_pointer(p.gate_dt_bias, "dt_bias");
  }
  if (p.qk_l2norm) {  // params.h: normalised as contiguous rows
    DELTACP_CHECK(p.K <= 256, "K", "expected K <= 256 with qk_l2norm, got ", p.K);
    for (const auto& [ref, name] : {std::pair{&p.q, "q"}, std::pair{&p.k, "k"}})
      DELTACP_CHECK(ref->stride_h == p.K && ref->stride_t == p.H * p.K && (p.B == 1 || ref->stride_b == p.T * p.H * p.K),
                    name, "expected contiguous [B, T, H, K] rows with qk_l2norm, got strides (", ref->stride_b, ", ",
                    ref->stride_t, ", ", ref->stride_h, ")");
  }
}

}  // namespace

bool device_available() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: not an error for the caller, just "no"
    return false;
  }
  return count > 0;
}

void release_workspace() { release_workspace_memory(); }

bool supports(Variant v, Method tier, bool backward) {
  const bool known = v == Variant::delta || v == Variant::gdn || v == Variant::kda || v == Variant::dplr;
  if (!known || !tier_built(tier, backward)) return false;
  switch (tier) {
    case Method::naive: return true;  // all four variants, forward and backward
    case Method::tiled: return v == Variant::gdn || v == Variant::kda || v == Variant::delta;
    case Method::fused: return !backward && (v == Variant::gdn || v == Variant::kda || v == Variant::delta);
    default: return false;
  }
}

static void run_forward(const Params& p, Method tier);

// qk_l2norm on a tier that does not fold it into its kernels (naive, tiled): q and k normalised into workspace
// (one pass each, cuda/common/l2norm.cu, FLA's eps), then the tier runs on them. The fused tier normalises the
// rows where it loads them (gdn, delta: the wgmma WY stage's row scales; kda: its two token-parallel kernels).
static void run_forward_on_normalised(const Params& p, Method tier) {
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const int64_t rows = p.B * p.T * p.H;
  const int64_t bytes = (rows * p.K * dtype_size(p.dtype) + 255) / 256 * 256;
  char* ws = static_cast<char*>(workspace_alloc(static_cast<size_t>(2 * bytes), stream));
  try {
    l2norm_rows(p.q.ptr, ws, nullptr, rows, p.K, p.dtype, kQkL2normEps, p.stream);
    l2norm_rows(p.k.ptr, ws + bytes, nullptr, rows, p.K, p.dtype, kQkL2normEps, p.stream);
    Params pn = p;
    pn.qk_l2norm = false;
    pn.qk_unit_rows = true;  // kda's diagonal bound: as wide as where the kernels normalise (kda_scores.cuh)
    pn.q = contiguous_ref(static_cast<void*>(ws), p.T, p.H, p.K);
    pn.k = contiguous_ref(static_cast<void*>(ws + bytes), p.T, p.H, p.K);
    run_forward(pn, tier);
  } catch (...) {
    workspace_free(ws, stream);
    throw;
  }
  workspace_free(ws, stream);
}

// kda's in-kernel gate (Params::gate_A_log) on a tier that does not fold it into its kernels (naive, tiled): the
// gate into fp32 workspace (one pass, cuda/common/kda_gate.cu), then the tier runs on it as a precomputed log
// decay. The fused tier applies it where its token-parallel stage sums the gate within each chunk.
static void run_forward_on_gated(const Params& p, Method tier) {
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const size_t bytes = static_cast<size_t>(p.B * p.T * p.HV * p.K) * sizeof(float);
  float* ws = static_cast<float*>(workspace_alloc(std::max<size_t>(bytes, 256), stream));
  try {
    kda_gate(p, ws, p.stream);
    Params pg = p;
    pg.gate_A_log = nullptr;
    pg.gate_dt_bias = nullptr;
    pg.gate_lower_bound = 0.f;
    pg.g = contiguous_ref(static_cast<void*>(ws), p.T, p.HV, p.K);
    pg.g_fp32 = true;
    run_forward(pg, tier);
  } catch (...) {
    workspace_free(ws, stream);
    throw;
  }
  workspace_free(ws, stream);
}

static void run_forward(const Params& p, Method tier) {
  g_last_kept_wy_stage = false;
  check_tier(tier, false);
  validate_on_gpu(p, tier, false, /*by_name=*/true);
  g_last_choice = TierChoice{tier, std::string("asked for by name")};
  if (p.gate_in_kernel() && tier != Method::fused) return run_forward_on_gated(p, tier);
  if (p.qk_l2norm && tier != Method::fused) return run_forward_on_normalised(p, tier);
  switch (tier) {
    case Method::naive: naive_forward(p); return;
#ifdef DELTACP_HAVE_TILED_FWD
    case Method::tiled:
#ifdef DELTACP_HAVE_TILED_DPLR_FWD
      if (p.variant == Variant::dplr) {
        tiled_dplr_forward(p);  // opt-in (see opt_in above)
        return;
      }
#endif
      tiled_forward(p);
      return;
#endif
#ifdef DELTACP_HAVE_FUSED_FWD
    case Method::fused:
      fused::forward(p);
      g_last_kept_wy_stage = fused::keeps_wy_stage(p);
      return;
#endif
    default: break;
  }
  throw_error("tier", "no CUDA forward for tier ", to_string(tier));  // unreachable after check_tier
}

// safe_gate's range check (Params::gate_range, common/gate_range.h), started once per call: the slots initialised,
// then the fused kda stage folds the reduction into its gate load (each window's stage, or its own pass where the
// wgmma stage does not run: tiled_fwd.cu launch_kda_fused_prepare); elsewhere one pass over g here, and the tier
// runs without it.
static Params start_gate_range(const Params& p, Method tier) {
  if (p.gate_range == nullptr) return p;
  DELTACP_CHECK(p.g.ptr != nullptr && !p.gate_in_kernel(), "gate_range",
                "internal: safe_gate's range check reads a precomputed g (not with the in-kernel gate)");
  check_gpu_pointer(p.gate_range, "gate_range");
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  gate_range_init(p.gate_range, stream);
  if (tier == Method::fused && p.variant == Variant::kda) return p;
  gate_range_pass(p, stream);
  Params rest = p;
  rest.gate_range = nullptr;
  return rest;
}

// DELTACP_CHECK=1: the numeric checks of docs/errors.md around the kernels (common/finite_check.h).
void forward(const Params& p, Method tier) {
  if (!numeric_checks_requested()) {
    if (p.gate_range == nullptr) return run_forward(p, tier);
    check_tier(tier, false);
    validate_on_gpu(p, tier, false, /*by_name=*/true);  // before the range check reads g
    return run_forward(start_gate_range(p, tier), tier);
  }
  check_tier(tier, false);
  validate_on_gpu(p, tier, false, /*by_name=*/true);  // the arguments first: the checks read the tensors
  check_inputs_on_device(p, false);
  const Params q = start_gate_range(p, tier);
  run_forward(q, tier);
  check_outputs_on_device(q, false);
}

static void run_backward(const Params& p, Method tier) {
  check_tier(tier, true);
  validate_on_gpu(p, tier, true, /*by_name=*/true);
  g_last_choice = TierChoice{tier, std::string("asked for by name")};
  switch (tier) {
    case Method::naive: naive_backward(p); return;
#ifdef DELTACP_HAVE_TILED_BWD
    case Method::tiled:
#ifdef DELTACP_HAVE_TILED_DPLR_FWD
      if (p.variant == Variant::dplr) {  // opt-in (see opt_in above)
#ifdef DELTACP_HAVE_TILED_DPLR_BWD
        tiled_dplr_backward(p);  // every gradient, or dh0 alone
#else
        tiled_dplr_dh0(p);  // dh0-only
#endif
        return;
      }
#endif
      tiled_backward(p);
      return;
#endif
    default: break;
  }
  throw_error("tier", "no CUDA backward for tier ", to_string(tier));  // unreachable after check_tier
}

void backward(const Params& p, Method tier) {
  if (!numeric_checks_requested()) return run_backward(p, tier);
  check_tier(tier, true);
  validate_on_gpu(p, tier, true, /*by_name=*/true);
  check_inputs_on_device(p, true);
  run_backward(p, tier);
  check_outputs_on_device(p, true);
}

// The fastest tier that runs p: fused (Hopper) where its kernels apply, else tiled, else naive.
TierChoice choose_forward_tier(const Params& p) {
  std::string why;
#ifdef DELTACP_HAVE_FUSED_FWD
  if (supports(p.variant, Method::fused, false)) {
    const char* refusal = fused::forward_refusal(p);
    if (refusal == nullptr) return {Method::fused, "the fused tier applies (the fastest)"};
    why = std::string("the fused tier does not apply: ") + refusal;
  } else {
    why = std::string("the fused tier does not implement variant ") + to_string(p.variant);
  }
#else
  why = "this build has no fused tier";
#endif
  if (supports(p.variant, Method::tiled, false)) return {Method::tiled, why};
  return {Method::naive, why + (why.empty() ? "" : "; ") + "the tiled tier does not implement variant " +
                             to_string(p.variant)};
}

Method forward_auto(const Params& p) {
  const TierChoice choice = choose_forward_tier(p);
  forward(p, choice.tier);
  g_last_choice = choice;
  return choice.tier;
}

Method backward_auto(const Params& p) {
  const Method tier = supports(p.variant, Method::tiled, true) ? Method::tiled : Method::naive;
  backward(p, tier);
  g_last_choice = TierChoice{tier, tier == Method::tiled ? "the fastest backward that implements the variant"
                                                         : "the tiled tier does not implement the variant"};
  return tier;
}

TierChoice last_tier_choice() { return g_last_choice; }
bool last_forward_kept_wy_stage() { return g_last_kept_wy_stage; }

TierChoice forward_tier(const Params& p) {
  check_gpu_params(p);
  return choose_forward_tier(p);
}

namespace {
// The staged calls (the CP layer's) recompute what they need: no kept per-chunk states (params.h).
void refuse_kept_states(const Params& p) {
  DELTACP_CHECK(p.chunk_h == nullptr && p.chunk_vnew == nullptr, p.chunk_h ? "chunk_h" : "chunk_vnew",
                "the staged forward and backward keep and read no per-chunk states; pass none");
  DELTACP_CHECK(p.wy_stage == nullptr, "wy_stage", "the staged forward and backward keep and read no WY stage; "
                "pass none");
}
// Every step of the staged (tiled) forward or backward checks what forward() / backward() check.
void validate_staged(const Params& p, bool backward) {
  validate_on_gpu(p, Method::tiled, backward);
  refuse_kept_states(p);
}
}  // namespace

std::unique_ptr<StagedForward> forward_prepare(const Params& p, Method tier) {
  check_tier(tier, false);
  DELTACP_CHECK(p.gate_range == nullptr, "gate_range", "the staged forward takes no range check of g");
  DELTACP_CHECK(tier == Method::tiled || tier == Method::fused, "tier",
                "expected 'tiled' or 'fused' for the staged forward, got ", to_string(tier));
  if (tier == Method::fused) {
    validate_on_gpu(p, Method::fused, false, /*by_name=*/true);
    refuse_kept_states(p);
#ifdef DELTACP_HAVE_FUSED_FWD
    return fused::forward_prepare(p);
#else
    throw_error("tier", "no CUDA forward for tier fused in this build");
#endif
  }
  validate_staged(p, false);
  // The tiled stages read q and k as given (the fused tier folds the row scales into its products; the one-shot
  // tiled forward normalises into workspace first, run_forward_on_normalised).
  DELTACP_CHECK(!p.qk_l2norm, "qk_l2norm", "the staged tiled forward takes q and k l2-normalised by the caller "
                "(the staged fused forward normalises them in its kernels)");
  // The tiled DPLR kernels (dplr_fwd.cu) have no staged form: refused here even once supports() lists them.
  DELTACP_CHECK(p.variant != Variant::dplr, "variant", "expected gdn, kda or delta for the staged tiled forward, "
                "got dplr");
#ifdef DELTACP_HAVE_TILED_FWD
  return tiled_forward_prepare(p);
#else
  throw_error("tier", "no CUDA forward for tier tiled in this build");
#endif
}

void forward_state_pieces(StagedForward& s, const Params& pieces, int64_t row0, bool with_values) {
  DELTACP_CHECK(s.tier() == Method::tiled, "state", "expected a forward prepared on the tiled tier for its "
                "state-only pieces (the fused chain always makes the output), got one prepared on ",
                to_string(s.tier()));
  validate_staged(pieces, false);
#ifdef DELTACP_HAVE_TILED_FWD
  tiled_forward_state_pieces(s, pieces, row0, with_values);
#else
  (void)s, (void)row0, (void)with_values;  // unreachable: forward_prepare throws first in such a build
  throw_error("tier", "no CUDA forward for tier tiled in this build");
#endif
}

std::vector<int64_t> scan_pieces(const Params& p, int64_t n, Method tier) {
  DELTACP_CHECK(tier == Method::tiled || tier == Method::fused, "tier",
                "expected 'tiled' or 'fused' for the forward's pieces, got ", to_string(tier));
  if (tier == Method::fused) {
    validate_on_gpu(p, Method::fused, false, /*by_name=*/true);
#ifdef DELTACP_HAVE_FUSED_FWD
    return fused::scan_pieces(p, n);
#else
    (void)n;
    throw_error("tier", "no CUDA forward for tier fused in this build");
#endif
  }
  validate_staged(p, false);
#ifdef DELTACP_HAVE_TILED_FWD
  return tiled_scan_pieces(p, n);
#else
  (void)n;
  throw_error("tier", "no CUDA forward for tier tiled in this build");
#endif
}

void forward_piece_maps(StagedForward& s, int64_t n, float* maps, int64_t numel) {
#ifdef DELTACP_HAVE_FUSED_FWD
  if (s.tier() == Method::fused) return fused::forward_piece_maps(s, n, maps, numel);
#endif
#ifdef DELTACP_HAVE_TILED_FWD
  tiled_forward_piece_maps(s, n, maps, numel);
#else
  (void)s, (void)n, (void)maps, (void)numel;  // unreachable: forward_prepare throws first in such a build
  throw_error("tier", "no CUDA forward for tier tiled in this build");
#endif
}

void forward_composed_map(StagedForward& s, int64_t n, const float* init, float* out, int64_t width, int64_t numel) {
#ifdef DELTACP_HAVE_FUSED_FWD
  if (s.tier() == Method::fused) return fused::forward_composed_map(s, n, init, out, width, numel);
#endif
#ifdef DELTACP_HAVE_TILED_FWD
  tiled_forward_composed_map(s, n, init, out, width, numel);
#else
  (void)s, (void)n, (void)init, (void)out, (void)width, (void)numel;  // unreachable, as forward_piece_maps
  throw_error("tier", "no CUDA forward for tier tiled in this build");
#endif
}

void compose_state_maps(const float* maps, int64_t P, int64_t HV, int64_t K, int64_t V, int64_t width,
                        const float* init, float* out, void* stream) {
#ifdef DELTACP_HAVE_TILED_FWD
  tiled_compose_state_maps(maps, P, HV, K, V, width, init, out, stream);
#else
  (void)maps, (void)P, (void)HV, (void)K, (void)V, (void)width, (void)init, (void)out, (void)stream;
  throw_error("tier", "no CUDA forward for tier tiled in this build");
#endif
}

void forward_finish(StagedForward& s, const Params& p) {
  if (s.tier() == Method::fused) {
    validate_on_gpu(p, Method::fused, false, /*by_name=*/true);
    refuse_kept_states(p);
#ifdef DELTACP_HAVE_FUSED_FWD
    return fused::forward_finish(s, p);
#else
    throw_error("tier", "no CUDA forward for tier fused in this build");  // unreachable: prepare throws first
#endif
  }
  validate_staged(p, false);
#ifdef DELTACP_HAVE_TILED_FWD
  tiled_forward_finish(s, p);
#else
  (void)s;  // unreachable: forward_prepare throws first in such a build
  throw_error("tier", "no CUDA forward for tier tiled in this build");
#endif
}

std::unique_ptr<StagedBackward> backward_prepare(const Params& p, Method tier) {
  check_tier(tier, true);
  DELTACP_CHECK(tier == Method::tiled, "tier", "expected 'tiled' for the staged backward, got ", to_string(tier));
  validate_staged(p, true);
#ifdef DELTACP_HAVE_TILED_BWD
  return tiled_backward_prepare(p);
#else
  throw_error("tier", "no CUDA backward for tier tiled in this build");
#endif
}

void backward_dh0_pieces(StagedBackward& s, const Params& pieces) {
  validate_staged(pieces, true);
#ifdef DELTACP_HAVE_TILED_BWD
  tiled_backward_dh0_pieces(s, pieces);
#else
  (void)s;  // unreachable: backward_prepare throws first in such a build
  throw_error("tier", "no CUDA backward for tier tiled in this build");
#endif
}

void backward_states(StagedBackward& s, void* stream) {
#ifdef DELTACP_HAVE_TILED_BWD
  tiled_backward_states(s, stream);
#else
  (void)s, (void)stream;  // unreachable: backward_prepare throws first in such a build
  throw_error("tier", "no CUDA backward for tier tiled in this build");
#endif
}

void backward_finish(StagedBackward& s, const Params& p) {
  validate_staged(p, true);
#ifdef DELTACP_HAVE_TILED_BWD
  tiled_backward_finish(s, p);
#else
  (void)s;  // unreachable: backward_prepare throws first in such a build
  throw_error("tier", "no CUDA backward for tier tiled in this build");
#endif
}

}  // namespace deltacp::cuda
