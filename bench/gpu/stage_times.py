"""Per-kernel CUDA time of one deltacp forward (torch.profiler), for tuning.

    python3 bench/gpu/stage_times.py --shape 2,16384,16,128 [--variant gdn|kda|dplr] [--backward] [--backend fused]
Prints each kernel's total CUDA time per call (mean of --repeat profiled calls), their sum, the elapsed time
per call, the host time to enqueue one, and the CUDA runtime and driver calls one call makes (count and host
time each; a synchronising one makes the GPU wait for the host's time after it). dplr takes the
inputs of bench_dplr.py (a = normalize(rand), b = -a, gates logsigmoid(randn) clamped to [-5, 0]) on the tiled
tier.
"""
import argparse
import collections
import time

import torch
import torch.nn.functional as F

import deltacp

# Runtime calls that wait for the device (or for work on it): after one, the GPU idles for the host's time.
_SYNCING = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaFree",
            "cudaMalloc", "cudaMemset", "cuStreamSynchronize", "cuCtxSynchronize", "cuMemcpyDtoH_v2"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2,16384,16,128")
    ap.add_argument("--variant", default="gdn")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="q, k, v and beta (g stays fp32)")
    ap.add_argument("--backend", default="tiled", help="the CUDA tier: tiled or fused (its backward is tiled)")
    ap.add_argument("--bench-kwargs", action="store_true",
                    help="call with FLA's benchmark keywords, as bench_gpu.py does (FLA_BENCH_KWARGS: the in-kernel "
                         "l2 norm; KDA's safe gate, lower_bound -5)")
    ap.add_argument("--host-profile", action="store_true",
                    help="also cProfile 50 calls: the Python functions the host time goes to (top 20 by cumulative "
                         "and by own time)")
    a = ap.parse_args()
    B, T, H, D = map(int, a.shape.split(","))
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    q = torch.randn(B, T, H, D, device="cuda", dtype=dt)
    k = F.normalize(torch.randn(B, T, H, D, device="cuda"), dim=-1).to(dt)
    v = torch.randn(B, T, H, D, device="cuda", dtype=dt)
    kw = dict(backend=a.backend)
    if a.variant == "dplr":
        an = F.normalize(torch.rand(B, T, H, D, device="cuda"), dim=-1)
        gk = F.logsigmoid(torch.randn(B, T, H, D, device="cuda")).clamp(-5.0, 0.0)
        op, xs = deltacp.chunk_dplr_delta_rule, [q, k, v, an.to(dt), (-an).to(dt), gk]
        kw.update(lower_bound=-5.0)
    else:
        g = F.logsigmoid(torch.randn((B, T, H, D) if a.variant == "kda" else (B, T, H), device="cuda"))
        beta = torch.rand(B, T, H, device="cuda").sigmoid().to(dt)
        op = deltacp.chunk_gated_delta_rule if a.variant == "gdn" else deltacp.chunk_kda
        xs = [q, k, v, g, beta]
    if a.bench_kwargs and a.variant in ("gdn", "kda"):
        from bench_gpu import FLA_BENCH_KWARGS  # this script's folder is on sys.path
        kw.update(FLA_BENCH_KWARGS[a.variant])
        if a.variant == "kda":
            xs[3] = xs[3].clamp(min=-5.0)  # inside safe_gate's promised range
    if a.backward:
        xs = [x.requires_grad_(True) for x in xs]

    def step():
        o, _ = op(*xs, **kw)
        if a.backward:
            o.backward(torch.ones_like(o))
            for x in xs:  # so that the next step assigns the gradients instead of adding to them (an extra kernel)
                x.grad = None

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(a.repeat):
            step()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    api = {}  # CUDA runtime / driver calls on the host: name -> (calls per call, us per call)
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:  # kernels, copies, memsets (not the CPU ops above them)
            if e.key.startswith("Activity Buffer"):  # the profiler's own
                continue
            t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            per[e.key[:70]] += t / a.repeat / 1e3
        elif e.key.startswith("cu"):
            api[e.key[:60]] = (e.count / a.repeat, e.cpu_time_total / a.repeat)
    total = sum(per.values())
    # Elapsed time per call (CUDA events around one call, median of 20): below the kernels' sum where kernels
    # run side by side on two streams, above it by the gaps between launches.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    walls = []
    for _ in range(20):
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        walls.append(start.elapsed_time(end))
    wall = sorted(walls)[len(walls) // 2]
    # Host time to enqueue one call (median of 20, the GPU kept busy by the calls before it, no synchronisation):
    # what the call costs the CPU (Python, the dispatch, tables, tensor maps, launches). Where it passes the
    # kernels' time, the GPU waits for the host between calls.
    hosts = []
    for _ in range(20):
        t0 = time.perf_counter()
        step()
        hosts.append(1e3 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    host = sorted(hosts)[len(hosts) // 2]
    print(f"{a.variant} {a.backend} {'fwd+bwd' if a.backward else 'fwd'} {(B, T, H, D)}: {total:.3f} ms of kernels "
          f"per call, {wall:.3f} ms elapsed, {host:.3f} ms of host time to enqueue it")
    for name, ms in sorted(per.items(), key=lambda x: -x[1])[:12]:
        print(f"  {ms:8.3f} ms  {name}")
    if a.host_profile:
        import cProfile
        import pstats
        prof_py = cProfile.Profile()
        prof_py.enable()
        for _ in range(50):
            step()
        prof_py.disable()
        torch.cuda.synchronize()
        print("  host profile of 50 calls (s):")
        pstats.Stats(prof_py).sort_stats("cumulative").print_stats(20)
        pstats.Stats(prof_py).sort_stats("tottime").print_stats(20)
    print("  CUDA API calls per call (count, host us):")
    for name, (n, us) in sorted(api.items(), key=lambda x: -x[1][1]):
        sync = "  <- synchronises" if name in _SYNCING else ""
        print(f"  {n:6.1f} x {us:8.1f} us  {name}{sync}")


if __name__ == "__main__":
    main()
