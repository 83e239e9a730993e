"""The planner: every question about the order of a layer's epochs, answered in one place.

:class:`Planner` is built with the layer (one per layer) and holds what fixes every epoch's
order once the data has been looked at: the properties, the data's :class:`~._shape.DataShape`,
a DataLoader worker's part, and a loaded state (:mod:`._resume`). It answers with pure plans
(:func:`~._plan.plan_epoch`, continued by :mod:`._replan`), the same on every rank, and keeps
the last few, so that the pipeline, ``len()`` and ``state_dict()`` agree without planning twice.
Planning a laned epoch of a large data set takes long enough to stall a step:
:meth:`Planner.plan_soon` plans in a worker thread, never on the event loop.

The planner sizes nothing: the blocks, first read and lanes are the shape's, and the rows a cache
slot holds (an elastically resumed epoch's larger chunks included) are fixed before it by
:mod:`._sizing` (or by a loaded state), so that an opening reaches the planner once.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import replace
from typing import Any

import anyio.to_thread

from ._config import LayerConfig
from ._errors import ConfigurationError
from ._mix import plan_mixed
from ._plan import EpochPlan, check_split, plan_epoch
from ._replan import skip_samples, split_plan
from ._resume import Loaded, Resume, fingerprint, load_state, resumed_plan, save_state
from ._schemas import check_elastic
from ._shape import DataShape

__all__ = ["Planner", "check_part"]

#: Plans a planner keeps (the epochs in flight: the one served, the next, and a stream's).
KEEP_PLANS = 4


class Planner:
    """Every question about the order of one layer's epochs (see the module docstring).

    Its state changes only through its methods: :meth:`looked` (the data's shape is known),
    :meth:`opening` (the same, checked, at open), :meth:`set_part` (a DataLoader worker's run
    of batches), :meth:`load` (a saved state) and :meth:`forget_state` (``set_epoch``). Each
    change drops the plans kept.

    The planner holds the layer's one :class:`~._config.LayerConfig` (the layer's ``config``
    reads it here): only :meth:`load` replaces it, when ``seed=None`` takes a state's seed.
    """

    def __init__(self, config: LayerConfig) -> None:
        self.config = config
        #: The data's shape (None: not looked at yet).
        self.shape: DataShape | None = None
        #: ``(part, parts)``: the contiguous run of each epoch's batches served (None: all).
        self.part: tuple[int, int] | None = None
        #: The state loaded (None: none, or ``set_epoch`` since).
        self.resume: Resume | None = None
        # An elastic resume's epoch is planned with the saved run's chunks (its rows were cut
        # by the saved run's shares); the epochs after it with this layer's own.
        self._resumed: DataShape | None = None
        self._plans: dict[tuple[int, bool], EpochPlan] = {}
        self._generation = 0  # a plan made in a thread is kept only if nothing changed since
        self._lock = threading.Lock()

    # --- what fixes the order -----------------------------------------------------------------

    def looked(self, shape: DataShape) -> None:
        """The data's shape is ``shape`` (looked at, or opened)."""
        self.shape = shape
        self._changed()

    def opening(self, shape: DataShape) -> None:
        """The layer opens over ``shape``: the split is checked (the same answer on every rank:
        from the configuration and the catalog) and the shape taken. Called once per opening,
        after :mod:`._sizing` fixed the shape and the rows a cache slot holds."""
        c = self.config
        check_split(shape.epoch_samples, c.batch_size, c.world_size, c.drop_last)
        if shape != self.shape:
            self.looked(shape)

    def set_part(self, part: tuple[int, int] | None) -> None:
        self.part = part
        self._changed()

    def forget_state(self) -> None:
        """Plan every epoch afresh (``set_epoch``): the loaded state no longer applies."""
        self.resume = self._resumed = None
        self._changed()

    def _changed(self) -> None:
        with self._lock:
            self._generation += 1
            self._plans = {}

    def shape_for(self, epoch: int) -> DataShape:
        """The shape ``epoch`` is planned with: an elastically resumed epoch's is the saved
        run's, every other epoch's this layer's."""
        r, resumed = self.resume, self._resumed
        if r is not None and resumed is not None and epoch == r.epoch:
            return resumed
        assert self.shape is not None, "the layer looks at its data before planning"
        return self.shape

    # --- plans --------------------------------------------------------------------------------

    def plan(self, epoch: int, *, stream: bool = False) -> EpochPlan:
        """The plan of ``epoch`` for this rank (pure; kept for the next asker). Blocking (long on a
        large laned data set): from the event loop, use :meth:`plan_soon`."""
        key = (epoch, stream)
        with self._lock:
            kept, generation = self._plans.get(key), self._generation
        if kept is not None:
            return kept
        made = self._make(epoch, stream)
        with self._lock:
            if generation == self._generation:
                if len(self._plans) >= KEEP_PLANS:
                    del self._plans[next(iter(self._plans))]
                self._plans[key] = made
        return made

    async def plan_soon(self, epoch: int, *, stream: bool = False) -> EpochPlan:
        """:meth:`plan`, made in a worker thread unless it is kept already. A wait cut short
        loses nothing: the plan is kept for the next asker."""
        with self._lock:
            kept = self._plans.get((epoch, stream))
        if kept is not None:
            return kept
        return await anyio.to_thread.run_sync(functools.partial(self.plan, epoch, stream=stream))

    def _make(self, epoch: int, stream: bool) -> EpochPlan:
        c = self.config
        shape = self.shape_for(epoch)
        part = self.part if not stream else None
        # A resident data set reads nothing after epoch 0: its later epochs are one chunk, a
        # uniform permutation from the first batch (a ramp would serve them in pieces, each
        # permuted within itself: its first batches would mix less than the rest).
        first_rows = None if shape.ramp_once and epoch > 0 else shape.first_rows

        def fresh(rank: int, world_size: int, stream: bool = stream) -> EpochPlan:
            order: dict[str, Any] = dict(
                epoch=epoch,
                batch_size=c.batch_size,
                chunk_size=shape.chunk_rows,
                shuffle=c.shuffle,
                seed=c.seed,
                rank=rank,
                world_size=world_size,
                drop_last=c.drop_last,
                first_rows=first_rows,
                stream=stream,
                block_size=shape.block_rows,
                ramp_lanes=shape.ramp_lanes,
                chunk_lanes=shape.chunk_lanes,
            )
            whole = (  # several streams mixed: their own planner
                plan_mixed(shape.streams, mode=c.batch_mode, **order)
                if shape.streams
                else plan_epoch(
                    shape.n_samples,
                    ramp_top_lanes=shape.ramp_top_lanes,
                    even_chunks=shape.even_chunks,
                    **order,
                )
            )
            return whole if part is None else split_plan(whole, *part)

        r = self.resume
        if r is None or epoch != r.epoch:
            return fresh(c.rank, c.world_size)
        if r.mode == "stream":
            return skip_samples(fresh(c.rank, c.world_size, stream=True), r.samples)
        return resumed_plan(
            r,
            lambda rank, world: fresh(rank, world, stream=False),
            rank=c.rank,
            world_size=c.world_size,
            drop_last=c.drop_last and not stream,
        )

    # --- resume (the rules are in :mod:`._resume`) --------------------------------------------

    def state(self, position: tuple[str, int, int, int]) -> dict[str, Any]:
        """The state of a consumer at ``position`` (see :func:`~._resume.save_state`)."""
        c = self.config
        return save_state(
            self.resume,
            position,
            seed=c.seed,
            rank=c.rank,
            world_size=c.world_size,
            fingerprint=fingerprint(self.shape_for(position[1]), c),
            part=self.part,
        )

    def load(self, state: object, open_rows: int | None) -> int:
        """Plan from ``state`` on (see :func:`~._resume.load_state`; ``open_rows``: the rows
        the open layer's cache slots hold, None when closed); the epoch it resumes."""
        assert self.shape is not None, "the layer looks at its data before loading a state"
        loaded: Loaded = load_state(
            state, shape=self.shape, config=self.config, part=self.part, open_rows=open_rows
        )
        r = loaded.resume
        if r.mode == "stream" or len(r.chain) > 1 or r.world_size != self.config.world_size:
            check_elastic(self.shape)  # the rest of its epoch is cut in order
        if not self.config.seed_given:
            self.config = replace(self.config, seed=loaded.resume.seed)
        self.shape, self._resumed, self.resume = loaded.shape, loaded.resumed, loaded.resume
        self._changed()
        return loaded.resume.epoch


def check_part(part: int, parts: int) -> tuple[int, int] | None:
    """``(part, parts)`` checked (None: the whole epoch)."""
    if not 0 <= part < parts:
        raise ConfigurationError(f"part {part} is outside 0 ... {parts - 1}")
    return None if parts == 1 else (part, parts)
