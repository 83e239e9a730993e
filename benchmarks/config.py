"""Suite parameters and the description of each benchmark data set."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DEFAULT_DATA_DIR = Path("/tmp/asynchdf5-bench")

Layout = Literal["contiguous", "gzip"]

IMAGE_SHAPE = (3, 32, 32)
TABULAR_SHAPE = (64,)


@dataclass(frozen=True)
class DatasetSpec:
    """One benchmark data set: what is generated, and where.

    Attributes
    ----------
    name
        Short name used on the command line (``--only``) and in the report.
    title
        One-line description for the report.
    kind
        ``"image"`` (uint8 3x32x32 smooth random images) or ``"tabular"`` (float32 rows).
    samples
        Total number of samples (rows) over all files.
    shape, dtype
        Sample shape and dtype of the ``data`` top (``label`` is always int64 scalars).
    layout
        ``"contiguous"`` or ``"gzip"`` (chunked, gzip level 4 + shuffle).
    files
        Number of HDF5 files the samples are split over (in order).
    chunk_rows
        HDF5 chunk length in samples (gzip layout only).
    seed
        Seed of the generator; the same seed gives the same bytes.
    """

    name: str
    title: str
    kind: Literal["image", "tabular"]
    samples: int
    shape: tuple[int, ...]
    dtype: str
    layout: Layout = "contiguous"
    files: int = 1
    chunk_rows: int = 1024
    seed: int = 0

    @property
    def sample_bytes(self) -> int:
        """Bytes of one sample over all tops (data + int64 label), uncompressed."""
        n = 1
        for d in self.shape:
            n *= d
        return n * _itemsize(self.dtype) + 8

    @property
    def total_bytes(self) -> int:
        """Uncompressed bytes of the whole data set (all tops)."""
        return self.samples * self.sample_bytes

    def params(self) -> dict[str, Any]:
        """Everything that determines the files' content (used to decide reuse)."""
        d = dataclasses.asdict(self)
        d.pop("title")
        d["shape"] = list(self.shape)
        d["generator_version"] = 1
        return d


def _itemsize(dtype: str) -> int:
    return {"uint8": 1, "float32": 4, "int64": 8}[dtype]


@dataclass(frozen=True)
class SuiteConfig:
    """Parameters of one run of the suite.

    Attributes
    ----------
    data_dir
        Folder the data sets are generated into.
    image_samples, tabular_rows
        Sizes of the image sets (a)-(c) and the tabular set (d).
    batch_size
        Minibatch size of every loader.
    chunk_size
        Samples per chunk for the hand-written chunk loop and asynchdf5 (Mocha's default 2**20).
        With the default sizes a whole image set fits in one chunk, so a second epoch is served
        from memory; hence also
    stream_chunk_size
        a smaller chunk with which every epoch streams the set through the cache, as it must for
        a set larger than memory (0: leave those runs out).
    budget_s
        Time budget of a bounded (extrapolated) measurement, after warm-up.
    timeout_s
        Wall-clock limit of one measurement subprocess.
    dataloader_workers
        Worker counts measured for the PyTorch DataLoader.
    dataloader_sets, probe_sets
        The data sets the DataLoader and the stall probe are measured on.
    decompress_threads
        Thread counts of the gzip decompression limit.
    small_buffer_read
        Also measure the warm raw read into a 4 MiB (cache-resident) buffer.
    seed
        Seed of every shuffle.
    sets
        The data sets measured.
    in_process
        Run every measurement in this process rather than a fresh one each (quicker; peak RSS
        is then the largest so far, not the measurement's own).
    """

    data_dir: Path = DEFAULT_DATA_DIR
    image_samples: int = 1_000_000
    tabular_rows: int = 4_000_000
    batch_size: int = 256
    chunk_size: int = 2**20
    stream_chunk_size: int = 2**17
    budget_s: float = 5.0
    timeout_s: float = 300.0
    dataloader_workers: tuple[int, ...] = (0, 2)
    dataloader_sets: tuple[str, ...] = ("contiguous", "gzip", "split4", "tabular")
    probe_sets: tuple[str, ...] = ("contiguous", "gzip")
    decompress_threads: tuple[int, ...] = (1, 2)
    small_buffer_read: bool = True
    seed: int = 0
    sets: tuple[str, ...] = ("contiguous", "gzip", "split4", "tabular")
    in_process: bool = False

    def datasets(self) -> list[DatasetSpec]:
        """The four data sets of the suite, with this run's sizes."""
        n, rows = self.image_samples, self.tabular_rows
        image = f"image, {n:,} x uint8 3x32x32 + int64 label"
        return [
            _image_set("contiguous", f"{image}, contiguous, one file", n),
            _image_set(
                "gzip",
                f"{image}, chunked (1024 samples), gzip 4 + shuffle, one file",
                n,
                layout="gzip",
            ),
            _image_set("split4", f"{image}, contiguous, 4 files + source list", n, files=4),
            DatasetSpec(
                name="tabular",
                title=f"tabular, {rows:,} x float32 64 + int64 label, contiguous, one file",
                kind="tabular",
                samples=rows,
                shape=TABULAR_SHAPE,
                dtype="float32",
            ),
        ]


def _image_set(
    name: str, title: str, samples: int, layout: Layout = "contiguous", files: int = 1
) -> DatasetSpec:
    return DatasetSpec(
        name=name,
        title=title,
        kind="image",
        samples=samples,
        shape=IMAGE_SHAPE,
        dtype="uint8",
        layout=layout,
        files=files,
    )


# Toy sizes that exercise every loader in seconds (one set, in one process).
QUICK: dict[str, Any] = {
    "image_samples": 8192,
    "tabular_rows": 8192,
    "chunk_size": 2**12,
    "budget_s": 0.2,
    "timeout_s": 60.0,
    "dataloader_workers": (0,),
    "dataloader_sets": ("contiguous",),
    "probe_sets": ("contiguous",),
    "decompress_threads": (2,),
    "small_buffer_read": False,
    "stream_chunk_size": 2**11,
    "sets": ("contiguous",),
    "in_process": True,
}
