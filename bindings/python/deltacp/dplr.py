"""deltacp.dplr — FLA's DPLR entry points: ``chunk_dplr_delta_rule`` and ``chunk_rwkv7``.

    o, ht = deltacp.chunk_dplr_delta_rule(q, k, v, a, b, gk, scale=None, initial_state=None,
                                          output_final_state=False, cu_seqlens=None, cu_seqlens_cpu=None,
                                          safe_gate=False, chunk_size=None, disable_recompute=False,
                                          cp_context=None, lower_bound=None, *, backend=None,
                                          state_v_first=False)
    o, ht = deltacp.chunk_rwkv7(r, w, k, v, a, b, scale=1.0, ...)         # the same, q = r, gk = w

The recurrence (FLA's, and deltacp's reference): per token, with D_t = diag(exp(gk_t)),

    S_t = D_t S_{t-1} + k_t v_t^T + b_t (a_t^T S_{t-1}),      o_t = S_t^T (scale q_t)

q, k, a, b, gk [B, T, H, K]; v [B, T, H, V]; states [N, H, K, V] (``state_v_first=True``: [N, H, V, K],
RWKV-7's native layout, for both ``initial_state`` and the returned final state). ``gk`` is the natural
log of the decay, <= 0. ``chunk_rwkv7``'s ``w`` is the same thing: FLA's RWKV-7 layer passes
``w = -exp(-0.5) * sigmoid(...)`` and chunk_rwkv7 hands it to the DPLR op as ``gk`` unchanged, so
``chunk_rwkv7(r, w, k, v, a, b)`` == ``chunk_dplr_delta_rule(r, k, v, a, b, gk=w, scale=1.0)``.

The argument order is FLA's, so calls written for FLA run unchanged. FLA arguments that steer only
FLA's kernels are accepted and checked but change nothing here: ``safe_gate`` (FLA: may assume
-5 <= gk < 0 for its M = 16 tensor-core path) and ``disable_recompute``. ``chunk_size=None`` means 64
here (FLA's default is 16; deltacp's chunk form is exact for any chunk size, 16, 32 and 64 are accepted).

The chunk form and the gate range
---------------------------------
The chunked methods (the CPU reference's chunked WY form, the CUDA tiled tier) evaluate decays between
two tokens of one chunk as exp(G_i - G_j), G the cumulative sum of gk inside the chunk. Two things
limit that:

* gk > 0 (growth): the exponents become positive and the chunk form's guarantee that every exponential
  is <= 1 is gone (the tiled tier's 16x16 sub-block factors then exceed 1 and overflow fp16 at 11).
* very negative gk: G_i - G_j is the difference of two fp32 sums whose magnitude reaches
  chunk_size * |min gk|; its absolute error, hence the relative error of every decay factor, grows
  like chunk_size * |min gk| * 2^-24 (about 6e-5 at 1024) in the float32 computations (the float64
  reference is unaffected in any practical range).

So the chunk form is used only where every gate lies in ``[GK_MIN, 0]`` with ``GK_MIN = -1024 /
chunk_size`` (-16 at chunk 64, -64 at chunk 16: a decay of e^-16 = 1.1e-7 per token already wipes the
state within one token at fp32 precision). Inputs outside that range fall back to the token recurrence,
which multiplies one exp(gk_t) per token and has no such limit: the ``recurrent`` reference on the CPU,
the ``naive`` tier on CUDA. The range check costs one min/max reduction of gk (and, on CUDA, one
synchronisation). ``lower_bound`` (FLA's: the caller asserts ``lower_bound <= gk < 0``) skips the check
when ``GK_MIN <= lower_bound < 0``; ``gate_check=False`` skips it unconditionally (the caller's
guarantee). ``backend="recurrent"`` / ``"naive"`` never needs it.

Backends: None (CPU: the chunked reference; CUDA: the naive tier), "reference", "recurrent", "naive",
"tiled" (the tiled DPLR forward and backward: chunked, on the tensor cores; cuda/tiled/dplr_fwd.cu and
dplr_bwd.cu). The tiled DPLR tier is opt-in: it is not the CUDA default until it has been validated on a GPU.
With "tiled", gates outside the range above run forward and backward on the naive tier.

With ``cp_context`` (context parallelism, deltacp.cp) the same choice is made on each rank for its own
tokens: with "tiled", the local pass (forward from the merged initial state, backward from the merged
dL/dS) and the pre-pass's state maps run on the tiled DPLR tier where the rank's gates lie in the range
and the tier takes the inputs (K <= 128, chunk_size <= 64, its stages' shared memory on the GPU), else on
the naive tier (and the fp32 loop kernels of deltacp._cp_nccl for the maps). ``deltacp.cp.last_stats
["local_tier"]`` says which tier a rank ran and why.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch

from . import _core
from . import ops as _ops
from ._calls import _FLOAT_DTYPES
from ._dplr_gates import DEFAULT_CHUNK as _DEFAULT_CHUNK
from ._dplr_gates import GK_SPAN, gate_range
from ._dplr_gates import gates_in_range as _gates_in_range
from .errors import DTypeError, InvalidArgumentError

__all__ = ["chunk_dplr_delta_rule", "chunk_rwkv7", "gate_range", "GK_SPAN"]


def _chunk_size(chunk_size) -> int:
    if chunk_size is None:
        return _DEFAULT_CHUNK
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"deltacp: argument 'chunk_size': expected an int or None, got {type(chunk_size).__name__}")
    if int(chunk_size) not in (16, 32, 64):
        raise InvalidArgumentError(f"deltacp: argument 'chunk_size': expected None, 16, 32 or 64, got {chunk_size}")
    return int(chunk_size)


def _flag(x, name) -> bool:
    if not isinstance(x, (bool, int)) or (isinstance(x, int) and x not in (0, 1)):
        raise TypeError(f"deltacp: argument '{name}': expected a bool, got {type(x).__name__}")
    return bool(x)


def _state_to_kv(initial_state, state_v_first):
    if initial_state is None or not state_v_first:
        return initial_state
    if not isinstance(initial_state, torch.Tensor):
        raise TypeError(f"deltacp: argument 'initial_state': expected a torch.Tensor, got "
                        f"{type(initial_state).__name__}")
    if initial_state.dim() != 4:
        raise InvalidArgumentError(f"deltacp: argument 'initial_state': expected 4 dims [N, H, V, K] "
                                   f"(state_v_first), got shape {list(initial_state.shape)}")
    return initial_state.transpose(-1, -2)  # [N, H, K, V] view; ops casts / makes it contiguous


def _run_tiled(q, k, v, a, b, gk, scale, h0, output_final_state, cu_seqlens, cu_seqlens_cpu, chunk_size):
    """The opt-in tiled DPLR forward and backward.

    ops._apply picks tiers through cuda_supports(), which does not list dplr for the tiled tier until the
    kernels have been validated on a GPU; the same checks as ops._apply run here, then the same autograd
    Function, whose backward names the tiled tier (the C++ dispatch runs the tiled DPLR backward by name,
    cuda/dispatch.cu opt_in)."""
    q = _ops._tensor(q, "q")
    k = _ops._tensor(k, "k", q)
    v = _ops._tensor(v, "v", q)
    gk = _ops._tensor(gk, "gk", q, allow_fp32=True)
    a = _ops._tensor(a, "a", q)
    b = _ops._tensor(b, "b", q)
    if q.device.type != "cuda":
        raise InvalidArgumentError(f"deltacp: argument 'backend': 'tiled' is a CUDA tier and needs CUDA tensors, got "
                                   f"tensors on {q.device}")
    if not _core.built_with_cuda():
        raise InvalidArgumentError("deltacp: argument 'backend': this deltacp was built without the CUDA tiers")
    if q.dim() != 4 or v.dim() != 4:
        raise InvalidArgumentError(f"deltacp: argument 'q': expected 4 dims [B, T, H, K] for q and v, got shapes "
                                   f"{list(q.shape)} and {list(v.shape)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"deltacp: argument 'scale': expected a float or None, got {type(scale).__name__}")
    cfg = _ops._Config()
    cfg.variant = "dplr"
    cfg.gate_name = "gk"
    cfg.device = q.device
    cfg.state_dtype = torch.float32
    cfg.compute = "float32"
    cfg.scale = None if scale is None else float(scale)
    if cfg.scale is not None and not math.isfinite(cfg.scale):
        raise InvalidArgumentError(f"deltacp: argument 'scale': expected a finite number, got {scale}")
    cfg.chunk_size = chunk_size
    cfg.output_final_state = bool(output_final_state)
    cfg.cu, cfg.cu_host = _ops._offsets(cu_seqlens, cu_seqlens_cpu, q.device)
    if h0 is not None:
        if not isinstance(h0, torch.Tensor):
            raise TypeError(f"deltacp: argument 'initial_state': expected a torch.Tensor, got {type(h0).__name__}")
        if h0.device != q.device:
            raise InvalidArgumentError(f"deltacp: argument 'initial_state': expected device {q.device} (like q), got "
                                       f"{h0.device}")
        h0 = h0.to(torch.float32).contiguous()
    cfg.fwd_method = "tiled"
    cfg.bwd_method = "tiled"
    o, ht = _ops._DeltaRuleFunction.apply(cfg, q, k, v, gk, None, a, b, h0)
    return o, (ht if cfg.output_final_state else None)


def _run_cp(q, k, v, a, b, gk, scale, h0, output_final_state, cu_seqlens, cu_seqlens_cpu, backend, chunk_size,
            cp_context, gate_check):
    """The CP op (deltacp.cp) with the backend as given, the same on every rank (the ranks check that they agree).
    Each rank then picks its own tier (deltacp.cp.local._dplr_tiers): the chunked method the backend names (the
    chunked reference on CPUs, the tiled tier with backend="tiled" on GPUs) where this rank's gates lie in
    gate_range (checked unless gate_check is False) and the tier takes its inputs, else the token recurrence.
    Mixed tiers across ranks are exact: the ranks exchange only fp32 state maps."""
    if cu_seqlens_cpu is not None:
        raise InvalidArgumentError("deltacp: argument 'cu_seqlens_cpu': expected None with cp_context (the CP context "
                                   "carries the rank-local offsets and their host copy), got a tensor")
    if isinstance(h0, torch.Tensor) and h0.dtype not in _FLOAT_DTYPES:
        raise DTypeError(f"deltacp: argument 'initial_state': expected a floating dtype, got {h0.dtype}")
    from .cp.ops import cp_apply

    return cp_apply("dplr", q, k, v, gk, None, a, b, cp_context=cp_context, scale=scale, initial_state=h0,
                    output_final_state=output_final_state, chunk_size=chunk_size, backend=backend, gate_name="gk",
                    cu_seqlens=cu_seqlens, gate_check=gate_check)


def chunk_dplr_delta_rule(q, k, v, a, b, gk, scale: Optional[float] = None, initial_state=None,
                          output_final_state: bool = False, cu_seqlens=None, cu_seqlens_cpu=None,
                          safe_gate: bool = False, chunk_size: Optional[int] = None, disable_recompute: bool = False,
                          cp_context=None, lower_bound: Optional[float] = None, *, backend: Optional[str] = None,
                          state_v_first: bool = False,
                          gate_check: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """DPLR delta rule with FLA's arguments: S <- diag(exp(gk)) S + k v^T + b (a^T S), o = S^T (scale q).

    q, k, a, b, gk [B, T, H, K]; v [B, T, H, V]; initial_state [N, H, K, V] ([N, H, V, K] with
    state_v_first). Returns (o [B, T, H, V], final_state or None). See the module doc for the gate range
    of the chunked methods and the fallback to the token recurrence outside it."""
    _flag(safe_gate, "safe_gate")
    _flag(disable_recompute, "disable_recompute")
    state_v_first = _flag(state_v_first, "state_v_first")
    gate_check = _flag(gate_check, "gate_check")
    cs = _chunk_size(chunk_size)
    if backend is not None and backend not in _ops.BACKENDS:
        raise InvalidArgumentError(f"deltacp: argument 'backend': expected None or one of {_ops.BACKENDS}, "
                                   f"got {backend!r}")
    if backend == "fused":
        raise InvalidArgumentError("deltacp: argument 'backend': the fused tier does not implement dplr; use None, "
                                   "'naive' or 'tiled' on CUDA")
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real) or \
                not math.isfinite(lower_bound):
            raise TypeError(f"deltacp: argument 'lower_bound': expected a finite float or None, got {lower_bound!r}")
        if lower_bound >= 0:
            raise InvalidArgumentError(f"deltacp: argument 'lower_bound': expected a negative bound (gk is a log "
                                       f"decay, lower_bound <= gk < 0), got {lower_bound}")
    if cp_context is not None and state_v_first:
        raise InvalidArgumentError("deltacp: argument 'state_v_first': expected False with cp_context (the CP op takes "
                                   "states in the [K, V] layout)")
    h0 = _state_to_kv(initial_state, state_v_first)

    if not isinstance(gk, torch.Tensor):
        raise TypeError(f"deltacp: argument 'gk': expected a torch.Tensor, got {type(gk).__name__}")
    device = gk.device
    if backend is None:
        backend = "naive" if device.type == "cuda" else "reference"

    trusted = not gate_check or (lower_bound is not None and lower_bound >= gate_range(cs)[0])
    if cp_context is not None:
        return _run_cp(q, k, v, a, b, gk, scale, h0, output_final_state, cu_seqlens, cu_seqlens_cpu, backend, cs,
                       cp_context, gate_check=not trusted)

    chunked = backend in ("reference", "tiled")
    if chunked and not trusted and not _gates_in_range(gk, cs):
        backend = "naive" if device.type == "cuda" else "recurrent"  # the documented fallback
        chunked = False

    if backend == "tiled":
        o, ht = _run_tiled(q, k, v, a, b, gk, scale, h0, output_final_state, cu_seqlens, cu_seqlens_cpu, cs)
    else:
        o, ht = _ops.chunk_dplr(q, k, v, a, b, gk, scale, h0, output_final_state, cu_seqlens, backend,
                                chunk_size=cs, cu_seqlens_cpu=cu_seqlens_cpu)
    if ht is not None and state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    return o, ht


def chunk_rwkv7(r, w, k, v, a, b, scale: float = 1.0, initial_state=None, output_final_state: bool = False,
                cu_seqlens=None, cu_seqlens_cpu=None, safe_gate: bool = False, chunk_size: Optional[int] = None,
                disable_recompute: bool = False, cp_context=None, lower_bound: Optional[float] = None, *,
                backend: Optional[str] = None, state_v_first: bool = False,
                gate_check: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """RWKV-7 with FLA's arguments: r (receptance) is q, w the log decay gk (<= 0, FLA's convention: its
    RWKV-7 layer passes w = -exp(-0.5) sigmoid(.)), a and b the low-rank pair (FLA's layer: a = -kk,
    b = kk * a). scale defaults to 1.0 as in FLA. Same as chunk_dplr_delta_rule(r, k, v, a, b, w, ...)."""
    return chunk_dplr_delta_rule(r, k, v, a, b, w, scale, initial_state, output_final_state, cu_seqlens,
                                 cu_seqlens_cpu, safe_gate, chunk_size, disable_recompute, cp_context, lower_bound,
                                 backend=backend, state_v_first=state_v_first, gate_check=gate_check)
