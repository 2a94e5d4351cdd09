"""deltacp.cp.ops — context-parallel forward and backward with autograd (docs/design.md section 4).

Each rank holds its slice of a packed batch (see context.py) and calls, with rank-local tensors,

    o, ht = chunk_gated_delta_rule_cp(q, k, v, g, beta, cp_context=ctx, initial_state=h0,
                                      output_final_state=True)

Forward, on every rank r (the same algorithm as the simulated CP of reference/src/batch.cpp):

  1. pre-pass: over the rank's LAST local segment, when it continues on a later rank, the state map
     S_end = M_r S_start + H_r. [H | M] evolves exactly like a state with V + K columns: run the
     segment with values [v | 0] from the initial state [h0 or 0 | I]; the final state is [H_r | M_r]
     (H_r includes the sequence's initial state when the sequence starts on this rank). fp32 (fp64
     for fp64 inputs).
  2. one all-gather of the [HV, K, V + K] buffers;
  3. merge: the initial state of the FIRST local segment, when it continues a sequence from earlier
     ranks, is S = 0 folded through the earlier ranks j = r - pre_ranks .. r - 1: S <- M_j S + H_j;
  4. the local chunked kernel over all local segments (the reference on the CPU, the fastest CUDA
     tier on GPUs) from those initial states. When the first segment continues a sequence mid-chunk,
     its tokens up to the one-device chunk boundary run first as a separate piece (_grid_pad), so
     the rest is chunked exactly as on one device (the same 16-bit rounding, tile for tile).

Backward mirrored: over the FIRST local segment (when it continues from earlier ranks) dS_start =
M_r^T dS_end + dH_r, computed as one backward of the [v | 0] problem with upstream [do | 0] and
dL/dS_end = [dht or 0 | I]: its dL/dh0 is [dH_r | M_r^T]. (When the forward saved that segment's
per-piece transitions, only dH is computed, over the V real columns, and composed with them; see
"In pieces" below.) All-gather, fold from the later ranks
dS <- M_j^T dS + dH_j (j = r + post_ranks down to r + 1), and run the local backward with that as the
last segment's dL/dS_end. Only one merged initial state is kept for the backward: the rest of the
local initial states are rebuilt from the user's initial_state.

Why the augmented run is exact: every update of the state is affine in S with coefficients that do
not depend on S (S <- P_t S + B_t with P_t, B_t built from k, g, beta, a, b and v), so for the
V + K columns of X = [S | Y] with values [v | 0]: the first V columns follow the real recurrence and
the last K follow Y <- P_t Y (no value term). From Y_0 = I they hold the product M = P_n ... P_1, and
from S_0 = start the first V columns end at M start + H. The backward is the transpose: from
dS_end = [dend | I] the gradient reaching the span start is [M^T dend + dH | M^T].

In pieces (_piece_bounds, _fold_maps): a span is cut into pieces of whole one-device chunks that run
side by side as one varlen call (a long single sequence otherwise walks its chunks one by one on a few
SMs); the pieces' affine maps are composed in fp32 by a log-depth tree. The CP forward also keeps the
first segment's per-piece transitions M_p for the backward pre-pass (_prepass_forward).

How the pre-pass runs (the state-only modes of deltacp::Params, params.h): the forward is a
final-state-only forward (no "o": only ht = [H | M] is written) and the backward a dh0-only backward
(no input gradients: only dh0 = [dH | M^T] is written), both through the normal chunked kernels:

  * CPU tensors: the chunked Eigen reference;
  * CUDA tensors, variants whose chosen tier is "tiled" (gdn, kda, delta) and V + K <= 256 (the
    tiled tier's widest value tile): the tiled tier itself (tensor cores; fp32 state, operands in
    the input dtype exactly like the local kernel). A tiled launch that does not fit the GPU's
    shared memory (fp32 inputs with V + K near 256) falls back to the loop kernels once and is
    remembered for that shape;
  * dplr with backend="tiled": on each rank whose inputs the tiled DPLR tier takes (local._dplr_tiers:
    gates in the chunk form's range, K <= 128, its shared memory on this GPU), that tier for the local
    pass and the pre-pass alike, at any V + K (its scans run the state in 32-column blocks): [H | M] is
    its final-state-only forward of [v | 0] from [start | I] (cuda/tiled/dplr_fwd.cu says why that is the
    chunks' transitions D_n + Bd^T W on the tensor cores), [dH | M^T] its dh0-only backward; the other
    ranks run the naive tier and the loop kernels below (the ranks exchange the same fp32 maps either way);
  * otherwise (the naive tier, V + K > 256): the fp32 loop kernels of deltacp._cp_nccl
    (distributed/src/cp_kernels.cu, exact fp32), or the chunked CUDA tier when that module is absent.

DELTACP_CP_PREPASS=auto (default) | chunked | loops overrides the CUDA choice (loops needs
deltacp._cp_nccl). float32 g (the log decay) beside bf16/fp16 q, k, v is accepted as in the
single-device ops, on every path.

States: ``initial_state`` [N, HV, K, V] (N = number of GLOBAL sequences, the same tensor on every
rank); row n is read by the rank holding sequence n's first token. The returned final state is
[N, HV, K, V] with the rows of the sequences ENDING on this rank filled and zeros elsewhere (sum over
the ranks for the full tensor). The gradient of initial_state likewise holds the rows of the sequences
STARTING on this rank. The all-gathers run on the context's group (gloo for CPU tensors) or on
deltacp's own NCCL communicator (CUDA tensors) with a timeout: a stalled or dead rank makes every
other rank raise instead of hanging.

Where the pieces live (imports run one way, each module from those below it):
  context.py   the plan of the rank (CPContext, build_context), agreement, timeouts
  local.py     the rank's local pass: state-only runs, pieces, the staged tiled stages, the chunk grid
  exchange.py  the pre-pass, the all-gather, the merges
  autograd.py  the CP forward, and the CP op as a torch.autograd.Function (forward and mirrored backward)
  plan.py      what a call computes once per problem (checks, configuration, routing), kept per context
  ops.py       this module: argument checks and the public ops
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import _core
from .._calls import check_inputs
from ..errors import InvalidArgumentError
from ..fla_options import l2norm as _l2norm
from .context import CPContext, agree
from . import plan as _plan
from .autograd import _CPFunction, _cp_forward
from .exchange import exchange_bytes, last_stats
from .local import _Cfg, _dplr_tiers

__all__ = ["chunk_gated_delta_rule_cp", "chunk_kda_cp", "chunk_delta_rule_cp", "chunk_dplr_cp", "cp_apply",
           "exchange_bytes", "last_stats"]

_CUDA_TIERS = ("fused", "tiled", "naive")


# ---------------------------------------------------------------------------------------------
# argument checks and the public ops
# ---------------------------------------------------------------------------------------------
def _methods(variant: str, backend, device, needs_grad) -> Tuple[str, str]:
    if device.type == "cpu":
        if backend not in (None, "reference"):
            raise InvalidArgumentError(f"deltacp: argument 'backend': context parallelism on CPU tensors runs the chunked "
                             f"reference; expected None or 'reference', got {backend!r}")
        return "chunked", "chunked"
    if device.type != "cuda":
        raise InvalidArgumentError(f"deltacp: argument 'q': expected a CPU or CUDA tensor, got device {device}")
    if not _core.built_with_cuda():
        raise InvalidArgumentError("deltacp: argument 'q': got CUDA tensors, but this deltacp was built without the CUDA tiers")
    tiers = _CUDA_TIERS if backend is None else (backend,)
    if backend is not None and backend not in _CUDA_TIERS:
        raise InvalidArgumentError(f"deltacp: argument 'backend': expected None or one of {_CUDA_TIERS} for CUDA tensors, "
                         f"got {backend!r}")
    if variant == "dplr" and backend == "tiled":
        # The tiled DPLR tier runs when named (opt-in, as in deltacp.dplr), which cuda_supports() does not list
        # until it is the CUDA default; each rank then checks that it takes its inputs (local._dplr_tiers).
        return "tiled", "tiled"
    fwd = next((t for t in tiers if _core.cuda_supports(variant, t, False)), None)
    bwd = next((t for t in tiers if _core.cuda_supports(variant, t, True)), None)
    if fwd is None:
        raise InvalidArgumentError(f"deltacp: argument 'backend': no CUDA tier among {tiers} implements variant '{variant}'")
    if needs_grad and bwd is None:
        raise InvalidArgumentError(f"deltacp: argument 'backend': no CUDA tier among {tiers} implements the backward of "
                         f"variant '{variant}'")
    return fwd, bwd or fwd


def _l2norm_in_kernel(cfg: _Cfg, q, k) -> bool:
    """use_qk_l2norm_in_kernel inside the local kernels (Params::qk_l2norm): where no gradient is wanted and the
    local forward is fused, as on one device (deltacp.ops). The staged fused forward folds the row scales into its
    products and its pieces' maps; a route without stages normalises in the dispatch (cuda/dispatch.cu
    run_forward_on_normalised) or, for the fp32 loop kernels, in one pass (exchange._prepass_forward_last). With a
    gradient the normalised q and k are the backward's inputs: one pass here, differentiated. On 2 x H200 at 32768
    tokens per rank (H = 16) that pass took 0.22 ms of the GDN CP forward's GPU time (docs/context-parallel.md)."""
    return (not cfg.needs_grad and cfg.device.type == "cuda" and cfg.fwd_method == "fused" and q.shape[-1] <= 256
            and q.dtype in (torch.bfloat16, torch.float16) and q.is_contiguous() and k.is_contiguous())


