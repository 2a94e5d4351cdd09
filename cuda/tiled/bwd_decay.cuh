// cuda/tiled/bwd_decay.cuh — backward stage B4: the decay-masked products, then the final
// per-value-head gradients dbeta and dg.
//
// P_ij = sum_d q_id k_jd E_ij^d and A_ij = beta_i sum_d k_id k_jd E_ij^d (E_ij^d = e^(G_id - G_jd))
// give, with dP from stage B2 and dA from stage B3 (both already masked):
//
//   Yq_id = sum_{j<=i} dP_ij k_jd E_ij^d          dq += Yq,          dG += q * Yq
//   Yr_id = sum_{j< i} dA_ij k_jd E_ij^d          dk += beta * Yr,   dG += beta k * Yr,  dbeta_i += k_i . Yr_i
//   Yc_jd = sum_{i>=j} (dP_ij q_id + beta_i dA_ij k_id) E_ij^d
//                                                 dk += Yc,          dG -= k * Yc
//
// (the k_i and G_i sides of each product, and the k_j and G_j sides; docs/design.md section 3.)
// Finally, per token: dbeta = (stage B3's part) + k . Yr, and dg = reverse cumulative sum over the
// chunk of dG (G_i = g_1 + ... + g_i), summed over d first for gdn's scalar gate.
//
//   gdn / delta (bwd_decay_scalar_kernel): E_ij is one scalar per (i, j), so the products are tensor-core
//     GEMMs on the decayed 64 x 64 matrices dP o E, dA o E, diag(beta) dA o E: Yq, Yr and Yc (two
//     products) accumulate in registers (warp w: rows 16 (w % 4), half w / 4 of the key columns, in two
//     passes of a quarter each), and one epilogue adds all three to B2's and B3's parts and sums each row's
//     k . Yr and dG (for dbeta and dg; B2 and B3 hand over dG as row sums, a.dGr) from the registers.
//     dP, dA, q, k come by cp.async. One CTA of 8 warps per (chunk, value head); two fit an SM on sm_90.
//   kda, 16-bit inputs (bwd_decay_kda_tc_kernel): E depends on d; the 16 x 16 blocks factorise around a reference
//     row onto the tensor cores (the diagonal ones in tf32, or summed in fp32 one thread per (block, key column)
//     where their factors leave the range; see the kernel's comment).
//   kda, fp32 inputs (bwd_decay_kda_kernel): each (row, key column) sums over the chunk element by element.
// With one value head per key head (group 1) this stage writes dq and dk to the outputs (no stage B5).
// Measured (NVIDIA H200, bf16 gdn, kernel time per call, 2026-11-25): 0.67 ms at (2, 16384, 16, 128), 1.05 at
// (1, 8192, 96, 128), with B2's and B3's dq / dk parts read before the products; 0.94 and 1.46 when each was
// read in the epilogue just before its store (one memory latency per element pair).
// Earlier (H100, bf16, (2, 16384, 16, 128), torch.profiler, 2026-11-23): gdn 1.08 ms (1.64 when
// dG travelled as an [R, HV, K] workspace and one CTA of 96 accumulator registers a thread filled an SM; 3.44
// ms on H200 with four block GEMMs each with a read-modify-write epilogue); kda 2.98 ms (8.35 element
// by element). kda, H100, (2, 16384, 16, 128), 2026-11-27: 3.08 -> 1.82 ms with the operands scaled eight keys
// per thread, dP and dA converted four at a time, and B2's / B3's parts read before the diagonal sums (each
// read had waited for the previous row's stores: 48 memory latencies per (block, key column) task).
#pragma once

#include "bwd_common.cuh"
#include "kda_scores.cuh"
#include "wy_solve.cuh"

