"""ragged_page_attention_v3 as Pallas Mosaic-TPU kernels: the new tokens' keys and values
written into their pages in place, then :mod:`.ragged_page_attention`'s kernel on the updated
caches.

The update is a kernel of its own: grid ``(T,)``, each token's cache row (the caches seen as
``[num_pages · page_size, Hkv, D]``; :func:`ejkernel.specs.ragged_page_attention_v3.cache_destinations`,
``-1`` for a token not written) scalar-prefetched into SMEM. Step ``t`` copies ``keys[t]`` and
``values[t]`` (``[Hkv, D]`` blocks in VMEM) to that row of each cache with two DMAs, or does
nothing. The caches stay in HBM (``memory_space=ANY``) and are aliased to the outputs
(``input_output_aliases``): the kernel writes the ``T`` new rows and nothing else, so under
``jax.jit`` with the caches donated the step holds one copy of each cache; without donation XLA
copies each cache once before the kernel (the caller's stay valid).

Declined in ``supports()`` as :mod:`.ragged_page_attention` declines (``k_scale``/``v_scale``,
other cache dtypes, blocks over the VMEM budget, tables over SMEM), plus the update's own SMEM
(one int32 per token).

Verified without a TPU: ``tests/pallas/test_tpu_ragged_page_attention_v3.py`` and the
conformance kit run both kernels in Pallas's TPU interpret mode against the spec's reference
(the updated caches too); the update's DMAs into aliased HBM buffers have not run on a TPU.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.specs.ragged_page_attention_v3 import cache_destinations

# Not `_compat`: the `__repr__` attrs generates reads attrs' own `_compat` from this module.
from ejkernel_pallas import _compat as compat
from ejkernel_pallas.tpu import _paged
from ejkernel_pallas.tpu import ragged_page_attention as ragged
from ejkernel_pallas.tpu.ragged_page_attention import RaggedPageAttentionConfig

__all__ = [
    "RaggedPageAttentionV3Config",
    "config_space",
    "heuristic",
    "ragged_page_attention_v3_pallas",
    "supports",
    "write_tokens",
]


@attrs.frozen(kw_only=True)
class RaggedPageAttentionV3Config(RaggedPageAttentionConfig):
    """Tunables of the attention kernel (:class:`RaggedPageAttentionConfig`'s; the update has
    none)."""


def _v3(cfg: RaggedPageAttentionConfig) -> RaggedPageAttentionV3Config:
    return RaggedPageAttentionV3Config(fwd_params=cfg.fwd_params)


def heuristic(inv: Any) -> RaggedPageAttentionV3Config:
    """The attention kernel's heuristic (:func:`.ragged_page_attention.heuristic`)."""
    return _v3(ragged.heuristic(inv))


def config_space(inv: Any) -> list[RaggedPageAttentionV3Config]:
    """The attention kernel's config space (:func:`.ragged_page_attention.config_space`)."""
    return [_v3(cfg) for cfg in ragged.config_space(inv)]


def supports(inv: Any) -> bool | str:
    """True, or why these kernels cannot serve the call (see the module docstring)."""
    reason = ragged.supports(inv)
    if reason is not True:
        return str(reason).replace("ragged_page_attention", "ragged_page_attention_v3")
    tokens = inv.kwargs["queries"].shape[0]
    if _paged.smem_bytes(tokens) > _paged.smem_budget():
        return (
            f"the Pallas TPU ragged_page_attention_v3 prefetches one cache row per token into "
            f"SMEM: {tokens} tokens exceed the budget of {_paged.smem_budget()} bytes"
        )
    return True


def ragged_page_attention_v3_pallas(
    *, cfg: RaggedPageAttentionV3Config | None = None, **args: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write the new keys/values into their pages (in place), then ragged paged attention.

    Args:
        cfg: the attention's query and kv blocks; ``None`` takes the heuristic's.
        **args: :func:`ejkernel.ragged_page_attention_v3`'s arguments by name, as its spec
            validated them; donate ``key_cache`` and ``value_cache``
            (``jax.jit(..., donate_argnums=...)``) for an update without a copy.

    Returns:
        ``(out [T, Hq, D], key_cache, value_cache)``.
    """
    key_cache, value_cache = args["key_cache"], args["value_cache"]
    num_pages, page_size = (int(n) for n in key_cache.shape[:2])
    num_seqs = args.get("num_seqs")
    if num_seqs is None:
        num_seqs = args["kv_lens"].shape[0]
    tables = (args["kv_lens"], args["block_tables"], args["query_start_loc"], num_seqs)
    dest = cache_destinations(*tables, args["queries"].shape[0], num_pages, page_size)
    key_cache, value_cache = write_tokens(
        key_cache,
        value_cache,
        args["keys"].astype(key_cache.dtype),
        args["values"].astype(value_cache.dtype),
        dest,
    )
    attention = {n: v for n, v in args.items() if n not in ("keys", "values")}
    attention |= {"key_cache": key_cache, "value_cache": value_cache}
    base = None if cfg is None else RaggedPageAttentionConfig(fwd_params=cfg.fwd_params)
    out = ragged.ragged_page_attention_pallas(cfg=base, **attention)
    return out, key_cache, value_cache


@functools.partial(jax.jit, static_argnames=("interpret",))
def _write(
    key_cache: jax.Array,
    value_cache: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    dest: jax.Array,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    pl, pltpu = compat.pl, compat.pltpu()
    shape = key_cache.shape
    rows = shape[0] * shape[1]
    flat = [c.reshape(rows, *shape[2:]) for c in (key_cache, value_cache)]
    t, hkv, d = keys.shape
    token = pl.BlockSpec((1, hkv, d), lambda i, *_: (i, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        _write_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(t,),
            in_specs=[token, token, hbm, hbm],
            out_specs=[hbm, hbm],
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in flat],
        # Inputs count the scalar-prefetched destinations: the caches are inputs 3 and 4.
        input_output_aliases={3: 0, 4: 1},
        compiler_params=compat.tpu_compiler_params(dimension_semantics=("arbitrary",)),
        interpret=compat.tpu_interpret_params() if interpret else False,
        name="ejkernel_paged_cache_write",
    )
    if interpret:  # the interpreter has no batching rule for it: one call per batch entry
        call = jax.custom_batching.sequential_vmap(call)
    key_out, value_out = call(dest, keys, values, *flat)
    return key_out.reshape(shape), value_out.reshape(shape)


def write_tokens(
    key_cache: jax.Array,
    value_cache: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    dest: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The caches with row ``t`` of ``keys``/``values`` (``[T, Hkv, D]``, in the cache dtype)
    written at cache row ``dest[t]`` (skipped where ``-1``), the caches aliased to the
    outputs."""
    if keys.shape[0] == 0:
        return key_cache, value_cache
    return _write(
        key_cache, value_cache, keys, values, dest.astype(jnp.int32), _paged.interpreting()
    )


def _write_kernel(dest_ref, keys_ref, values_ref, _key_in, _value_in, key_out, value_out, sems):
    pl, pltpu = compat.pl, compat.pltpu()
    row = dest_ref[pl.program_id(0)]

    @pl.when(row >= 0)
    def _() -> None:
        copies = [
            pltpu.make_async_copy(src, dst.at[pl.ds(row, 1)], sems.at[i])
            for i, (src, dst) in enumerate(((keys_ref, key_out), (values_ref, value_out)))
        ]
        for copy in copies:
            copy.start()
        for copy in copies:
            copy.wait()
