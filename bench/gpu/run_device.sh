#!/usr/bin/env bash
# One call on a GPU machine: build, validate, sanitize, benchmark; results under $OUT (default /tmp/deltacp-out).
#
#   bash bench/gpu/run_device.sh [steps]     steps: comma list of build,test,sanitize,pytest,bench,cp,
#                                            cpbench, cpstep, cptimeline, stages, scan, dplr, ncu (default build,test,sanitize,pytest,bench)
#   cp       distributed/tests/run_gpu_cp.sh (checks, faults, examples) and bench/cp/bench_cp.py --profile
#            (the bench only when cpbench is not asked for too); on one GPU the checks run as 2 ranks
#            sharing it over gloo, without the examples and the bench
#   stages   bench/gpu/stage_times.py: CUDA time of each kernel of the tiled forward + backward (gdn, kda) and
#            of kda's fused forward at DELTACP_STAGE_SHAPE (default 2,16384,16,128) -> stages.log; with
#            DELTACP_STAGE_FUSED="0 4096 ..." the fused gdn forward's kernels instead, once per piece length
#            (DELTACP_FUSED_PIECE; 0 = whole); with DELTACP_STAGE_ENVS="A=0 A=1,B=1 ..." the gdn (DELTACP_STAGE_VARIANT)
#            forward (DELTACP_STAGE_BACKEND, default fused; dplr: tiled) + backward once per setting (the
#            comma-joined variables set for that run), e.g. a kernel switch off and on (DELTACP_STAGE_FWD=1: the
#            forward alone, e.g. DELTACP_STAGE_ENVS="DELTACP_FUSED_WINDOW=512 DELTACP_FUSED_WINDOW=0")
#   scan     bench/gpu/bench_scan.py: the state scan kernel and the forward, wgmma against mma.sync
#   dplr     bench/gpu/bench_dplr.py: the tiled DPLR forward and forward + backward beside FLA's chunk_dplr
#            (DELTACP_DPLR_ARGS, e.g. "--impls deltacp_tiled,fla_chunk16 --shapes 4,4096,32,64") -> bench_dplr.json,
#            and the Triton autotune files FLA wrote in the run -> fla_autotune_new.tar.gz
#   ncu      one launch of the state scan (DELTACP_NCU_KERNEL) under Nsight Compute -> ncu_details.txt,
#            ncu_source.csv (per SASS instruction: executions, warp stall samples, shared wavefronts)
#   cpbench  bench/cp/bench_allgather.py and bench_cp.py --profile --trace --host-profile (chrome traces
#            of the GPU and cProfile of the host in $OUT/trace, tarred into cp_detail.tar.gz)
#   cpstep   bench/cp/bench_cp_step.py on every GPU (2 or more; skipped on one): deltacp's CP training step
#            (GDN, KDA) beside FLA's own CP and one GPU's same per-rank work -> bench_cp_step.json, bench_cp_step.log,
#            and the Triton autotune files FLA wrote in the run -> fla_autotune_cpstep_new.tar.gz
#            (DELTACP_CP_STEP_ARGS, e.g. "--variants gdn --repeat 30"; DELTACP_CP_STEP_TIMEOUT, seconds, default 480)
#   cptimeline  bench/cp/cp_timeline.py on every GPU (2 or more): one deltacp CP call phase by phase, each rank's
#            host and GPU times of each phase, forward and forward + backward (DELTACP_CP_TIMELINE_VARIANTS,
#            default "gdn kda"; DELTACP_CP_TIMELINE_TOKENS per rank, default 32768) -> cp_timeline.log and
#            cp_timeline.json (for the docs: docs/results/cptimeline-<gpu>x<n>.json, then make_docs.py)
# DELTACP_PYTEST_K narrows the pytest step (default "cuda or gpu"); DELTACP_BENCH_ARGS are added to bench_gpu.py's
# arguments and DELTACP_BENCH_TIMEOUT bounds it (seconds, default 420); DELTACP_CP_BENCH_ARGS are added to
# bench_cp.py's arguments (e.g. "--pieces 8192 --scan 0:0,64:2").
# FLA's Triton source, when carried in fla_src/ (ignored by git), is put on PYTHONPATH for the
# side-by-side benchmark. Files written to $OUT (at most 8 come back): summary.txt, build.log,
# ctest_gpu.log, sanitizer.log, pytest_gpu.log, bench_gpu.json, bench_gpu.log (bench step), or
# cp_gpu.log, bench_cp.json, bench_cp.log, cp_results.tar.gz (cp step), or bench_cp_step.json, bench_cp_step.log
# (cpstep step).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/deltacp-out}
mkdir -p "$OUT"
STEPS=${1:-build,test,sanitize,pytest,bench}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
SUM="$OUT/summary.txt"
say() { echo "$*" | tee -a "$SUM"; }
has() { [[ ",$STEPS," == *",$1,"* ]]; }
t_start=$(date +%s)
say "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -4 | tr '\n' ';')"
say "   nvcc $(nvcc --version | tail -1); python3 $(python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)')"
ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
[ "$ARCH" = 90 ] && ARCH=90a  # Hopper: the sm_90a target (wgmma, cuda/tiled/scan_wgmma.cuh)
BUILD=build-gpu