namespace deltacp::cuda::tiled::bwd {

// ---- pieces the B4 kernels share --------------------------------------------------------------------
// Issues the cp.async copies of the chunk's dP and dA (fp32 64 x 64, masked by B2 and B3; leading dimension
// PA) and its q, k rows (zero past len and K; leading dimension PK). The caller commits and waits.
template <class Op, int KP>
__device__ __forceinline__ void load_decay_inputs(float* dPs, float* dAs, int PA, Op* qs, Op* ks, int PK, const Args& a,
                                                  const ChunkEntry& ch, int64_t c, int64_t hv, int64_t hk) {
  const int len = static_cast<int>(ch.len), K = static_cast<int>(a.K);
  const float* dPg = a.dP + (c * a.HV + hv) * kRows * kRows;
  const float* dAg = a.dA + (c * a.HV + hv) * kRows * kRows;
  load_tile<float, kThreads>(dPs, PA, dPg, kRows, kRows, kRows, kRows, kRows, vec_ok(dPg, kRows));
  load_tile<float, kThreads>(dAs, PA, dAg, kRows, kRows, kRows, kRows, kRows, vec_ok(dAg, kRows));
  load_chunk_rows<Op, KP>(qs, PK, a.q, ch, hk, len, K);
  load_chunk_rows<Op, KP>(ks, PK, a.k, ch, hk, len, K);
}

// kda's last step, after a barrier: dbeta = stage B3's part + k . Yr, the row's NP parts (kpart[row * NP + p],
// one per 32 key columns) summed in a fixed order; dg = reverse cumulative sum of dG over the chunk's tokens
// (G_i = g_1 + ... + g_i, chunk-local), dG_of(i, d) giving the chunk's final dG.
template <class Op, int NP, class DG>
__device__ __forceinline__ void finish_kda_chunk(const Args& a, const ChunkEntry& ch, int64_t hv,
                                                 const float* kpart, DG&& dG_of) {
  const int tid = threadIdx.x, len = static_cast<int>(ch.len), K = static_cast<int>(a.K);
  if (tid < len) {
    float s = a.dbw[(ch.row0 + tid) * a.HV + hv];
#pragma unroll
    for (int p = 0; p < NP; ++p) s += kpart[tid * NP + p];
    st<Op>(a.dbeta, off(a.dbeta, ch.batch, ch.t0 + tid, hv), s);
  }
  for (int d = tid; d < K; d += kThreads) {
    float acc = 0.f;
    for (int i = len - 1; i >= 0; --i) {
      acc += dG_of(i, d);
      store_gate<Op>(a, off(a.dg, ch.batch, ch.t0 + i, hv) + d, acc);
    }
  }
}

// ---- kda: per key column, element by element -----------------------------------------------------
template <class Op, int KP>
struct DecayKdaSmem {
  static constexpr int PA = kRows + 1, PF = KP + 1;  // fp32 tiles (odd pitches: column walks hit 32 banks)
  // dP, dA, dB = diag(beta) dA, q, k, G (fp32), per-warp partial sums of k . Yr.
  size_t dP = 0, dA = 0, dB = 0, q = 0, k = 0, G = 0, beta = 0, rowsum = 0, total = 0;
  __host__ __device__ constexpr DecayKdaSmem() {
    Carve c;
    dP = c.take(sizeof(float) * kRows * PA);
    dA = c.take(sizeof(float) * kRows * PA);
    dB = c.take(sizeof(float) * kRows * PA);
    q = c.take(sizeof(float) * kRows * PF);
    k = c.take(sizeof(float) * kRows * PF);
    G = c.take(sizeof(float) * kRows * PF);
    beta = c.take(sizeof(float) * kRows);
    rowsum = c.take(sizeof(float) * kRows * (KP / 32));
    total = c.off;
  }
};

template <class Op, int KP>
__global__ void __launch_bounds__(kThreads) bwd_decay_kda_kernel(const Args a) {
  constexpr DecayKdaSmem<Op, KP> L{};
  constexpr int PA = L.PA, PF = L.PF;
  constexpr int kParts = KP / 32;  // warps per key row
  extern __shared__ __align__(16) unsigned char smem[];
  float* dPs = reinterpret_cast<float*>(smem + L.dP);
  float* dAs = reinterpret_cast<float*>(smem + L.dA);
  float* dBs = reinterpret_cast<float*>(smem + L.dB);
  float* qs = reinterpret_cast<float*>(smem + L.q);
  float* ks = reinterpret_cast<float*>(smem + L.k);
  float* Gk = reinterpret_cast<float*>(smem + L.G);
  float* betas = reinterpret_cast<float*>(smem + L.beta);
  float* rowsum = reinterpret_cast<float*>(smem + L.rowsum);  // [64][kParts]

  const int tid = threadIdx.x;
  const int64_t c = blockIdx.x, hv = blockIdx.y, hk = hv / a.group;
  const ChunkEntry ch = a.chunks[c];
  const int len = static_cast<int>(ch.len);
  const int K = static_cast<int>(a.K);
  const Op* qp = static_cast<const Op*>(a.q.ptr);
  const Op* kp = static_cast<const Op*>(a.k.ptr);
  const float* dPg = a.dP + (c * a.HV + hv) * kRows * kRows;
  const float* dAg = a.dA + (c * a.HV + hv) * kRows * kRows;

  for (int i = tid; i < kRows; i += kThreads)
    betas[i] = i < len ? ld<Op>(a.beta, off(a.beta, ch.batch, ch.t0 + i, hv)) : 0.f;
  for (int e = tid; e < kRows * kParts; e += kThreads) rowsum[e] = 0.f;
  __syncthreads();
  for (int e = tid; e < kRows * kRows; e += kThreads) {
    const int i = e / kRows, j = e % kRows;
    dPs[i * PA + j] = dPg[e];
    dAs[i * PA + j] = dAg[e];
    dBs[i * PA + j] = betas[i] * dAg[e];
  }
  for (int e = tid; e < kRows * KP; e += kThreads) {
    const int i = e / KP, d = e % KP;
    const bool ok = i < len && d < K;
    qs[i * PF + d] = ok ? to_f(qp[off(a.q, ch.batch, ch.t0 + i, hk) + d]) : 0.f;
    ks[i * PF + d] = ok ? to_f(kp[off(a.k, ch.batch, ch.t0 + i, hk) + d]) : 0.f;
    Gk[i * PF + d] = G_at(a, true, ch, len, hv, i, d);  // padding rows repeat the last row; d >= K: 0
  }
  __syncthreads();
  // Thread (row group r, key column d): rows i = r, r + RS, ... below len. A warp shares i
  // (KP >= 32 consecutive threads per row), so the loop bound is warp-uniform for the shuffles.
  constexpr int RS = kThreads / KP;
  const int d = tid % KP, r = tid / KP;
  for (int i = r; i < len; i += RS) {
    // The workspace values this thread adds to, loaded before the sums so that their latency is hidden
    // (read after the sums they stalled every thread: a quarter of the stage's time under Nsight Compute).
    const int64_t o = ws_row(ch, i, a.HV, hv, a.K) + d;
    float wq = 0.f, wk = 0.f, wg = 0.f;
    if (d < K) {
      wq = a.dqw[o];
      wk = a.dkw[o];
      wg = a.dGw[o];
    }
    const float Gi = Gk[i * PF + d];
    float yq = 0.f, yr = 0.f, ycol = 0.f;
    for (int j = 0; j <= i; ++j) {  // row i: E_ij^d = e^(G_id - G_jd), j <= i
      const float kj = ks[j * PF + d] * exp_t<Op>(Gi - Gk[j * PF + d]);
      yq = fmaf(dPs[i * PA + j], kj, yq);
      yr = fmaf(dAs[i * PA + j], kj, yr);
    }
    for (int i2 = i; i2 < len; ++i2) {  // column i: E_{i2,i}^d = e^(G_{i2,d} - G_id), i2 >= i
      const float z = dPs[i2 * PA + i] * qs[i2 * PF + d] + dBs[i2 * PA + i] * ks[i2 * PF + d];
      ycol = fmaf(z, exp_t<Op>(Gk[i2 * PF + d] - Gi), ycol);
    }
    const float qv = qs[i * PF + d], kv = ks[i * PF + d], b = betas[i];
    if (d < K) {
      if (a.group == 1) {  // dq, dk final: straight to the outputs (no stage B5)
        st<Op>(a.dq, off(a.dq, ch.batch, ch.t0 + i, hk) + d, wq + yq);
        st<Op>(a.dk, off(a.dk, ch.batch, ch.t0 + i, hk) + d, wk + (b * yr + ycol));
      } else {
        a.dqw[o] = wq + yq;
        a.dkw[o] = wk + (b * yr + ycol);
      }
      a.dGw[o] = wg + (qv * yq + b * kv * yr - kv * ycol);
    }
    const float part = warp_sum(kv * yr);  // kv = 0 for d >= K
    if ((tid & 31) == 0) rowsum[i * kParts + d / 32] = part;
  }
  __syncthreads();
  finish_kda_chunk<Op, kParts>(a, ch, hv, rowsum,
                               [&](int i, int d) { return a.dGw[ws_row(ch, i, a.HV, hv, a.K) + d]; });
}

// ---- kda, 16-bit inputs: the 16 x 16 blocks on the tensor cores ------------------------------------------
// E_ij^d = e^(G_id - G_jd) factorises around a reference row between i and j: e^(G_i - G_r) e^(G_r - G_j),
// both exponents <= 0 (G decreases along the chunk). Row block a (rows 16 a ..): for j < 16 a, with r = 16 a,
//   Yq_i += e^(G_i - G_r) o sum_j dP_ij Kr_j,  Yr_i += e^(G_i - G_r) o sum_j dA_ij Kr_j,  Kr_j = k_j e^(G_r - G_j)
// and column block b (columns j = 16 b ..): for i >= s = 16 (b + 1),
//   Yc_j += e^(G_s - G_j) o sum_i (dP_ij Qs_i + beta_i dA_ij Ks_i), Qs_i = q_i e^(G_i - G_s), Ks_i = k_i e^(G_i - G_s)
// Tensor-core products over 16 a or 64 - s rows (warp w: rows 16 (w % 4), half w / 4 of the key columns); the
// operands take 192 rows x K exponentials a chunk.
// The diagonal blocks (pairs j <= i inside block a) go through the same reference rows (s = 63 for the last
// block), into the same accumulators: their own rows' factors e^(G_r - G_j) and e^(G_i - G_s) now grow (exponents
// >= 0, at most the block's decay over 16 tokens), so these products take fp32 operands on mma.sync in tf32 (10-bit
// mantissa), as FLA's safe_gate path takes its diagonal sub-blocks, and the pairs j = i (decay 1) stay out of them:
// they are added in fp32. Both matter for dg, a reverse sum over the chunk in which the pairs of tokens cancel
// (each pair (i, j) adds q_i k_j dP_ij E_ij to dG_i and takes it from dG_j). A model of this stage's roundings
// (tests/python/test_chunk_backward_algebra.py, one chunk, dg's part from these products against fp64): with the
// diagonal blocks' operands in bf16 and the pairs j = i inside, 1.6 relative error under gates of -4.9 per token
// and 5.9e-2 under FLA's safe_gate range; in tf32 without those pairs 1.9e-3 and 2.1e-3, where the
// element-by-element sum gives 1.1e-3 and 1.3e-3 (the off-diagonal blocks' bf16 operands). A block
// takes the tensor cores where every factor's exponent is at most kDiagExpMax and every scaled element at most 1e30
// (diag_refused) and its dP, dA and beta dA at most kDiagGradMax; elsewhere, and always for fp16, its pairs are
// summed element by element in fp32 with e^(G_id - G_jd) (136 exponentials per block and key). The results go
// to shared memory scaled back from their reference rows; one thread per (diagonal block, key column) then
// finishes the block's 16 rows of that column: dq, dk, dG, and k . Yr (summed over a warp's 32 columns).
// Measured (NVIDIA H200, bf16 kda (2,16384,16,128), FLA's benchmark keywords, stage_times.py --backward, kernel
// time): 1.650 -> 1.622 ms from the element-by-element diagonal, which was about a third of the instructions
// executed (Nsight Compute) but not what bounds the stage: one CTA (184 KB of shared memory) per SM runs its
// loads, products and epilogue one after another, and moves about 263 KB a chunk and head (0.51 ms at the 4.22
// TB/s copy rate at this shape; docs/design.md section 5.2 has what was tried beyond that).
// The column side's reference row of block b: the first row after it (16 (b + 1)), the chunk's last for b = 3.
__host__ __device__ constexpr int col_ref_row(int b) { return b < 3 ? 16 * (b + 1) : kRows - 1; }
// The largest |dP|, |dA| or |beta dA| of a diagonal block that takes the tensor cores: with its scaled keys below
// 1e30 (diag_refused), 16 products stay below 1.6e37, inside fp32's range.
constexpr float kDiagGradMax = 1e6f;

// acc (this warp's 16 rows, NT n-tiles of 8 columns from n0) += A B over k < 16 on mma.sync m16n8k8 in tf32:
// A(m, k) = at(m, k), B's row k at B + k ldb (fp32). The fragment's k slots t and t + 4 take columns 2 t and
// 2 t + 1 of each k-step (any order serves when A and B agree); ldb = 4 mod 32 puts B's rows 2 t, 2 t + 1 on
// distinct banks.
template <int NT, class At>
__device__ __forceinline__ void diag_mma_tf32(float (&acc)[1][NT][4], At&& at, const float* B, int ldb, int n0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    const int k0 = 8 * ks + 2 * t, k1 = k0 + 1;
    const uint32_t a[4] = {to_tf32(at(g, k0)), to_tf32(at(g + 8, k0)), to_tf32(at(g, k1)), to_tf32(at(g + 8, k1))};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint32_t b[2] = {to_tf32(B[k0 * ldb + n0 + 8 * nt + g]), to_tf32(B[k1 * ldb + n0 + 8 * nt + g])};
      mma_tf32_m16n8k8(acc[0][nt], a, b);
    }
  }
}

