"""The tiled forward's state scan on its own: the wgmma scan (cuda/tiled/scan_wgmma.cuh) against the
mma.sync scan, per kernel (torch.profiler, CUDA time of the scan kernel per launch) and for the whole
forward (triton's do_bench, median, as bench_gpu.py), bf16 GDN on bench_gpu.py's inputs. A shape is
B,T,H,K[,V[,N]]: B rows of T tokens, or with N one row of T tokens packed as N equal sequences. 1,32768,16,128,256,4 has the parallel structure of the CP
pre-pass's pieces (4 pieces of 8192 tokens, state [H | M] 256 columns wide). "state only" times the
scan of a final-state-only forward (no o: the scan stores neither h nor v_new, as the CP pre-pass's
pieces run it). The scan is chosen by DELTACP_TILED_SCAN_WGMMA (0: mma.sync; 1: wgmma) and
DELTACP_TILED_SCAN_WG (warpgroups per CTA), read at every launch. --config NAME:VAR=VALUE,... replaces the
three default configurations, e.g. the scan in pieces (cuda/tiled/scan_split.cu; its fill, fold and gather
kernels count as scan time) against the whole scan:

    --config whole:DELTACP_TILED_SCAN_PIECE=0 --config auto: --config p2048:DELTACP_TILED_SCAN_PIECE=2048

--fwdbwd also times forward + backward (the backward recomputes the states with the same scan). --compose
P,HV,K,V ... times compose_state_maps (the CP pre-pass's composition, the fold's kernel body) on P maps.

    python3 bench/gpu/bench_scan.py [--shapes 1,32768,16,128 1,32768,16,128,256,4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

import deltacp
from bench_gpu import bench_ms, make_inputs  # same folder: the harness's inputs and timer


def inputs(B, T, H, K, V, N):
    x = make_inputs(B, T, H, K, "gdn", V=V)
    cu = None if N is None else torch.arange(0, T + 1, T // N, device="cuda", dtype=torch.int64)
    return tuple(x[n] for n in ("q", "k", "v", "g", "beta")), cu


def call(args, cu):
    return deltacp.chunk_gated_delta_rule(*args, cu_seqlens=cu, backend="tiled")


def forward_ms(args, cu):
    return bench_ms(lambda: call(args, cu))


def fwdbwd_ms(args, cu):
    xs = [x.detach().clone().requires_grad_(True) for x in args]
    do = torch.randn_like(xs[2])

    def step():
        o, _ = call(xs, cu)
        o.backward(do)

    return bench_ms(step)


def state_only_call(args, cu):
    """A final-state-only forward (no o) through the core entry: the CP pre-pass's mode."""
    from deltacp import _core
    from deltacp._describe import torch_desc

    q, k, v, g, beta = args
    B, T, HV, V = v.shape
    N = B if cu is None else cu.numel() - 1
    ht = torch.empty((N, HV, k.shape[-1], V), device="cuda")
    d = {n: torch_desc(x, n) for n, x in zip(("q", "k", "v", "g", "beta"), args)}
    d["ht"] = torch_desc(ht, "ht")
    keep = [ht]
    if cu is not None:
        cu_host = cu.cpu()
        keep += [cu, cu_host]
        d["cu_seqlens"] = torch_desc(cu, "cu_seqlens")
        d["cu_seqlens_host"] = torch_desc(cu_host, "cu_seqlens")
    _core.run("forward", "gdn", "tiled", "float32", d, None, 64, None, torch.cuda.current_stream().cuda_stream, False)
    return ht, keep


def scan_kernel_ms(args, cu, reps=10, fn=None):
    from torch.profiler import ProfilerActivity, profile

    fn = fn or call
    fn(args, cu)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn(args, cu)
        torch.cuda.synchronize()
    per = {}
    for ev in prof.key_averages():
        if any(x in ev.key for x in ("state_scan", "piece_states", "zero_identity", "gather_final_states")):
            # The kernel's name without its namespace, template arguments and parameters ("(anonymous
            # namespace)" holds a parenthesis: splitting at the first one would give every such name one key).
            name = ev.key.replace("(anonymous namespace)::", "").split("(")[0].split("<")[0].split("::")[-1]
            per[name] = per.get(name, 0.0) + ev.device_time_total / 1e3 / reps
    return per


