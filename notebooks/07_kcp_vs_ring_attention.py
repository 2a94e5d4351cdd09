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
# # 7. KCP beside ring attention: what each system exchanges, and where its work is unbalanced
#
# Both systems cut a sequence of $T$ tokens over $N$ ranks, $T/N$ tokens each, and both run the
# backward through the same exchange reversed. They differ in **what** crosses the wire.
#
# * **Ring attention** (softmax attention, `deltacp.cp.ring_attention`). Every query needs every
#   earlier key, so the keys and values themselves travel: at each of $N-1$ steps a rank passes a K/V
#   block of $2\,(T/N)\,H_{kv} D$ values to its neighbour, overlapped with the attention of its queries
#   against the block in hand, and merges the partial results with the online softmax. The backward
#   passes K/V round again, the other way, and with them the dK/dV accumulators. The traffic grows
#   with $T$.
# * **KCP** (delta-rule attention, `deltacp.cp.chunk_gated_delta_rule_cp`). A slice of tokens acts on
#   the recurrent state as an affine map $S \mapsto M S + H$ (notebook 4), so a rank summarises its
#   slice as $[H \mid M]$, $H_v K (K+V)$ values, and one all-gather delivers all of them; each rank folds
#   the earlier ranks' maps into its start state. The backward does the same with $[\mathrm{d}H \mid M^\top]$.
#   The traffic does not depend on $T$.
#
# Below: the two traffic formulas, checked against the bytes the two systems really sent on CPU ranks
# (gloo, via `torchrun`); the causal imbalance of contiguous slices and how the zig-zag layout removes
# it; KCP's only imbalance, its merge; and GPU measurements when they are recorded in `docs/results/`.

# %%
import glob
import json
import os
import subprocess
import sys

import matplotlib

if "inline" not in matplotlib.get_backend():  # headless: the Agg renderer (Jupyter's inline backend is Agg too)
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

import deltacp.cp as cp

# %% [markdown]
# ## What each system exchanges
#
# Bytes one rank **sends** per layer, forward and backward, for a model-sized head configuration
# (H = 32 heads, K = V = D = 128, K/V in bf16; KCP's maps in fp32 as deltacp keeps them):
#
# | | forward | backward |
# |---|---|---|
# | ring attention | $(N-1) \cdot 2 (T/N) H_{kv} D$ values (K and V) | the same K/V again, plus $N$ hops of dK/dV |
# | KCP | one all-gather: $H K (K+V)$ fp32 values from every rank | one all-gather of $[\mathrm{d}H \mid M^\top]$, the same size |
#
# KCP's all-gather delivers $(N-1) H K (K+V)$ values to each rank; with a ring all-gather a rank also
# sends that many. We count what a rank sends in both cases.

# %%
def ring_bytes(T, N, H_kv, D, elem=2, grad_elem=4):
    """(forward, backward) bytes one rank sends: K/V N - 1 times; backward K/V N - 1 times and dK/dV
    (fp32 accumulators) N times."""
    kv = 2 * (T // N) * H_kv * D
    return (N - 1) * kv * elem, (N - 1) * kv * elem + N * kv * grad_elem


def kcp_bytes(N, H, K, V, elem=4):
    """(forward, backward) bytes one rank sends in a ring all-gather of [H | M] ([dH | M^T])."""
    per_rank = H * K * (K + V) * elem
    return (N - 1) * per_rank, (N - 1) * per_rank


H, D = 32, 128
Ts = [2 ** p for p in range(12, 21)]
fig, ax = plt.subplots(figsize=(6.5, 4))
for N, style in ((2, "-"), (4, "--"), (8, ":")):
    ax.plot(Ts, [sum(ring_bytes(T, N, H, D)) / 2 ** 20 for T in Ts], "C0" + style, label=f"ring attention, N={N}")
    ax.plot(Ts, [sum(kcp_bytes(N, H, D, D)) / 2 ** 20 for T in Ts], "C3" + style, label=f"KCP, N={N}")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("tokens T (whole sequence)")
ax.set_ylabel("MiB sent per rank, forward + backward")
ax.set_title("H = 32, D = K = V = 128")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
for T in (16384, 131072, 1048576):
    r, k = sum(ring_bytes(T, 4, H, D)), sum(kcp_bytes(4, H, D, D))
    print(f"T = {T:>8}, N = 4: ring attention {r / 2**20:9.1f} MiB, KCP {k / 2**20:6.1f} MiB per rank "
          f"(ratio {r / k:.0f})")

# %% [markdown]
# ## The same bytes on CPU ranks
#
# Two small runs under `torchrun` (4 gloo processes each, checked against one process by the examples
# themselves): ring attention over 512 tokens (H = 4 query heads over H_kv = 2, D = 32, fp32) and GDN's
# KCP over one 512-token sequence (H = 2, K = V = 32). The bytes they report are the formulas' numbers.

# %%
def torchrun(module, *args, nproc=4):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module,
           *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}")
    return res.stdout


