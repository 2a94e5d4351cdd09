"""kda's token-parallel stage kept by the fused forward for the backward (Params::kda_stage, KdaStagePlanes in
deltacp/params.h; deltacp._library._new_kda_stage): what the forward writes into its planes against a torch telling
of the same quantities, gradients through the kept stage (the backward runs stage B0 alone) bit for bit against the
backward that recomputes the stage, the forward's report of whether it wrote the stage, and the errors of calls that
pass it where no kernel writes or reads it. Skipped without a CUDA device, and on a GPU that is not compute
capability 9.0 (the stage is kept only where the fused forward's wgmma kda stage runs)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
from deltacp import _library  # noqa: E402
from deltacp.errors import InvalidArgumentError  # noqa: E402
from deltacp_testutil import input_names, make_problem, rel_err  # noqa: E402

PLANES = {"G": 0, "T": 256, "W": 384, "Kd": 512, "Qg": 640, "P": 768}  # KdaStagePlanes, 16-bit elements per row
TOTAL = 832


def _need():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not deltacp.built_with_cuda() or not deltacp._core.cuda_supports("kda", "fused", False):
        pytest.fail("a CUDA device is present but this build has no fused tier")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kda stage is kept where the fused forward's wgmma stage runs: compute capability 9.0")


# (B, T, H, HV, cu_seqlens): fixed lengths past a chunk boundary, grouped values, packed varlen with sequences of
# one token and an empty one.
CASES = {
    "fixed": (2, 200, 2, 2, None),
    "grouped": (1, 130, 1, 3, None),
    "varlen": (1, None, 2, 2, [0, 1, 17, 81, 145, 145, 146, 400]),
}


def _tensors(case, dtype=torch.bfloat16, grad=False, seed=5):
    B, T, H, HV, cu = CASES[case]
    p = make_problem("kda", B=B, T=T or 1, H=H, HV=HV, K=128, V=128, cu_seqlens=cu, seed=seed)
    t = {n: torch.tensor(p[n], dtype=torch.float32 if n == "g" else dtype, device="cuda", requires_grad=grad)
         for n in input_names("kda")}
    h0 = torch.tensor(p["initial_state"], dtype=torch.float32, device="cuda", requires_grad=grad)
    cu_t = None if cu is None else torch.tensor(cu, device="cuda")
    return t, h0, cu_t


def _plane(stage, name, rows, width):
    start = PLANES[name] * rows
    if name in ("G", "T"):  # fp32 planes: rows x (width / 2) floats
        return stage[start:start + rows * width].view(torch.float32).view(rows, width // 2)
    return stage[start:start + rows * width].view(rows, width)


@pytest.mark.parametrize("case", list(CASES))
def test_fused_forward_fills_the_kda_stage(case):
    """Every plane of the kept stage is written for every token (no NaN left) and holds what it names: G the
    within-chunk cumulative sum of g (fp32), Q e^G and K e^(G_n - G) from q, k and G, P zero right of each chunk's
    block diagonal, T with a unit diagonal; the forward reports that it wrote the stage."""
    _need()
    t, h0, cu = _tensors(case)
    cu_host = None if cu is None else cu.cpu()
    cfg = _library._config("kda", "fused", "tiled", t["q"], None, 64, False, cu, cu_host)
    kept = _library._kept_states(cfg, t["q"], t["v"])
    stage = _library._new_kda_stage(cfg, t["q"], t["v"])
    assert kept is not None and stage is not None and stage.numel() % TOTAL == 0
    stage.fill_(float("nan"))
    _library._forward(cfg, t["q"], t["k"], t["v"], t["g"], t["beta"], None, None, h0, kept + (stage,))
    torch.cuda.synchronize()
    assert deltacp._core.cuda_last_forward_kept_kda_stage()
    B, T, H, HV = t["q"].shape[0], t["q"].shape[1], t["q"].shape[2], t["v"].shape[2]
    rows = B * T * HV
    G = _plane(stage, "G", rows, 256).view(B, T, HV, 128)
    Tm = _plane(stage, "T", rows, 128)[:, :32].contiguous().view(t["q"].dtype).view(B, T, HV, 64)
    W, Kd, Qg = (_plane(stage, n, rows, 128).view(B, T, HV, 128) for n in ("W", "Kd", "Qg"))
    P = _plane(stage, "P", rows, 64).view(B, T, HV, 64)
    for name, x in (("G", G), ("T", Tm), ("W", W), ("Kd", Kd), ("Qg", Qg), ("P", P)):
        assert not torch.isnan(x.float()).any(), f"{name}: elements the forward never wrote"
    # the chunks of every sequence: [start, end) on the time axis of batch row b
    bounds = [0, T] if cu is None else cu_host.tolist()
    group = HV // H
    for b in range(B):
        for s in range(len(bounds) - 1):
            for c0 in range(bounds[s], bounds[s + 1], 64):
                c1 = min(c0 + 64, bounds[s + 1])
                g = t["g"][b, c0:c1].double()
                Gr = torch.cumsum(g, dim=0)
                assert torch.allclose(G[b, c0:c1].double(), Gr, rtol=1e-5, atol=1e-5), (b, c0)
                qh = t["q"][b, c0:c1].double().repeat_interleave(group, dim=1)
                kh = t["k"][b, c0:c1].double().repeat_interleave(group, dim=1)
                assert rel_err(Qg[b, c0:c1].double().cpu(), (qh * Gr.exp()).cpu()) < 1e-2, (b, c0)
                assert rel_err(Kd[b, c0:c1].double().cpu(), (kh * (Gr[-1:] - Gr).exp()).cpu()) < 1e-2, (b, c0)
                n = c1 - c0
                i = torch.arange(n, device="cuda")
                Pc = P[b, c0:c1, :, :n].float().permute(1, 0, 2)  # [HV, row, column]
                assert (Pc[:, i[None, :] // 16 > i[:, None] // 16] == 0).all(), (b, c0)
                Tc = Tm[b, c0:c1, :, :n].float()
                assert torch.allclose(Tc[i, :, i], torch.ones_like(Tc[i, :, i]), atol=1e-2), (b, c0)


def _grads(t, h0, cu, seed=11):
    """o and the gradients of every input of one eager call on the fused forward and the tiled backward, and
    whether the forward wrote the kda stage."""
    rng = np.random.default_rng(seed)
    o, ht = deltacp.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=h0, output_final_state=True,
                              cu_seqlens=cu, backend="fused")
    wrote = deltacp._core.cuda_last_forward_kept_kda_stage()
    do = torch.tensor(rng.standard_normal(o.shape), dtype=o.dtype, device="cuda")
    dht = torch.tensor(rng.standard_normal(ht.shape), dtype=torch.float32, device="cuda")
    xs = [t[n] for n in input_names("kda")] + [h0]
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(), xs)
    torch.cuda.synchronize()
    return [o.detach()] + list(grads), wrote


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_through_the_kept_stage_equal_the_recompute(case, dtype, monkeypatch):
    """The backward that reads the forward's kept stage and runs stage B0 alone gives the gradients of the backward
    that recomputes the stage (DELTACP_KEEP_KDA_STAGE=0) bit for bit: the same kernel writes the same planes in both,
    and B0's products run on the same operands."""
    _need()
    t, h0, cu = _tensors(case, dtype=dtype, grad=True)
    monkeypatch.setenv("DELTACP_KEEP_KDA_STAGE", "0")
    recomputed, wrote = _grads(t, h0, cu)
    assert not wrote
    monkeypatch.setenv("DELTACP_KEEP_KDA_STAGE", "1")
    kept, wrote = _grads(t, h0, cu)
    assert wrote, "the fused forward did not keep the kda stage"
    for name, x, y in zip(["o"] + input_names("kda") + ["h0"], kept, recomputed):
        assert not torch.isnan(x).any(), name
        assert torch.equal(x, y), f"d{name} differs with the kept kda stage"


