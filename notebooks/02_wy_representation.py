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
# # 2. The WY representation
#
# From the product of per-token transitions to the matrices $A$, $T=(I+A)^{-1}$, $W$, $U$ that the
# chunked kernels compute, checked number by number against the product of transitions and the
# token recurrence with the `deltacp` reference (fp64).
#
# ## Per-token transitions
#
# One token of the gated delta rule (notebook 1) is an affine map of the state:
#
# $$S_t = P_t S_{t-1} + \beta_t k_t v_t^\top,\qquad P_t = (I - \beta_t k_t k_t^\top)\, D_t ,$$
#
# with $D_t = I$ (delta), $e^{g_t} I$ (gdn) or $\operatorname{diag}(e^{g_t})$ (kda). Over a chunk of
# $n$ tokens that starts in state $S$, the end state is $P_n \cdots P_1 S + (\dots)$: a product of
# $n$ "identity minus rank one" matrices, each $K\times K$. Multiplying them one by one is $n$
# sequential rank-one updates. The WY representation (Bischof and Van Loan's name for products of
# Householder reflections, $Q = I - W Y^\top$) writes the product as **diagonal minus one rank-$n$
# correction**, computed with a small triangular solve and matrix products.
#
# ## Derivation
#
# Let $G_i = g_1 + \dots + g_i$ be the within-chunk cumulative log decay (a $K$-vector per token for kda;
# the scalar broadcast for gdn; $0$ for delta) and $\Gamma_i = \operatorname{diag}(e^{G_i})$. Call
# $\tilde u_i = \beta_i\,(v_i - (D_i S_{i-1})^\top k_i)$ what token $i$ really writes ("v_new"), so that
# $S_i = D_i S_{i-1} + k_i \tilde u_i^\top$. Unrolling,
#
# $$S_i = \Gamma_i S + \sum_{j \le i} \Gamma_i \Gamma_j^{-1} k_j\, \tilde u_j^\top ,$$
#
# exactly: the subtractions of the delta rule are all inside the $\tilde u_j$. Put the state just before
# write $i$, $D_i S_{i-1} = \Gamma_i S + \sum_{j<i} \Gamma_i\Gamma_j^{-1} k_j \tilde u_j^\top$, into the definition of $\tilde u_i$:
#
# $$\tilde u_i + \sum_{j<i} \underbrace{\beta_i\, (e^{G_i}\!\odot k_i)\cdot(e^{-G_j}\!\odot k_j)}_{A_{ij}}\; \tilde u_j
#   = \beta_i v_i - \beta_i\, (e^{G_i}\!\odot k_i)^\top S .$$
#
# In matrix form, with rows as tokens and $B = \operatorname{diag}(\beta)$,
#
# $$(I + A)\, \tilde U = B V - B (K e^{G}) S
#   \quad\Longrightarrow\quad
#   \tilde U = \underbrace{T B V}_{U} - \underbrace{T B (K e^{G})}_{W} S,\qquad T = (I+A)^{-1},$$
#
# where $A = \operatorname{strict\_tril}\big(B (K e^G)(K e^{-G})^\top\big)$ is strictly lower triangular, so
# $I + A$ is unit lower triangular and $T$ comes from forward substitution (no pivoting, no division).
# The end state is then
#
# $$S_n = \Gamma_n S + (K e^{G_n - G})^\top \tilde U
#      = \underbrace{\big(\Gamma_n - (K e^{G_n-G})^\top W\big)}_{M\,=\,P_n\cdots P_1} S
#        + \underbrace{(K e^{G_n-G})^\top U}_{H} .$$
#
# So the product of the $n$ transitions is $M = \Gamma_n - (K e^{G_n-G})^\top W$: diagonal minus a rank-$n$
# term. The kernels never form $e^{-G}$ on its own (it overflows for long chunks): every exponential is
# of a difference $G_i - G_j$ with $i \ge j$, masked before the exponential.

# %%
import matplotlib

if "inline" not in matplotlib.get_backend():  # headless: the Agg renderer (Jupyter's inline backend is Agg too)
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from deltacp import reference as ref

rng = np.random.default_rng(7)


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def rel_err(x, y):
    return np.linalg.norm(x - y) / np.linalg.norm(y)


