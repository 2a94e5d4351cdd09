"""deltacp.causal_conv1d: the definition on one process, and context parallelism on 2 and 4 gloo ranks.

One process: y, dx, dweight, dbias equal the token-by-token fp64 definition (causal_conv1d_reference,
autograd) for W = 1..4, with and without bias and SiLU, packed sequences shorter than W; FLA's
initial_state / output_final_state / residual (gradients of all of them; a sequence continued from its
final state equals one run); bad input names the argument.

CP (each world size launched once; this file run as a script per rank): every rank's y and dx equal
its slice of the one-process op, and the all-reduced dweight / dbias equal the one-process ones;
cases: one sequence over all ranks, sequences starting on a rank with fewer than W - 1 tokens left on
it, many short sequences, and ranks holding fewer than W - 1 tokens (T_local = 2, W = 4: the halo
comes from two ranks back). float64 to 1e-12, float32 to 1e-6.
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


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _inputs(T, D, W, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, D, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.randn(D, W, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    b = torch.randn(D, generator=gen, dtype=torch.float64).to(dtype)
    dy = torch.randn(1, T, D, generator=gen, dtype=torch.float64).to(dtype)
    return x, w, b, dy


@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_equals_definition(W, activation, with_bias):
    import deltacp
    from deltacp.conv1d import causal_conv1d_reference

    cu = [0, 1, 3, 9, 10, 17]  # sequences of 1, 2, 6, 1, 7 tokens: several shorter than W
    x, w, b, dy = _inputs(17, 5, W, torch.float64)
    b = b if with_bias else None
    for offsets in (cu, None):
        ins = [t.clone().requires_grad_() for t in (x, w) + ((b,) if with_bias else ())]
        y, state = deltacp.causal_conv1d(ins[0], ins[1], ins[2] if with_bias else None, activation=activation,
                                         cu_seqlens=None if offsets is None else torch.tensor(offsets))
        assert state is None and y.dtype == x.dtype
        (y * dy).sum().backward()
        ref = [t.clone().requires_grad_() for t in (x, w) + ((b,) if with_bias else ())]
        y_ref = causal_conv1d_reference(ref[0], ref[1], ref[2] if with_bias else None, activation, offsets)
        (y_ref * dy).sum().backward()
        assert _rel(y, y_ref) < 1e-13
        for got, want in zip(ins, ref):
            assert _rel(got.grad, want.grad) < 1e-13


@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("packed", [True, False])
def test_states_and_residual_equal_definition(W, packed):
    """FLA's initial_state / output_final_state / residual: y, the final states and every gradient
    (x, weight, bias, initial_state, residual) equal the definition's."""
    import deltacp
    from deltacp.conv1d import causal_conv1d_reference

    if packed:
        cu, shape, N = [0, 1, 1, 3, 9, 14], (1, 14, 5), 5  # an empty sequence and ones shorter than W
    else:
        cu, shape, N = None, (3, 6, 5), 3  # every batch row a sequence
    gen = torch.Generator().manual_seed(11 + W)
    x, res, dy = (torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(3))
    w = torch.randn(5, W, generator=gen, dtype=torch.float64)
    b = torch.randn(5, generator=gen, dtype=torch.float64)
    h0 = torch.randn(N, 5, W, generator=gen, dtype=torch.float64)
    dht = torch.randn(N, 5, W, generator=gen, dtype=torch.float64)
    ins = [t.clone().requires_grad_() for t in (x, w, b, h0, res)]
    y, ht = deltacp.causal_conv1d(ins[0], ins[1], ins[2], activation="silu",
                                  cu_seqlens=None if cu is None else torch.tensor(cu), residual=ins[4],
                                  initial_state=ins[3], output_final_state=True)
    ((y * dy).sum() + (ht * dht).sum()).backward()
    ref = [t.clone().requires_grad_() for t in (x, w, b, h0, res)]
    y_ref, ht_ref = causal_conv1d_reference(ref[0], ref[1], ref[2], "silu", cu, residual=ref[4],
                                            initial_state=ref[3], output_final_state=True)
    ((y_ref * dy).sum() + (ht_ref * dht).sum()).backward()
    assert _rel(y, y_ref) < 1e-13 and _rel(ht, ht_ref) < 1e-13
    for got, want in zip(ins, ref):
        if want.grad is None:  # W = 1 reads no state: the definition never touches initial_state
            assert not got.grad.any()
        else:
            assert _rel(got.grad, want.grad) < 1e-13
    if packed:  # the empty sequence's final state is its initial state
        assert torch.equal(ht[1], h0[1])


