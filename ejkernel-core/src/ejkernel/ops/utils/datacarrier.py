"""Parameter carriers (``from ejkernel.ops.utils.datacarrier import FwdParams``, as in the seeds)."""

from __future__ import annotations

from ejkernel._params import BwdParams, FwdParams

__all__ = ["BwdParams", "FwdParams"]
