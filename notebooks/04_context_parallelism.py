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
# # 4. Context parallelism: all-gather the affine maps, merge, run locally
#
# A sequence too long for one GPU is cut into contiguous slices, one per rank. Every rank needs the
# state at its slice's start, which depends on all earlier tokens. Notebook 3 showed that any span
# of tokens acts on the state as an affine map $S \mapsto M S + H$ that depends only on the span's own
# tokens. So each rank can summarise its slice as $(M_r, H_r)$ **before** knowing its start state,
# the ranks exchange these small summaries, and each rank folds the earlier ones into its start state.
# We do this by hand with the `deltacp` reference, then check the package's simulated CP
# (`deltacp.reference.cp_simulate`), forward and backward, and finally measure how rounding in the
# chain of maps behaves in fp32 versus bf16.
#
# ## The algorithm (docs/design.md section 4)
#
# Packed batch ($B=1$, global `cu_seqlens`); rank $r$ holds tokens $[b_r, e_r)$.
#
# 1. **Local summary.** Over its *last* local segment (the one that continues on rank $r+1$), starting
#    from $S = 0$, $M = I$, rank $r$ folds its chunks into $(M_r, H_r)$: $M_r$ is $K\times K$, $H_r$ is
#    $K\times V$, fp32.
# 2. **All-gather** $[H_r \mid M_r]$: one $[HV, K, V+K]$ buffer per rank. The traffic does not depend on
#    the sequence length.
# 3. **Merge.** Rank $r$'s start state is the fold over the earlier ranks $j$ of the same sequence,
#    in order, $S \leftarrow M_j S + H_j$, started from the sequence's initial state $h_0$ (zero if none).
# 4. **Local forward** with that start state: the ordinary chunked kernel.
#
# **Backward, mirrored.** With $L = \sum o \cdot \mathrm{d}o + \sum h_T\cdot \mathrm{d}h_T$, the gradient
# reaching the start state of a span is $\mathrm{d}S_{\text{start}} = M^\top \mathrm{d}S_{\text{end}} + \mathrm{d}H$, where
# $\mathrm{d}H$ is what the span's own outputs send back (independent of $S_{\text{start}}$, since the outputs are
# affine in it). Each rank summarises its *first* segment as $(M_r^\top, \mathrm{d}H_r)$, the ranks
# all-gather, and the fold runs from the later ranks down: $\mathrm{d}S \leftarrow M_j^\top \mathrm{d}S + \mathrm{d}H_j$,
# started from $\mathrm{d}h_T$. Each rank then runs its local backward with that incoming $\mathrm{d}S$.

# %%
import matplotlib

if "inline" not in matplotlib.get_backend():  # headless: the Agg renderer (Jupyter's inline backend is Agg too)
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from deltacp import reference as ref

rng = np.random.default_rng(11)


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def rel_err(x, y):
    return np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-300)


def head_inputs(variant, n, K, V, beta=(0.1, 0.9), g=(0.01, 0.2)):
    """One head's inputs, rows are tokens (per-head functions of the package)."""
    x = dict(q=rng.standard_normal((n, K)), k=unit(rng.standard_normal((n, K))), v=rng.standard_normal((n, V)),
             beta=rng.uniform(*beta, n))
    if variant == "gdn":
        x["g"] = -rng.uniform(*g, n)
    elif variant == "kda":
        x["g"] = -rng.uniform(*g, (n, K))
    return x


def rows(x, t0, t1):
    return {name: arr[t0:t1] for name, arr in x.items()}


# %% [markdown]
# ## By hand: one sequence, four ranks
#
# $T = 320$ tokens of one gdn head, cut at 70, 150 and 260 (not on chunk boundaries, unequal
# slices), with an initial state $h_0$.

# %%
T, K, V, C = 320, 32, 16, 64
x = head_inputs("gdn", T, K, V)
h0 = rng.standard_normal((K, V))
bounds = [0, 70, 150, 260, T]
world = len(bounds) - 1

