"""deltacp.fla_options — the optional keyword arguments of FLA 0.5.2's ``chunk_gated_delta_rule`` and
``chunk_kda``: their checks, and their meaning as a pre-pass in torch before the delta-rule op.

FLA fuses these options into its Triton kernels. Here every option that changes the numbers is a
short torch expression applied to the inputs before ``deltacp::chunk_fwd`` (deltacp/_library.py), so
autograd gives their gradients (through the l2 norm, the sigmoid and the gate: dA_log, ddt_bias) and
torch.compile traces them. The fused CUDA tier may later take one over; its meaning is defined here
and its float64 ground truth is in deltacp.reference (``fla_forward`` / ``fla_backward``).

Option                      ops         meaning (FLA 0.5.2)
use_qk_l2norm_in_kernel     gdn, kda    q, k <- x / sqrt(sum(x^2) + 1e-6) over the last dim (float32 math)
use_beta_sigmoid_in_kernel  gdn, kda    beta <- sigmoid(beta)  (beta given as logits)
allow_neg_eigval            gdn, kda    beta <- 2 sigmoid(beta); needs use_beta_sigmoid_in_kernel
use_gate_in_kernel          gdn, kda    g is the raw gate input: g <- -exp(A_log) softplus(g + dt_bias)
  A_log, dt_bias                        A_log [HV]; dt_bias gdn [HV], kda [HV * K] or [HV, K] (optional)
lower_bound                 kda         with use_gate_in_kernel: g <- lower_bound sigmoid(exp(A_log) (g + dt_bias))
safe_gate                   kda         the caller promises lower_bound <= g <= 0 (see below)
state_v_first               gdn, kda    initial and final states (and h) in [N, HV, V, K] instead of [N, HV, K, V]
disable_recompute           kda         a memory / speed hint of FLA's backward: no effect on results here
return_intermediate_states  kda         inference mode only: also return h, the state at each chunk start
cu_seqlens_cpu              gdn, kda    a host copy of cu_seqlens (saves the device-to-host copy)
transpose_state_layout      gdn, kda    FLA's deprecated name of state_v_first (DeprecationWarning)

softplus is FLA's: x for x > 20, else log(1 + e^x) (torch.nn.functional.softplus's default threshold).

safe_gate. FLA's kernels use it to evaluate the intra-chunk decays in 16-token blocks relative to a
reference token, which is exact only while every per-token log decay is >= lower_bound (>= -5).
deltacp's kernels do not depend on that range, but a caller who sets safe_gate states it, and a
violated promise is reported instead of being computed on: with use_gate_in_kernel the lower-bound gate
lies in [lower_bound, 0] by construction; with a precomputed g the op checks lower_bound <= g <= 0 and
raises InvalidArgumentError naming 'g' otherwise (one min / max reduction; on CUDA the host waits for
its copy once the op's kernels are enqueued, which take any gate).
safe_gate needs lower_bound in [-5, 0) (FLA's range); with a precomputed g and no lower_bound the
promised range is FLA's floor, [-5, 0].

Arguments deltacp does not take raise TypeError naming them (FLA's ``**kwargs`` swallows unknown
names silently; deltacp does not), and values without an effect raise deltacp.InvalidArgumentError, a
ValueError (e.g. A_log without use_gate_in_kernel=True, lower_bound without use_gate_in_kernel or
safe_gate). Errors about values are InvalidArgumentError, about dtypes DTypeError (deltacp/errors.py).
"""

from __future__ import annotations

import numbers
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from . import _kda_gate, _l2norm
from .errors import DTypeError, InvalidArgumentError

__all__ = ["FlaOptions", "parse", "l2norm", "beta_activation", "gdn_gate", "kda_gate", "preprocess",
           "L2NORM_EPS", "SOFTPLUS_THRESHOLD", "SAFE_GATE_FLOOR"]

L2NORM_EPS = 1e-6          # FLA's l2norm_fwd default
SOFTPLUS_THRESHOLD = 20.0  # FLA's softplus: x above it
SAFE_GATE_FLOOR = -5.0     # FLA's safe range of lower_bound: [-5, 0)

# FLA 0.5.2's keyword arguments beyond the core ones, per op (its **kwargs ones included).
_OPTIONS = {
    "gdn": ("use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first",
            "use_gate_in_kernel", "A_log", "dt_bias"),
    "kda": ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
            "safe_gate", "lower_bound", "disable_recompute", "return_intermediate_states", "state_v_first",
            "A_log", "dt_bias"),
}
_OP_NAME = {"gdn": "chunk_gated_delta_rule", "kda": "chunk_kda"}


