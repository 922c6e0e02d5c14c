"""What the Pallas flash-attention kernels share: config, declined features, shapes, block spans.

Masking is :mod:`ejkernel.attention_semantics`: its :class:`~ejkernel.attention_semantics.Geometry`
answers which blocks a kernel may skip, and the spans below clamp its block ranges into index
maps, so the kernels never fetch a hidden block. They take Python ints or traced int32 scalars.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import jax.numpy as jnp

from ejkernel.attention_semantics import Geometry
from ejkernel.ops import unique_configs
from ejkernel.plugins import BwdParams, FwdParams

__all__ = [
    "FlashAttentionConfig",
    "Shapes",
    "blocks_config",
    "declined_features",
    "kv_block_span",
    "q_block_span",
    "refuse_declined",
    "unique_configs",
]


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


def blocks_config(fwd: Sequence[int], bwd: Sequence[int]) -> FlashAttentionConfig:
    """The config of ``(q_blocksize, kv_blocksize[, num_stages])`` for each pass."""
    names = ("q_blocksize", "kv_blocksize", "num_stages")
    return FlashAttentionConfig(
        fwd_params=FwdParams(**dict(zip(names, fwd))),
        bwd_params=BwdParams(**dict(zip(names, bwd))),
    )


#: Arguments no Pallas kernel implements, and how a reason names them.
DECLINED = (
    ("bias", "an additive bias"),
    ("attention_mask", "a dense attention_mask"),
    ("softmax_aux", "attention sinks (softmax_aux)"),
)


def declined_features(
    kw: Any, also: Iterable[tuple[str, str]] = (), kernels: str = "the Pallas kernels"
) -> str | None:
    """The first feature of the call that ``kernels`` do not implement (:data:`DECLINED`, then
    the ``also`` pairs of argument and name, then dropout), as a reason; ``None`` if none."""
    for name, why in (*DECLINED, *also):
        if kw.get(name) is not None:
            return f"{kernels} do not implement {why}; the XLA plugin serves it"
    if float(kw.get("dropout_prob") or 0.0) > 0.0:
        return f"{kernels} do not implement dropout; the XLA plugin serves it"
    return None


def refuse_declined(kw: Any, also: Iterable[tuple[str, str]] = ()) -> None:
    """Raise ``NotImplementedError`` for a call ``supports()`` declines (reached only by calling
    an implementation directly)."""
    reason = declined_features(kw, also)
    if reason is not None:
        raise NotImplementedError(f"ejkernel_pallas flash attention: {reason}")


@attrs.frozen(kw_only=True)
class Shapes:
    """Sizes of one call: query [b, sq, hq, d], key [b, sk, hkv, d], value [b, sk, hkv, dv]."""

    b: int
    sq: int
    sk: int
    hq: int
    hkv: int
    d: int
    dv: int

    @classmethod
    def of(cls, query: Any, key: Any, value: Any = None) -> Shapes:
        """From the arrays (or their shapes); without ``value``, ``dv = d``."""
        b, sq, hq, d = query.shape
        _, sk, hkv, _ = key.shape
        dv = d if value is None else value.shape[3]
        return cls(b=b, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, dv=dv)

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.hq // self.hkv


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
