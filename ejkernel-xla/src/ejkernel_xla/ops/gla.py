"""gla on XLA: chunked gated linear attention with a custom VJP.

``gla`` is ``recurrent`` with the key gate ``gk = g`` [B, S, H, K] and no other gate, so it runs
the chunked engine of :mod:`ejkernel_xla.ops._chunked` (GLA, Yang et al., 2024, Sec. 4):
parallel inside chunks, a scan over chunk states across them. Inside a chunk the decays are
differences of cumulative log gates from the chunk start; when every chunk's gates stay within
±80 of its start (GLA's ``log_sigmoid(x) / 16`` gates always do) the intra-chunk part is two
matmuls, otherwise it takes the two-level form with per-sub-chunk reference points of
flash-linear-attention's ``chunk_gla``, exact for any gates. See that module for the
algorithm, the chunk-aligned ``cu_seqlens`` layout, the streamed forward (one scan step per
chunk of a batch row, all heads, in cache; the primal call builds no backward residuals), its
flop and byte counts against the sequential scan, and the backward from saved chunk-start
states.

Tunables: ``chunk_size`` (tokens per chunk) and ``sub_chunk_size`` (tokens per sub-chunk of the
two-level form; its pairwise decays are [c, c, K]). It declines nothing (no ``supports``).
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.plugins import defvjp
from ejkernel_xla.ops import _chunked as _engine
from ejkernel_xla.ops import recurrent

__all__ = ["GlaConfig", "config_space", "gla_xla", "heuristic"]


@attrs.frozen(kw_only=True)
class GlaConfig:
    """Tunables of the chunked XLA gla.

    Attributes:
        chunk_size: tokens per chunk; ``None`` takes the backend's default (clamped to the
            sequence length rounded up to a power of two).
        sub_chunk_size: tokens per sub-chunk, dividing ``chunk_size``; ``None``: default.
    """

    chunk_size: int | None = None
    sub_chunk_size: int | None = None


def heuristic(inv: Any) -> GlaConfig:
    """The backend's default chunk sizes, smaller for short (packed) sequences."""
    chunk, sub = _engine.chunk_sizes(inv.kwargs, None)
    return GlaConfig(chunk_size=chunk, sub_chunk_size=sub)


def config_space(inv: Any) -> list[GlaConfig]:
    """The heuristic's config, then a few (chunk, sub-chunk) pairs, clamped and deduplicated."""
    return [GlaConfig(**attrs.asdict(c)) for c in recurrent.config_space(inv)]


def gla_xla(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g: jax.Array,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    cfg: GlaConfig | None = None,
) -> Any:
    """Gated linear attention, chunked (arguments as validated by the core spec).

    Args:
        query: [B, S, H, K].
        key: [B, S, H, K].
        value: [B, S, H, V].
        g: [B, S, H, K] log gate of the state's K axis.
        initial_state: [N, H, K, V] or ``None`` (zeros).
        softmax_scale: scales the query; ``None`` means K ** -0.5.
        cu_seqlens: [N + 1] packed-sequence offsets (B == 1), or ``None``.
        return_state: also return the final states [N, H, K, V] (float32).
        cfg: chunk sizes; ``None`` takes the defaults.

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state)``.
    """
    out, _ = _gla_fwd(
        query=query,
        key=key,
        value=value,
        g=g,
        initial_state=initial_state,
        softmax_scale=softmax_scale,
        cu_seqlens=cu_seqlens,
        return_state=return_state,
        cfg=cfg,
        residuals=False,
    )
    return out


def _gla_fwd(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g: jax.Array,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    cfg: GlaConfig | None = None,
    residuals: bool = True,
) -> tuple[Any, dict[str, Any]]:
    """Forward of :func:`gla_xla`: ``(out, residuals)`` (inputs and chunk-start states)."""
    arrays = {
        "query": query,
        "key": key,
        "value": value,
        "g": g,
        "initial_state": initial_state,
        "cu_seqlens": cu_seqlens,
    }
    st = _engine.LinearStatics.of(
        arrays, cfg, softmax_scale=softmax_scale, return_state=return_state
    )
    return _engine.linear_attention_forward(arrays, st, _gla_gates, residuals=residuals)


def _gla_bwd(
    residuals: dict[str, Any],
    d_out: Any,
    *,
    cfg: GlaConfig | None = None,
    softmax_scale: float | None = None,
    return_state: bool = False,
) -> dict[str, jax.Array | None]:
    """Backward of :func:`gla_xla`: gradients of q, k, v, g and initial_state."""
    st = _engine.LinearStatics.of(
        residuals["arrays"], cfg, softmax_scale=softmax_scale, return_state=return_state
    )
    return _engine.linear_attention_backward(residuals, d_out, st, _gla_gates)


defvjp(gla_xla, _gla_fwd, _gla_bwd)


def _gla_gates(a: dict[str, Any]) -> tuple[jax.Array, None]:
    return a["g"].astype(jnp.float32), None
