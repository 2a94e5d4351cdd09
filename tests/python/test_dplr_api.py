"""deltacp.chunk_dplr_delta_rule and deltacp.chunk_rwkv7 on the CPU: FLA's argument names and order, RWKV-7's
w convention and [V, K] state layout, gradients, and the gate range of the chunk form (deltacp/dplr.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
import deltacp.reference as ref  # noqa: E402
from deltacp import dplr  # noqa: E402
from deltacp_testutil import make_problem, rel_err, rwkv7_inputs  # noqa: E402


def _t(x, dtype=torch.float64, requires_grad=False):
    return torch.tensor(np.asarray(x), dtype=dtype, requires_grad=requires_grad)


def _problem(B=2, T=37, H=2, K=8, V=6, seed=0, cu_seqlens=None):
    p = make_problem("dplr", B=B, T=T, H=H, K=K, V=V, seed=seed, cu_seqlens=cu_seqlens)
    return p, {n: _t(p[n]) for n in ("q", "k", "v", "a", "b", "g")}


def _rwkv7_native(r, w, k, v, a, b, state_vk, scale):
    """RWKV-7's own recurrence, written on its [V, K] state (numpy, float64): per token
    S <- S diag(exp(w)) + (S a) b^T + v k^T, y = S (scale r). Returns (y, final state [N, H, V, K])."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    y = np.zeros((B, T, H, V))
    S = np.array(state_vk, dtype=np.float64).copy()
    for n in range(B):
        for h in range(H):
            for t in range(T):
                s = S[n, h]
                s = s * np.exp(w[n, t, h])[None, :] + np.outer(s @ a[n, t, h], b[n, t, h]) + np.outer(v[n, t, h],
                                                                                                        k[n, t, h])
                S[n, h] = s
                y[n, t, h] = s @ (scale * r[n, t, h])
    return y, S


def test_fla_positional_order_and_names():
    """All of FLA's positional arguments in FLA's order; the same call with FLA's keyword names."""
    p, t = _problem(B=1, T=29, cu_seqlens=[0, 11, 29], seed=1)
    h0 = _t(p["initial_state"])
    cu = torch.tensor([0, 11, 29])
    o_ref, ht_ref = ref.dplr(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], scale=0.3,
                             initial_state=p["initial_state"], cu_seqlens=p["cu_seqlens"])
    # q, k, v, a, b, gk, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, safe_gate,
    # chunk_size, disable_recompute, cp_context, lower_bound
    o, ht = deltacp.chunk_dplr_delta_rule(t["q"], t["k"], t["v"], t["a"], t["b"], t["g"], 0.3, h0, True, cu, cu,
                                          False, 16, False, None, None)
    assert rel_err(o.numpy(), o_ref) < 1e-12 and rel_err(ht.numpy(), ht_ref) < 1e-12
    o2, ht2 = deltacp.chunk_dplr_delta_rule(q=t["q"], k=t["k"], v=t["v"], a=t["a"], b=t["b"], gk=t["g"], scale=0.3,
                                            initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                            cu_seqlens_cpu=cu, safe_gate=True, chunk_size=32, disable_recompute=True,
                                            cp_context=None, lower_bound=-10.0)
    assert rel_err(o2.numpy(), o_ref) < 1e-12 and rel_err(ht2.numpy(), ht_ref) < 1e-12
    # scale=None is K^-1/2 (FLA's default); output_final_state=False returns None
    o3, ht3 = deltacp.chunk_dplr_delta_rule(t["q"], t["k"], t["v"], t["a"], t["b"], t["g"])
    o3_ref, _ = ref.dplr(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], scale=8 ** -0.5)
    assert ht3 is None and rel_err(o3.numpy(), o3_ref) < 1e-12
    assert deltacp.chunk_dplr_delta_rule is dplr.chunk_dplr_delta_rule
    assert deltacp.chunk_rwkv7 is dplr.chunk_rwkv7


def test_rwkv7_is_dplr_with_r_as_q_and_w_as_gk():
    """chunk_rwkv7(r, w, k, v, a, b): q = r, gk = w unchanged (FLA's convention: w is the log decay), scale 1.0."""
    p, t = _problem(seed=2)
    o, ht = deltacp.chunk_rwkv7(t["q"], t["g"], t["k"], t["v"], t["a"], t["b"], output_final_state=True)
    o_ref, ht_ref = ref.dplr(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], scale=1.0)
    assert rel_err(o.numpy(), o_ref) < 1e-12 and rel_err(ht.numpy(), ht_ref) < 1e-12
    o2, _ = deltacp.chunk_dplr_delta_rule(t["q"], t["k"], t["v"], t["a"], t["b"], t["g"], 1.0)
    assert torch.equal(o, o2)


