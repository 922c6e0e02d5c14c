"""User-facing tuning helpers: ``autotune``, ``autotune_platforms``, ``vmap_with_config``..."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from ejkernel._autotune import benchmark, on_device, tune_candidates
from ejkernel._executor import Executor, build_op_function, coerce_config, default_executor
from ejkernel._invocation import Invocation
from ejkernel._kernel import Kernel, OpKernel
from ejkernel.errors import ConfigError

__all__ = ["autotune", "autotune_platforms", "pmap_with_config", "vmap_with_config"]


def autotune(
    kernel: Kernel[Any, Any],
    *args: Any,
    configs: Sequence[Any] | None = None,
    num_warmup: int = 3,
    num_iters: int = 10,
    executor: Executor | None = None,
    **kwargs: Any,
) -> Any:
    """Time ``kernel(*args, **kwargs)`` under each config; return the fastest.

    Args:
        kernel: a user :class:`~ejkernel.ops.Kernel` or an op kernel (``FlashAttention()``).
        *args: concrete arguments.
        configs: candidates; default the kernel's (or the selected implementation's) space.
        num_warmup: untimed calls per candidate (the first compiles).
        num_iters: timed calls per candidate.
        executor: whose caches receive the result (default: the process-wide executor).
        **kwargs: the kernel's keyword arguments (``platform=`` for op kernels).

    The result is stored in the executor's memory cache (and persistent cache) as an autotuned
    entry, so later calls with the same shapes use it.
    """
    ex = executor or default_executor()
    if isinstance(kernel, OpKernel):
        spec = kernel.spec
        platform = kwargs.pop("platform", None)
        impl, _, _, arguments, _ = ex._prepare(spec, spec.bind(args, kwargs), platform, None)
        inv = Invocation(kernel=spec.name, kwargs=arguments, metadata={"grad": False})
        space = list(configs) if configs is not None else _space(impl.get_config_space(), inv)
        space = [coerce_config(spec, impl, c) for c in space]
        arrays = on_device(
            {k: v for k, v in arguments.items() if spec.arg(k).array and v is not None}
        )

        def make_runner(cfg: Any) -> Callable[[], Any]:
            jitted = jax.jit(build_op_function(spec, impl, arguments, lambda grad: cfg))
            return lambda: jitted(arrays)

        best, timings = tune_candidates(
            f"{spec.name}/{impl.platform}",
            space,
            make_runner,
            num_warmup=num_warmup,
            num_iters=num_iters,
        )
        _store(ex, inv, impl.platform, impl.version, best, timings)
        return best
    platform = kernel.select_platform()
    method = kernel.method(platform)
    inv = Invocation(
        kernel=kernel, args=args, kwargs=kwargs, metadata={"grad": False, "platform": platform}
    )
    space = list(configs) if configs is not None else _space(kernel.config_space, inv)

    device_args = on_device(args)

    def make_kernel_runner(cfg: Any) -> Callable[[], Any]:
        jitted = jax.jit(lambda *a: method(*a, cfg=cfg, **kwargs))
        return lambda: jitted(*device_args)

    best, timings = tune_candidates(
        kernel.name, space, make_kernel_runner, num_warmup=num_warmup, num_iters=num_iters
    )
    _store(ex, inv, platform, str(kernel.version), best, timings)
    return best


def _space(fn: Callable[[Invocation], list[Any]] | None, inv: Invocation) -> list[Any]:
    space = list(fn(inv)) if fn is not None else []
    if not space:
        raise ConfigError(
            f"{inv.kernel_name()}: nothing to tune: no configs given and no config space"
        )
    return space


def _store(
    ex: Executor, inv: Invocation, platform: str, version: str, best: Any, timings: dict[str, float]
) -> None:
    key = inv.cache_key(platform=platform, version=version)
    meta = {"key": inv.key_document(platform=platform, version=version), "timings_ms": timings}
    ex.selector.cache.put(key, best, source="autotune", meta=meta)
    if ex.selector.persistent is not None:
        ex.selector.persistent.put(key, best, source="autotune", meta=meta)


def autotune_platforms(
    op: str | OpKernel[Any, Any],
    *args: Any,
    num_iters: int = 10,
    executor: Executor | None = None,
    **kwargs: Any,
) -> str:
    """Time every runnable platform of an op call (each with its chosen config); remember the
    fastest as this invocation's platform (selection step 3). Returns the platform."""
    from ejkernel._invocation import current_backend
    from ejkernel._selection import runnable
    from ejkernel.plugins import get_registry

    ex = executor or default_executor()
    spec = get_registry().spec(op if isinstance(op, str) else op.spec.name)
    arguments = spec.validate(spec.bind(args, kwargs))
    inv = Invocation(kernel=spec.name, kwargs=arguments, metadata={"grad": False})
    candidates, _ = runnable(get_registry(), spec, inv, current_backend())
    arrays = on_device({k: v for k, v in arguments.items() if spec.arg(k).array and v is not None})
    timings: dict[str, float] = {}
    for impl in candidates:
        choose, _ = ex._chooser(spec, impl, arguments, None)
        f = jax.jit(build_op_function(spec, impl, arguments, choose))
        try:
            timings[impl.platform] = benchmark(f, arrays, num_iters=num_iters, num_warmup=1)
        except Exception:  # a platform that fails here is simply not chosen
            continue
    if not timings:
        raise ConfigError(f"{spec.name}: no platform could run this call")
    best = min(timings, key=timings.__getitem__)
    ex.selector.remember_platform(inv, best, timings)
    return best


def vmap_with_config(
    kernel: Kernel[Any, Any],
    in_axes: Any = 0,
    out_axes: Any = 0,
    *,
    executor: Executor | None = None,
    cfg: Any = None,
    **kwargs: Any,
) -> Callable[..., Any]:
    """``jax.vmap`` of ``kernel``: the config is chosen once, for the per-example shapes."""
    ex = executor or default_executor()
    return jax.vmap(
        lambda *a: ex(kernel, *a, cfg=cfg, **kwargs), in_axes=in_axes, out_axes=out_axes
    )


def pmap_with_config(
    kernel: Kernel[Any, Any],
    axis_name: Any = None,
    in_axes: Any = 0,
    *,
    executor: Executor | None = None,
    cfg: Any = None,
    **kwargs: Any,
) -> Callable[..., Any]:
    """``jax.pmap`` of ``kernel`` over devices: the config is chosen once, for per-device shapes."""
    ex = executor or default_executor()
    return jax.pmap(
        lambda *a: ex(kernel, *a, cfg=cfg, **kwargs), axis_name=axis_name, in_axes=in_axes
    )
