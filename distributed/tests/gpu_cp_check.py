"""GPU checks of context parallelism (run by run_gpu_cp.sh under torchrun on 2+ GPUs).

    torchrun --nproc_per_node=2 distributed/tests/gpu_cp_check.py check        [--out DIR]
    torchrun --nproc_per_node=2 distributed/tests/gpu_cp_check.py sleep|exit   [--out DIR]

check: (1) the CP pre-pass kernels ([H | M], [dH | M^T]) against the CPU reference's augmented run,
       every variant, fp32 and bf16 inputs; (2) CP over NCCL against one GPU (the same CUDA tier, whole
       batch) on o, every gradient, summed final states and initial-state gradients: fp32 1e-5,
       bf16 3e-3 (gdn) / 8e-3 (kda, dplr, delta), relative per tensor; shapes: a sequence spanning
       every rank, many short sequences, cuts inside a chunk, T not divisible by the chunk; (3) bitwise
       identical results run to run, and with the staged local kernels (DELTACP_CP_STAGED) on and off; (4) mismatched cu_seqlens -> the same ValueError on every rank,
       and ranks calling with different shapes -> the same ValueError naming q on every rank; (5) a second
       thread calling the communicator while a first waits inside a call -> a RuntimeError saying so.
--shared-gpu: every rank on GPU 0, exchanging over gloo (CUDA tensors, no deltacp NCCL communicator): the
       CP ops' GPU path (staged local kernels, the cut's piece maps, the composition, the merge) checked
       on a machine with one GPU; the communicator itself (timeouts, abort) is then not exercised.
sleep / exit: rank 1 stalls (or exits) in its pre-pass, before the all-gather; every other
       rank must raise within the context's timeout (10 s) instead of hanging or crashing, and a second
       call on the same context must raise at once (the communicator is dead for good) naming the
       first failure. faulthandler is on: a crash prints every thread's Python stack to the log.
Each rank writes cp_gpu_<mode>_rank<r>.json under --out (default $OUT or .); exit status non-zero
on any failure.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import sys
import threading
import time

faulthandler.enable(all_threads=True)  # a SIGSEGV / SIGABRT prints the Python stacks to stderr

import torch
import torch.distributed as dist
import torch.nn.functional as F

import deltacp
import deltacp.cp as cp
from deltacp.cp import autograd as cp_autograd, local as cp_local

TOL = {"float32": 1e-5, "bfloat16": {"gdn": 3e-3, "kda": 8e-3, "dplr": 8e-3, "delta": 8e-3}}
FAULT_TIMEOUT_S = 10.0
USE_NCCL = None  # build_context's use_nccl: None (deltacp's NCCL communicator when built), False with --shared-gpu


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def inputs(variant, seqlens, H, HV, K, V, dtype, device, seed=0, states=True):
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for s in seqlens:
        cu.append(cu[-1] + s)
    T, N = cu[-1], len(seqlens)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = {"q": rnd(1, T, H, K), "k": F.normalize(rnd(1, T, H, K), dim=-1), "v": rnd(1, T, HV, V)}
    if variant == "gdn":
        x["g"] = F.logsigmoid(rnd(1, T, HV) + 3.0) * 0.5
    elif variant in ("kda", "dplr"):
        x["g"] = F.logsigmoid(rnd(1, T, HV, K) + 3.0) * 0.5
    if variant == "dplr":
        kk = F.normalize(rnd(1, T, HV, K), dim=-1)
        x["a"], x["b"] = -kk * 0.5, kk * 0.5 * torch.sigmoid(rnd(1, T, HV, 1))
    else:
        x["beta"] = torch.sigmoid(rnd(1, T, HV))
    x = {n: t.to(device=device, dtype=dtype) for n, t in x.items()}
    if states:
        x["h0"] = (rnd(N, HV, K, V) * 0.5).to(device=device, dtype=torch.float32)
    do = rnd(1, T, HV, V).to(device=device, dtype=dtype)
    dht = rnd(N, HV, K, V).to(device=device, dtype=torch.float32) if states else None
    return cu, x, do, dht


def call(variant, x, chunk, states, cp_context=None, cu=None, backend=None):
    kw = dict(initial_state=x.get("h0"), output_final_state=states, chunk_size=chunk)
    if backend is not None:
        kw["backend"] = backend
    if cp_context is not None:
        kw["cp_context"] = cp_context
        fns = {"gdn": cp.chunk_gated_delta_rule_cp, "kda": cp.chunk_kda_cp, "delta": cp.chunk_delta_rule_cp,
               "dplr": cp.chunk_dplr_cp}
    else:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64, device=x["q"].device)
        fns = {"gdn": deltacp.chunk_gated_delta_rule, "kda": deltacp.chunk_kda, "delta": deltacp.chunk_delta_rule,
               # the tiled DPLR tier is opt-in by name through deltacp.dplr's op (deltacp.chunk_dplr lists the
               # tiers cuda_supports() names)
               "dplr": deltacp.chunk_dplr_delta_rule if backend == "tiled" else deltacp.chunk_dplr}
    if variant == "dplr":
        return fns[variant](x["q"], x["k"], x["v"], x["a"], x["b"], x["g"], **kw)
    if variant == "delta":
        return fns[variant](x["q"], x["k"], x["v"], x["beta"], **kw)
    return fns[variant](x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)


class _Cfg:  # the fields of deltacp.cp.local._Cfg the pre-pass reads
    pass


def check_prepass(device, report):
    """The pre-pass kernels against the reference's augmented run on the CPU (fp32)."""
    from deltacp.cp import nccl_backend

    out = []
    for variant in ("gdn", "kda", "delta", "dplr"):
        for dtype in (torch.float32, torch.bfloat16):
            for n in (1, 63, 64, 65, 300):
                H, HV, K, V = (2, 2, 64, 32) if variant == "dplr" else (2, 4, 64, 32)
                cu, x, do, _ = inputs(variant, [n], H, HV, K, V, dtype, device, seed=n)
                cfg = _Cfg()
                cfg.variant, cfg.scale, cfg.chunk_size = variant, None, 64
                cfg.H, cfg.HV, cfg.K, cfg.V = H, HV, K, V
                cfg.state_dtype, cfg.compute, cfg.gate_name = torch.float32, "float32", "gk" if variant == "dplr" else "g"
                start = torch.randn(HV, K, V, device=device)
                g, beta, a, b = x.get("g"), x.get("beta"), x.get("a"), x.get("b")
                gpu_f = nccl_backend.prepass_forward(cfg, x["q"], x["k"], x["v"], g, beta, a, b, start)
                gpu_b = nccl_backend.prepass_backward(cfg, x["q"], x["k"], x["v"], g, beta, a, b, do, start)
                cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
                cfg.device, cfg.fwd_method, cfg.bwd_method = torch.device("cpu"), "chunked", "chunked"
                ref_f = cp_local._augmented_forward(cfg, *[cpu(t) for t in (x["q"], x["k"], x["v"], g, beta, a, b)],
                                                  start.cpu())
                ref_b = cp_local._augmented_backward(cfg, *[cpu(t) for t in (x["q"], x["k"], x["v"], g, beta, a, b)],
                                                   do.cpu(), start.cpu())
                ef, eb = rel(gpu_f, ref_f), rel(gpu_b, ref_b)
                ok = ef <= 1e-5 and eb <= 1e-5
                row = dict(variant=variant, dtype=str(dtype), n=n, err_fwd=ef, err_bwd=eb, ok=ok)
                # The route deltacp.cp takes for tiled variants: the tiled tier's state-only modes
                # (final-state-only forward, dh0-only backward) on the augmented problem (dplr: the tiled DPLR
                # tier, which CP runs with backend="tiled").
                if deltacp._core.cuda_supports(variant, "tiled", True) or variant == "dplr":
                    cfg.device = device
                    tf = cp_local._augmented_forward(cfg, x["q"], x["k"], x["v"], g, beta, a, b, start, method="tiled")
                    tb = cp_local._augmented_backward(cfg, x["q"], x["k"], x["v"], g, beta, a, b, do, start,
                                                    method="tiled")
                    tol = 1e-5 if dtype == torch.float32 else 2e-2  # 16-bit operands in the tensor-core products
                    row.update(err_fwd_tiled=rel(tf, ref_f), err_bwd_tiled=rel(tb, ref_b), tol_tiled=tol)
                    row["ok"] = ok and row["err_fwd_tiled"] <= tol and row["err_bwd_tiled"] <= tol
                    # The same in pieces run side by side (one varlen call) and composed in fp32.
                    bounds = {65: [0, 64, 65], 300: [0, 20, 84, 212, 300]}.get(n)
                    if bounds:
                        pf = cp_local._augmented_forward(cfg, x["q"], x["k"], x["v"], g, beta, a, b, start,
                                                       method="tiled", bounds=bounds)
                        pb = cp_local._augmented_backward(cfg, x["q"], x["k"], x["v"], g, beta, a, b, do, start,
                                                        method="tiled", bounds=bounds)
                        row.update(err_fwd_pieces=rel(pf, ref_f), err_bwd_pieces=rel(pb, ref_b), bounds=bounds)
                        row["ok"] = row["ok"] and row["err_fwd_pieces"] <= tol and row["err_bwd_pieces"] <= tol
                out.append(row)
    report["prepass"] = out
    return all(r["ok"] for r in out)


