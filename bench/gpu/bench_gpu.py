"""GPU harness: deltacp's CUDA tiers beside FLA's Triton kernels, in the same run.

Measures, on the GPU it runs on:
  * the two ceilings: device copy bandwidth (bytes read + written) and the bf16 matmul rate;
  * for FLA's benchmark shapes (B, T, H, D; or B, T, H, K, V where the value head differs from the key
    head): forward and forward+backward time of each deltacp
    tier (naive, tiled) and of FLA (when its source is on PYTHONPATH), median of do_bench;
  * from counted bytes and FLOPs (see floor_bytes / chunked_flops below): TB/s, TFLOP/s and the
    fraction of the roofline floor max(bytes / copy_bw, flops / matmul_rate) / time;
  * accuracy on one small problem: each implementation's relative error against the fp64
    reference (deltacp.reference on the CPU, same bf16-rounded inputs), FLA's beside ours;
  * for the fused tier's forward rows, its serial chain (chain_profile below): the chain kernel's time per
    call, its CTAs, waves and chunks per CTA, hence the time of one chunk step, and the pieces' map pass;
  * memory of the forward+backward rows, each side in the same run (step_memory below): the step's
    peak above its inputs = torch.cuda.max_memory_allocated over the step + deltacp's high-water
    outside torch (deltacp.cuda_workspace_stats()["peak_reserved_bytes"]: 0 when its workspaces come
    from torch's caching allocator, the default under torch); per token-head too.

Writes JSON (--out); copied to docs/results/perf-<gpu>.json, bench/gpu/make_docs.py turns it into docs/perf.md.

    PYTHONPATH=fla_src python3 bench/gpu/bench_gpu.py --out $OUT/bench_gpu.json
"""
import argparse
import datetime
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [(4, 2048, 16, 128), (1, 8192, 96, 128), (2, 16384, 16, 128), (4, 4096, 64, 128)]
CHUNK = 64


# ---- counted work (per token and head, K = D, V = D unless given) -----------------------------
def floor_bytes(B, T, H, D, variant, backward, V=None):
    """Fewest bytes a kernel must move: every input read once, every output written once (bf16
    tensors, fp32 gates). Forward: q, k, v, g, beta in, o out. Backward adds do in and dq, dk, dv,
    dg, dbeta out (q, k, v, g, beta are read again)."""
    V = V or D
    g_elems = D if variant.startswith("kda") else 1
    qkv = (2 * D + V) * 2
    fwd = qkv + g_elems * 4 + 2 + V * 2
    if not backward:
        return B * T * H * fwd
    bwd = (qkv + g_elems * 4 + 2 + V * 2) + (qkv + g_elems * 4 + 2)
    return B * T * H * (fwd + bwd)


def chunked_flops(B, T, H, D, backward, V=None):
    """FLOPs of the chunked forward (C = 64), counted as the dense products the tiled tier issues:
    per chunk 3 state products (W S, K^T v_new, Q S: 2 C K V each), 3 C x C x K products (K K^T,
    T (Beta K e^G), Q K^T) and 2 C x C x V (T (Beta V), P v_new), plus the triangular solve C^3/3.
    The backward pass is counted as a forward recompute plus 2x the forward (the usual rule for
    matmul-bound layers), so forward+backward = 4x the forward; stated here so it can be redone."""
    C, K, V = CHUNK, D, V or D
    per_chunk = 3 * 2 * C * K * V + 3 * 2 * C * C * K + 2 * 2 * C * C * V + C ** 3 / 3
    fwd = B * H * math.ceil(T / C) * per_chunk
    return fwd * (4 if backward else 1)


