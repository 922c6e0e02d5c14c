"""What the tests of the XLA attention ops share.

For the serving ops: the jitted oracle, the arguments as the core passes them to an
implementation, an MQA batch, and the checks every serving op makes (output against the
reference, config space, hostile tables, memory that must not grow, bad inputs). For the
differentiable ones: output and gradients against the reference. For ring attention: the
sharded ring and the reference on the global arrays, with their gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import ejkernel
from ejkernel._invocation import Invocation
from ejkernel.ops import undo_zigzag_layout, zigzag_layout
from ejkernel.specs import OpSpec
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import assert_close, random_normal
from ejkernel.testing.cases._paged import GARBAGE, PagedBatch
from ejkernel.testing.cases.ragged_page_attention import MIXED as CASES_MIXED


def validated(spec: OpSpec, arrays: dict[str, Any], **options: Any) -> dict[str, Any]:
    """Every argument as the core passes it to an implementation."""
    return spec.validate(spec.bind((), {**arrays, **options}))


def abstract(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x


def sinks(hq: int, kind: str, seed: int) -> jax.Array:
    """Random sink logits (around 1), ``[Hq]`` for ``kind`` ``"Hq"``, else ``[Hq, 2]``."""
    shape = (hq,) if kind == "Hq" else (hq, 2)
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) + 1.0, jnp.float32)


def assert_output(
    out: jax.Array, expected: Any, shape: tuple[int, ...], dtype: str, name: str
) -> None:
    """``out`` has ``shape`` and ``dtype``, holds no garbage and matches the reference."""
    assert out.shape == tuple(shape) and out.dtype == jnp.dtype(dtype)
    assert np.all(np.isfinite(np.asarray(out, np.float32))), "garbage leaked into the output"
    assert_close(out, expected, name=name)


def check_call(
    fn: Callable[..., Any],
    spec: OpSpec,
    reference: Callable[..., Any],
    arrays: dict[str, Any],
    cfg: Any,
    dtype: str,
    name: str,
    **options: Any,
) -> jax.Array:
    """``fn(cfg=cfg)`` on ``arrays`` with ``options``, checked by :func:`assert_output` against
    ``reference`` in the query's shape; returns the output."""
    args = validated(spec, arrays, **options)
    out = fn(**args, cfg=cfg)
    assert_output(out, reference(**args), args["query"].shape, dtype, name)
    return out


def config_space_of(
    spec: OpSpec,
    args: dict[str, Any],
    heuristic: Callable[..., Any],
    config_space: Callable[..., Any],
) -> list[Any]:
    """The config space for ``args``, checked: the heuristic's config first, no repeats, at
    most 8."""
    inv = Invocation(kernel=spec.name, kwargs={k: abstract(v) for k, v in args.items()})
    space = config_space(inv)
    assert space[0] == heuristic(inv) and len(space) == len(set(space))
    assert 1 <= len(space) <= 8
    return space


def temp_bytes(fn: Callable[..., Any], shapes: dict[str, Any]) -> int:
    """Temporary bytes of ``fn(**shapes)`` compiled (skips where the backend reports none)."""
    memory = jax.jit(lambda a: fn(**a)).lower(shapes).compile().memory_analysis()
    if memory is None:
        pytest.skip("this backend reports no memory analysis")
    return int(memory.temp_size_in_bytes)


def abstract_paged_cache(num_pages: int, seqs: int, max_pages: int) -> dict[str, Any]:
    """Abstract ``key_cache``/``value_cache`` (float32, 16-token pages, Hkv 2, D 64) of
    ``num_pages`` pages, with ``kv_lens`` and ``block_tables`` of ``seqs`` sequences of up to
    ``max_pages`` pages."""
    cache = jax.ShapeDtypeStruct((num_pages, 16, 2, 64), jnp.float32)
    return {
        "key_cache": cache,
        "value_cache": cache,
        "kv_lens": jax.ShapeDtypeStruct((seqs,), jnp.int32),
        "block_tables": jax.ShapeDtypeStruct((seqs, max_pages), jnp.int32),
    }


