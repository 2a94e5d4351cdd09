"""The measured pages are generated, not written by hand: bench/gpu/make_docs.py run on docs/results/
reproduces docs/perf.md, docs/context-parallel.md and the README's table exactly. (After replacing a
results file, run `python3 bench/gpu/make_docs.py` and commit what it writes.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_docs_are_current(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    readme = tmp_path / "README.md"
    shutil.copy(REPO / "README.md", readme)
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "make_docs.py"), "--results",
                        str(REPO / "docs" / "results"), "--docs", str(docs), "--readme", str(readme)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("perf.md", "context-parallel.md"):
        assert (docs / name).read_text() == (REPO / "docs" / name).read_text(), \
            f"docs/{name} differs from what bench/gpu/make_docs.py generates"
    assert readme.read_text() == (REPO / "README.md").read_text(), "README's generated table is not current"


def test_results_carry_gpu_and_date():
    import json

    for path in sorted((REPO / "docs" / "results").glob("*.json")):
        data = json.loads(path.read_text())
        assert data.get("gpu") and data.get("date"), f"{path.name}: expected 'gpu' and 'date'"
