"""The fused tier (cuda/fused/, Hopper): its forward against the float64 reference on the same rounded
inputs and against the tiled tier, intra-card CP at sequence boundaries and pieces shorter than a chunk,
what the default dispatch picks and why, and the errors of backend="fused" where it does not apply.
Tolerance: bf16 / fp16 1e-2 relative (docs/design.md). Skipped without a CUDA device; the tests that need
the fused kernels skip on a GPU that is not compute capability 9.0."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
import deltacp.fla_options as fla_options  # noqa: E402
import deltacp.reference as ref  # noqa: E402
from deltacp_testutil import input_names, make_problem, ref_forward, rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _hopper():
    return torch.cuda.get_device_capability() == (9, 0)


def _need_fused():
    if not deltacp.built_with_cuda() or not deltacp._core.cuda_supports("gdn", "fused", False):
        pytest.fail("a CUDA device is present but this build has no fused tier")
    if not _hopper():
        pytest.skip("the fused kernels run on compute capability 9.0 (H100 / H200)")


def _tensors(p, variant, dtype, grad=False):
    names = input_names(variant)
    t = {n: torch.tensor(p[n], dtype=torch.float32 if n == "g" else dtype, device="cuda", requires_grad=grad)
         for n in names}
    h0 = None if p["initial_state"] is None else torch.tensor(p["initial_state"], dtype=torch.float32, device="cuda")
    cu = None if p["cu_seqlens"] is None else torch.tensor(p["cu_seqlens"], device="cuda")
    return t, h0, cu


def _op(variant):
    return {"gdn": deltacp.chunk_gated_delta_rule, "kda": deltacp.chunk_kda, "delta": deltacp.chunk_delta_rule}[variant]


def _run(variant, t, h0, cu, backend, q=None, k=None, **kw):
    """The variant's op on t (q and k replaced where given), with h0 and the final state."""
    args = [t["q"] if q is None else q, t["k"] if k is None else k, t["v"]]
    args += ([t["g"]] if variant != "delta" else []) + [t["beta"]]
    return _op(variant)(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend=backend, **kw)


def _reference(variant, p, t, h0):
    rounded = dict(p, **{n: t[n].detach().double().cpu().numpy() for n in input_names(variant)})
    if h0 is not None:
        rounded["initial_state"] = h0.double().cpu().numpy()
    return ref_forward(ref, variant, rounded)


def _poison():
    """NaN in freed allocator blocks: an output element the kernel never writes shows up."""
    junk = torch.full((1 << 24,), float("nan"), dtype=torch.float32, device="cuda")
    del junk


# (B, T, H, HV, cu_seqlens, with h0): fixed lengths around the chunk size, grouped values, packed varlen
# with sequences of 1 token and an empty one.
CASES = {
    "fixed": (2, 200, 2, 2, None, True),
    "grouped": (1, 130, 1, 3, None, False),
    "varlen": (1, None, 2, 2, [0, 1, 17, 81, 145, 145, 146, 400], True),
    "one_chunk": (3, 64, 1, 1, None, True),
}


# Every variant at K = V = 128, K = 128 with V = 256 (four 64-column tiles of the state in the chain; gdn and delta's
# WY stage makes U in two rounds of 128 columns) and K = V = 64 (one 64-column box per tile).
VARIANT_KV = [("gdn", 128, 128), ("kda", 128, 128), ("delta", 128, 128), ("gdn", 128, 256), ("kda", 128, 256),
              ("delta", 128, 256), ("gdn", 64, 64), ("kda", 64, 64), ("delta", 64, 64)]


@pytest.mark.parametrize("variant,K,V", VARIANT_KV)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_against_reference_and_tiled(variant, K, V, dtype, case, monkeypatch):
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_PIECE", "0")  # whole sequences here; the pieces are tested below
    B, T, H, HV, cu, with_h0 = CASES[case]
    p = make_problem(variant, B=B, T=T or 0, H=H, HV=HV, K=K, V=V, cu_seqlens=cu, h0=with_h0, seed=7)
    t, h0, cu_t = _tensors(p, variant, dtype)
    o_ref, ht_ref = _reference(variant, p, t, h0)
    _poison()
    o, ht = _run(variant, t, h0, cu_t, "fused")
    torch.cuda.synchronize()
    assert deltacp.last_cuda_tier()[0] == "fused"
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o.double().cpu().numpy(), o_ref) < 1e-2
    assert rel_err(ht.double().cpu().numpy(), ht_ref) < 1e-2
    o_t, ht_t = _run(variant, t, h0, cu_t, "tiled")
    # Same roundings as the tiled tier (fp32 state, 16-bit product operands): closer than to fp64.
    assert rel_err(o.double().cpu().numpy(), o_t.double().cpu().numpy()) < 5e-3
    assert rel_err(ht.double().cpu().numpy(), ht_t.double().cpu().numpy()) < 5e-3


