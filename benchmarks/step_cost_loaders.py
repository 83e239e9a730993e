"""The loaders ``step_cost`` compares: endless iterators of (data, label) NumPy arrays.

Each one (:data:`SYNC`, and :func:`async_batches` for ``async for``) iterates over as many epochs
as the step asks for, with the properties every asynchdf5 loader of the benchmark shares
(:data:`LAYER_OPTIONS` added: ``--layer``, set in the child). Kept apart from the measurement so
that what is compared reads in one place, beside how it is driven and reported.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from benchmarks import data
from benchmarks.config import IMAGE_SHAPE

__all__ = [
    "BATCH",
    "ENV",
    "LAYER_OPTIONS",
    "LOADERS",
    "NEEDS",
    "SYNC",
    "Pair",
    "async_batches",
    "free_batches",
]

Pair = tuple[npt.NDArray[Any], npt.NDArray[Any]]

#: The loaders, by ``--loaders`` name (``async`` and ``async_process`` drive :func:`async_batches`).
LOADERS = (
    "free",
    "layer",
    "async",
    "torch",
    "dataloader",
    "shm",
    "process",
    "async_process",
    "torch_process",
    "lightning",
    "lightning_free",
    "keras",
    "keras_free",
    "jax",
    "jax_free",
)
#: The packages a client loader needs (it is skipped, with a note, where one is missing).
NEEDS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "torch_process": ("torch",),
    "dataloader": ("torch",),
    "lightning": ("lightning", "torchdata"),
    "lightning_free": ("lightning", "torchdata"),
    "keras": ("keras", "jax"),  # Keras on its JAX backend
    "keras_free": ("keras", "jax"),
    "jax": ("jax",),
    "jax_free": ("jax",),
}
#: Environment of the child that measures a loader (set before anything is imported there).
ENV: dict[str, dict[str, str]] = {
    "keras": {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"},
    "keras_free": {"KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"},
    "jax": {"JAX_PLATFORMS": "cpu"},
    "jax_free": {"JAX_PLATFORMS": "cpu"},
}
BATCH = 256
#: Extra layer properties for this run (``--layer``), set in the child.
LAYER_OPTIONS: dict[str, Any] = {}


def _kwargs(source: str, chunk_size: int) -> dict[str, Any]:
    return {
        "batch_size": BATCH,
        "tops": ("data", "label"),
        "shuffle": True,
        "seed": 0,
        "chunk_size": chunk_size,
    } | LAYER_OPTIONS


def free_pair() -> Pair:
    """The free batch: made once, reused by every free step."""
    rng = np.random.default_rng(0)
    return (
        rng.integers(0, 256, (BATCH, *IMAGE_SHAPE), dtype=np.uint8),
        rng.integers(0, 10, BATCH, dtype=np.int64),
    )


def free_batches(*_: Any) -> Iterator[Pair]:
    pair = free_pair()
    while True:
        yield pair


def _epoch_batches(source: str, chunk_size: int) -> int:
    """Batches in an epoch of the asynchdf5 loaders (a free client row's epoch length)."""
    import h5py

    with h5py.File(source, "r") as f:
        return len(f["label"]) // BATCH


def layer_batches(source: str, chunk_size: int, **extra: Any) -> Iterator[Pair]:
    from asynchdf5 import HDF5DataLayer

    with HDF5DataLayer(source, **_kwargs(source, chunk_size), **extra) as layer:
        while True:
            for batch in layer:
                yield batch["data"], batch["label"]


async def async_batches(source: str, chunk_size: int, **extra: Any) -> AsyncIterator[Pair]:
    from asynchdf5 import AsyncHDF5DataLayer

    async with AsyncHDF5DataLayer(source, **_kwargs(source, chunk_size), **extra) as layer:
        while True:
            async for batch in layer:
                yield batch["data"], batch["label"]


def torch_batches(source: str, chunk_size: int, **extra: Any) -> Iterator[Pair]:
    from torch.utils.data import DataLoader

    from asynchdf5.torch import HDF5IterableDataset

    kwargs = _kwargs(source, chunk_size) | extra
    del kwargs["tops"]
    with HDF5IterableDataset(source, tops=("data", "label"), **kwargs) as ds:
        loader = DataLoader(ds, batch_size=None, num_workers=0)
        while True:
            for batch in loader:
                yield batch["data"].numpy(), batch["label"].numpy()


def dataloader_batches(source: str, chunk_size: int) -> Iterator[Pair]:
    import torch
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    from benchmarks.torch_loaders import BatchDataset

    files = data.DatasetFiles.from_json(json.loads(os.environ["STEP_COST_FILES"]))
    dataset: Any = BatchDataset(files)
    generator = torch.Generator().manual_seed(0)
    sampler = BatchSampler(RandomSampler(dataset, generator=generator), BATCH, False)
    loader = DataLoader(
        dataset, sampler=sampler, batch_size=None, num_workers=2, persistent_workers=True
    )
    while True:
        for d, label in loader:
            yield d.numpy(), label.numpy()


def lightning_batches(source: str, chunk_size: int) -> Iterator[Pair]:
    """What a ``lightning.Trainer`` iterates (docs/lightning.md): the dataset in
    :class:`asynchdf5.torch.StatefulDataLoader`, inside Lightning's ``CombinedLoader``."""
    from lightning.pytorch.utilities import CombinedLoader

    from asynchdf5.torch import HDF5IterableDataset, StatefulDataLoader

    kwargs = _kwargs(source, chunk_size)
    del kwargs["tops"]
    with HDF5IterableDataset(source, tops=("data", "label"), **kwargs) as ds:
        loader = CombinedLoader(StatefulDataLoader(ds, batch_size=None), "max_size_cycle")
        while True:
            for batch, _, _ in loader:
                yield batch["data"].numpy(), batch["label"].numpy()


def lightning_free_batches(source: str, chunk_size: int) -> Iterator[Pair]:
    """:func:`lightning_batches` with the free batch (as tensors) in place of the dataset, in a
    plain ``IterableDataset`` with as many batches an epoch: what Lightning's and torch's own
    machinery costs the step, whatever the loader."""
    import torch
    from lightning.pytorch.utilities import CombinedLoader
    from torch.utils.data import IterableDataset

    from asynchdf5.torch import StatefulDataLoader

    d, label = (torch.from_numpy(a) for a in free_pair())
    n = _epoch_batches(source, chunk_size)

    class Free(IterableDataset[dict[str, torch.Tensor]]):
        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            for _ in range(n):
                yield {"data": d, "label": label}

    loader = CombinedLoader(StatefulDataLoader(Free(), batch_size=None), "max_size_cycle")
    while True:
        for batch, _, _ in loader:
            yield batch["data"].numpy(), batch["label"].numpy()


def keras_batches(source: str, chunk_size: int) -> Iterator[Pair]:
    """What ``model.fit`` iterates on Keras's JAX backend, on the CPU (docs/keras.md): the
    :class:`asynchdf5.keras.PyDataset` through Keras's own adapter and JAX iterator, with the
    :class:`~asynchdf5.keras.Position` callback told of each batch, as ``fit`` tells it."""
    import numpy as np
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    from asynchdf5 import HDF5DataLayer
    from asynchdf5.keras import PyDataset

    with HDF5DataLayer(source, **_kwargs(source, chunk_size)) as layer:
        data = PyDataset(layer, x="data", y="label")
        adapter = PyDatasetAdapter(data)
        position = data.position
        position.set_params({"epochs": 1 << 30})
        position.on_train_begin()
        epoch = 0
        while True:
            adapter.on_epoch_begin()
            position.on_epoch_begin(epoch)
            for k, (x, y) in enumerate(adapter.get_jax_iterator()):
                yield np.asarray(x), np.asarray(y)
                position.on_train_batch_end(k)
            adapter.on_epoch_end()  # Keras's epoch iterator ends, then the callbacks hear
            position.on_epoch_end(epoch)
            epoch += 1


def keras_free_batches(source: str, chunk_size: int) -> Iterator[Pair]:
    """:func:`keras_batches` with the free batch from a plain ``keras.utils.PyDataset`` of as
    many batches an epoch (no callback): what Keras's own adapter costs the step."""
    import keras
    import numpy as np
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    pair = free_pair()
    n = _epoch_batches(source, chunk_size)

    class Free(keras.utils.PyDataset):  # type: ignore[misc]
        def __len__(self) -> int:
            return n

        def __getitem__(self, index: int) -> Pair:
            return pair

    adapter = PyDatasetAdapter(Free(workers=1, use_multiprocessing=False))
    while True:
        adapter.on_epoch_begin()
        for x, y in adapter.get_jax_iterator():
            yield np.asarray(x), np.asarray(y)
        adapter.on_epoch_end()


def jax_batches(source: str, chunk_size: int) -> Iterator[Pair]:
    """:class:`asynchdf5.jax.Loader` over :func:`asynchdf5.jax.layer` (docs/jax.md): global
    ``jax.Array``s on the CPU device, put ahead of the step; the step reads them as NumPy."""
    import numpy as np

    import asynchdf5.jax as aj

    with aj.layer(source, **_kwargs(source, chunk_size)) as layer:
        loader = aj.Loader(layer)
        while True:
            for batch in loader:
                yield np.asarray(batch["data"]), np.asarray(batch["label"])


def jax_free_batches(source: str, chunk_size: int) -> Iterator[Pair]:
    """The free batch put on the CPU device each step (``jax.device_put`` with the loader's
    default sharding; the label as int32, as the loader narrows it with x64 off): what any
    JAX input costs the step, whatever the loader."""
    import jax
    import numpy as np

    import asynchdf5.jax as aj

    d, label = free_pair()
    host = {"data": d, "label": label.astype(np.int32)}
    sharding = aj.batch_sharding()
    while True:
        batch = jax.device_put(host, sharding)
        yield np.asarray(batch["data"]), np.asarray(batch["label"])


def shm_batches(source: str, chunk_size: int) -> Iterator[Pair]:
    from benchmarks.shm_ring import ShmRing

    with ShmRing(source, _kwargs(source, chunk_size), BATCH, IMAGE_SHAPE) as ring:
        yield from ring


SYNC: dict[str, Callable[[str, int], Iterator[Pair]]] = {
    "free": free_batches,
    "layer": layer_batches,
    "torch": torch_batches,
    "dataloader": dataloader_batches,
    "shm": shm_batches,
    "process": lambda source, chunk: layer_batches(source, chunk, process=True),
    "torch_process": lambda source, chunk: torch_batches(source, chunk, process=True),
    "lightning": lightning_batches,
    "lightning_free": lightning_free_batches,
    "keras": keras_batches,
    "keras_free": keras_free_batches,
    "jax": jax_batches,
    "jax_free": jax_free_batches,
}
