"""Numerics of the XLA linear-attention and state-space ops against the sequential recurrence:
a log gate of -inf is a state reset, a NaN at token t stays in token t's causal future,
zero-length packed sequences keep their states (log decays of -20 per step over 101 steps: the
conformance kit's ``decay-20`` examples hold every platform to them).

Ops: gla, recurrent (scalar ``g``, vector ``gk``, ``gv``, ``reverse``), lightning_attention,
kernel_delta_attention (vector and scalar decay), state_space_v2 (grouped B/C) and
state_space_v1, through the public ops (the executor wires the custom VJPs), in chunks of 16
so that the 37 tokens span three chunks and the special token sits inside one. Gradients are
checked against autodiff of the op's reference; float32 is held to 1e-4 relative.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.xla import _linear_cases as lc

import ejkernel
from ejkernel.specs import gla as gla_spec
from ejkernel.specs import kernel_delta_attention as kda_spec
from ejkernel.specs import lightning_attention as lightning_spec
from ejkernel.specs import recurrent as recurrent_spec
from ejkernel.specs import state_space_v1 as ssv1_spec
from ejkernel.specs import state_space_v2 as ssv2_spec
from ejkernel.specs._base import jit_over_arrays
from ejkernel.testing import assert_close
from ejkernel.testing import random_normal as normal
from ejkernel_xla.ops.gla import GlaConfig
from ejkernel_xla.ops.kernel_delta_attention import KernelDeltaAttentionConfig
from ejkernel_xla.ops.lightning_attention import LightningAttentionConfig
from ejkernel_xla.ops.recurrent import RecurrentConfig
from ejkernel_xla.ops.state_space_v1 import StateSpaceV1Config
from ejkernel_xla.ops.state_space_v2 import StateSpaceV2Config

#: The token that carries the reset or the NaN: inside the second 16-token chunk.
T = 21
#: Packed sequences of 0, 5, 0, 0, 15, 17 and 0 tokens (37 in all).
CU_SEQLENS = (0, 0, 5, 5, 5, 20, 37, 37)


LINEAR_TOKENS = ("query", "key", "value")


@attrs.frozen(kw_only=True)
class Op:
    """One op under test and how to build its inputs.

    Attributes:
        id: the test id.
        fn: the public op.
        spec: its spec module (``SPEC``: the reference and the differentiable arguments).
        gates: the log-gate arguments and their trailing axis (``"K"``, ``"V"``, ``""`` for a
            per-head scalar); the state-space ops have none (their log decay is ``Δ A``).
        per_token: the arguments with a token axis (axis 1); by default q, k, v and the gates.
        value: the argument whose entries are the values (``value``, ``x``).
        cfg: the implementation's config, 16-token chunks.
        statics: the op's other arguments.
    """

    id: str
    fn: Callable[..., Any]
    spec: Any
    gates: dict[str, str] = attrs.field(factory=dict)
    per_token: tuple[str, ...] = attrs.field(
        default=attrs.Factory(lambda op: (*LINEAR_TOKENS, *op.gates), takes_self=True)
    )
    value: str = "value"
    cfg: Any = None
    statics: dict[str, Any] = attrs.field(factory=dict)

    @property
    def linear(self) -> bool:
        return self.value == "value"

    @property
    def reverse(self) -> bool:
        return bool(self.statics.get("reverse"))

    def reference(self, **kwargs: Any) -> Any:
        return jit_over_arrays(self.spec.SPEC.reference)(**kwargs)

    def check(self, arrays: dict[str, Any], **statics: Any) -> tuple[Any, dict[str, Any]]:
        """Output and gradients against the reference's (:func:`lc.check_vjp`)."""
        names = [a.name for a in self.spec.SPEC.args if a.differentiable]
        return lc.check_vjp(
            self.fn, self.reference, names, arrays, cfg=self.cfg, **self.statics, **statics
        )


