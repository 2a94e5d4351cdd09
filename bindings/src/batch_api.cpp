// bindings/src/batch_api.cpp — the one generic entry point `_core.run` behind every batched op.
//
//   run(direction, variant, method, compute, tensors, scale, chunk_size, cuts, stream, want_exchange)
//
// direction  "forward" writes o (and ht); "backward" writes dq, dk, dv, dg, dbeta, da, db, dh0 — the
//            gradients of L = sum(o * dout) + sum(ht * dht). The state-only modes of params.h are
//            reached by leaving tensors out: a forward without "o" but with "ht" writes only ht; a
//            backward without any input gradient but with "dh0" writes only dh0 (the CP pre-pass).
// method     host:  "recurrent" | "chunked" | "affine"   -> deltacp::ref::forward/backward<S>
//                   "cp" (with cuts)                      -> deltacp::ref::cp_forward/cp_backward<S>
//            CUDA:  "naive" | "tiled" | "fused"           -> deltacp::cuda::forward/backward
//                   "auto"                                -> the fastest tier that applies (forward_auto)
// compute    the reference's scalar type S: "float64" or "float32" (the CUDA tiers accumulate in fp32)
// tensors    {field: (ptr, dtype, shape, strides, device[, name])} — see tensor_desc.h; outputs are
//            allocated by the caller (numpy / torch) and written in place, nothing is copied.
// stream     the cudaStream_t (torch's current stream) as an integer; 0 = legacy default stream.
// The GIL is released while the reference or the CUDA launch runs.
#include <pybind11/eigen.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "deltacp/error.h"
#include "deltacp/reference/batch.h"
#include "tensor_desc.h"
#ifdef DELTACP_WITH_CUDA
#include "deltacp/cuda/api.h"
#endif

namespace py = pybind11;

