#!/usr/bin/env bash
# Shipped tables for the lent GPU, in one call: installs .whl (our wheels + jax-triton, cattrs, tqdm),
# tunes the forward flash-attention records of benchmarks/shipped_shapes.py on triton, pallas and
# cuda (ejkernel tune), ships them into the installed plugins (ejkernel cache ship; copies land in
# $OUT as <platform>-$SLUG.json, to commit into ejkernel-<platform>/src/ejkernel_<platform>/shipped/),
# then runs benchmarks/bench_shipped.py per main shape in a fresh process (BENCH=0 skips it). SLUG:
# h100 or h200.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$kind"; slug=${SLUG:-h200}
python3 benchmarks/shipped_shapes.py --out /tmp/shapes >/dev/null
python3 - <<'PY'
import json; d=json.load(open('/tmp/shapes/flash_attention.json'))
d['invocations']=[r for r in d['invocations'] if not r['grad']]
json.dump(d, open('/tmp/shapes/fa_fwd.json','w'))
PY
EJKERNEL_CACHE_DIR=$(mktemp -d) EJKERNEL_SHIPPED=0 timeout ${T:-300} python3 -m ejkernel tune --shapes /tmp/shapes/fa_fwd.json --platforms triton,pallas,cuda --out "$OUT/fa-fwd-$slug.json" --max-workers 12 2>&1 | grep -v cuda_timer | grep -v "_report\|AutotuneWarning" | cut -c1-200 | tail -14
for p in triton pallas cuda; do
  python3 -m ejkernel cache ship "$OUT/fa-fwd-$slug.json" --platform $p --out /tmp/site/ejkernel_$p/shipped/$slug.json
done
python3 -m ejkernel cache ship "$OUT/fa-fwd-$slug.json" --platform choice --out /tmp/site/ejkernel_xla/shipped/$slug.json
cp /tmp/site/ejkernel_*/shipped/$slug.json "$OUT/" 2>/dev/null; for p in triton pallas cuda xla; do cp /tmp/site/ejkernel_$p/shipped/$slug.json "$OUT/$p-$slug.json"; done
[ "${BENCH:-1}" = 0 ] && exit 0
for shape in 4,4096,16,128 8,2048,16,64; do for c in "" --causal; do
  EJKERNEL_CACHE_DIR=$(mktemp -d) timeout 120 python3 benchmarks/bench_shipped.py --shape $shape $c 2>&1 | grep -v cuda_timer | tail -5
done; done
