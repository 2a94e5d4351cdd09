"""The torch ops on CUDA tensors through the CUDA tiers (backend="naive" / "tiled" / "fused"), autograd
included, against the float64 reference evaluated on the same (rounded) inputs. Tolerances from
docs/design.md section 7: fp32 inputs 1e-5 relative, bf16 1e-2. Skipped without a CUDA device; a tier
(variant, direction) that this build does not implement is skipped with the reason."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
import deltacp.reference as ref  # noqa: E402
from deltacp_testutil import VARIANTS, call_torch_op as _call, input_names, make_problem, ref_backward, ref_forward, rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

TIERS = ("naive", "tiled", "fused")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# (B, T, H, HV, K, V, cu_seqlens): K != V, K in {32, 64, 128}, grouped values, varlen with T = 1
# sequences and lengths around the chunk size.
SHAPES = {
    "fixed": (2, 100, 2, 4, 32, 64, None),
    "varlen": (1, None, 2, 2, 64, 32, [0, 1, 17, 81, 145, 146]),
    "k128": (1, 65, 1, 1, 128, 128, None),
}


def _require_cuda_build():
    if not deltacp.built_with_cuda():
        if os.environ.get("DELTACP_ALLOW_NO_CUDA_BUILD") == "1":
            pytest.skip("deltacp built without CUDA (DELTACP_ALLOW_NO_CUDA_BUILD=1)")
        pytest.fail("a CUDA device is present but deltacp was built without the CUDA tiers (nvcc not found?)")




def _poison_cache(nbytes):
    """Fill freed allocator blocks with NaN so an output element the kernel never writes shows up."""
    junk = torch.full((nbytes // 4 + 1,), float("nan"), dtype=torch.float32, device="cuda")
    del junk


def _problem(variant, shape_name, seed):
    B, T, H, HV, K, V, cu = SHAPES[shape_name]
    return make_problem(variant, B=B, T=T or 0, H=H, HV=HV, K=K, V=V, cu_seqlens=cu, seed=seed)


def test_cuda_build_present():
    _require_cuda_build()
    assert deltacp.cuda_available()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tier_against_reference(variant, tier, shape_name, dtype):
    _check_tier(variant, tier, shape_name, dtype, gate_dtype=dtype)


@pytest.mark.parametrize("variant", ["gdn", "kda", "dplr"])
@pytest.mark.parametrize("tier", TIERS)
def test_tier_gate_in_fp32(variant, tier):
    """bf16 q, k, v beside a float32 log decay (FLA's usual setup): dg comes back in float32."""
    _check_tier(variant, tier, "varlen", torch.bfloat16, gate_dtype=torch.float32)


def _check_tier(variant, tier, shape_name, dtype, gate_dtype):
    _require_cuda_build()
    if not deltacp._core.cuda_supports(variant, tier, False):
        pytest.skip(f"tier {tier} does not implement {variant} forward in this build")
    with_backward = deltacp._core.cuda_supports(variant, tier, True)
    p = _problem(variant, shape_name, seed=40)
    K, V = p["q"].shape[-1], p["v"].shape[-1]
    if tier == "fused":
        # The fused kernels take bf16 / fp16, K = 128 with V = 128 or 256, and K = V = 64 on compute capability
        # 9.0; elsewhere asking for them by name is an error that says why (tests/python/test_cuda_fused.py covers
        # the tier itself).
        with_backward = True  # its gradients run on the tiled backward
        fits = (K, V) in ((128, 128), (128, 256), (64, 64))
        if not (fits and dtype != torch.float32 and torch.cuda.get_device_capability() == (9, 0)):
            t = {name: torch.tensor(p[name], dtype=dtype, device="cuda") for name in input_names(variant)}
            with pytest.raises(ValueError, match="fused tier cannot run"):
                _call(variant, t, backend=tier)
            return
    names = input_names(variant)
    t = {name: torch.tensor(p[name], dtype=gate_dtype if name == "g" else dtype, device="cuda",
                            requires_grad=with_backward) for name in names}
    h0 = torch.tensor(p["initial_state"], dtype=torch.float32, device="cuda", requires_grad=with_backward)
    cu = None if p["cu_seqlens"] is None else torch.tensor(p["cu_seqlens"], device="cuda")
    # the reference sees exactly the rounded inputs the kernel sees
    rounded = dict(p, **{name: t[name].detach().double().cpu().numpy() for name in names})
    rounded["initial_state"] = h0.detach().double().cpu().numpy()
    o_ref, ht_ref = ref_forward(ref, variant, rounded)

    _poison_cache(4 * sum(x.numel() for x in t.values()))
    o, ht = _call(variant, t, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend=tier)
    torch.cuda.synchronize()
    assert o.dtype == dtype and ht.dtype == torch.float32
    tol = TOL[dtype]
    assert rel_err(o.detach().double().cpu().numpy(), o_ref) < tol
    assert rel_err(ht.detach().double().cpu().numpy(), ht_ref) < tol
    if not with_backward:
        return
    rng = np.random.default_rng(41)
    do = torch.tensor(rng.standard_normal(o.shape), dtype=dtype, device="cuda")
    dht = torch.tensor(rng.standard_normal(ht.shape), dtype=torch.float32, device="cuda")
    grads_ref = ref_backward(ref, variant, rounded, do.double().cpu().numpy(), dht.double().cpu().numpy())
    ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
    torch.cuda.synchronize()
    for name in names:
        assert t[name].grad.dtype == t[name].dtype, f"d{name} dtype"
        err = rel_err(t[name].grad.double().cpu().numpy(), grads_ref["d" + name])
        assert err < tol, f"d{name}: {err:.3e}"
    assert rel_err(h0.grad.double().cpu().numpy(), grads_ref["dh0"]) < tol


def test_default_backend_and_streams():
    """backend=None picks a CUDA tier; work goes to torch's current stream (a side stream gives the
    same result as the default one)."""
    _require_cuda_build()
    if not any(deltacp._core.cuda_supports("gdn", tier, False) for tier in TIERS):
        pytest.skip("no CUDA tier implements gdn in this build")
    p = make_problem("gdn", B=2, T=70, H=2, K=32, V=32, seed=42)
    t = {name: torch.tensor(p[name], dtype=torch.float32, device="cuda") for name in ("q", "k", "v", "g", "beta")}
    o_default, _ = deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o_side, _ = deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"])
    side.synchronize()
    assert torch.equal(o_default, o_side)
    o_ref, _ = ref.gated_delta_rule(*(t[n].double().cpu().numpy() for n in ("q", "k", "v", "g", "beta")))
    assert rel_err(o_default.double().cpu().numpy(), o_ref) < 1e-5


def test_workspace_pool_release_and_reuse():
    """The kernels' workspace pool (cuda/common/workspace_pool.h): results are bit-identical across
    synchronised calls that reuse the cached memory and after deltacp.cuda_release_workspace() hands it
    back; the release itself is safe to call twice."""
    _require_cuda_build()
    if not any(deltacp._core.cuda_supports("gdn", tier, True) for tier in TIERS):
        pytest.skip("no CUDA tier implements the gdn backward in this build")
    p = make_problem("gdn", B=1, T=300, H=2, K=64, V=64, seed=8)

    def step():
        t = {n: torch.tensor(p[n], dtype=torch.float32, device="cuda", requires_grad=True)
             for n in ("q", "k", "v", "g", "beta")}
        o, _ = deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"])
        o.backward(torch.ones_like(o))
        torch.cuda.synchronize()
        return [o.detach()] + [t[n].grad for n in ("q", "k", "v", "g", "beta")]

    first = step()
    again = step()
    deltacp.cuda_release_workspace()
    deltacp.cuda_release_workspace()
    after = step()
    for a, b, c in zip(first, again, after):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_views_on_cuda():
    _require_cuda_build()
    if not any(deltacp._core.cuda_supports("gdn", tier, False) for tier in TIERS):
        pytest.skip("no CUDA tier implements gdn in this build")
    p = make_problem("gdn", B=1, T=40, H=2, K=32, V=32, seed=43)
    fused = torch.tensor(np.concatenate([p["q"], p["k"], p["v"]], axis=-1), dtype=torch.float32, device="cuda")
    q, k, v = fused[..., :32], fused[..., 32:64], fused[..., 64:]
    g = torch.tensor(p["g"], dtype=torch.float32, device="cuda")
    beta = torch.tensor(p["beta"], dtype=torch.float32, device="cuda")
    o_view, _ = deltacp.chunk_gated_delta_rule(q, k, v, g, beta)
    o_copy, _ = deltacp.chunk_gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), g, beta)
    assert torch.equal(o_view, o_copy)


def test_cuda_bad_input():
    _require_cuda_build()
    p = make_problem("gdn", B=1, T=8, H=1, K=32, V=32, seed=44)
    t = {name: torch.tensor(p[name], dtype=torch.float32, device="cuda") for name in ("q", "k", "v", "g", "beta")}
    with pytest.raises(ValueError, match="'backend'"):
        deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], backend="reference")
    with pytest.raises(ValueError, match="'k'.*device"):
        deltacp.chunk_gated_delta_rule(t["q"], t["k"].cpu(), t["v"], t["g"], t["beta"])
    with pytest.raises(ValueError, match="'initial_state'.*device"):
        deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                       initial_state=torch.zeros((1, 1, 32, 32)))


# ---- the state-only modes (Params::final_state_only / dh0_only: the CP pre-pass) on the CUDA tiers ----
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_every_state_scan_tile_gives_the_same_result(variant, dtype, monkeypatch):
    """The tiled forward's state scan (cuda/tiled/scan_config.h) picks a column tile BV and one or two load
    stages from the grid size. Each state column evolves on its own and every tile sums its products in
    the same order, so every forced choice (DELTACP_TILED_SCAN_BV = 32, 64; STAGES = 1, 2) must give the
    default's o and final state bit for bit, and the default must match the reference. K = V = 128 (8 warps)
    over three sequences, one of them a single token."""
    _require_cuda_build()
    monkeypatch.setenv("DELTACP_TILED_SCAN_WGMMA", "0")  # the mma.sync scan's tiles (the wgmma scan: below)
    p = make_problem(variant, cu_seqlens=[0, 1, 150, 300], H=2, HV=2, K=128, V=128, seed=21)
    names = input_names(variant)
    t = {n: torch.tensor(p[n], dtype=torch.float32 if n == "g" else dtype, device="cuda") for n in names}
    h0 = torch.tensor(p["initial_state"], dtype=torch.float32, device="cuda")
    cu = torch.tensor(p["cu_seqlens"], device="cuda")

    def run():
        o, ht = _call(variant, t, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend="tiled")
        torch.cuda.synchronize()
        return o, ht

    o0, ht0 = run()
    rounded = dict(p, **{n: t[n].double().cpu().numpy() for n in names}, initial_state=h0.double().cpu().numpy())
    o_ref, ht_ref = ref_forward(ref, variant, rounded)
    assert rel_err(o0.double().cpu().numpy(), o_ref) < TOL[dtype]
    assert rel_err(ht0.double().cpu().numpy(), ht_ref) < TOL[dtype]
    for bv in ("32", "64"):
        for stages in ("1", "2"):
            monkeypatch.setenv("DELTACP_TILED_SCAN_BV", bv)
            monkeypatch.setenv("DELTACP_TILED_SCAN_STAGES", stages)
            o, ht = run()
            assert torch.equal(o, o0) and torch.equal(ht, ht0), f"BV {bv}, {stages} stage(s)"
    monkeypatch.setenv("DELTACP_TILED_SCAN_BV", "48")
    with pytest.raises(ValueError, match="DELTACP_TILED_SCAN_BV"):
        run()


