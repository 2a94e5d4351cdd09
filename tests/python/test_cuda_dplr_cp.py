"""DPLR context parallelism on the tiled tier (backend="tiled"): the pieces CP runs on a GPU, and the CP op itself.

1. The pre-pass's state maps as deltacp.cp.local computes them on the tiled DPLR tier (the widened final-state-only
   forward and dh0-only backward, in pieces of whole chunks side by side, composed in fp32), against
   deltacp.reference.span_affine / span_affine_backward in float64 on the same rounded inputs: the composed
   [M start + H | M] and [M^T dend + dH | M^T], each piece's M_p (_transitions) and dH_p (_dh0_pieces).
   float32 1e-4, bfloat16 2e-2 (the maps ride the state's 16-bit tensor-core operands; distributed/tests/
   gpu_cp_check.py holds the tiled pre-pass to the same).
2. The local pass: the tiled forward from an initial state (o, ht) and its backward with dL/dht (every gradient,
   dh0) against the naive tier's, within twice the dplr tolerance of tests/python/test_dplr_cuda.py.
3. Each rank's tier (deltacp.cp.local._dplr_tiers): the tiled tier where it takes the inputs, else the naive tier,
   with the reason (gates outside the chunk form's range; K = 160, which the tier refuses before launching).
4. The CP op: 2 and 3 ranks sharing GPU 0 over gloo (worker processes, launched as tests/python/test_cp_gloo.py
   launches them), deltacp.chunk_dplr_delta_rule(cp_context=..., backend="tiled") against the same call in one
   process on o, every gradient, the summed final states and initial-state gradients: float32 1e-5, bfloat16 8e-3
   (the dplr CP tolerances, docs/design.md section 7); a sequence over every rank (its middle rank reads a
   transition M at 3 ranks), cuts inside chunks, many short sequences; deltacp.cp.last_stats["local_tier"] and
   deltacp.last_cuda_tier() name the tiled tier; a rank whose gates leave the range runs the naive tier, says
   why, and the result still matches one process.
Skipped without a CUDA device.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from deltacp_testutil import cp_against_one_process, gloo_case_worker, launch_workers  # noqa: E402

THIS = Path(__file__).resolve()

TOL_MAP = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
TOL_CP = {"float32": 1e-5, "bfloat16": 8e-3}


def _rel(x, ref) -> float:
    x = torch.as_tensor(x).detach().double().cpu()
    ref = torch.as_tensor(ref).detach().double().cpu()
    assert x.shape == ref.shape, (x.shape, ref.shape)
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def _inputs(T, H, K, V, dtype, seed, device="cuda", gk_fp32=False):
    """DPLR inputs [1, T, H, .] as gpu_cp_check.py draws them (unit keys; slow gates logsigmoid(x + 3) / 2, so the
    maps stay far from zero across ranks; a = -kk / 2, b = kk sigmoid(.) / 2), rounded to dtype."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = {"q": rnd(1, T, H, K), "k": F.normalize(rnd(1, T, H, K), dim=-1), "v": rnd(1, T, H, V),
         "g": F.logsigmoid(rnd(1, T, H, K) + 3.0) * 0.5}
    kk = F.normalize(rnd(1, T, H, K), dim=-1)
    x["a"], x["b"] = -kk * 0.5, kk * 0.5 * torch.sigmoid(rnd(1, T, H, 1))
    x = {n: t.to(device=device, dtype=dtype) for n, t in x.items()}
    if gk_fp32:
        x["g"] = x["g"].to(torch.float32)
    return x


def _require_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import deltacp

    if not deltacp.built_with_cuda():
        pytest.skip("deltacp built without the CUDA tiers")


def _cfg(H, K, V, dtype, chunk=64, method="tiled"):
    """The fields of deltacp.cp.local._Cfg the pre-pass and the local pass read."""
    from deltacp.cp import local as cp_local

    cfg = cp_local._Cfg()
    cfg.variant, cfg.gate_name, cfg.scale, cfg.chunk_size = "dplr", "gk", None, chunk
    cfg.compute, cfg.state_dtype = "float32", torch.float32
    cfg.device = torch.device("cuda", torch.cuda.current_device())
    cfg.fwd_method = cfg.bwd_method = method
    cfg.H = cfg.HV = H
    cfg.K, cfg.V = K, V
    cfg.output_final_state, cfg.tier_why = False, ""
    return cfg


