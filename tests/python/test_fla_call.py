"""FLA 0.5.2's keyword arguments of chunk_gated_delta_rule / chunk_kda (deltacp/fla_options.py).

Each option against the float64 reference (deltacp.reference.fla_forward / fla_backward, whose option
backward is written by hand, not by autograd), gradients included (dA_log, ddt_bias, through the l2
norm and the sigmoid); torch.autograd.gradcheck of the whole chain; FLA's golden vectors reached
through the options (raw inputs made so that the options give back the golden inputs); the
intermediate states; safe_gate's range; and the errors for arguments deltacp does not take."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
import deltacp.reference as ref  # noqa: E402
from deltacp.errors import InvalidArgumentError  # noqa: E402
from deltacp_testutil import rel_err  # noqa: E402

OPS = {"gdn": deltacp.chunk_gated_delta_rule, "kda": deltacp.chunk_kda}
# option sets (A_log / dt_bias are filled in by _raw); "kimi" / "qwen3next" are the FLA layers' calls
CASES = {
    "l2norm": dict(use_qk_l2norm_in_kernel=True),
    "beta_sigmoid": dict(use_beta_sigmoid_in_kernel=True),
    "neg_eigval": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "gate": dict(use_gate_in_kernel=True, A_log=True, dt_bias=True),
    "gate_no_bias": dict(use_gate_in_kernel=True, A_log=True),
    "state_v_first": dict(state_v_first=True),
    "lower_bound_gate": dict(use_gate_in_kernel=True, A_log=True, dt_bias=True, lower_bound=-3.0),
    "kimi": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=True, dt_bias=True,
                 use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, safe_gate=True, lower_bound=-5.0,
                 state_v_first=True),
    "qwen3next": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=True, dt_bias=True,
                      use_beta_sigmoid_in_kernel=True, state_v_first=True),
}
KDA_ONLY = ("lower_bound_gate", "kimi")
GDN_KDA = [(v, c) for c in CASES for v in ("gdn", "kda") if not (v == "gdn" and c in KDA_ONLY)]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _raw(variant, case, B=2, T=21, H=1, HV=2, K=5, V=4, cu=None, seed=0):
    """Raw float64 inputs for the options of `case`: q, k not normalised, beta logits or values in
    (0, 1), g a log decay or the raw gate input. -> (arrays dict, options dict with arrays)."""
    rng = np.random.default_rng(seed)
    opts = dict(CASES[case])
    if cu is not None:
        B, T = 1, cu[-1]
    N = B if cu is None else len(cu) - 1
    gshape = (B, T, HV) if variant == "gdn" else (B, T, HV, K)
    p = {"q": rng.standard_normal((B, T, H, K)), "k": rng.standard_normal((B, T, H, K)),
         "v": rng.standard_normal((B, T, HV, V))}
    if not opts.get("use_qk_l2norm_in_kernel"):
        p["k"] /= np.linalg.norm(p["k"], axis=-1, keepdims=True)
    logits = rng.standard_normal((B, T, HV))
    p["beta"] = logits if opts.get("use_beta_sigmoid_in_kernel") else ref.sigmoid(logits)
    raw_g = rng.standard_normal(gshape)
    p["g"] = raw_g if opts.get("use_gate_in_kernel") else np.log(ref.sigmoid(raw_g + 2.0))
    p["h0"] = 0.5 * rng.standard_normal((N, HV, V, K) if opts.get("state_v_first") else (N, HV, K, V))
    if opts.get("A_log"):
        opts["A_log"] = 0.5 * rng.standard_normal(HV)
    if opts.get("dt_bias"):
        opts["dt_bias"] = 0.5 * rng.standard_normal(HV if variant == "gdn" else HV * K)
    p["do"] = rng.standard_normal((B, T, HV, V))
    p["dht"] = rng.standard_normal(p["h0"].shape)
    return p, opts


def _torch_call(variant, p, opts, dtype=torch.float64, device="cpu", cu=None, param_dtype=None, **kw):
    """(o, ht, tensors by name) of the torch op on p's raw inputs; h0 / A_log / dt_bias in
    param_dtype (float32 for low-precision calls, as FLA layers keep them)."""
    param_dtype = param_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
    t = {n: torch.tensor(p[n], dtype=dtype, device=device, requires_grad=True) for n in ("q", "k", "v", "g", "beta")}
    t["h0"] = torch.tensor(p["h0"], dtype=param_dtype, device=device, requires_grad=True)
    o_kw = dict(opts)
    for name in ("A_log", "dt_bias"):
        if name in o_kw:
            t[name] = torch.tensor(o_kw[name], dtype=param_dtype, device=device, requires_grad=True)
            o_kw[name] = t[name]
    cu_t = None if cu is None else torch.tensor(cu, device=device)
    o, ht = OPS[variant](t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0"], output_final_state=True,
                         cu_seqlens=cu_t, **o_kw, **kw)
    return o, ht, t


def _rounded(p, opts, t):
    """p and opts with the values the torch tensors actually hold (after rounding to their dtype)."""
    r = dict(p)
    o = dict(opts)
    for n in ("q", "k", "v", "g", "beta", "h0"):
        r[n] = t[n].detach().double().cpu().numpy()
    for n in ("A_log", "dt_bias"):
        if n in t:
            o[n] = t[n].detach().double().cpu().numpy()
    return r, o


def _core_inputs(variant, r, o, dtype):
    """(q, k, g, beta) as the op's pre-pass hands them to the delta rule: each option in float64, then
    rounded to the dtype the op keeps it in (q, k, beta: the input dtype; the gate's log decay: float32).
    None in float64, where the reference's own pre-pass is what the op computes."""
    if dtype == torch.float64:
        return None

    def rnd(x, dt):
        return torch.tensor(x).to(dt).double().numpy()

    q, k, g, beta = r["q"], r["k"], r["g"], r["beta"]
    if o.get("use_qk_l2norm_in_kernel"):
        q, k = rnd(ref.l2norm(q), dtype), rnd(ref.l2norm(k), dtype)
    if o.get("use_beta_sigmoid_in_kernel"):
        beta = rnd(ref.beta_sigmoid(beta, o.get("allow_neg_eigval", False)), dtype)
    if o.get("use_gate_in_kernel"):
        g = rnd(ref.fla_gate(variant, g, o["A_log"], o.get("dt_bias"), o.get("lower_bound")), torch.float32)
    return q, k, g, beta


def _check_against_reference(variant, case, dtype, device, backend, cu=None, chunk_size=16, **shape):
    """The op on p's raw inputs against the reference applied to the pre-processed inputs (in float64
    the reference's own pre-pass; in 16-bit / float32 the pre-pass rounded as the op rounds it), forward
    and every gradient, the options' gradients by the reference's hand-written chain rule."""
    p, opts = _raw(variant, case, cu=cu, **shape)
    o, ht, t = _torch_call(variant, p, opts, dtype=dtype, device=device, cu=cu, backend=backend,
                           chunk_size=chunk_size)
    r, ropts = _rounded(p, opts, t)
    ropts.pop("safe_gate", None)
    ropts["core_inputs"] = _core_inputs(variant, r, ropts, dtype)
    o_ref, ht_ref = ref.fla_forward(variant, r["q"], r["k"], r["v"], r["g"], r["beta"], initial_state=r["h0"],
                                    cu_seqlens=cu, chunk_size=16, **ropts)
    tol = TOL[dtype]
    assert o.dtype == dtype and ht.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert ht.shape == t["h0"].shape
    assert rel_err(o.detach().double().cpu().numpy(), o_ref) < tol
    assert rel_err(ht.detach().double().cpu().numpy(), ht_ref) < tol
    do = torch.tensor(p["do"], dtype=dtype, device=device)
    dht = torch.tensor(p["dht"], dtype=ht.dtype, device=device)
    ((o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()).backward()
    g_ref = ref.fla_backward(variant, r["q"], r["k"], r["v"], r["g"], r["beta"], do.double().cpu().numpy(),
                             dht=dht.double().cpu().numpy(), initial_state=r["h0"], cu_seqlens=cu, chunk_size=16,
                             **ropts)
    names = ["q", "k", "v", "g", "beta", "h0"] + [n for n in ("A_log", "dt_bias") if n in t]
    for name in names:
        want = g_ref["dh0" if name == "h0" else "d" + name]
        assert t[name].grad.dtype == t[name].dtype, f"d{name} dtype"
        err = rel_err(t[name].grad.double().cpu().numpy(), want)
        assert err < tol, f"d{name}: {err:.3e} (tolerance {tol})"


@pytest.mark.parametrize("variant,case", GDN_KDA)
@pytest.mark.parametrize("backend", ["reference", "recurrent"])
def test_option_against_reference_fp64(variant, case, backend):
    _check_against_reference(variant, case, torch.float64, "cpu", backend)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_options_varlen_fp64(variant):
    _check_against_reference(variant, "kimi" if variant == "kda" else "qwen3next", torch.float64, "cpu",
                             "reference", cu=[0, 3, 20, 29])


@pytest.mark.parametrize("variant", ["gdn", "kda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_options_low_precision_cpu(variant, dtype):
    """float32 / bfloat16 tensors (A_log, dt_bias, h0 in float32): the CPU reference tier in float32,
    against the float64 reference on the same rounded inputs."""
    _check_against_reference(variant, "kimi" if variant == "kda" else "qwen3next", dtype, "cpu", "reference")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("variant", ["gdn", "kda"])
@pytest.mark.parametrize("tier", ["naive", "tiled", None], ids=["naive", "tiled", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_options_cuda(variant, tier, dtype):
    """The options on the CUDA tiers (pre-pass in torch on the GPU), fixed and varlen shapes; "default"
    is backend=None, the dispatch's choice (the fused tier where its kernels apply)."""
    if not deltacp.built_with_cuda():
        pytest.fail("a CUDA device is present but deltacp was built without the CUDA tiers")
    if tier is not None and not deltacp._core.cuda_supports(variant, tier, True):
        pytest.skip(f"tier {tier} does not implement {variant} forward and backward in this build")
    case = "kimi" if variant == "kda" else "qwen3next"
    shape = dict(B=2, T=100, H=2, HV=4, K=128, V=128)
    _check_against_reference(variant, case, dtype, "cuda", tier, chunk_size=64, **shape)
    _check_against_reference(variant, case, dtype, "cuda", tier, cu=[0, 1, 70, 140], chunk_size=64, **shape)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_gradcheck_options(variant):
    """torch.autograd.gradcheck (float64, CPU) through every option at once: l2 norm, sigmoid with
    negative eigenvalues, the gate (dA_log, ddt_bias; kda's lower-bound form), the V-first state."""
    case = "kimi" if variant == "kda" else "qwen3next"
    p, opts = _raw(variant, case, B=1, T=20, H=1, HV=2, K=3, V=2, seed=3)
    names = ["q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias"]
    xs = [torch.tensor(p[n] if n in p else opts[n], requires_grad=True) for n in names]

    def f(q, k, v, g, beta, h0, A_log, dt_bias):
        kw = dict(opts, A_log=A_log, dt_bias=dt_bias)
        return OPS[variant](q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16, **kw)

    assert torch.autograd.gradcheck(f, tuple(xs), eps=1e-6, atol=1e-8, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# FLA's golden vectors through the options
# ---------------------------------------------------------------------------------------------
def _logit(p):
    return np.log(p) - np.log1p(-p)


@pytest.mark.parametrize("variant,gate", [("gdn", "softplus"), ("kda", "softplus"), ("kda", "lower_bound")])
def test_golden_through_options(golden, variant, gate):
    """The golden q, k are unit vectors and its gates log decays: scaled q, k with
    use_qk_l2norm_in_kernel, beta's logits with use_beta_sigmoid_in_kernel, and a raw gate that the
    gate maps back onto g (-exp(A_log) softplus(g + dt_bias), or kda's lower-bound form) give the
    golden outputs; the gradients are the golden ones chained through the options' derivatives."""
    z = golden(f"{variant}_small")
    HV = z["v"].shape[2]
    rng = np.random.default_rng(5)
    A_log = 0.3 * rng.standard_normal(HV)
    a = np.exp(A_log) if variant == "gdn" else np.exp(A_log)[:, None]
    K = z["q"].shape[-1]
    dt_bias = 0.2 * rng.standard_normal(HV if variant == "gdn" else HV * K)
    bias = dt_bias if variant == "gdn" else dt_bias.reshape(HV, K)
    if gate == "softplus":
        g_raw = np.log(np.expm1(-z["g"] / a)) - bias             # softplus^-1(-g / exp(A_log))
        lower_bound = None
    else:
        lower_bound = -2.0                                      # golden kda gates lie in (-2, 0)
        assert z["g"].min() > lower_bound
        g_raw = _logit(z["g"] / lower_bound) / a - bias
    opts = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
                state_v_first=True)
    if lower_bound is not None:
        opts.update(lower_bound=lower_bound, safe_gate=True)
    raw = {"q": 2.5 * z["q"], "k": 0.7 * z["k"], "v": z["v"], "g": g_raw, "beta": _logit(z["beta"]),
           "h0": np.swapaxes(z["h0"], -1, -2)}
    t = {n: torch.tensor(x, requires_grad=True) for n, x in raw.items()}
    prm = {"A_log": torch.tensor(A_log, requires_grad=True), "dt_bias": torch.tensor(dt_bias, requires_grad=True)}
    o, ht = OPS[variant](t["q"], t["k"], t["v"], t["g"], t["beta"], z["scale"], t["h0"], True, **opts, **prm)
    assert rel_err(o.detach().numpy(), z["o"]) < 1e-5
    assert rel_err(ht.detach().numpy(), np.swapaxes(z["ht"], -1, -2)) < 1e-5
    ((o * torch.tensor(z["do"])).sum() + (ht * torch.tensor(np.swapaxes(z["dht"], -1, -2))).sum()).backward()
    # the golden gradients (with respect to the core inputs) chained by hand
    want = {"v": z["dv"], "h0": np.swapaxes(z["dh0"], -1, -2),
            "q": ref.l2norm_backward(raw["q"], z["dq"]), "k": ref.l2norm_backward(raw["k"], z["dk"]),
            "beta": ref.beta_sigmoid_backward(raw["beta"], z["dbeta"])}
    want["g"], dA, ddt = ref.fla_gate_backward(variant, g_raw, A_log, dt_bias, z["dg"], lower_bound)
    for name, w in want.items():
        assert rel_err(t[name].grad.numpy(), w) < 1e-5, name
    assert rel_err(prm["A_log"].grad.numpy(), dA) < 1e-5
    assert rel_err(prm["dt_bias"].grad.numpy(), ddt) < 1e-5


# ---------------------------------------------------------------------------------------------
# return_intermediate_states, safe_gate, the FLA call itself
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cu", [None, [0, 5, 40, 41, 58]], ids=["fixed", "varlen"])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_intermediate_states(cu, state_v_first):
    """kda's return_intermediate_states (inference mode): h = the state at each chunk start, against
    the per-head reference (deltacp.reference.chunk_states), sequence by sequence as in FLA."""
    case = "state_v_first" if state_v_first else "l2norm"
    p, opts = _raw("kda", case, B=2, T=37, H=1, HV=2, K=4, V=3, cu=cu, seed=7)
    t = {n: torch.tensor(p[n]) for n in ("q", "k", "v", "g", "beta", "h0")}
    cu_t = None if cu is None else torch.tensor(cu)
    with torch.inference_mode():
        o, ht, h = deltacp.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0"],
                                     output_final_state=True, cu_seqlens=cu_t, return_intermediate_states=True,
                                     chunk_size=16, **opts)
        o2, ht2 = deltacp.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0"],
                                    output_final_state=True, cu_seqlens=cu_t, chunk_size=16, **opts)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    q = ref.l2norm(p["q"]) if opts.get("use_qk_l2norm_in_kernel") else p["q"]
    k = ref.l2norm(p["k"]) if opts.get("use_qk_l2norm_in_kernel") else p["k"]
    h0 = np.swapaxes(p["h0"], -1, -2) if state_v_first else p["h0"]
    B, T = q.shape[:2]
    seqs = [(b, 0, T) for b in range(B)] if cu is None else [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]
    want = []
    for n, (b, s, e) in enumerate(seqs):
        per_head = [ref.chunk_states("kda", q[b, s:e, 0], k[b, s:e, 0], p["v"][b, s:e, hv], p["g"][b, s:e, hv],
                                     p["beta"][b, s:e, hv], initial_state=h0[n, hv], chunk_size=16)["states"][:-1]
                    for hv in range(2)]
        want.append(np.stack(per_head, axis=1))                 # [chunks, HV, K, V]
    want = np.concatenate(want).reshape((B if cu is None else 1, -1, 2, 4, 3))
    if state_v_first:
        want = np.swapaxes(want, -1, -2)
    assert h.shape == want.shape and h.dtype == t["q"].dtype
    assert rel_err(h.numpy(), want) < 1e-12


def test_safe_gate_range():
    """safe_gate=True promises lower_bound <= g <= 0: inside it the result is the plain one; outside
    it (and past FLA's floor -5 without lower_bound) the op raises InvalidArgumentError naming 'g'."""
    p, opts = _raw("kda", "l2norm", seed=9)
    t = {n: torch.tensor(p[n]) for n in ("q", "k", "v", "g", "beta")}
    plain, _ = deltacp.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"])
    lb = float(t["g"].min()) - 0.01
    safe, _ = deltacp.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], safe_gate=True, lower_bound=lb)
    assert torch.equal(plain, safe)
    with pytest.raises(InvalidArgumentError, match=r"'g'.*safe_gate"):
        deltacp.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], safe_gate=True, lower_bound=lb + 0.02)
    low = t["g"].clone()
    low[0, 3, 1, 2] = -5.5
    with pytest.raises(InvalidArgumentError, match=r"'g'.*-5.0 <= g <= 0"):
        deltacp.chunk_kda(t["q"], t["k"], t["v"], low, t["beta"], safe_gate=True)
    with pytest.raises(InvalidArgumentError, match=r"'g'.*safe_gate"):
        deltacp.chunk_kda(t["q"], t["k"], t["v"], -t["g"], t["beta"], safe_gate=True)  # growth, g > 0


