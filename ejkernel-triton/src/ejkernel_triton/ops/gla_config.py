"""gla (Triton): the config, the heuristic, the config space and what is served.

The chunked kernels (:mod:`ejkernel_triton.kernels.gla_fwd`, ``gla_bwd``) take a chunk size
``C`` (tokens per chunk: the length of the sequential state walk is ``T / C``), the sub-chunk
``BC`` (16 rows: the intra-chunk matrix is built in 16 x 16 tiles), block sizes over the key
dim ``K`` and the value dim ``V`` (the state kernels hold a ``[block_k, block_v]`` float32
tile), warps and pipeline stages.
"""

from __future__ import annotations

from typing import Any

import attrs
import jax.numpy as jnp

from ejkernel_triton import _launch
from ejkernel_triton._launch import pow2
from ejkernel_triton.ops.recurrent_fused import FUSED_MAX_TOKENS

__all__ = ["GlaConfig", "config_space", "heuristic", "supports"]

_CHUNKS = (16, 32, 64)
_MAX_DIM = 256
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@attrs.frozen(kw_only=True)
class GlaConfig:
    """Tunables of the Triton gla.

    Attributes:
        chunk_size: tokens per chunk, 16, 32 or 64 (whole sub-chunks of
            :data:`~ejkernel_triton.kernels.channel_products.SUB` rows).
        block_k: key-dim block of the state kernels and of the loops over K (a power of two
            ≥ 16; clamped to K rounded up to one).
        block_v: value-dim block, likewise.
        num_warps: warps per program.
        num_stages: software-pipelining stages.
        fused: run an undifferentiated call through the fused recurrent kernel (one token at
            a time, :mod:`ejkernel_triton.ops.recurrent_fused`; for decoding a few tokens), with
            ``block_v`` its value block; a differentiated call always runs the chunked kernels.
    """

    chunk_size: int = attrs.field(default=64, validator=attrs.validators.in_(_CHUNKS))
    block_k: int = attrs.field(default=64, validator=lambda *a: _power_of_two(*a))
    block_v: int = attrs.field(default=64, validator=lambda *a: _power_of_two(*a))
    num_warps: int = 4
    num_stages: int = 2
    fused: bool = False

    def blocks(self, dk: int, dv: int) -> tuple[int, int]:
        """``(block_k, block_v)`` clamped to the call's dims rounded up to powers of two."""
        return min(self.block_k, pow2(dk)), min(self.block_v, pow2(dv))


def _power_of_two(config: Any, attribute: Any, value: int) -> None:
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"GlaConfig.{attribute.name} must be a power of two ≥ 16; got {value}")


def supports(inv: Any) -> bool | str:
    """True, or why not: dtypes other than bf16/f16/f32, mixed dtypes, K or V over 256."""
    return kernel_limits(inv.kwargs, ("query", "key", "value", "g"))


def kernel_limits(a: dict[str, Any], arrays: tuple[str, ...]) -> bool | str:
    """What the chunked linear-attention kernels (gla's, kernel delta attention's) hold: the
    ``arrays`` of ``a`` given (checked in that order) in bf16/f16/f32, query, key and value in
    one dtype, K and V ≤ 256. True, or why not."""
    for name in arrays:
        x = a.get(name)
        if x is not None and x.dtype not in _DTYPES:
            return f"{name} dtype {x.dtype} (the Triton kernels take bfloat16, float16, float32)"
    if len({a["query"].dtype, a["key"].dtype, a["value"].dtype}) != 1:
        return "query, key and value dtypes differ"
    dk, dv = a["query"].shape[-1], a["value"].shape[-1]
    if max(dk, dv) > _MAX_DIM:
        return f"K {dk} / V {dv}: the kernels hold K, V ≤ {_MAX_DIM}"
    return True


#: The longest call (tokens per row) for which the heuristic picks the fused kernel on a GPU:
#: at B 32, H 16, K = V = 128 it takes well under the chunked kernels' time up to 8 tokens and
#: about the same at 16 (``bench_linear_gpu.py --decode``, benchmarks/RESULTS.md). Longer
#: calls run the chunked kernels.
FUSED_GPU_MAX_TOKENS = 8


def heuristic(inv: Any) -> GlaConfig:
    """Chunks of 64 with 64 x 64 state tiles (32 x 64 from K 128 on); smaller chunks for
    short sequences (packed: by their mean length, since each is padded to whole chunks), and
    in the interpreter (whose cost is per program and per loop step) whole-dim blocks.
    Decoding calls take the fused recurrent kernel: of at most :data:`FUSED_GPU_MAX_TOKENS`
    tokens on a GPU, with 16-wide value blocks (more programs over a state that is read and
    written once), and of at most :data:`FUSED_MAX_TOKENS` in the interpreter."""
    a = inv.kwargs
    s, dk, dv = a["query"].shape[1], a["query"].shape[-1], a["value"].shape[-1]
    cu = a.get("cu_seqlens")
    length = s if cu is None else s / max(1, cu.shape[0] - 1)  # mean packed length
    chunk = 64 if length > 32 else 32 if length > 16 else 16
    fused = s <= FUSED_MAX_TOKENS
    if _launch.interpreting():
        return GlaConfig(
            chunk_size=min(chunk, 32),
            block_k=pow2(dk),
            block_v=pow2(dv),
            num_stages=1,
            fused=fused,
        )
    dtype = jnp.dtype(a["query"].dtype)
    fused = s <= FUSED_GPU_MAX_TOKENS
    return GlaConfig(
        chunk_size=chunk,
        block_k=min(32 if dk >= 128 else 64, pow2(dk)),
        block_v=min(16 if fused else 64, pow2(dv)),
        num_warps=4,
        num_stages=2 if dtype.itemsize == 2 else 1,
        fused=fused,
    )


def config_space(inv: Any) -> list[GlaConfig]:
    """The heuristic, then chunks of 32 and 64 with 32/64-wide blocks and 4 or 8 warps."""
    base = heuristic(inv)
    if _launch.interpreting():
        return [base]
    a = inv.kwargs
    dk, dv = a["query"].shape[-1], a["value"].shape[-1]
    out = [base]
    for chunk in (32, 64):
        for bk, bv in ((64, 64), (32, 64), (64, 32)):
            for warps in (4, 8):
                cfg = attrs.evolve(
                    base,
                    chunk_size=min(chunk, base.chunk_size),
                    block_k=min(bk, pow2(dk)),
                    block_v=min(bv, pow2(dv)),
                    num_warps=warps,
                )
                if cfg not in out:
                    out.append(cfg)
    if base.fused:  # decoding: the fused kernel's value blocks
        for bv in (16, 32, 64):
            cfg = attrs.evolve(base, block_v=min(bv, pow2(dv)), num_warps=4)
            if cfg not in out:
                out.append(cfg)
    return out
