"""What the paged (serving) ops share: the cache record, argument checks, the references'
page gather and masked softmax, and the synthetic batches used for autotuning.

The paged layout (OPS.md): ``key_cache``/``value_cache`` ``[num_pages, page_size, Hkv, D]``;
a sequence owns the pages of its table row ``block_tables[s, :ceil(kv_len / page_size)]`` in
order, so its key at position ``p`` lives in page ``block_tables[s, p // page_size]``, slot
``p % page_size``. Table entries past the live pages are never read: they may hold any value
(``-1``, ``10**6``). Sequences may share pages (a common prefix).

Scaled caches (OPS.md): every serving op takes ``k_scale=None, v_scale=None``, each a float
or float32 ``[Hkv]``; with them the caches may be ``float8_e4m3fn`` (the queries then keep a
wider floating dtype) and are read as ``cache.astype(float32) · scale``, per KV head for
``[Hkv]`` (:func:`ejkernel.attention_semantics.dequantize_kv`). A ``float8_e4m3fn`` cache
without its scale is an error; a wider cache with scales is read by the same formula.

Every check raises ValueError/TypeError starting with the op, naming the argument and the
expected shape in OPS.md letters.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.attention_semantics import (
    dequantize_kv,
    finite_or_zero,
    hide,
    mask_scores,
    soft_cap,
    visible,
)
from ejkernel.specs._base import (
    CALL_PARAMETERS,
    check_array,
    check_floating,
    default_synthetic,
    is_floating,
    is_integer,
    jit_over_arrays,
)

__all__ = [
    "FP8",
    "PagedCache",
    "attend_rows",
    "check_block_tables",
    "check_cache_dtype",
    "check_counted_vector",
    "check_index_vector",
    "check_kv_scales",
    "check_paged_cache",
    "check_paged_call",
    "check_queries",
    "check_scalar_index",
    "check_sinks",
    "gather_sequence_pages",
    "packed_paged_reference",
    "paged_block_tables",
    "paged_reference",
    "ragged_tokens",
    "reference_of",
    "synthetic_paged_batch",
    "synthetic_paged_inputs",
    "synthetic_scales",
    "window_mask",
]

_CACHE_LETTERS = "[num_pages, page_size, Hkv, D]"
#: The narrow cache dtype the serving ops read with ``k_scale``/``v_scale``.
FP8 = jnp.dtype(jnp.float8_e4m3fn)


@attrs.frozen(kw_only=True)
class PagedCache:
    """The sizes of a checked paged KV cache (Python ints) and its dtype."""

    num_pages: int
    page_size: int
    hkv: int
    d: int
    dtype: Any


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def check_paged_cache(op: str, key_cache: Any, value_cache: Any) -> PagedCache:
    """Check the paged layout: two equal floating ``[num_pages, page_size, Hkv, D]`` arrays."""
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_array(op, name, x, ndim=4, letters=_CACHE_LETTERS)
        check_floating(op, ((name, x),))
    if tuple(value_cache.shape) != tuple(key_cache.shape) or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"{op}: `value_cache` must match `key_cache` {_CACHE_LETTERS}; got value_cache "
            f"{tuple(value_cache.shape)} {value_cache.dtype}, key_cache "
            f"{tuple(key_cache.shape)} {key_cache.dtype}"
        )
    check_cache_dtype(op, "key_cache", key_cache.dtype)
    if min(key_cache.shape) == 0:
        raise ValueError(
            f"{op}: `key_cache` {_CACHE_LETTERS} must have no empty axis; got "
            f"{tuple(key_cache.shape)}"
        )
    num_pages, page_size, hkv, d = (int(n) for n in key_cache.shape)
    return PagedCache(num_pages=num_pages, page_size=page_size, hkv=hkv, d=d, dtype=key_cache.dtype)


def check_queries(op: str, name: str, x: Any, *, letters: str, cache: PagedCache) -> int:
    """Check a query array whose last two axes are ``[Hq, D]`` against the cache; return Hq."""
    check_array(op, name, x, ndim=len(letters.split(",")), letters=letters)
    check_floating(op, ((name, x),))
    check_cache_dtype(op, name, x.dtype, cache.dtype, pair="the key/value cache")
    hq = int(x.shape[-2])
    if int(x.shape[-1]) != cache.d or hq == 0 or hq % cache.hkv != 0:
        raise ValueError(
            f"{op}: `{name}` must be {letters} with D={cache.d} and Hq % Hkv == 0 "
            f"(Hkv={cache.hkv}); got {name}.shape={tuple(x.shape)}"
        )
    if min(x.shape[1:]) == 0:  # no sequences (or tokens) is an empty call, not an error
        raise ValueError(
            f"{op}: `{name}` must have non-empty Hq and D; got {name}.shape={tuple(x.shape)}"
        )
    return hq


def check_paged_call(op: str, a: dict[str, Any], name: str, letters: str) -> tuple[PagedCache, int]:
    """The caches (:func:`check_paged_cache`), the query array ``a[name]``
    (:func:`check_queries`) and ``k_scale``/``v_scale`` (:func:`check_kv_scales`) of a paged
    op's arguments ``a``; return the cache sizes and Hq."""
    cache = check_paged_cache(op, a["key_cache"], a["value_cache"])
    hq = check_queries(op, name, a[name], letters=letters, cache=cache)
    check_kv_scales(op, a, hkv=cache.hkv, cache_dtype=cache.dtype)
    return cache, hq


