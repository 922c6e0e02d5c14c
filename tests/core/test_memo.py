"""The memo policy: memoised selections are keyed by everything they read, so a change of the
environment or of the registry takes effect without anything being forgotten by hand."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import ejkernel
from ejkernel import env
from ejkernel._memo import Memo
from ejkernel.plugins import get_registry, hookimpl, register_plugin


def _impl(value: float):
    def run(*, cfg, **kw):
        return jnp.zeros(kw["query"].shape, kw["query"].dtype) + value

    return run


class _Plugin:
    """Platform "probe": available only under EJKERNEL_INTERPRET=1, priority above xla."""

    @hookimpl
    def ejkernel_api_version(self):
        return 1

    @hookimpl
    def ejkernel_register(self, registry):
        registry.add_platform("probe", available=self.available)
        registry.register("flash_attention", platform="probe", backend="any", priority=9)(
            _impl(7.0)
        )

    @staticmethod
    def available(backend):
        return True if env.interpret() else f"set {env.INTERPRET}=1"


def _q():
    return (jnp.ones((1, 5, 2, 8)),) * 3


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.setenv("EJKERNEL_PLUGINS_AUTOLOAD", "0")
    monkeypatch.delenv("EJKERNEL_INTERPRET", raising=False)
    register_plugin(_Plugin(), name="probe")
    get_registry().register("flash_attention", platform="base", backend="any")(_impl(1.0))


def test_a_changed_environment_changes_the_selection_without_a_reset(probe, monkeypatch):
    assert float(ejkernel.flash_attention(*_q())[0, 0, 0, 0]) == 1.0
    assert (
        ejkernel.explain("flash_attention", *_q()).rejected["probe"] == "set EJKERNEL_INTERPRET=1"
    )
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")
    assert float(ejkernel.flash_attention(*_q())[0, 0, 0, 0]) == 7.0
    monkeypatch.setenv("EJKERNEL_PLATFORM", "base")
    assert float(ejkernel.flash_attention(*_q())[0, 0, 0, 0]) == 1.0


def test_a_new_registration_changes_the_selection_without_a_reset(probe, monkeypatch):
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")
    assert float(ejkernel.flash_attention(*_q())[0, 0, 0, 0]) == 7.0
    get_registry().register("flash_attention", platform="late", backend="any", priority=99)(
        _impl(5.0)
    )
    assert float(ejkernel.flash_attention(*_q())[0, 0, 0, 0]) == 5.0


def test_a_memo_is_bounded_and_cleared_when_full():
    memo: Memo[int] = Memo(limit=3)
    for i in range(3):
        memo.put(i, i)
    assert len(memo) == 3 and memo.get(2) == 2
    memo.put(3, 3)
    assert len(memo) == 1 and memo.get(0) is None and memo.get(3) == 3
