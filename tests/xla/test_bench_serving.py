"""The serving benchmark's cases: ``--parts`` splits each mixed batch into its two halves.

``benchmarks/bench_serving.py`` is a script, so it is loaded from its file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_serving.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(SCRIPT.parent))  # its `_common`
    try:
        spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_parts_follow_each_mixed_batch_and_split_it_into_decodes_and_chunks(
    bench: ModuleType,
) -> None:
    plain = bench.serving_cases(quick=True)
    parted = bench.serving_cases(quick=True, parts=True)

    assert [c for c in parted if c in plain] == plain
    for name, kv_lens, q_lens in plain:
        if len(set(q_lens)) == 1:
            continue
        i = parted.index((name, kv_lens, q_lens))
        (_, kv_d, q_d), (_, kv_c, q_c) = parted[i + 1], parted[i + 2]
        assert set(q_d) == {1} and 1 not in q_c
        assert sorted(zip(kv_d + kv_c, q_d + q_c)) == sorted(zip(kv_lens, q_lens))
    assert len(parted) == len(plain) + 4  # two mixed batches, two halves each