def _check_wgmma_scan(monkeypatch, variant, dtype, H, HV, V, cu_seqlens, with_h0, seed):
    """The wgmma state scan (DELTACP_TILED_SCAN_WGMMA=1, one and two warpgroups per CTA) against the
    mma.sync scan (=0) and the fp64 reference: o, the final state and every gradient (the backward
    recomputes h with the same scan); then the default warpgroup count again, bit for bit."""
    _require_cuda_build()
    p = make_problem(variant, cu_seqlens=cu_seqlens, H=H, HV=HV, K=128, V=V, seed=seed)
    names = input_names(variant)
    t = {n: torch.tensor(p[n], dtype=torch.float32 if n == "g" else dtype, device="cuda") for n in names}
    h0 = torch.tensor(p["initial_state"], dtype=torch.float32, device="cuda") if with_h0 else None
    cu = torch.tensor(p["cu_seqlens"], device="cuda")
    rng = np.random.default_rng(seed + 1)
    do = torch.tensor(rng.standard_normal((1, cu_seqlens[-1], HV, V)), dtype=dtype, device="cuda")

    def run():
        x = {n: v.clone().requires_grad_(True) for n, v in t.items()}
        h = h0.clone().requires_grad_(True) if with_h0 else None
        o, ht = _call(variant, x, initial_state=h, output_final_state=True, cu_seqlens=cu, backend="tiled")
        ((o.float() * do.float()).sum() + ht.sum()).backward()
        torch.cuda.synchronize()
        return [o.detach(), ht.detach()] + ([h.grad] if with_h0 else []) + [x[n].grad for n in names]

    monkeypatch.setenv("DELTACP_TILED_SCAN_WGMMA", "1")
    if torch.cuda.get_device_capability() != (9, 0):
        with pytest.raises(ValueError, match="DELTACP_TILED_SCAN_WGMMA"):
            run()
        pytest.skip("the wgmma scan runs on compute capability 9.0 only")
    got = {}
    for wg in ("1", "2"):
        monkeypatch.setenv("DELTACP_TILED_SCAN_WG", wg)
        try:
            got[wg] = run()
        except ValueError as e:  # a Hopper GPU, but a build without 90a in DELTACP_CUDA_ARCHS
            if "sm_90a" in str(e):
                pytest.skip(str(e))
            raise
    monkeypatch.delenv("DELTACP_TILED_SCAN_WG")
    monkeypatch.setenv("DELTACP_TILED_SCAN_WGMMA", "0")
    base = run()
    rounded = dict(p, **{n: t[n].double().cpu().numpy() for n in names})
    rounded["initial_state"] = h0.double().cpu().numpy() if with_h0 else None
    o_ref, ht_ref = ref_forward(ref, variant, rounded)
    labels = ["o", "ht"] + (["dh0"] if with_h0 else []) + ["d" + n for n in names]
    for wg, res in got.items():
        assert rel_err(res[0].double().cpu().numpy(), o_ref) < 1e-2, f"o vs reference, {wg} warpgroup(s)"
        assert rel_err(res[1].double().cpu().numpy(), ht_ref) < 1e-2, f"ht vs reference, {wg} warpgroup(s)"
        for label, a, b in zip(labels, res, base):
            err = rel_err(a.double().cpu().numpy(), b.double().cpu().numpy())
            assert err < 5e-3, f"{label}: wgmma ({wg} warpgroup(s)) vs mma.sync scan {err:.2e}"
    # deterministic: the default warpgroup count (one for a state at most 64 columns wide, else two)
    monkeypatch.setenv("DELTACP_TILED_SCAN_WGMMA", "1")
    again = run()
    assert all(torch.equal(a, b) for a, b in zip(again, got["1" if V <= 64 else "2"]))


@pytest.mark.parametrize("variant", ["gdn", "kda", "delta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("V", [128, 96, 256])
def test_wgmma_scan_matches_the_mma_sync_scan(variant, dtype, V, monkeypatch):
    """The Hopper state scan (cuda/tiled/scan_wgmma.cuh: wgmma, S^T in registers) against the mma.sync
    scan and the reference, with one and two warpgroups per CTA. V = 96 leaves the second warpgroup's
    columns partly outside the state; V = 256 is as wide as the CP pre-pass's [H | M] state. The two
    scans round alike and sum the k-steps in the same order (bench_scan.py found o bit-identical), but
    the test asks only for bf16 agreement. Runs on compute capability 9.0 only (elsewhere
    DELTACP_TILED_SCAN_WGMMA=1 must raise naming the variable)."""
    _check_wgmma_scan(monkeypatch, variant, dtype, H=2, HV=2, V=V, cu_seqlens=[0, 1, 150, 300, 700], with_h0=True,
                      seed=23)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
@pytest.mark.parametrize("V", [64, 160])
def test_wgmma_scan_grouped_heads_without_initial_state(variant, V, monkeypatch):
    """The wgmma scan with grouped value heads (HV = 2 H: value head hv reads key head hv / 2), no initial
    state, and a state whose last CTA has a warpgroup wholly outside it (V = 64 with two warpgroups,
    V = 160: columns 128..159 in the second CTA)."""
    _check_wgmma_scan(monkeypatch, variant, torch.bfloat16, H=2, HV=4, V=V, cu_seqlens=[0, 70, 200, 330],
                      with_h0=False, seed=31)


def test_wgmma_scan_switch_names_what_it_cannot_run(monkeypatch):
    """DELTACP_TILED_SCAN_WGMMA=1 requires the Hopper scan: fp32 inputs (which it does not take) raise a
    ValueError naming the variable and the reason, on any GPU and build; a value other than 0 or 1 is
    rejected by name."""
    _require_cuda_build()
    p = make_problem("gdn", B=1, T=70, H=1, K=128, V=128, seed=25)
    t = {n: torch.tensor(p[n], dtype=torch.float32, device="cuda") for n in ("q", "k", "v", "g", "beta")}
    monkeypatch.setenv("DELTACP_TILED_SCAN_WGMMA", "1")
    with pytest.raises(ValueError, match="DELTACP_TILED_SCAN_WGMMA.*(bf16 or fp16|sm_90a)"):
        deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], backend="tiled")
    monkeypatch.setenv("DELTACP_TILED_SCAN_WGMMA", "yes")
    with pytest.raises(ValueError, match="DELTACP_TILED_SCAN_WGMMA.*expected 0 or 1"):
        deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], backend="tiled")


# ---- the state scan in pieces (cuda/tiled/scan_split.cu) ----------------------------------------------
# Sequences of 300 (5 chunks), 1, 0 and 399 (7 chunks) tokens; DELTACP_TILED_SCAN_PIECE=128 cuts the
# first into 3 pieces (128, 128, 44 tokens) and the last into 4.
_CUT_SEQLENS = [0, 300, 301, 301, 700]


@pytest.mark.parametrize("variant", ["gdn", "kda", "delta"])
@pytest.mark.parametrize("dtype,K,V", [(torch.float32, 64, 48), (torch.bfloat16, 64, 48), (torch.bfloat16, 128, 128)],
                         ids=["fp32", "bf16", "bf16-k128"])
def test_scan_in_pieces_matches_the_whole_scan(variant, dtype, K, V, monkeypatch):
    """The tiled forward's state scan cut into pieces (pass 1: each piece's [H | M] from [0 | I]; fold;
    pass 2 from each piece's start) against the whole scan (DELTACP_TILED_SCAN_PIECE=0) and the fp64
    reference: o, the final state and every gradient (the backward's recompute cuts the same way), with an
    initial state, a 1-token and an empty sequence beside the cut ones; bit for bit run to run. K = V = 128
    in bf16 runs pass 1 with a 256-column state on the wgmma scan where the GPU has it."""
    _require_cuda_build()
    from deltacp import _core

    if not _core.cuda_supports(variant, "tiled", True):
        pytest.skip(f"tiled has no {variant} backward")
    p = make_problem(variant, cu_seqlens=_CUT_SEQLENS, H=2, HV=4, K=K, V=V, seed=31)
    names = input_names(variant)
    t = {n: torch.tensor(p[n], dtype=torch.float32 if n == "g" else dtype, device="cuda") for n in names}
    h0 = torch.tensor(p["initial_state"], dtype=torch.float32, device="cuda")
    cu = torch.tensor(p["cu_seqlens"], device="cuda")
    rng = np.random.default_rng(32)
    do = torch.tensor(rng.standard_normal((1, _CUT_SEQLENS[-1], 4, V)), dtype=dtype, device="cuda")

    def run():
        x = {n: v.clone().requires_grad_(True) for n, v in t.items()}
        h = h0.clone().requires_grad_(True)
        o, ht = _call(variant, x, initial_state=h, output_final_state=True, cu_seqlens=cu, backend="tiled")
        ((o.float() * do.float()).sum() + ht.sum()).backward()
        torch.cuda.synchronize()
        return [o.detach(), ht.detach(), h.grad] + [x[n].grad for n in names]

    monkeypatch.setenv("DELTACP_TILED_SCAN_PIECE", "0")
    whole = run()
    monkeypatch.setenv("DELTACP_TILED_SCAN_PIECE", "128")
    cut = run()
    rounded = dict(p, **{n: t[n].double().cpu().numpy() for n in names})
    rounded["initial_state"] = h0.double().cpu().numpy()
    o_ref, ht_ref = ref_forward(ref, variant, rounded)
    assert rel_err(cut[0].double().cpu().numpy(), o_ref) < TOL[dtype]
    assert rel_err(cut[1].double().cpu().numpy(), ht_ref) < TOL[dtype]
    bar = 1e-5 if dtype == torch.float32 else 5e-3
    for label, a, b in zip(["o", "ht", "dh0"] + ["d" + n for n in names], cut, whole):
        assert torch.isfinite(a).all(), label
        err = rel_err(a.double().cpu().numpy(), b.double().cpu().numpy())
        assert err < bar, f"{label}: the scan in pieces vs the whole scan {err:.2e}"
    again = run()
    assert all(torch.equal(a, b) for a, b in zip(again, cut))


def test_scan_pieces_says_where_it_cuts(monkeypatch):
    """_core.scan_pieces (deltacp/cuda/api.h scan_pieces) gives the cut as offsets in a sequence;
    DELTACP_TILED_SCAN_PIECE rounds up to whole chunks, 0 never cuts, and a bad value, a sequence index
    out of range or a state too wide to carry [H | M] raise naming what is wrong."""
    _require_cuda_build()
    from deltacp import _core
    from deltacp._describe import torch_desc

    def descs(K, V):
        p = make_problem("gdn", cu_seqlens=_CUT_SEQLENS, H=1, K=K, V=V, seed=3)
        ts = {n: torch.tensor(p[n], dtype=torch.bfloat16 if n != "g" else torch.float32, device="cuda")
              for n in ("q", "k", "v", "g", "beta")}
        cu = torch.tensor(_CUT_SEQLENS, dtype=torch.int64)
        ts["cu"], ts["cu_host"] = cu.cuda(), cu
        o = torch.empty_like(ts["v"])
        d = {n: torch_desc(ts[n], n) for n in ("q", "k", "v", "g", "beta")}
        d["o"] = torch_desc(o, "o")
        d["cu_seqlens"], d["cu_seqlens_host"] = torch_desc(ts["cu"], "cu_seqlens"), torch_desc(cu, "cu_seqlens")
        return d, (ts, o)

    d, _alive = descs(64, 64)
    monkeypatch.setenv("DELTACP_TILED_SCAN_PIECE", "100")  # rounds up to 128 tokens
    assert list(_core.scan_pieces("gdn", d, 0)) == [0, 128, 256, 300]
    assert list(_core.scan_pieces("gdn", d, 1)) == [0, 1]
    assert list(_core.scan_pieces("gdn", d, 2)) == [0, 0]
    assert list(_core.scan_pieces("gdn", d, 3)) == [0, 128, 256, 384, 399]
    monkeypatch.setenv("DELTACP_TILED_SCAN_PIECE", "0")
    assert list(_core.scan_pieces("gdn", d, 3)) == [0, 399]
    with pytest.raises(ValueError, match="'n'"):
        _core.scan_pieces("gdn", d, 4)
    monkeypatch.setenv("DELTACP_TILED_SCAN_PIECE", "-5")
    with pytest.raises(ValueError, match="DELTACP_TILED_SCAN_PIECE"):
        _core.scan_pieces("gdn", d, 0)
    wide, _alive2 = descs(256, 256)
    monkeypatch.setenv("DELTACP_TILED_SCAN_PIECE", "128")
    with pytest.raises(ValueError, match="DELTACP_TILED_SCAN_PIECE.*V \\+ K"):
        _core.scan_pieces("gdn", wide, 0)
    # No sequence longer than a piece: nothing is cut, so a state too wide for [H | M] is no error.
    monkeypatch.setenv("DELTACP_TILED_SCAN_PIECE", "512")
    assert list(_core.scan_pieces("gdn", wide, 3)) == [0, 399]