def cp_apply(variant, q, k, v, g, beta, a, b, *, cp_context: CPContext, scale=None, initial_state=None,
             output_final_state=False, chunk_size=64, backend=None, use_qk_l2norm_in_kernel=False,
             gate_name="g", cu_seqlens=None, gate_check=True, gate_range_check=None, qk_unit_rows=False):
    """The CP op for any variant (the public functions below fix the variant and argument names).
    gate_check (dplr): each rank checks its gates against the chunk form's range before a chunked method runs
    them (False: the caller vouches for them; local._dplr_tiers). gate_range_check: safe_gate's started check
    of the gate (deltacp._library.start_gate_range_check, from deltacp.ops), whose outcome joins the ranks'
    agreement, so that a broken promise on one rank makes every rank raise before the exchange.
    use_qk_l2norm_in_kernel: q and k l2-normalised here, inside the local fused kernels where no gradient is wanted
    (_l2norm_in_kernel; last_stats["qk_l2norm"] says how). qk_unit_rows: q and k were l2-normalised by the caller
    (Params::qk_unit_rows: the kernels' wider bound for kda's diagonal score blocks)."""
    ctx = cp_context
    if not isinstance(ctx, CPContext):
        raise TypeError(f"deltacp: argument 'cp_context': expected a deltacp.cp.CPContext (from "
                        f"deltacp.cp.build_context), got {type(ctx).__name__}")
    # A problem seen before (the same signature, options and DELTACP_* environment) was validated then, and
    # its configuration and routing were kept (deltacp/cp/plan.py): a hit skips straight to the per-call work.
    key = _plan.key(variant, q, k, v, g, beta, a, b, initial_state, scale, output_final_state, chunk_size, backend,
                    use_qk_l2norm_in_kernel, gate_name, gate_check, gate_range_check, cu_seqlens)
    plan = _plan.lookup(ctx, key)
    if plan is None:
        plan = _new_plan(ctx, variant, q, k, v, g, beta, a, b, scale, initial_state, output_final_state, chunk_size,
                         backend, use_qk_l2norm_in_kernel, gate_name, cu_seqlens, gate_range_check)
        _plan.store(ctx, key, plan)
    cfg = plan.cfg(ctx, gate_range_check)
    cfg.qk_l2norm = bool(use_qk_l2norm_in_kernel) and _l2norm_in_kernel(cfg, q, k)
    if use_qk_l2norm_in_kernel and not cfg.qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    last_stats["qk_l2norm"] = None if not use_qk_l2norm_in_kernel else "in kernel" if cfg.qk_l2norm else "one pass"
    cfg.qk_unit_rows = bool(use_qk_l2norm_in_kernel or qk_unit_rows)
    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(cfg.state_dtype).contiguous()
    if variant == "dplr":  # per call: the rank's tier depends on its gates' values
        _dplr_tiers(cfg, q, k, v, g, a, b, bool(gate_check))
    last_stats["local_tier"] = {"forward": cfg.fwd_method, "backward": cfg.bwd_method, "why": cfg.tier_why}
    if cfg.needs_grad:
        o, ht = _CPFunction.apply(cfg, q, k, v, g, beta, a, b, h0)
    else:  # no backward can follow: no autograd node (the Function's forward runs without grad mode, so here too)
        with torch.no_grad():
            o, ht, _, _ = _cp_forward(cfg, q, k, v, g, beta, a, b, h0)
    return o, (ht if cfg.output_final_state else None)


