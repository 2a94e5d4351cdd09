"""Shared helpers for the deltacp Python tests: random problems in FLA's layouts, the error metric, and the
launcher of multi-process (gloo) workers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

VARIANTS = ("delta", "gdn", "kda", "dplr")


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| (docs/design.md section 7); absolute when ref is zero."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    den = np.linalg.norm(ref)
    num = np.linalg.norm(x - ref)
    return float(num / den) if den > 0 else float(num)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _normalize(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_problem(variant, B=2, T=37, H=2, K=8, V=6, HV=None, seed=0, cu_seqlens=None, h0=True):
    """Random float64 inputs: dict(q, k, v, [g], [beta], [a, b], initial_state, cu_seqlens) in FLA's layouts.

    Keys are L2-normalised, gates are log-sigmoids (<= 0), beta in (0, 1); dplr uses a = -kk,
    b = kk * sigmoid(.) with a unit kk so its transition diag(e^gk) - s kk kk^T stays contractive.
    dplr ignores HV (it needs HV == H).
    """
    rng = np.random.default_rng(seed)
    HV = H if (HV is None or variant == "dplr") else HV  # dplr has no grouped values
    if cu_seqlens is not None:
        B = 1
        T = int(cu_seqlens[-1])
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    p = {
        "q": rng.standard_normal((B, T, H, K)),
        "k": _normalize(rng.standard_normal((B, T, H, K))),
        "v": rng.standard_normal((B, T, HV, V)),
    }
    if variant == "gdn":
        p["g"] = np.log(_sigmoid(rng.standard_normal((B, T, HV)) + 2.0))
    elif variant in ("kda", "dplr"):
        p["g"] = np.log(_sigmoid(rng.standard_normal((B, T, HV, K)) + 2.0))
    if variant == "dplr":
        kk = _normalize(rng.standard_normal((B, T, HV, K)))
        p["a"] = -kk
        p["b"] = kk * _sigmoid(rng.standard_normal((B, T, HV, 1)))
    else:
        p["beta"] = _sigmoid(rng.standard_normal((B, T, HV)))
    p["initial_state"] = 0.5 * rng.standard_normal((N, HV, K, V)) if h0 else None
    p["cu_seqlens"] = None if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int64)
    return p


def rwkv7_inputs(rng, B, T, H, K, V):
    """FLA's RWKV-7 layer inputs, float64: r, k, v ~ randn; w = -exp(-0.5) sigmoid(.) (the log decay);
    a = -kk and b = kk * sigmoid(.) (the in-context learning rate) with kk a unit row."""
    r = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    v = rng.standard_normal((B, T, H, V))
    w = -np.exp(-0.5) / (1.0 + np.exp(-rng.standard_normal((B, T, H, K))))
    kk = rng.standard_normal((B, T, H, K))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    iclr = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H, K))))
    return dict(r=r, w=w, k=k, v=v, a=-kk, b=kk * iclr)


def ref_forward(ref, variant, p, **kw):
    """Calls deltacp.reference's forward of `variant` on a make_problem dict."""
    common = dict(initial_state=p["initial_state"], cu_seqlens=p["cu_seqlens"], **kw)
    if variant == "gdn":
        return ref.gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], **common)
    if variant == "kda":
        return ref.kda(p["q"], p["k"], p["v"], p["g"], p["beta"], **common)
    if variant == "delta":
        return ref.delta_rule(p["q"], p["k"], p["v"], p["beta"], **common)
    return ref.dplr(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], **common)


def ref_backward(ref, variant, p, do, dht=None, **kw):
    """Calls deltacp.reference's backward of `variant`; dplr's dgk is renamed dg for uniform checks."""
    common = dict(dht=dht, initial_state=p["initial_state"], cu_seqlens=p["cu_seqlens"], **kw)
    if variant == "gdn":
        return ref.gated_delta_rule_backward(p["q"], p["k"], p["v"], p["g"], p["beta"], do, **common)
    if variant == "kda":
        return ref.kda_backward(p["q"], p["k"], p["v"], p["g"], p["beta"], do, **common)
    if variant == "delta":
        return ref.delta_rule_backward(p["q"], p["k"], p["v"], p["beta"], do, **common)
    grads = ref.dplr_backward(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], do, **common)
    grads["dg"] = grads.pop("dgk")
    return grads


def input_names(variant):
    """The differentiable inputs of a make_problem dict, in order."""
    names = ["q", "k", "v"]
    if variant != "delta":
        names.append("g")
    names += ["a", "b"] if variant == "dplr" else ["beta"]
    return names


def call_torch_op(variant, t, **kw):
    """Calls deltacp's torch op for the variant with FLA's positional order (t: tensors by name)."""
    import deltacp

    op = {"gdn": deltacp.chunk_gated_delta_rule, "kda": deltacp.chunk_kda, "delta": deltacp.chunk_delta_rule,
          "dplr": deltacp.chunk_dplr}[variant]
    if variant == "delta":
        return op(t["q"], t["k"], t["v"], t["beta"], **kw)
    if variant == "dplr":
        return op(t["q"], t["k"], t["v"], t["a"], t["b"], t["g"], **kw)
    return op(t["q"], t["k"], t["v"], t["g"], t["beta"], **kw)


