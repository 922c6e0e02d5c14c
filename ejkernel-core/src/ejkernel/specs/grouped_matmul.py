"""grouped_matmul: consecutive row groups of ``lhs`` each multiply their own ``rhs`` (MoE experts).

Semantics every implementation follows (OPS.md vocabulary):

- ``lhs [M, K]``, ``rhs [G, K, N]`` (``[G, N, K]`` with ``transpose_rhs=True``, the layout of
  weights stored output-major), ``group_sizes [G]`` integer.
- With ``E = cumsum(group_sizes)`` and ``S = E - group_sizes``, group g owns rows
  ``[S_g, E_g)`` of ``lhs`` and ``out[r] = lhs[r] @ rhs[g]`` for each of them (``rhs[g]ᵀ`` with
  ``transpose_rhs``). Groups may be empty (size 0) and of any size; rows at or past
  ``sum(group_sizes)`` belong to no group and give zeros. A total above M truncates the last
  groups at row M (rows past M do not exist). Sizes must be non-negative; their values are not
  checked (they may be traced, so one compiled function serves every routing).
- ``preferred_element_type`` is the output dtype (default: the input dtype). Accumulation is
  float32 (or the output dtype, if wider). ``lhs`` and ``rhs`` share one floating dtype.
- Differentiable in ``lhs`` and ``rhs``: ``d_lhs`` is a grouped matmul of ``d_out`` with
  ``rhs`` transposed (zero on rows past the total); ``d_rhs[g] = lhs_gᵀ · d_out_g`` over the
  rows of group g (zero for an empty group). Gradients keep their input's dtype.

This is the ``lax.ragged_dot`` contract (``group_offset`` aside), so a model written against
``ragged_dot`` moves over by renaming the call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejkernel.specs._base import (
    builtin_op_spec,
    call_op,
    check_array,
    check_flag,
    check_floating,
    even_offsets,
    is_integer,
    synthetic_normals,
)

__all__ = [
    "SPEC",
    "define_grouped_matmul_vjp",
    "grouped_matmul",
    "grouped_matmul_reference",
    "grouped_matmul_synthetic",
    "validate_grouped_matmul",
]

OP = "grouped_matmul"


def grouped_matmul_reference(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: Any = None,
    transpose_rhs: bool = False,
) -> jax.Array:
    """Every row times every expert in float32, then each row keeps its own group's product.

    Plain and O(G·M·N) in memory: the oracle, not a kernel.
    """
    out_dtype = lhs.dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
    m, num_groups = lhs.shape[0], rhs.shape[0]
    weights = rhs.astype(jnp.float32)
    if transpose_rhs:
        weights = jnp.swapaxes(weights, 1, 2)  # [G, N, K] -> [G, K, N]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    rows = jnp.arange(m)
    # Row r belongs to the first group whose end lies past it (empty groups are skipped).
    row_group = jnp.searchsorted(ends, rows, side="right")
    in_a_group = rows < ends[-1]
    every_product = jnp.einsum("mk,gkn->gmn", lhs.astype(jnp.float32), weights)  # [G, M, N]
    out = every_product[jnp.minimum(row_group, num_groups - 1), rows]
    out = jnp.where(in_a_group[:, None], out, 0.0)
    return out.astype(out_dtype)


def validate_grouped_matmul(a: dict[str, Any], *, op: str = OP) -> dict[str, Any]:
    """Check every argument of grouped_matmul; fill ``preferred_element_type``.

    ``preferred_element_type`` becomes a dtype name (``"float32"``): the input dtype when not
    given, so a call that names the default shares the cache key of one that does not.
    """
    lhs, rhs, sizes = a["lhs"], a["rhs"], a["group_sizes"]
    a["transpose_rhs"] = transpose = check_flag(op, "transpose_rhs", a.get("transpose_rhs", False))
    rhs_letters = "[G, N, K]" if transpose else "[G, K, N]"
    check_array(op, "lhs", lhs, ndim=2, letters="[M, K]")
    check_array(op, "rhs", rhs, ndim=3, letters=rhs_letters)
    check_array(op, "group_sizes", sizes, ndim=1, letters="[G]")
    check_floating(op, (("lhs", lhs), ("rhs", rhs)))
    if rhs.dtype != lhs.dtype:
        raise TypeError(
            f"{op}: `lhs` and `rhs` must share one dtype; got {lhs.dtype} and {rhs.dtype}"
        )
    _, k = lhs.shape
    num_groups = rhs.shape[0]
    rhs_k = rhs.shape[2] if transpose else rhs.shape[1]
    if rhs_k != k:
        raise ValueError(
            f"{op}: `rhs` must be {rhs_letters} with K = lhs.shape[1] = {k} "
            f"(transpose_rhs={transpose}); got rhs.shape={tuple(rhs.shape)}, "
            f"lhs.shape={tuple(lhs.shape)}"
        )
    if min(k, *rhs.shape) == 0:  # M == 0 (no rows) is an empty call, not an error
        raise ValueError(
            f"{op}: `lhs` [M, K] and `rhs` {rhs_letters} must have non-empty K, N and G; "
            f"got lhs.shape={tuple(lhs.shape)}, rhs.shape={tuple(rhs.shape)}"
        )
    if not is_integer(sizes):
        raise TypeError(f"{op}: `group_sizes` must be an integer array; got dtype {sizes.dtype}")
    if sizes.shape[0] != num_groups:
        raise ValueError(
            f"{op}: `group_sizes` must be [G] with G = rhs.shape[0] = {num_groups}; got "
            f"group_sizes.shape={tuple(sizes.shape)}"
        )
    a["preferred_element_type"] = _output_dtype(op, a.get("preferred_element_type"), lhs.dtype)
    return a


def _output_dtype(op: str, preferred: Any, default: Any) -> str:
    if preferred is None:
        return jnp.dtype(default).name
    try:
        dtype = jnp.dtype(preferred)
    except TypeError as err:
        raise TypeError(
            f"{op}: `preferred_element_type` must be a floating dtype or None; got {preferred!r}"
        ) from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{op}: `preferred_element_type` must be a floating dtype or None; got {dtype.name}"
        )
    # float64 without jax_enable_x64 runs as float32: name what the output will really be.
    return jnp.dtype(jax.dtypes.canonicalize_dtype(dtype)).name


def grouped_matmul_synthetic(abstract: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Valid autotuning inputs: normal ``lhs``/``rhs`` and M spread evenly over the G groups."""
    num_rows = abstract["lhs"].shape[0]
    even_groups = lambda x: np.diff(even_offsets(num_rows, x.shape[0]))
    return synthetic_normals(abstract, seed, {"group_sizes": even_groups})


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: Any = None,
    transpose_rhs: bool = False,
    platform: str | None = None,
    cfg: Any = None,
) -> jax.Array:
    """Grouped matmul (MoE experts): consecutive row groups of ``lhs`` times their ``rhs``.

    Args:
        lhs: [M, K], rows sorted by group (group 0's rows first).
        rhs: [G, K, N], one matrix per group; [G, N, K] with ``transpose_rhs=True``.
        group_sizes: [G] integer (int32), rows per group; may be traced. Groups may be empty;
            rows at or past ``sum(group_sizes)`` give zeros.
        preferred_element_type: output dtype (default: the input dtype); accumulation is
            float32.
        transpose_rhs: ``rhs`` is [G, N, K] and each group multiplies ``rhs[g]ᵀ``.
        platform: force an installed platform (``"xla"``, ...).
        cfg: a config for the selected implementation (this call only, never cached).

    Returns:
        [M, N] in ``preferred_element_type``. Differentiable in ``lhs`` and ``rhs``.
    """
    return call_op(SPEC, locals())


