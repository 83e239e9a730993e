"""The asynchdf5 exception family.

Every error the library raises on purpose derives from :class:`DataLayerError`; the subclasses say
which stage failed. Messages name the file, the top, the rows or the transformer involved, and the
original exception is always chained (``raise ... from exc``).
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "DataLayerError",
    "DeviceError",
    "ReadError",
    "SchemaError",
    "SourceError",
    "StateError",
    "TransformError",
]


class DataLayerError(Exception):
    """Base class of every error raised by asynchdf5."""


class ConfigurationError(DataLayerError, ValueError):
    """A keyword property has a bad value (at construction), or the properties cannot work with
    the source (at ``async with``: no batch to yield, a cache budget too small for a batch)."""


class StateError(DataLayerError, RuntimeError):
    """The layer is used in a state that does not allow it: opened twice, iterated when not
    open or by two consumers at once, an iterator used after its layer closed."""


class SourceError(DataLayerError):
    """The source list, or a file it names, is missing, unreadable, empty or not HDF5, or
    data it points to (an external link's target, external storage, a virtual dataset's
    source) cannot be read as stored."""


class SchemaError(DataLayerError):
    """The tops do not match across files: missing, unequal row counts, shape/dtype, kind."""


class ReadError(DataLayerError):
    """Reading rows of a file failed during an epoch (truncated, deleted, I/O error)."""


class TransformError(DataLayerError):
    """A transformer raised, or returned an array with a different number of rows."""


class DeviceError(DataLayerError):
    """Uploading a batch to the GPU failed during an epoch (out of device memory, a CUDA error)."""
