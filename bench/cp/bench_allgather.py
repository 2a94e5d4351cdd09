"""All-gather bandwidth on this machine's GPUs, reported like nccl-tests (algbw, busbw).

    torchrun --nproc_per_node=2 bench/cp/bench_allgather.py [--sizes-mib 0.25,1,2,4,16] [--json F]

The CP exchange moves world x [HV, K, V + K] fp32 (4 MiB at H = 16, K = V = 128 over 2 ranks) or
world x [HV, K, V] when no rank's transition is read (docs/design.md section 4.1). This measures the
same sizes through torch.distributed's NCCL group and, when built, deltacp's own communicator
(deltacp._cp_nccl, the one the CP ops use): its all-gathers on the blocking communicator split off for
them (the default) and on the non-blocking one (DELTACP_CP_BLOCKING_GATHER=0), whose every collective
NCCL enqueues from a thread it creates for the call. nccl-tests' conventions: algbw = total bytes gathered /
time; busbw = algbw * (world - 1) / world. NCCL_PROTO / NCCL_ALGO in the environment pass through.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes-mib", default="0.0625,0.25,1,2,4,8,32")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--json", default="")
    args = p.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120), device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = comm_nb = None
    try:
        import deltacp.cp as cp
        from deltacp.cp import nccl_backend

        if nccl_backend.available():
            comm = cp.build_context(torch.tensor([0, 64 * world]), device=device, timeout=60)
            os.environ["DELTACP_CP_BLOCKING_GATHER"] = "0"
            try:
                comm_nb = cp.build_context(torch.tensor([0, 64 * world]), device=device, timeout=60)
            finally:
                os.environ.pop("DELTACP_CP_BLOCKING_GATHER")
    except Exception as exc:  # noqa: BLE001  (the torch numbers alone are still worth having)
        if rank == 0:
            print("deltacp communicator unavailable:", exc)

    def timed(fn):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        times = []
        for _ in range(args.repeat):
            torch.cuda.synchronize()
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            t0.record()
            fn()
            t1.record()
            t1.synchronize()
            times.append(t0.elapsed_time(t1) * 1e-3)
        times.sort()
        return times[len(times) // 2]

    rows = []
    for mib in (float(s) for s in args.sizes_mib.split(",")):
        n = int(mib * 2**20) // 4  # fp32 elements each rank sends
        x = torch.randn(n, device=device)
        out = torch.empty(world * n, device=device)
        row = {"send_mib": mib}
        row["torch_s"] = timed(lambda: dist.all_gather_into_tensor(out, x))
        keys = ("torch", "deltacp", "deltacp_nonblocking")
        for key, ctx in (("deltacp", comm), ("deltacp_nonblocking", comm_nb)):
            if ctx is not None:
                from deltacp.cp import nccl_backend

                row[key + "_s"] = timed(lambda: nccl_backend.all_gather(ctx, x, "bench"))
        t = torch.tensor([row.get(key + "_s", 0.0) for key in keys], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        for i, key in enumerate(keys):
            row[key + "_s"] = float(t[i])
        total = world * n * 4
        for key in keys:
            if row[key + "_s"] > 0:
                alg = total / row[key + "_s"] / 1e9
                row[key + "_algbw_GBs"] = alg
                row[key + "_busbw_GBs"] = alg * (world - 1) / world
        rows.append(row)
    if rank == 0:
        proto = os.environ.get("NCCL_PROTO", "(NCCL's choice)")
        print(f"all-gather, {world} ranks, {torch.cuda.get_device_name(device)}, NCCL_PROTO={proto}; "
              f"median of {args.repeat}, max over ranks")
        print(f"{'send MiB':>9} {'torch ms':>9} {'busbw GB/s':>11} {'deltacp ms':>11} {'busbw GB/s':>11} "
              f"{'non-blocking ms':>16} {'busbw GB/s':>11}")
        for r in rows:
            print(f"{r['send_mib']:9.4g} {r['torch_s'] * 1e3:9.3f} {r['torch_busbw_GBs']:11.2f} "
                  f"{r['deltacp_s'] * 1e3:11.3f} {r.get('deltacp_busbw_GBs', 0.0):11.2f} "
                  f"{r['deltacp_nonblocking_s'] * 1e3:16.3f} {r.get('deltacp_nonblocking_busbw_GBs', 0.0):11.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "proto": proto, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
