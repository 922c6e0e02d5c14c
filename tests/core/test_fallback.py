"""Selection falls back when the chosen platform fails while traced; `platform=` is checked."""

from __future__ import annotations

import types
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import ejkernel
from ejkernel.errors import FallbackWarning, PluginWarning
from ejkernel.plugins import defvjp, hookimpl, register_plugin
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import AttentionShape, assert_close, attention_inputs

SHAPE = AttentionShape(b=2, sq=37, sk=37, hq=4, hkv=2, d=16)


def broken_plugin(*, fail_in: str) -> tuple[types.SimpleNamespace, list[str]]:
    """A platform "broken" above the toy's priority whose primal (``fail_in="primal"``),
    VJP forward (``"fwd"``) or backward (``"bwd"``) raises NotImplementedError when traced;
    returns the plugin and the list of its traced pieces."""
    traced: list[str] = []

    def piece(name: str) -> None:
        traced.append(name)
        if name == fail_in:
            raise NotImplementedError(f"broken {name}: unsupported sequence length")

    def flash_attention_broken(*, cfg: Any, **kw: Any) -> jax.Array:
        piece("primal")
        return flash_attention_reference(**kw)

    def fwd(*, cfg: Any, **kw: Any) -> tuple[jax.Array, Any]:
        piece("fwd")
        return flash_attention_reference(**kw), kw

    def bwd(kw: dict[str, Any], d_out: jax.Array, *, cfg: Any, **statics: Any) -> Any:
        piece("bwd")
        diff = {k: kw[k] for k in ("query", "key", "value")}
        rest = {k: v for k, v in kw.items() if k not in diff}
        return jax.vjp(lambda d: flash_attention_reference(**d, **rest), diff)[1](d_out)[0]

    defvjp(flash_attention_broken, fwd, bwd)

    @hookimpl
    def ejkernel_api_version() -> int:
        return 1

    @hookimpl
    def ejkernel_register(registry: Any) -> None:
        registry.register("flash_attention", platform="broken", backend="any", priority=90)(
            flash_attention_broken
        )

    plugin = types.SimpleNamespace(
        ejkernel_api_version=ejkernel_api_version, ejkernel_register=ejkernel_register
    )
    return plugin, traced


@pytest.fixture
def broken(toy):
    plugin, traced = broken_plugin(fail_in="primal")
    register_plugin(plugin, name="broken")
    return traced


def fallback_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, PluginWarning)]


# -- platform= -------------------------------------------------------------------------------


def test_platform_of_the_wrong_type_is_a_type_error_naming_it(toy):
    q, k, v = attention_inputs(SHAPE)
    with pytest.raises(TypeError, match="`platform` must be a str or None; got int"):
        ejkernel.flash_attention(q, k, v, platform=123)
    with pytest.raises(TypeError, match="`platform`"):
        ejkernel.explain("flash_attention", q, k, v, platform=123)
    assert toy.CALLS == []


def test_an_unknown_platform_lists_the_installed_ones(broken):
    q, k, v = attention_inputs(SHAPE)
    with pytest.raises(ValueError, match=r"'nowhere' is not installed .*installed: broken, toy"):
        ejkernel.flash_attention(q, k, v, platform="nowhere")
    with pytest.raises(ValueError, match="install ejkernel-triton"):
        ejkernel.explain("flash_attention", q, k, v, platform="triton")
    assert broken == []


# -- fallback --------------------------------------------------------------------------------


def test_eager_call_falls_back_warns_once_and_remembers(broken, toy):
    q, k, v = attention_inputs(SHAPE)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = ejkernel.flash_attention(q, k, v, causal=True)
        again = ejkernel.flash_attention(q, k, v, causal=True)
    assert_close(out, flash_attention_reference(q, k, v, causal=True))
    assert_close(again, out)
    assert broken == ["primal"]  # rejected once, never traced again for this call
    assert [c[0] for c in toy.CALLS] == ["run", "run"]
    (message,) = fallback_warnings(record)
    assert "flash_attention" in message and "'broken'" in message
    assert "NotImplementedError: broken primal: unsupported sequence length" in message
    sel = ejkernel.explain("flash_attention", q, k, v, causal=True)
    assert sel.platform == "toy"
    assert sel.rejected["broken"].startswith("failed while traced: NotImplementedError")
    assert "rejected broken: failed while traced" in str(sel)


