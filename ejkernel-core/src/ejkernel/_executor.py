"""The executor: validate → select an implementation → choose its config → run (with its VJP).

Selection (DESIGN.md): candidates are the implementations of the op for this backend (or
``any``) whose platform is available and whose ``supports(inv)`` is True; ``platform=`` (or a
config's ``platform`` field, or ``EJKERNEL_PLATFORM``) wins if given; else a cached
cross-platform choice; else the highest priority. Config selection goes through the
:class:`~ejkernel.ops.ConfigSelectorChain`. Differentiable implementations with ``fwd``/``bwd``
are wrapped in a ``jax.custom_vjp`` whose forward chooses the config of the differentiated call
(tuned on forward+backward) and hands it to the backward.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from ejkernel import _env
from ejkernel._autotune import on_device, run_outside_trace, tune_candidates
from ejkernel._chain import Choice, ConfigSelectorChain, Tunable, overlay_state
from ejkernel._invocation import Invocation, current_backend, fast_signature
from ejkernel._kernel import Kernel, OpKernel, _overrides
from ejkernel._registry import KNOWN_DISTRIBUTIONS, Implementation, Registry
from ejkernel.errors import ConfigError, NoImplementationError
from ejkernel.plugins import get_registry
from ejkernel.specs import OpSpec

__all__ = ["Executor", "Selection", "call_op", "default_executor", "explain"]


@attrs.frozen(kw_only=True)
class Selection:
    """What the executor chose for one call, and why (returned by :func:`ejkernel.explain`).

    Attributes:
        op: the op name.
        platform: the selected platform.
        implementation: ``module:qualname`` of the selected implementation.
        reason: why this platform (argument, environment, cached choice, priority).
        config: the config it would run with.
        source: tier that gave the config: override, overlay, memory, persistent, autotune,
            heuristic.
        origin: for memory/persistent hits, how that entry was first made.
        key: the invocation cache key.
        rejected: implementation (platform) -> why it cannot run this call.
    """

    op: str
    platform: str
    implementation: str
    reason: str
    config: Any
    source: str
    origin: str | None
    key: str
    rejected: Mapping[str, str]

    def __str__(self) -> str:
        origin = (
            f" (first made by {self.origin})" if self.origin and self.origin != self.source else ""
        )
        lines = [
            f"{self.op}: platform {self.platform!r} ({self.reason}) -> {self.implementation}",
            f"  config {self.config!r}",
            f"  from {self.source}{origin}; key {self.key[:12]}",
        ]
        lines += [f"  rejected {name}: {why}" for name, why in self.rejected.items()]
        return "\n".join(lines)


# -- selection ------------------------------------------------------------------------------

_dispatch_memo: dict[Any, tuple[list[Implementation], dict[str, str]]] = {}
_memo_lock = threading.Lock()


def forget_dispatch() -> None:
    """Drop memoised selections (the registry or the environment changed)."""
    with _memo_lock:
        _dispatch_memo.clear()


def _label(impl: Implementation, impls: list[Implementation]) -> str:
    same = [i for i in impls if i.platform == impl.platform]
    return impl.platform if len(same) == 1 else f"{impl.platform}[{'|'.join(impl.backends)}]"


def _runnable(
    registry: Registry, spec: OpSpec, inv: Invocation, backend: str
) -> tuple[list[Implementation], dict[str, str]]:
    impls = registry.implementations(spec.name)
    candidates: list[Implementation] = []
    rejected: dict[str, str] = {}
    for impl in impls:
        label = _label(impl, impls)
        if not impl.runs_on(backend):
            rejected[label] = f"serves {'/'.join(impl.backends)}, this device is {backend}"
            continue
        available = registry.platform(impl.platform).check(backend)
        if available is not True:
            rejected[label] = str(available)
            continue
        try:
            supports = impl.get_supports()
            ok = True if supports is None else supports(inv)
        except Exception as err:  # a broken supports() rejects, never breaks the call
            ok = f"supports() raised {type(err).__name__}: {err}"
        if ok is not True:
            rejected[label] = str(ok) if ok else "declined"
            continue
        candidates.append(impl)
    return candidates, rejected


def _install_hint(spec: OpSpec, registry: Registry, platform: str | None = None) -> str:
    if platform is not None:
        dist = registry.platform(platform).distribution or KNOWN_DISTRIBUTIONS.get(platform)
        return f"install {dist}" if dist else "install the plugin that provides it"
    installed = {i.platform for i in registry.implementations(spec.name)}
    missing = [d for p, d in KNOWN_DISTRIBUTIONS.items() if p not in installed]
    return (
        "install one of: " + ", ".join(missing) if missing else "no other distribution provides it"
    )


def select_implementation(
    spec: OpSpec,
    inv: Invocation,
    platform: str | None,
    reason: str | None,
    selector: ConfigSelectorChain,
) -> tuple[Implementation, str, dict[str, str]]:
    """Pick the implementation for ``inv``; raise NoImplementationError listing every reason."""
    registry = get_registry()
    backend = current_backend()
    forced, why = platform, reason
    if forced is None and _env.forced_platform():
        forced, why = _env.forced_platform(), f"{_env.PLATFORM}={_env.forced_platform()}"
    memo_key = (spec.name, backend, registry.generation, inv.fast_signature())
    memo = _dispatch_memo.get(memo_key)
    if memo is None:
        memo = _runnable(registry, spec, inv, backend)
        with _memo_lock:
            _dispatch_memo[memo_key] = memo
    candidates, rejected = memo[0], dict(memo[1])
    if forced is not None:
        forced = forced.lower()
        for impl in candidates:
            if impl.platform == forced:
                return impl, why or "forced", rejected
        known = {i.platform for i in registry.implementations(spec.name)}
        # every reason of the forced platform, those of implementations for other devices last
        causes = sorted(
            (r for name, r in rejected.items() if name.split("[")[0] == forced),
            key=lambda r: r.startswith("serves "),
        )
        cause = "; ".join(causes) or None
        if cause is None and forced not in known:
            cause = f"no {forced!r} implementation of {spec.name} is installed ({_install_hint(spec, registry, forced)})"
        raise NoImplementationError(
            f"{spec.name}: platform {forced!r} ({why}) cannot run this call: {cause}",
            op=spec.name,
            rejected=rejected,
        )
    if not candidates:
        listing = (
            "".join(f"\n  {name}: {r}" for name, r in rejected.items())
            or "\n  (no implementation installed)"
        )
        raise NoImplementationError(
            f"{spec.name}: no installed implementation can run this call on {backend}:{listing}\n"
            f"{_install_hint(spec, registry)}",
            op=spec.name,
            rejected=rejected,
        )
    cached = selector.platform_choice(inv)
    if cached is not None:
        for impl in candidates:
            if impl.platform == cached:
                return impl, "cached platform choice (cross-platform autotune)", rejected
    best = candidates[0]
    return best, f"highest priority ({best.priority}) of {len(candidates)} runnable", rejected


def preferred_platform(op: str) -> str | None:
    """The highest-priority platform available for ``op`` on this backend (ignoring supports)."""
    registry = get_registry()
    backend = current_backend()
    for impl in registry.implementations(op):
        if impl.runs_on(backend) and registry.platform(impl.platform).check(backend) is True:
            return impl.platform
    return None


# -- configs --------------------------------------------------------------------------------


def _fields(cfg: Any) -> dict[str, Any] | None:
    if attrs.has(type(cfg)):
        return {f.name: getattr(cfg, f.name) for f in attrs.fields(type(cfg))}
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return None


def coerce_config(spec: OpSpec, impl: Implementation, cfg: Any) -> Any:
    """Fit a config given for the op (or another platform) to ``impl``'s config class.

    A config of the implementation's class passes as is; another attrs class or dataclass is
    converted field by field (shared field names; ``platform`` is dropped; the entries of an
    ``options`` mapping field count as fields, so op-level configs can carry any tunable).
    """
    target = impl.config_type
    if cfg is None or target is None:
        return None
    if isinstance(cfg, target):
        return cfg
    fields = _fields(cfg)
    if fields is None:
        raise ConfigError(f"{spec.name}: cfg must be a {target.__name__}; got {type(cfg).__name__}")
    names = (
        {f.name for f in attrs.fields(target)}
        if attrs.has(target)
        else {f.name for f in dataclasses.fields(target)}
    )
    common = {k: v for k, v in fields.items() if k in names and v is not None}
    try:
        return target(**common)
    except Exception as err:
        raise ConfigError(
            f"{spec.name}: cfg {cfg!r} does not fit platform {impl.platform!r}'s {target.__name__}: {err}"
        ) from err


def _config_platform(cfg: Any) -> str | None:
    p = getattr(cfg, "platform", None)
    return None if p in (None, "auto") else str(p)


# -- running ops ----------------------------------------------------------------------------


def _is_float_array(x: Any) -> bool:
    return x is not None and hasattr(x, "dtype") and bool(jnp.issubdtype(x.dtype, jnp.floating))


def build_op_function(
    spec: OpSpec,
    impl: Implementation,
    arguments: Mapping[str, Any],
    choose: Callable[[bool], Any],
) -> Callable[[dict[str, Any]], Any]:
    """``f(arrays) -> out`` for the given statics; wires impl.fwd/bwd as a custom VJP.

    ``choose(grad)`` returns the config; it runs when ``f`` is traced or called.
    """
    fn = impl.fn
    statics = {k: v for k, v in arguments.items() if not spec.arg(k).array}
    nones = {k: None for k, v in arguments.items() if spec.arg(k).array and v is None}
    diff = {
        a.name for a in spec.args if a.differentiable and _is_float_array(arguments.get(a.name))
    }

    def primal(arrays: dict[str, Any]) -> Any:
        return fn(**statics, **nones, **arrays, cfg=choose(False))

    vjp = impl.get_vjp()
    if not (spec.differentiable and diff and vjp is not None):
        return primal
    fwd_fn, bwd_fn = vjp
    cell: dict[str, Any] = {}

    def fwd(arrays: dict[str, Any]) -> tuple[Any, Any]:
        cfg = cell["cfg"] = choose(True)
        return fwd_fn(**statics, **nones, **arrays, cfg=cfg)

    def bwd(residuals: Any, d_out: Any) -> tuple[dict[str, Any]]:
        grads = bwd_fn(residuals, d_out, **statics, cfg=cell["cfg"])
        return ({k: (grads.get(k) if k in diff else None) for k in cell["names"]},)

    wrapped = jax.custom_vjp(primal)
    wrapped.defvjp(fwd, bwd)

    def call(arrays: dict[str, Any]) -> Any:
        cell["names"] = list(arrays)
        return wrapped(arrays)

    return call


def _traced(arrays: Mapping[str, Any]) -> bool:
    return any(isinstance(v, jax.core.Tracer) for v in arrays.values())


class Executor:
    """Runs kernels and ops: selection, the config chain, custom VJPs.

    Called as ``executor(kernel, *args, cfg=None, **kwargs)`` where ``kernel`` is an op kernel
    (``ejkernel.modules.FlashAttention()``) or a user :class:`ejkernel.ops.Kernel`.

    Args:
        selector: the config chain (default: memory + persistent caches, autotune allowed).
    """

    def __init__(self, selector: ConfigSelectorChain | None = None) -> None:
        self.selector = selector if selector is not None else ConfigSelectorChain()
        self._tunables: dict[Implementation, Tunable] = {}
        self._eager: dict[Any, tuple[Implementation, Any, int]] = {}

    def __call__(self, kernel: Any, *args: Any, cfg: Any = None, **kwargs: Any) -> Any:
        if "_cfg" in kwargs:  # the seeds' spelling
            cfg = kwargs.pop("_cfg") if cfg is None else cfg
        if isinstance(kernel, OpKernel):
            platform = kwargs.pop("platform", None)
            return self.run_op(
                kernel.spec, kernel.spec.bind(args, kwargs), platform=platform, cfg=cfg
            )
        if isinstance(kernel, Kernel):
            return self._run_kernel(kernel, args, kwargs, cfg)
        raise TypeError(f"executor: expected an ejkernel.ops.Kernel; got {type(kernel).__name__}")

    # -- ops --------------------------------------------------------------------------------
    def _prepare(
        self,
        spec: OpSpec,
        bound: dict[str, Any],
        platform: str | None,
        cfg: Any,
        validated: dict[str, Any] | None = None,
    ) -> tuple[Implementation, str, dict[str, str], dict[str, Any], tuple[Any, ...]]:
        """Validate, then select; returns the implementation, why, rejections, arguments and
        the arguments' fast signature (reused by every invocation of this call)."""
        arguments = validated if validated is not None else spec.validate(dict(bound))
        reason = "platform= argument" if platform is not None else None
        if platform is None and _config_platform(cfg) is not None:
            platform, reason = _config_platform(cfg), "cfg.platform"
        inv = Invocation(kernel=spec.name, kwargs=arguments)
        impl, why, rejected = select_implementation(spec, inv, platform, reason, self.selector)
        return impl, why, rejected, arguments, inv.fast_signature()

    def _tunable(self, spec: OpSpec, impl: Implementation, arguments: Mapping[str, Any]) -> Tunable:
        tunable = self._tunables.get(impl)
        if tunable is None:
            tunable = self._tunables[impl] = self._new_tunable(spec, impl)
        return tunable

    def _new_tunable(self, spec: OpSpec, impl: Implementation) -> Tunable:
        return Tunable(
            op=spec.name,
            platform=impl.platform,
            version=impl.version,
            config_type=impl.config_type,
            configless=impl.config_type is None,
            heuristic=impl.get_heuristic(),
            config_space=impl.get_config_space(),
            tune=lambda inv, configs: self._tune_op(spec, impl, inv, configs),
        )

    def _chooser(
        self,
        spec: OpSpec,
        impl: Implementation,
        arguments: Mapping[str, Any],
        cfg: Any,
        fast: tuple[Any, ...] | None = None,
    ) -> tuple[Callable[[bool], Any], dict[str, Choice]]:
        tunable = self._tunable(spec, impl, arguments)
        override = coerce_config(spec, impl, cfg)
        seen: dict[str, Choice] = {}

        def choose(grad: bool) -> Any:
            inv = Invocation(kernel=spec.name, kwargs=arguments, metadata={"grad": grad}, fast=fast)
            choice = self.selector.choose(tunable, inv, override=override)
            if choice.source == "overlay":
                choice = attrs.evolve(choice, config=coerce_config(spec, impl, choice.config))
            seen["grad" if grad else "fwd"] = choice
            return choice.config

        return choose, seen

    def run_op(
        self, spec: OpSpec, bound: dict[str, Any], *, platform: str | None = None, cfg: Any = None
    ) -> Any:
        """Run an op on bound (not yet validated) arguments.

        Eager calls without ``cfg=`` or overlays are memoised per executor: the key holds
        everything selection and the chain read (signature, backend, platform, environment,
        registry generation, policy, memory-cache version), so a hit skips straight to the
        implementation.
        """
        arguments = spec.validate(dict(bound))
        eager = not _traced(arguments)  # concrete inputs: nothing differentiates this call
        memo_key = None
        if eager and cfg is None and not overlay_state():
            memo_key = (
                spec.name,
                fast_signature(arguments),
                current_backend(),
                platform,
                _env.forced_platform(),
                get_registry().generation,
                self.selector.policy(),
                self.selector.cache.version,
            )
            hit = self._eager.get(memo_key)
            if hit is not None:
                return hit[0].fn(**arguments, cfg=hit[1])
        impl, _, _, arguments, fast = self._prepare(spec, bound, platform, cfg, arguments)
        choose, seen = self._chooser(spec, impl, arguments, cfg, fast)
        if eager:
            config = choose(False)
            if memo_key is not None and seen["fwd"].source not in ("override", "overlay"):
                if len(self._eager) > 4096:
                    self._eager.clear()
                memo_key = (*memo_key[:-1], self.selector.cache.version)
                self._eager[memo_key] = (impl, config, self.selector.cache.version)
            return impl.fn(**arguments, cfg=config)
        arrays = {k: v for k, v in arguments.items() if spec.arg(k).array and v is not None}
        return build_op_function(spec, impl, arguments, choose)(arrays)

    def explain_op(
        self,
        spec: OpSpec,
        bound: dict[str, Any],
        *,
        platform: str | None = None,
        cfg: Any = None,
        grad: bool = False,
    ) -> Selection:
        """The selection record of a call, without running it (nothing is tuned or stored)."""
        impl, why, rejected, arguments, fast = self._prepare(spec, bound, platform, cfg)
        inv = Invocation(kernel=spec.name, kwargs=arguments, metadata={"grad": grad}, fast=fast)
        choice = self.selector.choose(
            self._tunable(spec, impl, arguments),
            inv,
            override=coerce_config(spec, impl, cfg),
            peek=True,
        )
        return Selection(
            op=spec.name,
            platform=impl.platform,
            implementation=impl.name,
            reason=why,
            config=choice.config,
            source=choice.source,
            origin=choice.origin,
            key=choice.key,
            rejected=rejected,
        )

    def _tune_op(
        self, spec: OpSpec, impl: Implementation, inv: Invocation, configs: list[Any]
    ) -> tuple[Any, dict[str, Any]]:
        abstract = inv.abstract_kwargs
        # On the tuning thread: under an active trace, jnp calls would stage into it.
        concrete = run_outside_trace(lambda: on_device(spec.make_synthetic(abstract)))
        arrays = {k: v for k, v in concrete.items() if spec.arg(k).array and v is not None}

        def make_runner(cfg: Any) -> Callable[[], Any]:
            f = build_op_function(spec, impl, concrete, lambda grad: cfg)
            if not inv.grad:
                jitted = jax.jit(f)
                return lambda: jitted(arrays)
            out_shape = jax.eval_shape(f, arrays)
            d_out = on_device(
                jax.tree_util.tree_map(
                    lambda s: np.random.default_rng(1).standard_normal(s.shape).astype(s.dtype),
                    out_shape,
                )
            )

            def fwd_bwd(arrs: dict[str, Any], ct: Any) -> Any:
                out, vjp = jax.vjp(f, arrs)
                return out, vjp(ct)

            jitted = jax.jit(fwd_bwd)
            return lambda: jitted(arrays, d_out)

        return tune_candidates(f"{spec.name}/{impl.platform}", configs, make_runner)

    # -- user kernels -----------------------------------------------------------------------
    def _run_kernel(
        self, kernel: Kernel[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any], cfg: Any
    ) -> Any:
        platform = kernel.select_platform()
        method = kernel.method(platform)
        heuristic = kernel.heuristic_cfg if _overrides(kernel, "heuristic_cfg") else None
        space = kernel.config_space if _overrides(kernel, "config_space") else None
        tunable = Tunable(
            op=kernel.name,
            platform=platform,
            version=str(kernel.version),
            config_type=getattr(kernel, "config_type", None),
            configless=heuristic is None and space is None,
            heuristic=heuristic,
            config_space=space,
            tune=lambda inv, configs: self._tune_kernel(kernel, method, inv, configs),
        )
        cell: dict[str, Any] = {}

        def choose(grad: bool) -> Any:
            inv = Invocation(
                kernel=kernel,
                args=args,
                kwargs=kwargs,
                metadata={"grad": grad, "platform": platform},
            )
            cell["cfg"] = self.selector.choose(tunable, inv, override=cfg).config
            return cell["cfg"]

        positions = [i for i, a in enumerate(args) if _is_float_array(a)]
        if (
            not _overrides(kernel, "custom_vjp")
            or not positions
            or not _traced({str(i): args[i] for i in positions})
        ):
            return method(*args, cfg=choose(False), **kwargs)

        def primal(diff: tuple[Any, ...]) -> Any:
            full = list(args)
            for i, x in zip(positions, diff):
                full[i] = x
            return method(*full, cfg=choose(False), **kwargs)

        def fwd(diff: tuple[Any, ...]) -> tuple[Any, Any]:
            full = list(args)
            for i, x in zip(positions, diff):
                full[i] = x
            out = method(*full, cfg=choose(True), **kwargs)
            return out, tuple(full)

        def bwd(primals: tuple[Any, ...], ct: Any) -> tuple[tuple[Any, ...]]:
            grads = kernel.custom_vjp(primals, cell["cfg"], kwargs, (ct,))
            return (tuple(grads[i] for i in positions),)

        wrapped = jax.custom_vjp(primal)
        wrapped.defvjp(fwd, bwd)
        return wrapped(tuple(args[i] for i in positions))

    def _tune_kernel(
        self, kernel: Kernel[Any, Any], method: Any, inv: Invocation, configs: list[Any]
    ) -> tuple[Any, dict[str, Any]]:
        from ejkernel.specs._base import default_synthetic

        abstract_kwargs = inv.abstract_kwargs
        pos = run_outside_trace(
            lambda: on_device(
                default_synthetic({str(i): a for i, a in enumerate(inv.abstract_args)})
            )
        )
        args = tuple(pos[str(i)] for i in range(len(inv.args)))
        kw = run_outside_trace(lambda: on_device(default_synthetic(abstract_kwargs)))
        arrays = [i for i, a in enumerate(args) if hasattr(a, "shape")]

        def make_runner(cfg: Any) -> Callable[[], Any]:
            def f(*arrs: Any) -> Any:
                full = list(args)
                for i, x in zip(arrays, arrs):
                    full[i] = x
                return method(*full, cfg=cfg, **kw)

            jitted = jax.jit(f)
            return lambda: jitted(*(args[i] for i in arrays))

        return tune_candidates(kernel.name, configs, make_runner)


