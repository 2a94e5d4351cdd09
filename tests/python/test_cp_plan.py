"""The CP op's per-problem plan cache (deltacp/cp/plan.py), the no-grad call without an autograd node, and
safe_gate's ring of pinned buffers (deltacp/_library.py _GateRing).

Checked on 2 gloo processes (CPU, and GPU 0 shared by both where CUDA is here):
  * a second identical call reuses the plan: no _methods, no fingerprint hashing, no tier settling, no cut
    planning (_cut_bounds; _core.scan_pieces on CUDA), and gives the first call's o, ht and gradients bit for
    bit, as does a fresh context;
  * a DELTACP_* change selects another plan (and an invalid switch still raises on every rank), as does a
    change of dtype or of an option; the cache stays bounded;
  * without a gradient (torch.no_grad(), inference mode, or no input requiring one) no autograd node is made;
  * errors are unchanged when one rank's call hits its cache and the other's does not (the ranks still make
    the same collectives and raise together, naming the argument);
  * safe_gate: a check read after its slot was reused still reports its own values; a slot whose copy is in
    flight is not reused.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from deltacp_testutil import launch_workers  # noqa: E402

THIS = Path(__file__).resolve()


# ---------------------------------------------------------------------------------------------
# the worker (this file run as a script in each rank's process)
# ---------------------------------------------------------------------------------------------
class _Counts:
    """Counts calls of module attributes, replaced by counting wrappers (restored by undo())."""

    def __init__(self):
        self.n, self._saved = {}, []

    def wrap(self, mod, name, label=None):
        label = label or name
        fn = getattr(mod, name)
        self.n.setdefault(label, 0)

        def counted(*args, **kwargs):
            self.n[label] += 1
            return fn(*args, **kwargs)

        self._saved.append((mod, name, fn))
        setattr(mod, name, counted)

    def take(self) -> dict:
        out = dict(self.n)
        for key in self.n:
            self.n[key] = 0
        return out

    def undo(self):
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)


def _dtypes(device):
    """(the scenarios' dtype, another one the tiers on `device` take): on CUDA bf16 with K = V = 128, the fused
    tier's problem on a compute capability 9.0 GPU (float32 takes the tiled tier there)."""
    return (torch.float32, torch.float64) if device.type == "cpu" else (torch.bfloat16, torch.float32)


def _inputs(world, device, dtype=None, variant="gdn"):
    import torch.nn.functional as F

    dtype = dtype or _dtypes(device)[0]
    gen = torch.Generator().manual_seed(7)
    T = 40 * world
    cu = [0, 9, T - 5, T]  # the middle sequence spans every rank; rank cuts inside chunks of 16
    H, K, V = (2, 16, 16) if device.type == "cpu" else (2, 128, 128)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = {"q": rnd(1, T, H, K), "k": F.normalize(rnd(1, T, H, K), dim=-1), "v": rnd(1, T, H, V),
         "beta": torch.sigmoid(rnd(1, T, H))}
    x["g"] = F.logsigmoid(rnd(1, T, H, K) + 2.0) if variant == "kda" else F.logsigmoid(rnd(1, T, H) + 2.0)
    x = {n: t.to(device=device, dtype=dtype) for n, t in x.items()}
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    x["h0"] = (rnd(len(cu) - 1, H, K, V) * 0.5).to(device=device, dtype=sdt)
    return cu, x


def _local(x, ctx, grad=True):
    import deltacp.cp as cp

    out = {n: (t if n == "h0" else cp.split_even(t, ctx)).detach().clone() for n, t in x.items()}
    if grad:
        for t in out.values():
            t.requires_grad_()
    return out


def _gdn(loc, ctx, **kw):
    import deltacp.cp as cp

    kw.setdefault("output_final_state", True)
    kw.setdefault("chunk_size", 16)
    return cp.chunk_gated_delta_rule_cp(loc["q"], loc["k"], loc["v"], loc["g"], loc["beta"], cp_context=ctx,
                                        initial_state=loc["h0"], **kw)


def _train(x, ctx, **kw):
    """o, ht and every gradient of one CP call with a backward."""
    loc = _local(x, ctx)
    o, ht = _gdn(loc, ctx, **kw)
    ((o.double() ** 2).sum() + (ht.double() ** 2).sum()).backward()
    return [o.detach(), ht.detach()] + [loc[n].grad for n in sorted(loc)]


def _same(a, b) -> bool:
    return all(torch.equal(s, t) for s, t in zip(a, b)) and len(a) == len(b)


def _error(fn) -> dict:
    try:
        fn()
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"raised": type(exc).__name__, "is_value_error": isinstance(exc, ValueError), "message": str(exc)}


