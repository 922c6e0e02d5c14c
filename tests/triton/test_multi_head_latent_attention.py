"""The Triton multi-head latent attention against the reference, in both forms.

Through Triton's interpreter on the CPU (``interpret``): the absorbed kernel over the latent
(decode, short and long queries, no rotary part, several row and key blocks, masks, soft cap,
non-finite latents, rows that see no key) and the expanded form on Triton flash attention;
output and the gradients of all five arrays against ``jax.vjp`` of
:func:`multi_head_latent_attention_reference`. Marked ``gpu``: DeepSeek's sizes in bfloat16
against the XLA platform in float32.
"""

from __future__ import annotations

import types
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import pytest
from tests.xla.test_multi_head_latent_attention import (
    DECODE,
    LONG_Q_NO_ROPE,
    SQUARE,
    MlaShape,
    with_gradients,
)

import ejkernel
from ejkernel.specs.multi_head_latent_attention import multi_head_latent_attention_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal

pytest.importorskip("triton")

from ejkernel_triton.ops.multi_head_latent_attention import (
    MultiHeadLatentAttentionConfig,
    config_space,
    heuristic,
    mla_form,
    splits_for,
    supports,
)

ABSORBED = MultiHeadLatentAttentionConfig(form="absorbed", block_m=16, block_n=16)
EXPANDED = MultiHeadLatentAttentionConfig(form="expanded")
#: an odd latent width and a 9-wide rotary part (padded blocks on both)
ODD = MlaShape(b=2, sq=5, sk=45, hq=7, r=40, dn=16, dr=9, dv=24)


def check(shape: MlaShape, cfg: Any, dtype: Any = jnp.float32, grads: bool = True, **kw: Any):
    arrays = shape.inputs(dtype)
    ours = lambda **a: ejkernel.multi_head_latent_attention(**a, platform="triton", cfg=cfg)
    if not grads:
        out = ours(**arrays, **kw)
        want = multi_head_latent_attention_reference(**arrays, **kw)
        assert out.dtype == dtype
        assert_close(out, want, name="out")
        return out
    d_out = normal(jax.random.PRNGKey(42), (shape.b, shape.sq, shape.hq, shape.dv), dtype)
    out, got = with_gradients(ours, **kw)(arrays, d_out)
    want, exp = with_gradients(multi_head_latent_attention_reference, **kw)(arrays, d_out)
    assert out.dtype == dtype
    assert_close(out, want, name="out")
    for n in arrays:
        assert_close(got[n], exp[n], name=f"d{n}")
    return out


@pytest.mark.parametrize(
    ("shape", "kw"),
    [
        (DECODE, {}),
        (ODD, {"causal": True}),
        (SQUARE, {"causal": True, "logits_soft_cap": 4.0}),
        (LONG_Q_NO_ROPE, {"causal": True, "sliding_window": (9, 0)}),
        (ODD, {"sliding_window": 13, "softmax_scale": 0.3}),
    ],
    ids=["decode", "odd-causal", "square-softcap", "no-rope-window", "odd-window-scale"],
)
def test_absorbed_kernel_matches_the_reference(interpret, shape, kw) -> None:
    check(shape, ABSORBED, grads=False, **kw)


@pytest.mark.parametrize(
    ("shape", "cfg", "kw"),
    [
        (DECODE, ABSORBED, {"causal": True}),
        (ODD, EXPANDED, {"causal": True, "logits_soft_cap": 4.0}),
        (LONG_Q_NO_ROPE, EXPANDED, {"sliding_window": (9, 3)}),
    ],
    ids=["absorbed-decode", "expanded-odd-softcap", "expanded-no-rope-window"],
)
def test_gradients_of_every_array_match_the_reference(interpret, shape, cfg, kw) -> None:
    check(shape, cfg, **kw)


@pytest.mark.parametrize(
    ("shape", "kw"),
    [(DECODE, {}), (ODD, {"causal": True, "sliding_window": (20, 0)})],
    ids=["decode", "odd-causal-window"],
)
def test_keys_split_over_programs_merge_to_the_reference(interpret, shape, kw) -> None:
    """Three splits of the keys per block of rows (some of them empty under the window),
    merged by their log-sum-exp."""
    check(shape, attrs.evolve(ABSORBED, num_splits=3), grads=False, **kw)


