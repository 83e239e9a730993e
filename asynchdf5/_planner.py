"""The planner: every question about the order of a layer's epochs, answered in one place.

:class:`Planner` is built with the layer (one per layer) and holds what fixes every epoch's
order once the data has been looked at: the properties, the data's :class:`~._shape.DataShape`,
a DataLoader worker's part, and a loaded state (:mod:`._resume`). It answers with pure plans
(:func:`~._plan.plan_epoch`, continued by :mod:`._replan`), the same on every rank, and keeps
the last few, so that the pipeline, ``len()`` and ``state_dict()`` agree without planning twice.
Planning a laned epoch of a large data set takes up to about a second: :meth:`Planner.plan_soon`
plans in a worker thread, never on the event loop.

The heuristics that size an epoch's order live here too, from the properties and the files'
layout only (never the shard), so that every rank and every resumed run draws the same order:
the rows of a shuffled block (:func:`default_block_rows`), an epoch's first read and its ramp's
lanes (:func:`first_read`), and the lanes of every chunk (:func:`chunk_lanes`).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, replace
from typing import Any

import anyio.to_thread

from ._config import (
    BLOCK_BYTES,
    BLOCKS_PER_CHUNK,
    MIN_BLOCK_BYTES,
    MIN_BLOCKS_PER_CHUNK,
    MIN_LANE_BYTES,
    MIN_PLACES,
    RAMP_LANES,
    RAMP_TOP_LANES,
    STORED_CHUNKS_PER_BLOCK,
    LayerConfig,
)
from ._errors import ConfigurationError
from ._mix import plan_mixed
from ._plan import EpochPlan, check_split, plan_epoch
from ._replan import skip_samples, split_plan
from ._resume import Loaded, Resume, fingerprint, load_state, resumed_plan, save_state
from ._schemas import check_elastic
from ._shape import DataShape

__all__ = [
    "RAMP_BYTES",
    "Order",
    "Planner",
    "chunk_lanes",
    "default_block_rows",
    "first_read",
    "lane_part_rows",
    "mixing_warning",
    "order_of",
    "ramp_lanes",
]

#: Rows of the first chunk of an epoch are ramped up from about this many bytes, so the first
#: batch waits for a small read rather than a whole chunk.
RAMP_BYTES = 8 * 2**20


def first_read(
    batch_size: int, row_bytes: int, shuffle: bool, stored_rows: int = 0, request_bytes: int = 0
) -> tuple[int, int]:
    """An epoch's first read: its rows and the lanes of its ramp (1 unshuffled).

    About :data:`RAMP_BYTES` of rows, and enough for a whole batch even when the shares of the
    ramp's lanes are rounded down (each up to a row short: see :func:`~._plan.plan_epoch`), so
    that the first batch waits for the first piece alone. The lanes are chosen for a read of a
    batch or :data:`RAMP_BYTES` (:func:`ramp_lanes`), and are no more than a batch's rows (more
    add nothing to the first batch's mix); the read then grows by what their rounding can
    lose, ``lanes - 1`` rows (not ``RAMP_LANES - 1`` whatever the lanes: a first batch of a few
    large rows would wait for dozens). States saved with another first read keep theirs
    (:mod:`._resume`).

    Shuffled data in stored chunks decoded whole (``stored_rows``) is read at least
    :data:`RAMP_LANES` stored chunks first, so that the first piece still draws from that many
    places: a part of a stored chunk decodes it whole anyway, and with chunks of 1,024 rows of
    1 KiB the 8 MiB first read drew from 8 (its batches of class-sorted data at 0.77-0.80 of a
    permutation's label entropy; from 32, 0.98 or more).
    """
    ramp = RAMP_BYTES // max(1, row_bytes)
    lanes = 1
    if shuffle:
        ramp = max(ramp, RAMP_LANES * stored_rows)
        base = max(batch_size, ramp)
        lanes = min(ramp_lanes(base, row_bytes, stored_rows, request_bytes), batch_size)
    return max(batch_size + lanes - 1, ramp), lanes


def ramp_lanes(first: int, row_bytes: int, stored_rows: int = 0, request_bytes: int = 0) -> int:
    """Lanes of the ramp (see :func:`~._plan.plan_epoch`): up to :data:`RAMP_LANES`, as long as
    each lane's part of the first piece (``first`` rows) is at least ``MIN_LANE_BYTES``, a
    stored chunk decoded whole (``stored_rows``) and a remote request (``request_bytes``): the
    first read stays a few large requests, and compressed data is not decoded many times over.
    From the properties and the files' layout only, as the blocks are."""
    row_bytes = max(1, row_bytes)
    lane = max(1, MIN_LANE_BYTES // row_bytes, stored_rows, -(-request_bytes // row_bytes))
    return max(1, min(RAMP_LANES, first // lane))


def lane_part_rows(row_bytes: int, stored_rows: int = 0, request_bytes: int = 0) -> int:
    """The fewest rows of a chunk's lane part (:func:`chunk_lanes`): ``MIN_LANE_BYTES``,
    ``STORED_CHUNKS_PER_BLOCK`` stored chunks decoded whole (as blocks span) and a remote
    request."""
    row_bytes = max(1, row_bytes)
    return max(
        1,
        MIN_LANE_BYTES // row_bytes,
        STORED_CHUNKS_PER_BLOCK * stored_rows,
        -(-request_bytes // row_bytes),
    )


def chunk_lanes(
    chunk_rows: int,
    block_rows: int | None,
    row_bytes: int,
    stored_rows: int = 0,
    request_bytes: int = 0,
) -> int:
    """Lanes of every chunk (see :func:`~._plan.plan_epoch`): 1 when a chunk holds
    ``BLOCKS_PER_CHUNK`` blocks (``MIN_PLACES`` of compressed or remote data), else up
    to ``BLOCKS_PER_CHUNK``, so that a chunk still draws from enough
    places of the data set for its batches to mix when the cache had to shrink (a small memory
    budget) or the rows are narrow. Each lane's part of a chunk keeps :func:`lane_part_rows`.

    Unlike the blocks, the lanes may depend on the cache (``chunk_rows``): they cut this rank's
    share into chunks, and never change which samples a rank serves.
    """
    # Compressed data and remote objects take lanes only below MIN_PLACES blocks a chunk (the
    # fewest that mix to the promise), their blocks being kept a few stored chunks or a request
    # long (:func:`default_block_rows`); below 36, from 16 up, chunks of class-sorted rows
    # in stored chunks mixed to 0.92 of a permutation, with no warning.
    want = MIN_PLACES if stored_rows or request_bytes else BLOCKS_PER_CHUNK
    if block_rows is None or chunk_rows // block_rows >= want:
        return 1
    part = lane_part_rows(row_bytes, stored_rows, request_bytes)
    return max(1, min(BLOCKS_PER_CHUNK, chunk_rows // part))


def mixing_warning(
    chunk_rows: int,
    block_rows: int | None,
    lanes: int,
    row_bytes: int,
    stored_rows: int = 0,
    request_bytes: int = 0,
) -> str | None:
    """Why the chunks will not mix class-sorted data to the documented 0.95 (None: they will):
    a chunk drawing from fewer than ``MIN_PLACES`` places, its blocks and lanes, because the
    cache is too small for that many lane parts of ``MIN_LANE_BYTES`` (or of a stored chunk
    decoded whole, or a remote request: see :func:`chunk_lanes`), with the cache that would."""
    if block_rows is None:
        return None
    places = lanes + chunk_rows // block_rows
    if places >= MIN_PLACES:
        return None
    need = 2 * MIN_PLACES * lane_part_rows(row_bytes, stored_rows, request_bytes) * row_bytes
    return (
        f"chunks of {chunk_rows} samples draw from {places} places of the data set, fewer than "
        f"the {MIN_PLACES} that mix class-sorted data to 0.95 of a full permutation: give the "
        f"cache at least {need / 2**20:.0f} MiB (cache_bytes), or lower block_size"
    )


def default_block_rows(
    row_bytes: int, chunk_size: int, stored_rows: int = 0, request_bytes: int = 0
) -> int:
    """Rows of a block for ``block_size=None``: about ``BLOCK_BYTES`` of samples (reads near
    the disk's sequential rate), but no more than ``chunk_size``'s share of ``BLOCKS_PER_CHUNK``
    blocks (each chunk draws from enough of the data set for its batches to mix), and never
    less than ``MIN_BLOCK_BYTES`` (so a small ``chunk_size`` does not make tiny blocks).

    ``stored_rows``: the rows of the largest stored chunk that is decoded whole (the raw-chunk
    path). A block shorter than a few of them would decode each several times over (every
    block decodes the stored chunks it touches whole), so blocks span at least
    ``STORED_CHUNKS_PER_BLOCK`` of them, as long as a chunk keeps ``MIN_BLOCKS_PER_CHUNK``.

    ``request_bytes``: the bytes one read request of the files should move at least (remote
    objects: a whole request, see :attr:`~._sources.StoredFile.request_bytes`). Each block is at
    least one request, and small requests to an object store cost a round trip and the
    client's work each, so blocks are at least this big, again as long as a chunk
    keeps ``MIN_BLOCKS_PER_CHUNK``.

    From the properties and the files' layout only, never from the data set's size, the shard
    or the cache: every rank, every world size and every resumed run draws the same blocks.
    """
    row_bytes = max(1, row_bytes)
    rows = min(BLOCK_BYTES // row_bytes, chunk_size // BLOCKS_PER_CHUNK)
    want = max(STORED_CHUNKS_PER_BLOCK * stored_rows, request_bytes // row_bytes)
    floor = min(want, chunk_size // MIN_BLOCKS_PER_CHUNK)
    return max(1, rows, floor, MIN_BLOCK_BYTES // row_bytes)


@dataclass(frozen=True)
class Order:
    """How a layer's epochs are cut, from its properties and its files' layout (see
    :func:`order_of`)."""

    block_rows: int | None  # None: unshuffled
    first_rows: int
    ramp_lanes: int
    chunk_lanes: int
    ramp_top_lanes: int | None  # None: unshuffled (the ramp's pieces are stretches)
    #: Why the chunks will not mix class-sorted data well (None: they will).
    warning: str | None


def order_of(
    config: LayerConfig,
    row_bytes: int,
    chunk_rows: int,
    stored_rows: int = 0,
    request_bytes: int = 0,
    stored_shuffled: bool = False,
) -> Order:
    """The blocks, first read and lanes of a layer with ``config`` over rows of ``row_bytes``,
    cached in chunks of ``chunk_rows`` (``stored_rows``, ``request_bytes``: see
    :func:`default_block_rows`). A ``block_size`` given is the order asked for: no lanes.

    ``stored_shuffled``: every file says its samples were written in a random order
    (``pack --shuffle``): any stretch of rows is already a random draw of the data set, so
    nothing needs reading from many places. Blocks are then ``chunk_size`` rows and nothing is
    laned: each chunk, and each piece of the ramp, is one or two sequential reads, and its
    samples are served in a random order, as a permutation's batches would hold them (unless a
    ``block_size`` is given: the order asked for).
    """
    c = config
    block = None
    if c.shuffle:
        block = c.block_size or default_block_rows(
            row_bytes, c.chunk_size, stored_rows, request_bytes
        )
    first, lanes = first_read(c.batch_size, row_bytes, c.shuffle, stored_rows, request_bytes)
    if c.shuffle and stored_shuffled and c.block_size is None:
        first = first_read(c.batch_size, row_bytes, False)[0]  # one stretch: no lanes to round
        return Order(c.chunk_size, first, 1, 1, None, None)
    laned = (
        chunk_lanes(chunk_rows, block, row_bytes, stored_rows, request_bytes)
        if c.block_size is None
        else 1
    )
    why = mixing_warning(chunk_rows, block, laned, row_bytes, stored_rows, request_bytes)
    top = RAMP_TOP_LANES if c.shuffle else None
    return Order(block, first, lanes, laned, top, why)


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

    def opening(self, shape: DataShape, epoch: int) -> int:
        """The layer opens over ``shape`` at ``epoch``: the split is checked (the same answer
        on every rank: from the configuration and the catalog), the shape taken, and the rows
        a cache slot must hold returned (:meth:`cache_rows`). Called once per opening, before
        the cache is allocated."""
        c = self.config
        check_split(shape.epoch_samples, c.batch_size, c.world_size, c.drop_last)
        if shape != self.shape:
            self.looked(shape)
        return self.cache_rows(shape, epoch)

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

    def cache_rows(self, shape: DataShape, epoch: int) -> int:
        """The rows a cache slot must hold when the layer opens with ``shape`` at ``epoch``:
        its chunks', and an elastically resumed epoch's still to come."""
        r, resumed = self.resume, self._resumed
        if r is not None and resumed is not None and epoch <= r.epoch:
            return max(shape.chunk_rows, resumed.chunk_rows)
        return shape.chunk_rows

    # --- plans --------------------------------------------------------------------------------

    def plan(self, epoch: int, *, stream: bool = False) -> EpochPlan:
        """The plan of ``epoch`` for this rank (pure; kept for the next asker). Blocking for up
        to about a second on a large laned data set: from the event loop, use
        :meth:`plan_soon`."""
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
        """:meth:`plan`, made in a worker thread unless it is kept already."""
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
