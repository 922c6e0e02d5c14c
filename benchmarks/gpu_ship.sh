#!/usr/bin/env bash
# Shipped tables for the lent GPU, in one call: installs .whl (our wheels + jax-triton, cattrs, tqdm),
# tunes the records of benchmarks/shipped_shapes.py (RECORDS: "fa" the forward flash-attention
# records on triton, pallas and cuda, "fa_grad" the differentiated ones, "decode" the decode
# records on triton, cuda and xla; default "fa decode"; EJKERNEL_LOG_AUTOTUNE=1 logs each
# candidate), merges each result into the installed plugins' tables for this device kind (ejkernel cache
# ship: the table as it was, then the new entries, which win on the same key; copies land in $OUT as
# <platform>-$SLUG.json, to commit into ejkernel-<platform>/src/ejkernel_<platform>/shipped/), then
# runs benchmarks/bench_shipped.py per main shape in a fresh process (BENCH=0 skips it). SLUG: h100
# or h200.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
kind=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$kind"; slug=${SLUG:-h200}
python3 benchmarks/shipped_shapes.py --out /tmp/shapes >/dev/null
python3 - <<'PY'
import json; d=json.load(open('/tmp/shapes/flash_attention.json'))
runs = d['invocations']
for name, grad in (('fa', False), ('fa_grad', True)):
    d['invocations'] = [r for r in runs if r['grad'] == grad]
    json.dump(d, open(f'/tmp/shapes/{name}.json', 'w'))
PY
for records in ${RECORDS:-fa decode}; do
  case $records in fa*) platforms=triton,pallas,cuda ;; decode) platforms=triton,cuda,xla ;; esac
  EJKERNEL_CACHE_DIR=$(mktemp -d) EJKERNEL_SHIPPED=0 timeout ${T:-300} python3 -m ejkernel tune \
    --shapes /tmp/shapes/$records.json --platforms $platforms --out "$OUT/$records-$slug.json" \
    --max-workers 12 2>&1 | grep -v "cuda_timer\|_report\|AutotuneWarning" \
    | tee "$OUT/tune-$records-$slug.log" | cut -c1-220 | tail -16
  for p in triton pallas cuda xla; do
    table=/tmp/site/ejkernel_$p/shipped/$slug.json; keep=$p; [ $p = xla ] && keep=xla,choice
    old=(); [ -f "$table" ] && { cp "$table" /tmp/old-$p.json; old=(/tmp/old-$p.json); }
    python3 -m ejkernel cache ship "${old[@]}" "$OUT/$records-$slug.json" --platform $keep --out "$table"
  done
done
for p in triton pallas cuda xla; do cp /tmp/site/ejkernel_$p/shipped/$slug.json "$OUT/$p-$slug.json" 2>/dev/null; done
[ "${BENCH:-1}" = 0 ] && exit 0
for shape in 4,4096,16,128 8,2048,16,64; do for c in "" --causal; do
  EJKERNEL_CACHE_DIR=$(mktemp -d) timeout 120 python3 benchmarks/bench_shipped.py --shape $shape $c 2>&1 | grep -v cuda_timer | tail -12
done; done
