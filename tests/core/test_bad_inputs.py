"""Inputs a user gets wrong raise a TypeError/ValueError naming the argument, before any
kernel runs; through each op's public function on the XLA platform."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel.specs import builtin_ops, builtin_spec
from ejkernel.testing._examples import examples_of

pytestmark = pytest.mark.filterwarnings("ignore")


def first_example(op: str) -> dict[str, Any]:
    """The arguments of the op's first conformance example (float32)."""
    spec = builtin_spec(op)
    return examples_of(spec)[0].build(spec, "float32")


def call(op: str, args: dict[str, Any]) -> Any:
    return getattr(ejkernel, op)(**args, platform="xla")


SCALED = [op for op in builtin_ops() if "softmax_scale" in builtin_spec(op).arg_names]


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("op", SCALED)
def test_softmax_scale_must_be_finite(op: str, scale: float) -> None:
    with pytest.raises(ValueError, match=rf"{op}: `softmax_scale` must be a finite number"):
        call(op, {**first_example(op), "softmax_scale": scale})


DROPOUT = [op for op in builtin_ops() if "dropout_seed" in builtin_spec(op).arg_names]


@pytest.mark.parametrize("seed", [2**31, 2**40, -(2**31) - 1])
@pytest.mark.parametrize("op", DROPOUT)
def test_dropout_seed_must_fit_int32(op: str, seed: int) -> None:
    args = {**first_example(op), "dropout_prob": 0.1, "dropout_seed": seed}
    with pytest.raises(ValueError, match=rf"{op}: `dropout_seed` must be in \[-2\*\*31, 2\*\*31\)"):
        call(op, args)


@pytest.mark.parametrize("op", DROPOUT)
def test_traced_dropout_prob_is_a_type_error(op: str) -> None:
    args = first_example(op)
    with pytest.raises(TypeError, match=rf"{op}: `dropout_prob` must be a Python float"):
        jax.jit(lambda p: call(op, {**args, "dropout_prob": p}))(0.1)


BAD_CU_SEQLENS = [
    ("float", lambda s: jnp.asarray([0.0, s]), TypeError, "`cu_seqlens` must be an integer"),
    ("one-offset", lambda s: jnp.asarray([0]), ValueError, r"`cu_seqlens` must be \[N \+ 1\]"),
    ("2d", lambda s: jnp.asarray([[0, s]]), ValueError, r"`cu_seqlens` must be \[N \+ 1\]"),
    ("past-S", lambda s: jnp.asarray([0, s + 1]), ValueError, "must lie in"),
    ("negative", lambda s: jnp.asarray([-1, s]), ValueError, "must lie in"),
    ("decreasing", lambda s: jnp.asarray([0, 5, 3, s]), ValueError, "never decrease"),
]


def packed_example(op: str) -> dict[str, Any]:
    """A valid packed call of the op (B == 1, cu_seqlens given)."""
    spec = builtin_spec(op)
    for example in examples_of(spec):
        if "cu_seqlens" in example.arrays:
            return example.build(spec, "float32")
    raise AssertionError(f"{op} has no packed example")


@pytest.mark.parametrize(
    "name,make,error,match", BAD_CU_SEQLENS, ids=[c[0] for c in BAD_CU_SEQLENS]
)
@pytest.mark.parametrize("op", ["native_sparse_attention", "kernel_delta_attention"])
def test_cu_seqlens_checked_alike(op: str, name: str, make: Any, error: type, match: str) -> None:
    args = packed_example(op)
    s = args["query"].shape[1]
    with pytest.raises(error, match=rf"{op}: .*{match}"):
        call(op, {**args, "cu_seqlens": make(s)})