SPEC = builtin_op_spec(
    grouped_matmul, differentiable=("lhs", "rhs"), synthetic=grouped_matmul_synthetic
)


def define_grouped_matmul_vjp(
    fn: Callable[..., jax.Array],
    backward: Callable[[jax.Array, Any, dict[str, Any]], tuple[jax.Array, jax.Array]],
) -> Callable[..., jax.Array]:
    """Give a grouped_matmul implementation its custom VJP (:func:`ejkernel.plugins.defvjp`).

    The forward runs ``fn`` and keeps ``lhs``, ``rhs`` and ``group_sizes``; the backward
    returns ``{"lhs": d_lhs, "rhs": d_rhs}`` from ``backward``.

    Args:
        fn: the implementation, ``fn(**args, cfg=cfg) -> out``.
        backward: ``backward(d_out, cfg, args) -> (d_lhs, d_rhs)``, each in its input's dtype;
            ``args`` holds ``lhs``, ``rhs``, ``group_sizes``, ``transpose_rhs`` and
            ``preferred_element_type`` by name, ``cfg`` is the forward's config.

    Returns:
        ``fn``, carrying its forward and backward.
    """
    from ejkernel.plugins import defvjp  # ejkernel.plugins imports the specs

    def fwd(**args: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        return fn(**args), {n: args[n] for n in ("lhs", "rhs", "group_sizes")}

    def bwd(
        residuals: dict[str, jax.Array],
        d_out: jax.Array,
        *,
        cfg: Any = None,
        preferred_element_type: Any = None,
        transpose_rhs: bool = False,
    ) -> dict[str, jax.Array]:
        statics = {"preferred_element_type": preferred_element_type, "transpose_rhs": transpose_rhs}
        d_lhs, d_rhs = backward(d_out, cfg, {**residuals, **statics})
        return {"lhs": d_lhs, "rhs": d_rhs}

    return defvjp(fn, fwd, bwd)
