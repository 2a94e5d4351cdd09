"""deltacp._kda_gate — kda's gate from the raw g (FLA's ``use_gate_in_kernel``) in one CUDA pass each way, for
calls with a gradient (deltacp.fla_options.kda_gate uses it where it applies):

    y = kda_gate_rows(g, A_log, dt_bias, lower_bound)    # CUDA, g bf16 / fp16 / fp32 [..., HV, K]; y fp32

    lower_bound set:  y = lower_bound sigmoid(e^A_log (g + dt_bias))
    lower_bound None: y = -e^A_log softplus(g + dt_bias)            (softplus(x) = x past 20, as torch's)

The kernels (cuda/common/kda_gate.cu) read g once and write y once, and the backward reads g and dy once and
writes dg, plus one float per row for A_log's gradient; dt_bias's gradient is dg summed over the rows of each
head. The torch expression they replace makes about five passes over fp32 [B, T, HV, K] each way. A call that
needs no gradient hands the gate to the delta-rule kernels instead (Params::gate_A_log). ``applies`` says when
fla_options.kda_gate may use it; under torch.compile the torch expression is traced instead.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _core
from ._stream import on_device, stream_handle

__all__ = ["applies", "kda_gate_rows"]

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_BUILT_WITH_CUDA = bool(_core.built_with_cuda())


def applies(g, A_log, dt_bias) -> bool:
    """True where the CUDA kernels take the call: CUDA tensors, g of bf16 / fp16 / fp32, the parameters in
    float32 or 16 bits (the math is fp32 either way), eager mode."""
    params = (A_log,) if dt_bias is None else (A_log, dt_bias)
    return (_BUILT_WITH_CUDA and not torch.compiler.is_compiling() and isinstance(g, torch.Tensor) and g.is_cuda
            and g.dtype in _DTYPES and g.dim() >= 2 and g.shape[-1] >= 1
            and all(isinstance(t, torch.Tensor) and t.device == g.device and t.dtype in _DTYPES for t in params))



class _KdaGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, A_log, dt_bias, lower_bound: Optional[float]):
        HV, K = g.shape[-2], g.shape[-1]
        gc = g.contiguous()
        a = A_log.detach().to(torch.float32).reshape(-1).contiguous()
        b = None if dt_bias is None else dt_bias.detach().to(torch.float32).reshape(-1).contiguous()
        lb = 0.0 if lower_bound is None else float(lower_bound)
        y = torch.empty(g.shape, dtype=torch.float32, device=g.device)
        rows = gc.numel() // K
        with on_device(g.device):
            _core.cuda_kda_gate_rows(gc.data_ptr(), _DTYPES[g.dtype], y.data_ptr(), rows, HV, K, a.data_ptr(),
                                     0 if b is None else b.data_ptr(), lb, stream_handle(g.device))
        ctx.save_for_backward(gc, a, b)
        ctx.lb, ctx.g_dtype = lb, g.dtype
        ctx.A_meta = (A_log.shape, A_log.dtype)
        ctx.b_meta = None if dt_bias is None else (dt_bias.shape, dt_bias.dtype)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        gc, a, b = ctx.saved_tensors
        HV, K = gc.shape[-2], gc.shape[-1]
        rows = gc.numel() // K
        dy = dy.to(torch.float32).contiguous()
        dx = torch.empty(gc.shape, dtype=torch.float32, device=gc.device)
        dA = torch.empty((rows,), dtype=torch.float32, device=gc.device)
        with on_device(gc.device):
            _core.cuda_kda_gate_rows_backward(gc.data_ptr(), _DTYPES[ctx.g_dtype], dy.data_ptr(), dx.data_ptr(),
                                              dA.data_ptr(), rows, HV, K, a.data_ptr(),
                                              0 if b is None else b.data_ptr(), ctx.lb, stream_handle(gc.device))
        dg = dx.to(ctx.g_dtype) if ctx.needs_input_grad[0] else None
        dA_log = None
        if ctx.needs_input_grad[1]:
            shape, dtype = ctx.A_meta
            dA_log = dA.view(-1, HV).sum(0).reshape(shape).to(dtype)
        ddt = None
        if ctx.b_meta is not None and ctx.needs_input_grad[2]:
            shape, dtype = ctx.b_meta
            ddt = dx.view(-1, HV * K).sum(0).reshape(shape).to(dtype)
        return dg, dA_log, ddt, None


def kda_gate_rows(g, A_log, dt_bias=None, lower_bound: Optional[float] = None) -> torch.Tensor:
    """The gate of g [..., HV, K] in float32, differentiable in g, A_log and dt_bias (see the module docstring)."""
    return _KdaGate.apply(g, A_log, dt_bias, lower_bound)