class FlaOptions:
    """The parsed options of one call (defaults: FLA's)."""

    __slots__ = ("variant", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias",
                 "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound", "disable_recompute",
                 "return_intermediate_states", "state_v_first")

    def __init__(self, variant: str):
        self.variant = variant
        self.use_qk_l2norm_in_kernel = False
        self.use_gate_in_kernel = False
        self.A_log = None
        self.dt_bias = None
        self.use_beta_sigmoid_in_kernel = False
        self.allow_neg_eigval = False
        self.safe_gate = False
        self.lower_bound = None
        self.disable_recompute = False
        self.return_intermediate_states = False
        self.state_v_first = False

    def copy(self, **changes) -> "FlaOptions":
        """These options with some fields replaced."""
        out = FlaOptions(self.variant)
        for name in self.__slots__:
            setattr(out, name, changes.pop(name, getattr(self, name)))
        if changes:
            raise TypeError(f"deltacp: FlaOptions has no field {sorted(changes)[0]!r}")
        return out

    def gate_check_bound(self) -> Optional[float]:
        """The lower bound the op must check a precomputed g against (safe_gate), else None."""
        if not self.safe_gate or self.use_gate_in_kernel:
            return None
        return SAFE_GATE_FLOOR if self.lower_bound is None else float(self.lower_bound)


def _flag(name, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"deltacp: argument '{name}': expected a bool, got {type(value).__name__}")
    return value


def _take_deprecated(kwargs: dict, state_v_first: bool) -> bool:
    """FLA's deprecated spellings in **kwargs: transpose_state_layout (-> state_v_first), head_first."""
    if "head_first" in kwargs:
        raise TypeError("deltacp: argument 'head_first': not supported (FLA removed it too); inputs are "
                        "[B, T, H, ...]")
    if "transpose_state_layout" in kwargs:
        old = _flag("transpose_state_layout", kwargs.pop("transpose_state_layout"))
        if state_v_first:
            raise InvalidArgumentError(
                "deltacp: argument 'transpose_state_layout': given beside state_v_first=True; pass "
                "only state_v_first (transpose_state_layout is its deprecated name)")
        warnings.warn("deltacp: 'transpose_state_layout' is deprecated (as in FLA); use 'state_v_first'",
                      DeprecationWarning, stacklevel=4)
        return old
    return state_v_first


def _reject_unknown(variant: str, kwargs: dict) -> None:
    other = "kda" if variant == "gdn" else "gdn"
    for name in kwargs:
        where = ""
        if name in _OPTIONS[other]:
            where = (f" (FLA 0.5.2 has it on {_OP_NAME[other]} only; its {_OP_NAME[variant]} would ignore it, "
                     f"deltacp refuses it)")
        raise TypeError(f"deltacp: argument '{name}': {_OP_NAME[variant]}() takes no such keyword argument{where}")


def _param(name, t, q, numel_options, shape_text):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"deltacp: argument '{name}': expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise DTypeError(f"deltacp: argument '{name}': expected a floating dtype, got {t.dtype}")
    if t.device != q.device:
        raise InvalidArgumentError(f"deltacp: argument '{name}': expected device {q.device} (like q), got {t.device}")
    if t.numel() not in numel_options:
        raise InvalidArgumentError(f"deltacp: argument '{name}': expected shape {shape_text}, got {list(t.shape)}")
    return t


def parse(variant: str, q, v, *, kwargs: dict, **given) -> FlaOptions:
    """Checks the options of one call of the gdn / kda op and returns them. q, v: the checked 4-D
    inputs; ``given``: the named parameters of the public op (FLA's keywords); ``kwargs``: anything
    else the caller passed."""
    opts = FlaOptions(variant)
    kwargs = dict(kwargs)
    given["state_v_first"] = _take_deprecated(kwargs, _flag("state_v_first", given["state_v_first"]))
    _reject_unknown(variant, kwargs)
    for name in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                 "safe_gate", "disable_recompute", "return_intermediate_states", "state_v_first"):
        if name in given:
            setattr(opts, name, _flag(name, given[name]))
    if opts.allow_neg_eigval and not opts.use_beta_sigmoid_in_kernel:
        raise InvalidArgumentError("deltacp: argument 'allow_neg_eigval': True needs use_beta_sigmoid_in_kernel=True "
                                   "(beta = 2 sigmoid(beta_logits)), as in FLA")

    A_log, dt_bias = given.get("A_log"), given.get("dt_bias")
    HV, K = v.shape[2], q.shape[3]  # q, v: checked 4-D tensors
    if opts.use_gate_in_kernel:
        if A_log is None:
            raise InvalidArgumentError("deltacp: argument 'A_log': is required with use_gate_in_kernel=True")
        opts.A_log = _param("A_log", A_log, q, (HV,), f"[HV] = [{HV}]")
        if dt_bias is not None:
            if variant == "gdn":
                opts.dt_bias = _param("dt_bias", dt_bias, q, (HV,), f"[HV] = [{HV}]")
            else:
                opts.dt_bias = _param("dt_bias", dt_bias, q, (HV * K,), f"[HV * K] = [{HV * K}] or [HV, K]")
    else:
        for name, value in (("A_log", A_log), ("dt_bias", dt_bias)):
            if value is not None:
                raise InvalidArgumentError(
                    f"deltacp: argument '{name}': given without use_gate_in_kernel=True, where it "
                    f"has no effect (g is then the log decay itself)")

    lower_bound = given.get("lower_bound")
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real):
            raise TypeError(f"deltacp: argument 'lower_bound': expected a float or None, got "
                            f"{type(lower_bound).__name__}")
        lower_bound = float(lower_bound)
        if not (lower_bound == lower_bound and abs(lower_bound) != float("inf")):
            raise InvalidArgumentError(f"deltacp: argument 'lower_bound': expected a finite number, got {lower_bound}")
        if not (opts.use_gate_in_kernel or opts.safe_gate):
            raise InvalidArgumentError(
                "deltacp: argument 'lower_bound': has an effect only with use_gate_in_kernel=True (the "
                "lower-bound gate) or safe_gate=True (the promised gate range)")
        opts.lower_bound = lower_bound
    if opts.safe_gate:
        if opts.use_gate_in_kernel and lower_bound is None:
            raise InvalidArgumentError("deltacp: argument 'lower_bound': is required with safe_gate=True and "
                                       "use_gate_in_kernel=True, as in FLA")
        if lower_bound is not None and not (SAFE_GATE_FLOOR <= lower_bound < 0):
            raise InvalidArgumentError(
                f"deltacp: argument 'lower_bound': with safe_gate=True expected a value in the safe "
                f"range [-5, 0), got {lower_bound}")
    if opts.return_intermediate_states:
        if not torch.is_inference_mode_enabled():
            raise InvalidArgumentError(
                "deltacp: argument 'return_intermediate_states': only in torch.inference_mode() (the "
                "states bypass autograd), as in FLA")
        if opts.disable_recompute:
            raise InvalidArgumentError(
                "deltacp: argument 'return_intermediate_states': needs disable_recompute=False, as in "
                "FLA")
    return opts


