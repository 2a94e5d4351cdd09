"""The torch ops on CPU tensors: torch.autograd.gradcheck on small float64 problems for each op, the
numpy and torch paths agree, views are used without copies, and FLA's calling conventions work."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
import deltacp.reference as ref  # noqa: E402
from deltacp_testutil import VARIANTS, call_torch_op as _call, input_names, make_problem, ref_backward, ref_forward, rel_err  # noqa: E402




def _tensors(p, variant, requires_grad=True, dtype=torch.float64):
    t = {name: torch.tensor(p[name], dtype=dtype, requires_grad=requires_grad) for name in input_names(variant)}
    if p["initial_state"] is not None:
        t["h0"] = torch.tensor(p["initial_state"], dtype=dtype, requires_grad=requires_grad)
    return t


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", ["reference", "recurrent"])
@pytest.mark.parametrize("varlen", [False, True])
def test_gradcheck(variant, backend, varlen):
    cu = [0, 3, 20] if varlen else None  # T <= 20, with a sequence longer than one chunk of 16
    p = make_problem(variant, B=1, T=20, H=1, HV=2, K=3, V=2, cu_seqlens=cu, seed=20)
    t = _tensors(p, variant)
    names = input_names(variant)
    cu_t = None if cu is None else torch.tensor(cu)

    def f(*xs):
        d = dict(zip(names + ["h0"], xs))
        return _call(variant, d, initial_state=d["h0"], output_final_state=True, cu_seqlens=cu_t, backend=backend,
                     chunk_size=16)

    assert torch.autograd.gradcheck(f, tuple(t[n] for n in names + ["h0"]), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_numpy_and_torch_agree(variant):
    p = make_problem(variant, B=2, T=21, H=2, K=5, V=4, seed=21)
    rng = np.random.default_rng(22)
    do = rng.standard_normal((2, 21, 2, 4))
    dht = rng.standard_normal((2, 2, 5, 4))
    o_np, ht_np = ref_forward(ref, variant, p, chunk_size=16)
    g_np = ref_backward(ref, variant, p, do, dht, chunk_size=16)
    t = _tensors(p, variant)
    o, ht = _call(variant, t, initial_state=t["h0"], output_final_state=True, chunk_size=16)
    assert o.dtype == torch.float64 and ht.dtype == torch.float64
    assert rel_err(o.detach().numpy(), o_np) < 1e-14
    assert rel_err(ht.detach().numpy(), ht_np) < 1e-14
    ((o * torch.tensor(do)).sum() + (ht * torch.tensor(dht)).sum()).backward()
    for name in input_names(variant):
        assert rel_err(t[name].grad.numpy(), g_np["d" + name]) < 1e-14, name
    assert rel_err(t["h0"].grad.numpy(), g_np["dh0"]) < 1e-14


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)])
def test_low_precision_inputs(dtype, tol):
    """fp32 / bf16 / fp16 tensors: outputs in the input dtype, state fp32, close to the fp64 reference
    evaluated on the same (rounded) inputs."""
    p = make_problem("gdn", B=1, T=40, H=2, K=8, V=8, seed=23)
    t = _tensors(p, "gdn", requires_grad=True, dtype=dtype)
    o, ht = deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0"],
                                           output_final_state=True)
    assert o.dtype == dtype and ht.dtype == torch.float32
    rounded = {name: t[name].detach().double().numpy() for name in ("q", "k", "v", "g", "beta")}
    o64, ht64 = ref.gated_delta_rule(rounded["q"], rounded["k"], rounded["v"], rounded["g"], rounded["beta"],
                                     initial_state=t["h0"].detach().double().numpy())
    assert rel_err(o.detach().double().numpy(), o64) < tol
    assert rel_err(ht.detach().double().numpy(), ht64) < tol
    o.float().sum().backward()
    assert t["q"].grad.dtype == dtype and torch.isfinite(t["q"].grad.float()).all()
    assert t["h0"].grad.dtype == dtype  # through the differentiable cast to the fp32 state


def test_views_are_used_without_copies():
    """q, k, v split from one fused projection (head-axis strides) give the same results and gradients."""
    p = make_problem("gdn", B=2, T=13, H=2, K=4, V=4, seed=24)
    fused = torch.tensor(np.concatenate([p["q"], p["k"], p["v"]], axis=-1), requires_grad=True)
    q, k, v = fused[..., :4], fused[..., 4:8], fused[..., 8:]
    assert not q.is_contiguous()
    g, beta = torch.tensor(p["g"]), torch.tensor(p["beta"])
    o, _ = deltacp.chunk_gated_delta_rule(q, k, v, g, beta)
    o.sum().backward()  # an expanded (stride 0) upstream gradient
    qc, kc, vc = (torch.tensor(p[n], requires_grad=True) for n in ("q", "k", "v"))
    oc, _ = deltacp.chunk_gated_delta_rule(qc, kc, vc, g, beta)
    oc.sum().backward()
    assert torch.equal(o, oc)
    assert torch.equal(fused.grad, torch.cat([qc.grad, kc.grad, vc.grad], dim=-1))


def test_only_final_state_in_the_loss():
    p = make_problem("kda", B=1, T=9, H=1, K=3, V=2, seed=25)
    t = _tensors(p, "kda")
    _, ht = deltacp.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["h0"],
                              output_final_state=True)
    ht.sum().backward()
    grads = ref.kda_backward(p["q"], p["k"], p["v"], p["g"], p["beta"], np.zeros((1, 9, 1, 2)),
                             dht=np.ones((1, 1, 3, 2)), initial_state=p["initial_state"], chunk_size=64)
    assert rel_err(t["v"].grad.numpy(), grads["dv"]) < 1e-14
    assert rel_err(t["h0"].grad.numpy(), grads["dh0"]) < 1e-14
    assert torch.count_nonzero(t["q"].grad) == 0  # o does not reach the loss


def test_fla_conventions():
    p = make_problem("gdn", B=1, T=10, H=2, K=4, V=3, seed=26)
    t = _tensors(p, "gdn", requires_grad=False)
    o, ht = deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"])
    assert ht is None  # output_final_state defaults to False, as in FLA
    o2, _ = deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], 4 ** -0.5)  # positional scale
    assert torch.equal(o, o2)
    with torch.no_grad():
        o3, _ = deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], backend="recurrent")
    assert rel_err(o3.numpy(), o.numpy()) < 1e-12
    # use_qk_l2norm_in_kernel == normalising q and k first (FLA's eps 1e-6)
    qn = t["q"] / torch.sqrt((t["q"] ** 2).sum(-1, keepdim=True) + 1e-6)
    kn = t["k"] / torch.sqrt((t["k"] ** 2).sum(-1, keepdim=True) + 1e-6)
    o4, _ = deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], use_qk_l2norm_in_kernel=True)
    o5, _ = deltacp.chunk_gated_delta_rule(qn, kn, t["v"], t["g"], t["beta"])
    assert rel_err(o4.numpy(), o5.numpy()) < 1e-14
    assert deltacp.chunk_dplr_delta_rule is deltacp.dplr.chunk_dplr_delta_rule  # FLA's order: deltacp.dplr


def test_cp_context_is_handed_to_deltacp_cp():
    """cp_context goes to deltacp.cp (tests/python/test_cp_gloo.py runs it on real process groups);
    here only that a wrong context is refused by name."""
    p = make_problem("gdn", B=1, T=4, H=1, K=2, V=2, seed=27)
    t = _tensors(p, "gdn", requires_grad=False)
    with pytest.raises((TypeError, NotImplementedError), match="cp_context"):
        deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], cp_context=object())
