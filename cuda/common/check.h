// cuda/common/check.h — CUDA error checks that throw deltacp::Error("cuda", ...).
//
//   DELTACP_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream));  // any cudaError_t expression
//   kernel<<<grid, block, smem, stream>>>(...);
//   DELTACP_CUDA_CHECK_LAUNCH();                                  // cudaGetLastError after a launch
//
// The message names the failing expression, cudaGetErrorString and the source file's name and line
// (not the build machine's path), so a bad launch configuration reads as one line instead of a silent
// wrong answer. An out-of-memory throws deltacp::OutOfMemory (Python: deltacp.OutOfMemoryError).
// Host-only header (plain C++ plus the CUDA runtime API); usable from .cu and .cpp files.
#pragma once

#include <cuda_runtime_api.h>

#include "deltacp/error.h"

namespace deltacp::cuda::detail {

// "cuda/tiled/tiled_fwd.cu" from __FILE__ (an absolute path of the build machine): the part from the
// last "cuda/" on, else the file name.
inline const char* source_name(const char* file) {
  const char* base = file;
  for (const char* c = file; *c; ++c) {
    if (c[0] == 'c' && c[1] == 'u' && c[2] == 'd' && c[3] == 'a' && c[4] == '/' && (c == file || c[-1] == '/'))
      base = c;
  }
  if (base != file) return base;
  for (const char* c = file; *c; ++c)
    if (*c == '/') base = c + 1;
  return base;
}

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  // Reset the runtime's last-error slot (for non-sticky errors) so a later, unrelated
  // cudaGetLastError() does not report this failure a second time.
  (void)cudaGetLastError();
  if (err == cudaErrorMemoryAllocation)
    ::deltacp::throw_error_as<::deltacp::OutOfMemory>("cuda", expr, " failed: out of device memory (",
                                                      source_name(file), ":", line, ")");
  ::deltacp::throw_error("cuda", expr, " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err), " (",
                         source_name(file), ":", line, ")");
}

}  // namespace deltacp::cuda::detail

#define DELTACP_CUDA_CHECK(expr)                                                          \
  do {                                                                                    \
    const cudaError_t deltacp_cuda_err_ = (expr);                                         \
    if (deltacp_cuda_err_ != cudaSuccess)                                                 \
      ::deltacp::cuda::detail::throw_cuda_error(deltacp_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a <<<...>>> launch: reports an invalid configuration (too much shared memory, bad grid).
#define DELTACP_CUDA_CHECK_LAUNCH() DELTACP_CUDA_CHECK(cudaGetLastError())
