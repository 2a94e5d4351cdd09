"""A whole Gated DeltaNet layer under context parallelism, forward + backward, checked against one
process; CP groups beside data-parallel groups.

    torchrun --nproc_per_node=2 -m deltacp.examples.gdn_layer_cp              # 1 CP group of 2 ranks
    torchrun --nproc_per_node=4 -m deltacp.examples.gdn_layer_cp --cp 2       # 2 CP groups x 2 DP groups
    torchrun --nproc_per_node=2 -m deltacp.examples.gdn_layer_cp --device cuda  # GPUs: NCCL, the CUDA tiers

The layer as models use it (FLA's GatedDeltaNet): q, k, v projections, each through a causal short
convolution (width 4, SiLU; deltacp.causal_conv1d), q and k l2-normalised, beta = sigmoid(b_proj x),
g = -exp(A_log) softplus(a_proj x + dt_bias), the chunk op deltacp.chunk_gated_delta_rule, an RMS norm
of o gated by silu(g_proj x), and the output projection.

The world is cut into `world / cp` CP groups of `cp` consecutive ranks; the ranks with the same
position in their CP groups form a data-parallel (DP) group. Each CP group runs its own packed batch
(different sequence lengths per group: a CP exchange that leaked into another group would fail
build_context's agreement check or give wrong numbers). Every rank holds its CP slice of its group's
batch; the layer runs with cp_context (the convolution's halo and the chunk op's state exchange stay
inside the CP group); the weight gradients are summed over the CP group (the layer's gradient for the
group's batch) and averaged over the DP group. Checked on every rank against one process: its slice of
the output and of dL/dx, and the weight gradients after both all-reduces (against the mean over the
DP replicas of the one-process gradients). Exit status non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import deltacp
import deltacp.cp as cp

# Relative errors against one process: outputs and dL/dx; weight gradients (sums over all tokens with
# cancellation: dt_bias's is the worst, 4.8e-5 measured in float32 at 2 CP x 2 DP on CPUs).
TOLERANCE = {"float64": 1e-10, "float32": 1e-4}
TOLERANCE_DW = {"float64": 1e-10, "float32": 3e-4}


class GatedDeltaNetLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, conv: int = 4, dtype=torch.float32):
        super().__init__()
        self.H, self.K = heads, head_dim
        inner = heads * head_dim
        kw = dict(dtype=dtype)
        self.q_proj = nn.Linear(hidden, inner, bias=False, **kw)
        self.k_proj = nn.Linear(hidden, inner, bias=False, **kw)
        self.v_proj = nn.Linear(hidden, inner, bias=False, **kw)
        self.conv_q = nn.Parameter(torch.randn(inner, conv, **kw) * conv ** -0.5)
        self.conv_k = nn.Parameter(torch.randn(inner, conv, **kw) * conv ** -0.5)
        self.conv_v = nn.Parameter(torch.randn(inner, conv, **kw) * conv ** -0.5)
        self.b_proj = nn.Linear(hidden, heads, bias=False, **kw)
        self.a_proj = nn.Linear(hidden, heads, bias=False, **kw)
        self.A_log = nn.Parameter(torch.log(torch.rand(heads, **kw) * 15 + 1))
        self.dt_bias = nn.Parameter(torch.rand(heads, **kw) * 0.1)
        self.g_proj = nn.Linear(hidden, inner, bias=False, **kw)
        self.norm_weight = nn.Parameter(torch.ones(head_dim, **kw))
        self.o_proj = nn.Linear(inner, hidden, bias=False, **kw)

    def forward(self, x, cu_seqlens=None, cp_context=None):
        """x [1, T, hidden] (this rank's slice under CP) -> [1, T, hidden]."""
        B, T, _ = x.shape
        conv = dict(activation="silu", cu_seqlens=cu_seqlens, cp_context=cp_context)
        q, _ = deltacp.causal_conv1d(self.q_proj(x), self.conv_q, **conv)
        k, _ = deltacp.causal_conv1d(self.k_proj(x), self.conv_k, **conv)
        v, _ = deltacp.causal_conv1d(self.v_proj(x), self.conv_v, **conv)
        q = F.normalize(q.view(B, T, self.H, self.K), dim=-1)
        k = F.normalize(k.view(B, T, self.H, self.K), dim=-1)
        v = v.view(B, T, self.H, self.K)
        beta = torch.sigmoid(self.b_proj(x))
        g = -self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)
        if cp_context is not None:
            o, _ = deltacp.chunk_gated_delta_rule(q, k, v, g, beta, cp_context=cp_context)
        else:
            o, _ = deltacp.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        o = o * F.silu(self.g_proj(x).view(B, T, self.H, self.K))
        return self.o_proj(o.reshape(B, T, self.H * self.K))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="deltacp.examples.gdn_layer_cp", description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, default=None, help="ranks per CP group (default: the whole world)")
    p.add_argument("--seqlens", default="97,300,11,104",
                   help="sequence lengths of CP group 0's packed batch; group d moves d x 7 tokens from the first "
                        "to the last sequence (default 512 tokens)")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=tuple(TOLERANCE))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--timeout", type=float, default=120.0)
    return p.parse_args(argv)


def rel(a, b) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def main(argv=None) -> int:
    args = parse_args(argv)
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


