// cuda/tiled/wgmma_ops.cuh — Hopper (sm_90a) building blocks shared by the kernels that run their
// products on wgmma: the tiled tier's (the state scan scan_wgmma.cuh, the WY stage wy_wgmma.cuh, the backward's
// bwd_dh_scan_wgmma.cuh and bwd_local_wgmma.cuh) and the fused tier's (cuda/fused/).
//
//   wg_desc                  shared-memory matrix descriptor, 128-byte swizzle
//   wg_fence / wg_commit / wg_wait<N>   the asynchronous product's ordering points
//   wgmma_n64_rs             D (64 x 64 fp32) += A (64 x 16, registers) B (16 x 64, K-major in shared memory)
//   wgmma_n64_ss             D (64 x 64 fp32) += A (64 x 16, K-major) B (16 x 64, K-major), both in shared memory
//   wgmma_n128_rs_tb         D (64 x 128 fp32) += A (registers) B (16 x 128, MN-major)
//   wgmma_n64_rs_tb          D (64 x 64 fp32) += A (registers) B (16 x 64, MN-major)
//   wgmma_rs_tb<T, N>        either of the two by N
//   wgmma_ss<T, N, TA, TB>   D (64 x N fp32, N = 32, 64, 128) += A B, both in shared memory, each K-major or
//                            transposed (A M-major, B MN-major)
//   stmatrix_x4_trans, pack2, unpack2, reg_fence, fence_proxy_async, warpgroup_bar
//   load_tile_sw128          a 64 x 128 16-bit tile into two 64 x 64 blocks with the 128-byte swizzle
//   load_tile_u              a 64 x kCols tile of plain rows
//
// The accumulator of an m64nN product (g = lane / 4, t = lane % 4, warp w of the warpgroup):
// d[4 nb + e] = D(16 w + g + 8 (e >> 1), 8 nb + 2 t + (e & 1)), and the A-register fragment of
// k-step kk is {D(.., 16 kk + 2 t ..), D(+8 rows), D(.., + 8 columns), D(+8, +8)} packed in pairs:
// a[kk][r] = pack2(d[8 kk + 2 r], d[8 kk + 2 r + 1]). So an accumulator becomes the next product's
// A operand without a trip through shared memory (the trick FlashAttention-3 uses for P V).
// Everything here compiles to device code only for sm_90a (DELTACP_WGMMA_DEVICE).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "fwd_mma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DELTACP_WGMMA_DEVICE 1
#endif

