"""recurrent on XLA: the gated linear recurrence, chunked.

Pure JAX. The recurrence ``h_t = h_{t-1} ⊙ exp(gk_t)[:, None] ⊙ exp(gv_t)[None, :] + k_tᵀ v_t``,
``o_t = scale · q_t h_t`` (log-space gates; ``recurrent``'s ``g`` and ``gk`` add into one key
gate) is computed in chunks, the form of GLA (Yang et al., 2024, "Gated Linear Attention
Transformers with Hardware-Efficient Training", Sec. 4): parallel inside a chunk of C tokens,
recurrent across chunks. This module is the op's config and gates; the entry point, forward
and backward are the adapter shared with gla and lightning_attention,
:mod:`ejkernel_xla.ops._chunked_op`, over the engine :mod:`ejkernel_xla.ops._chunked`, whose
docstring gives the algorithm: gate forms, the streamed forward, ``cu_seqlens`` layout, costs
and the backward from saved chunk-start states.

Accumulation is float32 (inputs are cast once); the output keeps the query dtype and the final
state is float32. It declines nothing (no ``supports``): every valid call runs on every backend.
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
    "RecurrentConfig",
    "config_space",
    "heuristic",
    "recurrent_xla",
]


@attrs.frozen(kw_only=True)
class RecurrentConfig:
    """Tunables of the chunked XLA recurrence.

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
    return adapter.heuristic(inv, RecurrentConfig)


def config_space(inv: Any) -> list[RecurrentConfig]:
    """The heuristic's config, then a few (chunk, sub-chunk) pairs, clamped and deduplicated."""
    return adapter.config_space(inv, RecurrentConfig, adapter.SUB_CHUNKED_TUNING)


def recurrent_xla(*, cfg: RecurrentConfig | None = None, **args: Any) -> Any:
    """Gated linear recurrence, chunked: the op's arguments
    (:func:`ejkernel.specs.recurrent.recurrent`, validated by the core) as keywords, and the
    chunk sizes ``cfg`` (``None``: the defaults).

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state)``.
    """
    return adapter.primal(args, cfg, _recurrent_gates)


def _recurrent_gates(a: dict[str, Any]) -> tuple[jax.Array | None, jax.Array | None]:
    """``g`` and ``gk`` add into one key gate ([B, S, H, 1] when only ``g`` is given)."""
    g, gk, gv = a.get("g"), a.get("gk"), a.get("gv")
    key_gate = None
    if g is not None:
        key_gate = g.astype(jnp.float32)[..., None]
    if gk is not None:
        key_gate = gk.astype(jnp.float32) if key_gate is None else key_gate + gk.astype(jnp.float32)
    return key_gate, None if gv is None else gv.astype(jnp.float32)


defvjp(
    recurrent_xla,
    functools.partial(adapter.forward, gates=_recurrent_gates),
    functools.partial(adapter.backward, gates=_recurrent_gates),
)
