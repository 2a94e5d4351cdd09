// bindings/src/workspace_api.cpp — where the CUDA kernels' workspaces come from, seen from Python.
//
//   cuda_set_workspace_allocator(alloc, free, init)  alloc(bytes, stream) -> device pointer (int), free(ptr):
//                                                     torch's caching allocator (deltacp/_workspace.py installs
//                                                     it when the torch ops load); None, None, None: deltacp's pool
//   cuda_workspace_stats() -> dict                    cuda/common/workspace_pool.h workspace_stats()
//   cuda_reset_workspace_peaks()                      reset_workspace_peaks()
//
// Why torch's allocator through Python callables, not torch's C++ API: the module does not link libtorch
// (it builds and imports without torch), and c10's raw_alloc_with_stream / raw_delete are inline calls
// through a virtual interface whose layout changes between torch releases, so reaching them from a binary
// built against no particular torch is an ABI guess. torch.cuda.caching_allocator_alloc(size, device,
// stream) / caching_allocator_delete(ptr) are documented and take the stream; deltacp/_workspace.py passes
// their underlying torch._C functions where torch has them (the same calls without the device context
// manager; it falls back to the documented ones). A workspace allocation is a few per forward or
// backward call, each a Python call of some microseconds, against milliseconds of kernels.
//
// The GIL: _core.run releases it around the CUDA calls, and workspace_alloc / workspace_free run inside,
// on any thread (torch's autograd threads included); each hook call takes the GIL for the Python call
// only (pybind11's gil_scoped_acquire works whether or not this thread holds it). No deltacp lock is held
// meanwhile (workspace_pool.h). A free that comes after the interpreter began to finalise is skipped: the
// process is ending and torch's allocator with it.
//
// Out of memory: torch's allocator raises torch.OutOfMemoryError after it has emptied its cache and
// retried; the hook turns that into deltacp::OutOfMemory (deltacp.OutOfMemoryError) naming the bytes
// requested and free, as the pool does.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>

#include "deltacp/error.h"
#ifdef DELTACP_WITH_CUDA
#include <cuda_runtime_api.h>

#include "common/workspace_pool.h"
#endif

namespace py = pybind11;

