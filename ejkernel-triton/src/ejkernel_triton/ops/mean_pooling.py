"""mean_pooling in Triton: the registered entry, its VJP, the config, heuristic and config
space.

Dense ``x [B, S, D]`` is read as ``B`` packed sequences of ``S`` tokens, so one pair of
kernels (:mod:`ejkernel_triton.kernels.mean_pooling`) serves every layout:

- forward: per (sequence, column block, part) a float32 sum of the part's tokens; the parts
  (``split`` of them, so that short batches of long sequences still fill the GPU) are added
  and divided by the length in JAX (``max(length, 1)``: an empty sequence gives zeros). The
  sum has a fixed order: the result does not depend on the run.
- backward: per (token block, column block) each token's ``d_out[seq] / length``; tokens of
  no sequence get zeros. The token → sequence map is ``searchsorted`` over the offsets, in JAX.

Offsets are clipped to ``[0, T]`` as the spec says; their values are not checked (they may be
traced). Every dtype JAX's floating types and Triton share is served (bfloat16, float16,
float32); ``jit``, ``grad`` and ``vmap`` compose with it.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp

from ejkernel.ops import prune_by_shared_memory
from ejkernel.plugins import defvjp
from ejkernel_triton import _launch, _smem
from ejkernel_triton._launch import BATCH, OTHER, pow2

__all__ = ["MeanPoolingConfig", "config_space", "heuristic", "mean_pooling_triton", "supports"]

_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@attrs.frozen(kw_only=True)
class MeanPoolingConfig:
    """Tunables of the Triton mean pooling.

    Attributes:
        block_t: tokens per step (forward) and per program (backward).
        block_d: columns per program.
        split: parts each sequence's sum is cut into (programs per sequence and column
            block); ``None``: as many as fill the device (:func:`heuristic`).
        num_warps: warps per program.
        num_stages: software-pipelining stages of the forward's loop.
    """

    block_t: int = 64
    block_d: int = 128
    split: int | None = None
    num_warps: int = 4
    num_stages: int = 2


def supports(inv: Any) -> bool | str:
    """True, or why not: dtypes other than bf16/f16/f32."""
    x = inv.kwargs["x"]
    if x.dtype not in _DTYPES:
        return f"x dtype {x.dtype} (Triton kernels take bfloat16, float16, float32)"
    return True


def heuristic(inv: Any) -> MeanPoolingConfig:
    """64-token steps over up to 128 columns, the split left to the launch; in the
    interpreter, whose cost is per program, whole columns and 32-token steps."""
    x = inv.kwargs["x"]
    d = pow2(x.shape[-1])
    if _launch.interpreting():
        return MeanPoolingConfig(block_t=32, block_d=d, split=1, num_stages=1)
    return MeanPoolingConfig(block_t=64, block_d=min(128, d), num_warps=4, num_stages=2)


def config_space(inv: Any) -> list[MeanPoolingConfig]:
    """The heuristic's config and a few tiles around it, minus those whose streamed tiles
    overflow the device's shared memory."""
    base = heuristic(inv)
    if _launch.interpreting():
        return [base]
    d = pow2(inv.kwargs["x"].shape[-1])
    configs = [base]
    for t, c, w, s in ((32, 256, 4, 2), (128, 64, 4, 2), (64, 256, 8, 3), (128, 128, 8, 3)):
        configs.append(MeanPoolingConfig(block_t=t, block_d=min(c, d), num_warps=w, num_stages=s))
    size = jnp.dtype(inv.kwargs["x"].dtype).itemsize
    return prune_by_shared_memory(
        list(dict.fromkeys(configs)),
        functools.partial(smem_need, size),
        keep=(base,),
        what="mean_pooling (triton)",
    )


def smem_need(itemsize: int, cfg: MeanPoolingConfig) -> int:
    """Bytes of shared memory the forward asks for at most: ``num_stages`` buffers of its
    streamed ``[block_t, block_d]`` tile (an upper estimate: Triton may keep it in registers)."""
    return cfg.num_stages * cfg.block_t * cfg.block_d * itemsize