ring_out = torchrun("deltacp.examples.ring_attention_cp", "--seqlen", "512", "--heads", "4", "--kv-heads", "2",
                    "--head-dim", "32")
print(ring_out)
kcp_out = torchrun("deltacp.examples.gdn_cp", "--seqlens", "512", "--heads", "2", "--head-dim", "32",
                   "--no-initial-state", "--repeat", "1")
print(kcp_out)


def rank_rows(text):
    """The per-rank rows of the table an example printed, split into fields."""
    return [line.split() for line in text.splitlines() if line.strip()[:1].isdigit() and "ok" in line.split()]


ring_sent = [int(r[7]) for r in rank_rows(ring_out)]  # rank, 4 errors, visible pairs, computed, sent B, ...
# KCP's row: rank, tokens, segs, pre, post, 3 errors, 2 times, tokens/s, exchange B
kcp_xfer = [int(r[11]) for r in rank_rows(kcp_out)]
print("ring attention, bytes each rank sent in the forward:", ring_sent,
      "formula:", ring_bytes(512, 4, 2, 32, elem=4)[0])
# gdn_cp reports what the two all-gathers DELIVERED to the rank: N buffers of [H | M] (its own included).
print("KCP, bytes the two all-gathers delivered to each rank:", kcp_xfer, "formula:", 2 * 4 * 2 * 32 * (32 + 32) * 4)
assert all(b == ring_bytes(512, 4, 2, 32, elem=4)[0] for b in ring_sent)
assert all(b == 2 * 4 * 2 * 32 * 64 * 4 for b in kcp_xfer)

# %% [markdown]
# ## Why causal attention needs the zig-zag layout
#
# Under the causal mask query $t$ sees $t + 1$ keys. With contiguous slices rank $r$ holds tokens
# $[rT/N, (r+1)T/N)$ and its visible (query, key) pairs grow with $r$: the last rank does about $2N-1$
# times the first rank's work, and the ring runs at the speed of the slowest rank. The zig-zag layout
# cuts the sequence into $2N$ blocks and gives rank $r$ blocks $r$ and $2N-1-r$, an early and a late
# one: every rank then sees exactly $(2N-1) b^2 + b(b+1)$ pairs ($b = T/2N$). `ring_attention` counts
# the pairs it computed (`deltacp.cp.ring_attention_stats`); the same count from the layouts:

