"""pytest configuration for the Python package tests: where the golden vectors live.

The golden vectors (shared/golden/*.npz, computed outside this project) are looked up in order:
  1. $DELTACP_GOLDEN_DIR
  2. <repo>/../shared/golden   (the layout of the project's workspace: Path(__file__).parents[3])
  3. <repo>/shared/golden
If none holds golden_*.npz the golden tests FAIL, unless DELTACP_ALLOW_NO_GOLDEN=1 (then they skip).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # deltacp_testutil

REPO = Path(__file__).resolve().parents[2]


def golden_dir():
    """(directory or None, the places looked at)."""
    env = os.environ.get("DELTACP_GOLDEN_DIR")
    candidates = ([Path(env)] if env else []) + [REPO.parent / "shared" / "golden", REPO / "shared" / "golden"]
    for c in candidates:
        if c.is_dir() and any(c.glob("golden_*.npz")):
            return c, candidates
    return None, candidates


@pytest.fixture(scope="session")
def golden():
    """golden(name) -> dict of float64 arrays from golden_<name>.npz (scale as a float)."""
    directory, looked = golden_dir()

    def load(name):
        path = None if directory is None else directory / f"golden_{name}.npz"
        if path is None or not path.exists():
            msg = f"golden vectors golden_{name}.npz not found (looked in {[str(p) for p in looked]})"
            if os.environ.get("DELTACP_ALLOW_NO_GOLDEN") == "1":
                pytest.skip(msg + "; DELTACP_ALLOW_NO_GOLDEN=1")
            pytest.fail(msg + "; set DELTACP_GOLDEN_DIR, or DELTACP_ALLOW_NO_GOLDEN=1 to skip")
        with np.load(path) as z:
            data = {key: np.asarray(z[key], dtype=np.float64) for key in z.files}
        data["scale"] = float(data["scale"])
        return data

    return load
