"""page_attention as a Pallas Mosaic-TPU kernel: one decode token per sequence over a paged KV
cache (forward only).

Algorithm: split-free decode attention with FlashAttention-2's online softmax (Dao, 2023, Alg. 1)
over the sequence's kv blocks, as JAX's ``pallas.ops.tpu.paged_attention`` schedules it (one grid
step per sequence, pages DMA'd block by block, double-buffered), on the OPS.md cache layout
``[num_pages, page_size, Hkv, D]``. Grid ``(S,)``, "parallel". A step holds the sequence's query
``[Hkv, G, D]`` (the ``G`` query heads of each KV head are the rows of its logits tile), walks
the kv blocks the query can see (``[kv_len - 1 - left, kv_len)`` under a sliding window, so
blocks outside the window are neither fetched nor computed) and writes ``[Hkv, G, D]``. Paging,
masking, sinks and the VMEM/SMEM rules: :mod:`._paged`.

Declined in ``supports()`` (the XLA plugin serves them): ``k_scale``/``v_scale`` (fp8 caches);
cache dtypes other than float32/bfloat16/float16; a call whose smallest kv block overflows the
VMEM budget or whose block tables overflow SMEM; on a TPU, a ``page_size`` that is not a
multiple of the sublane tiling (8 rows of 32-bit data, 16 of 16-bit).

Verified without a TPU: ``tests/pallas/test_tpu_page_attention.py`` runs the kernel in Pallas's
TPU interpret mode against ``page_attention_reference`` and JAX's own ``paged_attention``, and
lowers it to a Mosaic module for the TPU (Pallas's lowering rules); Mosaic's own passes (vector
layouts, the strided head loads, DMA legality) run only on a TPU and have not run.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.plugins import FwdParams

# Not `_compat`: the `__repr__` attrs generates reads attrs' own `_compat` from this module.
from ejkernel_pallas import _compat as compat
from ejkernel_pallas.tpu import _paged
from ejkernel_pallas.tpu._paged import Launch, Refs

__all__ = [
    "PageAttentionConfig",
    "config_space",
    "heuristic",
    "page_attention_pallas",
    "supports",
]


@attrs.frozen(kw_only=True)
class PageAttentionConfig:
    """Tunables of the Pallas TPU page attention.

    Attributes:
        fwd_params: ``kv_blocksize`` is the keys per kv block, rounded down to whole pages (at
            least one) and clamped to the table's width; ``None`` takes the heuristic's. Other
            fields are unused (one query per sequence).
    """

    fwd_params: FwdParams = attrs.field(factory=FwdParams)


def _launch(kw: Mapping[str, Any], cfg: PageAttentionConfig | None) -> Launch:
    """The launch of validated arguments (arrays or their abstract shapes): one query per
    sequence."""
    kv_blocksize = None if cfg is None else cfg.fwd_params.kv_blocksize
    return _paged.launch_of(kw, "query", q_block=1, kv_blocksize=kv_blocksize)


def _config(lp: Launch) -> PageAttentionConfig:
    return PageAttentionConfig(fwd_params=FwdParams(kv_blocksize=lp.block_keys))


def _heuristic_launch(kw: Mapping[str, Any]) -> Launch:
    lp = _launch(kw, None)
    while lp.pages_per_block > 1 and not _paged.fits(lp):
        lp = attrs.evolve(lp, pages_per_block=lp.pages_per_block // 2)
    return lp


def heuristic(inv: Any) -> PageAttentionConfig:
    """Kv blocks of ~512 keys (whole pages), halved until a grid step fits the VMEM budget."""
    return _config(_heuristic_launch(inv.kwargs))


def config_space(inv: Any) -> list[PageAttentionConfig]:
    """The heuristic's config, then kv blocks of 128 to 2048 keys that fit the VMEM budget."""
    lp = _launch(inv.kwargs, None)
    space = [heuristic(inv)]
    for pages in _paged.kv_block_choices(lp.page_size, lp.max_pages):
        cand = attrs.evolve(lp, pages_per_block=pages)
        if _paged.fits(cand) and _config(cand) not in space:
            space.append(_config(cand))
    return space


def supports(inv: Any) -> bool | str:
    """True, or why this kernel cannot serve the call (see the module docstring)."""
    kw = inv.kwargs
    lp = _launch(kw, None)
    reason = _paged.cache_reason("page_attention", kw, lp)
    if reason:
        return reason
    vmem = _paged.vmem_bytes(attrs.evolve(lp, pages_per_block=1))
    seqs = kw["query"].shape[0]
    smem = _paged.smem_bytes(seqs, seqs * lp.max_pages)
    reason = _paged.budget_reason(
        "page_attention",
        vmem=vmem,
        blocks="one page per block",
        smem=smem,
        prefetched="kv_lens and block_tables",
    )
    return reason or True


def page_attention_pallas(*, cfg: PageAttentionConfig | None = None, **args: Any) -> jax.Array:
    """Decode attention over a paged cache on Mosaic TPU.

    Args:
        cfg: the kv block; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.page_attention`'s arguments by name, as its spec validated
            them (``query [S, Hq, D]``, ``key_cache``/``value_cache [num_pages, page_size,
            Hkv, D]``, ``kv_lens [S]``, ``block_tables [S, max_pages]``, ``softmax_scale``,
            ``logits_soft_cap``, ``sliding_window``).

    Returns:
        [S, Hq, D] in the query dtype; sequences with ``kv_len == 0`` give zeros.
    """
    lp = _heuristic_launch(args) if cfg is None else _launch(args, cfg)
    arrays = (args[n] for n in ("query", "key_cache", "value_cache", "kv_lens", "block_tables"))
    return _forward(*arrays, lp)


@functools.partial(jax.jit, static_argnames="lp")
def _forward(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    lp: Launch,
) -> jax.Array:
    s, hq, d = query.shape
    q = query.reshape(s, lp.hkv, lp.group, d)
    out = _paged.serve(
        _page_attention_kernel,
        lp,
        q,
        key_cache,
        value_cache,
        kv_lens,
        block_tables,
        name="ejkernel_page_attention_fwd",
        grid=(s,),
        rows=compat.pl.BlockSpec((None, lp.hkv, lp.group, d), lambda i, *_: (i, 0, 0, 0)),
    )
    return out.reshape(s, hq, d)


def _page_attention_kernel(refs: Refs, lp: Launch) -> None:
    """Grid step ``seq``: the decode token of sequence ``seq`` over its visible kv blocks."""
    seq = compat.pl.program_id(0)
    kv_len = _paged.seq_kv_len(refs, seq, lp)
    position = kv_len - 1  # the decode token is the newest one
    _paged.attend_sequence(
        refs,
        lp,
        seq=seq,
        kv_len=kv_len,
        q_pos=jnp.full((lp.rows, 1), position, jnp.int32),
        rows_in_seq=None,
        p_lo=position,
        p_hi=position,
    )