if has build; then
  t0=$(date +%s)
  # One build for everything: C++ tests and the Python modules (installed into a staging
  # site-packages below instead of a second build through pip).
  # DELTACP_BUILD_CTESTS=0 skips the GoogleTest programs (a run of pytest, stages or bench only needs the
  # Python modules: about a minute less on 16 cores).
  cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DDELTACP_CUDA=ON -DDELTACP_CUDA_ARCHS="$ARCH" \
        -DDELTACP_BUILD_BENCH=OFF -DDELTACP_BUILD_PYTHON=ON \
        -DDELTACP_BUILD_TESTS=$([ "${DELTACP_BUILD_CTESTS:-1}" = 0 ] && echo OFF || echo ON) >"$OUT/build.log" 2>&1 &&
    cmake --build $BUILD -j 16 >>"$OUT/build.log" 2>&1
  rc=$?
  rm -rf /tmp/dcp_site && mkdir -p /tmp/dcp_site/deltacp && cp -r bindings/python/deltacp/. /tmp/dcp_site/deltacp/ &&
    cmake --install $BUILD --component python --prefix /tmp/dcp_site >>"$OUT/build.log" 2>&1
  say "build: rc=$rc in $(( $(date +%s) - t0 )) s (sm_$ARCH)"
  if command -v cuobjdump >/dev/null 2>&1; then  # the wgmma scan must show tensor-core warpgroup products
    say "   HGMMA instructions in tiled_fwd: $(cuobjdump -sass $BUILD/cuda/CMakeFiles/deltacp_cuda.dir/tiled/tiled_fwd.cu.o 2>/dev/null | grep -c HGMMA), fused_fwd: $(cuobjdump -sass $BUILD/cuda/CMakeFiles/deltacp_cuda.dir/fused/fused_fwd.cu.o 2>/dev/null | grep -c HGMMA)"
  fi
  [ $rc -ne 0 ] && { tail -40 "$OUT/build.log"; }
fi

if has test; then
  t0=$(date +%s)
  (cd $BUILD && ctest -R '^cuda\.' --output-on-failure) >"$OUT/ctest_gpu.log" 2>&1
  rc=$?
  say "gpu ctest: rc=$rc in $(( $(date +%s) - t0 )) s: $(grep -E 'tests passed|tests failed' "$OUT/ctest_gpu.log" | tail -1)"
  # Full per-case output (errors measured) for the record.
  $BUILD/tests/cuda/test_cuda_tiers >>"$OUT/ctest_gpu.log" 2>&1
  say "   cases: $(grep -cE '^\[       OK \]' "$OUT/ctest_gpu.log") ok, $(grep -cE '^\[  FAILED  \]' "$OUT/ctest_gpu.log") failed lines"
