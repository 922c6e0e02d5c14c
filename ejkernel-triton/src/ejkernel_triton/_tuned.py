"""The plugin's tables of tuned configs: JSON files beside the plugin (``tuned/<op>.json``).

A table is ``{"version": 1, "entries": [...]}``. Each entry names the devices it was tuned
on (``"device"``: a substring of JAX's ``device_kind``, a list of them, or ``"default"`` for
any device) plus the shape class it matches and the settings it holds; what the keys mean
is up to the op's heuristic, which reads :func:`entries`. Entries of the device come first,
in file order, then the ``"default"`` ones.

A table is read once per process, on first use. A missing, unreadable or malformed file is
reported once as a :class:`~ejkernel.errors.PluginWarning` and read as empty: the heuristic
then falls back to its generic defaults.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from ejkernel.errors import PluginWarning, warn_once

__all__ = ["TABLE_VERSION", "entries", "load"]

#: The format version this plugin reads.
TABLE_VERSION = 1

#: Where the tables live (package data; tests point it elsewhere).
FOLDER = Path(__file__).parent / "tuned"


def load(path: Path) -> tuple[dict[str, Any], ...]:
    """The entries of the table at ``path``; ``()`` (with a warning) if it cannot be used."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return _unusable(path, f"{type(err).__name__}: {err}")
    if not isinstance(data, dict) or data.get("version") != TABLE_VERSION:
        version = data.get("version") if isinstance(data, dict) else None
        return _unusable(path, f"version {version!r}, expected {TABLE_VERSION}")
    found = data.get("entries")
    if not isinstance(found, list) or not all(isinstance(e, dict) for e in found):
        return _unusable(path, "'entries' must be a list of objects")
    return tuple(found)


@functools.cache
def _table(op: str) -> tuple[dict[str, Any], ...]:
    return load(FOLDER / f"{op}.json")


def entries(op: str, device_kind: str) -> list[dict[str, Any]]:
    """The entries of ``op``'s table for a device of kind ``device_kind``: those naming it
    first, then the ``"default"`` ones, each group in file order."""
    own, default = [], []
    for entry in _table(op):
        device = entry.get("device", "default")
        names = [device] if isinstance(device, str) else list(device)
        if names == ["default"]:
            default.append(entry)
        elif any(isinstance(n, str) and n and n in device_kind for n in names):
            own.append(entry)
    return own + default


def _unusable(path: Path, why: str) -> tuple[dict[str, Any], ...]:
    warn_once(
        PluginWarning,
        f"ejkernel_triton table {path}",
        f"ejkernel-triton: tuned table {path} is not used ({why}); generic defaults apply",
    )
    return ()
