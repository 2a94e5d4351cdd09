"""deltacp._library — the delta-rule ops registered with torch.library, so torch.compile traces them.

    deltacp::chunk_fwd(q, k, v, g, beta, a, b, h0, cu_seqlens, cu_seqlens_cpu, variant, fwd_method,
                       bwd_method, scale, chunk_size, output_final_state, gate_min, ...,
                       keep_states) -> (o, ht, chunk_h, chunk_vnew)
    deltacp::chunk_bwd(q, k, v, g, beta, a, b, h0, cu_seqlens, cu_seqlens_cpu, do, dht, variant, method,
                       scale, chunk_size, qk_unit_rows, chunk_h, chunk_vnew) -> (dq, dk, dv, dg, dbeta, da, db, dh0)

Both are ``torch.library.custom_op``s with fake (meta) implementations, which give the output shapes
from the input shapes alone, and chunk_fwd's gradient is registered with ``register_autograd`` as a
call of chunk_bwd. Dynamo therefore records one node per op instead of breaking the graph at a
pybind11 call, and AOTAutograd traces the backward through chunk_bwd. Absent inputs (g for delta,
beta for dplr, h0, cu_seqlens) are None; absent outputs (ht without output_final_state, the gradients
of absent inputs, the per-chunk states where none are kept) are empty tensors, because a custom op returns
tensors only. chunk_h and chunk_vnew are what the forward keeps for the backward (_kept_states), outputs of
chunk_fwd that its registered backward hands to chunk_bwd.

``fwd_method`` / ``bwd_method`` are what _core.run runs ("chunked", "recurrent", "naive", "tiled",
"fused"), chosen by deltacp.ops._resolve_backend before the call. ``gate_min`` is safe_gate's promised
lower bound of a precomputed log decay (deltacp.fla_options), checked here, inside the op, where a
fused kernel may later take the check over. The ops are not differentiable twice (chunk_bwd has no
gradient), as the C++ backward is not.

This module also holds the run of one call (_Config, _forward, _backward) that the ops' real
implementations and the eager _DeltaRuleFunction share, and ``chunk``, the call deltacp.ops makes: the
registered op while torch.compile traces, the same run without the op's dispatch in eager mode. It imports
nothing of deltacp.ops.
"""

from __future__ import annotations

import os
import struct
import threading
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _core
from ._calls import _run, capturing, tensor_descs
from ._describe import torch_desc
from .errors import InvalidArgumentError

__all__ = ["chunk", "chunk_fwd", "chunk_bwd"]

_GATE_NAME = {"gdn": "g", "kda": "g", "delta": "g", "dplr": "gk"}


class _Config:
    """Everything about one call that is not a differentiable tensor."""

    __slots__ = ("variant", "fwd_method", "bwd_method", "compute", "scale", "chunk_size", "output_final_state",
                 "cu", "cu_host", "device", "gate_name", "state_dtype", "qk_l2norm", "gate_check", "kda_gate",
                 "qk_unit_rows", "gate_range")


def _state_dtype(q: Tensor):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _config(variant, fwd_method, bwd_method, q, scale, chunk_size, output_final_state, cu, cu_host) -> _Config:
    cfg = _Config()
    cfg.variant = variant
    cfg.gate_name = _GATE_NAME[variant]
    cfg.device = q.device
    cfg.state_dtype = _state_dtype(q)
    cfg.compute = "float64" if q.dtype == torch.float64 else "float32"
    cfg.scale = scale
    cfg.chunk_size = chunk_size
    cfg.output_final_state = output_final_state
    cfg.cu = cu
    # The host copy of the offsets the CUDA tiers plan with (deltacp.ops makes it once per call; a
    # direct caller of the op without one pays a device-to-host copy here, which a CUDA graph capture
    # cannot record).
    if cu is not None and q.device.type == "cuda" and cu_host is None and capturing(q.device):
        raise InvalidArgumentError(
            "deltacp: argument 'cu_seqlens_cpu': is required for a varlen call inside a CUDA graph capture "
            "(copying cu_seqlens to the host synchronises, which the capture cannot record)")
    cfg.cu_host = cu if (cu is None or q.device.type == "cpu") else (
        cu_host if cu_host is not None else cu.to("cpu"))
    cfg.fwd_method, cfg.bwd_method = fwd_method, bwd_method
    cfg.qk_l2norm = False
    cfg.gate_check = None  # safe_gate's range check, when the backward is the one to confirm it (chunk)
    cfg.kda_gate = None  # (A_log, dt_bias, lower_bound): kda's gate computed in the CUDA forward (chunk)
    cfg.qk_unit_rows = False  # q and k normalised by the caller (chunk: deltacp.ops with a gradient)
    cfg.gate_range = None  # safe_gate's range slots that the CUDA forward fills (_checked; Params::gate_range)
    return cfg