# ---- inputs ---------------------------------------------------------------------------------
def make_inputs(B, T, H, D, variant, dtype=torch.bfloat16, seed=0, device="cuda", V=None):
    """q, k (L2-normalised) of head dim D, v of head dim V (default D), g, beta; see docs/design.md section 8.
    kda_gate (KDA with use_gate_in_kernel=True): g is the raw gate input (standard normal), with A_log [H]
    (log of uniform [1, 16], as Mamba-style models initialise it) and dt_bias [H * D] (0.1 standard normal); the
    call maps it to lower_bound sigmoid(exp(A_log) (g + dt_bias))."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, T, H, D, device=device, dtype=torch.float32, generator=gen)
    k = F.normalize(torch.randn(B, T, H, D, device=device, dtype=torch.float32, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V or D, device=device, dtype=torch.float32, generator=gen)
    gshape = (B, T, H, D) if variant.startswith("kda") else (B, T, H)
    g = torch.randn(gshape, device=device, dtype=torch.float32, generator=gen)
    if variant != "kda_gate":
        g = F.logsigmoid(g)
    if variant == "kda":
        g = g / 8  # per-dimension decays: keep the product over a chunk in a realistic range
    beta = torch.rand(B, T, H, device=device, dtype=torch.float32, generator=gen).sigmoid()
    x = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.float(), beta=beta.to(dtype))
    if variant == "kda_gate":
        x["A_log"] = torch.log(1 + 15 * torch.rand(H, device=device, dtype=torch.float32, generator=gen))
        x["dt_bias"] = 0.1 * torch.randn(H * D, device=device, dtype=torch.float32, generator=gen)
    return x


# The inputs a step differentiates: q, k, v, g, beta, and the gate's parameters where the call takes them.
def grad_inputs(x):
    return [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias") if n in x]


# The keyword arguments of FLA's own benchmark, given to both sides so that both do the same work: q and k
# are L2-normalised inside the call; KDA's gate is taken as safe (>= lower_bound). deltacp runs the l2 norm
# as its own pass before the kernels (deltacp/fla_options.py), FLA inside its kernels.
# kda_gate: KDA with the gate computed inside the call from the raw input, A_log and dt_bias (FLA's
# use_gate_in_kernel; deltacp maps it in torch before its kernels, docs/fla-compat.md).
FLA_BENCH_KWARGS = {"gdn": dict(use_qk_l2norm_in_kernel=True),
                    "kda": dict(use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0),
                    "kda_gate": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True,
                                     lower_bound=-5.0)}


def gate_params(x):
    """A_log and dt_bias as keyword arguments, where the inputs carry them (kda_gate)."""
    return {n: x[n] for n in ("A_log", "dt_bias") if n in x}


def deltacp_fn(variant, backend, kwargs=None):
    import deltacp
    op = deltacp.chunk_gated_delta_rule if variant == "gdn" else deltacp.chunk_kda
    kw = dict(kwargs or {})

    def run(x, h0=None, final=False):
        return op(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0, output_final_state=final,
                  backend=backend, **kw, **gate_params(x))
    return run


def fla_fn(variant, kwargs=None):
    try:
        import fla.ops.common.chunk_o as chunk_o
        # FLA refuses its GDN backward on Hopper with triton < 3.7.1 (a known wrong-result bug);
        # switched off for TIMING only (docs/design.md, benchmark rules). Accuracy below is measured
        # with the guard in place where it applies.
        chunk_o.TRITON_ABOVE_3_7_1 = True
        if variant == "gdn":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as op
        else:
            from fla.ops.kda import chunk_kda as op
    except Exception as e:  # FLA not on PYTHONPATH
        print(f"FLA not available: {e}", file=sys.stderr)
        return None

    kw = dict(kwargs or {})

    def run(x, h0=None, final=False):
        return op(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0, output_final_state=final, **kw,
                  **gate_params(x))
    return run


# ---- timing ---------------------------------------------------------------------------------
def bench_ms(fn, warmup=25, rep=100):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def measure_ceilings():
    n = 1 << 30  # 1 GiB copy
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    ms = bench_ms(lambda: b.copy_(a))
    copy_tbs = 2 * n / (ms * 1e-3) / 1e12
    del a, b
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: x @ y)
    mm_tflops = 2 * m ** 3 / (ms * 1e-3) / 1e12
    return copy_tbs, mm_tflops


def time_impl(fn, B, T, H, D, variant, backward, l2_bytes, V=None):
    # Rotate input sets when one set would fit in L2, so the timing is not of the cache.
    one = floor_bytes(B, T, H, D, variant, False, V)
    nsets = 1 if one > 3 * l2_bytes else 3
    sets = [make_inputs(B, T, H, D, variant, seed=s, V=V) for s in range(nsets)]
    if backward:
        for x in sets:
            for t in grad_inputs(x):
                t.requires_grad_(True)
        do = torch.randn(B, T, H, V or D, device="cuda", dtype=torch.bfloat16)
    it = [0]

    def step():
        x = sets[it[0] % nsets]
        it[0] += 1
        o = fn(x)[0]
        if backward:
            torch.autograd.grad(o, grad_inputs(x), do)
    step()  # compile / autotune outside the timing
    torch.cuda.synchronize()
    return bench_ms(step)


# ---- the fused forward's serial chain -------------------------------------------------------
def is_map_mode(kernel_name):
    """Whether a profiled fused_chain_kernel<T, NWG, kMap, ...> is the map mode (its third template argument)."""
    head = kernel_name.split("(")[0]
    if "fused_chain_kernel<" not in head:
        return False
    args = head[head.index("fused_chain_kernel<") + len("fused_chain_kernel<"):].rstrip(" >").split(",")
    return len(args) > 2 and args[2].strip() == "true"


def chain_profile(fn, B, T, H, D, variant, reps=5, V=None):
    """The fused forward's chain kernel from a torch.profiler trace of `reps` calls: {chain_ms: its time per
    call, chain_ctas: its grid, chain_waves: ceil(CTAs / SMs) (one CTA per SM), chain_chunks_per_cta: the
    chunks the longest sequence or piece walks (fixed-length inputs: ceil(T / 64) over the pieces per
    sequence = grid.x / B), chain_us_per_chunk = chain_ms / (waves x chunks per CTA), and map_ms: the
    pieces' pass 1 (the chain kernel's map mode; 0 over whole sequences)}."""
    import os
    import tempfile
    x = make_inputs(B, T, H, D, variant, seed=11, V=V)
    with torch.no_grad():
        fn(x)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn(x)
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    chain, maps, grid = 0.0, 0.0, None
    for e in events:
        name = e.get("name", "")
        # the chain kernel, or the one-kernel forward (the chain with the WY stage beside it)
        if e.get("cat") != "kernel" or ("fused_chain_kernel" not in name and "fused_one_kernel" not in name):
            continue
        if is_map_mode(name):
            maps += e["dur"]
        else:
            chain += e["dur"]
            grid = e.get("args", {}).get("grid", grid)
    if grid is None:
        return {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = grid[0] * grid[1] * grid[2]
    waves = -(-ctas // sms)
    chunks = -(-T // CHUNK)
    per_seq = max(1, grid[0] // B)
    per_cta = -(-chunks // per_seq)
    chain_ms = chain / reps / 1e3
    return dict(chain_ms=chain_ms, chain_ctas=ctas, chain_waves=waves, chain_chunks_per_cta=per_cta,
                chain_us_per_chunk=1e3 * chain_ms / (waves * per_cta), map_ms=maps / reps / 1e3)


# ---- memory ---------------------------------------------------------------------------------
def step_memory(fn, B, T, H, D, variant, V=None):
    """Peak bytes of one forward + backward step above its inputs (q, k, v, g, beta, do): (through torch,
    outside torch). Through torch: torch.cuda.max_memory_allocated over the step minus what was allocated
    before it (the outputs, the gradients and every workspace taken from torch's caching allocator). Outside
    torch: deltacp's own workspace pool's mapped high-water mark over the step (released before it, so only
    this step's), 0 for FLA. Run after the timing, so autotuning and compilation are not in it."""
    x = make_inputs(B, T, H, D, variant, seed=7, V=V)
    for t in grad_inputs(x):
        t.requires_grad_(True)
    do = torch.randn(B, T, H, V or D, device="cuda", dtype=torch.bfloat16)
    try:
        import deltacp
        stats = getattr(deltacp, "cuda_workspace_stats", None)
    except Exception:
        deltacp, stats = None, None
    torch.cuda.synchronize()
    if deltacp is not None:
        deltacp.cuda_release_workspace()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    if stats is not None:
        deltacp.cuda_reset_workspace_stats()
    o = fn(x)[0]
    grads = torch.autograd.grad(o, grad_inputs(x), do)
    torch.cuda.synchronize()
    through = torch.cuda.max_memory_allocated() - base
    outside = stats()["peak_reserved_bytes"] if stats is not None else 0
    del o, grads
    return through, outside


# ---- accuracy against the fp64 reference --------------------------------------------------
def accuracy(variant, impls):
    """Relative error ||x - ref|| / ||ref|| of o and every gradient, bf16 inputs, vs fp64 reference."""
    import numpy as np
    import deltacp.reference as R
    B, T, H, D = 2, 300, 4, 128
    x = make_inputs(B, T, H, D, variant, seed=123)
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    h0 = torch.randn(B, H, D, D, device="cuda", dtype=torch.float32) * 0.1
    dht = torch.randn(B, H, D, D, device="cuda", dtype=torch.float32)
    f64 = {n: t.detach().double().cpu().numpy() for n, t in x.items()}
    args = (f64["q"], f64["k"], f64["v"], f64["g"], f64["beta"])
    fwd = R.gated_delta_rule if variant == "gdn" else R.kda
    bwd = R.gated_delta_rule_backward if variant == "gdn" else R.kda_backward
    o_ref, ht_ref = fwd(*args, initial_state=h0.double().cpu().numpy(), output_final_state=True, chunk_size=64)
    g_ref = bwd(*args, do.double().cpu().numpy(), dht=dht.double().cpu().numpy(),
                initial_state=h0.double().cpu().numpy(), chunk_size=64)
    refs = dict(o=o_ref, ht=ht_ref, dq=g_ref["dq"], dk=g_ref["dk"], dv=g_ref["dv"], dg=g_ref["dg"],
                dbeta=g_ref["dbeta"], dh0=g_ref["dh0"])
    out = {}
    for name, fn in impls.items():
        if fn is None:
            continue
        xs = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        h0r = h0.clone().requires_grad_(True)
        try:
            o, ht = fn(xs, h0=h0r, final=True)
            grads = torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(),
                                        [xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], h0r])
        except Exception as e:
            out[name] = {"error": str(e)[:300]}
            continue
        got = dict(o=o, ht=ht, dq=grads[0], dk=grads[1], dv=grads[2], dg=grads[3], dbeta=grads[4], dh0=grads[5])
        out[name] = {}
        for key, ref in refs.items():
            g = got[key].detach().double().cpu().numpy().reshape(ref.shape)
            err = float(np.linalg.norm(g - ref) / max(np.linalg.norm(ref), 1e-300))
            out[name][key] = err if np.isfinite(err) else float("nan")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_gpu.json")
    ap.add_argument("--variants", default="gdn,kda",
                    help="gdn, kda, and kda_gate (KDA with use_gate_in_kernel=True, A_log and dt_bias; timing only)")
    ap.add_argument("--tiers", default="fused,tiled,naive")
    ap.add_argument("--time-variants", default=None, help="variants to time (default: all of --variants); "
                    "accuracy is measured for every variant")
    ap.add_argument("--naive-shapes", type=int, default=1,
                    help="time the naive tier on the first N shapes only (it is a token loop: slow)")
    ap.add_argument("--skip-naive-backward-above", type=int, default=4 * 2048 * 16,
                    help="skip the naive tier's fwd+bwd when B*T*H exceeds this (it is a token loop)")
    ap.add_argument("--shapes", default=None,
                    help="B,T,H,D (K = V = D) or B,T,H,K,V shapes to time, ';'-separated (default: the four shapes "
                         "of SHAPES below the imports)")
    ap.add_argument("--plain-call", action="store_true",
                    help="time both sides without FLA's benchmark keywords (FLA_BENCH_KWARGS: in-kernel l2 norm, "
                         "KDA's safe gate)")
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    copy_tbs, mm_tflops = measure_ceilings()
    res = {"gpu": props.name, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "copy_TBps": copy_tbs, "bf16_matmul_TFLOPs": mm_tflops, "rows": [], "accuracy": {}}
    try:
        import triton
        res["triton"] = triton.__version__
        import fla
        res["fla"] = getattr(fla, "__version__", "?")
    except Exception:
        pass
    print(f"# {props.name}: copy {copy_tbs:.2f} TB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    def save():  # after every row, so a run cut short by its time limit still leaves its numbers
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    timed = (args.time_variants or args.variants).split(",")
    for variant in args.variants.split(","):
        kw = {} if args.plain_call else FLA_BENCH_KWARGS[variant]
        impls = {f"deltacp-{t}": deltacp_fn(variant, t, kw) for t in args.tiers.split(",")}
        impls["fla"] = fla_fn(variant, kw)
        res.setdefault("call_kwargs", {})[variant] = kw
        # Against the fp64 reference of the plain call (the inputs as given, q not normalised); kda_gate's gate
        # mapping is checked against FLA's by tests/python/test_fla_call.py, its recurrence is kda's.
        if variant in ("gdn", "kda"):
            try:
                plain = {f"deltacp-{t}": deltacp_fn(variant, t) for t in args.tiers.split(",")}
                plain["fla"] = fla_fn(variant)
                res["accuracy"][variant] = accuracy(variant, plain)
            except Exception as e:
                res["accuracy"][variant] = {"error": str(e)[:300]}
            print(f"# accuracy {variant}: {json.dumps(res['accuracy'][variant])}", flush=True)
            save()
        if variant not in timed:
            continue
        for si, shape in enumerate(shapes):
            B, T, H, D = shape[:4]
            V = shape[4] if len(shape) > 4 else D
            for backward in (False, True):
                for name, fn in impls.items():
                    if fn is None:
                        continue
                    if name == "deltacp-naive" and (si >= args.naive_shapes or
                                                    (backward and B * T * H > args.skip_naive_backward_above)):
                        continue
                    row = dict(variant=variant, impl=name, B=B, T=T, H=H, D=D, V=V,
                               direction="fwd+bwd" if backward else "fwd")
                    try:
                        ms = time_impl(fn, B, T, H, D, variant, backward, l2, V)
                        byts = floor_bytes(B, T, H, D, variant, backward, V)
                        flops = chunked_flops(B, T, H, D, backward, V)
                        floor_ms = max(byts / (copy_tbs * 1e12), flops / (mm_tflops * 1e12)) * 1e3
                        row.update(ms=ms, TBps=byts / (ms * 1e-3) / 1e12, TFLOPs=flops / (ms * 1e-3) / 1e12,
                                   floor_ms=floor_ms, roofline_fraction=floor_ms / ms)
                        if name == "deltacp-fused" and not backward:
                            try:
                                row.update(chain_profile(fn, B, T, H, D, variant, V=V))
                            except Exception as e:  # the timing stands without it
                                row.update(chain_error=str(e)[:300])
                        if backward:
                            through, outside = step_memory(fn, B, T, H, D, variant, V)
                            row.update(peak_MiB=(through + outside) / 2**20, peak_torch_MiB=through / 2**20,
                                       peak_outside_torch_MiB=outside / 2**20,
                                       peak_bytes_per_token_head=(through + outside) / (B * T * H))
                    except Exception as e:
                        row.update(error=str(e)[:300])
                    res["rows"].append(row)
                    save()
                    print(json.dumps(row), flush=True)
                    torch.cuda.empty_cache()
    save()
    # Short table last (a remote run's log is often read from its tail).
    names = [f"deltacp-{t}" for t in args.tiers.split(",")] + ["fla"]
    print(f"\n{'variant':6} {'shape':22} {'dir':8} " + " ".join(f"{n:>16}" for n in names))
    def key(x):
        return (x["B"], x["T"], x["H"], x["D"]) + ((x["V"],) if x.get("V", x["D"]) != x["D"] else ())

    for variant in args.variants.split(","):
        for shape in shapes:
            for d in ("fwd", "fwd+bwd"):
                cells = []
                for n in names:
                    r = [x for x in res["rows"] if x["variant"] == variant and x["impl"] == n and
                         key(x) == shape and x["direction"] == d]
                    cells.append(f"{r[0]['ms']:>13.3f} ms" if r and "ms" in r[0] else f"{'-':>16}")
                print(f"{variant:6} {str(shape):22} {d:8} " + " ".join(cells))
    # Peak memory of forward+backward (through torch + outside torch), MiB, same run.
    print(f"\n{'variant':6} {'shape':22} {'peak MiB':8} " + " ".join(f"{n:>16}" for n in names))
    for variant in args.variants.split(","):
        for shape in shapes:
            cells = []
            for n in names:
                r = [x for x in res["rows"] if x["variant"] == variant and x["impl"] == n and
                     key(x) == shape and x["direction"] == "fwd+bwd"]
                cells.append(f"{r[0]['peak_MiB']:>12.0f} MiB" if r and "peak_MiB" in r[0] else f"{'-':>16}")
            print(f"{variant:6} {str(shape):22} {'fwd+bwd':8} " + " ".join(cells))


if __name__ == "__main__":
    main()
