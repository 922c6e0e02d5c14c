"""Building shipped tables for the toy plugin's flash attention (tests of tables and policy)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from ejkernel._invocation import Invocation
from ejkernel._json import converter
from ejkernel.plugins import get_registry
from ejkernel.testing import AttentionShape, attention_inputs


def inputs(sq: int = 37, d: int = 16) -> tuple[Any, Any, Any]:
    return attention_inputs(AttentionShape(b=1, sq=sq, sk=sq, hq=2, hkv=1, d=d))


def key_document(
    args: tuple[Any, ...], platform: str = "toy", grad: bool = False, **kwargs: Any
) -> dict[str, Any]:
    """The key document of ``flash_attention(*args, **kwargs)`` on ``platform``."""
    registry = get_registry()
    spec = registry.spec("flash_attention")
    arguments = spec.validate(spec.bind(args, kwargs))
    version = "0"
    if platform != "<choice>":
        impls = registry.implementations("flash_attention")
        version = next(i.version for i in impls if i.platform == platform)
    inv = Invocation(kernel="flash_attention", kwargs=arguments, metadata={"grad": grad})
    return inv.key_document(platform=platform, version=version)


def entry(doc: dict[str, Any], config: Any, **extra: Any) -> dict[str, Any]:
    plain = config if isinstance(config, (str, dict)) else converter.unstructure(config)
    return {
        "config": plain,
        "config_type": "toy:ToyConfig",
        "source": "autotune",
        "key": doc,
        **extra,
    }


def choice(doc: dict[str, Any], timings: dict[str, float]) -> dict[str, Any]:
    fastest = min(timings, key=timings.__getitem__)
    return {
        "config": fastest,
        "config_type": "builtins:str",
        "source": "platform-choice",
        "key": doc,
        "timings_ms": timings,
    }


def write_table(path: pathlib.Path, *entries: dict[str, Any], **top: Any) -> pathlib.Path:
    doc = {"schema": 1, "entries": {f"k{i}": e for i, e in enumerate(entries)}, **top}
    path.write_text(json.dumps(doc))
    return path


def ship(path: pathlib.Path, *entries: dict[str, Any]) -> pathlib.Path:
    """Write a table and declare it in the registry."""
    write_table(path, *entries)
    get_registry().add_shipped_table(path)
    return path
