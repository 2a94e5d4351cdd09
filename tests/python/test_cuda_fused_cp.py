"""Context parallelism with the fused tier as each rank's local forward (gdn and kda, bf16, K = V = 128 on a
compute capability 9.0 GPU, the default tier choice: fused forward, tiled backward).

By default (DELTACP_CP_STAGED_FUSED=1) the local fused forward runs in stages (deltacp/cuda/api.h
forward_prepare(p, Method::fused)): its token-parallel stage and its pieces' maps before the exchange, the
last segment's pre-pass from those maps (composed), the chain after it. The state-only runs (the first
segment's transitions that the backward pre-pass reads, a head piece without output) cannot run on the fused
tier, which always computes the output: they take the tiled tier (deltacp.cp.local._state_only_method). In
float32 the fused tier refuses the problem and each rank's local forward takes the tiled tier, saying why
(deltacp.cp.autograd._settle_forward_tier).

Checked here: 2 and 3 ranks sharing GPU 0 over gloo (worker processes, launched as tests/python/
test_cp_gloo.py launches them), deltacp.chunk_gated_delta_rule / chunk_kda with cp_context and FLA's benchmark
keywords (the in-kernel l2 norm; kda's safe gate) against the same call in one process, with the fused local
forward one-shot and in stages: o, every gradient, the summed final states and initial-state gradients, and o and
the final states of the same calls without a gradient (q and k then normalised inside the fused kernels), within
the CP tolerances of distributed/tests/gpu_cp_check.py (bf16: gdn 3e-3, kda 8e-3; float32 1e-5); a sequence
over every rank (with gradients every rank after the first needs its first segment's transitions), cuts inside
chunks, many short sequences; deltacp.cp.last_stats["local_tier"] names each rank's tiers. Skipped without a
CUDA device of compute capability 9.0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from deltacp_testutil import (cp_against_one_process, gloo_case_worker, launch_workers,  # noqa: E402
                              require_fused_gpu)

THIS = Path(__file__).resolve()
TOL = {"gdn": 3e-3, "kda": 8e-3}
KWARGS = {"gdn": dict(use_qk_l2norm_in_kernel=True),
          "kda": dict(use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)}


def _cases(world):
    T = 700 * world + 24  # rank cuts inside chunks; the head piece re-aligns each rank's chunk grid
    span = [37, T - 48, 11]  # the middle sequence spans every rank (its middle ranks read M at world 3)
    many = [7, 1, 64, 65, 3, 128, 17] * 3
    many.append(T - sum(many))
    cases = [dict(name=f"{variant}-{layout}", variant=variant, seqlens=seqlens, states=states, dtype="bfloat16")
             for variant in ("gdn", "kda")
             for layout, seqlens, states in (("span", span, True), ("span-nostates", span, False),
                                             ("many", many, True))]
    # float32: the fused tier refuses the problem, so every rank's local forward takes the tiled tier
    return cases + [dict(name=f"{variant}-span-fp32", variant=variant, seqlens=span, states=True, dtype="float32")
                    for variant in ("gdn", "kda")]


def _inputs(variant, T, H, D, device, dtype):
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(11)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = {"q": rnd(1, T, H, D), "k": rnd(1, T, H, D), "v": rnd(1, T, H, D)}  # q, k raw: the call l2-normalises
    x = {n: t.to(device=device, dtype=dtype) for n, t in x.items()}
    g = F.logsigmoid(rnd(1, T, H, D)) / 8 if variant == "kda" else F.logsigmoid(rnd(1, T, H) + 2.0)
    x["g"] = g.to(device)  # fp32 gates, as FLA's benchmark passes them
    x["beta"] = torch.rand(1, T, H, generator=gen).sigmoid().to(device=device, dtype=dtype)
    return x


def _compare(case, rank, world):
    import deltacp
    import deltacp.cp as cp

    device = torch.device("cuda", 0)
    variant = case["variant"]
    cu = [0]
    for s in case["seqlens"]:
        cu.append(cu[-1] + s)
    T, N, H, D = cu[-1], len(case["seqlens"]), 2, 128
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[case["dtype"]]
    x = _inputs(variant, T, H, D, device, dtype)
    gen = torch.Generator().manual_seed(12)
    h0 = (torch.randn(N, H, D, D, generator=gen) * 0.5).to(device) if case["states"] else None
    dht = (torch.randn(N, H, D, D, generator=gen) * 0.5).to(device) if case["states"] else None
    do = torch.randn(1, T, H, D, generator=gen).to(device=device, dtype=dtype)
    ctx = cp.build_context(torch.tensor(cu), device=device, timeout=120, use_nccl=False)
    op = deltacp.chunk_kda if variant == "kda" else deltacp.chunk_gated_delta_rule

    def run(inputs, h, **kw):
        return op(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], initial_state=h,
                  output_final_state=case["states"], **KWARGS[variant], **kw)

    err, tier, _ = cp_against_one_process(run, x, h0, do, dht, cu, ctx, device)
    err.update(_inference_errors(run, x, h0, cu, ctx, device))
    return dict(err=err, tier=tier, plan=ctx.describe(), qk_l2norm=cp.last_stats.get("qk_l2norm"))


def _inference_errors(run, x, h0, cu, ctx, device):
    """The same op without a gradient, CP against one process: there both normalise q and k inside the fused
    kernels (Params::qk_l2norm; deltacp.cp.ops._l2norm_in_kernel), where the calls with a gradient normalise them
    in a pass of their own. Errors of o and of the final states summed over the ranks."""
    import torch.distributed as dist

    import deltacp.cp as cp
    from deltacp_testutil import rel_err

    with torch.no_grad():
        o, ht = run({n: cp.split_even(t, ctx) for n, t in x.items()}, h0, cp_context=ctx)
        o_ref, ht_ref = run(x, h0, cu_seqlens=torch.tensor(cu, device=device), cu_seqlens_cpu=torch.tensor(cu))
    rel = lambda a, ref: rel_err(a.double().cpu().numpy(), ref.double().cpu().numpy())  # noqa: E731
    err = {"o_no_grad": rel(o, cp.split_even(o_ref, ctx))}
    if ht is not None:
        ht_sum = ht.cpu()
        dist.all_reduce(ht_sum)
        err["ht_no_grad"] = rel(ht_sum, ht_ref)
    return err


def worker_main(argv):
    """python test_cuda_fused_cp.py worker <out dir>; rank and world from the environment."""
    gloo_case_worker(argv, _cases, _compare)


@pytest.mark.parametrize("staged", ["0", "1"], ids=["one-shot", "staged"])
@pytest.mark.parametrize("world", [2, 3])
def test_cuda_cp_with_the_fused_local_forward_equals_one_process(world, staged, monkeypatch):
    require_fused_gpu()
    monkeypatch.setenv("DELTACP_CP_STAGED_FUSED", staged)  # the workers inherit it
    run = launch_workers(THIS, world, timeout=600)
    assert len(run.reports) == world, "a worker did not report; logs:\n" + "\n".join(run.logs)
    for case in _cases(world):
        name = case["name"]
        tol = TOL[case["variant"]] if case["dtype"] == "bfloat16" else 1e-5
        for rank in range(world):
            r = run.reports[rank][name]
            assert "exception" not in r, f"{name} rank {rank}: {r.get('exception')}"
            print(f"[errors] CP fused local {name} world {world} rank {rank}: "
                  + " ".join(f"{n} {e:.2e}" for n, e in r["err"].items()))
            for n, e in r["err"].items():
                assert e <= tol, f"{name} rank {rank}: {n} {e:.2e} > {tol} ({r['plan']})"
            want = "fused" if case["dtype"] == "bfloat16" else "tiled"
            assert r["tier"]["forward"] == want and r["tier"]["backward"] == "tiled", (name, rank, r["tier"])
            # without a gradient the fused local forward normalises q and k in its kernels, the tiled one in a pass
            assert r["qk_l2norm"] == ("in kernel" if want == "fused" else "one pass"), (name, rank, r["qk_l2norm"])
            if want == "tiled":  # the fused tier implements the variant but refused the problem, and says why
                assert "fused tier does not apply" in r["tier"]["why"], r["tier"]


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker_main(sys.argv[2:])
