"""The Mosaic TPU flash-attention kernels and their launches: the forward over grid
(B, Hq, nq, nk), ``dQ`` over kv blocks and ``dK``/``dV`` over (G, nq) for each kv head."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.attention_semantics import (
    EMPTY_ROW_LSE,
    MASK_VALUE,
    hide,
    mask_scores,
    visible,
)
from ejkernel_pallas import _compat
from ejkernel_pallas._attention import kv_block_span, q_block_span
from ejkernel_pallas.tpu._numerics import finite_or_zero, precision, when
from ejkernel_pallas.tpu._problem import LANES, SUBLANES, Problem

__all__ = ["dkv_call", "dq_call", "fwd_call"]


def _spec(block: tuple[Any, ...], index_map: Callable[..., Any]) -> Any:
    return _compat.pl.BlockSpec(block, index_map)


def _by_query_block(
    pr: Problem, segs: Any, row_widths: tuple[int, ...]
) -> tuple[list[Any], Callable[[int], Any]]:
    """In-specs over grid (B, Hq, nq, nk), the forward's and dQ's: Q, K, V, a ``[bq, width]``
    block of query rows per ``row_widths``, then the segment ids; and the query-row spec (of a
    width). Kv blocks clamp to the span query block ``i`` sees."""
    bq, bk = pr.bq, pr.bk

    def kv_block(i: Any, j: Any) -> Any:
        first, last = kv_block_span(pr.geo, i, bq, bk, pr.nk)
        return jnp.clip(j, first, last)

    q_rows = lambda width: _spec((None, None, bq, width), lambda b, h, i, j: (b, h, i, 0))
    kv_map = lambda b, h, i, j: (b, h // pr.group, kv_block(i, j), 0)
    in_specs = [
        q_rows(pr.d_pad),
        _spec((None, None, bk, pr.d_pad), kv_map),
        _spec((None, None, bk, pr.dv_pad), kv_map),
        *map(q_rows, row_widths),
    ]
    if segs is not None:
        in_specs += [
            _spec((None, bq, LANES), lambda b, h, i, j: (b, i, 0)),
            _spec((None, SUBLANES, bk), lambda b, h, i, j: (b, 0, kv_block(i, j))),
        ]
    return in_specs, q_rows


def fwd_call(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segs: tuple[jax.Array, jax.Array] | None,
    pr: Problem,
) -> tuple[jax.Array, jax.Array]:
    """The forward kernel over grid (B, Hq, nq, nk): out [B, Hq, Sq_pad, Dv_pad], lse lanes."""
    in_specs, q_rows = _by_query_block(pr, segs, ())
    rows = (pr.b, pr.hq, pr.sq_pad)
    out, lse = _pallas_call(
        pr,
        _flash_attention_fwd_kernel,
        name="ejkernel_flash_attention_fwd",
        grid=(pr.b, pr.hq, pr.nq, pr.nk),
        in_specs=in_specs,
        out_specs=[q_rows(pr.dv_pad), q_rows(LANES)],
        out_shape=[
            jax.ShapeDtypeStruct((*rows, pr.dv_pad), pr.dtype),
            jax.ShapeDtypeStruct((*rows, LANES), jnp.float32),
        ],
        scratch_shapes=[
            _compat.vmem((pr.bq, LANES), jnp.float32),  # running max
            _compat.vmem((pr.bq, LANES), jnp.float32),  # running denominator
            _compat.vmem((pr.bq, pr.dv_pad), jnp.float32),  # output accumulator
        ],
    )(q, k, v, *(segs or ()))
    return out, lse


#: The backward kernels' inputs in kernel layout: (Q, K, V, dO, logsumexp, Δ).
BwdInputs = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]


def dq_call(inputs: BwdInputs, segs: tuple[jax.Array, jax.Array] | None, pr: Problem) -> jax.Array:
    """dQ over grid (B, Hq, nq, nk): [B, Hq, Sq_pad, D_pad] in the query dtype."""
    in_specs, q_rows = _by_query_block(pr, segs, (pr.dv_pad, LANES, LANES))  # dO, lse, delta
    return _pallas_call(
        pr,
        _bwd_dq_kernel,
        name="ejkernel_flash_attention_bwd_dq",
        grid=(pr.b, pr.hq, pr.nq, pr.nk),
        in_specs=in_specs,
        out_specs=q_rows(pr.d_pad),
        out_shape=jax.ShapeDtypeStruct((pr.b, pr.hq, pr.sq_pad, pr.d_pad), pr.dtype),
        scratch_shapes=[_compat.vmem((pr.bq, pr.d_pad), jnp.float32)],
    )(*inputs, *(segs or ()))


def dkv_call(
    inputs: BwdInputs, segs: tuple[jax.Array, jax.Array] | None, pr: Problem
) -> tuple[jax.Array, jax.Array]:
    """dK, dV over grid (B, Hkv, nk, G, nq): the G query heads of a kv head accumulate in VMEM."""
    bq, bk, group = pr.bq, pr.bk, pr.group

    def q_block(j: Any, i: Any) -> Any:
        first, last = q_block_span(pr.geo, j, bq, bk, pr.nq)
        return jnp.clip(i, first, last)

    q_rows = lambda width: _spec(
        (None, None, bq, width), lambda b, h, j, g, i: (b, h * group + g, q_block(j, i), 0)
    )
    kv_rows = lambda width: _spec((None, None, bk, width), lambda b, h, j, g, i: (b, h, j, 0))
    in_specs = [
        q_rows(pr.d_pad),
        kv_rows(pr.d_pad),
        kv_rows(pr.dv_pad),
        *map(q_rows, (pr.dv_pad, LANES, LANES)),  # dO, lse, delta
    ]
    if segs is not None:
        in_specs += [
            _spec((None, bq, LANES), lambda b, h, j, g, i: (b, q_block(j, i), 0)),
            _spec((None, SUBLANES, bk), lambda b, h, j, g, i: (b, 0, j)),
        ]
    rows = (pr.b, pr.hkv, pr.sk_pad)
    return _pallas_call(
        pr,
        _bwd_dkv_kernel,
        name="ejkernel_flash_attention_bwd_dkv",
        grid=(pr.b, pr.hkv, pr.nk, group, pr.nq),
        reduced_axes=2,
        in_specs=in_specs,
        out_specs=[kv_rows(pr.d_pad), kv_rows(pr.dv_pad)],
        out_shape=[
            jax.ShapeDtypeStruct((*rows, pr.d_pad), pr.dtype),
            jax.ShapeDtypeStruct((*rows, pr.dv_pad), pr.dtype),
        ],
        scratch_shapes=[
            _compat.vmem((bk, pr.d_pad), jnp.float32),
            _compat.vmem((bk, pr.dv_pad), jnp.float32),
        ],
    )(*inputs, *(segs or ()))


def _pallas_call(
    pr: Problem, kernel: Any, *, grid: tuple[int, ...], reduced_axes: int = 1, **kwargs: Any
) -> Any:
    """``pl.pallas_call`` of ``kernel`` for ``pr`` over ``grid``, whose last ``reduced_axes``
    axes accumulate ("arbitrary"); in interpret mode made vmappable one example at a time (the
    TPU interpreter's batching of a pallas_call fails on these block specs with jax 0.10)."""
    semantics = ("parallel",) * (len(grid) - reduced_axes) + ("arbitrary",) * reduced_axes
    call = _compat.pl.pallas_call(
        functools.partial(kernel, pr=pr),
        grid=grid,
        compiler_params=_compat.tpu_compiler_params(dimension_semantics=semantics),
        interpret=pr.interpret,
        **kwargs,
    )
    return jax.custom_batching.sequential_vmap(call) if pr.interpret else call


def _dot(a: Any, b: Any, contract: tuple[int, int]) -> Any:
    """``a · b`` contracting ``a``'s axis ``contract[0]`` with ``b``'s ``contract[1]``, f32."""
    return lax.dot_general(
        a,
        b,
        (((contract[0],), (contract[1],)), ((), ())),
        precision=precision(a.dtype),
        preferred_element_type=jnp.float32,
    )


def _visible(i: Any, j: Any, qs_ref: Any, ks_ref: Any, pr: Problem) -> Any:
    """Bool [bq, bk] of block (i, j) (:func:`ejkernel.attention_semantics.visible`), or ``None``
    when every entry is visible."""
    shape = (pr.bq, pr.bk)
    k_pos = j * pr.bk + lax.broadcasted_iota(jnp.int32, shape, 1)
    q_pos = pr.geo.q_position(i * pr.bq + lax.broadcasted_iota(jnp.int32, shape, 0))
    terms: dict[str, Any] = {}
    if qs_ref is not None:
        terms["q_segment_ids"] = qs_ref[...][:, :1]  # lanes replicate one id per row
        terms["kv_segment_ids"] = ks_ref[...][:1, :]  # sublanes replicate one id per column
    elif pr.sk_pad != pr.sk:  # padded segment ids (-1) hide the padded keys otherwise
        terms["kv_valid"] = k_pos < pr.sk
    if not pr.geo.restricted and not terms:
        return None
    return visible(q_pos, k_pos, causal=pr.geo.causal, window=pr.geo.window, **terms)


def _logits(q: Any, k: Any, pr: Problem) -> tuple[Any, Any]:
    """Scaled (and soft-capped) logits [bq, bk] in f32, with the tanh for the backward."""
    s = _dot(q, k, (1, 1)) * pr.scale
    if pr.cap is None:
        return s, None
    tanh = jnp.tanh(s * (1.0 / pr.cap))
    return pr.cap * tanh, tanh


def _split_refs(refs: tuple[Any, ...], inputs: int, pr: Problem) -> tuple[Any, Any, Any]:
    """A kernel's refs as (its ``inputs`` inputs, the segment-id refs or ``(None, None)``,
    outputs and scratch): the segment ids follow the inputs when the call has them."""
    end = inputs + 2 * pr.segments
    return refs[:inputs], (refs[inputs:end] or (None, None)), refs[end:]


def _flash_attention_fwd_kernel(*refs: Any, pr: Problem) -> None:
    (q_ref, k_ref, v_ref), (qs_ref, ks_ref), out = _split_refs(refs, 3, pr)
    o_ref, lse_ref, m_sc, l_sc, acc_sc = out
    i, j = _compat.pl.program_id(2), _compat.pl.program_id(3)

    @when(j == 0)
    def _init() -> None:
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @when(pr.geo.block_may_see(i, j, pr.bq, pr.bk))
    def _step() -> None:
        v = v_ref[...]
        s, _ = _logits(q_ref[...], k_ref[...], pr)
        vis = _visible(i, j, qs_ref, ks_ref, pr)
        if vis is not None:  # a hidden key or value holding NaN/Inf must not reach a row
            s = mask_scores(s, vis)
            v = finite_or_zero(v)
        m_prev = m_sc[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [bq, LANES]
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, :1])
        if vis is not None:
            p = hide(p, vis)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_next
        acc_sc[...] = acc_sc[...] * alpha[:, :1] + _dot(p.astype(v.dtype), v, (1, 0))

    @when(j == pr.nk - 1)
    def _finish() -> None:
        denom = l_sc[...]
        empty = denom == 0.0
        safe = jnp.where(empty, 1.0, denom)
        o_ref[...] = (acc_sc[...] / safe[:, :1]).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, EMPTY_ROW_LSE, m_sc[...] + jnp.log(safe))


