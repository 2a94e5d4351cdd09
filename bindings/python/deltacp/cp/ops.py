"""deltacp.cp.ops — context-parallel forward and backward with autograd (docs/design.md section 4).

Each rank holds its slice of a packed batch (see context.py) and calls, with rank-local tensors,

    o, ht = chunk_gated_delta_rule_cp(q, k, v, g, beta, cp_context=ctx, initial_state=h0,
                                      output_final_state=True)

Forward, on every rank r (the same algorithm as the simulated CP of reference/src/batch.cpp):

  1. pre-pass: over the rank's LAST local segment, when it continues on a later rank, the state map
     S_end = M_r S_start + H_r. [H | M] evolves exactly like a state with V + K columns: run the
     segment with values [v | 0] from the initial state [h0 or 0 | I]; the final state is [H_r | M_r]
     (H_r includes the sequence's initial state when the sequence starts on this rank). fp32 (fp64
     for fp64 inputs).
  2. one all-gather of the [HV, K, V + K] buffers;
  3. merge: the initial state of the FIRST local segment, when it continues a sequence from earlier
     ranks, is S = 0 folded through the earlier ranks j = r - pre_ranks .. r - 1: S <- M_j S + H_j;
  4. the local chunked kernel over all local segments (the reference on the CPU, the fastest CUDA
     tier on GPUs) from those initial states. When the first segment continues a sequence mid-chunk,
     its tokens up to the one-device chunk boundary run first as a separate piece (_grid_pad), so
     the rest is chunked exactly as on one device (the same 16-bit rounding, tile for tile).

Backward mirrored: over the FIRST local segment (when it continues from earlier ranks) dS_start =
M_r^T dS_end + dH_r, computed as one backward of the [v | 0] problem with upstream [do | 0] and
dL/dS_end = [dht or 0 | I]: its dL/dh0 is [dH_r | M_r^T]. (When the forward saved that segment's
per-piece transitions, only dH is computed, over the V real columns, and composed with them; see
"In pieces" below.) All-gather, fold from the later ranks
dS <- M_j^T dS + dH_j (j = r + post_ranks down to r + 1), and run the local backward with that as the
last segment's dL/dS_end. Only one merged initial state is kept for the backward (the seeds'
compress_h0): the rest of the local initial states are rebuilt from the user's initial_state.

Why the augmented run is exact: every update of the state is affine in S with coefficients that do
not depend on S (S <- P_t S + B_t with P_t, B_t built from k, g, beta, a, b and v), so for the
V + K columns of X = [S | Y] with values [v | 0]: the first V columns follow the real recurrence and
the last K follow Y <- P_t Y (no value term). From Y_0 = I they hold the product M = P_n ... P_1, and
from S_0 = start the first V columns end at M start + H. The backward is the transpose: from
dS_end = [dend | I] the gradient reaching the span start is [M^T dend + dH | M^T].

In pieces (_piece_bounds, _fold_maps): a span is cut into pieces of whole one-device chunks that run
side by side as one varlen call (a long single sequence otherwise walks its chunks one by one on a few
SMs); the pieces' affine maps are composed in fp32 by a log-depth tree. The CP forward also keeps the
first segment's per-piece transitions M_p for the backward pre-pass (_prepass_forward).

How the pre-pass runs (the state-only modes of deltacp::Params, params.h): the forward is a
final-state-only forward (no "o": only ht = [H | M] is written) and the backward a dh0-only backward
(no input gradients: only dh0 = [dH | M^T] is written), both through the normal chunked kernels:

  * CPU tensors: the chunked Eigen reference;
  * CUDA tensors, variants whose chosen tier is "tiled" (gdn, kda, delta) and V + K <= 256 (the
    tiled tier's widest value tile): the tiled tier itself (tensor cores; fp32 state, operands in
    the input dtype exactly like the local kernel). A tiled launch that does not fit the GPU's
    shared memory (fp32 inputs with V + K near 256) falls back to the loop kernels once and is
    remembered for that shape;
  * otherwise (dplr, the naive tier, V + K > 256): the fp32 loop kernels of deltacp._cp_nccl
    (distributed/src/cp_kernels.cu, exact fp32), or the chunked CUDA tier when that module is absent.

DELTACP_CP_PREPASS=auto (default) | chunked | loops overrides the CUDA choice (loops needs
deltacp._cp_nccl). float32 g (the log decay) beside bf16/fp16 q, k, v is accepted as in the
single-device ops, on every path.

States: ``initial_state`` [N, HV, K, V] (N = number of GLOBAL sequences, the same tensor on every
rank); row n is read by the rank holding sequence n's first token. The returned final state is
[N, HV, K, V] with the rows of the sequences ENDING on this rank filled and zeros elsewhere (sum over
the ranks for the full tensor). The gradient of initial_state likewise holds the rows of the sequences
STARTING on this rank. The all-gathers run on the context's group (gloo for CPU tensors) or on
deltacp's own NCCL communicator (CUDA tensors) with a timeout: a stalled or dead rank makes every
other rank raise instead of hanging.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _core
from .._describe import torch_desc
# The single-device ops' argument checks, tensor descriptions and kernel call, shared.
from ..ops import _l2norm, _run, _tensor, tensor_descs
from .context import CPContext, agree, agree_finish, agree_start, wait_collective

__all__ = ["chunk_gated_delta_rule_cp", "chunk_kda_cp", "chunk_delta_rule_cp", "chunk_dplr_cp", "cp_apply",
           "exchange_bytes", "last_stats"]

_CUDA_TIERS = ("fused", "tiled", "naive")

# Filled by each call (for the examples' tables): bytes received by the all-gathers, per direction.
last_stats = {"forward_bytes": 0, "backward_bytes": 0}


def exchange_bytes(ctx: CPContext, HV: int, K: int, V: int, dtype=torch.float32) -> int:
    """Bytes one all-gather delivers to each rank: world buffers of [HV, K, V + K], or of [HV, K, V] when no
    merge reads a transition (CPContext.maps_read)."""
    return ctx.world * HV * K * _exchange_width(ctx, K, V) * torch.tensor([], dtype=dtype).element_size()


def _exchange_width(ctx: CPContext, K: int, V: int) -> int:
    return V + K if ctx.maps_read else V


class _Cfg:
    """Everything about one call that is not a differentiable tensor."""

    __slots__ = ("variant", "gate_name", "scale", "chunk_size", "output_final_state", "compute", "state_dtype",
                 "ctx", "device", "fwd_method", "bwd_method", "H", "HV", "K", "V", "num_seqs", "has_h0",
                 "pending_check")


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
    stream made it."""
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
        _run(cfg, "forward", method or cfg.fwd_method, descs)
    if start is not None:
        _fold_start(ht, start, cfg.V)
    return ht


