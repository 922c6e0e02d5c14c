"""native_sparse_attention on XLA: NSA's three branches, query-chunked, selected blocks gathered.

Native Sparse Attention (Yuan et al., DeepSeek, 2025, Sec. 3.3), semantics as in
:mod:`ejkernel.specs.native_sparse_attention`, with a hand-written backward:

- Compression (Sec. 3.3.1): the complete blocks of every sequence are mean-pooled once into
  ``TC = max(1, S // bs)`` compressed tokens per batch row (with ``cu_seqlens`` each sequence
  contributes ``len // bs`` of them, so the packed total still fits in S // bs).
- Compressed and selected branches, per chunk of ``q_blocksize`` queries (a ``lax.map``, so
  memory stays at one chunk's working set): the chunk's compressed logits
  ``[B, Hkv, G, cq, TC]`` give the compressed output and, when no ``block_indices`` are given,
  the group-mean probabilities whose top ``block_counts`` blocks are selected
  (:func:`ejkernel.specs.native_sparse_attention.nsa_select_blocks`, the rule of the
  reference). Only the selected blocks are gathered, as contiguous windows of ``bs`` rows, once
  per KV head for the whole query group: ``[B, Hkv, cq, T·bs, D]``; the selected branch is a
  softmax over them, masked to positions ≤ the query's and to the first occurrence of a
  repeated block. The forward saves each branch's output and logsumexp and the selection.
- Backward (FlashAttention-2's Alg. 2 algebra per branch): a ``lax.scan`` over the same chunks
  recomputes ``P = exp(S - lse)``, gives dQ per chunk and accumulates dK/dV in float32 in the
  scan carry: the compressed tokens' gradients as dense sums, the selected windows'
  gradients scattered back into their rows. The compressed tokens' gradients then flow through
  the mean pooling. Gate gradients are ``Σ dO ⊙ o_branch``. The selection is not
  differentiated (it is saved, never recomputed).
- Sliding window: flash attention's blockwise kernel and backward
  (``sliding_window = (window_size - 1, 0)``, causal, segment ids from ``cu_seqlens``), so
  blocks outside the window are skipped and memory stays linear.

Cost: O(S·(S/bs + T·bs + W)·D) compute, O(cq·T·bs·D) working memory per chunk, never O(S²).
It declines nothing (no ``supports``): every valid call, ``cu_seqlens`` included, is served.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ejkernel.attention_semantics import EMPTY_ROW_LSE, finite_or_zero, hide, mask_scores
from ejkernel.plugins import FwdParams, defvjp
from ejkernel.specs.native_sparse_attention import SPEC, nsa_select_blocks, sequence_layout
from ejkernel_xla.ops._adapter import static_defaults
from ejkernel_xla.ops._blockwise import backend, pad_axis
from ejkernel_xla.ops.flash_attention import flash_attention_xla

__all__ = [
    "NativeSparseAttentionConfig",
    "config_space",
    "heuristic",
    "native_sparse_attention_xla",
]

#: Bytes of gathered keys/values one query chunk may hold, per backend (sizes the default
#: chunk): on CPU a chunk's blocks should stay in cache; on accelerators chunks are larger so
#: the loops have few steps.
_CHUNK_BYTES = {"cpu": 2 * 2**20, "gpu": 64 * 2**20, "tpu": 64 * 2**20}
#: Query chunk sizes :func:`config_space` offers (clamped to S).
_TUNING_CHUNKS = (16, 32, 64, 128, 256)


#: The arrays the compressed and selected branches read (and their backward differentiates).
_BRANCH_ARRAYS = ("query", "key", "value", "g_cmp", "g_slc", "cu_seqlens")


@attrs.frozen(kw_only=True)
class NativeSparseAttentionConfig:
    """Tunables of the XLA NSA.

    Attributes:
        fwd_params: ``q_blocksize`` is the number of queries per chunk (the backward walks the
            same chunks); ``None`` sizes it so a chunk's gathered keys and values stay near
            2 MiB on CPU, 64 MiB on accelerators.
    """

    fwd_params: FwdParams = attrs.field(factory=FwdParams)


def heuristic(inv: Any) -> NativeSparseAttentionConfig:
    """The largest power-of-two chunk whose gathered blocks fit the memory budget."""
    return NativeSparseAttentionConfig(fwd_params=FwdParams(q_blocksize=_default_chunk(inv.kwargs)))


def config_space(inv: Any) -> list[NativeSparseAttentionConfig]:
    """The heuristic's chunk, then a handful of others no longer than S."""
    s = int(inv.kwargs["query"].shape[1])
    configs = [heuristic(inv)]
    for chunk in _TUNING_CHUNKS:
        cfg = NativeSparseAttentionConfig(fwd_params=FwdParams(q_blocksize=min(chunk, s)))
        if cfg not in configs:
            configs.append(cfg)
    return configs


