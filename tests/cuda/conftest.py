"""Fixtures shared by the CUDA plugin's tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Selection sees a GPU backend and an available cuda platform; the other GPU plugins
    (triton, pallas) are disabled so the fallback is the XLA plugin."""
    from ejkernel import _selection
    from ejkernel_cuda import _device

    monkeypatch.setattr(_selection, "current_backend", lambda: "gpu")
    monkeypatch.setattr(_device, "available", lambda backend: True)
    monkeypatch.setenv("EJKERNEL_DISABLE_PLUGINS", "triton,pallas")