namespace deltacp::bindings {
namespace {

#ifdef DELTACP_WITH_CUDA
// One installation's Python callables, leaked on purpose: a block goes back to the callables that made
// it, also after another installation, and may be freed while the interpreter shuts down, when py::object
// destructors must not run.
struct TorchHook {
  py::object alloc, free, init;
  bool initialised = false;
};

bool interpreter_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

void* torch_alloc(size_t bytes, cudaStream_t stream, void* ctx) {
  TorchHook* hook = static_cast<TorchHook*>(ctx);
  if (!interpreter_alive()) throw Error("cuda", "the Python interpreter is shutting down: no workspace from torch");
  std::string failure;
  bool oom = false;
  void* ptr = nullptr;
  {
    py::gil_scoped_acquire gil;
    try {
      if (!hook->initialised) {  // torch's CUDA state (its allocator included) exists from here on
        if (!hook->init.is_none()) hook->init();
        hook->initialised = true;
      }
      const py::object r = hook->alloc(bytes, reinterpret_cast<uintptr_t>(stream));
      ptr = reinterpret_cast<void*>(r.cast<uintptr_t>());
    } catch (py::error_already_set& e) {
      oom = e.matches(PyExc_MemoryError) || std::string(e.what()).find("out of memory") != std::string::npos;
      failure = e.what();
    } catch (const std::exception& e) {  // a result that is not an integer, say
      failure = e.what();
    }
  }
  if (oom) {
    size_t free_b = 0, total_b = 0;
    (void)cudaMemGetInfo(&free_b, &total_b);
    (void)cudaGetLastError();
    const double GiB = 1024.0 * 1024.0 * 1024.0;
    throw_error_as<OutOfMemory>("cuda", "out of device memory for the kernels' workspace: requested ", bytes,
                                " bytes (", bytes / GiB, " GiB), free on the device ", free_b, " bytes (",
                                free_b / GiB, " GiB) of ", total_b, " (", total_b / GiB,
                                " GiB); the workspace comes from torch's caching allocator, which had emptied "
                                "its cache and retried");
  }
  if (!failure.empty()) {
    const size_t nl = failure.find('\n');
    throw Error("cuda", "torch's caching allocator refused the kernels' workspace of " + std::to_string(bytes) +
                            " bytes: " + failure.substr(0, nl));
  }
  if (ptr == nullptr) throw Error("cuda", "torch's caching allocator returned no memory for the workspace");
  return ptr;
}

void torch_free(void* ptr, cudaStream_t, void* ctx) noexcept {
  if (!interpreter_alive()) return;  // the process is ending (see above)
  py::gil_scoped_acquire gil;
  try {
    static_cast<TorchHook*>(ctx)->free(reinterpret_cast<uintptr_t>(ptr));
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("deltacp: returning a workspace block to torch's caching allocator");
  } catch (...) {
  }
}
#endif

void set_workspace_allocator(py::object alloc, py::object free, py::object init) {
#ifdef DELTACP_WITH_CUDA
  if (alloc.is_none() != free.is_none())
    throw Error("free", "expected alloc and free both callables or both None");
  if (alloc.is_none()) {
    cuda::set_workspace_allocator(nullptr);
    return;
  }
  if (!PyCallable_Check(alloc.ptr()) || !PyCallable_Check(free.ptr()))
    throw Error("alloc", "expected callables alloc(bytes, stream) -> int and free(ptr)");
  // Blocks already handed out keep their allocator (workspace_pool.h records it per block), so every
  // installation stays alive (leaked: a few hundred bytes each).
  auto* hook = new TorchHook{alloc, free, init, false};
  cuda::set_workspace_allocator(new cuda::WorkspaceAllocator{&torch_alloc, &torch_free, hook, "torch"});
#else
  (void)alloc, (void)free, (void)init;
#endif
}

py::dict workspace_stats() {
  py::dict d;
#ifdef DELTACP_WITH_CUDA
  const cuda::WorkspaceStats s = cuda::workspace_stats();
  d["allocator"] = std::string(s.allocator);
  d["current_bytes"] = s.current_bytes;
  d["peak_bytes"] = s.peak_bytes;
  d["reserved_bytes"] = s.reserved_bytes;
  d["peak_reserved_bytes"] = s.peak_reserved_bytes;
  d["torch_current_bytes"] = s.hooked_current_bytes;
  d["torch_peak_bytes"] = s.hooked_peak_bytes;
#else
  d["allocator"] = std::string("none");
  for (const char* k : {"current_bytes", "peak_bytes", "reserved_bytes", "peak_reserved_bytes",
                        "torch_current_bytes", "torch_peak_bytes"})
    d[k] = 0;
#endif
  return d;
}

// One workspace_alloc (and, with free_on, its workspace_free on stream free_on) with the GIL released, as
// the kernels' launchers make them: the tests drive the hook through it, on machines without a GPU too.
uintptr_t workspace_probe(size_t bytes, uintptr_t stream, std::optional<uintptr_t> free_on) {
#ifdef DELTACP_WITH_CUDA
  py::gil_scoped_release nogil;
  void* p = cuda::workspace_alloc(bytes, reinterpret_cast<cudaStream_t>(stream));
  if (free_on) cuda::workspace_free(p, reinterpret_cast<cudaStream_t>(*free_on));
  return reinterpret_cast<uintptr_t>(p);
#else
  (void)bytes, (void)stream, (void)free_on;
  throw Error("backend", "the workspace needs the CUDA tiers, but this deltacp was built without CUDA");
#endif
}

void workspace_probe_free(uintptr_t ptr, uintptr_t stream) {
#ifdef DELTACP_WITH_CUDA
  py::gil_scoped_release nogil;
  cuda::workspace_free(reinterpret_cast<void*>(ptr), reinterpret_cast<cudaStream_t>(stream));
#else
  (void)ptr, (void)stream;
#endif
}

void reset_workspace_peaks() {
#ifdef DELTACP_WITH_CUDA
  cuda::reset_workspace_peaks();
#endif
}

}  // namespace

void register_workspace_api(py::module_& m) {
  m.def("cuda_set_workspace_allocator", &set_workspace_allocator, py::arg("alloc"), py::arg("free"),
        py::arg("init") = py::none(),
        "Route the CUDA kernels' workspaces to alloc(bytes, stream) -> pointer and free(pointer) (torch's "
        "caching allocator); init() runs once before the first alloc; None, None: deltacp's own pool.");
  m.def("cuda_workspace_stats", &workspace_stats,
        "The kernels' workspace bytes: in use and high-water mark outside torch (deltacp's pool), the pool's "
        "mapped bytes and their high-water mark, and the bytes taken through torch's allocator.");
  m.def("_workspace_probe", &workspace_probe, py::arg("bytes"), py::arg("stream") = 0,
        py::arg("free_on") = py::none(),
        "Tests: one workspace allocation (and free on stream free_on) through the current allocator, the GIL "
        "released; returns the pointer.");
  m.def("_workspace_probe_free", &workspace_probe_free, py::arg("ptr"), py::arg("stream") = 0,
        "Tests: workspace_free of a pointer from _workspace_probe.");
  m.def("cuda_reset_workspace_peaks", &reset_workspace_peaks,
        "Restart every workspace high-water mark from the current value.");
}

}  // namespace deltacp::bindings
