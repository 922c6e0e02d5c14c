#!/usr/bin/env bash
# One lent-GPU call: install the carried wheels into /tmp/site, print versions, run "$@".
# Here, before the call: pip wheel --no-deps ./ejkernel-core ./ejkernel-xla ./ejkernel-triton -w .whl
# (plus the jax-triton and cattrs wheels the GPU image lacks, see README "GPU runs").
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 EJKERNEL_CACHE_DIR=${EJKERNEL_CACHE_DIR:-/tmp/ejkernel-cache}
python3 - <<'PY' | tee "$OUT/env.txt"
import importlib.metadata as md, jax
print("jax", jax.__version__, "jaxlib", md.version("jaxlib"), "devices", jax.devices())
for d in ("triton", "jax-triton", "ejkernel-core", "ejkernel-xla", "ejkernel-triton"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "missing")
PY
"$@"
