"""What every layer shares: configuration, lifecycle, iterators and stats.

A layer is thin: a :class:`~._config.LayerConfig`, a delivery chosen at construction, and a
lifecycle. ``async with`` (or ``with``, through the sync bridge) opens the reader, sizes the
cache and starts a :class:`~._iterator.Session`, which owns the state of every epoch until the
layer closes; each ``async for`` (or ``for``) is one :class:`~._iterator.EpochIterator`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from types import TracebackType
from typing import Literal

import anyio
import anyio.lowlevel
import anyio.to_thread

from ._batch import Batch
from ._cache import Slot
from ._config import LayerConfig
from ._delivery import make_delivery
from ._errors import StateError
from ._iterator import EpochIterator, Session
from ._plan import EpochPlan, check_split, plan_epoch
from ._read import Reader
from ._stats import LayerStats, Stats
from ._sync import SyncInterface

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

__all__ = ["RAMP_BYTES"]

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
