"""Triton flash attention: the pieces every kernel shares (constants, score and mask arithmetic,
block ranges, program order, TMA descriptors of the warp-specialized kernels).

The algorithm is FlashAttention-2 (Dao, 2023). Layout is OPS.md's: ``q [B, Sq, Hq, D]``,
``k [B, Sk, Hkv, D]``, ``v [B, Sk, Hkv, Dv]``; ``lse``/``delta`` are ``[B, Hq, Sq]`` float32.

- Scores live in the log2 domain: ``s = (softcap(scale · q·kᵀ) + bias) · log2(e)``, so the
  softmax uses ``exp2``. Masked entries get the finite :data:`MASK_VALUE`; a row whose running
  maximum is still ``MASK_VALUE`` at the end saw no key, stores zeros and ``lse = EMPTY_LSE``,
  which makes every recomputed probability of it exactly 0 in the backward.
- Each program walks its key blocks (forward, dQ) or query blocks (dK/dV) in three ranges:
  blocks cut by the causal diagonal, the window edges or the sequence end (``MASKED``), the
  blocks every row sees completely (no positional mask, no bounds checks), and the cut blocks
  on the other side. Blocks nobody sees are never visited.
- GQA: the dK/dV program of one key head loops over the query heads of its group, so K/V are
  never repeated in memory and dK/dV need no atomics.
- Sinks (``softmax_aux``) join the maximum and the denominator once, after the key loop.
- Head dims that are not powers of two (80, 96) load ``BLOCK_D = next_pow2(D)`` columns with a
  mask; powers of two skip the mask.

The kernels are in :mod:`ejkernel_triton.kernels.flash_attention_fwd` and
:mod:`ejkernel_triton.kernels.flash_attention_bwd`; on Hopper the Gluon kernels of
:mod:`ejkernel_triton.kernels.flash_attention_hopper_fwd` and
:mod:`ejkernel_triton.kernels.flash_attention_hopper_bwd` (which the interpreter cannot run).
All are plain ``@triton.jit`` (or ``@gluon.jit``) functions. The launch wrapper
(:mod:`ejkernel_triton.ops.flash_attention`) calls them through jax-triton on a GPU, or through
Triton's interpreter on a CPU (:mod:`ejkernel_triton._launch` re-imports a kernel's module, and
the modules of the helpers it imports, with the interpreter switched on, so the same source
runs both ways).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: log2(e): scores are kept in the log2 domain.
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
#: Score of a masked entry (finite: ``MASK_VALUE - MASK_VALUE`` is 0, never NaN).
MASK_VALUE: tl.constexpr = tl.constexpr(-1.0e30)
#: Stored log2-sum-exp of a row that saw no key: ``exp2(s - EMPTY_LSE)`` is 0 for any ``s``.
EMPTY_LSE: tl.constexpr = tl.constexpr(3.0e38)


# -- shared pieces --------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # tanh through exp2 (works in the interpreter and compiles to ex2 on the GPU), of |x| so
    # that exp2 never overflows (inf / inf for x below about -44)
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _aligned(stride_b, stride_s, stride_h, ALIGN: tl.constexpr):
    """A tensor's batch, sequence and head strides, passed in units of ``ALIGN`` elements, in
    elements.

    jax-triton passes integer arguments without divisibility hints (and ``tl.multiple_of`` /
    ``tl.assume`` on an argument reach no analysis), so strides counted in elements would
    leave every tile load a 2-byte load with no pipelined copy. Multiplying by the constexpr
    ``ALIGN`` gives the compiler the divisibility: 16-byte loads, ``cp.async`` stages.
    """
    return stride_b * ALIGN, stride_s * ALIGN, stride_h * ALIGN


@triton.jit
def _load_tile(
    ptrs,
    rows,
    n_rows,
    cols,
    N_COLS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
):
    """Load ``[len(rows), BLOCK_COLS]`` with zeros outside ``rows < n_rows`` / ``cols < N_COLS``."""
    if CHECK_ROWS:
        if BLOCK_COLS == N_COLS:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS), other=0.0)
    else:
        if BLOCK_COLS == N_COLS:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols[None, :] < N_COLS, other=0.0)
    return x


@triton.jit
def _finite_or_zero(x):
    """:func:`ejkernel.attention_semantics.finite_or_zero`: NaN and ±Inf entries read as 0.

    The kernels pass through it the tiles that a probability or score gradient zeroed by the
    mask multiplies, on the steps whose scores go through the mask's select
    (:func:`_finite_or_zero_if`; never on the whole blocks of a call without an attention mask
    or segment ids): V in the forward's ``P·V``, K and V in the backward's ``dO·Vᵀ`` and
    ``dS·K``; ``0 · NaN`` would otherwise reach a row that cannot see the entry. The forward's
    K needs none (a hidden score goes through the select); a row that sees a non-finite key
    then has a NaN lse, which the backward reads as ``+inf`` (all its probabilities 0, so none
    is NaN at an entry it cannot see). Keys loaded past the sequence end are zeros already.
    """
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)


@triton.jit
def _finite_or_zero_if(x, HIDES: tl.constexpr):
    """``x`` through :func:`_finite_or_zero` on a step that hides keys from some row (a cut
    block: ``MASKED``; any block under an attention mask or segment ids), else as it is."""
    if HIDES:
        x = _finite_or_zero(x)
    return x


@triton.jit
def _key_tile(
    base,
    cols,
    stride,
    offs,
    seqlen_k,
    N_COLS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    MASKED: tl.constexpr,
    HIDES: tl.constexpr,
):
    """The K or V tile ``[len(cols), BLOCK_COLS]`` of the keys ``cols`` (``base``: this batch
    and head's first key; ``stride``: the key stride): bounds-checked on a cut block
    (``MASKED``), through :func:`_finite_or_zero` on a step that hides keys (``HIDES``)."""
    ptrs = base + cols[:, None] * stride + offs[None, :]
    x = _load_tile(ptrs, cols, seqlen_k, offs, N_COLS, BLOCK_COLS, MASKED)
    return _finite_or_zero_if(x, HIDES)


@triton.jit
def _scores(qk, sm_scale, soft_cap, SOFT_CAP: tl.constexpr):
    """``(softcap(scale · qk) · log2e, tanh)``; ``tanh`` is what the soft-cap gradient needs."""
    if SOFT_CAP:
        t = _tanh(qk * (sm_scale / soft_cap))
        s = t * (soft_cap * LOG2E)
    else:
        t = qk  # unused
        s = qk * (sm_scale * LOG2E)
    return s, t


@triton.jit
def _visible(s, qi, kj, geo, masks, MASKED: tl.constexpr, FEATURES: tl.constexpr):
    """Add the bias and apply every mask to a tile of log2-domain scores.

    The visibility is :func:`ejkernel.attention_semantics.visible`, restated in Triton: query
    ``qi`` sits at key position ``q_pos = qi + q_pos_offset`` (``Sk - Sq``, bottom-right); it
    sees key ``kj`` when the key exists (``kv_valid``: ``kj < seqlen_k``), ``kj <= q_pos``
    (``CAUSAL``), ``q_pos - window_left <= kj <= q_pos + window_right`` (``WINDOW``), the
    attention mask is nonzero (``HAS_MASK``) and the segment ids are equal and non-negative
    (``HAS_SEG``). Hidden scores are replaced by :data:`MASK_VALUE` by a select, never by an
    addition. ``MASKED`` is false only on blocks every row of which sees every key
    (``Geometry.block_fully_visible``), where the positional terms are all true.
    ``tests/triton/test_visibility.py`` evaluates both on grids of positions.

    ``qi``/``kj`` are the query and key indices broadcast to the tile: ``rows[:, None]`` and
    ``cols[None, :]`` for a ``[queries, keys]`` tile, or the other way round for the
    transposed tile of the dK/dV kernel. The tuples: ``geo = (q_pos_offset, seqlen_q,
    seqlen_k, window_left, window_right)``; ``masks = ((bias_ptr, stride_biasq, stride_biask),
    (mask_ptr, stride_maskq, stride_maskk), (qseg_ptr, kseg_ptr))``, the bias and mask at this
    (batch, head)'s ``[Sq, Sk]`` plane (strides may be 0 for broadcast dims), the segment ids
    at this batch's; ``FEATURES = (CAUSAL, WINDOW, HAS_BIAS, HAS_MASK, HAS_SEG)``, constexprs.
    """
    q_pos_offset, seqlen_q, seqlen_k, window_left, window_right = geo
    bias, mask, seg = masks
    bias_ptr, stride_biasq, stride_biask = bias
    mask_ptr, stride_maskq, stride_maskk = mask
    qseg_ptr, kseg_ptr = seg
    CAUSAL, WINDOW, HAS_BIAS, HAS_MASK, HAS_SEG = FEATURES
    in_bounds = (qi < seqlen_q) & (kj < seqlen_k)
    if HAS_BIAS:
        b = tl.load(
            bias_ptr + qi * stride_biasq + kj * stride_biask,
            mask=in_bounds,
            other=0.0,
        )
        s = s + b.to(tl.float32) * LOG2E
    if MASKED:  # the positional terms as one bound a query (two with a window)
        q_pos = qi + q_pos_offset
        last = qi * 0 + (seqlen_k - 1)  # kv_valid, of the queries' shape
        if CAUSAL:
            last = tl.minimum(last, q_pos)
        if WINDOW:
            last = tl.minimum(last, q_pos + window_right)
        keep = kj <= last
        if WINDOW:
            keep = keep & (kj >= q_pos - window_left)
    else:
        keep = (qi >= 0) & (kj >= 0)  # all true, of the tile's shape
    if HAS_MASK:
        m = tl.load(
            mask_ptr + qi * stride_maskq + kj * stride_maskk,
            mask=in_bounds,
            other=0,
        )
        keep = keep & (m != 0)
    if HAS_SEG:
        qs = tl.load(qseg_ptr + qi, mask=qi < seqlen_q, other=-1)
        ks = tl.load(kseg_ptr + kj, mask=kj < seqlen_k, other=-2)
        keep = keep & (qs == ks) & (qs >= 0)
    if MASKED or HAS_MASK or HAS_SEG:
        s = tl.where(keep, s, MASK_VALUE)
    return s


@triton.jit
def _key_ranges(
    m_lo,
    geo,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Key blocks for the query block at row ``m_lo``: ``(start, full_start, full_end, end)``.

    ``[start, end)`` holds every key some row sees; ``[full_start, full_end)`` (multiples of
    ``BLOCK_N``) the blocks every row sees whole, within bounds. ``geo`` as :func:`_visible`'s.
    """
    return _key_ranges_from(m_lo, 0, geo, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)


@triton.jit
def _key_ranges_from(
    m_lo,
    kv_lo,
    geo,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """:func:`_key_ranges` over the keys from ``kv_lo`` on (a paged split's first key)."""
    q_pos_offset, seqlen_q, seqlen_k, window_left, window_right = geo
    m_hi = tl.minimum(m_lo + BLOCK_M, seqlen_q)
    p_first = m_lo + q_pos_offset
    p_last = m_hi - 1 + q_pos_offset
    lo = kv_lo
    hi = seqlen_k
    full_lo = kv_lo
    full_hi = seqlen_k
    if CAUSAL:
        hi = tl.minimum(hi, p_last + 1)
        full_hi = tl.minimum(full_hi, p_first + 1)
    if WINDOW:
        lo = tl.maximum(lo, p_first - window_left)
        hi = tl.minimum(hi, p_last + window_right + 1)
        full_lo = tl.maximum(full_lo, p_last - window_left)
        full_hi = tl.minimum(full_hi, p_first + window_right + 1)
    return _block_ranges(lo, hi, full_lo, full_hi, BLOCK_N)


@triton.jit
def _query_ranges(
    n_lo,
    geo,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Query blocks for the key block at column ``n_lo``, as :func:`_key_ranges` for queries."""
    q_pos_offset, seqlen_q, seqlen_k, window_left, window_right = geo
    n_hi = tl.minimum(n_lo + BLOCK_N, seqlen_k)
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = seqlen_q
    if CAUSAL:
        lo = tl.maximum(lo, n_lo - q_pos_offset)
        full_lo = tl.maximum(full_lo, n_hi - 1 - q_pos_offset)
    if WINDOW:
        lo = tl.maximum(lo, n_lo - window_right - q_pos_offset)
        hi = tl.minimum(hi, n_hi - 1 + window_left - q_pos_offset + 1)
        full_lo = tl.maximum(full_lo, n_hi - 1 - window_right - q_pos_offset)
        full_hi = tl.minimum(full_hi, n_lo + window_left - q_pos_offset + 1)
    if n_lo + BLOCK_N > seqlen_k:  # a key block cut by the sequence end is masked everywhere
        full_hi = 0
    return _block_ranges(lo, hi, full_lo, full_hi, BLOCK_M)


@triton.jit
def _block_ranges(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """``(start, full_start, full_end, end)`` in whole ``BLOCK``s from the positions some row
    sees, ``[lo, hi)``, and those every row sees, ``[full_lo, full_hi)``: the walk's masked
    blocks are ``[start, full_start)`` and ``[full_end, end)``."""
    hi = tl.maximum(hi, 0)
    full_hi = tl.maximum(full_hi, 0)
    start = (lo // BLOCK) * BLOCK
    end = tl.maximum(hi, start)
    full_start = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK) * BLOCK, start), end)
    full_end = tl.minimum(tl.maximum((full_hi // BLOCK) * BLOCK, full_start), end)
    return start, full_start, full_end, end


@triton.jit
def _heads(off_bh, num_heads, num_kv_heads):
    """``(batch, query head, key head)`` of a program's ``batch · num_heads + head``."""
    off_b = off_bh // num_heads
    off_h = off_bh % num_heads
    return off_b, off_h, off_h // (num_heads // num_kv_heads)


@triton.jit
def _program_tile(HEAD_GROUP: tl.constexpr):
    """``(query block, batch·head)`` of a forward program in a grid ``(blocks, B·H)``.

    ``HEAD_GROUP`` 0: grid order. Otherwise (causal, where programs differ in length) the GPU,
    which starts programs in order of their linear id, gets the heads in groups of
    ``HEAD_GROUP`` and, within a group, the longest (last) query blocks of all its heads first:
    the last programs to start are short, and the programs running at one time read the K/V of
    a few heads only, which stay in L2. The backward's kernels take the same order (dK/dV
    reversed: its longest programs are its first key blocks).
    """
    if HEAD_GROUP == 0:
        block = tl.program_id(0)
        off_bh = tl.program_id(1)
    else:
        blocks = tl.num_programs(0)
        heads = tl.num_programs(1)
        order = tl.program_id(1) * blocks + tl.program_id(0)
        group = order // (HEAD_GROUP * blocks)
        within = order % (HEAD_GROUP * blocks)
        size = tl.minimum(heads - group * HEAD_GROUP, HEAD_GROUP)
        block = blocks - 1 - within // size
        off_bh = group * HEAD_GROUP + within % size
    return block, off_bh


# -- warp-specialized kernels (Hopper) -------------------------------------------------------


@triton.jit
def _head_rows(ptr, rows, heads, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """A TMA descriptor of ``[B, S, H, D]`` seen as ``[rows = B·S, H·D]``, ``BLOCK`` rows of one
    head per load (at column ``head · HEAD_DIM``)."""
    return tl.make_tensor_descriptor(
        ptr,
        shape=[rows, heads * HEAD_DIM],
        strides=[heads * HEAD_DIM, 1],
        block_shape=[BLOCK, HEAD_DIM],
    )


@triton.jit
def _row_stats(ptr, size, BLOCK: tl.constexpr):
    """A TMA descriptor of a flat float32 ``[B·H·S]`` array, ``BLOCK`` entries per load."""
    return tl.make_tensor_descriptor(ptr, shape=[size], strides=[1], block_shape=[BLOCK])


@triton.jit
def _ws_mask(
    s,
    start_n,
    offs_m,
    q_pos_offset,
    seqlen_k,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Scores of a key block starting at ``start_n`` for rows ``offs_m``, masked where
    ``CAUSAL`` or a cut last block (``EVEN_K`` false) needs it (for a stored row, a causally
    visible key is also inside ``seqlen_k``)."""
    if CAUSAL:
        cols = start_n + tl.arange(0, BLOCK_N)
        s = tl.where(cols[None, :] <= offs_m[:, None] + q_pos_offset, s, MASK_VALUE)
    elif not EVEN_K:
        cols = start_n + tl.arange(0, BLOCK_N)
        s = tl.where(cols[None, :] < seqlen_k, s, MASK_VALUE)
    return s


@triton.jit
def _ws_tile(tile, num_m, heads, num_heads, num_kv_heads, CAUSAL: tl.constexpr):
    """A persistent program's tile: (query block, batch, query head, key head). Query blocks
    go in descending order when ``CAUSAL`` (the longest rows first), heads fastest."""
    start_m = tile // heads
    if CAUSAL:
        start_m = num_m - 1 - start_m
    off_bh = tile % heads
    off_b, off_h, off_hk = _heads(off_bh, num_heads, num_kv_heads)
    return start_m, off_bh, off_b, off_h, off_hk


# -- step bodies (one key tile of the forward or dQ, one query tile of dK/dV) ---------------


# Their tuples: ``offs = (offs_d, offs_dv)`` (the K and V columns); ``kv = (k_base, v_base,
# stride_ks, stride_vs)`` (this batch and key head's first key, and the key strides);
# ``scale = (sm_scale, soft_cap)``; ``DIMS = (HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)``;
# ``geo``, ``masks`` and ``features`` as in :func:`_visible`.


@triton.jit
def _fwd_step(
    q,
    offs_m,
    cols,
    offs,
    kv,
    state,
    k_end,
    scale,
    geo,
    masks,
    features,
    DIMS: tl.constexpr,
    FLAGS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of the forward over the keys ``cols`` (``k_end``: where the
    keys end): ``state = (m_i, l_i, acc)`` in, the new one out. ``FLAGS = (MASKED, HIDES,
    PLAIN_STEP, SOFT_CAP)``; ``PLAIN_STEP``: a step with nothing to mask or add and a scale
    ≥ 0, where the scale rides in the exponent's FFMA."""
    offs_d, offs_dv = offs
    k_base, v_base, stride_ks, stride_vs = kv
    m_i, l_i, acc = state
    sm_scale, soft_cap = scale
    HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV = DIMS
    MASKED, HIDES, PLAIN_STEP, SOFT_CAP = FLAGS
    k = _key_tile(k_base, cols, stride_ks, offs_d, k_end, HEAD_DIM, BLOCK_D, MASKED, False)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if PLAIN_STEP:  # the scale rides in the exponent's FFMA
        m_new = tl.maximum(m_i, tl.max(qk, 1) * (sm_scale * LOG2E))
        p = tl.exp2(qk * (sm_scale * LOG2E) - m_new[:, None])
    else:
        s, _ = _scores(qk, sm_scale, soft_cap, SOFT_CAP)
        s = _visible(s, offs_m[:, None], cols[None, :], geo, masks, MASKED, features)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = _key_tile(v_base, cols, stride_vs, offs_dv, k_end, HEAD_DIM_V, BLOCK_DV, MASKED, HIDES)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _dkdv_step(
    k,
    v,
    offs_n,
    rows,
    offs,
    bases,
    grads,
    q_end,
    scale,
    geo,
    masks,
    features,
    DIMS: tl.constexpr,
    FLAGS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One step of the dK/dV kernel over the query rows ``rows`` (``q_end``: where the rows
    end): ``grads = (dk, dv)`` in, the new ones out. ``bases = (q_base, do_base, lse_base,
    delta_base, stride_qs, stride_dos)``: this batch and query head's first row of each.
    ``FLAGS = (MASKED, HIDES, HIDE_ROWS, SOFT_CAP)``; ``HIDE_ROWS``: on a cut step, rows at or
    past ``q_end`` are hidden too (a block-sparse query block's end is not the sequence's)."""
    offs_d, offs_dv = offs
    q_base, do_base, lse_base, delta_base, stride_qs, stride_dos = bases
    dk, dv = grads
    sm_scale, soft_cap = scale
    HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV = DIMS
    MASKED, HIDES, HIDE_ROWS, SOFT_CAP = FLAGS
    q_ptrs = q_base + rows[:, None] * stride_qs + offs_d[None, :]
    q = _load_tile(q_ptrs, rows, q_end, offs_d, HEAD_DIM, BLOCK_D, MASKED)
    do_ptrs = do_base + rows[:, None] * stride_dos + offs_dv[None, :]
    do = _load_tile(do_ptrs, rows, q_end, offs_dv, HEAD_DIM_V, BLOCK_DV, MASKED)
    if MASKED:
        lse = tl.load(lse_base + rows, mask=rows < q_end, other=EMPTY_LSE)
        delta = tl.load(delta_base + rows, mask=rows < q_end, other=0.0)
    else:
        lse = tl.load(lse_base + rows)
        delta = tl.load(delta_base + rows)
    # transposed scores, [BLOCK_N, BLOCK_M]: p and ds then feed dV and dK as they
    # are, with no transpose of a register tile (a trip through shared memory)
    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    s_t, t_t = _scores(qk_t, sm_scale, soft_cap, SOFT_CAP)
    s_t = _visible(s_t, rows[None, :], offs_n[:, None], geo, masks, MASKED, features)
    if HIDE_ROWS and MASKED:  # rows of the next query block (or none) share no step here
        s_t = tl.where(rows[None, :] < q_end, s_t, MASK_VALUE)
    p_t = tl.exp2(s_t - lse[None, :])
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFT_CAP:
        ds_t = ds_t * (1.0 - t_t * t_t)
    if HIDES:  # hidden: p = 0 exactly, and dS 0 even where v or k is not finite
        ds_t = tl.where(p_t > 0.0, ds_t, 0.0)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dq_step(
    q,
    do,
    stats,
    offs_m,
    cols,
    offs,
    kv,
    dq,
    dbias,
    ends,
    scale,
    geo,
    masks,
    features,
    DIMS: tl.constexpr,
    FLAGS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One step of the dQ kernel over the keys ``cols``: the new ``dq``. ``stats = (lse,
    delta)`` of the rows; ``ends = (q_end, k_end)``: where the rows and keys end; ``dbias =
    (dbias_ptr, seqlen_k)``: the row-major ``[Sq, seqlen_k]`` bias gradient. ``FLAGS =
    (MASKED, HIDES, HAS_BIAS, SOFT_CAP)``."""
    lse, delta = stats
    offs_d, offs_dv = offs
    k_base, v_base, stride_ks, stride_vs = kv
    dbias_ptr, seqlen_k = dbias
    q_end, k_end = ends
    sm_scale, soft_cap = scale
    HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV = DIMS
    MASKED, HIDES, HAS_BIAS, SOFT_CAP = FLAGS
    k = _key_tile(k_base, cols, stride_ks, offs_d, k_end, HEAD_DIM, BLOCK_D, MASKED, HIDES)
    v = _key_tile(v_base, cols, stride_vs, offs_dv, k_end, HEAD_DIM_V, BLOCK_DV, MASKED, HIDES)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s, t = _scores(qk, sm_scale, soft_cap, SOFT_CAP)
    s = _visible(s, offs_m[:, None], cols[None, :], geo, masks, MASKED, features)
    p = tl.exp2(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    if HAS_BIAS:
        tl.store(
            dbias_ptr + offs_m[:, None] * seqlen_k + cols[None, :],
            ds,
            mask=(offs_m[:, None] < q_end) & (cols[None, :] < k_end),
        )
    if SOFT_CAP:
        ds = ds * (1.0 - t * t)
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq
