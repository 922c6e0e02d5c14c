"""flash_attention on CUDA: cuDNN's fused flash attention, reached through XLA.

The vendor route: ``jax.nn.dot_product_attention(..., implementation="cudnn")`` lowers to
cuDNN's fused attention (forward and backward, FlashAttention-2 style, Dao 2023); JAX
differentiates it with cuDNN's backward kernel. This module maps ejkernel's arguments onto it;
``supports()`` declines, with the reason, what cuDNN (as JAX exposes it, on this cuDNN version
and GPU) cannot compute with ejkernel's semantics, so selection moves on to another platform.
The limits are in :mod:`ejkernel_cuda.ops._cudnn_limits` (dtypes, head dims, even sequence
lengths, GQA, masks, the features cuDNN lacks); docs/platforms.md has the table.

Bias and ``attention_mask`` are broadcast to ``[·, ·, Sq, Sk]`` (batch and head dims may stay
1) and given to cuDNN, which adds them (the mask as a large negative bias); rows that the mask
leaves without any visible key are then set to zero, as ejkernel's semantics ask (cuDNN would
average them). The bias is cast to the query dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.attention_semantics import visible
from ejkernel_cuda.ops._cudnn_limits import cudnn_declines, current_target

__all__ = ["cudnn_attention", "cudnn_supports", "flash_attention_cuda", "supports"]


def cudnn_supports(kw: Any) -> bool | str:
    """Whether cuDNN's fused attention computes this call with ejkernel's semantics on this
    process's cuDNN and GPU (read now, not at import): ``True`` or the reason it cannot."""
    return cudnn_declines(kw, current_target()) or True


def supports(inv: Any) -> bool | str:
    return cudnn_supports(inv.kwargs)


def flash_attention_cuda(*, cfg: Any = None, **args: Any) -> jax.Array:
    """Flash attention through cuDNN: ``ejkernel.flash_attention``'s arguments as keywords,
    validated by the core spec (``supports()`` has declined segment ids, sinks, soft cap,
    dropout, odd lengths and the masks cuDNN aligns differently).

    Args:
        query: [B, Sq, Hq, D].
        key: [B, Sk, Hkv, D].
        value: [B, Sk, Hkv, D].
        bias: broadcastable to [B, Hq, Sq, Sk], or ``None``.
        attention_mask: bool, broadcastable to [B, Hq, Sq, Sk], or ``None``.
        softmax_scale: multiplies the logits.
        causal: bottom-right aligned causal mask.
        sliding_window: ``(left, right)`` or ``None``.
        cfg: unused (cuDNN picks its own kernels).

    Returns:
        [B, Sq, Hq, D] in the query dtype.
    """
    del cfg
    return cudnn_attention(**args)


def _to_4d(x: jax.Array, sq: int, sk: int) -> jax.Array:
    """Left-pad to rank 4 and broadcast the last two dims to ``[Sq, Sk]``."""
    x = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
    return jnp.broadcast_to(x, (x.shape[0], x.shape[1], sq, sk))


def cudnn_attention(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    **declined: Any,
) -> jax.Array:
    """``jax.nn.dot_product_attention(implementation="cudnn")`` with ejkernel's semantics, for
    the arguments of flash attention or scaled dot-product attention; ``declined`` are those
    :func:`cudnn_supports` turns away (absent or zero here)."""
    del declined
    b, sq, hq, d = query.shape
    sk = key.shape[1]
    scale = float(d**-0.5 if softmax_scale is None else softmax_scale)
    # Bottom-right causal equals cuDNN's top-left one when Sq == Sk; a single query sees all.
    is_causal = bool(causal and sq == sk)
    window = None
    if sliding_window is not None:
        # supports() let through only windows that are left-only once intersected with the
        # causal mask: (left, 0) with the causal flag is cuDNN's sliding window.
        window = (int(sliding_window[0]), 0)
        is_causal = True
    bias4 = None if bias is None else _to_4d(bias.astype(query.dtype), sq, sk)
    mask4 = None if attention_mask is None else _to_4d(attention_mask, sq, sk)
    out = jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias=bias4,
        mask=mask4,
        scale=scale,
        is_causal=is_causal,
        local_window_size=window,
        implementation="cudnn",
    )
    if mask4 is not None:
        out = jnp.where(_any_visible(mask4, b, sq, hq, sk, is_causal, window), out, 0)
    return out


def _any_visible(
    mask4: jax.Array,
    b: int,
    sq: int,
    hq: int,
    sk: int,
    causal: bool,
    window: tuple[int, int] | None,
) -> jax.Array:
    """[B, Sq, Hq, 1]: whether each query row keeps at least one key."""
    q_pos = jnp.arange(sq)[:, None] + (sk - sq)
    k_pos = jnp.arange(sk)[None, :]
    band = visible(q_pos, k_pos, causal=causal, window=window)
    seen = jnp.any(mask4 & band, axis=-1)  # [b', h', Sq]
    seen = jnp.broadcast_to(seen, (b, hq, sq))
    return jnp.transpose(seen, (0, 2, 1))[..., None]
