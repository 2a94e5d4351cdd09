// cuda/tiled/fwd_mma.cuh — warp-level tile products and shared-memory tile copies of the tiled tier.
//
// Every matrix product of the chunked algorithm (docs/design.md section 3) is C += A B on tiles that
// sit in shared memory. One warp computes a C block of MT x NT tiles of 16 x 8, held in registers
// in the accumulator layout of the tensor-core instruction mma.sync.m16n8k16 (g = lane / 4,
// t = lane % 4):
//
//   acc[mt][nt][0] = C(16 mt + g,     8 nt + 2 t)      acc[mt][nt][1] = C(16 mt + g,     8 nt + 2 t + 1)
//   acc[mt][nt][2] = C(16 mt + g + 8, 8 nt + 2 t)      acc[mt][nt][3] = C(16 mt + g + 8, 8 nt + 2 t + 1)
//
// (offsets relative to the block's first row m0 and column n0). Operands are read from shared
// memory in any of the layouts the algorithm needs, so no tile is ever transposed by hand:
//
//   A: Lay::rowmajor  A(m, k) = a[m * lda + k]        Lay::colmajor  A(m, k) = a[k * lda + m]
//   B: Lay::rowmajor  B(k, n) = b[k * ldb + n]        Lay::colmajor  B(k, n) = b[n * ldb + k]
//
// bf16 / fp16 tiles go through ldmatrix (.trans for the layouts whose 16-bit pairs are not
// contiguous along k) and mma.sync.m16n8k16 with fp32 accumulation: sm_80 and sm_90 both have it.
// fp32 tiles (fp32 inputs) use plain FFMA in the same accumulator layout: exact fp32 arithmetic,
// so the fp32 tolerance of 1e-5 vs fp64 holds (TF32 tensor cores would round operands to 10 bits).
//
// Shared-memory tiles of 16-bit elements use a leading dimension of (columns + 8) elements with the
// column count a multiple of 16: every ldmatrix row address is 16-byte aligned and the 8 rows of
// one 8x8 matrix fall in 8 different 16-byte bank groups (no bank conflicts).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../common/load_store.cuh"

namespace deltacp::cuda::tiled {

enum class Lay { rowmajor, colmajor };

template <class T>
constexpr bool kIs16Bit = std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- PTX wrappers ---------------------------------------------------------------------------
// Four 8x8 b16 matrices; lanes 8i .. 8i+7 give the row addresses of matrix i. Register i of lane l
// receives matrix i's (row l/4, cols 2(l%4), 2(l%4)+1); with .trans, (rows 2(l%4), 2(l%4)+1, col l/4).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row_addr))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row_addr))
               : "memory");
}

