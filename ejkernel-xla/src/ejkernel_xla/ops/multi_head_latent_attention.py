"""multi_head_latent_attention on XLA: blockwise MLA, absorbed or expanded, O(S) memory.

MLA (DeepSeek-V2, Sec. 2.1.2-2.1.3) keys are ``K_h = c · W_kc[h] ∥ k_rope`` and values
``V_h = c · W_vc[h]`` for a latent ``c [R]``. Per-head keys and values are never formed for the
whole sequence. Two exact forms, both a FlashAttention-2 style loop (Dao, 2023) over key blocks
with an online softmax, float32 statistics and a hand-written backward
(:func:`ejkernel.plugins.defvjp`):

- **absorbed**: ``q_nope · (c W_kc)ᵀ = (q_nope W_kcᵀ) · cᵀ``, so ``W_kc`` is folded into the
  query once (``q_lat [B, Sq, Hq, R]``) and every head attends to the *shared* latent,
  multi-query style, with logits ``q_lat · cᵀ + q_rope · k_ropeᵀ``; values are the latent
  itself, and ``W_vc`` is applied to the latent output at the end (``o = o_lat W_vc``).
  Nothing per head exists on the key side. Work: ``Sq·Sk·Hq·(2R + Dr)`` for attention plus
  ``Sq·Hq·R·(Dn + Dv)`` for the two projections.
- **expanded**: each key block of latents is up-projected to that block's per-head keys and
  values (``[B, Hq, bk, Dn + Dv]``, one block at a time, inside the loop), then ordinary
  attention. Work: ``Sq·Sk·Hq·(Dn + Dr + Dv)`` plus ``Sk·Hq·R·(Dn + Dv)``.

Which form (the config's ``form``; ``None`` and the heuristic apply this rule): the one with
fewer multiply-adds by the two formulas above. Absorbed wins when the query is short against
the latent (decode and short chunks: ``Sq ≲ R / 3`` for DeepSeek's R = 512, Dn = 128, Dv = 128,
Dr = 64, where the key side would otherwise be projected for every cached token); expanded wins
for long queries (prefill, training), where its per-pair cost ``Dn + Dr + Dv`` is far below
``2R + Dr``. The autotuner may try both (:func:`config_space`).

Loops: keys outer, queries inner, so the expanded form projects each key block once per pass.
The forward carries the running maximum, denominator and accumulator of every query row
(O(Sq) memory); the backward (Alg. 2) recomputes ``P = exp(S - logsumexp)`` per block pair,
accumulates ``dK``/``dV`` of the key block in the inner carry and ``dQ`` in the outer one, then
maps them back through the projections (``dc``, ``dW_kc``, ``dW_vc``, ``dk_rope``; in the
absorbed form ``dW_kc`` and ``dW_vc`` come from ``dq_lat`` and ``o_lat`` after the loop).
Masking (causal bottom-right aligned, sliding window, key padding) uses a finite mask value:
a row with no visible key returns zeros with zero gradients. Block pairs that causality or the
window hide entirely are skipped. Accumulation is float32; matmul inputs keep the input dtype.

It declines nothing (no ``supports``): this backend serves every valid call, on every backend.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.attention_semantics import (
    EMPTY_ROW_LSE,
    Tiling,
    finite_or_zero,
    soft_cap_grad,
)
from ejkernel.plugins import defvjp
from ejkernel.specs.multi_head_latent_attention import SPEC
from ejkernel_xla.ops._adapter import (
    BlockConfig,
    Blocked,
    Passes,
    clamp_blocks,
    pass_blocks,
)
from ejkernel_xla.ops._blockwise import (
    backend,
    block_scores,
    block_visibility,
    dot,
    finish_rows,
    initial_rows,
    online_step,
    pad_axis,
    scan,
    take,
    tile_may_see,
    when,
    when_else,
)
from ejkernel_xla.ops._tuning import distinct

__all__ = [
    "MultiHeadLatentAttentionConfig",
    "config_space",
    "heuristic",
    "mla_form",
    "multi_head_latent_attention_xla",
]

FORMS = ("absorbed", "expanded")

#: Default ((fwd q, fwd kv), (bwd q, bwd kv)) block sizes per backend.
_DEFAULT_BLOCKS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "cpu": ((256, 512), (256, 512)),
    "gpu": ((128, 128), (128, 128)),
    "tpu": ((512, 512), (512, 512)),
}
#: (q_blocksize, kv_blocksize) pairs :func:`config_space` offers per backend, for each form.
_TUNING_BLOCKS: dict[str, tuple[tuple[int, int], ...]] = {
    "cpu": ((256, 512), (128, 1024), (512, 512)),
    "gpu": ((64, 64), (128, 128), (128, 256)),
    "tpu": ((256, 256), (512, 512), (512, 1024)),
}


@attrs.frozen(kw_only=True)
class MultiHeadLatentAttentionConfig(BlockConfig):
    """Tunables of the XLA MLA.

    Attributes:
        form: ``"absorbed"`` (W_kc folded into the query, W_vc into the output; attention over
            the shared latent) or ``"expanded"`` (per-head K/V of one key block at a time);
            ``None`` picks by :func:`mla_form`'s multiply-add count.
        fwd_params: ``q_blocksize``/``kv_blocksize`` of the forward pass (``None``: default).
        bwd_params: the same for the backward pass.
    """

    form: str | None = attrs.field(default=None, validator=attrs.validators.in_((None, *FORMS)))


def mla_form(sq: int, sk: int, hq: int, r: int, dn: int, dr: int, dv: int) -> str:
    """The form with fewer multiply-adds: ``"absorbed"`` or ``"expanded"`` (ties: absorbed).

    absorbed: ``Sq·Sk·Hq·(2R + Dr) + Sq·Hq·R·(Dn + Dv)``;
    expanded: ``Sq·Sk·Hq·(Dn + Dr + Dv) + Sk·Hq·R·(Dn + Dv)``.
    """
    absorbed = sq * sk * hq * (2 * r + dr) + sq * hq * r * (dn + dv)
    expanded = sq * sk * hq * (dn + dr + dv) + sk * hq * r * (dn + dv)
    return "absorbed" if absorbed <= expanded else "expanded"


def heuristic(inv: Any) -> MultiHeadLatentAttentionConfig:
    """The cheaper form by :func:`mla_form`, with the backend's default (clamped) blocks."""
    form = mla_form(*_sizes(inv))
    sq, sk = _sizes(inv)[:2]
    fwd, bwd = (clamp_blocks(b, sq, sk) for b in _DEFAULT_BLOCKS[backend()])
    return MultiHeadLatentAttentionConfig.of(fwd, bwd, form=form)


