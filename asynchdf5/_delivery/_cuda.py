"""CUDA delivery (``device=``): batches become CuPy arrays while the consumer trains.

The delivery is the last stage of the pipeline::

    gather thread:   rows ─▶ pinned staging ─▶ async copy ─▶ transformers ─▶ event  (upload stream)
    consumer thread: ready(batch): the consumer's current stream waits on that event

* Rows are gathered straight into page-locked host buffers, allocated once and reused when the
  copy that reads them is done (the gather thread waits on that copy's event, if at all).
* Copies and transformers run on the stage's own non-blocking stream; the consumer's stream
  waits on an event. Nothing in the hot path synchronises the device.
* A ragged top's values (and a sparse top's column indices) are gathered into staging too,
  sized by the bound the cache's heaps use (the values of the longest rows a batch could
  hold), so that the buffers of every batch are the same size and reused; the rows' offsets
  are copied into staging. On the device they become an :class:`~asynchdf5.Ragged` of CuPy
  arrays, or a ``cupyx.scipy.sparse.csr_matrix``.
* Device arrays come from :class:`DeviceMemory`, which reuses a block the consumer has freed only
  once the consumer's stream has passed the point where it was freed. That point is recorded in
  the consumer's thread, at the next hand-off: no CUDA call runs in a finaliser or in whatever
  thread happens to drop the last reference (with per-thread default streams, a stream handle
  means a different stream in each thread).

CuPy is imported inside functions only, so importing asynchdf5 never imports it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .._batch import Batch
from .._catalog import TopInfo
from .._errors import DeviceError, SchemaError
from .._gather import gather_ragged, gather_split
from .._ragged import Ragged, sparse_module
from .._ragged_tops import RaggedInfo
from .._specs import GroupSpec, Piece
from .._stats import GatherStats
from .._transform import apply_transformers
from ..transforms import Transformer
from ._cuda_memory import (
    CUDA_OUT_OF_MEMORY,
    DeviceData,
    DeviceMemory,
    Resources,
    Staging,
)
from ._device import resolve_device

if TYPE_CHECKING:  # a type only: the configuration imports this package (parse_device)
    from .._config import LayerConfig

__all__ = ["SPARSE_DTYPES", "CudaDelivery", "DeviceMemoryStats", "device_arrays"]

#: The value dtypes a CuPy sparse matrix holds (``cupyx.scipy.sparse``; cuSPARSE's types).
SPARSE_DTYPES = frozenset(np.dtype(t) for t in ("?", "f4", "f8", "c8", "c16"))


class _HostRagged(NamedTuple):
    """A ragged top's batch gathered on the host: its offsets (int64, rows + 1, from 0) and
    its heaps (values, and a sparse top's column indices) in staging, to upload."""

    offsets: np.ndarray
    heaps: list[np.ndarray]
    info: RaggedInfo


def device_arrays(values: Iterable[Any]) -> Iterator[Any]:
    """The arrays a batch's values hold: an array itself, a :class:`~asynchdf5.Ragged`'s values
    and offsets, a sparse matrix's ``data``, ``indices`` and ``indptr`` (whose device blocks the
    batch's leases must cover)."""
    for v in values:
        if isinstance(v, Ragged):
            yield v.values
            yield v.offsets
        elif hasattr(v, "indptr"):  # a sparse matrix (what lacks an array has no block)
            yield getattr(v, "data", None)
            yield getattr(v, "indices", None)
            yield v.indptr
        else:
            yield v


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

    #: Batches are staged and uploaded one by one: a group only bounds what is in flight, and
    #: device memory (docs/gpu.md) grows with it.
    group_batches = 16
    #: CuPy and the CUDA driver run in the gather threads (and the transformers, if any).
    runs_user_code = True

    @classmethod
    def for_layer(cls, config: LayerConfig) -> CudaDelivery:
        """The delivery of a layer whose ``device`` is set."""
        return cls(
            config.device,
            config.transformers,
            config.batch_size,
            config.prefetch,
            reuse_buffers=config.reuse_buffers,
        )

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
        self._gpu: Resources | None = None
        self._memory: DeviceMemory | None = None  # kept after close, for the stats
        self._yielded: weakref.ReferenceType[DeviceData] | None = None
        self._tops: list[TopInfo] = []
        self._by_name: dict[str, TopInfo] = {}

    # --- the Delivery protocol ----------------------------------------------------------------

    def start(
        self,
        tops: Mapping[str, TopInfo],
        group_rows: int,
        depth: int,
        offsets: Mapping[str, int] | None = None,
    ) -> None:
        """Staging is allocated per batch, on first use (page-locked memory is reused; it is
        page-aligned, like the cache slots, so ``offsets`` are not needed)."""
        self._tops = list(tops.values())
        self._by_name = dict(tops)

    @property
    def concurrent(self) -> bool:
        """Without transformers, groups are staged on two threads at once (the copy into
        page-locked memory is the stage's cost; one thread's is slower than the upload) and
        queued on the one upload stream under a lock. A transformer is never called from two
        threads: with transformers one thread stages every group, in order."""
        return not self.transformers

    @property
    def per_batch(self) -> bool:
        """Transformed batches go to the consumer one by one, as each is queued."""
        return bool(self.transformers)

    def make(
        self,
        group: GroupSpec,
        stats: GatherStats,
        helper: Executor | None,
        emit: Callable[[Batch], None] | None = None,
    ) -> tuple[list[Batch], Exception | None]:
        """Each batch is gathered into its own staging buffers (a large one in halves, one on
        ``helper``'s thread: one thread's copies are slower than the upload) and its upload
        queued at once, so copies start early; a failure (staging, upload, transformer) keeps
        the complete batches before it, and gives the failed batch's buffers back. ``emit``
        gets each batch once its upload and transformers are queued (and the returned list
        leaves it out)."""
        out: list[Batch] = []
        each = group.batch_tops()  # streams of different schemas (:mod:`.._schemas`)
        tops, names = self._tops, None
        for i, (pieces, size, epoch) in enumerate(
            zip(group.batch_pieces(), group.sizes, group.epochs, strict=True)
        ):
            if each is not None:  # the batch's schema: its arrays only
                names = each[i]
                tops = [self._by_name[internal] for internal in names.values()]
            t0 = time.perf_counter()
            staging: dict[str, np.ndarray] = {}  # by internal top
            heaps: list[np.ndarray] = []  # ragged tops' staging buffers (whole)
            try:
                for t in tops:
                    if t.ragged is None:
                        staging[t.name] = self.alloc((size, *t.sample_shape), t.dtype)
                indices = np.empty(size, np.int64)
                gather_split(pieces, staging, indices, helper)
                ragged = {
                    t.name: self._gather_ragged(pieces, t, size, heaps)
                    for t in tops
                    if t.ragged is not None
                }
                for name, got in ragged.items():
                    if got.info.sparse:
                        got.info.check_columns(name, got.heaps[1], got.offsets, indices)
                gathered: dict[str, Any] = {  # in the tops' order, whatever their kind
                    t.name: staging[t.name] if t.ragged is None else ragged[t.name] for t in tops
                }
                t1 = time.perf_counter()
                host = (
                    gathered
                    if names is None
                    else {top: gathered[internal] for top, internal in names.items()}
                )
                data = self.finish(host, indices, epoch)
            except Exception as exc:
                self.abandon([*staging.values(), *heaps])
                return out, exc
            stats.gather_seconds += t1 - t0
            stats.transform_seconds += time.perf_counter() - t1
            batch = Batch(data, indices, epoch)
            if emit is None:
                out.append(batch)
                continue
            try:
                emit(batch)
            except Exception as exc:  # not handed over: not among those made
                return out, exc
            del batch, data  # handed over: the consumer holds the only reference
        return out, None

    def hand_off(self, batch: Batch) -> None:
        """See :meth:`ready`."""
        self.ready(batch)

    def memory(self) -> dict[str, int]:
        return asdict(self.memory_stats)

    # --- the stage's own work -----------------------------------------------------------------

    def _open(self) -> Resources:
        gpu = self._gpu
        if gpu is None:
            gpu = self._gpu = Resources(self._cupy, self.device_id)
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
            if getattr(exc, "status", None) == CUDA_OUT_OF_MEMORY or isinstance(exc, MemoryError):
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

    def _gather_ragged(
        self, pieces: Sequence[Piece], top: TopInfo, rows: int, lent: list[np.ndarray]
    ) -> _HostRagged:
        """Ragged ``top``'s rows of the batch, values gathered straight into staging.

        Each heap's staging buffer holds the values of the ``rows`` longest rows of the data
        set (:meth:`RaggedInfo.heap_rows`, the bound the cache's heaps use), whatever this
        batch holds: every batch asks for buffers of one size, which are then reused. The
        buffers are appended to ``lent`` (given back if the batch fails)."""
        info = top.ragged
        assert info is not None
        bound = info.heap_rows(rows)

        def empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
            whole = self.alloc((max(bound, shape[0]), *shape[1:]), dtype)
            lent.append(whole)
            return whole[: shape[0]]

        offsets, heaps = gather_ragged(pieces, top.name, info.sparse, empty)
        return _HostRagged(offsets, heaps, info)

    def finish(self, data: dict[str, Any], indices: np.ndarray, epoch: int) -> dict[str, Any]:
        """Enqueue the batch's copies and transformers on the upload stream; no waiting."""
        cp = self._cupy
        with self._lock:
            gpu = self._open()
            memory = gpu.memory
            with gpu.device, gpu.stream, cp.cuda.using_allocator(memory.malloc):
                memory.serial += 1
                out = DeviceData()
                staged: list[np.ndarray] = []
                rows = len(indices)
                batch = (
                    f"a batch of {rows} rows, first global index "
                    f"{int(indices[0]) if rows else None}, epoch {epoch}"
                )
                try:
                    for name, host in data.items():
                        if isinstance(host, _HostRagged):
                            out[name] = self._upload_ragged(gpu, name, host, staged, batch)
                        else:
                            out[name] = self._upload(gpu, f"top {name!r}", host, staged, batch)
                except BaseException:  # staging of this batch copied into: back, no wait
                    with contextlib.suppress(Exception):
                        gpu.staging.reclaim(gpu.record(block=True), staged)
                    raise
                with self._failures(f"queueing the copies of {batch}"):
                    gpu.staging.copied(staged, gpu.record(block=True))
                apply_transformers(out, self.transformers, epoch, indices)
                with self._failures(f"queueing the transformers of {batch}"):
                    out.event = gpu.record()
                out.leases = memory.leases_of(device_arrays(out.values()))
                out.serial = memory.serial
        return out

    def _upload(
        self, gpu: Resources, what: str, host: np.ndarray, staged: list[np.ndarray], batch: str
    ) -> Any:
        """Queue the copy of ``host`` into a new device array (on the upload stream, the
        allocator current); the staging it is read from is added to ``staged``."""
        cp = self._cupy
        what = f"uploading {what} ({host.nbytes} bytes, {batch})"
        owned = gpu.staging.owns(host)
        with self._failures(what, pinned=not owned):
            if host.nbytes:
                host = self._pinned(gpu.staging, host)
            if host.nbytes or owned:  # an empty view of a buffer goes back too
                staged.append(host)
        with self._failures(what):
            dev = cp.empty(host.shape, host.dtype.newbyteorder("="))
            if host.nbytes:
                dev.data.copy_from_host_async(host.ctypes.data, host.nbytes, gpu.stream)
        return dev

    def _upload_ragged(
        self, gpu: Resources, name: str, host: _HostRagged, staged: list[np.ndarray], batch: str
    ) -> Any:
        """A ragged top's batch on the device: a :class:`~asynchdf5.Ragged` of CuPy arrays
        (int64 offsets), or a sparse top's ``cupyx.scipy.sparse.csr_matrix``."""
        info, offsets = host.info, host.offsets
        values = self._upload(gpu, f"the values of top {name!r}", host.heaps[0], staged, batch)
        if not info.sparse:
            dev_offsets = self._upload(gpu, f"the offsets of top {name!r}", offsets, staged, batch)
            return Ragged._trusted(values, dev_offsets)
        index = host.heaps[1]
        if index.dtype.itemsize < offsets.dtype.itemsize and int(offsets[-1]) < 2**31 - 1:
            offsets = offsets.astype(index.dtype)  # one index dtype: CuPy converts none
        columns = self._upload(gpu, f"the column indices of top {name!r}", index, staged, batch)
        indptr = self._upload(gpu, f"the offsets of top {name!r}", offsets, staged, batch)
        with self._failures(f"making the sparse matrix of top {name!r} ({batch})"):
            return self._sparse(name).csr_matrix(
                (values, columns, indptr), shape=(len(offsets) - 1, info.n_cols)
            )

    def _sparse(self, top: str) -> Any:
        """``cupyx.scipy.sparse``, imported at open for sparse-matrix top ``top``
        (:meth:`check`: no batch waits for the import; a named error where it cannot be)."""
        return sparse_module(
            top, "cupyx.scipy.sparse", "check the CuPy install, or use device=None"
        )

    def abandon(self, staging: Iterable[np.ndarray]) -> None:
        """The batch being gathered or finished failed: its ``staging`` buffers go back (no
        wait); those of a batch another thread gathers stay lent to it."""
        with self._lock:
            gpu = self._gpu
            if gpu is not None:
                with gpu.device, contextlib.suppress(Exception):
                    gpu.staging.reclaim(gpu.record(block=True), staging)

    @staticmethod
    def _pinned(staging: Staging, host: np.ndarray) -> np.ndarray:
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
        """Raise :class:`~asynchdf5.SchemaError` for a top CuPy cannot hold (before any batch);
        import ``cupyx.scipy.sparse`` for a sparse-matrix top (blocking: :meth:`_sparse`)."""
        for name, top in tops.items():
            if top.ragged is not None and top.ragged.sparse:
                if top.dtype not in SPARSE_DTYPES:
                    raise SchemaError(
                        f"top {name!r} is a sparse matrix of {top.dtype} values, which a CuPy "
                        "sparse matrix (cupyx.scipy.sparse) cannot hold: it holds bool, "
                        "float32, float64, complex64 or complex128 values; store the matrix's "
                        "'data' as float32, or use device=None"
                    )
                self._sparse(name)
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
        if not isinstance(data, DeviceData):
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
