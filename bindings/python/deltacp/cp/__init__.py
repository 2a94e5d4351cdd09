"""deltacp.cp — context parallelism for delta-rule attention (docs/design.md section 4).

    import torch.distributed as dist, deltacp.cp as cp
    dist.init_process_group("gloo")                      # or "nccl" for CUDA tensors
    ctx = cp.build_context(cu_seqlens_global, group=None)  # B = 1 packed batch, T divisible by world
    q_local = cp.split_even(q_global, ctx)                 # this rank's tokens [begin, end)
    o_local, ht = cp.chunk_gated_delta_rule_cp(q_local, k_local, v_local, g_local, beta_local,
                                               cp_context=ctx, initial_state=h0, output_final_state=True)

The same ops are reached with ``deltacp.chunk_gated_delta_rule(..., cp_context=ctx)``. CPU tensors
run the Eigen reference and exchange over the group (gloo); CUDA tensors run the fastest CUDA tier
and exchange over deltacp's NCCL communicator (deltacp._cp_nccl) when it is built, otherwise over
the group. See context.py (the plan, ownership of states, timeouts) and ops.py (the algorithm).
"""

from .context import CPContext, CPTimeoutError, build_context, split_even
from .ops import (chunk_delta_rule_cp, chunk_dplr_cp, chunk_gated_delta_rule_cp, chunk_kda_cp, cp_apply,
                  exchange_bytes, last_stats)
from .ring_attention import (attention_reference, causal_pairs, ring_attention, zigzag_positions, zigzag_shard,
                             zigzag_unshard)
from .ring_attention import last_stats as ring_attention_stats

__all__ = ["CPContext", "CPTimeoutError", "build_context", "split_even", "chunk_gated_delta_rule_cp",
           "chunk_kda_cp", "chunk_delta_rule_cp", "chunk_dplr_cp", "cp_apply", "exchange_bytes", "last_stats",
           "ring_attention", "zigzag_shard", "zigzag_unshard", "zigzag_positions", "causal_pairs",
           "attention_reference", "ring_attention_stats"]
