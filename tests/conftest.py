"""Shared fixtures: the anyio backends and small HDF5 data sets written into ``tmp_path``."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from benchmarks.s3_server import S3Server

from . import _fake_cupy
from ._fake_cupy import FakeCupy, FakeDevice, FakeMemory, FakePinnedMemory
from ._leaks import assert_released, snapshot


@pytest.fixture(scope="session", autouse=True)
def _obstore_runtime() -> None:
    """obstore's runtime (its worker threads, their epoll and eventfd descriptors) starts with
    its first request and lives as long as the process, by design: start it before any test
    counts descriptors, so that the first remote test is not taken for a leak."""
    try:
        import obstore
        from obstore.store import MemoryStore
    except ImportError:
        return
    import asyncio

    async def touch() -> None:
        store = MemoryStore()
        await obstore.put_async(store, "x", b"x")
        await obstore.get_async(store, "x")

    asyncio.run(touch())


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test: no thread of ours still running, and no more open file descriptors, after it
    (idle pool workers of anyio and trio, lingering by design, excepted; see ``_leaks``).

    A test that hands something over to a later one on purpose opts out with
    ``@pytest.mark.leaks_ok``.
    """
    if request.node.get_closest_marker("leaks_ok") is not None:
        yield
        return
    before = snapshot()
    yield
    assert_released(before, strict=False)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every ``@pytest.mark.anyio`` test runs on asyncio and on trio."""
    return str(request.param)


def sample_data(start: int, n: int, shape: tuple[int, ...] = (3, 4)) -> dict[str, np.ndarray]:
    """Rows whose values encode their global index, so alignment is checkable from the data."""
    idx = np.arange(start, start + n, dtype=np.int64)
    data = (idx.reshape(-1, *([1] * len(shape))) * 10 + np.zeros(shape, np.int64)).astype(
        np.float32
    )
    return {"data": data, "label": idx}


def write_files(
    folder: Path,
    sizes: Sequence[int],
    *,
    shape: tuple[int, ...] = (3, 4),
    list_file: bool = True,
    **dataset_kwargs: Any,
) -> tuple[Path | list[Path], int]:
    """Write one HDF5 file per size (global index continues across files).

    Returns the source (a list file, or the list of paths) and the total sample count.
    """
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    start = 0
    for i, n in enumerate(sizes):
        path = folder / f"part{i}.h5"
        with h5py.File(path, "w") as f:
            for name, arr in sample_data(start, n, shape).items():
                f.create_dataset(name, data=arr, **dataset_kwargs)
        paths.append(path)
        start += n
    if not list_file:
        return paths, start
    lst = folder / "train.txt"
    lst.write_text("# training files\n\n" + "\n".join(p.name for p in paths) + "\n")
    return lst, start


@pytest.fixture
def h5_source(tmp_path: Path) -> tuple[Path, int]:
    """A source list of three files (one of them empty): 1000 samples."""
    src, n = write_files(tmp_path, [400, 0, 350, 250])
    assert isinstance(src, Path)
    return src, n


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCupy]:
    """A fresh stand-in for CuPy (``_fake_cupy``) as ``cupy`` and as ``_fake_cupy.FAKE``, its
    counters at zero."""
    fake = FakeCupy()
    monkeypatch.setattr(_fake_cupy, "FAKE", fake)
    monkeypatch.setitem(sys.modules, "cupy", fake.module())
    FakeMemory.created = FakePinnedMemory.created = FakeDevice.synchronized = 0
    yield fake
    FakeMemory.capacity = None


#: What a test module's S3 server holds: bucket -> key -> object (a file, or its bytes).
S3Objects = Mapping[str, Mapping[str, Path | bytes]]


@pytest.fixture(scope="module")
def s3_objects() -> S3Objects:
    """The objects of the module's ``s3`` server: none, unless the module says otherwise by a
    fixture of this name."""
    return {}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory, s3_objects: S3Objects) -> Iterator[S3Server]:
    """A real S3 API (moto's server in a subprocess, see ``benchmarks/s3_server``) for each test
    module that asks for one, holding the module's ``s3_objects``."""
    folder = tmp_path_factory.mktemp("s3")
    with S3Server(log=folder / "server.log") as server:
        for bucket, objects in s3_objects.items():
            server.upload(bucket, objects)
        yield server