namespace deltacp::cuda::tiled {

#ifdef DELTACP_WGMMA_DEVICE
// ---- PTX wrappers (sm_90a) ---------------------------------------------------------------------
// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading and stride byte offsets.
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((saddr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Waits until at most N committed groups of products are still in flight.
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Ordinary shared-memory writes (cp.async, st.shared) made visible to the tensor cores' async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Named barrier over one warpgroup's 128 threads (id 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_bar(int wg) { asm volatile("bar.sync %0, 128;\n" ::"r"(wg + 1) : "memory"); }
// Keeps the compiler from moving register reads or writes across an asynchronous product.
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// The A fragments too: wgmma reads them asynchronously, so they must stay put until the wait.
template <int M, int N>
__device__ __forceinline__ void reg_fence(uint32_t (&r)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}
// Four 8x8 16-bit matrices from the mma fragment layout, each stored transposed: lanes 8q .. 8q + 7
// give the addresses of the stored rows of matrix q (row rr = column rr of the fragment matrix).
__device__ __forceinline__ void stmatrix_x4_trans(void* row_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_u32(row_addr)),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

#define DELTACP_WGMMA_D32                                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),  \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define DELTACP_WGMMA_D64                                                                                        \
  DELTACP_WGMMA_D32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), \
      "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]),     \
      "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),     \
      "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),     \
      "+f"(d[63])
#define DELTACP_WGMMA_R32                                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define DELTACP_WGMMA_R64                                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "  \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 x 64, fp32) = A (64 x 16, registers) B (16 x 64, K-major descriptor) + (scale_d ? d : 0).
template <class T>
__device__ __forceinline__ void wgmma_n64_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int scale_d) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DELTACP_WGMMA_R32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : DELTACP_WGMMA_D32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " DELTACP_WGMMA_R32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : DELTACP_WGMMA_D32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
  }
}
// d (64 x 64, fp32) = A (64 x 16, K-major descriptor) B (16 x 64, K-major descriptor) + (scale_d ? d : 0).
template <class T>
__device__ __forceinline__ void wgmma_n64_ss(float (&d)[32], uint64_t a, uint64_t b, int scale_d) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DELTACP_WGMMA_R32
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : DELTACP_WGMMA_D32
                 : "l"(a), "l"(b), "r"(scale_d));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " DELTACP_WGMMA_R32
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : DELTACP_WGMMA_D32
                 : "l"(a), "l"(b), "r"(scale_d));
  }
}
// d (64 x 128, fp32) += A (64 x 16, registers) B (16 x 128, MN-major descriptor: imm-trans-b = 1).
template <class T>
__device__ __forceinline__ void wgmma_n128_rs_tb(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " DELTACP_WGMMA_R64
                 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : DELTACP_WGMMA_D64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " DELTACP_WGMMA_R64
                 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : DELTACP_WGMMA_D64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  }
}
// d (64 x 64, fp32) += A (64 x 16, registers) B (16 x 64, MN-major descriptor: imm-trans-b = 1).
template <class T>
__device__ __forceinline__ void wgmma_n64_rs_tb(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DELTACP_WGMMA_R32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : DELTACP_WGMMA_D32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " DELTACP_WGMMA_R32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : DELTACP_WGMMA_D32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
  }
}
// d (64 x N) += A (64 x 16, registers) B (16 x N, MN-major descriptor), N = 64 or 128.
template <class T, int N>
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (N == 128) {
    wgmma_n128_rs_tb<T>(d, a, b);
  } else {
    static_assert(N == 64, "m64n64k16 or m64n128k16");
    wgmma_n64_rs_tb<T>(d, a, b);
  }
}
#define DELTACP_WGMMA_D16                                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define DELTACP_WGMMA_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
// d (64 x N, fp32; N = 32, 64 or 128) = A (64 x 16) B (16 x N) + (scale_d ? d : 0), both operands in shared
// memory (128-byte swizzle). TA = 1: A is stored M-major (the tile holds A^T's rows: A = tile^T); TB = 1: B is
// stored MN-major (the tile holds B's rows); 0: K-major. Both transposes exist for 16-bit inputs only.
template <class T, int N, int TA, int TB>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a, uint64_t b, int scale_d) {
  static_assert(N == 32 || N == 64 || N == 128, "m64n32k16, m64n64k16 or m64n128k16");
  constexpr bool bf = std::is_same<T, __nv_bfloat16>::value;
  if constexpr (N == 32) {
    if constexpr (bf) {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " DELTACP_WGMMA_R16
                   ", %16, %17, p, 1, 1, %19, %20;\n}\n"
                   : DELTACP_WGMMA_D16
                   : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB));
    } else {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 " DELTACP_WGMMA_R16
                   ", %16, %17, p, 1, 1, %19, %20;\n}\n"
                   : DELTACP_WGMMA_D16
                   : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB));
    }
  } else if constexpr (N == 64) {
    if constexpr (bf) {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DELTACP_WGMMA_R32
                   ", %32, %33, p, 1, 1, %35, %36;\n}\n"
                   : DELTACP_WGMMA_D32
                   : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB));
    } else {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " DELTACP_WGMMA_R32
                   ", %32, %33, p, 1, 1, %35, %36;\n}\n"
                   : DELTACP_WGMMA_D32
                   : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB));
    }
  } else {
    if constexpr (bf) {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " DELTACP_WGMMA_R64
                   ", %64, %65, p, 1, 1, %67, %68;\n}\n"
                   : DELTACP_WGMMA_D64
                   : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB));
    } else {
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " DELTACP_WGMMA_R64
                   ", %64, %65, p, 1, 1, %67, %68;\n}\n"
                   : DELTACP_WGMMA_D64
                   : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB));
    }
  }
}
#undef DELTACP_WGMMA_D16
#undef DELTACP_WGMMA_R16
#undef DELTACP_WGMMA_D32
#undef DELTACP_WGMMA_D64
#undef DELTACP_WGMMA_R32
#undef DELTACP_WGMMA_R64

// Two floats as one register of two 16-bit values (x0 in the low half: the fragment's first column).
template <class T>
__device__ __forceinline__ uint32_t pack2(float x0, float x1) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(x0, x1);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(x0, x1);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t r) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&r));
  }
}

