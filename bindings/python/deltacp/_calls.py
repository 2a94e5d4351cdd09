"""deltacp._calls — one call of the C++ core from torch tensors: the argument check every torch op
makes of a tensor, the tensor descriptions ``_core.run`` takes, and the call on the tensors' CUDA stream.

Shared by the single-device ops (deltacp.ops) and the context-parallel ops (deltacp.cp), which both
import it; it imports neither (the package's imports run one way: tests/python/test_imports.py).
"""

from __future__ import annotations

import math
import numbers

import torch

from . import _core
from . import _workspace  # noqa: F401  (the CUDA workspaces from torch's caching allocator, at import)
from ._describe import torch_desc
from ._stream import on_device, stream_handle
from .errors import DTypeError, InvalidArgumentError

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _run(cfg, direction: str, method: str, descs: dict) -> None:
    """_core.run for cfg (variant, compute, scale, chunk_size, device: deltacp.ops._Config or
    deltacp.cp's _Cfg), on the current stream of cfg.device for CUDA tensors. cfg.qk_unit_rows (when set): q and k
    are l2-normalised rows, for the forward and the backward (Params::qk_unit_rows: kda's wider diagonal bound).
    cfg.needs_grad (the CP op's _Cfg): a backward that recomputes the forward's states follows
    (Params::backward_recomputes: the fused forward then rounds as one process's forward that keeps them)."""
    if cfg.device.type == "cuda":
        forward = direction == "forward"
        gate = getattr(cfg, "kda_gate", None) if forward else None  # (A_log, dt_bias, lower_bound): deltacp._library
        if gate is not None:
            descs["gate_A_log"] = torch_desc(gate[0], "A_log")
            if gate[1] is not None:
                descs["gate_dt_bias"] = torch_desc(gate[1], "dt_bias")
        with on_device(cfg.device):
            stream = stream_handle(cfg.device)
            _core.run(direction, cfg.variant, method, cfg.compute, descs, cfg.scale, cfg.chunk_size, None, stream,
                      False, getattr(cfg, "qk_l2norm", False) and forward, None if gate is None else gate[2],
                      getattr(cfg, "qk_unit_rows", False), bool(getattr(cfg, "needs_grad", False)) and forward)
    else:
        _core.run(direction, cfg.variant, method, cfg.compute, descs, cfg.scale, cfg.chunk_size, None, 0, False)


def capturing(device) -> bool:
    """True while torch's current stream of the CUDA ``device`` is being captured into a CUDA graph
    (torch.cuda.graph): then nothing may copy device memory to the host or synchronise, so the steps that
    would (a host copy of cu_seqlens, safe_gate's range check) raise an error naming their argument
    instead of breaking the capture."""
    if getattr(device, "type", None) != "cuda" or not torch.cuda.is_available():
        return False
    with on_device(device):
        return torch.cuda.is_current_stream_capturing()


def tensor_descs(gate_name, q, k, v, g, beta, a, b, h0=None, cu=None, cu_host=None) -> dict:
    """The descriptions _core.run takes for the inputs (the single-device and the CP ops share it)."""
    d = {"q": torch_desc(q, "q"), "k": torch_desc(k, "k"), "v": torch_desc(v, "v")}
    if g is not None:
        d["g"] = torch_desc(g, gate_name)
    if beta is not None:
        d["beta"] = torch_desc(beta, "beta")
    if a is not None:
        d["a"] = torch_desc(a, "a")
        d["b"] = torch_desc(b, "b")
    if h0 is not None:
        d["h0"] = torch_desc(h0, "initial_state")
    if cu is not None:
        d["cu_seqlens"] = torch_desc(cu, "cu_seqlens")
        if cu_host is not None and cu_host is not cu:
            d["cu_seqlens_host"] = torch_desc(cu_host, "cu_seqlens")
    return d


def _tensor(t, name, ref=None, optional=False, allow_fp32=False):
    if t is None:
        if optional:
            return None
        raise InvalidArgumentError(f"deltacp: argument '{name}': is required")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"deltacp: argument '{name}': expected a torch.Tensor, got {type(t).__name__}")
    if ref is None:
        if t.dtype not in _FLOAT_DTYPES:
            raise DTypeError(f"deltacp: argument '{name}': expected dtype float64, float32, bfloat16 or float16, "
                             f"got {t.dtype}")
        return t
    if t.device != ref.device:
        raise InvalidArgumentError(f"deltacp: argument '{name}': expected device {ref.device} (like q), got {t.device}")
    if t.dtype != ref.dtype and not (allow_fp32 and t.dtype == torch.float32):
        alt = " or torch.float32" if allow_fp32 else ""
        raise DTypeError(f"deltacp: argument '{name}': expected dtype {ref.dtype} (like q){alt}, got {t.dtype}")
    return t


def check_inputs(q, k, v, g, beta, a, b, gate_name, scale, chunk_size):
    """The checks every op makes of its inputs before anything else: each tensor's type, dtype and device
    (_tensor; the gate may stay float32 beside 16-bit q, k, v, FLA's usual setup, and its gradient comes back in
    its dtype), scale (a finite float or None) and chunk_size (an int). Returns the tensors."""
    q = _tensor(q, "q")
    k = _tensor(k, "k", q)
    v = _tensor(v, "v", q)
    g = _tensor(g, gate_name, q, optional=True, allow_fp32=True)
    beta = _tensor(beta, "beta", q, optional=True)
    a = _tensor(a, "a", q, optional=True)
    b = _tensor(b, "b", q, optional=True)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"deltacp: argument 'scale': expected a float or None, got {type(scale).__name__}")
    if scale is not None and not math.isfinite(float(scale)):
        raise InvalidArgumentError(f"deltacp: argument 'scale': expected a finite number, got {scale}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"deltacp: argument 'chunk_size': expected an int, got {type(chunk_size).__name__}")
    return q, k, v, g, beta, a, b
