"""deltacp.cp.ring_attention — softmax attention under context parallelism: the zig-zag layout and
ring attention (the system KCP is compared with; notebooks/07_kcp_vs_ring_attention.py).

    x_local = cp.zigzag_shard(x, dim=1)                        # this rank's tokens, in zig-zag order
    o_local = cp.ring_attention(q_local, k_local, v_local, causal=True)   # [B, T_local, H, Dv], autograd
    o = cp.zigzag_unshard(o_local, dim=1)                      # the whole sequence on every rank

The zig-zag layout. The T tokens are cut into blocks of `block` tokens, dealt to the N ranks in folds
of N blocks, every other fold in reverse: fold 0 gives blocks 0..N-1 to ranks 0..N-1, fold 1 gives
blocks N..2N-1 to ranks N-1..0, and so on. The default block is T / (2N): two folds, so rank r holds
blocks r and 2N-1-r, two contiguous pieces (the layout of ring-flash-attention and Megatron). A block
of one token is the token-by-token fold (N = 4, T = 16: rank 0 holds tokens 0, 7, 8, 15). T must
split into whole PAIRS of folds (T % (2 N block) == 0): every rank then holds T / N tokens and,
under the causal mask, the same number of visible (query, key) pairs. With the default block that
number is exactly (2N - 1) b^2 + b (b + 1) for b = T / (2N) on every rank, where contiguous slices
would give rank N-1 about 2N - 1 times rank 0's work (last_stats counts it; the tests check it).

Ring attention (forward). Step t = 0..N-1: rank r holds the K/V block of rank s = r - t (its own at
t = 0), starts sending it to rank r + 1 and receiving the next one from rank r - 1 into a second
buffer (double-buffered: one batched isend/irecv per step, overlapped with the compute), computes its
queries against that block (global positions give the causal mask; a piece of the block lying wholly
after a piece of the queries is skipped, one lying wholly before runs unmasked) and merges the result
into fp32 accumulators with the online softmax (o, lse: deltacp/reference/attention.h). Exchanged per
step: K and V of T/N tokens, N - 1 times.

Backward. With the final (o, lse) each key block's share of the gradients is exact on its own (dS =
P o (dO V^T - rowdot(dO, O)), P = e^{S - lse}). The ring runs the other way: K/V travel from rank r
to r - 1, and beside them the dK/dV accumulator of the block's owner, to which each rank adds its
share; after N steps one more hop brings every accumulator home. The dK/dV hop is posted as soon as
a step's share is added, and waited for only after the next step's block has been computed.

Grouped K/V heads (H query heads, HKV | H key/value heads): K/V travel with HKV heads; each block is
expanded to H heads for the compute and its dK/dV summed back over the group.

On CPU tensors the group is gloo and the block compute runs in torch (fp32 accumulators; fp64 stays
fp64). CUDA tensors exchange over NCCL (torch.distributed's send/recv); bf16 / fp16 with head dim 64
or 128 run each step in deltacp's CUDA ring-step kernels (cuda/attention/ring_step.cu: the causal
mask from global positions, the merge into fp32 accumulators, the backward's dQ and per-block dK/dV)
when the module was built with CUDA; other CUDA inputs take the torch block compute.
DELTACP_RING_KERNEL=flash runs each block pair through torch's flash-attention kernels instead (the
tensor-core path: a diagonal pair with flash's causal mask, its lse merged in fp32; the backward with
the final o and lse, as ring-flash-attention does), =torch forces the torch block compute.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["zigzag_positions", "zigzag_shard", "zigzag_unshard", "ring_attention", "attention_reference",
           "causal_pairs", "last_stats"]

# Filled by every ring_attention forward on this rank: the causal work it did and what it exchanged.
#   visible_pairs   (query, key) pairs of the B H heads' score matrices not masked out (the work a
#                   masking-aware kernel does), counted per (batch, head) once
#   computed_pairs  pairs evaluated by the block compute of the torch and flash paths (visible + masked
#                   ones inside partially masked blocks; the CUDA ring step skips 32-key tiles instead)
#   sent_bytes      bytes this rank sent in the forward (K/V, N - 1 times)
last_stats = {"visible_pairs": 0, "computed_pairs": 0, "sent_bytes": 0, "steps": 0}


# ---------------------------------------------------------------------------------------------
# the layout
# ---------------------------------------------------------------------------------------------
def _rank_world(group) -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    if group is not None:
        raise RuntimeError("deltacp: a process group was given but torch.distributed is not initialized")
    return 0, 1


def _check_block(T: int, world: int, block: Optional[int], argument: str) -> int:
    """The block size, checked: T must split into whole pairs of folds of `world` blocks."""
    if block is None:
        if T % (2 * world) != 0:
            raise ValueError(f"deltacp: argument '{argument}': the zig-zag layout deals T = {T} tokens to "
                             f"{world} ranks as 2 x {world} blocks, so T must be divisible by {2 * world}; got "
                             f"T = {T} (pad the sequence, or pass block=)")
        block = T // (2 * world)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"deltacp: argument 'block': expected a positive int (tokens per block), got {block!r}")
    if T % (2 * world * block) != 0:
        raise ValueError(f"deltacp: argument '{argument}': the zig-zag layout deals blocks of {block} tokens in pairs "
                         f"of folds of {world} blocks, so T must be divisible by 2 x {world} x {block} = "
                         f"{2 * world * block}; got T = {T}")
    return block


def zigzag_positions(T: int, world: int, rank: int, block: Optional[int] = None) -> torch.Tensor:
    """The global positions (int64, in local order) rank `rank` of `world` holds of T tokens."""
    block = _check_block(T, world, block, "T")
    if not 0 <= rank < world:
        raise ValueError(f"deltacp: argument 'rank': expected 0 <= rank < {world}, got {rank}")
    blocks = []
    for fold in range(T // (world * block)):
        b = fold * world + (rank if fold % 2 == 0 else world - 1 - rank)
        blocks.append(torch.arange(b * block, (b + 1) * block, dtype=torch.int64))
    return torch.cat(blocks)


def _runs(pos: torch.Tensor) -> List[Tuple[int, int]]:
    """The contiguous runs of a position list as (start index, length)."""
    p = pos.tolist()
    runs, start = [], 0
    for i in range(1, len(p) + 1):
        if i == len(p) or p[i] != p[i - 1] + 1:
            runs.append((start, i - start))
            start = i
    return runs


def _check_dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"deltacp: argument 'x': expected a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"deltacp: argument 'dim': expected a dimension of a {x.dim()}-D tensor, got {dim}")
    return dim % x.dim()


def zigzag_shard(x: torch.Tensor, dim: int = 1, block: Optional[int] = None, group=None) -> torch.Tensor:
    """This rank's tokens of the global tensor `x` along `dim`, in zig-zag order (a copy)."""
    dim = _check_dim(x, dim)
    rank, world = _rank_world(group)
    T = x.shape[dim]
    block = _check_block(T, world, block, "x")
    pos = zigzag_positions(T, world, rank, block)
    return torch.cat([x.narrow(dim, int(pos[s]), n) for s, n in _runs(pos)], dim=dim)


