"""blocksparse_attention (Triton): the config, what is served, the heuristic and the config
space.

The kernels' tiles live inside the mask's blocks: a program's ``BLOCK_M`` rows belong to one
query block and each step's ``BLOCK_N`` keys to one key block (:func:`kernel_blocks` fits a
config's tiles to the blocks: at most the block rounded up to a power of two, at least 16,
the smallest ``tl.dot``). A block larger than a tile is walked in several tiles; a tile that
overruns a block that is not a multiple of it is masked at the block's end. The
``warp_specialized`` kernels take the mask's blocks as their tiles (:func:`ws_tiles`).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax.numpy as jnp

from ejkernel.ops import BwdParams, FwdParams, prune_by_shared_memory
from ejkernel_triton import _launch
from ejkernel_triton._launch import pow2
from ejkernel_triton.ops.flash_attention_config import (
    Call,
    bwd_problem,
    bwd_smem,
    fwd_problem,
    fwd_smem,
    qkv_supported,
    resolve,
)

__all__ = [
    "VARIANTS",
    "BlocksparseAttentionConfig",
    "config_space",
    "heuristic",
    "kernel_blocks",
    "kernel_smem",
    "supports",
    "variant_problem",
    "ws_tiles",
]


#: The kernels a config can name (:attr:`BlocksparseAttentionConfig.fwd_variant`,
#: ``bwd_variant``).
VARIANTS = ("usual", "warp_specialized")


@attrs.frozen(kw_only=True)
class BlocksparseAttentionConfig:
    """Tunables of the Triton block-sparse attention.

    Attributes:
        fwd_params: the forward kernel: ``q_blocksize`` rows per program, ``kv_blocksize``
            keys per step, ``num_warps``, ``num_stages``.
        bwd_params: the dK/dV kernel: ``kv_blocksize`` keys per program, ``q_blocksize``
            query rows per step, warps, stages.
        dq_params: the dQ kernel: ``q_blocksize`` rows per program, ``kv_blocksize`` keys per
            step, warps, stages.
        scale_in_exponent: the forward folds the softmax scale into the exponent on whole
            blocks when nothing is masked or added and the scale is ≥ 0.
        fwd_variant: the forward kernel: ``usual`` (every feature, ``fwd_params``' tiles) or
            ``warp_specialized`` (Hopper: flash attention's persistent warp-specialized
            forward walking the lists, for plain calls whose mask blocks are its tile; see
            :func:`variant_problem`; ``fwd_params`` unused). A variant that cannot serve the
            call raises ``ValueError``.
        bwd_variant: the backward kernels: ``usual`` (``bwd_params`` and ``dq_params``) or
            ``warp_specialized`` (flash attention's warp-specialized dQ and dK/dV kernels
            walking the lists, the same calls; the params unused).

    Block sizes are fitted to the mask's blocks (:func:`kernel_blocks`); ``None`` fields take
    the defaults (64 × 64 forward, 32-row steps × 64 keys for dK/dV, 64 × 32 for dQ, 4 warps,
    2 stages).
    """

    fwd_params: FwdParams = attrs.field(factory=FwdParams)
    bwd_params: BwdParams = attrs.field(factory=BwdParams)
    dq_params: FwdParams = attrs.field(factory=FwdParams)
    scale_in_exponent: bool = True
    fwd_variant: str = attrs.field(default="usual", validator=attrs.validators.in_(VARIANTS))
    bwd_variant: str = attrs.field(default="usual", validator=attrs.validators.in_(VARIANTS))


def ws_tiles(block_size: tuple[int, int], interpreting: bool) -> dict[str, tuple[Any, Any]]:
    """The warp-specialized kernels' tiles for the mask's blocks ``(bq, bk)``, by pass
    (``"fwd"``, ``"dq"``, ``"bwd"``): ``(params, why they cannot run)``. The forward and dQ
    tiles are the blocks; dK/dV steps half a query block (``BLOCK_M = bq / 2``) over a key
    block. On a GPU they must be the tiles the kernels are validated in (flash attention's
    :func:`ejkernel_triton.ops.flash_attention_config.resolve`: 128 × 128 blocks)."""
    bq, bk = block_size
    rows = FwdParams(q_blocksize=bq, kv_blocksize=bk)
    steps = BwdParams(q_blocksize=max(16, bq // 2), kv_blocksize=bk)
    return {
        "fwd": resolve("fwd", "warp_specialized", rows, interpreting),
        "dq": resolve("dq", "warp_specialized", rows, interpreting),
        "bwd": resolve("bwd", "warp_specialized", steps, interpreting),
    }


def variant_problem(cfg: BlocksparseAttentionConfig, kw: Any, passes: str) -> str | None:
    """Why ``cfg``'s variants of ``passes`` (``"fwd"``, ``"bwd"``) cannot serve the call ``kw``
    (``None``: they can). The ``warp_specialized`` kernels take flash attention's plain case on
    Hopper (:func:`ejkernel_triton.ops.flash_attention_config.fwd_problem`) with the mask's
    blocks as their tiles (:func:`ws_tiles`); the interpreter takes any blocks of a power of
    two from 16."""
    variants = {"fwd": cfg.fwd_variant, "bwd": cfg.bwd_variant}
    kinds = [kind for kind in passes.split(",") if variants[kind] != "usual"]
    if not kinds:
        return None
    call = Call.of(kw)
    bq, bk = tuple(kw.get("block_size") or (128, 128))
    for kind in kinds:
        why = (fwd_problem if kind == "fwd" else bwd_problem)("warp_specialized", call)
        if not why and (min(bq, bk) < 16 or bq & (bq - 1) or bk & (bk - 1)):
            why = f"its tiles are the mask's blocks, powers of two from 16; got {(bq, bk)}"
        if not why:
            tiles = ws_tiles((bq, bk), call.interpreting)
            wrong = [tiles[k][1] for k in (("fwd",) if kind == "fwd" else ("dq", "bwd"))]
            why = next((f"its tiles are the mask's blocks: {w}" for w in wrong if w), None)
        if why:
            return f"{kind}_variant={variants[kind]!r}: {why}"
    return None


def kernel_blocks(
    params: Any, block_size: tuple[int, int], rows: int, keys: int
) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)`` of a kernel: ``params``' ``q_blocksize``/``kv_blocksize`` (or
    ``rows``/``keys``), at most the mask's block rounded up to a power of two, at least 16."""
    bq, bk = block_size
    m = max(16, min(pow2(params.q_blocksize or rows), pow2(bq)))
    n = max(16, min(pow2(params.kv_blocksize or keys), pow2(bk)))
    return m, n


# -- what is served -------------------------------------------------------------------------


def supports(inv: Any) -> bool | str:
    """True, or why not: dtypes other than bf16/f16/f32, mixed dtypes, head dims over 256."""
    return qkv_supported(inv.kwargs)


# -- configs --------------------------------------------------------------------------------


def heuristic(inv: Any) -> BlocksparseAttentionConfig:
    """Tiles by head dim and dtype: 64 × 64 for the forward (128 rows at D ≤ 64 in 16-bit),
    32-row steps over 64 keys for dK/dV (64 at D ≤ 64), 64 × 32 for dQ; the backward on the
    ``warp_specialized`` kernels where they serve the call (Hopper, 128 × 128 blocks: faster
    than the usual ones at every density measured, where their forward is not at low
    density; benchmarks/RESULTS.md); in the interpreter, whose cost is per program, the mask's
    blocks whole (up to 64)."""
    a = inv.kwargs
    q, v = a["query"], a["value"]
    bq, bk = a.get("block_size") or (128, 128)
    if _launch.interpreting():
        fwd = FwdParams(q_blocksize=min(64, bq), kv_blocksize=min(64, bk), num_stages=1)
        bwd = BwdParams(q_blocksize=min(64, bq), kv_blocksize=min(64, bk), num_stages=1)
        return BlocksparseAttentionConfig(fwd_params=fwd, bwd_params=bwd, dq_params=fwd)
    d = pow2(max(q.shape[-1], v.shape[-1]))
    wide = d <= 64 and jnp.dtype(q.dtype).itemsize == 2
    fwd = FwdParams(
        q_blocksize=128 if wide else 64,
        kv_blocksize=64,
        num_warps=8 if wide else 4,
        num_stages=3,
    )
    bwd = BwdParams(q_blocksize=64 if d <= 64 else 32, kv_blocksize=64, num_warps=4, num_stages=2)
    dq = FwdParams(q_blocksize=64, kv_blocksize=64 if d <= 64 else 32, num_warps=4, num_stages=2)
    cfg = BlocksparseAttentionConfig(fwd_params=fwd, bwd_params=bwd, dq_params=dq)
    specialized = attrs.evolve(cfg, bwd_variant="warp_specialized")
    return specialized if variant_problem(specialized, a, "bwd") is None else cfg


#: The tiles the config space tries: (rows, keys, warps, stages).
_FWD_BLOCKS = ((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 2))
_BWD_BLOCKS = ((64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 8, 2), (32, 128, 4, 2))
_DQ_BLOCKS = ((64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2))


def config_space(inv: Any) -> list[BlocksparseAttentionConfig]:
    """The heuristic's config, then each pass's tiles from :data:`_FWD_BLOCKS`,
    :data:`_BWD_BLOCKS` and :data:`_DQ_BLOCKS` (a candidate changes one pass; the backward's
    on the usual kernels, the warp-specialized ones tile by the mask's blocks), the
    ``warp_specialized`` forward and the other backward variant where they can serve the
    call, minus those whose kernels need more shared memory than the device grants; the
    interpreter and float32 get the heuristic's only."""
    base = heuristic(inv)
    if _launch.interpreting() or jnp.dtype(inv.kwargs["query"].dtype) == jnp.float32:
        return [base]
    configs = [base]
    for field, params, blocks in (
        ("fwd_params", FwdParams, _FWD_BLOCKS),
        ("bwd_params", BwdParams, _BWD_BLOCKS),
        ("dq_params", FwdParams, _DQ_BLOCKS),
    ):
        for m, n, w, s in blocks:
            tile = params(q_blocksize=m, kv_blocksize=n, num_warps=w, num_stages=s)
            usual = {} if field == "fwd_params" else {"bwd_variant": "usual"}  # WS: mask tiles
            configs.append(attrs.evolve(base, **{field: tile}, **usual))
    other_bwd = "usual" if base.bwd_variant == "warp_specialized" else "warp_specialized"
    for variants in ({"fwd_variant": "warp_specialized"}, {"bwd_variant": other_bwd}):
        specialized = attrs.evolve(base, **variants)
        if variant_problem(specialized, inv.kwargs, "fwd,bwd") is None:
            configs.append(specialized)
    return prune_by_shared_memory(
        list(dict.fromkeys(configs)),
        functools.partial(_need, inv.kwargs, getattr(inv, "grad", True)),
        keep=(base,),
        what="blocksparse_attention (triton)",
    )


def _need(kw: Any, grad: bool, cfg: BlocksparseAttentionConfig) -> int:
    return max(kernel_smem(kw, cfg, grad=grad).values())


def kernel_smem(kw: Any, cfg: BlocksparseAttentionConfig, *, grad: bool = True) -> dict[str, int]:
    """Bytes of shared memory each kernel of ``cfg`` asks for on the call ``kw``: the forward
    (``"fwd"``) and, with ``grad``, the ``"dq"`` and ``"dkdv"`` kernels, at the tiles the
    launch runs (flash attention's usual kernels' formulas,
    :func:`ejkernel_triton.ops.flash_attention_config.fwd_smem` and ``bwd_smem``); a bias or
    mask adds its score tile to every stage after the first."""
    q, v = kw["query"], kw["value"]
    d, dv, size = pow2(q.shape[-1]), pow2(v.shape[-1]), jnp.dtype(q.dtype).itemsize
    bias, mask = kw.get("bias"), kw.get("attention_mask")
    per_score = (0 if bias is None else jnp.dtype(bias.dtype).itemsize) + (mask is not None)
    blocks = tuple(kw.get("block_size") or (128, 128))

    def scores(rows: int, cols: int, stages: int) -> int:
        return (stages - 1) * rows * cols * per_score

    p = cfg.fwd_params
    bm, bn = kernel_blocks(p, blocks, 64, 64)
    stages = p.num_stages or 2
    needs = {"fwd": fwd_smem(bm, bn, stages, d, dv, size) + scores(bm, bn, stages)}
    if grad:
        p = cfg.dq_params
        bm, bn = kernel_blocks(p, blocks, 64, 32)
        stages = p.num_stages or 2
        needs["dq"] = bwd_smem(bn, bm, stages, d, dv, size) + scores(bm, bn, stages)
        p = cfg.bwd_params
        bm, bn = kernel_blocks(p, blocks, 32, 64)
        stages = p.num_stages or 2
        tiles = bwd_smem(bm, bn, stages, d, dv, size, step_vectors=2)
        needs["dkdv"] = tiles + scores(bm, bn, stages)
    return needs