def check_cp(device, world, report):
    ok_all = True
    T = 1000 * world + 24  # T / world not a multiple of the chunk: cuts inside chunks
    span = [37, T - 37 - 11, 11]  # the middle sequence spans every rank
    many = [7, 1, 64, 65, 3, 128, 17] * 4
    many.append(T - sum(many))
    rows = []
    # dplr twice: the default (naive) tier, and the tiled DPLR tier for the local pass and the pre-pass
    for variant, backend in (("gdn", None), ("kda", None), ("dplr", None), ("dplr", "tiled"), ("delta", None)):
        if not deltacp._core.cuda_supports(variant, "tiled", True) and not deltacp._core.cuda_supports(
                variant, "naive", True):
            rows.append(dict(variant=variant, skipped="no CUDA tier with a backward for this variant"))
            continue
        cases = [("float32", span, True, False), ("bfloat16", span, True, False),
                 ("float32", many, False, False), ("bfloat16", many, True, False)]
        if variant in ("gdn", "kda"):
            # The benchmark's shape, smaller: bf16, K = V = 128, 16 heads, one sequence of 16K tokens per rank
            # (plus a short one), so that the local scan takes the Hopper (wgmma) kernel and cuts the long
            # segments into pieces (cuda/tiled/scan_split.cu), and the pre-pass composes those pieces' maps.
            cases.append(("bfloat16", [16384 * world - 5, 5], True, True))
        for dtype_name, seqlens, states, hopper_shape in cases:
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
            H, HV, K, V = (4, 4, 64, 64) if variant == "dplr" else (4, 8, 64, 64)
            if hopper_shape:
                H, HV, K, V = 16, 16, 128, 128
            cu, x, do, dht = inputs(variant, seqlens, H, HV, K, V, dtype, device, seed=7, states=states)
            ctx = cp.build_context(torch.tensor(cu), device=device, timeout=60, use_nccl=USE_NCCL)

            def cp_run():
                loc = {n: (t if n == "h0" else cp.split_even(t, ctx)).detach().clone().requires_grad_()
                       for n, t in x.items()}
                o, ht = call(variant, loc, 64, states, cp_context=ctx, backend=backend)
                loss = (o.float() * cp.split_even(do, ctx).float()).sum()
                if ht is not None:
                    loss = loss + (ht * dht).sum()
                loss.backward()
                torch.cuda.synchronize(device)
                return o.detach(), ht, {n: loc[n].grad for n in loc}

            o, ht, grads = cp_run()
            o2, ht2, grads2 = cp_run()
            bitwise = bool(torch.equal(o, o2) and all(torch.equal(grads[n], grads2[n]) for n in grads))
            # The staged local backward (prepared before the exchange, the pre-pass from its stages) must
            # give exactly what the one-shot local backward after the exchange gives.
            os.environ["DELTACP_CP_STAGED"] = "0"
            try:
                o3, _, grads3 = cp_run()
            finally:
                os.environ.pop("DELTACP_CP_STAGED")
            staged_equal = bool(torch.equal(o, o3) and all(torch.equal(grads[n], grads3[n]) for n in grads))
            full = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
            o_ref, ht_ref = call(variant, full, 64, states, cu=cu, backend=backend)
            loss = (o_ref.float() * do.float()).sum()
            if ht_ref is not None:
                loss = loss + (ht_ref * dht).sum()
            loss.backward()
            err = {"o": rel(o, cp.split_even(o_ref, ctx))}
            for n in full:
                if n == "h0":
                    total = grads[n].clone()
                    dist.all_reduce(total)
                    err["dh0"] = rel(total, full[n].grad)
                else:
                    err["d" + n] = rel(grads[n], cp.split_even(full[n].grad, ctx))
            if ht is not None:
                total = ht.detach().clone()
                dist.all_reduce(total)
                err["ht"] = rel(total, ht_ref)
            tol = TOL[dtype_name] if dtype_name == "float32" else TOL[dtype_name][variant]
            # backend="tiled" for dplr: every rank ran the tiled DPLR tier (the inputs are in its range)
            local_tier = dict(cp.last_stats.get("local_tier", {}))
            tier_ok = backend is None or local_tier.get("forward") == backend
            ok = all(e <= tol for e in err.values()) and bitwise and staged_equal and tier_ok
            ok_all &= ok
            row = dict(variant=variant, backend=backend, local_tier=local_tier, dtype=dtype_name, seqlens=len(seqlens), states=states, K=K, errors=err,
                       tol=tol, bitwise=bitwise, staged_equals_one_shot=staged_equal, ok=ok, plan=ctx.describe(), exchange_bytes=dict(cp.last_stats))
            if dtype_name == "bfloat16" and not hopper_shape:  # (the fp64 CPU run of the large shape is slow)
                # For the record (not judged): each side's own error against the fp64 reference on the same
                # bf16-rounded inputs (CPU), to tell a CP error from the two runs' independent roundings.
                exact = {n: t.detach().double().cpu().requires_grad_() for n, t in x.items()}
                o64, ht64 = call(variant, exact, 64, states, cu=cu)
                loss = (o64 * do.double().cpu()).sum()
                if ht64 is not None:
                    loss = loss + (ht64 * dht.double().cpu()).sum()
                loss.backward()
                row["vs_fp64"] = {
                    "cp_o": rel(o.double().cpu(), cp.split_even(o64, ctx)),
                    "single_o": rel(cp.split_even(o_ref, ctx).double().cpu(), cp.split_even(o64, ctx)),
                    "cp_dk": rel(grads["k"].double().cpu(), cp.split_even(exact["k"].grad, ctx)),
                    "single_dk": rel(cp.split_even(full["k"].grad, ctx).double().cpu(),
                                     cp.split_even(exact["k"].grad, ctx)),
                }
            rows.append(row)
    report["cp"] = rows
    # mismatched cu_seqlens: the same ValueError naming cu_seqlens on every rank
    cu_bad = [0, 64 * world] if dist.get_rank() == 0 else [0, 32, 64 * world]
    try:
        cp.build_context(torch.tensor(cu_bad), device=device, timeout=30, use_nccl=USE_NCCL)
        report["mismatch"] = dict(raised=None, ok=False)
    except ValueError as exc:
        report["mismatch"] = dict(raised="ValueError", message=str(exc), ok="'cu_seqlens'" in str(exc))
    ok_all &= report["mismatch"]["ok"]
    # ranks that disagree on a call's shapes (here the number of query heads): the fingerprint check of
    # that call raises the same ValueError naming q on every rank, before anything is exchanged
    T_call = 128 * world
    ctx = cp.build_context(torch.tensor([0, T_call]), device=device, timeout=30, use_nccl=USE_NCCL)
    H_call = 4 if dist.get_rank() == 0 else 2
    _, x, _, _ = inputs("gdn", [T_call], H_call, 8, 64, 64, torch.bfloat16, device, seed=3, states=False)
    loc = {n: cp.split_even(t, ctx) for n, t in x.items()}
    try:
        call("gdn", loc, 64, False, cp_context=ctx)
        torch.cuda.synchronize(device)
        report["mismatch_call"] = dict(raised=None, ok=False)
    except ValueError as exc:
        report["mismatch_call"] = dict(raised="ValueError", message=str(exc), ok="'q'" in str(exc))
    ok_all &= report["mismatch_call"]["ok"]
    return ok_all


