"""deltacp.causal_conv1d — the depthwise causal short convolution before every GDN / KDA layer's
q, k, v, with FLA's arguments, on one device or under context parallelism.

    y, _ = deltacp.causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None, cp_context=None)

x [B, T, D], weight [D, W] (W >= 1; the last column multiplies the current token, as in FLA),
bias [D] or None, activation None or "silu" / "swish". For every channel d and token t of a sequence
that starts at token s0:

    z[t, d] = bias[d] + sum_{i=0}^{W-1} weight[d, i] x[t - (W - 1) + i, d]   (terms before s0 are 0)
    y = z, or silu(z) = z sigmoid(z)

Returns (y, None) as FLA's causal_conv1d does when no final state is asked for. cu_seqlens (B = 1,
packed sequences) keeps every sequence's window inside the sequence. FLA's residual, initial_state
and output_final_state are accepted by keyword on one device (causal_conv1d's docstring). Autograd gives dx, dweight,
dbias (an explicit backward: dz = dy silu'(z), dx[t] = sum_i weight[:, i] dz[t + (W - 1) - i]).

Under CP (cp_context from deltacp.cp.build_context(..., conv1d_kernel_size=W); x is this rank's slice
[1, T_local, D], cu_seqlens comes from the context and must not be passed) each rank first takes the
W - 1 tokens before its first token from the earlier ranks (deltacp/cp/conv1d.py), masks the ones of
other sequences, and the backward returns the gradient of those tokens to the ranks that own them.
The weight and bias gradients are this rank's share: all-reduce them over the CP group as for any
weight.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["causal_conv1d", "causal_conv1d_reference"]

_ACTIVATIONS = (None, "silu", "swish")


def _check(x, weight, bias, activation, cu_seqlens, cp_context):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"deltacp: argument 'x': expected a floating-point torch.Tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 3:
        raise ValueError(f"deltacp: argument 'x': expected [B, T, D], got shape {list(x.shape)}")
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != x.shape[2]
            or weight.shape[1] < 1):
        raise ValueError(f"deltacp: argument 'weight': expected [D, W] with D = {x.shape[2]} and W >= 1, got "
                         f"{list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if weight.dtype != x.dtype:
        raise TypeError(f"deltacp: argument 'weight': expected x's dtype {x.dtype}, got {weight.dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or list(bias.shape) != [x.shape[2]]):
        raise ValueError(f"deltacp: argument 'bias': expected [D] with D = {x.shape[2]} or None, got "
                         f"{list(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
    if bias is not None and bias.dtype != x.dtype:
        raise TypeError(f"deltacp: argument 'bias': expected x's dtype {x.dtype}, got {bias.dtype}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"deltacp: argument 'activation': expected None, 'silu' or 'swish', got {activation!r}")
    if cp_context is not None:
        if cu_seqlens is not None:
            raise ValueError("deltacp: argument 'cu_seqlens': under CP the offsets come from cp_context (pass "
                             "cu_seqlens to build_context instead)")
        W = cp_context.conv1d_kernel_size
        if W is None:
            raise ValueError("deltacp: argument 'cp_context': expected a context built with conv1d_kernel_size=W "
                             "(deltacp.cp.build_context(..., conv1d_kernel_size=W)), got one without it")
        if W != weight.shape[1]:
            raise ValueError(f"deltacp: argument 'weight': expected width W = {W} (cp_context.conv1d_kernel_size), got "
                             f"{weight.shape[1]}")
        if x.shape[0] != 1 or x.shape[1] != cp_context.local_tokens:
            raise ValueError(f"deltacp: argument 'x': expected this rank's slice [1, {cp_context.local_tokens}, D] "
                             f"under CP, got {list(x.shape)}")
    elif cu_seqlens is not None:
        cu = _offsets(cu_seqlens)
        if x.shape[0] != 1:
            raise ValueError(f"deltacp: argument 'x': expected B = 1 (a packed batch) with cu_seqlens, got B = "
                             f"{x.shape[0]}")
        if cu[0] != 0 or cu[-1] != x.shape[1] or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"deltacp: argument 'cu_seqlens': expected non-decreasing offsets from 0 to T = "
                             f"{x.shape[1]}, got {cu}")


def _offsets(cu_seqlens):
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise TypeError(f"deltacp: argument 'cu_seqlens': expected a 1-D int64 tensor, got {cu_seqlens.dtype} "
                            f"{list(cu_seqlens.shape)}")
        return [int(c) for c in cu_seqlens.tolist()]
    return [int(c) for c in cu_seqlens]


def token_offsets(cu, begin: int, n: int) -> torch.Tensor:
    """For tokens begin .. begin + n - 1 of a packed batch with offsets cu: how many tokens of the same
    sequence precede each one (int64 [n]). Window term i reaches back W - 1 - i tokens: it is
    valid where that is <= this offset."""
    cu_t = torch.tensor(cu, dtype=torch.int64)
    g = torch.arange(begin, begin + n, dtype=torch.int64)
    seq = torch.searchsorted(cu_t, g, right=True) - 1
    return g - cu_t[seq]


def _conv(ext, weight, bias, offset, W):
    """z [B, T, D] from ext = [W - 1 tokens before; T tokens] and the per-token offsets."""
    T = ext.shape[1] - (W - 1)
    z = ext[:, W - 1:] * weight[:, W - 1]
    for back in range(1, W):
        term = ext[:, W - 1 - back:W - 1 - back + T] * weight[:, W - 1 - back]
        z = z + term * (offset >= back).to(ext.dtype).view(1, T, 1)
    return z if bias is None else z + bias


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation, offset, halo):
        W = weight.shape[1]
        ext = torch.cat([halo.exchange(x), x], dim=1) if W > 1 else x
        z = _conv(ext, weight, bias, offset.to(x.device), W)
        y = z * torch.sigmoid(z) if activation else z
        ctx.save_for_backward(ext, weight, z)
        ctx.cfg = (activation, offset, halo, bias is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        ext, weight, z = ctx.saved_tensors
        activation, offset, halo, has_bias = ctx.cfg
        W = weight.shape[1]
        T = z.shape[1]
        if activation:
            s = torch.sigmoid(z)
            dz = dy * s * (1 + z * (1 - s))
        else:
            dz = dy
        dext = torch.zeros_like(ext)
        dweight = torch.empty_like(weight)
        dext[:, W - 1:] += dz * weight[:, W - 1]
        dweight[:, W - 1] = (dz * ext[:, W - 1:]).sum(dim=(0, 1))
        offset = offset.to(z.device)
        for back in range(1, W):
            dzm = dz * (offset >= back).to(dz.dtype).view(1, T, 1)
            dext[:, W - 1 - back:W - 1 - back + T] += dzm * weight[:, W - 1 - back]
            dweight[:, W - 1 - back] = (dzm * ext[:, W - 1 - back:W - 1 - back + T]).sum(dim=(0, 1))
        dx = halo.return_grad(dext) if W > 1 else dext
        dbias = dz.sum(dim=(0, 1)) if has_bias else None
        return dx, dweight, dbias, None, None, None


class _NoHalo:
    """One device: the tokens before the first are zeros (masked anyway)."""

    def __init__(self, W):
        self.W = W

    def exchange(self, x):
        return x.new_zeros(x.shape[0], self.W - 1, x.shape[2])

    def return_grad(self, dext):
        return dext[:, self.W - 1:]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  activation: Optional[str] = None, cu_seqlens=None, cp_context=None, *,
                  residual: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
                  output_final_state: bool = False):
    """Depthwise causal conv1d (see the module docstring). Returns (y, final_state or None).

    FLA's further options, by keyword, on one device: residual (like x) is added to y after the
    activation; initial_state [N, D, W] gives each of the N sequences (N = len(cu_seqlens) - 1, else B)
    the W tokens before its first one (column W - 1 the most recent); output_final_state returns each
    sequence's last W tokens in that layout (the initial state's columns where the sequence is shorter),
    so a sequence run in two parts, the second from the first's final state, equals one run."""
    _check(x, weight, bias, activation, cu_seqlens, cp_context)
    if residual is not None and (not isinstance(residual, torch.Tensor) or residual.shape != x.shape
                                 or residual.dtype != x.dtype):
        raise ValueError(f"deltacp: argument 'residual': expected a tensor like x ({list(x.shape)}, {x.dtype}), got "
                         f"{getattr(residual, 'shape', type(residual).__name__)}")
    if initial_state is not None or output_final_state:
        if cp_context is not None:
            name = "initial_state" if initial_state is not None else "output_final_state"
            raise ValueError(f"deltacp: argument '{name}': not supported under CP (as in FLA): the tokens before a "
                             f"rank's slice come from the earlier ranks")
        y, final = _with_states(x, weight, bias, activation, cu_seqlens, initial_state, output_final_state)
    else:
        W = weight.shape[1]
        if cp_context is not None:
            from .cp.conv1d import Halo

            offset = token_offsets(cp_context.cu_seqlens_global_list, cp_context.begin, x.shape[1])
            halo = Halo(cp_context, W)
        else:
            cu = _offsets(cu_seqlens) if cu_seqlens is not None else [0, x.shape[1]]
            offset = token_offsets(cu, 0, x.shape[1])
            halo = _NoHalo(W)
        y, final = _CausalConv1d.apply(x, weight, bias, activation is not None, offset, halo), None
    return (y if residual is None else y + residual), final