template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16-byte global -> shared copy that bypasses L1 (cp.async.cg, sm_80+). Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem_dst)), "l"(gmem_src) : "memory");
}
// 4-byte copy through L1 (cp.async.ca), for scattered scalars such as one gate value per row.
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(smem_dst)), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- the warp tile product ------------------------------------------------------------------
// acc[mt][nt] += A(m0 + 16 mt + [0,16), k0..k1) * B(k0..k1, n0 + 8 nt + [0,8)) for mt < mt_active,
// nt < nt_active. (k1 - k0) must be a multiple of 16; for 16-bit T, NT and nt_active must be even
// (B fragments are loaded two n-tiles at a time). Every lane of the warp must call it (ldmatrix and
// mma are warp-collective); mt_active, nt_active, k0, k1 must be warp-uniform.
template <class T, int MT, int NT, Lay LA, Lay LB>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][NT][4], const T* a, int lda, int m0, const T* b, int ldb,
                                         int n0, int k0, int k1, int mt_active = MT, int nt_active = NT) {
  const int lane = threadIdx.x & 31;
  if constexpr (kIs16Bit<T>) {
    static_assert(NT % 2 == 0, "16-bit warp_mma loads B two n-tiles at a time");
    const int mat = lane >> 3, r8 = lane & 7;  // which 8x8 matrix this lane addresses, and its row
    for (int k = k0; k < k1; k += 16) {
      uint32_t af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt < mt_active) {
          const int mb = m0 + 16 * mt;
          if constexpr (LA == Lay::rowmajor) {
            // matrices: (rows mb, k), (rows mb+8, k), (rows mb, k+8), (rows mb+8, k+8)
            ldmatrix_x4(af[mt], a + (mb + r8 + 8 * (mat & 1)) * lda + k + 8 * (mat >> 1));
          } else {
            // stored [k][m]; matrices (k, mb), (k, mb+8), (k+8, mb), (k+8, mb+8), delivered transposed
            ldmatrix_x4_trans(af[mt], a + (k + r8 + 8 * (mat >> 1)) * lda + mb + 8 * (mat & 1));
          }
        }
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        if (2 * np < nt_active) {
          const int nb = n0 + 16 * np;
          uint32_t bf[4];  // bf[0..1]: n-tile 2np, bf[2..3]: n-tile 2np+1
          if constexpr (LB == Lay::colmajor) {
            // stored [n][k]; matrices (n, k), (n, k+8), (n+8, k), (n+8, k+8)
            ldmatrix_x4(bf, b + (nb + r8 + 8 * (mat >> 1)) * ldb + k + 8 * (mat & 1));
          } else {
            // stored [k][n]; matrices (k, n), (k+8, n), (k, n+8), (k+8, n+8), delivered transposed
            ldmatrix_x4_trans(bf, b + (k + r8 + 8 * (mat & 1)) * ldb + nb + 8 * (mat >> 1));
          }
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            if (mt < mt_active) {
              mma_16816<T>(acc[mt][2 * np], af[mt], bf[0], bf[1]);
              mma_16816<T>(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
            }
          }
        }
      }
    }
  } else {
    // fp32: each lane forms its own accumulator elements with FFMA (rows g, g+8; columns 2t, 2t+1).
    const int g = lane >> 2, t = lane & 3;
    for (int k = k0; k < k1; ++k) {
      float av[MT][2], bv[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = m0 + 16 * mt + g + 8 * h;
          av[mt][h] = (mt < mt_active) ? float(LA == Lay::rowmajor ? a[m * lda + k] : a[k * lda + m]) : 0.f;
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int n = n0 + 8 * nt + 2 * t + j;
          bv[nt][j] = (nt < nt_active) ? float(LB == Lay::rowmajor ? b[k * ldb + n] : b[n * ldb + k]) : 0.f;
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          acc[mt][nt][0] = fmaf(av[mt][0], bv[nt][0], acc[mt][nt][0]);
          acc[mt][nt][1] = fmaf(av[mt][0], bv[nt][1], acc[mt][nt][1]);
          acc[mt][nt][2] = fmaf(av[mt][1], bv[nt][0], acc[mt][nt][2]);
          acc[mt][nt][3] = fmaf(av[mt][1], bv[nt][1], acc[mt][nt][3]);
        }
    }
  }
}

template <int MT, int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// Row and column (relative to the block origin) of accumulator element e of tile (mt, nt).
__device__ __forceinline__ int acc_row(int mt, int e) { return 16 * mt + ((threadIdx.x & 31) >> 2) + 8 * (e >> 1); }
__device__ __forceinline__ int acc_col(int nt, int e) { return 8 * nt + 2 * (threadIdx.x & 3) + (e & 1); }

// An fp32 state tile held as accumulators (rows m0 + 16 mt + .., columns 8 nt + ..) <-> a row-major
// fp32 matrix g (leading dimension ld), only rows < rows and columns < cols: the scans' h0 / dht in
// and ht / dh0 out. A null g loads zeros.
template <int MT, int NT>
__device__ __forceinline__ void load_acc(float (&acc)[MT][NT][4], const float* g, int64_t ld, int m0, int rows,
                                         int cols) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + acc_row(mt, e), c = acc_col(nt, e);
        acc[mt][nt][e] = (g != nullptr && r < rows && c < cols) ? g[int64_t(r) * ld + c] : 0.f;
      }
}
template <int MT, int NT>
__device__ __forceinline__ void store_acc(const float (&acc)[MT][NT][4], float* g, int64_t ld, int m0, int rows,
                                          int cols) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + acc_row(mt, e), c = acc_col(nt, e);
        if (r < rows && c < cols) g[int64_t(r) * ld + c] = acc[mt][nt][e];
      }
}

// ---- element helpers ------------------------------------------------------------------------
template <class T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

// e^x: accurate expf for fp32 inputs (1e-5 tolerance); for 16-bit inputs the hardware ex2 of x log2(e), the
// approximation __expf makes (~1e-6 relative error, far below bf16 / fp16 rounding, and the same bits wherever
// the result is a normal float), with results below 2^-126 flushed to zero. __expf keeps those subnormal
// results at the price of a compare and two predicated multiplies around every MUFU.EX2: in kda's decay
// scalings, which take a few exponentials per key element, those were a tenth of all instructions (Nsight
// Compute, H100, kda (2,16384,16,128)), for values no 16-bit product keeps anyway.
template <class T>
__device__ __forceinline__ float exp_t(float x) {
  if constexpr (kIs16Bit<T>) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
  } else {
    return expf(x);
  }
}

