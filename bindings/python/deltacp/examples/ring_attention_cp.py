"""Ring attention (softmax attention under context parallelism), forward + backward, checked against
one process.

    torchrun --nproc_per_node=4 -m deltacp.examples.ring_attention_cp              # CPU: gloo
    torchrun --nproc_per_node=2 -m deltacp.examples.ring_attention_cp --device cuda --seqlen 16384 \\
        --heads 32 --head-dim 128 --dtype bfloat16 --no-check                     # GPUs: NCCL

Every rank builds the same global q, k, v (same seed), takes its zig-zag shard (deltacp.cp.zigzag_shard),
runs deltacp.cp.ring_attention forward and backward, and (--check, on by default) compares its rows
of o, dq, dk, dv with one process's plain attention (fp64). Rank 0 prints one row per rank: errors,
the causal work the rank did (visible (query, key) pairs: equal on every rank under zig-zag), the
bytes it sent in the forward, and times. Exit status non-zero on a mismatch, so CI runs it as a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import deltacp.cp as cp

TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="deltacp.examples.ring_attention_cp", description=__doc__.split("\n")[0])
    p.add_argument("--seqlen", type=int, default=512, help="T, the whole sequence (default 512)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4, help="query heads H (default 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads, dividing H (default 2)")
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--block", type=int, default=None, help="zig-zag block (default T / (2N); 1 = token fold)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kernel", default=None, choices=("auto", "deltacp", "flash", "torch"),
                   help="how each ring step computes on CUDA (sets DELTACP_RING_KERNEL; default: auto, deltacp's "
                        "ring-step kernels for bf16/fp16 with head dim 64 or 128)")
    p.add_argument("--repeat", type=int, default=1, help="timed repetitions (median reported)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--baseline", action="store_true",
                   help="rank 0 also times plain attention (torch's scaled_dot_product_attention) over the whole "
                        "sequence on one device and prints the parallel efficiency: that time / (N x the slowest "
                        "rank's ring step), forward + backward")
    p.add_argument("--json", default=None, help="rank 0 writes the configuration, every rank's row and the "
                                                "baseline to this file (docs/results/ring-attention-*.json)")
    return p.parse_args(argv)


def rel(a, b) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.kernel:
        os.environ["DELTACP_RING_KERNEL"] = args.kernel
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=max(args.timeout, 30.0)))
    try:
        return _run(args, device)
    finally:
        dist.destroy_process_group()


def _run(args, device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    dt = DTYPES[args.dtype]
    B, T, H, HKV, D = args.batch, args.seqlen, args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, T, h, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV, H))
    shard = lambda t: cp.zigzag_shard(t, dim=1, block=args.block).to(device)  # noqa: E731

    def step():
        loc = [shard(t.to(dt)).requires_grad_() for t in (q, k, v)]
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        dist.barrier()
        t0 = time.perf_counter()
        o = cp.ring_attention(*loc, causal=args.causal, block=args.block)
        sync()
        t1 = time.perf_counter()
        o.backward(shard(do.to(dt)))
        sync()
        return o, loc, t1 - t0, time.perf_counter() - t1

    step()  # untimed: gloo connects a pair of ranks on its first message (the backward's direction too)
    runs = [step() for _ in range(max(1, args.repeat))]
    o, loc, _, _ = runs[-1]
    fwd = sorted(r[2] for r in runs)[len(runs) // 2]
    bwd = sorted(r[3] for r in runs)[len(runs) // 2]
    stats = dict(cp.ring_attention_stats)

    errors = {}
    if args.check:
        full = [t.to(dt).double().requires_grad_() for t in (q, k, v)]
        o_ref = cp.attention_reference(*full, causal=args.causal)
        (o_ref * do.to(dt).double()).sum().backward()
        errors["o"] = rel(o, shard(o_ref))
        for name, x, ref in zip(("dq", "dk", "dv"), loc, full):
            errors[name] = rel(x.grad, shard(ref.grad))
    tol = TOLERANCE[args.dtype]
    worst = max(errors.values()) if errors else 0.0
    row = dict(rank=rank, err=errors, ok=worst <= tol, work=stats["visible_pairs"], computed=stats["computed_pairs"],
               sent=stats["sent_bytes"], fwd=fwd * 1e3, bwd=bwd * 1e3)
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        block = args.block or T // (2 * world)
        print(f"deltacp ring attention: {world} ranks ({'gloo' if device.type == 'cpu' else 'NCCL'}, steps: "
              f"{os.environ.get('DELTACP_RING_KERNEL', 'auto')}), B={B} T={T} "
              f"H={H} HKV={HKV} D={D}, {args.dtype}, {'causal' if args.causal else 'non-causal'}, "
              f"zig-zag block {block}")
        if args.check:
            print(f"errors: relative ||ring - single|| / ||single|| (single: plain attention in fp64); "
                  f"tolerance {tol:g}")
        hdr = (f"{'rank':>4} {'err o':>9} {'err dq':>9} {'err dk':>9} {'err dv':>9} {'visible pairs':>14} "
               f"{'computed':>10} {'sent B':>9} {'fwd ms':>8} {'bwd ms':>8}  check")
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            e = r["err"]
            check = "-" if not args.check else ("ok" if r["ok"] else "FAIL")
            print(f"{r['rank']:>4} {e.get('o', float('nan')):>9.2e} {e.get('dq', float('nan')):>9.2e} "
                  f"{e.get('dk', float('nan')):>9.2e} {e.get('dv', float('nan')):>9.2e} {r['work']:>14d} "
                  f"{r['computed']:>10d} {r['sent']:>9d} {r['fwd']:>8.2f} {r['bwd']:>8.2f}  {check}")
        sys.stdout.flush()
    base = _baseline(args, device, dt) if args.baseline and rank == 0 else None
    if rank == 0:
        step_ms = max(r["fwd"] + r["bwd"] for r in rows)
        if base is not None:
            print(f"one device, scaled_dot_product_attention over all {T} tokens: fwd+bwd {base:.2f} ms; "
                  f"parallel efficiency {base:.2f} / ({world} x {step_ms:.2f}) = {base / (world * step_ms):.3f}")
        if args.json:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            with open(args.json, "w") as f:
                json.dump(dict(kind="ring_attention", device=name, world=world, backend=dist.get_backend(),
                               config=dict(batch=B, tokens=T, heads=H, kv_heads=HKV, head_dim=D, dtype=args.dtype,
                                           causal=args.causal, block=args.block or T // (2 * world),
                                           repeat=args.repeat, kernel=os.environ.get("DELTACP_RING_KERNEL", "auto")),
                               rows=rows, step_fwd_bwd_ms=step_ms, baseline_fwd_bwd_ms=base,
                               efficiency=None if base is None else base / (world * step_ms)), f, indent=1)
    failed = not all(r["ok"] for r in rows)
    if failed and rank == 0:
        print("deltacp: ring attention MISMATCH against the single-process run", file=sys.stderr)
    return 1 if failed else 0


def _baseline(args, device, dt):
    """Median fwd+bwd ms of plain attention over the whole sequence on this device: torch's
    scaled_dot_product_attention, held to its flash backend on CUDA without grouped heads (grouped K/V
    by enable_gqa, on whichever backend torch picks)."""
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, T, H, HKV, D = args.batch, args.seqlen, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(B, H, T, D, device=device, dtype=dt, requires_grad=True)
    k, v = (torch.randn(B, HKV, T, D, device=device, dtype=dt, requires_grad=True) for _ in range(2))
    do = torch.randn(B, H, T, D, device=device, dtype=dt)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    flash = device.type == "cuda" and HKV == H
    for i in range(max(1, args.repeat) + 1):
        sync()
        t0 = time.perf_counter()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if flash else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=args.causal, enable_gqa=HKV != H)
            o.backward(do)
        sync()
        if i:  # the first call is a warm-up
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    sys.exit(main())
