"""deltacp.cp.context — how one rank of a context-parallel (CP) group sees a packed batch.

A packed batch (B = 1) of N sequences with global offsets ``cu_seqlens = [0, t1, ..., T]`` is cut
into ``world`` equal, contiguous slices; rank r holds the global tokens [r T / world, (r + 1) T / world)
(docs/design.md section 4, reference/include/deltacp/cp_plan.h). A sequence cut by a rank boundary
continues on the next rank, so only two local segments can be shared with other ranks:

    the FIRST local segment may continue a sequence begun on the ``pre_ranks`` ranks before;
    the LAST local segment may continue into the ``post_ranks`` ranks after.

T not divisible by the world size is REJECTED (ValueError naming ``cu_seqlens``, with T and the world
size): every rank then holds the same number of tokens, as in torch's and FLA's CP, and the collective
buffers have one shape. Pad the packed batch (for instance with a short dummy sequence) to a multiple.

Ownership of per-sequence states (the rule that makes ``initial_state`` / ``output_final_state`` work
in CP, which FLA refuses): row n of ``initial_state`` is READ by the rank holding sequence n's first
token, row n of the final state is WRITTEN by the rank holding its last token (other ranks' rows are
zero); gradients follow the same rule, so summing a state gradient over the ranks gives the full one.
An empty sequence belongs to the rank that holds its offset (the last rank when the offset is T).

Before anything is exchanged the ranks compare fingerprints of what must agree (a small all-reduce of
hashes): a mismatch raises the same ValueError on every rank, naming the argument that differs.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _core
from ..errors import CPTimeoutError, DTypeError, InvalidArgumentError

__all__ = ["CPContext", "build_context", "DEFAULT_TIMEOUT_S", "CPTimeoutError", "agree", "wait_collective"]

# Seconds a collective may take before every rank gives up with a clear error (DELTACP_CP_TIMEOUT).
DEFAULT_TIMEOUT_S = float(os.environ.get("DELTACP_CP_TIMEOUT", "300"))


@dataclass(frozen=True)
class CPContext:
    """One rank's view of a packed batch cut across the CP group (see the module docstring)."""

    rank: int
    world: int
    group: object  # torch.distributed ProcessGroup (None = the default group)
    backend: str  # the group's backend ("gloo", "nccl", ...)
    device: torch.device  # where the local cu_seqlens live (the tensors' device)
    cu_seqlens_global: torch.Tensor  # int64 [N + 1], CPU
    cu_seqlens_global_list: List[int]
    begin: int  # this rank's global token range [begin, end)
    end: int
    cu_seqlens: torch.Tensor  # rank-local offsets, int64, on `device`
    cu_seqlens_cpu: torch.Tensor  # the same on the CPU
    cu_seqlens_list: List[int]
    seq_ids: List[int]  # global sequence index of each local segment
    pre_ranks: int  # earlier ranks holding part of the first local segment's sequence
    post_ranks: int  # later ranks holding part of the last local segment's sequence
    starts_here: List[bool]  # local segment i holds its sequence's first token
    ends_here: List[bool]  # local segment i holds its sequence's last token
    empty_seqs: List[int]  # empty sequences owned by this rank (their final state is their initial state)
    fingerprint: int  # hash of the global cu_seqlens and the world size (equal on every rank)
    timeout: float  # seconds a collective may take before CPTimeoutError
    # Some rank's span lies strictly inside one sequence (its only segment continues from an earlier
    # rank and on to a later one), so merges read transitions M (forward) and M^T (backward). When
    # False every merge folds at most one rank's buffer, whose transition multiplies a zero state:
    # the exchange then carries H (dH) alone, [HV, K, V] instead of [HV, K, V + K] per rank.
    maps_read: bool
    nccl: Optional[object] = field(default=None, compare=False)  # deltacp._cp_nccl.Communicator, if any
    # Width W of the causal short convolution (deltacp.causal_conv1d) run with this context: each rank
    # takes the W - 1 tokens before its first one from earlier ranks (deltacp/cp/conv1d.py).
    conv1d_kernel_size: Optional[int] = None
    # The CP op's per-problem plans (deltacp/cp/plan.py): an LRU keyed on the call's signature and environment.
    plans: OrderedDict = field(default_factory=OrderedDict, init=False, compare=False, repr=False)

    @property
    def first_continues(self) -> bool:
        """The first local segment continues a sequence begun on an earlier rank."""
        return self.pre_ranks > 0

    @property
    def last_continues(self) -> bool:
        """The last local segment continues on a later rank."""
        return self.post_ranks > 0

    @property
    def num_local_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def local_tokens(self) -> int:
        return self.end - self.begin

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens_global_list) - 1

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world}: tokens [{self.begin}, {self.end}), local cu_seqlens "
                f"{self.cu_seqlens_list}, sequences {self.seq_ids}, pre_ranks {self.pre_ranks}, "
                f"post_ranks {self.post_ranks}, maps read {self.maps_read}")


