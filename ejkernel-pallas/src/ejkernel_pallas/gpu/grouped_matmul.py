"""grouped_matmul as Pallas Mosaic-GPU kernels for Hopper: the grouped matmul (forward and
``d_lhs``) and the transposed grouped matmul (``tgmm``, ``d_rhs``).

**Tiles start where groups start.** A metadata pass in XLA (:func:`work_list`, on the traced
``group_sizes``) cuts every group into row tiles of ``block_m`` beginning at the group's first
row rounded down to a multiple of 8 (Mosaic GPU's TMA reads 8-row-aligned windows), so each
tile is one plain matmul ``lhs[tile] · rhs[g]`` and stores only its group's rows: the up to 7
rows of the previous group a first tile reads are computed and dropped, and a group's last
tile is short. Rows past ``sum(group_sizes)`` form a tail segment whose tiles store zeros
without a matmul. There are at most ``ceil(M / block_m) + G + 1`` tiles whatever the routing.

**gmm** (forward, and ``d_lhs = d_out · rhs[g]ᵀ``): persistent, one CTA per SM walking the
(tile, column block) items; three warpgroups, as in a Hopper dense matmul: a producer streams
``[block_m, block_k]`` slices of the tile and ``[block_k, 2·block_n]`` slices of ``rhs[g]`` (or
``[2·block_n, block_k]`` of the transposed layout) through a ring of ``stages`` shared-memory
slots with TMA (``emit_pipeline_warp_specialized``); two consumers each own ``block_n`` output
columns and accumulate with ``wgmma`` in float32. A tile's rows are stored as a binary ladder
of TMA stores (``rows = Σ 2^i``: one store per set bit, ``block_m`` rows at once for a full
tile), so a short tile writes exactly its rows and never touches the next group's. A CTA's
consecutive tiles run as one chained pipeline (Mosaic GPU's ``pipeline_state``, where the
steps fill the ring's slots evenly): the producer streams the next tile's slices while the
consumers finish and store the last one. The consumers stage their output through shared
memory in halves of the tile where a whole tile and 4 ring slots would not fit together
(bf16 at 128 × 2·128), so the ring keeps its 4 slots.

**tgmm** (``d_rhs[g] = lhs_gᵀ · d_out_g``): persistent over (group, row block of the output,
column block) items; the producer streams the group's rows in chunks of ``block_k``
(a dynamic trip count, from the group's first row), the consumers run ``wgmma`` with the
``lhs`` chunk transposed in shared memory. Chunks start at the group's first row rounded down
to 8; in the first and last chunk the rows outside the group are zeroed in both operands before
the matmul (they belong to the neighbouring groups, or lie past M where TMA reads zeros); an
empty group stores zeros.

Out-of-range reads rely on TMA's zero fill: K and N need not be multiples of the blocks, and
the last tile of a group may reach past M. K and N must be multiples of 8 (TMA's 16-byte
strides). bf16 and f16 inputs (``wgmma`` reads transposed 16-bit operands only), any floating
output dtype; everything else is declined (the XLA plugin serves it).

**Interpret mode** (CPU, tests): the same kernels in Mosaic GPU's interpreter, which models the
warpgroups, TMA copies and barriers; the matmuls are ``jnp.dot`` on the same shared-memory tiles
(its ``wgmma`` takes no transposed operand), and ``lhs``/``d_out`` get zero rows and K, N zero
columns appended first, standing in for the TMA zero fill it does not model. With XLA's
concurrency-optimized CPU scheduling on, the interpreted kernels can hang (warpgroup threads
left waiting on barriers); run them with
``XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false``, as the tests do.

The backward is the executor's custom VJP (``define_grouped_matmul_vjp``), each gradient in its
input's dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.ops import prune_by_shared_memory
from ejkernel.specs.grouped_matmul import define_grouped_matmul_vjp

# Not `_compat`: the `__repr__` attrs generates reads attrs' own `_compat` from this module.
from ejkernel_pallas import _compat as compat
from ejkernel_pallas.gpu import _smem, hopper_reason

__all__ = [
    "GroupedMatmulConfig",
    "config_space",
    "grouped_matmul_pallas",
    "heuristic",
    "smem_need",
    "supports",
    "work_list",
]

DTYPES = ("bfloat16", "float16")
#: K and N must be multiples of this (TMA strides are multiples of 16 bytes).
ALIGN = 8
#: (block_m, block_n per consumer, block_k) the config space offers; stages are added per
#: shared-memory budget.
BLOCKS = ((128, 128, 64), (64, 128, 64), (128, 64, 64), (64, 64, 64))
MAX_STAGES = 4
#: Registers the producer warpgroup keeps (the consumers get the rest).
PRODUCER_REGISTERS = 40
#: Row offsets of TMA windows are multiples of this (the 8-row tiling of the swizzled
#: shared-memory layout), so windows start up to 7 rows before their group.
ROW_ALIGN = 8
#: Columns of the arrays the kernels read are padded to multiples of this (the 128-byte
#: swizzle's tile of 16-bit entries); the shapes of MoE layers are, so nothing is copied there.
COL_ALIGN = 64
#: Opt-in shared memory per block of an H100/H200 (bytes).
HOPPER_SMEM = 232_448
#: SMs the interpreter pretends to have.
INTERPRET_SMS = 2


@attrs.frozen(kw_only=True)
class GroupedMatmulConfig:
    """Tunables of the Mosaic GPU grouped matmul (the same for all three products).

    Attributes:
        block_m: rows of ``lhs`` per tile (64 or 128); in ``tgmm`` the rows of a ``d_rhs`` tile.
        block_n: output columns of each of the two consumer warpgroups (64 or 128); a CTA
            covers ``2 · block_n``.
        block_k: contraction per pipeline step (64); in ``tgmm`` the rows of a chunk.
        stages: shared-memory ring slots of the producer (2-4).

    ``None`` takes :func:`heuristic`'s choice.
    """

    block_m: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_((64, 128)))
    )
    block_n: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_((64, 128)))
    )
    block_k: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_((32, 64)))
    )
    stages: int | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.in_(tuple(range(2, MAX_STAGES + 1)))),
    )


@attrs.frozen(kw_only=True)
class _Launch:
    """Static parameters of one product (hashable: a jit static)."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    store_m: int
    interpret: bool


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def _shapes(kw: Any) -> tuple[int, int, int, int]:
    """``(M, K, N, G)`` of validated arguments (arrays or abstract shapes)."""
    m, k = kw["lhs"].shape
    rhs = kw["rhs"].shape
    n = rhs[1] if kw.get("transpose_rhs") else rhs[2]
    return int(m), int(k), int(n), int(rhs[0])


