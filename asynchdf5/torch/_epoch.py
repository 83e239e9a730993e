"""One epoch of a dataset in the process that iterates it, and its batches as tensors."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack

from .._batch import Batch
from .._errors import ConfigurationError
from .._ragged import Ragged

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


#: How a ragged top's batch reaches torch (the datasets' ``ragged=``).
RAGGED_FORMS = ("padded", "nested")


def check_ragged_form(form: object) -> str:
    if form not in RAGGED_FORMS:
        raise ConfigurationError(
            f"ragged must be one of {', '.join(map(repr, RAGGED_FORMS))}, not {form!r}"
        )
    return str(form)


def as_torch(value: Any, ragged: str = "padded") -> Any:
    """A batch's value for torch: a tensor (:func:`as_tensor`); a ragged top's
    :class:`~asynchdf5.Ragged` as ``(padded, lengths)`` tensors (``ragged="padded"``, padded
    with 0 to the batch's longest row) or one jagged ``torch.nested`` tensor
    (``ragged="nested"``); a sparse top's ``scipy.sparse`` CSR batch as a
    ``torch.sparse_csr_tensor`` (int64 indices)."""
    if isinstance(value, Ragged):
        if ragged == "nested":
            return torch.nested.nested_tensor_from_jagged(
                as_tensor(value.values), as_tensor(value.offsets)
            )
        padded, lengths = value.to_padded()
        return torch.from_numpy(padded), torch.from_numpy(lengths)
    if type(value).__module__.startswith("scipy.sparse") and getattr(value, "format", "") == "csr":
        with warnings.catch_warnings():  # torch says its CSR tensors are "in beta", once
            warnings.filterwarnings("ignore", "Sparse CSR tensor support", UserWarning)
            return torch.sparse_csr_tensor(
                torch.from_numpy(np.asarray(value.indptr, np.int64)),
                torch.from_numpy(np.asarray(value.indices, np.int64)),
                as_tensor(value.data),
                size=value.shape,
                check_invariants=False,  # the layer's own arrays, checked at open (indptr)
            )
    return as_tensor(value)


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
