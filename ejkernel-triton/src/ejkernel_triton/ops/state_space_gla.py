"""What the Triton state-space ops share: the pieces of ``Δ`` and the decay both
(``state_space_v1``'s scan kernels, ``state_space_v2``'s SSD kernels) follow (:func:`delta`,
:func:`log_decay`, :func:`silu_gate`), their array names, and ``state_space_v2``'s mapping onto
the gla kernels (:mod:`ejkernel_triton.ops.gla`) for decoding and its config.

A :class:`Mapping` says how one op's arrays become gla's (``as_linear``), how gla's output
becomes the op's (``finish``: the skip ``D x`` and the gate), and how the state is laid out
(``state``: gla's final state to the op's). An undifferentiated call runs gla's fused recurrent
kernel where its config says ``fused``, else the mapping's own chunked forward
(``chunked_primal``: state_space_v2's SSD kernels; :func:`primal`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.specs.state_space_v1 import decay_rate
from ejkernel_triton.ops import gla
from ejkernel_triton.ops.gla_config import GlaConfig
from ejkernel_triton.ops.gla_config import heuristic as gla_heuristic

__all__ = [
    "ARRAYS",
    "Mapping",
    "config_space",
    "delta",
    "heuristic",
    "log_decay",
    "primal",
    "silu_gate",
    "supports",
]

#: The ops' array arguments (``None`` when absent).
ARRAYS = ("x", "A", "B", "C", "D", "dt", "gate", "dt_bias", "initial_state")
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MAX_DIM = 256
_CHUNKS = (16, 32, 64)


@attrs.frozen
class Mapping:
    """One op on the gla kernels.

    Attributes:
        shapes: ``kwargs -> (query [B, S, H, K], value [B, S, H, V])`` shapes of gla's call.
        as_linear: ``(arrays, dt_softplus) -> gla's arrays`` (``cu_seqlens`` included).
        finish: ``(y, arrays) -> out`` float32: gla's output to the op's, skip and gate.
        state: ``state -> state``: gla's final state to the op's (a transpose or reshape).
        chunked_primal: ``(arrays, dt_softplus, cfg, return_state) -> out or (out,
            final_state)``: the op's own chunked forward, which the undifferentiated non-fused
            call runs.
    """

    shapes: Callable[[dict[str, Any]], tuple[tuple[int, ...], tuple[int, ...]]]
    as_linear: Callable[[dict[str, Any], bool], dict[str, Any]]
    finish: Callable[[jax.Array, dict[str, Any]], jax.Array]
    state: Callable[[jax.Array], jax.Array]
    chunked_primal: Callable[[dict[str, Any], bool, Any, bool], Any]


# -- config ---------------------------------------------------------------------------------


def supports(inv: Any, m: Mapping) -> bool | str:
    """True, or why not: an ``x`` dtype other than bf16/f16/f32, gla's K or V over 256."""
    x = inv.kwargs["x"]
    if x.dtype not in _DTYPES:
        return f"x dtype {x.dtype} (the Triton kernels take bfloat16, float16, float32)"
    (*_, k), (*_, v) = m.shapes(inv.kwargs)
    if max(k, v) > _MAX_DIM:
        return f"state {k} x {v} per head: the kernels hold each ≤ {_MAX_DIM}"
    return True


def heuristic(inv: Any, m: Mapping, cls: type[GlaConfig]) -> Any:
    """gla's heuristic at the equivalent shape; the op's ``chunk_size``, when given, sets the
    chunk (the largest of gla's chunks not above it)."""
    base = gla_heuristic(_Inv(_gla_shapes(inv.kwargs, m)))
    return _with_chunk(cls(**attrs.asdict(base)), inv.kwargs.get("chunk_size"))


def config_space(inv: Any, m: Mapping, cls: type[GlaConfig]) -> list[Any]:
    """The heuristic, then gla's config space at the equivalent shape."""
    out = [heuristic(inv, m, cls)]
    for cfg in gla.config_space(_Inv(_gla_shapes(inv.kwargs, m))):
        mine = _with_chunk(cls(**attrs.asdict(cfg)), inv.kwargs.get("chunk_size"))
        if mine not in out:
            out.append(mine)
    return out


def _gla_shapes(kwargs: dict[str, Any], m: Mapping) -> dict[str, Any]:
    q, v = m.shapes(kwargs)
    dtype = kwargs["x"].dtype
    return {"query": jax.ShapeDtypeStruct(q, dtype), "value": jax.ShapeDtypeStruct(v, dtype)}


def _with_chunk(cfg: Any, chunk: int | None) -> Any:
    if chunk is None:
        return cfg
    return attrs.evolve(cfg, chunk_size=max([c for c in _CHUNKS if c <= chunk], default=16))


@attrs.frozen
class _Inv:
    kwargs: dict[str, Any]


def resolved_config(cfg: Any, args: dict[str, Any], m: Mapping, cls: type[GlaConfig]) -> Any:
    """The config a call runs with: ``cfg``, or the heuristic's when ``None``; the op's
    ``chunk_size`` in ``args``, when given, sets its chunk."""
    if cfg is None:
        return heuristic(_Inv(args), m, cls)
    return _with_chunk(cfg, args.get("chunk_size"))


# -- the undifferentiated call --------------------------------------------------------------


def primal(m: Mapping, cls: type[GlaConfig], cfg: Any, args: dict[str, Any]) -> Any:
    """The undifferentiated call: through gla's fused recurrent kernel where the config says
    ``fused`` (decoding a few tokens), else the mapping's ``chunked_primal``."""
    cfg = resolved_config(cfg, args, m, cls)
    a = {n: args.get(n) for n in ARRAYS}
    rs = bool(args.get("return_state"))
    if not cfg.fused:
        return m.chunked_primal(a, bool(args.get("dt_softplus")), cfg, rs)
    lin = m.as_linear(a, bool(args.get("dt_softplus")))
    out = gla.fused_gla({**lin, "softmax_scale": 1.0, "return_state": rs}, cfg, lin["g"])
    y, final = out if rs else (out, None)
    o = m.finish(y, a).astype(a["x"].dtype)
    return (o, m.state(final)) if rs else o


# -- shared pieces of the mappings ----------------------------------------------------------


def delta(a: dict[str, Any], softplus: bool) -> jax.Array:
    """``Δ = dt + dt_bias``, then ``softplus(Δ)`` when asked; float32."""
    d = a["dt"].astype(jnp.float32)
    if a["dt_bias"] is not None:
        d = d + a["dt_bias"].astype(jnp.float32)
    return jax.nn.softplus(d) if softplus else d


def log_decay(d: jax.Array, A: jax.Array) -> jax.Array:
    """``Δ A`` floored at gla's :data:`~ejkernel_triton.ops.gla.MIN_LOG_DECAY` (float32):
    ``A = -inf`` is a reset where ``Δ > 0`` and passes the state where ``Δ = 0``; below the
    floor (whose exp is 0 in float32) the gradient is 0."""
    return jnp.maximum(d * decay_rate(A), gla.MIN_LOG_DECAY)


def silu_gate(out: jax.Array, gate: jax.Array | None) -> jax.Array:
    """``out ⊙ silu(gate)`` (float32) when a gate is given."""
    if gate is None:
        return out
    return out * jax.nn.silu(gate.astype(jnp.float32))
