"""What a layer knows of its data once it has looked at it (:class:`DataShape`), and an
epoch's first read (:func:`first_read`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._config import (
    BLOCK_BYTES,
    BLOCKS_PER_CHUNK,
    MIN_BLOCK_BYTES,
    MIN_BLOCKS_PER_CHUNK,
    MIN_LANE_BYTES,
    MIN_PLACES,
    RAMP_LANES,
    STORED_CHUNKS_PER_BLOCK,
    LayerConfig,
)
from ._mix import StreamRows

__all__ = [
    "RAMP_BYTES",
    "DataShape",
    "chunk_lanes",
    "default_block_rows",
    "first_read",
    "mixing_warning",
    "ramp_lanes",
]

#: Rows of the first chunk of an epoch are ramped up from about this many bytes, so the first
#: batch waits for a small read rather than a whole chunk.
RAMP_BYTES = 8 * 2**20


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
    #: Several streams mixed (:mod:`._mix`): each one's rows and samples per epoch; () for one.
    streams: tuple[StreamRows, ...] = ()

    @property
    def epoch_samples(self) -> int:
        """Samples of an epoch over every rank (before ``drop_last``): the streams' counts."""
        return sum(s.count for s in self.streams) if self.streams else self.n_samples

    def fingerprint(self, config: LayerConfig) -> dict[str, Any]:
        """What a saved state must agree with (see :mod:`._resume`)."""
        mixed = (
            {
                "streams": [[s.name, s.size, s.count] for s in self.streams],
                "batch_mode": config.batch_mode,
            }
            if self.streams
            else {}
        )
        return mixed | {
            "n_samples": self.n_samples,
            "files": [[name, rows] for name, rows in self.files],
            "tops": [[name, dtype, list(shape)] for name, dtype, shape in self.tops],
            "batch_size": config.batch_size,
            "shuffle": config.shuffle,
            "drop_last": config.drop_last,
            "chunk_size": config.chunk_size,
            "block_size": config.block_size,
            "chunk_rows": self.chunk_rows,
            "block_rows": self.block_rows,
            "first_rows": self.first_rows,
            "ramp_lanes": self.ramp_lanes,
            "chunk_lanes": self.chunk_lanes,
        }


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
    """
    ramp = RAMP_BYTES // max(1, row_bytes)
    lanes = 1
    if shuffle:
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
    ``BLOCKS_PER_CHUNK`` blocks (``MIN_BLOCKS_PER_CHUNK`` of compressed or remote data), else up
    to ``BLOCKS_PER_CHUNK``, so that a chunk still draws from enough
    places of the data set for its batches to mix when the cache had to shrink (a small memory
    budget) or the rows are narrow. Each lane's part of a chunk keeps :func:`lane_part_rows`.

    Unlike the blocks, the lanes may depend on the cache (``chunk_rows``): they cut this rank's
    share into chunks, and never change which samples a rank serves.
    """
    # As for blocks (:func:`default_block_rows`): compressed data and remote objects keep 16
    # places a chunk, so that reads stay a few stored chunks or a request long.
    want = MIN_BLOCKS_PER_CHUNK if stored_rows or request_bytes else BLOCKS_PER_CHUNK
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
    path). A block shorter than a few of them would decode each several times over (blocks
    of 85 rows over gzip chunks of 1,024 read 13 times the data), so blocks span at least
    ``STORED_CHUNKS_PER_BLOCK`` of them, as long as a chunk keeps ``MIN_BLOCKS_PER_CHUNK``.

    ``request_bytes``: the bytes one read request of the files should move at least (remote
    objects: a whole request, see :attr:`~._sources.StoredFile.request_bytes`). Each block is at
    least one request, and small requests to an object store cost a round trip and the
    client's work each (1 MiB blocks over S3 with 20 ms round trips streamed at 0.3 of a plain
    download, 8 MiB blocks at 0.7), so blocks are at least this big, again as long as a chunk
    keeps ``MIN_BLOCKS_PER_CHUNK``.

    From the properties and the files' layout only, never from the data set's size, the shard
    or the cache: every rank, every world size and every resumed run draws the same blocks.
    """
    row_bytes = max(1, row_bytes)
    rows = min(BLOCK_BYTES // row_bytes, chunk_size // BLOCKS_PER_CHUNK)
    want = max(STORED_CHUNKS_PER_BLOCK * stored_rows, request_bytes // row_bytes)
    floor = min(want, chunk_size // MIN_BLOCKS_PER_CHUNK)
    return max(1, rows, floor, MIN_BLOCK_BYTES // row_bytes)
