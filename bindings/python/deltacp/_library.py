"""deltacp._library — the delta-rule ops registered with torch.library, so torch.compile traces them.

    deltacp::chunk_fwd(q, k, v, g, beta, a, b, h0, cu_seqlens, cu_seqlens_cpu, variant, backend, scale,
                       chunk_size, output_final_state, needs_grad, gate_min) -> (o, ht)
    deltacp::chunk_bwd(q, k, v, g, beta, a, b, h0, cu_seqlens, cu_seqlens_cpu, do, dht, variant, backend,
                       scale, chunk_size) -> (dq, dk, dv, dg, dbeta, da, db, dh0)

Both are ``torch.library.custom_op``s with fake (meta) implementations, which give the output shapes
from the input shapes alone, and chunk_fwd's gradient is registered with ``register_autograd`` as a
call of chunk_bwd. Dynamo therefore records one node per op instead of breaking the graph at a
pybind11 call, and AOTAutograd traces the backward through chunk_bwd. Absent inputs (g for delta,
beta for dplr, h0, cu_seqlens) are None; absent outputs (ht without output_final_state, the gradients
of absent inputs) are empty tensors, because a custom op returns tensors only.

The real implementations are deltacp.ops' _config / _forward / _backward: the backend is resolved and
the C++ core called there (CPU reference or CUDA tier, on torch's current stream). ``gate_min`` is
safe_gate's promised lower bound of a precomputed log decay (deltacp.fla_options): checked here, where
a fused kernel may later take the check over. The ops are not differentiable twice (chunk_bwd has no
gradient), as the C++ backward is not.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import ops as _ops

__all__ = ["chunk_fwd", "chunk_bwd"]


def _state_dtype(q: Tensor):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("deltacp::chunk_fwd", mutates_args=())
def chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor], a: Optional[Tensor],
              b: Optional[Tensor], h0: Optional[Tensor], cu_seqlens: Optional[Tensor],
              cu_seqlens_cpu: Optional[Tensor], variant: str, backend: Optional[str], scale: Optional[float],
              chunk_size: int, output_final_state: bool, needs_grad: bool,
              gate_min: Optional[float]) -> Tuple[Tensor, Tensor]:
    cfg = _ops._config(variant, backend, q, scale, chunk_size, output_final_state, cu_seqlens, cu_seqlens_cpu,
                       needs_grad)
    if gate_min is not None:
        _ops._check_gate_range(g, gate_min, cfg.gate_name)
    return _ops._forward(cfg, q, k, v, g, beta, a, b, h0)


@chunk_fwd.register_fake
def _chunk_fwd_fake(q, k, v, g, beta, a, b, h0, cu_seqlens, cu_seqlens_cpu, variant, backend, scale, chunk_size,
                    output_final_state, needs_grad, gate_min):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = q.new_empty((B, T, HV, V))
    if output_final_state:
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        ht = q.new_empty((N, HV, K, V), dtype=_state_dtype(q))
    else:
        ht = q.new_empty((0,), dtype=_state_dtype(q))
    return o, ht


@torch.library.custom_op("deltacp::chunk_bwd", mutates_args=())
def chunk_bwd(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor], a: Optional[Tensor],
              b: Optional[Tensor], h0: Optional[Tensor], cu_seqlens: Optional[Tensor],
              cu_seqlens_cpu: Optional[Tensor], do: Tensor, dht: Optional[Tensor], variant: str,
              backend: Optional[str], scale: Optional[float],
              chunk_size: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    cfg = _ops._config(variant, backend, q, scale, chunk_size, False, cu_seqlens, cu_seqlens_cpu, True)
    return tuple(_ops._backward(cfg, q, k, v, g, beta, a, b, h0, do, dht))


@chunk_bwd.register_fake
def _chunk_bwd_fake(q, k, v, g, beta, a, b, h0, cu_seqlens, cu_seqlens_cpu, do, dht, variant, backend, scale,
                    chunk_size):
    return tuple(q.new_empty((0,)) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (q, k, v, g, beta, a, b, h0))


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, a, b, h0, cu, cu_host, variant, backend, scale, chunk_size, output_final_state, _needs_grad,
     _gate_min) = inputs
    ctx.save_for_backward(q, k, v, g, beta, a, b, h0, cu, cu_host)
    ctx.variant, ctx.backend, ctx.scale, ctx.chunk_size = variant, backend, scale, chunk_size
    ctx.output_final_state = output_final_state


def _backward(ctx, do, dht):
    q, k, v, g, beta, a, b, h0, cu, cu_host = ctx.saved_tensors
    if do is None:
        do = q.new_zeros((q.shape[0], q.shape[1], v.shape[2], v.shape[3]))
    do = _ops._last_dim_contiguous(do)  # e.g. the expanded gradient of o.sum() has stride 0
    if not ctx.output_final_state or dht is None:
        dht = None
    else:
        dht = dht.to(_state_dtype(q)).contiguous()
    grads = chunk_bwd(q, k, v, g, beta, a, b, h0, cu, cu_host, do, dht, ctx.variant, ctx.backend, ctx.scale,
                      ctx.chunk_size)
    inputs = (q, k, v, g, beta, a, b, h0)
    return (*(None if t is None else d for t, d in zip(inputs, grads)),) + (None,) * 9


chunk_fwd.register_autograd(_backward, setup_context=_setup_context)
