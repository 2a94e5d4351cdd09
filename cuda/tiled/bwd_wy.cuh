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
// One CTA of 8 warps per (chunk, value head); warp w owns rows 16 (w % 4) .. + 16 of every product and
// half w / 4 of its columns. dT accumulates in registers (mma accumulators) over the walk over V in tiles
// of BV columns and then the key side; Y and Z are consumed by their epilogues from registers. The V tiles
// (dU in fp32, rounded in shared memory; v) come by cp.async, NS stages deep; T, k and G (what the key
// side and the epilogues read) by cp.async at the start, overlapping the V walk. dbeta: each row's parts
// (per column half, in a fixed order) go to a.dbw; dk and kda's dG are added to stage B2's workspaces, gdn's
// dG row sums to a.dGr (each element by one thread: no atomics, deterministic).
// At most 128 registers: two CTAs per SM where the shared memory allows (under ~113 KB a CTA: 16-bit
// gdn / delta, fp32 and 16-bit kda at K <= 64, and 16-bit kda at K > 64 with one V stage, which the launch
// does not pick yet: it takes two stages wherever they fit one CTA; which is faster is not measured).
// Measured (NVIDIA H200, bf16 gdn, kernel time per call, 2026-11-25): 1.02 ms at (2, 16384, 16, 128), 1.58 at
// (1, 8192, 96, 128); 1.15 and 1.80 when the epilogue read each of B2's dk pairs just before storing it (the
// compiler kept every read behind the previous store). Earlier, with dT in fp32 shared memory and element-wise
// loads and epilogues, 2.89 ms at (1, 32768, 16, 128) (H200). kda (H100, bf16, (2, 16384, 16, 128), 2026-11-27):
// 2.40 -> 1.54 ms with dW and beta K e^G built eight keys per thread and kda's dk and dG pairs read before the
// epilogue's stores (two passes of half the n-tiles), as gdn's dk already was.
#pragma once

#include "bwd_common.cuh"

