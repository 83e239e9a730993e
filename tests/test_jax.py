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


def test_ragged_and_sparse_tops_are_refused_by_name_until_made_dense(tmp_path: Path) -> None:
    """A global ``jax.Array`` is dense: a ragged or sparse top's batch is a ConfigurationError
    naming the top and ``Pad`` / ``Densify``, not an object array or a TypeError from JAX;
    with those transformers, dense arrays of the rows."""
    code = """
import sys
import h5py, numpy as np
from asynchdf5 import ConfigurationError, HDF5DataLayer, transforms as T
from asynchdf5.jax import Loader
path = sys.argv[1]
lens = np.arange(12) % 4
with h5py.File(path, "w") as f:
    g = f.create_group("tok")
    g["data"] = np.repeat(np.arange(12, dtype=np.int32), lens)
    g["indptr"] = np.concatenate([[0], np.cumsum(lens)])
    x = f.create_group("X")
    x["data"], x["indices"] = np.ones(12, np.float32), np.arange(12) % 5
    x["indptr"] = np.arange(13)
    x.attrs["shape"], x.attrs["encoding-type"] = (12, 5), "csr_matrix"
for top, fix in (("tok", "transforms.Pad"), ("X", "transforms.Densify")):
    with HDF5DataLayer(path, tops=(top,), batch_size=4) as layer:
        try:
            next(iter(Loader(layer)))
        except ConfigurationError as e:
            assert repr(top) in str(e) and fix in str(e), e
        else:
            raise AssertionError(top)
transformers = [("tok", T.Pad(-1, length=3)), ("X", T.Densify())]
with HDF5DataLayer(path, tops=("tok", "X"), batch_size=4, transformers=transformers) as layer:
    batches = list(Loader(layer))
    assert len(batches) == 3
    assert all(b["tok"].shape == (4, 3) and b["X"].shape == (4, 5) for b in batches)
    assert sum(float(b["X"].sum()) for b in batches) == 12
print("ok")
"""
    out = run_python(["-c", code, str(tmp_path / "r.h5")], 100, JAX_PLATFORMS="cpu")
    assert out.strip().split()[-1:] == ["ok"]