def _scenarios(rank, world, device) -> dict:
    import deltacp
    import deltacp.cp as cp
    from deltacp import _core
    from deltacp.cp import autograd as cp_autograd
    from deltacp.cp import context as cp_context
    from deltacp.cp import exchange as cp_exchange
    from deltacp.cp import ops as cp_ops
    from deltacp.cp import plan as cp_plan

    rep = {}
    counts = _Counts()
    counts.wrap(cp_ops, "_methods")
    counts.wrap(cp_exchange, "_cut_bounds")
    counts.wrap(cp_autograd, "_settle_forward_tier")
    counts.wrap(cp_context, "_hash62")
    if hasattr(_core, "scan_pieces"):
        counts.wrap(_core, "scan_pieces")
    applied = []

    class CountedFunction:  # cp_apply's autograd Function, counting the nodes it makes
        @staticmethod
        def apply(*args):
            applied.append(1)
            return cp_autograd._CPFunction.apply(*args)

    cp_ops._CPFunction = CountedFunction
    use_nccl = False  # gloo on both devices (the NCCL communicator cannot put two ranks on one GPU)
    cu, x = _inputs(world, device)
    ctx = cp.build_context(cu, device=device, timeout=60, use_nccl=use_nccl)
    counts.take()

    # hit: the second identical call computes nothing the first computed, and both equal a fresh context's call
    first = _train(x, ctx)
    rep["first"] = counts.take()
    second = _train(x, ctx)
    rep["second"] = counts.take()
    fresh = _train(x, cp.build_context(cu, device=device, timeout=60, use_nccl=use_nccl))
    counts.take()
    rep["hit_same"] = _same(first, second) and _same(first, fresh)
    rep["plans_after_hit"] = len(ctx.plans)

    # env: another DELTACP_* value, another plan; back to the first one, a hit
    os.environ["DELTACP_CP_PREPASS_PIECE"] = "16"
    try:
        piece = _train(x, ctx)
        rep["env_changed"] = counts.take()
        rep["plans_after_env"] = len(ctx.plans)
        piece_fresh = _train(x, cp.build_context(cu, device=device, timeout=60, use_nccl=use_nccl))
        counts.take()
        rep["env_same_as_fresh"] = _same(piece, piece_fresh)
    finally:
        del os.environ["DELTACP_CP_PREPASS_PIECE"]
    rep["env_back_same"] = _same(_train(x, ctx), first)
    rep["env_back"] = counts.take()
    os.environ["DELTACP_CP_STAGED"] = "maybe"  # an invalid switch raises on every rank, cached or not
    try:
        rep["env_invalid"] = _error(lambda: _train(x, ctx))
    finally:
        del os.environ["DELTACP_CP_STAGED"]
    counts.take()

    # signature: dtype and option changes miss; the cache stays bounded
    _train(_inputs(world, device, _dtypes(device)[1])[1], ctx)
    rep["dtype_changed"] = counts.take()
    _train(x, ctx, chunk_size=32)
    rep["option_changed"] = counts.take()
    for i in range(cp_plan.MAX_PLANS + 4):
        with torch.no_grad():
            _gdn(_local(x, ctx, grad=False), ctx, scale=0.1 + 0.01 * i)
    rep["plans_bounded"] = len(ctx.plans)
    counts.take()

    # no grad: no autograd node; the training call's o bit for bit
    applied.clear()
    with torch.no_grad():
        o, _ = _gdn(_local(x, ctx), ctx)
    rep["no_grad"] = {"nodes": len(applied), "grad_fn": o.grad_fn is not None, "same_o": torch.equal(o, first[0])}
    applied.clear()
    o, _ = _gdn(_local(x, ctx, grad=False), ctx)
    rep["no_input_requires_grad"] = {"nodes": len(applied), "grad_fn": o.grad_fn is not None,
                                     "same_o": torch.equal(o, first[0])}
    applied.clear()
    with torch.inference_mode():
        o, _ = _gdn(_local(x, ctx, grad=False), ctx)
    rep["inference_mode"] = {"nodes": len(applied), "same_o": torch.equal(o, first[0])}
    applied.clear()
    o, _ = _gdn(_local(x, ctx), ctx)
    rep["with_grad"] = {"nodes": len(applied), "grad_fn": o.grad_fn is not None}
    counts.take()

    # errors: rank 0 hits its cache, rank 1 misses it; both raise together
    _train(x, ctx)
    counts.take()

    def mismatched_dtype():
        loc = _local(x, ctx)
        if rank == 1:
            loc = {n: t.detach().to(_dtypes(device)[1]).requires_grad_() for n, t in loc.items()}
        _gdn(loc, ctx)

    rep["mismatch_dtype"] = _error(mismatched_dtype)
    rep["mismatch_dtype_counts"] = counts.take()

    def bad_initial_state():
        loc = _local(x, ctx)
        if rank == 1:
            loc["h0"] = loc["h0"].detach()[:, :, :, :-1].contiguous()
        _gdn(loc, ctx)

    rep["bad_initial_state"] = _error(bad_initial_state)
    counts.take()

    # safe_gate (kda): cached calls, then a broken promise on rank 1
    cu_k, xk = _inputs(world, device, variant="kda")
    xk["g"] = xk["g"].clamp(min=-4.0)

    def kda(broken):
        loc = _local(xk, ctx, grad=False)
        if broken and rank == 1:
            loc["g"][0, 3, 1, 2] = -4.5
        deltacp.chunk_kda(loc["q"], loc["k"], loc["v"], loc["g"], loc["beta"], initial_state=loc["h0"],
                          output_final_state=True, chunk_size=16, cp_context=ctx, safe_gate=True, lower_bound=-4.25)

    for _ in range(10):  # more calls than the gate ring's slots (CUDA)
        kda(False)
    counts.take()
    rep["broken_gate"] = _error(lambda: kda(True))
    rep["broken_gate_counts"] = counts.take()
    rep["after_broken_gate"] = _error(lambda: kda(False))

    if device.type == "cuda":
        rep.update(_cuda_env_flips(x, cu, ctx, counts))
    counts.undo()
    cp_ops._CPFunction = cp_autograd._CPFunction
    return rep


