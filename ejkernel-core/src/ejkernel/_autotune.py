"""The autotuner: time candidate configs on concrete inputs, outside any trace.

Tuning is triggered while an op is being traced (inside ``jax.jit``, the common case), so the
candidates run on a worker thread: JAX's trace state is thread-local, the worker sees no
tracer, and it compiles and times real executions on synthetic inputs built from the abstract
shapes. Failing candidates (compile error, runtime error, a result that disagrees with the
first candidate, which is the heuristic's choice) are dropped with an :class:`AutotuneWarning`;
if every candidate fails an ``ExceptionGroup`` with one note per candidate is raised. The
candidates within :data:`FINALIST_MARGIN` of the fastest are timed again in rounds whose order
rotates (:func:`confirm_finalists`) before one is chosen.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import logging
import statistics
import sys
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel import _env
from ejkernel._json import stable_json
from ejkernel.errors import AutotuneWarning, warn_once

__all__ = [
    "benchmark",
    "confirm_finalists",
    "on_device",
    "progress_logger",
    "run_outside_trace",
    "tune_candidates",
]

logger = logging.getLogger(__name__)

#: Progress of long tuning, and per-candidate lines under EJKERNEL_LOG_AUTOTUNE=1. It carries a
#: stderr handler of its own so users see it without configuring logging; silence it with
#: ``logging.getLogger("ejkernel.progress").disabled = True``.
progress_logger = logging.getLogger("ejkernel.progress")
if not progress_logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("ejkernel: %(message)s"))
    progress_logger.addHandler(_handler)
    progress_logger.setLevel(logging.INFO)
    progress_logger.propagate = False

PROGRESS_AFTER_S = 3.0

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_tuning = threading.local()


def run_outside_trace(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on the tuning thread, where no JAX trace is active, in the caller's context
    (its policy overrides and cache overlays); return its result.

    Called from a tuning thread itself (a candidate's implementation calls an op that tunes
    too, as NSA's sliding-window branch calls flash attention), ``fn`` runs on a thread of
    its own: the tuning thread is busy tracing that candidate and would wait for itself."""
    global _pool
    job = functools.partial(contextvars.copy_context().run, _on_tuning_thread, fn)
    if getattr(_tuning, "active", False):
        with concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="ejkernel-autotune-nested"
        ) as nested:
            return nested.submit(job).result()
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ejkernel-autotune")
    return _pool.submit(job).result()


def _on_tuning_thread(fn: Callable[[], Any]) -> Any:
    _tuning.active = True
    try:
        return fn()
    finally:
        _tuning.active = False


def on_device(tree: Any) -> Any:
    """``tree`` with its NumPy arrays copied to the default device once.

    Candidates are timed on these: a NumPy argument would be copied host to device at every
    call, and for attention-sized inputs that copy (tens of milliseconds) drowns the kernel
    being timed, so the pick would be noise."""
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, tree
    )


def _block(x: Any) -> Any:
    return jax.block_until_ready(x)


def benchmark(
    fn: Callable[..., Any], *args: Any, num_iters: int = 10, num_warmup: int = 1, repeats: int = 1
) -> float:
    """Median milliseconds of ``fn(*args)`` over ``num_iters`` calls after ``num_warmup``.

    Waits for results with ``block_until_ready``. ``repeats`` > 1 takes the median of several
    batches (each timed as a whole, divided by ``num_iters``).
    """
    for _ in range(max(num_warmup, 0)):
        _block(fn(*args))
    if repeats > 1:
        batches = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(num_iters):
                out = fn(*args)
            _block(out)
            batches.append((time.perf_counter() - t0) * 1e3 / num_iters)
        return statistics.median(batches)
    samples = []
    for _ in range(max(num_iters, 1)):
        t0 = time.perf_counter()
        _block(fn(*args))
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


#: A candidate runs for at least this long (ms) before it is timed, so the GPU's clocks have
#: left idle and its caches hold the inputs, whatever ran (or compiled) before it.
WARM_MS = 25.0


def time_candidate(
    fn: Callable[..., Any], *args: Any, num_iters: int = 5, num_warmup: int = 1
) -> float:
    """Milliseconds per call of ``fn(*args)`` as the autotuners compare candidates: at least
    ``num_warmup`` untimed calls and :data:`WARM_MS` of them (at most 64), then the median of
    three batches of ``num_iters`` calls, each batch waited for once (no host round trip
    between a batch's calls)."""
    t0 = time.perf_counter()
    for i in range(64):
        _block(fn(*args))
        if i + 1 >= num_warmup and (time.perf_counter() - t0) * 1e3 >= WARM_MS:
            break
    return benchmark(fn, *args, num_iters=num_iters, num_warmup=0, repeats=3)


#: Candidates whose first time is within this fraction of the fastest's are finalists: timed
#: again before one is chosen. One timing of each candidate in turn favours whoever runs at a
#: better moment (after an idle one, a GPU at its power limit clocks higher for a few tens of
#: milliseconds), and configs a few percent apart trade places.
FINALIST_MARGIN = 0.10
#: At most this many finalists (the fastest first times).
FINALISTS = 4
#: Rounds of the finalists' timing; each starts with the next finalist.
FINALIST_ROUNDS = 3

_K = TypeVar("_K", bound=Hashable)


