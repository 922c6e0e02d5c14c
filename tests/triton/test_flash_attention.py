"""The Triton flash attention against the reference, one body per test in every mode.

``mode`` is ``interpret`` (Triton's interpreter on the CPU, in CI: small, odd shapes, float32
unless said) or ``gpu`` (compiled by Triton and launched by jax-triton, marked ``gpu``:
realistic shapes in bfloat16, against the float32 reference at the highest matmul precision).
Each case names its shape in both modes ``[B, Sq, Sk, Hq, Hkv, D(, Dv)]``. The checks of what
a GPU would launch, compiled for sm_90 on any machine, are in ``test_codegen.py``.
"""

from __future__ import annotations

import types
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.triton._flash_variants import variant_kernels

import ejkernel
from ejkernel.ops import BwdParams, FwdParams
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal

pytest.importorskip("triton")

from ejkernel_triton.ops.flash_attention import (
    BWD_VARIANTS,
    FWD_VARIANTS,
    FlashAttentionConfig,
)

#: 16-row blocks: several blocks per axis at the interpreter's lengths, with cut tails.
SMALL = FlashAttentionConfig(
    fwd_params=FwdParams(q_blocksize=16, kv_blocksize=16, num_warps=4, num_stages=1),
    bwd_params=BwdParams(q_blocksize=16, kv_blocksize=32, num_warps=4, num_stages=1),
)


def shape_of(mode: str, interpret: tuple[int, ...], gpu: tuple[int, ...]) -> tuple[int, ...]:
    return interpret if mode == "interpret" else gpu


def qkv(
    b: int,
    sq: int,
    sk: int,
    hq: int,
    hkv: int,
    d: int,
    dv: int | None = None,
    dtype: Any = jnp.float32,
) -> tuple[jax.Array, ...]:
    ks = jax.random.split(jax.random.PRNGKey(sq * 7 + sk + d), 3)
    return (
        normal(ks[0], (b, sq, hq, d), dtype),
        normal(ks[1], (b, sk, hkv, d), dtype),
        normal(ks[2], (b, sk, hkv, dv or d), dtype),
    )


def inputs(mode: str, shape: tuple[int, ...], dtype: Any = None) -> tuple[jax.Array, ...]:
    """q, k, v of ``shape``: float32 in the interpreter, bfloat16 on the GPU, unless given."""
    return qkv(*shape, dtype=dtype or (jnp.float32 if mode == "interpret" else jnp.bfloat16))


