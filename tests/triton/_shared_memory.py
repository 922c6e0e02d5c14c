"""Config spaces with and without a shared-memory limit (``EJKERNEL_SHARED_MEMORY_LIMIT``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def spaces_with_and_without_limit(
    monkeypatch: pytest.MonkeyPatch, config_space: Callable[[], list[Any]], limit: int
) -> tuple[list[Any], list[Any]]:
    """``(every, kept)``: ``config_space()`` with no shared-memory limit, then with ``limit``
    bytes per block."""
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", "none")
    every = config_space()
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", str(limit))
    return every, config_space()
