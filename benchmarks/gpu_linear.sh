#!/usr/bin/env bash
# Linear attention on the lent GPU, in one call: installs .whl (our wheels, jax-triton) and, when
# carried, .whl-fla (fla-core and einops wheels: the flash-linear-attention anchors on torch)
# and .whl-mamba (benchmarks/fetch_mamba_anchor.sh: mamba-ssm's Triton SSD),
# then benchmarks/bench_linear_gpu.py: ejkernel's Triton and XLA rows, the anchors in a process
# of their own (ANCHOR_TIMEOUT: fla tunes each kernel on its first call, for minutes), and the
# decoding table. Arguments go to the first run (e.g. --op gla --op kda). Logs land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
wheels=(.whl/*.whl); [ -d .whl-fla ] && wheels+=(.whl-fla/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" || exit 1
[ -d .whl-mamba ] && cp -r .whl-mamba/mamba_ssm /tmp/site/  # fetch_mamba_anchor.sh: the SSD anchor
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 EJKERNEL_CACHE_DIR=$(mktemp -d) XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/linear.log"
quiet() { grep -v -i "warn\|cuda_timer\|from_numpy"; }
timeout ${TIMEOUT:-240} python3 benchmarks/bench_linear_gpu.py --anchors no "$@" 2>&1 | quiet | tee -a "$OUT/linear.log"
timeout ${ANCHOR_TIMEOUT:-420} python3 benchmarks/bench_linear_gpu.py --anchors only "$@" 2>&1 | quiet | tee -a "$OUT/linear.log"
timeout ${DECODE_TIMEOUT:-150} python3 benchmarks/bench_linear_gpu.py --decode 2>&1 | quiet | tee -a "$OUT/linear.log"
