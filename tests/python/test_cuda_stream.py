"""deltacp._stream: the device guard and stream handle every launch from torch tensors uses. The handle must be
torch's current stream on the tensor's device (a launch elsewhere would race torch's own work), and the guard must
make that device current only when it is not already. Skipped without a CUDA device."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from deltacp import _stream  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_stream_handle_is_torchs_current_stream():
    dev = torch.device("cuda", torch.cuda.current_device())
    assert _stream.stream_handle(dev) == torch.cuda.current_stream(dev).cuda_stream
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        assert _stream.stream_handle(dev) == side.cuda_stream
        assert _stream.stream_handle(torch.device("cuda")) == side.cuda_stream  # no index: the current device


def test_device_guard_only_switches_when_needed():
    here = torch.cuda.current_device()
    with _stream.on_device(torch.device("cuda", here)):
        assert torch.cuda.current_device() == here
    if torch.cuda.device_count() < 2:
        pytest.skip("one CUDA device: no other device to switch to")
    other = (here + 1) % torch.cuda.device_count()
    with _stream.on_device(torch.device("cuda", other)):
        assert torch.cuda.current_device() == other
        side = torch.cuda.Stream(torch.device("cuda", other))
        with torch.cuda.stream(side):
            assert _stream.stream_handle(torch.device("cuda", other)) == side.cuda_stream
    assert torch.cuda.current_device() == here


def test_a_launch_on_a_side_stream_orders_with_it():
    """An l2 norm launched inside torch.cuda.stream(side) runs on side: its result is ready after side's work."""
    import deltacp
    from deltacp import _l2norm

    if not deltacp.built_with_cuda():
        pytest.fail("a CUDA device is present but deltacp was built without the CUDA tiers")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = torch.randn(64, 4096, 128, device="cuda")  # made on side, normalised on side
        y = _l2norm.l2norm_rows(x)
    torch.cuda.current_stream().wait_stream(side)
    ref = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6)
