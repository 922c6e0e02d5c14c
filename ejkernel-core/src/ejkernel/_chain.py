"""The config chain: override → overlay → memory → persistent → autotune → heuristics → error.

Every chosen config carries its provenance (``source``). An override applies to one call and is
never cached; a heuristic choice is remembered in memory but never blocks a later autotune;
persistent entries are copied into memory; tuned configs go to both caches.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import attrs

from ejkernel import _env
from ejkernel._cache import CacheEntry, ConfigCache, PersistentCache
from ejkernel._invocation import Invocation
from ejkernel.errors import ConfigError

__all__ = ["Choice", "ConfigSelectorChain", "Tunable", "overlay_cache", "policy_override"]

SOURCES = ("override", "overlay", "memory", "persistent", "autotune", "heuristic")

_overlays: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "ejkernel_overlays", default=()
)
_policy: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "ejkernel_policy", default=None
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


@contextlib.contextmanager
def policy_override(autotune: bool | None = None, *, policy: str | None = None) -> Iterator[None]:
    """Set the autotune policy inside this block (beats ``EJKERNEL_AUTOTUNE_POLICY``).

    Args:
        autotune: True → ``"autotune"``, False → ``"heuristics"``.
        policy: the policy by name (``"autotune"`` or ``"heuristics"``).
    """
    if policy is None:
        policy = None if autotune is None else ("autotune" if autotune else "heuristics")
    if policy not in (None, "autotune", "heuristics"):
        raise ValueError(f"policy must be 'autotune' or 'heuristics'; got {policy!r}")
    token = _policy.set(policy)
    try:
        yield
    finally:
        _policy.reset(token)


def current_policy(default_autotune: bool = True) -> str:
    policy = _policy.get()
    if policy is not None:
        return policy
    env = _env.autotune_policy()
    return env if default_autotune else "heuristics"


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
    """Chooses the config of one invocation through the seven tiers.

    Args:
        cache: the memory tier (a new :class:`ConfigCache` by default).
        persistent: the disk tier; ``None`` uses a :class:`PersistentCache` at the default
            location, ``False`` disables it.
        autotune: allow tier 5 (still subject to the policy: ``EJKERNEL_AUTOTUNE_POLICY`` and
            :func:`policy_override`).
    """

    def __init__(
        self,
        cache: ConfigCache | None = None,
        persistent: PersistentCache | bool | None = None,
        autotune: bool = True,
    ) -> None:
        self.cache = cache if cache is not None else ConfigCache()
        if persistent is None or persistent is True:
            self.persistent: PersistentCache | None = PersistentCache()
        elif persistent is False:
            self.persistent = None
        else:
            self.persistent = persistent
        self.autotune = autotune
        self._platform_choices: dict[str, str] | None = None

    def policy(self) -> str:
        return current_policy(self.autotune)

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
        entry = self.cache.entry(key)
        if entry is not None and not (
            entry.source == "heuristic" and policy == "autotune" and _can_tune(tunable, inv)
        ):
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
        heuristic = tunable.heuristic(inv) if tunable.heuristic is not None else None
        if policy == "autotune" and not peek and tunable.config_space is not None:
            configs = _dedupe(
                ([heuristic] if heuristic is not None else []) + list(tunable.config_space(inv))
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
        if heuristic is not None:
            if not peek:
                self.cache.put(key, heuristic, source="heuristic", meta={"created": time.time()})
            return Choice(config=heuristic, source="heuristic", key=key)
        raise ConfigError(
            f"{tunable.op}: no config for platform {tunable.platform!r}: nothing cached, autotuning "
            f"is {'off' if policy != 'autotune' else 'not possible (no config space)'} and the "
            f"implementation has no heuristic; pass cfg= explicitly"
        )


def _can_tune(tunable: Tunable, inv: Invocation) -> bool:
    return tunable.config_space is not None


def _dedupe(configs: list[Any]) -> list[Any]:
    out: list[Any] = []
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