# 1. each rank's summary of its own tokens, from S = 0 (chunks aligned at the rank's first token)
maps = [ref.span_affine("gdn", **rows(x, bounds[r], bounds[r + 1]), chunk_size=C) for r in range(world)]

# 2. the all-gather buffer: [world, K, V + K] for this one head (fp32 on the wire)
gathered = np.stack([np.concatenate([H, M], axis=1) for M, H in maps]).astype(np.float32)
print(f"all-gather: {world} x [K, V + K] = {gathered.shape}, {gathered.nbytes} bytes in all "
      f"(the slice lengths do not enter)")

# 3. merge: start states by folding the earlier ranks' maps from h0
start = [h0]
for r in range(world - 1):
    M, H = maps[r]
    start.append(M @ start[-1] + H)
for r in range(world):
    _, S_true = ref.recurrent_forward("gdn", **rows(x, 0, bounds[r]), initial_state=h0) if r else (None, h0)
    err = rel_err(start[r], S_true)
    print(f"rank {r}: start state from the merge vs the recurrence up to token {bounds[r]:3d}: {err:.1e}")
    assert err < 1e-13

# 4. local chunked forward on each rank, from its merged start state
o_ranks, S_end = [], None
for r in range(world):
    local = ref.chunk_states("gdn", **rows(x, bounds[r], bounds[r + 1]), initial_state=start[r], chunk_size=C)
    o_ranks.append(local["o"])
    S_end = local["states"][-1]
o_single, ht_single = ref.recurrent_forward("gdn", **x, initial_state=h0)
print("outputs of the 4 ranks vs one process:", rel_err(np.concatenate(o_ranks), o_single),
      "  final state:", rel_err(S_end, ht_single))
assert rel_err(np.concatenate(o_ranks), o_single) < 1e-13 and rel_err(S_end, ht_single) < 1e-13

# %% [markdown]
# ### Backward, mirrored
#
# Each rank summarises its span as $(M_r^\top, \mathrm{d}H_r)$ (`span_affine_backward`); the fold from the
# last rank down gives the gradient at every rank boundary, which must equal $\mathrm{d}h_0$ of the
# package's backward run on the suffix that starts there. With it, each rank's local backward
# reproduces the single-process gradients.

# %%
do = rng.standard_normal((T, V))
dht = rng.standard_normal((K, V))
bwd_maps = [ref.span_affine_backward("gdn", **rows(x, bounds[r], bounds[r + 1]), do=do[bounds[r]:bounds[r + 1]],
                                     chunk_size=C) for r in range(world)]
# gradient arriving at the END of each rank (from the later ranks), folded from dht downwards
d_end = [None] * world
dS = dht
for r in reversed(range(world)):
    d_end[r] = dS
    Mt, dH = bwd_maps[r]
    dS = Mt @ dS + dH  # gradient at the start of rank r
for r in range(1, world):
    suffix = ref.recurrent_backward("gdn", **rows(x, bounds[r], T), do=do[bounds[r]:], dht=dht,
                                    initial_state=start[r])
    err = rel_err(d_end[r - 1], suffix["dh0"])
    print(f"gradient at token {bounds[r]:3d} from the backward fold vs the suffix's dh0: {err:.1e}")
    assert err < 1e-13

# local backward on every rank, then assemble
full = ref.recurrent_backward("gdn", **x, do=do, dht=dht, initial_state=h0)
local = [ref.chunked_backward("gdn", **rows(x, bounds[r], bounds[r + 1]), do=do[bounds[r]:bounds[r + 1]],
                              dht=d_end[r], initial_state=start[r], chunk_size=C) for r in range(world)]
for name in ("dq", "dk", "dv", "dg", "dbeta"):
    err = rel_err(np.concatenate([grads[name] for grads in local]), full[name])
    assert err < 1e-12, (name, err)
assert rel_err(local[0]["dh0"], full["dh0"]) < 1e-12
print("every gradient of the 4-rank backward matches one process (dq, dk, dv, dg, dbeta, dh0)")

