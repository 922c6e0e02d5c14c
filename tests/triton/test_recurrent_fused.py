"""The fused recurrent (decoding) path of the Triton gla, recurrent and lightning_attention.

Through Triton's interpreter on the CPU: T = 1 … 16 with a carried state, against the
sequential reference (float32 and bf16), packed sequences with empty and length-1 ones,
reverse, −inf gates and NaN, decoding step by step equal to one call, vmap. Marked ``gpu``:
one decoding token at B 64, H 16, K = V = 128 against the XLA platform.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from tests.triton._linear_helpers import random_qkv

import ejkernel
from ejkernel.specs.gla import gla_reference
from ejkernel.specs.lightning_attention import lightning_attention_reference
from ejkernel.specs.recurrent import recurrent_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal

pytest.importorskip("triton")

from ejkernel_triton.ops.gla import GlaConfig

FUSED = GlaConfig(block_v=16, fused=True)


def inputs(b: int, s: int, h: int, dk: int, dv: int, dtype: Any = jnp.float32) -> dict[str, Any]:
    """q, k, v, a log-sigmoid key gate ``gk`` and an initial state, from a fixed key."""
    ks = jax.random.split(jax.random.PRNGKey(s * 11 + dk + dv + b), 5)
    return {
        **random_qkv(ks, b, s, h, dk, dv, dtype),
        "gk": jax.nn.log_sigmoid(normal(ks[3], (b, s, h, dk), jnp.float32)).astype(dtype),
        "initial_state": normal(ks[4], (b, h, dk, dv), jnp.float32),
    }


def recurrent(cfg: Any = FUSED, **kw: Any) -> Any:
    return ejkernel.recurrent(platform="triton", cfg=cfg, return_state=True, **kw)


def close(got: Any, want: Any, tol: float | None = None) -> None:
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype
        if tol is None:
            assert_close(a, e)
        else:
            a, e = a.astype(jnp.float32), e.astype(jnp.float32)
            assert float(jnp.linalg.norm(a - e) / jnp.linalg.norm(e)) < tol


@pytest.mark.parametrize("s", [1, 5, 16])
def test_gla_and_recurrent_match_the_reference_up_to_16_tokens(interpret, s) -> None:
    a = inputs(2, s, 2, 24, 40)  # K 24 (a masked K block), V 40 (three value blocks of 16)
    gla = {"query": a["query"], "key": a["key"], "value": a["value"], "g": a["gk"]}
    init = a["initial_state"]
    got = ejkernel.gla(**gla, initial_state=init, return_state=True, platform="triton", cfg=FUSED)
    close(got, gla_reference(**gla, initial_state=init, return_state=True))
    g = a["gk"][..., 0]
    close(
        recurrent(**a, g=g, softmax_scale=0.5),
        recurrent_reference(**a, g=g, softmax_scale=0.5, return_state=True),
    )


def test_the_heuristic_path_without_a_config_is_the_fused_one(interpret) -> None:
    a = inputs(1, 3, 2, 16, 16)
    close(recurrent(cfg=None, **a), recurrent_reference(**a, return_state=True))


def test_bf16_within_a_half_precision_tolerance(interpret) -> None:
    a = inputs(2, 9, 2, 16, 32, dtype=jnp.bfloat16)
    close(
        recurrent(**a, reverse=True),
        recurrent_reference(**a, reverse=True, return_state=True),
        tol=1e-2,
    )


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_packed_sequences_with_empty_and_length_one_sequences(interpret, reverse) -> None:
    # sequences of 1, 0, 7 and 4 tokens; tokens 0 and 13.. belong to none (zero output)
    a = inputs(1, 15, 2, 16, 16)
    a["initial_state"] = normal(jax.random.PRNGKey(3), (4, 2, 16, 16), jnp.float32)
    cu = jnp.array([1, 2, 2, 9, 13], jnp.int32)
    got = recurrent(**a, cu_seqlens=cu, reverse=reverse)
    close(got, recurrent_reference(**a, cu_seqlens=cu, reverse=reverse, return_state=True))
    assert not jnp.any(got[0][:, 13:]) and not jnp.any(got[0][:, 0])
    assert_close(got[1][1], a["initial_state"][1])  # the empty sequence keeps its state


def test_decoding_token_by_token_equals_one_call(interpret) -> None:
    a = inputs(2, 6, 2, 16, 16)
    whole = recurrent(**a)
    state, outs = a["initial_state"], []
    for t in range(6):
        step = {n: x[:, t : t + 1] for n, x in a.items() if n != "initial_state"}
        out, state = recurrent(**step, initial_state=state)
        outs.append(out)
    assert_close(jnp.concatenate(outs, axis=1), whole[0], name="out")
    assert_close(state, whole[1], name="final")


def test_lightning_attention_and_its_infinite_slope(interpret) -> None:
    a = inputs(2, 4, 2, 16, 16)
    del a["gk"]
    slopes = jnp.array([0.3, jnp.inf], jnp.float32)
    got = ejkernel.lightning_attention(
        **a, slopes=slopes, return_state=True, platform="triton", cfg=FUSED
    )
    close(got, lightning_attention_reference(**a, slopes=slopes, return_state=True))


def test_minus_inf_gates_reset_and_nan_stays_in_its_causal_future(interpret) -> None:
    a = inputs(1, 12, 2, 16, 16)
    a["gk"] = a["gk"].at[0, 3, 0].set(-jnp.inf).at[0, 5, 1, :4].set(-30.0)
    close(recurrent(**a), recurrent_reference(**a, return_state=True))
    a["value"] = a["value"].at[0, 7, 1, 2].set(jnp.nan)
    for reverse in (False, True):
        got = recurrent(**a, reverse=reverse)[0]
        want = recurrent_reference(**a, reverse=reverse)
        assert jnp.array_equal(jnp.isnan(got), jnp.isnan(want))
        assert_close(got, want)


def test_vmap_equals_one_call_per_index(interpret) -> None:
    a = inputs(2, 5, 2, 16, 16)
    del a["initial_state"]
    f = lambda q, k, v, g: recurrent(query=q[None], key=k[None], value=v[None], gk=g[None])[0][0]
    mapped = jax.vmap(f)(a["query"], a["key"], a["value"], a["gk"])
    for i in range(2):
        assert_close(mapped[i], f(a["query"][i], a["key"][i], a["value"][i], a["gk"][i]))


def test_a_differentiated_call_runs_the_chunked_backward(interpret) -> None:
    a = inputs(1, 7, 2, 16, 16)

    def loss(fn: Any) -> Any:
        return jax.grad(lambda x: jnp.sum(jnp.sin(fn(**x)[0])) + jnp.sum(fn(**x)[1]))(a)

    got = loss(lambda **kw: recurrent(**kw))
    want = loss(lambda **kw: recurrent_reference(**kw, return_state=True))
    close(got, want)


# -- GPU, realistic shapes ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("s", [1, 16])
def test_gpu_decoding_matches_the_xla_path(s: int) -> None:
    a = inputs(64, s, 16, 128, 128, dtype=jnp.bfloat16)
    got = jax.jit(lambda x: recurrent(cfg=None, **x))(a)
    up = jax.tree.map(lambda x: x.astype(jnp.float32), a)
    with jax.default_matmul_precision("highest"):
        want = ejkernel.recurrent(**up, return_state=True, platform="xla")
    close(got[1], want[1], tol=2e-2)
    close(got[0].astype(jnp.float32), want[0], tol=2e-2)


@pytest.mark.gpu
def test_gpu_a_donated_state_is_updated_in_place() -> None:
    """A decoding step with its state donated: the final state takes the initial state's
    buffer (no second state buffer, no copy), and the values are the undonated call's."""
    a = inputs(64, 1, 16, 128, 128, dtype=jnp.bfloat16)
    state = a.pop("initial_state")
    step = jax.jit(lambda s, x: recurrent(cfg=None, **x, initial_state=s), donate_argnums=0)
    compiled = step.lower(state, a).compile()
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= state.nbytes, memory
    assert memory.temp_size_in_bytes < state.nbytes // 2, memory
    want = jax.jit(lambda s, x: recurrent(cfg=None, **x, initial_state=s))(state, a)
    got = step(jnp.copy(state), a)
    for ours, theirs in zip(got, want, strict=True):
        assert bool(jnp.all(ours == theirs))


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_the_kernel_compiles_for_hopper(monkeypatch, tmp_path, packed: bool) -> None:
    """The heuristic's launch (bf16, K = V = 128) compiled for sm_90 on any machine."""
    from ejkernel_triton import _codegen
    from ejkernel_triton.ops import gla_config
    from ejkernel_triton.ops.recurrent import recurrent_triton

    monkeypatch.setenv("EJKERNEL_INTERPRET", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    t = gla_config.FUSED_GPU_MAX_TOKENS
    q = jnp.ones((1 if packed else 4, t, 2, 128), jnp.bfloat16)
    cu = jnp.array([0, 1, t], jnp.int32) if packed else None
    jax.clear_caches()  # the launch is jitted: trace it under the recorder
    with _codegen.recorded_launches() as record:
        recurrent_triton(query=q, key=q, value=q, gk=q, cu_seqlens=cu, return_state=True)
    (launch,) = record
    compiled = _codegen.compile_launch(launch, capability=90)
    assert launch.kernel.fn.__name__ == "recurrent_fused_fwd_kernel"
    assert launch.input_output_aliases == ((4, 1),)  # the final state is written over init
    assert compiled.shared <= 232448  # the H100's shared memory per block