def reference_inputs(mode: str, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """The reference's inputs: as given in the interpreter, float32 on the GPU."""
    return xs if mode == "interpret" else tuple(x.astype(jnp.float32) for x in xs)


def rel(a: Any, b: Any) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


#: ``compare``'s default config: ``SMALL`` in the interpreter, the heuristic's on the GPU.
BY_MODE = object()


def compare(
    mode: str, q: Any, k: Any, v: Any, cfg: Any = BY_MODE, grads: bool = True, **kwargs: Any
) -> Any:
    """Output (and gradients of every array input) of the Triton op vs the reference: in the
    interpreter with the per-dtype tolerance on the same inputs; on the GPU jitted, by norm
    against the float32 reference at the highest precision."""
    if cfg is BY_MODE:
        cfg = SMALL if mode == "interpret" else None
    arrays = {n: x for n, x in kwargs.items() if isinstance(x, jax.Array)}
    statics = {n: x for n, x in kwargs.items() if n not in arrays}
    diff = {n: x for n, x in arrays.items() if jnp.issubdtype(x.dtype, jnp.floating)}
    rest = {n: x for n, x in arrays.items() if n not in diff}

    def ours(q, k, v, diff):
        return ejkernel.flash_attention(
            q, k, v, **diff, **rest, **statics, platform="triton", cfg=cfg
        )

    def ref(q, k, v, diff):
        return flash_attention_reference(q, k, v, **diff, **rest, **statics)

    d_out = normal(jax.random.PRNGKey(3), (*q.shape[:-1], v.shape[-1]), q.dtype)

    def run(fn: Any, *args: Any) -> Any:
        out, vjp = jax.vjp(fn, *args)
        return out, (vjp(d_out.astype(out.dtype)) if grads else None)

    if mode == "interpret":
        out, got = run(ours, q, k, v, diff)
        want, exp = run(ref, q, k, v, diff)
    else:
        out, got = jax.jit(lambda *a: run(ours, *a))(q, k, v, diff)
        up = jax.tree.map(lambda x: x.astype(jnp.float32), (q, k, v, diff))
        with jax.default_matmul_precision("highest"):
            want, exp = jax.jit(lambda *a: run(ref, *a))(*up)
    assert out.dtype == q.dtype and out.shape == want.shape
    tol = 1e-4 if q.dtype == jnp.float32 else 2e-2

    def close(a: Any, b: Any, name: str) -> None:
        if mode == "interpret":
            assert_close(a, b, name=name)
        else:
            assert not jnp.isnan(jnp.asarray(a, jnp.float32)).any(), name
            assert rel(a, b) < tol, (name, rel(a, b))

    close(out, want, "out")
    if grads:
        for name, g, e in zip(("dq", "dk", "dv", "d"), got, exp, strict=True):
            for leaf_g, leaf_e in zip(jax.tree.leaves(g), jax.tree.leaves(e), strict=True):
                assert leaf_g.shape == leaf_e.shape
                assert mode == "gpu" or leaf_g.dtype == leaf_e.dtype
                close(leaf_g, leaf_e, name)
    return out


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kernels launched, in order (the launches still run; JAX's caches are
    cleared first, so that a call traced by an earlier test is traced again)."""
    from ejkernel_triton import _launch

    jax.clear_caches()
    names: list[str] = []
    real = _launch.launch

    def spy(kernel: Any, *args: Any, **kwargs: Any) -> Any:
        names.append(kernel.fn.__name__)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(_launch, "launch", spy)
    return names


# -- features, in every mode ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("interpret", "gpu"),
    [
        ((2, 37, 37, 4, 4, 80), (2, 1024, 1024, 8, 2, 128)),
        ((1, 37, 45, 4, 2, 32), (2, 1000, 1500, 8, 8, 64)),
        ((1, 45, 37, 3, 1, 80, 48), (1, 1500, 1000, 8, 1, 80)),
    ],
    ids=["square-d80", "gqa-sq<sk-d32", "mqa-sq>sk-dv48"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_output_and_gradients_match_the_reference(
    mode: str, interpret: tuple, gpu: tuple, causal: bool
) -> None:
    compare(mode, *inputs(mode, shape_of(mode, interpret, gpu)), causal=causal)


def test_sliding_window_and_soft_cap(mode: str) -> None:
    q, k, v = inputs(mode, shape_of(mode, (1, 37, 45, 4, 2, 32), (2, 777, 900, 4, 2, 96)))
    compare(mode, q, k, v, sliding_window=(9, 4), logits_soft_cap=2.5)
    compare(mode, q, k, v, sliding_window=(5, 0), causal=True)


@pytest.mark.parametrize(("scale", "spread"), [(0.3, 1.0), (-0.2, 30.0)], ids=["pos", "neg"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softmax_scale_of_either_sign_on_whole_and_cut_blocks(
    mode: str, scale: float, spread: float, causal: bool
) -> None:
    # 16-key blocks over 45 keys: whole blocks, where a scale >= 0 rides in the exponent, and
    # a cut one. Negative: logits spread over hundreds, so that a row maximum taken from the
    # wrong end (the raw scores' maximum) would overflow exp2.
    q, k, v = inputs(mode, shape_of(mode, (1, 37, 45, 2, 2, 32), (1, 300, 300, 4, 2, 128)))
    compare(mode, q * spread, k, v, causal=causal, softmax_scale=scale)


@pytest.mark.parametrize("bias_kind", ["full", "per-batch-row", "2d"])
def test_bias_and_its_gradient_in_the_bias_shape(mode: str, bias_kind: str) -> None:
    b, sq, sk, hq, hkv, d = shape_of(mode, (2, 37, 45, 4, 2, 32), (1, 512, 512, 4, 4, 128))
    q, k, v = inputs(mode, (b, sq, sk, hq, hkv, d))
    bias_shape = {"full": (1, hq, sq, sk), "per-batch-row": (b, 1, 1, sk), "2d": (sq, sk)}
    bias = normal(jax.random.PRNGKey(5), bias_shape[bias_kind], q.dtype)
    compare(mode, q, k, v, bias=bias, causal=True)


def test_attention_mask_and_segment_ids(mode: str) -> None:
    b, s, _, hq, hkv, d = shape_of(mode, (2, 37, 37, 4, 2, 32), (2, 777, 777, 4, 2, 96))
    q, k, v = inputs(mode, (b, s, s, hq, hkv, d))
    mask = jax.random.bernoulli(jax.random.PRNGKey(6), 0.7, (b, 1, s, s))
    seg = np.zeros((b, s), np.int32)
    seg[:, s // 2 :] = 1
    seg[1, s - s // 4 :] = -1  # padding: rows without keys
    seg = jnp.asarray(seg)
    out = compare(mode, q, k, v, attention_mask=mask, q_segment_ids=seg, kv_segment_ids=seg)
    assert float(jnp.abs(out[1, s - s // 4 :].astype(jnp.float32)).max()) == 0.0


@pytest.mark.parametrize("per_head", [1, 3], ids=["per-head", "three-per-head"])
def test_sinks_and_their_gradient(mode: str, per_head: int) -> None:
    q, k, v = inputs(mode, shape_of(mode, (1, 37, 45, 4, 2, 32), (1, 512, 512, 4, 4, 128)))
    shape = (4,) if per_head == 1 else (4, per_head)
    compare(mode, q, k, v, softmax_aux=normal(jax.random.PRNGKey(7), shape), causal=True)


def test_rows_that_see_no_key_are_zero_with_zero_gradients(mode: str) -> None:
    # causal, Sq > Sk: the first Sq - Sk rows see nothing
    b, sq, sk, *rest = shape_of(mode, (1, 45, 20, 2, 2, 32), (1, 1500, 1000, 4, 4, 64))
    out = compare(mode, *inputs(mode, (b, sq, sk, *rest)), causal=True)
    assert float(jnp.abs(out[:, : sq - sk].astype(jnp.float32)).max()) == 0.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_each_dtype(mode: str, dtype: Any) -> None:
    # float32 takes IEEE dots (DOT_PRECISION), bfloat16 the tensor cores
    shape = shape_of(mode, (1, 37, 45, 4, 2, 80), (1, 257, 257, 4, 2, 64))
    compare(mode, *inputs(mode, shape, dtype), causal=True)


def test_soft_cap_of_large_logits_stays_finite(mode: str) -> None:
    # scale·q·kᵀ / cap reaches about ±100: a tanh through exp2(-2x) overflows to inf / inf
    q, k, v = inputs(mode, shape_of(mode, (1, 37, 45, 2, 1, 32), (1, 777, 777, 4, 1, 128)))
    compare(mode, q * 60.0, k, v, causal=True, logits_soft_cap=1.0)


def test_default_config_and_scaled_dot_product_attention(mode: str) -> None:
    q, k, v = inputs(mode, shape_of(mode, (1, 37, 37, 2, 2, 32), (1, 300, 300, 4, 2, 128)))
    compare(mode, q, k, v, cfg=None, grads=False, causal=True)
    out = ejkernel.scaled_dot_product_attention(q, k, v, causal=True, platform="triton")
    with jax.default_matmul_precision("highest"):
        want = flash_attention_reference(*reference_inputs(mode, q, k, v), causal=True)
    if mode == "interpret":
        assert_close(out, want, name="sdpa")
    else:
        assert rel(out, want) < 2e-2


def test_jit_and_vmap_compose_with_the_kernels(mode: str) -> None:
    q, k, v = inputs(mode, shape_of(mode, (2, 37, 45, 2, 1, 32), (3, 256, 256, 4, 2, 64)))
    cfg = SMALL if mode == "interpret" else None
    tol = 2e-2 if mode == "gpu" else None

    def f(q, k, v):
        return ejkernel.flash_attention(q, k, v, causal=True, platform="triton", cfg=cfg)

    def r(q, k, v):
        with jax.default_matmul_precision("highest"):
            return flash_attention_reference(*reference_inputs(mode, q, k, v), causal=True)

    def close(a: Any, b: Any, name: str) -> None:
        if tol is None:
            assert_close(a, b, name=name)
        else:
            assert rel(a, b) < tol, (name, rel(a, b))

    add = lambda x: x[:, None]  # vmapped over the batch axis
    got = jax.jit(jax.vmap(f))(add(q), add(k), add(v))
    close(got, jax.vmap(r)(add(q), add(k), add(v)), "vmap out")
    # vmap of grad, with k/v shared (unbatched) across the mapped axis
    loss = lambda fn: lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v).astype(jnp.float32)))
    g = jax.vmap(jax.grad(loss(f), argnums=(0, 1, 2)), in_axes=(0, None, None))(
        add(q), k[:1], v[:1]
    )
    e = jax.vmap(jax.grad(loss(r), argnums=(0, 1, 2)), in_axes=(0, None, None))(
        add(q), k[:1], v[:1]
    )
    for name, a, b in zip(("dq", "dk", "dv"), g, e, strict=True):
        close(a, b, f"vmap {name}")


# -- the variants, in every mode ------------------------------------------------------------


def variant_config(mode: str, fwd: str, bwd: str, call: dict[str, Any]) -> FlashAttentionConfig:
    """A config forcing ``fwd``/``bwd``: in the interpreter small blocks (the specialized
    kernels' loops then cross several blocks), on the GPU the heuristic's with the variants'
    tiles from the config space."""
    from ejkernel_triton.ops import flash_attention as fa

    if mode == "interpret":
        small = {"q_blocksize": 32, "kv_blocksize": 16}
        return attrs.evolve(
            SMALL,
            fwd_variant=fwd,
            bwd_variant=bwd,
            fwd_params=FwdParams(**small) if fwd != "usual" else SMALL.fwd_params,
            dq_params=FwdParams(**small) if bwd == "warp_specialized" else None,
        )
    space = fa.config_space(types.SimpleNamespace(kwargs=call))
    pick = {}
    for cfg in space:
        pick.setdefault(("fwd", cfg.fwd_variant), cfg)
        pick.setdefault(("bwd", cfg.bwd_variant), cfg)
    f, b = pick[("fwd", fwd)], pick[("bwd", bwd)]
    return attrs.evolve(
        f,
        bwd_variant=b.bwd_variant,
        bwd_params=b.bwd_params,
        dq_params=b.dq_params,
        bwd_head_group=b.bwd_head_group,
    )


#: [B, Sq, Sk, Hq, Hkv, D] in the interpreter, on the GPU, and the call's options.
VARIANT_SHAPES = {
    "gqa-causal": ((2, 37, 37, 4, 2, 64), (2, 1024, 1024, 8, 2, 128), {"causal": True}),
    "mqa-sq<sk-d128-softcap": (
        (1, 50, 70, 2, 1, 128),
        (1, 777, 777, 4, 1, 128),
        {"causal": True, "logits_soft_cap": 5.0},
    ),
    "sq>sk-empty-rows": ((1, 45, 20, 2, 2, 64), (1, 1500, 1000, 4, 4, 64), {"causal": True}),
    "cut-keys": ((2, 40, 37, 2, 2, 64), (2, 1000, 1500, 8, 8, 128), {"softmax_scale": 0.3}),
    "gqa-softcap": ((1, 37, 50, 4, 2, 64), (2, 2500, 3000, 4, 2, 64), {"logits_soft_cap": 3.0}),
}
#: Each specialized pair over every shape; the mixed pairs over one, on the GPU only (the
#: interpreter runs the same kernels in the specialized pair and the usual tests), as the Gluon
#: variants, which the interpreter cannot run (``test_codegen.py`` compiles them on the CPU).
VARIANT_CASES = [
    pytest.param(
        fwd,
        bwd,
        *VARIANT_SHAPES[name],
        id=f"{fwd}-{bwd}-{name}",
        marks=[] if (fwd, bwd) == ("warp_specialized", "warp_specialized") else [pytest.mark.gpu],
    )
    for fwd, bwd, names in [
        ("warp_specialized", "warp_specialized", VARIANT_SHAPES),
        ("pingpong", "gluon", ["gqa-causal", "mqa-sq<sk-d128-softcap", "cut-keys"]),
        ("usual", "warp_specialized", ["gqa-causal"]),
        ("warp_specialized", "usual", ["gqa-causal"]),
        ("usual", "gluon_dkdv", ["gqa-causal", "sq>sk-empty-rows"]),
        ("pingpong", "usual", ["cut-keys"]),
    ]
    for name in names
]


@pytest.mark.parametrize(("fwd", "bwd", "interpret", "gpu", "kwargs"), VARIANT_CASES)
def test_each_variant_runs_as_configured_and_matches_the_reference(
    mode: str, launched: list[str], fwd: str, bwd: str, interpret: tuple, gpu: tuple, kwargs: dict
) -> None:
    shape = shape_of(mode, interpret, gpu)
    q, k, v = inputs(mode, shape, jnp.bfloat16)
    cfg = variant_config(mode, fwd, bwd, {"query": q, "key": k, "value": v, **kwargs})
    out = compare(mode, q, k, v, cfg=cfg, **kwargs)
    assert launched == variant_kernels(fwd, bwd)
    if kwargs.get("causal") and shape[1] > shape[2]:
        empty = shape[1] - shape[2]
        assert float(jnp.abs(out[:, :empty].astype(jnp.float32)).max()) == 0.0


@pytest.mark.parametrize("fwd", FWD_VARIANTS)
@pytest.mark.parametrize("bwd", BWD_VARIANTS)
def test_a_variant_that_cannot_serve_the_call_is_refused(mode: str, fwd: str, bwd: str) -> None:
    # a bias: only the usual kernels serve it; nothing is replaced silently
    q, k, v = inputs(mode, shape_of(mode, (1, 37, 37, 2, 2, 64), (1, 256, 256, 2, 2, 128)))
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    bias = normal(jax.random.PRNGKey(5), (1, 2, q.shape[1], k.shape[1]), jnp.bfloat16)
    cfg = FlashAttentionConfig(fwd_variant=fwd, bwd_variant=bwd)
    if fwd == bwd == "usual":
        ejkernel.flash_attention(q, k, v, bias=bias, platform="triton", cfg=cfg)
        return
    f = lambda q: ejkernel.flash_attention(q, k, v, bias=bias, platform="triton", cfg=cfg)
    with pytest.raises(ValueError, match=r"variant cannot serve this call.*no bias"):
        jax.grad(lambda q: jnp.sum(f(q).astype(jnp.float32)))(q)


# -- hidden NaN and Inf, in every mode ----------------------------------------------------------


def segments(b: int, s: int) -> jax.Array:
    """Two segments a batch; batch 1's last quarter is padding (-1)."""
    seg = np.zeros((b, s), np.int32)
    seg[:, s // 2 :] = 1
    seg[1, s - s // 4 :] = -1
    return jnp.asarray(seg)


#: [B, Sq, Sk, Hq, Hkv, D] in the interpreter and on the GPU, the call's options, and what goes
#: where, ``(array, batch, key, kv head, value)`` (a key below 0 counts from the end): beside
#: the causal diagonal, inside a window, in another segment (a block whole by position: only
#: the segment ids hide it) and in padding, and in batch 1's first keys
#: (which the warp-specialized kernels read past batch 0's cut last key block; NaN only: the
#: rows of batch 1 see them, and the interpreter stops at an ``inf - inf``).
HIDDEN_CASES = {
    "causal": (
        (1, 37, 37, 2, 1, 64),
        (1, 777, 777, 4, 1, 128),
        {"causal": True},
        [("value", 0, -1, 0, np.nan), ("key", 0, -3, 0, np.inf)],
    ),
    "window": (
        (1, 37, 45, 4, 2, 64),
        (1, 700, 900, 4, 2, 64),
        {"sliding_window": (5, 2)},
        [("value", 0, -14, 1, np.nan), ("key", 0, -15, 0, -np.inf)],
    ),
    "segment-padding": (
        (2, 37, 37, 2, 2, 64),
        (2, 777, 777, 4, 2, 128),
        {"segments": True},
        [("value", 0, 5, 0, np.nan), ("key", 1, -2, 1, np.nan), ("value", 1, -1, 0, np.inf)],
    ),
    "cut-keys": (
        (2, 40, 37, 2, 2, 64),
        (2, 1000, 1500, 4, 4, 128),
        {},
        [("value", 1, 0, 0, np.nan), ("key", 1, 1, 1, np.nan)],
    ),
}
#: The variant pairs each case runs: those the interpreter runs, then the Gluon ones (GPU).
HIDDEN_VARIANTS = [("usual", "usual"), ("warp_specialized", "warp_specialized")]
HIDDEN_PARAMS = [
    pytest.param(fwd, bwd, name, id=f"{fwd}-{bwd}-{name}", marks=marks)
    for fwd, bwd, marks in [
        *((f, b, []) for f, b in HIDDEN_VARIANTS),
        ("pingpong", "gluon", [pytest.mark.gpu]),
    ]
    for name in HIDDEN_CASES
    if fwd == "usual" or "segments" not in HIDDEN_CASES[name][2]
    if fwd == "usual" or "sliding_window" not in HIDDEN_CASES[name][2]
]


@pytest.mark.parametrize(("fwd", "bwd", "name"), HIDDEN_PARAMS)
# the interpreter's numpy warns where the dK/dV kernel makes a NaN in the poisoned key's own row
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_hidden_nan_and_inf_in_keys_and_values_reach_no_row(
    mode: str, fwd: str, bwd: str, name: str
) -> None:
    """:mod:`ejkernel.attention_semantics`' rule: rows that see no planted entry give the same
    output and dQ as on clean inputs, and keys no such row shares (a planted key no row sees
    among them) give the same dK/dV."""
    from ejkernel.attention_semantics import Geometry, dense_visibility

    interpret, gpu, options, plants = HIDDEN_CASES[name]
    b, sq, sk, hq, hkv, d = shape_of(mode, interpret, gpu)
    q, k, v = inputs(mode, (b, sq, sk, hq, hkv, d), jnp.bfloat16 if fwd != "usual" else None)
    kw = {n: x for n, x in options.items() if n != "segments"}
    if options.get("segments"):
        kw["q_segment_ids"] = kw["kv_segment_ids"] = segments(b, sq)
    cfg = variant_config(mode, fwd, bwd, {"query": q, "key": k, "value": v, **kw})
    geometry = Geometry.of(q, k, causal=bool(kw.get("causal")), window=kw.get("sliding_window"))
    seg = (kw.get("q_segment_ids"), kw.get("kv_segment_ids"))
    vis = np.asarray(dense_visibility(geometry, None, *seg))  # [B, Hq, Sq, Sk]
    planted = np.zeros((b, sk, hkv), bool)
    bad = {"key": np.array(k, np.float32), "value": np.array(v, np.float32)}
    for array, batch, key, head, value in plants:
        planted[batch, key % sk, head] = True
        bad[array][batch, key % sk, head, key % d] = value
    k_bad, v_bad = jnp.asarray(bad["key"], k.dtype), jnp.asarray(bad["value"], v.dtype)
    group = hq // hkv
    sees = vis & np.repeat(planted, group, axis=2).transpose(0, 2, 1)[:, :, None, :]
    dirty = sees.any(-1)  # [B, Hq, Sq]
    shared = (vis & dirty[..., None]).any(2).reshape(b, hkv, group, sk).any(2)  # [B, Hkv, Sk]
    assert (~dirty).any() and vis[~dirty].any(), "a clean row that sees something"
    clean_rows = ~dirty.transpose(0, 2, 1)
    # a planted key no row sees has the gradients of a clean one (zeros)
    unseen = ~vis.reshape(b, hkv, group, sq, sk).any(axis=(2, 3)).transpose(0, 2, 1)
    clean_keys = (~planted & ~shared.transpose(0, 2, 1)) | (planted & unseen)

    def run(k: Any, v: Any) -> Any:
        f = lambda q, k, v: ejkernel.flash_attention(q, k, v, **kw, platform="triton", cfg=cfg)
        out, vjp = jax.vjp(f, q, k, v)
        return out, *vjp(normal(jax.random.PRNGKey(3), out.shape, out.dtype))

    if mode == "gpu":
        run = jax.jit(run)
    got, want = run(k_bad, v_bad), run(k, v)
    for what, x, x_w, where in zip(
        ("out", "dq", "dk", "dv"), got, want, (clean_rows, clean_rows, clean_keys, clean_keys)
    ):
        x, x_w = np.asarray(x, np.float32)[where], np.asarray(x_w, np.float32)[where]
        assert np.isfinite(x).all(), f"{what}: non-finite where nothing planted is seen"
        tol = 2e-2 if mode == "gpu" else 1e-6  # the Gluon dQ's sum has no fixed order
        np.testing.assert_allclose(x, x_w, rtol=tol, atol=tol, err_msg=what)


# -- GPU only ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_s16384_forward_and_backward_fit_in_memory() -> None:
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 16384, 16, 128), jnp.bfloat16)

    def loss(q: Any) -> Any:
        out = ejkernel.flash_attention(q, q, q, causal=True, platform="triton")
        return jnp.sum(out.astype(jnp.float32))

    g = jax.jit(jax.grad(loss))(q)
    assert g.shape == q.shape and bool(jnp.isfinite(g.astype(jnp.float32)).all())


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "kwargs"),
    [
        ((1, 37, 37, 2, 1, 128), {}),
        ((3, 700, 700, 4, 2, 128), {"causal": True}),
        ((1, 4096, 4096, 4, 4, 128), {"causal": True}),
        ((1, 300, 300, 4, 2, 128), {"causal": True, "softmax_scale": -0.05}),
        ((2, 300, 200, 4, 2, 128), {"causal": True}),
    ],
    ids=[
        "seq37",
        "causal-12-heads",  # the forward's head groups of 8: one whole, one of 4
        "long-causal",  # dQ of a row: the sum of up to 32 programs' TMA reduce-adds
        "negative-scale",  # the Gluon forward masks unscaled scores: Triton's takes it
        "sq>sk-empty-rows-gqa",
    ],
)
def test_the_heuristics_hopper_kernels(
    launched: list[str], shape: tuple[int, ...], kwargs: dict[str, Any]
) -> None:
    q, k, v = qkv(*shape, dtype=jnp.bfloat16)
    compare("gpu", q, k, v, **kwargs)
    forward = "pingpong" if kwargs.get("softmax_scale", 1.0) > 0 else "warp_specialized"
    assert launched == variant_kernels(forward, "gluon")


