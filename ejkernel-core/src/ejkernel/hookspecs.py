"""Hook specifications of the ``"ejkernel"`` pluggy project.

A plugin is a module named by an entry point of group ``ejkernel.plugins``; it implements these
hooks with :data:`ejkernel.plugins.hookimpl`. Hooks only grow: arguments may be added, never
renamed or removed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ejkernel._registry import Registry

hookspec = pluggy.HookspecMarker("ejkernel")

#: The core's plugin API major version. A plugin whose ``ejkernel_api_version()`` differs is
#: refused; plugins also declare ``Requires-Dist: ejkernel-core>=API_VERSION,<API_VERSION+1``.
API_VERSION = 1


@hookspec
def ejkernel_api_version() -> int:  # type: ignore[empty-body]
    """Return the core plugin API major version this plugin was built for.

    Called once per plugin at discovery, before :func:`ejkernel_register`. Required: a plugin
    that does not implement it, or returns another major version, is refused with a warning.

    Returns:
        An int, compared with :data:`API_VERSION`.
    """


@hookspec
def ejkernel_register(registry: Registry) -> None:
    """Register this plugin's ops, platforms and implementations.

    Called once per plugin at discovery, with the process-wide registry. Use
    ``registry.register(op, platform=, backend=, ...)(fn_or_"module:attr")``,
    ``registry.add_op(spec)`` and ``registry.add_platform(name, available=...)``. Import nothing
    heavy here: give implementations and probes as ``"module:attr"`` strings. If this hook
    raises, everything the plugin registered is rolled back and a ``PluginWarning`` names it.

    Args:
        registry: the :class:`ejkernel._registry.Registry`.

    Returns:
        Nothing.
    """


@hookspec(firstresult=True)
def ejkernel_build(platform: str, force: bool, check: bool, target: str | None) -> str | None:
    """Build the native code of ``platform`` ahead of time (``ejkernel build <platform>``).

    Optional (API version 1 is unchanged): only plugins that compile code on first use (the
    CUDA plugin's nvcc build) implement it. Called by the CLI, never during discovery; the
    first plugin that returns a result answers.

    Args:
        platform: the platform name asked for (lower case); a plugin that does not build it
            returns ``None``.
        force: rebuild even when a cached build (or a cached failure) exists.
        check: only report the state of the build (built, failed with the compiler's
            message, not built yet); build nothing.
        target: a platform-specific target (for CUDA a compute capability such as ``"90"``
            or ``"9.0"``), or ``None`` for this machine's device.

    Returns:
        ``None`` when this plugin does not build ``platform``; else a short report (what
        was built and where, or the state when ``check``). A failed build raises an
        exception whose message carries the compiler's output.
    """