def test_safe_gate_range_with_a_gradient_is_confirmed_by_the_backward():
    """With a gradient wanted the forward does not wait for safe_gate's range check (its result is exact for
    any gate): the backward raises, naming 'g', before it computes anything; inside the range it runs and
    its gradients are the plain call's."""
    p, _ = _raw("kda", "l2norm", seed=9)
    t = {n: torch.tensor(p[n], requires_grad=True) for n in ("q", "k", "v", "g", "beta")}
    xs = [t[n] for n in ("q", "k", "v", "g", "beta")]
    lb = float(t["g"].min()) - 0.01
    o_plain, _ = deltacp.chunk_kda(*xs)
    plain = torch.autograd.grad(o_plain.sum(), xs)
    o_safe, _ = deltacp.chunk_kda(*xs, safe_gate=True, lower_bound=lb)
    assert torch.equal(o_plain, o_safe)
    for a, b in zip(plain, torch.autograd.grad(o_safe.sum(), xs)):
        assert torch.equal(a, b)
    o_broken, _ = deltacp.chunk_kda(*xs, safe_gate=True, lower_bound=lb + 0.02)
    assert torch.equal(o_plain, o_broken)  # the forward is exact for any gate
    with pytest.raises(InvalidArgumentError, match=r"'g'.*safe_gate"):
        torch.autograd.grad(o_broken.sum(), xs)


