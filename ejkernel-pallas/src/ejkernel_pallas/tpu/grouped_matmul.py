"""grouped_matmul as Pallas Mosaic-TPU kernels in the megablox form: forward, and the
transposed grouped matmul (``tgmm``) for the gradient of ``rhs``.

Algorithm: the grouped matmul of MegaBlocks (Gale et al., 2022) as JAX's
``pallas.ops.tpu.megablox`` schedules it. A metadata pass over the traced ``group_sizes``
(:mod:`._gmm_metadata`, plain ``jnp``) lists the (row tile, group) pairs in row order; the list
is scalar-prefetched into SMEM and the grid walks it, the block index maps reading each step's
row tile and group from it:

- **gmm** (forward, and ``d_lhs = gmm(d_out, rhsᵀ)``): grid ``(N / bn, W, K / bk)``; step
  ``(j, w, k)`` accumulates ``lhs[tile_w, k] · rhs[group_w, k, j]`` in a float32 VMEM tile and,
  on the last ``k``, stores the rows of the tile that belong to the group (a select: every row
  has one group, so a tile straddling groups is completed over consecutive steps). Rows past
  ``sum(group_sizes)`` form a tail pseudo-group that stores zeros.
- **tgmm** (``d_rhs[g] = lhs_gᵀ · d_out_g``): grid ``(K / bk, N / bn, W)``; rows outside the
  step's group are selected to zero in both tiles, ``tileᵀ · tile`` accumulates in float32 while
  the group stays the same and is stored when it changes (an empty group stores zeros).

``W = ceil(M / bm) + G`` bounds the pairs; steps past them compute nothing and keep their
block indices (no DMA). M, K and N are zero-padded to whole blocks outside the kernels (the
padding rows belong to the tail, the padding columns contribute zeros), so any sizes run:
uneven and empty groups, M not a multiple of the tile, K or N not multiples of 128.

**Blocks** (``GroupedMatmulConfig``): ``block_m``, ``block_k``, ``block_n`` are multiples of
128 (rows of ``lhs`` and the lanes of the transposed ``tgmm`` tile; K and N are lane dims), so
every VMEM block obeys the (8, 128) tiling in any dtype. The config space keeps the blocks whose
grid steps fit the VMEM budget of the device kind (:func:`._paged.vmem_budget`: v5e/v6e 128 MiB,
v5p 64 MiB, three quarters claimable) and whose metadata fits SMEM; ``supports()`` declines a
call nothing fits, and dtypes other than float32 and bfloat16 (the XLA plugin serves them).

The backward is the executor's custom VJP (``define_grouped_matmul_vjp``):
``d_lhs = gmm(d_out, rhsᵀ)`` and ``d_rhs = tgmm(lhsᵀ, d_out)`` (``tgmm(d_outᵀ, lhs)`` for
``transpose_rhs``), each in its input's dtype. Accumulation is float32 throughout.

Verified without a TPU: ``tests/pallas/test_tpu_grouped_matmul.py`` runs both kernels in Pallas's
TPU interpret mode against the spec's reference and JAX's own megablox ``gmm``/``tgmm``, and
lowers them to Mosaic modules for the TPU (Pallas's lowering rules); Mosaic's own passes (vector
layouts, the in-kernel transpose of ``tgmm``, the bf16 selects) run only on a TPU and have not.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax import lax

from ejkernel.specs.grouped_matmul import define_grouped_matmul_vjp

# Not `_compat`: the `__repr__` attrs generates reads attrs' own `_compat` from this module.
from ejkernel_pallas import _compat as compat
from ejkernel_pallas.tpu import _gmm_metadata as metadata
from ejkernel_pallas.tpu import _paged
from ejkernel_pallas.tpu._numerics import precision

__all__ = [
    "GroupedMatmulConfig",
    "config_space",
    "grouped_matmul_pallas",
    "heuristic",
    "supports",
]

DTYPES = ("float32", "bfloat16")
LANES = _paged.LANES
#: Block sizes the config space offers (each a multiple of 128).
BLOCKS = (128, 256, 512)
#: Largest row tile the heuristic picks; it halves it while straddling tiles waste more than
#: half of M (``(G - 1) · block_m > M / 2``), down to 128.
BLOCK_M_MAX = 512
#: K and N block the heuristic aims at.
BLOCK_KN = 512


def _block_validator(_: Any, attribute: Any, value: int | None) -> None:
    if value is not None and (value < LANES or value % LANES):
        raise ValueError(
            f"GroupedMatmulConfig: `{attribute.name}` must be a positive multiple of {LANES} "
            f"(the TPU's lane tiling); got {value}"
        )


@attrs.frozen(kw_only=True)
class GroupedMatmulConfig:
    """Tunables of the Pallas TPU grouped matmul.

    Attributes:
        block_m: rows of ``lhs`` per tile (forward and both backward products).
        block_k: columns of ``lhs`` (rows of ``rhs[g]``) per block.
        block_n: output columns per block.

    Each a multiple of 128, or ``None`` for the heuristic's choice.
    """

    block_m: int | None = attrs.field(default=None, validator=_block_validator)
    block_k: int | None = attrs.field(default=None, validator=_block_validator)
    block_n: int | None = attrs.field(default=None, validator=_block_validator)


@attrs.frozen(kw_only=True)
class _Launch:
    """Static parameters of the three products of one call (hashable: a jit static)."""

    block_m: int
    block_k: int
    block_n: int
    transpose_rhs: bool
    out_dtype: str
    interpret: bool = attrs.field(factory=lambda: _paged.interpreting())


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def _shapes(kw: Any) -> tuple[int, int, int, int]:
    """``(M, K, N, G)`` of validated arguments (arrays or abstract shapes)."""
    m, k = kw["lhs"].shape
    rhs = kw["rhs"].shape
    n = rhs[1] if kw.get("transpose_rhs") else rhs[2]
    return int(m), int(k), int(n), int(rhs[0])


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _default_block_m(m: int, num_groups: int) -> int:
    block = BLOCK_M_MAX
    while block > LANES and (num_groups - 1) * block > m // 2:
        block //= 2
    return min(block, max(LANES, _pow2_ceil(m)))


def _default_block(dim: int) -> int:
    """One block when ``dim`` fits in :data:`BLOCK_KN`; else the largest of :data:`BLOCKS` (at
    most :data:`BLOCK_KN`) padding ``dim`` by at most an eighth, 128 when none does."""
    whole = _paged.round_up(dim, LANES)
    if whole <= BLOCK_KN:
        return whole
    for block in sorted((b for b in BLOCKS if b <= BLOCK_KN), reverse=True):
        if _paged.round_up(dim, block) - dim <= dim // 8:
            return block
    return LANES


def _launch(kw: Any, cfg: GroupedMatmulConfig | None) -> _Launch:
    """The launch of validated arguments: ``cfg``'s blocks, the heuristic's where ``None``."""
    m, k, n, num_groups = _shapes(kw)
    cfg = cfg or GroupedMatmulConfig()
    lp = _Launch(
        block_m=cfg.block_m or _default_block_m(m, num_groups),
        block_k=cfg.block_k or _default_block(k),
        block_n=cfg.block_n or _default_block(n),
        transpose_rhs=bool(kw.get("transpose_rhs")),
        out_dtype=jnp.dtype(kw.get("preferred_element_type") or kw["lhs"].dtype).name,
    )
    if cfg.block_k is None and cfg.block_n is None:
        dtype = kw["lhs"].dtype
        while not _fits(lp, dtype) and max(lp.block_k, lp.block_n) > LANES:
            wide = "block_k" if lp.block_k >= lp.block_n else "block_n"
            lp = attrs.evolve(lp, **{wide: getattr(lp, wide) // 2})
    return lp


def vmem_bytes(lp: _Launch, dtype: Any) -> int:
    """VMEM of one grid step of the largest of the three products: double-buffered input and
    output blocks, the float32 accumulator and (``tgmm``) the float32 copies of its masked and
    transposed tiles."""
    bm, bk, bn = lp.block_m, lp.block_k, lp.block_n
    t = _paged.tiled_bytes
    f32 = jnp.float32

    def gmm(c: int, f: int, out: Any) -> int:
        return 2 * (t((bm, c), dtype) + t((c, f), dtype) + t((bm, f), out)) + t((bm, f), f32)

    tgmm = 2 * (t((bm, bk), dtype) + t((bm, bn), dtype) + t((bk, bn), dtype))
    tgmm += t((bk, bn), f32) + 2 * (t((bm, bk), f32) + t((bm, bn), f32))
    return max(gmm(bk, bn, lp.out_dtype), gmm(bn, bk, dtype), tgmm)


def smem_bytes(lp: _Launch, m: int, num_groups: int) -> int:
    """SMEM of the scalar-prefetched metadata (offsets, and group, tile, valid per step)."""
    steps = metadata.row_steps(-(-m // lp.block_m), num_groups)
    return _paged.smem_bytes(num_groups + 2, steps, steps, steps)


def _fits(lp: _Launch, dtype: Any) -> bool:
    return vmem_bytes(lp, dtype) <= _paged.vmem_budget()


def _config(lp: _Launch) -> GroupedMatmulConfig:
    return GroupedMatmulConfig(block_m=lp.block_m, block_k=lp.block_k, block_n=lp.block_n)


def heuristic(inv: Any) -> GroupedMatmulConfig:
    """Row tiles of up to 512 (halved while straddling tiles waste more than M / 2), K and N
    blocks of up to 512 padding their dim by at most an eighth, halved until a grid step fits
    the VMEM budget."""
    return _config(_launch(inv.kwargs, None))


def config_space(inv: Any) -> list[GroupedMatmulConfig]:
    """The heuristic's config, then every combination of 128/256/512 blocks (none much longer
    than its dimension) that fits the VMEM and SMEM budgets."""
    kw = inv.kwargs
    m, k, n, num_groups = _shapes(kw)
    base = _launch(kw, None)
    space = [_config(base)]
    for bm in (b for b in BLOCKS if b <= max(LANES, _pow2_ceil(m))):
        for bk in (b for b in BLOCKS if b <= _paged.round_up(k, LANES)):
            for bn in (b for b in BLOCKS if b <= _paged.round_up(n, LANES)):
                lp = attrs.evolve(base, block_m=bm, block_k=bk, block_n=bn)
                fits = _fits(lp, kw["lhs"].dtype)
                fits = fits and smem_bytes(lp, m, num_groups) <= _paged.smem_budget()
                if fits and _config(lp) not in space:
                    space.append(_config(lp))
    return space


def supports(inv: Any) -> bool | str:
    """True, or why this kernel cannot serve the call (see the module docstring)."""
    kw = inv.kwargs
    dtype = jnp.dtype(kw["lhs"].dtype).name
    if dtype not in DTYPES:
        return (
            f"the Pallas TPU grouped_matmul takes {'/'.join(DTYPES)} inputs; got {dtype} "
            "(the XLA plugin serves it)"
        )
    m, _, _, num_groups = _shapes(kw)
    lp = _launch(kw, None)
    reason = _paged.budget_reason(
        "grouped_matmul",
        vmem=vmem_bytes(lp, dtype),
        blocks="its smallest blocks",
        smem=smem_bytes(lp, m, num_groups),
        prefetched="its work list",
    )
    return reason or True


# --------------------------------------------------------------------------------------------
# The op and its VJP
# --------------------------------------------------------------------------------------------


def grouped_matmul_pallas(*, cfg: GroupedMatmulConfig | None = None, **args: Any) -> jax.Array:
    """Grouped matmul on Mosaic TPU.

    Args:
        cfg: the blocks; ``None`` (or a ``None`` field) takes the heuristic's.
        **args: :func:`ejkernel.grouped_matmul`'s arguments by name, as its spec validated them
            (``lhs [M, K]``, ``rhs [G, K, N]`` or ``[G, N, K]``, ``group_sizes [G]``,
            ``preferred_element_type``, ``transpose_rhs``).

    Returns:
        [M, N] in ``preferred_element_type``; rows past ``sum(group_sizes)`` are zeros.
    """
    lp = _launch(args, cfg)
    return _forward(args["lhs"], args["rhs"], args["group_sizes"], lp=lp)


def _grouped_matmul_bwd(
    d_out: jax.Array, cfg: GroupedMatmulConfig | None, args: dict[str, Any]
) -> tuple[jax.Array, jax.Array]:
    """``d_lhs = gmm(d_out, rhsᵀ)`` and ``d_rhs = tgmm(lhsᵀ, d_out)``, in the inputs' dtypes."""
    arrays = (args[n] for n in ("lhs", "rhs", "group_sizes"))
    return _backward(*arrays, d_out, lp=_launch(args, cfg))


