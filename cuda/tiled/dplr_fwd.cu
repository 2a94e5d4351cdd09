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
// reference rows, every exponent <= 0 for gk <= 0, except the one factor of a bf16 diagonal block on the tensor
// cores, which is taken only where it stays below e^64). Every other exponential here is <= 0 too: e^Gp,
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
//   1 dplr_wy_kernel      grid (chunks, H)          G (cumsum: each thread loads 16 gates of its column at a
//                                                   time into registers and sums them there), Kd, Bd, D_n;
//                                                   A_ab, A_ak (scores; bf16's diagonal blocks on the tensor
//                                                   cores too where their decay allows, dplr_scores.cuh);
//                                                   T = (I - A_ab)^-1 (wy_solve.cuh: diagonal blocks by
//                                                   substitution, the blocks below by sub-diagonal level, their
//                                                   products on mma.sync in tf32 for 16-bit inputs, FFMA for
//                                                   fp32); W, T A_ak, U on the tensor cores, each row block over
//                                                   T's nonzero columns only
//   2 dplr_scan_kernel    grid (N * H, VP / BV)     sequential over a sequence's chunks; the state's BV
//                                                   columns stay in fp32 registers; 8 warps at K = 128
//                                                   (each a 16-row tile of the state), 4 at K <= 64
//                                                   (dplr_stages.cuh ScanWarps, dplr_scan_warps); writes h_c
//                                                   (chunk-start state) and Ut; ht. Two stages of the
//                                                   per-chunk tiles (W, Kd, Bd, U, V, D_n) where they fit
//                                                   the configuration's budget (all but fp32 K > 64): the
//                                                   next chunk's copies are in flight during this chunk's
//                                                   products. BV = 32, or 16 where the
//                                                   32-column grid would fill at most half the GPU's resident
//                                                   CTA slots (dplr_scan_narrow: a few long sequences, e.g.
//                                                   (1,16384,16,128): 64 CTAs of 32 columns on a 132-SM GPU,
//                                                   now 128 of 16); the state's column blocks are independent
//                                                   given W, Kd, Bd, D_n, so a narrower block only repeats the
//                                                   per-chunk W, Kd, Bd copies (through L2) and halves the
//                                                   products on each CTA's chain of chunks
//   3 dplr_output_kernel  grid (chunks, H)          G by cp.async; P_qk, P_qb (scores; only the blocks above the
//                                                   block diagonal zeroed first), then O over 64-column blocks
//                                                   (32 for fp32 K > 64, where three 64-column tiles do not
//                                                   fit over k, b and the scratch; P's row blocks over their
//                                                   nonzero columns only). At V = 64 the h, V and Ut tiles
//                                                   come in one round of copies: (4,4096,32,64) on an H100,
//                                                   0.41 -> 0.37 ms a launch against two 32-column rounds
//
// The dh0-only backward (Params::dh0_only: the CP backward pre-pass; also the reverse scan of the full backward,
// dplr_bwd.cu), from the reference's chunk backward: with dS = dL/dS at a chunk's end (dht at the sequence's end),
//   dUt = P_qb^T (scale dO) + Bd dS,   dS <- D_n dS + (q e^G)^T (scale dO) + W^T dUt,   dh0 = the last dS.
//   kernels 1 (W, Bd, D_n), 3 without o (storing q e^G and P_qb instead), then
//   4 dplr_dh0_scan_kernel  grid (N * H, VP / BV)   the mirror of kernel 2, from the last chunk back (two stages
//                                                   where they fit: 16-bit inputs; BV as for kernel 2)
// For the full backward kernel 1 also keeps T and A_ak, kernel 3 also P_qk, kernel 4 also dS at each chunk's end
// and dUt (DplrArgs' backward fields; null here, so the forward and the dh0-only backward store none of them).
//
// Intermediates (workspace, row-major; R = B * T rows of the flat token axis of chunk_table.cuh):
//   G fp32 [R, H, KP]; W, Kd, Bd p.dtype [R, H, KP]; U, Ut p.dtype [R, H, VP]; Dn fp32 [chunks, H, KP];
//   h p.dtype [chunks, H, KP, VP]; dh0-only: QG p.dtype [R, H, KP], P_qb p.dtype [chunks, H, 64, 64].
//   p.dtype for what feeds 16-bit tensor-core operands anyway (the state itself is carried in fp32 registers
//   through stage 2, as in the gdn / kda path of tiled_fwd.cu).
//
// Why the stages look as they do. The first version's wy stage took 76 us per (chunk, head) CTA: each thread
// loaded its 33 gates one dependent global load after another (the loop stored each into shared memory before the
// next load), T's 16 x 16 block products were fp32 loops over shared memory, each score's four diagonal blocks
// took 512 exponentials a lane (K = 64) element by element, and its 100 KB held two CTAs per SM. The output stage
// loaded G the same way (32 dependent loads a thread), and the scans waited on every chunk's copies. Now: the
// gates in batches of 16 independent loads, T on wy_solve.cuh's tf32 solve (the kda tier's), bf16's diagonal
// score blocks on the tensor cores, and layouts in which what dies early hands its space on: the wy stage copies
// the k tile over b once A_ab is made (Bd out first; the copy in flight during the inverse) and keeps T and A_ak
// as operands over the fp32 A, so that 16-bit inputs take 72 KB at K <= 64 (three CTAs per H100 / H200 SM, two
// before) and 109 KB at K <= 128 (two, one before); the output stage at K = 128 shares one tile between k and b
// (two CTAs per SM, one before); G comes by cp.async in the output stage, and the scans keep the next chunk's
// copies in flight.
//
// Dynamic shared memory (bytes, from the layout structs WySmem / ScanSmem / OutSmem / Dh0Smem; each launch checks
// it against the GPU's opt-in limit and throws an Error naming K when it does not fit):
//                 bf16/fp16 K <= 64   K <= 128     fp32 K <= 64   K <= 128
//   wy            71,952              109,328      108,816        170,512
//   scan          86,528              141,312      160,256        147,968 (one stage)
//   output        75,008              108,800      121,856        169,984
//   dh0 scan      94,720              149,504      97,536 (one)   156,160 (one stage)
//   16 columns (narrow grids): scan 74,240 / 126,976 / 135,680 / 127,488 (one stage); dh0 scan 86,528 / 139,264 /
//   160,256 / 139,776 (one stage) (taken only where the GPU's opt-in limit allows it)
//   (the first version: wy 100,112 / 142,096 / 141,840 / 224,016; scan 48,384 / 78,336 / 89,344 / 147,968;
//   output 72,704 / 121,856 / 121,856 / 203,776; dh0 scan 52,480 / 82,432 / 97,536 / 156,160.)
//   wy: see WySmem. scan: per stage W, Kd, Bd tiles, U, V 64 x (BV+pad), D_n; then Ut and S as a KP x (BV+pad)
//   operand. output: see OutSmem (q, k, b tiles, k and b one tile at K = 128; scratch; G; P_qk, P_qb; the
//   per-block h, V, Ut tiles over k, b and the scratch). dh0 scan: per stage W, Bd, q e^G, P_qb, dO, D_n; then
//   dUt and dS. A scan
//   takes its second stage only within its configuration's budget (dplr_smem_budget): 16-bit K <= 64 fits every
//   sm_80+ GPU (sm_86 / sm_89: 99 KB), 16-bit K <= 128 and fp32 K <= 64 need sm_80 / sm_90's 163 / 227 KB, fp32
//   K <= 128 Hopper only. The scans' grids are small (N * H * VP / 32 CTAs), so their larger stages cost
//   occupancy only where N * H * VP / 32 passes about two CTAs per SM.
// Registers (nvcc 13 -Xptxas -v; sm_80 / sm_90a; bf16, fp16, fp32): wy 92 / 77, 72 / 77, 80 / 78 (KP 64), 80 / 72,
// 80 / 75, 80 / 79 (KP 128); scan 128 / 126 (16-bit KP 64), 127 / 116 (16-bit KP 128), 128 / 123-128 (fp32);
// output 75-80 / 64-72; dh0 scan 128 / 128. The 16-column scans (no spills): scan 96 / 69 (16-bit KP 64),
// 95 / 115 (16-bit KP 128), 96-159 / 96-125 (fp32); dh0 scan 128 / 119 (16-bit KP 64), 124 / 80 (16-bit KP
// 128), 96-128 / 96-128 (fp32). Spills: wy bf16 KP 128 sm_90a 12 bytes stored / 36 loaded; output
// 16-bit KP 128 sm_90a 40-48 bytes (ptxas holds it to 64 registers there); dh0 scan fp32 KP 128 sm_90a 4 bytes;
// none elsewhere. (The first version: wy 72-80 / 63-79, scan 94-127 / 80-123, output 80 / 66-72, dh0 scan
// 122-128 / 80-96, with 4-8 byte spills in some wy and output kernels.)
// Speed (NVIDIA H100, bf16, bench/gpu/bench_dplr.py beside FLA 0.5.2's chunk_dplr_delta_rule, 2026-11-28): forward
// 1.20 ms at (4,4096,32,64), 1.29 at (2,8192,32,64), 1.60 at (1,16384,16,128): 1.53, 1.56 and 1.76x the speed of
// FLA's faster configuration (chunk 64 with safe_gate: 1.83, 2.01, 2.82 ms); at (1,16384,16,128) 1.82 ms with the
// scans on 4 warps, at (4,4096,32,64) 1.23 ms with the output stage's 32-column value blocks. The first version
// took 3.15, 3.25 and 5.67 ms on the same GPU; with 32-column scans only, 1.38, 1.40 and 2.23 ms. Kernel time of
// one forward + backward (bench/gpu/stage_times.py --variant dplr --backward; each of these stages runs in the
// forward and again in the backward's recompute): (2,8192,32,64) the wy stage 1.13 ms (the first version 4.72 on
// an H200), the output stage 0.76 (32-column blocks), the scan 0.64; (4,4096,32,64) the output stage 0.74 (0.82
// with 32-column blocks); (1,16384,16,128) the scan 1.46 ms on 4 warps (128 CTAs of 16 columns, 1.85 ms
// as 64 of 32: one long sequence leaves the grid narrow either way; on 8 warps, with the backward's scans side by
// side, 1.14 ms against 1.65 in one run), the wy stage 1.24, the output stage 0.90.
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

  if (C > 0) {
    dplr_launch(dplr_wy_kernel<T, KP>, WySmem<T, KP>::bytes, per_chunk, p, "WY stage", stream, x);
  }
  if (dh0_only) {
    if (C > 0) {  // the output stage without o: q e^G and P_qb for the reverse scan
      dplr_launch(dplr_output_kernel<T, KP>, OutSmem<T, KP>::bytes, per_chunk, p, "output stage", stream, x);
    }
    if (p.num_seqs > 0) {
      dplr_launch_dh0_scan<T, KP>(p, VP, "dh0 scan", stream, x);
    }
    return;
  }
  if (p.num_seqs > 0) {
    dplr_launch_scan<T, KP>(p, VP, stream, x);
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
