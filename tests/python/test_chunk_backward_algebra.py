"""The chunk-local gradients as cuda/tiled/bwd_local_wgmma.cuh regroups them (stages B2, B3 and B4 of the tiled
backward in one kernel: three accumulators dq, minus, plus per token row and key column, and Y = T^T dU), against
torch autograd through one chunk of the WY forward in float64. The kernel's GPU test compares its output with the
three mma.sync stages; this one ties the formulas in its opening comment to the chain rule, on the CPU. The kda
form of the same regrouping (per-key element scales, the decay products on 16-row blocks around a reference row, as
a chunk-local kernel for kda computes them) is tied to autograd below in the same way."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _inputs(n, K, V, gate, seed):
    """Random float64 leaves of one chunk (q, k unit rows, v, the log decays g from gate(randn), beta, the start
    state S) and the upstream gradients dO, dS' with the output scale."""
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=f64)

    x = {
        "q": randn(n, K),
        "k": torch.nn.functional.normalize(randn(n, K), dim=-1),
        "v": randn(n, V),
        "g": gate(randn),
        "beta": torch.rand(n, generator=gen, dtype=f64),
        "S": randn(K, V) * 0.1,
    }
    x = {name: t.requires_grad_(True) for name, t in x.items()}
    return x, randn(n, V), randn(K, V), 0.3


def _chunk(n, K, V, gated, seed):
    """One chunk of n tokens from a start state S: its output O and end state S' with autograd on every input."""
    f64 = torch.float64
    gate = (lambda randn: torch.nn.functional.logsigmoid(randn(n))) if gated else \
        (lambda randn: torch.zeros(n, dtype=f64))
    x, dO, dSp, scale = _inputs(n, K, V, gate, seed)
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


def _gradients(dq, minus, plus, Y, dG, k, v, beta):
    """Every input's gradient from the three accumulators, Y and the rows' dG (gdn: a scalar per row; kda: per
    key): dk = minus + beta plus, dv = beta Y, dbeta = Y . v + k . plus, dg = the reverse cumulative sum of dG."""
    return {
        "q": dq,
        "k": minus + beta[:, None] * plus,
        "v": beta[:, None] * Y,
        "beta": (Y * v).sum(1) + (k * plus).sum(1),
        "g": torch.flip(torch.cumsum(torch.flip(dG, [0]), 0), [0]),
    }


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
    return _gradients(dq, minus, plus, Y, dG, k, v, beta)


@pytest.mark.parametrize("gated", [True, False], ids=["gdn", "delta"])
@pytest.mark.parametrize("n", [64, 47, 1])
def test_regrouped_chunk_gradients_equal_autograd(gated, n):
    x, m, want = _chunk(n, 128, 128, gated, seed=n + 7 * gated)
    got = _regrouped(x, m)
    for name in ("q", "k", "v", "beta") + (("g",) if gated else ()):
        err = ((got[name] - want[name]).norm() / want[name].norm()).item()
        assert err < 1e-12, f"d{name}: {err:.2e}"


