"""The environment variables ejkernel reads, and their readers: public, for plugins and users.

Every reader reads the environment at call time (never frozen at import), so a test or a
launcher may set a variable after ``import ejkernel``. The README's table of variables is
:data:`VARIABLES`.

Example (a plugin's availability probe)::

    from ejkernel import env

    def available(backend):
        if backend == "cpu" and not env.interpret():
            return f"set {env.INTERPRET}=1 to run these kernels on the CPU"
        return True
"""

from __future__ import annotations

from ejkernel._env import (
    AUTOTUNE_POLICY,
    CACHE_DIR,
    DISABLE_PLUGINS,
    INTERPRET,
    LOG_AUTOTUNE,
    OPS_RECORD,
    OPS_STAMP,
    PLATFORM,
    PLUGINS_AUTOLOAD,
    SHARED_MEMORY_LIMIT,
    SHIPPED,
    VARIABLES,
    autotune_policy,
    cache_dir,
    disabled_plugins,
    forced_platform,
    interpret,
    log_autotune,
    ops_record,
    ops_stamp,
    plugins_autoload,
    shared_memory_limit,
    shipped,
)

__all__ = [
    "AUTOTUNE_POLICY",
    "CACHE_DIR",
    "DISABLE_PLUGINS",
    "INTERPRET",
    "LOG_AUTOTUNE",
    "OPS_RECORD",
    "OPS_STAMP",
    "PLATFORM",
    "PLUGINS_AUTOLOAD",
    "SHARED_MEMORY_LIMIT",
    "SHIPPED",
    "VARIABLES",
    "autotune_policy",
    "cache_dir",
    "disabled_plugins",
    "forced_platform",
    "interpret",
    "log_autotune",
    "ops_record",
    "ops_stamp",
    "plugins_autoload",
    "shared_memory_limit",
    "shipped",
]
