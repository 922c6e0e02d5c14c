"""What batch tuning returns: the tuned configs of many invocations, as one object.

An :class:`AutotuneResult` holds, per tuned invocation and platform, the chosen config, every
candidate's time and the cache key; and, where platforms were compared, the fastest platform
per invocation. It is applied in four ways: as an overlay (``with result:``,
``overlay_cache(result)``), into an executor's memory cache (:meth:`AutotuneResult.apply`),
into a persistent cache (:meth:`AutotuneResult.save`), or written to a file in the persistent
cache's export format (:meth:`AutotuneResult.export`), which ``ejkernel cache import`` merges
and :meth:`AutotuneResult.load` reads back.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from ejkernel._cache import (
    PersistentCache,
    make_entry,
    read_export,
    structure_entry,
    write_export,
)

__all__ = ["AutotuneResult", "PlatformChoice", "TuneFailure", "TunedConfig"]

#: The ``source`` of tuned entries and of cross-platform choices in the persistent cache.
TUNED_SOURCE = "autotune"
CHOICE_SOURCE = "platform-choice"


@attrs.frozen(kw_only=True)
class TunedConfig:
    """The tuned config of one invocation on one platform.

    Attributes:
        key: the invocation's cache key (what the config chain looks up).
        op: the op (or user kernel) name.
        platform: the platform it was tuned for.
        grad: tuned on forward+backward (the differentiated call's key).
        config: the fastest config.
        timings_ms: milliseconds per candidate (its ``stable_json`` label), failures omitted.
        document: the key document (op, platform, version, grad, invocation, device).
    """

    key: str
    op: str
    platform: str
    grad: bool
    config: Any
    timings_ms: Mapping[str, float] = attrs.field(factory=dict)
    document: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def best_ms(self) -> float | None:
        """The chosen config's time (None for an entry loaded without timings)."""
        return min(self.timings_ms.values()) if self.timings_ms else None


@attrs.frozen(kw_only=True)
class PlatformChoice:
    """The fastest platform of one invocation, where several were compared.

    Attributes:
        key: the cross-platform choice key (selection step 3).
        op: the op name.
        platform: the fastest platform.
        timings_ms: each platform's time with its best config.
        document: the key document.
    """

    key: str
    op: str
    platform: str
    timings_ms: Mapping[str, float] = attrs.field(factory=dict)
    document: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class TuneFailure:
    """A candidate (``config`` set) or a whole invocation (``config`` None) that failed.

    Attributes:
        op: the op (or user kernel) name.
        platform: the platform, if one was reached.
        config: the candidate's label, or None when the invocation as a whole was skipped.
        stage: ``"record"`` (could not be prepared), ``"compile"``, ``"run"``,
            ``"wrong result"`` (disagreed with the first candidate) or ``"all failed"``.
        error: the error's type and message.
    """

    op: str
    platform: str | None
    config: str | None
    stage: str
    error: str

    def __str__(self) -> str:
        where = "/".join(x for x in (self.op, self.platform) if x)
        what = f" candidate {self.config}" if self.config is not None else ""
        return f"{where}{what}: {self.stage}: {self.error}"


class AutotuneResult:
    """Tuned configs of a batch of invocations (returned by
    :func:`~ejkernel.ops.autotune_recorded`).

    Iterating yields a :class:`TunedConfig` per tuned invocation and platform; ``len(result)``
    counts them; ``result[key]`` and ``key in result`` look one up by cache key. ``failures``
    lists the candidates and invocations that failed (:class:`TuneFailure`); ``platforms``
    the fastest platform per invocation where several were compared (:class:`PlatformChoice`).

    Use it as an overlay (``with result: ...`` or ``overlay_cache(result)``): inside the
    block, its configs win over every cache for the invocations it tuned.
    """

    def __init__(
        self,
        configs: list[TunedConfig] | None = None,
        *,
        platforms: list[PlatformChoice] | None = None,
        failures: list[TuneFailure] | None = None,
    ) -> None:
        self._configs: dict[str, TunedConfig] = {c.key: c for c in configs or []}
        self.platforms: dict[str, PlatformChoice] = {p.key: p for p in platforms or []}
        self.failures: list[TuneFailure] = list(failures or [])
        # the overlays this result entered, per context (thread, task): `with result:` nests
        self._entered: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
            f"ejkernel_result_{id(self)}", default=()
        )

    # -- a collection of tuned configs ------------------------------------------------------
    def __iter__(self) -> Iterator[TunedConfig]:
        return iter(list(self._configs.values()))

    def __len__(self) -> int:
        return len(self._configs)

    def __contains__(self, key: object) -> bool:
        return key in self._configs

    def __getitem__(self, key: str) -> TunedConfig:
        return self._configs[key]

    def get(self, key: str, default: Any = None) -> TunedConfig | Any:
        return self._configs.get(key, default)

    def keys(self) -> list[str]:
        return list(self._configs)

    def __repr__(self) -> str:
        return (
            f"AutotuneResult({len(self)} configs, {len(self.platforms)} platform choices, "
            f"{len(self.failures)} failures)"
        )

    # -- as an overlay ----------------------------------------------------------------------
    def overlay_config(self, key: str, op: str, platform: str) -> Any:
        """The config for an invocation key (the overlay tier's lookup); None if not tuned."""
        tuned = self._configs.get(key)
        return None if tuned is None else tuned.config

    def __enter__(self) -> AutotuneResult:
        from ejkernel._chain import overlay_cache

        overlay = overlay_cache(self)
        overlay.__enter__()
        self._entered.set((*self._entered.get(), overlay))
        return self

    def __exit__(self, *exc: object) -> None:
        *outer, overlay = self._entered.get()
        self._entered.set(tuple(outer))
        overlay.__exit__(None, None, None)

    # -- into caches ------------------------------------------------------------------------
    def entries(self) -> dict[str, dict[str, Any]]:
        """Every entry as the persistent cache stores it (configs and platform choices)."""
        out: dict[str, dict[str, Any]] = {}
        for c in self._configs.values():
            meta = {"key": dict(c.document), "timings_ms": dict(c.timings_ms)}
            out[c.key] = make_entry(c.config, source=TUNED_SOURCE, meta=meta)
        for p in self.platforms.values():
            meta = {"key": dict(p.document), "timings_ms": dict(p.timings_ms)}
            out[p.key] = make_entry(p.platform, source=CHOICE_SOURCE, meta=meta)
        return out

    def apply(self, executor: Any = None) -> None:
        """Put the configs (and platform choices) into ``executor``'s memory cache, so later
        calls in this process use them (default: the process-wide executor)."""
        from ejkernel._executor import default_executor

        selector = (executor or default_executor()).selector
        for c in self._configs.values():
            meta = {"key": dict(c.document), "timings_ms": dict(c.timings_ms)}
            selector.cache.put(c.key, c.config, source=TUNED_SOURCE, meta=meta)
        if self.platforms:
            choices = selector._choices()
            for p in self.platforms.values():
                choices[p.key] = p.platform

    def save(self, persistent: PersistentCache | None = None) -> int:
        """Write every entry to ``persistent`` (default: the process-wide executor's persistent
        cache) in one locked update; returns the count written.

        Raises:
            ValueError: no persistent cache given and the default executor has none.
        """
        if persistent is None:
            from ejkernel._executor import default_executor

            persistent = default_executor().selector.persistent
            if persistent is None:
                raise ValueError(
                    "AutotuneResult.save: the default executor has no persistent cache; pass "
                    "`persistent`"
                )
        return persistent.merge(self.entries())

    # -- files ------------------------------------------------------------------------------
    def export(self, path: str | os.PathLike[str]) -> int:
        """Write the entries to ``path`` in :meth:`PersistentCache.export`'s format
        (``ejkernel cache import`` merges it); returns the count."""
        return write_export(path, self.entries())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AutotuneResult:
        """Read a file :meth:`export` (or ``ejkernel cache export``) wrote.

        Tuned entries and platform choices are read; other entries (heuristic choices) and
        entries whose config class cannot be found here are left out. A config is structured
        into the class of the registered implementation its key names (as the chain reads
        persistent entries), else into the class it was stored with.

        Raises:
            ValueError: not such a file.
        """
        entries = read_export(path, "load")
        configs: list[TunedConfig] = []
        platforms: list[PlatformChoice] = []
        for key, raw in entries.items():
            if not isinstance(raw, dict) or "config" not in raw:
                continue
            document = raw.get("key") if isinstance(raw.get("key"), dict) else {}
            timings = raw.get("timings_ms") if isinstance(raw.get("timings_ms"), dict) else {}
            op = str(document.get("op", "?"))
            if raw.get("source") == CHOICE_SOURCE and isinstance(raw["config"], str):
                platforms.append(
                    PlatformChoice(
                        key=key,
                        op=op,
                        platform=raw["config"],
                        timings_ms=timings,
                        document=document,
                    )
                )
                continue
            if raw.get("source") != TUNED_SOURCE:
                continue
            try:
                config = structure_entry(raw, _config_class(document))
            except Exception:  # a config class this process cannot import
                continue
            configs.append(
                TunedConfig(
                    key=key,
                    op=op,
                    platform=str(document.get("platform", "?")),
                    grad=bool(document.get("grad", False)),
                    config=config,
                    timings_ms=timings,
                    document=document,
                )
            )
        return cls(configs, platforms=platforms)


def _config_class(document: Mapping[str, Any]) -> Any:
    """The config class of the registered implementation the key document names (what the
    chain structures persistent entries into), else None (the stored class is imported)."""
    from ejkernel.plugins import get_registry

    registry = get_registry()
    op, platform = document.get("op"), document.get("platform")
    if op not in registry.ops():
        return None
    for impl in registry.implementations(str(op)):
        if impl.platform == platform:
            return impl.config_type
    return None
