"""Puts the forward + backward kernel times of one variant from bench/gpu/stage_times.py (as run_device.sh's
`stages` step writes them to stages.log) into a results file as its "stages_backward_<variant>" section, which
make_docs.py renders.

    python3 bench/gpu/stages_to_json.py docs/results/perf-h100.json stages.log [more logs ...] [--bench-kwargs] \\
        [--variant kda] [--setting DELTACP_TILED_BWD_BESIDE=0] --date 2026-11-27

Each log's block of the chosen setting (the "[setting]" prefix of DELTACP_STAGE_ENVS runs; no prefix: the
plain run) gives one shape: its kernels, named by the labels below (a kernel without a label is summed
into "the rest"), their sum and the elapsed time per call.
"""
import argparse
import json
import re

# Kernel name fragment -> label, in the order of the table's columns (first match wins).
LABELS = [
    # DPLR (cuda/tiled/dplr_fwd.cu, dplr_bwd.cu number its kernels 1-6) first: "dplr_bwd_local_wgmma_kernel" holds
    # gdn's kernel name below. The forward's kernels 1-3 run twice: in the forward and in the backward's recompute.
    ("dplr_bwd_local_wgmma", "dplr_bwd_local_wgmma (5-6)"),
    ("dplr_bwd_dk_kernel", "dplr_bwd_dk (6)"),
    ("dplr_bwd_dv_kernel", "dplr_bwd_dv (5)"),
    ("dplr_wy_kernel", "dplr_wy (1, both)"),
    ("dplr_output_kernel", "dplr_output (3, both)"),
    ("dplr_scan_kernel", "dplr_scan (2, both)"),
    ("dplr_dh0_scan_kernel", "dplr_dh0_scan (4)"),
    ("bwd_local_wgmma_kernel", "bwd_local_wgmma (B2-B4)"),
    # kda's chunk-local kernel with stage B4 inside (its template's last argument true): stage_times.py's log cuts
    # the names before it, so parse() relabels the kernel of a block that has no B4 of its own.
    ("bwd_local_kda_wgmma_kernel<__nv_bfloat16, true>", "bwd_local_kda_wgmma (B2-B4)"),
    ("bwd_local_kda_wgmma_kernel", "bwd_local_kda_wgmma (B2-B3)"),
    ("bwd_dqkg_kernel", "bwd_dqkg (B2)"),
    ("bwd_wy_kernel", "bwd_wy (B3)"),
    ("bwd_decay", "bwd_decay (B4)"),
    ("bwd_dh_scan_wgmma_kernel", "bwd_dh_scan, wgmma (B1)"),
    ("bwd_dh_scan_kernel", "bwd_dh_scan (B1)"),
    ("chunk_state_scan", "recompute: state scan"),
    ("wy_wgmma_kernel<__nv_bfloat16, true", "recompute: wy_wgmma with B0"),
    ("chunk_wy_kernel", "recompute: chunk_wy"),
    ("bwd_dv_local_kernel", "bwd_dv_local (B0)"),
    ("b0_kept_kernel", "B0 over the kept WY stage"),
    ("kda_prepare_wgmma_kernel<__nv_bfloat16, t", "recompute: kda_prepare_wgmma with B0"),
    ("kda_prepare_wgmma_kernel<__nv_bfloat16, f", "forward: kda_prepare_wgmma"),
    ("kda_prepare_kernel", "forward: kda_prepare"),
    ("fused_chain_kernel", "forward: fused_chain"),
    ("wy_wgmma_kernel<__nv_bfloat16, false", "forward: wy_wgmma"),
    ("chunk_cumsum_kernel", "cumsum (both)"),
    ("l2norm_rows", "l2 norm of q and k (forward, backward)"),
]
HEAD = re.compile(r"(\w+) (\w+) fwd\+bwd \(([\d, ]+)\): ([\d.]+) ms of kernels per call(?:, ([\d.]+) ms elapsed)?")
KERNEL = re.compile(r"^\s+([\d.]+) ms  (.*)$")


def parse(path, setting, variant):
    """{shape: {"total_ms", "elapsed_ms", "kernels_ms"}} of the variant's blocks of the setting in one log."""
    shapes, cur = {}, None
    for line in open(path):
        line = line.rstrip("\n")
        prefix = ""
        m = re.match(r"^\[([^\]]*)\] (.*)$", line)
        if m:
            prefix, line = m.group(1), m.group(2)
        if prefix != setting:
            continue
        h = HEAD.search(line)
        if h and h.group(1) != variant:
            cur = None
            continue
        if h:
            shape = ",".join(x.strip() for x in h.group(3).split(","))
            cur = shapes[shape] = {"total_ms": float(h.group(4)), "kernels_ms": {}, "backend": h.group(2)}
            if h.group(5):
                cur["elapsed_ms"] = float(h.group(5))
            continue
        k = KERNEL.match(line)
        if k and cur is not None:
            ms, name = float(k.group(1)), k.group(2)
            label = next((lab for frag, lab in LABELS if frag in name), "the rest")
            cur["kernels_ms"][label] = round(cur["kernels_ms"].get(label, 0.0) + ms, 3)
    for x in shapes.values():
        ks = x["kernels_ms"]
        if "bwd_local_kda_wgmma (B2-B3)" in ks and "bwd_decay (B4)" not in ks:
            ks["bwd_local_kda_wgmma (B2-B4)"] = ks.pop("bwd_local_kda_wgmma (B2-B3)")
    return shapes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--variant", default="gdn", choices=("gdn", "kda", "dplr"))
    ap.add_argument("--setting", default="", help="the [prefix] of the block to take (empty: unprefixed lines)")
    ap.add_argument("--date", required=True)
    ap.add_argument("--note", default="")
    ap.add_argument("--bench-kwargs", action="store_true", help="the logs ran stage_times.py --bench-kwargs")
    a = ap.parse_args()
    shapes = {}
    for path in a.logs:
        shapes.update(parse(path, a.setting, a.variant))
    if not shapes:
        raise SystemExit(f"no block of setting '{a.setting}' in {a.logs}")
    backends = {x.pop("backend") for x in shapes.values()}
    if len(backends) != 1:
        raise SystemExit(f"the blocks ran on different backends: {sorted(backends)}")
    backend = backends.pop()  # the forward's tier (stage_times.py --backend); the backward is the tiled tier's
    order = [lab for _, lab in LABELS] + ["the rest"]
    for x in shapes.values():  # every shape with the same columns, in LABELS' order
        x["kernels_ms"] = {lab: x["kernels_ms"].get(lab, 0.0) for lab in order
                           if any(lab in y["kernels_ms"] for y in shapes.values())}
    res = json.load(open(a.results))
    key = f"stages_backward_{a.variant}"
    res[key] = {
        "date": a.date, "variant": a.variant, "direction": "fwd+bwd",
        "backend": "fused forward, tiled backward" if backend == "fused" else f"{backend} forward and backward",
        "source": f"bench/gpu/stage_times.py --backward --backend {backend}"
                  + (" --bench-kwargs" if a.bench_kwargs else "") + " (torch.profiler, CUDA time per call; "
                  "elapsed: CUDA events around one call, median of 20)" + (f", {a.setting}" if a.setting else ""),
        "shapes": shapes,
    }
    if a.note:
        res[key]["note"] = a.note
    json.dump(res, open(a.results, "w"), indent=1)
    print(f"{a.results}: {key} for {list(shapes)}")


if __name__ == "__main__":
    main()
