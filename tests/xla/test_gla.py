"""The XLA gla (chunked) against the sequential reference: outputs and gradients (q, k, v, g,
initial_state), both intra-chunk forms, packed sequences, long sequences, bfloat16, state
round trips, transformations, linear memory, configs and errors.

Calls go through the public ``ejkernel.gla`` (the executor wires the custom VJP). Float32 is
held to 1e-4 relative error (the issue's bound for chunked linear attention), bfloat16 to 1e-2.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.xla import _linear_cases as lc

import ejkernel
from ejkernel.specs.gla import gla_reference
from ejkernel.specs.recurrent import recurrent_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal
from ejkernel_xla.ops.gla import GlaConfig, config_space, heuristic

#: Chunks of 16 tokens in sub-chunks of 4: a 37-token sequence is 3 chunks, the last padded.
SMALL = GlaConfig(chunk_size=16, sub_chunk_size=4)
DIFFERENTIABLE = ("query", "key", "value", "g", "initial_state")


def make_inputs(
    *sizes: int,
    strength: float = 1.0,
    num_states: int | None = None,
    dtype: Any = jnp.float32,
    seed: int = 0,
) -> dict[str, Any]:
    """q, k, v of ``sizes`` (B, S, H, Dk, Dv) in ``dtype``, the float32 gate ``log_sigmoid(x) · strength`` and, when asked,
    an initial state for ``num_states`` sequences."""
    b, s, h, dk, dv = sizes
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    arrays: dict[str, Any] = {
        **lc.qkv(keys, sizes, dtype),
        "g": jax.nn.log_sigmoid(normal(keys[3], (b, s, h, dk)) + 1.0) * strength,
    }
    if num_states is not None:
        arrays["initial_state"] = normal(keys[4], (num_states, h, dk, dv))
    return arrays


#: ``check(arrays, **statics)``: output and gradients of ``ejkernel.gla`` against the reference
#: (in ``SMALL`` chunks unless ``cfg`` is given); returns ours.
check = functools.partial(lc.check_vjp, ejkernel.gla, gla_reference, DIFFERENTIABLE, cfg=SMALL)


@pytest.mark.parametrize(
    "strength",
    [0.25, 1.0, 16.0],
    ids=["mild-gates-factored", "log-sigmoid-gates", "strong-gates-exact"],
)
def test_output_state_and_gradients_match_the_reference(strength: float) -> None:
    # B2-S37-H3-K16-V24 in 16-token chunks; the strongest gates push a chunk's decay far
    # below exp(-80), which the factored form cannot hold, so the exact form runs.
    arrays = make_inputs(2, 37, 3, 16, 24, strength=strength, num_states=2)
    (_, final), grads = check(arrays, return_state=True, softmax_scale=0.2)
    assert final.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(grads["g"])))


def test_packed_sequences_with_empty_and_single_token_sequences_reset_states() -> None:
    # Sequences of 1, 0, 19, 16 and 1 tokens: each starts from its own initial state.
    cu = jnp.asarray([0, 1, 1, 20, 36, 37], jnp.int32)
    arrays = make_inputs(1, 37, 3, 16, 24, num_states=5)
    (out, final), _ = check({**arrays, "cu_seqlens": cu}, return_state=True)
    np.testing.assert_array_equal(final[1], arrays["initial_state"][1])
    # The single-token sequence 0: o = scale · q (h0 ⊙ exp(g)[:, None] + kᵀ v).
    q, k, v, g, h0 = (
        arrays[n][0, 0] if n != "initial_state" else arrays[n][0]
        for n in ("query", "key", "value", "g", "initial_state")
    )
    state = h0 * jnp.exp(g)[:, :, None] + k[:, :, None] * v[:, None, :]
    assert_close(out[0, 0], 16**-0.5 * jnp.einsum("hk,hkv->hv", q, state), scale=lc.F32)
    assert_close(final[0], state, scale=lc.F32)


def test_three_hundred_and_thirty_three_steps_stay_within_1e_4_in_float32() -> None:
    # Default chunks (64): 6 chunks, the last one padded; gradients over the whole length.
    arrays = make_inputs(1, 333, 2, 32, 32, num_states=1)
    check(arrays, cfg=None, return_state=True)


def test_bfloat16_matches_the_float32_reference() -> None:
    arrays = make_inputs(2, 37, 3, 16, 24, num_states=2, dtype=jnp.bfloat16)
    out, _ = check(arrays, scale=1.0)
    assert out.dtype == jnp.bfloat16


def test_two_halves_with_the_carried_state_equal_one_run() -> None:
    arrays = make_inputs(2, 40, 3, 16, 24, num_states=2)
    lc.check_two_halves(ejkernel.gla, arrays, ("query", "key", "value", "g"), 20, cfg=SMALL)


def test_jit_and_vmap_of_gradients_match_the_reference() -> None:
    arrays = make_inputs(2, 37, 3, 16, 24)
    lc.check_jit_vmap_grad(functools.partial(ejkernel.gla, cfg=SMALL), gla_reference, arrays)


def test_forward_and_backward_memory_grows_linearly_in_the_sequence() -> None:
    def temp_bytes(s: int) -> int:
        shapes = [jax.ShapeDtypeStruct((1, s, 2, 32), jnp.float32) for _ in range(4)]

        def fwd_bwd(q: Any, k: Any, v: Any, g: Any) -> Any:
            out, vjp = jax.vjp(lambda *x: ejkernel.gla(*x), q, k, v, g)
            return vjp(out)

        stats = jax.jit(fwd_bwd).lower(*shapes).compile().memory_analysis()
        if stats is None:
            pytest.skip("this backend reports no memory analysis")
        return int(stats.temp_size_in_bytes)

    small, large = temp_bytes(1024), temp_bytes(8192)
    assert large < 8 * 1.2 * small  # linear (8x tokens), not quadratic
    inputs = 8192 * 2 * 32 * 4 * 4  # q, k, v, g in float32
    assert large < 16 * inputs


def test_forward_alone_mixes_both_intra_forms_per_chunk_and_matches_the_reference() -> None:
    # Not differentiated: the primal streaming forward. Batch row 1 has strong gates in tokens
    # 40-59 only, so its chunks 2-3 take the exact form and every other chunk the factored one.
    arrays = make_inputs(2, 100, 3, 16, 24, strength=0.25, num_states=2, seed=3)
    strong = (jnp.arange(100) >= 40) & (jnp.arange(100) < 60)
    g = arrays["g"].at[1].multiply(jnp.where(strong, 64.0, 1.0)[:, None, None])
    arrays = {**arrays, "g": g}
    out, final = jax.jit(lambda a: ejkernel.gla(**a, return_state=True, cfg=SMALL))(arrays)
    ref_out, ref_final = gla_reference(**arrays, return_state=True)
    assert_close(out, ref_out, scale=lc.F32, name="out")
    assert_close(final, ref_final, scale=lc.F32, name="final")
    # The same through ``recurrent`` run backwards (the streamed form flips the tokens).
    rec = {n: arrays[n] for n in ("query", "key", "value", "initial_state")}
    rec["gk"] = arrays["g"]
    out, final = jax.jit(
        lambda a: ejkernel.recurrent(**a, reverse=True, return_state=True, cfg=SMALL)
    )(rec)
    ref_out, ref_final = recurrent_reference(**rec, reverse=True, return_state=True)
    assert_close(out, ref_out, scale=lc.F32, name="reverse out")
    assert_close(final, ref_final, scale=lc.F32, name="reverse final")


def test_forward_alone_builds_no_per_chunk_states() -> None:
    # The primal keeps only the carried [H, K, V] state: its temporaries stay far below the
    # [S / C, B, H, K, V] chunk-start states that the custom-VJP forward saves.
    b, s, h, d = 1, 4096, 2, 64
    shapes = [jax.ShapeDtypeStruct((b, s, h, d), jnp.float32) for _ in range(4)]
    fn = jax.jit(lambda *x: ejkernel.gla(*x, cfg=GlaConfig(chunk_size=16)))
    stats = fn.lower(*shapes).compile().memory_analysis()
    if stats is None:
        pytest.skip("this backend reports no memory analysis")
    chunk_states = (s // 16) * b * h * d * d * 4
    assert int(stats.temp_size_in_bytes) < chunk_states // 4


def test_explain_reports_the_xla_heuristic_config() -> None:
    arrays = make_inputs(2, 37, 3, 16, 24)
    record = ejkernel.explain("gla", **arrays)
    assert record.platform == "xla" and record.source == "heuristic"
    assert record.config == GlaConfig(chunk_size=64, sub_chunk_size=16)
    assert ejkernel.explain(ejkernel.gla, **arrays, cfg=SMALL).source == "override"


@pytest.mark.parametrize(
    ("s", "cu"), [(4096, None), (37, None), (4096, 256)], ids=["S4096", "S37", "S4096-packed-256"]
)
def test_configs_never_use_chunks_longer_than_needed(s: int, cu: int | None) -> None:
    inv = lc.linear_invocation(s, cu)
    space = config_space(inv)
    assert space[0] == heuristic(inv) and len(space) == len(set(space)) <= 8
    for cfg in space:
        assert isinstance(cfg, GlaConfig)
        assert cfg.chunk_size <= max(64, 1 << (s - 1).bit_length())
        assert cfg.chunk_size % cfg.sub_chunk_size == 0


#: A valid call; the bad-input cases change some of its arguments.
VALID = make_inputs(2, 37, 3, 16, 24)


test_bad_inputs_raise_clear_errors_before_any_kernel = lc.rejects_bad_linear_inputs(
    ejkernel.gla,
    VALID,
    [
        pytest.param(
            {"g": jnp.zeros((2, 37, 3))}, ValueError, r"`g` must be \[B, S, H, K\]", id="g-shape"
        ),
        pytest.param(
            {"g": jnp.zeros((2, 37, 3, 16), jnp.int32)},
            TypeError,
            "`g` must be a floating",
            id="g-int",
        ),
    ],
)
