"""Chunk reading: the reader the pipeline reads through (:mod:`._reader`) and the steps of its
read plans (:mod:`._steps`), and the reader that serves a mapped file in place (:mod:`._mapped`)."""

from ._mapped import MappedReader, refusal
from ._reader import HDF5Reader, MemoryReader, Reader

__all__ = ["HDF5Reader", "MappedReader", "MemoryReader", "Reader", "refusal"]
