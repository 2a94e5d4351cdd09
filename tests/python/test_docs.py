"""The measured pages are generated, not written by hand: bench/gpu/make_docs.py run on docs/results/
reproduces docs/perf.md, docs/context-parallel.md and the README's table exactly. (After replacing a
results file, run `python3 bench/gpu/make_docs.py` and commit what it writes.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def _stages_to_json(tmp_path, log, *args):
    """Runs bench/gpu/stages_to_json.py with args on log into a fresh results file (a GPU and date, no rows); returns
    that file's path once the script has succeeded."""
    import json

    results = tmp_path / "perf.json"
    results.write_text(json.dumps({"gpu": "G", "date": "D", "rows": []}))
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "stages_to_json.py"), str(results), str(log),
                        *args, "--date", "2026-11-27"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return results


def test_stages_to_json_takes_the_named_variants_blocks(tmp_path):
    """bench/gpu/stages_to_json.py: from a stages.log holding gdn and kda blocks (with and without setting prefixes),
    --variant kda --setting S keeps the kda block of S alone, its kernels under their labels (the unlabelled ones
    summed into "the rest"), as the section stages_backward_kda beside what the results file had."""
    import json

    log = tmp_path / "stages.log"
    log.write_text("\n".join([
        "gdn fused fwd+bwd (2, 16384, 16, 128): 3.900 ms of kernels per call, 4.100 ms elapsed",
        "     1.000 ms  void deltacp::cuda::tiled::bwd::bwd_local_wgmma_kernel<__nv_bfloat16>",
        "[S=1] kda fused fwd+bwd (2, 16384, 16, 128): 7.000 ms of kernels per call, 7.500 ms elapsed",
        "[S=1]      1.250 ms  void deltacp::cuda::tiled::bwd::bwd_local_kda_wgmma_kernel<__nv_bfloat16>",
        "[S=1]      1.700 ms  void deltacp::cuda::tiled::bwd::bwd_decay_kda_tc_kernel<__nv_bfloat16, 128>",
        "[S=1]      0.040 ms  void at::native::vectorized_elementwise_kernel<8>",
        "[S=1]      0.010 ms  Memcpy HtoD (Pageable -> Device)",
        "[S=1] gdn fused fwd+bwd (1, 8192, 96, 128): 4.500 ms of kernels per call, 4.700 ms elapsed",
        "[S=1]      1.600 ms  void deltacp::cuda::tiled::bwd::bwd_local_wgmma_kernel<__nv_bfloat16>",
        "[S=0] kda fused fwd+bwd (2, 16384, 16, 128): 9.000 ms of kernels per call, 9.400 ms elapsed",
        "[S=0]      1.400 ms  void deltacp::cuda::tiled::bwd::bwd_dqkg_kernel<__nv_bfloat16, 128>",
    ]) + "\n")
    results = _stages_to_json(tmp_path, log, "--variant", "kda", "--setting", "S=1")
    data = json.loads(results.read_text())
    assert data["gpu"] == "G" and "stages_backward_gdn" not in data
    section = data["stages_backward_kda"]
    assert section["variant"] == "kda" and list(section["shapes"]) == ["2,16384,16,128"]
    shape = section["shapes"]["2,16384,16,128"]
    assert shape["total_ms"] == 7.0 and shape["elapsed_ms"] == 7.5
    assert shape["kernels_ms"] == {"bwd_local_kda_wgmma (B2-B3)": 1.25, "bwd_decay (B4)": 1.7, "the rest": 0.05}


def test_stages_to_json_names_dplr_kernels_and_its_backend(tmp_path):
    """A DPLR block (stage_times.py --backend tiled): its chunk-local kernel under its own label, not gdn's, whose
    kernel name it contains; the section records the tiled forward that ran."""
    import json

    log = tmp_path / "stages.log"
    log.write_text("\n".join([
        "dplr tiled fwd+bwd (4, 4096, 32, 64): 3.812 ms of kernels per call, 4.130 ms elapsed",
        "     1.173 ms  void deltacp::cuda::tiled::(anonymous namespace)::dplr_bwd_local_wgmma",
        "     1.122 ms  void deltacp::cuda::tiled::(anonymous namespace)::dplr_wy_kernel<__nv_",
        "     0.251 ms  void deltacp::cuda::tiled::(anonymous namespace)::dplr_dh0_scan_kernel",
        "     0.487 ms  void deltacp::cuda::tiled::(anonymous namespace)::dplr_scan_kernel<__n",
    ]) + "\n")
    results = _stages_to_json(tmp_path, log, "--variant", "dplr")
    section = json.loads(results.read_text())["stages_backward_dplr"]
    assert section["backend"] == "tiled forward and backward" and "--backend tiled" in section["source"]
    assert section["shapes"]["4,4096,32,64"]["kernels_ms"] == {
        "dplr_bwd_local_wgmma (5-6)": 1.173, "dplr_wy (1, both)": 1.122, "dplr_scan (2, both)": 0.487,
        "dplr_dh0_scan (4)": 0.251}


def test_ratios_only_against_fla_of_the_same_run():
    """A row kept from an earlier run (its own date) is shown, but divided only by FLA's row of that run: beside
    FLA's row of the latest run its ratio is '-' and it enters no README range."""
    sys.path.insert(0, str(REPO / "bench" / "gpu"))
    try:
        import make_docs
    finally:
        sys.path.pop(0)

    def row(impl, ms, **kw):
        return dict(variant="gdn", impl=impl, B=1, T=64, H=1, D=128, direction="fwd", ms=ms, **kw)

    perf = {"gpu": "G", "date": "2026-11-28",
            "rows": [row("fla", 2.0), row("deltacp-tiled", 1.0), row("deltacp-naive", 8.0, date="2026-11-27")]}
    assert make_docs.ratios(perf, "gdn", "fwd", "deltacp-tiled") == {(1, 64, 1, 128): 2.0}  # FLA's time / its
    assert make_docs.ratios(perf, "gdn", "fwd", "deltacp-naive") == {}
    perf["rows"].append(row("fla", 4.0, date="2026-11-27"))  # that run's FLA row: the naive row's ratio is back
    perf["rows"] = [r for r in perf["rows"] if r["impl"] != "deltacp-tiled" and r.get("date")]
    assert make_docs.ratios(perf, "gdn", "fwd", "deltacp-naive") == {(1, 64, 1, 128): 0.5}


def test_chain_profile_tells_the_map_mode_by_its_template_argument():
    """bench_gpu.py splits the fused chain's kernel time into the chain and the pieces' maps by fused_chain_kernel's
    third template argument (kMap), whatever the arguments after it (the T Beta form's trailing `true`)."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "bench" / "gpu"))
    try:
        import bench_gpu
    finally:
        sys.path.pop(0)
    name = "void deltacp::cuda::fused::fused_chain_kernel<__nv_bfloat16, {}>(ChainArgs<__nv_bfloat16>)"
    assert bench_gpu.is_map_mode(name.format("2, true, 3, false, 128"))
    assert not bench_gpu.is_map_mode(name.format("1, false, 3, false, 128, true"))
    assert not bench_gpu.is_map_mode(name.format("2, false, 2, true, 64"))
    assert not bench_gpu.is_map_mode("void deltacp::cuda::fused::fused_one_kernel<__nv_bfloat16>(x)")