# ---------------------------------------------------------------------------------------------
# small collective helpers shared with ops.py
# ---------------------------------------------------------------------------------------------
def _collective_device(group) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wait_collective(work, what: str, rank: int, timeout: float) -> None:
    """Waits for an async collective; a stall or a dead peer becomes CPTimeoutError / RuntimeError
    naming the collective, the rank and the timeout, instead of a hang."""
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError with its own text
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise CPTimeoutError(f"deltacp: context parallelism: {what} on rank {rank} did not complete within "
                                 f"{timeout:g} s (another rank stalled, exited or called a different collective); "
                                 f"underlying error: {text.strip()}") from exc
        raise RuntimeError(f"deltacp: context parallelism: {what} on rank {rank} failed (another rank probably "
                           f"exited); underlying error: {text.strip()}") from exc
    if ok is False:
        raise CPTimeoutError(f"deltacp: context parallelism: {what} on rank {rank} did not complete within "
                             f"{timeout:g} s")


def _hash62(value) -> int:
    """A stable 62-bit hash of repr(value) (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def agree(fields: dict, group, rank: int, timeout: float, what: str, ctx=None) -> None:
    """All ranks check that every value in `fields` ({argument name: value}) is the same everywhere.

    One all-reduce (MAX) of [h, -h] per field gives each field's largest and smallest hash on every
    rank, so every rank finds the same mismatches and raises the same ValueError naming the first.
    With a context that has deltacp's NCCL communicator the all-reduce runs there (with its timeout)."""
    agree_finish(agree_start(fields, group, rank, timeout, what, ctx))


class _PendingAgreement:
    __slots__ = ("names", "what", "finish")


def agree_start(fields: dict, group, rank: int, timeout: float, what: str, ctx=None) -> _PendingAgreement:
    """agree()'s all-reduce, started: agree_finish(pending) waits for it and raises on a mismatch. In
    between the caller may enqueue work that does not depend on the agreement (the CP pre-pass): with
    deltacp's NCCL communicator the all-reduce runs off the caller's streams and overlaps that work."""
    return agree_start_values(Fingerprint(fields).values(), group, rank, timeout, what, ctx)


class Fingerprint:
    """The hashes agree() compares, made once for fields that do not change between calls (the CP op's,
    deltacp/cp/plan.py). gate: the name of a field whose value each call extends with the outcome of its
    safe_gate range check, (value, "in range") or (value, "out of range"): both variants are hashed here."""
    __slots__ = ("names", "_both")

    def __init__(self, fields: dict, gate: Optional[str] = None):
        self.names = list(fields)
        self._both = {}
        for outcome in ((None,) if gate is None else ("in range", "out of range")):
            hashes = [_hash62(fields[n] if n != gate else (fields[n], outcome)) for n in self.names]
            self._both[outcome] = hashes + [-h for h in hashes]  # plain ints: no torch op before the exchange

    def values(self, outcome=None):
        """(names, [h..., -h...]) for agree_start_values; outcome: the gate's ("in range" / "out of range")."""
        return self.names, self._both[outcome]


