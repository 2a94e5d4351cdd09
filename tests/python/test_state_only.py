"""The state-only modes of deltacp::Params through the bindings (bindings/src/tensor_desc.cpp), and the
CP pre-pass that runs on them (deltacp.cp.local, deltacp.cp.exchange): CPU only.

  * a forward without "o" but with "ht" (final-state-only) gives exactly the full run's ht;
  * a backward without any input gradient but with "dh0" (dh0-only) gives exactly the full run's dh0;
  * leaving out o without ht, or a partial set of gradients, raises ValueError naming the argument;
  * the augmented pre-pass ([v | 0] from [start | I]) equals the reference's span maps (M, H);
  * the CUDA pre-pass route: tiled variants with V + K <= 256 take the state-only chunked path,
    dplr / the naive tier / wider problems take deltacp._cp_nccl's loop kernels, the environment
    override and the shared-memory fallback work (decided on the host: no GPU needed).
"""

from __future__ import annotations

import numpy as np
import pytest

import deltacp
import deltacp.reference as ref
from deltacp import _core
from deltacp._describe import numpy_desc
from deltacp_testutil import VARIANTS, make_problem

FIELDS = {"q": "q", "k": "k", "v": "v", "g": "g", "beta": "beta", "a": "a", "b": "b"}


def _inputs(variant, p):
    d = {}
    for name, field in FIELDS.items():
        if p.get(name) is not None:
            d[field] = numpy_desc(np.ascontiguousarray(p[name]), "gk" if (variant == "dplr" and name == "g") else name)
    if p["initial_state"] is not None:
        d["h0"] = numpy_desc(p["initial_state"], "initial_state")
    if p["cu_seqlens"] is not None:
        d["cu_seqlens"] = numpy_desc(p["cu_seqlens"], "cu_seqlens")
    return d


def _problem(variant):
    return make_problem(variant, cu_seqlens=[0, 30, 30, 71, 100], H=2, HV=4, K=8, V=6, seed=5)


def _forward(variant, p, method, with_o=True):
    B, T, HV, V = p["v"].shape
    N, K = p["initial_state"].shape[0], p["q"].shape[-1]
    d = _inputs(variant, p)
    o = np.full((B, T, HV, V), np.nan)
    ht = np.full((N, HV, K, V), np.nan)
    if with_o:
        d["o"] = numpy_desc(o, "o")
    d["ht"] = numpy_desc(ht, "ht")
    _core.run("forward", variant, method, "float64", d, None, 16, None, 0, False)
    return o, ht


def _backward(variant, p, method, grads=True, only=None):
    rng = np.random.default_rng(3)
    do = rng.standard_normal(p["v"].shape)
    dht = rng.standard_normal(p["initial_state"].shape)
    d = _inputs(variant, p)
    d["dout"] = numpy_desc(do, "do")
    d["dht"] = numpy_desc(dht, "dht")
    out = {"dh0": np.full(p["initial_state"].shape, np.nan)}
    d["dh0"] = numpy_desc(out["dh0"], "dh0")
    names = [n for n in FIELDS if p.get(n) is not None]
    for n in names if grads else (only or []):
        out["d" + n] = np.full(p[n].shape, np.nan)
        d["d" + n] = numpy_desc(out["d" + n], "d" + n)
    _core.run("backward", variant, method, "float64", d, None, 16, None, 0, False)
    return out


