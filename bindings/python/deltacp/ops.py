"""deltacp torch ops — FLA-compatible entry points with autograd, on CPU (the reference) or CUDA tiers.

    o, ht = deltacp.chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                           output_final_state=False, cu_seqlens=None, backend=None)

Same names, layouts and argument order as flash-linear-attention's ``chunk_gated_delta_rule`` /
``chunk_kda`` / ``chunk_delta_rule`` / ``chunk_dplr_delta_rule``. ``chunk_gated_delta_rule`` and
``chunk_kda`` take FLA 0.5.2's whole call (positions, defaults and every keyword option: the in-kernel
l2 norm, beta sigmoid, the A_log / dt_bias gate, safe_gate, state_v_first, ...; deltacp/fla_options.py,
docs/fla-compat.md); an argument deltacp does not take raises TypeError naming it.

Tensors go to C++ as (data pointer, dtype, shape, strides): no copies; the last dimension must be
contiguous. Outputs and gradients are allocated with torch. On CUDA the work is launched on torch's
current stream of the tensors' device. ``backend``:

    None         "reference" for CPU tensors; for CUDA tensors the fastest CUDA tier whose kernels apply to
                 the call (fused on Hopper where it applies, else tiled; ``deltacp.last_cuda_tier()``)
    "reference"  the chunked Eigen reference (CPU tensors; float64 computes in float64, else float32)
    "recurrent"  the token-recurrence Eigen reference (CPU tensors)
    "naive" / "tiled" / "fused"   the CUDA tiers (CUDA tensors); "fused" raises an error naming what it does
                 not support, and its gradients run on the tiled backward

While torch.compile traces, the kernels are reached through the torch.library custom ops
``deltacp::chunk_fwd`` / ``deltacp::chunk_bwd`` (deltacp/_library.py: fake implementations and registered
autograd, so torch.compile(fullgraph=True) traces a layer calling these ops); in eager mode the same run
goes without the custom op's dispatch (``_library.chunk``: an autograd Function, or the forward alone
without a gradient), which saves the host about 0.1 ms a call. The gradient is deltacp's own backward (the
reference's exact backward or the CUDA tier's). ``cp_context=`` (from ``deltacp.cp.build_context``)
hands the call to deltacp.cp's context-parallel op. States are float32 (float64 when the inputs are
float64); ``initial_state`` of another float dtype is cast (differentiably) first.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _core, fla_options
from ._describe import torch_desc
from .errors import DTypeError, InvalidArgumentError

__all__ = ["chunk_gated_delta_rule", "chunk_kda", "chunk_delta_rule", "chunk_dplr", "chunk_dplr_delta_rule",
           "BACKENDS"]

BACKENDS = ("reference", "recurrent", "naive", "tiled", "fused")
_CPU_METHOD = {"reference": "chunked", "recurrent": "recurrent"}
_CUDA_TIERS = ("fused", "tiled", "naive")  # fastest first
# The tensor check, the tensor descriptions and the core call, shared with deltacp.cp (deltacp/_calls.py).
from ._calls import _FLOAT_DTYPES, _run, _tensor, capturing, check_inputs, tensor_descs  # noqa: E402,F401
# The registered ops and the run of one call (_Config, _DeltaRuleFunction for callers that build one).
from . import _library  # noqa: E402
from ._library import _Config, _DeltaRuleFunction, start_gate_range_check  # noqa: E402,F401


# ---------------------------------------------------------------------------------------------
# argument checks shared by the public ops
# ---------------------------------------------------------------------------------------------
def _l2norm(x):
    """x / sqrt(sum(x^2) + 1e-6) along the last dim, in float32 or better (FLA's in-kernel l2norm)."""
    return fla_options.l2norm(x)


def _pick_cuda_tier(variant: str, backward: bool) -> Optional[str]:
    for tier in _CUDA_TIERS:
        if _core.cuda_supports(variant, tier, backward):
            return tier
    return None


@torch.compiler.assume_constant_result
def _methods(variant, backend, device, needs_grad):
    """_resolve_backend where torch.compile does not trace into it: while tracing it runs once (it asks
    the C++ core what this build has) and its result is a constant of the graph."""
    return _resolve_backend(variant, backend, device, needs_grad)


def _resolve_backend(variant, backend, device, needs_grad):
    """-> (forward method, backward method) for _core.run."""
    if backend is not None and backend not in BACKENDS:
        raise InvalidArgumentError(f"deltacp: argument 'backend': expected None or one of {BACKENDS}, got {backend!r}")
    if device.type == "cpu":
        if backend is None:
            backend = "reference"
        if backend not in _CPU_METHOD:
            raise InvalidArgumentError(
                f"deltacp: argument 'backend': {backend!r} is a CUDA tier and needs CUDA tensors, "
                f"got tensors on {device}; use 'reference' or 'recurrent' on the CPU")
        return _CPU_METHOD[backend], _CPU_METHOD[backend]
    if device.type != "cuda":
        raise InvalidArgumentError(f"deltacp: argument 'q': expected a CPU or CUDA tensor, got device {device}")
    if not _core.built_with_cuda():
        raise InvalidArgumentError(
            f"deltacp: argument 'q': got CUDA tensors, but this deltacp was built without the CUDA "
            f"tiers (no nvcc at build time); move the tensors to the CPU or rebuild with CUDA")
    if backend in _CPU_METHOD:
        raise InvalidArgumentError(f"deltacp: argument 'backend': {backend!r} runs on the host and needs CPU tensors, "
                                   f"got tensors on {device}; use one of {_CUDA_TIERS} on CUDA")
    if backend is None:
        fwd = _pick_cuda_tier(variant, False)
        bwd = _pick_cuda_tier(variant, True)
        if fwd is None:
            raise InvalidArgumentError(
                f"deltacp: argument 'backend': no CUDA tier implements variant '{variant}' in this build")
        if needs_grad and bwd is None:
            raise InvalidArgumentError(f"deltacp: argument 'backend': no CUDA tier implements the backward of variant "
                                       f"'{variant}' in this build")
        # "auto": the C++ dispatch picks per call the fastest tier whose kernels apply to these inputs
        # (shape, dtype, GPU); deltacp.last_cuda_tier() says which ran and why.
        return "auto", bwd or fwd
    if backend == "fused" and needs_grad and _core.cuda_supports(variant, "fused", False) \
            and not _core.cuda_supports(variant, "fused", True):
        # The fused tier has a forward only: its gradients come from the fastest backward built.
        bwd = _pick_cuda_tier(variant, True)
        if bwd is None:
            raise InvalidArgumentError(f"deltacp: argument 'backend': no CUDA tier implements the backward of variant "
                                       f"'{variant}' in this build")
        return "fused", bwd
    if not _core.cuda_supports(variant, backend, False):
        raise InvalidArgumentError(f"deltacp: argument 'backend': CUDA tier {backend!r} does not implement variant "
                                   f"'{variant}' in this build")
    if needs_grad and not _core.cuda_supports(variant, backend, True):
        raise InvalidArgumentError(
            f"deltacp: argument 'backend': CUDA tier {backend!r} does not implement the backward of "
            f"variant '{variant}' in this build")
    return backend, backend


def _offsets(cu_seqlens, cu_seqlens_cpu, device):
    """cu_seqlens as int64 on `device`, plus a host copy (the same tensor on the CPU)."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise InvalidArgumentError("deltacp: argument 'cu_seqlens_cpu': given without cu_seqlens")
        return None, None
    if not isinstance(cu_seqlens, torch.Tensor):
        try:
            cu_seqlens = torch.as_tensor(cu_seqlens)
        except Exception as exc:  # noqa: BLE001 - report which argument
            raise TypeError(f"deltacp: argument 'cu_seqlens': expected a LongTensor, got "
                            f"{type(cu_seqlens).__name__}") from exc
    if cu_seqlens.dtype not in (torch.int64, torch.int32):
        raise DTypeError(f"deltacp: argument 'cu_seqlens': expected dtype int64 (or int32), got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1:
        raise InvalidArgumentError(f"deltacp: argument 'cu_seqlens': expected a 1-D tensor [N + 1], got shape "
                                   f"{list(cu_seqlens.shape)}")
    if device.type == "cuda" and not torch.compiler.is_compiling() and capturing(device):
        _check_captured_offsets(cu_seqlens, cu_seqlens_cpu, device)
    cu = cu_seqlens.to(device=device, dtype=torch.int64).contiguous()
    if device.type == "cpu":
        return cu, cu
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    host = torch.as_tensor(host).to(device="cpu", dtype=torch.int64).contiguous()  # one sync when on the GPU
    return cu, host


def _check_captured_offsets(cu_seqlens, cu_seqlens_cpu, device):
    """A varlen call inside a CUDA graph capture: the CUDA tiers plan from a host copy of the offsets, and
    neither copy between host and device may run while the stream is captured (each synchronises). So
    cu_seqlens must already be on the GPU and cu_seqlens_cpu its host copy; the graph then replays those
    sequence boundaries (changing cu_seqlens' contents between replays does not move them)."""
    if cu_seqlens.device.type != "cuda":
        raise InvalidArgumentError(
            f"deltacp: argument 'cu_seqlens': inside a CUDA graph capture expected a tensor on {device} (copying "
            f"host offsets to the GPU synchronises, which the capture cannot record), got one on "
            f"{cu_seqlens.device}; pass cu_seqlens on the GPU and its host copy as cu_seqlens_cpu")
    if cu_seqlens_cpu is None:
        raise InvalidArgumentError(
            "deltacp: argument 'cu_seqlens_cpu': is required for a varlen call inside a CUDA graph capture: the "
            "CUDA tiers plan from a host copy of cu_seqlens, and copying cu_seqlens to the host synchronises, "
            "which the capture cannot record; pass cu_seqlens_cpu=cu_seqlens.cpu(), made before the capture "
            "(the graph replays these sequence boundaries)")
    if isinstance(cu_seqlens_cpu, torch.Tensor) and cu_seqlens_cpu.device.type != "cpu":
        raise InvalidArgumentError(
            f"deltacp: argument 'cu_seqlens_cpu': inside a CUDA graph capture expected a CPU tensor (copying it "
            f"to the host synchronises, which the capture cannot record), got one on {cu_seqlens_cpu.device}")


def _apply(variant, q, k, v, g, beta, a, b, scale, initial_state, output_final_state, cu_seqlens, backend,
           chunk_size, cp_context, cu_seqlens_cpu, opts: Optional[fla_options.FlaOptions] = None, gate_name="g"):
    # Everything here is either an argument check on metadata or a torch op, so that torch.compile
    # traces it into one graph; the C++ core is reached only inside the registered ops.
    if cp_context is not None and cu_seqlens_cpu is not None:
        raise InvalidArgumentError("deltacp: argument 'cu_seqlens_cpu': expected None with cp_context (the CP context "
                                   "carries the rank-local offsets and their host copy), got a tensor")
    q, k, v, g, beta, a, b = check_inputs(q, k, v, g, beta, a, b, gate_name, scale, chunk_size)
    if q.dim() != 4:
        raise InvalidArgumentError(f"deltacp: argument 'q': expected 4 dims [B, T, H, K], got shape {list(q.shape)}")
    if v.dim() != 4:
        raise InvalidArgumentError(f"deltacp: argument 'v': expected 4 dims [B, T, HV, V], got shape {list(v.shape)}")
    if backend is not None and backend not in BACKENDS:
        raise InvalidArgumentError(f"deltacp: argument 'backend': expected None or one of {BACKENDS}, got {backend!r}")
    opts = opts if opts is not None else fla_options.FlaOptions(variant)
    # use_qk_l2norm_in_kernel inside the CUDA forward when no gradient is wanted (Params::qk_l2norm: the fused
    # tier folds the row scales into its products, saving a pass over q and k); with a gradient, or
    # elsewhere, the normalisation runs here with autograd.
    no_grad = not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                   for t in (q, k, v, g, beta, a, b, initial_state, opts.A_log,
                                                             opts.dt_bias)))
    in_forward = cp_context is None and not opts.return_intermediate_states and q.device.type == "cuda" and no_grad
    l2_in_kernel = (opts.use_qk_l2norm_in_kernel and in_forward and q.shape[-1] <= 256 and q.is_contiguous()
                    and k.is_contiguous())
    # kda's use_gate_in_kernel inside the CUDA forward when no gradient is wanted (Params::gate_A_log: the fused
    # tier applies it where it sums the gate within each chunk, the others in one pass first); with a gradient,
    # or elsewhere, the gate is computed here with autograd.
    kda_gate = (_kda_gate_args(opts, v) if variant == "kda" and opts.use_gate_in_kernel and in_forward
                and (opts.lower_bound is None or opts.lower_bound < 0) else None)  # the kernels' two forms
    gate_bound = opts.gate_check_bound()  # of the options as given (safe_gate checks a precomputed g only)
    qk_unit_rows = bool(opts.use_qk_l2norm_in_kernel)
    # With cp_context the CP op normalises q and k itself (deltacp.cp.ops.cp_apply): in its local fused kernels where
    # no gradient is wanted, else in one pass of its own, differentiated; preprocess below leaves them as given.
    cp_l2 = cp_context is not None and opts.use_qk_l2norm_in_kernel
    if l2_in_kernel or kda_gate is not None or cp_l2:
        opts = opts.copy(use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel and not (l2_in_kernel or cp_l2),
                         use_gate_in_kernel=opts.use_gate_in_kernel and kda_gate is None)
    q, k, g, beta = fla_options.preprocess(opts, q, k, g, beta)

    h0 = None
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"deltacp: argument 'initial_state': expected a torch.Tensor, got "
                            f"{type(initial_state).__name__}")
        if initial_state.device != q.device:
            raise InvalidArgumentError(f"deltacp: argument 'initial_state': expected device {q.device} (like q), got "
                                       f"{initial_state.device}")
        if initial_state.dtype not in _FLOAT_DTYPES:
            raise DTypeError(f"deltacp: argument 'initial_state': expected a floating dtype, got {initial_state.dtype}")
        h0 = initial_state.transpose(-1, -2) if opts.state_v_first and initial_state.dim() >= 2 else initial_state
        state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        h0 = h0.to(state_dtype).contiguous()  # no-op when already fp32 (fp64) and contiguous

    if cp_context is not None:
        # Context parallelism lives in deltacp.cp (its own autograd Function and exchange); the options
        # are pure pre-processing, applied above.
        if opts.return_intermediate_states:
            raise InvalidArgumentError("deltacp: argument 'return_intermediate_states': not supported with cp_context")
        try:
            from .cp import cp_apply
        except ImportError as exc:
            raise NotImplementedError("deltacp: argument 'cp_context': context parallelism (deltacp.cp) is not "
                                      f"available in this installation: {exc}") from exc
        # The gate's range is checked on every rank before the exchange, inside the ranks' agreement.
        gate_check = start_gate_range_check(g, gate_bound, gate_name) if gate_bound is not None else None
        o, ht = cp_apply(variant, q, k, v, g, beta, a, b, cp_context=cp_context, scale=scale, initial_state=h0,
                         output_final_state=output_final_state, chunk_size=chunk_size, backend=backend,
                         use_qk_l2norm_in_kernel=cp_l2, gate_name=gate_name, cu_seqlens=cu_seqlens,
                         gate_range_check=gate_check, qk_unit_rows=qk_unit_rows)
        if ht is not None and opts.state_v_first:
            ht = ht.transpose(-1, -2).contiguous()
        return o, ht

    cu, cu_host = _offsets(cu_seqlens, cu_seqlens_cpu, q.device)
    cu_host = cu_host if q.device.type == "cuda" else None  # made once here for the forward and the backward
    output_final_state = bool(output_final_state)
    scale = None if scale is None else float(scale)
    tensors = [t for t in (q, k, v, g, beta, a, b, h0) if t is not None]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    fwd_method, bwd_method = _methods(variant, backend, q.device, needs_grad)
    # opts.use_qk_l2norm_in_kernel still set: preprocess normalised q and k above (Params::qk_unit_rows).
    o, ht = _library.chunk(q, k, v, g, beta, a, b, h0, cu, cu_host, variant, fwd_method, bwd_method, scale,
                           int(chunk_size), output_final_state, gate_bound, l2_in_kernel, kda_gate,
                           bool(opts.use_qk_l2norm_in_kernel))
    if not output_final_state:
        ht = None
    elif opts.state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    if opts.return_intermediate_states:
        h = _chunk_start_states(variant, q, k, v, g, beta, h0, cu, cu_host, fwd_method, scale, int(chunk_size))
        return o, ht, (h.transpose(-1, -2).contiguous() if opts.state_v_first else h)
    return o, ht


