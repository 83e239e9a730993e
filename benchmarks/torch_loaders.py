"""PyTorch ``DataLoader`` over an h5py-backed ``Dataset``: what most training code does today.

Two patterns, each with ``params["workers"]`` worker processes:

- per sample: ``__getitem__(i)`` reads one row of each top, the default collate stacks 256 of them;
- per batch: a ``BatchSampler`` hands ``__getitem__`` a whole batch of indices, read with one sorted
  fancy-index read per top.

Files are opened lazily in the process that reads (the usual way to make h5py work with forked
workers). Both are bounded measurements: a few batches after warm-up, extrapolated to the epoch.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from benchmarks.data import DatasetFiles
from benchmarks.measure import EpochClock, Job, Outcome, Skip
from benchmarks.sources import H5Rows


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise Skip("torch is not importable") from exc
    return torch


class _LazyRows:
    """Opens the data set's files on first use, in whichever process uses them."""

    def __init__(self, files: DatasetFiles) -> None:
        self.files = files
        self._rows: tuple[H5Rows, H5Rows] | None = None

    @property
    def rows(self) -> tuple[H5Rows, H5Rows]:
        if self._rows is None:
            self._rows = (H5Rows(self.files, "data"), H5Rows(self.files, "label"))
        return self._rows

    def __len__(self) -> int:
        return self.files.spec.samples


class SampleDataset(_LazyRows):
    """``dataset[i] -> (data row, label)``, one h5py read per top per sample."""

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        data, label = self.rows
        return data.row(i), label.row(i)


class BatchDataset(_LazyRows):
    """``dataset[indices] -> (data rows, labels)``, one sorted fancy-index read per top."""

    def __getitem__(self, indices: list[int]) -> tuple[Any, Any]:
        torch = _torch()
        idx = np.sort(np.asarray(indices, dtype=np.int64))
        data, label = self.rows
        return torch.from_numpy(data.fancy(idx)), torch.from_numpy(label.fancy(idx))


def dataloader(job: Job) -> Outcome:
    """One (bounded) shuffled epoch of a ``DataLoader``; params: ``workers``, ``pattern``."""
    torch = _torch()
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    workers = int(job.params["workers"])
    generator = torch.Generator().manual_seed(job.seed)
    clock = EpochClock(
        job.files.spec.samples, job.budget_s, warmup=2 + 2 * workers, min_timed=max(1, workers)
    )
    clock.start()
    # The datasets are duck-typed (torch's map-style protocol), not torch.utils.data.Dataset
    # subclasses, so that this module imports without torch.
    loader: Any
    if job.params["pattern"] == "sample":
        loader = DataLoader(
            cast(Any, SampleDataset(job.files)),
            batch_size=job.batch_size,
            shuffle=True,
            generator=generator,
            num_workers=workers,
        )
    else:
        dataset: Any = BatchDataset(job.files)
        sampler = BatchSampler(RandomSampler(dataset, generator=generator), job.batch_size, False)
        loader = DataLoader(dataset, sampler=sampler, batch_size=None, num_workers=workers)
    for data, _label in loader:
        if not clock.batch(len(data)):
            break
    del loader  # shuts the workers down before the outcome is taken
    return clock.outcome(torch=torch.__version__, torch_threads=torch.get_num_threads())
