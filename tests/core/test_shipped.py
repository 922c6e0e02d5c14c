"""Shipped tables: the config chain's `shipped` tier and selection's fastest platform by table."""

from __future__ import annotations

import json
import sys

import jax.numpy as jnp
import pytest

import ejkernel
from ejkernel.cli import main
from ejkernel.errors import CacheWarning
from ejkernel.ops import (
    AutotunePolicy,
    ConfigSelectorChain,
    Executor,
    PersistentCache,
    load_shipped_table,
    policy_override,
    shipped_tables,
    write_shipped_table,
)
from ejkernel.plugins import get_registry


def test_a_shipped_config_runs_on_the_first_call_without_tuning(toy, tables, tmp_path):
    q, k, v = tables.inputs()
    table = tables.ship(
        tmp_path / "t.json", tables.entry(tables.key_document((q, k, v)), toy.ToyConfig(block=16))
    )
    with policy_override(autotune=True):
        sel = ejkernel.explain("flash_attention", q, k, v)
        assert (sel.source, sel.config, sel.origin) == (
            "shipped",
            toy.ToyConfig(block=16),
            str(table),
        )
        ejkernel.flash_attention(q, k, v)
        assert [("run", toy.ToyConfig(block=16))] == toy.CALLS  # no candidate was timed
        sel = ejkernel.explain("flash_attention", q, k, v)
    assert (sel.source, sel.origin) == ("memory", "shipped")
    assert not PersistentCache().entries()  # shipped configs stay out of the user's cache


def test_the_persistent_cache_beats_the_shipped_table(toy, tables, tmp_path):
    q, k, v = tables.inputs()
    tables.ship(
        tmp_path / "t.json", tables.entry(tables.key_document((q, k, v)), toy.ToyConfig(block=16))
    )
    key = ejkernel.explain("flash_attention", q, k, v).key
    PersistentCache().put(key, toy.ToyConfig(block=64), source="autotune")
    sel = ejkernel.explain("flash_attention", q, k, v)
    assert (sel.source, sel.config) == ("persistent", toy.ToyConfig(block=64))


def test_a_bucket_match_takes_the_nearest_entry_within_a_factor_of_two(toy, tables, tmp_path):
    near, far = tables.inputs(sq=32), tables.inputs(sq=64)
    tables.ship(
        tmp_path / "t.json",
        tables.entry(tables.key_document(near), toy.ToyConfig(block=16)),
        tables.entry(tables.key_document(far), toy.ToyConfig(block=64)),
    )
    sel = ejkernel.explain("flash_attention", *tables.inputs(sq=40))
    assert (sel.source, sel.config) == ("shipped", toy.ToyConfig(block=16))
    assert ejkernel.explain("flash_attention", *tables.inputs(sq=60)).config.block == 64
    miss = ejkernel.explain("flash_attention", *tables.inputs(sq=140))  # > 2 x 64
    assert miss.source == "heuristic"
    other_head_dim = ejkernel.explain("flash_attention", *tables.inputs(sq=32, d=24))
    assert other_head_dim.source == "heuristic"  # its softmax scale, a static, differs


def test_a_bucket_match_needs_the_statics_and_dtypes_of_the_entry(toy, tables, tmp_path):
    q, k, v = tables.inputs(sq=32)
    tables.ship(
        tmp_path / "t.json", tables.entry(tables.key_document((q, k, v)), toy.ToyConfig(block=16))
    )
    q2, k2, v2 = tables.inputs(sq=40)
    assert ejkernel.explain("flash_attention", q2, k2, v2).source == "shipped"
    assert ejkernel.explain("flash_attention", q2, k2, v2, causal=True).source == "heuristic"
    half = [x.astype(jnp.bfloat16) for x in (q2, k2, v2)]
    assert ejkernel.explain("flash_attention", *half).source == "heuristic"


def test_a_bucket_match_is_used_only_where_the_implementation_could_pick_it(toy, tables, tmp_path):
    q, k, v = tables.inputs(sq=32)
    tables.ship(  # block 8 is neither the heuristic's nor a candidate
        tmp_path / "t.json", tables.entry(tables.key_document((q, k, v)), toy.ToyConfig(block=8))
    )
    assert ejkernel.explain("flash_attention", q, k, v).config == toy.ToyConfig(block=8)
    assert ejkernel.explain("flash_attention", *tables.inputs(sq=40)).source == "heuristic"


