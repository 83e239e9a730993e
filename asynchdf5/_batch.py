"""The public :class:`Batch`: what the consumer receives, one minibatch.

A read-only mapping from top name to an array (NumPy, or CuPy with a device) whose rows are
samples, with the global indices and the epoch of those samples. Made by the delivery
(:mod:`._delivery`), from rows the batcher cut (:mod:`._specs`) and gathered (:mod:`._gather`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

__all__ = ["Batch"]


class Batch(Mapping[str, Any]):
    """One minibatch: a read-only mapping from top name to an array whose rows are samples.

    Attributes
    ----------
    indices : numpy.ndarray
        int64, the global index of each row's sample, in row order.
    epoch : int
        The epoch the batch belongs to (for :meth:`AsyncHDF5DataLayer.stream`, the epoch it
        started in).
    streams : numpy.ndarray or None
        With several streams (``source={name: Stream(...)}``): the stream each row came from,
        as an index into the layer's ``stream_names``, in row order; ``None`` without.
    """

    __slots__ = ("_data", "epoch", "indices", "streams")

    def __init__(self, data: dict[str, Any], indices: np.ndarray, epoch: int) -> None:
        self._data = data
        self.indices = indices
        self.epoch = epoch
        self.streams: np.ndarray | None = None

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    @property
    def size(self) -> int:
        """Rows in the batch."""
        return len(self.indices)

    def __repr__(self) -> str:
        tops = ", ".join(
            f"{k!r}: {type(v).__module__.split('.')[0]}{tuple(v.shape)} {v.dtype}"
            if hasattr(v, "shape")
            else f"{k!r}: {v!r}"  # a ragged top's value
            for k, v in self._data.items()
        )
        return f"Batch(epoch={self.epoch}, rows={self.size}, {{{tops}}})"
