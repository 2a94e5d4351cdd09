# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 5. GDN vs KDA vs DPLR: three transition structures, one affine form
#
# All four variants of deltacp move the state by $S_t = P_t S_{t-1} + (\text{rank-one input})$; they
# differ in the structure of the transition $P_t$. This notebook compares the structures, embeds KDA
# (and so GDN) exactly into DPLR with the `deltacp` reference, derives DPLR's chunk form and its affine
# map, and explains why DPLR's $M$ carries a **plus** sign where the delta rule's has a minus.
#
# | variant | token update | transition $P_t$ | input |
# |---|---|---|---|
# | gdn | $S \leftarrow e^{g_t}S$; $S \leftarrow S + \beta_t k_t (v_t - S^\top k_t)^\top$ | $e^{g_t}(I - \beta_t k_t k_t^\top)$ | $\beta_t k_t v_t^\top$ |
# | kda | same with $S \leftarrow \operatorname{diag}(e^{g_t}) S$ | $(I - \beta_t k_t k_t^\top)\operatorname{diag}(e^{g_t})$ | $\beta_t k_t v_t^\top$ |
# | dplr | $S \leftarrow \operatorname{diag}(e^{gk_t}) S + k_t v_t^\top + b_t (a_t^\top S)$ | $\operatorname{diag}(e^{gk_t}) + b_t a_t^\top$ | $k_t v_t^\top$ |
#
# * **GDN**: a scalar times a symmetric "identity minus rank one". Eigenvalues: $e^{g}$ ($K-1$ times)
#   and $e^{g}(1-\beta)$ along $k$. $\lVert P\rVert_2 \le 1$ for $0\le\beta\le 2$.
# * **KDA**: the decay is per key channel and comes first. $P$ is no longer symmetric, but it is similar
#   to the symmetric $D^{1/2}(I-\beta kk^\top)D^{1/2}$: real eigenvalues, $|\lambda| \le \max_i e^{g_i}$, and
#   still $\lVert P\rVert_2 \le 1$.
# * **DPLR** (RWKV-7 family): diagonal plus an *arbitrary* rank one. Eigenvalues can be complex or
#   larger than one; nothing bounds the state unless the model keeps $a, b$ tied (RWKV-7 uses
#   $a = -\hat\kappa$, $b = \hat\kappa\odot\alpha$).
#
# **KDA is a DPLR.** Expand KDA's transition: $(I-\beta kk^\top)D = D - \beta k\,(Dk)^\top$. So KDA is DPLR with
#
# $$a_t = e^{g_t}\odot k_t,\qquad b_t = -\beta_t k_t,\qquad gk_t = g_t,\qquad v^{\text{dplr}}_t = \beta_t v_t .$$
#
# The minus sign of the delta rule has moved into $b$.

# %%
import matplotlib

if "inline" not in matplotlib.get_backend():  # headless: the Agg renderer (Jupyter's inline backend is Agg too)
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from deltacp import reference as ref

rng = np.random.default_rng(5)


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def rel_err(x, y):
    return np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-300)


def head(variant, n, K, V):
    """One head's inputs (rows are tokens) for the package's per-head functions."""
    x = dict(q=rng.standard_normal((n, K)), k=unit(rng.standard_normal((n, K))), v=rng.standard_normal((n, V)))
    if variant == "dplr":
        # RWKV-7's tied choice keeps the transition tame: a = -kappa, b = kappa * alpha
        kappa = unit(rng.standard_normal((n, K)))
        x.update(a=-kappa, b=kappa * rng.uniform(0.1, 0.9, (n, K)), gk=-rng.uniform(0.01, 0.3, (n, K)))
        return x
    x["beta"] = rng.uniform(0.1, 0.9, n)
    x["g"] = -rng.uniform(0.01, 0.3, n if variant == "gdn" else (n, K))
    return x


