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
# # 1. The delta rule as online regression
#
# This notebook derives the delta rule as one step of stochastic gradient descent on a
# regression loss, then checks with the `deltacp` reference (fp64, C++ Eigen) what the step size
# $\beta$ and the gate $g$ do: exact writes, overshoot, how the state norm behaves over time and
# how quickly old content is forgotten.
#
# **The recurrence** (one sequence, one head; state $S \in \mathbb{R}^{K\times V}$; docs/design.md section 2):
#
# $$S \leftarrow D_t S,\qquad u_t = \beta_t\,(v_t - S^\top k_t),\qquad S \leftarrow S + k_t u_t^\top,\qquad o_t = S^\top (\text{scale}\; q_t)$$
#
# with $D_t = I$ (DeltaNet, "delta"), $D_t = e^{g_t} I$ (Gated DeltaNet, "gdn") or
# $D_t = \operatorname{diag}(e^{g_t})$ (Kimi Delta Attention, "kda").
#
# **Online regression.** Read the state as a linear map from keys to values, $k \mapsto S^\top k$,
# and ask it to fit the pair $(k_t, v_t)$ that arrives at time $t$:
#
# $$\mathcal{L}_t(S) = \tfrac12 \lVert S^\top k_t - v_t \rVert^2, \qquad
#   \nabla_S \mathcal{L}_t = k_t\,(S^\top k_t - v_t)^\top .$$
#
# One gradient step with learning rate $\beta_t$ is
#
# $$S - \beta_t \nabla_S \mathcal{L}_t = S + \beta_t\, k_t (v_t - S^\top k_t)^\top = S + k_t u_t^\top ,$$
#
# exactly the delta rule. Plain linear attention instead adds $k_t v_t^\top$ whatever the state
# already predicts; the delta rule only writes the *error* $v_t - S^\top k_t$.
# Equivalently, $S \leftarrow (I - \beta_t k_t k_t^\top) S + \beta_t k_t v_t^\top$: a rank-one
# transition plus a rank-one input, the structure every later notebook builds on.

# %%
import matplotlib

if "inline" not in matplotlib.get_backend():  # headless: the Agg renderer (Jupyter's inline backend is Agg too)
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

import deltacp
from deltacp import reference as ref

rng = np.random.default_rng(2024)


def unit(x):
    """Rows scaled to unit L2 norm (the models L2-normalise keys)."""
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def rel_err(x, y):
    return np.linalg.norm(x - y) / np.linalg.norm(y)


print("deltacp", getattr(deltacp, "__version__", "?"))

# %% [markdown]
# ## One token is one gradient step
#
# Feed a single token to `deltacp.reference.delta_rule` from a random initial state and compare
# the final state with the gradient step written above. With $\lVert k\rVert = 1$ the loss after
# the step is $(1-\beta)^2$ times the loss before: $\beta = 1$ writes the pair exactly.

# %%
K, V = 16, 8
h0 = rng.standard_normal((K, V))
k1 = unit(rng.standard_normal(K))
v1 = rng.standard_normal(V)


def one_token(beta):
    """Final state after one delta-rule token (B = T = H = 1) from h0, computed by the package."""
    q = k1.reshape(1, 1, 1, K)
    _, ht = ref.delta_rule(q, k1.reshape(1, 1, 1, K), v1.reshape(1, 1, 1, V), np.full((1, 1, 1), beta),
                           scale=1.0, initial_state=h0.reshape(1, 1, K, V), output_final_state=True)
    return ht[0, 0]


loss = lambda S: 0.5 * np.sum((S.T @ k1 - v1) ** 2)
for beta in [0.25, 0.5, 1.0]:
    S1 = one_token(beta)
    gradient_step = h0 - beta * np.outer(k1, h0.T @ k1 - v1)
    err = rel_err(S1, gradient_step)
    print(f"beta={beta:4}: |package - gradient step| / |.| = {err:.1e}   "
          f"loss after / before = {loss(S1) / loss(h0):.4f}   (1-beta)^2 = {(1 - beta) ** 2:.4f}")
    assert err < 1e-14
    assert abs(loss(S1) / loss(h0) - (1 - beta) ** 2) < 1e-12
