"""Golden vectors (tests/data, computed by an independent float32 loop): every telling of the
reference, simulated CP with random cuts, and the torch op must reproduce the forward and every
gradient to 1e-5 relative (the producer's own float32 rounding is about 1e-6)."""

from __future__ import annotations

import numpy as np
import pytest

import deltacp.reference as ref
from deltacp_testutil import rel_err

TOL = 1e-5
VARIANTS = ("gdn", "kda")
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
# (method, chunk size): the token recurrence, the chunked WY form at each chunk size, the affine folds.
TELLINGS = [("recurrent", None), ("chunked", 16), ("chunked", 32), ("chunked", 64), ("affine", 64)]


def _fns(variant):
    if variant == "gdn":
        return ref.gated_delta_rule, ref.gated_delta_rule_backward
    return ref.kda, ref.kda_backward


def _check(label, got, want):
    err = rel_err(got, want)
    assert err < TOL, f"{label}: relative error {err:.3e} >= {TOL}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("method,chunk_size", TELLINGS)
def test_golden_reference(golden, variant, method, chunk_size):
    z = golden(f"{variant}_small")
    fwd, bwd = _fns(variant)
    args = (z["q"], z["k"], z["v"], z["g"], z["beta"])
    o, ht = fwd(*args, scale=z["scale"], initial_state=z["h0"], output_final_state=True, chunk_size=chunk_size,
                method=method)
    _check("o", o, z["o"])
    _check("ht", ht, z["ht"])
    grads = bwd(*args, z["do"], dht=z["dht"], scale=z["scale"], initial_state=z["h0"], chunk_size=chunk_size,
                method=method)
    for name in GRADS:
        _check(name, grads[name], z[name])


@pytest.mark.parametrize("variant", VARIANTS)
def test_golden_reference_float32(golden, variant):
    """float32 inputs run the reference in float32 (chunked, 64) and still meet 1e-5."""
    z = golden(f"{variant}_small")
    fwd, bwd = _fns(variant)
    f32 = {key: value.astype(np.float32) for key, value in z.items() if isinstance(value, np.ndarray)}
    args = (f32["q"], f32["k"], f32["v"], f32["g"], f32["beta"])
    o, ht = fwd(*args, scale=z["scale"], initial_state=f32["h0"], chunk_size=64)
    assert o.dtype == np.float32 and ht.dtype == np.float32
    _check("o", o, z["o"])
    _check("ht", ht, z["ht"])
    grads = bwd(*args, f32["do"], dht=f32["dht"], scale=z["scale"], initial_state=f32["h0"], chunk_size=64)
    for name in GRADS:
        _check(name, grads[name], z[name])


def _pack(x):
    """[B, T, ...] -> [1, B*T, ...]."""
    return x.reshape((1, x.shape[0] * x.shape[1]) + x.shape[2:])


