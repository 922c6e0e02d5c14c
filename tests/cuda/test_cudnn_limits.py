"""The cuDNN route's limits, per cuDNN version and compute capability, on any machine.

``cudnn_declines`` is a pure function of the call and the target (cuDNN version, compute
capability); ``supports()`` reads the target from ``ejkernel_cuda._device`` when it runs, so
the tests pretend a GPU by patching those probes. Selection is exercised through ``explain``
and a call with the backend pretended to be ``gpu`` (the XLA plugin then computes it on CPU).
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from tests.cuda._attention_kw import attention_kw, sds

import ejkernel
from ejkernel.errors import FallbackWarning
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import AttentionShape, assert_close, attention_inputs
from ejkernel_cuda import _device
from ejkernel_cuda.ops._cudnn_limits import (
    CudnnTarget,
    cudnn_declines,
    head_dim_limit,
    version_string,
)
from ejkernel_cuda.ops.flash_attention import cudnn_supports

H100 = CudnnTarget(version=90800, cc=(9, 0))
H200_NEW = CudnnTarget(version=91300, cc=(9, 0))
A100 = CudnnTarget(version=90800, cc=(8, 0))
B200 = CudnnTarget(version=91100, cc=(10, 0))
OLD_CUDNN = CudnnTarget(version=8905, cc=(9, 0))
UNKNOWN_CC = CudnnTarget(version=90800, cc=None)
TARGETS = [H100, H200_NEW, A100, B200, OLD_CUDNN, UNKNOWN_CC]


def kw(**change: Any) -> dict[str, Any]:
    """:func:`attention_kw` of B 2, S 64, H 4 (MHA), D 64 (``change`` overrides)."""
    return attention_kw(**{"hq": 4, "hkv": 4, "d": 64, **change})


def declines(target: CudnnTarget, **change: Any) -> str | None:
    return cudnn_declines(kw(**change), target)


def test_version_strings() -> None:
    assert version_string(90800) == "9.8.0"
    assert version_string(91100) == "9.11.0"
    assert version_string(8904) == "8.9.4"


@pytest.mark.parametrize("target", [t for t in TARGETS if t is not OLD_CUDNN], ids=str)
def test_the_issue_shape_is_declined_for_its_odd_length(target: CudnnTarget) -> None:
    """bf16 q [2, 777, 4, 80], k/v [2, 777, 2, 80]: JAX's cuDNN backward raises
    'Unsupported sequence length Q 777, KV 777' on every cuDNN it supports (a cuDNN without
    GQA declines the head counts first)."""
    reason = declines(target, sq=777, sk=777, hq=4, hkv=2, d=80)
    assert reason is not None and "even sequence lengths" in reason
    assert "Sq=777, Sk=777" in reason


@pytest.mark.parametrize(("sq", "sk"), [(37, 37), (1, 64), (64, 1), (36, 129), (1000, 777)])
def test_any_odd_length_is_declined(sq: int, sk: int) -> None:
    reason = declines(H100, sq=sq, sk=sk)
    assert reason is not None and "Unsupported sequence length" in reason


@pytest.mark.parametrize(
    "change",
    [
        {"sq": 778, "sk": 778, "hq": 4, "hkv": 2, "d": 80},
        {"sq": 1000, "sk": 1000, "d": 32},
        {"sq": 128, "sk": 256, "d": 96},  # Q != KV without causal
        {"d": 128, "dtype": jnp.float16},
        {"d": 192},
        {"d": 256, "hq": 8, "hkv": 1},  # MQA
        {"causal": True},
        {"sliding_window": (16, 0)},
        {"sliding_window": (16, 16), "causal": True},
        {"bias": sds((1, 4, 64, 64)), "attention_mask": sds((2, 1, 64, 64), jnp.bool_)},
    ],
    ids=str,
)
def test_shapes_cudnn_computes_are_accepted_on_hopper(change: dict[str, Any]) -> None:
    assert declines(H100, **change) is None
    assert declines(H200_NEW, **change) is None


@pytest.mark.parametrize(
    ("target", "change", "reason"),
    [
        (H100, {"dtype": jnp.float32}, "bfloat16/float16"),
        (H100, {"dtype": jnp.float8_e4m3fn}, "bfloat16/float16"),
        (H100, {"k_dtype": jnp.float16, "v_dtype": jnp.float16}, "one dtype"),
        (H100, {"d": 264}, "head dim <= 256"),
        (H100, {"d": 36}, "multiple of 8"),
        (H100, {"dv": 32}, "Dv == D"),
        (A100, {"d": 192}, "head dim <= 128"),
        (CudnnTarget(90400, (9, 0)), {"d": 192}, "head dim <= 128"),
        (UNKNOWN_CC, {"d": 192}, "head dim <= 128"),
        (OLD_CUDNN, {"hkv": 2}, "GQA"),
        (CudnnTarget(None, (9, 0)), {}, "JAX finds no cuDNN"),
        (CudnnTarget(8903, (9, 0)), {}, "cuDNN >= 8.9.4; JAX finds 8.9.3"),
        (CudnnTarget(90800, (7, 5)), {}, "compute capability >= 8.0"),
        (CudnnTarget(91000, (10, 3)), {}, "10.3 needs cuDNN >= 9.11.0"),
        (H100, {"logits_soft_cap": 30.0}, "soft cap"),
        (H100, {"softmax_aux": sds((4,), jnp.float32)}, "sinks"),
        (H100, {"dropout_prob": 0.1}, "dropout"),
        (H100, {"q_segment_ids": sds((2, 64), jnp.int32)}, "segment ids"),
        (H100, {"kv_segment_ids": sds((2, 64), jnp.int32)}, "segment ids"),
        (H100, {"sq": 32, "causal": True}, "top-left"),
        (H100, {"sq": 32, "sliding_window": (8, 0)}, "Sq == Sk"),
        (H100, {"sliding_window": (8, 8)}, "left windows"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else None,
)
def test_each_limit_declines_with_its_reason(
    target: CudnnTarget, change: dict[str, Any], reason: str
) -> None:
    result = declines(target, **change)
    assert result is not None and reason in result, result


def test_limits_that_lift_with_newer_cudnn_or_gpus() -> None:
    assert declines(CudnnTarget(91100, (10, 3))) is None
    assert declines(CudnnTarget(90500, (9, 0)), d=256) is None
    assert declines(OLD_CUDNN, hkv=4) is None  # MHA on a cuDNN without GQA
    assert declines(UNKNOWN_CC, d=128, hkv=2) is None
    assert [head_dim_limit(t) for t in (H100, A100, B200, UNKNOWN_CC)] == [256, 128, 256, 128]


# -- supports() reads the target when it runs ---------------------------------------------------


def pretend(monkeypatch: pytest.MonkeyPatch, target: CudnnTarget) -> None:
    monkeypatch.setattr(_device, "cudnn_version", lambda: target.version)
    monkeypatch.setattr(_device, "cc_tuple", lambda: target.cc)


def test_supports_asks_the_device_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend(monkeypatch, H100)
    assert cudnn_supports(kw(d=192)) is True
    pretend(monkeypatch, A100)
    assert "<= 128" in cudnn_supports(kw(d=192))
    pretend(monkeypatch, CudnnTarget(None, None))
    assert cudnn_supports(kw()) == "JAX finds no cuDNN"


@pytest.mark.parametrize(
    ("text", "cc"),
    [("9.0", (9, 0)), ("10.3", (10, 3)), ("12", (12, 0)), (None, None), ("sm_90", None)],
)
def test_compute_capability_is_parsed_or_unknown(
    monkeypatch: pytest.MonkeyPatch, text: str | None, cc: tuple[int, int] | None
) -> None:
    monkeypatch.setattr(_device, "compute_capability", lambda: text)
    assert _device.cc_tuple() == cc
    assert _device.cc_major() == (cc[0] if cc else 0)


def test_importing_the_routes_asks_the_device_nothing() -> None:
    code = (
        "import ejkernel_cuda._device as d\n"
        "def boom():\n"
        "    raise AssertionError('probed at import')\n"
        "d.cudnn_version = d.cc_tuple = d.compute_capability = boom\n"
        "import ejkernel\n"
        "import ejkernel_cuda.ops.flash_attention, ejkernel_cuda.ops.scaled_dot_product_attention\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- selection ---------------------------------------------------------------------------------


@pytest.fixture
def fake_h100(fake_gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`fake_gpu` with cuDNN 9.8 on compute capability 9.0."""
    pretend(monkeypatch, H100)


