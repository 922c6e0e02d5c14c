"""Batch tuning: tune many recorded invocations at once (``autotune_recorded``).

Every invocation becomes one target per platform to tune, each with its candidates (the
heuristic's config first, then the config space, deduplicated as the chain does). Candidates
compile ``max_workers`` at a time; on an accelerator in worker processes
(:mod:`ejkernel._compile_workers`: tracing holds the GIL, so threads of one process barely
share it), each invocation timed on the calling thread as soon as its candidates are ready
while the workers compile the next ones; on a CPU (or with ``compile_processes=False``) in
threads, all compiled before the first is timed. Timings run one after another, so no two
share the device. Inputs are synthetic, built from the abstract shapes when a target is timed
and dropped after it.

A candidate that fails to compile, raises when run, or disagrees with the target's first
candidate is dropped with an :class:`~ejkernel.errors.AutotuneWarning` and listed in the
result's ``failures``; a target whose candidates all fail is reported and skipped. Nothing
aborts the batch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs
import jax
import numpy as np

from ejkernel import _env
from ejkernel._autotune import (
    _agrees,
    confirm_finalists,
    on_device,
    progress_logger,
    time_candidate,
)
from ejkernel._chain import unique_configs
from ejkernel._compile_workers import WorkerPool, WorkerUnavailable
from ejkernel._executor import Executor, default_executor
from ejkernel._invocation import Invocation, abstract_value, current_backend
from ejkernel._json import stable_json
from ejkernel._kernel import Kernel, OpKernel, _overrides
from ejkernel._records import RecordedInvocation
from ejkernel._selection import runnable
from ejkernel._tune_result import AutotuneResult, PlatformChoice, TunedConfig, TuneFailure
from ejkernel._vjp import build_op_function
from ejkernel.errors import AutotuneWarning, warn_once
from ejkernel.plugins import get_registry
from ejkernel.specs._base import default_synthetic, normal_draw

__all__ = ["autotune_recorded", "worker_targets"]


@attrs.define(eq=False)
class _Target:
    """One invocation on one platform: its candidates and how to build and feed them."""

    op: str
    platform: str
    key: str
    document: dict[str, Any]
    grad: bool
    configs: list[Any]
    #: ``cfg -> (function, abstract arguments)``; called on a compile thread.
    function: Callable[[Any], tuple[Callable[..., Any], tuple[Any, ...]]]
    #: ``abstract arguments -> concrete arguments on the device``; called when timing.
    inputs: Callable[[tuple[Any, ...]], tuple[Any, ...]]
    compiled: dict[int, tuple[Any, tuple[Any, ...]]] = attrs.field(factory=dict)
    #: Seconds spent making its inputs (synthetic arrays, cotangents) when it was timed.
    inputs_s: float = 0.0
    #: Candidates compiled in a worker process (recompiled here if they fail or disagree).
    from_worker: set[int] = attrs.field(factory=set)
    recompiled: int = 0

    def compile_here(self, i: int) -> tuple[Any, tuple[Any, ...]]:
        fn, shapes = self.function(self.configs[i])
        return jax.jit(fn).lower(*shapes).compile(), shapes


@attrs.define(eq=False)
class _Job:
    """One invocation: its targets and, where platforms are compared, its choice key."""

    op: str
    targets: list[_Target] = attrs.field(factory=list)
    choice: tuple[str, dict[str, Any]] | None = None
    #: Inputs its targets share (made by the first one timed, dropped once all are timed).
    inputs: dict[str, Any] = attrs.field(factory=dict)
    #: Its item of ``invocations`` pickled for the compile workers (None where it does not
    #: pickle, or without workers: compiled in this process).
    call: bytes | None = None


# -- preparing targets ----------------------------------------------------------------------


def _fwd_bwd(f: Callable[..., Any]) -> Callable[..., Any]:
    def fwd_bwd(arrays: Any, ct: Any) -> Any:
        out, vjp = jax.vjp(f, arrays)
        return out, vjp(ct)

    return fwd_bwd


def _cotangent(abstract: Any) -> Any:
    """A random cotangent shaped like the outputs ``abstract``, on the device."""
    rng = np.random.default_rng(1)

    def one(s: Any) -> Any:
        if not jax.numpy.issubdtype(s.dtype, jax.numpy.floating):
            return np.zeros(s.shape, s.dtype)
        return normal_draw(rng, s.shape, s.dtype)

    return on_device(jax.tree_util.tree_map(one, abstract))


def _candidates(heuristic: Any, space: Any, inv: Invocation) -> list[Any]:
    first = heuristic(inv) if heuristic is not None else None
    return unique_configs(
        ([first] if first is not None else []) + list(space(inv) if space else [])
    )


def _op_targets(
    ex: Executor,
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    forced: str | None,
    grad: bool,
    platforms: Sequence[str] | None,
) -> tuple[_Job, list[str]]:
    """The targets of an op call (arrays given abstractly); and why platforms were skipped."""
    registry = get_registry()
    spec = op.spec if isinstance(op, OpKernel) else registry.spec(str(op))
    bound = spec.bind(args, kwargs)
    result = _Job(op=spec.name)
    skipped: list[str] = []
    if platforms is None or forced is not None:
        impl, _, _, arguments, _ = ex._prepare(spec, bound, forced, None)
        impls = [impl]
    else:
        arguments = spec.validate(dict(bound))
        plain = Invocation(kernel=spec.name, kwargs=arguments)
        found, rejected = runnable(registry, spec, plain, current_backend())
        impls = [i for i in found if not platforms or i.platform in platforms]
        skipped = [f"{p}: {why}" for p, why in rejected.items() if not platforms or p in platforms]
        choice_doc = plain.key_document(platform="<choice>", version="0")
        result.choice = (ex.selector._choice_key(plain), choice_doc)
    inv = Invocation(kernel=spec.name, kwargs=arguments, metadata={"grad": grad})
    arrays = {k: v for k, v in arguments.items() if spec.arg(k).array and v is not None}
    abstract = inv.abstract_kwargs
    for impl in impls:
        tunable = ex._tunable(spec, impl, arguments)
        if tunable.configless:
            configs: list[Any] = [None]
        else:
            configs = _candidates(tunable.heuristic, tunable.config_space, inv)
        if not configs or (len(configs) < 2 and result.choice is None):
            continue  # nothing to choose between: the chain's heuristic (or error) stands

        def function(cfg: Any, impl: Any = impl) -> tuple[Callable[..., Any], tuple[Any, ...]]:
            f = build_op_function(spec, impl, arguments, lambda _grad: cfg)
            if not grad:
                return f, (arrays,)
            return _fwd_bwd(f), (arrays, jax.eval_shape(f, arrays))

        def inputs(
            shapes: tuple[Any, ...], made: dict[str, Any] = result.inputs
        ) -> tuple[Any, ...]:
            if "feed" not in made:  # every platform of the call times on the same inputs
                concrete = on_device(spec.make_synthetic(abstract))
                made["feed"] = {k: concrete[k] for k in arrays}
            if not grad:
                return (made["feed"],)
            if "cotangent" not in made:
                made["cotangent"] = _cotangent(shapes[1])
            return made["feed"], made["cotangent"]

        result.targets.append(
            _Target(
                op=spec.name,
                platform=impl.platform,
                key=inv.cache_key(platform=impl.platform, version=impl.version),
                document=inv.key_document(platform=impl.platform, version=impl.version),
                grad=grad,
                configs=configs,
                function=function,
                inputs=inputs,
            )
        )
    return result, skipped


def _kernel_targets(kernel: Kernel[Any, Any], inv: Invocation, grad: bool) -> _Job:
    """The target of a user kernel's call: its preferred platform's method, forward only (as
    the chain tunes user kernels), keyed like ``executor(kernel, ...)``'s call."""
    platform = str(inv.metadata.get("platform") or kernel.select_platform())
    method = kernel.method(platform)
    args = inv.abstract_args
    kwargs = inv.abstract_kwargs
    key_inv = Invocation(
        kernel=kernel, args=args, kwargs=kwargs, metadata={"grad": grad, "platform": platform}
    )
    heuristic = kernel.heuristic_cfg if _overrides(kernel, "heuristic_cfg") else None
    space = kernel.config_space if _overrides(kernel, "config_space") else None
    configs = _candidates(heuristic, space, key_inv)
    result = _Job(op=kernel.name)
    if len(configs) < 2:
        return result
    positions = [i for i, a in enumerate(args) if isinstance(a, jax.ShapeDtypeStruct)]
    kw_arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.ShapeDtypeStruct)}
    kw_static = {k: v for k, v in kwargs.items() if k not in kw_arrays}

    def function(cfg: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        def f(pos: list[Any], kw: dict[str, Any]) -> Any:
            full = list(args)
            for i, x in zip(positions, pos):
                full[i] = x
            return method(*full, cfg=cfg, **kw_static, **kw)

        return f, ([args[i] for i in positions], kw_arrays)

    def inputs(shapes: tuple[Any, ...]) -> tuple[Any, ...]:
        pos = default_synthetic({str(n): a for n, a in enumerate(shapes[0])})
        return on_device(
            ([pos[str(n)] for n in range(len(shapes[0]))], default_synthetic(kw_arrays))
        )

    version = str(kernel.version)
    result.targets.append(
        _Target(
            op=kernel.name,
            platform=platform,
            key=key_inv.cache_key(platform=platform, version=version),
            document=key_inv.key_document(platform=platform, version=version),
            grad=grad,
            configs=configs,
            function=function,
            inputs=inputs,
        )
    )
    return result


def _abstract(values: Iterable[Any]) -> list[Any]:
    return [abstract_value(v) if hasattr(v, "shape") and hasattr(v, "dtype") else v for v in values]


def _prepare(
    ex: Executor,
    item: Any,
    platforms: Sequence[str] | None,
    grad: bool | None,
) -> tuple[_Job, list[str]]:
    """The targets of one item of ``invocations``."""
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Invocation):
        item = attrs.evolve(item[1], kernel=item[0]) if item[1].kernel is None else item[1]
    if isinstance(item, RecordedInvocation) and isinstance(item.kernel, Kernel):
        from ejkernel._recording import call_arguments

        args, kwargs = call_arguments(item)
        item = Invocation(
            kernel=item.kernel, args=args, kwargs=kwargs, metadata={"grad": item.grad}
        )
    if isinstance(item, RecordedInvocation):
        g = item.grad if grad is None else grad
        return _op_targets(ex, item.op, (), item.arguments(), item.platform, g, platforms)
    if isinstance(item, Invocation):
        g = item.grad if grad is None else grad
        kernel = item.kernel
        if isinstance(kernel, Kernel) and not isinstance(kernel, OpKernel):
            return _kernel_targets(kernel, item, g), []
        args = tuple(_abstract(item.args))
        kwargs = dict(zip(item.kwargs, _abstract(item.kwargs.values())))
        forced = kwargs.pop("platform", None) or item.metadata.get("platform")
        kwargs.pop("cfg", None)
        return _op_targets(ex, kernel, args, kwargs, forced, g, platforms)
    raise TypeError(f"autotune_recorded: not an invocation: {type(item).__name__}")


