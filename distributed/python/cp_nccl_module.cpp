// distributed/python/cp_nccl_module.cpp — the extension module `deltacp._cp_nccl`.
//
// What deltacp.cp needs on GPUs, on raw device pointers and a CUDA stream given as an integer
// (torch's current stream): the NCCL communicator with timeouts, the pre-pass and the merge
// (deltacp/distributed/cp.h). deltacp.cp.nccl_backend wraps it for torch tensors; the package
// imports without this module (CPU-only builds).
//
//   unique_id() -> bytes                            rank 0 makes it; torch.distributed broadcasts it
//   Communicator(unique_id, rank, world, device, timeout_s)
//       .all_gather(send, recv, count, dtype, stream, wait=True)
//       .wait(stream, what)   .confirm(what)  (after all_gather(wait=False))
//       .start_max_i64(values)   .finish_max_i64(what) -> values   (the fingerprint check, off the caller's streams)
//       .abort(reason)   .aborted   .failure      (a failed communicator is dead for good: cp.h)
//   prepass(direction, variant, dtype, n, H, HV, K, V, chunk, scale, tensors, init, out, stream, g_dtype="")
//       tensors: {"q"|"k"|"v"|"g"|"beta"|"a"|"b"|"do": (ptr, stride_t, stride_h)} of the span;
//       g_dtype: g's dtype when it differs from `dtype` ("float32" beside bfloat16/float16 inputs)
//   merge(gathered, HV, K, V, first, count, step, out, stream)
//
// deltacp::Error -> _cp_nccl.Error (a ValueError); CommTimeout -> _cp_nccl.CommTimeout (a
// RuntimeError); CommDead (any call after the communicator failed) -> _cp_nccl.CommDead (a
// RuntimeError); other failures -> RuntimeError. The GIL is released while waiting and aborting.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "deltacp/distributed/cp.h"
#include "deltacp/error.h"
#include "deltacp/params.h"

namespace py = pybind11;
using namespace deltacp;

namespace {

int dtype_code(const std::string& d) {
  if (d == "float32") return dist::kF32;
  if (d == "float64") return dist::kF64;
  if (d == "bfloat16") return dist::kBf16;
  if (d == "float16") return dist::kF16;
  throw Error("dtype", "expected float32, float64, bfloat16 or float16, got '" + d + "'");
}

void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

using View = std::tuple<uintptr_t, int64_t, int64_t>;  // (ptr, stride_t, stride_h)

void run_prepass(const std::string& direction, const std::string& variant, const std::string& dtype, int64_t n,
                 int64_t H, int64_t HV, int64_t K, int64_t V, int chunk, double scale,
                 const std::map<std::string, View>& tensors, uintptr_t init, uintptr_t out, uintptr_t stream,
                 const std::string& g_dtype) {
  dist::Span s;
  s.variant = static_cast<int>(variant_from_string(variant));
  s.dtype = dtype_code(dtype);
  if (!g_dtype.empty() && g_dtype != dtype) {
    const int code = dtype_code(g_dtype);
    if (code != dist::kF32) {
      throw Error("g", "expected g in the inputs' dtype " + dtype + " or float32, got " + g_dtype);
    }
    s.g_dtype = code;
  }
  s.n = n;
  s.H = H;
  s.HV = HV;
  s.K = K;
  s.V = V;
  s.chunk = chunk;
  s.scale = static_cast<float>(scale);
  const std::map<std::string, dist::Ref*> fields = {{"q", &s.q}, {"k", &s.k},       {"v", &s.v}, {"g", &s.g},
                                                    {"beta", &s.beta}, {"a", &s.a}, {"b", &s.b}, {"do", &s.dout}};
  for (const auto& [name, view] : tensors) {
    auto it = fields.find(name);
    if (it == fields.end()) throw Error(name, "is not a tensor of the CP pre-pass");
    *it->second = dist::Ref{as_ptr(std::get<0>(view)), std::get<1>(view), std::get<2>(view)};
  }
  for (const char* need : {"q", "k", "v"})
    if (!fields.at(need)->ptr) throw Error(need, "is required");
  if (s.variant != dist::kDelta && !s.g.ptr) throw Error("g", "is required for variant " + variant);
  if (s.variant == dist::kDplr && (!s.a.ptr || !s.b.ptr)) throw Error("a", "a and b are required for dplr");
  if (s.variant != dist::kDplr && !s.beta.ptr) throw Error("beta", "is required for variant " + variant);
  py::gil_scoped_release nogil;
  if (direction == "forward") {
    dist::prepass_forward(s, static_cast<const float*>(as_ptr(init)), static_cast<float*>(as_ptr(out)),
                          as_ptr(stream));
  } else if (direction == "backward") {
    dist::prepass_backward(s, static_cast<const float*>(as_ptr(init)), static_cast<float*>(as_ptr(out)),
                           as_ptr(stream));
  } else {
    throw Error("direction", "expected 'forward' or 'backward', got '" + direction + "'");
  }
}

}  // namespace