def test_fla_positional_order_and_aliases():
    """FLA's positional order (chunk_kda: ..., output_final_state, use_qk_l2norm_in_kernel,
    use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, ...),
    the deprecated transpose_state_layout, disable_recompute and cu_seqlens_cpu (no effect on results)."""
    p, opts = _raw("kda", "kimi", seed=11)
    t = {n: torch.tensor(p[n]) for n in ("q", "k", "v", "g", "beta", "h0")}
    prm = dict(A_log=torch.tensor(opts["A_log"]), dt_bias=torch.tensor(opts["dt_bias"]))
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"])
    by_name = deltacp.chunk_kda(*args, initial_state=t["h0"], output_final_state=True,
                                **dict(opts, **prm))
    by_pos = deltacp.chunk_kda(*args, None, t["h0"], True, True, True, True, True, True, -5.0, False, False, True,
                               **prm)
    assert all(torch.equal(x, y) for x, y in zip(by_name, by_pos))
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        old = deltacp.chunk_kda(*args, None, t["h0"], True, True, True, True, True, True, -5.0,
                                transpose_state_layout=True, **prm)
    assert all(torch.equal(x, y) for x, y in zip(by_name, old))
    cu = torch.tensor([0, 21])
    x = {n: torch.tensor(v[:1]) for n, v in _raw("kda", "l2norm", seed=11)[0].items()}  # g: log decays
    a = deltacp.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu)[0]
    b = deltacp.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, cu_seqlens_cpu=cu.clone(),
                          disable_recompute=True)[0]
    assert torch.equal(a, b)
    gp, gopts = _raw("gdn", "qwen3next", seed=12)
    gt = {n: torch.tensor(gp[n]) for n in ("q", "k", "v", "g", "beta", "h0")}
    gprm = dict(A_log=torch.tensor(gopts["A_log"]), dt_bias=torch.tensor(gopts["dt_bias"]))
    gargs = (gt["q"], gt["k"], gt["v"], gt["g"], gt["beta"])
    by_name = deltacp.chunk_gated_delta_rule(*gargs, initial_state=gt["h0"], output_final_state=True,
                                             **dict(gopts, **gprm))
    # chunk_gated_delta_rule: ..., use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
    # state_v_first, cu_seqlens, ...
    by_pos = deltacp.chunk_gated_delta_rule(*gargs, None, gt["h0"], True, True, True, False, True,
                                            use_gate_in_kernel=True, **gprm)
    assert all(torch.equal(x, y) for x, y in zip(by_name, by_pos))


