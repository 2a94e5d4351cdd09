"""bench/cp/bench_cp_step.py — the CP training step of deltacp beside FLA's own CP, GDN and KDA.

    torchrun --nproc_per_node=2 bench/cp/bench_cp_step.py              # GPUs: NCCL, bf16, H=16, K=V=128
    torchrun --nproc_per_node=2 bench/cp/bench_cp_step.py --device cpu --tokens 128 --heads 2 --head-dim 16 \\
        --repeat 2 --warmup 1                                           # smoke: gloo, the chunked reference

One sequence spans every rank (--tokens per rank). Each rank makes its own random inputs the way
bench/gpu/bench_gpu.py's make_inputs does (q, v randn; k L2-normalised; GDN g = logsigmoid, KDA g per key
dimension = logsigmoid / 8; beta sigmoid; the gates in float32), and both libraries are called with FLA's
benchmark keywords (bench_gpu.py FLA_BENCH_KWARGS: the in-kernel l2 norm; KDA's safe gate, lower_bound -5).
Per variant, four steps are timed in interleaved rounds (each call after a barrier and a synchronisation,
median of --repeat after --warmup rounds), forward alone (grad disabled) and forward + backward:

  deltacp_cp       deltacp.chunk_gated_delta_rule / chunk_kda with cp_context (deltacp.cp.build_context), its
                   default route: a fused local forward in stages, the pre-pass from its own pieces' maps
  deltacp_cp_oneshot  the same with DELTACP_CP_STAGED_FUSED=0 (the fused local forward one-shot after the
                   exchange, the pre-pass a tiled state-only run of its own), timed in the same rounds (GPUs;
                   --no-oneshot skips it)
  deltacp_one_gpu  the same call without cp_context on the rank's slice: the same per-rank work on one GPU
  fla_cp           FLA's op with its cp_context (fla.ops.cp.build_cp_context over the same global cu_seqlens)
  fla_one_gpu      FLA's op without cp_context on the rank's slice

per-rank efficiency = one GPU's time / the CP step's, each the slowest rank's (docs/design.md section 8).
Also, per variant:

  exchange     what deltacp's CP forward adds before its local kernel can run, timed through deltacp.cp's
               own internal functions as bench/cp/bench_cp.py does: the pre-pass (beyond the stages the local
               forward runs anyway, where the staged tiled forward runs), the all-gather and the merge, against
               the local forward; rank 0 (it sends)
  errors       relative errors ||x - ref|| / ||ref|| of o, dq, dk, dv, dg, dbeta on every rank: deltacp's CP
               against FLA's CP, and both against deltacp on one GPU over the whole global sequence (the inputs
               all-gathered), which is independent of FLA (see FLA_GUARD below); max over ranks
  peak memory  of one step: torch.cuda.max_memory_allocated above what was allocated before it, plus deltacp's
               workspace high-water mark outside torch (deltacp.cuda_workspace_stats, 0 under torch's allocator)

Without FLA (not importable) or on CPUs the FLA parts are skipped. Rank 0 prints a table and writes JSON to
$OUT/bench_cp_step.json (or --json), after each variant, so a run cut short keeps what it measured;
bench/gpu/make_docs.py renders it from docs/results/cpstep-<gpu>x<world>.json.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ("gdn", "kda")
IMPLS = ("deltacp_cp", "deltacp_cp_oneshot", "deltacp_one_gpu", "fla_cp", "fla_one_gpu")
STAGED_FUSED = "DELTACP_CP_STAGED_FUSED"  # deltacp.cp.local._fused_staged_enabled, read at each call
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")
TARGETS = {"efficiency_fwd": 0.85, "efficiency_fwd+bwd": 0.90, "exchange_fraction": 0.10}


def _load(name: str, path: Path):
    """A module from a file of this repository that is not on sys.path (the one-GPU harness, the docs generator)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# The inputs and FLA's benchmark keywords of the one-GPU harness, so that both benchmarks measure the same call.