def _new_plan(ctx, variant, q, k, v, g, beta, a, b, scale, initial_state, output_final_state, chunk_size, backend,
              use_qk_l2norm_in_kernel, gate_name, cu_seqlens, gate_range_check) -> _plan.Plan:
    """cp_apply's checks of a problem not seen before (raising as they find an error) and its plan."""
    if cu_seqlens is not None:
        raise InvalidArgumentError("deltacp: argument 'cu_seqlens': do not pass cu_seqlens with cp_context; the rank-local "
                         "offsets come from the context (build_context takes the global ones)")
    q, k, v, g, beta, a, b = check_inputs(q, k, v, g, beta, a, b, gate_name, scale, chunk_size)

    # Local checks first, then one fingerprint all-reduce so that every rank raises together.
    local_errors = {}
    if q.dim() != 4 or q.shape[0] != 1 or q.shape[1] != ctx.local_tokens:
        local_errors["q"] = (f"deltacp: argument 'q': expected this rank's slice [1, {ctx.local_tokens}, H, K] "
                             f"(rank {ctx.rank} holds global tokens [{ctx.begin}, {ctx.end})), got shape "
                             f"{list(q.shape)}")
    if v.dim() != 4:
        local_errors["v"] = f"deltacp: argument 'v': expected 4 dims [1, T_local, HV, V], got shape {list(v.shape)}"
    if q.device.type == "cuda" and ctx.device.type == "cuda" and q.device != ctx.device:
        local_errors["q"] = (f"deltacp: argument 'q': expected device {ctx.device} (the context's), got "
                             f"{q.device}")
    N = ctx.num_seqs
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"deltacp: argument 'initial_state': expected a torch.Tensor, got "
                            f"{type(initial_state).__name__}")
        if initial_state.device != q.device:
            local_errors["initial_state"] = (f"deltacp: argument 'initial_state': expected device {q.device} "
                                             f"(like q), got {initial_state.device}")
        elif q.dim() == 4 and v.dim() == 4 and tuple(initial_state.shape) != (N, v.shape[2], q.shape[3],
                                                                            v.shape[3]):
            local_errors["initial_state"] = (f"deltacp: argument 'initial_state': expected [N, HV, K, V] = "
                                             f"{[N, v.shape[2], q.shape[3], v.shape[3]]} (N = the number of "
                                             f"GLOBAL sequences), got {list(initial_state.shape)}")
    fields = {
        "q": ("ok" if "q" not in local_errors else "bad", str(q.dtype), tuple(q.shape[2:]) if q.dim() == 4 else ()),
        "v": ("ok" if "v" not in local_errors else "bad", tuple(v.shape[2:]) if v.dim() == 4 else ()),
        gate_name: None if g is None else str(g.dtype),  # float32 or q's dtype, the same on every rank
        "variant": variant,
        "chunk_size": int(chunk_size),
        "scale": None if scale is None else float(scale),
        "initial_state": (initial_state is not None, "initial_state" in local_errors),
        "output_final_state": bool(output_final_state),
        "cu_seqlens": ctx.fingerprint,
        "backend": backend,
        "use_qk_l2norm_in_kernel": bool(use_qk_l2norm_in_kernel),
    }
    if local_errors:  # agree now, so that every rank raises together (naming this rank's problem here)
        try:
            agree(fields, ctx.group, ctx.rank, ctx.timeout, f"the CP {variant} forward", ctx=ctx)
        except ValueError as exc:
            name = str(exc).split("'")[1]
            if name in local_errors:
                raise InvalidArgumentError(local_errors[name]) from exc
            raise
        raise InvalidArgumentError(next(iter(local_errors.values())))
    # The fingerprint check itself is started by the forward once its local work that needs no exchange is
    # enqueued (_start_check), finished before the first exchange (_finish_check): the check overlaps that
    # work and the pre-pass.

    cfg = _Cfg()
    cfg.variant = variant
    cfg.gate_name = gate_name
    cfg.scale = None if scale is None else float(scale)
    cfg.chunk_size = int(chunk_size)
    cfg.output_final_state = bool(output_final_state)
    cfg.compute = "float64" if q.dtype == torch.float64 else "float32"
    cfg.state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    cfg.device = q.device
    cfg.H, cfg.K = q.shape[2], q.shape[3]
    cfg.HV, cfg.V = v.shape[2], v.shape[3]
    cfg.num_seqs = N
    cfg.has_h0 = initial_state is not None
    cfg.check_fields = _plan.fingerprint(fields, gate_name, gate_range_check is not None)
    # (the l2 norm, when asked for, and initial_state's conversion keep requires_grad: decided from the inputs)
    tensors = [t for t in (q, k, v, g, beta, a, b, initial_state) if t is not None]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    cfg.needs_grad = needs_grad  # the autograd Function's forward runs without grad mode: decided here
    cfg.fwd_method, cfg.bwd_method = _methods(variant, backend, q.device, needs_grad)
    cfg.fwd_named = backend is not None  # else a fused forward the rank's problem refuses falls back (autograd)
    if q.device.type == "cpu":
        cfg.tier_why = "the chunked reference (CPU tensors)"
    elif backend is None:
        cfg.tier_why = f"the first CUDA tier among {_CUDA_TIERS} that implements {variant}"
    else:
        cfg.tier_why = f"backend={backend!r}"
    return _plan.Plan(cfg)


