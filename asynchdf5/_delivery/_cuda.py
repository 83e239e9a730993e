"""CUDA delivery (``device=``): batches become CuPy arrays while the consumer trains.

The delivery is the last stage of the pipeline::

    gather thread:   rows ─▶ pinned staging ─▶ async copy ─▶ transformers ─▶ event  (upload stream)
    consumer thread: ready(batch): the consumer's current stream waits on that event

* Rows are gathered straight into page-locked host buffers, allocated once and reused when the
  copy that reads them is done (the gather thread waits on that copy's event, if at all).
* Copies and transformers run on the stage's own non-blocking stream; the consumer's stream
  waits on an event. Nothing in the hot path synchronises the device.
* Device arrays come from :class:`_DeviceMemory`, which reuses a block the consumer has freed only
  once the consumer's stream has passed the point where it was freed. That point is recorded in
  the consumer's thread, at the next hand-off: no CUDA call runs in a finaliser or in whatever
  thread happens to drop the last reference (with per-thread default streams, a stream handle
  means a different stream in each thread).

CuPy is imported inside functions only, so importing asynchdf5 never imports it.
"""

from __future__ import annotations

import contextlib
import gc
import re
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import numpy as np

from .._batch import Batch, BatchSpec, gather_rows
from .._catalog import TopInfo
from .._errors import ConfigurationError, DeviceError, SchemaError
from .._stats import GatherStats
from .._transform import apply_transformers
from ..transforms import Transformer

__all__ = ["INSTALL_HINT", "CudaDelivery", "DeviceMemoryStats", "parse_device", "resolve_device"]

INSTALL_HINT = (
    'install CuPy with pip install "asynchdf5[cuda12]" (CUDA 12) or '
    'pip install "asynchdf5[cuda13]" (CUDA 13)'
)
_ACCEPTED = "None (NumPy batches), 'cuda', 'cuda:N', an int N >= 0 or a cupy.cuda.Device"
_CUDA = re.compile(r"cuda(?::([0-9]+))?")
#: Batches staged in pinned memory: one being gathered, one whose copies run.
STAGING_DEPTH = 2
#: Device blocks are rounded up to this many bytes, so that batches of one shape share blocks.
BLOCK_ALIGN = 512
#: ``cudaErrorMemoryAllocation``: what ``cudaMalloc`` (``cupy.cuda.Memory``) fails with.
_CUDA_OUT_OF_MEMORY = 2


def parse_device(device: object) -> int | None:
    """The CUDA device index that ``device`` names, checked without importing CuPy.

    Returns None for ``"cuda"``, the current device (known once CuPy is imported).
    Raises :class:`~asynchdf5.ConfigurationError` for anything that is not a device spec.
    """
    if isinstance(device, (bool, np.bool_)):
        raise ConfigurationError(f"device={device!r} is a bool, not a device; use {_ACCEPTED}")
    if isinstance(device, (int, np.integer)):
        if device < 0:
            raise ConfigurationError(f"device={device!r}: a CUDA device index must be >= 0")
        return int(device)
    if isinstance(device, str):
        match = _CUDA.fullmatch(device)
        if match is None:
            raise ConfigurationError(f"device={device!r} is not a CUDA device; use {_ACCEPTED}")
        return None if match.group(1) is None else int(match.group(1))
    index = getattr(device, "id", None)  # a cupy.cuda.Device: CuPy is imported already
    if type(device).__module__.startswith("cupy") and isinstance(index, int):
        return index
    raise ConfigurationError(f"device={device!r} is not a CUDA device; use {_ACCEPTED}")


def resolve_device(device: object) -> tuple[ModuleType, int]:
    """CuPy and the index of the device that ``device`` names, which must exist.

    Touches no device memory: the CUDA calls here create no context.
    """
    index = parse_device(device)
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken install failing in its own way
        raise ConfigurationError(
            f"device={device!r} needs CuPy, which cannot be imported "
            f"({type(exc).__name__}: {exc}); {INSTALL_HINT}"
        ) from exc
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
        if index is None and count > 0:
            index = int(cupy.cuda.runtime.getDevice())
    except Exception as exc:  # CUDARuntimeError: no driver, driver too old, no device
        raise ConfigurationError(
            f"device={device!r}: CuPy finds no usable CUDA GPU ({type(exc).__name__}: {exc}). "
            "Use device=None for NumPy batches, or check the NVIDIA driver and that the CuPy "
            f"package matches its CUDA version ({INSTALL_HINT})"
        ) from exc
    if count == 0 or index is None:
        raise ConfigurationError(f"device={device!r}: this machine has no CUDA GPU")
    if index >= count:
        raise ConfigurationError(
            f"device={device!r}: there is no CUDA device {index}; this machine has {count} "
            f"(0 … {count - 1})"
        )
    return cupy, index


