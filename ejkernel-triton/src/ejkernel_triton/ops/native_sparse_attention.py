"""native_sparse_attention in Triton: the registered entry, the config, heuristic, config space
and ``supports``.

NSA (semantics: :mod:`ejkernel.specs.native_sparse_attention`) in three parts, differentiated
by JAX around custom VJPs:

- the compressed branch and the selection: the complete blocks of every sequence are
  mean-pooled into at most ``S // bs`` compressed tokens per batch row (in JAX), every query
  attends to those of its own sequence that lie wholly in its past, and without
  ``block_indices`` each visible block's probability averaged over the query's group scores it
  for the selection (:func:`ejkernel.specs.native_sparse_attention.nsa_select_blocks`): the
  Triton kernels of :mod:`ejkernel_triton.kernels.nsa_compressed`; :func:`supports` declines
  calls whose scores ``[B, S, Hkv, ceil(S / bs)]`` would pass :data:`COMPRESSED_BYTES`, which
  the XLA platform serves in query chunks;
- the selected branch, the Triton kernels of :mod:`ejkernel_triton.kernels.nsa_selected`
  (a repeated block keeps its first slot only);
- the sliding-window branch, Triton flash attention (``sliding_window = (W - 1, 0)``, causal,
  the packed sequences as segment ids).

Keys and values go in through :func:`ejkernel.attention_semantics.finite_or_zero`, as the spec
reads them.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

import ejkernel
from ejkernel.attention_semantics import finite_or_zero
from ejkernel.specs.native_sparse_attention import nsa_select_blocks, sequence_layout
from ejkernel_triton import _launch
from ejkernel_triton._launch import BATCH, OTHER

__all__ = [
    "COMPRESSED_BYTES",
    "NativeSparseAttentionConfig",
    "config_space",
    "heuristic",
    "native_sparse_attention_triton",
    "supports",
]

_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_MAX_HEAD_DIM = 256
_MAX_BLOCK = 256
#: Bytes the selection's float32 scores (``[B, S, Hkv, ceil(S / block_size)]``) may take.
COMPRESSED_BYTES = 1 << 30


@attrs.frozen(kw_only=True)
class NativeSparseAttentionConfig:
    """Tunables of the Triton NSA's selected-branch kernels.

    Attributes:
        num_warps: warps per program (one program per query token and KV head).
        num_stages: software-pipelining stages of the walk over the selected blocks.
    """

    num_warps: int = 4
    num_stages: int = 2


def supports(inv: Any) -> bool | str:
    """True, or why not: dtypes other than bf16/f16/f32, head dims over 256, blocks over 256
    tokens, or selection scores over :data:`COMPRESSED_BYTES`."""
    a = inv.kwargs
    q, k, v = a["query"], a["key"], a["value"]
    if q.dtype not in _DTYPES or len({q.dtype, k.dtype, v.dtype}) != 1:
        return f"query/key/value dtypes {q.dtype}, {k.dtype}, {v.dtype} (one of bf16, f16, f32)"
    if max(q.shape[-1], v.shape[-1]) > _MAX_HEAD_DIM:
        return f"head dims D {q.shape[-1]}, Dv {v.shape[-1]} over {_MAX_HEAD_DIM}"
    bs = a.get("block_size", 64)
    if bs > _MAX_BLOCK:
        return f"block_size {bs} over {_MAX_BLOCK}"
    b, s = q.shape[:2]
    scores = 4 * b * s * k.shape[2] * -(-s // bs)
    if scores > COMPRESSED_BYTES:
        return (
            f"the selection's scores would take {scores / 2**30:.1f} GiB "
            f"(over {COMPRESSED_BYTES / 2**30:.0f} GiB; the XLA platform chunks them)"
        )
    return True


def heuristic(inv: Any) -> NativeSparseAttentionConfig:
    """4 warps, the walk over the selected blocks pipelined two deep (the next block's keys
    and values load while this one's are used), the fastest on an H200 at S 16384 with 64
    query heads in 4 groups (benchmarks/RESULTS.md, ``bench_native_sparse_attention.py
    --configs``)."""
    del inv
    return NativeSparseAttentionConfig()


def config_space(inv: Any) -> list[NativeSparseAttentionConfig]:
    """The heuristic, then three stages, none, and 8 warps."""
    base = heuristic(inv)
    if _launch.interpreting():
        return [base]
    return [
        base,
        attrs.evolve(base, num_stages=3),
        attrs.evolve(base, num_stages=1),
        attrs.evolve(base, num_warps=8),
    ]


def native_sparse_attention_triton(
    *, cfg: NativeSparseAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """NSA: compressed, selected and sliding-window branches mixed by their gates.

    Args:
        cfg: the selected-branch kernels' warps and stages; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.native_sparse_attention`'s arguments by name, as its spec
            validated them.

    Returns:
        [B, S, Hq, Dv] in the query dtype.
    """
    cfg = cfg or NativeSparseAttentionConfig()
    q, g_cmp, g_slc, g_swa = args["query"], args["g_cmp"], args["g_slc"], args.get("g_swa")
    k, v = finite_or_zero(args["key"]), finite_or_zero(args["value"])
    bs, window, cu = args.get("block_size", 64), args.get("window_size", 0), args.get("cu_seqlens")
    b, s, _, d = q.shape
    scale = args.get("softmax_scale")
    scale = d**-0.5 if scale is None else scale
    seq, start, pos = sequence_layout(b, s, cu)
    o_cmp, p_blocks = _compressed(q, k, v, seq, pos, cu, bs, scale)
    idx = args.get("block_indices")
    if idx is None:
        idx = nsa_select_blocks(
            p_blocks,
            pos,
            block_size=bs,
            block_counts=args.get("block_counts", 16),
            num_blocks=-(-s // bs),
        )
    blocks = -(-s // bs) + (0 if cu is None else cu.shape[0] - 1)  # key blocks at the most
    o_slc = _selected(q, k, v, _first_slots(idx), start[0], float(scale), bs, blocks, cfg)
    f32 = jnp.float32
    out = g_cmp.astype(f32)[..., None] * o_cmp + g_slc.astype(f32)[..., None] * o_slc
    if window > 0 and g_swa is not None:
        seg = None if cu is None else seq
        o_swa = ejkernel.flash_attention(
            q,
            k,
            v,
            causal=True,
            sliding_window=(window - 1, 0),
            softmax_scale=scale,
            q_segment_ids=seg,
            kv_segment_ids=seg,
            platform="triton",
        )
        out = out + g_swa.astype(f32)[..., None] * o_swa.astype(f32)
    return out.astype(q.dtype)


# -- the compressed branch and the selection ------------------------------------------------


def _compressed(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seq: jax.Array,
    pos: jax.Array,
    cu: jax.Array | None,
    bs: int,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """``(o_cmp [B, S, Hq, Dv] float32, p [B, S, Hkv, 1, NB])``: the compressed branch's output
    and each query's probabilities of the blocks ``0 .. NB-1`` of its sequence, averaged over
    the group's heads (the selection's scores), from the Triton kernels of
    :mod:`ejkernel_triton.kernels.nsa_compressed`."""
    s = q.shape[1]
    nb, tc = -(-s // bs), max(1, s // bs)
    m = jnp.arange(tc, dtype=jnp.int32)
    if cu is None:
        first = jnp.zeros((1,), jnp.int32)
        row0 = m * bs
    else:
        cu = cu.astype(jnp.int32)
        complete = (cu[1:] - cu[:-1]) // bs  # complete blocks of each sequence
        first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(complete)])
        j_m = jnp.minimum(jnp.searchsorted(first[1:], m, side="right"), complete.shape[0] - 1)
        row0 = cu[j_m] + (m - first[j_m]) * bs
    rows = jnp.clip(row0[:, None] + jnp.arange(bs), 0, s - 1)  # [TC, bs]
    f32 = jnp.float32
    k_cmp = jnp.mean(k[:, rows].astype(f32), axis=2)  # [B, TC, Hkv, D]
    v_cmp = jnp.mean(v[:, rows].astype(f32), axis=2)
    own = seq[0] if cu is not None else jnp.zeros((s,), jnp.int32)
    lo = first[own].astype(jnp.int32)  # each query's first compressed token
    cnt = ((pos[0] + 1) // bs).astype(jnp.int32)  # the complete blocks that end by it
    o_cmp, lse = _compressed_attention(q, k_cmp, v_cmp, lo, cnt, float(scale))
    scores = _scores(*jax.lax.stop_gradient((q, k_cmp, lse)), lo, cnt, float(scale), nb)
    return o_cmp, scores[:, :, :, None, :]


def _first_slots(idx: jax.Array) -> jax.Array:
    """The selection with each block in its first slot only (repeats and negatives: -1)."""
    idx = idx.astype(jnp.int32)
    t = idx.shape[-1]
    earlier = jnp.tril(jnp.ones((t, t), bool), -1)  # [i, j]: j before i
    repeat = jnp.any((idx[..., :, None] == idx[..., None, :]) & earlier, axis=-1)
    return jnp.where(repeat | (idx < 0), -1, idx)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _compressed_attention(
    q: jax.Array, kc: jax.Array, vc: jax.Array, lo: jax.Array, cnt: jax.Array, scale: float
) -> tuple[jax.Array, jax.Array]:
    """The compressed branch's output ``[B, S, Hq, Dv]`` and log2-sum-exp ``[B, S, Hq]``
    (float32; the latter's cotangent is taken as zero: only the selection reads it)."""
    return _compressed_fwd(q, kc, vc, lo, cnt, scale)[0]


def _compressed_fwd(q, kc, vc, lo, cnt, scale):
    run = _launch.fold_vmap(_compressed_kernel("fwd", scale), (BATCH,) * 3 + (OTHER,) * 2)
    o, lse = run(q, kc, vc, lo, cnt)
    return (o, lse), (q, kc, vc, lo, cnt, o, lse)


def _compressed_bwd(scale, res, cotangents):
    q, kc, vc, lo, cnt, o, lse = res
    d_o = cotangents[0]
    delta = jnp.sum(d_o * o, axis=-1)
    modes = (BATCH,) * 3 + (OTHER,) * 2 + (BATCH,) * 3
    (dq,) = _launch.fold_vmap(_compressed_kernel("dq", scale), modes)(
        q, kc, vc, lo, cnt, d_o, lse, delta
    )
    dkc, dvc = _launch.fold_vmap(_compressed_kernel("dkv", scale), modes)(
        q, kc, vc, lo, cnt, d_o, lse, delta
    )
    return dq.astype(q.dtype), dkc, dvc, None, None


_compressed_attention.defvjp(_compressed_fwd, _compressed_bwd)


def _scores(q, kc, lse, lo, cnt, scale: float, nb: int) -> jax.Array:
    """Each query's block probabilities averaged over its group ``[B, S, Hkv, NB]``."""
    run = _launch.fold_vmap(
        _compressed_kernel("scores", scale, nb), (BATCH,) * 2 + (OTHER,) * 2 + (BATCH,)
    )
    (p,) = run(q, kc, lo, cnt, lse)
    return p


#: Compressed tokens a step of the compressed branch's kernels takes, and query tokens a
#: ``dkc``/``dvc`` program walks (16 of each in the interpreter, so that its tests split
#: them over several steps and programs).
_COMPRESSED_BLOCK = 32
_COMPRESSED_QUERIES = 256


def _compressed_kernel(which: str, scale: float, nb: int = 0) -> Any:
    """The launch of one of :mod:`ejkernel_triton.kernels.nsa_compressed`'s kernels (``fwd``,
    ``scores``, ``dq``, ``dkv``), as a function of its arrays."""
    from ejkernel_triton.kernels import nsa_compressed as kernels

    f32 = jnp.float32

    def launch(kernel: Any, arrays: tuple[Any, ...], out_shape: list[Any], **extra: Any) -> Any:
        q, kc = arrays[0], arrays[1]
        b, s, hq, d = q.shape
        tc, hkv = kc.shape[1], kc.shape[2]
        dv = arrays[2].shape[-1] if which != "scores" else d
        pow2 = lambda n: max(16, 1 << (int(n) - 1).bit_length())
        sizes = {
            "G": hq // hkv,
            "D": d,
            "DV": dv,
            "BG": pow2(hq // hkv),
            "BD": pow2(d),
            "BDV": pow2(dv),
            "BM": 16 if _launch.interpreting() else _COMPRESSED_BLOCK,
            "DOT_PRECISION": "ieee" if jnp.dtype(q.dtype) == jnp.float32 else "tf32",
        }
        scalars = (np.float32(scale), s, tc, hkv) + ((nb,) if which == "scores" else ())
        grid = (s, b * hkv)
        if which == "dkv":
            tq = 16 if _launch.interpreting() else _COMPRESSED_QUERIES
            grid = (-(-tc // sizes["BM"]), -(-s // tq), b * hkv)
            extra.update(TQ=tq, BT=max(1, 64 // sizes["BG"]))
        return _launch.launch(
            kernel,
            *arrays,
            *scalars,
            out_shape=out_shape,
            grid=grid,
            num_warps=4,
            num_stages=1,
            **sizes,
            **extra,
        )

    def fwd(q, kc, vc, lo, cnt):
        b, s, hq, _ = q.shape
        out = [
            jax.ShapeDtypeStruct((b, s, hq, vc.shape[-1]), f32),
            jax.ShapeDtypeStruct((b, s, hq), f32),
        ]
        return launch(kernels.nsa_compressed_fwd_kernel, (q, kc, vc, lo, cnt), out)

    def scores(q, kc, lo, cnt, lse):
        b, s = q.shape[:2]
        out = [jax.ShapeDtypeStruct((b, s, kc.shape[2], nb), f32)]
        args = (q, kc, lo, cnt, lse)
        return launch(kernels.nsa_compressed_scores_kernel, args, out, zeroed_outputs=(0,))

    def dq(*args):
        out = [jax.ShapeDtypeStruct(args[0].shape, f32)]
        return launch(kernels.nsa_compressed_bwd_dq_kernel, args, out)

    def dkv(*args):
        out = [jax.ShapeDtypeStruct(args[1].shape, f32), jax.ShapeDtypeStruct(args[2].shape, f32)]
        return launch(kernels.nsa_compressed_bwd_dkv_kernel, args, out, zeroed_outputs=(0, 1))

    return {"fwd": fwd, "scores": scores, "dq": dq, "dkv": dkv}[which]


# -- the selected branch (Triton) -----------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _selected(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    idx: jax.Array,
    start: jax.Array,
    scale: float,
    bs: int,
    blocks: int,
    cfg: NativeSparseAttentionConfig,
) -> jax.Array:
    """The selected branch's output ``[B, S, Hq, Dv]`` (float32); ``blocks`` bounds the key
    blocks a batch row has (``ceil(S / bs)``, plus one per packed sequence)."""
    return _selected_fwd(q, k, v, idx, start, scale, bs, blocks, cfg)[0]


def _selected_fwd(q, k, v, idx, start, scale, bs, blocks, cfg):
    run = _launch.fold_vmap(_forward_kernel(scale, bs, cfg), (BATCH,) * 4 + (OTHER,))
    o, lse = run(q, k, v, idx, start)
    return o, (q, k, v, idx, start, o, lse)


def _selected_bwd(scale, bs, blocks, cfg, res, d_o):
    q, k, v, idx, start, o, lse = res
    delta = jnp.sum(d_o * o, axis=-1)
    d_o = d_o.astype(q.dtype)
    run = _launch.fold_vmap(
        _backward_kernel(scale, bs, cfg), (BATCH,) * 4 + (OTHER,) + (BATCH,) * 3
    )
    (dq,) = run(q, k, v, idx, start, d_o, lse, delta)
    per_item = _pairs_per_item()
    tok, items = pairs_by_block(idx, start, bs, blocks, per_item)
    run = _launch.fold_vmap(_dkv_kernel(scale, bs, cfg), (BATCH,) * 8)
    dk, dv = run(q, k, v, d_o, lse, delta, tok, items)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None


_selected.defvjp(_selected_fwd, _selected_bwd)


def _pairs_per_item() -> int:
    """Pairs a ``dk``/``dv`` program walks at the most (few in the interpreter, so that its
    tests split blocks over several programs)."""
    return 4 if _launch.interpreting() else 256


def pairs_by_block(
    idx: jax.Array, start: jax.Array, bs: int, blocks: int, per_item: int
) -> tuple[jax.Array, jax.Array]:
    """The (query token, block) pairs of a selection sorted by block, and their work items.

    Args:
        idx: ``[B, S, Hkv, T]`` int32, each block in its first slot (``-1`` elsewhere).
        start: ``[S]`` int32, each token's sequence start.
        bs: tokens per block.
        blocks: the most key blocks a batch row has.
        per_item: pairs per item at the most.

    Returns:
        ``tok [B, Hkv, S·T]`` (int32): the query token of each pair, pairs ordered by their
        block's first key row (a block the query cannot see, one starting after it, is left
        out: its pairs sort last and no item reads them); ``items [B, Hkv, W, 3]`` (int32): a
        block's first key row and a run ``[lo, hi)`` of at most ``per_item`` of its pairs, the
        unused items empty (``lo = hi = 0``), ``W = blocks + ceil(S·T / per_item)``.
    """
    b, s, hkv, t = idx.shape
    tokens = jnp.arange(s, dtype=jnp.int32)
    live = (idx >= 0) & (idx * bs <= (tokens - start)[None, :, None, None])
    first_row = jnp.where(live, start[None, :, None, None] + idx * bs, s)
    key = first_row.transpose(0, 2, 1, 3).reshape(b, hkv, s * t)
    order = jnp.argsort(key, axis=-1, stable=True)
    tok = (order // t).astype(jnp.int32)
    offs = _rows_search(jnp.take_along_axis(key, order, -1), jnp.arange(s + 1), "left")
    runs = -(-(offs[..., 1:] - offs[..., :-1]) // per_item)  # items of the block at row r
    ends = jnp.cumsum(runs, axis=-1)
    w = blocks + -(-s * t // per_item)
    row = _rows_search(ends, jnp.arange(w), "right")  # s: past the last item
    used = row < s
    row = jnp.minimum(row, s - 1)
    nth = jnp.arange(w) - (jnp.take_along_axis(ends, row, -1) - jnp.take_along_axis(runs, row, -1))
    lo = jnp.take_along_axis(offs, row, -1) + nth * per_item
    hi = jnp.minimum(jnp.take_along_axis(offs, row + 1, -1), lo + per_item)
    items = jnp.stack([row, jnp.where(used, lo, 0), jnp.where(used, hi, 0)], axis=-1)
    return tok, items.astype(jnp.int32)


def _sizes(q: jax.Array, k: jax.Array, v: jax.Array, bs: int) -> dict[str, Any]:
    pow2 = lambda n: max(16, 1 << (int(n) - 1).bit_length())
    group, d, dv = q.shape[2] // k.shape[2], q.shape[-1], v.shape[-1]
    return {
        "G": group,
        "D": d,
        "DV": dv,
        "BS_TRUE": bs,
        "BG": pow2(group),
        "BD": pow2(d),
        "BDV": pow2(dv),
        "BS": pow2(bs),
        "DOT_PRECISION": "ieee" if jnp.dtype(q.dtype) == jnp.float32 else "tf32",
    }


def _forward_kernel(scale: float, bs: int, cfg: NativeSparseAttentionConfig) -> Any:
    from ejkernel_triton.kernels.nsa_selected import nsa_selected_fwd_kernel

    def run(q, k, v, idx, start):
        b, s, hq, _ = q.shape
        hkv, t, dv = k.shape[2], idx.shape[-1], v.shape[-1]
        f32 = jnp.float32
        return _launch.launch(
            nsa_selected_fwd_kernel,
            q,
            k,
            v,
            idx,
            start,
            np.float32(scale),
            s,
            hkv,
            t,
            out_shape=[
                jax.ShapeDtypeStruct((b, s, hq, dv), f32),
                jax.ShapeDtypeStruct((b, s, hq), f32),
            ],
            grid=(s, b * hkv),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **_sizes(q, k, v, bs),
        )

    return run


def _backward_kernel(scale: float, bs: int, cfg: NativeSparseAttentionConfig) -> Any:
    from ejkernel_triton.kernels.nsa_selected import nsa_selected_bwd_kernel

    def run(q, k, v, idx, start, d_o, lse, delta):
        s, hkv, t = q.shape[1], k.shape[2], idx.shape[-1]
        return _launch.launch(
            nsa_selected_bwd_kernel,
            q,
            k,
            v,
            idx,
            start,
            d_o,
            lse,
            delta,
            np.float32(scale),
            s,
            hkv,
            t,
            out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
            grid=(s, q.shape[0] * hkv),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **_sizes(q, k, v, bs),
        )

    return run


def _rows_search(sorted_rows: jax.Array, x: jax.Array, side: str) -> jax.Array:
    """``searchsorted`` of ``x`` in each row of ``sorted_rows [B, Hkv, N]``."""
    one = lambda a: jnp.searchsorted(a, x.astype(a.dtype), side=side)
    return jax.vmap(jax.vmap(one))(sorted_rows)


def _dkv_kernel(scale: float, bs: int, cfg: NativeSparseAttentionConfig) -> Any:
    from ejkernel_triton.kernels.nsa_selected import nsa_selected_bwd_dkv_kernel

    def run(q, k, v, d_o, lse, delta, tok, items):
        b, s, hkv = k.shape[:3]
        f32 = jnp.float32
        sizes = _sizes(q, k, v, bs)
        return _launch.launch(
            nsa_selected_bwd_dkv_kernel,
            q,
            k,
            v,
            d_o,
            lse,
            delta,
            tok,
            items,
            np.float32(scale),
            s,
            hkv,
            tok.shape[-1],
            items.shape[2],
            out_shape=[
                jax.ShapeDtypeStruct(k.shape, f32),
                jax.ShapeDtypeStruct(v.shape, f32),
            ],
            grid=(items.shape[2], b * hkv),
            zeroed_outputs=(0, 1),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            BT=max(1, 64 // sizes["BG"]),
            **sizes,
        )

    return run
