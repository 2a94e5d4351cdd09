"""Tensor descriptions for the C++ core: how numpy arrays and torch tensors reach ``_core.run``.

A description is the tuple ``(data pointer, dtype name, shape, element strides, device, name)``.
The C++ side (bindings/src/tensor_desc.cpp) checks shapes, dtypes, devices and that the last
dimension is contiguous, and points ``deltacp::Params`` at the caller's memory: nothing is copied.
"""

from __future__ import annotations

import numpy as np

FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")


def numpy_desc(arr: np.ndarray, name: str) -> tuple:
    """(ptr, dtype, shape, element strides, "cpu", name) of a numpy array."""
    itemsize = arr.dtype.itemsize
    strides = []
    for s in arr.strides:
        if s % itemsize:
            raise ValueError(
                f"deltacp: argument '{name}': byte strides {arr.strides} are not multiples of the "
                f"element size {itemsize}; pass np.ascontiguousarray({name})"
            )
        strides.append(s // itemsize)
    return (int(arr.ctypes.data), arr.dtype.name, tuple(arr.shape), tuple(strides), "cpu", name)


def torch_device_name(device) -> str:
    """"cpu" or "cuda:<index>" (what the C++ side compares)."""
    if device.type == "cuda":
        index = device.index
        if index is None:
            import torch

            index = torch.cuda.current_device()
        return f"cuda:{index}"
    return device.type


def torch_desc(t, name: str) -> tuple:
    """(ptr, dtype, shape, element strides, device, name) of a torch tensor."""
    dtype = str(t.dtype)
    if dtype.startswith("torch."):
        dtype = dtype[len("torch."):]
    return (int(t.data_ptr()), dtype, tuple(t.shape), tuple(t.stride()), torch_device_name(t.device), name)