def kda_as_dplr(x):
    """The DPLR inputs that reproduce a KDA head exactly (see above)."""
    return dict(q=x["q"], k=x["k"], v=x["beta"][:, None] * x["v"], a=np.exp(x["g"]) * x["k"],
                b=-x["beta"][:, None] * x["k"], gk=x["g"])


# %% [markdown]
# ## KDA through DPLR's code path
#
# Run a packed KDA batch through `deltacp.reference.kda` and the same numbers through
# `deltacp.reference.dplr` with the substitution above: outputs and final states agree to rounding,
# for the recurrence and for the chunked form (whose DPLR branch has the plus sign).

# %%
B, T, H, K, V = 1, 150, 2, 16, 12
x = dict(q=rng.standard_normal((B, T, H, K)), k=unit(rng.standard_normal((B, T, H, K))),
         v=rng.standard_normal((B, T, H, V)), g=-rng.uniform(0.01, 0.3, (B, T, H, K)), beta=rng.uniform(0.1, 0.9, (B, T, H)))
cu = np.array([0, 40, 41, 150])
h0 = rng.standard_normal((len(cu) - 1, H, K, V))
as_dplr = dict(q=x["q"], k=x["k"], v=x["beta"][..., None] * x["v"], a=np.exp(x["g"]) * x["k"],
               b=-x["beta"][..., None] * x["k"], gk=x["g"])
for chunk in (None, 32, 64):
    o_kda, ht_kda = ref.kda(**x, initial_state=h0, cu_seqlens=cu, chunk_size=chunk)
    o_dplr, ht_dplr = ref.dplr(**as_dplr, initial_state=h0, cu_seqlens=cu, chunk_size=chunk)
    err = max(rel_err(o_dplr, o_kda), rel_err(ht_dplr, ht_kda))
    print(f"chunk_size={chunk}: dplr(embedded kda) vs kda: {err:.1e}")
    assert err < 1e-13

# GDN is KDA with the gate broadcast along K
xg = dict(x, g=x["g"][..., 0])
o_gdn, _ = ref.gated_delta_rule(**xg, initial_state=h0, cu_seqlens=cu)
o_kda, _ = ref.kda(**dict(x, g=np.repeat(xg["g"][..., None], K, axis=-1)), initial_state=h0, cu_seqlens=cu)
assert rel_err(o_kda, o_gdn) < 1e-14
print("gdn == kda with a broadcast gate")

# %% [markdown]
# ## The transitions, from the package
#
# `span_affine_tokens` over a single token returns that token's $(P_t, \text{input})$ as computed by
# the package. Eigenvalues of many such $P_t$: GDN's lie at exactly $e^{g}$ and $e^{g}(1-\beta)$;
# KDA's are real and inside $[-1, 1]$; DPLR's with untied random $a, b$ leave the real line and the unit
# disc, while RWKV-7's tied $a, b$ stay inside.

# %%
def token_transition(variant, x, t):
    one = {name: arr[t:t + 1] for name, arr in x.items()}
    P, _ = ref.span_affine_tokens(variant, **one)
    return P


n_tok, Ke = 200, 8
eig = {}
xg1 = head("gdn", n_tok, Ke, 4)
eig["gdn"] = np.concatenate([np.linalg.eigvals(token_transition("gdn", xg1, t)) for t in range(n_tok)])
for t in range(n_tok):  # exactly e^g (K - 1 times) and e^g (1 - beta)
    lam = np.sort(np.linalg.eigvals(token_transition("gdn", xg1, t)).real)
    decay = np.exp(xg1["g"][t])
    expected = np.sort(np.r_[np.full(Ke - 1, decay), decay * (1 - xg1["beta"][t])])
    assert np.abs(lam - expected).max() < 1e-12
