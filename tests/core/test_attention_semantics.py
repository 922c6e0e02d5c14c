"""``ejkernel.attention_semantics`` holds every platform to one masking rule.

Random geometries (seeded: Sq ≠ Sk, odd sizes, GQA, causal, windows, segments with padding,
attention masks, soft caps, sinks) get NaN and ±Inf planted into keys and values at positions
some rows cannot see. For the rows that cannot see a planted entry, the references and every
implementation of ``PLATFORMS`` must give the same output and gradients as on clean inputs,
finite; a row that sees nothing returns exact zeros with zero gradient. The dense visibility
must equal the elementwise predicate (and a plain-Python reading of OPS.md), and the
geometry's block helpers must agree with it. The paged serving ops get NaN/Inf inside a
sequence's own pages, at tokens the causal mask or the window hides from some of its queries
and just past its length; the dense decode, around each row's range and window (float8
caches too).

A platform joins by adding its name to ``PLATFORMS`` (calls go through ``ejkernel.<op>(...,
platform=p)``).
"""

from __future__ import annotations

import importlib
import zlib
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import ejkernel
from ejkernel.attention_semantics import Geometry, Tiling, dense_visibility, visible
from ejkernel.specs.attention import attention_reference
from ejkernel.specs.blocksparse_attention import (
    blocksparse_attention_reference,
    dense_block_mask,
)
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.specs.multi_head_latent_attention import multi_head_latent_attention_reference
from ejkernel.specs.native_sparse_attention import native_sparse_attention_reference
from ejkernel.specs.scaled_dot_product_attention import scaled_dot_product_attention_reference
from ejkernel.testing import AttentionShape

#: Platforms whose implementations the property runs against.
PLATFORMS = ["xla"]
#: Ops that take flash attention's arguments.
FLASH_OPS = ["flash_attention", "scaled_dot_product_attention", "attention", "ring_attention"]
REFERENCES = {
    "flash_attention": flash_attention_reference,
    "scaled_dot_product_attention": scaled_dot_product_attention_reference,
    "attention": attention_reference,
    "ring_attention": flash_attention_reference,
    "blocksparse_attention": blocksparse_attention_reference,
    "multi_head_latent_attention": multi_head_latent_attention_reference,
    "native_sparse_attention": native_sparse_attention_reference,
}


@attrs.frozen(kw_only=True)
class Case(AttentionShape):
    """An attention problem: its shape and which of the masks and options it uses."""

    causal: bool
    window: tuple[int, int] | None
    segments: bool
    mask: bool
    soft_cap: float | None
    sinks: bool

    def __str__(self) -> str:
        flags = [
            "causal" * self.causal,
            f"w{self.window[0]}-{self.window[1]}" if self.window else "",
            "seg" * self.segments,
            "mask" * self.mask,
            "cap" * (self.soft_cap is not None),
            "sinks" * self.sinks,
        ]
        return "-".join([super().__str__(), *(f for f in flags if f)])

    @property
    def geometry(self) -> Geometry:
        query = jax.ShapeDtypeStruct((self.b, self.sq, self.hq, self.d), jnp.float32)
        key = jax.ShapeDtypeStruct((self.b, self.sk, self.hkv, self.d), jnp.float32)
        return Geometry.of(query, key, causal=self.causal, window=self.window)


