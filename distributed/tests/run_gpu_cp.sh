#!/usr/bin/env bash
# distributed/tests/run_gpu_cp.sh — context parallelism on 2 GPUs (2 x H200, NVLink), JSON under $OUT.
#
#   bash distributed/tests/run_gpu_cp.sh            # from the repository root, on a machine with >= 2 GPUs
#
# 1. builds (if needed) and installs the package with deltacp._cp_nccl: pip install --no-build-isolation .
#    (scikit-build-core; the CMake target deltacp_core pulls deltacp_cp_nccl in when NCCL is found)
#    and the host check of the kernel bodies (CMake target deltacp_cp_body_host_test);
# 2. the pre-pass kernels vs the reference, CP over NCCL vs one GPU (fp32 1e-5, bf16 3e-3 / 8e-3),
#    bitwise determinism, mismatched cu_seqlens            -> cp_gpu_check_rank*.json
#    (and with the state scan cut into 128-token pieces    -> cut/cp_gpu_check_rank*.json)
# 3. faults: a rank that sleeps / exits mid-exchange       -> cp_gpu_sleep_rank*.json, cp_gpu_exit_rank*.json
# 4. the torchrun examples on GPUs (tables)                -> cp_examples.txt
# On a machine with one GPU (NPROC=1, or NGPU < 2) steps 2 and 3 run as 2 ranks sharing GPU 0 over gloo
# (gpu_cp_check.py --shared-gpu: the CP ops' GPU path, not deltacp's NCCL communicator) and 4 is skipped.
# Exit status non-zero when any step fails; every step runs regardless.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/cp_gpu_out}
mkdir -p "$OUT"
NPROC=${NPROC:-2}
SHARED=()
if [ "$NPROC" -lt 2 ]; then  # NCCL refuses two ranks on one device: gloo, both ranks on GPU 0
  NPROC=2; SHARED=(--shared-gpu)
  echo "one GPU: the checks run as 2 ranks sharing GPU 0 over gloo; the NCCL communicator and the examples are not run"
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
status=0
PY=${PYTHON:-python3}  # the interpreter that has torch (a bare `python` may be another one)
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, remember failures
  local name=$1; shift
  echo "== $name: $*"
  if "$@" > "$OUT/$name.log" 2>&1; then echo "   ok"; else echo "   FAILED (see $OUT/$name.log)"; tail -n 30 "$OUT/$name.log"; status=1; fi
}

# torch first: it loads the libnccl / libcudart that the module links against.
if ! "$PY" -c "import torch, deltacp._cp_nccl" 2>/dev/null; then
  step install "$PY" -m pip install --no-build-isolation -v .
fi
"$PY" -c "import torch, deltacp, deltacp._cp_nccl; print('deltacp', deltacp.__file__, 'cuda tiers:', deltacp.built_with_cuda())" \
  | tee "$OUT/cp_build.txt" || status=1

# The host check also runs in CI on CPUs; DELTACP_CP_SKIP_HOST=1 saves its separate build on a GPU machine.
[ "${DELTACP_CP_SKIP_HOST:-0}" = 1 ] || step host_body bash -c "cmake -S . -B build-cp-gpu -G Ninja -DDELTACP_BUILD_BENCH=OFF > /dev/null && \
  cmake --build build-cp-gpu --target deltacp_cp_body_host_test && ./build-cp-gpu/distributed/deltacp_cp_body_host_test"

step check timeout 900 torchrun --nproc_per_node="$NPROC" --master_port=29631 distributed/tests/gpu_cp_check.py check "${SHARED[@]}" --out "$OUT"
# Again with the local tiled forward's state scan cut into pieces of 128 tokens wherever a sequence is longer
# (cuda/tiled/scan_split.cu; by default only long sequences on a narrow grid are cut): the CP pre-pass then
# takes its pieces from the local forward's pass 1, and must still equal one GPU and the one-shot path.
step check_cut env DELTACP_TILED_SCAN_PIECE=128 timeout 900 torchrun --nproc_per_node="$NPROC" --master_port=29635 \
  distributed/tests/gpu_cp_check.py check "${SHARED[@]}" --out "$OUT/cut"
# NCCL's own view of the faults goes to the logs (warnings only).
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
step fault_sleep timeout 300 torchrun --nproc_per_node="$NPROC" --master_port=29632 distributed/tests/gpu_cp_check.py sleep "${SHARED[@]}" --out "$OUT"
step fault_exit timeout 300 torchrun --nproc_per_node="$NPROC" --master_port=29633 distributed/tests/gpu_cp_check.py exit "${SHARED[@]}" --out "$OUT"

[ ${#SHARED[@]} -eq 0 ] && for args in "gdn_cp --dtype bfloat16" "gdn_cp --dtype float32" "kda_cp --dtype bfloat16" \
            "dplr_cp --dtype float32" "dplr_cp --dtype bfloat16" "dplr_cp --dtype bfloat16 --backend tiled" \
            "gdn_cp --dtype bfloat16 --seqlens 32768,32768 --heads 16 --head-dim 128 --no-initial-state"; do
  name=example_$(echo "$args" | tr ' ,-' '___' | tr -s _)
  step "$name" timeout 600 torchrun --nproc_per_node="$NPROC" --master_port=29634 -m deltacp.examples.$args --device cuda
  cat "$OUT/$name.log" >> "$OUT/cp_examples.txt"
done

# The fault runs judge only the healthy ranks (rank 1 is the victim): require their JSON to say ok.
"$PY" - "$OUT" <<'PY' || status=1
import glob, json, sys
bad = []
for mode in ("check", "sleep", "exit"):  # a healthy rank that crashed writes no report at all
    if not glob.glob(sys.argv[1] + f"/cp_gpu_{mode}_rank0.json"):
        bad.append(f"cp_gpu_{mode}_rank0.json (missing: rank 0 crashed or hung?)")
for f in sorted(glob.glob(sys.argv[1] + "/cp_gpu_*_rank*.json")):
    r = json.load(open(f))
    if not r.get("ok"):
        bad.append(f)
print("cp GPU JSON reports:", "all ok" if not bad else "FAILED: " + ", ".join(bad))
sys.exit(1 if bad else 0)
PY
echo "run_gpu_cp.sh: $([ $status = 0 ] && echo OK || echo FAILED)  (results in $OUT)"
exit $status
