"""What the chunked ops on gla's layout (:mod:`~ejkernel_triton.ops.gla`,
:mod:`~ejkernel_triton.ops.kernel_delta_attention`) share in JAX: the statics every launch
takes from the call and its config, the custom VJP's forward and backward around the op's
jitted passes, and the chunk layout's way in and out of those passes.

The passes' contract: ``forward(arrays, st) -> (out, final_state, residuals)`` with the
residuals holding ``layout`` (:class:`~ejkernel_triton.ops.gla_layout.Layout`), the chunked
``q`` and ``v`` and ``dtypes`` (the gradients' dtypes, with ``initial_state`` exactly when the
call has one); ``backward(residuals, d_out, d_final, st) -> gradients``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel_triton.ops.gla_layout import Layout


def softmax_scale(args: dict[str, Any]) -> float:
    """The call's ``softmax_scale``, ``K ** -0.5`` when ``None``."""
    scale = args.get("softmax_scale")
    return float(args["query"].shape[-1] ** -0.5 if scale is None else scale)


@attrs.frozen(kw_only=True)
class Statics:
    """The statics every chunked op's launches take, resolved from the call and its config;
    an op's subclass adds its own and builds itself in ``of(args, cfg)``.

    Attributes:
        scale: the softmax scale. return_state: the call returns the final state.
        chunk: tokens per chunk. block_k / block_v: the key- and value-dim blocks.
        num_warps / num_stages: the config's. precision: the dots' (``ieee`` or ``tf32``).
    """

    scale: float
    return_state: bool
    chunk: int
    block_k: int
    block_v: int
    num_warps: int
    num_stages: int
    precision: str


def call_statics(args: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """The fields of :class:`Statics` the call and its config (``chunk_size``, ``num_warps``,
    ``num_stages``) give as they are: all but the blocks. The dots run in IEEE float32 for
    float32 inputs, else TF32."""
    return {
        "scale": softmax_scale(args),
        "return_state": bool(args.get("return_state")),
        "chunk": cfg.chunk_size,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        "precision": "ieee" if jnp.dtype(args["query"].dtype) == jnp.float32 else "tf32",
    }


def vjp_rules(
    statics: Callable[[dict[str, Any], Any], Any],
    forward: Callable[..., tuple[Any, Any, dict[str, Any]]],
    backward: Callable[..., dict[str, jax.Array | None]],
    array_names: tuple[str, ...],
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The ``(fwd, bwd)`` pair :func:`ejkernel.plugins.defvjp` takes, around the op's passes.

    Args:
        statics: ``statics(args, cfg)``, the call's resolved statics (with ``return_state`` and
            ``chunk``; ``cfg`` ``None`` takes the heuristic's).
        forward: ``forward(arrays, st)``, the differentiated forward pass.
        backward: ``backward(residuals, d_out, d_final, st)``.
        array_names: the op's array arguments, which ``forward`` takes by name.

    Returns:
        ``fwd(**args, cfg)``, giving ``(out or (out, final_state), residuals)``, and
        ``bwd(residuals, d_out, **statics, cfg)``, giving the gradients; the backward runs
        with the forward's chunk.
    """

    def fwd(*, cfg: Any = None, **args: Any) -> tuple[Any, dict[str, Any]]:
        st = statics(args, cfg)
        out, final, res = forward({n: args.get(n) for n in array_names}, st)
        return ((out, final) if st.return_state else out), res

    def bwd(
        residuals: dict[str, Any], d_out: Any, *, cfg: Any = None, **static_args: Any
    ) -> dict[str, jax.Array | None]:
        lay: Layout = residuals["layout"]
        st = statics({**static_args, "query": residuals["q"], "value": residuals["v"]}, cfg)
        st = attrs.evolve(st, chunk=lay.chunk)
        d_o, d_final = d_out if st.return_state else (d_out, None)
        return backward(residuals, d_o, d_final, st)

    return fwd, bwd


def chunk_layout(a: dict[str, Any], chunk: int) -> tuple[Layout, jax.Array]:
    """The call's chunk layout (chunks of ``chunk``) and its initial states as kernel rows
    (zeros where it has none); ``a`` holds the op's arrays by name."""
    b, s, h, dk = a["query"].shape
    lay = Layout.of(s, chunk, a["cu_seqlens"])
    return lay, lay.state_rows(a["initial_state"], (b, h, dk, a["value"].shape[-1]))


def cotangents(
    res: dict[str, Any], d_o: jax.Array, d_final: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """The backward's cotangents on the chunk layout: the output's in chunks (the query
    dtype) and the final state's as kernel rows (zeros when ``None``)."""
    lay: Layout = res["layout"]
    q = res["q"]
    b, _, h, dk = q.shape
    do = lay.to_chunks(d_o.astype(q.dtype))
    return do, lay.state_rows(d_final, (b, h, dk, res["v"].shape[-1]))


def gradients(
    res: dict[str, Any],
    d_q: jax.Array,
    d_k: jax.Array,
    d_v: jax.Array,
    dinit_rows: jax.Array,
    dfinal_rows: jax.Array,
) -> dict[str, jax.Array | None]:
    """The query, key and value gradients back in the op's layout, and the initial state's
    (its own dtype) where the call has one."""
    lay: Layout = res["layout"]
    grads: dict[str, jax.Array | None] = {
        "query": lay.from_chunks(d_q),
        "key": lay.from_chunks(d_k),
        "value": lay.from_chunks(d_v),
    }
    dtypes = res["dtypes"]
    if "initial_state" in dtypes:
        d_init = lay.op_states(dinit_rows, dfinal_rows)
        grads["initial_state"] = d_init.astype(dtypes["initial_state"].dtype)
    return grads
