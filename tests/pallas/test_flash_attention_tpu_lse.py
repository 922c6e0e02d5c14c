"""The Pallas TPU flash attention's (out, lse) step of ring attention (``ejkernel.plugins.deflse``)
in TPU interpret mode, against the XLA step (:func:`ejkernel.testing.check_lse_step`). On a TPU
the ring's steps select it."""

from __future__ import annotations

import pytest

from ejkernel.ops import BwdParams, FwdParams
from ejkernel.testing import check_lse_step
from ejkernel_pallas._attention import FlashAttentionConfig

SMALL = FlashAttentionConfig(
    fwd_params=FwdParams(q_blocksize=16, kv_blocksize=128),
    bwd_params=BwdParams(q_blocksize=16, kv_blocksize=128),
)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")


@pytest.mark.slow
def test_pallas_step_matches_the_xla_step_and_takes_merged_statistics() -> None:
    check_lse_step("pallas", SMALL)
