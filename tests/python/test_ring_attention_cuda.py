"""Ring attention's CUDA step (cuda/attention/ring_step.cu through deltacp._core) and ring attention on
GPUs. Skipped without a CUDA device or without the CUDA build.

  * the step kernels against fp64 attention on the same (rounded) inputs: two key blocks of zig-zag
    positions merged into the fp32 accumulators give o and lse of attention over both blocks; the
    backward with the final (lse, delta) summed over the blocks gives dq, dk, dv (bf16 and fp16, head
    dims 64 and 128, grouped K/V, causal and not): relative error <= 1e-4;
  * deltacp.cp.ring_attention on one GPU equals plain attention (bf16 1e-2) with the ring-step kernels
    (the default), with torch's flash kernels per block pair (DELTACP_RING_KERNEL=flash) and with the
    torch block path (DELTACP_RING_KERNEL=torch);
  * with 2+ GPUs: torchrun ring_attention_cp over NCCL, checked against one process by the example;
  * bad input to the step names the argument.

    python3 -m pytest -q tests/python/test_ring_attention_cuda.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from deltacp import _core  # noqa: E402

if not hasattr(_core, "attention_ring_step_forward"):
    pytest.skip("deltacp was built without CUDA (no ring-step kernels)", allow_module_level=True)

import deltacp.cp as cp  # noqa: E402
from deltacp.cp.ring_attention import _desc  # noqa: E402

DEV = torch.device("cuda")


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _reference(q, k, v, qpos, kpos, causal, scale):
    """fp64 attention of q [B, Tq, H, D] over k, v [B, Tk, HKV, D] with positions: (o [B, H, Tq, D], lse)."""
    G = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        s = s.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("bhij,bjhd->bhid", torch.softmax(s, dim=-1), v), lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_step_kernels_equal_fp64_attention(dtype, D, hkv, causal):
    B, H, N, T = 2, 4, 4, 160  # 4 ranks of 40 tokens (blocks of 20): not multiples of the 32-row tiles
    gen = torch.Generator().manual_seed(5)
    pos = [cp.zigzag_positions(T, N, r) for r in range(N)]
    qp, kp1, kp2 = pos[1], pos[1], pos[3]  # rank 1's queries against its own block and rank 3's
    n = len(qp)
    q = torch.randn(B, n, H, D, generator=gen).to(dtype)
    k1, v1, k2, v2 = (torch.randn(B, n, hkv, D, generator=gen).to(dtype) for _ in range(4))
    do = torch.randn(B, n, H, D, generator=gen).to(dtype)
    scale = D ** -0.5
    dq_, dk1_, dv1_, dk2_, dv2_ = (t.to(DEV) for t in (q, k1, v1, k2, v2))
    qpd, kp1d, kp2d = (p.to(DEV) for p in (qp, kp1, kp2))
    o = torch.zeros(B, H, n, D, device=DEV)
    lse = torch.full((B, H, n), float("-inf"), device=DEV)
    stream = torch.cuda.current_stream().cuda_stream
    for kk, vv, kp in ((dk1_, dv1_, kp1d), (dk2_, dv2_, kp2d)):
        _core.attention_ring_step_forward(_desc(dq_), _desc(kk), _desc(vv), _desc(qpd), _desc(kp), _desc(o),
                                          _desc(lse), causal, scale, stream)
    # fp64 reference over both blocks, on the same rounded inputs, with autograd for the gradients
    ref_in = [t.double().requires_grad_() for t in (q, torch.cat([k1, k2], 1), torch.cat([v1, v2], 1))]
    o_ref, lse_ref = _reference(*ref_in, qp, torch.cat([kp1, kp2]), causal, scale)
    assert _rel(o.cpu(), o_ref) < 1e-4
    assert _rel(lse.cpu(), lse_ref) < 1e-4
    (o_ref * do.double().transpose(1, 2)).sum().backward()

    delta = (do.to(DEV).float().transpose(1, 2) * o).sum(-1).contiguous()
    dq = torch.zeros(B, H, n, D, device=DEV)
    dks, dvs = [], []
    for kk, vv, kp in ((dk1_, dv1_, kp1d), (dk2_, dv2_, kp2d)):
        dk = torch.zeros(B, hkv, n, D, device=DEV)
        dv = torch.zeros(B, hkv, n, D, device=DEV)
        _core.attention_ring_step_backward(_desc(dq_), _desc(kk), _desc(vv), _desc(do.to(DEV)), _desc(qpd),
                                           _desc(kp), _desc(lse), _desc(delta), _desc(dq), _desc(dk), _desc(dv),
                                           causal, scale, stream)
        dks.append(dk.transpose(1, 2).cpu())
        dvs.append(dv.transpose(1, 2).cpu())
    assert _rel(dq.transpose(1, 2).cpu(), ref_in[0].grad) < 1e-4
    assert _rel(torch.cat(dks, 1), ref_in[1].grad) < 1e-4
    assert _rel(torch.cat(dvs, 1), ref_in[2].grad) < 1e-4


@pytest.mark.parametrize("D", [64, 128])
def test_ring_attention_one_gpu(D, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 256, 8, D, generator=gen).to(torch.bfloat16)
    k, v, do = (torch.randn(2, 256, h, D, generator=gen).to(torch.bfloat16) for h in (2, 2, 8))

    def run():
        x = [t.to(DEV).requires_grad_() for t in (q, k, v)]
        o = cp.ring_attention(*x, causal=True)
        o.backward(do.to(DEV))
        return [o] + [t.grad for t in x]

    kernel = run()  # the default on CUDA bf16: deltacp's ring-step kernels
    monkeypatch.setenv("DELTACP_RING_KERNEL", "flash")
    flash = run()
    monkeypatch.setenv("DELTACP_RING_KERNEL", "torch")
    torch_path = run()
    full = [t.double().requires_grad_() for t in (q, k, v)]
    o_ref = cp.attention_reference(*full, causal=True)
    (o_ref * do.double()).sum().backward()
    for got, fl, alt, want in zip(kernel, flash, torch_path, [o_ref] + [t.grad for t in full]):
        assert _rel(got.cpu(), want) < 1e-2
        assert _rel(fl.cpu(), want) < 1e-2
        assert _rel(got.cpu(), alt.cpu()) < 1e-2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ring_attention_nccl_two_gpus():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "deltacp.examples.ring_attention_cp", "--device", "cuda", "--dtype", "bfloat16", "--seqlen", "2048",
           "--heads", "8", "--kv-heads", "2", "--head-dim", "128"]
    for kernel in ("deltacp", "flash"):
        res = subprocess.run(cmd + ["--kernel", kernel], capture_output=True, text=True, timeout=600,
                             env=dict(os.environ))
        assert res.returncode == 0, res.stdout + res.stderr
        assert "NCCL" in res.stdout


def test_step_bad_input_names_the_argument():
    q = torch.zeros(1, 8, 2, 96, device=DEV, dtype=torch.bfloat16)
    pos = torch.arange(8, device=DEV)
    o = torch.zeros(1, 2, 8, 96, device=DEV)
    lse = torch.zeros(1, 2, 8, device=DEV)
    with pytest.raises(ValueError, match="argument 'q'.*head dim 64 or 128"):
        _core.attention_ring_step_forward(_desc(q), _desc(q), _desc(q), _desc(pos), _desc(pos), _desc(o), _desc(lse),
                                          True, 1.0, 0)
    q = torch.zeros(1, 8, 2, 64, device=DEV, dtype=torch.bfloat16)
    o = torch.zeros(1, 2, 8, 64, device=DEV)
    with pytest.raises(ValueError, match="argument 'kpos'"):
        _core.attention_ring_step_forward(_desc(q), _desc(q), _desc(q), _desc(pos), _desc(pos[:4]), _desc(o),
                                          _desc(lse), True, 1.0, 0)
    with pytest.raises(TypeError, match="argument 'k'"):
        _core.attention_ring_step_forward(_desc(q), _desc(q.half()), _desc(q), _desc(pos), _desc(pos), _desc(o),
                                          _desc(lse), True, 1.0, 0)
    with pytest.raises(ValueError, match="argument 'o_acc'"):
        _core.attention_ring_step_forward(_desc(q), _desc(q), _desc(q), _desc(pos), _desc(pos), _desc(o[:, :1]),
                                          _desc(lse), True, 1.0, 0)
