"""One epoch of a dataset in the process that iterates it, and its batches as tensors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack

from .._batch import Batch

if TYPE_CHECKING:
    from ._dataset import LayerDataset

#: The key of the global indices in a batch, with ``indices=True``.
INDICES = "indices"
#: ... and with several streams, the stream of each row (an index into ``stream_names``).
STREAMS = "streams"

Tensors = dict[str, torch.Tensor]


def as_tensor(array: Any) -> torch.Tensor:
    """``array`` as a tensor over the same memory (a copy only where torch cannot share it)."""
    if type(array).__module__.startswith("cupy"):  # a device batch: DLPack, stream-ordered
        return from_dlpack(array)
    a = np.asarray(array)
    if not a.flags.writeable or any(s < 0 for s in a.strides):
        a = np.array(a)  # from_numpy warns on read-only memory, refuses negative strides
    return torch.from_numpy(a)


class Epoch(Iterator[Tensors]):
    """One epoch of a dataset, in the process that iterates it.

    Deliberately without ``state_dict``: torchdata's StatefulDataLoader then saves the dataset's
    state, which says where the layer's consumer is at the moment it is asked.
    """

    def __init__(self, dataset: LayerDataset) -> None:
        self._dataset = dataset
        self._batches: Iterator[Batch] | None = None
        self._started = False
        self._done = False

    def __iter__(self) -> Epoch:
        return self

    def __next__(self) -> Tensors:
        if self._done:
            raise StopIteration
        ds = self._dataset
        if self._batches is None:
            self._batches = ds._begin(self)
        try:
            batch = next(self._batches)
        except StopIteration:
            self._done, self._batches = True, None
            ds._ended()
            raise
        except BaseException:
            self._done, self._batches = True, None
            raise
        if not self._started:
            self._started = True
            ds._started(batch.epoch)
        return ds._tensors(batch)

    def close(self) -> None:
        """Leave the epoch (what ``break`` does to a layer's ``for``)."""
        self._done = True
        batches, self._batches = self._batches, None
        close = getattr(batches, "close", None)
        if close is not None:
            close()