RECURRENT = RecurrentConfig(chunk_size=16, sub_chunk_size=4)
#: recurrent's gate forms: (id, gates, statics).
RECURRENT_FORMS = [
    ("recurrent-g", {"g": ""}, {}),
    ("recurrent-gk-reverse", {"gk": "K"}, {"reverse": True}),
    ("recurrent-g-gk-gv", {"g": "", "gk": "K", "gv": "V"}, {}),
]
#: The state-space ops: (id, function, spec module, config).
STATE_SPACE_FORMS = [
    ("ssd", ejkernel.state_space_v2, ssv2_spec, StateSpaceV2Config(chunk_size=16)),
    (
        "selective-scan",
        ejkernel.state_space_v1,
        ssv1_spec,
        StateSpaceV1Config(chunk_size=16, intra_chunk="associative"),
    ),
]
OPS = [
    Op(
        id="gla",
        fn=ejkernel.gla,
        spec=gla_spec,
        gates={"g": "K"},
        cfg=GlaConfig(chunk_size=16, sub_chunk_size=4),
    ),
    *(
        Op(id=i, fn=ejkernel.recurrent, spec=recurrent_spec, gates=g, cfg=RECURRENT, statics=st)
        for i, g, st in RECURRENT_FORMS
    ),
    Op(
        id="lightning",
        fn=ejkernel.lightning_attention,
        spec=lightning_spec,
        cfg=LightningAttentionConfig(chunk_size=16),
    ),
    *(
        Op(
            id=f"kda-{form}",
            fn=ejkernel.kernel_delta_attention,
            spec=kda_spec,
            gates={"g": axis},
            per_token=(*LINEAR_TOKENS, "beta", "g"),
            cfg=KernelDeltaAttentionConfig(chunk_size=16),
        )
        for form, axis in (("vector", "K"), ("scalar", ""))
    ),
    *(
        Op(
            id=i,
            fn=fn,
            spec=spec,
            per_token=("x", "B", "C", "dt", "gate"),
            value="x",
            cfg=cfg,
            statics={"dt_softplus": True},
        )
        for i, fn, spec, cfg in STATE_SPACE_FORMS
    ),
]
LINEAR = [op for op in OPS if op.linear]
OP_IDS = [op.id for op in OPS]


def inputs(op: Op, *, b: int = 2, s: int = 37, seed: int = 0, init: bool = True) -> dict[str, Any]:
    """Random inputs (never zeros): log-sigmoid gates, A < 0, ``beta`` in (0, 1); H 3, K 16,
    V 24 (state space: 4 heads of 8 channels in 2 groups of B/C, N 6)."""
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 12))
    if op.linear:
        h, dk, dv = 3, 16, 24
        arrays = lc.qkv([next(ks) for _ in range(3)], (b, s, h, dk, dv))
        sizes = {"K": (dk,), "V": (dv,), "": ()}
        for name, axis in op.gates.items():
            arrays[name] = jax.nn.log_sigmoid(normal(next(ks), (b, s, h, *sizes[axis])) + 1.0)
        if op.spec is lightning_spec:
            arrays["slopes"] = jnp.asarray([0.05, 0.5, 2.0])
        if op.spec is kda_spec:
            arrays["beta"] = jax.nn.sigmoid(normal(next(ks), (b, s, h)))
        if init:
            arrays["initial_state"] = normal(next(ks), (b, h, dk, dv))
        return arrays
    if op.spec is ssv2_spec:
        h, p, g, n = 4, 8, 2, 6
        arrays = {
            "x": normal(next(ks), (b, s, h, p)),
            "A": -jnp.exp(0.5 * normal(next(ks), (h,))),
            "B": normal(next(ks), (b, s, g, n)),
            "C": normal(next(ks), (b, s, g, n)),
            "D": normal(next(ks), (h,)),
            "dt": normal(next(ks), (b, s, h)),
            "gate": normal(next(ks), (b, s, h, p)),
        }
        state = (b, h, p, n)
    else:
        i, n = 12, 6
        arrays = {
            "x": normal(next(ks), (b, s, i)),
            "A": -jnp.exp(0.5 * normal(next(ks), (i, n))),
            "B": normal(next(ks), (b, s, n)),
            "C": normal(next(ks), (b, s, n)),
            "D": normal(next(ks), (i,)),
            "dt": normal(next(ks), (b, s, i)),
            "gate": normal(next(ks), (b, s, i)),
        }
        state = (b, i, n)
    if init:
        arrays["initial_state"] = normal(next(ks), state)
    return arrays


def at_token(x: jax.Array, t: int, value: float) -> jax.Array:
    """``x`` with every entry of token ``t`` (axis 1) set to ``value``."""
    return x.at[:, t].set(value)