def test_delta_rule_fla_positional_order():
    """chunk_delta_rule(q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
    cu_seqlens, ...) as FLA 0.5.2 orders it."""
    rng = np.random.default_rng(14)
    q, k = (torch.tensor(rng.standard_normal((1, 20, 1, 4))) for _ in range(2))
    v = torch.tensor(rng.standard_normal((1, 20, 2, 3)))
    beta = torch.tensor(ref.sigmoid(rng.standard_normal((1, 20, 2))))
    h0 = torch.tensor(rng.standard_normal((2, 2, 4, 3)))
    cu = torch.tensor([0, 9, 20])
    by_pos = deltacp.chunk_delta_rule(q, k, v, beta, None, h0, True, True, cu)
    by_name = deltacp.chunk_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    assert all(torch.equal(x, y) for x, y in zip(by_pos, by_name))
    o_ref, ht_ref = ref.delta_rule(ref.l2norm(q.numpy()), ref.l2norm(k.numpy()), v.numpy(), beta.numpy(),
                                   initial_state=h0.numpy(), cu_seqlens=cu.numpy(), chunk_size=64)
    assert rel_err(by_pos[0].numpy(), o_ref) < 1e-12 and rel_err(by_pos[1].numpy(), ht_ref) < 1e-12


# ---------------------------------------------------------------------------------------------
# arguments deltacp does not take, and values it refuses
# ---------------------------------------------------------------------------------------------
_P, _O = _raw("kda", "l2norm", B=1, T=6, H=1, HV=1, K=4, V=2)
_GP, _ = _raw("gdn", "l2norm", B=1, T=6, H=1, HV=1, K=4, V=2)


