"""The Pallas Mosaic GPU config space drops candidates over the device's shared memory before
anything compiles, from the kernels' own scratch description (``ejkernel_pallas.gpu._smem``)."""

from __future__ import annotations

import logging
import re
import types
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import pytest
from tests.triton._shared_memory import configs_tuning_runs

from ejkernel_pallas._attention import blocks_config

H200 = 232448  # the H100's and H200's shared memory per block (opt-in maximum)


def _inv(hq: int = 16, hkv: int = 16, d: int = 128, s: int = 4096, causal: bool = False) -> Any:
    """An invocation of a benchmark shape (B 4, S 4096; BENCHMARKS.md), bf16."""
    q = jax.ShapeDtypeStruct((4, s, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4, s, hkv, d), jnp.bfloat16)
    return types.SimpleNamespace(kwargs={"query": q, "key": kv, "value": kv, "causal": causal})


def _problem(inv: Any, blocks: tuple[int, int, int], *, backward: bool) -> Any:
    """The launch geometry of ``blocks`` for one pass (as on a GPU: not interpreted)."""
    from ejkernel_pallas.gpu._problem import Problem

    kw, cfg = inv.kwargs, blocks_config(blocks, blocks)
    pr = Problem.of(
        kw["query"], kw["key"], cfg, backward=backward, softmax_scale=None, causal=kw["causal"]
    )
    return attrs.evolve(pr, interpret=False)


def test_the_issues_figures_are_the_backward_kernels_of_two_candidates():
    # On an H200, tuning compiled and dropped candidates needing 329,840 and 264,328 bytes.
    from ejkernel_pallas.gpu import _smem as sm
    from ejkernel_pallas.gpu.flash_attention_bwd import dkv_scratch, dq_scratch

    gqa = _problem(_inv(hq=32, hkv=8), (64, 128, 2), backward=True)  # Llama GQA, D 128
    assert sm.nbytes(dkv_scratch(gqa)) == 329840  # its float32 dK/dV outputs
    mha = _problem(_inv(), (64, 128, 3), backward=True)
    assert sm.nbytes(dq_scratch(mha)) == 264328  # the first kernel to fail: dQ before dK/dV


def _mosaic_figure(fn: Any, *args: Any) -> int:
    """The shared memory Mosaic GPU allocates for ``fn``'s kernel, lowered for CUDA on any
    machine: under a limit of 1 byte the lowering fails and names it."""
    core = pytest.importorskip("jax.experimental.mosaic.gpu.core")
    limit = getattr(core, "artificial_shared_memory_limit", None)
    if limit is None:
        pytest.skip("this jax has no artificial_shared_memory_limit")
    with limit(1), pytest.raises(ValueError, match="exceeds available shared memory") as err:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return int(re.search(r"smem_bytes=(\d+)", str(err.value))[1])


@pytest.mark.parametrize(
    ("blocks", "causal", "hkv"),
    [((64, 128, 2), False, 1), ((64, 128, 3), True, 4), ((64, 192, 2), False, 4)],
    ids=["64x128x2-full-gqa", "64x128x3-causal", "64x192x2-full"],
)
def test_the_estimate_is_what_mosaic_gpu_allocates(blocks, causal, hkv):
    from ejkernel_pallas.gpu import _smem as sm
    from ejkernel_pallas.gpu import flash_attention_bwd as bwd
    from ejkernel_pallas.gpu import flash_attention_fwd as fwd

    inv = _inv(hq=4, hkv=hkv, s=512, causal=causal)
    q, k = inv.kwargs["query"], inv.kwargs["key"]
    row = jax.ShapeDtypeStruct((4, 4, 512), jnp.float32)
    pf = _problem(inv, blocks, backward=False)
    assert _mosaic_figure(lambda *a: fwd.fwd_call(*a, pf), q, k, k) == fwd.fwd_smem(pf)
    if blocks[1] == 192:  # a forward-only tile
        return
    pb = _problem(inv, blocks, backward=True)
    dq = _mosaic_figure(lambda *a: bwd.dq_call(*a, pb), q, k, k, q, row, row)
    dkv = _mosaic_figure(lambda *a: bwd.dkv_call(*a, pb), q, k, k, q, row, row)
    assert (dq, dkv) == (sm.nbytes(bwd.dq_scratch(pb)), sm.nbytes(bwd.dkv_scratch(pb)))


