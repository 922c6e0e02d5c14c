"""unified_attention on XLA: vLLM-style packed prefill and decode over a paged cache (forward only).

Runs the work-list engine of :mod:`ejkernel_xla.ops._paged` (every sequence live) with the
ALiBi bias ``slope · (key_pos - query_pos)`` added after the soft cap and an optional
non-causal mode (a query then sees its sequence's keys up to ``kv_len``, or up to ``p + right``
with a sliding window). Under ``jax.jit`` the work follows the visible keys, never
``num_pages`` or the table width; table slots past a sequence's live pages are never read.

It declines nothing (no ``supports``): this backend serves every valid call on every backend.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax

from ejkernel.specs.unified_attention import SPEC
from ejkernel_xla.ops import _paged as engine

__all__ = [
    "UnifiedAttentionConfig",
    "config_space",
    "heuristic",
    "unified_attention_xla",
]


@attrs.frozen(kw_only=True)
class UnifiedAttentionConfig(engine.PagedConfig):
    """Tunables of the XLA unified attention (see :class:`~ejkernel_xla.ops._paged.PagedConfig`)."""


heuristic, config_space = engine.tuning(UnifiedAttentionConfig, engine.packed_problem)


def unified_attention_xla(*, cfg: UnifiedAttentionConfig | None = None, **args: Any) -> jax.Array:
    """Unified paged attention, ALiBi slopes added after the soft cap.

    Args:
        cfg: blocks; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.unified_attention`'s arguments by name, as its spec validated
            them.

    Returns:
        [T, Hq, D] in the query dtype.
    """
    return engine.serve(SPEC, engine.packed_forward, engine.packed_problem, cfg, args)
