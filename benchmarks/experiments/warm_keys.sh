set -u
# On the GPU: N times (fresh caches each), a cold start then a warm start of
# experiments/warm_keys.py; the cold's choice and writes, the warm's every lookup.
SKIP_TESTS=1 BENCH_TIMEOUT=1 bash benchmarks/gpu_attention.sh --help >/dev/null 2>&1
export PYTHONPATH=/tmp/site:/tmp/anchors PYTHONUNBUFFERED=1 EJKERNEL_CACHE_DIR=/tmp/wk/ejk EJKERNEL_AUTOTUNE_POLICY=autotune
for i in $(seq ${1:-1}); do
  rm -rf /tmp/wk; mkdir -p /tmp/wk
  echo "=== repeat $i cold"
  python benchmarks/experiments/warm_keys.py > /tmp/wk/cold.log 2>&1
  grep -E "CHOOSE|TIMES|rror" /tmp/wk/cold.log | cut -c1-400
  grep -E "PARTS|META" /tmp/wk/cold.log | grep "flash_attention_fwd_kernel" | sort -u | cut -c1-1200
  echo "  writes: $(grep -c WRITE /tmp/wk/cold.log)"
  cp /tmp/wk/cold.log "${OUT:-/tmp}/cold-$i.log"
  echo "=== repeat $i warm"
  python benchmarks/experiments/warm_keys.py 2>&1 | grep -E "CHOOSE|KEY|READ|WRITE|TIMES|rror|PARTS|META" | cut -c1-1200
done
