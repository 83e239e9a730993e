"""What a layer knows of its data once it has looked at it (:class:`DataShape`).

The sizes that, with the seed and the epoch, fix every epoch's order: the planner
(:mod:`._planner`) plans from them, and a saved state (:mod:`._resume`) carries them, so that a
resumed run plans exactly as the run that saved it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._mix import StreamRows

__all__ = ["DataShape"]


@dataclass(frozen=True)
class DataShape:
    """What a layer knows of its data once it has looked at it: sizes, and the effective rows
    of its chunks, blocks and first reads (which, with the seed, fix every epoch's order)."""

    n_samples: int
    row_bytes: int
    files: tuple[tuple[str, int], ...]  # (file name, rows)
    tops: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, sample shape)
    chunk_rows: int
    block_rows: int | None
    first_rows: int | None
    resident: bool
    ramp_lanes: int = 1  # places each piece of the first read's ramp is taken from
    chunk_lanes: int = 1  # places each chunk is taken from, besides its blocks
    #: The most places a piece of the ramp draws from, each piece twice the lanes of the one
    #: before (:func:`~._walk.growing_ramp`); None: every piece ``ramp_lanes`` (states saved
    #: before growing lanes).
    ramp_top_lanes: int | None = None
    #: The ramp is epoch 0's only: the data set is resident, so later epochs read nothing and
    #: are served as one chunk, a uniform permutation from their first batch (False: states
    #: saved before, and streaming data, ramp every epoch).
    ramp_once: bool = False
    #: A shuffled share is cut into chunks of equal sizes, not full ones and a remainder
    #: (:func:`~._plan.plan_epoch`); False: states saved before.
    even_chunks: bool = False
    #: The tops cut as :class:`~asynchdf5.Windows`: ``(name, length, stride)`` each. Another
    #: stride can cut as many windows of the same shape: only these tell the samples apart.
    windows: tuple[tuple[str, int, int], ...] = ()
    #: Several streams mixed (:mod:`._mix`): each one's rows and samples per epoch; () for one.
    streams: tuple[StreamRows, ...] = ()
    #: The category names of the tops that are categorical groups, in code order (what the data
    #: says, not what fixes the order: no part of a state or of a comparison).
    categories: tuple[tuple[str, tuple[Any, ...]], ...] = field(default=(), compare=False)

    @property
    def stretches(self) -> bool:
        """Whether each chunk is read as one or two long stretches of rows: unshuffled, or
        shuffled in blocks of at least a chunk with no lanes (data packed shuffled,
        :func:`~._sizing.order_of`). Streamed from the disk, such chunks are read as an
        unshuffled epoch's are, whatever the order of the chunks."""
        if self.block_rows is None:
            return True
        return self.block_rows >= self.chunk_rows and self.chunk_lanes <= 1

    @property
    def epoch_samples(self) -> int:
        """Samples of an epoch over every rank (before ``drop_last``): the streams' counts."""
        return sum(s.count for s in self.streams) if self.streams else self.n_samples
