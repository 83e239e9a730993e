"""PyTorch: the layers as ``torch.utils.data.IterableDataset`` objects.

:class:`HDF5IterableDataset` and :class:`MemoryIterableDataset` yield each batch as a ``dict``
of ``torch.Tensor`` (one per top, and ``"indices"`` on request), for
``torch.utils.data.DataLoader(ds, batch_size=None)`` and torchdata's
``StatefulDataLoader(ds, batch_size=None)``. Install torch and torchdata with
``pip install ".[torch]"`` in the asynchdf5 checkout; ``import asynchdf5`` never imports torch,
this module is imported by name.

How it works, for whoever carries it on:

* **One layer per process, made where batches are needed.** The constructor builds a *closed*
  layer in the process that constructs the dataset: a bad property fails there, and with
  ``shuffle=True, seed=None`` and an initialised ``torch.distributed`` every rank takes part in
  the broadcast of rank 0's seed at the same point (every rank constructs its dataset). The
  resolved seed, rank and world size are kept. The first iteration opens the layer through its
  sync interface (``with layer``: the pipeline runs on an event loop in a background thread) and
  it stays open across epochs, so the next epoch's first chunk is read while the training loop
  finishes the last. A copy of the dataset in another process (a DataLoader worker, forked or
  spawned, or any unpickled copy) never touches a layer object it inherited: it builds its own
  from the properties and the resolved seed, rank and world size. Pickling drops the layer.
* **Closing**: :meth:`close`, ``with``, garbage collection and interpreter exit (a
  ``weakref.finalize``), and, in a DataLoader worker, the end of the worker process
  (multiprocessing's finalizers, which run before the process waits for its threads). Each
  closes only a layer opened by the process it runs in.
* **Tensors** are zero-copy: ``torch.from_numpy`` on host batches (a layer reuses a batch buffer
  only once nothing refers to it, and a tensor refers to its array, so a tensor kept is never
  overwritten), ``torch.from_dlpack`` on device batches (CuPy), which also orders PyTorch's
  current stream after the stream the batch was made ready on. A read-only array or one with a
  negative stride (a transformer's result; ``from_numpy`` refuses or warns) is copied.
* **Workers** (the DataLoader's ``num_workers=k > 0``, learned in each worker from
  ``get_worker_info()``): worker ``w`` serves the ``w``-th of ``k`` contiguous runs of its
  rank's batch plan (:func:`~asynchdf5._replan.split_plan`, through the layer's ``_set_part``
  while closed), so the workers together serve the rank's epoch exactly once, ``len()`` is
  the rank's batch count for any ``k``, and the DataLoader's round robin over the workers
  yields their runs interleaved (worker 0's first batch, worker 1's first, ...). Each
  worker's layer gets ``1/k`` of the cache budget (``cache_bytes``, or the default), so the
  workers together hold what one layer would; all ``k`` plan with the same budget, hence the
  same chunks. A DataLoader starts fresh workers for each epoch (unless
  ``persistent_workers=True``), copied from the main process's dataset, which iterates
  nothing itself: so the dataset keeps a small board in shared memory (:class:`_Board`,
  anonymous until pickled for spawned workers): a count of :meth:`set_epoch` calls, the most
  workers seen, and per worker the epoch its next iteration serves, which the worker writes
  when it starts an epoch (or ends one, or loads a state) and the main process's
  :meth:`set_epoch` overwrites. Per worker, because workers start at different moments: a
  worker that read a value one of its siblings had already advanced would serve the wrong
  epoch.
* **Resume with StatefulDataLoader** (torchdata 0.11): the iterator that ``__iter__`` returns has
  no ``state_dict``, so torchdata saves the *dataset's* state. With ``num_workers=0`` it calls
  :meth:`state_dict` in the main process when ``loader.state_dict()`` is called, and restores
  with :meth:`load_state_dict` before it calls ``iter(dataset)``; the layer counts a batch when
  it is handed over, and this dataset takes one from the layer only when the loader asks for
  it, so the state is exactly "the batches the loop has received". With workers, each worker's
  state is taken inside the worker right after it produced a batch and travels with it; the
  loader's snapshot holds, per worker, the state after the last batch of that worker it
  yielded, restores each worker from it and replays the batches since the snapshot
  (``snapshot_every_n_steps``); a worker's state says which run of the rank's batches it
  counts (``part``), and resumes only the same worker of as many. Both are exact: same next
  batch, same indices, same bytes. A loader whose state says its epoch was over starts the
  next epoch with fresh workers, which read the shared board: a worker that loads a state
  with nothing left of its epoch writes the epoch after it. ``len()`` of a resumed epoch
  counts the batches before the state too, as the loader counts them (it warns when it
  yields more batches than ``len()`` said). A loader's state resumes only a loader with the
  same ``num_workers``; torchdata checks the state's shape only at the next ``iter(loader)``,
  with an ``AssertionError``, before the dataset sees it, so :class:`StatefulDataLoader`
  (torchdata's, in :mod:`._loader`) checks it in ``load_state_dict``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover
    from typing_extensions import Unpack

try:  # the modules of this package import from it
    import torch  # noqa: F401
except ImportError as exc:  # tested with torch hidden from the import system
    raise ImportError(
        "asynchdf5.torch needs PyTorch, which is not installed: "
        'pip install ".[torch]" in the asynchdf5 checkout'
    ) from exc

from .._config import HDF5Properties, Properties
from .._hdf5 import HDF5DataLayer
from .._layer import LayerBase
from .._memory import MemoryDataLayer
from .._sizing import default_cache_bytes
from .._sources import SourceLike
from .._streams import Stream
from ._dataset import LayerDataset

__all__ = ["HDF5IterableDataset", "MemoryIterableDataset", "StatefulDataLoader"]


def __getattr__(name: str) -> Any:
    """:class:`StatefulDataLoader` is imported when it is asked for: it needs torchdata,
    which the datasets do not."""
    if name == "StatefulDataLoader":
        from ._loader import StatefulDataLoader

        return StatefulDataLoader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class HDF5IterableDataset(LayerDataset):
    """Batches from HDF5 files as dicts of ``torch.Tensor``, for PyTorch's ``DataLoader``.

    A ``torch.utils.data.IterableDataset`` over :class:`~asynchdf5.HDF5DataLayer`: use it as
    ``DataLoader(ds, batch_size=None)`` (the layer makes the batches) or as torchdata's
    ``StatefulDataLoader(ds, batch_size=None)``, whose ``state_dict()`` then resumes mid-epoch
    exactly. Each iteration is one epoch; each batch is ``{top: tensor}``, zero-copy (host
    batches through ``torch.from_numpy``, device batches through DLPack).

    ``num_workers=0`` is the recommended setting: the layer reads, gathers and transforms on
    threads of its own, outside the training loop, so worker processes mostly add copies
    between processes. They help when the transformers are CPU-heavy Python. Set
    ``num_workers`` on the DataLoader only: its workers split each epoch of this rank into
    contiguous runs of batches, and share the cache budget.

    Parameters
    ----------
    source : str, path, sequence of them, or dict
        The HDF5 files: a source list file, one HDF5 file, or a sequence of paths or URLs
        (see :class:`~asynchdf5.HDF5DataLayer`), or several named streams mixed (a mapping
        of names to :class:`~asynchdf5.Stream` or to sources). Relative paths are resolved now.
    indices : bool
        Add the global indices of the batch's samples as an ``int64`` tensor under
        ``"indices"`` (on the host, also for device batches); with several streams, each
        row's stream too, under ``"streams"`` (unless a top has that name).
    num_workers : int, optional
        Deprecated, and no longer needed: the DataLoader's ``num_workers`` is learned in its
        workers. When given, it must equal the DataLoader's.
    ragged : {"padded", "nested"}
        How a ragged top's batch (:class:`~asynchdf5.Ragged`) arrives: ``"padded"`` (the
        default) as a pair ``(padded, lengths)`` of tensors (zeros past each row's end, to the
        batch's longest row; the batch's keys stay the tops), ``"nested"`` as one jagged
        ``torch.nested`` tensor. A sparse-matrix top arrives as a ``torch.sparse_csr_tensor``
        (or dense, after ``transforms.Densify()``).
    **properties
        The keyword properties of :class:`~asynchdf5.HDF5DataLayer` (``batch_size`` is
        required; ``shuffle``, ``seed``, ``rank``, ``world_size``, ``transformers``,
        ``device``, ...). ``rank`` and ``world_size`` are detected as by the layer (an
        initialised ``torch.distributed``, torchrun's variables, ...), and with
        ``shuffle=True, seed=None`` and an initialised ``torch.distributed``, rank 0's seed is
        broadcast now: construct the dataset on every rank at the same point.

    Attributes
    ----------
    num_workers : int or None
        As given (deprecated).
    indices : bool
        As given.

    Raises
    ------
    ConfigurationError
        A bad property (at once, as the layer would), ``indices=True`` with a top named
        ``"indices"``, or ``device`` with DataLoader workers (in the worker).
    SourceError
        The source cannot be resolved.

    Examples
    --------
    >>> from torch.utils.data import DataLoader
    >>> from asynchdf5.torch import HDF5IterableDataset
    >>> def train(path):
    ...     ds = HDF5IterableDataset(path, batch_size=256, shuffle=True, seed=0)
    ...     loader = DataLoader(ds, batch_size=None)
    ...     for epoch in range(3):
    ...         for batch in loader:
    ...             ...  # batch["data"], batch["label"]: torch.Tensor
    ...     ds.close()
    """

    def __init__(
        self,
        source: SourceLike | Mapping[str, Stream | SourceLike],
        *,
        indices: bool = False,
        num_workers: int | None = None,
        ragged: str = "padded",
        **properties: Unpack[HDF5Properties],
    ) -> None:
        self._source: Any = source
        super().__init__(properties, indices=indices, num_workers=num_workers, ragged=ragged)
        assert isinstance(self._layer, HDF5DataLayer)
        # Resolved: the same files (and streams) in any process.
        self._source = self._layer.streams or list(self._layer.paths)

    def _new_layer(self, **properties: Any) -> LayerBase:
        return HDF5DataLayer(self._source, **properties)

    def _worker_properties(self, properties: dict[str, Any], workers: int) -> dict[str, Any]:
        # A given budget is the workers' together. The default (a third of the memory) is
        # shared as if by one more: each worker process also holds its own runtime, batch
        # buffers and batches in transit, which a layer in the main process shares with the
        # training loop (2 workers under a 512 MiB limit did not fit with halves of it).
        budget = properties.get("cache_bytes")
        if budget is not None:
            share = budget // workers
        else:  # of the memory alone: each worker sizes it, and they must plan alike
            share = default_cache_bytes(held=False) // (workers + 1)
        return {**super()._worker_properties(properties, workers), "cache_bytes": max(1, share)}


class MemoryIterableDataset(LayerDataset):
    """Batches from arrays in memory as dicts of ``torch.Tensor``, for PyTorch's ``DataLoader``.

    The same interface and semantics as :class:`HDF5IterableDataset`, over
    :class:`~asynchdf5.MemoryDataLayer`. With ``num_workers > 0`` every worker gets a copy of
    the arrays (shared copy-on-write when workers are forked, pickled when spawned).

    Parameters
    ----------
    data : mapping of str to array
        One array per top, rows = samples, all with the same number of rows.
    indices : bool
        Add the global indices (row numbers) of the batch's samples as an ``int64`` tensor
        under ``"indices"``.
    num_workers : int, optional
        Deprecated (see :class:`HDF5IterableDataset`).
    **properties
        The keyword properties of :class:`~asynchdf5.MemoryDataLayer` (``batch_size`` is
        required).

    Attributes
    ----------
    num_workers : int or None
        As given (deprecated).
    indices : bool
        As given.

    Examples
    --------
    >>> import numpy as np
    >>> from torch.utils.data import DataLoader
    >>> from asynchdf5.torch import MemoryIterableDataset
    >>> x, y = np.zeros((100, 3), np.float32), np.arange(100)
    >>> with MemoryIterableDataset(data={"x": x, "y": y}, batch_size=32) as ds:
    ...     [len(batch["y"]) for batch in DataLoader(ds, batch_size=None)]
    [32, 32, 32, 4]
    """

    def __init__(
        self,
        data: Mapping[str, Any],
        *,
        indices: bool = False,
        num_workers: int | None = None,
        ragged: str = "padded",
        **properties: Unpack[Properties],
    ) -> None:
        self._data = data
        super().__init__(properties, indices=indices, num_workers=num_workers, ragged=ragged)

    def _new_layer(self, **properties: Any) -> LayerBase:
        return MemoryDataLayer(self._data, **properties)
