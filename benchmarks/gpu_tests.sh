#!/usr/bin/env bash
# The gpu-marked tests on the lent GPU machine in one call: install the carried wheels (.whl:
# ours and jax-triton), run GROUP's tests across N pytest-xdist workers, each test's outcome
# appended to $OUT/tests.txt as it ends (so a run cut by the time limit still names what passed
# and what failed), then the failures and the slowest tests. The whole suite takes longer than
# one call: run the groups in calls of their own. Workers spread over the host's GPUs (worker i
# on GPU i mod n), 4 a GPU unless N says.
#   GROUP=triton   tests/triton but the ring (2 GPUs or more)
#   GROUP=rest     tests/core, cuda, pallas and xla but the default-call sweep
#   GROUP=sweep    tests/cuda/test_default_call_sweep.py (tunes: fewer workers)
#   GROUP=ring     tests/triton/test_ring_attention_gpu.py, one test at a time (every GPU)
#   GROUP=ids      the test ids or paths in TESTS (space-separated)
# Here, before the call: pip wheel --no-deps ./ejkernel-* -w .whl (see benchmarks/RESULTS.md).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 EJKERNEL_CACHE_DIR=$(mktemp -d) XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EJKERNEL_TEST_LOG="$OUT/tests.txt"
gpus=$(nvidia-smi -L | wc -l)
ring=tests/triton/test_ring_attention_gpu.py sweep=tests/cuda/test_default_call_sweep.py
case ${GROUP:-triton} in
  triton) tests=(tests/triton --ignore=$ring); n=${N:-$((4 * gpus))} ;;
  rest) tests=(tests/core tests/cuda tests/pallas tests/xla --ignore=$sweep); n=${N:-$((4 * gpus))} ;;
  sweep) tests=($sweep); n=${N:-$((2 * gpus))} ;;
  ring) tests=($ring); n=${N:-0} ;;
  ids) read -ra tests <<< "${TESTS:?TESTS: the test ids}"; n=${N:-$((4 * gpus))} ;;
  *) echo "GROUP: triton, rest, sweep, ring or ids"; exit 2 ;;
esac
workers=(); [ "$n" -gt 0 ] && workers=(-n "$n") && export EJKERNEL_TEST_GPUS=$gpus
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu_tests.log"
timeout -s ABRT ${TT:-540} python3 -X faulthandler -m pytest "${tests[@]}" -m gpu "${workers[@]}" \
  -p no:benchmark -p no:cacheprovider -q --tb=short > "$OUT/pytest.log" 2>&1
echo "pytest rc $?" | tee -a "$OUT/gpu_tests.log"
{
  cut -d' ' -f1 "$OUT/tests.txt" | sort | uniq -c
  grep -v "^passed\|^skipped" "$OUT/tests.txt"
  [ -f "$OUT/tests.txt.failures" ] && grep "^E  " "$OUT/tests.txt.failures" | head -40
  echo "slowest:"; sort -k3 -t' ' -rn <(awk '{sub("s$","",$3); print $1, $2, $3}' "$OUT/tests.txt") | head -8
} | tee -a "$OUT/gpu_tests.log"
