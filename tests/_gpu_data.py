"""Data and helpers shared by the GPU stage's tests (``test_delivery_cuda``, on the CuPy
stand-in, and ``test_gpu``, on the real CuPy)."""

from __future__ import annotations

from typing import Any

import numpy as np

from asynchdf5 import Batch
from asynchdf5 import transforms as T
from asynchdf5._delivery._cuda import CudaDelivery

from ._helpers import epochs as _epochs

RNG = np.random.default_rng(0)
IMAGES = RNG.integers(0, 256, size=(203, 4, 5, 3), dtype=np.uint8)  # NHWC
LABELS = np.arange(203, dtype=np.int64)
MEAN = np.array([10.0, 20.0, 30.0])
STD = np.array([2.0, 4.0, 8.0])
TRANSFORMERS: list[tuple[str, Any]] = [
    ("data", T.Scale(1 / 255)),
    ("data", T.SubMean(mean=MEAN / 255)),
    ("data", T.Normalize(mean=0.0, std=STD / 255)),
    ("data", T.Transpose((2, 0, 1))),
]


def host_copy(x: Any) -> np.ndarray:
    """A NumPy copy of a batch array from either CuPy or the stand-in."""
    get = getattr(x, "get", None)
    return np.array(get() if get is not None else x)


async def run_epochs(layer: Any, epochs: int = 1, keep: bool = True) -> list[list[Batch]]:
    """``_helpers.epochs``, under a deadline long enough for a first CUDA kernel's compile."""
    return await _epochs(layer, epochs, keep, deadline=120)


def check_epoch(batches: list[Batch], n: int, data: np.ndarray | None = None) -> None:
    """Every sample once; data and label rows belong to the same sample."""
    indices = np.concatenate([b.indices for b in batches])
    assert sorted(indices.tolist()) == list(range(n))
    for b in batches:
        assert isinstance(b.indices, np.ndarray)  # stays on the host
        np.testing.assert_array_equal(host_copy(b["label"]), LABELS[b.indices])
        if data is not None:
            np.testing.assert_array_equal(host_copy(b["data"]), data[b.indices])


def stage_of(layer: Any) -> CudaDelivery:
    stage = layer._delivery
    assert isinstance(stage, CudaDelivery)
    return stage