def _forward_descs(t, d, desc, state_shape, with_h0):
    """_cuda_problem's descriptions as a forward with NaN-filled o and ht (h0 only when with_h0): (descs, o, ht)."""
    dd = {key: val for key, val in d.items() if with_h0 or key != "h0"}
    o = torch.full_like(t["v"], float("nan"))
    ht = torch.full(tuple(state_shape), float("nan"), device="cuda")
    dd["o"], dd["ht"] = desc(o, "o"), desc(ht, "ht")
    return dd, o, ht


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["gdn", "kda", "delta"])
def test_staged_forward_reuses_the_piece_maps(variant, dtype, monkeypatch):
    """The CP pre-pass of a cut last segment is the local forward's own pass 1: prepare (which runs pass 1)
    -> staged_forward_piece_maps (sequence 3, whose two pieces are [130, 194) and [194, 200)) -> finish
    with h0 gives the one-shot forward's o and ht bit for bit, and the maps equal a final-state-only run
    of the same pieces with the widened values [v | 0] from [0 | I] bit for bit (the route the CP pre-pass
    takes without a prepared forward). Maps for a sequence not cut, or of the wrong size, raise naming the
    argument."""
    _require_cuda_build()
    from deltacp import _core

    if not _core.cuda_supports(variant, "tiled", False):
        pytest.skip(f"tiled has no {variant} forward")
    monkeypatch.setenv("DELTACP_TILED_SCAN_PIECE", "64")
    t, h0, d, desc = _cuda_problem(variant, dtype)  # sequences [0,1) [1,64) [64,130) [130,200), chunk 64
    N, HV, K, V = h0.shape
    stream = torch.cuda.current_stream().cuda_stream
    names = [n for n in t if n != "_alive"]

    def forward_descs(with_h0):
        return _forward_descs(t, d, desc, h0.shape, with_h0)

    one, one_o, one_ht = forward_descs(True)
    assert list(_core.scan_pieces(variant, one, 3)) == [0, 64, 70]
    _core.run("forward", variant, "tiled", "float32", one, None, 64, None, stream, False)

    staged, st_o, st_ht = forward_descs(False)
    state = _core.staged_forward_prepare(variant, "tiled", staged, None, 64, stream)
    maps = torch.full((2, HV, K, V + K), float("nan"), device="cuda")
    _core.staged_forward_piece_maps(state, 3, maps.data_ptr(), maps.numel())
    with pytest.raises(ValueError, match="'n'"):  # sequence 1 (63 tokens) is one piece
        _core.staged_forward_piece_maps(state, 1, maps.data_ptr(), maps.numel())
    with pytest.raises(ValueError, match="'maps'"):
        _core.staged_forward_piece_maps(state, 3, maps.data_ptr(), maps.numel() - 1)
    staged["h0"] = d["h0"]
    _core.staged_forward_step(state, "finish", variant, staged, None, 64, stream)

    # the widened run of the same pieces: rows [130, 200) cut at 64, values [v | 0], from [0 | I]
    cu_host = torch.tensor([0, 64, 70], dtype=torch.int64)
    cu_dev = cu_host.cuda()
    pd = {x: desc(t[x][:, 130:200], x) for x in names if x != "v"}
    wide = torch.cat([t["v"][:, 130:200], torch.zeros((1, 70, HV, K), dtype=dtype, device="cuda")], dim=-1)
    pd["v"] = desc(wide, "v")
    pd["cu_seqlens"], pd["cu_seqlens_host"] = desc(cu_dev, "cu_seqlens"), desc(cu_host, "cu_seqlens")
    start = torch.zeros((2, HV, K, V + K), device="cuda")
    start[..., V:] = torch.eye(K, device="cuda")
    widened = torch.full_like(start, float("nan"))
    pd["h0"], pd["ht"] = desc(start, "initial_state"), desc(widened, "ht")
    _core.run("forward", variant, "tiled", "float32", pd, None, 64, None, stream, False)
    torch.cuda.synchronize()
    assert torch.isfinite(one_o).all() and torch.equal(st_o, one_o)
    assert torch.equal(st_ht, one_ht)
    assert torch.isfinite(maps).all() and torch.equal(maps, widened)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_composed_map_is_the_pieces_maps_folded(variant, monkeypatch):
    """The CP pre-pass's one launch (deltacp/cuda/api.h forward_composed_map, compose_state_maps): a cut
    sequence's pass-1 maps composed in fp32 equal the maps folded in fp64 by torch (_fold_maps), entered
    with [0 | I], with [start | I] and with a given [H | M], at width V + K ([H | M]) and V (the offset
    alone; the first V columns of the former bit for bit). compose_state_maps on a copy of the maps gives
    forward_composed_map's bits. A bad width, a wrong size or a sequence not cut raise naming the argument."""
    _require_cuda_build()
    from deltacp import _core
    from deltacp.cp.local import _fold_maps

    monkeypatch.setenv("DELTACP_TILED_SCAN_PIECE", "64")
    t, h0, d, desc = _cuda_problem(variant, torch.bfloat16, cu_seqlens=(0, 40, 340))  # 40 tokens; 5 pieces
    N, HV, K, V = h0.shape
    stream = torch.cuda.current_stream().cuda_stream
    descs, _o, _ht = _forward_descs(t, d, desc, h0.shape, False)
    assert list(_core.scan_pieces(variant, descs, 1)) == [0, 64, 128, 192, 256, 300]
    state = _core.staged_forward_prepare(variant, "tiled", descs, None, 64, stream)
    maps = torch.empty((5, HV, K, V + K), device="cuda")
    _core.staged_forward_piece_maps(state, 1, maps.data_ptr(), maps.numel())
    eye = torch.eye(K, device="cuda").expand(HV, K, K)
    given = torch.cat([torch.randn(HV, K, V, device="cuda"), eye + 0.1 * torch.randn(HV, K, K, device="cuda")], -1)
    for init in (None, torch.cat([h0[1], eye], dim=-1), given):
        want = _fold_maps(torch.cat([(init if init is not None else torch.cat([0 * h0[1], eye], -1))[None], maps])
                          .double(), V)
        outs = {}
        for width in (V + K, V):
            x = None if init is None else init[..., :width].contiguous()
            out = torch.full((HV, K, width), float("nan"), device="cuda")
            _core.staged_forward_composed_map(state, 1, 0 if x is None else x.data_ptr(), out.data_ptr(), width,
                                              out.numel())
            again = torch.full_like(out, float("nan"))
            _core.compose_state_maps(maps.data_ptr(), 5, HV, K, V, width, 0 if x is None else x.data_ptr(),
                                     again.data_ptr(), again.numel(), stream)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all() and torch.equal(out, again)
            err = ((out.double() - want[..., :width]).norm() / want[..., :width].norm()).item()
            assert err < 1e-6, (width, err)
            outs[width] = out
        assert torch.equal(outs[V + K][..., :V], outs[V])
    out = torch.empty((HV, K, V), device="cuda")
    with pytest.raises(ValueError, match="'width'"):
        _core.staged_forward_composed_map(state, 1, 0, out.data_ptr(), V + 1, HV * K * (V + 1))
    with pytest.raises(ValueError, match="'out'"):
        _core.staged_forward_composed_map(state, 1, 0, out.data_ptr(), V, out.numel() - 1)
    with pytest.raises(ValueError, match="'n'"):  # sequence 0 (40 tokens) is one piece
        _core.staged_forward_composed_map(state, 0, 0, out.data_ptr(), V, out.numel())
    with pytest.raises(ValueError, match="'maps'"):
        _core.compose_state_maps(maps.data_ptr(), 0, HV, K, V, V, 0, out.data_ptr(), out.numel(), stream)
    torch.cuda.synchronize()


@pytest.mark.parametrize("P,HV,K,V", [(3, 2, 7, 5), (1, 3, 64, 48), (4, 2, 160, 16), (2, 1, 240, 13), (2, 2, 1, 3),
                                     (6, 2, 64, 64), (5, 2, 72, 20), (3, 1, 100, 7), (4, 2, 128, 128), (3, 2, 129, 9)])
def test_compose_state_maps_any_shape(P, HV, K, V):
    """compose_state_maps on maps of any size (cuda/tiled/scan_split.cu compose_maps_kernel): K and V not
    multiples of 4 (4-byte copies instead of 16-byte ones), one map, K from 1 to 240 (every ROWS instantiation;
    K > 128: slabs of 32 columns, more shared
    memory) against torch's fp64 fold, at width V + K and V, from [0 | I] and from a given state."""
    _require_cuda_build()
    from deltacp import _core
    from deltacp.cp.local import _fold_maps

    gen = torch.Generator().manual_seed(P * 1000 + K)
    H = torch.randn(P, HV, K, V, generator=gen)
    M = torch.eye(K) + torch.randn(P, HV, K, K, generator=gen) / K**0.5
    maps = torch.cat([H, M], dim=-1).cuda()
    start = torch.cat([torch.randn(HV, K, V, generator=gen), torch.eye(K).expand(HV, K, K)], -1).cuda()
    stream = torch.cuda.current_stream().cuda_stream
    for init in (None, start):
        first = init if init is not None else torch.cat([torch.zeros(HV, K, V), torch.eye(K).expand(HV, K, K)], -1)
        want = _fold_maps(torch.cat([first.cuda()[None], maps]).double(), V)
        for width in (V + K, V):
            x = None if init is None else init[..., :width].contiguous()
            out = torch.full((HV, K, width), float("nan"), device="cuda")
            _core.compose_state_maps(maps.data_ptr(), P, HV, K, V, width, 0 if x is None else x.data_ptr(),
                                     out.data_ptr(), out.numel(), stream)
            torch.cuda.synchronize()
            err = ((out.double() - want[..., :width]).norm() / want[..., :width].norm()).item()
            # fp32 level: the split-TF32 products with fp32 adds per k step (scan_split.cu carry_tile) measured
            # ~2e-7; a tensor-core accumulation over whole steps gave 1e-6 to 4e-6 (H100).
            assert torch.isfinite(out).all() and err < 1e-6, (width, err)


def _cuda_problem(variant, dtype, cu_seqlens=(0, 1, 64, 130, 200), K=64, V=48):
    from deltacp._describe import torch_desc

    p = make_problem(variant, cu_seqlens=list(cu_seqlens), H=2, HV=4, K=K, V=V, seed=11)
    t = {n: torch.as_tensor(np.ascontiguousarray(p[n])).to("cuda") for n in ("q", "k", "v", "g", "beta", "a", "b")
         if p.get(n) is not None}
    t = {n: (x.to(dtype) if n != "g" else x.float()) for n, x in t.items()}
    h0 = torch.as_tensor(p["initial_state"]).float().cuda()
    cu = torch.as_tensor(np.asarray(p["cu_seqlens"], dtype=np.int64)).cuda()
    gname = "gk" if variant == "dplr" else "g"
    d = {n: torch_desc(x, gname if n == "g" else n) for n, x in t.items()}
    d["h0"] = torch_desc(h0, "initial_state")
    d["cu_seqlens"] = torch_desc(cu, "cu_seqlens")
    cu_host = cu.cpu()
    d["cu_seqlens_host"] = torch_desc(cu_host, "cu_seqlens")
    t["_alive"] = (h0, cu, cu_host)  # the descriptions hold raw pointers: keep their tensors alive
    return t, h0, d, torch_desc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tier", ["naive", "tiled"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_state_only_modes_equal_the_full_run(variant, tier, dtype):
    """Final-state-only forward gives the full forward's ht, and dh0-only backward its dh0, bit for bit."""
    _require_cuda_build()
    from deltacp import _core

    for direction in ("forward", "backward"):
        if not _core.cuda_supports(variant, tier, direction == "backward"):
            pytest.skip(f"{tier} has no {variant} {direction}")
    t, h0, d, desc = _cuda_problem(variant, dtype)
    N, HV, K, V = h0.shape
    compute = "float32"
    stream = torch.cuda.current_stream().cuda_stream

    def forward(with_o):
        dd = dict(d)
        ht = torch.full((N, HV, K, V), float("nan"), device="cuda")
        dd["ht"] = desc(ht, "ht")
        if with_o:
            o = torch.empty_like(t["v"])
            dd["o"] = desc(o, "o")
        _core.run("forward", variant, tier, compute, dd, None, 64, None, stream, False)
        return ht

    def backward(with_grads):
        dd = dict(d)
        gen = torch.Generator(device="cuda").manual_seed(5)
        do = torch.randn(t["v"].shape, device="cuda", generator=gen).to(dtype)
        dht = torch.randn((N, HV, K, V), device="cuda", generator=gen)
        dh0 = torch.full((N, HV, K, V), float("nan"), device="cuda")
        dd.update(dout=desc(do, "do"), dht=desc(dht, "dht"), dh0=desc(dh0, "dh0"))
        keep = []
        if with_grads:
            for n, x in t.items():
                if n == "_alive":
                    continue
                keep.append(torch.empty_like(x))
                dd["d" + n] = desc(keep[-1], "d" + ("gk" if variant == "dplr" and n == "g" else n))
        _core.run("backward", variant, tier, compute, dd, None, 64, None, stream, False)
        return dh0

    ht_full, ht_only = forward(True), forward(False)
    torch.cuda.synchronize()
    assert torch.isfinite(ht_full).all()
    assert torch.equal(ht_only, ht_full)
    dh0_full, dh0_only = backward(True), backward(False)
    torch.cuda.synchronize()
    assert torch.isfinite(dh0_full).all()
    assert torch.equal(dh0_only, dh0_full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["gdn", "kda", "delta"])
