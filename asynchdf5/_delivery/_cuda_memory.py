"""Memory of the CUDA delivery: page-locked staging buffers and the caching device allocator.

* :class:`Staging`: page-locked host buffers that rows are gathered into, reused once the copy
  that reads them is done (the gather thread waits on that copy's event, if at all).
* :class:`DeviceMemory`: the delivery's allocator for device arrays, which reuses a block the
  consumer has freed only once the consumer's stream has passed the point where it was freed.
  That point is recorded in the consumer's thread, at the next hand-off: no CUDA call runs in a
  finaliser or in whatever thread happens to drop the last reference (with per-thread default
  streams, a stream handle means a different stream in each thread).

CuPy is passed in, never imported here.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections import deque
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "BLOCK_ALIGN",
    "CUDA_OUT_OF_MEMORY",
    "STAGING_DEPTH",
    "DeviceData",
    "DeviceMemory",
    "Lease",
    "Resources",
    "Staging",
]

#: Batches staged in pinned memory per batch being gathered: that one, one whose copies run.
STAGING_DEPTH = 2
#: Device blocks are rounded up to this many bytes, so that batches of one shape share blocks.
BLOCK_ALIGN = 512
#: ``cudaErrorMemoryAllocation``: what ``cudaMalloc`` (``cupy.cuda.Memory``) fails with.
CUDA_OUT_OF_MEMORY = 2


class Pinned:
    __slots__ = ("address", "array", "event")

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.address, self.event = array, array.ctypes.data, None

    def wait(self) -> Pinned:
        """Wait (host) until the copy that read this buffer is done; a no-op when it is."""
        if self.event is not None:
            self.event.synchronize()  # an event, never the device
        return self


def _done(buf: Pinned) -> bool:
    return buf.event is None or bool(buf.event.done)


class Staging:
    """Page-locked host buffers that rows are gathered into; reused once their copy is done.

    A buffer is matched to its batch by address when the batch's copy is enqueued; a batch
    that fails half-way gives its buffers back with :meth:`reclaim`.
    """

    def __init__(self, cupy: ModuleType) -> None:
        self._cupy = cupy
        self._free: dict[int, deque[Pinned]] = {}  # capacity -> buffers, oldest copy first
        self._lent: dict[int, Pinned] = {}  # address -> buffer handed out, copy not enqueued
        self._count = 0  # buffers owned
        self._cap = 0  # buffers kept: STAGING_DEPTH x the most handed out at once
        self.nbytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        buf = self._pick(nbytes)
        self._lent[buf.address] = buf
        self._cap = max(self._cap, STAGING_DEPTH * len(self._lent))
        return buf.array[:nbytes]

    def _pick(self, nbytes: int) -> Pinned:
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
        return Pinned(np.ndarray((nbytes,), np.uint8, self._cupy.cuda.PinnedMemoryPointer(mem, 0)))

    def owns(self, array: np.ndarray) -> bool:
        """Whether ``array`` is (a view at the start of) a buffer lent and not yet copied."""
        return array.ctypes.data in self._lent

    def reclaim(self, event: Any, arrays: Iterable[Any] | None = None) -> None:
        """The lent buffers of ``arrays`` (a batch that failed half-way; default: every lent
        buffer) go back, reusable after ``event``. Another thread's batch keeps its own."""
        if arrays is None:
            bufs = list(self._lent.values())
            self._lent.clear()
        else:
            found = (self._lent.pop(a.ctypes.data, None) for a in arrays)
            bufs = [buf for buf in found if buf is not None]
        for buf in bufs:
            buf.event = event
            self._free.setdefault(buf.array.nbytes, deque()).append(buf)

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


class Lease:
    """Owns one device block while arrays use it (CuPy's ``UnownedMemory`` holds the lease)."""

    __slots__ = ("__weakref__", "mem", "pool", "returned", "serial", "size", "stream")

    def __init__(self, pool: DeviceMemory, mem: Any, size: int, serial: int) -> None:
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


class DeviceMemory:
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
        self._leases: weakref.WeakValueDictionary[int, Lease] = weakref.WeakValueDictionary()
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
        lease = Lease(self, mem, size, self.serial)
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
                if getattr(exc, "status", None) != CUDA_OUT_OF_MEMORY or attempt == 2:
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

    def leases_of(self, arrays: Iterable[Any]) -> list[Lease]:
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


class DeviceData(dict[str, Any]):
    """A device batch's arrays, with the event they are ready at and their blocks' leases."""

    __slots__ = ("__weakref__", "event", "leases", "serial")
    event: Any
    leases: list[Lease]
    serial: int


class Resources:
    """What the stage allocates on first use: stream, staging, allocator."""

    def __init__(self, cupy: ModuleType, index: int) -> None:
        self.device = cupy.cuda.Device(index)
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)  # never waits for the null stream
        self.staging = Staging(cupy)
        self.memory = DeviceMemory(cupy, index, self.stream)
        self._event = cupy.cuda.Event

    def record(self, *, block: bool = False) -> Any:
        """An event at the upload stream's current end (``block``: host waits on it sleep)."""
        event = self._event(block=block, disable_timing=True)
        self.stream.record(event)
        return event