# ---- kda: a decay per key ----------------------------------------------------------------------------------------
# The same regrouping with kda's per-key gates (G: [n, K], the cumulative log decay of each key), in the form a
# chunk-local Hopper kernel for kda takes: the V and WY sides are gdn's products with element scales (Gam_id =
# e^(G_id), e^(Gn_d - G_id)) in place of row scales, dT reads K o Gam as its operand, and the decay products, whose
# per-key factors e^(G_id - G_jd) do not leave the sums over d, run on 16-row blocks around a reference row r (the
# block's first row): for i in block I and j in an earlier block J, e^(G_id - G_jd) = e^(G_id - G_rd) e^(G_rd - G_jd)
# with both exponents <= 0 (G falls along the chunk), so each off-diagonal 16 x 16 block is a plain product of two
# scaled operands; the diagonal blocks are summed element by element (cuda/tiled/kda_scores.cuh's scheme).
def _chunk_kda(n, K, V, seed):
    f64 = torch.float64
    # FLA's safe_gate range: at least -5 a token and key
    x, dO, dSp, scale = _inputs(n, K, V, lambda randn: torch.nn.functional.logsigmoid(randn(n, K)).clamp_min(-5.0),
                                seed)
    q, k, v, beta, S = x["q"], x["k"], x["v"], x["beta"], x["S"]
    G = torch.cumsum(x["g"], 0)
    lower = torch.tril(torch.ones(n, n, dtype=f64))
    decayed = torch.einsum("id,jd,ijd->ij", q, k, torch.exp(G[:, None, :] - G[None, :, :]) * lower[..., None])
    kk = torch.einsum("id,jd,ijd->ij", k, k, torch.exp(G[:, None, :] - G[None, :, :]) * lower[..., None])
    T = torch.linalg.inv(torch.eye(n, dtype=f64) + torch.tril(beta[:, None] * kk, -1))
    W = T @ (beta[:, None] * k * torch.exp(G))
    Vn = T @ (beta[:, None] * v) - W @ S
    O = scale * ((q * torch.exp(G)) @ S + decayed @ Vn)
    Kr = k * torch.exp(G[-1] - G)
    Sp = torch.exp(G[-1])[:, None] * S + Kr.T @ Vn
    ((O * dO).sum() + (Sp * dSp).sum()).backward()
    with torch.no_grad():
        plain = {name: t.detach() for name, t in x.items()}
        inter = dict(G=G.detach(), T=T.detach(), Vn=Vn.detach(), P=decayed.detach(), Kr=Kr.detach(), dO=dO, dSp=dSp,
                     scale=scale)
    return plain, inter, {name: t.grad for name, t in x.items()}


def _decay_products(dPm, dAm, q, k, beta, G, block=16):
    """Yq = sum_{j <= i} dP_ij k_j e^(G_i - G_j), Yr = sum_{j < i} dA_ij k_j e^(G_i - G_j) and
    Yc = sum_{i >= j} (dP_ij q_i + beta_i dA_ij k_i) e^(G_i - G_j) (each [n, K], per key), dP and dA masked, as
    16-row blocks: off-diagonal blocks (I > J) as products of operands scaled around I's first row r (every
    exponent <= 0), diagonal blocks element by element."""
    n, K = k.shape
    Yq, Yr, Yc = (torch.zeros(n, K, dtype=k.dtype) for _ in range(3))
    X = beta[:, None] * k  # the rows dA meets on the Yc side
    for i0 in range(0, n, block):
        i1 = min(n, i0 + block)
        Gr = G[i0]
        up = torch.exp(G[i0:i1] - Gr)  # e^(G_i - G_r) <= 1 for the block's rows
        for j0 in range(0, i0, block):  # earlier blocks: two scaled operands, one product each
            j1 = j0 + block
            down = torch.exp(Gr - G[j0:j1])  # e^(G_r - G_j) <= 1
            Yq[i0:i1] += up * (dPm[i0:i1, j0:j1] @ (k[j0:j1] * down))
            Yr[i0:i1] += up * (dAm[i0:i1, j0:j1] @ (k[j0:j1] * down))
            Yc[j0:j1] += down * (dPm[i0:i1, j0:j1].T @ (q[i0:i1] * up) + dAm[i0:i1, j0:j1].T @ (X[i0:i1] * up))
        for i in range(i0, i1):  # the diagonal block, element by element (j <= i inside it)
            for j in range(i0, i + 1):
                e = torch.exp(G[i] - G[j])
                Yq[i] += dPm[i, j] * k[j] * e
                Yr[i] += dAm[i, j] * k[j] * e
                Yc[j] += (dPm[i, j] * q[i] + dAm[i, j] * X[i]) * e
    return Yq, Yr, Yc


