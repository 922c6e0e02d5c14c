"""flash_attention (and scaled_dot_product_attention) as Pallas Mosaic-TPU kernels.

Algorithm: FlashAttention-2 (Dao, 2023), forward Alg. 1 with the online softmax, backward
Alg. 2 split in two kernels (``dQ`` over kv blocks; ``dK``/``dV`` over query blocks), as on
TPUs there are no atomics to merge them.

Layout and tiling. Inputs go to ``[B, H, S, D]``; the head dims are zero-padded to a multiple of
128 lanes (D 80 becomes 128: zeros change no dot product) and sequences to whole blocks. Query
blocks are multiples of 8 sublanes, kv blocks multiples of 128 lanes, so every tile (``[bq, D]``,
``[bk, D]``, the ``[bq, bk]`` logits) is made of whole (8, 128) vregs; the heuristic sizes the
blocks so one grid step's working set fits the scoped VMEM. Row statistics (running max,
denominator, logsumexp, the backward's ``rowsum(dO ∘ O)``) are kept replicated over 128 lanes,
and segment ids of queries over 128 lanes and of keys over 8 sublanes, so they load as whole
tiles. Every kernel runs on a grid whose last axis (or last two) is a reduction ("arbitrary"),
accumulating in VMEM scratch in float32; matmul inputs keep the input dtype.

Masking (core spec semantics): bottom-right aligned causal, sliding window ``(left, right)``,
segment ids (equal and non-negative), padded keys; a masked logit is a finite minimum, and a
row with no visible key returns zeros with zero gradients. Causal and window masks skip whole
blocks twice over: compute is predicated off (``pl.when`` on block indices) and the index maps
clamp the block fetched to the visible range, so a skipped step re-uses the block already in
VMEM instead of issuing a DMA. GQA: a query head reads kv head ``h // G``; ``dK``/``dV`` of a
kv head accumulate over its ``G`` query heads inside the kernel (grid axes ``(G, nq)``).
Soft cap: ``cap · tanh(s / cap)`` in the forward, and the chain rule ``(1 - tanh²)`` backward.

Declined in ``supports()`` (the XLA plugin serves them): bias, dense attention_mask, sinks
(softmax_aux), dropout; dtypes other than float32/bfloat16/float16; head dims over 512.

What was verified how: without a TPU, ``tests/pallas/test_flash_attention_tpu.py`` runs these
kernels on the CPU in Pallas's TPU interpret mode (``pltpu.InterpretParams``: HBM/VMEM memory
spaces, DMAs and the grid simulated) against ``flash_attention_reference`` in float32 (1e-5)
and bfloat16 (1e-2), forward and gradients, for every feature above (odd lengths 37/129,
head dim 80, GQA, several blocks per axis). Mosaic's lowering to a real TPU (layouts of the
lane slices and transposed matmuls) has not been run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ejkernel import env
from ejkernel.plugins import BwdParams, FwdParams, defvjp
from ejkernel_pallas import _compat
from ejkernel_pallas._attention import FlashAttentionConfig, Visibility, declined_features

__all__ = [
    "FlashAttentionConfig",
    "config_space",
    "flash_attention_pallas",
    "heuristic",
    "scaled_dot_product_attention_pallas",
    "supports",
]

LANES = 128
SUBLANES = 8
#: Logit of a masked entry: finite, so ``masked - row_max`` never forms ``inf - inf``.
MASK_VALUE = float(np.finfo(np.float32).min)
#: Logsumexp of a row with no visible key: ``exp(s - it)`` is 0 for every ``s``.
EMPTY_ROW_LSE = float(np.finfo(np.float32).max)
#: Default (q, kv) blocks of the forward and the backward, before the VMEM budget.
FWD_BLOCKS = (512, 512)
BWD_BLOCKS = (256, 512)
#: Bytes one grid step may hold in VMEM (inputs double-buffered, scratch, f32 temporaries);
#: below the 16 MiB scoped default of v4/v5e so the compiler keeps its own headroom.
VMEM_BUDGET = 12 * 2**20
MAX_HEAD_DIM = 512
DTYPES = ("float32", "bfloat16", "float16")
#: (q, kv) block pairs offered to the autotuner.
TUNING_BLOCKS = ((128, 128), (128, 256), (256, 256), (256, 512), (512, 512), (512, 1024))


def heuristic(inv: Any) -> FlashAttentionConfig:
    """Default blocks clamped to the sequences and shrunk to the VMEM budget."""
    p = _shape_of(inv)
    fwd = _fit_blocks(FWD_BLOCKS, p, backward=False)
    bwd = _fit_blocks(BWD_BLOCKS, p, backward=True)
    return FlashAttentionConfig(
        fwd_params=FwdParams(q_blocksize=fwd[0], kv_blocksize=fwd[1]),
        bwd_params=BwdParams(q_blocksize=bwd[0], kv_blocksize=bwd[1]),
    )


def config_space(inv: Any) -> list[FlashAttentionConfig]:
    """The heuristic's config, then the tuning pairs that fit (duplicates after clamping once)."""
    p = _shape_of(inv)
    configs = [heuristic(inv)]
    for pair in TUNING_BLOCKS:
        fwd = _fit_blocks(pair, p, backward=False)
        bwd = _fit_blocks(pair, p, backward=True)
        cfg = FlashAttentionConfig(
            fwd_params=FwdParams(q_blocksize=fwd[0], kv_blocksize=fwd[1]),
            bwd_params=BwdParams(q_blocksize=bwd[0], kv_blocksize=bwd[1]),
        )
        if cfg not in configs:
            configs.append(cfg)
    return configs


