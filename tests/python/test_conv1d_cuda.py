"""deltacp.causal_conv1d and the GDN layer under CP on GPUs. Skipped without a CUDA device.

  * causal_conv1d on a CUDA tensor equals the fp64 definition (fp32 1e-6, bf16 1e-2), forward and
    backward, packed sequences, W = 2..4, SiLU;
  * with 2+ GPUs: torchrun gdn_layer_cp --device cuda (the convolutions' halo and the chunk op's
    exchange over NCCL), checked against one process by the example.

    python3 -m pytest -q tests/python/test_conv1d_cuda.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import deltacp  # noqa: E402
from deltacp.conv1d import causal_conv1d_reference  # noqa: E402


def _rel(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("W", [2, 3, 4])
def test_conv1d_on_gpu_equals_definition(dtype, tol, W):
    gen = torch.Generator().manual_seed(W)
    cu = [0, 3, 40, 41, 100]
    x = torch.randn(1, 100, 64, generator=gen).to(dtype)
    w = (torch.randn(64, W, generator=gen) * 0.5).to(dtype)
    b = torch.randn(64, generator=gen).to(dtype)
    dy = torch.randn(1, 100, 64, generator=gen).to(dtype)
    ins = [t.cuda().requires_grad_() for t in (x, w, b)]
    y, _ = deltacp.causal_conv1d(*ins, activation="silu", cu_seqlens=torch.tensor(cu, device="cuda"))
    (y * dy.cuda()).sum().backward()
    ref = [t.double().requires_grad_() for t in (x, w, b)]
    y_ref = causal_conv1d_reference(*ref, activation="silu", cu_seqlens=cu)
    (y_ref * dy.double()).sum().backward()
    assert _rel(y, y_ref) < tol
    for got, want in zip(ins, ref):
        assert _rel(got.grad, want.grad) < tol


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gdn_layer_cp_nccl_two_gpus():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "deltacp.examples.gdn_layer_cp", "--device", "cuda"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "NCCL" in res.stdout
