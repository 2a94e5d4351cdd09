"""deltacp.reference — the Eigen reference on numpy arrays (FLA's layouts, float64 by default).

Batched ops, the same conventions as flash-linear-attention (docs/design.md sections 2 and 6)::

    q, k [B, T, H, K]   v [B, T, HV, V]   g: gdn [B, T, HV], kda/dplr [B, T, HV, K]   beta [B, T, HV]
    a, b [B, T, HV, K] (dplr)   states [N, HV, K, V]   cu_seqlens [N + 1] int64 (B == 1, packed)

    gdn / kda / delta:  S <- D_t S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T (scale q_t)
    dplr:               S <- diag(exp(gk_t)) S + k_t v_t^T + b_t (a_t^T S);          o_t = S^T (scale q_t)

``chunk_size=None`` runs the token recurrence; 16 / 32 / 64 (any positive size the C++ reference
accepts) the chunked WY form; ``method="affine"`` the chunk maps (M, H) folded. Inputs are float64
or float32 (all float32 -> the reference computes in float32, otherwise in float64); states are
float64 / float32 likewise. Backward functions return the gradients of
``L = sum(o * do) + sum(ht * dht)``.

Per-head pieces (one sequence, one value head, rows are tokens; always float64), for notebooks:
``chunk_wy``, ``chunk_step``, ``chunk_states``, ``chunk_affine``, ``span_affine``,
``span_affine_tokens``, ``span_affine_backward``, ``compose``, ``recurrent_forward``, ...
and ``cp_simulate`` for context parallelism simulated over ranks cut at given token positions.

FLA's optional keyword arguments of chunk_gated_delta_rule / chunk_kda (the in-kernel l2 norm, beta
sigmoid, the gate from A_log and dt_bias, the kda lower-bound gate, the V-first state layout), with
their backward written out: ``fla_forward``, ``fla_backward``, ``fla_gate``, ``l2norm``, ...
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence

import numpy as np

from . import _core
from ._describe import numpy_desc

__all__ = [
    "gated_delta_rule", "gated_delta_rule_backward", "kda", "kda_backward",
    "delta_rule", "delta_rule_backward", "dplr", "dplr_backward", "cp_simulate", "cp_plan",
    "chunk_wy", "chunk_step", "chunk_states", "chunked_forward", "chunked_backward", "chunk_affine",
    "span_affine", "span_affine_tokens", "span_affine_backward", "compose", "affine_forward",
    "recurrent_forward", "recurrent_backward", "unit_lower_inverse", "chunk_ranges",
    "fla_forward", "fla_backward", "fla_gate", "fla_gate_backward", "l2norm", "l2norm_backward", "beta_sigmoid",
    "beta_sigmoid_backward", "sigmoid", "softplus",
]

# Public gate / gradient names per variant: dplr calls its gate gk (FLA's name).
_GATE = {"delta": None, "gdn": "g", "kda": "g", "dplr": "gk"}
_METHODS = ("recurrent", "chunked", "affine")


# ---------------------------------------------------------------------------------------------
# argument handling
# ---------------------------------------------------------------------------------------------
def _to_float_array(x, name: str) -> np.ndarray:
    """numpy array of float64 / float32 (lists and integer arrays become float64)."""
    if not isinstance(x, np.ndarray):
        try:
            x = np.asarray(x)
        except Exception as exc:  # noqa: BLE001 - report which argument
            raise TypeError(f"deltacp: argument '{name}': expected a numpy array, got {type(x).__name__}") from exc
    if x.dtype.kind in "iub":
        x = x.astype(np.float64)
    if x.dtype not in (np.float64, np.float32):
        raise TypeError(f"deltacp: argument '{name}': expected dtype float64 or float32, got {x.dtype}")
    return x


def _check_ndim(x: np.ndarray, name: str, ndim: int, pattern: str) -> None:
    if x.ndim != ndim:
        raise ValueError(f"deltacp: argument '{name}': expected {ndim} dims {pattern}, got shape {list(x.shape)}")


def _cu_array(cu_seqlens) -> Optional[np.ndarray]:
    if cu_seqlens is None:
        return None
    cu = np.asarray(cu_seqlens)
    if cu.dtype.kind not in "iu":
        raise TypeError(f"deltacp: argument 'cu_seqlens': expected an integer array, got dtype {cu.dtype}")
    if cu.ndim != 1:
        raise ValueError(f"deltacp: argument 'cu_seqlens': expected a 1-D array [N + 1], got shape {list(cu.shape)}")
    return np.ascontiguousarray(cu, dtype=np.int64)


def _chunk_and_method(chunk_size, method):
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)):
        raise TypeError(f"deltacp: argument 'chunk_size': expected an int or None, got {type(chunk_size).__name__}")
    if method is None:
        method = "recurrent" if chunk_size is None else "chunked"
    if method not in _METHODS:
        raise ValueError(f"deltacp: argument 'method': expected one of {_METHODS}, got {method!r}")
    if method != "recurrent" and chunk_size is None:
        chunk_size = 64
    return (64 if chunk_size is None else int(chunk_size)), method


def _check_scale(scale):
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"deltacp: argument 'scale': expected a float or None, got {type(scale).__name__}")
    return None if scale is None else float(scale)


class _Problem:
    """The inputs of one batched call, converted once: arrays, compute dtype, sizes."""

    def __init__(self, variant: str, inputs: dict, initial_state, cu_seqlens):
        # inputs: {public name: (Params field, value or None)}
        if variant not in _GATE:
            raise ValueError(f"deltacp: argument 'variant': expected one of {tuple(_GATE)}, got {variant!r}")
        self.variant = variant
        arrays = {}
        for name, (field, value) in inputs.items():
            if value is not None:
                arrays[name] = (field, _to_float_array(value, name))
        # float32 only when every floating input is float32; any float64 makes the whole call float64.
        all32 = all(a.dtype == np.float32 for _, a in arrays.values())
        if initial_state is not None:
            initial_state = _to_float_array(initial_state, "initial_state")
            all32 = all32 and initial_state.dtype == np.float32
        self.dtype = np.dtype(np.float32 if all32 else np.float64)
        self.compute = self.dtype.name
        self.arrays = {name: (field, a.astype(self.dtype, copy=False)) for name, (field, a) in arrays.items()}
        q = self.arrays["q"][1]
        v = self.arrays["v"][1]
        _check_ndim(q, "q", 4, "[B, T, H, K]")
        _check_ndim(v, "v", 4, "[B, T, HV, V]")
        self.B, self.T, self.H, self.K = q.shape
        self.HV, self.V = v.shape[2], v.shape[3]
        self.cu = _cu_array(cu_seqlens)
        self.N = self.B if self.cu is None else len(self.cu) - 1
        self.h0 = None if initial_state is None else np.ascontiguousarray(initial_state, dtype=self.dtype)

    def state_shape(self):
        return (self.N, self.HV, self.K, self.V)

    def output(self, shape):
        return np.full(shape, np.nan, dtype=self.dtype)  # NaN-poisoned: an unwritten entry shows

    def descs(self) -> dict:
        d = {field: numpy_desc(a, name) for name, (field, a) in self.arrays.items()}
        if self.h0 is not None:
            d["h0"] = numpy_desc(self.h0, "initial_state")
        if self.cu is not None:
            d["cu_seqlens"] = numpy_desc(self.cu, "cu_seqlens")
        return d


def _inputs(variant, q, k, v, g=None, beta=None, a=None, b=None) -> dict:
    """{public name: (Params field, value)} for the variant (unused arguments left out)."""
    d = {"q": ("q", q), "k": ("k", k), "v": ("v", v)}
    gate = _GATE[variant]
    if gate is not None:
        d[gate] = ("g", g)
    if variant == "dplr":
        d["a"] = ("a", a)
        d["b"] = ("b", b)
    else:
        d["beta"] = ("beta", beta)
    return d


def _run_forward(variant, inputs, scale, initial_state, output_final_state, cu_seqlens, chunk_size, method,
                 cuts=None, want_exchange=False):
    prob = _Problem(variant, inputs, initial_state, cu_seqlens)
    descs = prob.descs()
    o = prob.output((prob.B, prob.T, prob.HV, prob.V))
    descs["o"] = numpy_desc(o, "o")
    ht = None
    if output_final_state:
        ht = prob.output(prob.state_shape())
        descs["ht"] = numpy_desc(ht, "ht")
    exchange = _core.run("forward", variant, method, prob.compute, descs, _check_scale(scale), chunk_size, cuts,
                         0, want_exchange)
    return o, ht, exchange


def _run_backward(variant, inputs, do, dht, scale, initial_state, cu_seqlens, chunk_size, method, cuts=None,
                  want_exchange=False):
    prob = _Problem(variant, inputs, initial_state, cu_seqlens)
    descs = prob.descs()
    if do is None:
        raise ValueError("deltacp: argument 'do': is required (the gradient of the loss with respect to o)")
    do = _to_float_array(do, "do").astype(prob.dtype, copy=False)
    descs["dout"] = numpy_desc(do, "do")
    if dht is not None:
        dht = np.ascontiguousarray(_to_float_array(dht, "dht"), dtype=prob.dtype)
        descs["dht"] = numpy_desc(dht, "dht")
    grads = {}
    for name, (field, arr) in prob.arrays.items():
        grads["d" + name] = prob.output(arr.shape)
        descs["d" + field] = numpy_desc(grads["d" + name], "d" + name)
    grads["dh0"] = prob.output(prob.state_shape())
    descs["dh0"] = numpy_desc(grads["dh0"], "dh0")
    exchange = _core.run("backward", variant, method, prob.compute, descs, _check_scale(scale), chunk_size, cuts,
                         0, want_exchange)
    return grads, exchange


# ---------------------------------------------------------------------------------------------
# batched ops: gdn, kda, delta, dplr
# ---------------------------------------------------------------------------------------------
def gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, cu_seqlens=None,
                     chunk_size=None, *, method=None):
    """Gated DeltaNet forward -> (o [B, T, HV, V], final_state [N, HV, K, V] or None)."""
    cs, m = _chunk_and_method(chunk_size, method)
    o, ht, _ = _run_forward("gdn", _inputs("gdn", q, k, v, g, beta), scale, initial_state, output_final_state,
                            cu_seqlens, cs, m)
    return o, ht


def gated_delta_rule_backward(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
                              chunk_size=None, *, method=None):
    """Gated DeltaNet backward -> dict(dq, dk, dv, dg, dbeta, dh0)."""
    cs, m = _chunk_and_method(chunk_size, method)
    grads, _ = _run_backward("gdn", _inputs("gdn", q, k, v, g, beta), do, dht, scale, initial_state, cu_seqlens,
                             cs, m)
    return grads


def kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, cu_seqlens=None,
        chunk_size=None, *, method=None):
    """Kimi Delta Attention forward (g per key dim, [B, T, HV, K]) -> (o, final_state or None)."""
    cs, m = _chunk_and_method(chunk_size, method)
    o, ht, _ = _run_forward("kda", _inputs("kda", q, k, v, g, beta), scale, initial_state, output_final_state,
                            cu_seqlens, cs, m)
    return o, ht


def kda_backward(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None, chunk_size=None,
                 *, method=None):
    """Kimi Delta Attention backward -> dict(dq, dk, dv, dg, dbeta, dh0)."""
    cs, m = _chunk_and_method(chunk_size, method)
    grads, _ = _run_backward("kda", _inputs("kda", q, k, v, g, beta), do, dht, scale, initial_state, cu_seqlens,
                             cs, m)
    return grads


def delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=True, cu_seqlens=None,
               chunk_size=None, *, method=None):
    """DeltaNet forward (no gate) -> (o, final_state or None)."""
    cs, m = _chunk_and_method(chunk_size, method)
    o, ht, _ = _run_forward("delta", _inputs("delta", q, k, v, beta=beta), scale, initial_state,
                            output_final_state, cu_seqlens, cs, m)
    return o, ht


def delta_rule_backward(q, k, v, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
                        chunk_size=None, *, method=None):
    """DeltaNet backward -> dict(dq, dk, dv, dbeta, dh0)."""
    cs, m = _chunk_and_method(chunk_size, method)
    grads, _ = _run_backward("delta", _inputs("delta", q, k, v, beta=beta), do, dht, scale, initial_state,
                             cu_seqlens, cs, m)
    return grads


def dplr(q, k, v, a, b, gk, scale=None, initial_state=None, output_final_state=True, cu_seqlens=None,
         chunk_size=None, *, method=None):
    """DPLR (RWKV-7 family) forward: S <- diag(e^gk) S + k v^T + b (a^T S) -> (o, final_state or None)."""
    cs, m = _chunk_and_method(chunk_size, method)
    o, ht, _ = _run_forward("dplr", _inputs("dplr", q, k, v, gk, a=a, b=b), scale, initial_state,
                            output_final_state, cu_seqlens, cs, m)
    return o, ht


def dplr_backward(q, k, v, a, b, gk, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
                  chunk_size=None, *, method=None):
    """DPLR backward -> dict(dq, dk, dv, da, db, dgk, dh0)."""
    cs, m = _chunk_and_method(chunk_size, method)
    grads, _ = _run_backward("dplr", _inputs("dplr", q, k, v, gk, a=a, b=b), do, dht, scale, initial_state,
                             cu_seqlens, cs, m)
    return grads


# ---------------------------------------------------------------------------------------------
# simulated context parallelism
# ---------------------------------------------------------------------------------------------
def cp_simulate(variant, q, k, v, g=None, beta=None, a=None, b=None, *, cuts: Sequence[int], gk=None, scale=None,
                initial_state=None, output_final_state=True, cu_seqlens=None, chunk_size=64, backward=False, do=None,
                dht=None, return_exchange=False):
    """Context parallelism simulated in one process (docs/design.md section 4, reference/cp.h).

    Packed inputs (B == 1; ``cu_seqlens`` None means one sequence) are cut into ranks at the global
    token positions ``cuts`` (strictly increasing, inside (0, T)). Each rank folds its last segment
    into (M_r, H_r); the ranks' initial states come from folding the earlier ranks' maps from the
    sequence's initial state; backward mirrors it with (M_r^T, dH_r).

    backward=False -> (o, final_state or None); backward=True -> the gradient dict of the matching
    ``*_backward`` function (``do`` required). With return_exchange=True the result is a pair
    (result, exchange), the maps the simulated ranks all-gathered, per rank and value head:
    forward {"M": [world, HV, K, K], "H": [world, HV, K, V]} (identity / zero for a rank whose last
    segment does not continue), backward {"Mt": [world, HV, K, K], "dH": [world, HV, K, V]}.
    """
    if variant not in _GATE:
        raise ValueError(f"deltacp: argument 'variant': expected one of {tuple(_GATE)}, got {variant!r}")
    if variant == "dplr" and gk is not None:
        if g is not None:
            raise ValueError("deltacp: argument 'gk': give the dplr gate once, as gk (or g), not both")
        g = gk
    if isinstance(cuts, (str, bytes)) or not hasattr(cuts, "__iter__"):
        raise TypeError(f"deltacp: argument 'cuts': expected a sequence of ints, got {type(cuts).__name__}")
    cut_list = []
    for c in cuts:
        if isinstance(c, bool) or not isinstance(c, numbers.Integral):
            raise TypeError(f"deltacp: argument 'cuts': expected ints, got {c!r}")
        cut_list.append(int(c))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"deltacp: argument 'chunk_size': expected an int, got {type(chunk_size).__name__}")
    if cu_seqlens is None:
        q_arr = _to_float_array(q, "q")
        _check_ndim(q_arr, "q", 4, "[B, T, H, K]")
        cu_seqlens = np.array([0, q_arr.shape[1]], dtype=np.int64)
    inputs = _inputs(variant, q, k, v, g, beta, a, b)
    if backward:
        result, exchange = _run_backward(variant, inputs, do, dht, scale, initial_state, cu_seqlens,
                                         int(chunk_size), "cp", cut_list, return_exchange)
    else:
        o, ht, exchange = _run_forward(variant, inputs, scale, initial_state, output_final_state, cu_seqlens,
                                       int(chunk_size), "cp", cut_list, return_exchange)
        result = (o, ht)
    if not return_exchange:
        return result
    return result, _exchange_arrays(exchange, len(cut_list) + 1, "bwd" if backward else "fwd")


def _exchange_arrays(exchange, world, direction):
    """The C++ lists (value head outer, rank inner: reference/src/batch.cpp) as [world, HV, ...] arrays."""
    pairs = exchange[direction]
    HV = len(pairs) // world
    first = np.stack([m for m, _ in pairs]).reshape((HV, world) + pairs[0][0].shape).swapaxes(0, 1)
    second = np.stack([h for _, h in pairs]).reshape((HV, world) + pairs[0][1].shape).swapaxes(0, 1)
    names = ("Mt", "dH") if direction == "bwd" else ("M", "H")
    return {names[0]: np.ascontiguousarray(first), names[1]: np.ascontiguousarray(second)}


def cp_plan(cu_seqlens, cuts=None, world=None):
    """How ranks split a packed batch: a list of dicts (rank, begin, end, cu_seqlens, seq_ids,
    pre_ranks, post_ranks) — cut at ``cuts``, or evenly over ``world`` ranks as torch/FLA do."""
    cu = _cu_array(cu_seqlens)
    if cu is None:
        raise ValueError("deltacp: argument 'cu_seqlens': is required")
    if (cuts is None) == (world is None):
        raise ValueError("deltacp: argument 'cuts': give exactly one of cuts and world")
    if cuts is not None:
        return _core.cp_plan(cu.tolist(), [int(c) for c in cuts])
    return _core.cp_plan_even(cu.tolist(), int(world))


# ---------------------------------------------------------------------------------------------
# per-head pieces (one sequence, one value head; float64)
# ---------------------------------------------------------------------------------------------
def _matrix(x, name, rows=None, cols=None, pattern="") -> np.ndarray:
    arr = np.asarray(_to_float_array(x, name), dtype=np.float64)
    if arr.ndim != 2 or (rows is not None and arr.shape[0] != rows) or (cols is not None and arr.shape[1] != cols):
        raise ValueError(f"deltacp: argument '{name}': expected shape {pattern}, got {list(arr.shape)}")
    return arr


def _head(variant, q, k, v, g=None, beta=None, a=None, b=None, scale=None, gk=None):
    """One slice as the C++ HeadInputs: q, k [n, K]; v [n, V]; g gdn [n], kda/dplr [n, K]; beta [n]."""
    if variant not in _GATE:
        raise ValueError(f"deltacp: argument 'variant': expected one of {tuple(_GATE)}, got {variant!r}")
    if gk is not None:
        if variant != "dplr":
            raise ValueError(f"deltacp: argument 'gk': only dplr has gk, variant is {variant!r}")
        if g is not None:
            raise ValueError("deltacp: argument 'gk': give the dplr gate once, as gk (or g), not both")
        g = gk
    q = _matrix(q, "q", pattern="[n, K]")
    n, K = q.shape
    k = _matrix(k, "k", n, K, f"[n, K] = [{n}, {K}]")
    v = _matrix(v, "v", n, None, f"[n, V] with n = {n}")
    gate_name = _GATE[variant] or "g"
    if variant == "delta":
        if g is not None:
            raise ValueError("deltacp: argument 'g': delta has no gate")
        g = np.zeros((n, 0))
    elif g is None:
        raise ValueError(f"deltacp: argument '{gate_name}': is required for variant '{variant}'")
    elif variant == "gdn":
        g = np.asarray(_to_float_array(g, "g"), dtype=np.float64)
        if g.shape not in ((n,), (n, 1)):
            raise ValueError(f"deltacp: argument 'g': expected shape [n] = [{n}], got {list(g.shape)}")
        g = g.reshape(n, 1)
    else:
        g = _matrix(g, gate_name, n, K, f"[n, K] = [{n}, {K}]")
    if variant == "dplr":
        if beta is not None:
            raise ValueError("deltacp: argument 'beta': dplr takes no beta")
        if a is None or b is None:
            raise ValueError(f"deltacp: argument '{'a' if a is None else 'b'}': is required for variant 'dplr'")
        beta = np.zeros(0)
        a = _matrix(a, "a", n, K, f"[n, K] = [{n}, {K}]")
        b = _matrix(b, "b", n, K, f"[n, K] = [{n}, {K}]")
    else:
        if a is not None or b is not None:
            raise ValueError(f"deltacp: argument '{'a' if a is not None else 'b'}': is not used by variant '{variant}'")
        if beta is None:
            raise ValueError(f"deltacp: argument 'beta': is required for variant '{variant}'")
        beta = np.asarray(_to_float_array(beta, "beta"), dtype=np.float64)
        if beta.shape not in ((n,), (n, 1)):
            raise ValueError(f"deltacp: argument 'beta': expected shape [n] = [{n}], got {list(beta.shape)}")
        beta = beta.reshape(n)
        a = b = np.zeros((0, 0))
    scale = K ** -0.5 if scale is None else _check_scale(scale)
    return _core.HeadInputs(variant, q, k, v, g, beta, a, b, scale)


def _state(x, name, head) -> np.ndarray:
    if x is None:
        return np.zeros((0, 0))
    return _matrix(x, name, head.K, head.V, f"[K, V] = [{head.K}, {head.V}]")


def chunk_wy(variant, q, k, v, g=None, beta=None, a=None, b=None, scale=None, *, gk=None) -> dict:
    """WY factors of ONE chunk (all n rows): dict(G, A, T, W, U[, Ak for dplr]).

    gdn/kda/delta: A = strict_tril(Beta (K e^G)(K e^-G)^T), T = (I + A)^-1, W = T Beta (K e^G), U = T Beta V.
    dplr: A = strict_tril((a e^G_prev)(b e^-G)^T), T = (I - A)^-1, W = T (a e^G_prev), U = T Ak V.
    """
    return _core.head_chunk_wy(_head(variant, q, k, v, g, beta, a, b, scale, gk))


def chunk_step(variant, q, k, v, g=None, beta=None, a=None, b=None, scale=None, *, S0, gk=None) -> dict:
    """ONE chunk applied to the state S0 [K, V]: dict(v_new, o, S_end)."""
    x = _head(variant, q, k, v, g, beta, a, b, scale, gk)
    return _core.head_chunk_step(x, _matrix(S0, "S0", x.K, x.V, f"[K, V] = [{x.K}, {x.V}]"))


def chunk_states(variant, q, k, v, g=None, beta=None, a=None, b=None, scale=None, *, initial_state=None,
                 chunk_size=64, gk=None) -> dict:
    """The chunked forward of one slice: dict(states [nchunks + 1, K, V] (chunk starts, then the final
    state), v_new [n, V], o [n, V])."""
    x = _head(variant, q, k, v, g, beta, a, b, scale, gk)
    out = _core.head_chunked_forward(x, _state(initial_state, "initial_state", x), int(chunk_size))
    out["states"] = np.stack(out["states"]) if out["states"] else np.zeros((0, x.K, x.V))
    return out


chunked_forward = chunk_states


def chunked_backward(variant, q, k, v, g=None, beta=None, a=None, b=None, scale=None, *, do, dht=None,
                     initial_state=None, chunk_size=64, gk=None) -> dict:
    """Chunked backward of one slice: dict(dq, dk, dv, dg / dgk, dbeta or da, db, dh0)."""
    x = _head(variant, q, k, v, g, beta, a, b, scale, gk)
    return _core.head_chunked_backward(x, _state(initial_state, "initial_state", x),
                                       _matrix(do, "do", x.n, x.V, f"[n, V] = [{x.n}, {x.V}]"),
                                       _state(dht, "dht", x), int(chunk_size))


def recurrent_forward(variant, q, k, v, g=None, beta=None, a=None, b=None, scale=None, *, initial_state=None,
                      gk=None):
    """Token recurrence of one slice -> (o [n, V], final state [K, V])."""
    x = _head(variant, q, k, v, g, beta, a, b, scale, gk)
    return _core.head_recurrent_forward(x, _state(initial_state, "initial_state", x))


def recurrent_backward(variant, q, k, v, g=None, beta=None, a=None, b=None, scale=None, *, do, dht=None,
                       initial_state=None, gk=None) -> dict:
    """Exact backward of the token recurrence of one slice -> gradient dict (with dh0)."""
    x = _head(variant, q, k, v, g, beta, a, b, scale, gk)
    return _core.head_recurrent_backward(x, _state(initial_state, "initial_state", x),
                                         _matrix(do, "do", x.n, x.V, f"[n, V] = [{x.n}, {x.V}]"),
                                         _state(dht, "dht", x))


def chunk_affine(variant, q, k, v, g=None, beta=None, a=None, b=None, scale=None, *, gk=None):
    """(M, H) of ONE chunk (all n rows) from its WY factors: S_end = M S_start + H."""
    return _core.head_chunk_affine(_head(variant, q, k, v, g, beta, a, b, scale, gk))


def _span(x, t0, t1):
    return int(t0), int(x.n if t1 is None else t1)


def span_affine(variant, q, k, v, g=None, beta=None, a=None, b=None, scale=None, *, t0=0, t1=None, chunk_size=64,
                gk=None):
    """(M, H) of tokens [t0, t1): the chunk maps (chunks aligned at t0) folded in order."""
    x = _head(variant, q, k, v, g, beta, a, b, scale, gk)
    t0, t1 = _span(x, t0, t1)
    return _core.head_span_affine(x, t0, t1, int(chunk_size))


def span_affine_tokens(variant, q, k, v, g=None, beta=None, a=None, b=None, scale=None, *, t0=0, t1=None, gk=None):
    """(M, H) of tokens [t0, t1) by multiplying the per-token transitions (the definition; slow)."""
    x = _head(variant, q, k, v, g, beta, a, b, scale, gk)
    t0, t1 = _span(x, t0, t1)
    return _core.head_span_affine_tokens(x, t0, t1)


def span_affine_backward(variant, q, k, v, g=None, beta=None, a=None, b=None, scale=None, *, do, t0=0, t1=None,
                         chunk_size=64, gk=None):
    """Backward map of tokens [t0, t1): dS_start = Mt dS_end + dH -> (Mt, dH). do covers the span's rows."""
    x = _head(variant, q, k, v, g, beta, a, b, scale, gk)
    t0, t1 = _span(x, t0, t1)
    return _core.head_span_affine_backward(x, t0, t1, _matrix(do, "do", pattern="[t1 - t0, V]"), int(chunk_size))


