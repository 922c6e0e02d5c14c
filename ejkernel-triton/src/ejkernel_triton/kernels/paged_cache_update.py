"""Triton scatter of new tokens into a paged KV cache, in place (``ragged_page_attention_v3``'s
cache update).

Layout (OPS.md): new ``keys``/``values`` ``[T, Hkv, D]`` already in the cache dtype (quantised
by the caller); ``key_cache``/``value_cache`` ``[num_pages, page_size, Hkv, D]``; ``Dest [T]``
int32, token ``t``'s slot ``page · page_size + slot`` or ``-1`` where it is not written. A
token's row of ``Hkv · D`` elements is contiguous in both, so program ``(t, j)`` copies the
``j``-th ``BLOCK`` elements of row ``t``. The outputs ``KOut``/``VOut`` alias the caches
(jax-triton's ``input_output_aliases``): only the ``T`` rows are written, the rest of each
cache is the input buffer itself.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_tokens_kernel(
    Keys,
    Values,
    KCache,
    VCache,
    Dest,
    KOut,
    VOut,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Copy row ``program_id(0)`` of ``Keys``/``Values`` to its slot of ``KOut``/``VOut``
    (``KCache``/``VCache``: the same buffers as the outputs, not read)."""
    t = tl.program_id(0)
    dest = tl.load(Dest + t)
    if dest < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < ROW
    src = t.to(tl.int64) * ROW + offs
    dst = dest.to(tl.int64) * ROW + offs
    tl.store(KOut + dst, tl.load(Keys + src, mask=keep), mask=keep)
    tl.store(VOut + dst, tl.load(Values + src, mask=keep), mask=keep)
