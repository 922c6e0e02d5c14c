"""Config spaces with and without a shared-memory limit (``EJKERNEL_SHARED_MEMORY_LIMIT``), and
the configs tuning runs under one."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest


def spaces_with_and_without_limit(
    monkeypatch: pytest.MonkeyPatch, config_space: Callable[[], list[Any]], limit: int
) -> tuple[list[Any], list[Any]]:
    """``(every, kept)``: ``config_space()`` with no shared-memory limit, then with ``limit``
    bytes per block."""
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", "none")
    every = config_space()
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", str(limit))
    return every, config_space()


def configs_tuning_runs(
    monkeypatch: pytest.MonkeyPatch,
    heuristic: Callable[[Any], Any],
    config_space: Callable[[Any], list[Any]],
    call: Callable[..., dict[str, Any]],
    *arrays: Any,
) -> list[Any]:
    """The configs the seed's tuning path (executor, chain, autotuner) runs, in order, for a
    kernel on ``arrays`` that offers ``heuristic`` and ``config_space`` of the differentiated
    call of arguments ``call(*arrays)``."""
    from ejkernel.ops import ConfigSelectorChain, Executor, Kernel

    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    ran: list[Any] = []

    class Spy(Kernel):
        def call(self, inv: Any) -> Any:
            return types.SimpleNamespace(kwargs=call(*inv.args), grad=True)

        def heuristic_cfg(self, inv: Any) -> Any:
            return heuristic(self.call(inv))

        def config_space(self, inv: Any) -> list[Any]:
            return config_space(self.call(inv))

        def run(self, *arrays: Any, cfg: Any) -> Any:
            ran.append(cfg)
            return arrays[0].sum()

    Executor(ConfigSelectorChain(persistent=False))(Spy(), *arrays)
    return ran
