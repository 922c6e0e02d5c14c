"""What the benchmark scripts share: the timer, the forward+backward wrapper, compiled memory.

JAX is imported inside each function, so a script may set ``XLA_FLAGS`` before JAX starts
(``bench_ring_attention.py --host-devices``).
"""

from __future__ import annotations

import statistics
import sys
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


def rotating_rounds(
    fns: dict[str, Callable[..., Any]],
    args: tuple[Any, ...],
    rounds: int,
    gflop: float,
    warm_s: float = 0.3,
) -> dict[str, list[float]]:
    """TFLOP/s of each function per round, timed by :func:`timed` in an order that rotates
    by one each round (which function follows which changes the clock)."""
    names = list(fns)
    res: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            res[n].append(gflop / timed(fns[n], *args, warm_s=warm_s))
    return res


def print_rounds(title: str, res: dict[str, list[float]], ref: str) -> None:
    """Each function's median TFLOP/s, its median ratio to ``ref`` and that ratio by round."""
    print(f"== {title} (TFLOP/s, {ref} median {statistics.median(res[ref]):.0f})")
    for n, xs in res.items():
        ratios = [x / c for x, c in zip(xs, res[ref], strict=True)]
        print(
            f"  {n:26s} {statistics.median(xs):6.1f}  ÷ {ref} median "
            f"{statistics.median(ratios):.3f}, by round: " + " ".join(f"{x:.2f}" for x in ratios),
            flush=True,
        )


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


def import_tokamax() -> Any:
    """tokamax (an anchor: its attention and ``ragged_dot``), made to run on this jax: the
    xprof module it imports at start stood in for, tokamax 0.0.12's Pallas names bridged
    (printed), its absl flags parsed. Raises ``ImportError`` where it is not installed."""
    _stand_in_xprof()
    import tokamax
    from absl import flags

    if tuple(int(x) for x in tokamax.__version__.split(".")[:3]) < (0, 0, 17):
        # tokamax looks these up at call time, so bridging after its import works
        bridged = _bridge_pallas_renames()
        if bridged:
            print(f"tokamax {tokamax.__version__}: bridged for this jax: {', '.join(bridged)}")
    flags.FLAGS(sys.argv[:1], known_only=True)  # tokamax reads absl flags; ours are not
    return tokamax


def _bridge_pallas_renames() -> list[str]:
    """tokamax 0.0.12 predates two Pallas renames of jax 0.11: ``plgpu.kernel`` took
    ``out_shape``/``scratch_shapes`` (now ``out_type``/``scratch_types``), and ``pl.dot``
    existed (a float32-accumulating matmul). Bridge both, only where missing, so the anchor runs
    on the lent machine's jax; returns what was bridged (printed with the results)."""
    import functools
    import inspect

    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bridged = []
    params = inspect.signature(plgpu.kernel).parameters
    if "out_shape" not in params and "out_type" in params:
        kernel = plgpu.kernel
        renames = {"out_shape": "out_type", "scratch_shapes": "scratch_types"}

        @functools.wraps(kernel)
        def renamed(*args: Any, **kwargs: Any) -> Any:
            return kernel(*args, **{renames.get(k, k): v for k, v in kwargs.items()})

        plgpu.kernel = renamed
        bridged.append("plgpu.kernel(out_shape=, scratch_shapes=)")
    if not hasattr(pl, "dot"):

        def dot(a: Any, b: Any, trans_a: bool = False, trans_b: bool = False, **kw: Any) -> Any:
            a, b = (a.T if trans_a else a), (b.T if trans_b else b)
            return jnp.dot(a, b, precision=kw.get("precision"), preferred_element_type=jnp.float32)

        pl.dot = dot
        bridged.append("pl.dot")
    return bridged


def _stand_in_xprof() -> None:
    """tokamax imports ``xprof.cli.tools.get_kernel_stats_tool`` at start (its own profiling
    timer, unused here); the GPU image lacks xprof."""
    import types

    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
        sys.modules.setdefault(name, types.ModuleType(name))
    tools = sys.modules["xprof.cli.tools"]
    if not hasattr(tools, "get_kernel_stats_tool"):
        tools.get_kernel_stats_tool = None