# -- the config and its choice (CPU) ----------------------------------------------------------


@pytest.fixture
def interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The heuristic's view of an H100 (sm_90), on the CPU."""
    from ejkernel_triton.ops import flash_attention_config as config

    monkeypatch.setattr(config._launch, "interpreting", lambda: False)
    monkeypatch.setattr(config, "_compute_capability", lambda: (9, 0))
    monkeypatch.setattr(config, "_device_kind", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", "232448")  # the H100's
    return config


def invocation(d: int = 128, causal: bool = True, dtype: Any = jnp.bfloat16, **extra: Any) -> Any:
    x = jax.ShapeDtypeStruct((8, 2048, 16, d), dtype)
    return types.SimpleNamespace(
        kwargs={"query": x, "key": x, "value": x, "causal": causal, **extra}
    )


def test_the_scale_rides_in_the_exponent_only_where_nothing_is_masked_or_added(
    interpreting: None,
) -> None:
    from ejkernel_triton import _codegen

    def plain_scale(cfg: Any = None, **kwargs: Any) -> bool:
        (fwd, *_) = _codegen.flash_attention_launches(
            (1, 64, 2, 64), causal=False, cfg=cfg, **kwargs
        )
        return fwd.constexprs["PLAIN_SCALE"]

    assert plain_scale()
    assert not plain_scale(FlashAttentionConfig(scale_in_exponent=False))
    assert not plain_scale(softmax_scale=-0.5)
    assert not plain_scale(logits_soft_cap=3.0)
    assert not plain_scale(bias=jnp.ones((1, 2, 64, 64)))
    assert not plain_scale(attention_mask=jnp.ones((1, 1, 64, 64), bool))
    seg = jnp.zeros((1, 64), jnp.int32)
    assert not plain_scale(q_segment_ids=seg, kv_segment_ids=seg)


def test_causal_forward_walks_heads_in_groups_longest_blocks_first(interpreting: None) -> None:
    # 3 x 7 = 21 (batch, head) pairs: a group of 16 and a cut group of 5
    from ejkernel_triton import _codegen
    from ejkernel_triton.ops import flash_attention as fa

    q, k, v = qkv(3, 37, 45, 7, 7, 32)
    compare("interpret", q, k, v, causal=True, grads=False)
    for group in (16, 4):
        with _codegen.recorded_launches() as rec:
            cfg = attrs.evolve(SMALL, fwd_head_group=group)
            fa._flash_attention_fwd(query=q, key=k, value=v, causal=True, cfg=cfg)
        assert rec[0].constexprs["HEAD_GROUP"] == group


def test_heuristic_by_head_dim_and_causality_from_the_table(hopper: Any) -> None:
    from ejkernel_triton.ops import flash_attention as fa

    def config(d: int, causal: bool, **extra: Any) -> Any:
        return fa.heuristic(invocation(d, causal, **extra))

    p = lambda q, k, w, s: FwdParams(q_blocksize=q, kv_blocksize=k, num_warps=w, num_stages=s)
    b = lambda q, k, w, s: BwdParams(q_blocksize=q, kv_blocksize=k, num_warps=w, num_stages=s)
    # the D 64 forward: 128 rows with 8 warps where unmasked and not causal, else 64 with 4
    assert config(64, False).fwd_params == p(128, 64, 8, 3)
    assert config(64, True).fwd_params == p(64, 64, 4, 3)
    assert config(64, False, logits_soft_cap=5.0).fwd_params == p(64, 64, 4, 3)
    assert config(64, False, softmax_scale=-0.1).fwd_params == p(64, 64, 4, 3)
    seg = jax.ShapeDtypeStruct((8, 2048), jnp.int32)
    assert config(64, False, q_segment_ids=seg, kv_segment_ids=seg).fwd_params == p(64, 64, 4, 3)
    assert config(32, False).fwd_params == p(64, 64, 4, 3)
    # on Hopper the plain backward is the Gluon kernel; at D 64 causal its dK/dV only
    assert (config(64, False).bwd_variant, config(64, True).bwd_variant) == ("gluon", "gluon_dkdv")
    assert config(64, True).dq_params == p(64, 64, 4, 3)
    assert config(128, True).fwd_variant == "pingpong"
    assert config(128, True, softmax_scale=-0.1).fwd_variant == "warp_specialized"
    bias = jax.ShapeDtypeStruct((8, 16, 2048, 2048), jnp.bfloat16)
    with_bias = config(128, True, bias=bias)
    assert (with_bias.fwd_variant, with_bias.bwd_variant) == ("usual", "usual")
    assert with_bias.bwd_params == b(32, 64, 4, 2)
    assert config(128, False, bias=bias).bwd_params == b(64, 64, 4, 2)
    assert config(64, True, dtype=jnp.float32).fwd_params == p(64, 32, 4, 2)


def test_config_space_offers_each_variant_that_can_serve_the_call(hopper: Any) -> None:
    from ejkernel_triton.ops import flash_attention as fa

    inv = invocation(128, True)
    space = fa.config_space(inv)
    assert space[0] == fa.heuristic(inv) and len(space) == len(set(space))
    assert {cfg.fwd_variant for cfg in space} == set(FWD_VARIANTS)
    assert {cfg.bwd_variant for cfg in space} == set(BWD_VARIANTS)
    call = fa.Call.of(inv.kwargs)
    for cfg in space:
        fa.check(cfg, call, ("fwd", "bwd"))  # every candidate can run
    # a bias: the usual kernels only, the backward's blocks varied, within shared memory
    bias = jax.ShapeDtypeStruct((8, 16, 2048, 2048), jnp.bfloat16)
    space = fa.config_space(invocation(128, True, bias=bias))
    assert {(c.fwd_variant, c.bwd_variant) for c in space} == {("usual", "usual")}
    assert len({c.bwd_params for c in space}) > 2 and len({c.fwd_params for c in space}) > 2


def test_config_space_in_the_interpreter_is_the_heuristic(interpreting: None) -> None:
    from ejkernel_triton.ops import flash_attention as fa

    inv = invocation(64, True)
    assert fa.config_space(inv) == [fa.heuristic(inv)]


def test_explain_shows_the_variant_and_the_config_round_trips(interpreting: None) -> None:
    from ejkernel.ops import from_json, to_json

    q, k, v = qkv(1, 37, 37, 2, 2, 32)
    record = ejkernel.explain("flash_attention", q, k, v, causal=True, platform="triton")
    assert record.config.fwd_variant == "usual" and record.config.bwd_variant == "usual"
    assert "fwd_variant='usual'" in repr(record.config)
    assert "bwd_variant='usual'" in str(record)
    cfg = FlashAttentionConfig(fwd_variant="pingpong", bwd_variant="gluon_dkdv", fwd_head_group=8)
    assert from_json(to_json(cfg), FlashAttentionConfig) == cfg
    with pytest.raises(ValueError, match="fwd_variant"):
        FlashAttentionConfig(fwd_variant="fast")


def test_a_corrupt_or_missing_table_warns_and_generic_defaults_apply(
    hopper: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ejkernel.errors import PluginWarning
    from ejkernel_triton import _tuned
    from ejkernel_triton.ops import flash_attention as fa

    generic = FwdParams(q_blocksize=64, kv_blocksize=32, num_warps=4, num_stages=2)
    monkeypatch.setattr(_tuned, "FOLDER", tmp_path)
    for content in ("{not json", '{"version": 99, "entries": []}', '{"version": 1}', None):
        _tuned._table.cache_clear()
        from ejkernel import errors

        errors._reset_warnings_for_tests()
        if content is not None:
            (tmp_path / "flash_attention.json").write_text(content)
        else:
            (tmp_path / "flash_attention.json").unlink()
        with pytest.warns(PluginWarning, match="flash_attention.json"):
            cfg = fa.heuristic(invocation(64, True))
        assert cfg.fwd_params == generic and cfg.fwd_variant == "usual"
    _tuned._table.cache_clear()


def test_the_tables_device_entries_come_before_the_default_ones(
    hopper: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from ejkernel_triton import _tuned
    from ejkernel_triton.ops import flash_attention as fa

    block = lambda w: {"variant": "usual", "q_blocksize": 64, "kv_blocksize": 64,
                       "num_warps": w, "num_stages": 2}  # fmt: skip
    table = {
        "version": 1,
        "entries": [
            {"device": "default", "max_head_dim": 64, "fwd": block(4)},
            {"device": "A100", "fwd": block(2)},
            {"device": ["H100", "H200"], "max_head_dim": 64, "fwd": block(8)},
        ],
    }
    (tmp_path / "flash_attention.json").write_text(json.dumps(table))
    monkeypatch.setattr(_tuned, "FOLDER", tmp_path)
    _tuned._table.cache_clear()
    try:
        assert fa.heuristic(invocation(64, True)).fwd_params.num_warps == 8
        d128 = fa.heuristic(invocation(128, True))  # no entry: generic defaults
        assert (d128.fwd_variant, d128.fwd_params.kv_blocksize) == ("usual", 32)
        monkeypatch.setattr(hopper, "_device_kind", lambda: "NVIDIA H800")
        assert fa.heuristic(invocation(64, True)).fwd_params.num_warps == 4
    finally:
        _tuned._table.cache_clear()


def test_dropout_is_declined_and_served_by_xla(interpreting: None) -> None:
    q, k, v = qkv(1, 37, 37, 2, 2, 32)
    record = ejkernel.explain("flash_attention", q, k, v, dropout_prob=0.1)
    assert record.platform != "triton"
    assert "dropout" in record.rejected["triton"]


def test_without_the_interpreter_the_cpu_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if jax.default_backend() != "cpu":
        pytest.skip("a CPU question")
    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    q, k, v = qkv(1, 37, 37, 2, 2, 32)
    record = ejkernel.explain("flash_attention", q, k, v)
    assert record.platform == "xla"
    assert "EJKERNEL_INTERPRET=1" in record.rejected["triton"]


def test_importing_the_plugin_imports_no_triton_or_jax_triton() -> None:
    import subprocess
    import sys

    code = (
        "import sys, ejkernel, ejkernel_triton.plugin, ejkernel_triton.ops.flash_attention\n"
        "assert 'triton' not in sys.modules and 'jax_triton' not in sys.modules, "
        "sorted(m for m in sys.modules if 'triton' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
