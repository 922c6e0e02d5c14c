"""AutotunePolicy: the chain's own policy, policy_override in every form, forward_autotune_only."""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
import pytest

import ejkernel
from ejkernel.errors import ConfigError
from ejkernel.modules import FlashAttention
from ejkernel.ops import (
    AutotunePolicy,
    ConfigSelectorChain,
    Executor,
    PersistentCache,
    forward_autotune_only,
    policy_override,
)
from ejkernel.plugins import get_registry


def test_the_policy_and_its_names():
    assert AutotunePolicy().tunes and AutotunePolicy().name == "autotune"
    heuristics = AutotunePolicy.named("heuristics")
    assert not heuristics.tunes and heuristics.name == "heuristics"
    assert not AutotunePolicy(allow_autotune=False).tunes
    assert not AutotunePolicy(cache_miss_fallback="heuristics").tunes
    with pytest.raises(ValueError):
        AutotunePolicy(cache_miss_fallback="sometimes")
    with pytest.raises(ValueError, match="policy must be"):
        AutotunePolicy.named("always")
    assert hash(AutotunePolicy()) == hash(AutotunePolicy())  # memos key on it


def test_a_chain_policy_beats_the_environment_and_overrides_beat_the_chain(monkeypatch):
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    assert ConfigSelectorChain(persistent=False).policy() == AutotunePolicy()
    assert not ConfigSelectorChain(persistent=False, autotune=False).policy().tunes
    chain = ConfigSelectorChain(persistent=False, policy=AutotunePolicy(allow_heuristics=False))
    assert chain.policy() == AutotunePolicy(allow_heuristics=False)
    with policy_override(autotune=False):
        assert chain.policy() == AutotunePolicy(
            allow_autotune=False, allow_heuristics=False, cache_miss_fallback="heuristics"
        )
        with policy_override(allow_heuristics=True):  # nested: one field on top
            assert chain.policy() == AutotunePolicy.named("heuristics")
    with policy_override(AutotunePolicy(use_shipped=False)):
        assert chain.policy() == AutotunePolicy(use_shipped=False)
    with policy_override(policy=AutotunePolicy(autotune_backward=False), use_shipped=False):
        assert chain.policy() == AutotunePolicy(autotune_backward=False, use_shipped=False)
    assert chain.policy() == AutotunePolicy(allow_heuristics=False)
    with pytest.raises(TypeError, match="policy must be an AutotunePolicy"):
        ConfigSelectorChain(persistent=False, policy="heuristics")


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        ((), {"policy": "sometimes"}, ValueError),
        (("yes",), {}, TypeError),
        ((), {"policy": 3}, TypeError),
        ((), {"allow_everything": True}, TypeError),
        ((), {"cache_miss_fallback": "never"}, ValueError),
        ((AutotunePolicy(),), {"policy": AutotunePolicy()}, TypeError),
    ],
)
def test_policy_override_refuses_bad_arguments(args, kwargs, error):
    with pytest.raises(error), policy_override(*args, **kwargs):
        pass


def test_policy_override_of_one_chain_leaves_the_others_alone():
    mine, other = ConfigSelectorChain(persistent=False), ConfigSelectorChain(persistent=False)
    with policy_override(mine, policy="autotune", use_shipped=False):
        assert mine.policy() == AutotunePolicy(use_shipped=False)
        assert other.policy() == AutotunePolicy.named("heuristics")
    assert mine.policy() == AutotunePolicy.named("heuristics")


def test_policy_override_works_as_a_decorator():
    @policy_override(autotune=False)
    def inside():
        return ConfigSelectorChain(persistent=False).policy()

    assert inside() == AutotunePolicy.named("heuristics")
    assert inside() == AutotunePolicy.named("heuristics")  # reusable


def _explain(executor, toy_inputs, grad=False):
    spec = get_registry().spec("flash_attention")
    return executor.explain_op(spec, spec.bind(toy_inputs, {}), grad=grad)