def _cuda_env_flips(x, cu, ctx, counts) -> dict:
    """The C++ planners' switches flipped between calls on one context: each call equals a fresh context's."""
    import deltacp.cp as cp

    out = {}
    for name, value in (("DELTACP_FUSED_PIECE", "64"), ("DELTACP_CP_STAGED", "0"), ("DELTACP_TILED_SCAN_PIECE", "64")):
        before = _train(x, ctx)
        counts.take()
        os.environ[name] = value
        try:
            flipped = _train(x, ctx)
            flipped_counts = counts.take()
            fresh = _train(x, cp.build_context(cu, device=ctx.device, timeout=60, use_nccl=False))
        finally:
            del os.environ[name]
        again = _train(x, ctx)
        out[f"flip_{name}"] = {"same_as_fresh": _same(flipped, fresh), "back_same": _same(again, before),
                               "missed": flipped_counts["_methods"] == 1}
        counts.take()
    return out


def worker_main(argv):
    """python test_cp_plan.py worker <device> <out dir>; rank and world from the environment."""
    import datetime

    device = torch.device(argv[0])
    out_dir = Path(argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        report = _scenarios(rank, world, device)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        import traceback

        report = {"exception": f"{exc!r}\n{traceback.format_exc()}"}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------
_REPORTS = {}


def reports(device: str):
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        import deltacp

        if not deltacp.built_with_cuda():
            pytest.skip("deltacp built without the CUDA tiers")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if device not in _REPORTS:
        run = launch_workers(THIS, 2, [device], timeout=600)
        assert len(run.reports) == 2, "a worker did not report; logs:\n" + "\n".join(run.logs)
        for rank, rep in run.reports.items():
            assert "exception" not in rep, f"rank {rank}: {rep['exception']}"
        _REPORTS[device] = run.reports
    return _REPORTS[device]


DEVICES = ["cpu", "cuda"]


@pytest.mark.parametrize("device", DEVICES)
def test_cp_plan_second_identical_call_reuses_the_plan(device):
    for rank, rep in reports(device).items():
        assert rep["first"]["_methods"] == 1 and rep["first"]["_hash62"] > 0, (rank, rep["first"])
        assert rep["first"]["_cut_bounds"] >= 1 and rep["first"]["_settle_forward_tier"] == 1, (rank, rep["first"])
        assert all(n == 0 for n in rep["second"].values()), (rank, rep["second"])
        assert rep["hit_same"], rank
        assert rep["plans_after_hit"] == 1, rank
    if device == "cuda":  # the cut was planned by the C++ planner once, and not again
        assert all(rep["first"]["scan_pieces"] >= 1 for rep in reports(device).values())


@pytest.mark.parametrize("device", DEVICES)
def test_cp_plan_env_change_selects_another_plan(device):
    for rank, rep in reports(device).items():
        assert rep["env_changed"]["_methods"] == 1 and rep["env_changed"]["_cut_bounds"] >= 1, (rank, rep)
        assert rep["plans_after_env"] == 2 and rep["env_same_as_fresh"], (rank, rep)
        assert rep["env_back"]["_methods"] == 0 and rep["env_back"]["_cut_bounds"] == 0, (rank, rep["env_back"])
        assert rep["env_back_same"], rank
        err = rep["env_invalid"]
        assert err["is_value_error"] and "DELTACP_CP_STAGED" in err["message"], (rank, err)


@pytest.mark.parametrize("device", DEVICES)
def test_cp_plan_signature_change_misses_and_the_cache_is_bounded(device):
    from deltacp.cp.plan import MAX_PLANS

    for rank, rep in reports(device).items():
        assert rep["dtype_changed"]["_methods"] == 1, (rank, rep["dtype_changed"])
        assert rep["option_changed"]["_methods"] == 1, (rank, rep["option_changed"])
        assert rep["plans_bounded"] == MAX_PLANS, (rank, rep["plans_bounded"])


@pytest.mark.parametrize("device", DEVICES)
def test_cp_without_grad_makes_no_autograd_node(device):
    for rank, rep in reports(device).items():
        for case in ("no_grad", "no_input_requires_grad"):
            assert rep[case] == {"nodes": 0, "grad_fn": False, "same_o": True}, (rank, case, rep[case])
        assert rep["inference_mode"] == {"nodes": 0, "same_o": True}, (rank, rep["inference_mode"])
        assert rep["with_grad"] == {"nodes": 1, "grad_fn": True}, (rank, rep["with_grad"])


@pytest.mark.parametrize("device", DEVICES)
def test_cp_errors_unchanged_when_one_rank_hits_its_cache(device):
    reps = reports(device)
    assert reps[0]["mismatch_dtype_counts"]["_methods"] == 0  # rank 0's call was a hit
    assert reps[1]["mismatch_dtype_counts"]["_methods"] == 1  # rank 1's a miss
    messages = {rep["mismatch_dtype"]["message"] for rep in reps.values()}
    assert all(rep["mismatch_dtype"]["is_value_error"] for rep in reps.values()), reps
    assert len(messages) == 1 and "'q'" in messages.pop()
    for rank, rep in reps.items():
        err = rep["bad_initial_state"]
        assert err["is_value_error"] and "'initial_state'" in err["message"], (rank, err)
    assert "expected [N, HV, K, V]" in reps[1]["bad_initial_state"]["message"]
    assert "the ranks disagree" in reps[0]["bad_initial_state"]["message"]


@pytest.mark.parametrize("device", DEVICES)
def test_cp_broken_safe_gate_after_cached_calls_raises_on_every_rank(device):
    reps = reports(device)
    assert reps[0]["broken_gate_counts"]["_methods"] == 0  # cached on both ranks: the gate is per call
    for rank, rep in reps.items():
        assert rep["broken_gate"]["is_value_error"] and "'g'" in rep["broken_gate"]["message"], (rank, rep)
        assert rep["after_broken_gate"]["raised"] is None, (rank, rep["after_broken_gate"])
    assert "safe_gate=True promises -4.25 <= g <= 0" in reps[1]["broken_gate"]["message"]
    assert "[-4.5, " in reps[1]["broken_gate"]["message"]
    assert "the ranks disagree" in reps[0]["broken_gate"]["message"]


def test_cp_plan_cuda_env_flips_between_calls_equal_a_fresh_context():
    """DELTACP_FUSED_PIECE, DELTACP_CP_STAGED and DELTACP_TILED_SCAN_PIECE flipped between calls on one context:
    each call misses the cache and equals a fresh context's call bit for bit; back, it equals the first."""
    for rank, rep in reports("cuda").items():
        for name in ("DELTACP_FUSED_PIECE", "DELTACP_CP_STAGED", "DELTACP_TILED_SCAN_PIECE"):
            assert rep[f"flip_{name}"] == {"same_as_fresh": True, "back_same": True, "missed": True}, (rank, name)


# ---------------------------------------------------------------------------------------------
# in-process: the key, the fingerprint, the gate ring
# ---------------------------------------------------------------------------------------------
def test_plan_key_sees_env_shapes_and_grad(monkeypatch):
    from deltacp.cp import plan

    q = torch.zeros(1, 8, 2, 4)
    v = torch.zeros(1, 8, 2, 4)

    def key(**kw):
        args = dict(variant="gdn", q=q, k=q, v=v, g=None, beta=None, a=None, b=None, initial_state=None, scale=None,
                    output_final_state=False, chunk_size=64, backend=None, use_qk_l2norm_in_kernel=False,
                    gate_name="g", gate_check=True, gate_range_check=None, cu_seqlens=None)
        args.update(kw)
        return plan.key(**args)

    base = key()
    assert base is not None and key() == base
    monkeypatch.setenv("DELTACP_CP_PREPASS_PIECE", "128")
    assert key() != base
    monkeypatch.delenv("DELTACP_CP_PREPASS_PIECE")
    assert key() == base
    monkeypatch.setenv("DELTACP_FUSED_PIECE", "0")  # a C++ planner's switch
    assert key() != base
    monkeypatch.delenv("DELTACP_FUSED_PIECE")
    monkeypatch.setenv("NOT_DELTACP_X", "1")
    assert key() == base
    assert key(q=torch.zeros(1, 8, 2, 4, dtype=torch.float64)) != base
    assert key(v=torch.zeros(1, 8, 4, 2).transpose(2, 3)) != base  # same shape, other strides
    assert key(q=q.clone().requires_grad_()) != base  # a gradient is wanted
    with torch.no_grad():
        assert key(q=q.clone().requires_grad_()) == base
    assert key(scale=0.5) != key(scale=0.25)
    # arguments the checks reject or convert: not cached
    assert key(output_final_state=1) is None and key(chunk_size=64.0) is None and key(q=[1.0]) is None
    assert key(initial_state="h0") is None and key(cu_seqlens=torch.zeros(2)) is None


def test_fingerprint_hashes_equal_the_fields_hashes():
    """The cached hashes (context.Fingerprint) are the ones agree_start hashes from the fields, the gate's field
    extended with the check's outcome as _start_check always extended it."""
    from deltacp.cp.context import Fingerprint, _hash62

    fields = {"q": ("ok", "torch.float32", (2, 4)), "g": "torch.float32", "variant": "kda", "scale": None}
    names, both = Fingerprint(fields).values()
    assert names == list(fields) and both == [_hash62(v) for v in fields.values()] + [-_hash62(v) for v in
                                                                                        fields.values()]
    fp = Fingerprint(fields, "g")
    for outcome in ("in range", "out of range"):
        want = dict(fields, g=(fields["g"], outcome))
        assert fp.values(outcome) == Fingerprint(want).values()


class _FakeEvent:
    def __init__(self):
        self.done, self.records = True, 0

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True

    def record(self, stream=None):
        self.records += 1


def _ring(size):
    from deltacp import _library

    made = []

    def new_slot():
        made.append(_library._GateSlot(torch.empty(2), _FakeEvent()))
        return made[-1]

    return _library._GateRing(new_slot, size), made


def _check(lower=-1.0):
    from deltacp import _library

    c = _library.GateRangeCheck()
    c.lower, c.gate_name, c.event, c.values, c.ring = lower, "g", None, None, None
    return c


def test_gate_ring_keeps_each_checks_own_values_across_reuse():
    ring, made = _ring(3)
    checks = []
    for i in range(10):  # every slot reused several times before the early checks are read
        c = _check()
        bad = i % 3 == 1
        ring.start(c, torch.tensor([-2.0 if bad else -0.5, -0.125]), None)
        checks.append((c, bad))
    assert len(made) == 3  # the ring's slots only
    for i, (c, bad) in enumerate(checks):
        message = c.error()
        assert (message is not None) == bad, (i, message)
        if bad:
            assert "got values in [-2.0, -0.125]" in message and "'g'" in message
    c, _ = checks[1]
    with pytest.raises(ValueError, match="'g'"):
        c.confirm()


def test_gate_ring_does_not_reuse_a_slot_in_flight():
    ring, made = _ring(2)
    first, second = _check(), _check()
    ring.start(first, torch.tensor([-0.5, -0.125]), None)
    ring.start(second, torch.tensor([-0.75, -0.25]), None)
    made[0].event.done = False  # the first copy has not completed
    third = _check()
    ring.start(third, torch.tensor([-3.0, -0.375]), None)
    assert len(made) == 3 and third.host is made[2].host  # a slot of its own, outside the ring
    assert first.host is made[0].host and first.error() is None  # untouched: still -0.5, -0.125
    assert first.values == [-0.5, -0.125]
    assert "[-3.0, -0.375]" in third.error()
    # The oldest slot is tried again next: its copy has completed now (first.error() waited for it).
    fourth, fifth = _check(), _check()
    ring.start(fourth, torch.tensor([-0.625, -0.5]), None)
    assert fourth.host is made[0].host and first.values == [-0.5, -0.125]
    ring.start(fifth, torch.tensor([-0.25, -0.125]), None)
    assert fifth.host is made[1].host and second.values == [-0.75, -0.25]  # kept before the slot was reused
    assert len(made) == 3 and second.error() is None and fifth.error() is None and fourth.error() is None


def test_gate_range_check_on_cuda_reuses_pinned_slots_and_keeps_values():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from deltacp import _library

    g = -torch.rand(64, device="cuda") * 0.5
    checks = []
    for i in range(3 * _library._GATE_RING_SLOTS):
        gi = g.clone()
        if i % 4 == 3:
            gi[i] = -7.0  # below the bound
        if i % 5 == 4:
            gi[i] = 0.5  # above 0
        checks.append((_library.start_gate_range_check(gi, -5.0), i % 4 == 3 or i % 5 == 4, gi))
    ring = _library._GATE_RINGS[(torch.cuda.current_device(), torch.float32)]
    assert len(ring._slots) == _library._GATE_RING_SLOTS
    for check, bad, gi in checks:  # read after their slots were reused
        message = check.error()
        assert (message is not None) == bad, message
        if bad:
            assert f"[{gi.min().item()}, {gi.max().item()}]" in message
    nan = g.clone()
    nan[5] = float("nan")
    assert "nan" in _library.start_gate_range_check(nan, -5.0).error()


def test_cuda_offsets_drop_their_copy_event_once_completed():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from deltacp.cp import local

    device = torch.device("cuda", torch.cuda.current_device())
    values = [0, 3, 11, 12345]
    local._offsets(device, values)
    torch.cuda.synchronize()
    dev, host = local._offsets(device, values)
    assert local._OFFSETS[(str(device), tuple(values))][2] is None
    assert dev.tolist() == values and host.tolist() == values


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