#: Per op, the arguments whose leading axis is the batch (sequences for the serving ops).
BATCHED: dict[str, tuple[str, ...]] = {
    "attention": ("query", "key", "value"),
    "blocksparse_attention": ("query", "key", "value"),
    "flash_attention": ("query", "key", "value"),
    "gla": ("query", "key", "value", "g", "initial_state"),
    "grouped_matmul": ("lhs",),
    "kernel_delta_attention": ("query", "key", "value", "beta", "g", "initial_state"),
    "lightning_attention": ("query", "key", "value", "initial_state"),
    "mean_pooling": ("x",),
    "multi_head_latent_attention": ("query", "key_value", "k_rope"),
    "native_sparse_attention": ("query", "key", "value", "g_cmp", "g_slc", "g_swa"),
    "page_attention": ("query", "kv_lens", "block_tables"),
    "prefill_page_attention": ("query",),
    "ragged_decode_attention": ("query", "key", "value", "sequence_start", "sequence_end"),
    "ragged_page_attention": ("queries", "kv_lens", "block_tables"),
    "ragged_page_attention_v3": ("queries", "keys", "values", "kv_lens", "block_tables"),
    "recurrent": ("query", "key", "value", "g", "gk", "initial_state"),
    "ring_attention": ("query", "key", "value"),
    "scaled_dot_product_attention": ("query", "key", "value"),
    "state_space_v1": ("x", "B", "C", "dt"),
    "state_space_v2": ("x", "B", "C", "dt"),
    "unified_attention": ("queries", "kv_lens", "block_tables"),
}


def batch_zero_case(op: str) -> tuple[dict[str, Any], Any]:
    """A valid unpacked call of the op with its batch (or token and sequence count) cut to 0,
    and the output it must return: the full call's output with the batch axis cut to 0."""
    spec = builtin_spec(op)
    example = next(e for e in examples_of(spec) if "cu_seqlens" not in e.arrays)
    args = example.build(spec, "float32")
    cut = {name: args[name][:0] for name in BATCHED[op] if args.get(name) is not None}
    if "query_start_loc" in args:
        cut["query_start_loc"] = args["query_start_loc"][:1] * 0
    if "num_seqs" in args:
        cut["num_seqs"] = jnp.zeros_like(args["num_seqs"])
    if "group_sizes" in args:
        cut["group_sizes"] = jnp.zeros_like(args["group_sizes"])
    if "kv_len" in args:
        cut["kv_len"] = jnp.zeros_like(args["kv_len"])
    checked = spec.validate(dict(spec.bind((), args)))
    arrays = {k: v for k, v in checked.items() if spec.arg(k).array and v is not None}
    statics = {k: v for k, v in checked.items() if k not in arrays}
    full = jax.eval_shape(lambda arr: spec.reference(**arr, **statics), arrays)
    return {**args, **cut}, full


#: Outputs that keep their size when the batch is 0 (the caches the op returns, unchanged).
UNBATCHED_OUTPUTS = {"ragged_page_attention_v3": (1, 2)}


@pytest.mark.parametrize("op", builtin_ops())
def test_batch_zero_returns_an_empty_output(op: str) -> None:
    args, full = batch_zero_case(op)
    out = call(op, args)
    keep = UNBATCHED_OUTPUTS.get(op, ())
    got = jax.tree.leaves(out)
    want = jax.tree.leaves(full)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        shape = w.shape if i in keep else (0, *w.shape[1:])
        assert (g.shape, g.dtype) == (shape, w.dtype), (op, i)
    for i, cache in zip(keep, ("key_cache", "value_cache")):
        assert np.array_equal(np.asarray(got[i]), np.asarray(args[cache]), equal_nan=True)


@pytest.mark.parametrize("op", ["flash_attention", "kernel_delta_attention", "grouped_matmul"])
def test_batch_zero_under_jit_and_grad(op: str) -> None:
    args, _ = batch_zero_case(op)
    spec = builtin_spec(op)
    arrays = {
        k: v
        for k, v in args.items()
        if spec.arg(k).differentiable and v is not None and jnp.issubdtype(v.dtype, jnp.floating)
    }
    others = {k: v for k, v in args.items() if k not in arrays}

    def loss(arr: dict[str, Any]) -> Any:
        return sum(jnp.sum(x) for x in jax.tree.leaves(call(op, {**others, **arr})))

    grads = jax.jit(jax.grad(loss))(arrays)
    for name, g in grads.items():
        assert g.shape == arrays[name].shape and not np.any(np.asarray(g)), name


