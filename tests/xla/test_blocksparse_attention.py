"""The XLA block-sparse attention against the reference: outputs, gradients, masks, schedule.

Calls go through the public ``ejkernel.blocksparse_attention`` with ``block_mask`` traced (an
argument of the jitted test function, as in training) unless a test says otherwise; gradients
are compared with ``jax.vjp`` of :func:`blocksparse_attention_reference`.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.xla import _attention_helpers as helpers

import ejkernel
from ejkernel.specs.blocksparse_attention import blocksparse_attention_reference
from ejkernel.testing import ATTENTION_SHAPES, AttentionShape, assert_close, attention_inputs
from ejkernel.testing import random_normal as normal
from ejkernel_xla.ops import blocksparse_attention as impl

SQUARE = ATTENTION_SHAPES[0]  # B2-Sq37-Sk37-Hq4-Hkv4-D80
GQA = ATTENTION_SHAPES[1]  # B1-Sq129-Sk129-Hq8-Hkv2-D64
SHORT_Q = ATTENTION_SHAPES[2]  # B2-Sq37-Sk129-Hq6-Hkv1-D32
LONG_Q = ATTENTION_SHAPES[3]  # B1-Sq129-Sk37-Hq4-Hkv2-D80-Dv48
DECODE = ATTENTION_SHAPES[4]  # B1-Sq1-Sk129-Hq8-Hkv2-D64


@attrs.frozen(kw_only=True)
class Case:
    """A shape, its block size and the broadcast shape of its block mask; ``str`` is the id."""

    shape: AttentionShape
    block: tuple[int, int]
    batch: bool = True
    heads: bool = True
    live: float = 0.5

    @property
    def grid(self) -> tuple[int, int]:
        return -(-self.shape.sq // self.block[0]), -(-self.shape.sk // self.block[1])

    def mask(self, seed: int = 1) -> jax.Array:
        dims = (self.shape.b if self.batch else 1, self.shape.hq if self.heads else 1, *self.grid)
        return jax.random.bernoulli(jax.random.PRNGKey(seed), self.live, dims)

    def __str__(self) -> str:
        dims = f"{'B' if self.batch else '1'}{'H' if self.heads else '1'}"
        return f"{self.shape}-blocks{self.block[0]}x{self.block[1]}-mask{dims}"


CASES = (
    Case(shape=SQUARE, block=(16, 16)),
    Case(shape=GQA, block=(32, 64), batch=False),
    Case(shape=SHORT_Q, block=(16, 32), heads=False),
    Case(shape=LONG_Q, block=(64, 16), batch=False, heads=False, live=0.7),
    Case(shape=DECODE, block=(1, 32)),
)


def with_gradients(fn: Any, **statics: Any) -> Any:
    """Jitted ``(wrt, mask, d_out) -> (out, grads)``, with the block mask traced."""

    @jax.jit
    def run(wrt: dict[str, Any], mask: Any, d_out: Any) -> Any:
        out, vjp = jax.vjp(lambda w: fn(**w, block_mask=mask, **statics), wrt)
        return out, vjp(d_out)[0]

    return run


def check(
    case: Case, mask: Any = None, dtype: Any = jnp.float32, kv: Any = None, **kwargs: Any
) -> tuple[Any, dict[str, Any]]:
    """Compare output and gradients with the reference; return ours."""
    shape = case.shape
    q, k, v = attention_inputs(shape, dtype) if kv is None else kv
    mask = case.mask() if mask is None else mask
    wrt = {"query": q, "key": k, "value": v}
    if "bias" in kwargs:
        wrt["bias"] = kwargs.pop("bias")
    d_out = normal(
        jax.random.PRNGKey(42), (shape.b, shape.sq, shape.hq, shape.dv or shape.d), dtype
    )
    statics = {"block_size": case.block, **kwargs}
    out, grads = with_gradients(ejkernel.blocksparse_attention, **statics)(wrt, mask, d_out)
    expected = with_gradients(blocksparse_attention_reference, **statics)(wrt, mask, d_out)
    helpers.assert_output_and_gradients_close(out, grads, expected, q.dtype)
    return out, grads


@pytest.mark.parametrize("case", CASES, ids=str)
def test_output_and_gradients_match_the_reference(case: Case) -> None:
    check(case)


def test_causal_window_and_soft_cap_match_with_zero_rows_before_every_key() -> None:
    case = CASES[3]  # Sq=129 > Sk=37 with causal: the first 92 queries see no key
    out, grads = check(case, causal=True, sliding_window=(40, 5), logits_soft_cap=2.0)
    assert np.all(np.asarray(out)[:, :92] == 0.0)
    assert np.all(np.asarray(grads["query"])[:, :92] == 0.0)


@pytest.mark.parametrize(
    "bias_shape",
    [(1, 6, 1, 129), (2, 1, 37, 1)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_bias_and_its_gradient_keep_the_bias_broadcast_shape(bias_shape: tuple[int, ...]) -> None:
    bias = normal(jax.random.PRNGKey(1), bias_shape)
    _, grads = check(CASES[2], bias=bias, logits_soft_cap=3.0)
    assert grads["bias"].shape == bias_shape


def test_full_bias_attention_mask_and_padding_segments_give_zero_rows_and_gradients() -> None:
    case = CASES[2]  # Sq=37, Sk=129, blocks 16 x 32
    shape = case.shape
    q_seg, kv_seg = helpers.padding_segments(shape.b, shape.sq, shape.sk)
    attention_mask = jax.random.bernoulli(
        jax.random.PRNGKey(2), 0.7, (shape.b, 1, shape.sq, shape.sk)
    )
    out, grads = check(
        case,
        bias=normal(jax.random.PRNGKey(3), (shape.b, shape.hq, shape.sq, shape.sk)),
        attention_mask=attention_mask,
        q_segment_ids=jnp.asarray(q_seg),
        kv_segment_ids=jnp.asarray(kv_seg),
    )
    blind = helpers.assert_blind_rows_are_zeros(out, grads, q_seg, kv_seg)
    assert np.all(np.asarray(grads["bias"]).transpose(0, 2, 1, 3)[blind] == 0.0)


def test_query_blocks_without_live_blocks_are_zeros_with_zero_gradients() -> None:
    case = CASES[0]  # Sq=Sk=37, blocks 16 x 16: 3 x 3
    mask = np.asarray(case.mask()).copy()
    mask[0, 1, 1, :] = False  # batch 0, head 1, query rows 16..31: nothing live
    mask[1] = False  # batch 1: nothing live at all
    out, grads = check(case, mask=jnp.asarray(mask))
    assert np.all(np.asarray(out)[0, 16:32, 1] == 0.0)
    assert np.all(np.asarray(grads["query"])[0, 16:32, 1] == 0.0)
    assert np.all(np.asarray(out)[1] == 0.0)
    for name in ("query", "key", "value"):
        assert np.all(np.asarray(grads[name])[1] == 0.0)


def test_dead_blocks_are_never_read() -> None:
    # Key block 2 (keys 64..95) is dead for every row: NaN there must not reach the output.
    case = Case(shape=SHORT_Q, block=(16, 32), heads=False)
    mask = np.asarray(case.mask()).copy()
    mask[:, :, :, 2] = False
    q, k, v = attention_inputs(SHORT_Q)
    poison = lambda x: x.at[:, 64:96].set(jnp.nan)
    out, _ = check(case, mask=jnp.asarray(mask), kv=(q, k, v))  # clean values vs reference
    nan_out = jax.jit(
        lambda q, k, v, m: ejkernel.blocksparse_attention(
            q, k, v, block_mask=m, block_size=(16, 32)
        )
    )(q, poison(k), poison(v), jnp.asarray(mask))
    assert_close(nan_out, out)


@pytest.mark.parametrize(
    "counts",
    [[4] * 12, [0, 0, 13, 1, 2, 0, 7, 40, 3, 3, 0, 1], [40] * 12, [0] * 12, [1] * 11 + [40]],
    ids=["balanced", "uneven", "dense", "empty", "one-busy-row"],
)
def test_schedule_covers_every_live_block_once_within_twice_the_live_work(
    counts: list[int],
) -> None:
    geo = impl._Geometry(b=1, sq=12 * 16, sk=40 * 8, hq=1, hkv=1, d=8, dv=8, bq=16, bk=8)
    rng = np.random.default_rng(0)
    live = np.zeros((geo.rows, geo.nk), bool)
    for r, c in enumerate(counts):
        live[r, rng.choice(geo.nk, c, replace=False)] = True
    schedule = {k: np.asarray(x) for k, x in impl._schedule(jnp.asarray(live), geo).items()}
    steps = int(schedule["steps"])
    seen = np.zeros_like(live, dtype=int)
    for lane in range(geo.lanes):
        row, start, count = (int(schedule[n][lane]) for n in ("row", "start", "count"))
        assert count <= steps
        seen[row, schedule["order"][row, start : start + count]] += 1
    np.testing.assert_array_equal(seen, live.astype(int))
    assert geo.lanes * steps <= 2 * live.sum() + 2 * geo.rows
    if len(set(counts)) == 1 and counts[0] % 2 == 0:  # equal even counts: no wasted lane-step
        assert geo.lanes * steps == live.sum()


def test_jit_and_vmap_over_inputs_and_masks_match_the_reference() -> None:
    case = CASES[2]
    q, k, v = attention_inputs(case.shape)
    qs, ks, vs = (jnp.stack([x, 2.0 * x]) for x in (q, k, v))
    masks = jnp.stack([case.mask(1), case.mask(2)])
    kwargs = {"block_size": case.block, "causal": True}

    def loss(fn: Any) -> Any:
        def f(q: Any, k: Any, v: Any, mask: Any) -> Any:
            return jnp.sum(jnp.sin(fn(q, k, v, block_mask=mask, **kwargs)))

        return jax.jit(jax.vmap(jax.value_and_grad(f, argnums=(0, 1, 2))))

    ours = loss(ejkernel.blocksparse_attention)(qs, ks, vs, masks)
    assert_close(ours, loss(blocksparse_attention_reference)(qs, ks, vs, masks))


def test_bfloat16_matches_the_float32_reference() -> None:
    check(CASES[1], dtype=jnp.bfloat16, causal=True)


def test_eager_call_and_explain_through_the_public_function() -> None:
    case = CASES[0]
    q, k, v = attention_inputs(case.shape)
    mask = case.mask()
    out = ejkernel.blocksparse_attention(q, k, v, block_mask=mask, block_size=16)
    ref = blocksparse_attention_reference(q, k, v, block_mask=mask, block_size=(16, 16))
    assert_close(out, ref)
    sel = ejkernel.explain("blocksparse_attention", q, k, v, block_mask=mask, block_size=16)
    assert sel.platform == "xla" and sel.config is None
    assert sel.implementation.endswith("blocksparse_attention_xla")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"block_mask": jnp.ones((2, 4, 3, 2), bool)},
            ValueError,
            r"^blocksparse_attention: `block_mask` must be bool \[B\|1, Hq\|1, Sq/bq, Sk/bk\] = "
            r"\[2\|1, 4\|1, 3, 3\].*got block_mask.shape=\(2, 4, 3, 2\)",
        ),
        (
            {"block_mask": jnp.ones((3, 1, 3, 3), bool)},
            ValueError,
            r"^blocksparse_attention: `block_mask` must be bool",
        ),
        (
            {"block_mask": jnp.ones((1, 1, 3, 3), jnp.int32)},
            TypeError,
            r"^blocksparse_attention: `block_mask` must be bool \(True = compute the block\); got int32",
        ),
        (
            {"block_mask": jnp.ones((3, 3), bool)},
            ValueError,
            r"^blocksparse_attention: `block_mask` must be bool \[B\|1, Hq\|1",
        ),
        (
            {"block_size": (16, 0)},
            ValueError,
            r"^blocksparse_attention: `block_size` must be positive",
        ),
        (
            {"block_size": (16, 16, 16)},
            TypeError,
            r"^blocksparse_attention: `block_size` must be an int or \(bq, bk\)",
        ),
        (
            {"key": jnp.ones((2, 37, 3, 80))},
            ValueError,
            r"^blocksparse_attention: `key` must be \[B, Sk, Hkv, D\]",
        ),
    ],
    ids=[
        "mask-grid",
        "mask-batch",
        "mask-dtype",
        "mask-ndim",
        "block-zero",
        "block-triple",
        "key-heads",
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs: dict[str, Any], error: type, match: str) -> None:
    q, k, v = attention_inputs(SQUARE)
    args = {"query": q, "key": k, "value": v, "block_mask": jnp.ones((1, 1, 3, 3), bool)}
    args = {**args, "block_size": (16, 16), **kwargs}
    with pytest.raises(error, match=match):
        ejkernel.blocksparse_attention(**args)