# %% [markdown]
# ### How the GPU pre-pass computes $(M, H)$: one run over $V + K$ columns
#
# The rank's summary does not need a special kernel. Every update is affine in the state with
# coefficients that do not depend on it, $S \leftarrow P_t S + k_t u_t^\top$, so run the *ordinary*
# recurrence on a state with $V + K$ columns, values $[v \mid 0]$, from the start state $[0 \mid I]$:
# the first $V$ columns follow the real recurrence from $0$ and end at $H$; the last $K$ columns get
# no writes, so they end at $P_n \cdots P_1 I = M$. The final state **is** $[H \mid M]$, the all-gather
# buffer. The backward is the transpose: run the backward with upstream $[\mathrm{d}o \mid 0]$ and
# $\mathrm{d}h_t = [0 \mid I]$; its $\mathrm{d}h_0$ is $[\mathrm{d}H \mid M^\top]$.
#
# `deltacp.cp` does exactly this on every backend (`bindings/python/deltacp/cp/local.py`,
# `_augmented_forward` / `_augmented_backward`), through two modes of the shared parameter struct
# (`reference/include/deltacp/params.h`): a *final-state-only* forward (no output buffer, only
# $h_t$) and a *dh0-only* backward (no input gradients, only $\mathrm{d}h_0$). On GPUs that is the
# tiled tier's tensor-core scan: 2.9 ms on an H200 for 32768 tokens of 16 heads with
# $K = V = 128$ as one sequential run, where hand-written fp32 loops took 51.8 ms
# (2 x H200, 2026-11-22). Below, the augmented runs against the span maps computed from the chunks.

# %%
r = 1
span = rows(x, bounds[r], bounds[r + 1])
n_r = bounds[r + 1] - bounds[r]
aug = dict(span, v=np.concatenate([span["v"], np.zeros((n_r, K))], axis=1))
_, HM = ref.recurrent_forward("gdn", **aug, initial_state=np.concatenate([np.zeros((K, V)), np.eye(K)], axis=1))
M, H = maps[r]
print("final state of the augmented run vs the span map: H", f"{rel_err(HM[:, :V], H):.1e}",
      " M", f"{rel_err(HM[:, V:], M):.1e}")
assert rel_err(HM[:, :V], H) < 1e-13 and rel_err(HM[:, V:], M) < 1e-13

do_r = do[bounds[r]:bounds[r + 1]]
g_aug = ref.recurrent_backward("gdn", **aug, do=np.concatenate([do_r, np.zeros((n_r, K))], axis=1),
                               dht=np.concatenate([np.zeros((K, V)), np.eye(K)], axis=1))
Mt, dH = bwd_maps[r]
print("dh0 of the augmented backward vs the backward span map: dH", f"{rel_err(g_aug['dh0'][:, :V], dH):.1e}",
      " M^T", f"{rel_err(g_aug['dh0'][:, V:], Mt):.1e}")
assert rel_err(g_aug["dh0"][:, :V], dH) < 1e-13 and rel_err(g_aug["dh0"][:, V:], Mt) < 1e-13
assert rel_err(g_aug["dh0"][:, V:], M.T) < 1e-13  # the backward map is the transpose of the forward one

# %% [markdown]
# ### The same in pieces, side by side
#
# One augmented run is a *sequential* scan over the rank's whole slice: one long sequence walks its
# chunks one after another, on a few SMs. Since the maps compose, the slice can be cut into pieces
# (whole chunks), each piece run from $[0 \mid I]$ **at the same time** (one varlen call: the pieces
# are just more sequences), and the pieces' $[H_p \mid M_p]$ composed afterwards in fp32,
# $(M_b, H_b)\circ(M_a, H_a) = (M_b M_a,\ M_b H_a + H_b)$. That is what `deltacp.cp` does
# (`_piece_bounds`, `_fold_maps` in `bindings/python/deltacp/cp/local.py`; default on GPUs: quarters of
# the slice). On 2 H200s it took the pre-pass from 1.85 to 1.60 ms, against a local forward of 2.0 ms
# (2 x H200, 2026-11-22): still far from the 10% goal, because every piece still runs the whole
# WY and scan machinery over $V + K$ columns. The backward keeps the forward's per-piece $M_p$ and
# computes only $\mathrm{d}H_p$ over the $V$ real columns. Below, three pieces of span $r$ against the
# single augmented run.

