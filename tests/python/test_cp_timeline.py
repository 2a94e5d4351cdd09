"""bench/cp/cp_timeline.py on 2 gloo processes at tiny sizes (the chunked reference): it runs end to end, every
rank's table has the CP call's phases (deltacp.cp's own steps, which it wraps by name: a renamed step would drop
out of the table), forward and backward, each entered before it is left, in the order the op runs them; its
--json results file holds the same per rank and renders into docs/context-parallel.md's section."""

from __future__ import annotations

import os
import re
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
SCRIPT = REPO / "bench" / "cp" / "cp_timeline.py"
ROW = re.compile(r"^  (\S+)\s+([\d.]+)\s+([\d.]+)\s+-\s+-$")


def test_cp_timeline_two_ranks_gloo(tmp_path):
    pkg_root = str(Path(deltacp.__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
           "--device", "cpu", "--tokens", "64", "--heads", "2", "--head-dim", "16", "--repeat", "2", "--warmup", "1",
           "--variant", "gdn", "--backward", "--json", str(tmp_path / "cptimeline.json")]
    res = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=240)
    log = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, log
    tables = {}
    rank = None
    for line in res.stdout.splitlines():
        m = re.match(r"rank (\d), gdn fwd\+bwd deltacp CP: call ([\d.]+) ms", line)
        if m:
            rank = int(m.group(1))
            tables[rank] = []
            assert float(m.group(2)) > 0, line
            continue
        if line.startswith("rank "):
            rank = None
        m = ROW.match(line)
        if m and rank is not None:
            tables[rank].append((m.group(1), float(m.group(2)), float(m.group(3))))
    assert set(tables) == {0, 1}, log
    for r, rows in tables.items():
        names = [n for n, _, _ in rows]
        for phase in ("_start_check", "_prepass_forward", "_finish_check", "_all_gather", "_confirm",
                      "_prepass_backward", "_all_gather#2", "_confirm#2"):
            assert phase in names, (r, phase, names)
        assert names.index("_prepass_forward") < names.index("_all_gather") < names.index("_prepass_backward"), names
        assert all(h0 <= h1 for _, h0, h1 in rows), rows
    import json

    data = json.loads((tmp_path / "cptimeline.json").read_text())
    assert data["world"] == 2 and data["tokens_per_rank"] == 64 and list(data["sections"]) == ["gdn fwd+bwd"]
    ranks = data["sections"]["gdn fwd+bwd"]["ranks"]
    assert len(ranks) == 2
    for r, rank in enumerate(ranks):
        assert [n for n, _ in rank["cp"]["phases"]] == [n for n, _, _ in tables[r]]
        assert rank["cp"]["call_ms"] > 0 and rank["one_gpu"]["call_ms"] > 0
        assert all(t[2] is None and t[3] is None for _, t in rank["cp"]["phases"])  # no GPU columns on CPUs
    sys.path.insert(0, str(REPO / "bench" / "gpu"))
    try:
        import make_docs
    finally:
        sys.path.pop(0)
    data["_file"] = "cptimeline.json"
    page = "\n".join(make_docs.cptimeline_md({"cptimeline": [data]}))
    assert "### gdn fwd+bwd" in page and "| _all_gather#2 |" in page, page