def _batch(args, replica, device):
    seqlens = [int(s) for s in args.seqlens.split(",") if s.strip()]
    shift = min(7 * replica, seqlens[0] - 1)
    seqlens[0] -= shift
    seqlens[-1] += shift
    cu = [0]
    for s in seqlens:
        cu.append(cu[-1] + s)
    gen = torch.Generator().manual_seed(100 + replica)
    dt = getattr(torch, args.dtype)
    x = torch.randn(1, cu[-1], args.hidden, generator=gen, dtype=torch.float64).to(device=device, dtype=dt)
    dy = torch.randn(1, cu[-1], args.hidden, generator=gen, dtype=torch.float64).to(device=device, dtype=dt)
    return cu, x, dy


def _run(args, device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    ncp = args.cp or world
    if world % ncp != 0:
        raise ValueError(f"deltacp: argument '--cp': expected a divisor of the world size {world}, got {ncp}")
    ndp = world // ncp
    # Every rank creates every group, in the same order (torch.distributed's rule).
    cp_groups = [dist.new_group(list(range(d * ncp, (d + 1) * ncp))) for d in range(ndp)]
    dp_groups = [dist.new_group(list(range(c, world, ncp))) for c in range(ncp)]
    replica, cp_rank = rank // ncp, rank % ncp
    cp_group, dp_group = cp_groups[replica], dp_groups[cp_rank]
    dt = getattr(torch, args.dtype)
    torch.manual_seed(0)  # the same weights on every rank
    layer = GatedDeltaNetLayer(args.hidden, args.heads, args.head_dim, dtype=dt).to(device)

    cu, x, dy = _batch(args, replica, device)
    ctx = cp.build_context(cu, group=cp_group, conv1d_kernel_size=4, timeout=args.timeout, device=device)
    xl = cp.split_even(x, ctx).clone().requires_grad_()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    (layer(xl, cp_context=ctx) * cp.split_even(dy, ctx)).sum().backward()  # untimed: first messages, kernels
    layer.zero_grad()
    xl.grad = None
    t0 = time.perf_counter()
    y = layer(xl, cp_context=ctx)
    sync()
    t1 = time.perf_counter()
    (y * cp.split_even(dy, ctx)).sum().backward()
    sync()
    t2 = time.perf_counter()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    for gr in grads.values():  # the group's batch: sum over CP; the replicas: mean over DP
        dist.all_reduce(gr, group=cp_group)
        dist.all_reduce(gr, group=dp_group)
        gr /= ndp

    # One process: this group's batch in full, and every replica's weight gradients (their mean).
    ref_grads = {n: torch.zeros_like(p) for n, p in layer.named_parameters()}
    for d in range(ndp):
        layer.zero_grad()
        cu_d, x_d, dy_d = _batch(args, d, device)
        xf = x_d.clone().requires_grad_()
        y_ref = layer(xf, cu_seqlens=torch.tensor(cu_d, device=device))
        (y_ref * dy_d).sum().backward()
        for n, p in layer.named_parameters():
            ref_grads[n] += p.grad / ndp
        if d == replica:
            err_y, err_dx = rel(y, cp.split_even(y_ref, ctx)), rel(xl.grad, cp.split_even(xf.grad, ctx))
    err_w = max(rel(grads[n], ref_grads[n]) for n in grads)
    worst_w = max(grads, key=lambda n: rel(grads[n], ref_grads[n]))
    tol = TOLERANCE[args.dtype]
    row = dict(rank=rank, replica=replica, cp_rank=cp_rank, tokens=ctx.local_tokens, T=cu[-1], y=err_y, dx=err_dx,
               w=err_w, worst=worst_w, fwd=(t1 - t0) * 1e3, bwd=(t2 - t1) * 1e3,
               ok=max(err_y, err_dx) <= tol and err_w <= TOLERANCE_DW[args.dtype])
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(f"deltacp GDN layer under CP: {world} ranks = {ndp} DP x {ncp} CP "
              f"({'gloo' if device.type == 'cpu' else 'NCCL'}), hidden {args.hidden}, "
              f"H={args.heads} K=V={args.head_dim}, conv 4, {args.dtype}; errors relative to one process, "
              f"tolerance {tol:g} (weight gradients {TOLERANCE_DW[args.dtype]:g})")
        hdr = (f"{'rank':>4} {'dp':>3} {'cp':>3} {'T':>5} {'tokens':>6} {'err y':>9} {'err dx':>9} {'err dW':>9} "
               f"{'worst dW':>12} {'fwd ms':>8} {'bwd ms':>8}  check")
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            print(f"{r['rank']:>4} {r['replica']:>3} {r['cp_rank']:>3} {r['T']:>5} {r['tokens']:>6} {r['y']:>9.2e} "
                  f"{r['dx']:>9.2e} {r['w']:>9.2e} {r['worst']:>12} {r['fwd']:>8.2f} {r['bwd']:>8.2f}  "
                  f"{'ok' if r['ok'] else 'FAIL (' + r['worst'] + ')'}")
        sys.stdout.flush()
    failed = not all(r["ok"] for r in rows)
    if failed and rank == 0:
        print("deltacp: GDN layer CP MISMATCH against the single-process run", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
