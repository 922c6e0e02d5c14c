"""The registry: ops (specs), platforms and the implementations plugins register for them.

Two ways to register an implementation, both lazy (nothing is imported until first use):

- :meth:`Registry.register` names each piece (function, config, heuristic, ...) as an object
  or a ``"module:attr"`` string (DESIGN.md's contract);
- :meth:`Registry.register_module` names a module and finds the pieces in it by convention
  (:func:`conventional_names`).

An op whose spec says ``served_by=X`` (``scaled_dot_product_attention``: flash attention) is
also served by every implementation of ``X`` on a platform that registers none of its own for
it: the ``X`` implementation runs with ``X``'s remaining arguments at their defaults.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from ejkernel.errors import ConfigError
from ejkernel.specs import OpSpec

__all__ = [
    "KNOWN_DISTRIBUTIONS",
    "Implementation",
    "Platform",
    "Registry",
    "conventional_names",
    "resolve",
]

#: platform -> the distribution that brings it (named in "no implementation" errors).
KNOWN_DISTRIBUTIONS: dict[str, str] = {
    "xla": "ejkernel-xla",
    "triton": "ejkernel-triton",
    "pallas": "ejkernel-pallas",
    "cuda": "ejkernel-cuda",
}

BACKENDS = ("cpu", "gpu", "tpu", "any")

_GENERATIONS = itertools.count(1)


def conventional_names(op: str, platform: str) -> dict[str, tuple[str, ...]]:
    """What :meth:`Registry.register_module` looks for in the module, per piece, in order.

    The implementation ``<op>_<platform>`` is required; every other name is optional, and a
    missing one means none: no config class (the implementation is called with ``cfg=None``),
    no heuristic, no config space, no ``supports`` (every valid call is served). The config
    class is ``<OpCamel>Config`` (``FlashAttentionConfig``), else ``Config``. A VJP comes from
    :func:`ejkernel.plugins.defvjp` on the implementation, else from module functions
    ``<op>_<platform>_fwd`` and ``<op>_<platform>_bwd`` (both or neither).
    """
    fn = f"{op}_{platform}"
    camel = "".join(part[:1].upper() + part[1:] for part in op.split("_"))
    return {
        "target": (fn,),
        "config": (f"{camel}Config", "Config"),
        "heuristic": ("heuristic",),
        "config_space": ("config_space",),
        "supports": ("supports",),
        "fwd": (f"{fn}_fwd",),
        "bwd": (f"{fn}_bwd",),
    }


@attrs.frozen
class ByName:
    """A piece of an implementation found in ``module`` under the first of ``names`` present
    (``None`` when none is, unless ``required``); imported on first use."""

    module: str
    names: tuple[str, ...]
    required: bool = False

    def load(self) -> Any:
        mod = importlib.import_module(self.module)
        for name in self.names:
            if hasattr(mod, name):
                return getattr(mod, name)
        if self.required:
            raise AttributeError(
                f"module {self.module!r} defines no {' or '.join(self.names)} "
                f"(registered with register_module)"
            )
        return None

    def __str__(self) -> str:
        return f"{self.module}:{self.names[0]}"


def resolve(target: Any) -> Any:
    """Import ``"module:attr"`` (dotted attrs allowed) or a :class:`ByName`; anything else is
    returned as is."""
    if isinstance(target, ByName):
        return target.load()
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"expected 'module:attr'; got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _callable_name(fn: Any) -> str:
    if isinstance(fn, (str, ByName)):
        return str(fn)
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}:{getattr(fn, '__qualname__', type(fn).__name__)}"


@attrs.define(kw_only=True, eq=False)
class Implementation:
    """One function computing one op on one platform for some backends.

    The function and its helpers may be ``"module:attr"`` strings, imported on first use.
    Differentiable implementations may carry ``fwd``/``bwd`` attributes (see
    :func:`ejkernel.plugins.defvjp`); the executor wires them into a ``jax.custom_vjp``.
    ``served_from`` is set on an implementation of an op made from one of the op that serves
    it (the spec's ``served_by``); its pieces are the source's, adapted.
    """

    op: str
    platform: str
    backends: tuple[str, ...]
    priority: int
    target: Any
    config: Any = None
    heuristic: Any = None
    config_space: Any = None
    supports: Any = None
    version: str = "0"
    plugin: str = "<direct>"
    fwd: Any = None
    bwd: Any = None
    served_from: _ServedFrom | None = None
    _loaded: dict[str, Any] = attrs.field(factory=dict, repr=False)

    @property
    def name(self) -> str:
        """``module:qualname`` of the function that runs (stable across processes)."""
        if self.served_from is not None:
            return self.served_from.source.name
        return _callable_name(self.target)

    def _get(self, field: str) -> Any:
        if field not in self._loaded:
            if self.served_from is not None:
                self._loaded[field] = self.served_from.adapt(field)
            else:
                self._loaded[field] = resolve(getattr(self, field))
        return self._loaded[field]

    @property
    def fn(self) -> Callable[..., Any]:
        return self._get("target")  # type: ignore[no-any-return]

    @property
    def config_type(self) -> Any:
        config = self._get("config")
        if config is None and isinstance(self.config, ByName):
            helpers = [f for f in ("heuristic", "config_space") if self._get(f) is not None]
            if helpers:
                raise ConfigError(
                    f"{self.op} ({self.platform}): module {self.config.module!r} defines "
                    f"{' and '.join(helpers)} but no config class "
                    f"({' or '.join(self.config.names)})"
                )
        return config

    def get_vjp(self) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
        """``(fwd, bwd)`` for the executor's custom VJP, or ``None`` (JAX differentiates the
        implementation itself)."""
        if "vjp" not in self._loaded:
            if self.served_from is not None:
                self._loaded["vjp"] = self.served_from.adapt("vjp")
            else:
                self._loaded["vjp"] = self._find_vjp()
        return self._loaded["vjp"]  # type: ignore[no-any-return]

    def _find_vjp(self) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
        fn = self.fn
        fwd, bwd = getattr(fn, "fwd", None), getattr(fn, "bwd", None)
        if fwd is None and bwd is None:
            fwd, bwd = resolve(self.fwd), resolve(self.bwd)
        if (fwd is None) != (bwd is None):
            raise ConfigError(
                f"{self.op} ({self.platform}): {self.name} has a forward or a backward but not "
                f"both; give both (defvjp, or <fn>_fwd and <fn>_bwd) or neither"
            )
        return None if fwd is None else (fwd, bwd)

    def get_heuristic(self) -> Callable[..., Any] | None:
        return self._get("heuristic")  # type: ignore[no-any-return]

    def get_config_space(self) -> Callable[..., Any] | None:
        return self._get("config_space")  # type: ignore[no-any-return]

    def get_supports(self) -> Callable[..., Any] | None:
        return self._get("supports")  # type: ignore[no-any-return]

    def runs_on(self, backend: str) -> bool:
        return "any" in self.backends or backend in self.backends


@attrs.frozen(kw_only=True)
class _ServedFrom:
    """How an implementation of ``source``'s op serves the op of ``spec`` (its ``served_by``).

    The function runs with the source op's arguments that ``spec`` lacks at their defaults
    (``fill``); ``supports``, the heuristic and the config space see an invocation with those
    arguments too, so they read exactly a call of the source op; the backward's gradients are
    kept for ``spec``'s arguments only.
    """

    source: Implementation
    spec: OpSpec
    fill: Mapping[str, Any]
    static_fill: Mapping[str, Any]

    @classmethod
    def of(cls, source: Implementation, spec: OpSpec, source_spec: OpSpec) -> _ServedFrom:
        extra = [a for a in source_spec.args if a.name not in spec.arg_names]
        return cls(
            source=source,
            spec=spec,
            fill={a.name: a.default for a in extra},
            static_fill={a.name: a.default for a in extra if not a.array},
        )

    def adapt(self, field: str) -> Any:
        if field == "target":
            return functools.partial(self.source.fn, **self.fill)
        if field == "config":
            return self.source.config_type
        if field == "vjp":
            vjp = self.source.get_vjp()
            if vjp is None:
                return None
            fwd, bwd = vjp
            names = set(self.spec.arg_names)

            def served_bwd(residuals: Any, d_out: Any, **statics: Any) -> dict[str, Any]:
                grads = bwd(residuals, d_out, **statics, **self.static_fill)
                return {k: g for k, g in grads.items() if k in names}

            return functools.partial(fwd, **self.fill), served_bwd
        helper = self.source._get(field)  # heuristic, config_space, supports
        if helper is None:
            return None
        return lambda inv: helper(self._as_source(inv))

    def _as_source(self, inv: Any) -> Any:
        return attrs.evolve(inv, kwargs={**inv.kwargs, **self.fill}, fast=None)


@attrs.define(kw_only=True, eq=False)
class Platform:
    """A platform name, its availability probe and the distribution that brings it."""

    name: str
    available: Any = None  # callable(backend) -> True | reason, or "module:attr"
    distribution: str | None = None
    plugin: str = "<direct>"

    def check(self, backend: str) -> bool | str:
        if self.available is None:
            return True
        try:
            result = resolve(self.available)(backend)
        except Exception as err:  # a probe must never break selection
            return f"availability probe failed: {type(err).__name__}: {err}"
        return True if result is True else str(result or "not available")


class Registry:
    """Ops and their implementations. Plugins receive it in ``ejkernel_register(registry)``."""

    def __init__(self, specs: Iterable[OpSpec] = ()) -> None:
        self._lock = threading.RLock()
        self._specs: dict[str, OpSpec] = {s.name: s for s in specs}
        self._impls: dict[str, list[Implementation]] = {}
        self._platforms: dict[str, Platform] = {}
        self._shipped: list[tuple[str, str]] = []
        self._plugin = "<direct>"
        self._plugin_version = "0"
        self._served_memo: dict[tuple[int, str], Implementation] = {}
        self._served_generation = 0
        # Process-wide increasing stamp, changed on every change of any registry (a new registry
        # never reuses an old one's stamp), so dispatch memos can key on it.
        self.generation = next(_GENERATIONS)

    # -- what plugins call -------------------------------------------------------------------
    def register(
        self,
        op: str,
        *,
        platform: str,
        backend: str | Sequence[str],
        priority: int = 0,
        config: Any = None,
        heuristic: Any = None,
        config_space: Any = None,
        supports: Any = None,
        version: str | None = None,
    ) -> Callable[[Any], Any]:
        """Register an implementation of ``op``; returns a decorator.

        Args:
            op: an op name (built in, or added with :meth:`add_op`).
            platform: any platform string (``"xla"``, ``"triton"``, a third party's own).
            backend: ``"cpu"``, ``"gpu"``, ``"tpu"``, ``"any"``, or a tuple of them.
            priority: higher wins among runnable candidates.
            config: the config class (frozen attrs class or dataclass), or ``None``.
            heuristic: ``heuristic(inv) -> config``.
            config_space: ``config_space(inv) -> list of configs`` for autotuning.
            supports: ``supports(inv) -> True | reason``; ``None``: every valid call is served.
            version: enters the cache key; defaults to the plugin distribution's version.

        The decorated object may be a function or a ``"module:attr"`` string; every helper may
        be a ``"module:attr"`` string too. Strings are imported on first use only.
        """
        pieces = {
            "config": config,
            "heuristic": heuristic,
            "config_space": config_space,
            "supports": supports,
        }
        check = self._check(op, platform, backend)

        def decorator(target: Any) -> Any:
            self._add(*check, priority=priority, version=version, target=target, **pieces)
            return target

        return decorator

    def _check(
        self, op: str, platform: str, backend: str | Sequence[str]
    ) -> tuple[str, str, tuple[str, ...]]:
        backends = (backend,) if isinstance(backend, str) else tuple(backend)
        bad = [b for b in backends if b not in BACKENDS]
        if bad or not backends:
            raise ValueError(
                f"backend must be one of {BACKENDS} or a tuple of them; got {backend!r}"
            )
        if not isinstance(platform, str) or not platform:
            raise ValueError(f"platform must be a non-empty string; got {platform!r}")
        return op, platform.lower(), backends

    def _add(
        self,
        op: str,
        platform: str,
        backends: tuple[str, ...],
        *,
        priority: int,
        version: str | None,
        **pieces: Any,
    ) -> None:
        """Add an implementation, replacing one of the same platform and backends."""
        with self._lock:
            if op not in self._specs:
                raise KeyError(f"unknown op {op!r}: add its spec with registry.add_op(spec) first")
            impl = Implementation(
                op=op,
                platform=platform,
                backends=backends,
                priority=int(priority),
                version=str(version if version is not None else self._plugin_version),
                plugin=self._plugin,
                **pieces,
            )
            impls = self._impls.setdefault(op, [])
            impls[:] = [
                i
                for i in impls
                if not (i.platform == impl.platform and i.backends == impl.backends)
            ]
            impls.append(impl)
            self.generation = next(_GENERATIONS)

    def register_module(
        self,
        op: str,
        module: str,
        *,
        platform: str,
        backend: str | Sequence[str],
        priority: int = 0,
        version: str | None = None,
    ) -> None:
        """Register the implementation of ``op`` that ``module`` holds, found by convention.

        Nothing is imported now: on first use, the pieces are looked up in ``module`` by the
        names :func:`conventional_names` gives (``<op>_<platform>``, ``<OpCamel>Config`` or
        ``Config``, ``heuristic``, ``config_space``, ``supports``); a missing optional name
        means none (no ``supports``: every valid call is served).

        Args:
            op: an op name (built in, or added with :meth:`add_op`).
            module: the module's import name (``"ejkernel_myplat.ops.flash_attention"``).
            platform: as :meth:`register`.
            backend: as :meth:`register`.
            priority: as :meth:`register`.
            version: as :meth:`register`.
        """
        op, platform, backends = self._check(op, platform, backend)
        pieces = {
            field: ByName(module, names, required=field == "target")
            for field, names in conventional_names(op, platform).items()
        }
        self._add(op, platform, backends, priority=priority, version=version, **pieces)

    def add_op(self, spec: OpSpec) -> None:
        """Add a new op (third-party plugins may ship ops, not only implementations)."""
        with self._lock:
            if spec.name in self._specs and self._specs[spec.name] is not spec:
                raise ValueError(f"op {spec.name!r} is already defined")
            self._specs[spec.name] = spec
            self.generation = next(_GENERATIONS)

    def add_platform(
        self, name: str, *, available: Any = None, distribution: str | None = None
    ) -> None:
        """Declare a platform with a lazy availability probe ``available(backend) -> True|reason``."""
        with self._lock:
            self._platforms[name.lower()] = Platform(
                name=name.lower(),
                available=available,
                distribution=distribution,
                plugin=self._plugin,
            )
            self.generation = next(_GENERATIONS)

    def add_shipped_table(self, location: str | os.PathLike[str]) -> None:
        """Declare a shipped table of tuned configs and fastest platforms (docs: tuning).

        Nothing is read now: the config chain reads every declared table on its first lookup,
        once per process; a missing, corrupt or foreign file is one ``CacheWarning``.

        Args:
            location: a JSON table or a folder of them (``*.json``, in name order): a path,
                or ``"package:relative/path"`` inside an installed package (package data),
                e.g. ``"ejkernel_myplat:shipped"``.
        """
        if not isinstance(location, (str, os.PathLike)) or not str(location):
            raise TypeError(f"location must be a path or 'package:path'; got {location!r}")
        with self._lock:
            self._shipped.append((os.fspath(location), self._plugin))
            self.generation = next(_GENERATIONS)

    # -- what the core reads -----------------------------------------------------------------
    def shipped_tables(self) -> list[tuple[str, str]]:
        """The declared shipped-table locations, each with the plugin that declared it."""
        return list(self._shipped)

    def spec(self, op: str) -> OpSpec:
        try:
            return self._specs[op]
        except KeyError:
            raise KeyError(f"unknown op {op!r}; known ops: {sorted(self._specs)}") from None

    def ops(self) -> list[str]:
        return sorted(self._specs)

    def implementations(self, op: str) -> list[Implementation]:
        """Implementations of ``op``, highest priority first.

        For an op whose spec is ``served_by`` another, these include the other op's
        implementations on every platform that registers none of its own for ``op``.
        """
        impls = list(self._impls.get(op, ()))
        spec = self._specs.get(op)
        if spec is not None and spec.served_by in self._specs:
            own = {i.platform for i in impls}
            impls += [
                self._served(i, spec)
                for i in self._impls.get(spec.served_by, ())  # type: ignore[arg-type]
                if i.platform not in own
            ]
        return sorted(impls, key=lambda i: (-i.priority, i.platform))

    def _served(self, source: Implementation, spec: OpSpec) -> Implementation:
        """The implementation of ``spec``'s op made from ``source`` (one object per source, so
        what the executor keys on it stays valid)."""
        with self._lock:
            if self._served_generation != self.generation:
                self._served_memo, self._served_generation = {}, self.generation
            impl = self._served_memo.get((id(source), spec.name))
            if impl is None:
                impl = Implementation(
                    op=spec.name,
                    platform=source.platform,
                    backends=source.backends,
                    priority=source.priority,
                    target=source.target,
                    version=source.version,
                    plugin=source.plugin,
                    served_from=_ServedFrom.of(source, spec, self._specs[source.op]),
                )
                self._served_memo[(id(source), spec.name)] = impl
            return impl

    def platform(self, name: str) -> Platform:
        return self._platforms.get(name) or Platform(
            name=name, distribution=KNOWN_DISTRIBUTIONS.get(name)
        )

    def platforms(self) -> list[str]:
        names = set(self._platforms)
        for impls in self._impls.values():
            names.update(i.platform for i in impls)
        return sorted(names)

    # -- transactions, so one plugin's failure leaves no half registration -------------------
    def _snapshot(
        self,
    ) -> tuple[dict[str, OpSpec], dict[str, list[Implementation]], dict[str, Platform], list[Any]]:
        return (
            dict(self._specs),
            {k: list(v) for k, v in self._impls.items()},
            dict(self._platforms),
            list(self._shipped),
        )

    def _restore(self, snap: tuple[Any, Any, Any, Any]) -> None:
        self._specs, self._impls, self._platforms, self._shipped = snap
        self.generation = next(_GENERATIONS)

    def _attribute_to(self, plugin: str, version: str) -> None:
        self._plugin, self._plugin_version = plugin, version
