"""JAX: :mod:`asynchdf5.jax` on four virtual CPU devices, in a fresh interpreter (the device
count is an ``XLA_FLAGS`` option read when JAX starts; see ``tests/_jax_run.py``). Skipped where
JAX is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ._files import write_source
from ._helpers import ROOT, run_python

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs JAX"),
]

# The labels' NarrowingWarning (int64 with x64 off) is expected there.
RUN_TWO = [sys.executable, "-W", "ignore::UserWarning", "-m", "tests._jax_two"]


def test_global_arrays_on_four_devices_resume_exactly(tmp_path: Path) -> None:
    source, _ = write_source(tmp_path / "data", (40, 13, 27))
    out = run_python(
        ["-m", "tests._jax_run", source],
        110,
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
    )
    assert out.split()[-1:] == ["ok"]


def test_two_processes_read_disjoint_shares_that_cover_the_epoch(tmp_path: Path) -> None:
    """Two JAX processes joined by ``jax.distributed.initialize`` on localhost: each yields
    global arrays over both processes' devices whose own rows are its shard; the shards are
    disjoint and together hold every sample once."""
    source, _ = write_source(tmp_path / "data", (40, 13, 27))
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    outs = [tmp_path / f"rank{i}.txt" for i in range(2)]
    procs = [
        subprocess.Popen(
            [*RUN_TWO, str(source), str(port), str(i), str(outs[i])],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=100)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], logs
    shares = [[int(v) for v in out.read_text().split()] for out in outs]
    assert len(shares[0]) == len(shares[1]) == 40
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == list(range(80))