def compose_ms(P, HV, K, V, width):
    """compose_state_maps (cuda/tiled/scan_split.cu compose_maps_kernel) on P random maps [HV, K, V + K]:
    the CP pre-pass's composition of a cut segment; ms per launch (bench_ms, the harness's timer)."""
    from deltacp import _core

    gen = torch.Generator(device="cuda").manual_seed(0)
    maps = torch.randn((P, HV, K, V + K), device="cuda", generator=gen) / K**0.5
    out = torch.empty((HV, K, width), device="cuda")
    stream = torch.cuda.current_stream().cuda_stream

    def launch():
        _core.compose_state_maps(maps.data_ptr(), P, HV, K, V, width, 0, out.data_ptr(), out.numel(), stream)

    return bench_ms(launch)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*",
                    default=["1,32768,16,128", "2,16384,16,128", "4,4096,64,128", "1,32768,16,128,256,4"])
    ap.add_argument("--json")
    ap.add_argument("--config", action="append", default=[], help="NAME:VAR=VALUE,... (repeatable)")
    ap.add_argument("--fwdbwd", action="store_true", help="also time forward + backward")
    ap.add_argument("--compose", nargs="*", default=["8,16,128,128", "16,16,128,128", "8,16,64,64", "8,16,256,256"],
                    help="P,HV,K,V: time compose_state_maps on P maps at widths V + K and V")
    a = ap.parse_args()
    configs = {"mma.sync": {"DELTACP_TILED_SCAN_WGMMA": "0"},
               "wgmma 1 WG": {"DELTACP_TILED_SCAN_WGMMA": "1", "DELTACP_TILED_SCAN_WG": "1"},
               "wgmma 2 WG": {"DELTACP_TILED_SCAN_WGMMA": "1", "DELTACP_TILED_SCAN_WG": "2"}}
    if a.config:
        configs = {}
        for c in a.config:
            name, _, rest = c.partition(":")
            configs[name] = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    knobs = sorted({k for env in configs.values() for k in env} | {"DELTACP_TILED_SCAN_WGMMA", "DELTACP_TILED_SCAN_WG"})
    rows = []
    print(f"{torch.cuda.get_device_name()}  bf16 gdn, scan kernel ms / forward ms")
    for shape in a.shapes:
        dims = list(map(int, shape.split(",")))
        B, T, H, K = dims[:4]
        V = dims[4] if len(dims) > 4 else K
        N = dims[5] if len(dims) > 5 else None
        args, cu = inputs(B, T, H, K, V, N)
        ref_o = None
        for name, env in configs.items():
            for key in knobs:
                os.environ.pop(key, None)
            os.environ.update(env)
            o, _ = call(args, cu)
            if ref_o is None:
                ref_o = o.float()
            diff = ((o.float() - ref_o).norm() / ref_o.norm()).item()
            scan = scan_kernel_ms(args, cu)
            fwd = forward_ms(args, cu)
            only = scan_kernel_ms(args, cu, fn=state_only_call)
            row = {"shape": shape, "scan": name, "env": env, "scan_ms": sum(scan.values()), "forward_ms": fwd,
                   "state_only_scan_ms": sum(only.values()), "rel_diff_vs_first": diff, "scan_kernels_ms": scan}
            fold = sum(t for key, t in scan.items() if "piece_states" in key)
            extra = f"  (fold {fold:.4f} ms)" if fold else ""
            if a.fwdbwd:
                row["fwdbwd_ms"] = fwdbwd_ms(args, cu)
                extra += f"  fwd+bwd {row['fwdbwd_ms']:.3f} ms"
            rows.append(row)
            print(f"  ({shape:>22s})  {name:11s}  scan {sum(scan.values()):.3f} ms  forward {fwd:.3f} ms  "
                  f"state-only scan {sum(only.values()):.3f} ms{extra}  o vs first {diff:.1e}", flush=True)
    for key in knobs:
        os.environ.pop(key, None)
    for spec in a.compose:
        P, HV, K, V = map(int, spec.split(","))
        for width in (V + K, V):
            ms = compose_ms(P, HV, K, V, width)
            rows.append({"compose": spec, "width": width, "ms": ms, "us_per_map": 1e3 * ms / P})
            print(f"  compose_state_maps P={P} HV={HV} K={K} V={V} width={width}: {ms:.4f} ms "
                  f"({1e3 * ms / P:.1f} us a map)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