# %%
cuts = [0, n_r // 3, 2 * n_r // 3, n_r]
pieces = []
for a_, b_ in zip(cuts, cuts[1:]):
    part = {name: arr[a_:b_] for name, arr in aug.items()}
    _, HM_p = ref.recurrent_forward("gdn", **part, initial_state=np.concatenate([np.zeros((K, V)), np.eye(K)], axis=1))
    pieces.append(HM_p)
folded = pieces[0]
for HM_p in pieces[1:]:  # apply the later piece's map to everything before it, then add its H
    folded = HM_p[:, V:] @ folded + np.concatenate([HM_p[:, :V], np.zeros((K, K))], axis=1)
print("three pieces, composed, vs the one augmented run:", f"{rel_err(folded, HM):.1e}")
assert rel_err(folded, HM) < 1e-13

# %% [markdown]
# On GPUs the pieces now come from the rank's own local forward: it is *prepared* first (the WY stage:
# $W$, $U$), and the pre-pass runs only the state scan over the pieces, on a state of $V + K$ columns
# whose first $V$ columns read $U$ and whose last $K$ see zero values (`StagedForward` in
# `cuda/include/deltacp/cuda/api.h`). The local forward then skips its own WY stage: the CP step's
# forward went from 4.51 to 2.86 ms against 2.08 ms on one GPU (2 x H200, 2026-11-22).
#
# On Hopper that scan of the pieces runs on `wgmma` (`cuda/tiled/scan_wgmma.cuh`). It keeps the state
# transposed, $S^\top$, in registers, so that both products of a chunk step,
# $V_n^\top = U^\top - S^\top W^\top$ and $S^\top \leftarrow D\,S^\top + V_{ns}^\top K$, read their left
# operand from registers. Only W and K come from shared memory. On 2 H200s, the scan of the 4 pieces
# takes 0.26 ms, down from 0.49. It is tested against the `mma.sync` scan and the reference in
# `tests/python/test_cuda.py::test_wgmma_scan_matches_the_mma_sync_scan`.
#
# The same cut pays inside one GPU. A single long sequence scans its chunks one after another on a few
# SMs, so the tiled forward now cuts it into pieces too (`cuda/tiled/scan_split.cu`): the pieces' maps
# side by side (pass 1, in the prepare stage), the fold above into each piece's start state, then the
# pieces' scans side by side from those states. On a CP rank the pre-pass is then those very maps,
# composed where they lie by one fp32 kernel (`compose_maps_kernel`, the fold above with every piece's
# map): it costs the local forward the composition (the CP forward step: 1.94 ms against 1.65 on one
# GPU on 2 x H200, 2026-11-23, docs/context-parallel.md). Tested in
# `tests/python/test_cuda.py::test_scan_in_pieces_matches_the_whole_scan`,
# `test_staged_forward_reuses_the_piece_maps` and `test_composed_map_is_the_pieces_maps_folded`.
#
# ### What the all-gather must carry
#
# The merge folds $S \leftarrow M_j S + H_j$ from $S = 0$ over the ranks before $r$ that share the
# sequence. The **first** of them always multiplies $M_j$ by zero (the initial state, when there is one,
# is already inside its $H_j$). So a rank's $M$ is read only when the rank lies strictly inside a
# sequence, with ranks on both sides. Here ranks 1 and 2 do; with two ranks nobody does, and the
# exchange carries $H$ alone, half the bytes (`CPContext.maps_read`). Below: rank 0's $M$ replaced by
# garbage changes nothing; rank 1's changes every later start.

# %%
def merged_starts(sent):
    """Start states of ranks 1 .. world-1: S = 0 folded through what the ranks sent, as deltacp folds."""
    S, out = np.zeros((K, V)), []
    for M, H in sent[:-1]:
        S = M @ S + H
        out.append(S)
    return out


# deltacp runs rank 0 from h0 itself, so rank 0 sends the H of its span from h0: M_0 h0 + H_0
sent = [(maps[0][0], maps[0][0] @ h0 + maps[0][1])] + maps[1:]
assert max(rel_err(a, b) for a, b in zip(merged_starts(sent), start[1:])) < 1e-13
garbage = rng.standard_normal((K, K)) * 1e3
for r_bad in (0, 1):
    bad = [(garbage, H) if r == r_bad else (M, H) for r, (M, H) in enumerate(sent)]
    worst = max(rel_err(a, b) for a, b in zip(merged_starts(bad), start[1:]))
    print(f"rank {r_bad}'s M replaced by garbage: worst start-state error of the later ranks {worst:.1e}")
    assert worst < 1e-13 if r_bad == 0 else worst > 1e-3


# %% [markdown]
# Pieces only spread the same scan over more SMs. The way to the 10% goal is the tree of notebook 3
# taken all the way down: every chunk's $(M_c, H_c)$ from its own WY factors in parallel, and a
# log-depth fold of $\lceil\log_2 n_c\rceil$ levels of batched matrix products composes them.

# %% [markdown]
# ## The package's simulated CP on a packed batch
#
# `cp_simulate` runs the same four steps for every sequence and head of a packed batch. The plan
# below has short sequences, a sequence spanning three ranks, $T$ not divisible by the number of
# ranks, initial states and final states. Each rank sends the map of its *last* segment (blue
# hatching: the part of a sequence that continues on a later rank) and receives the maps of the
# earlier ranks holding its *first* segment.

# %%
cu = np.array([0, 9, 40, 200, 205, 290, 301])
cuts = [60, 130, 230]
Tb, Hb, Kb, Vb = int(cu[-1]), 2, 16, 24
plan = ref.cp_plan(cu, cuts=cuts)

fig, ax = plt.subplots(figsize=(11, 2.6))
colors = plt.cm.tab10(np.arange(len(cu) - 1))
for s in range(len(cu) - 1):
    ax.barh(0, cu[s + 1] - cu[s], left=cu[s], color=colors[s], alpha=0.6, edgecolor="k")
    ax.text((cu[s] + cu[s + 1]) / 2, 0, f"seq {s}", ha="center", va="center", fontsize=8)
for rank in plan:
    ax.axvline(rank["begin"], color="k", lw=2)
    ax.text((rank["begin"] + rank["end"]) / 2, 0.55, f"rank {rank['rank']}: [{rank['begin']}, {rank['end']})",
            ha="center", fontsize=9)
    if rank["post_ranks"] > 0:  # its last segment continues: it sends (M_r, H_r) of that segment
        seg_begin = rank["begin"] + rank["cu_seqlens"][-2]
        ax.barh(-0.55, rank["end"] - seg_begin, left=seg_begin, height=0.3, color="none", edgecolor="C0", hatch="///")
ax.set_yticks([]); ax.set_ylim(-0.9, 0.9); ax.set_xlim(0, Tb); ax.set_xlabel("global token")
ax.set_title("packed batch over 4 ranks; hatched: the last segments whose (M, H) are all-gathered")
plt.tight_layout()
plt.show()
for rank in plan:
    print(rank)

# %%
def packed_inputs(variant):
    x = dict(q=rng.standard_normal((1, Tb, Hb, Kb)), k=unit(rng.standard_normal((1, Tb, Hb, Kb))),
             v=rng.standard_normal((1, Tb, Hb, Vb)), beta=rng.uniform(0.1, 0.9, (1, Tb, Hb)))
    x["g"] = -rng.uniform(0.01, 0.2, (1, Tb, Hb) if variant == "gdn" else (1, Tb, Hb, Kb))
    return x


SINGLE = {"gdn": (ref.gated_delta_rule, ref.gated_delta_rule_backward), "kda": (ref.kda, ref.kda_backward)}
N = len(cu) - 1
for variant, (fwd, bwd) in SINGLE.items():
    xb = packed_inputs(variant)
    h0b = rng.standard_normal((N, Hb, Kb, Vb))
    (o_cp, ht_cp), exchange = ref.cp_simulate(variant, **xb, cuts=cuts, initial_state=h0b, cu_seqlens=cu,
                                              chunk_size=32, return_exchange=True)
    o_1, ht_1 = fwd(**xb, initial_state=h0b, cu_seqlens=cu)  # one process, token recurrence
    fwd_err = max(rel_err(o_cp, o_1), rel_err(ht_cp, ht_1))

    dob, dhtb = rng.standard_normal(o_1.shape), rng.standard_normal(ht_1.shape)
    g_cp = ref.cp_simulate(variant, **xb, cuts=cuts, initial_state=h0b, cu_seqlens=cu, chunk_size=32,
                           backward=True, do=dob, dht=dhtb)
    g_1 = bwd(**xb, do=dob, dht=dhtb, initial_state=h0b, cu_seqlens=cu)
    bwd_err = max(rel_err(g_cp[name], g_1[name]) for name in g_1)
    print(f"{variant}: simulated CP vs one process: forward {fwd_err:.1e}, backward {bwd_err:.1e}")
    assert fwd_err < 1e-12 and bwd_err < 1e-12

    # what was all-gathered: rank r's (M_r, H_r) is the span map of its last segment, head by head
    for rank in plan:
        r = rank["rank"]
        for h in range(Hb):
            if rank["post_ranks"] == 0:
                assert np.allclose(exchange["M"][r, h], np.eye(Kb)) and not exchange["H"][r, h].any()
                continue
            seg_begin = rank["begin"] + rank["cu_seqlens"][-2]
            head = {name: arr[0, seg_begin:rank["end"], h] for name, arr in xb.items()}
            M, H = ref.span_affine(variant, **head, chunk_size=32)
            assert max(rel_err(exchange["M"][r, h], M), rel_err(exchange["H"][r, h], H)) < 1e-13
print("exchanged maps == span_affine of each rank's last segment")

# %% [markdown]
# ## Precision of the chain of maps: fp32 versus bf16
#
# The merge multiplies states by a chain of maps, and inside a rank the chunked kernel carries the
# state across chunks the same way: $S_{c+1} = M_c S_c + H_c$. How does rounding accumulate along
# that chain? We take the exact fp64 chunk maps from the package ($C = 64$ tokens each; a chain of
# $n$ maps stands for $n$ chunks, or ranks, of one sequence), and fold them
#
# * in fp64 (the truth; checked against the token recurrence of the whole sequence),
# * in fp32 (maps and state stored and multiplied in fp32: what deltacp does),
# * with the maps rounded to bf16, as if exchanged in bf16, state kept in fp32,
# * all in bf16: maps and the running state rounded to bf16 after every step.
#
# bf16 rounding is emulated in numpy: round the fp32 bit pattern to its upper 16 bits (round to
# nearest even), keeping 8 bits of mantissa. This emulation is the experiment, not part of the
# algorithm.
#
# Two regimes: *fast writes* ($\beta \sim U(0.1, 0.9)$: the state forgets within a few chunks) and
# *slow writes* ($\beta \sim U(0.002, 0.01)$, no gate: memory of thousands of tokens, $M$ close to $I$).

# %%
def to_bf16(x):
    """Round to the nearest bfloat16 (ties to even), returned as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


assert to_bf16(np.float32(1 + 2**-8)) == 1.0 and to_bf16(np.float32(1 + 3 * 2**-8)) == 1 + 2**-6  # ties to even

Kc = Vc = 64
Cc, n_maps = 64, 1024
REGIMES = {"fast writes, beta~U(0.1,0.9), delta": ("delta", (0.1, 0.9)),
           "slow writes, beta~U(0.002,0.01), delta": ("delta", (0.002, 0.01))}
errors, maps_by_regime = {}, {}
for label, (variant, beta_range) in REGIMES.items():
    x = head_inputs(variant, Cc * n_maps, Kc, Vc, beta=beta_range)
    chunk_maps = [ref.chunk_affine(variant, **rows(x, c * Cc, (c + 1) * Cc)) for c in range(n_maps)]
    S64 = np.zeros((Kc, Vc))
    S32 = np.zeros((Kc, Vc), np.float32)
    S_bx = np.zeros((Kc, Vc), np.float32)
    S_bb = np.zeros((Kc, Vc), np.float32)
    err = {"fp32": [], "bf16 maps, fp32 state": [], "bf16 maps and state": []}
    for M, H in chunk_maps:
        S64 = M @ S64 + H
        S32 = M.astype(np.float32) @ S32 + H.astype(np.float32)
        S_bx = to_bf16(M) @ S_bx + to_bf16(H)
        S_bb = to_bf16(to_bf16(M) @ S_bb + to_bf16(H))
        norm = np.linalg.norm(S64)
        for name, S in zip(err, (S32, S_bx, S_bb)):
            err[name].append(np.linalg.norm(S - S64) / norm)
    _, S_rec = ref.recurrent_forward(variant, **x)
    assert rel_err(S64, S_rec) < 1e-12  # the fp64 fold is the truth
    errors[label] = {name: np.array(e) for name, e in err.items()}
    maps_by_regime[label] = (chunk_maps, S64)

fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
for ax, (label, err) in zip(axes, errors.items()):
    for name, e in err.items():
        ax.loglog(np.arange(1, n_maps + 1), e, label=name)
    ax.set_title(label, fontsize=10)
    ax.set_xlabel("maps folded (chunks or ranks)")
axes[0].set_ylabel("|S - S_fp64| / |S_fp64|")
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()

for label, err in errors.items():
    print(label)
    for name, e in err.items():
        print(f"   {name:24s} after 1: {e[0]:.1e}  10: {e[9]:.1e}  100: {e[99]:.1e}  {n_maps}: {e[-1]:.1e}")
fast, slow = errors.values()
for err in (fast, slow):
    assert err["fp32"].max() < 1e-5  # fp32 keeps the chain to ~1e-6 or better
    assert err["bf16 maps and state"][-1] > 100 * err["fp32"][-1]  # bf16 costs 2-4 orders of magnitude
# fast writes forget old rounding errors: the error saturates within a few maps
assert fast["bf16 maps and state"][-1] < 3 * fast["bf16 maps and state"][9]
# slow writes remember: the error keeps growing along the chain
assert slow["bf16 maps and state"][-1] > 5 * slow["bf16 maps and state"][0]
assert slow["fp32"][-1] > 5 * slow["fp32"][0]

# %% [markdown]
# **What the plot says.** Rounding errors enter at every step and are then multiplied by the
# later maps. For the delta rule those maps never amplify ($\lVert I - \beta kk^\top\rVert_2 \le 1$ for
# $0\le\beta\le2$, and gates only shrink), so an old error is at worst carried along and usually
# forgotten: the total error grows while the chain still *remembers* (slow writes: about
# $K/\bar\beta$ tokens) and then levels off. In fp32 it stays around $10^{-7}$–$10^{-6}$ relative; with
# bf16 maps or states it is 3–4 orders of magnitude worse (about $10^{-3}$ after a single step, a few
# $10^{-2}$ on long-memory chains). Hence the design rule: the $(M, H)$ exchange and the merge stay
# fp32, whatever the input dtype. DPLR's $M$ is not a contraction in general, so there the chain
# could amplify errors; notebook 5 looks at its structure.
#
# **Take away.** CP for delta-rule attention exchanges one $[K, V+K]$ fp32 map per rank and head,
# reproduces the single-process forward and backward to about $10^{-15}$ in fp64, and needs fp32 for
# the chain.

# %% [markdown]
# ## A tree instead of a chain: what a chunk-parallel pre-pass would cost in precision
#
# On a GPU the pre-pass is a *sequential* scan over the rank's chunks, like the local forward (see
# "How the GPU pre-pass computes $(M, H)$" above). Composition is associative, so the same
# $(M, H)$ can come from a log-depth tree. Each chunk's $(M_c, H_c)$ comes from its WY factors, all
# chunks at once, and pairs are then composed level by level:
#
# $$(M_2, H_2)\circ(M_1, H_1) = (M_2 M_1,\; M_2 H_1 + H_2).$$
#
# That is $\lceil\log_2 n\rceil$ rounds of batched $K\times K\times(K+V)$ products, all on tensor cores,
# instead of $n$ dependent steps. Tensor cores take 16-bit operands, so the question is what rounding
# the maps to bf16 at every composition does to the result. fp32 accumulation and storage are kept,
# which is what an mma with bf16 inputs gives. We compare against the sequential fp32 chain and the
# chain with bf16 maps from above. The chain's rounding of each map happens once; the tree's
# intermediate products are rounded again at every level.

# %%
def tree_fold(maps, operand):
    """Compose [(M_1, H_1), ..., (M_n, H_n)] (applied in that order) pairwise, level by level."""
    level = [(operand(M), operand(H)) for M, H in maps]
    while len(level) > 1:
        nxt = []
        for i in range(0, len(level) - 1, 2):
            (M1, H1), (M2, H2) = level[i], level[i + 1]
            M2o = operand(M2)
            nxt.append((operand(M2o @ operand(M1)), operand(M2o @ operand(H1) + H2)))
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


fp32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
tree_err = {}
for label, (chunk_maps, S_true) in maps_by_regime.items():
    _, H_tree32 = tree_fold(chunk_maps, fp32)
    _, H_tree16 = tree_fold(chunk_maps, to_bf16)  # operands rounded to bf16, products accumulated in fp32
    tree_err[label] = {"tree fp32": rel_err(H_tree32, S_true), "tree bf16 operands": rel_err(H_tree16, S_true),
                       "chain fp32": errors[label]["fp32"][-1],
                       "chain bf16 maps": errors[label]["bf16 maps, fp32 state"][-1]}
    print(label)
    for name, e in tree_err[label].items():
        print(f"   {name:20s} {e:.1e}")
flops = (n_maps - 1) * 2 * Kc * Kc * (Kc + Vc)
print(f"tree work for {n_maps} chunks at K = V = {Kc}: {flops / 1e9:.2f} GFLOP per head, "
      f"{int(np.ceil(np.log2(n_maps)))} dependent rounds instead of {n_maps} steps")
for err in tree_err.values():
    assert err["tree fp32"] < 3 * err["chain fp32"] < 1e-5  # the tree is as accurate as the chain in fp32
    assert err["tree bf16 operands"] < 4 * err["chain bf16 maps"]  # and about as inaccurate with bf16 operands
    assert err["tree bf16 operands"] > 100 * err["tree fp32"]

# %% [markdown]
# **Reading it.**
#
# - **fp32.** The tree is as accurate as the chain (about $10^{-7}$ to $10^{-6}$); the order of the
#   additions hardly matters.
# - **bf16 operands.** The tree lands at the chain-with-bf16-maps level: a few $10^{-3}$ when the
#   state forgets quickly, about $10^{-2}$ when it remembers long. Re-rounding at each of the ten
#   levels adds little to the first rounding of the maps.
# - **What that means for a tensor-core tree pre-pass.** bf16 products are not good enough: they
#   would be worse than the tiled scan's own state error, about $2\times10^{-3}$ (bf16 accuracy table, docs/perf.md).
#   The compositions need tf32, or bf16 split into two halves (three products). The per-chunk maps
#   can come from the same 16-bit WY factors the local kernel uses.
# - **Cost.** About 1 GFLOP per head here, in 10 dependent rounds instead of 1024 sequential steps.
