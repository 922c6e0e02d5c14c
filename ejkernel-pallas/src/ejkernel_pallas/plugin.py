"""Entry point of the Pallas plugin: registers its kernels lazily (imports nothing heavy).

Two families, each declaring the hardware it runs on:

- ``ejkernel_pallas.tpu.<op>``: Mosaic TPU kernels, registered for backends ``tpu`` and ``cpu``.
  On the CPU they run only with ``EJKERNEL_INTERPRET=1``, through Pallas's TPU interpret mode
  (the same kernels, with TPU memory spaces simulated), for tests and debugging.
- ``ejkernel_pallas.gpu.<op>``: Mosaic GPU kernels for Hopper (sm_90), backend ``gpu``.

Each module is registered with ``registry.register_module`` (core finds ``<op>_pallas``, its
config class, ``heuristic``, ``config_space`` and ``supports`` there by name on first use);
flash attention's also serves ``scaled_dot_product_attention`` (core's ``served_by``). The
availability probe runs on first selection, never at import.
"""

from __future__ import annotations

from typing import Any

from ejkernel import env
from ejkernel.hookspecs import API_VERSION
from ejkernel.plugins import hookimpl

#: op -> the families (``tpu``, ``gpu``) with a module ``ejkernel_pallas.<family>.<op>``.
OPS: dict[str, tuple[str, ...]] = {
    "flash_attention": ("tpu", "gpu"),
    "grouped_matmul": ("tpu", "gpu"),
    "page_attention": ("tpu",),
    "ragged_page_attention": ("tpu",),
    "ragged_page_attention_v3": ("tpu",),
    "prefill_page_attention": ("tpu",),
}
#: family -> (backends it is registered for, priority). On a TPU the
#: Mosaic kernels beat the XLA fallback (0). On a GPU the Mosaic GPU kernels rank above the
#: Triton plugin (20): on the H100 they are level with it or ahead at the shapes of
#: benchmarks/RESULTS.md; cuDNN through the cuda plugin (200) still comes first where it
#: accepts the call. On a CPU (interpret mode) they rank below Triton's interpreter path.
FAMILIES: dict[str, tuple[tuple[str, ...], int]] = {
    "tpu": (("tpu", "cpu"), 10),
    "gpu": (("gpu",), 30),
}


def available(backend: str) -> bool | str:
    """``True`` on TPU and GPU, and on CPU with ``EJKERNEL_INTERPRET=1``; else the reason."""
    if backend in ("tpu", "gpu"):
        return True
    if env.interpret():
        return True
    return (
        f"Pallas kernels need a TPU or a GPU (this device is {backend}); set "
        f"{env.INTERPRET}=1 to run them on the CPU in interpret mode"
    )


@hookimpl
def ejkernel_api_version() -> int:
    return API_VERSION


@hookimpl
def ejkernel_register(registry: Any) -> None:
    registry.add_platform("pallas", available=available, distribution="ejkernel-pallas")
    registry.add_shipped_table("ejkernel_pallas:shipped")
    for op, families in OPS.items():
        for family in families:
            backends, priority = FAMILIES[family]
            registry.register_module(
                op,
                f"ejkernel_pallas.{family}.{op}",
                platform="pallas",
                backend=backends,
                priority=priority,
            )
