"""Config caches: in memory, and persistent on disk (atomic, locked, merge-on-write).

Persistent layout: ``<dir>/configs.json`` = ``{"schema": 1, "entries": {key: entry}}`` with
``entry = {"config": {...}, "config_type": "module:qualname", "source": "autotune",
"created": unix time, "key": {op, platform, version, grad, invocation, device}, ...}``.
Writes take ``<dir>/configs.json.lock`` (an OS file lock), re-read the file, merge, write a
temp file in the same folder and ``os.replace`` it: concurrent processes never lose entries.
A file that does not parse, or has another schema, is renamed ``configs.json.corrupt-<time>``
with a :class:`CacheWarning`; an unwritable folder gives one warning and the cache lives on in
memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from ejkernel import _env
from ejkernel._json import converter
from ejkernel._registry import resolve
from ejkernel.errors import CacheWarning, warn_once

__all__ = [
    "SCHEMA_VERSION",
    "CacheEntry",
    "ConfigCache",
    "PersistentCache",
    "make_entry",
    "structure_entry",
]

SCHEMA_VERSION = 1
FILE_NAME = "configs.json"


@attrs.frozen(kw_only=True)
class CacheEntry:
    """A cached config with its provenance.

    Attributes:
        config: the config object.
        source: how it was first chosen: ``autotune``, ``heuristic``, ``persistent``, ``manual``...
        meta: the key document and anything else worth keeping (timings).
    """

    config: Any
    source: str = "manual"
    meta: Mapping[str, Any] = attrs.field(factory=dict)


class ConfigCache:
    """In-memory config cache: ``put(key, cfg)``, ``get(key)``, ``key in cache``. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, CacheEntry] = {}
        self.version = 0  # bumped on every change, so memoised dispatch can tell

    def put(
        self, key: str, cfg: Any, *, source: str = "manual", meta: Mapping[str, Any] | None = None
    ) -> None:
        with self._lock:
            self._entries[key] = CacheEntry(config=cfg, source=source, meta=dict(meta or {}))
            self.version += 1

    def get(self, key: str, default: Any = None) -> Any:
        entry = self._entries.get(key)
        return default if entry is None else entry.config

    def entry(self, key: str) -> CacheEntry | None:
        return self._entries.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.version += 1


def _type_name(cfg: Any) -> str:
    t = type(cfg)
    return f"{t.__module__}:{t.__qualname__}"


