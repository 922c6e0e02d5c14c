"""A kernel that applies the flash attention kernels' ``_visible`` to a tile of scores, so
``test_visibility.py`` can compare it with ``ejkernel.attention_semantics.visible``."""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.flash_attention_common import _visible


@triton.jit
def visibility_probe_kernel(
    S,
    Mask,
    QSeg,
    KSeg,
    q_pos_offset,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    Out,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_SEG: tl.constexpr,
):
    qi = tl.arange(0, BLOCK_Q)[:, None]
    kj = tl.arange(0, BLOCK_K)[None, :]
    s = tl.load(S + qi * BLOCK_K + kj)
    geo = (q_pos_offset, seqlen_q, seqlen_k, window_left, window_right)
    masks = ((Mask, 0, 0), (Mask, BLOCK_K, 1), (QSeg, KSeg))  # no bias; the mask row-major
    s = _visible(s, qi, kj, geo, masks, True, (CAUSAL, WINDOW, False, HAS_MASK, HAS_SEG))
    tl.store(Out + qi * BLOCK_K + kj, s)
