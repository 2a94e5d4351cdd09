// bindings/src/module.cpp — the extension module `deltacp._core`.
//
// deltacp::Error (bad input, naming the argument) becomes `deltacp._core.Error`, a subclass of
// Python's ValueError, so `except ValueError` catches it; wrong dtypes are raised as TypeError at
// the binding layer; anything else from C++ (CUDA failures) arrives as RuntimeError.
#include <pybind11/pybind11.h>

#include "deltacp/error.h"

namespace py = pybind11;

namespace deltacp::bindings {
void register_batch_api(py::module_& m);  // batch_api.cpp: run, cuda_*, cp_plan
void register_head_api(py::module_& m);   // head_api.cpp: per-(sequence, head) reference pieces
}  // namespace deltacp::bindings

PYBIND11_MODULE(_core, m) {
  m.doc() = "deltacp C++ core: the Eigen reference and (when built) the CUDA tiers on FLA-layout tensors";
  py::register_exception<deltacp::Error>(m, "Error", PyExc_ValueError);
  deltacp::bindings::register_batch_api(m);
  deltacp::bindings::register_head_api(m);
}
