"""The Triton block-sparse attention against the reference, in the interpreter and on a GPU.

``mode`` is ``interpret`` (Triton's interpreter on the CPU: tiny, odd shapes, float32 unless
said, 16-row tiles so that blocks span several tiles or overrun them) or ``gpu`` (marked
``gpu``: S 8192, D 128, bf16, against the XLA platform's implementation). Gradients are checked
for every array input that has one (query, key, value, bias).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.triton._shared_memory import spaces_with_and_without_limit

import ejkernel
from ejkernel.ops import BwdParams, FwdParams
from ejkernel.specs.blocksparse_attention import blocksparse_attention_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal

pytest.importorskip("triton")

from ejkernel_triton.ops.blocksparse_attention import (
    BlocksparseAttentionConfig,
    block_lists,
)

#: 16-row tiles: blocks of 16 are one tile, larger ones several, odd ones overrun.
SMALL = BlocksparseAttentionConfig(
    fwd_params=FwdParams(q_blocksize=16, kv_blocksize=16, num_stages=1),
    bwd_params=BwdParams(q_blocksize=16, kv_blocksize=16, num_stages=1),
    dq_params=FwdParams(q_blocksize=16, kv_blocksize=16, num_stages=1),
)


def qkv(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype: Any = jnp.float32) -> Any:
    ks = jax.random.split(jax.random.PRNGKey(sq * 7 + sk + d), 3)
    return (
        normal(ks[0], (b, sq, hq, d), dtype),
        normal(ks[1], (b, sk, hkv, d), dtype),
        normal(ks[2], (b, sk, hkv, d), dtype),
    )


def random_mask(shape: tuple[int, ...], density: float, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).random(shape) < density)


def run(fn: Any, q: Any, k: Any, v: Any, diff: dict[str, Any]) -> Any:
    out, vjp = jax.vjp(fn, q, k, v, diff)
    d_out = normal(jax.random.PRNGKey(3), out.shape, out.dtype)
    return out, vjp(d_out)


def compare(q: Any, k: Any, v: Any, *, cfg: Any = SMALL, **kwargs: Any) -> Any:
    """Output and gradients (q, k, v and every floating array option) of the Triton op vs the
    reference on the same inputs, at the dtype's tolerance."""
    diff = {n: x for n, x in kwargs.items() if n == "bias"}
    rest = {n: x for n, x in kwargs.items() if n not in diff}

    def ours(q, k, v, diff):
        return ejkernel.blocksparse_attention(q, k, v, **diff, **rest, platform="triton", cfg=cfg)

    def ref(q, k, v, diff):
        return blocksparse_attention_reference(q, k, v, **diff, **rest)

    out, got = run(ours, q, k, v, diff)
    want, exp = run(ref, q, k, v, diff)
    assert out.dtype == q.dtype and out.shape == want.shape
    assert_close(out, want, name="out")
    for name, g, e in zip(("dq", "dk", "dv", "bias"), got, exp, strict=True):
        for leaf_g, leaf_e in zip(jax.tree.leaves(g), jax.tree.leaves(e), strict=True):
            assert leaf_g.shape == leaf_e.shape and leaf_g.dtype == leaf_e.dtype, name
            assert_close(leaf_g, leaf_e, name=name)
    return out, got


