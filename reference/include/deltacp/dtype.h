// deltacp/dtype.h — host conversions between the element types (bf16 and fp16 by bit patterns).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "deltacp/params.h"

namespace deltacp {

inline float bf16_bits_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16_bits(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
inline float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal
      float f = std::ldexp(static_cast<float>(man), -24);
      return (h & 0x8000u) ? -f : f;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_f16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(f)) return sign | 0x7e00;
  float a = std::fabs(f);
  if (a >= 65520.0f) return sign | 0x7c00;  // overflow to inf
  if (a < 6.103515625e-05f) {               // subnormal half: round a / 2^-24 to nearest even
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));
  }
  int e;
  float m = std::frexp(a, &e);                              // a = m 2^e, m in [0.5, 1)
  uint32_t mant = static_cast<uint32_t>(std::nearbyint(m * 2048.0f));  // 11 significant bits
  if (mant == 2048) { mant = 1024; ++e; }
  if (e + 14 >= 31) return sign | 0x7c00;
  return sign | static_cast<uint16_t>(((e + 14) << 10) | (mant & 0x3ff));
}

template <class S>
inline S load_as(const void* base, int64_t i, DType dt) {
  switch (dt) {
    case DType::f64: return static_cast<S>(static_cast<const double*>(base)[i]);
    case DType::f32: return static_cast<S>(static_cast<const float*>(base)[i]);
    case DType::bf16: return static_cast<S>(bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]));
    case DType::f16: return static_cast<S>(f16_bits_to_float(static_cast<const uint16_t*>(base)[i]));
  }
  return S(0);
}
template <class S>
inline void store_as(void* base, int64_t i, DType dt, S x) {
  switch (dt) {
    case DType::f64: static_cast<double*>(base)[i] = static_cast<double>(x); break;
    case DType::f32: static_cast<float*>(base)[i] = static_cast<float>(x); break;
    case DType::bf16: static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(static_cast<float>(x)); break;
    case DType::f16: static_cast<uint16_t*>(base)[i] = float_to_f16_bits(static_cast<float>(x)); break;
  }
}

}  // namespace deltacp
