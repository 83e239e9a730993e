"""PyTorch: the layers as ``torch.utils.data.IterableDataset`` objects.

:class:`HDF5IterableDataset` and :class:`MemoryIterableDataset` yield each batch as a ``dict``
of ``torch.Tensor`` (one per top, and ``"indices"`` on request), for
``torch.utils.data.DataLoader(ds, batch_size=None)`` and torchdata's
``StatefulDataLoader(ds, batch_size=None)``. Install with ``pip install "asynchdf5[torch]"``;
``import asynchdf5`` never imports torch, this module is imported by name.

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
* **Workers** (``num_workers=k > 0``): worker ``w`` of rank ``r`` of ``W`` serves the layer
  shard ``r * k + w`` of ``W * k``, so the union over workers and ranks is every sample exactly
  once per epoch and every worker yields the same number of batches. The worker's layer is
  made with the dataset's rank and world size and then given its share while closed
  (``_set_shard``): a forked worker inherits an initialised ``torch.distributed``, against
  which the layer refuses an explicit rank of another value. The dataset must be told
  ``k`` (``num_workers=``), because ``DataLoader`` asks ``len(dataset)`` in the main process,
  which cannot know it; a worker checks that it agrees. A DataLoader starts fresh workers for
  each epoch (unless ``persistent_workers=True``), copied from the main process's dataset,
  which iterates nothing itself: so the dataset keeps a small shared-memory tensor, made at
  construction: a count of :meth:`set_epoch` calls, and per worker the epoch its next
  iteration serves, which the worker writes when it starts an epoch (or ends one, or loads a
  state) and the main process's :meth:`set_epoch` overwrites. Per worker, because workers
  start at different moments: a worker that read a value one of its siblings had already
  advanced would serve the wrong epoch.
* **Resume with StatefulDataLoader** (torchdata 0.11): the iterator that ``__iter__`` returns has
  no ``state_dict``, so torchdata saves the *dataset's* state. With ``num_workers=0`` it calls
  :meth:`state_dict` in the main process when ``loader.state_dict()`` is called, and restores
  with :meth:`load_state_dict` before it calls ``iter(dataset)``; the layer counts a batch when
  it is handed over, and this dataset takes one from the layer only when the loader asks for
  it, so the state is exactly "the batches the loop has received". With workers, each worker's
  state is taken inside the worker right after it produced a batch and travels with it; the
  loader's snapshot holds, per worker, the state after the last batch of that worker it
  yielded, restores each worker from it and replays the batches since the snapshot
  (``snapshot_every_n_steps``). Both are exact: same next batch, same indices, same bytes. A
  loader whose state says its epoch was over starts the next epoch with fresh workers, which
  read the shared tensor: a worker that loads a state with nothing left of its epoch writes
  the epoch after it. ``len()`` of a resumed epoch counts the batches before the state too, as
  the loader counts them (it warns when it yields more batches than ``len()`` said).
"""

from __future__ import annotations

import multiprocessing.util
import os
import sys
import weakref
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any

try:
    import torch
    from torch.utils.data import IterableDataset, get_worker_info
    from torch.utils.dlpack import from_dlpack
except ImportError as exc:  # tested with torch hidden from the import system
    raise ImportError(
        'asynchdf5.torch needs PyTorch, which is not installed: pip install "asynchdf5[torch]"'
    ) from exc

import numpy as np

from ._batch import Batch
from ._errors import ConfigurationError, StateError
from ._hdf5 import HDF5DataLayer
from ._layer import _Layer
from ._memory import MemoryDataLayer
from ._sources import SourceLike

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

__all__ = ["HDF5IterableDataset", "MemoryIterableDataset"]

#: The key of the global indices in a batch, with ``indices=True``.
INDICES = "indices"

Tensors = dict[str, torch.Tensor]


def _tensor(array: Any) -> torch.Tensor:
    """``array`` as a tensor over the same memory (a copy only where torch cannot share it)."""
    if type(array).__module__.startswith("cupy"):  # a device batch: DLPack, stream-ordered
        return from_dlpack(array)
    a = np.asarray(array)
    if not a.flags.writeable or any(s < 0 for s in a.strides):
        a = np.array(a)  # from_numpy warns on read-only memory, refuses negative strides
    return torch.from_numpy(a)


def _close_layer(layer: _Layer, pid: int) -> None:
    """Close ``layer`` if this process opened it (a forked copy is never touched)."""
    if os.getpid() == pid:
        layer.close()


class _Epoch(Iterator[Tensors]):
    """One epoch of a dataset, in the process that iterates it.

    Deliberately without ``state_dict``: torchdata's StatefulDataLoader then saves the dataset's
    state, which says where the layer's consumer is at the moment it is asked.
    """

    def __init__(self, dataset: _LayerDataset) -> None:
        self._dataset = dataset
        self._batches: Iterator[Batch] | None = None
        self._started = False
        self._done = False

    def __iter__(self) -> _Epoch:
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