assert loss(one_token(1.0)) < 1e-28  # beta = 1: S^T k = v exactly after the write

# %% [markdown]
# ## Reading the whole state $S_t$ at every token through the package
#
# The package returns the outputs $o_t = S_t^\top(\text{scale}\,q_t)$ and the final state. To watch
# $S_t$ evolve we ask with $K$ heads at once: every head gets the same keys, values, $\beta$ and
# gate, and head $j$ queries with the basis vector $e_j$ (scale 1). Head $j$'s output at token $t$
# is then row $j$ of $S_t$. No re-implementation, only a clever query.

# %%
def state_trajectory(fn, k, v, beta=None, g=None, h0=None, **extra):
    """S_t (T x K x V) of one head, read from the package's outputs of K identical heads.

    fn is a deltacp.reference function; k [T, K], v [T, V], beta [T], g [T] (gdn), [T, K] (kda/dplr),
    extra: per-token tensors like a, b given as [T, K]. Returns S_1 .. S_T.
    """
    T, Kd = k.shape
    Vd = v.shape[1]
    heads = lambda x: np.repeat(x[None, :, None], Kd, axis=2)  # [T, ...] -> [1, T, K heads, ...]
    q = np.broadcast_to(np.eye(Kd)[None, None], (1, T, Kd, Kd)).copy()
    args = dict(scale=1.0, output_final_state=False)
    if h0 is not None:
        args["initial_state"] = np.broadcast_to(h0, (1, Kd, Kd, Vd)).copy()
    tensors = {name: heads(x) for name, x in extra.items()}
    if beta is not None:
        tensors["beta"] = heads(beta)
    if g is not None:
        tensors["gk" if fn is ref.dplr else "g"] = heads(g)
    o, _ = fn(q, heads(k), heads(v), **tensors, **args)
    return o[0]  # [T, K heads = rows of S, V]


def linear_attention(q, k, v, g=None, **kw):
    """Plain (gated) linear attention S <- diag(e^g) S + k v^T: the package's dplr with a = b = 0."""
    zeros = np.zeros(k.shape)  # [B, T, H, K]
    return ref.dplr(q, k, v, a=zeros, b=zeros, gk=zeros if g is None else g, **kw)


# check the trick once against the package's own final state
T0 = 7
kk, vv, bb = unit(rng.standard_normal((T0, K))), rng.standard_normal((T0, V)), rng.uniform(0.2, 1.0, T0)
traj = state_trajectory(ref.delta_rule, kk, vv, beta=bb, h0=h0)
_, ht = ref.delta_rule(kk[None, :, None], kk[None, :, None], vv[None, :, None], bb[None, :, None],
                       initial_state=h0[None, None], output_final_state=True)
assert rel_err(traj[-1], ht[0, 0]) < 1e-14
print("trajectory trick: S_T matches the package's final state, rel err", rel_err(traj[-1], ht[0, 0]))

# %% [markdown]
# ## $\beta$: how far each write moves
#
# Write the same pair $(k, v)$ again and again. The residual $r_t = S_t^\top k - v$ obeys
# $r_t = (1-\beta)\, r_{t-1}$ (with $\lVert k \rVert = 1$), so it shrinks geometrically for
# $0<\beta<1$, vanishes at once for $\beta=1$, overshoots with alternating sign for $1<\beta<2$
# (the transition $I-\beta kk^\top$ has the negative eigenvalue $1-\beta$ along $k$), and is
# reflected without loss at $\beta = 2$ (a Householder reflection).

# %%
steps = 12
fig, ax = plt.subplots(figsize=(6, 3.5))
for beta in [0.25, 0.5, 1.0, 1.5, 1.9]:
    traj = state_trajectory(ref.delta_rule, np.tile(k1, (steps, 1)), np.tile(v1, (steps, 1)),
                            beta=np.full(steps, beta), h0=h0)
    r = np.array([S.T @ k1 - v1 for S in traj])
    r0 = h0.T @ k1 - v1
    expected = np.array([(1 - beta) ** (t + 1) * r0 for t in range(steps)])
    assert np.abs(r - expected).max() < 1e-12 * np.abs(r0).max(), beta
    ax.semilogy(np.arange(1, steps + 1), np.maximum(np.linalg.norm(r, axis=1), 1e-17), "o-", ms=3, label=f"beta={beta}")
