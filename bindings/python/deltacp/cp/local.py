"""deltacp.cp.local — a rank's local pass and the state maps of its pieces (docs/design.md section 4.2).

The call's configuration (_Cfg) and tensor descriptions; the final-state-only forward and dh0-only
backward runs that give a span's affine map [H | M] (and [dH | M^T]) from a widened problem, whole or
in pieces of whole chunks side by side; the staged local forward / backward of the tiled tier
(prepare before the exchange, finish after it) and the pieces taken from their stages; the fp32
compositions of the pieces' maps; and the chunk grid across a rank boundary (the head piece up to the
one-device chunk boundary); and, for dplr, which tier this rank runs (_dplr_tiers). Imports: deltacp._calls,
deltacp._dplr_gates, deltacp.cp.context; nothing above it.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple, Optional

import torch

from .. import _core
from .._calls import _run, tensor_descs
from .._describe import torch_desc
from .._stream import on_device, stream_handle
from .._dplr_gates import gate_range, gates_in_range
from ..errors import InvalidArgumentError
from .context import CPContext


class _Cfg:
    """Everything about one call that is not a differentiable tensor."""

    __slots__ = ("variant", "gate_name", "scale", "chunk_size", "output_final_state", "compute", "state_dtype",
                 "ctx", "device", "fwd_method", "bwd_method", "H", "HV", "K", "V", "num_seqs", "has_h0",
                 "check_fields", "gate_range_check", "gate_error", "pending_check", "tier_why", "fwd_named",
                 "needs_grad", "plan",  # plan: the problem's cached decisions (deltacp/cp/plan.py), or unset
                 "qk_unit_rows",  # q and k are l2-normalised rows (per call; Params::qk_unit_rows)
                 "qk_l2norm")  # the local forward normalises q and k in its kernels (per call; Params::qk_l2norm)


def _descs(cfg: _Cfg, q, k, v, g, beta, a, b, h0=None, cu=None, cu_host=None) -> dict:
    return tensor_descs(cfg.gate_name, q, k, v, g, beta, a, b, h0, cu, cu_host)


def _seg(t, s0, s1):
    return None if t is None else t[:, s0:s1]


def _identity_block(cfg: _Cfg, device=None) -> torch.Tensor:
    """I_K for every value head: [HV, K, K] in the state dtype."""
    eye = torch.eye(cfg.K, dtype=cfg.state_dtype, device=cfg.device if device is None else device)
    return eye.unsqueeze(0).expand(cfg.HV, cfg.K, cfg.K)


_OFFSETS = {}  # (device, values) -> (device tensor, host tensor, copy event or None): _offsets
_OFFSETS_MAX = 1024  # past this many, new values are made per call (nothing cached is ever freed)


def _offsets(device: torch.device, values):
    """(on `device`, on the host) int64 tensors of `values` (offsets, or row indices), made once per device
    and values. A host-to-device copy from pageable memory makes torch wait for the stream, which would
    drain the queue the CP op keeps ahead of the GPU (and, after an asynchronous all-gather, wait for the
    collective): so the host copy is pinned and the transfer asynchronous, and a CP context asks for the
    same few every call. Every use orders the current stream after that copy (an event), whichever
    stream made it, until the copy is seen completed: then no stream needs the wait and the event goes."""
    key = (str(device), tuple(int(x) for x in values))
    hit = _OFFSETS.get(key)
    if hit is None:
        host = torch.tensor(key[1], dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
            copied = torch.cuda.Event()
            hit = (host.to(device, non_blocking=True), host, copied)
            copied.record(torch.cuda.current_stream(device))
        else:
            hit = (host, host, None)
        if len(_OFFSETS) < _OFFSETS_MAX:
            _OFFSETS[key] = hit
    if hit[2] is not None:
        if hit[2].query():
            if _OFFSETS.get(key) is hit:
                _OFFSETS[key] = (hit[0], hit[1], None)
        else:
            torch.cuda.current_stream(device).wait_event(hit[2])
    return hit[0], hit[1]


def _rows(device: torch.device, values) -> torch.Tensor:
    """An index tensor of `values` on `device` (see _offsets)."""
    return _offsets(device, values)[0]


def _piece_tensors(cfg: _Cfg, n: int, bounds, as_sequences: bool = False):
    """(cu device, cu host, number of pieces) of a span of n tokens cut at `bounds` (None: one piece). One
    piece has no offsets (a plain batch of one), unless as_sequences (the staged steps take pieces as
    sequences always)."""
    if bounds is None:
        bounds = [0, n]
    if bounds[0] != 0 or bounds[-1] != n or any(b1 <= b0 for b0, b1 in zip(bounds, bounds[1:])):
        raise ValueError(f"deltacp: internal: pre-pass piece bounds {bounds} do not cut [0, {n})")
    if len(bounds) == 2 and not as_sequences:
        return None, None, 1
    dev, host = _offsets(cfg.device, bounds)
    return dev, host, len(bounds) - 1


def _augmented_forward(cfg: _Cfg, q, k, v, g, beta, a, b, start: Optional[torch.Tensor],
                       method: Optional[str] = None, bounds=None) -> torch.Tensor:
    """Final state of a span run with values [v | 0] from [start or 0 | I]: [HV, K, V + K] = [H | M].

    A final-state-only forward (no output buffer): only ht is computed. bounds (span-relative token
    offsets [0, b1, ..., n]) cuts the span into pieces that run side by side as one varlen call, each
    from [0 | I] (the first from [start or 0 | I]); their maps are then composed in fp32 (_fold_maps)."""
    return _fold_maps(_augmented_forward_pieces(cfg, q, k, v, g, beta, a, b, start, method, bounds), cfg.V)


def _augmented_forward_pieces(cfg: _Cfg, q, k, v, g, beta, a, b, start: Optional[torch.Tensor],
                              method: Optional[str] = None, bounds=None, staged=None) -> torch.Tensor:
    """_augmented_forward's pieces before they are composed: [P, HV, K, V + K], piece p's [H_p | M_p]."""
    return _final_states(cfg, (q, k, v, g, beta, a, b), cfg.V + cfg.K, True, start, method, bounds, staged)


def _transitions(cfg: _Cfg, q, k, v, g, beta, a, b, bounds, staged=None) -> torch.Tensor:
    """Each piece's state transition M_p alone, [P, HV, K, K]: the pieces of _augmented_forward_pieces
    without the V value columns (K zero value columns from I). The backward pre-pass composes their
    transposes."""
    return _final_states(cfg, (q, k, v, g, beta, a, b), cfg.K, False, None, None, bounds, staged)


def _state_only_method(cfg: _Cfg) -> str:
    """The method of a final-state-only forward (the pre-pass's maps, a head piece whose output is not wanted).
    The fused tier computes the output and refuses calls without one: its chain kernel reads the chunk-local
    stage's operands of the output, which a state-only run would make for nothing. So where the local forward
    is fused, the state-only runs take the tiled tier, whose final-state-only scan skips the output stage."""
    return "tiled" if cfg.fwd_method == "fused" else cfg.fwd_method


def _final_states(cfg: _Cfg, xs, width: int, with_values: bool, start, method, bounds,
                  staged=None) -> torch.Tensor:
    """Every piece's final state [P, HV, K, width] of a final-state-only forward, each piece from [0 | I].
    The state's first V columns take v's values when with_values, its other columns (all of them otherwise)
    zero values: width V + K gives [H_p | M_p], width K M_p. start (with width V + K): the first piece's
    offset then also carries start, H_0 <- M_0 start + H_0 in fp32 (_fold_start). (Where the local tiled
    forward cuts the segment itself, the pre-pass runs its pieces without start and composes them from
    [start | I] in one kernel instead: _compose_cut_maps.)

    staged: (a prepared local forward, _core.StagedForward, and row0): the span is rows [row0, row0 + n)
    of that forward, made of its own chunks. Only the state scan runs then, reading the prepared cumulative
    gates and W, U; no widened [v | 0] input is built (the value tensor below is a zero-size view that only
    gives the width). Otherwise one final-state-only forward of the span with values [v | 0] (or 0)."""
    q, k, v, g, beta, a, b = xs
    n = q.shape[1]
    cu, cu_host, P = _piece_tensors(cfg, n, bounds, as_sequences=staged is not None)
    if staged is not None:
        values = torch.zeros(width, dtype=v.dtype, device=v.device).expand(1, n, cfg.HV, width)
    else:
        zeros = torch.zeros((1, n, cfg.HV, width - cfg.V if with_values else width), dtype=v.dtype, device=v.device)
        values = torch.cat([v, zeros], dim=-1) if with_values else zeros
    h0 = torch.zeros((P, cfg.HV, cfg.K, width), dtype=cfg.state_dtype, device=v.device)
    h0[:, :, :, width - cfg.K:] = _identity_block(cfg, v.device)
    ht = torch.empty((P, cfg.HV, cfg.K, width), dtype=cfg.state_dtype, device=v.device)
    descs = _descs(cfg, q, k, values, g, beta, a, b, h0=h0, cu=cu, cu_host=cu_host)
    descs["ht"] = torch_desc(ht, "ht")  # and no "o"
    if staged is not None:
        handle, row0 = staged
        _staged_call(cfg, _core.staged_forward_step, handle, "state_pieces", cfg.variant, descs, row0=row0,
                     with_values=with_values)
    else:
        _run(cfg, "forward", method or _state_only_method(cfg), descs)
    if start is not None:
        _fold_start(ht, start, cfg.V)
    return ht


def _fold_start(X: torch.Tensor, start: torch.Tensor, V: int) -> None:
    """In place on maps X [P, HV, K, V + K]: piece 0 entered with `start` instead of 0, H_0 <- M_0 start + H_0
    (fp32, no TF32)."""
    with _no_tf32():
        X[0, :, :, :V] = torch.baddbmm(X[0, :, :, :V], X[0, :, :, V:], start.to(X.dtype))


def _cut_bounds(cfg: _Cfg, local_descs, n: int, pad: int):
    """Where the local forward cuts the rank's local segment n (0: the first, -1: the last) into pieces (the
    tiled state scan's, or the staged fused chain's intra-card CP: deltacp/cuda/api.h scan_pieces), as
    segment-relative bounds for the pre-pass; None when it does not cut it (or the local forward is neither).
    local_descs: the local forward's problem, the body [pad, T_local), whose sequence n is segment n (the
    first less the head piece [0, pad), which then is a piece of its own)."""
    cuts = ("tiled", "fused") if _fused_staged_enabled() else ("tiled",)
    if local_descs is None or cfg.fwd_method not in cuts or cfg.device.type != "cuda" or \
            not hasattr(_core, "scan_pieces") or cfg.variant == "dplr":  # (the tiled DPLR never cuts)
        return None
    ctx = cfg.ctx
    n = n % ctx.num_local_seqs
    with on_device(cfg.device):  # the plan reads the device's SM count
        body = list(_core.scan_pieces(cfg.variant, local_descs, n, chunk_size=cfg.chunk_size,
                                      method=cfg.fwd_method))
    if len(body) <= 2:
        return None
    head = pad if n == 0 else 0
    if body[-1] != ctx.cu_seqlens_list[n + 1] - ctx.cu_seqlens_list[n] - head:
        raise ValueError(f"deltacp: internal: the local forward's sequence {n} is not local segment {n}")
    return ([0] if head else []) + [head + x for x in body]


def _compose_cut_maps(cfg: _Cfg, X: torch.Tensor, start: Optional[torch.Tensor], head: bool) -> torch.Tensor:
    """Maps X [P, HV, K, V + K] (CUDA fp32, each piece's [H_p | M_p] from [0 | I]) composed in one kernel
    (_core.compose_state_maps, the kernel of forward_composed_map) from X[0] when `head` (the head piece's
    map: the rest are composed), else from [start | I] ([0 | I] without start): [HV, K, width] fp32, width
    the exchange's (_exchange_width). The pieces of a cut the local forward makes are composed this way on
    every route, with the same inputs, so the staged and one-shot CP forwards agree bitwise."""
    assert X.dtype == torch.float32
    width, init, out = _composition_io(cfg, X[0] if head else None, start)
    X = (X[1:] if head else X).contiguous()
    with on_device(X.device):
        _core.compose_state_maps(X.data_ptr(), X.shape[0], cfg.HV, cfg.K, cfg.V, width,
                                 0 if init is None else init.data_ptr(), out.data_ptr(), out.numel(),
                                 stream_handle(X.device))
    return out


def _composition_io(cfg: _Cfg, head: Optional[torch.Tensor], start: Optional[torch.Tensor]):
    """(width, init, out) of a composition: width the exchange's (_exchange_width); init the state it enters
    with, [HV, K, width] fp32 contiguous: the head piece's map `head` ([HV, K, V + K]), else [start | I], else
    None ([0 | I], which the kernel makes itself); out an empty [HV, K, width] fp32 on the rank's device."""
    width = _exchange_width(cfg.ctx, cfg.K, cfg.V)
    init = None
    if head is not None:
        assert head.dtype == torch.float32
        init = head[..., :width].contiguous()
    elif start is not None:
        init = torch.cat([start.to(torch.float32), _identity_block(cfg).to(torch.float32)], dim=-1)
        init = init[..., :width].contiguous()
    return width, init, torch.empty((cfg.HV, cfg.K, width), dtype=torch.float32, device=cfg.device)


class _PreparedForward(NamedTuple):
    """A local forward prepared in stages (_core.StagedForward) over the body [pad, T_local) of the rank."""
    handle: object
    pad: int  # the body's first local token (_grid_pad)
    tier: str = "tiled"  # which tier prepared it: only the tiled one runs state-only pieces from its stages


def _pieces_of_segment(cfg: _Cfg, run, xs, s0: int, s1: int, bounds, prepared: Optional[_PreparedForward]):
    """run(span tensors, span-relative bounds, staged or None) -> [P, ...] over the local segment [s0, s1)
    cut at `bounds`. With a prepared forward the pieces come from its stages; a head piece before its
    body (tokens [0, pad), a piece boundary by _piece_bounds) then runs on its own, like the local forward.
    A forward prepared on the fused tier has no state-only pieces (its chain always makes the output): the
    pieces then run on their own (the tiled tier, _state_only_method)."""
    if prepared is None or prepared.tier != "tiled":
        return run(_split(xs, s0, s1), bounds, None)
    pad = prepared.pad
    if s0 >= pad:
        return run(_split(xs, s0, s1), bounds, (prepared.handle, s0 - pad))
    if pad not in bounds:
        raise ValueError("deltacp: internal: the pre-pass pieces do not start the body at the head piece's end")
    head = run(_split(xs, s0, pad), [0, pad], None)
    body = run(_split(xs, pad, s1), [x - pad for x in bounds if x >= pad], (prepared.handle, 0))
    return torch.cat([head, body])


def _fused_staged_enabled() -> bool:
    """DELTACP_CP_STAGED_FUSED=1 (the default): a fused local forward runs in stages, its pre-pass from its own
    pieces' maps. 0: the fused local forward runs one-shot after the exchange and the pre-pass is a tiled
    state-only run of its own (on 2 x H100, 32K tokens per rank, H = 16: the exchange 172% / 128% of the local
    forward for GDN / KDA one-shot, 24% / 12% staged; docs/context-parallel.md)."""
    flag = os.environ.get("DELTACP_CP_STAGED_FUSED", "1").strip()
    if flag not in ("0", "1"):
        raise InvalidArgumentError(f"deltacp: environment variable 'DELTACP_CP_STAGED_FUSED': expected 0 or 1, got "
                                   f"{flag!r}")
    return flag == "1"


def _staged_available(cfg: _Cfg, direction: str, q=None, g=None) -> bool:
    """The CP op runs the local tiled (or, forward, fused) kernels in stages (deltacp/cuda/api.h StagedForward,
    StagedBackward): the stages that need no exchanged state while the exchange is pending, and the pre-pass
    from those same stages. DELTACP_CP_STAGED=0 switches it off (one-shot local kernels, separate pre-pass). The
    forward stages only where the pre-pass takes the tiled route (q, g: its inputs); a fused local forward stages
    unless DELTACP_CP_STAGED_FUSED=0 (its pre-pass is then its own pieces' maps, composed)."""
    flag = os.environ.get("DELTACP_CP_STAGED", "1").strip()
    if flag not in ("0", "1"):
        raise InvalidArgumentError(f"deltacp: environment variable 'DELTACP_CP_STAGED': expected 0 or 1, got {flag!r}")
    if not (flag == "1" and cfg.device.type == "cuda" and _core.built_with_cuda()):
        return False
    if cfg.variant == "dplr":  # the tiled DPLR kernels have no staged form: one-shot local pass, separate pre-pass
        return False
    if direction == "backward":
        return cfg.bwd_method == "tiled" and hasattr(_core, "staged_backward_prepare")
    if cfg.fwd_method == "fused" and not _fused_staged_enabled():
        return False
    return (cfg.fwd_method in ("tiled", "fused") and hasattr(_core, "staged_forward_prepare")
            and hasattr(_core, "scan_pieces") and _prepass_route(cfg, "forward", q, g) == "chunked")


def _staged_call(cfg: _Cfg, fn, *args, **kwargs):
    with on_device(cfg.device):
        stream = stream_handle(cfg.device)
        return fn(*args, cfg.scale, cfg.chunk_size, stream, **kwargs)


def _dh0_pieces(cfg: _Cfg, q, k, v, g, beta, a, b, do, dend: Optional[torch.Tensor], bounds,
                staged=None) -> torch.Tensor:
    """Each piece's dH_p = dL/dS_start with dL/dS_end = 0 (the last piece: dend), [P, HV, K, V]: one
    dh0-only backward over the V real columns (no [v | 0] widening: the maps come from the forward).
    staged: a prepared local backward whose first rows these tokens are (its own chunks); then only its
    dh scan (B1) runs over the pieces, reading the prepared W, Kd, G and B0 rows."""
    n = q.shape[1]
    cu, cu_host, P = _piece_tensors(cfg, n, bounds, as_sequences=staged is not None)
    dht = torch.zeros((P, cfg.HV, cfg.K, cfg.V), dtype=cfg.state_dtype, device=v.device)
    if dend is not None:
        dht[-1] = dend
    dh0 = torch.empty((P, cfg.HV, cfg.K, cfg.V), dtype=cfg.state_dtype, device=v.device)
    descs = _descs(cfg, q, k, v, g, beta, a, b, cu=cu, cu_host=cu_host)
    do = do.to(v.dtype)
    descs["dout"] = torch_desc(do, "do")
    descs["dht"] = torch_desc(dht, "dht")
    descs["dh0"] = torch_desc(dh0, "dh0")  # and no dq, dk, dv, ...
    if staged is not None:
        _staged_call(cfg, _core.staged_backward_step, staged, "dh0_pieces", cfg.variant, descs)
    else:
        _run(cfg, "backward", cfg.bwd_method, descs)
    return dh0


def _augmented_backward(cfg: _Cfg, q, k, v, g, beta, a, b, do, dend: Optional[torch.Tensor],
                        method: Optional[str] = None, bounds=None) -> torch.Tensor:
    """dL/dS_start of a span run with values [v | 0], upstream [do | 0] and dL/dS_end = [dend or 0 | I]:
    [HV, K, V + K] = [dH | M^T] (independent of the start state, so none is given).

    A dh0-only backward (no input gradient buffers): only dh0 is computed. bounds as in
    _augmented_forward: every piece ends at [0 | I] (the last at [dend or 0 | I]); the pieces' maps are
    composed from the last to the first."""
    n = q.shape[1]
    cu, cu_host, P = _piece_tensors(cfg, n, bounds)
    zeros_v = torch.zeros((1, n, cfg.HV, cfg.K), dtype=v.dtype, device=v.device)
    v_aug = torch.cat([v, zeros_v], dim=-1)
    do_aug = torch.cat([do.to(v.dtype), zeros_v], dim=-1)
    dht_aug = torch.zeros((P, cfg.HV, cfg.K, cfg.V + cfg.K), dtype=cfg.state_dtype, device=v.device)
    dht_aug[:, :, :, cfg.V:] = _identity_block(cfg, v.device)
    if dend is not None:
        dht_aug[-1, :, :, :cfg.V] = dend
    dh0_aug = torch.empty((P, cfg.HV, cfg.K, cfg.V + cfg.K), dtype=cfg.state_dtype, device=v.device)
    descs = _descs(cfg, q, k, v_aug, g, beta, a, b, cu=cu, cu_host=cu_host)
    descs["dout"] = torch_desc(do_aug, "do")
    descs["dht"] = torch_desc(dht_aug, "dht")
    descs["dh0"] = torch_desc(dh0_aug, "dh0")  # and no dq, dk, dv, ...
    _run(cfg, "backward", method or cfg.bwd_method, descs)
    return _fold_maps(dh0_aug.flip(0), cfg.V)


def _fold_maps(X: torch.Tensor, V: int) -> torch.Tensor:
    """Composes affine state maps X[p] = [H_p | M_p] ([P, HV, K, V + K]; S -> M_p S + H_p, applied in
    the order p = 0, 1, ...) into one [H | M]: a log-depth tree of batched products, in X's dtype (fp32 or
    fp64; TF32 is switched off for it). (M_b, H_b) o (M_a, H_a) = (M_b M_a, M_b H_a + H_b)."""
    if X.shape[0] == 1:
        return X[0]
    H, M = _fold(X[..., :V], X[..., V:])
    return torch.cat([H, M], dim=-1)


@contextlib.contextmanager
def _no_tf32():
    """fp32 products in full fp32 (the compositions of state maps must not round to TF32's 10 bits)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _fold_offsets(H: torch.Tensor, M: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """The offset alone of the composed maps S -> M_p S + H_p (H [P, HV, K, V], M [P, HV, K, K]; applied
    p = 0, 1, ..., or p = P - 1, ..., 0 when reverse), [HV, K, V]: S = the first H_p, then S <- M_p S + H_p,
    one fused product per piece. For when nothing reads the composed transition (not ctx.maps_read): _fold
    also composes the transitions, in a tree of about five launches per level, which the host must issue
    while the GPU waits for them on the exchange's critical path (the 2x H200 traces showed the GPU idle
    between them); here P - 1 launches. Sums in another order than _fold's: the two agree to rounding.
    Also the CP merge's fold over the gathered ranks where the merge kernel is not at hand. Always a new
    tensor (one map: a copy), so that a kept result pins none of H's storage."""
    order = list(range(H.shape[0]))
    if reverse:
        order.reverse()
    if len(order) == 1:
        return H[order[0]].clone()
    S = H[order[0]]
    with _no_tf32():
        for p in order[1:]:
            S = torch.baddbmm(H[p], M[p], S)
    return S


