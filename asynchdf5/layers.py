"""The layers: :class:`AsyncHDF5DataLayer`, :class:`MemoryDataLayer` and the sync facade
:class:`HDF5DataLayer`."""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import anyio.to_thread  # imported lazily by anyio: at import time here, not on the event loop
import numpy as np
from anyio.abc import TaskGroup
from anyio.from_thread import BlockingPortal, start_blocking_portal

from ._batch import Batch, LoadedChunk, Transformer
from ._cache import allocate_slots, default_cache_bytes, slot_rows
from ._catalog import Catalog, TopInfo, build_catalog
from ._codecs import deflate_backend
from ._errors import ConfigurationError, DataLayerError, SchemaError
from ._pipeline import DataSource, EpochEnd, Failure, Item, Mode, Run, Stats
from ._plan import ChunkPlan, EpochPlan, check_split, plan_epoch, shard_share
from ._read import HDF5Reader
from ._sources import LocalSource, SourceLike, resolve_source

if TYPE_CHECKING:
    from ._device import DeviceStage

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

__all__ = ["AsyncHDF5DataLayer", "HDF5DataLayer", "LayerStats", "MemoryDataLayer"]

_log = logging.getLogger("asynchdf5")

DEFAULT_TOPS = ("data", "label")
#: Rows of the first chunk of an epoch are ramped up from about this many bytes, so the first
#: batch waits for a small read rather than a whole chunk.
RAMP_BYTES = 8 * 2**20


@dataclass(frozen=True)
class LayerStats:
    """A snapshot of a layer's pipeline counters (:attr:`AsyncHDF5DataLayer.stats`).

    Times are seconds summed over the layer's life (worker-thread time for the stages).
    ``resident`` is True when the whole data set fits one chunk and the cache budget: it is then
    read once and later epochs are served from memory. ``read_paths`` says how each top is read:
    ``"pread"`` (contiguous data read straight into the cache, outside h5py's lock),
    ``"chunks"`` (raw chunks read and decoded by a pool of threads, outside h5py's lock) or
    ``"h5py"`` (h5py reads it, holding its lock; the reason is in ``read_notes``).
    ``consumer_wait_seconds`` is the time ``async for`` waited for a batch. With a ``device``,
    ``device_bytes`` (held now), ``device_bytes_in_use``, ``device_bytes_peak`` and
    ``pinned_bytes`` report the device stage's memory (all 0 without one).
    """

    read_seconds: float
    gather_seconds: float
    transform_seconds: float
    consumer_wait_seconds: float
    bytes_read: int
    chunks_read: int
    batches: int
    samples: int
    first_batch_seconds: float | None
    chunk_rows: int
    resident: bool
    device_bytes: int = 0
    device_bytes_in_use: int = 0
    device_bytes_peak: int = 0
    pinned_bytes: int = 0
    read_paths: dict[str, str] = field(default_factory=dict)
    read_notes: dict[str, str] = field(default_factory=dict)


