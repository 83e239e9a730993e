"""What both datasets share: one layer per process, the shares of DataLoader workers, epochs
(:class:`Epoch`, and its batches as tensors) and resume (see the package's docstring), and
what Lightning is told about them (:func:`quiet_len_warning`)."""

from __future__ import annotations

import mmap
import multiprocessing.util
import os
import sys
import warnings
import weakref
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.dlpack import from_dlpack

from .._batch import Batch
from .._errors import ConfigurationError, StateError
from .._layer import LayerBase
from .._ragged import Ragged
from .._resume import batches_before
from ._shared import Ring

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self


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


#: The modules of the sparse batches: a host's (scipy) and a device's (CuPy).
_SPARSE = ("scipy.sparse", "cupyx.scipy.sparse")


def as_torch(value: Any, ragged: str = "padded") -> Any:
    """A batch's value for torch: a tensor (:func:`as_tensor`); a ragged top's
    :class:`~asynchdf5.Ragged` as ``(padded, lengths)`` tensors (``ragged="padded"``, padded
    with 0 to the batch's longest row) or one jagged ``torch.nested`` tensor
    (``ragged="nested"``); a sparse top's ``scipy.sparse`` CSR batch as a
    ``torch.sparse_csr_tensor`` (int64 indices). Device batches (a Ragged of CuPy arrays, a
    ``cupyx.scipy.sparse`` CSR matrix) become CUDA tensors the same way, through DLPack."""
    if isinstance(value, Ragged):
        if ragged == "nested":
            return torch.nested.nested_tensor_from_jagged(
                as_tensor(value.values), as_tensor(value.offsets)
            )
        padded, lengths = value.to_padded()
        return as_tensor(padded), as_tensor(lengths)
    module = type(value).__module__
    if module.startswith(_SPARSE) and getattr(value, "format", "") == "csr":
        with warnings.catch_warnings():  # torch says its CSR tensors are "in beta", once
            warnings.filterwarnings("ignore", "Sparse CSR tensor support", UserWarning)
            return torch.sparse_csr_tensor(
                as_tensor(value.indptr.astype(np.int64, copy=False)),
                as_tensor(value.indices.astype(np.int64, copy=False)),
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


# --- Lightning ---------------------------------------------------------------------------------

#: The start of Lightning's message (a regular expression, matched at the message's start).
LEN_WARNING = r"Your `IterableDataset` has `__len__` defined"
#: The modules it is raised from: the ``lightning`` package and the standalone one.
LEN_WARNING_MODULES = r"(lightning\.pytorch|pytorch_lightning)\.utilities\.data"


def quiet_len_warning() -> None:
    """Ignore Lightning's warning about ``__len__`` of an ``IterableDataset``. Idempotent: the
    filter is moved to the front, never duplicated.

    Lightning warns, for every ``IterableDataset`` that has ``__len__``, that the length "could
    be inaccurate if each worker is not configured independently" (``has_len_all_ranks`` in
    ``lightning.pytorch.utilities.data``, on every ``fit``). For these datasets it is accurate
    by construction: each rank's epoch has the same number of batches, and DataLoader workers
    split that rank's batch plan among themselves, so ``len()`` is the batches the loader yields
    whatever ``num_workers``. Lightning has no way to be told so but a warnings filter, and the
    warning is a plain ``UserWarning``; so making a dataset installs a filter for that one
    message, raised from that one Lightning module, and nothing else (another IterableDataset in
    the same process loses the same warning, which says nothing about asynchdf5's).
    """
    warnings.filterwarnings(
        "ignore", message=LEN_WARNING, category=UserWarning, module=LEN_WARNING_MODULES
    )


# --- the dataset -------------------------------------------------------------------------------

#: The most DataLoader workers a dataset serves (each has an entry in the shared board).
MAX_WORKERS = 256


class _Board:
    """A few ``int64`` values shared with DataLoader workers: ``[set_epoch calls, the most
    workers seen, worker 0's next epoch, worker 1's, ...]``.

    Anonymous shared memory (no descriptor held; forked workers inherit it), moved into
    torch's shared memory the first time it is pickled (spawned workers get it that way).
    """

    def __init__(self) -> None:
        self._map: mmap.mmap | None = mmap.mmap(-1, 8 * (2 + MAX_WORKERS))
        self._tensor: torch.Tensor | None = None
        self.values = np.frombuffer(self._map, np.int64)

    def __getstate__(self) -> dict[str, Any]:
        if self._tensor is None:
            tensor = torch.from_numpy(self.values.copy())
            self._tensor = tensor.share_memory_()  # type: ignore[no-untyped-call]
            self.values = self._tensor.numpy()  # from now on, here too
        return {"tensor": self._tensor}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._map, self._tensor = None, state["tensor"]
        self.values = state["tensor"].numpy()


def _close_layer(layer: LayerBase, pid: int) -> None:
    """Close ``layer`` if this process opened it (a forked copy is never touched)."""
    if os.getpid() == pid:
        layer.close()


class LayerDataset(IterableDataset[Tensors]):
    """What both datasets share; subclasses say how to make their layer."""

    def __init__(
        self,
        properties: Mapping[str, Any],
        *,
        indices: bool,
        num_workers: int | None,
        ragged: str = "padded",
    ) -> None:
        super().__init__()
        #: How a ragged top's batch reaches torch (:func:`as_torch`).
        self.ragged = check_ragged_form(ragged)
        if num_workers is not None and (
            isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0
        ):
            raise ConfigurationError(f"num_workers must be an int >= 0, not {num_workers!r}")
        if not isinstance(indices, bool):
            raise ConfigurationError(f"indices must be True or False, not {indices!r}")
        layer = self._new_layer(**properties)  # checks every property; may broadcast the seed
        c = layer.config
        own = {t for s in getattr(layer, "streams", {}).values() for t in s.tops or ()}
        if indices and INDICES in {*c.tops, *own}:
            raise ConfigurationError(
                f"indices=True adds the key {INDICES!r}, which is already a top's name"
            )
        if num_workers:
            self._check_device(c.device)
        if num_workers is not None:
            warnings.warn(
                "num_workers= of the dataset is deprecated and no longer needed: set it on the "
                "DataLoader only (the workers split this rank's batches among themselves)",
                DeprecationWarning,
                stacklevel=3,
            )
        #: The deprecated ``num_workers`` given at construction (``None``: not given); a
        #: DataLoader with another number of workers is then refused.
        self.num_workers = num_workers
        #: Whether batches carry the global indices of their samples under ``"indices"``.
        self.indices = indices
        self._properties = {
            k: v for k, v in properties.items() if k not in ("seed", "rank", "world_size")
        }
        self._seed, self._seed_given = c.seed, c.seed_given
        self._prefetch = c.prefetch
        self._rank, self._world_size = c.rank, c.world_size
        self._start_epoch = 0  # where a copy in another process starts (no workers)
        self._board = _Board()  # shared with the workers (see the package's docstring)
        self._slot = 2  # this worker's entry in the board
        self._generation = 0  # the set_epoch calls this worker's layer has followed
        # (epoch, batches of it before the loaded state): len() counts them, as
        # StatefulDataLoader counts them among the batches of the epoch.
        self._resumed: tuple[int, int] | None = None
        self._layer: LayerBase | None = None
        self._pid: int | None = None
        self._opened = False
        self._live: weakref.ReferenceType[Epoch] | None = None
        self._ring: Ring | None = None  # a DataLoader worker's shared memory (see _shared)
        self._adopt(layer)
        quiet_len_warning()  # len() is exact per rank and per worker: Lightning need not warn

    # --- what subclasses provide --------------------------------------------------------------

    def _new_layer(self, **properties: Any) -> LayerBase:
        raise NotImplementedError

    def _worker_properties(self, properties: dict[str, Any], workers: int) -> dict[str, Any]:
        """The properties of one of ``workers`` workers' layers: they share the batches read
        ahead (``prefetch``), as they share the cache budget (where there is one)."""
        return {**properties, "prefetch": max(1, self._prefetch // workers)}

    # --- this process's layer -----------------------------------------------------------------

    def _in_main_with_workers(self) -> bool:
        """In a process that hands the work to DataLoader workers (and iterates nothing): made
        with the deprecated ``num_workers > 0``, or whose workers have served."""
        if get_worker_info() is not None:
            return False
        return bool(self.num_workers) or int(self._board.values[1]) > 0

    def _check_device(self, device: Any) -> None:
        if device is not None:
            raise ConfigurationError(
                "device batches need num_workers=0: CUDA does not survive in DataLoader worker "
                "processes (and the layer has its own threads; see the docs)"
            )

    def _worker_layer(self, worker: Any) -> LayerBase:
        """A DataLoader worker's layer: this rank's, serving the worker's contiguous run of
        every epoch's batches, with its share of the cache budget."""
        k, declared = worker.num_workers, self.num_workers
        if declared is not None and declared != k:
            raise ConfigurationError(
                f"this dataset was made with num_workers={declared}, but DataLoader worker "
                f"{worker.id} of {k} iterates it: leave num_workers out of the dataset (it is "
                "deprecated), or give the DataLoader's"
            )
        if k > MAX_WORKERS:
            raise ConfigurationError(
                f"a DataLoader with {k} workers: this dataset serves at most {MAX_WORKERS}"
            )
        properties = self._worker_properties(dict(self._properties), k)
        layer = self._new_layer(
            **properties, seed=self._seed, rank=self._rank, world_size=self._world_size
        )
        self._check_device(layer.config.device)
        layer._set_part(worker.id, k)
        # Batches gathered into shared memory cross to the main process without a copy.
        self._ring = Ring()
        layer._gather_into(self._ring)
        values = self._board.values
        values[1] = max(int(values[1]), k)
        return layer

    def _adopt(self, layer: LayerBase) -> None:
        """``layer`` is this process's layer from now on."""
        pid = os.getpid()
        self._layer, self._pid, self._opened, self._live = layer, pid, False, None
        weakref.finalize(self, _close_layer, layer, pid)
        if get_worker_info() is not None:
            # A worker process waits for its threads when it ends: close the layer first.
            multiprocessing.util.Finalize(self, _close_layer, args=(layer, pid), exitpriority=0)

    def _this_layer(self) -> LayerBase:
        """This process's layer (made on first use in a process this dataset was copied to)."""
        layer = self._layer
        if layer is not None and self._pid == os.getpid():
            return layer
        worker = get_worker_info()
        if worker is not None:
            layer = self._worker_layer(worker)
            values = self._board.values
            self._slot = 2 + worker.id
            layer.set_epoch(int(values[self._slot]))
            self._generation = int(values[0])
        else:
            layer = self._new_layer(
                **self._properties, seed=self._seed, rank=self._rank, world_size=self._world_size
            )
            inherited = self._layer  # a forked copy: only its epoch is read
            layer.set_epoch(inherited.epoch if inherited is not None else self._start_epoch)
        self._adopt(layer)
        return layer

    def _abandon(self, keep: Epoch | None = None) -> None:
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
                "this dataset's epochs are served by DataLoader workers (num_workers > 0): "
                "iterate it through a DataLoader"
            )
        return Epoch(self)

    def _begin(self, epoch: Epoch) -> Iterator[Batch]:
        layer = self._this_layer()
        self._abandon(keep=epoch)
        values = self._board.values
        if get_worker_info() is not None and int(values[0]) != self._generation:
            layer.set_epoch(int(values[self._slot]))  # the main process called set_epoch
            self._generation = int(values[0])
        if not self._opened:
            # Marked first: a Ctrl-C as the opening returns would leave an open layer that
            # close() does not close (and the next iteration's opening failing).
            self._opened = True
            try:
                layer.__enter__()
            except BaseException:  # the layer closed itself, unless this came as it returned
                layer.close()
                self._opened = False
                raise
        self._live = weakref.ref(epoch)
        return iter(layer)

    def _mark(self, epoch: int) -> None:
        """Workers started from now on serve ``epoch`` next: in a worker, its successor and
        those of ids its DataLoader has none of (a later loader may have more workers); in the
        main process, every worker."""
        values = self._board.values
        worker = get_worker_info()
        if worker is not None:
            values[self._slot] = epoch
            values[2 + worker.num_workers :] = epoch
        else:
            values[2:] = epoch

    def _started(self, epoch: int) -> None:
        self._mark(epoch + 1)

    def _ended(self) -> None:
        if self._layer is not None:
            self._mark(self._layer.epoch)

    def _tensors(self, batch: Batch) -> Tensors:
        if self._ring is not None:  # a worker's: to the main process as shared memory
            shared = self._ring.pack(batch, INDICES if self.indices else None)
            if shared is not None:
                return cast(Tensors, shared)  # unpickled in the main process, it is Tensors
        out = {name: as_torch(array, self.ragged) for name, array in batch.items()}
        if self.indices:
            out[INDICES] = torch.from_numpy(batch.indices)
            if batch.streams is not None and STREAMS not in out:
                out[STREAMS] = torch.from_numpy(batch.streams)
        return out

    def __len__(self) -> int:
        """Batches of this rank's next epoch, whatever the DataLoader's ``num_workers`` (its
        workers share them out; in a worker, that worker's run of them). An epoch resumed from
        a state counts the batches before the state too, as ``StatefulDataLoader`` does (only
        the rest are yielded). May read the files' metadata (blocking) the first time."""
        layer = self._this_layer()
        n = len(layer)  # the rest, for a resumed epoch
        resumed = self._resumed
        if resumed is not None and resumed[0] == layer.epoch:
            n += resumed[1]
        return n

    @property
    def categories(self) -> dict[str, tuple[Any, ...]]:
        """The category names of each top that is a categorical group, in code order (see
        :attr:`asynchdf5.HDF5DataLayer.categories`). May read the files' metadata (blocking)
        the first time."""
        return self._this_layer().categories

    # --- epochs and resume --------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next iteration serves (the epochs finished, as ``layer.epoch``)."""
        if self._in_main_with_workers():
            k = max(int(self._board.values[1]), self.num_workers or 0)
            return int(self._board.values[2 : 2 + k].max())
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
        layer = self._this_layer()
        self._abandon()
        layer.set_epoch(epoch)  # checks the value
        self._resumed = None
        self._mark(epoch)
        if get_worker_info() is None:
            self._board.values[0] += 1  # persistent workers follow too

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
        self._resumed = (layer.epoch, batches_before(state))
        # Workers started later (the next epoch's) go on after this epoch, or, when nothing is
        # left of it (a state saved at its end), after it already: StatefulDataLoader then
        # starts them at once, while these may still be finding the epoch empty.
        self._mark(layer.epoch + (len(layer) == 0))

    def _no_state(self, what: str) -> str:
        return (
            f"{what}() in the main process of a DataLoader with worker processes: "
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
        if layer is not None and self._pid == os.getpid():
            state["_start_epoch"] = layer.epoch
        state.update(_layer=None, _pid=None, _opened=False, _live=None, _ring=None)
        return state
