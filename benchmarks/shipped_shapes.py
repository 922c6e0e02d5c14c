"""The invocations the plugins' shipped tables are tuned for, as records files for ``ejkernel tune``.

Flash attention: the two main shapes of BENCHMARKS.md (causal and not, forward and
differentiated), the D 128 training sweep's neighbours (S 1024 and 8192 at B·S = 16384) and a
GQA Llama shape; decode: the serving benchmark's decode (B 32, 8192 cached tokens, 32/8 heads,
D 128, bf16), dense and paged (page 16), and a small-batch short-context one. Then, on the GPU:

    python benchmarks/shipped_shapes.py --out /tmp/shapes
    ejkernel tune --shapes /tmp/shapes/flash_attention.json --platforms all --out fa.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

BF16 = jnp.bfloat16


def _sds(shape: tuple[int, ...], dtype: Any = BF16) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def flash_attention_calls() -> list[tuple[dict[str, Any], bool]]:
    """(arguments, differentiated) of the flash-attention invocations."""
    calls = []
    main = [(4, 4096, 16, 16, 128), (8, 2048, 16, 16, 64)]
    sweep = [(16, 1024, 16, 16, 128), (2, 8192, 16, 16, 128)]
    llama = [(2, 4096, 32, 8, 128)]
    for b, s, hq, hkv, d in main + sweep + llama:
        for causal in (False, True):
            for grad in (False, True):
                if (b, s, hq, hkv, d) in sweep and grad:
                    continue
                if (b, s, hq, hkv, d) in llama and not causal:
                    continue
                args = {
                    "query": _sds((b, s, hq, d)),
                    "key": _sds((b, s, hkv, d)),
                    "value": _sds((b, s, hkv, d)),
                    "causal": causal,
                }
                calls.append((args, grad))
    return calls


def decode_calls() -> dict[str, list[dict[str, Any]]]:
    """Arguments of the decode invocations, by op."""
    dense, paged = [], []
    for b, ctx in [(32, 8192), (8, 2048)]:
        hq, hkv, d, page = 32, 8, 128, 16
        dense.append(
            {
                "query": _sds((b, hq, d)),
                "key": _sds((b, ctx, hkv, d)),
                "value": _sds((b, ctx, hkv, d)),
                "sequence_start": _sds((b,), jnp.int32),
                "sequence_end": _sds((b,), jnp.int32),
            }
        )
        pages = b * ctx // page
        paged.append(
            {
                "query": _sds((b, hq, d)),
                "key_cache": _sds((pages, page, hkv, d)),
                "value_cache": _sds((pages, page, hkv, d)),
                "kv_lens": _sds((b,), jnp.int32),
                "block_tables": _sds((b, ctx // page), jnp.int32),
            }
        )
    return {"ragged_decode_attention": dense, "page_attention": paged}


def records() -> dict[str, list[Any]]:
    """Records files by name: ``flash_attention`` and ``decode``."""
    from ejkernel.ops import RecordedInvocation
    from ejkernel.plugins import get_registry

    def record(op: str, args: dict[str, Any], grad: bool) -> RecordedInvocation:
        spec = get_registry().spec(op)
        arguments = spec.validate(spec.bind((), args))
        arrays = [a.name for a in spec.args if a.array]
        return RecordedInvocation.from_arguments(op, arguments, arrays, grad=grad)

    out: dict[str, list[Any]] = {
        "flash_attention": [record("flash_attention", a, g) for a, g in flash_attention_calls()],
        "decode": [],
    }
    for op, calls in decode_calls().items():
        out["decode"] += [record(op, a, False) for a in calls]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for <name>.json")
    args = parser.parse_args()
    from ejkernel.ops import save_invocations

    folder = Path(args.out)
    for name, recs in records().items():
        save_invocations(folder / f"{name}.json", recs)
        print(f"{folder / name}.json: {len(recs)} invocations")


if __name__ == "__main__":
    main()
