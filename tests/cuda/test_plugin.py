"""The CUDA plugin on a machine without an NVIDIA GPU: registration, honest ``supports()``
reasons for the cuDNN and native routes, and selection falling back to another platform.

Selection on a GPU is exercised by pretending the backend is ``gpu`` (``explain`` only: nothing
runs); the kernels themselves are tested on the H100 (``test_*_gpu.py``).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from tests.cuda._attention_kw import attention_kw, sds

import ejkernel
from ejkernel.errors import NoImplementationError
from ejkernel.plugins import get_registry
from ejkernel_cuda import _build, _device
from ejkernel_cuda.ops import _decode
from ejkernel_cuda.ops.flash_attention import cudnn_supports

OPS = [
    "flash_attention",
    "mean_pooling",
    "page_attention",
    "ragged_decode_attention",
    "scaled_dot_product_attention",
]


@pytest.fixture
def cudnn_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend JAX found cuDNN 9.8 on a Hopper GPU."""
    monkeypatch.setattr(_device, "cudnn_version", lambda: 90800)
    monkeypatch.setattr(_device, "cc_tuple", lambda: (9, 0))


def test_the_plugin_registers_every_op_above_the_xla_fallback() -> None:
    registry = get_registry()
    for op in OPS:
        impls = {i.platform: i for i in registry.implementations(op)}
        assert "cuda" in impls, op
        assert impls["cuda"].backends == ("gpu",)
        assert impls["cuda"].priority > impls["xla"].priority
    assert registry.platform("cuda").distribution == "ejkernel-cuda"


@pytest.mark.parametrize("op", ["page_attention", "ragged_decode_attention"])
def test_the_native_decode_ranks_below_the_triton_serving_kernels(op: str) -> None:
    impls = {i.platform: i.priority for i in get_registry().implementations(op)}
    assert impls["triton"] > impls["cuda"] > impls["xla"], impls


ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.skipif(ON_GPU, reason="checks the behaviour off a GPU")
def test_off_an_nvidia_gpu_the_platform_says_why_and_xla_runs() -> None:
    reason = get_registry().platform("cuda").check("cpu")
    assert isinstance(reason, str) and "NVIDIA GPU" in reason
    q = jnp.ones((1, 2, 2, 8), jnp.bfloat16)
    record = ejkernel.explain("flash_attention", q, q, q)
    assert record.platform == "xla" and "serves gpu" in record.rejected["cuda"]
    with pytest.raises(NoImplementationError, match="serves gpu"):
        ejkernel.flash_attention(q, q, q, platform="cuda")


def test_importing_the_plugin_loads_no_kernel_module() -> None:
    code = (
        "import sys, ejkernel, ejkernel_cuda.plugin\n"
        "from ejkernel.plugins import get_registry\n"
        "get_registry()\n"
        "bad = [m for m in sys.modules if m.startswith(('ejkernel_cuda.ops', 'ejkernel_cuda._build'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- the cuDNN route -------------------------------------------------------------------------------


def test_cudnn_accepts_the_shapes_it_computes(cudnn_present: None) -> None:
    assert cudnn_supports(attention_kw()) is True
    assert cudnn_supports(attention_kw(causal=True)) is True
    assert cudnn_supports(attention_kw(sq=2, sk=300)) is True
    assert cudnn_supports(attention_kw(causal=True, sliding_window=(16, 16))) is True
    assert cudnn_supports(attention_kw(sliding_window=(16, 0), d=256, dtype=jnp.float16)) is True
    assert cudnn_supports(attention_kw(d=80)) is True


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"dtype": jnp.float32}, "bfloat16/float16"),
        ({"d": 264}, "head dim <= 256"),
        ({"d": 36}, "multiple of 8"),
        ({"dv": 64}, "Dv == D"),
        ({"logits_soft_cap": 30.0}, "soft cap"),
        ({"softmax_aux": sds((8,), jnp.float32)}, "sinks"),
        ({"dropout_prob": 0.1}, "dropout"),
        ({"q_segment_ids": sds((2, 64), jnp.int32)}, "segment ids"),
        ({"sq": 36, "causal": True}, "top-left"),
        ({"sq": 36, "sliding_window": (8, 0)}, "Sq == Sk"),
        ({"sq": 1, "sk": 300}, "even sequence lengths"),
        ({"sq": 37}, "even sequence lengths"),
        ({"sliding_window": (8, 8)}, "left windows"),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, dict) else None,
)
def test_cudnn_declines_with_a_reason(cudnn_present: None, change: dict, reason: str) -> None:
    result = cudnn_supports(attention_kw(**change))
    assert isinstance(result, str) and reason in result


def test_cudnn_head_dim_limit_is_128_before_hopper(
    cudnn_present: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_device, "cc_tuple", lambda: (8, 0))
    assert "<= 128" in cudnn_supports(attention_kw(d=192))


@pytest.mark.skipif(ON_GPU, reason="the GPU machine has cuDNN")
def test_without_cudnn_the_route_declines() -> None:
    assert cudnn_supports(attention_kw()) == "JAX finds no cuDNN"