@dataclass(frozen=True)
class DeviceMemoryStats:
    """Memory held by a layer's device stage (bytes).

    Attributes
    ----------
    device_bytes
        Device memory the stage holds: blocks of live batches plus free blocks kept for reuse.
    device_bytes_in_use
        Blocks of batches not yet freed, in the pipeline or held by the consumer.
    device_bytes_peak
        The most ``device_bytes_in_use`` has been.
    pinned_bytes
        Page-locked host staging buffers.
    """

    device_bytes: int = 0
    device_bytes_in_use: int = 0
    device_bytes_peak: int = 0
    pinned_bytes: int = 0


class _Pinned:
    __slots__ = ("address", "array", "event")

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.address, self.event = array, array.ctypes.data, None

    def wait(self) -> _Pinned:
        """Wait (host) until the copy that read this buffer is done; a no-op when it is."""
        if self.event is not None:
            self.event.synchronize()  # an event, never the device
        return self


def _done(buf: _Pinned) -> bool:
    return buf.event is None or bool(buf.event.done)


class _Staging:
    """Page-locked host buffers that rows are gathered into; reused once their copy is done.

    A buffer is matched to its batch by address when the batch's copy is enqueued; a batch
    that fails half-way gives its buffers back with :meth:`reclaim`.
    """

    def __init__(self, cupy: ModuleType) -> None:
        self._cupy = cupy
        self._free: dict[int, deque[_Pinned]] = {}  # capacity -> buffers, oldest copy first
        self._lent: dict[int, _Pinned] = {}  # address -> buffer handed out, copy not enqueued
        self._count = 0  # buffers owned
        self._cap = 0  # buffers kept: STAGING_DEPTH x the most handed out at once
        self.nbytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        buf = self._pick(nbytes)
        self._lent[buf.address] = buf
        self._cap = max(self._cap, STAGING_DEPTH * len(self._lent))
        return buf.array[:nbytes]

    def _pick(self, nbytes: int) -> _Pinned:
        # Below the cap a buffer whose copy still runs is not waited for: a new one is made.
        full = self._count >= self._cap
        same = self._free.get(nbytes)
        if same and (full or _done(same[0])):
            return same.popleft().wait()
        for size, bufs in self._free.items():  # rare: a short last batch, or a new size
            if size >= nbytes and bufs and (full or _done(bufs[0])):
                return bufs.popleft().wait()
        if full:  # every free buffer is too small: replace the oldest of one size
            for bufs in self._free.values():
                if bufs:
                    self.nbytes -= bufs.popleft().wait().array.nbytes
                    self._count -= 1
                    break
        mem = self._cupy.cuda.PinnedMemory(nbytes)
        self.nbytes += nbytes
        self._count += 1
        return _Pinned(np.ndarray((nbytes,), np.uint8, self._cupy.cuda.PinnedMemoryPointer(mem, 0)))

    def owns(self, array: np.ndarray) -> bool:
        """Whether ``array`` is (a view at the start of) a buffer lent and not yet copied."""
        return array.ctypes.data in self._lent

    def reclaim(self, event: Any) -> None:
        """Every lent buffer goes back, reusable after ``event`` (a batch failed half-way)."""
        for buf in self._lent.values():
            buf.event = event
            self._free.setdefault(buf.array.nbytes, deque()).append(buf)
        self._lent.clear()

    def copied(self, arrays: Iterable[Any], event: Any) -> None:
        """The copies reading ``arrays`` (views of lent buffers) end at ``event``."""
        for a in arrays:
            buf = self._lent.pop(a.ctypes.data, None) if isinstance(a, np.ndarray) else None
            if buf is not None:
                buf.event = event
                self._free.setdefault(buf.array.nbytes, deque()).append(buf)

    def close(self) -> None:
        self._free.clear()
        self._lent.clear()
        self._count = self.nbytes = 0


