"""The demo's sample data set: uint8 3x32x32 images and int64 labels whose values are functions
of each sample's global index, so that exactly-once and alignment are checkable from a batch."""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import numpy.typing as npt

__all__ = [
    "IMAGE_SHAPE",
    "MARKER_MODULUS",
    "N_CLASSES",
    "SAMPLE_BYTES",
    "label_of",
    "marker_of",
    "write_dataset",
]

IMAGE_SHAPE = (3, 32, 32)
N_CLASSES = 10
# The first pixel of sample i holds i % MARKER_MODULUS: a prime below 256, so the marker and the
# label (i % 10 pattern) vary independently and a batch whose data rows belong to other samples
# than its label rows is caught.
MARKER_MODULUS = 251
SAMPLE_BYTES = math.prod(IMAGE_SHAPE) * np.dtype(np.uint8).itemsize + np.dtype(np.int64).itemsize
WRITE_BLOCK = 16_384  # rows generated and written at a time, to bound the writer's memory


def label_of(index: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The label the demo data set stores for each global sample index."""
    return (index * 7 + 3) % N_CLASSES


def marker_of(index: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The value of pixel ``[0, 0, 0]`` of each sample (before scaling)."""
    return index % MARKER_MODULUS


# --- writing the data set ----------------------------------------------------------------------


def write_dataset(folder: Path, samples: int, files: int, seed: int) -> Path:
    """Write ``samples`` samples split over ``files`` HDF5 files and a source list naming them.

    Parameters
    ----------
    folder
        Where to write; created if missing.
    samples
        Number of samples in all.
    files
        Number of HDF5 files; the samples are split as evenly as possible, in order.
    seed
        Seed of the random pixels.

    Returns
    -------
    Path
        The source list file, ``folder / "train.txt"``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sizes = [samples // files + (k < samples % files) for k in range(files)]
    names: list[str] = []
    start = 0
    for k, size in enumerate(sizes):
        name = f"train-{k:03d}.h5"
        names.append(name)
        with h5py.File(folder / name, "w") as f:
            # Contiguous and uncompressed, the layout the reader can read without h5py's lock.
            data = f.create_dataset("data", shape=(size, *IMAGE_SHAPE), dtype=np.uint8)
            label = f.create_dataset("label", shape=(size,), dtype=np.int64)
            for lo in range(0, size, WRITE_BLOCK):
                hi = min(lo + WRITE_BLOCK, size)
                index = np.arange(start + lo, start + hi, dtype=np.int64)
                images = rng.integers(0, 256, size=(hi - lo, *IMAGE_SHAPE), dtype=np.uint8)
                images[:, 0, 0, 0] = marker_of(index)
                data[lo:hi] = images
                label[lo:hi] = label_of(index)
        start += size
    source = folder / "train.txt"
    lines = [f"# asynchdf5 demo data set: {samples} samples in {files} files", *names]
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return source