PYBIND11_MODULE(_cp_nccl, m) {
  m.doc() = "deltacp context parallelism on GPUs: NCCL communicator with timeouts, CP pre-pass and merge";
  // Module-local: these translate only what this module's functions throw. A global registration would
  // also catch the deltacp::Error thrown inside deltacp._core once this module is imported, and turn the
  // package's exception classes (deltacp.OutOfMemoryError, ...) into this module's plain Error.
  py::register_local_exception<Error>(m, "Error", PyExc_ValueError);
  py::register_local_exception<dist::CommTimeout>(m, "CommTimeout", PyExc_RuntimeError);
  py::register_local_exception<dist::CommDead>(m, "CommDead", PyExc_RuntimeError);
  py::register_local_exception<dist::CommBusy>(m, "CommBusy", PyExc_RuntimeError);

  m.def("unique_id", [] { return py::bytes(dist::nccl_unique_id()); }, "A new ncclUniqueId as bytes (on rank 0).");

  py::class_<dist::NcclComm, std::shared_ptr<dist::NcclComm>>(m, "Communicator")
      .def(py::init([](py::bytes id, int rank, int world, int device, double timeout_s, bool blocking_gather) {
             std::string raw = id;
             py::gil_scoped_release nogil;
             return std::make_shared<dist::NcclComm>(raw, rank, world, device, timeout_s, blocking_gather);
           }),
           py::arg("unique_id"), py::arg("rank"), py::arg("world"), py::arg("device"), py::arg("timeout_s"),
           py::arg("blocking_gather") = false)
      .def(
          "all_gather",
          [](dist::NcclComm& c, uintptr_t send, uintptr_t recv, size_t count, const std::string& dtype,
             uintptr_t stream, bool wait) {
            const int code = dtype_code(dtype);
            py::gil_scoped_release nogil;
            c.all_gather(as_ptr(send), as_ptr(recv), count, code, as_ptr(stream), wait);
          },
          py::arg("send"), py::arg("recv"), py::arg("count"), py::arg("dtype"), py::arg("stream"),
          py::arg("wait") = true)
      .def(
          "confirm",
          [](dist::NcclComm& c, const std::string& what) {
            py::gil_scoped_release nogil;
            c.confirm(what);
          },
          py::arg("what"))
      .def(
          "start_max_i64",
          [](dist::NcclComm& c, const std::vector<int64_t>& values) {
            py::gil_scoped_release nogil;
            c.start_max_i64(values);
          },
          py::arg("values"))
      .def(
          "finish_max_i64",
          [](dist::NcclComm& c, const std::string& what) {
            py::gil_scoped_release nogil;
            return c.finish_max_i64(what);
          },
          py::arg("what"))
      .def(
          "wait",
          [](dist::NcclComm& c, uintptr_t stream, const std::string& what) {
            py::gil_scoped_release nogil;
            c.wait(as_ptr(stream), what);
          },
          py::arg("stream"), py::arg("what"))
      .def(
          "abort",
          [](dist::NcclComm& c, const std::string& reason) {
            py::gil_scoped_release nogil;
            c.abort(reason);
          },
          py::arg("reason") = "abort() was called")
      .def_property_readonly("aborted", &dist::NcclComm::aborted)
      .def_property_readonly("failure", &dist::NcclComm::failure)
      .def_property_readonly("rank", &dist::NcclComm::rank)
      .def_property_readonly("world", &dist::NcclComm::world)
      .def_property_readonly("timeout", &dist::NcclComm::timeout);

  m.def("prepass", &run_prepass, py::arg("direction"), py::arg("variant"), py::arg("dtype"), py::arg("n"),
        py::arg("H"), py::arg("HV"), py::arg("K"), py::arg("V"), py::arg("chunk"), py::arg("scale"),
        py::arg("tensors"), py::arg("init"), py::arg("out"), py::arg("stream"), py::arg("g_dtype") = "",
        "The CP pre-pass over one span: out [HV, K, V + K] fp32 = [H | M] (forward) or [dH | M^T] (backward).");
  m.def(
      "merge",
      [](uintptr_t gathered, int64_t HV, int64_t K, int64_t V, int64_t first, int64_t count, int64_t step,
         uintptr_t out, uintptr_t stream) {
        py::gil_scoped_release nogil;
        dist::merge(static_cast<const float*>(as_ptr(gathered)), HV, K, V, first, count, step,
                    static_cast<float*>(as_ptr(out)), as_ptr(stream));
      },
      py::arg("gathered"), py::arg("HV"), py::arg("K"), py::arg("V"), py::arg("first"), py::arg("count"),
      py::arg("step"), py::arg("out"), py::arg("stream"),
      "S = 0; S <- A_j S + B_j over gathered [world, HV, K, V + K] buffers j = first, first + step, ...");
}
