"""The registry: ops (specs), platforms and the implementations plugins register for them."""

from __future__ import annotations

import importlib
import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from ejkernel.specs import OpSpec

__all__ = ["KNOWN_DISTRIBUTIONS", "Implementation", "Platform", "Registry", "resolve"]

#: platform -> the distribution that brings it (named in "no implementation" errors).
KNOWN_DISTRIBUTIONS: dict[str, str] = {
    "xla": "ejkernel-xla",
    "triton": "ejkernel-triton",
    "pallas": "ejkernel-pallas",
    "cuda": "ejkernel-cuda",
}

BACKENDS = ("cpu", "gpu", "tpu", "any")

_GENERATIONS = itertools.count(1)


def resolve(target: Any) -> Any:
    """Import ``"module:attr"`` (dotted attrs allowed); anything else is returned as is."""
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
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}:{getattr(fn, '__qualname__', type(fn).__name__)}"


@attrs.define(kw_only=True, eq=False)
class Implementation:
    """One function computing one op on one platform for some backends.

    The function and its helpers may be ``"module:attr"`` strings, imported on first use.
    Differentiable implementations may carry ``fwd``/``bwd`` attributes (see
    :func:`ejkernel.plugins.defvjp`); the executor wires them into a ``jax.custom_vjp``.
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
    _loaded: dict[str, Any] = attrs.field(factory=dict, repr=False)

    @property
    def name(self) -> str:
        """``module:qualname`` of the implementation (stable across processes)."""
        return _callable_name(self.target)

    def _get(self, field: str) -> Any:
        if field not in self._loaded:
            self._loaded[field] = resolve(getattr(self, field))
        return self._loaded[field]

    @property
    def fn(self) -> Callable[..., Any]:
        return self._get("target")  # type: ignore[no-any-return]

    @property
    def config_type(self) -> Any:
        return self._get("config")

    def get_heuristic(self) -> Callable[..., Any] | None:
        return self._get("heuristic")  # type: ignore[no-any-return]

    def get_config_space(self) -> Callable[..., Any] | None:
        return self._get("config_space")  # type: ignore[no-any-return]

    def get_supports(self) -> Callable[..., Any] | None:
        return self._get("supports")  # type: ignore[no-any-return]

    def runs_on(self, backend: str) -> bool:
        return "any" in self.backends or backend in self.backends


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
        self._plugin = "<direct>"
        self._plugin_version = "0"
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
            supports: ``supports(inv) -> True | reason``.
            version: enters the cache key; defaults to the plugin distribution's version.

        The decorated object may be a function or a ``"module:attr"`` string; every helper may
        be a ``"module:attr"`` string too. Strings are imported on first use only.
        """
        backends = (backend,) if isinstance(backend, str) else tuple(backend)
        bad = [b for b in backends if b not in BACKENDS]
        if bad or not backends:
            raise ValueError(
                f"backend must be one of {BACKENDS} or a tuple of them; got {backend!r}"
            )
        if not isinstance(platform, str) or not platform:
            raise ValueError(f"platform must be a non-empty string; got {platform!r}")

        def decorator(target: Any) -> Any:
            with self._lock:
                if op not in self._specs:
                    raise KeyError(
                        f"unknown op {op!r}: add its spec with registry.add_op(spec) first"
                    )
                impl = Implementation(
                    op=op,
                    platform=platform.lower(),
                    backends=backends,
                    priority=int(priority),
                    target=target,
                    config=config,
                    heuristic=heuristic,
                    config_space=config_space,
                    supports=supports,
                    version=str(version if version is not None else self._plugin_version),
                    plugin=self._plugin,
                )
                impls = self._impls.setdefault(op, [])
                impls[:] = [
                    i
                    for i in impls
                    if not (i.platform == impl.platform and i.backends == impl.backends)
                ]
                impls.append(impl)
                self.generation = next(_GENERATIONS)
            return target

        return decorator

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

    # -- what the core reads -----------------------------------------------------------------
    def spec(self, op: str) -> OpSpec:
        try:
            return self._specs[op]
        except KeyError:
            raise KeyError(f"unknown op {op!r}; known ops: {sorted(self._specs)}") from None

    def ops(self) -> list[str]:
        return sorted(self._specs)

    def implementations(self, op: str) -> list[Implementation]:
        """Implementations of ``op``, highest priority first."""
        return sorted(self._impls.get(op, ()), key=lambda i: (-i.priority, i.platform))

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
    ) -> tuple[dict[str, OpSpec], dict[str, list[Implementation]], dict[str, Platform]]:
        return (
            dict(self._specs),
            {k: list(v) for k, v in self._impls.items()},
            dict(self._platforms),
        )

    def _restore(self, snap: tuple[Any, Any, Any]) -> None:
        self._specs, self._impls, self._platforms = snap
        self.generation = next(_GENERATIONS)

    def _attribute_to(self, plugin: str, version: str) -> None:
        self._plugin, self._plugin_version = plugin, version
