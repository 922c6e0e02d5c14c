"""Shipped tables: tuned configs and fastest platforms that plugins ship for known devices.

A table is a persistent-cache export (``{"schema": 1, "entries": {key: entry}}``, each entry
with ``config``, ``config_type``, ``source``, ``key`` (the key document: op, platform, version,
grad, invocation signature, device) and optionally ``timings_ms``), so ``ejkernel cache
export`` and ``ejkernel tune --out`` write tables as they are. A table may add
``"format": "ejkernel-shipped/1"`` and ``"device_kinds"`` (``ejkernel cache ship`` writes both
and drops what a table does not need). Entries of source ``platform-choice`` name the fastest
platform (``config``) with every platform's time (``timings_ms``).

Plugins declare tables with ``registry.add_shipped_table(location)``; they are read on the
first lookup, once per registry generation (a process, unless plugins change). A missing,
corrupt or foreign file is one :class:`~ejkernel.errors.CacheWarning` naming it; the others
still load.

Matching a call (:meth:`ShippedIndex.matches`): the key document is compared without the
device's volatile fields (only backend, kind and compute capability count, not the driver or
library versions). An entry with the same document matches exactly. Else an entry matches by
bucket when op, platform, implementation version, grad, device, every static argument and
every array's dtype, rank and sharding are equal, and each array dimension is equal or within
a factor of 2 of the call's (so the sequence lengths, batch sizes... that differ fall in the
same bucket, with no per-op rule); the nearest such entry (smallest sum of
``|log2(call dim / entry dim)|``) comes first. The config chain accepts a bucket match only
when its config is the implementation's heuristic or among its candidates for the call (so a
config tuned for a neighbour never runs where the implementation cannot serve it).
"""

from __future__ import annotations

import importlib.resources
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ejkernel._cache import SCHEMA_VERSION, PersistentCache
from ejkernel._invocation import Invocation, device_fingerprint
from ejkernel._json import stable_hash
from ejkernel._memo import Memo
from ejkernel.errors import CacheWarning, warn_once

__all__ = [
    "FORMAT",
    "ShippedIndex",
    "ShippedMatch",
    "ShippedTable",
    "load_shipped_table",
    "registry_index",
    "shipped_tables",
    "write_shipped_table",
]

#: The ``format`` field of a shipped table (optional; a plain cache export is a table too).
FORMAT = "ejkernel-shipped/1"

#: The device fields a table entry must share with the call (the others are volatile).
DEVICE_FIELDS = ("backend", "kind", "compute_capability")

#: The platform of entries naming the fastest platform of a call.
CHOICE = "<choice>"

_PACKAGE = re.compile(r"^([A-Za-z_][\w.]*):(.*)$")


@attrs.frozen(kw_only=True)
class ShippedTable:
    """One shipped table, as read.

    Attributes:
        name: where it came from (``package:relative/path``, or the file path).
        entries: key -> entry, the entries that carry a key document.
        device_kinds: the device kinds its entries were tuned on.
        skipped: entries left out for want of a key document.
    """

    name: str
    entries: Mapping[str, Mapping[str, Any]] = attrs.field(repr=False)
    device_kinds: tuple[str, ...] = ()
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.entries)


@attrs.frozen(kw_only=True)
class ShippedMatch:
    """A table entry that matches a call.

    Attributes:
        table: the table's name.
        entry: the entry (``config``, ``config_type``, ``source``, ``key``, ``timings_ms``).
        exact: the key documents are equal (else a bucket match).
        distance: sum of ``|log2(call dim / entry dim)|`` (0 when exact).
    """

    table: str
    entry: Mapping[str, Any] = attrs.field(repr=False)
    exact: bool
    distance: float


def _is_array(v: Any) -> bool:
    return (
        isinstance(v, Mapping)
        and isinstance(v.get("shape"), list)
        and isinstance(v.get("dtype"), str)
        and set(v) <= {"shape", "dtype", "sharding"}
    )