def make_chunk(variant, n, K, V):
    """One chunk of one head: q, k [n, K] (unit keys), v [n, V], gate, beta in (0, 1)."""
    x = dict(q=rng.standard_normal((n, K)), k=unit(rng.standard_normal((n, K))), v=rng.standard_normal((n, V)),
             beta=rng.uniform(0.1, 0.9, n))
    if variant == "gdn":
        x["g"] = -rng.uniform(0.01, 0.3, n)  # log decay <= 0
    elif variant == "kda":
        x["g"] = -rng.uniform(0.01, 0.3, (n, K))
    return x


# %% [markdown]
# ## One gdn chunk, piece by piece
#
# `deltacp.reference.chunk_wy` returns the factors of one chunk of one head. We check each against
# its definition above.

# %%
n, K, V = 16, 8, 6
x = make_chunk("gdn", n, K, V)
wy = ref.chunk_wy("gdn", **x)
G, A, T, W, U = wy["G"], wy["A"], wy["T"], wy["W"], wy["U"]
print({name: arr.shape for name, arr in wy.items()})

# G: cumulative log decay, broadcast along K for gdn
assert np.allclose(G, np.cumsum(x["g"])[:, None] * np.ones(K), rtol=0, atol=1e-15)

# A_ij = beta_i sum_d k_id k_jd e^(G_id - G_jd) for i > j: exponent of a difference, masked first
lower = np.tril(np.ones((n, n), dtype=bool), -1)
diff = np.where(lower[:, :, None], G[:, None, :] - G[None, :, :], -np.inf)  # -inf -> e^... = 0 above the diagonal
A_def = x["beta"][:, None] * np.einsum("id,jd,ijd->ij", x["k"], x["k"], np.exp(diff))
print("A   vs its definition:          ", rel_err(A, A_def))
assert rel_err(A, A_def) < 1e-14

# T = (I + A)^-1: unit lower triangular; equals the finite Neumann series sum_m (-A)^m (A is nilpotent)
I = np.eye(n)
neumann = sum(np.linalg.matrix_power(-A, m) for m in range(n))
print("T (I + A) - I:                  ", np.abs(T @ (I + A) - I).max())
print("T   vs Neumann series:          ", rel_err(T, neumann))
assert np.abs(T @ (I + A) - I).max() < 1e-13 and rel_err(T, neumann) < 1e-13
assert np.allclose(np.diag(T), 1) and np.all(np.triu(T, 1) == 0)

# W and U from T
B = np.diag(x["beta"])
assert rel_err(W, T @ B @ (x["k"] * np.exp(G))) < 1e-14 and rel_err(U, T @ B @ x["v"]) < 1e-14

# %% [markdown]
# ## The numbers agree with the product of transitions
#
# Multiply the $n$ transitions $P_t = (I - \beta_t k_t k_t^\top) D_t$ one by one (the definition), and
# compare with $M = \Gamma_n - (K e^{G_n-G})^\top W$ built from the WY factors. The additive part
# $H = (K e^{G_n-G})^\top U$ must be the end state of the package's token recurrence started from zero,
# and for any start state $S$ the recurrence must end in $M S + H$.

# %%
def transition(variant, k_t, beta_t, g_t=None):
    """P_t = (I - beta k k^T) D_t: the definition of one token's transition, K x K."""
    Kd = k_t.shape[0]
    D = np.eye(Kd) if variant == "delta" else np.diag(np.broadcast_to(np.exp(g_t), (Kd,)))
    return (np.eye(Kd) - beta_t * np.outer(k_t, k_t)) @ D


def product_of_transitions(variant, x):
    P = np.eye(x["k"].shape[1])
    for t in range(x["k"].shape[0]):
        P = transition(variant, x["k"][t], x["beta"][t], None if variant == "delta" else x["g"][t]) @ P
    return P


def check_variant(variant, n, K, V):
    x = make_chunk(variant, n, K, V)
    wy = ref.chunk_wy(variant, **x)
    G, W, U = wy["G"], wy["W"], wy["U"]
    k_to_end = x["k"] * np.exp(G[-1] - G)  # row i: k_i decayed from token i to the chunk end
    M = np.diag(np.exp(G[-1])) - k_to_end.T @ W
    H = k_to_end.T @ U
    P = product_of_transitions(variant, x)
    _, S_from_zero = ref.recurrent_forward(variant, **x)
    S0 = rng.standard_normal((K, V))
    _, S_end = ref.recurrent_forward(variant, **x, initial_state=S0)
    errs = {
        "M vs P_n...P_1": rel_err(M, P),
        "H vs recurrence from 0": rel_err(H, S_from_zero),
        "M S0 + H vs recurrence from S0": rel_err(M @ S0 + H, S_end),
    }
    # the package's own (M, H): from the chunk formula, and by its token-product definition
    Mc, Hc = ref.chunk_affine(variant, **x)
    Mt, Ht = ref.span_affine_tokens(variant, **x)
    errs["package chunk_affine vs ours"] = max(rel_err(Mc, M), rel_err(Hc, H))
    errs["package span_affine_tokens vs P"] = max(rel_err(Mt, P), rel_err(Ht, S_from_zero))
    return errs, (M, P)