bench_gpu = _load("bench_gpu", REPO / "bench" / "gpu" / "bench_gpu.py")
bench_cp = _load("bench_cp", REPO / "bench" / "cp" / "bench_cp.py")


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_cp.add_problem_args(p)
    p.add_argument("--variants", default="gdn,kda", help="comma-separated, of: " + ", ".join(VARIANTS))
    p.add_argument("--seed", type=int, default=0, help="rank r's inputs use seed + r, its upstream gradient seed + "
                   "10000 + r")
    p.add_argument("--cp-timeout", type=float, default=120.0, help="seconds a deltacp CP collective may take "
                   "(deltacp.cp.build_context's timeout)")
    p.add_argument("--pg-timeout", type=float, default=900.0, help="seconds a torch.distributed collective may take "
                   "(FLA's first calls compile and autotune while the other ranks wait in a collective)")
    p.add_argument("--no-fla", action="store_true", help="skip FLA's steps even where FLA imports")
    p.add_argument("--no-oneshot", action="store_true",
                   help="skip deltacp_cp_oneshot, the CP step with its fused local forward one-shot "
                        "(DELTACP_CP_STAGED_FUSED=0) timed beside the default staged route (GPUs)")
    p.add_argument("--check-full-max-tokens", type=int, default=1 << 19,
                   help="the check against one GPU over the whole sequence runs when tokens x world is at most this")
    p.add_argument("--json", default=None, help="default: $OUT/bench_cp_step.json ($OUT default: .)")
    a = p.parse_args()
    variants = [x.strip() for x in a.variants.split(",") if x.strip()]
    bad = [x for x in variants if x not in VARIANTS]
    if bad or not variants:
        p.error(f"argument --variants: expected a comma-separated list of {', '.join(VARIANTS)}, got {a.variants!r}")
    a.variants = variants
    for name in ("tokens", "heads", "head_dim", "repeat"):
        if getattr(a, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: expected an integer >= 1, got {getattr(a, name)}")
    if a.warmup < 0:
        p.error(f"argument --warmup: expected an integer >= 0, got {a.warmup}")
    for name in ("cp_timeout", "pg_timeout"):
        if not getattr(a, name) > 0:
            p.error(f"argument --{name.replace('_', '-')}: expected a positive number of seconds, got "
                    f"{getattr(a, name)}")
    return a


# ---- the ranks together -------------------------------------------------------------------------------------
class Ranks:
    """The process group as this benchmark uses it: barriers on the rank's own device, objects gathered."""

    def __init__(self, device):
        self.device = device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def barrier(self):
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])  # NCCL: the rank's own GPU, not a guessed one
        else:
            dist.barrier()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def gather(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def say(self, text: str):
        """A progress line from rank 0 (long steps must show that they are alive)."""
        if self.rank == 0:
            print(f"[cpstep {time.strftime('%H:%M:%S')}] {text}", flush=True)


def time_interleaved(fns: dict, ranks: Ranks, repeat: int, warmup: int) -> dict:
    """{name: median seconds, name + "_host": median seconds until the call returned} of functions timed round by
    round, each call after a barrier and a synchronisation (bench/cp/bench_cp.py's time_interleaved): slow drifts
    of the machine hit every function alike, so their ratios compare like with like. The warm-up rounds take the
    barriers too: a rank that compiles or autotunes there must not leave another waiting inside a CP collective,
    whose timeout is shorter than the group's."""
    for _ in range(warmup):
        for fn in fns.values():
            ranks.barrier()
            fn()
            ranks.sync()
    times = {name: [] for name in fns}
    host = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            ranks.barrier()
            ranks.sync()
            t0 = time.perf_counter()
            fn()
            host[name].append(time.perf_counter() - t0)
            ranks.sync()
            times[name].append(time.perf_counter() - t0)
    out = {name: statistics.median(v) for name, v in times.items()}
    out.update({name + "_host": statistics.median(v) for name, v in host.items()})
    return out


# ---- FLA ----------------------------------------------------------------------------------------------------
class Fla:
    """FLA's ops and CP context builder, when FLA imports (its source on PYTHONPATH, as in bench_gpu.py)."""

    def __init__(self, device, disabled: bool):
        self.ops, self.version, self.reason, self.guard_bypassed = None, None, None, False
        if disabled:
            self.reason = "--no-fla"
            return
        if device.type != "cuda":
            self.reason = "FLA's kernels need CUDA tensors"
            return
        try:
            import fla
            import fla.ops.common.chunk_o as chunk_o
            from fla.ops.cp import build_cp_context
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            from fla.ops.kda import chunk_kda
        except Exception as e:  # noqa: BLE001 - not on PYTHONPATH, or its import fails on this machine
            self.reason = f"FLA not available: {type(e).__name__}: {e}"
            return
        # FLA refuses its GDN backward on Hopper with triton in [3.4.0, 3.7.1) (a known wrong-result bug of its
        # gated chunk_bwd_dqkwg); switched off for timing as in bench_gpu.py's fla_fn. Where it applied, FLA's own
        # GDN gradients may be wrong: the errors against deltacp on one GPU over the whole sequence tell.
        self.guard_bypassed = bool(getattr(chunk_o, "IS_NVIDIA_HOPPER", False) and
                                   getattr(chunk_o, "TRITON_ABOVE_3_4_0", False) and
                                   not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True))
        chunk_o.TRITON_ABOVE_3_7_1 = True
        self.ops = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda}
        self.build_cp_context = build_cp_context
        self.version = getattr(fla, "__version__", "?")