def test_final_state_continues_a_sequence():
    """A sequence run in two parts, the second from the first's final state, equals one run."""
    import deltacp

    x, w, b, _ = _inputs(20, 4, 4, torch.float64)
    y_all, h_all = deltacp.causal_conv1d(x, w, b, activation="silu", output_final_state=True)
    y1, h1 = deltacp.causal_conv1d(x[:, :7], w, b, activation="silu", output_final_state=True)
    y2, h2 = deltacp.causal_conv1d(x[:, 7:], w, b, activation="silu", initial_state=h1, output_final_state=True)
    assert _rel(torch.cat([y1, y2], 1), y_all) < 1e-15 and _rel(h2, h_all) < 1e-15


def test_sequence_boundaries_are_respected():
    """A token's output does not change when the previous sequence's tokens do."""
    import deltacp

    x, w, _, _ = _inputs(12, 3, 4, torch.float64)
    cu = torch.tensor([0, 5, 12])
    y1, _ = deltacp.causal_conv1d(x, w, cu_seqlens=cu)
    x2 = x.clone()
    x2[:, :5] = 100.0
    y2, _ = deltacp.causal_conv1d(x2, w, cu_seqlens=cu)
    assert torch.equal(y1[:, 5:], y2[:, 5:]) and not torch.equal(y1[:, :5], y2[:, :5])


def test_bad_input_names_the_argument():
    import deltacp

    x, w, b, _ = _inputs(8, 4, 3, torch.float32)
    with pytest.raises(ValueError, match="argument 'x'"):
        deltacp.causal_conv1d(x[0], w)
    with pytest.raises(ValueError, match="argument 'weight'"):
        deltacp.causal_conv1d(x, w[:3])
    with pytest.raises(TypeError, match="argument 'weight'"):
        deltacp.causal_conv1d(x, w.double())
    with pytest.raises(ValueError, match="argument 'bias'"):
        deltacp.causal_conv1d(x, w, b[:2])
    with pytest.raises(ValueError, match="argument 'activation'"):
        deltacp.causal_conv1d(x, w, activation="relu")
    with pytest.raises(ValueError, match="argument 'cu_seqlens'"):
        deltacp.causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match="argument 'x'.*B = 1"):
        deltacp.causal_conv1d(torch.cat([x, x]), w, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="argument 'initial_state'.*\\[2, 4, 3\\]"):
        deltacp.causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(2, 4, 2))
    with pytest.raises(ValueError, match="argument 'residual'"):
        deltacp.causal_conv1d(x, w, residual=x[:, :4])