def _fold_start(X: torch.Tensor, start: torch.Tensor, V: int) -> None:
    """In place on maps X [P, HV, K, V + K]: piece 0 entered with `start` instead of 0, H_0 <- M_0 start + H_0
    (fp32, no TF32)."""
    with _no_tf32():
        X[0, :, :, :V] = torch.baddbmm(X[0, :, :, :V], X[0, :, :, V:], start.to(X.dtype))


def _cut_bounds(cfg: _Cfg, local_descs, n: int, pad: int):
    """Where the local tiled forward's state scan cuts the rank's local segment n (0: the first, -1: the
    last) into pieces (deltacp/cuda/api.h scan_pieces), as segment-relative bounds for the pre-pass; None
    when it does not cut it (or the local forward is not the tiled CUDA one). local_descs: the local
    forward's problem, the body [pad, T_local), whose sequence n is segment n (the first less the head
    piece [0, pad), which then is a piece of its own)."""
    if local_descs is None or cfg.fwd_method != "tiled" or cfg.device.type != "cuda" or \
            not hasattr(_core, "staged_forward_composed_map"):
        return None
    ctx = cfg.ctx
    n = n % ctx.num_local_seqs
    with torch.cuda.device(cfg.device):  # the plan reads the device's SM count
        body = list(_core.tiled_scan_pieces(cfg.variant, local_descs, n, chunk_size=cfg.chunk_size))
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
    with torch.cuda.device(X.device):
        _core.compose_state_maps(X.data_ptr(), X.shape[0], cfg.HV, cfg.K, cfg.V, width,
                                 0 if init is None else init.data_ptr(), out.data_ptr(), out.numel(),
                                 torch.cuda.current_stream(X.device).cuda_stream)
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


def _pieces_of_segment(cfg: _Cfg, run, xs, s0: int, s1: int, bounds, prepared: Optional[_PreparedForward]):
    """run(span tensors, span-relative bounds, staged or None) -> [P, ...] over the local segment [s0, s1)
    cut at `bounds`. With a prepared forward the pieces come from its stages; a head piece before its
    body (tokens [0, pad), a piece boundary by _piece_bounds) then runs on its own, like the local forward."""
    if prepared is None:
        return run(_split(xs, s0, s1), bounds, None)
    pad = prepared.pad
    if s0 >= pad:
        return run(_split(xs, s0, s1), bounds, (prepared.handle, s0 - pad))
    if pad not in bounds:
        raise ValueError("deltacp: internal: the pre-pass pieces do not start the body at the head piece's end")
    head = run(_split(xs, s0, pad), [0, pad], None)
    body = run(_split(xs, pad, s1), [x - pad for x in bounds if x >= pad], (prepared.handle, 0))
    return torch.cat([head, body])


def _staged_available(cfg: _Cfg, direction: str, q=None, g=None) -> bool:
    """The CP op runs the local tiled kernels in stages (deltacp/cuda/api.h StagedForward, StagedBackward):
    the stages that need no exchanged state while the exchange is pending, and the pre-pass from those
    same stages. DELTACP_CP_STAGED=0 switches it off (one-shot local kernels, separate pre-pass). The
    forward stages only where the pre-pass takes the tiled route (q, g: its inputs)."""
    flag = os.environ.get("DELTACP_CP_STAGED", "1").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"deltacp: environment variable 'DELTACP_CP_STAGED': expected 0 or 1, got {flag!r}")
    if not (flag == "1" and cfg.device.type == "cuda" and _core.built_with_cuda()):
        return False
    if direction == "backward":
        return cfg.bwd_method == "tiled" and hasattr(_core, "staged_backward_prepare")
    return (cfg.fwd_method == "tiled" and hasattr(_core, "staged_forward_prepare")
            and _prepass_route(cfg, "forward", q, g) == "chunked")


def _staged_call(cfg: _Cfg, fn, *args, **kwargs):
    with torch.cuda.device(cfg.device):
        stream = torch.cuda.current_stream(cfg.device).cuda_stream
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

    Why a quarter: on 2x H200 (bf16 GDN, H = 16, K = V = 128, a 32768-token span; docs/context-parallel.md)
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
        raise ValueError(f"deltacp: environment variable 'DELTACP_CP_PREPASS_PIECE': expected 0 (one piece) or "
                         f"a positive number of tokens per pre-pass piece, got {text!r}")
    return _round_up(piece, cfg.chunk_size)  # whole chunks


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ---------------------------------------------------------------------------------------------
# the exchange: pre-pass, all-gather, merge
# ---------------------------------------------------------------------------------------------
_PREPASS_MODES = ("auto", "chunked", "loops")
_TILED_MAX_WIDTH = 256  # the tiled tier's widest value dimension (kMaxHeadDim): V + K must fit
_TILED_PREPASS_UNFIT = set()  # (direction, variant, dtype, g dtype, K, V) whose tiled run did not fit the GPU


def _use_nccl_kernels(cfg: _Cfg) -> bool:
    return cfg.device.type == "cuda" and cfg.ctx.nccl is not None


def _prepass_mode() -> str:
    mode = os.environ.get("DELTACP_CP_PREPASS", "auto").strip().lower() or "auto"
    if mode not in _PREPASS_MODES:
        raise ValueError(f"deltacp: environment variable 'DELTACP_CP_PREPASS': expected one of {_PREPASS_MODES}, "
                         f"got {mode!r}")
    return mode


def _prepass_route(cfg: _Cfg, direction: str, q, g) -> str:
    """'chunked' (the state-only modes of the chunked kernels) or 'loops' (deltacp._cp_nccl's fp32 loops)."""
    if not _use_nccl_kernels(cfg):
        return "chunked"  # CPU tensors, or CUDA without deltacp._cp_nccl
    mode = _prepass_mode()
    if mode != "auto":
        return mode
    method = cfg.fwd_method if direction == "forward" else cfg.bwd_method
    key = (direction, cfg.variant, str(q.dtype), None if g is None else str(g.dtype), cfg.K, cfg.V)
    if method == "tiled" and cfg.V + cfg.K <= _TILED_MAX_WIDTH and key not in _TILED_PREPASS_UNFIT:
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
    _run(cfg, "forward", cfg.fwd_method, descs)
    return ht[0]


def _split(ts, s0, s1):
    return [_seg(t, s0, s1) for t in ts]