def test_staged_forward_equals_the_one_shot_forward(variant, dtype):
    """deltacp/cuda/api.h StagedForward (tiled): prepare (no h0) -> state pieces -> finish (with h0) gives
    the one-shot forward's o and ht bit for bit. The pieces ([H | M] from [h | I] with the prepared values,
    M alone from I without them, over rows [64, 200)) equal final-state-only runs of the same pieces with
    the widened values [v | 0] (resp. 0) bit for bit. Pieces off the prepared chunks, another k, a state
    narrower than V, a second finish and another problem raise naming the argument."""
    _require_cuda_build()
    from deltacp import _core

    if not _core.cuda_supports(variant, "tiled", False):
        pytest.skip(f"tiled has no {variant} forward")
    t, h0, d, desc = _cuda_problem(variant, dtype)  # sequences [0,1) [1,64) [64,130) [130,200), chunk 64
    N, HV, K, V = h0.shape
    stream = torch.cuda.current_stream().cuda_stream
    gen = torch.Generator(device="cuda").manual_seed(5)
    names = [n for n in t if n != "_alive"]

    def forward_descs(with_h0):
        return _forward_descs(t, d, desc, h0.shape, with_h0)

    one, one_o, one_ht = forward_descs(True)
    _core.run("forward", variant, "tiled", "float32", one, None, 64, None, stream, False)

    # Pieces over rows [64, 200) on the prepared chunks (64,64) (128,2) (130,64)+(194,6).
    row0, cu_p = 64, torch.tensor([0, 64, 66, 136], dtype=torch.int64)
    P = cu_p.numel() - 1

    def piece_descs(cu_host, width, values, start_row=row0):
        n = int(cu_host[-1])
        pd = {x: desc(t[x][:, start_row:start_row + n], x) for x in names if x != "v"}
        pd["v"] = desc(values, "v")
        cu_dev = cu_host.cuda()
        pd["cu_seqlens"], pd["cu_seqlens_host"] = desc(cu_dev, "cu_seqlens"), desc(cu_host, "cu_seqlens")
        start = torch.zeros((cu_host.numel() - 1, HV, K, width), device="cuda")
        start[..., width - K:] = torch.eye(K, device="cuda")
        start[..., :width - K] = torch.randn((cu_host.numel() - 1, HV, K, width - K), device="cuda", generator=gen)
        ht_p = torch.full_like(start, float("nan"))
        pd["h0"], pd["ht"] = desc(start, "initial_state"), desc(ht_p, "ht")
        return pd, ht_p, (cu_dev, cu_host, start, values)  # the descriptions hold raw pointers: keep them alive

    v_rows = t["v"][:, row0:]
    zeros_k = torch.zeros((1, v_rows.shape[1], HV, K), dtype=dtype, device="cuda")
    wide = torch.cat([v_rows, zeros_k], dim=-1)  # [v | 0]: the reference's widened values
    gen.manual_seed(9)
    ref_hm, ref_hm_ht, _k1 = piece_descs(cu_p, V + K, wide)
    gen.manual_seed(9)
    ref_m, ref_m_ht, _k2 = piece_descs(cu_p, K, zeros_k)
    for ref in (ref_hm, ref_m):
        _core.run("forward", variant, "tiled", "float32", ref, None, 64, None, stream, False)

    staged, st_o, st_ht = forward_descs(False)
    state = _core.staged_forward_prepare(variant, "tiled", staged, None, 64, stream)
    def unread(w, n=int(cu_p[-1])):  # the staged pieces read no values: a zero-size view gives the width
        return torch.zeros(w, dtype=dtype, device="cuda").expand(1, n, HV, w)

    gen.manual_seed(9)
    hm, hm_ht, _k3 = piece_descs(cu_p, V + K, unread(V + K))
    _core.staged_forward_step(state, "state_pieces", variant, hm, None, 64, stream, row0=row0, with_values=True)
    gen.manual_seed(9)
    m, m_ht, _k4 = piece_descs(cu_p, K, unread(K))
    _core.staged_forward_step(state, "state_pieces", variant, m, None, 64, stream, row0=row0, with_values=False)
    staged["h0"] = d["h0"]
    _core.staged_forward_step(state, "finish", variant, staged, None, 64, stream)
    torch.cuda.synchronize()
    assert torch.isfinite(ref_hm_ht).all() and torch.equal(hm_ht, ref_hm_ht)
    assert torch.isfinite(ref_m_ht).all() and torch.equal(m_ht, ref_m_ht)
    assert torch.isfinite(one_o).all() and torch.equal(st_o, one_o)
    assert torch.equal(st_ht, one_ht)

    with pytest.raises(ValueError, match="state"):  # finished: its workspace is gone
        _core.staged_forward_step(state, "finish", variant, staged, None, 64, stream)
    again, _o, _ht = forward_descs(False)
    state = _core.staged_forward_prepare(variant, "tiled", again, None, 64, stream)
    off_grid, _, _k5 = piece_descs(torch.tensor([0, 40, 136], dtype=torch.int64), V + K, unread(V + K))
    with pytest.raises(ValueError, match="cu_seqlens"):  # a piece boundary inside a prepared chunk
        _core.staged_forward_step(state, "state_pieces", variant, off_grid, None, 64, stream, row0=row0)
    cu_shift = torch.tensor([0, 64, 66, 130], dtype=torch.int64)
    shifted, _, _k6 = piece_descs(cu_shift, V + K, unread(V + K, 130), start_row=row0 + 1)
    with pytest.raises(ValueError, match="'k'"):  # the pieces' k must be the prepared rows from row0
        _core.staged_forward_step(state, "state_pieces", variant, shifted, None, 64, stream, row0=row0)
    w = V - 16  # a state narrower than the prepared values
    narrow_start, narrow_values = torch.zeros((P, HV, K, w), device="cuda"), unread(w)
    narrow_ht = torch.empty_like(narrow_start)
    narrow = dict(hm, v=desc(narrow_values, "v"), h0=desc(narrow_start, "initial_state"), ht=desc(narrow_ht, "ht"))
    with pytest.raises(ValueError, match="'v'"):
        _core.staged_forward_step(state, "state_pieces", variant, narrow, None, 64, stream, row0=row0)
    other, _o2, _ht2 = forward_descs(True)
    q_other = t["q"].clone()
    other["q"] = desc(q_other, "q")
    with pytest.raises(ValueError, match="params"):  # finish must describe the prepared problem
        _core.staged_forward_step(state, "finish", variant, other, None, 64, stream)
    naive, _o3, _ht3 = forward_descs(False)
    with pytest.raises(ValueError, match="tier"):
        _core.staged_forward_prepare(variant, "naive", naive, None, 64, stream)
    torch.cuda.synchronize()