def native_sparse_attention_xla(
    *, cfg: NativeSparseAttentionConfig | None = None, **args: Any
) -> jax.Array:
    """NSA: compressed, selected and sliding-window branches mixed by their gates.

    Args:
        cfg: the query chunk size; ``None`` takes the default.
        **args: :func:`ejkernel.native_sparse_attention`'s arguments by name, as its spec
            validated them (absent ones take their defaults).

    Returns:
        [B, S, Hq, Dv] in the query dtype.
    """
    out, _ = _native_sparse_attention(args, cfg, residuals=False)
    return out


def _native_sparse_attention_fwd(
    *, cfg: NativeSparseAttentionConfig | None = None, **args: Any
) -> tuple[jax.Array, dict[str, Any]]:
    """Forward of :func:`native_sparse_attention_xla`: ``(out, residuals)``.

    The residuals are the inputs, each sparse branch's output and logsumexp and the selection
    (in the chunked layout), and flash attention's residuals for the sliding window.
    """
    return _native_sparse_attention(args, cfg, residuals=True)


def _native_sparse_attention(
    args: dict[str, Any], cfg: NativeSparseAttentionConfig | None, *, residuals: bool
) -> tuple[jax.Array, dict[str, Any] | None]:
    """The forward, keeping the backward's residuals only when asked (``None`` otherwise)."""
    a = SPEC.bind((), args)
    query, key, value, g_swa, cu_seqlens = (
        a[n] for n in ("query", "key", "value", "g_swa", "cu_seqlens")
    )
    st = _statics(a, cfg, residuals=residuals)
    out, saved = _sparse_forward({n: a[n] for n in (*_BRANCH_ARRAYS, "block_indices")}, st)
    swa = None
    if st.window > 0 and g_swa is not None:
        window = _window_args(cu_seqlens, query.shape[1], st)
        flash = {"query": query, "key": key, "value": value, **window}
        if residuals:
            o_swa, swa = flash_attention_xla.fwd(**flash)  # type: ignore[attr-defined]
        else:
            o_swa = flash_attention_xla(**flash)
        out = out + g_swa.astype(jnp.float32)[..., None] * o_swa.astype(jnp.float32)
    out = out.astype(query.dtype)
    if not residuals:
        return out, None
    kept = {n: a[n] for n in (*_BRANCH_ARRAYS, "g_swa")}
    return out, {**kept, "sparse": saved, "swa": swa}


def _native_sparse_attention_bwd(
    residuals: dict[str, Any],
    d_out: jax.Array,
    *,
    cfg: NativeSparseAttentionConfig | None = None,
    **static: Any,
) -> dict[str, jax.Array | None]:
    """Backward of :func:`native_sparse_attention_xla`.

    Returns:
        Gradients of ``query``, ``key``, ``value`` and the gates, each in its input's dtype.
    """
    r = residuals
    query, key, value = r["query"], r["key"], r["value"]
    idx = r["sparse"]["idx"]  # [n_chunks, B, Hkv, cq, T]: the forward's chunking
    static = static_defaults(SPEC, static)
    scale = static["softmax_scale"]
    st = _Statics(
        block_size=int(static["block_size"]),
        block_counts=int(idx.shape[-1]),
        select=False,
        scale=float(query.shape[-1] ** -0.5 if scale is None else scale),
        chunk=int(idx.shape[3]),
        window=int(static["window_size"]),
        residuals=True,
    )
    grads = _sparse_backward({n: r[n] for n in _BRANCH_ARRAYS}, r["sparse"], d_out, st)
    grads["g_swa"] = None
    if r["swa"] is not None:
        g_swa = r["g_swa"]
        d_out32 = d_out.astype(jnp.float32)
        o_swa = r["swa"]["out"].astype(jnp.float32)
        grads["g_swa"] = jnp.sum(d_out32 * o_swa, axis=-1).astype(g_swa.dtype)
        d_swa = (g_swa.astype(jnp.float32)[..., None] * d_out32).astype(query.dtype)
        bwd = flash_attention_xla.bwd  # type: ignore[attr-defined]
        flash = bwd(r["swa"], d_swa, **_window_statics(st))
        for name, x in (("query", query), ("key", key), ("value", value)):
            grads[name] = (grads[name] + flash[name].astype(jnp.float32)).astype(x.dtype)
    else:
        for name, x in (("query", query), ("key", key), ("value", value)):
            grads[name] = grads[name].astype(x.dtype)
    return grads


