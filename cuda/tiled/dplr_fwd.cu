// cuda/tiled/dplr_fwd.cu — the tiled tier's DPLR forward (and its dh0-only backward): the chunked WY form with
// separate a and b, one kernel per stage, products on the tensor cores. The kernels, their arguments and
// shared-memory layouts are in dplr_stages.cuh, which the full backward (dplr_bwd.cu) launches too.
//
// Recurrence (per token, state S [K, V]):  S_t = diag(e^gk_t) S_{t-1} + k_t v_t^T + b_t (a_t^T S_{t-1}),
// o_t = S_t^T (scale q_t). Chunk form (reference/src/chunked.cpp: chunk_wy, chunk_state_update,
// chunk_output), per chunk of n <= 64 tokens, G = within-chunk cumsum of gk, Gp_i = G_{i-1} (Gp_0 = 0):
//
//   A_ab = strict_tril(sum_d a_id b_jd e^(Gp_id - G_jd))     A_ak = the same with k for b
//   T    = (I - A_ab)^-1                                     (unit lower triangular, fp32)
//   W    = T (a e^Gp)           U = (T A_ak) V                (the WY-like representation)
//   Ut   = U + W S              (a_i^T S_{i-1} for every token of the chunk: the low-rank read-outs)
//   S'   = D_n S + (k e^(G_n - G))^T V + (b e^(G_n - G))^T Ut,   D_n = diag(e^G_n)
//   O    = scale ((q e^G) S + tril_incl(P_qk) V + tril_incl(P_qb) Ut)
//
// The decay-masked products A_ab, A_ak, P_qk, P_qb go through dplr_scores.cuh (16 x 16 sub-blocks around
// reference rows, every exponent <= 0 for gk <= 0). Every other exponential here is <= 0 too: e^Gp,
// e^G, e^(G_n - G), e^G_n. The kernels assume gk <= 0 (deltacp.dplr routes other gates to the naive tier).
//
// The state maps (context parallelism's pre-pass, docs/design.md sections 3.2 and 4). Putting Ut = U + W S
// into S' makes a chunk an affine map of its start state,
//
//   S' = M_c S + H_c,   M_c = D_n + Bd^T W   (K x K),   H_c = Kd^T V + Bd^T U   (K x V),
//   Kd = k e^(G_n - G), Bd = b e^(G_n - G)
//
// (the reference's chunk_affine; M_c equals the product of the chunk's token transitions diag(e^gk_t) +
// b_t a_t^T, span_affine_tokens), and a span of chunks is M = M_last ... M_first with the offsets folded
// alongside. This tier computes a span's [H | M] without forming any K x K chunk matrix: a final-state-only
// forward of the widened problem, values [v | 0] (K zero columns) from the state [S0 | I]. U = (T A_ak) V is
// linear in V, so the zero columns have U = 0 too, and in them the scan's chunk step is
// Y <- D_n Y + Kd^T 0 + Bd^T (0 + W Y) = M_c Y: the state's own two products (W Y, then Bd^T (W Y); 2 x 64 K^2
// multiply-adds a chunk, no more than forming M_c and composing it, 64 K^2 + K^3). From Y = I those columns
// end at M, the others at M S0 + H. The mirror, the dh0-only backward of values [v | 0], upstream [do | 0] and
// dL/dS_end = [dend | I]: in the zero columns dO = 0 and dUt = Bd dY, so dY <- D_n dY + W^T Bd dY = M_c^T dY,
// and dh0 = [M^T dend + dH | M^T]. The map columns ride exactly the state's arithmetic: fp32 registers, rounded
// to the input dtype once a chunk as a tensor-core operand. The CP pre-pass (bindings/python/deltacp/cp/local.py)
// runs a span as pieces of whole chunks, side by side as the sequences of one varlen problem, and composes the
// pieces' maps in fp32; tests/cuda/test_cuda_dplr_maps.cpp checks the maps against span_affine and
// span_affine_backward. A final-state-only run skips the output stage and the stores of h_c and Ut (only the
// output stage reads them): its workspace is G, W, Kd, Bd, U and D_n. No kernel of its own: one would skip only
// the K zero value columns' work (their U columns in stage 1; their zero V and U tiles and Kd^T V in the scan)
// and the [v | 0] copy, while the widened problem reaches this tier through deltacp::Params as it stands.
//
// What the tier refuses (check_dplr_tiled: K > 128, chunk_size > 64; check_dplr_smem: a stage's shared memory
// past this GPU's opt-in limit) it refuses before launching anything, with an Error naming the argument: a
// caller may run the naive tier instead, as a CP rank does (deltacp.cp.local._dplr_tiers).
//
// Kernels (128 threads = 4 warps each; 64-row tiles in shared memory; mma.sync m16n8k16 with fp32
// accumulation for bf16 / fp16, FFMA for fp32, through fwd_mma.cuh's warp_mma; KP = 64 for K <= 64, 128
// for K <= 128; VP = V rounded up to 32):
//
//   1 dplr_wy_kernel      grid (chunks, H)          G (cumsum), A_ab, A_ak (scores), T (fp32, by 16 x 16
//                                                   blocks: diagonal ones by substitution), W, U,
//                                                   Kd = k e^(G_n - G), Bd = b e^(G_n - G), D_n
//   2 dplr_scan_kernel    grid (N * H, VP / 32)     sequential over a sequence's chunks; the state's 32
//                                                   columns stay in fp32 registers (warp w: rows
//                                                   [w KP/4, (w+1) KP/4)); writes h_c (chunk-start state)
//                                                   and Ut; ht
//   3 dplr_output_kernel  grid (chunks, H)          P_qk, P_qb (scores), then O over 32-column blocks
//
// The dh0-only backward (Params::dh0_only: the CP backward pre-pass; also the reverse scan of the full backward,
// dplr_bwd.cu), from the reference's chunk backward: with dS = dL/dS at a chunk's end (dht at the sequence's end),
//   dUt = P_qb^T (scale dO) + Bd dS,   dS <- D_n dS + (q e^G)^T (scale dO) + W^T dUt,   dh0 = the last dS.
//   kernels 1 (W, Bd, D_n), 3 without o (storing q e^G and P_qb instead), then
//   4 dplr_dh0_scan_kernel  grid (N * H, VP / 32)   the mirror of kernel 2, from the last chunk back
// For the full backward kernel 1 also keeps T and A_ak, kernel 3 also P_qk, kernel 4 also dS at each chunk's end
// and dUt (DplrArgs' backward fields; null here, so the forward and the dh0-only backward store none of them).
//
// Intermediates (workspace, row-major; R = B * T rows of the flat token axis of chunk_table.cuh):
//   G fp32 [R, H, KP]; W, Kd, Bd p.dtype [R, H, KP]; U, Ut p.dtype [R, H, VP]; Dn fp32 [chunks, H, KP];
//   h p.dtype [chunks, H, KP, VP]; dh0-only: QG p.dtype [R, H, KP], P_qb p.dtype [chunks, H, 64, 64].
//   p.dtype for what feeds 16-bit tensor-core operands anyway (the state itself is carried in fp32 registers
//   through stage 2, as in the gdn / kda path of tiled_fwd.cu).
//
// Dynamic shared memory (bytes, from the layout structs WySmem / ScanSmem / OutSmem / Dh0Smem; each launch checks
// it against the GPU's opt-in limit and throws an Error naming K when it does not fit):
//                 bf16/fp16 K <= 64   K <= 128     fp32 K <= 64   K <= 128
//   wy            100,112             142,096      141,840        224,016
//   scan          48,384              78,336       89,344         147,968
//   output        72,704              121,856      121,856        203,776
//   dh0 scan      52,480              82,432       97,536         156,160
//   wy: a, b, k tiles 64 x (KP+pad); G 65 x (KP+4) fp32; scratch (the scores' reference-row tiles, then T in
//   fp32, then a V tile); A_ab 64 x 65 fp32; A_ak and T as 64 x (64+pad) tiles; 3 x 16 x 16 fp32 for T's
//   blocks. scan: W, Kd, Bd tiles; U, V, Ut 64 x (32+pad); S as a KP x (32+pad) operand; D_n. output: q, k, b
//   tiles; G fp32; scratch; P_qk, P_qb (the per-block h, V, Ut tiles reuse k and b). So 16-bit K <= 64 fits
//   every sm_80+ GPU (sm_86 / sm_89: 99 KB), 16-bit K <= 128 and fp32 K <= 64 need sm_80 / sm_90's 163 / 227
//   KB, fp32 K <= 128 Hopper only.
// Registers (nvcc 13 --resource-usage; sm_80 / sm_90a, 16-bit inputs): wy 80 / 72-79 (KP 64), 128 / 72 (KP
// 128); scan 122 / 91, 96 / 80; output 80 / 77, 80-86 / 74-75; dh0 scan 122 / 96, 128 / 96. Spills: none
// except 4-16 bytes in some wy kernels (fp16 KP 64 and fp32 KP 64 on sm_80; fp16 KP 128, bf16 KP 64 and fp32
// KP 128 on sm_90a).
// Speed (NVIDIA H200, bf16, bench/gpu/bench_dplr.py beside FLA's chunk_dplr_delta_rule, 2026-11-25): forward
// 3.75 ms at (4,4096,32,64), 3.91 at (2,8192,32,64), 7.17 at (1,16384,16,128): 0.44, 0.47 and 0.36x the speed of
// FLA's faster configuration (chunk 64 with safe_gate: 1.64, 1.83, 2.57 ms). With the scores' rescaling eight keys
// per thread (decayed_scores, shared with kda; NVIDIA H100, same harness, 2026-11-27): 3.15, 3.25 and 5.67 ms,
// 0.58, 0.63 and 0.49x (FLA 1.84, 2.04, 2.80). Kernel time of one forward +
// backward at (2,8192,32,64) (torch.profiler, 14.27 ms in all): this file's wy stage 4.72 ms for its two launches
// (the forward and the backward's recompute), 76 us per (chunk, head) CTA at two CTAs per SM; the output stage
// 2.23; the scan 0.75. The wy stage is the first to redo: T's blocks are products of fp32 loops (not tensor
// cores), and the scores' sub-blocks go element by element; at K = 128 it runs one 142 KB CTA per SM. The
// scan's grid is N * H * VP / 32 CTAs.
#include "dplr_stages.cuh"