namespace deltacp::cuda::tiled::bwd {

template <class Op>
constexpr int wy_vtile() {
  return kIs16Bit<Op> ? 32 : 16;
}

template <class Op, int KP, bool PERKEY, int NS>
struct WyBwdSmem {
  static constexpr int BV = wy_vtile<Op>();
  static constexpr int PA = kRows + 4;                             // fp32 T (16-byte rows)
  static constexpr int P64 = kIs16Bit<Op> ? kRows + 8 : kRows + 4;  // Op 64 x 64 (fp32: T itself)
  static constexpr int PV = kIs16Bit<Op> ? BV + 8 : BV + 4;          // Op V tiles
  static constexpr int PVF = BV + 4;                                // fp32 staging of dU
  static constexpr int PK = kIs16Bit<Op> ? KP + 8 : KP + 4;          // Op key-side tiles
  static constexpr int PG = KP + 4;                                 // kda's G tile
  size_t Ts = 0, Top = 0, beta = 0, part = 0, gpart = 0, k = 0, G = 0, dUf = 0, vs = 0, stage = 0, dUop = 0, Bv = 0,
         dWop = 0, Bx = 0, M1op = 0, dTop = 0, total = 0;
  __host__ __device__ constexpr WyBwdSmem() {
    Carve c;
    Ts = c.take(sizeof(float) * kRows * PA);
    Top = kIs16Bit<Op> ? c.take(sizeof(Op) * kRows * P64) : Ts;  // fp32: the operand is Ts itself
    beta = c.take(sizeof(float) * kRows);
    part = c.take(sizeof(float) * 2 * kRows);  // dbeta parts of the two column halves
    gpart = c.take(PERKEY ? 0 : sizeof(float) * 2 * kRows);  // gdn: dG row sums of the two column halves
    k = c.take(sizeof(Op) * kRows * PK);
    G = c.take(sizeof(float) * (PERKEY ? kRows * PG : kRows));
    Carve v = c;  // the V walk's tiles
    dUf = v.take(sizeof(float) * kRows * PVF);
    vs = v.take(sizeof(Op) * kRows * PV);
    stage = v.off - dUf;
    v.off = dUf + stage * NS;
    dUop = v.take(sizeof(Op) * kRows * PV);
    Bv = v.take(sizeof(Op) * kRows * PV);
    Carve w = c;  // the key side, over the V walk's bytes; M1 and dT later over dW's and (beta X)'s
    dWop = w.take(sizeof(Op) * kRows * PK);
    Bx = w.take(sizeof(Op) * kRows * PK);
    M1op = dWop;
    dTop = Bx;
    total = v.off > w.off ? v.off : w.off;
  }
};

template <class Op, int KP, bool PERKEY, int NS>
__global__ void __launch_bounds__(kThreads, 2) bwd_wy_kernel(const Args a) {
  constexpr WyBwdSmem<Op, KP, PERKEY, NS> L{};
  constexpr int BV = L.BV, PA = L.PA, P64 = L.P64, PV = L.PV, PVF = L.PVF, PK = L.PK, PG = L.PG;
  constexpr int NTY = BV / 16, NTK = KP / 16;  // n-tiles of 8 in a warp's half of Y's and Z's columns
  static_assert(kIs16Bit<Op> || PA == P64, "fp32 operand view of T must share its pitch");
  static_assert(P64 <= PK, "M1 and dT reuse the bytes of the key-side tiles");
  extern __shared__ __align__(16) unsigned char smem[];
  float* Ts = reinterpret_cast<float*>(smem + L.Ts);
  Op* Top = reinterpret_cast<Op*>(smem + L.Top);
  float* betas = reinterpret_cast<float*>(smem + L.beta);
  float* part = reinterpret_cast<float*>(smem + L.part);
  float* gpart = reinterpret_cast<float*>(smem + L.gpart);
  Op* ks = reinterpret_cast<Op*>(smem + L.k);
  float* Gs = reinterpret_cast<float*>(smem + L.G);
  Op* dUop = reinterpret_cast<Op*>(smem + L.dUop);
  Op* Bv = reinterpret_cast<Op*>(smem + L.Bv);
  Op* dWop = reinterpret_cast<Op*>(smem + L.dWop);
  Op* Bx = reinterpret_cast<Op*>(smem + L.Bx);
  Op* M1op = reinterpret_cast<Op*>(smem + L.M1op);
  Op* dTop = reinterpret_cast<Op*>(smem + L.dTop);
  auto at = [&](size_t base, int t) { return smem + base + static_cast<size_t>(t % NS) * L.stage; };

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t c = blockIdx.x, hv = blockIdx.y, hk = hv / a.group;
  const ChunkEntry ch = a.chunks[c];
  const int len = static_cast<int>(ch.len);
  const int K = static_cast<int>(a.K);
  const int V = static_cast<int>(a.V);
  const int ntiles = (V + BV - 1) / BV;
  const Op* vp = static_cast<const Op*>(a.v.ptr) + off(a.v, ch.batch, ch.t0, hv);
  const float* dUp = a.dvnew + ws_row(ch, 0, a.HV, hv, a.V);

  // T, k, G: one cp.async group (rows past len zero), before the V walk's.
  {
    const float* tsrc = a.Tinv + (ch.row0 * a.HV + hv) * kRows;
    load_tile<float, kThreads>(Ts, PA, tsrc, a.HV * kRows, len, kRows, kRows, kRows, vec_ok(tsrc, a.HV * kRows));
    load_chunk_rows<Op, KP>(ks, PK, a.k, ch, hk, len, K);
    if (a.gated) load_chunk_G<KP, PERKEY>(Gs, PG, a, ch, hv, len);
    cp_async_commit();
  }
  if (tid < kRows) {
    betas[tid] = tid < len ? ld<Op>(a.beta, off(a.beta, ch.batch, ch.t0 + tid, hv)) : 0.f;
    part[tid] = part[kRows + tid] = 0.f;
  }
  // V tile t (columns v0 .. v0 + BV) into stage t % NS: one cp.async group.
  auto issue = [&](int t) {
    const int v0 = t * BV, vw = min(BV, V - v0);
    float* dUf = reinterpret_cast<float*>(at(L.dUf, t));
    Op* vs = reinterpret_cast<Op*>(at(L.vs, t));
    load_tile<float, kThreads>(dUf, PVF, dUp + v0, a.HV * a.V, len, kRows, vw, BV, vec_ok(dUp + v0, a.HV * a.V));
    load_tile<Op, kThreads>(vs, PV, vp + v0, a.v.stride_t, len, kRows, vw, BV, vec_ok(vp + v0, a.v.stride_t));
    cp_async_commit();
  };
  issue(0);            // V >= 1 (validate.cpp): at least one tile
  cp_async_wait<1>();  // T, k, G (tile 0 may still be in flight)
  __syncthreads();
  if constexpr (kIs16Bit<Op>) {
    for (int e = tid; e < kRows * kRows; e += kThreads) {
      const int i = e / kRows, j = e % kRows;
      Top[i * P64 + j] = from_f<Op>(Ts[i * PA + j]);
    }
  }

  const int m0 = 16 * (warp & 3), half = warp >> 2;
  const int g = lane >> 2;  // accumulator rows m0 + g, m0 + g + 8
  float dt[1][4][4];        // dT, columns 32 half .. + 32
  zero_acc(dt);
  // Adds a lane's two row sums (rows m0 + g, m0 + g + 8) to the rows' dbeta part of this column half: the
  // four lanes of a row first, then lane 4 g adds (the same order every time).
  auto add_rows = [&](float s0, float s1) {
    s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
    s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    if ((lane & 3) == 0) {
      part[half * kRows + m0 + g] += s0;
      part[half * kRows + m0 + g + 8] += s1;
    }
  };

  for (int t = 0; t < ntiles; ++t) {
    await_tile<NS>(t, ntiles, issue);  // tile t (and the chunk's tiles loaded before the walk) landed
    __syncthreads();
    const int v0 = t * BV;
    const float* dUf = reinterpret_cast<const float*>(at(L.dUf, t));
    const Op* vs = reinterpret_cast<const Op*>(at(L.vs, t));
    // dU as an operand, and beta V.
    {
      constexpr int EP = kRows * BV / kThreads, TP = BV / EP;
      static_assert(EP % 4 == 0 && TP * EP == BV, "dU conversion: whole float4 pieces per thread");
      const int i = tid / TP, v = (tid % TP) * EP;
#pragma unroll
      for (int e = 0; e < EP; e += 4) {
        const float4 x = *reinterpret_cast<const float4*>(dUf + i * PVF + v + e);
        store_pair(dUop + i * PV + v + e, x.x, x.y);
        store_pair(dUop + i * PV + v + e + 2, x.z, x.w);
#pragma unroll
        for (int j = 0; j < 4; j += 2)
          store_pair(Bv + i * PV + v + e + j, betas[i] * to_f(vs[i * PV + v + e + j]),
                     betas[i] * to_f(vs[i * PV + v + e + j + 1]));
      }
    }
    __syncthreads();
    // dT += dU (beta V)^T (B(v, j) = Bv[j][v]); Y = T^T dU (A = T^T: T's column-major view).
    warp_mma<Op, 1, 4, Lay::rowmajor, Lay::colmajor>(dt, dUop, PV, m0, Bv, PV, 32 * half, 0, BV);
    float y[1][NTY][4];
    zero_acc(y);
    warp_mma<Op, 1, NTY, Lay::colmajor, Lay::rowmajor>(y, Top, P64, m0, dUop, PV, half * (BV / 2), 0, kRows);
    // dv = beta Y (rows < len, columns < V), and Y . v into dbeta.
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < NTY; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = m0 + acc_row(0, e), v = half * (BV / 2) + acc_col(nt, e);
        if (i < len && v0 + v < V) {
          st<Op>(a.dv, off(a.dv, ch.batch, ch.t0 + i, hv) + v0 + v, betas[i] * y[0][nt][e]);
          s[e >> 1] += y[0][nt][e] * to_f(vs[i * PV + v]);
        }
      }
    add_rows(s[0], s[1]);
    __syncthreads();  // the stage and dUop / Bv are free for the next tile
  }

