"""The XLA chunked gated delta rule against the sequential reference.

Calls go through the public ``ejkernel.kernel_delta_attention`` (the executor wires the custom
VJP), with ``cfg=`` choosing chunk lengths shorter than the sequences so tails are padded;
gradients are ``jax.vjp`` of it against ``jax.vjp`` of the reference. Float32 is held to a
relative error of 1e-4 over 300+ steps.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
#: f32 tolerance of this op: 1e-4 relative (the float32 table's 1e-5, times 10).
F32 = 10.0
#: Packed offsets over 97 tokens: an empty sequence first and in the middle, a length-1
#: sequence, one longer than a chunk, and tokens before the first and after the last offset.
PACKED = (2, 2, 3, 40, 40, 90)


def inputs(
    b: int,
    s: int,
    h: int,
    dk: int,
    dv: int,
    *,
    per_channel: bool,
    states: int | None = None,
    dtype: Any = jnp.float32,
    seed: int = 0,
    decay: float = 1.0,
) -> dict[str, jax.Array]:
    """Random q, k, v (never zeros), β in (0, 1), decays g ≤ 0, a random initial state."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    g_shape = (b, s, h, dk) if per_channel else (b, s, h)
    return {
        "query": normal(ks[0], (b, s, h, dk), dtype),
        "key": normal(ks[1], (b, s, h, dk), dtype),
        "value": normal(ks[2], (b, s, h, dv), dtype),
        "beta": jax.nn.sigmoid(normal(ks[3], (b, s, h))).astype(dtype),
        "g": (-decay * jax.nn.softplus(normal(ks[4], g_shape))).astype(dtype),
        "initial_state": normal(ks[5], (states or b, h, dk, dv)),
    }


def run_both(arrays: dict[str, Any], cfg: Any = None, **statics: Any) -> tuple[Any, Any, Any, Any]:
    """Outputs and gradients of ours (public function) and of the reference.

    Eager ``jax.vjp``: the executor's custom VJP runs the implementation's own jitted forward
    and backward, whose compilations are shared by every test of the same shapes.
    """
    diff = {n: arrays[n] for n in ARRAYS if arrays.get(n) is not None}
    rest = {n: v for n, v in arrays.items() if n not in diff}

    def fwd_bwd(fn: Any) -> Any:
        out, vjp = jax.vjp(lambda d: fn(**d, **rest, **statics), diff)
        cot = jax.tree.map(lambda o: normal(jax.random.PRNGKey(42), o.shape, o.dtype), out)
        return out, vjp(cot)[0]

    ours = fwd_bwd(lambda **kw: ejkernel.kernel_delta_attention(**kw, cfg=cfg))
    ref = fwd_bwd(kernel_delta_attention_reference)
    return ours[0], ours[1], ref[0], ref[1]


def check(
    arrays: dict[str, Any], cfg: Any = None, scale: float = F32, **statics: Any
) -> tuple[Any, Any]:
    out, grads, ref_out, ref_grads = run_both(arrays, cfg, **statics)
    dtype = arrays["query"].dtype
    first = out[0] if isinstance(out, tuple) else out
    assert first.dtype == dtype
    assert_close(out, ref_out, scale=scale, dtype=dtype, name="out")
    for name, grad in grads.items():
        assert grad.shape == arrays[name].shape and grad.dtype == arrays[name].dtype, name
        assert_close(grad, ref_grads[name], scale=scale, dtype=dtype, name=f"d{name}")
    return out, grads


@pytest.mark.parametrize(
    ("per_channel", "chunk"),
    [(True, 16), (False, 64)],
    ids=["g-BSHK-KDA-C16", "g-BSH-GatedDeltaNet-C64"],
)
def test_outputs_states_and_gradients_match_the_reference_over_301_steps(
    per_channel: bool, chunk: int
) -> None:
    arrays = inputs(2, 301, 3, 20, 24, per_channel=per_channel)
    out, _ = check(arrays, KernelDeltaAttentionConfig(chunk_size=chunk), return_state=True)
    assert out[0].shape == (2, 301, 3, 24) and out[1].shape == (2, 3, 20, 24)
    assert out[1].dtype == jnp.float32