define_grouped_matmul_vjp(grouped_matmul_pallas, _grouped_matmul_bwd)


def _pad(x: jax.Array, *sizes: int) -> jax.Array:
    """Zero-pad ``x`` up to ``sizes`` (one per axis)."""
    pads = [(0, s - d) for d, s in zip(x.shape, sizes, strict=True)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


@functools.partial(jax.jit, static_argnames="lp")
def _forward(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, lp: _Launch) -> jax.Array:
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if lp.transpose_rhs else rhs.shape[2]
    if m == 0:
        return jnp.zeros((0, n), lp.out_dtype)
    mp = _paged.round_up(m, lp.block_m)
    kp, np_ = _paged.round_up(k, lp.block_k), _paged.round_up(n, lp.block_n)
    w = _pad(rhs, num_groups, np_, kp) if lp.transpose_rhs else _pad(rhs, num_groups, kp, np_)
    plan = metadata.row_plan(group_sizes, m=m, block_m=lp.block_m)
    out = _gmm(
        _pad(lhs, mp, kp), w, plan, lp, block_c=lp.block_k, block_f=lp.block_n,
        transpose_w=lp.transpose_rhs, out_dtype=lp.out_dtype,
    )  # fmt: skip
    return out[:m, :n]


@functools.partial(jax.jit, static_argnames="lp")
def _backward(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, d_out: jax.Array, lp: _Launch
) -> tuple[jax.Array, jax.Array]:
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = d_out.shape[1]
    if m == 0:
        return jnp.zeros_like(lhs), jnp.zeros_like(rhs)
    mp = _paged.round_up(m, lp.block_m)
    kp, np_ = _paged.round_up(k, lp.block_k), _paged.round_up(n, lp.block_n)
    x, dy = _pad(lhs, mp, kp), _pad(d_out.astype(lhs.dtype), mp, np_)
    # rhs[g] is [K, N] (d_lhs contracts its N, dim 1) or, transposed, [N, K] (dim 0).
    w = _pad(rhs, num_groups, np_, kp) if lp.transpose_rhs else _pad(rhs, num_groups, kp, np_)
    rows = metadata.row_plan(group_sizes, m=m, block_m=lp.block_m)
    d_lhs = _gmm(
        dy, w, rows, lp, block_c=lp.block_n, block_f=lp.block_k,
        transpose_w=not lp.transpose_rhs, out_dtype=lhs.dtype.name,
    )  # fmt: skip
    groups = metadata.group_plan(group_sizes, m=m, block_m=lp.block_m)
    if lp.transpose_rhs:
        d_rhs = _tgmm(dy, x, groups, lp, block_p=lp.block_n, block_q=lp.block_k, out=rhs.dtype)
        d_rhs = d_rhs[:, :n, :k]
    else:
        d_rhs = _tgmm(x, dy, groups, lp, block_p=lp.block_k, block_q=lp.block_n, out=rhs.dtype)
        d_rhs = d_rhs[:, :k, :n]
    return d_lhs[:m, :k], d_rhs


# --------------------------------------------------------------------------------------------
# Launches
# --------------------------------------------------------------------------------------------


def _call(
    kernel: Any,
    lp: _Launch,
    *,
    name: str,
    grid: tuple[int, ...],
    in_specs: list[Any],
    out_specs: Any,
    out_shape: Any,
    scratch: Any,
    semantics: tuple[str, ...],
) -> Any:
    pltpu = compat.pltpu()
    call = compat.pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[scratch],
        ),
        out_shape=out_shape,
        compiler_params=compat.tpu_compiler_params(
            dimension_semantics=semantics, vmem_limit_bytes=_paged.vmem_budget()
        ),
        interpret=compat.tpu_interpret_params() if lp.interpret else False,
        name=name,
    )
    return jax.custom_batching.sequential_vmap(call) if lp.interpret else call


