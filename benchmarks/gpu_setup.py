"""What the GPU benchmark's two measurements share: its configuration, its report row, the data,
the layers and the PyTorch loader they drive.

:mod:`benchmarks.gpu` measures throughput with these, :mod:`benchmarks.gpu_stall` the
training-loop stall; both build the same layers over the same in-memory images, so their figures
compare.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asynchdf5 import MemoryDataLayer
from asynchdf5 import transforms as T

__all__ = [
    "Config",
    "Row",
    "make_data",
    "make_layer",
    "rate_row",
    "torch_batches",
    "torch_loader",
    "torch_or_none",
]


@dataclass
class Row:
    """One line of the report."""

    name: str
    samples_per_s: float = math.nan
    gb_per_s: float = math.nan
    steps: int = 0
    waited_fraction: float = math.nan
    mean_idle_ms: float = math.nan
    step_ms: float = math.nan
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    samples: int
    shape: tuple[int, ...]
    batch_size: int
    shuffle: bool
    prefetch: int
    seconds: float
    steps: int
    step_factor: float
    workers: int
    scale: bool

    @property
    def sample_bytes(self) -> int:
        return int(np.prod(self.shape)) + 8  # uint8 data + int64 label


def make_data(cfg: Config) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(cfg.samples, *cfg.shape), dtype=np.uint8)
    return {"data": data, "label": np.arange(cfg.samples, dtype=np.int64)}


def make_layer(cfg: Config, arrays: dict[str, np.ndarray], device: str | None) -> MemoryDataLayer:
    transformers = [("data", T.Scale(1 / 255))] if cfg.scale else []
    return MemoryDataLayer(
        arrays,
        batch_size=cfg.batch_size,
        shuffle=cfg.shuffle,
        seed=0,
        prefetch=cfg.prefetch,
        transformers=transformers,
        device=device,
    )


def rate_row(cfg: Config, name: str, batches: int, seconds: float, note: str = "") -> Row:
    sps = batches * cfg.batch_size / seconds
    return Row(name, sps, sps * cfg.sample_bytes / 1e9, note=note)


def torch_loader(cfg: Config, arrays: dict[str, np.ndarray]) -> Any:
    import torch
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

    dataset: Any = torch.utils.data.Dataset  # generic in torch's stubs, Any without them

    class Batches(dataset):  # type: ignore[misc]
        """``dataset[list of indices]``: one fancy-index gather per top (the fast pattern)."""

        def __len__(self) -> int:
            return cfg.samples

        def __getitem__(self, idx: list[int]) -> tuple[Any, Any]:
            rows = np.asarray(idx)
            return (
                torch.from_numpy(np.take(arrays["data"], rows, axis=0)),
                torch.from_numpy(np.take(arrays["label"], rows, axis=0)),
            )

    order = (
        RandomSampler(range(cfg.samples)) if cfg.shuffle else SequentialSampler(range(cfg.samples))
    )
    return DataLoader(
        Batches(),
        batch_size=None,
        sampler=BatchSampler(order, cfg.batch_size, drop_last=False),
        num_workers=cfg.workers,
        pin_memory=True,
        persistent_workers=cfg.workers > 0,
        prefetch_factor=max(2, cfg.prefetch // max(1, cfg.workers)) if cfg.workers else None,
    )


def torch_batches(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def torch_or_none() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None
