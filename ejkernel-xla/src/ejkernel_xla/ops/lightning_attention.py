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

Tunable: ``chunk_size``. It declines nothing (no ``supports``).
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.plugins import defvjp
from ejkernel_xla.ops import _chunked as _engine

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
    return LightningAttentionConfig(chunk_size=_engine.chunk_sizes(inv.kwargs, None)[0])


def config_space(inv: Any) -> list[LightningAttentionConfig]:
    """The heuristic's config, then a few chunk sizes, clamped and deduplicated."""
    configs = [heuristic(inv)]
    for chunk in _TUNING_CHUNKS:
        cfg = LightningAttentionConfig(
            chunk_size=_engine.chunk_sizes(inv.kwargs, LightningAttentionConfig(chunk_size=chunk))[
                0
            ]
        )
        if cfg not in configs:
            configs.append(cfg)
    return configs


def lightning_attention_xla(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    slopes: jax.Array,
    layer_idx: int | None = None,
    num_layers: int | None = None,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    cfg: LightningAttentionConfig | None = None,
) -> Any:
    """Lightning attention, chunked (arguments as validated by the core spec).

    Args:
        query: [B, S, H, K].
        key: [B, S, H, K].
        value: [B, S, H, V].
        slopes: [H] decay rates (the core builds them from ``layer_idx``/``num_layers``).
        layer_idx: unused here (already folded into ``slopes``).
        num_layers: unused here (already folded into ``slopes``).
        initial_state: [N, H, K, V] or ``None`` (zeros).
        softmax_scale: scales the query; ``None`` means K ** -0.5.
        cu_seqlens: [N + 1] packed-sequence offsets (B == 1), or ``None``.
        return_state: also return the final states [N, H, K, V] (float32).
        cfg: chunk size; ``None`` takes the default.

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state)``.
    """
    out, _ = _lightning_attention_fwd(
        query=query,
        key=key,
        value=value,
        slopes=slopes,
        layer_idx=layer_idx,
        num_layers=num_layers,
        initial_state=initial_state,
        softmax_scale=softmax_scale,
        cu_seqlens=cu_seqlens,
        return_state=return_state,
        cfg=cfg,
        residuals=False,
    )
    return out


def _lightning_attention_fwd(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    slopes: jax.Array,
    layer_idx: int | None = None,
    num_layers: int | None = None,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    cfg: LightningAttentionConfig | None = None,
    residuals: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """Forward of :func:`lightning_attention_xla`: ``(out, residuals)``."""
    del layer_idx, num_layers
    arrays = {
        "query": query,
        "key": key,
        "value": value,
        "slopes": slopes,
        "initial_state": initial_state,
        "cu_seqlens": cu_seqlens,
    }
    st = _engine.LinearStatics.of(
        arrays, cfg, softmax_scale=softmax_scale, return_state=return_state
    )
    return _engine.linear_attention_forward(arrays, st, _lightning_gates, residuals=residuals)


def _lightning_attention_bwd(
    residuals: dict[str, Any],
    d_out: Any,
    *,
    cfg: LightningAttentionConfig | None = None,
    softmax_scale: float | None = None,
    return_state: bool = False,
    layer_idx: int | None = None,
    num_layers: int | None = None,
) -> dict[str, jax.Array | None]:
    """Backward of :func:`lightning_attention_xla`: gradients of q, k, v, slopes, initial_state."""
    del layer_idx, num_layers
    st = _engine.LinearStatics.of(
        residuals["arrays"], cfg, softmax_scale=softmax_scale, return_state=return_state
    )
    return _engine.linear_attention_backward(residuals, d_out, st, _lightning_gates)


defvjp(lightning_attention_xla, _lightning_attention_fwd, _lightning_attention_bwd)


def _lightning_gates(a: dict[str, Any]) -> tuple[jax.Array, None]:
    """The scalar log gate ``-slopes[h]`` at every token, [B, S, H, 1]."""
    b, s, h, _ = a["query"].shape
    gate = -a["slopes"].astype(jnp.float32)[None, None, :, None]
    return jnp.broadcast_to(gate, (b, s, h, 1)), None
