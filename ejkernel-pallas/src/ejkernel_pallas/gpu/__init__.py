"""Pallas kernels lowered through Mosaic GPU, for Hopper GPUs (sm_90)."""

from __future__ import annotations

import jax

from ejkernel import env


def _compute_capability() -> tuple[int, int] | None:
    try:
        major, minor = str(jax.devices()[0].compute_capability).split(".")
        return int(major), int(minor)
    except Exception:  # not a CUDA device (interpret mode, ROCm): say nothing
        return None


def hopper_reason(who_needs: str) -> str | None:
    """Why the kernels cannot run on this GPU: it is older than Hopper (sm_90). The reason
    starts with ``who_needs`` (``"the Pallas Mosaic GPU kernels need"``). ``None`` in
    interpret mode, on Hopper or later, or where the device reports no compute capability."""
    if env.interpret():
        return None
    cc = _compute_capability()
    if cc is not None and cc < (9, 0):
        return f"{who_needs} Hopper (sm_90+); this GPU is sm_{cc[0]}{cc[1]}"
    return None