  // dW as an operand, and beta X = beta k e^G (the V walk's bytes are free).
  auto G_of = [&](int i, int d) -> float {
    if (!a.gated) return 0.f;
    if constexpr (PERKEY) return Gs[i * PG + d];
    return Gs[i];
  };
  // Eight keys per thread (16-byte pieces of dW's rows where K and its pointer allow them): element by element,
  // each a 2-byte global load and an exponential apart, this loop was a long serial stretch of kda's stage.
  {
    constexpr int kPieces = KP / 8;
    const Op* dWg = static_cast<const Op*>(a.dW);
    const bool dw_vec = K % 8 == 0 && reinterpret_cast<uintptr_t>(dWg) % 16 == 0;
    for (int e = tid; e < kRows * kPieces; e += kThreads) {  // consecutive threads, consecutive pieces
      const int i = e / kPieces, d0 = 8 * (e % kPieces);
      float w[8], kx[8], gv[8];
      load8_upto(dWg + ws_row(ch, i, a.HV, hv, a.K) + d0, i < len ? K - d0 : 0, dw_vec, w);
      store8(dWop + i * PK + d0, w);
      load8(ks + i * PK + d0, kx);
      if constexpr (PERKEY) {
        load8f(Gs + i * PG + d0, gv);
      } else {
#pragma unroll
        for (int h = 0; h < 8; ++h) gv[h] = G_of(i, d0 + h);
      }
#pragma unroll
      for (int h = 0; h < 8; ++h) {
        const bool ok = i < len && d0 + h < K;
        kx[h] = ok ? betas[i] * kx[h] * (a.gated ? exp_t<Op>(gv[h]) : 1.f) : 0.f;
      }
      store8(Bx + i * PK + d0, kx);
    }
  }
  __syncthreads();
  // dT += dW (beta X)^T; Z = T^T dW.
  warp_mma<Op, 1, 4, Lay::rowmajor, Lay::colmajor>(dt, dWop, PK, m0, Bx, PK, 32 * half, 0, KP);
  float z[1][NTK][4];
  zero_acc(z);
  warp_mma<Op, 1, NTK, Lay::colmajor, Lay::rowmajor>(z, Top, P64, m0, dWop, PK, half * (KP / 2), 0, kRows);
  __syncthreads();  // dW and beta X are read: M1 and dT take their bytes
  // dk += beta Z Gam, dG += beta Z X, Z . X into dbeta.
  {
    const bool pairs = (K % 2) == 0;  // rows of the [R, HV, K] workspaces stay 8-byte aligned
    float s[2] = {0.f, 0.f}, gs[2] = {0.f, 0.f};  // per row: Z . X; gdn: dG summed over this lane's columns
    // B2's dk (and kda's dG) pairs (K even), read before any store of their pass: in the loop below each read
    // waited for the previous element's store (the compiler cannot tell the addresses apart), one memory
    // latency each. kda reads two workspaces, so it goes in two passes of half the n-tiles (register budget).
    constexpr int kPasses = PERKEY ? 2 : 1, NQ = NTK / kPasses;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      float2 wk[NQ][2], wg[NQ][2];
#pragma unroll
      for (int q = 0; q < NQ; ++q)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int i = m0 + acc_row(0, 2 * h2), d = half * (KP / 2) + acc_col(pass * NQ + q, 0);
          wk[q][h2] = wg[q][h2] = make_float2(0.f, 0.f);
          if (pairs && i < len && d < K) {
            const int64_t o = ws_row(ch, i, a.HV, hv, a.K) + d;
            wk[q][h2] = *reinterpret_cast<const float2*>(a.dkw + o);
            if constexpr (PERKEY) wg[q][h2] = *reinterpret_cast<const float2*>(a.dGw + o);
          }
        }
#pragma unroll
      for (int q = 0; q < NQ; ++q)
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          const int nt = pass * NQ + q;
          const int i = m0 + acc_row(0, 2 * h2), d = half * (KP / 2) + acc_col(nt, 0);
          if (i >= len || d >= K) continue;
          const int64_t o = ws_row(ch, i, a.HV, hv, a.K) + d;
          float dk[2], dg[2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float zz = z[0][nt][2 * h2 + j];
            const float gam = (a.gated && d + j < K) ? exp_t<Op>(G_of(i, d + j)) : 1.f;
            const float x = d + j < K ? to_f(ks[i * PK + d + j]) * gam : 0.f;
            dk[j] = betas[i] * zz * gam;
            dg[j] = betas[i] * zz * x;
            s[h2] += zz * x;
          }
          if (pairs) {
            const float2 w = wk[q][h2];
            *reinterpret_cast<float2*>(a.dkw + o) = make_float2(w.x + dk[0], w.y + dk[1]);
            if constexpr (PERKEY) {
              const float2 u = wg[q][h2];
              *reinterpret_cast<float2*>(a.dGw + o) = make_float2(u.x + dg[0], u.y + dg[1]);
            } else {
              gs[h2] += dg[0] + dg[1];
            }
          } else {
#pragma unroll
            for (int j = 0; j < 2; ++j)
              if (d + j < K) {
                a.dkw[o + j] += dk[j];
                if constexpr (PERKEY) a.dGw[o + j] += dg[j];
                else gs[h2] += dg[j];
              }
          }
        }
    }
    add_rows(s[0], s[1]);
    if constexpr (!PERKEY) {  // gdn: the four lanes of a row, then lane 4 g writes this half's sum
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        gs[h2] += __shfl_xor_sync(0xffffffffu, gs[h2], 1);
        gs[h2] += __shfl_xor_sync(0xffffffffu, gs[h2], 2);
        if ((lane & 3) == 0) gpart[half * kRows + m0 + g + 8 * h2] = gs[h2];
      }
    }
  }
  acc_to_tile(dt, dTop, P64, m0, 32 * half);  // dT as an operand
  __syncthreads();
  // M1 = T^T dT, as an operand.
  {
    float m1[1][4][4];
    zero_acc(m1);
    warp_mma<Op, 1, 4, Lay::colmajor, Lay::rowmajor>(m1, Top, P64, m0, dTop, P64, 32 * half, 0, kRows);
    acc_to_tile(m1, M1op, P64, m0, 32 * half);
  }
  __syncthreads();
  if (tid < len) a.dbw[(ch.row0 + tid) * a.HV + hv] = part[tid] + part[kRows + tid];
  if constexpr (!PERKEY)  // gdn: B2's row sums of dG plus this stage's (the two halves in a fixed order)
    if (a.gated && tid < len) a.dGr[(ch.row0 + tid) * a.HV + hv] += gpart[tid] + gpart[kRows + tid];
  // dA = -M1 T^T (B(l, j) = T[j][l]: T's column-major view), strictly lower, rows < len.
  float da[1][4][4];
  zero_acc(da);
  warp_mma<Op, 1, 4, Lay::rowmajor, Lay::colmajor>(da, M1op, P64, m0, Top, P64, 32 * half, 0, kRows);
  float* dAg = a.dA + (c * a.HV + hv) * kRows * kRows;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      const int i = m0 + acc_row(0, 2 * h2), j = 32 * half + acc_col(nt, 0);
      const float x0 = (i > j && i < len) ? -da[0][nt][2 * h2] : 0.f;
      const float x1 = (i > j + 1 && i < len) ? -da[0][nt][2 * h2 + 1] : 0.f;
      *reinterpret_cast<float2*>(dAg + i * kRows + j) = make_float2(x0, x1);
    }
}

}  // namespace deltacp::cuda::tiled::bwd