template <class Op, int KP>
struct DecayKdaTcSmem {
  static constexpr int P64 = kRows + 8, PK = KP + 8;  // Op operand tiles (16-byte rows for ldmatrix)
  static constexpr int PG = KP + 4, PA = kRows + 4;   // fp32 G, Y and dG; fp32 staging of dP and dA
  static constexpr int PD = 17;                       // fp32 diagonal blocks of dP, dA: [4][16][17]
  static constexpr int PT = KP + 4;                    // fp32 operands of the diagonal blocks (tf32 fragments)
  // Row offsets in the operand region: Kr of row block a at 8 a (a - 1) (a = 1, 2, 3: 16, 32, 48 rows);
  // Qs, Ks of column block b at 48 b - 8 b (b - 1) (b = 0, 1, 2: 48, 32, 16 rows).
  static constexpr int kOperandRows = 96;
  __host__ __device__ static constexpr int kr_row0(int a) { return 8 * a * (a - 1); }
  __host__ __device__ static constexpr int qs_row0(int b) { return 48 * b - 8 * b * (b - 1); }
  size_t q = 0, k = 0, G = 0, beta = 0, kpart = 0, dPd = 0, dAd = 0, diag = 0, Mp = 0, Ma = 0, Mb = 0, dP = 0, dA = 0,
         Kr = 0, Qs = 0, Ks = 0, DKr = 0, DQs = 0, DKs = 0, Yq = 0, Yr = 0, Yc = 0, total = 0;
  __host__ __device__ constexpr DecayKdaTcSmem() {
    Carve c;
    q = c.take(sizeof(Op) * kRows * PK);
    k = c.take(sizeof(Op) * kRows * PK);
    G = c.take(sizeof(float) * kRows * PG);
    beta = c.take(sizeof(float) * kRows);
    kpart = c.take(sizeof(float) * kRows * (KP / 32));  // k . Yr per row and 32 key columns
    dPd = c.take(sizeof(float) * 4 * 16 * PD);
    dAd = c.take(sizeof(float) * 4 * 16 * PD);
    diag = c.take(sizeof(int) * 4);  // per diagonal block: 1 where it is summed element by element
    Carve s1 = c;  // the products: their 16-bit operands (the fp32 dP and dA arrive over Kr, Qs, Ks)
    Mp = s1.take(sizeof(Op) * kRows * P64);
    Ma = s1.take(sizeof(Op) * kRows * P64);
    Mb = s1.take(sizeof(Op) * kRows * P64);
    Carve s0 = s1;
    dP = s0.take(sizeof(float) * kRows * PA);
    dA = s0.take(sizeof(float) * kRows * PA);
    Kr = s1.take(sizeof(Op) * kOperandRows * PK);
    Qs = s1.take(sizeof(Op) * kOperandRows * PK);
    Ks = s1.take(sizeof(Op) * kOperandRows * PK);
    Carve s3 = c;  // then the diagonal blocks' fp32 operands
    DKr = s3.take(sizeof(float) * kRows * PT);
    DQs = s3.take(sizeof(float) * kRows * PT);
    DKs = s3.take(sizeof(float) * kRows * PT);
    Carve s2 = c;  // then their results (dG of the chunk later over Yq, element by element)
    Yq = s2.take(sizeof(float) * kRows * PG);
    Yr = s2.take(sizeof(float) * kRows * PG);
    Yc = s2.take(sizeof(float) * kRows * PG);
    const size_t m01 = s0.off > s1.off ? s0.off : s1.off, m23 = s2.off > s3.off ? s2.off : s3.off;
    total = m01 > m23 ? m01 : m23;
  }
};

