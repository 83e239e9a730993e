"""Tests of the GPU stage (``device=``): asynchdf5._delivery._cuda.

Three kinds of test:

* device specs and the configuration errors, with CuPy absent (run everywhere, CI included);
* the stage's bookkeeping (staging reuse, events, the allocator, ``reuse_buffers``, close) run on
  a small stand-in for CuPy over host memory, which checks the control flow but not CUDA
  semantics (run everywhere);
* the real thing, marked ``gpu``: skipped without CuPy or a CUDA GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import inspect
import re
import subprocess
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import anyio
import numpy as np
import pytest

from asynchdf5 import (
    AsyncHDF5DataLayer,
    Batch,
    ConfigurationError,
    DeviceError,
    HDF5DataLayer,
    MemoryDataLayer,
    SchemaError,
    TransformError,
)
from asynchdf5 import transforms as T
from asynchdf5._delivery._cuda import (
    STAGING_DEPTH,
    CudaDelivery,
    _DeviceMemory,
    _Staging,
    parse_device,
)

from .conftest import write_files

RNG = np.random.default_rng(0)
IMAGES = RNG.integers(0, 256, size=(203, 4, 5, 3), dtype=np.uint8)  # NHWC
LABELS = np.arange(203, dtype=np.int64)
MEAN = np.array([10.0, 20.0, 30.0])
STD = np.array([2.0, 4.0, 8.0])
TRANSFORMERS: list[tuple[str, Any]] = [
    ("data", T.Scale(1 / 255)),
    ("data", T.SubMean(mean=MEAN / 255)),
    ("data", T.Normalize(mean=0.0, std=STD / 255)),
    ("data", T.Transpose((2, 0, 1))),
]


def host_copy(x: Any) -> np.ndarray:
    """A NumPy copy of a batch array from either CuPy or the stand-in."""
    get = getattr(x, "get", None)
    return np.array(get() if get is not None else x)


async def run_epochs(layer: Any, epochs: int = 1, keep: bool = True) -> list[list[Batch]]:
    out: list[list[Batch]] = []
    async with layer:
        for _ in range(epochs):
            batches = []
            async for batch in layer:
                if keep:
                    batches.append(batch)
            out.append(batches)
    return out


def check_epoch(batches: list[Batch], n: int, data: np.ndarray | None = None) -> None:
    """Every sample once; data and label rows belong to the same sample."""
    indices = np.concatenate([b.indices for b in batches])
    assert sorted(indices.tolist()) == list(range(n))
    for b in batches:
        assert isinstance(b.indices, np.ndarray)  # stays on the host
        np.testing.assert_array_equal(host_copy(b["label"]), LABELS[b.indices])
        if data is not None:
            np.testing.assert_array_equal(host_copy(b["data"]), data[b.indices])


# -- device specs and errors without CuPy -------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "index"),
    [("cuda", None), ("cuda:0", 0), ("cuda:3", 3), (0, 0), (2, 2), (np.int64(1), 1)],
)
def test_parse_device_accepts(spec: object, index: int | None) -> None:
    assert parse_device(spec) == index


@pytest.mark.parametrize(
    "spec", ["cpu", "cuda:x", "cuda:", "cuda:-1", "gpu", "CUDA", " cuda", "cuda:١", -1, True, 1.0]
)
def test_parse_device_rejects(spec: object) -> None:
    with pytest.raises(ConfigurationError, match="device="):
        parse_device(spec)


@pytest.fixture
def no_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError


@pytest.mark.parametrize("spec", ["cuda", "cuda:1", 0])
def test_missing_cupy_is_a_configuration_error_with_install_hint(no_cupy: None, spec: Any) -> None:
    with pytest.raises(ConfigurationError, match=r"needs CuPy.*asynchdf5\[cuda12\].*cuda13"):
        MemoryDataLayer({"data": IMAGES, "label": LABELS}, batch_size=8, device=spec)
    with pytest.raises(ValueError):  # ConfigurationError is a ValueError too
        CudaDelivery(spec, [], 8, 8)


def test_malformed_spec_fails_before_cupy_is_imported(no_cupy: None) -> None:
    with pytest.raises(ConfigurationError, match="not a CUDA device"):
        MemoryDataLayer({"data": IMAGES}, batch_size=8, device="cpu")


def test_hdf5_layer_checks_device_at_construction(tmp_path: Path, no_cupy: None) -> None:
    src, _ = write_files(tmp_path, [50])
    with pytest.raises(ConfigurationError, match="needs CuPy"):
        AsyncHDF5DataLayer(src, batch_size=8, device="cuda:0")


def test_reuse_buffers_needs_a_device() -> None:
    x = np.zeros((10, 2), np.float32)
    with pytest.raises(ConfigurationError, match="reuse_buffers"):
        MemoryDataLayer({"data": x}, batch_size=2, reuse_buffers=True)


def test_importing_asynchdf5_and_host_layers_never_import_cupy() -> None:
    code = (
        "import sys, numpy as np, asynchdf5\n"
        "asynchdf5.MemoryDataLayer({'x': np.zeros((4, 2))}, batch_size=2, device=None)\n"
        "print('cupy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- a stand-in for CuPy ------------------------------------------------------------------------


class FakeEvent:
    def __init__(self, *, block: bool = False, disable_timing: bool = False) -> None:
        self.block = block
        self.recorded_on: FakeStream | None = None
        self.recorded_by: int | None = None  # the thread that recorded it
        self.synchronized = False

    @property
    def done(self) -> bool:  # work on a busy stream never finishes (until synchronised)
        return self.recorded_on is not None and not self.recorded_on.busy

    def synchronize(self) -> None:
        self.synchronized = True


class FakeStream:
    def __init__(self, *, non_blocking: bool = False, name: str = "", busy: bool = False) -> None:
        self.name = name or f"stream{id(self):x}"
        self.non_blocking = non_blocking
        self.busy = busy
        self.waited: list[FakeEvent] = []
        self.recorded: list[FakeEvent] = []

    def record(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.recorded_on = self
        event.recorded_by = threading.get_ident()
        self.recorded.append(event)
        return event

    def wait_event(self, event: FakeEvent) -> None:
        assert event.recorded_on is not None, "waiting on an event never recorded"
        self.waited.append(event)

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> FakeStream:
        FAKE.stack().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        FAKE.stack().pop()


class FakeDevice:
    synchronized = 0  # device-wide synchronisations (never in the hot path)

    def __init__(self, device: int | None = None) -> None:
        self.id = 0 if device is None else int(device)

    def synchronize(self) -> None:
        FakeDevice.synchronized += 1

    def __enter__(self) -> FakeDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


FakeDevice.__module__ = "cupy.cuda.device"  # parse_device tells a cupy.cuda.Device by its module


class FakeCUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        super().__init__(f"CUDA error {status}")
        self.status = status


class FakeMemory:
    """Device memory: host bytes whose address stands in for the device pointer."""

    created = 0
    capacity: int | None = None  # blocks cudaMalloc gives before it runs out of memory

    def __new__(cls, size: int) -> FakeMemory:
        if cls.capacity is not None and fake_blocks() >= cls.capacity:
            raise FakeCUDARuntimeError(2)  # cudaErrorMemoryAllocation
        return super().__new__(cls)

    def __init__(self, size: int) -> None:
        self._buf = (ctypes.c_char * size)()
        self.ptr, self.size = ctypes.addressof(self._buf), size
        FakeMemory.created += 1


def fake_blocks() -> int:
    """``FakeMemory`` blocks not yet freed. Counted from the objects that exist, not with
    ``__del__``, which the collector also runs for blocks a lease's finaliser keeps (PEP 442)."""
    return sum(1 for o in gc.get_objects() if type(o) is FakeMemory)


