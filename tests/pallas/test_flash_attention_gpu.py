"""The Pallas Mosaic-GPU flash attention: on an H100 (``gpu`` marker) and in interpret mode.

The same test body runs in two modes: ``gpu`` runs the compiled kernels through the public op
on the GPU; ``interpret`` runs them on the CPU in Mosaic GPU's interpret mode (warpgroups,
barriers, TMA and shared memory simulated; ``wgmma`` replaced by ``jnp.dot`` on the same tiles).
Interpret mode needs ``absl`` (Mosaic GPU imports it) and a few seconds per tile, so it is
marked ``slow`` and skipped where absl is missing.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import ejkernel
from ejkernel.ops import BwdParams, FwdParams
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import AttentionShape, assert_close, attention_inputs
from ejkernel.testing import random_normal as normal
from ejkernel_pallas._attention import FlashAttentionConfig

HAS_ABSL = importlib.util.find_spec("absl") is not None

GPU = pytest.param("gpu", marks=pytest.mark.gpu, id="gpu")
INTERPRET = pytest.param(
    "interpret",
    marks=[
        pytest.mark.slow,
        pytest.mark.skipif(not HAS_ABSL, reason="Mosaic GPU interpret mode needs absl-py"),
    ],
    id="interpret",
)


def _gpu(*values: Any, id: str) -> Any:
    """A ``gpu`` case with more parameters (marks of a ``pytest.param`` nested in a tuple are
    lost: build the whole case here)."""
    return pytest.param("gpu", *values, marks=GPU.marks, id=id)


def _interpret(*values: Any, id: str) -> Any:
    return pytest.param("interpret", *values, marks=INTERPRET.marks, id=id)


def _check(
    mode: str,
    shape: AttentionShape,
    causal: bool,
    cfg: Any = None,
    *,
    grads: bool = True,
    softmax_scale: float | None = None,
) -> None:
    """Output (and, with ``grads``, the gradients) of the kernels against the reference."""
    if mode == "interpret" and jax.default_backend() != "cpu":
        pytest.skip("interpret mode is exercised on the CPU")
    q, k, v = attention_inputs(shape, jnp.bfloat16, seed=1)
    d_out = normal(jax.random.PRNGKey(7), (shape.b, shape.sq, shape.hq, shape.d), jnp.bfloat16)
    kw = {"causal": causal, "softmax_scale": softmax_scale}
    if mode == "gpu":
        # The Mosaic GPU kernels must accept the call (supports() is True) when asked for by
        # platform: unasked, a higher-priority plugin (the CUDA one) may rightly be chosen.
        sel = ejkernel.explain(ejkernel.flash_attention, q, k, v, **kw, platform="pallas")
        assert sel.implementation.startswith("ejkernel_pallas.gpu."), sel

        def ours(q: Any, k: Any, v: Any) -> Any:
            return ejkernel.flash_attention(q, k, v, **kw, platform="pallas", cfg=cfg)

    else:
        from ejkernel_pallas.gpu.flash_attention import flash_attention_pallas as fn

        @jax.custom_vjp
        def ours(q: Any, k: Any, v: Any) -> Any:
            return fn(query=q, key=k, value=v, **kw, cfg=cfg)

        def fwd(q: Any, k: Any, v: Any) -> Any:
            return fn.fwd(query=q, key=k, value=v, **kw, cfg=cfg)

        def bwd(res: Any, g: Any) -> Any:
            grads = fn.bwd(res, g, **kw, cfg=cfg)
            return grads["query"], grads["key"], grads["value"]

        ours.defvjp(fwd, bwd)

    def run(q: Any, k: Any, v: Any, g: Any) -> Any:
        if not grads:
            return ours(q, k, v), ()
        out, vjp = jax.vjp(ours, q, k, v)
        return out, vjp(g)

    out, got = jax.jit(run)(q, k, v, d_out)
    up = lambda x: x.astype(jnp.float32)
    ref_out, ref_vjp = jax.vjp(
        lambda q, k, v: flash_attention_reference(q, k, v, **kw), up(q), up(k), up(v)
    )
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref_out, name="out")
    if not grads:
        return
    for name, g, r in zip(("dq", "dk", "dv"), got, ref_vjp(up(d_out))):
        assert g.dtype == jnp.bfloat16 and g.shape == r.shape
        assert_close(g, r, scale=2.0, name=name)


SMALL = FlashAttentionConfig(
    fwd_params=FwdParams(q_blocksize=64, kv_blocksize=64, num_stages=2),
    bwd_params=BwdParams(q_blocksize=64, kv_blocksize=64, num_stages=2),
)


@pytest.mark.parametrize("mode", [GPU, INTERPRET])
def test_causal_gqa_with_more_keys_than_queries(mode: str) -> None:
    # two query tiles on the GPU; one in the (slow) interpreter
    sq, sk = (256, 384) if mode == "gpu" else (128, 256)
    _check(mode, AttentionShape(b=1, sq=sq, sk=sk, hq=2, hkv=1, d=64), True, SMALL)


THREE_STAGES = FlashAttentionConfig(
    fwd_params=FwdParams(q_blocksize=64, kv_blocksize=64, num_stages=3),
    bwd_params=BwdParams(q_blocksize=64, kv_blocksize=64, num_stages=3),
)


@pytest.mark.parametrize("mode", [GPU, INTERPRET])
def test_causal_backward_with_a_three_slot_ring(mode: str) -> None:
    # the second kv tile's queries start at block 2, which three slots do not divide: the
    # dK/dV consumer hands back the steps it skips in the slots the producer filled
    _check(mode, AttentionShape(b=1, sq=256, sk=256, hq=1, hkv=1, d=64), True, THREE_STAGES)


@pytest.mark.parametrize("d", [64, 128])  # the forward orders its waits per head dim
@pytest.mark.parametrize("mode", [GPU, INTERPRET])
def test_full_attention_one_tile(mode: str, d: int) -> None:
    _check(mode, AttentionShape(b=1, sq=128, sk=128, hq=1, hkv=1, d=d), False, SMALL)


@pytest.mark.parametrize("scale", [-0.2, 0.0], ids=["negative", "zero"])
@pytest.mark.parametrize("mode", [GPU, INTERPRET])
def test_causal_with_a_softmax_scale_that_is_not_positive(mode: str, scale: float) -> None:
    # the forward's running maximum is max(s) · scale only for a positive scale, and a hidden
    # score of -inf times a scale <= 0 is +inf or NaN: scaled first, then masked
    shape = AttentionShape(b=1, sq=128, sk=256, hq=1, hkv=1, d=64)
    _check(mode, shape, True, SMALL, softmax_scale=scale)


@pytest.mark.parametrize("mode", [GPU, INTERPRET])
def test_overlapped_forward_over_many_kv_tiles(mode: str) -> None:
    # D 128 non-causal: the forward overlapping the next Q·Kᵀ with P·V, over six kv tiles
    # (every ring slot reused), GQA, more keys than queries
    _check(mode, AttentionShape(b=1, sq=128, sk=384, hq=2, hkv=1, d=128), False, SMALL)


@pytest.mark.parametrize(
    ("mode", "sk"),
    [
        _gpu(4096, id="gpu-20x192+2x128"),
        _gpu(1152, id="gpu-6x192"),
        _interpret(512, id="interpret-2x192+1x128"),
        _interpret(256, id="interpret-2x128"),
    ],
)
def test_wide_kv_forward_with_narrower_tail_steps(mode: str, sk: int) -> None:
    # the default non-causal D 128 forward takes 192-row kv tiles; where 192 does not divide
    # Sk, the last steps fill only the first 128 rows of their ring slots
    from ejkernel_pallas.gpu import _problem as pb

    q = jax.ShapeDtypeStruct((1, 128, 2, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, sk, 1, 128), jnp.bfloat16)
    pr = pb.Problem.of(q, k, None, backward=False, softmax_scale=None, causal=False)
    assert pr.bk == 192 and pr.wide_steps * 192 + pr.tail * pb.TAIL_ROWS == sk
    sq = 1024 if mode == "gpu" else 128
    # interpret: the forward only (its backward is test_overlapped_forward_over_many_kv_tiles')
    shape = AttentionShape(b=2 if mode == "gpu" else 1, sq=sq, sk=sk, hq=4, hkv=2, d=128)
    _check(mode, shape, False, grads=mode == "gpu")


def test_kv_tiles_that_cannot_cover_the_keys_are_refused() -> None:
    from ejkernel_pallas.gpu import _problem as pb

    q = jax.ShapeDtypeStruct((1, 256, 1, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 640, 1, 128), jnp.bfloat16)
    wide = FlashAttentionConfig(fwd_params=FwdParams(kv_blocksize=192))
    assert pb.Problem.of(q, k, wide, backward=False, softmax_scale=None, causal=False).tail == 2
    with pytest.raises(ValueError, match="kv_blocksize=192"):  # tail steps: non-causal only
        pb.Problem.of(q, k, wide, backward=False, softmax_scale=None, causal=True)
    with pytest.raises(ValueError, match="kv_blocksize=192 x 2"):
        wide_bwd = FlashAttentionConfig(bwd_params=BwdParams(kv_blocksize=192))
        pb.Problem.of(q, k, wide_bwd, backward=True, softmax_scale=None, causal=False)
    assert pb.tail_steps(4096, 192) == 2 and pb.tail_steps(384, 192) == 0
    assert pb.tail_steps(640, 256) == 1 and pb.tail_steps(64, 192) is None


@pytest.mark.parametrize(
    ("mode", "d"),
    [_gpu(64, id="gpu-64"), _interpret(64, id="interpret-64"), _interpret(128, id="interpret-128")],
)  # the GPU runs it at D 64 only
def test_persistent_forward_runs_several_tiles_per_cta(
    mode: str, d: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # non-causal with more (head, query tile, batch) tiles than CTAs: one ring across tiles
    # (3 CTAs in interpret mode, one per SM on the GPU)
    from ejkernel_pallas.gpu import flash_attention_fwd as fwd

    monkeypatch.setattr(fwd, "PERSISTENT_FORWARD_HEAD_DIMS", (d,))
    if mode == "gpu":
        shape = AttentionShape(b=2, sq=1024, sk=1024, hq=16, hkv=4, d=d)  # 256 tiles
    else:
        shape = AttentionShape(b=1, sq=256, sk=384, hq=2, hkv=1, d=d)  # 4 tiles
    # interpret: the forward only (the backward is not persistent; other tests run it)
    _check(mode, shape, False, SMALL, grads=mode == "gpu")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_kernels_lower_to_mosaic_gpu_on_any_machine(
    d: int, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GPU lowering itself (wgmma, named barriers, TMA), traced for CUDA without a GPU:
    # what interpret mode never builds (the wgmma accumulators, the named-barrier PTX).
    import attrs

    from ejkernel_pallas.gpu import _problem as pb
    from ejkernel_pallas.gpu import flash_attention_bwd as bwd
    from ejkernel_pallas.gpu import flash_attention_fwd as fwd_module

    x = jax.ShapeDtypeStruct((1, 256, 2, d), jnp.bfloat16)
    row = jax.ShapeDtypeStruct((1, 2, 256), jnp.float32)  # logsumexp, delta

    def problem(q: Any, k: Any, backward: bool) -> Any:
        pr = pb.Problem.of(q, k, None, backward=backward, softmax_scale=None, causal=causal)
        return attrs.evolve(pr, interpret=False)

    def lowered(fn: Any, *args: Any) -> str:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    fwd = lambda q, k, v: fwd_module.fwd_call(q, k, v, problem(q, k, False))
    dq = lambda q, k, v, do, lse, dl: bwd.dq_call(q, k, v, do, lse, dl, problem(q, k, True))
    dkv = lambda q, k, v, do, lse, dl: bwd.dkv_call(q, k, v, do, lse, dl, problem(q, k, True))
    assert "ejkernel_flash_attention_fwd" in lowered(fwd, x, x, x)
    assert "mosaic_gpu" in lowered(dq, x, x, x, x, row, row)
    assert "mosaic_gpu" in lowered(dkv, x, x, x, x, row, row)
    if d in pb.FWD_WIDE_KV and not causal:  # 192-row kv steps, then 128-row ones
        long = jax.ShapeDtypeStruct((1, 512, 2, d), jnp.bfloat16)
        assert problem(x, long, False).tail == 1
        assert "ejkernel_flash_attention_fwd" in lowered(fwd, x, long, long)
    monkeypatch.setattr(pb, "FWD_WIDE_KV", {})  # the persistent forward takes no tail steps
    monkeypatch.setattr(
        fwd_module, "_sm_count", lambda pr: 1
    )  # 2 tiles > 1 CTA: persistent if not causal
    monkeypatch.setattr(fwd_module, "PERSISTENT_FORWARD_HEAD_DIMS", (d,))
    persistent = lowered(lambda *a: fwd(*a), x, x, x)  # a new function: not jit's cached trace
    assert ("ejkernel_flash_attention_fwd_persistent" in persistent) != causal


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape",
    [
        AttentionShape(b=2, sq=1024, sk=1024, hq=8, hkv=8, d=128),
        AttentionShape(b=2, sq=512, sk=1024, hq=8, hkv=2, d=128),
        AttentionShape(b=1, sq=1024, sk=1024, hq=4, hkv=4, d=64),
    ],
    ids=str,
)
def test_gpu_kernels_match_the_reference_with_default_configs(
    shape: AttentionShape, causal: bool
) -> None:
    _check("gpu", shape, causal)
