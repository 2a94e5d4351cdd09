"""bench/cp/bench_cp_step.py on 2 gloo processes at tiny sizes (the chunked reference; FLA's side skipped on
CPUs): the script runs end to end and its JSON carries what bench/gpu/make_docs.py reads, for gdn and kda: finite
positive step times of deltacp's CP and one-device runs, their efficiencies, the exchange's parts, and the CP
results equal to one process over the whole sequence."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import deltacp  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "cp" / "bench_cp_step.py"


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_cp_step_two_ranks_gloo(tmp_path):
    out = tmp_path / "bench_cp_step.json"
    # The workers import the same deltacp as this test, wherever it was found.
    pkg_root = str(Path(deltacp.__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
           "--device", "cpu", "--tokens", "64", "--heads", "2", "--head-dim", "16", "--repeat", "2", "--warmup", "1",
           "--json", str(out)]
    res = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=240)
    log = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, log
    data = json.loads(out.read_text())
    assert data["kind"] == "cp_step" and data["world"] == 2 and data["gpu"] and data["date"], data
    assert data["fla"]["available"] is False and data["fla"]["reason"], data["fla"]
    assert set(data["variants"]) == {"gdn", "kda"}, log
    for variant, r in data["variants"].items():
        assert "failed" not in r, (variant, r.get("failed"))
        for impl in ("deltacp_cp", "deltacp_one_gpu"):
            for d in ("fwd", "fwd+bwd"):
                assert _finite_positive(r["ms"].get(f"{impl}_{d}")), (variant, impl, d, r["ms"])
        for d in ("fwd", "fwd+bwd"):
            assert _finite_positive(r["efficiency"].get(f"deltacp_{d}")), (variant, r["efficiency"])
        ex = r["exchange"]
        assert "error" not in ex, (variant, ex)
        for key in ("prepass_ms", "allgather_merge_ms", "local_forward_ms", "exchange_ms",
                    "exchange_fraction_of_local_fwd"):
            assert _finite_positive(ex.get(key)), (variant, key, ex)
        errs = r["errors"]["deltacp_cp_vs_whole_sequence"]
        assert set(errs) == {"o", "dq", "dk", "dv", "dg", "dbeta"}, errs
        assert all(math.isfinite(e) and e < 1e-2 for e in errs.values()), (variant, errs)
        assert r["exchange_bytes_per_rank"]["forward"] > 0, r["exchange_bytes_per_rank"]