def test_packed_sequences_reset_the_state_and_empty_ones_keep_theirs() -> None:
    n = len(PACKED) - 1
    arrays = inputs(1, 97, 2, 16, 8, per_channel=True, states=n, seed=1)
    arrays["cu_seqlens"] = jnp.asarray(PACKED, jnp.int32)
    (out, final), grads = check(
        arrays, KernelDeltaAttentionConfig(chunk_size=16), return_state=True
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
    assert_close(out[:, lo:hi], alone_out, scale=F32)
    assert_close(final[-1:], alone_state, scale=F32)


def test_two_halves_with_the_carried_state_equal_one_run() -> None:
    arrays = inputs(1, 194, 2, 16, 8, per_channel=True, seed=2)
    cfg = KernelDeltaAttentionConfig(chunk_size=16)
    whole, state = ejkernel.kernel_delta_attention(**arrays, return_state=True, cfg=cfg)
    first = {k: v[:, :97] if k != "initial_state" else v for k, v in arrays.items()}
    second = {k: v[:, 97:] for k, v in arrays.items() if k != "initial_state"}
    out1, mid = ejkernel.kernel_delta_attention(**first, return_state=True, cfg=cfg)
    out2, end = ejkernel.kernel_delta_attention(
        **second, initial_state=mid, return_state=True, cfg=cfg
    )
    assert_close(jnp.concatenate([out1, out2], axis=1), whole, scale=F32)
    assert_close(end, state, scale=F32)


def test_without_l2norm_initial_state_or_returned_state_matches_the_reference() -> None:
    arrays = inputs(1, 97, 2, 16, 8, per_channel=False, seed=3)
    arrays["initial_state"] = None
    # Without the L2 norm, keys must stay short for the delta rule to be stable.
    arrays["key"] = arrays["key"] * 0.2
    out, _ = check(
        arrays, KernelDeltaAttentionConfig(chunk_size=16), use_qk_l2norm=False, softmax_scale=0.5
    )
    assert out.shape == (1, 97, 2, 8)


def test_decays_far_past_float32_range_inside_a_chunk_stay_exact() -> None:
    # Σg over a chunk of 16 reaches about -300: any factorisation through the chunk start
    # would overflow exp() and give NaN.
    arrays = inputs(1, 97, 2, 16, 8, per_channel=True, seed=4, decay=20.0)
    out, grads = check(arrays, KernelDeltaAttentionConfig(chunk_size=16), return_state=True)
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
    assert_close(out, ref_out, scale=F32, name="out")
    assert_close(final, ref_final, scale=F32, name="final")
    assert np.all(np.isfinite(np.asarray(out)))


def test_bfloat16_matches_the_float32_reference() -> None:
    arrays = inputs(1, 97, 2, 16, 8, per_channel=True, dtype=jnp.bfloat16, seed=5)
    check(arrays, KernelDeltaAttentionConfig(chunk_size=16), scale=1.0, return_state=True)


def test_jit_of_vmap_of_the_gradient_matches_the_reference() -> None:
    arrays = inputs(1, 21, 2, 8, 8, per_channel=True, seed=6)
    stacked = {k: jnp.stack([v, 0.5 * v]) for k, v in arrays.items()}
    cfg = KernelDeltaAttentionConfig(chunk_size=8)

    def loss(fn: Any, arrs: dict[str, Any]) -> Any:
        return jnp.sum(jnp.sin(fn(**arrs)))

    ours = jax.jit(
        jax.vmap(
            jax.value_and_grad(
                lambda a: loss(lambda **k: ejkernel.kernel_delta_attention(**k, cfg=cfg), a)
            )
        )
    )
    ref = jax.vmap(jax.value_and_grad(lambda a: loss(kernel_delta_attention_reference, a)))
    assert_close(ours(stacked), ref(stacked), scale=F32)


def test_explain_names_the_xla_platform_and_the_heuristic_chunk() -> None:
    arrays = inputs(1, 37, 2, 8, 8, per_channel=False)
    record = ejkernel.explain("kernel_delta_attention", **arrays)
    assert record.platform == "xla" and record.source == "heuristic"
    assert record.config == KernelDeltaAttentionConfig(chunk_size=32)
    chosen = ejkernel.explain(
        "kernel_delta_attention", **arrays, cfg=KernelDeltaAttentionConfig(chunk_size=8)
    )
    assert chosen.source == "override" and chosen.config.chunk_size == 8


class _Inv:
    def __init__(self, s: int, cu: int | None = None) -> None:
        self.kwargs = {
            "query": jax.ShapeDtypeStruct((1, s, 2, 8), jnp.float32),
            "cu_seqlens": None if cu is None else jax.ShapeDtypeStruct((cu,), jnp.int32),
        }
        self.metadata = {"grad": True}


def test_configs_fit_the_sequences_and_every_call_is_supported() -> None:
    assert heuristic(_Inv(5)).chunk_size == 8
    assert heuristic(_Inv(4096)).chunk_size >= 16
    assert heuristic(_Inv(4096, cu=1025)).chunk_size == 4  # 1024 sequences of 4 tokens
    space = config_space(_Inv(100))
    assert space[0] == heuristic(_Inv(100)) and len(space) == len(set(space))
    with pytest.raises(ValueError, match="chunk_size"):
        KernelDeltaAttentionConfig(chunk_size=0)


def _bad(**changes: Any) -> dict[str, Any]:
    arrays = inputs(1, 9, 2, 4, 3, per_channel=False)
    arrays.update(changes)
    return arrays


@pytest.mark.parametrize(
    ("arrays", "error", "match"),
    [
        (_bad(key=jnp.ones((1, 9, 2, 5))), ValueError, r"`key` must be \[B, S, H, K\]"),
        (_bad(value=jnp.ones((1, 8, 2, 3))), ValueError, r"`value` must be \[B, S, H, V\]"),
        (_bad(beta=jnp.ones((1, 9, 3))), ValueError, r"`beta` must be \[B, S, H\]"),
        (_bad(g=jnp.ones((1, 9, 2, 5))), ValueError, r"`g` must be \[B, S, H, K\]"),
        (
            _bad(initial_state=jnp.ones((1, 2, 3, 4))),
            ValueError,
            r"`initial_state` must be floating \[B, H, K, V\]",
        ),
        (
            _bad(query=jnp.ones((1, 9, 2, 4), jnp.int32)),
            TypeError,
            r"`query` must be a floating array",
        ),
        (
            _bad(cu_seqlens=jnp.asarray([0, 5, 3, 9])),
            ValueError,
            r"`cu_seqlens` must lie in \[0, S=9\]",
        ),
        (
            _bad(cu_seqlens=jnp.asarray([0.0, 9.0])),
            TypeError,
            r"`cu_seqlens` must be an integer array",
        ),
        (
            {**inputs(2, 9, 2, 4, 3, per_channel=False), "cu_seqlens": jnp.asarray([0, 9])},
            ValueError,
            r"B == 1",
        ),
        (
            _bad(cu_seqlens=jnp.asarray([0, 4, 9])),
            ValueError,
            r"`initial_state` must be floating \[N, H, K, V\]",
        ),
    ],
    ids=[
        "key",
        "value",
        "beta",
        "g",
        "initial_state",
        "int-query",
        "cu-decreasing",
        "cu-float",
        "cu-batch",
        "cu-states",
    ],
)
def test_bad_inputs_raise_clear_errors_before_any_kernel(
    arrays: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=r"^kernel_delta_attention: .*" + match):
        ejkernel.kernel_delta_attention(**arrays)


def test_bad_flags_raise_type_errors() -> None:
    with pytest.raises(TypeError, match="`use_qk_l2norm` must be a bool"):
        ejkernel.kernel_delta_attention(**_bad(), use_qk_l2norm=None)
    with pytest.raises(TypeError, match="`softmax_scale` must be a Python number"):
        ejkernel.kernel_delta_attention(**_bad(), softmax_scale="big")


def test_synthetic_autotuning_inputs_are_valid_packed_sequences_and_decays() -> None:
    from ejkernel.specs.kernel_delta_attention import SPEC

    arrays = inputs(1, 37, 2, 8, 8, per_channel=True, states=4)
    arrays["cu_seqlens"] = jnp.asarray([0, 5, 5, 20, 37], jnp.int32)
    bound = SPEC.validate(SPEC.bind((), arrays))
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype) if hasattr(v, "shape") else v
        for k, v in bound.items()
    }
    made = SPEC.validate(SPEC.make_synthetic(abstract, seed=0))
    cu = np.asarray(made["cu_seqlens"])
    assert cu[0] == 0 and cu[-1] == 37 and np.all(np.diff(cu) >= 0)
    assert np.all(np.asarray(made["g"]) <= 0.0)
    beta = np.asarray(made["beta"])
    assert np.all((beta > 0.0) & (beta < 1.0))
    out = kernel_delta_attention_reference(**{k: v for k, v in made.items()})
    assert np.all(np.isfinite(np.asarray(out)))
