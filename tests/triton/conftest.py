"""Fixtures shared by the Triton tests."""

from __future__ import annotations

from typing import Any

import jax
import pytest


def _interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    if jax.default_backend() != "cpu":
        pytest.skip("the interpreter runs where the default device is a CPU")
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the kernels through Triton's interpreter (only where the default device is a CPU)."""
    _interpreting(monkeypatch)


@pytest.fixture(
    params=[
        pytest.param("interpret", id="interpret"),
        pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
    ]
)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test twice: ``"interpret"`` (through :func:`interpret`'s interpreter) and ``"gpu"``
    (compiled, marked ``gpu``)."""
    if request.param == "interpret":
        _interpreting(monkeypatch)
    return request.param


@pytest.fixture
def triton_cache_in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Triton's kernel cache in the test's temporary folder: each compile is the compiler's
    own, never a kernel an earlier run left behind."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))


@pytest.fixture
def hopper_compile(triton_cache_in_tmp: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels compiled, not interpreted, in :func:`triton_cache_in_tmp`'s cache, under the
    H100's shared memory."""
    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", "232448")