def reset_at(op: Op, arrays: dict[str, Any], t: int) -> dict[str, Any]:
    """Every log gate of token ``t`` at -inf (lightning attention and the state-space ops:
    an infinite slope or A = -inf on one head or channel, a reset at every token there)."""
    if op.spec is lightning_spec:  # one gate per head for every token: an infinite slope
        return {**arrays, "slopes": arrays["slopes"].at[1].set(jnp.inf)}
    if op.linear:
        return {**arrays, **{n: at_token(arrays[n], t, -jnp.inf) for n in op.gates}}
    return {**arrays, "A": arrays["A"].at[1].set(-jnp.inf)}


def pieces(op: Op, arrays: dict[str, Any], t: int) -> tuple[Any, Any]:
    """The recurrence with its state reset at token ``t``: the reference over the tokens the
    recurrence reaches first (from the initial state), then over the others from a zero state
    (the reset token first). Returns ``(out, final_state)`` in token order."""
    cut = t + 1 if op.reverse else t
    part = lambda sl: {n: (x[:, sl] if n in op.per_token else x) for n, x in arrays.items()}
    early, late = part(slice(0, cut)), part(slice(cut, None))
    first, then = (late, early) if op.reverse else (early, late)
    before = op.reference(**first, **op.statics, return_state=True)
    then = {n: x for n, x in then.items() if n != "initial_state"}
    after = op.reference(**then, **op.statics, return_state=True)
    outs = (after[0], before[0]) if op.reverse else (before[0], after[0])
    return jnp.concatenate(outs, axis=1), after[1]


# --------------------------------------------------------------------------------------------
# A log gate of -inf is a state reset
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_a_minus_inf_log_gate_resets_the_state_with_finite_gradients(op: Op) -> None:
    arrays = reset_at(op, inputs(op), T)
    (out, final), grads = op.check(arrays, return_state=True)
    assert np.all(np.isfinite(np.asarray(out))) and np.all(np.isfinite(np.asarray(final)))
    for name, grad in grads.items():
        assert np.all(np.isfinite(np.asarray(grad))), name
    if op.gates:
        want_out, want_final = pieces(op, inputs(op), T)
        assert_close(out, want_out, scale=lc.F32, name="out against the reset recurrence")
        assert_close(final, want_final, scale=lc.F32, name="final state")


@pytest.mark.parametrize("op", [op for op in LINEAR if "g" in op.gates], ids=lambda op: op.id)
def test_a_minus_inf_gate_on_some_channels_or_tokens_matches_the_recurrence(op: Op) -> None:
    # Half the key channels of token 3, every channel of tokens 20 and 22 (two resets in one
    # chunk), then the last token: the chunk's cumulative gates cross the floor three times.
    arrays = inputs(op, seed=1)
    g = arrays["g"].at[:, 3, :, ::2].set(-jnp.inf) if op.gates["g"] else arrays["g"]
    g = g.at[:, jnp.asarray([20, 22, 36])].set(-jnp.inf)
    op.check({**arrays, "g": g}, return_state=True)


@pytest.mark.parametrize("op", OPS, ids=OP_IDS)
def test_a_reset_in_bfloat16_keeps_the_dtype_and_stays_finite(op: Op) -> None:
    arrays = reset_at(op, inputs(op), T)
    low = {
        n: x.astype(jnp.bfloat16) if n != "initial_state" and x.dtype == jnp.float32 else x
        for n, x in arrays.items()
    }
    out = op.fn(**low, cfg=op.cfg, **op.statics)
    assert out.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert_close(out, op.reference(**low, **op.statics))


@pytest.mark.parametrize(
    "op",
    [op for op in OPS if op.id in ("gla", "recurrent-g-gk-gv", "kda-vector")],
    ids=lambda op: op.id,
)
def test_jit_of_vmap_of_the_gradient_through_a_reset_matches_the_reference(op: Op) -> None:
    # Under vmap the chunk forms' conditionals become selects: both forms run, and the one
    # a reset rules out (factored) must not leak NaN into the other's gradients.
    arrays = reset_at(op, inputs(op), T)
    lc.check_jit_vmap_grad(
        lambda **a: op.fn(**a, cfg=op.cfg, **op.statics),
        lambda **a: op.reference(**a, **op.statics),
        arrays,
    )


def test_lightning_attention_with_an_infinite_slope_forgets_at_every_token() -> None:
    op = next(op for op in OPS if op.id == "lightning")
    arrays = inputs(op, init=False)
    slopes = arrays["slopes"].at[1].set(jnp.inf)
    out = ejkernel.lightning_attention(**{**arrays, "slopes": slopes}, cfg=op.cfg)
    q, k, v = (arrays[n][:, :, 1] for n in ("query", "key", "value"))
    memoryless = 16**-0.5 * jnp.sum(q * k, axis=-1, keepdims=True) * v
    assert_close(out[:, :, 1], memoryless, scale=lc.F32)


