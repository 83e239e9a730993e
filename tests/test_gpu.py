"""Tests of the GPU stage (``device=``) against the real CuPy.

* CuPy installed, no GPU (as in CI with the ``cuda12`` extra): the configuration errors, the
  stand-in for CuPy (``_fake_cupy``) held to CuPy's real API, and the parts of the stage that
  need no device; skipped without CuPy, or where a GPU is usable;
* the real thing, marked ``gpu``: skipped without CuPy or a CUDA GPU.

Device specs, the errors without CuPy and the stage's bookkeeping on the stand-in (run
everywhere) are in ``test_delivery_cuda``.
"""

from __future__ import annotations

import gc
import inspect
import re
import subprocess
import sys
import types
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asynchdf5 import AsyncHDF5DataLayer, ConfigurationError, HDF5DataLayer, MemoryDataLayer
from asynchdf5._delivery._cuda import CudaDelivery
from asynchdf5._delivery._cuda_memory import DeviceMemory

from ._fake_cupy import FakeCsrMatrix, FakeCupy, FakeMemory, FakeStream
from ._files import IMAGE, write_source
from ._gpu_data import IMAGES, LABELS, TRANSFORMERS, check_epoch, run_epochs, stage_of

# -- the real CuPy, without a GPU ---------------------------------------------------------------
#
# CI installs the ``cuda12`` extra (``nox -s tests`` on Linux) on a machine without a GPU. CuPy
# imports there, and everything that touches no driver works: these tests hold the stand-in
# (``_fake_cupy``) to CuPy's real API and check the parts of the stage that need no device.


@pytest.fixture
def cupy_no_gpu() -> Any:
    cupy = pytest.importorskip("cupy")
    try:
        usable = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # CUDARuntimeError: no driver, driver too old
        usable = False
    if usable:
        pytest.skip("a CUDA GPU is usable here: the gpu-marked tests cover the real thing")
    return cupy


def test_real_cupy_without_a_gpu_is_a_configuration_error(cupy_no_gpu: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"device='cuda'.*no usable CUDA GPU") as info:
        MemoryDataLayer({"data": IMAGES}, batch_size=8, device="cuda")
    assert "CUDARuntimeError" in str(info.value) or "no CUDA GPU" in str(info.value)
    assert "device=None" in str(info.value)  # says how to go on without one
    with pytest.raises(ConfigurationError, match="no usable CUDA GPU"):
        CudaDelivery(0, [], 8, 8)


