"""The plugin API, and plugin discovery (entry points of group ``ejkernel.plugins``, pluggy).

What a plugin imports from core, all public: :data:`hookimpl` (hooks are specified in
:mod:`ejkernel.hookspecs`, with ``API_VERSION``), :func:`defvjp` (a forward/backward pair for an
implementation), :func:`deflse` and :func:`flash_attention_lse_step` (flash
attention's (out, lse) step, for ring attention), :class:`FwdParams` and :class:`BwdParams` (the tunables configs share),
:class:`Registry` (what ``ejkernel_register`` receives: :meth:`Registry.register`,
:meth:`Registry.register_module` with :func:`conventional_names`, :meth:`Registry.add_op`,
:meth:`Registry.add_platform`), the op contract in :mod:`ejkernel.specs`, the environment in
:mod:`ejkernel.env`, and the conformance kit in :mod:`ejkernel.testing`. A plugin never imports
``ejkernel._*`` modules: they change without notice.

Core loads entry points in its own loop, sorted by name, one failure isolated per plugin: a
plugin that fails to import, declares another API version, or raises while registering is
reported once as a :class:`~ejkernel.errors.PluginWarning` and skipped (its partial
registrations rolled back); every other plugin keeps working. Discovery runs once, on first use
of the registry (the first op call, ``explain``, ``ejkernel info``), so ``import ejkernel``
stays fast; it imports plugin modules only, which import nothing heavy.
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import attrs
import pluggy

from ejkernel import _env, hookspecs
from ejkernel._lse import FlashLseStep, deflse, flash_attention_lse_step
from ejkernel._params import BwdParams, FwdParams
from ejkernel._registry import Registry, conventional_names
from ejkernel.errors import PluginWarning, warn_once
from ejkernel.specs import builtin_ops, builtin_spec

__all__ = [
    "ENTRY_POINT_GROUP",
    "BwdParams",
    "FlashLseStep",
    "FwdParams",
    "PluginInfo",
    "Registry",
    "conventional_names",
    "deflse",
    "defvjp",
    "flash_attention_lse_step",
    "get_registry",
    "hookimpl",
    "plugin_infos",
    "register_plugin",
    "reset",
]

ENTRY_POINT_GROUP = "ejkernel.plugins"
PROJECT = "ejkernel"

hookimpl = pluggy.HookimplMarker(PROJECT)


@attrs.frozen(kw_only=True)
class PluginInfo:
    """What discovery did with one plugin (shown by ``ejkernel info``).

    Attributes:
        name: entry-point name (or the module name for :func:`register_plugin`).
        module: the module's import name.
        distribution: the distribution that declared it, with its version, if known.
        status: ``"loaded"``, ``"failed"``, ``"refused"`` or ``"disabled"``.
        error: the cause when not loaded.
    """

    name: str
    module: str
    distribution: str | None
    status: str
    error: str | None = None


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.registry: Registry | None = None
        self.loading: Registry | None = None  # while discovery runs (under ``lock``)
        self.pm: pluggy.PluginManager | None = None
        self.infos: dict[str, PluginInfo] = {}


_state = _State()


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def get_registry() -> Registry:
    """The process-wide registry, discovering plugins on first use.

    Other threads see it only once discovery has ended (they wait for it); a plugin's hook that
    asks for it during discovery gets the registry being filled.
    """
    reg = _state.registry
    if reg is not None:
        return reg
    with _state.lock:
        if _state.registry is not None:
            return _state.registry
        if _state.loading is not None:  # re-entered from a plugin's hook, on this thread
            return _state.loading
        _state.pm = _new_manager()
        registry = Registry(builtin_spec(name) for name in builtin_ops())
        _state.loading = registry
        try:
            if _env.plugins_autoload():
                _load_entry_points(registry)
        finally:
            _state.loading = None
        _state.registry = registry
        return registry


def plugin_infos() -> list[PluginInfo]:
    """Every plugin discovery saw, sorted by name."""
    get_registry()
    return [_state.infos[k] for k in sorted(_state.infos)]


def reset() -> None:
    """Forget the registry and plugins; the next use rediscovers (for tests and reloads).

    Memoised selections need no forgetting: the new registry's generation keys them anew.
    """
    with _state.lock:
        _state.registry = None
        _state.loading = None
        _state.pm = None
        _state.infos = {}


def register_plugin(module: ModuleType | object, name: str | None = None) -> str:
    """Register a plugin object by hand (as when ``EJKERNEL_PLUGINS_AUTOLOAD=0``).

    Args:
        module: a module (or any object) with ``@hookimpl`` functions.
        name: the plugin's name; default the module's ``__name__``.

    Returns:
        The name. Unlike discovery, a failing hand-registered plugin raises.
    """
    registry = get_registry()
    plugin_name = str(name or getattr(module, "__name__", type(module).__name__))
    with _state.lock:
        info = _activate(registry, plugin_name, module, distribution=None, raise_errors=True)
    if info.status != "loaded":
        raise RuntimeError(f"plugin {plugin_name!r} {info.status}: {info.error}")
    return plugin_name


def _load_entry_points(registry: Registry) -> None:
    disabled = _env.disabled_plugins()
    seen: set[str] = set()
    eps = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
    for ep in eps:
        if ep.name in seen:
            continue  # the same distribution on sys.path twice
        seen.add(ep.name)
        dist = _distribution_label(ep)
        if ep.name in disabled:
            _skipped(ep, dist, "disabled", f"disabled by {_env.DISABLE_PLUGINS}")
            continue
        try:
            module = ep.load()
        except Exception as err:
            cause = f"{type(err).__name__}: {err}"
            _skipped(ep, dist, "failed", f"import failed: {cause}")
            warn_once(
                PluginWarning,
                ep.name,
                f"ejkernel plugin {ep.name!r} ({ep.value}) failed to import and is skipped: {cause}",
            )
            continue
        _activate(registry, ep.name, module, distribution=dist, raise_errors=False)


def _skipped(
    ep: importlib.metadata.EntryPoint, distribution: str | None, status: str, error: str
) -> None:
    """Records an entry point that is not activated (disabled, or its import failed)."""
    _state.infos[ep.name] = PluginInfo(
        name=ep.name, module=ep.value, distribution=distribution, status=status, error=error
    )


def _distribution_label(ep: importlib.metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None
    return f"{dist.metadata['Name']} {dist.version}"


def _activate(
    registry: Registry, name: str, module: Any, *, distribution: str | None, raise_errors: bool
) -> PluginInfo:
    pm = _state.pm
    assert pm is not None
    module_name = getattr(module, "__name__", repr(module))
    version = (
        distribution.split(" ", 1)[1]
        if distribution and " " in distribution
        else _module_version(module)
    )

    def fail(status: str, cause: str) -> PluginInfo:
        info = PluginInfo(
            name=name, module=module_name, distribution=distribution, status=status, error=cause
        )
        _state.infos[name] = info
        if not raise_errors:
            warn_once(
                PluginWarning,
                name,
                f"ejkernel plugin {name!r} ({module_name}) {status} and is skipped: {cause}",
            )
        return info

    api = getattr(module, "ejkernel_api_version", None)
    if not callable(api):
        return fail(
            "refused",
            "it implements no `ejkernel_api_version` hook; plugins must declare the core API they target",
        )
    try:
        wanted = int(api())
    except Exception as err:
        return fail("failed", f"ejkernel_api_version() raised {type(err).__name__}: {err}")
    if wanted != hookspecs.API_VERSION:
        return fail(
            "refused",
            f"built for core plugin API {wanted}, this ejkernel-core speaks {hookspecs.API_VERSION}; "
            f"install a matching version of the plugin",
        )
    if pm.is_registered(module) or pm.get_plugin(name) is not None:
        return _state.infos.get(name) or PluginInfo(
            name=name, module=module_name, distribution=distribution, status="loaded"
        )
    try:
        pm.register(module, name=name)
    except Exception as err:  # pluggy validation: unknown hook names, bad signatures
        return fail("failed", f"invalid hooks: {type(err).__name__}: {err}")
    snapshot = registry._snapshot()
    registry._attribute_to(name, version)
    try:
        for hook_impl in pm.hook.ejkernel_register.get_hookimpls():
            if hook_impl.plugin is module:
                hook_impl.function(registry=registry)
    except Exception as err:
        registry._restore(snapshot)
        pm.unregister(module)
        if raise_errors:
            raise
        return fail("failed", f"registration raised {type(err).__name__}: {err}")
    finally:
        registry._attribute_to("<direct>", "0")
    info = PluginInfo(name=name, module=module_name, distribution=distribution, status="loaded")
    _state.infos[name] = info
    return info


def _module_version(module: Any) -> str:
    return str(getattr(module, "__version__", "0"))


def defvjp(
    fn: Callable[..., Any], fwd: Callable[..., Any], bwd: Callable[..., Any]
) -> Callable[..., Any]:
    """Attach a forward/backward pair to an implementation; the executor wires the custom VJP.

    Args:
        fn: the implementation, ``fn(**op_args, cfg=cfg) -> out`` (used when not differentiated).
        fwd: ``fwd(**op_args, cfg=cfg) -> (out, residuals)``; residuals are a pytree of arrays.
        bwd: ``bwd(residuals, d_out, **op_args_static, cfg=cfg) -> dict[name, gradient]`` for the
            op's differentiable arguments; a missing name or ``None`` means a zero gradient. The
            static arguments (not arrays) are passed as keywords.

    Returns:
        ``fn``, carrying ``fn.fwd`` and ``fn.bwd``.
    """
    fn.fwd = fwd  # type: ignore[attr-defined]
    fn.bwd = bwd  # type: ignore[attr-defined]
    return fn