def _kernel_smem(
    blocks: tuple[int, int, int, int], in_dtype: Any, out_dtype: Any, store_m: int | None = None
) -> int:
    """Shared memory of either kernel at ``(block_m, block_n, block_k, stages)``: the ring
    (an ``lhs`` slice and a ``2·block_n``-wide ``rhs`` slice a slot, or in ``tgmm`` the two
    chunks), the consumers' output staging (``store_m`` rows each, ``block_m`` unless said)
    and the ring's barriers."""
    bm, bn, bk, stages = blocks
    ring = [_smem.Buffer((stages, bm, bk), in_dtype), _smem.Buffer((stages, bk, 2 * bn), in_dtype)]
    out = _smem.Buffer((2, store_m or bm, bn), out_dtype, tiled=False)
    return _smem.nbytes([*ring, out, _smem.Barriers(4 * stages)])


def _both_smem(blocks: tuple[int, int, int, int], dtype: Any, out_dtype: Any, store_m: int) -> int:
    """The larger of the forward's and the gradients' kernels (outputs in ``out_dtype``, and
    gradients in the inputs' ``dtype``)."""
    return max(_kernel_smem(blocks, dtype, o, store_m) for o in (out_dtype, dtype))


def smem_need(kw: Any, cfg: GroupedMatmulConfig, *, grad: bool = True) -> int:
    """Bytes of shared memory the largest kernel of ``cfg`` allocates for the call ``kw``."""
    dtype = kw["lhs"].dtype
    out_dtype = kw.get("preferred_element_type") or dtype
    bm, bn, bk, stages, store_m = _blocks(kw, cfg)
    blocks = (bm, bn, bk, stages)
    if grad:
        return _both_smem(blocks, dtype, out_dtype, store_m)
    return _kernel_smem(blocks, dtype, out_dtype, store_m)


def _store_rows_that_fit(blocks: tuple[int, int, int, int], dtype: Any, out_dtype: Any) -> int:
    """Rows of the consumers' output staging: the whole tile, or half of it (stored in two
    rounds) where the ring's slots and a whole tile do not fit together."""
    bm = blocks[0]
    return bm if _both_smem(blocks, dtype, out_dtype, bm) <= _smem_limit() else bm // 2