// Va <- U^T - Va for an m64n64 accumulator Va (this warpgroup's 64 state columns x 64 tokens), U^T's
// fragments read straight from a tile of tokens x columns (rows ld elements apart, this warpgroup's
// columns from col0) by ldmatrix.trans. srow, scol: this lane's row address in the tile (lane -> matrix
// q = lane / 8: row 8 (q / 2) + lane % 8, column 16 w + 8 (q % 2) for warp w of the warpgroup).
template <class T>
__device__ __forceinline__ void u_minus_acc_trans(float (&Va)[32], const T* Us, int ld, int col0, int srow, int scol) {
#pragma unroll
  for (int np = 0; np < 4; ++np) {
    uint32_t u[4];
    ldmatrix_x4_trans(u, Us + (16 * np + srow) * ld + col0 + scol);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int at = 8 * np + 2 * q;  // n-block 2 np + q / 2, row half q % 2
      const float2 uf = unpack2<T>(u[q]);
      Va[at] = uf.x - Va[at];
      Va[at + 1] = uf.y - Va[at + 1];
    }
  }
}

// A 64 x 128 tile of 16-bit rows (src row r at src + r * ld, 16-byte aligned) into the swizzled
// two-block layout above; rows >= len are zero. cp.async for the valid rows (the caller commits).
// A thread keeps one 16-byte piece column and every (kThr / 16)-th row, so its swizzled position
// moves by a constant stride (kThr / 16 is a multiple of 8: the row's swizzle phase is fixed).
template <class T, int kThr>
__device__ __forceinline__ void load_tile_sw128(unsigned char* dst, const T* src, int64_t ld, int len) {
  constexpr int kRowStep = kThr / 16;
  static_assert(kRowStep % 8 == 0, "the swizzle phase of a thread's rows must stay fixed");
  const int piece = static_cast<int>(threadIdx.x) & 15, r0 = static_cast<int>(threadIdx.x) >> 4;
  unsigned char* d = dst + (piece >> 3) * 8192 + r0 * 128 + (((piece & 7) ^ (r0 & 7)) << 4);
  const T* s = src + r0 * ld + piece * 8;
#pragma unroll
  for (int it = 0; it < 64 / kRowStep; ++it) {
    if (r0 + it * kRowStep < len) {
      cp_async_16(d + it * kRowStep * 128, s + it * kRowStep * ld);
    } else {
      *reinterpret_cast<uint4*>(d + it * kRowStep * 128) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}
// The 64 x kCols U tile (plain rows of ld_s elements): column pieces below `valid` columns and rows
// below len from src (rows ld apart), zero elsewhere.
template <class T, int kThr, int kCols>
__device__ __forceinline__ void load_tile_u(T* dst, int ld_s, const T* src, int64_t ld, int len, int valid) {
  constexpr int kPieces = kCols / 8, kRowStep = kThr / kPieces;
  const int pc = static_cast<int>(threadIdx.x) % kPieces, r0 = static_cast<int>(threadIdx.x) / kPieces;
  T* d = dst + r0 * ld_s + pc * 8;
  const T* s = src + r0 * ld + pc * 8;
#pragma unroll
  for (int it = 0; it < 64 / kRowStep; ++it) {
    if (r0 + it * kRowStep < len && pc * 8 < valid) {
      cp_async_16(d + it * kRowStep * ld_s, s + it * kRowStep * ld);
    } else {
      *reinterpret_cast<uint4*>(d + it * kRowStep * ld_s) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}
// A transposed-state accumulator of an m64nK product (K = 2N: N registers a thread, register 4 nb + e holds key
// column 8 nb + 2 t + (e & 1), t = lane % 4) times e^(x_d) on each key column d, x: the K per-key log decays in
// shared memory (kda's last gate row of a chunk). The forward chain's S^T and the dh scan's dS^T.
template <class T, int N>
__device__ __forceinline__ void scale_key_columns_exp(float (&acc)[N], const float* x) {
  const int t = static_cast<int>(threadIdx.x) & 3;
#pragma unroll
  for (int nb = 0; nb < N / 4; ++nb) {  // keys 8 nb + 2 t and 8 nb + 2 t + 1
    const float2 gl = *reinterpret_cast<const float2*>(x + 8 * nb + 2 * t);
    const float e0 = exp_t<T>(gl.x), e1 = exp_t<T>(gl.y);
    acc[4 * nb] *= e0;
    acc[4 * nb + 1] *= e1;
    acc[4 * nb + 2] *= e0;
    acc[4 * nb + 3] *= e1;
  }
}
#endif  // DELTACP_WGMMA_DEVICE

}  // namespace deltacp::cuda::tiled