xk1 = head("kda", n_tok, Ke, 4)
xk1["beta"] = rng.uniform(0.1, 1.9, n_tok)  # beta > 1 gives negative eigenvalues
eig["kda"] = np.concatenate([np.linalg.eigvals(token_transition("kda", xk1, t)) for t in range(n_tok)])
xd_tied = head("dplr", n_tok, Ke, 4)
eig["dplr, tied a, b (RWKV-7)"] = np.concatenate(
    [np.linalg.eigvals(token_transition("dplr", xd_tied, t)) for t in range(n_tok)])
xd_free = dict(xd_tied, a=rng.standard_normal((n_tok, Ke)), b=rng.standard_normal((n_tok, Ke)))
eig["dplr, free a, b"] = np.concatenate([np.linalg.eigvals(token_transition("dplr", xd_free, t)) for t in range(n_tok)])

assert np.abs(eig["kda"].imag).max() < 1e-10 and np.abs(eig["kda"]).max() <= 1 + 1e-12
assert np.abs(eig["dplr, free a, b"].imag).max() > 0.1 and np.abs(eig["dplr, free a, b"]).max() > 1.5
assert np.abs(eig["dplr, tied a, b (RWKV-7)"]).max() <= 1 + 1e-12

fig, axes = plt.subplots(1, 4, figsize=(14, 3.6), sharex=True, sharey=True)
circle = np.exp(1j * np.linspace(0, 2 * np.pi, 200))
for ax, (name, lam) in zip(axes, eig.items()):
    ax.plot(circle.real, circle.imag, "k:", lw=0.8)
    ax.scatter(lam.real, lam.imag, s=4, alpha=0.5)
    ax.set_title(name, fontsize=10)
    ax.set_aspect("equal")
    ax.set_xlabel("Re")
axes[0].set_ylabel("Im")
axes[0].set_xlim(-2.5, 2.5); axes[0].set_ylim(-2, 2)
plt.tight_layout()
plt.show()
for name, lam in eig.items():
    print(f"{name:28s} max |lambda| = {np.abs(lam).max():.3f}, max |Im| = {np.abs(lam.imag).max():.3f}")

# %% [markdown]
# ## DPLR's chunk form and its plus sign
#
# DPLR's low-rank term *reads* the previous state: $\tilde u_i = a_i^\top S_{i-1}$ ($1\times V$), then writes
# $b_i \tilde u_i$. With $G$ the within-chunk cumulative log decay and $G_{i-1}$ the decay before token
# $i$ ($G_0 = 0$), the state before token $i$ is
# $S_{i-1} = \Gamma_{i-1} S + \sum_{j<i}\Gamma_{i-1}\Gamma_j^{-1}(k_j v_j^\top + b_j \tilde u_j)$, so
#
# $$\tilde u_i = (e^{G_{i-1}}\!\odot a_i)^\top S + \sum_{j<i} \underbrace{(e^{G_{i-1}}\!\odot a_i)\cdot(e^{-G_j}\!\odot k_j)}_{(A_k)_{ij}} v_j
#   + \sum_{j<i} \underbrace{(e^{G_{i-1}}\!\odot a_i)\cdot(e^{-G_j}\!\odot b_j)}_{A_{ij}} \tilde u_j .$$
#
# In matrix form $(I - A)\tilde U = (A_{\text{lr}} e^{G_{\text{prev}}}) S + A_k V$, hence
#
# $$\tilde U = W S + U,\qquad T = (I - A)^{-1},\quad W = T\,(A_{\text{lr}} e^{G_{\text{prev}}}),\quad U = T A_k V,$$
#
# $$S' = \Gamma_n S + (K e^{G_n-G})^\top V + (B_{\text{lr}} e^{G_n-G})^\top \tilde U
#      = \underbrace{\big(\Gamma_n + (B_{\text{lr}} e^{G_n-G})^\top W\big)}_{M} S
#        + \underbrace{(K e^{G_n-G})^\top V + (B_{\text{lr}} e^{G_n-G})^\top U}_{H}.$$
#
# **Why plus.** In the delta rule the low-rank term is a *correction*: the write is
# $\beta(v - S^\top k)$, "value minus what the state already predicts", so the state enters $\tilde U$ with a
# minus ($\tilde U = U - WS$) and $M = \Gamma_n - (K e^{G_n - G})^\top W$. DPLR simply *adds* $b\,(a^\top S)$: the state
# enters with a plus, and whatever sign the model wants lives inside $b$. For KDA embedded as DPLR,
# $b = -\beta k$ carries the delta rule's minus; the two formulas give the same $M$.