def _fold(H: torch.Tensor, M: torch.Tensor):
    """_fold_maps on separate [P, HV, K, V] offsets and [P, HV, K, K] transitions: (H, M) of the whole."""
    with _no_tf32():
        while H.shape[0] > 1:
            n = H.shape[0] // 2 * 2
            Mb = M[1:n:2]
            Hc = torch.matmul(Mb, H[0:n:2]) + H[1:n:2]
            Mc = torch.matmul(Mb, M[0:n:2])
            H, M = (torch.cat([Hc, H[n:]]), torch.cat([Mc, M[n:]])) if n < H.shape[0] else (Hc, Mc)
    return H[0], M[0]


def _piece_bounds(cfg: _Cfg, n: int, aligned_from: int):
    """Span-relative piece boundaries for a pre-pass over n tokens whose one-device chunk grid starts at
    token aligned_from (the _grid_pad head piece, 0 when aligned): [0, aligned_from?, +piece, ..., n].

    Pieces are whole one-device chunks, so each rounds exactly like the local kernel's chunks. Their length
    is DELTACP_CP_PREPASS_PIECE tokens (rounded up to whole chunks; 0: one piece) or, by default on CUDA,
    a quarter of the span but at least _MIN_PIECE_TOKENS; on CPUs the span stays whole (no parallel gain).

    Why a quarter: on 2x H200 (bf16 GDN, H = 16, K = V = 128, a 32768-token span; 2026-11-22)
    the forward pre-pass took 1.85 / 1.97 / 1.79 / 1.68 / 1.59 ms in one piece / pieces of 1024 / 2048 /
    4096 / 8192 tokens, the backward 3.03 / 2.59 / 2.40 / 2.29 / 2.21 ms: more pieces fill the GPU, but
    each costs a state load and store of K x (V + K) fp32 per head and a composition."""
    piece = _piece_tokens(cfg, n)
    bounds = [0]
    if 0 < aligned_from < n:
        bounds.append(aligned_from)
    x = bounds[-1]
    if piece > 0:
        while x + piece < n:
            x += piece
            bounds.append(x)
    bounds.append(n)
    return bounds


