"""deltacp.cp.plan — what a CP call computes once per problem and then reuses (the per-key plan cache).

Most of a CP forward's host work before its first launch does not depend on the tensors' values or
addresses: the argument checks, the call's configuration (_Cfg), the fingerprint hashes the ranks compare,
the CUDA tiers (cp/ops.py _methods), the head piece (_grid_pad), and the local forward's routing (the tier it
settles on, whether it runs in stages, the pre-pass's route, where it cuts its first and last segment). They
depend on the context, the problem's signature (each tensor's dtype, shape, strides and device; the
variant, the backend, the options; whether a gradient is wanted) and the DELTACP_* environment, so
cp_apply keys a _Plan on exactly those (key()) and keeps it in the context (CPContext.plans, a small LRU).

What stays per call: the pointers and the values. The settled tier depends on the pointers' alignment too
(the fused tier writes o in 16-byte pieces), and the pre-pass's route on which tiled pre-passes failed to
fit the GPU (local._TILED_PREPASS_UNFIT, which only grows): _Plan.routes keys the routing on both. The
collectives are never cached: every call makes the same fingerprint all-reduce and all-gather as before, so
a rank whose call hits its cache and one whose call misses still agree (and raise) together.

Only the public path (cp_apply and the forward it runs) uses a plan; the internal helpers called directly
(tests, benchmarks) take none and compute everything as before.
Imports: deltacp.cp.context, deltacp.cp.local.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

from .context import CPContext, Fingerprint
from .local import _TILED_PREPASS_UNFIT, _Cfg

MAX_PLANS = 16  # per context: a model has a few CP problem shapes (layers of a kind share one)
_MAX_ROUTES = 8  # per plan: alignment patterns of the pointers (normally one)

# The _Cfg fields a plan fixes; the rest (ctx, gate_range_check, gate_error, pending_check; plan) are per call.
_TEMPLATE = ("variant", "gate_name", "scale", "chunk_size", "output_final_state", "compute", "state_dtype",
             "device", "fwd_method", "bwd_method", "H", "HV", "K", "V", "num_seqs", "has_h0", "check_fields",
             "tier_why", "fwd_named", "needs_grad")


def env_fingerprint() -> tuple:
    """Every DELTACP_* variable of the environment, sorted. Any of them may steer a cached decision (the Python
    switches DELTACP_CP_STAGED, DELTACP_CP_STAGED_FUSED, DELTACP_CP_PREPASS, and the C++ planners' own, read by
    _core.cuda_forward_tier and _core.scan_pieces), so a change of any selects another plan. CPython keeps the
    environment's bytes in os.environ._data: scanning that takes a few microseconds, os.environ.items()
    (which decodes every entry) several times more."""
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict):
        return tuple(sorted(kv for kv in data.items() if kv[0][:8] in (b"DELTACP_", "DELTACP_")))
    return tuple(sorted(kv for kv in os.environ.items() if kv[0].startswith("DELTACP_")))


def _tensor_key(t):
    if t is None:
        return None
    return (t.dtype, t.shape, t.stride(), t.device)


def key(variant, q, k, v, g, beta, a, b, initial_state, scale, output_final_state, chunk_size, backend,
        use_qk_l2norm_in_kernel, gate_name, gate_check, gate_range_check, cu_seqlens):
    """The plan key of a call, or None when the call is not cached (an argument of a type the checks reject or
    convert: the call takes the full path, which raises or runs as always). Every check of cp_apply depends on
    these alone, so a key found in the cache is a validated one."""
    if cu_seqlens is not None:
        return None
    tensors = (q, k, v, g, beta, a, b, initial_state)
    for i, t in enumerate(tensors):
        if not (isinstance(t, torch.Tensor) or (t is None and i >= 3)):
            return None
    if type(chunk_size) is not int or not (scale is None or type(scale) in (float, int)):
        return None
    if not all(type(x) is bool for x in (output_final_state, use_qk_l2norm_in_kernel, gate_check)):
        return None
    if not (backend is None or type(backend) is str) or type(gate_name) is not str:
        return None
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    return (variant, gate_name, backend, chunk_size, None if scale is None else (type(scale), scale),
            output_final_state, use_qk_l2norm_in_kernel, gate_check, gate_range_check is not None, needs_grad,
            env_fingerprint()) + tuple(_tensor_key(t) for t in tensors)


def lookup(ctx: CPContext, k):
    """The plan of key k in ctx's cache (most recently used last), or None."""
    if k is None:
        return None
    plan = ctx.plans.get(k)
    if plan is not None:
        ctx.plans.move_to_end(k)
    return plan


def store(ctx: CPContext, k, plan) -> None:
    if k is None:
        return
    ctx.plans[k] = plan
    while len(ctx.plans) > MAX_PLANS:
        ctx.plans.popitem(last=False)


class Routes:
    """The local forward's decisions for one settled problem (autograd._cp_forward fills them on first use):
    tier  () when _settle_forward_tier kept the tier, else (fwd_method, tier_why) it settled on;
    staged  _staged_available(cfg, "forward", ...); route_bwd  _prepass_route(cfg, "backward", ...);
    cuts  {(segment, pad): _cut_bounds(...)}, where the local forward cuts its first (0) and last (-1) segment."""
    __slots__ = ("tier", "staged", "route_bwd", "cuts")

    def __init__(self):
        self.tier = self.staged = self.route_bwd = None
        self.cuts = {}


class Plan:
    """One validated CP problem: the _Cfg template cp_apply copies per call, the fingerprint hashes, and the
    local forward's head piece (pads) and routing (routes)."""
    __slots__ = ("template", "pads", "_routes")

    def __init__(self, cfg: _Cfg):
        self.template = tuple((name, getattr(cfg, name)) for name in _TEMPLATE)
        self.pads = {}  # fwd_method -> _grid_pad
        self._routes = OrderedDict()

    def cfg(self, ctx: CPContext, gate_range_check) -> _Cfg:
        """A fresh _Cfg of this problem for one call (the call's own fields set, the rest from the template)."""
        cfg = _Cfg()
        for name, value in self.template:
            setattr(cfg, name, value)
        cfg.ctx, cfg.gate_range_check, cfg.pending_check, cfg.gate_error = ctx, gate_range_check, None, None
        cfg.plan = self  # (not in the template: a plan holds no reference to itself, nor to the context)
        return cfg

    def routes(self, cfg: _Cfg, descs: dict) -> Routes:
        """The Routes of the local forward described by descs: keyed on the tiers (dplr picks them per call
        from the gates' values) and on what the decisions read beyond the plan's key (each pointer's alignment
        modulo 16 bytes, the largest any tier asks for; the tiled pre-passes known not to fit the GPU)."""
        k = (cfg.fwd_method, cfg.bwd_method, tuple(d[0] % 16 for d in descs.values()), len(_TILED_PREPASS_UNFIT))
        routes = self._routes.get(k)
        if routes is None:
            routes = self._routes[k] = Routes()
            while len(self._routes) > _MAX_ROUTES:
                self._routes.popitem(last=False)
        return routes


def fingerprint(fields: dict, gate_name: str, gate_checked: bool) -> Fingerprint:
    """The ranks' fingerprint of cp_apply's fields (context.Fingerprint), hashed once per plan."""
    return Fingerprint(fields, gate_name if gate_checked else None)
