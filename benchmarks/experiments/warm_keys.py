"""Which kernel-cache keys does a start ask for, and where do they come from? (issue 5, warm start)

Run it on the GPU several times against one cache folder (a cold start, then warm ones): each
``choose`` of the config chain and each kernel-cache lookup (key, kernel, hit in memory / on
disk / compiled, written or not) is printed, with the parts of the key that hold Python or
NumPy values, so two keys for one kernel show what differs.
"""

import hashlib
import time

t0 = time.perf_counter()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ejkernel  # noqa: E402
from ejkernel import _chain  # noqa: E402

choose = _chain.ConfigSelectorChain.choose


def logged_choose(self, tunable, inv, **kw):
    choice = choose(self, tunable, inv, **kw)
    print(f"CHOOSE grad={inv.metadata.get('grad')} source={choice.source} cfg={choice.config!r}")
    return choice


_chain.ConfigSelectorChain.choose = logged_choose

from ejkernel_triton import _kernel_cache  # noqa: E402

key, read, write = _kernel_cache._key, _kernel_cache._read, _kernel_cache._write


def logged_key(fn, arg_dtypes, scalar_args, kw):
    k = key(fn, arg_dtypes, scalar_args, kw)
    metas = sorted((n, type(v).__name__, repr(v)) for n, v in kw.get("metaparams", {}).items())
    odd = [m for m in metas if m[1] not in ("int", "bool", "str")]
    scal = [(i, type(v).__name__, repr(v)) for i, _, v in scalar_args]
    state = "memory" if k in _kernel_cache._memory else "lookup"
    parts = _kernel_cache._key_parts(fn, arg_dtypes, scalar_args, kw)
    digests = " ".join(hashlib.sha256(repr(p).encode()).hexdigest()[:6] for p in parts)
    print(f"PARTS {fn.__name__} {k[:8]} {digests} cache_key={fn.cache_key[:60]}")
    print(f"META {fn.__name__} {k[:8]} {sorted(kw.get('metaparams', {}).items())}")
    print(
        f"KEY {fn.__name__} {k[:8]} {state} warps={kw.get('num_warps')!r} "
        f"stages={kw.get('num_stages')!r} odd={odd} scalars={scal}"
    )
    return k


def logged_read(path):
    entry = read(path)
    print(f"  READ {path.name[:8]} {'hit' if entry else 'miss'}")
    return entry


def logged_write(path, entry):
    print(f"  WRITE {path.name[:8]} {entry['name']}")
    return write(path, entry)


_kernel_cache._key, _kernel_cache._read, _kernel_cache._write = (
    logged_key,
    logged_read,
    logged_write,
)

q = jax.block_until_ready(
    jax.random.normal(jax.random.PRNGKey(0), (2, 3072, 16, 128), jnp.bfloat16)
)
t1 = time.perf_counter()
f = jax.jit(
    jax.grad(
        lambda q: (
            ejkernel.flash_attention(q, q, q, causal=True, platform="triton")
            .astype(jnp.float32)
            .sum()
        )
    )
)
lowered = f.lower(q)
t2 = time.perf_counter()
jax.block_until_ready(lowered.compile()(q))
t3 = time.perf_counter()
print(f"TIMES import+input {t1 - t0:.2f} trace {t2 - t1:.2f} compile+run {t3 - t2:.2f}")