def test_importing_asynchdf5_does_not_import_installed_cupy(cupy_no_gpu: Any) -> None:
    code = (
        "import sys, importlib.util, numpy as np, asynchdf5, asynchdf5.transforms as T\n"
        "assert importlib.util.find_spec('cupy') is not None\n"
        "layer = asynchdf5.MemoryDataLayer({'x': np.zeros((4, 2))}, batch_size=2,\n"
        "                                  transformers=[('x', T.Scale(2.0))])\n"
        "print('cupy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _doc_signature(obj: Any) -> inspect.Signature:
    """The signature in the first docstring line of a Cython object: ``f(int a, b=1, *, c)``."""
    lines = (getattr(obj, "__doc__", None) or "").strip().splitlines()
    match = re.match(r"[\w.]+\((.*)\)", lines[0] if lines else "")
    if match is None:
        raise ValueError(f"no signature in the docstring of {obj!r}")
    kind: inspect._ParameterKind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params: list[inspect.Parameter] = []
    for part in (p.strip().replace("\\*", "*") for p in match.group(1).split(",")):
        if part in ("", "self"):
            continue
        if part == "/":
            params = [p.replace(kind=inspect.Parameter.POSITIONAL_ONLY) for p in params]
        elif part == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
        else:
            decl, eq, default = part.partition("=")
            name = decl.split()[-1]
            params.append(
                inspect.Parameter(name, kind, default=default if eq else inspect.Parameter.empty)
            )
    return inspect.Signature(params)


def _signature(obj: Any) -> inspect.Signature:
    if isinstance(obj, property):
        obj = obj.fget
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a Cython class or method: signature in the docstring
        init = getattr(obj, "__init__", None) if isinstance(obj, type) else None
        try:
            sig = _doc_signature(obj)
        except ValueError:
            sig = _doc_signature(init)
    params = [p for name, p in sig.parameters.items() if name != "self"]
    return sig.replace(parameters=params)


#: Parameters of the stand-in that only the tests use (the code under test never passes them).
TEST_ONLY = {"FakeStream": {"name", "busy"}}


def _check_call_shape(label: str, fake: Any, real: Any, test_only: set[str]) -> list[str]:
    """Every call valid on ``fake`` (without test-only arguments) is valid on ``real``."""
    problems = []
    f, r = _signature(fake), _signature(real)
    real_params = list(r.parameters.values())
    positional = [
        p for p in f.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    for i, p in enumerate(positional):
        q = real_params[i] if i < len(real_params) else None
        if q is None or q.kind not in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD):
            problems.append(f"{label}: argument {i} ({p.name}) is not positional in CuPy {r}")
        elif q.name != p.name and not (p.kind == q.kind == p.POSITIONAL_ONLY):
            problems.append(f"{label}: argument {i} is {q.name!r} in CuPy {r}, {p.name!r} here")
    by_name = {q.name: q for q in real_params if q.kind != q.POSITIONAL_ONLY}
    for p in f.parameters.values():
        if p.kind == p.KEYWORD_ONLY and p.name not in test_only and p.name not in by_name:
            problems.append(f"{label}: CuPy takes no keyword {p.name!r}: {r}")
    given = {p.name for p in f.parameters.values()} | set(range(len(positional)))
    for i, q in enumerate(real_params):
        if q.default is q.empty and q.kind != q.VAR_POSITIONAL and not ({q.name, i} & given):
            problems.append(f"{label}: CuPy requires {q.name!r}, which the stand-in lacks: {r}")
    return problems


def _members(cls: type) -> dict[str, Any]:
    """Methods and properties a stand-in class defines (what code under test may use)."""
    keep = {"__enter__", "__exit__"}
    return {
        name: value
        for name, value in vars(cls).items()
        if (not name.startswith("_") or name in keep)
        and (callable(value) or isinstance(value, property))
    }


def test_stand_in_matches_real_cupy_api(cupy_no_gpu: Any) -> None:
    """What the stage and transforms call on the stand-in exists in CuPy with the same shape."""
    fake = FakeCupy().module()
    pairs: list[tuple[str, Any, Any]] = []
    for name, value in vars(fake).items():
        if not name.startswith("__") and name != "cuda":
            pairs.append((f"cupy.{name}", value, getattr(cupy_no_gpu, name)))
    for name, value in vars(fake.cuda).items():
        pairs.append((f"cupy.cuda.{name}", value, getattr(cupy_no_gpu.cuda, name)))
    pairs.append(
        ("cupy.cuda.memory.OutOfMemoryError", MemoryError, cupy_no_gpu.cuda.memory.OutOfMemoryError)
    )
    problems = []
    for label, f, r in pairs:
        if isinstance(f, types.SimpleNamespace):  # runtime, memory: functions and classes
            for sub, value in vars(f).items():
                real = getattr(r, sub, None)
                if real is None:
                    problems.append(f"{label}.{sub} does not exist in CuPy")
                elif callable(value) and not isinstance(value, type):
                    problems += _check_call_shape(f"{label}.{sub}", value, real, set())
            continue
        if isinstance(f, type) and issubclass(f, BaseException):
            assert issubclass(r, BaseException), label
            continue
        if isinstance(f, type) and not issubclass(f, np.ndarray):
            problems += _check_call_shape(label, f, r, TEST_ONLY.get(f.__name__, set()))
        if isinstance(f, type):
            for member, value in _members(f).items():
                real = getattr(r, member, None)
                if real is None:
                    problems.append(f"{label}.{member} does not exist in CuPy")
                elif isinstance(value, property) != isinstance(
                    real, (property, types.GetSetDescriptorType)
                ):
                    problems.append(f"{label}.{member}: a property in one, a method in the other")
                elif not isinstance(value, property) and member not in ("__enter__", "__exit__"):
                    problems += _check_call_shape(f"{label}.{member}", value, real, set())
        elif callable(f):
            problems += _check_call_shape(label, f, r, set())
    # The sparse tops' batches: cupyx's csr_matrix (its __init__ forwards to the compressed base).
    import cupyx.scipy.sparse

    real_csr = cupyx.scipy.sparse.csr_matrix
    base = next(c for c in real_csr.__mro__ if c.__name__ == "_compressed_sparse_matrix")
    problems += _check_call_shape("csr_matrix", FakeCsrMatrix.__init__, base.__init__, set())
    for member, value in _members(FakeCsrMatrix).items():
        real = getattr(real_csr, member)
        problems += _check_call_shape(f"csr_matrix.{member}", value, real, set())
    # Attributes the stage reads off CuPy objects (instance attributes of the stand-in).
    for path in (
        "cuda.Device.id",
        "cuda.Memory.ptr",
        "cuda.MemoryPointer.mem",
        "cuda.MemoryPointer.ptr",
    ):
        obj: Any = cupy_no_gpu
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            problems.append(f"cupy.{path} does not exist")
    assert not problems, "\n".join(problems)


def test_real_cupy_arrays_hold_the_lease_of_their_block(cupy_no_gpu: Any) -> None:
    """The allocator's contract with CuPy: a block goes back only when no array or view uses it.

    Device memory is host bytes here (``cupy.cuda.Memory`` needs a driver); the pointer, the
    ``UnownedMemory`` that owns the lease, the arrays and their views are CuPy's own.
    """
    cp = cupy_no_gpu
    FakeMemory.created = 0
    memory = DeviceMemory(cp, 0, FakeStream(non_blocking=True))
    fake_cuda = types.SimpleNamespace(**{**vars(cp.cuda), "Memory": FakeMemory})
    memory._cupy = types.SimpleNamespace(cuda=fake_cuda)  # type: ignore[assignment]
    ptr = memory.malloc(100)
    assert isinstance(ptr, cp.cuda.MemoryPointer)
    a = cp.ndarray((25,), np.float32, memptr=ptr)
    del ptr
    views = [a[3:], a.reshape(5, 5).T, a[::2]]
    (lease,) = memory.leases_of([views[1]])
    assert memory.leases_of([a]) == [lease] and lease.size == 512 == memory.in_use
    block, lease_alive = lease.mem.ptr, weakref.ref(lease)
    del a, lease
    gc.collect()
    assert lease_alive() is not None and memory.in_use == 512  # the views still use the block
    views.pop()
    views.pop()
    gc.collect()
    assert lease_alive() is not None
    views.clear()
    gc.collect()
    assert lease_alive() is None
    assert memory.in_use == 0 and memory.reserved == 512  # back on the free list, kept
    again = memory.malloc(512)  # the same block, reused
    assert again.ptr == block and FakeMemory.created == 1
    del again
    gc.collect()
    memory.close()
    assert memory.reserved == 0


# -- on a real GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.anyio
@pytest.mark.parametrize("shuffle", [False, True])
async def test_gpu_memory_layer_matches_host(cupy_gpu: Any, shuffle: bool) -> None:
    kw: dict[str, Any] = dict(batch_size=16, shuffle=shuffle, seed=5)
    data = {"data": IMAGES, "label": LABELS}
    host = await run_epochs(MemoryDataLayer(data, **kw), epochs=2)
    dev = await run_epochs(MemoryDataLayer(data, device="cuda", **kw), epochs=2)
    for h_epoch, d_epoch in zip(host, dev, strict=True):
        check_epoch(d_epoch, len(LABELS), IMAGES)
        for h, d in zip(h_epoch, d_epoch, strict=True):
            assert isinstance(d["data"], cupy_gpu.ndarray)
            assert d["data"].device.id == 0
            np.testing.assert_array_equal(d.indices, h.indices)
            np.testing.assert_array_equal(cupy_gpu.asnumpy(d["data"]), h["data"])


@pytest.mark.gpu
@pytest.mark.anyio
async def test_gpu_hdf5_layer_matches_host(cupy_gpu: Any, tmp_path: Path) -> None:
    src, _ = write_source(tmp_path, [300, 0, 250], shape=IMAGE)
    n = 550
    kw: dict[str, Any] = dict(batch_size=32, shuffle=True, seed=2, chunk_size=128)
    host = await run_epochs(AsyncHDF5DataLayer(src, **kw), epochs=2)
    dev = await run_epochs(AsyncHDF5DataLayer(src, device=0, **kw), epochs=2)
    for h_epoch, d_epoch in zip(host, dev, strict=True):
        assert sorted(np.concatenate([b.indices for b in d_epoch]).tolist()) == list(range(n))
        for h, d in zip(h_epoch, d_epoch, strict=True):
            np.testing.assert_array_equal(d.indices, h.indices)
            for top in ("data", "label"):
                np.testing.assert_array_equal(cupy_gpu.asnumpy(d[top]), h[top])
            label = cupy_gpu.asnumpy(d["label"])
            np.testing.assert_array_equal(cupy_gpu.asnumpy(d["data"])[:, 0, 0], label * 10)


@pytest.mark.gpu
@pytest.mark.anyio
async def test_gpu_transforms_match_host(cupy_gpu: Any) -> None:
    kw: dict[str, Any] = dict(batch_size=16, shuffle=True, seed=4, transformers=TRANSFORMERS)
    data = {"data": IMAGES, "label": LABELS}
    (host,) = await run_epochs(MemoryDataLayer(data, **kw))
    (dev,) = await run_epochs(MemoryDataLayer(data, device="cuda", **kw))
    for h, d in zip(host, dev, strict=True):
        out = d["data"]
        assert out.dtype == h["data"].dtype == np.float32 and out.flags.c_contiguous
        np.testing.assert_allclose(cupy_gpu.asnumpy(out), h["data"], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.anyio
@pytest.mark.parametrize("keep", [False, True])
async def test_gpu_batches_survive_a_busy_consumer_stream(cupy_gpu: Any, keep: bool) -> None:
    """No upload overwrites a batch that the consumer's queued kernels still read, or that it
    still holds: the consumer's own stream lags far behind the host (matmuls before each read),
    and batches are dropped (or kept) as soon as their read is queued."""
    layer = MemoryDataLayer(
        {"data": IMAGES, "label": LABELS},
        batch_size=8,
        shuffle=True,
        seed=9,
        prefetch=2,
        device="cuda",
    )
    stream = cupy_gpu.cuda.Stream(non_blocking=True)
    sums, indices, kept = [], [], []
    with stream:
        work = cupy_gpu.ones((2048, 2048), cupy_gpu.float32)
        async with layer:
            for _ in range(2):
                async for batch in layer:
                    for _ in range(4):  # ones @ ones / 2048 == ones: busy, and stable
                        work = work @ work / 2048
                    sums.append(batch["data"].astype(cupy_gpu.int64).sum())
                    indices.append(batch.indices)
                    if keep:
                        kept.append(batch)
        expected = [int(IMAGES[i].astype(np.int64).sum()) for i in indices]
        assert [int(s) for s in sums] == expected
        for b in kept:  # read only now, after every later upload
            np.testing.assert_array_equal(cupy_gpu.asnumpy(b["data"]), IMAGES[b.indices])
    assert stage_of(layer).memory_stats.device_bytes_peak > 0


@pytest.mark.gpu
@pytest.mark.parametrize("reuse", [False, True])
def test_gpu_sync_facade_on_a_busy_consumer_stream(
    cupy_gpu: Any, tmp_path: Path, reuse: bool
) -> None:
    """The sync facade hands each batch to the ``for`` loop's thread and stream: with that
    stream lagging far behind the host, every batch still reads its own rows (with
    ``reuse_buffers``, as long as it is used before the next one is asked for)."""
    src, _ = write_source(tmp_path, [500, 300], shape=IMAGE)
    n = 800
    layer = HDF5DataLayer(
        src,
        batch_size=8,
        shuffle=True,
        seed=3,
        prefetch=2,
        chunk_size=256,
        device="cuda",
        reuse_buffers=reuse,
    )
    stream = cupy_gpu.cuda.Stream(non_blocking=True)
    sums, indices = [], []
    with stream, layer:
        work = cupy_gpu.ones((2048, 2048), cupy_gpu.float32)
        for _ in range(2):
            for batch in layer:
                for _ in range(4):  # ones @ ones / 2048 == ones: busy, and stable
                    work = work @ work / 2048
                sums.append(batch["label"].sum())  # the label is the global index
                indices.append(batch.indices)
        got = [int(s) for s in sums]  # synchronises, after every upload
        held = stage_of(layer).memory_stats.device_bytes
    assert got == [int(i.sum()) for i in indices]
    np.testing.assert_array_equal(np.sort(np.concatenate(indices)), np.repeat(np.arange(n), 2))
    # 200 batches of two 512-byte blocks were uploaded: blocks came back and were reused.
    assert held <= 150 * 1024


@pytest.mark.gpu
@pytest.mark.anyio
async def test_gpu_torch_from_dlpack(cupy_gpu: Any, torch_cuda: Any) -> None:
    torch = torch_cuda
    layer = MemoryDataLayer({"data": IMAGES, "label": LABELS}, batch_size=32, device="cuda")
    async with layer:
        async for batch in layer:
            x = torch.from_dlpack(batch["data"])
            assert x.is_cuda and x.data_ptr() == batch["data"].data.ptr  # no copy
            np.testing.assert_array_equal(x.cpu().numpy(), IMAGES[batch.indices])


@pytest.mark.gpu
@pytest.mark.anyio
async def test_gpu_jax_dlpack(cupy_gpu: Any, jax_gpu: Any) -> None:
    layer = MemoryDataLayer({"data": IMAGES, "label": LABELS}, batch_size=32, device="cuda")
    async with layer:
        async for batch in layer:
            x = jax_gpu.dlpack.from_dlpack(batch["data"])
            np.testing.assert_array_equal(np.asarray(x), IMAGES[batch.indices])


@pytest.mark.gpu
def test_gpu_device_out_of_range(cupy_gpu: Any) -> None:
    count = cupy_gpu.cuda.runtime.getDeviceCount()
    with pytest.raises(ConfigurationError, match=f"no CUDA device {count}"):
        MemoryDataLayer({"data": IMAGES}, batch_size=8, device=count)
    assert CudaDelivery(cupy_gpu.cuda.Device(0), [], 8, 8).device_id == 0
