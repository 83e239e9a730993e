"""Host cache: preallocated slots holding whole chunks, within a memory budget."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ._catalog import TopInfo

__all__ = ["Slot", "allocate_slots", "slot_rows"]

#: Slots: one being served while the next is read.
N_SLOTS = 2


@dataclass(eq=False)
class Slot:
    """One cache slot: an array per top with room for ``rows`` samples."""

    index: int
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def slot_rows(
    chunk_size: int, shard_samples: int, row_bytes: int, cache_bytes: int | None
) -> int:
    """Rows per slot: ``chunk_size``, no more than the shard holds, shrunk to fit the budget."""
    rows = min(chunk_size, shard_samples)
    if cache_bytes is not None:
        fit = cache_bytes // (N_SLOTS * max(1, row_bytes))
        if fit < rows:
            warnings.warn(
                f"chunk_size={chunk_size} samples of {row_bytes} bytes in {N_SLOTS} cache slots "
                f"needs {N_SLOTS * rows * row_bytes / 2**30:.2f} GiB, more than "
                f"cache_bytes={cache_bytes / 2**30:.2f} GiB; using chunks of {max(1, fit)} "
                "samples instead",
                ResourceWarning,
                stacklevel=4,
            )
            rows = max(1, fit)
    return rows


def allocate_slots(tops: Mapping[str, TopInfo], rows: int) -> list[Slot]:
    """Allocate the cache slots once; they are reused for every chunk of every epoch."""
    return [
        Slot(i, {t.name: np.empty((rows, *t.sample_shape), t.dtype) for t in tops.values()})
        for i in range(N_SLOTS)
    ]


def budget_note(rows: int, row_bytes: int) -> str:
    return f"{N_SLOTS} slots x {rows} rows x {row_bytes} B = {math.ceil(N_SLOTS * rows * row_bytes / 2**20)} MiB"
