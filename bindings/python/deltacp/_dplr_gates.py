"""deltacp._dplr_gates — the DPLR gates the chunk form takes, in one place for the single-device op
(deltacp.dplr, whose module doc says why the range exists) and the context-parallel op (deltacp.cp, which
picks each rank's tier from it).

    GK_MIN = -GK_SPAN / chunk_size <= gk <= 0     the chunked methods (the chunked reference, the tiled
                                                   CUDA tier); outside it the token recurrence (the recurrent
                                                   reference, the naive CUDA tier)
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

# Largest |cumulative gate| inside one chunk the chunk form takes: GK_MIN = -GK_SPAN / chunk_size.
GK_SPAN = 1024.0
DEFAULT_CHUNK = 64


def gate_range(chunk_size: int = DEFAULT_CHUNK) -> Tuple[float, float]:
    """(GK_MIN, 0.0): the gates the chunked methods take at this chunk size."""
    return (-GK_SPAN / float(chunk_size), 0.0)


def gates_in_range(gk: torch.Tensor, chunk_size: int) -> bool:
    """True when every gate lies in gate_range(chunk_size) (one reduction; a sync on CUDA)."""
    if gk.numel() == 0:
        return True
    lo, hi = torch.aminmax(gk.detach())
    gk_min, _ = gate_range(chunk_size)
    lo, hi = float(lo), float(hi)
    return math.isfinite(lo) and math.isfinite(hi) and lo >= gk_min and hi <= 0.0