def make_entry(
    cfg: Any, *, source: str = "manual", meta: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The stored (JSON) form of one entry, as :meth:`PersistentCache.put` writes it."""
    return {
        "config": converter.unstructure(cfg),
        "config_type": _type_name(cfg),
        "source": source,
        "created": time.time(),
        **dict(meta or {}),
    }


def structure_entry(raw: Mapping[str, Any], config_type: Any = None) -> Any:
    """The config of a stored entry, structured into ``config_type`` (default: the stored
    type). Raises when it no longer structures."""
    cls = config_type if config_type is not None else resolve(raw["config_type"])
    return converter.structure(raw["config"], cls)


def write_export(path: str | os.PathLike[str], entries: Mapping[str, Any]) -> int:
    """Write ``entries`` to ``path`` as a cache export (``{"schema", "entries"}``); returns
    the count."""
    Path(path).write_text(
        json.dumps({"schema": SCHEMA_VERSION, "entries": entries}, sort_keys=True, indent=1)
    )
    return len(entries)


def read_export(path: str | os.PathLike[str], verb: str) -> dict[str, Any]:
    """The entries of a cache export at ``path``.

    Raises:
        ValueError: ``cannot <verb> <path>: ...`` when the file cannot be read or is not an
            export of this schema.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot {verb} {path}: {err}") from err
    if (
        not isinstance(doc, dict)
        or doc.get("schema") != SCHEMA_VERSION
        or not isinstance(doc.get("entries"), dict)
    ):
        raise ValueError(
            f"cannot {verb} {path}: not an ejkernel cache export of schema {SCHEMA_VERSION}"
        )
    return doc["entries"]


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive inter-process lock on the file ``path`` (created when missing) for
    the ``with`` block: fcntl on POSIX, msvcrt on Windows. The persistent cache writes under
    one; a plugin's own files in the cache folder (compiled kernels) may too."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except ImportError:  # Windows
            import msvcrt

            msvcrt.locking(fd, msvcrt.LK_LOCK, 1)  # type: ignore[attr-defined]
        yield
    finally:
        os.close(fd)  # closing releases the lock


class PersistentCache:
    """Configs on disk, shared by processes and sessions.

    Args:
        path: the cache folder; default ``EJKERNEL_CACHE_DIR`` (read at each use), else
            ``$XDG_CACHE_HOME/ejkernel``, else ``~/.cache/ejkernel``.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._path = Path(path).expanduser() if path is not None else None
        self._lock = threading.Lock()
        self._data: dict[str, dict[str, Any]] = {}
        self._stamp: tuple[str, float, int] | None = None

    @property
    def directory(self) -> Path:
        return self._path if self._path is not None else _env.cache_dir()

    @property
    def file(self) -> Path:
        return self.directory / FILE_NAME

    # -- reading ------------------------------------------------------------------------------
    def _read_file(self) -> dict[str, dict[str, Any]]:
        """Entries on disk; a corrupt or foreign file is set aside with a warning."""
        f = self.file
        try:
            text = f.read_text()
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as err:
            warn_once(
                CacheWarning,
                str(f),
                f"ejkernel cache {f} cannot be read ({err}); continuing without it",
            )
            return {}
        try:
            doc = json.loads(text)
            if (
                not isinstance(doc, dict)
                or doc.get("schema") != SCHEMA_VERSION
                or not isinstance(doc.get("entries"), dict)
            ):
                raise ValueError(f"not an ejkernel cache of schema {SCHEMA_VERSION}")
            return {k: v for k, v in doc["entries"].items() if isinstance(v, dict)}
        except ValueError as err:
            aside = f.with_name(f"{FILE_NAME}.corrupt-{int(time.time() * 1000)}")
            try:
                os.replace(f, aside)
                where = f"moved to {aside.name}"
            except OSError:
                where = "left in place"
            warn_once(
                CacheWarning,
                str(f),
                f"ejkernel cache {f} is corrupt ({err}); {where}, starting afresh",
            )
            return {}

    def _refresh(self) -> dict[str, dict[str, Any]]:
        f = self.file
        try:
            st = f.stat()
            stamp = (str(f), st.st_mtime, st.st_size)
        except OSError:
            stamp = (str(f), 0.0, -1)
        if stamp != self._stamp:
            with self._lock:
                self._data = self._read_file()
                self._stamp = stamp
        return self._data

    def raw(self, key: str) -> dict[str, Any] | None:
        """The stored entry (JSON dict) for ``key``."""
        return self._refresh().get(key)

    def get(self, key: str, config_type: Any = None, default: Any = None) -> Any:
        """The config for ``key`` structured into ``config_type`` (default: the stored type).

        An entry that no longer structures into its class is ignored (``default`` returned).
        """
        raw = self.raw(key)
        if raw is None:
            return default
        try:
            return structure_entry(raw, config_type)
        except Exception:
            return default

    def entry(self, key: str, config_type: Any = None) -> CacheEntry | None:
        raw = self.raw(key)
        cfg = self.get(key, config_type)
        if raw is None or cfg is None:
            return None
        return CacheEntry(config=cfg, source=str(raw.get("source", "manual")), meta=raw)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self._refresh()

    def __len__(self) -> int:
        return len(self._refresh())

    def entries(self) -> dict[str, dict[str, Any]]:
        return dict(self._refresh())

    # -- writing ------------------------------------------------------------------------------
    def put(
        self, key: str, cfg: Any, *, source: str = "manual", meta: Mapping[str, Any] | None = None
    ) -> bool:
        """Store ``cfg``; returns False (with one warning) when the folder is not writable."""
        return self._update({key: make_entry(cfg, source=source, meta=meta)})

    def merge(self, entries: Mapping[str, Mapping[str, Any]]) -> int:
        """Add entries (e.g. imported ones); returns how many were written."""
        clean = {k: dict(v) for k, v in entries.items() if isinstance(v, Mapping) and "config" in v}
        return len(clean) if clean and self._update(clean) else 0

    def delete(self, keys: list[str] | None = None) -> int:
        """Remove ``keys`` (all when None); returns how many went."""
        removed = 0

        def edit(data: dict[str, Any]) -> None:
            nonlocal removed
            for k in list(data) if keys is None else keys:
                removed += data.pop(k, None) is not None

        self._transact(edit)
        return removed

    def _update(self, new: Mapping[str, dict[str, Any]]) -> bool:
        return self._transact(lambda data: data.update(new))

    def _transact(self, edit: Any) -> bool:
        d = self.directory
        try:
            d.mkdir(parents=True, exist_ok=True)
            with self._lock, file_lock(d / f"{FILE_NAME}.lock"):
                data = self._read_file()
                edit(data)
                doc = {"schema": SCHEMA_VERSION, "entries": data}
                fd, tmp = tempfile.mkstemp(prefix=f".{FILE_NAME}.", dir=d)
                try:
                    with os.fdopen(fd, "w") as fh:
                        json.dump(doc, fh, sort_keys=True, indent=1)
                    os.replace(tmp, self.file)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
                self._data, self._stamp = data, None
            return True
        except OSError as err:
            warn_once(
                CacheWarning,
                str(d),
                f"ejkernel cache folder {d} is not writable ({err}); configs stay in memory",
            )
            return False

    def export(self, path: str | os.PathLike[str]) -> int:
        """Write every entry to ``path`` (a cache file of the same schema); returns the count."""
        return write_export(path, self.entries())

    def import_(self, path: str | os.PathLike[str]) -> int:
        """Merge the entries of an exported file; returns the count. Bad files raise ValueError."""
        return self.merge(read_export(path, "import"))
