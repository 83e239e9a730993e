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
