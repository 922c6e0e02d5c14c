"""In-process memos: one policy for every shortcut the executor takes.

A memo remembers a value that is a pure function of its key, so a hit never changes what a
call does. The config chain's tiers (memory, persistent, ...) are the caches in the DESIGN.md
sense; a memo only skips recomputing what selection and the chain would give again.

What is memoised, keyed by what:

- **selection** (:mod:`ejkernel._selection`): the runnable implementations of an invocation
  and the reasons for the rest, keyed by :func:`call_key`;
- **eager dispatch** (per :class:`~ejkernel.ops.Executor`): the implementation and config of
  an eager call made without ``cfg=`` or an overlay, keyed by :func:`call_key` plus the
  ``platform=`` argument, the autotune policy and the memory cache's version (a config the
  chain put into the memory tier bumps it);
- **tunables** (per executor): what the chain needs from an implementation, keyed by the
  implementation object (a new registration is a new object);
- **cache keys** (:meth:`~ejkernel.ops.Invocation.cache_key`): the hash of an invocation's key
  document, keyed by op, platform, version, grad, device fingerprint and fast signature.

:func:`call_key` holds everything selection reads: the op, the invocation's fast signature
(shapes, dtypes, shardings, static values), the backend, the registry's generation (bumped by
every registration, plugin load and reset) and the environment selection depends on
(:data:`SELECTION_VARIABLES`: a forced platform, and the interpreter mode that availability
probes read). So nothing is invalidated by hand: a changed registry or environment makes new
keys, and the old entries are never hit again. ``supports()`` and availability probes are
therefore functions of the invocation, the backend and those variables. Every memo is bounded
(:data:`LIMIT` entries) and cleared when full.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

from ejkernel import _env

__all__ = ["LIMIT", "SELECTION_VARIABLES", "Memo", "call_key", "environment"]

#: The most entries one memo holds before it is cleared.
LIMIT = 4096

#: The environment variables selection reads (read on every call: keep this short).
SELECTION_VARIABLES = (_env.PLATFORM, _env.INTERPRET)

V = TypeVar("V")


class Memo(Generic[V]):
    """A bounded, thread-safe mapping from hashable keys to memoised values."""

    def __init__(self, limit: int = LIMIT) -> None:
        self._limit = limit
        self._data: dict[Hashable, V] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        return self._data.get(key)

    def put(self, key: Hashable, value: V) -> V:
        with self._lock:
            if len(self._data) >= self._limit:
                self._data.clear()
            self._data[key] = value
        return value

    def __len__(self) -> int:
        return len(self._data)


def environment() -> tuple[str | None, ...]:
    """The values of :data:`SELECTION_VARIABLES`, in its order."""
    get = os.environ.get
    return (get(_env.PLATFORM), get(_env.INTERPRET))


def call_key(op: str, fast: Hashable, backend: str, generation: int) -> tuple[Any, ...]:
    """The key part every memo of a call shares: op, fast signature, backend, registry
    generation and environment."""
    return (op, fast, backend, generation, environment())
