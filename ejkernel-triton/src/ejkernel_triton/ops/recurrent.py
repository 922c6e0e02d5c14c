"""recurrent in Triton: the gated linear recurrence on the gla kernels.

:func:`ejkernel.recurrent` with the key gates ``g [B, S, H]`` (per head) and ``gk [B, S, H, K]``
is gla with the key gate ``g[..., None] + gk`` (float32; an absent gate is 0), so the call
runs :mod:`ejkernel_triton.ops.gla`'s chunked kernels (or, undifferentiated and short, the
fused recurrent kernel) on that gate; ``g``'s gradient is the K-sum of the key gate's.

``reverse=True`` flips time: the reversed recurrence over tokens ``x`` is the forward one over
``x[:, ::-1]``, with packed sequences ``cu' = S − cu[::-1]`` (sequence n becomes sequence
N − 1 − n, so initial and final states are taken in reverse order) and the gradients flipped
back. The value gate ``gv`` is declined by :func:`supports`: it decays the state's V axis,
which the gla kernels (whose output contracts the gated K axis) do not carry; such calls run
on the XLA platform. Configs are :class:`~ejkernel_triton.ops.gla_config.GlaConfig`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.plugins import defvjp
from ejkernel_triton.ops import _on_gla, gla
from ejkernel_triton.ops.gla_config import GlaConfig, config_space, heuristic

__all__ = [
    "RecurrentConfig",
    "config_space",
    "heuristic",
    "recurrent_triton",
    "supports",
]

#: The recurrent op's config is gla's.
RecurrentConfig = GlaConfig


def supports(inv: Any) -> bool | str:
    """gla's limits (dtypes, K and V ≤ 256), and no value gate ``gv``."""
    a = inv.kwargs
    if a.get("gv") is not None:
        return (
            "the value gate gv decays the state's V axis, which the Triton gla kernels do not "
            "carry (the XLA platform serves it)"
        )
    return _on_gla.gla_supports(a, ("g", "gk"))


def recurrent_triton(*, cfg: GlaConfig | None = None, **args: Any) -> Any:
    """The gated linear recurrence through the Triton gla kernels.

    Args:
        **args: the arguments of :func:`ejkernel.specs.recurrent.recurrent`, by name, as the
            core spec validated them (``gv`` absent).
        cfg: the gla config; ``None`` takes the heuristic's.

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state [N, H, K, V] float32)``
        when ``return_state``.
    """
    cfg = _on_gla.config(cfg, args)
    if not cfg.fused:
        return _recurrent_fwd(cfg=cfg, **args)[0]
    a, rev = gla_form(args), bool(args.get("reverse"))
    packed = a["cu_seqlens"] is not None
    if rev:
        a = flip_inputs(a)
    out = gla.fused_gla(a, cfg, a["g"])
    return flip_outputs(out, packed, a["return_state"]) if rev else out


def _recurrent_fwd(*, cfg: GlaConfig | None = None, **args: Any) -> tuple[Any, dict[str, Any]]:
    a, rev = gla_form(args), bool(args.get("reverse"))
    packed = a["cu_seqlens"] is not None
    if rev:
        a = flip_inputs(a)
    out, res = gla._gla_fwd(cfg=cfg, **a)
    if rev:
        out = flip_outputs(out, packed, a["return_state"])
    dtypes = {n: jnp.zeros((0,), args[n].dtype) for n in ("g", "gk") if args.get(n) is not None}
    return out, {"gla": res, "dtypes": dtypes}


def _recurrent_bwd(
    residuals: dict[str, Any], d_out: Any, *, cfg: GlaConfig | None = None, **statics: Any
) -> dict[str, jax.Array | None]:
    res = residuals["gla"]
    packed, rev = res["layout"].packed, bool(statics.get("reverse"))
    ret = bool(statics.get("return_state"))
    if rev:
        d_out = flip_outputs(d_out, packed, ret)
    keep = {n: statics.get(n) for n in ("softmax_scale", "return_state")}
    grads = gla._gla_bwd(res, d_out, cfg=cfg, **keep)
    if rev:
        grads = {n: _flip_grad(n, x, packed) for n, x in grads.items()}
    d_gate = grads.pop("g")
    dtypes = residuals["dtypes"]
    if "g" in dtypes:
        grads["g"] = jnp.sum(d_gate, axis=-1).astype(dtypes["g"].dtype)
    if "gk" in dtypes:
        grads["gk"] = d_gate.astype(dtypes["gk"].dtype)
    return grads


defvjp(recurrent_triton, _recurrent_fwd, _recurrent_bwd)


def gla_form(args: dict[str, Any]) -> dict[str, Any]:
    """gla's arguments for the call: the key gate ``g[..., None] + gk`` in float32."""
    q = args["query"]
    gate = jnp.zeros(q.shape, jnp.float32)
    if args.get("g") is not None:
        gate = gate + args["g"].astype(jnp.float32)[..., None]
    if args.get("gk") is not None:
        gate = gate + args["gk"].astype(jnp.float32)
    return _on_gla.gla_args(args, gate)


def flip_inputs(a: dict[str, Any]) -> dict[str, Any]:
    """gla's arguments with time reversed (packed sequences and their states in reverse order)."""
    out = {**a}
    for n in ("query", "key", "value", "g"):
        out[n] = a[n][:, ::-1]
    cu = a["cu_seqlens"]
    if cu is not None:
        out["cu_seqlens"] = a["query"].shape[1] - cu[::-1]
        if a["initial_state"] is not None:
            out["initial_state"] = a["initial_state"][::-1]
    return out


def flip_outputs(out: Any, packed: bool, return_state: bool) -> Any:
    """The output (or its cotangent) of a flipped call back in the caller's time order."""
    if not return_state:
        return out[:, ::-1]
    o, final = out
    return o[:, ::-1], (final[::-1] if packed and final is not None else final)


def _flip_grad(name: str, x: jax.Array | None, packed: bool) -> jax.Array | None:
    if x is None:
        return None
    if name == "initial_state":
        return x[::-1] if packed else x
    return x[:, ::-1]
