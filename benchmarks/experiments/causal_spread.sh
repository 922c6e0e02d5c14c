set -u
# On the GPU: experiments/causal_spread.py in N fresh processes (fresh caches each), to see
# whether the causal D 128 fwd+bwd spread is between processes or within one.
SKIP_TESTS=1 BENCH_TIMEOUT=1 bash benchmarks/gpu_attention.sh --help >/dev/null 2>&1
export PYTHONPATH=/tmp/site:/tmp/anchors PYTHONUNBUFFERED=1
for i in $(seq ${1:-3}); do
  rm -rf /tmp/spread; mkdir -p /tmp/spread
  echo "=== process $i"
  EJKERNEL_CACHE_DIR=/tmp/spread python benchmarks/experiments/causal_spread.py 2>&1 | grep -E "^  |rror"
done
