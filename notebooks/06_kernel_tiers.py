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
# # 6. One shape through the three CUDA tiers: what stays on chip, what moves, what it costs
#
# deltacp runs the same algorithm three ways on a GPU (`cuda/`, docs/design.md):
#
# | tier | kernels | on chip | through HBM |
# |---|---|---|---|
# | **naive** (`cuda/naive/`) | one block per (sequence, value head), a token loop | the state $S$ (K x V, fp32) for the whole sequence | only the inputs and the output, but every token is a rank-one update on the CUDA cores: latency-bound, no tensor cores |
# | **tiled** (`cuda/tiled/`) | four stages, one kernel each: $G$ = cumsum g; $A, T, W, U$; the state scan; the output | one chunk's tiles inside each kernel | every chunk's $W, U$, the chunk-start states $h_c$ and $v_{new}$ are written by one stage and read by the next |
# | **fused** (`cuda/fused/`, Hopper) | token-parallel $G$, $T \beta$ and the decayed scores $P$; then one chain kernel per (sequence, head) with $S$ in wgmma accumulators | $S$ from the first chunk to the last, and each chunk's $V_{new} = T\beta\,(V - e^G K S)$ and output accumulator | $T\beta$ and $P$ once; no $W, U$, no $h_c$, no $v_{new}$ |
#
# This notebook counts the bytes each tier moves per token and value head (the same count the kernel
# files' comments give), draws them against the FLOPs on a roofline with the times of the newest results
# file (docs/results/perf-*.json), and, on a machine with a CUDA GPU, runs one shape through every tier
# and asserts that all of them agree with the fp64 reference.

# %%
import json
import math
import pathlib

import matplotlib

if "inline" not in matplotlib.get_backend():  # headless: the Agg renderer (Jupyter's inline backend is Agg too)
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

import deltacp
from deltacp import reference as ref


def repo_root():
    """The checkout this notebook runs in (its docs/results/ holds the measured numbers)."""
    for d in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]:
        if (d / "docs" / "results").is_dir():
            return d
    return None


# %% [markdown]
# ## Bytes per token and value head
#
# K = V = D = 128, chunk C = 64, 16-bit q, k, v, beta and o, fp32 log decay g and cumulative G. Each
# line below is one kernel's reads and writes, divided by the tokens of a chunk (a chunk-start state
# of $K \times V$ 16-bit values costs $2KV/C$ bytes per token).

# %%
D, C, es = 128, 64, 2
K = V = D


def tier_bytes():
    inputs = es * (K + K + V) + 4 + es  # q, k, v, g, beta
    out = es * V
    naive = {"q, k, v, g, beta in; o out": inputs + out}
    tiled = {
        "stage 1: g in, G out": 4 + 4,
        "stage 2: k, v, beta, G in; W, U out": es * (K + V) + es + 4 + es * (K + V),
        "stage 3: W, U, k, G in; v_new, h_c out": es * (K + V + K) + 4 + es * V + es * K * V / C,
        "stage 4: q, k, v_new, h_c, G in; o out": es * (K + K + V) + es * K * V / C + 4 + out,
    }
    fused = {  # the T Beta form of the chain (cuda/fused/fused_chain.cuh)
        "cumsum: g in, G out": 4 + 4,
        "WY and scores: q, k, beta, G in; T Beta, P out": es * (K + K) + es + 4 + es * (C + C),
        "chain: q, k, v, T Beta, P, G in; o out": es * (K + K + V + C + C) + 4 + out,
    }
    return {"naive": naive, "tiled": tiled, "fused": fused}


# The W, U form of the chain (DELTACP_FUSED_TBETA=0, a forward that keeps its states for the backward, and kda's only
# form): the token-parallel stage writes W and U in place of T Beta, and the chain reads them in place of v and T Beta.
FUSED_W_U = {
    "cumsum: g in, G out": 4 + 4,
    "WY and scores: q, k, v, beta, G in; W, U, P out": es * (K + K + V) + es + 4 + es * (K + V + C),
    "chain: q, k, W, U, P, G in; o out": es * (K + K + K + V + C) + 4 + es * V,
}


BYTES = tier_bytes()
for tier, parts in BYTES.items():
    print(f"{tier:6} {sum(parts.values()):7.0f} B per token-head")
    for what, b in parts.items():
        print(f"         {b:7.0f}  {what}")