def _is_8bit_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating)) and jnp.dtype(dtype).itemsize == 1


def check_cache_dtype(
    op: str, name: str, dtype: Any, cache_dtype: Any = None, *, pair: str = ""
) -> None:
    """A cache dtype is floating and ``float8_e4m3fn`` if 8-bit; with ``cache_dtype``, ``name``
    is the query (``pair`` names the cache in the message): it shares the cache dtype, or the
    cache is ``float8_e4m3fn`` and the query is a wider floating dtype. Raises TypeError."""
    if cache_dtype is None:
        if _is_8bit_float(dtype) and jnp.dtype(dtype) != FP8:
            raise TypeError(
                f"{op}: `{name}` must be float8_e4m3fn (read with k_scale/v_scale) or a wider "
                f"floating dtype; got dtype {dtype}"
            )
        return
    if dtype == cache_dtype and not _is_8bit_float(dtype):
        return
    if jnp.dtype(cache_dtype) == FP8 and not _is_8bit_float(dtype):
        return
    raise TypeError(
        f"{op}: `{name}` and {pair} must share one dtype, or the cache be float8_e4m3fn (read "
        f"with k_scale/v_scale) and `{name}` a wider floating dtype; got {dtype} and "
        f"{cache_dtype}"
    )


def check_kv_scales(
    op: str,
    a: dict[str, Any],
    *,
    hkv: int,
    cache_dtype: Any,
    caches: tuple[str, str] = ("key_cache", "value_cache"),
) -> None:
    """``k_scale``/``v_scale`` of ``a``: None, a float, or float32 ``[Hkv]`` (a float32 scalar
    array is a per-tensor scale too: it may be traced); a ``float8_e4m3fn`` cache needs both.

    A Python number must be finite and > 0 (an array may be traced, so its values are not
    checked); it becomes a float32 scalar array, so the scale's value never enters a cache key.
    ``caches`` name the key and value caches in messages.
    """
    for scale_name, cache_name in zip(("k_scale", "v_scale"), caches, strict=True):
        scale = a.get(scale_name)
        expected = f"{op}: `{scale_name}` must be a float or a float32 array [Hkv] with Hkv={hkv}"
        if scale is None:
            if jnp.dtype(cache_dtype) == FP8:
                raise ValueError(f"{expected} when `{cache_name}` is float8_e4m3fn; got None")
            continue
        if isinstance(scale, (bool, np.bool_)):
            raise TypeError(f"{expected}; got {scale!r}")
        if isinstance(scale, (int, float, np.integer, np.floating)):
            with np.errstate(over="ignore"):  # a float past float32's range is refused below
                value = np.float32(scale)
            if not (np.isfinite(value) and value > 0):
                raise ValueError(f"{op}: `{scale_name}` must be finite and > 0; got {scale!r}")
            a[scale_name] = np.asarray(value, np.float32)
            continue
        if not hasattr(scale, "shape") or not hasattr(scale, "dtype"):
            raise TypeError(f"{expected}; got {type(scale).__name__}")
        if scale.dtype != np.float32:
            raise TypeError(f"{expected}; got dtype {scale.dtype}")
        if tuple(scale.shape) not in ((), (hkv,)):
            raise ValueError(f"{expected}; got {scale_name}.shape={tuple(scale.shape)}")


