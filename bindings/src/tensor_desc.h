// bindings/src/tensor_desc.h — a tensor as the Python front ends describe it, and the Params built
// from a set of them.
//
// numpy and torch both reduce an array to (data pointer, dtype, shape, element strides, device):
//   numpy: (a.ctypes.data, a.dtype.name, a.shape, [s // a.itemsize for s in a.strides], "cpu")
//   torch: (t.data_ptr(), "float32", t.shape, t.stride(), "cuda:0")
// build_params() checks every description against the sizes read off q and v (shape, dtype,
// device, last dimension contiguous) and fills deltacp::Params with the caller's pointers and
// strides: nothing is copied. Bad input throws deltacp::Error (-> ValueError) naming the argument,
// or pybind11::type_error (-> TypeError) for a wrong dtype.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "deltacp/params.h"

namespace deltacp::bindings {

struct TensorDesc {
  std::string name;  // the argument's name as the user wrote it, for error messages
  uintptr_t ptr = 0;
  std::string dtype;  // numpy/torch spelling: float64, float32, bfloat16, float16, int64, ...
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements
  std::string device;            // "cpu" or "cuda:<index>"

  bool on_cpu() const { return device == "cpu"; }
  int64_t numel() const;
  std::string shape_str() const;
};

// Parses {field: (ptr, dtype, shape, strides, device[, user_name]) or None}; `field` is the Params
// member (q, k, v, g, beta, a, b, h0, o, ht, dout, dht, dq, ..., dh0, cu_seqlens, cu_seqlens_host),
// user_name the argument's name in the public API (dplr's "gk" for g). Unknown fields are rejected.
std::map<std::string, TensorDesc> parse_descs(const pybind11::dict& tensors);

// "float64" -> DType::f64 ...; throws pybind11::type_error naming `argument` for anything else.
DType parse_float_dtype(const std::string& dtype, const std::string& argument);

// Where the work runs: the reference on the host, or a CUDA tier on a device.
enum class Place { host, cuda };

// Fills a Params from the descriptions. `direction` is "forward" or "backward" (which tensors are
// allowed). A forward may leave out "o" when "ht" is given (final-state-only forward); a backward
// may leave out every input gradient when "dh0" is given (dh0-only backward; params.h). Sizes come from q [B, T, H, K] and v [B, T, HV, V]; N from cu_seqlens or B.
// No scale means K^-1/2.
Params build_params(const std::string& variant, const std::string& direction,
                    const std::map<std::string, TensorDesc>& descs, std::optional<double> scale, int chunk_size,
                    Place place);

}  // namespace deltacp::bindings