def test_rwkv7_native_recurrence_and_state_v_first():
    """Against RWKV-7's own [V, K] recurrence with FLA's layer inputs (w = -exp(-0.5) sigmoid(.), a = -kk,
    b = kk * a): output, the [V, K] initial and final states (state_v_first=True)."""
    rng = np.random.default_rng(3)
    B, T, H, K, V = 2, 23, 2, 8, 4
    x = rwkv7_inputs(rng, B, T, H, K, V)
    r, w, k, v, a, b = (x[n] for n in ("r", "w", "k", "v", "a", "b"))
    s0_vk = 0.3 * rng.standard_normal((B, H, V, K))
    y_ref, s_ref = _rwkv7_native(r, w, k, v, a, b, s0_vk, 1.0)
    for backend in ("reference", "recurrent"):
        y, s = deltacp.chunk_rwkv7(_t(r), _t(w), _t(k), _t(v), _t(a), _t(b), initial_state=_t(s0_vk),
                                   output_final_state=True, chunk_size=16, backend=backend, state_v_first=True)
        assert s.shape == (B, H, V, K) and s.is_contiguous()
        assert rel_err(y.numpy(), y_ref) < 1e-12, backend
        assert rel_err(s.numpy(), s_ref) < 1e-12, backend
    # the [K, V] layout is the transpose
    y2, s2 = deltacp.chunk_rwkv7(_t(r), _t(w), _t(k), _t(v), _t(a), _t(b), initial_state=_t(s0_vk).transpose(-1, -2),
                                 output_final_state=True)
    assert rel_err(y2.numpy(), y_ref) < 1e-12 and rel_err(s2.numpy(), np.swapaxes(s_ref, -1, -2)) < 1e-12


def test_gradients_match_reference_and_v_first_state_grad():
    p, _ = _problem(B=1, T=40, cu_seqlens=[0, 17, 40], seed=4)
    rng = np.random.default_rng(5)
    do = rng.standard_normal(p["v"].shape)
    dht = rng.standard_normal(p["initial_state"].shape)
    g_ref = ref.dplr_backward(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], do, dht=dht, scale=0.5,
                              initial_state=p["initial_state"], cu_seqlens=p["cu_seqlens"])
    t = {n: _t(p[n], requires_grad=True) for n in ("q", "k", "v", "a", "b", "g")}
    h0_vk = _t(np.swapaxes(p["initial_state"], -1, -2), requires_grad=True)
    o, ht_vk = deltacp.chunk_dplr_delta_rule(t["q"], t["k"], t["v"], t["a"], t["b"], t["g"], 0.5, h0_vk, True,
                                             torch.tensor(p["cu_seqlens"]), chunk_size=16, state_v_first=True)
    ((o * _t(do)).sum() + (ht_vk * _t(np.swapaxes(dht, -1, -2))).sum()).backward()
    for n, gname in (("q", "dq"), ("k", "dk"), ("v", "dv"), ("a", "da"), ("b", "db"), ("g", "dgk")):
        assert rel_err(t[n].grad.numpy(), g_ref[gname]) < 1e-11, n
    assert rel_err(h0_vk.grad.numpy(), np.swapaxes(g_ref["dh0"], -1, -2)) < 1e-11


def test_bad_arguments_are_named():
    _, t = _problem(B=1, T=5, seed=6)
    args = (t["q"], t["k"], t["v"], t["a"], t["b"], t["g"])
    with pytest.raises(ValueError, match="lower_bound"):
        deltacp.chunk_dplr_delta_rule(*args, lower_bound=0.5)
    with pytest.raises(TypeError, match="lower_bound"):
        deltacp.chunk_dplr_delta_rule(*args, lower_bound="x")
    with pytest.raises(ValueError, match="chunk_size"):
        deltacp.chunk_dplr_delta_rule(*args, chunk_size=48)
    with pytest.raises(ValueError, match="backend"):
        deltacp.chunk_dplr_delta_rule(*args, backend="fused")
    with pytest.raises(ValueError, match="backend"):
        deltacp.chunk_dplr_delta_rule(*args, backend="tiled")  # a CUDA tier, CPU tensors
    with pytest.raises(TypeError, match="safe_gate"):
        deltacp.chunk_dplr_delta_rule(*args, safe_gate="yes")
    with pytest.raises(ValueError, match="initial_state"):
        deltacp.chunk_rwkv7(t["q"], t["g"], t["k"], t["v"], t["a"], t["b"], initial_state=torch.zeros(2, 8, 6),
                            state_v_first=True)
    with pytest.raises(TypeError, match="gk"):
        deltacp.chunk_dplr_delta_rule(t["q"], t["k"], t["v"], t["a"], t["b"], [0.0])