# -- the lists -------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_lists_hold_the_live_blocks_whole_ones_first(causal: bool) -> None:
    from ejkernel.attention_semantics import Geometry

    q = jax.ShapeDtypeStruct((2, 37, 4, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((2, 45, 2, 8), jnp.float32)
    geo = Geometry.of(q, k, causal=causal, window=(20, 3) if causal else None)
    bq, bk = 8, 12
    mask = random_mask((2, 1, 5, 4), 0.6, seed=1)
    for by_key in (False, True):
        index, counts = (np.asarray(x) for x in block_lists(mask, (bq, bk), geo, by_key=by_key))
        for b, row in np.ndindex(2, index.shape[2]):
            whole, live = counts[b, 0, row]
            listed = index[b, 0, row]
            for n, other in enumerate(listed):
                i, j = (other, row) if by_key else (row, other)
                may = bool(mask[b, 0, i, j]) and bool(geo.block_may_see(i, j, bq, bk))
                full = bool(geo.block_fully_visible(i, j, bq, bk)) and (i + 1) * bq <= 37
                assert may == (n < live), (by_key, b, row, n)
                if n < live:
                    assert (may and full) == (n < whole), (by_key, b, row, n)
            assert sorted(listed[:whole]) == list(listed[:whole])
            assert sorted(listed[whole:live]) == list(listed[whole:live])


# -- against the reference, in the interpreter -----------------------------------------------


@pytest.mark.parametrize(
    ("shape", "block_size"),
    [
        ((1, 37, 37, 4, 2, 32), (16, 16)),
        ((2, 37, 45, 2, 1, 16), (8, 12)),
        ((1, 45, 37, 2, 2, 32), (40, 24)),
    ],
    ids=["gqa-seq37-b16", "mqa-sq<sk-b8x12", "sq>sk-b40x24"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_output_and_gradients_match_the_reference(
    interpret: None, shape: tuple[int, ...], block_size: tuple[int, int], causal: bool
) -> None:
    b, sq, sk, hq, _, _ = shape
    nq, nk = -(-sq // block_size[0]), -(-sk // block_size[1])
    mask = random_mask((b, hq, nq, nk), 0.6, seed=sq + nk)
    compare(*qkv(*shape), block_mask=mask, block_size=block_size, causal=causal)


def test_bf16(interpret: None) -> None:
    q, k, v = qkv(1, 37, 37, 2, 1, 32, jnp.bfloat16)
    mask = random_mask((1, 1, 3, 3), 0.7, seed=4)
    compare(q, k, v, block_mask=mask, block_size=16, causal=True)


def test_empty_mask_rows_give_zeros_and_zero_gradients(interpret: None) -> None:
    q, k, v = qkv(1, 37, 37, 2, 2, 16)
    mask = np.ones((1, 2, 3, 3), bool)
    mask[0, 0, 1] = False  # head 0, query block 1 has no live key block
    mask[0, 1, :, 2] = False  # head 1: key block 2 no query block uses
    out, (dq, dk, dv, _) = compare(q, k, v, block_mask=jnp.asarray(mask), block_size=16)
    assert float(jnp.abs(out[0, 16:32, 0]).max()) == 0.0
    assert float(jnp.abs(dq[0, 16:32, 0]).max()) == 0.0
    assert float(jnp.abs(dk[0, 32:, 1]).max()) == 0.0
    assert float(jnp.abs(dv[0, 32:, 1]).max()) == 0.0


def test_sliding_window_soft_cap_and_broadcast_mask_and_bias(interpret: None) -> None:
    q, k, v = qkv(2, 37, 45, 2, 1, 16)
    mask = random_mask((1, 1, 3, 3), 0.8, seed=5)
    compare(
        q,
        k,
        v,
        block_mask=mask,
        block_size=(16, 16),
        sliding_window=(9, 4),
        logits_soft_cap=2.5,
    )
    bias = normal(jax.random.PRNGKey(7), (2, 1, 1, 45))  # per batch and key: summed gradient
    compare(
        q,
        k,
        v,
        block_mask=mask,
        block_size=(16, 16),
        causal=True,
        sliding_window=(5, 0),
        bias=bias,
    )


def test_bias_attention_mask_and_segment_ids(interpret: None) -> None:
    b, s, hq = 2, 37, 2
    q, k, v = qkv(b, s, s, hq, 1, 16)
    seg = np.zeros((b, s), np.int32)
    seg[:, s // 2 :] = 1
    seg[1, s - 6 :] = -1  # padding: rows without keys
    seg = jnp.asarray(seg)
    compare(
        q,
        k,
        v,
        block_mask=random_mask((b, 1, 3, 3), 0.7, seed=6),
        block_size=16,
        bias=normal(jax.random.PRNGKey(5), (1, hq, s, s)),
        attention_mask=jax.random.bernoulli(jax.random.PRNGKey(6), 0.7, (b, 1, s, s)),
        q_segment_ids=seg,
        kv_segment_ids=seg,
        causal=True,
    )


def test_nan_in_dead_blocks_is_never_read(interpret: None) -> None:
    q, k, v = qkv(1, 37, 37, 2, 1, 16)
    mask = np.ones((1, 1, 3, 3), bool)
    mask[0, 0, :, 1] = False  # keys 16..31: no query block reads them
    k_bad, v_bad = k.at[:, 16:32].set(jnp.nan), v.at[:, 16:32].set(jnp.inf)
    kw = {"block_mask": jnp.asarray(mask), "block_size": 16, "platform": "triton", "cfg": SMALL}
    f = lambda q, k, v: ejkernel.blocksparse_attention(q, k, v, **kw)
    out, vjp = jax.vjp(f, q, k_bad, v_bad)
    want, vjp_w = jax.vjp(f, q, k, v)
    assert_close(out, want, name="out")
    dq, dk, dv = vjp(jnp.ones_like(out))
    dq_w, dk_w, dv_w = vjp_w(jnp.ones_like(out))
    assert_close(dq, dq_w, name="dq")
    assert float(jnp.abs(dk[:, 16:32]).max()) == float(jnp.abs(dv[:, 16:32]).max()) == 0.0
    assert_close(dk, dk_w, name="dk")
    assert_close(dv, dv_w, name="dv")


@pytest.mark.parametrize("forward", ["usual", "warp_specialized"])
def test_jit_and_vmap_with_a_traced_mask(interpret: None, forward: str) -> None:
    q, k, v = qkv(1, 37, 37, 2, 1, 64)
    if forward == "warp_specialized":  # its case: 16-bit, D 64 or 128
        q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    qs = jnp.stack([q, 0.5 - q])  # [2, 1, Sq, Hq, D]: vmapped over the leading axis
    masks = random_mask((2, 1, 1, 3, 3), 0.6, seed=8)  # one mask per vmapped entry
    cfg = attrs.evolve(SMALL, fwd_variant=forward)

    def f(q, m):
        return ejkernel.blocksparse_attention(
            q, k, v, block_mask=m, block_size=16, causal=True, platform="triton", cfg=cfg
        )

    def r(q, m):
        return blocksparse_attention_reference(q, k, v, block_mask=m, block_size=16, causal=True)

    assert_close(jax.jit(jax.vmap(f))(qs, masks), jax.vmap(r)(qs, masks), name="vmap")
    loss = lambda fn: lambda q, m: jnp.sum(jnp.sin(fn(q, m)))
    g = jax.jit(jax.vmap(jax.grad(loss(f))))(qs, masks)
    assert_close(g, jax.vmap(jax.grad(loss(r)))(qs, masks), name="vmap grad")


def test_the_default_call_runs_the_kernel_where_triton_runs(interpret: None) -> None:
    from ejkernel_triton import plugin

    q, k, v = qkv(1, 37, 37, 2, 1, 16)
    args = {"block_mask": random_mask((1, 1, 3, 3), 0.7, seed=9), "block_size": 16}
    assert "blocksparse_attention" not in plugin.OPT_IN
    assert ejkernel.explain("blocksparse_attention", q, k, v, **args).platform == "triton"
    out = ejkernel.blocksparse_attention(q, k, v, **args)
    assert_close(out, blocksparse_attention_reference(q, k, v, **args))


#: The warp-specialized forward (the mask's blocks its tiles) with the usual backward, and
#: the warp-specialized kernels of both passes.
WS = BlocksparseAttentionConfig(
    fwd_variant="warp_specialized",
    bwd_params=SMALL.bwd_params,
    dq_params=SMALL.dq_params,
)
WS_BOTH = attrs.evolve(WS, bwd_variant="warp_specialized")


@pytest.mark.parametrize(
    ("shape", "causal", "cap"),
    [
        ((2, 96, 96, 4, 2, 64), False, None),
        ((1, 112, 96, 2, 1, 64), True, None),  # Sq > Sk: empty rows
        ((1, 96, 104, 2, 2, 64), True, None),  # a cut last key block
        ((2, 80, 112, 2, 1, 128), False, 4.0),  # cut blocks of both, soft cap
    ],
    ids=["gqa", "sq>sk-causal", "cut-keys-causal", "mqa-cut-softcap"],
)
def test_warp_specialized_kernels_walk_the_lists(
    interpret: None,
    monkeypatch: pytest.MonkeyPatch,
    shape: tuple[int, ...],
    causal: bool,
    cap: float | None,
) -> None:
    from ejkernel_triton import _launch

    jax.clear_caches()  # a call traced by an earlier test is traced (and launched) again
    names: list[str] = []
    real = _launch.launch
    monkeypatch.setattr(
        _launch,
        "launch",
        lambda kernel, *a, **kw: names.append(kernel.fn.__name__) or real(kernel, *a, **kw),
    )
    b, sq, sk, hq, _, _ = shape
    nq, nk = -(-sq // 32), -(-sk // 32)
    mask = random_mask((b, hq, nq, nk), 0.6, seed=sq + sk)
    mask = mask.at[:, :, 0].set(False)  # a query block with nothing to see
    q, k, v = qkv(*shape, jnp.bfloat16)
    kw = {"block_mask": mask, "block_size": 32, "causal": causal, "logits_soft_cap": cap}
    compare(q, k, v, cfg=WS_BOTH, **kw)
    assert names == [
        "flash_attention_fwd_ws_kernel",
        "flash_attention_bwd_dkdv_ws_kernel",
        "flash_attention_bwd_dq_ws_kernel",
    ]


def test_warp_specialized_forward_reads_no_hidden_nan(interpret: None) -> None:
    """NaN in dead blocks and beside the causal diagonal reaches no row."""
    q, k, v = qkv(1, 64, 64, 2, 1, 64, jnp.bfloat16)
    mask = np.ones((1, 1, 4, 4), bool)
    mask[0, 0, :, 1] = False  # keys 16..31: dead
    kw = {"block_mask": jnp.asarray(mask), "block_size": 16, "causal": True, "platform": "triton"}
    bad = (k.at[:, 16:32].set(jnp.nan), v.at[:, 16:32].set(jnp.nan))
    bad = (bad[0].at[:, 63].set(jnp.inf), bad[1].at[:, 63].set(jnp.nan))  # the last query's own key
    out = ejkernel.blocksparse_attention(q, *bad, cfg=WS, **kw)
    want = ejkernel.blocksparse_attention(q, k, v, cfg=SMALL, **kw)
    assert_close(out[:, :63], want[:, :63], name="rows that cannot see key 63")


def test_a_variant_that_cannot_serve_the_call_is_refused(interpret: None) -> None:
    q, k, v = qkv(1, 64, 64, 2, 1, 64, jnp.bfloat16)
    mask = jnp.ones((1, 1, 4, 4), bool)
    call = {"block_mask": mask, "block_size": 16, "platform": "triton", "cfg": WS}
    with pytest.raises(ValueError, match=r"fwd_variant='warp_specialized'.*no bias"):
        ejkernel.blocksparse_attention(q, k, v, bias=jnp.zeros((1, 2, 64, 64)), **call)
    both = {**call, "cfg": attrs.evolve(SMALL, bwd_variant="warp_specialized")}
    with pytest.raises(ValueError, match=r"bwd_variant='warp_specialized'.*no bias"):
        ejkernel.blocksparse_attention(q, k, v, bias=jnp.zeros((1, 2, 64, 64)), **both)
    with pytest.raises(ValueError, match=r"warp_specialized.*powers of two"):
        odd = jnp.ones((1, 1, 6, 6), bool)
        ejkernel.blocksparse_attention(q, k, v, **{**call, "block_mask": odd, "block_size": 12})
    for field in ("fwd_variant", "bwd_variant"):
        with pytest.raises(ValueError, match=field):
            BlocksparseAttentionConfig(**{field: "pingpong"})


def test_the_warp_specialized_kernels_join_the_space_where_they_serve(monkeypatch) -> None:
    import types

    from ejkernel_triton.ops import blocksparse_attention_config as config
    from ejkernel_triton.ops import flash_attention_config as flash_config

    monkeypatch.setattr(config._launch, "interpreting", lambda: False)
    monkeypatch.setattr(flash_config._launch, "interpreting", lambda: False)
    monkeypatch.setattr(flash_config, "_compute_capability", lambda: (9, 0))
    x = jax.ShapeDtypeStruct((1, 8192, 16, 128), jnp.bfloat16)
    call = {"query": x, "key": x, "value": x, "block_size": (128, 128)}
    variants = lambda **kw: [
        c.fwd_variant + "/" + c.bwd_variant
        for c in config.config_space(types.SimpleNamespace(kwargs={**call, **kw}))
    ]
    assert variants()[0] == "usual/warp_specialized"  # the heuristic's backward
    assert "warp_specialized/warp_specialized" in variants() and "usual/usual" in variants()
    for kw in ({"block_size": (64, 128)}, {"sliding_window": (64, 64)}):  # not its case
        assert set(variants(**kw)) == {"usual/usual"}
    monkeypatch.setattr(flash_config, "_compute_capability", lambda: (8, 0))
    assert set(variants()) == {"usual/usual"}


def test_config_space_prunes_by_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from ejkernel_triton.ops import blocksparse_attention_config as config

    monkeypatch.setattr(config._launch, "interpreting", lambda: False)
    x = jax.ShapeDtypeStruct((1, 8192, 16, 128), jnp.bfloat16)
    inv = types.SimpleNamespace(kwargs={"query": x, "key": x, "value": x, "block_size": (128, 128)})
    every, kept = spaces_with_and_without_limit(
        monkeypatch, lambda: config.config_space(inv), 100000
    )
    assert kept[0] == every[0] == config.heuristic(inv)
    assert 1 < len(kept) < len(every)
    for cfg in kept[1:]:
        assert max(config.kernel_smem(inv.kwargs, cfg).values()) <= 100000


# -- what a GPU would run, compiled for sm_90 on any machine ---------------------------------


@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernels_compile_for_sm90_with_pipelined_tile_loads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, head_dim: int
) -> None:
    """The heuristic's three kernels at 128 × 128 blocks compile for Hopper, stream their
    tiles by 16-byte ``cp.async`` copies into the shared memory the config space counts, and
    multiply by ``wgmma``."""
    import types

    from ejkernel_triton import _codegen
    from ejkernel_triton.ops import blocksparse_attention as op
    from ejkernel_triton.ops.blocksparse_attention_config import heuristic, kernel_smem

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", "232448")
    x = jnp.ones((1, 512, 2, head_dim), jnp.bfloat16)
    call = {"query": x, "key": x, "value": x, "block_size": (128, 128), "causal": True}
    mask = jnp.ones((1, 1, 4, 4), bool)
    with _codegen.recorded_launches() as launches:
        out, res = op._blocksparse_fwd(**call, block_mask=mask)
        op._blocksparse_bwd(res, out, block_size=(128, 128), causal=True)
    needs = kernel_smem(call, heuristic(types.SimpleNamespace(kwargs=call)))
    names = {
        "blocksparse_attention_fwd_kernel": "fwd",
        "blocksparse_attention_bwd_dq_kernel": "dq",
        "blocksparse_attention_bwd_dkdv_kernel": "dkdv",
    }
    assert [launch.kernel.fn.__name__ for launch in launches] == list(names)
    for launch in launches:
        compiled = _codegen.compile_launch(launch)
        mix = _codegen.instruction_mix(compiled.ptx)
        name = launch.kernel.fn.__name__
        assert mix.get("cp.async.cg.shared.global", 0) > 0, (name, mix)
        assert any(m.startswith("wgmma") for m in mix), (name, mix)
        assert 0 <= needs[names[name]] - compiled.shared <= 512, (name, compiled.shared)


def test_warp_specialized_kernels_compile_to_a_producer_and_two_consumers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from ejkernel_triton import _codegen
    from ejkernel_triton.ops import blocksparse_attention as op
    from ejkernel_triton.ops import flash_attention_config as flash_config

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    monkeypatch.setattr(flash_config, "_compute_capability", lambda: (9, 0))
    x = jnp.ones((1, 512, 2, 128), jnp.bfloat16)
    call = {"query": x, "key": x, "value": x, "block_size": (128, 128), "causal": True}
    with _codegen.recorded_launches() as launches:
        out, res = op._blocksparse_fwd(**call, block_mask=jnp.ones((1, 1, 4, 4), bool), cfg=WS_BOTH)
        op._blocksparse_bwd(res, out, block_size=(128, 128), causal=True, cfg=WS_BOTH)
    assert [launch.kernel.fn.__name__ for launch in launches] == [
        "flash_attention_fwd_ws_kernel",
        "flash_attention_bwd_dkdv_ws_kernel",
        "flash_attention_bwd_dq_ws_kernel",
    ]
    for launch in launches:
        compiled = _codegen.compile_launch(launch)
        assert compiled.num_warps == 12  # 4 asked for: the producer and two consumers of 4
        assert compiled.ptx.count("setmaxnreg") > 0
        assert any(m.startswith("wgmma") for m in _codegen.instruction_mix(compiled.ptx))


# -- GPU: realistic shapes against the XLA platform -------------------------------------------


def sparse_mask(b: int, h: int, n: int, sparsity: float, seed: int = 0) -> jax.Array:
    """Each query block keeps ``round((1 - sparsity) · n)`` random key blocks, the diagonal
    among them (no empty rows)."""
    rng = np.random.default_rng(seed)
    keep = max(1, round((1 - sparsity) * n))
    mask = np.zeros((b, h, n, n), bool)
    for idx in np.ndindex(b, h, n):
        others = rng.choice(np.delete(np.arange(n), idx[2]), keep - 1, replace=False)
        mask[idx][[idx[2], *others]] = True
    return jnp.asarray(mask)


def rel(a: Any, b: Any) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["heuristic", "warp_specialized"])
@pytest.mark.parametrize("sparsity", [0.5, 0.9], ids=["50%", "90%"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_s8192_d128_matches_dense_attention_under_the_expanded_mask(
    sparsity: float, causal: bool, kernels: str
) -> None:
    """Against the XLA platform's flash attention with the block mask expanded to a dense
    attention mask (the XLA blocksparse schedule takes minutes to compile at this size); the
    heuristic's kernels, and the warp-specialized ones of both passes."""
    cfg = None
    if kernels == "warp_specialized":
        cfg = BlocksparseAttentionConfig(fwd_variant=kernels, bwd_variant=kernels)
    b, s, hq, hkv, d, blk = 1, 8192, 8, 2, 128, 128
    q, k, v = qkv(b, s, s, hq, hkv, d, jnp.bfloat16)
    mask = sparse_mask(b, hq, s // blk, sparsity)
    d_out = normal(jax.random.PRNGKey(4), q.shape, q.dtype)

    def sparse(q, k, v, mask):
        return ejkernel.blocksparse_attention(
            q, k, v, block_mask=mask, block_size=blk, causal=causal, platform="triton", cfg=cfg
        )

    def reference(q, k, v, mask):
        dense = jnp.repeat(jnp.repeat(mask, blk, axis=2), blk, axis=3)
        return ejkernel.flash_attention(
            q, k, v, attention_mask=dense, causal=causal, platform="xla"
        )

    @functools.partial(jax.jit, static_argnums=0)
    def fwd_bwd(f: Any, q: Any, k: Any, v: Any, mask: Any, d_out: Any) -> Any:
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, mask), q, k, v)
        return out, vjp(d_out)

    got = fwd_bwd(sparse, q, k, v, mask, d_out)
    want = fwd_bwd(reference, q, k, v, mask, d_out)
    for name, a, e in zip(("out", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want)):
        assert bool(jnp.isfinite(a.astype(jnp.float32)).all()), name
        assert rel(a, e) < 2e-2, (name, rel(a, e))
