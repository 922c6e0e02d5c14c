"""flash_attention (and scaled_dot_product_attention) on XLA: blockwise FlashAttention-2.

Pure JAX, O(S) memory in the forward and the backward, with a hand-written backward attached
through :func:`ejkernel.plugins.defvjp`. The algorithm is FlashAttention-2 (Dao, 2023):

- Blocking. Queries are cut into blocks of ``q_blocksize`` rows and keys/values into blocks of
  ``kv_blocksize`` rows; a sequence longer than its block is padded to a block multiple (padded
  keys are masked out, padded query rows are computed and dropped). Heads are laid out as
  ``[B, Hkv, G, S, D]`` with ``G = Hq // Hkv``, so grouped queries (GQA/MQA) share one key
  block in a single batched matmul and ``dK``/``dV`` sum over the group for free.
- Forward (Alg. 1, with the online softmax of Sec. 3.1.1). A map over query blocks, inside a
  scan over key blocks carrying the running row maximum ``m``, denominator ``denom`` and
  accumulator ``acc`` in float32; both are rescaled by ``exp(m_old - m_new)`` when the maximum
  grows, and the division by ``denom`` happens once at the end. Sinks (``softmax_aux``) join the
  maximum and the denominator at the end of the scan. Dropout drops entries of the
  unnormalised block probabilities before they multiply V (the same entries as the reference,
  from :func:`ejkernel.specs.flash_attention.dropout_keep` evaluated with global indices) and
  the kept ones are scaled by ``1 / (1 - dropout_prob)``. The per-row logsumexp is saved.
- Backward (Alg. 2). A scan over key blocks, inside a scan over query blocks, recomputing
  ``P = exp(S - logsumexp)`` per block: ``dV += Pᵀ dO``, ``dP = dO Vᵀ``,
  ``dS = P ∘ (dP - D)`` with ``D = rowsum(dO ∘ O)``, ``dQ += dS K``, ``dK += dSᵀ Q``. ``dK``
  and ``dV`` of a key block live in the inner carry; the ``dQ`` contributions are stacked and
  summed over key blocks. The bias gradient is ``dS`` summed into the bias's own broadcast
  shape; the sink gradient is ``-Σ p_aux · D`` over batch and rows.
- Masking is :mod:`ejkernel.attention_semantics` laid out per block from global positions
  (causal bottom-right aligned: query i sits at ``Sk - Sq + i``; sliding window;
  ``attention_mask`` and ``bias`` broadcast and sliced per block; segment ids equal and
  non-negative) with the finite ``MASK_VALUE`` selected in, so a row with no visible key never
  produces NaN: it is detected from its running maximum and returns zeros with zero
  gradients. Keys and values are read through ``finite_or_zero``, so a hidden NaN or Inf
  contributes nothing. Blocks that causality or the sliding window hide entirely are skipped
  (``Geometry.block_may_see``: a ``lax.cond`` on block indices only, which stays a branch
  under ``vmap``). The engine's pieces live in :mod:`ejkernel_xla.ops._blockwise`, shared with
  ring attention, MLA and block-sparse attention.

Accumulation is float32; matmul inputs keep the input dtype. It declines nothing (no ``supports``):
this backend serves every valid call of both ops, on every backend.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.attention_semantics import (
    bias_grad,
    finite_or_zero,
    sink_grad,
)
from ejkernel.plugins import deflse, defvjp
from ejkernel.specs.flash_attention import SPEC, dropout_keep
from ejkernel_xla.ops._adapter import (
    BlockConfig,
    Blocked,
    Passes,
    clamp_blocks,
    pass_blocks,
)
from ejkernel_xla.ops._blockwise import (
    BackwardRows,
    Blocking,
    SideInputs,
    as_4d,
    backend,
    block_gradients,
    block_scores,
    block_visibility,
    dot,
    finish_rows,
    initial_rows,
    kv_blocks,
    map_blocks,
    online_step,
    pad_axis,
    q_blocks,
    scan,
    take,
    tile_may_see,
    unblock_kv,
    unblock_q,
    when,
    when_else,
)
from ejkernel_xla.ops._tuning import distinct

__all__ = [
    "FlashAttentionConfig",
    "config_space",
    "flash_attention_xla",
    "heuristic",
    "scaled_dot_product_attention_xla",
]

#: Default ((fwd q, fwd kv), (bwd q, bwd kv)) block sizes per backend, before the tile budget.
#: On CPU the best blocks are narrow in queries and wide in keys: a [128..256, 1024] float32
#: tile per head stays in cache while loop steps stay few (measured at (1, 1024, 8, 64) and
#: (1, 4096, 8, 64)). On GPU each loop step is a handful of kernel launches, so the largest
#: blocks win (measured on an H100 from (1, 1024, 8, 64) to (1, 32768, 8, 128): 2048 x 2048
#: ran 7x to 30x faster than 128 x 128); TPU is assumed to behave alike (not measured).
_DEFAULT_BLOCKS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "cpu": ((256, 1024), (128, 1024)),
    "gpu": ((2048, 2048), (2048, 2048)),
    "tpu": ((1024, 1024), (1024, 1024)),
}
#: Most float32 elements of one [B, Hq, bq, bk] tile per backend: default blocks are halved
#: (the longer one first, queries on a tie) until a tile fits, so large batches and head
#: counts stay within memory.
_TILE_BUDGET: dict[str, int] = {"cpu": 2**26, "gpu": 2**28, "tpu": 2**27}
#: Smallest block the budget shrinks a default to.
_MIN_BLOCK = 128
#: (q_blocksize, kv_blocksize) pairs :func:`config_space` offers per backend.
_TUNING_BLOCKS: dict[str, tuple[tuple[int, int], ...]] = {
    "cpu": ((128, 1024), (256, 1024), (128, 512), (256, 256), (512, 512), (128, 2048)),
    "gpu": ((512, 1024), (1024, 1024), (1024, 2048), (2048, 2048), (512, 2048)),
    "tpu": ((256, 512), (512, 512), (512, 1024), (1024, 1024), (1024, 2048)),
}


@attrs.frozen(kw_only=True)
class FlashAttentionConfig(BlockConfig):
    """Tunables of the XLA flash attention (also used by scaled_dot_product_attention): the
    block sizes of :class:`~ejkernel_xla.ops._adapter.BlockConfig`.

    Only ``q_blocksize`` and ``kv_blocksize`` matter here; ``None`` takes the backend's
    default. Blocks longer than the sequence are clamped to it.
    """


def heuristic(inv: Any) -> FlashAttentionConfig:
    """The backend's default block sizes, clamped to the sequence lengths of ``inv``."""
    b, hq, sq, sk = _problem_size(inv)
    fwd, bwd = (_default_blocks(b, hq, sq, sk, backward=p) for p in (False, True))
    return FlashAttentionConfig.of(fwd, bwd)


