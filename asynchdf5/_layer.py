"""What every layer shares: configuration, lifecycle, iterators and stats.

A layer is thin: a :class:`~._config.LayerConfig`, a delivery chosen at construction, and a
lifecycle. ``async with`` (or ``with``, through the sync bridge) opens the reader, sizes the
cache and starts a :class:`~._session.Session`, which owns the state of every epoch until the
layer closes; each ``async for`` (or ``for``) is one :class:`~._iterator.EpochIterator`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.lowlevel
import anyio.to_thread

from ._batch import Batch
from ._cache import Slot
from ._config import LayerConfig
from ._delivery import make_delivery
from ._errors import ConfigurationError, StateError
from ._iterator import EpochIterator
from ._plan import EpochPlan, check_split, plan_epoch
from ._priority import nice_steps
from ._process import ProcessReader
from ._read import Reader
from ._replan import skip_samples, split_plan
from ._resume import Resume, epoch_plan, parse_state, save_state
from ._session import Session
from ._shape import DataShape
from ._stats import LayerStats, Stats
from ._sync import SyncInterface

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

_log = logging.getLogger("asynchdf5")


class LayerBase(SyncInterface):
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
        self._shape: DataShape | None = None
        self._resume: Resume | None = None
        # An elastic resume's epoch is planned with the saved run's chunks (its rows were cut
        # by the saved run's shares); the epochs after it with this layer's own.
        self._resumed_shape: DataShape | None = None
        self._part: tuple[int, int] | None = None  # a DataLoader worker's run of the batches
        self._slot_rows = 0  # the rows the open layer's cache slots hold
        self._read_paths: Mapping[str, str] = {}
        self._read_notes: Mapping[str, str] = {}

    # --- what subclasses provide --------------------------------------------------------------

    async def _open_reader(self) -> tuple[Reader | ProcessReader, list[Slot] | None, DataShape]:
        """Open the data, size the cache; the reader (or the helper process that runs the
        pipeline, with ``process=True``), its cache slots (None: in place), and what was
        learned of the data."""
        raise NotImplementedError

    def _look(self) -> DataShape:
        """What the data is like, without opening the pipeline (blocking: may read the files'
        metadata, in a worker thread)."""
        raise NotImplementedError

    def _data_shape(self) -> DataShape:
        if self._shape is None:
            self._shape = self._look()
        return self._shape

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
        """Samples in the whole source (all ranks); reads the files' metadata on first use if
        the layer was never opened."""
        return self._data_shape().n_samples

    def __len__(self) -> int:
        """Batches that the next epoch yields on this rank (after ``drop_last`` and sharding,
        and what is left of it when a state was loaded). Reads the files' metadata on first use
        if the layer was never opened: blocking, so call it outside the event loop, or after
        ``async with``."""
        return self.plan(self.epoch).n_batches

    @property
    def stats(self) -> LayerStats:
        """Counters of the pipeline so far (see :class:`LayerStats`)."""
        shape = self._shape
        return self._stats.snapshot(
            chunk_rows=shape.chunk_rows if shape is not None else self.config.chunk_size,
            resident=shape.resident if shape is not None else False,
            device=self._delivery.memory(),
            read_paths=self._read_paths,
            read_notes=self._read_notes,
        )

    def plan(self, epoch: int, *, stream: bool = False) -> EpochPlan:
        """The plan of ``epoch`` for this rank: chunks and batch sizes (pure; no I/O).

        ``stream=True``: the plan that :meth:`stream` follows (``drop_last`` does not apply).
        """
        c = self.config
        shape = self._plan_shape(epoch)
        part = self._part if not stream else None

        def fresh(rank: int, world_size: int, stream: bool = stream) -> EpochPlan:
            whole = plan_epoch(
                shape.n_samples,
                epoch=epoch,
                batch_size=c.batch_size,
                chunk_size=shape.chunk_rows,
                shuffle=c.shuffle,
                seed=c.seed,
                rank=rank,
                world_size=world_size,
                drop_last=c.drop_last,
                first_rows=shape.first_rows,
                stream=stream,
                block_size=shape.block_rows,
                ramp_lanes=shape.ramp_lanes,
                chunk_lanes=shape.chunk_lanes,
            )
            return whole if part is None else split_plan(whole, *part)

        r = self._resume
        if r is None or epoch != r.epoch:
            return fresh(c.rank, c.world_size)
        if r.mode == "stream":
            return skip_samples(fresh(c.rank, c.world_size, stream=True), r.samples)
        return epoch_plan(
            r.chain,
            lambda rank, world: fresh(rank, world, stream=False),
            rank=c.rank,
            world_size=c.world_size,
            drop_last=c.drop_last and not stream,
        )

    def _plan_shape(self, epoch: int) -> DataShape:
        """The shape ``epoch`` is planned with: an elastically resumed epoch's is the saved
        run's, every other epoch's this layer's."""
        r, resumed = self._resume, self._resumed_shape
        if r is not None and resumed is not None and epoch == r.epoch:
            return resumed
        return self._data_shape()

    def _cache_rows(self, shape: DataShape) -> int:
        """The rows a cache slot must hold when the layer opens with ``shape``: its chunks', and
        an elastically resumed epoch's still to come."""
        r, resumed = self._resume, self._resumed_shape
        if r is not None and resumed is not None and self._epoch <= r.epoch:
            return max(shape.chunk_rows, resumed.chunk_rows)
        return shape.chunk_rows

    def set_epoch(self, epoch: int) -> None:
        """Serve ``epoch`` next, from its first batch (as ``DistributedSampler.set_epoch`` does
        for PyTorch; epochs otherwise advance by themselves). Not while an iterator is live."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigurationError(f"epoch must be an int >= 0, not {epoch!r}")
        session = self._session
        if session is not None and session.consumer() is not None:
            raise StateError("set_epoch while an iterator is live: finish or close it first")
        self._resume = self._resumed_shape = None
        self._epoch = epoch
        if session is not None:
            session.restart_at(epoch)

    def _set_part(self, part: int, parts: int) -> None:
        """Serve part ``part`` of ``parts`` of this rank's epochs, a contiguous run of each
        epoch's batches (a DataLoader worker's, for :mod:`asynchdf5.torch`; see
        :func:`~._replan.split_plan`): only on a closed layer with no state loaded."""
        if self._state != "closed" or self._resume is not None:
            raise StateError("a layer's part can change only while it is closed, before a state")
        if not 0 <= part < parts:
            raise ConfigurationError(f"part {part} is outside 0 ... {parts - 1}")
        self._part = None if parts == 1 else (part, parts)

    # --- resume -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the consumer is, as plain values (JSON-serialisable): pass it to
        :meth:`load_state_dict` of a layer over the same files and properties, and its next
        batch is exactly the one that would have come next here. Only batches handed to the
        consumer count, never prefetched ones."""
        session = self._session
        position = session.position() if session is not None else ("epoch", self._epoch, 0, 0)
        c = self.config
        return save_state(
            self._resume,
            position,
            seed=c.seed,
            rank=c.rank,
            world_size=c.world_size,
            fingerprint=self._plan_shape(position[1]).fingerprint(c),
            part=self._part,
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`): the next batch is the one that
        would have come next in the run that saved it, and every later epoch is that run's
        (after an elastic resume, every later epoch is that of a layer started on this run's
        world size).

        Allowed when the layer is not iterating: before ``async with`` (best: the cache is
        then sized for the saved run's chunks), or between epochs. A state from other files
        or other properties is a :class:`ConfigurationError` that says what differs. A state
        from a run with another ``world_size`` (every rank of which was at the same batch
        count) continues that epoch over this run's ranks: see the docs on elastic resume.
        """
        r = parse_state(state)
        session = self._session
        if session is not None and session.consumer() is not None:
            raise StateError("load_state_dict while an iterator is live: finish or close it first")
        shape = self._data_shape()
        c = self.config
        r.check_resumes(
            shape.fingerprint(c),
            seed=c.seed if c.seed_given else None,
            world_size=c.world_size,
            part=self._part,
        )
        saved_rows = r.fingerprint["chunk_rows"]
        if session is not None and saved_rows > self._slot_rows:
            raise ConfigurationError(
                f"the saved run cached chunks of {saved_rows} rows, this open layer's cache "
                f"holds {self._slot_rows}: load the state before opening it"
            )
        self._shape, resumed = r.shapes(shape, c.world_size)
        if not c.seed_given:
            self.config = dataclasses.replace(c, seed=r.seed)
        self._resume, self._resumed_shape = r, resumed
        self._epoch = r.epoch
        if session is not None:
            session.restart_at(r.epoch)

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
            nice_steps()  # a bad ASYNCHDF5_NICE fails here, not in a pipeline thread
            reader, slots, shape = await self._open_reader()
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
        self._shape = shape
        self._slot_rows = self._cache_rows(shape)
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
