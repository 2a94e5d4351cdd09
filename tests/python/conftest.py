"""pytest configuration for the Python package tests: where the golden vectors live.

The golden vectors (tests/data/golden_*.npz, computed outside this project; tests/data/README.md gives
their provenance) are part of the repository: a missing file is a failure, never a skip.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # deltacp_testutil

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"


@pytest.fixture(scope="session")
def golden():
    """golden(name) -> dict of float64 arrays from tests/data/golden_<name>.npz (scale as a float)."""

    def load(name):
        path = DATA / f"golden_{name}.npz"
        if not path.exists():
            pytest.fail(f"golden vectors {path} not found (they are tracked in tests/data/)")
        with np.load(path) as z:
            data = {key: np.asarray(z[key], dtype=np.float64) for key in z.files}
        data["scale"] = float(data["scale"])
        return data

    return load
