"""``ejkernel.ops.shared_memory_limit`` and ``prune_by_shared_memory``: what a GPU block may
use, and the rule config spaces follow with it."""

from __future__ import annotations

import logging
import types

import pytest

from ejkernel.ops import prune_by_shared_memory, shared_memory_limit


def _gpu(**attributes):
    return types.SimpleNamespace(platform="gpu", **attributes)


def test_the_device_report_wins_over_the_tables():
    device = _gpu(shared_memory_per_block_optin=12345, compute_capability="9.0")
    assert shared_memory_limit(device) == 12345


@pytest.mark.parametrize(
    ("capability", "limit"),
    [
        ("9.0", 232448),
        ("10.0", 232448),
        ("8.0", 166912),
        ("8.6", 101376),
        ("8.9", 101376),
        ("7.0", 98304),
        ("7.5", 65536),
    ],
)
def test_without_a_report_the_compute_capability_says(capability, limit):
    assert shared_memory_limit(_gpu(compute_capability=capability, device_kind="?")) == limit


@pytest.mark.parametrize(
    ("kind", "limit"),
    [
        ("NVIDIA H100 80GB HBM3", 232448),
        ("NVIDIA H200", 232448),
        ("NVIDIA GH200 480GB", 232448),
        ("NVIDIA H800", 232448),
        ("NVIDIA A100-SXM4-80GB", 166912),
        ("NVIDIA A800 80GB PCIe", 166912),
        ("NVIDIA A10", 101376),
        ("NVIDIA L4", 101376),
        ("NVIDIA L40S", 101376),
        ("NVIDIA GeForce RTX 4090", 101376),
        ("Tesla V100-SXM2-16GB", 98304),
        ("Tesla T4", 65536),
        ("Some Future GPU", None),
    ],
)
def test_without_a_capability_the_device_kind_says(kind, limit):
    assert shared_memory_limit(_gpu(device_kind=kind)) == limit


def test_a_cpu_or_tpu_has_no_limit():
    assert shared_memory_limit() is None  # these tests run on a CPU
    assert shared_memory_limit(types.SimpleNamespace(platform="tpu", device_kind="TPU v5")) is None


def test_the_environment_overrides_the_device(monkeypatch):
    h100 = _gpu(shared_memory_per_block_optin=232448)
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", "101376")
    assert shared_memory_limit(h100) == 101376 and shared_memory_limit() == 101376
    for off in ("none", "0", "None"):
        monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", off)
        assert shared_memory_limit(h100) is None
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", "227KiB")
    with pytest.raises(ValueError, match="EJKERNEL_SHARED_MEMORY_LIMIT"):
        shared_memory_limit(h100)


def test_candidates_over_the_limit_are_dropped_with_a_debug_line(caplog):
    with caplog.at_level(logging.DEBUG, logger="ejkernel.tuning"):
        kept = prune_by_shared_memory([10, 300, 20, 400], lambda n: n, limit=100, what="toy")
    assert kept == [10, 20]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "toy: dropped 300: needs 300 bytes of shared memory, over the device's 100",
        "toy: dropped 400: needs 400 bytes of shared memory, over the device's 100",
    ]


def test_what_keep_names_survives_and_an_empty_result_keeps_the_smallest():
    assert prune_by_shared_memory([500, 300, 20], lambda n: n, keep=(500,), limit=100) == [500, 20]
    assert prune_by_shared_memory([500, 300, 400], lambda n: n, limit=100) == [300]


def test_no_limit_known_drops_nothing(monkeypatch):
    assert prune_by_shared_memory([500, 300], lambda n: n) == [500, 300]  # a CPU: no limit
    monkeypatch.setenv("EJKERNEL_SHARED_MEMORY_LIMIT", "100")
    assert prune_by_shared_memory([500, 30], lambda n: n) == [30]


@pytest.mark.gpu
def test_on_the_gpu_the_limit_is_what_the_device_reports():
    import jax

    device = jax.devices()[0]
    reported = device.shared_memory_per_block_optin
    assert shared_memory_limit() == reported
    # the table (for a jax that does not report it) agrees on this GPU
    by_capability = _gpu(compute_capability=device.compute_capability, device_kind="?")
    assert shared_memory_limit(by_capability) == reported
    kind_only = types.SimpleNamespace(platform="gpu", device_kind=device.device_kind)
    assert shared_memory_limit(kind_only) in (reported, None)