defvjp(native_sparse_attention_xla, _native_sparse_attention_fwd, _native_sparse_attention_bwd)


# --------------------------------------------------------------------------------------------
# Configuration helpers
# --------------------------------------------------------------------------------------------


def _default_chunk(kw: Any) -> int:
    q, k, v = kw["query"], kw["key"], kw["value"]
    idx = kw.get("block_indices")
    count = idx.shape[-1] if idx is not None else kw.get("block_counts", 16)
    b, s = q.shape[:2]
    itemsize = jnp.dtype(k.dtype).itemsize
    per_query = (
        b * k.shape[2] * count * kw.get("block_size", 64) * (k.shape[3] + v.shape[3]) * itemsize
    )
    budget = _CHUNK_BYTES.get(backend(), _CHUNK_BYTES["cpu"])
    chunk = 1 << max(0, int(np.log2(max(1, budget // max(1, per_query)))))
    return max(1, min(chunk, 256, s))


@attrs.frozen(kw_only=True)
class _Statics:
    """Everything static about one call (hashable: the ``jax.jit`` static argument)."""

    block_size: int
    block_counts: int
    select: bool
    scale: float
    chunk: int
    window: int
    residuals: bool


def _statics(
    a: dict[str, Any], cfg: NativeSparseAttentionConfig | None, *, residuals: bool
) -> _Statics:
    query, idx = a["query"], a["block_indices"]
    chunk = (cfg.fwd_params.q_blocksize if cfg is not None else None) or _default_chunk(a)
    scale = a.get("softmax_scale")
    return _Statics(
        block_size=int(a["block_size"]),
        block_counts=int(idx.shape[-1] if idx is not None else a["block_counts"]),
        select=idx is None,
        scale=float(query.shape[-1] ** -0.5 if scale is None else scale),
        chunk=max(1, min(int(chunk), query.shape[1])),
        window=int(a["window_size"]),
        residuals=residuals,
    )


def _window_args(cu_seqlens: jax.Array | None, seqlen: int, st: _Statics) -> dict[str, Any]:
    """Flash attention's arguments for the sliding-window branch (packed: segment ids)."""
    segments = None if cu_seqlens is None else sequence_layout(1, seqlen, cu_seqlens)[0]
    return {"q_segment_ids": segments, "kv_segment_ids": segments, **_window_statics(st)}


def _window_statics(st: _Statics) -> dict[str, Any]:
    """Flash attention's static arguments: causal, the last ``window_size`` positions."""
    return {
        "softmax_scale": st.scale,
        "causal": True,
        "sliding_window": (st.window - 1, 0),
        "logits_soft_cap": None,
        "dropout_prob": 0.0,
    }


# --------------------------------------------------------------------------------------------
# Compressed and selected branches
# --------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Layout:
    """Sizes, per-token sequence layout and compressed tokens of one call."""

    b: int
    s: int
    hkv: int
    group: int
    d: int
    dv: int
    bs: int
    cq: int
    packed: bool

    @property
    def n_chunks(self) -> int:
        return -(-self.s // self.cq)

    @property
    def num_blocks(self) -> int:
        return -(-self.s // self.bs)

    @classmethod
    def of(cls, query: jax.Array, value: jax.Array, st: _Statics, packed: bool) -> _Layout:
        b, s, hq, d = query.shape
        hkv = value.shape[2]
        return cls(
            b=b,
            s=s,
            hkv=hkv,
            group=hq // hkv,
            d=d,
            dv=value.shape[3],
            bs=st.block_size,
            cq=st.chunk,
            packed=packed,
        )

    def chunked(self, x: jax.Array, fill: Any = 0) -> jax.Array:
        """[B|1, S, ...] -> [n_chunks, B|1, cq, ...] (padded queries are dropped later)."""
        x = pad_axis(x, 1, self.n_chunks * self.cq, fill)
        x = x.reshape(x.shape[0], self.n_chunks, self.cq, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    def unchunked(self, x: jax.Array) -> jax.Array:
        """[n_chunks, B, Hkv, G, cq, ...] -> [B, S, Hq, ...]."""
        x = jnp.moveaxis(x, 4, 1)  # [n, cq, B, Hkv, G, ...]
        x = x.reshape(self.n_chunks * self.cq, self.b, self.hkv * self.group, *x.shape[5:])
        return jnp.moveaxis(x, 0, 1)[:, : self.s]


def _sequences(geo: _Layout, cu_seqlens: jax.Array | None) -> dict[str, Any]:
    """Per-token start and position, each token's first compressed token, pooling starts."""
    seq, start, pos = sequence_layout(geo.b, geo.s, cu_seqlens)
    if cu_seqlens is None:
        return {"start": start, "pos": pos, "first": jnp.zeros_like(start), "pool": None}
    cu = cu_seqlens.astype(jnp.int32)
    counts = (cu[1:] - cu[:-1]) // geo.bs
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
    u = jnp.arange(max(1, geo.s // geo.bs), dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(first[1:], u, side="right"), cu.shape[0] - 2)
    # Compressed token u pools keys pool[u] … pool[u] + bs - 1 (tokens past the last complete
    # block pool whatever lies there and are never visible).
    pool = cu[owner] + (u - first[owner]) * geo.bs
    return {"start": start, "pos": pos, "first": first[seq], "pool": pool}


def _compress(x: jax.Array, bs: int, pool: jax.Array | None) -> jax.Array:
    """Mean of ``bs`` rows per compressed token: [B, S, H, F] -> [B, TC, H, F] float32.

    ``pool`` gives each token's first row (packed sequences); ``None`` means the row's own
    blocks ``u·bs``, pooled with a reshape.
    """
    b, s, h, f = x.shape
    tc = max(1, s // bs)
    x = x.astype(jnp.float32)
    if pool is None:
        return pad_axis(x, 1, tc * bs)[:, : tc * bs].reshape(b, tc, bs, h, f).mean(axis=2)
    rows = jnp.clip(pool[:, None] + jnp.arange(bs), 0, s - 1).reshape(-1)
    return jnp.take(x, rows, axis=1).reshape(b, tc, bs, h, f).mean(axis=2)


def _cmp_visible(c: dict[str, Any], tc: int, bs: int) -> jax.Array:
    """[B|1, 1, 1, cq, TC]: compressed token u is a whole block in the query's past."""
    pos, first = c["pos"][:, None, None, :, None], c["first"][:, None, None, :, None]
    u = jnp.arange(tc)
    return (u >= first) & ((u - first + 1) * bs - 1 <= pos)


def _slots(c: dict[str, Any], idx: jax.Array, geo: _Layout) -> tuple[jax.Array, jax.Array]:
    """Window starts [B, Hkv, cq·T] and visibility [B, Hkv, 1, cq, T·bs] of selected blocks.

    A slot is visible up to the query's position, unless empty (negative) or repeating an
    earlier slot's block; a masked slot's clipped window may land anywhere.
    """
    bs, s = geo.bs, geo.s
    offsets = idx[..., None] * bs + jnp.arange(bs)  # [B, Hkv, cq, T, bs]
    earlier = jnp.tri(idx.shape[-1], k=-1, dtype=bool)
    repeated = jnp.any((idx[..., :, None] == idx[..., None, :]) & earlier, axis=-1)
    keep = (idx >= 0) & ~repeated
    visible = keep[..., None] & (offsets <= c["pos"][:, None, :, None, None])
    visible = visible.reshape(*visible.shape[:3], -1)[:, :, None]
    starts = jnp.clip(c["start"][:, None, :, None] + idx * bs, 0, s)
    return starts.reshape(geo.b, geo.hkv, -1), visible


@functools.partial(jax.jit, static_argnames="st")
def _sparse_forward(
    a: dict[str, Any], st: _Statics
) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """``g_cmp ⊙ o_cmp + g_slc ⊙ o_slc`` float32 [B, S, Hq, Dv], and the chunked residuals,
    from :data:`_BRANCH_ARRAYS` and ``block_indices``."""
    query, g_cmp, g_slc, cu_seqlens = (a[n] for n in ("query", "g_cmp", "g_slc", "cu_seqlens"))
    block_indices = a["block_indices"]
    # Non-finite keys/values read as 0, so a hidden one reaches no row, block choice or
    # compressed token that cannot see it (attention_semantics).
    key, value = finite_or_zero(a["key"]), finite_or_zero(a["value"])
    geo = _Layout.of(query, value, st, cu_seqlens is not None)
    seqs = _sequences(geo, cu_seqlens)
    k_cmp = _compress(key, geo.bs, seqs["pool"]).transpose(0, 2, 1, 3)  # [B, Hkv, TC, D]
    v_cmp = _compress(value, geo.bs, seqs["pool"]).transpose(0, 2, 1, 3)
    k_rows, v_rows = _rows(key, geo), _rows(value, geo)
    xs = _chunk_inputs(geo, query, g_cmp, g_slc, seqs)
    xs["idx"] = None if block_indices is None else geo.chunked(block_indices.astype(jnp.int32), -1)

    def one_chunk(c: dict[str, Any]) -> tuple[jax.Array, Any]:
        q = c["q"]  # [B, Hkv, G, cq, D]
        cmp_visible = _cmp_visible(c, k_cmp.shape[2], geo.bs)
        logits = _dot("bhgqd,bhud->bhgqu", q, k_cmp) * st.scale
        p_cmp, lse_cmp = _softmax_rows(logits, cmp_visible)
        o_cmp = _dot("bhgqu,bhud->bhgqd", p_cmp, v_cmp)
        idx = _select(p_cmp, c, geo, st) if st.select else c["idx"].transpose(0, 2, 1, 3)
        starts, visible = _slots(c, idx, geo)
        k_sel = _windows(k_rows, starts, geo.bs).reshape(geo.b, geo.hkv, geo.cq, -1, geo.d)
        v_sel = _windows(v_rows, starts, geo.bs).reshape(geo.b, geo.hkv, geo.cq, -1, geo.dv)
        logits = _dot("bhgqd,bhqnd->bhgqn", q, k_sel) * st.scale
        p_slc, lse_slc = _softmax_rows(logits, visible)
        o_slc = _dot("bhgqn,bhqnd->bhgqd", p_slc.astype(v_sel.dtype), v_sel)
        out = c["g_cmp"][..., None] * o_cmp + c["g_slc"][..., None] * o_slc
        if not st.residuals:
            return out, None
        saved = {"o_cmp": o_cmp, "o_slc": o_slc, "lse_cmp": lse_cmp, "lse_slc": lse_slc}
        return out, {**saved, "idx": idx}

    out, saved = _map(one_chunk, xs, geo.n_chunks)
    return geo.unchunked(out), saved


@functools.partial(jax.jit, static_argnames="st")
def _sparse_backward(
    a: dict[str, Any], saved: dict[str, jax.Array], d_out: jax.Array, st: _Statics
) -> dict[str, Any]:
    """Gradients of the compressed and selected branches (q, k, v float32; gates cast), from
    :data:`_BRANCH_ARRAYS` and the forward's chunked residuals."""
    query, g_cmp, g_slc, cu_seqlens = (a[n] for n in ("query", "g_cmp", "g_slc", "cu_seqlens"))
    key, value = finite_or_zero(a["key"]), finite_or_zero(a["value"])
    geo = _Layout.of(query, value, st, cu_seqlens is not None)
    seqs = _sequences(geo, cu_seqlens)
    k_cmp, pool_k = jax.vjp(lambda k: _compress(k, geo.bs, seqs["pool"]), key)
    v_cmp, pool_v = jax.vjp(lambda v: _compress(v, geo.bs, seqs["pool"]), value)
    k_cmp, v_cmp = k_cmp.transpose(0, 2, 1, 3), v_cmp.transpose(0, 2, 1, 3)
    k_rows, v_rows = _rows(key, geo), _rows(value, geo)
    xs = _chunk_inputs(geo, query, g_cmp, g_slc, seqs)
    d_out = d_out.astype(jnp.float32).reshape(geo.b, geo.s, geo.hkv, geo.group, geo.dv)
    xs["d_out"] = geo.chunked(d_out).transpose(0, 1, 3, 4, 2, 5)  # [n, B, Hkv, G, cq, Dv]
    xs.update(saved)
    tc = k_cmp.shape[2]
    f32 = lambda *shape: jnp.zeros(shape, jnp.float32)
    init = {
        "dk_cmp": f32(geo.b, geo.hkv, tc, geo.d),
        "dv_cmp": f32(geo.b, geo.hkv, tc, geo.dv),
        "dk_rows": f32(*k_rows.shape),
        "dv_rows": f32(*v_rows.shape),
    }

    def one_chunk(acc: dict[str, jax.Array], c: dict[str, Any]) -> tuple[Any, Any]:
        q, d_o = c["q"], c["d_out"]
        # dO of each branch, and D = rowsum(dO_branch ⊙ O_branch) (FlashAttention-2 Sec. 3.1.2).
        do_cmp, do_slc = c["g_cmp"][..., None] * d_o, c["g_slc"][..., None] * d_o
        d_g_cmp = jnp.sum(d_o * c["o_cmp"], axis=-1)
        d_g_slc = jnp.sum(d_o * c["o_slc"], axis=-1)
        # Compressed branch: dense against every compressed token.
        logits = _dot("bhgqd,bhud->bhgqu", q, k_cmp) * st.scale
        p = jnp.where(_cmp_visible(c, tc, geo.bs), jnp.exp(logits - c["lse_cmp"][..., None]), 0.0)
        ds = p * (_dot("bhgqd,bhud->bhgqu", do_cmp, v_cmp) - (c["g_cmp"] * d_g_cmp)[..., None])
        dq = _dot("bhgqu,bhud->bhgqd", ds, k_cmp)
        acc = {
            **acc,
            "dv_cmp": acc["dv_cmp"] + _dot("bhgqu,bhgqd->bhud", p, do_cmp),
            "dk_cmp": acc["dk_cmp"] + _dot("bhgqu,bhgqd->bhud", ds, q.astype(jnp.float32)),
        }
        # Selected branch: the same algebra on the gathered windows, scattered back.
        starts, visible = _slots(c, c["idx"], geo)
        k_sel = _windows(k_rows, starts, geo.bs).reshape(geo.b, geo.hkv, geo.cq, -1, geo.d)
        v_sel = _windows(v_rows, starts, geo.bs).reshape(geo.b, geo.hkv, geo.cq, -1, geo.dv)
        logits = _dot("bhgqd,bhqnd->bhgqn", q, k_sel) * st.scale
        p = jnp.where(visible, jnp.exp(logits - c["lse_slc"][..., None]), 0.0)
        dp = _dot("bhgqd,bhqnd->bhgqn", do_slc.astype(v_sel.dtype), v_sel)
        ds = p * (dp - (c["g_slc"] * d_g_slc)[..., None])
        dq = dq + _dot("bhgqn,bhqnd->bhgqd", ds.astype(k_sel.dtype), k_sel)
        dk_sel = _dot("bhgqn,bhgqd->bhqnd", ds, q.astype(jnp.float32)) * st.scale
        dv_sel = _dot("bhgqn,bhgqd->bhqnd", p, do_slc)
        windows = (geo.b, geo.hkv, starts.shape[-1], geo.bs)
        acc["dk_rows"] = _add_windows(acc["dk_rows"], starts, dk_sel.reshape(*windows, geo.d))
        acc["dv_rows"] = _add_windows(acc["dv_rows"], starts, dv_sel.reshape(*windows, geo.dv))
        return acc, (dq * st.scale, d_g_cmp, d_g_slc)

    acc, (dq, d_g_cmp, d_g_slc) = lax.scan(one_chunk, init, xs)
    dk = acc["dk_rows"][:, :, : geo.s].transpose(0, 2, 1, 3)
    dv = acc["dv_rows"][:, :, : geo.s].transpose(0, 2, 1, 3)
    dk = dk + pool_k(acc["dk_cmp"].transpose(0, 2, 1, 3) * st.scale)[0]
    dv = dv + pool_v(acc["dv_cmp"].transpose(0, 2, 1, 3))[0]
    return {
        "query": geo.unchunked(dq),
        "key": dk,
        "value": dv,
        "g_cmp": geo.unchunked(d_g_cmp[..., None])[..., 0].astype(g_cmp.dtype),
        "g_slc": geo.unchunked(d_g_slc[..., None])[..., 0].astype(g_slc.dtype),
    }


def _chunk_inputs(
    geo: _Layout, query: jax.Array, g_cmp: jax.Array, g_slc: jax.Array, seqs: dict[str, Any]
) -> dict[str, Any]:
    """Per-chunk inputs: queries [B, Hkv, G, cq, D], gates [B, Hkv, G, cq] f32, layout."""
    gate = lambda g: geo.chunked(
        g.astype(jnp.float32).reshape(geo.b, geo.s, geo.hkv, geo.group)
    ).transpose(0, 1, 3, 4, 2)
    q = geo.chunked(query.reshape(geo.b, geo.s, geo.hkv, geo.group, geo.d))
    return {
        "q": q.transpose(0, 1, 3, 4, 2, 5),
        "g_cmp": gate(g_cmp),
        "g_slc": gate(g_slc),
        "start": geo.chunked(seqs["start"]),
        "pos": geo.chunked(seqs["pos"], -1),  # padded queries see nothing
        "first": geo.chunked(seqs["first"]),
    }


def _select(p_cmp: jax.Array, c: dict[str, Any], geo: _Layout, st: _Statics) -> jax.Array:
    """Top-k blocks [B, Hkv, cq, T] of the query's own sequence from compressed probabilities."""
    tc = p_cmp.shape[-1]
    local = jnp.clip(c["first"][:, :, None] + jnp.arange(geo.num_blocks), 0, tc - 1)
    # Entries of blocks not (yet) complete are ignored by the selection rule.
    p_local = jnp.take_along_axis(p_cmp, local[:, None, None].astype(jnp.int32), axis=-1)
    idx = nsa_select_blocks(
        p_local.transpose(0, 3, 1, 2, 4),  # [B, cq, Hkv, G, NB]
        c["pos"],
        block_size=geo.bs,
        block_counts=st.block_counts,
        num_blocks=geo.num_blocks,
    )
    return lax.stop_gradient(idx).transpose(0, 2, 1, 3)


def _rows(x: jax.Array, geo: _Layout) -> jax.Array:
    """[B, S, H, F] -> [B, H, S + bs, F]: a window of bs rows starting in [0, S] fits."""
    return pad_axis(x.transpose(0, 2, 1, 3), 2, geo.s + geo.bs)


def _windows(rows: jax.Array, starts: jax.Array, size: int) -> jax.Array:
    """``rows[b, h, starts[b, h, n] : + size]``: [B, H, R, F], [B, H, N] -> [B, H, N, size, F].

    One gather of contiguous ``size × F`` slices.
    """
    window = lambda x, start: lax.dynamic_slice_in_dim(x, start, size, axis=0)
    return jax.vmap(jax.vmap(jax.vmap(window, in_axes=(None, 0))))(rows, starts)


def _add_windows(acc: jax.Array, starts: jax.Array, updates: jax.Array) -> jax.Array:
    """``acc[b, h, starts[b, h, n] : + size] += updates[b, h, n]`` (float32, in place)."""
    size = updates.shape[3]
    rows = (starts[..., None] + jnp.arange(size)).reshape(*starts.shape[:2], -1)
    flat = updates.reshape(*rows.shape, updates.shape[-1])
    add = lambda a, r, u: a.at[r].add(u, indices_are_sorted=False, unique_indices=False)
    return jax.vmap(jax.vmap(add))(acc, rows, flat)


def _map(fn: Any, xs: dict[str, Any], n: int) -> Any:
    """``lax.map`` over chunks; a single chunk runs unrolled."""
    if n == 1:
        return jax.tree.map(lambda y: y[None], fn(jax.tree.map(lambda x: x[0], xs)))
    return lax.map(fn, xs)


def _softmax_rows(logits: jax.Array, visible: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax over the visible entries of the last axis and its logsumexp.

    Rows with nothing visible give zeros and a logsumexp that zeroes any recomputed entry.
    """
    logits = mask_scores(logits, visible)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = hide(jnp.exp(logits - m), visible)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    seen = denom > 0.0
    p = p / jnp.where(seen, denom, 1.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), EMPTY_ROW_LSE)
    return p, lse[..., 0]


def _dot(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """Einsum accumulating in float32.

    On CPU half-precision operands are widened first: XLA:CPU cannot run some batched
    bf16 × bf16 → f32 dots (``Unsupported element type for DotThunk``).
    """
    if backend() == "cpu":
        x, y = (z.astype(jnp.float32) if z.dtype.itemsize < 4 else z for z in (x, y))
    return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)
