"""Tests of the GPU stage (``device=``) that need no GPU and no CuPy: run everywhere, CI included.

* device specs and the configuration errors, with CuPy absent (``parse_device``, the install
  hint, ``reuse_buffers`` without a device, importing asynchdf5 never imports CuPy);
* the stage's bookkeeping (resolving specs, staging reuse, events and streams, the device
  allocator, ``reuse_buffers``, hand-off in the consumer's thread, errors, close) run on the
  stand-in for CuPy in ``_fake_cupy``, which checks the control flow but not CUDA semantics.

The tests against the real CuPy (without a GPU, and ``gpu``-marked on one) are in ``test_gpu``.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import types
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    _gather,
)
from asynchdf5._delivery._cuda import CudaDelivery
from asynchdf5._delivery._cuda_memory import STAGING_DEPTH, DeviceMemory, Staging
from asynchdf5._delivery._device import parse_device

from ._fake_cupy import (
    FakeArray,
    FakeCUDARuntimeError,
    FakeCupy,
    FakeDevice,
    FakeEvent,
    FakeMemory,
    FakePinnedMemory,
    FakeStream,
    fake_blocks,
)
from ._files import IMAGE, write_source
from ._gpu_data import IMAGES, LABELS, TRANSFORMERS, check_epoch, host_copy, run_epochs, stage_of

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
    with pytest.raises(ConfigurationError, match=r"needs CuPy.*\.\[cuda12\].*cuda13"):
        MemoryDataLayer({"data": IMAGES, "label": LABELS}, batch_size=8, device=spec)
    with pytest.raises(ValueError):  # ConfigurationError is a ValueError too
        CudaDelivery(spec, [], 8, 8)


def test_malformed_spec_fails_before_cupy_is_imported(no_cupy: None) -> None:
    with pytest.raises(ConfigurationError, match="not a CUDA device"):
        MemoryDataLayer({"data": IMAGES}, batch_size=8, device="cpu")


def test_hdf5_layer_checks_device_at_construction(tmp_path: Path, no_cupy: None) -> None:
    src, _ = write_source(tmp_path, [50], shape=IMAGE)
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


# -- the stage on the stand-in for CuPy ---------------------------------------------------------


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
@pytest.mark.parametrize("transformed", [False, True])
async def test_fake_batches_are_staged_on_two_threads(
    fake_cupy: FakeCupy, monkeypatch: pytest.MonkeyPatch, transformed: bool
) -> None:
    """The copy into page-locked staging runs on two threads (one thread's copies are slower
    than the upload): without transformers two workers stage whole groups at once; with them
    one worker stages each large batch in two halves, one on the gather helper's thread. Every
    row lands in place either way, over several epochs of many groups."""
    monkeypatch.setattr(_gather, "PARALLEL_BYTES", 1)  # the test's small batches count as large
    threads: set[str] = set()
    real = _gather.gather_rows

    def spy(*args: Any, **kwargs: Any) -> None:
        threads.add(threading.current_thread().name)
        real(*args, **kwargs)

    monkeypatch.setattr(_gather, "gather_rows", spy)
    transformers = TRANSFORMERS if transformed else []
    kw: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=8, transformers=transformers)
    data = {"data": IMAGES, "label": LABELS}
    with anyio.fail_after(30):
        host = await run_epochs(MemoryDataLayer(data, **kw), epochs=3)
        threads.clear()
        layer = MemoryDataLayer(data, device="cuda", **kw)
        assert stage_of(layer).concurrent is not transformed
        dev = await run_epochs(layer, epochs=3)
    if transformed:
        assert threads == {"asynchdf5-gather", "asynchdf5-gather-helper_0"}, threads
    else:  # which worker takes which group is the scheduler's choice
        assert threads and threads <= {"asynchdf5-gather", "asynchdf5-gather_1"}, threads
    for h_epoch, d_epoch in zip(host, dev, strict=True):
        check_epoch(d_epoch, len(LABELS), None if transformed else IMAGES)
        for h, d in zip(h_epoch, d_epoch, strict=True):
            np.testing.assert_array_equal(d.indices, h.indices)
            np.testing.assert_allclose(host_copy(d["data"]), h["data"], rtol=1e-6)


@pytest.mark.anyio
@pytest.mark.parametrize("transformed", [False, True])
async def test_fake_a_dropped_batch_is_held_by_nothing_else(
    fake_cupy: FakeCupy, transformed: bool
) -> None:
    """Once the loop drops a batch, nothing of the pipeline holds it, so its device blocks come
    back as it goes: a gather worker waiting for room (behind a slow loop) used to hold the
    last group it made, and the consumer the list that group came in."""
    transformers = TRANSFORMERS if transformed else []
    layer = MemoryDataLayer(
        {"data": IMAGES, "label": LABELS},
        batch_size=4,
        prefetch=2,
        device="cuda",
        transformers=transformers,
    )
    last: weakref.ReferenceType[Any] | None = None
    seen = 0
    with anyio.fail_after(30):
        async with layer:
            async for batch in layer:
                if last is not None:
                    assert last() is None, f"batch {seen - 1} is still held"
                last = weakref.ref(batch._data)
                seen += 1
                del batch
                await anyio.sleep(0.002)  # a slow loop: the workers wait for room
    assert seen == -(-len(LABELS) // 4)


def test_fake_a_failed_batch_gives_back_only_its_own_staging(fake_cupy: FakeCupy) -> None:
    """Two threads stage batches at once: one batch failing returns its buffers, never the
    other's, which that thread still fills."""
    staging = Staging(sys.modules["cupy"])
    mine, theirs = staging.take(64), staging.take(64)
    staging.reclaim(FakeStream().record(FakeEvent()), [mine])
    assert staging.owns(theirs) and not staging.owns(mine)
    again = staging.take(64)  # the reclaimed buffer, free again; never `theirs`
    assert again.ctypes.data == mine.ctypes.data != theirs.ctypes.data


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
#: the queue to the consumer (max(prefetch, g)), the group the sender holds, the group queued
#: and waiting, the group being gathered by each of the two workers (no transformers); plus the
#: consumer's batch, the one it just dropped (freed at the next hand-off) and a transformer's
#: temporaries.
IN_FLIGHT = max(2, 16) + 4 * 16 + 3
MANY = {"data": np.zeros((4003, 4), np.uint8), "label": np.arange(4003)}
BLOCKS = 2 * 512  # one batch of MANY: two tops, each block rounded up to 512 bytes


