// deltacp/distributed/cp_body.h — the CP pre-pass and merge, written once for the GPU and the host.
//
// measured: not yet (fp32 CUDA cores, no tensor cores; see "speed" below).
//
// What it computes (docs/design.md sections 3-4, reference/include/deltacp/reference/affine.h):
//
//   forward pre-pass over one span of n tokens (a rank's LAST local segment), per value head:
//     X = [start | I]  (K x (V + K), fp32; start = the sequence's h0 when it starts here, else 0)
//     per chunk:  Vn = Ux + s Wx X;   X <- diag(d) X + Kbx^T Vn
//     final X = [H | M]:  S_end = M S_start + H
//   backward pre-pass over a rank's FIRST local segment, chunks in reverse:
//     Y = [dend | I]
//     per chunk:  Z = dvl + Kb Y;     Y <- diag(d) Y + Qg^T dO + s W^T Z
//     final Y = [dH | M^T]:  dS_start = M^T dS_end + dH
//   with, per chunk (G the within-chunk cumulative log decay, d = e^(G_last), chunked.h):
//     gdn / kda / delta (s = -1): Wx = W = T Beta (K e^G), Ux = U = T Beta V, Kbx = Kb = K e^(G_last - G),
//                                 Qg = scale Q e^G, dvl = tril(scale (Q e^G)(K e^-G)^T)^T dO
//     dplr (s = +1): forward rows stacked [first n: Wx = 0, Ux = V, Kbx = K e^(G_last - G);
//                                          next n:  Wx = W, Ux = U, Kbx = B e^(G_last - G)]
//                    so that X <- D X + (K e^..)^T V + (B e^..)^T (U + W X);
//                    backward Kb = B e^(G_last - G), dvl = tril(scale (Q e^G)(B e^-G)^T)^T dO.
//   Columns >= V (the M block) have no values and no output gradient: Ux, dvl, dO read as 0 there.
//   Every column of X evolves independently, so the scan is tiled over columns.
//
//   merge: S = 0; for j in the given order: S <- A_j S + B_j with [B_j | A_j] one rank's gathered
//   [HV, K, V + K] buffer (forward: [H | M], ranks ascending; backward: [dH | M^T], descending).
//
// How it runs: three kernels (distributed/src/cp_kernels.cu) — prep (grid chunks x heads, fully parallel: the WY
// factors of each chunk into an fp32 workspace), scan (grid column tiles x heads, serial over chunks,
// the state tile in shared memory), merge (grid column tiles x heads). The bodies below are written
// as strided loops over work items between block barriers, so the same code runs on the host with one
// "thread" (distributed/tests/cp_body_host_test.cpp checks them against the Eigen reference).
//
// speed: every product is a plain fp32 loop (exact to the reference's fp32 within rounding). The
// obvious next steps — tensor-core mma with 3xTF32 splitting for W X and Kb^T Vn, staging W / Kb in
// shared memory, fusing prep into the scan — are not done.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DELTACP_HD __host__ __device__
#if defined(__CUDA_ARCH__)
#define DELTACP_BLOCK_SYNC() __syncthreads()
#else
#define DELTACP_BLOCK_SYNC() ((void)0)
#endif
#else
#define DELTACP_HD
#define DELTACP_BLOCK_SYNC() ((void)0)
#endif