def test_a_chain_that_may_tune_tunes_under_a_heuristics_environment(toy, tables):
    q, k, v = tables.inputs()
    executor = Executor(ConfigSelectorChain(policy=AutotunePolicy()))
    executor(FlashAttention(), q, k, v)
    assert _explain(executor, (q, k, v)).origin == "autotune"
    assert ejkernel.explain("flash_attention", q, k, v).source == "persistent"


def test_no_heuristics_and_no_tuning_is_a_config_error(toy, tables):
    q, k, v = tables.inputs()
    off = AutotunePolicy(allow_autotune=False, allow_heuristics=False)
    with policy_override(off), pytest.raises(ConfigError, match="heuristics are off"):
        ejkernel.flash_attention(q, k, v)
    with policy_override(autotune=True, allow_heuristics=False):
        ejkernel.flash_attention(q, k, v)
    assert ejkernel.explain("flash_attention", q, k, v).origin == "autotune"


def test_a_heuristic_in_memory_does_not_answer_when_heuristics_are_off(toy, tables):
    q, k, v = tables.inputs()
    ejkernel.flash_attention(q, k, v)  # the heuristic, remembered
    assert ejkernel.explain("flash_attention", q, k, v).origin == "heuristic"
    with policy_override(allow_heuristics=False), pytest.raises(ConfigError):
        ejkernel.flash_attention(q, k, v)


def test_eager_dispatch_is_memoised_per_policy(toy, tables, tmp_path):
    q, k, v = tables.inputs()
    tables.ship(
        tmp_path / "t.json", tables.entry(tables.key_document((q, k, v)), toy.ToyConfig(block=16))
    )
    ejkernel.flash_attention(q, k, v)
    with policy_override(use_shipped=False):
        ejkernel.flash_attention(q, k, v)
    ejkernel.flash_attention(q, k, v)
    shipped, heuristic = toy.ToyConfig(block=16), toy.ToyConfig(block=32)
    assert [c for _, c in toy.CALLS] == [shipped, heuristic, shipped]


def _loss(q, k, v):
    return jnp.sum(ejkernel.flash_attention(q, k, v, causal=True) ** 2)


def test_forward_autotune_only_tunes_the_forward_and_never_times_a_backward(toy, tables):
    q, k, v = tables.inputs()
    timed = []

    def counting_space(inv):
        timed.append(inv.grad)
        return toy.config_space(inv)

    toy.register_flash_attention(
        get_registry(),
        toy.flash_attention_toy,
        platform="toy",
        priority=50,
        config_space=counting_space,
    )
    with policy_override(autotune=True), forward_autotune_only():
        jax.grad(_loss)(q, k, v)
        sel = ejkernel.explain("flash_attention", q, k, v, causal=True, grad=True)
    assert timed == [False]  # one tuning, of the forward
    fwd = ejkernel.explain("flash_attention", q, k, v, causal=True)
    assert (fwd.source, fwd.origin) == ("memory", "autotune")
    assert (sel.source, sel.origin, sel.config) == ("memory", "forward", fwd.config)
    assert [c for name, c in toy.CALLS if name in ("fwd", "bwd")] == [fwd.config, fwd.config]
    keys = {e["key"]["grad"] for e in PersistentCache().entries().values()}
    assert keys == {False}  # nothing stored for the differentiated call
    assert (
        ejkernel.explain("flash_attention", q, k, v, causal=True, grad=True).source == "heuristic"
    )


def test_forward_autotune_only_as_a_decorator_with_and_without_parentheses():
    def policy():
        return ConfigSelectorChain(persistent=False).policy().autotune_backward

    assert forward_autotune_only(policy)() is False
    assert forward_autotune_only()(policy)() is False
    assert policy() is True
    with pytest.raises(TypeError, match="expected a function"):
        forward_autotune_only(3)


def test_overrides_leave_no_state_behind_in_other_threads():
    with (
        policy_override(autotune=True),
        forward_autotune_only(),
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        other = pool.submit(lambda: ConfigSelectorChain(persistent=False).policy()).result()
    assert other == AutotunePolicy.named("heuristics")  # the conftest's environment
