"""The seeds' registry decorator: ``kernel_registry.register("name", Platform.TRITON, Backend.GPU)``.

Names that are catalogue ops register into the op registry too (so the executor can select
them); other names form a simple name → platform → function table read with ``get``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, ClassVar, Self

__all__ = ["Backend", "KernelRegistry", "Platform", "kernel_registry"]


class _Name(str):
    """A lower-cased name string with the enum-style ``value``."""

    def __new__(cls, value: str) -> Self:
        return super().__new__(cls, str(value).lower())

    @property
    def value(self) -> str:
        return str(self)


class Platform(_Name):
    """A platform name: the seeds' members are predefined; any plugin's string is valid too."""

    TRITON: ClassVar[Platform]
    PALLAS: ClassVar[Platform]
    CUDA: ClassVar[Platform]
    XLA: ClassVar[Platform]
    AUTO: ClassVar[Platform]


class Backend(_Name):
    """A backend name (``gpu``, ``tpu``, ``cpu``, ``any``); other strings are accepted as given."""

    GPU: ClassVar[Backend]
    TPU: ClassVar[Backend]
    CPU: ClassVar[Backend]
    ANY: ClassVar[Backend]


Platform.TRITON, Platform.PALLAS, Platform.CUDA = (
    Platform("triton"),
    Platform("pallas"),
    Platform("cuda"),
)
Platform.XLA, Platform.AUTO = Platform("xla"), Platform("auto")
Backend.GPU, Backend.TPU, Backend.CPU, Backend.ANY = (
    Backend("gpu"),
    Backend("tpu"),
    Backend("cpu"),
    Backend("any"),
)


class KernelRegistry:
    """Name → platform → implementation, with priorities."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: dict[str, list[tuple[int, str, str, Callable[..., Any]]]] = {}

    def register(
        self, name: str, platform: str, backend: str = "any", priority: int = 0
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering ``fn`` as ``name`` on ``platform`` for ``backend``."""

        def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
            with self._lock:
                entries = self._table.setdefault(name, [])
                entries.append((priority, str(platform).lower(), str(backend).lower(), fn))
                entries.sort(key=lambda e: -e[0])
            from ejkernel.plugins import get_registry

            registry = get_registry()
            if name in registry.ops():
                registry.register(
                    name,
                    platform=str(platform).lower(),
                    backend=str(backend).lower(),
                    priority=priority,
                )(fn)
            return fn

        return decorator

    def get(
        self, name: str, platform: str | None = None, backend: str | None = None
    ) -> Callable[..., Any]:
        """The highest-priority function registered as ``name`` (on ``platform``/``backend``).

        Catalogue ops also resolve to implementations registered by plugins.
        """
        want = None if platform in (None, "auto") else str(platform).lower()
        for _, p, b, fn in self._table.get(name, []):
            if (want is None or p == want) and (
                backend is None or b in ("any", str(backend).lower())
            ):
                return fn
        from ejkernel.plugins import get_registry

        registry = get_registry()
        if name in registry.ops():
            for impl in registry.implementations(name):
                if (want is None or impl.platform == want) and (
                    backend is None or impl.runs_on(str(backend).lower())
                ):
                    return impl.fn
        raise KeyError(
            f"no kernel {name!r} registered for platform {platform!r}, backend {backend!r}"
        )

    def names(self) -> list[str]:
        return sorted(self._table)


kernel_registry = KernelRegistry()