class _PieceMaps(NamedTuple):
    """The first segment's per-piece transitions, kept from the forward for the backward pre-pass."""
    bounds: list  # segment-relative piece boundaries (_piece_bounds), fixed at the forward
    M: torch.Tensor  # [P, HV, K, K] fp32: piece p's state transition


def _prepass_forward(cfg: _Cfg, q, k, v, g, beta, a, b, h0, want_first_maps: bool = False,
                     prepared: Optional[_PreparedForward] = None, local_descs=None):
    """(sent, first_maps). sent: [H_r | M_r] of the last local segment, or [0 | I] when it does not
    continue (nobody reads it); only [H_r] (resp. 0) when no merge reads a transition (ctx.maps_read).
    first_maps (when asked for, else None): the per-piece transitions
    [P, HV, K, K] of the FIRST local segment on the backward pre-pass's pieces, which that pre-pass then
    needs only dH from. They come free from the [H | M] pieces when the first segment is the last one, or
    where the local forward's scan cuts the first segment from its pass-1 maps (_first_segment_maps, on
    that cut's pieces), else from one K-column run (_transitions) while the rank waits for the all-gather.
    prepared: the rank's local forward prepared in stages; the pieces then reuse its stages.
    local_descs: the local forward's problem (the body); where its tiled state scan cuts the last segment
    into pieces (_cut_bounds), the pre-pass takes those pieces, and with `prepared` their maps come from
    the local forward's own pass 1 (made at prepare, which finish then uses): the pre-pass costs the local
    forward the last piece's map (in the same launch) and the composition."""
    ctx = cfg.ctx
    xs = (q, k, v, g, beta, a, b)
    first_maps = None
    if want_first_maps:
        f0, f1 = ctx.cu_seqlens_list[0], ctx.cu_seqlens_list[1]
        first_bounds = _piece_bounds(cfg, f1 - f0, _grid_pad(cfg))
    if not ctx.last_continues:
        zeros = torch.zeros((cfg.HV, cfg.K, cfg.V), dtype=cfg.state_dtype, device=cfg.device)
        sent = torch.cat([zeros, _identity_block(cfg)], dim=-1).contiguous()
    else:
        sent, first_maps = _prepass_forward_last(cfg, xs, h0, want_first_maps, prepared, local_descs)
    if want_first_maps and first_maps is None:
        first_maps = _first_segment_maps(cfg, xs, prepared, local_descs)
    if want_first_maps and first_maps is None:
        run = lambda span, bounds, staged: _transitions(cfg, *span, bounds, staged)  # noqa: E731
        first_maps = _PieceMaps(first_bounds, _pieces_of_segment(cfg, run, xs, f0, f1, first_bounds, prepared))
    return _narrow(cfg, sent), first_maps


def _local_piece_maps(cfg: _Cfg, prepared: _PreparedForward, n: int, P: int) -> torch.Tensor:
    """The prepared local forward's pass-1 maps of its sequence n (made at prepare, copied here):
    [P, HV, K, V + K] fp32, piece j's [H_j | M_j] from [0 | I] (deltacp/cuda/api.h forward_piece_maps)."""
    maps = torch.empty((P, cfg.HV, cfg.K, cfg.V + cfg.K), dtype=torch.float32, device=cfg.device)
    with torch.cuda.device(cfg.device):  # on the prepared forward's stream (the current one: maps' stream too)
        _core.staged_forward_piece_maps(prepared.handle, n, maps.data_ptr(), maps.numel())
    return maps


def _first_segment_maps(cfg: _Cfg, xs, prepared: Optional[_PreparedForward], local_descs) -> Optional[_PieceMaps]:
    """The first segment's per-piece transitions where the local forward's scan cuts it (_cut_bounds), on
    its pieces: the M columns of the prepared forward's pass-1 maps (a copy; no run at all), or without a
    prepared forward of one [H | M] run of those pieces (the same kernel's columns: the staged and one-shot
    CP ops then agree bitwise). None where the scan does not cut the first segment."""
    pad = _grid_pad(cfg)
    cut = _cut_bounds(cfg, local_descs, 0, pad)
    if cut is None:
        return None
    X = _cut_piece_maps(cfg, xs, prepared, 0, cut, pad)
    return _PieceMaps(cut, X[..., cfg.V:].contiguous())


def _head_piece_map(cfg: _Cfg, xs, pad: int) -> torch.Tensor:
    """The head piece [0, pad)'s [H | M] from [0 | I], [1, HV, K, V + K] fp32: a problem of its own, as in
    the local forward (_grid_pad)."""
    return _augmented_forward_pieces(cfg, *_split(xs, 0, pad), None, bounds=[0, pad], staged=None)


def _cut_piece_maps(cfg: _Cfg, xs, prepared: Optional[_PreparedForward], n: int, cut, pad: int) -> torch.Tensor:
    """Every piece's [H_p | M_p] from [0 | I] on the local forward's cut of local segment n (_cut_bounds; pad:
    the head piece's length, 0 unless n is the first segment), [P, HV, K, V + K] fp32: copied from the
    prepared forward's pass 1 (the head piece run on its own), or without one run here on the same pieces
    (the same kernel: the same bits)."""
    if prepared is None:
        s0, s1 = cfg.ctx.cu_seqlens_list[n], cfg.ctx.cu_seqlens_list[n + 1]
        return _augmented_forward_pieces(cfg, *_split(xs, s0, s1), None, bounds=cut, staged=None)
    X = _local_piece_maps(cfg, prepared, n, len(cut) - 1 - (1 if pad else 0))
    return torch.cat([_head_piece_map(cfg, xs, pad), X]) if pad else X


def _composed_local_maps(cfg: _Cfg, prepared: _PreparedForward, head: Optional[torch.Tensor],
                         start: Optional[torch.Tensor]) -> torch.Tensor:
    """The prepared local forward's pass-1 maps of its last sequence composed in one kernel (deltacp/cuda/api.h
    forward_composed_map), [HV, K, width] fp32 with width the exchange's (_exchange_width): [H | M], or the
    offset alone. Entered with the head piece's map `head` ([HV, K, V + K], when the segment has one), else
    with [start | I] (start: the sequence's initial state when it starts here), else with [0 | I]."""
    width, init, out = _composition_io(cfg, head, start)
    with torch.cuda.device(cfg.device):  # on the prepared forward's stream
        _core.staged_forward_composed_map(prepared.handle, cfg.ctx.num_local_seqs - 1,
                                          0 if init is None else init.data_ptr(), out.data_ptr(), width, out.numel())
    return out


