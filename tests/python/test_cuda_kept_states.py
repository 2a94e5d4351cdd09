"""The per-chunk states a CUDA forward keeps for the backward (Params::chunk_h and chunk_vnew in deltacp/params.h;
deltacp._library._kept_states): the fused chain's h and v_new against the tiled forward's state scan, gradients
with them against gradients that recompute them (DELTACP_KEEP_CHUNK_STATES=0), and the errors of a call that passes
them where no kernel writes or reads them. Skipped without a CUDA device; the fused cases skip on a GPU that is not
compute capability 9.0; the reference's refusal runs on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
from deltacp import _library  # noqa: E402
from deltacp.errors import InvalidArgumentError  # noqa: E402
from deltacp_testutil import input_names, make_problem, rel_err  # noqa: E402

def _need(tier):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not deltacp.built_with_cuda() or not deltacp._core.cuda_supports("gdn", tier, False):
        pytest.fail(f"a CUDA device is present but this build has no {tier} tier")
    if tier == "fused" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused kernels run on compute capability 9.0 (H100 / H200)")


# (B, T, H, HV, cu_seqlens): fixed lengths past a chunk boundary, grouped values, packed varlen with sequences of
# one token and an empty one.
CASES = {
    "fixed": (2, 200, 2, 2, None),
    "grouped": (1, 130, 1, 3, None),
    "varlen": (1, None, 2, 2, [0, 1, 17, 81, 145, 145, 146, 400]),
}


def _tensors(variant, case, K, V, dtype=torch.bfloat16, grad=False, seed=3):
    B, T, H, HV, cu = CASES[case]
    p = make_problem(variant, B=B, T=T or 1, H=H, HV=HV, K=K, V=V, cu_seqlens=cu, seed=seed)
    t = {n: torch.tensor(p[n], dtype=torch.float32 if n == "g" else dtype, device="cuda", requires_grad=grad)
         for n in input_names(variant)}
    h0 = torch.tensor(p["initial_state"], dtype=torch.float32, device="cuda", requires_grad=grad)
    cu_t = None if cu is None else torch.tensor(cu, device="cuda")
    return t, h0, cu_t


def _forward_kept(variant, t, h0, cu, tier):
    """(o, chunk_h, chunk_vnew) of one forward on `tier` that keeps its states, NaN where nothing wrote."""
    cu_host = None if cu is None else cu.cpu()
    cfg = _library._config(variant, tier, "tiled", t["q"], None, 64, False, cu, cu_host)
    kept = _library._kept_states(cfg, t["q"], t["v"])
    assert kept is not None
    for x in kept:
        x.fill_(float("nan"))
    o, _ = _library._forward(cfg, t["q"], t["k"], t["v"], t.get("g"), t.get("beta"), None, None, h0, kept)
    torch.cuda.synchronize()
    return o, kept[0], kept[1]


@pytest.mark.parametrize("variant,K,V", [("gdn", 128, 128), ("kda", 128, 128), ("delta", 128, 128),
                                         ("gdn", 128, 256), ("gdn", 64, 64), ("kda", 64, 64)])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("piece", [None, "64"], ids=["whole", "pieces"])
def test_fused_kept_states_match_the_tiled_scan(variant, K, V, case, piece, monkeypatch):
    """The fused chain stores every chunk's start state and every token's v_new (no NaN left), and they agree with
    the tiled forward's state scan to bf16 rounding, also where the chain runs intra-card CP pieces of one chunk
    (DELTACP_FUSED_PIECE=64: each piece from its composed start state)."""
    _need("fused")
    if piece is not None:
        monkeypatch.setenv("DELTACP_FUSED_PIECE", piece)
    t, h0, cu = _tensors(variant, case, K, V)
    o_f, h_f, vn_f = _forward_kept(variant, t, h0, cu, "fused")
    monkeypatch.delenv("DELTACP_FUSED_PIECE", raising=False)
    o_t, h_t, vn_t = _forward_kept(variant, t, h0, cu, "tiled")
    for name, x in (("chunk_h", h_f), ("chunk_vnew", vn_f)):
        assert not torch.isnan(x).any(), f"{name}: elements the fused forward never wrote"
    assert rel_err(h_f.float().cpu(), h_t.float().cpu()) < 1e-2
    assert rel_err(vn_f.float().cpu(), vn_t.float().cpu()) < 1e-2
    assert rel_err(o_f.float().cpu(), o_t.float().cpu()) < 1e-2


def _grads(variant, t, h0, cu, backend, seed=11, compiled=False):
    """o and the gradients of every input of one call (do and dht from `seed`); compiled: through torch.compile
    (aot_eager: Dynamo and AOTAutograd around the registered ops, no code generation), so that the backward is the
    registered chunk_bwd."""
    op = {"gdn": deltacp.chunk_gated_delta_rule, "kda": deltacp.chunk_kda, "delta": deltacp.chunk_delta_rule}[variant]

    def call(*args):
        return op(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend=backend)

    if compiled:
        torch._dynamo.reset()
        call = torch.compile(call, fullgraph=True, backend="aot_eager")
    rng = np.random.default_rng(seed)
    args = [t["q"], t["k"], t["v"]] + ([t["g"]] if variant != "delta" else []) + [t["beta"]]
    o, ht = call(*args)
    do = torch.tensor(rng.standard_normal(o.shape), dtype=o.dtype, device="cuda")
    dht = torch.tensor(rng.standard_normal(ht.shape), dtype=torch.float32, device="cuda")
    xs = [t[n] for n in input_names(variant)] + [h0]
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (ht * dht).sum(), xs)
    torch.cuda.synchronize()
    return [o.detach()] + list(grads)


@pytest.mark.parametrize("variant,K,V", [("gdn", 128, 128), ("kda", 128, 128), ("delta", 128, 128),
                                         ("gdn", 64, 64)])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["fused", "tiled"])
def test_gradients_with_kept_states_match_the_recompute(variant, K, V, case, backend, monkeypatch):
    """The backward reading the forward's kept h and v_new gives the gradients of the backward that recomputes them
    with its own state scan: bitwise on the tiled forward (the same scan), to bf16 rounding on the fused one."""
    _need(backend)
    t, h0, cu = _tensors(variant, case, K, V, grad=True)
    monkeypatch.setenv("DELTACP_KEEP_CHUNK_STATES", "0")
    recomputed = _grads(variant, t, h0, cu, backend)
    monkeypatch.setenv("DELTACP_KEEP_CHUNK_STATES", "1")
    kept = _grads(variant, t, h0, cu, backend)
    names = ["o"] + input_names(variant) + ["h0"]
    for name, x, y in zip(names, kept, recomputed):
        assert not torch.isnan(x).any(), name
        if backend == "tiled":
            assert torch.equal(x, y), f"d{name} differs with the kept states"
        else:
            assert rel_err(x.float().cpu(), y.float().cpu()) < 5e-3, f"d{name}"


@pytest.mark.parametrize("variant", ["gdn", "kda"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_route_keeps_the_states(variant, case, monkeypatch):
    """Under torch.compile the registered chunk_fwd returns the kept h and v_new (fixed-length batches; a varlen
    batch keeps none, its chunk count being unknown to the fake implementation) and chunk_bwd reads them: the
    gradients are the eager route's (the same kernels on the same states; on the fused forward a backward that
    recomputed the states instead would differ by bf16 roundings, about 1e-3), and they agree with a compiled
    backward that recomputes the states."""
    _need("tiled")
    t, h0, cu = _tensors(variant, case, 128, 128, grad=True)
    eager = _grads(variant, t, h0, cu, None)
    compiled = _grads(variant, t, h0, cu, None, compiled=True)
    monkeypatch.setenv("DELTACP_KEEP_CHUNK_STATES", "0")
    recomputed = _grads(variant, t, h0, cu, None, compiled=True)
    names = ["o"] + input_names(variant) + ["h0"]
    for name, x, y, z in zip(names, compiled, eager, recomputed):
        assert not torch.isnan(x).any(), name
        if cu is None:
            assert rel_err(x.float().cpu(), y.float().cpu()) < 1e-6, f"d{name}: the compiled route differs from eager"
        assert rel_err(x.float().cpu(), z.float().cpu()) < 5e-3, f"d{name}"
    monkeypatch.setenv("DELTACP_KEEP_CHUNK_STATES", "1")
    args = [t["q"].detach(), t["k"].detach(), t["v"].detach(), t["g"].detach(), t["beta"].detach(), None, None,
            h0.detach(), cu, None if cu is None else cu.cpu(), variant, "auto", "tiled", None, 64, True, None]
    _, _, h, vn = _library.chunk_fwd(*args, keep_states=True)
    B, T, H, HV, _ = CASES[case]
    if cu is None:
        assert h.shape == (B * -(-T // 64), HV, 128, 128) and vn.shape == (B, T, HV, 128)
    else:
        assert h.numel() == 0 and vn.numel() == 0


def test_kept_states_are_refused_where_no_kernel_uses_them():
    """A forward on the naive tier, a CUDA call with a wrongly shaped buffer and one buffer without the other fail
    naming the argument."""
    _need("tiled")
    t, h0, cu = _tensors("gdn", "fixed", 64, 64)
    cfg = _library._config("gdn", "naive", "tiled", t["q"], None, 64, False, None, None)
    h, vn = _library._kept_states(_library._config("gdn", "tiled", "tiled", t["q"], None, 64, False, None, None),
                                  t["q"], t["v"])
    with pytest.raises(InvalidArgumentError, match="chunk_h"):
        _library._forward(cfg, t["q"], t["k"], t["v"], t["g"], t["beta"], None, None, h0, (h, vn))
    cfg = _library._config("gdn", "tiled", "tiled", t["q"], None, 64, False, None, None)
    with pytest.raises(InvalidArgumentError, match="chunk_h.*expected shape"):
        _library._forward(cfg, t["q"], t["k"], t["v"], t["g"], t["beta"], None, None, h0, (h[1:], vn))
    with pytest.raises(InvalidArgumentError, match="chunk_vnew.*expected shape"):
        _library._forward(cfg, t["q"], t["k"], t["v"], t["g"], t["beta"], None, None, h0, (h, vn[:, 1:]))
    descs = _library._input_descs(cfg, t["q"], t["k"], t["v"], t["g"], t["beta"], None, None, h0)
    descs["o"] = _library.torch_desc(torch.empty_like(t["v"]), "o")
    descs["chunk_h"] = _library.torch_desc(h, "chunk_h")
    with pytest.raises(InvalidArgumentError, match="chunk_vnew"):
        _library._run(cfg, "forward", "tiled", descs)


def test_the_reference_refuses_kept_states():
    """The CPU reference keeps no per-chunk states: a call that passes them fails naming chunk_h."""
    p = make_problem("gdn", B=1, T=70, H=1, K=16, V=16, seed=2)
    t = {n: torch.tensor(p[n]) for n in input_names("gdn")}
    cfg = _library._config("gdn", "chunked", "chunked", t["q"], None, 64, False, None, None)
    kept = (torch.zeros((2, 1, 16, 16), dtype=torch.float64), torch.zeros((1, 70, 1, 16), dtype=torch.float64))
    with pytest.raises(InvalidArgumentError, match="chunk_h.*reference keeps no per-chunk states"):
        _library._forward(cfg, t["q"], t["k"], t["v"], t["g"], t["beta"], None, None, None, kept)