def config_space(inv: Any) -> list[MultiHeadLatentAttentionConfig]:
    """The heuristic's config, then both forms × a few block pairs (deduplicated)."""
    sq, sk = _sizes(inv)[:2]
    pairs = [clamp_blocks(pair, sq, sk) for pair in _TUNING_BLOCKS[backend()]]
    candidates = (
        MultiHeadLatentAttentionConfig.of(pair, form=form) for form in FORMS for pair in pairs
    )
    return distinct([heuristic(inv), *candidates])


def multi_head_latent_attention_xla(
    *, cfg: MultiHeadLatentAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """MLA, blockwise, O(S) memory.

    Args:
        cfg: form and block sizes; ``None`` picks the form by multiply-adds, default blocks.
        **args: :func:`ejkernel.multi_head_latent_attention`'s arguments by name, as its spec
            validated them (absent ones take their defaults).

    Returns:
        [B, Sq, Hq, Dv] in the query dtype; rows with no visible key are zeros.
    """
    return _PASSES.primal(args, cfg)


# --------------------------------------------------------------------------------------------
# Configuration helpers
# --------------------------------------------------------------------------------------------


def _sizes(inv: Any) -> tuple[int, int, int, int, int, int, int]:
    """``(Sq, Sk, Hq, R, Dn, Dr, Dv)`` of an invocation."""
    kw = inv.kwargs
    _, sq, hq, d = kw["query"].shape
    _, sk, r = kw["key_value"].shape
    dn, dv = kw["w_kc"].shape[2], kw["w_vc"].shape[2]
    return int(sq), int(sk), int(hq), int(r), int(dn), int(d - dn), int(dv)


@attrs.frozen(kw_only=True)
class _Statics(Blocked):
    """:class:`~ejkernel_xla.ops._adapter.Blocked` and the form (``absorbed`` or not)."""

    absorbed: bool


def _statics(
    arrays: dict[str, Any],
    cfg: MultiHeadLatentAttentionConfig | None,
    backward: bool,
    static: Any,
) -> _Statics:
    query, key_value, w_kc, w_vc = (arrays[n] for n in ("query", "key_value", "w_kc", "w_vc"))
    _, sq, hq, d = query.shape
    _, sk, r = key_value.shape
    dn, dv = w_kc.shape[2], w_vc.shape[2]
    cfg = cfg if cfg is not None else MultiHeadLatentAttentionConfig()
    form = cfg.form or mla_form(sq, sk, hq, r, dn, d - dn, dv)
    default = _DEFAULT_BLOCKS[backend()][1 if backward else 0]
    blocks = pass_blocks(cfg, backward, default, sq, sk)
    return _Statics.of(query, static, absorbed=form == "absorbed", **blocks)


# --------------------------------------------------------------------------------------------
# Forward and backward passes
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="st")
def _forward(a: dict[str, Any], st: _Statics) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``out [B, Sq, Hq, Dv]``, and for the backward the attention output in the form's value
    space (the latent output ``[B, Sq, Hq, R]`` float32 when absorbed, ``out`` when expanded)
    and the per-row logsumexp ``[B, Sq, Hq]``."""
    a = _finite_latents(a)
    q, w_vc = a["query"], a["w_vc"]
    geo = _Geometry.of(a, st)
    q_att, q_rope = _query_parts(a, st)
    qab, qrb = _q_blocks(q_att, geo), _q_blocks(q_rope, geo)
    cb, rb = _k_blocks(a["key_value"], geo), _k_blocks(a["k_rope"], geo)
    f = geo.r if st.absorbed else geo.dv
    init = initial_rows((geo.nq, geo.b, geo.hq, geo.bq), f)

    def one_kv_block(carry: Any, j: Any) -> tuple[Any, None]:
        c_j, r_j = take(cb, j), take(rb, j)
        k_j, v_j = _project(c_j, a, st)

        def one_q_block(_: None, xs: Any) -> tuple[None, Any]:
            i, qa_i, qr_i, *stats = xs

            def compute(stats: Any) -> Any:
                s, _ = _scores(qa_i, qr_i, k_j, r_j, geo, st, i, j)
                return online_step(stats, s, v_j, _spec("pv", st))

            return None, when(tile_may_see(geo, st, i, j), compute, tuple(stats))

        _, stats = lax.scan(one_q_block, None, (jnp.arange(geo.nq), qab, qrb, *carry))
        return stats, None

    (m, denom, acc), _ = scan(one_kv_block, init, geo.nk)
    out_attn, lse = finish_rows(m, denom, acc)
    out_attn = _unblock_q(out_attn, geo)
    lse = _unblock_q(lse[..., None], geo)[..., 0]
    if st.absorbed:
        out = dot("bqhr,rhv->bqhv", out_attn.astype(w_vc.dtype), w_vc).astype(q.dtype)
        return out, {"out_attn": out_attn, "logsumexp": lse}
    out = out_attn.astype(q.dtype)
    return out, {"out_attn": out, "logsumexp": lse}


@functools.partial(jax.jit, static_argnames="st")
def _backward(a: dict[str, Any], d_out: jax.Array, st: _Statics) -> dict[str, jax.Array]:
    """FlashAttention-2 Alg. 2 (keys outer, queries inner), then the projections' chain rule.

    Returns:
        Gradients for ``query``, ``key_value``, ``w_kc``, ``w_vc`` and ``k_rope``, each in its
        input's dtype.
    """
    out_attn, lse = a["out_attn"], a["logsumexp"]
    a = _finite_latents(a)
    q, c, w_kc, w_vc, rope = (a[n] for n in ("query", "key_value", "w_kc", "w_vc", "k_rope"))
    geo = _Geometry.of(a, st)
    dtype = q.dtype
    d_out = d_out.astype(dtype)
    q_att, q_rope = _query_parts(a, st)
    # In the absorbed form the attention's values are latents: dO_lat = dO W_vcᵀ.
    do_att = dot("bqhv,rhv->bqhr", d_out, w_vc).astype(dtype) if st.absorbed else d_out
    # D = rowsum(dO ∘ O) in the attention's value space (Sec. 3.1.2).
    delta = jnp.sum(do_att.astype(jnp.float32) * out_attn.astype(jnp.float32), axis=-1)
    qab, qrb, dob = _q_blocks(q_att, geo), _q_blocks(q_rope, geo), _q_blocks(do_att, geo)
    deltab = _q_blocks(delta[..., None], geo)[..., 0]
    lseb = _q_blocks(lse[..., None], geo, fill=EMPTY_ROW_LSE)[..., 0]
    cb, rb = _k_blocks(c, geo), _k_blocks(rope, geo)
    fa = geo.r if st.absorbed else geo.dn
    f = geo.r if st.absorbed else geo.dv
    dq_shape = (geo.b, geo.hq, geo.bq)
    k_side = (geo.b, geo.bk) if st.absorbed else (geo.b, geo.hq, geo.bk)

    def one_kv_block(outer: Any, j: Any) -> tuple[Any, Any]:
        dqa, dqr, dw_kc, dw_vc = outer
        c_j, r_j = take(cb, j), take(rb, j)
        k_j, v_j = _project(c_j, a, st)
        inner_init = (
            jnp.zeros((*k_side, fa), jnp.float32),
            jnp.zeros((geo.b, geo.bk, geo.dr), jnp.float32),
            jnp.zeros((*k_side, f), jnp.float32),
        )

        def one_q_block(inner: Any, xs: Any) -> tuple[Any, Any]:
            i, qa_i, qr_i, do_i, delta_i, lse_i = xs

            def compute(inner: Any) -> Any:
                dk_j, dkr_j, dv_j = inner
                s, capped = _scores(qa_i, qr_i, k_j, r_j, geo, st, i, j)
                p = jnp.exp(s - lse_i[..., None])
                dv_j = dv_j + dot(_spec("dv", st), p.astype(dtype), do_i)
                dp = dot(_spec("dp", st), do_i, v_j)
                ds = p * (dp - delta_i[..., None])
                if capped is not None:
                    ds = ds * soft_cap_grad(capped, st.logits_soft_cap)
                ds = ds.astype(dtype)
                dqa_i = dot(_spec("dq", st), ds, k_j)
                dqr_i = dot("bhqk,bke->bhqe", ds, r_j)
                dk_j = dk_j + dot(_spec("dk", st), ds, qa_i)
                dkr_j = dkr_j + dot("bhqk,bhqe->bke", ds, qr_i)
                return (dk_j, dkr_j, dv_j), (dqa_i, dqr_i)

            def skip(inner: Any) -> Any:
                zeros = (
                    jnp.zeros((*dq_shape, fa), jnp.float32),
                    jnp.zeros((*dq_shape, geo.dr), jnp.float32),
                )
                return inner, zeros

            return when_else(tile_may_see(geo, st, i, j), compute, skip, inner)

        xs = (jnp.arange(geo.nq), qab, qrb, dob, deltab, lseb)
        (dk_j, dkr_j, dv_j), (dqa_parts, dqr_parts) = lax.scan(one_q_block, inner_init, xs)
        dk_j = dk_j * st.softmax_scale
        if st.absorbed:  # keys and values are the latent itself
            dc_j = dk_j + dv_j
        else:  # back through K_j = c_j W_kc and V_j = c_j W_vc
            dc_j = dot("bhkn,rhn->bkr", dk_j, w_kc) + dot("bhkv,rhv->bkr", dv_j, w_vc)
            dw_kc = dw_kc + dot("bkr,bhkn->rhn", c_j, dk_j)
            dw_vc = dw_vc + dot("bkr,bhkv->rhv", c_j, dv_j)
        outer = (dqa + dqa_parts, dqr + dqr_parts, dw_kc, dw_vc)
        return outer, (dc_j, dkr_j * st.softmax_scale)

    outer_init = (
        jnp.zeros((geo.nq, *dq_shape, fa), jnp.float32),
        jnp.zeros((geo.nq, *dq_shape, geo.dr), jnp.float32),
        jnp.zeros((geo.r, geo.hq, geo.dn), jnp.float32),
        jnp.zeros((geo.r, geo.hq, geo.dv), jnp.float32),
    )
    (dqa, dqr, dw_kc, dw_vc), (dc, dkr) = scan(one_kv_block, outer_init, geo.nk)
    dqa = _unblock_q(dqa, geo) * st.softmax_scale
    dqr = _unblock_q(dqr, geo) * st.softmax_scale
    if st.absorbed:  # back through q_lat = q_nope W_kcᵀ and O = O_lat W_vc
        q_nope = q[..., : geo.dn]
        dq_nope = dot("bqhr,rhn->bqhn", dqa, w_kc)
        dw_kc = dot("bqhr,bqhn->rhn", dqa, q_nope)
        dw_vc = dot("bqhr,bqhv->rhv", out_attn, d_out)
    else:
        dq_nope = dqa
    return {
        "query": jnp.concatenate([dq_nope, dqr], axis=-1).astype(q.dtype),
        "key_value": _unblock_k(dc, geo).astype(c.dtype),
        "w_kc": dw_kc.astype(w_kc.dtype),
        "w_vc": dw_vc.astype(w_vc.dtype),
        "k_rope": _unblock_k(dkr, geo).astype(rope.dtype),
    }


_PASSES = Passes(spec=SPEC, statics=_statics, forward=_forward, backward=_backward)
defvjp(multi_head_latent_attention_xla, _PASSES.fwd, _PASSES.bwd)


# --------------------------------------------------------------------------------------------
# Block helpers
# --------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Geometry(Tiling):
    """Sizes of one call and its blocking (all Python ints): the tiling, batch, heads, the
    latent rank and the head dims."""

    b: int
    hq: int
    r: int
    dn: int
    dr: int
    dv: int
    bq: int
    bk: int

    @classmethod
    def of(cls, a: dict[str, Any], st: _Statics) -> _Geometry:
        b, sq, hq, d = a["query"].shape
        _, sk, r = a["key_value"].shape
        dn = a["w_kc"].shape[2]
        return cls(
            b=b,
            sq=sq,
            sk=sk,
            hq=hq,
            r=r,
            dn=dn,
            dr=d - dn,
            dv=a["w_vc"].shape[2],
            bq=st.block_q,
            bk=st.block_k,
        )


def _query_parts(a: dict[str, Any], st: _Statics) -> tuple[jax.Array, jax.Array]:
    """The query part meeting the keys' latent side (``q_lat`` or ``q_nope``) and ``q_rope``."""
    q, w_kc = a["query"], a["w_kc"]
    dn = w_kc.shape[2]
    q_nope, q_rope = q[..., :dn], q[..., dn:]
    if st.absorbed:  # q_lat = q_nope W_kcᵀ: [B, Sq, Hq, R]
        return dot("bqhn,rhn->bqhr", q_nope, w_kc).astype(q.dtype), q_rope
    return q_nope, q_rope