def zigzag_unshard(x: torch.Tensor, dim: int = 1, block: Optional[int] = None, group=None) -> torch.Tensor:
    """The global tensor, in sequence order on every rank, from each rank's zig-zag shard (all-gather;
    not differentiable)."""
    dim = _check_dim(x, dim)
    rank, world = _rank_world(group)
    T = x.shape[dim] * world
    block = _check_block(T, world, block, "x")
    if world == 1:
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    out = torch.empty(*x.shape[:dim], T, *x.shape[dim + 1:], dtype=x.dtype, device=x.device)
    for r in range(world):
        pos = zigzag_positions(T, world, r, block)
        for s, n in _runs(pos):
            out.narrow(dim, int(pos[s]), n).copy_(parts[r].narrow(dim, s, n))
    return out


def causal_pairs(qpos: torch.Tensor, kpos: torch.Tensor) -> int:
    """Visible (query, key) pairs under the causal mask (key position <= query position)."""
    k_sorted = torch.sort(kpos).values
    return int(torch.searchsorted(k_sorted, qpos, right=True).sum())


def attention_reference(q, k, v, causal=True, scale=None):
    """Plain softmax attention on [B, T, H, D] (grouped K/V expanded), in fp64 for the comparisons."""
    H, HKV = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = k.repeat_interleave(H // HKV, dim=2)
    v = v.repeat_interleave(H // HKV, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * scale
    if causal:
        T = q.shape[1]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(s, dim=-1), v.double())


# ---------------------------------------------------------------------------------------------
# block compute (torch, any device): queries [B, H, n, D] against one key block [B, H, m, D]
# ---------------------------------------------------------------------------------------------
class _Pieces:
    """How one rank's queries meet one rank's key block: per (query piece, key piece) pair, skipped
    (all masked), unmasked (all visible) or masked. The pieces are the zig-zag blocks when a rank holds
    at most 4 of them (with the default block every rank then computes 2N + 1 block pairs: balanced),
    otherwise (a small block size) all of the rank's tokens as one masked piece."""

    def __init__(self, qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, block: int):
        self.items = []  # (qs, qn, ks, kn, masked): local row / key ranges; masked = needs the causal mask
        self.qpos, self.kpos = qpos, kpos
        self.visible = causal_pairs(qpos, kpos) if causal else len(qpos) * len(kpos)
        self.computed = 0
        n = len(qpos)
        if causal and n // block <= 4:
            qr = kr = [(s, block) for s in range(0, n, block)]
        else:
            qr, kr = [(0, n)], [(0, len(kpos))]
        for qs, qn in qr:
            qp = qpos[qs:qs + qn]
            for ks, kn in kr:
                kp = kpos[ks:ks + kn]
                if causal and int(kp.min()) > int(qp.max()):
                    continue  # every key after every query
                masked = causal and int(kp.max()) > int(qp.min())
                self.items.append((qs, qn, ks, kn, masked))
                self.computed += qn * kn

    def mask(self, qs, qn, ks, kn, device):
        """The causal mask of one item, True where masked (built only where a path needs it: the CUDA
        step reads positions itself, flash masks a diagonal block by its own rule)."""
        qp, kp = self.qpos[qs:qs + qn].to(device), self.kpos[ks:ks + kn].to(device)
        return kp[None, :] > qp[:, None]


def _block_forward(q, k, v, scale, pieces: _Pieces, acc_dtype):
    """Partial (o, lse) of q against one block, [B, H, n, Dv] and [B, H, n]; q, k, v in acc_dtype."""
    B, H, n, _ = q.shape
    o = torch.zeros(B, H, n, v.shape[-1], dtype=acc_dtype, device=q.device)
    lse = torch.full((B, H, n), float("-inf"), dtype=acc_dtype, device=q.device)
    for qs, qn, ks, kn, masked in pieces.items:
        s = torch.matmul(q[:, :, qs:qs + qn], k[:, :, ks:ks + kn].transpose(-1, -2)) * scale
        if masked:
            s = s.masked_fill(pieces.mask(qs, qn, ks, kn, q.device), float("-inf"))
        l_p = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - l_p.unsqueeze(-1)).nan_to_num_(0.0)  # rows with no visible key: 0
        o_p = torch.matmul(p, v[:, :, ks:ks + kn])
        o[:, :, qs:qs + qn], lse[:, :, qs:qs + qn] = _merge(o[:, :, qs:qs + qn], lse[:, :, qs:qs + qn], o_p, l_p)
    return o, lse


