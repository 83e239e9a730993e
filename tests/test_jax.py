"""JAX: :mod:`asynchdf5.jax` on four virtual CPU devices, in a fresh interpreter (the device
count is an ``XLA_FLAGS`` option read when JAX starts; see ``tests/_jax_run.py``). Skipped where
JAX is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ._files import write_source

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs JAX"),
]

ROOT = Path(__file__).resolve().parent.parent


def test_global_arrays_on_four_devices_resume_exactly(tmp_path: Path) -> None:
    source, _ = write_source(tmp_path / "data", (40, 13, 27))
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-m", "tests._jax_run", str(source)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split()[-1:] == ["ok"]
