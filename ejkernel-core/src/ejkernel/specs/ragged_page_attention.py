"""ragged_page_attention: mixed prefill and decode over a paged KV cache (forward only).

Semantics every implementation follows (OPS.md vocabulary):

- The paged layout: ``key_cache``/``value_cache`` ``[num_pages, page_size, Hkv, D]``; sequence
  ``s`` owns the pages ``block_tables[s, :ceil(kv_lens[s] / page_size)]`` in order, so its key
  at position ``p`` lives in page ``block_tables[s, p // page_size]``, slot ``p % page_size``.
  Table entries past the live pages are never read: they may hold any value (``-1``, ``10**6``).
  Sequences may share pages (a common prefix).
- ``queries [T, Hq, D]`` are packed: sequence ``s`` owns tokens
  ``query_start_loc[s] : query_start_loc[s + 1]``, its ``q_len`` queries being its *last*
  tokens, so query ``i`` sits at position ``kv_lens[s] - q_len + i`` (bottom-right causal: a
  decode step sees the whole cache, a prefill chunk sees its prefix and itself). A query whose
  position is negative (``q_len > kv_len``) sees no key.
- Only the first ``num_seqs`` sequences are live (a Python int, or an integer array of shape
  ``()`` or ``(1,)`` that may be traced, so one compiled kernel serves every batch size up to
  ``kv_lens.shape[0]``). Tokens of no live sequence, and rows that see no key, are zeros.
- logits = ``softmax_scale · q·kᵀ``; ``cap · tanh(logits / cap)`` when ``logits_soft_cap`` is
  set; then the causal mask and ``sliding_window=(left, right)`` (keys in ``[p - left,
  p + right]``; ``right`` is moot under causality); ``softmax_aux`` ``[Hq]`` or ``[Hq, n]``
  sink logits join the softmax denominator only. GQA: query head ``h`` reads KV head
  ``h // (Hq // Hkv)``. Accumulation is float32; the output keeps the query dtype.

Index values are never validated (they may be traced): lengths beyond a sequence's capacity
``max_pages · page_size`` are clamped to it, and malformed offsets give unspecified (but finite,
in-bounds) results.

This module also holds what every paged op shares: the argument checks, the per-sequence key
gather of the references, the dense masked softmax they end in, and the synthetic batch used
for autotuning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.specs._base import (
    Arg,
    OpSpec,
    call_op,
    check_array,
    default_synthetic,
    is_floating,
    is_integer,
)
from ejkernel.specs.flash_attention import _number, normalize_window

__all__ = [
    "SPEC",
    "attend_rows",
    "check_block_tables",
    "check_index_vector",
    "check_paged_cache",
    "check_queries",
    "check_scalar_index",
    "check_sinks",
    "gather_sequence_pages",
    "packed_paged_reference",
    "paged_block_tables",
    "paged_statics",
    "ragged_page_attention",
    "ragged_page_attention_reference",
    "ragged_tokens",
    "synthetic_packed_inputs",
    "synthetic_paged_batch",
    "validate_ragged_page_attention",
    "window_mask",
]

OP = "ragged_page_attention"


# --------------------------------------------------------------------------------------------
# Argument checks shared by the paged ops
# --------------------------------------------------------------------------------------------


def check_paged_cache(op: str, key_cache: Any, value_cache: Any) -> tuple[int, int, int, int]:
    """Check the paged layout; return ``(num_pages, page_size, Hkv, D)``."""
    letters = "[num_pages, page_size, Hkv, D]"
    check_array(op, "key_cache", key_cache, ndim=4, letters=letters)
    check_array(op, "value_cache", value_cache, ndim=4, letters=letters)
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not is_floating(x):
            raise TypeError(f"{op}: `{name}` must be a floating array; got dtype {x.dtype}")
    if tuple(value_cache.shape) != tuple(key_cache.shape) or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"{op}: `value_cache` must match `key_cache` {letters}; got value_cache "
            f"{tuple(value_cache.shape)} {value_cache.dtype}, key_cache "
            f"{tuple(key_cache.shape)} {key_cache.dtype}"
        )
    if min(key_cache.shape) == 0:
        raise ValueError(
            f"{op}: `key_cache` {letters} must have no empty axis; got {tuple(key_cache.shape)}"
        )
    num_pages, page_size, hkv, d = (int(n) for n in key_cache.shape)
    return num_pages, page_size, hkv, d


def check_queries(op: str, name: str, x: Any, *, letters: str, hkv: int, d: int, dtype: Any) -> int:
    """Check a query array whose last two axes are ``[Hq, D]``; return ``Hq``."""
    check_array(op, name, x, ndim=len(letters.split(",")), letters=letters)
    if not is_floating(x):
        raise TypeError(f"{op}: `{name}` must be a floating array; got dtype {x.dtype}")
    if x.dtype != dtype:
        raise TypeError(
            f"{op}: `{name}` and the key/value cache must share one dtype; got {x.dtype} and {dtype}"
        )
    hq = int(x.shape[-2])
    if int(x.shape[-1]) != d or hq == 0 or hq % hkv != 0:
        raise ValueError(
            f"{op}: `{name}` must be {letters} with D={d} and Hq % Hkv == 0 (Hkv={hkv}); "
            f"got {name}.shape={tuple(x.shape)}"
        )
    if min(x.shape) == 0:
        raise ValueError(f"{op}: `{name}` must not be empty; got {name}.shape={tuple(x.shape)}")
    return hq


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
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(
            f"{op}: `{name}` must be an int or an integer array of shape () or (1,); got {x!r}"
        )
    if isinstance(x, (int, np.integer)):
        if x < 0 or (upper is not None and x > upper):
            bound = f"[0, {upper}]" if upper is not None else ">= 0"
            raise ValueError(f"{op}: `{name}` must be in {bound}; got {int(x)}")
        return jnp.asarray(int(x), jnp.int32)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"{op}: `{name}` must be an int or an integer array of shape () or (1,); got {type(x).__name__}"
        )
    if tuple(x.shape) not in ((), (1,)) or not is_integer(x):
        raise TypeError(
            f"{op}: `{name}` must be an int or an integer array of shape () or (1,); got "
            f"{name}.shape={tuple(x.shape)}, dtype {x.dtype}"
        )
    return jnp.asarray(x).reshape(()).astype(jnp.int32)


def check_sinks(op: str, aux: Any, hq: int) -> None:
    if aux is None:
        return
    check_array(op, "softmax_aux", aux, ndim=(1, 2), letters="[Hq] or [Hq, n]")
    if int(aux.shape[0]) != hq or not is_floating(aux) or min(aux.shape) == 0:
        raise ValueError(
            f"{op}: `softmax_aux` must be floating [Hq] or [Hq, n] with Hq={hq}; got "
            f"softmax_aux.shape={tuple(aux.shape)}, dtype {aux.dtype}"
        )


def paged_statics(op: str, a: dict[str, Any], *, d: int) -> None:
    """Normalise ``softmax_scale``, ``logits_soft_cap`` and ``sliding_window`` in place."""
    scale = a.get("softmax_scale")
    a["softmax_scale"] = float(d**-0.5 if scale is None else _number(op, "softmax_scale", scale))
    cap = a.get("logits_soft_cap")
    if cap is not None:
        cap = _number(op, "logits_soft_cap", cap)
        if not cap > 0:
            raise ValueError(f"{op}: `logits_soft_cap` must be > 0; got {cap}")
        a["logits_soft_cap"] = cap
    a["sliding_window"] = normalize_window(op, a.get("sliding_window"))


def validate_ragged_page_attention(a: dict[str, Any], *, op: str = OP) -> dict[str, Any]:
    """Check every argument; fill defaults; ``num_seqs`` becomes an int32 scalar array."""
    _, _, hkv, d = check_paged_cache(op, a["key_cache"], a["value_cache"])
    dtype = a["key_cache"].dtype
    hq = check_queries(op, "queries", a["queries"], letters="[T, Hq, D]", hkv=hkv, d=d, dtype=dtype)
    kv_lens = a["kv_lens"]
    check_array(op, "kv_lens", kv_lens, ndim=1, letters="[num_seqs]")
    num_seqs = int(kv_lens.shape[0])
    if num_seqs == 0:
        raise ValueError(
            f"{op}: `kv_lens` must be [num_seqs] with num_seqs >= 1; got kv_lens.shape=(0,)"
        )
    check_index_vector(op, "kv_lens", kv_lens, letters="[num_seqs]", length=num_seqs)
    check_block_tables(op, "block_tables", a["block_tables"], num_seqs=num_seqs)
    check_index_vector(
        op, "query_start_loc", a["query_start_loc"], letters="[num_seqs + 1]", length=num_seqs + 1
    )
    if "num_seqs" in a:
        a["num_seqs"] = check_scalar_index(op, "num_seqs", a["num_seqs"], upper=num_seqs)
    check_sinks(op, a.get("softmax_aux"), hq)
    paged_statics(op, a, d=d)
    return a


# --------------------------------------------------------------------------------------------
# Reference pieces shared by the paged ops (plain JAX, written for clarity)
# --------------------------------------------------------------------------------------------


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
        bias: [R, Hq, K] added after the soft cap (ALiBi), or None.
        softmax_aux: [Hq] or [Hq, n] sink logits (denominator only), or None.

    Returns:
        [R, Hq, Dv] in q's dtype; rows with no visible key are zeros.
    """
    hq, hkv = q.shape[1], k.shape[2]
    k = jnp.repeat(k.astype(jnp.float32), hq // hkv, axis=2)
    # Values of invisible keys are zeroed, so garbage (even NaN) in unused slots never leaks in.
    v = jnp.where(visible[:, :, None, None], v.astype(jnp.float32), 0.0)
    v = jnp.repeat(v, hq // hkv, axis=2)
    logits = jnp.einsum("rhd,rkhd->rhk", q.astype(jnp.float32), k) * softmax_scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    if bias is not None:
        logits = logits + bias
    logits = jnp.where(visible[:, None, :], logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if softmax_aux is not None:
        aux = softmax_aux.astype(jnp.float32).reshape(hq, -1)
        row_max = jnp.maximum(row_max, jnp.max(aux, axis=-1)[None, :, None])
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(logits - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if softmax_aux is not None:
        denom = denom + jnp.sum(jnp.exp(aux[None] - row_max), axis=-1, keepdims=True)
    any_visible = jnp.any(visible, axis=-1)[:, None, None]
    p = jnp.where(any_visible, p / jnp.where(denom == 0, 1.0, denom), 0.0)
    return jnp.einsum("rhk,rkhd->rhd", p, v).astype(q.dtype)


def window_mask(
    key_pos: jax.Array, query_pos: jax.Array, *, causal: bool, sliding_window: Any
) -> jax.Array:
    """Causal and sliding-window visibility of keys at ``key_pos`` from queries at ``query_pos``."""
    visible = jnp.ones(jnp.broadcast_shapes(key_pos.shape, query_pos.shape), bool)
    if causal:
        visible &= key_pos <= query_pos
    if sliding_window is not None:
        left, right = (
            (sliding_window, sliding_window) if isinstance(sliding_window, int) else sliding_window
        )
        visible &= (key_pos >= query_pos - left) & (key_pos <= query_pos + right)
    return visible


def ragged_page_attention_reference(
    queries: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: Any,
    *,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    softmax_aux: jax.Array | None = None,
) -> jax.Array:
    """Plain-JAX oracle: gather each sequence's pages, then one masked softmax per token."""
    return packed_paged_reference(
        queries,
        key_cache,
        value_cache,
        kv_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        causal=True,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
        softmax_aux=softmax_aux,
    )


def packed_paged_reference(
    queries: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start_loc: jax.Array,
    num_seqs: Any,
    *,
    causal: bool,
    softmax_scale: float | None,
    logits_soft_cap: float | None,
    sliding_window: Any,
    softmax_aux: jax.Array | None,
    alibi_slopes: jax.Array | None = None,
) -> jax.Array:
    """The reference of every packed paged op (ragged, v3, unified)."""
    t = queries.shape[0]
    if softmax_scale is None:
        softmax_scale = queries.shape[-1] ** -0.5
    capacity = block_tables.shape[1] * key_cache.shape[1]
    keys = gather_sequence_pages(key_cache, block_tables)  # [S, capacity, Hkv, D]
    values = gather_sequence_pages(value_cache, block_tables)
    seq, q_pos, live = ragged_tokens(query_start_loc, kv_lens, num_seqs, t)
    k_pos = jnp.arange(capacity)[None, :]
    kv_len = kv_lens.astype(jnp.int32)[seq][:, None]
    visible = (
        live[:, None]
        & (k_pos < kv_len)
        & window_mask(k_pos, q_pos[:, None], causal=causal, sliding_window=sliding_window)
    )
    bias = None
    if alibi_slopes is not None:
        distance = (k_pos - q_pos[:, None]).astype(jnp.float32)  # [T, capacity]
        bias = alibi_slopes.astype(jnp.float32)[None, :, None] * distance[:, None, :]
    return attend_rows(
        queries,
        keys[seq],
        values[seq],
        visible,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        bias=bias,
        softmax_aux=softmax_aux,
    )


# --------------------------------------------------------------------------------------------
# Synthetic inputs for autotuning
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


def synthetic_paged_batch(
    rng: np.random.Generator,
    *,
    num_seqs: int,
    num_tokens: int,
    num_pages: int,
    page_size: int,
    max_pages: int,
) -> dict[str, np.ndarray]:
    """A valid packed batch: ``kv_lens``, ``block_tables``, ``query_start_loc`` (int32).

    Query lengths split ``num_tokens`` among the sequences (as far as their capacity allows);
    each sequence holds at least its queries; pages come from :func:`paged_block_tables`.
    """
    capacity = max_pages * page_size
    q_lens = np.zeros(num_seqs, np.int64)
    left = min(num_tokens, num_seqs * capacity)
    weights = rng.random(num_seqs) + 0.1
    for s in range(num_seqs):
        share = left if s == num_seqs - 1 else round(left * weights[s] / weights[s:].sum())
        q_lens[s] = min(capacity, share)
        left -= q_lens[s]
    kv_lens = np.array([rng.integers(q, capacity + 1) for q in q_lens], np.int64)
    tables = paged_block_tables(
        rng, kv_lens, num_pages=num_pages, page_size=page_size, max_pages=max_pages
    )
    return {
        "kv_lens": kv_lens.astype(np.int32),
        "block_tables": tables,
        "query_start_loc": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
    }


def synthetic_packed_inputs(abstract: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Valid inputs of a packed paged op (lengths, tables, offsets) from abstract shapes."""
    out = default_synthetic(abstract, seed)
    rng = np.random.default_rng(seed)
    num_pages, page_size = abstract["key_cache"].shape[:2]
    s, max_pages = abstract["block_tables"].shape
    batch = synthetic_paged_batch(
        rng,
        num_seqs=s,
        num_tokens=abstract["queries"].shape[0],
        num_pages=num_pages,
        page_size=page_size,
        max_pages=max_pages,
    )
    # NumPy, not jnp: tuning starts while a trace is active, where jnp operations are staged.
    for name, value in batch.items():
        out[name] = value.astype(abstract[name].dtype)
    if "num_seqs" in abstract:
        num_seqs = abstract["num_seqs"]
        out["num_seqs"] = np.full(num_seqs.shape, s, num_seqs.dtype)
    return out


SPEC = OpSpec(
    name=OP,
    args=(
        Arg(name="queries", array=True, required=True),
        Arg(name="key_cache", array=True, required=True),
        Arg(name="value_cache", array=True, required=True),
        Arg(name="kv_lens", array=True, required=True),
        Arg(name="block_tables", array=True, required=True),
        Arg(name="query_start_loc", array=True, required=True),
        Arg(name="num_seqs", array=True, required=True),
        Arg(name="softmax_scale", array=False),
        Arg(name="logits_soft_cap", array=False),
        Arg(name="sliding_window", array=False),
        Arg(name="softmax_aux", array=True),
    ),
    validate=validate_ragged_page_attention,
    reference=ragged_page_attention_reference,
    differentiable=False,
    synthetic=synthetic_packed_inputs,
    examples="ejkernel.testing.cases.ragged_page_attention:examples",
)


def ragged_page_attention(
    queries: jax.Array,
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
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    """Mixed prefill and decode attention over a paged KV cache (forward only).

    Args:
        queries: [T, Hq, D], the packed queries of every sequence.
        key_cache: [num_pages, page_size, Hkv, D], Hq % Hkv == 0 (GQA/MQA).
        value_cache: [num_pages, page_size, Hkv, D].
        kv_lens: [num_seqs] int32, tokens in the cache per sequence (its queries included).
        block_tables: [num_seqs, max_pages] int32, page ids of each sequence in order; slots
            past ``ceil(kv_len / page_size)`` are never read and may hold any value.
        query_start_loc: [num_seqs + 1] int32, offsets of each sequence's queries in
            ``queries``; its ``q_len`` queries are the sequence's last tokens (causal).
        num_seqs: live sequences (the first ``num_seqs``): a Python int in
            ``[0, kv_lens.shape[0]]``, or an integer array of shape () or (1,), which may be
            traced (one compiled kernel for every batch size).
        softmax_scale: multiplies the logits; default D ** -0.5.
        logits_soft_cap: logits become ``cap * tanh(logits / cap)`` before masking.
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``; with causality a query at
            position p sees keys in ``[p - left, p]``.
        softmax_aux: [Hq] or [Hq, n] attention-sink logits (denominator only).
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only).

    Returns:
        [T, Hq, D] in the query dtype; tokens of no live sequence and rows that see no key
        are zeros.
    """
    return call_op(SPEC, locals())