def _project(c_j: jax.Array, a: dict[str, Any], st: _Statics) -> tuple[jax.Array, jax.Array]:
    """Key-side and value blocks: the latent itself, or this block's per-head K/V."""
    if st.absorbed:
        return c_j, c_j  # [B, bk, R], shared by every head
    k_j = dot("bkr,rhn->bhkn", c_j, a["w_kc"]).astype(c_j.dtype)
    v_j = dot("bkr,rhv->bhkv", c_j, a["w_vc"]).astype(c_j.dtype)
    return k_j, v_j


#: einsum specs per product, ``(absorbed, expanded)``: shared latent keys/values (absorbed) or
#: per-head ones (expanded).
_SPECS = {
    "qk": ("bhqr,bkr->bhqk", "bhqn,bhkn->bhqk"),
    "pv": ("bhqk,bkr->bhqr", "bhqk,bhkv->bhqv"),
    "dv": ("bhqk,bhqr->bkr", "bhqk,bhqv->bhkv"),
    "dp": ("bhqr,bkr->bhqk", "bhqv,bhkv->bhqk"),
    "dq": ("bhqk,bkr->bhqr", "bhqk,bhkn->bhqn"),
    "dk": ("bhqk,bhqr->bkr", "bhqk,bhqn->bhkn"),
}