def affine_forward(variant, q, k, v, g=None, beta=None, a=None, b=None, scale=None, *, initial_state=None,
                   chunk_size=64, gk=None):
    """Forward through folded chunk maps (the CP way) -> (o [n, V], final state [K, V])."""
    x = _head(variant, q, k, v, g, beta, a, b, scale, gk)
    return _core.head_affine_forward(x, _state(initial_state, "initial_state", x), int(chunk_size))


def compose(later, earlier):
    """(M2, H2) o (M1, H1) = (M2 M1, M2 H1 + H2): the map of `earlier` followed by `later`."""
    (M2, H2), (M1, H1) = later, earlier
    return _core.compose(_matrix(M2, "M2"), _matrix(H2, "H2"), _matrix(M1, "M1"), _matrix(H1, "H1"))


def unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower-triangular A, by forward substitution."""
    return _core.unit_lower_inverse(_matrix(A, "A"))


def chunk_ranges(n: int, chunk_size: int):
    """[(t0, t1), ...] chunk ranges of a slice of n tokens."""
    return _core.chunk_ranges(int(n), int(chunk_size))


# ---------------------------------------------------------------------------------------------
# FLA's optional keyword arguments of chunk_gated_delta_rule / chunk_kda (float64 ground truth)
# ---------------------------------------------------------------------------------------------
# The torch ops apply these as a pre-pass (deltacp/fla_options.py) and let autograd differentiate it;
# here each is written out with its backward by hand, so the two derivations check each other.
FLA_L2NORM_EPS = 1e-6
FLA_SOFTPLUS_THRESHOLD = 20.0


def _f64(x, name):
    return np.asarray(_to_float_array(x, name), dtype=np.float64)


def sigmoid(x):
    """1 / (1 + e^-x) without overflow."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def softplus(x):
    """FLA's softplus: x above 20, else log(1 + e^x)."""
    x = np.asarray(x, dtype=np.float64)
    return np.where(x > FLA_SOFTPLUS_THRESHOLD, x, np.log1p(np.exp(np.minimum(x, FLA_SOFTPLUS_THRESHOLD))))