def test_candidates_over_the_limit_are_dropped_and_logged(monkeypatch, caplog):
    from ejkernel_pallas.gpu.flash_attention import config_space, heuristic, smem_need

    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", str(H200))
    inv = _inv(hq=32, hkv=8)
    with caplog.at_level(logging.DEBUG, logger="ejkernel.tuning"):
        space = config_space(inv)
    assert space[0] == heuristic(inv)
    assert all(smem_need(inv.kwargs, cfg) <= H200 for cfg in space)
    dropped = {blocks_config(t, t) for t in ((64, 128, 2), (64, 128, 3))}
    assert not dropped & set(space) and len(space) == 3
    lines = [r.getMessage() for r in caplog.records if "shared memory" in r.getMessage()]
    assert len(lines) == 2 and all("flash_attention (pallas gpu)" in m for m in lines)
    assert any("329840" in m for m in lines) and any("362648" in m for m in lines)


def test_a_forward_only_call_counts_the_forward_only(monkeypatch):
    from ejkernel_pallas.gpu.flash_attention import config_space

    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", str(H200))
    inv = _inv(hq=32, hkv=8)
    forward = types.SimpleNamespace(kwargs=inv.kwargs, grad=False)
    assert blocks_config((64, 128, 3), (64, 128, 3)) in config_space(forward)
    assert len(config_space(forward)) == 5


def test_the_heuristic_survives_a_limit_nothing_fits(monkeypatch):
    from ejkernel_pallas.gpu.flash_attention import config_space, heuristic

    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", "1024")
    inv = _inv()
    assert config_space(inv) == [heuristic(inv)]


def test_no_known_limit_prunes_nothing(monkeypatch):
    from ejkernel_pallas.gpu.flash_attention import TUNING, config_space

    # this CPU reports no shared memory: the space is whole (and so with `none`)
    assert len(config_space(_inv(hq=32, hkv=8))) == 1 + len(TUNING)
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", "none")
    assert len(config_space(_inv(hq=32, hkv=8))) == 1 + len(TUNING)


def test_tuning_never_runs_a_dropped_candidate(monkeypatch):
    # Tuning over a kernel that offers the Pallas GPU config space: dropped candidates never run.
    from ejkernel_pallas.gpu import flash_attention as fa

    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", str(H200))
    q = jnp.ones((1, 256, 4, 128), jnp.bfloat16)
    k = jnp.ones((1, 256, 1, 128), jnp.bfloat16)
    call = lambda q, k: {"query": q, "key": k, "value": k, "causal": False}
    ran = configs_tuning_runs(monkeypatch, fa.heuristic, fa.config_space, call, q, k)
    dropped = {blocks_config(t, t) for t in ((64, 128, 2), (64, 128, 3))}
    assert ran and not dropped & set(ran)
    assert blocks_config((64, 64, 3), (64, 64, 3)) in ran


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "causal"),
    [(16, 16, 128, False), (16, 16, 128, True), (32, 8, 128, False), (16, 16, 64, True)],
    ids=["D128-full", "D128-causal", "D128-gqa32x8", "D64-causal"],
)
def test_every_candidate_the_autotuner_gets_compiles_and_runs_on_the_gpu(hq, hkv, d, causal):
    # The issue: on an H200 two candidates failed for shared memory at tuning. Now none does.
    # A candidate's shared memory follows its tiles and head dim, not B or S: the space is that
    # of the (4, 4096) shape, the runs are of a (1, 1024) one, compiled on 8 threads.
    from concurrent.futures import ThreadPoolExecutor

    import ejkernel
    from ejkernel_pallas.gpu.flash_attention import config_space

    def arrays(b: int, s: int) -> tuple[Any, Any]:
        return jnp.ones((b, s, hq, d), jnp.bfloat16), jnp.ones((b, s, hkv, d), jnp.bfloat16)

    big_q, big_kv = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays(4, 4096))
    inv = types.SimpleNamespace(
        kwargs={"query": big_q, "key": big_kv, "value": big_kv, "causal": causal}, grad=True
    )
    q, kv = arrays(1, 1024)

    def loss(q, k, v, cfg):
        out = ejkernel.flash_attention(q, k, v, causal=causal, platform="pallas", cfg=cfg)
        return out.astype(jnp.float32).sum()

    def compiled(cfg: Any) -> Any:
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
        return grad.lower(q, kv, kv, cfg).compile()

    space = config_space(inv)
    with ThreadPoolExecutor(8) as pool:
        for fn in pool.map(compiled, space):
            jax.block_until_ready(fn(q, kv, kv))