@pytest.mark.anyio
async def test_fake_device_memory_is_reused_and_bounded(fake_cupy: FakeCupy) -> None:
    layer = MemoryDataLayer(MANY, batch_size=8, prefetch=2, device="cuda")
    await run_epochs(layer, epochs=3, keep=False)
    stats = stage_of(layer).memory_stats
    # 1500 batches: blocks come back and are reused, each as its batch is dropped (a gather
    # worker that made a batch holds no reference to it while it makes the next group).
    assert FakeMemory.created <= IN_FLIGHT * 2 + 2
    assert FakePinnedMemory.created <= STAGING_DEPTH * 2 * 2  # two batches a worker, two tops
    assert stats.device_bytes_peak <= IN_FLIGHT * BLOCKS
    assert stats.pinned_bytes == 0  # closed
    assert stats.device_bytes == stats.device_bytes_in_use  # closed: free blocks released


@pytest.mark.both_backends
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
        layer._consumer.delivery = CudaDelivery("cuda", [], 8, 2, reuse_buffers=reuse)
        await run_epochs(layer, epochs=1)  # holds every batch
        peaks[reuse] = stage_of(layer).memory_stats.device_bytes_peak
    assert peaks[False] >= 4003 // 8 * BLOCKS  # safe by default: nothing held is reused
    assert peaks[True] <= IN_FLIGHT * BLOCKS


def test_fake_staging_waits_for_a_copy_only_when_full(fake_cupy: FakeCupy) -> None:
    staging = Staging(sys.modules["cupy"])
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
    layer._consumer.delivery = CudaDelivery("cuda", layer.config.transformers, 8, 8)
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
    src, _ = write_source(tmp_path, [700], shape=IMAGE)
    n = 700
    layer = HDF5DataLayer(src, batch_size=8, device="cuda")
    layer._consumer.delivery = CudaDelivery("cuda", [], 8, 8, reuse_buffers=reuse)
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


