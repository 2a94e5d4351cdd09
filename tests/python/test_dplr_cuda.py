"""The tiled DPLR forward on CUDA (deltacp.chunk_dplr_delta_rule / chunk_rwkv7 with backend="tiled", an opt-in
tier until validated on a GPU) against the float64 reference on the same rounded inputs: odd lengths, varlen
with empty and one-token sequences, initial / final states, chunk sizes 16 / 32 / 64, K in {32, 64, 100, 128},
bf16 / fp16 / fp32 inputs, gk in fp32 beside 16-bit inputs, the [V, K] state layout, gradients (the naive
backward behind the tiled forward), the gate-range fallback, and, where FLA is installed, FLA's chunk_rwkv7.
Tolerances: fp32 1e-4 (the chunk form in fp32; measured ~1e-6 on the CPU reference), 16-bit 1e-2. Skipped
without a CUDA device."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
import deltacp.reference as ref  # noqa: E402
from deltacp_testutil import make_problem, rel_err  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# (B, T, H, K, V, cu_seqlens)
SHAPES = {
    "T1": (2, 1, 2, 64, 64, None),
    "T63": (1, 63, 2, 64, 32, None),
    "T65_K32_V48": (2, 65, 2, 32, 48, None),
    "T130_K128_V128": (1, 130, 2, 128, 128, None),
    "K100_V33": (1, 77, 1, 100, 33, None),
    "varlen": (1, None, 2, 64, 64, [0, 1, 64, 64, 129, 200, 201]),
}


def _inputs(shape, dtype, seed, gate_fp32=False):
    B, T, H, K, V, cu = SHAPES[shape]
    p = make_problem("dplr", B=B, T=T or 0, H=H, K=K, V=V, cu_seqlens=cu, seed=seed)
    # round the inputs to the dtype under test; the reference then sees the same numbers
    t = {n: torch.tensor(p[n]).to(dtype) for n in ("q", "k", "v", "a", "b")}
    t["g"] = torch.tensor(p["g"]).to(torch.float32 if gate_fp32 else dtype)
    for n in ("q", "k", "v", "a", "b", "g"):
        p[n] = t[n].double().numpy()
    h0 = torch.tensor(p["initial_state"], dtype=torch.float32)
    p["initial_state"] = h0.double().numpy()
    cu_t = None if cu is None else torch.tensor(cu)
    return p, {n: x.cuda() for n, x in t.items()}, h0.cuda(), cu_t


def _run(t, h0, cu, backend, chunk_size, **kw):
    return deltacp.chunk_dplr_delta_rule(t["q"], t["k"], t["v"], t["a"], t["b"], t["g"], None, h0, True,
                                         None if cu is None else cu.cuda(), cu, chunk_size=chunk_size,
                                         backend=backend, **kw)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_tiled_forward_against_reference(shape, dtype, chunk_size):
    p, t, h0, cu = _inputs(shape, dtype, seed=zlib.crc32(f"{shape}/{dtype}/{chunk_size}".encode()))
    o_ref, ht_ref = ref.dplr(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], initial_state=p["initial_state"],
                             cu_seqlens=p["cu_seqlens"])
    torch.cuda.empty_cache()
    o, ht = _run(t, h0, cu, "tiled", chunk_size)
    torch.cuda.synchronize()
    assert o.dtype == dtype and ht.dtype == torch.float32
    e_o, e_h = rel_err(o.double().cpu().numpy(), o_ref), rel_err(ht.double().cpu().numpy(), ht_ref)
    print(f"[errors] tiled dplr {shape} {dtype} chunk {chunk_size}: o {e_o:.2e} ht {e_h:.2e}")
    assert e_o < TOL[dtype] and e_h < TOL[dtype]


def test_tiled_forward_gate_fp32_no_states_and_state_v_first():
    p, t, h0, cu = _inputs("varlen", torch.bfloat16, seed=3, gate_fp32=True)
    o_ref, ht_ref = ref.dplr(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], cu_seqlens=p["cu_seqlens"])
    o, ht = deltacp.chunk_dplr_delta_rule(t["q"], t["k"], t["v"], t["a"], t["b"], t["g"], output_final_state=True,
                                          cu_seqlens=cu.cuda(), backend="tiled")
    assert rel_err(o.double().cpu().numpy(), o_ref) < 1e-2
    assert rel_err(ht.double().cpu().numpy(), ht_ref) < 1e-2
    # RWKV-7's [V, K] states: the transposes of the [K, V] ones
    o2, ht2 = deltacp.chunk_rwkv7(t["q"], t["g"], t["k"], t["v"], t["a"], t["b"], scale=64 ** -0.5,
                                  initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
                                  cu_seqlens=cu.cuda(), backend="tiled", state_v_first=True)
    o3, ht3 = _run(t, h0, cu, "tiled", 64)
    assert torch.equal(o2, o3) and torch.equal(ht2, ht3.transpose(-1, -2))


def test_tiled_forward_then_naive_backward():
    """backend="tiled": the forward on the tiled tier, the gradients from the naive backward (until the tiled
    DPLR backward exists), against the reference backward."""
    p, t, h0, cu = _inputs("T65_K32_V48", torch.float32, seed=5)
    rng = np.random.default_rng(6)
    do = rng.standard_normal(p["v"].shape).astype(np.float32)
    dht = rng.standard_normal(p["initial_state"].shape).astype(np.float32)
    g_ref = ref.dplr_backward(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], do.astype(np.float64),
                              dht=dht.astype(np.float64), initial_state=p["initial_state"])
    leaves = {n: x.clone().requires_grad_(True) for n, x in t.items()}
    h0 = h0.clone().requires_grad_(True)
    o, ht = _run(leaves, h0, None, "tiled", 64)
    ((o * torch.tensor(do).cuda()).sum() + (ht * torch.tensor(dht).cuda()).sum()).backward()
    for n, gname in (("q", "dq"), ("k", "dk"), ("v", "dv"), ("a", "da"), ("b", "db"), ("g", "dgk")):
        assert rel_err(leaves[n].grad.double().cpu().numpy(), g_ref[gname]) < 1e-4, n
    assert rel_err(h0.grad.double().cpu().numpy(), g_ref["dh0"]) < 1e-4


def test_tiled_gates_outside_range_fall_back_to_naive():
    p, t, h0, cu = _inputs("T63", torch.float32, seed=7)
    t["g"][0, 10, 1, 5] = -100.0  # below -1024 / 64
    o, ht = _run(t, h0, cu, "tiled", 64)
    o_n, ht_n = _run(t, h0, cu, "naive", 64)
    assert torch.equal(o, o_n) and torch.equal(ht, ht_n)


def test_tiled_rejects_wide_keys():
    p = make_problem("dplr", B=1, T=8, H=1, K=160, V=16, seed=8)
    t = {n: torch.tensor(p[n], dtype=torch.bfloat16).cuda() for n in ("q", "k", "v", "a", "b", "g")}
    with pytest.raises(ValueError, match="K"):
        deltacp.chunk_dplr_delta_rule(t["q"], t["k"], t["v"], t["a"], t["b"], t["g"], backend="tiled")


def test_against_fla_chunk_rwkv7():
    """Where FLA is installed: deltacp's chunk_rwkv7 and FLA's on the same bf16 inputs (FLA's RWKV-7 layer's
    w and a / b), both against float64; deltacp's error no worse than twice FLA's (or below 2e-3)."""
    fla_rwkv7 = pytest.importorskip("fla.ops.rwkv7")
    rng = np.random.default_rng(9)
    B, T, H, K, V = 2, 1000, 4, 64, 64
    r = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    v = rng.standard_normal((B, T, H, V))
    w = -np.exp(-0.5) / (1.0 + np.exp(-rng.standard_normal((B, T, H, K))))
    kk = rng.standard_normal((B, T, H, K))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    iclr = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H, K))))
    xs = {n: torch.tensor(x).to(torch.bfloat16) for n, x in
          (("r", r), ("w", w), ("k", k), ("v", v), ("a", -kk), ("b", kk * iclr))}
    xd = {n: x.double().numpy() for n, x in xs.items()}
    o_ref, ht_ref = ref.dplr(xd["r"], xd["k"], xd["v"], xd["a"], xd["b"], xd["w"], scale=1.0)
    xc = {n: x.cuda() for n, x in xs.items()}
    o_f, ht_f = fla_rwkv7.chunk_rwkv7(xc["r"], xc["w"], xc["k"], xc["v"], xc["a"], xc["b"], scale=1.0,
                                      output_final_state=True)
    o_d, ht_d = deltacp.chunk_rwkv7(xc["r"], xc["w"], xc["k"], xc["v"], xc["a"], xc["b"], scale=1.0,
                                    output_final_state=True, backend="tiled")
    e_f = rel_err(o_f.double().cpu().numpy(), o_ref)
    e_d = rel_err(o_d.double().cpu().numpy(), o_ref)
    print(f"[errors] chunk_rwkv7 bf16 vs fp64: deltacp tiled {e_d:.2e}, FLA {e_f:.2e}")
    assert e_d < 1e-2 and (e_d <= 2 * e_f or e_d < 2e-3)
    assert rel_err(ht_d.double().cpu().numpy(), ht_ref) < 1e-2


# ---- the state-only modes (Params::final_state_only / dh0_only: the CP pre-passes) ----------------------------
def _descs(t, h0, cu):
    from deltacp._describe import torch_desc

    keep = []

    def desc(x, name):
        keep.append(x)
        return torch_desc(x, name)

    d = {n: desc(t[n], n) for n in ("q", "k", "v", "a", "b")}
    d["g"] = desc(t["g"], "gk")
    d["h0"] = desc(h0, "initial_state")
    if cu is not None:
        d["cu_seqlens"] = desc(cu.cuda(), "cu_seqlens")
        d["cu_seqlens_host"] = desc(cu, "cu_seqlens")
    return d, desc, keep


@pytest.mark.parametrize("shape", ["T65_K32_V48", "T130_K128_V128", "varlen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiled_state_only_modes(shape, dtype):
    """Final-state-only forward (o absent) gives the full tiled forward's ht bit for bit; the dh0-only backward
    (every input gradient absent: the tiled DPLR reverse state-gradient scan) gives the reference's dh0."""
    from deltacp import _core

    p, t, h0, cu = _inputs(shape, dtype, seed=zlib.crc32(f"state/{shape}/{dtype}".encode()))
    d, desc, keep = _descs(t, h0, cu)
    N, H, K, V = h0.shape
    stream = torch.cuda.current_stream().cuda_stream

    def forward(with_o):
        dd = dict(d)
        ht = torch.full((N, H, K, V), float("nan"), device="cuda")
        dd["ht"] = desc(ht, "ht")
        if with_o:
            dd["o"] = desc(torch.empty_like(t["v"]), "o")
        _core.run("forward", "dplr", "tiled", "float32", dd, None, 64, None, stream, False)
        return ht

    ht_full, ht_only = forward(True), forward(False)
    torch.cuda.synchronize()
    assert torch.isfinite(ht_full).all() and torch.equal(ht_only, ht_full)

    rng = np.random.default_rng(11)
    do = torch.tensor(rng.standard_normal(p["v"].shape)).to(dtype)
    dht = torch.tensor(rng.standard_normal(p["initial_state"].shape), dtype=torch.float32)
    g_ref = ref.dplr_backward(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], do.double().numpy(),
                              dht=dht.double().numpy(), initial_state=p["initial_state"], cu_seqlens=p["cu_seqlens"])
    dd = dict(d)
    dh0 = torch.full((N, H, K, V), float("nan"), device="cuda")
    dd.update(dout=desc(do.cuda(), "do"), dht=desc(dht.cuda(), "dht"), dh0=desc(dh0, "dh0"))
    _core.run("backward", "dplr", "tiled", "float32", dd, None, 64, None, stream, False)
    torch.cuda.synchronize()
    err = rel_err(dh0.double().cpu().numpy(), g_ref["dh0"])
    print(f"[errors] tiled dplr dh0-only {shape} {dtype}: dh0 {err:.2e}")
    assert err < TOL[dtype]
    # a full backward by name on the tiled tier is refused, naming the variant (only the dh0-only one exists)
    for n in ("q", "k", "v", "a", "b", "g"):
        dd["d" + n] = desc(torch.empty_like(t[n]), "dgk" if n == "g" else "d" + n)
    with pytest.raises(ValueError, match="variant"):
        _core.run("backward", "dplr", "tiled", "float32", dd, None, 64, None, stream, False)
