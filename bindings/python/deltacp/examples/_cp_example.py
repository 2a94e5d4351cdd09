"""The shared body of the context-parallel examples (gdn_cp.py, kda_cp.py, dplr_cp.py).

    torchrun --nproc_per_node=N -m deltacp.examples.gdn_cp [--dtype float32] [--device cpu|cuda] ...

Every rank builds the same packed batch of several sequences (same seed), cuts it with
deltacp.cp.build_context, runs the CP forward and backward on its slice, and (--check, on by default)
runs the whole batch in one process to compare its slice of o and of every gradient, plus the summed
final states and initial-state gradients. Rank 0 prints one row per rank: relative errors, times,
tokens/s and the bytes each all-gather delivered. The exit status is non-zero on any mismatch (every
rank agrees on it), so CI can run this as a test.

On CPUs this runs the Eigen reference and gloo; on GPUs (--device cuda) the fastest CUDA tier and
NCCL (deltacp's own communicator when deltacp._cp_nccl is built).

Inputs: gdn / kda as FLA's GDN / KDA tests draw them (unit keys, g = logsigmoid(x + 3) / 2,
beta = sigmoid). dplr as FLA's DPLR tests and bench/gpu/bench_dplr.py draw them: q, k, v ~ randn,
a = normalize(rand) per row, b = -a (so the transition diag(e^gk) - a a^T has spectral norm <= 1),
gk = logsigmoid(randn) clamped to [-5, 0] and kept in float32 beside 16-bit q, k, v (inside the chunk
form's gate range at every chunk size, so neither side falls back to the token recurrence). DPLR has
no grouped values (HV == H). These gates forget fast (the product of the transitions falls about
e^-0.64 per token, to 1e-18 over 64 tokens), so a rank's incoming state shapes its first few dozen
tokens and the maps M composed across ranks are negligible (one 2048-token sequence on 4 ranks matches
one process bitwise in float32); tests/python/test_cp_gloo.py checks the dplr merges with slower gates.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import deltacp
import deltacp.cp as cp
# deltacp.ops (the single-process ops this example checks against) loads torch._dynamo when imported.
# Imported here, before the process group starts: loaded after gloo's threads had started, 1 in 4
# 4-process CPU runs aborted at exit ("terminate called without an active exception"), 0 in 21 this way.
import deltacp.ops  # noqa: E402,F401

# Relative-error tolerances of CP against one process (docs/design.md section 7).
# dplr, measured on the CPU (gloo + reference; 2 and 4 ranks; seeds 0-7, chunks 16 / 32 / 64, with and
# without states, one sequence over every rank, H = 4 and K = V = 64): float64 <= 1e-15, float32 <= 6e-7, bfloat16 <= 6e-5 (both sides compute in fp32; a
# few bf16 roundings of o and the gradients land on the other side of a tie). float32 and float64 keep
# gdn's and kda's margins; bfloat16 takes kda's 8e-3, the tolerance the GPU path (naive DPLR tier, fp32
# pre-pass loops) is held to in distributed/tests/gpu_cp_check.py. An incoming state lost in the exchange
# (the merged state zeroed, 2 ranks, float32) shows as 1.5e-2 in o and 3.2e-2 in dgk: above 8e-3 too.
TOLERANCE = {
    "float64": {"gdn": 1e-10, "kda": 1e-10, "dplr": 1e-10},
    "float32": {"gdn": 1e-5, "kda": 1e-5, "dplr": 1e-5},
    "bfloat16": {"gdn": 3e-3, "kda": 8e-3, "dplr": 8e-3},
}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(variant: str, argv=None):
    p = argparse.ArgumentParser(prog=f"deltacp.examples.{variant}_cp",
                                description=f"{variant.upper()} context parallelism: forward + backward on a packed "
                                            f"batch, checked against one process.")
    p.add_argument("--seqlens", default="301,700,33,1,1013",
                   help="comma-separated sequence lengths of the packed batch; their sum must be divisible by the "
                        "number of ranks (default: 5 sequences, 2048 tokens; one spans several ranks)")
    p.add_argument("--heads", type=int, default=2, help="query/key heads H (default 2)")
    p.add_argument("--value-heads", type=int, default=None, help="value heads HV (default H)")
    p.add_argument("--head-dim", type=int, default=32, help="K = V (default 32)")
    p.add_argument("--chunk-size", type=int, default=64, choices=(16, 32, 64))
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--backend", default=None, help="local kernel: None (default), 'reference', or a CUDA tier")
    p.add_argument("--initial-state", action=argparse.BooleanOptionalAction, default=True,
                   help="give per-sequence initial states and take final states (default on)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare with a single-process run (default on)")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions (median reported)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a stalled exchange fails")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if variant == "dplr" and args.value_heads is not None and args.value_heads != args.heads:
        p.error(f"--value-heads {args.value_heads}: DPLR has no grouped values (a, b and gk act on the state "
                f"of each query/key head), so HV == H = {args.heads}; leave --value-heads out")
    return args


def make_inputs(variant, cu, H, HV, K, V, dtype, device, seed, with_states):
    """The global packed batch (identical on every rank: same seed, generated on the CPU in fp64)."""
    gen = torch.Generator().manual_seed(seed)
    T, N = cu[-1], len(cu) - 1

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    state = lambda t: None if t is None else t.to(device=device, dtype=torch.float32 if dtype != torch.float64  # noqa: E731
                                                   else torch.float64)
    if variant == "dplr":  # FLA's DPLR inputs (module doc); the gate in float32 unless the run is float64
        q, k, v = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, HV, V)
        a = torch.nn.functional.normalize(torch.rand(1, T, H, K, generator=gen, dtype=torch.float64), p=2, dim=-1)
        gk = torch.nn.functional.logsigmoid(rnd(1, T, H, K)).clamp(-5.0, 0.0)
        h0 = rnd(N, HV, K, V) * 0.5 if with_states else None
        do = rnd(1, T, HV, V)
        dht = rnd(N, HV, K, V) if with_states else None
        return dict(q=cast(q), k=cast(k), v=cast(v), a=cast(a), b=cast(-a), gk=state(gk), h0=state(h0),
                    do=cast(do), dht=state(dht))
    q = rnd(1, T, H, K)
    k = torch.nn.functional.normalize(rnd(1, T, H, K), dim=-1)  # unit keys keep the delta rule stable
    v = rnd(1, T, HV, V)
    if variant == "gdn":
        g = torch.nn.functional.logsigmoid(rnd(1, T, HV) + 3.0) * 0.5
    else:
        g = torch.nn.functional.logsigmoid(rnd(1, T, HV, K) + 3.0) * 0.5
    beta = torch.sigmoid(rnd(1, T, HV))
    h0 = rnd(N, HV, K, V) * 0.5 if with_states else None
    do = rnd(1, T, HV, V)
    dht = rnd(N, HV, K, V) if with_states else None
    return dict(q=cast(q), k=cast(k), v=cast(v), g=cast(g), beta=cast(beta), h0=state(h0), do=cast(do),
                dht=state(dht))


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(variant: str, argv=None) -> int:
    args = parse_args(variant, argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(args.timeout, 30.0)))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        return _run(variant, args, device, rank, world)
    finally:
        dist.destroy_process_group()


def _run(variant, args, device, rank, world) -> int:
    seqlens = [int(s) for s in args.seqlens.split(",") if s.strip()]
    cu = [0]
    for s in seqlens:
        cu.append(cu[-1] + s)
    H = args.heads
    HV = args.value_heads or H
    K = V = args.head_dim
    dtype = DTYPES[args.dtype]
    # The op's tensor arguments in its positional order (the same for the CP and the single-process op).
    op, cp_op, inputs = {
        "gdn": (deltacp.chunk_gated_delta_rule, cp.chunk_gated_delta_rule_cp, ["q", "k", "v", "g", "beta"]),
        "kda": (deltacp.chunk_kda, cp.chunk_kda_cp, ["q", "k", "v", "g", "beta"]),
        "dplr": (deltacp.chunk_dplr_delta_rule, cp.chunk_dplr_cp, ["q", "k", "v", "a", "b", "gk"]),
    }[variant]

    ctx = cp.build_context(torch.tensor(cu, dtype=torch.int64), device=device, timeout=args.timeout)
    x = make_inputs(variant, cu, H, HV, K, V, dtype, device, args.seed, args.initial_state)
    names = inputs + (["h0"] if args.initial_state else [])

    # ---- CP forward + backward on this rank's slice --------------------------------------------
    def cp_step():
        local = {n: (x[n] if n == "h0" else cp.split_even(x[n], ctx)).detach().clone().requires_grad_()
                 for n in names}
        o, ht = cp_op(*[local[n] for n in inputs], cp_context=ctx,
                      initial_state=local.get("h0"), output_final_state=args.initial_state,
                      chunk_size=args.chunk_size, backend=args.backend)
        sync(device)
        t1 = time.perf_counter()
        loss = (o.float() * cp.split_even(x["do"], ctx).float()).sum()
        if ht is not None:
            loss = loss + (ht * x["dht"]).sum()
        loss.backward()
        sync(device)
        return o, ht, {n: local[n].grad for n in names}, t1

    fwd_times, bwd_times = [], []
    for _ in range(max(1, args.repeat)):
        dist.barrier()
        t0 = time.perf_counter()
        o, ht, grads, t1 = cp_step()
        t2 = time.perf_counter()
        fwd_times.append(t1 - t0)
        bwd_times.append(t2 - t1)
    fwd = sorted(fwd_times)[len(fwd_times) // 2]
    bwd = sorted(bwd_times)[len(bwd_times) // 2]
    stats = dict(cp.last_stats)

    # ---- the single-process run, and this rank's slice of it ------------------------------------
    errors = {}
    if args.check:
        full = {n: x[n].detach().clone().requires_grad_() for n in names}
        o_ref, ht_ref = op(*[full[n] for n in inputs],
                           initial_state=full.get("h0"), output_final_state=args.initial_state,
                           cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=device), chunk_size=args.chunk_size,
                           backend=args.backend)
        loss = (o_ref.float() * x["do"].float()).sum()
        if ht_ref is not None:
            loss = loss + (ht_ref * x["dht"]).sum()
        loss.backward()
        errors["o"] = rel(o, cp.split_even(o_ref, ctx))
        for n in names:
            if n == "h0":  # rows owned by different ranks: the sum over ranks is the full gradient
                total = grads[n].detach().clone()
                dist.all_reduce(total)
                errors["dh0"] = rel(total, full[n].grad)
            else:
                errors["d" + n] = rel(grads[n], cp.split_even(full[n].grad, ctx))
        if ht is not None:
            total = ht.detach().clone()
            dist.all_reduce(total)
            errors["ht"] = rel(total, ht_ref)

    tol = TOLERANCE[args.dtype][variant]
    worst = max(errors.values()) if errors else 0.0
    ok = worst <= tol
    row = dict(rank=rank, tokens=ctx.local_tokens, segments=ctx.num_local_seqs, pre=ctx.pre_ranks,
               post=ctx.post_ranks, err_o=errors.get("o", float("nan")),
               err_grad=max([e for n, e in errors.items() if n.startswith("d") and n != "dh0"], default=float("nan")),
               err_state=max([errors.get("ht", 0.0), errors.get("dh0", 0.0)]) if errors else float("nan"),
               fwd_ms=fwd * 1e3, bwd_ms=bwd * 1e3, tok_s=ctx.local_tokens / (fwd + bwd),
               xfer=stats["forward_bytes"] + stats["backward_bytes"], ok=ok, worst=errors and max(errors, key=errors.get))
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(f"deltacp {variant.upper()} context parallelism: {world} ranks ({'gloo + reference' if device.type == 'cpu' else 'NCCL + CUDA'}), "
              f"{len(seqlens)} sequences {seqlens} = {cu[-1]} tokens, H={H} HV={HV} K=V={K}, {args.dtype}, "
              f"chunk {args.chunk_size}, initial/final states {'on' if args.initial_state else 'off'}")
        if args.check:
            print(f"errors: relative ||cp - single|| / ||single|| per tensor (worst gradient of "
                  f"{', '.join('d' + n for n in inputs)}; states: summed ht and dh0); tolerance {tol:g}")
        hdr = (f"{'rank':>4} {'tokens':>7} {'segs':>4} {'pre':>3} {'post':>4} {'err o':>9} {'err grad':>9} "
               f"{'err state':>9} {'fwd ms':>8} {'bwd ms':>8} {'tokens/s':>10} {'exchange B':>11}  check")
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            check = "-" if not args.check else ("ok" if r["ok"] else f"FAIL ({r['worst']})")
            print(f"{r['rank']:>4} {r['tokens']:>7} {r['segments']:>4} {r['pre']:>3} {r['post']:>4} "
                  f"{r['err_o']:>9.2e} {r['err_grad']:>9.2e} {r['err_state']:>9.2e} {r['fwd_ms']:>8.2f} "
                  f"{r['bwd_ms']:>8.2f} {r['tok_s']:>10.0f} {r['xfer']:>11d}  {check}")
        sys.stdout.flush()
    failed = not all(r["ok"] for r in rows)
    if failed and rank == 0:
        print("deltacp: CP MISMATCH against the single-process run", file=sys.stderr)
    return 1 if failed else 0