print(f"{'check':36s} " + " ".join(f"{v:>9s}" for v in ["delta", "gdn", "kda"]))
results = {v: check_variant(v, 32, 16, 12) for v in ["delta", "gdn", "kda"]}
for name in results["gdn"][0]:
    row = [results[v][0][name] for v in ["delta", "gdn", "kda"]]
    print(f"{name:36s} " + " ".join(f"{e:9.1e}" for e in row))
    assert max(row) < 1e-13, name

# %% [markdown]
# ## $\tilde U = U - W S$ is what each token really writes
#
# The recurrence's own write at token $i$ is $\tilde u_i = \beta_i (v_i - (D_i S_{i-1})^\top k_i)$. We get the
# states $S_{i-1}$ from the package's token recurrence over each prefix and compare with the WY
# formula $U - W S$ for a random start state $S$.

# %%
S = rng.standard_normal((K, V))
u_rec = np.zeros((n, V))
state = S
for i in range(n):
    decayed = np.exp(x["g"][i]) * state  # gdn: D_i S_{i-1}
    u_rec[i] = x["beta"][i] * (x["v"][i] - decayed.T @ x["k"][i])
    prefix = {name: arr[: i + 1] for name, arr in x.items()}
    _, state = ref.recurrent_forward("gdn", **prefix, initial_state=S)  # S_i by the package
v_new = U - W @ S
print("U - W S vs the recurrence's writes:", rel_err(v_new, u_rec))
assert rel_err(v_new, u_rec) < 1e-13

# the package's chunk step computes the same v_new
step = ref.chunk_step("gdn", **x, S0=S)
assert rel_err(step["v_new"], u_rec) < 1e-13

# %% [markdown]
# ## What the factors look like
#
# $A$ is strictly lower triangular and decays away from the diagonal (the gate shrinks
# $e^{G_i - G_j}$ as $i - j$ grows); $T$ is unit lower triangular. The product of transitions and
# its WY form agree to rounding everywhere.

# %%
M, P = results["gdn"][1]
fig, axes = plt.subplots(1, 4, figsize=(14, 3.3))
for ax, (title, mat) in zip(axes, [("A (strictly lower)", A), ("T = (I + A)^-1", T), ("W", W),
                                  ("|M - P_n...P_1| (gdn)", np.abs(M - P))]):
    im = ax.imshow(mat, cmap="magma" if title.startswith("|") else "RdBu_r",
                   **({} if title.startswith("|") else dict(vmin=-np.abs(mat).max(), vmax=np.abs(mat).max())))
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046)
axes[0].set_ylabel("token i"); axes[0].set_xlabel("token j"); axes[2].set_xlabel("key dim")
axes[3].set_xlabel("key dim"); axes[3].set_ylabel("key dim")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Why bother: the work moves into matrix products
#
# Multiplying the transitions one by one costs $n$ dependent rank-one updates of a $K\times K$ (or,
# applied to the state, $K\times V$) matrix: a serial chain of length $n$. The WY form needs
# $A$ ($n^2 K$ multiply-adds, one matrix product), the triangular solve ($\approx n^3/6$; a small
# serial part of size $n$, but on $n\times n$ numbers), and $W$, $U$ (matrix products). On tensor
# cores the matrix products are almost free; that is the whole point of the chunked kernels in
# notebook 3 and in `cuda/`.
#
# **Take away.** $P_n\cdots P_1 = \Gamma_n - (K e^{G_n-G})^\top W$ with $W = (I+A)^{-1} B (K e^G)$,
# and the chunk's input contributes $(K e^{G_n-G})^\top U$ with $U = (I+A)^{-1} B V$: checked above
# to about $10^{-15}$ for delta, gdn and kda.
