"""The sizes an HDF5 layer fixes from its catalog: the cache's chunks and the order's shape.

The cache, fitted to the memory budget (:func:`size_cache`, :func:`cache_plan`): a third of the
room the process has by default (:func:`default_cache_bytes`), chunks shrunk to fit it with a
:class:`CacheBudgetWarning`. The order's heuristics, from the properties and the files' layout
only (never the shard), so that every rank and every resumed run draws the same order: the rows
of a shuffled block (:func:`default_block_rows`), an epoch's first read and its ramp's lanes
(:func:`first_read`), and the lanes of every chunk (:func:`chunk_lanes`), together
:func:`order_of`. :func:`shape_of` puts the order's sizes, or a loaded state's, into the one
:class:`~._shape.DataShape` that every plan and saved state agrees on; :func:`size_opening` adds
the rows a cache slot holds (:func:`held_rows`). No I/O but the memory figures of
:mod:`._machine`, and below the planner, which only plans from that shape: an opening sizes
here, once, then reaches the planner once.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ._cache import N_SLOTS
from ._catalog import Catalog, TopInfo
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
from ._machine import memory_bytes, memory_room
from ._mix import StreamRows
from ._pipeline import MIN_GROUP_BYTES, RING_GROUPS
from ._plan import shard_share
from ._shape import DataShape
from ._state import Resume

__all__ = [
    "N_SLOTS",
    "RAMP_BYTES",
    "CacheBudgetWarning",
    "CachePlan",
    "Order",
    "Sized",
    "cache_plan",
    "chunk_lanes",
    "default_block_rows",
    "default_cache_bytes",
    "first_read",
    "heap_bytes",
    "held_rows",
    "lane_part_rows",
    "mixing_warning",
    "order_of",
    "ramp_lanes",
    "shape_of",
    "size_cache",
    "size_opening",
    "slot_rows",
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
    places: a part of a stored chunk decodes it whole anyway, and a first read of a few large
    stored chunks draws from too few places to mix class-sorted data (docs/design-notes.md).
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
    # long (:func:`default_block_rows`); fewer places mix class-sorted rows in stored chunks
    # below the promise, with no warning.
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
    path), weighed by its top's share of a sample's bytes (:func:`stored_rows`). A block
    shorter than a few of them would decode each several times over (every block decodes the
    stored chunks it touches whole), so blocks span at least ``STORED_CHUNKS_PER_BLOCK`` of
    them, as long as a chunk keeps ``MIN_BLOCKS_PER_CHUNK``.

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
    value_rows: int = 0,
) -> Order:
    """The blocks, first read and lanes of a layer with ``config`` over rows of ``row_bytes``,
    cached in chunks of ``chunk_rows`` (``stored_rows``, ``request_bytes``: see
    :func:`default_block_rows`). A ``block_size`` given is the order asked for: no lanes.

    ``value_rows``: the rows a ragged top's stored chunk of values spans, weighed as
    ``stored_rows`` is (:func:`value_rows`). Its blocks and first read span a few of them, as
    they do stored chunks of rows; its lane parts too, but only as long as a chunk keeps
    ``MIN_PLACES`` lanes: a chunk at a part's edge is decoded by both parts (twice), but fewer
    places mix class-sorted data worse, and that is the promise (a sparse ``.h5ad``'s value
    chunks of a few dozen rows were cut by lane parts of 256 KiB, about one chunk: each chunk
    decoded twice an epoch).

    ``stored_shuffled``: every file says its samples were written in a random order
    (``pack --shuffle``): any stretch of rows is already a random draw of the data set, so
    nothing needs reading from many places. Blocks are then ``chunk_size`` rows and nothing is
    laned: each chunk, and each piece of the ramp, is one or two sequential reads, and its
    samples are served in a random order, as a permutation's batches would hold them (unless a
    ``block_size`` is given: the order asked for).
    """
    c = config
    stored = max(stored_rows, value_rows)
    block = None
    if c.shuffle:
        block = c.block_size or default_block_rows(row_bytes, c.chunk_size, stored, request_bytes)
    first, lanes = first_read(c.batch_size, row_bytes, c.shuffle, stored, request_bytes)
    if c.shuffle and stored_shuffled and c.block_size is None:
        first = first_read(c.batch_size, row_bytes, False)[0]  # one stretch: no lanes to round
        return Order(c.chunk_size, first, 1, 1, None, None)
    # The lanes' stored chunks: a ragged top's as far as MIN_PLACES parts of a chunk allow.
    keeps = chunk_rows // (MIN_PLACES * STORED_CHUNKS_PER_BLOCK)
    laned_rows = max(stored_rows, min(value_rows, keeps))
    laned = (
        chunk_lanes(chunk_rows, block, row_bytes, laned_rows, request_bytes)
        if c.block_size is None
        else 1
    )
    why = mixing_warning(chunk_rows, block, laned, row_bytes, laned_rows, request_bytes)
    top = RAMP_TOP_LANES if c.shuffle else None
    return Order(block, first, lanes, laned, top, why)


def request_bytes(catalog: Catalog) -> int:
    """The bytes a read request of the source's files should move at least (0: any)."""
    return max((f.file.request_bytes for f in catalog.files), default=0)


