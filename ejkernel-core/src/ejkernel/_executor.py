"""The executor: validate → select an implementation → choose its config → run (with its VJP).

The op path of DESIGN.md: an op call is validated by its spec, an implementation is selected
(:mod:`ejkernel._selection`), its config comes from the
:class:`~ejkernel.ops.ConfigSelectorChain`, and it runs; differentiable implementations run
through a ``jax.custom_vjp`` whose forward chooses the config of the differentiated call and
hands it to the backward (:mod:`ejkernel._vjp`). User :class:`~ejkernel.ops.Kernel` objects
run through :func:`ejkernel._kernel.run_kernel`.

Memos (the policy of :mod:`ejkernel._memo`): selection's runnable candidates, keyed by
:func:`~ejkernel._memo.call_key` (op, fast signature, backend, registry generation,
environment); per executor, the eager dispatch of calls without ``cfg=`` or an overlay (the
implementation and its config), keyed by the same plus ``platform=``, the autotune policy and
the memory cache's version; and the tunable of each implementation, keyed by the
implementation object. None is invalidated by hand: what changes a result changes its key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import jax
import numpy as np

from ejkernel import _env, _labels, _recording
from ejkernel._autotune import on_device, run_outside_trace, tune_candidates
from ejkernel._chain import Choice, ConfigSelectorChain, Tunable, overlay_state
from ejkernel._invocation import Invocation, current_backend
from ejkernel._kernel import Kernel, OpKernel, run_kernel
from ejkernel._memo import Memo, call_key
from ejkernel._registry import Implementation
from ejkernel._selection import (
    Selection,
    check_platform_argument,
    reject_failed,
    select_implementation,
)
from ejkernel._vjp import build_op_function, traced
from ejkernel.errors import ConfigError
from ejkernel.plugins import get_registry
from ejkernel.specs import OpSpec
from ejkernel.specs._base import normal_draw

__all__ = [
    "Executor",
    "Selection",
    "build_op_function",
    "call_op",
    "coerce_config",
    "default_executor",
    "explain",
]


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
    Anything else, or a config that sets fields of which the target has none (another op's
    config), is a :class:`ConfigError` naming ``cfg``: never silently replaced by a default.
    """
    target = impl.config_type
    if cfg is None:
        return None
    fields = _fields(cfg)
    if fields is None:
        want = target.__name__ if target is not None else "config (attrs class or dataclass)"
        raise ConfigError(f"{spec.name}: `cfg` must be a {want} or None; got {type(cfg).__name__}")
    if target is not None and isinstance(cfg, target):
        return cfg
    options = fields.pop("options", None) or {}
    fields = {**fields, **dict(options)}
    given = {k: v for k, v in fields.items() if k != "platform" and v is not None}
    if target is None:
        if given:
            raise ConfigError(
                f"{spec.name}: platform {impl.platform!r} takes no config, but `cfg` sets "
                f"{', '.join(sorted(given))}"
            )
        return None
    names = (
        {f.name for f in attrs.fields(target)}
        if attrs.has(target)
        else {f.name for f in dataclasses.fields(target)}
    )
    if given and not given.keys() & names:
        raise ConfigError(
            f"{spec.name}: `cfg` is a {type(cfg).__name__} whose fields ({', '.join(sorted(given))}) "
            f"platform {impl.platform!r}'s {target.__name__} does not have "
            f"({', '.join(sorted(names))}): a config of another op?"
        )
    common = {k: v for k, v in given.items() if k in names}
    try:
        return target(**common)
    except Exception as err:
        raise ConfigError(
            f"{spec.name}: cfg {cfg!r} does not fit platform {impl.platform!r}'s {target.__name__}: {err}"
        ) from err


def _config_platform(cfg: Any) -> str | None:
    p = getattr(cfg, "platform", None)
    return None if p in (None, "auto") else str(p)


def _forced(platform: str | None, cfg: Any) -> str | None:
    """The platform a call forces: ``platform=``, ``cfg.platform``, ``EJKERNEL_PLATFORM``."""
    return platform or _config_platform(cfg) or _env.forced_platform()


