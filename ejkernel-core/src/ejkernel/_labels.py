"""Stamps and labels: named scopes that mark op calls and user code in profiles and HLO.

With ``EJKERNEL_OPS_STAMP=hash`` or ``json`` (read at every call), the executor runs each op's
implementation inside ``jax.named_scope(<stamp>)``; JAX puts the scope into the name of every
operation inside it: MLIR locations (``loc("jit(f)/ejkernel:op=.../dot_general")``), HLO
metadata (``metadata={op_name="jit(f)/ejkernel:op=.../dot_general"}``) and profiler traces.
A stamp is ``ejkernel:op=<op>;platform=<platform>;key=<cache key prefix>;cfg=<config digest>``,
plus ``;type=<module:qualname>;json=<config>`` in ``json`` mode. :func:`label` marks user
code the same way: ``ejkernel:label=<name>``.

Values are written with characters every JAX/XLA printer keeps as they are (letters, digits,
``_.+-:,{}[]~``); a ``"`` becomes a backtick and anything else ``%XX`` (UTF-8 bytes), so a
stamp never breaks a name stack (``/``), a location string or HLO escaping, and reads back
exactly. :func:`extract_labels_from_hlo_text` finds stamps in any of these texts,
:func:`find_labels_in_lowered` in a ``jax.stages.Lowered`` or ``Compiled``, and
:func:`labels_to_configs` maps op stamps back to the configs that ran.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import string
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import attrs
import jax

from ejkernel import _env
from ejkernel._json import stable_json
from ejkernel._memo import Memo

__all__ = [
    "PREFIX",
    "Label",
    "extract_labels_from_hlo_text",
    "find_labels_in_lowered",
    "label",
    "labels_to_configs",
    "op_stamp",
    "stamp_mode",
]

#: What every stamp and label scope starts with.
PREFIX = "ejkernel:"

#: Characters written as they are; ``=``, ``;``, ``%`` and the backtick are structure.
_SAFE = frozenset(string.ascii_letters + string.digits + "_.+-:,{}[]~")
_TOKEN = re.compile(r"ejkernel:(?:op|label)=[A-Za-z0-9_.+\-:,{}\[\]~=;%`]+")

#: Length of the cache key prefix and of the config digest in a stamp.
KEY_CHARS = 16
DIGEST_CHARS = 8

F = TypeVar("F", bound=Callable[..., Any])


def _encode(text: str) -> str:
    out: list[str] = []
    for ch in text:
        if ch in _SAFE:
            out.append(ch)
        elif ch == '"':
            out.append("`")
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


def _decode(text: str) -> str:
    return urllib.parse.unquote(text.replace("`", "%22"))


def stamp_mode() -> str | None:
    """``"hash"`` or ``"json"`` when ``EJKERNEL_OPS_STAMP`` asks for stamps, else ``None``."""
    if not os.environ.get(_env.OPS_STAMP):
        return None
    mode = _env.ops_stamp()
    return None if mode == "none" else mode


# -- stamping -----------------------------------------------------------------------------------

#: (key prefix, config digest) -> the config a stamp was made for.
_stamped: Memo[tuple[Any]] = Memo()
_digests: Memo[str] = Memo()


def _config_text(config: Any) -> str:
    """The config as :func:`stable_json`, or its ``repr`` as a JSON string when it has no JSON
    form (a stamp must never fail the call it marks)."""
    try:
        return stable_json(config)
    except Exception:
        return json.dumps(repr(config))


def _digest(config: Any) -> str:
    try:
        memo = (type(config), config)
        hit = _digests.get(memo)
    except TypeError:  # an unhashable config
        memo, hit = None, None
    if hit is None:
        hit = hashlib.sha256(_config_text(config).encode()).hexdigest()[:DIGEST_CHARS]
        if memo is not None:
            _digests.put(memo, hit)
    return hit


def forget_stamps() -> None:
    """Forget the configs of the stamps made in this process (tests start clean)."""
    global _stamped
    _stamped = Memo()


def op_stamp(op: str, platform: str, key: str, config: Any, mode: str) -> str:
    """The scope name of one op call (remembered for :func:`labels_to_configs`).

    Args:
        op: the op (or kernel) name.
        platform: the platform that runs.
        key: the invocation's cache key (its first :data:`KEY_CHARS` characters are kept).
        config: the config it runs with.
        mode: ``"hash"`` or ``"json"``.
    """
    key = key[:KEY_CHARS]
    digest = _digest(config)
    _stamped.put((key, digest), (config,))
    parts = [f"op={_encode(op)}", f"platform={_encode(platform)}", f"key={key}", f"cfg={digest}"]
    if mode == "json":
        if config is not None:
            t = type(config)
            parts.append(f"type={_encode(f'{t.__module__}:{t.__qualname__}')}")
        parts.append(f"json={_encode(_config_text(config))}")
    return PREFIX + ";".join(parts)


class _LabelScope:
    """``label(name)``: a decorator, and a context manager, opening ``jax.named_scope``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.scope = f"{PREFIX}label={_encode(name)}"
        self._open = threading.local()

    def __call__(self, fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"label({self.name!r}) decorates a function; got {type(fn).__name__}")
        scope = self.scope

        @functools.wraps(fn)
        def labelled(*args: Any, **kwargs: Any) -> Any:
            with jax.named_scope(scope):
                return fn(*args, **kwargs)

        return labelled  # type: ignore[return-value]

    def __enter__(self) -> _LabelScope:
        cm = jax.named_scope(self.scope)
        cm.__enter__()
        self._open.__dict__.setdefault("stack", []).append(cm)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._open.stack.pop().__exit__(*exc)

    def __repr__(self) -> str:
        return f"label({self.name!r})"


