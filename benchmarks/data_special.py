"""The data files single benchmarks make for themselves, beside the suite's data sets.

A class-sorted image file (``out_of_core``), a file of random bytes (``block_size``), many small
shards (``many_files``) and large images (``torch_workers``). Each is generated once for its
parameters, written under a temporary name and synced (so that cold-cache measurements can evict
it), then reused. Kept apart from :mod:`benchmarks.data`, whose sets every benchmark shares.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import h5py
import numpy as np

from benchmarks.config import IMAGE_SHAPE
from benchmarks.data import synced_into_place
from benchmarks.internals import SHUFFLED_ATTR

__all__ = [
    "OOC_PARAMS_ATTR",
    "class_sorted_images",
    "class_sorted_path",
    "large_images",
    "random_bytes",
    "shard_files",
    "shuffled_images",
]

#: Marks a complete class-sorted file of :func:`class_sorted_images` (its parameters).
OOC_PARAMS_ATTR = "asynchdf5_ooc_bench"


def class_sorted_path(data_dir: Path, n: int) -> Path:
    """Where :func:`class_sorted_images` keeps its file."""
    return data_dir / f"ooc-class-sorted-{n}.h5"


def _written_with(path: Path, params: str) -> bool:
    """Whether ``path`` is a complete file written with ``params`` (the attribute is set last)."""
    try:
        with h5py.File(path, "r") as f:
            return bool(f.attrs.get(OOC_PARAMS_ATTR) == params)
    except OSError:
        return False


def class_sorted_images(data_dir: Path, n: int, seed: int = 0) -> tuple[Path, bool]:
    """The class-sorted image file of ``n`` samples, written unless a complete one exists;
    returns (path, reused). Image bytes are random (no reader here decodes or compresses)."""
    path = class_sorted_path(data_dir, n)
    params = json.dumps({"samples": n, "seed": seed, "version": 1})
    if _written_with(path, params):
        return path, True
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".h5.tmp")
    rng = np.random.default_rng(seed)
    step = 16384
    with h5py.File(tmp, "w") as f:
        data = f.create_dataset("data", (n, *IMAGE_SHAPE), "uint8")  # contiguous
        label = f.create_dataset("label", (n,), "int64")
        for a in range(0, n, step):
            b = min(n, a + step)
            data[a:b] = rng.integers(0, 256, (b - a, *IMAGE_SHAPE), dtype=np.uint8)
            label[a:b] = np.arange(a, b, dtype=np.int64) * 10 // n
        f.attrs[OOC_PARAMS_ATTR] = params
    synced_into_place(tmp, path)
    return path, False


def shuffled_images(data_dir: Path, n: int, seed: int = 0) -> tuple[Path, bool]:
    """The samples of :func:`class_sorted_images` in a random order, with the file attribute
    ``shuffled`` that ``asynchdf5 pack --shuffle`` writes (docs/packing.md), written unless a
    complete one exists; returns (path, reused)."""
    sorted_path, _ = class_sorted_images(data_dir, n, seed)
    path = data_dir / f"ooc-packed-shuffled-{n}.h5"
    params = json.dumps({"samples": n, "seed": seed, "version": 1, "shuffled": True})
    if _written_with(path, params):
        return path, True
    with h5py.File(sorted_path, "r") as f:
        offset = f["data"].id.get_offset()
        labels = f["label"][:]
    rows = np.memmap(sorted_path, np.uint8, "r", offset=offset, shape=(n, *IMAGE_SHAPE))
    order = np.random.default_rng((seed, 1)).permutation(n)
    tmp = path.with_suffix(".h5.tmp")
    step = 16384
    with h5py.File(tmp, "w") as f:
        data = f.create_dataset("data", (n, *IMAGE_SHAPE), "uint8")  # contiguous
        f.create_dataset("label", data=labels[order])
        for a in range(0, n, step):
            take = order[a : a + step]
            by_offset = np.argsort(take)
            block = np.empty((len(take), *IMAGE_SHAPE), np.uint8)
            block[by_offset] = rows[take[by_offset]]
            data[a : a + len(take)] = block
        f.attrs[SHUFFLED_ATTR] = True
        f.attrs[OOC_PARAMS_ATTR] = params
    del rows
    synced_into_place(tmp, path)
    return path, False


def random_bytes(path: Path, size: int, seed: int = 0) -> float:
    """Write ``size`` random bytes to ``path`` (synced); returns the seconds it took."""
    t0 = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    rng = np.random.default_rng(seed)
    piece = 64 * 2**20
    with open(tmp, "wb") as f:
        left = size
        while left > 0:
            n = min(piece, left)
            words = rng.integers(0, 2**63, size=-(-n // 8), dtype=np.uint64)
            f.write(words.view(np.uint8).data[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
    return time.perf_counter() - t0


def shard_files(
    folder: Path, files: int, rows_per_file: int, shape: tuple[int, ...]
) -> tuple[Path, Path]:
    """``files`` small shard files of float32 ``shape`` rows and int64 labels, a list naming
    them, and one file with the same samples (many-files); returns (list, one file)."""

    def write(path: Path, start: int, n: int) -> None:
        idx = np.arange(start, start + n, dtype=np.int64)
        with h5py.File(path, "w") as f:
            f.create_dataset("data", data=(idx[:, None] + np.arange(shape[0])).astype(np.float32))
            f.create_dataset("label", data=idx)

    names = []
    for i in range(files):
        name = f"shard-{i:06d}.h5"
        write(folder / name, i * rows_per_file, rows_per_file)
        names.append(name)
    lst = folder / "train.txt"
    lst.write_text("\n".join(names) + "\n")
    one = folder / "one.h5"
    write(one, 0, files * rows_per_file)
    return lst, one


def large_images(folder: Path, n: int) -> Path:
    """``n`` random 3x64x64 uint8 images and int64 labels in ``folder/images.h5`` (torch-workers),
    written unless a file of ``n`` is there."""
    path = folder / "images.h5"
    if path.exists():
        with h5py.File(path, "r") as f:
            if f["data"].shape[0] == n:
                return path
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        d = f.create_dataset("data", (n, 3, 64, 64), np.uint8)
        for a in range(0, n, 10_000):
            b = min(n, a + 10_000)
            d[a:b] = rng.integers(0, 256, (b - a, 3, 64, 64), dtype=np.uint8)
        f.create_dataset("label", data=np.arange(n, dtype=np.int64) % 1000)
    return path