#: The conformance ragged batch (lengths 0 and 1, whole pages, a chunked prefill, decode steps,
#: a sequence with more queries than keys, padding tokens) at D 40, with a 2-page prefix shared
#: by sequences 0 and 3.
MIXED = attrs.evolve(CASES_MIXED, d=40, shared_pages=2)


def mqa_batch(kv_lens: tuple[int, ...], q_lens: tuple[int, ...], num_pages: int) -> PagedBatch:
    """MQA (Hq 4, Hkv 1, D 32) over 16-token pages, at most 9 a sequence."""
    return PagedBatch(
        kv_lens=kv_lens,
        q_lens=q_lens,
        hq=4,
        hkv=1,
        d=32,
        page_size=16,
        max_pages=9,
        num_pages=num_pages,
    )


def assert_unused_slots_change_nothing(
    fn: Callable[..., Any],
    spec: OpSpec,
    make_inputs: Callable[..., dict[str, Any]],
    batch: Any,
    unused: tuple[Any, ...] = (0, GARBAGE),
    **options: Any,
) -> None:
    """``fn``'s output is the same whatever the table slots past the live pages hold
    (``make_inputs(batch, unused=u)`` builds the arguments with ``u`` there)."""
    outs = [
        np.asarray(fn(**validated(spec, make_inputs(batch, unused=u), **options))) for u in unused
    ]
    assert all(np.array_equal(outs[0], out) for out in outs[1:])


def explained_public_call(
    spec: OpSpec, args: tuple[Any, ...], config_type: type, **options: Any
) -> Any:
    """``ejkernel.explain`` picks the XLA implementation and its heuristic config (a
    ``config_type``) for ``args``; returns what the public function gives for them."""
    record = ejkernel.explain(spec.name, *args, **options)
    assert record.platform == "xla" and record.source == "heuristic"
    assert isinstance(record.config, config_type)
    return getattr(ejkernel, spec.name)(*args, **options)


def synthetic(spec: OpSpec, arrays: dict[str, Any], seed: int, **options: Any) -> dict[str, Any]:
    """The inputs ``spec`` makes for autotuning, for the shapes and dtypes of the valid call
    ``arrays`` (with ``options``)."""
    shapes = {k: abstract(v) for k, v in validated(spec, arrays, **options).items()}
    return spec.make_synthetic(shapes, seed=seed)


def error_id(x: Any) -> str | None:
    """Readable parameter ids of a bad-input table: argument names, not values or messages."""
    return x if isinstance(x, str) and not x.startswith("`") else None


def assert_rejected(spec: OpSpec, arrays: dict[str, Any], message: str) -> None:
    """The public function refuses ``arrays`` before any kernel runs, with ``message`` after
    the op's name."""
    with pytest.raises((TypeError, ValueError), match=rf"^{spec.name}: " + message):
        getattr(ejkernel, spec.name)(**arrays)


def rejects_bad_inputs(
    spec: OpSpec, valid: Callable[[], dict[str, Any]], cases: list[Any]
) -> Callable[..., None]:
    """A test over ``cases`` of ``(name, value, message)``: the arguments ``valid()`` with
    ``name`` set to ``value`` are refused as :func:`assert_rejected` says. Bound to a module's
    ``test_...`` name, pytest collects it there."""

    @pytest.mark.parametrize(("name", "value", "message"), cases, ids=error_id)
    def test(name: str, value: Any, message: str) -> None:
        assert_rejected(spec, {**valid(), name: value}, message)

    return test


def assert_output_and_gradients_close(
    out: Any, grads: dict[str, Any], expected: tuple[Any, dict[str, Any]], dtype: Any
) -> None:
    """``out`` is of ``dtype``; it and ``grads`` match the reference's ``expected``
    ``(output, gradients)``."""
    assert out.dtype == dtype
    assert_close(out, expected[0], name="out")
    assert_gradients_close(grads, expected[1])


def assert_gradients_close(grads: dict[str, Any], expected: dict[str, Any]) -> None:
    """Each gradient has the reference gradient's shape and dtype and matches it."""
    for name, grad in grads.items():
        assert grad.shape == expected[name].shape and grad.dtype == expected[name].dtype
        assert_close(grad, expected[name], name=f"d{name}")