def _gmm(
    x: jax.Array,
    w: jax.Array,
    plan: metadata.Plan,
    lp: _Launch,
    *,
    block_c: int,
    block_f: int,
    transpose_w: bool,
    out_dtype: Any,
) -> jax.Array:
    """``out[r] = x[r] · w[g]`` over the rows r of each group g (zeros past the groups):
    ``x [Mp, Cp]``, ``w [G, Cp, Fp]`` (``[G, Fp, Cp]`` when ``transpose_w``) -> ``[Mp, Fp]``."""
    mp, cp = x.shape
    num_groups = w.shape[0]
    fp = w.shape[1] if transpose_w else w.shape[2]
    bm = lp.block_m
    steps = plan.group.shape[0]
    last = num_groups - 1

    def x_index(j: Any, s: Any, c: Any, offsets: Any, group: Any, tile: Any, valid: Any) -> Any:
        return tile[s], c

    def w_index(j: Any, s: Any, c: Any, offsets: Any, group: Any, tile: Any, valid: Any) -> Any:
        g = jnp.minimum(group[s], last)  # the tail group reads a block it does not use
        return (g, j, c) if transpose_w else (g, c, j)

    def out_index(j: Any, s: Any, c: Any, offsets: Any, group: Any, tile: Any, valid: Any) -> Any:
        return tile[s], j

    w_block = (None, block_f, block_c) if transpose_w else (None, block_c, block_f)
    kernel = functools.partial(
        _gmm_kernel, num_groups=num_groups, c_steps=cp // block_c, block_m=bm,
        transpose_w=transpose_w,
    )  # fmt: skip
    return _call(
        kernel,
        lp,
        name="ejkernel_grouped_matmul_gmm",
        grid=(fp // block_f, steps, cp // block_c),
        in_specs=[
            compat.pl.BlockSpec((bm, block_c), x_index),
            compat.pl.BlockSpec(w_block, w_index),
        ],
        out_specs=compat.pl.BlockSpec((bm, block_f), out_index),
        out_shape=jax.ShapeDtypeStruct((mp, fp), out_dtype),
        scratch=compat.vmem((bm, block_f), jnp.float32),
        semantics=("parallel", "arbitrary", "arbitrary"),
    )(*plan, x, w)


def _tgmm(
    a: jax.Array,
    b: jax.Array,
    plan: metadata.Plan,
    lp: _Launch,
    *,
    block_p: int,
    block_q: int,
    out: Any,
) -> jax.Array:
    """``out[g] = a_gᵀ · b_g`` over the rows of each group g (zeros for an empty group):
    ``a [Mp, Pp]``, ``b [Mp, Qp]`` -> ``[G, Pp, Qp]``."""
    (_, pp), qp = a.shape, b.shape[1]
    num_groups = plan.offsets.shape[0] - 2
    bm = lp.block_m
    steps = plan.group.shape[0]

    def a_index(i: Any, j: Any, s: Any, offsets: Any, group: Any, tile: Any, valid: Any) -> Any:
        return tile[s], i

    def b_index(i: Any, j: Any, s: Any, offsets: Any, group: Any, tile: Any, valid: Any) -> Any:
        return tile[s], j

    def out_index(i: Any, j: Any, s: Any, offsets: Any, group: Any, tile: Any, valid: Any) -> Any:
        return group[s], i, j

    return _call(
        functools.partial(_tgmm_kernel, block_m=bm, steps=steps),
        lp,
        name="ejkernel_grouped_matmul_tgmm",
        grid=(pp // block_p, qp // block_q, steps),
        in_specs=[
            compat.pl.BlockSpec((bm, block_p), a_index),
            compat.pl.BlockSpec((bm, block_q), b_index),
        ],
        out_specs=compat.pl.BlockSpec((None, block_p, block_q), out_index),
        out_shape=jax.ShapeDtypeStruct((num_groups, pp, qp), out),
        scratch=compat.vmem((block_p, block_q), jnp.float32),
        semantics=("parallel", "parallel", "arbitrary"),
    )(*plan, a, b)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def _rows_in_group(offsets: Any, g: Any, tile: Any, block_m: int, shape: tuple[int, int]) -> Any:
    """``shape`` bool: whether each row of row tile ``tile`` lies in group ``g``."""
    rows = tile * block_m + lax.broadcasted_iota(jnp.int32, shape, 0)
    return jnp.logical_and(rows >= offsets[g], rows < offsets[g + 1])


def _gmm_kernel(
    offsets: Any,
    group: Any,
    tile: Any,
    valid: Any,
    x_ref: Any,
    w_ref: Any,
    out_ref: Any,
    acc_ref: Any,
    *,
    num_groups: int,
    c_steps: int,
    block_m: int,
    transpose_w: bool,
) -> None:
    s, c = compat.pl.program_id(1), compat.pl.program_id(2)
    g = group[s]
    live = valid[s] == 1

    @compat.pl.when(c == 0)
    def _zero() -> None:
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @compat.pl.when(jnp.logical_and(live, g < num_groups))  # the tail group stays zero
    def _accumulate() -> None:
        x, w = x_ref[...], w_ref[...]
        dims = (((1,), (1,)), ((), ())) if transpose_w else (((1,), (0,)), ((), ()))
        acc_ref[...] += lax.dot_general(
            x, w, dims, precision=precision(x.dtype), preferred_element_type=jnp.float32
        )

    @compat.pl.when(jnp.logical_and(live, c == c_steps - 1))
    def _store() -> None:  # this group's rows of the tile; the other groups' rows stay
        mask = _rows_in_group(offsets, g, tile[s], block_m, acc_ref.shape)
        kept = out_ref[...].astype(jnp.float32)
        out_ref[...] = jnp.where(mask, acc_ref[...], kept).astype(out_ref.dtype)


def _tgmm_kernel(
    offsets: Any,
    group: Any,
    tile: Any,
    valid: Any,
    a_ref: Any,
    b_ref: Any,
    out_ref: Any,
    acc_ref: Any,
    *,
    block_m: int,
    steps: int,
) -> None:
    s = compat.pl.program_id(2)
    g = group[s]
    first_of_group = jnp.logical_or(s == 0, group[jnp.maximum(s - 1, 0)] != g)
    last_of_group = jnp.logical_or(s == steps - 1, group[jnp.minimum(s + 1, steps - 1)] != g)

    @compat.pl.when(first_of_group)
    def _zero() -> None:
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    nonempty = offsets[g + 1] > offsets[g]

    @compat.pl.when(jnp.logical_and(valid[s] == 1, nonempty))
    def _accumulate() -> None:
        # Rows of other groups are selected to zero (in float32, as Mosaic selects best) in
        # both tiles, so a non-finite value there reaches no product.
        a, b = a_ref[...], b_ref[...]
        in_a = _rows_in_group(offsets, g, tile[s], block_m, a.shape)
        in_b = _rows_in_group(offsets, g, tile[s], block_m, b.shape)
        a32 = jnp.where(in_a, a.astype(jnp.float32), 0.0)
        b32 = jnp.where(in_b, b.astype(jnp.float32), 0.0)
        acc_ref[...] += lax.dot_general(
            a32.swapaxes(0, 1).astype(a.dtype),
            b32.astype(b.dtype),
            (((1,), (0,)), ((), ())),
            precision=precision(a.dtype),
            preferred_element_type=jnp.float32,
        )

    @compat.pl.when(last_of_group)
    def _store() -> None:
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)