def _spec(product: str, st: _Statics) -> str:
    """The einsum spec of ``product`` (a key of :data:`_SPECS`) in ``st``'s form."""
    absorbed, expanded = _SPECS[product]
    return absorbed if st.absorbed else expanded


def _q_blocks(x: jax.Array, geo: _Geometry, fill: Any = 0) -> jax.Array:
    """[B, Sq, Hq, F] -> [nq, B, Hq, bq, F]."""
    x = pad_axis(x, 1, geo.nq * geo.bq, fill)
    x = x.reshape(geo.b, geo.nq, geo.bq, geo.hq, x.shape[-1])
    return x.transpose(1, 0, 3, 2, 4)


def _unblock_q(x: jax.Array, geo: _Geometry) -> jax.Array:
    """[nq, B, Hq, bq, F] -> [B, Sq, Hq, F]."""
    x = x.transpose(1, 0, 3, 2, 4).reshape(geo.b, geo.nq * geo.bq, geo.hq, x.shape[-1])
    return x[:, : geo.sq]


def _k_blocks(x: jax.Array, geo: _Geometry) -> jax.Array:
    """[B, Sk, F] -> [nk, B, bk, F]."""
    x = pad_axis(x, 1, geo.nk * geo.bk)
    return x.reshape(geo.b, geo.nk, geo.bk, x.shape[-1]).transpose(1, 0, 2, 3)


