"""Attention semantics, written once: what every attention implementation computes.

Every platform (the references, XLA, Pallas, Triton, CUDA) follows this page; kernels that
must restate a rule in their own language (Triton) keep these names and a property test
(``tests/core/test_attention_semantics.py``) holds them together. OPS.md letters throughout.

**Positions.** Query ``i`` (of ``Sq``) sits at key position ``p = i + offset`` with
``offset = Sk - Sq``: bottom-right alignment, so the last query sees the last key and a
decode step (``Sq = 1``) sees the whole cache. Key ``j`` sits at position ``j``.

**Visibility.** Query ``i`` may see key ``j`` when every given term holds (:func:`visible`):

- ``causal``: ``j <= p``;
- ``window=(left, right)``: ``p - left <= j <= p + right`` (intersected with ``causal``);
- segment ids: ``q_segment_ids[i] == kv_segment_ids[j]`` and ``q_segment_ids[i] >= 0`` (a
  negative id is padding and sees nothing);
- ``kv_valid``: the key exists (a padded block's tail, a paged cache beyond ``kv_len``);
- ``attention_mask``: True = may attend, broadcast to ``[B, Hq, Sq, Sk]``.

**Logits.** ``s = softmax_scale · q·kᵀ``, then :func:`soft_cap` (``cap · tanh(s / cap)``),
then ``+ bias``, then :func:`mask_scores`: a hidden score becomes :data:`MASK_VALUE` by a
select (never an additive mask, which would turn ``NaN + MASK_VALUE`` into NaN). The finite
mask value keeps ``hidden - row_max`` free of ``inf - inf`` in online softmaxes.

**Softmax.** Over the visible keys of a row, plus the attention sinks ``softmax_aux``
(``[Hq]`` or ``[Hq, n]``) which join the maximum and the denominator only. Probabilities of
hidden keys are exact zeros (:func:`hide`, a select). A row with no visible key returns
zeros and has zero gradient (also with sinks); a blockwise kernel saves
:data:`EMPTY_ROW_LSE` as its logsumexp, so ``exp(s - lse)`` is 0 in the backward.

**Hidden positions contribute nothing, whatever they hold.** A key or value the mask hides
from a row never changes that row's output or gradients, even when it holds NaN or Inf (a
stale cache slot, uninitialised padding). ``0 · NaN = NaN``, so selecting the scores is not
enough: every product of probabilities (or score gradients) with keys or values —
``P·V`` in the forward, ``dO·Vᵀ`` and ``dS·K`` in the backward — must not read a non-finite
entry into a row that cannot see it. The references and the XLA implementations read keys
and values through :func:`finite_or_zero` wherever they multiply probabilities, which is exact
and costs one elementwise pass over K and V; the Triton and Pallas kernels clean the tiles
of the blocks the mask cuts (every block under an attention mask or segment ids) the same
way and leave fully visible blocks as they are. What a row computes from a non-finite key or
value it *can* see is unspecified (the references and XLA read it as 0; a kernel may give
NaN): it is a bad input, not a masking question.

**Gradients.** With ``D = rowsum(dO ∘ O)`` and ``dS = P ∘ (dP - D)`` (FlashAttention-2,
Sec. 3.1.2): the soft cap's derivative is :func:`soft_cap_grad`, ``1 - (capped / cap)²``
taken from the capped logit; the bias gradient is ``dS`` summed over the axes the bias
broadcasts along (:func:`bias_grad`); the sink gradient is ``-Σ_{b,q} D · p_sink``
(:func:`sink_grad`).

**Blocks.** :class:`Geometry` holds one call's sizes as Python ints and answers the
questions a blockwise kernel asks: may query block ``i`` see any key of key block ``j``
(:meth:`Geometry.block_may_see`), are all its pairs visible
(:meth:`Geometry.block_fully_visible`), which keys can a query block see
(:meth:`Geometry.kv_range`). Arguments may be Python ints (answers are Python values) or
traced scalars (answers are JAX scalars), so one record serves XLA loops and Pallas grids.
:meth:`Geometry.tiling` cuts the sequences into ``bq``-row query and ``bk``-row key blocks: a
:class:`Tiling` says how many (``nq = ceil(Sq / bq)``, ``nk = ceil(Sk / bk)``) and the lengths
padded to whole blocks (``sq_pad = nq · bq``, ``sk_pad = nk · bk``); a padded key is one that
does not exist (``kv_valid``).

**Scaled caches.** The serving ops take ``k_scale``/``v_scale`` (a float, or float32
``[Hkv]``): their key and value caches, ``float8_e4m3fn`` or any floating dtype, are read as
``cache.astype(float32) · scale`` (per KV head, the cache's axis ``-2``, when ``[Hkv]``;
:func:`dequantize_kv`), and the new keys and values ``ragged_page_attention_v3`` writes are
stored as ``x / scale`` rounded to nearest (ties to even) and saturated at the cache dtype's
largest finite magnitude, ±448 for ``float8_e4m3fn`` (:func:`quantize_kv`; NaN stays NaN).
A kernel dequantises the tiles it reads, so the cache is read in its own (narrow) dtype.

Dropout is defined beside this, in :func:`ejkernel.specs.flash_attention.dropout_keep`.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "EMPTY_ROW_LSE",
    "MASK_VALUE",
    "Geometry",
    "Tiling",
    "bias_grad",
    "dense_visibility",
    "dequantize_kv",
    "finite_or_zero",
    "hide",
    "mask_scores",
    "masked_softmax",
    "quantize_kv",
    "sink_grad",
    "sink_probabilities",
    "soft_cap",
    "soft_cap_grad",
    "visible",
]

#: Score of a hidden entry: the most negative finite float32, so ``hidden - row_max`` is never
#: ``inf - inf`` and a row that has seen nothing yet keeps ``MASK_VALUE`` as its maximum.
MASK_VALUE: float = float(np.finfo(np.float32).min)
#: Logsumexp saved for a row with no visible key: ``exp(anything - EMPTY_ROW_LSE)`` is 0.
EMPTY_ROW_LSE: float = float(np.finfo(np.float32).max)


def _and(terms: list[Any]) -> Any:
    """Conjunction of bools or arrays; Python ``bool`` when every term is one."""
    if all(isinstance(t, (bool, np.bool_)) for t in terms):
        return bool(all(terms))
    return functools.reduce(jnp.logical_and, [jnp.asarray(t) for t in terms])


def _max(a: Any, b: Any) -> Any:
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _min(a: Any, b: Any) -> Any:
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def visible(
    q_pos: Any,
    k_pos: Any,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
    kv_valid: Any = None,
    attention_mask: Any = None,
) -> jax.Array:
    """Whether a query at key position ``q_pos`` may see the key at position ``k_pos``.

    Every argument broadcasts (plain ``jnp``), so this runs in plain JAX and inside Pallas
    kernels; pass ``q_pos`` as ``[..., bq, 1]`` and ``k_pos`` as ``[..., 1, bk]`` for a tile.

    Args:
        q_pos: query positions in key coordinates (query index + ``Sk - Sq``).
        k_pos: key positions.
        causal: keys at positions ``<= q_pos`` only.
        window: ``(left, right)``: keys in ``[q_pos - left, q_pos + right]``.
        q_segment_ids: the queries' segment ids (broadcasting like ``q_pos``); a negative id
            sees nothing.
        kv_segment_ids: the keys' segment ids (broadcasting like ``k_pos``).
        kv_valid: bool, whether the key exists (padding and stale cache slots are False).
        attention_mask: bool, True = may attend.

    Returns:
        A bool array of the broadcast shape (all True when no term is given).
    """
    terms: list[Any] = []
    if causal:
        terms.append(k_pos <= q_pos)
    if window is not None:
        left, right = window
        terms.append((k_pos >= q_pos - left) & (k_pos <= q_pos + right))
    if q_segment_ids is not None and kv_segment_ids is not None:
        terms.append((q_segment_ids == kv_segment_ids) & (q_segment_ids >= 0))
    if kv_valid is not None:
        terms.append(kv_valid)
    if attention_mask is not None:
        terms.append(attention_mask)
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in (q_pos, k_pos, *terms)))
    if not terms:
        return jnp.ones(shape, bool)
    return jnp.broadcast_to(functools.reduce(jnp.logical_and, terms), shape)


@attrs.frozen(kw_only=True)
class Tiling:
    """Query and key sequences cut into blocks, the last of each padded to a whole block.

    Attributes:
        sq: query length Sq.
        sk: key length Sk.
        bq: rows of a query block.
        bk: rows of a key block.
    """

    sq: int
    sk: int
    bq: int
    bk: int

    @property
    def nq(self) -> int:
        """Query blocks, ``ceil(Sq / bq)``."""
        return -(-self.sq // self.bq)

    @property
    def nk(self) -> int:
        """Key blocks, ``ceil(Sk / bk)``."""
        return -(-self.sk // self.bk)

    @property
    def sq_pad(self) -> int:
        """Query length padded to whole blocks, ``nq · bq``."""
        return self.nq * self.bq

    @property
    def sk_pad(self) -> int:
        """Key length padded to whole blocks, ``nk · bk``."""
        return self.nk * self.bk


@attrs.frozen(kw_only=True)
class Geometry:
    """The masking geometry of one attention call (Python ints, hashable: a static arg).

    Attributes:
        batch: B.
        sq: query length Sq.
        sk: key length Sk.
        num_q_heads: Hq.
        num_kv_heads: Hkv (divides Hq; query head h reads key head ``h // group``).
        causal: bottom-right aligned causal mask.
        window: ``(left, right)`` sliding window, or ``None``.
    """

    batch: int
    sq: int
    sk: int
    num_q_heads: int
    num_kv_heads: int
    causal: bool = False
    window: tuple[int, int] | None = attrs.field(
        default=None, converter=lambda w: None if w is None else (int(w[0]), int(w[1]))
    )

    @classmethod
    def of(
        cls,
        query: Any,
        key: Any,
        *,
        causal: bool = False,
        window: tuple[int, int] | None = None,
    ) -> Geometry:
        """The geometry of ``query [B, Sq, Hq, D]`` against ``key [B, Sk, Hkv, D]``."""
        b, sq, hq = (int(n) for n in query.shape[:3])
        sk, hkv = int(key.shape[1]), int(key.shape[2])
        return cls(
            batch=b,
            sq=sq,
            sk=sk,
            num_q_heads=hq,
            num_kv_heads=hkv,
            causal=bool(causal),
            window=window,
        )

    @property
    def group(self) -> int:
        """Query heads per key head, ``Hq // Hkv`` (GQA/MQA)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def offset(self) -> int:
        """Key position of query 0: ``Sk - Sq`` (bottom-right alignment)."""
        return self.sk - self.sq

    @property
    def restricted(self) -> bool:
        """Whether causality or the window hide anything (else every block may see)."""
        return self.causal or self.window is not None

    @property
    def right(self) -> int | None:
        """Largest ``k - p`` a query may see (``None``: unbounded)."""
        if self.causal and self.window is not None:
            return min(self.window[1], 0)
        if self.causal:
            return 0
        return self.window[1] if self.window is not None else None

    @property
    def left(self) -> int | None:
        """Largest ``p - k`` a query may see (``None``: unbounded)."""
        return self.window[0] if self.window is not None else None

    def tiling(self, bq: int, bk: int) -> Tiling:
        """This call's sequences cut into ``bq``-row query and ``bk``-row key blocks."""
        return Tiling(sq=self.sq, sk=self.sk, bq=bq, bk=bk)

    def q_position(self, i: Any) -> Any:
        """Key position of query index ``i``."""
        return i + self.offset

    def visible(self, q_index: Any, k_index: Any, **terms: Any) -> jax.Array:
        """:func:`visible` with this geometry's causality and window, from query indices."""
        return visible(
            self.q_position(q_index), k_index, causal=self.causal, window=self.window, **terms
        )

    def block_may_see(self, i: Any, j: Any, bq: int, bk: int) -> Any:
        """Whether causality and the window leave query block ``i`` (rows ``[i·bq, i·bq+bq)``)
        any visible key in key block ``j`` (keys ``[j·bk, j·bk+bk)``).

        Decided from block indices only (segments and masks are not consulted), so it stays a
        scalar branch condition under ``vmap``. A Python ``bool`` for Python indices.
        """
        return self.span_may_see(i * bq, bq, j * bk, bk)

    def span_may_see(self, q_start: Any, q_len: int, k_start: Any, k_len: int) -> Any:
        """:meth:`block_may_see` for query indices ``[q_start, q_start + q_len)`` and keys
        ``[k_start, k_start + k_len)`` that need not be block-aligned (a ring's shard)."""
        q_lo = self.q_position(q_start)
        q_hi = q_lo + q_len - 1
        k_lo = k_start
        k_hi = k_lo + k_len - 1
        conds: list[Any] = []
        if self.right is not None:
            conds.append(k_lo <= q_hi + self.right)
        if self.left is not None:
            conds.append(k_hi >= q_lo - self.left)
        return _and(conds) if conds else True

    def block_fully_visible(self, i: Any, j: Any, bq: int, bk: int) -> Any:
        """Whether every key of key block ``j`` exists and causality and the window let every
        query of block ``i`` see it (a kernel may then skip the positional mask)."""
        q_lo = self.q_position(i * bq)
        q_hi = q_lo + bq - 1
        k_lo = j * bk
        k_hi = k_lo + bk - 1
        conds: list[Any] = [k_hi <= self.sk - 1]
        if self.right is not None:
            conds.append(k_hi <= q_lo + self.right)
        if self.left is not None:
            conds.append(k_lo >= q_hi - self.left)
        return _and(conds)

    def kv_range(self, i: Any, bq: int) -> tuple[Any, Any]:
        """Key positions ``[lo, hi)`` query block ``i`` may see, within ``[0, Sk]``.

        ``lo >= hi`` means the block sees no key. Python ints for a Python ``i``.
        """
        q_lo = self.q_position(i * bq)
        q_hi = q_lo + bq - 1
        lo = 0 if self.left is None else _min(_max(q_lo - self.left, 0), self.sk)
        hi = self.sk if self.right is None else _max(_min(q_hi + self.right + 1, self.sk), 0)
        return lo, hi

    def kv_blocks(self, i: Any, bq: int, bk: int) -> tuple[Any, Any]:
        """Key blocks ``[first, last)`` of size ``bk`` query block ``i`` may see."""
        lo, hi = self.kv_range(i, bq)
        return lo // bk, -(-hi // bk)

    def q_range(self, j: Any, bk: int) -> tuple[Any, Any]:
        """Query indices ``[lo, hi)`` that may see some key of key block ``j``, within
        ``[0, Sq]`` (the reverse of :meth:`kv_range`, for loops over key blocks).

        ``lo >= hi`` means no query sees the block. Python ints for a Python ``j``.
        """
        k_lo = j * bk
        k_hi = k_lo + bk - 1
        lo = 0 if self.right is None else _min(_max(k_lo - self.right - self.offset, 0), self.sq)
        hi = (
            self.sq
            if self.left is None
            else _max(_min(k_hi + self.left - self.offset + 1, self.sq), 0)
        )
        return lo, hi

    def q_blocks(self, j: Any, bq: int, bk: int) -> tuple[Any, Any]:
        """Query blocks ``[first, last)`` of size ``bq`` that may see key block ``j``."""
        lo, hi = self.q_range(j, bk)
        return lo // bq, -(-hi // bq)


def dense_visibility(
    geometry: Geometry,
    attention_mask: Any = None,
    q_segment_ids: Any = None,
    kv_segment_ids: Any = None,
) -> jax.Array:
    """The visibility ``[B, Hq, Sq, Sk]`` (True = may attend) of every masking argument.

    Args:
        geometry: sizes, causality and window.
        attention_mask: bool, broadcastable to [B, Hq, Sq, Sk].
        q_segment_ids: [B, Sq] int (with ``kv_segment_ids``).
        kv_segment_ids: [B, Sk] int.
    """
    g = geometry
    segments: dict[str, Any] = {}
    if q_segment_ids is not None and kv_segment_ids is not None:
        segments = {
            "q_segment_ids": q_segment_ids[:, None, :, None],
            "kv_segment_ids": kv_segment_ids[:, None, None, :],
        }
    mask = None
    if attention_mask is not None:
        mask = attention_mask.reshape((1,) * (4 - attention_mask.ndim) + attention_mask.shape)
    vis = g.visible(
        jnp.arange(g.sq)[:, None], jnp.arange(g.sk)[None, :], attention_mask=mask, **segments
    )
    return jnp.broadcast_to(vis, (g.batch, g.num_q_heads, g.sq, g.sk))


def mask_scores(scores: jax.Array, vis: Any) -> jax.Array:
    """``where(vis, scores, MASK_VALUE)``: a select, so a NaN or Inf score it hides is gone."""
    return jnp.where(vis, scores, MASK_VALUE)


def hide(p: jax.Array, vis: Any) -> jax.Array:
    """``where(vis, p, 0)``: hidden probabilities (or score gradients) as exact zeros."""
    return jnp.where(vis, p, jnp.zeros((), p.dtype))


def masked_softmax(logits: jax.Array, vis: Any) -> jax.Array:
    """Softmax along the last axis over the visible entries (:func:`mask_scores`, then
    :func:`hide`): hidden entries get exactly 0 and a row that sees nothing gives zeros."""
    logits = mask_scores(logits, vis)
    p = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
    p = hide(p, vis)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(denom == 0.0, 1.0, denom)


def finite_or_zero(x: jax.Array) -> jax.Array:
    """``x`` with NaN and ±Inf entries read as 0: how keys and values enter the products of
    probabilities, so ``0 · NaN`` never reaches a row that cannot see the entry."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def _per_head(scale: Any) -> jax.Array:
    """A cache scale as float32, shaped to broadcast against ``[..., Hkv, D]``."""
    scale = jnp.asarray(scale, jnp.float32)
    return scale[:, None] if scale.ndim == 1 else scale


def dequantize_kv(cache: jax.Array, scale: Any) -> jax.Array:
    """How a serving op reads a key or value cache: ``cache.astype(float32) · scale``.

    Args:
        cache: ``[..., Hkv, D]`` (a paged cache, a dense one, or a gathered tile), in
            ``float8_e4m3fn`` or any floating dtype.
        scale: ``None`` (the cache is read as it is), a float or float32 scalar (per tensor),
            or float32 ``[Hkv]`` (per KV head).
    """
    if scale is None:
        return cache
    return cache.astype(jnp.float32) * _per_head(scale)


def quantize_kv(x: jax.Array, scale: Any, dtype: Any) -> jax.Array:
    """How new keys or values ``x [..., Hkv, D]`` are stored in a cache of ``dtype`` read with
    ``scale`` (:func:`dequantize_kv`'s inverse up to rounding): ``x / scale`` in float32,
    saturated at ``dtype``'s largest finite magnitude (±448 for ``float8_e4m3fn``; an Inf
    saturates too), then rounded to nearest, ties to even. NaN stays NaN. Without a scale,
    ``x`` is cast to ``dtype``."""
    if scale is None:
        return x.astype(dtype)
    largest = float(jnp.finfo(dtype).max)
    y = x.astype(jnp.float32) / _per_head(scale)
    return jnp.clip(y, -largest, largest).astype(dtype)


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """``cap · tanh(logits / cap)``; ``logits`` unchanged when ``cap`` is ``None``."""
    if cap is None:
        return logits
    return cap * jnp.tanh(logits * (1.0 / cap))


def soft_cap_grad(capped: jax.Array, cap: float | None) -> Any:
    """d soft_cap / d logits from the capped value: ``1 - (capped / cap)²`` (1 without a cap)."""
    if cap is None:
        return 1.0
    t = capped * (1.0 / cap)
    return 1.0 - t * t


def sink_probabilities(softmax_aux: jax.Array, logsumexp: jax.Array) -> jax.Array:
    """Per-row probabilities of the sinks, ``exp(aux - lse)``, ``[B, Sq, Hq, n]`` float32.

    Args:
        softmax_aux: [Hq] or [Hq, n] sink logits.
        logsumexp: [B, Sq, Hq] per-row logsumexp (sinks included; ``EMPTY_ROW_LSE`` for a row
            with no visible key, whose sink probabilities are then 0).
    """
    hq = logsumexp.shape[-1]
    aux = softmax_aux.astype(jnp.float32).reshape(hq, -1)
    return jnp.exp(aux - logsumexp.astype(jnp.float32)[..., None])


def sink_grad(softmax_aux: jax.Array, logsumexp: jax.Array, delta: jax.Array) -> jax.Array:
    """Gradient of the sinks: ``-Σ_{b,q} D[b, q, h] · p_sink[b, q, h, n]``.

    Args:
        softmax_aux: [Hq] or [Hq, n].
        logsumexp: [B, Sq, Hq] (as :func:`sink_probabilities`).
        delta: [B, Sq, Hq], ``D = rowsum(dO ∘ O)``.

    Returns:
        The gradient in ``softmax_aux``'s shape and dtype.
    """
    p = sink_probabilities(softmax_aux, logsumexp)
    d_aux = -jnp.einsum("bqh,bqhn->hn", delta.astype(jnp.float32), p)
    return d_aux.reshape(softmax_aux.shape).astype(softmax_aux.dtype)


def bias_grad(ds: jax.Array, shape: tuple[int, ...], dtype: Any = None) -> jax.Array:
    """The bias gradient: ``dS`` summed over the axes a bias of ``shape`` broadcasts along.

    Args:
        ds: the score gradient, [B, Hq, Sq, Sk] (or any shape ``shape`` broadcasts to).
        shape: the bias's own shape (right-aligned broadcasting).
        dtype: the result's dtype (default: ``ds``'s).
    """
    lead = ds.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + a for a, n in enumerate(shape) if n == 1 and ds.shape[lead + a] != 1
    )
    out = jnp.sum(ds, axis=axes, keepdims=True) if axes else ds
    return out.reshape(shape).astype(ds.dtype if dtype is None else dtype)
