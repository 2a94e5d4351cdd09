// deltacp/params.h — the one parameter struct shared by every backend.
//
// The Eigen reference (reference/), every CUDA tier (cuda/) and the context-parallel layer
// (distributed/) take exactly this struct, the way flash-attention's kernels all take one
// Flash_fwd_params. Layouts are FLA's (docs/design.md section 6):
//
//   q, k        [B, T, H,  K]      queries and keys
//   v, o        [B, T, HV, V]      values and outputs        (HV = H, or a multiple of H: grouped values)
//   g           gdn: [B, T, HV]    log decay, natural log, <= 0 in practice (scalar per head and token)
//               kda/dplr: [B, T, HV, K]  (per key dimension; for dplr this is FLA's `gk`)
//   beta        [B, T, HV]         delta-rule step (gdn, kda, delta)
//   a, b        [B, T, HV, K]      dplr's low-rank pair: S <- diag(e^gk) S + k v^T + b (a^T S)
//   h0, ht      [N, HV, K, V]      initial / final state, contiguous, state_dtype (fp32 on GPUs)
//
// Varlen: B == 1 and cu_seqlens = [0, t1, ..., T] (int64, N + 1 entries); otherwise N == B and every
// sequence has length T. All sizes, strides and offsets are int64: T * H * K passes 2^31.
//
// Every [B, T, heads, D] tensor is described by a TensorRef: a base pointer and int64 element strides
// for the batch, time and head axes; the last axis must be contiguous (stride 1). That lets a caller
// hand in a torch view (for instance q, k, v split from one fused projection) without a copy.
#pragma once

#include <cstdint>
#include <string>

namespace deltacp {

enum class Variant : int { delta = 0, gdn = 1, kda = 2, dplr = 3 };

// Element types. States and all accumulation are fp32 or better on every backend.
enum class DType : int { f64 = 0, f32 = 1, bf16 = 2, f16 = 3 };

// Which telling of the algorithm runs. The reference implements the first three on the CPU;
// the CUDA tiers are naive (token loop), tiled (chunked, one kernel per stage), fused (Hopper).
enum class Method : int {
  recurrent = 0,  // token by token:           S <- D_t S + k_t u_t^T          (docs/design.md section 2)
  chunked = 1,    // WY form chunk by chunk:   A, T = (I + A)^-1, W, U, v_new  (section 3)
  affine = 2,     // chunk maps (M, H) folded: S' = M S + H, outputs from the chunk formula
  naive = 10,     // CUDA tier: one block per (sequence, value head), token loop
  tiled = 11,     // CUDA tier: chunked algorithm, one kernel per stage, tensor cores
  fused = 12,     // CUDA tier: Hopper, state on chip
};

const char* to_string(Variant v);
const char* to_string(DType d);
const char* to_string(Method m);
Variant variant_from_string(const std::string& s);  // throws deltacp::Error naming 'variant'
Method method_from_string(const std::string& s);    // throws deltacp::Error naming 'method'
int64_t dtype_size(DType d);

// A [B, T, heads, D] view. Strides are in elements, not bytes; the D axis is contiguous.
struct TensorRef {
  void* ptr = nullptr;
  int64_t stride_b = 0;
  int64_t stride_t = 0;
  int64_t stride_h = 0;