@pytest.mark.parametrize("variant", ["gdn", "delta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES) + ["long_varlen"])
@pytest.mark.parametrize("l2", [False, True], ids=["plain", "l2norm"])
def test_fused_one_kernel_equals_two_kernels(variant, dtype, case, l2, monkeypatch):
    """The one-kernel forward (the WY stage on chip beside the chain, fused_one_kernel.cuh) against the
    two-kernel one: the same products with the same roundings, so the same bits, at chunks shorter than 64
    tokens, sequence boundaries, empty and one-token sequences, grouped values, h0 and the in-kernel l2 norm;
    and against the fp64 reference."""
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_PIECE", "0")
    monkeypatch.setenv("DELTACP_FUSED_TBETA", "0")  # the one kernel makes W and U, as the W, U form of the chain
    if case == "long_varlen":  # many chunks per sequence: the input stages and ring slots wrap many times
        B, T, H, HV, cu, with_h0 = 1, None, 1, 2, [0, 700, 701, 1500, 2063], True
    else:
        B, T, H, HV, cu, with_h0 = CASES[case]
    p = make_problem(variant, B=B, T=T or 0, H=H, HV=HV, K=128, V=128, cu_seqlens=cu, h0=with_h0, seed=23)
    t, h0, cu_t = _tensors(p, variant, dtype)
    kw = {"use_qk_l2norm_in_kernel": True} if l2 else {}
    qk = _raw_qk(t) if l2 else {"q": t["q"], "k": t["k"]}
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("DELTACP_FUSED_ONE_KERNEL", mode)
        _poison()
        with torch.no_grad():
            out[mode] = _run(variant, t, h0, cu_t, "fused", q=qk["q"], k=qk["k"], **kw)
        torch.cuda.synchronize()
    o, ht = out["1"]
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert torch.equal(o, out["0"][0])
    assert torch.equal(ht, out["0"][1])
    if not l2:
        o_ref, ht_ref = _reference(variant, p, t, h0)
        assert rel_err(o.double().cpu().numpy(), o_ref) < 1e-2
        assert rel_err(ht.double().cpu().numpy(), ht_ref) < 1e-2


@pytest.mark.parametrize("variant,K,V", [("gdn", 128, 128), ("delta", 128, 128), ("gdn", 128, 256), ("gdn", 64, 64),
                                         ("delta", 64, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(CASES) + ["long_varlen"])
@pytest.mark.parametrize("l2", [False, True], ids=["plain", "l2norm"])
def test_fused_tbeta_form_matches_w_u_form(variant, K, V, dtype, case, l2, monkeypatch):
    """The chain's T Beta form (the WY stage writes T Beta, the chain reads v and makes Vn = T Beta (V - e^G K S))
    against its W, U form (DELTACP_FUSED_TBETA=0): the same algebra rounded at other places, so as close to the fp64
    reference (and within bf16 rounding of the W, U form with the in-kernel l2 norm), at chunks shorter than 64
    tokens, sequence boundaries, empty and one-token sequences, grouped values, h0, and one or two warpgroups per CTA
    (the same bits). Reruns give the same bits."""
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_PIECE", "0")
    if case == "long_varlen":
        B, T, H, HV, cu, with_h0 = 1, None, 1, 2, [0, 700, 701, 1500, 2063], True
    else:
        B, T, H, HV, cu, with_h0 = CASES[case]
    p = make_problem(variant, B=B, T=T or 0, H=H, HV=HV, K=K, V=V, cu_seqlens=cu, h0=with_h0, seed=29)
    t, h0, cu_t = _tensors(p, variant, dtype)
    kw = {"use_qk_l2norm_in_kernel": True} if l2 else {}
    qk = _raw_qk(t) if l2 else {"q": t["q"], "k": t["k"]}
    out = {}
    for mode, wg in (("0", "1"), ("1", "1"), ("1", "2"), ("1", "2")):
        if V == 64 and wg == "2":
            continue
        monkeypatch.setenv("DELTACP_FUSED_TBETA", mode)
        monkeypatch.setenv("DELTACP_FUSED_WG", wg)
        _poison()
        with torch.no_grad():
            got = _run(variant, t, h0, cu_t, "fused", q=qk["q"], k=qk["k"], **kw)
        torch.cuda.synchronize()
        assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all(), (mode, wg)
        if (mode, wg) in out:
            assert torch.equal(got[0], out[mode, wg][0]) and torch.equal(got[1], out[mode, wg][1])
        out[mode, wg] = got
    (o_wu, ht_wu), (o, ht) = out["0", "1"], out["1", "1"]
    if ("1", "2") in out:
        assert torch.equal(out["1", "2"][0], o) and torch.equal(out["1", "2"][1], ht)
    o_ref, ht_ref = _reference(variant, p, t, h0) if not l2 else (None, None)
    for name, x, x_wu, x_ref in (("o", o, o_wu, o_ref), ("ht", ht, ht_wu, ht_ref)):
        x, x_wu = x.double().cpu().numpy(), x_wu.double().cpu().numpy()
        if x_ref is None:  # raw q, k normalised inside: no fp64 reference of these exact inputs here
            assert rel_err(x, x_wu) < 1e-2, name
        else:  # as accurate as the W, U form (its roundings are other ones, not fewer)
            err, err_wu = rel_err(x, x_ref), rel_err(x_wu, x_ref)
            assert err < 1e-2 and err <= 1.5 * err_wu + 1e-3, (name, err, err_wu)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("g_dtype", ["fp32", "input"])
def test_fused_tbeta_form_sums_the_gate_in_its_wy_stage(dtype, g_dtype, monkeypatch):
    """The T Beta form's WY stage sums g within each chunk itself (no cumsum launch), from an fp32 g or one in the
    input dtype, in the cumsum's order: the final state and output stay within bf16 rounding of the W, U form's
    (which runs the cumsum kernel) and of the fp64 reference, with packed sequences and chunks shorter than 64."""
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_PIECE", "0")
    p = make_problem("gdn", B=1, H=2, HV=4, K=128, V=128, cu_seqlens=[0, 5, 64, 65, 300, 301, 555], h0=True, seed=31)
    t, h0, cu_t = _tensors(p, "gdn", dtype)
    if g_dtype == "input":
        t["g"] = t["g"].to(dtype)
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("DELTACP_FUSED_TBETA", mode)
        _poison()
        with torch.no_grad():
            out[mode] = _run("gdn", t, h0, cu_t, "fused")
        torch.cuda.synchronize()
    o_ref, ht_ref = _reference("gdn", p, t, h0)  # on the rounded g
    for i, ref_x in ((0, o_ref), (1, ht_ref)):
        x, x_wu = out["1"][i].double().cpu().numpy(), out["0"][i].double().cpu().numpy()
        assert np.isfinite(x).all()
        err, err_wu = rel_err(x, ref_x), rel_err(x_wu, ref_x)
        assert err < 1e-2 and err <= 1.5 * err_wu + 1e-3, (i, err, err_wu)


def test_fused_tbeta_form_required_says_why_not(monkeypatch):
    """DELTACP_FUSED_TBETA=1 where the T Beta form cannot run (kda's chain, whose W carries a decay per key): an
    error naming the variable and the reason; a value other than 0 or 1 is an error too."""
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_TBETA", "1")
    p = make_problem("kda", B=1, T=300, H=1, K=128, V=128, seed=5)
    t, h0, cu = _tensors(p, "kda", torch.bfloat16)
    with pytest.raises(ValueError, match="DELTACP_FUSED_TBETA") as info:
        _run("kda", t, h0, cu, "fused")
    assert "gdn and delta" in str(info.value)
    monkeypatch.setenv("DELTACP_FUSED_TBETA", "yes")
    p = make_problem("gdn", B=1, T=300, H=1, K=128, V=128, seed=5)
    t, h0, cu = _tensors(p, "gdn", torch.bfloat16)
    with pytest.raises(ValueError, match="DELTACP_FUSED_TBETA"):
        _run("gdn", t, h0, cu, "fused")


@pytest.mark.parametrize("what", ["kda", "pieces", "V256"])
def test_fused_one_kernel_required_says_why_not(what, monkeypatch):
    """DELTACP_FUSED_ONE_KERNEL=1 where the one kernel cannot run: an error naming the variable and the reason."""
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_ONE_KERNEL", "1")
    monkeypatch.setenv("DELTACP_FUSED_PIECE", "128" if what == "pieces" else "0")
    variant = "kda" if what == "kda" else "gdn"
    p = make_problem(variant, B=1, T=300, H=1, K=128, V=256 if what == "V256" else 128, seed=5)
    t, h0, cu = _tensors(p, variant, torch.bfloat16)
    expect = {"kda": "gdn and delta", "pieces": "piece plan", "V256": "K = V = 128"}[what]
    with pytest.raises(ValueError, match="DELTACP_FUSED_ONE_KERNEL") as info:
        _run(variant, t, h0, cu, "fused")
    assert expect in str(info.value)


@pytest.mark.parametrize("variant,K,V", [("gdn", 128, 128), ("kda", 128, 128), ("gdn", 128, 256), ("kda", 128, 256),
                                         ("gdn", 64, 64), ("kda", 64, 64)])
@pytest.mark.parametrize("piece", [64, 100, 256])
@pytest.mark.parametrize("form", ["default", "w_u"])
def test_fused_intra_card_pieces_are_exact(variant, K, V, piece, form, monkeypatch):
    """Sequences cut into pieces (DELTACP_FUSED_PIECE tokens, rounded up to whole chunks), each run from the
    start state the fold of the pieces' maps gives it: the same answer as whole sequences to rounding, at
    packed-sequence boundaries, with sequences shorter than a piece and last pieces shorter than a chunk; for gdn
    with the maps and the chain in the T Beta form (the default) and in the W, U form (DELTACP_FUSED_TBETA=0)."""
    _need_fused()
    if form == "w_u":
        if variant == "kda":
            pytest.skip("kda has only the W, U form")
        monkeypatch.setenv("DELTACP_FUSED_TBETA", "0")
    cu = [0, 1, 65, 300, 301, 1000, 1100]
    p = make_problem(variant, B=1, H=2, HV=4, K=K, V=V, cu_seqlens=cu, seed=11)
    t, h0, cu_t = _tensors(p, variant, torch.bfloat16)
    o_ref, ht_ref = _reference(variant, p, t, h0)
    monkeypatch.setenv("DELTACP_FUSED_PIECE", "0")
    o_whole, ht_whole = _run(variant, t, h0, cu_t, "fused")
    monkeypatch.setenv("DELTACP_FUSED_PIECE", str(piece))
    _poison()
    o, ht = _run(variant, t, h0, cu_t, "fused")
    torch.cuda.synchronize()
    assert rel_err(o.double().cpu().numpy(), o_ref) < 1e-2
    assert rel_err(ht.double().cpu().numpy(), ht_ref) < 1e-2
    assert rel_err(o.double().cpu().numpy(), o_whole.double().cpu().numpy()) < 5e-3
    assert rel_err(ht.double().cpu().numpy(), ht_whole.double().cpu().numpy()) < 5e-3


def test_fused_long_sequence_few_heads_default_plan():
    """One long sequence and few heads: the default plan (intra-card CP where the time model predicts a gain)
    still gives the reference's answer."""
    _need_fused()
    p = make_problem("gdn", B=1, T=8192, H=2, K=128, V=128, seed=13)
    t, h0, cu_t = _tensors(p, "gdn", torch.bfloat16)
    o_ref, ht_ref = _reference("gdn", p, t, h0)
    o, ht = _run("gdn", t, h0, cu_t, "fused")
    torch.cuda.synchronize()
    assert rel_err(o.double().cpu().numpy(), o_ref) < 1e-2
    assert rel_err(ht.double().cpu().numpy(), ht_ref) < 1e-2


def test_fused_default_dispatch_says_which_tier_ran_and_why():
    _need_fused()
    for variant in ("gdn", "kda"):
        p = make_problem(variant, B=1, T=100, H=2, K=128, V=128, seed=3)
        t, h0, cu = _tensors(p, variant, torch.bfloat16)
        _run(variant, t, h0, cu, None)
        tier, why = deltacp.last_cuda_tier()
        assert tier == "fused", (variant, why)
    p = make_problem("gdn", B=1, T=100, H=2, K=64, V=32, seed=3)
    t, h0, cu = _tensors(p, "gdn", torch.bfloat16)
    _run("gdn", t, h0, cu, None)
    tier, why = deltacp.last_cuda_tier()
    assert tier == "tiled" and "or K = V = 64" in why
    t32, h0, cu = _tensors(make_problem("gdn", B=1, T=100, H=2, K=128, V=128, seed=3), "gdn", torch.float32)
    _run("gdn", t32, h0, cu, None)
    tier, why = deltacp.last_cuda_tier()
    assert tier == "tiled" and "bf16 or fp16" in why


@pytest.mark.parametrize("what", ["K64_V128", "fp32", "kda_V64", "kda_K64_V128", "V192", "unaligned_q"])
def test_fused_by_name_refuses_with_the_reason(what):
    _need_fused()
    variant = "kda" if what.startswith("kda") else "gdn"
    K = 64 if what.endswith("K64_V128") else 128
    V = {"kda_V64": 64, "V192": 192}.get(what, 128)
    p = make_problem(variant, B=1, T=80, H=1, K=K, V=V, seed=5)
    t, h0, cu = _tensors(p, variant, torch.float32 if what == "fp32" else torch.bfloat16)
    if what == "unaligned_q":  # rows of q 8 bytes off a 16-byte boundary
        buf = torch.empty(t["q"].numel() + 4, dtype=t["q"].dtype, device="cuda")
        q = buf[4:].view_as(t["q"])
        q.copy_(t["q"])
        t["q"] = q
    shapes = "K = 128 with V = 128 or 256, or K = V = 64"
    expect = {"K64_V128": shapes, "fp32": "bf16 or fp16", "kda_V64": shapes, "kda_K64_V128": shapes,
              "V192": shapes, "unaligned_q": "q's pointer"}[what]
    args = [t["q"], t["k"], t["v"], t["g"], t["beta"]]
    op = deltacp.chunk_kda if variant == "kda" else deltacp.chunk_gated_delta_rule
    with pytest.raises(ValueError, match="fused") as info:
        op(*args, initial_state=h0, output_final_state=True, backend="fused")
    assert expect in str(info.value)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_fused_forward_with_gradients_through_the_tiled_backward(variant):
    """backend="fused" with grad: the forward runs fused, the gradients on the tiled backward; both equal
    the all-tiled call's to bf16 rounding."""
    _need_fused()
    p = make_problem(variant, B=2, T=150, H=2, K=128, V=128, seed=9)
    grads = {}
    for backend in ("fused", "tiled"):
        t, h0, cu = _tensors(p, variant, torch.bfloat16, grad=True)
        o, ht = _run(variant, t, h0, cu, backend)
        rng = np.random.default_rng(2)
        do = torch.tensor(rng.standard_normal(o.shape), dtype=o.dtype, device="cuda")
        (o.float() * do.float()).sum().backward()
        grads[backend] = {n: t[n].grad.double().cpu().numpy() for n in t}
    for n in grads["fused"]:
        assert rel_err(grads["fused"][n], grads["tiled"][n]) < 5e-3, n


# ---- FLA's use_qk_l2norm_in_kernel inside the kernels (Params::qk_l2norm) ----------------------------------
def _raw_qk(t, seed=5):
    """q and k with row norms spread over [0.3, 3] (make_problem's keys are unit rows), in their dtype."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for n in ("q", "k"):
        x = t[n].detach().float()
        s = 0.3 + 2.7 * torch.rand(x.shape[:-1] + (1,), device="cuda", generator=gen)
        out[n] = (x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6) * s).to(t[n].dtype)
    return out


def _gdn_call(t, q, k, h0, cu, **kw):
    return deltacp.chunk_gated_delta_rule(q, k, t["v"], t["g"], t["beta"], initial_state=h0, output_final_state=True,
                                          cu_seqlens=cu, **kw)


@pytest.mark.parametrize("case", ["fixed", "grouped", "varlen"])
@pytest.mark.parametrize("piece", [0, 100])
def test_fused_in_kernel_l2norm(case, piece, monkeypatch):
    """use_qk_l2norm_in_kernel without gradients: the fused kernels fold each row's 1 / |x| into their products
    (q and k read once, no normalised copy) — against the fp64 reference of the normalised inputs, and against
    normalising first and running the fused tier on the result; whole sequences and pieces (whose pass 1, the
    chain's map mode, folds k's row scales into its products like the chain)."""
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_PIECE", str(piece))
    B, T, H, HV, cu, with_h0 = CASES[case]
    p = make_problem("gdn", B=B, T=T or 0, H=H, HV=HV, K=128, V=128, cu_seqlens=cu, h0=with_h0, seed=17)
    t, h0, cu_t = _tensors(p, "gdn", torch.bfloat16)
    raw = _raw_qk(t)
    _poison()
    with torch.no_grad():
        o, ht = _gdn_call(t, raw["q"], raw["k"], h0, cu_t, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()
    assert deltacp.last_cuda_tier()[0] == "fused"
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    normed = {n: raw[n].double() / torch.sqrt((raw[n].double() ** 2).sum(-1, keepdim=True) + 1e-6) for n in raw}
    o_ref, ht_ref = _reference("gdn", p, dict(t, **normed), h0)
    assert rel_err(o.double().cpu().numpy(), o_ref) < 1e-2
    assert rel_err(ht.double().cpu().numpy(), ht_ref) < 1e-2
    with torch.no_grad():
        qn, kn = fla_options.l2norm(raw["q"]), fla_options.l2norm(raw["k"])
        o_pre, ht_pre = _gdn_call(t, qn, kn, h0, cu_t, backend="fused")
    assert rel_err(o.double().cpu().numpy(), o_pre.double().cpu().numpy()) < 5e-3
    assert rel_err(ht.double().cpu().numpy(), ht_pre.double().cpu().numpy()) < 5e-3


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_in_kernel_l2norm_on_the_tiled_tier_normalises_first(variant):
    """Where the kernels do not fold the norm in (the tiled tier), the CUDA core normalises q and k into
    workspace with the same one-pass kernel the torch op uses, so the answer is bitwise the torch path's."""
    if not deltacp.built_with_cuda():
        pytest.fail("a CUDA device is present but this build has no CUDA tiers")
    p = make_problem(variant, B=2, T=150, H=2, K=64, V=32, seed=19)
    t, h0, _ = _tensors(p, variant, torch.bfloat16)
    raw = _raw_qk(t)
    op = deltacp.chunk_gated_delta_rule if variant == "gdn" else deltacp.chunk_kda
    with torch.no_grad():
        o, ht = op(raw["q"], raw["k"], t["v"], t["g"], t["beta"], initial_state=h0, output_final_state=True,
                   backend="tiled", use_qk_l2norm_in_kernel=True)
        qn, kn = fla_options.l2norm(raw["q"]), fla_options.l2norm(raw["k"])
        o_pre, ht_pre = op(qn, kn, t["v"], t["g"], t["beta"], initial_state=h0, output_final_state=True,
                           backend="tiled")
    assert torch.equal(o, o_pre) and torch.equal(ht, ht_pre)


@pytest.mark.parametrize("case", ["fixed", "grouped", "varlen"])
@pytest.mark.parametrize("piece", [0, 100])
@pytest.mark.parametrize("gate", ["fp32", "bf16"])
@pytest.mark.parametrize("D", [128, 64], ids=["K128", "K64"])
def test_fused_kda_normalises_and_sums_the_gate_in_its_kernels(case, piece, gate, D, monkeypatch):
    """kda's two token-parallel kernels l2-normalise q and k where they load them, with the one-pass kernel's
    arithmetic (bit for bit the fused call on q, k normalised first), and sum the gate within each chunk
    themselves (g in fp32 or bf16; only G's last rows reach the chain and, with pieces, its map mode): against
    the tiled tier and the fp64 reference on the normalised inputs."""
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_PIECE", str(piece))
    B, T, H, HV, cu, with_h0 = CASES[case]
    p = make_problem("kda", B=B, T=T or 0, H=H, HV=HV, K=D, V=D, cu_seqlens=cu, h0=with_h0, seed=29)
    t, h0, cu_t = _tensors(p, "kda", torch.bfloat16)
    if gate == "bf16":
        t["g"] = t["g"].to(torch.bfloat16)
    raw = _raw_qk(t)
    _poison()
    with torch.no_grad():
        o, ht = _run("kda", t, h0, cu_t, "fused", q=raw["q"], k=raw["k"], use_qk_l2norm_in_kernel=True)
        qn, kn = fla_options.l2norm(raw["q"]), fla_options.l2norm(raw["k"])
        o_pre, ht_pre = _run("kda", t, h0, cu_t, "fused", q=qn, k=kn)
        o_tiled, ht_tiled = _run("kda", t, h0, cu_t, "tiled", q=qn, k=kn)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert torch.equal(o, o_pre) and torch.equal(ht, ht_pre)
    assert rel_err(o.double().cpu().numpy(), o_tiled.double().cpu().numpy()) < 5e-3
    assert rel_err(ht.double().cpu().numpy(), ht_tiled.double().cpu().numpy()) < 5e-3
    o_ref, ht_ref = _reference("kda", p, dict(t, q=qn, k=kn), h0)
    assert rel_err(o.double().cpu().numpy(), o_ref) < 1e-2
    assert rel_err(ht.double().cpu().numpy(), ht_ref) < 1e-2


def test_kda_with_gradients_keeps_the_unit_row_diagonal_bound():
    """With a gradient, q and k are l2-normalised before the kernels (with autograd) and the call says so
    (Params::qk_unit_rows), so kda's diagonal score blocks take the same tensor-core bound as the call without a
    gradient, which normalises inside its kernels: on gates near lower_bound -5, whose 16-token blocks decay by
    about e^73 (past the e^64 bound of rows of any norm), both calls give o and ht bit for bit. The gradients
    (the backward's recompute takes the same bound) match float64 autograd on the CPU."""
    _need_fused()
    p = make_problem("kda", B=1, T=200, H=2, K=128, V=128, seed=31)
    t, h0, _ = _tensors(p, "kda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(3)
    t["g"] = -4.9 + 0.1 * torch.rand(t["g"].shape, device="cuda", generator=gen)  # per-token decays in [-4.9, -4.8]
    raw = _raw_qk(t)
    kw = dict(use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        o_ng, ht_ng = _run("kda", t, h0, None, None, q=raw["q"], k=raw["k"], **kw)
    leaves = {n: (raw[n] if n in raw else t[n]).detach().clone().requires_grad_(True)
              for n in ("q", "k", "v", "g", "beta")}
    o, ht = _run("kda", leaves, h0, None, None, **kw)
    assert deltacp.last_cuda_tier()[0] == "fused"
    assert torch.equal(o.detach(), o_ng) and torch.equal(ht.detach(), ht_ng)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, device="cuda", generator=gen)
    names = ("q", "k", "v", "g", "beta")
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(), [leaves[n] for n in names])
    cpu = {n: leaves[n].detach().double().cpu().requires_grad_(True) for n in names}
    o64, ht64 = _run("kda", cpu, h0.double().cpu(), None, None, **kw)
    want = torch.autograd.grad((o64 * do.double().cpu()).sum() + (ht64 * dht.double().cpu()).sum(),
                               [cpu[n] for n in names])
    assert rel_err(o.detach().double().cpu().numpy(), o64.detach().numpy()) < 1e-2
    for n, got, ref64 in zip(names, grads, want):
        assert torch.isfinite(got).all(), n
        assert rel_err(got.double().cpu().numpy(), ref64.numpy()) < 1e-2, n


# ---- FLA's use_gate_in_kernel for kda inside the kernels (Params::gate_A_log) ------------------------------------
def _raw_gate(t, HV, K, seed=7):
    """A raw gate input (either sign), A_log [HV] = log(1 + 15 u) and dt_bias [HV * K] = 0.1 n, as FLA's models
    initialise them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    g = torch.randn(t["g"].shape, device="cuda", generator=gen)
    A_log = torch.log1p(15 * torch.rand(HV, device="cuda", generator=gen))
    dt_bias = 0.1 * torch.randn(HV * K, device="cuda", generator=gen)
    return g, A_log, dt_bias


@pytest.mark.parametrize("case", ["fixed", "grouped", "varlen"])
@pytest.mark.parametrize("piece", [0, 100])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("gate", ["fp32", "bf16"])
def test_fused_kda_applies_the_in_kernel_gate(case, piece, lower_bound, gate, monkeypatch):
    """use_gate_in_kernel without gradients: the fused kda forward turns the raw g into lower_bound sigmoid(e^A_log
    (g + dt_bias)) (or -e^A_log softplus(g + dt_bias) without lower_bound) where it sums the gate within each chunk,
    and the tiled tier takes it from one pass into workspace: both against the call on the gate computed first by
    torch (fla_options.kda_gate), against each other, and against the fp64 reference."""
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_PIECE", str(piece))
    B, T, H, HV, cu, with_h0 = CASES[case]
    p = make_problem("kda", B=B, T=T or 0, H=H, HV=HV, K=128, V=128, cu_seqlens=cu, h0=with_h0, seed=31)
    t, h0, cu_t = _tensors(p, "kda", torch.bfloat16)
    g_raw, A_log, dt_bias = _raw_gate(t, HV, 128)
    if gate == "bf16":
        g_raw = g_raw.to(torch.bfloat16)
    opts = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    if lower_bound is not None:
        opts["safe_gate"] = True
    g_pre = fla_options.kda_gate(g_raw, A_log, dt_bias, lower_bound, out_dtype=torch.float32)
    _poison()
    with torch.no_grad():
        o, ht = _run("kda", dict(t, g=g_raw), h0, cu_t, "fused", **opts)
        assert deltacp.last_cuda_tier()[0] == "fused"
        o_tiled, ht_tiled = _run("kda", dict(t, g=g_raw), h0, cu_t, "tiled", **opts)
        o_pre, ht_pre = _run("kda", dict(t, g=g_pre), h0, cu_t, "fused")
    torch.cuda.synchronize()
    for x in (o, ht, o_tiled, ht_tiled):
        assert torch.isfinite(x).all()
    assert rel_err(o.double().cpu().numpy(), o_pre.double().cpu().numpy()) < 5e-3
    assert rel_err(ht.double().cpu().numpy(), ht_pre.double().cpu().numpy()) < 1e-3
    assert rel_err(o.double().cpu().numpy(), o_tiled.double().cpu().numpy()) < 5e-3
    assert rel_err(ht.double().cpu().numpy(), ht_tiled.double().cpu().numpy()) < 5e-3
    g64 = fla_options.kda_gate(g_raw.double(), A_log.double(), dt_bias.double(), lower_bound)
    o_ref, ht_ref = _reference("kda", p, dict(t, g=g64), h0)
    assert rel_err(o.double().cpu().numpy(), o_ref) < 1e-2
    assert rel_err(ht.double().cpu().numpy(), ht_ref) < 1e-2


def test_in_kernel_kda_gate_with_gradients_runs_as_its_own_op():
    """With a gradient wanted the gate runs before the delta-rule kernels as a differentiable op (deltacp._kda_gate;
    the kernels' in-kernel gate has no backward): A_log gets its gradient, and the forward agrees with the in-kernel
    gate's."""
    _need_fused()
    p = make_problem("kda", B=1, T=150, H=2, HV=2, K=128, V=128, seed=33)
    t, h0, _ = _tensors(p, "kda", torch.bfloat16)
    g_raw, A_log, dt_bias = _raw_gate(t, 2, 128)
    with torch.no_grad():
        o_in, _ = _run("kda", dict(t, g=g_raw), h0, None, None, use_gate_in_kernel=True, A_log=A_log,
                       dt_bias=dt_bias, lower_bound=-5.0)
    A = A_log.clone().requires_grad_(True)
    o, _ = _run("kda", dict(t, g=g_raw), h0, None, None, use_gate_in_kernel=True, A_log=A, dt_bias=dt_bias,
                lower_bound=-5.0)
    (dA,) = torch.autograd.grad(o.float().sum(), A)
    assert torch.isfinite(dA).all() and dA.abs().sum() > 0
    assert rel_err(o.detach().double().cpu().numpy(), o_in.double().cpu().numpy()) < 5e-3


def test_in_kernel_l2norm_with_gradients_or_strided_rows_normalises_in_torch():
    """With a gradient wanted, or q / k rows that are not contiguous, the call normalises with autograd first
    (the kernels' folded norm has no backward): the same forward to rounding, and gradients flow."""
    _need_fused()
    p = make_problem("gdn", B=1, T=300, H=2, K=128, V=128, seed=23)
    t, h0, _ = _tensors(p, "gdn", torch.bfloat16)
    raw = _raw_qk(t)
    with torch.no_grad():
        o_in, _ = _gdn_call(t, raw["q"], raw["k"], h0, None, use_qk_l2norm_in_kernel=True)
    q = raw["q"].clone().requires_grad_(True)
    o_grad, _ = _gdn_call(t, q, raw["k"], h0, None, use_qk_l2norm_in_kernel=True)
    o_grad.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert rel_err(o_in.double().cpu().numpy(), o_grad.detach().double().cpu().numpy()) < 5e-3
    wide = torch.cat([raw["q"], raw["q"]], dim=-1)[..., :128]  # a strided view: rows 256 elements apart
    assert not wide.is_contiguous()
    with torch.no_grad():
        o_strided, _ = _gdn_call(t, wide, raw["k"], h0, None, use_qk_l2norm_in_kernel=True)
    assert rel_err(o_in.double().cpu().numpy(), o_strided.double().cpu().numpy()) < 5e-3


# ---- windows along time (fused_fwd.cu fused_window_tokens) --------------------------------------------------
@pytest.mark.parametrize("window", [64, 128, 192])
@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("overlap", ["0", "1"])
@pytest.mark.parametrize("variant,K,V", [("gdn", 128, 128), ("kda", 128, 128), ("gdn", 128, 256), ("kda", 128, 256),
                                         ("gdn", 64, 64), ("kda", 64, 64)])
def test_fused_windows_along_time_equal_one_window(variant, K, V, window, l2, overlap, monkeypatch):
    """A fixed-length batch run as windows of whole chunks (DELTACP_FUSED_WINDOW tokens), each from the fp32
    state the last one left: over whole sequences the same kernels see the same chunks and states, so o and
    ht equal the one-window call bit for bit (T = 300: a short last window); also with the next window's WY
    stage beside this window's chain (DELTACP_FUSED_OVERLAP=1: two streams, two slots of W, U, P)."""
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_PIECE", "0")
    monkeypatch.setenv("DELTACP_FUSED_OVERLAP", overlap)
    p = make_problem(variant, B=2, T=300, H=2, HV=4, K=K, V=V, h0=True, seed=23)
    t, h0, _ = _tensors(p, variant, torch.bfloat16)
    raw = _raw_qk(t) if l2 else {"q": t["q"], "k": t["k"]}
    kw = dict(use_qk_l2norm_in_kernel=True) if l2 else {}
    with torch.no_grad():
        monkeypatch.setenv("DELTACP_FUSED_WINDOW", "0")
        o_one, ht_one = _run(variant, t, h0, None, "fused", q=raw["q"], k=raw["k"], **kw)
        monkeypatch.setenv("DELTACP_FUSED_WINDOW", str(window))
        _poison()
        o, ht = _run(variant, t, h0, None, "fused", q=raw["q"], k=raw["k"], **kw)
    torch.cuda.synchronize()
    assert torch.equal(o, o_one)
    assert torch.equal(ht, ht_one)


def test_fused_inference_workspace_does_not_grow_with_the_chunks(monkeypatch):
    """An inference call's memory beyond its inputs and outputs (the workspace, from torch's caching allocator)
    is the same for 4096 and 16384 tokens when windows of 1024 tokens bound it."""
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_WINDOW", "1024")
    monkeypatch.setenv("DELTACP_FUSED_PIECE", "0")

    def extra_bytes(T):
        p = make_problem("gdn", B=1, T=T, H=4, K=128, V=128, seed=29)
        t, h0, _ = _tensors(p, "gdn", torch.bfloat16)
        with torch.no_grad():
            _gdn_call(t, t["q"], t["k"], h0, None, backend="fused")  # warm: tables, tensor maps, allocator
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            o, ht = _gdn_call(t, t["q"], t["k"], h0, None, backend="fused")
            torch.cuda.synchronize()
        outputs = o.numel() * o.element_size() + ht.numel() * ht.element_size()
        return torch.cuda.max_memory_allocated() - base - outputs

    small, large = extra_bytes(4096), extra_bytes(16384)
    assert large <= small + (1 << 20), f"workspace {small} B at 4096 tokens, {large} B at 16384"


@pytest.mark.parametrize("window", [64, 150, 320])
@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_fused_varlen_windows_equal_one_window(variant, window, monkeypatch):
    """A packed batch run as windows of its packed axis (fused_windows.h): sequences cut at their own chunk
    starts carry their fp32 state to the next window; empty, one-token and long sequences; bit for bit the
    one-window call over whole sequences."""
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_PIECE", "0")
    cu = [0, 1, 65, 300, 300, 301, 1000, 1100]
    p = make_problem(variant, B=1, H=2, HV=4, K=128, V=128, cu_seqlens=cu, h0=True, seed=31)
    t, h0, cu_t = _tensors(p, variant, torch.bfloat16)
    with torch.no_grad():
        monkeypatch.setenv("DELTACP_FUSED_WINDOW", "0")
        o_one, ht_one = _run(variant, t, h0, cu_t, "fused")
        monkeypatch.setenv("DELTACP_FUSED_WINDOW", str(window))
        _poison()
        o, ht = _run(variant, t, h0, cu_t, "fused")
    torch.cuda.synchronize()
    assert torch.equal(o, o_one)
    assert torch.equal(ht, ht_one)