def check_index_vector(op: str, name: str, x: Any, *, letters: str, length: int) -> None:
    """An integer array of shape ``[length]``."""
    check_array(op, name, x, ndim=1, letters=letters)
    if not is_integer(x):
        raise TypeError(
            f"{op}: `{name}` must be an integer (int32) array {letters}; got dtype {x.dtype}"
        )
    if int(x.shape[0]) != length:
        raise ValueError(
            f"{op}: `{name}` must be {letters}={(length,)}; got {name}.shape={tuple(x.shape)}"
        )


def check_counted_vector(
    op: str, name: str, x: Any, *, count: str, allow_empty: bool = False
) -> int:
    """An integer array ``[count]`` whose length defines ``count``; returns it. Empty only when
    ``allow_empty`` (a call with no tokens may have no sequences)."""
    letters = f"[{count}]"
    check_array(op, name, x, ndim=1, letters=letters)
    length = int(x.shape[0])
    if length == 0 and not allow_empty:
        raise ValueError(
            f"{op}: `{name}` must be {letters} with {count} >= 1; got {name}.shape=(0,)"
        )
    check_index_vector(op, name, x, letters=letters, length=length)
    return length


def check_block_tables(op: str, name: str, x: Any, *, num_seqs: int) -> int:
    """``[num_seqs, max_pages]`` integers; return ``max_pages``."""
    letters = "[num_seqs, max_pages]"
    check_array(op, name, x, ndim=2, letters=letters)
    if not is_integer(x):
        raise TypeError(
            f"{op}: `{name}` must be an integer (int32) array {letters}; got dtype {x.dtype}"
        )
    if int(x.shape[0]) != num_seqs or int(x.shape[1]) == 0:
        raise ValueError(
            f"{op}: `{name}` must be {letters} with num_seqs={num_seqs} (from kv_lens) and "
            f"max_pages >= 1; got {name}.shape={tuple(x.shape)}"
        )
    return int(x.shape[1])


def check_scalar_index(op: str, name: str, x: Any, *, upper: int | None = None) -> jax.Array:
    """A Python int or an integer array of shape ``()``/``(1,)``; returned as an int32 scalar.

    A Python int is range-checked against ``[0, upper]``; an array may be traced, so its value
    is not.
    """
    expected = f"{op}: `{name}` must be an int or an integer array of shape () or (1,); got"
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{expected} {x!r}")
    if isinstance(x, (int, np.integer)):
        if x < 0 or (upper is not None and x > upper):
            bound = f"[0, {upper}]" if upper is not None else ">= 0"
            raise ValueError(f"{op}: `{name}` must be in {bound}; got {int(x)}")
        return jnp.asarray(int(x), jnp.int32)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{expected} {type(x).__name__}")
    if tuple(x.shape) not in ((), (1,)) or not is_integer(x):
        raise TypeError(f"{expected} {name}.shape={tuple(x.shape)}, dtype {x.dtype}")
    return jnp.asarray(x).reshape(()).astype(jnp.int32)


def check_sinks(op: str, aux: Any, hq: int) -> None:
    """``softmax_aux``: None, or floating ``[Hq]`` / ``[Hq, n]``."""
    if aux is None:
        return
    check_array(op, "softmax_aux", aux, ndim=(1, 2), letters="[Hq] or [Hq, n]")
    if int(aux.shape[0]) != hq or not is_floating(aux) or min(aux.shape) == 0:
        raise ValueError(
            f"{op}: `softmax_aux` must be floating [Hq] or [Hq, n] with Hq={hq}; got "
            f"softmax_aux.shape={tuple(aux.shape)}, dtype {aux.dtype}"
        )


# --------------------------------------------------------------------------------------------
# Reference pieces (plain JAX, written for clarity)
# --------------------------------------------------------------------------------------------


