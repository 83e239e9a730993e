"""Keras 3: ``model.fit`` on :class:`asynchdf5.keras.PyDataset`, with the JAX and the PyTorch
backends, each in a fresh interpreter (``KERAS_BACKEND`` must be set before Keras is imported):
two epochs of data in two Keras epochs, the loader's state exact after every trained batch (not
the batches Keras read ahead), and a crash after a checkpoint resumed to the same weights (see
``tests/_keras_train.py``). Skipped where Keras or the backend is not installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ._files import write_source
from ._helpers import run_python

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    # Not imported here: Keras picks its backend once, at import (TensorFlow by default).
    pytest.mark.skipif(importlib.util.find_spec("keras") is None, reason="needs Keras 3"),
]


@pytest.mark.parametrize(
    ("backend", "saved"),
    [("jax", 4), ("torch", 13)],  # saved in epoch 0 (two fits to resume), in epoch 1 (one)
)
def test_fit_trains_epochs_and_resumes_exactly(tmp_path: Path, backend: str, saved: int) -> None:
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"the {backend} backend is not installed")
    source, _ = write_source(tmp_path / "data", (40, 13, 27))  # 10 batches of 8 per epoch
    out = run_python(
        ["-m", "tests._keras_train", source, tmp_path, saved],
        110,
        KERAS_BACKEND=backend,
        JAX_PLATFORMS="cpu",
    )
    assert out.split()[-2:] == ["ok", backend]


def test_refuses_what_it_cannot_serve(tmp_path: Path) -> None:
    """Names that are no tops, a sample weight without targets: errors before any batch; a
    state asked for during an epoch without the Position callback: an error, not a guess."""
    code = """
import numpy as np
from asynchdf5 import ConfigurationError, MemoryDataLayer, StateError
from asynchdf5.keras import PyDataset
data = {"x": np.zeros((20, 2), np.float32), "y": np.arange(20)}
with MemoryDataLayer(data, batch_size=8) as layer:
    for kw in ({"x": "z"}, {"x": "x", "y": ("y", "w")}, {"x": "x", "sample_weight": "y"}):
        try:
            PyDataset(layer, **kw)
        except ConfigurationError:
            pass
        else:
            raise AssertionError(kw)
    ds = PyDataset(layer, x={"in": "x"}, y="y", sample_weight="y")
    assert len(ds) == 3 and ds.num_batches == 3
    ds.position.on_epoch_begin(0)  # as Keras calls them, without the model
    ds.on_epoch_begin()
    x, y, w = ds[0]
    assert set(x) == {"in"} and x["in"].shape == (8, 2) and (y == w).all()
    try:
        ds.state_dict()
    except StateError:
        pass
    else:
        raise AssertionError("state_dict without Position")
    for i in (1, 2):
        ds[i]
    ds.on_epoch_end()
    ds.position.on_epoch_end(0)
    assert layer.epoch == 1 and ds.state_dict()["epoch"] == 1
print("ok")
"""
    backend = "jax" if importlib.util.find_spec("jax") else "torch"
    assert run_python(["-c", code], 100, KERAS_BACKEND=backend).strip() == "ok"


def test_a_training_epoch_keeps_no_batch_keras_let_go_of(tmp_path: Path) -> None:
    """Only a look's first batches (a pass outside a training epoch) are kept, to serve again;
    a training epoch's are never served again, so the dataset lets go of them: a batch kept
    for the epoch would hold one of the layer's batch buffers all epoch (the layer then
    allocates fresh ones in its place more often)."""
    code = """
import gc, weakref
import numpy as np
from asynchdf5 import MemoryDataLayer
from asynchdf5.keras import PyDataset
data = {"x": np.zeros((40, 2), np.float32), "y": np.arange(40)}
with MemoryDataLayer(data, batch_size=8) as layer:
    ds = PyDataset(layer, x="x", y="y")
    ds.on_epoch_begin()  # Keras's look at a batch, before training
    look = weakref.ref(ds[0][0])
    gc.collect()
    assert look() is not None  # kept: served again at the next pass
    ds.on_epoch_end()
    ds.position.on_epoch_begin(0)
    ds.on_epoch_begin()
    first = ds[0][0]
    assert look() is first  # the look's batch, served again
    del first
    served = [weakref.ref(ds[i][0]) for i in range(1, 4)]
    gc.collect()  # (the layer's iterator may hold the last batch it made: not asked of it)
    assert look() is None and all(r() is None for r in served[:-1]), "a trained batch is kept"
print("ok")
"""
    backend = "jax" if importlib.util.find_spec("jax") else "torch"
    assert run_python(["-c", code], 100, KERAS_BACKEND=backend).strip() == "ok"


def test_ragged_and_sparse_tops_are_refused_by_name_until_made_dense(tmp_path: Path) -> None:
    """A ragged top (an ``asynchdf5.Ragged`` batch) or a sparse one (a scipy CSR batch) given
    to Keras: a ConfigurationError naming the top and the transformer that makes it dense, not
    an object Keras fails on later; after ``Pad`` / ``Densify``, dense batches of the rows."""
    code = """
import sys
import h5py, numpy as np
from asynchdf5 import ConfigurationError, HDF5DataLayer, transforms as T
from asynchdf5.keras import PyDataset
path = sys.argv[1]
lens = np.arange(12) % 4
with h5py.File(path, "w") as f:
    g = f.create_group("tok")
    g["data"] = np.repeat(np.arange(12), lens)
    g["indptr"] = np.concatenate([[0], np.cumsum(lens)])
    x = f.create_group("X")
    x["data"], x["indices"] = np.ones(12, np.float32), np.arange(12) % 5
    x["indptr"] = np.arange(13)
    x.attrs["shape"], x.attrs["encoding-type"] = (12, 5), "csr_matrix"
    f["y"] = np.arange(12)
for top, fix in (("tok", "transforms.Pad"), ("X", "transforms.Densify")):
    with HDF5DataLayer(path, tops=(top, "y"), batch_size=4) as layer:
        ds = PyDataset(layer, x=top, y="y")
        ds.on_epoch_begin()
        try:
            ds[0]
        except ConfigurationError as e:
            assert repr(top) in str(e) and fix in str(e), e
        else:
            raise AssertionError(top)
transformers = [("tok", T.Pad(-1, length=3)), ("X", T.Densify())]
with HDF5DataLayer(path, tops=("tok", "X", "y"), batch_size=4, transformers=transformers) as layer:
    ds = PyDataset(layer, x=("tok", "X"), y="y")
    ds.on_epoch_begin()
    (tok, X), y = ds[0]
    assert tok.shape == (4, 3) and X.shape == (4, 5), (tok.shape, X.shape)
    assert ((tok == y[:, None]) | (tok == -1)).all() and (X.sum(axis=1) == 1).all()
print("ok")
"""
    backend = "jax" if importlib.util.find_spec("jax") else "torch"
    out = run_python(["-c", code, tmp_path / "r.h5"], 100, KERAS_BACKEND=backend)
    assert out.strip() == "ok"
