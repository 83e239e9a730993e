"""Host cache: the slots that hold whole chunks, and the memory budget they must fit.

Slots are allocated once and reused for every chunk of every epoch, so a long run's memory stays
flat whatever the data set's size: ``N_SLOTS x chunk rows x bytes per sample``.
"""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from ._catalog import TopInfo
from ._errors import ConfigurationError
from ._machine import memory_bytes, memory_room
from ._pages import free_arrays
from ._plan import shard_share
from ._ragged_tops import heap_keys

__all__ = [
    "N_SLOTS",
    "CacheBudgetWarning",
    "CachePlan",
    "Slot",
    "allocate_slots",
    "default_cache_bytes",
    "free_slots",
    "heap_bytes",
    "size_cache",
    "slot_rows",
]

#: Slots: one being served while the next is read.
N_SLOTS = 2


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


@dataclass(eq=False)
class Slot:
    """One cache slot: an array per top with room for a chunk's samples."""

    index: int
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


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


def _anonymous(nbytes: int) -> np.ndarray:
    """Page-aligned anonymous memory, untouched until it is first written.

    No ``MADV_HUGEPAGE``: huge pages make every fill of a slot slower, the first one most, for
    a small gain in the gather (docs/design-notes.md).
    """
    if nbytes == 0:
        return np.empty(0, np.uint8)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(buf, np.uint8)


def allocate_slots(tops: Mapping[str, TopInfo], rows: int, count: int = N_SLOTS) -> list[Slot]:
    """Allocate the cache slots once; they are reused for every chunk of every epoch.

    A ragged top has its spans (``(rows, 2)`` int64) under its name and its heaps under
    :func:`~._ragged_tops.heap_keys`, each sized for the ``rows`` longest rows of the data
    (:meth:`~._ragged_tops.RaggedInfo.heap_rows`): no chunk of ``rows`` rows overflows them.
    """
    slots = []
    for i in range(count):
        arrays = {}
        for t in tops.values():
            if t.ragged is None:
                raw = _anonymous(rows * t.row_bytes)
                arrays[t.name] = raw.view(t.dtype).reshape(rows, *t.sample_shape)
                continue
            arrays[t.name] = _anonymous(rows * 16).view(np.int64).reshape(rows, 2)
            values = t.ragged.heap_rows(rows)
            kinds = [(t.dtype, t.sample_shape)]
            if t.ragged.index_dtype is not None:
                kinds.append((t.ragged.index_dtype, ()))
            for key, (dtype, shape) in zip(heap_keys(t.name, t.ragged.sparse), kinds, strict=True):
                n = values * dtype.itemsize * int(np.prod(shape, dtype=np.int64))
                arrays[key] = _anonymous(n).view(dtype).reshape(values, *shape)
        slots.append(Slot(i, arrays))
    return slots


def heap_bytes(tops: Mapping[str, TopInfo]) -> Callable[[int], int] | None:
    """Bytes of the ragged tops' heaps in a slot of ``rows`` rows (None: no ragged top)."""
    ragged = [t for t in tops.values() if t.ragged is not None]
    if not ragged:
        return None

    def of(rows: int) -> int:
        return sum(t.ragged.heap_rows(rows) * t.value_bytes for t in ragged if t.ragged)

    return of


def free_slots(slots: Iterable[Slot]) -> None:
    """Give every slot's pages back (:func:`~._pages.free_arrays`), then drop its arrays."""
    for s in slots:
        free_arrays(s.arrays.values())
        s.arrays.clear()


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
    # The whole data set is one chunk and fits the budget: keep it, read each sample once.
    resident = n <= chunk_size and n * row_bytes <= budget
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
    ``r * row_bytes + heaps(r)`` bytes (``heaps`` grows with ``r``: the largest rows first)."""
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
            f"each, and a batch of the {batch_rows} longest rows of the ragged tops takes "
            f"{slot(batch_rows)} bytes ({need} bytes in all); raise cache_bytes (where the "
            "memory allows it) or lower batch_size"
        )
    want = min(chunk_size, max(1, share))
    if rows is not None:
        if N_SLOTS * slot(rows) > budget:
            raise ConfigurationError(
                f"the saved run cached chunks of {rows} samples, whose longest rows take "
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
    resident = n <= chunk_size and slot(n) <= budget
    shrunk = chunk_rows < want
    return CachePlan(chunk_rows, resident, budget, shrunk)
