"""Every test of the plugin runs with its own ejkernel cache folder and a fresh plugin set."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _isolated_ejkernel(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from ejkernel import plugins

    monkeypatch.setenv("EJKERNEL_CACHE_DIR", str(tmp_path / "ejkernel-cache"))
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
    for name in ("EJKERNEL_PLATFORM", "EJKERNEL_DISABLE_PLUGINS", "EJKERNEL_PLUGINS_AUTOLOAD"):
        monkeypatch.delenv(name, raising=False)
    plugins.reset()
    yield
    plugins.reset()