def _merge(o_a, l_a, o_b, l_b):
    """The online-softmax merge of two partial results over disjoint keys (rows that saw no key:
    lse = -inf, o = 0; merging them is the identity)."""
    L = torch.logaddexp(l_a, l_b)
    finite = torch.isfinite(L)
    safe = torch.where(finite, L, torch.zeros_like(L))
    w_a = torch.where(finite, torch.exp(l_a - safe), torch.zeros_like(L)).unsqueeze(-1)
    w_b = torch.where(finite, torch.exp(l_b - safe), torch.zeros_like(L)).unsqueeze(-1)
    return w_a * o_a + w_b * o_b, L


def _block_backward(q, k, v, do, delta, lse, scale, pieces: _Pieces, acc_dtype):
    """One key block's share of (dq, dk, dv) from the final lse and delta = rowdot(dO, O); every
    tensor in acc_dtype."""
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
    for qs, qn, ks, kn, masked in pieces.items:
        qq, kk, vv = q[:, :, qs:qs + qn], k[:, :, ks:ks + kn], v[:, :, ks:ks + kn]
        dd = do[:, :, qs:qs + qn]
        s = torch.matmul(qq, kk.transpose(-1, -2)) * scale
        if masked:
            s = s.masked_fill(pieces.mask(qs, qn, ks, kn, q.device), float("-inf"))
        l_q = lse[:, :, qs:qs + qn]
        p = torch.exp(s - torch.where(torch.isfinite(l_q), l_q, torch.zeros_like(l_q)).unsqueeze(-1))
        p = torch.where(torch.isfinite(l_q).unsqueeze(-1), p, torch.zeros_like(p))
        dv[:, :, ks:ks + kn] += torch.matmul(p.transpose(-1, -2), dd)
        ds = p * (torch.matmul(dd, vv.transpose(-1, -2)) - delta[:, :, qs:qs + qn].unsqueeze(-1))
        dq[:, :, qs:qs + qn] += torch.matmul(ds, kk) * scale
        dk[:, :, ks:ks + kn] += torch.matmul(ds.transpose(-1, -2), qq) * scale
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# the ring
# ---------------------------------------------------------------------------------------------
class _Ring:
    """Neighbour exchange on a group: one batched isend/irecv per hop (gloo or NCCL)."""

    def __init__(self, group, rank, world):
        self.group, self.rank, self.world = group, rank, world
        glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next, self.prev = glob((rank + 1) % world), glob((rank - 1) % world)

    def start(self, send: torch.Tensor, recv: torch.Tensor, forward: bool, tag: int):
        """Sends `send` to the next rank (forward) or the previous one, receives into `recv` from the
        other side. Returns the pending works."""
        to, frm = (self.next, self.prev) if forward else (self.prev, self.next)
        ops = [dist.P2POp(dist.isend, send, to, self.group, tag), dist.P2POp(dist.irecv, recv, frm, self.group, tag)]
        return dist.batch_isend_irecv(ops)


