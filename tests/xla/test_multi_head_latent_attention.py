"""The XLA multi-head latent attention against the reference, in both forms.

Calls go through the public ``ejkernel.multi_head_latent_attention`` (the executor wires the
custom VJP); gradients of all five arrays are compared with ``jax.vjp`` of
:func:`multi_head_latent_attention_reference`, which materialises per-head keys and values.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel._params import BwdParams, FwdParams
from ejkernel.specs.multi_head_latent_attention import multi_head_latent_attention_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal
from ejkernel_xla.ops.multi_head_latent_attention import (
    MultiHeadLatentAttentionConfig,
    config_space,
    heuristic,
    mla_form,
)

ARRAYS = ("query", "key_value", "w_kc", "w_vc", "k_rope")


@attrs.frozen(kw_only=True)
class MlaShape:
    """One MLA problem size; ``str()`` is a readable test id."""

    b: int
    sq: int
    sk: int
    hq: int
    r: int
    dn: int
    dr: int
    dv: int

    def __str__(self) -> str:
        return f"B{self.b}-Sq{self.sq}-Sk{self.sk}-Hq{self.hq}-R{self.r}-Dn{self.dn}-Dr{self.dr}-Dv{self.dv}"

    def inputs(self, dtype: Any = jnp.float32, seed: int = 0) -> dict[str, jax.Array]:
        ks = jax.random.split(jax.random.PRNGKey(seed), 5)
        proj = self.r**-0.5  # keeps up-projected keys and values of unit scale
        return {
            "query": normal(ks[0], (self.b, self.sq, self.hq, self.dn + self.dr), dtype),
            "key_value": normal(ks[1], (self.b, self.sk, self.r), dtype),
            "w_kc": (normal(ks[2], (self.r, self.hq, self.dn)) * proj).astype(dtype),
            "w_vc": (normal(ks[3], (self.r, self.hq, self.dv)) * proj).astype(dtype),
            "k_rope": normal(ks[4], (self.b, self.sk, self.dr), dtype),
        }


SQUARE = MlaShape(b=2, sq=37, sk=37, hq=3, r=24, dn=16, dr=8, dv=12)
DECODE = MlaShape(b=1, sq=1, sk=129, hq=4, r=32, dn=16, dr=8, dv=16)
LONG_Q_NO_ROPE = MlaShape(b=1, sq=53, sk=29, hq=2, r=40, dn=24, dr=0, dv=20)
WIDE_HEADS = MlaShape(b=2, sq=29, sk=71, hq=4, r=16, dn=32, dr=16, dv=24)


def config(
    form: str | None, fwd: tuple[int, int] = (16, 32), bwd: tuple[int, int] = (32, 16)
) -> Any:
    """Blocks shorter than the test sequences: several blocks per axis, padded tails."""
    return MultiHeadLatentAttentionConfig(
        form=form,
        fwd_params=FwdParams(q_blocksize=fwd[0], kv_blocksize=fwd[1]),
        bwd_params=BwdParams(q_blocksize=bwd[0], kv_blocksize=bwd[1]),
    )


def with_gradients(fn: Any, **statics: Any) -> Any:
    @jax.jit  # one compile per case (the eager reference would compile op by op)
    def run(arrays: dict[str, Any], d_out: Any) -> Any:
        out, vjp = jax.vjp(lambda a: fn(**a, **statics), arrays)
        return out, vjp(d_out)[0]

    return run


def check(
    shape: MlaShape, cfg: Any = None, dtype: Any = jnp.float32, **kwargs: Any
) -> tuple[Any, dict[str, Any]]:
    """Compare output and all five gradients with the reference; return ours."""
    arrays = shape.inputs(dtype)
    d_out = normal(jax.random.PRNGKey(42), (shape.b, shape.sq, shape.hq, shape.dv), dtype)
    out, grads = with_gradients(ejkernel.multi_head_latent_attention, cfg=cfg, **kwargs)(
        arrays, d_out
    )
    ref_out, ref_grads = with_gradients(multi_head_latent_attention_reference, **kwargs)(
        arrays, d_out
    )
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert_close(out, ref_out, name="out")
    for name in ARRAYS:
        assert grads[name].shape == ref_grads[name].shape
        assert grads[name].dtype == ref_grads[name].dtype
        assert_close(grads[name], ref_grads[name], name=f"d{name}")
    return out, grads


@pytest.mark.parametrize(
    ("shape", "form"),
    [
        (SQUARE, "absorbed"),
        (SQUARE, "expanded"),
        (DECODE, "absorbed"),
        (WIDE_HEADS, None),
    ],
    ids=lambda x: str(x) if isinstance(x, MlaShape) else f"form-{x or 'by-rule'}",
)
def test_output_and_gradients_match_the_reference(shape: MlaShape, form: str | None) -> None:
    check(shape, config(form))


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_causal_window_soft_cap_and_scale_match_with_zero_rows_before_every_key(form: str) -> None:
    # Sq > Sk with causal: the first Sq - Sk queries sit before key 0 (and Dr = 0: no rope).
    shape = LONG_Q_NO_ROPE
    out, grads = check(
        shape,
        config(form),
        causal=True,
        sliding_window=(20, 4),
        logits_soft_cap=1.5,
        softmax_scale=0.3,
    )
    blind = shape.sq - shape.sk
    assert np.all(np.asarray(out)[:, :blind] == 0.0)
    assert np.all(np.asarray(grads["query"])[:, :blind] == 0.0)
    for grad in grads.values():
        assert np.all(np.isfinite(np.asarray(grad)))


def test_default_blocks_and_bfloat16_match_the_float32_reference() -> None:
    check(SQUARE, None, dtype=jnp.bfloat16, causal=True)


def test_jit_and_vmap_match_the_reference() -> None:
    shape = SQUARE
    batched = {n: jnp.stack([x, 0.5 * x]) for n, x in shape.inputs().items()}
    kwargs = {"causal": True, "logits_soft_cap": 4.0}

    def loss(fn: Any, **extra: Any) -> Any:
        def f(a: dict[str, Any]) -> Any:
            return jnp.sum(jnp.sin(fn(**a, **kwargs, **extra)))

        return jax.jit(jax.vmap(jax.value_and_grad(f)))

    ours = loss(ejkernel.multi_head_latent_attention, cfg=config("expanded"))(batched)
    assert_close(ours, loss(multi_head_latent_attention_reference)(batched))


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_memory_stays_linear_and_never_holds_per_head_keys(form: str) -> None:
    # Per-head keys and values of the whole sequence would be Sk · Hq · (Dn + Dv) · 4 = 512 MiB;
    # what the pass may hold is O(Sk · (R + Dr)) plus [Hq, bq, bk] tiles, a few tens of MiB.
    shape = MlaShape(b=1, sq=128, sk=65536, hq=16, r=32, dn=64, dr=16, dv=64)
    abstract = {n: jax.ShapeDtypeStruct(x.shape, x.dtype) for n, x in shape.inputs().items()}
    cfg = config(form, (128, 512), (128, 512))

    def loss(a: dict[str, Any]) -> Any:
        return jnp.sum(ejkernel.multi_head_latent_attention(**a, causal=True, cfg=cfg))

    memory = jax.jit(jax.grad(loss)).lower(abstract).compile().memory_analysis()
    if memory is None:
        pytest.skip("this backend reports no memory analysis")
    per_head_kv = shape.sk * shape.hq * (shape.dn + shape.dv) * 4
    assert memory.temp_size_in_bytes < per_head_kv / 4


def test_form_rule_picks_absorbed_for_decode_and_expanded_for_prefill() -> None:
    deepseek = {"hq": 128, "r": 512, "dn": 128, "dr": 64, "dv": 128}
    assert mla_form(1, 4096, **deepseek) == "absorbed"
    assert mla_form(64, 4096, **deepseek) == "absorbed"
    assert mla_form(4096, 4096, **deepseek) == "expanded"
    assert mla_form(1024, 1024, **deepseek) == "expanded"


class _Invocation:
    def __init__(self, shape: MlaShape) -> None:
        self.kwargs = {n: jax.ShapeDtypeStruct(x.shape, x.dtype) for n, x in shape.inputs().items()}
        self.metadata = {"grad": True}


def test_heuristic_and_config_space_offer_both_forms_within_the_sequence() -> None:
    inv = _Invocation(DECODE)
    space = config_space(inv)
    assert space[0] == heuristic(inv) and heuristic(inv).form == "absorbed"
    assert {cfg.form for cfg in space} == {"absorbed", "expanded"}
    assert len(space) == len(set(space))
    for cfg in space:
        for params in (cfg.fwd_params, cfg.bwd_params):
            assert 1 <= params.q_blocksize <= DECODE.sq and 1 <= params.kv_blocksize <= DECODE.sk
    with pytest.raises(ValueError, match="form"):
        MultiHeadLatentAttentionConfig(form="naive")


def test_eager_call_and_explain_through_the_public_function() -> None:
    arrays = DECODE.inputs()
    sel = ejkernel.explain("multi_head_latent_attention", *arrays.values(), causal=True)
    assert sel.platform == "xla" and sel.source == "heuristic"
    assert sel.config.form == "absorbed"
    assert sel.implementation.endswith("multi_head_latent_attention_xla")
    out = ejkernel.multi_head_latent_attention(*arrays.values(), causal=True)
    assert_close(out, multi_head_latent_attention_reference(*arrays.values(), causal=True))


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        ("key_value", (3, 37, 24), r"`key_value` must be \[B, Sk, R\] with B=2"),
        ("w_kc", (24, 3, 25), r"`w_kc` must be \[R, Hq, Dn\] with R=24, Hq=3"),
        ("w_vc", (24, 2, 12), r"`w_vc` must be \[R, Hq, Dv\] with R=24, Hq=3"),
        ("k_rope", (2, 37, 7), r"`k_rope` must be \[B, Sk, Dr\]=\(2, 37, 8\)"),
        ("query", (2, 37, 3), r"`query` must be \[B, Sq, Hq, Dn \+ Dr\]"),
    ],
    ids=["latent-batch", "w_kc-dn", "w_vc-heads", "rope-dim", "query-ndim"],
)
def test_bad_shapes_raise_clear_errors(name: str, shape: tuple[int, ...], message: str) -> None:
    arrays = {**SQUARE.inputs(), name: jnp.ones(shape)}
    with pytest.raises(ValueError, match=r"^multi_head_latent_attention: " + message):
        ejkernel.multi_head_latent_attention(**arrays)


def test_mixed_dtypes_and_bad_statics_raise_clear_errors() -> None:
    arrays = SQUARE.inputs()
    with pytest.raises(
        TypeError, match=r"^multi_head_latent_attention: every array must share one dtype"
    ):
        ejkernel.multi_head_latent_attention(
            **{**arrays, "w_vc": arrays["w_vc"].astype(jnp.bfloat16)}
        )
    with pytest.raises(
        ValueError, match=r"^multi_head_latent_attention: `logits_soft_cap` must be > 0"
    ):
        ejkernel.multi_head_latent_attention(**arrays, logits_soft_cap=-1.0)
    with pytest.raises(TypeError, match=r"^multi_head_latent_attention: `sliding_window` must be"):
        ejkernel.multi_head_latent_attention(**arrays, sliding_window=(1, 2, 3))