class FakeUnownedMemory:
    def __init__(self, ptr: int, size: int, owner: object, device_id: int) -> None:
        self.ptr, self.size, self.owner = ptr, size, owner


class FakeMemoryPointer:
    def __init__(self, mem: Any, offset: int) -> None:
        self.mem, self.ptr = mem, mem.ptr + offset

    def copy_from_host_async(self, mem: int, size: int, stream: FakeStream) -> None:
        assert FAKE.current_stream() is stream
        assert FakePinnedMemory.holds(mem, size), "an async copy from pageable memory"
        ctypes.memmove(self.ptr, mem, size)


class _PinnedBytes(bytearray):
    """Host bytes standing in for page-locked memory (weakly referable, unlike bytearray)."""


class FakePinnedMemory:
    created = 0
    live: ClassVar[weakref.WeakValueDictionary[int, _PinnedBytes]] = weakref.WeakValueDictionary()

    def __init__(self, size: int) -> None:
        self.buffer = _PinnedBytes(size)
        start = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer)) if size else 0
        FakePinnedMemory.live[start] = self.buffer
        FakePinnedMemory.created += 1

    @classmethod
    def holds(cls, address: int, size: int) -> bool:
        """Whether ``size`` bytes at ``address`` lie in one live pinned buffer."""
        return any(
            start <= address and address + size <= start + len(buf)
            for start, buf in list(cls.live.items())
        )


class FakeArray(np.ndarray):
    """A 'device' array: NumPy over memory from the current allocator."""

    _memptr: Any = None

    def __array_finalize__(self, obj: Any) -> None:
        # Views share the parent's memory, as in CuPy; fresh results own none of ours.
        self._memptr = getattr(obj, "_memptr", None) if self.base is not None else None

    @property
    def device(self) -> FakeDevice:  # type: ignore[override]
        return FakeDevice(0)

    @property
    def data(self) -> Any:
        return self._memptr

    def get(self) -> np.ndarray:
        return np.array(self.view(np.ndarray))


FakeArray.__module__ = "cupy"  # what asynchdf5.transforms looks at to tell CuPy arrays