#: Bias shapes against [B, Hq, Sq, Sk] = [2, 6, 37, 129]: full, and broadcast along each axis.
BIAS_SHAPES = [(2, 6, 37, 129), (1, 6, 1, 129), (37, 129), (2, 1, 37, 1)]


def shape_id(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def assert_bias_gradient_keeps_its_shape(
    check: Callable[..., tuple[Any, dict[str, Any]]], bias_shape: tuple[int, ...]
) -> None:
    """``check(bias=..., logits_soft_cap=...)`` passes and returns a bias gradient in the
    bias's own (broadcast) shape."""
    bias = random_normal(jax.random.PRNGKey(1), bias_shape)
    _, grads = check(bias=bias, logits_soft_cap=3.0)
    assert grads["bias"].shape == bias_shape


def padding_segments(b: int, sq: int, sk: int) -> tuple[np.ndarray, np.ndarray]:
    """Query and key segment ids (``[b, sq]``, ``[b, sk]``, ``sk`` >= 100) with padding (-1)
    on both sides and, in batch row 1, a query segment (7) that has no keys."""
    q_seg = np.full((b, sq), -1, np.int32)
    q_seg[:, :10], q_seg[:, 10:30], q_seg[1, 30:33] = 0, 1, 7  # id 7 has no keys
    kv_seg = np.full((b, sk), -1, np.int32)
    kv_seg[:, :50], kv_seg[:, 50:100] = 0, 1
    return q_seg, kv_seg


def assert_blind_rows_are_zeros(
    out: Any, grads: dict[str, Any], q_seg: np.ndarray, kv_seg: np.ndarray
) -> np.ndarray:
    """Rows of :func:`padding_segments` that see no key give zeros and zero query gradients,
    padding keys get zero gradients, and no gradient holds NaN; returns the blind rows."""
    blind = (q_seg < 0) | (q_seg == 7)
    assert np.all(np.asarray(out)[blind] == 0.0)
    assert np.all(np.asarray(grads["query"])[blind] == 0.0)
    assert np.all(np.asarray(grads["key"])[kv_seg < 0] == 0.0)
    for grad in grads.values():
        assert np.all(np.isfinite(np.asarray(grad)))
    return blind


def ring_and_reference(
    mesh: Any,
    axis: str,
    names: tuple[str, ...],
    layout: str,
    cotangent: jax.Array,
    upcast: Any = None,
    **statics: Any,
) -> Callable[[dict[str, Any]], Any]:
    """A jitted function of the global arrays (``names``) giving ``[(out, grads), (ref_out,
    ref_grads)]``: ``ejkernel.ring_attention`` in ``jax.shard_map`` over ``mesh``'s ``axis``
    (rows split; ``"zigzag"`` through ``zigzag_layout``), then ``flash_attention_reference``
    (on float32 copies of the arrays of dtype ``upcast``), each with its query, key and value
    gradients under ``cotangent``."""
    n = mesh.shape[axis]
    rows = PartitionSpec(None, axis)

    def sharded(*xs: Any) -> Any:
        return ejkernel.ring_attention(
            **dict(zip(names, xs)), axis_name=axis, layout=layout, **statics
        )

    ring = jax.shard_map(sharded, mesh=mesh, in_specs=rows, out_specs=rows)

    def ours(arrs: dict[str, Any]) -> Any:
        xs = [arrs[k] for k in names]
        if layout == "zigzag":
            return undo_zigzag_layout(ring(*(zigzag_layout(x, n) for x in xs)), n)
        return ring(*xs)

    def reference(arrs: dict[str, Any]) -> Any:
        if upcast is not None:
            arrs = {k: x.astype(jnp.float32) if x.dtype == upcast else x for k, x in arrs.items()}
        return flash_attention_reference(**arrs, **statics)

    diff = ("query", "key", "value")

    @jax.jit
    def both(arrs: dict[str, Any]) -> Any:
        fixed = {k: x for k, x in arrs.items() if k not in diff}
        results = []
        for fn in (ours, reference):
            out, vjp = jax.vjp(lambda w, fn=fn: fn({**w, **fixed}), {k: arrs[k] for k in diff})
            results.append((out, vjp(cotangent.astype(out.dtype))[0]))
        return results

    return both
