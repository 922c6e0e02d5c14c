"""The Triton flash attention's (out, lse) step of ring attention (``ejkernel.plugins.deflse``)
against the XLA step, in Triton's interpreter and on the GPU
(:func:`ejkernel.testing.check_lse_step`: the lse in natural log and ``[B, Sq, Hq]``, empty rows
at ``EMPTY_ROW_LSE``, gradients from the merged statistics of a two-part softmax)."""

from __future__ import annotations

import pytest

from ejkernel.ops import BwdParams, FwdParams
from ejkernel.testing import check_lse_step

pytest.importorskip("triton")

from ejkernel_triton.ops.flash_attention import FlashAttentionConfig

SMALL = FlashAttentionConfig(
    fwd_params=FwdParams(q_blocksize=16, kv_blocksize=16, num_warps=4, num_stages=1),
    bwd_params=BwdParams(q_blocksize=16, kv_blocksize=32, num_warps=4, num_stages=1),
)


def test_triton_step_matches_the_xla_step_and_takes_merged_statistics(mode: str) -> None:
    check_lse_step("triton", SMALL if mode == "interpret" else None, batch=2)
