"""The XLA engine of the serving ops: work-list attention over a paged (or dense) KV cache.

``page_attention``, ``ragged_page_attention``, ``ragged_page_attention_v3``,
``prefill_page_attention``, ``unified_attention`` and ``ragged_decode_attention`` all run on
this module; each op module is an adapter that describes its sequences (:class:`Sequences`) and
its key fetch (:func:`paged_fetch`, :func:`dense_fetch`) in a jitted forward, names its config
class, and runs through :func:`serve` (which binds the arguments by the op's spec, so no module
restates them). Forward only: the serving ops are not differentiable.

Algorithm: the online softmax of FlashAttention-2 (Dao, 2023, Sec. 3.1) over a flat work list,
in the spirit of split-KV decoding (FlashDecoding) and the ragged paged kernels of vLLM and
JAX's TPU serving work:

- Work items. Each sequence's queries are cut into items of at most ``q_blocksize`` tokens
  (decode ops: one token per item). An item's visible keys span positions ``[lo, hi]``: from
  ``kv_lo`` (or the left edge of the sliding window) to ``kv_len - 1`` (or its last query's
  position under causality, plus the window's right edge without it). Keys come in blocks of
  ``kv_blocksize`` positions (for a paged cache a whole number of pages), so an item needs
  ``hi // bk - lo // bk + 1`` blocks. The static number of items is
  ``min(T, T // q_blocksize + min(num_seqs, T))``, a bound on ``sum(ceil(q_len / bq))``.
- Work pairs. Every (item, key block) pair is one unit of work; their count
  ``P = Σ blocks`` is known only at run time. A ``lax.fori_loop`` with a traced trip count
  ``ceil(P / blocks_per_step)`` handles ``blocks_per_step`` pairs per step: it finds each
  pair's item by searching the pairs' running sum, gathers the item's queries and the
  block's pages (only the table entries of live pages: ids of unused slots are replaced by
  page 0 before the gather, so garbage such as ``-1`` or ``10**6`` is never read), and
  computes masked logits ``[W·Hkv, bq·G, bk]`` in float32 with one canonical batched matmul
  (GQA: the ``G = Hq // Hkv`` query heads of a KV head share its keys).
- Merge. The running row maximum ``m``, denominator ``l`` and accumulator ``acc`` of every
  item live in the loop carry; a step raises ``m`` with a scatter-max of its pairs' block
  maxima and scatter-adds its pairs' ``exp(s - m_new)`` sums and products with V (several
  pairs of one item in a step simply add up). The rescale of an item's old ``l`` and ``acc``
  by ``alpha = exp(m_old - m_new)`` rides on the same scatter: the first pair of each item
  (pairs are sorted by item) adds ``state · (alpha - 1)``, so a step costs O(its pairs),
  never O(all items). Hidden scores and probabilities are selected away
  (``attention_semantics.mask_scores``/``hide``) and values pass through ``finite_or_zero``
  before the product, so NaN or Inf in unused cache slots, past a sequence's length, or at
  positions the causal mask or the window hides from some rows never leaks.
- Scaled caches. With ``k_scale``/``v_scale`` the fetch gathers the pages in the cache's own
  dtype (``float8_e4m3fn``: half the bytes of bf16) and dequantises only the gathered block,
  ``block.astype(float32) · scale`` per KV head (``attention_semantics.dequantize_kv``); the
  block's products then run in float32.
- Finish. Sinks (``softmax_aux``) join the maximum and the denominator; rows that saw no key
  (``l == 0``) become zeros; items scatter back to their tokens.

Cost: under ``jax.jit`` the work is proportional to the keys actually visible, ``Σ`` over
items of their key blocks times ``q_blocksize`` rows (about ``sum(kv_lens)`` for decode; a
sliding window bounds it by the window), plus O(items) once for the work list. It does not
depend on ``num_pages`` (the cache is only gathered from) nor on ``max_pages`` (the table
width); a step's temporaries are bounded by the per-backend step budgets below. Measured
(``benchmarks/bench_serving.py``, CPU): decode time flat when ``num_pages`` or ``max_pages``
grows 10x, linear in ``sum(kv_lens)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel import attention_semantics as semantics
from ejkernel.attention_semantics import MASK_VALUE, dequantize_kv
from ejkernel.plugins import FwdParams
from ejkernel.specs import OpSpec
from ejkernel_xla.ops import _tuning

__all__ = [
    "PagedConfig",
    "Problem",
    "Sequences",
    "Statics",
    "attend",
    "attend_pages",
    "decode_sequences",
    "dense_fetch",
    "make_statics",
    "packed_forward",
    "packed_problem",
    "paged_config_space",
    "paged_fetch",
    "paged_heuristic",
    "paged_problem",
    "paged_sequences",
    "serve",
    "tuning",
]

#: Logit of a masked entry: finite, so ``masked - row_max`` never forms ``inf - inf``.

#: Largest query tokens per work item, per backend.
_Q_BLOCK_MAX = {"cpu": 32, "gpu": 64, "tpu": 128}
#: Default keys per block (rounded to whole pages), per backend.
_KV_BLOCK = {"cpu": 256, "gpu": 256, "tpu": 512}
#: Per loop step, per backend: the logit entries (pairs · q_block · kv_block · Hq) and the
#: gathered key/value elements (pairs · kv_block · Hkv · (D + Dv)) it aims at: large enough to
#: amortise a step's fixed cost, small enough that a step's tiles stay in cache (on CPU,
#: ~1k gathered keys per step at Hkv·D = 128 ran 5x faster than 16k).
_STEP_LOGITS = {"cpu": 1 << 17, "gpu": 1 << 22, "tpu": 1 << 22}
_STEP_KV = {"cpu": 1 << 18, "gpu": 1 << 23, "tpu": 1 << 23}
#: Most pairs per step the heuristic picks.
_MAX_PAIRS = 256
#: Largest table × queries product searched by counting comparisons instead of bisection.
_COMPARE_ALL_MAX = 1 << 16


@attrs.frozen(kw_only=True)
class PagedConfig:
    """Tunables of the XLA serving attention; every serving op's config class derives from it.

    ``None`` takes the heuristic's value.

    Attributes:
        fwd_params: ``q_blocksize`` is the query tokens per work item (decode ops always use
            1); ``kv_blocksize`` the keys per block, rounded down to whole pages (at least one)
            for a paged cache and clamped to the sequence capacity. Other fields are unused.
        blocks_per_step: (work item, key block) pairs computed per loop step.
    """

    fwd_params: FwdParams = attrs.field(factory=FwdParams)
    blocks_per_step: int | None = None


@attrs.frozen(kw_only=True)
class Problem:
    """The sizes a heuristic looks at (Python ints, read from abstract shapes).

    Attributes:
        tokens: packed query tokens ``T``.
        seqs: sequences (``kv_lens.shape[0]``).
        hq: query heads.
        kv_width: elements of one cached token, keys and values (``Hkv · (D + Dv)``).
        page_size: keys per page (1 for a dense cache).
        capacity: most keys one sequence can hold (``max_pages · page_size`` or ``Sk``).
        decode: one query per sequence by construction (query blocks of one token).
        head_dim: D, for the default ``softmax_scale``.
    """

    tokens: int
    seqs: int
    hq: int
    kv_width: int
    page_size: int
    capacity: int
    decode: bool
    head_dim: int


@attrs.frozen(kw_only=True)
class Statics:
    """Everything static about one call (hashable: the ``jax.jit`` static argument)."""

    softmax_scale: float
    logits_soft_cap: float | None
    sliding_window: tuple[int, int] | None
    causal: bool
    q_block: int
    kv_block: int
    blocks_per_step: int


class Sequences(NamedTuple):
    """Per-sequence description of a call, each [S] int32.

    Attributes:
        q_begin: offset of the sequence's first query token.
        q_len: its query tokens (0: nothing to compute).
        q_pos0: key position of its first query.
        kv_lo: first key position it may see.
        kv_hi: one past the last key position it may see.
    """

    q_begin: jax.Array
    q_len: jax.Array
    q_pos0: jax.Array
    kv_lo: jax.Array
    kv_hi: jax.Array


#: ``fetch(seq [W], block [W]) -> (keys [W, bk, Hkv, D], values [W, bk, Hkv, Dv], positions
#: [W, bk])``: block ``block`` covers key positions ``[block · bk, (block + 1) · bk)``; the
#: positions returned say where each fetched key really sits (those outside are masked).
Fetch = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


# --------------------------------------------------------------------------------------------
# Heuristic and config space
# --------------------------------------------------------------------------------------------


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _num_items(tokens: int, seqs: int, q_block: int) -> int:
    """Static bound on ``Σ ceil(q_len / q_block)`` when ``Σ q_len <= tokens``."""
    return max(1, min(tokens, tokens // q_block + min(seqs, tokens)))


def _blocks(
    problem: Problem, q_block: int | None, kv_block: int | None, per_step: int | None
) -> tuple[int, int, int]:
    """Resolve ``(q_block, kv_block, blocks_per_step)``, every ``None`` from the heuristic."""
    backend = _tuning.backend(_KV_BLOCK)
    if problem.decode:
        bq = 1
    elif q_block is None:
        # The largest power of two with seqs · (bq - 1) <= tokens: padding the last item of
        # every sequence at most doubles the rows computed, whatever the length mix.
        bq = min(_Q_BLOCK_MAX[backend], _pow2_floor(problem.tokens // problem.seqs + 1))
    else:
        bq = int(q_block)
    bq = max(1, min(bq, problem.tokens))
    ps = problem.page_size
    pages = max(1, int(kv_block if kv_block is not None else _KV_BLOCK[backend]) // ps)
    pages = min(pages, -(-problem.capacity // ps))
    bk = pages * ps
    if ps == 1:
        bk = min(bk, problem.capacity)
    # Aligned blocks covering any span of at most `capacity` keys.
    pairs = _num_items(problem.tokens, problem.seqs, bq) * (-(-problem.capacity // bk) + 1)
    if per_step is None:
        per_step = min(
            _STEP_LOGITS[backend] // (bq * bk * problem.hq),
            _STEP_KV[backend] // (bk * problem.kv_width),
            _MAX_PAIRS,
        )
    w = max(1, min(int(per_step), pairs))
    return bq, bk, w


def paged_heuristic(problem: Problem, config: type[Any]) -> Any:
    """The heuristic config of ``config``'s class for ``problem``."""
    bq, bk, w = _blocks(problem, None, None, None)
    return config(fwd_params=FwdParams(q_blocksize=bq, kv_blocksize=bk), blocks_per_step=w)


