"""multi_head_latent_attention: MLA (DeepSeek-V2, Sec. 2.1), keys and values from a shared latent.

Every key/value token is stored as a latent ``c [R]`` plus one rotary key ``k_rope [Dr]``
shared by all heads. Head h sees

- key ``K_h = c · w_kc[:, h, :] ∥ k_rope`` (``[Dn + Dr]``, the rope part identical for every
  head) and value ``V_h = c · w_vc[:, h, :]`` (``[Dv]``);
- a query ``[Dn + Dr]`` whose first Dn features meet the latent key part and last Dr features
  the rope part;

then ordinary softmax attention: logits ``softmax_scale · q · K_h``, soft cap, masking
(``causal`` bottom-right aligned, ``sliding_window``) as in flash attention. ``softmax_scale``
defaults to ``(Dn + Dr) ** -0.5``.

OPS.md writes one ``S`` for queries and keys; the query length may differ from the key length
(``query [B, Sq, ...]``, ``key_value [B, Sk, R]``, ``k_rope [B, Sk, Dr]``; decode is Sq = 1
over a cached latent), with flash attention's bottom-right causal alignment. ``Dr`` may be 0.
A row with no visible key returns zeros with zero gradients. Accumulation is float32; the
output ``[B, Sq, Hq, Dv]`` keeps the query dtype. Differentiable in every array argument.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.attention_semantics import finite_or_zero
from ejkernel.specs._base import builtin_op_spec, call_op, check_array, check_floating
from ejkernel.specs.flash_attention import attention_statics, flash_attention_reference

__all__ = [
    "SPEC",
    "multi_head_latent_attention",
    "multi_head_latent_attention_reference",
    "validate_multi_head_latent_attention",
]

OP = "multi_head_latent_attention"


def multi_head_latent_attention_reference(
    query: jax.Array,
    key_value: jax.Array,
    w_kc: jax.Array,
    w_vc: jax.Array,
    k_rope: jax.Array,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
) -> jax.Array:
    """Per-head keys and values materialised in float32, then flash attention's oracle."""
    f32 = lambda x: x.astype(jnp.float32)
    # Non-finite latents read as 0 before the projections mix them (see attention_semantics).
    key_value, k_rope = finite_or_zero(key_value), finite_or_zero(k_rope)
    b, sk, _ = key_value.shape
    hq, dr = w_kc.shape[1], k_rope.shape[-1]
    k_nope = jnp.einsum("bsr,rhn->bshn", f32(key_value), f32(w_kc))
    k_rope_heads = jnp.broadcast_to(f32(k_rope)[:, :, None, :], (b, sk, hq, dr))
    key = jnp.concatenate([k_nope, k_rope_heads], axis=-1)  # [B, Sk, Hq, Dn + Dr]
    value = jnp.einsum("bsr,rhv->bshv", f32(key_value), f32(w_vc))  # [B, Sk, Hq, Dv]
    out = flash_attention_reference(
        f32(query),
        key,
        value,
        softmax_scale=query.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    return out.astype(query.dtype)


def validate_multi_head_latent_attention(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument; fill ``softmax_scale``. Raises ValueError/TypeError."""
    q, c, w_kc, w_vc, rope = (a[n] for n in ("query", "key_value", "w_kc", "w_vc", "k_rope"))
    check_array(OP, "query", q, ndim=4, letters="[B, Sq, Hq, Dn + Dr]")
    check_array(OP, "key_value", c, ndim=3, letters="[B, Sk, R]")
    check_array(OP, "w_kc", w_kc, ndim=3, letters="[R, Hq, Dn]")
    check_array(OP, "w_vc", w_vc, ndim=3, letters="[R, Hq, Dv]")
    check_array(OP, "k_rope", rope, ndim=3, letters="[B, Sk, Dr]")
    named = (("query", q), ("key_value", c), ("w_kc", w_kc), ("w_vc", w_vc), ("k_rope", rope))
    check_floating(OP, named)
    if len({x.dtype for _, x in named}) != 1:
        dtypes = ", ".join(f"{name}={x.dtype}" for name, x in named)
        raise TypeError(f"{OP}: every array must share one dtype; got {dtypes}")
    b, sq, hq, d = q.shape
    sk, r = c.shape[1], c.shape[2]
    if c.shape[0] != b:
        raise ValueError(
            f"{OP}: `key_value` must be [B, Sk, R] with B={b}; got key_value.shape="
            f"{tuple(c.shape)}, query.shape={tuple(q.shape)}"
        )
    if w_kc.shape[:2] != (r, hq) or w_kc.shape[2] > d:
        raise ValueError(
            f"{OP}: `w_kc` must be [R, Hq, Dn] with R={r}, Hq={hq}, Dn <= Dn + Dr={d}; got "
            f"w_kc.shape={tuple(w_kc.shape)}"
        )
    if w_vc.shape[:2] != (r, hq):
        raise ValueError(
            f"{OP}: `w_vc` must be [R, Hq, Dv] with R={r}, Hq={hq}; got w_vc.shape={tuple(w_vc.shape)}"
        )
    dn = w_kc.shape[2]
    if tuple(rope.shape) != (b, sk, d - dn):
        raise ValueError(
            f"{OP}: `k_rope` must be [B, Sk, Dr]=({b}, {sk}, {d - dn}) with Dr = query's last "
            f"dim ({d}) - Dn ({dn}); got k_rope.shape={tuple(rope.shape)}"
        )
    if min(sq, sk, r, dn, w_vc.shape[2]) == 0:  # B == 0 is an empty call, not an error
        raise ValueError(
            f"{OP}: Sq, Sk, R, Dn and Dv must be non-empty; got query.shape={tuple(q.shape)}, "
            f"key_value.shape={tuple(c.shape)}, w_kc.shape={tuple(w_kc.shape)}, "
            f"w_vc.shape={tuple(w_vc.shape)}"
        )
    a.setdefault("causal", False)
    attention_statics(OP, a, d=d)
    return a


def multi_head_latent_attention(
    query: jax.Array,
    key_value: jax.Array,
    w_kc: jax.Array,
    w_vc: jax.Array,
    k_rope: jax.Array,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    """Multi-head latent attention (MLA): keys and values up-projected from a shared latent.

    Args:
        query: [B, Sq, Hq, Dn + Dr]; the first Dn features meet ``key_value · w_kc``, the last
            Dr features meet ``k_rope``.
        key_value: [B, Sk, R], the compressed latent of every key/value token.
        w_kc: [R, Hq, Dn], the latent-to-key up-projection.
        w_vc: [R, Hq, Dv], the latent-to-value up-projection.
        k_rope: [B, Sk, Dr], the rotary key part shared by all heads (Dr may be 0).
        softmax_scale: multiplies the logits; default (Dn + Dr) ** -0.5.
        causal: bottom-right aligned causal mask (query i at position Sk - Sq + i).
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``; intersected with ``causal``.
        logits_soft_cap: logits become ``cap * tanh(logits / cap)`` before masking.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        [B, Sq, Hq, Dv] in the query dtype (per-head values, before any output projection);
        rows with no visible key are zeros.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(
    multi_head_latent_attention, differentiable=("query", "key_value", "w_kc", "w_vc", "k_rope")
)