# %%
T, N = 4096, 4
n = T // N
keys = torch.arange(T)
contiguous = [cp.causal_pairs(torch.arange(r * n, (r + 1) * n), keys) for r in range(N)]
zigzag = [cp.causal_pairs(cp.zigzag_positions(T, N, r), keys) for r in range(N)]
fold = [cp.causal_pairs(cp.zigzag_positions(T, N, r, block=1), keys) for r in range(N)]
b = T // (2 * N)
assert all(z == (2 * N - 1) * b * b + b * (b + 1) for z in zigzag) and len(set(fold)) == 1
print(f"visible pairs per rank, T = {T}, N = {N}")
print(f"  contiguous slices: {contiguous}  (last / first = {contiguous[-1] / contiguous[0]:.1f})")
print(f"  zig-zag, block T/2N = {b}: {zigzag}")
print(f"  zig-zag, block 1 (token fold): {fold}")
fig, ax = plt.subplots(figsize=(6.5, 3.2))
x = torch.arange(N).float()
ax.bar(x - 0.2, [c / 1e6 for c in contiguous], 0.4, label="contiguous slices")
ax.bar(x + 0.2, [z / 1e6 for z in zigzag], 0.4, label="zig-zag (blocks r, 2N-1-r)")
ax.set_xticks(range(N))
ax.set_xlabel("rank")
ax.set_ylabel("visible (q, k) pairs, millions")
ax.set_title(f"causal attention work per rank, T = {T}, N = {N}")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## KCP's only imbalance: the merge
#
# A delta-rule layer has no quadratic term: rank $r$'s local work is the chunked recurrence over its
# $T/N$ tokens whatever $r$ is, so contiguous slices are balanced. What grows with $r$ is the merge:
# rank $r$ folds the $r$ earlier maps, $S \leftarrow M_j S + H_j$, one $K\times K$ by $K \times V$ product each,
# $2 K^2 V$ flops per head per fold. Against the local state pass alone (three products of $(T/N)$ rows
# by $K\times V$ per chunk walk: $6 (T/N) K V$ flops per head), the last rank's extra share is
# $\frac{(N-1) \cdot 2 K^2 V}{6 (T/N) K V} = \frac{(N-1) K}{3 T/N}$:

# %%
K = 128
for N in (2, 4, 8):
    for per_rank in (4096, 8192, 32768):
        print(f"N = {N}, T/N = {per_rank:>6}: last rank's merge = {(N - 1) * K / (3 * per_rank):6.2%} "
              f"of its local state pass")

# %% [markdown]
# The merge is a few percent of the local work at realistic sizes and needs no change of layout. For
# causal softmax attention the imbalance of contiguous slices is the whole $2N-1$ factor, which is why
# ring attention ships with the zig-zag layout (and why its callers must shard and unshard their
# tensors in that order).
#
# ## Recorded GPU numbers
#
# GPU runs record their summaries in `docs/results/`: KCP's CP step (`cp-*.json`, written from
# `bench/cp/bench_cp.py` runs) and ring attention's (`ring-attention-*.json`, written by
# `torchrun ... -m deltacp.examples.ring_attention_cp --device cuda --baseline --json FILE`). Parallel
# efficiency = one GPU doing the whole work / (N x the CP step), forward + backward.

# %%
rows = []
for path in sorted(glob.glob("../docs/results/cp-*.json")):
    with open(path) as f:
        rec = json.load(f)
    eff = rec.get("summary", {}).get("efficiency_fwd+bwd")
    if eff is not None:
        c = rec.get("config", {})
        rows.append((f"KCP {c.get('variant', '')} {rec.get('world')} x {rec.get('gpu', '')}\n"
                     f"{c.get('tokens', '?')} tok/rank, H={c.get('heads')}, {c.get('dtype')}", eff))
for path in sorted(glob.glob("../docs/results/ring-attention-*.json")):
    with open(path) as f:
        rec = json.load(f)
    if rec.get("efficiency") is not None:
        c = rec["config"]
        rows.append((f"ring attention {rec['world']} x {rec['device']}\n{c['tokens']} tok, H={c['heads']}, "
                     f"{c['dtype']}", rec["efficiency"]))
if not any(r[0].startswith("ring") for r in rows):
    print("no recorded ring attention GPU run in docs/results/ yet (ring-attention-*.json)")
if rows:
    for label, eff in rows:
        print(f"{label.replace(chr(10), ', '):70s} efficiency {eff:.3f}")
    fig, ax = plt.subplots(figsize=(6.5, 0.6 + 0.55 * len(rows)))
    ax.barh(range(len(rows)), [r[1] for r in rows], color=["C3" if r[0].startswith("KCP") else "C0" for r in rows])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=7)
    ax.axvline(0.85, color="gray", ls=":", lw=1)
    ax.set_xlim(0, 1)
    ax.set_xlabel("parallel efficiency, forward + backward (recorded)")
    plt.tight_layout()
    plt.show()
else:
    print("no recorded GPU numbers in docs/results/")