def reference_of(
    op: Callable[..., Any],
) -> Callable[[Callable[[dict[str, Any]], Any]], Callable[..., Any]]:
    """Decorator: ``body(a)`` becomes the reference of the public function ``op``.

    The reference takes ``op``'s arguments (``platform`` and ``cfg`` aside), positionally or by
    name, under ``op``'s signature; ``body`` receives them as one dict by name, the defaults
    filled, as the op's implementations do; it runs as one program (:func:`jit_over_arrays`).
    """
    full = inspect.signature(op)
    signature = full.replace(
        parameters=[p for p in full.parameters.values() if p.name not in CALL_PARAMETERS]
    )

    def decorate(body: Callable[[dict[str, Any]], Any]) -> Callable[..., Any]:
        @functools.wraps(body)
        def reference(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return body(dict(bound.arguments))

        reference.__signature__ = signature  # type: ignore[attr-defined]
        return jit_over_arrays(reference)

    return decorate


def gather_sequence_pages(cache: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Every sequence's keys (or values) in order: ``[num_seqs, max_pages · page_size, Hkv, D]``.

    Table entries past the live pages may be garbage; they are clamped into range here and
    the keys they bring are masked by the caller (position >= kv_len).
    """
    num_pages, page_size = cache.shape[:2]
    pages = cache[jnp.clip(block_tables, 0, num_pages - 1)]  # [S, max_pages, page_size, Hkv, D]
    s, max_pages = block_tables.shape
    return pages.reshape(s, max_pages * page_size, *cache.shape[2:])


def ragged_tokens(
    query_start_loc: jax.Array, kv_lens: jax.Array, num_seqs: Any, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each packed token: ``(sequence, position, live)``.

    Token ``t`` belongs to sequence ``s`` when ``query_start_loc[s] <= t <
    query_start_loc[s + 1]``; it is live when ``s < num_seqs``; its position is
    ``kv_lens[s] - q_len + (t - query_start_loc[s])`` (the queries are the last tokens).
    """
    qsl = query_start_loc.astype(jnp.int32)
    t = jnp.arange(num_tokens)
    seq = jnp.searchsorted(qsl[1:], t, side="right")
    seq_c = jnp.minimum(seq, qsl.shape[0] - 2)
    live = (seq < jnp.asarray(num_seqs).reshape(())) & (t >= qsl[seq_c])
    q_len = qsl[seq_c + 1] - qsl[seq_c]
    position = kv_lens.astype(jnp.int32)[seq_c] - q_len + (t - qsl[seq_c])
    return seq_c, position, live


def window_mask(
    key_pos: jax.Array, query_pos: jax.Array, *, causal: bool, sliding_window: Any
) -> jax.Array:
    """Causal and sliding-window visibility of keys at ``key_pos`` from queries at ``query_pos``
    (:func:`ejkernel.attention_semantics.visible`; an int window is ``(w, w)``)."""
    window = (sliding_window, sliding_window) if isinstance(sliding_window, int) else sliding_window
    return visible(query_pos, key_pos, causal=causal, window=window)


def attend_rows(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: jax.Array,
    *,
    softmax_scale: float,
    logits_soft_cap: float | None,
    bias: jax.Array | None = None,
    softmax_aux: jax.Array | None = None,
) -> jax.Array:
    """Materialised attention of independent rows in float32.

    Args:
        q: [R, Hq, D], one query per row.
        k: [R, K, Hkv, D], the keys each row may look at; v: [R, K, Hkv, Dv].
        visible: [R, K] bool.
        softmax_scale: multiplies the logits.
        logits_soft_cap: ``cap · tanh(logits / cap)`` before the bias and masking, or None.
        bias: [R, Hq, K] added after the soft cap (ALiBi), or None.
        softmax_aux: [Hq] or [Hq, n] sink logits (denominator only), or None.

    Returns:
        [R, Hq, Dv] in q's dtype; rows with no visible key are zeros.
    """
    hq, hkv = q.shape[1], k.shape[2]
    k = jnp.repeat(k.astype(jnp.float32), hq // hkv, axis=2)
    # A value enters p @ V through finite_or_zero and a hidden key's probability is an exact
    # 0 (attention_semantics), so garbage (even NaN) in a slot a row cannot see never leaks in.
    v = jnp.repeat(finite_or_zero(v.astype(jnp.float32)), hq // hkv, axis=2)
    vis = visible[:, None, :]
    logits = jnp.einsum("rhd,rkhd->rhk", q.astype(jnp.float32), k) * softmax_scale
    logits = soft_cap(logits, logits_soft_cap)
    if bias is not None:
        logits = logits + bias
    logits = mask_scores(logits, vis)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if softmax_aux is not None:
        aux = softmax_aux.astype(jnp.float32).reshape(hq, -1)
        row_max = jnp.maximum(row_max, jnp.max(aux, axis=-1)[None, :, None])
    p = hide(jnp.exp(logits - row_max), vis)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if softmax_aux is not None:
        denom = denom + jnp.sum(jnp.exp(aux[None] - row_max), axis=-1, keepdims=True)
    any_visible = jnp.any(visible, axis=-1)[:, None, None]
    p = jnp.where(any_visible, p / jnp.where(denom == 0, 1.0, denom), 0.0)
    return jnp.einsum("rhk,rkhd->rhd", p, v).astype(q.dtype)


def paged_reference(
    queries: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    tokens: tuple[jax.Array, jax.Array, jax.Array],
    a: Mapping[str, Any],
    *,
    causal: bool = True,
) -> jax.Array:
    """The reference of every paged op: each query row attends over its sequence's pages.

    Args:
        queries: [T, Hq, D].
        block_tables: [num_seqs, max_pages] page ids.
        kv_lens: [num_seqs], keys per sequence (clamped to its capacity by the mask).
        tokens: ``(sequence [T], position [T], live [T])`` of every query row; a row that is
            not live, or sees no key, is zeros.
        a: the op's other arguments by name: ``key_cache``, ``value_cache`` [num_pages,
            page_size, Hkv, D] and, each None or absent when unused, ``softmax_scale`` (None
            means D ** -0.5), ``logits_soft_cap``, ``sliding_window``, ``softmax_aux`` (as
            OPS.md defines them), ``alibi_slopes`` ([Hq]; adds ``slope · (key_pos -
            query_pos)`` after the soft cap), ``k_scale``/``v_scale`` (the caches are read as
            ``cache.astype(float32) · scale``,
            :func:`ejkernel.attention_semantics.dequantize_kv`).
        causal: keys at positions <= the query's only.
    """
    softmax_scale = a.get("softmax_scale")
    if softmax_scale is None:
        softmax_scale = queries.shape[-1] ** -0.5
    seq, q_pos, live = tokens
    keys = dequantize_kv(gather_sequence_pages(a["key_cache"], block_tables), a.get("k_scale"))
    values = dequantize_kv(gather_sequence_pages(a["value_cache"], block_tables), a.get("v_scale"))
    k_pos = jnp.arange(keys.shape[1])[None, :]
    kv_len = kv_lens.astype(jnp.int32)[seq][:, None]
    window = a.get("sliding_window")
    visible = (
        live[:, None]
        & (k_pos < kv_len)
        & window_mask(k_pos, q_pos[:, None], causal=causal, sliding_window=window)
    )
    bias = None
    alibi_slopes = a.get("alibi_slopes")
    if alibi_slopes is not None:
        distance = (k_pos - q_pos[:, None]).astype(jnp.float32)  # [T, capacity]
        bias = alibi_slopes.astype(jnp.float32)[None, :, None] * distance[:, None, :]
    return attend_rows(
        queries,
        keys[seq],
        values[seq],
        visible,
        softmax_scale=softmax_scale,
        logits_soft_cap=a.get("logits_soft_cap"),
        bias=bias,
        softmax_aux=a.get("softmax_aux"),
    )


def packed_paged_reference(a: Mapping[str, Any]) -> jax.Array:
    """The reference of the packed paged ops (ragged, v3, unified), from their arguments by
    name: each token's sequence and position from ``query_start_loc`` (:func:`ragged_tokens`;
    every sequence live without ``num_seqs``), then :func:`paged_reference` (causal unless
    ``causal`` is given and false)."""
    queries, kv_lens = a["queries"], a["kv_lens"]
    num_seqs = a.get("num_seqs", kv_lens.shape[0])
    tokens = ragged_tokens(a["query_start_loc"], kv_lens, num_seqs, queries.shape[0])
    causal = a.get("causal", True)
    return paged_reference(queries, a["block_tables"], kv_lens, tokens, a, causal=causal)


# --------------------------------------------------------------------------------------------
# Synthetic inputs (autotuning, tests, benchmarks)
# --------------------------------------------------------------------------------------------


def paged_block_tables(
    rng: np.random.Generator,
    kv_lens: Sequence[int] | np.ndarray,
    *,
    num_pages: int,
    page_size: int,
    max_pages: int,
    unused: int | Sequence[int] = 0,
    shared_pages: int | Sequence[int] = 0,
) -> np.ndarray:
    """Block tables ``[num_seqs, max_pages]`` (int32) holding ``kv_lens`` tokens.

    Live pages are distinct and in shuffled order when the cache has enough of them (drawn
    with repeats otherwise); sequence ``s``'s first ``shared_pages`` live pages (one count for
    all, or one per sequence) are sequence 0's, a shared prefix; slots past the live pages hold
    ``unused`` (cycled when a sequence: tests put garbage such as ``-1`` or ``10**6`` there).
    """
    live = [-(-int(n) // page_size) for n in kv_lens]
    total = sum(live)
    order = (
        rng.permutation(num_pages)[:total]
        if num_pages >= total
        else rng.integers(0, num_pages, total)
    )
    tables = np.resize(np.asarray(unused, np.int64).reshape(-1), (len(live), max_pages))
    shared = np.resize(np.asarray(shared_pages, np.int64).reshape(-1), len(live))
    used = 0
    for s, n in enumerate(live):
        tables[s, :n] = order[used : used + n]
        used += n
        prefix = min(int(shared[s]), n, live[0])
        tables[s, :prefix] = tables[0, :prefix]
    return tables.astype(np.int32)


#: Queries per prefill chunk in a synthetic serving step (:func:`synthetic_paged_batch`).
SYNTHETIC_CHUNK = 512


def synthetic_paged_batch(
    rng: np.random.Generator,
    *,
    num_seqs: int,
    num_tokens: int,
    num_pages: int,
    page_size: int,
    max_pages: int,
) -> dict[str, np.ndarray]:
    """A valid packed batch shaped like a serving step: ``kv_lens``, ``block_tables``,
    ``query_start_loc`` (int32).

    Every sequence has one query (a decode) while tokens last; the tokens past one a sequence
    go to the last sequences as prefill chunks of about :data:`SYNTHETIC_CHUNK` queries
    (as far as their capacity allows); each sequence holds at least its queries, its length
    drawn up to the capacity; pages come from :func:`paged_block_tables`.
    """
    capacity = max_pages * page_size
    q_lens = (np.arange(num_seqs) < num_tokens).astype(np.int64)
    extra = max(num_tokens - num_seqs, 0)
    chunks = min(num_seqs, -(-extra // SYNTHETIC_CHUNK))
    for i, s in enumerate(range(num_seqs - chunks, num_seqs)):
        share = extra // chunks + (i < extra % chunks)
        q_lens[s] = min(capacity, 1 + share)
    kv_lens = np.array([rng.integers(q, capacity + 1) for q in q_lens], np.int64)
    tables = paged_block_tables(
        rng, kv_lens, num_pages=num_pages, page_size=page_size, max_pages=max_pages
    )
    return {
        "kv_lens": kv_lens.astype(np.int32),
        "block_tables": tables,
        "query_start_loc": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
    }


def synthetic_scales(abstract: Mapping[str, Any], out: dict[str, Any], seed: int) -> dict[str, Any]:
    """``out`` with array ``k_scale``/``v_scale`` drawn in ``[0.5, 1.5)`` (scales are > 0)."""
    rng = np.random.default_rng(seed + 1)
    for name in ("k_scale", "v_scale"):
        a = abstract.get(name)
        if isinstance(a, jax.ShapeDtypeStruct):
            out[name] = rng.uniform(0.5, 1.5, a.shape).astype(a.dtype)
    return out


def synthetic_paged_inputs(abstract: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Valid inputs of any paged-cache op from abstract shapes (the spec's ``synthetic``).

    Floating arrays are standard normal; the index arrays the op takes are a valid batch of
    :func:`synthetic_paged_batch`: packed queries (``queries``, ``query_start_loc``, every
    sequence live), one decode query per sequence (``query`` and ``block_tables``) or one
    sequence's chunk (``query`` and ``page_indices``, ``kv_len``).
    """
    out = synthetic_scales(abstract, default_synthetic(abstract, seed), seed)
    num_pages, page_size = abstract["key_cache"].shape[:2]
    single = "page_indices" in abstract
    if single:
        num_seqs, max_pages = 1, abstract["page_indices"].shape[0]
    else:
        num_seqs, max_pages = abstract["block_tables"].shape
    query = abstract["queries" if "queries" in abstract else "query"]
    batch = synthetic_paged_batch(
        np.random.default_rng(seed),
        num_seqs=num_seqs,
        num_tokens=query.shape[0] if single or "queries" in abstract else num_seqs,
        num_pages=num_pages,
        page_size=page_size,
        max_pages=max_pages,
    )
    if single:
        batch = {"page_indices": batch["block_tables"][0], "kv_len": batch["kv_lens"][0]}
    # NumPy, not jnp: tuning starts while a trace is active, where jnp operations are staged.
    for name, value in batch.items():
        if name in abstract:
            out[name] = np.broadcast_to(value, abstract[name].shape).astype(abstract[name].dtype)
    if "num_seqs" in abstract:
        out["num_seqs"] = np.full(abstract["num_seqs"].shape, num_seqs, abstract["num_seqs"].dtype)
    return out
