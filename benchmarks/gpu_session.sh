#!/usr/bin/env bash
# One lent-GPU call: install the carried wheels, run the GPU-marked and full CPU-semantics tests
# on the GPU, then the flash-attention benchmark. Logs land in $OUT.
# Here, before the call:  pip wheel --no-deps ./ejkernel-core ./ejkernel-xla -w .whl
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 EJKERNEL_CACHE_DIR=/tmp/ejkernel-cache
python3 - <<'PY' | tee "$OUT/env.txt"
import importlib.metadata as md, jax
print("jax", jax.__version__, "jaxlib", md.version("jaxlib"), "devices", jax.devices())
for d in ("triton", "ejkernel-core", "ejkernel-xla"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "missing")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/env.txt"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 420 python3 -m pytest ${TESTS:-tests/xla/test_flash_attention_gpu.py tests/xla/test_flash_attention.py tests/core} \
  -q -p no:cacheprovider -x 2>&1 | tee "$OUT/pytest.log" | tail -25
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_flash_attention.py --gpu ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