def _with_states(x, weight, bias, activation, cu_seqlens, initial_state, output_final_state):
    """The convolution with per-sequence states: every sequence preceded by its W state tokens (zeros
    without initial_state) in one packed batch, run by the plain path (autograd reaches the states
    through the packing); the outputs of the state tokens are dropped, and the last W tokens of each
    packed sequence are its final state."""
    B, T, D = x.shape
    W = weight.shape[1]
    if cu_seqlens is None:  # every batch row is a sequence
        cu, packed = [b * T for b in range(B + 1)], x.reshape(1, B * T, D)
    else:
        cu, packed = _offsets(cu_seqlens), x
    N = len(cu) - 1
    if initial_state is None:
        initial_state = x.new_zeros(N, D, W)
    elif (not isinstance(initial_state, torch.Tensor) or list(initial_state.shape) != [N, D, W]
          or initial_state.dtype != x.dtype):
        raise ValueError(f"deltacp: argument 'initial_state': expected [N, D, W] = [{N}, {D}, {W}] in {x.dtype} (one "
                         f"state per sequence), got {getattr(initial_state, 'shape', type(initial_state).__name__)}")
    pieces, ext_cu, keep = [], [0], []
    for n in range(N):
        pieces += [initial_state[n].transpose(0, 1).unsqueeze(0), packed[:, cu[n]:cu[n + 1]]]
        keep += range(ext_cu[-1] + W, ext_cu[-1] + W + cu[n + 1] - cu[n])
        ext_cu.append(ext_cu[-1] + W + cu[n + 1] - cu[n])
    ext = torch.cat(pieces, dim=1)
    y_ext, _ = causal_conv1d(ext, weight, bias, activation, cu_seqlens=ext_cu)
    y = y_ext[:, torch.tensor(keep, dtype=torch.int64, device=x.device)].reshape(B, T, D)
    final = None
    if output_final_state:
        final = torch.stack([ext[0, e - W:e].transpose(0, 1) for e in ext_cu[1:]])
    return y, final


