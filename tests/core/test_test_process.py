"""The test process's own settings (``tests/conftest.py``) hold where the tests run."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest


def test_cpu_dispatch_is_synchronous() -> None:
    """A call returns only once its computation has run (an asynchronous CPU client wedges
    with the interpreted kernels' callbacks in flight). The flag only counts if it was set
    before JAX created its CPU client; set later, calls return at once."""
    if jax.default_backend() != "cpu":
        pytest.skip("the setting concerns the CPU client")
    x = jnp.ones((1000, 1000))
    f = jax.jit(lambda x: (x @ x @ x @ x).sum())
    f(x).block_until_ready()
    start = time.perf_counter()
    y = f(x)
    returned = time.perf_counter() - start
    y.block_until_ready()
    done = time.perf_counter() - start
    assert returned >= 0.5 * done, (returned, done)
