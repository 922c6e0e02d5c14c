"""state_space_v2 in Triton: Mamba-2 SSD, chunked, on kernels of its own, forward and backward.

SSD is linear attention with one scalar decay per head and token (Dao and Gu, "Transformers
are SSMs", ICML 2024, Sec. 6). Transposed, the state ``hᵀ [N, P]`` of head h is gla's state
with query ``C_t``, key ``B_t``, value ``u_t = Δ_t x_t``, the log gate ``Δ_t A_h`` (the same
for every key channel) and scale 1 (the mapping a decoding call runs gla's fused kernel on).

Forward: :mod:`ejkernel_triton.kernels.ssd_fwd`, in chunks of ``C`` tokens. In JAX
(:func:`_gates`): ``Δ = softplus(dt + dt_bias)`` (as asked) and the chunk-local cumulative
log decay ``G`` of ``Δ A`` (floored at gla's :data:`~ejkernel_triton.ops.gla.MIN_LOG_DECAY`:
``A = -inf`` is a state reset where ``Δ > 0``; ``Δ = 0`` passes the state through), both
``[B, T, H]`` float32 with ``T`` the padded length. Then two kernels read ``x``, the gate and
``B``/``C`` in place (head h reads its group's rows; no per-head copy, no padding): the state
walk ``hᵀ ← hᵀ exp(G_last) + (B ⊙ exp(G_last − G))ᵀ u`` over the chunks (grid N blocks x P
blocks x B·H), and per chunk and P block the output
``(exp(G) ⊙ (C hᵀ) + ((C Bᵀ) ⊙ exp(G_i − G_j))_{j ≤ i} u + D x) ⊙ silu(gate)`` (two dots over
N, one over the chunk; one exponential per token pair, none per state channel). The initial
and final states are read and written in the op's ``[B, H, P, N]`` layout.

Backward (the executor's custom VJP: :func:`_vjp_fwd`, :func:`_vjp_bwd`): the differentiated
forward runs the same kernels without the gate, applies it in JAX, and keeps the inputs, the
ungated ``y + D x`` and the chunk-start states ``hᵀ`` (``[B, H, NT, N, P]``, ``x``'s dtype).
The backward pulls the cotangent through the gate and the skip in JAX (the gate's and ``D``'s
gradients, ``dy``), runs :mod:`ejkernel_triton.kernels.ssd_bwd` (the reverse walk of the state
gradient, then per chunk ``dx`` with the shares of ``dΔ`` and of ``G``'s gradient over P
blocks, and ``dB``/``dC`` per head over N blocks), and ends in JAX: ``dt``'s, ``dt_bias``'s and
``A``'s gradients by autodiff of :func:`_gates` (the reverse cumulative sum within each chunk,
the floor's zero gradient, softplus), ``B``'s and ``C``'s summed over each group's heads.

Decoding: an undifferentiated call whose config says ``fused`` (gla's heuristic, for a few
tokens) runs gla's fused recurrent kernel on the same mapping.

Config: :class:`StateSpaceV2Config` (gla's tunables; the forward and backward kernels take the
same one: the chunk, ``block_k`` over ``N``, ``block_v`` over ``P``). The op's ``chunk_size``
wins over the config's, taken as the largest of gla's chunks (16, 32, 64) not above it (16
below 16). :func:`supports` declines an ``x`` dtype other than bf16/f16/f32 and ``N`` or ``P``
over 256. ``B``, ``C`` and ``Δ x`` enter the kernels in ``x``'s dtype; gates and states are
float32 (the chunk-start states and their gradients in ``x``'s dtype).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.plugins import defvjp
from ejkernel_triton import _launch
from ejkernel_triton._launch import BATCH, OTHER
from ejkernel_triton.ops import _chunked
from ejkernel_triton.ops import state_space_gla as ssm
from ejkernel_triton.ops.gla_config import GlaConfig

__all__ = [
    "StateSpaceV2Config",
    "config_space",
    "heuristic",
    "state_space_v2_triton",
    "supports",
]


@attrs.frozen(kw_only=True)
class StateSpaceV2Config(GlaConfig):
    """Tunables of the Triton SSD kernels, gla's fields (its fused kernel decodes): chunk
    size, blocks over ``N`` (gla's K) and ``P`` (gla's V), warps, stages."""


def _shapes(a: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    b, s, h, p = a["x"].shape
    return (b, s, h, a["B"].shape[-1]), (b, s, h, p)


def _as_linear(a: dict[str, Any], softplus: bool) -> dict[str, Any]:
    """gla's arrays: query ``C`` and key ``B`` per head [B, S, H, N] and value ``Δ x``
    [B, S, H, P] in ``x``'s dtype, the log gate ``Δ A`` broadcast over N [B, S, H, N] and the
    initial state ``h₀ᵀ`` [B, H, N, P], float32."""
    x = a["x"]
    dtype = x.dtype
    n = a["B"].shape[-1]
    heads = x.shape[2] // a["B"].shape[2]
    per_head = lambda v: jnp.repeat(v.astype(dtype), heads, axis=2)
    d = ssm.delta(a, softplus)
    gate = ssm.log_decay(d, a["A"])
    init = a["initial_state"]
    return {
        "query": per_head(a["C"]),
        "key": per_head(a["B"]),
        "value": (d[..., None] * x.astype(jnp.float32)).astype(dtype),
        "g": jnp.broadcast_to(gate[..., None], (*gate.shape, n)),
        "initial_state": None if init is None else _transpose(init.astype(jnp.float32)),
        "cu_seqlens": None,
    }


def _finish(y: jax.Array, a: dict[str, Any]) -> jax.Array:
    """``(y + D x) ⊙ silu(gate)`` in float32 (``D`` per head, broadcast over its channels)."""
    x = a["x"].astype(jnp.float32)
    out = y.astype(jnp.float32) + a["D"].astype(jnp.float32)[:, None] * x
    return ssm.silu_gate(out, a["gate"])


def _transpose(state: jax.Array) -> jax.Array:
    return jnp.swapaxes(state, -1, -2)


def _chunked_primal(a: dict[str, Any], softplus: bool, cfg: GlaConfig, return_state: bool) -> Any:
    """The undifferentiated chunked call on the SSD kernels (:func:`_forward`)."""
    st = _statics(a, cfg, return_state)
    out, final, _ = _forward(a, softplus, st)
    return (out, final) if return_state else out


def _statics(a: dict[str, Any], cfg: GlaConfig, return_state: bool) -> _chunked.Statics:
    """The launches' statics: the config's chunk and warps, its blocks over ``N`` and ``P``."""
    x, n = a["x"], a["B"].shape[-1]
    bk, bv = cfg.blocks(n, x.shape[-1])
    args = {"query": x, "softmax_scale": 1.0, "return_state": return_state}
    return _chunked.Statics(block_k=bk, block_v=bv, **_chunked.call_statics(args, cfg))


MAPPING = ssm.Mapping(
    shapes=_shapes,
    as_linear=_as_linear,
    finish=_finish,
    state=_transpose,
    chunked_primal=_chunked_primal,
)


def supports(inv: Any) -> bool | str:
    """True, or why not: an ``x`` dtype other than bf16/f16/f32, ``N`` or ``P`` over 256."""
    return ssm.supports(inv, MAPPING)


def heuristic(inv: Any) -> StateSpaceV2Config:
    """gla's heuristic at the equivalent shape (K = N, V = P); the op's ``chunk_size``, when
    given, sets the chunk."""
    return ssm.heuristic(inv, MAPPING, StateSpaceV2Config)


def config_space(inv: Any) -> list[StateSpaceV2Config]:
    """The heuristic, then gla's config space at the equivalent shape."""
    return ssm.config_space(inv, MAPPING, StateSpaceV2Config)