def agree_start_values(values, group, rank: int, timeout: float, what: str, ctx=None) -> _PendingAgreement:
    """agree_start with the hashes made (Fingerprint.values())."""
    names, both = values
    pending = _PendingAgreement()
    pending.names, pending.what = names, what
    label = f"the fingerprint check before {what}"
    if ctx is not None and ctx.nccl is not None:
        from . import nccl_backend

        nccl_backend.start_check(ctx, both)
        pending.finish = lambda: nccl_backend.finish_check(ctx, label)
    else:
        both = torch.tensor(both, dtype=torch.int64, device=_collective_device(group))
        work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True)

        def finish():
            wait_collective(work, label, rank, timeout)
            return both.cpu().tolist()

        pending.finish = finish
    return pending


def agree_finish(pending: _PendingAgreement) -> None:
    both = pending.finish()
    names, n = pending.names, len(pending.names)
    bad = [names[i] for i in range(n) if int(both[i]) != -int(both[n + i])]
    if bad:
        raise InvalidArgumentError(f"deltacp: argument '{bad[0]}': expected the same {bad[0]} on every rank of the CP group "
                         f"before {pending.what}, but the ranks disagree (fingerprints differ for: {', '.join(bad)})")


# ---------------------------------------------------------------------------------------------
# build_context
# ---------------------------------------------------------------------------------------------
def _cu_list(cu_seqlens) -> List[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int64, torch.int32):
            raise DTypeError(f"deltacp: argument 'cu_seqlens': expected an int64 (or int32) tensor, got "
                            f"{cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1:
            raise InvalidArgumentError(f"deltacp: argument 'cu_seqlens': expected a 1-D tensor [N + 1], got shape "
                             f"{list(cu_seqlens.shape)}")
        return [int(x) for x in cu_seqlens.cpu().tolist()]
    if isinstance(cu_seqlens, (str, bytes)) or not isinstance(cu_seqlens, Sequence):
        raise TypeError(f"deltacp: argument 'cu_seqlens': expected a LongTensor or a list of ints, got "
                        f"{type(cu_seqlens).__name__}")
    out = []
    for x in cu_seqlens:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"deltacp: argument 'cu_seqlens': expected ints, got {x!r}")
        out.append(int(x))
    return out