def _regrouped_kda(x, m):
    """dq, minus, plus and Y for kda (per-key scales; the decay products in reference-row blocks), from what a
    chunk-local kernel reads: q, k, v, beta, G, S = h[c], dS' = dh[c], Vn, T, dO and dU = dL/dVn."""
    q, k, v, beta, S = x["q"], x["k"], x["v"], x["beta"], x["S"]
    G, T, Vn, dO, dSp, scale = m["G"], m["T"], m["Vn"], m["dO"], m["dSp"], m["scale"]
    n = q.shape[0]
    gam, ek = torch.exp(G), torch.exp(G[-1] - G)  # [n, K]: element scales
    dU = scale * m["P"].T @ dO + m["Kr"] @ dSp
    lower = torch.tril(torch.ones(n, n, dtype=q.dtype))
    # the V side (gdn's products; their scales now per element)
    dq = scale * gam * (dO @ S.T)
    minus = ek * (Vn @ dSp.T)
    kr_sum = (k * minus).sum(0)  # per key: the last row's share of dG from Gn in Kr
    Y = T.T @ dU
    dW = -(dU @ S.T)
    dPm = scale * (dO @ Vn.T) * lower  # j <= i
    # the WY side: K o Gam is dT's operand
    plus = gam * (T.T @ dW)
    dT = (dU @ v.T + dW @ (k * gam).T) * beta[None, :]
    dAm = torch.tril(-(T.T @ dT) @ T.T, -1)
    # the decay products
    Yq, Yr, Yc = _decay_products(dPm, dAm, q, k, beta, G)
    dq = dq + Yq
    plus = plus + Yr
    minus = minus + Yc
    dG = q * dq + beta[:, None] * k * plus - k * minus  # per key
    dG[n - 1] += torch.exp(G[-1]) * (dSp * S).sum(1) + kr_sum
    return _gradients(dq, minus, plus, Y, dG, k, v, beta)


@pytest.mark.parametrize("n", [64, 47, 17, 1])
def test_regrouped_kda_chunk_gradients_equal_autograd(n):
    """Every gradient of one kda chunk from the regrouped formulas (per-key scales, the decay products as 16-row
    reference blocks) equals autograd's in float64, at full and short chunk lengths; gates down to -5 per token
    (FLA's safe_gate bound), where a single reference row per chunk would overflow."""
    x, m, want = _chunk_kda(n, 32, 24, seed=n + 3)
    got = _regrouped_kda(x, m)
    for name in ("q", "k", "v", "beta", "g"):
        err = ((got[name] - want[name]).norm() / want[name].norm()).item()
        assert err < 1e-11, f"d{name}: {err:.2e}"


# ---- kda: the rounding of the decay products' diagonal blocks ----------------------------------------------------
# cuda/tiled/bwd_decay.cuh (bwd_decay_kda_tc_kernel) rounds the off-diagonal blocks' operands to bf16 and takes its
# diagonal blocks on the tensor cores in tf32, around the off-diagonal blocks' reference rows (row side: the block's
# first row r, factors e^(G_r - G_j) >= 1 for its own rows j; column side: the next block's first row s, the
# chunk's last row for the last block, factors e^(G_i - G_s) >= 1), with the pairs j = i (decay 1) left out of the
# products and added exactly. dg, the reverse sum of dG over the chunk, is where that choice shows: each pair (i, j)
# adds the same term to dG_i as it takes from dG_j, so rounding the two sides apart leaves residues that do not
# cancel. This model of the stage, in float64 with the roundings applied where the kernel rounds, checks the choice.
def _bf16(x):
    return x.to(torch.bfloat16).to(torch.float64)


def _tf32(x):
    """Round to tf32 (10-bit mantissa) to nearest, ties away from zero, as cvt.rna.tf32.f32 does."""
    bits = x.to(torch.float32).view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).to(torch.float64)


