"""Checks the XLA tests of the recurrent ops share (recurrent, gla, lightning_attention,
kernel_delta_attention, state_space_v1, state_space_v2): outputs and gradients against the
op's reference, two halves carried through the state against one run, and ``jit`` of ``vmap``
of the gradient against the reference's.

Each takes the public op (``ejkernel.gla``, ...) and its reference; calls go through the
executor, which wires the implementation's custom VJP.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal

__all__ = [
    "F32",
    "check_jit_vmap_grad",
    "check_two_halves",
    "check_vjp",
    "common_bad_inputs",
    "invocation",
    "linear_invocation",
    "qkv",
    "rejects_bad_inputs",
    "rejects_bad_linear_inputs",
    "synthetic_like",
]

#: Float32 tolerance multiplier of these ops: 1e-5 · 10 = 1e-4 relative to the largest
#: reference value (chunked forms regroup the recurrence's sums over hundreds of steps).
F32 = 10.0


@functools.partial(jax.jit, static_argnames=("reference", "statics"))
def _reference_vjp(
    reference: Callable[..., Any],
    wrt: dict[str, Any],
    rest: dict[str, Any],
    cotangent: Any,
    statics: tuple[tuple[str, Any], ...],
) -> Any:
    """The reference's output and its gradients for ``cotangent`` (jitted: compiled once per
    shapes, shared by the tests)."""
    out, vjp = jax.vjp(lambda w: reference(**w, **rest, **dict(statics)), wrt)
    return out, vjp(cotangent)[0]


def _vjp_of(call: Callable[..., Any], wrt: Any, rest: Any, cotangent: Any) -> Any:
    out, vjp = jax.vjp(lambda w: call(w, rest), wrt)
    return out, vjp(cotangent)[0]


def check_vjp(
    op: Callable[..., Any],
    reference: Callable[..., Any],
    differentiable: Collection[str],
    arrays: dict[str, Any],
    *,
    cfg: Any = None,
    scale: float = F32,
    **statics: Any,
) -> tuple[Any, dict[str, Any]]:
    """Output and gradients (for a random cotangent) of ``op`` against ``reference``.

    Args:
        op: the public op.
        reference: its reference.
        differentiable: names of the op's differentiable arguments, its main input first (the
            dtype the output and the tolerance follow).
        arrays: the array arguments; those named in ``differentiable`` (and not ``None``) get
            gradients.
        cfg: the implementation's config (``None``: the heuristic's).
        scale: tolerance multiplier of the dtype's table.
        statics: the op's other arguments.

    Returns:
        ``(out, grads)`` of ``op``.
    """
    wrt = {n: x for n, x in arrays.items() if n in differentiable and x is not None}
    rest = {n: x for n, x in arrays.items() if n not in wrt}
    call = lambda w, r: op(**w, **r, cfg=cfg, **statics)
    shapes = jax.eval_shape(call, wrt, rest)
    cotangent = jax.tree.map(lambda o: normal(jax.random.PRNGKey(42), o.shape, o.dtype), shapes)
    # one compiled program for the op's forward and backward (op by op, each primitive of the
    # custom VJP would compile on its own)
    out, grads = jax.jit(lambda w, r, ct: _vjp_of(call, w, r, ct))(wrt, rest, cotangent)
    ref_out, ref_grads = _reference_vjp(
        reference, wrt, rest, cotangent, tuple(sorted(statics.items()))
    )
    dtype = arrays[next(iter(differentiable))].dtype
    assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, ref_out)
    assert jax.tree.leaves(out)[0].dtype == dtype
    assert_close(out, ref_out, dtype=dtype, scale=scale, name="out")
    assert set(grads) == set(wrt)
    for name, grad in grads.items():
        assert grad.shape == arrays[name].shape and grad.dtype == arrays[name].dtype, name
        assert_close(grad, ref_grads[name], dtype=dtype, scale=scale, name=f"d{name}")
    return out, grads


def check_two_halves(
    op: Callable[..., Any],
    arrays: dict[str, Any],
    per_token: Collection[str],
    split: int,
    **statics: Any,
) -> None:
    """The tokens before ``split``, then the rest from the state they end in, equal one run
    (outputs and final state); ``per_token`` names the arrays with a token axis (axis 1)."""
    cut = lambda part: {
        n: (x[:, :split] if part == 0 else x[:, split:]) if n in per_token else x
        for n, x in arrays.items()
        if part == 0 or n != "initial_state"
    }
    whole, state = op(**arrays, return_state=True, **statics)
    out1, mid = op(**cut(0), return_state=True, **statics)
    out2, end = op(**cut(1), initial_state=mid, return_state=True, **statics)
    assert_close(jnp.concatenate([out1, out2], axis=1), whole, scale=F32)
    assert_close(end, state, scale=F32)


def check_jit_vmap_grad(
    op: Callable[..., Any], reference: Callable[..., Any], arrays: dict[str, Any], **statics: Any
) -> None:
    """``jit(vmap(value_and_grad))`` of a loss of ``op`` over a batch of two input sets equals
    ``vmap(value_and_grad)`` of the reference's."""
    stacked = {n: jnp.stack([x, 0.5 * x]) for n, x in arrays.items()}

    def loss(fn: Callable[..., Any], a: dict[str, Any]) -> Any:
        return jnp.sum(jnp.sin(fn(**a, **statics)))

    got = jax.jit(jax.vmap(jax.value_and_grad(functools.partial(loss, op))))(stacked)
    want = jax.vmap(jax.value_and_grad(functools.partial(loss, reference)))(stacked)
    assert_close(got, want, scale=F32)


