"""The fused forward in stages (deltacp/cuda/api.h forward_prepare(p, Method::fused); the CP op's local forward):
prepare (the token-parallel stage and every piece's map by the chain's map mode) -> finish from h0 gives the
one-shot fused forward's o and ht bit for bit, with the sequences whole (DELTACP_FUSED_PIECE=0) and cut into
pieces (DELTACP_FUSED_PIECE=128); scan_pieces(method="fused") gives the chain's cut; a cut sequence's maps,
composed (staged_forward_composed_map, the CP pre-pass), are [H | M] with H the final state from zero and
M h0 + H the final state from h0 (bf16 products: 2e-2), and equal compose_state_maps of the copied maps
(staged_forward_piece_maps) bit for bit; at K = V = 128 and, for gdn, K = 128 with V = 256 (maps 384 columns wide)
and K = V = 64 (128). A fused state has no state-only pieces, and a sequence the chain
does not cut has no maps: both raise naming the argument. Skipped without a compute capability 9.0 GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from deltacp_testutil import make_problem, require_fused_gpu  # noqa: E402

CU = (0, 1, 64, 130, 400)  # four sequences; the last (270 tokens) is cut at 128 tokens: [0, 128, 256, 270]


def _problem(variant, K=128, V=128):
    from deltacp._describe import torch_desc

    p = make_problem(variant, cu_seqlens=list(CU), H=2, HV=2, K=K, V=V, seed=5)
    t = {n: torch.as_tensor(np.ascontiguousarray(p[n])).to("cuda") for n in ("q", "k", "v", "g", "beta")
         if p.get(n) is not None}
    t = {n: (x.to(torch.bfloat16) if n != "g" else x.float()) for n, x in t.items()}
    h0 = torch.as_tensor(p["initial_state"]).float().cuda()
    cu = torch.tensor(CU, dtype=torch.int64, device="cuda")
    cu_host = cu.cpu()
    base = {n: torch_desc(x, n) for n, x in t.items()}
    base["cu_seqlens"] = torch_desc(cu, "cu_seqlens")
    base["cu_seqlens_host"] = torch_desc(cu_host, "cu_seqlens")
    keep = [cu, cu_host]

    def descs(h0_value):
        """The forward's descriptions with fresh NaN-filled o and ht (and h0 when given): (descs, o, ht)."""
        d = dict(base)
        o = torch.full_like(t["v"], float("nan"))
        ht = torch.full(tuple(h0.shape), float("nan"), device="cuda")
        d["o"], d["ht"] = torch_desc(o, "o"), torch_desc(ht, "ht")
        if h0_value is not None:
            d["h0"] = torch_desc(h0_value, "initial_state")
        keep.extend([o, ht])
        return d, o, ht

    return t, h0, descs


@pytest.mark.parametrize("piece", ["0", "128"])
@pytest.mark.parametrize("variant,K,V", [("gdn", 128, 128), ("kda", 128, 128), ("delta", 128, 128), ("gdn", 128, 256),
                                         ("kda", 128, 256), ("gdn", 64, 64), ("kda", 64, 64)])
def test_staged_fused_forward_equals_the_one_shot_forward(variant, K, V, piece, monkeypatch):
    require_fused_gpu()
    from deltacp import _core

    if not _core.cuda_supports(variant, "fused", False):
        pytest.skip(f"the fused tier has no {variant} forward in this build")
    monkeypatch.setenv("DELTACP_FUSED_PIECE", piece)
    t, h0, descs = _problem(variant, K, V)
    N, HV, K, V = h0.shape
    stream = torch.cuda.current_stream().cuda_stream

    one, one_o, one_ht = descs(h0)
    assert _core.cuda_forward_tier(variant, one)[0] == "fused"
    _core.run("forward", variant, "fused", "float32", one, None, 64, None, stream, False)
    cut = list(_core.scan_pieces(variant, one, 3, method="fused"))
    assert cut == ([0, 128, 256, 270] if piece == "128" else [0, 270])

    staged, st_o, st_ht = descs(None)
    state = _core.staged_forward_prepare(variant, "fused", staged, None, 64, stream)
    with pytest.raises(ValueError, match="'state'"):  # the fused chain always makes the output
        _core.staged_forward_step(state, "state_pieces", variant, staged, None, 64, stream, row0=0)
    if piece == "128":
        eye = torch.eye(K, device="cuda").expand(HV, K, K)
        maps = torch.full((3, HV, K, V + K), float("nan"), device="cuda")
        _core.staged_forward_piece_maps(state, 3, maps.data_ptr(), maps.numel())
        outs = []
        for init in (None, torch.cat([h0[3], eye], dim=-1).contiguous()):
            out = torch.full((HV, K, V + K), float("nan"), device="cuda")
            _core.staged_forward_composed_map(state, 3, 0 if init is None else init.data_ptr(), out.data_ptr(), V + K,
                                              out.numel())
            again = torch.full_like(out, float("nan"))
            _core.compose_state_maps(maps.data_ptr(), 3, HV, K, V, V + K, 0 if init is None else init.data_ptr(),
                                     again.data_ptr(), again.numel(), stream)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all() and torch.equal(out, again)
            outs.append(out)
        with pytest.raises(ValueError, match="'n'"):  # sequence 2 (66 tokens) is one piece
            _core.staged_forward_piece_maps(state, 2, maps.data_ptr(), maps.numel())
    staged["h0"] = one["h0"]
    _core.staged_forward_step(state, "finish", variant, staged, None, 64, stream)
    torch.cuda.synchronize()
    assert torch.isfinite(st_o).all() and torch.equal(st_o, one_o)
    assert torch.equal(st_ht, one_ht)

    if piece == "128":  # [H | M] of sequence 3 against the forward from zero and from h0
        zero_h0 = torch.zeros_like(h0)
        z, _z_o, z_ht = descs(zero_h0)
        _core.run("forward", variant, "fused", "float32", z, None, 64, None, stream, False)
        torch.cuda.synchronize()
        H, M = outs[0][..., :V], outs[0][..., V:]

        def rel(x, ref):
            return ((x.double() - ref.double()).norm() / ref.double().norm()).item()

        assert rel(H, z_ht[3]) < 2e-2
        assert rel(M @ h0[3] + H, one_ht[3]) < 2e-2
        assert rel(outs[1][..., :V], one_ht[3]) < 2e-2  # entered with [h0 | I]: the final state itself