def supports(inv: Any) -> bool | str:
    """True, or why these kernels cannot serve the call (see the module docstring)."""
    kw = inv.kwargs
    declined = declined_features(kw)
    if declined:
        return declined
    dtype = jnp.dtype(kw["query"].dtype).name
    if dtype not in DTYPES:
        return f"the Pallas TPU kernels take {'/'.join(DTYPES)}; got {dtype}"
    d, dv = kw["query"].shape[3], kw["value"].shape[3]
    if max(d, dv) > MAX_HEAD_DIM:
        return f"the Pallas TPU kernels take head dims up to {MAX_HEAD_DIM}; got D={d}, Dv={dv}"
    return True


# --------------------------------------------------------------------------------------------
# The registered entry, its forward and backward
# --------------------------------------------------------------------------------------------


def flash_attention_pallas(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_aux: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: jax.Array | None = None,
    cfg: FlashAttentionConfig | None = None,
) -> jax.Array:
    """Flash attention on Mosaic TPU (arguments as validated by the core spec).

    Args:
        query: [B, Sq, Hq, D].
        key: [B, Sk, Hkv, D].
        value: [B, Sk, Hkv, Dv].
        bias, attention_mask, softmax_aux, dropout_prob, dropout_seed: must be absent / zero
            (``supports()`` declines them).
        q_segment_ids: [B, Sq] int; with ``kv_segment_ids`` [B, Sk].
        softmax_scale: multiplies the logits; ``None`` means D ** -0.5.
        causal: bottom-right aligned causal mask.
        sliding_window: ``(left, right)`` or ``None``.
        logits_soft_cap: ``cap * tanh(logits / cap)`` or ``None``.
        cfg: block sizes; ``None`` takes the heuristic's.

    Returns:
        [B, Sq, Hq, Dv] in the query dtype; rows with no visible key are zeros.
    """
    out, _ = _flash_attention_fwd(**locals())
    return out


