"""deltacp._stream — the device guard and the stream handle of every CUDA launch made from torch tensors.

    with on_device(t.device):
        _core.<launch>(..., stream_handle(t.device))

A training step makes a dozen launches from Python, and at small shapes their host time is the step's time:
torch.cuda.device builds and enters a guard object even when the device is already current, and
torch.cuda.current_stream builds a Stream object to read one integer. These two skip both where they can
and fall back to torch's public calls otherwise. (Imports nothing of deltacp.)
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["on_device", "stream_handle"]

# torch's raw-stream query (what Triton's launcher reads): the handle without a Stream object.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_ALREADY_CURRENT = contextlib.nullcontext()  # stateless: one instance serves every call, nested or not


def on_device(device):
    """A context that makes the CUDA ``device`` current: nothing to do when it already is (the common case),
    else torch.cuda.device(device)."""
    index = device.index
    if index is None or index == torch.cuda.current_device():
        return _ALREADY_CURRENT
    return torch.cuda.device(device)


def stream_handle(device) -> int:
    """The handle (cudaStream_t as an int) of torch's current stream on the CUDA ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(index))
    return torch.cuda.current_stream(index).cuda_stream
