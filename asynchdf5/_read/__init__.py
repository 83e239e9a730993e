"""Chunk reading: the reader the pipeline reads through (:mod:`._reader`) and the steps of its
read plans (:mod:`._steps`), the reader that serves a mapped file in place (:mod:`._mapped`),
and the choice between them (:mod:`._choice`)."""

from ._choice import Choice, choose, probe
from ._mapped import MappedReader
from ._reader import HDF5Reader, Reader, fill_threads

__all__ = ["Choice", "HDF5Reader", "MappedReader", "Reader", "choose", "fill_threads", "probe"]
