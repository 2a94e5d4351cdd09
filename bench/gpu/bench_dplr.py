"""DPLR on one GPU: deltacp's tiled DPLR forward and forward + backward (the tiled DPLR backward,
cuda/tiled/dplr_bwd.cu), and the naive tier's, beside FLA's chunk_dplr_delta_rule at chunk 16 (its default) and
chunk 64 with safe_gate=True, bf16, median of triton's do_bench; plus the error of each against the float64
reference: o, and the worst of the gradients dq, dk, dv, da, db, dgk.

    python3 bench/gpu/bench_dplr.py --out dplr.json            # FLA's source on PYTHONPATH for its rows
    python3 bench/gpu/bench_dplr.py --impls deltacp_tiled,fla_chunk16 --shapes 4,4096,32,64

The naive tier (a token loop: tens of seconds of do_bench at these shapes) is timed only when --impls names
it (deltacp_naive); its accuracy is always measured. FLA's first call compiles and autotunes its Triton
kernels (minutes per chunk size without a tuned cache), so each step prints a progress line first.

Inputs as FLA's DPLR tests draw them: q, k, v ~ randn; a = normalize(rand), b = -a; gk = logsigmoid(randn),
clamped to [-5, 0] (FLA's safe_gate range, the same inputs for every implementation). Shapes (B, T, H, D):
(4, 4096, 32, 64), (2, 8192, 32, 64), (1, 16384, 16, 128). Each row records the GPU's name and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import torch.nn.functional as F

SHAPES = [(4, 4096, 32, 64), (2, 8192, 32, 64), (1, 16384, 16, 128)]
LOWER = -5.0


def make_inputs(B, T, H, D, seed=0, dtype=torch.bfloat16, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, dtype=torch.float32, generator=gen)  # noqa: E731
    a = F.normalize(torch.rand(B, T, H, D, device=device, dtype=torch.float32, generator=gen), p=2, dim=-1)
    gk = F.logsigmoid(r(B, T, H, D)).clamp(LOWER, 0.0)
    return dict(q=r(B, T, H, D).to(dtype), k=r(B, T, H, D).to(dtype), v=r(B, T, H, D).to(dtype), a=a.to(dtype),
                b=(-a).to(dtype), gk=gk)


def deltacp_fn(backend):
    import deltacp

    def run(x):
        return deltacp.chunk_dplr_delta_rule(x["q"], x["k"], x["v"], x["a"], x["b"], x["gk"], backend=backend,
                                             lower_bound=LOWER)
    return run


def fla_fn(chunk_size, safe_gate):
    try:
        from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule as op
    except Exception as e:  # FLA not on PYTHONPATH
        print(f"FLA not available: {e}", file=sys.stderr)
        return None
    kw = dict(chunk_size=chunk_size)
    if safe_gate:
        kw.update(safe_gate=True, lower_bound=LOWER)

    def run(x):
        return op(x["q"], x["k"], x["v"], x["a"], x["b"], x["gk"], **kw)
    return run


def bench_ms(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def time_impl(fn, shape, backward):
    B, T, H, D = shape
    x = make_inputs(B, T, H, D)
    names = ("q", "k", "v", "a", "b", "gk")
    if backward:
        for n in names:
            x[n].requires_grad_(True)
        do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)

    def step():
        o = fn(x)[0]
        if backward:
            torch.autograd.grad(o, [x[n] for n in names], do)
    step()  # compile / autotune outside the timing
    torch.cuda.synchronize()
    return bench_ms(step)


def accuracy(impls, H, D):
    """Each implementation on bf16 inputs against float64: {name: ||o - ref|| / ||ref||} and {name: the worst
    ||d - ref|| / ||ref|| over the gradients dq, dk, dv, da, db, dgk of sum(o * do)}. Two sequences of 1000
    tokens (odd: a partial last chunk) with the timed shapes' first H and D, so that FLA's autotuning here
    (keyed on its kernels' constexprs, among them the head count and head size) serves the timing too."""
    import numpy as np
    import deltacp.reference as R
    B, T = 2, 1000
    x = make_inputs(B, T, H, D, seed=1)
    do = torch.randn(B, T, H, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)).to(
        torch.bfloat16)
    xd = {n: t.double().cpu().numpy() for n, t in x.items()}
    o_ref, _ = R.dplr(xd["q"], xd["k"], xd["v"], xd["a"], xd["b"], xd["gk"], scale=D ** -0.5)
    g_ref = R.dplr_backward(xd["q"], xd["k"], xd["v"], xd["a"], xd["b"], xd["gk"], do.double().cpu().numpy(),
                            scale=D ** -0.5)
    names = ("q", "k", "v", "a", "b", "gk")
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    out, grads = {}, {}
    for name, fn in impls.items():
        with torch.no_grad():
            out[name] = rel(fn(x)[0].double().cpu().numpy(), o_ref)
        try:
            xg = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
            g = torch.autograd.grad(fn(xg)[0], [xg[n] for n in names], do)
            grads[name] = max(rel(gi.double().cpu().numpy(), g_ref["d" + n]) for n, gi in zip(names, g))
        except Exception as e:  # noqa: BLE001 - record and go on
            grads[name] = f"{type(e).__name__}: {e}"[:300]
    return out, grads


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_dplr.json")
    ap.add_argument("--impls", default="deltacp_tiled,fla_chunk16,fla_chunk64_safe_gate",
                    help="implementations to time, comma-separated (deltacp_tiled, deltacp_naive, fla_chunk16, "
                         "fla_chunk64_safe_gate); these and the naive tier are checked for accuracy")
    ap.add_argument("--shapes", default=None, help="B,T,H,D shapes, ';'-separated (default: the three above)")
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    impls = {"deltacp_tiled": deltacp_fn("tiled"), "deltacp_naive": deltacp_fn("naive")}
    for cs, safe in ((16, False), (64, True)):
        f = fla_fn(cs, safe)
        if f is not None:
            impls[f"fla_chunk{cs}" + ("_safe_gate" if safe else "")] = f
    timed = [n for n in args.impls.split(",") if n in impls]
    # Accuracy of the timed implementations and the naive tier (its token loop is quick at this size): an FLA
    # configuration not timed is not compiled and autotuned for nothing.
    checked = {n: f for n, f in impls.items() if n in timed or n == "deltacp_naive"}
    print(f"# accuracy against float64 of {', '.join(checked)} (FLA's first calls compile its kernels)", flush=True)
    errors, grad_errors = accuracy(checked, shapes[0][2], shapes[0][3])
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), dtype="bf16",
                  gate=f"logsigmoid(randn) clamped to [{LOWER}, 0]", rows=[], errors_vs_fp64=errors,
                  grad_errors_vs_fp64=grad_errors, torch=torch.__version__)
    try:
        import triton
        result["triton"] = triton.__version__
        import fla
        result["fla"] = getattr(fla, "__version__", "?")
    except Exception:  # noqa: BLE001 - versions are for the record only
        pass
    for shape in shapes:
        for backward in (False, True):
            row = dict(shape=list(shape), direction="fwd+bwd" if backward else "fwd")
            for name in timed:
                fn = impls[name]
                print(f"# timing {name} {shape} {row['direction']}", flush=True)
                try:
                    row[name + "_ms"] = time_impl(fn, shape, backward)
                except Exception as e:  # noqa: BLE001 - record and go on (e.g. a shape one side refuses)
                    row[name + "_ms"] = None
                    row[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
                torch.cuda.empty_cache()
            fla = [row.get(k) for k in row if k.startswith("fla_") and k.endswith("_ms") and row.get(k)]
            if fla and row.get("deltacp_tiled_ms"):
                row["speedup_vs_faster_fla"] = min(fla) / row["deltacp_tiled_ms"]
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(json.dumps(result["errors_vs_fp64"]))
    print(json.dumps(result["grad_errors_vs_fp64"]))


if __name__ == "__main__":
    main()