// Piece e of the off-diagonal blocks' 16-bit operands (operand row o = e / kPieces, keys d0 .. d0 + 7 with
// d0 = 8 (e % kPieces); blocks wholly past len skipped): Kr of row blocks 1..3 (o = 8 a (a - 1) + j: k_j e^(G_r -
// G_j), j < r = 16 a) and Qs, Ks of column blocks 0..2 (o = 48 b - 8 b (b - 1) + (i - s): q_i and k_i e^(G_i -
// G_s), i >= s = 16 (b + 1)). load_q(i, d0, x) and load_k(i, d0, x) read eight keys of a row of q and k; G is fp32
// with row pitch PG. bwd_decay_kda_tc_kernel and the chunk-local kernel's B4 (bwd_local_kda_wgmma.cuh) build them.
template <class Op, int kPieces, class LoadQ, class LoadK>
__device__ __forceinline__ void decay_operand_piece(int e, Op* Kr, Op* Qs, Op* Ks, int PK, const float* G, int PG,
                                                    int len, LoadQ&& load_q, LoadK&& load_k) {
  using L = DecayKdaTcSmem<Op, 8 * kPieces>;
  const int o = e / kPieces, d0 = 8 * (e % kPieces);
  {  // Kr
    const int blk = o < 16 ? 1 : (o < 48 ? 2 : 3), j = o - L::kr_row0(blk), r = 16 * blk;
    if (r < len) {
      float x[8], gj[8], gr[8];
      load_k(j, d0, x);
      load8f(G + j * PG + d0, gj);
      load8f(G + r * PG + d0, gr);
#pragma unroll
      for (int h = 0; h < 8; ++h) x[h] *= exp_t<Op>(gr[h] - gj[h]);
      store8(Kr + o * PK + d0, x);
    }
  }
  {  // Qs, Ks
    const int blk = o < 48 ? 0 : (o < 80 ? 1 : 2), s = 16 * (blk + 1), i = s + o - L::qs_row0(blk);
    if (s < len) {
      float xq[8], xk[8], gi[8], gs[8];
      load_q(i, d0, xq);
      load_k(i, d0, xk);
      load8f(G + i * PG + d0, gi);
      load8f(G + s * PG + d0, gs);
#pragma unroll
      for (int h = 0; h < 8; ++h) {
        const float E = exp_t<Op>(gi[h] - gs[h]);
        xq[h] *= E;
        xk[h] *= E;
      }
      store8(Qs + o * PK + d0, xq);
      store8(Ks + o * PK + d0, xk);
    }
  }
}