# -- progress -------------------------------------------------------------------------------


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency; a stripped environment just has no bar
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="cfg", file=sys.stderr, leave=False)


# -- the two phases -------------------------------------------------------------------------


def _report(failures: list[TuneFailure], failure: TuneFailure, key: str, what: str) -> None:
    failures.append(failure)
    warn_once(AutotuneWarning, f"autotune_recorded:{key}", f"autotune_recorded: {failure}; {what}")


def _fail(
    failures: list[TuneFailure], t: _Target, label: str | None, stage: str, err: Exception
) -> None:
    """A candidate (``label``) of ``t`` failed: report it, drop it."""
    error = f"{type(err).__name__}: {err}"
    failure = TuneFailure(op=t.op, platform=t.platform, config=label, stage=stage, error=error)
    _report(failures, failure, f"{t.key}:{label}", "dropped")


class _Compiler:
    """Compiles every candidate of a batch on ``max_workers`` threads, each of which hands its
    candidates to a worker process of its own where ``workers`` is given (and compiles in this
    process what a worker cannot serve)."""

    def __init__(self, max_workers: int, workers: WorkerPool | None, call_args: Any) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers, thread_name_prefix="ejkernel-compile"
        )
        self.workers = workers
        self.call_args = call_args  # (platforms, grad) as the workers rebuild the targets
        self.futures: dict[int, list[tuple[concurrent.futures.Future[Any], _Target, int]]] = {}
        self.in_workers = 0
        #: Why candidates compiled in this process after all (reason -> a platform it hit).
        self.here: dict[str, str] = {}
        self.finished_at = 0.0

    def submit(self, job: _Job) -> None:
        self.futures[id(job)] = [
            (self.pool.submit(self._compile, job.call, t, i), t, i)
            for t in job.targets
            for i in range(len(t.configs))
        ]

    def _compile(self, call: bytes | None, t: _Target, i: int) -> tuple[Any, tuple[Any, ...], bool]:
        """``(compiled, abstract arguments, whether a worker compiled it)``; the first
        candidate, every other's reference, always compiles here."""
        try:
            if self.workers is not None and call is not None and i > 0:
                label = stable_json(t.configs[i])
                try:
                    compiled, shapes = self.workers.compile(
                        call, *self.call_args, t.platform, i, label
                    )
                    return compiled, shapes, True
                except WorkerUnavailable as why:
                    self.here.setdefault(str(why)[:200], t.platform)
            return (*t.compile_here(i), False)
        finally:
            self.finished_at = time.perf_counter()

    def collect(self, job: _Job, failures: list[TuneFailure], bar: Any) -> None:
        """Wait for ``job``'s candidates; file them into their targets."""
        for future, t, i in self.futures.pop(id(job)):
            try:
                compiled, shapes, from_worker = future.result()
                t.compiled[i] = compiled, shapes
                if from_worker:
                    t.from_worker.add(i)
                    self.in_workers += 1
            except Exception as err:
                _fail(failures, t, stable_json(t.configs[i]), "compile", err)
            bar.update()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.workers is not None:
            self.workers.close()


