"""attention on XLA: materialised softmax attention returning ``(out, weights)``.

The probabilities are an output, so the whole ``[B, Hq, Sq, Sk]`` matrix is formed in float32:

- Forward. Logits ``softmax_scale · q kᵀ`` (GQA heads laid out as ``[B, Hkv, G, ...]`` so a
  key/value head is never repeated), soft cap, bias, then the visibility of
  :func:`ejkernel.attention_semantics.dense_visibility`; non-finite keys and values read as
  0 (:func:`~ejkernel.attention_semantics.finite_or_zero`), so a hidden one contributes nothing. A numerically stable softmax
  whose maximum and denominator include the sinks (``softmax_aux``); rows with no visible key
  are zeros. Dropout uses flash attention's hash (:func:`~ejkernel.specs.flash_attention.dropout_keep`),
  so ``weights`` drops the entries flash attention drops. ``out = weights · V`` in float32.
- Backward (hand-written, attached with :func:`ejkernel.plugins.defvjp`). Cotangents arrive
  for both outputs; with ``P`` the undropped probabilities and ``W`` the returned weights,
  ``dW_total = dO Vᵀ + dWeights``, ``dP = keep ∘ dW_total / (1 - p)``, and the softmax
  Jacobian gives ``dS = P ∘ (dP - Σ_k P dP)`` (sinks have no upstream gradient, so they only
  enter through ``P``; their own gradient is ``-p_sink · Σ_k P dP``). The soft cap multiplies
  ``dS`` by ``1 - tanh²``; ``dBias`` is ``dS`` summed into the bias's broadcast shape. Saved:
  the inputs, ``P`` in float32 and the row logsumexp; the logits are recomputed only for the
  soft cap.

No config (nothing to tune: one fused graph). It declines nothing (no ``supports``): every valid call
runs, on every backend (memory is O(B · Hq · Sq · Sk) by the op's definition).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.attention_semantics import (
    EMPTY_ROW_LSE,
    Geometry,
    bias_grad,
    dense_visibility,
    finite_or_zero,
    sink_grad,
    soft_cap,
    soft_cap_grad,
)
from ejkernel.plugins import defvjp
from ejkernel.specs.attention import SPEC
from ejkernel.specs.flash_attention import dropout_keep
from ejkernel_xla.ops._adapter import Masking, Passes

__all__ = ["attention_xla"]


def attention_xla(*, cfg: None = None, **args: Any) -> tuple[jax.Array, jax.Array]:
    """Materialised attention.

    Args:
        cfg: unused (this implementation has no tunables).
        **args: :func:`ejkernel.attention`'s arguments by name, as its spec validated them
            (absent ones take their defaults).

    Returns:
        ``(out [B, Sq, Hq, Dv], weights [B, Hq, Sq, Sk])`` in the query dtype.
    """
    return _PASSES.primal(args, cfg)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _statics(arrays: dict[str, Any], cfg: None, backward: bool, static: Any) -> Masking:
    del cfg, backward
    return Masking.of(arrays["query"], static)


def _raw_logits(q: jax.Array, k: jax.Array, st: Masking) -> jax.Array:
    """``softmax_scale · q kᵀ`` as [B, Hq, Sq, Sk] float32 (GQA without repeating K)."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, sq, hkv, hq // hkv, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    return s.reshape(b, hq, sq, k.shape[1]) * st.softmax_scale


def _visible(a: dict[str, Any], st: Masking) -> jax.Array:
    geometry = Geometry.of(a["query"], a["key"], causal=st.causal, window=st.sliding_window)
    return dense_visibility(geometry, a["attention_mask"], a["q_segment_ids"], a["kv_segment_ids"])


def _keep(a: dict[str, Any], st: Masking) -> jax.Array:
    """Dropout keep-mask [B, Hq, Sq, Sk] from global indices (flash attention's hash)."""
    b, sq, hq, _ = a["query"].shape
    sk = a["key"].shape[1]
    return dropout_keep(
        a["dropout_seed"],
        jnp.arange(b)[:, None, None, None],
        jnp.arange(hq)[None, :, None, None],
        jnp.arange(sq)[None, None, :, None],
        jnp.arange(sk)[None, None, None, :],
        st.dropout_prob,
    )


def _sinks(aux: jax.Array | None, hq: int) -> jax.Array | None:
    """[Hq] or [Hq, n] -> [1, Hq, 1, n] float32."""
    if aux is None:
        return None
    return aux.astype(jnp.float32).reshape(1, hq, 1, -1)