def _unblock_k(x: jax.Array, geo: _Geometry) -> jax.Array:
    """[nk, B, bk, F] -> [B, Sk, F]."""
    x = x.transpose(1, 0, 2, 3).reshape(geo.b, geo.nk * geo.bk, x.shape[-1])
    return x[:, : geo.sk]


def _scores(
    qa_i: jax.Array,
    qr_i: jax.Array,
    k_j: jax.Array,
    r_j: jax.Array,
    geo: _Geometry,
    st: _Statics,
    i: Any,
    j: Any,
) -> tuple[jax.Array, jax.Array | None]:
    """Masked logits of block (i, j), [B, Hq, bq, bk] float32, and the soft-capped ones."""
    s = dot(_spec("qk", st), qa_i, k_j)
    if geo.dr:
        s = s + dot("bhqe,bke->bhqk", qr_i, r_j)
    q_pos = (i * geo.bq + jnp.arange(geo.bq))[:, None] + (geo.sk - geo.sq)
    k_pos = (j * geo.bk + jnp.arange(geo.bk))[None, :]
    vis = block_visibility(
        q_pos, k_pos, causal=st.causal, window=st.sliding_window, kv_valid=k_pos < geo.sk
    )
    return block_scores(
        s, softmax_scale=st.softmax_scale, logits_soft_cap=st.logits_soft_cap, bias=None, vis=vis
    )


def _finite_latents(a: dict[str, Any]) -> dict[str, Any]:
    """Non-finite latents read as 0 before any projection mixes them, so a hidden one
    contributes nothing (:mod:`ejkernel.attention_semantics`)."""
    return {**a, "key_value": finite_or_zero(a["key_value"]), "k_rope": finite_or_zero(a["k_rope"])}
