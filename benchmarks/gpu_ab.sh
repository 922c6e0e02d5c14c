#!/usr/bin/env bash
# Two builds of ejkernel side by side on the lent GPU, in one call: a harness (BENCH, default the
# flash-attention one) on the baseline (.whl-base) and on the candidate (.whl), alternating
# ROUNDS times, each in a fresh process with a fresh cache and the same anchors. Arguments go
# to the harness (flash attention's default: the two main shapes, Triton and Pallas against
# cuDNN; e.g. BENCH=benchmarks/bench_grouped_matmul.py with --gpu --no-anchors --routing
# zipf). Tables land in $OUT. ORDER names a round's runs (default "base new");
# "new:heuristics" runs a build on its heuristics alone (EJKERNEL_SHIPPED=0: the candidate's
# code without its shipped tables); any other build name X in ORDER runs the wheels of .whl-X
# (carry it).
# Here, before the call (BASE: the baseline commit, X a build's ref):
#   bash benchmarks/wheels_of.sh HEAD .whl; bash benchmarks/wheels_of.sh BASE .whl-base
#   bash benchmarks/wheels_of.sh X .whl-e1   (and so on for each build in ORDER)
#   pip download --no-deps -d .whl jax-triton==0.3.1 cattrs   (the image lacks both)
# BUILDS=DIR: build X's wheels are in DIR/X instead ("new" too; one folder to carry, as carry
# takes at most 8 paths), e.g. bash benchmarks/wheels_of.sh X .builds/e1.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
pip() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$@"; }
pip --target /tmp/deps .whl/jax_triton-*.whl .whl/cattrs-*.whl || exit 1
for build in $(printf '%s\n' ${ORDER:-base new} | sed 's/:.*//' | sort -u); do
  dir=.whl-$build; [ "$build" = new ] && dir=.whl
  [ -n "${BUILDS:-}" ] && dir=$BUILDS/$build
  pip --target /tmp/$build $(ls $dir/ejkernel_*.whl) || exit 1
done
export PYTHONUNBUFFERED=1
BENCH=${BENCH:-benchmarks/bench_attention.py}
ARGS=("$@")
if [ "$BENCH" = benchmarks/bench_attention.py ] && [ ${#ARGS[@]} -eq 0 ]; then
  ARGS=(--quick --no-startup --shapes 2 --impls "ejkernel triton" "ejkernel pallas" cuDNN)
fi
for round in $(seq 1 "${ROUNDS:-1}"); do
  for run in ${ORDER:-base new}; do
    build=${run%%:*} policy=${run#*:} name=${run/:/-}
    [ "$policy" = "$run" ] && policy=""
    cache=$(mktemp -d) out=()
    [ "$BENCH" = benchmarks/bench_attention.py ] && out=(--out "$OUT/$name-$round")
    EJKERNEL_CACHE_DIR=$cache PYTHONPATH=/tmp/$build:/tmp/deps \
      env ${policy:+EJKERNEL_AUTOTUNE_POLICY=$policy EJKERNEL_SHIPPED=0} timeout "${BENCH_TIMEOUT:-280}" \
      python3 "$BENCH" "${out[@]}" "${ARGS[@]}" 2>&1 | grep -v '^{' | tee "$OUT/$name-$round.log" | tail -22
  done
done