def test_explain_before_the_call_still_shows_the_priority_choice(broken):
    q, k, v = attention_inputs(SHAPE)
    assert ejkernel.explain("flash_attention", q, k, v).platform == "broken"
    assert broken == []


def test_jit_falls_back_at_trace_time(broken, toy):
    q, k, v = attention_inputs(SHAPE)
    with pytest.warns(FallbackWarning, match="'broken' raised NotImplementedError"):
        out = jax.jit(lambda q, k, v: ejkernel.flash_attention(q, k, v) * 2)(q, k, v)
    assert_close(out, 2 * flash_attention_reference(q, k, v))
    jax.jit(lambda q, k, v: ejkernel.flash_attention(q, k, v) + 1)(q, k, v)
    assert broken == ["primal"]
    assert "broken" in ejkernel.explain("flash_attention", q, k, v).rejected


def test_a_failing_vjp_forward_falls_back_under_grad(toy):
    plugin, traced = broken_plugin(fail_in="fwd")
    register_plugin(plugin, name="broken")
    q, k, v = attention_inputs(SHAPE)

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v, causal=True) ** 2)

    with pytest.warns(PluginWarning, match="broken fwd"):
        grads = jax.jit(jax.grad(loss(ejkernel.flash_attention), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(flash_attention_reference), argnums=(0, 1, 2))(q, k, v)
    assert_close(grads, want)
    assert traced == ["fwd"] and [c[0] for c in toy.CALLS] == ["fwd", "bwd"]


def test_a_backward_failing_at_trace_time_raises_its_error(toy):
    # The backward is traced after the op call has returned: too late to choose again.
    plugin, _ = broken_plugin(fail_in="bwd")
    register_plugin(plugin, name="broken")
    q, k, v = attention_inputs(SHAPE)
    with pytest.raises(NotImplementedError, match="broken bwd"):
        jax.grad(lambda q: jnp.sum(ejkernel.flash_attention(q, k, v)))(q)


def test_one_warning_per_op_platform_and_reason(broken):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for sq in (37, 19):
            q, k, v = attention_inputs(AttentionShape(b=1, sq=sq, sk=sq, hq=2, hkv=2, d=16))
            ejkernel.flash_attention(q, k, v)
    assert broken == ["primal", "primal"]  # another invocation key is tried afresh
    assert len(fallback_warnings(record)) == 1


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_forced_platform_raises_the_original_error(broken, toy, monkeypatch, how):
    q, k, v = attention_inputs(SHAPE)
    kwargs = {"platform": "broken"} if how == "argument" else {}
    if how == "environment":
        monkeypatch.setenv("EJKERNEL_PLATFORM", "broken")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(NotImplementedError, match="broken primal"):
            ejkernel.flash_attention(q, k, v, **kwargs)
        with pytest.raises(NotImplementedError, match="broken primal"):
            jax.jit(lambda q: ejkernel.flash_attention(q, k, v, **kwargs))(q)
    assert fallback_warnings(record) == [] and toy.CALLS == []


def test_the_last_runnable_platform_raises_its_own_error(broken, toy):
    q, k, v = attention_inputs(SHAPE)  # the toy declines dropout: "broken" is the only one
    for _ in range(2):
        with pytest.raises(NotImplementedError, match="broken primal"):
            ejkernel.flash_attention(q, k, v, dropout_prob=0.5)
    assert broken == ["primal", "primal"] and toy.CALLS == []


def test_bad_input_raises_before_selection_and_fallback(broken, toy):
    q, k, v = attention_inputs(SHAPE)
    with pytest.raises(ValueError, match="`dropout_prob` must be in"):
        ejkernel.flash_attention(q, k, v, dropout_prob=1.5)
    assert broken == [] and toy.CALLS == []