def _time_target(
    t: _Target, num_iters: int, num_warmup: int, failures: list[TuneFailure]
) -> dict[int, float]:
    """Milliseconds per candidate of ``t`` that runs and agrees with the first one (the
    finalists' after :func:`~ejkernel._autotune.confirm_finalists`)."""
    timings: dict[int, float] = {}
    if not t.compiled:
        return timings
    first = min(t.compiled)
    made = time.perf_counter()
    try:
        feed = t.inputs(t.compiled[first][1])
        t.inputs_s = time.perf_counter() - made
    except Exception as err:
        _fail(failures, t, None, "run", err)
        return timings
    baseline: Any = None
    timed: dict[int, Any] = {}  # the executables, released once the finalists are timed
    for i in sorted(t.compiled):
        compiled = t.compiled.pop(i)[0]
        label = stable_json(t.configs[i])
        with _reported_if_stuck(f"{t.op}/{t.platform} candidate {label}"):
            try:
                try:
                    out = _run_checked(compiled, feed, baseline)
                except Exception:
                    if i not in t.from_worker:
                        raise
                    # a worker's executable that fails or disagrees: judge the candidate by
                    # the executable this process compiles
                    t.recompiled += 1
                    compiled = t.compile_here(i)[0]
                    out = _run_checked(compiled, feed, baseline)
            except Exception as err:
                stage = "wrong result" if isinstance(err, _WrongResult) else "run"
                _fail(failures, t, label, stage, err)
                continue
            if baseline is None:
                baseline = out
            del out
            try:
                ms = time_candidate(compiled, *feed, num_iters=num_iters, num_warmup=num_warmup)
            except Exception as err:
                _fail(failures, t, label, "run", err)
                continue
        timings[i] = ms
        timed[i] = compiled
        if _env.log_autotune():
            progress_logger.info("autotune_recorded: %s/%s %s %.3f ms", t.op, t.platform, label, ms)
    return confirm_finalists(
        timings,
        lambda i: time_candidate(timed[i], *feed, num_iters=num_iters, num_warmup=num_warmup),
    )


