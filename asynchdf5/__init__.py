"""asynchdf5: shuffled minibatches from HDF5 files at disk speed, for ``async for`` training loops.

Public names are re-exported here; the implementation lives in ``_``-prefixed modules, one per
stage of the pipeline (see the architecture page of the documentation).
"""

from __future__ import annotations

from . import transforms
from ._batch import Batch
from ._errors import (
    ConfigurationError,
    DataLayerError,
    DeviceError,
    ReadError,
    SchemaError,
    SourceError,
    StateError,
    TransformError,
)
from ._hdf5 import AsyncHDF5DataLayer, HDF5DataLayer
from ._iterator import EpochIterator
from ._memory import MemoryDataLayer
from ._ragged import Ragged
from ._sizing import CacheBudgetWarning
from ._stats import LayerStats
from ._streams import Stream
from ._windows import Windows

__all__ = [
    "AsyncHDF5DataLayer",
    "Batch",
    "CacheBudgetWarning",
    "ConfigurationError",
    "DataLayerError",
    "DeviceError",
    "EpochIterator",
    "HDF5DataLayer",
    "LayerStats",
    "MemoryDataLayer",
    "Ragged",
    "ReadError",
    "SchemaError",
    "SourceError",
    "StateError",
    "Stream",
    "TransformError",
    "Windows",
    "transforms",
]

__version__ = "0.1.0"

# Public classes say where users find them: asynchdf5.ReadError in a traceback, not
# asynchdf5._errors.ReadError (anyio and httpx do the same).
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type):
        _obj.__module__ = __name__
del _name, _obj