def _valid_document(doc: Any) -> bool:
    return (
        isinstance(doc, Mapping)
        and isinstance(doc.get("op"), str)
        and isinstance(doc.get("platform"), str)
        and isinstance(doc.get("invocation"), Mapping)
        and isinstance(doc.get("device"), Mapping)
    )


def _usable_entry(entry: Any) -> bool:
    """Whether an entry has a config and a key document that can be indexed."""
    if not isinstance(entry, dict) or "config" not in entry:
        return False
    if not _valid_document(entry.get("key")):
        return False
    try:
        _shape_of(_stable(entry["key"]))
    except (TypeError, ValueError, AttributeError):
        return False
    return True


def _stable(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The key document without the device's volatile fields."""
    device = doc.get("device") or {}
    return {
        "op": doc.get("op"),
        "platform": doc.get("platform"),
        "version": str(doc.get("version", "0")),
        "grad": bool(doc.get("grad", False)),
        "invocation": doc.get("invocation"),
        "device": {k: str(device[k]) for k in DEVICE_FIELDS if k in device},
    }


def _shape_of(stable: Mapping[str, Any]) -> tuple[str, tuple[int, ...]]:
    """The bucket of a stable document (it with every shape replaced by its rank), and its
    dimensions in a fixed order."""
    dims: list[int] = []

    def skeleton(v: Any) -> Any:
        if _is_array(v):
            dims.extend(int(d) for d in v["shape"])
            return {**v, "shape": len(v["shape"])}
        return v

    inv = stable["invocation"]
    skeletal = {
        "args": [skeleton(a) for a in inv.get("args", [])],
        "kwargs": {k: skeleton(v) for k, v in sorted(dict(inv.get("kwargs", {})).items())},
    }
    return stable_hash({**stable, "invocation": skeletal}), tuple(dims)


def _distance(call: tuple[int, ...], entry: tuple[int, ...]) -> float | None:
    """Sum of ``|log2(call/entry)|`` over dimensions, or None when one differs by more than a
    factor of 2 (or one of them is 0)."""
    total = 0.0
    for a, b in zip(call, entry, strict=True):
        if a == b:
            continue
        if a <= 0 or b <= 0 or max(a, b) > 2 * min(a, b):
            return None
        total += abs(math.log2(a / b))
    return total


# -- reading tables ---------------------------------------------------------------------------


def _parse(text: str, name: str) -> ShippedTable:
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{name} is not JSON ({err})") from err
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), dict):
        raise ValueError(f"{name} is not an ejkernel table (no `entries` mapping)")
    if doc.get("schema") != SCHEMA_VERSION:
        raise ValueError(
            f"{name} has schema {doc.get('schema')!r}; this ejkernel reads schema {SCHEMA_VERSION}"
        )
    if doc.get("format", FORMAT) != FORMAT:
        raise ValueError(f"{name} has format {doc.get('format')!r}; this ejkernel reads {FORMAT}")
    entries = {str(k): v for k, v in doc["entries"].items() if _usable_entry(v)}
    kinds = sorted({str(e["key"]["device"].get("kind", "?")) for e in entries.values()})
    return ShippedTable(
        name=name,
        entries=entries,
        device_kinds=tuple(kinds),
        skipped=len(doc["entries"]) - len(entries),
    )


def load_shipped_table(path: str | os.PathLike[str]) -> ShippedTable:
    """Read a shipped table (or any persistent-cache export) to inspect it.

    Raises:
        ValueError: the file cannot be read, is not JSON, or is not a table of this schema.
    """
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    return _parse(text, os.fspath(path))


