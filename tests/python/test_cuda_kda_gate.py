"""kda's gate from the raw g as a CUDA op with its backward (cuda/common/kda_gate.cu, deltacp/_kda_gate.py), which
deltacp.fla_options.kda_gate runs on CUDA tensors (FLA's use_gate_in_kernel with a gradient): the gate and the
gradients of g, A_log and dt_bias against the torch expression in float64. Skipped without a CUDA device."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
from deltacp import _kda_gate, fla_options  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("lower_bound", [None, -5.0, -1.0])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16], ids=["g_fp32", "g_bf16"])
@pytest.mark.parametrize("bias", ["flat", "2d", "none"])
@pytest.mark.parametrize("K", [128, 64, 100])
def test_kda_gate_rows_against_torch_in_float64(lower_bound, gdtype, bias, K):
    if not deltacp.built_with_cuda():
        pytest.fail("a CUDA device is present but deltacp was built without the CUDA tiers")
    torch.manual_seed(K)
    B, T, HV = 2, 37, 3
    g = (4 * torch.randn(B, T, HV, K, device="cuda")).to(gdtype).requires_grad_(True)  # softplus past 20 too
    g.data[0, 0, 0, :4] = torch.tensor([25.0, -30.0, 19.5, 0.0])
    A_log = torch.log1p(15 * torch.rand(HV, device="cuda")).requires_grad_(True)
    dt_bias = None if bias == "none" else (0.1 * torch.randn(HV * K if bias == "flat" else (HV, K),
                                                             device="cuda")).requires_grad_(True)
    assert _kda_gate.applies(g, A_log, dt_bias)
    y = fla_options.kda_gate(g, A_log, dt_bias, lower_bound, out_dtype=torch.float32)
    leaves = [g, A_log] + ([] if dt_bias is None else [dt_bias])
    r64 = [x.detach().double().requires_grad_(True) for x in leaves]
    y64 = fla_options.kda_gate(r64[0], r64[1], None if dt_bias is None else r64[2], lower_bound)
    assert y.dtype == torch.float32 and y.shape == g.shape
    assert _rel(y, y64) < 1e-6
    dy = torch.randn_like(y64)
    grads = torch.autograd.grad((y.double() * dy).sum(), leaves)
    grads64 = torch.autograd.grad((y64 * dy).sum(), r64)
    for name, d, d64, leaf in zip(("g", "A_log", "dt_bias"), grads, grads64, leaves):
        assert d.dtype == leaf.dtype and d.shape == leaf.shape, name
        # bf16 dg rounds to 8 bits; A_log's and dt_bias's gradients are fp32 sums over B * T (* K) terms
        tol = 8e-3 if (name == "g" and gdtype == torch.bfloat16) else (1e-5 if name == "g" else 1e-4)
        assert _rel(d, d64) < tol, (name, _rel(d, d64))


def test_kda_gate_rows_leaves_gradients_it_is_not_asked_for():
    """A_log and dt_bias as constants (no requires_grad): only g's gradient, the same as with them."""
    torch.manual_seed(1)
    g = torch.randn(1, 9, 2, 128, device="cuda", requires_grad=True)
    A_log, dt_bias = torch.zeros(2, device="cuda"), torch.zeros(256, device="cuda")
    y = fla_options.kda_gate(g, A_log, dt_bias, -5.0)
    (dg,) = torch.autograd.grad(y.sum(), g)
    g64 = g.detach().double().requires_grad_(True)
    (dg64,) = torch.autograd.grad(fla_options.kda_gate(g64, A_log.double(), dt_bias.double(), -5.0).sum(), g64)
    assert _rel(dg, dg64) < 1e-5


@pytest.mark.parametrize("lower_bound", [0.0, 0.5])
def test_kda_gate_with_a_bound_the_kernels_do_not_take_runs_in_torch(lower_bound):
    """The kernels take the sigmoid form with a negative lower_bound and the softplus form without one; any other
    bound (FLA computes lower_bound sigmoid(...) with it) stays on torch's expression, never the softplus form."""
    torch.manual_seed(2)
    g = torch.randn(1, 5, 2, 64, device="cuda")
    A_log, dt_bias = torch.zeros(2, device="cuda"), torch.zeros(128, device="cuda")
    y = fla_options.kda_gate(g, A_log, dt_bias, lower_bound)
    assert torch.equal(y, lower_bound * torch.sigmoid(g))
