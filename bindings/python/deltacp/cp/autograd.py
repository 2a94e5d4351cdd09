"""deltacp.cp.autograd — the CP op as one torch.autograd.Function: the forward (pre-pass, exchange,
merge, local forward, overlapped where the staged tiled tier runs) and its mirrored backward.
Imports: deltacp.cp.exchange and below.
"""

from __future__ import annotations


import torch

from .. import _core
from .._calls import _run
from .._describe import torch_desc
from .._stream import on_device
from .exchange import (_all_gather, _finish_check, last_stats, _local_initial_states, _merge_backward, _merge_forward,
                       _prepass_backward, _prepass_forward, _start_check, _until_confirmed)
from .local import (_body_cu_seqlens, _Cfg, _descs, _grid_pad, _head_forward, _PreparedForward, _prepass_route, _rows,
                    _seg, _split, _staged_available, _staged_call)


def _settle_forward_tier(cfg: _Cfg, descs: dict) -> None:
    """The fused tier implements the variant (deltacp.cp.ops._methods) but may refuse this rank's problem
    (dtype, K, V, alignment, a GPU other than compute capability 9.0): unless it was asked for by name, the
    local forward then takes the tier the single-device dispatch picks for the same problem, and
    last_stats["local_tier"] says which and why."""
    if cfg.fwd_method != "fused" or cfg.fwd_named or cfg.device.type != "cuda" or \
            not hasattr(_core, "cuda_forward_tier"):
        return
    with on_device(cfg.device):
        tier, why = _core.cuda_forward_tier(cfg.variant, descs, cfg.scale, cfg.chunk_size)
    if tier != "fused":
        cfg.fwd_method, cfg.tier_why = tier, why
        last_stats["local_tier"] = {"forward": cfg.fwd_method, "backward": cfg.bwd_method, "why": cfg.tier_why}


