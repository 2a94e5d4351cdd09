"""Context parallelism on CPUs: 2 and 4 gloo processes against one process (deltacp.cp).

Each test launches `world` worker processes on localhost (this file run as a script, a free port,
the rank in the environment) and reads their JSON reports. Checked:

  * CP equals the single-process run on o, ht, and every gradient (dq, dk, dv, dg / dgk, dbeta or
    da, db, dh0): float64 to 1e-11, float32 to 1e-5, bfloat16 within 3e-3 (gdn) / 8e-3 (kda), relative
    ||cp - single|| / ||single|| per tensor; shapes: a sequence spanning 3+ ranks, many short sequences,
    cuts inside a chunk, T not divisible by the chunk, empty sequences, grouped value heads, with and
    without initial / final states; variants gdn, kda, dplr and delta;
  * results are bitwise identical run to run;
  * a float32 g (log decay) beside bfloat16 / float64 q, k, v, as the single-device ops accept it:
    CP equals the single-process run with the same dtypes; a g of another dtype is a TypeError naming
    'g' on every rank, and ranks that disagree on g's dtype raise the same ValueError naming 'g';
  * faults: a rank that sleeps or exits mid-exchange makes every other rank raise a clear error
    within the (10 s) timeout; mismatched cu_seqlens / dtypes raise the same ValueError on every rank
    naming the argument; T not divisible by the world size is rejected naming cu_seqlens.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from deltacp_testutil import launch_workers  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

THIS = Path(__file__).resolve()
TOL = {"float64": 1e-11, "float32": 1e-5, "bfloat16": {"gdn": 3e-3, "kda": 8e-3}}
FAULT_TIMEOUT_S = 10.0  # the CP context's timeout in the fault tests


# ---------------------------------------------------------------------------------------------
# the cases every world size runs (kept small: the whole file runs in well under a minute)
# ---------------------------------------------------------------------------------------------
def cases(world):
    T = 26 * world  # rank cuts at multiples of 26: inside chunks of 16 and 32; T and T / world not multiples of 16
    many = [3, 1, 7, 2, 5, 1, 4, 6, 2, 3, 1, 8, 2, 3]  # many short sequences
    many.append(T - sum(many))
    span = [5, T - 9, 4]  # the middle sequence spans every rank (3+ ranks at world 4)
    with_empty = [T // 2 + 3, 0, T // 2 - 3]  # an empty sequence at a cut
    out = []
    for variant in ("gdn", "kda", "dplr", "delta"):
        for dtype in ("float64", "float32"):
            out.append(dict(name=f"{variant}-{dtype}-span", variant=variant, dtype=dtype, seqlens=span, states=True,
                            HV_mult=1, chunk=16))
    out.append(dict(name="gdn-float32-many-short", variant="gdn", dtype="float32", seqlens=many, states=True,
                    HV_mult=1, chunk=16))
    out.append(dict(name="kda-float64-many-short", variant="kda", dtype="float64", seqlens=many, states=False,
                    HV_mult=1, chunk=16))
    out.append(dict(name="gdn-float64-grouped-empty", variant="gdn", dtype="float64", seqlens=with_empty, states=True,
                    HV_mult=2, chunk=32))
    out.append(dict(name="gdn-float32-nostates", variant="gdn", dtype="float32", seqlens=span, states=False,
                    HV_mult=1, chunk=64))
    out.append(dict(name="gdn-bfloat16-span", variant="gdn", dtype="bfloat16", seqlens=span, states=True, HV_mult=1,
                    chunk=16))
    out.append(dict(name="kda-bfloat16-span", variant="kda", dtype="bfloat16", seqlens=span, states=True, HV_mult=1,
                    chunk=16))
    # g kept in float32 beside 16-bit (or float64) q, k, v: FLA's usual setup.
    out.append(dict(name="gdn-bfloat16-fp32gate-span", variant="gdn", dtype="bfloat16", seqlens=span, states=True,
                    HV_mult=1, chunk=16, gate_fp32=True))
    out.append(dict(name="kda-bfloat16-fp32gate-many-short", variant="kda", dtype="bfloat16", seqlens=many,
                    states=True, HV_mult=1, chunk=16, gate_fp32=True))
    out.append(dict(name="dplr-float64-fp32gate-span", variant="dplr", dtype="float64", seqlens=span, states=True,
                    HV_mult=1, chunk=16, gate_fp32=True))
    return out


# ---------------------------------------------------------------------------------------------
# the worker (this file run as a script in each rank's process)
# ---------------------------------------------------------------------------------------------
def _inputs(case, device="cpu"):
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(1234)
    seqlens = case["seqlens"]
    cu = [0]
    for s in seqlens:
        cu.append(cu[-1] + s)
    T, N = cu[-1], len(seqlens)
    H, K, V = 2, 8, 6
    HV = H * case["HV_mult"]
    variant = case["variant"]
    dt = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}[case["dtype"]]
    sdt = torch.float64 if dt == torch.float64 else torch.float32

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {"q": rnd(1, T, H, K), "k": F.normalize(rnd(1, T, H, K), dim=-1), "v": rnd(1, T, HV, V)}
    if variant == "gdn":
        x["g"] = F.logsigmoid(rnd(1, T, HV) + 2.0)
    elif variant in ("kda", "dplr"):
        x["g"] = F.logsigmoid(rnd(1, T, HV, K) + 2.0)
    if variant == "dplr":
        kk = F.normalize(rnd(1, T, HV, K), dim=-1)
        x["a"], x["b"] = -kk * 0.5, kk * 0.5 * torch.sigmoid(rnd(1, T, HV, 1))
    else:
        x["beta"] = torch.sigmoid(rnd(1, T, HV))
    x = {n: t.to(dt) for n, t in x.items()}
    if case.get("gate_fp32"):
        x["g"] = x["g"].to(torch.float32)
    if case["states"]:
        x["h0"] = (rnd(N, HV, K, V) * 0.5).to(sdt)
    do = rnd(1, T, HV, V).to(dt)
    dht = rnd(N, HV, K, V).to(sdt) if case["states"] else None
    return cu, x, do, dht


def _call(variant, x, *, cp_context=None, cu=None, chunk, states):
    import deltacp
    import deltacp.cp as cp

    kw = dict(initial_state=x.get("h0"), output_final_state=states, chunk_size=chunk)
    if cp_context is not None:
        kw["cp_context"] = cp_context
        fns = {"gdn": cp.chunk_gated_delta_rule_cp, "kda": cp.chunk_kda_cp, "delta": cp.chunk_delta_rule_cp,
               "dplr": cp.chunk_dplr_cp}
    else:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64)
        fns = {"gdn": deltacp.chunk_gated_delta_rule, "kda": deltacp.chunk_kda, "delta": deltacp.chunk_delta_rule,
               "dplr": deltacp.chunk_dplr}
    if variant == "dplr":
        return fns[variant](x["q"], x["k"], x["v"], x["a"], x["b"], x["g"], **kw)
    if variant == "delta":
        return fns[variant](x["q"], x["k"], x["v"], x["beta"], **kw)
    return fns[variant](x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _compare(case, rank, world):
    import deltacp.cp as cp

    cu, x, do, dht = _inputs(case)
    ctx = cp.build_context(cu, timeout=60)
    names = list(x)

    def cp_run():
        loc = {n: (t if n == "h0" else cp.split_even(t, ctx)).detach().clone().requires_grad_() for n, t in x.items()}
        o, ht = _call(case["variant"], loc, cp_context=ctx, chunk=case["chunk"], states=case["states"])
        loss = (o.double() * cp.split_even(do, ctx).double()).sum()
        if ht is not None:
            loss = loss + (ht.double() * dht.double()).sum()
        loss.backward()
        return o.detach(), (None if ht is None else ht.detach()), {n: loc[n].grad for n in names}

    o, ht, grads = cp_run()
    o2, ht2, grads2 = cp_run()  # determinism: bitwise equal run to run
    bitwise = bool(torch.equal(o, o2) and all(torch.equal(grads[n], grads2[n]) for n in names)
                   and (ht is None or torch.equal(ht, ht2)))

    # Inference (torch.no_grad) on tensors that require grad: the training call's o, bit for bit, and the
    # forward's pre-pass is not asked for the backward pre-pass's maps (no backward follows).
    import deltacp.cp.autograd as cp_autograd

    asked, prepass = [], cp_autograd._prepass_forward

    def spy(*args, **kwargs):
        asked.append(bool(kwargs.get("want_first_maps", False)))
        return prepass(*args, **kwargs)

    cp_autograd._prepass_forward = spy
    try:
        with torch.no_grad():
            loc = {n: (t if n == "h0" else cp.split_even(t, ctx)).detach().clone().requires_grad_() for n, t in x.items()}
            o_inference, _ = _call(case["variant"], loc, cp_context=ctx, chunk=case["chunk"], states=case["states"])
    finally:
        cp_autograd._prepass_forward = prepass
    inference = {"same_o": bool(torch.equal(o_inference, o)), "prepass_calls": len(asked), "maps_asked": any(asked)}

    full = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o_ref, ht_ref = _call(case["variant"], full, cu=cu, chunk=case["chunk"], states=case["states"])
    loss = (o_ref.double() * do.double()).sum()
    if ht_ref is not None:
        loss = loss + (ht_ref.double() * dht.double()).sum()
    loss.backward()

    err = {"o": _rel(o, cp.split_even(o_ref, ctx))}
    for n in names:
        if n == "h0":  # each rank holds the rows of the sequences starting on it: the sum is the gradient
            total = grads[n].clone()
            dist.all_reduce(total)
            err["dh0"] = _rel(total, full[n].grad)
        else:
            err["d" + n] = _rel(grads[n], cp.split_even(full[n].grad, ctx))
    if ht is not None:  # each rank holds the rows of the sequences ending on it
        total = ht.clone()
        dist.all_reduce(total)
        err["ht"] = _rel(total, ht_ref)
        # rows this rank does not own are exactly zero
        owned = [ctx.seq_ids[i] for i in range(ctx.num_local_seqs) if ctx.ends_here[i]] + list(ctx.empty_seqs)
        others = [n for n in range(ctx.num_seqs) if n not in owned]
        err["ht_foreign_rows_zero"] = 0.0 if not others or bool((ht[others] == 0).all()) else 1.0
    # The exchange carries [X | M] only where a merge reads M (a rank strictly inside one sequence).
    HV, K, V = x["v"].shape[2], x["q"].shape[3], x["v"].shape[3]
    state = torch.float64 if case["dtype"] == "float64" else torch.float32
    width = V + K if ctx.maps_read else V
    sizes_ok = all(cp.last_stats[key] == ctx.world * HV * K * width * state.itemsize
                   and cp.last_stats[key] == cp.exchange_bytes(ctx, HV, K, V, state)
                   for key in ("forward_bytes", "backward_bytes"))
    return {"errors": err, "bitwise": bitwise, "plan": ctx.describe(), "maps_read": ctx.maps_read,
            "exchange_sizes_ok": sizes_ok, "inference": inference}


def _fault(scenario, rank, world, victim):
    """Runs one fault scenario; returns what this rank saw (exception type and text, seconds)."""
    import deltacp
    import deltacp.cp as cp
    from deltacp.cp import autograd as cp_autograd

    variant = "kda" if scenario == "broken_safe_gate" else "gdn"
    case = dict(variant=variant, dtype="float32", seqlens=[7, 24 * world - 7], states=True, HV_mult=1, chunk=16)
    if scenario in ("bad_gate_dtype", "mismatch_gate_dtype"):
        case["dtype"] = "bfloat16"
    cu, x, do, dht = _inputs(case)
    if scenario == "mismatch_cu" and rank == victim:
        cu = [0, 8, cu[-1]]
    if scenario == "indivisible":
        cu = [0, 5, 24 * world + 1]
    t0 = time.time()
    try:
        ctx = cp.build_context(cu, timeout=FAULT_TIMEOUT_S)
        if scenario in ("sleep", "exit") and rank == victim:
            original = cp_autograd._prepass_forward

            def stalled(*args, **kwargs):  # in the pre-pass (the fingerprint check started), before the all-gather
                if scenario == "exit":
                    sys.stdout.flush()
                    os._exit(0)
                time.sleep(3 * FAULT_TIMEOUT_S)
                return original(*args, **kwargs)

            cp_autograd._prepass_forward = stalled
        loc = {n: (t if n == "h0" else cp.split_even(t, ctx)).detach().clone() for n, t in x.items()}
        if scenario == "mismatch_dtype" and rank == victim:
            loc = {n: t.double() for n, t in loc.items()}
        if scenario == "bad_gate_dtype":  # float16 g beside bfloat16 q: neither q's dtype nor float32
            loc["g"] = loc["g"].to(torch.float16)
        if scenario == "mismatch_gate_dtype" and rank == victim:  # float32 g here, bfloat16 elsewhere
            loc["g"] = loc["g"].to(torch.float32)
        if scenario == "broken_safe_gate":  # safe_gate's promise (g >= lower_bound) broken on the victim only
            loc["g"] = loc["g"].clamp(min=-4.0)
            if rank == victim:
                loc["g"][0, 3, 1, 2] = -4.5
            deltacp.chunk_kda(loc["q"], loc["k"], loc["v"], loc["g"], loc["beta"], initial_state=loc["h0"],
                              output_final_state=True, chunk_size=16, cp_context=ctx, safe_gate=True,
                              lower_bound=-4.25)
        else:
            _call("gdn", loc, cp_context=ctx, chunk=16, states=True)
        return {"raised": None, "seconds": time.time() - t0}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"raised": type(exc).__name__, "is_value_error": isinstance(exc, ValueError),
                "is_type_error": isinstance(exc, TypeError), "message": str(exc), "seconds": time.time() - t0}


def worker_main(argv):
    """python test_cp_gloo.py worker <json spec> <out dir>; rank and world from the environment."""
    spec = json.loads(argv[0])
    out_dir = Path(argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import datetime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    if spec["kind"] == "compare":
        report = {c["name"]: _compare(c, rank, world) for c in cases(world)}
    else:
        report = _fault(spec["kind"], rank, world, spec.get("victim", 1))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)  # no teardown: after a fault the process group cannot be destroyed cleanly


# ---------------------------------------------------------------------------------------------
# the launcher and the tests
# ---------------------------------------------------------------------------------------------
def launch(world, spec, timeout=240, wait_for=None):
    """Runs `world` workers; returns ({rank: report} of the ranks that wrote one, logs). With
    `wait_for` (ranks), the others are killed as soon as those have finished (a stalled victim)."""
    run = launch_workers(THIS, world, [json.dumps(spec)], timeout=timeout, wait_for=wait_for)
    if not run.reports:
        raise AssertionError("no worker reported; logs:\n" + "\n".join(run.logs))
    return run.reports, run.logs


_COMPARE = {}


def compare_reports(world):
    if world not in _COMPARE:
        reports, logs = launch(world, {"kind": "compare"})
        assert len(reports) == world, "a worker failed; logs:\n" + "\n".join(logs)
        _COMPARE[world] = reports
    return _COMPARE[world]


def _tol(case):
    t = TOL[case["dtype"]]
    return t[case["variant"]] if isinstance(t, dict) else t


@pytest.mark.parametrize("world", [2, 4])
def test_cp_equals_single_process(world):
    reports = compare_reports(world)
    failures = []
    for case in cases(world):
        tol = _tol(case)
        for rank, rep in reports.items():
            r = rep[case["name"]]
            for name, e in r["errors"].items():
                if not e <= tol:
                    failures.append(f"{case['name']} rank {rank} ({r['plan']}): {name} error {e:.3e} > {tol:g}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_bitwise_deterministic(world):
    reports = compare_reports(world)
    bad = [f"{name} rank {rank}" for rank, rep in reports.items() for name, r in rep.items() if not r["bitwise"]]
    assert not bad, "results differ run to run: " + ", ".join(bad)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_inference_under_no_grad_makes_no_backward_maps(world):
    """A CP forward under torch.no_grad() on tensors that require grad (a model evaluated without a backward)
    gives the training call's o bit for bit and does not make the backward pre-pass's transitions: autograd's
    needs_input_grad is set under no_grad too, so the op decides from grad mode at the call."""
    reports = compare_reports(world)
    bad = [f"{name} rank {rank}: {r['inference']}" for rank, rep in reports.items() for name, r in rep.items()
           if not (r["inference"]["same_o"] and r["inference"]["prepass_calls"] == 1
                   and not r["inference"]["maps_asked"])]
    assert not bad, "\n".join(bad)


def test_cp_sequence_spans_three_ranks():
    reports = compare_reports(4)
    plans = [reports[r]["gdn-float64-span"]["plan"] for r in range(4)]
    # ranks 1 and 2 have the middle sequence arriving from before and leaving to after
    assert "pre_ranks 1, post_ranks 2" in plans[1] and "pre_ranks 2, post_ranks 1" in plans[2], plans


@pytest.mark.parametrize("world", [2, 4])
def test_cp_exchange_carries_transitions_only_where_read(world):
    """CPContext.maps_read: at world 2 no rank lies strictly inside a sequence, so every merge folds one
    rank's H (dH) and the all-gathers carry [HV, K, V]; at world 4 the span case's ranks 1 and 2 do, and
    the all-gathers carry [HV, K, V + K]. The bytes each rank received match exchange_bytes."""
    reports = compare_reports(world)
    bad = [f"{name} rank {rank}" for rank, rep in reports.items() for name, r in rep.items()
           if not r["exchange_sizes_ok"]]
    assert not bad, "exchange sizes: " + ", ".join(bad)
    span_maps = {reports[r]["gdn-float64-span"]["maps_read"] for r in range(world)}
    assert span_maps == {world > 2}, span_maps


@pytest.mark.parametrize("world,victim", [(2, 1), (4, 2)])
def test_cp_stalled_rank_times_out(world, victim):
    others = [r for r in range(world) if r != victim]
    reports, logs = launch(world, {"kind": "sleep", "victim": victim}, timeout=120, wait_for=others)
    for r in others:
        assert r in reports, f"rank {r} did not report; logs:\n" + "\n".join(logs)
        rep = reports[r]
        assert rep["raised"] in ("CPTimeoutError", "RuntimeError"), rep
        assert "context parallelism" in rep["message"] and "all-gather" in rep["message"], rep["message"]
        assert rep["seconds"] < FAULT_TIMEOUT_S + 8, rep  # within the timeout (plus start-up)


def test_cp_exited_rank_fails_fast():
    reports, logs = launch(2, {"kind": "exit", "victim": 1}, timeout=120)
    rep = reports.get(0)
    assert rep is not None, "rank 0 did not report; logs:\n" + "\n".join(logs)
    assert rep["raised"] in ("CPTimeoutError", "RuntimeError"), rep
    assert "context parallelism" in rep["message"], rep["message"]
    assert rep["seconds"] < FAULT_TIMEOUT_S + 8, rep


def _assert_same_value_error_everywhere(world, spec, argument):
    """Every rank reports one and the same ValueError, naming `argument`."""
    reports, logs = launch(world, spec, timeout=120)
    assert len(reports) == world, "\n".join(logs)
    messages = {rep["message"] for rep in reports.values()}
    assert all(rep["is_value_error"] for rep in reports.values()), reports
    assert len(messages) == 1, messages
    assert f"'{argument}'" in messages.pop()


def test_cp_mismatched_cu_seqlens_same_error_everywhere():
    _assert_same_value_error_everywhere(4, {"kind": "mismatch_cu", "victim": 3}, "cu_seqlens")


def test_cp_mismatched_dtype_raises_on_every_rank():
    reports, logs = launch(2, {"kind": "mismatch_dtype", "victim": 1}, timeout=120)
    assert len(reports) == 2, "\n".join(logs)
    for rep in reports.values():
        assert rep["is_value_error"] and "'q'" in rep["message"], rep


def test_cp_accepts_fp32_gate_beside_bf16_inputs():
    reports = compare_reports(2)
    for rank, rep in reports.items():
        for name in ("gdn-bfloat16-fp32gate-span", "kda-bfloat16-fp32gate-many-short", "dplr-float64-fp32gate-span"):
            assert name in rep, f"rank {rank}: case {name} missing"
            assert "dg" in rep[name]["errors"], rep[name]


def test_cp_gate_of_another_dtype_is_a_type_error_naming_g():
    reports, logs = launch(2, {"kind": "bad_gate_dtype"}, timeout=120)
    assert len(reports) == 2, "\n".join(logs)
    for rep in reports.values():
        assert rep["is_type_error"] and "'g'" in rep["message"] and "float32" in rep["message"], rep


def test_cp_ranks_disagreeing_on_the_gate_dtype_raise_naming_g():
    _assert_same_value_error_everywhere(2, {"kind": "mismatch_gate_dtype", "victim": 1}, "g")


def test_cp_broken_safe_gate_raises_on_every_rank_naming_g():
    """safe_gate's range is checked on each rank and joins the ranks' agreement: the rank whose gate breaks the
    promise names the values, the others the disagreement on g; nobody is left waiting in the exchange."""
    reports, logs = launch(2, {"kind": "broken_safe_gate", "victim": 1}, timeout=120)
    assert len(reports) == 2, "\n".join(logs)
    for rank, rep in reports.items():
        assert rep["is_value_error"] and "'g'" in rep["message"], rep
        assert rep["seconds"] < FAULT_TIMEOUT_S, rep
    assert "safe_gate=True promises -4.25 <= g <= 0" in reports[1]["message"], reports[1]
    assert "the ranks disagree" in reports[0]["message"], reports[0]


def test_cp_indivisible_tokens_rejected():
    reports, logs = launch(2, {"kind": "indivisible"}, timeout=120)
    assert len(reports) == 2, "\n".join(logs)
    messages = {rep["message"] for rep in reports.values()}
    assert len(messages) == 1, messages
    msg = messages.pop()
    assert "'cu_seqlens'" in msg and "divisible" in msg, msg


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])


def test_blocking_gather_rule():
    """deltacp.cp.nccl_backend.blocking_gather: the all-gathers get a blocking NCCL communicator of their own
    by default only on one host with NVLS off (where ring is NCCL's one all-gather algorithm, so the warm-up
    at creation connected everything), never where a rank says DELTACP_CP_BLOCKING_GATHER=0 or sets
    NCCL_COMM_BLOCKING=0 under "auto", always where every rank says 1."""
    from deltacp.cp.nccl_backend import blocking_gather

    def rank(mode="auto", nvls_off=True, comm_nonblocking=False, host="a"):
        return {"mode": mode, "nvls_off": nvls_off, "comm_nonblocking": comm_nonblocking, "host": host}

    assert blocking_gather([rank(), rank()])
    assert not blocking_gather([rank(), rank(nvls_off=False)])  # NVLS may be picked for some sizes
    assert not blocking_gather([rank(), rank(host="b")])  # several nodes: PAT, CollNet
    assert not blocking_gather([rank(), rank(comm_nonblocking=True)])
    assert not blocking_gather([rank(mode="1"), rank(mode="0")])
    assert blocking_gather([rank(mode="1", nvls_off=False), rank(mode="1", host="b")])
    assert not blocking_gather([rank(mode="1"), rank(nvls_off=False)])  # "1" and "auto": auto's rule
