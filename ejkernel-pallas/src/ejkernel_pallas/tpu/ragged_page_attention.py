"""ragged_page_attention as a Pallas Mosaic-TPU kernel: mixed prefill and decode over a paged KV
cache (forward only).

Algorithm: FlashAttention-2's online softmax (Dao, 2023, Alg. 1) over packed query blocks, in the
manner of JAX's ``pallas.ops.tpu.ragged_paged_attention`` (a query block of ``bq`` packed tokens
may hold the tail of one sequence, several whole ones and the head of another), on the OPS.md
cache layout ``[num_pages, page_size, Hkv, D]`` with separate K and V caches. Grid ``(T_pad /
bq,)``, "parallel": the first sequence of every block is found before the launch (a search of
``query_start_loc``, scalar-prefetched), so blocks are independent. A step walks the live
sequences that own tokens of its block; for each it runs the online softmax over the kv blocks
its rows there can see (bottom-right causal: its queries are its last tokens; a sliding window
skips the blocks before it), updating only that sequence's rows, and finally normalises every
row (sinks join here). Queries go to ``[Hkv, T_pad · G, D]`` so a KV head's ``G`` query heads of
``bq`` tokens are the ``bq · G`` rows of one logits tile (GQA without repeating K/V). Tokens of
no live sequence, and rows that see no key, are zeros. Paging, masking, sinks and the VMEM/SMEM
rules: :mod:`._paged`.

Declined in ``supports()`` (the XLA plugin serves them): ``k_scale``/``v_scale`` (fp8 caches);
cache dtypes other than float32/bfloat16/float16; a call whose smallest blocks overflow the VMEM
budget or whose block tables overflow SMEM; on a TPU, a ``page_size`` that is not a multiple of
the sublane tiling (8 rows of 32-bit data, 16 of 16-bit).

Verified without a TPU: ``tests/pallas/test_tpu_ragged_page_attention.py`` runs the kernel in
Pallas's TPU interpret mode against ``ragged_page_attention_reference`` and JAX's own
``ragged_paged_attention``, and lowers it to a Mosaic module for the TPU (Pallas's lowering
rules); Mosaic's own passes (vector layouts, the strided head loads, DMA legality) run only on a
TPU and have not run.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.plugins import FwdParams

# Not `_compat`: the `__repr__` attrs generates reads attrs' own `_compat` from this module.
from ejkernel_pallas import _compat as compat
from ejkernel_pallas.tpu import _paged
from ejkernel_pallas.tpu._numerics import when
from ejkernel_pallas.tpu._paged import SUBLANES, Launch, Refs

__all__ = [
    "RaggedPageAttentionConfig",
    "config_space",
    "heuristic",
    "ragged_page_attention_pallas",
    "supports",
]

#: Logits rows (``bq · G``) per KV head the heuristic aims at, and the query blocks offered.
ROWS_TARGET = 128
Q_BLOCKS = (8, 16, 32, 64, 128)


@attrs.frozen(kw_only=True)
class RaggedPageAttentionConfig:
    """Tunables of the Pallas TPU ragged page attention.

    Attributes:
        fwd_params: ``q_blocksize`` is the packed query tokens per grid step (rounded up to a
            multiple of 8); ``kv_blocksize`` the keys per kv block, rounded down to whole pages
            (at least one) and clamped to the table's width. ``None`` takes the heuristic's.
    """

    fwd_params: FwdParams = attrs.field(factory=FwdParams)


def _launch(kw: Mapping[str, Any], q_block: int | None, kv_blocksize: int | None) -> Launch:
    """The launch of validated arguments (arrays or their abstract shapes)."""
    tokens, hq, _ = kw["queries"].shape
    group = hq // kw["key_cache"].shape[2]
    if q_block is None:
        q_block = max(SUBLANES, ROWS_TARGET // group // SUBLANES * SUBLANES)
    q_block = min(
        _paged.round_up(int(q_block), SUBLANES), _paged.round_up(max(tokens, 1), SUBLANES)
    )
    return _paged.launch_of(kw, "queries", q_block=q_block, kv_blocksize=kv_blocksize)


def _q_block(lp: Launch) -> int:
    return lp.rows // lp.group


def _config(lp: Launch) -> RaggedPageAttentionConfig:
    return RaggedPageAttentionConfig(
        fwd_params=FwdParams(q_blocksize=_q_block(lp), kv_blocksize=lp.block_keys)
    )


def _heuristic_launch(kw: Mapping[str, Any]) -> Launch:
    lp = _launch(kw, None, None)
    while not _paged.fits(lp):
        if lp.pages_per_block > 1:
            lp = attrs.evolve(lp, pages_per_block=lp.pages_per_block // 2)
        elif _q_block(lp) > SUBLANES:
            lp = attrs.evolve(lp, rows=_q_block(lp) // 2 * lp.group)
        else:
            break
    return lp


def heuristic(inv: Any) -> RaggedPageAttentionConfig:
    """~128 logits rows per KV head (``bq · G``, ``bq`` a multiple of 8, at most the padded
    tokens) and kv blocks of ~512 keys (whole pages); kv blocks halve first, then query blocks,
    until a grid step fits the VMEM budget."""
    return _config(_heuristic_launch(inv.kwargs))


def config_space(inv: Any) -> list[RaggedPageAttentionConfig]:
    """The heuristic's config, then query blocks of 8 to 128 tokens with kv blocks of 128 to
    2048 keys, those that fit the VMEM budget (duplicates after clamping once)."""
    kw = inv.kwargs
    base = _launch(kw, None, None)
    space = [heuristic(inv)]
    for q_block in Q_BLOCKS:
        for pages in _paged.kv_block_choices(base.page_size, base.max_pages):
            cand = _launch(kw, q_block, pages * base.page_size)
            if _paged.fits(cand) and _config(cand) not in space:
                space.append(_config(cand))
    return space


def supports(inv: Any) -> bool | str:
    """True, or why this kernel cannot serve the call (see the module docstring)."""
    kw = inv.kwargs
    lp = _launch(kw, SUBLANES, 1)
    reason = _paged.cache_reason("ragged_page_attention", kw, lp)
    if reason:
        return reason
    seqs = kw["kv_lens"].shape[0]
    blocks = -(-kw["queries"].shape[0] // SUBLANES)
    smem = _paged.smem_bytes(seqs, seqs * lp.max_pages, seqs + 1, blocks, 1)
    reason = _paged.budget_reason(
        "ragged_page_attention",
        vmem=_paged.vmem_bytes(lp),
        blocks="its smallest blocks",
        smem=smem,
        prefetched="the lengths, offsets and block tables",
    )
    return reason or True


def ragged_page_attention_pallas(
    *, cfg: RaggedPageAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """Ragged paged attention on Mosaic TPU.

    Args:
        cfg: query and kv blocks; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.ragged_page_attention`'s arguments by name, as its spec
            validated them (``queries [T, Hq, D]``, the caches, ``kv_lens [num_seqs]``,
            ``block_tables``, ``query_start_loc [num_seqs + 1]``, ``num_seqs``, the statics,
            ``softmax_aux``).

    Returns:
        [T, Hq, D] in the query dtype.
    """
    if cfg is None:
        lp = _heuristic_launch(args)
    else:
        lp = _launch(args, cfg.fwd_params.q_blocksize, cfg.fwd_params.kv_blocksize)
    num_seqs = args.get("num_seqs")
    if num_seqs is None:
        num_seqs = args["kv_lens"].shape[0]
    return _forward(
        args["queries"],
        args["key_cache"],
        args["value_cache"],
        args["kv_lens"],
        args["block_tables"],
        args["query_start_loc"],
        jnp.asarray(num_seqs, jnp.int32).reshape(()),
        args.get("softmax_aux"),
        lp,
    )


@functools.partial(jax.jit, static_argnames="lp")
def _forward(
    queries: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: jax.Array,
    softmax_aux: jax.Array | None,
    lp: Launch,
) -> jax.Array:
    tokens, hq, d = queries.shape
    seqs = kv_lens.shape[0]
    bq = _q_block(lp)
    blocks = max(1, -(-tokens // bq))
    t_pad = blocks * bq
    q = jnp.pad(queries, ((0, t_pad - tokens), (0, 0), (0, 0)))
    q = q.reshape(t_pad, lp.hkv, lp.group, d).transpose(1, 0, 2, 3).reshape(lp.hkv, -1, d)
    num_seqs = jnp.clip(num_seqs, 0, seqs)
    qsl = query_start_loc.astype(jnp.int32)
    # The first live sequence ending after each block's first token (dead ones never match).
    ends = jnp.where(jnp.arange(seqs) < num_seqs, qsl[1:], jnp.iinfo(jnp.int32).max)
    first = jnp.searchsorted(ends, jnp.arange(blocks) * bq, side="right").astype(jnp.int32)
    out = _paged.serve(
        _ragged_page_attention_kernel,
        lp,
        q,
        key_cache,
        value_cache,
        kv_lens,
        block_tables,
        qsl,
        first,
        num_seqs.reshape(1),
        name="ejkernel_ragged_page_attention_fwd",
        grid=(blocks,),
        rows=compat.pl.BlockSpec((lp.hkv, lp.rows, d), lambda i, *_: (0, i, 0)),
        aux=_paged.sink_rows(softmax_aux, lp.hkv, bq),
    )
    out = out.reshape(lp.hkv, t_pad, lp.group, d).transpose(1, 0, 2, 3)
    return out.reshape(t_pad, hq, d)[:tokens]


def _ragged_page_attention_kernel(
    refs: Refs, lp: Launch, qsl_ref: Any, first_ref: Any, num_seqs_ref: Any
) -> None:
    """Grid step ``block``: the rows of query block ``block``, attended by each live sequence
    that owns tokens of the block (from its first, ``first_ref[block]``) over its visible kv
    blocks."""
    block = compat.pl.program_id(0)
    bq = _q_block(lp)
    blk_start = block * bq
    blk_end = blk_start + bq
    num_seqs = num_seqs_ref[0]
    token = blk_start + lax.div(lax.broadcasted_iota(jnp.int32, (lp.rows, 1), 0), lp.group)

    def owns_tokens_here(seq: Any) -> Any:
        return jnp.logical_and(seq < num_seqs, qsl_ref[seq] < blk_end)

    def attend(seq: Any) -> Any:
        q_start, q_end = qsl_ref[seq], qsl_ref[seq + 1]
        kv_len = _paged.seq_kv_len(refs, seq, lp)
        offset = kv_len - (q_end - q_start) - q_start  # position = token + offset
        t_lo = jnp.maximum(q_start, blk_start)
        t_hi = jnp.minimum(q_end, blk_end) - 1

        @when(t_hi >= t_lo)
        def _rows() -> None:
            _paged.attend_sequence(
                refs,
                lp,
                seq=seq,
                kv_len=kv_len,
                q_pos=token + offset,
                rows_in_seq=jnp.logical_and(token >= q_start, token < q_end),
                p_lo=t_lo + offset,
                p_hi=t_hi + offset,
            )

        return seq + 1

    lax.while_loop(owns_tokens_here, attend, first_ref[block])