def state_space_v2_triton(*, cfg: StateSpaceV2Config | None = None, **args: Any) -> Any:
    """Mamba-2 SSD through the Triton SSD kernels (gla's fused kernel when decoding).

    Args:
        **args: the arguments of :func:`ejkernel.specs.state_space_v2.state_space_v2`, by
            name, as the core spec validated them.
        cfg: the kernels' tunables; ``None`` takes the heuristic's.

    Returns:
        out [B, S, H, P] in the dtype of ``x``, or ``(out, final_state [B, H, P, N] float32)``
        when ``return_state``.
    """
    return ssm.primal(MAPPING, StateSpaceV2Config, cfg, args)


def _vjp_fwd(*, cfg: StateSpaceV2Config | None = None, **args: Any) -> tuple[Any, Any]:
    """The differentiated call's forward: the SSD kernels, with the output before the gate
    and the chunk-start states kept for :func:`_vjp_bwd`."""
    a = {n: args.get(n) for n in ssm.ARRAYS}
    rs = bool(args.get("return_state"))
    st = _statics(a, ssm.resolved_config(cfg, {**args, **a}, MAPPING, StateSpaceV2Config), rs)
    out, final, res = _forward_for_vjp(a, bool(args.get("dt_softplus")), st)
    return ((out, final) if rs else out), res


