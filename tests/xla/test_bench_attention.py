"""The attention benchmark harness records which config each ejkernel row ran with.

Runs ``benchmarks/bench_attention.py``'s row code on the CPU through the XLA platform with a tiny
shape; the harness is a script, so it is loaded from its file.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import pytest

HARNESS = Path(__file__).parents[2] / "benchmarks" / "bench_attention.py"
SHAPE = (1, 64, 2, 32)  # B, S, H, D


@pytest.fixture(scope="module")
def harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_attention", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ejkernel_row_records_the_chosen_config_of_fwd_and_fwd_bwd(
    harness: ModuleType, causal: bool
) -> None:
    row = harness.bench_row("ejkernel xla", harness.ours("xla"), SHAPE, causal)

    assert "error" not in row, row["error"]
    assert set(row["chosen"]) == {"fwd", "fwd_bwd"}
    for pick in row["chosen"].values():
        assert "error" not in pick, pick["error"]
        assert isinstance(pick["config"], dict) and pick["config"]
        # The measured call cached its heuristic config under the key explain looks up.
        assert (pick["source"], pick["origin"]) == ("memory", "heuristic")
    json.dumps(row)  # goes into the report as it is
    line = harness.chosen_line(row)
    assert line.startswith(f"chosen ejkernel xla {SHAPE}{' causal' if causal else ''}: fwd memory")
    assert "; fwd+bwd memory(heuristic) " in line and "null" not in line


def test_autotuned_choice_is_recorded_as_the_tuned_entry(
    harness: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EJKERNEL_AUTOTUNE_POLICY", "autotune")
    shape = (1, 256, 1, 16)  # the smallest with several XLA candidates to tune

    row = harness.bench_row("ejkernel xla", harness.ours("xla"), shape, False)

    for pick in row["chosen"].values():
        assert (pick["source"], pick["origin"]) == ("memory", "autotune")
    assert harness.chosen_line(row).count("memory(autotune) {") == 2


def test_anchor_row_records_no_choice(harness: ModuleType) -> None:
    def xla(q: Any, k: Any, v: Any, causal: bool) -> Any:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    assert "chosen" not in harness.bench_row("XLA", xla, SHAPE, True)


def test_choice_that_cannot_be_explained_is_recorded_as_its_error(harness: ModuleType) -> None:
    chosen = harness.chosen("no-such-platform", SHAPE, False)

    assert set(chosen) == {"fwd", "fwd_bwd"}
    assert all(pick["error"] for pick in chosen.values())
    assert "fwd fails: " in harness.chosen_line(
        {"impl": "x", "shape": SHAPE, "causal": False, "chosen": chosen}
    )


def test_config_space_lists_the_heuristic_first_then_the_other_candidates(
    harness: ModuleType,
) -> None:
    space = harness.config_space("xla", (1, 256, 1, 16), False)

    labels = list(space)
    assert labels[0].startswith("heuristic {") and len(labels) > 1
    assert len(set(space.values())) == len(space)


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_timed_rounds_time_every_function_in_every_round(
    harness: ModuleType, monkeypatch: pytest.MonkeyPatch, grad: bool
) -> None:
    monkeypatch.setattr(harness, "WARM_S", 0.0)

    def xla(q: Any, k: Any, v: Any, causal: bool) -> Any:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    res = harness.timed_rounds({"ours": harness.ours("xla"), "XLA": xla}, SHAPE, True, 2, grad)

    assert set(res) == {"ours", "XLA"}
    assert all(len(xs) == 2 and min(xs) > 0 for xs in res.values())


def test_configs_mode_times_each_config_and_the_default_call_forward_and_backward(
    harness: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(harness, "WARM_S", 0.0)

    harness.rounds_mode("xla", "XLA", SHAPE, 1, (True,), True, every_config=True)

    out = capsys.readouterr().out
    assert f"{SHAPE} causal=True forward+backward, 1 rounds" in out
    assert "  heuristic {" in out and "  default call " in out
    assert "chosen default call" in out