def test_another_device_kind_misses_and_volatile_device_fields_do_not_count(toy, tables, tmp_path):
    q, k, v = tables.inputs()
    other = tables.key_document((q, k, v))
    other["device"] = {**other["device"], "kind": "NVIDIA H100 80GB HBM3"}
    tables.ship(tmp_path / "a.json", tables.entry(other, toy.ToyConfig(block=16)))
    assert ejkernel.explain("flash_attention", q, k, v).source == "heuristic"
    newer = tables.key_document((q, k, v))
    newer["device"] = {**newer["device"], "platform_version": "some other runtime 9.9"}
    tables.ship(tmp_path / "b.json", tables.entry(newer, toy.ToyConfig(block=16)))
    assert ejkernel.explain("flash_attention", q, k, v).source == "shipped"


def test_entries_without_a_usable_key_document_are_skipped(toy, tables, tmp_path):
    q, k, v = tables.inputs()
    doc = tables.key_document((q, k, v))
    broken = {**doc, "invocation": {"kwargs": {"query": {"shape": ["x"], "dtype": "f"}}}}
    table = tables.ship(
        tmp_path / "t.json",
        tables.entry(broken, toy.ToyConfig(block=64)),
        {"config": {"block": 64}},
        tables.entry(doc, toy.ToyConfig(block=16)),
    )
    assert load_shipped_table(table).skipped == 2
    assert ejkernel.explain("flash_attention", q, k, v).config == toy.ToyConfig(block=16)


def test_an_entry_that_no_longer_structures_into_the_config_class_is_ignored(toy, tables, tmp_path):
    q, k, v = tables.inputs()
    tables.ship(tmp_path / "t.json", tables.entry(tables.key_document((q, k, v)), {"blocks": 16}))
    assert ejkernel.explain("flash_attention", q, k, v).source == "heuristic"


def _fast_platform(toy):
    toy.register_flash_attention(
        get_registry(), toy.flash_attention_toy, platform="fast", priority=10
    )


def test_selection_takes_the_fastest_runnable_platform_a_table_names(toy, tables, tmp_path):
    _fast_platform(toy)
    q, k, v = tables.inputs()
    assert ejkernel.explain("flash_attention", q, k, v).platform == "toy"  # by priority
    doc = tables.key_document((q, k, v), platform="<choice>")
    table = tables.ship(tmp_path / "t.json", tables.choice(doc, {"fast": 1.0, "toy": 2.0}))
    sel = ejkernel.explain("flash_attention", *tables.inputs(sq=45))  # same bucket
    assert (sel.platform, sel.reason) == ("fast", f"shipped table ({table})")
    with policy_override(use_shipped=False):
        assert ejkernel.explain("flash_attention", q, k, v).platform == "toy"
    assert ejkernel.explain("flash_attention", q, k, v, platform="toy").platform == "toy"


def test_a_fastest_platform_that_cannot_run_gives_way_to_the_next_by_time(toy, tables, tmp_path):
    _fast_platform(toy)
    q, k, v = tables.inputs()
    doc = tables.key_document((q, k, v), platform="<choice>")
    tables.ship(tmp_path / "t.json", tables.choice(doc, {"cuda": 0.5, "fast": 2.0, "toy": 1.0}))
    assert ejkernel.explain("flash_attention", q, k, v).platform == "toy"


def test_a_corrupt_or_foreign_table_warns_once_and_the_others_still_load(toy, tables, tmp_path):
    q, k, v = tables.inputs()
    (tmp_path / "a_corrupt.json").write_text("{not json")
    tables.write_table(tmp_path / "b_foreign.json", schema=2)
    tables.write_table(tmp_path / "c_alien.json", format="someone-else/3")
    tables.write_table(
        tmp_path / "d_good.json",
        tables.entry(tables.key_document((q, k, v)), toy.ToyConfig(block=16)),
    )
    get_registry().add_shipped_table(tmp_path)
    get_registry().add_shipped_table(tmp_path / "missing.json")
    with pytest.warns(CacheWarning) as caught:
        sel = ejkernel.explain("flash_attention", q, k, v)
    assert (sel.source, sel.origin) == ("shipped", f"{tmp_path}/d_good.json")
    text = "\n".join(str(w.message) for w in caught)
    for name in ("a_corrupt.json", "b_foreign.json", "c_alien.json", "missing.json"):
        assert name in text
    assert len(caught) == 4
    assert [t.name for t in shipped_tables()] == [f"{tmp_path}/d_good.json"]
    ejkernel.explain("flash_attention", q, k, v)  # read once: no new warning


def test_a_table_inside_a_package_is_named_by_package_and_path(toy, tables, tmp_path, monkeypatch):
    q, k, v = tables.inputs()
    folder = tmp_path / "shipped_pkg_for_test" / "shipped"
    folder.mkdir(parents=True)
    (folder.parent / "__init__.py").write_text("")
    tables.write_table(
        folder / "cpu.json", tables.entry(tables.key_document((q, k, v)), toy.ToyConfig(block=16))
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "shipped_pkg_for_test", raising=False)
    get_registry().add_shipped_table("shipped_pkg_for_test:shipped")
    sel = ejkernel.explain("flash_attention", q, k, v)
    assert (sel.source, sel.origin) == ("shipped", "shipped_pkg_for_test:shipped/cpu.json")
    sys.modules.pop("shipped_pkg_for_test", None)


