"""Chunk reading: the reader the pipeline reads through (:mod:`._reader`) and the steps of its
read plans (:mod:`._steps`)."""

from ._reader import HDF5Reader, MemoryReader, Reader

__all__ = ["HDF5Reader", "MemoryReader", "Reader"]