fi

if has sanitize; then
  t0=$(date +%s)
  : >"$OUT/sanitizer.log"
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 $BUILD/tests/cuda/test_cuda_tiers \
      --gtest_filter="${DELTACP_SANITIZE_FILTER:-*small*:*T1*:*short*}" >>"$OUT/sanitizer.log" 2>&1
    rc=$?
    say "compute-sanitizer $tool: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer.log" | tail -1)"
  done
  say "   sanitizer time $(( $(date +%s) - t0 )) s"
fi

export PYTHONPATH="/tmp/dcp_site:${PYTHONPATH:-}"
if has pytest || has bench || has cp || has cpstep; then
  say "python package: $(cd /tmp && python3 -c 'import deltacp; print("built_with_cuda", deltacp.built_with_cuda(), "cuda_available", deltacp.cuda_available())' 2>&1 | tail -1)"
fi

if has pytest; then
  t0=$(date +%s)
  python3 -m pytest -q -x tests/python -k "${DELTACP_PYTEST_K:-cuda or gpu}" >"$OUT/pytest_gpu.log" 2>&1
  say "pytest (cuda): rc=$? in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/pytest_gpu.log")"
fi

if has scan; then  # the state scan alone: wgmma against mma.sync (bench/gpu/bench_scan.py)
  t0=$(date +%s)
  timeout 300 python3 bench/gpu/bench_scan.py --json "$OUT/bench_scan.json" ${DELTACP_SCAN_ARGS:-} >"$OUT/bench_scan.log" 2>&1
  say "scan bench: rc=$? in $(( $(date +%s) - t0 )) s"
  tail -24 "$OUT/bench_scan.log"
fi

