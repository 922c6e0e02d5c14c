"""The autotune policy: what the config chain may do when no cache holds a config.

:class:`AutotunePolicy` is a frozen value. The policy in force for a call is resolved, in this
order, from: the chain's own policy (``ConfigSelectorChain(policy=...)``, else
``EJKERNEL_AUTOTUNE_POLICY``; ``ConfigSelectorChain(autotune=False)`` forbids tuning), then
every enclosing :func:`policy_override` (innermost last), then :func:`forward_autotune_only`,
then ``EJKERNEL_SHIPPED=0`` (which turns ``use_shipped`` off). Context variables carry the
overrides, so they are thread- and task-safe.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar

import attrs

from ejkernel import _env

__all__ = ["AutotunePolicy", "forward_autotune_only", "policy_override", "resolve_policy"]

F = TypeVar("F", bound=Callable[..., Any])

FALLBACKS = ("autotune", "heuristics")


@attrs.frozen(kw_only=True)
class AutotunePolicy:
    """What the config chain may do when no cache holds a config for a call.

    Attributes:
        allow_autotune: tuning may run at all (``False`` forbids it whatever else says).
        allow_heuristics: an implementation's heuristic may answer a miss of every cache; with
            ``False``, a call that neither a cache nor tuning can serve is a ``ConfigError``.
        cache_miss_fallback: ``"autotune"`` (time the candidates) or ``"heuristics"`` (take the
            heuristic) when no cache holds a config; tuning runs only when this is
            ``"autotune"`` and ``allow_autotune`` is true.
        autotune_backward: differentiated calls are tuned on forward plus backward. With
            ``False`` (see :func:`forward_autotune_only`) a differentiated call missing from
            the caches takes the config of the same call undifferentiated (tuned on the
            forward alone, if tuning is allowed), never timing a backward pass.
        use_shipped: consult the plugins' shipped tables (the ``shipped`` tier and selection's
            fastest platform by table). ``EJKERNEL_SHIPPED=0`` turns it off everywhere.

    Example:
        >>> from ejkernel.ops import AutotunePolicy, policy_override
        >>> with policy_override(AutotunePolicy(allow_autotune=False)):
        ...     pass  # heuristics (or cached configs) only inside this block
    """

    allow_autotune: bool = True
    allow_heuristics: bool = True
    cache_miss_fallback: Literal["autotune", "heuristics"] = attrs.field(
        default="autotune", validator=attrs.validators.in_(FALLBACKS)
    )
    autotune_backward: bool = True
    use_shipped: bool = True

    @property
    def tunes(self) -> bool:
        """Whether a miss of every cache autotunes (where the implementation has candidates)."""
        return self.allow_autotune and self.cache_miss_fallback == "autotune"

    @property
    def name(self) -> str:
        """``"autotune"`` or ``"heuristics"``: the ``EJKERNEL_AUTOTUNE_POLICY`` spelling."""
        return "autotune" if self.tunes else "heuristics"

    @classmethod
    def named(cls, name: str) -> AutotunePolicy:
        """The policy ``EJKERNEL_AUTOTUNE_POLICY=name`` means (``autotune`` or ``heuristics``)."""
        if name not in FALLBACKS:
            raise ValueError(f"policy must be 'autotune' or 'heuristics'; got {name!r}")
        return _NAMED[name]


_NAMED = {
    "autotune": AutotunePolicy(),
    "heuristics": AutotunePolicy(allow_autotune=False, cache_miss_fallback="heuristics"),
}
_FIELDS = frozenset(a.name for a in attrs.fields(AutotunePolicy))

#: Enclosing overrides, outermost first: (the chain it is for, or None for every chain; a
#: whole policy, or field updates).
_layers: contextvars.ContextVar[tuple[tuple[Any, AutotunePolicy | dict[str, Any]], ...]] = (
    contextvars.ContextVar("ejkernel_policy_layers", default=())
)
_forward_only: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ejkernel_forward_autotune_only", default=False
)


def _mode(name: str) -> dict[str, Any]:
    """Field updates of a named mode (keeps the other fields of the policy in force)."""
    AutotunePolicy.named(name)
    tune = name == "autotune"
    return {"allow_autotune": tune, "cache_miss_fallback": name}


@contextlib.contextmanager
def policy_override(
    autotune: Any = None,
    *,
    policy: str | AutotunePolicy | None = None,
    **fields: Any,
) -> Iterator[None]:
    """Set the autotune policy inside this block (beats the chain's and
    ``EJKERNEL_AUTOTUNE_POLICY``; thread- and task-safe; usable as a decorator too).

    Args:
        autotune: ``True`` → tune on a miss, ``False`` → heuristics only; or a whole
            :class:`AutotunePolicy`; or a :class:`~ejkernel.ops.ConfigSelectorChain`, to
            change only that chain's policy (``policy_override(selector,
            allow_autotune=False)``, as upstream ejkernel spells it).
        policy: the same by name (``"autotune"`` or ``"heuristics"``), or a policy.
        **fields: :class:`AutotunePolicy` fields to change (``allow_heuristics=False``...),
            the others staying as in force outside the block.

    Example:
        >>> with policy_override(autotune=False):
        ...     pass
        >>> with policy_override(AutotunePolicy(use_shipped=False)):
        ...     pass
    """
    owner = None
    if hasattr(autotune, "autotune_policy"):  # a ConfigSelectorChain
        owner, autotune = autotune, None
    layer = _layer(autotune, policy, fields)
    token = _layers.set((*_layers.get(), (owner, layer)))
    try:
        yield
    finally:
        _layers.reset(token)


def _layer(autotune: Any, policy: Any, fields: dict[str, Any]) -> AutotunePolicy | dict[str, Any]:
    if isinstance(autotune, AutotunePolicy):
        if policy is not None:
            raise TypeError("policy_override: give the policy once, not as `autotune` and `policy`")
        autotune, policy = None, autotune
    if autotune is not None and not isinstance(autotune, bool):
        raise TypeError(
            f"policy_override: `autotune` must be a bool or an AutotunePolicy; "
            f"got {type(autotune).__name__}"
        )
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise TypeError(
            f"policy_override: unknown AutotunePolicy fields {unknown}; known: {sorted(_FIELDS)}"
        )
    if isinstance(policy, AutotunePolicy):
        return attrs.evolve(policy, **fields) if fields else policy
    updates: dict[str, Any] = {}
    if policy is not None:
        if not isinstance(policy, str):
            raise TypeError(
                f"policy_override: `policy` must be a str or an AutotunePolicy; "
                f"got {type(policy).__name__}"
            )
        updates.update(_mode(policy))
    elif autotune is not None:
        updates.update(_mode("autotune" if autotune else "heuristics"))
    updates.update(fields)
    attrs.evolve(AutotunePolicy(), **updates)  # validate now, not at the next call
    return updates


@contextlib.contextmanager
def _forward_only_block() -> Iterator[None]:
    token = _forward_only.set(True)
    try:
        yield
    finally:
        _forward_only.reset(token)


def forward_autotune_only(fn: F | None = None) -> Any:
    """Inside this block (or decorated function), differentiated calls are never tuned on their
    backward pass: a differentiated call missing from the caches takes the config of the same
    call undifferentiated (tuned on the forward alone when the policy tunes, else cached or
    heuristic). Forward calls tune as usual. Usable as ``with forward_autotune_only():``,
    ``@forward_autotune_only()`` or ``@forward_autotune_only``.

    Example:
        >>> @forward_autotune_only
        ... def train_step(params, batch):
        ...     ...
    """
    if fn is None:
        return _forward_only_block()
    if not callable(fn):
        raise TypeError(f"forward_autotune_only: expected a function; got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _forward_only_block():
            return fn(*args, **kwargs)

    return wrapper


def resolve_policy(
    base: AutotunePolicy | None, allow_autotune: bool = True, chain: Any = None
) -> AutotunePolicy:
    """The policy in force for ``chain``: ``base`` (else ``EJKERNEL_AUTOTUNE_POLICY``),
    tuning forbidden unless ``allow_autotune``, then the enclosing overrides (those for every
    chain and those for ``chain``), :func:`forward_autotune_only` and ``EJKERNEL_SHIPPED``."""
    policy = base if base is not None else AutotunePolicy.named(_env.autotune_policy())
    if not allow_autotune and policy.allow_autotune:
        policy = attrs.evolve(policy, allow_autotune=False)
    for owner, layer in _layers.get():
        if owner is not None and owner is not chain:
            continue
        policy = layer if isinstance(layer, AutotunePolicy) else attrs.evolve(policy, **layer)
    if _forward_only.get() and policy.autotune_backward:
        policy = attrs.evolve(policy, autotune_backward=False)
    if policy.use_shipped and not _env.shipped():
        policy = attrs.evolve(policy, use_shipped=False)
    return policy