def _narrow(cfg: _Cfg, sent: torch.Tensor) -> torch.Tensor:
    """What the all-gather carries of [X | M]: all of it, or X alone when no merge reads M (maps_read)."""
    width = _exchange_width(cfg.ctx, cfg.K, cfg.V)
    return sent if width == sent.shape[-1] else sent[..., :width].contiguous()


def _prepass_forward_last(cfg: _Cfg, xs, h0, want_first_maps: bool, prepared: Optional[_PreparedForward] = None,
                          local_descs=None):
    """_prepass_forward's [H_r | M_r] (and the first maps when the last segment is also the first)."""
    ctx = cfg.ctx
    s0, s1 = ctx.cu_seqlens_list[-2], ctx.cu_seqlens_list[-1]
    start = None
    if h0 is not None and ctx.starts_here[-1]:
        start = h0[ctx.seq_ids[-1]]
    span = _split(xs, s0, s1)
    pad = _grid_pad(cfg) if s0 == 0 else 0  # the last segment is also the first, continuing one
    maps = []

    def chunked():  # pieces on the one-device chunk grid (the head piece up to its first boundary first)
        keep_maps = want_first_maps and s0 == ctx.cu_seqlens_list[0]  # the same segment and pieces
        cut = _cut_bounds(cfg, local_descs, -1, _grid_pad(cfg))
        if cut is None:
            bounds = _piece_bounds(cfg, s1 - s0, pad)
            run = lambda sp, bd, staged: _augmented_forward_pieces(cfg, *sp, start, bounds=bd,  # noqa: E731
                                                                   staged=staged)
            X = _pieces_of_segment(cfg, run, xs, s0, s1, bounds, prepared)
            if keep_maps:
                maps.append(_PieceMaps(bounds, X[..., cfg.V:].clone()))
            if not ctx.maps_read:  # nothing reads the composed transition: the offset alone
                return _fold_offsets(X[..., :cfg.V], X[..., cfg.V:])
            return _fold_maps(X, cfg.V)
        # The local forward's own cut: its pieces' maps from [0 | I], composed from [start | I] in one kernel.
        if pad and start is not None:
            raise ValueError("deltacp: internal: a head piece in a segment that starts its sequence")
        if prepared is not None and not keep_maps:  # the local forward's pass 1 (finish reuses it): one launch
            head = _head_piece_map(cfg, xs, pad)[0] if pad else None
            return _composed_local_maps(cfg, prepared, head, start)
        # The same maps, copied since the backward keeps their transitions (or run, for a one-shot forward).
        X = _cut_piece_maps(cfg, xs, prepared, ctx.num_local_seqs - 1, cut, pad)
        if keep_maps:
            maps.append(_PieceMaps(cut, X[..., cfg.V:].clone()))
        return _compose_cut_maps(cfg, X, start, head=bool(pad))

    def loops():
        from . import nccl_backend

        return nccl_backend.prepass_forward(cfg, *span, start)

    sent = _prepass_chunked_or_loops(cfg, "forward", chunked, loops, xs[0], xs[3])
    return sent, (maps[0] if maps else None)


def _prepass_backward(cfg: _Cfg, q, k, v, g, beta, a, b, do, dht,
                      first_maps: Optional[_PieceMaps] = None, staged=None) -> torch.Tensor:
    """[dH_r | M_r^T] of the first local segment, or [0 | I] when it does not continue; only [dH_r] (resp. 0)
    when no merge reads a transition (ctx.maps_read).

    first_maps (from _prepass_forward): the segment's per-piece transitions; then only the pieces' dH_p
    are computed here (one dh0-only backward over V columns instead of V + K) and composed with M_p^T.
    staged (with first_maps): the rank's prepared local backward (_core.StagedBackward of the body
    [pad, T_local)); the body pieces' dH_p then come from its stages (B1 only), the head piece's alone."""
    return _narrow(cfg, _prepass_backward_wide(cfg, q, k, v, g, beta, a, b, do, dht, first_maps, staged))


def _prepass_backward_wide(cfg: _Cfg, q, k, v, g, beta, a, b, do, dht, first_maps, staged) -> torch.Tensor:
    ctx = cfg.ctx
    if not ctx.first_continues:
        zeros = torch.zeros((cfg.HV, cfg.K, cfg.V), dtype=cfg.state_dtype, device=cfg.device)
        return torch.cat([zeros, _identity_block(cfg)], dim=-1).contiguous()
    s0, s1 = ctx.cu_seqlens_list[0], ctx.cu_seqlens_list[1]
    # The rank holding the sequence's last token adds the user's dL/dht into its dH.
    dend = None
    if dht is not None and ctx.ends_here[0]:
        dend = dht[ctx.seq_ids[0]]
    xs = (q, k, v, g, beta, a, b)
    span = _split(xs, s0, s1)
    do_span = _seg(do, s0, s1)
    pad = _grid_pad(cfg)

    bounds = _piece_bounds(cfg, s1 - s0, pad)
    if first_maps is not None:  # the forward's pieces (whatever DELTACP_CP_PREPASS_PIECE says now)
        bounds = first_maps.bounds
        if bounds[-1] != s1 - s0 or first_maps.M.shape[0] != len(bounds) - 1:
            raise ValueError("deltacp: internal: the forward's pre-pass pieces do not match the first segment")
    dH = None
    if first_maps is not None and staged is not None:
        body_bounds = [x - pad for x in bounds if x >= pad]
        dH = _dh0_pieces(cfg, *_split(xs, pad, s1), _seg(do, pad, s1), dend, body_bounds, staged=staged)
        if pad:  # the head piece [0, pad) is a separate problem of its own (as in the local backward)
            dH = torch.cat([_dh0_pieces(cfg, *_split(xs, 0, pad), _seg(do, 0, pad), None, [0, pad]), dH])
    elif first_maps is not None:
        try:
            dH = _dh0_pieces(cfg, *span, do_span, dend, bounds)
        except ValueError as exc:  # a tiled launch that does not fit: the route below falls back
            if "shared memory" not in str(exc):
                raise
    if dH is not None:
        # backward order: the last piece's map is applied first; dS_start = M_p^T dS_end + dH_p
        Mt = first_maps.M.transpose(-1, -2)
        if not ctx.maps_read:  # nothing reads the composed transition: the offset alone
            return _fold_offsets(dH, Mt, reverse=True)
        H, Mt = _fold(dH.flip(0), Mt.flip(0))
        return torch.cat([H, Mt], dim=-1).contiguous()

    def chunked():  # pieces on the one-device chunk grid, as in the forward
        return _augmented_backward(cfg, *span, do_span, dend, bounds=bounds)

    def loops():
        from . import nccl_backend

        return nccl_backend.prepass_backward(cfg, *span, do_span, dend)

    return _prepass_chunked_or_loops(cfg, "backward", chunked, loops, q, g)


