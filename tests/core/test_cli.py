"""The `ejkernel` command and the README's table of environment variables."""

from __future__ import annotations

import json
import pathlib
import re

import attrs

from ejkernel import _env
from ejkernel.cli import main
from ejkernel.ops import PersistentCache

README = pathlib.Path(__file__).parents[2] / "README.md"


@attrs.frozen
class C:
    n: int


def test_readme_table_matches_the_environment_module():
    text = README.read_text()
    table = text.split("<!-- env-table")[1].split("<!-- /env-table -->")[0]
    rows = re.findall(r"^\| `(EJKERNEL_[A-Z_]+)` \| (.*?) \| (.*) \|$", table, re.M)
    assert {name: (default, meaning) for name, default, meaning in rows} == _env.VARIABLES


def test_info_lists_versions_plugins_and_the_op_platform_matrix(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "ejkernel-core" in out and "jax" in out
    assert "xla (ejkernel_xla.plugin)" in out and "loaded" in out
    assert re.search(r"flash_attention\b.*\byes", out)


def test_cache_commands_path_list_export_import_clear(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EJKERNEL_CACHE_DIR", str(tmp_path / "c"))
    PersistentCache().put(
        "k1", C(1), source="autotune", meta={"key": {"op": "flash_attention", "platform": "xla"}}
    )
    assert main(["cache", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "c")
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "flash_attention/xla" in out and "1 entries" in out
    assert main(["cache", "export", str(tmp_path / "x.json")]) == 0
    assert json.loads((tmp_path / "x.json").read_text())["entries"]["k1"]["config"] == {"n": 1}
    assert main(["cache", "clear"]) == 0
    assert len(PersistentCache()) == 0
    assert main(["cache", "import", str(tmp_path / "x.json")]) == 0
    assert PersistentCache().get("k1", C) == C(1)
    (tmp_path / "bad.json").write_text("nonsense")
    assert main(["cache", "import", str(tmp_path / "bad.json")]) == 1


def _building_plugin() -> object:
    """A plugin whose platform compiles ahead of time (implements the optional build hook)."""
    from ejkernel.hookspecs import API_VERSION
    from ejkernel.plugins import hookimpl

    class BuildingPlugin:
        @hookimpl
        def ejkernel_api_version(self) -> int:
            return API_VERSION

        @hookimpl
        def ejkernel_register(self, registry: object) -> None:
            registry.add_platform("toyhw")  # type: ignore[attr-defined]

        @hookimpl
        def ejkernel_build(
            self, platform: str, force: bool, check: bool, target: str | None
        ) -> str | None:
            if platform != "toyhw":
                return None
            if target == "bad":
                raise RuntimeError("toycc: error: boom")
            return f"toyhw force={force} check={check} target={target}"

    return BuildingPlugin()


def test_build_command_asks_the_plugin_that_builds_the_platform(capsys):
    from ejkernel.plugins import register_plugin

    register_plugin(_building_plugin(), name="toybuild")
    assert main(["build", "TOYHW", "--force", "--target", "90"]) == 0
    assert capsys.readouterr().out.strip() == "toyhw force=True check=False target=90"
    assert main(["build", "toyhw", "--check"]) == 0
    assert "check=True target=None" in capsys.readouterr().out
    assert main(["build", "toyhw", "--target", "bad"]) == 1
    assert "build of toyhw failed: toycc: error: boom" in capsys.readouterr().err
    assert main(["build", "xla"]) == 0
    assert "xla: nothing to build" in capsys.readouterr().out
    assert main(["build", "nowhere"]) == 1
    assert "no installed plugin provides platform 'nowhere'" in capsys.readouterr().err


def test_python_dash_m_runs_the_command(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "EJKERNEL_CACHE_DIR": str(tmp_path)}
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "ejkernel", *a], capture_output=True, text=True, env=env, timeout=120
    )
    helped = run("--help")
    assert helped.returncode == 0 and "usage: ejkernel" in helped.stdout
    path = run("cache", "path")
    assert path.returncode == 0 and path.stdout.strip() == str(tmp_path)
    assert run("no-such-command").returncode == 2