minimum = sum(BYTES["naive"].values())
assert sum(BYTES["fused"].values()) < sum(FUSED_W_U.values()) < sum(BYTES["tiled"].values())
print(f"fused in its W, U form: {sum(FUSED_W_U.values()):.0f} B per token-head")
print(f"the fused tier moves {sum(BYTES['fused'].values()) / minimum:.1f}x the minimum, the tiled tier "
      f"{sum(BYTES['tiled'].values()) / minimum:.1f}x")

# %% [markdown]
# The fused forward as one kernel (`cuda/fused/fused_one_kernel.cuh`, opt-in: slower on an H200, its header
# says why) makes each chunk's $W, U, P$ in the chain's CTA, so they never reach HBM; each of a head's two CTAs
# (64 state columns each) reads $q$, $k$, $G$ and $\beta$ whole and its half of $v$.

# %%
ONE_KERNEL = {
    "cumsum: g in, G out": 4 + 4,
    "one kernel: q, k, G, beta in per CTA (two per head); v in; o out": 2 * (es * (K + K) + 4 + es) + es * V + es * V,
}
one_kernel = sum(ONE_KERNEL.values())
assert minimum < one_kernel < sum(BYTES["fused"].values())
print(f"one kernel: {one_kernel:.0f} B per token-head, {one_kernel / minimum:.1f}x the minimum")

# %% [markdown]
# kda's fused forward (a decay per key: g is 128 fp32 values per token) is two kernels too. Its token-parallel
# stage (`cuda/tiled/kda_prepare_wgmma.cuh`) sums the gate within each chunk itself and hands the chain the
# operands with the decays folded in, $Q e^G$ and $K e^{G_n - G}$, beside $W$, $U$, $P$ and the chunk's last row of
# $G$; the chain then reads neither q nor k. With FLA's `use_gate_in_kernel` the stage reads the raw g in place of
# the log decay, so the count is the same.

# %%
KDA_FUSED = {
    "prepare: q, k, v, g, beta in; W, U, K e^(G_n - G), P, Q e^G, G's last row out":
        es * (K + K + V) + 4 * K + es + es * (K + V + K + C + K) + 4 * K / C,
    "chain: W, U, K e^(G_n - G), P, Q e^G, G's last row in; o out": es * (K + V + K + C + K) + 4 * K / C + es * V,
}
kda_minimum = es * (K + K + V) + 4 * K + es + es * V
kda_fused = sum(KDA_FUSED.values())
assert kda_minimum < kda_fused
print(f"kda fused: {kda_fused:.0f} B per token-head, {kda_fused / kda_minimum:.1f}x its minimum of {kda_minimum:.0f}")

# %% [markdown]
# ## The backward's bytes
#
# The backward (the tiled tier's, after either forward; on Hopper for 16-bit gdn and delta at K = V = 128) can
# start from the forward's inputs alone: it then recomputes $G$, the WY representation and the chunk-start
# states, runs the reverse chain of state gradients (B1) and the chunk-local gradients (B2-B4 as one kernel).
# fp32 where the kernels keep fp32: $T$, the value gradients $dV_{new}$ that B0 starts and B1 completes. One
# value head per key head (grouped value heads add fp32 parts of dq and dk and the kernel that sums them).

# %%
f32 = 4
state = es * K * V / C  # one chunk-start state (h) or state gradient (dh) per chunk, 16-bit
B1_AND_LOCAL = {
    "B1 dh scan: q, k, W, dO, dVn_local, G in; dh, dVn out": es * (K + K + K + V) + f32 * V + 4 + state + f32 * V,
    "B2-B4: dO, h, v_new, dh, v, q, k, dVn, T, G, beta in; dq, dk, dv, dg, dbeta out": es * V + state + es * V
    + state + es * (V + K + K) + f32 * V + f32 * C + 4 + es + es * (K + K + V) + 4 + es,
}
BWD = {
    "cumsum: g in, G out": 4 + 4,
    "WY + B0: q, k, v, beta, G, dO in; W, U, T, dVn_local out": es * (K + K + V) + es + 4 + es * V
    + es * (K + V) + f32 * C + f32 * V,
    "state scan: W, U, k, G in; h, v_new out": es * (K + V + K) + 4 + state + es * V,
    **B1_AND_LOCAL,
}
print(f"backward from the inputs alone {sum(BWD.values()):7.0f} B per token-head")
for what, b in BWD.items():
    print(f"         {b:7.0f}  {what}")
