"""Tunable parameter carriers shared by attention configs (the seeds' FwdParams/BwdParams)."""

from __future__ import annotations

import attrs

__all__ = ["BwdParams", "FwdParams"]


@attrs.frozen(kw_only=True)
class FwdParams:
    """Forward-pass tunables; a platform ignores the fields it has no use for.

    Attributes:
        q_blocksize: query rows per block.
        kv_blocksize: key/value rows per block.
        num_warps: GPU warps per program (Triton, Pallas GPU).
        num_stages: software-pipelining stages (Triton, Pallas GPU).
    """

    q_blocksize: int | None = None
    kv_blocksize: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


@attrs.frozen(kw_only=True)
class BwdParams:
    """Backward-pass tunables, as :class:`FwdParams`."""

    q_blocksize: int | None = None
    kv_blocksize: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