def _input_descs(cfg: _Config, q, k, v, g, beta, a, b, h0) -> dict:
    return tensor_descs(cfg.gate_name, q, k, v, g, beta, a, b, h0, cfg.cu, cfg.cu_host)


def _num_seqs(cfg: _Config, q) -> int:
    return q.shape[0] if cfg.cu is None else cfg.cu.shape[0] - 1


def _last_dim_contiguous(t):
    return t if t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _forward(cfg: _Config, q, k, v, g, beta, a, b, h0, kept=None):
    """-> (o [B, T, HV, V], ht [N, HV, K, V] or an empty tensor without output_final_state). kept: (chunk_h,
    chunk_vnew) from _kept_states, which the forward fills for the backward."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    descs = _input_descs(cfg, q, k, v, g, beta, a, b, h0)
    o = torch.empty((B, T, HV, V), dtype=q.dtype, device=q.device)
    descs["o"] = torch_desc(o, "o")
    if cfg.gate_range is not None:
        descs["gate_range"] = torch_desc(cfg.gate_range, "gate_range")
    if cfg.output_final_state:
        ht = torch.empty((_num_seqs(cfg, q), HV, K, V), dtype=cfg.state_dtype, device=q.device)
        descs["ht"] = torch_desc(ht, "ht")
    else:
        ht = torch.empty((0,), dtype=cfg.state_dtype, device=q.device)
    _describe_kept(descs, kept)
    _run(cfg, "forward", cfg.fwd_method, descs)
    return o, ht


# The forward's per-chunk states kept for the backward (Params::chunk_h, chunk_vnew in deltacp/params.h):
# h [chunks, HV, K, V] and v_new [B, T, HV, V] in q's dtype, which the backward's recompute would otherwise rebuild
# with a state scan over every chunk (a serial chain: at (2, 16384, 16, 128) bf16 on an H200, 0.50 ms of a 6.3 ms
# kda step). They cost 512 + 256 bytes per token and value head at K = V = 128 in 16 bits, held from the forward to
# the backward; the backward then needs that much less workspace. DELTACP_KEEP_CHUNK_STATES=0 keeps nothing (FLA's
# disable_recompute=False keeps nothing either).
_KEEP_VARIANTS = ("gdn", "kda", "delta")


def _keeps_chunk_states(variant: str, fwd_method: str, bwd_method: str, q) -> bool:
    if os.environ.get("DELTACP_KEEP_CHUNK_STATES", "1") == "0":
        return False
    return (q.device.type == "cuda" and variant in _KEEP_VARIANTS and bwd_method == "tiled"
            and fwd_method in ("auto", "fused", "tiled") and q.dtype in (torch.bfloat16, torch.float16))


def _new_kept_states(q, v, chunks):
    """(chunk_h, chunk_vnew), uninitialised, for `chunks` chunks (K and V rounded up to 16, as the kernels'
    tiles are)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    Kp, Vp = (K + 15) // 16 * 16, (V + 15) // 16 * 16
    return q.new_empty((chunks, HV, Kp, Vp)), q.new_empty((B, T, HV, Vp))


