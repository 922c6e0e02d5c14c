set -u
# On the GPU: a cold start of a new shape, then three warm starts; after each, which kernels the
# cache holds and how many __pycache__ folders the install has (where do warm seconds go?).
export PYTHONPATH=/tmp/site:/tmp/anchors PYTHONUNBUFFERED=1 EJKERNEL_CACHE_DIR=/tmp/wp/ejk TRITON_CACHE_DIR=/tmp/wp/tri EJKERNEL_AUTOTUNE_POLICY=autotune
rm -rf /tmp/wp; mkdir -p /tmp/wp
echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}"
cat > /tmp/wp/start.py <<'PY'
import time; t0 = time.perf_counter()
import jax, jax.numpy as jnp, ejkernel
q = jax.block_until_ready(jax.random.normal(jax.random.PRNGKey(0), (2, 3072, 16, 128), jnp.bfloat16))
t1 = time.perf_counter()
f = jax.jit(jax.grad(lambda q: ejkernel.flash_attention(q, q, q, causal=True, platform="triton").astype(jnp.float32).sum()))
lowered = f.lower(q); t2 = time.perf_counter()
jax.block_until_ready(lowered.compile()(q)); t3 = time.perf_counter()
print(f"TIMES input {t1-t0:.2f} trace {t2-t1:.2f} compile+run {t3-t2:.2f}")
PY
for run in cold warm1 warm2 warm3; do
  python /tmp/wp/start.py 2>&1 | grep TIMES | sed "s/^/$run /"
  echo "  pycache dirs: $(find /tmp/site -name __pycache__ | wc -l); kernels:"
  for f in $(ls -tr /tmp/wp/ejk/triton/*.json); do python -c "import json,sys; print('   ', json.load(open(sys.argv[1]))['name'], sys.argv[1][-12:])" $f; done | sort | uniq -c | sort -rn | head -20
done
