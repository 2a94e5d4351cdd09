"""bench/cp/bench_cp.py — the CP state exchange, four ways, side by side (docs/design.md section 4).

    torchrun --nproc_per_node=2 bench/cp/bench_cp.py                       # GPUs: NCCL, bf16 GDN, H=16, K=V=128
    torchrun --nproc_per_node=4 bench/cp/bench_cp.py --device cpu --tokens 256 --heads 2 --head-dim 16   # smoke

One sequence spans every rank (the worst case: rank r folds r earlier maps). Each rank holds its
pre-pass result [H_r | M_r] ([HV, K, V + K] fp32; on GPUs made by the real pre-pass kernel from
random GDN inputs of --tokens per rank). Measured, median of --repeat after warm-up:

  prepass        the pre-pass kernel alone (GPU, deltacp._cp_nccl)
  allgather      one all-gather of [H | M] (world x HV K (V + K) fp32 received per rank) + the merge
                 fold S <- M_j S + H_j over the earlier ranks (the merge kernel on GPUs)
  ring           the state passed rank to rank: S_{r+1} = M_r S_r + H_r, send S (HV K V fp32) to r + 1;
                 O(KV) traffic per rank but world - 1 serial hops
  scan           a log-depth (Hillis-Steele) scan over the affine maps: ceil(log2 world) rounds, in
                 round s rank r receives the composed map of ranks [r - 2^(s+1) + 1, r - 2^s] and
                 composes (M, H) <- (M M_j, M H_j + H); the initial state is the exclusive prefix
  overlap        the local forward (zero initial state) alone, and concurrently with prepass +
                 allgather + merge on a second stream: how much of the exchange the intra-chunk work
                 could hide (the local kernels do not yet split out the state-independent part)

Every method's initial state is checked against the all-gather's (relative error printed). Rank 0
prints a table and writes JSON to $OUT/bench_cp.json (or --json).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist


def start_process_group(device_name: str, timeout_s: float) -> torch.device:
    """This rank's device (cuda:LOCAL_RANK, made current; or the CPU) and the default process group over it: NCCL
    on GPUs, gloo on CPUs, with timeout_s for a collective. The CP benches start their ranks through it."""
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return device


def add_problem_args(p: argparse.ArgumentParser) -> None:
    """The CP benches' shared arguments: the device, one sequence's tokens per rank, heads, K = V, dtype, and how
    many timed and warm-up calls."""
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tokens", type=int, default=32768, help="tokens per rank")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)


def parse():
    p = argparse.ArgumentParser()
    add_problem_args(p)
    p.add_argument("--json", default=None)
    p.add_argument("--pieces", default="0,2048,4096,8192,16384",
                   help="pre-pass piece lengths (tokens) to time; 0 = one sequential scan over the span")
    p.add_argument("--scan", default="",
                   help="state-scan configurations BV:STAGES (DELTACP_TILED_SCAN_BV / _STAGES, 0 = the kernel's "
                        "choice), comma-separated: the local forward and the staged pre-pass at each piece "
                        "length are timed with each")
    p.add_argument("--profile", action="store_true", help="per-kernel CUDA times of the CP and one-GPU steps")
    p.add_argument("--trace", default="", help="a folder: each rank writes the chrome trace (CPU + CUDA) of "
                   "one CP forward + backward step there (cp_step_rank<r>.json); the GPU's activity alone unless "
                   "--trace-cpu (the CPU side's tracing delays the host, which shows as GPU gaps)")
    p.add_argument("--trace-cpu", action="store_true", help="--trace records the CPU side too")
    p.add_argument("--host-profile", default="", help="a folder: each rank writes where the host's time goes in "
                   "20 CP forward steps (cProfile, by cumulative time; waits included) to host_fwd_rank<r>.txt")
    a = p.parse_args()
    a.pieces = [int(x) for x in a.pieces.split(",") if x.strip()]
    a.scan = [tuple(int(y) for y in x.split(":")) for x in a.scan.split(",") if x.strip()]
    return a


@contextlib.contextmanager
def scan_env(bv: int, stages: int):
    """DELTACP_TILED_SCAN_BV / _STAGES set for the block (0: left to the kernel's choice)."""
    names = {"DELTACP_TILED_SCAN_BV": bv, "DELTACP_TILED_SCAN_STAGES": stages}
    for name, value in names.items():
        if value:
            os.environ[name] = str(value)
    try:
        yield
    finally:
        for name in names:
            os.environ.pop(name, None)


def timer(device):
    def run(fn, repeat, warmup):
        return time_interleaved({"fn": fn}, device, repeat, warmup)["fn"]

    return run


def time_interleaved(fns: dict, device, repeat: int, warmup: int, host: bool = False) -> dict:
    """{name: median seconds} of several functions timed round by round (each round runs every function
    once, each after a barrier and a synchronisation), so that slow drifts of the machine hit all alike.
    host: also {name + "_host": median seconds until the call returned, before the synchronisation}; where
    it is close to the full time the GPU waited for the host (launches, Python) rather than the reverse."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    host_times = {name + "_host": [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            host_times[name + "_host"].append(time.perf_counter() - t0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - t0)
    if host:
        times.update(host_times)
    return {name: statistics.median(v) for name, v in times.items()}


def kernel_times(fn, device, calls=3):
    """[(kernel name, ms per call)] of fn's CUDA kernels, largest first (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        if t > 0:
            rows.append((e.key, t / calls / 1e3))
    dist.barrier()
    return sorted(rows, key=lambda r: -r[1])


def main():
    args = parse()
    device = start_process_group(args.device, 300)
    rank, world = dist.get_rank(), dist.get_world_size()
    HV = H = args.heads
    K = V = args.head_dim
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    time_it = timer(device)

    import deltacp.cp as cp
    from deltacp.cp import nccl_backend, exchange as cp_exchange, local as cp_local, ops as cp_ops

    T_rank = args.tokens
    cu = [0, T_rank * world]  # one sequence over every rank
    ctx = cp.build_context(torch.tensor(cu), device=device, timeout=120)
    gen = torch.Generator().manual_seed(100 + rank)
    q = torch.randn(1, T_rank, H, K, generator=gen).to(device, dtype)
    k = torch.nn.functional.normalize(torch.randn(1, T_rank, H, K, generator=gen), dim=-1).to(device, dtype)
    v = torch.randn(1, T_rank, HV, V, generator=gen).to(device, dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T_rank, HV, generator=gen) + 4).to(device, dtype)
    beta = torch.sigmoid(torch.randn(1, T_rank, HV, generator=gen)).to(device, dtype)

    cfg = cp_local._Cfg()
    cfg.variant, cfg.gate_name, cfg.scale, cfg.chunk_size = "gdn", "g", None, 64
    cfg.output_final_state, cfg.compute, cfg.state_dtype = False, "float32", torch.float32
    cfg.ctx, cfg.device, cfg.H, cfg.HV, cfg.K, cfg.V, cfg.num_seqs, cfg.has_h0 = ctx, device, H, HV, K, V, 1, False
    cfg.fwd_method, cfg.bwd_method = cp_ops._methods("gdn", None, device, False)
    use_kernels = device.type == "cuda" and nccl_backend.available()

    results, profiles = {}, {}
    scan_cut = None  # the local tiled forward's cut of the rank's sequence (token offsets), where staged
    # The forward pre-pass as the CP forward runs it: [H | M] of the last segment, plus the first segment's
    # per-piece transitions for the backward pre-pass where the first segment continues (rank > 0).
    want_maps = ctx.first_continues
    prepass = lambda: cp_exchange._prepass_forward(cfg, q, k, v, g, beta, None, None, None,  # noqa: E731
                                              want_first_maps=want_maps)
    do_pre = torch.randn(1, T_rank, HV, V, generator=gen).to(device, dtype)
    first_maps = [None]
    prepass_bwd = lambda: cp_exchange._prepass_backward(cfg, q, k, v, g, beta, None, None, do_pre, None,  # noqa: E731
                                                   first_maps=first_maps[0])
    prepass_bwd_widened = lambda: cp_exchange._prepass_backward(cfg, q, k, v, g, beta, None, None,  # noqa: E731
                                                           do_pre, None)
    errors = {}
    if use_kernels:
        # The pre-pass in pieces of P tokens run side by side and composed in fp32 (cp/local.py
        # _piece_bounds); 0 = the whole span as one sequential scan. Both directions, each piece length.
        whole = {}
        for piece in args.pieces:
            os.environ["DELTACP_CP_PREPASS_PIECE"] = str(piece)
            first_maps[0] = prepass()[1]
            for name, fn in (("fwd", lambda: prepass()[0]), ("bwd", prepass_bwd)):
                got = fn()
                whole.setdefault(name, got)
                errors[f"prepass_{name}_piece{piece}"] = float((got - whole[name]).norm() /
                                                                whole[name].norm().clamp_min(1e-30))
                results[f"prepass_{name}_piece{piece}"] = time_it(fn, args.repeat, args.warmup)
        # The CP steps below use the library's default piece length (cp/local.py _piece_bounds).
        os.environ.pop("DELTACP_CP_PREPASS_PIECE", None)
        piece_default = cp_local._piece_tokens(cfg, T_rank)
        results["prepass"] = time_it(prepass, args.repeat, args.warmup)
        first_maps[0] = prepass()[1]
        results["prepass_bwd"] = time_it(prepass_bwd, args.repeat, args.warmup)
        # The pre-pass as the staged CP forward runs it: the local forward prepared (cumulative gates and WY,
        # which the local forward then does not repeat), the pieces from its stages (cp/local.py).
        if cp_local._staged_available(cfg, "forward", q, g):
            from deltacp import _core
            from deltacp._describe import torch_desc as _td

            o_staged = torch.empty_like(v)

            def local_descs():  # the rank's local forward, as the staged CP forward describes it
                descs = cp_local._descs(cfg, q, k, v, g, beta, None, None, cu=ctx.cu_seqlens, cu_host=ctx.cu_seqlens_cpu)
                descs["o"] = _td(o_staged, "o")
                return descs

            def prepass_staged():
                descs = local_descs()
                handle = cp_local._staged_call(cfg, _core.staged_forward_prepare, "gdn", "tiled", descs)
                sent = cp_exchange._prepass_forward(cfg, q, k, v, g, beta, None, None, None, want_first_maps=want_maps,
                                               prepared=cp_local._PreparedForward(handle, 0), local_descs=descs)[0]
                torch.cuda.current_stream(device).synchronize()  # the handle's workspace outlives the kernels
                return sent

            def prepare_only():  # what the local forward does before h0 anyway (stages 1, 2; the scan's pass 1)
                cp_local._staged_call(cfg, _core.staged_forward_prepare, "gdn", "tiled", local_descs())
                torch.cuda.current_stream(device).synchronize()

            # The staged pre-pass at each piece length and forced scan configuration (scan_config.h).
            for piece in args.pieces:
                os.environ["DELTACP_CP_PREPASS_PIECE"] = str(piece)
                for bv, stages in args.scan:
                    with scan_env(bv, stages):
                        results[f"prepass_staged_piece{piece}_bv{bv}_s{stages}"] = time_it(
                            prepass_staged, args.repeat, args.warmup)
            os.environ.pop("DELTACP_CP_PREPASS_PIECE", None)
            results["prepass_staged"] = time_it(prepass_staged, args.repeat, args.warmup)
            results["prepare_only"] = time_it(prepare_only, args.repeat, args.warmup)
            # How the local forward's state scan cuts the rank's sequence (cuda/tiled/scan_split.cu).
            scan_cut = list(_core.scan_pieces("gdn", local_descs(), 0, chunk_size=64))
            errors["prepass_staged"] = float((prepass_staged() - prepass()[0]).norm() /
                                             prepass()[0].norm().clamp_min(1e-30))
        results["prepass_bwd_widened"] = time_it(prepass_bwd_widened, args.repeat, args.warmup)
        errors["prepass_bwd_widened"] = float((prepass_bwd_widened() - prepass_bwd()).norm() /
                                              prepass_bwd().norm().clamp_min(1e-30))
    sent = prepass()[0]  # what the CP op all-gathers: [H | M], or [H] when no merge reads M (ctx.maps_read)
    X = cp_local._augmented_forward(cfg, q, k, v, g, beta, None, None, None)  # [HV, K, V + K]: the ring and scan's maps

    def allgather():
        gathered = cp_exchange._all_gather(cfg, sent, "bench all-gather")
        return cp_exchange._merge_forward(cfg, gathered)

    def ring():
        S = torch.zeros((HV, K, V), dtype=torch.float32, device=device)
        if rank > 0:
            dist.recv(S, src=rank - 1)
        if rank + 1 < world:
            out = torch.matmul(X[..., V:], S) + X[..., :V]
            dist.send(out.contiguous(), dst=rank + 1)
        return S

    def scan():
        # Inclusive Hillis-Steele scan of the maps, then the exclusive prefix's H is the initial state.
        M, Hs = X[..., V:].clone(), X[..., :V].clone()
        d = 1
        while d < world:
            buf = torch.cat([Hs, M], dim=-1).contiguous()
            recv = torch.empty_like(buf)
            ops = []
            if rank + d < world:
                ops.append(dist.P2POp(dist.isend, buf, rank + d))
            if rank - d >= 0:
                ops.append(dist.P2POp(dist.irecv, recv, rank - d))
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            if rank - d >= 0:
                Hj, Mj = recv[..., :V], recv[..., V:]
                Hs = torch.matmul(M, Hj) + Hs
                M = torch.matmul(M, Mj)
            d *= 2
        # exclusive: rank r needs the inclusive prefix of r - 1
        S = torch.zeros((HV, K, V), dtype=torch.float32, device=device)
        ops = []
        if rank + 1 < world:
            ops.append(dist.P2POp(dist.isend, Hs.contiguous(), rank + 1))
        if rank > 0:
            ops.append(dist.P2POp(dist.irecv, S, rank - 1))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return S

    S_ref = allgather()
    for name, fn in (("allgather", allgather), ("ring", ring), ("scan", scan)):
        S = fn()
        errors[name] = 0.0 if rank == 0 else float((S - S_ref).norm() / S_ref.norm().clamp_min(1e-30))
        results[name] = time_it(fn, args.repeat, args.warmup)

    if device.type == "cuda":
        from deltacp._describe import torch_desc

        o = torch.empty_like(v)
        descs = cp_local._descs(cfg, q, k, v, g, beta, None, None)
        descs["o"] = torch_desc(o, "o")

        def local_forward():
            cp_local._run(cfg, "forward", cfg.fwd_method, descs)

        side = torch.cuda.Stream(device)

        def overlapped():
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                prepass()
                allgather()
            local_forward()
            torch.cuda.current_stream(device).wait_stream(side)

        results["local_forward"] = time_it(local_forward, args.repeat, args.warmup)
        for bv, stages in args.scan:
            with scan_env(bv, stages):
                results[f"local_forward_bv{bv}_s{stages}"] = time_it(local_forward, args.repeat, args.warmup)
        results["overlap_forward_plus_exchange"] = time_it(overlapped, args.repeat, args.warmup)

        # Parallel efficiency (docs/design.md section 8): one rank's CP step, forward + backward through the
        # autograd op, against the same per-rank work on one GPU without CP (the plain op on the
        # rank's slice). g has q's dtype here: the CP ops do not take the fp32 gate yet.
        import deltacp

        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        gg = g.detach().clone().requires_grad_(True)
        b_ = beta.detach().clone().requires_grad_(True)
        do = torch.randn_like(v)

        def cp_step(direction):
            o, _ = cp.chunk_gated_delta_rule_cp(*leaves, gg, b_, cp_context=ctx)
            if direction == "fwd+bwd":
                o.backward(do)

        def single_step(direction):
            o, _ = deltacp.chunk_gated_delta_rule(*leaves, gg, b_)
            if direction == "fwd+bwd":
                o.backward(do)

        def one_shot(direction):  # the same CP step with the one-shot local kernels (DELTACP_CP_STAGED=0)
            os.environ["DELTACP_CP_STAGED"] = "0"
            try:
                cp_step(direction)
            finally:
                os.environ.pop("DELTACP_CP_STAGED")

        # The CP step, the one-shot CP step and one GPU are timed in interleaved rounds, so that the ratios
        # (the parallel efficiency above all) compare runs made under the same conditions of the machine.
        for direction in ("fwd", "fwd+bwd"):
            with torch.set_grad_enabled(direction == "fwd+bwd"):
                rounds = time_interleaved({f"cp_step_{direction}": lambda: cp_step(direction),
                                           f"single_gpu_{direction}": lambda: single_step(direction),
                                           f"cp_step_{direction}_unstaged": lambda: one_shot(direction)},
                                          device, args.repeat, args.warmup, host=True)
                results.update(rounds)
        if args.trace:
            from torch.profiler import ProfilerActivity, profile

            os.makedirs(args.trace, exist_ok=True)
            with torch.set_grad_enabled(True):
                cp_step("fwd+bwd")
                torch.cuda.synchronize(device)
                dist.barrier()
                activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.trace_cpu else [])
                with profile(activities=activities) as prof:
                    cp_step("fwd+bwd")
                    torch.cuda.synchronize(device)
            prof.export_chrome_trace(os.path.join(args.trace, f"cp_step_rank{rank}.json"))

        if args.host_profile:
            import cProfile
            import io
            import pstats

            os.makedirs(args.host_profile, exist_ok=True)
            dist.barrier()
            prof_host = cProfile.Profile()
            prof_host.enable()
            for _ in range(20):
                cp_step("fwd")
            torch.cuda.synchronize(device)
            prof_host.disable()
            text = io.StringIO()
            pstats.Stats(prof_host, stream=text).sort_stats("cumulative").print_stats(45)
            with open(os.path.join(args.host_profile, f"host_fwd_rank{rank}.txt"), "w") as f:
                f.write(text.getvalue())

        if args.profile:
            for name, fn in (("cp_step_fwd+bwd", lambda: cp_step("fwd+bwd")),
                             ("single_gpu_fwd+bwd", lambda: single_step("fwd+bwd")),
                             ("prepass_fwd", prepass), ("prepass_bwd", prepass_bwd)) + (
                                 (("prepass_staged", prepass_staged),) if "prepass_staged" in results else ()):
                profiles[name] = kernel_times(fn, device)

    rows = [None] * world
    dist.all_gather_object(rows, dict(rank=rank, times=results, errors=errors, profiles=profiles,
                                      piece_default=piece_default if use_kernels else None,
                                      scan_cut=scan_cut))
    if rank == 0:
        bytes_ag = cp_exchange.exchange_bytes(ctx, HV, K, V)
        bytes_ring = HV * K * V * 4
        bytes_scan = math.ceil(math.log2(world)) * HV * K * (V + K) * 4 if world > 1 else 0
        print(f"CP exchange, {world} ranks ({device.type}), GDN {args.dtype}, H={H} K=V={K}, {T_rank} tokens/rank, "
              f"one sequence over every rank; median of {args.repeat} (ms, max over ranks)")
        if rows[0].get("scan_cut"):
            cut = rows[0]["scan_cut"]
            print(f"  (the local forward's state scan: {len(cut) - 1} piece(s) of {cut[1]} tokens, scan_split.cu)")
        if rows[0]["piece_default"] is not None:
            print(f"  (pre-pass pieces in the CP steps and 'prepass': the default, {rows[0]['piece_default']} tokens)")
        names = sorted({n for r in rows for n in r["times"]})
        for n in names:
            worst = max(r["times"].get(n, 0.0) for r in rows) * 1e3
            print(f"  {n:<32} {worst:9.3f} ms")
        for d in ("fwd", "fwd+bwd"):
            cpt = max(r["times"].get(f"cp_step_{d}", 0.0) for r in rows)
            one = max(r["times"].get(f"single_gpu_{d}", 0.0) for r in rows)
            if cpt > 0:
                print(f"  parallel efficiency {d:8} single-GPU per-rank work / CP step = {one / cpt:6.1%}")
        ag = max(r["times"].get("allgather", 0.0) for r in rows)
        # The second CP measure: what the CP forward adds to the local forward before the local kernel can
        # run from its initial state: the pre-pass beyond the stages the local forward runs anyway (prepare:
        # stages 1 and 2 and the scan's pass 1), the all-gather and the merge (rank 0, which sends).
        r0 = rows[0]["times"]
        if r0.get("prepass_staged") and r0.get("prepare_only") and r0.get("local_forward"):
            extra = max(r0["prepass_staged"] - r0["prepare_only"], 0.0) + r0["allgather"]
            print(f"  pre-pass beyond prepare + all-gather + merge (rank 0): {extra * 1e3:.3f} ms = "
                  f"{extra / r0['local_forward']:.1%} of the local forward ({r0['local_forward'] * 1e3:.3f} ms)")
        for d in ("fwd", "fwd+bwd"):
            cpt = max(r["times"].get(f"cp_step_{d}", 0.0) for r in rows)
            one = max(r["times"].get(f"single_gpu_{d}", 0.0) for r in rows)
            if cpt > 0:
                print(f"  CP step {d} over one GPU: +{(cpt - one) * 1e3:.3f} ms ({cpt / one - 1:+.1%})")
        if ag > 0:
            print(f"  all-gather + merge bus bandwidth (nccl-tests busbw = algbw (world-1)/world): "
                  f"{bytes_ag / ag * (world - 1) / world / 1e9:.1f} GB/s")
        print(f"  bytes received per rank: allgather {bytes_ag}, ring {bytes_ring} (world - 1 serial hops), "
              f"scan {bytes_scan} (ceil(log2 world) rounds)")
        piece_errs = sorted({n for r in rows for n in r["errors"] if n.startswith("prepass_")})
        if piece_errs:
            print("  pre-pass in pieces vs the first piece length (relative): " + ", ".join(
                f"{n[8:]} {max(r['errors'].get(n, 0.0) for r in rows):.1e}" for n in piece_errs))
        print("  initial-state error vs allgather: " + ", ".join(
            f"{n} {max(r['errors'][n] for r in rows):.1e}" for n in ("ring", "scan")))
        for r in rows:
            for name, table in r["profiles"].items():
                total = sum(t for _, t in table)
                print(f"  profile rank {r['rank']} {name}: {total:.3f} ms of kernels per call; top: " +
                      ", ".join(f"{n[:48]} {t:.3f}" for n, t in table[:8]))
        out = args.json or os.path.join(os.environ.get("OUT", "."), "bench_cp.json")
        with open(out, "w") as f:
            gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            # kind, gpu and date: what bench/gpu/make_docs.py reads (docs/results/cp-<gpu>x<world>.json)
            json.dump(dict(kind="cp", gpu=gpu, date=datetime.date.today().isoformat(), world=world,
                           device=str(device.type), config=vars(args), ranks=rows,
                           bytes=dict(allgather=bytes_ag, ring=bytes_ring, scan=bytes_scan)), f, indent=1)
        print(f"  JSON: {out}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