def _kda_args():
    return tuple(torch.tensor(_P[n]) for n in ("q", "k", "v", "g", "beta"))


def _kda(**kw):
    return deltacp.chunk_kda(*_kda_args(), **kw)


def _gdn(**kw):
    t = {n: torch.tensor(_GP[n]) for n in ("q", "k", "v", "g", "beta")}
    return deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], **kw)


_A = torch.zeros(1, dtype=torch.float64)
ERROR_CASES = [
    ("unknown keyword", lambda: _kda(use_fast_path=True), TypeError, r"'use_fast_path'"),
    ("unknown keyword gdn", lambda: _gdn(foo=1), TypeError, r"'foo'"),
    ("safe_gate on gdn", lambda: _gdn(safe_gate=True), TypeError, r"'safe_gate'.*chunk_kda only"),
    ("lower_bound on gdn", lambda: _gdn(lower_bound=-5.0), TypeError, r"'lower_bound'"),
    ("return_intermediate_states on gdn", lambda: _gdn(return_intermediate_states=True), TypeError,
     r"'return_intermediate_states'"),
    ("chunk_indices", lambda: _gdn(chunk_indices=torch.zeros(2, 2)), TypeError, r"'chunk_indices'"),
    ("head_first", lambda: _kda(head_first=False), TypeError, r"'head_first'"),
    ("flag not a bool", lambda: _kda(use_qk_l2norm_in_kernel=torch.tensor([0, 6])), TypeError,
     r"'use_qk_l2norm_in_kernel'.*bool"),
    ("A_log missing", lambda: _kda(use_gate_in_kernel=True), InvalidArgumentError, r"'A_log'.*required"),
    ("A_log without the gate", lambda: _kda(A_log=_A), InvalidArgumentError, r"'A_log'.*use_gate_in_kernel"),
    ("dt_bias without the gate", lambda: _gdn(dt_bias=_A), InvalidArgumentError, r"'dt_bias'"),
    ("A_log shape", lambda: _kda(use_gate_in_kernel=True, A_log=torch.zeros(3, dtype=torch.float64)), InvalidArgumentError,
     r"'A_log'.*\[HV\]"),
    ("A_log not a tensor", lambda: _gdn(use_gate_in_kernel=True, A_log=0.0), TypeError, r"'A_log'"),
    ("dt_bias shape kda", lambda: _kda(use_gate_in_kernel=True, A_log=_A, dt_bias=_A), InvalidArgumentError,
     r"'dt_bias'.*\[HV \* K\]"),
    ("allow_neg_eigval alone", lambda: _kda(allow_neg_eigval=True), InvalidArgumentError,
     r"'allow_neg_eigval'.*use_beta_sigmoid_in_kernel"),
    ("lower_bound without effect", lambda: _kda(lower_bound=-3.0), InvalidArgumentError, r"'lower_bound'.*effect"),
    ("lower_bound type", lambda: _kda(use_gate_in_kernel=True, A_log=_A, lower_bound="low"), TypeError,
     r"'lower_bound'"),
    ("safe_gate needs lower_bound", lambda: _kda(use_gate_in_kernel=True, A_log=_A, safe_gate=True), InvalidArgumentError,
     r"'lower_bound'.*required"),
    ("safe_gate range", lambda: _kda(use_gate_in_kernel=True, A_log=_A, safe_gate=True, lower_bound=-6.0),
     InvalidArgumentError, r"'lower_bound'.*\[-5, 0\)"),
    ("intermediate states with grad", lambda: _kda(return_intermediate_states=True), InvalidArgumentError,
     r"'return_intermediate_states'.*inference_mode"),
    ("both state layout names", lambda: _kda(state_v_first=True, transpose_state_layout=True), InvalidArgumentError,
     r"'transpose_state_layout'"),
    ("old positional cu_seqlens", lambda: deltacp.chunk_kda(*_kda_args(), None, None, False, torch.tensor([0, 6])),
     TypeError,
     r"'use_qk_l2norm_in_kernel'"),
]