def draw_cases(n: int, seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    cases = []
    for index in range(n):
        sq = int(rng.choice([1, 5, 16, 37]))
        sk = 37 if index == 0 else int(rng.choice([sq, 7, 24, 37]))
        hkv = int(rng.choice([1, 2]))
        causal = bool(rng.random() < 0.6)
        window = None
        if rng.random() < 0.4:
            window = (int(rng.integers(0, 9)), int(rng.integers(0, 9)))
        segments = bool(rng.random() < 0.4)
        causal = causal or (window is None and not segments)  # something is always hidden
        segments = segments or (sq == 1 and window is None)  # a decode row sees every key
        cases.append(
            Case(
                b=int(rng.choice([1, 2])),
                sq=sq,
                sk=sk,
                hq=hkv * int(rng.choice([1, 2])),
                hkv=hkv,
                d=int(rng.choice([8, 12])),
                causal=causal,
                window=window,
                segments=segments,
                mask=bool(rng.random() < 0.3),
                soft_cap=20.0 if rng.random() < 0.3 else None,
                sinks=bool(rng.random() < 0.3),
            )
        )
    return cases


CASES = draw_cases(12, seed=27)


def masking(case: Case, rng: np.random.Generator) -> dict[str, Any]:
    """The masking arguments of a case (segment ids with padding, a random mask)."""
    kw: dict[str, Any] = {"causal": case.causal, "sliding_window": case.window}
    if case.segments:
        q_seg = np.sort(rng.integers(0, 3, (case.b, case.sq)), axis=1)
        kv_seg = np.sort(rng.integers(0, 3, (case.b, case.sk)), axis=1)
        q_seg[:, -1:] = -1  # a padded query: sees nothing
        kv_seg[:, -1:] = -1  # a padded key
        kw["q_segment_ids"] = jnp.asarray(q_seg, jnp.int32)
        kw["kv_segment_ids"] = jnp.asarray(kv_seg, jnp.int32)
    if case.mask:
        kw["attention_mask"] = jnp.asarray(rng.random((case.b, 1, case.sq, case.sk)) < 0.8)
    if case.soft_cap is not None:
        kw["logits_soft_cap"] = case.soft_cap
    return kw


def plant(
    arrays: dict[str, np.ndarray], hidden_somewhere: np.ndarray, rng: np.random.Generator
) -> tuple[dict[str, jax.Array], np.ndarray]:
    """NaN/±Inf into ``key``/``value`` rows ``[b, k, hkv]`` some row cannot see.

    Returns the poisoned arrays and the planted ``[B, Sk, Hkv]`` bool map.
    """
    candidates = np.argwhere(hidden_somewhere)
    planted = np.zeros(hidden_somewhere.shape, bool)
    poisoned = {n: x.copy() for n, x in arrays.items()}
    picks = rng.choice(len(candidates), size=min(3, len(candidates)), replace=False)
    for n, index in enumerate(picks):
        b, k, h = candidates[index]
        planted[b, k, h] = True
        name = ("value", "key", "value")[n]
        poisoned[name][b, k, h, rng.integers(0, poisoned[name].shape[-1])] = (
            np.nan,
            np.inf,
            -np.inf,
        )[n]
    return {n: jnp.asarray(x) for n, x in poisoned.items()}, planted


def row_and_key_maps(vis: np.ndarray, planted: np.ndarray, group: int) -> Any:
    """Clean rows ``[B, Sq, Hq]``, clean keys ``[B, Sk, Hkv]`` and empty rows ``[B, Sq, Hq]``.

    A row is clean when it sees no planted entry; a key is clean when it is not planted and
    only clean rows see it (its gradient gathers only from them).
    """
    b, hq, _, sk = vis.shape
    hkv = hq // group
    planted_q = np.repeat(planted, group, axis=2).transpose(0, 2, 1)  # [B, Hq, Sk]
    dirty = np.any(vis & planted_q[:, :, None, :], axis=-1)  # [B, Hq, Sq]
    seen_by_dirty = np.any(vis & dirty[..., None], axis=2)  # [B, Hq, Sk]
    seen_by_dirty = seen_by_dirty.reshape(b, hkv, group, sk).any(axis=2).transpose(0, 2, 1)
    clean_keys = ~planted & ~seen_by_dirty
    empty = ~vis.any(axis=-1)
    return ~dirty.transpose(0, 2, 1), clean_keys, empty.transpose(0, 2, 1)


def one_device_ring(**kwargs: Any) -> Any:
    """``ejkernel.ring_attention`` on a ring of one device (the ring kernel, not flash)."""
    mesh = jax.make_mesh((1,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
    arrays = {n: x for n, x in kwargs.items() if hasattr(x, "shape")}
    statics = {n: x for n, x in kwargs.items() if n not in arrays}
    names = tuple(arrays)

    def inner(*xs: Any) -> Any:
        return ejkernel.ring_attention(**dict(zip(names, xs)), **statics, axis_name="sp")

    specs = tuple(P() if arrays[n].ndim <= 1 else P(None, "sp") for n in names)
    return jax.shard_map(inner, mesh=mesh, in_specs=specs, out_specs=P(None, "sp"))(
        *arrays.values()
    )


def op_fn(op: str, platform: Any) -> Any:
    """``ejkernel.<op>`` on ``platform`` (``None``: the op's reference; a callable: itself)."""
    if platform is None:
        return REFERENCES[op]
    if callable(platform):
        return platform
    if op == "ring_attention":
        return lambda **a: one_device_ring(**a, platform=platform)
    return lambda **a: getattr(ejkernel, op)(**a, platform=platform)


def run(fn: Any, arrays: dict[str, jax.Array], kw: dict[str, Any]) -> Any:
    """Output and (q, k, v) gradients of ``fn`` under a fixed, non-uniform cotangent."""
    others = {n: x for n, x in arrays.items() if n not in ("query", "key", "value")}

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> Any:
        out = fn(query=q, key=k, value=v, **others, **kw)
        out = out[0] if isinstance(out, tuple) else out
        ct = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        arrays["query"], arrays["key"], arrays["value"]
    )
    return out, grads


def check_rows(got: Any, want: Any, clean_rows: np.ndarray, clean_keys: np.ndarray, empty: Any):
    out, (dq, dk, dv) = got
    out_w, (dq_w, dk_w, dv_w) = want
    group = out.shape[2] // dk.shape[2]
    for name, x, x_w, rows in (
        ("out", out, out_w, clean_rows),
        ("dq", dq, dq_w, clean_rows),
        ("dk", dk, dk_w, clean_keys),
        ("dv", dv, dv_w, clean_keys),
    ):
        x, x_w = np.asarray(x, np.float32), np.asarray(x_w, np.float32)
        assert np.isfinite(x[rows]).all(), f"{name}: non-finite where nothing planted is seen"
        np.testing.assert_allclose(x[rows], x_w[rows], rtol=1e-5, atol=1e-6, err_msg=name)
    assert group >= 1
    empty_rows = np.asarray(out, np.float32)[empty]
    assert (empty_rows == 0).all(), "a row that sees nothing must return exact zeros"
    assert (np.asarray(dq, np.float32)[empty] == 0).all(), "and have a zero gradient"


def flash_inputs(case: Case, op: str) -> tuple[dict[str, np.ndarray], dict[str, Any], np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    arrays = {
        "query": rng.standard_normal((case.b, case.sq, case.hq, case.d)).astype(np.float32),
        "key": rng.standard_normal((case.b, case.sk, case.hkv, case.d)).astype(np.float32),
        "value": rng.standard_normal((case.b, case.sk, case.hkv, case.d)).astype(np.float32),
    }
    kw = masking(case, rng)
    if case.sinks and op != "scaled_dot_product_attention":
        kw["softmax_aux"] = jnp.asarray(rng.standard_normal((case.hq,)), jnp.float32)
    vis = np.asarray(
        dense_visibility(
            case.geometry,
            kw.get("attention_mask"),
            kw.get("q_segment_ids"),
            kw.get("kv_segment_ids"),
        )
    )
    return arrays, kw, vis


#: Each case runs one op of the flash family (in turn), so every op meets several geometries.
FLASH_CASES = [pytest.param(op, case, id=f"{op}-{case}") for case, op in zip(CASES, FLASH_OPS * 3)]


@pytest.mark.parametrize("platform", [None, *PLATFORMS], ids=lambda p: p or "reference")
@pytest.mark.parametrize(("op", "case"), FLASH_CASES)
def test_hidden_nan_and_inf_never_reach_a_row(op: str, case: Case, platform: str | None) -> None:
    arrays, kw, vis = flash_inputs(case, op)
    # Keys some row of the KV head cannot see: [B, Sk, Hkv].
    hidden = ~vis.reshape(case.b, case.hkv, -1, case.sq, case.sk).all(axis=(2, 3))
    if not hidden.any():
        pytest.skip("every row sees every key: nothing to hide")
    rng = np.random.default_rng(7)
    poisoned, planted = plant(arrays, hidden.transpose(0, 2, 1), rng)
    clean_rows, clean_keys, empty = row_and_key_maps(vis, planted, case.hq // case.hkv)
    kw_arrays = {n: x for n, x in kw.items() if hasattr(x, "shape")}
    statics = {n: x for n, x in kw.items() if n not in kw_arrays}
    clean = {n: jnp.asarray(x) for n, x in arrays.items()}
    want = run(op_fn(op, platform), {**clean, **kw_arrays}, statics)
    got = run(op_fn(op, platform), {**poisoned, **kw_arrays}, statics)
    check_rows(got, want, clean_rows, clean_keys, empty)


# -- the predicate and the block helpers -------------------------------------------------------


def ops_md_visible(case: Case, kw: dict[str, Any], b: int, h: int, i: int, j: int) -> bool:
    """OPS.md's sentences, in plain Python."""
    p = case.sk - case.sq + i
    if case.causal and j > p:
        return False
    if case.window is not None and not (p - case.window[0] <= j <= p + case.window[1]):
        return False
    if "q_segment_ids" in kw:
        qs, ks = int(kw["q_segment_ids"][b, i]), int(kw["kv_segment_ids"][b, j])
        if qs < 0 or qs != ks:
            return False
    return "attention_mask" not in kw or bool(kw["attention_mask"][b, 0, i, j])


@pytest.mark.parametrize("case", CASES[:6], ids=str)
def test_dense_visibility_is_the_elementwise_predicate_and_ops_md(case: Case) -> None:
    _, kw, vis = flash_inputs(case, "flash_attention")
    q = np.arange(case.sq)[:, None] + case.sk - case.sq
    k = np.arange(case.sk)[None, :]
    segments = {}
    if "q_segment_ids" in kw:
        segments = {
            "q_segment_ids": kw["q_segment_ids"][:, None, :, None],
            "kv_segment_ids": kw["kv_segment_ids"][:, None, None, :],
        }
    elementwise = visible(
        q,
        k,
        causal=case.causal,
        window=case.window,
        attention_mask=kw.get("attention_mask"),
        **segments,
    )
    np.testing.assert_array_equal(np.broadcast_to(elementwise, vis.shape), vis)
    plain = np.array(
        [
            [[ops_md_visible(case, kw, b, 0, i, j) for j in range(case.sk)] for i in range(case.sq)]
            for b in range(case.b)
        ]
    )
    np.testing.assert_array_equal(vis[:, 0], plain)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_block_helpers_agree_with_the_predicate(case: Case) -> None:
    geo = case.geometry
    vis = np.asarray(geo.visible(np.arange(case.sq)[:, None], np.arange(case.sk)[None, :]))
    for bq, bk in ((1, 1), (4, 8), (16, 5)):
        nq, nk = -(-case.sq // bq), -(-case.sk // bk)
        traced = np.broadcast_to(
            jax.jit(lambda i, j, bq=bq, bk=bk: geo.block_may_see(i, j, bq, bk))(
                jnp.arange(nq)[:, None], jnp.arange(nk)[None, :]
            ),
            (nq, nk),
        )
        for i in range(nq):
            rows = vis[i * bq : (i + 1) * bq]
            lo, hi = geo.kv_range(i, bq)
            seen = np.flatnonzero(rows.any(axis=0))
            assert seen.size == 0 or (lo <= seen.min() and seen.max() < hi), (i, lo, hi)
            first, last = geo.kv_blocks(i, bq, bk)
            for j in range(nk):
                tile = rows[:, j * bk : (j + 1) * bk]
                may = geo.block_may_see(i, j, bq, bk)
                assert may == traced[i, j], "traced and Python indices must agree"
                if not may:
                    assert not tile.any(), ("block_may_see is False but a pair is visible", i, j)
                if tile.any():
                    assert first <= j < last, (i, j, first, last)
                if geo.block_fully_visible(i, j, bq, bk):
                    assert tile.all(), ("block_fully_visible but a pair is hidden", i, j)
        for j in range(nk):
            cols = vis[:, j * bk : (j + 1) * bk]
            lo, hi = geo.q_range(j, bk)
            seen = np.flatnonzero(cols.any(axis=1))
            assert seen.size == 0 or (lo <= seen.min() and seen.max() < hi), (j, lo, hi)
            first, last = geo.q_blocks(j, bq, bk)
            for i in range(nq):
                if vis[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any():
                    assert first <= i < last, (i, j, first, last)


@pytest.mark.parametrize(
    ("sq", "sk", "bq", "bk"),
    [
        pytest.param(37, 129, 16, 64, id="Sq37-Sk129-bq16-bk64"),
        pytest.param(1, 37, 8, 128, id="Sq1-Sk37-bq8-bk128"),
        pytest.param(64, 64, 64, 32, id="Sq64-Sk64-bq64-bk32"),
    ],
)
def test_block_tiling_covers_each_sequence_with_whole_blocks(
    sq: int, sk: int, bq: int, bk: int
) -> None:
    tiles = Geometry(batch=2, sq=sq, sk=sk, num_q_heads=8, num_kv_heads=2).tiling(bq, bk)
    assert tiles == Tiling(sq=sq, sk=sk, bq=bq, bk=bk)
    for n, b, blocks, padded in (
        (sq, bq, tiles.nq, tiles.sq_pad),
        (sk, bk, tiles.nk, tiles.sk_pad),
    ):
        assert padded == blocks * b
        assert (blocks - 1) * b < n <= padded, "every row in a block, no block empty"


# -- ops with their own arguments --------------------------------------------------------------


#: Interpreted platforms with a block-sparse kernel (run with EJKERNEL_INTERPRET=1).
INTERPRETED_BLOCKSPARSE = ["triton"]


@pytest.mark.parametrize(
    "platform", [None, *PLATFORMS, *INTERPRETED_BLOCKSPARSE], ids=lambda p: p or "reference"
)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # see NUMPY_NAN
def test_blocksparse_hidden_nan_never_reaches_a_row(
    platform: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if platform in INTERPRETED_BLOCKSPARSE:
        pytest.importorskip(f"ejkernel_{platform}")
        monkeypatch.setenv("EJKERNEL_INTERPRET", "1")
    case = Case(
        b=2, sq=37, sk=24, hq=4, hkv=2, d=8, causal=True, window=None,
        segments=True, mask=False, soft_cap=None, sinks=False,
    )  # fmt: skip
    arrays, kw, _ = flash_inputs(case, "blocksparse_attention")
    bq, bk = 8, 8
    rng = np.random.default_rng(3)
    block_mask = jnp.asarray(rng.random((case.b, 1, -(-case.sq // bq), -(-case.sk // bk))) < 0.7)
    kw = {**kw, "block_mask": block_mask, "block_size": (bq, bk)}
    dense = dense_block_mask(block_mask, (bq, bk), case.sq, case.sk)
    vis = np.asarray(
        dense_visibility(case.geometry, dense, kw["q_segment_ids"], kw["kv_segment_ids"])
    )
    hidden = ~vis.reshape(case.b, case.hkv, -1, case.sq, case.sk).all(axis=(2, 3))
    poisoned, planted = plant(arrays, hidden.transpose(0, 2, 1), rng)
    clean_rows, clean_keys, empty = row_and_key_maps(vis, planted, case.hq // case.hkv)
    fn = op_fn("blocksparse_attention", platform)
    kw_arrays = {n: x for n, x in kw.items() if hasattr(x, "shape")}
    statics = {n: x for n, x in kw.items() if n not in kw_arrays}
    clean = {n: jnp.asarray(x) for n, x in arrays.items()}
    want = run(fn, {**clean, **kw_arrays}, statics)
    got = run(fn, {**poisoned, **kw_arrays}, statics)
    check_rows(got, want, clean_rows, clean_keys, empty)


@pytest.mark.parametrize("platform", [None, *PLATFORMS], ids=lambda p: p or "reference")
def test_mla_hidden_nan_stays_in_its_rows_and_batch(platform: str | None) -> None:
    b, s, hq, r, dn, dr, dv = 2, 21, 2, 16, 8, 4, 8
    rng = np.random.default_rng(5)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    arrays = {
        "query": normal(b, s, hq, dn + dr),
        "key_value": normal(b, s, r) * r**-0.5,
        "w_kc": normal(r, hq, dn),
        "w_vc": normal(r, hq, dv),
        "k_rope": normal(b, s, dr),
    }
    poisoned = {n: x.copy() for n, x in arrays.items()}
    poisoned["key_value"][0, 13, 3] = np.nan  # batch 0, key 13: rows < 13 cannot see it
    poisoned["k_rope"][0, 17, 1] = np.inf
    call = op_fn("multi_head_latent_attention", platform)
    fn = lambda a: call(**a, causal=True)

    def out_and_grads(a: dict[str, np.ndarray]) -> Any:
        a = {n: jnp.asarray(x) for n, x in a.items()}
        loss = lambda a: (jnp.sum(fn(a) * jnp.arange(dv, dtype=jnp.float32)), fn(a))
        (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(a)
        return np.asarray(out), grads

    out_w, grads_w = out_and_grads(arrays)
    out, grads = out_and_grads(poisoned)
    np.testing.assert_allclose(out[0, :13], out_w[0, :13], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[1], out_w[1], rtol=1e-5, atol=1e-6)
    dq, dq_w = np.asarray(grads["query"]), np.asarray(grads_w["query"])
    np.testing.assert_allclose(dq[0, :13], dq_w[0, :13], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dq[1], dq_w[1], rtol=1e-5, atol=1e-6)
    for name in ("key_value", "k_rope"):  # batch 1 shares nothing with the planted entries
        g, g_w = np.asarray(grads[name]), np.asarray(grads_w[name])
        np.testing.assert_allclose(g[1], g_w[1], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("platform", [None, *PLATFORMS], ids=lambda p: p or "reference")
def test_nsa_hidden_nan_stays_in_the_rows_that_see_it(platform: str | None) -> None:
    b, s, hq, hkv, d = 1, 40, 4, 1, 8
    rng = np.random.default_rng(9)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    arrays = {
        "query": normal(b, s, hq, d),
        "key": normal(b, s, hkv, d),
        "value": normal(b, s, hkv, d),
        "g_cmp": normal(b, s, hq),
        "g_slc": normal(b, s, hq),
        "g_swa": normal(b, s, hq),
    }
    poisoned = {n: x.copy() for n, x in arrays.items()}
    poisoned["value"][0, 29, 0, 2] = np.nan  # key 29: causally hidden from queries < 29
    poisoned["key"][0, 33, 0, 5] = np.inf
    call = op_fn("native_sparse_attention", platform)
    fn = lambda a: call(**a, block_size=4, block_counts=3, window_size=5)

    def out_and_dq(a: dict[str, np.ndarray]) -> Any:
        a = {n: jnp.asarray(x) for n, x in a.items()}
        loss = lambda q: (jnp.sum(fn({**a, "query": q})), fn({**a, "query": q}))
        (_, out), dq = jax.jit(jax.value_and_grad(loss, has_aux=True))(a["query"])
        return np.asarray(out), np.asarray(dq)

    out_w, dq_w = out_and_dq(arrays)
    out, dq = out_and_dq(poisoned)
    np.testing.assert_allclose(out[0, :29], out_w[0, :29], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dq[0, :29], dq_w[0, :29], rtol=1e-5, atol=1e-6)


#: Kernel platforms run through their interpreters on the CPU, on the flash-attention cases whose
#: features they implement (Pallas declines masks and sinks; the XLA plugin serves those).
INTERPRETED = ["pallas", "triton"]
#: An interpreter's numpy warns where a kernel makes a NaN that stays in the poisoned key's own
#: dK/dV row (Triton's dK/dV kernel leaves its key tile as it is): a warning, not an error.
NUMPY_NAN = "invalid value encountered"
#: Interpreted platforms whose kernels take masks and sinks too.
WITH_MASKS_AND_SINKS = {"triton"}
#: Geometries where a row that sees a planted key has hidden keys that only clean rows see
#: (windows, segments): its lse is NaN there, and its probabilities at those keys must stay 0.
DIRTY_ROW_CASES = [
    Case(
        b=1,
        sq=37,
        sk=37,
        hq=2,
        hkv=1,
        d=16,
        causal=causal,
        window=window,
        segments=segments,
        mask=False,
        soft_cap=None,
        sinks=False,
    )
    for causal, window, segments in [
        (True, (5, 0), False),
        (False, (3, 2), False),
        (True, None, True),
    ]
]
KERNEL_CASES = [
    pytest.param(platform, case, id=f"{platform}-{case}")
    for platform in INTERPRETED
    for case, op in [*zip(CASES, FLASH_OPS * 3), *((c, "flash_attention") for c in DIRTY_ROW_CASES)]
    if op == "flash_attention"
    and (platform in WITH_MASKS_AND_SINKS or (not case.mask and not case.sinks))
]


@pytest.mark.parametrize(("platform", "case"), KERNEL_CASES)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # see NUMPY_NAN
def test_interpreted_kernels_keep_hidden_nan_out(
    platform: str, case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip(f"ejkernel_{platform}")
    monkeypatch.setenv("EJKERNEL_INTERPRET", "1")
    test_hidden_nan_and_inf_never_reach_a_row("flash_attention", case, platform)


def mosaic_gpu_interpreted(*, query: Any, key: Any, value: Any, **kw: Any) -> Any:
    """The Pallas Mosaic GPU flash attention in Mosaic GPU's interpret mode, in bf16 (its
    plugin registers it for GPUs only: called here directly, with its VJP)."""
    from ejkernel_pallas.gpu.flash_attention import flash_attention_pallas as fn

    @jax.custom_vjp
    def attend(q: Any, k: Any, v: Any) -> Any:
        return fn(query=q, key=k, value=v, **kw)

    def bwd(res: Any, g: Any) -> Any:
        grads = fn.bwd(res, g, **kw)
        return grads["query"], grads["key"], grads["value"]

    attend.defvjp(lambda q, k, v: fn.fwd(query=q, key=k, value=v, **kw), bwd)
    return attend(*(x.astype(jnp.bfloat16) for x in (query, key, value)))


@pytest.mark.slow
def test_interpreted_mosaic_gpu_kernels_keep_hidden_nan_out() -> None:
    # bf16, D 64, Sq and Sk multiples of 128, causal: what those kernels implement (compiled
    # on a GPU, interpreted on the CPU)
    if jax.default_backend() not in ("cpu", "gpu"):
        pytest.skip("Mosaic GPU kernels run on a GPU or interpreted on the CPU")
    pytest.importorskip("ejkernel_pallas")
    pytest.importorskip("absl", reason="Mosaic GPU interpret mode needs absl-py")
    case = Case(
        b=1, sq=128, sk=256, hq=2, hkv=1, d=64, causal=True, window=None,
        segments=False, mask=False, soft_cap=None, sinks=False,
    )  # fmt: skip
    test_hidden_nan_and_inf_never_reach_a_row("flash_attention", case, mosaic_gpu_interpreted)


#: Serving ops over a paged cache (forward only), with their argument layout.
PAGED_OPS = {
    "page_attention": "decode",
    "ragged_page_attention": "packed",
    "unified_attention": "packed",
    "prefill_page_attention": "prefill",
}
FP8 = "float8_e4m3fn"
#: Cache scales of the float8 cases: per KV head (Hkv = 2) and per tensor.
FP8_SCALES = {"k_scale": np.array([0.5, 2.0], np.float32), "v_scale": 0.75}
CACHES = [(None, "float32"), (3, "float32"), (3, FP8)]


def put(cache: np.ndarray, page: int, slot: int, value: float) -> None:
    """``cache[page, slot] = value`` (float8 has no Inf: it stores NaN)."""
    cache[page, slot] = np.asarray(value, np.float32).astype(cache.dtype)


@pytest.mark.parametrize("platform", [None, *PLATFORMS], ids=lambda p: p or "reference")
@pytest.mark.parametrize(("window", "cache"), CACHES, ids=["causal", "window-3", "window-3-fp8"])
@pytest.mark.parametrize("op", sorted(PAGED_OPS))
def test_paged_hidden_nan_stays_out_of_the_rows_that_cannot_see_it(
    op: str, window: int | None, cache: str, platform: str | None
) -> None:
    """Inside a sequence's own pages: NaN keys and +Inf values at its last token (seen by its
    last query only; planted where it has more than one query), with a window at the token
    just left of its first query's window (seen by no query), and -Inf keys and NaN values
    just past its length in its last page (no one's token). Every row that cannot see a
    planted entry equals its clean output. (Slots no sequence owns hold NaN in every paged
    example already.)"""
    from ejkernel.testing.cases._paged import PagedBatch

    layout = PAGED_OPS[op]
    spec = importlib.import_module(f"ejkernel.specs.{op}").SPEC
    kv_lens, q_lens = ((37,), (6,)) if layout == "prefill" else ((37, 21), (6, 3))
    batch = PagedBatch(
        kv_lens=kv_lens,
        q_lens=None if layout == "decode" else q_lens,
        hq=4,
        hkv=2,
        d=32,
        page_size=8,
        max_pages=6,
        num_pages=16,
    )
    q_lens = (1,) * len(kv_lens) if layout == "decode" else q_lens
    num_seqs = len(kv_lens) if "num_seqs" in spec.arg_names else None
    example = batch.example(layout, num_seqs=num_seqs, cache_dtype=cache)
    clean = {k: np.asarray(v) for k, v in example.build(spec, "float32").items()}
    kw: dict[str, Any] = {} if window is None else {"sliding_window": (window, 0)}
    kw |= FP8_SCALES if cache == FP8 else {}
    fn = spec.reference if platform is None else op_fn(op, platform)
    tables = clean["page_indices"][None] if layout == "prefill" else clean["block_tables"]
    poisoned = {k: v.copy() for k, v in clean.items()}
    seen_by_last_query = []
    for s, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens, strict=True)):
        planted = [(kv_len - 1, np.nan, np.inf)] if q_len > 1 else []
        if window is not None:
            planted.append((kv_len - q_len - window - 1, np.nan, np.inf))
        planted.append((kv_len, -np.inf, np.nan))  # past the length, inside the last live page
        for pos, key, value in planted:
            page, slot = tables[s, pos // batch.page_size], pos % batch.page_size
            put(poisoned["key_cache"], page, slot, key)
            put(poisoned["value_cache"], page, slot, value)
        if q_len > 1:
            seen_by_last_query.append(sum(q_lens[: s + 1]) - 1)
    want = np.asarray(fn(**{k: jnp.asarray(v) for k, v in clean.items()}, **kw))
    got = np.asarray(fn(**{k: jnp.asarray(v) for k, v in poisoned.items()}, **kw))
    rows = np.setdiff1d(np.arange(got.shape[0]), seen_by_last_query)
    assert np.isfinite(got[rows]).all(), "a row that cannot see a planted entry is not finite"
    np.testing.assert_allclose(got[rows], want[rows], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("platform", [None, *PLATFORMS], ids=lambda p: p or "reference")
@pytest.mark.parametrize("cache", ["float32", FP8])
def test_dense_decode_hidden_nan_stays_out_of_every_row(cache: str, platform: str | None) -> None:
    """``ragged_decode_attention``: NaN keys and +Inf values just left of a row's window
    (inside its valid range), -Inf keys and NaN values just before its start and at its end.
    No row sees them: every row equals its clean output. (Entries outside a row's range hold
    NaN in its examples already.)"""
    from ejkernel.specs.ragged_decode_attention import SPEC
    from ejkernel.testing.cases.ragged_decode_attention import rows_example

    starts, ends, window = (0, 3, 10), (37, 30, 20), 4
    example = rows_example(starts, ends, sk=37, hq=4, hkv=2, d=16, cache_dtype=cache)
    clean = {k: np.asarray(v) for k, v in example.build(SPEC, "float32").items()}
    kw: dict[str, Any] = {"sliding_window": (window, 0), "logits_soft_cap": 5.0}
    kw |= FP8_SCALES if cache == FP8 else {}
    fn = SPEC.reference if platform is None else op_fn("ragged_decode_attention", platform)
    poisoned = {k: v.copy() for k, v in clean.items()}
    for b, (start, end) in enumerate(zip(starts, ends, strict=True)):
        planted = [(end - 2 - window, np.nan, np.inf), (start - 1, -np.inf, np.nan)]
        planted.append((end, -np.inf, np.nan))
        for pos, key, value in planted:
            if 0 <= pos < 37:
                put(poisoned["key"], b, pos, key)
                put(poisoned["value"], b, pos, value)
    want = np.asarray(fn(**{k: jnp.asarray(v) for k, v in clean.items()}, **kw))
    got = np.asarray(fn(**{k: jnp.asarray(v) for k, v in poisoned.items()}, **kw))
    assert np.isfinite(got).all(), "a planted entry no row can see reached the output"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_masked_softmax_gives_hidden_entries_and_empty_rows_exact_zeros() -> None:
    from ejkernel.attention_semantics import masked_softmax

    logits = jnp.array([[1.0, jnp.nan, 3.0, -jnp.inf], [jnp.inf, jnp.nan, 2.0, 0.5]])
    vis = jnp.array([[True, False, True, False], [False, False, False, False]])
    p = masked_softmax(logits, vis)
    want = jax.nn.softmax(jnp.array([1.0, 3.0]))
    np.testing.assert_allclose(p[0, jnp.array([0, 2])], want, rtol=1e-6)
    assert float(p[0, 1]) == 0.0 and float(p[0, 3]) == 0.0
    assert not bool(jnp.any(p[1]))
    grad = jax.grad(lambda x: jnp.sum(masked_softmax(x, vis) * jnp.arange(4.0)))(logits)
    assert bool(jnp.isfinite(grad).all()) and float(grad[0, 1]) == 0.0