# --------------------------------------------------------------------------------------------
# A NaN stays in its causal future
# --------------------------------------------------------------------------------------------

#: How the chunks run: the streamed forward with factored chunks (mild gates), with the
#: two-level exact form (strong gates), and the all-chunks-at-once form (packed sequences).
FORMS = ("mild", "strong", "packed")


def nan_inputs(op: Op, form: str, target: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(clean, poisoned)`` inputs of ``form``; ``target`` "value": one value entry of token
    T is NaN; "token": every per-token input of token T is NaN."""
    packed = form == "packed"
    arrays = inputs(op, b=1 if packed else 2, init=not packed)
    if form == "strong":
        arrays = {n: 16.0 * x if n in op.gates else x for n, x in arrays.items()}
    if packed:
        arrays["cu_seqlens"] = jnp.asarray(CU_SEQLENS, jnp.int32)
    if target == "value":
        index = (slice(None), T) + (1,) * (arrays[op.value].ndim - 2)
        poisoned = {**arrays, op.value: arrays[op.value].at[index].set(jnp.nan)}
    else:
        poisoned = {
            n: at_token(x, T, jnp.nan) if n in op.per_token else x for n, x in arrays.items()
        }
    return arrays, poisoned


def nan_cases() -> list[Any]:
    cases = []
    for op in OPS:
        forms = FORMS if op.linear else ("mild",)
        for form in forms:
            for target in ("value", "token"):
                cases.append(pytest.param(op, form, target, id=f"{op.id}-{form}-{target}"))
    return cases


@pytest.mark.parametrize(("op", "form", "target"), nan_cases())
def test_a_nan_at_token_t_reaches_only_its_causal_future(op: Op, form: str, target: str) -> None:
    clean, poisoned = nan_inputs(op, form, target)
    call = lambda a: op.fn(**a, cfg=op.cfg, **op.statics)
    out, want = np.asarray(call(poisoned)), np.asarray(call(clean))
    past = slice(T + 1, None) if op.reverse else slice(0, T)
    assert np.all(np.isfinite(out[:, past])), "a NaN reached tokens before it"
    # (A NaN gate may move the whole call to the exact form: equal to rounding.)
    assert_close(out[:, past], want[:, past], name="before the NaN")
    assert not np.all(np.isfinite(out)), "the NaN vanished"
    # NaN exactly where the recurrence has it (per channel for a value), close elsewhere.
    assert_close(out, op.reference(**poisoned, **op.statics), scale=lc.F32)


# --------------------------------------------------------------------------------------------
# Zero-length packed sequences (strong decays over 101 steps: the conformance kit's
# ``decay-20`` examples, on every platform)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", LINEAR, ids=lambda op: op.id)
def test_zero_length_packed_sequences_keep_their_initial_state(op: Op) -> None:
    # Empty sequences first, between others and last; a reset inside the 15-token sequence.
    arrays = reset_at(op, inputs(op, b=1, init=False), 12)
    n = len(CU_SEQLENS) - 1
    init = normal(jax.random.PRNGKey(5), (n, 3, 16, 24))
    arrays = {**arrays, "cu_seqlens": jnp.asarray(CU_SEQLENS, jnp.int32), "initial_state": init}
    (out, final), grads = op.check(arrays, return_state=True)
    for empty in (0, 2, 3, 6):
        np.testing.assert_array_equal(final[empty], init[empty])
    for x in (out, final, *grads.values()):
        assert np.all(np.isfinite(np.asarray(x)))


@pytest.mark.parametrize("op", LINEAR, ids=lambda op: op.id)
def test_only_empty_packed_sequences_give_zeros_and_their_initial_states(op: Op) -> None:
    arrays = inputs(op, b=1, init=False)
    init = normal(jax.random.PRNGKey(6), (2, 3, 16, 24))
    arrays = {**arrays, "cu_seqlens": jnp.asarray([0, 0, 0], jnp.int32), "initial_state": init}
    out, final = op.fn(**arrays, cfg=op.cfg, return_state=True, **op.statics)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    np.testing.assert_array_equal(np.asarray(final), np.asarray(init))
