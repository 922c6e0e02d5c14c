"""Pallas API names that moved between the jax versions we support (0.10 here, 0.11 on GPUs).

Every kernel module reaches the moving parts of Pallas through this module only, so a rename
upstream is one edit here. Each helper tries the current name first, then the older ones.
Nothing here is imported by ``ejkernel_pallas.plugin``: importing this module imports Pallas.
"""

from __future__ import annotations

from typing import Any

from jax.experimental import pallas as pl

__all__ = [
    "gpu_compiler_params",
    "gpu_interpret_params",
    "gpu_load",
    "gpu_named_barrier",
    "gpu_pipeline_states",
    "pl",
    "plgpu",
    "pltpu",
    "tpu_compiler_params",
    "tpu_interpret_params",
    "transpose_ref",
    "vmem",
]


def _first(module: Any, *names: str) -> Any:
    for name in names:
        value = getattr(module, name, None)
        if value is not None:
            return value
    raise AttributeError(f"{module.__name__} has none of {names} (jax API moved again?)")


def pltpu() -> Any:
    """``jax.experimental.pallas.tpu`` (imported on first use)."""
    from jax.experimental.pallas import tpu

    return tpu


def plgpu() -> Any:
    """``jax.experimental.pallas.mosaic_gpu`` (imported on first use: it needs absl and MLIR)."""
    from jax.experimental.pallas import mosaic_gpu

    return mosaic_gpu


def tpu_compiler_params(**kwargs: Any) -> Any:
    """``pltpu.CompilerParams`` (``TPUCompilerParams`` before jax 0.7)."""
    return _first(pltpu(), "CompilerParams", "TPUCompilerParams")(**kwargs)


def tpu_interpret_params() -> Any:
    """What ``pallas_call(interpret=...)`` takes for TPU interpret mode.

    ``pltpu.InterpretParams()`` (``TPUInterpretParams`` in older jax) simulates the TPU memory
    spaces (HBM, VMEM, SMEM) and DMAs on the CPU; plain ``True`` (the generic HLO interpreter)
    is the last resort.
    """
    tpu = pltpu()
    for name in ("InterpretParams", "TPUInterpretParams"):
        cls = getattr(tpu, name, None)
        if cls is not None:
            return cls()
    return True


def vmem(shape: tuple[int, ...], dtype: Any) -> Any:
    """A VMEM scratch buffer: ``pltpu.VMEM`` (``pltpu.MemorySpace.VMEM`` / ``TPUMemorySpace``)."""
    tpu = pltpu()
    space = getattr(tpu, "VMEM", None)
    if space is None:
        space = _first(tpu, "MemorySpace", "TPUMemorySpace").VMEM
    return space(shape, dtype)


def gpu_compiler_params(**kwargs: Any) -> Any:
    """``plgpu.CompilerParams`` (``GPUCompilerParams`` before jax 0.7)."""
    return _first(plgpu(), "CompilerParams", "GPUCompilerParams")(**kwargs)


def gpu_interpret_params() -> Any:
    """Parameters of Mosaic GPU interpret mode (jax >= 0.10), or ``None`` where it is missing."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:
        return None
    return InterpretGPUParams()


def gpu_layout(name: str) -> Any:
    """A register layout of Mosaic GPU (``plgpu.Layout.WGMMA``...)."""
    return getattr(_first(plgpu(), "Layout"), name)


def gpu_accumulator(shape: tuple[int, int], dtype: Any) -> Any:
    """A WGMMA accumulator for ``pl.run_scoped``: ``plgpu.ACC`` (``WGMMAAccumulatorRef``)."""
    return _first(plgpu(), "ACC", "WGMMAAccumulatorRef")(shape, dtype)


def gpu_accumulator_init(value: Any) -> Any:
    """A WGMMA accumulator initialised from registers, for ``pl.run_state``."""
    return _first(plgpu(), "ACC", "WGMMAAccumulatorRef").init(value)


def gpu_named_barrier(operation: str, barrier_id: int, num_threads: int) -> None:
    """``bar.<operation> barrier_id, num_threads;`` (``arrive`` or ``sync``): a hardware named
    barrier, through Mosaic GPU's inline escape (Pallas exposes only mbarriers)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    @plgpu().inline_mgpu()
    def body(_ctx: Any) -> None:
        llvm.inline_asm(
            ir.Type.parse("!llvm.void"),
            [],
            f"bar.{operation} {barrier_id}, {num_threads};",
            "",
            has_side_effects=True,
        )

    body()


def gpu_kernel(
    body: Any, *, out: Any, scratch: Any, name: str, interpret: bool = False, **kwargs: Any
) -> Any:
    """``plgpu.kernel`` with this jax's keywords: ``out_type``/``scratch_types`` (``out_shape``/
    ``scratch_shapes`` before 0.8) and ``kernel_name`` (dropped where unknown); with
    ``interpret``, in Mosaic GPU interpret mode (:func:`gpu_interpret_params`)."""
    kernel = _first(plgpu(), "kernel")
    if interpret:
        kwargs["interpret"] = gpu_interpret_params()
    attempts = [
        {"out_type": out, "scratch_types": scratch, "kernel_name": name},
        {"out_type": out, "scratch_types": scratch},
        {"out_shape": out, "scratch_shapes": scratch},
    ]
    error: Exception | None = None
    for extra in attempts:
        try:
            return kernel(body, **extra, **kwargs)
        except TypeError as err:  # an unknown keyword of this version: try the older names
            error = err
    assert error is not None
    raise error


def gpu_load(ref: Any, *, layout: Any) -> Any:
    """``plgpu.load`` of a whole ref into registers with ``layout``: jax 0.11 deprecates the
    separate index argument (index the ref itself); jax 0.10 requires it (``()``: all of it)."""
    import inspect

    load = plgpu().load
    idx = inspect.signature(load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return load(ref, (), layout=layout)
    return load(ref, layout=layout)


def gpu_pipeline_states() -> Any:
    """``plgpu.PipelinePipeline`` (the ``pipeline_state`` of
    ``emit_pipeline_warp_specialized`` that chains consecutive pipelines without a bubble), or
    ``None`` in a jax without it."""
    import inspect

    states = getattr(plgpu(), "PipelinePipeline", None)
    params = inspect.signature(plgpu().emit_pipeline_warp_specialized).parameters
    return states if "pipeline_state" in params else None


def transpose_ref(ref: Any, permutation: tuple[int, ...]) -> Any:
    """A transposed view of a shared-memory ref: ``ref.transpose(...)`` (jax 0.11 deprecates
    ``plgpu.transpose_ref``, which only calls it), else ``plgpu.transpose_ref`` in older jax."""
    method = getattr(ref, "transpose", None)
    if method is not None:
        return method(permutation)
    return plgpu().transpose_ref(ref, permutation)


def is_ref(x: Any) -> bool:
    """Whether ``x`` (inside a kernel) is a memory reference rather than a value."""
    from jax._src.state import types as state_types

    return isinstance(getattr(x, "aval", None), state_types.AbstractRef)