@pytest.mark.parametrize("label,call,exc,pattern", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_fla_argument_errors(label, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_intermediate_states_with_disable_recompute_is_refused():
    with torch.inference_mode(), pytest.raises(InvalidArgumentError, match="disable_recompute"):
        _kda(return_intermediate_states=True, disable_recompute=True)


def test_transpose_state_layout_warns():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _kda(transpose_state_layout=False)
    assert any(issubclass(w.category, DeprecationWarning) for w in seen)


# ---------------------------------------------------------------------------------------------
# context parallelism: the options are applied before the call reaches deltacp.cp
# ---------------------------------------------------------------------------------------------
_CP_T = 22
_CP_CU = [0, 5, 17, _CP_T]  # the middle sequence crosses the rank boundary at token 11


def _cp_inputs():
    p, opts = _raw("kda", "kimi", B=1, T=_CP_T, H=1, HV=2, K=4, V=3, seed=13)
    opts.pop("state_v_first")
    return p, opts


def _cp_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    from deltacp.cp import build_context

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        p, opts = _cp_inputs()
        lo, hi = rank * _CP_T // world, (rank + 1) * _CP_T // world
        t = {n: torch.tensor(p[n][:, lo:hi], requires_grad=True) for n in ("q", "k", "v", "g", "beta")}
        prm = {n: torch.tensor(opts[n], requires_grad=True) for n in ("A_log", "dt_bias")}
        ctx = build_context(torch.tensor(_CP_CU))
        o, _ = deltacp.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], cp_context=ctx, **dict(opts, **prm))
        (o * torch.tensor(p["do"][:, lo:hi])).sum().backward()
        out = {"o": o.detach().numpy()}
        out.update({"d" + n: x.grad.numpy() for n, x in {**t, **prm}.items()})
        np.savez(f"{out_dir}/rank{rank}.npz", **out)
    finally:
        dist.destroy_process_group()


