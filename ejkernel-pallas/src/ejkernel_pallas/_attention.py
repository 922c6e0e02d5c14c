"""What the Pallas flash-attention kernels share: config, declined features, block spans.

Masking is :mod:`ejkernel.attention_semantics`: its :class:`~ejkernel.attention_semantics.Geometry`
answers which blocks a kernel may skip, and the spans below clamp its block ranges into index
maps, so the kernels never fetch a hidden block. They take Python ints or traced int32 scalars.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax.numpy as jnp

from ejkernel.attention_semantics import Geometry
from ejkernel.plugins import BwdParams, FwdParams

__all__ = ["FlashAttentionConfig", "declined_features", "kv_block_span", "q_block_span"]


@attrs.frozen(kw_only=True)
class FlashAttentionConfig:
    """Tunables of the Pallas flash attention (same shape as the XLA plugin's config).

    Attributes:
        fwd_params: forward blocks (``q_blocksize``, ``kv_blocksize``; ``num_stages`` is the
            depth of the GPU kernels' key/value pipeline). ``None`` fields take the defaults.
        bwd_params: the same for the backward kernels.
    """

    fwd_params: FwdParams = attrs.field(factory=FwdParams)
    bwd_params: BwdParams = attrs.field(factory=BwdParams)


def declined_features(kw: Any) -> str | None:
    """The first feature of the call the Pallas kernels do not implement, as a reason."""
    for name, why in (
        ("bias", "an additive bias"),
        ("attention_mask", "a dense attention_mask"),
        ("softmax_aux", "attention sinks (softmax_aux)"),
    ):
        if kw.get(name) is not None:
            return f"the Pallas kernels do not implement {why}; the XLA plugin serves it"
    if float(kw.get("dropout_prob") or 0.0) > 0.0:
        return "the Pallas kernels do not implement dropout; the XLA plugin serves it"
    return None


def kv_block_span(geo: Geometry, i: Any, bq: int, bk: int, nk: int) -> tuple[Any, Any]:
    """``[first, last]`` kv blocks query block ``i`` needs, clamped to ``[0, nk - 1]``: an index
    map's range. A block that sees nothing still maps to a valid block (its compute is skipped
    by :meth:`~ejkernel.attention_semantics.Geometry.block_may_see`)."""
    first, end = geo.kv_blocks(i, bq, bk)
    last = jnp.clip(end - 1, 0, nk - 1)
    return jnp.clip(first, 0, last), last


def q_block_span(geo: Geometry, j: Any, bq: int, bk: int, nq: int) -> tuple[Any, Any]:
    """``[first, last]`` query blocks that see kv block ``j``, clamped to ``[0, nq - 1]``."""
    first, end = geo.q_blocks(j, bq, bk)
    last = jnp.clip(end - 1, 0, nq - 1)
    return jnp.clip(first, 0, last), last