def _all_gather(cfg: _Cfg, x: torch.Tensor, what: str, wait: bool = True) -> torch.Tensor:
    """[world, HV, K, V + K]: every rank's buffer, in rank order. wait=False (deltacp's NCCL communicator):
    the host returns at once and the work enqueued next on the current stream runs after the collective on
    the GPU, with no idle gap while the host notices the completion and launches it; _confirm must follow
    (it raises CPTimeoutError if the collective did not complete in time). Elsewhere it always waits."""
    ctx = cfg.ctx
    x = x.contiguous()
    if _use_nccl_kernels(cfg):
        from . import nccl_backend

        return nccl_backend.all_gather(ctx, x, what, wait)
    out = torch.empty((ctx.world,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    if x.device.type == "cuda" and "nccl" in ctx.backend:
        work = dist.all_gather_into_tensor(out, x, group=ctx.group, async_op=True)
    else:
        work = dist.all_gather(list(out.unbind(0)), x, group=ctx.group, async_op=True)
    wait_collective(work, what, ctx.rank, ctx.timeout)
    return out


def _confirm(cfg: _Cfg, what: str, *buffers) -> None:
    """After _all_gather(wait=False): the collective completed within the timeout (else the error)."""
    if _use_nccl_kernels(cfg):
        from . import nccl_backend

        nccl_backend.confirm(cfg.ctx, what, *buffers)


@contextlib.contextmanager
def _until_confirmed(cfg: _Cfg, what: str, *buffers):
    """with _until_confirmed(cfg, what, sent, gathered): the work that reads an all-gather(wait=False)'s
    result, enqueued inside; on leaving, the collective is confirmed (_confirm: CPTimeoutError after the
    timeout). If the body raises, the collective is still waited for (its buffers quarantined if it failed)
    and the body's error propagates, so no buffer is freed while NCCL may still use it."""
    try:
        yield
    except BaseException:
        try:
            _confirm(cfg, what, *buffers)
        except Exception:  # noqa: BLE001 - the body's error is the one to report
            pass
        raise
    _confirm(cfg, what, *buffers)


def _finish_check(cfg: _Cfg) -> None:
    """The fingerprint check cp_apply started (agree_start) must pass before anything is exchanged."""
    pending, cfg.pending_check = getattr(cfg, "pending_check", None), None
    if pending is not None:
        agree_finish(pending)


def _merge_forward(cfg: _Cfg, gathered: torch.Tensor) -> torch.Tensor:
    """S = 0 folded through the earlier ranks: S <- M_j S + H_j, j = r - pre .. r - 1 (fp32 chain).
    Without transitions in the exchange (not maps_read) the fold is one rank's H: M_j multiplies 0."""
    ctx, V = cfg.ctx, cfg.V
    if ctx.pre_ranks == 0:
        return torch.zeros((cfg.HV, cfg.K, V), dtype=gathered.dtype, device=gathered.device)
    if gathered.shape[-1] == V:
        if ctx.pre_ranks > 1:
            raise ValueError("deltacp: internal: a merge over several ranks without their transitions")
        return gathered[ctx.rank - 1].clone()  # the backward keeps it: not a view pinning every rank's buffer
    if _use_nccl_kernels(cfg):
        from . import nccl_backend

        return nccl_backend.merge(cfg, gathered, ctx.rank - ctx.pre_ranks, ctx.rank, forward=True)
    earlier = gathered[ctx.rank - ctx.pre_ranks:ctx.rank]
    return _fold_offsets(earlier[..., :V], earlier[..., V:])


def _merge_backward(cfg: _Cfg, gathered: torch.Tensor) -> torch.Tensor:
    """dS = 0 folded from the later ranks down: dS <- M_j^T dS + dH_j, j = r + post .. r + 1.
    Without transitions in the exchange (not maps_read) the fold is one rank's dH."""
    ctx, V = cfg.ctx, cfg.V
    if ctx.post_ranks == 0:
        return torch.zeros((cfg.HV, cfg.K, V), dtype=gathered.dtype, device=gathered.device)
    if gathered.shape[-1] == V:
        if ctx.post_ranks > 1:
            raise ValueError("deltacp: internal: a merge over several ranks without their transitions")
        return gathered[ctx.rank + 1]
    if _use_nccl_kernels(cfg):
        from . import nccl_backend

        return nccl_backend.merge(cfg, gathered, ctx.rank + 1, ctx.rank + ctx.post_ranks + 1, forward=False)
    later = gathered[ctx.rank + 1:ctx.rank + ctx.post_ranks + 1]
    return _fold_offsets(later[..., :V], later[..., V:], reverse=True)


def _local_initial_states(cfg: _Cfg, h0, merged) -> Optional[torch.Tensor]:
    """[N_local, HV, K, V]: the merged state for a continuing first segment, the user's rows for
    the segments that start here (the seeds' expand_h0). None when all of them are zero."""
    ctx = cfg.ctx
    if h0 is None and merged is None:
        return None
    out = torch.zeros((ctx.num_local_seqs, cfg.HV, cfg.K, cfg.V), dtype=cfg.state_dtype, device=cfg.device)
    if h0 is not None:
        idx = [i for i in range(ctx.num_local_seqs) if ctx.starts_here[i]]
        if idx:
            out[_rows(out.device, idx)] = h0[_rows(h0.device, [ctx.seq_ids[i] for i in idx])]
    if merged is not None:
        out[0] = merged
    return out


class _CPFunction(torch.autograd.Function):
    """o, ht = CP(q, k, v, g, beta, a, b, h0) on rank-local tensors; backward mirrored."""

    @staticmethod
    def forward(ctx_, cfg: _Cfg, q, k, v, g, beta, a, b, h0):
        ctx = cfg.ctx
        # The local kernel runs over every local segment, after the head piece that re-aligns the chunk
        # grid with the one-device run's when the first segment continues mid-chunk (_grid_pad): the body
        # is [pad, T_local). With the staged tiled forward its stages that need no initial state run first,
        # and the pre-pass below reuses them; otherwise the whole local forward runs after the exchange.
        xs, T_loc = (q, k, v, g, beta, a, b), q.shape[1]
        o = torch.empty((1, T_loc, cfg.HV, cfg.V), dtype=q.dtype, device=q.device)
        pad = _grid_pad(cfg)
        cu, cu_host, body, o_body = ctx.cu_seqlens, ctx.cu_seqlens_cpu, xs, o
        if pad:
            cu, cu_host = _body_cu_seqlens(cfg, pad)
            body, o_body = _split(xs, pad, T_loc), o[:, pad:]
        descs = _descs(cfg, *body, cu=cu, cu_host=cu_host)
        descs["o"] = torch_desc(o_body, "o")
        ht_local = None
        if cfg.output_final_state:
            ht_local = torch.empty((ctx.num_local_seqs, cfg.HV, cfg.K, cfg.V), dtype=cfg.state_dtype,
                                   device=q.device)
            descs["ht"] = torch_desc(ht_local, "ht")
        prepared = None
        if _staged_available(cfg, "forward", q, g):
            handle = _staged_call(cfg, _core.staged_forward_prepare, cfg.variant, "tiled", descs)
            prepared = _PreparedForward(handle, pad)
        # 1-3: the state entering this rank's first segment.
        # The backward pre-pass's transitions are made here, where the rank waits for the all-gather.
        want_maps = (ctx.first_continues and any(ctx_.needs_input_grad[1:])
                     and _prepass_route(cfg, "backward", q, g) == "chunked")
        sent, first_maps = _prepass_forward(cfg, q, k, v, g, beta, a, b, h0, want_first_maps=want_maps,
                                            prepared=prepared, local_descs=descs)
        _finish_check(cfg)
        what = "the forward all-gather of [H | M]"
        gathered = _all_gather(cfg, sent, what, wait=False)
        with _until_confirmed(cfg, what, sent, gathered):
            last_stats["forward_bytes"] = gathered.numel() * gathered.element_size()
            merged = _merge_forward(cfg, gathered) if ctx.first_continues else None
            # 4: the local kernel from the merged state (the user's initial states for the other segments).
            h0_local = _local_initial_states(cfg, h0, merged)
            if pad:
                h0_local[0] = _head_forward(cfg, _split(xs, 0, pad), merged, o[:, :pad])
            if h0_local is not None:
                descs["h0"] = torch_desc(h0_local, "initial_state")
            if prepared is not None:
                _staged_call(cfg, _core.staged_forward_step, prepared.handle, "finish", cfg.variant, descs)
            else:
                _run(cfg, "forward", cfg.fwd_method, descs)
        ht = None
        if cfg.output_final_state:
            ht = torch.zeros((cfg.num_seqs, cfg.HV, cfg.K, cfg.V), dtype=cfg.state_dtype, device=q.device)
            idx = [i for i in range(ctx.num_local_seqs) if ctx.ends_here[i]]
            if idx:
                ht[_rows(ht.device, [ctx.seq_ids[i] for i in idx])] = ht_local[_rows(ht.device, idx)]
            for n in ctx.empty_seqs:  # an empty sequence's final state is its initial state
                if h0 is not None:
                    ht[n] = h0[n]
        ctx_.cfg = cfg
        ctx_.merged = merged  # the one initial state kept for the backward (compress_h0)
        ctx_.first_maps = first_maps  # _PieceMaps: the first segment's pieces and transitions (or None)
        ctx_.save_for_backward(q, k, v, g, beta, a, b, h0)
        ctx_.set_materialize_grads(False)
        return o, ht

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx_, do, dht):
        cfg: _Cfg = ctx_.cfg
        ctx = cfg.ctx
        q, k, v, g, beta, a, b, h0 = ctx_.saved_tensors
        if do is None:
            do = torch.zeros((1, q.shape[1], cfg.HV, cfg.V), dtype=q.dtype, device=q.device)
        if do.shape[-1] > 1 and do.stride(-1) != 1:
            do = do.contiguous()
        if dht is not None:
            dht = dht.to(cfg.state_dtype)
        # The local backward from the rebuilt initial states (expand_h0), on the same chunk grid as the
        # forward: the body [pad, T_local), then the head piece with the body's dL/d(its start state).
        # With the staged tiled backward its stages that need no dL/dS_end run first, before the exchange
        # (and the pre-pass reuses them); otherwise the whole local backward runs after it.
        xs, T_loc = (q, k, v, g, beta, a, b), q.shape[1]
        h0_local = _local_initial_states(cfg, h0, ctx_.merged)
        pad = _grid_pad(cfg)
        cu, cu_host, body, do_body = ctx.cu_seqlens, ctx.cu_seqlens_cpu, xs, do
        if pad:
            h0_local[0] = _head_forward(cfg, _split(xs, 0, pad), ctx_.merged, None)  # recomputed, not saved
            cu, cu_host = _body_cu_seqlens(cfg, pad)
            body, do_body = _split(xs, pad, T_loc), _seg(do, pad, T_loc)
        fields = (("q", q, "q"), ("k", k, "k"), ("v", v, "v"), ("g", g, cfg.gate_name), ("beta", beta, "beta"),
                  ("a", a, "a"), ("b", b, "b"))
        grads = {field: None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                 for field, t, _ in fields}

        def grad_descs(descs, s0, s1):
            for field, t, name in fields:
                if t is not None:
                    descs["d" + field] = torch_desc(_seg(grads[field], s0, s1), "d" + name)

        descs = _descs(cfg, *body, h0=h0_local, cu=cu, cu_host=cu_host)
        descs["dout"] = torch_desc(do_body, "do")
        grad_descs(descs, pad, T_loc)
        dh0_local = None
        if h0 is not None or pad:
            dh0_local = torch.empty((ctx.num_local_seqs, cfg.HV, cfg.K, cfg.V), dtype=cfg.state_dtype,
                                    device=q.device)
            descs["dh0"] = torch_desc(dh0_local, "dh0")
        staged, side = None, None
        if _staged_available(cfg, "backward"):
            staged = _staged_call(cfg, _core.staged_backward_prepare, cfg.variant, "tiled", descs)
            # The recompute's state scan is read only by finish's later stages. A rank whose pre-pass sends dH
            # from the prepared stages runs it on a side stream, beside that pre-pass, so its dH leaves sooner;
            # a rank that only waits runs it now.
            if ctx.first_continues and ctx_.first_maps is not None:
                main = torch.cuda.current_stream(cfg.device)
                side = torch.cuda.Stream(cfg.device)
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    _staged_call(cfg, _core.staged_backward_step, staged, "states", cfg.variant, {})
            else:
                _staged_call(cfg, _core.staged_backward_step, staged, "states", cfg.variant, {})
        try:
            # 1-3 mirrored: dL/dS at the end of this rank's last segment, from the later ranks.
            sent = _prepass_backward(cfg, q, k, v, g, beta, a, b, do, dht, first_maps=ctx_.first_maps,
                                     staged=staged)
            what = "the backward all-gather of [dH | M^T]"
            gathered = _all_gather(cfg, sent, what, wait=False)
            with _until_confirmed(cfg, what, sent, gathered):
                return _CPFunction._backward_finish(ctx_, cfg, xs, do, dht, h0, staged, side, descs, grads,
                                                    dh0_local, grad_descs, pad, gathered)
        finally:
            if side is not None:  # also on an error: nothing freed below may still be in use on the side stream
                torch.cuda.current_stream(cfg.device).wait_stream(side)

    @staticmethod
    def _backward_finish(ctx_, cfg: _Cfg, xs, do, dht, h0, staged, side, descs, grads, dh0_local, grad_descs, pad,
                         gathered):
        """After the backward all-gather was enqueued: merge, the local backward with dL/dS_end, dh0."""
        ctx = cfg.ctx
        q = xs[0]
        last_stats["backward_bytes"] = gathered.numel() * gathered.element_size()
        dS_last = _merge_backward(cfg, gathered) if ctx.last_continues else None
        dht_local = None
        if dht is not None or dS_last is not None:
            dht_local = torch.zeros((ctx.num_local_seqs, cfg.HV, cfg.K, cfg.V), dtype=cfg.state_dtype,
                                    device=q.device)
            if dht is not None:
                idx = [i for i in range(ctx.num_local_seqs) if ctx.ends_here[i]]
                if idx:
                    dht_local[_rows(dht.device, idx)] = dht[_rows(dht.device, [ctx.seq_ids[i] for i in idx])]
            if dS_last is not None:
                dht_local[-1] = dS_last
        if dht_local is not None:
            descs["dht"] = torch_desc(dht_local, "dht")
        if staged is not None:
            if side is not None:
                torch.cuda.current_stream(cfg.device).wait_stream(side)
            _staged_call(cfg, _core.staged_backward_step, staged, "finish", cfg.variant, descs)
        else:
            _run(cfg, "backward", cfg.bwd_method, descs)
        if pad:  # the head piece, from the merged state, with dL/d(its final state) = the body's dh0
            head_h0, head_dht = ctx_.merged.unsqueeze(0).contiguous(), dh0_local[0:1].contiguous()
            head = _descs(cfg, *_split(xs, 0, pad), h0=head_h0)
            head["dout"] = torch_desc(_seg(do, 0, pad), "do")
            head["dht"] = torch_desc(head_dht, "dht")
            grad_descs(head, 0, pad)
            _run(cfg, "backward", cfg.bwd_method, head)
        dh0 = None
        if h0 is not None:
            dh0 = torch.zeros_like(h0)
            idx = [i for i in range(ctx.num_local_seqs) if ctx.starts_here[i]]
            if idx:
                dh0[_rows(dh0.device, [ctx.seq_ids[i] for i in idx])] = dh0_local[_rows(dh0.device, idx)]
            for n in ctx.empty_seqs:  # an empty sequence passes dL/dht straight to dL/dh0
                if dht is not None:
                    dh0[n] = dht[n]
        return (None, grads["q"], grads["k"], grads["v"], grads["g"], grads["beta"], grads["a"], grads["b"], dh0)


# ---------------------------------------------------------------------------------------------
# argument checks and the public ops
# ---------------------------------------------------------------------------------------------
def _methods(variant: str, backend, device, needs_grad) -> Tuple[str, str]:
    if device.type == "cpu":
        if backend not in (None, "reference"):
            raise ValueError(f"deltacp: argument 'backend': context parallelism on CPU tensors runs the chunked "
                             f"reference; expected None or 'reference', got {backend!r}")
        return "chunked", "chunked"
    if device.type != "cuda":
        raise ValueError(f"deltacp: argument 'q': expected a CPU or CUDA tensor, got device {device}")
    if not _core.built_with_cuda():
        raise ValueError("deltacp: argument 'q': got CUDA tensors, but this deltacp was built without the CUDA tiers")
    tiers = _CUDA_TIERS if backend is None else (backend,)
    if backend is not None and backend not in _CUDA_TIERS:
        raise ValueError(f"deltacp: argument 'backend': expected None or one of {_CUDA_TIERS} for CUDA tensors, "
                         f"got {backend!r}")
    fwd = next((t for t in tiers if _core.cuda_supports(variant, t, False)), None)
    bwd = next((t for t in tiers if _core.cuda_supports(variant, t, True)), None)
    if fwd is None:
        raise ValueError(f"deltacp: argument 'backend': no CUDA tier among {tiers} implements variant '{variant}'")
    if needs_grad and bwd is None:
        raise ValueError(f"deltacp: argument 'backend': no CUDA tier among {tiers} implements the backward of "
                         f"variant '{variant}'")
    return fwd, bwd or fwd


def cp_apply(variant, q, k, v, g, beta, a, b, *, cp_context: CPContext, scale=None, initial_state=None,
             output_final_state=False, chunk_size=64, backend=None, use_qk_l2norm_in_kernel=False,
             gate_name="g", cu_seqlens=None):
    """The CP op for any variant (the public functions below fix the variant and argument names)."""
    ctx = cp_context
    if not isinstance(ctx, CPContext):
        raise TypeError(f"deltacp: argument 'cp_context': expected a deltacp.cp.CPContext (from "
                        f"deltacp.cp.build_context), got {type(ctx).__name__}")
    if cu_seqlens is not None:
        raise ValueError("deltacp: argument 'cu_seqlens': do not pass cu_seqlens with cp_context; the rank-local "
                         "offsets come from the context (build_context takes the global ones)")
    q = _tensor(q, "q")
    k = _tensor(k, "k", q)
    v = _tensor(v, "v", q)
    # The log decay may stay in float32 beside 16-bit q, k, v (as in the single-device ops).
    g = _tensor(g, gate_name, q, optional=True, allow_fp32=True)
    beta = _tensor(beta, "beta", q, optional=True)
    a = _tensor(a, "a", q, optional=True)
    b = _tensor(b, "b", q, optional=True)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"deltacp: argument 'scale': expected a float or None, got {type(scale).__name__}")
    if scale is not None and not math.isfinite(float(scale)):
        raise ValueError(f"deltacp: argument 'scale': expected a finite number, got {scale}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"deltacp: argument 'chunk_size': expected an int, got {type(chunk_size).__name__}")

    # Local checks first, then one fingerprint all-reduce so that every rank raises together.
    local_errors = {}
    if q.dim() != 4 or q.shape[0] != 1 or q.shape[1] != ctx.local_tokens:
        local_errors["q"] = (f"deltacp: argument 'q': expected this rank's slice [1, {ctx.local_tokens}, H, K] "
                             f"(rank {ctx.rank} holds global tokens [{ctx.begin}, {ctx.end})), got shape "
                             f"{list(q.shape)}")
    if v.dim() != 4:
        local_errors["v"] = f"deltacp: argument 'v': expected 4 dims [1, T_local, HV, V], got shape {list(v.shape)}"
    if q.device.type == "cuda" and ctx.device.type == "cuda" and q.device != ctx.device:
        local_errors["q"] = (f"deltacp: argument 'q': expected device {ctx.device} (the context's), got "
                             f"{q.device}")
    N = ctx.num_seqs
    h0 = None
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"deltacp: argument 'initial_state': expected a torch.Tensor, got "
                            f"{type(initial_state).__name__}")
        if initial_state.device != q.device:
            local_errors["initial_state"] = (f"deltacp: argument 'initial_state': expected device {q.device} "
                                             f"(like q), got {initial_state.device}")
        elif q.dim() == 4 and v.dim() == 4 and tuple(initial_state.shape) != (N, v.shape[2], q.shape[3],
                                                                            v.shape[3]):
            local_errors["initial_state"] = (f"deltacp: argument 'initial_state': expected [N, HV, K, V] = "
                                             f"{[N, v.shape[2], q.shape[3], v.shape[3]]} (N = the number of "
                                             f"GLOBAL sequences), got {list(initial_state.shape)}")
    fields = {
        "q": ("ok" if "q" not in local_errors else "bad", str(q.dtype), tuple(q.shape[2:]) if q.dim() == 4 else ()),
        "v": ("ok" if "v" not in local_errors else "bad", tuple(v.shape[2:]) if v.dim() == 4 else ()),
        gate_name: None if g is None else str(g.dtype),  # float32 or q's dtype, the same on every rank
        "variant": variant,
        "chunk_size": int(chunk_size),
        "scale": None if scale is None else float(scale),
        "initial_state": (initial_state is not None, "initial_state" in local_errors),
        "output_final_state": bool(output_final_state),
        "cu_seqlens": ctx.fingerprint,
        "backend": backend,
        "use_qk_l2norm_in_kernel": bool(use_qk_l2norm_in_kernel),
    }
    if local_errors:  # agree now, so that every rank raises together (naming this rank's problem here)
        try:
            agree(fields, ctx.group, ctx.rank, ctx.timeout, f"the CP {variant} forward", ctx=ctx)
        except ValueError as exc:
            name = str(exc).split("'")[1]
            if name in local_errors:
                raise ValueError(local_errors[name]) from exc
            raise
        raise ValueError(next(iter(local_errors.values())))
    # Started here, finished before the first exchange (_finish_check): the check overlaps the pre-pass.
    pending_check = agree_start(fields, ctx.group, ctx.rank, ctx.timeout, f"the CP {variant} forward", ctx=ctx)

    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    cfg = _Cfg()
    cfg.variant = variant
    cfg.gate_name = gate_name
    cfg.scale = None if scale is None else float(scale)
    cfg.chunk_size = int(chunk_size)
    cfg.output_final_state = bool(output_final_state)
    cfg.compute = "float64" if q.dtype == torch.float64 else "float32"
    cfg.state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    cfg.ctx = ctx
    cfg.device = q.device
    cfg.H, cfg.K = q.shape[2], q.shape[3]
    cfg.HV, cfg.V = v.shape[2], v.shape[3]
    cfg.num_seqs = N
    if initial_state is not None:
        h0 = initial_state.to(cfg.state_dtype).contiguous()
    cfg.has_h0 = h0 is not None
    cfg.pending_check = pending_check
    tensors = [t for t in (q, k, v, g, beta, a, b, h0) if t is not None]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    cfg.fwd_method, cfg.bwd_method = _methods(variant, backend, q.device, needs_grad)
    o, ht = _CPFunction.apply(cfg, q, k, v, g, beta, a, b, h0)
    return o, (ht if cfg.output_final_state else None)