def _kda_gate_args(opts, v):
    """(A_log fp32 [HV], dt_bias fp32 [HV * K] or None, lower_bound or None) for the CUDA forward's kda gate, on v's
    device (fla_options.parse checked their sizes)."""
    A_log = opts.A_log.detach().to(device=v.device, dtype=torch.float32).reshape(-1).contiguous()
    dt_bias = None if opts.dt_bias is None else (
        opts.dt_bias.detach().to(device=v.device, dtype=torch.float32).reshape(-1).contiguous())
    return A_log, dt_bias, None if opts.lower_bound is None else float(opts.lower_bound)


def _chunk_start_states(variant, q, k, v, g, beta, h0, cu, cu_host, method, scale, chunk_size):
    """FLA's return_intermediate_states (inference mode only): the state at the start of every chunk,
    h [B, NT, HV, K, V] (varlen: [1, total chunks, HV, K, V], sequence by sequence), in q's dtype.

    Chunk c of every sequence is run as one packed varlen call from the states the previous call
    left: ceil(longest sequence / chunk_size) calls, a path for inference and checks, not for speed."""
    if not torch.compiler.is_compiling() and capturing(q.device):
        raise InvalidArgumentError(
            "deltacp: argument 'return_intermediate_states': not supported inside a CUDA graph capture (it runs "
            "one call per chunk with offsets built on the host, copied to the GPU with a synchronisation)")
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu is None:
        bounds = [(i * T, (i + 1) * T) for i in range(B)]
        flat = [x.reshape((1, B * T) + tuple(x.shape[2:])) for x in (q, k, v, g, beta)]
    else:
        host = (cu if cu_host is None else cu_host).tolist()
        bounds = list(zip(host[:-1], host[1:]))
        flat = [q, k, v, g, beta]
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    N = len(bounds)
    states = (torch.zeros((N, HV, K, V), dtype=state_dtype, device=q.device) if h0 is None else h0.clone())
    counts = [-(-(e - s) // chunk_size) for s, e in bounds]
    first = [sum(counts[:i]) for i in range(N)]
    h = torch.empty((sum(counts), HV, K, V), dtype=q.dtype, device=q.device)
    for c in range(max(counts, default=0)):
        active = [i for i in range(N) if counts[i] > c]
        pieces = [(bounds[i][0] + c * chunk_size, min(bounds[i][0] + (c + 1) * chunk_size, bounds[i][1]))
                  for i in active]
        idx = torch.tensor(active, device=q.device)
        h[torch.tensor([first[i] + c for i in active], device=q.device)] = states[idx].to(q.dtype)
        rows = torch.cat([torch.arange(s, e) for s, e in pieces]).to(q.device)
        offsets = torch.tensor([0] + [e - s for s, e in pieces]).cumsum(0)
        xs = [x.index_select(1, rows) for x in flat]
        ht = _library.chunk_fwd(*xs[:3], xs[3], xs[4], None, None, states[idx].contiguous(), offsets.to(q.device),
                                offsets, variant, method, method, scale, chunk_size, True, None)[1]
        states[idx] = ht
    return h.reshape((B if cu is None else 1, -1, HV, K, V))


def _flags(**named):
    for name, value in named.items():
        if not isinstance(value, bool):
            raise TypeError(f"deltacp: argument '{name}': expected a bool, got {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# the public ops (FLA's names and argument order)
# ---------------------------------------------------------------------------------------------
def chunk_gated_delta_rule(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                           state_v_first: bool = False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None, *,
                           use_gate_in_kernel: bool = False, A_log=None, dt_bias=None, chunk_size: int = 64,
                           backend: Optional[str] = None, **kwargs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated DeltaNet. q, k [B, T, H, K]; v [B, T, HV, V]; g (log decay) and beta [B, T, HV];
    initial_state [N, HV, K, V]. Returns (o [B, T, HV, V], final_state [N, HV, K, V] or None).

    FLA 0.5.2's arguments, positions and defaults; ``use_gate_in_kernel``, ``A_log``, ``dt_bias`` and
    ``chunk_size`` by keyword (FLA's ``**kwargs``), and deltacp's ``backend``. The options'
    meanings: deltacp/fla_options.py and docs/fla-compat.md. Unknown keywords raise TypeError."""
    q = _tensor(q, "q")
    v = _tensor(v, "v", q)
    _check_4d(q, v)
    opts = fla_options.parse("gdn", q, v, kwargs=kwargs, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                             state_v_first=state_v_first, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                             dt_bias=dt_bias)
    return _apply("gdn", q, k, v, g, beta, None, None, scale, initial_state, output_final_state, cu_seqlens,
                  backend, chunk_size, cp_context, cu_seqlens_cpu, opts)


def chunk_kda(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
              use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False, safe_gate: bool = False,
              lower_bound: Optional[float] = None, disable_recompute: bool = False,
              return_intermediate_states: bool = False, state_v_first: bool = False, cu_seqlens=None,
              cu_seqlens_cpu=None, cp_context=None, *, A_log=None, dt_bias=None, chunk_size: int = 64,
              backend: Optional[str] = None, **kwargs):
    """Kimi Delta Attention: like chunk_gated_delta_rule with g per key dim, [B, T, HV, K].

    FLA 0.5.2's arguments, positions and defaults; ``A_log``, ``dt_bias`` and ``chunk_size`` by
    keyword (FLA's ``**kwargs``), and deltacp's ``backend``. Returns (o, final_state or None), and
    with return_intermediate_states=True (inference mode) (o, final_state or None, h). The options'
    meanings (the lower-bound gate, safe_gate's checked range): deltacp/fla_options.py and
    docs/fla-compat.md. Unknown keywords raise TypeError."""
    q = _tensor(q, "q")
    v = _tensor(v, "v", q)
    _check_4d(q, v)
    opts = fla_options.parse("kda", q, v, kwargs=kwargs, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             use_gate_in_kernel=use_gate_in_kernel,
                             use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                             safe_gate=safe_gate, lower_bound=lower_bound, disable_recompute=disable_recompute,
                             return_intermediate_states=return_intermediate_states, state_v_first=state_v_first,
                             A_log=A_log, dt_bias=dt_bias)
    return _apply("kda", q, k, v, g, beta, None, None, scale, initial_state, output_final_state, cu_seqlens,
                  backend, chunk_size, cp_context, cu_seqlens_cpu, opts)


def _check_4d(q, v):
    if q.dim() != 4:
        raise InvalidArgumentError(f"deltacp: argument 'q': expected 4 dims [B, T, H, K], got shape {list(q.shape)}")
    if v.dim() != 4:
        raise InvalidArgumentError(f"deltacp: argument 'v': expected 4 dims [B, T, HV, V], got shape {list(v.shape)}")


def _l2norm_only(variant, use_qk_l2norm_in_kernel):
    _flags(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    opts = fla_options.FlaOptions(variant)
    opts.use_qk_l2norm_in_kernel = use_qk_l2norm_in_kernel
    return opts


def chunk_delta_rule(q, k, v, beta, scale: Optional[float] = None, initial_state=None,
                     output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, cu_seqlens=None,
                     cu_seqlens_cpu=None, cp_context=None, *, chunk_size: int = 64,
                     backend: Optional[str] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """DeltaNet (no gate): beta [B, T, HV]. FLA 0.5.2's positional order (use_qk_l2norm_in_kernel
    before cu_seqlens); chunk_size and deltacp's backend by keyword."""
    return _apply("delta", q, k, v, None, beta, None, None, scale, initial_state, output_final_state, cu_seqlens,
                  backend, chunk_size, cp_context, cu_seqlens_cpu, _l2norm_only("delta", use_qk_l2norm_in_kernel))


def chunk_dplr(q, k, v, a, b, gk, scale: Optional[float] = None, initial_state=None,
               output_final_state: bool = False, cu_seqlens=None, backend: Optional[str] = None, *,
               chunk_size: int = 64, cu_seqlens_cpu=None,
               cp_context=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """DPLR (RWKV-7 family): S <- diag(e^gk) S + k v^T + b (a^T S). a, b, gk [B, T, HV, K]."""
    return _apply("dplr", q, k, v, gk, None, a, b, scale, initial_state, output_final_state, cu_seqlens, backend,
                  chunk_size, cp_context, cu_seqlens_cpu, gate_name="gk")


chunk_dplr_delta_rule = chunk_dplr  # FLA's name