class _Lease:
    """Owns one device block while arrays use it (CuPy's ``UnownedMemory`` holds the lease)."""

    __slots__ = ("__weakref__", "mem", "pool", "returned", "serial", "size", "stream")

    def __init__(self, pool: _DeviceMemory, mem: Any, size: int, serial: int) -> None:
        self.pool, self.mem, self.size, self.serial = pool, mem, size, serial
        self.stream: Any = None  # the consumer's stream, once handed to it
        self.returned = False

    def give_back(self) -> None:
        if not self.returned:
            self.returned = True
            self.pool.release(self.mem, self.size, self.stream)

    def __del__(self) -> None:  # the last array using the block is gone
        # At interpreter exit CuPy may be half torn down; a finaliser must not raise.
        with contextlib.suppress(Exception):
            self.give_back()


class _DeviceMemory:
    """The stage's caching allocator for device arrays (uploads and transformer outputs).

    CuPy's pool keeps one free list per stream (cupy/cupy#8068): a block the consumer frees after
    using it on its own stream would go back to the upload stream's list, and the next upload
    could overwrite it while the consumer's kernels still read it. Here a block freed after it
    was handed to the consumer waits in ``pending`` until the consumer's next hand-off, which
    records an event on the consumer's stream, in the consumer's thread; the upload stream waits
    on that event before reusing the block (PyTorch's ``record_stream`` idea): no host wait, no
    device synchronisation, and no CUDA call where the last reference happens to drop.
    """

    def __init__(self, cupy: ModuleType, device_id: int, stream: Any) -> None:
        self._cupy, self._device_id, self._stream = cupy, device_id, stream
        self._lock = threading.RLock()  # a release can run inside malloc (GC)
        self._free: dict[int, deque[tuple[Any, Any]]] = {}  # size -> (block, event or None)
        self._pending: list[tuple[Any, int, Any]] = []  # (block, size, consumer stream)
        self._leases: weakref.WeakValueDictionary[int, _Lease] = weakref.WeakValueDictionary()
        self.serial = 0  # which batch is being finished
        self.closed = False
        self.reserved = self.in_use = self.peak = 0

    def malloc(self, size: int) -> Any:
        """CuPy allocator interface: a ``MemoryPointer`` to ``size`` bytes (upload stream)."""
        cp = self._cupy
        size = -(-max(size, 1) // BLOCK_ALIGN) * BLOCK_ALIGN
        with self._lock:
            block = self._take(size)
        if block is None:
            mem = self._cuda_malloc(size)
            with self._lock:
                self.reserved += size
        else:
            mem, event = block
            if event is not None:
                self._stream.wait_event(event)  # the consumer is done with it, in stream order
        lease = _Lease(self, mem, size, self.serial)
        with self._lock:
            self.in_use += size
            self.peak = max(self.peak, self.in_use)
            self._leases[mem.ptr] = lease
        return cp.cuda.MemoryPointer(
            cp.cuda.UnownedMemory(mem.ptr, size, lease, self._device_id), 0
        )

    def _cuda_malloc(self, size: int) -> Any:
        """A new block; out of memory, free what is cached here and in CuPy's pool, then retry."""
        cp = self._cupy
        for attempt in range(3):
            try:
                return cp.cuda.Memory(size)
            except cp.cuda.runtime.CUDARuntimeError as exc:
                if getattr(exc, "status", None) != _CUDA_OUT_OF_MEMORY or attempt == 2:
                    raise
            if attempt == 0:
                self._drop_free()
            else:  # batches nobody refers to any more, and blocks CuPy's own pool caches
                gc.collect()
                self._drop_pending()
                self._drop_free()
                cp.get_default_memory_pool().free_all_blocks()
        raise AssertionError("unreachable")  # pragma: no cover

    def _take(self, size: int) -> tuple[Any, Any] | None:
        blocks = self._free.get(size)
        if not blocks:
            return None
        # A snapshot: a release run by the garbage collector in this thread may append meanwhile.
        for item in list(blocks):  # prefer a block nobody needs to wait for
            if item[1] is None or item[1].done:
                blocks.remove(item)
                return item[0], None
        return blocks.popleft()

    def release(self, mem: Any, size: int, stream: Any) -> None:
        """A lease's last array is gone (any thread, a finaliser too): no CUDA call here."""
        with self._lock:
            self.in_use -= size
            if self.closed:
                self.reserved -= size
            elif stream is None:  # never handed out: used on the upload stream alone
                self._free.setdefault(size, deque()).append((mem, None))
                return
            else:
                self._pending.append((mem, size, stream))
                return
        if stream is not None:  # after close: the consumer's kernels may still read it
            with contextlib.suppress(Exception):
                self._cupy.cuda.Device(self._device_id).synchronize()
        del mem  # cudaFree

    def hand_off(self) -> None:
        """In the consumer's thread: blocks it freed become reusable after its work so far."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        events: dict[int, Any] = {}
        for mem, size, stream in pending:
            event = events.get(id(stream))
            if event is None:
                event = events[id(stream)] = self._cupy.cuda.Event(disable_timing=True)
                stream.record(event)
            with self._lock:
                if not self.closed:
                    self._free.setdefault(size, deque()).append((mem, event))
                    continue
                self.reserved -= size  # closed meanwhile (another thread): free it here
            event.synchronize()
        pending.clear()  # cudaFree of the blocks freed after close

    def leases_of(self, arrays: Iterable[Any]) -> list[_Lease]:
        """The leases of the blocks that ``arrays`` live in (those from this allocator)."""
        mems = (getattr(getattr(a, "data", None), "mem", None) for a in arrays)
        ptrs = (getattr(mem, "ptr", None) for mem in mems)
        found = (self._leases.get(ptr) for ptr in ptrs if isinstance(ptr, int))
        return [lease for lease in found if lease is not None]

    def _drop_pending(self) -> None:
        """Free the blocks the consumer freed since the last hand-off, once the device is idle."""
        with self._lock:
            pending, self._pending = self._pending, []
            self.reserved -= sum(size for _, size, _ in pending)
        if pending:  # used on the consumer's streams, with no event yet
            self._cupy.cuda.Device(self._device_id).synchronize()
        pending.clear()

    def _drop_free(self) -> None:
        """Free the cached blocks, once the work that used them is done."""
        with self._lock:
            dropped, self._free = self._free, {}
            self.reserved -= sum(size * len(blocks) for size, blocks in dropped.items())
        if not dropped:
            return
        # Outside the lock: waits on the GPU, and cudaFree may synchronise. Blocks last used on
        # the upload stream (transformer temporaries) wait for it; the others for the consumer.
        self._stream.synchronize()
        for blocks in dropped.values():
            for _, event in blocks:
                if event is not None:
                    event.synchronize()
        dropped.clear()

    def close(self) -> None:
        """Free every cached and pending block (after the device is idle, if any is pending)."""
        with self._lock:
            self.closed = True
        self._drop_pending()
        self._drop_free()


class _DeviceData(dict[str, Any]):
    """A device batch's arrays, with the event they are ready at and their blocks' leases."""

    __slots__ = ("__weakref__", "event", "leases", "serial")
    event: Any
    leases: list[_Lease]
    serial: int


class _Resources:
    """What the stage allocates on first use: stream, staging, allocator."""

    def __init__(self, cupy: ModuleType, index: int) -> None:
        self.device = cupy.cuda.Device(index)
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)  # never waits for the null stream
        self.staging = _Staging(cupy)
        self.memory = _DeviceMemory(cupy, index, self.stream)
        self._event = cupy.cuda.Event

    def record(self, *, block: bool = False) -> Any:
        """An event at the upload stream's current end (``block``: host waits on it sleep)."""
        event = self._event(block=block, disable_timing=True)
        self.stream.record(event)
        return event


class CudaDelivery:
    """Uploads gathered batches to a CUDA device and runs the transformers there.

    Parameters
    ----------
    device
        ``"cuda"`` (the current device), ``"cuda:N"``, an int ``N`` or a ``cupy.cuda.Device``.
    transformers
        ``(top, callable)`` pairs, run on the device arrays on the upload stream.
    batch_size, prefetch
        The layer's; they bound the batches in flight.
    reuse_buffers
        Recycle a batch's device blocks as soon as the next batch is yielded, even if the
        consumer still holds the arrays: the consumer promises to be done with a batch (on the
        stream it was yielded on) when it asks for the next.

    Raises
    ------
    ConfigurationError
        CuPy is missing, there is no GPU, or ``device`` names none. Nothing is allocated on the
        device before the first batch.
    """

    def __init__(
        self,
        device: object,
        transformers: Sequence[tuple[str, Transformer]],
        batch_size: int,
        prefetch: int,
        *,
        reuse_buffers: bool = False,
    ) -> None:
        self._cupy, self.device_id = resolve_device(device)
        self._device = self._cupy.cuda.Device(self.device_id)  # an id only: no context yet
        self.transformers = list(transformers)
        self.batch_size, self.prefetch = batch_size, prefetch
        self.reuse_buffers = reuse_buffers
        self._lock = threading.Lock()
        self._gpu: _Resources | None = None
        self._memory: _DeviceMemory | None = None  # kept after close, for the stats
        self._yielded: weakref.ReferenceType[_DeviceData] | None = None
        self._tops: list[TopInfo] = []

    # --- the Delivery protocol ----------------------------------------------------------------

    def start(self, tops: Mapping[str, TopInfo], group_rows: int, depth: int) -> None:
        """Staging is allocated per batch, on first use (page-locked memory is reused)."""
        self._tops = list(tops.values())

    def make(
        self, specs: Sequence[BatchSpec], stats: GatherStats, helper: Executor | None
    ) -> tuple[list[Batch], Exception | None]:
        """Each batch is gathered into its own staging buffers and its upload queued at once,
        so copies start early; a failure (staging, upload, transformer) keeps the complete
        batches before it, and gives the failed batch's buffers back."""
        out: list[Batch] = []
        for spec in specs:
            t0 = time.perf_counter()
            try:
                staging = {
                    t.name: self.alloc((spec.rows, *t.sample_shape), t.dtype) for t in self._tops
                }
                indices = np.empty(spec.rows, np.int64)
                gather_rows(spec.pieces, staging, indices)
                t1 = time.perf_counter()
                data = self.finish(dict(staging), indices, spec.epoch)
            except Exception as exc:
                self.abandon()
                return out, exc
            stats.gather_seconds += t1 - t0
            stats.transform_seconds += time.perf_counter() - t1
            out.append(Batch(data, indices, spec.epoch))
        return out, None

    def hand_off(self, batch: Batch) -> None:
        """See :meth:`ready`."""
        self.ready(batch)

    def memory(self) -> dict[str, int]:
        return asdict(self.memory_stats)

    # --- the stage's own work -----------------------------------------------------------------

    def _open(self) -> _Resources:
        gpu = self._gpu
        if gpu is None:
            gpu = self._gpu = _Resources(self._cupy, self.device_id)
            self._memory = gpu.memory
        return gpu

    @contextlib.contextmanager
    def _failures(self, what: str, *, pinned: bool = False) -> Iterator[None]:
        """Turn a CUDA error or an out-of-memory into :class:`~asynchdf5.DeviceError`.

        The message says what was being done and, out of memory, what the layer holds. Anything
        else (a bug) passes unchanged.
        """
        cuda = self._cupy.cuda
        try:
            yield
        except (cuda.runtime.CUDARuntimeError, cuda.driver.CUDADriverError, MemoryError) as exc:
            hint = ""
            if getattr(exc, "status", None) == _CUDA_OUT_OF_MEMORY or isinstance(exc, MemoryError):
                stats = self.memory_stats
                if pinned:
                    hint = (
                        f"; out of page-locked host memory, the layer holds {stats.pinned_bytes} "
                        "bytes of it: lower batch_size, or check the memory lock limit (ulimit -l)"
                    )
                else:
                    hint = (
                        f"; the layer holds {stats.device_bytes} bytes of device memory, "
                        f"{stats.device_bytes_in_use} in batches not yet freed (in flight or held "
                        "by you): hold fewer batches, or lower prefetch or batch_size, or set "
                        "reuse_buffers=True"
                    )
            raise DeviceError(
                f"{what} on CUDA device {self.device_id} failed: {type(exc).__name__}: {exc}{hint}"
            ) from exc

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """Pinned host memory for one top of the batch being gathered."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        what = f"allocating {nbytes} bytes of pinned host memory for rows of shape {shape}"
        with self._lock, self._failures(what, pinned=True):
            gpu = self._open()
            with gpu.device:
                raw = gpu.staging.take(nbytes)
        return raw.view(dtype).reshape(shape)

    def finish(self, data: dict[str, Any], indices: np.ndarray, epoch: int) -> dict[str, Any]:
        """Enqueue the batch's copies and transformers on the upload stream; no waiting."""
        cp = self._cupy
        with self._lock:
            gpu = self._open()
            memory = gpu.memory
            with gpu.device, gpu.stream, cp.cuda.using_allocator(memory.malloc):
                memory.serial += 1
                out = _DeviceData()
                staged = []
                rows = len(indices)
                batch = (
                    f"a batch of {rows} rows, first global index "
                    f"{int(indices[0]) if rows else None}, epoch {epoch}"
                )
                for name, host in data.items():
                    what = f"uploading top {name!r} ({host.nbytes} bytes, {batch})"
                    with self._failures(what, pinned=not gpu.staging.owns(host)):
                        if host.nbytes:
                            host = self._pinned(gpu.staging, host)
                            staged.append(host)
                    with self._failures(what):
                        dev = cp.empty(host.shape, host.dtype.newbyteorder("="))
                        if host.nbytes:
                            dev.data.copy_from_host_async(host.ctypes.data, host.nbytes, gpu.stream)
                    out[name] = dev
                with self._failures(f"queueing the copies of {batch}"):
                    gpu.staging.copied(staged, gpu.record(block=True))
                apply_transformers(out, self.transformers, epoch, indices)
                with self._failures(f"queueing the transformers of {batch}"):
                    out.event = gpu.record()
                out.leases = memory.leases_of(out.values())
                out.serial = memory.serial
        return out

    def abandon(self) -> None:
        """The batch being gathered or finished failed: its staging buffers go back (no wait)."""
        with self._lock:
            gpu = self._gpu
            if gpu is not None:
                with gpu.device, contextlib.suppress(Exception):
                    gpu.staging.reclaim(gpu.record(block=True))

    @staticmethod
    def _pinned(staging: _Staging, host: np.ndarray) -> np.ndarray:
        """``host`` in a pinned staging buffer, C-contiguous and in native byte order.

        Rows are gathered into staging already; anything else is copied in, since an async copy
        from pageable memory may still read it after the call returns.
        """
        if not staging.owns(host) or not host.flags.c_contiguous:
            pinned = staging.take(host.nbytes).view(host.dtype).reshape(host.shape)
            pinned[...] = host
            host = pinned
        if not host.dtype.isnative:  # CuPy has no byte-swapped dtypes: swap in place
            host = host.byteswap(inplace=True).view(host.dtype.newbyteorder("="))
        return host

    def check(self, tops: Mapping[str, TopInfo]) -> None:
        """Raise :class:`~asynchdf5.SchemaError` for a top CuPy cannot hold (before any batch)."""
        for name, top in tops.items():
            dtype = top.dtype
            if dtype.char in "gG":  # long double: no CUDA type, no DLPack type
                raise SchemaError(
                    f"top {name!r} has dtype {dtype} (long double), which CuPy cannot hold on "
                    "the device; cast it in the file, or use device=None"
                )

    def ready(self, batch: Batch) -> None:
        """Hand ``batch`` to the calling thread: its current stream waits for the upload.

        Runs in the consumer's thread, right before the batch is yielded: blocks the consumer
        freed since the last hand-off get their event on its stream here.
        """
        data = batch._data
        if not isinstance(data, _DeviceData):
            return
        with self._device, self._failures("handing a batch to the consumer's stream"):
            stream = self._cupy.cuda.get_current_stream()
            stream.wait_event(data.event)
            for lease in data.leases:
                lease.stream = stream
            if self.reuse_buffers:
                previous = self._yielded() if self._yielded is not None else None
                if previous is not None and previous is not data:
                    for lease in previous.leases:
                        if lease.serial == previous.serial:  # made for it, not a constant
                            lease.give_back()
                self._yielded = weakref.ref(data)
            if self._memory is not None:
                self._memory.hand_off()

    @property
    def memory_stats(self) -> DeviceMemoryStats:
        """Device and pinned memory held now (see :class:`DeviceMemoryStats`)."""
        mem, gpu = self._memory, self._gpu
        if mem is None:
            return DeviceMemoryStats()
        pinned = gpu.staging.nbytes if gpu is not None else 0
        return DeviceMemoryStats(mem.reserved, mem.in_use, mem.peak, pinned)

    def close(self) -> None:
        """Free the staging buffers and the free device blocks; blocks in use go when freed."""
        with self._lock:
            gpu, self._gpu = self._gpu, None
            self._yielded = None
            if gpu is None:
                return
            with gpu.device:
                gpu.stream.synchronize()  # copies still reading staging (this stream only)
                gpu.staging.close()
                gpu.memory.close()
