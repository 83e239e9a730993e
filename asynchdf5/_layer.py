"""The layers: configuration, lifecycle and iterators, for HDF5 files and for arrays in memory.

A layer is thin: a :class:`~._config.LayerConfig`, a delivery chosen at construction, and a
lifecycle. ``async with`` (or ``with``, through the sync bridge) opens the reader, sizes the
cache and starts a :class:`~._iterator.Session`, which owns the state of every epoch until the
layer closes; each ``async for`` (or ``for``) is one :class:`~._iterator.EpochIterator`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np

from ._batch import Batch
from ._cache import N_SLOTS, Slot, allocate_slots, default_cache_bytes, slot_rows
from ._catalog import TopInfo, build_catalog
from ._codecs import deflate_backend
from ._config import DEFAULT_TOPS, LayerConfig
from ._delivery import make_delivery
from ._errors import ConfigurationError, SchemaError, StateError
from ._iterator import EpochIterator, Session
from ._plan import EpochPlan, check_split, plan_epoch, shard_share
from ._read import HDF5Reader, MemoryReader, Reader
from ._sources import LocalSource, SourceLike, resolve_source
from ._stats import LayerStats, Stats
from ._sync import SyncInterface
from .transforms import Transformer

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

__all__ = ["RAMP_BYTES", "AsyncHDF5DataLayer", "HDF5DataLayer", "MemoryDataLayer"]

_log = logging.getLogger("asynchdf5")

#: Rows of the first chunk of an epoch are ramped up from about this many bytes, so the first
#: batch waits for a small read rather than a whole chunk.
RAMP_BYTES = 8 * 2**20


class _Layer(SyncInterface):
    """What every layer shares: configuration, lifecycle, iterators, stats."""

    def __init__(self, config: LayerConfig) -> None:
        self.config = config
        self._delivery = make_delivery(
            config.device,
            config.transformers,
            config.batch_size,
            config.prefetch,
            reuse_buffers=config.reuse_buffers,
        )
        self._stats = Stats()
        self._state: Literal["closed", "opening", "open"] = "closed"
        self._session: Session | None = None
        self._opener: int | None = None  # the task that opened the layer
        self._epoch = 0
        self._n_samples: int | None = None
        self._row_bytes = 0
        self._chunk_rows = config.chunk_size
        self._resident = False
        self._read_paths: Mapping[str, str] = {}
        self._read_notes: Mapping[str, str] = {}

    # --- what subclasses provide --------------------------------------------------------------

    async def _open_reader(self) -> tuple[Reader, list[Slot] | None]:
        """Open the data, size the cache; the reader and its cache slots (None: in place)."""
        raise NotImplementedError

    # --- configuration ------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Rows per batch."""
        return self.config.batch_size

    @property
    def tops(self) -> tuple[str, ...]:
        """The tops: dataset names, and the keys of every batch."""
        return self.config.tops

    @property
    def seed(self) -> int:
        """The seed of the shuffle (drawn at construction when ``seed=None``)."""
        return self.config.seed

    @property
    def rank(self) -> int:
        """This process's shard."""
        return self.config.rank

    @property
    def world_size(self) -> int:
        """The number of shards."""
        return self.config.world_size

    # --- state --------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Epochs finished so far (an epoch left early counts once the next one starts)."""
        return self._session.epoch if self._session is not None else self._epoch

    @property
    def n_samples(self) -> int:
        """Samples in the whole source (all ranks); known once the layer has been opened."""
        if self._n_samples is None:
            raise StateError("the number of samples is known once the layer is open")
        return self._n_samples

    @property
    def stats(self) -> LayerStats:
        """Counters of the pipeline so far (see :class:`LayerStats`)."""
        return self._stats.snapshot(
            chunk_rows=self._chunk_rows,
            resident=self._resident,
            device=self._delivery.memory(),
            read_paths=self._read_paths,
            read_notes=self._read_notes,
        )

    def plan(self, epoch: int, *, stream: bool = False) -> EpochPlan:
        """The plan of ``epoch`` for this rank: chunks and batch sizes (pure; no I/O).

        ``stream=True``: the plan that :meth:`stream` follows (``drop_last`` does not apply).
        """
        c = self.config
        return plan_epoch(
            self.n_samples,
            epoch=epoch,
            batch_size=c.batch_size,
            chunk_size=self._chunk_rows,
            shuffle=c.shuffle,
            seed=c.seed,
            rank=c.rank,
            world_size=c.world_size,
            drop_last=c.drop_last,
            first_rows=max(c.batch_size, RAMP_BYTES // max(1, self._row_bytes)),
            stream=stream,
        )

    # --- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self._open(sync=False)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._close(exc_type, exc, tb)

    async def aclose(self) -> None:
        """Stop the pipeline and release everything (what leaving ``async with`` does)."""
        await self._close(None, None, None)

    @contextlib.asynccontextmanager
    async def _opened(self, *, sync: bool) -> AsyncIterator[None]:
        await self._open(sync=sync)
        try:
            yield
        except BaseException as exc:
            if not await self._close(type(exc), exc, exc.__traceback__):
                raise
        else:
            await self._close(None, None, None)

    def _backend(self) -> str:
        return self.config.backend

    async def _open(self, *, sync: bool) -> None:
        if self._state != "closed":
            raise StateError(f"the layer is already {self._state}: open it once at a time")
        self._state = "opening"  # before any await: a second opener sees it at once
        try:
            opened_at = time.perf_counter()
            reader, slots = await self._open_reader()
            try:
                self._delivery.check(reader.tops)
                # The same answer on every rank: decided from the configuration and the catalog.
                c = self.config
                check_split(reader.n_samples, c.batch_size, c.world_size, c.drop_last)
                task_group = anyio.create_task_group()
                await task_group.__aenter__()
            except BaseException:
                await reader.aclose()
                raise
        except BaseException:
            self._state = "closed"
            raise
        self._read_paths, self._read_notes = reader.read_paths, reader.read_notes
        self._opener = anyio.get_current_task().id
        self._session = Session(
            reader=reader,
            slots=slots,
            delivery=self._delivery,
            stats=self._stats,
            plan=lambda epoch, stream: self.plan(epoch, stream=stream),
            batch_size=self.config.batch_size,
            prefetch=self.config.prefetch,
            epoch=self._epoch,
            task_group=task_group,
            opened_at=opened_at,
            sync=sync,
        )
        self._state = "open"
        self._session.start_run("epoch")  # the first epoch's first chunk is read now

    async def _close(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        session = self._session
        if session is None:
            return None
        if anyio.get_current_task().id != self._opener:
            raise StateError("close the layer in the task that opened it")
        self._session = None
        try:
            session.cancel()
            if exc is None or isinstance(exc, anyio.get_cancelled_exc_class()):
                return await session.task_group.__aexit__(exc_type, exc, tb)
            # Any other exception leaving the body is the caller's own: handed to the task
            # group, it would come out wrapped in an ExceptionGroup. The group only has to wait
            # for the cancelled run; returning None re-raises the exception unchanged.
            await session.task_group.__aexit__(None, None, None)
            return None
        finally:
            try:
                await session.aclose()
            finally:
                self._epoch = session.epoch
                self._state = "closed"

    # --- iterating ----------------------------------------------------------------------------

    def __aiter__(self) -> EpochIterator:
        """Iterate over one epoch (the next one)."""
        return EpochIterator(self, "epoch")

    def __iter__(self) -> Iterator[Batch]:
        """Iterate over one epoch (the next one), in a layer opened with ``with``."""
        return iter(EpochIterator(self, "epoch"))

    def stream(self) -> EpochIterator:
        """Iterate endlessly, Mocha-style: full batches that wrap across epoch boundaries.

        Every batch has ``batch_size`` rows (``drop_last`` does not apply); ``batch.epoch`` is the
        epoch the batch started in, and :attr:`epoch` counts the epochs passed. Use it with
        ``async for`` (or ``for``, in a layer opened with ``with``).
        """
        return EpochIterator(self, "stream")

    def _session_for(self, it: EpochIterator) -> Session:
        if self._session is None or self._state != "open":
            raise StateError(
                "the layer is not open: iterate inside `async with layer:` (or `with layer:`)"
            )
        return self._session


class AsyncHDF5DataLayer(_Layer):
    """Shuffled minibatches from HDF5 files, for ``async for`` in a training coroutine.

    A background pipeline reads large chunks of the source into a host cache, cuts them into
    batches in a worker thread, runs the transformers and hands the batches to ``async for``.
    Works on asyncio and trio (through anyio); ``with`` and ``for`` work too, on an event loop
    in a background thread (see :class:`HDF5DataLayer`). The keyword properties are documented
    in the user guide's property table.

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
        backend: Literal["asyncio", "trio"] = "asyncio",
    ) -> None:
        config = LayerConfig.parse(
            batch_size=batch_size,
            tops=tops,
            shuffle=shuffle,
            chunk_size=chunk_size,
            transformers=transformers,
            seed=seed,
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
            cache_bytes=cache_bytes,
            prefetch=prefetch,
            device=device,
            reuse_buffers=reuse_buffers,
            backend=backend,
        )
        #: The files (absolute paths, or URLs), resolved at construction.
        self.paths = resolve_source(source)
        super().__init__(config)

    async def _open_reader(self) -> tuple[Reader, list[Slot] | None]:
        files = LocalSource()
        try:
            catalog = await anyio.to_thread.run_sync(
                build_catalog, files, self.paths, self.config.tops
            )
            c = self.config
            n, row_bytes = catalog.n_samples, catalog.row_bytes
            share = shard_share(n, c.batch_size, 0, c.world_size)[1]  # rank 0's: same everywhere
            budget = c.cache_bytes if c.cache_bytes is not None else default_cache_bytes()
            need = N_SLOTS * min(c.batch_size, max(1, share)) * row_bytes
            if need > budget:
                raise ConfigurationError(
                    f"cache_bytes={budget} cannot hold what the pipeline needs: {N_SLOTS} cache "
                    f"slots of a batch each, {min(c.batch_size, share)} samples of {row_bytes} "
                    f"bytes per slot, {need} bytes; raise cache_bytes or lower batch_size"
                )
            chunk_rows = slot_rows(c.chunk_size, max(1, share), row_bytes, budget)
            # The whole data set is one chunk and fits the budget: keep it, read each sample once.
            resident = n <= c.chunk_size and n * row_bytes <= budget
            slots: list[Slot] | None = None
            if resident:
                whole = allocate_slots(catalog.tops, n, count=1)[0].arrays
                reader = HDF5Reader(catalog, files, resident=whole)
            else:
                slots = allocate_slots(catalog.tops, chunk_rows)
                reader = HDF5Reader(catalog, files)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(files.close)
            raise
        self._n_samples, self._row_bytes = n, row_bytes
        self._chunk_rows, self._resident = chunk_rows, resident
        for top, path in reader.read_paths.items():
            note = reader.read_notes.get(top)
            if "chunks" in path:
                note = f"deflate decoder: {deflate_backend()}" + (f"; {note}" if note else "")
            _log.info("top %r is read by %s%s", top, path, f" ({note})" if note else "")
        return reader, slots


class HDF5DataLayer(AsyncHDF5DataLayer):
    """Shuffled minibatches from HDF5 files, for ordinary ``with`` / ``for`` loops.

    The same keyword properties as :class:`AsyncHDF5DataLayer` (``backend`` picks the event loop
    the pipeline runs on, in a background thread). Every call crosses one bridge to that loop;
    iterating takes the batches the pipeline has ready, a handful per trip.

    Examples
    --------
    >>> import asynchdf5
    >>> def train(path):
    ...     with asynchdf5.HDF5DataLayer(path, batch_size=32, shuffle=True, seed=0) as layer:
    ...         for epoch in range(3):
    ...             for batch in layer:
    ...                 ...
    """

    @property
    def layer(self) -> Self:
        """The layer itself (kept from when the sync facade wrapped an async layer)."""
        return self


class MemoryDataLayer(_Layer):
    """The same interface and semantics as :class:`AsyncHDF5DataLayer`, over arrays in memory.

    Works with ``async with`` / ``async for`` and with ``with`` / ``for``.

    Parameters
    ----------
    data : mapping of str to array
        One array per top, rows = samples, all with the same number of rows.
    batch_size, tops, shuffle, transformers, seed, drop_last, rank, world_size, prefetch, ...
        As for :class:`AsyncHDF5DataLayer`; ``tops`` defaults to every key of ``data``. The
        whole data set is one chunk, served in place.
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
        backend: Literal["asyncio", "trio"] = "asyncio",
    ) -> None:
        if not isinstance(data, Mapping) or not data:
            raise ConfigurationError("data must be a non-empty mapping of top name to array")
        arrays = {str(k): np.asarray(v) for k, v in data.items()}
        config = LayerConfig.parse(
            batch_size=batch_size,
            tops=tuple(arrays) if tops is None else tops,
            shuffle=shuffle,
            chunk_size=batch_size,  # set below: the whole data set is one chunk
            transformers=transformers,
            seed=seed,
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
            prefetch=prefetch,
            device=device,
            reuse_buffers=reuse_buffers,
            backend=backend,
        )
        n = _check_arrays(arrays, config.tops)
        super().__init__(dataclasses.replace(config, chunk_size=max(n, config.batch_size)))
        self._arrays = {k: arrays[k] for k in config.tops}
        self._specs = {k: TopInfo(k, a.dtype, tuple(a.shape[1:])) for k, a in self._arrays.items()}
        self._n_samples = n
        self._row_bytes = sum(t.row_bytes for t in self._specs.values())
        self._resident = True

    async def _open_reader(self) -> tuple[Reader, list[Slot] | None]:
        return MemoryReader(self._arrays, self._specs), None


def _check_arrays(arrays: Mapping[str, np.ndarray], tops: Sequence[str]) -> int:
    """The number of samples of the arrays that ``tops`` name (checked: SchemaError)."""
    rows: dict[str, int] = {}
    for name in tops:
        if name not in arrays:
            raise SchemaError(f"top {name!r} is not a key of data ({sorted(arrays)})")
        a = arrays[name]
        if a.ndim == 0:
            raise SchemaError(f"top {name!r} is a 0-d array; a top needs one row per sample")
        if a.dtype.kind not in "biufc" or a.dtype.names is not None:
            raise SchemaError(f"top {name!r} has dtype {a.dtype}; not supported")
        rows[name] = len(a)
    if len(set(rows.values())) > 1:
        raise SchemaError(f"the tops have different row counts: {rows}")
    n = next(iter(rows.values()))
    if n == 0:
        raise SchemaError("the arrays hold no samples")
    return n