  bool defined() const { return ptr != nullptr; }
  // Element offset of (b, t, h, 0).
  int64_t offset(int64_t b, int64_t t, int64_t h) const { return b * stride_b + t * stride_t + h * stride_h; }
};

// Strides of a contiguous [B, T, heads, D] tensor.
inline TensorRef contiguous_ref(void* ptr, int64_t T, int64_t heads, int64_t D) {
  return TensorRef{ptr, T * heads * D, heads * D, D};
}
inline TensorRef contiguous_ref(const void* ptr, int64_t T, int64_t heads, int64_t D) {
  return contiguous_ref(const_cast<void*>(ptr), T, heads, D);
}

// FLA's l2norm epsilon (use_qk_l2norm_in_kernel): x / sqrt(sum x^2 + eps).
constexpr float kQkL2normEps = 1e-6f;

// The planes of Params::wy_stage (K = V = 128, 16-bit dtype), per variant: where each starts, in 16-bit elements per
// token row and value head (a plane of width w holds row r * HV + hv at elements r * w; every start is a multiple of 8,
// so each plane begins 16-byte aligned):
//   G   the chunk-local cumulative gate, fp32: kda [rows, 128] (256 elements a row), gdn [rows] (2, padded to 8)
//   T   fp32 [rows, 64]: row i of the chunk's (I + A)^-1, rounded to dtype in its first 64 elements
//   W   [rows, 128]: (T Beta)(K e^G) (kda), (T Beta e^G) K (gdn)
//   Kd, Qg  [rows, 128], kda only: K e^(G_n - G), Q e^G
//   P   [rows, 64]: the chunk's decayed scores, zero right of the block diagonal (kda), of the diagonal (gdn)
// kda 1,664 bytes per token and value head, gdn 656 (of which 12 padding and T's unused 128).
struct WyStagePlanes {
  int64_t G = 0, T = 0, W = 0, Kd = -1, Qg = -1, P = 0, total = 0;
  static constexpr WyStagePlanes of(Variant v) {
    return v == Variant::kda ? WyStagePlanes{0, 256, 384, 512, 640, 768, 832}
                             : WyStagePlanes{0, 8, 136, -1, -1, 264, 328};
  }
  // Where the plane starting at `start` begins in a buffer of `rows` token rows x value heads.
  static void* at(void* base, int64_t start, int64_t rows) { return static_cast<char*>(base) + 2 * start * rows; }
};

struct Params {
  Variant variant = Variant::gdn;
  DType dtype = DType::f32;        // q, k, v, g, beta, a, b, o and every gradient of them
  // g and dg in fp32 whatever dtype is (FLA keeps the log decay in fp32 beside bf16 q, k, v:
  // its cumulative sum loses too much in bf16). false: g has p.dtype like every other input.
  bool g_fp32 = false;
  DType state_dtype = DType::f32;  // h0, ht, dht, dh0

  int64_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;

  // Varlen (B == 1): N + 1 offsets. `cu_seqlens` lives where the backend computes (host for the
  // reference, device for CUDA); `cu_seqlens_host` is a host copy that GPU launchers use to size
  // grids and chunk tables. For the reference both may point at the same array.
  const int64_t* cu_seqlens = nullptr;
  const int64_t* cu_seqlens_host = nullptr;
  int64_t num_seqs = 0;  // N: B for fixed-length batches, len(cu_seqlens) - 1 for varlen

  double scale = 0.0;  // query scale; the front ends fill K^-1/2 when the user gives none
  int chunk_size = 64;
  // FLA's use_qk_l2norm_in_kernel inside the CUDA forward: the kernels use q / sqrt(|q|^2 + 1e-6) and the same
  // for k in place of q and k (the fused tier folds the row scales into its products, so q and k are read
  // once; the other tiers normalise q and k into workspace first). Forward only, CUDA only, q and k with
  // contiguous [B, T, H, K] rows; the backward takes normalised q and k (the front ends normalise with
  // autograd when a gradient is wanted).
  bool qk_l2norm = false;
  // The rows of q and k have l2 norm at most 1: the front ends l2-normalised them before the call (FLA's
  // use_qk_l2norm_in_kernel with a gradient, for the forward and its backward). A promise about the data, not an
  // operation: kda's diagonal score blocks then stay on the tensor cores over the same wider decay range as with
  // qk_l2norm (cuda/tiled/kda_scores.cuh, kDiagExpMaxUnit), so a call with a gradient takes the path of the call
  // without one. CUDA only; ignored elsewhere.
  bool qk_unit_rows = false;
  // A backward that recomputes this forward's states from its inputs follows (the CP op's, which keeps no per-chunk
  // states): the fused tier then makes o with the W, U form's roundings, as a forward that keeps its states does
  // (cuda/fused/fused_fwd.cu tbeta_refusal), so that o and the gradients equal one process's bit for bit. CUDA
  // forward only; ignored elsewhere.
  bool backward_recomputes = false;
  // safe_gate's range check (FLA's promise lower_bound <= g <= 0 on a precomputed g): [2] int32 on the device that a
  // CUDA forward fills with the smallest and the largest value of g, in cuda/common/gate_range.cuh's integer form
  // (the fused kda stage as it loads the gate, every other path in one pass first; cuda/common/gate_range.h).
  // deltacp/_library.py reads and judges them. CUDA forward only, not with the in-kernel gate (gate_A_log).
  int* gate_range = nullptr;
  // FLA's use_gate_in_kernel for kda inside the CUDA forward (gate_A_log set): g holds the raw gate x and the
  // kernels use, in its place, lower_bound sigmoid(e^(A_log[hv]) (x + dt_bias[hv, k])) when gate_lower_bound < 0,
  // or -e^(A_log[hv]) softplus(x + dt_bias[hv, k]) when it is 0 (FLA without lower_bound; softplus(y) = y past
  // 20). A_log [HV] and dt_bias [HV * K] (optional) are contiguous fp32 on the device. Forward only, CUDA only,
  // no gradient: the fused tier folds it into the gate sum of its token-parallel stage, the other tiers compute
  // the gate into workspace first (the front ends compute it with autograd when a gradient is wanted).
  const float* gate_A_log = nullptr;
  const float* gate_dt_bias = nullptr;
  float gate_lower_bound = 0.f;
  bool gate_in_kernel() const { return gate_A_log != nullptr; }

