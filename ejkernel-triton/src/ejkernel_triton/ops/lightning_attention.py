"""lightning_attention in Triton: linear attention with a per-head constant decay, on the gla
kernels.

:func:`ejkernel.lightning_attention` is gla with the key gate ``-slopes[h]`` at every token
and K index (float32), so the call runs :mod:`ejkernel_triton.ops.gla`'s chunked kernels (or,
undifferentiated and short, the fused recurrent kernel) on that gate; the slopes' gradient is
minus the key gate's summed over batch, tokens and K (padding and tokens outside every packed
sequence have a zero gate gradient). An infinite slope is a −inf gate: the state is forgotten
at every token, as in the recurrence. Configs are
:class:`~ejkernel_triton.ops.gla_config.GlaConfig`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.plugins import defvjp
from ejkernel_triton.ops import _on_gla, gla
from ejkernel_triton.ops.gla_config import GlaConfig, config_space, heuristic

__all__ = [
    "LightningAttentionConfig",
    "config_space",
    "heuristic",
    "lightning_attention_triton",
    "supports",
]

#: The lightning_attention op's config is gla's.
LightningAttentionConfig = GlaConfig


def supports(inv: Any) -> bool | str:
    """gla's limits: dtypes bf16/f16/f32, one q/k/v dtype, K and V ≤ 256."""
    a = inv.kwargs
    return _on_gla.gla_supports(a)


def lightning_attention_triton(*, cfg: GlaConfig | None = None, **args: Any) -> Any:
    """Lightning attention through the Triton gla kernels.

    Args:
        **args: the arguments of :func:`ejkernel.specs.lightning_attention.lightning_attention`,
            by name, as the core spec validated them (``slopes`` filled in).
        cfg: the gla config; ``None`` takes the heuristic's.

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state [N, H, K, V] float32)``
        when ``return_state``.
    """
    cfg = _on_gla.config(cfg, args)
    if not cfg.fused:
        return _lightning_fwd(cfg=cfg, **args)[0]
    a = gla_form(args)
    return gla.fused_gla(a, cfg, a["g"])


def _lightning_fwd(*, cfg: GlaConfig | None = None, **args: Any) -> tuple[Any, dict[str, Any]]:
    out, res = gla._gla_fwd(cfg=cfg, **gla_form(args))
    return out, {"gla": res, "slopes": jnp.zeros((0,), args["slopes"].dtype)}


def _lightning_bwd(
    residuals: dict[str, Any], d_out: Any, *, cfg: GlaConfig | None = None, **statics: Any
) -> dict[str, jax.Array | None]:
    keep = {n: statics.get(n) for n in ("softmax_scale", "return_state")}
    grads = gla._gla_bwd(residuals["gla"], d_out, cfg=cfg, **keep)
    d_gate = grads.pop("g")
    grads["slopes"] = -jnp.sum(d_gate, axis=(0, 1, 3)).astype(residuals["slopes"].dtype)
    return grads


defvjp(lightning_attention_triton, _lightning_fwd, _lightning_bwd)


def gla_form(args: dict[str, Any]) -> dict[str, Any]:
    """gla's arguments for the call: the key gate ``-slopes`` broadcast to ``[B, S, H, K]``."""
    q = args["query"]
    gate = jnp.broadcast_to(-args["slopes"].astype(jnp.float32)[:, None], q.shape)
    return _on_gla.gla_args(args, gate)
