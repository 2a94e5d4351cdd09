"""deltacp._workspace — the CUDA kernels' workspaces from torch's caching allocator.

Imported with the torch ops (deltacp._calls, which every torch entry point goes through), it routes the
workspaces of the CUDA tiers (cuda/common/workspace_pool.h) to torch's caching allocator, so that one
allocator serves the whole training step: what a backward's workspace frees, the next layer's tensors
reuse, and torch.cuda.max_memory_allocated counts it. Without torch (the C++ API) the workspaces come
from deltacp's own pool, which keeps its memory mapped between calls; DELTACP_WORKSPACE=pool in the
environment keeps that pool under torch too.

The calls are torch's documented torch.cuda.caching_allocator_alloc(size, device, stream) /
caching_allocator_delete(ptr), through the torch._C functions they wrap where torch has them (the same
allocation without the device context manager: the C++ caller runs on the device of the tensors). A
block is allocated and freed on the stream of the call (torch's current stream), so torch may hand it
to later work on that stream at once; bindings/src/workspace_api.cpp says how the GIL and an
out-of-memory are handled.
"""

from __future__ import annotations

import os

import torch

from . import _core


def install() -> bool:
    """Routes the CUDA workspaces to torch's caching allocator; False where it does not apply (a build
    without CUDA, a torch without CUDA, or DELTACP_WORKSPACE=pool)."""
    if not _core.built_with_cuda() or os.environ.get("DELTACP_WORKSPACE", "torch").lower() == "pool":
        return False
    raw_alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
    raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)
    if raw_alloc is None or raw_delete is None:  # a CPU-only torch has neither
        if not hasattr(torch.cuda, "caching_allocator_alloc") or not torch.backends.cuda.is_built():
            return False

        def raw_alloc(size, stream):
            return torch.cuda.caching_allocator_alloc(size, torch.cuda.current_device(), stream)

        raw_delete = torch.cuda.caching_allocator_delete
    _core.cuda_set_workspace_allocator(raw_alloc, raw_delete, torch.cuda.init)
    return True


def uninstall() -> None:
    """Back to deltacp's own pool for later workspaces (blocks handed out go back where they came from)."""
    _core.cuda_set_workspace_allocator(None, None, None)


INSTALLED = install()
