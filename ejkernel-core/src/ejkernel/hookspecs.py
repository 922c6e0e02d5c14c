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
