"""ragged_page_attention_v3: write the new tokens' keys/values into their pages, then attend.

Semantics (OPS.md vocabulary): :mod:`ejkernel.specs.ragged_page_attention` preceded by the
cache update. ``kv_lens`` counts tokens *after* the update, so live token ``i`` of sequence
``s`` (``q_len`` tokens, packed at ``query_start_loc[s] + i``) sits at position
``p = kv_lens[s] - q_len + i``; its key ``keys[t]`` and value ``values[t]`` are written to page
``block_tables[s, p // page_size]``, slot ``p % page_size``. Tokens of no live sequence (past
``num_seqs``, or outside every sequence's range) and tokens at a negative position are not
written. Then every query attends, causally, to its sequence's ``kv_lens[s]`` keys, the ones
just written included. Two tokens writing one slot (sequences whose *new* tokens share a page
slot) leave an unspecified one of them; sharing read-only prefix pages is fine.

With ``k_scale``/``v_scale`` (a float, or float32 ``[Hkv]``) the caches, then possibly
``float8_e4m3fn``, are read as ``cache.astype(float32) · scale`` (per KV head for ``[Hkv]``),
and the new keys/values are stored quantised with the same scales: ``x / scale`` rounded to
nearest and saturated at the cache dtype's largest magnitude (±448 for ``float8_e4m3fn``;
:func:`ejkernel.attention_semantics.quantize_kv`). ``keys``/``values`` share the queries'
dtype.

Returns ``(out [T, Hq, D], key_cache, value_cache)``, the caches updated. The update is a
functional scatter (``cache.at[page, slot].set``): under ``jax.jit`` with the caches donated
(``donate_argnums``), XLA aliases each updated cache to its input buffer and writes only the
``T`` new slots, in place; without donation the caller keeps the old caches and XLA copies.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.attention_semantics import quantize_kv
from ejkernel.specs._base import OpSpec, call_op, check_array, is_floating
from ejkernel.specs._paged import (
    packed_paged_reference,
    ragged_tokens,
    reference_of,
    synthetic_paged_inputs,
)
from ejkernel.specs.ragged_page_attention import validate_ragged_page_attention

__all__ = [
    "SPEC",
    "cache_destinations",
    "ragged_page_attention_v3",
    "ragged_page_attention_v3_reference",
    "validate_ragged_page_attention_v3",
    "write_new_tokens",
]

OP = "ragged_page_attention_v3"


def cache_destinations(
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: Any,
    num_tokens: int,
    num_pages: int,
    page_size: int,
) -> jax.Array:
    """int32 ``[T]``: each packed token's cache row ``page · page_size + slot`` (the caches seen
    as ``[num_pages · page_size, Hkv, D]``), or ``-1`` for a token that is not written: of no
    live sequence, at a negative position, past its table row, or on a page out of range.

    The one definition of where v3 writes: the reference and every platform's update use it.
    """
    max_pages = block_tables.shape[1]
    if block_tables.shape[0] == 0 or max_pages == 0:
        return jnp.full((num_tokens,), -1, jnp.int32)
    seq, position, live = ragged_tokens(query_start_loc, kv_lens, num_seqs, num_tokens)
    column = position // page_size
    live &= (position >= 0) & (column < max_pages)
    page = block_tables.astype(jnp.int32)[seq, jnp.clip(column, 0, max_pages - 1)]
    live &= (page >= 0) & (page < num_pages)
    return jnp.where(live, page * page_size + position % page_size, -1).astype(jnp.int32)


def write_new_tokens(
    cache: jax.Array,
    new: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: Any,
    scale: Any = None,
) -> jax.Array:
    """``cache`` with each live token's row of ``new [T, Hkv, D]`` written at its position
    (:func:`cache_destinations`), quantised with the cache's ``scale``
    (:func:`ejkernel.attention_semantics.quantize_kv`; ``None``: cast)."""
    num_pages, page_size = cache.shape[:2]
    tables = (kv_lens, block_tables, query_start_loc, num_seqs)
    dest = cache_destinations(*tables, new.shape[0], num_pages, page_size)
    # Tokens that must not be written go to row `num_pages · page_size`: out of range, dropped.
    dest = jnp.where(dest >= 0, dest, num_pages * page_size)
    stored = quantize_kv(new, scale, cache.dtype)
    flat = cache.reshape(num_pages * page_size, *cache.shape[2:])
    return flat.at[dest].set(stored, mode="drop").reshape(cache.shape)


def validate_ragged_page_attention_v3(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument; fill defaults; ``num_seqs`` becomes an int32 scalar array."""
    validate_ragged_page_attention(a, op=OP)
    t = int(a["queries"].shape[0])
    _, _, hkv, d = a["key_cache"].shape
    # New tokens come in the queries' dtype: the cache's, unless the cache is float8 (scaled).
    dtype, which = a["queries"].dtype, "queries'"
    if dtype == a["key_cache"].dtype:
        which = "cache"
    for name in ("keys", "values"):
        x = a[name]
        check_array(OP, name, x, ndim=3, letters="[T, Hkv, D]")
        if not is_floating(x) or x.dtype != dtype:
            raise TypeError(
                f"{OP}: `{name}` must share the {which} dtype {dtype}; got dtype {x.dtype}"
            )
        if tuple(x.shape) != (t, hkv, d):
            raise ValueError(
                f"{OP}: `{name}` must be [T, Hkv, D]={(t, hkv, d)}; got {name}.shape={tuple(x.shape)}"
            )
    return a