fwd_bwd = sum(BYTES["fused"].values()) + sum(BWD.values())
least = sum(BYTES["naive"].values()) + es * (K + K + V) + 4 + es + es * V  # + read do, write dq dk dv dg dbeta
print(f"forward (fused) + that backward: {fwd_bwd:.0f} B per token-head, {fwd_bwd / least:.1f}x the least a "
      f"training step must move ({least:.0f}: the inputs and do in, o and the gradients out)")
assert BWD["B2-B4: dO, h, v_new, dh, v, q, k, dVn, T, G, beta in; dq, dk, dv, dg, dbeta out"] == max(BWD.values())

# %% [markdown]
# What a training step does by default (the eager autograd path, 16-bit inputs, Hopper): the forward keeps for
# the backward what the backward would otherwise rebuild (docs/design.md section 5). Its chain runs in the W, U
# form and writes each chunk's start state $h$ and each token's $v_{new}$ as it goes (`Params::chunk_h`,
# `chunk_vnew`); its WY stage also writes $T$, rounded to 16 bits as the chunk-local kernel reads it, beside $W$
# and $P$ (`Params::wy_stage`). The backward then runs no cumsum, no WY stage and no state scan: stage B0 alone
# ($P$ and $dO$ in, $dV_{new}$'s local part out), then B1 and B2-B4 as above. The kept bytes wait in HBM between
# the passes (gdn: 512 + 256 + 656 per token-head at this shape).

# %%
FWD_KEPT = dict(FUSED_W_U)
FWD_KEPT["kept: h, v_new from the chain; T from the WY stage"] = state + es * V + es * C
BWD_KEPT = {"B0 alone: P, dO in; dVn_local out": es * C + es * V + f32 * V, **B1_AND_LOCAL}
kept_step = sum(FWD_KEPT.values()) + sum(BWD_KEPT.values())
for name, parts in (("forward keeping its states and WY stage", FWD_KEPT), ("backward after it", BWD_KEPT)):
    print(f"{name}: {sum(parts.values()):.0f} B per token-head")
    for what, b in parts.items():
        print(f"         {b:7.0f}  {what}")
print(f"the default training step: {kept_step:.0f} B per token-head ({kept_step / least:.1f}x the least), "
      f"{fwd_bwd - kept_step:.0f} fewer than forward + a backward from the inputs alone")
assert kept_step < fwd_bwd

# %% [markdown]
# ## FLOPs per token and value head
#
# The chunked algorithm's tensor-core work per chunk: $QK^\top$, $KK^\top$ ($2C^2K$ each), the inverse
# applied twice ($W$, $U$: $2C^2K + 2C^2V$), and the three products with the state ($WS$, $QS$, $K^\top V_{new}$:
# $2CKV$ each), plus $PV_{new}$ ($2C^2V$). The naive tier does $\approx 8KV$ per token on the CUDA cores
# (two rank-one products and two matrix-vector products with $S$).

# %%
flops_chunked = (3 * 2 * C * K * V + 2 * 2 * C * C * K + 2 * C * C * K + 2 * C * C * V + 2 * C * C * V) / C
flops_naive = 8 * K * V
print(f"chunked: {flops_chunked:.3g} FLOP per token-head; naive: {flops_naive:.3g}")
for tier, parts in BYTES.items():
    f = flops_naive if tier == "naive" else flops_chunked
    print(f"{tier:6} arithmetic intensity {f / sum(parts.values()):6.1f} FLOP/B")

# %% [markdown]
# ## Measured: the tiers beside FLA
#
# From the harness's results file (`bench/gpu/bench_gpu.py`, written by `bench/gpu/run_device.sh`):
# each tier's forward time at FLA's benchmark shapes, its attained rate, and the roofline
# $\min(\text{peak}, \text{intensity} \times \text{bandwidth})$ with the copy bandwidth and bf16 matmul
# rate measured in the same run.

# %%
root = repo_root()
results = None
if root is not None:  # the newest results file (one per GPU)
    found = [json.loads(f.read_text()) for f in sorted((root / "docs" / "results").glob("perf-*.json"))]
    if found:
        results = max(found, key=lambda r: r.get("date", ""))
