"""Ring attention on CPUs: 1 to 4 gloo processes against single-process attention (deltacp.cp).

Each world size launches its worker processes once (this file run as a script, a free port, the
rank in the environment); every worker runs all cases and writes a JSON report. Checked:

  * o, dq, dk, dv of every rank equal its zig-zag rows of plain fp64 attention (autograd): relative
    ||ring - single|| / ||single|| <= 1e-5 in float32, 1e-2 in bfloat16; causal and not, grouped K/V
    heads (H = 4 over 2) and not, the default block T / (2N) and block = 1;
  * zigzag_unshard(zigzag_shard(x)) == x on every rank, and the layout itself (rank 0 of 4 holds
    tokens 0, 7, 8, 15 with block = 1; blocks r and 2N-1-r by default);
  * the causal work each rank counted (visible (query, key) pairs) is the same on every rank, while
    contiguous slices would give the last rank 2N - 1 times the first rank's; with the default block
    every rank also computes the same number of block pairs (2N + 1);
  * lengths the layout cannot deal evenly are rejected with a ValueError naming the argument.
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

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

THIS = Path(__file__).resolve()
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def _cases():
    out = []
    for dtype in ("float32", "bfloat16"):
        for causal in (True, False):
            for hkv in (4, 2):
                for block in (None, 1):
                    out.append(dict(dtype=dtype, causal=causal, hkv=hkv, block=block))
    return out


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _worker(rank, world):
    import deltacp.cp as cp

    report = {"cases": [], "layout": {}}
    B, H, D, Dv = 2, 4, 16, 8
    T = 12 * world
    for case in _cases():
        gen = torch.Generator().manual_seed(7)
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[case["dtype"]]
        q = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
        k = torch.randn(B, T, case["hkv"], D, generator=gen, dtype=torch.float64)
        v = torch.randn(B, T, case["hkv"], Dv, generator=gen, dtype=torch.float64)
        do = torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64)
        # The single-process run: plain attention in fp64 on the inputs as the ranks see them.
        full = [t.to(dt).double().requires_grad_() for t in (q, k, v)]
        o_ref = cp.attention_reference(*full, causal=case["causal"])
        (o_ref * do).sum().backward()
        shard = lambda t: cp.zigzag_shard(t, dim=1, block=case["block"])  # noqa: E731
        loc = [shard(t.to(dt)).requires_grad_() for t in (q, k, v)]
        o = cp.ring_attention(*loc, causal=case["causal"], block=case["block"])
        stats = dict(cp.ring_attention_stats)
        (o.float() * shard(do).float()).sum().backward()
        err = {"o": _rel(o, shard(o_ref))}
        for name, x, ref in zip(("dq", "dk", "dv"), loc, full):
            err[name] = _rel(x.grad, shard(ref.grad))
        back = cp.zigzag_unshard(o, dim=1, block=case["block"])
        report["cases"].append(dict(case, errors=err, stats=stats, dtype_ok=o.dtype == dt,
                                    unshard_ok=bool(torch.equal(cp.zigzag_shard(back, dim=1, block=case["block"]), o))))
    x = torch.arange(T).view(1, T, 1).expand(2, T, 3).contiguous()
    report["layout"] = {
        "roundtrip": bool(torch.equal(cp.zigzag_unshard(cp.zigzag_shard(x, 1), 1), x)),
        "roundtrip_block1": bool(torch.equal(cp.zigzag_unshard(cp.zigzag_shard(x, 1, block=1), 1, block=1), x)),
        "positions": cp.zigzag_shard(x, 1)[0, :, 0].tolist(),
        "positions_block1": cp.zigzag_shard(x, 1, block=1)[0, :, 0].tolist(),
    }
    errors = {}
    if world > 1:
        try:
            cp.zigzag_shard(torch.zeros(1, 2 * world + 2, 1), dim=1)
        except ValueError as e:
            errors["shard"] = str(e)
        try:
            q = torch.zeros(1, 3, 2, 4)
            cp.ring_attention(q, q, q, block=1)
        except ValueError as e:
            errors["ring"] = str(e)
    report["bad_length_errors"] = errors
    if world == 4:  # two rings on interleaved process groups {0, 2} and {1, 3}, each on its own data
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mine = groups[rank % 2]
        gen = torch.Generator().manual_seed(100 + rank % 2)
        q, k, v, do = (torch.randn(1, 16, h, D, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
        full = [t.float().double().requires_grad_() for t in (q, k, v)]
        o_ref = cp.attention_reference(*full, causal=True)
        (o_ref * do).sum().backward()
        shard = lambda t: cp.zigzag_shard(t, dim=1, group=mine)  # noqa: E731
        loc = [shard(t.float()).requires_grad_() for t in (q, k, v)]
        o = cp.ring_attention(*loc, causal=True, group=mine)
        o.backward(shard(do.float()))
        report["subgroup_errors"] = [_rel(o, shard(o_ref))] + [_rel(x.grad, shard(r.grad)) for x, r in zip(loc, full)]
        report["subgroup_errors"].append(_rel(cp.zigzag_unshard(o.detach(), dim=1, group=mine), o_ref))
    return report


def worker_main(argv):
    out_dir = argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=world)
    try:
        report = _worker(rank, world)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


_REPORTS = {}


def reports(world):
    """Every rank's report for one world size (launched once per session)."""
    if world in _REPORTS:
        return _REPORTS[world]
    run = launch_workers(THIS, world, timeout=240)
    if run.timed_out:
        pytest.fail("ring attention workers did not finish within 240 s")
    for rank, rc in enumerate(run.returncodes):
        assert rc == 0, f"rank {rank} failed:\n{run.logs[rank]}"
    _REPORTS[world] = [run.reports[r] for r in range(world)]
    return _REPORTS[world]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_attention_equals_single_process(world):
    bad = []
    for rank, rep in enumerate(reports(world)):
        for c in rep["cases"]:
            tol = TOL[c["dtype"]]
            for name, e in c["errors"].items():
                if not e <= tol:
                    bad.append(f"rank {rank} {c['dtype']} causal={c['causal']} hkv={c['hkv']} block={c['block']}: "
                               f"{name} {e:.2e} > {tol:g}")
            assert c["dtype_ok"] and c["unshard_ok"], c
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("world", [2, 4])
def test_zigzag_layout(world):
    T = 12 * world
    b = T // (2 * world)
    for rank, rep in enumerate(reports(world)):
        lay = rep["layout"]
        assert lay["roundtrip"] and lay["roundtrip_block1"]
        assert lay["positions"] == list(range(rank * b, (rank + 1) * b)) + \
            list(range((2 * world - 1 - rank) * b, (2 * world - rank) * b))
    if world == 4:
        assert reports(4)[0]["layout"]["positions_block1"][:4] == [0, 7, 8, 15]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_causal_work_is_balanced(world):
    import deltacp.cp as cp

    T = 12 * world
    for block in (None, 1):
        work = [next(c for c in rep["cases"] if c["causal"] and c["block"] == block and c["dtype"] == "float32"
                     and c["hkv"] == 4)["stats"]["visible_pairs"] for rep in reports(world)]
        assert len(set(work)) == 1, (block, work)
        B, H = 2, 4
        assert sum(work) == B * H * T * (T + 1) // 2  # every visible pair counted once, somewhere
    # What the default layout's blocks make every rank compute (masked pairs of diagonal blocks
    # included): 2N + 1 block pairs of (T / 2N)^2 on every rank.
    computed = [next(c for c in rep["cases"] if c["causal"] and c["block"] is None and c["dtype"] == "float32"
                     and c["hkv"] == 4)["stats"]["computed_pairs"] for rep in reports(world)]
    assert computed == [2 * 4 * (2 * world + 1) * (T // (2 * world)) ** 2] * world, computed
    # The same count for contiguous slices: the last rank does 2N - 1 times the first rank's work
    # (up to the diagonal's share), the imbalance zig-zag removes.
    n = T // world
    contiguous = [cp.causal_pairs(torch.arange(r * n, (r + 1) * n), torch.arange(T)) for r in range(world)]
    assert contiguous[-1] / contiguous[0] > 2 * world - 2
    zz = [cp.causal_pairs(cp.zigzag_positions(T, world, r), torch.arange(T)) for r in range(world)]
    assert len(set(zz)) == 1


def test_ring_on_interleaved_process_groups():
    """4 processes as two rings {0, 2} and {1, 3} (group ranks differ from global ranks), each on its
    own data: every rank equals its ring's single-process attention (fp32 1e-5)."""
    for rank, rep in enumerate(reports(4)):
        assert max(rep["subgroup_errors"]) < 1e-5, (rank, rep["subgroup_errors"])


def test_bad_lengths_rejected():
    import deltacp.cp as cp

    for world in (2, 3, 4):
        for rank, rep in enumerate(reports(world)):
            errs = rep["bad_length_errors"]
            assert "argument 'x'" in errs["shard"] and f"divisible by {2 * world}" in errs["shard"], errs
            assert "argument 'q'" in errs["ring"] and f"T = {3 * world}" in errs["ring"], errs
    with pytest.raises(ValueError, match="argument 'T'.*divisible by 8"):
        cp.zigzag_positions(10, 4, 0)
    with pytest.raises(ValueError, match="argument 'block'"):
        cp.zigzag_positions(16, 4, 0, block=0)
    q = torch.zeros(1, 3, 2, 4)
    with pytest.raises(ValueError, match="argument 'q'.*divisible by 2"):
        cp.ring_attention(q, q, q)
    with pytest.raises(ValueError, match="argument 'k'.*heads"):
        cp.ring_attention(torch.zeros(1, 4, 3, 4), torch.zeros(1, 4, 2, 4), torch.zeros(1, 4, 2, 4))
    with pytest.raises(TypeError, match="argument 'k'"):
        cp.ring_attention(q[:, :2], q[:, :2].double(), q[:, :2])


def test_step_kind_from_the_environment(monkeypatch):
    import deltacp.cp as cp

    q = torch.zeros(1, 4, 2, 8)
    monkeypatch.setenv("DELTACP_RING_KERNEL", "fast")
    with pytest.raises(ValueError, match="DELTACP_RING_KERNEL.*auto, deltacp, flash, torch"):
        cp.ring_attention(q, q, q)
    monkeypatch.setenv("DELTACP_RING_KERNEL", "flash")  # CPU tensors: the torch block compute regardless
    assert torch.equal(cp.ring_attention(q, q, q), torch.zeros(1, 4, 2, 8))


def test_single_rank_matches_sdpa():
    """World 1 without torch.distributed: the ring is plain attention (against torch's own SDPA)."""
    import torch.nn.functional as F

    import deltacp.cp as cp

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 10, 4, 8, generator=gen, requires_grad=True) for _ in range(3))
    o = cp.ring_attention(q, k, v, causal=True)
    o_ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True).transpose(1, 2)
    assert _rel(o, o_ref) < 1e-6


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker_main(sys.argv[1:])
