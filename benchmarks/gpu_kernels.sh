#!/usr/bin/env bash
# Per-kernel GPU times of one linear-attention op's forward+backward, in one lent-GPU call:
# installs .whl (our wheels, jax-triton), runs `bench_linear_gpu.py --once --op OP` under
# Nsight Compute (`--clock-control none`: the card's own clocks, as the timed runs have them)
# and prints each kernel's time at its last launch (the second, warm call). Logs land in $OUT.
# Usage: OPS="kda gdn" bash benchmarks/gpu_kernels.sh (PATTERN: ncu's kernel-name filter;
# default the op's kernels, every kernel for ssd and ssm; ONCE_ARGS=--forward: an undifferentiated
# call's kernels, under the forward's own configs). DETAILS=1: then the same kernels' warm launch
# again under ncu's speed-of-light, memory, occupancy and warp-stall sections, into
# $OUT/ncu_details_OP.txt (where the time goes: bytes, latency or issue)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 EJKERNEL_CACHE_DIR=$(mktemp -d) XLA_PYTHON_CLIENT_PREALLOCATE=false
export EJKERNEL_AUTOTUNE_POLICY=${EJKERNEL_AUTOTUNE_POLICY:-heuristics}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/kernels.log"
for op in ${OPS:-kda}; do
  csv="$OUT/ncu_$op.csv"
  case $op in gdn) pattern=kda ;; ssd) pattern=. ;; ssm) pattern=. ;; *) pattern=$op ;; esac
  timeout ${TIMEOUT:-200} ncu --clock-control none --metrics gpu__time_duration.sum \
    -k "regex:${PATTERN:-$pattern}" --csv python3 benchmarks/bench_linear_gpu.py --once ${ONCE_ARGS:-} --op "$op" \
    > "$csv" 2> "$OUT/ncu_$op.err"
  python3 - "$csv" "$op" <<'PY' | tee -a "$OUT/kernels.log"
import collections, csv, sys

rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    sys.exit(f"{sys.argv[2]}: ncu wrote no rows (see ncu_{sys.argv[2]}.err)")
head = rows[0]
name, value, unit = (head.index(k) for k in ("Kernel Name", "Metric Value", "Metric Unit"))
scale = {"n": 1e-6, "u": 1e-3, "m": 1.0, "s": 1e3}
times = collections.defaultdict(list)
for r in rows[1:]:
    times[r[name]].append(float(r[value].replace(",", "")) * scale[r[unit].lower()[0]])
print(f"### {sys.argv[2]}: ms per kernel (last launch)")
for kernel, ms in times.items():
    print(f"| {kernel[:70]} | {ms[-1]:.3f} |")
PY
  if [ -n "${DETAILS:-}" ]; then
    timeout ${TIMEOUT:-200} ncu --clock-control none --section SpeedOfLight --section Occupancy \
      --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
      -k "regex:${PATTERN:-$pattern}" python3 benchmarks/bench_linear_gpu.py --once ${ONCE_ARGS:-} \
      --op "$op" > "$OUT/ncu_details_$op.txt" 2>> "$OUT/ncu_$op.err"
    grep -E "^  [a-z_0-9]+_kernel|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy" \
      "$OUT/ncu_details_$op.txt" | tee -a "$OUT/kernels.log"
  fi
done