def _apply_v(w: jax.Array, v: jax.Array) -> jax.Array:
    """``w [B, Hq, Sq, Sk] · v [B, Sk, Hkv, Dv]`` -> [B, Sq, Hq, Dv] float32."""
    b, hq, sq, sk = w.shape
    hkv = v.shape[2]
    wg = w.reshape(b, hkv, hq // hkv, sq, sk)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", wg, v.astype(jnp.float32))
    return out.reshape(b, sq, hq, v.shape[3])


# --------------------------------------------------------------------------------------------
# Forward and backward passes
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="st")
def _forward(
    a: dict[str, Any], st: Masking
) -> tuple[tuple[jax.Array, jax.Array], dict[str, jax.Array]]:
    """``(out, weights)`` in the query dtype, and for the backward the undropped
    probabilities ``[B, Hq, Sq, Sk]`` and the row logsumexp ``[B, Hq, Sq]`` (float32)."""
    q, k, v = a["query"], finite_or_zero(a["key"]), finite_or_zero(a["value"])
    hq = q.shape[2]
    s = soft_cap(_raw_logits(q, k, st), st.logits_soft_cap)
    if a["bias"] is not None:
        s = s + a["bias"].astype(jnp.float32)
    visible = _visible(a, st)
    s = jnp.where(visible, s, -jnp.inf)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    aux = _sinks(a["softmax_aux"], hq)
    if aux is not None:
        row_max = jnp.maximum(row_max, jnp.max(aux, axis=-1, keepdims=True))
    # A row with nothing visible (or only -inf logits) has no finite maximum: use 0, so every
    # exp below is exp(-inf) = 0 and the row's probabilities come out as zeros.
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(s - row_max)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if aux is not None:
        denom = denom + jnp.sum(jnp.exp(aux - row_max), axis=-1, keepdims=True)
    seen = jnp.any(visible, axis=-1, keepdims=True) & (denom > 0.0)
    denom = jnp.where(seen, denom, 1.0)
    probs = jnp.where(seen, p / denom, 0.0)
    lse = jnp.where(seen, row_max + jnp.log(denom), EMPTY_ROW_LSE)[..., 0]
    weights = probs
    if st.dropout_prob > 0.0:
        weights = jnp.where(_keep(a, st), probs * (1.0 / (1.0 - st.dropout_prob)), 0.0)
    out = _apply_v(weights, v)
    return (out.astype(q.dtype), weights.astype(q.dtype)), {"probs": probs, "logsumexp": lse}


@functools.partial(jax.jit, static_argnames="st")
def _backward(
    a: dict[str, Any], d_outputs: tuple[jax.Array, jax.Array], st: Masking
) -> dict[str, jax.Array | None]:
    """Gradients for the cotangents of ``(out, weights)``: ``query``, ``key``, ``value``,
    ``bias`` (in bias's own shape) and ``softmax_aux``, each in its input's dtype; ``None``
    for an absent input."""
    d_out, d_weights = d_outputs
    q, k, v = a["query"], finite_or_zero(a["key"]), finite_or_zero(a["value"])
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    probs, lse = a["probs"], a["logsumexp"]
    d_out = d_out.astype(jnp.float32)
    scale_kept = 1.0 / (1.0 - st.dropout_prob) if st.dropout_prob > 0.0 else 1.0
    keep = _keep(a, st) if st.dropout_prob > 0.0 else None
    weights = probs if keep is None else jnp.where(keep, probs * scale_kept, 0.0)
    # dV = Wᵀ dO, summed over the query heads sharing each key/value head.
    wg = weights.reshape(b, hkv, group, sq, sk)
    dog = d_out.reshape(b, sq, hkv, group, -1)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", wg, dog)
    # The total cotangent of the returned weights, then of the undropped probabilities.
    dw = jnp.einsum("bqhgd,bkhd->bhgqk", dog, v.astype(jnp.float32)).reshape(b, hq, sq, sk)
    dw = dw + d_weights.astype(jnp.float32)
    dp = dw if keep is None else jnp.where(keep, dw * scale_kept, 0.0)
    delta = jnp.sum(probs * dp, axis=-1, keepdims=True)
    ds = probs * (dp - delta)
    grads: dict[str, jax.Array | None] = {"bias": None, "softmax_aux": None}
    if a["bias"] is not None:
        grads["bias"] = bias_grad(ds, tuple(a["bias"].shape), a["bias"].dtype)
    if st.logits_soft_cap is not None:
        capped = soft_cap(_raw_logits(q, k, st), st.logits_soft_cap)
        ds = ds * soft_cap_grad(capped, st.logits_soft_cap)
    dsg = ds.reshape(b, hkv, group, sq, sk) * st.softmax_scale
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", dsg, k.astype(jnp.float32)).reshape(b, sq, hq, d)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", dsg, q.astype(jnp.float32).reshape(b, sq, hkv, group, d))
    grads.update(query=dq.astype(q.dtype), key=dk.astype(k.dtype), value=dv.astype(v.dtype))
    aux = a["softmax_aux"]
    if aux is not None:
        # Row statistics as [B, Sq, Hq]: delta is Σ_k P dP, the D of the sink gradient.
        rows = lambda x: x.transpose(0, 2, 1)
        grads["softmax_aux"] = sink_grad(aux, rows(lse), rows(delta[..., 0]))
    return grads


_PASSES = Passes(spec=SPEC, statics=_statics, forward=_forward, backward=_backward)
defvjp(attention_xla, _PASSES.fwd, _PASSES.bwd)
