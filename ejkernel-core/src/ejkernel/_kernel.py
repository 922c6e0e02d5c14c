"""``Kernel``: the seeds' building block (one operation, per-platform ``run_<platform>`` methods).

Ops of the catalogue are :class:`OpKernel` subclasses whose ``run_<platform>`` methods call
the registered implementation of that platform; user kernels subclass :class:`Kernel`
directly. Both run through :class:`ejkernel.ops.Executor`: op kernels through the registry
(:mod:`ejkernel._executor`), user kernels through :func:`run_kernel` here (the method of the
backend's preferred platform, its config from the chain, its ``custom_vjp`` when overridden).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import jax

from ejkernel import _recording
from ejkernel._autotune import on_device, run_outside_trace, tune_candidates
from ejkernel._chain import ConfigSelectorChain, Tunable
from ejkernel._invocation import Invocation, current_backend
from ejkernel._vjp import build_kernel_function, is_float_array, traced
from ejkernel.specs import OpSpec

__all__ = ["Cfg", "Kernel", "OpKernel", "Out", "get_device_platform", "run_kernel"]

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
    from ejkernel._selection import preferred_platform

    return preferred_platform("flash_attention") or PREFERRED_PLATFORM.get(current_backend(), "xla")


def run_kernel(
    selector: ConfigSelectorChain,
    kernel: Kernel[Any, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cfg: Any,
) -> Any:
    """Run a user kernel: its preferred platform's method, with the config the chain chooses
    (``cfg`` overrides), through its ``custom_vjp`` when overridden and differentiated."""
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
        tune=lambda inv, configs: _tune_kernel(kernel, method, inv, configs),
    )

    def choose(grad: bool) -> Any:
        if _recording.active():
            _recording.record_kernel_call(kernel, args, kwargs, grad=grad)
        inv = Invocation(
            kernel=kernel, args=args, kwargs=kwargs, metadata={"grad": grad, "platform": platform}
        )
        return selector.choose(tunable, inv, override=cfg).config

    positions = [i for i, a in enumerate(args) if is_float_array(a)]
    if (
        not _overrides(kernel, "custom_vjp")
        or not positions
        or not traced({str(i): args[i] for i in positions})
    ):
        return method(*args, cfg=choose(False), **kwargs)
    f = build_kernel_function(method, args, kwargs, positions, choose, kernel.custom_vjp)
    return f(tuple(args[i] for i in positions))


def _tune_kernel(
    kernel: Kernel[Any, Any], method: Any, inv: Invocation, configs: list[Any]
) -> tuple[Any, dict[str, Any]]:
    """Time ``configs`` on synthetic inputs shaped like ``inv``'s (forward only)."""
    from ejkernel.specs._base import default_synthetic

    abstract_kwargs = inv.abstract_kwargs
    pos = run_outside_trace(
        lambda: on_device(default_synthetic({str(i): a for i, a in enumerate(inv.abstract_args)}))
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
