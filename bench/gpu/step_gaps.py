"""Where the GPU waits for the host inside a step: the time between a step's kernels, and the host calls behind it.

    python3 bench/gpu/step_gaps.py --shape 2,16384,16,128 [--variant gdn] [--impl deltacp-fused|deltacp-tiled|fla]
                                   [--backward] [--repeat 10] [--plain-call]

A step is bench_gpu.py's (the same inputs, FLA's benchmark keywords unless --plain-call, steps issued back to
back as do_bench issues them). From a torch.profiler trace (CPU and CUDA activities) of --repeat steps:

  span     first GPU activity to last, per step (what do_bench times, less its own overhead)
  busy     the union of the GPU's kernels, copies and fills, per step
  idle     span - busy: the GPU waiting for the host (a blocking call, or host work slower than the kernels)
  gaps     the longest idle intervals, each with the kernel before it, the launch that ended it and the host
           operators (torch / deltacp calls) enclosing that launch
  calls    host time per step in the CUDA runtime and driver calls that can block or are slow (synchronise,
           copies, allocation, attribute setting), by name
  host     the host operators (torch and deltacp calls) by inclusive time per step: where a host-bound step's
           time goes

A kernel time table (stage_times.py) says what the GPU does; this says when it does nothing, and why. The
profiler slows the host several times over, so a host-bound step shows its gaps' places here, not their lengths;
for the CP step, bench/cp/cp_timeline.py times each phase without it.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import FLA_BENCH_KWARGS, deltacp_fn, fla_fn, make_inputs  # noqa: E402

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def short(name, w=60):
    return name if len(name) <= w else name[:w - 3] + "..."


def summarise(events, n, ngaps):
    """The trace's complete events ("ph": "X") of n steps -> (summary dict, printable lines)."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    launch_of = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    if not gpu:
        raise SystemExit("no GPU activity in the trace")
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    busy, end, gaps, prev = 0.0, gpu[0]["ts"], [], None
    for e in gpu:
        s, t = e["ts"], e["ts"] + e["dur"]
        if s > end:
            gaps.append((s - end, prev, e))
        busy += max(0.0, t - max(s, end))
        end = max(end, t)
        prev = e
    lines = [f"span {span / n / 1e3:.3f} ms per step, GPU busy {busy / n / 1e3:.3f} ms, idle "
             f"{(span - busy) / n / 1e3:.3f} ms ({len(gaps) / n:.1f} gaps per step)",
             f"the {ngaps} longest gaps (us): after kernel -> before kernel; the launch ending it, and its host ops"]

    def enclosing_ops(ts):
        inner = sorted((o for o in ops if o["ts"] <= ts <= o["ts"] + o["dur"]), key=lambda o: o["ts"])
        return " > ".join(short(o["name"], 40) for o in inner[-3:])

    shown = []
    for dur, before, after in sorted(gaps, key=lambda g: -g[0])[:ngaps]:
        launch = launch_of.get(after.get("args", {}).get("correlation"))
        where = (f"{short(launch['name'], 30)} at +{launch['ts'] - (before['ts'] + before['dur']):.0f} us, "
                 f"in {enclosing_ops(launch['ts'])}") if launch else "launch not in the trace"
        lines.append(f"  {dur:8.1f}  {short(before['name'], 45)} -> {short(after['name'], 45)}; {where}")
        shown.append(dict(us=dur, before=before["name"], after=after["name"], where=where))
    calls = collections.defaultdict(lambda: [0, 0.0])
    for e in runtime:
        calls[e["name"]][0] += 1
        calls[e["name"]][1] += e["dur"]
    lines.append("host time in CUDA runtime / driver calls per step (us; count per step):")
    for name, (cnt, us) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:12]:
        lines.append(f"  {us / n:9.1f}  {cnt / n:6.1f}  {name}")
    # Host operators by inclusive time (an operator's time includes the operators and calls it encloses).
    host = collections.defaultdict(lambda: [0, 0.0])
    for e in ops:
        host[e["name"]][0] += 1
        host[e["name"]][1] += e["dur"]
    lines.append("host operators per step, inclusive (us; count per step):")
    for name, (cnt, us) in sorted(host.items(), key=lambda kv: -kv[1][1])[:16]:
        lines.append(f"  {us / n:9.1f}  {cnt / n:6.1f}  {short(name, 70)}")
    summary = dict(span_ms=span / n / 1e3, busy_ms=busy / n / 1e3, idle_ms=(span - busy) / n / 1e3, gaps=shown,
                   calls={k: dict(count=v[0] / n, us=v[1] / n) for k, v in calls.items()},
                   host_ops={k: dict(count=v[0] / n, us=v[1] / n) for k, v in host.items()})
    return summary, lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2,16384,16,128")
    ap.add_argument("--variant", default="gdn")
    ap.add_argument("--impl", default="deltacp-fused")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--plain-call", action="store_true")
    ap.add_argument("--gaps", type=int, default=8, help="how many of the longest gaps to show")
    ap.add_argument("--json", default=None, help="also write the summary here")
    a = ap.parse_args()
    B, T, H, D = map(int, a.shape.split(","))
    kw = {} if a.plain_call else FLA_BENCH_KWARGS[a.variant]
    fn = fla_fn(a.variant, kw) if a.impl == "fla" else deltacp_fn(a.variant, a.impl.replace("deltacp-", ""), kw)
    if fn is None:
        sys.exit("FLA is not on PYTHONPATH")
    x = make_inputs(B, T, H, D, a.variant)
    names = ("q", "k", "v", "g", "beta")
    if a.backward:
        for n in names:
            x[n].requires_grad_(True)
        do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)

    def step():
        o = fn(x)[0]
        if a.backward:
            torch.autograd.grad(o, [x[n] for n in names], do)

    for _ in range(3):  # compile, autotune, fill the allocators
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.repeat):
            step()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    finally:
        os.unlink(path)

    label = f"{a.impl} {a.variant} {'fwd+bwd' if a.backward else 'fwd'} {(B, T, H, D)}"
    summary, lines = summarise(events, a.repeat, a.gaps)
    print(f"{label}: " + "\n".join(lines), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(label=label, **summary), f, indent=1)


if __name__ == "__main__":
    main()
