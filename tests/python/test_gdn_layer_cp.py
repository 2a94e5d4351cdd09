"""A whole GDN layer under CP on 4 gloo processes as 2 CP groups x 2 data-parallel groups
(deltacp.examples.gdn_layer_cp): each CP group runs its own packed batch (different sequence
lengths), exchanging only within itself; every rank's output and dL/dx slices and the CP-summed,
DP-averaged weight gradients equal one process's in float64 (1e-10; measured ~1e-12)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _torchrun(nproc, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "deltacp.examples.gdn_layer_cp", *args]
    return subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)


def test_gdn_layer_two_cp_groups_by_two_dp_groups():
    res = _torchrun(4, "--cp", "2", "--dtype", "float64")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "4 ranks = 2 DP x 2 CP" in out, out
    rows = [line.split() for line in res.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4 and all(r[-1] == "ok" for r in rows), out
    # The two CP groups ran different batches (the first sequence is 7 tokens shorter in group 1).
    assert {r[1] for r in rows} == {"0", "1"}

