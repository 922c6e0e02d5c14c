"""Fixtures of the core tests."""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

import pytest

from ejkernel.plugins import register_plugin


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The toy plugin (``toy.py`` beside this file): flash attention only, on platform "toy",
    with entry-point discovery off so it is the only plugin."""
    monkeypatch.setenv("EJKERNEL_PLUGINS_AUTOLOAD", "0")
    path = pathlib.Path(__file__).with_name("toy.py")
    spec = importlib.util.spec_from_file_location("ejkernel_test_toy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    register_plugin(module, name="toy")
    return module


@pytest.fixture
def tables(toy: ModuleType) -> ModuleType:
    """Helpers that build shipped tables for the toy plugin (``_shipped_helpers.py``)."""
    path = pathlib.Path(__file__).with_name("_shipped_helpers.py")
    spec = importlib.util.spec_from_file_location("ejkernel_test_shipped_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
