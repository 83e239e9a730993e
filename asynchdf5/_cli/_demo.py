"""``asynchdf5 demo``: write a sample data set and stream shuffled epochs from it.

The demo writes a small image data set (uint8 3x32x32 images and int64 labels, split over a few
HDF5 files and named by a source list file), streams shuffled epochs from it through
:class:`~asynchdf5.AsyncHDF5DataLayer` (or :class:`~asynchdf5.HDF5DataLayer` with ``--sync``)
with a simulated training step, and reports throughput. It also checks the two promises every
epoch makes: each sample is seen exactly once, and the rows of ``data`` and ``label`` in a batch
belong to the same samples. Each sample's label and its first pixel are functions of its global
index, so the check needs nothing but the batch.
"""

from __future__ import annotations

import argparse
import os
import pprint
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import anyio
import numpy as np
import numpy.typing as npt

from .. import AsyncHDF5DataLayer, DataLayerError, HDF5DataLayer
from .. import transforms as T
from ._sample import SAMPLE_BYTES, label_of, marker_of, write_dataset
from ._util import Bar, plural, positive, progress_bar, run_async

# --- checking and timing one epoch -------------------------------------------------------------


class BatchLike(Protocol):
    """What the demo reads from a batch: tops by name and the global sample indices."""

    @property
    def indices(self) -> Any: ...

    def __getitem__(self, top: str) -> Any: ...


@dataclass
class EpochReport:
    """What one epoch did and whether it kept its promises."""

    epoch: int
    samples: int
    seconds: float
    first_batch_seconds: float
    exactly_once: bool
    misaligned: int
    problem: str = ""

    @property
    def ok(self) -> bool:
        return self.exactly_once and self.misaligned == 0


@dataclass
class EpochCheck:
    """Collects the indices of an epoch's batches and checks their rows against them."""

    epoch: int
    total: int
    started: float = field(default_factory=time.perf_counter)
    first_batch: float | None = None
    samples: int = 0
    misaligned: int = 0
    seen: list[npt.NDArray[np.int64]] = field(default_factory=list)

    def add(self, batch: BatchLike) -> npt.NDArray[np.float32]:
        """Check one batch; return its ``data`` as NumPy for the simulated training step."""
        if self.first_batch is None:
            self.first_batch = time.perf_counter()
        # Copies: the layer may reuse its batch buffers once the next batch is asked for.
        index = np.array(batch.indices, dtype=np.int64)
        data = np.asarray(batch["data"])
        label = np.asarray(batch["label"])
        if not (len(index) == len(data) == len(label)):
            self.misaligned += max(len(index), len(data), len(label))
        else:
            marker = np.rint(data[:, 0, 0, 0].astype(np.float64) * 255).astype(np.int64)
            wrong = (label != label_of(index)) | (marker != marker_of(index))
            self.misaligned += int(np.count_nonzero(wrong))
        self.seen.append(index)
        self.samples += len(index)
        return data

    def finish(self) -> EpochReport:
        """Check that every sample index was seen exactly once and time the epoch."""
        end = time.perf_counter()
        seen = np.concatenate(self.seen) if self.seen else np.zeros(0, dtype=np.int64)
        problem = ""
        if seen.size and (seen.min() < 0 or seen.max() >= self.total):
            problem = f"indices outside 0..{self.total - 1}"
        else:
            counts = np.bincount(seen, minlength=self.total)
            missing = int(np.count_nonzero(counts == 0))
            repeated = int(np.count_nonzero(counts > 1))
            if missing or repeated:
                problem = f"{missing} samples never seen, {repeated} seen more than once"
        return EpochReport(
            epoch=self.epoch,
            samples=self.samples,
            seconds=end - self.started,
            first_batch_seconds=(self.first_batch or end) - self.started,
            exactly_once=not problem,
            misaligned=self.misaligned,
            problem=problem,
        )


@contextmanager
def progress(epoch: int, epochs: int, total: int) -> Iterator[Bar]:
    """A bar for one epoch, counted in samples (on a terminal, with the ``cli`` extra)."""
    with progress_bar(total, f"epoch {epoch}/{epochs}", "sample", leave=False) as bar:
        yield bar