_SIDE_STREAMS = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The staged backward's side stream on `device`, one kept for every call. The state scan allocates its three
    workspaces (the pieces' maps, starts and fold tables: cuda/tiled/scan_split.cu) on the stream it runs on;
    torch's caching allocator keeps a freed block for later work on that stream alone, and torch.cuda.Stream()
    hands out the next of its pool's 32 streams. With a new stream per call the blocks were never found again:
    on 2 x H100 under torch.profiler the rank that runs the scan there made 3 cudaMalloc per GDN or KDA CP
    training step (0.48 and 0.73 ms of host time per step), and each pool stream kept its own copies."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(torch.device("cuda", index))
    return _SIDE_STREAMS[index]


def _settle(cfg: _Cfg, descs: dict, routes) -> None:
    """_settle_forward_tier, its outcome kept in the problem's routes (deltacp/cp/plan.py) when given: the
    same changes to cfg and last_stats as the call would make."""
    if routes is None:
        _settle_forward_tier(cfg, descs)
    elif routes.tier is None:
        before = cfg.fwd_method
        _settle_forward_tier(cfg, descs)
        routes.tier = (cfg.fwd_method, cfg.tier_why) if cfg.fwd_method != before else ()
    elif routes.tier:
        cfg.fwd_method, cfg.tier_why = routes.tier
        last_stats["local_tier"] = {"forward": cfg.fwd_method, "backward": cfg.bwd_method, "why": cfg.tier_why}


def _cp_forward(cfg: _Cfg, q, k, v, g, beta, a, b, h0, needs_input_grad=None):
    """The CP forward: (o, ht, merged, first_maps), the last two for the backward (_CPFunction). Called by
    _CPFunction.forward when a gradient is wanted, else directly by cp_apply (no autograd node: nothing to
    save, and none of the Function's bookkeeping on the host path). needs_input_grad: the Function's (None
    without one: then cfg.needs_grad is False and no backward pre-pass maps are made)."""
    ctx = cfg.ctx
    plan = getattr(cfg, "plan", None)  # the problem's cached decisions (cp_apply), or none (direct callers)
    # The local kernel runs over every local segment, after the head piece that re-aligns the chunk
    # grid with the one-device run's when the first segment continues mid-chunk (_grid_pad): the body
    # is [pad, T_local). With the staged tiled forward its stages that need no initial state run first,
    # and the pre-pass below reuses them; otherwise the whole local forward runs after the exchange.
    xs, T_loc = (q, k, v, g, beta, a, b), q.shape[1]
    o = torch.empty((1, T_loc, cfg.HV, cfg.V), dtype=q.dtype, device=q.device)
    if plan is None:
        pad = _grid_pad(cfg)
    else:
        pad = plan.pads.get(cfg.fwd_method)
        if pad is None:
            pad = plan.pads[cfg.fwd_method] = _grid_pad(cfg)
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
    routes = None if plan is None else plan.routes(cfg, descs)
    _settle(cfg, descs, routes)
    prepared = None
    if routes is None:
        staged = _staged_available(cfg, "forward", q, g)
    else:
        if routes.staged is None:
            routes.staged = _staged_available(cfg, "forward", q, g)
        staged = routes.staged
    qk_l2norm = getattr(cfg, "qk_l2norm", False)
    if qk_l2norm and cfg.fwd_method != "fused":  # the fused tier refused the problem (_settle)
        staged = False  # the tiled stages read q and k as given; one-shot, the dispatch normalises them first
        last_stats["qk_l2norm"] = "one pass"  # into workspace (cuda/dispatch.cu run_forward_on_normalised)
    if staged:
        handle = _staged_call(cfg, _core.staged_forward_prepare, cfg.variant, cfg.fwd_method, descs,
                              qk_unit_rows=getattr(cfg, "qk_unit_rows", False), qk_l2norm=qk_l2norm,
                              backward_recomputes=bool(getattr(cfg, "needs_grad", False)))
        prepared = _PreparedForward(handle, pad, cfg.fwd_method)
    _start_check(cfg)
    # 1-3: the state entering this rank's first segment.
    # The backward pre-pass's transitions are made here, where the rank waits for the all-gather; only
    # when a backward can follow. needs_input_grad says which inputs require grad even under torch.no_grad(),
    # where no backward follows: an inference call on such tensors made the maps for nothing (on 2 x H100,
    # gdn at 32K tokens per rank, the second rank's pre-pass then took 0.41 ms of host time, the first's 0.15).
    want_maps = cfg.needs_grad and ctx.first_continues and any(needs_input_grad[1:])
    if want_maps:
        if routes is None:
            want_maps = _prepass_route(cfg, "backward", q, g) == "chunked"
        else:
            if routes.route_bwd is None:
                routes.route_bwd = _prepass_route(cfg, "backward", q, g)
            want_maps = routes.route_bwd == "chunked"
    sent, first_maps = _prepass_forward(cfg, q, k, v, g, beta, a, b, h0, want_first_maps=want_maps,
                                        prepared=prepared, local_descs=descs,
                                        cuts=None if routes is None else routes.cuts)
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
    return o, ht, merged, first_maps


class _CPFunction(torch.autograd.Function):
    """o, ht = CP(q, k, v, g, beta, a, b, h0) on rank-local tensors; backward mirrored."""

    @staticmethod
    def forward(ctx_, cfg: _Cfg, q, k, v, g, beta, a, b, h0):
        o, ht, merged, first_maps = _cp_forward(cfg, q, k, v, g, beta, a, b, h0, ctx_.needs_input_grad)
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
            staged = _staged_call(cfg, _core.staged_backward_prepare, cfg.variant, "tiled", descs,
                                  qk_unit_rows=getattr(cfg, "qk_unit_rows", False))
            # The recompute's state scan is read only by finish's later stages. A rank whose pre-pass sends dH
            # from the prepared stages runs it on a side stream, beside that pre-pass, so its dH leaves sooner;
            # a rank that only waits runs it now.
            if ctx.first_continues and ctx_.first_maps is not None:
                main = torch.cuda.current_stream(cfg.device)
                side = _side_stream(cfg.device)
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