# %%
n, K, V = 32, 16, 12
xd = head("dplr", n, K, V)
wy = ref.chunk_wy("dplr", **xd)
print({name: arr.shape for name, arr in wy.items()})
G = wy["G"]
G_prev = np.vstack([np.zeros((1, K)), G[:-1]])
a_prev = xd["a"] * np.exp(G_prev)
lower = np.tril(np.ones((n, n), dtype=bool), -1)


def masked_decay(G_rows, G_cols):
    """e^(G_rows_i - G_cols_j) per key dim for i > j (masked before the exponential), else 0."""
    return np.exp(np.where(lower[:, :, None], G_rows[:, None, :] - G_cols[None, :, :], -np.inf))


A_def = np.einsum("id,jd,ijd->ij", xd["a"], xd["b"], masked_decay(G_prev, G))
Ak_def = np.einsum("id,jd,ijd->ij", xd["a"], xd["k"], masked_decay(G_prev, G))
assert rel_err(wy["A"], A_def) < 1e-13 and rel_err(wy["Ak"], Ak_def) < 1e-13
assert np.abs(wy["T"] @ (np.eye(n) - wy["A"]) - np.eye(n)).max() < 1e-12  # T = (I - A)^-1: note the minus
assert rel_err(wy["W"], wy["T"] @ a_prev) < 1e-13 and rel_err(wy["U"], wy["T"] @ wy["Ak"] @ xd["v"]) < 1e-13

# the affine map, with the plus sign, against the product of the package's per-token transitions
to_end = np.exp(G[-1] - G)
M = np.diag(np.exp(G[-1])) + (xd["b"] * to_end).T @ wy["W"]
H = (xd["k"] * to_end).T @ xd["v"] + (xd["b"] * to_end).T @ wy["U"]
P = np.eye(K)
for t in range(n):
    P = token_transition("dplr", xd, t) @ P
_, S_from_zero = ref.recurrent_forward("dplr", **xd)
print("dplr  M = D_n + (B e^(G_n-G))^T W  vs product of transitions:", rel_err(M, P))
print("dplr  H vs recurrence from 0:", rel_err(H, S_from_zero))
assert rel_err(M, P) < 1e-13 and rel_err(H, S_from_zero) < 1e-13

# U~ = U + W S is the recurrence's low-rank read-out a_i^T S_{i-1}
S = rng.standard_normal((K, V))
readout = np.zeros((n, V))
state = S
for i in range(n):
    readout[i] = xd["a"][i] @ state
    _, state = ref.recurrent_forward("dplr", **{name: arr[: i + 1] for name, arr in xd.items()}, initial_state=S)
assert rel_err(wy["U"] + wy["W"] @ S, readout) < 1e-13
assert rel_err(ref.chunk_step("dplr", **xd, S0=S)["v_new"], readout) < 1e-13
print("U + W S == a_i^T S_(i-1) of the recurrence")

# %% [markdown]
# ### The same chunk of KDA, told both ways
#
# For KDA embedded as DPLR the two factorisations are tied exactly: with $B=\operatorname{diag}(\beta)$,
# $I - A^{\text{dplr}} = B^{-1}(I + A^{\text{kda}})B$, so $W^{\text{dplr}} = B^{-1}W^{\text{kda}}$ and
# $(B_{\text{lr}} e^{G_n-G})^\top W^{\text{dplr}} = -(K e^{G_n-G})^\top W^{\text{kda}}$: the plus sign and $b = -\beta k$ together
# give the delta rule's minus.

