"""Compile the kernels a call would launch for a GPU target, on any machine (no GPU needed).

Triton compiles to PTX and SASS with its own LLVM and bundled ``ptxas``, so what the GPU will
run can be inspected on a CPU. :func:`recorded_launches` runs a launching function with
:func:`ejkernel_triton._launch.launch` replaced by a recorder; :func:`compile_launch` compiles
one recorded launch the way jax-triton does (arrays as 16-byte-aligned pointers, integer
arguments unspecialised, integers equal to 1 folded to constants) and :func:`instruction_mix`
counts the instructions that decide speed: global loads by width, ``cp.async`` copies,
``wgmma``/``mma`` matrix instructions.

Used by ``tests/triton/test_codegen.py`` (a check that tile loads stay vectorised and
pipelined) and handy when tuning: ``python -m ejkernel_triton._codegen`` prints the mix of the
heuristic flash configs, ``python -m ejkernel_triton._codegen --decode`` the decode kernel's on a
bfloat16 and a float8 cache (with the shared-memory loads by width,
:func:`shared_memory_mix`), ``--linear kda|gdn|gla`` a linear-attention op's forward and
backward launches at B 2, T 8192, H 16, D 128 (:func:`linear_launches`).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Compiled",
    "Launch",
    "compile_launch",
    "decode_launches",
    "flash_attention_launches",
    "instruction_mix",
    "linear_launches",
    "recorded_launches",
    "shared_memory_mix",
]

_POINTER_TYPES = {
    jnp.dtype(jnp.bfloat16): "*bf16",
    jnp.dtype(jnp.float16): "*fp16",
    jnp.dtype(jnp.float32): "*fp32",
    jnp.dtype(jnp.float8_e4m3fn): "*fp8e4nv",
    jnp.dtype(jnp.int32): "*i32",
    jnp.dtype(jnp.int8): "*i8",
    jnp.dtype(jnp.bool_): "*i1",
}


@attrs.frozen
class Launch:
    """One kernel launch as :func:`~ejkernel_triton._launch.launch` received it."""

    kernel: Any
    args: tuple[Any, ...]
    out_shape: tuple[jax.ShapeDtypeStruct, ...]
    num_warps: int
    num_stages: int
    constexprs: dict[str, Any]
    grid: tuple[int, ...] = ()
    zeroed_outputs: tuple[int, ...] = ()
    input_output_aliases: tuple[tuple[int, int], ...] = ()


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Within the block, launches are recorded (and return zeros) instead of running."""
    from ejkernel_triton import _launch

    record: list[Launch] = []

    def fake(
        kernel,
        *args,
        out_shape,
        grid,
        num_warps,
        num_stages,
        zeroed_outputs=(),
        input_output_aliases=None,
        **cx,
    ):
        record.append(
            Launch(
                kernel,
                args,
                tuple(out_shape),
                num_warps,
                num_stages,
                cx,
                grid,
                tuple(zeroed_outputs),
                tuple(sorted((input_output_aliases or {}).items())),
            )
        )
        return [jnp.zeros(s.shape, s.dtype) for s in out_shape]

    real = _launch.launch
    _launch.launch = fake
    try:
        yield record
    finally:
        _launch.launch = real


def compile_launch(launch: Launch, capability: int = 90) -> Compiled:
    """Compile ``launch`` for ``sm_<capability>`` in a child process.

    A child process, because Triton's interpreter (the CPU path of this plugin) leaves
    ``triton.language`` patched in a process that has used it, and a patched process cannot
    compile. The child imports triton and the kernel's module only (no JAX).
    """
    fn = launch.kernel
    values = [*launch.args, *(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in launch.out_shape)]
    signature: dict[str, str] = {}
    constexprs = dict(launch.constexprs)
    attrs_: list[int] = []
    for i, (name, value) in enumerate(zip(fn.arg_names, values, strict=False)):
        if hasattr(value, "dtype") and hasattr(value, "shape") and np.ndim(value) > 0:
            signature[name] = _POINTER_TYPES[jnp.dtype(value.dtype)]
            attrs_.append(i)  # jax-triton: every array is 16-byte aligned
        elif isinstance(value, np.floating | float):
            signature[name] = "fp32"
        elif int(value) == 1:  # jax-triton folds integers equal to 1
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -(2**31) <= int(value) < 2**31 else "i64"
    for name in constexprs:
        signature[name] = "constexpr"
    request = {
        "module": fn.fn.__module__,
        "kernel": fn.fn.__name__,
        "signature": signature,
        "constexprs": constexprs,
        "aligned": attrs_,
        "options": {
            "num_warps": launch.num_warps,
            "num_stages": launch.num_stages,
            **(getattr(fn, "ejkernel_compile_options", None) or {}),
        },
        "capability": capability,
    }
    res = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        err = res.stderr  # the compiler's message first, its IR dump (often long) after
        if len(err) > 6000:
            err = f"{err[:3000]}\n...\n{err[-3000:]}"
        raise RuntimeError(f"compiling {fn.fn.__name__} failed:\n{err}")
    out = json.loads(res.stdout.splitlines()[-1])
    return Compiled(
        ptx=out["ptx"],
        cubin=base64.b64decode(out["cubin"]),
        shared=out["shared"],
        num_warps=out["num_warps"],
    )


