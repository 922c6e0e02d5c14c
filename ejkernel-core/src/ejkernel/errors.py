"""ejkernel's errors and warnings.

Each error also subclasses the builtin a user would catch; each warning category is emitted once
per process per culprit (see :func:`warn_once`).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping

__all__ = [
    "AutotuneWarning",
    "CacheWarning",
    "ConfigError",
    "EjkernelError",
    "FallbackWarning",
    "NoImplementationError",
    "PluginWarning",
    "warn_once",
]


class EjkernelError(Exception):
    """Base of every error ejkernel raises on its own behalf."""


class NoImplementationError(EjkernelError, RuntimeError):
    """No installed implementation can run this call.

    Attributes:
        op: the op name.
        rejected: implementation (``"op/platform"``) -> why it was rejected.
    """

    def __init__(self, message: str, *, op: str, rejected: Mapping[str, str]):
        super().__init__(message)
        self.op = op
        self.rejected = dict(rejected)


class ConfigError(EjkernelError, ValueError):
    """No config could be chosen (last tier of the chain), or a given config does not fit."""


class PluginWarning(UserWarning):
    """A plugin failed to import or register, or was refused; it is skipped."""


class FallbackWarning(PluginWarning):
    """An implementation chosen without a forced platform failed while traced; the call ran on
    the next runnable platform (a :class:`PluginWarning`, so filters of plugin trouble see it)."""


class CacheWarning(UserWarning):
    """A cache file or folder could not be read or written; ejkernel goes on without it."""


class AutotuneWarning(UserWarning):
    """An autotune candidate failed and was dropped."""


_seen: set[tuple[type[Warning], str]] = set()
_seen_lock = threading.Lock()


def warn_once(category: type[Warning], culprit: str, message: str, stacklevel: int = 3) -> None:
    """Emit ``message`` once per process for ``(category, culprit)``."""
    with _seen_lock:
        if (category, culprit) in _seen:
            return
        _seen.add((category, culprit))
    warnings.warn(message, category, stacklevel=stacklevel)


def _reset_warnings_for_tests() -> None:
    with _seen_lock:
        _seen.clear()
