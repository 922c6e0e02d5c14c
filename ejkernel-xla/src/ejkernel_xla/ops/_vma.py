"""Varying-manual-axes typing for loops and branches inside ``jax.shard_map``.

With replication tracking on (``check_vma=True``, the default), a value computed from a sharded
input *varies* along the mesh axes it was split over, and ``lax.scan``/``lax.cond`` demand the
same typing of a carry's input and output, and of both branches' outputs. A loop that starts
from ``jnp.zeros`` and accumulates sharded data, or a branch that returns zeros beside one that
computes, breaks that rule: these helpers cast the constant side to varying (``lax.pcast``)
where the other side varies. Outside ``shard_map`` nothing varies and they return their input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

__all__ = ["cast_like", "same_branches", "scan_init", "varying"]


def varying(x: Any) -> frozenset[Any]:
    """Mesh axes along which ``x`` differs between devices (empty when untracked)."""
    aval = jax.typeof(x) if not isinstance(x, jax.ShapeDtypeStruct) else x
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.9
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()) or ())


def _vary(x: Any, axes: frozenset[Any]) -> Any:
    missing = tuple(sorted(axes - varying(x), key=str))
    if not missing:
        return x
    cast = getattr(lax, "pcast", None)
    if cast is not None:
        return cast(x, missing, to="varying")
    return lax.pvary(x, missing)  # type: ignore[attr-defined]


def cast_like(tree: Any, like: Any) -> Any:
    """``tree`` with each leaf varying along the axes its counterpart in ``like`` (arrays or
    ``jax.eval_shape`` results of the same structure) varies along."""
    return jax.tree.map(lambda x, ref: _vary(x, varying(ref)), tree, like)


def _in_shard_map() -> bool:
    """Whether tracing runs inside ``shard_map`` (the only place values vary): elsewhere the
    helpers return at once, without tracing anything twice."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    return get is not None and bool(getattr(get(), "manual_axes", ()))


def scan_init(body: Callable[[Any, Any], Any], init: Any, index: Any) -> Any:
    """``init`` typed as ``body``'s carry output varies (``body(init, index)`` traced once
    more, inside ``shard_map`` only)."""
    if not jax.tree.leaves(init) or not _in_shard_map():
        return init
    carry, _ = jax.eval_shape(body, init, index)
    return cast_like(init, carry)


def same_branches(
    fn: Callable[[Any], Any], other: Callable[[Any], Any], x: Any
) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """``fn`` and ``other`` returning outputs varying along the union of what each varies
    (each traced once more, inside ``shard_map`` only)."""
    if not _in_shard_map():
        return fn, other
    a, b = jax.eval_shape(fn, x), jax.eval_shape(other, x)
    union = jax.tree.map(lambda p, q: varying(p) | varying(q), a, b)

    def widen(f: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return lambda y: jax.tree.map(_vary, f(y), union)

    return widen(fn), widen(other)