@pytest.mark.parametrize("handoff", ["fp32", "local16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["gdn", "kda", "delta"])
def test_staged_backward_equals_the_one_shot_backward(variant, dtype, handoff, monkeypatch):
    """deltacp/cuda/api.h StagedBackward (tiled): prepare (no dht) -> dh0 of pieces -> the states on another
    stream -> finish (with dht) gives the one-shot backward's gradients bit for bit; the pieces' dh0 equal a dh0-only run over the same
    pieces bit for bit; pieces off the prepared chunks, a second finish and another problem raise naming
    the argument. local16: K = V = 128 on the Hopper kernels with the chunk-local kernel's inputs in 16 bits
    (DELTACP_TILED_BWD_LOCAL16=1), where the dh0 pieces read B0's fp32 dVn before finish overwrites it."""
    _require_cuda_build()
    from deltacp import _core

    if not _core.cuda_supports(variant, "tiled", True):
        pytest.skip(f"tiled has no {variant} backward")
    K, V = 64, 48
    if handoff == "local16":
        if dtype != torch.bfloat16 or variant == "kda" or torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the 16-bit hand-offs run with the Hopper kernels: 16-bit gdn / delta on compute capability 9.0")
        for env in ("DELTACP_TILED_BWD_LOCAL16", "DELTACP_TILED_DH_WGMMA", "DELTACP_TILED_WY_WGMMA",
                    "DELTACP_TILED_BWD_LOCAL_WGMMA"):
            monkeypatch.setenv(env, "1")
        K = V = 128
    t, h0, d, desc = _cuda_problem(variant, dtype, K=K, V=V)  # sequences [0,1) [1,64) [64,130) [130,200), chunk 64
    N, HV, K, V = h0.shape
    stream = torch.cuda.current_stream().cuda_stream
    gen = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(t["v"].shape, device="cuda", generator=gen).to(dtype)
    dht = torch.randn((N, HV, K, V), device="cuda", generator=gen)
    names = [n for n in t if n != "_alive"]

    def backward_descs():
        grads = {n: torch.full_like(t[n], float("nan")) for n in names}
        dd = dict(d)
        dd["dout"] = desc(do, "do")
        for n in names:
            dd["d" + n] = desc(grads[n], "d" + n)
        dh0 = torch.full((N, HV, K, V), float("nan"), device="cuda")
        dd["dh0"] = desc(dh0, "dh0")
        return dd, grads, dh0

    one, one_grads, one_dh0 = backward_descs()
    one["dht"] = desc(dht, "dht")
    _core.run("backward", variant, "tiled", "float32", one, None, 64, None, stream, False)

    # pieces over the first 130 rows, on the prepared chunks (0,1) (1,63) (64,64) (128,2)
    cu_p = torch.tensor([0, 1, 64, 128, 130], dtype=torch.int64)
    dht_p = torch.randn((4, HV, K, V), device="cuda", generator=gen)

    def piece_descs(cu_host):
        n = int(cu_host[-1])
        pd = {x: desc(t[x][:, :n], x) for x in names}
        pd["dout"] = desc(do[:, :n], "do")
        cu_dev = cu_host.cuda()
        pd["cu_seqlens"], pd["cu_seqlens_host"] = desc(cu_dev, "cu_seqlens"), desc(cu_host, "cu_seqlens")
        P = cu_host.numel() - 1
        dh0_p = torch.full((P, HV, K, V), float("nan"), device="cuda")
        pd["dht"], pd["dh0"] = desc(dht_p[:P].contiguous(), "dht"), desc(dh0_p, "dh0")
        return pd, dh0_p, (cu_dev, cu_host)  # the descriptions hold raw pointers: keep both alive

    ref_pieces, ref_dh0_p, _keep1 = piece_descs(cu_p)
    _core.run("backward", variant, "tiled", "float32", ref_pieces, None, 64, None, stream, False)

    staged, st_grads, st_dh0 = backward_descs()
    state = _core.staged_backward_prepare(variant, "tiled", staged, None, 64, stream)
    pieces, dh0_p, _keep2 = piece_descs(cu_p)
    _core.staged_backward_step(state, "dh0_pieces", variant, pieces, None, 64, stream)
    side = torch.cuda.Stream()  # the recompute's state scan on another stream, as the CP backward runs it
    side.wait_stream(torch.cuda.current_stream())
    _core.staged_backward_step(state, "states", variant, {}, None, 64, side.cuda_stream)
    with pytest.raises(ValueError, match="state"):  # once only
        _core.staged_backward_step(state, "states", variant, {}, None, 64, side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    staged["dht"] = desc(dht, "dht")
    _core.staged_backward_step(state, "finish", variant, staged, None, 64, stream)
    torch.cuda.synchronize()
    assert torch.isfinite(ref_dh0_p).all() and torch.equal(dh0_p, ref_dh0_p)
    assert torch.equal(st_dh0, one_dh0)
    for n in names:
        assert torch.isfinite(one_grads[n]).all(), n
        assert torch.equal(st_grads[n], one_grads[n]), n

    with pytest.raises(ValueError, match="state"):  # finished: its workspace is gone
        _core.staged_backward_step(state, "finish", variant, staged, None, 64, stream)
    again, _, _ = backward_descs()
    state = _core.staged_backward_prepare(variant, "tiled", again, None, 64, stream)
    cu_off = torch.tensor([0, 1, 40, 130], dtype=torch.int64)
    off_grid, _, _keep3 = piece_descs(cu_off)
    with pytest.raises(ValueError, match="cu_seqlens"):  # a piece boundary inside a prepared chunk
        _core.staged_backward_step(state, "dh0_pieces", variant, off_grid, None, 64, stream)
    other, _, _ = backward_descs()
    q_other = t["q"].clone()
    other["q"] = desc(q_other, "q")
    with pytest.raises(ValueError, match="params"):  # finish must describe the prepared problem
        _core.staged_backward_step(state, "finish", variant, other, None, 64, stream)
    naive, _naive_grads, _naive_dh0 = backward_descs()
    with pytest.raises(ValueError, match="tier"):
        _core.staged_backward_prepare(variant, "naive", naive, None, 64, stream)
    torch.cuda.synchronize()


# ---- the backward's reverse state-gradient scan on Hopper (cuda/tiled/bwd_dh_scan_wgmma.cuh) ---------------
def _backward_grads(variant, t, h0, cu, do, dht, monkeypatch, switch):
    monkeypatch.setenv("DELTACP_TILED_DH_WGMMA", switch)
    x = {n: v.clone().requires_grad_(True) for n, v in t.items()}
    h = h0.clone().requires_grad_(True)
    o, ht = _call(variant, x, initial_state=h, output_final_state=True, cu_seqlens=cu, backend="tiled")
    ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
    torch.cuda.synchronize()
    return {"dh0": h.grad, **{"d" + n: x[n].grad for n in t}}


@pytest.mark.parametrize("variant", ["gdn", "delta", "kda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["varlen", "grouped"])
def test_wgmma_dh_scan_matches_the_mma_sync_scan_and_the_reference(variant, dtype, case, monkeypatch):
    """Stage B1 of the tiled backward on Hopper (wgmma, dS^T in registers, tiles by TMA; kda: its Kd and Q e^G
    workspaces in place of k and q, and the per-key decay of dS) against the mma.sync scan
    (DELTACP_TILED_DH_WGMMA=0) and the fp64 reference, every gradient including dh0, with a non-zero dht: packed
    sequences of 1, 149, 150 and 400 tokens (short last chunks, whose rows past the sequence the kernel zeroes),
    or grouped value heads (HV = 2 H) over a fixed-length batch. One and two warpgroups per CTA
    (DELTACP_TILED_DH_WG) give the same bits, and so do two runs. Runs on compute capability 9.0 only (elsewhere
    the switch set to 1 must raise naming itself)."""
    _require_cuda_build()
    if case == "varlen":
        p = make_problem(variant, cu_seqlens=[0, 1, 150, 300, 700], H=2, HV=2, K=128, V=128, seed=41)
        N, T = 4, 700
    else:
        p = make_problem(variant, B=2, T=200, H=2, HV=4, K=128, V=128, seed=43)
        N, T = 2, 200
    names = input_names(variant)
    t = {n: torch.tensor(p[n], dtype=torch.float32 if n == "g" else dtype, device="cuda") for n in names}
    rng = np.random.default_rng(7)
    h0 = torch.tensor(rng.standard_normal((N, p["v"].shape[-2], 128, 128)) * 0.1, dtype=torch.float32, device="cuda")
    dht = torch.tensor(rng.standard_normal(tuple(h0.shape)), dtype=torch.float32, device="cuda")
    B = 1 if case == "varlen" else 2
    do = torch.tensor(rng.standard_normal((B, T, p["v"].shape[-2], 128)), dtype=dtype, device="cuda")
    cu = torch.tensor(p["cu_seqlens"], device="cuda") if p.get("cu_seqlens") is not None else None
    if torch.cuda.get_device_capability() != (9, 0):
        with pytest.raises(ValueError, match="DELTACP_TILED_DH_WGMMA"):
            _backward_grads(variant, t, h0, cu, do, dht, monkeypatch, "1")
        pytest.skip("the wgmma dh scan runs on compute capability 9.0 only")
    got = {}
    for wg in ("1", "2"):  # one or two warpgroups per CTA (DELTACP_TILED_DH_WG)
        monkeypatch.setenv("DELTACP_TILED_DH_WG", wg)
        try:
            got[wg] = _backward_grads(variant, t, h0, cu, do, dht, monkeypatch, "1")
        except ValueError as e:  # a Hopper GPU, but a build without 90a in DELTACP_CUDA_ARCHS
            if "sm_90a" in str(e):
                pytest.skip(str(e))
            raise
    again = _backward_grads(variant, t, h0, cu, do, dht, monkeypatch, "1")
    monkeypatch.delenv("DELTACP_TILED_DH_WG")
    base = _backward_grads(variant, t, h0, cu, do, dht, monkeypatch, "0")
    rounded = dict(p, **{n: t[n].double().cpu().numpy() for n in names}, initial_state=h0.double().cpu().numpy())
    want = ref_backward(ref, variant, rounded, do.double().cpu().numpy(), dht=dht.double().cpu().numpy())
    for wg, grads in got.items():
        for name, g in grads.items():
            assert torch.isfinite(g).all(), name
            # each state column evolves on its own: the warpgroup count changes no bit
            assert torch.equal(g, got["1"][name]), f"{name}: {wg} warpgroups differ from one"
            err = rel_err(g.double().cpu().numpy(), base[name].double().cpu().numpy())
            assert err < 5e-3, f"{name}: wgmma ({wg} warpgroups) vs mma.sync dh scan {err:.2e}"
            err = rel_err(g.double().cpu().numpy(), np.asarray(want[name]))
            assert err < 1e-2, f"{name}: wgmma dh scan ({wg} warpgroups) vs the fp64 reference {err:.2e}"
    for name, g in again.items():
        assert torch.equal(g, got["2"][name]), f"{name}: two runs differ"


def test_wgmma_dh_scan_switch_names_what_it_cannot_run(monkeypatch):
    """DELTACP_TILED_DH_WGMMA=1 requires the Hopper dh scan: fp32 inputs and K = V = 64 (which it does not
    take) raise a ValueError naming the variable and the reason; a value other than 0 or 1 is rejected by
    name."""
    _require_cuda_build()
    for variant, dtype, D, why in (("gdn", torch.float32, 128, "bf16 or fp16|sm_90a"),
                                   ("kda", torch.bfloat16, 64, "K = V = 128|sm_90a")):
        p = make_problem(variant, B=1, T=70, H=1, K=D, V=D, seed=25)
        t = {n: torch.tensor(p[n], dtype=torch.float32 if n == "g" else dtype, device="cuda").requires_grad_(True)
             for n in input_names(variant)}
        monkeypatch.setenv("DELTACP_TILED_DH_WGMMA", "1")
        o, _ = _call(variant, t, backend="tiled")
        with pytest.raises(ValueError, match=f"DELTACP_TILED_DH_WGMMA.*({why})"):
            o.float().sum().backward()
    monkeypatch.setenv("DELTACP_TILED_DH_WGMMA", "yes")
    o, _ = _call(variant, t, backend="tiled")
    with pytest.raises(ValueError, match="DELTACP_TILED_DH_WGMMA.*expected 0 or 1"):
        o.float().sum().backward()


def _packed_dh0_run(variant, seed, upstream_seed):
    """A bf16 problem of the variant (K = V = 128, packed sequences [0, 1, 64, 130, 300), H = 2, HV = 4) with h0, do
    and dht, for the tests that check the dh0-only backward (the CP pre-pass) against the full one: returns
    dh0_of(with_grads) -> dh0 of one tiled backward through the C++ entry point, with every input gradient
    requested or none."""
    from deltacp import _core
    from deltacp._describe import torch_desc

    p = make_problem(variant, cu_seqlens=[0, 1, 64, 130, 300], H=2, HV=4, K=128, V=128, seed=seed)
    t = {n: torch.as_tensor(np.ascontiguousarray(p[n])).to("cuda") for n in ("q", "k", "v", "g", "beta")}
    t = {n: (x.bfloat16() if n != "g" else x.float()) for n, x in t.items()}
    h0 = torch.as_tensor(p["initial_state"]).float().cuda()
    cu = torch.as_tensor(np.asarray(p["cu_seqlens"], dtype=np.int64)).cuda()
    d = {n: torch_desc(x, n) for n, x in t.items()}
    d["h0"] = torch_desc(h0, "initial_state")
    d["cu_seqlens"] = torch_desc(cu, "cu_seqlens")
    cu_host = cu.cpu()  # the CUDA tiers plan their chunk table from a host copy of the offsets
    d["cu_seqlens_host"] = torch_desc(cu_host, "cu_seqlens")
    gen = torch.Generator(device="cuda").manual_seed(upstream_seed)
    do = torch.randn(t["v"].shape, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(tuple(h0.shape), device="cuda", generator=gen)
    stream = torch.cuda.current_stream().cuda_stream
    offsets = (cu, cu_host)  # d holds their addresses only: dh0_of keeps them (and t, h0, do, dht) alive

    def dh0_of(with_grads):
        dd = dict(d)
        dh0 = torch.full(tuple(h0.shape), float("nan"), device="cuda")
        dd.update(dout=torch_desc(do, "do"), dht=torch_desc(dht, "dht"), dh0=torch_desc(dh0, "dh0"))
        keep = [offsets]
        if with_grads:
            for n, x in t.items():
                keep.append(torch.empty_like(x))
                dd["d" + n] = torch_desc(keep[-1], "d" + n)
        _core.run("backward", variant, "tiled", "float32", dd, None, 64, None, stream, False)
        torch.cuda.synchronize()
        return dh0
    return dh0_of


@pytest.mark.parametrize("wg", ["1", "2"])
def test_wgmma_dh_scan_dh0_only_equals_the_full_run(wg, monkeypatch):
    """The dh0-only backward (the CP pre-pass: no input gradient, no dh or dVn stored) on the Hopper dh scan
    gives the full backward's dh0 bit for bit: the same chain of products, only the stores skipped. bf16 gdn,
    K = V = 128, packed sequences [0, 1, 64, 130, 300), one and two warpgroups per CTA."""
    _require_cuda_build()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma dh scan runs on compute capability 9.0 only")
    monkeypatch.setenv("DELTACP_TILED_DH_WGMMA", "1")
    monkeypatch.setenv("DELTACP_TILED_DH_WG", wg)
    dh0_of = _packed_dh0_run("gdn", seed=61, upstream_seed=5)
    full, only = dh0_of(True), dh0_of(False)
    assert torch.isfinite(full).all()
    assert torch.equal(only, full)


class _Switched:
    """A packed problem (K = V = 128 unless given; grouped value heads by default: H = 2, HV = 4) with h0, dht
    and do, for the
    tests that run the tiled tier with a kernel switch one way and the other: run(env, value) -> o, ht and every
    gradient with dh0 (the allocator's free blocks poisoned with NaN first, so an unwritten element shows);
    reference() -> the same from the fp64 reference on the rounded inputs."""

    def __init__(self, variant, dtype, cu_seqlens, seed, rng_seed, H=2, HV=4, K=128, V=128):
        self.variant, self.names = variant, input_names(variant)
        self.p = make_problem(variant, cu_seqlens=cu_seqlens, H=H, HV=HV, K=K, V=V, seed=seed)
        self.t = {n: torch.tensor(self.p[n], dtype=torch.float32 if n == "g" else dtype, device="cuda")
                  for n in self.names}
        rng = np.random.default_rng(rng_seed)
        n_seqs, tokens = len(cu_seqlens) - 1, cu_seqlens[-1]
        self.h0 = torch.tensor(rng.standard_normal((n_seqs, HV, K, V)) * 0.1, dtype=torch.float32, device="cuda")
        self.dht = torch.tensor(rng.standard_normal((n_seqs, HV, K, V)), dtype=torch.float32, device="cuda")
        self.do = torch.tensor(rng.standard_normal((1, tokens, HV, V)), dtype=dtype, device="cuda")
        self.cu = torch.tensor(self.p["cu_seqlens"], device="cuda")

    def run(self, monkeypatch, env, value):
        monkeypatch.setenv(env, value)
        _poison_cache(64 << 20)
        x = {n: v.clone().requires_grad_(True) for n, v in self.t.items()}
        h = self.h0.clone().requires_grad_(True)
        o, ht = _call(self.variant, x, initial_state=h, output_final_state=True, cu_seqlens=self.cu, backend="tiled")
        ((o.float() * self.do.float()).sum() + (ht * self.dht).sum()).backward()
        torch.cuda.synchronize()
        return {"o": o.detach(), "ht": ht.detach(), "dh0": h.grad, **{"d" + n: x[n].grad for n in self.names}}

    def kernels(self, monkeypatch, env, value):
        """The names of the CUDA kernels one run (forward and backward) launches with env at value."""
        return _kernels_launched(lambda: self.run(monkeypatch, env, value))

    def reference(self):
        rounded = dict(self.p, **{n: self.t[n].double().cpu().numpy() for n in self.names},
                       initial_state=self.h0.double().cpu().numpy())
        o, ht = ref_forward(ref, self.variant, rounded)
        grads = ref_backward(ref, self.variant, rounded, self.do.double().cpu().numpy(),
                             dht=self.dht.double().cpu().numpy())
        return dict(grads, o=o, ht=ht)


def _kda_gate_family_problem(dtype, gate_dtype, heads, gates, seed, rng_seed):
    """A _Switched kda problem over packed sequences of 1, 63, 64, 65 and 207 tokens with g in fp32 or the input
    dtype ("16bit"), and make_problem's mild gates or ("steep") every third block of 16 tokens decaying by 8 per
    token and key (diagonal blocks off the tensor cores)."""
    H, HV = heads
    s = _Switched("kda", dtype, [0, 1, 64, 128, 193, 400], seed=seed, rng_seed=rng_seed, H=H, HV=HV)
    if gate_dtype == "16bit":
        s.t["g"] = s.t["g"].to(dtype)
    if gates == "steep":
        tokens = s.t["g"].shape[1]
        steep = (torch.arange(tokens, device="cuda") // 16) % 3 == 1
        s.t["g"][:, steep] = -8.0
    s.p["g"] = s.t["g"].double().cpu().numpy()
    return s


def _assert_rerun_fp32_and_sliced_same_bits(s, monkeypatch, env, want, hand_offs):
    """With `env` at 1: a second run, the chunk-local kernel's hand-offs in fp32 (DELTACP_TILED_BWD_LOCAL16=0) and
    slices of two chunks (DELTACP_BWD_SLICE_CHUNKS=2) each give want's bits."""
    again = s.run(monkeypatch, env, "1")
    fp32 = s.run(monkeypatch, "DELTACP_TILED_BWD_LOCAL16", "0")
    monkeypatch.delenv("DELTACP_TILED_BWD_LOCAL16")
    sliced = s.run(monkeypatch, "DELTACP_BWD_SLICE_CHUNKS", "2")
    monkeypatch.delenv("DELTACP_BWD_SLICE_CHUNKS")
    for name, x in want.items():
        assert torch.equal(x, again[name]), f"{name}: a second run differs"
        assert torch.equal(x, fp32[name]), f"{name}: {hand_offs} in fp32 differ from 16 bits"
        assert torch.equal(x, sliced[name]), f"{name}: slices of two chunks differ"


def _assert_kda_switch_refusals(s, monkeypatch, env, gdn_reason, dtype, heads, seed, rng_seed):
    """A kda-only kernel switch `env`: a bad value raises naming it; "1" with fp32 inputs raises naming the dtypes
    the kernel takes, and "1" for gdn (the same packed problem) raises with gdn_reason."""
    with pytest.raises(ValueError, match=env):
        s.run(monkeypatch, env, "sometimes")
    monkeypatch.setenv(env, "1")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        _call("kda", {n: v.float().requires_grad_(True) for n, v in s.t.items()}, cu_seqlens=s.cu,
              backend="tiled")[0].sum().backward()
    H, HV = heads
    g = _Switched("gdn", dtype, [0, 1, 64, 128, 193, 400], seed=seed, rng_seed=rng_seed, H=H, HV=HV)
    with pytest.raises(ValueError, match=gdn_reason):
        g.run(monkeypatch, env, "1")


def _kernels_launched(fn):
    """The names of the CUDA kernels fn() launches, space-separated (torch.profiler): the way to tell two kernel
    paths apart where both give the same bits."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " ".join(e.name for e in prof.events())


def _assert_close(got, other, want, tol_other, tol_want, what):
    for name, x in got.items():
        assert torch.isfinite(x).all(), name
        err = rel_err(x.double().cpu().numpy(), other[name].double().cpu().numpy())
        assert err < tol_other, f"{name}: {what} {err:.2e}"
        err = rel_err(x.double().cpu().numpy(), np.asarray(want[name]))
        assert err < tol_want, f"{name}: vs the fp64 reference {err:.2e}"


@pytest.mark.parametrize("tier", ["tiled", "fused"])
def test_kda_scores_diagonal_blocks_on_both_paths(tier, monkeypatch):
    """bf16 kda's decayed scores (cuda/tiled/kda_scores.cuh): a diagonal 16 x 16 block goes through the tensor
    cores where its decay over 15 tokens keeps the scaled keys in range, element by element where it does not.
    Gates that put both kinds of block in one call (make_problem's mild ones, and every third block of 16 tokens
    decaying by 8 per token: 120 over the block): o, ht and every gradient (the backward's stage B0 shares the
    scores) against the fp64 reference, finite."""
    _require_cuda_build()
    from deltacp import _core

    if tier == "fused" and (not _core.cuda_supports("kda", "fused", False)
                            or torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("the fused tier runs on compute capability 9.0")
    s = _Switched("kda", torch.bfloat16, [0, 1, 100, 300], seed=41, rng_seed=5)
    tokens = s.t["g"].shape[1]
    steep = (torch.arange(tokens, device="cuda") // 16) % 3 == 1
    s.t["g"][:, steep] = -8.0
    s.p["g"] = s.t["g"].double().cpu().numpy()
    _poison_cache(64 << 20)
    x = {n: v.clone().requires_grad_(True) for n, v in s.t.items()}
    h = s.h0.clone().requires_grad_(True)
    o, ht = _call("kda", x, initial_state=h, output_final_state=True, cu_seqlens=s.cu, backend=tier)
    ((o.float() * s.do.float()).sum() + (ht * s.dht).sum()).backward()
    torch.cuda.synchronize()
    got = {"o": o.detach(), "ht": ht.detach(), "dh0": h.grad, **{"d" + n: x[n].grad for n in s.names}}
    want = s.reference()
    for name, value in got.items():
        assert torch.isfinite(value).all(), name
        err = rel_err(value.double().cpu().numpy(), np.asarray(want[name]))
        assert err < TOL[torch.bfloat16], f"{name}: {err:.2e} against the fp64 reference"


@pytest.mark.parametrize("tier", ["tiled", "fused"])
def test_kda_decay_stage_large_upstream_gradients_sum_diagonal_blocks_element_by_element(tier):
    """bf16 kda's backward stage B4 (inside the chunk-local kernel by default, cuda/tiled/bwd_local_kda_wgmma.cuh;
    apart, cuda/tiled/bwd_decay.cuh) takes a diagonal block onto the tensor cores only while its dP, dA and beta dA
    stay within kDiagGradMax (1e6): with do and dht scaled by 1e7 every block is summed element by element. The
    gradients then are 1e7 times those of the unscaled call to bf16 rounding (the two go through different sums of
    the same pairs), finite, and within tolerance of the fp64 reference."""
    _require_cuda_build()
    from deltacp import _core

    if tier == "fused" and (not _core.cuda_supports("kda", "fused", False)
                            or torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("the fused tier runs on compute capability 9.0")
    s = _Switched("kda", torch.bfloat16, [0, 1, 100, 300], seed=43, rng_seed=6)
    want = s.reference()

    def grads(scale):
        x = {n: v.clone().requires_grad_(True) for n, v in s.t.items()}
        h = s.h0.clone().requires_grad_(True)
        o, ht = _call("kda", x, initial_state=h, output_final_state=True, cu_seqlens=s.cu, backend=tier)
        ((o.float() * s.do.float()).sum() * scale + (ht * s.dht).sum() * scale).backward()
        torch.cuda.synchronize()
        return {"dh0": h.grad, **{"d" + n: x[n].grad for n in s.names}}

    plain, large = grads(1.0), grads(1e7)
    for name, value in large.items():
        assert torch.isfinite(value).all(), name
        err = rel_err(value.double().cpu().numpy() / 1e7, plain[name].double().cpu().numpy())
        assert err < 1e-2, f"{name}: {err:.2e} against the unscaled call"
        err = rel_err(value.double().cpu().numpy() / 1e7, np.asarray(want[name]))
        assert err < TOL[torch.bfloat16], f"{name}: {err:.2e} against the fp64 reference"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("gate16", [False, True], ids=["g_fp32", "g_16bit"])
@pytest.mark.parametrize("l2norm", [False, True], ids=["plain", "qk_l2norm"])
@pytest.mark.parametrize("K,V", [(128, 128), (128, 256), (64, 64)], ids=["K128", "V256", "K64"])
def test_fused_kda_prepare_kernel_matches_the_pair(dtype, gate16, l2norm, K, V, monkeypatch):
    """The fused forward's kda stage in one kernel (kda_prepare_kernel, DELTACP_FUSED_KDA_PREPARE) against the
    pair it replaces (=0: chunk_wy_kernel, then kda_chain_operands_kernel): o and ht bit for bit, at each shape
    of the fused tier, on packed sequences with short chunks, grouped value heads, the raw gate in fp32 or 16
    bits, with and without the in-kernel l2 norm, and gates that send some bf16 diagonal blocks element by
    element."""
    _require_cuda_build()
    from deltacp import _core

    if not _core.cuda_supports("kda", "fused", False) or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused tier runs on compute capability 9.0")
    s = _Switched("kda", dtype, [0, 1, 63, 64, 65, 300], seed=43, rng_seed=7, K=K, V=V)
    steep = (torch.arange(s.t["g"].shape[1], device="cuda") // 16) % 3 == 1
    s.t["g"][:, steep] = -8.0
    if gate16:
        s.t["g"] = s.t["g"].to(dtype)
    got = {}
    monkeypatch.setenv("DELTACP_FUSED_KDA_PREPARE_WGMMA", "0")  # (that stage is checked first: off here)
    for value in ("1", "0"):
        monkeypatch.setenv("DELTACP_FUSED_KDA_PREPARE", value)
        _poison_cache(64 << 20)
        o, ht = _call("kda", dict(s.t), initial_state=s.h0, output_final_state=True, cu_seqlens=s.cu,
                      use_qk_l2norm_in_kernel=l2norm, backend="fused")
        torch.cuda.synchronize()
        got[value] = (o, ht)
    assert torch.isfinite(got["1"][0]).all() and torch.isfinite(got["1"][1]).all()
    assert torch.equal(got["1"][0], got["0"][0]), "o: one kernel differs from the pair"
    assert torch.equal(got["1"][1], got["0"][1]), "ht: one kernel differs from the pair"


def _need_wgmma_kda_prepare():
    _require_cuda_build()
    from deltacp import _core

    if not _core.cuda_supports("kda", "fused", False) or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused tier's wgmma kda stage runs on compute capability 9.0")


def _kda_wgmma_problem(dtype, gate16, steep, heads, V=128):
    """_Switched kda problem for the wgmma kda stage's tests: sequences of 1, 63, 64, 65 and 207 tokens (short
    chunks), K = 128 (V = 128 unless given), g in fp32 or 16 bits; steep: every third block of 16 tokens decays by
    8 per token per key (its bf16 diagonal blocks leave the tensor cores' range and go element by element), and one
    block by 5."""
    H, HV = heads
    s = _Switched("kda", dtype, [0, 1, 64, 128, 193, 400], seed=97, rng_seed=19, H=H, HV=HV, V=V)
    if steep:
        tokens = s.t["g"].shape[1]
        blk = torch.arange(tokens, device="cuda") // 16
        s.t["g"][:, (blk % 3) == 1] = -8.0
        s.t["g"][:, blk == 9] = -5.0
    if gate16:
        s.t["g"] = s.t["g"].to(dtype)
    return s


def _kda_fused_call(s, monkeypatch, value, l2norm, q=None, k=None):
    monkeypatch.setenv("DELTACP_FUSED_KDA_PREPARE_WGMMA", value)
    _poison_cache(64 << 20)
    t = dict(s.t)
    if q is not None:
        t["q"], t["k"] = q, k
    with torch.no_grad():
        o, ht = _call("kda", t, initial_state=s.h0, output_final_state=True, cu_seqlens=s.cu,
                      use_qk_l2norm_in_kernel=l2norm, backend="fused")
    torch.cuda.synchronize()
    return o, ht


def _kda_reference_forward(s, l2norm):
    """fp64 reference forward on the rounded inputs (q, k normalised in fp64 first when l2norm)."""
    x = {n: s.t[n].double().cpu().numpy() for n in s.names}
    if l2norm:
        for n in ("q", "k"):
            x[n] = x[n] / np.sqrt((x[n] ** 2).sum(-1, keepdims=True) + 1e-6)
    rounded = dict(s.p, **x, initial_state=s.h0.double().cpu().numpy())
    return ref_forward(ref, "kda", rounded)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("gate16", [False, True], ids=["g_fp32", "g_16bit"])
@pytest.mark.parametrize("l2norm", [False, True], ids=["plain", "qk_l2norm"])
@pytest.mark.parametrize("steep", [False, True], ids=["mild", "steep"])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)], ids=["one_value_head", "grouped"])
@pytest.mark.parametrize("V", [128, 256], ids=["V128", "V256"])
def test_fused_kda_prepare_wgmma_matches_kda_prepare_kernel(dtype, gate16, l2norm, steep, heads, V, monkeypatch):
    """The fused forward's kda stage on wgmma (cuda/tiled/kda_prepare_wgmma.cuh, DELTACP_FUSED_KDA_PREPARE_WGMMA=1)
    against kda_prepare_kernel (=0) and the fp64 reference: o and ht, packed sequences of 1, 63, 64, 65 and 207
    tokens with h0, one or grouped value heads, V = 128 or 256 (U's second half after W), g in fp32 or 16 bits, with
    and without the in-kernel l2 norm, mild gates and steep ones (bf16 diagonal blocks element by element). The
    products accumulate in wgmma's order, so the two agree to 16-bit rounding, not bit for bit; a second run of the
    wgmma stage gives the same bits."""
    _need_wgmma_kda_prepare()
    s = _kda_wgmma_problem(dtype, gate16, steep, heads, V)
    o1, ht1 = _kda_fused_call(s, monkeypatch, "1", l2norm)
    o1b, ht1b = _kda_fused_call(s, monkeypatch, "1", l2norm)
    o0, ht0 = _kda_fused_call(s, monkeypatch, "0", l2norm)
    for x in (o1, ht1):
        assert torch.isfinite(x).all()
    assert torch.equal(o1, o1b) and torch.equal(ht1, ht1b), "the wgmma stage is not deterministic"
    assert rel_err(o1.double().cpu().numpy(), o0.double().cpu().numpy()) < 5e-3, "o: wgmma vs mma.sync stage"
    assert rel_err(ht1.double().cpu().numpy(), ht0.double().cpu().numpy()) < 5e-3, "ht: wgmma vs mma.sync stage"
    o_ref, ht_ref = _kda_reference_forward(s, l2norm)
    assert rel_err(o1.double().cpu().numpy(), o_ref) < 1e-2, "o vs the fp64 reference"
    assert rel_err(ht1.double().cpu().numpy(), ht_ref) < 1e-2, "ht vs the fp64 reference"


def test_fused_kda_prepare_wgmma_switch_values(monkeypatch):
    """DELTACP_FUSED_KDA_PREPARE_WGMMA: anything but 0 / 1 raises naming the variable; unset launches the wgmma
    stage on compute capability 9.0 and =0 kda_prepare_kernel (seen in the profiler: on these inputs the two can give
    the same bits); =1 ahead of DELTACP_FUSED_KDA_PREPARE=0 (the pair) still runs the wgmma stage (its bits)."""
    _need_wgmma_kda_prepare()
    s = _kda_wgmma_problem(torch.bfloat16, False, True, (2, 4))
    with pytest.raises(ValueError, match="DELTACP_FUSED_KDA_PREPARE_WGMMA"):
        _kda_fused_call(s, monkeypatch, "sometimes", False)
    o1, ht1 = _kda_fused_call(s, monkeypatch, "1", False)

    def kernels_run(value):  # the names of the CUDA kernels one fused forward launches with the switch at value
        if value is None:
            monkeypatch.delenv("DELTACP_FUSED_KDA_PREPARE_WGMMA", raising=False)
        else:
            monkeypatch.setenv("DELTACP_FUSED_KDA_PREPARE_WGMMA", value)
        with torch.no_grad():
            return _kernels_launched(lambda: _call("kda", dict(s.t), initial_state=s.h0, output_final_state=True,
                                                   cu_seqlens=s.cu, use_qk_l2norm_in_kernel=False, backend="fused"))

    unset, zero = kernels_run(None), kernels_run("0")
    assert "kda_prepare_wgmma_kernel" in unset, "unset is not the wgmma stage"
    assert "kda_prepare_wgmma_kernel" not in zero and "kda_prepare_kernel" in zero, "=0 still runs the wgmma stage"
    monkeypatch.setenv("DELTACP_FUSED_KDA_PREPARE", "0")
    o2, ht2 = _kda_fused_call(s, monkeypatch, "1", False)
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_kda_staged_forward_with_the_wgmma_stage(dtype, monkeypatch):
    """The staged fused forward (forward_prepare: the CP op's local forward) runs the same launch function: with
    DELTACP_FUSED_KDA_PREPARE_WGMMA=1, prepare (no h0) -> finish (h0) gives the one-shot fused forward's o and ht
    bit for bit, and agrees with the staged forward on kda_prepare_kernel (=0) to 16-bit rounding."""
    _need_wgmma_kda_prepare()
    from deltacp import _core

    t, h0, d, desc = _cuda_problem("kda", dtype, cu_seqlens=(0, 1, 64, 128, 193, 400), K=128, V=128)
    stream = torch.cuda.current_stream().cuda_stream

    def staged(value):
        monkeypatch.setenv("DELTACP_FUSED_KDA_PREPARE_WGMMA", value)
        _poison_cache(64 << 20)
        dd, o, ht = _forward_descs(t, d, desc, h0.shape, False)
        state = _core.staged_forward_prepare("kda", "fused", dd, None, 64, stream)
        dd["h0"] = d["h0"]
        _core.staged_forward_step(state, "finish", "kda", dd, None, 64, stream)
        torch.cuda.synchronize()
        return o, ht

    monkeypatch.setenv("DELTACP_FUSED_KDA_PREPARE_WGMMA", "1")
    one, one_o, one_ht = _forward_descs(t, d, desc, h0.shape, True)
    _core.run("forward", "kda", "fused", "float32", one, None, 64, None, stream, False)
    torch.cuda.synchronize()
    o1, ht1 = staged("1")
    o0, ht0 = staged("0")
    assert torch.isfinite(o1).all() and torch.isfinite(ht1).all()
    assert torch.equal(o1, one_o) and torch.equal(ht1, one_ht)
    assert rel_err(o1.double().cpu().numpy(), o0.double().cpu().numpy()) < 5e-3
    assert rel_err(ht1.double().cpu().numpy(), ht0.double().cpu().numpy()) < 5e-3


@pytest.mark.parametrize("variant", ["gdn", "delta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("K,V", [(128, 128), (128, 256), (64, 64)])
def test_wgmma_wy_stage_matches_the_mma_sync_one(variant, dtype, K, V, monkeypatch):
    """The Hopper WY stage (cuda/tiled/wy_wgmma.cuh, DELTACP_TILED_WY_WGMMA) in the tiled forward and in the
    backward's recompute (where it also writes T for stage B3 and, at K = V = 128, does stage B0, scale P^T dO) against
    the mma.sync stage and B0 (=0) and the fp64 reference: o, ht, every gradient and dh0, packed sequences of 1, 63,
    64, 65 and 207 tokens (short chunks), grouped value heads, K = V = 128, K = 128 with V = 256 (U in two rounds of
    128 columns) and K = V = 64, a non-zero dht."""
    _require_cuda_build()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma WY stage runs on compute capability 9.0 only")
    s = _Switched(variant, dtype, [0, 1, 64, 128, 193, 400], seed=87, rng_seed=13, K=K, V=V)
    env = "DELTACP_TILED_WY_WGMMA"
    _assert_close(s.run(monkeypatch, env, "1"), s.run(monkeypatch, env, "0"), s.reference(), 5e-3, 1e-2,
                  "wgmma WY vs mma.sync WY")
    with pytest.raises(ValueError, match=env):
        s.run(monkeypatch, env, "sometimes")
    monkeypatch.setenv(env, "1")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        _call(variant, {n: v.float() for n, v in s.t.items()}, cu_seqlens=s.cu, backend="tiled")


@pytest.mark.parametrize("variant", ["gdn", "delta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)], ids=["one_value_head", "grouped"])
def test_fused_local_backward_matches_the_three_stages(variant, dtype, heads, monkeypatch):
    """Stages B2, B3 and B4 of the tiled backward as one Hopper kernel (cuda/tiled/bwd_local_wgmma.cuh,
    DELTACP_TILED_BWD_LOCAL_WGMMA) against the three mma.sync kernels (=0) and the fp64 reference: o, ht, every
    gradient and dh0; packed sequences of 1, 63, 64, 65 and 207 tokens (short chunks), a non-zero dht; with one
    value head per key head (the kernel writes dq and dk) and grouped value heads (stage B5 sums them). Then
    the same run in slices of two chunks (DELTACP_BWD_SLICE_CHUNKS: the chunk states' tensor maps start at each
    slice) and a second run give the same bits."""
    _require_cuda_build()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused chunk-local backward runs on compute capability 9.0 only")
    H, HV = heads
    s = _Switched(variant, dtype, [0, 1, 64, 128, 193, 400], seed=91, rng_seed=17, H=H, HV=HV)
    env = "DELTACP_TILED_BWD_LOCAL_WGMMA"
    fused = s.run(monkeypatch, env, "1")
    _assert_close(fused, s.run(monkeypatch, env, "0"), s.reference(), 5e-3, 1e-2, "fused B2-B4 vs mma.sync B2, B3, B4")
    again = s.run(monkeypatch, env, "1")
    monkeypatch.setenv("DELTACP_BWD_SLICE_CHUNKS", "2")
    sliced = s.run(monkeypatch, env, "1")
    for name, x in fused.items():
        assert torch.equal(x, again[name]), f"{name}: a second run differs"
        assert torch.equal(x, sliced[name]), f"{name}: slices of two chunks differ"
    with pytest.raises(ValueError, match=env):
        s.run(monkeypatch, env, "often")
    monkeypatch.setenv(env, "1")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        _call(variant, {n: v.float().requires_grad_(True) for n, v in s.t.items()}, cu_seqlens=s.cu,
              backend="tiled")[0].sum().backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("gate_dtype", ["fp32", "16bit"])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)], ids=["one_value_head", "grouped"])
@pytest.mark.parametrize("gates", ["mild", "steep"])
def test_kda_local_backward_matches_the_two_stages(dtype, gate_dtype, heads, gates, monkeypatch):
    """kda's stages B2 and B3 of the tiled backward as one Hopper kernel (cuda/tiled/bwd_local_kda_wgmma.cuh,
    DELTACP_TILED_BWD_LOCAL_KDA=1), feeding stage B4 the buffers B2 and B3 feed it, against the two mma.sync kernels
    (=0) and the fp64 reference: o, ht, every gradient and dh0; packed sequences of 1, 63, 64, 65 and 207 tokens
    (short chunks), a non-zero dht; g in fp32 or in the input dtype (dg comes back in g's dtype); one value head per
    key head and grouped value heads (stage B5 sums them); make_problem's mild gates, or every third block of 16
    tokens decaying by 8 per token and key. Summation orders differ from the mma.sync kernels', so the two agree
    within tolerance, not bit for bit. Then: unset equals =1 bit for bit (the default), a second run, a run in slices of
    two chunks (DELTACP_BWD_SLICE_CHUNKS) and dVn handed over in 16 bits or fp32 (DELTACP_TILED_BWD_LOCAL16) give
    the same bits; a bad value, fp32 inputs and gdn with =1 raise naming why."""
    _require_cuda_build()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kda chunk-local backward runs on compute capability 9.0 only")
    s = _kda_gate_family_problem(dtype, gate_dtype, heads, gates, seed=97, rng_seed=29)
    env = "DELTACP_TILED_BWD_LOCAL_KDA"
    local = s.run(monkeypatch, env, "1")
    off = s.run(monkeypatch, env, "0")
    assert local["dg"].dtype == s.t["g"].dtype
    _assert_close(local, off, s.reference(), 5e-3, 1e-2, "kda chunk-local B2-B3 vs mma.sync B2, B3")
    monkeypatch.delenv(env)
    default = s.run(monkeypatch, "DELTACP_BWD_SLICE_CHUNKS", "0")  # 0: the slicing heuristic, as unset
    for name, x in local.items():
        assert torch.equal(x, default[name]), f"{name}: unset differs from =1 (the kernel is the default)"
    _assert_rerun_fp32_and_sliced_same_bits(s, monkeypatch, env, local, "dVn")
    _assert_kda_switch_refusals(s, monkeypatch, env, "per-key gate", dtype, heads, seed=97, rng_seed=29)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)], ids=["one_value_head", "grouped"])
@pytest.mark.parametrize("gates", ["mild", "steep"])
def test_kda_local_backward_with_stage_b4_matches_b4_apart(dtype, heads, gates, monkeypatch):
    """Stage B4 inside kda's chunk-local kernel (DELTACP_TILED_BWD_LOCAL_KDA_DECAY=1: dq, dk, dg and dbeta final
    there, no dP, dA or fp32 parts in global memory) against B4 as its own kernel (=0) and the fp64 reference: o,
    ht, every gradient and dh0 on packed sequences of 1, 63, 64, 65 and 207 tokens with a non-zero dht, one value
    head per key head and grouped value heads (stage B5 sums them), make_problem's mild gates and steep ones (every
    third block of 16 tokens decaying by 8 per token and key: those diagonal blocks summed element by element).
    Then: unset gives =1's bits for bf16 and =0's for fp16 (the defaults), a second run, fp32 hand-offs and slices
    of two chunks give the same bits, and a bad value raises naming the switch."""
    _require_cuda_build()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kda chunk-local backward runs on compute capability 9.0 only")
    s = _kda_gate_family_problem(dtype, "fp32", heads, gates, seed=101, rng_seed=31)
    env = "DELTACP_TILED_BWD_LOCAL_KDA_DECAY"
    inside = s.run(monkeypatch, env, "1")
    apart = s.run(monkeypatch, env, "0")
    _assert_close(inside, apart, s.reference(), 5e-3, 1e-2, "B4 inside the chunk-local kernel vs apart")
    monkeypatch.delenv(env)
    default = s.run(monkeypatch, "DELTACP_BWD_SLICE_CHUNKS", "0")  # 0: the slicing heuristic, as unset
    monkeypatch.delenv("DELTACP_BWD_SLICE_CHUNKS")
    want = inside if dtype == torch.bfloat16 else apart
    for name, x in want.items():
        assert torch.equal(x, default[name]), f"{name}: unset differs from the default for {dtype}"
    _assert_rerun_fp32_and_sliced_same_bits(s, monkeypatch, env, inside, "dVn")
    with pytest.raises(ValueError, match=env):
        s.run(monkeypatch, env, "sometimes")


@pytest.mark.parametrize("variant", ["gdn", "kda", "delta"])
def test_b1_beside_the_chunk_local_kernel_gives_the_same_bits(variant, monkeypatch):
    """Stage B1 beside the chunk-local kernel, chunk by chunk (DELTACP_TILED_BWD_HANDOFF=1, bwd_handoff.cuh: B1 on
    the side stream counts each chunk done, the chunk-local kernel walks the chunks in B1's order and waits for
    each) against one after the other (=0): o, ht, every gradient and dh0 bit for bit, three runs, and against the
    fp64 reference; on three packed sequences of 300 tokens (five chunks each, the last of 44 tokens), bf16, one
    value head per key head, non-zero dht. Unset runs it (the gate kernel is launched) and gives the same bits.
    =1 raises naming why where it cannot run: sequences of unequal chunk counts, grouped value heads."""
    _require_cuda_build()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the chunk-local kernel and the wgmma B1 run on compute capability 9.0 only")
    env = "DELTACP_TILED_BWD_HANDOFF"
    s = _Switched(variant, torch.bfloat16, [0, 300, 600, 900], seed=211, rng_seed=41, H=2, HV=2)
    apart = s.run(monkeypatch, env, "0")
    _assert_close(apart, apart, s.reference(), 1.0, 1e-2, "one after the other")
    assert "b1_started_gate" not in s.kernels(monkeypatch, env, "0")
    for _ in range(3):
        beside = s.run(monkeypatch, env, "1")
        for name, x in apart.items():
            assert torch.equal(x, beside[name]), f"{name}: B1 beside the chunk-local kernel differs"
    monkeypatch.delenv(env)
    assert "b1_started_gate" in s.kernels(monkeypatch, "DELTACP_BWD_SLICE_CHUNKS", "0")
    default = s.run(monkeypatch, "DELTACP_BWD_SLICE_CHUNKS", "0")
    monkeypatch.delenv("DELTACP_BWD_SLICE_CHUNKS")
    for name, x in apart.items():
        assert torch.equal(x, default[name]), f"{name}: unset differs"
    with pytest.raises(ValueError, match=env):
        s.run(monkeypatch, env, "sometimes")
    unequal = _Switched(variant, torch.bfloat16, [0, 1, 64, 128, 193, 400], seed=211, rng_seed=41, H=2, HV=2)
    with pytest.raises(ValueError, match="same number of chunks"):
        unequal.run(monkeypatch, env, "1")
    grouped = _Switched(variant, torch.bfloat16, [0, 300, 600], seed=211, rng_seed=41, H=2, HV=4)
    with pytest.raises(ValueError, match="buffers of their own"):
        grouped.run(monkeypatch, env, "1")


@pytest.mark.parametrize("variant", ["gdn", "delta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("piece", ["0", "128"], ids=["whole_b1", "b1_in_pieces"])
@pytest.mark.parametrize("wg", ["1", "2"], ids=["b1_one_warpgroup", "b1_two_warpgroups"])
def test_local_inputs_in_16_bits_give_the_same_bits(variant, dtype, piece, wg, monkeypatch):
    """dVn (from B1) and T (from the WY stage) handed to the chunk-local kernel in 16 bits over their own fp32
    bytes (DELTACP_TILED_BWD_LOCAL16=1, tiled_bwd.cu local_inputs_16bit): o, ht, every gradient and dh0 bit for
    bit those of the fp32 hand-offs (=0), since the local kernel rounds both to the input dtype for its products
    either way; the Hopper dh scan, WY stage and chunk-local kernel required (=1: a fallback fails), B1 with one
    and two warpgroups per CTA (DELTACP_TILED_DH_WG), whole and in pieces of 128 tokens,
    the local stage whole and in slices of two chunks, packed sequences of 1, 63, 64, 65 and 207 tokens, grouped
    value heads. fp32 inputs (no local kernel there) with =1 raise naming the switch."""
    _require_cuda_build()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper dh scan and chunk-local kernel run on compute capability 9.0 only")
    monkeypatch.setenv("DELTACP_TILED_DH_PIECE", piece)
    monkeypatch.setenv("DELTACP_TILED_DH_WG", wg)
    for required in ("DELTACP_TILED_DH_WGMMA", "DELTACP_TILED_WY_WGMMA", "DELTACP_TILED_BWD_LOCAL_WGMMA"):
        monkeypatch.setenv(required, "1")
    s = _Switched(variant, dtype, [0, 1, 64, 128, 193, 400], seed=95, rng_seed=23)
    env = "DELTACP_TILED_BWD_LOCAL16"
    half, full = s.run(monkeypatch, env, "1"), s.run(monkeypatch, env, "0")
    for name, x in half.items():
        assert torch.equal(x, full[name]), f"{name}: the 16-bit hand-offs differ"
    _assert_close(half, full, s.reference(), 1e-12, TOL[torch.bfloat16], "16-bit vs fp32 hand-offs")
    monkeypatch.setenv("DELTACP_BWD_SLICE_CHUNKS", "2")
    sliced = s.run(monkeypatch, env, "1")
    for name, x in half.items():
        assert torch.equal(x, sliced[name]), f"{name}: slices of two chunks differ"
    with pytest.raises(ValueError, match=env):
        s.run(monkeypatch, env, "half")
    for required in ("DELTACP_TILED_DH_WGMMA", "DELTACP_TILED_WY_WGMMA", "DELTACP_TILED_BWD_LOCAL_WGMMA"):
        monkeypatch.delenv(required)
    monkeypatch.setenv(env, "1")
    with pytest.raises(ValueError, match=env):
        _call(variant, {n: v.float().requires_grad_(True) for n, v in s.t.items()}, cu_seqlens=s.cu,
              backend="tiled")[0].sum().backward()


@pytest.mark.parametrize("variant", ["gdn", "kda", "delta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("piece", ["0", "128"], ids=["whole_b1", "b1_in_pieces"])
def test_state_scan_beside_b1_gives_the_same_bits(variant, dtype, piece, monkeypatch):
    """The one-shot tiled backward runs the recompute's state scan beside B1 (B1 on a second stream; U and dh in
    their own bytes; DELTACP_TILED_BWD_BESIDE, on by default): o, ht, every gradient and dh0 bit for bit those of
    the two in order on one stream (=0), and within tolerance of the fp64 reference; B1 whole and in pieces of
    128 tokens (DELTACP_TILED_DH_PIECE), packed sequences of 1, 63, 64, 65 and 207 tokens, grouped value heads."""
    _require_cuda_build()
    monkeypatch.setenv("DELTACP_TILED_DH_PIECE", piece)
    s = _Switched(variant, dtype, [0, 1, 64, 128, 193, 400], seed=93, rng_seed=19)
    env = "DELTACP_TILED_BWD_BESIDE"
    beside, in_order = s.run(monkeypatch, env, "1"), s.run(monkeypatch, env, "0")
    for name, x in beside.items():
        assert torch.equal(x, in_order[name]), f"{name}: beside B1 differs from in order"
    _assert_close(beside, in_order, s.reference(), 1e-12, TOL[dtype], "beside vs in order")
    monkeypatch.delenv(env)
    default = s.run(monkeypatch, "DELTACP_TILED_DH_PIECE", piece)
    for name, x in beside.items():
        assert torch.equal(x, default[name]), f"{name}: the default differs from beside B1"
    with pytest.raises(ValueError, match=env):
        s.run(monkeypatch, env, "both")


@pytest.mark.parametrize("variant", ["gdn", "kda", "delta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dh_scan_in_pieces_matches_the_whole_scan(variant, dtype, monkeypatch):
    """Stage B1 in pieces (intra-card CP of the reverse chain, tiled_bwd.cu launch_dh_scan_in_pieces): pieces
    of 128 tokens (DELTACP_TILED_DH_PIECE) against the whole-sequence scan (=0) and the fp64 reference, every
    gradient and dh0, with a non-zero dht: packed sequences of 1, 149, 150 and 400 tokens (cut into 1, 2, 2 and
    4 pieces, the last ones short), grouped value heads, K = V = 128."""
    _require_cuda_build()
    s = _Switched(variant, dtype, [0, 1, 150, 300, 700], seed=71, rng_seed=9)
    env = "DELTACP_TILED_DH_PIECE"
    _assert_close(s.run(monkeypatch, env, "128"), s.run(monkeypatch, env, "0"), s.reference(),
                  5e-3 if dtype == torch.bfloat16 else 1e-5, TOL[dtype], "B1 in pieces vs whole")
    with pytest.raises(ValueError, match=env):
        s.run(monkeypatch, env, "lots")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("gate_dtype", ["fp32", "16bit"])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)], ids=["one_value_head", "grouped"])
@pytest.mark.parametrize("gates", ["mild", "steep"])
def test_kda_wgmma_recompute_matches_the_three_kernels(dtype, gate_dtype, heads, gates, monkeypatch):
    """kda's backward recompute on Hopper's warpgroup products (cuda/tiled/kda_prepare_wgmma.cuh in its backward
    mode, DELTACP_TILED_BWD_KDA_RECOMPUTE_WGMMA=1: G of every row, W, U, Kd, T, Q e^G and stage B0's scale P^T dO in
    one kernel) against the gate cumsum, chunk_wy_kernel and B0 (=0) and the fp64 reference: every gradient and dh0;
    packed sequences of 1, 63, 64, 65 and 207 tokens (short chunks), a non-zero dht and h0; g in fp32 or in the input
    dtype; one value head per key head and grouped value heads; make_problem's mild gates, or every third block of
    16 tokens decaying by 8 per token and key (diagonal blocks off the tensor cores). The products accumulate in
    wgmma's k order (the GPU has given the same bits as =0; the test asks only for agreement within tolerance and
    tells the paths apart by the kernels launched); o and ht (the forward, untouched) are the same bits. Then: unset
    launches the recompute and gives =1's bits (the default on Hopper), and a second run, slices of two chunks
    (DELTACP_BWD_SLICE_CHUNKS), T and dVn handed to the chunk-local kernel in fp32 (DELTACP_TILED_BWD_LOCAL16=0) give
    the same bits; the mma.sync B2 / B3 (DELTACP_TILED_BWD_LOCAL_KDA=0, reading this kernel's fp32 T) and B1 in
    pieces of 128 tokens agree within tolerance; a bad value, and fp32 inputs or gdn with =1, raise naming why."""
    _require_cuda_build()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kda recompute runs on compute capability 9.0 only")
    s = _kda_gate_family_problem(dtype, gate_dtype, heads, gates, seed=101, rng_seed=37)
    env = "DELTACP_TILED_BWD_KDA_RECOMPUTE_WGMMA"
    on = s.run(monkeypatch, env, "1")
    off = s.run(monkeypatch, env, "0")
    assert on["dg"].dtype == s.t["g"].dtype
    want = s.reference()
    _assert_close(on, off, want, 5e-3, 1e-2, "wgmma recompute vs cumsum + chunk_wy + B0")
    assert torch.equal(on["o"], off["o"]) and torch.equal(on["ht"], off["ht"]), "the forward changed"
    # On these inputs the two paths can give the same bits (the same products in the same k order), so the
    # profiler tells them apart: =1 launches the prepare kernel in its backward mode and none of the three kernels
    names_on, names_off = s.kernels(monkeypatch, env, "1"), s.kernels(monkeypatch, env, "0")
    assert re.search(r"kda_prepare_wgmma_kernel<[^>]*, true>", names_on), "=1 did not run the wgmma recompute"
    assert "bwd_dv_local_kernel" not in names_on and "bwd_dv_local_kernel" in names_off, "B0 ran with =1"
    assert not re.search(r"kda_prepare_wgmma_kernel<[^>]*, true>", names_off), "=0 ran the wgmma recompute"
    monkeypatch.delenv(env)
    unset = s.run(monkeypatch, "DELTACP_BWD_SLICE_CHUNKS", "0")  # 0: the slicing heuristic, as unset
    names_unset = s.kernels(monkeypatch, "DELTACP_BWD_SLICE_CHUNKS", "0")
    monkeypatch.delenv("DELTACP_BWD_SLICE_CHUNKS")
    assert re.search(r"kda_prepare_wgmma_kernel<[^>]*, true>", names_unset), "unset is not the wgmma recompute"
    for name, x in on.items():
        assert torch.equal(x, unset[name]), f"{name}: unset differs from =1 (the default on Hopper)"
    _assert_rerun_fp32_and_sliced_same_bits(s, monkeypatch, env, on, "T and dVn")
    two_stages = s.run(monkeypatch, "DELTACP_TILED_BWD_LOCAL_KDA", "0")
    monkeypatch.delenv("DELTACP_TILED_BWD_LOCAL_KDA")
    _assert_close(two_stages, on, want, 5e-3, 1e-2, "mma.sync B2, B3 on the wgmma recompute")
    pieces = s.run(monkeypatch, "DELTACP_TILED_DH_PIECE", "128")
    monkeypatch.delenv("DELTACP_TILED_DH_PIECE")
    _assert_close(pieces, on, want, 5e-3, 1e-2, "B1 in pieces on the wgmma recompute")
    _assert_kda_switch_refusals(s, monkeypatch, env, "implements kda", dtype, heads, seed=101, rng_seed=37)


@pytest.mark.parametrize("value", ["0", "1"])
def test_kda_wgmma_recompute_dh0_only_equals_the_full_run(value, monkeypatch):
    """The dh0-only kda backward (the CP pre-pass: stages B0 and B1 only) with the wgmma recompute on (=1) and off
    (=0) gives the full backward's dh0 bit for bit (the same recompute and B1, only stores skipped), and the two
    settings agree within tolerance. bf16, K = V = 128, packed sequences [0, 1, 64, 130, 300), grouped value heads."""
    _require_cuda_build()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kda recompute runs on compute capability 9.0 only")
    run = _packed_dh0_run("kda", seed=63, upstream_seed=7)

    def dh0_of(with_grads, setting):
        monkeypatch.setenv("DELTACP_TILED_BWD_KDA_RECOMPUTE_WGMMA", setting)
        _poison_cache(64 << 20)
        return run(with_grads)

    full, only = dh0_of(True, value), dh0_of(False, value)
    assert torch.isfinite(full).all()
    assert torch.equal(only, full)
    other = dh0_of(False, "1" if value == "0" else "0")
    assert rel_err(only.double().cpu().numpy(), other.double().cpu().numpy()) < 5e-3
