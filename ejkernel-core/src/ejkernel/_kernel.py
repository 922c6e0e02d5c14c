"""``Kernel``: the seeds' building block (one operation, per-platform ``run_<platform>`` methods).

Ops of the catalogue are :class:`OpKernel` subclasses whose ``run_<platform>`` methods call
the registered implementation of that platform; user kernels subclass :class:`Kernel`
directly. Both run through :class:`ejkernel.ops.Executor`.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from ejkernel._invocation import Invocation, current_backend
from ejkernel.specs import OpSpec

__all__ = ["Cfg", "Kernel", "OpKernel", "Out", "get_device_platform"]

Cfg = TypeVar("Cfg")
Out = TypeVar("Out")

#: The platform whose ``run_<platform>`` method a plain :class:`Kernel` prefers per backend.
PREFERRED_PLATFORM = {"gpu": "triton", "tpu": "pallas", "cpu": "xla"}


class Kernel(Generic[Cfg, Out]):
    """An operation with tunable configs and per-platform implementations.

    Subclasses implement ``run(*args, cfg, **kwargs)`` and/or ``run_<platform>`` methods
    (``run_xla``, ``run_triton``, ``run_pallas``, ``run_cuda``, or a plugin's platform), and
    optionally ``heuristic_cfg(inv)``, ``config_space(inv)`` and ``custom_vjp``.

    Attributes:
        name: names the kernel in cache keys and messages.
        version: bump it when configs cached for an older version must not be reused.
    """

    version: str = "0"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or type(self).__name__

    def run(self, *args: Any, cfg: Cfg, **kwargs: Any) -> Out:
        """The default implementation (used when no ``run_<platform>`` fits)."""
        run_xla = getattr(self, "run_xla", None)
        if run_xla is not None:
            return run_xla(*args, cfg=cfg, **kwargs)  # type: ignore[no-any-return]
        raise NotImplementedError(f"{self.name}: implement run() or run_<platform>()")

    def heuristic_cfg(self, inv: Invocation) -> Cfg:
        """A config chosen from the invocation's shapes (tier 6 of the chain)."""
        raise NotImplementedError

    def config_space(self, inv: Invocation) -> list[Cfg]:
        """Candidates for autotuning (tier 5); empty means nothing to tune."""
        return []

    def custom_vjp(
        self,
        primals: tuple[Any, ...],
        cfg: Cfg,
        kwargs: dict[str, Any],
        cotangents: tuple[Any, ...],
    ) -> tuple[Any, ...]:
        """Gradients of the positional arguments; not overriding it means plain autodiff."""
        raise NotImplementedError

    def select_platform(self) -> str:
        """The ``run_<platform>`` this backend prefers, if defined; else ``"default"`` (``run``)."""
        preferred = PREFERRED_PLATFORM.get(current_backend(), "xla")
        return preferred if callable(getattr(self, f"run_{preferred}", None)) else "default"

    def method(self, platform: str) -> Any:
        return self.run if platform == "default" else getattr(self, f"run_{platform}")

    def __call__(self, *args: Any, cfg: Cfg | None = None, **kwargs: Any) -> Out:
        """Run through the default executor."""
        from ejkernel._executor import default_executor

        return default_executor()(self, *args, cfg=cfg, **kwargs)  # type: ignore[no-any-return]


def _overrides(obj: Any, name: str) -> bool:
    return getattr(type(obj), name, None) is not getattr(Kernel, name, None)


class OpKernel(Kernel[Cfg, Out]):
    """A catalogue op as a :class:`Kernel`: the executor selects among registered implementations.

    ``run_<platform>`` calls that platform's registered implementation directly with ``cfg``.
    """

    spec: OpSpec

    def __init__(self) -> None:
        super().__init__(name=self.spec.name)

    def run(
        self, *args: Any, cfg: Cfg | None = None, platform: str | None = None, **kwargs: Any
    ) -> Out:
        from ejkernel._executor import default_executor

        return default_executor()(self, *args, cfg=cfg, platform=platform, **kwargs)  # type: ignore[no-any-return]

    def _run_platform(
        self, platform: str, args: tuple[Any, ...], cfg: Any, kwargs: dict[str, Any]
    ) -> Out:
        return self.run(*args, cfg=cfg, platform=platform, **kwargs)

    def run_xla(self, *args: Any, cfg: Cfg | None = None, **kwargs: Any) -> Out:
        return self._run_platform("xla", args, cfg, kwargs)

    def run_triton(self, *args: Any, cfg: Cfg | None = None, **kwargs: Any) -> Out:
        return self._run_platform("triton", args, cfg, kwargs)

    def run_pallas(self, *args: Any, cfg: Cfg | None = None, **kwargs: Any) -> Out:
        return self._run_platform("pallas", args, cfg, kwargs)

    def run_cuda(self, *args: Any, cfg: Cfg | None = None, **kwargs: Any) -> Out:
        return self._run_platform("cuda", args, cfg, kwargs)


def get_device_platform() -> str:
    """The platform the executor would pick for ``flash_attention`` on the default device.

    Falls back to the seeds' per-backend default (``triton`` on gpu, ``pallas`` on tpu,
    ``xla`` on cpu) when no implementation is installed.
    """
    from ejkernel._executor import preferred_platform

    return preferred_platform("flash_attention") or PREFERRED_PLATFORM.get(current_backend(), "xla")
