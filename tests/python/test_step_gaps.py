"""bench/gpu/step_gaps.py's analysis of a profiler trace, on a synthetic one: the GPU's busy time is the union
of its activities, every idle interval between them is a gap, and each gap names the launch that ended it and
the host operators around that launch."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[2]


def _step_gaps():
    spec = importlib.util.spec_from_file_location("step_gaps", REPO / "bench" / "gpu" / "step_gaps.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gaps_union_and_the_launch_behind_each_gap():
    sg = _step_gaps()

    def ev(cat, name, ts, dur, corr=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {} if corr is None else {"correlation": corr}}
    events = [
        ev("kernel", "a", 100, 50, 1), ev("kernel", "b", 120, 60, 2),  # overlapping: busy 100 .. 180
        ev("kernel", "c", 230, 20, 3),                                   # a 50 us gap before it
        ev("gpu_memcpy", "copy", 260, 10, 4),                            # a 10 us gap
        ev("cuda_runtime", "cudaLaunchKernel", 90, 5, 1), ev("cuda_runtime", "cudaLaunchKernel", 95, 5, 2),
        ev("cuda_runtime", "cudaLaunchKernel", 220, 5, 3), ev("cuda_runtime", "cudaMemcpyAsync", 200, 58, 4),
        ev("cpu_op", "deltacp::backward", 150, 100), ev("cpu_op", "aten::empty", 210, 20),
    ]
    summary, lines = sg.summarise(events, n=2, ngaps=4)
    assert summary["span_ms"] == pytest.approx(170 / 2 / 1e3)
    assert summary["busy_ms"] == pytest.approx((80 + 20 + 10) / 2 / 1e3)
    assert summary["idle_ms"] == pytest.approx(60 / 2 / 1e3)
    first, second = summary["gaps"]
    assert (first["us"], first["before"], first["after"]) == (50, "b", "c")
    assert "cudaLaunchKernel at +40 us" in first["where"]
    assert "deltacp::backward > aten::empty" in first["where"]
    assert (second["us"], second["after"]) == (10, "copy")
    assert summary["calls"]["cudaMemcpyAsync"] == {"count": 0.5, "us": 29.0}
    assert summary["host_ops"]["deltacp::backward"] == {"count": 0.5, "us": 50.0}
    assert any("longest gaps" in line for line in lines)