_MIN_PIECE_TOKENS = 2048


def _piece_tokens(cfg: _Cfg, n: int) -> int:
    text = os.environ.get("DELTACP_CP_PREPASS_PIECE", "").strip()
    if not text:
        if cfg.device.type != "cuda":
            return 0
        return max(_MIN_PIECE_TOKENS, _round_up(_round_up(n, 4) // 4, cfg.chunk_size))
    try:
        piece = int(text)
    except ValueError:
        piece = -1
    if piece < 0:
        raise InvalidArgumentError(f"deltacp: environment variable 'DELTACP_CP_PREPASS_PIECE': expected 0 (one piece) or "
                         f"a positive number of tokens per pre-pass piece, got {text!r}")
    return _round_up(piece, cfg.chunk_size)  # whole chunks


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ---------------------------------------------------------------------------------------------
# the chunk grid across a rank boundary
# ---------------------------------------------------------------------------------------------
_CHUNKED_METHODS = ("chunked", "tiled", "fused")


def _grid_pad(cfg: _Cfg) -> int:
    """Tokens at the start of the first local segment that complete the chunk a rank boundary cut.

    A chunked kernel cuts each sequence into chunks from the sequence's first token. A rank whose first
    segment continues a sequence would, left alone, restart that grid at its own first token, so every
    one of its chunks would hold different tokens than the one-device run's chunks. In exact arithmetic
    that changes nothing. With 16-bit operands (W, U, h are rounded per chunk) the two runs would round
    different tiles, and their difference would be about sqrt(2) times each run's own error. So the
    first `pad` tokens, up to the next one-device chunk boundary, run as a separate short piece whose
    final state starts the rest. That re-aligns the grid, and the rest rounds exactly like the one
    device. 0 when the segment starts its sequence, the boundary is already aligned, the segment ends
    before the next boundary, or the method has no chunk grid."""
    ctx = cfg.ctx
    if not ctx.first_continues or cfg.fwd_method not in _CHUNKED_METHODS:
        return 0
    seg_len = ctx.cu_seqlens_list[1] - ctx.cu_seqlens_list[0]
    offset = ctx.begin - ctx.cu_seqlens_global_list[ctx.seq_ids[0]]  # tokens of the sequence on earlier ranks
    pad = (-offset) % cfg.chunk_size
    return pad if 0 < pad < seg_len else 0


def _body_cu_seqlens(cfg: _Cfg, pad: int):
    """Rank-local cu_seqlens of tokens [pad, T_local) (the first segment shortened by pad): (device, host)."""
    ctx = cfg.ctx
    return _offsets(ctx.cu_seqlens.device, [0] + [c - pad for c in ctx.cu_seqlens_list[1:]])


def _head_forward(cfg: _Cfg, head, start: torch.Tensor, o_view: Optional[torch.Tensor]) -> torch.Tensor:
    """The pad-token head piece (one sequence) from `start`: fills o_view when given (else a final-state-only
    run) and returns its final state [HV, K, V]."""
    h0 = start.unsqueeze(0).contiguous()  # the descriptions hold raw pointers: keep every tensor referenced
    descs = _descs(cfg, *head, h0=h0)
    if o_view is not None:
        descs["o"] = torch_desc(o_view, "o")
    ht = torch.empty((1, cfg.HV, cfg.K, cfg.V), dtype=cfg.state_dtype, device=cfg.device)
    descs["ht"] = torch_desc(ht, "ht")
    _run(cfg, "forward", cfg.fwd_method if o_view is not None else _state_only_method(cfg), descs)
    return ht[0]


def _split(ts, s0, s1):
    return [_seg(t, s0, s1) for t in ts]


def _exchange_width(ctx: CPContext, K: int, V: int) -> int:
    return V + K if ctx.maps_read else V


# ---------------------------------------------------------------------------------------------
# the route of the pre-pass's state-only runs
# ---------------------------------------------------------------------------------------------
_PREPASS_MODES = ("auto", "chunked", "loops")
_TILED_MAX_WIDTH = 256  # the tiled tier's widest value dimension (kMaxHeadDim): V + K must fit
_TILED_PREPASS_UNFIT = set()  # (direction, variant, dtype, g dtype, K, V) whose tiled run did not fit the GPU


def _use_nccl_kernels(cfg: _Cfg) -> bool:
    return cfg.device.type == "cuda" and cfg.ctx.nccl is not None


def _prepass_mode() -> str:
    mode = os.environ.get("DELTACP_CP_PREPASS", "auto").strip().lower() or "auto"
    if mode not in _PREPASS_MODES:
        raise InvalidArgumentError(f"deltacp: environment variable 'DELTACP_CP_PREPASS': expected one of {_PREPASS_MODES}, "
                         f"got {mode!r}")
    return mode


def _prepass_route(cfg: _Cfg, direction: str, q, g) -> str:
    """'chunked' (the state-only modes of the chunked kernels) or 'loops' (deltacp._cp_nccl's fp32 loops)."""
    if not _use_nccl_kernels(cfg):
        return "chunked"  # CPU tensors, or CUDA without deltacp._cp_nccl
    mode = _prepass_mode()
    if mode != "auto":
        return mode
    method = _state_only_method(cfg) if direction == "forward" else cfg.bwd_method  # the forward's: state-only
    key = (direction, cfg.variant, str(q.dtype), None if g is None else str(g.dtype), cfg.K, cfg.V)
    # The tiled DPLR kernels take any state width (their scans run 32-column blocks of the state side by side).
    fits = cfg.variant == "dplr" or cfg.V + cfg.K <= _TILED_MAX_WIDTH
    if method == "tiled" and fits and key not in _TILED_PREPASS_UNFIT:
        return "chunked"
    return "loops"


def _prepass_chunked_or_loops(cfg: _Cfg, direction: str, chunked, loops, q, g):
    """Runs the route _prepass_route picks; a tiled run that does not fit the GPU's shared memory
    (a deltacp.Error naming the shared-memory limit, raised before anything is launched) falls back
    to the loop kernels, once per shape."""
    route = _prepass_route(cfg, direction, q, g)
    if route == "loops":
        return loops()
    try:
        return chunked()
    except ValueError as exc:
        if not (_use_nccl_kernels(cfg) and _prepass_mode() == "auto" and "shared memory" in str(exc)):
            raise
        _TILED_PREPASS_UNFIT.add((direction, cfg.variant, str(q.dtype), None if g is None else str(g.dtype), cfg.K,
                                  cfg.V))
        return loops()


# ---------------------------------------------------------------------------------------------
# dplr: this rank's tier
# ---------------------------------------------------------------------------------------------
# The token recurrence that stands in for a chunked method where that method does not take a rank's inputs.
_DPLR_FALLBACK = {"chunked": "recurrent", "tiled": "naive"}
_TILED_DPLR_REFUSALS = {}  # (device, dtype, gk dtype, K, chunk size) -> None (it runs) or why the tier refuses


def _dplr_tiers(cfg: _Cfg, q, k, v, g, a, b, gate_check: bool) -> None:
    """cfg.fwd_method / bwd_method (and cfg.tier_why) for dplr on this rank.

    The chunked methods (the chunked reference on CPUs; the tiled DPLR tier on GPUs, named by backend="tiled")
    run the local pass and the pre-pass's maps where every gate of this rank lies in the chunk form's range
    (deltacp._dplr_gates; not checked when the caller vouches for it: gate_check False) and, for the tiled tier,
    where it takes the inputs (_tiled_dplr_refusal). Otherwise this rank runs the token recurrence (the
    recurrent reference, the naive tier), as the single-device op does. The choice is the rank's own: the ranks
    agree on the backend argument, and exchange only fp32 state maps, which every tier computes exactly."""
    fallback = _DPLR_FALLBACK.get(cfg.fwd_method)
    if fallback is None:  # the token recurrence already (cfg.tier_why: why that one)
        return
    why = None
    if gate_check and not gates_in_range(g, cfg.chunk_size):
        lo, hi = gate_range(cfg.chunk_size)
        why = f"gk outside the chunk form's range [{lo:g}, {hi:g}] at chunk size {cfg.chunk_size} on this rank"
    elif cfg.fwd_method == "tiled":
        refusal = _tiled_dplr_refusal(cfg, q, k, v, g, a, b)
        if refusal is not None:
            why = f"the tiled DPLR tier does not take these inputs: {refusal}"
    if why is None:
        cfg.tier_why = ("the tiled DPLR tier takes this rank's inputs" if cfg.fwd_method == "tiled"
                        else "the chunked reference takes this rank's gates")
        return
    cfg.fwd_method = cfg.bwd_method = fallback
    cfg.tier_why = why


def _tiled_dplr_refusal(cfg: _Cfg, q, k, v, g, a, b) -> Optional[str]:
    """None when the tiled DPLR tier runs this call's inputs, else the tier's own words for why not.

    The tier checks what it takes (K <= 128, chunk_size <= 64, and each of its stages' shared memory against
    this GPU's limit for the dtype and K) before it launches anything, and names what it refuses. That depends
    on the dtype, gk's dtype, K and the chunk size only, so a one-token forward of this rank's first token
    (outputs to scratch) asks it once per such key and device. Its stages' widest is the WY stage, wider than
    every stage of the backward (cuda/tiled/dplr_bwd.cu's table), so the forward's answer holds for both."""
    key = (str(cfg.device), str(q.dtype), str(g.dtype), cfg.K, cfg.chunk_size)
    if key in _TILED_DPLR_REFUSALS:
        return _TILED_DPLR_REFUSALS[key]
    if q.shape[1] == 0:
        return None  # nothing runs on this rank
    descs = _descs(cfg, *_split((q, k, v, g, None, a, b), 0, 1))
    o = torch.empty((1, 1, cfg.HV, cfg.V), dtype=v.dtype, device=v.device)
    ht = torch.empty((1, cfg.HV, cfg.K, cfg.V), dtype=cfg.state_dtype, device=v.device)
    descs["o"] = torch_desc(o, "o")
    descs["ht"] = torch_desc(ht, "ht")
    try:
        _run(cfg, "forward", "tiled", descs)
        refusal = None
    except ValueError as exc:  # deltacp.InvalidArgumentError naming K, chunk_size, ... (nothing was launched)
        refusal = str(exc)
    _TILED_DPLR_REFUSALS[key] = refusal
    return refusal
