// cuda/tiled/bwd_dh_scan.cuh — backward stage B1: the reverse state-gradient scan.
//
// Walking the chunks of one sequence from last to first, with dS' = dL/d(end state of the chunk)
// (dht, or 0, for the last chunk):
//
//   dh[c]  = dS'                                             (kept for stage B2)
//   dVn    = dVn_local + Kr dS'                              (dVn_local from stage B0)
//   dS     = e^Gn o dS' + scale (Q*Gam)^T dO - W^T dVn       (= dS' of the previous chunk)
//   dh0    = dS of the first chunk                           (when p.dh0 is given)
//
// The last two terms are one product over a stacked contraction of 2 x 64 rows:
//   dS += [scale Q*Gam ; -W]^T [dO ; dVn]     (KP x 128) x (128 x 32)
//
// One CTA per (sequence, value head, 32-column slice of V), 256 threads; the fp32 slice of dS
// (KP x 32) stays in shared memory for the whole walk, the chunks are visited sequentially.
// Measured: not yet (no GPU timing recorded; see tiled_bwd.cu).
#pragma once

#include "bwd_common.cuh"

namespace deltacp::cuda::tiled::bwd {

template <class Op, int KP>
struct DhScanSmem {
  static constexpr int PS = kScanCols + 1;           // fp32 dS
  static constexpr int PSO = pitch_of<Op>(kScanCols);  // dS as a product operand
  static constexpr int PK = pitch_of<Op>(KP), PB = pitch_of<Op>(kScanCols);
  size_t dS = 0, dSop = 0, Kr = 0, Ast = 0, Bst = 0, Gn = 0, total = 0;
  __host__ __device__ constexpr DhScanSmem() {
    Carve c;
    dS = c.take(sizeof(float) * KP * PS);
    // fp32: the product reads dS itself (pitches agree); it is not written while being read.
    dSop = kIs16Bit<Op> ? c.take(sizeof(Op) * KP * PSO) : dS;
    Kr = c.take(sizeof(Op) * kRows * PK);
    Ast = c.take(sizeof(Op) * 2 * kRows * PK);
    Bst = c.take(sizeof(Op) * 2 * kRows * PB);
    Gn = c.take(sizeof(float) * KP);
    total = c.off;
  }
};

template <class Op, int KP, bool PERKEY>
__global__ void __launch_bounds__(kThreads) bwd_dh_scan_kernel(const Args a) {
  constexpr DhScanSmem<Op, KP> L{};
  constexpr int PS = L.PS, PSO = L.PSO, PK = L.PK, PB = L.PB;
  static_assert(kIs16Bit<Op> || PS == PSO, "fp32 operand view of dS must share its pitch");
  extern __shared__ __align__(16) unsigned char smem[];
  float* dS = reinterpret_cast<float*>(smem + L.dS);
  Op* dSop = reinterpret_cast<Op*>(smem + L.dSop);
  Op* Kr = reinterpret_cast<Op*>(smem + L.Kr);
  Op* Ast = reinterpret_cast<Op*>(smem + L.Ast);
  Op* Bst = reinterpret_cast<Op*>(smem + L.Bst);
  float* Gn = reinterpret_cast<float*>(smem + L.Gn);

  const int tid = threadIdx.x;
  const int64_t nvt = (a.V + kScanCols - 1) / kScanCols;
  const int64_t vt = blockIdx.x % nvt, rest = blockIdx.x / nvt;
  const int64_t hv = rest % a.HV, n = rest / a.HV, hk = hv / a.group;
  const int64_t v0 = vt * kScanCols;
  const int vw = static_cast<int>(a.V - v0 < kScanCols ? a.V - v0 : kScanCols);
  const int K = static_cast<int>(a.K);
  const SeqEntry sq = a.seqs[n];
  const int64_t state0 = (n * a.HV + hv) * a.K * a.V;  // [N, HV, K, V] offset of (n, hv)

  for (int e = tid; e < KP * kScanCols; e += kThreads) {
    const int d = e / kScanCols, v = e % kScanCols;
    dS[d * PS + v] = (a.dht && d < K && v < vw) ? a.dht[state0 + int64_t(d) * a.V + v0 + v] : 0.f;
  }

  const Op* qp = static_cast<const Op*>(a.q.ptr);
  const Op* kp = static_cast<const Op*>(a.k.ptr);
  const Op* Wp = static_cast<const Op*>(a.W);
  const Op* dout = static_cast<const Op*>(a.dout.ptr);

  for (int64_t ci = sq.num_chunks - 1; ci >= 0; --ci) {
    const int64_t c = sq.first_chunk + ci;
    const ChunkEntry ch = a.chunks[c];
    const int len = static_cast<int>(ch.len);
    __syncthreads();  // dS holds the previous step's result; the operand tiles are free

    const int64_t hc = (c * a.HV + hv) * a.K * a.V;  // [num_chunks, HV, K, V] offset of (c, hv)
    for (int e = tid; e < KP * kScanCols; e += kThreads) {
      const int d = e / kScanCols, v = e % kScanCols;
      const float s = dS[d * PS + v];
      if (d < K && v < vw) a.dh[hc + int64_t(d) * a.V + v0 + v] = s;
      if constexpr (kIs16Bit<Op>) dSop[d * PSO + v] = from_f<Op>(s);
    }
    for (int d = tid; d < KP; d += kThreads) Gn[d] = a.gated ? G_at(a, PERKEY, ch, len, hv, len - 1, d) : 0.f;
    // Ast rows 0..63: scale q e^G; rows 64..127: -W.  Bst rows 0..63: dO (rows 64..127 come below).
    for (int e = tid; e < kRows * KP; e += kThreads) {
      const int i = e / KP, d = e % KP;
      float x = 0.f, w = 0.f;
      if (i < len && d < K) {
        x = a.scale * to_f(qp[off(a.q, ch.batch, ch.t0 + i, hk) + d]);
        if (a.gated) x *= exp_t<Op>(G_at(a, PERKEY, ch, len, hv, i, d));
        w = -to_f(Wp[((ch.row0 + i) * a.HV + hv) * a.Kp + d]);
      }
      Ast[i * PK + d] = from_f<Op>(x);
      Ast[(kRows + i) * PK + d] = from_f<Op>(w);
    }
    for (int e = tid; e < kRows * kScanCols; e += kThreads) {
      const int i = e / kScanCols, v = e % kScanCols;
      const bool ok = i < len && v < vw;
      Bst[i * PB + v] = ok ? dout[off(a.dout, ch.batch, ch.t0 + i, hv) + v0 + v] : from_f<Op>(0.f);
    }
    __syncthreads();  // Gn ready
    // Kr = k e^(Gn - G) (exponent <= 0 for a non-positive log decay).
    for (int e = tid; e < kRows * KP; e += kThreads) {
      const int i = e / KP, d = e % KP;
      float x = 0.f;
      if (i < len && d < K) {
        x = to_f(kp[off(a.k, ch.batch, ch.t0 + i, hk) + d]);
        if (a.gated) x *= exp_t<Op>(Gn[d] - G_at(a, PERKEY, ch, len, hv, i, d));
      }
      Kr[i * PK + d] = from_f<Op>(x);
    }
    __syncthreads();
    // dVn = dVn_local + Kr dS'; stored back (fp32) and into Bst rows 64..127 as an operand.
    block_gemm<Op, kRows, kScanCols, Lay::rowmajor, Lay::rowmajor>(Kr, PK, dSop, PSO, KP, [&](int i, int v, float x) {
      float dv = 0.f;
      if (i < len && v < vw) {
        const int64_t o = ws_row(ch, i, a.HV, hv, a.V) + v0 + v;
        dv = a.dvnew[o] + x;
        a.dvnew[o] = dv;
      }
      Bst[(kRows + i) * PB + v] = from_f<Op>(dv);
    });
    __syncthreads();
    // dS = e^Gn o dS' + Ast^T Bst. Each element is read and written by the thread that owns it.
    block_gemm<Op, KP, kScanCols, Lay::colmajor, Lay::rowmajor>(Ast, PK, Bst, PB, 2 * kRows,
                                                                 [&](int d, int v, float x) {
      const float decay = a.gated ? exp_t<Op>(Gn[d]) : 1.f;
      dS[d * PS + v] = decay * dS[d * PS + v] + x;
    });
  }
  __syncthreads();
  if (a.dh0) {
    for (int e = tid; e < KP * kScanCols; e += kThreads) {
      const int d = e / kScanCols, v = e % kScanCols;
      if (d < K && v < vw) a.dh0[state0 + int64_t(d) * a.V + v0 + v] = dS[d * PS + v];
    }
  }
}

}  // namespace deltacp::cuda::tiled::bwd
