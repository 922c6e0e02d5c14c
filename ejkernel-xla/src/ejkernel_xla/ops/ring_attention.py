"""ring_attention on XLA: Ring Attention over blockwise FlashAttention-2, with a custom VJP.

Without ``axis_name`` the op is flash attention: the call, its forward and its backward go to
:mod:`ejkernel_xla.ops.flash_attention`. With ``axis_name`` it runs inside ``jax.shard_map``;
each of the ``n`` devices of the axis holds one shard of the sequence (query rows
``[r·Sq, (r+1)·Sq)``, key rows ``[r·Sk, (r+1)·Sk)``). The algorithm is Ring Attention (Liu,
Zaharia and Abbeel, 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context", Sec. 3), each device's work being FlashAttention-2 (Dao, 2023, Alg. 1 and 2):

- Forward. The device's queries stay; its key/value shard (and its ``kv_segment_ids``) travels
  around the ring with ``lax.ppermute`` (device r sends to r + 1), so at step t device r holds
  the shard of device ``s = (r - t) mod n``. Each step runs the blockwise online softmax over
  that shard's key blocks, carrying the running row maximum, denominator and accumulator (all
  float32) across steps, which is the exact merge of partial softmaxes; the rotation of step
  t is independent of its compute, so XLA can overlap the two. After the last step sinks join
  the denominator, the accumulator is divided once and the per-row logsumexp is saved. n - 1
  rotations move every shard past every device.
- Backward. The saved logsumexp makes each step independent: ``P = exp(S - lse)`` is
  recomputed per block and dQ accumulates on the device, while the dK/dV accumulators travel
  with the key/value shard they belong to; after n compute steps a last rotation brings each
  accumulator home to the device of its shard.
- Masks use global positions: local query i of device r is global row ``r·Sq + i``, at
  position ``n·Sk - n·Sq + r·Sq + i`` (causal bottom-right alignment of the global lengths);
  key j of shard s is at ``s·Sk + j``. ``bias``/``attention_mask`` hold the device's query rows
  and every key column ([B|1, Hq|1, Sq|1, n·Sk|1]); the columns of shard s are read at step t.
  Dropout hashes the global query and key rows (:func:`ejkernel.specs.flash_attention.
  dropout_keep`), so it drops what the unsharded call drops. Shards and blocks that causality
  or the window hide entirely are skipped with ``lax.cond`` on positions only.
- Gradients of inputs the same on every device (``softmax_aux``, a ``bias`` not split along the
  ring) are summed over the ring (``psum``) when ``shard_map`` tracks replication
  (``check_vma=True``); without that tracking ``shard_map``'s own transpose sums them.

Calls without bias, attention mask, dropout, sinks or sliding window (and, when causal, with
``Sq == Sk`` locally) run instead on the selected flash-attention kernel per ring step
(:mod:`ejkernel_xla.ops._ring_flash`), as does the zigzag layout (which the spec refuses with
a sliding window, dropout or sinks). Accumulation is float32; matmul inputs keep the input
dtype; every masking argument of flash attention is served on the ring in the contiguous layout. A ring call is never
autotuned (its config space is the heuristic alone): the tuner times candidates on synthetic
inputs outside the caller's trace, where the ``shard_map`` axis is unbound.

The ring's machinery (shard geometry, rotation, replication typing, the blocks of one step) is
:mod:`ejkernel_xla.ops._ring`; this module holds the config and the two passes.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.attention_semantics import sink_grad
from ejkernel.plugins import defvjp
from ejkernel.specs.ring_attention import SPEC
from ejkernel_xla.ops import _ring_flash
from ejkernel_xla.ops._adapter import BlockConfig, Passes, pass_blocks
from ejkernel_xla.ops._blockwise import (
    BackwardRows,
    backend,
    block_gradients,
    finish_rows,
    initial_rows,
    online_step,
    q_blocks,
    scan,
    take,
    unblock_kv,
    unblock_q,
    when,
    when_else,
)
from ejkernel_xla.ops._ring import (
    At,
    BiasGradient,
    RingGeometry,
    Shard,
    Statics,
    block_keep,
    block_may_see,
    ring,
    rotate,
    scores,
    shard_may_see,
    side_inputs,
    sinks,
    sum_if_replicated,
    vary_like,
    zeros_like_query,
)
from ejkernel_xla.ops.flash_attention import FlashAttentionConfig, flash_attention_xla
from ejkernel_xla.ops.flash_attention import config_space as flash_config_space
from ejkernel_xla.ops.flash_attention import heuristic as flash_heuristic

__all__ = [
    "RingAttentionConfig",
    "config_space",
    "heuristic",
    "ring_attention_xla",
]

#: Default ((fwd q, fwd kv), (bwd q, bwd kv)) block sizes inside one device's shard, as flash
#: attention's (wide key blocks on CPU keep loop steps few).
_DEFAULT_BLOCKS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "cpu": ((256, 1024), (128, 1024)),
    "gpu": ((128, 128), (128, 128)),
    "tpu": ((512, 512), (512, 512)),
}


@attrs.frozen(kw_only=True)
class RingAttentionConfig(BlockConfig):
    """Tunables of the XLA ring attention: the block sizes of
    :class:`~ejkernel_xla.ops._adapter.BlockConfig` inside one device's shard.

    Without ``axis_name`` they are flash attention's. ``None`` takes the backend's default;
    blocks longer than the local sequence are clamped to it.
    """


def heuristic(inv: Any) -> RingAttentionConfig:
    """Flash attention's default blocks, clamped to the device's local sequence lengths."""
    return _from_flash(flash_heuristic(inv))


def config_space(inv: Any) -> list[RingAttentionConfig]:
    """Flash attention's candidate blocks; on a ring, the heuristic's alone.

    Candidates are timed on synthetic inputs outside the caller's trace, where the ring's
    ``shard_map`` axis is not bound, so a ring call is never autotuned (a single candidate
    skips tuning); without ``axis_name`` the call is flash attention and tunes like it.
    """
    if inv.kwargs.get("axis_name") is not None:
        return [heuristic(inv)]
    return [_from_flash(cfg) for cfg in flash_config_space(inv)]


def ring_attention_xla(
    *, cfg: RingAttentionConfig | None = None, axis_name: Any = None, **args: Any
) -> jax.Array:
    """Ring attention (arrays are the device's local shards).

    Args:
        cfg: block sizes inside the shard for the blockwise ring; ``None`` takes the defaults.
            A call on flash-attention steps takes each step's config from flash attention's
            own config chain, on the step's shapes.
        axis_name: the ``shard_map`` axis the sequence is split over; ``None``: flash attention.
        **args: the rest of :func:`ejkernel.ring_attention`'s arguments by name, as its spec
            validated them (absent ones take their defaults): ``query [B, Sq, Hq, D]`` holds
            the device's query rows, ``key``/``value`` (with ``kv_segment_ids``) its key rows,
            which travel; ``bias``/``attention_mask`` broadcast to [B, Hq, Sq, n·Sk] (my rows,
            every key column); masks apply to global positions.

    Returns:
        [B, Sq, Hq, Dv] in the query dtype (my rows); rows with no visible key are zeros.
    """
    if axis_name is None:
        args.pop("layout", None)
        return flash_attention_xla(cfg=_to_flash(cfg), **args)
    if _on_flash_steps(args):
        return _ring_flash.forward(_flash_args(args), axis_name)[0]
    return _PASSES.primal({**args, "axis_name": axis_name}, cfg)


def _ring_attention_fwd(
    *, cfg: RingAttentionConfig | None = None, axis_name: Any = None, **args: Any
) -> tuple[jax.Array, dict[str, jax.Array | None]]:
    """Forward of :func:`ring_attention_xla`: ``(out, residuals)``, flash attention's without
    a ring axis."""
    if axis_name is None:
        args.pop("layout", None)
        return flash_attention_xla.fwd(cfg=_to_flash(cfg), **args)  # type: ignore[attr-defined]
    if _on_flash_steps(args):
        return _ring_flash.forward(_flash_args(args), axis_name)
    return _PASSES.fwd(cfg=cfg, axis_name=axis_name, **args)


def _ring_attention_bwd(
    residuals: dict[str, jax.Array | None],
    d_out: jax.Array,
    *,
    cfg: RingAttentionConfig | None = None,
    axis_name: Any = None,
    **static: Any,
) -> dict[str, jax.Array | None]:
    """Backward of :func:`ring_attention_xla` (flash attention's without a ring axis)."""
    if axis_name is None:
        static.pop("layout", None)
        bwd = flash_attention_xla.bwd  # type: ignore[attr-defined]
        return bwd(residuals, d_out, cfg=_to_flash(cfg), **static)
    if _on_flash_steps({**residuals, **static}):
        return _ring_flash.backward(residuals, d_out, _flash_args(static, residuals), axis_name)
    return _PASSES.bwd(residuals, d_out, cfg=cfg, axis_name=axis_name, **static)


def _on_flash_steps(a: dict[str, Any]) -> bool:
    """Whether a ring call runs on flash-attention steps (:mod:`._ring_flash`)."""
    return a.get("layout") == "zigzag" or _ring_flash.serves(a)


def _flash_args(a: dict[str, Any], arrays: dict[str, Any] | None = None) -> dict[str, Any]:
    """The arguments the flash-step ring reads, the scale filled in."""
    a = {**(arrays or {}), **a}
    scale = a.get("softmax_scale")
    if scale is None:
        scale = a["query"].shape[-1] ** -0.5
    return {**a, "softmax_scale": float(scale)}


# --------------------------------------------------------------------------------------------
# Configuration helpers
# --------------------------------------------------------------------------------------------


def _from_flash(cfg: FlashAttentionConfig) -> RingAttentionConfig:
    return RingAttentionConfig(fwd_params=cfg.fwd_params, bwd_params=cfg.bwd_params)


def _to_flash(cfg: RingAttentionConfig | None) -> FlashAttentionConfig | None:
    if cfg is None:
        return None
    return FlashAttentionConfig(fwd_params=cfg.fwd_params, bwd_params=cfg.bwd_params)


def _statics(
    arrays: dict[str, Any], cfg: RingAttentionConfig | None, backward: bool, static: Any
) -> Statics:
    default = _DEFAULT_BLOCKS[backend()][1 if backward else 0]
    sq, sk = arrays["query"].shape[1], arrays["key"].shape[1]
    blocks = pass_blocks(cfg or RingAttentionConfig(), backward, default, sq, sk)
    return Statics.of(arrays["query"], static, axis_name=static["axis_name"], **blocks)


# --------------------------------------------------------------------------------------------
# Forward and backward passes on the ring
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="st")
def _forward(a: dict[str, Any], st: Statics) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Ring Attention forward: ``out [B, Sq, Hq, Dv]``, and it with the logsumexp
    ``[B, Sq, Hq]`` of the global softmax (float32) for the backward."""
    q = a["query"]
    geo = RingGeometry.of(a, st)
    side = side_inputs(a, geo)
    qb = q_blocks(q, geo)
    rank = lax.axis_index(st.axis_name)
    rows = (geo.nq, geo.b, geo.hkv, geo.group, geo.bq)
    running = vary_like(initial_rows(rows, geo.dv), q, st.axis_name)

    def visit_shard(running: Any, shard: Shard, t: Any) -> tuple[Any, Shard]:
        src = (rank - t) % geo.n

        def one_q_block(_: Any, xs: Any) -> tuple[None, Any]:
            i, m, denom, acc = xs
            q_i = take(qb, i)
            at = At(rank=rank, src=src, i=i, j=None)

            def one_kv_block(carry: Any, j: Any) -> tuple[Any, None]:
                here = attrs.evolve(at, j=j)

                def update(carry: Any) -> Any:
                    s, _ = scores(q_i, take(shard.key, j), shard, side, geo, st, here)
                    keep = None
                    if st.dropout_prob > 0.0:
                        keep = block_keep(a["dropout_seed"], geo, st, here)
                    return online_step(carry, s, take(shard.value, j), "bhgqk,bhkd->bhgqd", keep)

                return when(block_may_see(geo, st, here), update, carry), None

            (m, denom, acc), _ = scan(one_kv_block, (m, denom, acc), geo.nk)
            return None, (m, denom, acc)

        def visit(running: Any) -> Any:
            _, running = lax.scan(one_q_block, None, (jnp.arange(geo.nq), *running))
            return running

        return when(shard_may_see(geo, st, rank, src), visit, running), shard

    running, _ = ring(visit_shard, running, Shard.of(a, geo), geo, st)
    m, denom, acc = running
    aux = sinks(a["softmax_aux"], geo)
    out, lse = finish_rows(m, denom, acc, sinks=aux, dropout_prob=st.dropout_prob)
    out = out.astype(q.dtype)
    out = unblock_q(out, geo)
    return out, {"out": out, "logsumexp": unblock_q(lse[..., None], geo)[..., 0]}


@functools.partial(jax.jit, static_argnames="st")
def _backward(a: dict[str, Any], d_out: jax.Array, st: Statics) -> dict[str, jax.Array | None]:
    """Ring Attention backward: dQ stays, dK/dV travel with their shard and come home.

    Returns:
        Gradients for ``query``, ``key``, ``value``, ``bias`` (in bias's own shape) and
        ``softmax_aux``, each in its input's dtype; ``None`` for an absent input.
    """
    q, k, v = (a[n] for n in ("query", "key", "value"))
    geo = RingGeometry.of(a, st)
    side = side_inputs(a, geo)
    rank = lax.axis_index(st.axis_name)
    rows = BackwardRows.of(a, d_out, geo)
    bias_grad = BiasGradient.of(a["bias"], geo)
    zero = functools.partial(zeros_like_query, q=q, axis=st.axis_name)

    def visit_shard(fixed: Any, shard: Shard, t: Any) -> tuple[Any, Shard]:
        src = (rank - t) % geo.n

        def one_kv_block(dq_acc: Any, j: Any) -> tuple[Any, Any]:
            k_j, v_j = take(shard.key, j), take(shard.value, j)
            init = (zero((geo.b, geo.hkv, geo.bk, geo.d)), zero((geo.b, geo.hkv, geo.bk, geo.dv)))

            def one_q_block(inner: Any, i: Any) -> tuple[Any, Any]:
                here = At(rank=rank, src=src, i=i, j=j)

                def update(inner: Any) -> Any:
                    dk, dv = inner
                    q_i = take(rows.q, i)
                    tile = scores(q_i, k_j, shard, side, geo, st, here)
                    keep = None
                    if st.dropout_prob > 0.0:
                        keep = block_keep(a["dropout_seed"], geo, st, here)
                    dq_i, dk_i, dv_i, db_i = block_gradients(
                        rows, i, k_j, v_j, tile, keep=keep, st=st, reduce_bias=bias_grad.reduce
                    )
                    dk, dv = dk + dk_i, dv + dv_i
                    return (dk, dv), (dq_i, db_i)

                def skip(inner: Any) -> Any:
                    dq_i = zero((geo.b, geo.hkv, geo.group, geo.bq, geo.d))
                    return inner, (dq_i, bias_grad.zero_block(zero))

                return when_else(block_may_see(geo, st, here), update, skip, inner)

            (dk_j, dv_j), (dq_parts, db_parts) = scan(one_q_block, init, geo.nq)
            return dq_acc + dq_parts, (dk_j, dv_j, db_parts)

        def visit(state: Any) -> Any:
            (dq, db), shard = state
            dq, (dk_s, dv_s, db_s) = scan(one_kv_block, dq, geo.nk)
            db = bias_grad.add(db, db_s, src)
            return (dq, db), attrs.evolve(shard, dk=shard.dk + dk_s, dv=shard.dv + dv_s)

        return when(shard_may_see(geo, st, rank, src), visit, (fixed, shard))

    shard = Shard.of(a, geo)
    shard = attrs.evolve(
        shard,
        dk=zero((geo.nk, geo.b, geo.hkv, geo.bk, geo.d)),
        dv=zero((geo.nk, geo.b, geo.hkv, geo.bk, geo.dv)),
    )
    fixed = (zero((geo.nq, geo.b, geo.hkv, geo.group, geo.bq, geo.d)), bias_grad.zeros(zero))
    (dq, db), shard = ring(visit_shard, fixed, shard, geo, st)
    # After n steps device r holds the accumulators of shard r + 1: one more hop brings each home.
    dk, dv = rotate((shard.dk, shard.dv), geo, st)
    scale = st.softmax_scale
    grads: dict[str, jax.Array | None] = {
        "query": (unblock_q(dq, geo) * scale).astype(q.dtype),
        "key": (unblock_kv(dk, geo) * scale).astype(k.dtype),
        "value": unblock_kv(dv, geo).astype(v.dtype),
        "bias": None,
        "softmax_aux": None,
    }
    if a["bias"] is not None:
        d_bias = bias_grad.finish(db)
        grads["bias"] = sum_if_replicated(d_bias, a["bias"], q, st.axis_name)
    if a["softmax_aux"] is not None:
        aux = a["softmax_aux"]
        d_aux = sink_grad(aux.astype(jnp.float32), a["logsumexp"], rows.delta)
        grads["softmax_aux"] = sum_if_replicated(d_aux, aux, q, st.axis_name).astype(aux.dtype)
    return grads


_PASSES = Passes(spec=SPEC, statics=_statics, forward=_forward, backward=_backward)
defvjp(ring_attention_xla, _ring_attention_fwd, _ring_attention_bwd)
