"""Selection: which implementation runs an invocation, and why the others cannot (DESIGN.md).

For an invocation of op X on the default device's backend B:

1. candidates: the implementations of X for B (or ``any``) whose platform is available here
   and whose ``supports(inv)`` is True (no ``supports``: every valid call);
2. a forced platform wins (``platform=``, a config's ``platform`` field, or
   ``EJKERNEL_PLATFORM``); if it cannot run the call, the error gives its reasons;
3. else a platform cross-platform autotuning chose for this invocation;
4. else the fastest runnable platform a shipped table names for this device and shape bucket
   (:meth:`ejkernel.ops.ConfigSelectorChain.shipped_platform`);
5. else the highest priority.

When no platform is forced, an implementation that raises while it is traced (or, called
eagerly, run) is rejected for that invocation (:func:`reject_failed`): the executor warns once
and selects again; later calls of the same invocation key skip it, and its reason shows in
:attr:`Selection.rejected`. The last runnable candidate is never rejected this way: its error
propagates as it is.

No candidate: :class:`~ejkernel.errors.NoImplementationError` listing, per installed
implementation, why it was rejected, and which distribution to install. Step 1 is memoised by
:func:`ejkernel._memo.call_key` (the memo policy is in :mod:`ejkernel._memo`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ejkernel import _env
from ejkernel._chain import ConfigSelectorChain
from ejkernel._invocation import Invocation, current_backend
from ejkernel._memo import Memo, call_key
from ejkernel._registry import KNOWN_DISTRIBUTIONS, Implementation, Registry
from ejkernel.errors import FallbackWarning, NoImplementationError, warn_once
from ejkernel.plugins import get_registry
from ejkernel.specs import OpSpec

__all__ = [
    "Selection",
    "check_platform_argument",
    "preferred_platform",
    "reject_failed",
    "runnable",
    "select_implementation",
]


@attrs.frozen(kw_only=True)
class Selection:
    """What the executor chose for one call, and why (returned by :func:`ejkernel.explain`).

    Attributes:
        op: the op name.
        platform: the selected platform.
        implementation: ``module:qualname`` of the selected implementation.
        reason: why this platform (argument, environment, cached choice, shipped table,
            priority).
        config: the config it would run with.
        source: tier that gave the config: override, overlay, memory, persistent, shipped,
            autotune, heuristic.
        origin: for memory/persistent hits, how that entry was first made; for shipped ones,
            the table.
        key: the invocation cache key.
        rejected: implementation (platform) -> why it cannot run this call.
    """

    op: str
    platform: str
    implementation: str
    reason: str
    config: Any
    source: str
    origin: str | None
    key: str
    rejected: Mapping[str, str]

    def __str__(self) -> str:
        origin = (
            f" (first made by {self.origin})" if self.origin and self.origin != self.source else ""
        )
        if self.source == "shipped":
            origin = f" table {self.origin}"
        lines = [
            f"{self.op}: platform {self.platform!r} ({self.reason}) -> {self.implementation}",
            f"  config {self.config!r}",
            f"  from {self.source}{origin}; key {self.key[:12]}",
        ]
        lines += [f"  rejected {name}: {why}" for name, why in self.rejected.items()]
        return "\n".join(lines)


#: Step 1 per call: (candidates, rejected), keyed by :func:`ejkernel._memo.call_key`.
_runnable_memo: Memo[tuple[list[Implementation], dict[str, str]]] = Memo()

#: Implementations that failed while traced, per call: label -> reason, keyed as above.
_failed_memo: Memo[dict[str, str]] = Memo()


def _label(impl: Implementation, impls: list[Implementation]) -> str:
    same = [i for i in impls if i.platform == impl.platform]
    return impl.platform if len(same) == 1 else f"{impl.platform}[{'|'.join(impl.backends)}]"


def runnable(
    registry: Registry, spec: OpSpec, inv: Invocation, backend: str
) -> tuple[list[Implementation], dict[str, str]]:
    """Step 1: the implementations that can run ``inv`` on ``backend`` (highest priority
    first), and for every other one (``platform`` or ``platform[backends]``) the reason."""
    impls = registry.implementations(spec.name)
    candidates: list[Implementation] = []
    rejected: dict[str, str] = {}
    for impl in impls:
        label = _label(impl, impls)
        if not impl.runs_on(backend):
            rejected[label] = f"serves {'/'.join(impl.backends)}, this device is {backend}"
            continue
        available = registry.platform(impl.platform).check(backend)
        if available is not True:
            rejected[label] = str(available)
            continue
        try:
            supports = impl.get_supports()
            ok = True if supports is None else supports(inv)
        except Exception as err:  # a broken supports() rejects, never breaks the call
            ok = f"supports() raised {type(err).__name__}: {err}"
        if ok is not True:
            rejected[label] = str(ok) if ok else "declined"
            continue
        candidates.append(impl)
    return candidates, rejected


def install_hint(spec: OpSpec, registry: Registry, platform: str | None = None) -> str:
    """Which distribution would bring ``platform`` (or any platform ``spec``'s op lacks)."""
    if platform is not None:
        dist = registry.platform(platform).distribution or KNOWN_DISTRIBUTIONS.get(platform)
        return f"install {dist}" if dist else "install the plugin that provides it"
    installed = {i.platform for i in registry.implementations(spec.name)}
    missing = [d for p, d in KNOWN_DISTRIBUTIONS.items() if p not in installed]
    return (
        "install one of: " + ", ".join(missing) if missing else "no other distribution provides it"
    )


def select_implementation(
    spec: OpSpec,
    inv: Invocation,
    platform: str | None,
    reason: str | None,
    selector: ConfigSelectorChain,
) -> tuple[Implementation, str, dict[str, str]]:
    """Pick the implementation for ``inv``; raise NoImplementationError listing every reason.

    Returns:
        The implementation, why it was chosen, and the rejected ones with their reasons.
    """
    registry = get_registry()
    backend = current_backend()
    forced, why = platform, reason
    if forced is None and _env.forced_platform():
        forced, why = _env.forced_platform(), f"{_env.PLATFORM}={_env.forced_platform()}"
    key = call_key(spec.name, inv.fast_signature(), backend, registry.generation)
    memo = _runnable_memo.get(key)
    if memo is None:
        memo = _runnable_memo.put(key, runnable(registry, spec, inv, backend))
    candidates, rejected = memo[0], dict(memo[1])
    if forced is None and len(_failed_memo):
        candidates = _without_failed(_failure_key(spec, inv, backend), candidates, rejected)
    if forced is not None:
        return (
            _forced(spec, registry, forced.lower(), why, candidates, rejected),
            why or "forced",
            rejected,
        )
    if not candidates:
        listing = (
            "".join(f"\n  {name}: {r}" for name, r in rejected.items())
            or "\n  (no implementation installed)"
        )
        raise NoImplementationError(
            f"{spec.name}: no installed implementation can run this call on {backend}:{listing}\n"
            f"{install_hint(spec, registry)}",
            op=spec.name,
            rejected=rejected,
        )
    cached = selector.platform_choice(inv)
    if cached is not None:
        for impl in candidates:
            if impl.platform == cached:
                return impl, "cached platform choice (cross-platform autotune)", rejected
    shipped = selector.shipped_platform(inv, [c.platform for c in candidates])
    if shipped is not None:
        for impl in candidates:
            if impl.platform == shipped[0]:
                return impl, f"shipped table ({shipped[1]})", rejected
    best = candidates[0]
    return best, f"highest priority ({best.priority}) of {len(candidates)} runnable", rejected


def _name(item: tuple[Any, ...]) -> str:
    return str(item[0])


def _failure_key(spec: OpSpec, inv: Invocation, backend: str) -> tuple[Any, ...]:
    """The call key with the arguments in name order (callers bind them in different orders)
    and without arrays' shardings (a traced array has none): a failure while tracing is one of
    shapes, dtypes and static arguments."""
    args, kwargs = inv.fast_signature()
    fast = tuple(
        tuple(sorted((item[:3] if len(item) == 4 else item for item in part), key=_name))
        for part in (args, kwargs)
    )
    return call_key(spec.name, fast, backend, get_registry().generation)


def _without_failed(
    key: tuple[Any, ...], candidates: list[Implementation], rejected: dict[str, str]
) -> list[Implementation]:
    """The candidates that did not fail while traced for this call; adds the others' reasons
    to ``rejected``."""
    failed = _failed_memo.get(key)
    if not failed:
        return candidates
    impls = get_registry().implementations(candidates[0].op) if candidates else []
    kept = []
    for impl in candidates:
        label = _label(impl, impls)
        if label in failed:
            rejected[label] = failed[label]
        else:
            kept.append(impl)
    return kept


def reject_failed(spec: OpSpec, inv: Invocation, impl: Implementation, err: Exception) -> bool:
    """Reject ``impl`` for ``inv`` after it raised ``err`` while traced; warn once.

    Returns:
        False, recording nothing, when ``impl`` is the last runnable candidate of the call
        (its error is then the caller's to raise); else True.
    """
    registry = get_registry()
    backend = current_backend()
    memo = _runnable_memo.get(
        call_key(spec.name, inv.fast_signature(), backend, registry.generation)
    )
    if memo is None:
        return False
    key = _failure_key(spec, inv, backend)
    failed = dict(_failed_memo.get(key) or {})
    impls = registry.implementations(spec.name)
    label = _label(impl, impls)
    others = [c for c in memo[0] if c is not impl and _label(c, impls) not in failed]
    if not others:
        return False
    reason = f"failed while traced: {type(err).__name__}: {err}"
    failed[label] = reason
    _failed_memo.put(key, failed)
    warn_once(
        FallbackWarning,
        f"{spec.name}/{label}/{type(err).__name__}: {err}",
        f"{spec.name}: platform {label!r} raised {type(err).__name__}: {err}; it is rejected "
        f"for this call, which runs on the next runnable platform "
        f"({', '.join(repr(c.platform) for c in others)}). "
        f"Pass platform={impl.platform!r} to see the error raised.",
    )
    return True


def check_platform_argument(spec: OpSpec, platform: Any) -> None:
    """``platform=`` must be a string naming a platform with an implementation of the op."""
    if platform is None:
        return
    if not isinstance(platform, str):
        raise TypeError(
            f"{spec.name}: `platform` must be a str or None; got {type(platform).__name__}"
        )
    registry = get_registry()
    installed = sorted({i.platform for i in registry.implementations(spec.name)})
    if platform.lower() not in installed:
        raise ValueError(
            f"{spec.name}: `platform`={platform!r} is not installed for {spec.name}; installed: "
            f"{', '.join(installed) or '(none)'} ({install_hint(spec, registry, platform.lower())})"
        )


def _forced(
    spec: OpSpec,
    registry: Registry,
    forced: str,
    why: str | None,
    candidates: list[Implementation],
    rejected: dict[str, str],
) -> Implementation:
    """Step 2: the forced platform's candidate, or an error with every reason it cannot run."""
    for impl in candidates:
        if impl.platform == forced:
            return impl
    known = {i.platform for i in registry.implementations(spec.name)}
    # every reason of the forced platform, those of implementations for other devices last
    causes = sorted(
        (r for name, r in rejected.items() if name.split("[")[0] == forced),
        key=lambda r: r.startswith("serves "),
    )
    cause = "; ".join(causes) or None
    if cause is None and forced not in known:
        cause = (
            f"no {forced!r} implementation of {spec.name} is installed "
            f"({install_hint(spec, registry, forced)})"
        )
    raise NoImplementationError(
        f"{spec.name}: platform {forced!r} ({why}) cannot run this call: {cause}",
        op=spec.name,
        rejected=rejected,
    )


def preferred_platform(op: str) -> str | None:
    """The highest-priority platform available for ``op`` on this backend (ignoring supports)."""
    registry = get_registry()
    backend = current_backend()
    for impl in registry.implementations(op):
        if impl.runs_on(backend) and registry.platform(impl.platform).check(backend) is True:
            return impl.platform
    return None
