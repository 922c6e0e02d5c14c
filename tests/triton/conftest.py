"""Fixtures shared by the Triton tests."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the kernels through Triton's interpreter (only where the default device is a CPU)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the interpreter runs where the default device is a CPU")
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")