namespace deltacp::cuda::tiled {
namespace {

// dh0_only: the dh0-only backward of p (Params::dh0_only), else p's forward.
template <class T, int KP>
void run_dplr(const Params& p, cudaStream_t stream, bool dh0_only) {
  check_dplr_grid(p);
  const bool with_o = !dh0_only && p.o.defined();
  check_dplr_smem<T, KP>(p, dh0_only  ? kDplrWy | kDplrOut | kDplrDh0Scan
                            : with_o ? kDplrWy | kDplrScan | kDplrOut
                                     : kDplrWy | kDplrScan);
  const ChunkTable table(p, p.chunk_size, stream);  // (after the checks: a refusal launches nothing)
  const int64_t R = p.B * p.T, H = p.H, C = table.num_chunks();
  const int VP = dplr_vp(p);
  DplrWorkspace ws(stream);
  DplrArgs<T> x = dplr_args<T>(p, table, VP);
  x.G = ws.get<float>(R * H * KP);
  x.W = ws.get<T>(R * H * KP);
  x.Kd = ws.get<T>(R * H * KP);
  x.Bd = ws.get<T>(R * H * KP);
  x.U = ws.get<T>(R * H * VP);
  x.Dn = ws.get<float>(C * H * KP);
  if (dh0_only) {
    x.QG = ws.get<T>(R * H * KP);
    x.Pb = ws.get<T>(C * H * kDRows * kDRows);
    x.dout = dev_rows<const T>(p.dout);
    x.dht = static_cast<const float*>(p.dht);
    x.dh0 = static_cast<float*>(p.dh0);
  } else {
    x.o = dev_rows<T>(p.o);
    if (with_o) {  // what the output stage reads; a final-state-only run (the CP pre-pass's maps) keeps neither
      x.Ut = ws.get<T>(R * H * VP);
      x.h = ws.get<T>(C * H * KP * VP);
    }
    x.h0 = static_cast<const float*>(p.h0);
    x.ht = static_cast<float*>(p.ht);
  }
  const dim3 per_chunk(static_cast<unsigned>(C), static_cast<unsigned>(H));
  const dim3 per_seq(static_cast<unsigned>(p.num_seqs * H), static_cast<unsigned>(VP / kDBV));

  if (C > 0) {
    dplr_launch(dplr_wy_kernel<T, KP>, WySmem<T, KP>::bytes, per_chunk, p, "WY stage", stream, x);
  }
  if (dh0_only) {
    if (C > 0) {  // the output stage without o: q e^G and P_qb for the reverse scan
      dplr_launch(dplr_output_kernel<T, KP>, OutSmem<T, KP>::bytes, per_chunk, p, "output stage", stream, x);
    }
    if (p.num_seqs > 0) {
      dplr_launch(dplr_dh0_scan_kernel<T, KP>, Dh0Smem<T, KP>::bytes, per_seq, p, "dh0 scan", stream, x);
    }
    return;
  }
  if (p.num_seqs > 0) {
    dplr_launch(dplr_scan_kernel<T, KP>, ScanSmem<T, KP>::bytes, per_seq, p, "state scan", stream, x);
  }
  if (C > 0 && with_o) {
    dplr_launch(dplr_output_kernel<T, KP>, OutSmem<T, KP>::bytes, per_chunk, p, "output stage", stream, x);
  }
}


void run_dplr_any(const Params& p, bool dh0_only) {
  check_dplr_tiled(p);
  const cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (p.K <= 64) {
      run_dplr<T, 64>(p, stream, dh0_only);
    } else {
      run_dplr<T, 128>(p, stream, dh0_only);
    }
  });
}

}  // namespace

void tiled_dplr_forward(const Params& p) { run_dplr_any(p, false); }

void tiled_dplr_dh0(const Params& p) {
  DELTACP_CHECK(p.dh0_only(), "dh0", "expected a dh0-only backward (dh0 given, every input gradient null) for the "
                "tiled DPLR dh0 scan, got input gradients (the full backward is tiled_dplr_backward, dplr_bwd.cu)");
  run_dplr_any(p, true);
}

}  // namespace deltacp::cuda::tiled

namespace deltacp::cuda {
void tiled_dplr_forward(const Params& p) { tiled::tiled_dplr_forward(p); }
void tiled_dplr_dh0(const Params& p) { tiled::tiled_dplr_dh0(p); }
}  // namespace deltacp::cuda