def chunk_gated_delta_rule_cp(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                              output_final_state: bool = False, cu_seqlens=None, backend: Optional[str] = None, *,
                              cp_context: CPContext, chunk_size: int = 64, use_qk_l2norm_in_kernel: bool = False):
    """Gated DeltaNet under context parallelism: rank-local q, k [1, T_local, H, K], v [1, T_local, HV, V],
    g, beta [1, T_local, HV]; initial_state [N, HV, K, V] over the GLOBAL sequences. Returns (o_local,
    final_state [N, HV, K, V] with this rank's rows, or None)."""
    return cp_apply("gdn", q, k, v, g, beta, None, None, cp_context=cp_context, scale=scale,
                    initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size,
                    backend=backend, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def chunk_kda_cp(q, k, v, g, beta, scale: Optional[float] = None, initial_state=None,
                 output_final_state: bool = False, cu_seqlens=None, backend: Optional[str] = None, *,
                 cp_context: CPContext, chunk_size: int = 64, use_qk_l2norm_in_kernel: bool = False):
    """Kimi Delta Attention under context parallelism (g per key dim, [1, T_local, HV, K])."""
    return cp_apply("kda", q, k, v, g, beta, None, None, cp_context=cp_context, scale=scale,
                    initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size,
                    backend=backend, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def chunk_delta_rule_cp(q, k, v, beta, scale: Optional[float] = None, initial_state=None,
                        output_final_state: bool = False, cu_seqlens=None, backend: Optional[str] = None, *,
                        cp_context: CPContext, chunk_size: int = 64, use_qk_l2norm_in_kernel: bool = False):
    """DeltaNet (no gate) under context parallelism."""
    return cp_apply("delta", q, k, v, None, beta, None, None, cp_context=cp_context, scale=scale,
                    initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size,
                    backend=backend, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def chunk_dplr_cp(q, k, v, a, b, gk, scale: Optional[float] = None, initial_state=None,
                  output_final_state: bool = False, cu_seqlens=None, backend: Optional[str] = None, *,
                  cp_context: CPContext, chunk_size: int = 64, gate_check: bool = True):
    """DPLR (RWKV-7 family) under context parallelism: S <- diag(e^gk) S + k v^T + b (a^T S).

    backend="tiled" (CUDA): the tiled DPLR tier for the local pass and the pre-pass on every rank whose gates
    lie in deltacp.dplr.gate_range(chunk_size) and whose inputs the tier takes, the naive tier on the others
    (deltacp.cp.last_stats["local_tier"] says which and why); gate_check=False skips the gates' check (the
    caller's guarantee, as deltacp.chunk_dplr_delta_rule's lower_bound). None: the naive tier (the CUDA
    default, as in the single-device op)."""
    if not isinstance(gate_check, bool):
        raise TypeError(f"deltacp: argument 'gate_check': expected a bool, got {type(gate_check).__name__}")
    return cp_apply("dplr", q, k, v, gk, None, a, b, cp_context=cp_context, scale=scale,
                    initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size,
                    backend=backend, gate_name="gk", cu_seqlens=cu_seqlens, gate_check=gate_check)