ax.set_xlabel("writes of the same pair")
ax.set_ylabel("|S^T k - v|")
ax.set_title("residual shrinks by |1 - beta| per write")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
print("r_t = (1 - beta)^t r_0 holds for every beta to 1e-12")

# %% [markdown]
# ## Many pairs: the delta rule solves the regression, linear attention does not
#
# Stream $N < K$ pairs with correlated (non-orthogonal) unit keys, over and over, with $\beta=1$.
# Each write projects the state onto the set $\{S : S^\top k_t = v_t\}$: this is Kaczmarz's method
# for the linear system $K_{\text{pairs}} S = V_{\text{pairs}}$, which converges to its minimum-norm solution $S^*$. Plain linear
# attention ($S \mathrel{+}= k v^\top$) keeps the cross-talk $\sum_{j\neq i} (k_j\cdot k_i)\, v_j$ forever.

# %%
N, K2, V2, passes = 12, 32, 8, 60
common = rng.standard_normal(K2)
keys = unit(rng.standard_normal((N, K2)) + 0.5 * common)  # correlated keys, |cos| ~ 0.2 between pairs
vals = rng.standard_normal((N, V2))
print("mean |cos| between keys:", np.abs(keys @ keys.T - np.eye(N)).sum() / (N * (N - 1)))

stream_k, stream_v = np.tile(keys, (passes, 1)), np.tile(vals, (passes, 1))
recall_err = lambda S: np.linalg.norm(keys @ S - vals) / np.linalg.norm(vals)

delta_traj = state_trajectory(ref.delta_rule, stream_k, stream_v, beta=np.ones(N * passes))
half_traj = state_trajectory(ref.delta_rule, stream_k, stream_v, beta=np.full(N * passes, 0.5))
lin_traj = state_trajectory(linear_attention, stream_k, stream_v)
delta_err = [recall_err(delta_traj[(p + 1) * N - 1]) for p in range(passes)]
half_err = [recall_err(half_traj[(p + 1) * N - 1]) for p in range(passes)]
# linear attention after p passes holds p * sum k v^T: compare its best rescaling, the first-pass state
lin_err = recall_err(lin_traj[N - 1])

fig, ax = plt.subplots(figsize=(6, 3.5))
ax.semilogy(range(1, passes + 1), delta_err, "o-", ms=3, label="delta rule, beta=1")
ax.semilogy(range(1, passes + 1), half_err, "s-", ms=3, label="delta rule, beta=0.5")
ax.axhline(lin_err, color="k", ls="--", label="linear attention (any number of passes)")
ax.set_xlabel("passes over the N pairs")
ax.set_ylabel("|K S - V| / |V|")
ax.set_title("recall error of all stored pairs")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
print(f"recall error: delta after 1 pass {delta_err[0]:.3f}, after {passes} passes {delta_err[-1]:.1e}; "
      f"linear attention {lin_err:.3f}")
assert delta_err[-1] < 1e-8 and lin_err > 0.1
# Each write is an orthogonal projection onto a set that contains the minimum-norm solution S*
# (reached from S_0 = 0), so the distance to S* can never grow: Kaczmarz's monotonicity.
S_star = np.linalg.lstsq(keys, vals, rcond=None)[0]
dist = np.linalg.norm(delta_traj - S_star, axis=(1, 2))
assert np.all(np.diff(dist) <= 1e-12) and dist[-1] < 1e-8 * np.linalg.norm(S_star)
print(f"|S_t - S*| never grows and ends at {dist[-1]:.1e}")

