"""``Executor(...)(op, *arrays, method="shard_map", ...)`` for every op of the registry, on 2
host devices in a subprocess (``_shard_map_every_op.py``): replicated, and split by batch
where the op's arrays share a leading batch axis."""

from __future__ import annotations

import pathlib

from tests.xla._host_devices import run_on_host_devices

from ejkernel.plugins import get_registry

HELPER = pathlib.Path(__file__).with_name("_shard_map_every_op.py")


def test_every_op_runs_under_the_executors_shard_map_method() -> None:
    stdout = run_on_host_devices(HELPER, 2)
    ops = get_registry().ops()
    assert stdout.count("ok ") == len(ops) and len(ops) >= 21, stdout
    split = stdout.split("split by batch:")[1].split()
    assert {"flash_attention", "ragged_decode_attention", "mean_pooling"} <= set(split), stdout
