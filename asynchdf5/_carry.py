"""The carry: the rows of an incomplete batch copied out of the chunks they are in, so that no
incomplete batch holds a cache slot across a chunk boundary (the invariant that keeps the
pipeline from waiting on itself: see :class:`~._pipeline.Run`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._gather import gather_ragged, gather_rows
from ._ragged_tops import heap_keys
from ._specs import BatchSpec, Carry
from ._verify import verify

__all__ = ["carry"]


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
