"""Environment variables ejkernel reads, each read at call time (never frozen at import).

The README's table of variables is generated from :data:`VARIABLES`; a test keeps them equal.
The public face of this module, for plugins and users, is :mod:`ejkernel.env`.
"""

from __future__ import annotations

import os
from pathlib import Path

AUTOTUNE_POLICY = "EJKERNEL_AUTOTUNE_POLICY"
LOG_AUTOTUNE = "EJKERNEL_LOG_AUTOTUNE"
CACHE_DIR = "EJKERNEL_CACHE_DIR"
PLATFORM = "EJKERNEL_PLATFORM"
DISABLE_PLUGINS = "EJKERNEL_DISABLE_PLUGINS"
PLUGINS_AUTOLOAD = "EJKERNEL_PLUGINS_AUTOLOAD"
OPS_STAMP = "EJKERNEL_OPS_STAMP"
OPS_RECORD = "EJKERNEL_OPS_RECORD"
INTERPRET = "EJKERNEL_INTERPRET"
SHIPPED = "EJKERNEL_SHIPPED"
SHARED_MEMORY_LIMIT = "EJKERNEL_SHARED_MEMORY_LIMIT"

#: name -> (default, meaning); the README table mirrors this mapping.
VARIABLES: dict[str, tuple[str, str]] = {
    AUTOTUNE_POLICY: (
        "autotune",
        "`autotune`: tune configs missing from the caches (once per shape and device; results "
        "persist); `heuristics`: never tune, use each implementation's heuristic (an explicit "
        "`cfg=` is always honoured)",
    ),
    SHIPPED: (
        "1",
        "`0` ignores the plugins' shipped tables of tuned configs and fastest platforms (the "
        "config chain's `shipped` tier and selection by table), e.g. to measure tuning",
    ),
    LOG_AUTOTUNE: ("0", "`1` logs every autotune candidate and its time at INFO level"),
    CACHE_DIR: (
        "`$XDG_CACHE_HOME/ejkernel` or `~/.cache/ejkernel`",
        "folder of the persistent config cache",
    ),
    PLATFORM: (
        "",
        "force a platform (`xla`, `triton`, ...) for every op; an error if it cannot run",
    ),
    DISABLE_PLUGINS: ("", "comma-separated entry-point names of plugins to skip"),
    PLUGINS_AUTOLOAD: ("1", "`0` skips entry-point discovery (add plugins with `register_plugin`)"),
    INTERPRET: (
        "0",
        "`1` runs Triton and Pallas kernels on the CPU through their interpreters (slow; for "
        "tests and debugging without the hardware)",
    ),
    SHARED_MEMORY_LIMIT: (
        "the device's",
        "bytes of shared memory a GPU kernel block may use, by which config spaces drop "
        "candidates before compiling (`ejkernel.ops.shared_memory_limit`); `none` or `0`: "
        "no limit, nothing dropped",
    ),
    OPS_STAMP: (
        "none",
        "`hash` or `json` runs every traced op call (under `jit`, `grad`, ...) in a named scope "
        "`ejkernel:op=...` carrying the op, the platform and the config (its cache key, or the "
        "config as JSON), seen in profiles and HLO metadata "
        "(`ejkernel.ops.find_labels_in_lowered`); `none` stamps nothing",
    ),
    OPS_RECORD: (
        "0",
        "`1` records every op call (abstract arguments, deduplicated) for "
        "`ejkernel.ops.get_invocations()` and batch tuning",
    ),
}


def _get(name: str) -> str:
    return os.environ.get(name, "").strip()


def autotune_policy() -> str:
    """`"autotune"` (the default, as in the seeds) or `"heuristics"`; anything else raises."""
    value = _get(AUTOTUNE_POLICY).lower() or "autotune"
    if value not in ("autotune", "heuristics"):
        raise ValueError(f"{AUTOTUNE_POLICY} must be 'autotune' or 'heuristics'; got {value!r}")
    return value


def shipped() -> bool:
    """Whether the plugins' shipped tables are consulted (``EJKERNEL_SHIPPED``, default on)."""
    return _get(SHIPPED).lower() not in ("0", "false", "no", "off")


def log_autotune() -> bool:
    """Whether every autotune candidate and its time is logged at INFO level."""
    return _get(LOG_AUTOTUNE).lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """The persistent cache folder (plugins keep their own caches in subfolders of it)."""
    explicit = _get(CACHE_DIR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = _get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ejkernel"


def forced_platform() -> str | None:
    """The platform ``EJKERNEL_PLATFORM`` forces for every op, lower-cased, or ``None``."""
    return _get(PLATFORM).lower() or None


def disabled_plugins() -> frozenset[str]:
    """Entry-point names of the plugins ``EJKERNEL_DISABLE_PLUGINS`` skips."""
    return frozenset(p.strip() for p in _get(DISABLE_PLUGINS).split(",") if p.strip())


def interpret() -> bool:
    """Whether kernel backends should run their kernels through an interpreter on the CPU."""
    return _get(INTERPRET).lower() in ("1", "true", "yes", "on")


def ops_stamp() -> str:
    """``"hash"``, ``"json"`` or ``"none"`` (the default): how op calls are stamped in HLO."""
    value = _get(OPS_STAMP).lower() or "none"
    if value not in ("hash", "json", "none"):
        raise ValueError(f"{OPS_STAMP} must be 'hash', 'json' or 'none'; got {value!r}")
    return value


def ops_record() -> bool:
    """Whether every op call is recorded (``EJKERNEL_OPS_RECORD=1``)."""
    return _get(OPS_RECORD).lower() in ("1", "true", "yes", "on")


def plugins_autoload() -> bool:
    """Whether plugins are discovered through entry points (``EJKERNEL_PLUGINS_AUTOLOAD``)."""
    return _get(PLUGINS_AUTOLOAD).lower() not in ("0", "false", "no", "off")


def shared_memory_limit() -> int | None:
    """The bytes ``EJKERNEL_SHARED_MEMORY_LIMIT`` sets; 0 for ``none`` or ``0`` (no limit);
    ``None`` when unset (the device's limit holds)."""
    value = _get(SHARED_MEMORY_LIMIT).lower()
    if not value:
        return None
    if value in ("none", "0"):
        return 0
    try:
        limit = int(value)
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(
            f"{SHARED_MEMORY_LIMIT} must be a number of bytes or 'none'; got {value!r}"
        )
    return limit
