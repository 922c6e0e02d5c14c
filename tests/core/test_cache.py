"""The persistent cache: concurrency, corruption, read-only folders, export/import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import attrs
import cattrs
import pytest

from ejkernel.errors import CacheWarning
from ejkernel.ops import ConfigCache, PersistentCache, from_json, stable_json, to_json


@attrs.frozen(kw_only=True)
class Cfg:
    block: int = 64
    warps: int = 4


def test_memory_cache_has_the_seed_interface():
    cache = ConfigCache()
    cache.put("k", Cfg(block=1))
    assert "k" in cache and cache.get("k") == Cfg(block=1) and cache.get("missing") is None


def test_persistent_cache_round_trips_configs_and_provenance(tmp_path):
    cache = PersistentCache(path=tmp_path / "c")
    cache.put("k1", Cfg(block=32), source="autotune", meta={"timings_ms": {"a": 1.0}})
    again = PersistentCache(path=tmp_path / "c")
    assert (
        "k1" in again and again.get("k1") == Cfg(block=32) and again.get("k1", Cfg) == Cfg(block=32)
    )
    assert again.entry("k1", Cfg).source == "autotune"
    doc = json.loads((tmp_path / "c" / "configs.json").read_text())
    assert doc["schema"] == 1 and doc["entries"]["k1"]["source"] == "autotune"


def test_default_location_follows_the_environment_at_call_time(tmp_path, monkeypatch):
    cache = PersistentCache()
    monkeypatch.setenv("EJKERNEL_CACHE_DIR", str(tmp_path / "one"))
    assert cache.directory == tmp_path / "one"
    monkeypatch.delenv("EJKERNEL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.directory == tmp_path / "xdg" / "ejkernel"


def test_entry_that_no_longer_structures_is_ignored(tmp_path):
    cache = PersistentCache(path=tmp_path)
    cache.put("k", Cfg())
    data = json.loads((tmp_path / "configs.json").read_text())
    data["entries"]["k"]["config"]["renamed_field"] = 1
    (tmp_path / "configs.json").write_text(json.dumps(data))
    assert PersistentCache(path=tmp_path).get("k", Cfg) is None


def test_corrupt_file_is_set_aside_with_a_warning_and_writes_continue(tmp_path):
    (tmp_path / "configs.json").write_text("{not json")
    cache = PersistentCache(path=tmp_path)
    with pytest.warns(CacheWarning, match="corrupt"):
        assert cache.get("k") is None
    aside = [p for p in os.listdir(tmp_path) if p.startswith("configs.json.corrupt-")]
    assert len(aside) == 1 and (tmp_path / aside[0]).read_text() == "{not json"
    cache.put("k", Cfg(block=8))
    assert PersistentCache(path=tmp_path).get("k", Cfg) == Cfg(block=8)


def test_foreign_schema_is_set_aside(tmp_path):
    (tmp_path / "configs.json").write_text(json.dumps({"schema": 99, "entries": {}}))
    with pytest.warns(CacheWarning, match="schema 1"):
        assert len(PersistentCache(path=tmp_path)) == 0


@pytest.mark.skipif(
    os.geteuid() == 0 if hasattr(os, "geteuid") else True, reason="root ignores permissions"
)
def test_read_only_folder_warns_and_keeps_working(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    PersistentCache(path=folder).put("old", Cfg(block=2))
    folder.chmod(0o500)
    try:
        cache = PersistentCache(path=folder)
        with pytest.warns(CacheWarning, match="not writable"):
            assert cache.put("k", Cfg()) is False
        assert cache.get("old", Cfg) == Cfg(block=2)
    finally:
        folder.chmod(0o700)


def test_permission_denied_on_write_warns_and_loses_nothing(tmp_path, monkeypatch):
    cache = PersistentCache(path=tmp_path)
    cache.put("old", Cfg(block=2))

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as patch:
        patch.setattr("tempfile.mkstemp", denied)  # what a read-only folder does, even for root
        with pytest.warns(CacheWarning, match="not writable"):
            assert cache.put("k", Cfg()) is False
    assert PersistentCache(path=tmp_path).get("old", Cfg) == Cfg(block=2)


def test_unwritable_location_warns_once_and_never_crashes(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")
    cache = PersistentCache(path=blocker / "sub")
    with pytest.warns(CacheWarning, match="not writable"):
        assert cache.put("k", Cfg()) is False
    assert cache.put("k2", Cfg()) is False  # warned once: no second warning (filterwarnings=error)
    assert cache.get("k") is None


def test_concurrent_processes_lose_no_entries(tmp_path):
    worker = textwrap.dedent(
        """
        import sys, attrs
        from ejkernel.ops import PersistentCache

        @attrs.frozen
        class C:
            n: int

        cache = PersistentCache(path=sys.argv[1])
        for i in range(25):
            cache.put(f"{sys.argv[2]}-{i}", C(i))
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", worker, str(tmp_path), f"p{p}"]) for p in range(4)
    ]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    entries = PersistentCache(path=tmp_path).entries()
    assert len(entries) == 100
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".configs.json.")]  # no temp left


def test_export_and_import_move_configs_between_machines(tmp_path):
    src = PersistentCache(path=tmp_path / "a")
    src.put("k1", Cfg(block=1), source="autotune")
    src.put("k2", Cfg(block=2), source="autotune")
    assert src.export(tmp_path / "tuned.json") == 2
    dst = PersistentCache(path=tmp_path / "b")
    dst.put("k0", Cfg(block=0))
    assert dst.import_(tmp_path / "tuned.json") == 2
    assert {k: dst.get(k, Cfg).block for k in ("k0", "k1", "k2")} == {"k0": 0, "k1": 1, "k2": 2}
    (tmp_path / "junk.json").write_text("[]")
    with pytest.raises(ValueError, match="not an ejkernel cache export"):
        dst.import_(tmp_path / "junk.json")


def test_json_helpers_are_stable_and_strict():
    assert stable_json({"b": 1, "a": (1, 2)}) == '{"a":[1,2],"b":1}'
    assert from_json(to_json(Cfg(block=3)), Cfg) == Cfg(block=3)
    with pytest.raises(cattrs.errors.BaseValidationError):
        from_json('{"block": 1, "extra": 2}', Cfg)
