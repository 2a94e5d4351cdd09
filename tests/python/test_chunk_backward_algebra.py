"""The chunk-local gradients as cuda/tiled/bwd_local_wgmma.cuh regroups them (stages B2, B3 and B4 of the tiled
backward in one kernel: three accumulators dq, minus, plus per token row and key column, and Y = T^T dU), against
torch autograd through one chunk of the WY forward in float64. The kernel's GPU test compares its output with the
three mma.sync stages; this one ties the formulas in its opening comment to the chain rule, on the CPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _chunk(n, K, V, gated, seed):
    """One chunk of n tokens from a start state S: its output O and end state S' with autograd on every input."""
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=f64)

    x = {
        "q": randn(n, K),
        "k": torch.nn.functional.normalize(randn(n, K), dim=-1),
        "v": randn(n, V),
        "g": torch.nn.functional.logsigmoid(randn(n)) if gated else torch.zeros(n, dtype=f64),
        "beta": torch.rand(n, generator=gen, dtype=f64),
        "S": randn(K, V) * 0.1,
    }
    x = {name: t.requires_grad_(True) for name, t in x.items()}
    dO, dSp, scale = randn(n, V), randn(K, V), 0.3
    q, k, v, beta, S = x["q"], x["k"], x["v"], x["beta"], x["S"]
    G = torch.cumsum(x["g"], 0)
    E = torch.exp(G[:, None] - G[None, :]) * torch.tril(torch.ones(n, n, dtype=f64))
    T = torch.linalg.inv(torch.eye(n, dtype=f64) + torch.tril(beta[:, None] * (k @ k.T) * E, -1))
    W = T @ (beta[:, None] * k * torch.exp(G)[:, None])
    Vn = T @ (beta[:, None] * v) - W @ S
    P = (q @ k.T) * E
    O = scale * ((q * torch.exp(G)[:, None]) @ S + P @ Vn)
    Kr = k * torch.exp(G[-1] - G)[:, None]
    Sp = torch.exp(G[-1]) * S + Kr.T @ Vn
    ((O * dO).sum() + (Sp * dSp).sum()).backward()
    with torch.no_grad():
        plain = {name: t.detach() for name, t in x.items()}
        inter = dict(G=G, E=E, T=T, Vn=Vn, P=P, Kr=Kr, dO=dO, dSp=dSp, scale=scale)
    return plain, inter, {name: t.grad for name, t in x.items()}


def _regrouped(x, m):
    """The kernel's formulas (bwd_local_wgmma.cuh's opening comment), from what it reads: q, k, v, beta, G, S = h[c],
    dS' = dh[c], Vn, T, dO and dU = dL/dVn (stages B0 and B1)."""
    q, k, v, beta, S = x["q"], x["k"], x["v"], x["beta"], x["S"]
    G, E, T, Vn, dO, dSp, scale = m["G"], m["E"], m["T"], m["Vn"], m["dO"], m["dSp"], m["scale"]
    n = q.shape[0]
    gam, ek = torch.exp(G), torch.exp(G[-1] - G)
    dU = scale * m["P"].T @ dO + m["Kr"] @ dSp
    # the V side
    dq = (scale * gam)[:, None] * (dO @ S.T)
    minus = ek[:, None] * (Vn @ dSp.T)
    kr_sum = (k * minus).sum()  # summed before the decay products join minus
    Y = T.T @ dU
    dW = -(dU @ S.T)
    dPE = scale * (dO @ Vn.T) * E  # E holds the j <= i mask
    # the WY side
    plus = gam[:, None] * (T.T @ dW)
    dT = (dU @ v.T + (dW @ k.T) * gam[None, :]) * beta[None, :]
    dAE = torch.tril(-(T.T @ dT) @ T.T, -1) * E
    # the decay products
    dq = dq + dPE @ k
    plus = plus + dAE @ k
    minus = minus + dPE.T @ q + (beta[:, None] * dAE).T @ k
    dG = (q * dq).sum(1) + beta * (k * plus).sum(1) - (k * minus).sum(1)
    dG[n - 1] += torch.exp(G[-1]) * (dSp * S).sum() + kr_sum
    return {
        "q": dq,
        "k": minus + beta[:, None] * plus,
        "v": beta[:, None] * Y,
        "beta": (Y * v).sum(1) + (k * plus).sum(1),
        "g": torch.flip(torch.cumsum(torch.flip(dG, [0]), 0), [0]),
    }


@pytest.mark.parametrize("gated", [True, False], ids=["gdn", "delta"])
@pytest.mark.parametrize("n", [64, 47, 1])
def test_regrouped_chunk_gradients_equal_autograd(gated, n):
    x, m, want = _chunk(n, 128, 128, gated, seed=n + 7 * gated)
    got = _regrouped(x, m)
    for name in ("q", "k", "v", "beta") + (("g",) if gated else ()):
        err = ((got[name] - want[name]).norm() / want[name].norm()).item()
        assert err < 1e-12, f"d{name}: {err:.2e}"