FORWARD_ONLY = [op for op in builtin_ops() if not builtin_spec(op).differentiable]


def query_of(args: dict[str, Any]) -> str:
    return "query" if "query" in args else "queries"


@pytest.mark.parametrize("op", FORWARD_ONLY)
def test_grad_through_a_forward_only_op_names_it(op: str) -> None:
    args = first_example(op)
    name = query_of(args)

    def loss(q: Any) -> Any:
        return jnp.sum(jax.tree.leaves(call(op, {**args, name: q}))[0])

    with pytest.raises(TypeError, match=rf"{op} is forward-only: it has no gradient"):
        jax.grad(loss)(args[name])
    with pytest.raises(TypeError, match=rf"{op} is forward-only"):
        jax.jvp(loss, (args[name],), (jnp.ones_like(args[name]),))
    stopped = jax.grad(lambda q: loss(jax.lax.stop_gradient(q)))(args[name])
    assert not np.any(np.asarray(stopped))
    assert np.allclose(jax.jit(loss)(args[name]), loss(args[name]), equal_nan=True)


@pytest.mark.parametrize("op", builtin_ops())
def test_cfg_of_a_wrong_type_is_an_error(op: str) -> None:
    with pytest.raises(ValueError, match=rf"{op}: `cfg` must be a \w+"):
        call(op, {**first_example(op), "cfg": "big blocks"})


def test_cfg_of_another_op_is_an_error_not_a_silent_default() -> None:
    from ejkernel.modules import GlaConfig

    args = first_example("flash_attention")
    with pytest.raises(ValueError, match=r"flash_attention: `cfg` is a GlaConfig whose fields"):
        call("flash_attention", {**args, "cfg": GlaConfig(chunk_size=64)})


def test_cfg_that_only_names_a_platform_or_fits_by_options_is_accepted() -> None:
    from ejkernel.modules import FlashAttentionConfig, GlaConfig
    from ejkernel.plugins import FwdParams

    args = first_example("flash_attention")
    call("flash_attention", {**args, "cfg": FlashAttentionConfig(platform="xla")})
    fwd = FwdParams(q_blocksize=16, kv_blocksize=16)
    call("flash_attention", {**args, "cfg": FlashAttentionConfig(fwd_params=fwd)})
    gla = first_example("gla")
    call("gla", {**gla, "cfg": GlaConfig(options={"chunk_size": 16})})
    with pytest.raises(ValueError, match="takes no config"):
        call("mean_pooling", {**first_example("mean_pooling"), "cfg": GlaConfig(chunk_size=16)})


def test_batch_zero_still_checks_platform_and_cfg() -> None:
    args = first_example("flash_attention")
    args = {k: (v[:0] if k in ("query", "key", "value") else v) for k, v in args.items()}
    with pytest.raises(TypeError, match="`platform` must be a str or None"):
        ejkernel.flash_attention(**args, platform=123)
    with pytest.raises(ValueError, match="`platform`='nowhere' is not installed"):
        ejkernel.flash_attention(**args, platform="nowhere")
    with pytest.raises(ValueError, match="`cfg` must be a config"):
        ejkernel.flash_attention(**args, cfg="big blocks")
    assert ejkernel.flash_attention(**args, platform="xla").shape[0] == 0


