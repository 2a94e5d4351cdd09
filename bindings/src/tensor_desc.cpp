// bindings/src/tensor_desc.cpp — tensor descriptions -> deltacp::Params, with every check that needs
// the shapes (Params itself only carries sizes and strides, so shapes are checked here, once, for
// both the numpy and the torch front ends).
//
// Expected shapes (FLA's layouts, docs/design.md section 6):
//   q, k, dq, dk              [B, T, H, K]
//   v, o, dout, dv            [B, T, HV, V]
//   g, dg                     gdn [B, T, HV]; kda, dplr [B, T, HV, K]; delta: none
//   beta, dbeta               [B, T, HV] (not dplr)
//   a, b, da, db              [B, T, HV, K] (dplr only)
//   h0, ht, dht, dh0          [N, HV, K, V], contiguous
//   cu_seqlens(_host)         [N + 1] int64, contiguous
#include "tensor_desc.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "deltacp/error.h"

namespace py = pybind11;

namespace deltacp::bindings {

int64_t TensorDesc::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// std::to_string, not an ostream: see deltacp/error.h (integers through std::ostream crashed inside
// a torch process on the GPU machines).
static std::string dims_str(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

std::string TensorDesc::shape_str() const { return dims_str(shape); }

// The fields a caller may describe, by direction.
static const std::set<std::string> kForwardFields = {"q", "k", "v", "g", "beta", "a", "b", "h0",
                                                     "o", "ht", "cu_seqlens", "cu_seqlens_host",
                                                     "gate_A_log", "gate_dt_bias", "chunk_h", "chunk_vnew",
                                                     "wy_stage", "gate_range"};
static const std::set<std::string> kBackwardFields = {
    "q",    "k",  "v",  "g",  "beta", "a",  "b",  "h0",     "dout", "dht", "dq",
    "dk",   "dv", "dg", "dbeta", "da", "db", "dh0", "cu_seqlens", "cu_seqlens_host", "chunk_h", "chunk_vnew",
    "wy_stage"};

std::map<std::string, TensorDesc> parse_descs(const py::dict& tensors) {
  std::map<std::string, TensorDesc> out;
  for (auto item : tensors) {
    const std::string field = py::cast<std::string>(item.first);
    if (item.second.is_none()) continue;
    auto tup = py::cast<py::tuple>(item.second);
    if (tup.size() != 5 && tup.size() != 6) {
      throw Error(field, "internal: a tensor description is (ptr, dtype, shape, strides, device[, name])");
    }
    TensorDesc d;
    d.ptr = py::cast<uintptr_t>(tup[0]);
    d.dtype = py::cast<std::string>(tup[1]);
    d.shape = py::cast<std::vector<int64_t>>(tup[2]);
    d.strides = py::cast<std::vector<int64_t>>(tup[3]);
    d.device = py::cast<std::string>(tup[4]);
    d.name = tup.size() == 6 ? py::cast<std::string>(tup[5]) : field;
    if (d.shape.size() != d.strides.size()) {
      throw Error(d.name, "internal: shape " + dims_str(d.shape) + " and strides " + dims_str(d.strides) +
                              " differ in length");
    }
    out.emplace(field, std::move(d));
  }
  return out;
}

DType parse_float_dtype(const std::string& dtype, const std::string& argument) {
  if (dtype == "float64") return DType::f64;
  if (dtype == "float32") return DType::f32;
  if (dtype == "bfloat16") return DType::bf16;
  if (dtype == "float16") return DType::f16;
  throw py::type_error("deltacp: argument '" + argument +
                       "': expected a floating dtype (float64, float32, bfloat16 or float16), got " + dtype);
}

namespace {

// Builder state: the descriptions and the sizes read so far.
struct Checker {
  const std::map<std::string, TensorDesc>& descs;
  Place place;
  std::string device;  // q's device
  DType dtype = DType::f32;

  const TensorDesc* find(const std::string& field) const {
    auto it = descs.find(field);
    return it == descs.end() ? nullptr : &it->second;
  }

  void check_device(const TensorDesc& d, bool host_copy = false) const {
    if (host_copy || place == Place::host) {
      if (!d.on_cpu()) {
        throw Error(d.name, std::string("expected a CPU tensor") +
                                (host_copy ? " (the host copy of cu_seqlens)" : " (the reference runs on the host)") +
                                ", got device " + d.device);
      }
    } else if (d.device != device) {
      throw Error(d.name, "expected device " + device + " (like q), got " + d.device);
    }
    if (d.ptr == 0 && d.numel() > 0) throw Error(d.name, "got a null data pointer");
  }

  void check_shape(const TensorDesc& d, const std::vector<int64_t>& expected, const char* pattern) const {
    if (d.shape != expected) {
      throw Error(d.name, std::string("expected shape ") + pattern + " = " + dims_str(expected) + ", got " +
                              d.shape_str());
    }
  }

  // A [B, T, heads(, D)] tensor of the compute dtype: shape, dtype, device, last dim contiguous.
  // gate_fp32 (g and dg only): non-null means float32 is accepted besides the compute dtype, as
  // FLA keeps the log decay in fp32 beside bf16 q, k, v; *gate_fp32 records which was given, and
  // dg must then match g.
  TensorRef data(const std::string& field, const std::vector<int64_t>& expected, const char* pattern,
                 bool* gate_fp32 = nullptr, bool gate_seen = false) const {
    const TensorDesc* d = find(field);
    if (!d) return TensorRef{};
    check_shape(*d, expected, pattern);
    DType dt = parse_float_dtype(d->dtype, d->name);
    if (gate_fp32 && dt == DType::f32 && dtype != DType::f32) {
      if (gate_seen && !*gate_fp32) {
        throw py::type_error("deltacp: argument '" + d->name + "': expected dtype " + to_string(dtype) +
                             " (like the gate), got " + d->dtype);
      }
      *gate_fp32 = true;
    } else if (gate_fp32 && gate_seen && *gate_fp32) {
      throw py::type_error("deltacp: argument '" + d->name + "': expected dtype float32 (like the gate), got " +
                           d->dtype);
    } else if (dt != dtype) {
      throw py::type_error("deltacp: argument '" + d->name + "': expected dtype " + to_string(dtype) +
                           (gate_fp32 ? " (like q) or float32" : " (like q)") + ", got " + d->dtype);
    }
    check_device(*d);
    if (d->shape.size() == 4 && d->shape[3] > 1 && d->strides[3] != 1) {
      throw Error(d->name, "must be contiguous in its last dimension (stride 1), got strides " +
                               dims_str(d->strides));
    }
    return TensorRef{reinterpret_cast<void*>(d->ptr), d->strides[0], d->strides[1], d->strides[2]};
  }

  // A [N, HV, K, V] state: shape, device, row-major contiguous; returns its pointer.
  void* state(const std::string& field, const std::vector<int64_t>& expected, DType* state_dtype,
              bool* state_dtype_set) const {
    const TensorDesc* d = find(field);
    if (!d) return nullptr;
    check_shape(*d, expected, "[N, HV, K, V]");
    DType dt = parse_float_dtype(d->dtype, d->name);
    if (*state_dtype_set && dt != *state_dtype) {
      throw py::type_error("deltacp: argument '" + d->name + "': expected dtype " + to_string(*state_dtype) +
                           " (like the other states), got " + d->dtype);
    }
    *state_dtype = dt;
    *state_dtype_set = true;
    check_device(*d);
    int64_t want = 1;
    for (int i = 3; i >= 0; --i) {
      if (d->shape[i] > 1 && d->strides[i] != want) {
        throw Error(d->name, "must be contiguous (a [N, HV, K, V] row-major state), got strides " +
                                 dims_str(d->strides));
      }
      want *= d->shape[i];
    }
    return reinterpret_cast<void*>(d->ptr);
  }

  // A per-chunk intermediate kept from the forward for the backward (Params::chunk_h, chunk_vnew): the compute
  // dtype, row-major contiguous; returns its pointer.
  void* kept(const std::string& field, const std::vector<int64_t>& expected, const char* pattern) const {
    const TensorDesc* d = find(field);
    if (!d) return nullptr;
    if (place == Place::host) throw Error(d->name, "the reference keeps no per-chunk states; pass none");
    check_shape(*d, expected, pattern);
    if (parse_float_dtype(d->dtype, d->name) != dtype) {
      throw py::type_error("deltacp: argument '" + d->name + "': expected dtype " + to_string(dtype) + " (like q), got " +
                           d->dtype);
    }
    check_device(*d);
    int64_t want = 1;
    for (int i = static_cast<int>(d->shape.size()) - 1; i >= 0; --i) {
      if (d->shape[i] > 1 && d->strides[i] != want) {
        throw Error(d->name, std::string("must be contiguous ") + pattern + ", got strides " + dims_str(d->strides));
      }
      want *= d->shape[i];
    }
    return reinterpret_cast<void*>(d->ptr);
  }

  // cu_seqlens or its host copy: [N + 1] int64 with stride 1.
  const int64_t* offsets(const TensorDesc& d, bool host_copy) const {
    if (d.dtype != "int64") {
      throw py::type_error("deltacp: argument '" + d.name + "': expected dtype int64, got " + d.dtype);
    }
    if (d.shape.size() != 1) throw Error(d.name, "expected a 1-D tensor [N + 1], got shape " + d.shape_str());
    if (d.shape[0] < 2) throw Error(d.name, "expected at least 2 entries [0, ..., T], got " + d.shape_str());
    if (d.shape[0] > 1 && d.strides[0] != 1) {
      throw Error(d.name, "must be contiguous, got stride " + std::to_string(d.strides[0]));
    }
    check_device(d, host_copy);
    return reinterpret_cast<const int64_t*>(d.ptr);
  }
};

}  // namespace

Params build_params(const std::string& variant, const std::string& direction,
                    const std::map<std::string, TensorDesc>& descs, std::optional<double> scale, int chunk_size,
                    Place place) {
  const bool backward = direction == "backward";
  if (!backward && direction != "forward") {
    throw Error("direction", "expected 'forward' or 'backward', got '" + direction + "'");
  }
  Params p;
  p.variant = variant_from_string(variant);
  const auto& allowed = backward ? kBackwardFields : kForwardFields;
  for (const auto& [field, d] : descs) {
    if (!allowed.count(field)) throw Error(d.name, "internal: not an argument of the " + direction + " pass");
  }

  Checker c{descs, place, "", DType::f32};
  const TensorDesc* q = c.find("q");
  const TensorDesc* v = c.find("v");
  if (!q) throw Error("q", "is required");
  if (!c.find("k")) throw Error("k", "is required");
  if (!v) throw Error("v", "is required");
  if (q->shape.size() != 4) throw Error(q->name, "expected 4 dims [B, T, H, K], got shape " + q->shape_str());
  if (v->shape.size() != 4) throw Error(v->name, "expected 4 dims [B, T, HV, V], got shape " + v->shape_str());
  c.device = q->device;
  if (place == Place::host && !q->on_cpu()) {
    throw Error(q->name, "expected a CPU tensor (the reference runs on the host), got device " + q->device);
  }
  if (place == Place::cuda && q->device.rfind("cuda", 0) != 0) {
    throw Error(q->name, "expected a CUDA tensor for a CUDA tier, got device " + q->device);
  }
  c.dtype = parse_float_dtype(q->dtype, q->name);
  p.dtype = c.dtype;

  const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2], K = q->shape[3];
  if (v->shape[0] != B || v->shape[1] != T) {
    throw Error(v->name, "expected shape [B, T, HV, V] with B = " + std::to_string(B) + ", T = " +
                             std::to_string(T) + " (from q), got " + v->shape_str());
  }
  const int64_t HV = v->shape[2], V = v->shape[3];
  p.B = B;
  p.T = T;
  p.H = H;
  p.HV = HV;
  p.K = K;
  p.V = V;

  // Varlen offsets: the compute-side array and its host copy (the same array on the host).
  int64_t N = B;
  const TensorDesc* cu = c.find("cu_seqlens");
  const TensorDesc* cu_host = c.find("cu_seqlens_host");
  if (cu) {
    p.cu_seqlens = c.offsets(*cu, false);
    p.cu_seqlens_host = cu_host ? c.offsets(*cu_host, true) : (place == Place::host ? p.cu_seqlens : nullptr);
    if (!p.cu_seqlens_host) throw Error(cu->name, "internal: a host copy is required for CUDA tiers");
    if (cu_host && cu_host->shape != cu->shape) {
      throw Error(cu_host->name, "expected the shape of cu_seqlens " + cu->shape_str() + ", got " +
                                     cu_host->shape_str());
    }
    N = cu->shape[0] - 1;
    p.num_seqs = N;  // finalize() leaves it to the front end for varlen batches
    if (B != 1) {
      throw Error(cu->name, "expected batch size B == 1 with cu_seqlens (a packed batch), got B = " +
                                std::to_string(B) + " (q has shape " + q->shape_str() + ")");
    }
  } else if (cu_host) {
    throw Error(cu_host->name, "internal: given without cu_seqlens");
  }

  const std::vector<int64_t> qk_shape{B, T, H, K}, vo_shape{B, T, HV, V}, head_shape{B, T, HV},
      key_shape{B, T, HV, K}, state_shape{N, HV, K, V};
  const bool has_g = p.variant != Variant::delta;
  const bool has_beta = p.variant != Variant::dplr;
  const bool has_ab = p.variant == Variant::dplr;
  const bool g_per_key = p.variant == Variant::kda || p.variant == Variant::dplr;
  const std::vector<int64_t>& g_shape = g_per_key ? key_shape : head_shape;
  const char* g_pattern = g_per_key ? "[B, T, HV, K]" : "[B, T, HV]";

  // The public name of a field that was not given (dplr calls its gate gk, FLA calls dout do).
  auto public_name = [&](const std::string& field) -> std::string {
    if (p.variant == Variant::dplr && field == "g") return "gk";
    if (p.variant == Variant::dplr && field == "dg") return "dgk";
    if (field == "dout") return "do";
    return field;
  };
  auto require = [&](const std::string& field, bool needed, const char* why) {
    const TensorDesc* d = c.find(field);
    if (needed && !d) {
      throw Error(public_name(field), std::string("is required for variant '") + variant + "'" + why);
    }
    if (!needed && d) throw Error(d->name, std::string("is not used by variant '") + variant + "'");
  };
  require("g", has_g, "");
  require("beta", has_beta, "");
  require("a", has_ab, "");
  require("b", has_ab, "");

  p.q = c.data("q", qk_shape, "[B, T, H, K]");
  p.k = c.data("k", qk_shape, "[B, T, H, K]");
  p.v = c.data("v", vo_shape, "[B, T, HV, V]");
  p.g = c.data("g", g_shape, g_pattern, &p.g_fp32);
  p.beta = c.data("beta", head_shape, "[B, T, HV]");
  p.a = c.data("a", key_shape, "[B, T, HV, K]");
  p.b = c.data("b", key_shape, "[B, T, HV, K]");

  DType state_dtype = DType::f32;
  bool state_dtype_set = false;
  p.h0 = c.state("h0", state_shape, &state_dtype, &state_dtype_set);

  // The in-kernel kda gate's parameters (params.h): contiguous fp32 vectors on q's device.
  auto gate_vector = [&](const char* field, int64_t n) -> const float* {
    const TensorDesc* d = c.find(field);
    if (!d) return nullptr;
    if (p.variant != Variant::kda) {
      throw Error(d->name, std::string("the in-kernel gate is kda's, got variant '") + variant + "'");
    }
    if (d->shape != std::vector<int64_t>{n}) {
      throw Error(d->name, "expected shape [" + std::to_string(n) + "] for the in-kernel gate, got " + d->shape_str());
    }
    if (d->dtype != "float32") throw py::type_error("deltacp: argument '" + d->name + "': expected float32, got " + d->dtype);
    if (n > 1 && d->strides[0] != 1) throw Error(d->name, "must be contiguous, got stride " + std::to_string(d->strides[0]));
    c.check_device(*d);
    return reinterpret_cast<const float*>(d->ptr);
  };
  p.gate_A_log = gate_vector("gate_A_log", HV);
  p.gate_dt_bias = gate_vector("gate_dt_bias", HV * K);
  if (p.gate_dt_bias && !p.gate_A_log) throw Error("dt_bias", "internal: the in-kernel gate needs A_log");

  // safe_gate's range check of a CUDA forward (params.h): int32 [2] on the device, with a precomputed g.
  if (const TensorDesc* d = c.find("gate_range")) {
    if (place != Place::cuda) throw Error(d->name, "internal: the range check in the forward is the CUDA tiers'");
    if (d->shape != std::vector<int64_t>{2} || d->dtype != "int32" || d->strides[0] != 1) {
      throw Error(d->name, "internal: expected a contiguous int32 [2], got " + d->dtype + " " + d->shape_str());
    }
    if (!c.find("g") || p.gate_A_log) throw Error(d->name, "internal: the range check reads a precomputed g");
    c.check_device(*d);
    p.gate_range = reinterpret_cast<int*>(d->ptr);
  }

  if (!backward) {
    // o may be left out only for the final-state-only forward (ht given; params.h).
    if (!c.find("o") && !c.find("ht")) {
      throw Error("o", "internal: the output is required (it may be omitted only when ht is given: the "
                       "final-state-only forward)");
    }
    p.o = c.data("o", vo_shape, "[B, T, HV, V]");
    p.ht = c.state("ht", state_shape, &state_dtype, &state_dtype_set);
  } else {
    if (!c.find("dout")) throw Error(public_name("dout"), "is required");
    // dh0-only backward (params.h): dh0 given and no input gradient at all. Otherwise every
    // gradient the variant has is required (a partial set names the first missing one).
    bool any_grad = false;
    for (const char* f : {"dq", "dk", "dv", "dg", "dbeta", "da", "db"}) any_grad = any_grad || c.find(f);
    const bool dh0_only = !any_grad && c.find("dh0");
    if (!dh0_only) {
      for (const char* f : {"dq", "dk", "dv"}) {
        if (!c.find(f)) {
          throw Error(f, "internal: the gradient output is required (all input gradients may be omitted together "
                         "only when dh0 is given: the dh0-only backward)");
        }
      }
      require("dg", has_g, " (internal: its gradient output)");
      require("dbeta", has_beta, " (internal: its gradient output)");
      require("da", has_ab, " (internal: its gradient output)");
      require("db", has_ab, " (internal: its gradient output)");
    }
    p.dout = c.data("dout", vo_shape, "[B, T, HV, V]");
    p.dht = c.state("dht", state_shape, &state_dtype, &state_dtype_set);
    p.dq = c.data("dq", qk_shape, "[B, T, H, K]");
    p.dk = c.data("dk", qk_shape, "[B, T, H, K]");
    p.dv = c.data("dv", vo_shape, "[B, T, HV, V]");
    p.dg = c.data("dg", g_shape, g_pattern, &p.g_fp32, /*gate_seen=*/p.g.defined());
    p.dbeta = c.data("dbeta", head_shape, "[B, T, HV]");
    p.da = c.data("da", key_shape, "[B, T, HV, K]");
    p.db = c.data("db", key_shape, "[B, T, HV, K]");
    p.dh0 = c.state("dh0", state_shape, &state_dtype, &state_dtype_set);
  }
  p.state_dtype = state_dtype;

  // The forward's kept intermediates (params.h): [NC, HV, Kp, Vp] and [B, T, HV, Vp], Kp and Vp rounded up to 16.
  if (c.find("chunk_h") || c.find("chunk_vnew")) {
    if (chunk_size < 1) throw Error("chunk_size", "expected >= 1, got " + std::to_string(chunk_size));
    int64_t NC = 0;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t len = cu ? p.cu_seqlens_host[n + 1] - p.cu_seqlens_host[n] : T;
      NC += (std::max<int64_t>(len, 0) + chunk_size - 1) / chunk_size;
    }
    const int64_t Kp = (K + 15) / 16 * 16, Vp = (V + 15) / 16 * 16;
    p.chunk_h = c.kept("chunk_h", {NC, HV, Kp, Vp}, "[chunks, HV, K, V] (K, V rounded up to 16)");
    p.chunk_vnew = c.kept("chunk_vnew", {B, T, HV, Vp}, "[B, T, HV, V] (V rounded up to 16)");
  }
  // The WY stage kept beside them (params.h WyStagePlanes): one flat buffer, 832 (kda) or 328 (gdn) elements per
  // token row and value head.
  p.wy_stage = c.kept("wy_stage", {B * T * HV * WyStagePlanes::of(p.variant).total},
                      "[B * T * HV * (832 for kda, 328 for gdn)] (deltacp/params.h WyStagePlanes)");

  if (scale.has_value()) {
    if (!std::isfinite(*scale)) throw Error("scale", "expected a finite number, got " + std::to_string(*scale));
    p.scale = *scale;
  } else {
    p.scale = K > 0 ? 1.0 / std::sqrt(static_cast<double>(K)) : 1.0;
  }
  p.chunk_size = chunk_size;
  finalize(p);
  return p;
}

}  // namespace deltacp::bindings