def paged_config_space(problem: Problem, config: type[Any]) -> list[Any]:
    """The heuristic's config, then a few neighbours (smaller/larger blocks, pairs per step)."""
    base = paged_heuristic(problem, config)
    bq, bk = base.fwd_params.q_blocksize, base.fwd_params.kv_blocksize
    w = base.blocks_per_step
    options = [
        (bq, bk, w),
        (bq, bk * 2, None),
        (bq, bk // 2, None),
        (bq, bk, w * 4),
        (bq, bk, w // 4),
    ]
    if not problem.decode:
        options += [(bq * 4, bk, None), (bq // 4, bk, None), (bq * 2, bk * 2, None)]
    space: list[Any] = []
    for q, k, n in options:
        q, k, n = _blocks(problem, max(1, q), max(1, k), None if n is None else max(1, n))
        cfg = config(fwd_params=FwdParams(q_blocksize=q, kv_blocksize=k), blocks_per_step=n)
        if cfg not in space:
            space.append(cfg)
    return space


def paged_problem(queries: Any, key_cache: Any, tables: Any, *, decode: bool = False) -> Problem:
    """The problem of a paged op: ``queries [T, Hq, D]``, tables ``[num_seqs, max_pages]``
    (or one sequence's ``[P]``); ``decode``: one query per sequence."""
    seqs, max_pages = tables.shape if len(tables.shape) == 2 else (1, tables.shape[0])
    page_size = int(key_cache.shape[1])
    return Problem(
        tokens=int(queries.shape[0]),
        seqs=int(seqs),
        hq=int(queries.shape[1]),
        kv_width=2 * int(key_cache.shape[2] * key_cache.shape[3]),
        page_size=page_size,
        capacity=int(max_pages) * page_size,
        decode=decode,
        head_dim=int(queries.shape[-1]),
    )


def packed_problem(kw: Mapping[str, Any]) -> Problem:
    """The problem of a packed op (``queries``, ``key_cache``, ``block_tables`` by name)."""
    return paged_problem(kw["queries"], kw["key_cache"], kw["block_tables"])


def tuning(
    config: type[Any], problem: Callable[[Mapping[str, Any]], Problem]
) -> tuple[Callable[[Any], Any], Callable[[Any], list[Any]]]:
    """An op's ``(heuristic, config_space)``: :func:`paged_heuristic` and
    :func:`paged_config_space` for ``config``'s class on ``problem(inv.kwargs)``."""

    def heuristic(inv: Any) -> Any:
        """Query blocks of the largest power of two with ``S · (bq - 1) <= T`` (capped per
        backend; one token for decode ops), ~256-key blocks of whole pages, pairs per step
        from the backend's step budget."""
        return paged_heuristic(problem(inv.kwargs), config)

    def config_space(inv: Any) -> list[Any]:
        """The heuristic's config, then a few neighbours (block sizes, pairs per step)."""
        return paged_config_space(problem(inv.kwargs), config)

    return heuristic, config_space


def make_statics(problem: Problem, cfg: Any, static: Mapping[str, Any]) -> Statics:
    """The statics of one call from its static arguments (``softmax_scale``,
    ``logits_soft_cap``, ``sliding_window``; ``causal``, true when absent), ``cfg``'s ``None``
    fields taken from the heuristic."""
    params = cfg.fwd_params if cfg is not None else FwdParams()
    per_step = cfg.blocks_per_step if cfg is not None else None
    bq, bk, w = _blocks(problem, params.q_blocksize, params.kv_blocksize, per_step)
    scale, cap, window = (
        static.get(n) for n in ("softmax_scale", "logits_soft_cap", "sliding_window")
    )
    return Statics(
        softmax_scale=float(problem.head_dim**-0.5 if scale is None else scale),
        logits_soft_cap=None if cap is None else float(cap),
        sliding_window=None if window is None else (int(window[0]), int(window[1])),
        causal=bool(static.get("causal", True)),
        q_block=bq,
        kv_block=bk,
        blocks_per_step=w,
    )


def serve(
    spec: OpSpec,
    forward: Callable[[dict[str, Any], Statics], Any],
    problem: Callable[[Mapping[str, Any]], Problem],
    cfg: Any,
    args: Mapping[str, Any],
) -> Any:
    """One call of a serving op, ``args`` by the names of its ``spec``: ``forward`` (jitted)
    on the array arguments (absent ones ``None``), with the statics of the call's problem, its
    ``cfg`` and its static arguments."""
    arrays = {a.name: args.get(a.name) for a in spec.args if a.array}
    return forward(arrays, make_statics(problem(args), cfg, args))


@functools.partial(jax.jit, static_argnames="st")
def packed_forward(a: dict[str, Any], st: Statics) -> jax.Array:
    """Packed queries over a paged cache: the forward of the ragged and unified ops, from their
    arrays by name (``num_seqs``, ``softmax_aux`` and ``alibi_slopes`` may be absent)."""
    queries, key_cache, block_tables = a["queries"], a["key_cache"], a["block_tables"]
    num_seqs = a.get("num_seqs")
    num_seqs = num_seqs if num_seqs is not None else block_tables.shape[0]
    capacity = block_tables.shape[1] * key_cache.shape[1]
    seqs = paged_sequences(a["kv_lens"], a["query_start_loc"], num_seqs, queries.shape[0], capacity)
    return attend_pages(queries, seqs, st, a, block_tables)


def attend_pages(
    queries: jax.Array, seqs: Sequences, st: Statics, a: Mapping[str, Any], block_tables: jax.Array
) -> jax.Array:
    """:func:`attend` over the pages of ``block_tables`` (:func:`paged_fetch`, up to each
    sequence's ``kv_hi``), the caches and the optional ``k_scale``, ``v_scale``,
    ``softmax_aux`` and ``alibi_slopes`` taken from the arrays ``a`` by name."""
    key_cache, value_cache = a["key_cache"], a["value_cache"]
    fetch = paged_fetch(
        key_cache,
        value_cache,
        block_tables,
        seqs.kv_hi,
        st.kv_block,
        k_scale=a.get("k_scale"),
        v_scale=a.get("v_scale"),
    )
    return attend(
        queries,
        seqs,
        fetch,
        st,
        softmax_aux=a.get("softmax_aux"),
        alibi_slopes=a.get("alibi_slopes"),
        reads=(key_cache, value_cache, block_tables),
    )


# --------------------------------------------------------------------------------------------
# Sequences and fetches
# --------------------------------------------------------------------------------------------


def paged_sequences(
    kv_lens: jax.Array, query_start_loc: jax.Array, num_seqs: jax.Array, tokens: int, capacity: int
) -> Sequences:
    """Packed queries, each sequence's being its last tokens; only ``num_seqs`` are live.

    Offsets are clamped to ``[0, T]`` and lengths to the capacity, so malformed indices stay
    in bounds.
    """
    qsl = jnp.clip(query_start_loc.astype(jnp.int32), 0, tokens)
    begin = qsl[:-1]
    live = jnp.arange(begin.shape[0]) < jnp.asarray(num_seqs).reshape(())
    q_len = jnp.where(live, jnp.maximum(qsl[1:] - begin, 0), 0)
    kv_len = kv_lens.astype(jnp.int32)
    return Sequences(
        q_begin=begin,
        q_len=q_len,
        q_pos0=kv_len - q_len,
        kv_lo=jnp.zeros_like(kv_len),
        kv_hi=jnp.clip(kv_len, 0, capacity),
    )


def decode_sequences(q_pos: jax.Array, kv_lo: jax.Array, kv_hi: jax.Array) -> Sequences:
    """One query per sequence (token ``s`` is sequence ``s``'s), at position ``q_pos``."""
    s = q_pos.shape[0]
    return Sequences(
        q_begin=jnp.arange(s, dtype=jnp.int32),
        q_len=jnp.ones((s,), jnp.int32),
        q_pos0=q_pos,
        kv_lo=kv_lo,
        kv_hi=kv_hi,
    )


def paged_fetch(
    key_cache: jax.Array,
    value_cache: jax.Array,
    block_tables: jax.Array,
    kv_hi: jax.Array,
    kv_block: int,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> Fetch:
    """Fetch key block ``b`` of sequence ``s``: its pages ``block_tables[s, b·n : (b+1)·n]``.

    Table slots past the live pages (and past the table) are replaced by page 0 before the
    gather: their ids are never used, whatever they hold. With a scale, the gathered block is
    dequantised (float32); without, it keeps the cache dtype.
    """
    num_pages, page_size = key_cache.shape[:2]
    max_pages = block_tables.shape[1]
    per_block = kv_block // page_size
    slots = jnp.arange(per_block)
    offsets = jnp.arange(kv_block)

    def fetch(seq: jax.Array, block: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        col = block[:, None] * per_block + slots  # [W, pages per block]
        live = (col < max_pages) & (col * page_size < kv_hi[seq][:, None])
        ids = block_tables[seq[:, None], jnp.minimum(col, max_pages - 1)]
        ids = jnp.where(live, jnp.clip(ids, 0, num_pages - 1), 0)
        w = seq.shape[0]
        keys = key_cache[ids].reshape(w, kv_block, *key_cache.shape[2:])
        values = value_cache[ids].reshape(w, kv_block, *value_cache.shape[2:])
        keys, values = dequantize_kv(keys, k_scale), dequantize_kv(values, v_scale)
        return keys, values, block[:, None] * kv_block + offsets

    return fetch


def dense_fetch(
    key: jax.Array,
    value: jax.Array,
    kv_block: int,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> Fetch:
    """Fetch key block ``b`` of batch row ``s`` of a dense ``[B, Sk, Hkv, D]`` cache.

    The last block is shifted left to end at ``Sk`` (``kv_block <= Sk``); the positions it
    re-reads from the previous block are masked by the caller. With a scale, the gathered
    block is dequantised (float32).
    """
    sk = key.shape[1]
    offsets = jnp.arange(kv_block)

    def fetch(seq: jax.Array, block: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        start = jnp.minimum(block * kv_block, sk - kv_block)
        positions = start[:, None] + offsets
        keys = dequantize_kv(key[seq[:, None], positions], k_scale)
        values = dequantize_kv(value[seq[:, None], positions], v_scale)
        return keys, values, positions

    return fetch


# --------------------------------------------------------------------------------------------
# The core
# --------------------------------------------------------------------------------------------


class _Items(NamedTuple):
    """Work items, each [N] int32: sequence, first token, tokens, first query position, first
    key block, key blocks."""

    seq: jax.Array
    tok0: jax.Array
    count: jax.Array
    pos0: jax.Array
    first: jax.Array
    blocks: jax.Array


def _work_items(seqs: Sequences, tokens: int, st: Statics) -> _Items:
    bq, bk = st.q_block, st.kv_block
    s = seqs.q_len.shape[0]
    n = _num_items(tokens, s, bq)
    chunks = (seqs.q_len + bq - 1) // bq
    ends = jnp.cumsum(chunks)
    idx = jnp.arange(n, dtype=jnp.int32)
    seq = jnp.minimum(_search(ends, idx), s - 1)
    chunk = idx - (ends[seq] - chunks[seq])
    valid = idx < ends[-1]
    count = jnp.where(valid, jnp.clip(seqs.q_len[seq] - chunk * bq, 0, bq), 0)
    pos0 = seqs.q_pos0[seq] + chunk * bq
    last = pos0 + count - 1
    lo = seqs.kv_lo[seq]
    hi = seqs.kv_hi[seq] - 1
    if st.sliding_window is not None:
        left, right = st.sliding_window
        lo = jnp.maximum(lo, pos0 - left)
        if not st.causal:
            hi = jnp.minimum(hi, last + right)
    if st.causal:
        hi = jnp.minimum(hi, last)
    lo = jnp.maximum(lo, 0)
    first = lo // bk
    blocks = jnp.where((count > 0) & (hi >= lo), hi // bk - first + 1, 0)
    return _Items(
        seq=seq,
        tok0=seqs.q_begin[seq] + chunk * bq,
        count=count,
        pos0=pos0,
        first=first,
        blocks=blocks,
    )


def _typed_zero(*arrays: jax.Array) -> jax.Array:
    """A float32 0 that varies over every ``shard_map`` axis one of ``arrays`` varies over: the
    sum of an empty slice of each, so none of their values (a NaN included) reaches it. Added
    to a loop's initial carry, it gives the carry the typing the body's results have."""
    zero = jnp.float32(0.0)
    for a in arrays:
        empty = a[tuple(slice(0, 0) for _ in a.shape)] if a.ndim else a[None][:0]
        zero = zero + jnp.sum(empty.astype(jnp.float32))
    return zero


def _search(sorted_ends: jax.Array, x: jax.Array) -> jax.Array:
    """Index of the first entry of ``sorted_ends`` greater than each ``x`` (int32).

    Short tables are searched by counting comparisons (no inner loop: it compiles to a handful
    of ops); long ones by binary search.
    """
    if sorted_ends.shape[0] * x.shape[0] <= _COMPARE_ALL_MAX:
        return jnp.sum(sorted_ends[None, :] <= x[:, None], axis=1, dtype=jnp.int32)
    return jnp.searchsorted(sorted_ends, x, side="right").astype(jnp.int32)


def attend(
    queries: jax.Array,
    seqs: Sequences,
    fetch: Fetch,
    st: Statics,
    *,
    softmax_aux: jax.Array | None = None,
    alibi_slopes: jax.Array | None = None,
    reads: tuple[jax.Array, ...] = (),
) -> jax.Array:
    """Attention of packed ``queries [T, Hq, D]`` over the keys ``fetch`` brings (from the
    arrays ``reads``: its caches, whose ``shard_map`` typing the loop's carry takes).

    Returns:
        [T, Hq, Dv] in the query dtype; tokens of no item and rows that see no key are zeros.
    """
    t, hq, d = queries.shape
    bq, bk, w = st.q_block, st.kv_block, st.blocks_per_step
    items = _work_items(seqs, t, st)
    n = items.seq.shape[0]
    pair_ends = jnp.cumsum(items.blocks)
    total = pair_ends[-1]
    rows = jnp.arange(bq, dtype=jnp.int32)
    probe_k, probe_v, _ = jax.eval_shape(
        fetch, jnp.zeros((w,), jnp.int32), jnp.zeros((w,), jnp.int32)
    )
    hkv, dv = probe_k.shape[2], probe_v.shape[3]
    group = hq // hkv
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.astype(jnp.float32).reshape(1, hkv, 1, group, 1)
    # One gather per step reads every per-item field a pair needs (another the per-sequence key
    # bounds): fewer, wider gathers compile and run faster than one per field.
    table = jnp.stack(
        [items.seq, items.tok0, items.count, items.pos0, items.first - (pair_ends - items.blocks)],
        axis=1,
    )
    bounds = jnp.stack([seqs.kv_lo, seqs.kv_hi], axis=1)
    # Logits are laid out [W·Hkv, bq·G, bk]: one canonical batched matmul per product (a KV
    # head's G query heads share its keys), which XLA compiles far faster than 5-D einsums.
    contract_d = (((2,), (2,)), ((0,), (0,)))
    contract_k = (((2,), (1,)), ((0,), (0,)))

    def step(
        i: Any, carry: tuple[jax.Array, jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, denom, acc = carry
        pair = i * w + jnp.arange(w, dtype=jnp.int32)
        ok = pair < total
        item = jnp.minimum(_search(pair_ends, pair), n - 1)
        fields = table[item]
        seq, tok0, count, pos0 = fields[:, 0], fields[:, 1], fields[:, 2], fields[:, 3]
        block = fields[:, 4] + pair
        kv_bounds = bounds[seq]
        keys, values, k_pos = fetch(seq, block)
        key_ok = (
            ok[:, None]
            & (k_pos >= block[:, None] * bk)
            & (k_pos < block[:, None] * bk + bk)
            & (k_pos >= kv_bounds[:, :1])
            & (k_pos < kv_bounds[:, 1:])
        )
        q_pos = pos0[:, None] + rows  # [W, bq]
        visible = (rows < count[:, None])[:, :, None] & key_ok[:, None, :]
        kp, qp = k_pos[:, None, :], q_pos[:, :, None]
        visible &= semantics.visible(qp, kp, causal=st.causal, window=st.sliding_window)
        tok = jnp.clip(tok0[:, None] + rows, 0, t - 1)
        # A dequantised (float32) block takes float32 queries; else both keep their dtype.
        q = queries[tok].astype(keys.dtype).reshape(w, bq, hkv, group, d).transpose(0, 2, 1, 3, 4)
        k = keys.transpose(0, 2, 1, 3).reshape(w * hkv, bk, d)
        s = lax.dot_general(
            q.reshape(w * hkv, bq * group, d), k, contract_d, preferred_element_type=jnp.float32
        )
        s = s.reshape(w, hkv, bq, group, bk) * st.softmax_scale
        s = semantics.soft_cap(s, st.logits_soft_cap)
        if slopes is not None:
            s = s + slopes * (kp - qp).astype(jnp.float32)[:, None, :, None, :]
        vis = visible[:, None, :, None, :]  # [W, 1, bq, 1, bk]
        s = semantics.mask_scores(s, vis)
        dest = jnp.where(ok, item, n)  # pairs past the end scatter nowhere
        m_old = m[item]
        m = m.at[dest].max(jnp.max(s, axis=-1), mode="drop")
        m_item = m[item]
        p = semantics.hide(jnp.exp(s - m_item[..., None]), vis)
        # A hidden key's probability is an exact 0, but 0 times a NaN or Inf value (a stale slot
        # past kv_len, a value the causal mask or the window hides from this row) is NaN: values
        # enter p @ V through finite_or_zero (attention_semantics), as in the references.
        values = semantics.finite_or_zero(values)
        v = values.transpose(0, 2, 1, 3).reshape(w * hkv, bk, dv)
        p_flat = p.reshape(w * hkv, bq * group, bk).astype(v.dtype)
        pv = lax.dot_general(p_flat, v, contract_k, preferred_element_type=jnp.float32)
        # Only the items this step touches are rescaled by exp(m_old - m_new): the first pair of
        # each item (pairs are sorted by item) also adds state · (alpha - 1), so the work per
        # step is O(pairs), never O(items).
        first = jnp.concatenate([jnp.ones((1,), bool), item[1:] != item[:-1]])
        fix = jnp.where(first[:, None, None, None], jnp.exp(m_old - m_item) - 1.0, 0.0)
        denom = denom.at[dest].add(jnp.sum(p, axis=-1) + denom[item] * fix, mode="drop")
        acc_delta = pv.reshape(w, hkv, bq, group, dv) + acc[item] * fix[..., None]
        acc = acc.at[dest].add(acc_delta, mode="drop")
        return m, denom, acc

    stats = (n, hkv, bq, group)
    zero = _typed_zero(queries, *reads, *jax.tree_util.tree_leaves(seqs))
    init = (
        jnp.full(stats, MASK_VALUE, jnp.float32) + zero,
        jnp.zeros(stats, jnp.float32) + zero,
        jnp.zeros((*stats, dv), jnp.float32) + zero,
    )
    steps = (total + w - 1) // w
    m, denom, acc = lax.fori_loop(0, steps, step, init)
    seen = denom > 0.0
    if softmax_aux is not None:
        # Sinks join the maximum and the denominator only (never the numerator).
        aux = softmax_aux.astype(jnp.float32).reshape(1, hkv, 1, group, -1)
        m_all = jnp.maximum(m, jnp.max(aux, axis=-1))
        rescale = jnp.exp(m - m_all)
        denom = denom * rescale + jnp.sum(jnp.exp(aux - m_all[..., None]), axis=-1)
        acc = acc * rescale[..., None]
    out = jnp.where(seen[..., None], acc / jnp.where(seen, denom, 1.0)[..., None], 0.0)
    out = out.transpose(0, 2, 1, 3, 4).reshape(n, bq, hq, dv).astype(queries.dtype)
    tok = items.tok0[:, None] + rows
    dest = jnp.where((rows < items.count[:, None]) & (tok < t), tok, t)
    return jnp.zeros((t, hq, dv), queries.dtype).at[dest].set(out, mode="drop")
