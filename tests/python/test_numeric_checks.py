"""The numeric error contract (docs/errors.md) on every backend.

Inputs: every tensor finite and the log decay g <= 0 (gdn, kda). Outputs: o, ht and every gradient finite.
A failure raises deltacp.NumericError (a ValueError) naming the tensor, the first bad index and the cause.
CPU (the reference): always on. CUDA (naive and tiled tiers): on with DELTACP_CHECK=1; off, the tiers
return what the arithmetic gives (the GPU cases also check that, so the switch is shown to matter).
The GPU cases skip without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

import deltacp
import deltacp.reference as ref
from deltacp_testutil import make_problem

VARIANTS = ("gdn", "kda")


def _problem(variant, T=40):
    return make_problem(variant, B=2, T=T, H=2, K=8, V=6, seed=7)


def _poke(a, value, index):
    a = np.array(a, copy=True)
    a[index] = value
    return a


def _cases(variant):
    """(label, changes to the problem, tensor named, regex of the message)."""
    p = _problem(variant)
    gidx = (1, 13, 0) if variant == "gdn" else (1, 13, 0, 3)
    # Keys of norm 30: beta ||k||^2 ~ 450, so the delta step multiplies the state along k by ~ -450 a token;
    # 200 tokens overflow float64 (40 overflow float32 but not float64).
    long = _problem(variant, T=200)
    big_k = {**long, "k": long["k"] * 30.0}
    return [
        ("g +5", {"g": _poke(p["g"], 5.0, gidx)}, "g",
         r"expected log decays <= 0, got 5 at \[1, 13, 0, " + ("0" if variant == "gdn" else "3") + r"\].*positive gate"),
        ("g +50", {"g": _poke(p["g"], 50.0, gidx)}, "g", r"expected log decays <= 0, got 50"),
        ("NaN in q", {"q": _poke(p["q"], np.nan, (0, 3, 1, 2))}, "q", r"expected finite values, found nan at \[0, 3, 1, 2\]"),
        ("Inf in v", {"v": _poke(p["v"], np.inf, (1, 0, 0, 5))}, "v", r"found inf at \[1, 0, 0, 5\]"),
        ("NaN in beta", {"beta": _poke(p["beta"], np.nan, (0, 39, 1))}, "beta", r"found nan at \[0, 39, 1, 0\]"),
        ("Inf in initial_state", {"initial_state": _poke(p["initial_state"], -np.inf, (1, 1, 2, 3))}, "initial_state",
         r"found -inf at flat index"),
        ("keys of norm 30", big_k, "o", r"non-finite output from finite inputs.*normalise k"),
    ]


def _reference_call(variant, p):
    fn = ref.gated_delta_rule if variant == "gdn" else ref.kda
    return fn(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["initial_state"], output_final_state=True)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", range(7), ids=["g+5", "g+50", "nan_q", "inf_v", "nan_beta", "inf_h0", "k_norm30"])
def test_reference_numeric_errors(variant, case):
    label, change, name, pattern = _cases(variant)[case]
    p = {**_problem(variant), **change}
    with pytest.raises(deltacp.NumericError, match=pattern) as info:
        _reference_call(variant, p)
    assert info.value.argument == name, (label, info.value.argument)
    assert f"argument '{name}'" in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, deltacp.DeltaCPError)


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_gate_zero_is_allowed(variant):
    """g = 0 (no decay) is inside the contract: only g > 0 is refused."""
    p = _problem(variant)
    p["g"] = np.zeros_like(p["g"])
    o, ht = _reference_call(variant, p)
    assert np.isfinite(o).all() and np.isfinite(ht).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_backward_nonfinite_gradient(variant):
    """Keys of norm 30 in the backward: the first gradient checked (dq) is reported with the cause."""
    p = _problem(variant, T=200)
    bwd = ref.gated_delta_rule_backward if variant == "gdn" else ref.kda_backward
    do = np.ones(p["v"].shape)
    with pytest.raises(deltacp.NumericError, match=r"non-finite gradient from finite inputs.*normalise k") as info:
        bwd(p["q"], p["k"] * 30.0, p["v"], p["g"], p["beta"], do, initial_state=p["initial_state"])
    assert info.value.argument in ("dq", "dk", "dv", "dg", "dbeta", "dh0")


torch = pytest.importorskip("torch")

_OPS = {"gdn": "chunk_gated_delta_rule", "kda": "chunk_kda"}


def _torch_call(variant, p, device, dtype, backend=None):
    t = {key: torch.tensor(val, dtype=dtype, device=device) for key, val in p.items()
         if key in ("q", "k", "v", "beta")}
    t["g"] = torch.tensor(p["g"], dtype=torch.float32 if dtype != torch.float64 else dtype, device=device)
    h0 = torch.tensor(p["initial_state"], dtype=torch.float32 if dtype != torch.float64 else dtype, device=device)
    kw = {} if backend is None else {"backend": backend}
    return getattr(deltacp, _OPS[variant])(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=h0,
                                           output_final_state=True, **kw)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", range(7), ids=["g+5", "g+50", "nan_q", "inf_v", "nan_beta", "inf_h0", "k_norm30"])
def test_torch_cpu_numeric_errors(variant, case):
    label, change, name, pattern = _cases(variant)[case]
    p = {**_problem(variant), **change}
    with pytest.raises(deltacp.NumericError, match=pattern) as info:
        _torch_call(variant, p, "cpu", torch.float64)
    assert info.value.argument == name, (label, info.value.argument)


needs_cuda = pytest.mark.skipif(not (deltacp.built_with_cuda() and torch.cuda.is_available()),
                                reason="needs the CUDA tiers and a CUDA device")


@needs_cuda
@pytest.mark.parametrize("tier", ("naive", "tiled"))
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", range(7), ids=["g+5", "g+50", "nan_q", "inf_v", "nan_beta", "inf_h0", "k_norm30"])
def test_cuda_numeric_errors_on_request(monkeypatch, tier, variant, case):
    """DELTACP_CHECK=1: the same error, tensor and message as on the CPU. Unset: the hot path checks
    nothing, so the same call returns (whatever the arithmetic gives)."""
    label, change, name, pattern = _cases(variant)[case]
    p = {**_problem(variant), **change}
    monkeypatch.delenv("DELTACP_CHECK", raising=False)
    _torch_call(variant, p, "cuda", torch.float32, backend=tier)
    torch.cuda.synchronize()
    monkeypatch.setenv("DELTACP_CHECK", "1")
    with pytest.raises(deltacp.NumericError, match=pattern) as info:
        _torch_call(variant, p, "cuda", torch.float32, backend=tier)
    assert info.value.argument == name, (label, info.value.argument)


@needs_cuda
@pytest.mark.parametrize("tier", ("naive", "tiled"))
@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_check_passes_good_input_bf16(monkeypatch, tier, variant):
    """DELTACP_CHECK=1 on valid bf16 inputs (fp32 gate): forward and backward run and agree with the run
    without checks bit for bit (the checks only read)."""
    p = _problem(variant)

    def run():
        t = {key: torch.tensor(p[key], dtype=torch.bfloat16, device="cuda").requires_grad_()
             for key in ("q", "k", "v", "beta")}
        g = torch.tensor(p["g"], dtype=torch.float32, device="cuda").requires_grad_()
        o, _ = getattr(deltacp, _OPS[variant])(t["q"], t["k"], t["v"], g, t["beta"], backend=tier)
        o.float().square().sum().backward()
        return [o.detach()] + [t[key].grad for key in ("q", "k", "v", "beta")] + [g.grad]

    monkeypatch.delenv("DELTACP_CHECK", raising=False)
    plain = run()
    monkeypatch.setenv("DELTACP_CHECK", "1")
    checked = run()
    for a, b in zip(plain, checked):
        assert torch.equal(a, b)


@needs_cuda
def test_cuda_nonfinite_gradient_on_request(monkeypatch):
    """DELTACP_CHECK=1: a non-finite upstream gradient is refused naming 'do' on the GPU too."""
    monkeypatch.setenv("DELTACP_CHECK", "1")
    p = _problem("gdn")
    t = {key: torch.tensor(p[key], dtype=torch.float32, device="cuda").requires_grad_()
         for key in ("q", "k", "v", "g", "beta")}
    o, _ = deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], backend="tiled")
    with pytest.raises(deltacp.NumericError, match=r"argument 'do'"):
        o.backward(torch.full_like(o, float("nan")))


@needs_cuda
def test_cuda_workspace_out_of_memory_says_what_was_asked():
    """An out-of-memory in the kernels' workspace pool raises deltacp.OutOfMemoryError (a MemoryError) with
    the bytes requested and free, and no path of the machine that built the module. The device is filled
    to leave room for the gradients torch allocates but not for the tiled backward's workspace."""
    import re

    B, T, H, D = 1, 32768, 16, 128
    x = {name: torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for name in "qkv"}
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda")).requires_grad_()
    beta = torch.rand(B, T, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
    o, _ = deltacp.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, beta, backend="tiled")
    do = torch.randn_like(o)
    torch.cuda.synchronize()
    deltacp.cuda_release_workspace()
    torch.cuda.empty_cache()
    grads = sum(t.numel() * t.element_size() for t in (*x.values(), g, beta))
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(max(free - grads - (96 << 20), 0), dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(deltacp.OutOfMemoryError) as info:
            o.backward(do)
            torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        pytest.skip("torch's own allocation ran out first on this device")
    finally:
        del filler
        deltacp.cuda_release_workspace()
        torch.cuda.empty_cache()
    msg = str(info.value)
    assert isinstance(info.value, MemoryError) and info.value.argument == "cuda"
    assert re.search(r"requested \d+ bytes", msg) and re.search(r"free on the device \d+ bytes", msg), msg
    assert not re.search(r"/[\w.-]+/[\w./-]*\.(cu|cuh|h|cpp)\b", msg), msg
