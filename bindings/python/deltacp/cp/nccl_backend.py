"""deltacp.cp.nccl_backend — the GPU side of deltacp.cp on top of deltacp._cp_nccl.

deltacp._cp_nccl (distributed/python/cp_nccl_module.cpp) is built only with CUDA, NCCL and the
Python module; without it ``available()`` is False and CUDA tensors exchange through the torch
process group instead. What it adds:

  * a non-blocking NCCL communicator of deltacp's own, made from a unique id that rank 0 creates
    and the context's torch.distributed group (any backend) hands out, with a blocking one split from
    it for the all-gathers where that is safe (blocking_gather); every wait polls with the
    context's timeout and shuts the communicator down for good on a stall or an error
    (CPTimeoutError / RuntimeError on every healthy rank, raised before any further CUDA work);
    every later call on that context raises a RuntimeError naming the first failure (the context
    must be rebuilt). One thread at a time per context: a call while another thread is inside one
    raises a RuntimeError saying so (and changes nothing). The buffers of a failed collective are
    kept alive until the process exits so that torch never hands memory that NCCL might still write
    to another tensor;
  * the CP pre-pass kernels ([H | M] of the last local segment, [dH | M^T] of the first) and the
    merge kernel, launched on torch's current stream.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from .._stream import on_device, stream_handle
from ..errors import CPTimeoutError, InvalidArgumentError

try:
    from .. import _cp_nccl
except ImportError:  # CPU-only build, or no NCCL at build time
    _cp_nccl = None

__all__ = ["available", "create_communicator", "prepass_forward", "prepass_backward", "all_gather", "confirm",
           "merge", "start_check", "finish_check"]


def available() -> bool:
    return _cp_nccl is not None and torch.cuda.is_available()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


# Buffers of collectives that failed: never freed (see the module docstring).
_QUARANTINE = []


def _translate(exc: Exception, what: str, *buffers):
    if _cp_nccl is not None and isinstance(exc, _cp_nccl.CommBusy):  # refused before anything was enqueued
        return RuntimeError(str(exc))
    if _cp_nccl is not None and isinstance(exc, (_cp_nccl.CommTimeout, _cp_nccl.CommDead)):
        _QUARANTINE.extend(b for b in buffers if b is not None)
        if isinstance(exc, _cp_nccl.CommTimeout):
            return CPTimeoutError(str(exc))
        return RuntimeError(str(exc))
    if isinstance(exc, RuntimeError):  # an NCCL or CUDA failure: the communicator is shut down
        _QUARANTINE.extend(b for b in buffers if b is not None)
    return exc


_GATHER_MODES = ("auto", "0", "1")


def blocking_gather(entries) -> bool:
    """Whether the all-gathers get a blocking communicator of their own (distributed/include/deltacp/
    distributed/cp.h says why it is faster and when it is safe), from every rank's entry of
    create_communicator: DELTACP_CP_BLOCKING_GATHER ("auto", the default; "0"; "1"), whether NCCL_NVLS_ENABLE=0
    and NCCL_COMM_BLOCKING=0 are set, and the host. Any "0" turns it off and "1" on every rank turns it on;
    "auto" turns it on only where ring is NCCL's one all-gather algorithm, so that the warm-up at creation made
    every connection an all-gather will need: one host, NVLS switched off; and not where NCCL_COMM_BLOCKING=0
    would make the communicator non-blocking anyway. Every rank computes the same answer from the same list."""
    modes = {e["mode"] for e in entries}
    if "0" in modes:
        return False
    if modes == {"1"}:
        return True
    return (all(e["nvls_off"] and not e["comm_nonblocking"] for e in entries)
            and len({e["host"] for e in entries}) == 1)


def create_communicator(group, rank: int, world: int, device: torch.device, timeout: float):
    """Rank 0 makes the NCCL unique id; one all-gather over the group hands it out together with what
    blocking_gather decides from; every rank joins (with the timeout)."""
    raw = os.environ.get("DELTACP_CP_BLOCKING_GATHER", "").strip() or "auto"
    me = {"id": _cp_nccl.unique_id() if rank == 0 else None, "mode": raw,
          "nvls_off": os.environ.get("NCCL_NVLS_ENABLE", "").strip() == "0",
          "comm_nonblocking": os.environ.get("NCCL_COMM_BLOCKING", "").strip() == "0", "host": socket.gethostname()}
    entries = [None] * world
    dist.all_gather_object(entries, me, group=group)
    bad = [(r, e["mode"]) for r, e in enumerate(entries) if e["mode"] not in _GATHER_MODES]
    if bad:  # the same error on every rank, after the exchange
        raise InvalidArgumentError("deltacp: environment variable 'DELTACP_CP_BLOCKING_GATHER': expected auto, 0 or 1 on "
                         "every rank, got " + ", ".join(f"{m!r} on rank {r}" for r, m in bad))
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return _cp_nccl.Communicator(entries[0]["id"], rank, world, index, float(timeout), blocking_gather(entries))
    except Exception as exc:  # noqa: BLE001
        raise _translate(exc, "creating the NCCL communicator") from exc


def _views(**tensors) -> dict:
    out = {}
    for name, t in tensors.items():
        if t is None:
            continue
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise InvalidArgumentError(f"deltacp: argument '{name}': the last dimension must be contiguous")
        out[name] = (int(t.data_ptr()), int(t.stride(1)), int(t.stride(2)))
    return out


def _prepass(direction, cfg, q, k, v, g, beta, a, b, do, init):
    if cfg.state_dtype != torch.float32:
        raise InvalidArgumentError(f"deltacp: argument 'q': the CUDA CP path keeps fp32 states; got {q.dtype} inputs "
                         f"(use float32, bfloat16 or float16 on GPUs)")
    out = torch.empty((cfg.HV, cfg.K, cfg.V + cfg.K), dtype=torch.float32, device=q.device)
    if init is not None:
        init = init.to(torch.float32).contiguous()
    views = _views(q=q, k=k, v=v, g=g, beta=beta, a=a, b=b, **({"do": do} if do is not None else {}))
    scale = cfg.scale if cfg.scale is not None else cfg.K ** -0.5
    # g may be float32 beside 16-bit q, k, v (the kernels read it in its own dtype).
    g_dtype = "" if g is None else _dtype_name(g)
    with on_device(q.device):
        _cp_nccl.prepass(direction, cfg.variant, _dtype_name(q), int(q.shape[1]), cfg.H, cfg.HV, cfg.K, cfg.V,
                         cfg.chunk_size, float(scale), views, 0 if init is None else int(init.data_ptr()),
                         int(out.data_ptr()), stream_handle(q.device), g_dtype)
    if init is not None:
        init.record_stream(torch.cuda.current_stream(q.device))
    return out


def prepass_forward(cfg, q, k, v, g, beta, a, b, start):
    """[H | M] of the span [HV, K, V + K] fp32 (start: the span's initial state or None)."""
    return _prepass("forward", cfg, q, k, v, g, beta, a, b, None, start)


def prepass_backward(cfg, q, k, v, g, beta, a, b, do, dend):
    """[dH | M^T] of the span [HV, K, V + K] fp32 (dend: dL/dS at the span end or None)."""
    return _prepass("backward", cfg, q, k, v, g, beta, a, b, do, dend)


def all_gather(ctx, x: torch.Tensor, what: str, wait: bool = True) -> torch.Tensor:
    """[world, *x.shape]: every rank's x. wait=False: later work on the current stream is ordered after the
    collective on the GPU and the host returns at once; confirm() must follow (it waits, with the timeout)."""
    out = torch.empty((ctx.world,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    try:
        ctx.nccl.all_gather(int(x.data_ptr()), int(out.data_ptr()), x.numel(), _dtype_name(x), stream_handle(x.device),
                            wait)
    except Exception as exc:  # noqa: BLE001
        raise _translate(exc, what, x, out) from exc
    return out


def confirm(ctx, what: str, *buffers) -> None:
    """The last all_gather(wait=False) completed (CPTimeoutError / RuntimeError otherwise; its buffers are
    then kept for good, see the module docstring)."""
    try:
        ctx.nccl.confirm(what)
    except Exception as exc:  # noqa: BLE001
        raise _translate(exc, what, *buffers) from exc


def start_check(ctx, values) -> None:
    """The fingerprint all-reduce (MAX over ranks) of int64 values, enqueued off the caller's streams."""
    try:
        ctx.nccl.start_max_i64([int(x) for x in values])
    except Exception as exc:  # noqa: BLE001
        raise _translate(exc, "the fingerprint check") from exc


def finish_check(ctx, what: str) -> list:
    """start_check's maxima, once the all-reduce completed (with the timeout)."""
    try:
        return ctx.nccl.finish_max_i64(what)
    except Exception as exc:  # noqa: BLE001
        raise _translate(exc, what) from exc


def merge(cfg, gathered: torch.Tensor, j0: int, j1: int, forward: bool) -> torch.Tensor:
    """Fold over ranks j0 .. j1 - 1: ascending (forward, [H | M]) or descending (backward, [dH | M^T])."""
    out = torch.empty((cfg.HV, cfg.K, cfg.V), dtype=torch.float32, device=gathered.device)
    count = j1 - j0
    first, step = (j0, 1) if forward else (j1 - 1, -1)
    with on_device(gathered.device):
        _cp_nccl.merge(int(gathered.data_ptr()), cfg.HV, cfg.K, cfg.V, first, count, step, int(out.data_ptr()),
                       stream_handle(gathered.device))
    return out
