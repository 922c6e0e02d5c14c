"""The seeds' code, as a user would type it, runs as written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from tests.core._seed_kernel import MyConfig, MyKernel

from ejkernel.ops import (
    BwdParams,
    ConfigCache,
    ConfigSelectorChain,
    Executor,
    FwdParams,
    Invocation,
    PersistentCache,
    autotune,
    benchmark,
    default_key_builder_with_sharding,
    device_fingerprint,
    device_kind,
    from_json,
    get_device_platform,
    overlay_cache,
    policy_override,
    sharding_fingerprint,
    stable_json,
    to_json,
    vmap_with_config,
)


class GradKernel(MyKernel):
    def custom_vjp(self, primals, cfg, kwargs, cotangents):
        a, b = primals
        ct = cotangents[0]
        return (3.0 * ct @ b.T, a.T @ ct)  # deliberately not the true gradient of a


def _ab():
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    return jax.random.normal(ka, (8, 16)), jax.random.normal(kb, (16, 4))


def test_seed_executor_stack_runs_a_user_kernel():
    a, b = _ab()
    cache = ConfigCache()
    selector = ConfigSelectorChain(cache=cache)
    executor = Executor(selector)
    result = executor(MyKernel(), a, b)
    assert jnp.allclose(result, a @ b)
    assert len(cache) == 1 and cache.get(next(iter(cache))) == MyConfig(block_size=64)
    result = executor(MyKernel(), a, b, cfg=MyConfig(block_size=256))
    assert jnp.allclose(result, a @ b)


def test_seed_selector_chain_with_persistent_cache_and_autotune(tmp_path):
    a, b = _ab()
    selector = ConfigSelectorChain(
        cache=ConfigCache(), persistent=PersistentCache(path=tmp_path), autotune=True
    )
    executor = Executor(selector)
    with policy_override(autotune=True):
        executor(MyKernel(), a, b)
    assert len(PersistentCache(path=tmp_path)) == 1
    with policy_override(autotune=False):
        executor(MyKernel(), a, b)


def test_seed_overlay_and_policy_override():
    a, b = _ab()
    my_custom_cache = ConfigCache()
    executor = Executor(ConfigSelectorChain(cache=ConfigCache()))
    with overlay_cache(my_custom_cache):
        executor(MyKernel(), a, b)
    with policy_override(autotune=False):
        executor(MyKernel(), a, b)


def test_seed_custom_vjp_is_used_for_gradients():
    a, b = _ab()
    executor = Executor(ConfigSelectorChain(cache=ConfigCache(), persistent=False))
    ga = jax.grad(lambda a: executor(GradKernel(), a, b).sum())(a)
    assert jnp.allclose(ga, 3.0 * jnp.ones((8, 4)) @ b.T)


def test_seed_manual_autotune_and_benchmark():
    a, b = _ab()
    kernel = MyKernel()
    inv = Invocation(kernel=kernel, args=(a, b))
    best_config = autotune(
        kernel, a, b, configs=kernel.config_space(inv), num_warmup=3, num_iters=10
    )
    assert best_config in kernel.config_space(inv)
    time_ms = benchmark(lambda: kernel(a, b), num_iters=100)
    assert time_ms > 0


def test_seed_vmap_with_config():
    a, b = _ab()
    batched = vmap_with_config(MyKernel(), in_axes=(0, 0))(jnp.stack([a, a]), jnp.stack([b, b]))
    assert batched.shape == (2, 8, 4)


def test_seed_params_device_and_serialisation_helpers():
    fwd = FwdParams(q_blocksize=128, kv_blocksize=256, num_warps=4, num_stages=2)
    bwd = BwdParams(q_blocksize=64, kv_blocksize=128)
    assert from_json(to_json(fwd), FwdParams) == fwd and bwd.num_warps is None
    assert device_kind() in ("gpu", "tpu", "cpu")
    assert get_device_platform() in ("xla", "triton", "pallas", "cuda")
    assert device_fingerprint().startswith(device_kind())
    assert sharding_fingerprint(jnp.ones(3)) is None
    a, b = _ab()
    key = default_key_builder_with_sharding(MyKernel(), (a, b), {"scale": 1.0})
    assert key == default_key_builder_with_sharding(MyKernel(), (a + 1, b), {"scale": 1.0})
    assert key != default_key_builder_with_sharding(MyKernel(), (a[:4], b), {"scale": 1.0})
    assert stable_json(MyConfig()) == '{"algorithm":"default","block_size":128,"num_warps":4}'
    assert from_json(to_json(MyConfig(block_size=1)), MyConfig) == MyConfig(block_size=1)


def test_seed_registry_decorator():
    from ejkernel.kernels import Backend, Platform, kernel_registry

    @kernel_registry.register("my_kernel", Platform.TRITON, Backend.GPU)
    def my_kernel_triton(inputs, **kwargs):
        return inputs * 2

    assert kernel_registry.get("my_kernel", Platform.TRITON) is my_kernel_triton
    assert Platform("myplugin") == "myplugin" and Platform.XLA.value == "xla"
    with pytest.raises(KeyError):
        kernel_registry.get("my_kernel", "xla")


def test_seed_module_api_flash_attention():
    from ejkernel.modules import FlashAttention, create_default_executor

    executor = create_default_executor()
    attention = FlashAttention()
    batch, seq_len, num_heads, head_dim = 2, 64, 4, 32
    key = jax.random.PRNGKey(0)
    q = k = v = jax.random.normal(key, (batch, seq_len, num_heads, head_dim))
    output = executor(attention, q, k, v, causal=True, dropout_prob=0.1, logits_soft_cap=30.0)
    assert output.shape == (batch, seq_len, num_heads, head_dim)
    assert bool(jnp.all(jnp.isfinite(output)))


def test_seed_module_config_and_function():
    from ejkernel.modules import FlashAttentionConfig, flash_attention
    from ejkernel.ops.utils.datacarrier import FwdParams

    q = k = v = jax.random.normal(jax.random.PRNGKey(1), (1, 48, 2, 16))
    output = flash_attention(q, k, v, causal=True, sliding_window=16, logits_soft_cap=30.0)
    config = FlashAttentionConfig(
        fwd_params=FwdParams(q_blocksize=16, kv_blocksize=16), platform="xla"
    )
    same = flash_attention(
        q, k, v, causal=True, sliding_window=16, logits_soft_cap=30.0, cfg=config
    )
    assert jnp.allclose(output, same, atol=1e-5)
