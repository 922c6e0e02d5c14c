#!/usr/bin/env bash
# Serving attention on the lent GPU, in one call: installs .whl (our wheels, jax-triton) and, when
# carried, .whl-vllm (benchmarks/fetch_vllm_anchor.sh: vLLM's Triton unified attention, on the
# GPU machine's torch and triton), then benchmarks/bench_serving.py with the arguments given
# (none: --serving default,triton --anchors). The log lands in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
[ -d .whl-vllm ] && cp -r .whl-vllm/vllm /tmp/site/  # fetch_vllm_anchor.sh: the vLLM anchor
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 EJKERNEL_CACHE_DIR=$(mktemp -d)
args=("$@"); [ $# -eq 0 ] && args=(--serving default,triton --anchors)
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/serving.log"
timeout ${TIMEOUT:-540} python3 benchmarks/bench_serving.py "${args[@]}" 2>&1 | tee -a "$OUT/serving.log"
