"""Shared fixtures: the anyio backends, the leak check, the stand-in for CuPy, a real GPU (where
there is one) and the S3 server.
The data sets tests write are in ``_files``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support.s3_server import S3Server

from . import _fake_cupy
from ._fake_cupy import FakeCupy, FakeDevice, FakeMemory, FakePinnedMemory
from ._files import write_source
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


@pytest.fixture(scope="session")
def cupy_gpu() -> Any:
    """CuPy, with a CUDA context on device 0 started; the test is skipped without CuPy or a GPU.

    The driver opens descriptors (``/dev/nvidia*``, pipes, event fds, a shared-memory file) the
    first time a context, a stream, an event and a page-locked copy are made, and keeps them as
    long as the process: they are made here, before a test counts descriptors, so that the first
    GPU test is not taken for a leak."""
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, driver too old, no runtime library
        pytest.skip(f"no usable CUDA GPU: {exc}")
    if count == 0:
        pytest.skip("no CUDA GPU")
    import cupyx

    with cupy.cuda.Device(0):
        stream = cupy.cuda.Stream(non_blocking=True)
        host = cupyx.empty_pinned((1 << 20,), np.uint8)
        dev = cupy.empty(host.shape, np.uint8)
        dev.data.copy_from_host_async(host.ctypes.data, host.nbytes, stream)
        stream.record().synchronize()
        del host, dev, stream
    return cupy


@pytest.fixture(scope="session")
def torch_cuda(cupy_gpu: Any) -> Any:
    """PyTorch with its CUDA state started (for the same reason as ``cupy_gpu``); skipped
    without PyTorch or its CUDA."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    torch.ones(1, device="cuda").add_(1).cpu()
    return torch


@pytest.fixture(scope="session")
def jax_gpu(cupy_gpu: Any) -> Any:
    """JAX with its GPU backend started (for the same reason as ``cupy_gpu``), told not to take
    most of the GPU's memory up front; skipped without JAX or its GPU backend."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax has no GPU backend")
    jax.numpy.ones(1).block_until_ready()
    return jax


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


#: ``ASYNCHDF5_BACKENDS=all``: every ``anyio`` test on asyncio and on trio, marked or not.
ALL_BACKENDS = os.environ.get("ASYNCHDF5_BACKENDS", "") == "all"


def _parametrized(metafunc: pytest.Metafunc, name: str) -> bool:
    """Whether the test parametrizes ``name`` itself."""
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The event loop of each ``@pytest.mark.anyio`` test: asyncio, and trio as well where the
    event loop is what the test is about, the tests marked ``both_backends`` (hand-off, pacing,
    lifecycle, the sync facade, cancellation, the whole-pipeline invariants). Elsewhere the
    pipeline under test runs in its own threads and the loop only awaits it, so a second loop
    would run the same code again. ``ASYNCHDF5_BACKENDS=all`` runs every test on both; a test
    that parametrizes ``anyio_backend`` itself keeps its own."""
    if "anyio_backend" not in metafunc.fixturenames or _parametrized(metafunc, "anyio_backend"):
        return
    both = ALL_BACKENDS or metafunc.definition.get_closest_marker("both_backends") is not None
    metafunc.parametrize("anyio_backend", ["asyncio", "trio"] if both else ["asyncio"])


@pytest.fixture
def anyio_backend() -> str:
    """Stands in for anyio's own fixture (parametrized over every backend installed), so that
    ``pytest_generate_tests`` alone says which loops a test runs on."""
    return "asyncio"


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCupy]:
    """A fresh stand-in for CuPy (``_fake_cupy``) as ``cupy`` (and ``cupyx.scipy.sparse``) and
    as ``_fake_cupy.FAKE``, its counters at zero."""
    fake = FakeCupy()
    monkeypatch.setattr(_fake_cupy, "FAKE", fake)
    for name, module in fake.modules().items():  # cupy, and cupyx for sparse batches
        monkeypatch.setitem(sys.modules, name, module)
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
    """A real S3 API (moto's server in a subprocess, see ``support/s3_server``) for each test
    module that asks for one, holding the module's ``s3_objects``."""
    folder = tmp_path_factory.mktemp("s3")
    with S3Server(log=folder / "server.log") as server:
        for bucket, objects in s3_objects.items():
            server.upload(bucket, objects)
        yield server


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, list[Path]]:
    """A list file naming three files, 300 samples (``_files.write_source``), and the files. A
    module that means another source defines its own fixture of this name."""
    return write_source(tmp_path)