@pytest.mark.parametrize("method", ["recurrent", "chunked", "affine"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_final_state_only_forward_equals_full_run(variant, method):
    p = _problem(variant)
    _, ht_full = _forward(variant, p, method)
    o, ht = _forward(variant, p, method, with_o=False)
    assert np.array_equal(ht, ht_full)
    assert np.isnan(o).all()


@pytest.mark.parametrize("method", ["recurrent", "chunked"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_dh0_only_backward_equals_full_run(variant, method):
    p = _problem(variant)
    full = _backward(variant, p, method)
    only = _backward(variant, p, method, grads=False)
    assert set(only) == {"dh0"}
    assert np.array_equal(only["dh0"], full["dh0"])


def test_forward_without_output_or_final_state_names_o():
    p = _problem("gdn")
    d = _inputs("gdn", p)
    with pytest.raises(ValueError, match=r"'o'.*only when ht is given"):
        _core.run("forward", "gdn", "chunked", "float64", d, None, 16, None, 0, False)


def test_partial_gradients_name_the_missing_one():
    p = _problem("gdn")
    with pytest.raises(ValueError, match=r"'dk'.*dh0-only"):
        _backward("gdn", p, "chunked", grads=False, only=["q"])
    with pytest.raises(ValueError, match=r"'dg'"):
        _backward("gdn", p, "chunked", grads=False, only=["q", "k", "v", "beta"])


def test_no_gradients_and_no_dh0_names_dq():
    p = _problem("kda")
    rng = np.random.default_rng(0)
    d = _inputs("kda", p)
    d["dout"] = numpy_desc(rng.standard_normal(p["v"].shape), "do")
    with pytest.raises(ValueError, match=r"'dq'.*dh0"):
        _core.run("backward", "kda", "chunked", "float64", d, None, 16, None, 0, False)


# ---------------------------------------------------------------------------------------------
# the CP pre-pass on the state-only modes (CPU: the chunked reference)
# ---------------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")
from deltacp.cp import exchange as cp_exchange, local as cp_local  # noqa: E402


def _cfg(variant, H, HV, K, V, device="cpu", fwd="chunked", bwd="chunked", ctx=None):
    cfg = cp_local._Cfg()
    cfg.variant, cfg.gate_name, cfg.scale, cfg.chunk_size = variant, "gk" if variant == "dplr" else "g", None, 16
    cfg.compute, cfg.state_dtype, cfg.device = "float64", torch.float64, torch.device(device)
    cfg.H, cfg.HV, cfg.K, cfg.V = H, HV, K, V
    cfg.fwd_method, cfg.bwd_method, cfg.ctx = fwd, bwd, ctx
    return cfg


def _span_problem(variant, seed, rng_seed, ctx=None):
    """One 45-token span (H = HV = 1, K = 5, V = 4, chunk 16) in fp64: (problem, cfg, the seven input
    tensors, a start state, a dend, an upstream do)."""
    p = make_problem(variant, B=1, T=45, H=1, HV=1, K=5, V=4, seed=seed)
    t = {n: (None if p.get(n) is None else torch.from_numpy(np.ascontiguousarray(p[n]))) for n in FIELDS}
    rng = np.random.default_rng(rng_seed)
    start = torch.from_numpy(rng.standard_normal((1, 5, 4)))
    dend = torch.from_numpy(rng.standard_normal((1, 5, 4)))
    do = torch.from_numpy(rng.standard_normal((1, 45, 1, 4)))
    args = [t[n] for n in ("q", "k", "v", "g", "beta", "a", "b")]
    return p, _cfg(variant, 1, 1, 5, 4, ctx=ctx), args, start, dend, do


@pytest.mark.parametrize("variant", VARIANTS)
def test_augmented_prepass_gives_the_span_maps(variant):
    p, cfg, args, start, dend, do = _span_problem(variant, seed=9, rng_seed=1)
    fwd = cp_local._augmented_forward(cfg, *args, start).numpy()
    bwd = cp_local._augmented_backward(cfg, *args, do, dend).numpy()
    # (M, H) and (M^T, dH) of the span from the per-head reference pieces.
    head = {n: p[n][0, :, 0] for n in ("q", "k", "v", "g", "beta", "a", "b") if p.get(n) is not None}
    M, H = ref.span_affine(variant, chunk_size=16, **head)
    Mt, dH = ref.span_affine_backward(variant, do=do.numpy()[0, :, 0], chunk_size=16, **head)
    np.testing.assert_allclose(fwd[0, :, :4], M @ start.numpy()[0] + H, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(fwd[0, :, 4:], M, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(bwd[0, :, :4], Mt @ dend.numpy()[0] + dH, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(bwd[0, :, 4:], Mt, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bounds", [[0, 16, 45], [0, 5, 21, 37, 45], [0, 3, 19, 35, 45]])
def test_prepass_in_pieces_equals_the_whole_span(variant, bounds):
    """cp/local.py: the pieces' maps composed by _fold_maps (2 to 4 pieces, with and without a short head
    piece) equal the one-piece pre-pass in fp64, forward and backward, with a start state and a dend."""
    _, cfg, args, start, dend, do = _span_problem(variant, seed=11, rng_seed=2)
    whole_f = cp_local._augmented_forward(cfg, *args, start).numpy()
    whole_b = cp_local._augmented_backward(cfg, *args, do, dend).numpy()
    piece_f = cp_local._augmented_forward(cfg, *args, start, bounds=bounds).numpy()
    piece_b = cp_local._augmented_backward(cfg, *args, do, dend, bounds=bounds).numpy()
    np.testing.assert_allclose(piece_f, whole_f, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(piece_b, whole_b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("segments", [[0, 45], [0, 20, 45]])
@pytest.mark.parametrize("piece", ["0", "16"])
def test_backward_prepass_from_the_forward_maps(monkeypatch, variant, segments, piece):
    """cp/exchange.py: the backward pre-pass from the forward's per-piece transitions (dH over the V columns
    only, composed with M_p^T) equals the widened [v | 0] run, in fp64: one local segment continuing on
    both sides (the maps come from the [H | M] pieces) and two segments (from _transitions), with a
    head piece (the rank starts 7 tokens into its sequence) and in pieces of 16 tokens or one."""
    from types import SimpleNamespace

    monkeypatch.setenv("DELTACP_CP_PREPASS_PIECE", piece)
    n_seg = len(segments) - 1
    ctx = SimpleNamespace(first_continues=True, last_continues=True, cu_seqlens_list=segments, begin=7,
                          cu_seqlens_global_list=[0, 52, 200], seq_ids=list(range(n_seg)), starts_here=[False] * n_seg,
                          ends_here=[False] * n_seg, maps_read=True)
    _, cfg, args, _, _, do = _span_problem(variant, seed=12, rng_seed=4, ctx=ctx)
    sent, maps = cp_exchange._prepass_forward(cfg, *args, None, want_first_maps=True)
    assert maps is not None and maps.M.shape == (len(maps.bounds) - 1, 1, 5, 5)
    assert cp_exchange._prepass_forward(cfg, *args, None)[1] is None
    old = cp_exchange._prepass_backward(cfg, *args, do, None).numpy()
    new = cp_exchange._prepass_backward(cfg, *args, do, None, first_maps=maps).numpy()
    np.testing.assert_allclose(new, old, rtol=1e-11, atol=1e-12)
    # The backward follows the forward's pieces even when the setting changes in between.
    monkeypatch.setenv("DELTACP_CP_PREPASS_PIECE", "32" if piece == "16" else "16")
    moved = cp_exchange._prepass_backward(cfg, *args, do, None, first_maps=maps).numpy()
    np.testing.assert_allclose(moved, old, rtol=1e-11, atol=1e-12)


def test_piece_bounds_follow_the_one_device_chunk_grid(monkeypatch):
    """cp/local.py _piece_bounds: a head piece up to the first one-device boundary, then whole pieces of
    DELTACP_CP_PREPASS_PIECE tokens (default: one on CPUs, quarters of the span on GPUs); a bad setting
    names the variable."""
    cfg = _cfg("gdn", 1, 1, 4, 4)  # chunk 16, CPU: one piece by default
    assert cp_local._piece_bounds(cfg, 100, 0) == [0, 100]
    assert cp_local._piece_bounds(cfg, 100, 7) == [0, 7, 100]
    gpu = _cfg("gdn", 1, 1, 4, 4, device="cuda")  # CUDA default: quarters of the span, >= 2048 tokens
    gpu.chunk_size = 64
    assert cp_local._piece_bounds(gpu, 32768, 0) == [0, 8192, 16384, 24576, 32768]
    assert cp_local._piece_bounds(gpu, 32768, 20) == [0, 20, 8212, 16404, 24596, 32768]
    assert cp_local._piece_bounds(gpu, 5000, 0) == [0, 2048, 4096, 5000]
    assert cp_local._piece_bounds(gpu, 1012, 0) == [0, 1012]
    monkeypatch.setenv("DELTACP_CP_PREPASS_PIECE", "32")
    assert cp_local._piece_bounds(cfg, 100, 0) == [0, 32, 64, 96, 100]
    assert cp_local._piece_bounds(cfg, 100, 7) == [0, 7, 39, 71, 100]
    assert cp_local._piece_bounds(cfg, 32, 0) == [0, 32]
    monkeypatch.setenv("DELTACP_CP_PREPASS_PIECE", "20")  # rounded up to whole chunks of 16
    assert cp_local._piece_bounds(cfg, 100, 0) == [0, 32, 64, 96, 100]
    for bad in ("-16", "x"):
        monkeypatch.setenv("DELTACP_CP_PREPASS_PIECE", bad)
        with pytest.raises(ValueError, match="DELTACP_CP_PREPASS_PIECE"):
            cp_local._piece_bounds(cfg, 100, 0)


@pytest.mark.parametrize("cu,world,read", [
    ([0, 64], 2, False),              # one sequence over 2 ranks: each merge folds one rank, M times 0
    ([0, 96], 3, True),               # rank 1 lies strictly inside the sequence
    ([0, 40, 80], 4, False),          # two sequences over 2 ranks each (cuts at 20, 40, 60)
    ([0, 10, 80], 4, True),           # the second sequence spans ranks 0-3: ranks 1 and 2 inside
    ([0, 20, 40, 60, 80], 4, False),  # every rank holds whole sequences
])
def test_transitions_read_only_inside_a_sequence(cu, world, read):
    """CPContext.maps_read (context.transitions_read): the exchange carries M only where a merge reads it,
    and the merges agree: folding the gathered maps with every unread M replaced by garbage gives the same
    start states (fp64, random maps), so carrying [H] alone is exact."""
    from deltacp import _core
    from deltacp.cp.context import transitions_read

    plans = _core.cp_plan_even(cu, world)
    assert transitions_read(plans) == read
    rng = np.random.default_rng(5)
    K, V = 3, 2
    H = [rng.standard_normal((K, V)) for _ in range(world)]
    M = [rng.standard_normal((K, K)) for _ in range(world)]
    for r, plan in enumerate(plans):
        js = range(r - plan["pre_ranks"], r)  # the ranks the merge of rank r folds (cp/exchange.py _merge_forward)
        S = np.zeros((K, V))
        S_garbage = np.zeros((K, V))
        for i, j in enumerate(js):
            unread = i == 0  # the first folded rank's M multiplies S = 0
            S = M[j] @ S + H[j]
            S_garbage = (rng.standard_normal((K, K)) * 1e6 if unread else M[j]) @ S_garbage + H[j]
            assert unread or read  # a second folded rank exists only when some rank lies inside a sequence
        np.testing.assert_array_equal(S, S_garbage)


def test_until_confirmed_waits_for_the_collective_even_when_its_body_raises(monkeypatch):
    """cp/exchange.py _until_confirmed: the collective of an all-gather(wait=False) is confirmed on a normal exit
    (its error propagates) and also when the body raises (the body's error propagates, not the collective's)."""
    calls = []

    def fake_confirm(cfg, what, *buffers):
        calls.append(what)
        if what == "stalled":
            raise RuntimeError("collective timed out")

    monkeypatch.setattr(cp_exchange, "_confirm", fake_confirm)
    with cp_exchange._until_confirmed(None, "ok"):
        pass
    with pytest.raises(RuntimeError, match="timed out"):
        with cp_exchange._until_confirmed(None, "stalled"):
            pass
    with pytest.raises(KeyError, match="body"):
        with cp_exchange._until_confirmed(None, "stalled"):
            raise KeyError("body")
    assert calls == ["ok", "stalled", "stalled"]


def test_fold_maps_is_the_chain():
    """_fold_maps (a log-depth tree) equals the chain S <- M_p S + H_p for 1 to 7 maps, in fp64, and
    _fold_offsets its offset, over the maps in order and over them reversed with reverse=True."""
    rng = np.random.default_rng(3)
    for P in range(1, 8):
        X = torch.from_numpy(rng.standard_normal((P, 2, 3, 4 + 3)) * 0.5)
        H, M = torch.zeros(2, 3, 4, dtype=X.dtype), torch.eye(3, dtype=X.dtype).expand(2, 3, 3)
        for p in range(P):
            H, M = X[p, :, :, 4:] @ H + X[p, :, :, :4], X[p, :, :, 4:] @ M
        got = cp_local._fold_maps(X, 4)
        np.testing.assert_allclose(got[..., :4].numpy(), H.numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got[..., 4:].numpy(), M.numpy(), rtol=1e-12, atol=1e-12)
        # the offset alone (no merge reads the composed transition), in order and reversed
        np.testing.assert_allclose(cp_local._fold_offsets(X[..., :4], X[..., 4:]).numpy(), H.numpy(),
                                   rtol=1e-12, atol=1e-12)
        back = cp_local._fold_offsets(X.flip(0)[..., :4], X.flip(0)[..., 4:], reverse=True)
        np.testing.assert_allclose(back.numpy(), H.numpy(), rtol=1e-12, atol=1e-12)


class _FakeCtx:
    nccl = object()  # "deltacp._cp_nccl is built": the loop kernels are available


@pytest.mark.parametrize("variant,fwd,K,V,route", [
    ("gdn", "tiled", 128, 128, "chunked"),
    ("kda", "tiled", 64, 192, "chunked"),
    ("delta", "tiled", 128, 129, "loops"),  # V + K > 256: wider than the tiled tier's value tile
    ("dplr", "naive", 64, 64, "loops"),    # no tiled dplr
    ("gdn", "naive", 64, 64, "loops"),     # backend="naive": the fp32 loops beat the token loop
])
def test_cuda_prepass_route(monkeypatch, variant, fwd, K, V, route):
    monkeypatch.delenv("DELTACP_CP_PREPASS", raising=False)
    cfg = _cfg(variant, 2, 2, K, V, device="cuda", fwd=fwd, bwd=fwd, ctx=_FakeCtx())
    q = torch.empty(0, dtype=torch.bfloat16)
    assert cp_local._prepass_route(cfg, "forward", q, None) == route
    assert cp_local._prepass_route(cfg, "backward", q, None) == route
    monkeypatch.setenv("DELTACP_CP_PREPASS", "loops")
    assert cp_local._prepass_route(cfg, "forward", q, None) == "loops"
    monkeypatch.setenv("DELTACP_CP_PREPASS", "chunked")
    assert cp_local._prepass_route(cfg, "forward", q, None) == "chunked"
    monkeypatch.setenv("DELTACP_CP_PREPASS", "fast")
    with pytest.raises(ValueError, match="DELTACP_CP_PREPASS"):
        cp_local._prepass_route(cfg, "forward", q, None)


def test_cuda_prepass_route_without_the_nccl_module_is_chunked():
    class NoNccl:
        nccl = None

    cfg = _cfg("dplr", 2, 2, 64, 64, device="cuda", fwd="naive", bwd="naive", ctx=NoNccl())
    assert cp_local._prepass_route(cfg, "forward", torch.empty(0), None) == "chunked"
    assert cp_local._prepass_route(_cfg("gdn", 2, 2, 8, 8), "forward", torch.empty(0), None) == "chunked"  # CPU


def test_tiled_prepass_that_does_not_fit_falls_back_to_the_loops(monkeypatch):
    monkeypatch.delenv("DELTACP_CP_PREPASS", raising=False)
    cfg = _cfg("kda", 2, 2, 128, 128, device="cuda", fwd="tiled", bwd="tiled", ctx=_FakeCtx())
    q = torch.empty(0, dtype=torch.float32)
    calls = []

    def too_big():
        calls.append("chunked")
        raise ValueError("deltacp: argument 'K': the tiled tier's A/T/W/U stage needs 200000 bytes of shared memory")

    def loops():
        calls.append("loops")
        return "loops-result"

    cp_local._TILED_PREPASS_UNFIT.clear()
    assert cp_local._prepass_chunked_or_loops(cfg, "forward", too_big, loops, q, None) == "loops-result"
    assert calls == ["chunked", "loops"]
    assert cp_local._prepass_route(cfg, "forward", q, None) == "loops"  # remembered for this shape
    assert cp_local._prepass_route(cfg, "backward", q, None) == "chunked"  # per direction

    def bad_input():
        raise ValueError("deltacp: argument 'g': expected shape [B, T, HV, K]")

    with pytest.raises(ValueError, match="'g'"):  # other errors are never swallowed
        cp_local._prepass_chunked_or_loops(cfg, "backward", bad_input, loops, q, None)
    cp_local._TILED_PREPASS_UNFIT.clear()


def test_grid_pad_realigns_the_first_segment_with_the_one_device_chunks():
    """cp/local.py _grid_pad: tokens up to the one-device chunk boundary, 0 where nothing needs aligning."""
    from types import SimpleNamespace

    from deltacp.cp import local as cp_local

    def pad(begin, seq_start, seg_len, chunk=64, method="tiled", continues=True):
        ctx = SimpleNamespace(first_continues=continues, cu_seqlens_list=[0, seg_len, seg_len + 7], begin=begin,
                              cu_seqlens_global_list=[0, seq_start, 10 ** 6], seq_ids=[1])
        return cp_local._grid_pad(SimpleNamespace(ctx=ctx, fwd_method=method, chunk_size=chunk))

    assert pad(1012, 0, 1000) == 12  # 1012 + 12 = 1024, the next chunk boundary of the sequence
    assert pad(1012, 100, 1000) == 48  # offset 912 -> 960
    assert pad(1012, 0, 1000, chunk=16) == 12
    assert pad(1024, 0, 1000) == 0  # the rank boundary is a chunk boundary already
    assert pad(1012, 0, 12) == 0 and pad(1012, 0, 5) == 0  # the segment ends before the next boundary
    assert pad(1012, 0, 1000, continues=False) == 0  # the sequence starts on this rank
    assert pad(1012, 0, 1000, method="recurrent") == 0 and pad(1012, 0, 1000, method="naive") == 0  # no grid
    assert pad(1012, 0, 1000, method="chunked") == 12


@pytest.mark.parametrize("stage", ["staged_forward_prepare", "staged_backward_prepare"])
def test_staged_kernels_refuse_cpu_tensors_by_name(stage):
    """_core.staged_forward_prepare / staged_backward_prepare on CPU tensors: a ValueError naming what is
    wrong (the build has no CUDA tiers: 'backend'; it has them: the tensor 'q' is not on a GPU), no crash."""
    import torch

    from deltacp import _core
    from deltacp._describe import torch_desc

    q, v = torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16)
    g, beta, o = torch.randn(1, 64, 2), torch.rand(1, 64, 2), torch.empty(1, 64, 2, 16)
    descs = {"q": torch_desc(q, "q"), "k": torch_desc(q, "k"), "v": torch_desc(v, "v"), "g": torch_desc(g, "g"),
             "beta": torch_desc(beta, "beta")}
    if stage == "staged_forward_prepare":
        descs["o"] = torch_desc(o, "o")
    else:
        descs["dout"] = torch_desc(o, "do")
        grads = {n: torch.empty_like(t) for n, t in (("q", q), ("k", q), ("v", v), ("g", g), ("beta", beta))}
        descs.update({"d" + n: torch_desc(t, "d" + n) for n, t in grads.items()})
    with pytest.raises(ValueError, match="'backend'|'q'"):
        getattr(_core, stage)("gdn", "tiled", descs, None, 64, 0)