def stored_rows(catalog: Catalog) -> int:
    """Rows of the whole sample that hold as many bytes as the largest stored chunk the reader
    decodes whole (0: none).

    A stored chunk is weighed by its top's share of a sample's bytes (ragged values counted on
    average): the order's heuristics keep blocks and lanes a few stored chunks long so that no
    chunk is decoded many times over, and that cost is the chunk's bytes. A narrow column
    gzipped in long chunks (an AnnData ``obs`` column: thousands of rows of a few bytes) costs
    little to decode again; counted in its own rows, it made blocks of tens of thousands of
    samples, and a small cache's chunks then drew from one place of the data set.
    """
    row_bytes = catalog.mean_row_bytes
    return max(
        (
            _weighed(layout.chunks.rows, catalog.tops[name], row_bytes)
            for f in catalog.files
            for name, layout in f.layouts.items()
            if layout.chunks is not None
            and name in catalog.tops
            and name not in f.ragged  # a ragged top's stored chunks hold values: value_rows
            # Unfiltered whole-sample chunks are read row by row, as contiguous data is.
            and (layout.filters or layout.chunks.splits_samples)
        ),
        default=0,
    )


def value_rows(catalog: Catalog) -> int:
    """The rows the largest stored chunk of a ragged top's values (or of a sparse top's column
    indices) that the reader decodes whole spans, weighed as :func:`stored_rows` weighs a stored
    chunk of rows (0: none).

    Such a chunk holds values, not rows: it spans its values over the top's mean values a row
    (no more than its file's rows), and decoding it again costs its top's share of a sample's
    bytes. AnnData's gzipped ``X/data`` and ``X/indices`` of 20,000 genes: chunks of 27,683
    values, about 25 cells. Unfiltered chunks of whole values are read in place: none.
    """
    row_bytes = catalog.mean_row_bytes
    most = 0
    for f in catalog.files:
        for name, parts in f.ragged.items():
            top = catalog.tops.get(name)
            if top is None or top.ragged is None or top.ragged.mean_values <= 0:
                continue
            for values in (parts.data, parts.indices):
                if values is None or values.chunks is None:
                    continue
                index = values.chunks
                # Unfiltered chunks of whole values are read in place, as contiguous data is.
                if not (values.filters or index.splits_samples):
                    continue
                spans = min(index.rows / top.ragged.mean_values, f.nrows)
                most = max(most, _weighed(spans, top, row_bytes))
    return most


def _weighed(rows: float, top: TopInfo, row_bytes: int) -> int:
    """Rows of the whole sample (``row_bytes`` on average) that hold as many bytes as ``rows``
    rows of ``top`` (its bytes a row on average: a ragged top's values count), rounded up: a
    stored chunk's weight (:func:`stored_rows`, :func:`value_rows`). Multiplied before it is
    divided, so that whole numbers (a top of fixed rows) give the exact ceiling."""
    return math.ceil(rows * min(top.mean_row_bytes, row_bytes) / row_bytes)


def stored_shuffled(catalog: Catalog) -> bool:
    """Whether every file with rows says its samples were written in a random order."""
    return all(f.shuffled for f in catalog.files if f.nrows)


# --- the cache, fitted to the memory budget ---------------------------------------------------


class CacheBudgetWarning(UserWarning):
    """``chunk_size`` samples per slot would not fit ``cache_bytes``: the chunks were shrunk."""