# ---- the gate range of the chunk form -------------------------------------------------------------------
def _mixed_gates(shape, gmin, seed):
    """Mostly mild gates (-0.5 .. 0) with 30% of them at gmin: large |cumulative gate| beside small steps,
    where fp32 differences G_i - G_j lose digits."""
    rng = np.random.default_rng(seed)
    g = -rng.uniform(0.0, 0.5, shape)
    g[rng.random(shape) < 0.3] = gmin
    return g


def _fp32_problem(gmin, seed, T=256, K=32, V=32):
    p = make_problem("dplr", B=1, T=T, H=2, K=K, V=V, seed=seed, h0=False)
    p["g"] = _mixed_gates(p["g"].shape, gmin, seed + 1)
    return p


def _err(x, y):
    return float(np.abs(np.asarray(x, np.float64) - y).max() / np.abs(y).max())


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_gate_range_edges_on_the_chunked_reference(chunk_size):
    """The measured edge: in float32 the chunk form's error grows like chunk_size * |min gk|; at the
    accepted edge (chunk_size * |min gk| = 1024) it stays within 2e-5 of float64 (measured <= 8.3e-6),
    at 16x past it, it does not (measured 1.4e-4 .. 1.4e-3), while the token recurrence stays at ~2e-7."""
    gk_min, gk_max = dplr.gate_range(chunk_size)
    assert gk_max == 0.0 and gk_min == -dplr.GK_SPAN / chunk_size
    for gmin, ok in ((gk_min, True), (16 * gk_min, False)):
        p = _fp32_problem(gmin, seed=7)
        args = [p[n] for n in ("q", "k", "v", "a", "b", "g")]
        o64, h64 = ref.dplr(*args)
        f32 = [x.astype(np.float32) for x in args]
        o32, h32 = ref.dplr(*f32, chunk_size=chunk_size)
        err = max(_err(o32, o64), _err(h32, h64))
        assert (err < 2e-5) == ok, (gmin, err)
        orec, hrec = ref.dplr(*f32)
        assert max(_err(orec, o64), _err(hrec, h64)) < 2e-6


def test_gates_outside_the_range_fall_back_to_the_recurrence():
    """Outside [GK_MIN, 0] the op runs the token recurrence (never the chunk form's degraded answer); inside
    it runs the chunk form; lower_bound (FLA's promise) or gate_check=False skip the check."""
    for gmin in (-64.0, 3.0):  # too negative for chunk 64 (GK_MIN = -16); growth (gk > 0)
        p = _fp32_problem(-16.0, seed=8, T=70)
        g = p["g"] if gmin < 0 else np.abs(p["g"]) * 0.05
        if gmin < 0:
            g = g.copy()
            g[0, 5, 0, 3] = gmin
        t = {n: _t(p[n], torch.float32) for n in ("q", "k", "v", "a", "b")}
        gt = _t(g, torch.float32)
        args = (t["q"], t["k"], t["v"], t["a"], t["b"], gt)
        o, ht = deltacp.chunk_dplr_delta_rule(*args, output_final_state=True)
        o_rec, ht_rec = deltacp.chunk_dplr_delta_rule(*args, output_final_state=True, backend="recurrent")
        o_chk, _ = deltacp.chunk_dplr_delta_rule(*args, output_final_state=True, gate_check=False)
        o_ops, _ = deltacp.chunk_dplr(*args, output_final_state=True)  # ops' op: always the chunk form
        assert torch.equal(o, o_rec) and torch.equal(ht, ht_rec), gmin
        assert torch.equal(o_chk, o_ops) and not torch.equal(o_chk, o_rec), gmin
    # inside the range (the edge itself included): the chunk form
    p = _fp32_problem(-16.0, seed=9, T=70)
    t = {n: _t(p[n], torch.float32) for n in ("q", "k", "v", "a", "b", "g")}
    args = (t["q"], t["k"], t["v"], t["a"], t["b"], t["g"])
    assert float(t["g"].min()) == -16.0
    o, _ = deltacp.chunk_dplr_delta_rule(*args)
    assert torch.equal(o, deltacp.chunk_dplr(*args)[0])
    # lower_bound within the range: trusted, no check (the chunk form even where a gate breaks the promise)
    g_bad = t["g"].clone()
    g_bad[0, 3, 1, 2] = -100.0
    args_bad = args[:5] + (g_bad,)
    o_lb, _ = deltacp.chunk_dplr_delta_rule(*args_bad, lower_bound=-1.0)
    assert torch.equal(o_lb, deltacp.chunk_dplr(*args_bad)[0])
    # lower_bound below the range: the check runs and falls back
    o_lb2, _ = deltacp.chunk_dplr_delta_rule(*args_bad, lower_bound=-1000.0)
    assert torch.equal(o_lb2, deltacp.chunk_dplr_delta_rule(*args_bad, backend="recurrent")[0])
