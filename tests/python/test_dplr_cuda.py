"""The tiled DPLR forward and backward on CUDA (deltacp.chunk_dplr_delta_rule / chunk_rwkv7 with backend="tiled",
an opt-in tier until validated on a GPU) against the float64 reference on the same rounded inputs: odd lengths,
varlen with empty, one-token and tiny sequences, initial / final states, chunk sizes 16 / 32 / 64, K in
{32, 64, 100, 128}, bf16 / fp16 / fp32 inputs, gk in fp32 beside 16-bit inputs, the [V, K] state layout, every
gradient (dq, dk, dv, da, db, dgk, dh0) of the tiled backward with and without h0 and dht, against the reference
and against the naive tier's, the gate-range fallback, and, where FLA is installed, FLA's chunk_rwkv7.
Tolerances: fp32 1e-4 (the chunk form in fp32; measured ~1e-6 on the CPU reference), 16-bit 1e-2. Skipped
without a CUDA device."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
import deltacp.reference as ref  # noqa: E402
from deltacp_testutil import make_problem, rel_err, rwkv7_inputs  # noqa: E402

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
    "T200": (1, 200, 2, 64, 64, None),
    "tiny_varlen": (1, None, 2, 64, 64, [0, 1, 3, 3, 8, 9, 25, 26, 30]),
    "T1_K128": (2, 1, 2, 128, 128, None),
    "varlen_K128": (1, None, 2, 128, 128, [0, 1, 64, 64, 129, 200, 201]),
    "H16_K128": (1, 200, 16, 128, 128, None),  # 64 scan CTAs of 32 columns: 16 in order, 32 side by side
    "H72": (1, 130, 72, 64, 64, None),  # 144 scan CTAs of 32 columns on a 132-SM GPU: K = 64 with 32 (8 warps)
    "T70_V96": (1, 70, 2, 64, 96, None),  # the output stage's 64-column value blocks: one full, one of 32
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


# ---- the tiled backward ------------------------------------------------------------------------------------------
BWD_SHAPES = ["T1", "T63", "T65_K32_V48", "T130_K128_V128", "T200", "K100_V33", "varlen", "tiny_varlen", "T70_V96"]
GRADS = ("dq", "dk", "dv", "da", "db", "dgk", "dh0")


def _upstream(p, dtype, seed, with_dht):
    """do in the dtype under test (the gradient autograd hands the op), dht in fp32 or None (zero)."""
    rng = np.random.default_rng(seed)
    do = torch.tensor(rng.standard_normal(p["v"].shape)).to(dtype)
    dht = torch.tensor(rng.standard_normal(p["initial_state"].shape), dtype=torch.float32) if with_dht else None
    return do, dht


def _tiled_grads(t, h0, cu, backend, do, dht, chunk_size=64, rwkv7=False):
    """Every gradient through autograd of chunk_dplr_delta_rule (or chunk_rwkv7) with `backend`, and the tier
    the backward ran on (deltacp.last_cuda_tier())."""
    leaves = {n: x.clone().requires_grad_(True) for n, x in t.items()}
    h = None if h0 is None else h0.clone().requires_grad_(True)
    cu_dev = None if cu is None else cu.cuda()
    if rwkv7:
        o, ht = deltacp.chunk_rwkv7(leaves["q"], leaves["g"], leaves["k"], leaves["v"], leaves["a"], leaves["b"],
                                    scale=t["q"].shape[-1] ** -0.5, initial_state=h, output_final_state=True,
                                    cu_seqlens=cu_dev, cu_seqlens_cpu=cu, chunk_size=chunk_size, backend=backend)
    else:
        o, ht = _run(leaves, h, cu, backend, chunk_size)
    loss = (o * do.cuda()).sum()
    if dht is not None:
        loss = loss + (ht * dht.cuda()).sum()
    loss.backward()
    torch.cuda.synchronize()
    g = {("dgk" if n == "g" else "d" + n): leaves[n].grad for n in leaves}
    g["dh0"] = None if h is None else h.grad
    return g, deltacp.last_cuda_tier()[0]


def _ref_grads(p, do, dht, with_h0):
    return ref.dplr_backward(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], do.double().numpy(),
                             dht=None if dht is None else dht.double().numpy(),
                             initial_state=p["initial_state"] if with_h0 else None, cu_seqlens=p["cu_seqlens"])


def _check_grads(g, g_ref, tol, label, with_h0):
    errs = {}
    for n in GRADS:
        if n == "dh0" and not with_h0:
            continue
        assert g[n] is not None, f"{label}: no {n}"
        errs[n] = rel_err(g[n].double().cpu().numpy(), g_ref[n])
    print(f"[errors] {label}: " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < tol, f"{label}: {n} relative error {e:.2e} >= {tol}"


@pytest.mark.parametrize("shape", BWD_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("states", ["h0_dht", "h0_nodht", "noh0_dht"])
def test_dplr_tiled_backward_against_reference(shape, dtype, states):
    """Every gradient of the tiled backward (it, not the naive one, runs: last_cuda_tier) against the fp64
    reference's analytic backward on the same rounded inputs."""
    with_h0, with_dht = states.startswith("h0"), states.endswith("_dht")
    p, t, h0, cu = _inputs(shape, dtype, seed=zlib.crc32(f"bwd/{shape}/{dtype}/{states}".encode()))
    do, dht = _upstream(p, dtype, zlib.crc32(f"up/{shape}/{states}".encode()), with_dht)
    g, tier = _tiled_grads(t, h0 if with_h0 else None, cu, "tiled", do, dht)
    assert tier == "tiled"
    _check_grads(g, _ref_grads(p, do, dht, with_h0), TOL[dtype], f"tiled dplr bwd {shape} {dtype} {states}", with_h0)