def label(name: str) -> _LabelScope:
    """Mark a function's operations with ``name`` in profiles and HLO.

    Use it as a decorator (``@label("attention")``), also on functions called under
    ``jax.jit``, or as ``with label("attention"):``. :func:`find_labels_in_lowered` finds
    it again as a :class:`Label` of kind ``"label"``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is empty.
    """
    if not isinstance(name, str):
        raise TypeError(f"label: `name` must be a string; got {type(name).__name__}")
    if not name:
        raise ValueError("label: `name` must not be empty")
    return _LabelScope(name)


# -- finding ------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Label:
    """A stamp or label found in a program.

    Attributes:
        kind: ``"label"`` (from :func:`label`) or ``"op"`` (an op call's stamp).
        name: the label's name, or the op's.
        op: the op (``None`` for labels).
        platform: the platform that ran.
        key: the first characters of the invocation's cache key.
        digest: a short hash of the config (tells configs of one invocation apart).
        config_type: the config class as ``module:qualname`` (``json`` stamps).
        config_json: the config as JSON (``json`` stamps).
    """

    kind: str
    name: str
    op: str | None = None
    platform: str | None = None
    key: str | None = None
    digest: str | None = None
    config_type: str | None = None
    config_json: str | None = None


def _parse(token: str) -> Label | None:
    fields: dict[str, str] = {}
    for part in token[len(PREFIX) :].split(";"):
        name, sep, value = part.partition("=")
        if sep:
            fields.setdefault(name, _decode(value))
    if "label" in fields:
        return Label(kind="label", name=fields["label"])
    if "op" not in fields:
        return None
    return Label(
        kind="op",
        name=fields["op"],
        op=fields["op"],
        platform=fields.get("platform"),
        key=fields.get("key"),
        digest=fields.get("cfg"),
        config_type=fields.get("type"),
        config_json=fields.get("json"),
    )