def _probabilities_and_ds(
    q: Any, k: Any, v: Any, do: Any, lse: Any, delta: Any, vis: Any, pr: Problem
) -> tuple[Any, Any]:
    """Recomputed P [bq, bk] and dS = P ∘ (dP - Δ) (through the soft cap), both f32."""
    s, tanh = _logits(q, k, pr)
    p = jnp.exp(s - lse[:, :1])
    dp = _dot(do, v, (1, 1))
    ds = p * (dp - delta[:, :1])
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    if vis is not None:  # selects: dP of a hidden non-finite value is NaN, and 0 · NaN too
        p, ds = hide(p, vis), hide(ds, vis)
    return p, ds


def _bwd_dq_kernel(*refs: Any, pr: Problem) -> None:
    inputs, (qs_ref, ks_ref), (dq_ref, dq_sc) = _split_refs(refs, 6, pr)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    i, j = _compat.pl.program_id(2), _compat.pl.program_id(3)

    @when(j == 0)
    def _init() -> None:
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @when(pr.geo.block_may_see(i, j, pr.bq, pr.bk))
    def _step() -> None:
        k = k_ref[...]
        vis = _visible(i, j, qs_ref, ks_ref, pr)
        _, ds = _probabilities_and_ds(
            q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], vis, pr
        )
        if vis is not None:
            k = finite_or_zero(k)
        dq_sc[...] += _dot(ds.astype(k.dtype), k, (1, 0))

    @when(j == pr.nk - 1)
    def _finish() -> None:
        dq_ref[...] = (dq_sc[...] * pr.scale).astype(dq_ref.dtype)


def _bwd_dkv_kernel(*refs: Any, pr: Problem) -> None:
    inputs, (qs_ref, ks_ref), (dk_ref, dv_ref, dk_sc, dv_sc) = _split_refs(refs, 6, pr)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    pl = _compat.pl
    j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @when(jnp.logical_and(g == 0, i == 0))
    def _init() -> None:
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @when(pr.geo.block_may_see(i, j, pr.bq, pr.bk))
    def _step() -> None:
        q, do = q_ref[...], do_ref[...]
        vis = _visible(i, j, qs_ref, ks_ref, pr)
        p, ds = _probabilities_and_ds(
            q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], vis, pr
        )
        if vis is not None:
            q = finite_or_zero(q)
        dv_sc[...] += _dot(p.astype(do.dtype), do, (0, 0))
        dk_sc[...] += _dot(ds.astype(q.dtype), q, (0, 0))

    @when(jnp.logical_and(g == pr.group - 1, i == pr.nq - 1))
    def _finish() -> None:
        dk_ref[...] = (dk_sc[...] * pr.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)