class _LayerDataset(IterableDataset[Tensors]):
    """What both datasets share; subclasses say how to make their layer."""

    def __init__(self, properties: Mapping[str, Any], *, indices: bool, num_workers: int) -> None:
        super().__init__()
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigurationError(f"num_workers must be an int >= 0, not {num_workers!r}")
        if not isinstance(indices, bool):
            raise ConfigurationError(f"indices must be True or False, not {indices!r}")
        layer = self._new_layer(**properties)  # checks every property; may broadcast the seed
        c = layer.config
        if indices and INDICES in c.tops:
            raise ConfigurationError(
                f"indices=True adds the key {INDICES!r}, which is already a top's name"
            )
        if num_workers and c.device is not None:
            raise ConfigurationError(
                "device batches need num_workers=0: CUDA does not survive in DataLoader worker "
                "processes (and the layer has its own threads; see the docs)"
            )
        #: The ``num_workers`` of the DataLoader that iterates this dataset.
        self.num_workers = num_workers
        #: Whether batches carry the global indices of their samples under ``"indices"``.
        self.indices = indices
        self._properties = {
            k: v for k, v in properties.items() if k not in ("seed", "rank", "world_size")
        }
        self._seed, self._seed_given = c.seed, c.seed_given
        self._rank, self._world_size = c.rank, c.world_size
        self._start_epoch = 0  # where a copy in another process starts (no workers)
        # With workers, shared with them: [set_epoch calls, worker 0's next epoch, worker 1's...]
        self._shared: torch.Tensor | None = None
        if num_workers:
            shared = torch.zeros(1 + num_workers, dtype=torch.int64)
            self._shared = shared.share_memory_()  # type: ignore[no-untyped-call]
        self._slot = 1  # this worker's entry in _shared
        self._generation = 0  # the set_epoch calls this worker's layer has followed
        # (epoch, batches of it before the loaded state): len() counts them, as
        # StatefulDataLoader counts them among the batches of the epoch.
        self._resumed: tuple[int, int] | None = None
        self._layer: _Layer | None = None
        self._pid: int | None = None
        self._opened = False
        self._live: weakref.ReferenceType[_Epoch] | None = None
        self._adopt(self._reshard(layer, worker=None))

    # --- what subclasses provide --------------------------------------------------------------

    def _new_layer(self, **properties: Any) -> _Layer:
        raise NotImplementedError

    # --- this process's layer -----------------------------------------------------------------

    def _in_main_with_workers(self) -> bool:
        """In a process that hands the work to DataLoader workers (and iterates nothing)."""
        return self.num_workers > 0 and get_worker_info() is None

    def _reshard(self, layer: _Layer, worker: Any) -> _Layer:
        """``layer`` (closed, fresh) set to this process's shard: the dataset's rank, or a
        worker's share of it; in a process that hands the work to workers, the share of its
        first worker (every worker's share has the same number of batches: ``len``)."""
        k, r, world = self.num_workers, self._rank, self._world_size
        if worker is not None:
            if worker.num_workers != k:
                raise ConfigurationError(
                    f"this dataset was made with num_workers={k}, but DataLoader worker "
                    f"{worker.id} of {worker.num_workers} iterates it: pass the DataLoader's "
                    "num_workers to the dataset too (it splits this rank's shard among the "
                    "workers, and len() counts their batches)"
                )
            rank = r * k + worker.id
        else:
            rank = r * k if k else r
        layer._set_shard(rank, world * max(k, 1), seed_given=self._seed_given)
        return layer

    def _adopt(self, layer: _Layer) -> None:
        """``layer`` is this process's layer from now on."""
        pid = os.getpid()
        self._layer, self._pid, self._opened, self._live = layer, pid, False, None
        weakref.finalize(self, _close_layer, layer, pid)
        if get_worker_info() is not None:
            # A worker process waits for its threads when it ends: close the layer first.
            multiprocessing.util.Finalize(self, _close_layer, args=(layer, pid), exitpriority=0)

    def _this_layer(self) -> _Layer:
        """This process's layer (made on first use in a process this dataset was copied to)."""
        layer = self._layer
        if layer is not None and self._pid == os.getpid():
            return layer
        worker = get_worker_info()
        layer = self._new_layer(
            **self._properties, seed=self._seed, rank=self._rank, world_size=self._world_size
        )
        self._reshard(layer, worker)
        if self._shared is not None:
            self._slot = 1 + (worker.id if worker is not None else 0)
            layer.set_epoch(int(self._shared[self._slot]))
            self._generation = int(self._shared[0])
        else:
            inherited = self._layer  # a forked copy: only its epoch is read
            layer.set_epoch(inherited.epoch if inherited is not None else self._start_epoch)
        self._adopt(layer)
        return layer

    def _abandon(self, keep: _Epoch | None = None) -> None:
        """End the epoch a previous iteration left suspended in this process."""
        live = self._live() if self._live is not None else None
        self._live = None
        if live is not None and live is not keep:
            live.close()

    # --- iterating ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Tensors]:
        """One epoch (the next one) of this process's share, as dicts of tensors."""
        if self._in_main_with_workers():
            raise StateError(
                f"this dataset was made for a DataLoader with num_workers={self.num_workers}: "
                "iterate it through that DataLoader (or make it with num_workers=0)"
            )
        return _Epoch(self)

    def _begin(self, epoch: _Epoch) -> Iterator[Batch]:
        layer = self._this_layer()
        self._abandon(keep=epoch)
        shared = self._shared
        if shared is not None and int(shared[0]) != self._generation:
            layer.set_epoch(int(shared[self._slot]))  # the main process called set_epoch
            self._generation = int(shared[0])
        if not self._opened:
            layer.__enter__()
            self._opened = True
        self._live = weakref.ref(epoch)
        return iter(layer)

    def _started(self, epoch: int) -> None:
        if self._shared is not None:  # this worker's successor starts after this epoch
            self._shared[self._slot] = epoch + 1

    def _ended(self) -> None:
        if self._shared is not None and self._layer is not None:
            self._shared[self._slot] = self._layer.epoch

    def _tensors(self, batch: Batch) -> Tensors:
        out = {name: _tensor(array) for name, array in batch.items()}
        if self.indices:
            out[INDICES] = torch.from_numpy(batch.indices)
        return out

    def __len__(self) -> int:
        """Batches of the next epoch of this process's share: with ``num_workers=k``, in the
        main process, of all ``k`` workers together (what ``len(DataLoader)`` says). An epoch
        resumed from a state counts the batches before the state too, as ``StatefulDataLoader``
        does (only the rest are yielded). May read the files' metadata (blocking) the first
        time."""
        layer = self._this_layer()
        n = len(layer)  # the rest, for a resumed epoch
        if self._in_main_with_workers():
            return n * self.num_workers
        resumed = self._resumed
        if resumed is not None and resumed[0] == layer.epoch:
            n += resumed[1]
        return n

    # --- epochs and resume --------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next iteration serves (the epochs finished, as ``layer.epoch``)."""
        if self._shared is not None and self._in_main_with_workers():
            return int(self._shared[1:].max())
        return self._this_layer().epoch

    @property
    def seed(self) -> int:
        """The seed of the shuffle (rank 0's, or a loaded state's, when ``seed=None``)."""
        return self._seed

    @property
    def rank(self) -> int:
        """This process's rank (detected or given), before any split among workers."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks (detected or given)."""
        return self._world_size

    def set_epoch(self, epoch: int) -> None:
        """Serve ``epoch`` next, from its first batch (as ``DistributedSampler.set_epoch``;
        epochs otherwise advance by themselves). An epoch left suspended in this process (a
        loop left with ``break`` whose iterator is still referenced) is abandoned. With
        workers, call it in the main process: the workers follow."""
        if self._shared is not None and self._in_main_with_workers():
            self._this_layer().set_epoch(epoch)  # checks the value
            self._shared[1:] = epoch
            self._shared[0] += 1
            return
        layer = self._this_layer()
        self._abandon()
        layer.set_epoch(epoch)
        self._resumed = None
        if self._shared is not None:
            self._shared[self._slot] = epoch

    def state_dict(self) -> dict[str, Any]:
        """Where this process's consumer is: the layer's state (plain values, JSON-ready).

        Only batches handed over count. With ``num_workers > 0`` the positions live in the
        workers: use ``StatefulDataLoader``'s own ``state_dict()``, which takes each worker's.
        """
        if self._in_main_with_workers():
            raise StateError(self._no_state("state_dict"))
        return self._this_layer().state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`): the next batch is the one that
        would have come next in the run that saved it. A state from another world size resumes
        elastically (see the layer's docs). An epoch left suspended in this process is
        abandoned, and an open layer is closed first (reopened at the next iteration with the
        saved cache sizes)."""
        if self._in_main_with_workers():
            raise StateError(self._no_state("load_state_dict"))
        layer = self._this_layer()
        self._abandon()
        if self._opened:
            self._opened = False
            layer.close()
        layer.load_state_dict(state)
        self._seed = layer.config.seed  # seed=None takes the saved seed
        done = state["chain"] if state["mode"] == "epoch" else []
        self._resumed = (layer.epoch, sum(int(batches) for _, batches in done))
        if self._shared is not None:
            # Workers started later (the next epoch's) go on after this epoch, or, when nothing
            # is left of it (a state saved at its end), after it already: StatefulDataLoader
            # then starts them at once, while these may still be finding the epoch empty.
            self._shared[self._slot] = layer.epoch + (len(layer) == 0)

    def _no_state(self, what: str) -> str:
        return (
            f"{what}() in the main process of a DataLoader with num_workers={self.num_workers}: "
            "the positions are in the workers; use torchdata's StatefulDataLoader, whose "
            f"{what}() handles each worker's"
        )

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop this process's pipeline and release its threads and files (idempotent). The
        next iteration opens it again and goes on with the next epoch."""
        self._abandon()
        layer = self._layer
        if layer is not None and self._opened and self._pid == os.getpid():
            self._opened = False
            layer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        layer = self._layer
        if layer is not None and self._pid == os.getpid() and self._shared is None:
            state["_start_epoch"] = layer.epoch
        state.update(_layer=None, _pid=None, _opened=False, _live=None)
        return state


class HDF5IterableDataset(_LayerDataset):
    """Batches from HDF5 files as dicts of ``torch.Tensor``, for PyTorch's ``DataLoader``.

    A ``torch.utils.data.IterableDataset`` over :class:`~asynchdf5.HDF5DataLayer`: use it as
    ``DataLoader(ds, batch_size=None)`` (the layer makes the batches) or as torchdata's
    ``StatefulDataLoader(ds, batch_size=None)``, whose ``state_dict()`` then resumes mid-epoch
    exactly. Each iteration is one epoch; each batch is ``{top: tensor}``, zero-copy (host
    batches through ``torch.from_numpy``, device batches through DLPack).

    ``num_workers=0`` is the recommended setting: the layer reads, gathers and transforms on
    threads of its own, outside the training loop, so worker processes only add copies between
    processes. With ``num_workers=k`` (the same on every rank), pass ``k`` here too.

    Parameters
    ----------
    source : str, path or sequence of them
        The HDF5 files: a source list file, one HDF5 file, or a sequence of paths or URLs
        (see :class:`~asynchdf5.HDF5DataLayer`). Relative paths are resolved now.
    indices : bool
        Add the global indices of the batch's samples as an ``int64`` tensor under
        ``"indices"`` (on the host, also for device batches).
    num_workers : int
        The ``num_workers`` of the DataLoader that iterates this dataset. With ``k > 0``,
        worker ``w`` of rank ``r`` serves the shard ``r * k + w`` of ``world_size * k``: every
        worker yields the same number of batches, each with its own last partial batch (or
        leftover, with ``drop_last=True``), so an epoch may have up to ``k - 1`` more batches
        than with ``num_workers=0``, in another order.
    **properties
        The keyword properties of :class:`~asynchdf5.HDF5DataLayer` (``batch_size`` is
        required; ``shuffle``, ``seed``, ``rank``, ``world_size``, ``transformers``,
        ``device``, ...). ``rank`` and ``world_size`` are detected as by the layer (an
        initialised ``torch.distributed``, torchrun's variables, ...), and with
        ``shuffle=True, seed=None`` and an initialised ``torch.distributed``, rank 0's seed is
        broadcast now: construct the dataset on every rank at the same point.

    Attributes
    ----------
    num_workers : int
        As given.
    indices : bool
        As given.

    Raises
    ------
    ConfigurationError
        A bad property (at once, as the layer would), ``indices=True`` with a top named
        ``"indices"``, or ``device`` with ``num_workers > 0``.
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
        source: SourceLike,
        *,
        indices: bool = False,
        num_workers: int = 0,
        **properties: Any,
    ) -> None:
        self._source: Any = source
        super().__init__(properties, indices=indices, num_workers=num_workers)
        assert isinstance(self._layer, HDF5DataLayer)
        self._source = list(self._layer.paths)  # resolved: the same files in any process

    def _new_layer(self, **properties: Any) -> _Layer:
        return HDF5DataLayer(self._source, **properties)


class MemoryIterableDataset(_LayerDataset):
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
    num_workers : int
        The ``num_workers`` of the DataLoader that iterates this dataset (see
        :class:`HDF5IterableDataset`).
    **properties
        The keyword properties of :class:`~asynchdf5.MemoryDataLayer` (``batch_size`` is
        required).

    Attributes
    ----------
    num_workers : int
        As given.
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
        num_workers: int = 0,
        **properties: Any,
    ) -> None:
        self._data = data
        super().__init__(properties, indices=indices, num_workers=num_workers)

    def _new_layer(self, **properties: Any) -> _Layer:
        return MemoryDataLayer(self._data, **properties)
