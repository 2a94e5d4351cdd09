"""safe_gate's range check made by the CUDA forward itself (Params::gate_range; cuda/common/gate_range.h): with a
gradient wanted, the forward's kernels reduce the smallest and largest value of g into two int slots (the fused kda
stage as it loads the gate, every other path in one pass of its own) and the backward judges them
(deltacp/_library.py in_forward_range_check). Checked on each path (the fused kda stage on wgmma at K = V = 128 and
its mma.sync kernel at K = V = 64, the tiled tier by name, a packed varlen batch): inside the promised range the
outputs and gradients are those of the call without safe_gate, bit for bit; a value below the bound, a positive value
and a NaN each make the backward raise InvalidArgumentError naming 'g' and the range torch.aminmax reports. The
slots' integer form is checked on the host without a GPU (the decoder against numpy's bit view and float order).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
from deltacp import _library  # noqa: E402
from deltacp.errors import InvalidArgumentError  # noqa: E402

CASES = {  # name: (K = V, backend, varlen)
    "fused-wgmma-k128": (128, None, False),
    "fused-k64": (64, None, False),
    "tiled-k128": (128, "tiled", False),
    "fused-varlen-k128": (128, None, True),
}


def _encode(x: np.ndarray) -> np.ndarray:
    """cuda/common/gate_range.cuh gate_order_key on the host."""
    bits = np.asarray(x, dtype=np.float32).view(np.int32)
    return np.where(bits >= 0, bits, bits ^ np.int32(0x7FFFFFFF))


def test_gate_range_keys_decode_and_sort_like_floats():
    values = np.array([-np.inf, -3.3e38, -5.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 2.0, 3.4e38, np.inf], np.float32)
    keys = _encode(values)
    assert np.all(np.diff(keys.astype(np.int64)) > 0)  # the keys' order is the floats' order
    for x, key in zip(values, keys):
        y = _library._key_to_float(int(key))
        assert y == x and math.copysign(1.0, y) == math.copysign(1.0, float(x))
    # the slots' starting values (two memsets: bytes 0x7f and 0x80) decode to +-3.39e38
    assert _library._key_to_float(0x7F7F7F7F) == pytest.approx(3.39e38, rel=1e-2)
    assert _library._key_to_float(np.int32(-0x7F7F7F80).item()) == pytest.approx(-3.39e38, rel=1e-2)
    # a NaN of either sign lands beyond every number and decodes to NaN
    for nan_bits in (0x7FC00000, -0x00400000):
        key = int(_encode(np.array([nan_bits], np.int32).view(np.float32))[0])
        assert key > int(keys[-1]) or key < int(keys[0])
        assert math.isnan(_library._key_to_float(key))


def _inputs(D, varlen, seed=3):
    gen = torch.Generator().manual_seed(seed)
    B, T, H = (1, 300, 2) if varlen else (2, 200, 2)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = {"q": rnd(B, T, H, D), "k": rnd(B, T, H, D), "v": rnd(B, T, H, D)}
    x = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in x.items()}
    x["g"] = (torch.nn.functional.logsigmoid(rnd(B, T, H, D)) / 4).clamp(min=-4.5).cuda()  # fp32, in [-4.5, 0]
    x["beta"] = torch.rand(B, T, H, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 7, 150, 151, 300], device="cuda") if varlen else None
    return x, cu


def _step(x, cu, backend, **kw):
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o, _ = deltacp.chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                             use_qk_l2norm_in_kernel=True, cu_seqlens=cu, backend=backend, **kw)
    grads = torch.autograd.grad((o.float() * 0.01).sum(), list(leaves.values()))
    return o, grads


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_safe_gate_check_in_the_forward(case, monkeypatch):
    from deltacp_testutil import require_fused_gpu

    require_fused_gpu()
    D, backend, varlen = CASES[case]
    x, cu = _inputs(D, varlen)
    o_plain, g_plain = _step(x, cu, backend)

    def no_pass_of_its_own(*args, **kwargs):
        raise AssertionError("safe_gate's check took a pass over g before the forward")

    monkeypatch.setattr(_library, "start_gate_range_check", no_pass_of_its_own)
    o_safe, g_safe = _step(x, cu, backend, safe_gate=True, lower_bound=-5.0)
    assert torch.equal(o_plain, o_safe)
    for a, b in zip(g_plain, g_safe):
        assert torch.equal(a, b)
    T = x["g"].shape[1]
    for what, value, at in (("below the bound", -5.25, (0, T - 1, 1, D - 1)), ("positive", 0.5, (0, T // 2, 0, 3)),
                            ("nan", float("nan"), (0, 66, 1, 64 % D))):
        bad = dict(x, g=x["g"].clone())
        bad["g"][at] = value
        lo, hi = (v.item() for v in torch.aminmax(bad["g"]))
        with pytest.raises(InvalidArgumentError, match=r"'g'.*safe_gate") as err:
            _step(bad, cu, backend, safe_gate=True, lower_bound=-5.0)
        got = re.search(r"got values in \[(\S+), (\S+)\]", str(err.value))
        assert got is not None, str(err.value)
        if what == "nan":
            assert "nan" in got.group(0), (case, str(err.value))
        else:
            assert float(got.group(1)) == lo and float(got.group(2)) == hi, (case, what, str(err.value), lo, hi)
