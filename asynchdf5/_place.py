"""Where the consumer is (:class:`Place`): the epochs finished, the live iterator, its position.

The position is what ``state_dict()`` saves: an epoch iteration's batches and samples handed
over in its epoch, or a stream's samples since the epoch it began at, turned into
``(mode, epoch, batches, samples)`` by :meth:`Place.position`. A :class:`Place` belongs to one
:class:`~._consumer.Consumer` and is written through its methods only, by that consumer (every
batch handed over is counted by :meth:`Place.count`, on the event loop or in a sync ``for``
loop's thread alike); it is kept apart so that the arithmetic of positions and epoch
boundaries reads on its own, away from the runs and the hand-over.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._pipeline import Mode

if TYPE_CHECKING:
    from ._iterator import EpochIterator
    from ._plan import EpochPlan

__all__ = ["Place", "Position"]

#: ``(mode, epoch, batches, samples)``: see :meth:`Place.position`.
Position = tuple[Mode, int, int, int]


class Place:
    """Where a layer's consumer is, from construction on, across openings (see the module)."""

    def __init__(self) -> None:
        #: Epochs finished (an epoch left early counts once the next iteration starts).
        self.epoch = 0
        #: The latest epoch the consumer got a batch of, while it may have left it early.
        self.touched: int | None = None
        # The live iterator, and where it is: batches yielded to it (not prefetched), in its
        # epoch; for a stream, the samples yielded since it began at epoch `start`.
        self._live: weakref.ReferenceType[EpochIterator] | None = None
        self.mode: Mode = "epoch"
        self.start = 0
        self.batches = 0
        self.samples = 0

    def live(self) -> EpochIterator | None:
        """The live iterator, if any (not one whose ``for`` loop ended without closing it)."""
        it = self._live() if self._live is not None else None
        return None if it is None or it.done or it.abandoned else it

    def settle(self) -> None:
        """The previous consumer left early: the epoch it was in is over."""
        if self.touched is not None:
            self.epoch = max(self.epoch, self.touched + 1)
        self.touched = None
        self._live = None

    def begin(self, it: EpochIterator) -> None:
        """``it`` becomes the live iterator, from the start of the next epoch."""
        self.settle()
        self._live = weakref.ref(it)
        self.mode, self.start, self.batches, self.samples = it.mode, self.epoch, 0, 0

    def count(self, mode: Mode, epoch: int, rows: int) -> None:
        """A batch of ``rows`` samples, begun in ``epoch``, reached the consumer in ``mode``."""
        if mode == "epoch" and epoch != self.start:
            self.start, self.batches, self.samples = epoch, 0, 0
        self.batches += 1
        self.samples += rows

    def touch(self, epoch: int) -> None:
        """The consumer got a batch of ``epoch`` (it may leave that epoch early)."""
        self.touched = epoch

    def ended(self, mode: Mode, epoch: int) -> None:
        """Every batch of ``epoch`` has been handed over (in ``mode``)."""
        self.epoch = epoch + 1
        self.touched = None
        if mode == "epoch":
            self.start, self.batches, self.samples = epoch + 1, 0, 0
            self._live = None

    def failed(self, mode: Mode) -> None:
        """The live iteration failed: the epoch it was in is over."""
        if self.touched is not None:
            self.epoch = max(self.epoch, self.touched + 1)
        elif mode == "epoch":
            self.epoch += 1
        self.touched = None
        self._live = None

    def drop(self, it: EpochIterator) -> None:
        """``it`` left before its end: it is no longer the live iterator."""
        if self._live is not None and self._live() is it:
            self._live = None

    def position(self, plan: Callable[..., EpochPlan]) -> Position:
        """``(mode, epoch, batches, samples)``: where the consumer is. An epoch: its batches and
        samples yielded so far; a stream: the samples of ``epoch`` yielded (batches 0). With no
        live consumer: the next epoch, from its start. ``plan(epoch, stream=True)``: a
        stream's plan of ``epoch`` (the planner's)."""
        if self.live() is None:
            touched = self.touched
            epoch = self.epoch if touched is None else max(self.epoch, touched + 1)
            return "epoch", epoch, 0, 0
        if self.mode == "epoch":
            return "epoch", self.start, self.batches, self.samples
        first = plan(self.start, stream=True).n_samples  # left of the stream's first epoch
        if self.samples < first:
            return "stream", self.start, 0, self.samples
        share = plan(self.start + 1, stream=True).n_samples
        rest = self.samples - first
        return "stream", self.start + 1 + rest // share, 0, rest % share

    def restart_at(self, epoch: int) -> None:
        """``epoch`` is next, from its start."""
        self.epoch = epoch
        self.touched = None
        self.start, self.batches, self.samples = epoch, 0, 0