def check_one_caller(device, world, report):
    """One thread at a time per communicator (cp.h OneCaller): while a thread of rank 0 waits inside an
    all-gather (rank 1 joins it 3 s late), a second thread's call raises a RuntimeError saying so, the first
    call completes, and the context works afterwards."""
    from deltacp.cp import nccl_backend

    rank = dist.get_rank()
    ctx = cp.build_context(torch.tensor([0, 128 * world]), device=device, timeout=60, use_nccl=USE_NCCL)
    if ctx.nccl is None:
        report["one_caller"] = dict(skipped="no deltacp NCCL communicator", ok=True)
        return True
    x = torch.full((1024,), float(rank + 1), device=device)
    row = {}
    if rank == 0:
        def first():
            try:
                row["first"] = nccl_backend.all_gather(ctx, x, "the first thread's all-gather")[:, 0].tolist()
            except Exception as exc:  # noqa: BLE001
                row["first"] = repr(exc)

        thread = threading.Thread(target=first)
        thread.start()
        time.sleep(1.0)  # the first thread now waits inside the all-gather for rank 1
        try:
            nccl_backend.all_gather(ctx, x, "the second thread's all-gather")
            row["second"] = None
        except RuntimeError as exc:
            row["second"] = str(exc)
        thread.join()
    else:
        time.sleep(3.0)
        row["first"] = nccl_backend.all_gather(ctx, x, "the first all-gather")[:, 0].tolist()
    row["after"] = nccl_backend.all_gather(ctx, x, "an all-gather afterwards")[:, 0].tolist()
    expected = [float(r + 1) for r in range(world)]
    row["ok"] = (row["first"] == expected and row["after"] == expected and not ctx.nccl.aborted
                 and (rank != 0 or "another thread" in (row["second"] or "")))
    report["one_caller"] = row
    return row["ok"]


