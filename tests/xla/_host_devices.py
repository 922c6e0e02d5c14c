"""Running a test script on several host (CPU) devices, in a subprocess of its own: the
device count is fixed when jax starts."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys


def run_on_host_devices(script: pathlib.Path, devices: int) -> str:
    """``script``'s standard output, run with ``devices`` host devices as its one argument;
    fails the test (with the script's output) where it exits non-zero."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [sys.executable, str(script), str(devices)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    return result.stdout