@attrs.frozen
class Compiled:
    """A kernel compiled for a GPU target: its PTX, its cubin, its shared memory (bytes) and
    the warps it launches with (more than asked for when Triton warp-specializes it)."""

    ptx: str
    cubin: bytes
    shared: int
    num_warps: int


_CHILD = """
import base64, importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
r = json.loads(sys.stdin.read())
fn = getattr(importlib.import_module(r["module"]), r["kernel"])
if type(fn).__name__ == "GluonJITFunction":
    from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
attrs = {(i,): [["tt.divisibility", 16]] for i in r["aligned"]}
src = ASTSource(fn, r["signature"], constexprs=r["constexprs"], attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", r["capability"], 32), options=r["options"])
print(json.dumps({"ptx": k.asm["ptx"], "cubin": base64.b64encode(k.asm["cubin"]).decode(),
                  "shared": k.metadata.shared, "num_warps": k.metadata.num_warps}))
"""


def instruction_mix(ptx: str) -> dict[str, int]:
    """Counts of the PTX instructions that decide a kernel's speed, by mnemonic."""
    pattern = r"\b(ld\.global[.\w]*|cp\.async\.c[ag][.\w]*|wgmma\.mma_async[.\w]*|mma\.sync[.\w]*)"
    return dict(collections.Counter(re.findall(pattern, ptx)))


def shared_memory_mix(ptx: str) -> dict[str, int]:
    """Counts of the shared-memory loads and stores by width (``ld.shared.b8`` one byte at a
    time, ``ldmatrix`` a matrix fragment), by mnemonic."""
    pattern = r"\b((?:ld|st)\.shared[.\w]*|ldmatrix[.\w]*)"
    return dict(collections.Counter(re.findall(pattern, ptx)))


def decode_launches(
    cache_dtype: Any = jnp.bfloat16, batch: int = 32, pages: int = 512, *, fp8_v_words: bool = False
) -> Launch:
    """The launch of a ``page_attention`` decode step (``batch`` sequences of ``pages`` pages of
    16, 32/8 heads, D 128, bfloat16 queries) over a cache of ``cache_dtype`` (``float8_e4m3fn``
    with scales), at the B 32, 8k tile: 16 rows, 128 keys, 4 warps, 2 stages, 3 splits (and
    the config's ``fp8_v_words``)."""
    from ejkernel.ops import FwdParams
    from ejkernel_triton.ops.page_attention import PageAttentionConfig
    from ejkernel_triton.ops.unified_attention import paged_attention

    hq, hkv, d = 32, 8, 128
    params = FwdParams(q_blocksize=16, kv_blocksize=128, num_warps=4, num_stages=2)
    cfg = PageAttentionConfig(fwd_params=params, num_splits=3, fp8_v_words=fp8_v_words)
    scales = {}
    if jnp.dtype(cache_dtype).itemsize == 1:
        scales = {"k_scale": jnp.float32(1.0), "v_scale": jnp.float32(1.0)}
    cache = jnp.ones((batch * pages + 1, 16, hkv, d), cache_dtype)
    call = {
        "queries": jnp.ones((batch, hq, d), jnp.bfloat16),
        "key_cache": cache,
        "value_cache": cache,
        "kv_lens": jnp.ones((batch,), jnp.int32),
        "block_tables": jnp.zeros((batch, pages), jnp.int32),
        "query_start_loc": jnp.arange(batch + 1, dtype=jnp.int32),
        **scales,
    }
    with recorded_launches() as record:
        paged_attention(cfg, call, decode=True)
    (launch,) = record
    return launch


def linear_launches(
    op: str, shape: tuple[int, int, int, int] = (2, 8192, 16, 128), cfg: Any = None
) -> list[Launch]:
    """The launches of a chunked linear-attention op's forward and backward, in launch order,
    bfloat16 ``[B, T, H, D]`` (K = V = D), by ``cfg`` or the heuristic's: ``kda``
    (``kernel_delta_attention`` with a per-channel gate and ``use_qk_l2norm``), ``gdn`` (its
    per-head gate) or ``gla``."""
    from ejkernel_triton.ops import gla, kernel_delta_attention

    b, t, h, _ = shape
    x = jnp.ones(shape, jnp.bfloat16)
    if op == "gla":
        module, fwd, bwd = gla, gla._gla_fwd, gla._gla_bwd
        call: dict[str, Any] = {"query": x, "key": x, "value": x}
        call["g"] = jnp.full(shape, -0.1, jnp.float32)
        extra: dict[str, Any] = {}
    elif op in ("kda", "gdn"):
        module = kernel_delta_attention
        fwd, bwd = module._kda_fwd, module._kda_bwd
        gate = jnp.full(shape if op == "kda" else (b, t, h), -0.1, jnp.bfloat16)
        call = {"query": x, "key": x, "value": x, "beta": jnp.full((b, t, h), 0.5, jnp.bfloat16)}
        call.update(g=gate, use_qk_l2norm=True)
        extra = {"use_qk_l2norm": True}
    else:
        raise ValueError(f"op: 'kda', 'gdn' or 'gla', not {op!r}")
    cfg = cfg or module.heuristic(types.SimpleNamespace(kwargs=call))
    jax.clear_caches()  # the forward is jitted: trace it under the recorder
    with recorded_launches() as record:
        out, res = fwd(cfg=cfg, **call)
        bwd(res, out, cfg=cfg, **extra)
    return record


def flash_attention_launches(
    shape: tuple[int, int, int, int] = (1, 256, 2, 128),
    dtype: Any = jnp.bfloat16,
    *,
    causal: bool = True,
    cfg: Any = None,
    **kwargs: Any,
) -> list[Launch]:
    """The launches of a flash-attention forward and backward, in launch order (the usual
    kernels: forward, dQ, dK/dV; the warp-specialized ones: forward, dK/dV, dQ; the Gluon
    backward: one kernel, or the dQ kernel then the Gluon dK/dV), by ``cfg`` or else the
    heuristic's config; ``kwargs`` (``bias``, ``attention_mask``, ...) go to the op."""
    from ejkernel_triton.ops import flash_attention as fa

    q, k, v = (jnp.ones(shape, dtype) for _ in range(3))
    call = {"query": q, "key": k, "value": v, "causal": causal, **kwargs}
    cfg = cfg or fa.heuristic(types.SimpleNamespace(kwargs=call))
    statics = ("softmax_scale", "sliding_window", "logits_soft_cap")
    with recorded_launches() as record:
        out, res = fa._flash_attention_fwd(**call, cfg=cfg)
        fa._flash_attention_bwd(
            res, out, cfg=cfg, causal=causal, **{n: kwargs[n] for n in statics if n in kwargs}
        )
    return record


def _print_mix(launch: Launch, label: str) -> None:
    compiled = compile_launch(launch)
    print(f"{label}: shared {compiled.shared} B")
    mix = {**instruction_mix(compiled.ptx), **shared_memory_mix(compiled.ptx)}
    for name, count in sorted(mix.items()):
        print(f"  {name:60s} {count}")


if __name__ == "__main__" and sys.argv[1:2] == ["--linear"]:
    for launch in linear_launches(sys.argv[2] if len(sys.argv) > 2 else "kda"):
        name = launch.kernel.fn.__name__
        _print_mix(launch, f"{name} grid {launch.grid}, {launch.num_warps} warps, "
                   f"{launch.num_stages} stages")  # fmt: skip
elif __name__ == "__main__" and sys.argv[1:] == ["--decode"]:
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        _print_mix(decode_launches(dtype), f"page_attention decode, {jnp.dtype(dtype).name} cache")
    _print_mix(decode_launches(jnp.float8_e4m3fn, fp8_v_words=True), "the same, fp8_v_words")
elif __name__ == "__main__":
    for d in (64, 80, 128):
        print(f"--- D {d}")
        for launch in flash_attention_launches((1, 256, 2, d)):
            compiled = compile_launch(launch)
            print(f"{launch.kernel.fn.__name__}: shared {compiled.shared} B")
            for name, count in sorted(instruction_mix(compiled.ptx).items()):
                print(f"  {name:60s} {count}")
