"""deltacp._l2norm — x / sqrt(sum(x^2) + eps) over the last dim in one CUDA pass each way (FLA's
``use_qk_l2norm_in_kernel`` for q and k), registered with torch.library so torch.compile traces it.

    y = l2norm_rows(x, eps)      # CUDA, bf16 / fp16 / fp32, last dim <= 256; autograd included

The kernels (cuda/common/l2norm.cu) read every element once and write it once, with fp32 math; the torch
expression they replace (cast, square, sum, rsqrt, multiply, cast back) makes about six passes with
fp32 intermediates, which at (2, 16384, 16, 128) for q and k costs more than a third of the fused
forward. ``applies(x)`` says when deltacp.fla_options.l2norm may use it.
"""

from __future__ import annotations

import torch

from . import _core
from ._stream import on_device, stream_handle

__all__ = ["applies", "l2norm_rows"]

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# Read once: a call into the extension while torch.compile traces would break a fullgraph trace.
_BUILT_WITH_CUDA = bool(_core.built_with_cuda())


def applies(x) -> bool:
    """True where the CUDA kernel takes x: a CUDA tensor of bf16 / fp16 / fp32 with a last dim of at most
    256, in a build with the CUDA tiers."""
    return (_BUILT_WITH_CUDA and isinstance(x, torch.Tensor) and x.is_cuda and x.dtype in _DTYPES
            and 1 <= x.shape[-1] <= 256)


def _rows(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): the forward kernel on x's rows (every route below launches exactly this)."""
    xc = x.contiguous()
    y = torch.empty_like(xc)
    rstd = torch.empty(xc.shape[:-1], dtype=torch.float32, device=xc.device)
    with on_device(xc.device):
        stream = stream_handle(xc.device)
        _core.cuda_l2norm_rows(xc.data_ptr(), y.data_ptr(), rstd.data_ptr(), xc.numel() // xc.shape[-1],
                               xc.shape[-1], _DTYPES[xc.dtype], eps, stream)
    return y, rstd


@torch.library.custom_op("deltacp::l2norm_rows", mutates_args=())
def _l2norm_fwd(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _rows(x, eps)


@_l2norm_fwd.register_fake
def _(x, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _rows_backward(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx: the backward kernel (every route launches exactly this)."""
    xc, dyc = x.contiguous(), dy.contiguous().to(x.dtype)
    dx = torch.empty_like(xc)
    with on_device(xc.device):
        stream = stream_handle(xc.device)
        _core.cuda_l2norm_rows_backward(xc.data_ptr(), rstd.data_ptr(), dyc.data_ptr(), dx.data_ptr(),
                                        xc.numel() // xc.shape[-1], xc.shape[-1], _DTYPES[xc.dtype], stream)
    return dx


@torch.library.custom_op("deltacp::l2norm_rows_backward", mutates_args=())
def _l2norm_bwd(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return _rows_backward(x, rstd, dy)


@_l2norm_bwd.register_fake
def _(x, rstd, dy):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, _eps = inputs
    _y, rstd = output
    ctx.save_for_backward(x, rstd)


def _backward(ctx, dy, _drstd):
    x, rstd = ctx.saved_tensors
    return _l2norm_bwd(x, rstd, dy), None


_l2norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _L2NormRows(torch.autograd.Function):
    """The registered op's autograd outside torch.compile: the same two kernels without torch.library's
    dispatch (on an H100 host, FLA's option preprocessing, two l2 norms through the registered op, took
    0.19 ms of host time per call without a gradient and 0.32 ms with one)."""

    @staticmethod
    def forward(ctx, x, eps):
        y, rstd = _rows(x, eps)
        ctx.save_for_backward(x, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, rstd = ctx.saved_tensors
        return _rows_backward(x, rstd, dy), None


def l2norm_rows(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) along the last dim (fp32 math, x's dtype), differentiable.

    Three routes to the same kernels, so the same bits: the registered op while torch.compile traces; an
    autograd Function when a gradient is wanted; the kernel alone otherwise (inference, where the l2 norm is
    on the host's path before the delta-rule kernels: the context-parallel forward, for one)."""
    if torch.compiler.is_compiling():
        return _l2norm_fwd(x, float(eps))[0]
    if torch.is_grad_enabled() and x.requires_grad:
        return _L2NormRows.apply(x, float(eps))
    return _rows(x, float(eps))[0]
