// bindings/src/module.cpp — the extension module `deltacp._core`.
//
// Errors: every deltacp::Error reaching Python is raised as its class of deltacp/errors.py, each a
// deltacp.DeltaCPError and the builtin it stands for (reference/include/deltacp/error.h lists the kinds):
//   deltacp::NumericError            -> deltacp.NumericError       (ValueError)
//   deltacp::OutOfMemory             -> deltacp.OutOfMemoryError   (MemoryError)
//   deltacp::Error, argument 'cuda'  -> deltacp.CUDAError          (RuntimeError)
//   deltacp::Error                   -> deltacp.InvalidArgumentError (ValueError)
//   a dtype refused by the binding layer (py::type_error "deltacp: argument ...") -> deltacp.DTypeError
// Each exception carries .argument, the offending argument's name. `deltacp._core.Error` is
// deltacp.InvalidArgumentError.
#include <pybind11/pybind11.h>

#include <cstring>
#include <exception>

#include "deltacp/error.h"

namespace py = pybind11;

namespace deltacp::bindings {
void register_batch_api(py::module_& m);  // batch_api.cpp: run, cuda_*, cp_plan
void register_head_api(py::module_& m);   // head_api.cpp: per-(sequence, head) reference pieces
void register_attention_api(py::module_& m);  // attention_api.cpp: ring attention's CUDA step (CUDA builds)
void register_workspace_api(py::module_& m);  // workspace_api.cpp: the kernels' workspace allocator and bytes
}  // namespace deltacp::bindings

namespace {

// Raises deltacp.errors.<cls>(message, argument) as the pending Python exception.
void raise_as(const char* cls, const char* message, const std::string& argument) {
  py::object type = py::module_::import("deltacp.errors").attr(cls);
  py::object exc = type(py::str(message), py::str(argument));
  PyErr_SetObject(type.ptr(), exc.ptr());
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const deltacp::NumericError& e) {
    raise_as("NumericError", e.what(), e.argument());
  } catch (const deltacp::OutOfMemory& e) {
    raise_as("OutOfMemoryError", e.what(), e.argument());
  } catch (const deltacp::Error& e) {
    raise_as(e.argument() == "cuda" ? "CUDAError" : "InvalidArgumentError", e.what(), e.argument());
  } catch (const py::type_error& e) {
    // The binding layer's dtype checks (tensor_desc.cpp) throw py::type_error("deltacp: argument ...").
    if (std::strncmp(e.what(), "deltacp: argument '", 19) != 0) throw;
    const std::string msg = e.what();
    const size_t end = msg.find('\'', 19);
    raise_as("DTypeError", e.what(), end == std::string::npos ? std::string() : msg.substr(19, end - 19));
  }
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "deltacp C++ core: the Eigen reference and (when built) the CUDA tiers on FLA-layout tensors";
  py::register_exception_translator(&translate);
  m.attr("Error") = py::module_::import("deltacp.errors").attr("InvalidArgumentError");
  deltacp::bindings::register_batch_api(m);
  deltacp::bindings::register_head_api(m);
  deltacp::bindings::register_attention_api(m);
  deltacp::bindings::register_workspace_api(m);
}