namespace deltacp::bindings {
namespace {

enum class Kind { reference, cp, cuda };

Kind kind_of(const std::string& method, Method* m) {
  if (method == "auto") {  // CUDA: the tier chosen per call (deltacp::cuda::forward_auto / backward_auto)
    *m = Method::fused;
    return Kind::cuda;
  }
  if (method == "cp") {
    *m = Method::chunked;
    return Kind::cp;
  }
  *m = method_from_string(method);  // deltacp::Error naming 'method' for unknown names
  switch (*m) {
    case Method::recurrent:
    case Method::chunked:
    case Method::affine: return Kind::reference;
    default: return Kind::cuda;
  }
}

template <class S>
py::dict exchange_to_python(const ref::CpExchange<S>& ex) {
  py::list fwd, bwd;
  for (const auto& a : ex.fwd) fwd.append(py::make_tuple(py::cast(a.M), py::cast(a.H)));
  for (const auto& a : ex.bwd) bwd.append(py::make_tuple(py::cast(a.Mt), py::cast(a.dH)));
  py::dict d;
  d["fwd"] = fwd;
  d["bwd"] = bwd;
  return d;
}

// Runs the reference (plain or simulated CP) in scalar type S; returns the exchange or None.
template <class S>
py::object run_reference(const Params& p, bool backward, Kind kind, Method m, const std::vector<int64_t>& cuts,
                         bool want_exchange) {
  ref::CpExchange<S> ex;
  {
    py::gil_scoped_release nogil;
    if (kind == Kind::reference) {
      if (backward) {
        ref::backward<S>(p, m);
      } else {
        ref::forward<S>(p, m);
      }
    } else if (backward) {
      ref::cp_backward<S>(p, cuts, want_exchange ? &ex : nullptr);
    } else {
      ref::cp_forward<S>(p, cuts, want_exchange ? &ex : nullptr);
    }
  }
  if (kind == Kind::cp && want_exchange) return exchange_to_python(ex);
  return py::none();
}

py::object run(const std::string& direction, const std::string& variant, const std::string& method,
               const std::string& compute, const py::dict& tensors, std::optional<double> scale, int chunk_size,
               std::optional<std::vector<int64_t>> cuts, uintptr_t stream, bool want_exchange, bool qk_l2norm,
               std::optional<double> gate_lower_bound, bool qk_unit_rows, bool backward_recomputes) {
  Method m = Method::chunked;
  const Kind kind = kind_of(method, &m);
  if (kind == Kind::cp && !cuts) throw Error("cuts", "is required for simulated context parallelism");
  if (kind != Kind::cp && cuts) throw Error("cuts", "only the simulated CP ('cp') takes cuts");

  const auto descs = parse_descs(tensors);
  Params p = build_params(variant, direction, descs, scale, chunk_size,
                          kind == Kind::cuda ? Place::cuda : Place::host);
  p.qk_l2norm = qk_l2norm;
  p.qk_unit_rows = qk_unit_rows;
  p.backward_recomputes = backward_recomputes;
  const bool backward = direction == "backward";
  if (p.gate_in_kernel()) {  // params.h: a CUDA forward option
    if (kind != Kind::cuda) throw Error("A_log", "the in-kernel kda gate is an option of the CUDA forward");
    if (gate_lower_bound && !(*gate_lower_bound < 0.0)) {
      throw Error("lower_bound", "expected a negative value for the in-kernel gate, got " +
                                     std::to_string(*gate_lower_bound));
    }
    p.gate_lower_bound = gate_lower_bound ? static_cast<float>(*gate_lower_bound) : 0.f;
  } else if (gate_lower_bound) {
    throw Error("lower_bound", "internal: given without the in-kernel gate's A_log");
  }

  if (kind == Kind::cuda) {
#ifdef DELTACP_WITH_CUDA
    p.stream = reinterpret_cast<void*>(stream);
    py::gil_scoped_release nogil;
    if (method == "auto") {
      if (backward) {
        cuda::backward_auto(p);
      } else {
        cuda::forward_auto(p);
      }
    } else if (backward) {
      cuda::backward(p, m);
    } else {
      cuda::forward(p, m);
    }
    return py::none();
#else
    (void)stream;
    throw Error("backend", std::string("'") + method +
                               "' needs the CUDA tiers, but this deltacp was built without CUDA "
                               "(no nvcc at build time)");
#endif
  }
  const std::vector<int64_t> no_cuts;
  const std::vector<int64_t>& cut_list = cuts ? *cuts : no_cuts;
  if (compute == "float64") return run_reference<double>(p, backward, kind, m, cut_list, want_exchange);
  if (compute == "float32") return run_reference<float>(p, backward, kind, m, cut_list, want_exchange);
  throw Error("compute", "expected 'float64' or 'float32', got '" + compute + "'");
}

bool built_with_cuda() {
#ifdef DELTACP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool cuda_available() {
#ifdef DELTACP_WITH_CUDA
  return cuda::device_available();
#else
  return false;
#endif
}

// The staged CUDA backward (deltacp/cuda/api.h), held by Python between its three calls.
struct StagedBackwardHandle {
#ifdef DELTACP_WITH_CUDA
  std::unique_ptr<cuda::StagedBackward> state;
#endif
};

[[noreturn, maybe_unused]] void no_cuda(const char* what) {
  throw Error("backend", std::string(what) + " needs the CUDA tiers, but this deltacp was built without CUDA");
}

Params staged_params(const std::string& variant, const py::dict& tensors, std::optional<double> scale,
                     int chunk_size, uintptr_t stream, const char* direction = "backward") {
  const auto descs = parse_descs(tensors);
  Params p = build_params(variant, direction, descs, scale, chunk_size, Place::cuda);
  p.stream = reinterpret_cast<void*>(stream);
  return p;
}

StagedBackwardHandle* staged_prepare(const std::string& variant, const std::string& method, const py::dict& tensors,
                                     std::optional<double> scale, int chunk_size, uintptr_t stream,
                                     bool qk_unit_rows) {
#ifdef DELTACP_WITH_CUDA
  Method m = Method::chunked;
  if (kind_of(method, &m) != Kind::cuda) throw Error("method", "expected a CUDA tier, got '" + method + "'");
  Params p = staged_params(variant, tensors, scale, chunk_size, stream);
  p.qk_unit_rows = qk_unit_rows;
  auto h = std::make_unique<StagedBackwardHandle>();
  {
    py::gil_scoped_release nogil;
    h->state = cuda::backward_prepare(p, m);
  }
  return h.release();
#else
  (void)variant, (void)method, (void)tensors, (void)scale, (void)chunk_size, (void)stream, (void)qk_unit_rows;
  no_cuda("the staged backward");
#endif
}

void staged_step(StagedBackwardHandle& h, const std::string& step, const std::string& variant,
                 const py::dict& tensors, std::optional<double> scale, int chunk_size, uintptr_t stream) {
#ifdef DELTACP_WITH_CUDA
  if (!h.state) throw Error("state", "expected a prepared backward (this one has finished)");
  if (step == "states") {  // no tensors: the prepared problem's, on `stream`
    py::gil_scoped_release nogil;
    cuda::backward_states(*h.state, reinterpret_cast<void*>(stream));
    return;
  }
  const Params p = staged_params(variant, tensors, scale, chunk_size, stream);
  if (step == "dh0_pieces") {
    py::gil_scoped_release nogil;
    cuda::backward_dh0_pieces(*h.state, p);
  } else if (step == "finish") {
    {
      py::gil_scoped_release nogil;
      cuda::backward_finish(*h.state, p);
    }
    h.state.reset();  // frees the workspace stream-ordered, after finish's kernels
  } else {
    throw Error("step", "expected 'dh0_pieces', 'states' or 'finish', got '" + step + "'");
  }
#else
  (void)h, (void)step, (void)variant, (void)tensors, (void)scale, (void)chunk_size, (void)stream;
  no_cuda("the staged backward");
#endif
}

// The staged CUDA forward (deltacp/cuda/api.h), held by Python between its calls.
struct StagedForwardHandle {
#ifdef DELTACP_WITH_CUDA
  std::unique_ptr<cuda::StagedForward> state;
#endif
};

StagedForwardHandle* staged_forward_prepare(const std::string& variant, const std::string& method,
                                            const py::dict& tensors, std::optional<double> scale, int chunk_size,
                                            uintptr_t stream, bool qk_unit_rows, bool qk_l2norm,
                                            bool backward_recomputes) {
#ifdef DELTACP_WITH_CUDA
  Method m = Method::chunked;
  if (kind_of(method, &m) != Kind::cuda) throw Error("method", "expected a CUDA tier, got '" + method + "'");
  Params p = staged_params(variant, tensors, scale, chunk_size, stream, "forward");
  p.qk_unit_rows = qk_unit_rows;
  p.qk_l2norm = qk_l2norm;
  p.backward_recomputes = backward_recomputes;
  auto h = std::make_unique<StagedForwardHandle>();
  {
    py::gil_scoped_release nogil;
    h->state = cuda::forward_prepare(p, m);
  }
  return h.release();
#else
  (void)variant, (void)method, (void)tensors, (void)scale, (void)chunk_size, (void)stream, (void)qk_unit_rows,
      (void)qk_l2norm, (void)backward_recomputes;
  no_cuda("the staged forward");
#endif
}

void staged_forward_step(StagedForwardHandle& h, const std::string& step, const std::string& variant,
                         const py::dict& tensors, std::optional<double> scale, int chunk_size, uintptr_t stream,
                         int64_t row0, bool with_values) {
#ifdef DELTACP_WITH_CUDA
  if (!h.state) throw Error("state", "expected a prepared forward (this one has finished)");
  const Params p = staged_params(variant, tensors, scale, chunk_size, stream, "forward");
  if (step == "state_pieces") {
    py::gil_scoped_release nogil;
    cuda::forward_state_pieces(*h.state, p, row0, with_values);
  } else if (step == "finish") {
    {
      py::gil_scoped_release nogil;
      cuda::forward_finish(*h.state, p);
    }
    h.state.reset();  // frees the workspace stream-ordered, after finish's kernels
  } else {
    throw Error("step", "expected 'state_pieces' or 'finish', got '" + step + "'");
  }
#else
  (void)h, (void)step, (void)variant, (void)tensors, (void)scale, (void)chunk_size, (void)stream, (void)row0,
      (void)with_values;
  no_cuda("the staged forward");
#endif
}

// Where the tiled forward's state scan, or the fused forward's chain (method), cuts sequence n of the described
// problem into pieces (deltacp/cuda/api.h scan_pieces), as offsets from the sequence's start.
std::vector<int64_t> scan_pieces(const std::string& variant, const py::dict& tensors, int64_t n,
                                 std::optional<double> scale, int chunk_size, const std::string& method) {
#ifdef DELTACP_WITH_CUDA
  Method m = Method::chunked;
  if (kind_of(method, &m) != Kind::cuda) throw Error("method", "expected a CUDA tier, got '" + method + "'");
  const Params p = staged_params(variant, tensors, scale, chunk_size, 0, "forward");
  return cuda::scan_pieces(p, n, m);
#else
  (void)variant, (void)tensors, (void)n, (void)scale, (void)chunk_size, (void)method;
  no_cuda("the forward's pieces");
#endif
}

// forward_piece_maps (api.h): the pass-1 maps of prepared sequence n into the fp32 device buffer at maps_ptr.
void staged_forward_piece_maps(StagedForwardHandle& h, int64_t n, uintptr_t maps_ptr, int64_t numel) {
#ifdef DELTACP_WITH_CUDA
  if (!h.state) throw Error("state", "expected a prepared forward (this one has finished)");
  py::gil_scoped_release nogil;
  cuda::forward_piece_maps(*h.state, n, reinterpret_cast<float*>(maps_ptr), numel);
#else
  (void)h, (void)n, (void)maps_ptr, (void)numel;
  no_cuda("the staged forward");
#endif
}

// forward_composed_map (api.h): prepared sequence n's maps composed from init (0: [0 | I]) into out.
void staged_forward_composed_map(StagedForwardHandle& h, int64_t n, uintptr_t init_ptr, uintptr_t out_ptr,
                                 int64_t width, int64_t numel) {
#ifdef DELTACP_WITH_CUDA
  if (!h.state) throw Error("state", "expected a prepared forward (this one has finished)");
  py::gil_scoped_release nogil;
  cuda::forward_composed_map(*h.state, n, reinterpret_cast<const float*>(init_ptr), reinterpret_cast<float*>(out_ptr),
                             width, numel);
#else
  (void)h, (void)n, (void)init_ptr, (void)out_ptr, (void)width, (void)numel;
  no_cuda("the staged forward");
#endif
}

// compose_state_maps (api.h): maps [P, HV, K, V + K] at maps_ptr composed from init (0: [0 | I]) into out
// ([HV, K, width], numel elements), all fp32 CUDA buffers, on `stream`.
void compose_state_maps(uintptr_t maps_ptr, int64_t P, int64_t HV, int64_t K, int64_t V, int64_t width,
                        uintptr_t init_ptr, uintptr_t out_ptr, int64_t numel, uintptr_t stream) {
#ifdef DELTACP_WITH_CUDA
  if (numel != HV * K * width) throw Error("out", "expected HV * K * width = " + std::to_string(HV * K * width) +
                                                       " elements, got " + std::to_string(numel));
  py::gil_scoped_release nogil;
  cuda::compose_state_maps(reinterpret_cast<const float*>(maps_ptr), P, HV, K, V, width,
                           reinterpret_cast<const float*>(init_ptr), reinterpret_cast<float*>(out_ptr),
                           reinterpret_cast<void*>(stream));
#else
  (void)maps_ptr, (void)P, (void)HV, (void)K, (void)V, (void)width, (void)init_ptr, (void)out_ptr, (void)numel,
      (void)stream;
  no_cuda("the composition of state maps");
#endif
}

void cuda_release_workspace() {
#ifdef DELTACP_WITH_CUDA
  cuda::release_workspace();
#endif
}

// The one-pass l2 norm of rows (deltacp/cuda/api.h l2norm_rows), on device pointers; deltacp/_l2norm.py
// registers it as the torch op deltacp::l2norm_rows.
void cuda_l2norm_rows(uintptr_t x, uintptr_t y, uintptr_t rstd, int64_t rows, int64_t D, const std::string& dtype,
                      double eps, uintptr_t stream) {
#ifdef DELTACP_WITH_CUDA
  const DType dt = parse_float_dtype(dtype, "x");
  py::gil_scoped_release nogil;
  cuda::l2norm_rows(reinterpret_cast<const void*>(x), reinterpret_cast<void*>(y), reinterpret_cast<float*>(rstd),
                    rows, D, dt, static_cast<float>(eps), reinterpret_cast<void*>(stream));
#else
  (void)x, (void)y, (void)rstd, (void)rows, (void)D, (void)dtype, (void)eps, (void)stream;
  no_cuda("the l2 norm kernel");
#endif
}

void cuda_l2norm_rows_backward(uintptr_t x, uintptr_t rstd, uintptr_t dy, uintptr_t dx, int64_t rows, int64_t D,
                               const std::string& dtype, uintptr_t stream) {
#ifdef DELTACP_WITH_CUDA
  const DType dt = parse_float_dtype(dtype, "x");
  py::gil_scoped_release nogil;
  cuda::l2norm_rows_backward(reinterpret_cast<const void*>(x), reinterpret_cast<const float*>(rstd),
                             reinterpret_cast<const void*>(dy), reinterpret_cast<void*>(dx), rows, D, dt,
                             reinterpret_cast<void*>(stream));
#else
  (void)x, (void)rstd, (void)dy, (void)dx, (void)rows, (void)D, (void)dtype, (void)stream;
  no_cuda("the l2 norm kernel");
#endif
}

// kda's gate over contiguous rows (deltacp/cuda/api.h kda_gate_rows and its backward), on device pointers;
// deltacp/_kda_gate.py makes it a differentiable op. lower_bound 0: FLA's softplus form.
void cuda_kda_gate_rows(uintptr_t g, const std::string& dtype, uintptr_t y, int64_t rows, int64_t HV, int64_t K,
                        uintptr_t A_log, uintptr_t dt_bias, double lower_bound, uintptr_t stream) {
#ifdef DELTACP_WITH_CUDA
  const DType dt = parse_float_dtype(dtype, "g");
  py::gil_scoped_release nogil;
  cuda::kda_gate_rows(reinterpret_cast<const void*>(g), dt, reinterpret_cast<float*>(y), rows, HV, K,
                      reinterpret_cast<const float*>(A_log), reinterpret_cast<const float*>(dt_bias),
                      static_cast<float>(lower_bound), reinterpret_cast<void*>(stream));
#else
  (void)g, (void)dtype, (void)y, (void)rows, (void)HV, (void)K, (void)A_log, (void)dt_bias, (void)lower_bound,
      (void)stream;
  no_cuda("the kda gate kernel");
#endif
}

void cuda_kda_gate_rows_backward(uintptr_t g, const std::string& dtype, uintptr_t dg, uintptr_t dx, uintptr_t dA,
                                 int64_t rows, int64_t HV, int64_t K, uintptr_t A_log, uintptr_t dt_bias,
                                 double lower_bound, uintptr_t stream) {
#ifdef DELTACP_WITH_CUDA
  const DType dt = parse_float_dtype(dtype, "g");
  py::gil_scoped_release nogil;
  cuda::kda_gate_rows_backward(reinterpret_cast<const void*>(g), dt, reinterpret_cast<const float*>(dg),
                               reinterpret_cast<float*>(dx), reinterpret_cast<float*>(dA), rows, HV, K,
                               reinterpret_cast<const float*>(A_log), reinterpret_cast<const float*>(dt_bias),
                               static_cast<float>(lower_bound), reinterpret_cast<void*>(stream));
#else
  (void)g, (void)dtype, (void)dg, (void)dx, (void)dA, (void)rows, (void)HV, (void)K, (void)A_log, (void)dt_bias,
      (void)lower_bound, (void)stream;
  no_cuda("the kda gate kernel");
#endif
}

// (tier, why) of the last CUDA forward or backward this thread launched.
py::tuple cuda_last_tier() {
#ifdef DELTACP_WITH_CUDA
  const cuda::TierChoice c = cuda::last_tier_choice();
  return py::make_tuple(std::string(to_string(c.tier)), c.why);
#else
  return py::make_tuple(std::string("none"), std::string("this deltacp was built without CUDA"));
#endif
}

// (tier, why): the CUDA tier the default dispatch would run the described forward on; launches nothing.
py::tuple cuda_forward_tier(const std::string& variant, const py::dict& tensors, std::optional<double> scale,
                            int chunk_size) {
#ifdef DELTACP_WITH_CUDA
  const Params p = staged_params(variant, tensors, scale, chunk_size, 0, "forward");
  const cuda::TierChoice c = cuda::forward_tier(p);
  return py::make_tuple(std::string(to_string(c.tier)), c.why);
#else
  (void)variant, (void)tensors, (void)scale, (void)chunk_size;
  no_cuda("the CUDA tier choice");
#endif
}

bool cuda_last_forward_kept_wy_stage() {
#ifdef DELTACP_WITH_CUDA
  return cuda::last_forward_kept_wy_stage();
#else
  return false;
#endif
}

bool cuda_supports(const std::string& variant, const std::string& tier, bool backward) {
#ifdef DELTACP_WITH_CUDA
  return cuda::supports(variant_from_string(variant), method_from_string(tier), backward);
#else
  (void)variant;
  (void)tier;
  (void)backward;
  return false;
#endif
}

py::list plan_to_python(const std::vector<CpRankPlan>& plans) {
  py::list out;
  for (const auto& r : plans) {
    py::dict d;
    d["rank"] = r.rank;
    d["world"] = r.world;
    d["begin"] = r.begin;
    d["end"] = r.end;
    d["cu_seqlens"] = r.cu_seqlens;
    d["seq_ids"] = r.seq_ids;
    d["pre_ranks"] = r.pre_ranks;
    d["post_ranks"] = r.post_ranks;
    out.append(d);
  }
  return out;
}

}  // namespace

void register_batch_api(py::module_& m) {
  m.def("run", &run, py::arg("direction"), py::arg("variant"), py::arg("method"), py::arg("compute"),
        py::arg("tensors"), py::arg("scale") = py::none(), py::arg("chunk_size") = 64, py::arg("cuts") = py::none(),
        py::arg("stream") = 0, py::arg("want_exchange") = false, py::arg("qk_l2norm") = false,
        py::arg("gate_lower_bound") = py::none(), py::arg("qk_unit_rows") = false,
        py::arg("backward_recomputes") = false,
        "Run one forward or backward pass on described tensors (see bindings/src/batch_api.cpp); qk_l2norm: "
        "q and k l2-normalised inside the CUDA forward (Params::qk_l2norm); gate_lower_bound: the in-kernel kda "
        "gate's lower bound when the tensors hold gate_A_log (Params::gate_A_log; None: FLA's softplus form); "
        "qk_unit_rows: q and k are l2-normalised rows already (Params::qk_unit_rows); backward_recomputes: a "
        "backward recomputing the forward's states follows (Params::backward_recomputes).");
  m.def("built_with_cuda", &built_with_cuda, "True when the CUDA tiers were compiled into this module.");
  m.def("cuda_available", &cuda_available, "True when the CUDA tiers are built and a device is usable.");
  py::class_<StagedBackwardHandle>(m, "StagedBackward",
                                   "A CUDA backward prepared up to the stages that need dht (deltacp/cuda/api.h).");
  m.def("staged_backward_prepare", &staged_prepare, py::arg("variant"), py::arg("method"), py::arg("tensors"),
        py::arg("scale") = py::none(), py::arg("chunk_size") = 64, py::arg("stream") = 0,
        py::arg("qk_unit_rows") = false, py::return_value_policy::take_ownership,
        "Run every backward stage that does not read dht; the tensors must stay alive until 'finish'. "
        "qk_unit_rows: q and k are l2-normalised rows (Params::qk_unit_rows).");
  m.def("staged_backward_step", &staged_step, py::arg("state"), py::arg("step"), py::arg("variant"),
        py::arg("tensors"), py::arg("scale") = py::none(), py::arg("chunk_size") = 64, py::arg("stream") = 0,
        "'dh0_pieces': dh0 of pieces of the prepared rows (a dh0-only problem); 'states': the recompute's "
        "state scan on `stream` (tensors ignored); 'finish': the remaining stages with dht (the same tensors "
        "as prepared).");
  py::class_<StagedForwardHandle>(m, "StagedForward",
                                  "A CUDA forward prepared up to the stages that need h0 (deltacp/cuda/api.h).");
  m.def("staged_forward_prepare", &staged_forward_prepare, py::arg("variant"), py::arg("method"), py::arg("tensors"),
        py::arg("scale") = py::none(), py::arg("chunk_size") = 64, py::arg("stream") = 0,
        py::arg("qk_unit_rows") = false, py::arg("qk_l2norm") = false, py::arg("backward_recomputes") = false,
        py::return_value_policy::take_ownership,
        "Run every forward stage that does not read h0; the tensors must stay alive until 'finish'. "
        "qk_unit_rows: q and k are l2-normalised rows (Params::qk_unit_rows); qk_l2norm: the fused tier "
        "normalises q and k in its kernels (Params::qk_l2norm; the staged tiled forward refuses it); "
        "backward_recomputes: a backward recomputing the forward's states follows (Params::backward_recomputes).");
  m.def("staged_forward_step", &staged_forward_step, py::arg("state"), py::arg("step"), py::arg("variant"),
        py::arg("tensors"), py::arg("scale") = py::none(), py::arg("chunk_size") = 64, py::arg("stream") = 0,
        py::arg("row0") = 0, py::arg("with_values") = true,
        "'state_pieces': final states of pieces over rows [row0, row0 + T) of the prepared problem (a "
        "final-state-only problem; its state may be wider than V: with_values gives its first V columns the "
        "prepared values, the rest zero values); 'finish': the state scan from h0 and the output (the same "
        "tensors as prepared).");
  m.def("scan_pieces", &scan_pieces, py::arg("variant"), py::arg("tensors"), py::arg("n"),
        py::arg("scale") = py::none(), py::arg("chunk_size") = 64, py::arg("method") = "tiled",
        "Where the forward of `method` ('tiled': its state scan; 'fused': its chain) cuts sequence n of the "
        "described forward problem into pieces: token offsets from the sequence's start, [0, ..., len] "
        "([0, len]: not cut).");
  m.def("staged_forward_piece_maps", &staged_forward_piece_maps, py::arg("state"), py::arg("n"),
        py::arg("maps_ptr"), py::arg("numel"),
        "The state scan in pieces' maps of prepared sequence n: every piece's [H | M] from [0 | I] into the "
        "fp32 CUDA buffer at maps_ptr ([P, HV, K, V + K], numel elements), on the prepared stream.");
  m.def("staged_forward_composed_map", &staged_forward_composed_map, py::arg("state"), py::arg("n"),
        py::arg("init_ptr"), py::arg("out_ptr"), py::arg("width"), py::arg("numel"),
        "Those maps composed in fp32, in one kernel on the prepared stream: the state [HV, K, width] leaving "
        "prepared sequence n when entered with the fp32 CUDA buffer at init_ptr (0: [0 | I]), into the one "
        "at out_ptr (numel elements each); width V + K gives [H | M], width V the offset alone.");
  m.def("compose_state_maps", &compose_state_maps, py::arg("maps_ptr"), py::arg("P"), py::arg("HV"), py::arg("K"),
        py::arg("V"), py::arg("width"), py::arg("init_ptr"), py::arg("out_ptr"), py::arg("numel"), py::arg("stream"),
        "Affine state maps [P, HV, K, V + K] (fp32 CUDA) composed in one kernel on `stream`: the state [HV, K, "
        "width] leaving them when entered with init (0: [0 | I]), into out.");
  m.def("cuda_release_workspace", &cuda_release_workspace,
        "Hand the CUDA kernels' cached workspace memory back to the driver (no-op without CUDA).");
  m.def("cuda_l2norm_rows", &cuda_l2norm_rows, py::arg("x"), py::arg("y"), py::arg("rstd"), py::arg("rows"),
        py::arg("D"), py::arg("dtype"), py::arg("eps"), py::arg("stream"),
        "y = x / sqrt(sum(x^2) + eps) over rows of D contiguous elements (device pointers); rstd: 1 / norm.");
  m.def("cuda_l2norm_rows_backward", &cuda_l2norm_rows_backward, py::arg("x"), py::arg("rstd"), py::arg("dy"),
        py::arg("dx"), py::arg("rows"), py::arg("D"), py::arg("dtype"), py::arg("stream"),
        "dx = rstd (dy - y (y . dy)), y = x rstd, over rows of D contiguous elements (device pointers).");
  m.def("cuda_kda_gate_rows", &cuda_kda_gate_rows, py::arg("g"), py::arg("dtype"), py::arg("y"), py::arg("rows"),
        py::arg("HV"), py::arg("K"), py::arg("A_log"), py::arg("dt_bias"), py::arg("lower_bound"), py::arg("stream"),
        "kda's gate of rows of K contiguous raw values into fp32 y (device pointers; lower_bound 0: softplus form).");
  m.def("cuda_kda_gate_rows_backward", &cuda_kda_gate_rows_backward, py::arg("g"), py::arg("dtype"), py::arg("dg"),
        py::arg("dx"), py::arg("dA"), py::arg("rows"), py::arg("HV"), py::arg("K"), py::arg("A_log"),
        py::arg("dt_bias"), py::arg("lower_bound"), py::arg("stream"),
        "The gate's backward: dx (fp32 [rows, K]) and each row's part of A_log's gradient dA (fp32 [rows]).");
  m.def("cuda_last_tier", &cuda_last_tier,
        "(tier, why): the CUDA tier the last forward or backward of this thread ran, and why that one.");
  m.def("cuda_forward_tier", &cuda_forward_tier, py::arg("variant"), py::arg("tensors"), py::arg("scale") = py::none(),
        py::arg("chunk_size") = 64,
        "(tier, why): the CUDA tier the default dispatch would run the described forward on (launches nothing).");
  m.def("cuda_last_forward_kept_wy_stage", &cuda_last_forward_kept_wy_stage,
        "Whether the last CUDA forward of this thread wrote the WY stage it was given (Params::wy_stage).");
  m.def("cuda_supports", &cuda_supports, py::arg("variant"), py::arg("tier"), py::arg("backward"),
        "Whether the CUDA tier implements (variant, direction) in this build.");
  m.def(
      "cp_plan",
      [](const std::vector<int64_t>& cu_seqlens, const std::vector<int64_t>& cuts) {
        return plan_to_python(cp_plan_from_cuts(cu_seqlens, cuts));
      },
      py::arg("cu_seqlens"), py::arg("cuts"), "How ranks cut at `cuts` split a packed batch (cp_plan.h).");
  m.def(
      "cp_plan_even",
      [](const std::vector<int64_t>& cu_seqlens, int world) {
        return plan_to_python(cp_plan_even(cu_seqlens, world));
      },
      py::arg("cu_seqlens"), py::arg("world"), "Equal split over `world` ranks (cp_plan.h).");
}

}  // namespace deltacp::bindings
