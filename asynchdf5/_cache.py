"""Host cache: the slots that hold whole chunks.

Slots are allocated once and reused for every chunk of every epoch, so a long run's memory stays
flat whatever the data set's size: ``N_SLOTS x chunk rows x bytes per sample``. How many rows a
slot holds is fixed before, by :mod:`._sizing` (the cache fitted to the memory budget).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ._catalog import TopInfo
from ._pages import free_arrays
from ._ragged_tops import heap_keys

__all__ = ["N_SLOTS", "Slot", "allocate_slots", "fit_heaps", "free_slots"]

#: Slots: one being served while the next is read.
N_SLOTS = 2


@dataclass(eq=False)
class Slot:
    """One cache slot: an array per top with room for a chunk's samples."""

    index: int
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


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
    :func:`~._ragged_tops.heap_keys`, each sized for the values chunks of ``rows`` rows hold
    (:meth:`~._ragged_tops.RaggedInfo.slot_values`); a chunk that holds more grows them
    before it is read (:func:`fit_heaps`).
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
            arrays.update(_heaps(t, t.ragged.slot_values(rows)))
        slots.append(Slot(i, arrays))
    return slots


def _heaps(top: TopInfo, values: int) -> dict[str, np.ndarray]:
    """A ragged top's heaps (:func:`~._ragged_tops.heap_keys`) of ``values`` values each."""
    assert top.ragged is not None
    kinds = [(top.dtype, top.sample_shape)]
    if top.ragged.index_dtype is not None:
        kinds.append((top.ragged.index_dtype, ()))
    arrays = {}
    for key, (dtype, shape) in zip(heap_keys(top.name, top.ragged.sparse), kinds, strict=True):
        n = values * dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        arrays[key] = _anonymous(n).view(dtype).reshape(values, *shape)
    return arrays


def fit_heaps(
    slot: Slot, tops: Mapping[str, TopInfo], ranges: Sequence[tuple[int, int]]
) -> list[np.ndarray]:
    """Make ``slot``'s heaps hold the values of a chunk of the global rows ``ranges``
    (a free slot, before the chunk is read into it): a heap too small for them is replaced by
    one of exactly their size, which the slot keeps for the chunks after it.

    The heaps are sized for the chunks the order makes (:meth:`~._ragged_tops.RaggedInfo.
    slot_values`), not for the longest rows: a chunk drawn with more values than that (blocks
    of long rows together) is rare, and grows the cache past its budget by what it holds more,
    rather than every chunk being shrunk for it. Returns the heaps replaced, for the caller to
    give back (:func:`~._pages.free_arrays`, off the event loop)."""
    old: list[np.ndarray] = []
    for t in tops.values():
        if t.ragged is None:
            continue
        keys = heap_keys(t.name, t.ragged.sparse)
        if keys[0] not in slot.arrays:  # another stream's variant: not in this slot
            continue
        need = t.ragged.chunk_values(ranges)
        if need <= len(slot.arrays[keys[0]]):
            continue
        old += [slot.arrays[k] for k in keys]
        slot.arrays.update(_heaps(t, need))
    return old


def free_slots(slots: Iterable[Slot]) -> None:
    """Give every slot's pages back (:func:`~._pages.free_arrays`), then drop its arrays."""
    for s in slots:
        free_arrays(s.arrays.values())
        s.arrays.clear()