# FLA's tuned Triton configs (bench/gpu/fla_autotune/README.md): restored before FLA first runs, so its
# autotuning (2 to 3.5 minutes per new head count) does not eat the benchmark's time.
restore_fla_autotune() {
  if [ -z "${TRITON_CACHE_DIR:-}" ]; then
    export TRITON_CACHE_DIR=/tmp/tcache
    mkdir -p "$TRITON_CACHE_DIR"
    for f in bench/gpu/fla_autotune/*.tar.gz; do tar -xzf "$f" -C "$TRITON_CACHE_DIR" 2>/dev/null; done
  fi
}

if has dplr; then  # DPLR beside FLA (its first calls compile and autotune: progress lines in bench_dplr.log)
  restore_fla_autotune
  touch /tmp/dplr_start
  t0=$(date +%s)
  PYTHONPATH="$PWD/fla_src:$PYTHONPATH" timeout ${DELTACP_DPLR_TIMEOUT:-420} python3 bench/gpu/bench_dplr.py \
    --out "$OUT/bench_dplr.json" ${DELTACP_DPLR_ARGS:-} >"$OUT/bench_dplr.log" 2>&1
  say "dplr bench: rc=$? in $(( $(date +%s) - t0 )) s"
  # The configs FLA tuned in this run (to keep beside the harness: bench/gpu/fla_autotune/README.md).
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -newer /tmp/dplr_start | tar -czf "$OUT/fla_autotune_new.tar.gz" -T -) 2>/dev/null
  say "   FLA autotune files written in this run: $(tar -tzf "$OUT/fla_autotune_new.tar.gz" 2>/dev/null | grep -c autotune)"
  tail -12 "$OUT/bench_dplr.log"
fi

if has stages; then  # where the tiled forward + backward spends its time, kernel by kernel
  t0=$(date +%s)
  if [ -n "${DELTACP_STAGE_ENVS:-}" ]; then  # forward + backward once per setting of the variables listed
    for setting in ${DELTACP_STAGE_ENVS}; do
      env ${setting//,/ } timeout 120 python3 bench/gpu/stage_times.py --variant "${DELTACP_STAGE_VARIANT:-gdn}" \
        $([ "${DELTACP_STAGE_FWD:-0}" = 1 ] || echo --backward) --backend "${DELTACP_STAGE_BACKEND:-fused}" \
        --shape "${DELTACP_STAGE_SHAPE:-2,16384,16,128}" 2>&1 | sed "s/^/[$setting] /" >>"$OUT/stages.log"
    done
  elif [ -n "${DELTACP_STAGE_FUSED:-}" ]; then  # the fused forward, whole sequences and each piece length listed
    for piece in ${DELTACP_STAGE_FUSED}; do
      DELTACP_FUSED_PIECE=$piece timeout 120 python3 bench/gpu/stage_times.py --variant gdn --backend fused \
        --shape "${DELTACP_STAGE_SHAPE:-2,16384,16,128}" 2>&1 | sed "s/^/[piece $piece] /" >>"$OUT/stages.log"
    done
  else
    for variant in gdn kda; do
      timeout 120 python3 bench/gpu/stage_times.py --variant $variant --backward \
        --shape "${DELTACP_STAGE_SHAPE:-2,16384,16,128}" >>"$OUT/stages.log" 2>&1
    done
    # kda's fused forward on its own (its token-parallel kernels differ from the tiled forward's above)
    timeout 120 python3 bench/gpu/stage_times.py --variant kda --backend fused \
      --shape "${DELTACP_STAGE_SHAPE:-2,16384,16,128}" >>"$OUT/stages.log" 2>&1
  fi
  say "stages: rc=$? in $(( $(date +%s) - t0 )) s"
  cat "$OUT/stages.log"
fi

if has bench; then
  restore_fla_autotune
  touch /tmp/bench_start
  t0=$(date +%s)
  PYTHONPATH="$PWD/fla_src:$PYTHONPATH" timeout ${DELTACP_BENCH_TIMEOUT:-420} python3 bench/gpu/bench_gpu.py \
    --out "$OUT/bench_gpu.json" ${DELTACP_BENCH_ARGS:-} >"$OUT/bench_gpu.log" 2>&1
  say "bench: rc=$? in $(( $(date +%s) - t0 )) s"
  # The configs FLA tuned in this run (a GPU, FLA option or shape the archives here do not cover), to keep
  # beside the harness so that the next run restores them (bench/gpu/fla_autotune/README.md).
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -newer /tmp/bench_start |
    tar -czf "$OUT/fla_autotune_bench_new.tar.gz" -T -) 2>/dev/null
  say "   FLA autotune files written in this run: $(tar -tzf "$OUT/fla_autotune_bench_new.tar.gz" 2>/dev/null | grep -c autotune)"
  tail -20 "$OUT/bench_gpu.log"
fi

if has cp && [ -f distributed/tests/run_gpu_cp.sh ]; then
  # The CP scripts call `python` and `torchrun`; the image has python3 (with torch) for sure.
  mkdir -p /tmp/bin && ln -sf "$(command -v python3)" /tmp/bin/python &&
    printf '#!/bin/sh\nexec python3 -m torch.distributed.run "$@"\n' >/tmp/bin/torchrun && chmod +x /tmp/bin/torchrun
  export PATH=/tmp/bin:$PATH
  t0=$(date +%s)
  mkdir -p /tmp/cpout
  OUT=/tmp/cpout NPROC=$(nvidia-smi -L | grep -c '^GPU') bash distributed/tests/run_gpu_cp.sh >"$OUT/cp_gpu.log" 2>&1
  say "cp (gpu): rc=$? in $(( $(date +%s) - t0 )) s"
  if ! has cpbench && [ "$(nvidia-smi -L | grep -c '^GPU')" -ge 2 ]; then  # cpbench: the same bench, with traces
    t0=$(date +%s)
    timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node=$(nvidia-smi -L | grep -c '^GPU') \
      bench/cp/bench_cp.py --profile ${DELTACP_CP_BENCH_ARGS:-} --json "$OUT/bench_cp.json" >"$OUT/bench_cp.log" 2>&1
    say "cp bench: rc=$? in $(( $(date +%s) - t0 )) s"
    tail -25 "$OUT/bench_cp.log"
  fi
  tar -czf "$OUT/cp_results.tar.gz" -C /tmp cpout 2>/dev/null
  tail -25 "$OUT/cp_gpu.log"
fi
if has ncu; then
  # One launch of a kernel under Nsight Compute (full set: warp stall reasons, pipe use, source counters),
  # from three forwards of one shape (forward + backward when the kernel's name has "bwd").
  # DELTACP_NCU_KERNEL (regex, default the state scan), DELTACP_NCU_SHAPE (B,T,H,D, default 1,32768,16,128:
  # one sequence, as in the CP bench), DELTACP_NCU_VARIANT (gdn, kda or dplr), DELTACP_NCU_SKIP / _COUNT (matching
  # launches skipped, then profiled: default 1, 1).
  t0=$(date +%s)
  if command -v ncu >/dev/null 2>&1; then
    IFS=, read -r NB NT NH ND <<<"${DELTACP_NCU_SHAPE:-1,32768,16,128}"
    timeout 300 ncu --kernel-name "regex:${DELTACP_NCU_KERNEL:-chunk_state_scan}" --launch-skip ${DELTACP_NCU_SKIP:-1} \
      --launch-count ${DELTACP_NCU_COUNT:-1} \
      --set full --import-source yes -o "$OUT/ncu_kernel" -f python3 -c "
import torch, torch.nn.functional as F, deltacp
B, T, H, D = $NB, $NT, $NH, $ND
q = torch.randn(B, T, H, D, device='cuda', dtype=torch.bfloat16)
k = F.normalize(torch.randn(B, T, H, D, device='cuda'), dim=-1).bfloat16()
v = torch.randn(B, T, H, D, device='cuda', dtype=torch.bfloat16)
variant = '${DELTACP_NCU_VARIANT:-gdn}'
kda = variant == 'kda'  # kda: a gate per key dimension (FLA's bench: logsigmoid / 8)
g = F.logsigmoid(torch.randn(B, T, H, D, device='cuda')) / 8 if kda else F.logsigmoid(torch.randn(B, T, H, device='cuda'))
beta = torch.rand(B, T, H, device='cuda').sigmoid().bfloat16()
backward = 'bwd' in '${DELTACP_NCU_KERNEL:-}'  # a backward kernel: forward + backward each time
if variant == 'dplr':  # bench_dplr.py's inputs, the tiled tier
    an = F.normalize(torch.rand(B, T, H, D, device='cuda'), dim=-1)
    xs = [q, k, v, an.bfloat16(), (-an).bfloat16(), F.logsigmoid(torch.randn(B, T, H, D, device='cuda')).clamp(-5, 0)]
    call = lambda: deltacp.chunk_dplr_delta_rule(*xs, backend='tiled', lower_bound=-5.0)
else:
    xs = [q, k, v, g, beta]
    call = lambda: (deltacp.chunk_kda if kda else deltacp.chunk_gated_delta_rule)(*xs)
for t in xs:
    t.requires_grad_(backward)
for _ in range(3):
    o, _ = call()
    if backward:
        o.backward(torch.ones_like(o))
torch.cuda.synchronize()
" >"$OUT/ncu.log" 2>&1
    rc=$?
    ncu --import "$OUT/ncu_kernel.ncu-rep" --page details --print-details all >"$OUT/ncu_details.txt" 2>&1
    # Per-instruction counters (SASS with warp stall samples): where a latency-bound kernel waits.
    ncu --import "$OUT/ncu_kernel.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu_source.csv" 2>&1 ||
      say "   ncu source page: not available"
    say "ncu (${DELTACP_NCU_KERNEL:-chunk_state_scan}): rc=$rc in $(( $(date +%s) - t0 )) s"
    grep -E "Duration|Registers|Achieved Occupancy|Issue Slots Busy|Warp Cycles Per Issued|Stall" "$OUT/ncu_details.txt" | head -${DELTACP_NCU_LINES:-30}
  else
    say "ncu: not on this image"
  fi
fi

NGPU=$(nvidia-smi -L | grep -c '^GPU')
if has cpbench; then
  t0=$(date +%s)
  mkdir -p "$OUT/trace"
  timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node=$NGPU bench/cp/bench_allgather.py \
    --json "$OUT/trace/bench_allgather.json" >"$OUT/bench_allgather.log" 2>&1
  say "all-gather bench: rc=$? in $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  timeout 400 python3 -m torch.distributed.run --standalone --nproc_per_node=$NGPU bench/cp/bench_cp.py --profile \
    --trace "$OUT/trace" --host-profile "$OUT/trace" ${DELTACP_CP_BENCH_ARGS:-} --json "$OUT/bench_cp.json" >"$OUT/bench_cp.log" 2>&1
  say "cp bench: rc=$? in $(( $(date +%s) - t0 )) s"
  grep -v "NCCL INFO" "$OUT/bench_allgather.log" | tail -10
  grep -v "profile rank" "$OUT/bench_cp.log" | tail -40
fi
if has cptimeline; then  # one deltacp CP call phase by phase, host and GPU, rank by rank (bench/cp/cp_timeline.py)
  if [ "$NGPU" -ge 2 ]; then
    t0=$(date +%s)
    : >"$OUT/cp_timeline.log"
    for v in ${DELTACP_CP_TIMELINE_VARIANTS:-gdn kda}; do
      for dir in "" --backward; do
        timeout 180 python3 -m torch.distributed.run --standalone --nproc_per_node=$NGPU bench/cp/cp_timeline.py \
          --tokens "${DELTACP_CP_TIMELINE_TOKENS:-32768}" --variant "$v" $dir --json "$OUT/cp_timeline.json" 2>&1 |
          grep -v "NCCL INFO" >>"$OUT/cp_timeline.log"
      done
    done
    say "cp timeline: in $(( $(date +%s) - t0 )) s ($NGPU GPUs) -> cp_timeline.log"
  fi
fi
if has cpstep; then  # deltacp's CP training step beside FLA's (its first calls compile and autotune: see the log)
  if [ "$NGPU" -ge 2 ]; then
    restore_fla_autotune
    touch /tmp/cpstep_start
    t0=$(date +%s)
    PYTHONPATH="$PWD/fla_src:$PYTHONPATH" timeout ${DELTACP_CP_STEP_TIMEOUT:-480} python3 -m torch.distributed.run \
      --standalone --nproc_per_node=$NGPU bench/cp/bench_cp_step.py --json "$OUT/bench_cp_step.json" \
      ${DELTACP_CP_STEP_ARGS:-} >"$OUT/bench_cp_step.log" 2>&1
    say "cp step bench: rc=$? in $(( $(date +%s) - t0 )) s ($NGPU GPUs)"
    # The configs FLA tuned in this run (its CP calls are varlen: keys the archives here may not cover), to keep
    # beside the harness so that the next run restores them (bench/gpu/fla_autotune/README.md).
    (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -newer /tmp/cpstep_start |
      tar -czf "$OUT/fla_autotune_cpstep_new.tar.gz" -T -) 2>/dev/null
    say "   FLA autotune files written in this run: $(tar -tzf "$OUT/fla_autotune_cpstep_new.tar.gz" 2>/dev/null | grep -c autotune)"
    grep -v "NCCL INFO" "$OUT/bench_cp_step.log" | tail -40
  else
    say "cp step bench: needs 2 or more GPUs, found $NGPU: skipped"
  fi
fi
# At most 8 files come back: the traces travel as one archive.
if has cpbench; then
  tar -czf "$OUT/cp_detail.tar.gz" -C "$OUT" trace 2>/dev/null && rm -rf "$OUT/trace"
fi
say "== total $(( $(date +%s) - t_start )) s"
cat "$SUM"