class FakeCupy:
    """The parts of CuPy the stage and the transforms use."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.null = FakeStream(name="null")
        self.device_count = 1
        self.pool = types.SimpleNamespace(freed=0)
        self.pool.free_all_blocks = lambda: setattr(self.pool, "freed", self.pool.freed + 1)

    def stack(self) -> list[FakeStream]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        stack: list[FakeStream] = self.local.stack
        return stack

    def current_stream(self) -> FakeStream:
        stack = self.stack()
        return stack[-1] if stack else self.null

    def module(self) -> types.ModuleType:
        fake = types.ModuleType("cupy")
        runtime = types.SimpleNamespace(
            getDeviceCount=lambda: self.device_count,
            getDevice=lambda: 0,
            CUDARuntimeError=FakeCUDARuntimeError,
        )
        memory = types.SimpleNamespace(OutOfMemoryError=MemoryError)
        driver = types.SimpleNamespace(CUDADriverError=type("CUDADriverError", (RuntimeError,), {}))
        fake.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
            runtime=runtime,
            driver=driver,
            memory=memory,
            Device=FakeDevice,
            Stream=FakeStream,
            Event=FakeEvent,
            Memory=FakeMemory,
            UnownedMemory=FakeUnownedMemory,
            MemoryPointer=FakeMemoryPointer,
            PinnedMemory=FakePinnedMemory,
            PinnedMemoryPointer=lambda mem, offset: mem.buffer,
            get_current_stream=self.current_stream,
            using_allocator=self.using_allocator,
        )
        fake.ndarray = FakeArray  # type: ignore[attr-defined]
        fake.get_default_memory_pool = lambda: self.pool  # type: ignore[attr-defined]
        fake.empty = self.empty  # type: ignore[attr-defined]
        fake.asarray = self.asarray  # type: ignore[attr-defined]
        fake.ascontiguousarray = self.ascontiguousarray  # type: ignore[attr-defined]
        fake.multiply = self.ufunc(np.multiply)  # type: ignore[attr-defined]
        fake.subtract = self.ufunc(np.subtract)  # type: ignore[attr-defined]
        return fake

    @contextlib.contextmanager
    def using_allocator(self, allocator: Callable[[int], Any]) -> Iterator[None]:
        previous = getattr(self.local, "malloc", None)
        self.local.malloc = allocator
        try:
            yield
        finally:
            self.local.malloc = previous

    def empty(self, shape: tuple[int, ...], dtype: Any) -> FakeArray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        malloc = getattr(self.local, "malloc", None)
        if malloc is None:
            memptr = FakeMemoryPointer(FakeMemory(max(nbytes, 1)), 0)
        else:
            memptr = malloc(nbytes)
        raw = (ctypes.c_char * max(nbytes, 1)).from_address(memptr.ptr)
        base = np.frombuffer(raw, np.uint8, nbytes)
        out: FakeArray = base.view(dtype).reshape(shape).view(FakeArray)
        out._memptr = memptr
        return out

    def asarray(self, a: Any, dtype: Any = None) -> FakeArray:
        host = np.asarray(a, dtype=dtype)
        out = self.empty(host.shape, host.dtype)
        out.view(np.ndarray)[...] = host
        return out

    def ascontiguousarray(self, a: Any) -> FakeArray:
        return self.asarray(np.asarray(a))

    def ufunc(self, fn: np.ufunc) -> Callable[..., FakeArray]:
        def apply(x1: Any, x2: Any, /, *, dtype: Any = None) -> FakeArray:
            a, b = np.asarray(x1), np.asarray(x2)
            out = self.empty(np.broadcast_shapes(a.shape, b.shape), dtype or np.result_type(a, b))
            fn(a, b, out=out.view(np.ndarray), dtype=dtype)
            return out

        return apply


FAKE = FakeCupy()


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCupy]:
    fake = FakeCupy()
    monkeypatch.setattr(sys.modules[__name__], "FAKE", fake)
    monkeypatch.setitem(sys.modules, "cupy", fake.module())
    FakeMemory.created = FakePinnedMemory.created = FakeDevice.synchronized = 0
    yield fake
    FakeMemory.capacity = None


def stage_of(layer: Any) -> CudaDelivery:
    stage = layer._delivery
    assert isinstance(stage, CudaDelivery)
    return stage


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", 0])
def test_stage_resolves_specs(fake_cupy: FakeCupy, spec: Any) -> None:
    assert CudaDelivery(spec, [], 8, 8).device_id == 0
    assert CudaDelivery(FakeDevice(0), [], 8, 8).device_id == 0


def test_no_gpu_or_missing_index_is_a_configuration_error(fake_cupy: FakeCupy) -> None:
    with pytest.raises(ConfigurationError, match="no CUDA device 1; this machine has 1"):
        CudaDelivery("cuda:1", [], 8, 8)
    fake_cupy.device_count = 0
    with pytest.raises(ConfigurationError, match="no CUDA GPU"):
        CudaDelivery("cuda", [], 8, 8)


def test_cuda_runtime_error_is_a_configuration_error(
    fake_cupy: FakeCupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> int:
        raise RuntimeError("cudaErrorInsufficientDriver")

    monkeypatch.setattr(sys.modules["cupy"].cuda.runtime, "getDeviceCount", broken)
    with pytest.raises(ConfigurationError, match=r"no usable CUDA GPU.*InsufficientDriver"):
        MemoryDataLayer({"data": IMAGES}, batch_size=8, device="cuda")


def test_nothing_allocated_at_construction(fake_cupy: FakeCupy) -> None:
    layer = MemoryDataLayer({"data": IMAGES}, batch_size=8, device="cuda")
    assert FakeMemory.created == FakePinnedMemory.created == 0
    assert stage_of(layer).memory_stats.device_bytes == 0


@pytest.mark.anyio
@pytest.mark.parametrize("shuffle", [False, True])
async def test_fake_values_match_host_path(fake_cupy: FakeCupy, shuffle: bool) -> None:
    kw: dict[str, Any] = dict(batch_size=16, shuffle=shuffle, seed=3, transformers=TRANSFORMERS)
    data = {"data": IMAGES, "label": LABELS}
    host = await run_epochs(MemoryDataLayer(data, **kw), epochs=2)
    dev = await run_epochs(MemoryDataLayer(data, device="cuda", **kw), epochs=2)
    for h_epoch, d_epoch in zip(host, dev, strict=True):
        check_epoch(d_epoch, len(LABELS))
        for h, d in zip(h_epoch, d_epoch, strict=True):
            assert isinstance(d["data"], FakeArray)
            np.testing.assert_array_equal(d.indices, h.indices)
            np.testing.assert_allclose(host_copy(d["data"]), h["data"], rtol=1e-6)


@pytest.mark.anyio
async def test_fake_batches_ready_on_the_consumers_current_stream(fake_cupy: FakeCupy) -> None:
    layer = MemoryDataLayer({"data": IMAGES, "label": LABELS}, batch_size=32, device="cuda")
    mine = FakeStream(name="training")
    with mine:
        (batches,) = await run_epochs(layer)
    events = [b._data.event for b in batches]  # type: ignore[attr-defined]
    assert mine.waited == events
    (upload,) = {e.recorded_on for e in events}
    assert upload is not None and upload not in (mine, fake_cupy.null)
    assert upload.non_blocking  # never serialised with the legacy default stream


#: Batches alive at most (docs/gpu.md, "Memory"): prefetch 2, groups of g = 16 small batches:
#: the queue to the consumer (max(prefetch, g)), the group the sender holds, the group gathered
#: and waiting, the group being gathered; plus the consumer's batch, the one it just dropped
#: (freed at the next hand-off) and a transformer's temporaries.
IN_FLIGHT = max(2, 16) + 3 * 16 + 3
MANY = {"data": np.zeros((4003, 4), np.uint8), "label": np.arange(4003)}
BLOCKS = 2 * 512  # one batch of MANY: two tops, each block rounded up to 512 bytes


@pytest.mark.anyio
async def test_fake_device_memory_is_reused_and_bounded(fake_cupy: FakeCupy) -> None:
    layer = MemoryDataLayer(MANY, batch_size=8, prefetch=2, device="cuda")
    await run_epochs(layer, epochs=3, keep=False)
    stats = stage_of(layer).memory_stats
    assert FakeMemory.created <= IN_FLIGHT * 2 + 2  # 1500 batches: blocks come back, reused
    assert FakePinnedMemory.created <= STAGING_DEPTH * 2  # about two batches of two tops
    assert stats.device_bytes_peak <= IN_FLIGHT * BLOCKS
    assert stats.pinned_bytes == 0  # closed
    assert stats.device_bytes == stats.device_bytes_in_use  # closed: free blocks released


@pytest.mark.anyio
async def test_fake_reused_block_waits_for_the_consumer(fake_cupy: FakeCupy) -> None:
    layer = MemoryDataLayer({"data": IMAGES, "label": LABELS}, batch_size=8, device="cuda")
    mine = FakeStream(name="training", busy=True)
    with mine:
        await run_epochs(layer, epochs=2, keep=False)
    # Blocks freed by the consumer carry an event recorded on its stream, and the upload stream
    # waits on it before writing into the block again.
    upload = stage_of(layer)._memory._stream  # type: ignore[union-attr]
    consumer_events = [e for e in upload.waited if e.recorded_on is mine]
    assert consumer_events
    assert all(e in mine.recorded for e in consumer_events)


@pytest.mark.anyio
async def test_fake_held_batches_are_never_overwritten(fake_cupy: FakeCupy) -> None:
    data = {"data": IMAGES, "label": LABELS}
    layer = MemoryDataLayer(data, batch_size=8, shuffle=True, seed=1, device="cuda")
    epochs = await run_epochs(layer, epochs=2)
    for batches in epochs:  # checked only now, after every later upload
        check_epoch(batches, len(LABELS), IMAGES)


@pytest.mark.anyio
async def test_fake_reuse_buffers_bounds_memory_of_held_batches(fake_cupy: FakeCupy) -> None:
    peaks = {}
    for reuse in (False, True):
        layer = MemoryDataLayer(MANY, batch_size=8, prefetch=2, device="cuda")
        layer._delivery = CudaDelivery("cuda", [], 8, 2, reuse_buffers=reuse)
        await run_epochs(layer, epochs=1)  # holds every batch
        peaks[reuse] = stage_of(layer).memory_stats.device_bytes_peak
    assert peaks[False] >= 4003 // 8 * BLOCKS  # safe by default: nothing held is reused
    assert peaks[True] <= IN_FLIGHT * BLOCKS


def test_fake_staging_waits_for_a_copy_only_when_full(fake_cupy: FakeCupy) -> None:
    staging = _Staging(sys.modules["cupy"])
    busy = FakeStream(busy=True)  # copies on it never finish by themselves
    a, b = staging.take(100), staging.take(52)  # one batch of two tops
    first = busy.record(FakeEvent())
    staging.copied([a.view(np.float32).reshape(5, 5), b, np.zeros(3)], first)
    c, d = staging.take(100), staging.take(52)  # a's copy is not done: fresh buffers
    assert FakePinnedMemory.created == 4 and not first.synchronized
    staging.copied([c, d], busy.record(FakeEvent()))
    e = staging.take(100)  # STAGING_DEPTH batches staged: wait for the oldest copy, reuse it
    assert FakePinnedMemory.created == 4 and first.synchronized
    assert e.ctypes.data == a.ctypes.data
    assert staging.nbytes == 2 * (100 + 52)


def test_fake_ready_twice_then_reuse_buffers_recycles(fake_cupy: FakeCupy) -> None:
    stage = CudaDelivery("cuda", [], 4, 2, reuse_buffers=True)
    indices = np.arange(4)

    def batch(value: float) -> Batch:
        host = stage.alloc((4, 3), np.dtype(np.float32))
        host[...] = value
        return Batch(stage.finish({"x": host}, indices, 0), indices, 0)

    first = batch(1.0)
    stage.ready(first)
    stage.ready(first)  # handed off twice: nothing recycled
    assert stage.memory_stats.device_bytes_in_use == 512
    second = batch(2.0)
    stage.ready(second)  # `first` is recycled although still held: the opt-in contract
    assert stage.memory_stats.device_bytes_in_use == 512
    batch(3.0)
    assert FakeMemory.created == 2  # the third batch went into the first one's block
    np.testing.assert_array_equal(host_copy(first["x"]), 3.0)
    np.testing.assert_array_equal(host_copy(second["x"]), 2.0)
    stage.close()
    assert stage.memory_stats.pinned_bytes == 0


@pytest.mark.anyio
async def test_fake_transformer_error_is_wrapped(fake_cupy: FakeCupy) -> None:
    def boom(x: Any) -> Any:
        raise ZeroDivisionError("bad batch")

    layer = MemoryDataLayer({"data": IMAGES}, batch_size=8, transformers=[("data", boom)])
    layer._delivery = CudaDelivery("cuda", layer.config.transformers, 8, 8)
    async with layer:
        with pytest.raises(TransformError, match="ZeroDivisionError: bad batch"):
            async for _ in layer:
                pass


@pytest.mark.anyio
async def test_fake_big_endian_and_odd_dtypes(fake_cupy: FakeCupy) -> None:
    x = np.arange(60, dtype=">f8").reshape(20, 3)
    flags = np.arange(20) % 3 == 0
    layer = MemoryDataLayer({"x": x, "flag": flags}, batch_size=7, device="cuda")
    (batches,) = await run_epochs(layer)
    got = np.concatenate([host_copy(b["x"]) for b in batches])
    np.testing.assert_array_equal(got, x)
    assert got.dtype == np.float64 and got.dtype.isnative
    np.testing.assert_array_equal(np.concatenate([host_copy(b["flag"]) for b in batches]), flags)


@pytest.mark.anyio
async def test_fake_layer_reopens_after_close(fake_cupy: FakeCupy) -> None:
    layer = MemoryDataLayer({"data": IMAGES, "label": LABELS}, batch_size=32, device="cuda")
    for _ in range(2):  # close frees the staging and the stream; the next open makes new ones
        (batches,) = await run_epochs(layer)
        check_epoch(batches, len(LABELS), IMAGES)
        assert stage_of(layer).memory_stats.pinned_bytes == 0


@pytest.mark.parametrize("reuse", [False, True])
def test_fake_sync_facade_hands_batches_off_in_the_loops_thread(
    fake_cupy: FakeCupy, tmp_path: Path, reuse: bool
) -> None:
    """The ``for`` loop's thread, not the portal's, is the consumer: its stream waits for each
    upload, blocks it frees are ordered on its stream, and ``reuse_buffers`` recycles a batch
    only once the loop has moved past it (the portal takes up to 16 batches at a time)."""
    src, n = write_files(tmp_path, [700])
    layer = HDF5DataLayer(src, batch_size=8, device="cuda")
    layer._delivery = CudaDelivery("cuda", [], 8, 8, reuse_buffers=reuse)
    training = FakeStream(non_blocking=True, name="training", busy=True)  # never catches up
    seen = []
    with layer, training:
        for batch in layer:
            # Read the moment it arrives: nothing may have been written over it yet.
            np.testing.assert_array_equal(host_copy(batch["label"]), batch.indices)
            seen.append(batch.indices)
    assert sorted(np.concatenate(seen).tolist()) == list(range(n))
    assert len(training.waited) == len(seen)  # every batch's upload, on the loop thread's stream
    upload = stage_of(layer)._memory._stream  # type: ignore[union-attr]
    released = [e for e in upload.waited if e.recorded_on is not None]
    assert released  # blocks came back from the consumer and were reused
    assert {e.recorded_on.name for e in released} == {"training"}
    assert not fake_cupy.null.recorded  # nothing recorded on the portal thread's stream,
    assert not fake_cupy.null.waited  # and it never waited for an upload
    mine = threading.get_ident()
    assert {e.recorded_by for e in released} == {mine}


@pytest.mark.anyio
async def test_fake_blocks_freed_in_other_threads_are_ordered_in_the_consumers(
    fake_cupy: FakeCupy,
) -> None:
    """A batch dropped in another thread (autograd, a GC pass in the gather thread) records
    nothing there: with per-thread default streams that would be another stream."""
    layer = MemoryDataLayer({"data": IMAGES, "label": LABELS}, batch_size=8, device="cuda")
    training = FakeStream(non_blocking=True, name="training", busy=True)
    handed: list[Batch] = []
    with training:
        async with layer:
            for _ in range(2):
                async for batch in layer:
                    handed.append(batch)
                    if len(handed) == 4:  # dropped by a worker thread
                        dropped, handed[:] = list(handed), []
                        await anyio.to_thread.run_sync(dropped.clear)
    upload = stage_of(layer)._memory._stream  # type: ignore[union-attr]
    released = [e for e in upload.waited if e.recorded_on is training]
    assert released
    assert {e.recorded_by for e in training.recorded} == {threading.get_ident()}


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    gc.collect()  # blocks other tests left to the collector
    gc.disable()
    yield
    gc.enable()


def test_fake_out_of_device_memory_frees_cached_blocks_then_retries(
    fake_cupy: FakeCupy, no_automatic_gc: None
) -> None:
    memory = _DeviceMemory(sys.modules["cupy"], 0, FakeStream(non_blocking=True))
    base = fake_blocks()
    held, cached = memory.malloc(1000), memory.malloc(3000)
    cycle: list[Any] = [memory.malloc(4096)]
    cycle.append(cycle)  # garbage only the collector finds
    del cached, cycle  # the 3072-byte block goes to the cache
    FakeMemory.capacity = fake_blocks()  # the device is full
    first = memory.malloc(2000)  # dropping the cache makes room
    assert fake_blocks() - base == 3 and memory.reserved == 1024 + 2048 + 4096
    assert fake_cupy.pool.freed == 0
    second = memory.malloc(512)  # collect garbage, free CuPy's own pool, try again
    assert fake_cupy.pool.freed == 1 and memory.reserved == 1024 + 2048 + 512
    FakeMemory.capacity = None
    handed: list[Any] = [memory.malloc(512)]
    (lease,) = memory.leases_of([types.SimpleNamespace(data=handed[0])])
    lease.stream = FakeStream(non_blocking=True, name="training")  # the consumer had it
    handed.append(handed)
    del handed, lease  # garbage, freed by the collector into the pending list
    FakeMemory.capacity = fake_blocks()
    synced = FakeDevice.synchronized
    third = memory.malloc(512)  # pending blocks are freed once the device is idle
    assert FakeDevice.synchronized == synced + 1
    with pytest.raises(FakeCUDARuntimeError) as info:  # nothing left to free: CuPy's error
        memory.malloc(512)
    assert info.value.status == 2
    assert memory.in_use == 1024 + 2048 + 512 + 512
    del held, first, second, third


@pytest.mark.anyio
async def test_fake_out_of_device_memory_is_a_device_error(fake_cupy: FakeCupy) -> None:
    FakeMemory.capacity = 0
    layer = MemoryDataLayer({"data": IMAGES, "label": LABELS}, batch_size=8, device="cuda")
    async with layer:
        with pytest.raises(DeviceError) as info:
            async for _ in layer:
                pass
    message = str(info.value)
    assert "uploading top 'data'" in message and "a batch of 8 rows" in message
    assert "CUDA device 0" in message and "reuse_buffers=True" in message
    assert isinstance(info.value.__cause__, FakeCUDARuntimeError)
    assert fake_cupy.pool.freed == 1  # CuPy's own cache was given back first


@pytest.mark.anyio
async def test_fake_long_double_top_is_a_schema_error_before_any_batch(
    fake_cupy: FakeCupy, tmp_path: Path
) -> None:
    x = np.zeros((20, 2), np.longdouble)
    if x.dtype == np.float64:
        pytest.skip("long double is double on this platform")
    layer = MemoryDataLayer({"x": x, "y": np.arange(20)}, batch_size=4, device="cuda")
    with pytest.raises(SchemaError, match=r"top 'x'.*long double"):
        async with layer:
            pass
    assert FakeMemory.created == FakePinnedMemory.created == 0


def test_fake_blocks_the_consumer_used_are_freed_once_the_device_is_idle(
    fake_cupy: FakeCupy, no_automatic_gc: None
) -> None:
    cp = sys.modules["cupy"]
    memory = _DeviceMemory(cp, 0, FakeStream(non_blocking=True))
    training = FakeStream(non_blocking=True, name="training", busy=True)
    used, unused, after = memory.malloc(512), memory.malloc(1024), memory.malloc(2048)
    for lease in memory.leases_of([types.SimpleNamespace(data=p) for p in (used, after)]):
        lease.stream = training  # handed to the consumer
    del lease, used, unused  # freed since the last hand-off: pending, and the cache
    assert not training.recorded and FakeDevice.synchronized == 0  # no CUDA call on release
    memory.close()
    assert FakeDevice.synchronized == 1  # the consumer's work on the pending block is done
    assert memory.reserved == 2048  # only the block still in use
    del after  # dropped after close: freed at once, once the device is idle
    assert FakeDevice.synchronized == 2 and memory.reserved == 0 and memory.in_use == 0


@pytest.mark.anyio
async def test_fake_pinned_allocation_failure_comes_after_the_complete_batches(
    fake_cupy: FakeCupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = MemoryDataLayer({"data": IMAGES, "label": LABELS}, batch_size=8, device="cuda")
    stage = stage_of(layer)
    calls = 0
    take = _Staging.take

    def failing(self: _Staging, nbytes: int) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls == 2 * 7 + 2:  # the second top of the 8th batch
            raise FakeCUDARuntimeError(2)  # cudaHostAlloc: out of memory
        return take(self, nbytes)

    monkeypatch.setattr(_Staging, "take", failing)
    got = []
    async with layer:
        with pytest.raises(DeviceError, match=r"pinned host memory.*ulimit -l"):
            async for batch in layer:
                await anyio.sleep(0.001)  # a slow consumer: the error waits behind the batches
                got.append(batch.indices)
        assert stage._gpu is not None and not stage._gpu.staging._lent  # given back
    assert len(got) == 7
    np.testing.assert_array_equal(np.concatenate(got), np.arange(56))


def test_fake_finish_copies_host_arrays_into_pinned_memory(fake_cupy: FakeCupy) -> None:
    """Arrays not gathered into staging (plain, strided, byte-swapped) are copied into pinned
    buffers first: the stand-in's copy asserts that it reads pinned memory."""
    stage = CudaDelivery("cuda", [], 5, 2)
    plain = np.arange(15, dtype=np.float32).reshape(5, 3)
    strided = np.arange(30, dtype=np.int16).reshape(5, 6)[:, ::2]
    swapped = np.arange(5, dtype=">i4")
    data: dict[str, np.ndarray] = {
        "plain": plain,
        "strided": strided,
        "swapped": swapped,
        "empty": np.zeros((5, 0)),
    }
    out = stage.finish(dict(data), np.arange(5), 0)
    for name, host in data.items():
        got = host_copy(out[name])
        np.testing.assert_array_equal(got, host)
        assert got.dtype.isnative and got.dtype.kind == host.dtype.kind
    assert swapped.dtype == ">i4" and swapped[1] == 1  # the caller's array is left alone
    assert stage._gpu is not None and not stage._gpu.staging._lent  # all copies queued
    stage.close()