def test_a_forward_that_cannot_keep_the_stage_says_so(monkeypatch):
    """Where the fused forward's kda stage runs on the mma.sync kernel (DELTACP_FUSED_KDA_PREPARE_WGMMA=0) it writes
    no stage and reports so; the backward then recomputes, and the gradients are those of a call that kept none."""
    _need()
    t, h0, cu = _tensors("fixed", grad=True)
    monkeypatch.setenv("DELTACP_FUSED_KDA_PREPARE_WGMMA", "0")
    monkeypatch.setenv("DELTACP_KEEP_KDA_STAGE", "0")
    recomputed, _ = _grads(t, h0, cu)
    monkeypatch.setenv("DELTACP_KEEP_KDA_STAGE", "1")
    kept, wrote = _grads(t, h0, cu)
    assert not wrote
    for name, x, y in zip(["o"] + input_names("kda") + ["h0"], kept, recomputed):
        assert torch.equal(x, y), name


def test_the_kda_stage_is_refused_where_no_kernel_uses_it():
    """A stage without the per-chunk states, of the wrong size, or for gdn fails naming kda_stage."""
    _need()
    t, h0, _ = _tensors("fixed")
    cfg = _library._config("kda", "fused", "tiled", t["q"], None, 64, False, None, None)
    h, vn = _library._kept_states(cfg, t["q"], t["v"])
    stage = _library._new_kda_stage(cfg, t["q"], t["v"])
    descs = _library._input_descs(cfg, t["q"], t["k"], t["v"], t["g"], t["beta"], None, None, h0)
    descs["o"] = _library.torch_desc(torch.empty_like(t["v"]), "o")
    descs["kda_stage"] = _library.torch_desc(stage, "kda_stage")
    with pytest.raises(InvalidArgumentError, match="kda_stage.*chunk_h"):
        _library._run(cfg, "forward", "fused", descs)
    with pytest.raises(InvalidArgumentError, match="kda_stage.*expected shape"):
        _library._forward(cfg, t["q"], t["k"], t["v"], t["g"], t["beta"], None, None, h0, (h, vn, stage[1:]))
    p = make_problem("gdn", B=2, T=200, H=2, K=128, V=128, seed=3)
    tg = {n: torch.tensor(p[n], dtype=torch.float32 if n == "g" else torch.bfloat16, device="cuda")
          for n in input_names("gdn")}
    cfg_g = _library._config("gdn", "fused", "tiled", tg["q"], None, 64, False, None, None)
    hg, vng = _library._kept_states(cfg_g, tg["q"], tg["v"])
    assert _library._new_kda_stage(cfg_g, tg["q"], tg["v"]) is None
    with pytest.raises(InvalidArgumentError, match="kda_stage.*expected kda"):
        _library._forward(cfg_g, tg["q"], tg["k"], tg["v"], tg["g"], tg["beta"], None, None, None, (hg, vng, stage))