def test_shipped_tables_can_be_turned_off(toy, tables, tmp_path, monkeypatch):
    q, k, v = tables.inputs()
    tables.ship(
        tmp_path / "t.json", tables.entry(tables.key_document((q, k, v)), toy.ToyConfig(block=16))
    )
    monkeypatch.setenv("EJKERNEL_SHIPPED", "0")
    assert ejkernel.explain("flash_attention", q, k, v).source == "heuristic"
    monkeypatch.delenv("EJKERNEL_SHIPPED")
    with policy_override(AutotunePolicy(allow_autotune=False, use_shipped=False)):
        assert ejkernel.explain("flash_attention", q, k, v).source == "heuristic"
    assert ejkernel.explain("flash_attention", q, k, v).source == "shipped"
    own = Executor(ConfigSelectorChain(shipped=False))
    spec = get_registry().spec("flash_attention")
    assert own.explain_op(spec, spec.bind((q, k, v), {})).source == "heuristic"


def test_a_chain_given_its_own_tables_uses_only_those(toy, tables, tmp_path):
    q, k, v = tables.inputs()
    declared = tables.ship(
        tmp_path / "declared.json",
        tables.entry(tables.key_document((q, k, v)), toy.ToyConfig(block=16)),
    )
    own = tables.write_table(
        tmp_path / "own.json", tables.entry(tables.key_document((q, k, v)), toy.ToyConfig(block=64))
    )
    spec = get_registry().spec("flash_attention")
    sel = Executor(ConfigSelectorChain(shipped=[own])).explain_op(spec, spec.bind((q, k, v), {}))
    assert (sel.config, sel.origin) == (toy.ToyConfig(block=64), str(own))
    assert ejkernel.explain("flash_attention", q, k, v).origin == str(declared)
    one = Executor(ConfigSelectorChain(shipped=own)).explain_op(spec, spec.bind((q, k, v), {}))
    assert one.origin == str(own)
    with pytest.raises(ValueError, match="cannot read"):
        ConfigSelectorChain(shipped=[tmp_path / "missing.json"])


def test_a_tuned_export_ships_as_a_table(toy, tables, tmp_path, monkeypatch, capsys):
    q, k, v = tables.inputs()
    with policy_override(autotune=True):
        ejkernel.flash_attention(q, k, v)
    tuned = ejkernel.explain("flash_attention", q, k, v).config
    export = tmp_path / "export.json"
    PersistentCache().export(export)
    assert main(["cache", "ship", str(export), "--out", str(tmp_path / "t.json")]) == 0
    assert "1 entries" in capsys.readouterr().out
    table = load_shipped_table(tmp_path / "t.json")
    raw = json.loads((tmp_path / "t.json").read_text())
    assert raw["format"] == "ejkernel-shipped/1" and raw["device_kinds"] == list(table.device_kinds)
    (entry,) = table.entries.values()
    assert set(entry["key"]["device"]) <= {"backend", "kind", "compute_capability"}
    assert write_shipped_table([export], tmp_path / "none.json", device="no such gpu").entries == {}
    # a fresh process with an empty cache: the table answers, nothing is tuned
    monkeypatch.setenv("EJKERNEL_CACHE_DIR", str(tmp_path / "fresh"))
    ejkernel._executor._default = None
    get_registry().add_shipped_table(tmp_path / "t.json")
    with policy_override(autotune=True):
        sel = ejkernel.explain("flash_attention", q, k, v)
    assert (sel.source, sel.config) == ("shipped", tuned)
    assert f"from shipped table {tmp_path / 't.json'}" in str(sel)
    capsys.readouterr()
    assert main(["info"]) == 0
    assert f"{tmp_path / 't.json'}: 1 entries" in capsys.readouterr().out


def test_load_shipped_table_rejects_what_it_cannot_read(tmp_path, tables):
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match=r"bad\.json"):
        load_shipped_table(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="schema"):
        load_shipped_table(tables.write_table(tmp_path / "s.json", schema=7))
    with pytest.raises(ValueError, match="cannot read"):
        load_shipped_table(tmp_path / "missing.json")


def test_the_in_tree_plugins_declare_their_shipped_folders():
    declared = {loc for loc, _ in get_registry().shipped_tables()}
    assert {"ejkernel_xla:shipped", "ejkernel_triton:shipped"} <= declared
    assert {"ejkernel_pallas:shipped", "ejkernel_cuda:shipped"} <= declared