def _vjp_bwd(
    residuals: dict[str, Any],
    d_out: Any,
    *,
    cfg: StateSpaceV2Config | None = None,
    **statics: Any,
) -> dict[str, jax.Array | None]:
    """The gradient of every given array, in its dtype (``None`` for absent ones)."""
    a = residuals["arrays"]
    rs = bool(statics.get("return_state"))
    st = _statics(a, ssm.resolved_config(cfg, {**statics, **a}, MAPPING, StateSpaceV2Config), rs)
    d_o, d_final = d_out if rs else (d_out, None)
    return _backward(residuals, d_o, d_final, bool(statics.get("dt_softplus")), st)


defvjp(state_space_v2_triton, _vjp_fwd, _vjp_bwd)


# -- forward and backward on the SSD kernels ------------------------------------------------


def _gates(t: dict[str, Any], softplus: bool, chunk: int) -> tuple[jax.Array, jax.Array]:
    """``Δ`` and the chunk-local cumulative log decay ``G`` (``[B, T, H]`` float32, zero past
    ``S``) from ``dt``, ``dt_bias`` and ``A`` (``t``, by name)."""
    d = ssm.delta(t, softplus)
    g = ssm.log_decay(d, t["A"])
    b, s, h = d.shape
    nt = -(-s // chunk)
    pad = ((0, 0), (0, nt * chunk - s), (0, 0))
    g = jnp.cumsum(jnp.pad(g, pad).reshape(b, nt, chunk, h), axis=2).reshape(b, nt * chunk, h)
    return jnp.pad(d, pad), g


@functools.partial(jax.jit, static_argnames=("softplus", "st", "gated"))
def _forward(
    a: dict[str, Any], softplus: bool, st: _chunked.Statics, gated: bool = True
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(out [B, S, H, P] in x's dtype, final_state [B, H, P, N] float32, hᵀ)``: :func:`_gates`
    in JAX, then the state walk and the output kernels of
    :mod:`ejkernel_triton.kernels.ssd_fwd`; ``hᵀ`` the chunk-start states ``[B, H, NT, N, P]``
    (``x``'s dtype). Not ``gated``: ``out`` is ``y + D x``, before the gate."""
    x = a["x"]
    b, s, h, p = x.shape
    nt = -(-s // st.chunk)
    d, g = _gates(a, softplus, st.chunk)
    n = a["B"].shape[-1]
    init = a["initial_state"]
    init = jnp.zeros((b, h, p, n), jnp.float32) if init is None else init.astype(jnp.float32)
    gate = a["gate"] if gated else None
    z = x if gate is None else gate  # x stands in: the kernel reads no gate
    bc = (a["B"].astype(x.dtype), a["C"].astype(x.dtype))
    run = _launch.fold_vmap(_forward_kernels(st, nt, gate is not None), (BATCH,) * 7 + (OTHER,))
    return run(x, z, *bc, d, g, init, a["D"].astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("softplus", "st"))
def _forward_for_vjp(
    a: dict[str, Any], softplus: bool, st: _chunked.Statics
) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
    """``(out, final_state, residuals)``: the SSD kernels without the gate, which JAX applies
    to their ``y + D x``; the residuals are the array inputs, ``y + D x`` (``pre``, ``x``'s
    dtype) and the chunk-start states ``hᵀ``."""
    pre, final, hs = _forward(a, softplus, st, gated=False)
    out = pre if a["gate"] is None else ssm.silu_gate(pre, a["gate"]).astype(pre.dtype)
    return out, final, {"arrays": a, "pre": pre, "h": hs}


@functools.partial(jax.jit, static_argnames=("softplus", "st"))
def _backward(
    res: dict[str, Any],
    d_o: jax.Array,
    d_final: jax.Array | None,
    softplus: bool,
    st: _chunked.Statics,
) -> dict[str, jax.Array | None]:
    """Every gradient: the gate's, ``D``'s and ``dy`` (the cotangent of ``y``) through
    ``(y + D x) ⊙ silu(gate)`` in JAX; the kernels of :mod:`ejkernel_triton.kernels.ssd_bwd`;
    then ``dt``'s, ``dt_bias``'s and ``A``'s through :func:`_gates` (JAX autodiff, from the
    kernels' ``dΔ`` and ``dG``) and the group sums of the per-head ``dB`` and ``dC``."""
    a = res["arrays"]
    x = a["x"]
    b, s, h, p = x.shape
    ng, n = a["B"].shape[2], a["B"].shape[3]
    nt = -(-s // st.chunk)
    assert res["h"].shape[2] == nt, "the backward runs with the forward's chunk"
    pre = res["pre"].astype(jnp.float32)
    d_o = d_o.astype(jnp.float32)
    if a["gate"] is None:
        d_pre, d_gate = d_o, None
    else:
        _, pull_gate = jax.vjp(ssm.silu_gate, pre, a["gate"])
        d_pre, d_gate = pull_gate(d_o)
    d_skip = jnp.sum(d_pre * x.astype(jnp.float32), axis=(0, 1, 3))
    timed = {k: a[k] for k in ("dt", "dt_bias", "A")}
    (d, g), pull_gates = jax.vjp(lambda t: _gates(t, softplus, st.chunk), timed)
    d_final = (
        jnp.zeros((b, h, p, n), jnp.float32) if d_final is None else d_final.astype(jnp.float32)
    )
    bc = (a["B"].astype(x.dtype), a["C"].astype(x.dtype))
    run = _launch.fold_vmap(_backward_kernels(st, nt), (BATCH,) * 8 + (OTHER,))
    dx, ddt, dg, db, dc, d_init = run(
        x, *bc, d_pre.astype(x.dtype), d, g, res["h"], d_final, a["D"].astype(jnp.float32)
    )
    (d_timed,) = pull_gates((jnp.sum(ddt, axis=1), jnp.sum(dg, axis=1)))
    per_group = lambda v: jnp.sum(v.reshape(b, s, ng, h // ng, n), axis=3, dtype=jnp.float32)
    grads = {
        **d_timed,
        "x": dx,
        "B": per_group(db),
        "C": per_group(dc),
        "D": d_skip,
        "gate": d_gate,
        "initial_state": d_init,
    }
    return {k: None if a[k] is None else grads[k].astype(a[k].dtype) for k in ssm.ARRAYS}


def _forward_kernels(st: _chunked.Statics, nt: int, has_gate: bool) -> Any:
    """``run(x, z, B, C, Δ, G, init, D) -> (out, final_state, hᵀ)``: the two launches."""
    from ejkernel_triton.kernels.ssd_fwd import ssd_fwd_h_kernel, ssd_fwd_o_kernel

    def run(x, z, b_, c_, d, g, init, skip):
        b, s, h, p = x.shape
        ng, n = b_.shape[2], b_.shape[3]
        sizes = (s, nt, h, ng)
        hs, final = _state_walk(st, ssd_fwd_h_kernel, (x, b_, d, g, init), sizes, x, n)
        (out,) = _launch.launch(
            ssd_fwd_o_kernel,
            *(x, z, b_, c_, d, g, hs, skip),
            *sizes,
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype)],
            grid=(_cdiv(p, st.block_v), nt, b * h),
            HAS_GATE=has_gate,
            **_common(st, n, p),
        )
        return out, final, hs

    return run


def _backward_kernels(st: _chunked.Statics, nt: int) -> Any:
    """``run(x, B, C, dy, Δ, G, hᵀ, d_final, D) -> (dx, dΔ shares, dG shares, dB per head,
    dC per head, d_init)``: the three launches."""
    from ejkernel_triton.kernels.ssd_bwd import (
        ssd_bwd_dbc_kernel,
        ssd_bwd_dh_kernel,
        ssd_bwd_dx_kernel,
    )

    def run(x, b_, c_, dy, d, g, hs, d_final, skip):
        b, s, h, p = x.shape
        ng, n = b_.shape[2], b_.shape[3]
        sizes = (s, nt, h, ng)
        common = _common(st, n, p)
        dh, d_init = _state_walk(st, ssd_bwd_dh_kernel, (c_, dy, g, d_final), sizes, x, n)
        reads = (x, b_, c_, d, g, hs, dh, dy)  # what both per-chunk kernels read
        shares = jax.ShapeDtypeStruct((b, _cdiv(p, st.block_v), nt * st.chunk, h), jnp.float32)
        dx, ddt, dg = _launch.launch(
            ssd_bwd_dx_kernel,
            *reads,
            skip,
            *sizes,
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), shares, shares],
            grid=(_cdiv(p, st.block_v), nt, b * h),
            **common,
        )
        per_head = jax.ShapeDtypeStruct((b, s, h, n), x.dtype)
        db, dc = _launch.launch(
            ssd_bwd_dbc_kernel,
            *reads,
            *sizes,
            out_shape=[per_head, per_head],
            grid=(_cdiv(n, st.block_k), nt, b * h),
            **common,
        )
        return dx, ddt, dg, db, dc, d_init

    return run


def _state_walk(
    st: _chunked.Statics,
    kernel: Any,
    reads: tuple[jax.Array, ...],
    sizes: tuple[int, ...],
    x: jax.Array,
    n: int,
) -> list[jax.Array]:
    """One launch of a state walk (``ssd_fwd_h`` or ``ssd_bwd_dh``), a program per (N block,
    P block, batch row, head): it reads ``reads``, then ``sizes`` (S, NT, H, G), and writes
    per-chunk states ``[B, H, NT, N, P]`` in ``x``'s dtype and one ``[B, H, P, N]`` float32
    state."""
    b, _, h, p = x.shape
    return _launch.launch(
        kernel,
        *reads,
        *sizes,
        out_shape=[
            jax.ShapeDtypeStruct((b, h, sizes[1], n, p), x.dtype),
            jax.ShapeDtypeStruct((b, h, p, n), jnp.float32),
        ],
        grid=(_cdiv(n, st.block_k), _cdiv(p, st.block_v), b * h),
        **_common(st, n, p),
    )


def _common(st: _chunked.Statics, n: int, p: int) -> dict[str, Any]:
    """The constexprs and launch options every SSD kernel takes."""
    return {
        "N": n,
        "P": p,
        "C": st.chunk,
        "BK": st.block_k,
        "BV": st.block_v,
        "DOT_PRECISION": st.precision,
        "num_warps": st.num_warps,
        "num_stages": st.num_stages,
    }


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
