"""One JSON converter (cattrs, extra keys forbidden) and `stable_json` for cache keys."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, TypeVar

import attrs
import cattrs

T = TypeVar("T")

converter = cattrs.Converter(forbid_extra_keys=True)


def _plain(obj: Any) -> Any:
    """Turn configs, tuples and numpy scalars into JSON-ready values."""
    if attrs.has(type(obj)) or dataclasses.is_dataclass(obj):
        return _plain(converter.unstructure(obj))
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "shape", None) == ():
        return obj.item()  # numpy / jax scalar
    return obj


def stable_json(obj: Any) -> str:
    """Deterministic JSON: sorted keys, compact separators, configs unstructured first."""
    return json.dumps(_plain(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def stable_hash(obj: Any) -> str:
    """A short stable hex digest of :func:`stable_json` (same across processes and machines)."""
    return hashlib.sha256(stable_json(obj).encode()).hexdigest()[:32]


def to_json(cfg: Any) -> str:
    """Serialise a config (attrs class or dataclass) to JSON."""
    return stable_json(cfg)


def from_json(s: str | bytes | dict[str, Any], config_type: type[T]) -> T:
    """Structure JSON (text or an already-parsed dict) into ``config_type``."""
    data = json.loads(s) if isinstance(s, (str, bytes)) else s
    return converter.structure(data, config_type)
