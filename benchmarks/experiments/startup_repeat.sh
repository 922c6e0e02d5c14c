set -u
# On the GPU: the harness's startup() (a cold start, then a warm one, of a new shape, each a
# fresh process with fresh caches per repeat) N times, to see the spread of the warm start.
SKIP_TESTS=1 BENCH_TIMEOUT=1 bash benchmarks/gpu_attention.sh --help >/dev/null 2>&1
export PYTHONPATH=/tmp/site:/tmp/anchors PYTHONUNBUFFERED=1
cd benchmarks && python - "${1:-3}" <<'PY'
import sys
from bench_attention import startup, startup_line
for i in range(int(sys.argv[1])):
    print(f"repeat {i}:", startup_line((2, 3072, 16, 128), startup((2, 3072, 16, 128))), flush=True)
PY
