"""asynchdf5: shuffled minibatches from HDF5 files at disk speed, for ``async for`` training loops.

Public names are re-exported here; the implementation lives in ``_``-prefixed modules.
"""

from __future__ import annotations

from . import transforms
from ._batch import Batch
from ._cache import CacheBudgetWarning
from ._errors import (
    ConfigurationError,
    DataLayerError,
    DeviceError,
    ReadError,
    SchemaError,
    SourceError,
    TransformError,
)
from .layers import AsyncHDF5DataLayer, HDF5DataLayer, LayerStats, MemoryDataLayer

__all__ = [
    "AsyncHDF5DataLayer",
    "Batch",
    "CacheBudgetWarning",
    "ConfigurationError",
    "DataLayerError",
    "DeviceError",
    "HDF5DataLayer",
    "LayerStats",
    "MemoryDataLayer",
    "ReadError",
    "SchemaError",
    "SourceError",
    "TransformError",
    "transforms",
]

__version__ = "0.1.0"