template <class Op, int KP>
__global__ void __launch_bounds__(kThreads, 1) bwd_decay_kda_tc_kernel(const Args a) {
  static_assert(kIs16Bit<Op>, "the tensor-core kda decay stage takes 16-bit inputs");
  constexpr DecayKdaTcSmem<Op, KP> L{};
  constexpr int P64 = L.P64, PK = L.PK, PG = L.PG, PA = L.PA, PD = L.PD, PT = L.PT;
  constexpr int NT = KP / 16;  // n-tiles of 8 in a warp's half of the key columns
  extern __shared__ __align__(16) unsigned char smem[];
  Op* qs = reinterpret_cast<Op*>(smem + L.q);
  Op* ks = reinterpret_cast<Op*>(smem + L.k);
  float* Gs = reinterpret_cast<float*>(smem + L.G);
  float* betas = reinterpret_cast<float*>(smem + L.beta);
  float* kpart = reinterpret_cast<float*>(smem + L.kpart);
  float* dPd = reinterpret_cast<float*>(smem + L.dPd);
  float* dAd = reinterpret_cast<float*>(smem + L.dAd);
  int* diag_refused_by = reinterpret_cast<int*>(smem + L.diag);
  Op* Mp = reinterpret_cast<Op*>(smem + L.Mp);
  Op* Ma = reinterpret_cast<Op*>(smem + L.Ma);
  Op* Mb = reinterpret_cast<Op*>(smem + L.Mb);
  float* dPs = reinterpret_cast<float*>(smem + L.dP);
  float* dAs = reinterpret_cast<float*>(smem + L.dA);
  Op* Kr = reinterpret_cast<Op*>(smem + L.Kr);
  Op* Qs = reinterpret_cast<Op*>(smem + L.Qs);
  Op* Ks = reinterpret_cast<Op*>(smem + L.Ks);
  float* Yqs = reinterpret_cast<float*>(smem + L.Yq);
  float* Yrs = reinterpret_cast<float*>(smem + L.Yr);
  float* Ycs = reinterpret_cast<float*>(smem + L.Yc);
  float* dGs = Yqs;  // each element read (as Yq) and then written (as dG) by the same thread

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t c = blockIdx.x, hv = blockIdx.y, hk = hv / a.group;
  const ChunkEntry ch = a.chunks[c];
  const int len = static_cast<int>(ch.len);
  const int K = static_cast<int>(a.K);

  // dP, dA (fp32, masked by B2 and B3), q, k (zero past len and K), G (rows past len repeat the last one, so
  // every exponent below stays finite): one cp.async group.
  load_decay_inputs<Op, KP>(dPs, dAs, PA, qs, ks, PK, a, ch, c, hv, hk);
  load_key_gate(Gs, PG, a.G, ch.row0, a.HV, hv, a.K, KP, len);
  cp_async_commit();
  if (tid < kRows) betas[tid] = tid < len ? ld<Op>(a.beta, off(a.beta, ch.batch, ch.t0 + tid, hv)) : 0.f;
  // fp16's range is too narrow for the diagonal blocks' growing factors: element by element, always.
  if (tid < 4) diag_refused_by[tid] = std::is_same_v<Op, __half> || 16 * tid >= len;
  cp_async_wait<0>();
  __syncthreads();
  // The 16-bit operands dP, dA, diag(beta) dA, and the diagonal blocks of dP and dA in fp32: four elements per
  // thread (float4 rows of the staging; a quad never straddles a 16-column block). A diagonal block with an
  // element of dP, dA or beta dA above kDiagGradMax is summed element by element (see the diagonal operands).
  for (int e = tid; e < kRows * kRows / 4; e += kThreads) {
    const int i = e / (kRows / 4), j0 = 4 * (e % (kRows / 4));
    const float4 p4 = *reinterpret_cast<const float4*>(dPs + i * PA + j0);
    const float4 a4 = *reinterpret_cast<const float4*>(dAs + i * PA + j0);
    const float dp[4] = {p4.x, p4.y, p4.z, p4.w}, da[4] = {a4.x, a4.y, a4.z, a4.w}, b = betas[i];
#pragma unroll
    for (int h = 0; h < 4; h += 2) {
      store_pair(Mp + i * P64 + j0 + h, dp[h], dp[h + 1]);
      store_pair(Ma + i * P64 + j0 + h, da[h], da[h + 1]);
      store_pair(Mb + i * P64 + j0 + h, b * da[h], b * da[h + 1]);
    }
    if ((i >> 4) == (j0 >> 4)) {
      float* pd = dPd + (i >> 4) * 16 * PD + (i & 15) * PD + (j0 & 15);
      float* ad = dAd + (i >> 4) * 16 * PD + (i & 15) * PD + (j0 & 15);
      bool big = false;
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        pd[h] = dp[h], ad[h] = da[h];
        big |= !(fabsf(dp[h]) <= kDiagGradMax) | !(fabsf(da[h]) <= kDiagGradMax) | !(fabsf(b * da[h]) <= kDiagGradMax);
      }
      if (big) diag_refused_by[i >> 4] = 1;  // every writer stores the same value
    }
  }
  __syncthreads();  // the staging of dP and dA is free for the operands
  // Kr of row blocks 1..3 and Qs, Ks of column blocks 0..2 (operand row o; blocks wholly past len skipped), eight
  // keys per thread (16-byte rows): element by element this loop held a fifth of the stage's warp samples
  // (Nsight Compute, H100, kda (2,16384,16,128)).
  constexpr int kPieces = KP / 8;
  for (int e = tid; e < L.kOperandRows * kPieces; e += kThreads)
    decay_operand_piece<Op, kPieces>(
        e, Kr, Qs, Ks, PK, Gs, PG, len, [&](int i, int d0, float(&x)[8]) { load8(qs + i * PK + d0, x); },
        [&](int i, int d0, float(&x)[8]) { load8(ks + i * PK + d0, x); });
  __syncthreads();

  {
    const int blk = warp & 3, m0 = 16 * blk, half = warp >> 2, n0 = half * (KP / 2);
    const int sref = m0 + 16;  // the column side's reference row (the row side's is m0)
    float accq[1][NT][4], accr[1][NT][4], accc[1][NT][4];
    zero_acc(accq);
    zero_acc(accr);
    zero_acc(accc);
    if (blk >= 1 && m0 < len) {  // rows of block blk against columns j < 16 blk
      const Op* Kra = Kr + L.kr_row0(blk) * PK;
      warp_mma<Op, 1, NT, Lay::rowmajor, Lay::rowmajor>(accq, Mp, P64, m0, Kra, PK, n0, 0, m0);
      warp_mma<Op, 1, NT, Lay::rowmajor, Lay::rowmajor>(accr, Ma, P64, m0, Kra, PK, n0, 0, m0);
    }
    if (blk <= 2 && sref < len) {  // columns of block blk against rows i >= sref (A: column-major views)
      const int base = L.qs_row0(blk);
      warp_mma<Op, 1, NT, Lay::colmajor, Lay::rowmajor>(accc, Mp + sref * P64, P64, m0, Qs + base * PK, PK, n0,
                                                         0, kRows - sref);
      warp_mma<Op, 1, NT, Lay::colmajor, Lay::rowmajor>(accc, Mb + sref * P64, P64, m0, Ks + base * PK, PK, n0,
                                                         0, kRows - sref);
    }
    // The diagonal blocks on the tensor cores in tf32, through the same reference rows as the off-diagonal blocks
    // so that their products land in the same accumulators: row block a's keys DKr_j = k_j e^(G_r - G_j) for its
    // own rows j >= r (r = 16 a; exponents >= 0), column block b's rows DQs_i = q_i e^(G_i - G_s) and DKs_i = k_i
    // e^(G_i - G_s) for its own rows i < s (s = col_ref_row(b); exponents >= 0), in fp32 over the 16-bit operands
    // once every warp has read them. The pairs j = i (decay 1) stay out of the products and join in fp32 below.
    __syncthreads();
    float* DKr = reinterpret_cast<float*>(smem + L.DKr);
    float* DQs = reinterpret_cast<float*>(smem + L.DQs);
    float* DKs = reinterpret_cast<float*>(smem + L.DKs);
    if constexpr (!std::is_same_v<Op, __half>) {
      for (int e = tid; e < kRows * kPieces; e += kThreads) {
        const int o = e / kPieces, d0 = 8 * (e % kPieces), ob = o >> 4, r = 16 * ob, s = col_ref_row(ob);
        if (r >= len) continue;
        float xq[8], xk[8], kr[8], go[8], gr[8], gs[8];
        load8(qs + o * PK + d0, xq);
        load8(ks + o * PK + d0, xk);
        load8f(Gs + o * PG + d0, go);
        load8f(Gs + r * PG + d0, gr);
        load8f(Gs + s * PG + d0, gs);
        bool refused = false;
#pragma unroll
        for (int h = 0; h < 8; ++h) {
          const float exr = gr[h] - go[h], exs = go[h] - gs[h], Es = exp_t<Op>(exs);
          kr[h] = xk[h] * exp_t<Op>(exr);
          xq[h] *= Es;
          xk[h] *= Es;
          refused |= diag_refused(exr, kr[h], false) | diag_refused(exs, xq[h], false) |
                     diag_refused(exs, xk[h], false);
        }
        store8(DKr + o * PT + d0, kr);
        store8(DQs + o * PT + d0, xq);
        store8(DKs + o * PT + d0, xk);
        if (refused) diag_refused_by[ob] = 1;
      }
    }
    __syncthreads();
    const bool diag_tc = diag_refused_by[blk] == 0;  // warp-uniform
    if (diag_tc) {
      const float* dPb = dPd + blk * 16 * PD;
      const float* dAb = dAd + blk * 16 * PD;
      const float* bb = betas + m0;
      const int o = m0 * PT;
      diag_mma_tf32<NT>(accq, [&](int i, int j) { return i == j ? 0.f : dPb[i * PD + j]; }, DKr + o, PT, n0);
      diag_mma_tf32<NT>(accr, [&](int i, int j) { return dAb[i * PD + j]; }, DKr + o, PT, n0);
      diag_mma_tf32<NT>(accc, [&](int j, int i) { return i == j ? 0.f : dPb[i * PD + j]; }, DQs + o, PT, n0);
      diag_mma_tf32<NT>(accc, [&](int j, int i) { return bb[i] * dAb[i * PD + j]; }, DKs + o, PT, n0);
    }
    const bool row_side = diag_tc || (blk >= 1 && m0 < len), col_side = diag_tc || (blk <= 2 && sref < len);
    const int cref = col_ref_row(blk);
    __syncthreads();  // the operands are read: Yq, Yr, Yc take their bytes
    // Scaled back from the reference rows: e^(G_r - G_m0) on the row side, e^(G_sref - G_r) on the column side.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int r = m0 + acc_row(0, 2 * h2), d = n0 + acc_col(nt, 0);
        const float2 Gr = *reinterpret_cast<const float2*>(Gs + r * PG + d);
        const float2 G0 = *reinterpret_cast<const float2*>(Gs + m0 * PG + d);
        const float2 Gc = *reinterpret_cast<const float2*>(Gs + cref * PG + d);
        // Sides with no product keep their zeros (an exponential there need not be finite).
        const float er0 = row_side ? exp_t<Op>(Gr.x - G0.x) : 0.f, er1 = row_side ? exp_t<Op>(Gr.y - G0.y) : 0.f;
        const float ec0 = col_side ? exp_t<Op>(Gc.x - Gr.x) : 0.f, ec1 = col_side ? exp_t<Op>(Gc.y - Gr.y) : 0.f;
        const float* q2 = accq[0][nt] + 2 * h2;
        const float* r2 = accr[0][nt] + 2 * h2;
        const float* c2 = accc[0][nt] + 2 * h2;
        *reinterpret_cast<float2*>(Yqs + r * PG + d) = make_float2(q2[0] * er0, q2[1] * er1);
        *reinterpret_cast<float2*>(Yrs + r * PG + d) = make_float2(r2[0] * er0, r2[1] * er1);
        *reinterpret_cast<float2*>(Ycs + r * PG + d) = make_float2(c2[0] * ec0, c2[1] * ec1);
      }
  }
  __syncthreads();

  // The diagonal blocks and the outputs: one thread per (block, key column), 4 KP tasks (a warp: one block, 32
  // consecutive columns). With one value head per key head dq and dk are final here (no stage B5).
  const bool final_out = a.group == 1;
  for (int task = tid; task < 4 * KP; task += kThreads) {
    const int blk = task / KP, d = task % KP, m0 = 16 * blk;
    if (m0 >= len) continue;  // warp-uniform: the block is past the chunk
    const bool col = d < K;
    float qv[16], kv[16], gv[16], yq[16], yr[16], yc[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      qv[i] = to_f(qs[(m0 + i) * PK + d]);
      kv[i] = to_f(ks[(m0 + i) * PK + d]);
      gv[i] = Gs[(m0 + i) * PG + d];
      yq[i] = yr[i] = yc[i] = 0.f;
    }
    // B2's and B3's parts of dq, dk and dG for the block's 16 rows, read before the sums so that their latency
    // passes under them: read in the epilogue, each waited for the previous row's stores (the compiler cannot
    // tell the addresses apart), 48 memory latencies per task.
    float wq[16], wk[16], wg[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      wq[i] = wk[i] = wg[i] = 0.f;
      if (m0 + i < len && col) {
        const int64_t o = ws_row(ch, m0 + i, a.HV, hv, a.K) + d;
        wq[i] = a.dqw[o];
        wk[i] = a.dkw[o];
        wg[i] = a.dGw[o];
      }
    }
    const float* dPb = dPd + blk * 16 * PD;
    const float* dAb = dAd + blk * 16 * PD;
    if (diag_refused_by[blk]) {  // warp-uniform: the block did not go through the tensor cores, every pair here
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float bi = betas[m0 + i];
#pragma unroll
        for (int j = 0; j <= i; ++j) {
          const float E = exp_t<Op>(gv[i] - gv[j]);
          const float p = dPb[i * PD + j], da = dAb[i * PD + j];  // the same for the whole warp
          yq[i] = fmaf(p * kv[j], E, yq[i]);
          yr[i] = fmaf(da * kv[j], E, yr[i]);
          yc[j] = fmaf(p * qv[i] + bi * da * kv[i], E, yc[j]);
        }
      }
    } else {  // the tensor cores took the pairs j < i; the pairs j = i (decay 1) here, in fp32
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float p = dPb[i * PD + i], da = dAb[i * PD + i];
        yq[i] = p * kv[i];
        yr[i] = da * kv[i];
        yc[i] = p * qv[i] + betas[m0 + i] * da * kv[i];
      }
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int r = m0 + i;
      const bool row = r < len;
      const float Yq = Yqs[r * PG + d] + yq[i], Yr = Yrs[r * PG + d] + yr[i], Yc = Ycs[r * PG + d] + yc[i];
      const float b = betas[r];
      float kyr = 0.f;
      if (row && col) {
        const int64_t o = ws_row(ch, r, a.HV, hv, a.K) + d;
        const float nq = wq[i] + Yq, nk = wk[i] + (b * Yr + Yc);
        dGs[r * PG + d] = wg[i] + (qv[i] * Yq + b * kv[i] * Yr - kv[i] * Yc);
        kyr = kv[i] * Yr;
        if (final_out) {
          st<Op>(a.dq, off(a.dq, ch.batch, ch.t0 + r, hk) + d, nq);
          st<Op>(a.dk, off(a.dk, ch.batch, ch.t0 + r, hk) + d, nk);
        } else {
          a.dqw[o] = nq;
          a.dkw[o] = nk;
        }
      }
      kyr = warp_sum(kyr);  // the warp's 32 columns (0 past K and len)
      if (lane == 0) kpart[r * (KP / 32) + d / 32] = kyr;
    }
  }
  __syncthreads();
  finish_kda_chunk<Op, KP / 32>(a, ch, hv, kpart, [&](int i, int d) { return dGs[i * PG + d]; });
}

