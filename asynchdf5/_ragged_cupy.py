"""A :class:`~asynchdf5.Ragged` whose arrays are CuPy's (a ragged top's batch with ``device=``):
its padding, done on the device with a few array operations and no loop over rows.

Every value goes to its place in one scatter: value ``j`` of the batch belongs to row ``r``
(found by a binary search in the offsets) at place ``j - offsets[r]``; values whose place is at
or past the padded length land in one spare row past the end, which is cut off. So nothing
waits for the device when the length is given; with ``length=None`` the longest row's length
is read back once (the output's shape depends on it).

CuPy is the module of the arrays given (imported with them, never by asynchdf5 itself).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["to_padded_on_device"]


def to_padded_on_device(
    values: Any, offsets: Any, pad: Any, length: int | None, dtype: npt.DTypeLike | None
) -> tuple[Any, Any]:
    """:meth:`Ragged.to_padded <asynchdf5.Ragged.to_padded>` for CuPy ``values`` and
    ``offsets`` (int64): the dense rows ``(rows, length, *trailing)`` and the rows' lengths
    (cut to ``length``), both CuPy arrays on the values' device, queued on the current stream."""
    import cupy as xp

    with values.device:
        n = len(offsets) - 1
        lengths = offsets[1:] - offsets[:-1]
        if length is None:
            size = int(lengths.max()) if n else 0  # reads one number back from the device
        else:
            size = int(length)
            if size < 0:
                raise ValueError(f"to_padded: length={length} is negative")
        cut = xp.minimum(lengths, size)
        trailing = tuple(values.shape[1:])
        inner = math.prod(trailing)
        out_dtype = values.dtype if dtype is None else np.dtype(dtype)
        # One spare row past the end takes the values cut off by ``length``.
        flat = xp.full((n * size + 1, inner), pad, dtype=out_dtype)
        total = len(values)
        if total:
            place = xp.arange(total, dtype=np.int64)
            row = xp.searchsorted(offsets, place, side="right") - 1
            place -= offsets[row]
            dest = xp.where(place < size, row * size + place, n * size)
            flat[dest] = values.reshape(total, inner).astype(out_dtype, copy=False)
        return flat[: n * size].reshape(n, size, *trailing), cut