// The row of piece idx of a tile walked as idx = row * pieces + column piece: a shift where `pieces` is a power
// of two (every padded head dimension of 64 or 128), the division otherwise. A division by a runtime divisor
// takes about 20 instructions; once per 16-byte piece it was a tenth of the instructions of kda's token-parallel
// kernels (Nsight Compute, H100, kda (2,16384,16,128)).
struct PieceRows {
  int pieces, shift = -1;  // shift < 0: pieces is not a power of two
  __device__ __forceinline__ explicit PieceRows(int n) : pieces(n) {
    if (n > 0 && (n & (n - 1)) == 0) {
      shift = 0;
      while ((1 << shift) < n) ++shift;
    }
  }
  __device__ __forceinline__ int row(int idx) const { return shift >= 0 ? idx >> shift : idx / pieces; }
};

// Stores two adjacent elements (columns c, c + 1) of a row; `p` must be aligned to 2 elements.
template <class T>
__device__ __forceinline__ void store_pair(T* p, float x0, float x1) {
  if constexpr (std::is_same<T, float>::value) {
    *reinterpret_cast<float2*>(p) = make_float2(x0, x1);
  } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x0, x1);
  } else {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x0, x1);
  }
}

// Eight consecutive elements (shared or global; 16-byte aligned) as floats: the 16-byte pieces in which the
// scaling loops of kda and DPLR go eight keys per thread.
template <class T>
__device__ __forceinline__ void load8(const T* p, float (&x)[8]) {
  if constexpr (std::is_same<T, float>::value) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = to_f(e[i]);
  }
}
__device__ __forceinline__ void load8f(const float* p, float (&x)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
// Eight consecutive elements as floats where the first n exist (n <= 0: none), zeros past them: one 16-byte
// load when all eight exist and `vec` says the piece is 16-byte aligned, element by element otherwise.
template <class T>
__device__ __forceinline__ void load8_upto(const T* p, int n, bool vec, float (&x)[8]) {
  if (vec && n >= 8) {
    load8(p, x);
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = e < n ? to_f(p[e]) : 0.f;
}
// Eight floats stored as eight consecutive elements of T (shared or global; 16-byte aligned).
template <class T>
__device__ __forceinline__ void store8(T* p, const float (&x)[8]) {
  if constexpr (std::is_same<T, float>::value) {
    *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
    *reinterpret_cast<float4*>(p + 4) = make_float4(x[4], x[5], x[6], x[7]);
  } else {
    uint4 u;
    T* e = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = from_f<T>(x[i]);
    *reinterpret_cast<uint4*>(p) = u;
  }
}

// ---- tile copies global <-> shared ------------------------------------------------------------
// Copies a rows_total x cols_pad tile into shared memory (leading dimension lds): element (r, c)
// = src[r * src_ld + c] for r < rows_valid and c < cols_valid, zero elsewhere. cols_pad must be a
// multiple of 16. When `vec` is true (src 16-byte aligned, src_ld * sizeof(T) a multiple of 16),
// full 16-byte pieces go through cp.async (the caller commits and waits); the rest is copied with
// ordinary loads. All threads of the block call it with the same arguments; src_ld is int64.
// kThreadsHint: the block size when the caller knows it at compile time (0: blockDim.x); with it and
// constant rows_total / cols_pad the loop has a constant trip count and unrolls.
template <class T, int kThreadsHint = 0>
__device__ __forceinline__ void load_tile(T* dst, int lds, const T* src, int64_t src_ld, int rows_valid,
                                          int rows_total, int cols_valid, int cols_pad, bool vec) {
  constexpr int kPiece = 16 / sizeof(T);  // elements per 16-byte piece
  const int pieces_per_row = cols_pad / kPiece;
  const PieceRows rows_of(pieces_per_row);
  const int total = rows_total * pieces_per_row;
  const int nthreads = kThreadsHint > 0 ? kThreadsHint : static_cast<int>(blockDim.x);
  const int iters = (total + nthreads - 1) / nthreads;
#pragma unroll 4
  for (int it = 0; it < iters; ++it) {
    const int i = static_cast<int>(threadIdx.x) + it * nthreads;
    if (i >= total) break;
    const int r = rows_of.row(i);
    const int c = (i - r * pieces_per_row) * kPiece;
    T* d = dst + r * lds + c;
    const T* s = src + static_cast<int64_t>(r) * src_ld + c;
    if (r < rows_valid && vec && c + kPiece <= cols_valid) {
      cp_async_16(d, s);
    } else {
#pragma unroll
      for (int e = 0; e < kPiece; ++e) d[e] = (r < rows_valid && c + e < cols_valid) ? s[e] : from_f<T>(0.f);
    }
  }
}

// True when `ptr` is 16-byte aligned and rows `ld` elements apart stay 16-byte aligned.
template <class T>
__device__ __forceinline__ bool vec_ok(const T* ptr, int64_t ld) {
  return (reinterpret_cast<uintptr_t>(ptr) % 16 == 0) && ((ld * static_cast<int64_t>(sizeof(T))) % 16 == 0);
}

}  // namespace deltacp::cuda::tiled
