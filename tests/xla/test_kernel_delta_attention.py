"""The XLA chunked gated delta rule against the sequential reference.

Calls go through the public ``ejkernel.kernel_delta_attention`` (the executor wires the custom
VJP), with ``cfg=`` choosing chunk lengths shorter than the sequences so tails are padded;
gradients are ``jax.vjp`` of it against ``jax.vjp`` of the reference. Float32 is held to a
relative error of 1e-4 over 300+ steps.
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
from ejkernel.specs.kernel_delta_attention import kernel_delta_attention_reference
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal
from ejkernel_xla.ops.kernel_delta_attention import (
    KernelDeltaAttentionConfig,
    config_space,
    heuristic,
)

ARRAYS = ("query", "key", "value", "beta", "g", "initial_state")
#: Packed offsets over 97 tokens: an empty sequence first and in the middle, a length-1
#: sequence, one longer than a chunk, and tokens before the first and after the last offset.
PACKED = (2, 2, 3, 40, 40, 90)


def inputs(
    *sizes: int,
    per_channel: bool,
    states: int | None = None,
    dtype: Any = jnp.float32,
    seed: int = 0,
    decay: float = 1.0,
) -> dict[str, jax.Array]:
    """Random q, k, v of ``sizes`` (B, S, H, Dk, Dv) (never zeros), β in (0, 1), decays g ≤ 0, a random initial state."""
    b, s, h, dk, dv = sizes
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    g_shape = (b, s, h, dk) if per_channel else (b, s, h)
    return {
        **lc.qkv(ks, sizes, dtype),
        "beta": jax.nn.sigmoid(normal(ks[3], (b, s, h))).astype(dtype),
        "g": (-decay * jax.nn.softplus(normal(ks[4], g_shape))).astype(dtype),
        "initial_state": normal(ks[5], (states or b, h, dk, dv)),
    }


#: ``check(arrays, cfg=..., **statics)``: output and gradients of
#: ``ejkernel.kernel_delta_attention`` against the reference; returns ours.
check = functools.partial(
    lc.check_vjp, ejkernel.kernel_delta_attention, kernel_delta_attention_reference, ARRAYS
)


@pytest.mark.parametrize(
    ("per_channel", "chunk"),
    [(True, 16), (False, 64)],
    ids=["g-BSHK-KDA-C16", "g-BSH-GatedDeltaNet-C64"],
)
def test_outputs_states_and_gradients_match_the_reference_over_301_steps(
    per_channel: bool, chunk: int
) -> None:
    arrays = inputs(2, 301, 3, 20, 24, per_channel=per_channel)
    out, _ = check(arrays, cfg=KernelDeltaAttentionConfig(chunk_size=chunk), return_state=True)
    assert out[0].shape == (2, 301, 3, 24) and out[1].shape == (2, 3, 20, 24)
    assert out[1].dtype == jnp.float32


def test_packed_sequences_reset_the_state_and_empty_ones_keep_theirs() -> None:
    n = len(PACKED) - 1
    arrays = inputs(1, 97, 2, 16, 8, per_channel=True, states=n, seed=1)
    arrays["cu_seqlens"] = jnp.asarray(PACKED, jnp.int32)
    (out, final), grads = check(
        arrays, cfg=KernelDeltaAttentionConfig(chunk_size=16), return_state=True
    )
    assert final.shape == (n, 2, 16, 8)
    lengths = np.diff(PACKED)
    init = np.asarray(arrays["initial_state"])
    assert np.array_equal(np.asarray(final)[lengths == 0], init[lengths == 0])
    outside = np.r_[0 : PACKED[0], PACKED[-1] : 97]
    assert np.all(np.asarray(out)[0, outside] == 0.0)
    assert np.all(np.asarray(grads["query"])[0, outside] == 0.0)
    # The packed oracle itself: the last sequence (after an empty one) alone, from its own
    # state, gives the same tokens and state (ours was compared with the packed oracle above).
    lo, hi = PACKED[-2], PACKED[-1]
    alone = {k: v[:, lo:hi] for k, v in arrays.items() if k not in ("cu_seqlens", "initial_state")}
    alone_out, alone_state = kernel_delta_attention_reference(
        **alone, initial_state=arrays["initial_state"][-1:], return_state=True
    )
    assert_close(out[:, lo:hi], alone_out, scale=lc.F32)
    assert_close(final[-1:], alone_state, scale=lc.F32)


def test_two_halves_with_the_carried_state_equal_one_run() -> None:
    arrays = inputs(1, 194, 2, 16, 8, per_channel=True, seed=2)
    cfg = KernelDeltaAttentionConfig(chunk_size=16)
    lc.check_two_halves(ejkernel.kernel_delta_attention, arrays, ARRAYS[:5], 97, cfg=cfg)


def test_without_l2norm_initial_state_or_returned_state_matches_the_reference() -> None:
    arrays = inputs(1, 97, 2, 16, 8, per_channel=False, seed=3)
    arrays["initial_state"] = None
    # Without the L2 norm, keys must stay short for the delta rule to be stable.
    arrays["key"] = arrays["key"] * 0.2
    out, _ = check(
        arrays,
        cfg=KernelDeltaAttentionConfig(chunk_size=16),
        use_qk_l2norm=False,
        softmax_scale=0.5,
    )
    assert out.shape == (1, 97, 2, 8)


def test_decays_far_past_float32_range_inside_a_chunk_stay_exact() -> None:
    # Σg over a chunk of 16 reaches about -300: any factorisation through the chunk start
    # would overflow exp() and give NaN.
    arrays = inputs(1, 97, 2, 16, 8, per_channel=True, seed=4, decay=20.0)
    out, grads = check(arrays, cfg=KernelDeltaAttentionConfig(chunk_size=16), return_state=True)
    for x in (*out, *grads.values()):
        assert np.all(np.isfinite(np.asarray(x)))


def test_forward_alone_mixes_factored_and_exact_chunks_and_matches_the_reference() -> None:
    # Not differentiated: the primal streaming forward. Tokens 30-45 of batch row 0 decay
    # strongly (a chunk's Σg far past -80: the hierarchical products), the rest mildly (the
    # factored ones); 101 tokens end in a padded chunk.
    arrays = inputs(2, 101, 3, 16, 8, per_channel=True, seed=7, decay=0.1)
    strong = (jnp.arange(101) >= 30) & (jnp.arange(101) < 46)
    g = arrays["g"].at[0].multiply(jnp.where(strong, 400.0, 1.0)[:, None, None])
    arrays = {**arrays, "g": g}
    cfg = KernelDeltaAttentionConfig(chunk_size=16)
    out, final = jax.jit(
        lambda a: ejkernel.kernel_delta_attention(**a, return_state=True, cfg=cfg)
    )(arrays)
    ref_out, ref_final = kernel_delta_attention_reference(**arrays, return_state=True)
    assert_close(out, ref_out, scale=lc.F32, name="out")
    assert_close(final, ref_final, scale=lc.F32, name="final")
    assert np.all(np.isfinite(np.asarray(out)))


def test_bfloat16_matches_the_float32_reference() -> None:
    arrays = inputs(1, 97, 2, 16, 8, per_channel=True, dtype=jnp.bfloat16, seed=5)
    check(arrays, cfg=KernelDeltaAttentionConfig(chunk_size=16), scale=1.0, return_state=True)


def test_jit_of_vmap_of_the_gradient_matches_the_reference() -> None:
    arrays = inputs(1, 21, 2, 8, 8, per_channel=True, seed=6)
    cfg = KernelDeltaAttentionConfig(chunk_size=8)
    lc.check_jit_vmap_grad(
        functools.partial(ejkernel.kernel_delta_attention, cfg=cfg),
        kernel_delta_attention_reference,
        arrays,
    )


def test_explain_names_the_xla_platform_and_the_heuristic_chunk() -> None:
    arrays = inputs(1, 37, 2, 8, 8, per_channel=False)
    record = ejkernel.explain("kernel_delta_attention", **arrays)
    assert record.platform == "xla" and record.source == "heuristic"
    assert record.config == KernelDeltaAttentionConfig(chunk_size=32)
    chosen = ejkernel.explain(
        "kernel_delta_attention", **arrays, cfg=KernelDeltaAttentionConfig(chunk_size=8)
    )
    assert chosen.source == "override" and chosen.config.chunk_size == 8


def test_configs_fit_the_sequences_and_every_call_is_supported() -> None:
    assert heuristic(lc.linear_invocation(5)).chunk_size == 8
    assert heuristic(lc.linear_invocation(4096)).chunk_size >= 16
    assert heuristic(lc.linear_invocation(4096, 1024)).chunk_size == 4  # 1024 sequences of 4 tokens
    space = config_space(lc.linear_invocation(100))
    assert space[0] == heuristic(lc.linear_invocation(100)) and len(space) == len(set(space))
    with pytest.raises(ValueError, match="chunk_size"):
        KernelDeltaAttentionConfig(chunk_size=0)


#: A valid call (B = 2) and a valid one-row call (packed sequences need B == 1); the bad-input
#: cases change some of their arguments.
VALID = inputs(2, 9, 2, 4, 3, per_channel=False)
ONE_ROW = inputs(1, 9, 2, 4, 3, per_channel=False)


test_bad_inputs_raise_clear_errors_before_any_kernel = lc.rejects_bad_linear_inputs(
    ejkernel.kernel_delta_attention,
    VALID,
    [
        pytest.param(
            {"beta": jnp.ones((2, 9, 3))}, ValueError, r"`beta` must be \[B, S, H\]", id="beta"
        ),
        pytest.param(
            {"g": jnp.ones((2, 9, 2, 5))}, ValueError, r"`g` must be \[B, S, H, K\]", id="g"
        ),
        pytest.param(
            {**ONE_ROW, "cu_seqlens": jnp.asarray([0, 5, 3, 9])},
            ValueError,
            r"`cu_seqlens` must lie in \[0, S=9\]",
            id="cu-decreasing",
        ),
        pytest.param(
            {**ONE_ROW, "cu_seqlens": jnp.asarray([0, 4, 9])},
            ValueError,
            r"`initial_state` must be floating \[N, H, K, V\]",
            id="cu-states",
        ),
    ],
)


def test_bad_flags_raise_type_errors() -> None:
    with pytest.raises(TypeError, match="`use_qk_l2norm` must be a bool"):
        ejkernel.kernel_delta_attention(**VALID, use_qk_l2norm=None)
    with pytest.raises(TypeError, match="`softmax_scale` must be a number"):
        ejkernel.kernel_delta_attention(**VALID, softmax_scale="big")


def test_synthetic_autotuning_inputs_are_valid_packed_sequences_and_decays() -> None:
    from ejkernel.specs.kernel_delta_attention import SPEC

    arrays = inputs(1, 37, 2, 8, 8, per_channel=True, states=4)
    arrays["cu_seqlens"] = jnp.asarray([0, 5, 5, 20, 37], jnp.int32)
    made = lc.synthetic_like(SPEC, arrays)
    cu = np.asarray(made["cu_seqlens"])
    assert cu[0] == 0 and cu[-1] == 37 and np.all(np.diff(cu) >= 0)
    assert np.all(np.asarray(made["g"]) <= 0.0)
    beta = np.asarray(made["beta"])
    assert np.all((beta > 0.0) & (beta < 1.0))
    out = kernel_delta_attention_reference(**{k: v for k, v in made.items()})
    assert np.all(np.isfinite(np.asarray(out)))
