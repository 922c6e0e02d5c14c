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
two-level form; its pairwise decays are [c, c, K]). It declines nothing (no ``supports``). The
entry point, forward and backward are the linear family's shared adapter,
:mod:`ejkernel_xla.ops._chunked_op`.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.plugins import defvjp
from ejkernel_xla.ops import _chunked_op as adapter
from ejkernel_xla.ops.recurrent import RecurrentConfig

__all__ = ["GlaConfig", "config_space", "gla_xla", "heuristic"]


@attrs.frozen(kw_only=True)
class GlaConfig(RecurrentConfig):
    """Tunables of the chunked XLA gla: those of :class:`RecurrentConfig` (gla runs the same
    engine with the key gate ``g``)."""


def heuristic(inv: Any) -> GlaConfig:
    """The backend's default chunk sizes, smaller for short (packed) sequences."""
    return adapter.heuristic(inv, GlaConfig)


def config_space(inv: Any) -> list[GlaConfig]:
    """The heuristic's config, then a few (chunk, sub-chunk) pairs, clamped and deduplicated."""
    return adapter.config_space(inv, GlaConfig, adapter.SUB_CHUNKED_TUNING)


def gla_xla(*, cfg: GlaConfig | None = None, **args: Any) -> Any:
    """Gated linear attention, chunked: the op's arguments (:func:`ejkernel.specs.gla.gla`,
    validated by the core) as keywords, and the chunk sizes ``cfg`` (``None``: the defaults).

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state)``.
    """
    return adapter.primal(args, cfg, _gla_gates)


def _gla_gates(a: dict[str, Any]) -> tuple[jax.Array, None]:
    """The key gate ``g`` [B, S, H, K]; no value gate."""
    return a["g"].astype(jnp.float32), None


defvjp(
    gla_xla,
    functools.partial(adapter.forward, gates=_gla_gates),
    functools.partial(adapter.backward, gates=_gla_gates),
)
