// cuda/common/load_store.cuh — element loads/stores between the input dtypes and fp32.
//
// Every kernel computes in fp32 (docs/design.md section 6: inputs fp32/bf16/fp16, accumulation and
// states fp32). These overloads are the only place the element type shows up in a kernel body:
//
//   float x = deltacp::cuda::load_f(ptr + i);     // T = float, __nv_bfloat16 or __half -> float
//   deltacp::cuda::store_f(ptr + i, x);           // float -> T, round to nearest even
//
// On the host, dispatch_dtype(p.dtype, f) calls f(TypeTag<T>{}) with the matching CUDA element
// type, so a launcher writes one templated body and instantiates it for the three input types:
//
//   dispatch_dtype(p.dtype, [&](auto tag) {
//     using T = typename decltype(tag)::type;
//     my_kernel<T><<<grid, block, 0, stream>>>(...);
//   });
//
// dispatch_dtype throws deltacp::Error naming 'dtype' for f64 (no GPU kernel takes fp64 inputs).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "deltacp/error.h"
#include "deltacp/params.h"

namespace deltacp::cuda {

// ---- device: element <-> fp32 ---------------------------------------------------------------
__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_f(const __half* p) { return __half2float(*p); }

__device__ __forceinline__ void store_f(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ void store_f(__half* p, float x) { *p = __float2half_rn(x); }

// ---- host: DType -> element type ------------------------------------------------------------
template <class T>
struct TypeTag {
  using type = T;
};

// The DType a CUDA element type stands for (for messages and checks).
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<__nv_bfloat16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct dtype_of<__half> {
  static constexpr DType value = DType::f16;
};

// Calls f(TypeTag<T>{}) for T matching `dtype` (f32 -> float, bf16 -> __nv_bfloat16, f16 -> __half).
template <class F>
inline void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: f(TypeTag<float>{}); return;
    case DType::bf16: f(TypeTag<__nv_bfloat16>{}); return;
    case DType::f16: f(TypeTag<__half>{}); return;
    default: break;
  }
  throw_error("dtype", "expected f32, bf16 or f16 on the GPU, got ", to_string(dtype));
}

}  // namespace deltacp::cuda