# ---------------------------------------------------------------------------------------------
# the pre-pass (torch; autograd gives the gradients)
# ---------------------------------------------------------------------------------------------
def _math_dtype(*ts):
    """float64 when any input is float64, else float32 (FLA computes these options in float32)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def l2norm(x, eps: float = L2NORM_EPS):
    """x / sqrt(sum(x^2) + eps) along the last dim, in float32 or better, returned in x's dtype."""
    if _l2norm.applies(x):  # CUDA: one pass each way (deltacp/_l2norm.py), the same float32 math
        return _l2norm.l2norm_rows(x, eps)
    xf = x.to(_math_dtype(x))
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def beta_activation(beta, allow_neg_eigval: bool = False):
    """sigmoid(beta) (2 sigmoid(beta) with allow_neg_eigval), in float32 or better, in beta's dtype."""
    b = torch.sigmoid(beta.to(_math_dtype(beta)))
    return (2.0 * b if allow_neg_eigval else b).to(beta.dtype)


def gdn_gate(g, A_log, dt_bias=None, out_dtype=None):
    """-exp(A_log) softplus(g + dt_bias): g [B, T, HV]; A_log, dt_bias [HV]."""
    dtype = _math_dtype(g, A_log, dt_bias)
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(-1)
    y = -torch.exp(A_log.to(dtype).reshape(-1)) * F.softplus(x, beta=1.0, threshold=SOFTPLUS_THRESHOLD)
    return y if out_dtype is None else y.to(out_dtype)


def kda_gate(g, A_log, dt_bias=None, lower_bound: Optional[float] = None, out_dtype=None):
    """g [B, T, HV, K]; A_log [HV]; dt_bias [HV * K] (or [HV, K]). Without lower_bound
    -exp(A_log) softplus(g + dt_bias); with it lower_bound sigmoid(exp(A_log) (g + dt_bias))."""
    HV, K = g.shape[-2], g.shape[-1]
    dtype = _math_dtype(g, A_log, dt_bias)
    if (dtype == torch.float32 and out_dtype in (None, torch.float32) and (lower_bound is None or lower_bound < 0)
            and _kda_gate.applies(g, A_log, dt_bias)):  # the kernels' two forms: a negative bound, or none
        return _kda_gate.kda_gate_rows(g, A_log, dt_bias, lower_bound)  # CUDA: one pass each way, fp32 math
    x = g.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(HV, K)
    a = torch.exp(A_log.to(dtype).reshape(HV, 1))
    if lower_bound is None:
        y = -a * F.softplus(x, beta=1.0, threshold=SOFTPLUS_THRESHOLD)
    else:
        y = float(lower_bound) * torch.sigmoid(a * x)
    return y if out_dtype is None else y.to(out_dtype)


def preprocess(opts: FlaOptions, q, k, g, beta):
    """(q, k, g, beta) as the delta-rule op takes them (l2-normalised, log decay, beta in [0, 1) or [0, 2))."""
    if opts.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if opts.use_beta_sigmoid_in_kernel:
        beta = beta_activation(beta, opts.allow_neg_eigval)
    if opts.use_gate_in_kernel:
        # The log decay in float32 (float64 for float64 q), the dtype the op accepts beside 16-bit q.
        out = torch.float64 if q.dtype == torch.float64 else torch.float32
        if opts.variant == "gdn":
            g = gdn_gate(g, opts.A_log, opts.dt_bias, out_dtype=out)
        else:
            g = kda_gate(g, opts.A_log, opts.dt_bias, opts.lower_bound, out_dtype=out)
    return q, k, g, beta
