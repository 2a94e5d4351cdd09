// cuda/attention/ring_step.h — one step of ring attention on the GPU: this rank's queries against
// one K/V block, the causal mask from global token positions, the result merged into fp32
// accumulators (deltacp.cp.ring_attention calls it once per ring step; the formulas are those of
// reference/include/deltacp/reference/attention.h).
//
//   forward:  (o_acc, lse_acc) <- merge((o_acc, lse_acc), softmax attention of q over this block)
//   backward: with the FINAL lse and delta = rowdot(dO, O) of every query row,
//             dq_acc += this block's share of dQ;  dk_acc, dv_acc += the block's dK, dV
//
// Layouts: q [B, Tq, H, D], k and v [B, Tk, HKV, D], dout [B, Tq, H, D] in the input dtype (bf16,
// fp16 or fp32) with any strides over B, T and heads (the last dimension contiguous); H a multiple of
// HKV (grouped K/V: query head h reads key/value head h / (H / HKV)); head dim D = 64 or 128.
// qpos [Tq], kpos [Tk] int64 global positions (key j visible to query i iff kpos[j] <= qpos[i] when
// causal). Accumulators fp32, contiguous: o_acc, dq_acc [B, H, Tq, D]; lse_acc, lse, delta [B, H, Tq]
// (lse_acc = -inf and o_acc = 0 before the first step); dk_acc, dv_acc [B, HKV, Tk, D].
//
// The kernels are plain CUDA cores in fp32 (a warp per row, K/V or Q/dO tiles in shared memory); a
// causally masked tile is skipped. They are the correct, simple version of the step: no tensor cores.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "deltacp/params.h"

namespace deltacp::cuda::attention {

struct RingStepArgs {
  DType dtype = DType::bf16;
  int64_t B = 0, Tq = 0, Tk = 0, H = 0, HKV = 0, D = 0;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* dout = nullptr;                   // backward only
  int64_t q_s[3] = {0, 0, 0};                   // element strides of q over (B, T, H)
  int64_t k_s[3] = {0, 0, 0};
  int64_t v_s[3] = {0, 0, 0};
  int64_t do_s[3] = {0, 0, 0};
  const int64_t* qpos = nullptr;
  const int64_t* kpos = nullptr;
  bool causal = true;
  float scale = 1.f;
  float* o_acc = nullptr;                       // forward
  float* lse_acc = nullptr;                     // forward
  const float* lse = nullptr;                   // backward: final lse
  const float* delta = nullptr;                 // backward: rowdot(dO, O)
  float* dq_acc = nullptr;                      // backward
  float* dk_acc = nullptr;                      // backward
  float* dv_acc = nullptr;                      // backward
};

// Throw deltacp::Error naming the argument on bad sizes (head dim, heads, dtype, null pointers).
void ring_step_forward(const RingStepArgs& a, cudaStream_t stream);
void ring_step_backward(const RingStepArgs& a, cudaStream_t stream);

}  // namespace deltacp::cuda::attention