#: Serving ops: their key and value caches (a dense cache for ``ragged_decode_attention``).
SERVING = {
    op: ("key", "value") if op == "ragged_decode_attention" else ("key_cache", "value_cache")
    for op in builtin_ops()
    if "k_scale" in builtin_spec(op).arg_names
}
#: A bad scale (``hkv`` -> value), the error and its message after the argument's name.
BAD_SCALES = {
    "k_scale-Hkv+1": ("k_scale", lambda h: np.ones((h + 1,), np.float32), ValueError, "shape"),
    "v_scale-2d": ("v_scale", lambda h: np.ones((h, 1), np.float32), ValueError, "shape"),
    "k_scale-bfloat16": ("k_scale", lambda h: jnp.ones((h,), jnp.bfloat16), TypeError, "dtype"),
    "v_scale-int32": ("v_scale", lambda h: np.ones((h,), np.int32), TypeError, "dtype"),
    "k_scale-str": ("k_scale", lambda h: "0.5", TypeError, "str"),
    "v_scale-bool": ("v_scale", lambda h: True, TypeError, "True"),
    "k_scale-zero": ("k_scale", lambda h: 0.0, ValueError, "zero"),
    "v_scale-nan": ("v_scale", lambda h: math.nan, ValueError, "zero"),
    "k_scale-negative": ("k_scale", lambda h: -1.0, ValueError, "zero"),
    "v_scale-past-float32": ("v_scale", lambda h: 1e40, ValueError, "zero"),
}


@pytest.mark.parametrize("case", sorted(BAD_SCALES))
@pytest.mark.parametrize("op", sorted(SERVING))
def test_a_bad_cache_scale_is_refused_naming_it(op: str, case: str) -> None:
    name, make, error, kind = BAD_SCALES[case]
    args = first_example(op)
    hkv = int(args[SERVING[op][0]].shape[2])
    expected = rf"`{name}` must be a float or a float32 array \[Hkv\] with Hkv={hkv}; got "
    message = {
        "shape": expected + rf"{name}\.shape=",
        "dtype": expected + "dtype ",
        "str": expected + "str",
        "True": expected + "True",
        "zero": rf"`{name}` must be finite and > 0; got ",
    }[kind]
    with pytest.raises(error, match=rf"^{op}: {message}"):
        call(op, {**args, name: make(hkv)})


def float8_caches(op: str, args: dict[str, Any], dtype: Any = jnp.float8_e4m3fn) -> dict[str, Any]:
    return {**args, **{name: args[name].astype(dtype) for name in SERVING[op]}}


@pytest.mark.parametrize("missing", ["k_scale", "v_scale"])
@pytest.mark.parametrize("op", sorted(SERVING))
def test_a_float8_cache_needs_its_scale(op: str, missing: str) -> None:
    args = float8_caches(op, first_example(op))
    given = {"v_scale" if missing == "k_scale" else "k_scale": 0.5}
    cache = SERVING[op][0 if missing == "k_scale" else 1]
    with pytest.raises(ValueError, match=rf"^{op}: `{missing}` must be .* when `{cache}` is float8_e4m3fn; got None"):  # fmt: skip
        call(op, {**args, **given})


@pytest.mark.parametrize("op", sorted(SERVING))
def test_float8_queries_and_other_float8_caches_are_refused(op: str) -> None:
    args = first_example(op)
    scales = {"k_scale": 0.5, "v_scale": 0.5}
    query = "queries" if "queries" in args else "query"
    fp8 = float8_caches(op, args)
    with pytest.raises(TypeError, match=rf"^{op}: `{query}` and .* must share one dtype, or the"):
        call(op, {**fp8, query: args[query].astype(jnp.float8_e4m3fn), **scales})
    e5m2 = float8_caches(op, args, jnp.float8_e5m2)
    cache = SERVING[op][0]
    with pytest.raises(TypeError, match=rf"^{op}: `{cache}` must be float8_e4m3fn .*float8_e5m2"):
        call(op, {**e5m2, **scales})


def test_v3_new_tokens_come_in_the_queries_dtype_beside_a_float8_cache() -> None:
    args = float8_caches("ragged_page_attention_v3", first_example("ragged_page_attention_v3"))
    args |= {"k_scale": 0.5, "v_scale": 0.5, "keys": args["keys"].astype(jnp.bfloat16)}
    with pytest.raises(TypeError, match=r"`keys` must share the queries' dtype float32; got dtype"):
        call("ragged_page_attention_v3", args)
