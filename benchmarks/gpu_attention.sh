#!/usr/bin/env bash
# Flash attention on the lent GPU in one call: install ours (.whl) and the anchors (.whl-anchors:
# tokamax and its pure-Python dependencies, upstream ejkernel 0.0.80.3 into its own folder),
# run the GPU tests (TESTS, default tests/triton; SKIP_TESTS=1 skips them), then the attention
# harness. Arguments go to the harness, e.g.
#   bash benchmarks/gpu_attention.sh --quick --shapes 2 --impls "ejkernel triton" cuDNN \
#       "tokamax triton" "tokamax mosaic"                     (the table RESULTS.md quotes)
#   SKIP_TESTS=1 bash benchmarks/gpu_attention.sh --mode rounds --rounds 6
#   SKIP_TESTS=1 bash benchmarks/gpu_attention.sh --mode configs --rounds 3
#   SKIP_TESTS=1 bash benchmarks/gpu_attention.sh --mode startup --repeat 3
# Here, before the call:
#   pip wheel --no-deps ./ejkernel-core ./ejkernel-xla ./ejkernel-triton -w .whl
#   pip download --no-deps -d .whl jax-triton==0.3.1 cattrs   (the image lacks both)
#   pip download --no-deps -d .whl-anchors tokamax einshape qwix immutabledict tensorboardx \
#       typeguard==2.13.3 pydantic pydantic-core annotated-types typing-inspection beartype \
#       ejkernel==0.0.80.3   (pydantic-core for cp312)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
pip() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$@"; }
pip --target /tmp/site .whl/*.whl || exit 1
if [ -d .whl-anchors ]; then
  pip --target /tmp/anchors $(ls .whl-anchors/*.whl | grep -v -e "/ejkernel-" -e beartype)
  pip --target /tmp/upstream .whl-anchors/ejkernel-*.whl .whl-anchors/beartype-*.whl
fi
export PYTHONPATH=/tmp/site:/tmp/anchors PYTHONUNBUFFERED=1 EJKERNEL_CACHE_DIR=/tmp/ejkernel-cache
export EJKERNEL_UPSTREAM_PATH=/tmp/upstream:/tmp/anchors
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 480 python3 -m pytest ${TESTS:-tests/triton} -m gpu -q -p no:cacheprovider -rf 2>&1 \
    | tee "$OUT/pytest.log" | tail -15
fi
timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/bench_attention.py --out "$OUT/attention" "$@" 2>&1 \
  | tee "$OUT/bench.log" | grep -v '^{' | tail -60
