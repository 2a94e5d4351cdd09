"""The one-pass CUDA l2 norm of rows (cuda/common/l2norm.cu, deltacp/_l2norm.py) that FLA's
use_qk_l2norm_in_kernel runs on CUDA tensors: forward and gradient against the torch expression in
float64, the registered op (torch.library.opcheck). Skipped without a CUDA device."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import deltacp  # noqa: E402
from deltacp import _l2norm  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _torch_l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3), (torch.float16, 1e-3)],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("D", [128, 64, 100, 160, 256, 1])
def test_l2norm_rows_against_torch(dtype, tol, D):
    if not deltacp.built_with_cuda():
        pytest.fail("a CUDA device is present but deltacp was built without the CUDA tiers")
    torch.manual_seed(D)
    x = (3 * torch.randn(2, 37, 3, D, device="cuda")).to(dtype).requires_grad_(True)
    assert _l2norm.applies(x)
    y = _l2norm.l2norm_rows(x)
    x64 = x.detach().double().requires_grad_(True)
    y64 = _torch_l2norm(x64)
    assert y.dtype == dtype and y.shape == x.shape
    assert ((y.double() - y64).norm() / y64.norm()).item() < tol
    if D < 32:
        # |y| ~ 1 for a row of one element: dx = r dy (1 - y^2) cancels to eps / (x^2 + eps), a relative error
        # of 1e-1 in fp32 whatever computes it (FLA's kernel too); head dims are 32 and more.
        return
    dy = torch.randn_like(y64)
    (y.double() * dy).sum().backward()
    (y64 * dy).sum().backward()
    err = ((x.grad.double() - x64.grad).norm() / x64.grad.norm()).item()
    assert err < 2 * tol, err


def test_l2norm_rows_on_views_and_the_fla_option():
    """A non-contiguous view is normalised like its contiguous copy; deltacp.fla_options.l2norm takes the
    kernel on CUDA."""
    from deltacp import fla_options

    x = torch.randn(4, 50, 2, 256, device="cuda", dtype=torch.bfloat16)[..., :128]
    assert torch.equal(_l2norm.l2norm_rows(x), _l2norm.l2norm_rows(x.contiguous()))
    assert torch.equal(fla_options.l2norm(x), _l2norm.l2norm_rows(x.contiguous()))


def test_l2norm_rows_opcheck():
    x = torch.randn(3, 5, 64, device="cuda", dtype=torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.deltacp.l2norm_rows.default, (x, 1e-6))


def test_l2norm_rows_routes_give_the_same_bits():
    """l2norm_rows' three routes (the kernel alone without a gradient, an autograd Function with one, the
    registered op as torch.compile traces it) launch the same kernels: y and dx bit for bit."""
    torch.manual_seed(5)
    x = (3 * torch.randn(2, 70, 3, 128, device="cuda")).to(torch.bfloat16)
    dy = torch.randn(x.shape, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        y_plain = _l2norm.l2norm_rows(x.requires_grad_(True))
    assert y_plain.grad_fn is None
    xa = x.detach().requires_grad_(True)
    y_fn = _l2norm.l2norm_rows(xa)
    y_fn.backward(dy)
    xo = x.detach().requires_grad_(True)
    y_op = torch.ops.deltacp.l2norm_rows.default(xo, 1e-6)[0]
    y_op.backward(dy)
    assert torch.equal(y_plain, y_fn) and torch.equal(y_fn, y_op)
    assert torch.equal(xa.grad, xo.grad)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_l2norm_rows_tile_kernels_give_the_row_kernels_bits(dtype):
    """Rows of 128 16-bit elements at 16-byte aligned pointers take the kernels that move 32 rows a block through
    shared memory; the same rows 2 bytes off that alignment take the one-row kernels: y and dx bit for bit (77 rows:
    a partial last tile)."""
    torch.manual_seed(3)
    n = 77
    x0 = (3 * torch.randn(n * 128, device="cuda")).to(dtype)
    dy0 = torch.randn(n * 128, device="cuda").to(dtype)
    got = []
    for off in (0, 1):  # the same values at element offset 0 (16-byte aligned) and 1 (2 bytes off)
        buf, dbuf = x0.new_zeros(n * 128 + 8), dy0.new_zeros(n * 128 + 8)
        buf[off:off + n * 128] = x0
        dbuf[off:off + n * 128] = dy0
        x = buf[off:off + n * 128].view(n, 128).requires_grad_(True)
        y = _l2norm.l2norm_rows(x)
        y.backward(dbuf[off:off + n * 128].view(n, 128))
        got.append((y.detach(), x.grad))
    assert torch.equal(got[0][0], got[1][0]), "y"
    assert torch.equal(got[0][1], got[1][1]), "dx"
