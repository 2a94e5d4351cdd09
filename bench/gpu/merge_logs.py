"""Rebuilds a bench_gpu.py JSON from the JSON lines of one or more bench_gpu.log files, and merges
JSON results (later files add rows; a later row for the same key replaces an earlier one).

    python3 bench/gpu/merge_logs.py out.json run1/bench_gpu.log run2/bench_gpu.json ...
"""
import json
import re
import sys


def main():
    out, inputs = sys.argv[1], sys.argv[2:]
    res = {"rows": [], "accuracy": {}}
    rows = {}
    for path in inputs:
        if path.endswith(".json"):
            r = json.load(open(path))
            for k, v in r.items():
                if k not in ("rows", "accuracy"):
                    res.setdefault(k, v)
            res["accuracy"].update(r.get("accuracy", {}))
            new = r.get("rows", [])
        else:
            new = []
            for line in open(path):
                m = re.match(r"# (.*): copy ([\d.]+) TB/s, bf16 matmul ([\d.]+) TFLOP/s", line)
                if m:
                    res.setdefault("gpu", m.group(1))
                    res.setdefault("copy_TBps", float(m.group(2)))
                    res.setdefault("bf16_matmul_TFLOPs", float(m.group(3)))
                if line.startswith("{"):
                    new.append(json.loads(line))
        for row in new:
            rows[(row["variant"], row["impl"], row["B"], row["T"], row["H"], row["D"], row.get("V", row["D"]),
                  row["direction"])] = row
    res["rows"] = list(rows.values())
    json.dump(res, open(out, "w"), indent=1)
    print(f"{len(res['rows'])} rows -> {out}")


if __name__ == "__main__":
    main()
