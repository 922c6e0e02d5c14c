"""The Triton flash attention's config space drops candidates over the device's shared memory
before anything compiles; its estimates hold against what Triton allocates for sm_90 (compiled
on any machine by ``ejkernel_triton._codegen``)."""

from __future__ import annotations

import logging
import types
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import pytest
from tests.triton._shared_memory import configs_tuning_runs

from ejkernel.ops import BwdParams, FwdParams

pytest.importorskip("triton")

from ejkernel_triton import _codegen
from ejkernel_triton.ops import flash_attention as fa
from ejkernel_triton.ops import flash_attention_config as config

pytestmark = pytest.mark.usefixtures("triton_cache_in_tmp")

#: An Ampere/Ada GPU's shared memory per block (sm_86, sm_89): most usual blocks at D 128
#: exceed it.
SM86 = 101376


@pytest.fixture
def gpu_view(monkeypatch):
    """The config space a GPU gets (not the interpreter's), on the CPU: the usual kernels."""
    monkeypatch.setattr(config._launch, "interpreting", lambda: False)
    monkeypatch.setattr(config, "_compute_capability", lambda: (8, 6))
    monkeypatch.setattr(config, "_device_kind", lambda: "NVIDIA A10")


def _inv(d: int = 128, grad: bool = True) -> Any:
    x = jax.ShapeDtypeStruct((4, 4096, 16, d), jnp.bfloat16)
    kwargs = {"query": x, "key": x, "value": x, "causal": True}
    return types.SimpleNamespace(kwargs=kwargs, grad=grad)


def test_candidates_over_the_limit_are_dropped_the_heuristic_stays(gpu_view, monkeypatch, caplog):
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", str(SM86))
    inv = _inv()
    with caplog.at_level(logging.DEBUG, logger="ejkernel.tuning"):
        space = fa.config_space(inv)
    base = space[0]
    assert base == fa.heuristic(inv) and len(space) > 1
    need = lambda cfg: config.smem_need(inv.kwargs, cfg, beside=base)
    assert all(need(cfg) <= SM86 for cfg in space)
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", "none")
    whole = fa.config_space(inv)
    dropped = [cfg for cfg in whole if cfg not in space]
    assert dropped and all(need(cfg) > SM86 for cfg in dropped)
    lines = [r.getMessage() for r in caplog.records if "flash_attention (triton)" in r.getMessage()]
    assert len(lines) == len(dropped)


def test_no_known_limit_prunes_nothing(gpu_view, monkeypatch):
    space = fa.config_space(_inv())  # a CPU reports no shared memory
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", "none")
    assert space == fa.config_space(_inv()) and len(space) > 8


def test_a_forward_only_call_counts_the_forward_only(gpu_view, monkeypatch):
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", str(SM86))
    forward = fa.config_space(_inv(grad=False))
    assert len(forward) > len(fa.config_space(_inv(grad=True)))


def test_tuning_never_runs_a_dropped_candidate(gpu_view, monkeypatch):
    # Tuning over a kernel that offers the Triton config space.
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", str(SM86))
    q = jnp.ones((1, 512, 2, 128), jnp.bfloat16)
    call = lambda q: {"query": q, "key": q, "value": q, "causal": True}
    ran = configs_tuning_runs(monkeypatch, fa.heuristic, fa.config_space, call, q)
    kw = {"query": q, "key": q, "value": q}
    base = fa.heuristic(types.SimpleNamespace(kwargs={**kw, "causal": True}))
    assert len(ran) > 1 and base in ran
    assert all(config.smem_need(kw, cfg, beside=base) <= SM86 for cfg in ran)
    big = {
        attrs.evolve(
            base, fwd_params=FwdParams(q_blocksize=128, kv_blocksize=128, num_warps=8, num_stages=3)
        )
    }
    assert not big & set(ran)  # 229,376 bytes: dropped


def test_estimates_hold_against_what_triton_allocates():
    # Forward and dQ: to the byte; dK/dV: at most 512 bytes over (its logsumexp and Δ rows).
    d = 128
    shape = (1, 256, 2, d)
    usual = fa.FlashAttentionConfig()
    for bq, bk, w, s in config._FWD_BLOCKS:
        cfg = usual.__class__(
            fwd_params=FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)
        )
        fwd = _codegen.flash_attention_launches(shape, causal=False, cfg=cfg)[0]
        assert fwd.num_stages == s
        shared = _codegen.compile_launch(fwd).shared
        assert shared == config.fwd_smem(bq, bk, s, d, d, 2), (bq, bk, s)
    for bq, bk, w, s in config._BWD_BLOCKS:
        cfg = usual.__class__(
            bwd_params=BwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)
        )
        dkdv = _codegen.flash_attention_launches(shape, causal=False, cfg=cfg)[2]
        shared = _codegen.compile_launch(dkdv).shared
        estimate = config.bwd_smem(bq, bk, s, d, d, 2, step_vectors=2)
        assert 0 <= estimate - shared <= 512, (bq, bk, s, shared, estimate)
    for bq, bk, w, s in config._DQ_BLOCKS:
        cfg = usual.__class__(
            dq_params=FwdParams(q_blocksize=bq, kv_blocksize=bk, num_warps=w, num_stages=s)
        )
        dq = _codegen.flash_attention_launches(shape, causal=False, cfg=cfg)[1]
        shared = _codegen.compile_launch(dq).shared
        assert shared == config.bwd_smem(bk, bq, s, d, d, 2), (bq, bk, s)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_every_candidate_the_autotuner_gets_compiles_and_runs_on_the_gpu(d, causal):
    # No candidate of the config space fails for shared memory on the real device.
    q = jnp.ones((2, 2048, 16, d), jnp.bfloat16)
    kv = jnp.ones((2, 2048, 8, d), jnp.bfloat16)
    inv = types.SimpleNamespace(
        kwargs={"query": q, "key": kv, "value": kv, "causal": causal}, grad=True
    )

    import ejkernel

    def loss(q, k, v, cfg):
        out = ejkernel.flash_attention(q, k, v, causal=causal, platform="triton", cfg=cfg)
        return out.astype(jnp.float32).sum()

    for cfg in fa.config_space(inv):
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, kv, kv, cfg)
        jax.block_until_ready(grads)