# -- the op ---------------------------------------------------------------------------------


def mean_pooling_triton(
    *, x: jax.Array, cu_seqlens: jax.Array | None = None, cfg: MeanPoolingConfig | None = None
) -> jax.Array:
    """Mean over each sequence's tokens through the Triton kernels (the op's arguments,
    validated by the core; ``cfg=None`` takes the heuristic's).

    Returns:
        [B, D] or [N, D] in the dtype of ``x``; empty sequences give zero rows.
    """
    out, _ = _mean_pooling_fwd(x=x, cu_seqlens=cu_seqlens, cfg=cfg)
    return out


def _mean_pooling_fwd(
    *, x: jax.Array, cu_seqlens: jax.Array | None = None, cfg: MeanPoolingConfig | None = None
) -> tuple[jax.Array, dict[str, Any]]:
    cfg = cfg or heuristic(_Inv({"x": x}))
    if cu_seqlens is None and x.ndim == 3:
        return _dense_call(cfg)(x), {"x": x, "cu_seqlens": None}
    offsets = _offsets(x, cu_seqlens)
    return _packed_call(cfg)(x.reshape(-1, x.shape[-1]), offsets), {"x": x, "cu_seqlens": offsets}


def _mean_pooling_bwd(
    residuals: dict[str, Any], d_out: jax.Array, *, cfg: MeanPoolingConfig | None = None
) -> dict[str, jax.Array]:
    x, offsets = residuals["x"], residuals["cu_seqlens"]
    cfg = cfg or heuristic(_Inv({"x": x}))
    if offsets is None:
        return {"x": _dense_bwd_call(cfg, x.shape)(d_out)}
    tokens = jax.ShapeDtypeStruct((x.shape[-2], x.shape[-1]), x.dtype)
    return {"x": _packed_bwd_call(cfg, tokens)(d_out, offsets).reshape(x.shape)}


defvjp(mean_pooling_triton, _mean_pooling_fwd, _mean_pooling_bwd)


@attrs.frozen
class _Inv:
    kwargs: dict[str, Any]


def _offsets(x: jax.Array, cu_seqlens: jax.Array | None) -> jax.Array:
    """[N + 1] int32 offsets clipped to [0, T] (``[0, T]`` for one unpacked sequence)."""
    num_tokens = x.shape[-2]
    if cu_seqlens is None:
        return jnp.asarray([0, num_tokens], jnp.int32)
    return jnp.clip(cu_seqlens.astype(jnp.int32), 0, num_tokens)


def _dense_call(cfg: MeanPoolingConfig) -> Any:
    def run(x: jax.Array) -> tuple[jax.Array]:
        b, s, d = x.shape
        offsets = jnp.arange(b + 1, dtype=jnp.int32) * s
        return (_pool(cfg, x.reshape(b * s, d), offsets, s),)

    call = _launch.fold_vmap(run, (BATCH,))
    return lambda x: call(x)[0]