def _stages_that_fit(blocks: tuple[int, int, int], dtype: Any, out_dtype: Any) -> int:
    """The most ring slots (up to :data:`MAX_STAGES`) shared memory holds beside a half-tile
    output staging: slots hide the loads' latency, and a ring of 4 lets consecutive tiles'
    pipelines chain (:func:`_chainable`) where the steps are a multiple of 4."""
    limit = _smem_limit()
    for stages in range(MAX_STAGES, 1, -1):
        if _both_smem((*blocks, stages), dtype, out_dtype, blocks[0] // 2) <= limit:
            return stages
    return 2


def _smem_limit() -> int:
    """The device's shared memory per block; a Hopper's where the device does not say (the
    CPU in interpret mode), so one call gets one config everywhere."""
    from ejkernel.ops import shared_memory_limit

    return shared_memory_limit() or HOPPER_SMEM


def _blocks(kw: Any, cfg: GroupedMatmulConfig | None) -> tuple[int, int, int, int, int]:
    """``(block_m, block_n, block_k, stages, store_m)``: the config's, the heuristic's where
    ``None``; ``store_m`` the output staging's rows (:func:`_store_rows_that_fit`)."""
    m, _, n, g = _shapes(kw)
    bm = cfg.block_m if cfg is not None and cfg.block_m is not None else None
    bn = cfg.block_n if cfg is not None and cfg.block_n is not None else None
    bk = cfg.block_k if cfg is not None and cfg.block_k is not None else 64
    if bm is None:
        # Short tiles (one per group) waste up to (G + 1)·block_m rows of work; 64-row tiles
        # run at about half the rate of 128-row ones, so they pay only for groups of a few
        # dozen rows (decoding-size batches).
        bm = 128 if (g + 1) * 128 <= max(m, 1) else 64
    if bn is None:
        bn = 128 if n > 64 * 2 else 64
    stages = cfg.stages if cfg is not None and cfg.stages is not None else None
    dtype = kw["lhs"].dtype
    out_dtype = kw.get("preferred_element_type") or dtype
    if stages is None:
        stages = _stages_that_fit((bm, bn, bk), dtype, out_dtype)
    return bm, bn, bk, stages, _store_rows_that_fit((bm, bn, bk, stages), dtype, out_dtype)


def heuristic(inv: Any) -> GroupedMatmulConfig:
    """128-row tiles unless the short tiles of G groups would waste as much as M (then 64),
    2 × 128 output columns a CTA (2 × 64 when N ≤ 128), steps of 64, and as many ring slots
    (up to 4) as shared memory holds beside a half-tile output staging."""
    bm, bn, bk, stages, _ = _blocks(inv.kwargs, None)
    return GroupedMatmulConfig(block_m=bm, block_n=bn, block_k=bk, stages=stages)


def config_space(inv: Any) -> list[GroupedMatmulConfig]:
    """The heuristic's config, then every block triple of :data:`BLOCKS` at 2-4 stages, minus
    those over the device's shared memory."""
    base = heuristic(inv)
    candidates = [base]
    for bm, bn, bk in BLOCKS:
        for stages in range(2, MAX_STAGES + 1):
            cfg = GroupedMatmulConfig(block_m=bm, block_n=bn, block_k=bk, stages=stages)
            if cfg not in candidates:
                candidates.append(cfg)
    return prune_by_shared_memory(
        candidates,
        functools.partial(smem_need, inv.kwargs, grad=getattr(inv, "grad", True)),
        keep=(base,),
        what="grouped_matmul (pallas gpu)",
    )


def supports(inv: Any) -> bool | str:
    """True, or why these kernels cannot serve the call (see the module docstring)."""
    kw = inv.kwargs
    dtype = jnp.dtype(kw["lhs"].dtype).name
    if dtype not in DTYPES:
        return f"the Pallas Mosaic GPU grouped matmul takes {'/'.join(DTYPES)}; got {dtype}"
    _, k, n, _ = _shapes(kw)
    if k % ALIGN or n % ALIGN:
        return (
            f"the Pallas Mosaic GPU grouped matmul takes K and N multiples of {ALIGN} (TMA "
            f"strides); got K={k}, N={n}"
        )
    return hopper_reason("the Pallas Mosaic GPU grouped matmul needs") or True


def _launch(kw: Any, cfg: GroupedMatmulConfig | None) -> _Launch:
    bm, bn, bk, stages, store_m = _blocks(kw, cfg)
    return _Launch(
        block_m=bm,
        block_n=bn,
        block_k=bk,
        stages=stages,
        store_m=store_m,
        interpret=jax.default_backend() == "cpu",
    )


# --------------------------------------------------------------------------------------------
# The op and its VJP
# --------------------------------------------------------------------------------------------


def grouped_matmul_pallas(*, cfg: GroupedMatmulConfig | None = None, **args: Any) -> jax.Array:
    """Grouped matmul on Mosaic GPU: the op's arguments
    (:func:`ejkernel.specs.grouped_matmul.grouped_matmul`, validated by the core) as keywords.

    Returns:
        [M, N] in ``preferred_element_type``; rows past ``sum(group_sizes)`` are zeros.
    """
    lhs, rhs = args["lhs"], args["rhs"]
    out_dtype = jnp.dtype(args.get("preferred_element_type") or lhs.dtype).name
    return _gmm(
        lhs,
        rhs,
        args["group_sizes"],
        lp=_launch(args, cfg),
        transpose_w=bool(args.get("transpose_rhs")),
        out_dtype=out_dtype,
    )


def _grouped_matmul_bwd(
    d_out: jax.Array, cfg: GroupedMatmulConfig | None, args: dict[str, Any]
) -> tuple[jax.Array, jax.Array]:
    """``d_lhs = gmm(d_out, rhsᵀ)``, ``d_rhs = tgmm(lhs, d_out)`` (``tgmm(d_out, lhs)`` in the
    transposed layout), each in its input's dtype."""
    lhs, rhs, sizes = args["lhs"], args["rhs"], args["group_sizes"]
    transpose_rhs = args["transpose_rhs"]
    lp = _launch(args, cfg)
    d_out = d_out.astype(lhs.dtype)
    dtype = jnp.dtype(lhs.dtype).name
    d_lhs = _gmm(d_out, rhs, sizes, lp=lp, transpose_w=not transpose_rhs, out_dtype=dtype)
    a, b = (d_out, lhs) if transpose_rhs else (lhs, d_out)
    d_rhs = _tgmm(a, b, sizes, lp=lp, out_dtype=dtype)
    return d_lhs, d_rhs


define_grouped_matmul_vjp(grouped_matmul_pallas, _grouped_matmul_bwd)


# --------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------


def _segments(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """First row and length of each group, clipped to M (``[G]`` int32 each)."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.clip(jnp.cumsum(sizes), 0, m)
    starts = jnp.clip(jnp.cumsum(sizes) - sizes, 0, m)
    return starts, jnp.maximum(ends - starts, 0)


def work_list(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """The row tiles of the gmm kernel: ``[4, W]`` int32 rows (segment, window, lead, rows) with
    ``W = ceil(M / block_m) + G + 1``.

    Segment ``g < G`` is group g; segment G is the tail (rows past ``sum(group_sizes)``, zeros).
    A segment starting at row S is cut into windows of ``block_m`` rows from ``S`` rounded down
    to a multiple of :data:`ROW_ALIGN`; a window's ``rows`` rows from its row ``lead`` on are the
    segment's (``lead`` > 0 only in its first window). Entries past the last window have 0 rows;
    empty groups have none.
    """
    starts, lengths = _segments(group_sizes, m)
    tail_start = starts[-1] + lengths[-1]
    seg_start = jnp.concatenate([starts, tail_start[None]])
    seg_end = seg_start + jnp.concatenate([lengths, (m - tail_start)[None]])
    seg_base = seg_start - seg_start % ROW_ALIGN
    tiles = jnp.where(seg_end > seg_start, (seg_end - seg_base + block_m - 1) // block_m, 0)
    tiles_end = jnp.cumsum(tiles)
    num_groups = group_sizes.shape[0]
    w = jnp.arange(-(-m // block_m) + num_groups + 1, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(tiles_end, w, side="right"), num_groups).astype(jnp.int32)
    window = seg_base[seg] + (w - (tiles_end - tiles)[seg]) * block_m
    first = jnp.maximum(seg_start[seg], window)
    rows = jnp.clip(jnp.minimum(seg_end[seg], window + block_m) - first, 0, block_m)
    rows = jnp.where(w < tiles_end[-1], rows, 0)
    return jnp.stack([seg, window, first - window, rows]).astype(jnp.int32)


def _pad_to(x: jax.Array, axis: int, size: int) -> jax.Array:
    if x.shape[axis] >= size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _extent(size: int, block: int, lp: _Launch, align: int) -> int:
    """Size a dimension read in blocks of ``block`` is padded to. On the GPU: at least one
    block (a TMA box never exceeds its array), a multiple of ``align`` (Mosaic GPU's TMA wants
    the dimensions of a swizzled copy to be multiples of its tiling: 8 rows, 64 columns), and
    no more: reads past the end are TMA's zeros. In interpret mode whole blocks, standing in
    for those zeros."""
    if lp.interpret:
        return -(-size // block) * block
    return -(-max(size, block) // align) * align


def _transforms(dtype: Any, minor: int) -> tuple[Any, ...]:
    """Tiling and swizzle of a shared-memory slice whose minor dimension has ``minor`` entries."""
    plgpu = compat.plgpu()
    swizzle = plgpu.find_swizzle(
        min(minor, 128 // jnp.dtype(dtype).itemsize) * jnp.dtype(dtype).itemsize * 8
    )
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _num_sms(lp: _Launch) -> int:
    return INTERPRET_SMS if lp.interpret else int(jax.devices()[0].core_count)


def _kernel(body: Any, *, out: Any, lp: _Launch, name: str) -> Any:
    plgpu = compat.plgpu()
    return compat.gpu_kernel(
        body,
        out=out,
        scratch=(),
        grid=(_num_sms(lp),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=compat.gpu_compiler_params(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        name=name,
        interpret=lp.interpret,
    )


def _accumulate(lp: _Launch, shape: tuple[int, int], store: Any) -> Any:
    """The pipeline's ``compute_context``: run it with a float32 ``shape`` accumulator (a
    ``wgmma`` accumulator, or in interpret mode a plain array carried through the steps), then
    ``store`` the result."""

    def context(run_pipeline: Any) -> None:
        if lp.interpret:
            store(run_pipeline(jnp.zeros(shape, jnp.float32)))
            return

        @functools.partial(compat.pl.run_scoped, acc=compat.gpu_accumulator(shape, jnp.float32))
        def _(acc: Any) -> None:
            run_pipeline(acc)
            store(acc[...])

    return context


def _mma(lp: _Launch, acc: Any, a: Any, b: Any, *, transpose_a: bool, transpose_b: bool) -> Any:
    """``acc + a · b`` (either shared-memory operand transposed) with ``wgmma`` into the
    accumulator ref; in interpret mode a ``jnp.dot`` of the loaded tiles added to the carried
    array (the interpreter's ``wgmma`` takes no transposed operand)."""
    plgpu = compat.plgpu()
    if lp.interpret:
        x, y = a[...], b[...]
        x, y = (x.T if transpose_a else x), (y.T if transpose_b else y)
        return acc + jnp.dot(x, y, preferred_element_type=jnp.float32)
    a = compat.transpose_ref(a, (1, 0)) if transpose_a else a
    b = compat.transpose_ref(b, (1, 0)) if transpose_b else b
    plgpu.wgmma(acc, a, b)
    plgpu.wgmma_wait(0)
    return acc


def _pipeline(
    lp: _Launch, steps: Any, specs: list[Any], step: Any, context: Any, state: Any = None
) -> Any:
    """The producer/two-consumer pipeline of both kernels over ``steps`` (static or traced);
    ``state`` chains it to the CTA's previous and next pipelines (see :func:`_chainable`)."""
    extra = {} if state is None else {"pipeline_state": state}
    return compat.plgpu().emit_pipeline_warp_specialized(
        step,
        grid=(steps,),
        memory_registers=PRODUCER_REGISTERS,
        in_specs=specs,
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=lp.stages,
        compute_context=context,
        **extra,
    )


def _chainable(lp: _Launch, steps: int) -> bool:
    """Whether a CTA's consecutive gmm pipelines (one per work item, ``steps`` steps each) can
    run as one: the producer then streams the next item's first slices while the consumers
    finish the last item's steps and store its tile, instead of waiting for the tile to be
    consumed. Mosaic GPU chains pipelines of a static step count that is a multiple of the
    ring's slots."""
    slots = min(lp.stages, steps)
    return compat.gpu_pipeline_states() is not None and steps % slots == 0


def _ignore(*_: Any, **__: Any) -> None:
    """A pipeline body that does nothing: the pipeline's shared memory does not depend on it."""
    return None


def _per_consumer(wg: Any, body: Any) -> None:
    """``body(i)`` on consumer warpgroup ``i`` with ``i`` static: shared-memory slices a
    register load or store touches need offsets Mosaic GPU's layout inference can prove."""
    for i in range(2):
        compat.pl.when(wg == i)(functools.partial(body, i))


def _store_rows(src: Any, dst: Any, window: Any, lead: Any, rows: Any, block_m: int) -> None:
    """Copy rows ``[lead, lead + rows)`` of the shared-memory tile ``src`` to the same rows of
    the window of ``dst`` starting at row ``window``: one TMA store per set bit of ``rows``
    (TMA boxes have static sizes)."""
    plgpu = compat.plgpu()
    offset = lead
    size = block_m
    while size >= 1:
        part = lax.bitwise_and(rows, jnp.int32(size))

        @compat.pl.when(part != 0)
        def _(offset=offset, size=size) -> None:
            plgpu.copy_smem_to_gmem(
                src.at[compat.pl.ds(offset, size)], dst.at[compat.pl.ds(window + offset, size)]
            )

        offset = offset + part
        size //= 2


# --------------------------------------------------------------------------------------------
# gmm: out[rows of g] = x[rows of g] · w[g]
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("lp", "transpose_w", "out_dtype"))
def _gmm(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    lp: _Launch,
    transpose_w: bool,
    out_dtype: str,
) -> jax.Array:
    """``[M, K] × [G, K, N]`` (``[G, N, K]`` with ``transpose_w``) -> ``[M, N]``."""
    m, k = x.shape
    n = w.shape[1] if transpose_w else w.shape[2]
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    bm, bn, bk = lp.block_m, lp.block_n, lp.block_k
    work = work_list(group_sizes, m, bm)
    # A group's last tile may read up to bm rows past M.
    x = _pad_to(x, 0, m + bm if lp.interpret else _extent(m, bm, lp, ROW_ALIGN))
    k_pad, n_pad = _extent(k, bk, lp, COL_ALIGN), _extent(n, 2 * bn, lp, COL_ALIGN)
    x = _pad_to(x, 1, k_pad)
    w = _pad_to(_pad_to(w, 2 if transpose_w else 1, k_pad), 1 if transpose_w else 2, n_pad)
    out = _kernel(
        functools.partial(_gmm_kernel, lp=lp, transpose_w=transpose_w),
        out=jax.ShapeDtypeStruct((x.shape[0], n_pad), out_dtype),
        lp=lp,
        name="ejkernel_grouped_matmul",
    )(work, jnp.sum((work[0] < group_sizes.shape[0]) & (work[3] > 0), keepdims=True), x, w)
    return out[:m, :n]


def _gmm_kernel(work, matmul_tiles, x_gmem, w_gmem, out_gmem, *, lp: _Launch, transpose_w: bool):
    pl, plgpu = compat.pl, compat.plgpu()
    bm, bn, bk, sm_rows = lp.block_m, lp.block_n, lp.block_k, lp.store_m
    cta_n = 2 * bn
    k = x_gmem.shape[1]
    n = out_gmem.shape[1]
    num_groups = w_gmem.shape[0]
    col_blocks = -(-n // cta_n)
    dtype = x_gmem.dtype
    if transpose_w:
        w_spec = plgpu.BlockSpec((cta_n, bk), lambda s: (0, s), transforms=_transforms(dtype, bk))
    else:
        w_spec = plgpu.BlockSpec(
            (bk, cta_n), lambda s: (s, 0), transforms=_transforms(dtype, cta_n)
        )
    x_spec = plgpu.BlockSpec((bm, bk), lambda s: (0, s), transforms=_transforms(dtype, bk))

    steps = -(-k // bk)
    pipeline = functools.partial(_pipeline, lp, steps, [x_spec, w_spec])
    w_slice = w_gmem.at[0]
    w_slice = w_slice.at[pl.ds(0, cta_n)] if transpose_w else w_slice.at[:, pl.ds(0, cta_n)]

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(_ignore, _ignore).get_allocations(x_gmem.at[pl.ds(0, bm)], w_slice),
        out_smem=plgpu.SMEM((2, sm_rows, bn), out_gmem.dtype),
        collective_axes="wg",
    )
    def _(allocations: Any, out_smem: Any) -> None:
        wg = lax.axis_index("wg")
        # The groups' tiles lead the work list, so a CTA's items that run a pipeline are the
        # first `chained` of its round-robin share.
        sm, num_sms = lax.axis_index("sm"), lax.axis_size("sm")
        chained = lax.div(jnp.maximum(matmul_tiles[0] * col_blocks - sm + num_sms - 1, 0), num_sms)

        @plgpu.nd_loop((work.shape[1] * col_blocks,), collective_axes="sm")
        def _(loop: Any) -> None:
            (item,) = loop.index
            tile, col = lax.div(item, col_blocks), lax.rem(item, col_blocks)
            group, rows = work[0, tile], work[3, tile]
            window, lead = pl.multiple_of(work[1, tile], ROW_ALIGN), work[2, tile]

            def store(value: Any) -> None:
                def mine(i: int) -> None:
                    out_cols = out_gmem.at[:, pl.ds(col * cta_n + i * bn, bn)]
                    for top in range(0, bm, sm_rows):
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging's last use
                        out_smem[i] = value[top : top + sm_rows].astype(out_smem.dtype)
                        plgpu.commit_smem()
                        # This part's rows of [lead, lead + rows).
                        first = jnp.clip(lead - top, 0, sm_rows)
                        last = jnp.clip(lead + rows - top, 0, sm_rows)
                        _store_rows(
                            out_smem.at[i], out_cols, window + top, first, last - first, sm_rows
                        )

                _per_consumer(wg, mine)

            context = _accumulate(lp, (bm, bn), store)

            def step(_: Any, x_smem: Any, w_smem: Any, acc: Any) -> Any:
                half = pl.ds(wg * bn, bn)
                b = w_smem.at[half] if transpose_w else w_smem.at[:, half]
                return _mma(lp, acc, x_smem, b, transpose_a=False, transpose_b=transpose_w)

            w_g = w_gmem.at[jnp.minimum(group, num_groups - 1)]
            cols = pl.ds(col * cta_n, cta_n)
            w_g = w_g.at[cols] if transpose_w else w_g.at[:, cols]
            refs = (x_gmem.at[pl.ds(window, bm)], w_g)
            matmul = (rows > 0) & (group < num_groups)

            if not _chainable(lp, steps):
                pl.when(matmul)(lambda: pipeline(step, context)(*refs, allocations=allocations))
            else:
                states = compat.gpu_pipeline_states()
                nth = lax.div(item - sm, num_sms)
                state = lax.select(
                    nth == 0,
                    jnp.int32(states.START),
                    lax.select(
                        nth == chained - 1, jnp.int32(states.STOP), jnp.int32(states.STEADY)
                    ),
                )

                @pl.when(matmul & (chained == 1))
                def _() -> None:
                    pipeline(step, context)(*refs, allocations=allocations)

                @pl.when(matmul & (chained > 1))
                def _() -> None:
                    pipeline(step, context, state)(*refs, allocations=allocations)

            @pl.when((rows > 0) & (group == num_groups) & (wg < 2))
            def _() -> None:
                store(jnp.zeros((bm, bn), jnp.float32))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# --------------------------------------------------------------------------------------------
# tgmm: out[g] = a[rows of g]ᵀ · b[rows of g]
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("lp", "out_dtype"))
def _tgmm(a: jax.Array, b: jax.Array, group_sizes: jax.Array, *, lp: _Launch, out_dtype: str):
    """``[M, P]ᵀ × [M, Q]`` per group -> ``[G, P, Q]`` (zeros for an empty group)."""
    m, p = a.shape
    q = b.shape[1]
    num_groups = group_sizes.shape[0]
    if m == 0:
        return jnp.zeros((num_groups, p, q), out_dtype)
    bm, bn, bk = lp.block_m, lp.block_n, lp.block_k
    starts, lengths = _segments(group_sizes, m)
    # A group's chunks are read from its first row through a window of `span` rows; they end
    # at most bk rows past M.
    span = _extent(m, bk, lp, ROW_ALIGN)
    a = _pad_to(a, 0, m + span if lp.interpret else span)
    a = _pad_to(a, 1, _extent(p, bm, lp, COL_ALIGN))
    b = _pad_to(_pad_to(b, 0, a.shape[0]), 1, _extent(q, 2 * bn, lp, COL_ALIGN))
    out = _kernel(
        functools.partial(_tgmm_kernel, lp=lp, span=span),
        out=jax.ShapeDtypeStruct((num_groups, a.shape[1], b.shape[1]), out_dtype),
        lp=lp,
        name="ejkernel_grouped_matmul_tgmm",
    )(jnp.stack([starts, lengths]), a, b)
    return out[:, :p, :q]


def _tgmm_kernel(segments, a_gmem, b_gmem, out_gmem, *, lp: _Launch, span: int):
    pl, plgpu = compat.pl, compat.plgpu()
    bm, bn, bk, sm_rows = lp.block_m, lp.block_n, lp.block_k, lp.store_m
    cta_n = 2 * bn
    num_groups, p, q = out_gmem.shape
    row_blocks, col_blocks = -(-p // bm), -(-q // cta_n)
    dtype = a_gmem.dtype
    specs = [
        plgpu.BlockSpec((bk, bm), lambda s: (s, 0), transforms=_transforms(dtype, bm)),
        plgpu.BlockSpec((bk, cta_n), lambda s: (s, 0), transforms=_transforms(dtype, cta_n)),
    ]

    def pipeline(chunks: Any, step: Any, context: Any) -> Any:
        return _pipeline(lp, chunks, specs, step, context)

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(jnp.int32(1), _ignore, _ignore).get_allocations(
            a_gmem.at[:, pl.ds(0, bm)], b_gmem.at[:, pl.ds(0, cta_n)]
        ),
        out_smem=plgpu.SMEM((2, sm_rows, bn), out_gmem.dtype),
        collective_axes="wg",
    )
    def _(allocations: Any, out_smem: Any) -> None:
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((num_groups * row_blocks * col_blocks,), collective_axes="sm")
        def _(loop: Any) -> None:
            (item,) = loop.index
            group = lax.div(item, row_blocks * col_blocks)
            rest = lax.rem(item, row_blocks * col_blocks)
            row, col = lax.div(rest, col_blocks), lax.rem(rest, col_blocks)
            first, length = segments[0, group], segments[1, group]
            # Chunks of bk rows from the group's first row rounded down to ROW_ALIGN; rows of
            # a chunk outside [lo, hi) belong to other groups.
            lead = lax.rem(first, ROW_ALIGN)
            base = pl.multiple_of(first - lead, ROW_ALIGN)
            chunks = lax.div(lead + length + (bk - 1), bk)

            def store(value: Any) -> None:
                def mine(i: int) -> None:
                    cols = pl.ds(col * cta_n + i * bn, bn)
                    for top in range(0, bm, sm_rows):
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        out_smem[i] = value[top : top + sm_rows].astype(out_smem.dtype)
                        plgpu.commit_smem()
                        rows = pl.ds(row * bm + top, sm_rows)
                        plgpu.copy_smem_to_gmem(out_smem.at[i], out_gmem.at[group, rows, cols])

                _per_consumer(wg, mine)

            context = _accumulate(lp, (bm, bn), store)

            def zero_rows_outside(ref: Any, lo: Any, hi: Any) -> None:
                value = ref[...]
                index = lax.broadcasted_iota(jnp.int32, value.shape, 0)
                inside = (index >= lo) & (index < hi)
                ref[...] = jnp.where(inside, value, jnp.zeros((), value.dtype))

            def step(indices: Any, a_smem: Any, b_smem: Any, acc: Any) -> Any:
                lo = lead - indices[0] * bk
                hi = lead + length - indices[0] * bk

                @pl.when((lo > 0) | (hi < bk))
                def _() -> None:
                    def mine(i: int) -> None:
                        # Both consumers rewrite the shared lhs chunk with the same values.
                        zero_rows_outside(a_smem, lo, hi)
                        zero_rows_outside(b_smem.at[:, pl.ds(i * bn, bn)], lo, hi)
                        plgpu.commit_smem()

                    _per_consumer(wg, mine)

                b_half = b_smem.at[:, pl.ds(wg * bn, bn)]
                return _mma(lp, acc, a_smem, b_half, transpose_a=True, transpose_b=False)

            @pl.when(length > 0)
            def _() -> None:
                rows = pl.ds(base, span)
                pipeline(chunks, step, context)(
                    a_gmem.at[rows, pl.ds(row * bm, bm)],
                    b_gmem.at[rows, pl.ds(col * cta_n, cta_n)],
                    allocations=allocations,
                )

            @pl.when((length == 0) & (wg < 2))
            def _() -> None:
                store(jnp.zeros((bm, bn), jnp.float32))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