def causal_conv1d_reference(x, weight, bias=None, activation=None, cu_seqlens=None, residual=None,
                            initial_state=None, output_final_state=False):
    """The definition, token by token in fp64 (for the tests): y [B, T, D] float64, and with
    output_final_state the final states [N, D, W]. Without cu_seqlens every batch row is a sequence."""
    x, w = x.double(), weight.double()
    B, T, D = x.shape
    W = w.shape[1]
    if cu_seqlens is not None:
        segments = [(0, s0, s1) for s0, s1 in zip(_offsets(cu_seqlens), _offsets(cu_seqlens)[1:])]
    else:
        segments = [(b, 0, T) for b in range(B)]
    h0 = None if initial_state is None else initial_state.double()
    y = torch.zeros(B, T, D, dtype=torch.float64)
    finals = []

    def token(b, n, s0, src):  # x at `src` of sequence n, or the state column before its start
        if src >= s0:
            return x[b, src]
        return h0[n, :, W + src - s0] if h0 is not None else torch.zeros(D, dtype=torch.float64)

    for n, (b, s0, s1) in enumerate(segments):
        for t in range(s0, s1):
            acc = torch.zeros(D, dtype=torch.float64) if bias is None else bias.double().clone()
            for i in range(W):
                acc = acc + w[:, i] * token(b, n, s0, t - (W - 1) + i)
            y[b, t] = acc
        finals.append(torch.stack([token(b, n, s0, s1 - W + j) for j in range(W)], dim=1))
    y = y * torch.sigmoid(y) if activation else y
    if residual is not None:
        y = y + residual.double()
    return (y, torch.stack(finals)) if output_final_state else y