// ---- gdn / delta: one decay per (i, j), products on the tensor cores -------------------------------
template <class Op, int KP>
struct DecayScalarSmem {
  static constexpr int PA = kRows + 4;                             // fp32 dP, dA (16-byte rows)
  static constexpr int P64 = kIs16Bit<Op> ? kRows + 8 : kRows + 4;  // Op 64 x 64 operands
  static constexpr int PK = kIs16Bit<Op> ? KP + 8 : KP + 4;          // Op q, k
  size_t dP = 0, dA = 0, Mp = 0, Ma = 0, Mb = 0, q = 0, k = 0, G = 0, beta = 0, part = 0, total = 0;
  __host__ __device__ constexpr DecayScalarSmem() {
    Carve c;
    dP = c.take(sizeof(float) * kRows * PA);
    dA = c.take(sizeof(float) * kRows * PA);
    // fp32: dP o E and dA o E overwrite dP and dA in place (the same pitch; each element is read and
    // written by one thread), so that K <= 64 fits the 99 KB of sm_86 / sm_89 (88.6 KB instead of 123 KB).
    Mp = kIs16Bit<Op> ? c.take(sizeof(Op) * kRows * P64) : dP;
    Ma = kIs16Bit<Op> ? c.take(sizeof(Op) * kRows * P64) : dA;
    Mb = c.take(sizeof(Op) * kRows * P64);
    q = c.take(sizeof(Op) * kRows * PK);
    k = c.take(sizeof(Op) * kRows * PK);
    G = c.take(sizeof(float) * kRows);
    beta = c.take(sizeof(float) * kRows);
    part = c.take(sizeof(float) * 4 * kRows);  // per column half: k . Yr, then dG summed over d
    total = c.off;
  }
};

