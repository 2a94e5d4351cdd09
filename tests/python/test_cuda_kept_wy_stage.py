"""The token-parallel (WY) stage that the fused forward keeps for the backward (Params::wy_stage, WyStagePlanes in
deltacp/params.h; deltacp._library._new_wy_stage), for kda and gdn: what the forward writes into its planes against a
torch telling of the same quantities, gradients through the kept stage (the backward runs stage B0 alone) against the
backward that recomputes the stage (kda bit for bit), the forward's report of whether it wrote the stage, and the
errors of calls that pass it where no kernel writes or reads it. Skipped without a CUDA device, and on a GPU that is
not compute capability 9.0 (the stage is kept only where the fused forward's wgmma stage runs)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
from deltacp import _library  # noqa: E402
from deltacp.errors import InvalidArgumentError  # noqa: E402
from deltacp_testutil import input_names, make_problem, rel_err  # noqa: E402

# WyStagePlanes::of(variant): each plane's start and width in 16-bit elements per token row and value head.
PLANES = {
    "kda": {"G": (0, 256), "T": (256, 128), "W": (384, 128), "Kd": (512, 128), "Qg": (640, 128), "P": (768, 64)},
    "gdn": {"G": (0, 8), "T": (8, 128), "W": (136, 128), "P": (264, 64)},
}
TOTAL = {"kda": 832, "gdn": 328}
OPS = {"kda": deltacp.chunk_kda, "gdn": deltacp.chunk_gated_delta_rule}


def _need():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not deltacp.built_with_cuda() or not deltacp._core.cuda_supports("kda", "fused", False):
        pytest.fail("a CUDA device is present but this build has no fused tier")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the stage is kept where the fused forward's wgmma stage runs: compute capability 9.0")


# (B, T, H, HV, cu_seqlens): fixed lengths past a chunk boundary, grouped values, packed varlen with sequences of
# one token and an empty one.
CASES = {
    "fixed": (2, 200, 2, 2, None),
    "grouped": (1, 130, 1, 3, None),
    "varlen": (1, None, 2, 2, [0, 1, 17, 81, 145, 145, 146, 400]),
}


def _tensors(variant, case, dtype=torch.bfloat16, grad=False, seed=5):
    B, T, H, HV, cu = CASES[case]
    p = make_problem(variant, B=B, T=T or 1, H=H, HV=HV, K=128, V=128, cu_seqlens=cu, seed=seed)
    t = {n: torch.tensor(p[n], dtype=torch.float32 if n == "g" else dtype, device="cuda", requires_grad=grad)
         for n in input_names(variant)}
    h0 = torch.tensor(p["initial_state"], dtype=torch.float32, device="cuda", requires_grad=grad)
    cu_t = None if cu is None else torch.tensor(cu, device="cuda")
    return t, h0, cu_t


def _plane(stage, variant, name, rows):
    start, width = PLANES[variant][name]
    x = stage[start * rows:(start + width) * rows]
    if name in ("G", "T"):  # fp32 planes
        return x.view(torch.float32).view(rows, width // 2)
    return x.view(rows, width)


@pytest.mark.parametrize("variant", ["kda", "gdn"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_forward_fills_the_wy_stage(variant, case):
    """Every plane of the kept stage is written for every token (no NaN left) and holds what it names: G the
    within-chunk cumulative sum of g (fp32), for kda Q e^G and K e^(G_n - G) from q, k and G, P zero right of each
    chunk's block diagonal (kda) or of its diagonal (gdn), T with a unit diagonal; the forward reports that it wrote
    the stage."""
    _need()
    t, h0, cu = _tensors(variant, case)
    cu_host = None if cu is None else cu.cpu()
    cfg = _library._config(variant, "fused", "tiled", t["q"], None, 64, False, cu, cu_host)
    kept = _library._kept_states(cfg, t["q"], t["v"])
    stage = _library._new_wy_stage(cfg, t["q"], t["v"])
    assert kept is not None and stage is not None and stage.numel() % TOTAL[variant] == 0
    stage.fill_(float("nan"))
    _library._forward(cfg, t["q"], t["k"], t["v"], t["g"], t["beta"], None, None, h0, kept + (stage,))
    torch.cuda.synchronize()
    assert deltacp._core.cuda_last_forward_kept_wy_stage()
    B, T, H, HV = t["q"].shape[0], t["q"].shape[1], t["q"].shape[2], t["v"].shape[2]
    rows = B * T * HV
    kda = variant == "kda"
    G = _plane(stage, variant, "G", rows)
    G = G.view(B, T, HV, 128) if kda else G.flatten()[:rows].view(B, T, HV)
    Tm = _plane(stage, variant, "T", rows)[:, :32].contiguous().view(t["q"].dtype).view(B, T, HV, 64)
    W = _plane(stage, variant, "W", rows).view(B, T, HV, 128)
    P = _plane(stage, variant, "P", rows).view(B, T, HV, 64)
    named = {"G": G, "T": Tm, "W": W, "P": P}
    if kda:
        named["Kd"] = _plane(stage, variant, "Kd", rows).view(B, T, HV, 128)
        named["Qg"] = _plane(stage, variant, "Qg", rows).view(B, T, HV, 128)
    for name, x in named.items():
        assert not torch.isnan(x.float()).any(), f"{name}: elements the forward never wrote"
    bounds = [0, T] if cu is None else cu_host.tolist()
    group = HV // H
    for b in range(B):
        for s in range(len(bounds) - 1):
            for c0 in range(bounds[s], bounds[s + 1], 64):
                c1 = min(c0 + 64, bounds[s + 1])
                Gr = torch.cumsum(t["g"][b, c0:c1].double(), dim=0)
                assert torch.allclose(G[b, c0:c1].double(), Gr, rtol=1e-5, atol=1e-5), (b, c0)
                if kda:
                    qh = t["q"][b, c0:c1].double().repeat_interleave(group, dim=1)
                    kh = t["k"][b, c0:c1].double().repeat_interleave(group, dim=1)
                    Qg, Kd = named["Qg"][b, c0:c1].double(), named["Kd"][b, c0:c1].double()
                    assert rel_err(Qg.cpu(), (qh * Gr.exp()).cpu()) < 1e-2, (b, c0)
                    assert rel_err(Kd.cpu(), (kh * (Gr[-1:] - Gr).exp()).cpu()) < 1e-2, (b, c0)
                n = c1 - c0
                i = torch.arange(n, device="cuda")
                Pc = P[b, c0:c1, :, :n].float().permute(1, 0, 2)  # [HV, row, column]
                above = (i[None, :] // 16 > i[:, None] // 16) if kda else (i[None, :] > i[:, None])
                assert (Pc[:, above] == 0).all(), (b, c0)
                Tc = Tm[b, c0:c1, :, :n].float()
                assert torch.allclose(Tc[i, :, i], torch.ones_like(Tc[i, :, i]), atol=1e-2), (b, c0)


def _grads(variant, t, h0, cu, seed=11):
    """o and the gradients of every input of one eager call on the fused forward and the tiled backward, and
    whether the forward wrote the WY stage."""
    rng = np.random.default_rng(seed)
    o, ht = OPS[variant](*(t[n] for n in input_names(variant)), initial_state=h0, output_final_state=True,
                         cu_seqlens=cu, backend="fused")
    wrote = deltacp._core.cuda_last_forward_kept_wy_stage()
    do = torch.tensor(rng.standard_normal(o.shape), dtype=o.dtype, device="cuda")
    dht = torch.tensor(rng.standard_normal(ht.shape), dtype=torch.float32, device="cuda")
    xs = [t[n] for n in input_names(variant)] + [h0]
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(), xs)
    torch.cuda.synchronize()
    return [o.detach()] + list(grads), wrote


@pytest.mark.parametrize("variant", ["kda", "gdn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_through_the_kept_stage_match_the_recompute(variant, case, dtype, monkeypatch):
    """The backward that reads the forward's kept stage and runs stage B0 alone gives the gradients of the backward
    that recomputes the stage (DELTACP_KEEP_WY_STAGE=0). kda bit for bit: the same kernel writes the same planes in
    both, and B0's products run on the same operands. gdn within 2e-3: B0's product is split into two m64n64
    products per k-step where the recompute makes one m64n128, which may sum in another order."""
    _need()
    t, h0, cu = _tensors(variant, case, dtype=dtype, grad=True)
    monkeypatch.setenv("DELTACP_KEEP_WY_STAGE", "0")
    recomputed, wrote = _grads(variant, t, h0, cu)
    assert not wrote
    monkeypatch.setenv("DELTACP_KEEP_WY_STAGE", "1")
    kept, wrote = _grads(variant, t, h0, cu)
    assert wrote, "the fused forward did not keep the WY stage"
    for name, x, y in zip(["o"] + input_names(variant) + ["h0"], kept, recomputed):
        assert not torch.isnan(x).any(), name
        if variant == "kda":
            assert torch.equal(x, y), f"d{name} differs with the kept WY stage"
        else:
            assert rel_err(x.float().cpu(), y.float().cpu()) < 2e-3, f"d{name}"


def test_a_forward_that_cannot_keep_the_stage_says_so(monkeypatch):
    """Where the fused forward's kda stage runs on the mma.sync kernel (DELTACP_FUSED_KDA_PREPARE_WGMMA=0) it writes
    no stage and reports so; the backward then recomputes, and the gradients are those of a call that kept none."""
    _need()
    t, h0, cu = _tensors("kda", "fixed", grad=True)
    monkeypatch.setenv("DELTACP_FUSED_KDA_PREPARE_WGMMA", "0")
    monkeypatch.setenv("DELTACP_KEEP_WY_STAGE", "0")
    recomputed, _ = _grads("kda", t, h0, cu)
    monkeypatch.setenv("DELTACP_KEEP_WY_STAGE", "1")
    kept, wrote = _grads("kda", t, h0, cu)
    assert not wrote
    for name, x, y in zip(["o"] + input_names("kda") + ["h0"], kept, recomputed):
        assert torch.equal(x, y), name


def test_the_wy_stage_is_refused_where_no_kernel_uses_it():
    """A stage without the per-chunk states, of the wrong size, or for delta fails naming wy_stage."""
    _need()
    t, h0, _ = _tensors("kda", "fixed")
    cfg = _library._config("kda", "fused", "tiled", t["q"], None, 64, False, None, None)
    h, vn = _library._kept_states(cfg, t["q"], t["v"])
    stage = _library._new_wy_stage(cfg, t["q"], t["v"])
    descs = _library._input_descs(cfg, t["q"], t["k"], t["v"], t["g"], t["beta"], None, None, h0)
    descs["o"] = _library.torch_desc(torch.empty_like(t["v"]), "o")
    descs["wy_stage"] = _library.torch_desc(stage, "wy_stage")
    with pytest.raises(InvalidArgumentError, match="wy_stage.*chunk_h"):
        _library._run(cfg, "forward", "fused", descs)
    with pytest.raises(InvalidArgumentError, match="wy_stage.*expected shape"):
        _library._forward(cfg, t["q"], t["k"], t["v"], t["g"], t["beta"], None, None, h0, (h, vn, stage[1:]))
    p = make_problem("delta", B=2, T=200, H=2, K=128, V=128, seed=3)
    td = {n: torch.tensor(p[n], dtype=torch.bfloat16, device="cuda") for n in input_names("delta")}
    cfg_d = _library._config("delta", "fused", "tiled", td["q"], None, 64, False, None, None)
    hd, vnd = _library._kept_states(cfg_d, td["q"], td["v"])
    assert _library._new_wy_stage(cfg_d, td["q"], td["v"]) is None
    with pytest.raises(InvalidArgumentError, match="wy_stage.*expected gdn or kda"):
        _library._forward(cfg_d, td["q"], td["k"], td["v"], None, td["beta"], None, None, None,
                          (hd, vnd, stage[:2 * 200 * 2 * 328]))


@pytest.mark.parametrize("variant", ["kda", "gdn", "delta"])
def test_which_calls_allocate_a_wy_stage(variant, monkeypatch):
    """deltacp._library._new_wy_stage's choice, on any machine (the device check stubbed to a Hopper): a buffer of
    WyStagePlanes' size for gdn and kda at K = V = 128 on the fused or automatic forward, none for delta, another
    forward method, another head size, the in-kernel options or DELTACP_KEEP_WY_STAGE=0."""
    monkeypatch.setattr(_library, "_is_hopper", lambda device: True)
    B, T, HV = 2, 70, 3

    def stage(method="fused", K=128, V=128, qk_l2norm=False):
        q, v = torch.zeros((B, T, 1, K), dtype=torch.bfloat16), torch.zeros((B, T, HV, V), dtype=torch.bfloat16)
        cfg = _library._config(variant, method, "tiled", q, None, 64, False, None, None)
        cfg.qk_l2norm, cfg.kda_gate = qk_l2norm, None
        return _library._new_wy_stage(cfg, q, v)

    if variant == "delta":
        assert stage() is None
        return
    for method in ("fused", "auto"):
        s = stage(method)
        assert s is not None and s.shape == (B * T * HV * TOTAL[variant],) and s.dtype == torch.bfloat16
    assert stage("tiled") is None and stage(K=64, V=64) is None and stage(V=256) is None
    assert stage(qk_l2norm=True) is None
    monkeypatch.setenv("DELTACP_KEEP_WY_STAGE", "0")
    assert stage() is None