@contextlib.contextmanager
def _reported_if_stuck(what: str) -> Iterator[None]:
    """Log a warning if the block runs past :data:`STUCK_AFTER_S` (a kernel that hangs on the
    device cannot be stopped from here; the log names it)."""
    message = "autotune_recorded: %s still running after %.0f s"
    watch = threading.Timer(STUCK_AFTER_S, progress_logger.warning, (message, what, STUCK_AFTER_S))
    watch.daemon = True
    watch.start()
    try:
        yield
    finally:
        watch.cancel()


#: Seconds after which a candidate's run or timing is reported as stuck.
STUCK_AFTER_S = 60.0


class _WrongResult(ValueError):
    """A candidate's result disagrees with the first candidate's."""


def _run_checked(compiled: Any, feed: tuple[Any, ...], baseline: Any) -> Any:
    out = jax.block_until_ready(compiled(*feed))
    if baseline is not None and not _agrees(out, baseline):
        raise _WrongResult("disagrees with the first candidate")
    return out


def autotune_recorded(
    invocations: Iterable[Any] | None = None,
    *,
    platforms: str | Sequence[str] | None = None,
    grad: bool | None = None,
    max_workers: int | None = None,
    compile_processes: bool | None = None,
    num_iters: int = 5,
    num_warmup: int = 1,
    executor: Executor | None = None,
    progress: bool | None = None,
    apply: bool = True,
) -> AutotuneResult:
    """Tune every invocation of a batch on the current device; return the configs chosen.

    Candidates of all invocations are compiled in parallel threads, then timed one after
    another on the device, on synthetic inputs of the recorded shapes. A failing candidate
    (compile error, run error, a result that disagrees with the heuristic's) is skipped with
    an :class:`~ejkernel.errors.AutotuneWarning`, an invocation whose candidates all fail is
    skipped the same way: both are listed in ``result.failures`` and never abort the batch.

    Args:
        invocations: :class:`~ejkernel.ops.RecordedInvocation` or
            :class:`~ejkernel.ops.Invocation` objects (of ops, op kernels or user kernels);
            default: everything recorded so far (``get_invocations()``). Duplicates are tuned
            once.
        platforms: None: the platform the executor would select for each call. ``"all"`` or
            a list of platform names: each of those that can run the call, and the fastest is
            remembered as the call's platform (selection step 3). A call that forces a
            platform is tuned on that one only.
        grad: None: as recorded; True: tune forward+backward (the differentiated call's
            key); False: forward only. User kernels are tuned forward only.
        max_workers: how many candidates compile at once (default ``min(8, CPU count)``).
        compile_processes: compile in ``max_workers`` worker processes (each traces under a
            GIL of its own, and the calls already compiled are timed meanwhile) rather than in
            threads of this process (whose timing waits until every candidate has compiled).
            Default: processes where ``max_workers`` > 1 and the default device is not a CPU.
            What a worker cannot serve (a call that does not pickle, a plugin registered in
            this process only) compiles in this process.
        num_iters: timed calls per candidate.
        num_warmup: untimed calls per candidate (the first also checks the result).
        executor: whose memory cache receives the result and whose selection decides the
            platform (default: the process-wide executor).
        progress: show a progress bar (tqdm); default: when stderr is a terminal. The
            ``ejkernel.progress`` logger gets a line per phase either way.
        apply: put the result into the executor's memory cache, so later calls of this
            process use it (``result.save()`` writes it to the persistent cache,
            ``result.export(path)`` to a file).

    Returns:
        An :class:`~ejkernel.ops.AutotuneResult`.

    Raises:
        ValueError: ``platforms`` names a platform that is not installed, or ``max_workers``
            is not positive.
    """
    ex = executor or default_executor()
    if invocations is None:
        from ejkernel._recording import get_invocations

        invocations = get_invocations()
    items = list(invocations)
    for item in items:
        if not isinstance(item, (RecordedInvocation, Invocation)) and not (
            isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Invocation)
        ):
            raise TypeError(
                "autotune_recorded: `invocations` must hold RecordedInvocation or "
                f"ejkernel.ops.Invocation objects; got {type(item).__name__}"
            )
    if max_workers is None:
        max_workers = min(8, os.cpu_count() or 1)
    if not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < 1:
        raise ValueError(
            f"autotune_recorded: `max_workers` must be a positive int; got {max_workers!r}"
        )
    wanted = _platform_list(platforms)
    show = sys.stderr.isatty() if progress is None else bool(progress)

    workers = _use_workers(compile_processes, max_workers)
    failures: list[TuneFailure] = []
    jobs: list[_Job] = []
    targets: list[_Target] = []
    seen: set[str] = set()
    start = time.perf_counter()
    for n, item in enumerate(items):
        name = _name(item)
        try:
            job, skipped = _prepare(ex, item, wanted, grad)
            job.call = _pickled(item) if workers else None
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
            failure = TuneFailure(op=name, platform=None, config=None, stage="record", error=error)
            _report(failures, failure, f"{n}:{error}", "skipped")
            continue
        if wanted is not None and job.choice is not None and not job.targets and skipped:
            error = "no requested platform can run it (" + "; ".join(skipped) + ")"
            failure = TuneFailure(
                op=job.op, platform=None, config=None, stage="record", error=error
            )
            _report(failures, failure, f"{n}:platforms", "skipped")
            continue
        job.targets = [t for t in job.targets if t.key not in seen]
        if job.choice is not None and job.choice[0] in seen:
            job.choice = None
        seen.update(t.key for t in job.targets)
        if job.choice is not None:
            seen.add(job.choice[0])
        if job.targets:
            jobs.append(job)
            targets.extend(job.targets)
    n_cfg = sum(len(t.configs) for t in targets)
    progress_logger.info(
        "autotune_recorded: %d invocations, %d targets, %d candidates; compiling on %d %s",
        len(jobs),
        len(targets),
        n_cfg,
        max_workers,
        "worker processes" if workers else "threads",
    )
    compiler = _Compiler(max_workers, WorkerPool() if workers else None, (wanted, grad))
    for job in jobs:
        compiler.submit(job)

    tuned: list[TunedConfig] = []
    choices: list[PlatformChoice] = []
    bar = _bar(2 * n_cfg, "compiling and timing", show)
    n_ok = 0
    try:
        if not workers:  # threads trace under this process's GIL: no timing while they run
            for job in jobs:
                compiler.collect(job, failures, bar)
        for n, job in enumerate(jobs, 1):
            if workers:  # the later calls compile in the workers while this one is timed
                compiler.collect(job, failures, bar)
            job_start = time.perf_counter()
            per_platform: dict[str, float] = {}
            for t in job.targets:
                count = len(t.compiled)
                n_ok += count
                timings = _time_target(t, num_iters, num_warmup, failures)
                bar.update(len(t.configs))
                if not timings:
                    error = f"every one of {len(t.configs)} candidates failed"
                    failure = TuneFailure(
                        op=t.op, platform=t.platform, config=None, stage="all failed", error=error
                    )
                    _report(failures, failure, t.key, "skipped")
                    continue
                best = min(timings, key=timings.__getitem__)
                per_platform[t.platform] = timings[best]
                if t.configs[best] is not None:
                    tuned.append(
                        TunedConfig(
                            key=t.key,
                            op=t.op,
                            platform=t.platform,
                            grad=t.grad,
                            config=t.configs[best],
                            timings_ms={stable_json(t.configs[i]): ms for i, ms in timings.items()},
                            document=t.document,
                        )
                    )
            job.inputs.clear()
            progress_logger.info(
                "autotune_recorded: %d/%d %s timed in %.1f s: %s",
                n,
                len(jobs),
                job.op,
                time.perf_counter() - job_start,
                ", ".join(f"{p} {ms:.3f} ms" for p, ms in per_platform.items()) or "no result",
            )
            if job.choice is not None and per_platform:
                choices.append(
                    PlatformChoice(
                        key=job.choice[0],
                        op=job.op,
                        platform=min(per_platform, key=per_platform.__getitem__),
                        timings_ms=per_platform,
                        document=job.choice[1],
                    )
                )
    finally:
        bar.close()
        compiler.close()
    progress_logger.info(
        "autotune_recorded: compiled %d/%d candidates (%d in worker processes) in %.1f s%s",
        n_ok,
        n_cfg,
        compiler.in_workers,
        max(compiler.finished_at - start, 0.0),
        "".join(f"; here: {p}: {why}" for why, p in compiler.here.items()),
    )
    progress_logger.info(
        "autotune_recorded: timed %d candidates (%.1f s of it making inputs; %d recompiled here "
        "after their worker's executable failed or disagreed); %d configs, %d platform choices, "
        "%d failures (%.1f s in all)",
        n_ok,
        sum(t.inputs_s for t in targets),
        sum(t.recompiled for t in targets),
        len(tuned),
        len(choices),
        len(failures),
        time.perf_counter() - start,
    )
    result = AutotuneResult(tuned, platforms=choices, failures=failures)
    if apply:
        result.apply(ex)
    return result


