"""A stand-in for CuPy over host memory, for the tests of the GPU stage (``device=``).

What it imitates: the parts of CuPy that the stage (``asynchdf5._delivery._cuda`` and
``_cuda_memory``) and ``asynchdf5.transforms`` use, with CuPy's names and call shapes (held to the
installed CuPy by ``test_gpu.test_stand_in_matches_real_cupy_api``): the device count and
``CUDARuntimeError`` of ``cupy.cuda.runtime``, ``Device``, ``Stream`` (a context manager that
makes it the thread's current stream), ``Event``, device memory (``Memory``, ``UnownedMemory``,
``MemoryPointer``), page-locked host memory (``PinnedMemory``), ``using_allocator``, the default
memory pool's ``free_all_blocks``, and ``cupy.ndarray`` with the few array functions used
(``empty``, ``asarray``, ``ascontiguousarray``, ``multiply``, ``subtract``, and for the padding
of ragged batches ``full``, ``arange``, ``searchsorted``, ``minimum``, ``where``), and
``cupyx.scipy.sparse.csr_matrix`` (``FakeCsrMatrix``: the sparse tops' batches).

How: "device" memory is host bytes whose address stands for the device pointer, and a "device"
array is a NumPy array over it (``FakeArray``, which says its module is ``cupy``). Pinned
buffers are host bytes registered while alive: a host-to-device copy asserts that it reads
pinned memory and that its stream is the current one in its thread. An event is done once
recorded on a stream that is not ``busy`` (a busy stream stands for queued kernels that never
finish). Streams keep the events recorded on them and those they waited for; an event keeps
the thread that recorded it. Knobs and counters for the tests: ``FakeCupy.device_count``,
``FakeMemory.capacity`` (blocks before "out of memory"), ``FakeMemory.created``,
``FakePinnedMemory.created``, ``FakeDevice.synchronized``, ``fake_blocks()``, and the pool's
``freed``.

What it does not imitate: nothing runs asynchronously or on a device. Copies happen at once,
``synchronize`` only takes note, and there is no ordering between streams, no race, no kernel,
no real memory limit. So it checks the stage's control flow and bookkeeping (which event is
recorded or waited for on which stream and in which thread; when staging buffers and device
blocks are reused, freed and counted; which failure becomes which error), not CUDA semantics:
those are for the ``gpu``-marked tests in ``test_gpu``, on a real GPU.

``FakeCupy.upload_fails``: a host-to-device copy of that many bytes raises a CUDA error (an
upload that fails). ``FAKE`` is the stand-in in use (streams entered as context managers push
onto its per-thread stack); the ``fake_cupy`` fixture replaces it, and ``sys.modules["cupy"]``
(``cupyx`` too), for each test.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np


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
        if size == FAKE.upload_fails:
            raise FakeCUDARuntimeError(700)  # cudaErrorIllegalAddress
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


class FakeCsrMatrix:
    """``cupyx.scipy.sparse.csr_matrix`` built from ``(data, indices, indptr)`` device arrays,
    with CuPy's checks (1-D arrays, the value dtypes cuSPARSE holds, ``indptr`` of rows + 1)."""

    def __init__(self, arg1: Any, shape: Any = None, dtype: Any = None, copy: bool = False) -> None:
        data, indices, indptr = arg1
        for a in arg1:
            if not isinstance(a, FakeArray) or a.ndim != 1:
                raise ValueError("data, indices, and indptr must be 1-D cupy arrays")
        if np.dtype(data.dtype) not in {np.dtype(t) for t in ("?", "f4", "f8", "c8", "c16")}:
            raise ValueError("Only bool, float32, float64, complex64 and complex128 are supported")
        if len(data) != len(indices) or len(indptr) != shape[0] + 1:
            raise ValueError("inconsistent sizes")
        self.data, self.indices, self.indptr = data, indices, indptr
        self.shape = tuple(shape)
        self.dtype = data.dtype

    def toarray(self, order: Any = None, out: Any = None) -> FakeArray:
        import scipy.sparse

        host = scipy.sparse.csr_array(
            (self.data.get(), self.indices.get(), self.indptr.get()), shape=self.shape
        ).toarray()
        return FAKE.asarray(host)


FakeCsrMatrix.__module__ = "cupyx.scipy.sparse._csr"


class FakeCupy:
    """The parts of CuPy the stage and the transforms use."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.null = FakeStream(name="null")
        self.device_count = 1
        self.upload_fails: int | None = None
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
        fake.minimum = self.ufunc(np.minimum)  # type: ignore[attr-defined]
        fake.full = self.full  # type: ignore[attr-defined]
        fake.arange = self.arange  # type: ignore[attr-defined]
        fake.searchsorted = self.searchsorted  # type: ignore[attr-defined]
        fake.where = self.where  # type: ignore[attr-defined]
        return fake

    def modules(self) -> dict[str, types.ModuleType]:
        """``cupy``, and ``cupyx`` down to ``cupyx.scipy.sparse``, as ``sys.modules`` holds them."""
        sparse = types.ModuleType("cupyx.scipy.sparse")
        sparse.csr_matrix = FakeCsrMatrix  # type: ignore[attr-defined]
        scipy_ = types.ModuleType("cupyx.scipy")
        scipy_.sparse = sparse  # type: ignore[attr-defined]
        cupyx = types.ModuleType("cupyx")
        cupyx.scipy = scipy_  # type: ignore[attr-defined]
        return {
            "cupy": self.module(),
            "cupyx": cupyx,
            "cupyx.scipy": scipy_,
            "cupyx.scipy.sparse": sparse,
        }

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

    def _device(self, host: np.ndarray) -> FakeArray:
        out = self.empty(host.shape, host.dtype)
        out.view(np.ndarray)[...] = host
        return out

    def full(self, shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> FakeArray:
        return self._device(np.full(shape, fill_value, dtype=dtype))

    def arange(self, start: Any, stop: Any = None, step: Any = 1, dtype: Any = None) -> FakeArray:
        return self._device(np.arange(start, stop, step, dtype=dtype))

    def searchsorted(self, a: Any, v: Any, side: str = "left", sorter: Any = None) -> FakeArray:
        host = np.searchsorted(np.asarray(a), np.asarray(v), side=side)  # type: ignore[call-overload]
        return self._device(host)

    def where(self, condition: Any, x: Any = None, y: Any = None) -> FakeArray:
        return self._device(np.where(np.asarray(condition), np.asarray(x), np.asarray(y)))

    def ufunc(self, fn: np.ufunc) -> Callable[..., FakeArray]:
        def apply(x1: Any, x2: Any, /, *, dtype: Any = None) -> FakeArray:
            a, b = np.asarray(x1), np.asarray(x2)
            out = self.empty(np.broadcast_shapes(a.shape, b.shape), dtype or np.result_type(a, b))
            fn(a, b, out=out.view(np.ndarray), dtype=dtype)
            return out

        return apply


FAKE = FakeCupy()
