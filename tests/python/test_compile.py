"""The ops under torch.library and torch.compile: torch.library.opcheck on deltacp::chunk_fwd /
deltacp::chunk_bwd (schema, fake implementations, registered autograd, AOT dispatch with dynamic
shapes), and layers written for FLA's GDN and KDA calls compiled with fullgraph=True (no graph break)
giving the eager results and gradients.

On the CPU the compiled cases use the aot_eager backend (Dynamo + AOTAutograd: the whole trace, with
the fake implementations and the registered backward; Inductor's C++ code generation would add tens of
seconds to CI and tests nothing of deltacp's). On a CUDA device the layer goes through Inductor."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
from deltacp import _library  # noqa: E402
from deltacp_testutil import make_problem, rel_err  # noqa: E402


def _op_args(variant, output_final_state=True, cu=None, dtype=torch.float64):
    p = make_problem(variant, B=1 if cu else 2, T=20, H=1, HV=1 if variant == "dplr" else 2, K=4, V=3, seed=50,
                     cu_seqlens=cu)
    t = {n: (None if p.get(n) is None else torch.tensor(p[n], dtype=dtype, requires_grad=True))
         for n in ("q", "k", "v", "g", "beta", "a", "b")}
    h0 = torch.tensor(p["initial_state"], dtype=dtype, requires_grad=True)
    cu_t = None if cu is None else torch.tensor(cu)
    return (t["q"], t["k"], t["v"], t["g"], t["beta"], t["a"], t["b"], h0, cu_t, None, variant, "chunked", "chunked",
            None, 16, output_final_state, None)


@pytest.mark.parametrize("variant", ["gdn", "kda", "delta", "dplr"])
def test_opcheck_forward(variant):
    torch.library.opcheck(_library.chunk_fwd, _op_args(variant))


@pytest.mark.parametrize("output_final_state", [False, True])
def test_opcheck_forward_varlen(output_final_state):
    torch.library.opcheck(_library.chunk_fwd, _op_args("kda", output_final_state, cu=[0, 7, 20]))


def test_opcheck_backward():
    args = list(_op_args("gdn"))[:10]
    args = [None if a is None else (a.detach() if isinstance(a, torch.Tensor) else a) for a in args]
    do = torch.randn(2, 20, 2, 3, dtype=torch.float64)
    dht = torch.randn(2, 2, 4, 3, dtype=torch.float64)
    torch.library.opcheck(_library.chunk_bwd, (*args, do, dht, "gdn", "chunked", None, 16))


class _Layer(torch.nn.Module):
    """A minimal linear-attention layer calling the op as FLA's layers do (Kimi Linear's KDA layer,
    Qwen3-Next's GDN layer): projections, raw gate and beta logits, every option in the kernel call."""

    def __init__(self, variant, d=16, H=2, K=8, V=8, dtype=torch.float64):
        super().__init__()
        self.variant, self.H, self.K, self.V = variant, H, K, V
        gate_dim = H * K if variant == "kda" else H
        self.qkv = torch.nn.Linear(d, H * (2 * K + V), bias=False, dtype=dtype)
        self.gate = torch.nn.Linear(d, gate_dim, bias=False, dtype=dtype)
        self.b = torch.nn.Linear(d, H, bias=False, dtype=dtype)
        self.out = torch.nn.Linear(H * V, d, bias=False, dtype=dtype)
        gen = torch.Generator().manual_seed(3)
        self.A_log = torch.nn.Parameter(torch.rand(H, generator=gen, dtype=torch.float32).mul(0.5).log1p())
        self.dt_bias = torch.nn.Parameter(0.1 * torch.randn(gate_dim, generator=gen, dtype=torch.float32))

    def forward(self, x, state, cu_seqlens=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split([self.H * self.K, self.H * self.K, self.H * self.V], dim=-1)
        q, k = q.reshape(B, T, self.H, self.K), k.reshape(B, T, self.H, self.K)
        v = v.reshape(B, T, self.H, self.V)
        g = self.gate(x)
        g = g.reshape(B, T, self.H, self.K) if self.variant == "kda" else g
        beta = self.b(x)
        common = dict(A_log=self.A_log, dt_bias=self.dt_bias, initial_state=state, output_final_state=True,
                      cu_seqlens=cu_seqlens,
                      use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      allow_neg_eigval=True, state_v_first=True)
        if self.variant == "kda":
            o, ht = deltacp.chunk_kda(q, k, v, g, beta, safe_gate=True, lower_bound=-5.0, **common)
        else:
            o, ht = deltacp.chunk_gated_delta_rule(q, k, v, g, beta, **common)
        return self.out(o.reshape(B, T, -1)), ht


def _step(layer, fn, x, state, cu=None):
    layer.zero_grad(set_to_none=True)
    y, ht = fn(x, state, cu)
    (y.square().mean() + ht.float().square().mean()).backward()
    return y.detach(), ht.detach(), {n: p.grad.detach().clone() for n, p in layer.named_parameters()}


def _recording_aot_eager():
    """aot_eager that keeps the code of the forward and backward graphs it is given."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    codes = []

    def keep(gm, example_inputs):
        codes.append(gm.code)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep), codes


def _compare(layer, x, state, backend, tol, cu=None, grad_tol=None):
    eager = _step(layer, layer, x, state, cu)
    compiled_fn = torch.compile(layer, fullgraph=True, backend=backend)
    compiled = _step(layer, compiled_fn, x, state, cu)
    assert rel_err(compiled[0].double().cpu().numpy(), eager[0].double().cpu().numpy()) < tol
    assert rel_err(compiled[1].double().cpu().numpy(), eager[1].double().cpu().numpy()) < tol
    for name, grad in eager[2].items():
        err = rel_err(compiled[2][name].double().cpu().numpy(), grad.double().cpu().numpy())
        assert err < (grad_tol or tol), f"grad of {name}: {err:.3e}"


@pytest.mark.parametrize("variant,varlen", [("gdn", False), ("kda", False), ("kda", True)])
def test_compiled_layer_cpu(variant, varlen):
    """fullgraph=True: a graph break (an untraceable call in the op's Python) fails the test."""
    torch.manual_seed(0)
    layer = _Layer(variant)
    x = torch.randn(1 if varlen else 2, 38 if varlen else 19, 16, dtype=torch.float64)
    cu = torch.tensor([0, 11, 38]) if varlen else None
    state = 0.1 * torch.randn(2, 2, 8, 8, dtype=torch.float32)
    backend, codes = _recording_aot_eager()
    _compare(layer, x, state, backend, 1e-12, cu)
    # one forward graph holding the registered op, one backward graph holding its gradient op
    assert len(codes) == 2
    assert "deltacp.chunk_fwd" in codes[0] and "deltacp.chunk_bwd" in codes[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("variant,varlen", [("gdn", False), ("kda", False), ("gdn", True)])
def test_compiled_layer_cuda(variant, varlen):
    """The same layer on CUDA through Inductor (float32 weights; the default CUDA tier). Inductor
    reassociates the float32 arithmetic around the op (projections, l2 norm, gate): on the CPU the
    same float32 layer compiled by Inductor differed from eager by 1.7e-7 in the output and up to
    6.8e-5 in a parameter gradient (sums over every token), hence 1e-5 / 1e-3 here."""
    if not deltacp.built_with_cuda():
        pytest.fail("a CUDA device is present but deltacp was built without the CUDA tiers")
    torch.manual_seed(0)
    layer = _Layer(variant, d=64, H=2, K=64, V=64, dtype=torch.float32).cuda()
    x = torch.randn(1 if varlen else 2, 300 if varlen else 150, 64, device="cuda")
    cu = torch.tensor([0, 77, 300], device="cuda") if varlen else None  # the host copy made in the graph
    state = 0.1 * torch.randn(2, 2, 64, 64, device="cuda")
    _compare(layer, x, state, "inductor", 1e-5, cu, grad_tol=1e-3)


def test_compiled_matches_reference_numbers():
    """The compiled op's numbers are the reference's (not only the eager op's): one kda call with
    options, compiled, against deltacp.reference.fla_forward."""
    import deltacp.reference as ref

    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((2, 1, 19, 1, 4))
    v = rng.standard_normal((1, 19, 2, 3))
    g = rng.standard_normal((1, 19, 2, 4))
    beta = rng.standard_normal((1, 19, 2))
    A_log, dt_bias = 0.3 * rng.standard_normal(2), 0.3 * rng.standard_normal(8)
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                lower_bound=-4.0)

    def f(q, k, v, g, beta, A_log, dt_bias):
        return deltacp.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, output_final_state=True, **opts)

    args = [torch.tensor(x) for x in (q, k, v, g, beta, A_log, dt_bias)]
    o, ht = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    o_ref, ht_ref = ref.fla_forward("kda", q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, **opts)
    assert rel_err(o.numpy(), o_ref) < 1e-12
    assert rel_err(ht.numpy(), ht_ref) < 1e-12


def test_second_derivative_is_refused():
    """The C++ backward is not differentiable: a double backward raises instead of returning a wrong
    (zero) second derivative."""
    p = make_problem("gdn", B=1, T=8, H=1, K=4, V=3, seed=51)
    q = torch.tensor(p["q"], requires_grad=True)
    o, _ = deltacp.chunk_gated_delta_rule(q, *(torch.tensor(p[n]) for n in ("k", "v", "g", "beta")))
    (dq,) = torch.autograd.grad(o.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="chunk_bwd"):
        dq.sum().backward()