def _use_workers(compile_processes: bool | None, max_workers: int) -> bool:
    if compile_processes is None:
        return max_workers > 1 and jax.default_backend() != "cpu"
    return bool(compile_processes)


def _pickled(item: Any) -> bytes | None:
    try:
        return pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None


def worker_targets(item: Any, platforms: list[str] | None, grad: bool | None) -> list[_Target]:
    """The targets of ``item`` as :func:`autotune_recorded` builds them (in a compile worker)."""
    return _prepare(default_executor(), item, platforms, grad)[0].targets


def _platform_list(platforms: str | Sequence[str] | None) -> list[str] | None:
    """None (the selected platform), [] (every runnable one) or the names asked for."""
    if platforms is None:
        return None
    if isinstance(platforms, str):
        if platforms == "all":
            return []
        platforms = [p for p in platforms.split(",") if p]
    names = [str(p).lower() for p in platforms]
    known = set(get_registry().platforms())
    unknown = [p for p in names if p not in known]
    if unknown or not names:
        raise ValueError(
            f"autotune_recorded: `platforms` must be None, 'all' or installed platform names "
            f"({', '.join(sorted(known)) or 'none installed'}); got {platforms!r}"
        )
    return names


def _name(item: Any) -> str:
    if isinstance(item, RecordedInvocation):
        return item.op
    if isinstance(item, Invocation):
        return item.kernel_name()
    return type(item).__name__