class _FailingStream(FakeStream):
    """The consumer's stream; ``wait_event`` fails from the ``fail_at``-th call on."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(non_blocking=True, name="training")
        self.fail_at, self.calls = fail_at, 0

    def wait_event(self, event: FakeEvent) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise FakeCUDARuntimeError(700)  # cudaErrorIllegalAddress: a sticky CUDA error
        super().wait_event(event)


@pytest.mark.anyio
async def test_fake_hand_off_failure_ends_the_epoch(fake_cupy: FakeCupy) -> None:
    layer = MemoryDataLayer({"data": IMAGES, "label": LABELS}, batch_size=8, device="cuda")
    got: list[Batch] = []
    with _FailingStream(fail_at=5):
        async with layer:
            with pytest.raises(DeviceError, match="handing a batch to the consumer's stream"):
                async for batch in layer:
                    got.append(batch)
            assert len(got) == 4 and layer.stats.batches == 4  # the failed one never counted
            assert (
                layer._session is not None and layer._session.run is None
            )  # the pipeline was stopped, as after any failure
            (epoch,) = [[b async for b in layer]]  # the next loop: the next epoch, whole
    assert {b.epoch for b in epoch} == {1}
    check_epoch(epoch, len(LABELS), IMAGES)


def test_fake_sync_hand_off_failure_ends_the_epoch(fake_cupy: FakeCupy, tmp_path: Path) -> None:
    src, n = write_files(tmp_path, [300])
    layer = HDF5DataLayer(src, batch_size=8, device="cuda")
    got: list[Batch] = []
    with _FailingStream(fail_at=20), layer:
        with pytest.raises(DeviceError, match="handing a batch"):
            for batch in layer:
                got.append(batch)
        assert (
            len(got) == 19 and layer._session is not None and layer._session.run is None
        )  # stopped
        epoch = list(layer)
    assert {b.epoch for b in epoch} == {1}
    assert sorted(np.concatenate([b.indices for b in epoch]).tolist()) == list(range(n))


def test_fake_hand_off_racing_close_frees_what_it_took(
    fake_cupy: FakeCupy, no_automatic_gc: None
) -> None:
    memory = _DeviceMemory(sys.modules["cupy"], 0, FakeStream(non_blocking=True))

    class Closing(FakeStream):  # close() from another thread, while hand_off records
        def record(self, event: FakeEvent | None = None) -> FakeEvent:
            memory.close()
            return super().record(event)

    block = memory.malloc(512)
    (lease,) = memory.leases_of([types.SimpleNamespace(data=block)])
    lease.stream = Closing(non_blocking=True)
    del block, lease  # pending
    memory.hand_off()
    assert memory.reserved == 0 and memory.in_use == 0 and not memory._free


def test_fake_errors_that_are_not_cuda_pass_unchanged(
    fake_cupy: FakeCupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    stage = CudaDelivery("cuda", [], 4, 2)
    x = np.zeros((4, 3), np.float32)

    def broken(staging: _Staging, host: np.ndarray) -> np.ndarray:
        raise TypeError("a bug")

    monkeypatch.setattr(CudaDelivery, "_pinned", staticmethod(broken))
    with pytest.raises(TypeError, match="a bug"):  # not dressed up as a DeviceError
        stage.finish({"x": x}, np.arange(4), 0)
    monkeypatch.undo()

    def no_pinned_memory(self: _Staging, nbytes: int) -> np.ndarray:
        raise FakeCUDARuntimeError(2)

    monkeypatch.setattr(_Staging, "take", no_pinned_memory)
    with pytest.raises(DeviceError, match=r"uploading top 'x'.*page-locked host memory"):
        stage.finish({"x": x}, np.arange(4), 0)  # not gathered into staging: copied there
    stage.close()


def test_fake_reclaimed_staging_is_reused_only_after_its_copies(fake_cupy: FakeCupy) -> None:
    staging = _Staging(sys.modules["cupy"])
    busy = FakeStream(busy=True)
    a = staging.take(64)
    staging.reclaim(busy.record(FakeEvent()))  # the batch failed; a copy may still read `a`
    assert not staging._lent
    b = staging.take(64)  # below the cap: a new buffer rather than one a copy still reads
    assert b.ctypes.data != a.ctypes.data and FakePinnedMemory.created == 2


@pytest.mark.anyio
@pytest.mark.parametrize("reuse", [False, True])
async def test_fake_stream_mode_on_the_device(fake_cupy: FakeCupy, reuse: bool) -> None:
    """``layer.stream()``: full batches across epochs, each read as it arrives (with
    ``reuse_buffers``, a batch is valid until the next one is asked for)."""
    layer = MemoryDataLayer(
        {"data": IMAGES, "label": LABELS}, batch_size=16, shuffle=True, seed=2, device="cuda"
    )
    layer._delivery = CudaDelivery("cuda", [], 16, 8, reuse_buffers=reuse)
    seen = []
    async with layer:
        async for batch in layer.stream():
            assert len(batch.indices) == 16
            np.testing.assert_array_equal(host_copy(batch["data"]), IMAGES[batch.indices])
            seen.append(batch.indices)
            if len(seen) == 40:  # 640 samples: three epochs and a bit
                break
    counts = np.bincount(np.concatenate(seen), minlength=len(LABELS))
    assert counts.min() >= 3 and counts.max() <= 4  # every sample once per epoch passed


# -- the real CuPy, without a GPU ---------------------------------------------------------------
#
# CI installs the ``cuda12`` extra (``nox -s tests`` on Linux) on a machine without a GPU. CuPy
# imports there, and everything that touches no driver works: these tests hold the stand-in above
# to CuPy's real API and check the parts of the stage that need no device.


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
    memory = _DeviceMemory(cp, 0, FakeStream(non_blocking=True))
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


@pytest.fixture
def cupy_gpu() -> Any:
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, driver too old, no runtime library
        pytest.skip(f"no usable CUDA GPU: {exc}")
    if count == 0:
        pytest.skip("no CUDA GPU")
    return cupy


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
    src, n = write_files(tmp_path, [300, 0, 250])
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
    src, n = write_files(tmp_path, [500, 300])
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
async def test_gpu_torch_from_dlpack(cupy_gpu: Any) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    layer = MemoryDataLayer({"data": IMAGES, "label": LABELS}, batch_size=32, device="cuda")
    async with layer:
        async for batch in layer:
            x = torch.from_dlpack(batch["data"])
            assert x.is_cuda and x.data_ptr() == batch["data"].data.ptr  # no copy
            np.testing.assert_array_equal(x.cpu().numpy(), IMAGES[batch.indices])


@pytest.mark.gpu
@pytest.mark.anyio
async def test_gpu_jax_dlpack(cupy_gpu: Any) -> None:
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax has no GPU backend")
    layer = MemoryDataLayer({"data": IMAGES, "label": LABELS}, batch_size=32, device="cuda")
    async with layer:
        async for batch in layer:
            x = importlib.import_module("jax.dlpack").from_dlpack(batch["data"])
            np.testing.assert_array_equal(np.asarray(x), IMAGES[batch.indices])


@pytest.mark.gpu
def test_gpu_device_out_of_range(cupy_gpu: Any) -> None:
    count = cupy_gpu.cuda.runtime.getDeviceCount()
    with pytest.raises(ConfigurationError, match=f"no CUDA device {count}"):
        MemoryDataLayer({"data": IMAGES}, batch_size=8, device=count)
    assert CudaDelivery(cupy_gpu.cuda.Device(0), [], 8, 8).device_id == 0
