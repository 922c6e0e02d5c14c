"""The Triton flash attention compiled by Triton and launched by jax-triton on a GPU.

Realistic shapes, bf16 and f32, every feature, gradients, against the float32 reference computed
at the highest matmul precision. Run on the lent H100 (``benchmarks/gpu_attention.sh``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest

import ejkernel
from ejkernel.specs.flash_attention import flash_attention_reference

pytestmark = pytest.mark.gpu


def rel(a: Any, b: Any) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def gluon_backward(d: int, kwargs: dict[str, Any]) -> list[str]:
    """The backward's kernels in the plain case on Hopper: the Gluon kernel, with dQ (delta
    from JAX) but at D 64 causal, where the usual dQ kernel runs first and computes delta."""
    from ejkernel_triton.ops.flash_attention import _gluon_fuses_dq

    if _gluon_fuses_dq(d, bool(kwargs.get("causal"))):
        return ["flash_attention_bwd_gluon_kernel"]
    return ["flash_attention_bwd_dq_kernel", "flash_attention_bwd_gluon_kernel"]


def check(shape: tuple[int, ...], dtype: Any, tol: float, cfg: Any = None, **kwargs: Any) -> None:
    b, sq, sk, hq, hkv, d = shape
    ks = jax.random.split(jax.random.PRNGKey(sq + d), 8)
    q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, sk, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, sk, hkv, d), jnp.float32).astype(dtype)
    d_out = jax.random.normal(ks[3], (b, sq, hq, d), jnp.float32).astype(dtype)
    if kwargs.pop("bias", False):
        kwargs["bias"] = jax.random.normal(ks[4], (1, hq, sq, sk), jnp.float32).astype(dtype)
    if kwargs.pop("sinks", False):
        kwargs["softmax_aux"] = jax.random.normal(ks[5], (hq,), jnp.float32)
    if kwargs.pop("segments", False):
        seg = jnp.sort(jax.random.randint(ks[6], (b, sq), 0, 4), axis=-1)
        kwargs.update(q_segment_ids=seg, kv_segment_ids=seg)
    arrays = {n: x for n, x in kwargs.items() if isinstance(x, jax.Array)}
    diff = {n: x for n, x in arrays.items() if jnp.issubdtype(x.dtype, jnp.floating)}
    fixed = {n: x for n, x in kwargs.items() if n not in diff}

    def run(fn: Any, *inputs: Any, **extra: Any) -> Any:
        out, vjp = jax.vjp(lambda q, k, v, a: fn(q, k, v, **a, **fixed, **extra), *inputs)
        return out, vjp(d_out.astype(out.dtype))

    out, grads = jax.jit(lambda *a: run(ejkernel.flash_attention, *a, platform="triton", cfg=cfg))(
        q, k, v, diff
    )
    up = jax.tree.map(lambda x: x.astype(jnp.float32), (q, k, v, diff))
    with jax.default_matmul_precision("highest"):
        want, want_grads = jax.jit(lambda *a: run(flash_attention_reference, *a))(*up)
    assert out.dtype == dtype and not jnp.isnan(out.astype(jnp.float32)).any()
    assert rel(out, want) < tol, ("out", rel(out, want))
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert g.shape == w.shape
        assert rel(g, w) < tol, ("grad", g.shape, rel(g, w))


@pytest.mark.parametrize(
    ("shape", "kwargs"),
    [
        ((2, 1024, 1024, 8, 2, 128), {"causal": True}),
        ((2, 1000, 1500, 8, 8, 64), {"causal": True}),
        ((1, 1500, 1000, 8, 1, 80), {"causal": True, "logits_soft_cap": 30.0}),
        ((2, 777, 777, 4, 2, 96), {"sliding_window": (128, 0), "segments": True}),
        ((1, 512, 512, 4, 4, 128), {"bias": True, "sinks": True}),
        ((1, 300, 300, 4, 2, 256), {}),
        ((2, 333, 333, 4, 4, 32), {"causal": True}),
    ],
    ids=[
        "gqa-d128",
        "sq<sk-d64",
        "mqa-sq>sk-d80-softcap",
        "window-segments-d96",
        "bias-sinks",
        "d256",
        "d32",
    ],
)
def test_bf16_outputs_and_gradients(shape: tuple[int, ...], kwargs: dict[str, Any]) -> None:
    check(shape, jnp.bfloat16, 2e-2, **kwargs)


@pytest.mark.parametrize("causal", [False, True])
def test_f32_uses_ieee_dots(causal: bool) -> None:
    check((1, 257, 257, 4, 2, 64), jnp.float32, 1e-4, causal=causal)


def test_s16384_forward_and_backward_fit_in_memory() -> None:
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 16384, 16, 128), jnp.bfloat16)

    def loss(q: Any) -> Any:
        out = ejkernel.flash_attention(q, q, q, causal=True, platform="triton")
        return jnp.sum(out.astype(jnp.float32))

    g = jax.jit(jax.grad(loss))(q)
    assert g.shape == q.shape and bool(jnp.isfinite(g.astype(jnp.float32)).all())


def test_vmap_folds_into_the_grid() -> None:
    q = jax.random.normal(jax.random.PRNGKey(1), (3, 2, 256, 4, 64), jnp.bfloat16)
    f = jax.vmap(lambda q: ejkernel.flash_attention(q, q, q, causal=True, platform="triton"))
    out = jax.jit(f)(q)
    with jax.default_matmul_precision("highest"):
        want = jax.vmap(lambda q: flash_attention_reference(q, q, q, causal=True))(
            q.astype(jnp.float32)
        )
    assert rel(out, want) < 2e-2


@pytest.mark.parametrize(
    ("shape", "kwargs"),
    [
        ((2, 1024, 1024, 8, 2, 128), {"causal": True}),
        ((2, 1000, 1500, 8, 8, 128), {}),
        ((1, 1500, 1000, 4, 4, 64), {"causal": True}),
        ((1, 777, 777, 4, 1, 128), {"causal": True, "logits_soft_cap": 30.0}),
        ((2, 300, 200, 4, 2, 128), {"causal": True}),
        ((1, 37, 37, 2, 1, 128), {}),
        ((3, 700, 700, 4, 2, 128), {"causal": True}),
        ((2, 2500, 3000, 4, 2, 64), {}),
        ((1, 4096, 4096, 4, 4, 128), {"causal": True}),
        ((1, 300, 300, 4, 2, 128), {"causal": True, "softmax_scale": -0.05}),
    ],
    ids=[
        "gqa-causal",
        "sq<sk-cut-keys",
        "sq>sk-empty-rows-d64",
        "mqa-softcap",
        "sq>sk-empty-rows-gqa",
        "seq37",
        "causal-12-heads",  # the forward's head groups of 8: one whole, one of 4
        "d64-rows-cross-batches",  # 128-row steps run into the next batch's rows: dQ adds 0
        "long-causal",  # dQ of a row: the sum of up to 32 programs' TMA reduce-adds
        "negative-scale",  # the Gluon forward masks unscaled scores: Triton's takes it
    ],
)
def test_warp_specialized_kernels(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], kwargs: dict[str, Any]
) -> None:
    from ejkernel_triton import _launch
    from ejkernel_triton.ops.flash_attention import _WS_FWD, FlashAttentionConfig

    names: list[str] = []
    real = _launch.launch
    monkeypatch.setattr(
        _launch,
        "launch",
        lambda kernel, *a, **k: names.append(kernel.fn.__name__) or real(kernel, *a, **k),
    )
    cfg = FlashAttentionConfig(fwd_params=_WS_FWD, warp_specialize=True)
    check(shape, jnp.bfloat16, 2e-2, cfg=cfg, **kwargs)
    # at D 128 the forward is the Gluon kernel (FA3's ping-pong) for a scale > 0, else Triton's
    forward = (
        "flash_attention_fwd_pingpong_kernel"
        if shape[-1] == 128 and kwargs.get("softmax_scale", 1.0) > 0
        else "flash_attention_fwd_ws_kernel"
    )
    assert names == [forward, *gluon_backward(shape[-1], kwargs)]


@pytest.mark.parametrize(
    ("shape", "kwargs"),
    [
        ((2, 1000, 1000, 8, 2, 64), {"causal": True}),
        ((1, 1500, 1000, 4, 4, 64), {"causal": True}),
        ((2, 300, 555, 4, 1, 64), {"logits_soft_cap": 20.0}),
        ((1, 37, 37, 2, 1, 128), {"causal": True}),
    ],
    ids=["gqa-causal-d64", "sq>sk-empty-rows-d64", "mqa-softcap-sq<sk-d64", "seq37-d128"],
)
def test_usual_forward_with_the_gluon_backward(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], kwargs: dict[str, Any]
) -> None:
    from ejkernel_triton import _launch
    from ejkernel_triton.ops.flash_attention import _BWD_D64, _FWD_D128, FlashAttentionConfig

    names: list[str] = []
    real = _launch.launch
    monkeypatch.setattr(
        _launch,
        "launch",
        lambda kernel, *a, **k: names.append(kernel.fn.__name__) or real(kernel, *a, **k),
    )
    cfg = FlashAttentionConfig(fwd_params=_FWD_D128, bwd_params=_BWD_D64)
    check(shape, jnp.bfloat16, 2e-2, cfg=cfg, **kwargs)
    # whatever the config, the plain case's backward is the Gluon kernel's
    assert names == ["flash_attention_fwd_kernel", *gluon_backward(shape[-1], kwargs)]