# ---- the steps ----------------------------------------------------------------------------------------------
def make_rank_inputs(variant, args, rank, device, dtype):
    """Rank `rank`'s inputs (bench_gpu.make_inputs: gates in float32) and upstream gradient do."""
    x = bench_gpu.make_inputs(1, args.tokens, args.heads, args.head_dim, variant, dtype=dtype, seed=args.seed + rank,
                              device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed + 10000 + rank)
    do = torch.randn(1, args.tokens, args.heads, args.head_dim, device=device, dtype=torch.float32,
                     generator=gen).to(dtype)
    return x, do


def step_fns(op, x, do, kw, cp_context):
    """(forward, forward + backward, one step returning [o, dq, dk, dv, dg, dbeta]) of one implementation on leaves
    of its own made from x. The gradients come from torch.autograd.grad (no accumulation into .grad between calls,
    the same for every implementation)."""
    leaves = [x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
    extra = {} if cp_context is None else {"cp_context": cp_context}

    def call():
        return op(*leaves, **kw, **extra)[0]

    def fwd():
        call()

    def fwd_bwd():
        torch.autograd.grad(call(), leaves, do)

    def with_grads():
        with torch.enable_grad():
            o = call()
            grads = torch.autograd.grad(o, leaves, do)
        return [o.detach()] + [g_.detach() for g_ in grads]

    return fwd, fwd_bwd, with_grads


def with_env(fns, name: str, value: str):
    """fns (step_fns' three callables) each run with the environment variable name = value, restored after."""
    def wrap(fn):
        def run():
            old = os.environ.get(name)
            os.environ[name] = value
            try:
                return fn()
            finally:
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old
        return run
    return tuple(wrap(f) for f in fns)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().float(), ref.detach().float()
    den = ref.norm()
    num = (x - ref).norm()
    return float(num / den) if float(den) > 0 else float(num)


def errors_of(got, ref) -> dict:
    return {name: rel_err(a, b) for name, a, b in zip(("o",) + GRAD_NAMES, got, ref)}


def whole_sequence_reference(op, x, do, kw, ranks: Ranks):
    """deltacp on one GPU over the whole global sequence (every rank's inputs all-gathered here), cut to this rank's
    slice: o and the gradients. Independent of FLA and of deltacp's CP path."""
    T = x["q"].shape[1]
    full = {}
    for name in ("q", "k", "v", "g", "beta"):
        parts = [torch.empty_like(x[name]) for _ in range(ranks.world)]
        dist.all_gather(parts, x[name].contiguous())
        full[name] = torch.cat(parts, dim=1)
    parts = [torch.empty_like(do) for _ in range(ranks.world)]
    dist.all_gather(parts, do.contiguous())
    do_full = torch.cat(parts, dim=1)
    *_, with_grads = step_fns(op, full, do_full, kw, None)
    out = with_grads()
    r = ranks.rank
    return [t[:, r * T:(r + 1) * T].clone() for t in out]


def step_memory(fn, ranks: Ranks, deltacp):
    """(through torch, outside torch) bytes of one call of fn above what was allocated before it; None on CPUs."""
    if ranks.device.type != "cuda":
        return None
    ranks.sync()
    ranks.barrier()
    stats = getattr(deltacp, "cuda_workspace_stats", None)
    if stats is not None:
        deltacp.cuda_release_workspace()
        deltacp.cuda_reset_workspace_stats()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(ranks.device)
    torch.cuda.reset_peak_memory_stats(ranks.device)
    fn()
    ranks.sync()
    through = torch.cuda.max_memory_allocated(ranks.device) - base
    outside = int(stats()["peak_reserved_bytes"]) if stats is not None else 0
    return int(through), outside


def exchange_parts(variant, x, ctx, device, dtype, args, ranks: Ranks) -> dict:
    """The CP forward's exchange, timed through deltacp.cp's own functions (as bench/cp/bench_cp.py does, for the
    variant at hand): {"times": {part: seconds}, "route"} on every rank, or {"error": text} on every rank.

    The inputs are those the CP op hands its autograd function: q, k l2-normalised by the op's pre-pass
    (deltacp.fla_options.preprocess for use_qk_l2norm_in_kernel), the gate in float32. Parts:
      prepass          the forward pre-pass alone: [H | M] of the rank's last segment (a separate run)
      prepass_staged   (a staged local forward, tiled or fused) the local forward's prepare stages + the pre-pass from them
      prepare_only     those prepare stages alone; prepass_staged - prepare_only is what the pre-pass adds
      allgather_merge  the all-gather of what the pre-pass sends + the merge of the earlier ranks' maps
      local_forward    the rank's local forward from a zero state (the op's method), the yardstick
    The forward pre-pass does not make the backward's first-segment maps here (want_first_maps=False: a forward
    without gradients); rank 0, whose fraction is reported, has none to make either way."""
    from deltacp import _core
    from deltacp._calls import _run
    from deltacp._describe import torch_desc
    from deltacp.cp import exchange as ex
    from deltacp.cp import local as lo
    from deltacp.cp import ops as cp_ops
    from deltacp.fla_options import l2norm

    q, k = l2norm(x["q"]), l2norm(x["k"])
    v, g, beta = x["v"], x["g"], x["beta"]
    cfg = lo._Cfg()
    cfg.variant, cfg.gate_name, cfg.scale, cfg.chunk_size = variant, "g", None, 64
    cfg.output_final_state = False
    cfg.compute = "float64" if dtype == torch.float64 else "float32"
    cfg.state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cfg.ctx, cfg.device = ctx, device
    cfg.H, cfg.K, cfg.HV, cfg.V = q.shape[2], q.shape[3], v.shape[2], v.shape[3]
    cfg.num_seqs, cfg.has_h0 = 1, False
    cfg.fwd_method, cfg.bwd_method = cp_ops._methods(variant, None, device, False)
    cfg.fwd_named = False
    T_loc = q.shape[1]
    xs = (q, k, v, g, beta, None, None)
    pad = lo._grid_pad(cfg)  # the head piece before the body, as the CP forward cuts it (0 at multiples of 64)
    o = torch.empty((1, T_loc, cfg.HV, cfg.V), dtype=q.dtype, device=device)

    def prepass():
        return ex._prepass_forward(cfg, q, k, v, g, beta, None, None, None, want_first_maps=False)[0]

    local_descs = lo._descs(cfg, q, k, v, g, beta, None, None)
    local_descs["o"] = torch_desc(o, "o")
    from deltacp.cp.autograd import _settle_forward_tier

    _settle_forward_tier(cfg, local_descs)  # the rank's local forward tier, as the CP op settles it

    def local_forward():
        _run(cfg, "forward", cfg.fwd_method, local_descs)

    staged = lo._staged_available(cfg, "forward", q, g)

    def body_descs():  # the staged forward's problem: the body [pad, T_loc), as deltacp/cp/autograd.py builds it
        cu, cu_host, body, o_body = ctx.cu_seqlens, ctx.cu_seqlens_cpu, xs, o
        if pad:
            cu, cu_host = lo._body_cu_seqlens(cfg, pad)
            body, o_body = lo._split(xs, pad, T_loc), o[:, pad:]
        descs = lo._descs(cfg, *body, cu=cu, cu_host=cu_host)
        descs["o"] = torch_desc(o_body, "o")
        return descs, body

    def prepass_staged():
        descs, body = body_descs()
        handle = lo._staged_call(cfg, _core.staged_forward_prepare, variant, cfg.fwd_method, descs)
        sent = ex._prepass_forward(cfg, q, k, v, g, beta, None, None, None, want_first_maps=False,
                                   prepared=lo._PreparedForward(handle, pad, cfg.fwd_method), local_descs=descs)[0]
        torch.cuda.current_stream(device).synchronize()  # the handle's workspace must outlive its kernels
        return sent

    def prepare_only():
        descs, body = body_descs()
        lo._staged_call(cfg, _core.staged_forward_prepare, variant, cfg.fwd_method, descs)
        torch.cuda.current_stream(device).synchronize()

    # Every local part once on its own first: a rank that fails here must not leave the others in a collective.
    error = None
    try:
        with torch.no_grad():
            sent = [prepass()]
            local_forward()
            if staged:
                prepass_staged()
                prepare_only()
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the steps' timings stand without it
        error = f"rank {ranks.rank}: {type(e).__name__}: {str(e)[:400]}"
    errors = [e for e in ranks.gather(error) if e]
    if errors:
        return {"error": errors[0]}

    def allgather_merge():
        gathered = ex._all_gather(cfg, sent[0], "the benchmark's all-gather")
        return ex._merge_forward(cfg, gathered)

    fns = {"prepass": prepass, "allgather_merge": allgather_merge, "local_forward": local_forward}
    if staged:
        fns.update(prepass_staged=prepass_staged, prepare_only=prepare_only)
    with torch.no_grad():
        times = time_interleaved(fns, ranks, args.repeat, args.warmup)
    return {"times": {n: t for n, t in times.items() if not n.endswith("_host")},
            "route": "staged" if staged else "separate", "local_method": cfg.fwd_method, "pad": pad,
            "sent_shape": list(sent[0].shape)}


def exchange_summary(rows) -> dict:
    """Rank 0's exchange: what the pre-pass adds + all-gather + merge, against its local forward."""
    r0 = rows[0]
    if "error" in r0:
        return {"error": r0["error"]}
    t = r0["times"]
    if r0["route"] == "staged":
        pre = max(t["prepass_staged"] - t["prepare_only"], 0.0)
        pre_what = "beyond the staged local forward's prepare stages"
    else:
        pre = t["prepass"]
        pre_what = f"a run of its own: the local {r0['local_method']} forward is not staged"
    ex_s = pre + t["allgather_merge"]
    out = {"route": r0["route"], "prepass_what": pre_what, "local_method": r0["local_method"],
           "prepass_ms": pre * 1e3, "allgather_merge_ms": t["allgather_merge"] * 1e3,
           "local_forward_ms": t["local_forward"] * 1e3, "exchange_ms": ex_s * 1e3,
           "exchange_fraction_of_local_fwd": ex_s / t["local_forward"] if t["local_forward"] > 0 else None,
           "sent_shape": r0["sent_shape"],
           "rank0_parts_ms": {n: v * 1e3 for n, v in t.items()}}
    out["max_over_ranks_parts_ms"] = {n: max(r["times"][n] for r in rows) * 1e3 for n in t}
    return out


def run_variant(variant, args, ranks: Ranks, device, dtype, ctx, fla, fla_ctx, deltacp, cp) -> dict:
    """Everything measured for one variant; the same dict on every rank (gathered)."""
    # The same keywords on both sides and on every device: deltacp's CPU path (the chunked reference) takes them too
    # (the l2 norm and safe_gate's range check run in torch before the op, deltacp/fla_options.py).
    kw = dict(bench_gpu.FLA_BENCH_KWARGS[variant])
    op = deltacp.chunk_gated_delta_rule if variant == "gdn" else deltacp.chunk_kda
    x, do = make_rank_inputs(variant, args, ranks.rank, device, dtype)
    fns = {"deltacp_cp": with_env(step_fns(op, x, do, kw, ctx), STAGED_FUSED, "1")}
    if not args.no_oneshot and device.type == "cuda":  # the fused local forward's other route, same rounds
        fns["deltacp_cp_oneshot"] = with_env(step_fns(op, x, do, kw, ctx), STAGED_FUSED, "0")
    fns["deltacp_one_gpu"] = step_fns(op, x, do, kw, None)
    fla_op = fla.ops[variant] if fla.ops else None
    if fla_op is not None:
        fns["fla_cp"] = step_fns(fla_op, x, do, kw, fla_ctx)
        fns["fla_one_gpu"] = step_fns(fla_op, x, do, kw, None)
    out = {"call_kwargs": kw}

    # 1. The first calls (FLA compiles and autotunes here: minutes) and the results to check, every step with
    # gradients. A failure common to every rank skips the variant's FLA side (or the variant) with its text.
    results, errors = {}, {}
    for name, (_, _, with_grads) in fns.items():
        ranks.say(f"{variant}: first call of {name} (forward + backward)" +
                  (": FLA compiles and autotunes now, possibly minutes" if name.startswith("fla") else ""))
        err = None
        try:
            results[name] = with_grads()
            if name == "deltacp_cp":  # what this CP call ran and exchanged (deltacp.cp.last_stats, per call)
                out["local_tier"] = dict(cp.last_stats.get("local_tier", {}))
                out["exchange_bytes_per_rank"] = {"forward": cp.last_stats.get("forward_bytes"),
                                                  "backward": cp.last_stats.get("backward_bytes")}
        except Exception as e:  # noqa: BLE001 - reported; the other implementations still run
            err = f"rank {ranks.rank}: {type(e).__name__}: {str(e)[:400]}"
        ranks.sync()
        errs = [e for e in ranks.gather(err) if e]
        if errs:
            errors[name] = " | ".join(errs)  # every rank's: the first to fail is often not rank 0
            ranks.say(f"{variant}: {name} failed: {errors[name]}")
    for name in errors:
        fns.pop(name)
        results.pop(name, None)
    if errors:
        out["failed"] = errors
    if "deltacp_cp" not in fns:
        return out
    if device.type == "cuda" and "deltacp_one_gpu" in fns:
        with torch.no_grad():
            fns["deltacp_one_gpu"][0]()  # a forward without gradients: the tier deltacp picks for inference
        out["one_gpu_forward_tier"] = list(deltacp.last_cuda_tier())

    # 2. Correctness: deltacp's CP against FLA's CP on the same rank, and both against deltacp on one GPU over the
    # whole sequence.
    errs = {}
    if "fla_cp" in results:
        errs["deltacp_cp_vs_fla_cp"] = errors_of(results["deltacp_cp"], results["fla_cp"])
    if ranks.world * args.tokens <= args.check_full_max_tokens:
        ranks.say(f"{variant}: deltacp on one GPU over the whole sequence ({ranks.world * args.tokens} tokens), "
                  "the reference of the check")
        ref = whole_sequence_reference(op, x, do, kw, ranks)
        for name in ("deltacp_cp", "deltacp_cp_oneshot", "fla_cp"):
            if name in results:
                errs[f"{name}_vs_whole_sequence"] = errors_of(results[name], ref)
        del ref
    else:
        errs["whole_sequence"] = f"skipped: {ranks.world * args.tokens} tokens > --check-full-max-tokens"
    results.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows = ranks.gather(errs)
    out["errors"] = {}
    for key, val in rows[0].items():
        if isinstance(val, dict):
            out["errors"][key] = {n: max(r[key][n] for r in rows) for n in val}
            out["errors"][key + "_per_rank"] = [r[key] for r in rows]
        else:
            out["errors"][key] = val
    for key, val in out["errors"].items():
        if not key.endswith("_per_rank") and isinstance(val, dict):
            ranks.say(f"{variant}: max relative error {key}: " + ", ".join(f"{n} {e:.1e}" for n, e in val.items()))

    # 3. Timing, interleaved round by round, each direction with grad enabled only for forward + backward.
    times = {}
    for d, idx in (("fwd", 0), ("fwd+bwd", 1)):
        ranks.say(f"{variant}: timing {d}: {', '.join(fns)} ({args.warmup} warm-up + {args.repeat} rounds)")
        with torch.set_grad_enabled(d == "fwd+bwd"):
            got = time_interleaved({f"{n}_{d}": f[idx] for n, f in fns.items()}, ranks, args.repeat, args.warmup)
        times.update(got)
    rows = ranks.gather(times)
    out["per_rank_ms"] = [{n: t * 1e3 for n, t in r.items()} for r in rows]
    out["ms"] = {n: max(r[n] for r in rows) * 1e3 for n in times if not n.endswith("_host")}
    out["host_ms"] = {n[:-5]: max(r[n] for r in rows) * 1e3 for n in times if n.endswith("_host")}
    ms = out["ms"]
    out["efficiency"], out["fla_over_deltacp"] = {}, {}
    out["fla_over_deltacp_oneshot"] = {}
    for d in ("fwd", "fwd+bwd"):
        for side, cp_name, one_name in (("deltacp", "deltacp_cp", "deltacp_one_gpu"),
                                        ("deltacp_oneshot", "deltacp_cp_oneshot", "deltacp_one_gpu"),
                                        ("fla", "fla_cp", "fla_one_gpu")):
            cp_t, one_t = ms.get(f"{cp_name}_{d}"), ms.get(f"{one_name}_{d}")
            if cp_t and one_t:
                out["efficiency"][f"{side}_{d}"] = one_t / cp_t
        for key, name in (("fla_over_deltacp", "deltacp_cp"), ("fla_over_deltacp_oneshot", "deltacp_cp_oneshot")):
            if ms.get(f"fla_cp_{d}") and ms.get(f"{name}_{d}"):
                out[key][d] = ms[f"fla_cp_{d}"] / ms[f"{name}_{d}"]

    # 4. Peak memory of one step of each (max over ranks).
    if device.type == "cuda":
        ranks.say(f"{variant}: peak memory of one step each")
        mem = {}
        for d, idx in (("fwd", 0), ("fwd+bwd", 1)):
            with torch.set_grad_enabled(d == "fwd+bwd"):
                for n, f in fns.items():
                    mem[f"{n}_{d}"] = step_memory(f[idx], ranks, deltacp)
        rows = ranks.gather(mem)
        out["peak_MiB"] = {n: {"torch": max(r[n][0] for r in rows) / 2**20,
                               "outside_torch": max(r[n][1] for r in rows) / 2**20,
                               "total": max(r[n][0] + r[n][1] for r in rows) / 2**20} for n in mem}

    # 5. The exchange of deltacp's CP forward, part by part.
    routes = [("exchange", "1")]
    if "deltacp_cp_oneshot" in fns:
        routes.append(("exchange_oneshot", "0"))
    for key, staged in routes:
        ranks.say(f"{variant}: the exchange, part by part (deltacp.cp internals; {STAGED_FUSED}={staged})")
        parts = with_env((lambda: exchange_parts(variant, x, ctx, device, dtype, args, ranks),), STAGED_FUSED,
                         staged)[0]()
        if "error" in parts:
            out[key] = {"error": parts["error"]}
            ranks.say(f"{variant}: exchange parts not measured: {parts['error']}")
        else:
            out[key] = exchange_summary(ranks.gather(parts))
    return out


# ---- report -------------------------------------------------------------------------------------------------
def versions(fla=None) -> dict:
    """torch, Python, Triton, FLA (when `fla` loaded it), deltacp and the checkout's commit."""
    v = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        v["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - CPU machines often have no triton
        pass
    if fla is not None and fla.version:
        v["fla"] = fla.version
    try:
        import deltacp

        v["deltacp"] = getattr(deltacp, "__version__", "?")
    except Exception:  # noqa: BLE001
        pass
    try:  # the checkout's commit (+dirty with uncommitted changes to tracked files), when it is a git checkout
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10)
            v["deltacp_commit"] = head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001 - no git, or no checkout
        pass
    return v


def fmt_ms(x):
    return f"{x:9.3f}" if x else f"{'-':>9}"


def report(res: dict):
    c = res["config"]
    print(f"\nCP training step, {res['world']} ranks ({res['gpu']}), one sequence over every rank: {c['tokens']} "
          f"tokens per rank, H={c['heads']}, K=V={c['head_dim']}, {c['dtype']} (gates float32); median of "
          f"{c['repeat']} after {c['warmup']} warm-up rounds, ms of the slowest rank", flush=True)
    if res["fla"]["reason"]:
        print(f"  FLA skipped: {res['fla']['reason']}")
    head = (f"  {'variant':7} {'dir':15} {'deltacp CP':>10} {'FLA CP':>9} {'FLA/ours':>8} {'ours 1GPU':>9} "
            f"{'FLA 1GPU':>9} {'eff ours':>8} {'eff FLA':>8}")
    print(head)
    for variant, r in res["variants"].items():
        ms, eff = r.get("ms", {}), r.get("efficiency", {})
        for route, cp_name, side, ratios in (("", "deltacp_cp", "deltacp", "fla_over_deltacp"),
                                             (" one-shot", "deltacp_cp_oneshot", "deltacp_oneshot",
                                              "fla_over_deltacp_oneshot")):
            for d in ("fwd", "fwd+bwd"):
                if f"{cp_name}_{d}" not in ms:
                    continue
                ratio = r.get(ratios, {}).get(d)
                ratio = f"{ratio:.2f}x" if ratio else "-"
                effs = [f"{eff[key]:.1%}" if key in eff else "-" for key in (f"{side}_{d}", f"fla_{d}")]
                cells = [fmt_ms(ms.get(f"{n}_{d}")) for n in (cp_name, "fla_cp", "deltacp_one_gpu", "fla_one_gpu")]
                print(f"  {variant:7} {(d + route):15} {cells[0]:>10} {cells[1]} {ratio:>8} {cells[2]} {cells[3]} "
                      f"{effs[0]:>8} {effs[1]:>8}")
    for variant, r in res["variants"].items():
        print(f"  {variant}:")
        for name, text in r.get("failed", {}).items():
            print(f"    FAILED {name}: {text}")
        eff = r.get("efficiency", {})
        for side, label in (("deltacp", "deltacp"), ("deltacp_oneshot", "deltacp, fused forward one-shot")):
            marks = []
            for d in ("fwd", "fwd+bwd"):
                if f"{side}_{d}" in eff:
                    goal = TARGETS[f"efficiency_{d}"]
                    e = eff[f"{side}_{d}"]
                    marks.append(f"{d} {e:.1%} (target >= {goal:.0%}: {'met' if e >= goal else 'MISSED'})")
            if marks:
                print(f"    per-rank efficiency, {label}: " + "; ".join(marks))
        for key, label in (("exchange", "exchange"), ("exchange_oneshot", "exchange, fused forward one-shot")):
            ex = r.get(key, {})
            if "exchange_ms" in ex:
                f = ex["exchange_fraction_of_local_fwd"]
                goal = TARGETS["exchange_fraction"]
                print(f"    {label}, rank 0: pre-pass ({ex['prepass_what']}) {ex['prepass_ms']:.3f} ms + all-gather "
                      f"and merge {ex['allgather_merge_ms']:.3f} ms = {ex['exchange_ms']:.3f} ms = "
                      + (f"{f:.1%} of the local forward ({ex['local_forward_ms']:.3f} ms; target <= {goal:.0%}: "
                         f"{'met' if f <= goal else 'MISSED'})" if f is not None else "- (no local forward time)"))
            elif "error" in ex:
                print(f"    {label} not measured: {ex['error']}")
        for key, val in r.get("errors", {}).items():
            if key.endswith("_per_rank"):
                continue
            text = ", ".join(f"{n} {e:.1e}" for n, e in val.items()) if isinstance(val, dict) else val
            print(f"    max relative error {key}: {text}")
        for d in ("fwd", "fwd+bwd"):
            pk = r.get("peak_MiB", {})
            cells = [f"{n} {pk[f'{n}_{d}']['total']:.0f}" for n in IMPLS if f"{n}_{d}" in pk]
            if cells:
                print(f"    peak MiB of one {d} step (torch + outside torch): " + ", ".join(cells))
    if res["fla"].get("hopper_triton_guard_bypassed"):
        print("  note: FLA's Hopper guard for its GDN backward (triton < 3.7.1) was switched off for timing; its GDN "
              "gradients may be off where it applies (see the errors against the whole-sequence run)")


def main():
    args = parse()
    device = bench_cp.start_process_group(args.device, args.pg_timeout)
    ranks = Ranks(device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = False
    if ranks.world < 2:
        ranks.say("one rank only: the CP steps run, but nothing is exchanged (use 2+ ranks)")

    import deltacp
    import deltacp.cp as cp

    fla = Fla(device, args.no_fla)
    ranks.say(f"{ranks.world} ranks on {device.type}; FLA: " + (f"{fla.version}" if fla.ops else fla.reason))
    T_global = args.tokens * ranks.world
    # One sequence over every rank: global cu_seqlens [0, T x world], the same on both sides.
    ctx = cp.build_context(torch.tensor([0, T_global]), device=device, timeout=args.cp_timeout)
    fla_ctx = None
    if fla.ops:
        # FLA's builder takes the global offsets on the tensors' device and the process group it all-gathers on.
        fla_ctx = fla.build_cp_context(torch.tensor([0, T_global], dtype=torch.long, device=device),
                                       group=dist.group.WORLD)

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    config = {k: v for k, v in vars(args).items() if k != "json"}  # (where this machine wrote it: not a setting)
    res = dict(kind="cp_step", gpu=gpu, date=datetime.date.today().isoformat(), world=ranks.world,
               device=device.type, versions=versions(fla), config=config,
               fla=dict(available=fla.ops is not None, reason=fla.reason,
                        hopper_triton_guard_bypassed=fla.guard_bypassed),
               layout="one sequence over every rank: global cu_seqlens [0, tokens x world]", variants={})
    out_path = args.json or os.path.join(os.environ.get("OUT", "."), "bench_cp_step.json")

    def save():
        if ranks.rank == 0:
            with open(out_path, "w") as f:
                json.dump(res, f, indent=1)

    for variant in args.variants:
        ranks.say(f"== {variant}")
        res["variants"][variant] = run_variant(variant, args, ranks, device, dtype, ctx, fla, fla_ctx, deltacp, cp)
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if ranks.rank == 0:
        report(res)
        save()
        hint = ""
        if device.type == "cuda":  # where the docs read it (bench/gpu/make_docs.py names files by GPU and world)
            try:
                make_docs = _load("make_docs", REPO / "bench" / "gpu" / "make_docs.py")
                hint = (f" (for the docs: docs/results/cpstep-{make_docs.gpu_short(gpu).lower()}x{ranks.world}.json, "
                        "then python3 bench/gpu/make_docs.py)")
            except Exception:  # noqa: BLE001 - the name is a hint only
                pass
        print(f"  JSON: {out_path}{hint}", flush=True)
    ranks.barrier()
    dist.destroy_process_group()
    ok = all("failed" not in r or "deltacp_cp" not in r["failed"] for r in res["variants"].values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
