"""unified_attention in Triton, and the launch every serving op shares (forward only).

:func:`paged_attention` launches :func:`ejkernel_triton.kernels.paged_attention.
unified_attention_kernel` on a packed batch (queries ``[T, Hq, D]``, a paged cache, the
table, ``query_start_loc`` and the live ``num_seqs``) and, with split-K, merges the splits'
float32 partial outputs by their log2-sum-exp in JAX. With ``chunk_kernel="pingpong"``
(Hopper) the sequences of :data:`PINGPONG_MIN_QUERIES` queries or more run on
:func:`ejkernel_triton.kernels.paged_attention_hopper.paged_attention_pingpong_kernel`, the
shorter chunks on the unified kernel at :data:`SHORT_CHUNKS`' tile, and the decodes, there
and with ``decode_launch``, as a decode batch of one row a table row whose outputs are added
at their tokens. ``page_attention``,
``ragged_page_attention`` and ``prefill_page_attention`` map their arguments onto it in
their own modules (:mod:`ejkernel_triton.ops.page_attention`, ...). The config, heuristic and
config space are in :mod:`ejkernel_triton.ops.unified_attention_config`.

Every valid call is served except head dims over 256, query dtypes other than
bfloat16/float16/float32 and cache dtypes other than those or ``float8_e4m3fn`` (with
``k_scale``/``v_scale``, dequantised in the kernel's registers), which :func:`supports`
declines. Under ``jit`` one compiled kernel serves every ``kv_lens``, ``query_start_loc`` and
``num_seqs``: the grid depends only on the static shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel_triton import _launch
from ejkernel_triton._launch import pow2
from ejkernel_triton.ops.unified_attention_config import (
    PINGPONG_MIN_QUERIES,
    SHORT_CHUNKS,
    Problem,
    UnifiedAttentionConfig,
    fit_stages,
    pingpong_refusal,
    pingpong_tile,
    resolve,
    selection,
    table_problem,
)

__all__ = [
    "UnifiedAttentionConfig",
    "config_space",
    "heuristic",
    "paged_attention",
    "supports",
    "unified_attention_triton",
]


def paged_attention(
    cfg: Any, a: Mapping[str, Any], *, decode: bool = False, kv_starts: jax.Array | None = None
) -> jax.Array:
    """Packed paged attention (``unified_attention``'s semantics) through the Triton kernel.

    Args:
        cfg: a :class:`UnifiedAttentionConfig` (or a subclass), or ``None`` for the heuristic.
        a: the arguments by name, as ``ejkernel.unified_attention`` takes them (validated: the
            window a pair or ``None``): ``queries`` [T, Hq, D]; ``key_cache`` [num_pages,
            page_size, Hkv, D]; ``value_cache`` [num_pages, page_size, Hkv, Dv]; ``kv_lens``
            [rows] int; ``block_tables`` [rows, max_pages] int; ``query_start_loc`` [rows + 1]
            int; and, each ``None`` or absent when unused, ``num_seqs`` (the live sequences,
            the first ``num_seqs`` rows: an int or an integer array of shape () or (1,), may
            be traced; absent: every row), ``softmax_scale``, ``causal`` (absent: True),
            ``sliding_window``, ``logits_soft_cap``, ``softmax_aux``, ``alibi_slopes``,
            ``k_scale``/``v_scale`` (a float32 scalar or ``[Hkv]``: the caches, then possibly
            ``float8_e4m3fn``, are read as ``cache.astype(float32) · scale``; both or neither).
        decode: the caller promises token ``s`` is sequence ``s``'s one query and every row
            is live (``page_attention``): one program per sequence and KV head, no search.
        kv_starts: [rows] int, each sequence's first visible key (``ragged_decode_attention``'s
            ``sequence_start``), or ``None`` (0).

    Returns:
        [T, Hq, Dv] in the query dtype; tokens of no live sequence and rows that see no key
        are zeros.
    """
    names = ("queries", "key_cache", "value_cache", "kv_lens", "block_tables", "query_start_loc")
    queries, key_cache, value_cache, kv_lens, block_tables, query_start_loc = (a[n] for n in names)
    softmax_scale, sliding_window, logits_soft_cap, softmax_aux, alibi_slopes = (
        a.get(n)
        for n in (
            "softmax_scale",
            "sliding_window",
            "logits_soft_cap",
            "softmax_aux",
            "alibi_slopes",
        )
    )
    k_scale, v_scale, causal = a.get("k_scale"), a.get("v_scale"), a.get("causal", True)
    num_seqs = a.get("num_seqs")
    t, hq, d = (int(n) for n in queries.shape)
    dv = int(value_cache.shape[-1])
    rows, max_pages = (int(n) for n in block_tables.shape)
    if t == 0 or rows == 0:
        return jnp.zeros((t, hq, dv), queries.dtype)
    problem = Problem.of(queries, key_cache, rows, max_pages)
    group = hq // problem.hkv
    align = min(d & -d, dv & -dv, 16)
    left, right = (int(w) for w in sliding_window) if sliding_window is not None else (0, 0)
    aux = (
        jnp.zeros((1,), jnp.float32)
        if softmax_aux is None
        else softmax_aux.astype(jnp.float32).reshape(hq, -1)
    )
    slopes = (
        jnp.zeros((1,), jnp.float32) if alibi_slopes is None else alibi_slopes.astype(jnp.float32)
    )
    live = jnp.clip(
        jnp.asarray(rows if num_seqs is None else num_seqs, jnp.int32).reshape(1), 0, rows
    )
    scaled = k_scale is not None or v_scale is not None
    k_scales, v_scales = (_per_head(x, problem.hkv) for x in (k_scale, v_scale))
    starts = jnp.zeros((1,), jnp.int32) if kv_starts is None else kv_starts.astype(jnp.int32)
    f16_products = scaled and queries.dtype == jnp.bfloat16 and key_cache.dtype.itemsize == 1
    f16_products = f16_products and value_cache.dtype.itemsize == 1
    v_words = bool(getattr(cfg, "fp8_v_words", False)) and value_cache.dtype.itemsize == 1
    v_words = v_words and dv % 16 == 0 and align % 4 == 0

    # what every launch takes first: queries, caches, lengths, table, starts, live sequences
    batch = (
        queries,
        key_cache,
        value_cache,
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        query_start_loc.astype(jnp.int32),
        live,
    )
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)

    def run(r: dict[str, int], q_lens: tuple[int, int] = (1, 0)) -> jax.Array:
        """One launch with ``r``'s tiles over the sequences of ``q_lens[0]`` queries or more
        and (``q_lens[1]`` > 0) at most ``q_lens[1]``."""
        splits = r["num_splits"]
        if splits == 1:
            out_shape = [
                jax.ShapeDtypeStruct((t, hq, dv), queries.dtype),
                jax.ShapeDtypeStruct((1,), jnp.float32),
            ]
        else:
            out_shape = [
                jax.ShapeDtypeStruct((splits, t, hq, dv), jnp.float32),
                jax.ShapeDtypeStruct((splits, t, hq), jnp.float32),
            ]
        from ejkernel_triton.kernels.paged_attention import unified_attention_kernel

        num_aux = int(aux.shape[1]) if softmax_aux is not None else 1
        out, lse = _launch.launch(
            unified_attention_kernel,
            *batch,
            aux,
            slopes,
            starts,
            k_scales,
            v_scales,
            np.float32(scale),
            np.float32(logits_soft_cap or 1.0),
            left,
            right,
            num_aux,
            t,
            hq,
            problem.num_pages,
            max_pages,
            hq * d // align,
            problem.page_size * problem.hkv * d // align,
            problem.hkv * d // align,
            problem.page_size * problem.hkv * dv // align,
            problem.hkv * dv // align,
            hq * dv // align,
            out_shape=out_shape,
            grid=(rows if decode else t // r["block_q"] + rows, problem.hkv, splits),
            num_warps=r["num_warps"],
            num_stages=fit_stages(problem, r["block_m"], r["block_n"], r["num_stages"]),
            zeroed_outputs=(0, 1),
            HEAD_DIM=d,
            BLOCK_D=pow2(d),
            HEAD_DV=dv,
            BLOCK_DV=pow2(dv),
            PAGE_SIZE=problem.page_size,
            GROUP=group,
            GROUP_PAD=problem.group_pad,
            BLOCK_Q=r["block_q"],
            BLOCK_M=r["block_m"],
            BLOCK_N=r["block_n"],
            NUM_SPLITS=splits,
            CAUSAL=bool(causal),
            WINDOW=sliding_window is not None,
            SOFT_CAP=logits_soft_cap is not None,
            HAS_AUX=softmax_aux is not None,
            BLOCK_AUX=pow2(num_aux),
            HAS_ALIBI=alibi_slopes is not None,
            DOT_PRECISION="ieee" if queries.dtype == jnp.float32 else "tf32",
            ALIGN=align,
            DECODE=bool(decode),
            HAS_START=kv_starts is not None,
            ONE_PAGE=max_pages == 1,
            SCALED=scaled,
            MIN_Q_LEN=q_lens[0],
            MAX_Q_LEN=q_lens[1],
            F16_PRODUCTS=f16_products,
            V_WORDS=v_words,
        )
        if splits == 1:
            return out
        return merge_splits(out, lse).astype(queries.dtype)

    def run_pingpong(min_q_len: int, block_n: int, stages: int) -> jax.Array:
        """The sequences of ``min_q_len`` queries or more on the Gluon ping-pong kernel."""
        from ejkernel_triton._kernel_cache import GLOBAL_SCRATCH_BYTES
        from ejkernel_triton.kernels.paged_attention_hopper import (
            paged_attention_pingpong_kernel,
        )

        grid = (t // 128 + rows, hq)
        out, _, _ = _launch.launch(
            paged_attention_pingpong_kernel,
            *batch,
            np.float32(scale),
            np.float32(logits_soft_cap or 1.0),
            t,
            hq,
            problem.hkv,
            problem.num_pages,
            max_pages,
            out_shape=[
                jax.ShapeDtypeStruct((t, hq, d), queries.dtype),
                jax.ShapeDtypeStruct((t * hq,), jnp.float32),
                jax.ShapeDtypeStruct((grid[0] * grid[1] * GLOBAL_SCRATCH_BYTES,), jnp.int8),
            ],
            grid=grid,
            num_warps=4,
            num_stages=stages,
            zeroed_outputs=(0,),
            HEAD_DIM=d,
            CAUSAL=bool(causal),
            SOFT_CAP=logits_soft_cap is not None,
            PAGE_SIZE=problem.page_size,
            BLOCK_N=block_n,
            STAGES=stages,
            MIN_Q_LEN=min_q_len,
            HEAD_GROUP=8 if causal else 0,
        )
        return out

    if getattr(cfg, "chunk_kernel", "unified") == "pingpong":
        why = (
            "a decode call"
            if decode
            else pingpong_refusal({**a, "sequence_start": kv_starts}, problem, "queries")
        )
        if why:
            raise ValueError(f"chunk_kernel='pingpong' cannot serve this call: {why}")
        tile = pingpong_tile(cfg)
        if rows == 1:
            return run_pingpong(1, *tile)
        chunks = run_pingpong(PINGPONG_MIN_QUERIES, *tile)
        short = run(resolve(problem, SHORT_CHUNKS), (2, PINGPONG_MIN_QUERIES - 1))
        return _decodes_added(a, live, chunks + short)
    r = resolve(problem, cfg)
    if decode or problem.decode_like or rows < 2 or not getattr(cfg, "decode_launch", False):
        return run(r)
    return _decodes_added(a, live, run(r, (2, 0)))


def _decodes_added(a: Mapping[str, Any], live: jax.Array, others: jax.Array) -> jax.Array:
    """``others`` (the output of the sequences of two queries or more, zeros at the decodes'
    tokens) plus the decodes' (the live sequences of one query): a decode batch of one token
    per table row, ``[rows, Hq, D]`` (a row that is not a live decode gets no keys), on the
    heuristic's decode tiles and splits, added at the decodes' tokens."""
    qsl = a["query_start_loc"].astype(jnp.int32)
    rows = a["block_tables"].shape[0]
    t = others.shape[0]
    starts = qsl[:-1]
    is_decode = (qsl[1:] - starts == 1) & (jnp.arange(rows) < live[0])
    token = jnp.clip(starts, 0, t - 1)
    batch = {
        **a,
        "queries": a["queries"][token],
        "kv_lens": jnp.where(is_decode, a["kv_lens"], 0),
        "query_start_loc": jnp.arange(rows + 1, dtype=jnp.int32),
        "num_seqs": None,
    }
    out = paged_attention(None, batch, decode=True)
    return others.at[jnp.where(is_decode, token, t)].add(out, mode="drop")


def _per_head(scale: Any, hkv: int) -> jax.Array:
    """A cache scale as float32 ``[Hkv]`` (ones for ``None``)."""
    if scale is None:
        return jnp.ones((hkv,), jnp.float32)
    return jnp.broadcast_to(jnp.asarray(scale, jnp.float32).reshape(-1), (hkv,))


def merge_splits(out: jax.Array, lse: jax.Array) -> jax.Array:
    """The attention over every split's keys from each split's normalised output
    ``[n, T, Hq, D]`` and log2-sum-exp ``[n, T, Hq]`` (a split that saw nothing has weight 0
    unless none saw anything, when every output is 0)."""
    top = jnp.max(lse, axis=0)
    w = jnp.exp2(lse - top)
    return jnp.sum(w[..., None] * out, axis=0) / jnp.sum(w, axis=0)[..., None]


# -- the registered op ----------------------------------------------------------------------


heuristic, config_space, supports = selection(
    UnifiedAttentionConfig, table_problem("queries"), "queries"
)


def unified_attention_triton(
    *, cfg: UnifiedAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """vLLM-style unified attention through the Triton kernel.

    Args:
        cfg: blocks, warps, stages, splits; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.unified_attention`'s arguments by name, as its spec validated
            them.

    Returns:
        [T, Hq, D] in the query dtype.
    """
    return paged_attention(cfg, args)
