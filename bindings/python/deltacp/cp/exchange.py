"""deltacp.cp.exchange — the CP exchange: pre-pass, all-gather, merge (docs/design.md section 4).

The pre-pass (each rank's [H_r | M_r] over its last local segment, or [dH_r | M_r^T] over its first,
from the local pass's pieces where the staged tiled tier ran them), the route it takes (tiled state-only
modes, the fp32 loop kernels of deltacp._cp_nccl, the chunked reference), the all-gather on the context's
group or deltacp's NCCL communicator (asynchronous where that communicator runs it, confirmed before the
op returns), and the merges S <- M_j S + H_j (forward) and dS <- M_j^T dS + dH_j (backward).
Imports: deltacp.cp.local and below.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .. import _core
from .._stream import on_device
from ..errors import InvalidArgumentError
from ..fla_options import l2norm as _l2norm
from .context import CPContext, agree_finish, agree_start_values, wait_collective
from .local import (_augmented_backward, _augmented_forward_pieces, _Cfg, _compose_cut_maps, _composition_io,
                    _cut_bounds, _dh0_pieces, _exchange_width, _fold, _fold_maps, _fold_offsets, _grid_pad,
                    _identity_block, _piece_bounds, _pieces_of_segment, _PreparedForward, _prepass_chunked_or_loops,
                    _rows, _seg, _split, _transitions, _use_nccl_kernels)

# Filled by each call (for the examples' tables): bytes received by the all-gathers, per direction; and
# "local_tier", the tiers this rank's local pass runs and why ({"forward", "backward", "why"}; set by cp_apply);
# "qk_l2norm", where use_qk_l2norm_in_kernel normalised q and k ("in kernel", "one pass" or None; set by cp_apply).
last_stats = {"forward_bytes": 0, "backward_bytes": 0}


def exchange_bytes(ctx: CPContext, HV: int, K: int, V: int, dtype=torch.float32) -> int:
    """Bytes one all-gather delivers to each rank: world buffers of [HV, K, V + K], or of [HV, K, V] when no
    merge reads a transition (CPContext.maps_read)."""
    return ctx.world * HV * K * _exchange_width(ctx, K, V) * torch.tensor([], dtype=dtype).element_size()






class _PieceMaps(NamedTuple):
    """The first segment's per-piece transitions, kept from the forward for the backward pre-pass."""
    bounds: list  # segment-relative piece boundaries (_piece_bounds), fixed at the forward
    M: torch.Tensor  # [P, HV, K, K] fp32: piece p's state transition


def _prepass_forward(cfg: _Cfg, q, k, v, g, beta, a, b, h0, want_first_maps: bool = False,
                     prepared: Optional[_PreparedForward] = None, local_descs=None, cuts: Optional[dict] = None):
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
    forward the last piece's map (in the same launch) and the composition.
    cuts: where the local forward's cuts are kept between calls of one problem (_cut), or None."""
    ctx = cfg.ctx
    xs = (q, k, v, g, beta, a, b)
    first_maps = None
    if want_first_maps:
        f0, f1 = ctx.cu_seqlens_list[0], ctx.cu_seqlens_list[1]
        first_bounds = _piece_bounds(cfg, f1 - f0, _grid_pad(cfg))
    if not ctx.last_continues:  # [0 | I] at the exchange's width (0 alone where no merge reads M): nobody reads it
        sent = torch.zeros((cfg.HV, cfg.K, _exchange_width(ctx, cfg.K, cfg.V)), dtype=cfg.state_dtype,
                           device=cfg.device)
        if sent.shape[-1] > cfg.V:
            sent[..., cfg.V:] = _identity_block(cfg)
    else:
        sent, first_maps = _prepass_forward_last(cfg, xs, h0, want_first_maps, prepared, local_descs, cuts)
    if want_first_maps and first_maps is None:
        first_maps = _first_segment_maps(cfg, xs, prepared, local_descs, cuts)
    if want_first_maps and first_maps is None:
        run = lambda span, bounds, staged: _transitions(cfg, *span, bounds, staged)  # noqa: E731
        first_maps = _PieceMaps(first_bounds, _pieces_of_segment(cfg, run, xs, f0, f1, first_bounds, prepared))
    return _narrow(cfg, sent), first_maps


def _local_piece_maps(cfg: _Cfg, prepared: _PreparedForward, n: int, P: int) -> torch.Tensor:
    """The prepared local forward's pass-1 maps of its sequence n (made at prepare, copied here):
    [P, HV, K, V + K] fp32, piece j's [H_j | M_j] from [0 | I] (deltacp/cuda/api.h forward_piece_maps)."""
    maps = torch.empty((P, cfg.HV, cfg.K, cfg.V + cfg.K), dtype=torch.float32, device=cfg.device)
    with on_device(cfg.device):  # on the prepared forward's stream (the current one: maps' stream too)
        _core.staged_forward_piece_maps(prepared.handle, n, maps.data_ptr(), maps.numel())
    return maps