def test_selection_picks_cudnn_and_falls_back_to_xla_when_declined(
    fake_gpu: None, cudnn_present: None
) -> None:
    q = jnp.zeros((1, 16, 4, 64), jnp.bfloat16)
    assert ejkernel.explain("flash_attention", q, q, q, causal=True).platform == "cuda"
    assert ejkernel.explain("scaled_dot_product_attention", q, q, q).platform == "cuda"
    record = ejkernel.explain("flash_attention", q, q, q, logits_soft_cap=20.0)
    assert record.platform == "xla" and "soft cap" in record.rejected["cuda"]
    f = q.astype(jnp.float32)
    record = ejkernel.explain("scaled_dot_product_attention", f, f, f)
    assert record.platform == "xla" and "bfloat16/float16" in record.rejected["cuda"]


# -- the native route ------------------------------------------------------------------------------


def paged_args(d: int = 128, dtype: Any = jnp.bfloat16) -> tuple[Any, ...]:
    return (
        jnp.zeros((4, 8, d), dtype),
        jnp.zeros((32, 16, 2, d), dtype),
        jnp.zeros((32, 16, 2, d), dtype),
        jnp.ones((4,), jnp.int32),
        jnp.zeros((4, 8), jnp.int32),
    )


def test_native_ops_decline_without_nvcc_and_selection_falls_back(
    fake_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_build, "find_nvcc", lambda: None)
    monkeypatch.setattr(_build, "normalize_arch", lambda arch: "90")
    monkeypatch.setattr(_build, "_state", {})  # this process's load state, restored after
    record = ejkernel.explain("page_attention", *paged_args())
    assert record.platform == "xla"
    assert "nvcc not found" in record.rejected["cuda"]
    x = jnp.zeros((2, 5, 16), jnp.float32)
    record = ejkernel.explain("mean_pooling", x)
    assert record.platform == "xla" and "nvcc not found" in record.rejected["cuda"]


def test_native_decode_declines_shapes_the_kernel_lacks(fake_gpu: None) -> None:
    record = ejkernel.explain("page_attention", *paged_args(d=36))
    assert record.platform == "xla" and "multiple of 8" in record.rejected["cuda"]
    record = ejkernel.explain("page_attention", *paged_args(d=264))
    assert "<= 256" in record.rejected["cuda"]
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    k = jnp.zeros((2, 40, 2, 64), jnp.bfloat16)
    v = jnp.zeros((2, 40, 2, 32), jnp.bfloat16)
    n = jnp.zeros((2,), jnp.int32)
    record = ejkernel.explain("ragged_decode_attention", q, k, v, n, n)
    assert "Dv == D" in record.rejected["cuda"]


def test_native_decode_declines_scaled_caches(fake_gpu: None, monkeypatch) -> None:
    """float8 caches, and any cache read with k_scale/v_scale, go to XLA with a reason."""
    monkeypatch.setattr(_build, "native_status", lambda: True)
    q, k, v, lens, tables = paged_args()
    fp8 = (k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn))
    for caches, scales in (((k, v), {"v_scale": 0.5}), (fp8, {"k_scale": 0.5, "v_scale": 2.0})):
        record = ejkernel.explain("page_attention", q, *caches, lens, tables, **scales)
        assert record.platform == "xla" and "k_scale/v_scale" in record.rejected["cuda"]
    dense = (jnp.zeros((2, 40, 2, 64), jnp.float8_e4m3fn),) * 2
    n = jnp.zeros((2,), jnp.int32)
    scales = {"k_scale": jnp.ones((2,), jnp.float32), "v_scale": 0.5}
    record = ejkernel.explain("ragged_decode_attention", q[:2, :, :64], *dense, n, n, **scales)
    assert record.platform == "xla" and "k_scale/v_scale" in record.rejected["cuda"]


def test_native_route_is_chosen_once_built(fake_gpu: None, monkeypatch) -> None:
    monkeypatch.setattr(_build, "native_status", lambda: True)
    record = ejkernel.explain("page_attention", *paged_args())
    assert record.platform == "cuda" and record.config.num_splits >= 1
    x = jnp.zeros((1, 10, 16), jnp.float32)
    cu = jnp.asarray([0, 4, 10], jnp.int32)
    assert ejkernel.explain("mean_pooling", x, cu_seqlens=cu).platform == "cuda"


@pytest.mark.parametrize(
    ("hq", "hkv", "want"), [(32, 8, 4), (64, 8, 4), (16, 1, 4), (6, 2, 1), (12, 2, 2), (8, 8, 1)]
)
def test_heads_per_cta_shares_every_kv_read_within_a_group(hq: int, hkv: int, want: int) -> None:
    assert _decode.heads_per_cta(hq, hkv) == want


def test_split_heuristic_fills_the_gpu_and_keeps_splits_long() -> None:
    # B 32, Hq 32 / Hkv 8 (4 heads per CTA), 8192 keys: 256 CTAs a split, 4 x 132 slots (bf16).
    assert _decode.default_splits(32, 32, 8, 8192) == 2  # 512 of 528 slots: one full wave
    assert _decode.default_splits(32, 32, 8, 8192, itemsize=4) == 3  # 768 of 792 (3 a SM)
    # 300 CTAs: 3 splits fill 85 % of two waves, 5 fill 95 % of three.
    assert _decode.default_splits(300, 4, 1, 8192) == 5
    assert _decode.default_splits(32, 32, 8, 100) == 1  # fewer than 128 keys a split
    # Too few rows to fill the GPU: as many splits as allowed.
    assert _decode.default_splits(1, 8, 1, 1 << 20) == _decode.MAX_SPLITS