def fault(mode, device, world, report):
    rank = dist.get_rank()
    cu, x, do, dht = inputs("gdn", [100, 2048 * world - 100], 4, 4, 64, 64, torch.bfloat16, device)
    ctx = cp.build_context(torch.tensor(cu), device=device, timeout=FAULT_TIMEOUT_S, use_nccl=USE_NCCL)
    if rank == 1:
        original = cp_autograd._prepass_forward

        def stalled(*args, **kwargs):
            if mode == "exit":
                sys.stdout.flush()
                os._exit(0)
            time.sleep(3 * FAULT_TIMEOUT_S)
            return original(*args, **kwargs)

        cp_autograd._prepass_forward = stalled
    loc = {n: (t if n == "h0" else cp.split_even(t, ctx)) for n, t in x.items()}
    t0 = time.time()
    try:
        call("gdn", loc, 64, True, cp_context=ctx)
        torch.cuda.synchronize(device)
        report.update(raised=None, seconds=time.time() - t0)
    except Exception as exc:  # noqa: BLE001
        report.update(raised=type(exc).__name__, message=str(exc), seconds=time.time() - t0)
    print(f"[rank {rank}] {mode}: first call -> {report.get('raised')} after {report['seconds']:.1f} s", flush=True)
    if rank != 1 and report["raised"] is not None:
        # The communicator is dead for good: a second call must raise at once, before any NCCL or
        # CUDA work, naming the first failure; CUDA itself must still be usable.
        t1 = time.time()
        try:
            call("gdn", loc, 64, True, cp_context=ctx)
            report.update(second_raised=None)
        except Exception as exc:  # noqa: BLE001
            report.update(second_raised=type(exc).__name__, second_message=str(exc))
        report["second_seconds"] = time.time() - t1
        report["cuda_usable_after"] = bool(torch.ones(4, device=device).sum().item() == 4.0)
        report["communicator_failure"] = ctx.nccl.failure if ctx.nccl is not None else None
    if rank == 1:
        report["ok"] = True  # the victim itself is not judged
    else:
        report["ok"] = (report["raised"] in ("CPTimeoutError", "RuntimeError")
                        and report["seconds"] < FAULT_TIMEOUT_S + 10
                        and (ctx.nccl is None or (report.get("second_raised") == "RuntimeError"
                                                  and "shut down" in report.get("second_message", "")
                                                  and report["second_seconds"] < 5.0))
                        and report.get("cuda_usable_after", False))
    return report["ok"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("check", "sleep", "exit"))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--shared-gpu", action="store_true",
                   help="every rank on GPU 0, exchanging over gloo (a machine with one GPU: NCCL refuses two ranks "
                        "on one device)")
    args = p.parse_args()
    global USE_NCCL
    local = 0 if args.shared_gpu else int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    if args.shared_gpu:
        USE_NCCL = False
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    else:
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120), device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    from deltacp.cp import nccl_backend

    report = {"mode": args.mode, "rank": rank, "world": world, "device": torch.cuda.get_device_name(device),
              "shared_gpu": args.shared_gpu}

    report["nccl_module"] = nccl_backend.available()
    ok = False
    try:
        if args.mode == "check":
            ok = check_prepass(device, report) if nccl_backend.available() else True
            ok = check_cp(device, world, report) and ok
            ok = check_one_caller(device, world, report) and ok
        else:
            ok = fault(args.mode, device, world, report)
    except Exception as exc:  # noqa: BLE001
        import traceback

        report["exception"] = traceback.format_exc()
        print(report["exception"], file=sys.stderr)
    report["ok"] = bool(ok)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"cp_gpu_{args.mode}_rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"[rank {rank}] {args.mode}: {'OK' if ok else 'FAIL'}", flush=True)
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # no NCCL teardown after a fault


if __name__ == "__main__":
    main()
