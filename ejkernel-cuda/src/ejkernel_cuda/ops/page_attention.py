"""page_attention on CUDA: split-K flash decoding over a paged cache (forward only).

Native kernel (``csrc/decode_attention.cu``, Flash-Decoding, Dao et al. 2023), shared with
``ragged_decode_attention`` (:mod:`ejkernel_cuda.ops._decode`): each CTA reads one key-range
split of one sequence for the query heads of one GQA group, looking each token's page up in
the block table (a shift and a mask for power-of-two page sizes), 16-byte loads of the key
and value rows; a second kernel merges the splits. Sequence ``s`` reads only positions
``[max(0, kv_len - 1 - left), min(kv_len, capacity))``: table slots past its live pages are
never read, and page ids are clamped to ``[0, num_pages)`` as JAX's gather would.

``supports()`` declines: scaled caches (``k_scale``/``v_scale``, float8: the XLA plugin
serves them), dtypes other than bfloat16/float16/float32, head dims that are not a multiple of
8 or exceed 256, and, when nvcc is missing or the build failed, every call (the reason carries
the compiler's message). The op is forward-only.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel_cuda.ops._decode import DecodeConfig, decode, decode_supports, decode_tuning

__all__ = ["PageAttentionConfig", "config_space", "heuristic", "page_attention_cuda", "supports"]


@attrs.frozen(kw_only=True)
class PageAttentionConfig(DecodeConfig):
    """``num_splits`` key-range splits per sequence (0: the heuristic's count)."""


def _dims(kw: Any) -> tuple[int, int, int, int, int]:
    q, kc, table = kw["query"], kw["key_cache"], kw["block_tables"]
    capacity = int(table.shape[1]) * int(kc.shape[1])
    return int(q.shape[0]), int(q.shape[1]), int(kc.shape[2]), capacity, kc.dtype.itemsize


heuristic, config_space = decode_tuning(_dims, PageAttentionConfig)


def supports(inv: Any) -> bool | str:
    kw = inv.kwargs
    return decode_supports(kw["query"], kw["value_cache"], kw.get("k_scale"), kw.get("v_scale"))


def page_attention_cuda(*, cfg: PageAttentionConfig | None = None, **args: Any) -> jax.Array:
    """Decode attention over a paged cache: ``ejkernel.page_attention``'s arguments as
    keywords, validated by the core spec.

    Args:
        query: [S, Hq, D].
        key_cache: [num_pages, page_size, Hkv, D].
        value_cache: [num_pages, page_size, Hkv, D].
        kv_lens: [S] int.
        block_tables: [S, max_pages] int.
        softmax_scale: multiplies the logits; ``None`` means D ** -0.5.
        logits_soft_cap: ``cap * tanh(logits / cap)``, or ``None``.
        sliding_window: ``(left, right)`` or ``None``.
        cfg: ``num_splits``; ``None`` or 0 takes the heuristic's.

    Returns:
        [S, Hq, D] in the query dtype; sequences with ``kv_len == 0`` give zeros.
    """
    return decode(
        args["query"],
        args["key_cache"],
        args["value_cache"],
        (args["kv_lens"], None),
        bounds=_bounds,
        table=args["block_tables"],
        softmax_aux=None,
        dims=_dims(args),
        cfg=cfg,
        options=args,
    )


def _bounds(kv_lens: jax.Array, _: None, capacity: int, left: int | None) -> Any:
    """Sequence ``s`` sees ``[max(0, kv_len - 1 - left), min(kv_len, capacity))``."""
    kv_len = kv_lens.astype(jnp.int32)
    hi = jnp.clip(kv_len, 0, capacity)
    lo = jnp.zeros_like(hi) if left is None else jnp.maximum(0, kv_len - 1 - left)
    return lo, hi