def _wait(works):
    for w in works or ():
        w.wait()


def _pack(*ts):
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf, like):
    out, off = [], 0
    for t in like:
        out.append(buf[off:off + t.numel()].view(t.shape))
        off += t.numel()
    return out


def _heads_first(x):
    return x.transpose(1, 2)  # [B, T, H, D] -> [B, H, T, D] (a view)


def _expand(x, groups):
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_groups(dx, groups):
    if groups == 1:
        return dx
    B, H, T, D = dx.shape
    return dx.view(B, H // groups, groups, T, D).sum(dim=2)


_STEP_KINDS = ("auto", "deltacp", "flash", "torch")


def _step_kind(q, v, causal, block):
    """How each ring step computes: 'deltacp' (deltacp._core's CUDA ring step), 'flash' (torch's flash
    attention kernels per block pair) or 'torch' (the torch block compute). DELTACP_RING_KERNEL picks:
    auto (default: deltacp for CUDA bf16/fp16 with head dim 64 or 128 when built, else torch), deltacp,
    flash or torch. flash takes causal blocks only as whole zig-zag blocks (a rank holding at most 4)."""
    want = os.environ.get("DELTACP_RING_KERNEL", "auto")
    if want not in _STEP_KINDS:
        raise ValueError(f"deltacp: DELTACP_RING_KERNEL: expected one of {', '.join(_STEP_KINDS)}, got {want!r}")
    if not q.is_cuda or want == "torch":
        return "torch"
    half = q.dtype in (torch.bfloat16, torch.float16) and v.shape[-1] == q.shape[-1]
    if want == "flash":
        if not (half and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256):
            raise ValueError(f"deltacp: argument 'q': DELTACP_RING_KERNEL=flash needs bf16/fp16 q, k, v of one head "
                             f"dim (a multiple of 8, at most 256), got {q.dtype}, {q.shape[-1]} and {v.shape[-1]}")
        if causal and q.shape[1] // block > 4:
            raise ValueError(f"deltacp: argument 'block': DELTACP_RING_KERNEL=flash masks whole zig-zag blocks only "
                             f"(at most 4 per rank), got {q.shape[1] // block} blocks of {block} tokens per rank")
        return "flash"
    from .. import _core

    built = hasattr(_core, "attention_ring_step_forward")
    fits = built and half and q.shape[-1] in (64, 128)
    if want == "deltacp" and not fits:
        raise ValueError(f"deltacp: argument 'q': DELTACP_RING_KERNEL=deltacp needs the CUDA build and bf16/fp16 "
                         f"q, k, v with head dim 64 or 128, got {q.dtype}, head dims {q.shape[-1]} / {v.shape[-1]}"
                         f"{'' if built else ' (deltacp was built without CUDA)'}")
    return "deltacp" if fits else "torch"


def _desc(t):
    """A tensor as deltacp._core's attention step reads it: (ptr, dtype, shape, strides, device)."""
    return (t.data_ptr(), str(t.dtype).replace("torch.", ""), list(t.shape), list(t.stride()), str(t.device))


def _flash_forward(q, kk, vv, o, lse, pieces, groups, scale):
    """One ring step by torch's flash attention per (query block, key block) pair: a diagonal pair
    (the same zig-zag block) with flash's causal mask, an earlier key block unmasked; each result
    merged into (o, lse). Returns what each pair's backward needs."""
    saved = []
    for qs, qn, ks, kn, masked in pieces.items:
        qq = q[:, qs:qs + qn].transpose(1, 2)
        k_p = _expand(_heads_first(kk[:, ks:ks + kn]), groups)
        v_p = _expand(_heads_first(vv[:, ks:ks + kn]), groups)
        res = torch.ops.aten._scaled_dot_product_flash_attention(qq, k_p, v_p, 0.0, masked, False,
                                                                 scale=scale)
        rows = slice(qs, qs + qn)
        o[:, :, rows], lse[:, :, rows] = _merge(o[:, :, rows], lse[:, :, rows], res[0].float(), res[1].float())
        saved.append((qs, qn, ks, kn, masked, res[2], res[3], res[6], res[7]))
    return saved


def _flash_backward(q, kk, vv, dout, o_in, lse, dq, saved, groups, scale):
    """One ring step's backward by flash's backward per block pair, from the FINAL o and lse (each
    pair's exact share): dq accumulated in place; returns the block's dK, dV [B, HKV, T, D] (fp32)."""
    B, T, HKV, D = kk.shape
    dk = torch.zeros(B, HKV * groups, T, D, dtype=torch.float32, device=q.device)
    dv = torch.zeros(B, HKV * groups, T, vv.shape[-1], dtype=torch.float32, device=q.device)
    for qs, qn, ks, kn, is_causal, cum_q, cum_k, seed, offset in saved:
        qq = q[:, qs:qs + qn].transpose(1, 2)
        k_p = _expand(_heads_first(kk[:, ks:ks + kn]), groups)
        v_p = _expand(_heads_first(vv[:, ks:ks + kn]), groups)
        g = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout[:, qs:qs + qn].transpose(1, 2), qq, k_p, v_p, o_in[:, :, qs:qs + qn],
            lse[:, :, qs:qs + qn].contiguous(), cum_q, cum_k, qn, kn, 0.0, is_causal, seed, offset, scale=scale)
        dq[:, :, qs:qs + qn] += g[0].float()
        dk[:, :, ks:ks + kn] += g[1].float()
        dv[:, :, ks:ks + kn] += g[2].float()
    return _reduce_groups(dk, groups), _reduce_groups(dv, groups)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, block, rank, world):
        T = q.shape[1] * world
        pos = [zigzag_positions(T, world, r, block) for r in range(world)]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        groups = q.shape[2] // k.shape[2]
        kind = _step_kind(q, v, causal, block)
        flash_saved = {}  # flash: per source rank, what each block pair's backward needs from its forward
        if kind != "torch":  # o, lse merged in place; q read in its own dtype and layout
            from .. import _core

            q = q if q.stride(-1) == 1 else q.contiguous()
            dpos = [p.to(q.device) for p in pos]
            stream = torch.cuda.current_stream(q.device).cuda_stream
            o = torch.zeros(q.shape[0], q.shape[2], q.shape[1], v.shape[-1], dtype=acc, device=q.device)
            lse = torch.full(o.shape[:3], float("-inf"), dtype=acc, device=q.device)
        else:
            qh = _heads_first(q).to(acc).contiguous()  # K/V travel in their own dtype, computed in acc
            o = lse = None
        kv = [k.contiguous(), v.contiguous()]
        ring = _Ring(group, rank, world)
        cur = _pack(*kv)
        nxt = torch.empty_like(cur)
        visible = computed = sent = 0
        for step in range(world):
            src = (rank - step) % world
            works = None
            if step < world - 1:
                works = ring.start(cur, nxt, forward=True, tag=0)
                sent += cur.numel() * cur.element_size()
            kk, vv = _unpack(cur, kv)
            pieces = _Pieces(pos[rank], pos[src], causal, block)
            visible += pieces.visible
            computed += pieces.computed
            if kind == "flash":
                flash_saved[src] = _flash_forward(q, kk, vv, o, lse, pieces, groups, scale)
            elif kind == "deltacp":
                _core.attention_ring_step_forward(_desc(q), _desc(kk), _desc(vv), _desc(dpos[rank]), _desc(dpos[src]),
                                                  _desc(o), _desc(lse), causal, scale, stream)
            else:
                o_b, l_b = _block_forward(qh, _expand(_heads_first(kk).to(acc), groups),
                                          _expand(_heads_first(vv).to(acc), groups), scale, pieces, acc)
                o, lse = (o_b, l_b) if o is None else _merge(o, lse, o_b, l_b)
            _wait(works)
            cur, nxt = nxt, cur
        BH = q.shape[0] * q.shape[2]
        last_stats.update(visible_pairs=visible * BH, computed_pairs=computed * BH, sent_bytes=sent, steps=world)
        out = o.transpose(1, 2).to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.cfg = (causal, scale, group, block, rank, world, pos, kind, flash_saved)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale, group, block, rank, world, pos, kind, flash_saved = ctx.cfg
        acc = o.dtype
        groups = q.shape[2] // k.shape[2]
        qh = _heads_first(q).to(acc)
        do = _heads_first(dout).to(acc).contiguous()
        delta = (do * o).sum(-1)  # rowdot(dO, O) with the fp32 O of the forward
        dq = torch.zeros(qh.shape, dtype=acc, device=q.device)
        if kind != "torch":
            from .. import _core

            dout = dout.contiguous()
            o_in = o.to(q.dtype)  # flash's backward takes the final o in the input dtype
            dpos = [p.to(q.device) for p in pos]
            stream = torch.cuda.current_stream(q.device).cuda_stream
            lse_c, delta = lse.contiguous(), delta.contiguous()
        kv = [k.contiguous(), v.contiguous()]
        dkv_like = [torch.empty(k.shape, dtype=acc, device=k.device), torch.empty(v.shape, dtype=acc, device=v.device)]
        ring = _Ring(group, rank, world)
        cur = _pack(*kv)
        nxt = torch.empty_like(cur)
        dacc = None  # the dK/dV accumulator of the block in hand (flat, acc dtype)
        dwork, drecv = None, None
        for step in range(world):
            src = (rank + step) % world  # the backward ring runs the other way: K/V from rank r + 1
            works = ring.start(cur, nxt, forward=False, tag=0) if step < world - 1 else None
            kk, vv = _unpack(cur, kv)
            pieces = _Pieces(pos[rank], pos[src], causal, block)
            if kind == "flash":
                dk_b, dv_b = _flash_backward(q, kk, vv, dout, o_in, lse_c, dq, flash_saved[src], groups, scale)
                share = _pack(dk_b.transpose(1, 2), dv_b.transpose(1, 2))
            elif kind == "deltacp":
                dk_b = torch.zeros(k.shape[0], k.shape[2], k.shape[1], k.shape[3], dtype=acc, device=q.device)
                dv_b = torch.zeros(v.shape[0], v.shape[2], v.shape[1], v.shape[3], dtype=acc, device=q.device)
                _core.attention_ring_step_backward(_desc(q), _desc(kk), _desc(vv), _desc(dout), _desc(dpos[rank]),
                                                   _desc(dpos[src]), _desc(lse_c), _desc(delta), _desc(dq),
                                                   _desc(dk_b), _desc(dv_b), causal, scale, stream)
                share = _pack(dk_b.transpose(1, 2), dv_b.transpose(1, 2))
            else:
                dq_b, dk_b, dv_b = _block_backward(qh, _expand(_heads_first(kk).to(acc), groups),
                                                   _expand(_heads_first(vv).to(acc), groups), do, delta, lse, scale,
                                                   pieces, acc)
                dq += dq_b
                share = _pack(_reduce_groups(dk_b, groups).transpose(1, 2),
                              _reduce_groups(dv_b, groups).transpose(1, 2))
            if step == 0:
                dacc = share
            else:
                _wait(dwork)  # the accumulator of block `src` (from rank r + 1), posted a step ago
                dacc, drecv = drecv, None
                dacc += share
            if world > 1:  # pass it on: to rank r - 1, which holds block `src` next (the last hop: home)
                drecv = torch.empty_like(dacc)
                dwork = ring.start(dacc, drecv, forward=False, tag=1)
            _wait(works)
            cur, nxt = nxt, cur
        if world > 1:
            _wait(dwork)
            dacc = drecv
        dk, dv = _unpack(dacc, dkv_like)
        return (dq.transpose(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                   scale: Optional[float] = None, group=None, *, block: Optional[int] = None) -> torch.Tensor:
    """Softmax attention of this rank's queries over the whole sequence, by ring attention.

    q [B, T_local, H, D], k [B, T_local, HKV, D], v [B, T_local, HKV, Dv] (HKV divides H): this rank's
    tokens in zig-zag order (zigzag_shard with the same `block`, default T / (2N)). Returns o
    [B, T_local, H, Dv] in q's dtype, the rows of attention over all N T_local tokens; autograd gives
    dq, dk, dv of the local tokens. scale defaults to D ** -0.5. Every rank of `group` must call it
    with the same shapes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"deltacp: argument '{name}': expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"deltacp: argument '{name}': expected [B, T_local, heads, dim], got shape "
                             f"{list(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"deltacp: argument '{name}': expected a floating-point tensor, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"deltacp: argument 'k': expected q, k and v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"deltacp: argument 'k': expected k and v with q's [B, T_local] = {list(q.shape[:2])}, got "
                         f"{list(k.shape[:2])} and {list(v.shape[:2])}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"deltacp: argument 'k': expected head dim {q.shape[3]} as q, got {k.shape[3]}")
    if v.shape[2] != k.shape[2] or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"deltacp: argument 'k': expected k and v with the same number of heads dividing q's "
                         f"{q.shape[2]}, got {k.shape[2]} (k) and {v.shape[2]} (v)")
    rank, world = _rank_world(group)
    block = _check_block(q.shape[1] * world, world, block, "q")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, bool(causal), scale, group, block, rank, world)
