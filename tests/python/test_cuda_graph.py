"""CUDA graphs: the CUDA forward captured with torch.cuda.graph and replayed after the inputs' contents were
replaced in place (copy_) gives what an eager call on those contents gives, bit for bit (the same kernels on
the same tables): the fused tier over whole sequences and in pieces, the tiled tier with its state scan whole
and in pieces, kda on the fused and tiled tiers, the default dispatch, with and without the in-kernel l2 norm, always
with an initial and a final state; varlen calls that pass cu_seqlens_cpu; both workspace allocators (torch's,
deltacp's pool). The calls that cannot be captured (a varlen call without a host copy of the offsets,
DELTACP_CHECK=1, safe_gate's range check) raise an error naming the argument and leave the device usable.
Skipped without a CUDA device; the fused cases skip on a GPU that is not compute capability 9.0."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import deltacp  # noqa: E402
from deltacp import _workspace  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

K = V = 128


def _need_cuda_build():
    if not deltacp.built_with_cuda():
        if os.environ.get("DELTACP_ALLOW_NO_CUDA_BUILD") == "1":
            pytest.skip("deltacp built without CUDA (DELTACP_ALLOW_NO_CUDA_BUILD=1)")
        pytest.fail("a CUDA device is present but deltacp was built without the CUDA tiers (nvcc not found?)")


def _need_fused():
    _need_cuda_build()
    if not deltacp._core.cuda_supports("gdn", "fused", False):
        pytest.fail("a CUDA device is present but this build has no fused tier")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused kernels run on compute capability 9.0 (H100 / H200)")


def _inputs(variant, B, T, H, HV, N, l2, seed):
    """bf16 q, k, v, beta; float32 log decay g (per key dim for kda) and initial state. Without the in-kernel
    l2 norm q and k are unit rows already (the delta rule's stable regime); with it they are raw."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32)

    q, k = randn(B, T, H, K), randn(B, T, H, K)
    if not l2:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = F.logsigmoid(randn(*((B, T, HV) if variant == "gdn" else (B, T, HV, K))))
    beta = torch.rand(B, T, HV, generator=gen, device="cuda")
    return {"q": q.bfloat16(), "k": k.bfloat16(), "v": randn(B, T, HV, V).bfloat16(), "g": g,
            "beta": beta.bfloat16(), "h0": 0.1 * randn(N, HV, K, V)}


def _forward(variant, x, backend, l2, cu=None, cu_cpu=None):
    op = deltacp.chunk_gated_delta_rule if variant == "gdn" else deltacp.chunk_kda
    with torch.no_grad():
        return op(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                  use_qk_l2norm_in_kernel=l2, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, backend=backend)


def _capture(fn):
    """(graph, outputs) of fn captured with torch.cuda.graph, after the warm-up call on a side stream that
    torch's documentation asks for."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _check_replays_like_eager(variant, shape, backend, l2, cu=None):
    """Captures one forward, then twice: new contents into the captured inputs, NaN into its outputs, replay,
    and compare with an eager call on separate tensors holding the same contents. The two replays must
    differ (each computed on its own inputs)."""
    B, T, H, HV = shape
    N = B if cu is None else len(cu) - 1
    cu_gpu = None if cu is None else torch.tensor(cu, dtype=torch.int64, device="cuda")
    cu_cpu = None if cu is None else cu_gpu.cpu()
    static = _inputs(variant, B, T, H, HV, N, l2, seed=0)
    graph, out = _capture(lambda: _forward(variant, static, backend, l2, cu_gpu, cu_cpu))
    captured_tier = deltacp.last_cuda_tier()[0]
    replayed = []
    for seed in (1, 2):
        fresh = _inputs(variant, B, T, H, HV, N, l2, seed=seed)
        for name, t in static.items():
            t.copy_(fresh[name])
        for t in out:
            t.fill_(float("nan"))
        graph.replay()
        got = [t.clone() for t in out]
        want = _forward(variant, fresh, backend, l2, cu_gpu, cu_cpu)
        torch.cuda.synchronize()
        assert deltacp.last_cuda_tier()[0] == captured_tier
        for name, a, b in zip(("o", "final_state"), got, want):
            assert torch.isfinite(b).all(), name
            assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())
        replayed.append(got)
    assert not torch.equal(replayed[0][0], replayed[1][0])
    assert not torch.equal(replayed[0][1], replayed[1][1])
    del graph
    return captured_tier


# (B, T, H, HV): grouped values over two sequences; one sequence long enough to be cut into pieces.
SHAPE = (2, 300, 2, 4)
LONG = (1, 1000, 1, 2)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
@pytest.mark.parametrize("l2", [False, True], ids=["plain", "l2norm"])
@pytest.mark.parametrize("piece", [0, 128], ids=["whole", "pieces"])
def test_fused_forward_replays_in_cuda_graph(variant, l2, piece, monkeypatch):
    """The fused tier (gdn and kda), whole sequences and cut into pieces of 128 tokens (pass 1's maps, the
    fold's table of map pointers into the graph's workspace, the pieces' chunk table)."""
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_PIECE", str(piece))
    assert _check_replays_like_eager(variant, LONG if piece else SHAPE, "fused", l2) == "fused"


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_fused_forward_in_windows_replays_in_cuda_graph(varlen, monkeypatch):
    """The fused tier in windows along time (DELTACP_FUSED_WINDOW=128 tokens): a captured call runs its
    windows in order on the capturing stream (the overlapped windows use a second stream of their own), so
    the replays equal eager calls, which overlap their windows, bit for bit."""
    _need_fused()
    monkeypatch.setenv("DELTACP_FUSED_PIECE", "0")
    monkeypatch.setenv("DELTACP_FUSED_WINDOW", "128")
    monkeypatch.delenv("DELTACP_FUSED_OVERLAP", raising=False)
    if varlen:
        assert _check_replays_like_eager("gdn", (1, VARLEN[-1], 2, 2), "fused", True, cu=VARLEN) == "fused"
    else:
        assert _check_replays_like_eager("gdn", SHAPE, "fused", True) == "fused"


@pytest.mark.parametrize("variant", ["gdn", "kda"])
@pytest.mark.parametrize("l2", [False, True], ids=["plain", "l2norm"])
@pytest.mark.parametrize("piece", [0, 128], ids=["whole", "pieces"])
def test_tiled_forward_replays_in_cuda_graph(variant, l2, piece, monkeypatch):
    """The tiled tier (gdn and kda), its state scan whole and in pieces (DELTACP_TILED_SCAN_PIECE)."""
    _need_cuda_build()
    monkeypatch.setenv("DELTACP_TILED_SCAN_PIECE", str(piece))
    assert _check_replays_like_eager(variant, LONG if piece else SHAPE, "tiled", l2) == "tiled"


@pytest.mark.parametrize("l2", [False, True], ids=["plain", "l2norm"])
def test_default_cuda_forward_replays_in_cuda_graph(l2):
    """No backend: the tier the dispatch picks (fused on Hopper, else tiled), at the default piece plan."""
    _need_cuda_build()
    tier = _check_replays_like_eager("gdn", SHAPE, None, l2)
    assert tier == ("fused" if torch.cuda.get_device_capability() == (9, 0) else "tiled")


VARLEN = [0, 100, 300, 301, 301, 700, 1000]  # a 1-token and an empty sequence; pieces across boundaries


@pytest.mark.parametrize("backend", ["fused", "tiled"])
@pytest.mark.parametrize("piece", [0, 128], ids=["whole", "pieces"])
def test_varlen_forward_replays_in_cuda_graph_with_cu_seqlens_cpu(backend, piece, monkeypatch):
    """Packed sequences with cu_seqlens on the GPU and its host copy as cu_seqlens_cpu: nothing to copy
    between host and device while capturing; the replays run the captured sequence boundaries."""
    if backend == "fused":
        _need_fused()
    else:
        _need_cuda_build()
    monkeypatch.setenv("DELTACP_FUSED_PIECE", str(piece))
    monkeypatch.setenv("DELTACP_TILED_SCAN_PIECE", str(piece))
    assert _check_replays_like_eager("gdn", (1, VARLEN[-1], 2, 2), backend, True, cu=VARLEN) == backend


@pytest.mark.parametrize("backend", ["fused", "tiled"])
def test_forward_replays_in_cuda_graph_with_deltacp_workspace_pool(backend, monkeypatch):
    """Workspaces from deltacp's own pool (DELTACP_WORKSPACE=pool) instead of torch's allocator: under
    capture they become the graph's allocation and free nodes."""
    if backend == "fused":
        _need_fused()
    else:
        _need_cuda_build()
    monkeypatch.setenv("DELTACP_FUSED_PIECE", "128")
    monkeypatch.setenv("DELTACP_TILED_SCAN_PIECE", "128")
    try:
        _workspace.uninstall()
        assert deltacp.cuda_workspace_stats()["allocator"] == "pool"
        assert _check_replays_like_eager("gdn", LONG, backend, False) == backend
    finally:
        _workspace.install()  # as the package left it
        deltacp.cuda_release_workspace()


def _refused_in_capture(call, match):
    """call() inside torch.cuda.graph raises deltacp's InvalidArgumentError matching `match`, before anything
    that would break the capture; the device stays usable."""
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(deltacp.InvalidArgumentError, match=match):
        with torch.cuda.graph(graph):
            call()
    del graph
    torch.cuda.synchronize()


def _varlen_inputs():
    cu = torch.tensor(VARLEN, dtype=torch.int64, device="cuda")
    return _inputs("gdn", 1, VARLEN[-1], 2, 2, len(VARLEN) - 1, False, seed=3), cu


def test_varlen_cuda_graph_capture_without_cu_seqlens_cpu_raises_naming_it():
    _need_cuda_build()
    x, cu = _varlen_inputs()
    _refused_in_capture(lambda: _forward("gdn", x, None, False, cu), "'cu_seqlens_cpu'")
    o, ht = _forward("gdn", x, None, False, cu)  # eager, the host copy made inside: still fine
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()


def test_varlen_cuda_graph_capture_with_host_offsets_only_raises_naming_them():
    """cu_seqlens on the CPU (its copy to the GPU synchronises), or cu_seqlens_cpu on the GPU."""
    _need_cuda_build()
    x, cu = _varlen_inputs()
    host = cu.cpu()
    _refused_in_capture(lambda: _forward("gdn", x, None, False, host, host), "'cu_seqlens'")
    _refused_in_capture(lambda: _forward("gdn", x, None, False, cu, cu), "'cu_seqlens_cpu'")


def test_numeric_checks_refuse_cuda_graph_capture(monkeypatch):
    """DELTACP_CHECK=1 reads results back and synchronises: refused by name inside a capture."""
    _need_cuda_build()
    x = _inputs("gdn", *SHAPE, SHAPE[0], False, seed=4)
    monkeypatch.setenv("DELTACP_CHECK", "1")
    _refused_in_capture(lambda: _forward("gdn", x, "tiled", False), "DELTACP_CHECK")
    monkeypatch.setenv("DELTACP_CHECK", "0")
    _check_replays_like_eager("gdn", SHAPE, "tiled", False)


def test_safe_gate_range_check_refuses_cuda_graph_capture():
    """safe_gate=True with a precomputed g checks its range on the host: refused by name inside a capture."""
    _need_cuda_build()
    x = _inputs("kda", *SHAPE, SHAPE[0], False, seed=5)
    x["g"] = x["g"].clamp(min=-5.0)

    def call():
        with torch.no_grad():
            return deltacp.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], safe_gate=True, backend="tiled")

    _refused_in_capture(call, "'safe_gate'")
