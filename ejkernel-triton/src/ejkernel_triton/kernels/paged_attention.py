"""Triton unified paged attention: one kernel for a ragged batch of decode tokens and prefill
chunks over a paged KV cache (vLLM's unified attention layout), forward only.

Layout (OPS.md): packed ``queries [T, Hq, D]``; ``key_cache``/``value_cache``
``[num_pages, page_size, Hkv, D]``; ``block_tables [rows, max_pages]``; ``query_start_loc
[rows + 1]``; ``kv_lens [rows]``. Sequence ``s``'s ``q_len`` queries are its last tokens: query
``i`` sits at key position ``kv_len - q_len + i`` (bottom-right causal).

- A program serves ``BLOCK_Q`` query tokens of one sequence times the ``GROUP`` query heads of
  one KV head: ``BLOCK_M = BLOCK_Q · GROUP_PAD`` rows (row ``r`` is token ``r // GROUP_PAD``,
  head ``r % GROUP_PAD`` of the group), so each K/V tile is read once for the whole GQA group
  and never repeated in memory. Grid ``(T // BLOCK_Q + rows, Hkv, NUM_SPLITS)``: sequence ``s``
  owns the query blocks from ``query_start_loc[s] // BLOCK_Q + s`` on (a bound on the blocks of
  the sequences before it), found by a binary search; blocks past a sequence's queries exit.
  A decode batch of one query per sequence (``DECODE``) takes grid ``(rows, Hkv, NUM_SPLITS)``
  and no search.
- Keys are gathered per tile through the block table (one page id per tile when a tile lies
  within a page, else one per key), page ids clamped to ``[0, num_pages)``; table slots past a
  sequence's live pages are never read (their loads are masked).
- The key walk is flash attention's (:mod:`ejkernel_triton.kernels.flash_attention_common`):
  log2-domain scores, :data:`MASK_VALUE` by a select, tiles cut by the causal diagonal, the
  window or the sequence end masked (``MASKED``), whole tiles unmasked; V tiles of masked
  steps go through ``finite_or_zero``, so a NaN/Inf in a slot past the length, outside the
  window or causally after a query reaches no row that cannot see it.
- A dense cache (``ragged_decode_attention``'s ``[B, Sk, Hkv, D]``) is a paged cache of ``B``
  pages of ``Sk`` slots, one per sequence (``ONE_PAGE``: the table's one column is read once);
  ``KvStarts`` (``HAS_START``) bounds each sequence's keys from below as ``kv_lens`` does from
  above.
- Quantised caches (``SCALED``): K/V tiles load in the cache dtype (``float8_e4m3fn``: half
  the bytes of bfloat16) and are cast to the query dtype in registers; the program's KV head
  scale ``k_scale[h]`` joins the score scale and ``v_scale[h]`` the final normalisation, so
  ``cache · scale`` is never formed (scales come as float32 ``[Hkv]``). ``F16_PRODUCTS``
  (bfloat16 queries over a float8 cache): both products run in float16 instead, to which a
  float8 tile converts exactly in one instruction a pair (to bfloat16 it takes two); each
  query row is divided by a power of two that brings its largest magnitude within 2^15
  (usually 1) and the row's scores are multiplied back, exactly, so no query overflows
  float16, and the probabilities enter the second product in float16. ``V_WORDS``: a float8
  V tile loads as 32-bit words and is widened to float16 in registers before the product,
  which then reads it from shared memory by matrix fragments (loaded as float8, the
  transposed operand of P·V is read one byte at a time).
- ALiBi adds ``slope[h] · (key_pos - query_pos)`` after the soft cap; sinks
  (``softmax_aux [Hq, n]``) join the maximum and denominator once, after the walk.
- Split-K (``NUM_SPLITS > 1``): split ``k`` walks the ``k``-th of ``NUM_SPLITS`` equal runs of
  the program's key tiles and writes its normalised float32 output ``[NUM_SPLITS, T, Hq, D]``
  and log2-sum-exp ``[NUM_SPLITS, T, Hq]`` (``MASK_VALUE`` where it saw nothing); the sinks
  join split 0 only, and the caller merges the splits (``ops.unified_attention``). With one
  split the output is final, in the query dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ejkernel_triton.kernels.flash_attention_common import (
    LOG2E,
    MASK_VALUE,
    _finite_or_zero_if,
    _key_ranges_from,
    _load_tile,
    _scores,
    _visible,
)


@triton.jit
def _sequence_of(QStart, num_live, block, BLOCK_Q: tl.constexpr):
    """The sequence owning query block ``block``: the last ``s < num_live`` with
    ``query_start_loc[s] // BLOCK_Q + s <= block`` (-1 when none). Gluon kernels call it too
    (:mod:`ejkernel_triton.kernels.paged_attention_hopper`)."""
    lo = block * 0  # a tensor from the start (the loop carries it), in Triton and in Gluon
    hi = num_live
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(QStart + mid) // BLOCK_Q + mid
        if first <= block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _kv_tile(
    Cache,
    table_row,
    cols,
    start_n,
    kv_hi,
    num_pages,
    head_off,
    stride_cp,
    stride_cs,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    ONE_PAGE: tl.constexpr,
):
    """The K or V tile ``[BLOCK_N, BLOCK_D]`` of key positions ``cols`` (one sequence, one KV
    head at ``head_off``), through the sequence's table row; zeros past ``kv_hi`` on a masked
    step. ``ONE_PAGE``: the sequence's keys all lie on its one page."""
    if ONE_PAGE:
        page = tl.load(table_row)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        base = Cache + page * stride_cp + head_off
        rows = cols * stride_cs
    elif PAGE_SIZE % BLOCK_N == 0:  # the tile lies within one page: one page id
        page = tl.load(table_row + start_n // PAGE_SIZE)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        base = Cache + page * stride_cp + head_off
        rows = (cols % PAGE_SIZE) * stride_cs
    else:
        slot = cols // PAGE_SIZE
        if MASKED:
            page = tl.load(table_row + slot, mask=cols < kv_hi, other=0)
        else:
            page = tl.load(table_row + slot)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        base = Cache + head_off
        rows = page * stride_cp + (cols % PAGE_SIZE) * stride_cs
    ptrs = base + rows[:, None] + offs_d[None, :]
    return _load_tile(ptrs, cols, kv_hi, offs_d, HEAD_DIM, BLOCK_D, MASKED)


@triton.jit
def _fp8_words_to_f16(w):
    """A float8 (e4m3) tile loaded as 32-bit words ``[N, D / 4]`` (entry ``4j + i`` in byte
    ``i`` of word ``j``), widened to float16 ``[N, D]`` (exact)."""
    e0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    e1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    e2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    e3 = (w >> 24).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    x = tl.join(tl.join(e0, e2), tl.join(e1, e3))  # [N, D / 4, 2, 2]: entry 4j + 2b + a
    return tl.reshape(x, [w.shape[0], w.shape[1] * 4])


@triton.jit
def _to_float16_rows(q):
    """``(q / r, r)``: ``q`` in float16, each row divided by the power of two ``r`` (1 unless
    the row's largest magnitude exceeds 2^15) that keeps it within float16's range."""
    x = q.to(tl.float32)
    big = tl.maximum(tl.max(tl.abs(x), 1), 1.0)
    shift = tl.maximum(tl.ceil(tl.log2(big)) - 15.0, 0.0)
    r = tl.exp2(shift)
    return (x / r[:, None]).to(tl.float16), r


@triton.jit
def unified_attention_kernel(
    Q,
    KCache,
    VCache,
    KvLens,
    Tables,
    QStart,
    NumSeqs,
    Aux,
    Slopes,
    KvStarts,
    KScale,
    VScale,
    sm_scale,
    soft_cap,
    window_left,
    window_right,
    num_aux,
    num_tokens,
    num_heads,
    num_pages,
    max_pages,
    stride_qt,
    stride_cp,
    stride_cs,
    stride_vp,
    stride_vs,
    stride_ot,
    Out,
    Lse,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_AUX: tl.constexpr,
    BLOCK_AUX: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
    DECODE: tl.constexpr = False,
    HAS_START: tl.constexpr = False,
    ONE_PAGE: tl.constexpr = False,
    SCALED: tl.constexpr = False,
    F16_PRODUCTS: tl.constexpr = False,
    V_WORDS: tl.constexpr = False,
    MIN_Q_LEN: tl.constexpr = 1,
    MAX_Q_LEN: tl.constexpr = 0,
):
    """One program: ``BLOCK_Q`` query tokens of one sequence × the query heads of KV head
    ``program_id(1)``, over split ``program_id(2)`` of their keys. Strides (``stride_qt`` and
    ``stride_ot`` the token strides of Q and Out; the K and V caches' page and slot strides)
    come in units of ``ALIGN`` elements; a head's stride is ``HEAD_DIM`` (``HEAD_DV`` in the V
    cache and Out). ``NumSeqs``: the live sequences (int32 ``[1]``).
    ``BLOCK_M = BLOCK_Q · GROUP_PAD`` rows. ``DECODE``: one query per sequence, token ``s``
    of sequence ``s`` (``page_attention``): the grid's first axis is the sequences, every one
    live, and ``QStart`` is not read. ``KvStarts`` (int32 ``[rows]``, read with
    ``HAS_START``): each sequence's first key; ``KScale``/``VScale`` (float32 ``[Hkv]``, read
    when ``SCALED``): the caches' scales. ``MIN_Q_LEN``, ``MAX_Q_LEN``: the sequences served,
    those of ``MIN_Q_LEN`` queries or more and (``MAX_Q_LEN`` > 0) at most ``MAX_Q_LEN`` (a
    mixed batch's kinds in launches of their own).
    """
    stride_qt = stride_qt * ALIGN
    stride_cp = stride_cp * ALIGN
    stride_cs = stride_cs * ALIGN
    stride_vp = stride_vp * ALIGN
    stride_vs = stride_vs * ALIGN
    stride_ot = stride_ot * ALIGN
    block = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE:  # token s is sequence s's one query: no search
        seq = block
        q_start = block
        q_len = block * 0 + 1
        m_lo = block * 0
    else:
        seq = _sequence_of(QStart, tl.load(NumSeqs), block, BLOCK_Q)
        if seq < 0:
            return
        q_start = tl.load(QStart + seq)
        q_len = tl.load(QStart + seq + 1) - q_start
        m_lo = (block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
        if m_lo >= q_len:
            return
        if MIN_Q_LEN > 1:  # noqa: SIM102 (a constexpr: no code at all otherwise)
            if q_len < MIN_Q_LEN:
                return
        if MAX_Q_LEN > 0:  # noqa: SIM102
            if q_len > MAX_Q_LEN:
                return
    kv_len = tl.load(KvLens + seq)
    kv_hi = tl.minimum(tl.maximum(kv_len, 0), max_pages * PAGE_SIZE)
    kv_lo = 0
    if HAS_START:
        kv_lo = tl.minimum(tl.maximum(tl.load(KvStarts + seq), 0), kv_hi)
    qk_scale = sm_scale
    v_scale = 1.0
    if SCALED:
        qk_scale = sm_scale * tl.load(KScale + kvh)
        v_scale = tl.load(VScale + kvh)
    geo = (kv_len - q_len, q_len, kv_hi, window_left, window_right)
    features = (CAUSAL, WINDOW, False, False, False)
    masks = ((Q, 0, 0), (Q, 0, 0), (Q, Q))  # no bias, mask or segment ids

    rows = tl.arange(0, BLOCK_M)
    tok = m_lo + rows // GROUP_PAD  # the row's query, within the sequence
    g = rows % GROUP_PAD
    head = kvh * GROUP + g
    token = q_start + tok
    row_ok = (tok < q_len) & (g < GROUP) & (token >= 0) & (token < num_tokens)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + token[:, None] * stride_qt + head[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if F16_PRODUCTS:
        q, row_scale = _to_float16_rows(q)
    q_pos = tok + (kv_len - q_len)
    slope = tl.zeros([BLOCK_M], tl.float32)
    if HAS_ALIBI:
        slope = tl.load(Slopes + head, mask=g < GROUP, other=0.0).to(tl.float32) * LOG2E

    start, full_start, full_end, end = _key_ranges_from(
        m_lo, kv_lo, geo, BLOCK_Q, BLOCK_N, CAUSAL, WINDOW
    )
    ranges = (start, full_start, full_end, end)
    split_lo = start
    split_hi = end
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(end - start, BLOCK_N), NUM_SPLITS) * BLOCK_N
        split_lo = start + split * per_split
        split_hi = tl.minimum(split_lo + per_split, end)

    table_row = Tables + seq.to(tl.int64) * max_pages
    head_off = kvh * HEAD_DIM
    m_i = tl.full([BLOCK_M], MASK_VALUE, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    offs_dv = tl.arange(0, BLOCK_DV)
    for part in tl.static_range(3):  # cut tiles, whole tiles, cut tiles
        MASKED = part != 1
        lo = tl.maximum(ranges[part], split_lo)
        hi = tl.minimum(ranges[part + 1], split_hi)
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            k = _kv_tile(
                KCache, table_row, cols, start_n, kv_hi, num_pages, head_off, stride_cp,
                stride_cs, offs_d, HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N, MASKED, ONE_PAGE,
            )  # fmt: skip
            if SCALED:  # dequantised in registers; the scale joined qk_scale
                k = k.to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if F16_PRODUCTS:
                qk = qk * row_scale[:, None]
            s, _ = _scores(qk, qk_scale, soft_cap, SOFT_CAP)
            if HAS_ALIBI:
                s = s + slope[:, None] * (cols[None, :] - q_pos[:, None]).to(tl.float32)
            s = _visible(s, tok[:, None], cols[None, :], geo, masks, MASKED, features)
            if HAS_START and MASKED:
                s = tl.where(cols[None, :] >= kv_lo, s, MASK_VALUE)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if V_WORDS:  # a float8 V tile as 32-bit words, widened in registers
                v = _kv_tile(
                    VCache.to(tl.pointer_type(tl.uint32)), table_row, cols, start_n, kv_hi,
                    num_pages, kvh * (HEAD_DV // 4), stride_vp // 4, stride_vs // 4,
                    tl.arange(0, BLOCK_DV // 4), HEAD_DV // 4, BLOCK_DV // 4, PAGE_SIZE,
                    BLOCK_N, MASKED, ONE_PAGE,
                )  # fmt: skip
                v = _fp8_words_to_f16(v).to(q.dtype)
            else:
                v = _kv_tile(
                    VCache, table_row, cols, start_n, kv_hi, num_pages, kvh * HEAD_DV, stride_vp,
                    stride_vs, offs_dv, HEAD_DV, BLOCK_DV, PAGE_SIZE, BLOCK_N, MASKED, ONE_PAGE,
                )  # fmt: skip
            if SCALED and not V_WORDS:
                v = v.to(q.dtype)
            v = _finite_or_zero_if(v, MASKED)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            m_i = m_new

    empty = m_i <= MASK_VALUE * 0.5
    if HAS_AUX:  # the sinks join once: split 0's
        offs_a = tl.arange(0, BLOCK_AUX)
        take = (offs_a[None, :] < num_aux) & (g[:, None] < GROUP) & (split == 0)
        aux = tl.load(Aux + head[:, None] * num_aux + offs_a[None, :], mask=take, other=0.0)
        aux = tl.where(take, aux.to(tl.float32) * LOG2E, MASK_VALUE)
        m_f = tl.maximum(m_i, tl.max(aux, 1))
        alpha = tl.exp2(m_i - m_f)
        l_i = l_i * alpha + tl.sum(tl.where(take, tl.exp2(aux - m_f[:, None]), 0.0), 1)
        acc = acc * alpha[:, None]
        m_i = m_f
        empty = m_i <= MASK_VALUE * 0.5
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = tl.where(empty[:, None], 0.0, acc * (v_scale / l_safe)[:, None])

    o_mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DV)
    o_rows = token.to(tl.int64) * stride_ot + head * HEAD_DV
    if NUM_SPLITS == 1:
        o_ptrs = Out + o_rows[:, None] + offs_dv[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
    else:
        plane = split.to(tl.int64) * num_tokens
        o_ptrs = Out + plane * stride_ot + o_rows[:, None] + offs_dv[None, :]
        tl.store(o_ptrs, out, mask=o_mask)
        lse = tl.where(empty, MASK_VALUE, m_i + tl.log2(l_safe))
        tl.store(Lse + (plane + token) * num_heads + head, lse, mask=row_ok)
