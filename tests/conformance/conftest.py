"""The conformance kit runs every in-tree implementation: the Triton and Pallas kernels through
their interpreters on a CPU (``EJKERNEL_INTERPRET=1`` for these tests only, so the rest of the
suite, in the same run, sees the plugins as a user without the interpreter does)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _interpreters_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")
