"""deltacp.reference on numpy: the four tellings agree in float64 (1e-12), gradients match finite
differences, varlen equals separate sequences, simulated CP equals the single-process result, and
the per-head pieces satisfy their defining equations (docs/design.md sections 2-4)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import deltacp
import deltacp.reference as ref
from deltacp_testutil import VARIANTS, input_names, make_problem, ref_backward, ref_forward, rel_err

EXACT = 1e-12


def _upstream(p, variant, seed=1):
    rng = np.random.default_rng(seed)
    B, T = p["q"].shape[:2]
    HV, V = p["v"].shape[2:]
    K = p["q"].shape[3]
    N = B if p["cu_seqlens"] is None else len(p["cu_seqlens"]) - 1
    return rng.standard_normal((B, T, HV, V)), rng.standard_normal((N, HV, K, V))


def _assert_grads_close(got, want, tol, label=""):
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name in want:
        err = rel_err(got[name], want[name])
        assert err < tol, f"{label}{name}: relative error {err:.3e}"


# --------------------------------------------------------------------------------------------
# the tellings agree
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [1, 15, 16, 17, 37])
def test_tellings_agree(variant, T):
    """recurrence == chunked (16, 32, 64) == affine, forward and backward, grouped values (HV = 2H)."""
    p = make_problem(variant, B=2, T=T, H=1, HV=2, K=8, V=6, seed=T)
    do, dht = _upstream(p, variant)
    o0, ht0 = ref_forward(ref, variant, p)
    g0 = ref_backward(ref, variant, p, do, dht)
    assert np.all(np.isfinite(o0)) and np.all(np.isfinite(ht0))
    for method, cs in (("chunked", 16), ("chunked", 32), ("chunked", 64), ("affine", 16)):
        o, ht = ref_forward(ref, variant, p, chunk_size=cs, method=method)
        assert rel_err(o, o0) < EXACT, (method, cs)
        assert rel_err(ht, ht0) < EXACT, (method, cs)
        _assert_grads_close(ref_backward(ref, variant, p, do, dht, chunk_size=cs, method=method), g0, EXACT,
                            f"{method}/{cs}: ")


@pytest.mark.parametrize("variant", VARIANTS)
def test_varlen_equals_separate_sequences(variant):
    cu = [0, 5, 21, 21 + 19, 41]  # includes a sequence of length 1
    p = make_problem(variant, cu_seqlens=cu, K=4, V=5, H=2, seed=3)
    do, dht = _upstream(p, variant)
    o, ht = ref_forward(ref, variant, p, chunk_size=16)
    grads = ref_backward(ref, variant, p, do, dht, chunk_size=16)
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        pn = {key: (None if val is None else val[:, s:e]) for key, val in p.items()
              if key not in ("initial_state", "cu_seqlens")}
        pn["initial_state"] = p["initial_state"][n:n + 1]
        pn["cu_seqlens"] = None
        on, htn = ref_forward(ref, variant, pn)
        assert rel_err(o[:, s:e], on) < EXACT
        assert rel_err(ht[n:n + 1], htn) < EXACT
        gn = ref_backward(ref, variant, pn, do[:, s:e], dht[n:n + 1])
        for name in gn:
            got = grads[name][n:n + 1] if name == "dh0" else grads[name][:, s:e]
            assert rel_err(got, gn[name]) < EXACT, (n, name)


def test_zero_initial_state_and_no_final_state():
    p = make_problem("gdn", h0=False, seed=4)
    o, ht = ref_forward(ref, "gdn", p, output_final_state=False)
    assert ht is None
    p["initial_state"] = np.zeros((2, 2, 8, 6))
    o2, _ = ref_forward(ref, "gdn", p)
    assert rel_err(o, o2) == 0.0


def test_float32_inputs_compute_in_float32():
    p = make_problem("kda", seed=5)
    o64, ht64 = ref_forward(ref, "kda", p, chunk_size=32)
    p32 = {key: (val.astype(np.float32) if isinstance(val, np.ndarray) and val.dtype == np.float64 else val)
           for key, val in p.items()}
    o32, ht32 = ref_forward(ref, "kda", p32, chunk_size=32)
    assert o32.dtype == np.float32 and ht32.dtype == np.float32
    assert rel_err(o32, o64) < 1e-5 and rel_err(ht32, ht64) < 1e-5
    # one float64 argument makes the whole call float64
    p32["initial_state"] = p["initial_state"]
    o_mixed, _ = ref_forward(ref, "kda", p32, chunk_size=32)
    assert o_mixed.dtype == np.float64


def test_strided_views_without_copies():
    """q, k, v sliced out of one fused [B, T, H, 3K] projection (strides in the head axis) and a
    reversed time axis (negative strides) give the same results as contiguous copies."""
    p = make_problem("gdn", K=6, V=6, seed=6)
    fused = np.concatenate([p["q"], p["k"], p["v"]], axis=-1)
    q, k, v = fused[..., :6], fused[..., 6:12], fused[..., 12:]
    assert not q.flags.c_contiguous
    o_view, ht_view = ref.gated_delta_rule(q, k, v, p["g"], p["beta"], initial_state=p["initial_state"])
    o, ht = ref_forward(ref, "gdn", p)
    assert rel_err(o_view, o) == 0.0 and rel_err(ht_view, ht) == 0.0
    rev = {key: p[key][:, ::-1] for key in ("q", "k", "v", "g", "beta")}
    o_rev, _ = ref.gated_delta_rule(rev["q"], rev["k"], rev["v"], rev["g"], rev["beta"],
                                    initial_state=p["initial_state"])
    o_copy, _ = ref.gated_delta_rule(*(np.ascontiguousarray(rev[key]) for key in ("q", "k", "v", "g", "beta")),
                                     initial_state=p["initial_state"])
    assert rel_err(o_rev, o_copy) == 0.0


def test_default_scale_is_rsqrt_k():
    p = make_problem("delta", K=9, seed=7)
    o1, _ = ref_forward(ref, "delta", p)
    o2, _ = ref_forward(ref, "delta", p, scale=9 ** -0.5)
    assert rel_err(o1, o2) == 0.0


# --------------------------------------------------------------------------------------------
# gradients against finite differences
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunk_size", [None, 16])
def test_backward_matches_finite_differences(variant, chunk_size):
    """Directional derivatives of L = sum(o * do) + sum(ht * dht) by central differences (fp64)."""
    p = make_problem(variant, B=1, T=20, H=1, HV=2, K=3, V=2, seed=8)
    do, dht = _upstream(p, variant, seed=9)
    grads = ref_backward(ref, variant, p, do, dht, chunk_size=chunk_size)

    def loss(q):
        o, ht = ref_forward(ref, variant, q, chunk_size=chunk_size)
        return float(np.sum(o * do) + np.sum(ht * dht))

    rng = np.random.default_rng(10)
    eps = 1e-6
    for name in input_names(variant) + ["initial_state"]:
        direction = rng.standard_normal(p[name].shape)
        plus = dict(p, **{name: p[name] + eps * direction})
        minus = dict(p, **{name: p[name] - eps * direction})
        numeric = (loss(plus) - loss(minus)) / (2 * eps)
        gname = "dh0" if name == "initial_state" else "d" + name
        analytic = float(np.sum(grads[gname] * direction))
        assert abs(numeric - analytic) <= 1e-7 * max(1.0, abs(analytic)), (name, numeric, analytic)


# --------------------------------------------------------------------------------------------
# simulated context parallelism
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("cuts", [[1], [10], [5, 6, 30], [3, 7, 11, 25, 40]])
def test_cp_simulate_equals_single_process(variant, cuts):
    """Ranks cut inside sequences, at their boundaries, a sequence over 3+ ranks, T not divisible."""
    cu = [0, 11, 29, 45]
    p = make_problem(variant, cu_seqlens=cu, K=5, V=4, H=2, seed=11)
    do, dht = _upstream(p, variant)
    o0, ht0 = ref_forward(ref, variant, p, chunk_size=16)
    g0 = ref_backward(ref, variant, p, do, dht, chunk_size=16)
    names = input_names(variant)
    args = [p[name] for name in names[:3]]
    kw = dict(cuts=cuts, initial_state=p["initial_state"], cu_seqlens=p["cu_seqlens"], chunk_size=16)
    for name in names[3:]:
        kw["gk" if (variant == "dplr" and name == "g") else name] = p[name]
    (o, ht), exchange = ref.cp_simulate(variant, *args, return_exchange=True, **kw)
    assert rel_err(o, o0) < EXACT and rel_err(ht, ht0) < EXACT
    world, HV = len(cuts) + 1, p["v"].shape[2]
    assert exchange["M"].shape == (world, HV, 5, 5) and exchange["H"].shape == (world, HV, 5, 4)
    assert np.array_equal(exchange["M"][-1], np.broadcast_to(np.eye(5), (HV, 5, 5)))  # the last rank sends I
    grads, bexchange = ref.cp_simulate(variant, *args, backward=True, do=do, dht=dht, return_exchange=True, **kw)
    assert bexchange["Mt"].shape == (world, HV, 5, 5) and bexchange["dH"].shape == (world, HV, 5, 4)
    assert not np.any(bexchange["dH"][0])  # rank 0's first segment starts its sequence: nothing to send
    if variant == "dplr":
        grads["dg"] = grads.pop("dgk")
    _assert_grads_close(grads, g0, EXACT, f"cuts {cuts}: ")


def test_cp_simulate_single_sequence_default_cu_seqlens():
    p = make_problem("gdn", B=1, T=30, seed=12)
    o0, ht0 = ref_forward(ref, "gdn", p)
    o, ht = ref.cp_simulate("gdn", p["q"], p["k"], p["v"], p["g"], p["beta"], cuts=[7, 19],
                            initial_state=p["initial_state"], chunk_size=16)
    assert rel_err(o, o0) < EXACT and rel_err(ht, ht0) < EXACT


def test_cp_plan():
    plans = ref.cp_plan([0, 10, 25], cuts=[5, 15])
    assert [(r["begin"], r["end"]) for r in plans] == [(0, 5), (5, 15), (15, 25)]
    assert plans[1]["seq_ids"] == [0, 1]
    assert plans[1]["pre_ranks"] == 1 and plans[1]["post_ranks"] == 1
    even = ref.cp_plan([0, 12], world=3)
    assert [(r["begin"], r["end"]) for r in even] == [(0, 4), (4, 8), (8, 12)]


# --------------------------------------------------------------------------------------------
# per-head pieces
# --------------------------------------------------------------------------------------------
def _head_problem(variant, n=11, K=4, V=3, seed=13):
    p = make_problem(variant, B=1, T=n, H=1, K=K, V=V, seed=seed)
    head = {"q": p["q"][0, :, 0], "k": p["k"][0, :, 0], "v": p["v"][0, :, 0]}
    if variant == "gdn":
        head["g"] = p["g"][0, :, 0]
    elif variant == "kda":
        head["g"] = p["g"][0, :, 0]
    elif variant == "dplr":
        head["gk"] = p["g"][0, :, 0]
        head["a"], head["b"] = p["a"][0, :, 0], p["b"][0, :, 0]
    if variant != "dplr":
        head["beta"] = p["beta"][0, :, 0]
    return head, p["initial_state"][0, 0]


@pytest.mark.parametrize("variant", ["delta", "gdn", "kda"])
def test_chunk_wy_definitions(variant):
    """A = strict_tril(Beta (K e^G)(K e^-G)^T), T = (I + A)^-1, W = T Beta (K e^G), U = T Beta V."""
    head, _ = _head_problem(variant, n=9)
    wy = ref.chunk_wy(variant, **head)
    n, K = head["q"].shape
    g = head.get("g", np.zeros((n, K)))
    G = np.cumsum(g.reshape(n, -1) * np.ones((1, K)), axis=0)
    assert rel_err(wy["G"], G) < EXACT
    beta = head["beta"][:, None]
    kg, kig = head["k"] * np.exp(G), head["k"] * np.exp(-G)
    A = np.tril(beta * (kg @ kig.T), -1)
    assert rel_err(wy["A"], A) < EXACT
    T = np.linalg.inv(np.eye(n) + A)
    assert rel_err(wy["T"], T) < EXACT
    assert rel_err(wy["W"], T @ (beta * kg)) < EXACT
    assert rel_err(wy["U"], T @ (beta * head["v"])) < EXACT
    assert rel_err(ref.unit_lower_inverse(A), T) < EXACT


def test_chunk_wy_dplr_has_ak():
    head, _ = _head_problem("dplr", n=9)
    wy = ref.chunk_wy("dplr", **head)
    assert set(wy) == {"G", "A", "T", "W", "U", "Ak"}
    n = head["q"].shape[0]
    assert rel_err(wy["T"], np.linalg.inv(np.eye(n) - wy["A"])) < EXACT


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunk_states_and_affine_maps(variant):
    head, h0 = _head_problem(variant, n=40)
    n = head["q"].shape[0]
    o_rec, ht_rec = ref.recurrent_forward(variant, **head, initial_state=h0)
    out = ref.chunk_states(variant, **head, initial_state=h0, chunk_size=16)
    assert out["states"].shape == (4, 4, 3)  # chunk starts at 0, 16, 32, then the final state
    assert rel_err(out["o"], o_rec) < EXACT
    assert rel_err(out["states"][-1], ht_rec) < EXACT
    assert rel_err(out["states"][0], h0) < EXACT
    # the state at a chunk boundary is the recurrence's state after that many tokens
    prefix = {key: val[:16] for key, val in head.items()}
    _, s16 = ref.recurrent_forward(variant, **prefix, initial_state=h0)
    assert rel_err(out["states"][1], s16) < EXACT
    # (M, H): chunk-folded == token-multiplied; applied to h0 gives the final state
    M, H = ref.span_affine(variant, **head, chunk_size=16)
    Mt_, Ht_ = ref.span_affine_tokens(variant, **head)
    assert rel_err(M, Mt_) < EXACT and rel_err(H, Ht_) < EXACT
    assert rel_err(M @ h0 + H, ht_rec) < EXACT
    # composition: span [0, n) = span [5, n) o span [0, 5)
    later = ref.span_affine_tokens(variant, **head, t0=5, t1=n)
    earlier = ref.span_affine_tokens(variant, **head, t0=0, t1=5)
    Mc, Hc = ref.compose(later, earlier)
    assert rel_err(Mc, M) < EXACT and rel_err(Hc, H) < EXACT
    # affine_forward == recurrence
    o_aff, ht_aff = ref.affine_forward(variant, **head, initial_state=h0, chunk_size=16)
    assert rel_err(o_aff, o_rec) < EXACT and rel_err(ht_aff, ht_rec) < EXACT
    # one chunk: chunk_affine and chunk_step
    first = {key: val[:16] for key, val in head.items()}
    Mc1, Hc1 = ref.chunk_affine(variant, **first)
    step = ref.chunk_step(variant, **first, S0=h0)
    assert rel_err(step["S_end"], Mc1 @ h0 + Hc1) < EXACT
    assert rel_err(step["o"], o_rec[:16]) < EXACT


@pytest.mark.parametrize("variant", VARIANTS)
def test_span_affine_backward_and_head_backward(variant):
    """dS_start = Mt dS_end + dH reproduces dh0 of the exact backward; chunked == recurrent backward."""
    head, h0 = _head_problem(variant, n=37)
    rng = np.random.default_rng(14)
    do = rng.standard_normal((37, 3))
    dht = rng.standard_normal((4, 3))
    g_rec = ref.recurrent_backward(variant, **head, do=do, dht=dht, initial_state=h0)
    g_chk = ref.chunked_backward(variant, **head, do=do, dht=dht, initial_state=h0, chunk_size=16)
    for name in g_rec:
        assert rel_err(g_chk[name], g_rec[name]) < EXACT, name
    Mt, dH = ref.span_affine_backward(variant, **head, do=do, chunk_size=16)
    M, _ = ref.span_affine(variant, **head, chunk_size=16)
    assert rel_err(Mt, M.T) < EXACT
    assert rel_err(Mt @ dht + dH, g_rec["dh0"]) < EXACT


def test_chunk_ranges():
    assert [tuple(r) for r in ref.chunk_ranges(10, 4)] == [(0, 4), (4, 8), (8, 10)]


def test_package_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import numpy as np, deltacp\n"
            "q = np.ones((1, 3, 1, 2)); o, ht = deltacp.reference.delta_rule(q, q, q, np.full((1, 3, 1), 0.5))\n"
            "assert o.shape == (1, 3, 1, 2) and ht.shape == (1, 1, 2, 2)\n"
            "print('ok', deltacp.built_with_cuda())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_version_and_error_type():
    assert deltacp.__version__
    assert issubclass(deltacp.Error, ValueError)


def test_cuda_release_workspace_without_any_cuda_work_is_a_no_op():
    """deltacp.cuda_release_workspace() before any CUDA call (and in CPU-only builds) does nothing and raises
    nothing (cuda/common/workspace_pool.h: no pool, no device call)."""
    deltacp.cuda_release_workspace()