def test_the_split_rule_fills_the_gpu_and_keeps_splits_long(monkeypatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    cfg = MultiHeadLatentAttentionConfig(form="absorbed")  # 16 rows, 32 keys a block
    assert splits_for(rows=128, batch=64, sk=8192, cfg=cfg) == 1  # 512 programs already
    assert splits_for(rows=128, batch=1, sk=131072, cfg=cfg) == 33  # 8 programs -> 264
    assert splits_for(rows=16, batch=1, sk=256, cfg=cfg) == 2  # 8 key blocks, 4 a split
    assert splits_for(rows=16, batch=1, sk=64, cfg=cfg) == 1
    assert splits_for(1, 1, 64, attrs.evolve(cfg, num_splits=5)) == 5


def test_rows_that_see_no_key_are_zero(interpret) -> None:
    # Sq > Sk, causal bottom-right: the first Sq - Sk queries see no key
    shape = MlaShape(b=1, sq=21, sk=13, hq=2, r=32, dn=16, dr=8, dv=16)
    out = check(shape, ABSORBED, grads=False, causal=True)
    assert not jnp.any(out[:, :8])


# the absorbed kernel's first walk multiplies the planted NaN/Inf (NumPy warns in the
# interpreter); the block then walks again with the latent cleaned
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_non_finite_latents_read_as_zero(interpret) -> None:
    arrays = ODD.inputs()
    arrays["key_value"] = arrays["key_value"].at[1, 7, 3].set(jnp.nan).at[0, 30].set(jnp.inf)
    arrays["k_rope"] = arrays["k_rope"].at[1, 12, 2].set(-jnp.inf)
    for cfg in (ABSORBED, EXPANDED):
        out = ejkernel.multi_head_latent_attention(
            **arrays, causal=True, platform="triton", cfg=cfg
        )
        want = multi_head_latent_attention_reference(**arrays, causal=True)
        assert bool(jnp.isfinite(out).all())
        assert_close(out, want, name=cfg.form)


def test_half_precision_within_a_half_precision_tolerance(interpret) -> None:
    arrays = ODD.inputs(jnp.bfloat16)
    want = multi_head_latent_attention_reference(
        **jax.tree.map(lambda x: x.astype(jnp.float32), arrays), causal=True
    )
    for cfg in (ABSORBED, EXPANDED):
        out = ejkernel.multi_head_latent_attention(
            **arrays, causal=True, platform="triton", cfg=cfg
        )
        assert out.dtype == jnp.bfloat16
        assert_close(out, want, dtype=jnp.bfloat16, scale=2.0, name=cfg.form)


def _inv(shape: MlaShape, dtype: Any = jnp.bfloat16) -> Any:
    arrays = jax.eval_shape(lambda: shape.inputs(dtype))
    return types.SimpleNamespace(kwargs=arrays)


def test_the_form_follows_the_multiply_adds_and_what_each_form_holds(monkeypatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    decode = MlaShape(b=64, sq=1, sk=8192, hq=128, r=512, dn=128, dr=64, dv=128)
    train = MlaShape(b=2, sq=4096, sk=4096, hq=16, r=512, dn=128, dr=64, dv=128)
    assert mla_form(1, 8192, 128, 512, 128, 64, 128) == "absorbed"
    assert heuristic(_inv(decode)).form == "absorbed"
    assert heuristic(_inv(train)).form == "expanded"
    wide = MlaShape(b=1, sq=4096, sk=4096, hq=4, r=256, dn=256, dr=64, dv=128)
    assert heuristic(_inv(wide)).form == "absorbed"  # Dn + Dr 320: flash attention cannot
    huge = MlaShape(b=1, sq=1, sk=64, hq=4, r=1024, dn=128, dr=64, dv=128)
    assert heuristic(_inv(huge)).form == "expanded"  # R 1024: the absorbed kernel cannot
    neither = MlaShape(b=1, sq=1, sk=64, hq=4, r=1024, dn=256, dr=64, dv=128)
    assert "R ≤ 512" in supports(_inv(neither))
    f64 = {n: jax.ShapeDtypeStruct(x.shape, jnp.float64) for n, x in _inv(decode).kwargs.items()}
    assert "float64" in supports(types.SimpleNamespace(kwargs=f64))
    space = config_space(_inv(decode))
    assert space[0] == heuristic(_inv(decode)) and len(space) == len(set(space)) > 2
    with pytest.raises(ValueError, match="block_m"):
        MultiHeadLatentAttentionConfig(block_m=24)
    with pytest.raises(ValueError, match="form"):
        MultiHeadLatentAttentionConfig(form="fused")


@pytest.mark.parametrize("limit", [232448, 101376], ids=["hopper", "sm86"])
def test_absorbed_blocks_follow_the_rows_and_the_shared_memory(monkeypatch, limit) -> None:
    """Decode at DeepSeek's sizes takes 64 heads a program where they fit; a smaller shared
    memory, fewer rows or float32 take smaller blocks; no config of the space is over it."""
    from ejkernel_triton.ops import multi_head_latent_attention as mla

    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    monkeypatch.setattr(mla._smem, "launch_limit", lambda: limit)
    decode = MlaShape(b=64, sq=1, sk=8192, hq=128, r=512, dn=128, dr=64, dv=128)
    few = MlaShape(b=64, sq=1, sk=8192, hq=16, r=512, dn=128, dr=64, dv=128)
    for dtype in (jnp.bfloat16, jnp.float32):
        for shape in (decode, few):
            inv = _inv(shape, dtype)
            itemsize = jnp.dtype(dtype).itemsize
            for cfg in (c for c in config_space(inv) if c.form != "expanded"):
                assert mla.absorbed_shared_memory(cfg, 512, 64, itemsize) <= limit, cfg
    cfg = heuristic(_inv(decode))
    if limit == 232448:
        assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (64, 64, 8)
    else:
        assert cfg.block_m * cfg.block_n < 64 * 64
    assert heuristic(_inv(few)).block_m == 16


def test_a_form_that_cannot_serve_the_call_raises(interpret) -> None:
    arrays = MlaShape(b=1, sq=1, sk=20, hq=2, r=16, dn=256, dr=16, dv=16).inputs()
    with pytest.raises(ValueError, match="expanded form needs Dn \\+ Dr"):
        ejkernel.multi_head_latent_attention(**arrays, platform="triton", cfg=EXPANDED)


def test_registered_above_the_xla_fallback() -> None:
    from ejkernel_triton import plugin

    assert "multi_head_latent_attention" in plugin.OPS
    assert "multi_head_latent_attention" not in plugin.OPT_IN


def test_the_absorbed_kernel_compiles_for_hopper_with_matrix_instructions(
    monkeypatch, tmp_path
) -> None:
    """The decode launch at DeepSeek's sizes (R 512, Dr 64), bf16, compiled for sm_90."""
    from ejkernel_triton import _codegen
    from ejkernel_triton.ops import multi_head_latent_attention as mla

    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    shape = MlaShape(b=2, sq=1, sk=256, hq=64, r=512, dn=128, dr=64, dv=128)
    call = {**shape.inputs(jnp.bfloat16), "causal": True}
    cfg = heuristic(_inv(shape))
    with _codegen.recorded_launches() as record:
        mla.multi_head_latent_attention_triton(cfg=cfg, **call)
    (launch,) = record
    compiled = _codegen.compile_launch(launch, capability=90)
    mix = _codegen.instruction_mix(compiled.ptx)
    assert any(k.startswith("wgmma") for k in mix)  # 64 heads a program
    assert compiled.shared <= mla.absorbed_shared_memory(cfg, 512, 64, 2) <= 232448


# -- GPU, DeepSeek's sizes ------------------------------------------------------------------


def _rel(a: Any, b: Any) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "form"),
    [
        (MlaShape(b=8, sq=1, sk=4097, hq=128, r=512, dn=128, dr=64, dv=128), "absorbed"),
        (MlaShape(b=1, sq=1024, sk=1024, hq=16, r=512, dn=128, dr=64, dv=128), "expanded"),
    ],
    ids=["decode", "prefill"],
)
def test_gpu_bf16_matches_the_xla_path_with_gradients(shape, form) -> None:
    arrays = shape.inputs(jnp.bfloat16)
    d_out = normal(jax.random.PRNGKey(1), (shape.b, shape.sq, shape.hq, shape.dv), jnp.bfloat16)
    cfg = MultiHeadLatentAttentionConfig(form=form)
    ours = lambda **a: ejkernel.multi_head_latent_attention(**a, platform="triton", cfg=cfg)
    xla = lambda **a: ejkernel.multi_head_latent_attention(**a, platform="xla")
    out, got = with_gradients(ours, causal=True)(arrays, d_out)
    up = jax.tree.map(lambda x: x.astype(jnp.float32), (arrays, d_out))
    with jax.default_matmul_precision("highest"):
        want, exp = with_gradients(xla, causal=True)(*up)
    assert _rel(out, want) < 2e-2
    for n in arrays:
        assert bool(jnp.isfinite(got[n].astype(jnp.float32)).all()), n
        assert _rel(got[n], exp[n]) < 2e-2, (n, _rel(got[n], exp[n]))
