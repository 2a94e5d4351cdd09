// Names of the enums and Params defaults.
#include "deltacp/params.h"

#include "deltacp/error.h"

namespace deltacp {

const char* to_string(Variant v) {
  switch (v) {
    case Variant::delta: return "delta";
    case Variant::gdn: return "gdn";
    case Variant::kda: return "kda";
    case Variant::dplr: return "dplr";
  }
  return "?";
}

const char* to_string(DType d) {
  switch (d) {
    case DType::f64: return "float64";
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
  }
  return "?";
}

const char* to_string(Method m) {
  switch (m) {
    case Method::recurrent: return "recurrent";
    case Method::chunked: return "chunked";
    case Method::affine: return "affine";
    case Method::naive: return "naive";
    case Method::tiled: return "tiled";
    case Method::fused: return "fused";
  }
  return "?";
}

Variant variant_from_string(const std::string& s) {
  for (Variant v : {Variant::delta, Variant::gdn, Variant::kda, Variant::dplr})
    if (s == to_string(v)) return v;
  throw_error("variant", "expected one of delta, gdn, kda, dplr, got '", s, "'");
}

Method method_from_string(const std::string& s) {
  for (Method m : {Method::recurrent, Method::chunked, Method::affine, Method::naive, Method::tiled, Method::fused})
    if (s == to_string(m)) return m;
  throw_error("method", "expected one of recurrent, chunked, affine, naive, tiled, fused, got '", s, "'");
}

int64_t dtype_size(DType d) {
  switch (d) {
    case DType::f64: return 8;
    case DType::f32: return 4;
    case DType::bf16:
    case DType::f16: return 2;
  }
  return 0;
}

void finalize(Params& p) {
  if (p.varlen()) {
    // The number of sequences is only known from the caller's array length; front ends set it.
    // When it is unset, a varlen Params is an error caught by validate_forward.
  } else {
    p.num_seqs = p.B;
  }
  if (p.HV == 0) p.HV = p.H;
}

}  // namespace deltacp