def chunk_gated_delta_rule_cp(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                              output_final_state: bool = False, cu_seqlens=None, backend: Optional[str] = None, *,
                              cp_context: CPContext, chunk_size: int = 64, use_qk_l2norm_in_kernel: bool = False):
    """Gated DeltaNet under context parallelism: rank-local q, k [1, T_local, H, K], v [1, T_local, HV, V],
    g, beta [1, T_local, HV]; initial_state [N, HV, K, V] over the GLOBAL sequences. Returns (o_local,
    final_state [N, HV, K, V] with this rank's rows, or None)."""
    return cp_apply("gdn", q, k, v, g, beta, None, None, cp_context=cp_context, scale=scale,
                    initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size,
                    backend=backend, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def chunk_kda_cp(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                 output_final_state: bool = False, cu_seqlens=None, backend: Optional[str] = None, *,
                 cp_context: CPContext, chunk_size: int = 64, use_qk_l2norm_in_kernel: bool = False):
    """Kimi Delta Attention under context parallelism (g per key dim, [1, T_local, HV, K])."""
    return cp_apply("kda", q, k, v, g, beta, None, None, cp_context=cp_context, scale=scale,
                    initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size,
                    backend=backend, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def chunk_delta_rule_cp(q, k, v, beta, scale: Optional[float] = None, initial_state=None,
                        output_final_state: bool = False, cu_seqlens=None, backend: Optional[str] = None, *,
                        cp_context: CPContext, chunk_size: int = 64, use_qk_l2norm_in_kernel: bool = False):
    """DeltaNet (no gate) under context parallelism."""
    return cp_apply("delta", q, k, v, None, beta, None, None, cp_context=cp_context, scale=scale,
                    initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size,
                    backend=backend, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def chunk_dplr_cp(q, k, v, a, b, gk, scale: Optional[float] = None, initial_state=None,
                  output_final_state: bool = False, cu_seqlens=None, backend: Optional[str] = None, *,
                  cp_context: CPContext, chunk_size: int = 64):
    """DPLR (RWKV-7 family) under context parallelism: S <- diag(e^gk) S + k v^T + b (a^T S)."""
    return cp_apply("dplr", q, k, v, gk, None, a, b, cp_context=cp_context, scale=scale,
                    initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size,
                    backend=backend, gate_name="gk", cu_seqlens=cu_seqlens)