def _softplus_grad(x):
    return np.where(x > FLA_SOFTPLUS_THRESHOLD, 1.0, sigmoid(x))


def l2norm(x, eps=FLA_L2NORM_EPS):
    """use_qk_l2norm_in_kernel: x / sqrt(sum(x^2) + eps) over the last dim."""
    x = _f64(x, "x")
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def l2norm_backward(x, dy, eps=FLA_L2NORM_EPS):
    """dx of y = x r, r = (sum(x^2) + eps)^-1/2: r dy - r^3 x sum(x dy)."""
    x, dy = _f64(x, "x"), _f64(dy, "dy")
    r = 1.0 / np.sqrt((x * x).sum(-1, keepdims=True) + eps)
    return r * dy - r ** 3 * x * (x * dy).sum(-1, keepdims=True)


def beta_sigmoid(beta, allow_neg_eigval=False):
    """use_beta_sigmoid_in_kernel: sigmoid(beta), 2 sigmoid(beta) with allow_neg_eigval."""
    return (2.0 if allow_neg_eigval else 1.0) * sigmoid(_f64(beta, "beta"))


def beta_sigmoid_backward(beta, dy, allow_neg_eigval=False):
    s = sigmoid(_f64(beta, "beta"))
    return (2.0 if allow_neg_eigval else 1.0) * s * (1.0 - s) * _f64(dy, "dy")


