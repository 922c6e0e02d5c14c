"""kernel_delta_attention in Triton: the chunked gated delta rule (Kimi Delta Attention; a
scalar gate is Gated DeltaNet) in the WY/UT form.

Per chunk of ``C`` tokens (:class:`KernelDeltaAttentionConfig`), with ``G`` the float32
cumulative log gate from the chunk start and ``S`` the float32 state at the chunk start:
``T = (I + A)⁻¹`` with ``A_tj = β_t Σ_κ k_tκ k_jκ exp(G_tκ − G_jκ)`` (``j < t``),
``W = T diag(β) (K ⊙ exp(G))``, ``U = T diag(β) V``; then ``V' = U − W S``,
``o = (q ⊙ exp(G)) S + P V'`` with ``P_tj = Σ_κ q_tκ k_jκ exp(G_tκ − G_jκ)`` (``j ≤ t``), and
``S ← diag(exp(G_C)) S + (K ⊙ exp(G_C − G))ᵀ V'``. The kernels are
:mod:`ejkernel_triton.kernels.kda_fwd` (the state-independent work per chunk, which also fuses
the L2 norm of q and k: one kernel for a per-head gate, three for a per-channel gate, whose
decayed products run in ``[16, 16]`` tiles; one sequential kernel per state block that carries
only the state; one output kernel per chunk, which reads each chunk's starting state from memory:
``[B, H, T / C, K, V]`` in the input dtype, ``K V / C`` entries a token and head, twice the
query's size at K = V = 128, C = 64); the layout (padding to
whole chunks; packed sequences chunk-aligned, so ``cu_seqlens`` may be traced) is gla's,
:mod:`ejkernel_triton.ops.gla_layout`.

An undifferentiated call with a ``fused`` config (the heuristic's for a few tokens, decoding)
runs :mod:`ejkernel_triton.kernels.kda_fused` instead: the recurrence token by token with the
state in registers.

Every OPS.md argument is served: both gate forms, ``use_qk_l2norm``, ``beta``,
``softmax_scale``, ``initial_state``, ``return_state``, ``cu_seqlens`` (empty and length-1
sequences), any S. Numerics as the XLA path's (``ejkernel_xla.ops._chunk_numerics``): gates
floored at ``-GATE_FLOOR`` (``-inf`` is a reset, finite sums), relative decays inside a chunk
only (exps of differences ≤ 0 for decaying gates), a non-finite input stays in its causal
future.

The backward is Triton too (:mod:`ejkernel_triton.kernels.kda_bwd`): the differentiated
forward keeps the chunk factors, each chunk's starting state ``[B, H, NT, K, V]`` and ``V'``
(float32); one reverse walk per V block carries the state's gradient, then per-chunk kernels
recompute the chunk algebra and pull the cotangents back to query, key, value, beta, the gates
and the initial state. :func:`supports` declines dtypes other than bf16/f16/f32, mixed q/k/v
dtypes and K or V over 256 (the per-chunk kernels hold whole K and V rows).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.plugins import defvjp
from ejkernel_triton import _launch, _smem
from ejkernel_triton._launch import pow2
from ejkernel_triton.ops import _chunked
from ejkernel_triton.ops.gla_config import kernel_limits
from ejkernel_triton.ops.gla_layout import Layout
from ejkernel_triton.ops.recurrent_fused import fused_launch, fused_states

__all__ = [
    "GATE_FLOOR",
    "KernelDeltaAttentionConfig",
    "config_space",
    "heuristic",
    "kernel_delta_attention_triton",
    "shared_memory",
    "supports",
]

#: Log gates below ``-GATE_FLOOR`` (-inf included) are taken as ``-GATE_FLOOR``, whose exp
#: is 0 in float32 (a reset either way) while the chunk's cumulative sums stay finite and
#: keep their digits (the XLA path's floor).
GATE_FLOOR = 110.0

_CHUNKS = (16, 32, 64)
#: The longest call (tokens per row, or in all when packed) the heuristic gives the fused
#: recurrent kernel in the interpreter, and on a GPU: the fused kernel's time grows with each
#: token, the chunked launches' hardly up to a chunk, and they cross near 8 tokens
#: (benchmarks/RESULTS.md, ``bench_linear_gpu.py --decode``).
FUSED_MAX_TOKENS = 16
FUSED_GPU_MAX_TOKENS = 8
#: Key channels a step of a per-channel gate's decayed products takes: the forward's
#: (``_ROW_CHANNELS``) and the VJP's (``_PRODUCT_CHANNELS``).
_ROW_CHANNELS = 64
_PRODUCT_CHANNELS = 64
#: Warps of a program of the backward's decayed products (one ``[16, 16]`` tile of them).
_TILE_WARPS = 2
#: Warps of a program of the forward's decayed products (one block of 16 rows, its tiles in
#: turn): one, so that more of these short programs are resident (benchmarks/RESULTS.md).
_ROW_WARPS = 1
_ARRAY_NAMES = ("query", "key", "value", "beta", "g", "initial_state", "cu_seqlens")


def _power_of_two(config: Any, attribute: Any, value: int) -> None:
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(
            f"KernelDeltaAttentionConfig.{attribute.name} must be a power of two ≥ 16; got {value}"
        )


@attrs.frozen(kw_only=True)
class KernelDeltaAttentionConfig:
    """Tunables of the Triton gated delta rule.

    Attributes:
        chunk_size: tokens per chunk, 16, 32 or 64 (the sequential walk has ``T / C`` steps;
            the per-chunk kernel holds ``[C, K]``, ``[C, V]`` and ``[C, C]`` float32 tiles).
        block_v: value-dim block of the sequential kernel (its state tile is ``[K, block_v]``
            float32; a power of two ≥ 16, clamped to V rounded up to one).
        num_warps: warps per program.
        num_stages: software-pipelining stages.
        chunk_warps: warps of the passes that hold a whole chunk's ``[C, K]`` tiles in one
            program (the forward's normalisation and factor kernels, the backward's value and
            chunk kernels); ``None``: ``num_warps``. At chunks of 64 with K = 128, 4 warps
            spill those kernels' registers where 8 do not, while the sequential walks and
            the output kernel of a forward alone do better with 4.
        fused: run an undifferentiated call through the fused recurrent kernel (one token at
            a time, :mod:`ejkernel_triton.kernels.kda_fused`; for decoding a few tokens), with
            ``block_v`` its value block; a differentiated call always runs the chunked kernels.
        narrow_products: the forward's per-chunk products (``W`` and ``U`` from ``T``, the
            decayed ``P`` and ``K Kᵀ`` (a per-channel gate's below its diagonal blocks, from
            normalised q and k written in the inputs' dtype), the outputs' ``P V'``) take
            operands in the inputs' 16-bit dtype (the tensor cores' bf16 rate) instead of
            float32 (tf32); the inverse ``T``, the gates and the state stay float32. No
            effect on float32 inputs.
        narrow_states: a differentiated call keeps each chunk's starting state, ``V'`` and
            the state gradients the backward reads (``[B, H, T / C, K, V]`` each) in the
            inputs' 16-bit dtype instead of float32: half the backward's largest memory
            traffic; the walks carry their states in float32 either way. No effect on float32
            inputs or on a forward alone (which keeps them in the inputs' dtype).
    """

    chunk_size: int = attrs.field(default=32, validator=attrs.validators.in_(_CHUNKS))
    block_v: int = attrs.field(default=64, validator=_power_of_two)
    num_warps: int = 4
    num_stages: int = 1
    chunk_warps: int | None = None
    fused: bool = False
    narrow_products: bool = False
    narrow_states: bool = False


def supports(inv: Any) -> bool | str:
    """True, or why not: dtypes other than bf16/f16/f32, mixed dtypes, K or V over 256."""
    return kernel_limits(inv.kwargs, ("query", "key", "value", "beta", "g"))


def shared_memory(cfg: KernelDeltaAttentionConfig, dk: int, dv: int) -> int:
    """Bytes of shared memory the launches of ``cfg`` need at most (K = ``dk``, V = ``dv``):
    the largest of the per-chunk forward (``[C, K]`` and ``[C, V]`` operand tiles), the
    sequential walks (the ``[K, BV]`` state and ``[C, BV]`` tiles), the backward's V pass
    (``[C, K]`` and its streamed ``[C, BV]`` tiles) and its chunk pass (``[C, K]`` and
    ``[C, C]`` tiles), all float32, the walks' streamed tiles once more a pipelining stage.
    An upper bound of what Triton 3.6 allocates for sm_90, which
    ``tests/triton/test_kernel_delta_attention.py`` holds it to."""
    c, bk, vp = cfg.chunk_size, pow2(dk), pow2(dv)
    bv = min(cfg.block_v, vp)
    walk_stage = 3 * c * bk // 2 + c * bv  # a walk step's streamed tiles, once a stage
    return 4 * max(
        2 * c * (bk + vp),
        2 * bk * bv + 2 * c * bv + (cfg.num_stages - 1) * walk_stage,
        c * bk + 8 * c * bv,
        4 * c * bk + c * c,
    )


def heuristic(inv: Any) -> KernelDeltaAttentionConfig:
    """Chunks of 64 with 32-wide V blocks, 2 stages in the sequential walks where shared
    memory holds them (the backward's reverse walk has ``T / C`` sequential steps, so longer
    chunks pay off most there), 4 warps, but 8 in the whole-chunk passes of a call being
    differentiated at chunks of 64 (``chunk_warps``: the backward's spill registers in 4; a
    forward's alone do not gain from 8),
    a forward alone on 16-bit inputs with ``narrow_products`` (either gate form), a
    differentiated call on 16-bit inputs with ``narrow_states``, shorter
    chunks for short packed sequences or where shared memory is too small; in the interpreter
    (whose cost is per program and per loop step) chunks of 16 and whole-V blocks. Decoding
    calls (at most
    :data:`FUSED_GPU_MAX_TOKENS` tokens on a GPU, :data:`FUSED_MAX_TOKENS` in the
    interpreter) take the fused recurrent kernel, with value blocks of up to 64 on a GPU."""
    a = inv.kwargs
    s, dk, dv = a["query"].shape[1], a["query"].shape[-1], a["value"].shape[-1]
    cu = a.get("cu_seqlens")
    length = s if cu is None else s / max(1, cu.shape[0] - 1)  # mean packed length
    if _launch.interpreting():
        return KernelDeltaAttentionConfig(
            chunk_size=16, block_v=pow2(dv), fused=s <= FUSED_MAX_TOKENS
        )
    if s <= FUSED_GPU_MAX_TOKENS:
        return KernelDeltaAttentionConfig(
            chunk_size=16, block_v=min(64, pow2(dv)), num_warps=4, fused=True
        )
    limit = _smem.launch_limit()
    grad = getattr(inv, "grad", False)
    half = jnp.dtype(a["query"].dtype).itemsize == 2
    narrow = not grad and half
    for chunk, stages in ((64, 2), (64, 1), (32, 1), (16, 1)):
        cfg = KernelDeltaAttentionConfig(
            chunk_size=chunk,
            block_v=min(32, pow2(dv)),
            num_warps=4,
            num_stages=stages,
            chunk_warps=8 if chunk == 64 and grad else None,
            narrow_products=narrow,
            narrow_states=grad and half,
        )
        if chunk == 16 or (length >= chunk and shared_memory(cfg, dk, dv) <= limit):
            return cfg
    raise AssertionError("unreachable")


def config_space(inv: Any) -> list[KernelDeltaAttentionConfig]:
    """The heuristic, then chunks of 16, 32 and 64 with 32/64-wide V blocks and 4 or 8 warps
    in 1 stage, and those of the heuristic's chunk size with 2 stages in the sequential walks,
    without those over the device's shared memory (:func:`shared_memory`); for 16-bit inputs
    the heuristic's with ``narrow_products`` the other way and with ``narrow_states`` the other
    way, and at chunks of 64 the
    heuristic's with its ``chunk_warps`` the other way (8 or ``None``)."""
    base = heuristic(inv)
    if _launch.interpreting():
        return [base]
    dk, dv = inv.kwargs["query"].shape[-1], inv.kwargs["value"].shape[-1]
    if base.fused:  # decoding: the fused kernel's value blocks
        return [attrs.evolve(base, block_v=min(bv, pow2(dv))) for bv in (16, 32, 64)]
    limit = _smem.launch_limit()
    out = [base]
    for chunk in _CHUNKS:
        for bv in (32, 64):
            for warps in (4, 8):
                cfg = attrs.evolve(
                    base,
                    chunk_size=chunk,
                    block_v=min(bv, pow2(dv)),
                    num_warps=warps,
                    num_stages=1,
                )
                if cfg not in out and shared_memory(cfg, dk, dv) <= limit:
                    out.append(cfg)
    # the sequential walks with their loads pipelined a step ahead (128 programs in all at
    # B 2, H 16, K = V = 128: nothing else hides their memory latency)
    for cfg in [c for c in out if c.chunk_size == base.chunk_size]:
        piped = attrs.evolve(cfg, num_stages=2)
        if piped not in out and shared_memory(piped, dk, dv) <= limit:
            out.append(piped)
    if jnp.dtype(inv.kwargs["query"].dtype).itemsize == 2:  # the products on 16-bit operands
        out.append(attrs.evolve(base, narrow_products=not base.narrow_products))
        out.append(attrs.evolve(base, narrow_states=not base.narrow_states))
    if base.chunk_size == 64:  # the whole-chunk passes in 8 warps, or in the walks' 4
        out.append(attrs.evolve(base, chunk_warps=None if base.chunk_warps else 8))
    return out


# -- the op ---------------------------------------------------------------------------------


def kernel_delta_attention_triton(
    *, cfg: KernelDeltaAttentionConfig | None = None, **args: Any
) -> Any:
    """The gated delta rule through the Triton kernels.

    Args:
        **args: the arguments of
            :func:`ejkernel.specs.kernel_delta_attention.kernel_delta_attention`, by name, as
            the core spec validated them.
        cfg: chunk size, V block, warps and stages; ``None`` takes the heuristic's.

    Returns:
        ``out [B, S, H, V]`` in the query dtype, or ``(out, final_state [N, H, K, V] float32)``
        when ``return_state``.
    """
    if cfg is None:
        cfg = heuristic(_Inv(args))
    if cfg.fused:
        return _fused(args, cfg)
    st = _Statics.of(args, cfg)
    out, final, _ = _forward({n: args.get(n) for n in _ARRAY_NAMES}, st)
    return (out, final) if st.return_state else out


@attrs.frozen(kw_only=True)
class _Statics(_chunked.Statics):
    """The call's static facts and the config, resolved for the launches: the shared ones,
    whether q and k are L2-normalised and the value block of the per-chunk passes."""

    l2norm: bool
    block_v_prep: int
    narrow: bool
    narrow_states: bool
    chunk_warps: int

    @classmethod
    def of(cls, args: dict[str, Any], cfg: KernelDeltaAttentionConfig | None) -> _Statics:
        if cfg is None:
            cfg = heuristic(_Inv(args))
        dk, dv = args["query"].shape[-1], args["value"].shape[-1]
        return cls(
            l2norm=bool(args.get("use_qk_l2norm", True)),
            block_k=pow2(dk),
            block_v=min(cfg.block_v, pow2(dv)),
            block_v_prep=pow2(dv),
            narrow=cfg.narrow_products,
            narrow_states=cfg.narrow_states,
            chunk_warps=cfg.chunk_warps or cfg.num_warps,
            **_chunked.call_statics(args, cfg),
        )


@attrs.frozen
class _Inv:
    kwargs: dict[str, Any]


# -- the fused recurrent forward (decoding) ------------------------------------------------


def _fused(args: dict[str, Any], cfg: KernelDeltaAttentionConfig) -> Any:
    """The call's forward through :mod:`ejkernel_triton.kernels.kda_fused`."""
    q, v, cu = args["query"], args["value"], args.get("cu_seqlens")
    init, offsets = fused_states(q, v, args.get("initial_state"), cu)
    g = args["g"] if args["g"].ndim == 4 else args["g"][..., None]
    out, final = _fused_run(
        q,
        args["key"],
        v,
        args["beta"],
        g,
        init,
        offsets,
        scale=_chunked.softmax_scale(args),
        l2norm=bool(args.get("use_qk_l2norm", True)),
        block_v=min(cfg.block_v, pow2(v.shape[-1])),
        num_warps=cfg.num_warps,
        packed=cu is not None,
    )
    return (out, final) if args.get("return_state") else out


@functools.partial(jax.jit, static_argnames=("scale", "l2norm", "block_v", "num_warps", "packed"))
def _fused_run(q, k, v, beta, g, init, cu, *, scale, l2norm, block_v, num_warps, packed):
    """The delta-rule kernel's launch."""
    from ejkernel_triton.kernels.kda_fused import kda_fused_fwd_kernel

    return fused_launch(
        kda_fused_fwd_kernel,
        q,
        k,
        v,
        beta,
        g,
        init,
        cu,
        scale=scale,
        block_v=block_v,
        num_warps=num_warps,
        packed=packed,
        GK=g.shape[-1],
        L2NORM=l2norm,
        GATE_FLOOR=GATE_FLOOR,
    )


# -- forward --------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("st", "keep"))
def _forward(
    a: dict[str, Any], st: _Statics, keep: bool = False
) -> tuple[jax.Array, jax.Array, dict[str, Any] | None]:
    """``(out, final_state, residuals)``; the residuals (``keep``) are what the backward
    reads, else ``None``."""
    init = a["initial_state"]
    lay, init_rows = _chunked.chunk_layout(a, st.chunk)
    g = a["g"] if a["g"].ndim == 4 else a["g"][..., None]
    q, k, v, beta, gates = (
        lay.to_chunks(x) for x in (a["query"], a["key"], a["value"], a["beta"][..., None], g)
    )
    run = _launch.fold_vmap(_forward_kernels(st, lay.num_chunks, keep), lay.fold_modes(7))
    o, final_rows, *saved = run(q, k, v, beta, gates, init_rows, lay.flags)
    out = lay.from_chunks(o)
    final = lay.op_states(final_rows, init_rows)
    if not keep:
        return out, final, None
    res = dict(zip(("qg", "kg", "w", "p", "decay", "h", "vn", "t", "kk"), saved, strict=True))
    res.update(layout=lay, q=q, k=k, v=v, beta=beta, g=gates)
    # the gradients' dtypes and shapes; the key's presence says the initial state has one
    res["dtypes"] = {n: jnp.zeros((0,), a[n].dtype) for n in ("beta", "g")}
    res["gate_per_head"] = jnp.zeros((0,), jnp.bool_) if a["g"].ndim == 3 else None
    if init is not None:
        res["dtypes"]["initial_state"] = jnp.zeros((0,), init.dtype)
    return out, final, res


def _forward_kernels(st: _Statics, nt: int, keep: bool) -> Any:
    """``run(q, k, v, beta, gates, init_rows, flags) -> (o, final_rows)``, and with ``keep``
    also ``(qg, kg, w, p, decay, h, vn, t, kk)`` (the per-chunk factors, starting states,
    ``V'``, ``T`` and the decayed ``K Kᵀ``): the forward's launches on the chunk layout."""
    from ejkernel_triton.kernels.kda_fwd import kda_fwd_h_kernel, kda_fwd_o_kernel

    def run(q, k, v, beta, gates, init_rows, flags):
        b, t, h, dk = q.shape
        dv, gk = v.shape[-1], gates.shape[-1]
        c = st.chunk
        common = {"num_warps": st.num_warps, "DOT_PRECISION": st.precision}
        chunk = _per_channel_chunk if gk > 1 else _per_head_chunk
        qg, kg, w, u, p, decay, tt, kk = chunk(st, nt, keep, q, k, v, beta, gates)
        # the starting states and V' the output kernel reads: float32 where the backward
        # reads them too (unless narrow_states), else the input dtype
        saved = jnp.float32 if keep and not st.narrow_states else q.dtype
        final_rows, hs, vn = _launch.launch(
            kda_fwd_h_kernel,
            kg,
            w,
            u,
            decay,
            init_rows,
            flags,
            nt,
            h,
            init_rows.shape[0] // b,
            out_shape=[
                jax.ShapeDtypeStruct(init_rows.shape, jnp.float32),
                jax.ShapeDtypeStruct((b, h, nt, dk, dv), saved),
                jax.ShapeDtypeStruct((b, t, h, dv), saved),
            ],
            grid=(-(-dv // st.block_v), b * h),
            **_sizes(st, dk, dv, gk),
            num_stages=st.num_stages,
            **common,
        )
        (o,) = _launch.launch(
            kda_fwd_o_kernel,
            qg,
            p,
            hs,
            vn,
            nt,
            h,
            out_shape=[jax.ShapeDtypeStruct((b, t, h, dv), q.dtype)],
            grid=(nt, -(-dv // st.block_v), b * h),
            K=dk,
            V=dv,
            C=c,
            BK=st.block_k,
            BV=st.block_v,
            NARROW=st.narrow,
            num_stages=1,
            **common,
        )
        if keep:
            return o, final_rows, qg, kg, w, p, decay, hs, vn, tt, kk
        return o, final_rows

    return run


def _per_head_chunk(st: _Statics, nt: int, keep: bool, q, k, v, beta, gates) -> list[Any]:
    """A per-head gate's chunk pass, one launch: ``(qg, kg, w, u, p, decay, t, kk)`` (``t``
    and ``kk`` only with ``keep``)."""
    from ejkernel_triton.kernels.kda_fwd import kda_fwd_prep_kernel

    b, t, h, _ = q.shape
    c = st.chunk
    factors = (b, t, h, c) if keep else (1,)
    return _factor_pass(
        kda_fwd_prep_kernel,
        st,
        nt,
        keep,
        (q, k, v, beta, gates),
        out_shape=[
            jax.ShapeDtypeStruct((b, t, h, c), jnp.float32),
            jax.ShapeDtypeStruct((b, nt, h, 1), jnp.float32),
            jax.ShapeDtypeStruct(factors, jnp.float32),
            jax.ShapeDtypeStruct(factors, jnp.float32),
        ],
        GK=1,
    )


def _per_channel_chunk(st: _Statics, nt: int, keep: bool, q, k, v, beta, gates) -> list[Any]:
    """A per-channel gate's chunk pass: the normalised inputs, the decayed products in
    ``[16, 16]`` tiles over blocks of :data:`_ROW_CHANNELS` key channels, one program per
    block of 16 rows (which also inverts its diagonal block of ``I + A``), then the rest;
    ``(qg, kg, w, u, p, decay, t, kk)`` as :func:`_per_head_chunk`'s (``kk`` always)."""
    from ejkernel_triton.kernels.kda_fwd import (
        kda_fwd_intra_kernel,
        kda_fwd_norm_kernel,
        kda_fwd_wy_kernel,
    )

    b, t, h, dk = q.shape
    c = st.chunk
    tokens_f32 = jax.ShapeDtypeStruct((b, t, h, dk), jnp.float32)
    # q̂ and k̂ in the inputs' dtype where the products take 16-bit operands anyway
    normalised = jax.ShapeDtypeStruct((b, t, h, dk), q.dtype) if st.narrow else tokens_f32
    sizes = {"K": dk, "C": c, "BK": st.block_k}
    numerics = {"L2NORM": st.l2norm, "GATE_FLOOR": GATE_FLOOR}
    qn, kn, gc, bn = _launch.launch(
        kda_fwd_norm_kernel,
        q,
        k,
        beta,
        gates,
        np.float32(st.scale),
        nt,
        h,
        out_shape=[
            normalised,
            normalised,
            tokens_f32,
            jax.ShapeDtypeStruct((b, t, h), jnp.float32),
        ],
        grid=(nt, b * h),
        **sizes,
        **numerics,
        num_warps=st.chunk_warps,
        num_stages=1,
    )
    per_chunk = jax.ShapeDtypeStruct((b, t, h, c), jnp.float32)
    p, kk, tdiag = _launch.launch(
        kda_fwd_intra_kernel,
        qn,
        kn,
        gc,
        bn,
        nt,
        h,
        out_shape=[per_chunk] * 3,
        grid=(nt * (c // 16), b * h),
        K=dk,
        C=c,
        BKS=min(_ROW_CHANNELS, st.block_k),
        DOT_PRECISION=st.precision,
        NARROW=st.narrow,
        num_warps=_ROW_WARPS,
        num_stages=1,
    )
    qg, kg, w, u, decay, tt = _factor_pass(
        kda_fwd_wy_kernel,
        st,
        nt,
        keep,
        (qn, kn, v, bn, gc, kk, tdiag),
        out_shape=[
            jax.ShapeDtypeStruct((b, nt, h, dk), jnp.float32),
            jax.ShapeDtypeStruct((b, t, h, c) if keep else (1,), jnp.float32),
        ],
        normalised=True,
    )
    return [qg, kg, w, u, p, decay, tt, kk]


def _factor_pass(
    kernel: Any,
    st: _Statics,
    nt: int,
    keep: bool,
    reads: tuple[Any, ...],
    out_shape: list[jax.ShapeDtypeStruct],
    normalised: bool = False,
    **constexprs: Any,
) -> list[Any]:
    """A forward chunk pass that writes the factors, one program per chunk and head: it reads
    ``reads`` (``q, k, v, beta, gates`` first, then the scale; ``normalised``: the norm
    kernel's ``q̂, k̂, v, β, G``, which need neither the scale nor the input numerics), and
    writes ``qg``, ``kg``, ``w`` and ``u`` (the value's dtype, the inputs'), then
    ``out_shape``'s; all of V in one block (``STORE_FACTORS``: ``keep``)."""
    q, v = reads[0], reads[2]
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    tokens_k = jax.ShapeDtypeStruct((b, t, h, dk), v.dtype)
    factors = [tokens_k, tokens_k, tokens_k, jax.ShapeDtypeStruct((b, t, h, dv), v.dtype)]
    sizes = {"K": dk, "V": dv, "C": st.chunk, "BK": st.block_k, "BV": st.block_v_prep}
    numerics = {} if normalised else {"L2NORM": st.l2norm, "GATE_FLOOR": GATE_FLOOR}
    scale = () if normalised else (np.float32(st.scale),)
    return _launch.launch(
        kernel,
        *reads,
        *scale,
        nt,
        h,
        out_shape=[*factors, *out_shape],
        grid=(nt, b * h),
        **sizes,
        **numerics,
        STORE_FACTORS=keep,
        DOT_PRECISION=st.precision,
        NARROW=st.narrow,
        num_warps=st.chunk_warps,
        num_stages=1,
        **constexprs,
    )


def _sizes(
    st: _Statics, dk: int, dv: int, gk: int, chunk_pass: bool = False, block_v: int | None = None
) -> dict[str, Any]:
    """The launches' size constexprs: a sequential walk's (``BV`` the state block), or a
    per-chunk pass's (``BV`` all of V unless ``block_v``; with the input numerics')."""
    sizes = {"K": dk, "V": dv, "C": st.chunk, "BK": st.block_k, "GK": gk}
    if not chunk_pass:
        return {**sizes, "BV": st.block_v}
    bv = st.block_v_prep if block_v is None else block_v
    return {**sizes, "BV": bv, "L2NORM": st.l2norm, "GATE_FLOOR": GATE_FLOOR}


# -- backward -------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("st",))
def _backward(
    res: dict[str, Any], d_o: jax.Array, d_final: jax.Array | None, st: _Statics
) -> dict[str, jax.Array | None]:
    lay: Layout = res["layout"]
    do, dfinal_rows = _chunked.cotangents(res, d_o, d_final)
    run = _launch.fold_vmap(_backward_kernels(st, lay.num_chunks), lay.fold_modes(17))
    names = ("q", "k", "v", "beta", "g", "qg", "kg", "w", "p", "decay", "h", "vn", "t", "kk")
    dinit_rows, d_q, d_k, d_v, d_beta, d_g = run(
        *(res[n] for n in names),
        do,
        dfinal_rows,
        lay.flags,
    )
    d_g = lay.from_chunks(d_g)
    if res["gate_per_head"] is not None:
        d_g = d_g[..., 0]
    dtypes = res["dtypes"]
    grads = _chunked.gradients(res, d_q, d_k, d_v, dinit_rows, dfinal_rows)
    grads["beta"] = lay.from_chunks(d_beta)[..., 0].astype(dtypes["beta"].dtype)
    grads["g"] = d_g.astype(dtypes["g"].dtype)
    return grads


#: Forward ``(out or (out, final_state), residuals)``, the residuals the chunk layout's
#: inputs, the per-chunk factors and each chunk's starting state; backward: gradients of
#: query, key, value, beta, g and initial_state.
_kda_fwd, _kda_bwd = _chunked.vjp_rules(
    _Statics.of, functools.partial(_forward, keep=True), _backward, _ARRAY_NAMES
)
defvjp(kernel_delta_attention_triton, _kda_fwd, _kda_bwd)


def _backward_kernels(st: _Statics, nt: int) -> Any:
    """``run(q, k, v, beta, gates, qg, kg, w, p, decay, h, vn, t, kk, do, dfinal_rows, flags) ->
    (dinit_rows, dq, dk, dv, dbeta, dg)``: the backward's launches on the chunk layout."""
    from ejkernel_triton.kernels.kda_bwd import (
        kda_bwd_chunk_in_kernel,
        kda_bwd_chunk_kernel,
        kda_bwd_chunk_out_kernel,
        kda_bwd_dh_kernel,
        kda_bwd_dv_kernel,
        kda_bwd_dvl_kernel,
        kda_bwd_products_kernel,
    )

    def run(q, k, v, beta, gates, qg, kg, w, p, decay, hs, vn, tt, kk, do, dfinal_rows, flags):
        b, t, h, dk = q.shape
        dv, gk = v.shape[-1], gates.shape[-1]
        c = st.chunk
        common = {"num_warps": st.num_warps, "DOT_PRECISION": st.precision}
        chunk_common = {**common, "num_warps": st.chunk_warps}
        f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
        (dvl,) = _launch.launch(
            kda_bwd_dvl_kernel,
            p,
            do,
            nt,
            h,
            out_shape=[f32((b, t, h, dv))],
            grid=(nt, -(-dv // st.block_v), b * h),
            V=dv,
            C=c,
            BV=st.block_v,
            num_stages=1,
            **common,
        )
        dh, dvn, dinit_rows = _launch.launch(
            kda_bwd_dh_kernel,
            qg,
            kg,
            w,
            dvl,
            decay,
            do,
            dfinal_rows,
            flags,
            nt,
            h,
            dfinal_rows.shape[0] // b,
            out_shape=[
                jax.ShapeDtypeStruct(hs.shape, hs.dtype),
                f32((b, t, h, dv)),
                f32(dfinal_rows.shape),
            ],
            grid=(-(-dv // st.block_v), b * h),
            **_sizes(st, dk, dv, gk),
            num_stages=st.num_stages,
            **common,
        )
        sizes = _sizes(st, dk, dv, gk, chunk_pass=True, block_v=st.block_v)
        d_v, dqg, dw, dkg, dpt, dtt, dbeta_v, ddecay = _launch.launch(
            kda_bwd_dv_kernel,
            q,
            k,
            v,
            beta,
            gates,
            tt,
            hs,
            vn,
            dh,
            do,
            dvn,
            nt,
            h,
            out_shape=[
                jax.ShapeDtypeStruct(v.shape, v.dtype),
                *(f32((b, t, h, dk)) for _ in range(3)),
                f32((b, t, h, c)),
                f32((b, t, h, c)),
                f32(beta.shape),
                f32((b, nt, h, dk)),
            ],
            grid=(nt, b * h),
            **{n: sizes[n] for n in ("K", "V", "C", "BK", "BV", "GK", "GATE_FLOOR")},
            num_stages=1,
            **chunk_common,
        )
        chunk_sizes = {n: sizes[n] for n in ("K", "C", "BK", "GK", "L2NORM", "GATE_FLOOR")}
        scale = np.float32(st.scale)

        def chunk_pass(kernel, *reads, out_shape, **params):
            """A pass over the chunks of the inputs (one program per chunk and head), reading
            ``q, k, beta, gates, *reads, scale``."""
            return _launch.launch(
                kernel,
                q,
                k,
                beta,
                gates,
                *reads,
                scale,
                nt,
                h,
                out_shape=out_shape,
                grid=(nt, b * h),
                **chunk_sizes,
                num_stages=1,
                **params,
            )

        d_qk = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype)]
        if gk == 1:
            d_q, d_k, d_beta, d_g, _ = chunk_pass(
                kda_bwd_chunk_kernel,
                tt,
                kk,
                dqg,
                dw,
                dkg,
                dpt,
                dtt,
                dbeta_v,
                ddecay,
                out_shape=[*d_qk, f32(beta.shape), f32(gates.shape), f32((b, nt, h, c * c))],
                **chunk_common,
            )
            return dinit_rows, d_q, d_k, d_v, d_beta, d_g
        # a per-channel gate: the decayed products' backward over blocks of key channels,
        # between a pass that prepares it and one that finishes the gradients
        qs, kn, gc, dkn, dgc, dm, d_beta = chunk_pass(
            kda_bwd_chunk_in_kernel,
            tt,
            kk,
            dw,
            dtt,
            dbeta_v,
            out_shape=[*(f32((b, t, h, dk)) for _ in range(5)), f32((b, t, h, c)), f32(beta.shape)],
            **chunk_common,
        )
        bks = min(_PRODUCT_CHANNELS, st.block_k)
        kb = -(-dk // bks)
        dqs, dkn, dgc = _launch.launch(
            kda_bwd_products_kernel,
            qs,
            kn,
            gc,
            dkn,
            dgc,
            dpt,
            dm,
            nt,
            h,
            out_shape=[f32((b, t, h, dk)) for _ in range(3)],
            grid=(nt * (c // 16), kb, b * h),
            K=dk,
            C=c,
            BKS=bks,
            num_stages=1,
            num_warps=_TILE_WARPS,
            DOT_PRECISION=st.precision,
        )
        d_q, d_k, d_g = chunk_pass(
            kda_bwd_chunk_out_kernel,
            dqs,
            dkn,
            dgc,
            dqg,
            dkg,
            ddecay,
            out_shape=[*d_qk, f32(gates.shape)],
            num_warps=st.chunk_warps,
        )
        return dinit_rows, d_q, d_k, d_v, d_beta, d_g

    return run