def common_bad_inputs(valid: dict[str, Any]) -> list[Any]:
    """``pytest.param(changes, error, match)`` of the calls every linear op (recurrent, gla,
    lightning_attention, kernel_delta_attention) rejects with the same message, from the
    arrays of one valid call (``query``, ``key``, ``value`` [B, S, H, ·], B ≥ 2, K ≠ V)."""
    q, k, v = valid["query"], valid["key"], valid["value"]
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    state = r"`initial_state` must be floating \[B, H, K, V\]"
    cases = {
        "query-ndim": ({"query": q[..., 0]}, ValueError, r"`query` must be \[B, S, H, K\]"),
        "query-int": ({"query": q.astype(jnp.int32)}, TypeError, "`query` must be a floating"),
        "key-K": ({"key": k[..., 1:]}, ValueError, r"`key` must be \[B, S, H, K\]"),
        "value-S": ({"value": v[:, 1:]}, ValueError, r"`value` must be \[B, S, H, V\]"),
        "dtype-mix": (
            {"key": k.astype(jnp.bfloat16)},
            TypeError,
            "`query`, `key` and `value` must share one dtype",
        ),
        "initial-state-KV": ({"initial_state": jnp.zeros((b, h, dv, dk))}, ValueError, state),
        "initial-state-N": ({"initial_state": jnp.zeros((b + 1, h, dk, dv))}, ValueError, state),
        "cu-seqlens-B": ({"cu_seqlens": jnp.asarray([0, s])}, ValueError, "`cu_seqlens`.*B == 1"),
        "cu-seqlens-float": (
            {"cu_seqlens": jnp.asarray([0.0, s])},
            TypeError,
            "`cu_seqlens` must be an integer array",
        ),
        "cu-seqlens-2d": (
            {"cu_seqlens": jnp.asarray([[0, s]])},
            ValueError,
            r"`cu_seqlens` must be \[N \+ 1\]",
        ),
        "return-state-str": ({"return_state": "yes"}, TypeError, "`return_state` must be a bool"),
        "scale-str": ({"softmax_scale": "x"}, TypeError, "`softmax_scale` must be a .*number"),
    }
    return [pytest.param(*case, id=name) for name, case in cases.items()]


def rejects_bad_inputs(
    op: Callable[..., Any],
    valid: dict[str, Any],
    cases: list[Any],
    ids: list[str] | None = None,
) -> Callable[..., None]:
    """A test over ``cases`` of ``(changes, error, match)``: ``op`` on ``valid`` arguments with
    ``changes`` raises ``error`` whose message starts with the op's name and matches ``match``,
    before any kernel runs. Bound to a module's ``test_...`` name, pytest collects it there."""

    @pytest.mark.parametrize(("changes", "error", "match"), cases, ids=ids)
    def test(changes: dict[str, Any], error: type, match: str) -> None:
        with pytest.raises(error, match=rf"^{op.__name__}: .*{match}"):
            op(**{**valid, **changes})

    return test


def rejects_bad_linear_inputs(
    op: Callable[..., Any], valid: dict[str, Any], cases: list[Any]
) -> Callable[..., None]:
    """:func:`rejects_bad_inputs` over :func:`common_bad_inputs` of ``valid``, then ``cases``
    (the op's own)."""
    return rejects_bad_inputs(op, valid, [*common_bad_inputs(valid), *cases])


def qkv(keys: Any, sizes: tuple[int, ...], dtype: Any = jnp.float32) -> dict[str, Any]:
    """Random ``query``, ``key`` ``[B, S, H, Dk]`` and ``value`` ``[B, S, H, Dv]`` of ``dtype``
    for ``sizes`` ``(B, S, H, Dk, Dv)``, drawn from ``keys[0]``, ``keys[1]``, ``keys[2]``."""
    b, s, h, dk, dv = sizes
    shapes = {"query": dk, "key": dk, "value": dv}
    return {
        name: normal(key, (b, s, h, d), dtype)
        for key, (name, d) in zip(keys, shapes.items(), strict=False)
    }


def invocation(**kwargs: Any) -> Any:
    """A stand-in for the executor's invocation of a differentiated call, what ``heuristic``
    and ``config_space`` read: the arguments (arrays as ``jax.ShapeDtypeStruct``)."""
    return types.SimpleNamespace(kwargs=kwargs, metadata={"grad": True})


def linear_invocation(s: int, sequences: int | None = None) -> Any:
    """:func:`invocation` of a linear op on a [1, s, 2, 16] query, packing ``sequences``
    sequences when given."""
    cu = None if sequences is None else jax.ShapeDtypeStruct((sequences + 1,), jnp.int32)
    return invocation(query=jax.ShapeDtypeStruct((1, s, 2, 16), jnp.float32), cu_seqlens=cu)


def synthetic_like(spec: Any, arrays: dict[str, Any]) -> dict[str, Any]:
    """The inputs ``spec`` makes for autotuning (validated), for the shapes and dtypes of the
    valid call ``arrays``."""
    bound = spec.validate(spec.bind((), arrays))
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype) if hasattr(v, "shape") else v
        for k, v in bound.items()
    }
    return spec.validate(spec.make_synthetic(abstract, seed=0))