def extract_labels_from_hlo_text(text: str) -> list[Label]:
    """The stamps and labels in a program's text, deduplicated, in order of appearance.

    Reads StableHLO/MLIR text with locations (``loc("...")``, as printed by
    ``lowered.as_text(debug_info=True)``) and HLO text with ``metadata={op_name="..."}``
    (``compiled.as_text()``, XLA dumps).
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_labels_from_hlo_text: expected text; got {type(text).__name__}")
    seen: dict[Label, None] = {}
    for match in _TOKEN.finditer(text):
        found = _parse(match.group(0))
        if found is not None:
            seen.setdefault(found, None)
    return list(seen)


def _program_text(obj: Any) -> str:
    as_text = getattr(obj, "as_text", None)
    if as_text is None:
        raise TypeError(
            "find_labels_in_lowered: expected a jax.stages.Lowered or Compiled "
            f"(jax.jit(f).lower(...)); got {type(obj).__name__}"
        )
    try:
        text = as_text(debug_info=True)  # Lowered: locations are printed only on request
    except TypeError:
        text = as_text()
    return text or ""


def find_labels_in_lowered(lowered: Any) -> list[Label]:
    """The stamps and labels in ``jax.jit(f).lower(...)`` (or its ``.compile()``).

    Args:
        lowered: a ``jax.stages.Lowered``, a ``jax.stages.Compiled``, a ``Traced`` (it is
            lowered) or program text.

    Returns:
        :class:`Label` records, deduplicated, in order of appearance.
    """
    if isinstance(lowered, str):
        return extract_labels_from_hlo_text(lowered)
    if not hasattr(lowered, "as_text") and callable(getattr(lowered, "lower", None)):
        lowered = lowered.lower()
    return extract_labels_from_hlo_text(_program_text(lowered))


# -- labels to configs --------------------------------------------------------------------------


def _matching(key: str, digest: str | None, configs: Iterable[tuple[str, Callable[[], Any]]]):
    for k, get in configs:
        if k.startswith(key):
            cfg = get()
            if digest is None or _digest(cfg) == digest:
                return (cfg,)
    return None


def _from_stamps(found: Label) -> tuple[Any] | None:
    """The config of a stamp made in this process (exactly the object that ran)."""
    return _stamped.get((found.key, found.digest)) if found.key is not None else None


def _from_caches(found: Label) -> tuple[Any] | None:
    """A config of the default executor's memory cache or of the persistent cache whose key
    starts with the stamp's and whose digest is the stamp's."""
    if found.key is None:
        return None
    from ejkernel import _executor
    from ejkernel._cache import PersistentCache

    executor = _executor._default
    if executor is not None:
        cache = executor.selector.cache
        hit = _matching(found.key, found.digest, ((k, lambda k=k: cache.get(k)) for k in cache))
        if hit is not None:
            return hit
    persistent = PersistentCache()
    return _matching(
        found.key,
        found.digest,
        ((k, lambda k=k: persistent.get(k)) for k in persistent.entries()),
    )


def _json_data(found: Label) -> tuple[Any] | None:
    if found.config_json is None:
        return None
    try:
        return (json.loads(found.config_json),)
    except ValueError:
        return None


def _from_json(found: Label) -> tuple[Any] | None:
    """A ``json`` stamp's config structured into its class (``None`` when the class cannot be
    imported here or no longer takes this JSON)."""
    data = _json_data(found)
    if data is None or data[0] is None:
        return data
    if found.config_type is None:
        return None
    from ejkernel._json import from_json
    from ejkernel._registry import resolve

    try:
        return (from_json(data[0], resolve(found.config_type)),)
    except Exception:
        return None


def labels_to_configs(labels: Iterable[Label]) -> dict[Label, Any]:
    """The config each op stamp ran with.

    Looked up, in this order: among the stamps made in this process (by key and config
    digest); in a ``json`` stamp itself (structured into its class); in the default
    executor's memory cache and the persistent cache (by key prefix and digest); a ``json``
    stamp whose class cannot be imported here maps to its plain JSON. Labels of kind
    ``"label"`` and stamps whose config is found nowhere are left out.

    Returns:
        ``{label: config}`` (``None`` for implementations that take no config).
    """
    out: dict[Label, Any] = {}
    for found in labels:
        if not isinstance(found, Label):
            raise TypeError(
                f"labels_to_configs: expected Label records; got {type(found).__name__}"
            )
        if found.kind != "op":
            continue
        hit = _from_stamps(found) or _from_json(found) or _from_caches(found) or _json_data(found)
        if hit is not None:
            out[found] = hit[0]
    return out