def _kept_states(cfg: _Config, q, v):
    """(chunk_h, chunk_vnew), uninitialised, for a forward that keeps them (_keeps_chunk_states), else None."""
    if not _keeps_chunk_states(cfg.variant, cfg.fwd_method, cfg.bwd_method, q):
        return None
    B, T = q.shape[:2]
    cs = cfg.chunk_size
    if cfg.cu is None:
        chunks = B * ((T + cs - 1) // cs)
    else:
        lens = cfg.cu_host[1:] - cfg.cu_host[:-1]
        chunks = int(((lens.clamp(min=0) + cs - 1) // cs).sum())
    return _new_kept_states(q, v, chunks)


# The forward's token-parallel (WY) stage kept beside the states (Params::wy_stage, WyStagePlanes in
# deltacp/params.h): G, T, W and P of every token (kda also K e^(G_n - G) and Q e^G), 1664 bytes per token and value
# head for kda and 656 for gdn, which the backward's recompute would otherwise rebuild from q, k, v, g and beta (kda:
# one kernel of 0.77 ms in a 4.7 ms step at (2, 16384, 16, 128) bf16 on an H200); the backward then runs stage B0
# alone and needs that much less workspace. The eager autograd route keeps it where the fused forward's stage runs on
# wgmma (16-bit gdn or kda, K = V = 128, Hopper) and hands it to the backward only when the forward reports that it
# wrote it (_core.cuda_last_forward_kept_wy_stage); the registered op (torch.compile) keeps none.
# DELTACP_KEEP_WY_STAGE=0 keeps none.
_WY_STAGE_ELEMS = {"kda": 832, "gdn": 328}  # WyStagePlanes::of(variant).total: 16-bit elements per row and head
_HOPPER = {}


def _is_hopper(device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HOPPER:
        _HOPPER[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return _HOPPER[index]


def _new_wy_stage(cfg: _Config, q, v):
    """An uninitialised WY stage buffer for a forward that keeps its states (_kept_states), or None where the fused
    forward would not write one (the forward has the last word: _core.cuda_last_forward_kept_wy_stage)."""
    if os.environ.get("DELTACP_KEEP_WY_STAGE", "1") == "0":
        return None
    if (cfg.variant not in _WY_STAGE_ELEMS or cfg.fwd_method not in ("auto", "fused") or q.shape[3] != 128
            or v.shape[3] != 128 or getattr(cfg, "qk_l2norm", False) or getattr(cfg, "kda_gate", None) is not None
            or not _is_hopper(q.device)):
        return None
    B, T = q.shape[:2]
    return q.new_empty((B * T * v.shape[2] * _WY_STAGE_ELEMS[cfg.variant],))


def _describe_kept(descs: dict, kept) -> None:
    if kept is not None:
        descs["chunk_h"] = torch_desc(kept[0], "chunk_h")
        descs["chunk_vnew"] = torch_desc(kept[1], "chunk_vnew")
        if len(kept) > 2 and kept[2] is not None:
            descs["wy_stage"] = torch_desc(kept[2], "wy_stage")


def _backward(cfg: _Config, q, k, v, g, beta, a, b, h0, do, dht, kept=None):
    """-> [dq, dk, dv, dg, dbeta, da, db, dh0], an empty tensor for each absent input. kept: what the forward kept
    (_forward's), read in place of the recompute's state scan."""
    descs = _input_descs(cfg, q, k, v, g, beta, a, b, h0)
    _describe_kept(descs, kept)
    descs["dout"] = torch_desc(do, "do")
    if dht is not None:
        descs["dht"] = torch_desc(dht, "dht")
    grads = []
    for field, t, name in (("q", q, "q"), ("k", k, "k"), ("v", v, "v"), ("g", g, cfg.gate_name),
                           ("beta", beta, "beta"), ("a", a, "a"), ("b", b, "b"), ("h0", h0, "initial_state")):
        if t is None:
            grads.append(torch.empty((0,), dtype=q.dtype, device=q.device))
            continue
        grads.append(torch.empty(t.shape, dtype=t.dtype, device=t.device))
        descs["d" + field] = torch_desc(grads[-1], "d" + name)
    _run(cfg, "backward", cfg.bwd_method, descs)
    return grads


class GateRangeCheck:
    """safe_gate's promise lower <= g <= 0 on a precomputed log decay (deltacp.fla_options), checked in two
    halves: start_gate_range_check enqueues one min / max reduction of g and its copy to pinned host memory;
    error() waits for that copy alone (not for work enqueued after it) and returns the message of a broken
    promise, or None. The ops enqueue their kernels in between: those are exact for any gate (the range is
    FLA's requirement, not deltacp's), so a broken promise is still reported before the call returns, while
    the GPU already runs the op (a check that synchronised before the launches left the GPU idle for the
    host's whole launch time). On CUDA the pinned memory and the event are a slot of a ring (_GateRing).
    A check made in the forward (in_forward_range_check) holds the forward's own range slots instead
    (Params::gate_range, in cuda/common/gate_range.cuh's integer form: encoded)."""
    __slots__ = ("lower", "gate_name", "host", "event", "values", "ring", "encoded")

    def __init__(self):
        self.lower, self.gate_name, self.host, self.event, self.values, self.ring = None, "g", None, None, None, None
        self.encoded = False  # the forward's range slots (in_forward_range_check) rather than floats

    def error(self):
        if self.values is None:
            if self.ring is not None:
                self.ring.read(self)
            else:  # CPU tensors: the reduction ran synchronously
                self.values = self.host.tolist()
        lo, hi = (_key_to_float(x) for x in self.values) if self.encoded else self.values
        if lo >= self.lower and hi <= 0.0:
            return None
        return (f"deltacp: argument '{self.gate_name}': safe_gate=True promises {self.lower} <= {self.gate_name} "
                f"<= 0 (lower_bound), got values in [{lo}, {hi}]; pass safe_gate=False for gates outside it")

    def confirm(self) -> None:
        """InvalidArgumentError naming the gate if the promise is broken."""
        message = self.error()
        if message is not None:
            raise InvalidArgumentError(message)


class _GateSlot:
    """Pinned host memory for one (min, max) pair, the event that marks its copy, and the check that owns it."""
    __slots__ = ("host", "event", "owner")

    def __init__(self, host, event):
        self.host, self.event, self.owner = host, event, None


class _GateRing:
    """The pinned (min, max) buffers and events of safe_gate's checks on one device and dtype, reused call after
    call. A pinned allocation and a new CUDA event per call cost more host time than the check's launches
    (the caching host allocator records and queries an event per block), on every KDA call with safe_gate.

    A slot is reused only once the copy into it has completed (its event has); if the check that owned it has
    not read its values yet, they are kept in that check first (GateRangeCheck.values), so a check read late
    still sees its own values. When the next slot's copy is still in flight (the host ran that far ahead of the
    GPU) the check gets a slot of its own outside the ring, as every check did before."""

    def __init__(self, new_slot, size: int):
        self._new_slot, self._size = new_slot, size
        self._slots, self._next = [], 0
        self._lock = threading.Lock()

    def _take(self):
        if len(self._slots) < self._size:
            self._slots.append(self._new_slot())
            return self._slots[-1]
        slot = self._slots[self._next]
        if not slot.event.query():
            return self._new_slot()  # outside the ring: used once
        self._next = (self._next + 1) % self._size
        if slot.owner is not None and slot.owner.values is None:
            slot.owner.values = slot.host.tolist()  # completed: the previous check keeps its values
        return slot

    def start(self, check: GateRangeCheck, lo_hi: Tensor, stream) -> None:
        """Copies lo_hi into a free slot after the work on `stream` and hands the slot to `check`."""
        with self._lock:  # held until the copy is recorded, so that no other thread takes the slot before
            slot = self._take()
            slot.owner = check
            slot.host.copy_(lo_hi, non_blocking=True)
            slot.event.record(stream)
        check.host, check.event, check.ring = slot.host, slot.event, self

    def read(self, check: GateRangeCheck) -> None:
        """check.values, once its copy completed (the wait outside the lock: another thread may go on)."""
        check.event.synchronize()
        with self._lock:
            if check.values is None:  # else a later check took the slot and kept the values first (_take)
                check.values = check.host.tolist()


_GATE_RING_SLOTS = 8  # one check is read per op call before the next starts; spare slots for direct callers
_GATE_RINGS = {}  # (device index, dtype) -> _GateRing


def _gate_ring(device: torch.device, dtype) -> _GateRing:
    index = device.index if device.index is not None else torch.cuda.current_device()
    ring = _GATE_RINGS.get((index, dtype))
    if ring is None:
        def new_slot():
            return _GateSlot(torch.empty((2,), dtype=dtype, pin_memory=True), torch.cuda.Event())

        ring = _GATE_RINGS.setdefault((index, dtype), _GateRing(new_slot, _GATE_RING_SLOTS))
    return ring


def start_gate_range_check(g, lower: float, gate_name: str = "g"):
    """A GateRangeCheck of g (None when g is absent or empty)."""
    if g is None or g.numel() == 0:
        return None
    if not torch.compiler.is_compiling() and capturing(g.device):
        raise InvalidArgumentError(
            f"deltacp: argument 'safe_gate': with a precomputed {gate_name}, safe_gate=True checks "
            f"{lower} <= {gate_name} <= 0 on the host, a device-to-host copy that a CUDA graph capture cannot "
            f"record; check the range before the capture and call with safe_gate=False inside it, or let the "
            f"gate come from use_gate_in_kernel=True")
    check = GateRangeCheck()
    check.lower, check.gate_name = lower, gate_name
    # One pass over g and one device-to-host copy (min() and max() apart took two of each: at (2,16384,16,128)
    # two reads of 268 MB and two synchronisations per call).
    lo_hi = torch.stack(torch.aminmax(g.detach()))
    if g.device.type == "cuda":
        _gate_ring(g.device, lo_hi.dtype).start(check, lo_hi, torch.cuda.current_stream(g.device))
    else:
        check.host = lo_hi
    return check


def _key_to_float(key: int) -> float:
    """A range slot's value (cuda/common/gate_range.cuh: a float's bits, a negative float's magnitude bits
    flipped) as the float it encodes."""
    bits = key if key >= 0 else key ^ 0x7FFFFFFF
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def in_forward_range_check(cfg: _Config, g, lower: float, gate_name: str = "g"):
    """safe_gate's check of g made by the CUDA forward itself (Params::gate_range): the fused kda stage folds the
    smallest and largest value into its gate load, so no pass over g runs before the kernels (on an H200, bf16 kda
    with FLA's benchmark keywords, torch.aminmax over g took 0.131 ms of the 1.82 ms forward at (4,4096,64,128));
    other tiers take one pass of their own (cuda/common/gate_range.h). None where it does not apply: then
    start_gate_range_check. The values reach the host after the forward's kernels (finish_in_forward_range_check),
    so it suits a check that the backward confirms, not one the forward waits for."""
    if (g is None or g.numel() == 0 or g.device.type != "cuda" or cfg.kda_gate is not None
            or g.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        return None
    if not torch.compiler.is_compiling() and capturing(g.device):
        return None  # start_gate_range_check raises the capture's error
    check = GateRangeCheck()
    check.lower, check.gate_name, check.encoded = lower, gate_name, True
    check.host = torch.empty((2,), dtype=torch.int32, device=g.device)  # the slots, until the copy
    cfg.gate_range = check.host
    return check


def finish_in_forward_range_check(cfg: _Config, check: GateRangeCheck) -> None:
    """After the forward's launches: its range slots copied to pinned memory behind them (a ring slot)."""
    slots, cfg.gate_range = check.host, None
    _gate_ring(slots.device, slots.dtype).start(check, slots, torch.cuda.current_stream(slots.device))


def _refuse_second_derivative(grads):
    """The gradients, each marked as requiring grad through a node that raises when reached: the C++ backward
    has no derivative of its own, and a second derivative must fail by name rather than come out as zero (what
    torch.autograd.function.once_differentiable does, with deltacp's message; the registered op's route fails
    the same way, at chunk_bwd's missing autograd)."""
    present = [i for i, t in enumerate(grads) if isinstance(t, torch.Tensor)]
    if not present:
        return grads
    message = (b"deltacp: a second derivative through deltacp::chunk_fwd is not supported: its backward "
               b"(deltacp::chunk_bwd) has no gradient")
    err = torch._C._functions.DelayedError(message, len(present))
    marked = err(*[grads[i].detach().requires_grad_(True) for i in present])
    marked = marked if isinstance(marked, tuple) else (marked,)
    out = list(grads)
    for i, t in zip(present, marked):
        out[i] = t
    return tuple(out)


_NO_L2NORM_GRAD = ("deltacp: argument 'qk_l2norm': the in-kernel l2 norm and kda gate have no gradient here; "
                   "compute them with autograd (deltacp.fla_options.l2norm, kda_gate) when one is wanted")


class _DeltaRuleFunction(torch.autograd.Function):
    """o, ht = f(cfg, q, k, v, g, beta, a, b, h0) for callers that build a _Config themselves (their
    methods chosen): eager autograd over _forward / _backward. The public ops use the registered
    deltacp::chunk_fwd instead, which torch.compile traces."""

    @staticmethod
    def forward(ctx, cfg: _Config, q, k, v, g, beta, a, b, h0):
        kept = _kept_states(cfg, q, v)
        if kept is not None:
            kept = kept + (_new_wy_stage(cfg, q, v),)
        o, ht = _forward(cfg, q, k, v, g, beta, a, b, h0, kept)
        if kept is not None and kept[2] is not None and not _core.cuda_last_forward_kept_wy_stage():
            kept = kept[:2]  # the forward wrote no stage: the backward recomputes it
        ctx.kept = kept  # the per-chunk states for the backward (_kept_states), or None
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, g, beta, a, b, h0)
        ctx.set_materialize_grads(False)
        return o, (ht if cfg.output_final_state else None)

    @staticmethod
    def backward(ctx, do, dht):
        if torch.is_grad_enabled():  # create_graph=True: the gradients' own backward refuses by name
            with torch.no_grad():
                grads = _DeltaRuleFunction.backward(ctx, do, dht)
            return _refuse_second_derivative(grads)
        cfg: _Config = ctx.cfg
        if getattr(cfg, "qk_l2norm", False) or getattr(cfg, "kda_gate", None) is not None:  # forward-only options
            raise InvalidArgumentError(_NO_L2NORM_GRAD)
        gate_check = getattr(cfg, "gate_check", None)
        # A check made by the forward's kernels (in_forward_range_check) reaches the host behind them: confirmed after
        # this backward's launches, so that the GPU runs them instead of idling while the host waits and launches (a
        # broken promise then drops the gradients). One made before the forward is complete by now: no wait.
        confirm_after = gate_check is not None and gate_check.encoded
        if gate_check is not None and not confirm_after:
            gate_check.confirm()
        q, k, v, g, beta, a, b, h0 = ctx.saved_tensors
        if do is None:  # only ht was used
            do = torch.zeros((q.shape[0], q.shape[1], v.shape[2], v.shape[3]), dtype=q.dtype, device=q.device)
        do = _last_dim_contiguous(do)  # e.g. the expanded gradient of o.sum() has stride 0
        if dht is not None:
            dht = dht.to(cfg.state_dtype).contiguous()
        try:
            grads = _backward(cfg, q, k, v, g, beta, a, b, h0, do, dht, ctx.kept)
        except Exception:
            if confirm_after:
                gate_check.confirm()  # a broken promise is the error to report
            raise
        if confirm_after:
            gate_check.confirm()
        inputs = (q, k, v, g, beta, a, b, h0)
        return (None, *(None if t is None else d for t, d in zip(inputs, grads)))


# ---------------------------------------------------------------------------------------------
# the registered ops
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("deltacp::chunk_fwd", mutates_args=())
def chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor], a: Optional[Tensor],
              b: Optional[Tensor], h0: Optional[Tensor], cu_seqlens: Optional[Tensor],
              cu_seqlens_cpu: Optional[Tensor], variant: str, fwd_method: str, bwd_method: str,
              scale: Optional[float], chunk_size: int, output_final_state: bool,
              gate_min: Optional[float], qk_l2norm: bool = False, gate_A_log: Optional[Tensor] = None,
              gate_dt_bias: Optional[Tensor] = None, gate_lower_bound: Optional[float] = None,
              qk_unit_rows: bool = False, keep_states: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    # qk_l2norm: q and k are l2-normalised inside the CUDA forward (FLA's use_qk_l2norm_in_kernel, no gradient:
    # deltacp.ops sets it only for calls that need none; the fused tier folds it into its products).
    # qk_unit_rows: q and k were l2-normalised before the call (deltacp.ops with a gradient), for the forward and
    # the backward: kda's diagonal score blocks take the same decay bound as with qk_l2norm (Params::qk_unit_rows).
    # gate_A_log (fp32 [HV]), gate_dt_bias (fp32 [HV * K] or None), gate_lower_bound: kda's gate from the raw g inside
    # the CUDA forward (FLA's use_gate_in_kernel, no gradient; the fused tier folds it into its gate sum).
    # keep_states: the per-chunk states for the backward (_kept_states), where they are kept and the sequences
    # have one length (the fake implementation cannot count a varlen batch's chunks from its shapes).
    cfg = _call_config(variant, fwd_method, bwd_method, q, scale, chunk_size, output_final_state, cu_seqlens,
                       cu_seqlens_cpu, qk_l2norm, None if gate_A_log is None else (gate_A_log, gate_dt_bias,
                                                                                   gate_lower_bound), qk_unit_rows)
    kept = _kept_states(cfg, q, v) if keep_states and cu_seqlens is None else None
    o, ht = _checked(cfg, g, gate_min, lambda: _forward(cfg, q, k, v, g, beta, a, b, h0, kept))
    return (o, ht) + (kept if kept is not None else (q.new_empty((0,)), q.new_empty((0,))))


def _call_config(variant, fwd_method, bwd_method, q, scale, chunk_size, output_final_state, cu, cu_host, qk_l2norm,
                 kda_gate, qk_unit_rows=False) -> _Config:
    """The _Config of one forward call with its in-kernel options (both routes of chunk)."""
    cfg = _config(variant, fwd_method, bwd_method, q, scale, chunk_size, output_final_state, cu, cu_host)
    cfg.qk_l2norm = bool(qk_l2norm)
    cfg.kda_gate = kda_gate
    cfg.qk_unit_rows = bool(qk_unit_rows)
    return cfg


def _checked(cfg: _Config, g, gate_min, run, confirm_in_backward: bool = False):
    """run() after safe_gate's range check of g was enqueued (gate_min: its lower bound, None: no check), confirmed
    after the launches (the forward's kernels take any gate), or with confirm_in_backward by the backward (cfg):
    then, on CUDA, the forward's kernels make the check themselves (in_forward_range_check)."""
    in_forward = None
    if gate_min is not None and confirm_in_backward:
        in_forward = in_forward_range_check(cfg, g, gate_min, cfg.gate_name)
    gate_check = in_forward
    if gate_min is not None and gate_check is None:
        gate_check = start_gate_range_check(g, gate_min, cfg.gate_name)
    if confirm_in_backward:
        cfg.gate_check = gate_check
    try:
        out = run()
    except Exception:
        cfg.gate_range = None
        if in_forward is not None:  # the forward stopped: its slots may not hold every value
            gate_check = start_gate_range_check(g, gate_min, cfg.gate_name)
        if gate_check is not None:
            gate_check.confirm()  # a broken promise is the error to report (a positive g fails both)
        raise
    if in_forward is not None:
        finish_in_forward_range_check(cfg, in_forward)
    if gate_check is not None and not confirm_in_backward:
        gate_check.confirm()
    return out


@chunk_fwd.register_fake
def _chunk_fwd_fake(q, k, v, g, beta, a, b, h0, cu_seqlens, cu_seqlens_cpu, variant, fwd_method, bwd_method, scale,
                    chunk_size, output_final_state, gate_min, qk_l2norm=False, gate_A_log=None, gate_dt_bias=None,
                    gate_lower_bound=None, qk_unit_rows=False, keep_states=False):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = q.new_empty((B, T, HV, V))
    if output_final_state:
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        ht = q.new_empty((N, HV, K, V), dtype=_state_dtype(q))
    else:
        ht = q.new_empty((0,), dtype=_state_dtype(q))
    if keep_states and cu_seqlens is None and _keeps_chunk_states(variant, fwd_method, bwd_method, q):
        kept = _new_kept_states(q, v, B * ((T + chunk_size - 1) // chunk_size))
    else:
        kept = (q.new_empty((0,)), q.new_empty((0,)))
    return (o, ht) + kept


@torch.library.custom_op("deltacp::chunk_bwd", mutates_args=())
def chunk_bwd(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Optional[Tensor], a: Optional[Tensor],
              b: Optional[Tensor], h0: Optional[Tensor], cu_seqlens: Optional[Tensor],
              cu_seqlens_cpu: Optional[Tensor], do: Tensor, dht: Optional[Tensor], variant: str, method: str,
              scale: Optional[float], chunk_size: int, qk_unit_rows: bool = False,
              chunk_h: Optional[Tensor] = None, chunk_vnew: Optional[Tensor] = None
              ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # chunk_h, chunk_vnew: what chunk_fwd kept for this backward (empty or None: nothing kept, the recompute's
    # state scan rebuilds them).
    cfg = _config(variant, method, method, q, scale, chunk_size, False, cu_seqlens, cu_seqlens_cpu)
    cfg.qk_unit_rows = bool(qk_unit_rows)
    kept = (chunk_h, chunk_vnew) if chunk_h is not None and chunk_h.numel() > 0 else None
    return tuple(_backward(cfg, q, k, v, g, beta, a, b, h0, do, dht, kept))


@chunk_bwd.register_fake
def _chunk_bwd_fake(q, k, v, g, beta, a, b, h0, cu_seqlens, cu_seqlens_cpu, do, dht, variant, method, scale,
                    chunk_size, qk_unit_rows=False, chunk_h=None, chunk_vnew=None):
    return tuple(q.new_empty((0,)) if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (q, k, v, g, beta, a, b, h0))


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, a, b, h0, cu, cu_host, variant, _fwd_method, bwd_method, scale, chunk_size,
     output_final_state, _gate_min, qk_l2norm, gate_A_log, _gate_dt_bias, _gate_lower_bound, qk_unit_rows,
     _keep_states) = inputs
    ctx.qk_l2norm = qk_l2norm or gate_A_log is not None  # both forward-only options: no gradient
    ctx.qk_unit_rows = qk_unit_rows
    chunk_h, chunk_vnew = output[2], output[3]
    ctx.mark_non_differentiable(chunk_h, chunk_vnew)
    ctx.save_for_backward(q, k, v, g, beta, a, b, h0, cu, cu_host, chunk_h, chunk_vnew)
    ctx.variant, ctx.method, ctx.scale, ctx.chunk_size = variant, bwd_method, scale, chunk_size
    ctx.output_final_state = output_final_state


def _chunk_fwd_backward(ctx, do, dht, _dchunk_h, _dchunk_vnew):
    if ctx.qk_l2norm:
        raise InvalidArgumentError(_NO_L2NORM_GRAD)
    q, k, v, g, beta, a, b, h0, cu, cu_host, chunk_h, chunk_vnew = ctx.saved_tensors
    if do is None:
        do = q.new_zeros((q.shape[0], q.shape[1], v.shape[2], v.shape[3]))
    do = _last_dim_contiguous(do)  # e.g. the expanded gradient of o.sum() has stride 0
    if not ctx.output_final_state or dht is None:
        dht = None
    else:
        dht = dht.to(_state_dtype(q)).contiguous()
    grads = chunk_bwd(q, k, v, g, beta, a, b, h0, cu, cu_host, do, dht, ctx.variant, ctx.method, ctx.scale,
                      ctx.chunk_size, ctx.qk_unit_rows, chunk_h, chunk_vnew)
    inputs = (q, k, v, g, beta, a, b, h0)
    return (*(None if t is None else d for t, d in zip(inputs, grads)),) + (None,) * 15


chunk_fwd.register_autograd(_chunk_fwd_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# the call: the registered op while torch.compile traces, the same run without its dispatch otherwise
# ---------------------------------------------------------------------------------------------
def _plain(tensors) -> bool:
    """True when nothing but eager torch sees these tensors: plain tensors (no subclass: FakeTensor, DTensor, a
    functorch wrapper) and no dispatch mode or functorch transform active. Anything else goes through the
    registered op, whose fake implementation and dispatch those need."""
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors if t is not None):
        return False
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode
        if _get_current_dispatch_mode() is not None:
            return False
        if torch._C._functorch.maybe_current_level() is not None:
            return False
    except (ImportError, AttributeError):  # a torch without these internals: the registered op
        return False
    return True


def chunk(q, k, v, g, beta, a, b, h0, cu_seqlens, cu_seqlens_cpu, variant: str, fwd_method: str, bwd_method: str,
          scale, chunk_size: int, output_final_state: bool, gate_min, qk_l2norm: bool = False, kda_gate=None,
          qk_unit_rows: bool = False):
    """(o, ht): what deltacp::chunk_fwd computes, with the same arguments, by one of two routes to the same
    _forward / _backward (so the same kernels and bits):

    - the registered op while torch.compile traces (and for tensor subclasses, fake tensors, dispatch modes);
    - otherwise _DeltaRuleFunction when a gradient is wanted, or _forward alone. torch.library's dispatch of a
      custom op (argument schema, autograd wrapper, the backward's default filling) costs the host about as
      much as the rest of deltacp's Python path: 125 us per forward and 210 per forward + backward on a
      2-core CPU host, time the GPU waits for at small problems. deltacp/_l2norm.py routes its kernel alike.

    ht is None without output_final_state on the second route (an empty tensor on the first: a custom op
    returns tensors only); deltacp.ops drops it either way.

    safe_gate's range check (gate_min) is enqueued before the kernels on both routes. Without a gradient the
    forward waits for it and raises; with one, on the second route, the forward's kernels make it themselves on
    CUDA (in_forward_range_check) and the backward raises, after enqueueing its kernels (before them elsewhere).
    Waiting in the forward held the host until the GPU had drained everything queued before the check (the
    previous step's backward, in training), so the host then enqueued this step's backward while the GPU
    idled; the forward's result is exact for any gate either way (the promise is FLA's requirement)."""
    tensors = (q, k, v, g, beta, a, b, h0, cu_seqlens, cu_seqlens_cpu)
    gate = kda_gate if kda_gate is not None else (None, None, None)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors[:8])
    if torch.compiler.is_compiling() or not _plain(tensors + gate[:2]):
        o, ht, _, _ = chunk_fwd(q, k, v, g, beta, a, b, h0, cu_seqlens, cu_seqlens_cpu, variant, fwd_method,
                                bwd_method, scale, chunk_size, output_final_state, gate_min, qk_l2norm, *gate,
                                qk_unit_rows, grad)
        return o, ht
    cfg = _call_config(variant, fwd_method, bwd_method, q, scale, chunk_size, output_final_state, cu_seqlens,
                       cu_seqlens_cpu, qk_l2norm, kda_gate, qk_unit_rows)
    if grad:
        return _checked(cfg, g, gate_min, lambda: _DeltaRuleFunction.apply(cfg, q, k, v, g, beta, a, b, h0),
                        confirm_in_backward=True)
    return _checked(cfg, g, gate_min, lambda: _forward(cfg, q, k, v, g, beta, a, b, h0))
