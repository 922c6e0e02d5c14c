"""What the XLA ops' configs share: the backend a default is looked up for, chunk and tile
lengths fitted to a call, the ``chunk_size`` validator, and a config space without repeats."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, TypeVar

import jax

__all__ = ["backend", "check_chunk_size", "distinct", "fit_chunk", "pow2_ceil"]

_Config = TypeVar("_Config")


def backend(table: Collection[str]) -> str:
    """This process's JAX backend as a key of ``table`` (``"gpu"`` for CUDA/ROCm; ``"cpu"``
    when ``table`` does not know it)."""
    name = jax.default_backend().lower()
    name = "gpu" if name in ("cuda", "rocm") else name
    return name if name in table else "cpu"


def pow2_ceil(n: int) -> int:
    """The smallest power of two ``>= n`` (for ``n >= 1``)."""
    return 1 << max(0, (n - 1).bit_length())


def fit_chunk(chunk: int, length: int) -> int:
    """``chunk``, or the smallest power of two covering a shorter sequence."""
    if length >= chunk:
        return chunk
    return pow2_ceil(length)


def check_chunk_size(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator of a config's ``chunk_size``: an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"{type(instance).__name__}: `{attribute.name}` must be an int >= 1; got {value!r}"
        )


def distinct(configs: Iterable[_Config]) -> list[_Config]:
    """``configs`` in order, each once (a config space: the heuristic's first)."""
    return list(dict.fromkeys(configs))