# %% [markdown]
# ## $g$: forgetting, and the state norm over time
#
# The gate multiplies the state by $e^{g_t}$ before the write. The transition of one token is
# $P_t = e^{g_t}(I - \beta_t k_t k_t^\top)$, whose spectral norm is $e^{g_t}$ when
# $0 \le \beta_t \le 2$ and $\lVert k_t\rVert = 1$. The state is affine in the initial state,
# $S_t = P_t\cdots P_1\, h_0 + (\text{terms without } h_0)$, so the part of $S_t$ that still
# remembers $h_0$ is the difference of two runs, with $h_0$ and with $0$, and it obeys
#
# $$\lVert S_t(h_0) - S_t(0) \rVert_F \le e^{g_1 + \dots + g_t}\, \lVert h_0 \rVert_F .$$
#
# Even without a gate ($g = 0$) the delta rule forgets: each write replaces the component of
# the state along $k_t$. The gate adds a uniform exponential forgetting on top.
#
# The state norm tells the same story from the other side: linear attention's state grows like
# $\sqrt t$ on a random stream (it only adds), the delta rule's stays level (each write replaces
# what the state says about $k_t$), and a gate bounds either.

# %%
T, K3, V3 = 600, 32, 16
ks = unit(rng.standard_normal((T, K3)))
vs = rng.standard_normal((T, V3))
betas = rng.uniform(0.3, 1.0, T)
H0 = rng.standard_normal((K3, V3))

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
for gval, color in [(0.0, "C0"), (-0.01, "C1"), (-0.05, "C2")]:
    g = np.full(T, gval)
    with_h0 = state_trajectory(ref.gated_delta_rule, ks, vs, beta=betas, g=g, h0=H0)
    without = state_trajectory(ref.gated_delta_rule, ks, vs, beta=betas, g=g)
    memory = np.linalg.norm(with_h0 - without, axis=(1, 2)) / np.linalg.norm(H0)
    bound = np.exp(np.cumsum(g))
    assert np.all(memory <= bound * (1 + 1e-12)), gval
    ax1.semilogy(range(1, T + 1), memory, color=color, label=f"g={gval}")
    ax1.semilogy(range(1, T + 1), bound, color=color, ls=":", lw=1)
    ax2.plot(range(1, T + 1), np.linalg.norm(without, axis=(1, 2)), color=color, label=f"delta rule, g={gval}")
    if gval == -0.05:
        gated_lin = state_trajectory(linear_attention, ks, vs, g=np.full((T, K3), gval))
        ax2.plot(range(1, T + 1), np.linalg.norm(gated_lin, axis=(1, 2)), color=color, ls="--",
                 label=f"linear attention, g={gval}")
lin = state_trajectory(linear_attention, ks, vs)
lin_norm = np.linalg.norm(lin, axis=(1, 2))
delta_norm = np.linalg.norm(state_trajectory(ref.delta_rule, ks, vs, beta=betas), axis=(1, 2))
ax2.plot(range(1, T + 1), lin_norm, color="k", ls="--", label="linear attention, g=0")
ax1.set_xlabel("token t"); ax1.set_ylabel("|S_t(h0) - S_t(0)| / |h0|")
ax1.set_title("memory of h0 (dotted: bound e^(g_1+...+g_t))")
ax1.set_ylim(1e-14, 2); ax1.legend(fontsize=8)
ax2.set_xlabel("token t"); ax2.set_ylabel("|S_t|_F"); ax2.set_title("state norm on a random stream")
ax2.legend(fontsize=8)
plt.tight_layout()
plt.show()

growth = lambda x: x[-1] / x[T // 4 - 1]
print(f"norm growth from t={T // 4} to t={T}: linear attention x{growth(lin_norm):.2f} "
      f"(sqrt(4) = 2), delta rule x{growth(delta_norm):.2f}")
assert growth(lin_norm) > 1.6 and growth(delta_norm) < 1.25

# %% [markdown]
# ## What to take away
#
# * The delta rule is SGD on $\tfrac12\lVert S^\top k_t - v_t\rVert^2$ with step $\beta_t$: it writes the
#   prediction error, so repeated or correlated keys do not pile up (Kaczmarz, not accumulation).
# * $\beta$ sets how far the state moves along $k_t$: the residual scales by $1-\beta$; $\beta>1$ gives
#   the transition a negative eigenvalue.
# * The gate $g$ scales the whole state by $e^{g}$ per token: the memory of anything older than $t$
#   tokens is bounded by $e^{\sum g}$. Both are parts of one per-token transition
#   $P_t = (I - \beta_t k_t k_t^\top) D_t$ — notebook 2 multiplies many of them together.
