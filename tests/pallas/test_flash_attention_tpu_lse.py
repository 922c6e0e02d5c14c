"""The Pallas TPU flash attention's (out, lse) step of ring attention (``ejkernel.plugins.deflse``)
in TPU interpret mode, against the XLA step (:func:`ejkernel.testing.check_lse_step`). On a TPU
the ring's steps select it."""

from __future__ import annotations

import pytest
from tests.pallas.test_flash_attention_tpu import SMALL

from ejkernel.testing import check_lse_step


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")


@pytest.mark.slow
def test_pallas_step_matches_the_xla_step_and_takes_merged_statistics() -> None:
    check_lse_step("pallas", SMALL)
