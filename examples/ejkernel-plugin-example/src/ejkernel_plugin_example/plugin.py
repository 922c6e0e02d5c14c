"""Entry point of the example plugin (``ejkernel.plugins: example``).

Core imports this module at discovery, so it imports nothing heavy: each implementation is
registered by module name with ``registry.register_module``, and core finds its pieces there
by convention on first use (``<op>_example``, and ``supports`` where the module declines
some calls). The new op's spec is an object (``registry.add_op`` needs it); its module
imports only JAX, which core has loaded.
"""

from __future__ import annotations

from typing import Any

from ejkernel.hookspecs import API_VERSION
from ejkernel.plugins import hookimpl

PLATFORM = "example"

#: Below the XLA plugin's 0: installing this plugin never changes what users get by default;
#: ``platform="example"`` (or ``EJKERNEL_PLATFORM=example``) selects it.
PRIORITY = -10


@hookimpl
def ejkernel_api_version() -> int:
    """The core plugin API this plugin was built for (core refuses another major)."""
    return API_VERSION


@hookimpl
def ejkernel_register(registry: Any) -> None:
    """Declare the platform, add the new op, register one implementation per op."""
    from ejkernel_plugin_example.specs.example_rms_norm import SPEC

    registry.add_platform(PLATFORM, distribution="ejkernel-plugin-example")
    registry.add_op(SPEC)
    for op in ("mean_pooling", "example_rms_norm"):
        registry.register_module(
            op,
            f"ejkernel_plugin_example.ops.{op}",
            platform=PLATFORM,
            backend="any",
            priority=PRIORITY,
        )