def _cut(cfg: _Cfg, local_descs, n: int, pad: int, cuts: Optional[dict]):
    """_cut_bounds, kept in `cuts` (a plan's, deltacp/cp/plan.py Routes.cuts) when given: the cut depends only on
    the problem, the tier and the environment, which the plan's key fixes, and planning it (_core.scan_pieces)
    is the pre-pass's largest host cost. A fresh list each time (callers keep it in _PieceMaps)."""
    if cuts is None:
        return _cut_bounds(cfg, local_descs, n, pad)
    if (n, pad) not in cuts:
        cuts[(n, pad)] = _cut_bounds(cfg, local_descs, n, pad)
    cut = cuts[(n, pad)]
    return None if cut is None else list(cut)


def _first_segment_maps(cfg: _Cfg, xs, prepared: Optional[_PreparedForward], local_descs,
                        cuts: Optional[dict] = None) -> Optional[_PieceMaps]:
    """The first segment's per-piece transitions where the local forward's scan cuts it (_cut_bounds), on
    its pieces: the M columns of the prepared forward's pass-1 maps (a copy; no run at all), or without a
    prepared forward of one [H | M] run of those pieces (the same kernel's columns: the staged and one-shot
    CP ops then agree bitwise). None where the scan does not cut the first segment."""
    pad = _grid_pad(cfg)
    cut = _cut(cfg, local_descs, 0, pad, cuts)
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
    with on_device(cfg.device):  # on the prepared forward's stream
        _core.staged_forward_composed_map(prepared.handle, cfg.ctx.num_local_seqs - 1,
                                          0 if init is None else init.data_ptr(), out.data_ptr(), width, out.numel())
    return out


def _narrow(cfg: _Cfg, sent: torch.Tensor) -> torch.Tensor:
    """What the all-gather carries of [X | M]: all of it, or X alone when no merge reads M (maps_read)."""
    width = _exchange_width(cfg.ctx, cfg.K, cfg.V)
    return sent if width == sent.shape[-1] else sent[..., :width].contiguous()


def _prepass_forward_last(cfg: _Cfg, xs, h0, want_first_maps: bool, prepared: Optional[_PreparedForward] = None,
                          local_descs=None, cuts: Optional[dict] = None):
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
        cut = _cut(cfg, local_descs, -1, _grid_pad(cfg), cuts)
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

        sp = list(span)
        if getattr(cfg, "qk_l2norm", False):  # the fp32 loop kernels read q and k as given
            sp[0], sp[1] = _l2norm(sp[0]), _l2norm(sp[1])
        return nccl_backend.prepass_forward(cfg, *sp, start)

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


def _start_check(cfg: _Cfg) -> None:
    """The ranks' fingerprint check of cp_apply's fields (agree_start), started once the forward has enqueued
    the local work that needs no exchange: the host's NCCL enqueue then overlaps that work instead of delaying
    its launch. cfg.check_fields: the fields' hashes (a context.Fingerprint, made once per problem by cp_apply).
    The gate range check's outcome (safe_gate) joins the gate's field here."""
    gate = cfg.gate_range_check
    cfg.gate_error = None
    outcome = None
    if gate is not None:
        cfg.gate_error = gate.error()
        outcome = "in range" if cfg.gate_error is None else "out of range"
    ctx = cfg.ctx
    cfg.pending_check = agree_start_values(cfg.check_fields.values(outcome), ctx.group, ctx.rank, ctx.timeout,
                                          f"the CP {cfg.variant} forward", ctx=ctx)


def _finish_check(cfg: _Cfg) -> None:
    """The fingerprint check (_start_check) must pass before anything is exchanged. A broken safe_gate promise
    raises on every rank: its message where it broke, the ranks' disagreement on the gate elsewhere."""
    pending, cfg.pending_check = cfg.pending_check, None
    if pending is None:
        return
    try:
        agree_finish(pending)
    except InvalidArgumentError as exc:
        if cfg.gate_error is not None:
            raise InvalidArgumentError(cfg.gate_error) from exc
        raise
    if cfg.gate_error is not None:  # broken on every rank
        raise InvalidArgumentError(cfg.gate_error)


def _merge_forward(cfg: _Cfg, gathered: torch.Tensor) -> torch.Tensor:
    """S = 0 folded through the earlier ranks: S <- M_j S + H_j, j = r - pre .. r - 1 (fp32 chain).
    Without transitions in the exchange (not maps_read) the fold is one rank's H: M_j multiplies 0."""
    ctx, V = cfg.ctx, cfg.V
    if ctx.pre_ranks == 0:
        return torch.zeros((cfg.HV, cfg.K, V), dtype=gathered.dtype, device=gathered.device)
    if gathered.shape[-1] == V:
        if ctx.pre_ranks > 1:
            raise ValueError("deltacp: internal: a merge over several ranks without their transitions")
        if not getattr(cfg, "needs_grad", True):  # no backward keeps it
            return gathered[ctx.rank - 1]
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