def train_step(data: npt.NDArray[np.float32]) -> float:
    """A stand-in for the forward and backward pass: a small reduction over the batch."""
    return float(data[:, :, ::4, ::4].mean())


# --- the two ways to stream --------------------------------------------------------------------


@dataclass
class Settings:
    """The demo's layer settings, from the command line."""

    source: Path
    total: int
    epochs: int
    batch_size: int
    shuffle: bool
    chunk_size: int
    seed: int
    backend: Literal["asyncio", "trio"]

    def layer_kwargs(self) -> dict[str, Any]:
        return {
            "source": os.fspath(self.source),
            "batch_size": self.batch_size,
            "tops": ("data", "label"),
            "shuffle": self.shuffle,
            "chunk_size": self.chunk_size,
            "transformers": [("data", T.Scale(1 / 255))],
            "seed": self.seed,
        }


async def stream_async(settings: Settings) -> tuple[list[EpochReport], float, Any]:
    """Stream the epochs with ``async with`` / ``async for``; return reports, open time, stats."""
    layer = AsyncHDF5DataLayer(**settings.layer_kwargs())
    reports: list[EpochReport] = []
    opening = time.perf_counter()
    async with layer:
        opened = time.perf_counter() - opening
        for epoch in range(1, settings.epochs + 1):
            check = EpochCheck(epoch, settings.total)
            with progress(epoch, settings.epochs, settings.total) as bar:
                async for batch in layer:
                    data = check.add(batch)
                    # Yield to the event loop, as awaiting a device or a queue would.
                    await anyio.sleep(0)
                    train_step(data)
                    bar.update(len(data))
            reports.append(check.finish())
            print_epoch(reports[-1], settings)
        stats = layer.stats
    return reports, opened, stats


def stream_sync(settings: Settings) -> tuple[list[EpochReport], float, Any]:
    """Stream the epochs with ``with`` / ``for`` through the sync facade."""
    layer = HDF5DataLayer(**settings.layer_kwargs())
    reports: list[EpochReport] = []
    opening = time.perf_counter()
    with layer:
        opened = time.perf_counter() - opening
        for epoch in range(1, settings.epochs + 1):
            check = EpochCheck(epoch, settings.total)
            with progress(epoch, settings.epochs, settings.total) as bar:
                for batch in layer:
                    data = check.add(batch)
                    train_step(data)
                    bar.update(len(data))
            reports.append(check.finish())
            print_epoch(reports[-1], settings)
        stats = layer.stats
    return reports, opened, stats


# --- reporting ---------------------------------------------------------------------------------


def rate(samples: int, seconds: float) -> str:
    """Samples per second and MB per second (of stored bytes: uint8 image + int64 label)."""
    seconds = max(seconds, 1e-9)
    return f"{samples / seconds:,.0f} samples/s, {samples * SAMPLE_BYTES / seconds / 1e6:,.1f} MB/s"


def print_epoch(report: EpochReport, settings: Settings) -> None:
    verdict = (
        f"OK: all {settings.total:,} samples seen exactly once"
        if report.exactly_once
        else f"FAILED: {report.problem}"
    )
    if report.misaligned:
        verdict += f"; FAILED: {report.misaligned:,} rows whose data/label do not match their index"
    print(
        f"epoch {report.epoch}/{settings.epochs}: {report.samples:,} samples in "
        f"{report.seconds:.2f} s ({rate(report.samples, report.seconds)}), first batch after "
        f"{report.first_batch_seconds * 1e3:.1f} ms; {verdict}",
        flush=True,
    )


def print_summary(reports: Sequence[EpochReport], opened: float, stats: Any) -> None:
    samples = sum(r.samples for r in reports)
    seconds = sum(r.seconds for r in reports)
    ok = all(r.ok for r in reports)
    first = reports[0].first_batch_seconds if reports else 0.0
    print(
        f"summary: {plural(len(reports), 'epoch')}, {samples:,} samples in {seconds:.2f} s "
        f"({rate(samples, seconds)}); opened in {opened * 1e3:.1f} ms, first batch "
        f"{first * 1e3:.1f} ms after; "
        + ("every epoch saw every sample exactly once, aligned" if ok else "CHECKS FAILED")
    )
    if stats is not None:
        print("layer.stats:")
        print(pprint.pformat(stats, sort_dicts=False, width=100))


