"""Installed distributions: metadata, entry points, the console script, a fresh process."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys

import pytest

from ejkernel.hookspecs import API_VERSION

PLUGINS = ["ejkernel-xla", "ejkernel-triton", "ejkernel-pallas", "ejkernel-cuda"]


@pytest.mark.parametrize("dist", PLUGINS)
def test_plugin_distribution_requires_a_compatible_core(dist):
    requires = md.requires(dist) or []
    core = [r for r in requires if r.replace(" ", "").startswith("ejkernel-core")]
    assert core and f">={API_VERSION}" in core[0] and f"<{API_VERSION + 1}" in core[0], requires


@pytest.mark.parametrize("dist", PLUGINS)
def test_plugin_distribution_declares_one_entry_point_named_like_its_platform(dist):
    eps = [ep for ep in md.distribution(dist).entry_points if ep.group == "ejkernel.plugins"]
    platform = dist.removeprefix("ejkernel-")
    assert [(ep.name, ep.value) for ep in eps] == [(platform, f"ejkernel_{platform}.plugin")]
    assert eps[0].load().ejkernel_api_version() == API_VERSION


def test_core_installs_the_console_script():
    scripts = {
        ep.name: ep.value
        for ep in md.distribution("ejkernel-core").entry_points
        if ep.group == "console_scripts"
    }
    assert scripts == {"ejkernel": "ejkernel.cli:main"}


def test_cli_runs_in_a_fresh_process(tmp_path):
    env = {"EJKERNEL_CACHE_DIR": str(tmp_path), "PATH": "", "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "ejkernel.cli", "info"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "xla (ejkernel_xla.plugin)" in out.stdout and "flash_attention" in out.stdout
