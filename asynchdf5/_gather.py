"""Gathering rows: a batch's rows copied from cache slots, in-memory arrays, a mapped file or
a carry into the arrays the delivery hands over, with their global indices.

- The kernel (:func:`gather_rows`): one ``np.take(..., mode="clip", out=...)`` per top and
  piece, straight into the destination; the bounds that ``clip`` would hide are checked once
  per chunk when it is loaded (:func:`check_rows`), not per batch. Large gathers go in two
  halves on two threads (:func:`gather_split`).
- The check of rows taken in place from a mapped file (:func:`verify`): after every gather
  from one, before the rows go anywhere, the file must be unchanged. Mapped, rows are read
  during the gather, straight from the page cache, so a file changed meanwhile would be read as
  changed: the check turns that into a :class:`~asynchdf5.ReadError` naming the rows as the
  copying reader names a read's (:func:`rows_words`), instead of a batch (see
  :mod:`._read._mapped`).
- A ragged top padded as it is gathered (:func:`gather_padded`): the rows straight into the
  dense ``(rows, length)`` array a :class:`~asynchdf5.transforms.Pad` at the head of the top's
  transformer chain would make of them, instead of gathering them and copying them again.
- The carry (:func:`carry`): the rows of an incomplete batch copied out of the chunks they are
  in, so that no incomplete batch holds a cache slot across a chunk boundary (the invariant
  that keeps the pipeline from waiting on itself: see :class:`~._pipeline.Run`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, wait
from contextlib import AbstractContextManager
from typing import Any, cast

import numpy as np

from ._blocks import RUN_BYTES, ScatteredValues, copy_all, row_bytes
from ._errors import ReadError
from ._ragged import pad_rows
from ._ragged_tops import heap_keys, is_heap
from ._specs import BatchSpec, Carry, LoadedChunk, Piece, Rows, split_pieces

__all__ = [
    "PARALLEL_BYTES",
    "carry",
    "check_rows",
    "gather_padded",
    "gather_ragged",
    "gather_rows",
    "gather_split",
    "rows_words",
    "verify",
]

#: Below this many bytes rows are gathered on one thread: handing half to another thread costs
#: more than it saves (and the two would contend for the GIL between small copies).
PARALLEL_BYTES = 2 * 2**20


def gather_rows(
    pieces: Sequence[Piece], out: dict[str, np.ndarray], indices: np.ndarray, at: int = 0
) -> None:
    """Copy the rows of ``pieces`` into ``out`` and their global indices into ``indices``,
    from row ``at`` on."""
    for chunk, a, b in pieces:
        n = b - a
        idx = indices[at : at + n]
        rows: np.ndarray | slice
        if isinstance(chunk, Carry):  # rows and indices in serving order
            idx[:] = chunk.indices[a:b]
            for name, dest in out.items():
                dest[at : at + n] = chunk.arrays[name][a:b]
            at += n
            continue
        idx[:] = chunk.indices[a:b]
        if chunk.rows_are_global:
            rows = idx
        else:
            rows = slice(a, b) if chunk.order is None else chunk.order[a:b]
        if not isinstance(rows, slice) and n and not chunk.checked:
            # The take below writes straight into ``dest`` (mode="clip"), so the bounds are
            # checked instead: once per chunk when it was loaded, else here.
            check_rows(rows, chunk.arrays)
        for name, dest in out.items():  # each top's copy on its own, under the guard
            with guarded(chunk.guard, name, idx):
                _take(chunk.arrays[name], rows, dest[at : at + n])
        at += n


@contextlib.contextmanager
def guarded(
    guard: AbstractContextManager[None] | None, name: str, indices: np.ndarray
) -> Iterator[None]:
    """Under ``guard`` (a mapped file's read lease, None: no guard), entered right before a
    copy of top ``name``'s rows ``indices`` (global), its refusal a :class:`ReadError` naming
    them as the copying reader names a read's rows."""
    if guard is None:
        yield
        return
    try:
        guard.__enter__()
    except ReadError as exc:
        raise ReadError(f"top {name!r}, {rows_words(indices)}: {exc}") from exc
    try:
        yield
    finally:
        guard.__exit__(None, None, None)


def piece_spans(chunk: LoadedChunk | Carry, a: int, b: int, name: str) -> np.ndarray:
    """The spans (start, stop in its heaps) of ragged top ``name``'s rows ``a:b`` of a piece's
    ``chunk``, in serving order."""
    rows: np.ndarray | slice
    if isinstance(chunk, Carry):
        rows = slice(a, b)
    elif chunk.rows_are_global:
        rows = chunk.indices[a:b]
    else:
        rows = slice(a, b) if chunk.order is None else chunk.order[a:b]
    spans = _array(chunk.arrays[name])
    if isinstance(rows, slice):
        return spans[rows]
    # ``np.take``: the same rows as ``spans[rows]`` (bounds checked, negative rows wrapped),
    # without the general fancy index's cost on a 2-D array; but it first copies a source that
    # is not contiguous whole. A mapped top's spans are a view of ``indptr`` (row i's are
    # ``indptr[i:i + 2]``), whose two columns are contiguous: each column taken on its own,
    # into int64 as every gather's runs are (an int32 indptr's too: a mapped heap's byte places
    # pass 2**31 long before its values do). Slots' and carries' spans are int64 already.
    if spans.flags.c_contiguous:
        return np.take(spans, rows, axis=0)
    starts, stops = spans[:, 0], spans[:, 1]
    if not (starts.flags.c_contiguous and stops.flags.c_contiguous):
        taken: np.ndarray = spans[rows].astype(np.int64, copy=False)
        return taken
    out = np.empty((len(rows), 2), np.int64)
    out[:, 0] = starts.take(rows)
    out[:, 1] = stops.take(rows)
    return out


def gather_split(
    pieces: Sequence[Piece],
    out: dict[str, np.ndarray],
    indices: np.ndarray,
    helper: Executor | None,
) -> None:
    """:func:`gather_rows`, with the first half of the rows on ``helper``'s thread when there is
    one and ``out`` holds at least :data:`PARALLEL_BYTES` (``np.take`` releases the GIL)."""
    total = len(indices)
    if helper is None or sum(a.nbytes for a in out.values()) < PARALLEL_BYTES:
        gather_rows(pieces, out, indices)
        return
    head, tail = split_pieces(pieces, total // 2)
    on_two_threads(
        helper,
        functools.partial(gather_rows, head, out, indices),
        functools.partial(gather_rows, tail, out, indices, total // 2),
    )


def on_two_threads(helper: Executor, head: Callable[[], None], tail: Callable[[], None]) -> None:
    """Run ``head`` on ``helper``'s thread while ``tail`` runs on this one, both writing into one
    output. An error here waits for the helper's part first (it writes into that output too:
    done with it before anyone reuses it); the helper's error comes out after."""
    future = helper.submit(head)
    try:
        tail()
    except BaseException:
        wait([future])
        raise
    future.result()


def _take(source: Rows, rows: np.ndarray | slice, dest: np.ndarray) -> None:
    """Copy ``rows`` of ``source`` into ``dest``."""
    if isinstance(rows, slice):
        dest[...] = source[rows]
    else:
        # mode="clip" writes straight into ``dest``; numpy's default ("raise") gathers into
        # a temporary first and copies it over, a second copy of every row. (What np.take
        # calls: mapped rows have a take of their own.)
        source.take(rows, axis=0, out=dest, mode="clip")


def _array(held: Rows) -> np.ndarray:
    """A ragged top's spans: an array wherever they are held."""
    assert isinstance(held, np.ndarray)
    return held


def _heap(held: Rows) -> np.ndarray | ScatteredValues:
    """A ragged top's values (or column indices): an array, or a mapped heap stored in chunks
    (:class:`~._read._maps.ChunkHeap`), which copies its own runs; never spliced over several
    files (:mod:`._read._choice`)."""
    if isinstance(held, np.ndarray):
        return held
    assert hasattr(held, "copy_into")
    return cast(ScatteredValues, held)


def check_rows(rows: np.ndarray, arrays: Mapping[str, Rows]) -> None:
    """:class:`IndexError` unless every one of ``rows`` is a row of every array: ``np.take``
    with ``mode="clip"`` (which gathers straight into a batch) would silently clip the others.
    Two passes over ``rows``: the loader runs it once per chunk, so that the gather need not."""
    if len(rows):
        lo, hi = int(rows.min()), int(rows.max())
        for name, a in arrays.items():
            if is_heap(name):  # a ragged top's values: its spans (rows) are checked
                continue
            if lo < 0 or hi >= len(a):
                raise IndexError(f"rows {lo}..{hi} of {len(a)} (top {name!r})")


# --- the check of mapped rows ------------------------------------------------------------------


def verify(pieces: Sequence[Piece]) -> None:
    """Run the ``verify`` of every chunk the pieces were gathered from (see
    :attr:`LoadedChunk.verify`): after the gather, before the rows go anywhere."""
    checks = {c.verify: c for c, _, _ in pieces if isinstance(c, LoadedChunk) and c.verify}
    for check, chunk in checks.items():
        try:
            check()
        except ReadError as exc:  # named as the copying reader names a read's rows
            idx = [c.indices[a:b] for c, a, b in pieces if isinstance(c, LoadedChunk)]
            tops = ", ".join(map(repr, chunk.arrays))
            # The check covers every mapped file: the one it names may hold none of the rows.
            raise ReadError(
                f"top {tops}, {rows_words(np.concatenate(idx))}: a mapped file changed while "
                f"they were gathered: {exc}"
            ) from exc


def rows_words(indices: np.ndarray) -> str:
    """Global rows in an error message: ``rows a:b`` when they are that run, else how many and
    the range they lie in."""
    n = len(indices)
    if n == 0:
        return "no rows"
    lo, hi = int(indices.min()), int(indices.max())
    if hi - lo == n - 1 and (n == 1 or bool(np.all(np.diff(indices) == 1))):
        return f"rows {lo}:{hi + 1}"
    return f"{n} rows in {lo}:{hi + 1}"


# --- the carry --------------------------------------------------------------------------------


def carry(
    spec: BatchSpec,
    tops: Mapping[str, tuple[tuple[int, ...], np.dtype[Any]]],
    ragged: Mapping[str, bool] | None = None,
) -> Carry:
    """Copy the rows cut so far into an incomplete batch out of the chunks they are in.

    The batcher calls this when it has cut every row of a chunk and the batch it is building
    still needs rows from the next one: the copy (fewer than ``batch_size`` rows) lets the
    chunk's cache slot go back to the reader without waiting for that next chunk. Blocking:
    run in a worker thread.

    Rows of a mapped file are checked here (:func:`verify`), as after every gather, and not only
    after the gather that completes the batch: a later check can miss a change this one sees (a
    file rewritten in place, its modification time set back, then linked or unlinked: the two
    moves of its change time look like one link change).

    ``ragged``: the ragged tops (name -> whether sparse), carried as a chunk holds them: their
    rows' spans under the top's name, over heaps of their own (:func:`gather_ragged`).
    """
    arrays = {name: np.empty((spec.rows, *shape), dtype) for name, (shape, dtype) in tops.items()}
    indices = np.empty(spec.rows, np.int64)
    gather_rows(spec.pieces, arrays, indices)
    for name, sparse in (ragged or {}).items():
        offsets, heaps = gather_ragged(spec.pieces, name, sparse)
        arrays[name] = np.stack([offsets[:-1], offsets[1:]], axis=1)
        arrays.update(zip(heap_keys(name, sparse), heaps, strict=True))
    verify(spec.pieces)  # rows of a mapped file: unchanged when they were copied
    return Carry(arrays, indices)


# --- ragged tops ------------------------------------------------------------------------------


def gather_ragged(
    pieces: Sequence[Piece],
    name: str,
    sparse: bool,
    empty: Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray] | None = None,
    helper: Executor | None = None,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The rows of ragged top ``name`` in ``pieces``, in order: their offsets (int64, rows + 1,
    from 0) and their values (with a sparse top's column indices: ``[values, indices]``), each
    an array of the batch's own: new, or from ``empty(shape, dtype)`` (a pool of reused
    buffers). Rows that follow each other in a heap (an unshuffled chunk's) are copied as one
    slice. With a ``helper`` and at least :data:`PARALLEL_BYTES` of values, the rows holding
    the first half of them are copied on the helper's thread (the copies let go of the GIL),
    as :func:`gather_split` does a fixed top's."""
    make = empty if empty is not None else np.empty
    keys = heap_keys(name, sparse)
    jobs: list[_SpanJob] = []
    rows = 0
    for chunk, a, b in pieces:
        span = piece_spans(chunk, a, b, name)
        jobs.append((chunk, a, span, rows))
        rows += len(span)
    # The offsets are the call's own array (a caller may keep them, or size buffers from them):
    # each row's length written in place, then summed in place.
    offsets = np.empty(rows + 1, np.int64)
    offsets[0] = 0
    for _, _, span, row in jobs:
        np.subtract(span[:, 1], span[:, 0], out=offsets[row + 1 : row + 1 + len(span)])
    np.cumsum(offsets[1:], out=offsets[1:])
    total = int(offsets[-1])
    first = pieces[0][0].arrays if pieces else None
    outs = []
    for key in keys:
        heap = first[key] if first is not None else np.empty(0)
        outs.append(make((total, *heap.shape[1:]), heap.dtype))
    nbytes = sum(row_bytes(out) for out in outs) * total
    if helper is None or nbytes < PARALLEL_BYTES:
        _copy_jobs(jobs, name, keys, outs, offsets)
        return offsets, outs
    # The row that starts the second half of the values, and the jobs on either side of it.
    cut = int(np.searchsorted(offsets, total // 2, side="right")) - 1
    head, tail = [], []
    for job in jobs:
        chunk, a, span, row = job
        n = len(span)
        if row + n <= cut:
            head.append(job)
        elif row >= cut:
            tail.append(job)
        else:
            k = cut - row
            head.append((chunk, a, span[:k], row))
            tail.append((chunk, a + k, span[k:], cut))
    on_two_threads(
        helper,
        functools.partial(_copy_jobs, head, name, keys, outs, offsets),
        functools.partial(_copy_jobs, tail, name, keys, outs, offsets),
    )
    return offsets, outs


#: One piece's rows of a ragged top, to copy: its chunk, the first row's place in the chunk's
#: serving order, the rows' spans in the chunk's heaps, and the first row's row in the batch.
_SpanJob = tuple["LoadedChunk | Carry", int, np.ndarray, int]


def _copy_jobs(
    jobs: Sequence[_SpanJob],
    name: str,
    keys: Sequence[str],
    outs: Sequence[np.ndarray],
    offsets: np.ndarray,
) -> None:
    """Copy the rows of ``jobs`` to their places in ``outs`` (from ``offsets``), each chunk's
    under its guard."""
    for chunk, a, span, row in jobs:
        heaps = [_heap(chunk.arrays[key]) for key in keys]
        places = offsets[row : row + len(span) + 1]
        guard = chunk.guard if isinstance(chunk, LoadedChunk) else None
        if guard is None:
            _copy_spans(heaps, span, places, outs)
            continue
        with guarded(guard, name, chunk.indices[a : a + len(span)]):
            _copy_spans(heaps, span, places, outs)


def _copy_spans(
    heaps: Sequence[np.ndarray | ScatteredValues],
    span: np.ndarray,
    places: np.ndarray,
    dests: Sequence[np.ndarray],
) -> None:
    """Copy ``heap[start:stop]`` of each span to ``dest[places[i]:places[i + 1]]``, for each
    heap and its ``dest`` (``places``: one more than the spans, each span's place in the dests
    and the end of the last): a sparse top's values and column indices share the spans, and the
    work that depends on them alone. Spans that continue each other are merged into runs first
    (an unshuffled chunk's rows are one run), only when some do; long runs are copied a slice
    each, by one C loop, short ones in blocks (:func:`~._blocks.copy_runs`). A heap in a mapped
    file's chunks copies the runs itself, each cut where its chunks are not back to back in the
    file."""
    n = len(span)
    lo, hi = int(places[0]), int(places[-1])
    if n == 0 or hi == lo:
        return
    starts, stops = span[:, 0], span[:, 1]
    at = places[:-1]
    joined = starts[1:] == stops[:-1]
    if joined.any():
        heads = np.flatnonzero(~joined) + 1  # the spans that start a run, but the first
        first = starts[np.concatenate(([0], heads))]
        last = stops[np.concatenate((heads - 1, [n - 1]))]
        at = at[np.concatenate(([0], heads))]
    else:
        first, last = starts, stops
    arrays = [h for h in heaps if isinstance(h, np.ndarray)]
    chunked = len(arrays) < len(heaps)  # stored in chunks: the heaps copy their runs themselves
    if not chunked and (hi - lo) * max(map(row_bytes, arrays)) >= RUN_BYTES * len(first):
        runs = list(zip(first.tolist(), last.tolist(), strict=True))
        for heap, dest in zip(arrays, dests, strict=True):
            # One C loop copies every run: the Python work is a view per run.
            np.concatenate([heap[a:b] for a, b in runs], axis=0, out=dest[lo:hi])
        return
    copy_all(heaps, dests, first, at, last - first)


def gather_padded(
    pieces: Sequence[Piece],
    name: str,
    length: int,
    pad: Any,
    empty: Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray] | None = None,
    helper: Executor | None = None,
) -> np.ndarray:
    """The rows of (not sparse) ragged top ``name`` in ``pieces``, in order, padded: what
    :class:`~asynchdf5.transforms.Pad` ``(pad, length)`` makes of the :class:`~asynchdf5.Ragged`
    that :func:`gather_ragged` gathers, ``(rows, length, *trailing)`` in the values' dtype (rows
    longer than ``length`` cut to it, the rest of each row ``pad``), straight from the heaps
    into the batch's array, no Ragged made and copied again (:func:`~._ragged.pad_rows`). The
    array is new or from ``empty(shape, dtype)``, as :func:`gather_ragged`'s are. With a
    ``helper`` and an output of at least :data:`PARALLEL_BYTES`, the first half of the rows
    is padded on the helper's thread, as :func:`gather_split` does a fixed top's."""
    make = empty if empty is not None else np.empty
    (key,) = heap_keys(name, False)
    first = pieces[0][0].arrays[key] if pieces else np.empty(0)
    rows = sum(b - a for _, a, b in pieces)
    out = make((rows, length, *first.shape[1:]), first.dtype)
    if helper is None or out.nbytes < PARALLEL_BYTES:
        _pad_pieces(pieces, name, key, length, pad, out)
        return out
    half = rows // 2
    head, tail = split_pieces(pieces, half)
    on_two_threads(
        helper,
        functools.partial(_pad_pieces, head, name, key, length, pad, out[:half]),
        functools.partial(_pad_pieces, tail, name, key, length, pad, out[half:]),
    )
    return out


def _pad_pieces(
    pieces: Sequence[Piece], name: str, key: str, length: int, pad: Any, out: np.ndarray
) -> None:
    """Pad the rows of ``pieces`` into ``out`` (as many rows), each chunk's under its guard."""
    at = 0
    for chunk, a, b in pieces:
        span = piece_spans(chunk, a, b, name)
        starts = np.ascontiguousarray(span[:, 0])
        cut = np.minimum(span[:, 1] - starts, length)
        dest = out[at : at + b - a]
        at += b - a
        guard = chunk.guard if isinstance(chunk, LoadedChunk) else None
        mapped = isinstance(chunk, LoadedChunk) and chunk.verify is not None
        with guarded(guard, name, chunk.indices[a:b]):
            pad_rows(_heap(chunk.arrays[key]), starts, cut, dest, pad, exact=mapped)
