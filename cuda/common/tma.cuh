// cuda/common/tma.cuh — Hopper's tensor memory accelerator (TMA) for kernels that stream tiles of 16-bit rows
// into shared memory: host-side tensor maps, device-side bulk copies completing on an mbarrier.
//
// Why: a tile of 64 rows x 128 keys by cp.async is 1,024 16-byte copies, each an instruction of some thread
// with its own address arithmetic, and the load/store unit keeps only so many in flight. Measured in the
// fused chain (NVIDIA H200, bf16 gdn, (2,16384,16,128), whole sequences): its cp.async loads were half of
// its time (0.672 ms against 0.330 ms with the loads left out), although they were issued a whole chunk
// ahead. One TMA instruction moves the same tile: the copy engine walks the rows, applies the 128-byte
// swizzle the wgmma descriptors expect, and signals an mbarrier with the bytes that arrived.
//
// Host:
//   TileMap16 map = tile_map_16bit(base, dims, strides, box, "k");   // rank 2..5, 16-bit elements,
//       // dims fastest first (dims[0] contiguous), strides in elements for dims 1.., box[0] = 64 (128 B: the
//       // swizzle span), 128-byte swizzle, zero fill outside the tensor. An Error names `arg` when the driver
//       // refuses the map (its message has the dims and strides).
//   token_rows_map(q, B, T, H, 128, "q"), workspace_rows_map(W, B * T, HV, 128, "W")   // 64 x 64 boxes
// Device (sm_90):
//   mbar_init(bar, 1); fence_mbar_init();            // once, one thread, then a CTA barrier
//   mbar_expect_tx(bar, bytes); tma_load_2d/3d/4d(...)  // the thread that issues the stage's copies
//   mbar_wait(bar, parity);                          // every consumer; parity = (use count) & 1
// A tensor map must reach the kernel as a __grid_constant__ parameter (or a member of one).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "check.h"
#include "deltacp/params.h"

namespace deltacp::cuda {

// A CUtensorMap (128 bytes, 64-byte aligned) that a kernel argument struct can hold.
struct TileMap16 {
  CUtensorMap map;
};

// The driver's cuTensorMapEncodeTiled through the runtime (no link against libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    DELTACP_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || f == nullptr)
      ::deltacp::throw_error("cuda", "the driver has no cuTensorMapEncodeTiled (a driver for CUDA 12 or later is needed)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A tiled map over a tensor of 16-bit elements: dims fastest first, strides (in elements) of dims 1 .. rank-1,
// box of box[i] elements per dim. Dims of size 1 get a stride the driver accepts (it is never stepped).
inline TileMap16 tile_map_16bit(const void* base, std::initializer_list<int64_t> dims,
                                std::initializer_list<int64_t> strides, std::initializer_list<uint32_t> box,
                                const char* arg) {
  const int rank = static_cast<int>(dims.size());
  cuuint64_t gdim[5] = {}, gstride[4] = {};
  cuuint32_t gbox[5] = {}, estride[5] = {1, 1, 1, 1, 1};
  int i = 0;
  for (int64_t d : dims) gdim[i++] = static_cast<cuuint64_t>(d);
  i = 0;
  for (uint32_t b : box) gbox[i++] = b;
  i = 0;
  for (int64_t s : strides) {
    const int64_t bytes = s * 2;
    gstride[i] = gdim[i + 1] == 1 && bytes <= 0 ? 16 : static_cast<cuuint64_t>(bytes);
    ++i;
  }
  TileMap16 m{};
  const CUresult r = tensor_map_encoder()(&m.map, CU_TENSOR_MAP_DATA_TYPE_UINT16, static_cast<cuuint32_t>(rank),
                                          const_cast<void*>(base), gdim, gstride, gbox, estride,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::string shape;
    for (int d = 0; d < rank; ++d) shape += (d ? ", " : "") + std::to_string(gdim[d]);
    std::string st;
    for (int d = 0; d + 1 < rank; ++d) st += (d ? ", " : "") + std::to_string(gstride[d]);
    ::deltacp::throw_error(arg, "cannot be read through a TMA tensor map (cuTensorMapEncodeTiled error ",
                           static_cast<int>(r), "; dims [", shape, "], byte strides [", st,
                           "]: strides must be positive multiples of 16 bytes)");
  }
  return m;
}

// Whether a [B, T, heads, D] tensor's pointer and strides are whole 16-byte pieces (what 16-byte loads, stores
// and TMA boxes of its rows need).
inline bool rows_aligned16(const TensorRef& r, int64_t es) {
  return reinterpret_cast<uintptr_t>(r.ptr) % 16 == 0 && (r.stride_b * es) % 16 == 0 &&
         (r.stride_t * es) % 16 == 0 && (r.stride_h * es) % 16 == 0;
}

// Whether token_rows_map can cover a [B, T, heads, D] tensor: its strides positive wherever a dim is stepped (a
// tensor map takes no zero or negative stride; 16-byte alignment is rows_aligned16's).
inline bool steps_forward(const TensorRef& r, int64_t B, int64_t T, int64_t heads) {
  return (heads <= 1 || r.stride_h > 0) && (T <= 1 || r.stride_t > 0) && (B <= 1 || r.stride_b > 0);
}

// Boxes of 64 columns x 64 token rows over a caller's [B, T, heads, D] tensor (TensorRef strides) ...
inline TileMap16 token_rows_map(const TensorRef& r, int64_t B, int64_t T, int64_t heads, int64_t D, const char* arg) {
  return tile_map_16bit(r.ptr, {D, heads, T, B}, {r.stride_h, r.stride_t, r.stride_b}, {64, 1, 64, 1}, arg);
}
// ... and over a contiguous [R, heads, D] workspace (R = B * T token rows).
inline TileMap16 workspace_rows_map(const void* base, int64_t R, int64_t heads, int64_t D, const char* arg) {
  return tile_map_16bit(base, {D, heads, R}, {D, heads * D}, {64, 1, 64}, arg);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t tma_smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(tma_smem_u32(bar)), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the copy engine (then a CTA barrier for the other threads).
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// This thread's arrival, announcing `bytes` more to come from copies that complete on the barrier.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(tma_smem_u32(bar)), "r"(bytes)
               : "memory");
}
// Waits for the phase of the given parity to complete.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(tma_smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// One box of a tensor map into shared memory (1024-byte aligned for the 128-byte swizzle), completing on bar.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
      "[%2];\n" ::"r"(tma_smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(tma_smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(tma_smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(tma_smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, "
      "%6}], [%2];\n" ::"r"(tma_smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(tma_smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// Brings a tensor map (a kernel parameter) into the descriptor cache ahead of its first copy.
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
#endif

}  // namespace deltacp::cuda