def _gate_parts(variant, g, A_log, dt_bias):
    """(x = g + dt_bias, exp(A_log) broadcast over x, dt_bias shape): gdn g [B, T, HV], A_log and
    dt_bias [HV]; kda g [B, T, HV, K], A_log [HV], dt_bias [HV * K] or [HV, K]."""
    g = _f64(g, "g")
    A = _f64(A_log, "A_log").reshape(-1)
    x = g.copy()
    if dt_bias is not None:
        x = x + _f64(dt_bias, "dt_bias").reshape(g.shape[2:])
    a = np.exp(A) if variant == "gdn" else np.exp(A)[:, None]
    return x, a


def fla_gate(variant, g, A_log, dt_bias=None, lower_bound=None):
    """use_gate_in_kernel: the log decay from the raw gate input. -exp(A_log) softplus(g + dt_bias);
    kda with lower_bound: lower_bound sigmoid(exp(A_log) (g + dt_bias))."""
    x, a = _gate_parts(variant, g, A_log, dt_bias)
    if lower_bound is None:
        return -a * softplus(x)
    return float(lower_bound) * sigmoid(a * x)


def fla_gate_backward(variant, g, A_log, dt_bias, dy, lower_bound=None):
    """-> (dg, dA_log [HV], ddt_bias in dt_bias's shape or None) for the upstream gradient dy."""
    x, a = _gate_parts(variant, g, A_log, dt_bias)
    dy = _f64(dy, "dy")
    if lower_bound is None:
        y = -a * softplus(x)
        dx = -a * _softplus_grad(x) * dy
        dA_full = dy * y                                  # d y / d A_log = y
    else:
        s = sigmoid(a * x)
        dz = float(lower_bound) * s * (1.0 - s) * dy      # z = a x
        dx = dz * a
        dA_full = dz * a * x
    sum_axes = (0, 1) if variant == "gdn" else (0, 1, 3)
    dA = dA_full.sum(axis=sum_axes).reshape(np.shape(A_log))
    ddt = None if dt_bias is None else dx.sum(axis=(0, 1)).reshape(np.shape(dt_bias))
    return dx, dA, ddt