def _files(location: str) -> list[tuple[str, Any]]:
    """``(name, Traversable)`` of the JSON files a declared location holds."""
    match = _PACKAGE.match(location)
    if match is not None and not os.path.exists(location):
        package, relative = match.groups()
        try:
            root: Any = importlib.resources.files(package)
        except (ImportError, TypeError) as err:
            raise FileNotFoundError(f"package {package!r} cannot be found: {err}") from err
        target = root.joinpath(relative) if relative else root
        prefix = f"{package}:{relative.rstrip('/')}" if relative else f"{package}:"
    else:
        target, prefix = Path(location).expanduser(), location
    if target.is_dir():
        names = sorted(c.name for c in target.iterdir() if c.name.endswith(".json"))
        sep = "" if prefix.endswith((":", "/")) else "/"
        return [(f"{prefix}{sep}{n}", target.joinpath(n)) for n in names]
    if target.is_file():
        return [(prefix, target)]
    raise FileNotFoundError("no such file or folder")


def _read_declared(locations: Iterable[tuple[str, str]]) -> list[ShippedTable]:
    """Every table the locations hold; each bad one is a warning, never an error."""
    tables: list[ShippedTable] = []
    for location, plugin in locations:
        by = f" (declared by plugin {plugin!r})" if plugin not in ("<direct>", "") else ""
        try:
            files = _files(location)
        except OSError as err:
            warn_once(
                CacheWarning,
                f"shipped:{location}",
                f"ejkernel shipped table {location}{by} cannot be found ({err}); ignored",
            )
            continue
        for name, file in files:
            try:
                tables.append(_parse(file.read_text(), name))
            except (OSError, ValueError) as err:
                warn_once(
                    CacheWarning,
                    f"shipped:{name}",
                    f"ejkernel shipped table {name}{by} is ignored: {err}",
                )
    return tables


# -- matching ---------------------------------------------------------------------------------


class ShippedIndex:
    """Tables indexed for lookups: exact by stable key document, else by bucket."""

    def __init__(self, tables: Sequence[ShippedTable]) -> None:
        self.tables = list(tables)
        self._exact: dict[str, tuple[str, Mapping[str, Any]]] = {}
        self._buckets: dict[str, list[tuple[tuple[int, ...], str, Mapping[str, Any]]]] = {}
        self.ops: set[str] = set()
        self._memo: Memo[list[ShippedMatch]] = Memo()
        for table in self.tables:
            for entry in table.entries.values():
                stable = _stable(entry["key"])
                self._exact.setdefault(stable_hash(stable), (table.name, entry))
                bucket, dims = _shape_of(stable)
                self._buckets.setdefault(bucket, []).append((dims, table.name, entry))
                self.ops.add(str(stable["op"]))

    def __bool__(self) -> bool:
        return bool(self.ops)

    def matches(self, doc: Mapping[str, Any]) -> list[ShippedMatch]:
        """Entries matching a key document: the exact one first, then bucket matches, nearest
        first."""
        if str(doc.get("op")) not in self.ops:
            return []
        stable = _stable(doc)
        out: list[ShippedMatch] = []
        exact = self._exact.get(stable_hash(stable))
        if exact is not None:
            out.append(ShippedMatch(table=exact[0], entry=exact[1], exact=True, distance=0.0))
        bucket, dims = _shape_of(stable)
        near = []
        for entry_dims, table, entry in self._buckets.get(bucket, ()):
            d = _distance(dims, entry_dims)
            if d is not None and d > 0:
                near.append(ShippedMatch(table=table, entry=entry, exact=False, distance=d))
        out += sorted(near, key=lambda m: m.distance)
        return out

    def lookup(self, inv: Invocation, platform: str, version: str) -> list[ShippedMatch]:
        """:meth:`matches` of ``inv``'s key document, memoised per call signature."""
        if inv.kernel_name() not in self.ops:
            return []
        memo = (
            inv.kernel_name(),
            platform,
            version,
            inv.grad,
            device_fingerprint(),
            inv.fast_signature(),
        )
        found = self._memo.get(memo)
        if found is None:
            found = self._memo.put(
                memo, self.matches(inv.key_document(platform=platform, version=version))
            )
        return found

    def fastest_platform(self, inv: Invocation, runnable: Sequence[str]) -> tuple[str, str] | None:
        """The fastest of ``runnable`` by the first matching platform-choice entry, with its
        table's name; platforms without a time rank after the named one."""
        for match in self.lookup(inv, CHOICE, "0"):
            chosen = match.entry.get("config")
            if not isinstance(chosen, str):
                continue
            timings = match.entry.get("timings_ms") or {}
            ranked = sorted(
                (p for p in timings if isinstance(timings[p], (int, float))),
                key=lambda p: timings[p],
            )
            for platform in [chosen, *ranked]:
                if platform in runnable:
                    return platform, match.table
        return None


