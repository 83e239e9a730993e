"""Stored chunks into a cache slot, outside h5py's lock: the reads of the ``chunks`` path.

Where each chunk is comes from HDF5's chunk index, taken at open (:class:`~.._layout.ChunkIndex`);
nothing here computes a chunk's place. Two kinds of reads:

* **Unfiltered chunks holding whole samples** are contiguous pieces of the rows: the rows a
  chunk read needs are fetched straight into the slot, and neighbouring chunks that are adjacent
  in the file are one request (up to the source's ``piece_bytes``), as for contiguous data.
* **Everything else** (filtered chunks, chunks that split the samples) is read in *runs*:
  chunks adjacent in the file, up to :data:`RUN_BYTES` stored and :data:`RUN_DECODED_BYTES`
  decoded (at least one chunk), fetched as one request and decoded on the reader's pool of
  threads, each chunk once however many of its rows the read needs, straight into the slot (a
  last shuffle undone by that same copy; a chunk whose bytes are whole rows of the slot is
  decoded right there, where its last filter allows: no copy at all). Where chunks split the
  samples, a *band* (every chunk of a run of rows) holds whole samples: written one after the
  other, as h5py does, a band is one request, or a few where it is large, and a run that fills
  up in a band's middle ends where that band starts, so that one thread writes (and faults in)
  each band's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .._codecs import ChecksumError, ChunkDecoder, copy_elements
from .._errors import ReadError
from .._layout import ChunkIndex, Layout
from .._pages import populate
from .._sources import ByteRange
from ._steps import byte_view

__all__ = ["RUN_BYTES", "ChunkRun", "Need", "chunk_reads"]

#: Stored bytes fetched as one request at most (unless one chunk is larger): large enough that
#: a request costs little per byte.
RUN_BYTES = 2 * 2**20
#: Decoded bytes of one run at most (unless one chunk is larger): one task of the decoding
#: threads, small enough that a chunk's runs (the first, small read's too) keep them all busy.
RUN_DECODED_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Need:
    """Rows ``start:stop`` of a top in one file, to land in ``dest`` (one row per row)."""

    start: int
    stop: int
    dest: np.ndarray


class _Place(NamedTuple):
    """Rows ``first:first + n`` of a decoded chunk into ``dest[region]`` (``dest``: a uint8
    view of the slot, ``(rows, *sample_shape, itemsize)``; the region ``(n, *cut,
    itemsize)``), from the chunk's elements ``take`` (``[first:first + n, :cut...]``). A tuple,
    its region cut out on the decoding thread: a plan makes one for each stored chunk each
    need touches (tens of thousands in a resident data set's first epoch), on the event loop,
    while the decoding threads wait for its reads."""

    first: int
    n: int
    dest: np.ndarray
    region: tuple[slice, ...]
    take: tuple[slice, ...]


class _Stored(NamedTuple):
    """One stored chunk a read needs: where it is, its filter mask, where its rows go, and the
    rows of the top (``lo:hi``) it gives; ``k``, ``j``: its row chunk and its place in the band
    (what error messages call it, formatted only for one)."""

    offset: int
    size: int
    mask: int
    places: list[_Place]
    lo: int
    hi: int
    k: int
    j: int
    #: The destination rows (all of each sample) of its band, never written before, that this
    #: chunk faults in at once before its copy (:func:`~.._pages.populate`), for a resident data
    #: set's first read: set on the band's first chunk in the file, the first one decoded
    #: (a band's chunks may lie apart, in several runs).
    fresh: tuple[np.ndarray, ...] = ()

    def what(self, about: str, band: int) -> str:
        """The chunk, as error messages call it."""
        return (
            f"{about}, rows {self.lo}:{self.hi}: stored chunk {self.k}"
            + (f", {self.j} of its band" if band > 1 else "")
            + f" ({self.size} bytes at offset {self.offset})"
        )


class ChunkRun:
    """Decode the stored chunks of one run and copy their rows into the slot (on a codec thread).

    ``items``: for each chunk, its place in the run's bytes, its filter mask, the chunk (what
    error messages call it, the fresh rows it faults in) and where its rows go.
    """

    __slots__ = ("about", "band", "decoder", "items")

    def __init__(
        self,
        decoder: ChunkDecoder,
        items: list[tuple[int, int, int, _Stored, list[_Place]]],
        about: str,
        band: int,
    ) -> None:
        self.decoder, self.items, self.about, self.band = decoder, items, about, band

    def __call__(self, raw: bytes | memoryview) -> None:
        view = memoryview(raw).cast("B") if isinstance(raw, memoryview) else memoryview(raw)
        decoder = self.decoder
        chunk_bytes = decoder.chunk_bytes
        for at, size, mask, stored, places in self.items:
            for rows in stored.fresh:
                populate(byte_view(rows))
            # A chunk whose bytes are exactly its one destination's (whole rows, in place in
            # the slot) is decoded straight into it, where the pipeline allows.
            intos = [p.dest[p.region] for p in places]
            whole = intos[0] if len(intos) == 1 else None
            try:
                if (
                    whole is not None
                    and places[0].first == 0
                    and whole.nbytes == chunk_bytes
                    and whole.flags.c_contiguous
                    and decoder.decode_into(view[at : at + size], mask, whole.reshape(-1))
                ):
                    continue
                elements = decoder.elements(view[at : at + size], mask)
            except ChecksumError as exc:
                raise ReadError(f"{self._what(stored)}: {exc}") from exc
            except Exception as exc:
                # Each codec has its own error class (deflate.DeflateError, isal's IsalError,
                # numcodecs' RuntimeError, ...): a chunk that does not decode is a failed read.
                what = self._what(stored)
                raise ReadError(f"{what} does not decode: {type(exc).__name__}: {exc}") from exc
            for p, into in zip(places, intos, strict=True):
                copy_elements(into, elements[p.take])

    def _what(self, stored: _Stored) -> str:
        return stored.what(self.about, self.band)


def chunk_reads(
    layout: Layout,
    needs: Sequence[Need],
    decoder: ChunkDecoder,
    about: str,
    piece_bytes: int,
    run_bytes: int = RUN_BYTES,
    *,
    fresh: bool = False,
) -> list[ByteRange]:
    """The byte ranges that put ``needs`` (disjoint rows of one top of one file) in their
    destinations. Byte order is left as stored (the caller swaps afterwards). ``fresh``: the
    destinations were never written (a resident data set's rows, read once)."""
    index = layout.chunks
    assert index is not None
    if not layout.filters and not index.splits_samples:
        ranges = _direct(index, needs, decoder.itemsize, about, piece_bytes)
        for r in ranges:
            r.fresh = fresh
        return ranges
    return _runs(index, needs, decoder, about, run_bytes, fresh)


def _direct(
    index: ChunkIndex, needs: Sequence[Need], itemsize: int, about: str, piece_bytes: int
) -> list[ByteRange]:
    """Unfiltered whole-sample chunks: each need's rows read in place, one request for rows of
    neighbouring chunks adjacent in the file."""
    rows = index.rows
    rb = itemsize * int(np.prod(index.sample_shape, dtype=np.int64))
    out: list[ByteRange] = []
    for need in needs:
        view = byte_view(need.dest)
        what = f"{about}, rows {need.start}:{need.stop}"
        start = end = -1  # the file bytes of the range being built ...
        at = 0  # ... and where they land in `view`
        for k in range(need.start // rows, (need.stop - 1) // rows + 1):
            a, b = max(need.start, k * rows), min(need.stop, (k + 1) * rows)
            offset = int(index.offsets[k, 0]) + (a - k * rows) * rb
            size = (b - a) * rb
            if offset == end and end - start + size <= piece_bytes:
                end += size
                continue
            if end > start:
                out.append(
                    ByteRange(
                        index.file, start, end - start, what, into=view[at : at + end - start]
                    )
                )
                at += end - start
            start, end = offset, offset + size
        if end > start:
            out.append(
                ByteRange(index.file, start, end - start, what, into=view[at : at + end - start])
            )
    return out


def _runs(
    index: ChunkIndex,
    needs: Sequence[Need],
    decoder: ChunkDecoder,
    about: str,
    run_bytes: int,
    fresh: bool,
) -> list[ByteRange]:
    """Filtered or sample-splitting chunks: each needed chunk once, in runs of chunks adjacent
    in the file. This runs on the event loop, once per stored chunk a read needs: no numpy
    scalar or message is made per chunk here."""
    rows, itemsize, band = index.rows, decoder.itemsize, index.band
    rest = index.shape[1:]
    grid = tuple(-(-n // c) for n, c in zip(index.sample_shape, rest, strict=True))
    # Where chunk j of a band lands in a sample (its slices), and what of the chunk's elements
    # is inside it.
    tiles: list[tuple[tuple[slice, ...], tuple[slice, ...]]] = []
    for j in range(band):
        at = np.unravel_index(j, grid) if grid else ()
        starts = [int(i) * c for i, c in zip(at, rest, strict=True)]
        cut = tuple(min(c, n - s) for s, c, n in zip(starts, rest, index.sample_shape, strict=True))
        where = tuple(slice(s, s + c) for s, c in zip(starts, cut, strict=True))
        tiles.append((where, tuple(slice(0, c) for c in cut)))
    # Each row chunk, with the rows of each need it holds.
    wanted: dict[int, list[tuple[np.ndarray, int, int, int]]] = {}
    for need in needs:
        u8 = need.dest.view(np.uint8).reshape(len(need.dest), *index.sample_shape, itemsize)
        for k in range(need.start // rows, (need.stop - 1) // rows + 1):
            a, b = max(need.start, k * rows), min(need.stop, (k + 1) * rows)
            wanted.setdefault(k, []).append((u8, need.start, a, b))
    chunks: list[_Stored] = []
    for k, parts in wanted.items():
        offsets, sizes = index.offsets[k].tolist(), index.sizes[k].tolist()
        masks = index.masks[k].tolist()
        lo, hi = min(a for _, _, a, _ in parts), max(b for _, _, _, b in parts)
        for j, (where, take) in enumerate(tiles):
            places = []
            for u8, s, a, b in parts:
                region = (slice(a - s, b - s), *where)
                r0 = a - k * rows
                places.append(_Place(r0, b - a, u8, region, (slice(r0, b - k * rows), *take)))
            chunks.append(_Stored(offsets[j], sizes[j], masks[j], places, lo, hi, k, j))
    chunks.sort(key=lambda c: c.offset)
    if fresh:  # each band's rows faulted in by its first chunk in the file, decoded first
        begun: set[int] = set()
        for i, c in enumerate(chunks):
            if c.k not in begun:
                begun.add(c.k)
                rows_of = tuple(u8[a - s : b - s] for u8, s, a, b in wanted[c.k])
                chunks[i] = c._replace(fresh=rows_of)
    out: list[ByteRange] = []
    run: list[_Stored] = []
    most = max(1, RUN_DECODED_BYTES // max(1, decoder.chunk_bytes))  # chunks per run
    for c in chunks:
        if run and (
            c.offset != run[-1].offset + run[-1].size
            or c.offset + c.size - run[0].offset > run_bytes
            or len(run) >= most
        ):
            # A run full in the middle of a band ends where that band starts, where one began
            # before it: each band's rows are then written (and faulted in) by one thread.
            until = len(run)
            if c.offset == run[-1].offset + run[-1].size and c.k == run[-1].k:
                b0 = until - 1
                while b0 > 0 and run[b0 - 1].k == c.k:
                    b0 -= 1
                until = b0 or until
            out.append(_range(index, decoder, run[:until], about))
            run = run[until:]
        run.append(c)
    if run:
        out.append(_range(index, decoder, run, about))
    return out


def _range(index: ChunkIndex, decoder: ChunkDecoder, run: list[_Stored], about: str) -> ByteRange:
    """One request for ``run`` (chunks adjacent in the file), decoded by a :class:`ChunkRun`."""
    start, end = run[0].offset, run[-1].offset + run[-1].size
    name = index.file.name
    items = [(c.offset - start, c.size, c.mask, c, c.places) for c in run]
    lo, hi = min(c.lo for c in run), max(c.hi for c in run)
    what = (
        run[0].what(about, index.band)
        if len(run) == 1
        else f"{about}, rows {lo}:{hi}: {len(run)} stored chunks at offset {start}"
    )
    then = ChunkRun(decoder, items, f"{name}: {about}", index.band)
    return ByteRange(index.file, start, end - start, what, then=then)