# %%
xk = head("kda", n, K, V)
wk = ref.chunk_wy("kda", **xk)
xe = kda_as_dplr(xk)
we = ref.chunk_wy("dplr", **xe)
beta = xk["beta"][:, None]
to_end = np.exp(wk["G"][-1] - wk["G"])
M_kda = np.diag(np.exp(wk["G"][-1])) - (xk["k"] * to_end).T @ wk["W"]
M_dplr = np.diag(np.exp(we["G"][-1])) + (xe["b"] * to_end).T @ we["W"]
checks = {
    "W_dplr == W_kda / beta": rel_err(we["W"], wk["W"] / beta),
    "I - A_dplr == B^-1 (I + A_kda) B": rel_err(np.eye(n) - we["A"], (np.eye(n) + wk["A"]) * xk["beta"][None, :] / beta),
    "M (kda, minus) == M (dplr, plus)": rel_err(M_dplr, M_kda),
    "KDA write == beta v - beta * DPLR read-out": rel_err(wk["U"] - wk["W"] @ S, beta * xk["v"] - beta * (we["U"] + we["W"] @ S)),
}
for name, err in checks.items():
    print(f"{name:44s} {err:.1e}")
    assert err < 1e-13

# %% [markdown]
# ## What the structure costs, and what it means for CP
#
# * **Chunk matrices.** GDN and KDA need one $n\times n$ system, $A$, and (for outputs) one
#   $\operatorname{tril}(Q e^G (K e^{-G})^\top)$. DPLR needs two systems' worth, $A_{ab}$ and $A_{ak}$, and two
#   output matrices ($Q$ against $K$ and against $B_{\text{lr}}$): about twice the intra-chunk work and more
#   intermediates to keep for the backward.
# * **Gates.** GDN's scalar decay factors out of the $K$-sum, $A_{ij} = \beta_i (k_i\cdot k_j)\,e^{G_i-G_j}$:
#   one matrix product, then an elementwise scale. KDA's and DPLR's per-channel decay sits *inside* the
#   sum, so the kernels scale the operands ($K e^{G}$, $K e^{-G}$, relative to a reference point for
#   range) before the product.
# * **CP.** All three are affine per span, so context parallelism (notebook 4) is the same: exchange
#   $(M_r, H_r)$, fold. For GDN and KDA every $\lVert P_t\rVert_2\le 1$, so the chain of maps cannot amplify
#   rounding errors. DPLR with untied $a, b$ has no such bound: below, the spectral norm of a chunk's $M$.

# %%
norms = {}
for name, make in [("kda", lambda: head("kda", 64, K, V)), ("dplr tied (RWKV-7)", lambda: head("dplr", 64, K, V)),
                   ("dplr free a, b", lambda: dict(head("dplr", 64, K, V), a=0.5 * rng.standard_normal((64, K)),
                                                   b=0.5 * rng.standard_normal((64, K))))]:
    variant = "kda" if name == "kda" else "dplr"
    norms[name] = [np.linalg.norm(ref.chunk_affine(variant, **make())[0], 2) for _ in range(20)]
    print(f"{name:20s} ||M||_2 over 20 random chunks of 64 tokens: min {min(norms[name]):.2e}, max {max(norms[name]):.2e}")
assert max(norms["kda"]) <= 1 + 1e-12
assert max(norms["dplr free a, b"]) > 1

# %% [markdown]
# **Take away.** GDN $\subset$ KDA $\subset$ DPLR: $P_t$ goes from scalar times symmetric rank-one update, to
# per-channel decay then rank-one update, to diagonal plus any rank one. All three have the chunked
# WY form and the affine $(M, H)$ map; DPLR's $M = \Gamma_n + (B e^{G_n-G})^\top W$ has a plus sign
# because its low-rank term adds a read-out of the state instead of subtracting a prediction, and the
# delta rule's minus reappears inside $b = -\beta k$ when KDA is written as a DPLR.
