"""The Pallas plugin: lazy registration, the availability probe, what each family declines."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import jax.numpy as jnp
import pytest

import ejkernel
from ejkernel._invocation import Invocation
from ejkernel.errors import NoImplementationError
from ejkernel.plugins import get_registry, plugin_infos
from ejkernel.testing import AttentionShape, attention_inputs
from ejkernel_pallas import plugin


def test_plugin_is_discovered_and_registers_both_families() -> None:
    infos = {i.name: i for i in plugin_infos()}
    assert infos["pallas"].status == "loaded"
    impls = [i for i in get_registry().implementations("flash_attention") if i.platform == "pallas"]
    assert sorted(i.backends for i in impls) == [("gpu",), ("tpu", "cpu")]
    assert {i.name for i in impls} == {
        "ejkernel_pallas.gpu.flash_attention:flash_attention_pallas",
        "ejkernel_pallas.tpu.flash_attention:flash_attention_pallas",
    }


def test_importing_the_plugin_imports_no_pallas_module() -> None:
    code = (
        "import sys, ejkernel, ejkernel_pallas.plugin\n"
        "from ejkernel.plugins import get_registry\n"
        "get_registry()\n"
        "bad = [m for m in sys.modules if m.startswith(('jax.experimental.pallas', "
        "'ejkernel_pallas.tpu', 'ejkernel_pallas.gpu', 'ejkernel_pallas._compat'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_probe_needs_interpret_mode_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EJKERNEL_INTERPRET", raising=False)
    assert plugin.available("tpu") is True and plugin.available("gpu") is True
    reason = plugin.available("cpu")
    assert isinstance(reason, str) and "EJKERNEL_INTERPRET" in reason
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")
    assert plugin.available("cpu") is True


def test_forcing_pallas_on_cpu_without_interpret_mode_says_how(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("EJKERNEL_INTERPRET", raising=False)
    q, k, v = attention_inputs(AttentionShape(b=1, sq=8, sk=8, hq=1, hkv=1, d=8))
    with pytest.raises(NoImplementationError, match="EJKERNEL_INTERPRET"):
        ejkernel.flash_attention(q, k, v, platform="pallas")
    assert ejkernel.explain(ejkernel.flash_attention, q, k, v).platform != "pallas"


def _gpu_inv(**kwargs: Any) -> Invocation:
    shape = dict(b=1, sq=256, sk=256, hq=4, hkv=2, d=128)
    shape.update({k: kwargs.pop(k) for k in list(kwargs) if k in shape})
    q, k, v = attention_inputs(AttentionShape(**shape), kwargs.pop("dtype", jnp.bfloat16))
    return Invocation(kernel="flash_attention", kwargs={"query": q, "key": k, "value": v, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"dtype": jnp.float32}, "bfloat16"),
        ({"d": 80}, "D = Dv"),
        ({"d": 256}, "D = Dv"),
        ({"sq": 200}, "multiples of 128"),
        ({"logits_soft_cap": 5.0}, "soft cap"),
        ({"sliding_window": (64, 0)}, "sliding window"),
        ({"q_segment_ids": jnp.zeros((1, 256), jnp.int32)}, "segment ids"),
        ({"bias": jnp.zeros((256, 256))}, "bias"),
        ({"dropout_prob": 0.1}, "dropout"),
    ],
    ids=["f32", "d80", "d256", "sq200", "softcap", "window", "segments", "bias", "dropout"],
)
def test_gpu_kernels_decline_what_they_do_not_implement(kwargs: Any, word: str) -> None:
    from ejkernel_pallas.gpu.flash_attention import supports

    reason = supports(_gpu_inv(**kwargs))
    assert isinstance(reason, str) and word in reason


def test_gpu_kernels_accept_causal_gqa_bf16() -> None:
    from ejkernel_pallas.gpu.flash_attention import config_space, heuristic, supports

    inv = _gpu_inv(causal=True)
    assert supports(inv) is True
    cfg = heuristic(inv)
    assert cfg.fwd_params.q_blocksize % 64 == 0 and cfg.fwd_params.num_stages >= 2
    assert config_space(inv)[0] == cfg
