"""deltacp — delta-rule linear attention: Eigen reference, CUDA tiers, context parallelism.

    import deltacp
    o, ht = deltacp.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)   # torch, autograd
    o, ht = deltacp.reference.gated_delta_rule(q, k, v, g, beta)                         # numpy, float64

``deltacp.reference`` needs only numpy. The torch ops (chunk_gated_delta_rule, chunk_kda,
chunk_delta_rule, chunk_dplr) import torch on first use, so the package imports without torch.
Errors: ``deltacp.DeltaCPError`` and its kinds (deltacp/errors.py), each also the builtin it stands for:
InvalidArgumentError (ValueError; ``deltacp.Error``), NumericError (ValueError: non-finite values, a log
decay g > 0; docs/errors.md), DTypeError (TypeError), OutOfMemoryError (MemoryError), CUDAError
(RuntimeError), CPTimeoutError (RuntimeError). Messages name the argument.
"""

from .errors import (CPTimeoutError, CUDAError, DeltaCPError, DTypeError, Error, InvalidArgumentError, NumericError,
                     OutOfMemoryError)
from . import _core
from . import reference

__version__ = "0.1.0"

_TORCH_OPS = ("chunk_gated_delta_rule", "chunk_kda", "chunk_delta_rule", "chunk_dplr", "chunk_dplr_delta_rule",
              "BACKENDS")
# FLA's DPLR entry points with FLA's argument order (deltacp.dplr), imported with torch on first use.
_DPLR_OPS = ("chunk_dplr_delta_rule", "chunk_rwkv7")

__all__ = ["reference", "Error", "DeltaCPError", "InvalidArgumentError", "NumericError", "DTypeError",
           "OutOfMemoryError", "CUDAError", "CPTimeoutError", "built_with_cuda", "cuda_available", "cuda_release_workspace",
           "cuda_workspace_stats", "cuda_reset_workspace_stats", "last_cuda_tier",
           *_TORCH_OPS, "chunk_rwkv7"]


def built_with_cuda() -> bool:
    """True when the CUDA tiers were compiled into this build."""
    return _core.built_with_cuda()


def cuda_available() -> bool:
    """True when the CUDA tiers are built and a CUDA device is usable."""
    return _core.cuda_available()


def last_cuda_tier() -> tuple:
    """(tier, why): the CUDA tier ("naive", "tiled" or "fused") that the last CUDA forward or backward of
    this thread ran, and why that one (with ``backend=None`` the dispatch picks per call the fastest tier
    whose kernels apply to the inputs)."""
    return _core.cuda_last_tier()


def cuda_release_workspace() -> None:
    """Hands deltacp's own cached CUDA workspace memory back to the driver.

    With the torch ops loaded, the kernels' workspaces come from torch's caching allocator (one pool for
    the whole training step; torch.cuda.empty_cache() is what returns its cache). Without torch, or with
    DELTACP_WORKSPACE=pool, they come from a per-device pool that keeps its memory mapped between calls
    (as torch's allocator does), because re-mapping ~1.5 GB per backward after every synchronisation
    cost more wall time than the kernels (cuda/common/workspace_pool.h); this hands that pool's unused
    memory back. No-op without CUDA."""
    _core.cuda_release_workspace()


def cuda_workspace_stats() -> dict:
    """The CUDA kernels' workspace bytes (ints), every device together:

    ``allocator``: where workspaces come from now, "torch" (torch's caching allocator, installed with the
    torch ops) or "pool" (deltacp's own); ``current_bytes`` / ``peak_bytes``: in use outside torch (from
    deltacp's pool) now and its high-water mark; ``reserved_bytes`` / ``peak_reserved_bytes``: what the pool
    keeps mapped (in use + cached) now and its high-water mark, the memory deltacp holds outside torch;
    ``torch_current_bytes`` / ``torch_peak_bytes``: workspaces taken through torch's allocator (already in
    torch.cuda.max_memory_allocated). A training step's peak is torch.cuda.max_memory_allocated() plus
    ``peak_reserved_bytes``. High-water marks count from the last cuda_reset_workspace_stats()."""
    return dict(_core.cuda_workspace_stats())


def cuda_reset_workspace_stats() -> None:
    """Restarts the high-water marks of cuda_workspace_stats() from the current values (as
    torch.cuda.reset_peak_memory_stats does for torch's)."""
    _core.cuda_reset_workspace_peaks()


def __getattr__(name):
    if name in _DPLR_OPS:
        from . import dplr

        return getattr(dplr, name)
    if name == "causal_conv1d":  # the short convolution, with torch on first use (deltacp/conv1d.py)
        from .conv1d import causal_conv1d

        return causal_conv1d
    # The torch ops live in deltacp.ops, imported (with torch) only when first asked for.
    if name in _TORCH_OPS:
        from . import ops

        return getattr(ops, name)
    raise AttributeError(f"module 'deltacp' has no attribute {name!r}")
