"""deltacp.cp.conv1d — the halo exchange of the causal short convolution under CP.

Rank r holds global tokens [begin, end) (build_context's contiguous slices, T_local = end - begin on
every rank). Its convolution needs the W - 1 tokens before `begin`: the halo. Each rank sends the
last W - 1 tokens of [its halo; its tokens] to rank r + 1 and receives its own halo from rank r - 1
(one batched isend/irecv on the context's group; rank 0's halo is zeros). When T_local >= W - 1 one
hop delivers every halo; a rank holding fewer tokens than W - 1 repeats the hop, ceil((W - 1) /
T_local) times in all, each hop reaching one rank further back. Halo tokens of another sequence are
masked by the convolution (deltacp/conv1d.py, from the global cu_seqlens), so a sequence that starts
on rank r - 1 with fewer than W - 1 tokens there, or one that starts on rank r, reads no foreign token.

Backward: the gradient of the halo goes back the same hops in reverse: each hop sends the gradient of
a rank's halo to rank r - 1, which adds it to the gradient of the last W - 1 tokens of its
[halo; tokens] (its halo part travels on at the next hop).
"""

from __future__ import annotations

import torch

from .ring_attention import _Ring, _wait


class Halo:
    def __init__(self, ctx, W: int):
        self.ctx, self.W = ctx, W
        self.ring = _Ring(ctx.group, ctx.rank, ctx.world)
        T_local = ctx.local_tokens
        self.hops = 0 if W == 1 or ctx.world == 1 else -(-(W - 1) // max(T_local, 1))

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        """[1, W - 1, D]: the tokens before this rank's first one (zeros before token 0)."""
        halo = x.new_zeros(x.shape[0], self.W - 1, x.shape[2])
        for _ in range(self.hops):
            send = torch.cat([halo, x], dim=1)[:, -(self.W - 1):].contiguous()
            recv = torch.empty_like(send)
            _wait(self.ring.start(send, recv, forward=True, tag=2))
            halo = recv if self.ctx.rank > 0 else torch.zeros_like(recv)
        return halo

    def return_grad(self, dext: torch.Tensor) -> torch.Tensor:
        """dx of this rank's tokens from the gradient of [halo; tokens]: halo gradients sent home."""
        dext = dext.clone()
        W1 = self.W - 1
        for _ in range(self.hops):
            send = dext[:, :W1].clone() if self.ctx.rank > 0 else torch.zeros_like(dext[:, :W1])
            dext[:, :W1] = 0
            recv = torch.empty_like(send)
            _wait(self.ring.start(send, recv, forward=False, tag=3))
            if self.ctx.rank < self.ctx.world - 1:  # the last rank's comes from rank 0: nothing
                dext[:, -W1:] += recv
        return dext[:, W1:]
