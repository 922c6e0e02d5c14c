"""lightning_attention on XLA: chunked linear attention with per-head decay, custom VJP.

Lightning attention (MiniMax-01, arXiv:2501.08313; Qin et al., 2024, "Lightning Attention-2")
is ``recurrent`` with the per-head scalar log gate ``g = -slopes[h]`` at every token, so it runs
the chunked engine of :mod:`ejkernel_xla.ops._chunked` on its scalar-gate path: inside a chunk
``((q kᵀ) ⊙ exp(-slope · (t - s)) ⊙ [s ≤ t]) v``, across chunks the carried state decayed by
``exp(-slope · (t + 1))``, both with non-positive exponents only (Lightning Attention-2's intra /
inter split). The slopes arrive built by the core spec when ``(layer_idx, num_layers)`` is given
(MiniMax-01's formula, :func:`ejkernel.specs.lightning_attention.lightning_slopes`), and get a
gradient like any gate. See the engine module for the ``cu_seqlens`` layout and the backward
from saved chunk-start states.

Tunable: ``chunk_size``. It declines nothing (no ``supports``). The entry point, forward and
backward are the linear family's shared adapter, :mod:`ejkernel_xla.ops._chunked_op`.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.plugins import defvjp
from ejkernel_xla.ops import _chunked_op as adapter

__all__ = [
    "LightningAttentionConfig",
    "config_space",
    "heuristic",
    "lightning_attention_xla",
]

#: Chunk sizes :func:`config_space` offers (the scalar-gate path has no sub-chunks).
_TUNING_CHUNKS = (32, 64, 128, 256)


@attrs.frozen(kw_only=True)
class LightningAttentionConfig:
    """Tunables of the chunked XLA lightning attention.

    Attributes:
        chunk_size: tokens per chunk; ``None`` takes the backend's default (clamped to the
            sequence length rounded up to a power of two).
    """

    chunk_size: int | None = None


def heuristic(inv: Any) -> LightningAttentionConfig:
    """The backend's default chunk size, smaller for short (packed) sequences."""
    return adapter.heuristic(inv, LightningAttentionConfig)


def config_space(inv: Any) -> list[LightningAttentionConfig]:
    """The heuristic's config, then a few chunk sizes, clamped and deduplicated."""
    tuning = [(chunk, None) for chunk in _TUNING_CHUNKS]
    return adapter.config_space(inv, LightningAttentionConfig, tuning)


def lightning_attention_xla(*, cfg: LightningAttentionConfig | None = None, **args: Any) -> Any:
    """Lightning attention, chunked: the op's arguments
    (:func:`ejkernel.specs.lightning_attention.lightning_attention`, validated by the core) as
    keywords, and the chunk size ``cfg`` (``None``: the default). ``layer_idx`` and
    ``num_layers`` are unused here: the core has folded them into ``slopes``.

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state)``.
    """
    return adapter.primal(args, cfg, _lightning_gates)


def _lightning_gates(a: dict[str, Any]) -> tuple[jax.Array, None]:
    """The scalar log gate ``-slopes[h]`` at every token, [B, S, H, 1]."""
    b, s, h, _ = a["query"].shape
    gate = -a["slopes"].astype(jnp.float32)[None, None, :, None]
    return jnp.broadcast_to(gate, (b, s, h, 1)), None


defvjp(
    lightning_attention_xla,
    functools.partial(adapter.forward, gates=_lightning_gates),
    functools.partial(adapter.backward, gates=_lightning_gates),
)