def _int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigurationError(f"{name} must be an int, not {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ConfigurationError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigurationError(f"{name} must be True or False, not {value!r}")
    return bool(value)


def _tops(tops: object) -> tuple[str, ...]:
    if isinstance(tops, str):
        tops = (tops,)
    if not isinstance(tops, Sequence) or not all(isinstance(t, str) for t in tops):
        raise ConfigurationError(f"tops must be a sequence of dataset names, not {tops!r}")
    if not tops:
        raise ConfigurationError("tops is empty: name at least one dataset")
    seen: set[str] = set()
    for t in tops:
        if t in seen:
            raise ConfigurationError(f"top {t!r} is listed twice in tops={tuple(tops)!r}")
        seen.add(t)
    return tuple(tops)


def _transformers(value: object, tops: Sequence[str]) -> list[tuple[str, Transformer]]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigurationError(
            f"transformers must be a sequence of (top, callable) pairs, not {value!r}"
        )
    out = []
    for i, pair in enumerate(value):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ConfigurationError(
                f"transformers[{i}] must be a (top, callable) pair, not {pair!r}"
            )
        top, fn = pair
        if top not in tops:
            raise ConfigurationError(
                f"transformers[{i}] is for top {top!r}, which is not one of tops={tuple(tops)!r}"
            )
        if not callable(fn):
            raise ConfigurationError(f"transformers[{i}] for top {top!r} is not callable: {fn!r}")
        out.append((str(top), fn))
    return out


class _Layer:
    """What the async layers share: configuration, the run, the epoch iterators."""

    def __init__(
        self,
        *,
        batch_size: int,
        tops: Sequence[str],
        shuffle: bool,
        chunk_size: int,
        transformers: Sequence[tuple[str, Transformer]],
        seed: int | None,
        drop_last: bool,
        rank: int,
        world_size: int,
        prefetch: int,
        device: object = None,
        reuse_buffers: bool = False,
    ) -> None:
        self.batch_size = _int("batch_size", batch_size, minimum=1)
        self.tops = _tops(tops)
        self.shuffle = _bool("shuffle", shuffle)
        self.chunk_size = _int("chunk_size", chunk_size, minimum=1)
        if self.chunk_size < self.batch_size:
            raise ConfigurationError(
                f"chunk_size={self.chunk_size} is smaller than batch_size={self.batch_size}; "
                "a chunk must hold at least one batch"
            )
        self.transformers = _transformers(transformers, self.tops)
        self.drop_last = _bool("drop_last", drop_last)
        self.world_size = _int("world_size", world_size, minimum=1)
        self.rank = _int("rank", rank, minimum=0)
        if self.rank >= self.world_size:
            raise ConfigurationError(
                f"rank={self.rank} is outside 0 ... world_size-1 = {self.world_size - 1}"
            )
        if seed is None:
            if self.world_size > 1 and self.shuffle:
                raise ConfigurationError(
                    "shuffle=True with world_size > 1 needs an explicit seed, the same on every "
                    "rank, so that the ranks' shards stay disjoint"
                )
            seed = secrets.randbits(63)
        self.seed = _int("seed", seed, minimum=0)
        self.prefetch = _int("prefetch", prefetch, minimum=1)
        self._epoch = 0
        self._tg: TaskGroup | None = None
        self._source: DataSource | None = None
        self._run: Run | None = None
        self._current: _EpochIterator | None = None
        self._stats = Stats()
        self._chunk_rows = self.chunk_size
        self._resident = False
        self._opened_at = 0.0
        self.device = device
        self.reuse_buffers = _bool("reuse_buffers", reuse_buffers)
        if self.reuse_buffers and device is None:
            raise ConfigurationError(
                "reuse_buffers=True applies to device batches; set device= too (host batches "
                "are reused only once you let go of them, without asking)"
            )
        self._finisher: DeviceStage | None = None
        if device is not None:
            from ._device import DeviceStage

            self._finisher = DeviceStage(
                device,
                self.transformers,
                self.batch_size,
                self.prefetch,
                reuse_buffers=self.reuse_buffers,
            )

    # --- what subclasses provide ---------------------------------------------------------

    async def _open_source(self) -> DataSource:
        raise NotImplementedError

    def _read_paths(self) -> dict[str, str]:
        return {}

    def _read_notes(self) -> dict[str, str]:
        return {}

    def _first_rows(self) -> int | None:
        return None

    # --- public ----------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Epochs finished so far (an epoch left early counts once the next one starts)."""
        return self._epoch

    @property
    def n_samples(self) -> int:
        """Samples in the whole source (all ranks); known once the layer is open."""
        if self._source is None:
            raise ConfigurationError("the layer is not open: use `async with layer:` first")
        return self._source.n_samples

    @property
    def stats(self) -> LayerStats:
        """Counters of the pipeline so far (see :class:`LayerStats`)."""
        s = self._stats
        return LayerStats(
            read_seconds=s.read_seconds,
            gather_seconds=s.times.gather,
            transform_seconds=s.times.transform,
            consumer_wait_seconds=s.consumer_wait_seconds,
            bytes_read=s.bytes_read,
            chunks_read=s.chunks_read,
            batches=s.batches,
            samples=s.samples,
            first_batch_seconds=s.first_batch_seconds,
            chunk_rows=self._chunk_rows,
            resident=self._resident,
            **self._device_memory(),
            read_paths=self._read_paths(),
            read_notes=self._read_notes(),
        )

    def _device_memory(self) -> dict[str, int]:
        if self._finisher is None:
            return {}
        return dataclasses.asdict(self._finisher.memory_stats)

    def plan(self, epoch: int, *, stream: bool = False) -> EpochPlan:
        """The plan of ``epoch`` for this rank: chunks and batch sizes (pure; no I/O).

        ``stream=True``: the plan that :meth:`stream` follows (``drop_last`` does not apply).
        """
        return plan_epoch(
            self.n_samples,
            epoch=epoch,
            batch_size=self.batch_size,
            chunk_size=self._chunk_rows,
            shuffle=self.shuffle,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
            first_rows=self._first_rows(),
            stream=stream,
        )

    async def __aenter__(self) -> Self:
        if self._tg is not None:
            raise ConfigurationError("the layer is already open")
        self._opened_at = time.perf_counter()
        source = await self._open_source()
        try:
            self._source = source
            if self._finisher is not None:
                self._finisher.check({name: top.dtype for name, top in source.tops.items()})
            # The same answer on every rank: decided from the configuration and the catalog.
            check_split(source.n_samples, self.batch_size, self.world_size, self.drop_last)
            tg = anyio.create_task_group()
            await tg.__aenter__()
        except BaseException:
            self._source = None
            await source.aclose()
            raise
        self._tg = tg
        self._start_run("epoch")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tg, self._tg = self._tg, None
        if tg is None:
            return None
        try:
            if self._run is not None:
                self._run.scope.cancel()
            if exc is None or isinstance(exc, anyio.get_cancelled_exc_class()):
                return await tg.__aexit__(exc_type, exc, tb)
            # Any other exception leaving the body is the caller's own: handed to the task
            # group, it would come out wrapped in an ExceptionGroup. The group only has to wait
            # for the cancelled run; returning None re-raises the exception unchanged.
            await tg.__aexit__(None, None, None)
            return None
        finally:
            if self._run is not None:
                self._run.items.close()
            self._run = None
            self._current = None
            source, self._source = self._source, None
            if source is not None:
                await source.aclose()
            if self._finisher is not None:
                self._finisher.close()

    async def aclose(self) -> None:
        """Stop the pipeline and release everything (what leaving ``async with`` does)."""
        await self.__aexit__(None, None, None)

    def __aiter__(self) -> _EpochIterator:
        """Iterate over one epoch (the next one)."""
        return _EpochIterator(self, "epoch")

    def stream(self) -> _EpochIterator:
        """Iterate endlessly, Mocha-style: full batches that wrap across epoch boundaries.

        Every batch has ``batch_size`` rows (``drop_last`` does not apply); ``batch.epoch`` is the
        epoch the batch started in, and :attr:`epoch` counts the epochs passed.
        """
        return _EpochIterator(self, "stream")

    # --- internals -------------------------------------------------------------------------

    def _start_run(self, mode: Mode) -> Run:
        assert self._tg is not None and self._source is not None
        run = Run(
            self._source,
            functools.partial(self.plan, stream=mode == "stream"),
            mode=mode,
            start_epoch=self._epoch,
            batch_size=self.batch_size,
            transformers=self.transformers,
            prefetch=self.prefetch,
            stats=self._stats,
            finisher=self._finisher,
        )
        self._run = run
        self._tg.start_soon(run.main)
        return run

    async def _begin(self, it: _EpochIterator) -> Run:
        if self._tg is None:
            raise ConfigurationError(
                "the layer is not open: iterate inside `async with layer:` "
                "(or `with layer:` for HDF5DataLayer)"
            )
        prev = self._current
        if prev is not None and prev is not it and prev.touched is not None:
            self._epoch = max(self._epoch, prev.touched + 1)  # left early: that epoch is over
        self._current = it
        run = self._run
        if run is None or run.mode != it.mode or run.head_epoch != self._epoch:
            if run is not None:
                await run.stop()
            run = self._start_run(it.mode)
        return run

    def _on_failure(self, it: _EpochIterator) -> None:
        if it.touched is not None:
            self._epoch = max(self._epoch, it.touched + 1)
        elif it.mode == "epoch":
            self._epoch += 1
        if self._run is not None:
            self._run.scope.cancel()  # a no-op when the run itself failed: it is over
            self._run.items.close()
        self._run = None
        self._current = None


class _EpochIterator:
    """``async for`` over one epoch (``mode="epoch"``) or the endless stream."""

    def __init__(self, layer: _Layer, mode: Mode) -> None:
        self._layer = layer
        self.mode: Mode = mode
        # Device batches are handed to the thread that yields them (its CUDA stream waits for
        # the upload); the sync facade yields in another thread than this one, and does it there.
        self.hand_off = True
        self._run: Run | None = None
        self._done = False
        self._pending: Item | None = None  # taken from the queue, handled on the next call
        self.touched: int | None = None  # latest epoch a yielded batch belonged to

    def __aiter__(self) -> _EpochIterator:
        return self

    async def __anext__(self) -> Batch:
        layer = self._layer
        if self._done:
            raise StopAsyncIteration
        if self._run is None or layer._current is not self:
            if self._run is not None:  # another iteration took over: this one is over
                self._done = True
                raise StopAsyncIteration
            self._run = await layer._begin(self)
        run = self._run
        while True:
            item = await self._receive(run)
            if isinstance(item, Batch):
                return self._accept(item)
            if isinstance(item, EpochEnd):
                layer._epoch = item.epoch + 1
                run.head_epoch = item.epoch + 1
                if self.mode == "epoch":
                    self._done = True
                    layer._current = None
                    raise StopAsyncIteration
                continue
            assert isinstance(item, Failure)
            self.fail()
            raise item.error

    async def _receive(self, run: Run) -> Item:
        if self._pending is not None:
            item, self._pending = self._pending, None
            return item
        stats = self._layer._stats
        t0 = time.perf_counter()
        try:
            # A ready batch is taken without a trip through the event loop (that trip costs as
            # much as the rest of a small batch); cancellation is still honoured, and the queue
            # holds a bounded number, after which receive() yields to other tasks.
            await anyio.lowlevel.checkpoint_if_cancelled()
            try:
                return run.items.receive_nowait()
            except anyio.WouldBlock:
                return await run.items.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._done = True
            raise DataLayerError("the pipeline stopped (the layer was closed)") from None
        finally:
            stats.consumer_wait_seconds += time.perf_counter() - t0

    def _accept(self, batch: Batch) -> Batch:
        layer = self._layer
        stats = layer._stats
        assert self._run is not None
        self._run.head_epoch = None
        self.touched = batch.epoch
        if layer._finisher is not None and self.hand_off:
            try:
                layer._finisher.ready(batch)
            except BaseException:
                self.fail()
                raise
        if stats.first_batch_seconds is None:
            stats.first_batch_seconds = time.perf_counter() - layer._opened_at
        stats.batches += 1
        stats.samples += len(batch.indices)
        return batch

    def fail(self) -> None:
        """The pipeline failed, or a batch could not be handed over: this iteration ends, the
        run is stopped, and the next ``async for`` starts the next epoch whole."""
        self._done = True
        if self._layer._current is self:
            self._layer._on_failure(self)

    async def next_batches(self, limit: int) -> list[Batch]:
        """The next batch and up to ``limit - 1`` more that are ready now; ``[]`` at the end.

        For the sync facade: one trip across its thread bridge per handful of batches, never
        more than are already gathered (an epoch is never collected).
        """
        try:
            out = [await self.__anext__()]
        except StopAsyncIteration:
            return []
        run = self._run
        while len(out) < limit and run is not None and self._layer._current is self:
            try:
                item = run.items.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            if not isinstance(item, Batch):
                self._pending = item  # an epoch end or a failure: the next call handles it
                break
            out.append(self._accept(item))
        return out


class AsyncHDF5DataLayer(_Layer):
    """Shuffled minibatches from HDF5 files, for ``async for`` in a training coroutine.

    A background pipeline reads large contiguous chunks of the source into a host cache, cuts
    them into batches in a worker thread, runs the transformers and hands the batches to
    ``async for``. Works on asyncio and trio (through anyio).

    Parameters
    ----------
    source : str, path or sequence of paths
        A source list file (one HDF5 path per line; blank lines and ``#`` lines ignored; relative
        paths relative to the list file's folder), a single HDF5 file, or a sequence of paths.
    batch_size : int
        Rows per batch.
    tops : sequence of str, default ``("data", "label")``
        Dataset names present in every file; the keys of every batch.
    shuffle : bool, default False
        Rotate chunk boundaries, permute chunk order and samples within chunks, per epoch.
    chunk_size : int, default ``2**20``
        Samples per cached chunk (shrunk to fit ``cache_bytes``).
    transformers : sequence of (top, callable), default ``()``
        Applied in order to the top's batch array, in a worker thread.
    seed : int, optional
        Seed of the shuffle; the same seed gives the same batches on every run. Required with
        ``shuffle=True`` and ``world_size > 1``.
    drop_last : bool, default False
        Leave out each epoch's last partial batch.
    rank, world_size : int, default 0, 1
        This process's shard of every epoch (see the docs on sharding).
    cache_bytes : int, optional
        Memory budget of the host cache (two chunk slots); default: a third of the machine's
        physical memory. When ``chunk_size`` samples per slot would not fit, the chunks shrink to
        fit and a :class:`CacheBudgetWarning` says so.
    prefetch : int, default 8
        Batches gathered ahead of the consumer.
    device : None, str, int or cupy.cuda.Device, optional
        Put batches on this CUDA device as CuPy arrays (``"cuda"``, ``"cuda:1"``, ``1``); the
        transformers then run on the device after the upload. Needs the ``cuda12`` or ``cuda13``
        extra.

    Examples
    --------
    >>> import anyio, asynchdf5
    >>> async def main(path):
    ...     async with asynchdf5.AsyncHDF5DataLayer(path, batch_size=32) as layer:
    ...         async for batch in layer:
    ...             ...
    """

    def __init__(
        self,
        source: SourceLike,
        *,
        batch_size: int,
        tops: Sequence[str] = DEFAULT_TOPS,
        shuffle: bool = False,
        chunk_size: int = 2**20,
        transformers: Sequence[tuple[str, Transformer]] = (),
        seed: int | None = None,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        cache_bytes: int | None = None,
        prefetch: int = 8,
        device: object = None,
        reuse_buffers: bool = False,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            tops=tops,
            shuffle=shuffle,
            chunk_size=chunk_size,
            transformers=transformers,
            seed=seed,
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
            prefetch=prefetch,
            device=device,
            reuse_buffers=reuse_buffers,
        )
        self.cache_bytes = (
            None if cache_bytes is None else _int("cache_bytes", cache_bytes, minimum=1)
        )
        self.paths = resolve_source(source)
        self._reader_paths: dict[str, str] = {}
        self._reader_notes: dict[str, str] = {}

    def _read_paths(self) -> dict[str, str]:
        return dict(self._reader_paths)

    def _read_notes(self) -> dict[str, str]:
        return dict(self._reader_notes)

    def _first_rows(self) -> int | None:
        src = self._source
        if src is None:
            return None
        row_bytes = sum(t.row_bytes for t in src.tops.values())
        return max(self.batch_size, RAMP_BYTES // max(1, row_bytes))

    async def _open_source(self) -> DataSource:
        files = LocalSource()
        try:
            catalog = await anyio.to_thread.run_sync(build_catalog, files, self.paths, self.tops)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(files.close)
            raise
        try:
            return self._reader(catalog, files)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(files.close)
            raise

    def _reader(self, catalog: Catalog, files: LocalSource) -> HDF5Reader:
        _, share = shard_share(catalog.n_samples, self.batch_size, 0, self.world_size)
        budget = self.cache_bytes if self.cache_bytes is not None else default_cache_bytes()
        self._chunk_rows = slot_rows(self.chunk_size, max(1, share), catalog.row_bytes, budget)
        if self._chunk_rows < self.batch_size and self._chunk_rows < share:
            raise ConfigurationError(
                f"cache_bytes={self.cache_bytes} cannot hold a batch of {self.batch_size} "
                f"samples of {catalog.row_bytes} bytes in each of the cache slots"
            )
        # The whole data set is one chunk and fits the budget: keep it, read each sample once.
        self._resident = (
            catalog.n_samples <= self.chunk_size and catalog.n_samples * catalog.row_bytes <= budget
        )
        if self._resident:
            whole = allocate_slots(catalog.tops, catalog.n_samples, count=1)[0].arrays
            reader = HDF5Reader(catalog, files, None, resident=whole)
        else:
            reader = HDF5Reader(catalog, files, allocate_slots(catalog.tops, self._chunk_rows))
        self._reader_paths = catalog.read_paths()
        self._reader_notes = catalog.read_notes()
        for top, path in self._reader_paths.items():
            note = self._reader_notes.get(top)
            if "chunks" in path:
                note = f"deflate decoder: {deflate_backend()}" + (f"; {note}" if note else "")
            _log.info("top %r is read by %s%s", top, path, f" ({note})" if note else "")
        return reader


class _MemorySource:
    """In-memory arrays as a data source: rows are gathered straight from the arrays."""

    slots = None

    def __init__(self, arrays: dict[str, np.ndarray], tops: dict[str, TopInfo]) -> None:
        self.arrays = arrays
        self.tops = tops
        self.n_samples = len(next(iter(arrays.values())))

    async def load(self, chunk: ChunkPlan, slot: object, stats: Stats) -> LoadedChunk:
        order = await anyio.to_thread.run_sync(chunk.order)
        return LoadedChunk(chunk, order, self.arrays, rows_are_global=True)

    async def aclose(self) -> None:
        pass


class MemoryDataLayer(_Layer):
    """The same interface and semantics as :class:`AsyncHDF5DataLayer`, over arrays in memory.

    Parameters
    ----------
    data : mapping of str to array
        One array per top, rows = samples, all with the same number of rows.
    batch_size, tops, shuffle, transformers, seed, drop_last, rank, world_size, prefetch
        As for :class:`AsyncHDF5DataLayer`; ``tops`` defaults to every key of ``data``. The
        whole data set is one chunk.
    """

    def __init__(
        self,
        data: Mapping[str, Any],
        *,
        batch_size: int,
        tops: Sequence[str] | None = None,
        shuffle: bool = False,
        transformers: Sequence[tuple[str, Transformer]] = (),
        seed: int | None = None,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 8,
        device: object = None,
        reuse_buffers: bool = False,
    ) -> None:
        if not isinstance(data, Mapping) or not data:
            raise ConfigurationError("data must be a non-empty mapping of top name to array")
        arrays = {str(k): np.asarray(v) for k, v in data.items()}
        names = _tops(tuple(arrays) if tops is None else tops)
        specs: dict[str, TopInfo] = {}
        rows: dict[str, int] = {}
        for name in names:
            if name not in arrays:
                raise SchemaError(f"top {name!r} is not a key of data ({sorted(arrays)})")
            a = arrays[name]
            if a.ndim == 0:
                raise SchemaError(f"top {name!r} is a 0-d array; a top needs one row per sample")
            if a.dtype.kind not in "biufc" or a.dtype.names is not None:
                raise SchemaError(f"top {name!r} has dtype {a.dtype}; not supported")
            rows[name] = len(a)
            specs[name] = TopInfo(name, a.dtype, tuple(a.shape[1:]))
        if len(set(rows.values())) > 1:
            raise SchemaError(f"the tops have different row counts: {rows}")
        if next(iter(rows.values())) == 0:
            raise SchemaError("the arrays hold no samples")
        n = next(iter(rows.values()))
        super().__init__(
            batch_size=batch_size,
            tops=names,
            shuffle=shuffle,
            chunk_size=max(n, _int("batch_size", batch_size, minimum=1)),
            transformers=transformers,
            seed=seed,
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
            prefetch=prefetch,
            device=device,
            reuse_buffers=reuse_buffers,
        )
        self._arrays = {k: arrays[k] for k in names}
        self._specs = specs

    async def _open_source(self) -> DataSource:
        return _MemorySource(self._arrays, self._specs)


class HDF5DataLayer:
    """The sync facade of :class:`AsyncHDF5DataLayer`, for ordinary ``for`` loops.

    Takes the same keyword properties. The async pipeline runs on an event loop in a background
    thread (one anyio blocking portal); every call crosses that one bridge, one batch at a time.

    Examples
    --------
    >>> import asynchdf5
    >>> def train(path):
    ...     with asynchdf5.HDF5DataLayer(path, batch_size=32, shuffle=True, seed=0) as layer:
    ...         for epoch in range(3):
    ...             for batch in layer:
    ...                 ...
    """

    def __init__(self, source: SourceLike, *, backend: str = "asyncio", **properties: Any) -> None:
        self._layer = AsyncHDF5DataLayer(source, **properties)
        self._backend = backend
        self._portal_cm: Any = None
        self._portal: BlockingPortal | None = None
        self._ctx: Any = None

    @property
    def layer(self) -> AsyncHDF5DataLayer:
        """The async layer behind the facade."""
        return self._layer

    @property
    def epoch(self) -> int:
        """Epochs finished so far."""
        return self._layer.epoch

    @property
    def stats(self) -> LayerStats:
        """Counters of the pipeline so far."""
        return self._layer.stats

    @property
    def n_samples(self) -> int:
        """Samples in the whole source (all ranks)."""
        return self._layer.n_samples

    def plan(self, epoch: int) -> EpochPlan:
        """The plan of ``epoch`` for this rank (see :meth:`AsyncHDF5DataLayer.plan`)."""
        return self._layer.plan(epoch)

    def __enter__(self) -> Self:
        if self._portal is not None:
            raise ConfigurationError("the layer is already open")
        cm = start_blocking_portal(self._backend)
        portal = cm.__enter__()
        try:
            ctx = portal.wrap_async_context_manager(self._layer)
            ctx.__enter__()
        except BaseException:
            cm.__exit__(*sys.exc_info())
            raise
        self._portal_cm, self._portal, self._ctx = cm, portal, ctx
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the pipeline and its event loop thread; release everything."""
        cm, ctx = self._portal_cm, self._ctx
        self._portal_cm = self._portal = self._ctx = None
        if cm is None:
            return
        try:
            ctx.__exit__(None, None, None)
        finally:
            cm.__exit__(None, None, None)

    def __iter__(self) -> Iterator[Batch]:
        """Iterate over one epoch (the next one)."""
        return self._iterate(self._layer.__aiter__())

    def stream(self) -> Iterator[Batch]:
        """Iterate endlessly over full batches that wrap across epochs."""
        return self._iterate(self._layer.stream())

    def _iterate(self, it: _EpochIterator) -> Iterator[Batch]:
        portal = self._portal
        if portal is None:
            raise ConfigurationError("the layer is not open: iterate inside `with layer:`")
        finisher = self._layer._finisher
        it.hand_off = False  # the portal thread is not the consumer: this one is
        while True:
            batches = portal.call(it.next_batches, 16)
            if not batches:
                return
            batches.reverse()
            while batches:  # popped: a batch the loop is done with is not held here
                batch = batches.pop()
                if finisher is not None:
                    try:  # this thread's current stream waits for the upload
                        finisher.ready(batch)
                    except BaseException:
                        portal.call(it.fail)
                        raise
                yield batch
