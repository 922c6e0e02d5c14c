"""The config chain: override → overlay → memory → persistent → shipped → autotune →
heuristics → error.

Every chosen config carries its provenance (``source``). An override applies to one call and is
never cached; a heuristic choice is remembered in memory but never blocks a later autotune;
persistent and shipped entries are copied into memory (a shipped hit is final, like a
persistent one: the first call of a shape a table covers runs its config without tuning); tuned
configs go to both caches. What the chain may do on a miss is the :class:`AutotunePolicy` in
force (:mod:`ejkernel._policy`).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import attrs

from ejkernel._cache import CacheEntry, ConfigCache, PersistentCache
from ejkernel._invocation import Invocation
from ejkernel._json import converter
from ejkernel._policy import AutotunePolicy, policy_override, resolve_policy
from ejkernel._registry import resolve
from ejkernel._shipped import ShippedIndex, ShippedTable, load_shipped_table, registry_index
from ejkernel.errors import ConfigError

__all__ = [
    "Choice",
    "ConfigSelectorChain",
    "Tunable",
    "overlay_cache",
    "policy_override",
    "unique_configs",
]

C = TypeVar("C")

SOURCES = ("override", "overlay", "memory", "persistent", "shipped", "autotune", "heuristic")

_overlays: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "ejkernel_overlays", default=()
)


class OverlayLayer(Protocol):
    """Anything with ``overlay_config(key, op, platform) -> cfg or None`` is an overlay layer."""

    def overlay_config(self, key: str, op: str, platform: str) -> Any: ...


@contextlib.contextmanager
def overlay_cache(cache: ConfigCache | Mapping[str, Any] | OverlayLayer) -> Iterator[None]:
    """Configs from ``cache`` win over the caches inside this block (thread- and task-safe).

    Args:
        cache: a :class:`ConfigCache`, an :class:`~ejkernel.ops.AutotuneResult`, or a mapping
            from invocation keys or op names (``{"flash_attention": cfg}``) to configs.
    """
    token = _overlays.set((*_overlays.get(), cache))
    try:
        yield
    finally:
        _overlays.reset(token)


def overlay_state() -> tuple[Any, ...]:
    return _overlays.get()


@attrs.frozen(kw_only=True)
class Tunable:
    """What the chain needs from an implementation.

    Attributes:
        op: op (or kernel) name, for overlay lookups by name.
        platform: its platform.
        version: enters the key.
        config_type: the config class (``None``: structure persistent entries into the type
            they were stored with).
        configless: the implementation takes no config (``cfg=None`` always).
        heuristic: ``heuristic(inv) -> cfg`` or None.
        config_space: ``config_space(inv) -> [cfg]`` or None.
        tune: ``tune(inv, configs) -> (best_cfg, timings)``, running the autotuner.
    """

    op: str
    platform: str
    version: str
    config_type: Any
    configless: bool
    heuristic: Callable[[Invocation], Any] | None
    config_space: Callable[[Invocation], list[Any]] | None
    tune: Callable[[Invocation, list[Any]], tuple[Any, dict[str, Any]]]


@attrs.frozen(kw_only=True)
class Choice:
    """A config and where it came from (one of :data:`SOURCES`), with the cache key."""

    config: Any
    source: str
    key: str
    origin: str | None = None  # for memory/persistent hits: how the entry was first made


class ConfigSelectorChain:
    """Chooses the config of one invocation through the eight tiers (:data:`SOURCES`, then an
    error).

    Args:
        cache: the memory tier (a new :class:`ConfigCache` by default).
        persistent: the disk tier; ``None`` uses a :class:`PersistentCache` at the default
            location, ``False`` disables it.
        autotune: allow the autotune tier (still subject to the policy:
            ``EJKERNEL_AUTOTUNE_POLICY``, ``policy=`` and :func:`policy_override`).
        policy: this chain's :class:`AutotunePolicy` (default: ``EJKERNEL_AUTOTUNE_POLICY``'s);
            :func:`policy_override` and :func:`forward_autotune_only` still apply on top.
        shipped: the shipped tier's tables: ``None`` those the plugins declare, ``False``
            none, or table files (or :class:`ShippedTable` objects) to use instead, read now
            (a file that is not a table raises ``ValueError``).
    """

    def __init__(
        self,
        cache: ConfigCache | None = None,
        persistent: PersistentCache | bool | None = None,
        autotune: bool = True,
        *,
        policy: AutotunePolicy | None = None,
        shipped: bool | Sequence[str | os.PathLike[str] | ShippedTable] | None = None,
    ) -> None:
        self.cache = cache if cache is not None else ConfigCache()
        if persistent is None or persistent is True:
            self.persistent: PersistentCache | None = PersistentCache()
        elif persistent is False:
            self.persistent = None
        else:
            self.persistent = persistent
        if policy is not None and not isinstance(policy, AutotunePolicy):
            raise TypeError(
                f"policy must be an AutotunePolicy or None; got {type(policy).__name__}"
            )
        self.autotune = autotune
        self.autotune_policy = policy
        self._shipped_declared = shipped is None or shipped is True
        self._shipped_own: ShippedIndex | None = None
        if shipped is not None and not isinstance(shipped, bool):
            if isinstance(shipped, (str, os.PathLike, ShippedTable)):
                shipped = [shipped]
            self._shipped_own = ShippedIndex(
                [t if isinstance(t, ShippedTable) else load_shipped_table(t) for t in shipped]
            )
        self._platform_choices: dict[str, str] | None = None

    def policy(self) -> AutotunePolicy:
        """The :class:`AutotunePolicy` in force for a call made now (hashable: memos key on it)."""
        return resolve_policy(self.autotune_policy, self.autotune, self)

    # -- shipped tables (tier 5, selection step 4) --------------------------------------------
    def shipped_index(self) -> ShippedIndex | None:
        """The shipped tables this chain consults, indexed (``None``: none)."""
        return registry_index() if self._shipped_declared else self._shipped_own

    def shipped_platform(self, inv: Invocation, runnable: Sequence[str]) -> tuple[str, str] | None:
        """The fastest of the ``runnable`` platforms by a shipped table, and that table's name
        (``None`` when no table covers the call, or the policy does not use them)."""
        if not self.policy().use_shipped:
            return None
        index = self.shipped_index()
        return index.fastest_platform(inv, runnable) if index else None

    def _shipped_config(self, tunable: Tunable, inv: Invocation) -> tuple[Any, Any] | None:
        """The first matching shipped config that structures into the implementation's config
        class (a bucket match only if the implementation could pick it for this call)."""
        index = self.shipped_index()
        if not index:
            return None
        for match in index.lookup(inv, tunable.platform, tunable.version):
            try:
                cls = tunable.config_type or resolve(str(match.entry.get("config_type")))
                cfg = converter.structure(match.entry["config"], cls)
            except Exception:  # stale: the config class changed since the table was made
                continue
            if match.exact or _could_pick(tunable, inv, cfg):
                return cfg, match
        return None

    # -- cross-platform choices (selection step 3) --------------------------------------------
    def _choice_key(self, inv: Invocation) -> str:
        return inv.cache_key(platform="<choice>", version="0")

    def _choices(self) -> dict[str, str]:
        if self._platform_choices is None:
            self._platform_choices = {}
            if self.persistent is not None:
                for key, raw in self.persistent.entries().items():
                    if raw.get("source") == "platform-choice" and isinstance(
                        raw.get("config"), str
                    ):
                        self._platform_choices[key] = raw["config"]
        return self._platform_choices

    def platform_choice(self, inv: Invocation) -> str | None:
        """The platform cross-platform autotuning chose for this invocation, if any."""
        choices = self._choices()
        return choices.get(self._choice_key(inv)) if choices else None

    def remember_platform(
        self, inv: Invocation, platform: str, timings: Mapping[str, float]
    ) -> None:
        """Record a cross-platform choice in memory and on disk."""
        key = self._choice_key(inv)
        self._choices()[key] = platform
        if self.persistent is not None:
            meta = {
                "key": inv.key_document(platform="<choice>", version="0"),
                "timings_ms": dict(timings),
            }
            self.persistent.put(key, platform, source="platform-choice", meta=meta)

    def choose(
        self, tunable: Tunable, inv: Invocation, *, override: Any = None, peek: bool = False
    ) -> Choice:
        """Run the chain. With ``peek`` (``explain``), nothing is tuned or stored."""
        key = inv.cache_key(platform=tunable.platform, version=tunable.version)
        if override is not None:
            return Choice(config=override, source="override", key=key)
        if tunable.configless:
            return Choice(config=None, source="heuristic", key=key)
        for layer in reversed(_overlays.get()):
            cfg = _overlay_lookup(layer, key, tunable.op, tunable.platform)
            if cfg is not None:
                return Choice(config=cfg, source="overlay", key=key)
        policy = self.policy()
        tunes = policy.tunes and _can_tune(tunable, inv)
        entry = self.cache.entry(key)
        if entry is not None and _usable(entry.source, policy, tunes):
            return Choice(config=entry.config, source="memory", key=key, origin=entry.source)
        if self.persistent is not None:
            pentry = self.persistent.entry(key, tunable.config_type)
            if pentry is not None:
                if not peek:
                    self.cache.put(
                        key, pentry.config, source=pentry.source, meta={"from": "persistent"}
                    )
                return Choice(
                    config=pentry.config, source="persistent", key=key, origin=pentry.source
                )
        shipped = self._shipped_config(tunable, inv) if policy.use_shipped else None
        if shipped is not None:
            cfg, match = shipped
            if not peek:
                meta = {"table": match.table, "exact": match.exact, "key": match.entry["key"]}
                self.cache.put(key, cfg, source="shipped", meta=meta)
            return Choice(config=cfg, source="shipped", key=key, origin=match.table)
        if inv.grad and not policy.autotune_backward:
            fwd = self.choose(tunable, _undifferentiated(inv), peek=peek)
            return Choice(config=fwd.config, source=fwd.source, key=key, origin="forward")
        heuristic = tunable.heuristic(inv) if tunable.heuristic is not None else None
        space = tunable.config_space
        if tunes and not peek and space is not None:
            configs = unique_configs(
                ([heuristic] if heuristic is not None else []) + list(space(inv))
            )
            if len(configs) > 1:
                best, timings = tunable.tune(inv, configs)
                meta = {
                    "key": inv.key_document(platform=tunable.platform, version=tunable.version),
                    "timings_ms": timings,
                }
                self.cache.put(key, best, source="autotune", meta=meta)
                if self.persistent is not None:
                    self.persistent.put(key, best, source="autotune", meta=meta)
                return Choice(config=best, source="autotune", key=key)
        if heuristic is not None and policy.allow_heuristics:
            if not peek and entry is None:  # never over a better entry the policy skipped
                self.cache.put(key, heuristic, source="heuristic", meta={"created": time.time()})
            return Choice(config=heuristic, source="heuristic", key=key)
        if heuristic is not None:
            why = "heuristics are off (AutotunePolicy(allow_heuristics=False))"
        else:
            why = "the implementation has no heuristic"
        raise ConfigError(
            f"{tunable.op}: no config for platform {tunable.platform!r}: nothing cached, autotuning "
            f"is {'off' if not policy.tunes else 'not possible (no config space)'} and {why}; "
            f"pass cfg= explicitly"
        )


def _can_tune(tunable: Tunable, inv: Invocation) -> bool:
    return tunable.config_space is not None


def _usable(source: str, policy: AutotunePolicy, tunes: bool) -> bool:
    """Whether a memory entry made by ``source`` answers under ``policy``: a heuristic's never
    blocks tuning (nor answers when heuristics are off), a shipped one only while tables are
    used."""
    if source == "heuristic":
        return not tunes and policy.allow_heuristics
    if source == "shipped":
        return policy.use_shipped
    return True


def _could_pick(tunable: Tunable, inv: Invocation, cfg: Any) -> bool:
    """Whether the implementation could choose ``cfg`` for ``inv``: its heuristic or one of its
    candidates."""
    try:
        if tunable.heuristic is not None and tunable.heuristic(inv) == cfg:
            return True
        return tunable.config_space is not None and cfg in list(tunable.config_space(inv))
    except Exception:
        return False


def _undifferentiated(inv: Invocation) -> Invocation:
    return attrs.evolve(inv, metadata={**inv.metadata, "grad": False})


def unique_configs(configs: Iterable[C]) -> list[C]:
    """``configs`` in order, each once (by ``==``, so unhashable configs too): how the chain
    reads a config space (the heuristic's config first), and how a plugin can build one.

    Example (a plugin's config space)::

        from ejkernel.ops import unique_configs

        def config_space(inv):
            return unique_configs([heuristic(inv), *CANDIDATES])
    """
    out: list[C] = []
    for c in configs:
        if c not in out:
            out.append(c)
    return out


def _overlay_lookup(layer: Any, key: str, op: str, platform: str) -> Any:
    lookup = getattr(layer, "overlay_config", None)  # AutotuneResult and other layers
    if callable(lookup):
        return lookup(key, op, platform)
    if isinstance(layer, ConfigCache):
        return layer.get(key)
    if isinstance(layer, Mapping):
        for k in (key, f"{op}/{platform}", op):
            if k in layer:
                value = layer[k]
                return value.config if isinstance(value, CacheEntry) else value
    return None
