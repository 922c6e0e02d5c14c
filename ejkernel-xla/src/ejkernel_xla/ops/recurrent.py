"""recurrent on XLA: the gated linear recurrence, chunked.

Pure JAX. The recurrence ``h_t = h_{t-1} ⊙ exp(gk_t)[:, None] ⊙ exp(gv_t)[None, :] + k_tᵀ v_t``,
``o_t = scale · q_t h_t`` (log-space gates; ``recurrent``'s ``g`` and ``gk`` add into one key
gate) is computed in chunks, the form of GLA (Yang et al., 2024, "Gated Linear Attention
Transformers with Hardware-Efficient Training", Sec. 4): parallel inside a chunk of C tokens,
recurrent across chunks. This module is the op's adapter (config, heuristic, config space,
entry point and its forward/backward); the engine, shared with gla and lightning_attention,
is :mod:`ejkernel_xla.ops._chunked`, whose docstring gives the algorithm: gate forms, the
streamed forward, ``cu_seqlens`` layout, costs and the backward from saved chunk-start states.

Accumulation is float32 (inputs are cast once); the output keeps the query dtype and the final
state is float32. It declines nothing (no ``supports``): every valid call runs on every backend.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.plugins import defvjp
from ejkernel_xla.ops._chunked import (
    LinearStatics,
    chunk_sizes,
    linear_attention_backward,
    linear_attention_forward,
)

__all__ = [
    "RecurrentConfig",
    "config_space",
    "heuristic",
    "recurrent_xla",
]

#: (chunk, sub-chunk) pairs :func:`config_space` offers.
_TUNING_CHUNKS: tuple[tuple[int, int], ...] = (
    (32, 8),
    (32, 16),
    (64, 16),
    (64, 32),
    (128, 16),
    (128, 32),
)


@attrs.frozen(kw_only=True)
class RecurrentConfig:
    """Tunables of the chunked XLA recurrence (also used by gla and lightning_attention).

    Attributes:
        chunk_size: tokens per chunk (parallel inside, recurrent across); ``None`` takes the
            backend's default. Clamped to the sequence length rounded up to a power of two.
        sub_chunk_size: tokens per sub-chunk for gates over K or V; must divide
            ``chunk_size``; ``None`` takes the default (clamped to the chunk).
    """

    chunk_size: int | None = None
    sub_chunk_size: int | None = None


def heuristic(inv: Any) -> RecurrentConfig:
    """The backend's default chunk sizes, smaller for short sequences or short packed ones."""
    chunk, sub = chunk_sizes(inv.kwargs, None)
    return RecurrentConfig(chunk_size=chunk, sub_chunk_size=sub)


def config_space(inv: Any) -> list[RecurrentConfig]:
    """The heuristic's config, then a few (chunk, sub-chunk) pairs, clamped and deduplicated."""
    configs = [heuristic(inv)]
    for chunk, sub in _TUNING_CHUNKS:
        size = chunk_sizes(inv.kwargs, RecurrentConfig(chunk_size=chunk, sub_chunk_size=sub))
        cfg = RecurrentConfig(chunk_size=size[0], sub_chunk_size=size[1])
        if cfg not in configs:
            configs.append(cfg)
    return configs


def recurrent_xla(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g: jax.Array | None = None,
    gk: jax.Array | None = None,
    gv: jax.Array | None = None,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    reverse: bool = False,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    cfg: RecurrentConfig | None = None,
) -> Any:
    """Gated linear recurrence, chunked (arguments as validated by the core spec).

    Args:
        query: [B, S, H, K].
        key: [B, S, H, K].
        value: [B, S, H, V].
        g: [B, S, H] scalar log gate per head, or ``None``.
        gk: [B, S, H, K] log gate of the K axis, or ``None``.
        gv: [B, S, H, V] log gate of the V axis, or ``None``.
        initial_state: [N, H, K, V] or ``None`` (zeros).
        softmax_scale: scales the query; ``None`` means K ** -0.5.
        reverse: run from the last token to the first.
        cu_seqlens: [N + 1] packed-sequence offsets (B == 1), or ``None``.
        return_state: also return the final states [N, H, K, V] (float32).
        cfg: chunk sizes; ``None`` takes the defaults.

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state)``.
    """
    out, _ = _recurrent_fwd(
        query=query,
        key=key,
        value=value,
        g=g,
        gk=gk,
        gv=gv,
        initial_state=initial_state,
        softmax_scale=softmax_scale,
        reverse=reverse,
        cu_seqlens=cu_seqlens,
        return_state=return_state,
        cfg=cfg,
        residuals=False,
    )
    return out


def _recurrent_fwd(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g: jax.Array | None = None,
    gk: jax.Array | None = None,
    gv: jax.Array | None = None,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    reverse: bool = False,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    cfg: RecurrentConfig | None = None,
    residuals: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """Forward of :func:`recurrent_xla`: ``(out, residuals)``; residuals are the inputs and the
    chunk-start states."""
    arrays = {
        "query": query,
        "key": key,
        "value": value,
        "g": g,
        "gk": gk,
        "gv": gv,
        "initial_state": initial_state,
        "cu_seqlens": cu_seqlens,
    }
    st = LinearStatics.of(
        arrays, cfg, softmax_scale=softmax_scale, reverse=reverse, return_state=return_state
    )
    return linear_attention_forward(arrays, st, _recurrent_gates, residuals=residuals)


def _recurrent_bwd(
    residuals: dict[str, Any],
    d_out: Any,
    *,
    cfg: RecurrentConfig | None = None,
    softmax_scale: float | None = None,
    reverse: bool = False,
    return_state: bool = False,
) -> dict[str, jax.Array | None]:
    """Backward of :func:`recurrent_xla`: gradients of q, k, v, g, gk, gv and initial_state."""
    st = LinearStatics.of(
        residuals["arrays"],
        cfg,
        softmax_scale=softmax_scale,
        reverse=reverse,
        return_state=return_state,
    )
    return linear_attention_backward(residuals, d_out, st, _recurrent_gates)


defvjp(recurrent_xla, _recurrent_fwd, _recurrent_bwd)


def _recurrent_gates(a: dict[str, Any]) -> tuple[jax.Array | None, jax.Array | None]:
    """``g`` and ``gk`` add into one key gate ([B, S, H, 1] when only ``g`` is given)."""
    g, gk, gv = a["g"], a["gk"], a["gv"]
    key_gate = None
    if g is not None:
        key_gate = g.astype(jnp.float32)[..., None]
    if gk is not None:
        key_gate = gk.astype(jnp.float32) if key_gate is None else key_gate + gk.astype(jnp.float32)
    return key_gate, None if gv is None else gv.astype(jnp.float32)