def _decay_products_rounded(dPm, dAm, q, k, beta, G, diagonal):
    """_decay_products with the kernel's roundings: the off-diagonal blocks' operands in bf16; the diagonal blocks
    element by element ("exact": the kernel's fp32 sum, here without rounding), or as products around the reference
    rows with operands rounded by "tf32" (the pairs j = i apart, exact) or "bf16 with j = i" (inside the products)."""
    n, K = k.shape
    Yq, Yr, Yc = (torch.zeros(n, K, dtype=k.dtype) for _ in range(3))
    X = beta[:, None] * dAm  # beta_i dA_ij, the Yc side's second left operand
    for a in range(0, n // 16):
        r, rows = 16 * a, slice(16 * a, 16 * a + 16)
        if a > 0:  # row side, earlier blocks: j < r
            Kr = _bf16(k[:r] * torch.exp(G[r] - G[:r]))
            up = torch.exp(G[rows] - G[r])
            Yq[rows] += up * (_bf16(dPm[rows, :r]) @ Kr)
            Yr[rows] += up * (_bf16(dAm[rows, :r]) @ Kr)
        if r + 16 < n:  # column side, later blocks: i >= s
            s = r + 16
            e = torch.exp(G[s:] - G[s])
            Yc[rows] += torch.exp(G[s] - G[rows]) * (_bf16(dPm[s:, rows]).T @ _bf16(q[s:] * e) +
                                                     _bf16(X[s:, rows]).T @ _bf16(k[s:] * e))
        if diagonal == "exact":
            for i in range(r, r + 16):
                for j in range(r, i + 1):
                    e = torch.exp(G[i] - G[j])
                    Yq[i] += dPm[i, j] * k[j] * e
                    Yr[i] += dAm[i, j] * k[j] * e
                    Yc[j] += (dPm[i, j] * q[i] + X[i, j] * k[i]) * e
            continue
        rnd, apart = (_tf32, True) if diagonal == "tf32" else (_bf16, False)
        s = min(r + 16, n - 1)
        dP = dPm[rows, rows] - (torch.diag(torch.diag(dPm[rows, rows])) if apart else 0)
        Kd = rnd(k[rows] * torch.exp(G[r] - G[rows]))
        e = torch.exp(G[rows] - G[s])
        Yq[rows] += torch.exp(G[rows] - G[r]) * (rnd(dP) @ Kd)
        Yr[rows] += torch.exp(G[rows] - G[r]) * (rnd(dAm[rows, rows]) @ Kd)
        Yc[rows] += torch.exp(G[s] - G[rows]) * (rnd(dP).T @ rnd(q[rows] * e) + rnd(X[rows, rows]).T @ rnd(k[rows] * e))
        if apart:
            d = torch.diag(dPm[rows, rows])[:, None]
            Yq[rows] += d * k[rows]
            Yc[rows] += d * q[rows]
    return Yq, Yr, Yc


@pytest.mark.parametrize("gates", ["steep", "safe_gate", "mild"])
def test_kda_diagonal_blocks_in_tf32_keep_dg_as_precise_as_the_elementwise_sum(gates):
    """dg's part from the decay products (the reverse sum over a 64-token chunk of q Yq + beta k Yr - k Yc) against
    float64 without rounding: with the diagonal blocks in tf32 and the pairs j = i apart, within twice the error
    of summing them element by element (the rest is the off-diagonal blocks' bf16 rounding); with bf16 operands and
    those pairs inside the products, more than five times it where the gates decay fast (-4.9 a token; FLA's
    safe_gate range of -5 .. 0), which is why the kernel does not do that."""
    gen = torch.Generator().manual_seed(7)
    f64 = torch.float64
    n, K = 64, 128
    q = _bf16(torch.randn(n, K, generator=gen, dtype=f64))
    k = _bf16(torch.nn.functional.normalize(torch.randn(n, K, generator=gen, dtype=f64), dim=-1))
    beta = _bf16(torch.rand(n, generator=gen, dtype=f64))
    u = torch.randn(n, K, generator=gen, dtype=f64)
    g = {"steep": -4.9 + 0.1 * torch.rand(n, K, generator=gen, dtype=f64),
         "safe_gate": (-5 * torch.sigmoid(u)), "mild": torch.nn.functional.logsigmoid(u) / 8}[gates]
    G = torch.cumsum(g, 0)
    dPm = torch.tril(torch.randn(n, n, generator=gen, dtype=f64))
    dAm = torch.tril(torch.randn(n, n, generator=gen, dtype=f64), -1)

    def dg_error(diagonal):
        Yq, Yr, Yc = _decay_products_rounded(dPm, dAm, q, k, beta, G, diagonal)
        dG = q * Yq + beta[:, None] * k * Yr - k * Yc
        return torch.flip(torch.cumsum(torch.flip(dG, [0]), 0), [0])

    Yq, Yr, Yc = _decay_products(dPm, dAm, q, k, beta, G)
    dG = q * Yq + beta[:, None] * k * Yr - k * Yc
    want = torch.flip(torch.cumsum(torch.flip(dG, [0]), 0), [0])
    err = {d: ((dg_error(d) - want).norm() / want.norm()).item() for d in ("exact", "tf32", "bf16 with j = i")}
    assert err["exact"] < 1e-2, err
    assert err["tf32"] < 2 * err["exact"], err
    if gates != "mild":
        assert err["bf16 with j = i"] > 5 * err["exact"], err
