// cuda/tiled/bwd_wy.cuh — backward stage B3: through the WY representation.
//
// W = T diag(beta) X and U = T diag(beta) V with X = K*Gam, T = (I + A)^-1; given dW (stage B2)
// and dU = dVn (stage B1):
//
//   dT  = dU (diag(beta) V)^T + dW (diag(beta) X)^T                              (64 x 64)
//   Y   = T^T dU:   dv = diag(beta) Y  (final: v reaches the loss only through U),  dbeta_i += Y_i . v_i
//   Z   = T^T dW:   dk += diag(beta) Z * Gam,  dG += diag(beta) Z * X,             dbeta_i += Z_i . X_i
//   dA  = -(T^T dT T^T), masked to j < i < len  (= -T^T dT T^T: dT = -T dA T)     -> a.dA (stage B4)
//
// One CTA per (chunk, value head), 256 threads. V is walked in tiles of 32 columns (dT and Y),
// then the key-side products run on 64 x KP tiles. dbeta from this stage goes to a.dbw; dk and dG
// are added to stage B2's workspaces (each element by one thread: no atomics).
// Measured: not yet (no GPU timing recorded; see tiled_bwd.cu).
#pragma once

#include "bwd_common.cuh"

namespace deltacp::cuda::tiled::bwd {

template <class Op, int KP>
struct WyBwdSmem {
  static constexpr int PA = kRows + 1;            // fp32 64 x 64
  static constexpr int P64 = pitch_of<Op>(kRows);  // Op 64 x 64
  static constexpr int PV = pitch_of<Op>(kVTile), PY = kVTile + 1;
  static constexpr int PK = pitch_of<Op>(KP), PZ = KP + 1;
  size_t Ts = 0, Top = 0, dT = 0, dTop = 0, beta = 0, dbeta = 0;
  size_t dU = 0, Bv = 0, Yv = 0;  // the V loop
  size_t dWs = 0, Bx = 0, Zx = 0;  // the key-side products (share the V loop's bytes; Zx reuses Bx's)
  size_t total = 0;
  __host__ __device__ constexpr WyBwdSmem() {
    Carve c;
    Ts = c.take(sizeof(float) * kRows * PA);
    Top = kIs16Bit<Op> ? c.take(sizeof(Op) * kRows * P64) : Ts;  // fp32: the operand is Ts itself
    dT = c.take(sizeof(float) * kRows * PA);
    dTop = c.take(sizeof(Op) * kRows * P64);
    beta = c.take(sizeof(float) * kRows);
    dbeta = c.take(sizeof(float) * kRows);
    Carve v = c;  // V loop region
    dU = v.take(sizeof(Op) * kRows * PV);
    Bv = v.take(sizeof(Op) * kRows * PV);
    Yv = v.take(sizeof(float) * kRows * PY);
    Carve k = c;  // key-side region, overlapping the V loop's
    dWs = k.take(sizeof(Op) * kRows * PK);
    const size_t bx_bytes = sizeof(Op) * kRows * PK, zx_bytes = sizeof(float) * kRows * PZ;
    Bx = k.take(bx_bytes > zx_bytes ? bx_bytes : zx_bytes);
    Zx = Bx;
    total = v.off > k.off ? v.off : k.off;
  }
};

template <class Op, int KP, bool PERKEY>
__global__ void __launch_bounds__(kThreads) bwd_wy_kernel(const Args a) {
  constexpr WyBwdSmem<Op, KP> L{};
  constexpr int PA = L.PA, P64 = L.P64, PV = L.PV, PY = L.PY, PK = L.PK, PZ = L.PZ;
  static_assert(kIs16Bit<Op> || PA == P64, "fp32 operand view of T must share its pitch");
  extern __shared__ __align__(16) unsigned char smem[];
  float* Ts = reinterpret_cast<float*>(smem + L.Ts);
  Op* Top = reinterpret_cast<Op*>(smem + L.Top);
  float* dT = reinterpret_cast<float*>(smem + L.dT);
  Op* dTop = reinterpret_cast<Op*>(smem + L.dTop);
  float* betas = reinterpret_cast<float*>(smem + L.beta);
  float* dbeta = reinterpret_cast<float*>(smem + L.dbeta);
  Op* dUs = reinterpret_cast<Op*>(smem + L.dU);
  Op* Bvs = reinterpret_cast<Op*>(smem + L.Bv);
  float* Yv = reinterpret_cast<float*>(smem + L.Yv);
  Op* dWs = reinterpret_cast<Op*>(smem + L.dWs);
  Op* Bxs = reinterpret_cast<Op*>(smem + L.Bx);
  float* Zx = reinterpret_cast<float*>(smem + L.Zx);

  const int tid = threadIdx.x;
  const int64_t c = blockIdx.x, hv = blockIdx.y, hk = hv / a.group;
  const ChunkEntry ch = a.chunks[c];
  const int len = static_cast<int>(ch.len);
  const int K = static_cast<int>(a.K);
  const Op* vp = static_cast<const Op*>(a.v.ptr);
  const Op* kp = static_cast<const Op*>(a.k.ptr);

  // T rows i < len from the forward's [R, HV, 64] buffer; padding rows zero (they multiply zeros).
  for (int e = tid; e < kRows * kRows; e += kThreads) {
    const int i = e / kRows, j = e % kRows;
    const float t = i < len ? a.Tinv[((ch.row0 + i) * a.HV + hv) * kRows + j] : 0.f;
    Ts[i * PA + j] = t;
    if constexpr (kIs16Bit<Op>) Top[i * P64 + j] = from_f<Op>(t);
    dT[i * PA + j] = 0.f;
  }
  for (int i = tid; i < kRows; i += kThreads) {
    betas[i] = i < len ? ld<Op>(a.beta, off(a.beta, ch.batch, ch.t0 + i, hv)) : 0.f;
    dbeta[i] = 0.f;
  }

  for (int64_t v0 = 0; v0 < a.V; v0 += kVTile) {
    __syncthreads();  // T, beta ready / the previous tile is fully consumed
    for (int e = tid; e < kRows * kVTile; e += kThreads) {
      const int i = e / kVTile, v = e % kVTile;
      const bool ok = i < len && v0 + v < a.V;
      dUs[i * PV + v] = from_f<Op>(ok ? a.dvnew[ws_row(ch, i, a.HV, hv, a.V) + v0 + v] : 0.f);
      Bvs[i * PV + v] = from_f<Op>(ok ? betas[i] * to_f(vp[off(a.v, ch.batch, ch.t0 + i, hv) + v0 + v]) : 0.f);
    }
    __syncthreads();
    // dT += dU (beta V)^T
    block_gemm<Op, kRows, kRows, Lay::rowmajor, Lay::colmajor>(dUs, PV, Bvs, PV, kVTile,
                                                               [&](int i, int j, float x) { dT[i * PA + j] += x; });
    // Y = T^T dU (A = T^T: column-major view of T): dv = beta Y, and Y . v for dbeta.
    block_gemm<Op, kRows, kVTile, Lay::colmajor, Lay::rowmajor>(Top, P64, dUs, PV, kRows, [&](int i, int v, float y) {
      float yv = 0.f;
      if (i < len && v0 + v < a.V) {
        const int64_t o = off(a.v, ch.batch, ch.t0 + i, hv) + v0 + v;
        yv = y * to_f(vp[o]);
        st<Op>(a.dv, off(a.dv, ch.batch, ch.t0 + i, hv) + v0 + v, betas[i] * y);
      }
      Yv[i * PY + v] = yv;
    });
    __syncthreads();
    if (tid < kRows) {
      float s = 0.f;
      for (int v = 0; v < kVTile; ++v) s += Yv[tid * PY + v];
      dbeta[tid] += s;
    }
  }
  __syncthreads();  // the V loop's region is free

  // dW (fp32 workspace) and beta X = beta k e^G as operands.
  for (int e = tid; e < kRows * KP; e += kThreads) {
    const int i = e / KP, d = e % KP;
    float w = 0.f, bx = 0.f;
    if (i < len && d < K) {
      w = a.dW[ws_row(ch, i, a.HV, hv, a.K) + d];
      bx = betas[i] * to_f(kp[off(a.k, ch.batch, ch.t0 + i, hk) + d]);
      if (a.gated) bx *= exp_t<Op>(G_at(a, PERKEY, ch, len, hv, i, d));
    }
    dWs[i * PK + d] = from_f<Op>(w);
    Bxs[i * PK + d] = from_f<Op>(bx);
  }
  __syncthreads();
  // dT += dW (beta X)^T
  block_gemm<Op, kRows, kRows, Lay::rowmajor, Lay::colmajor>(dWs, PK, Bxs, PK, KP,
                                                             [&](int i, int j, float x) { dT[i * PA + j] += x; });
  __syncthreads();  // Bx is read; Zx takes its bytes
  // Z = T^T dW: dk += beta Z Gam, dG += beta Z X, and Z . X for dbeta.
  block_gemm<Op, kRows, KP, Lay::colmajor, Lay::rowmajor>(Top, P64, dWs, PK, kRows, [&](int i, int d, float z) {
    float zx = 0.f;
    if (i < len && d < K) {
      const float gam = a.gated ? exp_t<Op>(G_at(a, PERKEY, ch, len, hv, i, d)) : 1.f;
      const float x = to_f(kp[off(a.k, ch.batch, ch.t0 + i, hk) + d]) * gam;
      const int64_t o = ws_row(ch, i, a.HV, hv, a.K) + d;
      a.dkw[o] += betas[i] * z * gam;
      if (a.gated) a.dGw[o] += betas[i] * z * x;
      zx = z * x;
    }
    Zx[i * PZ + d] = zx;
  });
  __syncthreads();
  if (tid < kRows) {
    float s = 0.f;
    for (int d = 0; d < KP; ++d) s += Zx[tid * PZ + d];
    dbeta[tid] += s;
  }
  for (int e = tid; e < kRows * kRows; e += kThreads) {
    const int i = e / kRows, j = e % kRows;
    dTop[i * P64 + j] = from_f<Op>(dT[i * PA + j]);
  }
  __syncthreads();
  // M1 = T^T dT (reads Top, dTop; overwrites the fp32 dT, which it does not read).
  block_gemm<Op, kRows, kRows, Lay::colmajor, Lay::rowmajor>(Top, P64, dTop, P64, kRows,
                                                             [&](int i, int j, float x) { dT[i * PA + j] = x; });
  __syncthreads();
  for (int e = tid; e < kRows * kRows; e += kThreads) {
    const int i = e / kRows, j = e % kRows;
    dTop[i * P64 + j] = from_f<Op>(dT[i * PA + j]);
  }
  __syncthreads();
  // dA = -M1 T^T (B = T^T: column-major view of T), strictly lower, rows < len.
  float* dAg = a.dA + (c * a.HV + hv) * kRows * kRows;
  block_gemm<Op, kRows, kRows, Lay::rowmajor, Lay::colmajor>(dTop, P64, Top, P64, kRows, [&](int i, int j, float x) {
    dAg[i * kRows + j] = (i > j && i < len) ? -x : 0.f;
  });
  if (tid < len) a.dbw[(ch.row0 + tid) * a.HV + hv] = dbeta[tid];
}

}  // namespace deltacp::cuda::tiled::bwd