class _ImplementationFailed(Exception):
    """Internal: the selected implementation raised ``error``."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


# -- running ops ----------------------------------------------------------------------------

#: Keyword arguments of ``Executor.__call__`` that go to ``jax.shard_map`` with
#: ``method="shard_map"``.
_SHARD_MAP_OPTIONS = ("mesh", "in_specs", "out_specs", "check_vma", "axis_names")


class Executor:
    """Runs kernels and ops: selection, the config chain, custom VJPs.

    Called as ``executor(kernel, *args, cfg=None, **kwargs)`` where ``kernel`` is an op kernel
    (``ejkernel.modules.FlashAttention()``) or a user :class:`ejkernel.ops.Kernel`.

    With ``method="shard_map"`` (and ``mesh=``, ``in_specs=``, ``out_specs=``, optionally
    ``check_vma=``) the call runs inside ``jax.shard_map``: ``args`` are the global arrays,
    split by ``in_specs`` (one spec per positional argument, or one for all), and each device
    runs the kernel on its shard, so selection and tuning see the per-shard shapes (a config is
    chosen, or tuned, once per shard shape). Keyword arguments are static or replicated; pass
    arrays that must be split positionally.

    Args:
        selector: the config chain (default: memory + persistent caches, autotune allowed).
    """

    def __init__(self, selector: ConfigSelectorChain | None = None) -> None:
        self.selector = selector if selector is not None else ConfigSelectorChain()
        self._tunables: Memo[Tunable] = Memo()
        self._eager: Memo[tuple[Implementation, Any]] = Memo()

    def __call__(
        self,
        kernel: Any,
        *args: Any,
        cfg: Any = None,
        method: str | None = None,
        **kwargs: Any,
    ) -> Any:
        if "_cfg" in kwargs:  # the seeds' spelling
            cfg = kwargs.pop("_cfg") if cfg is None else cfg
        if method is not None:
            return self._call_sharded(kernel, args, cfg, method, kwargs)
        if isinstance(kernel, OpKernel):
            platform = kwargs.pop("platform", None)
            return self.run_op(
                kernel.spec, kernel.spec.bind(args, kwargs), platform=platform, cfg=cfg
            )
        if isinstance(kernel, Kernel):
            return run_kernel(self.selector, kernel, args, kwargs, cfg)
        raise TypeError(f"executor: expected an ejkernel.ops.Kernel; got {type(kernel).__name__}")

    def _call_sharded(
        self, kernel: Any, args: tuple[Any, ...], cfg: Any, method: str, kwargs: dict[str, Any]
    ) -> Any:
        """``executor(kernel, *args, method="shard_map", mesh=, in_specs=, out_specs=, ...)``."""
        options = {n: kwargs.pop(n) for n in _SHARD_MAP_OPTIONS if n in kwargs}
        if method != "shard_map":
            raise ValueError(f"executor: `method` must be 'shard_map' or None; got {method!r}")
        if "out_specs" not in options:
            raise TypeError(
                "executor: method='shard_map' needs `out_specs` (and `in_specs`, `mesh`)"
            )

        def per_shard(*shards: Any) -> Any:
            return self(kernel, *shards, cfg=cfg, **kwargs)

        return jax.shard_map(per_shard, **options)(*args)

    # -- ops --------------------------------------------------------------------------------
    def _prepare(
        self,
        spec: OpSpec,
        bound: dict[str, Any],
        platform: str | None,
        cfg: Any,
        validated: dict[str, Any] | None = None,
        fast: tuple[Any, ...] | None = None,
    ) -> tuple[Implementation, str, dict[str, str], dict[str, Any], tuple[Any, ...]]:
        """Validate, then select; returns the implementation, why, rejections, arguments and
        the arguments' fast signature (reused by every invocation of this call)."""
        arguments = validated if validated is not None else spec.validate(dict(bound))
        check_platform_argument(spec, platform)
        reason = "platform= argument" if platform is not None else None
        if platform is None and _config_platform(cfg) is not None:
            platform, reason = _config_platform(cfg), "cfg.platform"
        inv = Invocation(kernel=spec.name, kwargs=arguments, fast=fast)
        impl, why, rejected = select_implementation(spec, inv, platform, reason, self.selector)
        return impl, why, rejected, arguments, inv.fast_signature()

    def _tunable(self, spec: OpSpec, impl: Implementation, arguments: Mapping[str, Any]) -> Tunable:
        tunable = self._tunables.get(impl)
        if tunable is None:
            tunable = self._tunables.put(impl, self._new_tunable(spec, impl))
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

        Eager calls without ``cfg=`` or overlays are memoised per executor (see the module
        docstring): a hit skips selection and the chain, straight to the implementation.
        Unless a platform is forced (``platform=``, ``cfg.platform``, ``EJKERNEL_PLATFORM``),
        an implementation that raises while traced (eagerly: while called) is rejected for
        this call and the next runnable one runs (:func:`ejkernel._selection.reject_failed`).
        """
        arguments = spec.validate(dict(bound))
        eager = not traced(arguments)  # concrete inputs: nothing differentiates this call
        recording = _recording.active()
        if recording and eager:
            check_platform_argument(spec, platform)
            _recording.record_op_call(spec, arguments, platform=_forced(platform, cfg), grad=False)
        fast = Invocation(kernel=spec.name, kwargs=arguments).fast_signature()
        memo_key = None
        if eager and cfg is None and not overlay_state():
            memo_key = (
                *call_key(spec.name, fast, current_backend(), get_registry().generation),
                platform,
                self.selector.policy(),
            )
            hit = self._eager.get((*memo_key, self.selector.cache.version))
            if hit is not None:
                return hit[0].fn(**arguments, cfg=hit[1])
        forced_platform = _forced(platform, cfg)
        forced = forced_platform is not None
        record = None
        if recording and not eager:

            def record(grad: bool) -> None:
                _recording.record_op_call(spec, arguments, platform=forced_platform, grad=grad)

        while True:
            impl, _, _, arguments, fast = self._prepare(spec, bound, platform, cfg, arguments, fast)
            try:
                return self._run_impl(spec, impl, arguments, cfg, fast, eager, memo_key, record)
            except _ImplementationFailed as failed:
                err = failed.error
            # outside the handler: the implementation's error is raised as it was
            inv = Invocation(kernel=spec.name, kwargs=arguments, fast=fast)
            if forced or not reject_failed(spec, inv, impl, err):
                raise err

    def _run_impl(
        self,
        spec: OpSpec,
        impl: Implementation,
        arguments: dict[str, Any],
        cfg: Any,
        fast: tuple[Any, ...],
        eager: bool,
        memo_key: tuple[Any, ...] | None,
        record: Callable[[bool], None] | None = None,
    ) -> Any:
        """Run ``impl``; an error the implementation raises (not the config chain) comes out
        wrapped in :class:`_ImplementationFailed`. ``record(grad)`` records a traced call
        when its config is chosen. With ``EJKERNEL_OPS_STAMP``, a traced implementation runs
        in a named scope stamped with the op, the platform and its config (a named scope
        marks only what is traced: eager calls have no program to stamp)."""
        choose, seen = self._chooser(spec, impl, arguments, cfg, fast)
        if eager:
            config = choose(False)
            try:
                out = impl.fn(**arguments, cfg=config)
            except Exception as err:
                raise _ImplementationFailed(err) from None
            if memo_key is not None and seen["fwd"].source not in ("override", "overlay"):
                # the version after the chain ran: it may have put this very config in memory
                self._eager.put((*memo_key, self.selector.cache.version), (impl, config))
            return out
        chain_errors: list[Exception] = []

        def chosen(grad: bool) -> Any:
            try:
                if record is not None:
                    record(grad)
                return choose(grad)
            except Exception as err:
                chain_errors.append(err)
                raise

        stamp = _labels.stamp_mode()

        def scope(grad: bool) -> str:
            choice = seen["grad" if grad else "fwd"]
            return _labels.op_stamp(spec.name, impl.platform, choice.key, choice.config, stamp)

        arrays = {k: v for k, v in arguments.items() if spec.arg(k).array and v is not None}
        try:
            f = build_op_function(spec, impl, arguments, chosen, scope if stamp else None)
            return f(arrays)
        except Exception as err:
            if any(err is e for e in chain_errors):
                raise
            raise _ImplementationFailed(err) from None

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
                    lambda s: normal_draw(np.random.default_rng(1), s.shape, s.dtype),
                    out_shape,
                )
            )

            def fwd_bwd(arrs: dict[str, Any], ct: Any) -> Any:
                out, vjp = jax.vjp(f, arrs)
                return out, vjp(ct)

            jitted = jax.jit(fwd_bwd)
            return lambda: jitted(arrays, d_out)

        return tune_candidates(f"{spec.name}/{impl.platform}", configs, make_runner)


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