def _packed_call(cfg: MeanPoolingConfig) -> Any:
    def run(tokens: jax.Array, offsets: jax.Array) -> tuple[jax.Array]:
        num_seqs = offsets.shape[0] - 1
        return (_pool(cfg, tokens, offsets, -(-tokens.shape[0] // max(num_seqs, 1))),)

    call = _launch.fold_vmap(run, (OTHER, OTHER))
    return lambda tokens, offsets: call(tokens, offsets)[0]


def _pool(cfg: MeanPoolingConfig, tokens: jax.Array, offsets: jax.Array, mean_len: int) -> Any:
    """``[N, D]`` means of the sequences ``offsets`` cut ``tokens [T, D]`` into."""
    from ejkernel_triton.kernels.mean_pooling import mean_pooling_fwd_kernel

    num_seqs, d = offsets.shape[0] - 1, tokens.shape[-1]
    block_d = min(pow2(cfg.block_d), pow2(d))
    block_t = pow2(cfg.block_t)
    col_blocks = -(-d // block_d)
    split = cfg.split or _split(num_seqs * col_blocks, mean_len, block_t)
    stages = cfg.num_stages
    while stages > 1 and smem_need(tokens.dtype.itemsize, attrs.evolve(cfg, num_stages=stages)) > (
        _smem.launch_limit()
    ):
        stages -= 1
    (partial,) = _launch.launch(
        mean_pooling_fwd_kernel,
        tokens,
        offsets,
        d,
        out_shape=[jax.ShapeDtypeStruct((num_seqs, split, d), jnp.float32)],
        grid=(num_seqs, col_blocks, split),
        num_warps=cfg.num_warps,
        num_stages=stages,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        SPLIT=split,
    )
    lengths = jnp.maximum(offsets[1:] - offsets[:-1], 0)
    sums = jnp.sum(partial, axis=1)
    out = jnp.where(lengths[:, None] > 0, sums / jnp.maximum(lengths, 1)[:, None], 0.0)
    return out.astype(tokens.dtype)


def _split(programs: int, mean_len: int, block_t: int) -> int:
    """Parts per sequence: enough programs for about four per SM (132 SMs assumed where
    the device does not say), never parts shorter than four tiles."""
    target = 4 * _sm_count()
    most = max(1, mean_len // (4 * block_t))
    return max(1, min(most, target // max(programs, 1)))


@functools.cache
def _sm_count() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def _dense_bwd_call(cfg: MeanPoolingConfig, shape: tuple[int, ...]) -> Any:
    _, s, d = shape

    def run(d_out: jax.Array) -> tuple[jax.Array]:
        batch = d_out.shape[0]
        offsets = jnp.arange(batch + 1, dtype=jnp.int32) * s
        tokens = jax.ShapeDtypeStruct((batch * s, d), d_out.dtype)
        return (_spread(cfg, d_out, offsets, tokens).reshape(batch, s, d),)

    call = _launch.fold_vmap(run, (BATCH,))
    return lambda d_out: call(d_out)[0]


def _packed_bwd_call(cfg: MeanPoolingConfig, tokens: jax.ShapeDtypeStruct) -> Any:
    def run(d_out: jax.Array, offsets: jax.Array) -> tuple[jax.Array]:
        return (_spread(cfg, d_out, offsets, tokens),)

    call = _launch.fold_vmap(run, (OTHER, OTHER))
    return lambda d_out, offsets: call(d_out, offsets)[0]


def _spread(
    cfg: MeanPoolingConfig, d_out: jax.Array, offsets: jax.Array, tokens: jax.ShapeDtypeStruct
) -> jax.Array:
    """``dx [T, D]``: each token's ``d_out[seq] / length``, zeros outside every sequence."""
    from ejkernel_triton.kernels.mean_pooling import mean_pooling_bwd_kernel

    num_tokens, d = tokens.shape
    num_seqs = offsets.shape[0] - 1
    position = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(offsets[1:], position, side="right"), num_seqs - 1)
    inside = (position >= offsets[0]) & (position < offsets[-1])
    seq = jnp.where(inside, seq, -1).astype(jnp.int32)
    inv_length = 1.0 / jnp.maximum(offsets[1:] - offsets[:-1], 1).astype(jnp.float32)
    block_d = min(pow2(cfg.block_d), pow2(d))
    block_t = pow2(cfg.block_t)
    (dx,) = _launch.launch(
        mean_pooling_bwd_kernel,
        d_out,
        seq,
        inv_length,
        num_tokens,
        d,
        out_shape=[jax.ShapeDtypeStruct((num_tokens, d), tokens.dtype)],
        grid=(-(-num_tokens // block_t), -(-d // block_d)),
        num_warps=cfg.num_warps,
        num_stages=1,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
    )
    return dx
