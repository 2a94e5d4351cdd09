"""Plots bench_cp.py's JSON: the CP step against one GPU doing the same per-rank work, and the
exchange alternatives (docs/context-parallel.md shows the result).

    python3 bench/cp/plot_cp.py docs/cp-h200x2-2026-11-22.json --png docs/cp.png
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def worst(r, key):
    """The max over ranks, in ms (the CP step is as slow as its slowest rank)."""
    return 1e3 * max(rank["times"][key] for rank in r["ranks"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--png", default="docs/cp.png")
    ap.add_argument("--gpu", default="NVIDIA H200", help="GPU name for the title (the JSON does not record it)")
    a = ap.parse_args()
    r = json.load(open(a.json))
    c = r["config"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))

    labels = ["forward", "forward + backward"]
    single = [worst(r, "single_gpu_fwd"), worst(r, "single_gpu_fwd+bwd")]
    cp = [worst(r, "cp_step_fwd"), worst(r, "cp_step_fwd+bwd")]
    unstaged = all("cp_step_fwd_unstaged" in rank["times"] for rank in r["ranks"])
    x = range(len(labels))
    width = 0.27 if unstaged else 0.4
    ax1.bar([i - width for i in x] if unstaged else [i - 0.2 for i in x], single, width,
            label="one GPU, same per-rank work")
    if unstaged:  # the one-shot local kernels after the exchange (DELTACP_CP_STAGED=0)
        one_shot = [worst(r, "cp_step_fwd_unstaged"), worst(r, "cp_step_fwd+bwd_unstaged")]
        ax1.bar(list(x), one_shot, width, label="CP step, one-shot local kernels")
        for i in x:
            ax1.text(i, one_shot[i], f"{100 * single[i] / one_shot[i]:.0f}%", ha="center", va="bottom", fontsize=8)
    pos = [i + width for i in x] if unstaged else [i + 0.2 for i in x]
    ax1.bar(pos, cp, width, label=f"CP step, staged ({r['world']} ranks)")
    for i in x:
        ax1.text(pos[i], cp[i], f"{100 * single[i] / cp[i]:.0f}%", ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(list(x), labels)
    ax1.set_ylabel("ms")
    ax1.set_title("parallel efficiency (one GPU / CP step)")
    ax1.legend(fontsize=8)

    parts = ["prepass", "prepass_staged", "prepass_bwd", "allgather", "ring", "scan", "local_forward"]
    names = ["pre-pass [H|M]", "local prepare + pre-pass from its stages", "backward pre-pass [dH|M^T]",
             "all-gather + merge", "ring pass", "log-depth scan", "local forward"]
    have = [i for i, p in enumerate(parts) if all(p in rank["times"] for rank in r["ranks"])]
    ax2.barh([names[i] for i in have], [worst(r, parts[i]) for i in have])
    ax2.set_xlabel("ms (max over ranks)")
    ax2.set_title("exchange alternatives and the local forward")
    fig.suptitle(f"{r['world']} x {a.gpu}, GDN {c['dtype']}, H={c['heads']}, "
                 f"K=V={c['head_dim']}, {c['tokens']} tokens per rank", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print("wrote", a.png)


if __name__ == "__main__":
    main()
