"""ragged_page_attention on XLA: mixed prefill and decode over a paged KV cache (forward only).

Runs the work-list engine of :mod:`ejkernel_xla.ops._paged` (FlashAttention-2's online softmax
over (work item, key block) pairs): each live sequence's queries, its last tokens, are cut
into work items of ``q_blocksize`` tokens, each paired with the key blocks (whole pages) it
can see causally and within the sliding window. Under ``jax.jit`` the work follows the visible
keys, never ``num_pages`` or the table width; table slots past a sequence's live pages are
never read.

It declines nothing (no ``supports``): this backend serves every valid call on every backend.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax

from ejkernel.specs.ragged_page_attention import SPEC
from ejkernel_xla.ops import _paged as engine

__all__ = [
    "RaggedPageAttentionConfig",
    "config_space",
    "heuristic",
    "ragged_page_attention_xla",
]


@attrs.frozen(kw_only=True)
class RaggedPageAttentionConfig(engine.PagedConfig):
    """Tunables of the XLA ragged paged attention (see
    :class:`~ejkernel_xla.ops._paged.PagedConfig`)."""


heuristic, config_space = engine.tuning(RaggedPageAttentionConfig, engine.packed_problem)


def ragged_page_attention_xla(
    *, cfg: RaggedPageAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """Ragged paged attention.

    Args:
        cfg: blocks; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.ragged_page_attention`'s arguments by name, as its spec
            validated them.

    Returns:
        [T, Hq, D] in the query dtype.
    """
    return engine.serve(SPEC, engine.packed_forward, engine.packed_problem, cfg, args)