class WorkerRun(NamedTuple):
    """What launch_workers saw of its workers, each list in rank order."""

    reports: dict  # {rank: parsed rank{rank}.json} of the ranks that wrote one
    logs: list  # each rank's stdout and stderr
    returncodes: list  # each rank's exit status (negative: killed by that signal)
    timed_out: list  # the ranks killed at the deadline (not those killed for being outside wait_for)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_workers(script, world, worker_args=(), timeout=240.0, wait_for=None) -> WorkerRun:
    """Runs `world` processes of `python script worker *worker_args <out dir>` on localhost and collects their reports.

    Each process gets RANK, WORLD_SIZE, MASTER_PORT (one free port for all) and OMP_NUM_THREADS=1 in its
    environment and writes its report to <out dir>/rank{RANK}.json (a temporary directory). All of them share one
    deadline, `timeout` seconds from the start; a process still running at the deadline is killed. With `wait_for`
    (ranks), the other ranks are killed as soon as those have been waited for (a stalled victim).
    """
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, str(script), "worker", *worker_args, tmp], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs, timed_out = [""] * world, []
        deadline = time.time() + timeout
        waited = set(range(world) if wait_for is None else wait_for)
        for rank in sorted(range(world), key=lambda r: r not in waited):
            p = procs[rank]
            if rank not in waited:
                p.kill()
            try:
                logs[rank], _ = p.communicate(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                logs[rank], _ = p.communicate()
                timed_out.append(rank)
        reports = {}
        for rank in range(world):
            f = Path(tmp) / f"rank{rank}.json"
            if f.exists():
                reports[rank] = json.loads(f.read_text())
        return WorkerRun(reports, logs, [p.returncode for p in procs], sorted(timed_out))


def gloo_case_worker(argv, cases, compare, timeout_s=120):
    """The body of a worker process of launch_workers that shares GPU 0 with the others over gloo: every case of
    cases() through compare(case, rank, world) -> a JSON-able dict (or {"exception": text} where it raised, for
    the test to fail naming it), written to <argv[0]>/rank{RANK}.json; then the process exits at once."""
    import datetime
    import traceback

    import torch
    import torch.distributed as dist

    out_dir = Path(argv[0])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    report = {}
    for case in cases(world):
        try:
            report[case["name"]] = compare(case, rank, world)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails naming it
            report[case["name"]] = dict(exception=f"{exc!r}\n{traceback.format_exc()}")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)


def require_fused_gpu():
    """Skips the test unless a compute capability 9.0 GPU and a deltacp with the CUDA tiers are here (the fused
    tier's kernels are sm_90a)."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import deltacp

    if not deltacp.built_with_cuda():
        pytest.skip("deltacp built without the CUDA tiers")
    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the fused tier runs on compute capability 9.0")


def cp_against_one_process(run, x, h0, do, dht, cu, ctx, device):
    """run(inputs, h0, **kw) -> (o, ht): one op, called on this rank's slice of the inputs x with cp_context=ctx and
    over the whole packed batch in one process (cu_seqlens=cu), each followed by the backward of
    sum(o do) + sum(ht dht). Returns (errors, local_tier, last_cuda_tier): the relative errors of o, every input's
    gradient and, with states, of the final states and initial-state gradients summed over the ranks;
    deltacp.cp.last_stats["local_tier"] and deltacp.last_cuda_tier()'s tier after the CP call's backward."""
    import torch
    import torch.distributed as dist

    import deltacp
    import deltacp.cp as cp

    def rel(a, ref):
        return rel_err(a.detach().double().cpu().numpy(), ref.detach().double().cpu().numpy())

    def loss_of(o, ht, do_, dht_):
        loss = (o.float() * do_.float()).sum()
        return loss + (ht * dht_).sum() if ht is not None else loss

    loc = {n: cp.split_even(t, ctx).detach().clone().requires_grad_() for n, t in x.items()}
    h_loc = None if h0 is None else h0.clone().requires_grad_()
    o, ht = run(loc, h_loc, cp_context=ctx)
    tier = dict(cp.last_stats["local_tier"])
    loss_of(o, ht, cp.split_even(do, ctx), dht).backward()
    torch.cuda.synchronize(device)
    last = deltacp.last_cuda_tier()[0]

    full = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    h_full = None if h0 is None else h0.clone().requires_grad_()
    o_ref, ht_ref = run(full, h_full, cu_seqlens=torch.tensor(cu, device=device), cu_seqlens_cpu=torch.tensor(cu))
    loss_of(o_ref, ht_ref, do, dht).backward()
    err = {"o": rel(o, cp.split_even(o_ref, ctx))}
    for n in full:
        err["d" + n] = rel(loc[n].grad, cp.split_even(full[n].grad, ctx))
    if ht is not None:  # each rank holds the rows of its own sequences: summed over the ranks (on the host)
        ht_sum, dh0_sum = ht.detach().cpu(), h_loc.grad.detach().cpu()
        dist.all_reduce(ht_sum)
        dist.all_reduce(dh0_sum)
        err["ht"] = rel(ht_sum, ht_ref)
        err["dh0"] = rel(dh0_sum, h_full.grad)
    return err, tier, last
