"""lightning_attention: linear attention with a per-head constant decay (MiniMax-01), chunked.

Semantics (OPS.md vocabulary), for each head h:
``state_t = exp(-slopes[h]) · state_{t-1} + k_tᵀ v_t`` and ``o_t = softmax_scale · q_t state_t``,
i.e. :func:`ejkernel.recurrent` with the scalar log gate ``g = -slopes[h]`` at every token.
``softmax_scale`` scales the query, default ``K ** -0.5`` as for every linear-attention op
(MiniMax-01's own layer applies no scale: pass ``softmax_scale=1.0`` to match it).
``initial_state``, ``cu_seqlens`` and ``return_state`` are as in
:mod:`ejkernel.specs.recurrent`, and so are its numerics (an infinite slope forgets the state
at every token; a NaN at token t reaches only token t and the tokens after it).

Slopes: given as ``slopes [H]``, or built from ``(layer_idx, num_layers)`` as MiniMax-01 publishes
(``MiniMaxLightningAttention.get_slope_rate`` in the MiniMax-Text-01 modelling code, also in
Hugging Face transformers' ``models/minimax``; paper arXiv:2501.08313), by
:func:`lightning_slopes`::

    slopes[h] = 2 ** (-8 (h + 1) / H) · (1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)

for h = 0 … H-1: ALiBi's geometric head slopes, shrinking linearly with depth so that the last
layer barely decays. (flash-linear-attention's ``chunk_lightning_attn`` uses a different
decay, ``-(8 / H) (1 - layer_idx / num_layers) · h``; this op follows MiniMax.)

Accumulation is float32; the output keeps the query dtype. Differentiable in query, key,
value, ``slopes`` and ``initial_state``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.specs._base import (
    CHUNKED_TOLERANCES,
    builtin_op_spec,
    call_op,
    check_array,
    is_floating,
)
from ejkernel.specs.recurrent import (
    linear_recurrence_reference,
    linear_synthetic,
    validate_linear_common,
)

__all__ = [
    "SPEC",
    "lightning_attention",
    "lightning_attention_reference",
    "lightning_slopes",
    "validate_lightning_attention",
]

OP = "lightning_attention"


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> np.ndarray:
    """MiniMax-01's decay rates ``[H]`` (float32) of layer ``layer_idx`` of ``num_layers``.

    ``slopes[h] = 2 ** (-8 (h + 1) / H) · (1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)``
    (MiniMax-Text-01's ``get_slope_rate``; see the module docstring).
    """
    base = 2.0 ** (-8.0 / num_heads)
    factor = 1.0 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** (np.arange(num_heads, dtype=np.float64) + 1) * factor).astype(np.float32)


def lightning_attention_reference(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    slopes: jax.Array | None = None,
    layer_idx: int | None = None,
    num_layers: int | None = None,
    **options: Any,
) -> Any:
    """``lax.scan`` over time in float32: the oracle every implementation is tested against.

    The linear recurrence with the key gate ``-slopes`` per head; ``options`` are the other
    keyword arguments of :func:`lightning_attention`."""
    if slopes is None:
        assert layer_idx is not None and num_layers is not None
        slopes = jnp.asarray(lightning_slopes(query.shape[2], layer_idx, num_layers))
    key_gate = -slopes.astype(jnp.float32)[None, None, :, None]
    return linear_recurrence_reference(query, key, value, key_gate=key_gate, **options)


def validate_lightning_attention(a: dict[str, Any]) -> dict[str, Any]:
    """Check every argument; build ``slopes`` from ``(layer_idx, num_layers)`` when not given.

    Raises ValueError/TypeError.
    """
    a = validate_linear_common(OP, a)
    h = a["query"].shape[2]
    slopes, layer, layers = a.get("slopes"), a.get("layer_idx"), a.get("num_layers")
    if slopes is not None:
        if layer is not None or layers is not None:
            raise ValueError(
                f"{OP}: give `slopes` or (`layer_idx`, `num_layers`), not both; got slopes and "
                f"layer_idx={layer!r}, num_layers={layers!r}"
            )
        check_array(OP, "slopes", slopes, ndim=1, letters="[H]")
        if tuple(slopes.shape) != (h,) or not is_floating(slopes):
            raise ValueError(
                f"{OP}: `slopes` must be floating [H]=({h},); got slopes.shape="
                f"{tuple(slopes.shape)}, dtype {slopes.dtype}"
            )
        return a
    if layer is None or layers is None:
        raise ValueError(
            f"{OP}: give `slopes` [H] or both `layer_idx` and `num_layers`; got "
            f"layer_idx={layer!r}, num_layers={layers!r}"
        )
    for name, x in (("layer_idx", layer), ("num_layers", layers)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{OP}: `{name}` must be an int; got {x!r}")
    if not 0 <= int(layer) < int(layers):
        raise ValueError(
            f"{OP}: `layer_idx` must satisfy 0 <= layer_idx < num_layers; got layer_idx={layer}, "
            f"num_layers={layers}"
        )
    a["layer_idx"], a["num_layers"] = int(layer), int(layers)
    a["slopes"] = jnp.asarray(lightning_slopes(h, int(layer), int(layers)))
    return a


def lightning_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    slopes: jax.Array | None = None,
    layer_idx: int | None = None,
    num_layers: int | None = None,
    initial_state: jax.Array | None = None,
    softmax_scale: float | None = None,
    cu_seqlens: jax.Array | None = None,
    return_state: bool = False,
    platform: str | None = None,
    cfg: Any = None,
) -> Any:
    """Lightning attention (MiniMax-01): linear attention with per-head decay ``exp(-slopes)``.

    Args:
        query: [B, S, H, K].
        key: [B, S, H, K].
        value: [B, S, H, V].
        slopes: [H] decay rates (> 0 decays); differentiable. Or give ``layer_idx`` and
            ``num_layers`` for MiniMax-01's slopes (:func:`lightning_slopes`).
        layer_idx: this layer's index, 0 <= layer_idx < num_layers.
        num_layers: the model's number of layers.
        initial_state: [N, H, K, V] (N = B, or the number of ``cu_seqlens`` sequences);
            differentiable.
        softmax_scale: scales the query; default K ** -0.5 (MiniMax-01 itself uses 1.0).
        cu_seqlens: [N + 1] integer offsets of N sequences packed along S (B == 1).
        return_state: also return the final states.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state [N, H, K, V] float32)``
        when ``return_state``.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(
    lightning_attention,
    differentiable=("query", "key", "value", "slopes", "initial_state"),
    synthetic=linear_synthetic,
    tolerances=CHUNKED_TOLERANCES,
)