if results is None:
    print("no results file here (docs/results/perf-*.json): the measured part is skipped")
else:
    bw, peak = results["copy_TBps"] * 1e12, results["bf16_matmul_TFLOPs"] * 1e12
    print(f"{results['gpu']}, {results['date']}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    rows = [r for r in results["rows"] if r.get("direction") == "fwd" and "ms" in r and r["variant"] == "gdn"]
    print(f"{'impl':15} {'shape':22} {'ms':>8} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['impl']:15} {str((r['B'], r['T'], r['H'], r['D'])):22} {r['ms']:8.3f} {r['TFLOPs']:8.1f}")

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    x = np.logspace(0, 3, 100)
    ax.loglog(x, np.minimum(peak, x * bw) / 1e12, "k-", lw=1, label="roofline (measured ceilings)")
    colors = {"deltacp-naive": "tab:gray", "deltacp-tiled": "tab:blue", "deltacp-fused": "tab:red", "fla": "tab:green"}
    for impl, color in colors.items():
        pts = [r for r in rows if r["impl"] == impl]
        if not pts:
            continue
        tier = impl.split("-")[-1]
        intensity = (flops_naive if tier == "naive" else flops_chunked) / sum(BYTES.get(tier, BYTES["tiled"]).values())
        ax.scatter([intensity] * len(pts), [r["TFLOPs"] for r in pts], color=color, label=impl, s=25)
    ax.set_xlabel("FLOP per byte moved (this tier's count; FLA plotted at the tiled tier's)")
    ax.set_ylabel("TFLOP/s (chunked count)")
    ax.set_title("GDN forward, K = V = 128, bf16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# ## Live: one shape through every tier (needs a CUDA GPU)
#
# The same bf16 inputs through naive, tiled and fused (where its kernels apply: Hopper, K = V = 128 here),
# each against the fp64 reference evaluated on the same rounded inputs, within the bf16 tolerance of
# docs/design.md (1e-2 relative). Without a GPU, the reference's own tellings are tied instead: the
# chunked form that the tiled and fused tiers run equals the token recurrence that the naive tier runs.

# %%
rng = np.random.default_rng(6)
B, T, H = 1, 300, 2
q = rng.standard_normal((B, T, H, D))
k = rng.standard_normal((B, T, H, D))
k /= np.linalg.norm(k, axis=-1, keepdims=True)
v = rng.standard_normal((B, T, H, D))
g = np.log(1 / (1 + np.exp(-(rng.standard_normal((B, T, H)) + 2))))
beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))

try:
    import torch

    live = torch.cuda.is_available() and deltacp.built_with_cuda()
except ImportError:
    live = False

if not live:
    o_chunk, _ = ref.gated_delta_rule(q, k, v, g, beta, chunk_size=64)
    o_rec, _ = ref.gated_delta_rule(q, k, v, g, beta, chunk_size=None)
    err = np.linalg.norm(o_chunk - o_rec) / np.linalg.norm(o_rec)
    print(f"no CUDA GPU here: chunked vs recurrence (fp64) {err:.1e}")
    assert err < 1e-12
else:
    t = {n: torch.tensor(x, dtype=torch.bfloat16, device="cuda") for n, x in
         dict(q=q, k=k, v=v, beta=beta).items()}
    t["g"] = torch.tensor(g, dtype=torch.float32, device="cuda")
    rounded = {n: x.double().cpu().numpy() for n, x in t.items()}
    o_ref, _ = ref.gated_delta_rule(rounded["q"], rounded["k"], rounded["v"], rounded["g"], rounded["beta"])
    hopper = torch.cuda.get_device_capability() == (9, 0)
    for tier in ["naive", "tiled"] + (["fused"] if hopper else []):
        o, _ = deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], backend=tier)
        torch.cuda.synchronize()
        err = np.linalg.norm(o.double().cpu().numpy() - o_ref) / np.linalg.norm(o_ref)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], backend=tier)
        end.record()
        torch.cuda.synchronize()
        print(f"{tier:6} relative error {err:.1e}, {start.elapsed_time(end) / 20:.3f} ms at {(B, T, H, D)}")
        assert err < 1e-2, tier
    o, _ = deltacp.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"])
    print("default backend ran:", deltacp.last_cuda_tier())
