"""What every layer shares: configuration, lifecycle, iterators and stats.

A layer is thin: a delivery chosen at construction, one :class:`~._planner.Planner` (every
question about order; it holds the layer's one :class:`~._config.LayerConfig`) and one
:class:`~._consumer.Consumer` (where the consumer is: open or closed, the epoch, the position,
its stats). ``async with`` has the layer's source build its whole opening (catalog, checks,
reader, cache: an :class:`~._opened.Opened`, by :meth:`LayerBase._open_source`) and hands it to
the consumer. ``with`` does the same on an event loop in a background thread: the layer then
holds a :class:`~._sync.Bridge` (composed, not inherited) and enters its own opening through
the bridge's portal, which the ``for`` loops take their batches through. Each ``async for`` (or
``for``) is an :class:`~._iterator.EpochIterator`, a view on the consumer. Resume goes through
the planner to :mod:`._resume`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from types import TracebackType
from typing import Any

from anyio.from_thread import BlockingPortal

from ._batch import Batch
from ._config import LayerConfig
from ._consumer import Consumer
from ._delivery import BatchMemory, Delivery, HostDelivery, make_delivery
from ._errors import ConfigurationError, StateError
from ._interrupts import interrupts_held
from ._iterator import EpochIterator
from ._opened import Opened
from ._plan import EpochPlan
from ._planner import Planner, check_part
from ._priority import nice_steps
from ._shape import DataShape
from ._stats import LayerStats, Stats
from ._sync import Bridge

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

_log = logging.getLogger("asynchdf5")


class LayerBase:
    """What every layer shares: configuration, lifecycle, iterators, stats."""

    def __init__(self, config: LayerConfig) -> None:
        delivery = make_delivery(config)
        self._stats = Stats()
        self._planner = Planner(config)
        self._consumer = Consumer(
            planner=self._planner,
            delivery=delivery,
            stats=self._stats,
            batch_size=config.batch_size,
            prefetch=config.prefetch,
        )
        #: Opened with ``with``: the bridge to the background event loop, and the opening
        #: entered there through its portal (None otherwise).
        self._sync: Bridge | None = None
        # What the latest opening's reader said of each top (kept after the close, for stats).
        self._read_paths: Mapping[str, str] = {}
        self._read_notes: Mapping[str, str] = {}

    # --- what subclasses provide --------------------------------------------------------------

    async def _open_source(self, epoch: int, portal: BlockingPortal | None, at: float) -> Opened:
        """Build the whole opening, at ``epoch``: open the data, have the planner check and
        size it (:meth:`~._planner.Planner.opening`), make the reader (or the helper process
        that runs the pipeline, with ``process=True``) and its cache slots, and end with
        :meth:`~._opened.Opened.enter`. ``portal``: opened with ``with``; ``at``: when the
        opening began."""
        raise NotImplementedError

    def _look(self) -> DataShape:
        """What the data is like, without opening the pipeline (blocking: may read the files'
        metadata, in a worker thread)."""
        raise NotImplementedError

    @property
    def _delivery(self) -> Delivery:
        """Where batches go (the consumer's)."""
        return self._consumer.delivery

    @property
    def _shape(self) -> DataShape | None:
        """The data's shape, once looked at (the planner's)."""
        return self._planner.shape

    def _data_shape(self) -> DataShape:
        shape = self._planner.shape
        if shape is None:
            shape = self._look()
            self._planner.looked(shape)
        return shape

    # --- configuration ------------------------------------------------------------------------

    @property
    def config(self) -> LayerConfig:
        """The layer's properties, checked (read-only: the planner holds them, and a state
        loaded with ``seed=None`` gives them its seed)."""
        return self._planner.config

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
        return self._consumer.epoch

    @property
    def n_samples(self) -> int:
        """Samples in the whole source (all ranks); reads the files' metadata on first use if
        the layer was never opened."""
        return self._data_shape().n_samples

    @property
    def categories(self) -> dict[str, tuple[Any, ...]]:
        """The category names of each top that is a categorical group (AnnData's
        ``obs/cell_type``: the top's rows are its integer codes), in code order: code ``c``
        is ``categories[top][c]`` (AnnData writes ``-1`` for a missing value). Reads the
        files' metadata on first use if the layer was never opened, as ``len()`` does."""
        return dict(self._data_shape().categories)

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
        self._data_shape()
        return self._planner.plan(epoch, stream=stream)

    def set_epoch(self, epoch: int) -> None:
        """Serve ``epoch`` next, from its first batch (as ``DistributedSampler.set_epoch`` does
        for PyTorch; epochs otherwise advance by themselves). Not while an iterator is live."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigurationError(f"epoch must be an int >= 0, not {epoch!r}")
        if self._consumer.live() is not None:
            raise StateError("set_epoch while an iterator is live: finish or close it first")
        self._planner.forget_state()
        self._consumer.restart_at(epoch)

    def _set_part(self, part: int, parts: int) -> None:
        """Serve part ``part`` of ``parts`` of this rank's epochs, a contiguous run of each
        epoch's batches (a DataLoader worker's, for :mod:`asynchdf5.torch`; see
        :func:`~._replan.split_plan`): only on a closed layer with no state loaded."""
        if self._consumer.state != "closed" or self._planner.resume is not None:
            raise StateError("a layer's part can change only while it is closed, before a state")
        self._planner.set_part(check_part(part, parts))

    def _gather_into(self, memory: BatchMemory) -> None:
        """Gather host batches into buffers from ``memory`` (a DataLoader worker's shared
        memory, for :mod:`asynchdf5.torch`, which sends batches from there without copying
        them): only on a closed layer delivering to the host."""
        delivery = self._delivery
        if self._consumer.state != "closed" or not isinstance(delivery, HostDelivery):
            raise StateError("batch memory is set only on a closed layer delivering to the host")
        delivery.batch_memory = memory

    # --- resume (the rules: :mod:`._resume`) --------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the consumer is, as plain values (JSON-serialisable): pass it to
        :meth:`load_state_dict` of a layer over the same files and properties, and its next
        batch is exactly the one that would have come next here. Only batches handed to the
        consumer count, never prefetched ones."""
        self._data_shape()
        return self._planner.state(self._consumer.position())

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
        consumer = self._consumer
        if consumer.live() is not None:
            raise StateError("load_state_dict while an iterator is live: finish or close it first")
        self._data_shape()
        opened = consumer.opened
        open_rows = opened.slot_rows if consumer.state == "open" and opened is not None else None
        consumer.restart_at(self._planner.load(state, open_rows))

    # --- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self._open(None)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._consumer.close(exc_type, exc, tb)

    async def aclose(self) -> None:
        """Stop the pipeline and release everything (what leaving ``async with`` does)."""
        await self._consumer.close(None, None, None)

    @contextlib.asynccontextmanager
    async def _opened(self, portal: BlockingPortal) -> AsyncIterator[None]:
        """The layer open, on the event loop behind ``portal`` (what ``with`` enters there)."""
        await self._open(portal)
        try:
            yield
        except BaseException as exc:
            await self._consumer.close(type(exc), exc, exc.__traceback__)
            raise
        else:
            await self._consumer.close(None, None, None)

    async def _open(self, portal: BlockingPortal | None) -> None:
        """Open: the source builds the whole opening, which the consumer adopts."""
        consumer = self._consumer
        epoch = consumer.opening()  # a second opener gets a StateError before any await
        try:
            at = time.perf_counter()
            nice_steps()  # a bad ASYNCHDF5_NICE fails here, not in a pipeline thread
            opened = await self._open_source(epoch, portal, at)
        except BaseException:
            consumer.not_opened()
            raise
        reader = opened.reader
        self._read_paths, self._read_notes = reader.read_paths, reader.read_notes
        await consumer.open(opened)

    def __enter__(self) -> Self:
        if self._sync is not None:
            raise StateError("the layer is already open")
        # The layer enters its own opening through the bridge's portal: the bridge is handed
        # none of the layer's code, so control goes down once (on failure its loop stops).
        # Ctrl-C is held back but at the waits: wherever it comes, the layer holds the bridge
        # and closes it (``with`` calls no ``__exit__`` when ``__enter__`` raises).
        try:
            with interrupts_held():
                Bridge(self._opened, keep=self._keep)
        except BaseException:
            self.close()
            raise
        return self

    def _keep(self, bridge: Bridge) -> None:
        self._sync = bridge

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the pipeline and its event loop thread; release everything (idempotent)."""
        with interrupts_held():  # raised at the close's waits only: the bridge is let go of
            bridge = self._sync
            if bridge is not None:
                try:
                    bridge.close()
                finally:
                    self._sync = None

    # --- iterating ----------------------------------------------------------------------------

    def __aiter__(self) -> EpochIterator:
        """Iterate over one epoch (the next one)."""
        return EpochIterator(self._consumer, "epoch")

    def __iter__(self) -> Iterator[Batch]:
        """Iterate over one epoch (the next one), in a layer opened with ``with``."""
        return iter(EpochIterator(self._consumer, "epoch"))

    def stream(self) -> EpochIterator:
        """Iterate endlessly, Mocha-style: full batches that wrap across epoch boundaries.

        Every batch has ``batch_size`` rows (``drop_last`` does not apply); ``batch.epoch`` is the
        epoch the batch started in, and :attr:`epoch` counts the epochs passed. Use it with
        ``async for`` (or ``for``, in a layer opened with ``with``).
        """
        return EpochIterator(self._consumer, "stream")