def config_space(inv: Any) -> list[FlashAttentionConfig]:
    """The heuristic's config, then a handful of block pairs, none longer than the sequence.

    Each pair serves both passes; pairs that clamp to the same blocks appear once, so a short
    sequence has a single candidate.
    """
    _, _, sq, sk = _problem_size(inv)
    pairs = (clamp_blocks(pair, sq, sk) for pair in _TUNING_BLOCKS[backend()])
    return distinct([heuristic(inv), *(FlashAttentionConfig.of(pair) for pair in pairs)])


def flash_attention_xla(*, cfg: FlashAttentionConfig | None = None, **args: Any) -> jax.Array:
    """Exact attention, blockwise, O(S) memory.

    Args:
        cfg: block sizes; ``None`` takes the defaults.
        **args: :func:`ejkernel.flash_attention`'s arguments by name, as its spec validated
            them (absent ones take their defaults).

    Returns:
        [B, Sq, Hq, Dv] in the query dtype; rows with no visible key are zeros.
    """
    return _PASSES.primal(args, cfg)


def scaled_dot_product_attention_xla(
    *, cfg: FlashAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """Scaled dot-product attention: :func:`flash_attention_xla` without dropout and sinks.

    Args: as :func:`flash_attention_xla`, with :func:`ejkernel.scaled_dot_product_attention`'s
    arguments.

    Returns:
        [B, Sq, Hq, Dv] in the query dtype; rows with no visible key are zeros.
    """
    return _PASSES.primal(args, cfg)


def _scaled_dot_product_attention_bwd(
    residuals: dict[str, jax.Array | None], d_out: jax.Array, **static: Any
) -> dict[str, jax.Array | None]:
    """Flash attention's gradients of q, k, v and bias (the op has no sinks)."""
    grads = _PASSES.bwd(residuals, d_out, **static)
    grads.pop("softmax_aux")
    return grads


# --------------------------------------------------------------------------------------------
# Configuration helpers
# --------------------------------------------------------------------------------------------


def _problem_size(inv: Any) -> tuple[int, int, int, int]:
    """``(B, Hq, Sq, Sk)`` of an invocation (shapes only: arrays may be tracers)."""
    b, sq, hq, _ = inv.kwargs["query"].shape
    return int(b), int(hq), int(sq), int(inv.kwargs["key"].shape[1])


def _default_blocks(b: int, hq: int, sq: int, sk: int, *, backward: bool) -> tuple[int, int]:
    """The backend's default blocks, halved until a [B, Hq, bq, bk] tile fits the budget.

    Then balanced: a sequence just past a block multiple is split into as many blocks of
    equal size (a multiple of 8) instead of a full block of padding (129 rows: 2 x 72, not
    2 x 128).
    """
    family = backend()
    bq, bk = clamp_blocks(_DEFAULT_BLOCKS[family][1 if backward else 0], sq, sk)
    while b * hq * bq * bk > _TILE_BUDGET[family] and max(bq, bk) > _MIN_BLOCK:
        if bq >= bk and bq > _MIN_BLOCK:
            bq //= 2
        else:
            bk //= 2
    return _balanced(bq, sq), _balanced(bk, sk)


def _balanced(block: int, seq: int) -> int:
    if block >= seq:
        return seq
    per_block = -(-seq // -(-seq // block))
    return min(block, -(-per_block // 8) * 8)


def _statics(
    arrays: dict[str, Any], cfg: FlashAttentionConfig | None, backward: bool, static: Any
) -> Blocked:
    b, sq, hq, _ = arrays["query"].shape
    sk = arrays["key"].shape[1]
    default = _default_blocks(b, hq, sq, sk, backward=backward)
    blocks = pass_blocks(cfg or FlashAttentionConfig(), backward, default, sq, sk)
    return Blocked.of(arrays["query"], static, **blocks)


# --------------------------------------------------------------------------------------------
# Forward and backward passes
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="st")
def _forward(a: dict[str, Any], st: Blocked) -> tuple[jax.Array, dict[str, jax.Array]]:
    """FlashAttention-2 Alg. 1: ``out [B, Sq, Hq, Dv]``, and it with the logsumexp
    ``[B, Sq, Hq]`` (float32) for the backward."""
    q, k, v = a["query"], finite_or_zero(a["key"]), finite_or_zero(a["value"])
    geo = Blocking.of(q, k, v, st.block_q, st.block_k)
    side = SideInputs.of(a, geo, _pair_blocks)
    qb = q_blocks(q, geo)
    kb, vb = kv_blocks(k, geo), kv_blocks(v, geo)
    aux = _sinks(a["softmax_aux"], geo)

    def one_q_block(i: Any) -> tuple[jax.Array, jax.Array]:
        q_i = take(qb, i)
        init = initial_rows((geo.b, geo.hkv, geo.group, geo.bq), geo.dv)

        def one_kv_block(carry: Any, j: Any) -> tuple[Any, None]:
            def compute(carry: Any) -> Any:
                s, _ = _scores(q_i, take(kb, j), side, geo, st, i, j)
                keep = None
                if st.dropout_prob > 0.0:
                    keep = _keep(a["dropout_seed"], geo, st, i, j)
                return online_step(carry, s, take(vb, j), "bhgqk,bhkd->bhgqd", keep)

            return when(tile_may_see(geo, st, i, j), compute, carry), None

        (m, denom, acc), _ = scan(one_kv_block, init, geo.nk)
        out_i, lse_i = finish_rows(m, denom, acc, sinks=aux, dropout_prob=st.dropout_prob)
        return out_i.astype(q.dtype), lse_i

    out_b, lse_b = map_blocks(one_q_block, geo.nq)
    out = unblock_q(out_b, geo)
    return out, {"out": out, "logsumexp": unblock_q(lse_b[..., None], geo)[..., 0]}


@functools.partial(jax.jit, static_argnames="st")
def _backward(a: dict[str, Any], d_out: jax.Array, st: Blocked) -> dict[str, jax.Array | None]:
    """FlashAttention-2 Alg. 2: outer scan over key blocks, inner scan over query blocks.

    Returns:
        Gradients for ``query``, ``key``, ``value``, ``bias`` (in bias's own shape) and
        ``softmax_aux``, each in its input's dtype; ``None`` for an absent input.
    """
    q, k, v = (a[n] for n in ("query", "key", "value"))
    geo = Blocking.of(q, k, v, st.block_q, st.block_k)
    side = SideInputs.of(a, geo, _pair_blocks)
    rows = BackwardRows.of(a, d_out, geo)
    kb, vb = kv_blocks(finite_or_zero(k), geo), kv_blocks(finite_or_zero(v), geo)
    bias_grad = _BiasGradient.of(a["bias"], geo)

    def one_kv_block(outer: Any, j: Any) -> tuple[Any, Any]:
        k_j, v_j = take(kb, j), take(vb, j)
        zeros_kv = (
            jnp.zeros((geo.b, geo.hkv, geo.bk, geo.d), jnp.float32),
            jnp.zeros((geo.b, geo.hkv, geo.bk, geo.dv), jnp.float32),
        )
        init = (*zeros_kv, bias_grad.zeros_over_q())

        def one_q_block(inner: Any, i: Any) -> tuple[Any, Any]:
            dq_zero = jnp.zeros((geo.b, geo.hkv, geo.group, geo.bq, geo.d), jnp.float32)

            def compute(inner: Any) -> Any:
                dk, dv, db_sum = inner
                q_i = take(rows.q, i)
                scores = _scores(q_i, k_j, side, geo, st, i, j)
                keep = _keep(a["dropout_seed"], geo, st, i, j) if st.dropout_prob > 0.0 else None
                dq_i, dk_i, dv_i, db_i = block_gradients(
                    rows, i, k_j, v_j, scores, keep=keep, st=st, reduce_bias=bias_grad.reduce
                )
                dk, dv = dk + dk_i, dv + dv_i
                db_sum, db_out = bias_grad.split_over_q(db_sum, db_i)
                return (dk, dv, db_sum), (dq_i, db_out)

            def skip(inner: Any) -> Any:
                return inner, (dq_zero, bias_grad.zeros_per_q())

            return when_else(tile_may_see(geo, st, i, j), compute, skip, inner)

        (dk, dv, db_sum), (dq_parts, db_parts) = scan(one_q_block, init, geo.nq)
        dq_acc, db_acc = outer
        db_acc, db_out = bias_grad.split_over_k(db_acc, bias_grad.join_q(db_sum, db_parts))
        return (dq_acc + dq_parts, db_acc), (dk, dv, db_out)

    dq_init = jnp.zeros((geo.nq, geo.b, geo.hkv, geo.group, geo.bq, geo.d), jnp.float32)
    (dq, db_acc), (dk, dv, db_parts) = scan(
        one_kv_block, (dq_init, bias_grad.zeros_over_k()), geo.nk
    )
    scale = st.softmax_scale
    grads: dict[str, jax.Array | None] = {
        "query": (unblock_q(dq, geo) * scale).astype(q.dtype),
        "key": (unblock_kv(dk, geo) * scale).astype(k.dtype),
        "value": unblock_kv(dv, geo).astype(v.dtype),
        "bias": bias_grad.finish(db_acc, db_parts),
        "softmax_aux": None,
    }
    if a["softmax_aux"] is not None:
        grads["softmax_aux"] = sink_grad(a["softmax_aux"], a["logsumexp"], rows.delta)
    return grads


_PASSES = Passes(spec=SPEC, statics=_statics, forward=_forward, backward=_backward)
defvjp(flash_attention_xla, _PASSES.fwd, _PASSES.bwd)
defvjp(scaled_dot_product_attention_xla, _PASSES.fwd, _scaled_dot_product_attention_bwd)


def _flash_attention_lse_fwd(*, cfg: Any = None, **args: Any) -> tuple[jax.Array, jax.Array]:
    """``(out, logsumexp [B, Sq, Hq] float32)``: the (out, lse) step of ring attention."""
    out, residuals = _PASSES.fwd(cfg=cfg, **args)
    return out, residuals["logsumexp"]


def _flash_attention_lse_bwd(
    out: jax.Array, lse: jax.Array, d_out: jax.Array, *, cfg: Any = None, **args: Any
) -> dict[str, jax.Array | None]:
    """Gradients from the softmax statistics ``out`` and ``lse`` given by the caller."""
    bound = SPEC.bind((), args)
    arrays = {a.name: bound[a.name] for a in SPEC.args if a.array}
    static = {k: v for k, v in bound.items() if k not in arrays}
    seed = arrays["dropout_seed"]
    arrays["dropout_seed"] = (
        jnp.asarray(0 if seed is None else seed).astype(jnp.uint32)
        if static.get("dropout_prob")
        else None
    )
    residuals = {**arrays, "out": out, "logsumexp": lse}
    return _PASSES.bwd(residuals, d_out, cfg=cfg, **static)


deflse(flash_attention_xla, _flash_attention_lse_fwd, _flash_attention_lse_bwd)


# --------------------------------------------------------------------------------------------
# Block helpers
# --------------------------------------------------------------------------------------------


def _pair_blocks(x: jax.Array, geo: Blocking, fill: Any) -> jax.Array:
    """Broadcastable to [B, Hq, Sq, Sk] -> [nq|1, nk|1, B|1, Hkv|1, G|1, bq|1, bk|1].

    Axes the array broadcasts over stay of size 1 (a broadcast bias is never materialised).
    """
    x = as_4d(x)
    b1, h1, q1, k1 = x.shape
    nq, bq = (geo.nq, geo.bq) if q1 > 1 else (1, 1)
    nk, bk = (geo.nk, geo.bk) if k1 > 1 else (1, 1)
    hkv, group = (geo.hkv, geo.group) if h1 > 1 else (1, 1)
    if q1 > 1:
        x = pad_axis(x, 2, geo.sq_pad, fill)
    if k1 > 1:
        x = pad_axis(x, 3, geo.sk_pad, fill)
    x = x.reshape(b1, hkv, group, nq, bq, nk, bk)
    return x.transpose(3, 5, 0, 1, 2, 4, 6)


def _take_pair(x: jax.Array, i: Any, j: Any) -> jax.Array:
    return take(take(x, i), j)


def _scores(
    q_i: jax.Array,
    k_j: jax.Array,
    side: SideInputs,
    geo: Blocking,
    st: Blocked,
    i: Any,
    j: Any,
) -> tuple[jax.Array, jax.Array | None]:
    """Masked logits of block (i, j), [B, Hkv, G, bq, bk] float32, and the soft-capped ones."""
    return block_scores(
        dot("bhgqd,bhkd->bhgqk", q_i, k_j),
        softmax_scale=st.softmax_scale,
        logits_soft_cap=st.logits_soft_cap,
        bias=None if side.bias is None else _take_pair(side.bias, i, j),
        vis=_visibility(side, geo, st, i, j),
    )


def _visibility(side: SideInputs, geo: Blocking, st: Blocked, i: Any, j: Any) -> Any:
    """Bool mask of block (i, j) broadcastable to [B, Hkv, G, bq, bk]; ``None`` = all visible."""
    q_pos = (i * geo.bq + jnp.arange(geo.bq))[:, None] + (geo.sk - geo.sq)
    k_pos = (j * geo.bk + jnp.arange(geo.bk))[None, :]
    segments: dict[str, Any] = {}
    kv_valid = None
    if side.q_segments is not None:
        # [B, 1, 1, bq, 1] against [B, 1, 1, 1, bk]; padded keys carry id -1: hidden here too.
        segments = {
            "q_segment_ids": take(side.q_segments, i)[:, None, None, :, None],
            "kv_segment_ids": take(side.kv_segments, j)[:, None, None, None, :],
        }
    elif geo.sk_pad != geo.sk:
        kv_valid = k_pos < geo.sk
    return block_visibility(
        q_pos,
        k_pos,
        causal=st.causal,
        window=st.sliding_window,
        kv_valid=kv_valid,
        attention_mask=None if side.mask is None else _take_pair(side.mask, i, j),
        **segments,
    )


def _keep(seed: jax.Array, geo: Blocking, st: Blocked, i: Any, j: Any) -> jax.Array:
    """Dropout keep-mask of block (i, j), [B, Hkv, G, bq, bk], from global indices."""
    return dropout_keep(
        seed,
        jnp.arange(geo.b).reshape(geo.b, 1, 1, 1, 1),
        jnp.arange(geo.hq).reshape(1, geo.hkv, geo.group, 1, 1),
        (i * geo.bq + jnp.arange(geo.bq))[:, None],
        (j * geo.bk + jnp.arange(geo.bk))[None, :],
        st.dropout_prob,
    )


def _sinks(aux: jax.Array | None, geo: Blocking) -> jax.Array | None:
    """[Hq] or [Hq, n] -> [1, Hkv, G, 1, n] float32, broadcasting against row statistics."""
    if aux is None:
        return None
    return aux.astype(jnp.float32).reshape(1, geo.hkv, geo.group, 1, -1)


@attrs.frozen(kw_only=True)
class _BiasGradient:
    """Accumulates ``dS`` into the bias's broadcast shape across the two backward loops.

    Along an axis the bias has in full, block results are stacked; along one it broadcasts
    over, they are summed in the loop carry.
    """

    shape: tuple[int, ...] | None
    dtype: Any
    geo: Blocking

    @classmethod
    def of(cls, bias: jax.Array | None, geo: Blocking) -> _BiasGradient:
        if bias is None:
            return cls(shape=None, dtype=None, geo=geo)
        return cls(shape=tuple(bias.shape), dtype=bias.dtype, geo=geo)

    @property
    def _dims4(self) -> tuple[int, ...]:
        assert self.shape is not None
        return (1,) * (4 - len(self.shape)) + self.shape

    @property
    def _q_full(self) -> bool:
        return self._dims4[2] > 1

    @property
    def _k_full(self) -> bool:
        return self._dims4[3] > 1

    def _block_shape(self) -> tuple[int, ...]:
        b1, h1, _, _ = self._dims4
        hkv, group = (self.geo.hkv, self.geo.group) if h1 > 1 else (1, 1)
        bq = self.geo.bq if self._q_full else 1
        bk = self.geo.bk if self._k_full else 1
        return (b1, hkv, group, bq, bk)

    def reduce(self, ds: jax.Array) -> jax.Array | None:
        """Sum ``ds`` [B, Hkv, G, bq, bk] over the axes the bias broadcasts along."""
        if self.shape is None:
            return None
        return bias_grad(ds, self._block_shape())

    def zeros_over_q(self) -> jax.Array | None:
        """Inner-loop carry: the running sum over query blocks (when not stacked)."""
        if self.shape is None or self._q_full:
            return None
        return jnp.zeros(self._block_shape(), jnp.float32)

    def zeros_per_q(self) -> jax.Array | None:
        """Inner-loop output of a skipped block (when stacked over query blocks)."""
        if self.shape is None or not self._q_full:
            return None
        return jnp.zeros(self._block_shape(), jnp.float32)

    def split_over_q(self, running: Any, block: Any) -> tuple[Any, Any]:
        """``(carry, output)`` of a query block: stacked along a full query axis, else summed."""
        return self._split(2, running, block)

    def join_q(self, running: Any, stacked: Any) -> Any:
        """The key block's gradient, [nq|1, B|1, Hkv|1, G|1, bq|1, bk|1]."""
        if self.shape is None:
            return None
        return stacked if self._q_full else running[None]

    def zeros_over_k(self) -> jax.Array | None:
        """Outer-loop carry: the running sum over key blocks (when not stacked)."""
        if self.shape is None or self._k_full:
            return None
        nq = self.geo.nq if self._q_full else 1
        return jnp.zeros((nq, *self._block_shape()), jnp.float32)

    def split_over_k(self, running: Any, block: Any) -> tuple[Any, Any]:
        """``(carry, output)`` of a key block: stacked along a full key axis, else summed."""
        return self._split(3, running, block)

    def _split(self, axis: int, running: Any, block: Any) -> tuple[Any, Any]:
        if self.shape is None:
            return None, None
        if self._dims4[axis] > 1:
            return running, block
        return running + block, None

    def finish(self, running: Any, stacked: Any) -> jax.Array | None:
        """[nk|1, nq|1, B|1, Hkv|1, G|1, bq|1, bk|1] -> the bias's own shape and dtype."""
        if self.shape is None:
            return None
        blocks = stacked if self._k_full else running[None]
        b1, h1, q1, k1 = self._dims4
        sq = blocks.shape[1] * blocks.shape[5]
        sk = blocks.shape[0] * blocks.shape[6]
        grad = blocks.transpose(2, 3, 4, 1, 5, 0, 6).reshape(b1, h1, sq, sk)
        return grad[:, :, :q1, :k1].reshape(self.shape).astype(self.dtype)
