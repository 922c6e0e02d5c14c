"""Utilities of the kernel framework (the seeds' import paths)."""

from __future__ import annotations

from ejkernel._params import BwdParams, FwdParams

__all__ = ["BwdParams", "FwdParams"]