  // Forward inputs.
  TensorRef q, k, v, g, beta, a, b;
  const void* h0 = nullptr;  // optional [N, HV, K, V]
  // Forward outputs.
  //   Full forward: o is required, ht optional.
  //   Final-state-only forward: o null and ht given. Only ht is computed; no output is written
  //   (and no output buffer needs to exist). This is what the context-parallel pre-pass runs: the
  //   final state of a span whose values are augmented with K zero columns is [H | M], the affine
  //   map S_end = M S_start + H of the span (docs/design.md section 4). Every backend supports it.
  TensorRef o;
  void* ht = nullptr;  // optional [N, HV, K, V]

  // Backward: upstream gradients in, input gradients out.
  //   Full backward: dout and dq, dk, dv are required, plus the variant's dg (gdn, kda, dplr),
  //   dbeta (gdn, kda, delta), da and db (dplr); dh0 is optional.
  //   dh0-only backward: dh0 given and EVERY input gradient (dq, dk, dv, dg, dbeta, da, db) null.
  //   Only dL/dh0 is computed (dout and dht are read as usual). The CP backward pre-pass runs it:
  //   with values [v | 0], upstream [do | 0] and dht = [dend | I], dh0 is [dH | M^T].
  //   A partial set (for instance dq given and dk null) is an error naming the missing gradient.
  // The forward's per-chunk intermediates kept for the backward (CUDA, optional; both or neither), in dtype:
  //   chunk_h     [NC, HV, Kp, Vp]   the state at the start of each chunk (NC: every sequence's chunks, in order)
  //   chunk_vnew  [B, T, HV, Vp]     v_new = U - W S of each token
  // with Kp, Vp = K, V rounded up to 16. A CUDA forward on the tiled or fused tier writes them when given; the
  // tiled backward then reads them in place of its recompute's state scan (the autograd path passes the same
  // buffers to both; docs/design.md section 5 gives the bytes). The naive tier and the staged (CP) calls refuse them.
  void* chunk_h = nullptr;
  void* chunk_vnew = nullptr;
  // The forward's token-parallel (WY) stage kept for the backward (CUDA, optional, only beside chunk_h): one buffer
  // of B * T * HV * WyStagePlanes::of(variant).total elements in dtype, planes of B * T * HV rows (WyStagePlanes
  // above). A fused forward of 16-bit kda or gdn at K = V = 128 whose stage runs on Hopper's warpgroup products
  // writes it when given (cuda::last_forward_kept_wy_stage says whether it did); the tiled backward then reads G, T,
  // W (kda: K e^(G_n - G), Q e^G) and P from it in place of its recompute and runs stage B0 alone (docs/design.md
  // section 5).
  void* wy_stage = nullptr;

  TensorRef dout;             // dL/do, like o
  const void* dht = nullptr;  // dL/dht, like ht
  TensorRef dq, dk, dv, dg, dbeta, da, db;
  void* dh0 = nullptr;

  // The two state-only modes above (validate_forward / validate_backward accept exactly these).
  bool final_state_only() const { return !o.defined() && ht != nullptr; }
  bool dh0_only() const {
    return dh0 != nullptr && !dq.defined() && !dk.defined() && !dv.defined() && !dg.defined() &&
           !dbeta.defined() && !da.defined() && !db.defined();
  }

  // For the CUDA backends: the stream to launch on (cudaStream_t), nullptr = default stream.
  void* stream = nullptr;

  bool varlen() const { return cu_seqlens != nullptr; }
  // Host-side sequence bounds [bos, eos) of sequence n, in the packed time axis (varlen) or [0, T).
  int64_t seq_begin(int64_t n) const { return varlen() ? host_cu()[n] : 0; }
  int64_t seq_end(int64_t n) const { return varlen() ? host_cu()[n + 1] : T; }
  // Batch index that holds sequence n.
  int64_t seq_batch(int64_t n) const { return varlen() ? 0 : n; }
  const int64_t* host_cu() const { return cu_seqlens_host ? cu_seqlens_host : cu_seqlens; }
  int64_t head_group() const { return HV / H; }  // value heads per query/key head
  int64_t state_elems() const { return num_seqs * HV * K * V; }
  DType gate_dtype() const { return g_fp32 ? DType::f32 : dtype; }  // dtype of g and dg
};

// Fills num_seqs and the derived defaults; call after setting sizes and cu_seqlens.
void finalize(Params& p);

}  // namespace deltacp