def confirm_finalists(
    timings: Mapping[_K, float], time_one: Callable[[_K], float]
) -> dict[_K, float]:
    """``timings`` with each finalist's time replaced by the median of its first time and
    :data:`FINALIST_ROUNDS` more from ``time_one(key)``, taken in rounds whose order rotates
    (which candidate follows which changes the clock). A finalist whose timing fails keeps its
    first time; with fewer than two finalists nothing is timed."""
    if not timings:
        return dict(timings)
    best = min(timings.values())
    near = sorted((k for k, ms in timings.items() if ms <= best * (1 + FINALIST_MARGIN)),
                  key=lambda k: timings[k])[:FINALISTS]  # fmt: skip
    if len(near) < 2:
        return dict(timings)
    samples = {k: [timings[k]] for k in near}
    for r in range(FINALIST_ROUNDS):
        for k in near[r % len(near) :] + near[: r % len(near)]:
            try:
                samples[k].append(time_one(k))
            except Exception:  # it ran once: judge it by that
                continue
    return {**timings, **{k: statistics.median(v) for k, v in samples.items()}}


def _agrees(out: Any, ref: Any) -> bool:
    """Whether every leaf of ``out`` is close to ``ref``'s (NaN where ``ref`` has NaN).

    Compared on the device (one boolean comes back per leaf): a candidate's outputs are as
    large as the call's (gradients of attention-sized inputs: hundreds of MB), and copying
    each to the host to compare there would cost more than timing the candidate."""
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        if jax.dtypes.float0 in (getattr(a, "dtype", None), getattr(b, "dtype", None)):
            continue  # the zero cotangent of an integer input (lengths, segment ids)
        if np.shape(a) != np.shape(b):
            return False
        tol = 2e-2 if jnp.dtype(a.dtype).itemsize <= 2 else 1e-3
        if not bool(_close(a, b, tol)):
            return False
    return True


@functools.partial(jax.jit, static_argnums=2)
def _close(a: Any, b: Any, tol: float) -> jax.Array:
    """``np.allclose(a, b, rtol=tol, atol=tol · max(|b|max, 1), equal_nan=True)``, on device."""
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    if a32.size == 0:
        return jnp.bool_(True)
    atol = tol * jnp.maximum(jnp.max(jnp.abs(b32)), 1.0)
    close = jnp.abs(a32 - b32) <= atol + tol * jnp.abs(b32)
    both_nan = jnp.isnan(a32) & jnp.isnan(b32)
    return jnp.all(close | both_nan | (a32 == b32))


def tune_candidates(
    name: str,
    configs: Sequence[Any],
    make_runner: Callable[[Any], Callable[[], Any]],
    *,
    num_warmup: int = 1,
    num_iters: int = 5,
) -> tuple[Any, dict[str, float]]:
    """Time each config's runner; return the fastest config and every candidate's time (ms).

    Args:
        name: what is tuned (``flash_attention/xla``), for messages.
        configs: candidates; the first one is the reference for the correctness check.
        make_runner: ``cfg -> zero-argument function`` computing the outputs (jitted inside).
        num_warmup: at least this many untimed calls (see :func:`time_candidate`).
        num_iters: timed calls.
    """

    def work() -> tuple[Any, dict[str, float]]:
        verbose = _env.log_autotune()
        start = time.perf_counter()
        reported = False
        timings: dict[str, float] = {}
        runners: dict[str, tuple[Any, Callable[[], Any]]] = {}
        errors: list[tuple[Any, Exception]] = []
        baseline: Any = None
        for i, cfg in enumerate(configs):
            label = stable_json(cfg)
            try:
                runner = make_runner(cfg)
                out = _block(runner())
                if baseline is None:
                    baseline = out
                elif not _agrees(out, baseline):
                    raise ValueError("wrong result: disagrees with the first candidate")
                ms = time_candidate(runner, num_iters=num_iters, num_warmup=num_warmup)
            except Exception as err:
                errors.append((cfg, err))
                warn_once(
                    AutotuneWarning,
                    f"{name}:{label}",
                    f"autotune {name}: candidate {label} dropped: {type(err).__name__}: {err}",
                )
                continue
            timings[label] = ms
            runners[label] = (cfg, runner)
            if verbose:
                progress_logger.info("autotune %s: %s %.3f ms", name, label, ms)
            elapsed = time.perf_counter() - start
            if elapsed > PROGRESS_AFTER_S and (not reported or verbose):
                reported = True
                progress_logger.info(
                    "autotuning %s: %d/%d candidates (%.1f s)", name, i + 1, len(configs), elapsed
                )
        if not timings:
            group = ExceptionGroup(
                f"autotune {name}: every candidate failed", [e for _, e in errors]
            )
            for cfg, failure in errors:
                group.add_note(f"{stable_json(cfg)}: {type(failure).__name__}: {failure}")
            raise group
        timings = confirm_finalists(
            timings,
            lambda label: time_candidate(
                runners[label][1], num_iters=num_iters, num_warmup=num_warmup
            ),
        )
        fastest = min(timings, key=timings.__getitem__)
        best = (timings[fastest], runners[fastest][0])
        if verbose or reported:
            progress_logger.info(
                "autotune %s: best %s (%.3f ms)", name, stable_json(best[1]), best[0]
            )
        return best[1], timings

    return run_outside_trace(work)  # type: ignore[no-any-return]
