"""Registration by convention (``register_module``) and ops served by another op's
implementations (``served_by``: flash attention serves scaled_dot_product_attention)."""

from __future__ import annotations

import sys
import textwrap

import jax
import pytest
from tests.core._flash_calls import SHAPE

import ejkernel
from ejkernel.errors import ConfigError
from ejkernel.plugins import get_registry
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import assert_close, attention_inputs

#: A plugin module for platform "conv": the reference under the conventional names.
CONVENTIONAL = """
import attrs
from ejkernel.specs.flash_attention import flash_attention_reference

CALLS = []

@attrs.frozen(kw_only=True)
class Config:
    block: int = 16

{extra}

def heuristic(inv):
    return {config}(block=32)

def config_space(inv):
    return [{config}(block=16), {config}(block=32)]

def flash_attention_conv(*, cfg, **kw):
    CALLS.append(("run", cfg))
    return flash_attention_reference(**kw)
"""

VJP = """
def flash_attention_conv_fwd(*, cfg, **kw):
    CALLS.append(("fwd", cfg))
    arrays = {k: v for k, v in kw.items() if v is not None and hasattr(v, "shape")}
    return flash_attention_reference(**kw), arrays

def flash_attention_conv_bwd(arrays, d_out, *, cfg, **statics):
    import jax
    CALLS.append(("bwd", cfg))
    diff = {k: v for k, v in arrays.items() if k in ("query", "key", "value")}
    rest = {k: v for k, v in arrays.items() if k not in diff}
    _, vjp = jax.vjp(lambda d: flash_attention_reference(**d, **rest, **statics), diff)
    return vjp(d_out)[0]
"""


@pytest.fixture
def conv(tmp_path, monkeypatch):
    """Write module ``conv_ops`` (the text given) and register it with register_module."""
    monkeypatch.setenv("EJKERNEL_PLUGINS_AUTOLOAD", "0")
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(source: str, priority: int = 50) -> None:
        (tmp_path / "conv_ops.py").write_text(textwrap.dedent(source))
        sys.modules.pop("conv_ops", None)
        get_registry().register_module(
            "flash_attention", "conv_ops", platform="conv", backend="any", priority=priority
        )

    yield install
    sys.modules.pop("conv_ops", None)


def _source(extra: str = "", config: str = "Config") -> str:
    return CONVENTIONAL.format(extra=extra, config=config)


def test_register_module_imports_nothing_until_first_use(conv):
    conv(_source())
    assert "conv_ops" not in sys.modules
    (impl,) = get_registry().implementations("flash_attention")
    assert impl.name == "conv_ops:flash_attention_conv" and "conv_ops" not in sys.modules
    q, k, v = attention_inputs(SHAPE)
    out = ejkernel.flash_attention(q, k, v, causal=True)
    assert_close(out, flash_attention_reference(q, k, v, causal=True))
    module = sys.modules["conv_ops"]
    assert [("run", module.Config(block=32))] == module.CALLS
    assert impl.get_supports() is None and impl.get_vjp() is None


def test_the_op_named_config_class_wins_over_config(conv):
    extra = "@attrs.frozen(kw_only=True)\nclass FlashAttentionConfig:\n    block: int = 8\n"
    conv(_source(extra, config="FlashAttentionConfig"))
    q, k, v = attention_inputs(SHAPE)
    sel = ejkernel.explain("flash_attention", q, k, v)
    assert type(sel.config).__name__ == "FlashAttentionConfig" and sel.config.block == 32


def test_forward_and_backward_are_found_by_name_and_get_the_forwards_config(conv):
    conv(_source(VJP))
    q, k, v = attention_inputs(SHAPE)
    grads = jax.grad(lambda q, k: ejkernel.flash_attention(q, k, v).sum(), argnums=(0, 1))(q, k)
    expected = jax.grad(lambda q, k: flash_attention_reference(q, k, v).sum(), argnums=(0, 1))(q, k)
    assert_close(grads, expected)
    calls = sys.modules["conv_ops"].CALLS
    assert [c[0] for c in calls] == ["fwd", "bwd"] and calls[0][1] == calls[1][1]


def test_a_missing_implementation_names_the_module_and_the_name(conv):
    conv("VALUE = 1\n")
    (impl,) = get_registry().implementations("flash_attention")
    with pytest.raises(AttributeError, match="'conv_ops' defines no flash_attention_conv"):
        impl.fn  # noqa: B018


def test_a_heuristic_without_a_config_class_is_an_error(conv):
    conv("def heuristic(inv):\n    return None\n\ndef flash_attention_conv(**kw):\n    pass\n")
    (impl,) = get_registry().implementations("flash_attention")
    with pytest.raises(ConfigError, match="defines heuristic but no config class"):
        impl.config_type  # noqa: B018


def test_a_flash_attention_implementation_serves_scaled_dot_product_attention(toy):
    q, k, v = attention_inputs(SHAPE)
    sel = ejkernel.explain("scaled_dot_product_attention", q, k, v, causal=True)
    assert sel.platform == "toy" and sel.config == toy.ToyConfig(block=32)
    assert sel.implementation.endswith(":flash_attention_toy")

    def loss(q, k, v):
        return ejkernel.scaled_dot_product_attention(q, k, v, causal=True).sum()

    def ref(q, k, v):
        return flash_attention_reference(q, k, v, causal=True).sum()

    out = ejkernel.scaled_dot_product_attention(q, k, v, causal=True)
    assert_close(out, flash_attention_reference(q, k, v, causal=True))
    toy.CALLS.clear()
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert_close(grads, jax.grad(ref, argnums=(0, 1, 2))(q, k, v))
    assert [c[0] for c in toy.CALLS] == ["fwd", "bwd"]


def test_the_served_implementation_sees_the_flash_only_arguments_at_their_defaults(toy):
    seen = []
    (impl,) = get_registry().implementations("scaled_dot_product_attention")
    impl.served_from.source._loaded["supports"] = lambda inv: seen.append(dict(inv.kwargs)) or True
    impl._loaded.pop("supports", None)
    q, k, v = attention_inputs(SHAPE)
    ejkernel.explain("scaled_dot_product_attention", q, k, v)
    assert seen and seen[0]["dropout_prob"] == 0.0 and seen[0]["softmax_aux"] is None


def test_a_platforms_own_registration_wins_over_the_served_one(toy):
    registry = get_registry()
    registry.register("scaled_dot_product_attention", platform="toy", backend="any", priority=5)(
        lambda *, cfg, **kw: flash_attention_reference(**kw) * 0 + 3
    )
    (impl,) = registry.implementations("scaled_dot_product_attention")
    assert impl.served_from is None and impl.priority == 5
    q, k, v = attention_inputs(SHAPE)
    assert float(ejkernel.scaled_dot_product_attention(q, k, v)[0, 0, 0, 0]) == 3.0
