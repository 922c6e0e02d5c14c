"""What the benchmark scripts share: the timer, the forward+backward wrapper, compiled memory.

JAX is imported inside each function, so a script may set ``XLA_FLAGS`` before JAX starts
(``bench_ring_attention.py --host-devices``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed(
    fn: Callable[..., Any],
    *args: Any,
    iters: int = 10,
    repeats: int = 5,
    warm_calls: int = 1,
    warm_s: float = 0.0,
) -> float:
    """Median milliseconds per call over ``repeats`` batches of ``iters``.

    Before timing: ``warm_calls`` calls (the first compiles), then back-to-back calls for
    ``warm_s`` seconds (a GPU timed right after an idle moment runs faster for a while).
    """
    import jax

    for _ in range(warm_calls):
        jax.block_until_ready(fn(*args))
    if warm_s > 0:
        start = time.perf_counter()
        while True:
            jax.block_until_ready([fn(*args) for _ in range(3)])
            if time.perf_counter() - start >= warm_s:
                break
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(runs)


def fwd_bwd(attn: Callable[..., Any]) -> Callable[..., Any]:
    """``(q, k, v, dO) -> (out, (dq, dk, dv))``, jitted."""
    import jax

    def f(q: Any, k: Any, v: Any, do: Any) -> Any:
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(do)

    return jax.jit(f)


def ceilings(nbytes: int, n: int) -> tuple[float, float]:
    """(copy GB/s on a buffer of ``nbytes``, bf16 TFLOP/s of an ``n³`` matmul) measured now:
    a roofline's two ceilings, counted as bytes read plus written and ``2n³`` flops."""
    import jax
    import jax.numpy as jnp

    buf = jnp.ones((nbytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda x: x * jnp.bfloat16(1.5))
    t_copy = timed(copy, buf, iters=20, repeats=5, warm_s=0.3)
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: x @ y)
    t_mm = timed(mm, a, a, iters=10, repeats=5, warm_s=0.3)
    return 2 * nbytes / t_copy / 1e6, 2 * n**3 / t_mm / 1e9


def temp_bytes(fn: Callable[..., Any], *args: Any) -> int | None:
    """Temporary memory of ``fn`` compiled for ``args`` (jitted here unless it is already);
    ``None`` where the backend does not report it."""
    import jax

    jitted: Any = fn if hasattr(fn, "lower") else jax.jit(fn)
    try:
        return int(jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes)
    except Exception:  # some backends do not report
        return None


def mib(nbytes: int | None, digits: int = 0) -> str:
    """Bytes as MiB for a table cell; ``?`` where unknown."""
    return "?" if nbytes is None else f"{nbytes / 2**20:.{digits}f}"