# --- command line ------------------------------------------------------------------------------


def add_parser(commands: Any) -> None:
    """Register ``demo`` with the command line's subcommands."""
    demo = commands.add_parser(
        "demo",
        help="write a sample data set and stream shuffled epochs from it",
        description=(
            "Write a sample data set (uint8 3x32x32 images and int64 labels in several HDF5 "
            "files, named by a source list file train.txt), stream epochs from it through "
            "AsyncHDF5DataLayer with a simulated training step, report samples/s, MB/s and the "
            "time to the first batch, and check that each epoch saw every sample exactly once "
            "with data and label aligned. Exits 1 if a check fails."
        ),
    )
    demo.add_argument(
        "--samples", type=positive, default=200_000, help="samples in all (default: %(default)s)"
    )
    demo.add_argument(
        "--files",
        type=positive,
        default=4,
        help="HDF5 files to split them over (default: %(default)s)",
    )
    demo.add_argument(
        "--epochs", type=positive, default=3, help="epochs to stream (default: %(default)s)"
    )
    demo.add_argument(
        "--batch-size", type=positive, default=256, help="samples per batch (default: %(default)s)"
    )
    demo.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shuffle each epoch: chunk order and boundaries, samples within chunks (default: on)",
    )
    demo.add_argument(
        "--chunk-size",
        type=positive,
        default=2**15,
        help="samples per cached chunk (default: %(default)s)",
    )
    demo.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the data and of the shuffle (default: %(default)s)",
    )
    demo.add_argument(
        "--dir",
        type=Path,
        default=None,
        metavar="PATH",
        help="write the data set here and keep it (default: a temporary folder, deleted after)",
    )
    demo.add_argument(
        "--sync",
        action="store_true",
        help="use the sync facade HDF5DataLayer with plain `for` instead of `async for`",
    )
    demo.add_argument(
        "--backend",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="anyio backend of `async for`'s event loop (--sync runs on asyncio); trio must be "
        "installed (default: %(default)s)",
    )
    demo.set_defaults(run=run)


def run_demo(args: argparse.Namespace, folder: Path) -> int:
    """Write the data set into ``folder`` and stream it; the exit status."""
    samples = args.samples
    files = min(args.files, samples)
    print(
        f"writing {samples:,} samples ({samples * SAMPLE_BYTES / 1e6:,.0f} MB) "
        f"in {files} HDF5 files to {folder}",
        flush=True,
    )
    start = time.perf_counter()
    source = write_dataset(folder, samples, files, args.seed)
    print(f"written in {time.perf_counter() - start:.1f} s; source list {source}", flush=True)
    settings = Settings(
        source=source,
        total=samples,
        epochs=args.epochs,
        batch_size=args.batch_size,
        shuffle=args.shuffle,
        chunk_size=args.chunk_size,
        seed=args.seed,
        backend=args.backend,
    )
    api = "HDF5DataLayer, for" if args.sync else "AsyncHDF5DataLayer, async for"
    mode = f"{api}, {'asyncio' if args.sync else args.backend} event loop"
    print(
        f"streaming {plural(args.epochs, 'epoch')} ({mode}): batch_size={args.batch_size}, "
        f"shuffle={args.shuffle}, chunk_size={args.chunk_size:,}, seed={args.seed}",
        flush=True,
    )
    try:
        if args.sync:
            reports, opened, stats = stream_sync(settings)
        else:
            reports, opened, stats = run_async(stream_async, settings, backend=args.backend)
    except DataLayerError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print_summary(reports, opened, stats)
    return 0 if all(r.ok for r in reports) else 1


def run(args: argparse.Namespace) -> int:
    """``asynchdf5 demo``: into ``--dir``, or a temporary folder removed afterwards."""
    if args.dir is not None:
        return run_demo(args, args.dir)
    with tempfile.TemporaryDirectory(prefix="asynchdf5-demo-") as tmp:
        return run_demo(args, Path(tmp))
