"""Recorded invocations of this process (the recording entry points fill it)."""

from __future__ import annotations

from typing import Any

__all__ = ["get_invocations"]

_INVOCATIONS: list[Any] = []


def get_invocations() -> list[Any]:
    """Every invocation recorded so far in this process (a copy)."""
    return list(_INVOCATIONS)
