"""gla in Triton: chunked gated linear attention (Yang et al., 2024, Sec. 4), forward and
backward through the executor's custom VJP.

Per chunk of ``C`` tokens (:class:`~ejkernel_triton.ops.gla_config.GlaConfig`), with ``G`` the
float32 cumulative log gate from the chunk start and ``h`` the float32 state at the chunk start:
``o = scale · (q ⊙ exp(G)) h + A v`` with the intra-chunk matrix
``A[i, j] = scale · Σ_k q_ik k_jk exp(G_ik − G_jk)`` (j ≤ i), and
``h ← h · exp(G_last) + (k ⊙ exp(G_last − G))ᵀ v`` across chunks. The layout (padding to whole
chunks; packed sequences chunk-aligned, so ``cu_seqlens`` may be traced and the state restarts
at each sequence) is :mod:`ejkernel_triton.ops.gla_layout`; the kernels are
:mod:`ejkernel_triton.kernels.gla_fwd` and :mod:`ejkernel_triton.kernels.gla_bwd`.

Forward (4 kernels): the chunk-local cumulative gates ``G``; chunk-start states and final
states; ``A``; the output. The custom-VJP forward keeps ``G``, the chunk-start states and ``A``
for the backward.

Backward (5 kernels): ``dh``, the gradient of each chunk's end state, walked from the last chunk
(starting from the final state's cotangent; what reaches a sequence's start is the initial
state's gradient); ``dA = scale · do vᵀ`` (lower triangle); ``dv = Aᵀ do + (k ⊙ exp(G_last −
G)) dh``; the intra-chunk ``dq``, ``dk`` from ``dA`` (sub-chunk split as in the forward's
``A``); then the inter-chunk ``dq = scale · exp(G) ⊙ do hᵀ`` and ``dk = exp(G_last − G) ⊙
v dhᵀ`` added, and the in-chunk reverse cumsum of ``q ⊙ dq − k ⊙ dk``.

The gate gradient: with ``Γ`` the cumulative log gate of the whole sequence, every output
depends on the gates only through ``q ⊙ exp(Γ)``, ``k ⊙ exp(−Γ)`` and the final state's
``exp(Γ_last)``, so ``∂/∂Γ_t = q_t ⊙ dq_t − k_t ⊙ dk_t`` (plus ``Σ_v h_T ⊙ dh_T`` at the last
token), and the gate gradient is its reverse cumulative sum within each sequence: inside the
chunk, the kernel's cumsum; what the sequence's later tokens and its final state add is the
gradient through the chunk's end state, ``Σ_v h_end ⊙ dh_end`` (from the ``dh`` kernel), exact
and free of long cancelling sums (flash-linear-attention's ``chunk_gla`` does the same).

Every OPS.md argument of gla is served (``softmax_scale``, ``initial_state`` with its gradient,
``return_state``, ``cu_seqlens`` with empty and length-1 sequences, any S). :func:`supports`
declines dtypes other than bf16/f16/f32, mixed q/k/v dtypes and K or V over 256. Gates are
log decays: where a chunk's gates grow (g > 0) the exps are of positive sums, as in the
recurrence itself. A gate of −inf is a state reset, as in the recurrence (gates are clamped at
:data:`MIN_LOG_DECAY`, whose exp is already 0 in float32); a NaN input stays in its causal
future in the output (the gradients of a call with NaN inputs are not held to that).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.plugins import defvjp
from ejkernel_triton import _launch
from ejkernel_triton.ops import _chunked, _on_gla
from ejkernel_triton.ops.gla_config import (
    GlaConfig,
    config_space,
    heuristic,
    supports,
)
from ejkernel_triton.ops.gla_layout import Layout
from ejkernel_triton.ops.recurrent_fused import fused_forward

__all__ = [
    "MIN_LOG_DECAY",
    "GlaConfig",
    "config_space",
    "fused_gla",
    "gla_triton",
    "heuristic",
    "supports",
]

#: Gates are clamped from below here: ``exp(-200)`` is 0 in float32, so the recurrence is the
#: same (a gate of −inf still zeroes the state: a reset), while cumulative sums stay finite
#: (with −inf, every later difference inside the chunk would be NaN).
MIN_LOG_DECAY = -200.0

_ARRAY_NAMES = ("query", "key", "value", "g", "initial_state", "cu_seqlens")


# -- the op ---------------------------------------------------------------------------------


def gla_triton(*, cfg: GlaConfig | None = None, **args: Any) -> Any:
    """Gated linear attention through the Triton kernels.

    Args:
        **args: the arguments of :func:`ejkernel.specs.gla.gla`, by name, as the core spec
            validated them.
        cfg: chunk size, blocks, warps and stages; ``None`` takes the heuristic's.

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state [N, H, K, V] float32)``
        when ``return_state``.
    """
    cfg = _on_gla.config(cfg, args)
    if cfg.fused:
        return fused_gla(args, cfg, args["g"])
    return _gla_fwd(cfg=cfg, **args)[0]


def fused_gla(args: dict[str, Any], cfg: GlaConfig, g: jax.Array) -> Any:
    """The call's forward through the fused recurrent kernel with the key gate ``g``
    ``[B, S, H, K]`` (the other arguments gla's, by name, in ``args``)."""
    return fused_forward(
        args["query"],
        args["key"],
        args["value"],
        g,
        initial_state=args.get("initial_state"),
        cu_seqlens=args.get("cu_seqlens"),
        scale=_chunked.softmax_scale(args),
        block_v=cfg.block_v,
        num_warps=cfg.num_warps,
        return_state=bool(args.get("return_state")),
    )


@attrs.frozen(kw_only=True)
class _Statics(_chunked.Statics):
    """The call's static facts and the config, resolved for the launches."""

    @classmethod
    def of(cls, args: dict[str, Any], cfg: GlaConfig | None) -> _Statics:
        cfg = _on_gla.config(cfg, args)
        bk, bv = cfg.blocks(args["query"].shape[-1], args["value"].shape[-1])
        return cls(block_k=bk, block_v=bv, **_chunked.call_statics(args, cfg))


# -- forward --------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("st",))
def _forward(a: dict[str, Any], st: _Statics) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
    init = a["initial_state"]
    lay, init_rows = _chunked.chunk_layout(a, st.chunk)
    q, k, v, gates = (lay.to_chunks(a[n]) for n in ("query", "key", "value", "g"))
    run = _launch.fold_vmap(_forward_kernels(st, lay.num_chunks), lay.fold_modes(6))
    g, hs, final_rows, amat, o = run(q, k, v, gates, init_rows, lay.flags)
    out = lay.from_chunks(o)
    final = lay.op_states(final_rows, init_rows)
    res = {
        "layout": lay,
        "q": q,
        "k": k,
        "v": v,
        "g": g,
        "h": hs,
        "a": amat,
        "final_rows": final_rows,
    }
    res["dtypes"] = {"g": jnp.zeros((0,), a["g"].dtype)}  # the gradients' dtypes
    if init is not None:  # the key's presence says the initial state has a gradient
        res["dtypes"]["initial_state"] = jnp.zeros((0,), init.dtype)
    return out, final, res


def _forward_kernels(st: _Statics, nt: int) -> Any:
    """``run(q, k, v, gates, init_rows, flags) -> (G, h, final_rows, A, o)``: the forward's
    launches on the chunk layout."""
    from ejkernel_triton.kernels.gla_fwd import (
        gla_fwd_a_kernel,
        gla_fwd_cumsum_kernel,
        gla_fwd_h_kernel,
        gla_fwd_o_kernel,
    )

    def run(q, k, v, gates, init_rows, flags):
        b, t, h, dk = q.shape
        dv = v.shape[-1]
        c = st.chunk
        (g,) = _launch.launch(
            gla_fwd_cumsum_kernel,
            gates,
            nt,
            h,
            out_shape=[jax.ShapeDtypeStruct((b, t, h, dk), jnp.float32)],
            grid=(_cdiv(dk, st.block_k), nt, b * h),
            K=dk,
            C=c,
            BK=st.block_k,
            MIN_LOG_DECAY=MIN_LOG_DECAY,
            num_warps=st.num_warps,
            num_stages=1,
        )
        walk = (k, v, g, init_rows, flags)
        hs, final_rows = _state_walk(st, gla_fwd_h_kernel, walk, init_rows, q, nt, dv)
        (amat,) = _launch.launch(
            gla_fwd_a_kernel,
            q,
            k,
            g,
            np.float32(st.scale),
            nt,
            h,
            out_shape=[jax.ShapeDtypeStruct((b, t, h, c), jnp.float32)],
            grid=(nt, b * h),
            K=dk,
            C=c,
            BK=st.block_k,
            **_common(st),
        )
        (o,) = _launch.launch(
            gla_fwd_o_kernel,
            q,
            v,
            g,
            hs,
            amat,
            np.float32(st.scale),
            nt,
            h,
            out_shape=[jax.ShapeDtypeStruct((b, t, h, dv), q.dtype)],
            grid=(_cdiv(dv, st.block_v), nt, b * h),
            **_tiles(st, dk, dv),
        )
        return g, hs, final_rows, amat, o

    return run


def _common(st: _Statics) -> dict[str, Any]:
    return {
        "num_warps": st.num_warps,
        "num_stages": st.num_stages,
        "DOT_PRECISION": st.precision,
    }


def _tiles(st: _Statics, dk: int, dv: int) -> dict[str, Any]:
    """:func:`_common` and the chunk tiling of a launch over both K and V: the head sizes
    ``K``/``V``, the chunk ``C`` and the ``BK``/``BV`` blocks."""
    return {"K": dk, "V": dv, "C": st.chunk, "BK": st.block_k, "BV": st.block_v, **_common(st)}


def _state_walk(
    st: _Statics,
    kernel: Any,
    args: tuple[Any, ...],
    rows: jax.Array,
    q: jax.Array,
    nt: int,
    dv: int,
    extra_out: tuple[jax.ShapeDtypeStruct, ...] = (),
) -> list[jax.Array]:
    """Launch a walk of the state over the chunks (``gla_fwd_h`` or ``gla_bwd_dh``).

    One program per (K block, V block, batch·head) takes ``args``, then the chunk count, the
    heads and the sequences per batch row (``rows``: the float32 per-sequence states the walk
    starts from, one row per sequence). The outputs are the per-chunk states
    ``[B, H, NT, K, V]`` in the query dtype, the per-sequence states it ends with (shaped as
    ``rows``), then ``extra_out``.
    """
    b, _, h, dk = q.shape
    return _launch.launch(
        kernel,
        *args,
        nt,
        h,
        rows.shape[0] // b,
        out_shape=[
            jax.ShapeDtypeStruct((b, h, nt, dk, dv), q.dtype),
            jax.ShapeDtypeStruct(rows.shape, jnp.float32),
            *extra_out,
        ],
        grid=(_cdiv(dk, st.block_k), _cdiv(dv, st.block_v), b * h),
        **_tiles(st, dk, dv),
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- backward -------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("st",))
def _backward(
    res: dict[str, Any], d_o: jax.Array, d_final: jax.Array | None, st: _Statics
) -> dict[str, jax.Array | None]:
    """The gradients."""
    lay: Layout = res["layout"]
    q = res["q"]
    b, _, h, dk = q.shape
    do, dfinal_rows = _chunked.cotangents(res, d_o, d_final)
    kernels = _backward_kernels(st, lay.num_chunks)
    run = _launch.fold_vmap(kernels, lay.fold_modes(10))
    dinit_rows, d_q, d_k, d_v, d_gamma, d_end = run(
        q,
        res["k"],
        res["v"],
        res["g"],
        res["h"],
        res["a"],
        res["final_rows"],
        do,
        dfinal_rows,
        lay.flags,
    )
    # in-chunk reverse cumsums, plus what reaches each chunk through its end state
    through_end = jnp.sum(d_end, axis=3).transpose(0, 2, 1, 3)  # [B, NT, H, K]
    d_g = (d_gamma.reshape(b, lay.num_chunks, lay.chunk, h, dk) + through_end[:, :, None]).reshape(
        d_gamma.shape
    )
    grads = _chunked.gradients(res, d_q, d_k, d_v, dinit_rows, dfinal_rows)
    grads["g"] = lay.from_chunks(d_g).astype(res["dtypes"]["g"].dtype)
    return grads


#: Forward ``(out or (out, final_state), residuals)`` and backward (gradients of query, key,
#: value, g and initial_state) of the custom VJP.
_gla_fwd, _gla_bwd = _chunked.vjp_rules(_Statics.of, _forward, _backward, _ARRAY_NAMES)
defvjp(gla_triton, _gla_fwd, _gla_bwd)


def _backward_kernels(st: _Statics, nt: int) -> Any:
    """``run(q, k, v, g, h, A, final_rows, do, dfinal_rows, flags) -> (dinit_rows, dq, dk, dv,
    d_gamma, d_end)`` (``d_gamma``: the in-chunk reverse cumsum of ``q ⊙ dq − k ⊙ dk``;
    ``d_end [B, H, NT, NV, K]``: ``Σ_v h_end ⊙ dh`` per V block): the backward's launches on
    the chunk layout."""
    from ejkernel_triton.kernels.gla_bwd import (
        gla_bwd_da_kernel,
        gla_bwd_dh_kernel,
        gla_bwd_dqk_kernel,
        gla_bwd_dv_kernel,
        gla_bwd_intra_kernel,
    )

    def run(q, k, v, g, hs, amat, final_rows, do, dfinal_rows, flags):
        b, t, h, dk = q.shape
        dv = v.shape[-1]
        c = st.chunk
        common = _common(st)
        tiles = _tiles(st, dk, dv)
        scale = np.float32(st.scale)
        tokens = jax.ShapeDtypeStruct((b, t, h, dk), jnp.float32)
        nv = _cdiv(dv, st.block_v)
        walk = (q, g, do, hs, final_rows, dfinal_rows, flags, scale)
        d_end_shape = jax.ShapeDtypeStruct((b, h, nt, nv, dk), jnp.float32)
        dh, dinit_rows, d_end = _state_walk(
            st, gla_bwd_dh_kernel, walk, dfinal_rows, q, nt, dv, (d_end_shape,)
        )
        (da,) = _launch.launch(
            gla_bwd_da_kernel,
            v,
            do,
            scale,
            nt,
            h,
            out_shape=[jax.ShapeDtypeStruct((b, t, h, c), jnp.float32)],
            grid=(nt, b * h),
            V=dv,
            C=c,
            BV=st.block_v,
            **common,
        )
        (d_v,) = _launch.launch(
            gla_bwd_dv_kernel,
            k,
            g,
            amat,
            do,
            dh,
            nt,
            h,
            out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype)],
            grid=(_cdiv(dv, st.block_v), nt, b * h),
            **tiles,
        )
        dq_intra, dk_intra = _launch.launch(
            gla_bwd_intra_kernel,
            q,
            k,
            g,
            da,
            nt,
            h,
            out_shape=[tokens, tokens],
            grid=(nt, _cdiv(dk, st.block_k), b * h),
            K=dk,
            C=c,
            BK=st.block_k,
            **common,
        )
        d_q, d_k, d_gamma = _launch.launch(
            gla_bwd_dqk_kernel,
            q,
            k,
            v,
            g,
            hs,
            dh,
            do,
            dq_intra,
            dk_intra,
            scale,
            nt,
            h,
            out_shape=[
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct(k.shape, k.dtype),
                tokens,
            ],
            grid=(_cdiv(dk, st.block_k), nt, b * h),
            **tiles,
        )
        return dinit_rows, d_q, d_k, d_v, d_gamma, d_end

    return run