_registry_memo: tuple[int, ShippedIndex] | None = None


def registry_index() -> ShippedIndex:
    """The index of every table the loaded plugins declare (read once per registry state)."""
    global _registry_memo
    from ejkernel.plugins import get_registry

    registry = get_registry()
    memo = _registry_memo
    if memo is not None and memo[0] == registry.generation:
        return memo[1]
    index = ShippedIndex(_read_declared(registry.shipped_tables()))
    _registry_memo = (registry.generation, index)
    return index


def shipped_tables() -> list[ShippedTable]:
    """The shipped tables the loaded plugins declare, as read (bad files left out, with a
    warning)."""
    return list(registry_index().tables)


# -- writing tables ---------------------------------------------------------------------------


def _source_entries(source: Any) -> Mapping[str, Any]:
    if isinstance(source, PersistentCache):
        return source.entries()
    if isinstance(source, ShippedTable):
        return source.entries
    try:
        doc = json.loads(Path(source).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {source}: {err}") from err
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"{source} is not an ejkernel cache export of schema {SCHEMA_VERSION}")
    entries = doc.get("entries")
    return entries if isinstance(entries, dict) else {}


def write_shipped_table(
    sources: Sequence[str | os.PathLike[str] | PersistentCache | ShippedTable],
    out: str | os.PathLike[str],
    *,
    device: str | None = None,
    platforms: Sequence[str] | None = None,
) -> ShippedTable:
    """Write a shipped table made of cache exports (later sources win on the same key).

    Keeps each entry's config, config type, source, key document (its device reduced to
    backend, kind and compute capability) and timings; entries without a key document are
    left out.

    Args:
        sources: export files (``ejkernel cache export``, ``ejkernel tune --out``), persistent
            caches or tables.
        out: the table to write.
        device: keep only entries whose device kind contains this (case-insensitive).
        platforms: keep only entries of these platforms (``"choice"``: fastest-platform
            entries).

    Returns:
        The table written.
    """
    wanted = None if platforms is None else {CHOICE if p == "choice" else p for p in platforms}
    entries: dict[str, dict[str, Any]] = {}
    for source in sources:
        for raw in _source_entries(source).values():
            if not _usable_entry(raw):
                continue
            stable = _stable(raw["key"])
            kind = stable["device"].get("kind", "")
            if device is not None and device.lower() not in kind.lower():
                continue
            if wanted is not None and stable["platform"] not in wanted:
                continue
            entry = {k: raw[k] for k in ("config", "config_type", "source") if k in raw}
            entry["key"] = stable
            if isinstance(raw.get("timings_ms"), Mapping):
                entry["timings_ms"] = dict(raw["timings_ms"])
            entries[stable_hash(stable)] = entry
    kinds = sorted({e["key"]["device"].get("kind", "?") for e in entries.values()})
    doc = {"schema": SCHEMA_VERSION, "format": FORMAT, "device_kinds": kinds, "entries": entries}
    Path(out).write_text(json.dumps(doc, sort_keys=True, indent=1) + "\n")
    return ShippedTable(name=os.fspath(out), entries=entries, device_kinds=tuple(kinds))
