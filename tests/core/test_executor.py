"""The executor: selection, config tiers with provenance, VJP wiring, jit/vmap composition."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import pytest

import ejkernel
from ejkernel.errors import ConfigError, NoImplementationError
from ejkernel.ops import ConfigCache, overlay_cache, policy_override
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import AttentionShape, assert_close, attention_inputs

SHAPE = AttentionShape(b=2, sq=37, sk=37, hq=4, hkv=2, d=16)


def test_call_runs_the_highest_priority_implementation_with_its_heuristic(toy):
    q, k, v = attention_inputs(SHAPE)
    out = ejkernel.flash_attention(q, k, v, causal=True)
    assert_close(out, flash_attention_reference(q, k, v, causal=True))
    assert [("run", toy.ToyConfig(block=32))] == toy.CALLS
    sel = ejkernel.explain("flash_attention", q, k, v, causal=True)
    assert (sel.platform, sel.source, sel.origin) == ("toy", "memory", "heuristic")


def test_explain_runs_nothing_and_reports_the_heuristic(toy):
    q, k, v = attention_inputs(SHAPE)
    sel = ejkernel.explain(ejkernel.flash_attention, q, k, v)
    assert (
        sel.platform == "toy"
        and sel.source == "heuristic"
        and sel.config == toy.ToyConfig(block=32)
    )
    assert toy.CALLS == []
    assert "toy" in str(sel)


def test_explain_with_shape_dtype_structs_keys_as_the_arrays_do(toy):
    q, k, v = attention_inputs(SHAPE)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    before = ejkernel.explain("flash_attention", *abstract, causal=True)
    assert before.key == ejkernel.explain("flash_attention", q, k, v, causal=True).key
    assert before.source == "heuristic"
    ejkernel.flash_attention(q, k, v, causal=True)
    after = ejkernel.explain("flash_attention", *abstract, causal=True)
    assert (after.source, after.key) == ("memory", before.key)
    half = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in (q, k, v)]
    assert ejkernel.explain("flash_attention", *half, causal=True).key != before.key


def test_override_applies_to_one_call_and_is_never_cached(toy):
    q, k, v = attention_inputs(SHAPE)
    ejkernel.flash_attention(q, k, v, cfg=toy.ToyConfig(block=16))
    assert toy.CALLS[-1] == ("run", toy.ToyConfig(block=16))
    assert ejkernel.explain("flash_attention", q, k, v).source == "heuristic"
    assert (
        ejkernel.explain("flash_attention", q, k, v, cfg=toy.ToyConfig(block=16)).source
        == "override"
    )


def test_overlay_beats_the_memory_cache_and_is_scoped(toy):
    q, k, v = attention_inputs(SHAPE)
    ejkernel.flash_attention(q, k, v)
    with overlay_cache({"flash_attention": toy.ToyConfig(block=16)}):
        assert ejkernel.explain("flash_attention", q, k, v).source == "overlay"
        ejkernel.flash_attention(q, k, v)
        assert toy.CALLS[-1] == ("run", toy.ToyConfig(block=16))
    assert ejkernel.explain("flash_attention", q, k, v).source == "memory"


def test_overlay_with_a_config_cache_keyed_by_invocation(toy):
    q, k, v = attention_inputs(SHAPE)
    key = ejkernel.explain("flash_attention", q, k, v).key
    cache = ConfigCache()
    cache.put(key, toy.ToyConfig(block=64))
    with overlay_cache(cache):
        sel = ejkernel.explain("flash_attention", q, k, v)
    assert (sel.source, sel.config) == ("overlay", toy.ToyConfig(block=64))


def test_autotune_inside_jit_tunes_outside_the_trace_and_persists(toy, monkeypatch):
    q, k, v = attention_inputs(SHAPE)
    with policy_override(autotune=True):
        out = jax.jit(lambda q, k, v: ejkernel.flash_attention(q, k, v))(q, k, v)
    assert_close(out, flash_attention_reference(q, k, v))
    sel = ejkernel.explain("flash_attention", q, k, v)
    assert sel.source == "memory" and sel.origin == "autotune"
    ejkernel._executor._default = None  # a new process: only the persistent tier remains
    sel = ejkernel.explain("flash_attention", q, k, v)
    assert sel.source == "persistent" and sel.origin == "autotune"


def test_heuristic_in_memory_never_blocks_a_later_autotune(toy):
    q, k, v = attention_inputs(SHAPE)
    ejkernel.flash_attention(q, k, v)
    assert ejkernel.explain("flash_attention", q, k, v).origin == "heuristic"
    with policy_override(autotune=True):
        ejkernel.flash_attention(q, k, v)
    assert ejkernel.explain("flash_attention", q, k, v).origin == "autotune"


def test_heuristics_policy_still_honours_cfg(toy, monkeypatch):
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
    q, k, v = attention_inputs(SHAPE)
    ejkernel.flash_attention(q, k, v, cfg=toy.ToyConfig(block=16))
    assert toy.CALLS[-1] == ("run", toy.ToyConfig(block=16))


def test_gradients_flow_through_the_implementations_fwd_and_bwd(toy):
    q, k, v = attention_inputs(SHAPE)
    bias = jax.random.normal(jax.random.PRNGKey(3), (1, SHAPE.hq, SHAPE.sq, SHAPE.sk))

    def loss(fn, q, k, v, bias):
        return jnp.sum(fn(q, k, v, bias=bias, causal=True) ** 2)

    got = jax.grad(lambda *a: loss(ejkernel.flash_attention, *a), argnums=(0, 1, 2, 3))(
        q, k, v, bias
    )
    want = jax.grad(lambda *a: loss(flash_attention_reference, *a), argnums=(0, 1, 2, 3))(
        q, k, v, bias
    )
    assert_close(got, want)
    assert [c[0] for c in toy.CALLS] == ["fwd", "bwd"]


def test_jit_vmap_and_grad_compose(toy):
    q, k, v = attention_inputs(SHAPE)
    f = jax.jit(
        jax.vmap(
            jax.grad(lambda q, k, v: ejkernel.flash_attention(q[None], k[None], v[None]).sum())
        )
    )
    g = jax.vmap(
        jax.grad(lambda q, k, v: flash_attention_reference(q[None], k[None], v[None]).sum())
    )
    assert_close(f(q, k, v), g(q, k, v))


def test_forced_platform_that_cannot_run_names_the_reason(toy):
    q, k, v = attention_inputs(SHAPE)
    with pytest.raises(NoImplementationError, match="toy does not do dropout") as info:
        ejkernel.flash_attention(q, k, v, dropout_prob=0.5, platform="toy")
    assert info.value.rejected == {"toy": "toy does not do dropout"}
    with pytest.raises(ValueError, match=r"installed: toy.*install ejkernel-triton"):
        ejkernel.flash_attention(q, k, v, platform="triton")


def test_no_candidate_lists_every_rejection_and_what_to_install(toy):
    q, k, v = attention_inputs(SHAPE)
    with pytest.raises(NoImplementationError) as info:
        ejkernel.flash_attention(q, k, v, dropout_prob=0.5)
    message = str(info.value)
    assert "toy: toy does not do dropout" in message and "ejkernel-xla" in message


def test_environment_platform_is_read_at_call_time(toy, monkeypatch):
    q, k, v = attention_inputs(SHAPE)
    monkeypatch.setenv("EJKERNEL_PLATFORM", "nowhere")
    with pytest.raises(NoImplementationError, match="EJKERNEL_PLATFORM=nowhere"):
        ejkernel.flash_attention(q, k, v)
    monkeypatch.delenv("EJKERNEL_PLATFORM")
    ejkernel.flash_attention(q, k, v)


def test_a_config_that_does_not_fit_is_a_clear_error(toy):
    q, k, v = attention_inputs(SHAPE)
    with pytest.raises(ConfigError, match="`cfg` must be a ToyConfig"):
        ejkernel.flash_attention(q, k, v, cfg="big blocks")


def test_bad_input_is_rejected_before_any_kernel_runs(toy):
    q, k, v = attention_inputs(SHAPE)
    bad_k = jnp.ones((2, 37, 3, 16))
    with pytest.raises(
        ValueError,
        match=r"`key` must be \[B, Sk, Hkv, D\] with Hq % Hkv == 0; got key.shape=\(2, 37, 3, 16\)",
    ):
        ejkernel.flash_attention(q, bad_k, v)
    with pytest.raises(TypeError, match="`attention_mask` must be bool"):
        ejkernel.flash_attention(q, k, v, attention_mask=jnp.ones((37, 37)))
    with pytest.raises(ValueError, match="`sliding_window` must be non-negative"):
        ejkernel.flash_attention(q, k, v, sliding_window=(-1, 3))
    with pytest.raises(TypeError, match="`sliding_window` must be an int or"):
        ejkernel.flash_attention(q, k, v, sliding_window=(1, 2, 3))
    with pytest.raises(ValueError, match="`dropout_prob` must be in"):
        ejkernel.flash_attention(q, k, v, dropout_prob=1.5)
    with pytest.raises(ValueError, match="given together"):
        ejkernel.flash_attention(q, k, v, q_segment_ids=jnp.zeros((2, 37), jnp.int32))
    with pytest.raises(TypeError, match="`query` must be an array"):
        ejkernel.flash_attention([[1.0]], k, v)
    assert toy.CALLS == []


def test_autotune_inside_jit_builds_synthetic_inputs_outside_the_trace(toy):
    q = attention_inputs(SHAPE, jnp.bfloat16)[0]
    mask = jnp.tril(jnp.ones((SHAPE.sq, SHAPE.sk), bool))
    with policy_override(autotune=True):
        out = jax.jit(lambda q, m: ejkernel.flash_attention(q, q, q, attention_mask=m))(q, mask)
    assert_close(out, flash_attention_reference(q, q, q, attention_mask=mask))
    assert ejkernel.explain("flash_attention", q, q, q, attention_mask=mask).origin == "autotune"


@contextlib.contextmanager
def no_implicit_host_to_device():
    """Implicit host-to-device copies raise (explicit ``jax.device_put`` is allowed)."""
    before = jax.config.jax_transfer_guard_host_to_device
    jax.config.update("jax_transfer_guard_host_to_device", "disallow")
    try:
        yield
    finally:
        jax.config.update("jax_transfer_guard_host_to_device", before)


@pytest.mark.parametrize("grad", [False, True])
def test_autotune_times_candidates_on_inputs_already_on_the_device(toy, grad):
    # Synthetic inputs are NumPy; passed as they are, each timed call would copy them to the
    # device first (tens of ms at attention sizes on a GPU), and the pick would be noise.
    q, k, v = attention_inputs(SHAPE)

    def f(q, k, v):
        return ejkernel.flash_attention(q, k, v, causal=True)

    fn = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2)) if grad else f)
    with policy_override(autotune=True), no_implicit_host_to_device():
        out = fn(q, k, v)
    assert ejkernel.explain("flash_attention", q, k, v, causal=True, grad=grad).origin == (
        "autotune"
    )
    want = (
        jax.grad(lambda *a: jnp.sum(flash_attention_reference(*a, causal=True) ** 2))(q, k, v)
        if grad
        else flash_attention_reference(q, k, v, causal=True)
    )
    assert_close(out, want)


def test_memoised_eager_dispatch_follows_cache_changes(toy):
    q, k, v = attention_inputs(SHAPE)
    ejkernel.flash_attention(q, k, v)
    ejkernel.flash_attention(q, k, v)
    assert toy.CALLS[-1] == ("run", toy.ToyConfig(block=32))
    key = ejkernel.explain("flash_attention", q, k, v).key
    ejkernel._executor.default_executor().selector.cache.put(key, toy.ToyConfig(block=64))
    ejkernel.flash_attention(q, k, v)
    assert toy.CALLS[-1] == ("run", toy.ToyConfig(block=64))
    ejkernel.flash_attention(q, k, v, cfg=toy.ToyConfig(block=16))
    assert toy.CALLS[-1] == ("run", toy.ToyConfig(block=16))
    ejkernel.flash_attention(q, k, v)
    assert toy.CALLS[-1] == ("run", toy.ToyConfig(block=64))