def _flash_attention_fwd(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_aux: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
    dropout_seed: jax.Array | None = None,
    cfg: FlashAttentionConfig | None = None,
) -> tuple[jax.Array, dict[str, Any]]:
    """Forward: ``(out, residuals)``; residuals hold the kernel-layout inputs, output and lse."""
    _refuse_declined(bias, attention_mask, softmax_aux, dropout_prob)
    pr = _Problem.of(
        query,
        key,
        value,
        q_segment_ids,
        cfg,
        backward=False,
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    q, k, v = _to_kernel_layout(query, key, value, pr)
    segs = _segments(q_segment_ids, kv_segment_ids, pr)
    out, lse = _fwd_call(q, k, v, segs, pr)
    out = _from_kernel_layout(out, pr)
    residuals = {
        "query": query,
        "key": key,
        "value": value,
        "q_segment_ids": q_segment_ids,
        "kv_segment_ids": kv_segment_ids,
        "out": out,
        "logsumexp": lse[:, :, : pr.sq, 0],  # [B, Hq, Sq]: one lane of the replicated rows
    }
    return out, residuals


def _flash_attention_bwd(
    residuals: dict[str, Any],
    d_out: jax.Array,
    *,
    cfg: FlashAttentionConfig | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    dropout_prob: float = 0.0,
) -> dict[str, jax.Array | None]:
    """Backward: gradients of query, key and value (in their dtypes)."""
    del dropout_prob  # declined in supports(): always 0 here
    query, key, value = residuals["query"], residuals["key"], residuals["value"]
    pr = _Problem.of(
        query,
        key,
        value,
        residuals["q_segment_ids"],
        cfg,
        backward=True,
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    q, k, v = _to_kernel_layout(query, key, value, pr)
    segs = _segments(residuals["q_segment_ids"], residuals["kv_segment_ids"], pr)
    rows = (pr.b, pr.hq, pr.sq_pad)
    lse = _pad_to(residuals["logsumexp"], rows, EMPTY_ROW_LSE)
    delta = jnp.einsum(
        "bqhd,bqhd->bhq", residuals["out"].astype(jnp.float32), d_out.astype(jnp.float32)
    )
    lse, delta = (
        jnp.broadcast_to(_pad_to(x, rows)[..., None], (*rows, LANES)) for x in (lse, delta)
    )
    do = _pad_to(jnp.swapaxes(d_out.astype(query.dtype), 1, 2), (*rows, pr.dv_pad))
    dq = _bwd_dq_call(q, k, v, do, lse, delta, segs, pr)
    dk, dv = _bwd_dkv_call(q, k, v, do, lse, delta, segs, pr)
    return {
        "query": jnp.swapaxes(dq[:, :, : pr.sq, : pr.d], 1, 2),
        "key": jnp.swapaxes(dk[:, :, : pr.sk, : pr.d], 1, 2),
        "value": jnp.swapaxes(dv[:, :, : pr.sk, : pr.dv], 1, 2),
    }


defvjp(flash_attention_pallas, _flash_attention_fwd, _flash_attention_bwd)


def scaled_dot_product_attention_pallas(
    *,
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    cfg: FlashAttentionConfig | None = None,
) -> jax.Array:
    """Scaled dot-product attention: :func:`flash_attention_pallas` without dropout and sinks."""
    return flash_attention_pallas(**locals())


def _scaled_dot_product_attention_fwd(**kwargs: Any) -> tuple[jax.Array, dict[str, Any]]:
    return _flash_attention_fwd(**kwargs)


defvjp(scaled_dot_product_attention_pallas, _scaled_dot_product_attention_fwd, _flash_attention_bwd)


# --------------------------------------------------------------------------------------------
# Problem geometry, blocks, layout
# --------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Shapes:
    b: int
    sq: int
    sk: int
    hq: int
    hkv: int
    d: int
    dv: int


def _shape_of(inv: Any) -> _Shapes:
    kw = inv.kwargs
    b, sq, hq, d = kw["query"].shape
    _, sk, hkv, _ = kw["key"].shape
    return _Shapes(b=b, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, dv=kw["value"].shape[3])


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _vmem_bytes(bq: int, bk: int, d: int, dv: int, itemsize: int, backward: bool) -> int:
    """Rough VMEM of one grid step: double-buffered blocks, scratch, f32 [bq, bk] temporaries."""
    d, dv = _round_up(d, LANES), _round_up(dv, LANES)
    blocks = (bq * d + bk * (d + dv)) * itemsize + bq * dv * itemsize + 2 * bq * LANES * 4
    if backward:
        blocks += bq * dv * itemsize + bq * LANES * 4
        scratch = (bq * d + bk * (d + dv)) * 4
        temps = 5 * bq * bk * 4
    else:
        scratch = bq * dv * 4 + 2 * bq * LANES * 4
        temps = 3 * bq * bk * 4
    return 2 * blocks + scratch + temps


def _fit_blocks(pair: tuple[int, int], s: _Shapes, *, backward: bool) -> tuple[int, int]:
    """Blocks legal on TPU (q: 8 sublanes, kv: 128 lanes), no longer than the padded sequences,
    halved (kv first) until a grid step fits :data:`VMEM_BUDGET`."""
    bq = max(SUBLANES, min(_round_up(pair[0], SUBLANES), _round_up(s.sq, SUBLANES)))
    bk = max(LANES, min(_round_up(pair[1], LANES), _round_up(s.sk, LANES)))
    while _vmem_bytes(bq, bk, s.d, s.dv, 4, backward) > VMEM_BUDGET:
        if bk > LANES and bk >= bq:
            bk = _round_up(bk // 2, LANES)
        elif bq > SUBLANES:
            bq = _round_up(bq // 2, SUBLANES)
        else:
            break
    return bq, bk


@attrs.frozen(kw_only=True)
class _Problem:
    """Everything static about one launch (hashable: it parametrises the kernels)."""

    b: int
    sq: int
    sk: int
    hq: int
    hkv: int
    d: int
    dv: int
    d_pad: int
    dv_pad: int
    bq: int
    bk: int
    scale: float
    cap: float | None
    vis: Visibility
    segments: bool
    dtype: Any

    @classmethod
    def of(
        cls,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        q_segment_ids: jax.Array | None,
        cfg: FlashAttentionConfig | None,
        *,
        backward: bool,
        **statics: Any,
    ) -> _Problem:
        b, sq, hq, d = query.shape
        _, sk, hkv, _ = key.shape
        shapes = _Shapes(b=b, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, dv=value.shape[3])
        return cls.from_shapes(
            shapes,
            head_dim_padded=_round_up(d, LANES),
            dtype=query.dtype,
            segments=q_segment_ids is not None,
            cfg=cfg,
            backward=backward,
            **statics,
        )

    @classmethod
    def from_shapes(
        cls,
        s: _Shapes,
        *,
        head_dim_padded: int,
        dtype: Any,
        segments: bool,
        cfg: FlashAttentionConfig | None,
        backward: bool,
        softmax_scale: float | None,
        causal: bool,
        sliding_window: tuple[int, int] | None,
        logits_soft_cap: float | None,
    ) -> _Problem:
        params = None
        if cfg is not None:
            params = cfg.bwd_params if backward else cfg.fwd_params
        default = BWD_BLOCKS if backward else FWD_BLOCKS
        pair = (
            (params.q_blocksize if params and params.q_blocksize else default[0]),
            (params.kv_blocksize if params and params.kv_blocksize else default[1]),
        )
        bq, bk = _fit_blocks(pair, s, backward=backward)
        if softmax_scale is None:
            softmax_scale = s.d**-0.5
        return cls(
            b=s.b,
            sq=s.sq,
            sk=s.sk,
            hq=s.hq,
            hkv=s.hkv,
            d=s.d,
            dv=s.dv,
            d_pad=head_dim_padded,
            dv_pad=_round_up(s.dv, LANES),
            bq=bq,
            bk=bk,
            scale=float(softmax_scale),
            cap=None if logits_soft_cap is None else float(logits_soft_cap),
            vis=Visibility(sq=s.sq, sk=s.sk, causal=bool(causal), window=sliding_window),
            segments=segments,
            dtype=jnp.dtype(dtype),
        )

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    @property
    def nq(self) -> int:
        return -(-self.sq // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.sk // self.bk)

    @property
    def sq_pad(self) -> int:
        return self.nq * self.bq

    @property
    def sk_pad(self) -> int:
        return self.nk * self.bk

    @property
    def interpret(self) -> Any:
        """TPU interpret parameters on the CPU (only reachable with EJKERNEL_INTERPRET=1)."""
        if jax.default_backend() == "tpu" and not env.interpret():
            return False
        return _compat.tpu_interpret_params()


def _refuse_declined(*args: Any) -> None:
    bias, mask, aux, dropout = args
    if bias is not None or mask is not None or aux is not None or float(dropout or 0.0) > 0:
        raise NotImplementedError(
            "ejkernel_pallas flash attention: bias, attention_mask, softmax_aux and dropout are "
            "declined by supports(); select platform='xla' for them"
        )


def _pad_to(x: jax.Array, shape: tuple[int, ...], fill: Any = 0) -> jax.Array:
    widths = [(0, t - s) for s, t in zip(x.shape, shape)]
    if all(w == (0, 0) for w in widths):
        return x
    return jnp.pad(x, widths, constant_values=fill)


def _to_kernel_layout(
    query: jax.Array, key: jax.Array, value: jax.Array, pr: _Problem
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """[B, S, H, D] -> [B, H, S_pad, D_pad] (zero padding)."""
    q = _pad_to(jnp.swapaxes(query, 1, 2), (pr.b, pr.hq, pr.sq_pad, pr.d_pad))
    k = _pad_to(jnp.swapaxes(key, 1, 2), (pr.b, pr.hkv, pr.sk_pad, pr.d_pad))
    v = _pad_to(jnp.swapaxes(value, 1, 2), (pr.b, pr.hkv, pr.sk_pad, pr.dv_pad))
    return q, k, v


def _from_kernel_layout(out: jax.Array, pr: _Problem) -> jax.Array:
    return jnp.swapaxes(out[:, :, : pr.sq, : pr.dv], 1, 2)


def _segments(
    q_segment_ids: jax.Array | None, kv_segment_ids: jax.Array | None, pr: _Problem
) -> tuple[jax.Array, jax.Array] | None:
    """Query ids [B, Sq_pad, 128] (lanes replicated), key ids [B, 8, Sk_pad] (sublanes
    replicated); padding carries id -1, which sees nothing."""
    if q_segment_ids is None or kv_segment_ids is None:
        return None
    qs = _pad_to(q_segment_ids.astype(jnp.int32), (pr.b, pr.sq_pad), -1)
    ks = _pad_to(kv_segment_ids.astype(jnp.int32), (pr.b, pr.sk_pad), -1)
    qs = jnp.broadcast_to(qs[:, :, None], (pr.b, pr.sq_pad, LANES))
    ks = jnp.broadcast_to(ks[:, None, :], (pr.b, SUBLANES, pr.sk_pad))
    return qs, ks


# --------------------------------------------------------------------------------------------
# Launch helpers
# --------------------------------------------------------------------------------------------


def _spec(block: tuple[Any, ...], index_map: Callable[..., Any]) -> Any:
    return _compat.pl.BlockSpec(block, index_map)


def _fwd_call(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segs: tuple[jax.Array, jax.Array] | None,
    pr: _Problem,
) -> tuple[jax.Array, jax.Array]:
    """The forward kernel over grid (B, Hq, nq, nk): out [B, Hq, Sq_pad, Dv_pad], lse lanes."""
    bq, bk, group = pr.bq, pr.bk, pr.group

    def kv_block(i: Any, j: Any) -> Any:
        first, last = pr.vis.kv_blocks(i, bq, bk, pr.nk)
        return jnp.clip(j, first, last)

    q_map = lambda b, h, i, j: (b, h, i, 0)
    kv_map = lambda b, h, i, j: (b, h // group, kv_block(i, j), 0)
    in_specs = [
        _spec((None, None, bq, pr.d_pad), q_map),
        _spec((None, None, bk, pr.d_pad), kv_map),
        _spec((None, None, bk, pr.dv_pad), kv_map),
    ]
    args = [q, k, v]
    if segs is not None:
        in_specs += [
            _spec((None, bq, LANES), lambda b, h, i, j: (b, i, 0)),
            _spec((None, SUBLANES, bk), lambda b, h, i, j: (b, 0, kv_block(i, j))),
        ]
        args += list(segs)
    out_shape = [
        jax.ShapeDtypeStruct((pr.b, pr.hq, pr.sq_pad, pr.dv_pad), pr.dtype),
        jax.ShapeDtypeStruct((pr.b, pr.hq, pr.sq_pad, LANES), jnp.float32),
    ]
    out_specs = [
        _spec((None, None, bq, pr.dv_pad), q_map),
        _spec((None, None, bq, LANES), q_map),
    ]
    scratch = [
        _compat.vmem((bq, LANES), jnp.float32),  # running max
        _compat.vmem((bq, LANES), jnp.float32),  # running denominator
        _compat.vmem((bq, pr.dv_pad), jnp.float32),  # output accumulator
    ]
    out, lse = _pallas_call(
        pr,
        functools.partial(_flash_attention_fwd_kernel, pr=pr),
        out_shape=out_shape,
        grid=(pr.b, pr.hq, pr.nq, pr.nk),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch,
        compiler_params=_compat.tpu_compiler_params(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=pr.interpret,
        name="ejkernel_flash_attention_fwd",
    )(*args)
    return out, lse


def _bwd_dq_call(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    do: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    segs: tuple[jax.Array, jax.Array] | None,
    pr: _Problem,
) -> jax.Array:
    """dQ over grid (B, Hq, nq, nk): [B, Hq, Sq_pad, D_pad] in the query dtype."""
    bq, bk, group = pr.bq, pr.bk, pr.group

    def kv_block(i: Any, j: Any) -> Any:
        first, last = pr.vis.kv_blocks(i, bq, bk, pr.nk)
        return jnp.clip(j, first, last)

    q_map = lambda b, h, i, j: (b, h, i, 0)
    kv_map = lambda b, h, i, j: (b, h // group, kv_block(i, j), 0)
    in_specs = [
        _spec((None, None, bq, pr.d_pad), q_map),
        _spec((None, None, bk, pr.d_pad), kv_map),
        _spec((None, None, bk, pr.dv_pad), kv_map),
        _spec((None, None, bq, pr.dv_pad), q_map),
        _spec((None, None, bq, LANES), q_map),
        _spec((None, None, bq, LANES), q_map),
    ]
    args = [q, k, v, do, lse, delta]
    if segs is not None:
        in_specs += [
            _spec((None, bq, LANES), lambda b, h, i, j: (b, i, 0)),
            _spec((None, SUBLANES, bk), lambda b, h, i, j: (b, 0, kv_block(i, j))),
        ]
        args += list(segs)
    return _pallas_call(
        pr,
        functools.partial(_bwd_dq_kernel, pr=pr),
        out_shape=jax.ShapeDtypeStruct((pr.b, pr.hq, pr.sq_pad, pr.d_pad), pr.dtype),
        grid=(pr.b, pr.hq, pr.nq, pr.nk),
        in_specs=in_specs,
        out_specs=_spec((None, None, bq, pr.d_pad), q_map),
        scratch_shapes=[_compat.vmem((bq, pr.d_pad), jnp.float32)],
        compiler_params=_compat.tpu_compiler_params(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=pr.interpret,
        name="ejkernel_flash_attention_bwd_dq",
    )(*args)


def _bwd_dkv_call(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    do: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    segs: tuple[jax.Array, jax.Array] | None,
    pr: _Problem,
) -> tuple[jax.Array, jax.Array]:
    """dK, dV over grid (B, Hkv, nk, G, nq): the G query heads of a kv head accumulate in VMEM."""
    bq, bk, group = pr.bq, pr.bk, pr.group

    def q_block(j: Any, i: Any) -> Any:
        first, last = pr.vis.q_blocks(j, bq, bk, pr.nq)
        return jnp.clip(i, first, last)

    q_map = lambda b, h, j, g, i: (b, h * group + g, q_block(j, i), 0)
    kv_map = lambda b, h, j, g, i: (b, h, j, 0)
    in_specs = [
        _spec((None, None, bq, pr.d_pad), q_map),
        _spec((None, None, bk, pr.d_pad), kv_map),
        _spec((None, None, bk, pr.dv_pad), kv_map),
        _spec((None, None, bq, pr.dv_pad), q_map),
        _spec((None, None, bq, LANES), q_map),
        _spec((None, None, bq, LANES), q_map),
    ]
    args = [q, k, v, do, lse, delta]
    if segs is not None:
        in_specs += [
            _spec((None, bq, LANES), lambda b, h, j, g, i: (b, q_block(j, i), 0)),
            _spec((None, SUBLANES, bk), lambda b, h, j, g, i: (b, 0, j)),
        ]
        args += list(segs)
    return _pallas_call(
        pr,
        functools.partial(_bwd_dkv_kernel, pr=pr),
        out_shape=[
            jax.ShapeDtypeStruct((pr.b, pr.hkv, pr.sk_pad, pr.d_pad), pr.dtype),
            jax.ShapeDtypeStruct((pr.b, pr.hkv, pr.sk_pad, pr.dv_pad), pr.dtype),
        ],
        grid=(pr.b, pr.hkv, pr.nk, group, pr.nq),
        in_specs=in_specs,
        out_specs=[
            _spec((None, None, bk, pr.d_pad), kv_map),
            _spec((None, None, bk, pr.dv_pad), kv_map),
        ],
        scratch_shapes=[
            _compat.vmem((bk, pr.d_pad), jnp.float32),
            _compat.vmem((bk, pr.dv_pad), jnp.float32),
        ],
        compiler_params=_compat.tpu_compiler_params(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
        ),
        interpret=pr.interpret,
        name="ejkernel_flash_attention_bwd_dkv",
    )(*args)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def _pallas_call(pr: _Problem, kernel: Any, **kwargs: Any) -> Any:
    """``pl.pallas_call``; in interpret mode made vmappable one example at a time (the TPU
    interpreter's batching of a pallas_call fails on these block specs with jax 0.10)."""
    call = _compat.pl.pallas_call(kernel, **kwargs)
    return jax.custom_batching.sequential_vmap(call) if pr.interpret else call


def _when(cond: Any) -> Callable[[Callable[[], None]], None]:
    """``pl.when`` that also takes a Python bool (resolved at trace time)."""

    def run(fn: Callable[[], None]) -> None:
        if cond is True:
            fn()
        elif cond is not False:
            _compat.pl.when(cond)(fn)

    return run


def _precision(dtype: Any) -> Any:
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot(a: Any, b: Any, contract: tuple[int, int]) -> Any:
    """``a · b`` contracting ``a``'s axis ``contract[0]`` with ``b``'s ``contract[1]``, f32."""
    return lax.dot_general(
        a,
        b,
        (((contract[0],), (contract[1],)), ((), ())),
        precision=_precision(a.dtype),
        preferred_element_type=jnp.float32,
    )


def _visible(i: Any, j: Any, qs_ref: Any, ks_ref: Any, pr: _Problem) -> Any:
    """Bool [bq, bk] of block (i, j), or ``None`` when every entry is visible."""
    shape = (pr.bq, pr.bk)
    k_pos = j * pr.bk + lax.broadcasted_iota(jnp.int32, shape, 1)
    terms = []
    if pr.vis.restricted:
        q_idx = i * pr.bq + lax.broadcasted_iota(jnp.int32, shape, 0)
        terms.append(pr.vis.mask(q_idx, k_pos))
    if qs_ref is not None:
        q_ids = qs_ref[...][:, :1]  # lanes replicate one id per row
        k_ids = ks_ref[...][:1, :]  # sublanes replicate one id per column
        terms.append(jnp.logical_and(q_ids == k_ids, q_ids >= 0))  # padding: id -1
    elif pr.sk_pad != pr.sk:
        terms.append(k_pos < pr.sk)
    if not terms:
        return None
    return functools.reduce(jnp.logical_and, terms)


def _logits(q: Any, k: Any, pr: _Problem) -> tuple[Any, Any]:
    """Scaled (and soft-capped) logits [bq, bk] in f32, with the tanh for the backward."""
    s = _dot(q, k, (1, 1)) * pr.scale
    if pr.cap is None:
        return s, None
    tanh = jnp.tanh(s * (1.0 / pr.cap))
    return pr.cap * tanh, tanh


def _flash_attention_fwd_kernel(*refs: Any, pr: _Problem) -> None:
    if pr.segments:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
    else:
        q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
        qs_ref = ks_ref = None
    i, j = _compat.pl.program_id(2), _compat.pl.program_id(3)

    @_when(j == 0)
    def _init() -> None:
        m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @_when(pr.vis.block_may_see(i, j, pr.bq, pr.bk))
    def _step() -> None:
        v = v_ref[...]
        s, _ = _logits(q_ref[...], k_ref[...], pr)
        visible = _visible(i, j, qs_ref, ks_ref, pr)
        if visible is not None:
            s = jnp.where(visible, s, MASK_VALUE)
        m_prev = m_sc[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [bq, LANES]
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, :1])
        if visible is not None:
            p = jnp.where(visible, p, 0.0)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_next
        acc_sc[...] = acc_sc[...] * alpha[:, :1] + _dot(p.astype(v.dtype), v, (1, 0))

    @_when(j == pr.nk - 1)
    def _finish() -> None:
        denom = l_sc[...]
        empty = denom == 0.0
        safe = jnp.where(empty, 1.0, denom)
        o_ref[...] = (acc_sc[...] / safe[:, :1]).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, EMPTY_ROW_LSE, m_sc[...] + jnp.log(safe))


def _probabilities_and_ds(
    q: Any, k: Any, v: Any, do: Any, lse: Any, delta: Any, visible: Any, pr: _Problem
) -> tuple[Any, Any]:
    """Recomputed P [bq, bk] and dS = P ∘ (dP - Δ) (through the soft cap), both f32."""
    s, tanh = _logits(q, k, pr)
    p = jnp.exp(s - lse[:, :1])
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    dp = _dot(do, v, (1, 1))
    ds = p * (dp - delta[:, :1])
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    return p, ds


def _bwd_dq_kernel(*refs: Any, pr: _Problem) -> None:
    if pr.segments:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, dq_ref, dq_sc = refs
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_sc = refs
        qs_ref = ks_ref = None
    i, j = _compat.pl.program_id(2), _compat.pl.program_id(3)

    @_when(j == 0)
    def _init() -> None:
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @_when(pr.vis.block_may_see(i, j, pr.bq, pr.bk))
    def _step() -> None:
        k = k_ref[...]
        visible = _visible(i, j, qs_ref, ks_ref, pr)
        _, ds = _probabilities_and_ds(
            q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], visible, pr
        )
        dq_sc[...] += _dot(ds.astype(k.dtype), k, (1, 0))

    @_when(j == pr.nk - 1)
    def _finish() -> None:
        dq_ref[...] = (dq_sc[...] * pr.scale).astype(dq_ref.dtype)


def _bwd_dkv_kernel(*refs: Any, pr: _Problem) -> None:
    if pr.segments:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref) = refs[:8]
        dk_ref, dv_ref, dk_sc, dv_sc = refs[8:]
    else:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
        dk_ref, dv_ref, dk_sc, dv_sc = refs[6:]
        qs_ref = ks_ref = None
    pl = _compat.pl
    j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @_when(jnp.logical_and(g == 0, i == 0))
    def _init() -> None:
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @_when(pr.vis.block_may_see(i, j, pr.bq, pr.bk))
    def _step() -> None:
        q, do = q_ref[...], do_ref[...]
        visible = _visible(i, j, qs_ref, ks_ref, pr)
        p, ds = _probabilities_and_ds(
            q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], visible, pr
        )
        dv_sc[...] += _dot(p.astype(do.dtype), do, (0, 0))
        dk_sc[...] += _dot(ds.astype(q.dtype), q, (0, 0))

    @_when(jnp.logical_and(g == pr.group - 1, i == pr.nq - 1))
    def _finish() -> None:
        dk_ref[...] = (dk_sc[...] * pr.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)