def ragged_page_attention_v3(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: int | jax.Array,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    softmax_aux: jax.Array | None = None,
    k_scale: float | jax.Array | None = None,
    v_scale: float | jax.Array | None = None,
    platform: str | None = None,
    cfg: Any = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write the new tokens' keys/values into the paged cache, then ragged paged attention.

    To update the cache in place, call it inside ``jax.jit`` with the caches donated and use
    the returned caches from then on::

        step = jax.jit(ejkernel.ragged_page_attention_v3, donate_argnums=(3, 4))
        out, key_cache, value_cache = step(q, k, v, key_cache, value_cache, kv_lens,
                                           block_tables, query_start_loc, num_seqs)

    Without donation the result is the same, but XLA copies the caches. So it does when a
    donated buffer cannot be reused: one still read by a computation in flight, or (on CPU)
    one that aliases NumPy memory, as ``jnp.asarray`` of an aligned NumPy array may.

    Args:
        queries: [T, Hq, D], the packed queries of every sequence.
        keys: [T, Hkv, D], the new tokens' keys (one per query token).
        values: [T, Hkv, D], the new tokens' values.
        key_cache: [num_pages, page_size, Hkv, D], Hq % Hkv == 0 (GQA/MQA).
        value_cache: [num_pages, page_size, Hkv, D].
        kv_lens: [num_seqs] int32, tokens per sequence *after* the update.
        block_tables: [num_seqs, max_pages] int32, page ids in order (the new tokens' pages
            included); slots past ``ceil(kv_len / page_size)`` are never read or written.
        query_start_loc: [num_seqs + 1] int32, offsets of each sequence's new tokens.
        num_seqs: live sequences: a Python int or an integer array of shape () or (1,).
        softmax_scale: multiplies the logits; default D ** -0.5.
        logits_soft_cap: logits become ``cap * tanh(logits / cap)`` before masking.
        sliding_window: ``(left, right)`` or ``w``; a query at position p sees keys in
            ``[p - left, p]``.
        softmax_aux: [Hq] or [Hq, n] attention-sink logits (denominator only).
        k_scale: ``None``, a float, or float32 [Hkv]: ``key_cache`` is read as
            ``key_cache.astype(float32) * k_scale`` (per KV head for [Hkv]); required when the
            cache is float8_e4m3fn (the queries keep their own, wider floating dtype).
        v_scale: the same for ``value_cache``.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only).

    Returns:
        ``(out [T, Hq, D], key_cache, value_cache)``: the attention output in the query dtype
        (zeros for tokens of no live sequence and rows that see no key) and the updated caches.
    """
    return call_op(SPEC, locals())


@reference_of(ragged_page_attention_v3)
def ragged_page_attention_v3_reference(a: dict[str, Any]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain-JAX oracle: write the new keys/values, then the ragged reference."""
    tables = tuple(a[n] for n in ("kv_lens", "block_tables", "query_start_loc", "num_seqs"))
    a["key_cache"] = write_new_tokens(a["key_cache"], a["keys"], *tables, a["k_scale"])
    a["value_cache"] = write_new_tokens(a["value_cache"], a["values"], *tables, a["v_scale"])
    out = packed_paged_reference(a)  # over the updated caches
    return out, a["key_cache"], a["value_cache"]


SPEC = OpSpec.from_function(
    ragged_page_attention_v3,
    validate=validate_ragged_page_attention_v3,
    reference=ragged_page_attention_v3_reference,
    synthetic=synthetic_paged_inputs,
    examples="ejkernel.testing.cases.ragged_page_attention_v3:examples",
)