# -- module-level entry points ----------------------------------------------------------------

_default: Executor | None = None


def default_executor() -> Executor:
    """The process-wide executor behind ``ejkernel.<op>(...)``."""
    global _default
    if _default is None:
        _default = Executor()
    return _default


def call_op(spec: OpSpec, arguments: dict[str, Any]) -> Any:
    """Entry of every public op function: ``arguments`` is its ``locals()``."""
    arguments = dict(arguments)  # every argument is present: the public function named them all
    platform = arguments.pop("platform", None)
    cfg = arguments.pop("cfg", None)
    return default_executor().run_op(spec, arguments, platform=platform, cfg=cfg)


def explain(
    op: str | Callable[..., Any] | OpKernel[Any, Any], *args: Any, grad: bool = False, **kwargs: Any
) -> Selection:
    """What ``ejkernel.<op>(*args, **kwargs)`` would run, without running it.

    Args:
        op: the op name, its public function, or its kernel (``FlashAttention()``).
        *args: the op's arguments (arrays or ``jax.ShapeDtypeStruct``).
        grad: explain the differentiated call (its config may be tuned separately).
        **kwargs: the op's keyword arguments, plus ``platform=`` and ``cfg=``.

    Returns:
        A :class:`Selection`: ``.platform``, ``.config``, ``.source``, ``.rejected``...
    """
    name = (
        op
        if isinstance(op, str)
        else getattr(getattr(op, "spec", None), "name", None) or getattr(op, "__name__", "")
    )
    spec = get_registry().spec(str(name))
    platform = kwargs.pop("platform", None)
    cfg = kwargs.pop("cfg", None)
    return default_executor().explain_op(
        spec, spec.bind(args, kwargs), platform=platform, cfg=cfg, grad=grad
    )
