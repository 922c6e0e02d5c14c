"""The XLA plugin's registration: every op, found by convention, declining no valid call."""

from __future__ import annotations

from ejkernel.plugins import get_registry
from ejkernel_xla.plugin import OPS


def test_every_op_is_registered_and_serves_every_valid_call() -> None:
    registry = get_registry()
    for op in (*OPS, "scaled_dot_product_attention"):
        (impl,) = [i for i in registry.implementations(op) if i.platform == "xla"]
        assert impl.backends == ("any",) and impl.fn is not None
        assert impl.get_supports() is None, f"{op}: the XLA fallback must decline nothing"


def test_flash_attention_serves_scaled_dot_product_attention() -> None:
    registry = get_registry()
    (sdpa,) = [
        i for i in registry.implementations("scaled_dot_product_attention") if i.platform == "xla"
    ]
    assert sdpa.name == "ejkernel_xla.ops.flash_attention:flash_attention_xla"
    assert sdpa.config_type.__name__ == "FlashAttentionConfig" and sdpa.get_vjp() is not None
