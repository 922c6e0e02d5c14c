"""Reading the Mosaic TPU module a Pallas kernel lowers to, on any machine.

``jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))`` runs Pallas's TPU lowering rules
and embeds the Mosaic module, serialised, in a ``tpu_custom_call``. Mosaic's own passes (memref
and vector layouts, their application) run only inside the TPU compiler; what can be checked
here is which Mosaic operations the kernel is made of.
"""

from __future__ import annotations

import base64
import re
from typing import Any

import pytest


def mosaic_ops(lowered_text: str, index: int = 0) -> set[str]:
    """The ``tpu.``, ``scf.``, ``vector.`` and ``memref.`` operations of the ``index``-th
    Mosaic kernel in a lowered module's text; skips the test where this jax's internals moved."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir import ir, passmanager
        from jax._src.tpu_custom_call import tpu
    except ImportError as err:  # pragma: no cover - another jax
        pytest.skip(f"cannot decode Mosaic modules with this jax: {err}")
    bodies = re.findall(r"body\\22: \\22([A-Za-z0-9+/=]+)", lowered_text)
    assert len(bodies) > index, f"no Mosaic kernel number {index} in the lowered module"
    ctx: Any = mlir.make_ir_context()
    tpu.register_dialect(ctx)
    with ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(base64.b64decode(bodies[index]))
        passmanager.PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(
            module.operation
        )
        text = str(module)
    return set(re.findall(r"\b((?:tpu|scf|vector|memref)\.[a-z0-9_]+)\b", text))


def assert_paged_attention_kernel(lowered_text: str, name: str) -> None:
    """A lowered module holds the Mosaic kernel ``name`` of a paged attention: pages come by
    DMA (started, then waited), the logits and P·V on the MXU, the kv blocks in a loop of
    run-time length."""
    assert "tpu_custom_call" in lowered_text and name in lowered_text
    ops = mosaic_ops(lowered_text)
    assert {"tpu.enqueue_dma", "tpu.matmul", "scf.for"} <= ops, sorted(ops)
    assert any(op.startswith("tpu.wait_dma") for op in ops), sorted(ops)