def _head(x, h, t0, t1):
    """Head h, tokens [t0, t1) as float64 numpy (the reference's slice)."""
    return {n: t[0, t0:t1, h].double().cpu().numpy() for n, t in x.items()}


# ---- 1. the pre-pass's maps ----------------------------------------------------------------------------------
# (T, K, V, piece bounds of the span: the pre-pass's pieces, a head piece off the chunk grid first where given)
MAP_SHAPES = {
    "one_piece_T130": (130, 64, 64, None),
    "pieces_T300": (300, 64, 64, [0, 20, 84, 212, 300]),
    "K128_V32_pieces": (200, 128, 32, [0, 64, 128, 200]),
    "K32_V48_head_piece": (150, 32, 48, [0, 7, 71, 135, 150]),
}


@pytest.mark.parametrize("shape", list(MAP_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_dplr_cp_prepass_maps_against_reference(shape, dtype):
    _require_cuda()
    import deltacp.reference as ref
    from deltacp.cp import local as cp_local

    T, K, V, bounds = MAP_SHAPES[shape]
    H = 2
    seed = zlib.crc32(f"maps/{shape}/{dtype}".encode())
    x = _inputs(T, H, K, V, dtype, seed, gk_fp32=dtype != torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    start = (torch.randn(H, K, V, generator=gen) * 0.5).cuda()
    dend = (torch.randn(H, K, V, generator=gen) * 0.5).cuda()
    do = torch.randn(1, T, H, V, generator=gen).to(device="cuda", dtype=dtype)
    cfg = _cfg(H, K, V, dtype)
    args = (x["q"], x["k"], x["v"], x["g"], None, x["a"], x["b"])

    fwd = cp_local._augmented_forward(cfg, *args, start, bounds=bounds)  # [H, K, V + K] = [M start + H | M]
    bwd = cp_local._augmented_backward(cfg, *args, do, dend, bounds=bounds)  # [M^T dend + dH | M^T]
    P = 1 if bounds is None else len(bounds) - 1
    cuts = [0, T] if bounds is None else bounds
    M_p = cp_local._transitions(cfg, *args, bounds) if bounds is not None else None  # [P, H, K, K]
    dH_p = cp_local._dh0_pieces(cfg, *args, do, dend, bounds) if bounds is not None else None  # [P, H, K, V]
    torch.cuda.synchronize()

    exp_f, exp_b, exp_M, exp_dH = [], [], [], []
    for h in range(H):
        s = _head(x, h, 0, T)
        M, Hh = ref.span_affine("dplr", s["q"], s["k"], s["v"], a=s["a"], b=s["b"], gk=s["g"], chunk_size=64)
        st = start[h].double().cpu().numpy()
        exp_f.append(np.concatenate([M @ st + Hh, M], axis=1))
        Mt, dH = ref.span_affine_backward("dplr", s["q"], s["k"], s["v"], a=s["a"], b=s["b"], gk=s["g"],
                                          do=do[0, :, h].double().cpu().numpy(), chunk_size=64)
        de = dend[h].double().cpu().numpy()
        exp_b.append(np.concatenate([Mt @ de + dH, Mt], axis=1))
        for p in range(P):
            t0, t1 = cuts[p], cuts[p + 1]
            sp = _head(x, h, t0, t1)
            Mp, _ = ref.span_affine("dplr", sp["q"], sp["k"], sp["v"], a=sp["a"], b=sp["b"], gk=sp["g"],
                                    chunk_size=64)
            Mtp, dHp = ref.span_affine_backward("dplr", sp["q"], sp["k"], sp["v"], a=sp["a"], b=sp["b"],
                                                gk=sp["g"], do=do[0, t0:t1, h].double().cpu().numpy(), chunk_size=64)
            exp_M.append(Mp)
            exp_dH.append(dHp + (Mtp @ de if p == P - 1 else 0.0))
    tol = TOL_MAP[dtype]
    exp_f, exp_b = np.stack(exp_f), np.stack(exp_b)
    errs = {"fwd_H": _rel(fwd[..., :V], exp_f[..., :V]), "fwd_M": _rel(fwd[..., V:], exp_f[..., V:]),
            "bwd_dH": _rel(bwd[..., :V], exp_b[..., :V]), "bwd_Mt": _rel(bwd[..., V:], exp_b[..., V:])}
    if bounds is not None:
        errs["pieces_M"] = _rel(M_p.transpose(0, 1).reshape(-1, K, K), np.stack(exp_M))
        errs["pieces_dH"] = _rel(dH_p.transpose(0, 1).reshape(-1, K, V), np.stack(exp_dH))
    print(f"[errors] tiled dplr pre-pass maps {shape} {dtype}: " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < tol, f"{n}: {e:.2e} >= {tol}"


# ---- 2. the local pass from an initial state ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_dplr_cp_local_pass_from_initial_state_against_naive(dtype):
    """A rank's local pass: several local segments, the first from a merged state, the others from the user's
    rows; forward (o, ht) and backward (with dL/dht: every gradient and dh0) on the tiled and the naive tier."""
    _require_cuda()
    import deltacp

    H, K, V = 2, 64, 64
    cu = [0, 37, 101, 102, 230]
    x = _inputs(cu[-1], H, K, V, dtype, seed=zlib.crc32(f"local/{dtype}".encode()), gk_fp32=dtype != torch.float32)
    gen = torch.Generator().manual_seed(5)
    h0 = (torch.randn(len(cu) - 1, H, K, V, generator=gen) * 0.5).cuda()
    do = torch.randn(1, cu[-1], H, V, generator=gen).to(device="cuda", dtype=dtype)
    dht = (torch.randn(len(cu) - 1, H, K, V, generator=gen) * 0.5).cuda()
    cu_t = torch.tensor(cu)
    out = {}
    for backend in ("tiled", "naive"):
        leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        h = h0.clone().requires_grad_(True)
        o, ht = deltacp.chunk_dplr_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["a"], leaves["b"],
                                              leaves["g"], initial_state=h, output_final_state=True,
                                              cu_seqlens=cu_t.cuda(), cu_seqlens_cpu=cu_t, backend=backend)
        ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
        torch.cuda.synchronize()
        assert deltacp.last_cuda_tier()[0] == backend
        out[backend] = dict(o=o.detach(), ht=ht.detach(), dh0=h.grad, **{"d" + n: leaves[n].grad for n in leaves})
    errs = {n: _rel(out["tiled"][n], out["naive"][n]) for n in out["tiled"]}
    print(f"[errors] tiled vs naive dplr local pass {dtype}: " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    for n, e in errs.items():
        assert e < tol, f"{n}: {e:.2e} >= {tol}"


# ---- 3. each rank's tier --------------------------------------------------------------------------------------
def test_cuda_dplr_cp_rank_tier_choice():
    _require_cuda()
    from deltacp.cp import local as cp_local

    def choose(K, dtype, gates_scale=1.0, gate_check=True):
        x = _inputs(70, 2, K, 32, dtype, seed=K)
        x["g"] = x["g"] * gates_scale
        cfg = _cfg(2, K, 32, dtype)
        cp_local._dplr_tiers(cfg, x["q"], x["k"], x["v"], x["g"], x["a"], x["b"], gate_check)
        return cfg.fwd_method, cfg.bwd_method, cfg.tier_why

    fwd, bwd, why = choose(64, torch.bfloat16)
    assert (fwd, bwd) == ("tiled", "tiled"), why
    fwd, bwd, why = choose(64, torch.bfloat16, gates_scale=1e4)  # gk far below -1024 / 64
    assert (fwd, bwd) == ("naive", "naive") and "gk outside" in why, why
    fwd, _, why = choose(64, torch.bfloat16, gates_scale=1e4, gate_check=False)  # the caller vouches for them
    assert fwd == "tiled", why
    fwd, bwd, why = choose(160, torch.bfloat16)  # the tier refuses K > 128 before launching anything
    assert (fwd, bwd) == ("naive", "naive") and "'K'" in why, why
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    fwd, _, why = choose(128, torch.float32)  # the WY stage needs 224,016 bytes for fp32 K = 128
    assert fwd == ("tiled" if limit >= 224016 else "naive"), why


# ---- 4. the CP op: ranks sharing GPU 0 over gloo ------------------------------------------------------------
def _cases(world):
    T = 700 * world + 24  # rank cuts inside chunks; the head piece re-aligns each rank's chunk grid
    span = [37, T - 48, 11]  # the middle sequence spans every rank (its middle ranks read M at world 3)
    many = [7, 1, 64, 65, 3, 128, 17] * 3
    many.append(T - sum(many))
    return [dict(name="fp32-span", dtype="float32", seqlens=span, states=True),
            dict(name="bf16-span", dtype="bfloat16", seqlens=span, states=True),
            dict(name="bf16-many-nostates", dtype="bfloat16", seqlens=many, states=False),
            # rank 1's gates leave the chunk form's range: it runs the naive tier, the others the tiled one
            dict(name="fp32-span-rank1-naive", dtype="float32", seqlens=span, states=True, bad_gate_rank=1)]


def _compare(case, rank, world):
    import deltacp
    import deltacp.cp as cp

    device = torch.device("cuda", 0)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[case["dtype"]]
    cu = [0]
    for s in case["seqlens"]:
        cu.append(cu[-1] + s)
    T, N, H, K, V = cu[-1], len(case["seqlens"]), 2, 64, 64
    x = _inputs(T, H, K, V, dtype, seed=7, device=device, gk_fp32=dtype != torch.float32)
    gen = torch.Generator().manual_seed(8)
    h0 = (torch.randn(N, H, K, V, generator=gen) * 0.5).to(device) if case["states"] else None
    dht = (torch.randn(N, H, K, V, generator=gen) * 0.5).to(device) if case["states"] else None
    do = torch.randn(1, T, H, V, generator=gen).to(device=device, dtype=dtype)
    ctx = cp.build_context(torch.tensor(cu), device=device, timeout=120, use_nccl=False)
    if "bad_gate_rank" in case:
        x["g"][0, (case["bad_gate_rank"] * T) // world + 3, 0, 0] = -100.0  # below -1024 / 64

    def run(inputs, h, **kw):
        return deltacp.chunk_dplr_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["a"], inputs["b"],
                                             inputs["g"], initial_state=h, output_final_state=case["states"],
                                             backend="tiled", **kw)

    err, tier, last = cp_against_one_process(run, x, h0, do, dht, cu, ctx, device)
    return dict(err=err, tier=tier, last_cuda_tier=last, plan=ctx.describe())


def worker_main(argv):
    """python test_cuda_dplr_cp.py worker <out dir>; rank and world from the environment."""
    gloo_case_worker(argv, _cases, _compare)


def _launch(world, timeout=600):
    run = launch_workers(THIS, world, timeout=timeout)
    assert len(run.reports) == world, "a worker did not report; logs:\n" + "\n".join(run.logs)
    return run.reports


@pytest.mark.parametrize("world", [2, 3])
def test_cuda_dplr_cp_tiled_equals_one_process(world):
    _require_cuda()
    reports = _launch(world)
    for case in _cases(world):
        name, tol = case["name"], TOL_CP[case["dtype"]]
        for rank in range(world):
            r = reports[rank][name]
            assert "exception" not in r, f"{name} rank {rank}: {r.get('exception')}"
            print(f"[errors] dplr CP tiled {name} world {world} rank {rank} ({r['tier']['forward']}): "
                  + " ".join(f"{n} {e:.2e}" for n, e in r["err"].items()))
            for n, e in r["err"].items():
                assert e <= tol, f"{name} rank {rank}: {n} {e:.2e} > {tol} ({r['plan']})"
            naive_here = case.get("bad_gate_rank") == rank
            want = "naive" if naive_here else "tiled"
            assert r["tier"]["forward"] == want and r["tier"]["backward"] == want, (name, rank, r["tier"])
            assert r["last_cuda_tier"] == want, (name, rank, r["last_cuda_tier"])
            if naive_here:
                assert "gk outside" in r["tier"]["why"], r["tier"]


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker_main(sys.argv[2:])