def default_cache_bytes(*, held: bool = True) -> int:
    """The default budget of the host cache: a third of the room this process has when the
    layer opens (the machine's memory, or its container's limit, less what is held under it
    already: :func:`~._machine.memory_room`), so that a training process's own memory, and
    as much again for what it allocates later and the page cache, stays free. Rounded down to
    three significant bits, so that the chunks, and the order they make, stay the same from run
    to run while what is held differs a little.

    ``held=False`` (a rank of several): a third of the memory alone, whatever is held. The
    cache's size fixes the order, which every rank must plan alike, and what each rank holds
    differs."""
    if not held:
        return memory_bytes() // 3 or 4 * 2**30
    room = memory_room()
    if room is None:
        return 4 * 2**30
    third = max(1, room.free // 3)
    step = 1 << max(0, third.bit_length() - 3)
    return third // step * step


def _default_words(budget: int) -> str:
    """Where the default budget comes from, for a message that says it is too small."""
    room = memory_room()
    if room is None:
        return f"cache_bytes={budget}"
    return f"the default cache_bytes={budget} (a third of the room left under {room})"


def slot_rows(chunk_size: int, shard_samples: int, row_bytes: int, cache_bytes: int) -> int:
    """Rows per slot: ``chunk_size``, no more than the shard holds, shrunk to fit the budget."""
    rows = min(chunk_size, shard_samples)
    fit = cache_bytes // (N_SLOTS * max(1, row_bytes))
    if fit < rows:
        warnings.warn(
            f"chunk_size={chunk_size} samples of {row_bytes} bytes in {N_SLOTS} cache slots "
            f"would take {N_SLOTS * rows * row_bytes / 2**30:.2f} GiB, more than "
            f"cache_bytes={cache_bytes / 2**30:.2f} GiB: using chunks of {max(1, fit)} samples",
            CacheBudgetWarning,
            stacklevel=2,
        )
        rows = max(1, fit)
    return rows


def heap_bytes(tops: Mapping[str, TopInfo]) -> Callable[[int], int] | None:
    """Bytes of the ragged tops' heaps in a slot of ``rows`` rows (None: no ragged top)."""
    ragged = [t for t in tops.values() if t.ragged is not None]
    if not ragged:
        return None

    def of(rows: int) -> int:
        return sum(t.ragged.slot_values(rows) * t.value_bytes for t in ragged if t.ragged)

    return of


def holds_whole(n: int, nbytes: int, chunk_size: int, budget: int) -> bool:
    """Whether a data set of ``n`` samples, ``nbytes`` in all (its ragged tops' values
    included), is cached resident: it is one chunk and fits the budget, so each sample is read
    once. The one statement of the rule: the layer's cache plan and ``inspect``'s note ask it."""
    return n <= chunk_size and nbytes <= budget


@dataclass(frozen=True)
class CachePlan:
    """How a source is cached: chunks of ``chunk_rows`` samples, or ``resident`` (read once)."""

    chunk_rows: int
    resident: bool
    budget: int
    shrunk: bool = False  # chunks hold fewer rows than chunk_size and the shard give: the budget


def size_cache(
    n: int,
    row_bytes: int,
    *,
    batch_size: int,
    world_size: int,
    chunk_size: int,
    cache_bytes: int | None,
    rows: int | None = None,
    heaps: Callable[[int], int] | None = None,
) -> CachePlan:
    """Size the cache for ``n`` samples of ``row_bytes`` (the same answer on every rank).

    Raises :class:`ConfigurationError` when the budget cannot hold a batch in each slot; warns
    (:class:`CacheBudgetWarning`) when the chunks must shrink to fit it. ``rows``: chunks of
    exactly that many rows (a resumed run's), or a :class:`ConfigurationError`. ``heaps``: the
    bytes a slot of so many rows needs besides (ragged tops' values, :func:`heap_bytes`): the
    chunks are sized in bytes, so that no slot's heap can overflow whichever rows it holds.
    """
    if heaps is not None:
        return _size_ragged(
            n,
            row_bytes,
            heaps,
            batch_size=batch_size,
            world_size=world_size,
            chunk_size=chunk_size,
            cache_bytes=cache_bytes,
            rows=rows,
        )
    share = shard_share(n, batch_size, 0, world_size)[1]  # rank 0's: the same on every rank
    budget = cache_bytes if cache_bytes is not None else default_cache_bytes(held=world_size == 1)
    batch_rows = min(batch_size, max(1, share))
    need = N_SLOTS * batch_rows * row_bytes
    if need > budget:
        what = f"cache_bytes={budget}" if cache_bytes is not None else _default_words(budget)
        raise ConfigurationError(
            f"{what} cannot hold what the pipeline needs: {N_SLOTS} cache slots of "
            f"a batch each, {batch_rows} samples of {row_bytes} bytes per slot, {need} bytes; "
            "raise cache_bytes (where the memory allows it) or lower batch_size"
        )
    if rows is not None:
        if N_SLOTS * rows * row_bytes > budget:
            raise ConfigurationError(
                f"the saved run cached chunks of {rows} samples of {row_bytes} bytes; "
                f"cache_bytes={budget} cannot hold {N_SLOTS} of them: raise cache_bytes"
            )
        chunk_rows = rows
    else:
        chunk_rows = slot_rows(chunk_size, max(1, share), row_bytes, budget)
    resident = holds_whole(n, n * row_bytes, chunk_size, budget)
    shrunk = chunk_rows < min(chunk_size, max(1, share))
    return CachePlan(chunk_rows, resident, budget, shrunk)


def _size_ragged(
    n: int,
    row_bytes: int,
    heaps: Callable[[int], int],
    *,
    batch_size: int,
    world_size: int,
    chunk_size: int,
    cache_bytes: int | None,
    rows: int | None,
) -> CachePlan:
    """:func:`size_cache` with ragged tops: a slot of ``r`` rows takes
    ``r * row_bytes + heaps(r)`` bytes (``heaps`` grows with ``r``: the values chunks of ``r``
    rows hold, :meth:`~._ragged_tops.RaggedInfo.slot_values`)."""
    share = shard_share(n, batch_size, 0, world_size)[1]
    budget = cache_bytes if cache_bytes is not None else default_cache_bytes(held=world_size == 1)

    def slot(r: int) -> int:
        return r * row_bytes + heaps(r)

    batch_rows = min(batch_size, max(1, share))
    need = N_SLOTS * slot(batch_rows)
    if need > budget:
        what = f"cache_bytes={budget}" if cache_bytes is not None else _default_words(budget)
        raise ConfigurationError(
            f"{what} cannot hold what the pipeline needs: {N_SLOTS} cache slots of a batch "
            f"each, and {batch_rows} rows of the ragged tops take up to {slot(batch_rows)} "
            f"bytes where their longest rows lie together ({need} bytes in all); raise "
            "cache_bytes (where the memory allows it) or lower batch_size"
        )
    want = min(chunk_size, max(1, share))
    if rows is not None:
        if N_SLOTS * slot(rows) > budget:
            raise ConfigurationError(
                f"the saved run cached chunks of {rows} samples, whose rows take "
                f"{slot(rows)} bytes; cache_bytes={budget} cannot hold {N_SLOTS} of them: "
                "raise cache_bytes"
            )
        chunk_rows = rows
    elif N_SLOTS * slot(want) <= budget:
        chunk_rows = want
    else:  # the most rows whose slots fit (slot() grows with r): a binary search
        lo, hi = batch_rows, want
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if N_SLOTS * slot(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        chunk_rows = lo
        warnings.warn(
            f"chunk_size={chunk_size} samples with rows of varying length would take up to "
            f"{N_SLOTS * slot(want) / 2**30:.2f} GiB in {N_SLOTS} cache slots, more than "
            f"cache_bytes={budget / 2**30:.2f} GiB: using chunks of {chunk_rows} samples",
            CacheBudgetWarning,
            stacklevel=3,
        )
    resident = holds_whole(n, slot(n), chunk_size, budget)
    shrunk = chunk_rows < want
    return CachePlan(chunk_rows, resident, budget, shrunk)


def cache_plan(catalog: Catalog, config: LayerConfig, rows: int | None) -> CachePlan:
    """The cache for ``catalog`` under ``config``'s budget; ``rows``: chunks of that many rows
    (a loaded state's), else as the properties and the budget give
    (:class:`~._errors.ConfigurationError` when the budget cannot hold them)."""
    c = config
    plan = size_cache(
        catalog.n_samples,
        catalog.row_bytes,
        batch_size=c.batch_size,
        world_size=c.world_size,
        chunk_size=c.chunk_size,
        cache_bytes=c.cache_bytes,
        rows=rows,
        heaps=heap_bytes(catalog.tops),
    )
    if c.cache_bytes is None and c.world_size == 1:  # (ranks: see default_cache_bytes)
        check_room(plan.budget, min(c.batch_size, catalog.n_samples) * catalog.row_bytes)
    return plan


def check_room(budget: int, batch_bytes: int) -> None:
    """:class:`ConfigurationError` when the default cache ``budget`` (a third of the room this
    process has: :func:`default_cache_bytes`) cannot hold the least the pipeline needs
    (two cache slots of a batch, and its ring of batch buffers): then the rest of the process
    would not have room either, and the kernel would kill it for memory mid-epoch. Named at
    open instead, with the limit and what to set."""
    least = N_SLOTS * batch_bytes + RING_GROUPS * max(MIN_GROUP_BYTES, batch_bytes)
    room = memory_room()
    if budget >= least or room is None:
        return
    raise ConfigurationError(
        f"{room} leaves {room.free / 2**20:.1f} MiB: too little for the layer's cache and "
        f"batch buffers (at least {least / 2**20:.1f} MiB, and by default no more than a third "
        "of the room, so that the rest of the process has its share): free memory before "
        "opening the layer or raise the limit, or size the cache yourself with cache_bytes= "
        "(lowering batch_size shrinks both)"
    )


def shape_of(
    catalog: Catalog,
    streams: tuple[StreamRows, ...],
    config: LayerConfig,
    forced: DataShape | None,
) -> DataShape:
    """The data's shape, and how it is cached: as ``forced`` (a loaded state's) says, else as
    the properties and the budget give. A cache the budget shrank warns
    (:class:`CacheBudgetWarning`) when the order's heuristics say what that costs."""
    n, row_bytes = catalog.n_samples, catalog.row_bytes
    cache = cache_plan(catalog, config, forced.chunk_rows if forced is not None else None)
    if forced is not None:
        block, first, lanes = forced.block_rows, forced.first_rows, forced.ramp_lanes
        laned, top, once = forced.chunk_lanes, forced.ramp_top_lanes, forced.ramp_once
        even = forced.even_chunks
    else:
        stored, request = stored_rows(catalog), request_bytes(catalog)
        order = order_of(
            config,
            catalog.mean_row_bytes,  # ragged tops: their values too
            cache.chunk_rows,
            stored,
            request,
            stored_shuffled(catalog),
            value_rows(catalog),
        )
        block, first = order.block_rows, order.first_rows
        lanes, laned, top = order.ramp_lanes, order.chunk_lanes, order.ramp_top_lanes
        once, even = cache.resident, True
        # Warned of when the budget shrank the cache, not when the properties asked for it.
        if order.warning is not None and cache.shrunk:
            warnings.warn(order.warning, CacheBudgetWarning, stacklevel=3)
    return DataShape(
        n_samples=n,
        row_bytes=row_bytes,
        files=tuple((os.path.basename(f.name), f.nrows) for f in catalog.files),
        tops=tuple((t.name, t.dtype.str, tuple(t.sample_shape)) for t in catalog.tops.values()),
        windows=tuple(
            (str(t.name), *t.windows) for t in catalog.tops.values() if t.windows is not None
        ),
        chunk_rows=cache.chunk_rows,
        block_rows=block,
        first_rows=first,
        resident=cache.resident,
        ramp_lanes=lanes,
        chunk_lanes=laned,
        ramp_top_lanes=top,
        ramp_once=once,
        even_chunks=even,
        streams=streams,
        categories=tuple(catalog.categories.items()),
    )


def held_rows(shape: DataShape, resume: Resume | None, epoch: int) -> int:
    """The rows a cache slot holds when a layer opens over ``shape`` at ``epoch``: its chunks',
    and those of an epoch a loaded state (``resume``) resumes that is still to come, which is
    served in the saved run's chunks (more rows than this run's after an elastic resume: they
    were cut by other shares)."""
    if resume is not None and epoch <= resume.epoch:
        return max(shape.chunk_rows, int(resume.fingerprint["chunk_rows"]))
    return shape.chunk_rows


@dataclass(frozen=True)
class Sized:
    """What an HDF5 opening fixes from its catalog before it allocates anything
    (:func:`size_opening`)."""

    shape: DataShape  # every epoch's order and cache
    #: The rows a cache slot holds: the shape's chunks, or the larger ones of an elastically
    #: resumed epoch still to come.
    slot_rows: int
    #: Why the budget cannot hold cache slots of ``slot_rows`` (None: it can). Raised by the
    #: opening only where it allocates slots: a mapped or resident reader has none.
    refused: ConfigurationError | None = None


def size_opening(
    catalog: Catalog,
    streams: tuple[StreamRows, ...],
    config: LayerConfig,
    *,
    loaded: DataShape | None,
    resume: Resume | None,
    epoch: int,
) -> Sized:
    """The sizes of an opening at ``epoch`` (:class:`Sized`), each fixed here once.

    ``loaded``: the shape a loaded state fixes (:func:`shape_of`'s ``forced``; None: none).
    ``resume``: the loaded state; a slot holds :func:`held_rows`, and where those are more than
    the shape's chunks the budget is checked for them too."""
    shape = shape_of(catalog, streams, config, loaded)
    rows, refused = held_rows(shape, resume, epoch), None
    if rows > shape.chunk_rows:
        try:
            cache_plan(catalog, config, rows)
        except ConfigurationError as exc:
            refused = exc
    return Sized(shape, rows, refused)
