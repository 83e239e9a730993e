"""The in-memory layer: :class:`MemoryDataLayer`, arrays served in place (Mocha's
MemoryDataLayer; also the test double for everything above the reader), through its own
:class:`MemoryReader` (nothing is read: the whole data set is one chunk, its rows at their
global indices)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from anyio.from_thread import BlockingPortal

from ._catalog import TopInfo
from ._config import LayerConfig, Properties, document
from ._errors import ConfigurationError, SchemaError
from ._layer import LayerBase
from ._opened import Opened
from ._plan import ChunkPlan
from ._ragged import Ragged
from ._shape import DataShape
from ._sizing import held_rows
from ._stats import ReadStats
from ._windows import Windows, window_view

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover
    from typing_extensions import Unpack

__all__ = ["MemoryDataLayer", "MemoryReader"]


class MemoryReader:
    """Arrays in memory (``MemoryDataLayer``): rows are served in place, nothing is read."""

    in_place = True
    reads_at_once = 1
    read_paths: Mapping[str, str] = {}
    read_notes: Mapping[str, str] = {}

    def __init__(self, arrays: Mapping[str, np.ndarray], tops: Mapping[str, TopInfo]) -> None:
        self.own_arrays = arrays
        self.tops = tops
        self.n_samples = len(next(iter(arrays.values())))

    async def read(
        self, chunk: ChunkPlan, into: Mapping[str, np.ndarray] | None, stats: ReadStats
    ) -> tuple[Mapping[str, np.ndarray], bool]:
        return self.own_arrays, True

    def release(self, chunk: ChunkPlan) -> None:
        pass

    verify = None
    guard = None

    async def aclose(self) -> None:
        pass


class MemoryDataLayer(LayerBase):
    """The same interface and semantics as :class:`AsyncHDF5DataLayer`, over arrays in memory.

    Works with ``async with`` / ``async for`` and with ``with`` / ``for``. The whole data set
    is one chunk, served in place; ``tops`` defaults to every key of ``data``.
    """

    def __init__(self, data: Mapping[str, Any], **properties: Unpack[Properties]) -> None:
        if not isinstance(data, Mapping) or not data:
            raise ConfigurationError("data must be a non-empty mapping of top name to array")
        arrays = {str(k): _fixed_rows(str(k), v) for k, v in data.items()}
        config = LayerConfig.parse(
            {"tops": tuple(arrays), **properties} if properties.get("tops") is None else properties,
            hdf5=False,
            caller=type(self).__name__,
        )
        for top in config.tops:  # a view of the windows: gathered like rows, never copied
            if isinstance(top, Windows) and top in arrays:
                if arrays[top].ndim != 1:
                    raise SchemaError(
                        f"top {top!r} cuts windows from a 1-D array, but data[{str(top)!r}] "
                        f"has shape {arrays[top].shape}"
                    )
                arrays[top] = window_view(arrays[top], top.length, top.stride)
        n = _check_arrays(arrays, config.tops)
        super().__init__(dataclasses.replace(config, chunk_size=max(n, config.batch_size)))
        self._arrays = {k: arrays[k] for k in config.tops}
        self._specs = {k: TopInfo(k, a.dtype, tuple(a.shape[1:])) for k, a in self._arrays.items()}
        self._planner.looked(
            DataShape(
                n_samples=n,
                row_bytes=sum(t.row_bytes for t in self._specs.values()),
                files=(("<memory>", n),),
                tops=tuple((t.name, t.dtype.str, t.sample_shape) for t in self._specs.values()),
                windows=tuple(
                    (str(t), t.length, t.stride) for t in config.tops if isinstance(t, Windows)
                ),
                chunk_rows=self.config.chunk_size,
                block_rows=None,  # one chunk, in place: blocks would change nothing
                first_rows=None,  # nothing to read: no ramp
                resident=True,
            )
        )

    def _look(self) -> DataShape:
        assert self._shape is not None
        return self._shape

    async def _open_source(self, epoch: int, portal: BlockingPortal | None, at: float) -> Opened:
        shape = self._look()
        rows = held_rows(shape, self._planner.resume, epoch)
        self._planner.opening(shape)
        reader = MemoryReader(self._arrays, self._specs)
        return await Opened.enter(
            reader, None, shape, slot_rows=rows, delivery=self._delivery, portal=portal, at=at
        )


def _fixed_rows(name: str, value: Any) -> np.ndarray:
    """``value`` as an array of fixed rows; a :class:`~asynchdf5.Ragged`, a sparse matrix or
    rows of unequal lengths are a SchemaError saying what works (the in-memory layer serves
    arrays in place: it has no heap of values and ``indptr`` to cut rows of varying length
    from), not NumPy's error about an inhomogeneous shape, nor a 0-d array of an object."""
    sparse = hasattr(value, "indptr") and hasattr(value, "tocsr")
    try:
        array = None if sparse or isinstance(value, Ragged) else np.asarray(value)
    except ValueError:  # a sequence of rows of unequal lengths
        array = None
    if array is None:
        raise SchemaError(
            f"data[{name!r}] has rows of varying length ({type(value).__name__}); "
            "MemoryDataLayer serves arrays of fixed rows: pad them (Ragged.to_padded, or "
            "`.toarray()` of a sparse matrix), or write them to an HDF5 file as a ragged group "
            "('data' + 'indptr', docs/sequences.md) or a CSR group (docs/sparse.md) and read it "
            "with HDF5DataLayer"
        )
    return array


def _check_arrays(arrays: Mapping[str, np.ndarray], tops: Sequence[str]) -> int:
    """The number of samples of the arrays that ``tops`` name (checked: SchemaError)."""
    rows: dict[str, int] = {}
    for name in tops:
        if name not in arrays:
            raise SchemaError(f"top {name!r} is not a key of data ({sorted(arrays)})")
        a = arrays[name]
        if a.ndim == 0:
            raise SchemaError(f"top {name!r} is a 0-d array; a top needs one row per sample")
        if a.dtype.kind not in "biufc" or a.dtype.names is not None:
            raise SchemaError(f"top {name!r} has dtype {a.dtype}; not supported")
        rows[name] = len(a)
    if len(set(rows.values())) > 1:
        raise SchemaError(f"the tops have different row counts: {rows}")
    n = next(iter(rows.values()))
    if n == 0:
        raise SchemaError("the arrays hold no samples")
    return n


document(
    MemoryDataLayer,
    hdf5=False,
    defaults={"tops": None},
    first="""data : mapping of str to array
    One array per top, rows = samples, all with the same number of rows.""",
)
