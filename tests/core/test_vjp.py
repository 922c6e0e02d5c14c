"""Custom VJPs (op implementations and user kernels): each backward runs with the config its
own forward chose."""

from __future__ import annotations

import itertools

import attrs
import jax
from tests.core._flash_calls import SHAPE

from ejkernel._vjp import build_op_function
from ejkernel.ops import ConfigCache, ConfigSelectorChain, Executor, Kernel
from ejkernel.plugins import get_registry
from ejkernel.specs.flash_attention import flash_attention_reference
from ejkernel.testing import assert_close, attention_inputs


def test_each_backward_gets_the_config_of_its_own_forward_when_traced_twice(toy):
    registry = get_registry()
    spec = registry.spec("flash_attention")
    (impl,) = registry.implementations("flash_attention")
    q, k, v = attention_inputs(SHAPE)
    arguments = spec.validate(spec.bind((q, k, v), {"causal": True}))
    blocks = itertools.count(1)
    f = build_op_function(spec, impl, arguments, lambda grad: toy.ToyConfig(block=next(blocks)))
    arrays = {"query": q, "key": k, "value": v}
    out1, vjp1 = jax.vjp(f, arrays)
    out2, vjp2 = jax.vjp(f, arrays)
    toy.CALLS.clear()
    (grads1,) = vjp1(out1)  # the first forward's backward runs after the second forward
    (grads2,) = vjp2(out2)
    assert [("bwd", toy.ToyConfig(block=1)), ("bwd", toy.ToyConfig(block=2))] == toy.CALLS
    expected = jax.vjp(lambda a: flash_attention_reference(**a, causal=True), arrays)[1](out1)[0]
    assert_close(grads1, expected)
    assert set(grads2) == set(arrays)


def test_a_forward_under_jit_hands_its_config_to_the_backward(toy):
    q, k, v = attention_inputs(SHAPE)

    import ejkernel

    grads = jax.jit(jax.grad(lambda q: ejkernel.flash_attention(q, k, v).sum()))(q)
    expected = jax.grad(lambda q: flash_attention_reference(q, k, v).sum())(q)
    assert_close(grads, expected)
    fwd = [c for c in toy.CALLS if c[0] == "fwd"]
    bwd = [c for c in toy.CALLS if c[0] == "bwd"]
    assert fwd and bwd and fwd[0][1] == bwd[0][1]


class _Scale(Kernel):
    """``x * cfg.factor``, whose hand-written backward records the config it is handed."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def run(self, x, *, cfg):
        return x * cfg.factor

    def heuristic_cfg(self, inv):
        return _Factor(factor=2.0)

    def custom_vjp(self, primals, cfg, kwargs, cotangents):
        self.seen.append(cfg)
        return (cotangents[0] * cfg.factor,)


@attrs.frozen
class _Factor:
    factor: float


def test_a_user_kernels_backward_gets_the_config_its_forward_ran_with():
    executor = Executor(ConfigSelectorChain(cache=ConfigCache(), persistent=False))
    x = jax.numpy.arange(3.0)
    kernel = _Scale()
    grad = jax.grad(lambda x: executor(kernel, x, cfg=_Factor(factor=5.0)).sum())(x)
    assert grad.tolist() == [5.0, 5.0, 5.0] and kernel.seen == [_Factor(factor=5.0)]
    grad = jax.grad(lambda x: executor(kernel, x).sum())(x)
    assert grad.tolist() == [2.0, 2.0, 2.0] and kernel.seen[-1] == _Factor(factor=2.0)