def _unpack(x, B):
    return x.reshape((B, x.shape[1] // B) + x.shape[2:])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_golden_cp_simulate(golden, variant, seed):
    """The golden batch packed into one varlen sequence pair, cut into 2..6 ranks at random tokens."""
    z = golden(f"{variant}_small")
    B, T = z["q"].shape[:2]
    rng = np.random.default_rng(seed)
    n_cuts = int(rng.integers(1, 6))
    cuts = sorted(int(c) for c in rng.choice(np.arange(1, B * T), size=n_cuts, replace=False))
    if seed == 0 and T not in cuts:  # a cut exactly at the sequence boundary
        cuts = sorted(cuts + [T])
    cu = np.arange(B + 1, dtype=np.int64) * T
    packed = {key: _pack(z[key]) for key in ("q", "k", "v", "g", "beta", "do")}
    common = dict(cuts=cuts, scale=z["scale"], initial_state=z["h0"], cu_seqlens=cu, chunk_size=64)
    o, ht = ref.cp_simulate(variant, packed["q"], packed["k"], packed["v"], packed["g"], packed["beta"], **common)
    _check(f"o (cuts {cuts})", _unpack(o, B), z["o"])
    _check(f"ht (cuts {cuts})", ht, z["ht"])
    grads = ref.cp_simulate(variant, packed["q"], packed["k"], packed["v"], packed["g"], packed["beta"],
                            backward=True, do=packed["do"], dht=z["dht"], **common)
    for name in GRADS:
        got = grads[name] if name == "dh0" else _unpack(grads[name], B)
        _check(f"{name} (cuts {cuts})", got, z[name])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", ["reference", "recurrent"])
def test_golden_torch(golden, variant, backend):
    """The torch op on CPU float64 tensors, gradients by autograd (our backward)."""
    torch = pytest.importorskip("torch")
    import deltacp

    z = golden(f"{variant}_small")
    op = deltacp.chunk_gated_delta_rule if variant == "gdn" else deltacp.chunk_kda
    t = {key: torch.tensor(z[key], requires_grad=key in ("q", "k", "v", "g", "beta", "h0"))
         for key in ("q", "k", "v", "g", "beta", "h0", "do", "dht")}
    o, ht = op(t["q"], t["k"], t["v"], t["g"], t["beta"], scale=z["scale"], initial_state=t["h0"],
               output_final_state=True, backend=backend)
    _check("o", o.detach().numpy(), z["o"])
    _check("ht", ht.detach().numpy(), z["ht"])
    ((o * t["do"]).sum() + (ht * t["dht"]).sum()).backward()
    for name, key in (("dq", "q"), ("dk", "k"), ("dv", "v"), ("dg", "g"), ("dbeta", "beta"), ("dh0", "h0")):
        _check(name, t[key].grad.numpy(), z[name])


@pytest.mark.parametrize("variant", VARIANTS)
def test_golden_torch_varlen(golden, variant):
    """The golden batch as one packed varlen batch through the torch op (cu_seqlens, int32 accepted)."""
    torch = pytest.importorskip("torch")
    import deltacp

    z = golden(f"{variant}_small")
    B, T = z["q"].shape[:2]
    op = deltacp.chunk_gated_delta_rule if variant == "gdn" else deltacp.chunk_kda
    t = {key: torch.tensor(_pack(z[key]), requires_grad=key != "do") for key in ("q", "k", "v", "g", "beta", "do")}
    h0 = torch.tensor(z["h0"], requires_grad=True)
    cu = torch.arange(B + 1, dtype=torch.int32) * T
    o, ht = op(t["q"], t["k"], t["v"], t["g"], t["beta"], scale=z["scale"], initial_state=h0,
               output_final_state=True, cu_seqlens=cu)
    _check("o", _unpack(o.detach().numpy(), B), z["o"])
    _check("ht", ht.detach().numpy(), z["ht"])
    ((o * t["do"]).sum() + (ht * torch.tensor(z["dht"])).sum()).backward()
    for name, key in (("dq", "q"), ("dk", "k"), ("dv", "v"), ("dg", "g"), ("dbeta", "beta")):
        _check(name, _unpack(t[key].grad.numpy(), B), z[name])
    _check("dh0", h0.grad.numpy(), z["dh0"])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", ["naive", "tiled"])
def test_golden_cuda(golden, variant, backend):
    """The CUDA tiers on float32 CUDA tensors match the golden vectors (forward and every gradient)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import deltacp

    if not deltacp.built_with_cuda():
        pytest.skip("deltacp built without the CUDA tiers (tests/python/test_cuda.py fails for that case)")
    z = golden(f"{variant}_small")
    op = deltacp.chunk_gated_delta_rule if variant == "gdn" else deltacp.chunk_kda
    t = {key: torch.tensor(z[key], dtype=torch.float32, device="cuda",
                           requires_grad=key in ("q", "k", "v", "g", "beta", "h0"))
         for key in ("q", "k", "v", "g", "beta", "h0", "do", "dht")}
    o, ht = op(t["q"], t["k"], t["v"], t["g"], t["beta"], scale=float(z["scale"]), initial_state=t["h0"],
               output_final_state=True, backend=backend)
    _check("o", o.detach().cpu().numpy(), z["o"])
    _check("ht", ht.detach().cpu().numpy(), z["ht"])
    ((o * t["do"]).sum() + (ht * t["dht"]).sum()).backward()
    for name, key in (("dq", "q"), ("dk", "k"), ("dv", "v"), ("dg", "g"), ("dbeta", "beta"), ("dh0", "h0")):
        _check(name, t[key].grad.cpu().numpy(), z[name])