ISSUE = AttentionShape(b=2, sq=777, sk=777, hq=4, hkv=2, d=80)


@pytest.mark.parametrize("op", ["flash_attention", "scaled_dot_product_attention"])
def test_explain_shows_the_declined_cudnn_route(fake_h100: None, op: str) -> None:
    q, k, v = (sds(x.shape) for x in attention_inputs(ISSUE, jnp.bfloat16))
    record = ejkernel.explain(op, q, k, v)
    assert record.platform == "xla"
    assert "Unsupported sequence length" in record.rejected["cuda"]
    even = sds((2, 778, 4, 80)), sds((2, 778, 2, 80)), sds((2, 778, 2, 80))
    assert ejkernel.explain(op, *even).platform == "cuda"


def test_the_default_call_of_the_issue_runs_without_a_fallback(fake_h100: None) -> None:
    """Before the cuDNN route stated its limits, this call was sent to cuDNN (which cannot run
    here, nor differentiate length 777 on a GPU) and fell back with a FallbackWarning."""
    q, k, v = attention_inputs(ISSUE, jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        out = ejkernel.flash_attention(q, k, v, causal=True)
        grads = jax.grad(lambda q: jnp.sum(ejkernel.flash_attention(q, k, v).astype(jnp.float32)))(
            q
        )
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert_close(out, flash_attention_reference(*f32, causal=True), dtype=jnp.bfloat16)
    assert grads.shape == q.shape and bool(jnp.all(jnp.isfinite(grads.astype(jnp.float32))))