def _fla_prepass(variant, q, k, g, beta, o):
    """The inputs of the core op after FLA's options `o` (a dict of the keyword arguments)."""
    if o.get("allow_neg_eigval") and not o.get("use_beta_sigmoid_in_kernel"):
        raise ValueError("deltacp: argument 'allow_neg_eigval': True needs use_beta_sigmoid_in_kernel=True")
    if o.get("lower_bound") is not None and variant != "kda":
        raise ValueError("deltacp: argument 'lower_bound': only kda has the lower-bound gate")
    qq, kk, gg, bb = _f64(q, "q"), _f64(k, "k"), _f64(g, "g"), _f64(beta, "beta")
    if o.get("use_qk_l2norm_in_kernel"):
        qq, kk = l2norm(qq), l2norm(kk)
    if o.get("use_beta_sigmoid_in_kernel"):
        bb = beta_sigmoid(bb, o.get("allow_neg_eigval", False))
    if o.get("use_gate_in_kernel"):
        gg = fla_gate(variant, gg, o["A_log"], o.get("dt_bias"), o.get("lower_bound"))
    return qq, kk, gg, bb


def _swap_kv(x):
    return None if x is None else np.ascontiguousarray(np.swapaxes(_f64(x, "state"), -1, -2))


def fla_forward(variant, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                cu_seqlens=None, chunk_size=None, *, method=None, core_inputs=None, **options):
    """gdn / kda forward with FLA 0.5.2's keyword options (float64): use_qk_l2norm_in_kernel,
    use_gate_in_kernel with A_log and dt_bias, lower_bound (kda), use_beta_sigmoid_in_kernel,
    allow_neg_eigval, state_v_first (states [N, HV, V, K]) -> (o, final_state or None).

    core_inputs: (q, k, g, beta) to run the delta rule on instead of the float64 pre-pass, e.g. the
    pre-pass rounded as a 16-bit op rounds it (the reference applied to the pre-processed inputs)."""
    if variant not in ("gdn", "kda"):
        raise ValueError(f"deltacp: argument 'variant': expected 'gdn' or 'kda', got {variant!r}")
    qq, kk, gg, bb = _fla_prepass(variant, q, k, g, beta, options) if core_inputs is None else core_inputs
    v_first = options.get("state_v_first", False)
    h0 = _swap_kv(initial_state) if v_first else initial_state
    fwd = gated_delta_rule if variant == "gdn" else kda
    o, ht = fwd(qq, kk, _f64(v, "v"), gg, bb, scale=scale, initial_state=h0, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, chunk_size=chunk_size, method=method)
    return o, (_swap_kv(ht) if v_first and ht is not None else ht)