template <class Op, int KP>
__global__ void __launch_bounds__(kThreads, 2) bwd_decay_scalar_kernel(const Args a) {
  constexpr DecayScalarSmem<Op, KP> L{};
  constexpr int PA = L.PA, P64 = L.P64, PK = L.PK;
  constexpr int NTP = KP / 32;  // n-tiles of 8 in a quarter of the key columns (one pass of a warp)
  static_assert(kIs16Bit<Op> || PA == P64, "fp32: dP o E and dA o E overwrite dP and dA with the same pitch");
  extern __shared__ __align__(16) unsigned char smem[];
  float* dPs = reinterpret_cast<float*>(smem + L.dP);
  float* dAs = reinterpret_cast<float*>(smem + L.dA);
  Op* Mp = reinterpret_cast<Op*>(smem + L.Mp);
  Op* Ma = reinterpret_cast<Op*>(smem + L.Ma);
  Op* Mb = reinterpret_cast<Op*>(smem + L.Mb);
  Op* qs = reinterpret_cast<Op*>(smem + L.q);
  Op* ks = reinterpret_cast<Op*>(smem + L.k);
  float* Gs = reinterpret_cast<float*>(smem + L.G);
  float* betas = reinterpret_cast<float*>(smem + L.beta);
  float* part = reinterpret_cast<float*>(smem + L.part);  // [2][64] k . Yr, [2][64] sum_d dG

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t c = blockIdx.x, hv = blockIdx.y, hk = hv / a.group;
  const ChunkEntry ch = a.chunks[c];
  const int len = static_cast<int>(ch.len);
  const int K = static_cast<int>(a.K);

  // dP, dA (B2, B3; already masked), q, k (rows past len, columns past K zero): one cp.async group.
  load_decay_inputs<Op, KP>(dPs, dAs, PA, qs, ks, PK, a, ch, c, hv, hk);
  cp_async_commit();
  if (tid < kRows) {
    betas[tid] = tid < len ? ld<Op>(a.beta, off(a.beta, ch.batch, ch.t0 + tid, hv)) : 0.f;
    Gs[tid] = a.gated ? G_at(a, false, ch, len, hv, tid, 0) : 0.f;
    part[tid] = part[kRows + tid] = part[2 * kRows + tid] = part[3 * kRows + tid] = 0.f;
  }
  cp_async_wait<0>();
  __syncthreads();
  // dP o E, dA o E, diag(beta) dA o E as operands (dP, dA are zero outside i >= j; the exponential is only
  // evaluated inside that mask). For fp32 the first two overwrite dP and dA in place (element by element,
  // read before written by the same thread).
  for (int e = tid; e < kRows * kRows; e += kThreads) {
    const int i = e / kRows, j = e % kRows;
    const float E = (a.gated && i >= j) ? exp_t<Op>(Gs[i] - Gs[j]) : 1.f;
    const float dp = dPs[i * PA + j] * E, da = dAs[i * PA + j] * E;
    Mp[i * P64 + j] = from_f<Op>(dp);
    Ma[i * P64 + j] = from_f<Op>(da);
    Mb[i * P64 + j] = from_f<Op>(betas[i] * da);
  }
  __syncthreads();

  const int m0 = 16 * (warp & 3), half = warp >> 2;
  // dq, dk final here when there is one value head per key head (group 1): straight to the outputs (no B5).
  const bool pairs = (K % 2) == 0;  // rows of the [R, HV, K] workspaces stay 8-byte aligned
  const bool final_out = a.group == 1;
  float kyr[2] = {0.f, 0.f}, gsum[2] = {0.f, 0.f};
  // Two passes over the warp's half of the key columns, a quarter each: the three accumulators then take
  // 48 registers instead of 96, so two CTAs fit an SM (one CTA of 8 warps hid too little latency).
  for (int pass = 0; pass < 2; ++pass) {
    const int n0 = half * (KP / 2) + pass * (KP / 4);
    // B2's and B3's parts of dq and dk for this pass's elements (K even), read before the products so that
    // their latency passes under them: read in the epilogue, each waited for the previous element's stores
    // (the compiler cannot tell the addresses apart), one memory latency per element pair.
    float2 xq[NTP][2], xk[NTP][2];
#pragma unroll
    for (int nt = 0; nt < NTP; ++nt)
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int r = m0 + acc_row(0, 2 * h2), d = n0 + acc_col(nt, 0);
        xq[nt][h2] = xk[nt][h2] = make_float2(0.f, 0.f);
        if (pairs && r < len && d < K) {
          const int64_t o = ws_row(ch, r, a.HV, hv, a.K) + d;
          xq[nt][h2] = *reinterpret_cast<const float2*>(a.dqw + o);
          xk[nt][h2] = *reinterpret_cast<const float2*>(a.dkw + o);
        }
      }
    float yq[1][NTP][4], yr[1][NTP][4], yc[1][NTP][4];
    zero_acc(yq);
    zero_acc(yr);
    zero_acc(yc);
    // Yq = (dP o E) K, Yr = (dA o E) K; Yc = (dP o E)^T Q + (diag(beta) dA o E)^T K (column-major views).
    warp_mma<Op, 1, NTP, Lay::rowmajor, Lay::rowmajor>(yq, Mp, P64, m0, ks, PK, n0, 0, kRows);
    warp_mma<Op, 1, NTP, Lay::rowmajor, Lay::rowmajor>(yr, Ma, P64, m0, ks, PK, n0, 0, kRows);
    warp_mma<Op, 1, NTP, Lay::colmajor, Lay::rowmajor>(yc, Mp, P64, m0, qs, PK, n0, 0, kRows);
    warp_mma<Op, 1, NTP, Lay::colmajor, Lay::rowmajor>(yc, Mb, P64, m0, ks, PK, n0, 0, kRows);

    // One epilogue for all three (the same token row r for Yq, Yr and Yc): dq += Yq, dk += beta Yr + Yc,
    // dG += q Yq + beta k Yr - k Yc; the row's k . Yr and its dG summed over these columns.
#pragma unroll
    for (int nt = 0; nt < NTP; ++nt)
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int r = m0 + acc_row(0, 2 * h2), d = n0 + acc_col(nt, 0);
        if (r >= len || d >= K) continue;
        const int64_t o = ws_row(ch, r, a.HV, hv, a.K) + d;
        const float b = betas[r];
        float dq[2], dk[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float q = to_f(qs[r * PK + d + j]), k = to_f(ks[r * PK + d + j]);  // 0 past K
          const float Yq = yq[0][nt][2 * h2 + j], Yr = yr[0][nt][2 * h2 + j], Yc = yc[0][nt][2 * h2 + j];
          dq[j] = Yq;
          dk[j] = b * Yr + Yc;
          gsum[h2] += q * Yq + b * k * Yr - k * Yc;  // 0 past K
          kyr[h2] += k * Yr;
        }
        const bool both = d + 1 < K;
        float wq[2] = {0.f, 0.f}, wk[2] = {0.f, 0.f};  // B2's and B3's parts
        if (pairs) {
          wq[0] = xq[nt][h2].x, wq[1] = xq[nt][h2].y, wk[0] = xk[nt][h2].x, wk[1] = xk[nt][h2].y;
        } else {
          wq[0] = a.dqw[o], wk[0] = a.dkw[o];
          if (both) wq[1] = a.dqw[o + 1], wk[1] = a.dkw[o + 1];
        }
        const float nq0 = wq[0] + dq[0], nq1 = wq[1] + dq[1], nk0 = wk[0] + dk[0], nk1 = wk[1] + dk[1];
        if (final_out) {
          st2<Op>(a.dq, off(a.dq, ch.batch, ch.t0 + r, hk) + d, nq0, nq1, both);
          st2<Op>(a.dk, off(a.dk, ch.batch, ch.t0 + r, hk) + d, nk0, nk1, both);
        } else if (pairs) {
          *reinterpret_cast<float2*>(a.dqw + o) = make_float2(nq0, nq1);
          *reinterpret_cast<float2*>(a.dkw + o) = make_float2(nk0, nk1);
        } else {
          a.dqw[o] = nq0, a.dkw[o] = nk0;
          if (both) a.dqw[o + 1] = nq1, a.dkw[o + 1] = nk1;
        }
      }
  }
  // Per row: the four lanes of a row, then lane 4 g writes this half's sums (fixed order).
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    kyr[h2] += __shfl_xor_sync(0xffffffffu, kyr[h2], 1);
    kyr[h2] += __shfl_xor_sync(0xffffffffu, kyr[h2], 2);
    gsum[h2] += __shfl_xor_sync(0xffffffffu, gsum[h2], 1);
    gsum[h2] += __shfl_xor_sync(0xffffffffu, gsum[h2], 2);
    if ((lane & 3) == 0) {
      const int r = m0 + (lane >> 2) + 8 * h2;
      part[half * kRows + r] = kyr[h2];
      part[(2 + half) * kRows + r] = gsum[h2];
    }
  }
  __syncthreads();

  // dbeta = stage B3's part + k . Yr.
  if (tid < len) {
    const float s = a.dbw[(ch.row0 + tid) * a.HV + hv] + (part[tid] + part[kRows + tid]);
    st<Op>(a.dbeta, off(a.dbeta, ch.batch, ch.t0 + tid, hv), s);
  }
  if (!a.gated) return;
  // dg: reverse cumulative sum over the chunk of dG summed over d (gdn: G_i = g_1 + ... + g_i, chunk-local):
  // B2's and B3's row sums (a.dGr) plus this stage's two halves.
  if (tid < len) part[2 * kRows + tid] = a.dGr[(ch.row0 + tid) * a.HV + hv] + (part[2 * kRows + tid] +
                                                                                part[3 * kRows + tid]);
  __syncthreads();
  if (tid < len) {
    float acc = 0.f;
    for (int i = len - 1; i >= tid; --i) acc += part[2 * kRows + i];
    store_gate<Op>(a, off(a.dg, ch.batch, ch.t0 + tid, hv), acc);
  }
}

}  // namespace deltacp::cuda::tiled::bwd
