"""The default call (no ``platform=``) of ``flash_attention`` and
``scaled_dot_product_attention`` on an NVIDIA GPU never fails and never falls back from cuDNN.

Sweeps head dims 32–256 (80, 96 and 192 included), odd lengths (37, 777, 1000), Q != KV, GQA
(4 query heads, 2 key/value heads), bf16/fp16/fp32 and masks (causal, sliding windows, segment
ids, soft cap, bias) against the op's plain-JAX reference, forward everywhere and gradients on a
subset. The cuDNN route must decline in ``supports()`` what cuDNN cannot run, so a
``FallbackWarning`` naming the ``cuda`` platform fails the test. Where the cuDNN route accepts a
call that another platform ran (a cached or shipped platform choice), the call runs once more
with ``platform="cuda"``: what ``supports()`` accepts must compute.

Batch 1–2 and four heads keep it small; every call is jitted (one compile per case).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejkernel
from ejkernel.errors import FallbackWarning
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import AttentionShape, assert_close, attention_inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _heuristic_configs() -> Any:
    """The sweep asks whether each call runs, not how fast: every platform runs its heuristic
    config (tuning each of 65 shapes would compile every candidate of each)."""
    from ejkernel.ops import policy_override

    with policy_override(autotune=False):
        yield


OPS: dict[str, Callable[..., Any]] = {
    "flash_attention": ejkernel.flash_attention,
    "scaled_dot_product_attention": ejkernel.scaled_dot_product_attention,
}

#: float32 may run through XLA's default dot precision (TF32 on the GPU) on some platform.
F32_TOL = {"rtol": 2e-3, "atol": 2e-3}


def shape(sq: int, sk: int | None = None, d: int = 80, b: int = 1) -> AttentionShape:
    return AttentionShape(b=b, sq=sq, sk=sq if sk is None else sk, hq=4, hkv=2, d=d)


def segments(b: int, s: int, cut: int) -> jax.Array:
    """Two packed sequences per row: ids 0 before ``cut``, 1 after."""
    return jnp.broadcast_to((jnp.arange(s) >= cut).astype(jnp.int32), (b, s))


def options(case: str, shp: AttentionShape) -> dict[str, Any]:
    """The keyword arguments of a mask case (arrays built for ``shp``)."""
    if case == "none":
        return {}
    if case == "causal":
        return {"causal": True}
    if case == "window":
        return {"sliding_window": (32, 0)}
    if case == "window_both":
        return {"sliding_window": (24, 8)}
    if case == "causal_window":
        return {"causal": True, "sliding_window": (32, 8)}
    if case == "segments":
        return {
            "q_segment_ids": segments(shp.b, shp.sq, shp.sq // 3),
            "kv_segment_ids": segments(shp.b, shp.sk, shp.sk // 3),
        }
    if case == "soft_cap":
        return {"logits_soft_cap": 20.0}
    if case == "bias":
        rng = np.random.default_rng(3)
        return {"bias": jnp.asarray(rng.standard_normal((1, shp.hq, shp.sq, shp.sk), np.float32))}
    raise AssertionError(case)


# (op, shape, dtype, mask case, gradients too)
Case = tuple[str, AttentionShape, Any, str, bool]
FA, SDPA = "flash_attention", "scaled_dot_product_attention"
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)


def sweep() -> list[Case]:
    cases: list[Case] = []
    for d in HEAD_DIMS:  # odd (the issue's 777), even (cuDNN's), and 37
        cases.append((FA, shape(777, d=d, b=2), BF16, "none", d in (80, 128)))
        cases.append((FA, shape(256, d=d), BF16, "none", d in (64, 128, 256)))
        cases.append((FA, shape(37, d=d), BF16, "causal", d == 96))
    for sq, sk in ((1000, 1000), (64, 1000), (1000, 37), (1, 1000), (2, 1000)):  # Q != KV
        cases.append((FA, shape(sq, sk), BF16, "none", False))
        cases.append((FA, shape(sq, sk), BF16, "causal", sq == 64))
    for dtype in (F16, F32):
        for d in (80, 128):
            cases.append((FA, shape(777, d=d), dtype, "none", d == 128))
            cases.append((FA, shape(256, d=d), dtype, "causal", d == 80))
    for mask in (
        "causal",
        "window",
        "window_both",
        "causal_window",
        "segments",
        "soft_cap",
        "bias",
    ):
        cases.append((FA, shape(256, d=128), BF16, mask, mask in ("causal", "window", "bias")))
        cases.append((FA, shape(37, 129, d=80), BF16, mask, mask == "segments"))
    for d in (64, 80, 128, 256):
        cases.append((SDPA, shape(777, d=d), BF16, "none", d == 80))
        cases.append((SDPA, shape(512, d=d), BF16, "causal", d == 128))
    for mask in ("window", "segments", "soft_cap"):
        cases.append((SDPA, shape(256, d=64), F16, mask, False))
    return cases


def case_id(case: Case) -> str:
    op, shp, dtype, mask, grad = case
    name = "fa" if op == FA else "sdpa"
    return f"{name}-{shp}-{jnp.dtype(dtype).name}-{mask}{'-grad' if grad else ''}"


def reference(q: jax.Array, k: jax.Array, v: jax.Array, **kw: Any) -> jax.Array:
    with jax.default_matmul_precision("highest"):
        return flash_attention_reference(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), **kw
        )


def tolerance(dtype: Any, scale: float = 1.0) -> dict[str, Any]:
    if jnp.dtype(dtype) == jnp.float32:
        return {k: t * scale for k, t in F32_TOL.items()}
    return {"dtype": dtype, "scale": scale}


def check(op: str, shp: AttentionShape, dtype: Any, mask: str, grad: bool, **force: Any) -> None:
    """Run the call jitted (forward, and gradients if ``grad``) and compare with the reference;
    ``force`` is ``{}`` for the default call or ``{"platform": "cuda"}``."""
    q, k, v = attention_inputs(shp, dtype, seed=shp.d)
    kw = options(mask, shp)
    fn = OPS[op]
    out = jax.jit(lambda q, k, v: fn(q, k, v, **kw, **force))(q, k, v)
    assert out.shape == (shp.b, shp.sq, shp.hq, shp.d) and out.dtype == dtype
    assert_close(out, reference(q, k, v, **kw), name=f"out {force}", **tolerance(dtype))
    if not grad:
        return
    w = jax.random.normal(jax.random.PRNGKey(7), out.shape, jnp.float32)

    def loss(f: Callable[..., Any]) -> Callable[..., Any]:
        return lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w)

    ours = jax.jit(jax.grad(loss(lambda q, k, v: fn(q, k, v, **kw, **force)), (0, 1, 2)))(q, k, v)
    with jax.default_matmul_precision("highest"):
        theirs = jax.grad(
            loss(lambda q, k, v: flash_attention_reference(q, k, v, **kw)), (0, 1, 2)
        )(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    assert_close(ours, theirs, name=f"grads {force}", **tolerance(dtype, scale=4.0))


def cuda_fallbacks(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, FallbackWarning) and "platform 'cuda'" in str(w.message)
    ]


@pytest.mark.parametrize("case", sweep(), ids=case_id)
def test_the_default_call_runs_without_a_cudnn_fallback(case: Case) -> None:
    op, shp, dtype, mask, grad = case
    q, k, v = attention_inputs(shp, dtype, seed=shp.d)
    record = ejkernel.explain(op, q, k, v, grad=grad, **options(mask, shp))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        check(op, shp, dtype, mask, grad)
    assert not cuda_fallbacks(caught), (record.rejected, cuda_fallbacks(caught))
    if "cuda" not in record.rejected and record.platform != "cuda":
        check(op, shp, dtype, mask, grad, platform="cuda")


def test_the_issue_call_declines_cudnn_and_runs() -> None:
    """bf16 q [2, 777, 4, 80], k/v [2, 777, 2, 80]: cuDNN's backward rejects length 777, so the
    route declines it in supports() and another platform computes it, forward and backward."""
    shp = AttentionShape(b=2, sq=777, sk=777, hq=4, hkv=2, d=80)
    q, k, v = attention_inputs(shp, jnp.bfloat16)
    record = ejkernel.explain("flash_attention", q, k, v)
    assert record.platform != "cuda"
    assert "Unsupported sequence length" in record.rejected["cuda"], record.rejected
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        check(FA, shp, jnp.bfloat16, "none", grad=True)