def fla_backward(variant, q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
                 chunk_size=None, *, method=None, core_inputs=None, **options) -> dict:
    """The gradients of fla_forward's L = sum(o * do) + sum(ht * dht) with respect to its raw inputs:
    dict(dq, dk, dv, dg, dbeta, dh0) and, with use_gate_in_kernel, dA_log and ddt_bias (None without
    dt_bias). The core backward's gradients (at core_inputs when given, as in fla_forward) chained
    through the options' hand-written backward at the raw inputs."""
    if variant not in ("gdn", "kda"):
        raise ValueError(f"deltacp: argument 'variant': expected 'gdn' or 'kda', got {variant!r}")
    o = options
    qq, kk, gg, bb = _fla_prepass(variant, q, k, g, beta, o) if core_inputs is None else core_inputs
    v_first = o.get("state_v_first", False)
    h0 = _swap_kv(initial_state) if v_first else initial_state
    dht_kv = _swap_kv(dht) if v_first else dht
    bwd = gated_delta_rule_backward if variant == "gdn" else kda_backward
    grads = bwd(qq, kk, _f64(v, "v"), gg, bb, do, dht=dht_kv, scale=scale, initial_state=h0, cu_seqlens=cu_seqlens,
                chunk_size=chunk_size, method=method)
    if o.get("use_qk_l2norm_in_kernel"):
        grads["dq"] = l2norm_backward(q, grads["dq"])
        grads["dk"] = l2norm_backward(k, grads["dk"])
    if o.get("use_beta_sigmoid_in_kernel"):
        grads["dbeta"] = beta_sigmoid_backward(beta, grads["dbeta"], o.get("allow_neg_eigval", False))
    if o.get("use_gate_in_kernel"):
        grads["dg"], grads["dA_log"], grads["ddt_bias"] = fla_gate_backward(
            variant, g, o["A_log"], o.get("dt_bias"), grads["dg"], o.get("lower_bound"))
    if v_first and grads.get("dh0") is not None:
        grads["dh0"] = _swap_kv(grads["dh0"])
    return grads