@pytest.mark.parametrize("shape", ["T1", "T65_K32_V48", "T130_K128_V128", "tiny_varlen"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("chunk_size", [16, 32])
def test_dplr_tiled_backward_chunk_sizes_and_fp16(shape, dtype, chunk_size):
    p, t, h0, cu = _inputs(shape, dtype, seed=zlib.crc32(f"bwdcs/{shape}/{dtype}/{chunk_size}".encode()))
    do, dht = _upstream(p, dtype, 21, True)
    g, tier = _tiled_grads(t, h0, cu, "tiled", do, dht, chunk_size=chunk_size)
    assert tier == "tiled"
    _check_grads(g, _ref_grads(p, do, dht, True), TOL[dtype], f"tiled dplr bwd {shape} {dtype} chunk {chunk_size}",
                 True)


@pytest.mark.parametrize("shape", ["T200", "T130_K128_V128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dplr_tiled_backward_strong_decay(shape, dtype):
    """Gates down to the chunk form's limit (-1024 / 64 = -16): cumulative decays of hundreds inside a chunk,
    where a positive exponent anywhere would overflow and a wrongly masked one would underflow a live term."""
    p, t, h0, cu = _inputs(shape, dtype, seed=zlib.crc32(f"strong/{shape}/{dtype}".encode()))
    t["g"] = (t["g"].float() * 40.0).clamp(min=-16.0).to(t["g"].dtype)
    p["g"] = t["g"].double().cpu().numpy()
    do, dht = _upstream(p, dtype, 61, True)
    g, tier = _tiled_grads(t, h0, cu, "tiled", do, dht)
    assert tier == "tiled"
    _check_grads(g, _ref_grads(p, do, dht, True), TOL[dtype], f"tiled dplr bwd strong decay {shape} {dtype}", True)


@pytest.mark.parametrize("shape", ["T63", "T130_K128_V128", "varlen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dplr_tiled_backward_against_naive(shape, dtype):
    """The tiled and the naive tier's gradients of the same call agree (each within the tolerance of the fp64
    reference, so within twice it of each other)."""
    p, t, h0, cu = _inputs(shape, dtype, seed=zlib.crc32(f"vsnaive/{shape}/{dtype}".encode()))
    do, dht = _upstream(p, dtype, 31, True)
    g_t, tier_t = _tiled_grads(t, h0, cu, "tiled", do, dht)
    g_n, tier_n = _tiled_grads(t, h0, cu, "naive", do, dht)
    assert (tier_t, tier_n) == ("tiled", "naive")
    errs = {n: rel_err(g_t[n].double().cpu().numpy(), g_n[n].double().cpu().numpy()) for n in GRADS}
    print(f"[errors] tiled vs naive dplr bwd {shape} {dtype}: " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < 2 * TOL[dtype], f"{n}: tiled vs naive {e:.2e}"


def test_dplr_tiled_backward_rwkv7_gate_fp32_and_state_v_first():
    """chunk_rwkv7(backend="tiled") differentiates through the tiled backward: with gk (w) in fp32 beside bf16
    inputs its gradients equal chunk_dplr_delta_rule's, and RWKV-7's [V, K] initial state gets the transposed
    dh0; all against the reference."""
    p, t, h0, cu = _inputs("varlen", torch.bfloat16, seed=41, gate_fp32=True)
    do, dht = _upstream(p, torch.bfloat16, 42, False)
    g1, tier = _tiled_grads(t, h0, cu, "tiled", do, None)
    assert tier == "tiled" and g1["dgk"].dtype == torch.float32
    g2, _ = _tiled_grads(t, h0, cu, "tiled", do, None, rwkv7=True)
    for n in GRADS:
        assert torch.equal(g1[n], g2[n]), n
    _check_grads(g1, _ref_grads(p, do, None, True), 1e-2, "tiled dplr bwd rwkv7 gk fp32", True)
    leaves = {n: x.clone().requires_grad_(True) for n, x in t.items()}
    hv = h0.transpose(-1, -2).contiguous().requires_grad_(True)
    o, _ = deltacp.chunk_rwkv7(leaves["q"], leaves["g"], leaves["k"], leaves["v"], leaves["a"], leaves["b"],
                               scale=64 ** -0.5, initial_state=hv, cu_seqlens=cu.cuda(), backend="tiled",
                               state_v_first=True)
    (o * do.cuda()).sum().backward()
    assert torch.equal(hv.grad, g1["dh0"].transpose(-1, -2))
    assert torch.equal(leaves["g"].grad, g1["dgk"])


def test_dplr_tiled_backward_gates_outside_range_use_naive():
    """gk below the chunk form's range: backend="tiled" falls back to the naive tier for both directions."""
    p, t, h0, cu = _inputs("T63", torch.float32, seed=7)
    t["g"][0, 10, 1, 5] = -100.0  # below -1024 / 64
    do, dht = _upstream(p, torch.float32, 51, True)
    g_t, tier = _tiled_grads(t, h0, cu, "tiled", do, dht)
    g_n, _ = _tiled_grads(t, h0, cu, "naive", do, dht)
    assert tier == "naive"
    for n in GRADS:
        assert torch.equal(g_t[n], g_n[n]), n


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
    xs = {n: torch.tensor(x).to(torch.bfloat16) for n, x in rwkv7_inputs(rng, 2, 1000, 4, 64, 64).items()}
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
    (every input gradient absent: the tiled DPLR reverse state-gradient scan) gives the reference's dh0, and the
    full tiled backward by name the same dh0 bit for bit (the same scan) and the reference's input gradients."""
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
    # the full backward by name: every input gradient (NaN-poisoned first) and the same dh0
    grads = {n: torch.full_like(t[n], float("nan")) for n in ("q", "k", "v", "a", "b", "g")}
    for n, x in grads.items():
        dd["d" + n] = desc(x, "dgk" if n == "g" else "d" + n)
    dh0_full = torch.full((N, H, K, V), float("nan"), device="cuda")
    dd["dh0"] = desc(dh0_full, "dh0")
    _core.run("backward", "dplr", "tiled", "float32", dd, None, 64, None, stream, False)
    torch.cuda.synchronize()
    assert torch.equal(dh0_full, dh0)
    for n, x in grads.items():
        name = "dgk" if n == "g" else "d" + n
        err = rel_err(x.double().cpu().numpy(), g_ref[name])
        assert err < TOL[dtype], f"{name} {err:.2e}"


# ---- the chunk-local kernel (dplr_bwd_local_wgmma.cuh) against kernels 5 + 6 -------------------------------------
# 16-bit K = V = 64 or 128 on compute capability 9.0 runs kernels 5 and 6 as one Hopper kernel (at 128 one CTA per
# key half) unless DELTACP_TILED_DPLR_BWD_LOCAL=0; "1" requires it. Its gram takes a per-key-column mid reference
# where the column's span allows and an element-by-element path elsewhere, so the gate families below cover both
# paths and their mix.
LOCAL_SHAPES = ["T1", "T200", "varlen", "tiny_varlen",  # K = V = 64; short last chunks, one-token chunks
                "T1_K128", "T130_K128_V128", "varlen_K128"]  # K = V = 128


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _gate_family(t, p, family, seed):
    """Replaces the gates: "mild" (make_problem's), "bench" (logsigmoid(randn) clamped to -5: the benchmark's,
    spans about 51 a chunk), "steep" (-3 .. -5 per token: spans up to 320, every column falls back), "mixed" (a
    third of the key columns steep beside mild ones)."""
    rng = np.random.default_rng(seed)
    shape = tuple(t["g"].shape)
    if family == "mild":
        return
    if family == "bench":
        g = np.maximum(np.log(1 / (1 + np.exp(-rng.standard_normal(shape)))), -5.0)
    elif family == "steep":
        g = -rng.uniform(3.0, 5.0, shape)
    else:
        steep = rng.uniform(size=(1, 1, 1, shape[-1])) < 0.33
        g = np.where(steep, -rng.uniform(1.0, 5.0, shape), p["g"])
    t["g"] = torch.tensor(g).to(t["g"].dtype).cuda()
    p["g"] = t["g"].double().cpu().numpy()


def _grads_with_switch(monkeypatch, value, t, h0, cu, do, dht):
    if value is None:
        monkeypatch.delenv("DELTACP_TILED_DPLR_BWD_LOCAL", raising=False)
    else:
        monkeypatch.setenv("DELTACP_TILED_DPLR_BWD_LOCAL", value)
    g, tier = _tiled_grads(t, h0, cu, "tiled", do, dht)
    assert tier == "tiled"
    return g


@pytest.mark.parametrize("shape", LOCAL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("gates", ["mild", "bench", "steep", "mixed"])
def test_dplr_local_kernel_against_pair_and_reference(shape, dtype, gates, monkeypatch):
    """Every gradient of the chunk-local kernel (switch "1": an error if it does not run) and of kernels 5 + 6
    (switch "0") against the fp64 reference, and against each other. Each within the 16-bit tolerance of the
    reference, or (dgk under steep gates, where both kernels' roundings meet cancellations) within 1.5x the
    pair's own error."""
    if not _hopper():
        pytest.skip("the chunk-local kernel runs on compute capability 9.0 only")
    p, t, h0, cu = _inputs(shape, dtype, seed=zlib.crc32(f"local/{shape}/{dtype}/{gates}".encode()))
    _gate_family(t, p, gates, zlib.crc32(f"localg/{shape}/{gates}".encode()))
    do, dht = _upstream(p, dtype, zlib.crc32(f"localup/{shape}".encode()), True)
    g_ref = _ref_grads(p, do, dht, True)
    g_new = _grads_with_switch(monkeypatch, "1", t, h0, cu, do, dht)
    g_old = _grads_with_switch(monkeypatch, "0", t, h0, cu, do, dht)
    tol = TOL[dtype]
    errs = {}
    for n in GRADS:
        e_new = rel_err(g_new[n].double().cpu().numpy(), g_ref[n])
        e_old = rel_err(g_old[n].double().cpu().numpy(), g_ref[n])
        e_pair = rel_err(g_new[n].double().cpu().numpy(), g_old[n].double().cpu().numpy())
        errs[n] = (e_new, e_old, e_pair)
        assert np.isfinite(e_new), f"{n}: not finite"
        assert e_new < max(tol, 1.5 * e_old), f"{n}: local kernel {e_new:.2e}, kernels 5 + 6 {e_old:.2e}"
        assert e_pair < max(2 * tol, 3 * e_old), f"{n}: local vs kernels 5 + 6 {e_pair:.2e}"
    print(f"[errors] dplr local {shape} {dtype} {gates} (new / old / new-vs-old): " +
          " ".join(f"{n} {a:.1e}/{b:.1e}/{c:.1e}" for n, (a, b, c) in errs.items()))
    # dh0 comes from the reverse scan, which both paths share: the same bits
    assert torch.equal(g_new["dh0"], g_old["dh0"])


def test_dplr_local_kernel_switch(monkeypatch):
    """Unset selects the chunk-local kernel on Hopper for 16-bit K = V = 64 and 128 (the same bits as "1", and
    deterministic); "1" names why it cannot run fp32 inputs or other K / V; anything but 0 / 1 is an error."""
    if not _hopper():
        pytest.skip("the chunk-local kernel runs on compute capability 9.0 only")
    for i, shape in enumerate(("T200", "T130_K128_V128")):
        p, t, h0, cu = _inputs(shape, torch.bfloat16, seed=91 + 10 * i)
        _gate_family(t, p, "mixed", 92 + 10 * i)
        do, dht = _upstream(p, torch.bfloat16, 93 + 10 * i, True)
        g_unset = _grads_with_switch(monkeypatch, None, t, h0, cu, do, dht)
        g_one = _grads_with_switch(monkeypatch, "1", t, h0, cu, do, dht)
        g_one2 = _grads_with_switch(monkeypatch, "1", t, h0, cu, do, dht)
        g_zero = _grads_with_switch(monkeypatch, "0", t, h0, cu, do, dht)
        for n in GRADS:
            assert torch.equal(g_unset[n], g_one[n]), f"{shape} {n}: unset runs the wrong kernels"
            assert torch.equal(g_one[n], g_one2[n]), f"{shape} {n}: not deterministic"
        # a different summation and reference: the two paths differ somewhere (else the switch did nothing)
        assert any(not torch.equal(g_one[n], g_zero[n]) for n in ("dq", "dk", "dv", "da", "db", "dgk")), shape
    for dtype, shape in ((torch.float32, "T200"), (torch.float32, "T130_K128_V128"),
                         (torch.bfloat16, "T65_K32_V48"), (torch.bfloat16, "K100_V33")):
        p2, t2, h02, cu2 = _inputs(shape, dtype, seed=94)
        do2, dht2 = _upstream(p2, dtype, 95, True)
        monkeypatch.setenv("DELTACP_TILED_DPLR_BWD_LOCAL", "1")
        with pytest.raises(Exception, match="DELTACP_TILED_DPLR_BWD_LOCAL"):
            _tiled_grads(t2, h02, cu2, "tiled", do2, dht2)
        _grads_with_switch(monkeypatch, None, t2, h02, cu2, do2, dht2)  # unset: kernels 5 + 6, no error
    monkeypatch.setenv("DELTACP_TILED_DPLR_BWD_LOCAL", "2")
    with pytest.raises(Exception, match="DELTACP_TILED_DPLR_BWD_LOCAL"):
        _tiled_grads(t, h0, cu, "tiled", do, dht)


def test_dplr_local_switch_off_elsewhere(monkeypatch):
    """Off Hopper (or with the switch at 0) the pair runs: "0" gives the same bits as unset there."""
    if _hopper():
        pytest.skip("on compute capability 9.0 unset selects the chunk-local kernel")
    p, t, h0, cu = _inputs("T200", torch.bfloat16, seed=96)
    do, dht = _upstream(p, torch.bfloat16, 97, True)
    g_unset = _grads_with_switch(monkeypatch, None, t, h0, cu, do, dht)
    g_zero = _grads_with_switch(monkeypatch, "0", t, h0, cu, do, dht)
    for n in GRADS:
        assert torch.equal(g_unset[n], g_zero[n]), n


@pytest.mark.parametrize("shape", ["varlen", "varlen_K128", "H16_K128"])
def test_dplr_backward_scans_beside(shape, monkeypatch):
    """The full backward's forward and reverse scans side by side (dplr_bwd.cu, DELTACP_TILED_DPLR_BWD_BESIDE: the
    reverse scan on the side stream after the output stage) against the four kernels one after the other (=0):
    both within the bf16 tolerance of the fp64 reference and within 1e-3 of each other (the same arithmetic per
    value column; at H16_K128 the two modes take different column widths); unset is =1 bit for bit, =1 is
    deterministic, and anything but 0 / 1 is an error naming the variable."""
    var = "DELTACP_TILED_DPLR_BWD_BESIDE"
    p, t, h0, cu = _inputs(shape, torch.bfloat16, seed=zlib.crc32(f"beside/{shape}".encode()))
    do, dht = _upstream(p, torch.bfloat16, zlib.crc32(f"besideup/{shape}".encode()), True)
    g_ref = _ref_grads(p, do, dht, True)

    def grads(value):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
        g, tier = _tiled_grads(t, h0, cu, "tiled", do, dht)
        assert tier == "tiled"
        return g

    g_on, g_on2, g_off, g_unset = grads("1"), grads("1"), grads("0"), grads(None)
    for n in GRADS:
        on, off = g_on[n].double().cpu().numpy(), g_off[n].double().cpu().numpy()
        assert np.isfinite(on).all(), f"{n}: not finite side by side"
        assert rel_err(on, g_ref[n]) < TOL[torch.bfloat16], f"{n}: side by side vs the reference"
        assert rel_err(off, g_ref[n]) < TOL[torch.bfloat16], f"{n}: in order vs the reference"
        assert rel_err(on, off) < 1e-3, f"{n}: side by side vs in order {rel_err(on, off):.2e}"
        assert torch.equal(g_on[n], g_on2[n]), f"{n}: side by side is not deterministic"
        assert torch.equal(g_on[n], g_unset[n]), f"{n}: unset is not side by side"
    monkeypatch.setenv(var, "2")
    with pytest.raises(Exception, match=var):
        _tiled_grads(t, h0, cu, "tiled", do, dht)


@pytest.mark.parametrize("shape", ["varlen_K128", "H16_K128", "H72"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dplr_scans_8_warps(shape, dtype, monkeypatch):
    """The scans on 8 warps (dplr_stages.cuh ScanWarps, DELTACP_TILED_DPLR_SCAN8=1; unset = 8 at K = 128, 4 at
    K = 64) against 4 (=0): every element's products run over the same k-steps in the same order, so the forward's
    o and ht and every gradient are the same bits; the 8-warp results are within the tolerance of the fp64
    reference. =1 where the layout does not apply (K = 64 with 16-column blocks: two heads) and anything but 0 / 1
    are errors naming the variable."""
    var = "DELTACP_TILED_DPLR_SCAN8"
    p, t, h0, cu = _inputs(shape, dtype, seed=zlib.crc32(f"scan8/{shape}/{dtype}".encode()))
    do, dht = _upstream(p, dtype, zlib.crc32(f"scan8up/{shape}/{dtype}".encode()), True)

    def run(value):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
        o, ht = _run(t, h0, cu, "tiled", 64)
        g, tier = _tiled_grads(t, h0, cu, "tiled", do, dht)
        assert tier == "tiled"
        return dict(g, o=o, ht=ht)

    eight, four, unset = run("1"), run("0"), run(None)
    o_ref, ht_ref = ref.dplr(p["q"], p["k"], p["v"], p["a"], p["b"], p["g"], initial_state=p["initial_state"],
                             cu_seqlens=p["cu_seqlens"])
    g_ref = dict(_ref_grads(p, do, dht, True), o=o_ref, ht=ht_ref)
    for n in GRADS + ("o", "ht"):
        got = eight[n].double().cpu().numpy()
        assert np.isfinite(got).all(), f"{n}: not finite on 8 warps"
        assert rel_err(got, g_ref[n]) < TOL[dtype], f"{n}: 8 warps vs the reference {rel_err(got, g_ref[n]):.2e}"
        assert torch.equal(eight[n], four[n]), f"{n}: 8 warps and 4 differ"
        assert torch.equal(eight[n], unset[n]), f"{n}: unset differs"
    p2, t2, h02, cu2 = _inputs("varlen", torch.bfloat16, seed=5)
    monkeypatch.setenv(var, "1")
    with pytest.raises(Exception, match=var):
        _run(t2, h02, cu2, "tiled", 64)
    monkeypatch.setenv(var, "2")
    with pytest.raises(Exception, match=var):
        _run(t, h0, cu, "tiled", 64)