# ---------------------------------------------------------------------------------------------
# CP on gloo ranks
# ---------------------------------------------------------------------------------------------
def _cp_cases(world):
    T = 6 * world
    return [
        dict(name="one-sequence", seqlens=[T], W=4, act="silu", dtype="float64"),
        # a sequence starting 1 token before each rank boundary (fewer than W - 1 tokens there)
        dict(name="starts-before-cut", seqlens=[5] + [6] * (world - 1) + [1], W=4, act=None, dtype="float64"),
        dict(name="many-short", seqlens=[1, 2, 1, 3] + [T - 7], W=3, act="silu", dtype="float32"),
        dict(name="width-1", seqlens=[T // 2, T - T // 2], W=1, act=None, dtype="float64"),
        dict(name="width-2", seqlens=[T - 1, 1], W=2, act="silu", dtype="float32"),
        # T_local = 2 < W - 1 = 3: the halo spans two earlier ranks
        dict(name="tiny-ranks", seqlens=[2 * world - 3, 3], W=4, act="silu", dtype="float64", tiny=True),
        dict(name="tiny-ranks-short-seqs", seqlens=[1] * (2 * world), W=4, act=None, dtype="float64", tiny=True),
    ]


def _cp_worker(rank, world):
    import deltacp
    import deltacp.cp as cp

    out = {}
    for case in _cp_cases(world):
        dt = {"float64": torch.float64, "float32": torch.float32}[case["dtype"]]
        cu = [0]
        for s in case["seqlens"]:
            cu.append(cu[-1] + s)
        T, D, W = cu[-1], 6, case["W"]
        x, w, b, dy = _inputs(T, D, W, dt, seed=len(out))
        ctx = cp.build_context(cu, conv1d_kernel_size=W, timeout=60)
        xl = cp.split_even(x, ctx).clone().requires_grad_()
        wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
        y, _ = deltacp.causal_conv1d(xl, wl, bl, activation=case["act"], cp_context=ctx)
        (y * cp.split_even(dy, ctx)).sum().backward()
        dw, db = wl.grad.clone(), bl.grad.clone()
        dist.all_reduce(dw)
        dist.all_reduce(db)
        full = [t.clone().requires_grad_() for t in (x, w, b)]
        y_ref, _ = deltacp.causal_conv1d(*full, activation=case["act"], cu_seqlens=torch.tensor(cu))
        (y_ref * dy).sum().backward()
        out[case["name"]] = dict(dtype=case["dtype"], local=ctx.local_tokens, errors={
            "y": _rel(y, cp.split_even(y_ref, ctx)), "dx": _rel(xl.grad, cp.split_even(full[0].grad, ctx)),
            "dweight": _rel(dw, full[1].grad), "dbias": _rel(db, full[2].grad)})
    errors = {}
    ctx = cp.build_context([0, 6 * world], timeout=60)
    try:
        deltacp.causal_conv1d(torch.zeros(1, 6, 2), torch.zeros(2, 3), cp_context=ctx)
    except ValueError as e:
        errors["no_width"] = str(e)
    ctx = cp.build_context([0, 6 * world], conv1d_kernel_size=4, timeout=60)
    try:
        deltacp.causal_conv1d(torch.zeros(1, 6, 2), torch.zeros(2, 3), cp_context=ctx)
    except ValueError as e:
        errors["wrong_width"] = str(e)
    try:
        deltacp.causal_conv1d(torch.zeros(1, 6, 2), torch.zeros(2, 4), cp_context=ctx, cu_seqlens=torch.tensor([0, 6]))
    except ValueError as e:
        errors["cu_seqlens"] = str(e)
    try:
        deltacp.causal_conv1d(torch.zeros(1, 6, 2), torch.zeros(2, 4), cp_context=ctx,
                              initial_state=torch.zeros(1, 2, 4))
    except ValueError as e:
        errors["initial_state"] = str(e)
    return {"cases": out, "errors": errors}


def worker_main(argv):
    out_dir = argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=world)
    try:
        report = _cp_worker(rank, world)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


def _launch(world):
    run = launch_workers(THIS, world, timeout=180)
    if run.timed_out:
        pytest.fail("conv1d CP workers did not finish within 180 s")
    for r, rc in enumerate(run.returncodes):
        assert rc == 0, f"rank {r} failed:\n{run.logs[r]}"
    return [run.reports[r] for r in range(world)]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
@pytest.mark.parametrize("world", [2, 4])
def test_cp_equals_single_process(world):
    reports = _launch(world)
    bad = []
    for r, rep in enumerate(reports):
        for name, c in rep["cases"].items():
            tol = 1e-12 if c["dtype"] == "float64" else 1e-6
            for what, e in c["errors"].items():
                if not e <= tol:
                    bad.append(f"rank {r} {name}: {what} {e:.2e} > {tol:g}")
        assert rep["cases"]["tiny-ranks"]["local"] == 2
        e = rep["errors"]
        assert "argument 'cp_context'" in e["no_width"] and "conv1d_kernel_size" in e["no_width"], e
        assert "argument 'weight'" in e["wrong_width"] and "W = 4" in e["wrong_width"], e
        assert "argument 'cu_seqlens'" in e["cu_seqlens"], e
        assert "argument 'initial_state'" in e["initial_state"] and "CP" in e["initial_state"], e
    assert not bad, "\n".join(bad)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker_main(sys.argv[1:])
