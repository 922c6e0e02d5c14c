"""Custom VJPs: an op implementation's (or a user kernel's) forward/backward as ``jax.custom_vjp``.

The config is chosen lazily, when the function is traced or called: the primal with the
config of the plain call, the VJP forward with the config of the differentiated call (tuned on
forward+backward). The forward hands its config to the backward explicitly, inside the
residuals, as a leafless pytree node (:class:`Static`), so one built function may be traced
any number of times, for any configs, and each backward gets its own forward's config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ejkernel._registry import Implementation
from ejkernel.specs import OpSpec

__all__ = [
    "Static",
    "build_kernel_function",
    "build_op_function",
    "forward_only",
    "is_float_array",
    "traced",
]


class Static:
    """A Python value carried through a pytree (JAX residuals) as structure, not as leaves.

    Compared by identity, so any value (an unhashable config too) may travel.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


jax.tree_util.register_pytree_node(Static, lambda s: ((), s), lambda s, _: s)


def is_float_array(x: Any) -> bool:
    return x is not None and hasattr(x, "dtype") and bool(jnp.issubdtype(x.dtype, jnp.floating))


def traced(arrays: Mapping[str, Any]) -> bool:
    """Whether any value is a tracer (the call is being transformed: jit, grad, vmap...)."""
    return any(isinstance(v, jax.core.Tracer) for v in arrays.values())


def build_op_function(
    spec: OpSpec,
    impl: Implementation,
    arguments: Mapping[str, Any],
    choose: Callable[[bool], Any],
    scope: Callable[[bool], str] | None = None,
) -> Callable[[dict[str, Any]], Any]:
    """``f(arrays) -> out`` for the given statics; wires ``impl.get_vjp()`` as a custom VJP.

    Args:
        spec: the op.
        impl: the implementation to run.
        arguments: every argument of the call, validated (arrays may be replaced when ``f``
            is called; their names and the statics are fixed here).
        choose: ``choose(grad) -> cfg``, run when ``f`` (or its VJP forward) is traced.
        scope: ``scope(grad) -> name``, called after ``choose(grad)``: the implementation
            (forward and backward) runs inside ``jax.named_scope(name)`` (op stamps).

    Returns:
        ``f``, taking the dict of the call's non-``None`` array arguments.
    """
    fn = impl.fn
    statics = {k: v for k, v in arguments.items() if not spec.arg(k).array}
    nones = {k: None for k, v in arguments.items() if spec.arg(k).array and v is None}
    diff = {a.name for a in spec.args if a.differentiable and is_float_array(arguments.get(a.name))}

    def primal(arrays: dict[str, Any]) -> Any:
        cfg = choose(False)
        if scope is None:
            return fn(**statics, **nones, **arrays, cfg=cfg)
        with jax.named_scope(scope(False)):
            return fn(**statics, **nones, **arrays, cfg=cfg)

    if not spec.differentiable:
        return forward_only(spec.name, primal)
    vjp = impl.get_vjp()
    if not (spec.differentiable and diff and vjp is not None):
        return primal
    fwd_fn, bwd_fn = vjp

    def fwd(arrays: dict[str, Any]) -> tuple[Any, Any]:
        cfg = choose(True)
        name = scope(True) if scope is not None else None
        with _named(name):
            out, residuals = fwd_fn(**statics, **nones, **arrays, cfg=cfg)
        return out, (residuals, Static((cfg, tuple(arrays), name)))

    def bwd(saved: tuple[Any, Static], d_out: Any) -> tuple[dict[str, Any]]:
        residuals, static = saved
        cfg, names, name = static.value
        with _named(name):
            grads = bwd_fn(residuals, d_out, **statics, cfg=cfg)
        return ({k: (grads.get(k) if k in diff else None) for k in names},)

    wrapped = jax.custom_vjp(primal)
    wrapped.defvjp(fwd, bwd)
    return wrapped


def _named(name: str | None) -> Any:
    return jax.named_scope(name) if name is not None else contextlib.nullcontext()


def forward_only(
    op: str, primal: Callable[[dict[str, Any]], Any]
) -> Callable[[dict[str, Any]], Any]:
    """``primal`` of an op with no backward pass: differentiating it (``jax.grad``, ``vjp``,
    ``jvp``) raises a TypeError naming the op, rather than failing somewhere inside the
    implementation (an XLA ``while_loop`` cannot be reverse-differentiated)."""

    def refuse(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> Any:
        raise TypeError(
            f"{op} is forward-only: it has no gradient (it cannot be differentiated with "
            f"jax.grad, jax.vjp or jax.jvp); stop gradients before it with jax.lax.stop_gradient"
        )

    wrapped = jax.custom_jvp(primal)
    wrapped.defjvp(refuse)
    return wrapped


def build_kernel_function(
    method: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    positions: Sequence[int],
    choose: Callable[[bool], Any],
    custom_vjp: Callable[[tuple[Any, ...], Any, Any, tuple[Any, ...]], Any],
) -> Callable[[tuple[Any, ...]], Any]:
    """``f(diff) -> out`` for a user kernel: ``diff`` replaces ``args`` at ``positions``.

    The backward is the kernel's ``custom_vjp(primals, cfg, kwargs, cotangents)``, given the
    config its forward ran with.
    """

    def full(diff: tuple[Any, ...]) -> list[Any]:
        values = list(args)
        for i, x in zip(positions, diff):
            values[i] = x
        return values

    def primal(diff: tuple[Any, ...]) -> Any:
        return method(*full(diff), cfg=choose(False), **kwargs)

    def fwd(diff: tuple[Any, ...]) -> tuple[Any, Any]:
        cfg = choose(True)
        values = full(diff)
        return method(*values, cfg=cfg, **kwargs), (tuple(values), Static(cfg))

    def bwd(saved: tuple[tuple[Any, ...], Static], ct: Any) -> tuple[tuple[Any, ...]]:
        primals, static = saved
        grads = custom_vjp(primals, static.value, kwargs, (ct,))
        return (tuple(grads[i] for i in positions),)

    wrapped = jax.custom_vjp(primal)
    wrapped.defvjp(fwd, bwd)
    return wrapped