namespace deltacp::dist {

// Variants and element types, numbered as deltacp::Variant / deltacp::DType (params.h).
enum : int { kDelta = 0, kGdn = 1, kKda = 2, kDplr = 3 };
enum : int { kF64 = 0, kF32 = 1, kBf16 = 2, kF16 = 3 };

// A [1, T, heads, D] view: element strides of the time and head axes (the last axis contiguous).
struct Ref {
  const void* ptr = nullptr;
  int64_t stride_t = 0, stride_h = 0;
};

// Who this thread is in its block (tid, nthreads); on the host: {0, 1}.
struct Lane {
  int tid, nthreads;
};

DELTACP_HD inline float half_bits_to_float(uint16_t h) {
  // IEEE binary16 -> binary32 by hand, so the host build needs no CUDA headers.
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

// Element `idx` of a tensor of element type `dt`, as fp32.
DELTACP_HD inline float load_f32(const void* p, int64_t idx, int dt) {
  switch (dt) {
    case kF32: return static_cast<const float*>(p)[idx];
    case kF64: return static_cast<float>(static_cast<const double*>(p)[idx]);
    case kBf16: {
      const uint32_t bits = (uint32_t)(static_cast<const uint16_t*>(p)[idx]) << 16;
      float f;
      memcpy(&f, &bits, sizeof f);
      return f;
    }
    default: return half_bits_to_float(static_cast<const uint16_t*>(p)[idx]);
  }
}

// One span (B = 1, tokens [0, n) of the given views) and its sizes.
struct Span {
  int variant = kGdn, dtype = kF32;
  // Element type of g (the log decay): -1 = like dtype, or kF32 beside 16-bit q, k, v (FLA keeps
  // the log decay in fp32; deltacp::Params::g_fp32).
  int g_dtype = -1;
  int64_t n = 0, H = 1, HV = 1, K = 0, V = 0;
  int chunk = 64;
  float scale = 1.f;
  Ref q, k, v, g, beta, a, b, dout;

  DELTACP_HD int64_t nchunks() const { return (n + chunk - 1) / chunk; }
  DELTACP_HD int64_t chunk_len(int64_t c) const {
    const int64_t t0 = c * chunk;
    return (n - t0 < chunk) ? n - t0 : chunk;
  }
  // Element (t, head, d) of a view; q, k are indexed by the key head hv / (HV / H).
  DELTACP_HD float at(const Ref& r, int64_t t, int64_t head, int64_t d) const {
    return load_f32(r.ptr, t * r.stride_t + head * r.stride_h + d, dtype);
  }
  // Element (t, hv, d) of g, in g's own element type.
  DELTACP_HD float gate(int64_t t, int64_t hv, int64_t d) const {
    return load_f32(g.ptr, t * g.stride_t + hv * g.stride_h + d, g_dtype < 0 ? dtype : g_dtype);
  }
  DELTACP_HD int64_t key_head(int64_t hv) const { return hv / (HV / H); }
};

// The fp32 workspace the prep kernel writes and the scan kernel reads. Row r of chunk c of head hv
// lives at row ((hv * nchunks + c) * rows + r); `rows` = chunk (2 chunk for the dplr forward).
struct Work {
  float* Wx = nullptr;   // [.., K]
  float* Ux = nullptr;   // [.., V]   forward: Ux;  backward: dvl
  float* Kbx = nullptr;  // [.., K]
  float* Qg = nullptr;   // [.., K]   backward only
  float* dO = nullptr;   // [.., V]   backward only: dout as fp32
  float* d = nullptr;    // [HV * nchunks, K]: e^(G_last) per chunk
  int64_t rows = 0;
};

// Shared memory (floats) the prep body needs: k and G, q (backward), a and b (dplr), A, T, Ak (dplr
// forward) and beta. prep_layout places them; the kernel asks for prep_smem_floats of them.
struct PrepLayout {
  int64_t k, q, a, b, G, A, T, Ak, beta, total;
};
DELTACP_HD inline PrepLayout prep_layout(int64_t C, int64_t K, int variant, bool backward) {
  PrepLayout l{};
  int64_t at = 0;
  auto take = [&](int64_t n) {
    const int64_t here = at;
    at += n;
    return here;
  };
  const bool dplr = variant == kDplr;
  l.k = take(C * K);
  l.q = backward ? take(C * K) : -1;
  l.a = dplr ? take(C * K) : -1;
  l.b = dplr ? take(C * K) : -1;
  l.G = take(C * K);
  l.A = take(C * C);
  l.T = take(C * C);
  l.Ak = dplr && !backward ? take(C * C) : -1;
  l.beta = take(C);
  l.total = at;
  return l;
}
DELTACP_HD inline int64_t prep_smem_floats(int64_t C, int64_t K, int variant, bool backward) {
  return prep_layout(C, K, variant, backward).total;
}
// ... and the scan body for a tile of CT columns (rows = rows per chunk in the workspace).
DELTACP_HD inline int64_t scan_smem_floats(int64_t rows, int64_t K, int64_t CT) { return K * CT + rows * CT; }
DELTACP_HD inline int64_t merge_smem_floats(int64_t K, int64_t CT) { return 2 * K * CT; }

// ---------------------------------------------------------------------------------------------
// prep: the WY factors of chunk c, value head hv, into the workspace.
// ---------------------------------------------------------------------------------------------
DELTACP_HD inline void prep_body(Lane L, const Span& s, const Work& w, int64_t c, int64_t hv, bool backward,
                                 float* smem) {
  const int64_t K = s.K, V = s.V, C = s.chunk, n = s.chunk_len(c), t0 = c * C, hk = s.key_head(hv);
  const bool dplr = s.variant == kDplr, scalar_gate = s.variant == kGdn || s.variant == kDelta;
  // Shared arrays, row-major [C][K] or [C][C] (prep_layout); absent ones point at k and are unused.
  const PrepLayout lay = prep_layout(C, K, s.variant, backward);
  float* sk = smem + lay.k;                          // k
  float* sq = smem + (lay.q >= 0 ? lay.q : lay.k);   // q (backward)
  float* sa = smem + (lay.a >= 0 ? lay.a : lay.k);   // a (dplr)
  float* sb = smem + (lay.b >= 0 ? lay.b : lay.k);   // b (dplr)
  float* sG = smem + lay.G;                          // G: within-chunk cumulative log decay
  float* sA = smem + lay.A;                          // A, then P (backward)
  float* sT = smem + lay.T;                          // T = (I + A)^-1  (dplr: (I - A)^-1)
  float* sAk = smem + (lay.Ak >= 0 ? lay.Ak : lay.A);  // dplr forward: Ak, then T Ak
  float* sbeta = smem + lay.beta;                    // beta

  for (int64_t idx = L.tid; idx < n * K; idx += L.nthreads) {
    const int64_t i = idx / K, d = idx % K, t = t0 + i;
    sk[idx] = s.at(s.k, t, hk, d);
    if (backward) sq[idx] = s.at(s.q, t, hk, d);
    if (dplr) {
      sa[idx] = s.at(s.a, t, hv, d);
      sb[idx] = s.at(s.b, t, hv, d);
    }
  }
  for (int64_t i = L.tid; i < n; i += L.nthreads) sbeta[i] = dplr ? 0.f : s.at(s.beta, t0 + i, hv, 0);
  // G: a running sum down each key column (gdn: the scalar gate, broadcast; delta: 0).
  for (int64_t d = L.tid; d < K; d += L.nthreads) {
    float run = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      if (s.variant == kDelta) {
        run = 0.f;
      } else {
        run += scalar_gate ? s.gate(t0 + i, hv, 0) : s.gate(t0 + i, hv, d);
      }
      sG[i * K + d] = run;
    }
  }
  DELTACP_BLOCK_SYNC();

  // Decayed Gram entry sum_d X_id Y_jd e^(Gl_id - G_jd) for j <= i (no e^-G is ever formed).
  // dplr uses Gl = G_{i-1} (the decay before token i: row i-1 of G, 0 for i = 0).
  auto gram = [&](const float* X, const float* Y, int64_t i, int64_t j, bool prev) -> float {
    float acc = 0.f;
    if (scalar_gate) {
      const float gl = prev ? (i > 0 ? sG[(i - 1) * K] : 0.f) : sG[i * K];
      for (int64_t d = 0; d < K; ++d) acc += X[i * K + d] * Y[j * K + d];
      return acc * expf(gl - sG[j * K]);
    }
    for (int64_t d = 0; d < K; ++d) {
      const float gl = prev ? (i > 0 ? sG[(i - 1) * K + d] : 0.f) : sG[i * K + d];
      acc += X[i * K + d] * Y[j * K + d] * expf(gl - sG[j * K + d]);
    }
    return acc;
  };

  // A (strictly lower): gdn/kda/delta beta_i k_i.k_j e^(G_i - G_j); dplr a_i.b_j e^(G_{i-1} - G_j).
  for (int64_t idx = L.tid; idx < C * C; idx += L.nthreads) {
    const int64_t i = idx / C, j = idx % C;
    float val = 0.f;
    if (i < n && j < i) val = dplr ? gram(sa, sb, i, j, true) : sbeta[i] * gram(sk, sk, i, j, false);
    sA[idx] = val;
    sT[idx] = (i == j) ? 1.f : 0.f;
  }
  DELTACP_BLOCK_SYNC();
  // T = (I + A)^-1 (dplr: (I - A)^-1) by forward substitution, one row at a time:
  // T_i = e_i - sum_{j < i} A_ij T_j  (dplr: + sum).
  const float sign_T = dplr ? 1.f : -1.f;
  for (int64_t i = 1; i < n; ++i) {
    for (int64_t m = L.tid; m < i; m += L.nthreads) {
      float acc = 0.f;
      for (int64_t j = m; j < i; ++j) acc += sA[i * C + j] * sT[j * C + m];
      sT[i * C + m] = sign_T * acc;
    }
    DELTACP_BLOCK_SYNC();
  }

  const int64_t row0 = (hv * s.nchunks() + c) * w.rows;
  const int64_t off = dplr && !backward ? n : 0;  // dplr forward: W, U, B-rows come second
  // d = e^(G_last); Kb = (k or b) e^(G_last - G); W = T (beta k e^G)  (dplr: T (a e^G_prev)).
  for (int64_t d = L.tid; d < K; d += L.nthreads) w.d[(hv * s.nchunks() + c) * K + d] = expf(sG[(n - 1) * K + d]);
  for (int64_t idx = L.tid; idx < n * K; idx += L.nthreads) {
    const int64_t i = idx / K, d = idx % K;
    const float to_end = expf(sG[(n - 1) * K + d] - sG[i * K + d]);
    float acc = 0.f;
    for (int64_t j = 0; j <= i; ++j) {
      if (dplr) {
        const float gp = j > 0 ? sG[(j - 1) * K + d] : 0.f;
        acc += sT[i * C + j] * sa[j * K + d] * expf(gp);
      } else {
        acc += sT[i * C + j] * sbeta[j] * sk[j * K + d] * expf(sG[j * K + d]);
      }
    }
    w.Wx[(row0 + off + i) * K + d] = acc;
    w.Kbx[(row0 + off + i) * K + d] = (dplr ? sb[idx] : sk[idx]) * to_end;
    if (dplr && !backward) {  // the first n rows: X <- ... + (K e^(G_last - G))^T V
      w.Wx[(row0 + i) * K + d] = 0.f;
      w.Kbx[(row0 + i) * K + d] = sk[idx] * to_end;
    }
    if (backward) w.Qg[(row0 + i) * K + d] = s.scale * sq[idx] * expf(sG[idx]);
  }
  DELTACP_BLOCK_SYNC();

  if (!backward) {
    // U = T Beta V (dplr: U = T (Ak V), Ak_ij = a_i.k_j e^(G_{i-1} - G_j), strictly lower).
    if (dplr) {
      // Ak (strictly lower) into sAk, then sA <- T Ak (sA is free once T is known).
      for (int64_t idx = L.tid; idx < C * C; idx += L.nthreads) {
        const int64_t i = idx / C, m = idx % C;
        sAk[idx] = (i < n && m < i) ? gram(sa, sk, i, m, true) : 0.f;
      }
      DELTACP_BLOCK_SYNC();
      for (int64_t idx = L.tid; idx < C * C; idx += L.nthreads) {
        const int64_t i = idx / C, m = idx % C;
        float acc = 0.f;
        if (i < n)
          for (int64_t j = m + 1; j <= i; ++j) acc += sT[i * C + j] * sAk[j * C + m];
        sA[idx] = acc;
      }
      DELTACP_BLOCK_SYNC();
    }
    for (int64_t idx = L.tid; idx < n * V; idx += L.nthreads) {
      const int64_t i = idx / V, col = idx % V;
      float acc = 0.f;
      for (int64_t j = 0; j <= i; ++j) {
        const float vj = s.at(s.v, t0 + j, hv, col);
        acc += (dplr ? sA[i * C + j] : sT[i * C + j] * sbeta[j]) * vj;
      }
      w.Ux[(row0 + off + i) * V + col] = acc;
      if (dplr) w.Ux[(row0 + i) * V + col] = s.at(s.v, t0 + i, hv, col);
    }
    return;
  }
  // Backward: P_ij = scale sum_d q_id (k or b)_jd e^(G_id - G_jd), j <= i; dvl = P^T dO; dO as fp32.
  const float* sKey = dplr ? sb : sk;
  for (int64_t idx = L.tid; idx < C * C; idx += L.nthreads) {
    const int64_t i = idx / C, j = idx % C;
    sA[idx] = (i < n && j <= i) ? s.scale * gram(sq, sKey, i, j, false) : 0.f;
  }
  DELTACP_BLOCK_SYNC();
  for (int64_t idx = L.tid; idx < n * V; idx += L.nthreads) {
    const int64_t j = idx / V, col = idx % V;
    float acc = 0.f;
    for (int64_t i = j; i < n; ++i) acc += sA[i * C + j] * s.at(s.dout, t0 + i, hv, col);
    w.Ux[(row0 + j) * V + col] = acc;
    w.dO[(row0 + j) * V + col] = s.at(s.dout, t0 + j, hv, col);
  }
}

// ---------------------------------------------------------------------------------------------
// scan: columns [col0, col0 + CT) of X (forward, chunks ascending) or Y (backward, descending).
// `init` is start (forward) / dend (backward), [HV, K, V] fp32 or null (= 0); out is [HV, K, V + K].
// ---------------------------------------------------------------------------------------------
DELTACP_HD inline void scan_body(Lane L, const Span& s, const Work& w, int64_t hv, int64_t col0, int64_t CT,
                                 bool backward, const float* init, float* out, float* smem) {
  const int64_t K = s.K, V = s.V, NC = s.nchunks(), width = V + K;
  const bool dplr = s.variant == kDplr;
  const float sgn = dplr ? 1.f : -1.f;
  const int64_t ncols = (col0 + CT <= width) ? CT : width - col0;
  float* X = smem;           // [K][CT]
  float* Vn = X + K * CT;    // [rows][CT]
  for (int64_t idx = L.tid; idx < K * CT; idx += L.nthreads) {
    const int64_t d = idx / CT, j = idx % CT, col = col0 + j;
    float x = 0.f;
    if (j < ncols) {
      if (col < V) {
        x = init ? init[(hv * K + d) * V + col] : 0.f;
      } else {
        x = (col - V == d) ? 1.f : 0.f;
      }
    }
    X[idx] = x;
  }
  DELTACP_BLOCK_SYNC();
  for (int64_t step = 0; step < NC; ++step) {
    const int64_t c = backward ? NC - 1 - step : step;
    const int64_t n = s.chunk_len(c);
    const int64_t rows = dplr && !backward ? 2 * n : n;
    const int64_t off = dplr && !backward ? n : 0;  // dplr forward: value rows first, then W rows
    const int64_t row0 = (hv * NC + c) * w.rows;
    const float* dvec = w.d + (hv * NC + c) * K;
    // phase 1 — forward: Vn = Ux + s Wx X;  backward: Z = dvl + Kb Y.
    for (int64_t idx = L.tid; idx < rows * CT; idx += L.nthreads) {
      const int64_t r = idx / CT, j = idx % CT, col = col0 + j;
      float acc = 0.f;
      if (j < ncols) {
        if (!backward) {
          // dplr's value rows (r < off) have Wx = 0 and Ux = V; the rest: U + s W X.
          // Row r of this chunk in the workspace is r for every variant (dplr rows are stacked).
          const int64_t wr = r;
          if (r >= off) {
            const float* Wr = w.Wx + (row0 + wr) * K;
            for (int64_t d = 0; d < K; ++d) acc += Wr[d] * X[d * CT + j];
            acc *= sgn;
          }
          if (col < V) acc += w.Ux[(row0 + wr) * V + col];
        } else {
          const float* Kr = w.Kbx + (row0 + r) * K;
          for (int64_t d = 0; d < K; ++d) acc += Kr[d] * X[d * CT + j];
          if (col < V) acc += w.Ux[(row0 + r) * V + col];
        }
      }
      Vn[idx] = acc;
    }
    DELTACP_BLOCK_SYNC();
    // phase 2 — forward: X <- d X + Kbx^T Vn;  backward: Y <- d Y + Qg^T dO + s W^T Z.
    for (int64_t idx = L.tid; idx < K * CT; idx += L.nthreads) {
      const int64_t d = idx / CT, j = idx % CT, col = col0 + j;
      if (j >= ncols) continue;
      float acc = dvec[d] * X[idx];
      if (!backward) {
        for (int64_t r = 0; r < rows; ++r) acc += w.Kbx[(row0 + r) * K + d] * Vn[r * CT + j];
      } else {
        float z = 0.f;
        for (int64_t r = 0; r < rows; ++r) z += w.Wx[(row0 + r) * K + d] * Vn[r * CT + j];
        acc += sgn * z;
        if (col < V)
          for (int64_t r = 0; r < rows; ++r) acc += w.Qg[(row0 + r) * K + d] * w.dO[(row0 + r) * V + col];
      }
      X[idx] = acc;  // only this thread reads or writes X[d][j] in this phase
    }
    DELTACP_BLOCK_SYNC();
  }
  for (int64_t idx = L.tid; idx < K * CT; idx += L.nthreads) {
    const int64_t d = idx / CT, j = idx % CT;
    if (j < ncols) out[(hv * K + d) * width + col0 + j] = X[idx];
  }
}

// ---------------------------------------------------------------------------------------------
// merge: S = 0; for j = first, first + step, ... (count terms): S <- A_j S + B_j, columns [col0, col0 + CT).
// gathered: [world, HV, K, V + K] with [B | A]; out: [HV, K, V].
// ---------------------------------------------------------------------------------------------
DELTACP_HD inline void merge_body(Lane L, const float* gathered, int64_t HV, int64_t K, int64_t V, int64_t hv,
                                  int64_t col0, int64_t CT, int64_t first, int64_t count, int64_t step, float* out,
                                  float* smem) {
  const int64_t width = V + K;
  const int64_t ncols = (col0 + CT <= V) ? CT : V - col0;
  float* S = smem;            // [K][CT]
  float* Snew = S + K * CT;   // [K][CT]
  for (int64_t idx = L.tid; idx < K * CT; idx += L.nthreads) S[idx] = 0.f;
  DELTACP_BLOCK_SYNC();
  for (int64_t t = 0; t < count; ++t) {
    const float* buf = gathered + ((first + t * step) * HV + hv) * K * width;
    for (int64_t idx = L.tid; idx < K * CT; idx += L.nthreads) {
      const int64_t d = idx / CT, j = idx % CT;
      if (j >= ncols) continue;
      float acc = buf[d * width + col0 + j];  // B_j
      const float* Arow = buf + d * width + V;  // row d of A_j
      for (int64_t e = 0; e < K; ++e) acc += Arow[e] * S[e * CT + j];
      Snew[idx] = acc;
    }
    DELTACP_BLOCK_SYNC();
    for (int64_t idx = L.tid; idx < K * CT; idx += L.nthreads) S[idx] = Snew[idx];
    DELTACP_BLOCK_SYNC();
  }
  for (int64_t idx = L.tid; idx < K * CT; idx += L.nthreads) {
    const int64_t d = idx / CT, j = idx % CT;
    if (j < ncols) out[(hv * K + d) * V + col0 + j] = S[idx];
  }
}

}  // namespace deltacp::dist
