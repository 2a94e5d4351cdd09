"""Every bad input raises the documented error naming the argument: ValueError (deltacp.Error, the C++
core's deltacp.InvalidArgumentError, is one) for shapes, layouts, values and devices; TypeError for dtypes
and non-tensors; the package's exception classes (deltacp/errors.py)."""

from __future__ import annotations

import numpy as np
import pytest

import deltacp
import deltacp.reference as ref
from deltacp_testutil import make_problem


def _gdn(**over):
    p = make_problem("gdn", B=2, T=20, H=2, K=4, V=3, seed=30)
    args = dict(q=p["q"], k=p["k"], v=p["v"], g=p["g"], beta=p["beta"], initial_state=p["initial_state"])
    args.update(over)
    return args


def _fwd(**over):
    a = _gdn(**over)
    return ref.gated_delta_rule(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"), **a)


def _bwd(do=None, **over):
    a = _gdn(**over)
    do = np.ones((2, 20, 2, 3)) if do is None else do
    return ref.gated_delta_rule_backward(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"), do, **a)


P = make_problem("gdn", B=2, T=20, H=2, K=4, V=3, seed=30)
PACKED = make_problem("gdn", cu_seqlens=[0, 7, 20], H=2, K=4, V=3, seed=31)

# (description, call, exception, regex the message must match)
NUMPY_CASES = [
    ("q rank", lambda: _fwd(q=P["q"][0]), ValueError, r"'q'.*4 dims"),
    ("k shape", lambda: _fwd(k=P["k"][:, :19]), ValueError, r"'k'.*expected shape \[B, T, H, K\]"),
    ("v batch", lambda: _fwd(v=P["v"][:1]), ValueError, r"'v'"),
    ("g shape (kda-shaped for gdn)", lambda: _fwd(g=np.zeros((2, 20, 2, 4))), ValueError, r"'g'.*\[B, T, HV\]"),
    ("beta shape", lambda: _fwd(beta=P["beta"][..., :1]), ValueError, r"'beta'"),
    ("HV not a multiple of H", lambda: _fwd(v=np.zeros((2, 20, 3, 3)), g=np.zeros((2, 20, 3)),
                                           beta=np.zeros((2, 20, 3)), initial_state=None), ValueError, r"'HV'"),
    ("complex dtype", lambda: _fwd(q=P["q"].astype(np.complex128)), TypeError, r"'q'.*float64 or float32"),
    ("float16 numpy", lambda: _fwd(k=P["k"].astype(np.float16)), TypeError, r"'k'"),
    ("not an array", lambda: _fwd(v=object()), TypeError, r"'v'"),
    ("last dim not contiguous", lambda: _fwd(q=np.repeat(P["q"], 2, axis=-1)[..., ::2]), ValueError,
     r"'q'.*contiguous in its last dimension"),
    ("initial_state shape", lambda: _fwd(initial_state=np.zeros((1, 2, 4, 3))), ValueError,
     r"'initial_state'.*\[N, HV, K, V\]"),
    ("NaN input", lambda: _fwd(g=np.where(np.arange(20)[None, :, None] == 5, np.nan, P["g"])), ValueError,
     r"'g'.*finite"),
    ("NaN initial state", lambda: _fwd(initial_state=np.full((2, 2, 4, 3), np.inf)), ValueError,
     r"'initial_state'.*finite"),
    ("chunk_size 48", lambda: _fwd(chunk_size=48), ValueError, r"'chunk_size'"),
    ("chunk_size 0", lambda: _fwd(chunk_size=0), ValueError, r"'chunk_size'"),
    ("chunk_size str", lambda: _fwd(chunk_size="64"), TypeError, r"'chunk_size'"),
    ("method", lambda: _fwd(method="magic"), ValueError, r"'method'"),
    ("scale type", lambda: _fwd(scale="big"), TypeError, r"'scale'"),
    ("scale NaN", lambda: _fwd(scale=float("nan")), ValueError, r"'scale'"),
    ("cu_seqlens with B > 1", lambda: _fwd(cu_seqlens=[0, 10, 20], initial_state=None), ValueError,
     r"'cu_seqlens'.*B == 1"),
    ("do shape", lambda: _bwd(do=np.ones((2, 20, 2, 4))), ValueError, r"'do'"),
    ("dht shape", lambda: _bwd(dht=np.ones((2, 2, 3, 4))), ValueError, r"'dht'"),
    ("do missing", lambda: ref.gated_delta_rule_backward(P["q"], P["k"], P["v"], P["g"], P["beta"], None),
     ValueError, r"'do'"),
]


def _packed(cu, **kw):
    p = PACKED
    return ref.gated_delta_rule(p["q"], p["k"], p["v"], p["g"], p["beta"], cu_seqlens=cu, **kw)


CU_CASES = [
    ("cu_seqlens start", lambda: _packed([1, 7, 20]), ValueError, r"'cu_seqlens'.*cu_seqlens\[0\] == 0"),
    ("cu_seqlens decreasing", lambda: _packed([0, 9, 7, 20]), ValueError, r"'cu_seqlens'.*non-decreasing"),
    ("cu_seqlens end", lambda: _packed([0, 7, 19]), ValueError, r"'cu_seqlens'.*T = 20"),
    ("cu_seqlens float", lambda: _packed(np.array([0.0, 7.0, 20.0])), TypeError, r"'cu_seqlens'"),
    ("cu_seqlens 2-D", lambda: _packed(np.array([[0, 7, 20]])), ValueError, r"'cu_seqlens'"),
    ("initial_state count", lambda: _packed([0, 7, 20], initial_state=np.zeros((1, 2, 4, 3))), ValueError,
     r"'initial_state'"),
]


def _cp(cuts, **kw):
    p = PACKED
    return ref.cp_simulate("gdn", p["q"], p["k"], p["v"], p["g"], p["beta"], cuts=cuts, cu_seqlens=p["cu_seqlens"],
                           chunk_size=16, **kw)


CP_CASES = [
    ("cuts not increasing", lambda: _cp([9, 5]), ValueError, r"'cuts'.*increasing"),
    ("cut at 0", lambda: _cp([0]), ValueError, r"'cuts'"),
    ("cut at T", lambda: _cp([20]), ValueError, r"'cuts'"),
    ("cuts type", lambda: _cp("5"), TypeError, r"'cuts'"),
    ("cuts float", lambda: _cp([5.5]), TypeError, r"'cuts'"),
    ("cp with B > 1", lambda: ref.cp_simulate("gdn", P["q"], P["k"], P["v"], P["g"], P["beta"], cuts=[5],
                                              cu_seqlens=None, chunk_size=16), ValueError, r"'(B|cu_seqlens)'"),
    ("cp backward without do", lambda: _cp([5], backward=True), ValueError, r"'do'"),
    ("cp variant", lambda: ref.cp_simulate("mamba", P["q"], P["k"], P["v"], cuts=[5]), ValueError, r"'variant'"),
]

_H = {"q": P["q"][0, :, 0], "k": P["k"][0, :, 0], "v": P["v"][0, :, 0], "g": P["g"][0, :, 0],
      "beta": P["beta"][0, :, 0]}

HEAD_CASES = [
    ("head variant", lambda: ref.chunk_wy("rwkv", **_H), ValueError, r"'variant'"),
    ("head k rows", lambda: ref.chunk_wy("gdn", **dict(_H, k=_H["k"][:5])), ValueError, r"'k'"),
    ("head gdn g shape", lambda: ref.chunk_wy("gdn", **dict(_H, g=np.zeros((20, 4)))), ValueError, r"'g'"),
    ("head kda g shape", lambda: ref.chunk_wy("kda", **_H), ValueError, r"'g'"),
    ("head delta with g", lambda: ref.chunk_wy("delta", **_H), ValueError, r"'g'"),
    ("head dplr without a", lambda: ref.chunk_wy("dplr", _H["q"], _H["k"], _H["v"], gk=np.zeros((20, 4))),
     ValueError, r"'a'"),
    ("head beta missing", lambda: ref.chunk_wy("gdn", _H["q"], _H["k"], _H["v"], g=_H["g"]), ValueError, r"'beta'"),
    ("head state shape", lambda: ref.recurrent_forward("gdn", **_H, initial_state=np.zeros((3, 4))), ValueError,
     r"'initial_state'"),
    ("head span", lambda: ref.span_affine("gdn", **_H, t0=5, t1=30, chunk_size=16), ValueError, r"'t0, t1'"),
    ("head do shape", lambda: ref.recurrent_backward("gdn", **_H, do=np.zeros((20, 4))), ValueError, r"'do'"),
    ("compose shapes", lambda: ref.compose((np.eye(3), np.zeros((3, 2))), (np.eye(4), np.zeros((4, 2)))),
     ValueError, r"'M2'"),
    ("cp_plan both", lambda: ref.cp_plan([0, 10], cuts=[5], world=2), ValueError, r"'cuts'"),
    ("cp_plan uneven", lambda: ref.cp_plan([0, 10], world=3), ValueError, r"'cu_seqlens'.*divisible"),
]


@pytest.mark.parametrize("label,call,exc,pattern", NUMPY_CASES + CU_CASES + CP_CASES + HEAD_CASES,
                         ids=[c[0] for c in NUMPY_CASES + CU_CASES + CP_CASES + HEAD_CASES])
def test_numpy_bad_input(label, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_value_errors_are_deltacp_errors():
    with pytest.raises(deltacp.Error):
        _fwd(chunk_size=48)


def test_exception_classes():
    """The package's exceptions: one base, each kind also the builtin it stands for (deltacp/errors.py)."""
    assert deltacp.Error is deltacp.InvalidArgumentError
    assert deltacp._core.Error is deltacp.InvalidArgumentError
    for cls, builtin in ((deltacp.InvalidArgumentError, ValueError), (deltacp.NumericError, ValueError),
                         (deltacp.DTypeError, TypeError), (deltacp.OutOfMemoryError, MemoryError),
                         (deltacp.CUDAError, RuntimeError), (deltacp.CPTimeoutError, RuntimeError)):
        assert issubclass(cls, deltacp.DeltaCPError) and issubclass(cls, builtin), cls
    assert issubclass(deltacp.NumericError, deltacp.InvalidArgumentError)
    e = deltacp.OutOfMemoryError("deltacp: argument 'cuda': out of device memory")
    assert e.argument == "cuda" and deltacp.DeltaCPError("no argument here").argument == ""


def test_core_errors_carry_the_argument():
    """An error of the C++ core arrives as the package's class with .argument set, and its message holds
    no path of the machine that built the module."""
    with pytest.raises(deltacp.InvalidArgumentError) as info:
        _fwd(chunk_size=48)
    assert info.value.argument == "chunk_size"
    assert type(info.value) is deltacp.InvalidArgumentError
    with pytest.raises(deltacp.NumericError) as info:
        _fwd(q=np.where(np.arange(20)[None, :, None, None] == 3, np.nan, P["q"]))
    assert info.value.argument == "q" and "/" not in str(info.value).split("argument")[0]


def test_cp_timeout_error_is_the_package_class():
    cp_context = pytest.importorskip("deltacp.cp.context")
    assert cp_context.CPTimeoutError is deltacp.CPTimeoutError


# --------------------------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")


def _t(**over):
    t = {name: torch.tensor(P[name]) for name in ("q", "k", "v", "g", "beta")}
    t.update(over)
    return t


def _op(**over):
    kw = {key: over.pop(key) for key in list(over) if key not in ("q", "k", "v", "g", "beta")}
    t = _t(**over)
    return deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], **kw)


TORCH_CASES = [
    ("not a tensor", lambda: _op(q=P["q"]), TypeError, r"'q'.*torch.Tensor"),
    ("integer q", lambda: _op(q=torch.zeros((2, 20, 2, 4), dtype=torch.int64)), TypeError, r"'q'"),
    ("k dtype", lambda: _op(k=torch.tensor(P["k"], dtype=torch.float32)), TypeError, r"'k'.*like q"),
    ("g dtype", lambda: _op(g=torch.tensor(P["g"], dtype=torch.float16)), TypeError, r"'g'.*or torch.float32"),
    ("q rank", lambda: _op(q=torch.zeros((20, 2, 4), dtype=torch.float64)), ValueError, r"'q'.*4 dims"),
    ("g shape", lambda: _op(g=torch.zeros((2, 20, 2, 4), dtype=torch.float64)), ValueError, r"'g'"),
    ("last dim not contiguous", lambda: _op(v=torch.zeros((2, 20, 2, 6), dtype=torch.float64)[..., ::2]),
     ValueError, r"'v'.*contiguous in its last dimension"),
    ("initial_state shape", lambda: _op(initial_state=torch.zeros((3, 2, 4, 3))), ValueError, r"'initial_state'"),
    ("initial_state type", lambda: _op(initial_state=np.zeros((2, 2, 4, 3))), TypeError, r"'initial_state'"),
    ("unknown backend", lambda: _op(backend="triton"), ValueError, r"'backend'"),
    ("CUDA tier on CPU tensors", lambda: _op(backend="tiled"), ValueError, r"'backend'.*CUDA"),
    ("cu_seqlens dtype", lambda: _op(cu_seqlens=torch.tensor([0.0, 40.0])), TypeError, r"'cu_seqlens'"),
    ("cu_seqlens with B > 1", lambda: _op(cu_seqlens=torch.tensor([0, 20])), ValueError, r"'cu_seqlens'"),
    ("chunk_size", lambda: _op(chunk_size=24), ValueError, r"'chunk_size'"),
    ("scale", lambda: _op(scale="1"), TypeError, r"'scale'"),
    ("NaN", lambda: _op(beta=torch.full((2, 20, 2), float("nan"), dtype=torch.float64)), ValueError, r"'beta'"),
    ("dplr gk shape", lambda: deltacp.chunk_dplr(*(torch.zeros((1, 5, 1, 4), dtype=torch.float64) for _ in range(5)),
                                                 torch.zeros((1, 5, 1), dtype=torch.float64)), ValueError, r"'gk'"),
    ("cu_seqlens_cpu alone", lambda: _op(cu_seqlens_cpu=torch.tensor([0, 20])), ValueError, r"'cu_seqlens_cpu'"),
]


@pytest.mark.parametrize("label,call,exc,pattern", TORCH_CASES, ids=[c[0] for c in TORCH_CASES])
def test_torch_bad_input(label, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_torch_bad_upstream_gradient_is_reported():
    """A NaN reaching backward is reported, not propagated."""
    t = {key: val.requires_grad_() for key, val in _t().items()}
    o, _ = deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"])
    with pytest.raises(ValueError, match="'do'"):
        o.backward(torch.full_like(o, float("nan")))


def test_cp_context_refuses_cu_seqlens_cpu():
    """With cp_context the rank-local offsets come from the context; a host copy given beside it is
    an error, not silently ignored. (The check runs before the context is used.)"""
    torch = pytest.importorskip("torch")
    import deltacp

    x = torch.zeros(1, 4, 1, 8, dtype=torch.float64)
    g, beta = torch.zeros(1, 4, 1, dtype=torch.float64), torch.full((1, 4, 1), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="'cu_seqlens_cpu'"):
        deltacp.chunk_gated_delta_rule(x, x, x, g, beta, cp_context=object(), cu_seqlens_cpu=torch.tensor([0, 4]))


def test_in_kernel_l2norm_flag_is_refused_where_it_cannot_apply():
    """Params::qk_l2norm (FLA's use_qk_l2norm_in_kernel inside the CUDA forward) on the CPU reference, or on a
    backward, is an error naming it, never a silent run on unnormalised q and k."""
    torch = pytest.importorskip("torch")
    from deltacp import _core
    from deltacp._calls import tensor_descs
    from deltacp._describe import torch_desc

    p = make_problem("gdn", B=1, T=10, H=1, K=4, V=3, seed=3)
    t = {n: torch.tensor(p[n]) for n in ("q", "k", "v", "g", "beta")}
    d = tensor_descs("g", t["q"], t["k"], t["v"], t["g"], t["beta"], None, None)
    d["o"] = torch_desc(torch.empty(1, 10, 1, 3, dtype=torch.float64), "o")
    with pytest.raises(deltacp.InvalidArgumentError) as info:
        _core.run("forward", "gdn", "chunked", "float64", d, None, 64, None, 0, False, True)
    assert info.value.argument == "qk_l2norm"
    d.pop("o")
    d["dout"] = torch_desc(torch.ones(1, 10, 1, 3, dtype=torch.float64), "do")
    for n in ("q", "k", "v", "g", "beta"):
        d["d" + n] = torch_desc(torch.empty_like(t[n]), "d" + n)
    with pytest.raises(deltacp.InvalidArgumentError) as info:
        _core.run("backward", "gdn", "chunked", "float64", d, None, 64, None, 0, False, True)
    assert info.value.argument == "qk_l2norm"


def test_in_kernel_kda_gate_is_refused_where_it_cannot_apply():
    """Params::gate_A_log (FLA's use_gate_in_kernel for kda inside the CUDA forward): on the CPU reference, for
    another variant, with a wrong shape or dtype, or a lower_bound that is not negative, an error naming the
    argument, never a run on the raw gate as if it were a log decay."""
    torch = pytest.importorskip("torch")
    from deltacp import _core
    from deltacp._calls import tensor_descs
    from deltacp._describe import torch_desc

    def descs(variant, A_log):
        p = make_problem(variant, B=1, T=10, H=1, K=4, V=3, seed=3)
        t = {n: torch.tensor(p[n]) for n in ("q", "k", "v", "g", "beta")}
        d = tensor_descs("g", t["q"], t["k"], t["v"], t["g"], t["beta"], None, None)
        d["o"] = torch_desc(torch.empty(1, 10, 1, 3, dtype=torch.float64), "o")
        d["gate_A_log"] = torch_desc(A_log, "A_log")
        return d

    cases = [("kda", torch.zeros(1, dtype=torch.float32), None, ValueError, "A_log"),  # the host reference
             ("gdn", torch.zeros(1, dtype=torch.float32), None, ValueError, "A_log"),
             ("kda", torch.zeros(2, dtype=torch.float32), None, ValueError, "A_log"),
             ("kda", torch.zeros(1, dtype=torch.float64), None, TypeError, "A_log")]
    for variant, A_log, lb, error, name in cases:
        with pytest.raises(error, match=f"'{name}'"):
            _core.run("forward", variant, "chunked", "float64", descs(variant, A_log), None, 64, None, 0, False, False,
                      lb)
    with pytest.raises(ValueError, match="'lower_bound'"):  # without the gate's A_log
        d = descs("kda", torch.zeros(1, dtype=torch.float32))
        d.pop("gate_A_log")
        _core.run("forward", "kda", "chunked", "float64", d, None, 64, None, 0, False, False, -5.0)
