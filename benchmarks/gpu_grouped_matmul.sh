#!/usr/bin/env bash
# Grouped matmul on the lent GPU, in one call: installs .whl (ours) and, when carried,
# .whl-anchors (tokamax 0.0.12 and its pure-Python dependencies: tokamax's ragged_dot, the
# Mosaic GPU sm_90 kernel), then benchmarks/bench_grouped_matmul.py --gpu with the arguments
# given (default: issue 32's even and Zipf shapes against a dense matmul, lax.ragged_dot, JAX's
# ragged_dot_mgpu and tokamax). The log lands in $OUT.
# Here, before the call:
#   pip wheel --no-deps ./ejkernel-core ./ejkernel-xla ./ejkernel-pallas -w .whl
#   pip download --no-deps -d .whl-anchors tokamax==0.0.12 einshape qwix immutabledict \
#       tensorboardx typeguard==2.13.3 pydantic annotated-types typing-inspection jaxtyping \
#       wadler-lindig
#   pip download --no-deps -d .whl-anchors --python-version 3.12 --only-binary=:all: pydantic-core
# (tokamax's qwix imports flax, which the GPU image is expected to hold.)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
pip() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$@"; }
pip --target /tmp/site .whl/*.whl || exit 1
py=cp$(python3 -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
[ -d .whl-anchors ] && pip --target /tmp/anchors $(ls .whl-anchors/*.whl | grep -E -v "cp3[0-9]+-" ; ls .whl-anchors/*-$py-*.whl 2>/dev/null)
export PYTHONPATH=/tmp/site:/tmp/anchors PYTHONUNBUFFERED=1 EJKERNEL_CACHE_DIR=$(mktemp -d)
export EJKERNEL_AUTOTUNE_POLICY=${EJKERNEL_AUTOTUNE_POLICY:-heuristics}
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/grouped_matmul.log"
args=("$@"); [ $# -eq 0 ] && args=(--gpu)
timeout ${TIMEOUT:-540} python3 benchmarks/bench_grouped_matmul.py "${args[@]}" 2>&1 \
  | grep -v -i "warn" | tee -a "$OUT/grouped_matmul.log"
