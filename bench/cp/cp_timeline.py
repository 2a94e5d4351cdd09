"""bench/cp/cp_timeline.py — one deltacp CP call, phase by phase: when the host enters and leaves each phase, and
when the GPU reaches its start and its end.

    torchrun --nproc_per_node=2 bench/cp/cp_timeline.py [--variant gdn|kda] [--backward] [--tokens 32768] \
        [--json cptimeline.json]
    torchrun --nproc_per_node=2 bench/cp/cp_timeline.py --device cpu --tokens 64 --heads 2 --head-dim 16  # smoke

The phases are the public op's prologue (its input checks, FLA's options, safe_gate's range check) and deltacp.cp's
own steps (PHASES below: the staged local forward's prepare and finish, the fingerprint check, the pre-pass, the
all-gather, the merge, the confirmation, and with --backward their mirrors). The tool wraps
each of those functions for the run: at entry and exit it reads the host clock and records a CUDA event on the
current stream. Nothing else is instrumented, so the host runs at its own speed; torch.profiler slows it several
times over (bench/gpu/step_gaps.py), which hides exactly the waits this looks for.

The inputs, call and timing rule are bench_cp_step.py's: one sequence over every rank (--tokens per rank), FLA's
benchmark keywords, and each call after a barrier and a synchronisation. The table has, per rank, the median over
--repeat calls, in ms since the call began:

  host in / host out   the host entering and leaving the phase (a blocking wait shows as a long phase)
  gpu in / gpu out     the GPU reaching the phase's first and last enqueued work, in stream order

Reading it: where a phase's "gpu in" equals its "host in", the GPU was idle until the host got there, so the host
is on the critical path; where "gpu in" is later, the host ran ahead. The same call without cp_context on the
rank's slice (one GPU, the efficiency's reference) comes first. On CPUs (gloo) only the host columns mean anything.

--json adds the run to a results file (one section per variant and direction, e.g. "gdn fwd", kept beside the
sections of other runs): every rank's two calls with their phases, which bench/gpu/make_docs.py renders into
docs/context-parallel.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
# deltacp.cp's steps, by module: functions looked up through the module's globals at each call (so a wrapper set
# on the module is what the op calls). _staged_call is shown by the staged function it runs and, for a step, the
# step's name ("staged_forward_step:finish").
PHASES = {
    # The public op's prologue (deltacp.ops: its checks, FLA's options, safe_gate's range check; the one-GPU
    # call's forward), then deltacp.cp's own steps.
    "deltacp.ops": ("check_inputs", "start_gate_range_check", "_methods"),
    "deltacp.fla_options": ("preprocess",),
    "deltacp._library": ("chunk_fwd",),
    "deltacp.cp": ("cp_apply",),
    "deltacp.cp.ops": ("check_inputs", "_methods"),
    "deltacp.cp.autograd": ("_descs", "_settle_forward_tier", "_staged_call", "_start_check", "_prepass_forward",
                            "_finish_check", "_all_gather", "_merge_forward", "_local_initial_states",
                            "_head_forward", "_run", "_prepass_backward", "_merge_backward"),
    # inside the pre-passes: the local forward's cut, the pieces' maps it copies or composes
    "deltacp.cp.exchange": ("_confirm", "_cut_bounds", "_first_segment_maps", "_local_piece_maps",
                            "_composed_local_maps", "_dh0_pieces"),
}


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Recorder:
    """The wrapped phases' marks of one call: (label, host in, host out, event in, event out)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks, self.t0 = [], 0.0

    def event(self):
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def wrap(self, fn, name):
        @functools.wraps(fn)
        def phase(*args, **kwargs):
            label = name
            if name == "_staged_call" and len(args) > 1:  # (cfg, core function, ...[, step name])
                label = getattr(args[1], "__name__", "staged")
                step = next((a for a in args[2:4] if isinstance(a, str) and a in ("states", "finish")), None)
                label += f":{step}" if step else ""
            e0, h0 = self.event(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                h1 = time.perf_counter()
                self.marks.append((label, h0 - self.t0, h1 - self.t0, e0, self.event()))
        return phase

    @contextlib.contextmanager
    def installed(self):
        saved = []
        for modname, names in PHASES.items():
            mod = importlib.import_module(modname)
            for name in names:
                if hasattr(mod, name):
                    saved.append((mod, name, getattr(mod, name)))
                    setattr(mod, name, self.wrap(getattr(mod, name), name))
        try:
            yield
        finally:
            for mod, name, fn in saved:
                setattr(mod, name, fn)


def timeline(fn, rec: Recorder, ranks, repeat: int, warmup: int):
    """{"call_ms", "host_ms", "phases": [(label, [host in, host out, gpu in, gpu out])]} (medians, ms)."""
    rows, calls, hosts = {}, [], []
    for i in range(warmup + repeat):
        ranks.barrier()
        ranks.sync()
        rec.marks = []
        start = rec.event()
        rec.t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - rec.t0
        ranks.sync()
        call = time.perf_counter() - rec.t0
        if i < warmup:
            continue
        calls.append(call * 1e3)
        hosts.append(host * 1e3)
        seen = {}
        for label, h0, h1, e0, e1 in rec.marks:
            n = seen[label] = seen.get(label, 0) + 1
            key = label if n == 1 else f"{label}#{n}"
            g0 = start.elapsed_time(e0) if start is not None else float("nan")
            g1 = start.elapsed_time(e1) if start is not None else float("nan")
            rows.setdefault(key, []).append((h0 * 1e3, h1 * 1e3, g0, g1))
    phases = [(key, [statistics.median(r[j] for r in v) for j in range(4)]) for key, v in rows.items()]
    phases.sort(key=lambda kv: kv[1][0])
    return {"call_ms": statistics.median(calls), "host_ms": statistics.median(hosts), "phases": phases}


def render(rank: int, label: str, t: dict) -> str:
    lines = [f"rank {rank}, {label}: call {t['call_ms']:.3f} ms, the host returns at {t['host_ms']:.3f} ms"]
    if t["phases"]:
        lines.append(f"  {'phase':38s} {'host in':>8s} {'host out':>8s} {'gpu in':>8s} {'gpu out':>8s}")
        for key, (h0, h1, g0, g1) in t["phases"]:
            gpu = " ".join(f"{x:8.3f}" if x == x else f"{'-':>8s}" for x in (g0, g1))  # NaN: no GPU (CPU run)
            lines.append(f"  {key:38s} {h0:8.3f} {h1:8.3f} {gpu}")
    return "\n".join(lines)


def add_to_results(path: Path, head: dict, section: str, ranks: list) -> None:
    """Section `section` of the results file at path: ranks[r] = {"one_gpu": timeline, "cp": timeline} (timeline():
    call_ms, host_ms, phases), the problem and the GPU in `head`; the file's other sections are kept."""
    def plain(t):  # NaN (no GPU columns on CPUs) as null
        return {"call_ms": t["call_ms"], "host_ms": t["host_ms"],
                "phases": [[name, [None if y != y else y for y in times]] for name, times in t["phases"]]}

    res = json.loads(path.read_text()) if path.exists() else {}
    res.update(head)
    res.setdefault("sections", {})[section] = {
        "ranks": [{"one_gpu": plain(r["one_gpu"]), "cp": plain(r["cp"])} for r in ranks]}
    path.write_text(json.dumps(res, indent=1) + "\n")


def main():
    step = _load("bench_cp_step", REPO / "bench" / "cp" / "bench_cp_step.py")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    step.bench_cp.add_problem_args(p)
    p.add_argument("--variant", default="gdn", choices=("gdn", "kda"))
    p.add_argument("--backward", action="store_true", help="forward + backward (torch.autograd.grad) per call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="add this run to a results file (its section: variant, direction)")
    a = p.parse_args()
    device = step.bench_cp.start_process_group(a.device, 600.0)
    import deltacp
    import deltacp.cp as cp

    ranks = step.Ranks(device)
    dtype = getattr(torch, a.dtype)
    world = ranks.world
    ctx = cp.build_context(torch.tensor([0, a.tokens * world]), device=device)
    x, do = step.make_rank_inputs(a.variant, a, ranks.rank, device, dtype)
    op = {"gdn": deltacp.chunk_gated_delta_rule, "kda": deltacp.chunk_kda}[a.variant]
    kw = step.bench_gpu.FLA_BENCH_KWARGS[a.variant]
    rec = Recorder(device)
    out, mine = [], {}
    direction = "fwd+bwd" if a.backward else "fwd"
    for key, label, context in (("one_gpu", "one GPU (no cp_context)", None), ("cp", "deltacp CP", ctx)):
        fwd, fwd_bwd, _ = step.step_fns(op, x, do, kw, context)
        fn = fwd_bwd if a.backward else fwd
        with rec.installed(), (contextlib.nullcontext() if a.backward else torch.no_grad()):
            t = timeline(fn, rec, ranks, a.repeat, a.warmup)
        out.append(render(ranks.rank, f"{a.variant} {direction} {label}", t))
        mine[key] = t
    gathered = ranks.gather(("\n".join(out), mine))
    if ranks.rank == 0:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        head = (f"{a.variant}, {world} ranks ({gpu}), {a.tokens} tokens per rank, H={a.heads}, K=V={a.head_dim}, "
                f"{a.dtype}; medians of {a.repeat} calls, ms since the call began")
        print(head + "\n" + "\n\n".join(text for text, _ in gathered), flush=True)
        if a.json:
            add_to_results(Path(a.json), {
                "gpu": gpu, "date": time.strftime("%Y-%m-%d"), "world": world, "tokens_per_rank": a.tokens,
                "heads": a.heads, "head_dim": a.head_dim, "dtype": a.dtype, "repeat": a.repeat,
                "source": "bench/cp/cp_timeline.py, FLA's benchmark keywords", "versions": step.versions()},
                f"{a.variant} {direction}", [timings for _, timings in gathered])
    # Every rank past its last collective before any tears the group down: a rank that destroyed it while
    # rank 0 was still writing the results aborted at exit under gloo ("terminate called without an active
    # exception"), about one run in five on a 2-core machine.
    ranks.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