def build_context(cu_seqlens, group=None, *, device=None, timeout: Optional[float] = None,
                  use_nccl: Optional[bool] = None, conv1d_kernel_size: Optional[int] = None) -> CPContext:
    """The CP context of this rank for a packed batch with GLOBAL offsets ``cu_seqlens`` (B = 1).

    cu_seqlens  int64 tensor or list [0, t1, ..., T], the same on every rank (checked: a mismatch
                raises ValueError naming 'cu_seqlens' on every rank); T must be divisible by the
                group size (rejected otherwise, naming 'cu_seqlens').
    group       a torch.distributed process group (None = the default group), any backend.
    device      where the local cu_seqlens go (default: cu_seqlens' device, or the current CUDA
                device for an NCCL group).
    timeout     seconds a CP collective may take before every rank raises (default
                DELTACP_CP_TIMEOUT or 300 s). On gloo it bounds each wait; with the NCCL communicator
                it is the communicator's abort timeout.
    conv1d_kernel_size  the width W >= 1 of deltacp.causal_conv1d under this context (as FLA's
                build_cp_context); None when no convolution runs with it.
    use_nccl    for CUDA tensors, create deltacp's own NCCL communicator (deltacp._cp_nccl): True,
                False, or None = when the module is built and device is CUDA. Its unique id is made
                on rank 0 and broadcast through `group`.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("deltacp: build_context: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group first (torchrun sets the environment)")
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
    if not timeout > 0:
        raise InvalidArgumentError(f"deltacp: argument 'timeout': expected a positive number of seconds, got {timeout}")
    cu = _cu_list(cu_seqlens)
    if conv1d_kernel_size is not None and (isinstance(conv1d_kernel_size, bool) or not isinstance(conv1d_kernel_size, int)
                                           or conv1d_kernel_size < 1):
        raise InvalidArgumentError(f"deltacp: argument 'conv1d_kernel_size': expected an int >= 1 (the convolution width), got "
                         f"{conv1d_kernel_size!r}")
    if device is None:
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type != "cpu":
            device = cu_seqlens.device
        elif _collective_device(group).type == "cuda":
            device = _collective_device(group)
        else:
            device = torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda": the current device, as tensors made there name it
        device = torch.device("cuda", torch.cuda.current_device())

    fingerprint = _hash62(("cu_seqlens", tuple(cu), world))
    agree({"cu_seqlens": tuple(cu), "world": world, "conv1d_kernel_size": conv1d_kernel_size}, group, rank, timeout,
          "build_context")
    # Same cu_seqlens everywhere from here on, so every rank raises the same planning error.
    plans = _core.cp_plan_even(cu, world)  # ValueError naming 'cu_seqlens' when T % world != 0
    plan = plans[rank]
    T = cu[-1]
    per_rank = T // world
    n_local = len(plan["seq_ids"])
    starts_here = [i > 0 or plan["pre_ranks"] == 0 for i in range(n_local)]
    ends_here = [i < n_local - 1 or plan["post_ranks"] == 0 for i in range(n_local)]
    empty = [n for n in range(len(cu) - 1) if cu[n + 1] == cu[n] and min(cu[n] // per_rank, world - 1) == rank]
    local = torch.tensor(plan["cu_seqlens"], dtype=torch.int64)
    maps_read = transitions_read(plans)

    nccl = None
    if device.type == "cuda" and use_nccl is not False:
        from . import nccl_backend

        if nccl_backend.available():
            nccl = nccl_backend.create_communicator(group, rank, world, device, timeout)
        elif use_nccl:
            raise RuntimeError("deltacp: build_context: use_nccl=True but deltacp._cp_nccl is not built "
                               "(needs CUDA, NCCL and DELTACP_BUILD_PYTHON)")

    return CPContext(rank=rank, world=world, group=group, backend=backend, device=device,
                     cu_seqlens_global=torch.tensor(cu, dtype=torch.int64), cu_seqlens_global_list=cu,
                     begin=int(plan["begin"]), end=int(plan["end"]), cu_seqlens=local.to(device),
                     cu_seqlens_cpu=local, cu_seqlens_list=[int(x) for x in plan["cu_seqlens"]],
                     seq_ids=[int(x) for x in plan["seq_ids"]], pre_ranks=int(plan["pre_ranks"]),
                     post_ranks=int(plan["post_ranks"]), starts_here=starts_here, ends_here=ends_here,
                     empty_seqs=empty, fingerprint=fingerprint, timeout=timeout, maps_read=maps_read,
                     nccl=nccl, conv1d_kernel_size=conv1d_kernel_size)


def transitions_read(plans) -> bool:
    """CPContext.maps_read from every rank's plan (_core.cp_plan_even): some rank's only local segment
    continues from an earlier rank and on to a later one. A merge folds S <- M_j S + H_j from S = 0, so
    the first rank it folds always multiplies its M_j by zero; only ranks strictly inside a sequence have
    their M (M^T in the backward) read."""
    return any(r["pre_ranks"] > 0 and r["post_ranks"] > 0 and len(r["seq_ids"]) == 1 for r in plans)


def split_even(x: torch.Tensor, ctx: CPContext, dim: int = 1) -> torch.Tensor:
    """This rank's slice [begin, end) of a global packed tensor along `dim` (a view)."""
    return x.narrow(dim, ctx.begin, ctx.end - ctx.begin)
