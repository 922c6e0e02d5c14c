#!/usr/bin/env bash
# Two builds of ejkernel side by side on the lent GPU, in one call: the flash-attention harness
# on the baseline (.whl-base) and on the candidate (.whl), alternating ROUNDS times, each in a
# fresh process with a fresh cache, with cuDNN in every run. Arguments go to the harness
# (default: the two main shapes, Triton and Pallas against cuDNN). Tables land in $OUT.
# Here, before the call (BASE: the baseline commit):
#   pip wheel --no-deps ./ejkernel-core ./ejkernel-xla ./ejkernel-triton ./ejkernel-pallas -w .whl
#   git worktree add /tmp/base BASE && pip wheel --no-deps /tmp/base/ejkernel-{core,xla,triton,pallas} -w .whl-base
#   pip download --no-deps -d .whl jax-triton==0.3.1 cattrs   (the image lacks both)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
pip() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$@"; }
pip --target /tmp/deps .whl/jax_triton-*.whl .whl/cattrs-*.whl || exit 1
pip --target /tmp/new $(ls .whl/ejkernel_*.whl) || exit 1
pip --target /tmp/base $(ls .whl-base/ejkernel_*.whl) || exit 1
export PYTHONUNBUFFERED=1
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--quick --no-startup --shapes 2 --impls "ejkernel triton" "ejkernel pallas" cuDNN)
for round in $(seq 1 "${ROUNDS:-1}"); do
  for build in ${ORDER:-base new}; do
    cache=$(mktemp -d)
    EJKERNEL_CACHE_DIR=$cache PYTHONPATH=/tmp/$build:/tmp/deps \
      timeout "${BENCH_TIMEOUT:-280}" python3 benchmarks/bench_attention.py \
      --out "$OUT/$build-$round" "${ARGS[@]}" 2>&1 | grep -v '^{' | tee "$OUT/$build-$round.log" | tail -22
  done
done