@pytest.mark.both_backends
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
    memory = DeviceMemory(sys.modules["cupy"], 0, FakeStream(non_blocking=True))
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
    assert fake_cupy.pool.freed >= 1  # CuPy's own cache was given back first (by each worker)


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
    memory = DeviceMemory(cp, 0, FakeStream(non_blocking=True))
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
    take = Staging.take

    failed_batch: list[np.ndarray] = []

    def failing(self: Staging, nbytes: int) -> np.ndarray:
        if nbytes == 3 * LABELS.itemsize:  # the labels of the last batch, 3 rows, alone
            raise FakeCUDARuntimeError(2)  # cudaHostAlloc: out of memory
        buf = take(self, nbytes)
        if nbytes == 3 * IMAGES[0].nbytes:  # the same batch's data, staged just before
            failed_batch.append(buf)
        return buf

    monkeypatch.setattr(Staging, "take", failing)
    got = []
    async with layer:
        with pytest.raises(DeviceError, match=r"pinned host memory.*ulimit -l"):
            async for batch in layer:
                await anyio.sleep(0.001)  # a slow consumer: the error waits behind the batches
                got.append(batch.indices)
        # The failed batch's buffer went back (another worker may be staging a batch of its
        # own meanwhile, whose buffers stay lent to it).
        assert stage._gpu is not None and failed_batch
        assert not any(stage._gpu.staging.owns(b) for b in failed_batch)
    assert len(got) == 25  # every complete batch before the failed one, in order
    np.testing.assert_array_equal(np.concatenate(got), np.arange(200))


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


@pytest.mark.both_backends
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
                layer._consumer is not None and layer._consumer.run is None
            )  # the pipeline was stopped, as after any failure
            (epoch,) = [[b async for b in layer]]  # the next loop: the next epoch, whole
    assert {b.epoch for b in epoch} == {1}
    check_epoch(epoch, len(LABELS), IMAGES)


def test_fake_sync_hand_off_failure_ends_the_epoch(fake_cupy: FakeCupy, tmp_path: Path) -> None:
    src, _ = write_source(tmp_path, [300], shape=IMAGE)
    n = 300
    layer = HDF5DataLayer(src, batch_size=8, device="cuda")
    got: list[Batch] = []
    with _FailingStream(fail_at=20), layer:
        with pytest.raises(DeviceError, match="handing a batch"):
            for batch in layer:
                got.append(batch)
        assert (
            len(got) == 19 and layer._consumer is not None and layer._consumer.run is None
        )  # stopped
        epoch = list(layer)
    assert {b.epoch for b in epoch} == {1}
    assert sorted(np.concatenate([b.indices for b in epoch]).tolist()) == list(range(n))


def test_fake_hand_off_racing_close_frees_what_it_took(
    fake_cupy: FakeCupy, no_automatic_gc: None
) -> None:
    memory = DeviceMemory(sys.modules["cupy"], 0, FakeStream(non_blocking=True))

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

    def broken(staging: Staging, host: np.ndarray) -> np.ndarray:
        raise TypeError("a bug")

    monkeypatch.setattr(CudaDelivery, "_pinned", staticmethod(broken))
    with pytest.raises(TypeError, match="a bug"):  # not dressed up as a DeviceError
        stage.finish({"x": x}, np.arange(4), 0)
    monkeypatch.undo()

    def no_pinned_memory(self: Staging, nbytes: int) -> np.ndarray:
        raise FakeCUDARuntimeError(2)

    monkeypatch.setattr(Staging, "take", no_pinned_memory)
    with pytest.raises(DeviceError, match=r"uploading top 'x'.*page-locked host memory"):
        stage.finish({"x": x}, np.arange(4), 0)  # not gathered into staging: copied there
    stage.close()


def test_fake_reclaimed_staging_is_reused_only_after_its_copies(fake_cupy: FakeCupy) -> None:
    staging = Staging(sys.modules["cupy"])
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
    layer._consumer.delivery = CudaDelivery("cuda", [], 16, 8, reuse_buffers=reuse)
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
