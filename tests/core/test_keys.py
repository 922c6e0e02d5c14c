"""Invocation keys: stable across processes, sensitive to what matters, blind to values."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp

import ejkernel

PROBE = """
import jax, jax.numpy as jnp, ejkernel
q = jnp.ones((1, 40, 2, 16), jnp.bfloat16)
print(ejkernel.explain("flash_attention", q, q, q, softmax_scale=0.1, sliding_window=(7, 0), causal=True).key)
"""


def _key(*args, **kwargs):
    return ejkernel.explain("flash_attention", *args, **kwargs).key


def test_keys_are_identical_across_processes_and_hash_seeds():
    keys = {
        subprocess.run(
            [sys.executable, "-c", PROBE],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    q = jnp.ones((1, 40, 2, 16), jnp.bfloat16)
    assert keys == {_key(q, q, q, softmax_scale=0.1, sliding_window=(7, 0), causal=True)}


def test_keys_follow_shapes_dtypes_and_statics_not_values():
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 40, 2, 16))
    base = _key(q, q, q)
    assert _key(q + 1, q * 2, q) == base
    assert _key(q[:, :39], q, q) != base
    assert _key(q.astype(jnp.bfloat16), q.astype(jnp.bfloat16), q.astype(jnp.bfloat16)) != base
    assert _key(q, q, q, causal=True) != base
    assert _key(q, q, q, softmax_scale=0.25) != _key(q, q, q, softmax_scale=0.125)
    import numpy as np

    assert _key(q, q, q, softmax_scale=np.float32(0.25)) == _key(q, q, q, softmax_scale=0.25)
    assert ejkernel.explain("flash_attention", q, q, q, grad=True).key != base