def test_options_under_context_parallelism(tmp_path):
    """Two gloo processes, a sequence crossing the rank boundary, every kda option: the per-rank
    outputs and gradients equal the single-process call's slices; dA_log and ddt_bias summed over
    the ranks equal the single-process ones."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    world = 2
    # spawn (not fork: autograd's threads in this process make a forked child's backward fail)
    mp.start_processes(_cp_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    p, opts = _cp_inputs()
    t = {n: torch.tensor(p[n], requires_grad=True) for n in ("q", "k", "v", "g", "beta")}
    prm = {n: torch.tensor(opts[n], requires_grad=True) for n in ("A_log", "dt_bias")}
    o, _ = deltacp.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], cu_seqlens=torch.tensor(_CP_CU),
                             **dict(opts, **prm))
    (o * torch.tensor(p["do"])).sum().backward()
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(world)]
    assert rel_err(np.concatenate([r["o"] for r in ranks], axis=1), o.detach().numpy()) < 1e-11
    for n, x in t.items():
        assert rel_err(np.concatenate([r["d" + n] for r in ranks], axis=1), x.grad.numpy()) < 1e-11, n
    for n, x in prm.items():
        assert rel_err(sum(r["d" + n] for r in ranks), x.grad.numpy()) < 1e-11, n
