"""Generate the benchmark data sets with h5py, and reuse them while their parameters hold.

Images are smooth random pictures (bilinear upsampling of a random 4x4 image, posterised to steps
of 8 levels, plus +-1 noise): gzip level 4 shrinks them to about 60 % of their size, close to what
it does to natural 32x32 images, so decompression costs what it would on real data. Tabular rows
are standard normal float32. Every block of samples is drawn from its own seeded generator, so the
same parameters give the same bytes in every layout.

Each file records the parameters it was generated with (attribute ``asynchdf5_bench``) and is
written under a temporary name, then renamed: a file with the right attribute is complete. The
files single benchmarks make for themselves are :mod:`benchmarks.data_special`.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import numpy.typing as npt

from benchmarks.config import DEFAULT_DATA_DIR, DatasetSpec

__all__ = ["DEFAULT_DATA_DIR", "DatasetFiles", "DatasetSpec", "ensure"]

PARAMS_ATTR = "asynchdf5_bench"
TOPS = ("data", "label")
GZIP_LEVEL = 4
COMPRESSOR_ATTR = "asynchdf5_bench_compressor"
# Samples drawn per generator call; a multiple of the HDF5 chunk length, so that the gzip writer
# compresses whole chunks straight from a block.
BLOCK = 8192


@dataclass(frozen=True)
class DatasetFiles:
    """Where a generated data set lives.

    Attributes
    ----------
    spec
        The data set's parameters.
    paths
        The HDF5 files, in source order.
    source
        What to give a loader as ``source``: the list file for a split set, else the one path.
    rows
        Rows (samples) in each file.
    """

    spec: DatasetSpec
    paths: tuple[Path, ...]
    source: Path
    rows: tuple[int, ...]

    def to_json(self) -> dict[str, object]:
        """A JSON-able form, passed to measurement subprocesses."""
        return {
            "spec": self.spec.params() | {"title": self.spec.title},
            "paths": [str(p) for p in self.paths],
            "source": str(self.source),
            "rows": list(self.rows),
        }

    @classmethod
    def from_json(cls, d: dict[str, object]) -> DatasetFiles:
        """Inverse of :meth:`to_json`."""
        spec_d = dict(d["spec"])  # type: ignore[call-overload]
        spec_d.pop("generator_version")
        spec_d["shape"] = tuple(spec_d["shape"])
        return cls(
            spec=DatasetSpec(**spec_d),
            paths=tuple(Path(p) for p in d["paths"]),  # type: ignore[attr-defined]
            source=Path(str(d["source"])),
            rows=tuple(int(r) for r in d["rows"]),  # type: ignore[attr-defined]
        )


def file_rows(spec: DatasetSpec) -> list[int]:
    """Rows per file: the samples split as evenly as possible, in order."""
    edges = np.linspace(0, spec.samples, spec.files + 1).astype(np.int64)
    return [int(b - a) for a, b in itertools.pairwise(edges)]


def locate(spec: DatasetSpec, data_dir: Path) -> DatasetFiles:
    """Paths of a data set's files (which may not exist yet)."""
    folder = data_dir / f"{spec.name}-{spec.samples}"  # quick and full sizes side by side
    if spec.files == 1:
        paths: tuple[Path, ...] = (folder / f"{spec.name}.h5",)
        source = paths[0]
    else:
        paths = tuple(folder / f"{spec.name}-{i}.h5" for i in range(spec.files))
        source = folder / f"{spec.name}.txt"
    return DatasetFiles(spec=spec, paths=paths, source=source, rows=tuple(file_rows(spec)))


def is_current(files: DatasetFiles) -> bool:
    """Whether every file exists and was generated with these parameters."""
    if files.source.suffix == ".txt" and not files.source.exists():
        return False
    for index, path in enumerate(files.paths):
        try:
            with h5py.File(path, "r") as f:
                stored = f.attrs.get(PARAMS_ATTR)
        except OSError:
            return False
        if stored != _params_json(files.spec, index):
            return False
    return True


def ensure(specs: list[DatasetSpec], data_dir: Path, log: bool = True) -> list[DatasetFiles]:
    """Generate the data sets that are missing or stale; return all of them.

    The image sets share one pass over the generated blocks, so their bytes are generated once.
    """
    located = [locate(s, data_dir) for s in specs]
    stale = [f for f in located if not is_current(f)]
    if stale:
        t0 = time.perf_counter()
        for kind in ("image", "tabular"):
            group = [f for f in stale if f.spec.kind == kind]
            if group:
                _generate(group)
        if log:
            names = ", ".join(f.spec.name for f in stale)
            print(
                f"# generated {names} in {time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    return located


def _params_json(spec: DatasetSpec, index: int) -> str:
    return json.dumps(spec.params() | {"file_index": index}, sort_keys=True)


# --------------------------------------------------------------------------------------------
# Sample generators


def _bilinear(n_out: int, n_in: int) -> npt.NDArray[np.float32]:
    w = np.zeros((n_out, n_in), np.float32)
    for i, x in enumerate(np.linspace(0, n_in - 1, n_out)):
        j = min(int(x), n_in - 2)
        w[i, j], w[i, j + 1] = 1 - (x - j), x - j
    return w


_UPSAMPLE = _bilinear(32, 4)


def image_block(
    seed: int, block: int, n: int
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Samples ``block * BLOCK`` onward (``n`` of them) of the image generator."""
    rng = np.random.default_rng([seed, block])
    low = rng.integers(0, 256, (n, 3, 4, 4), dtype=np.uint8).astype(np.float32)
    img = _UPSAMPLE @ (low @ _UPSAMPLE.T)
    img = np.floor(img / 8) * 8 + rng.integers(-1, 2, img.shape, dtype=np.int8)
    labels = rng.integers(0, 10, n, dtype=np.int64)
    return np.clip(img, 0, 255).astype(np.uint8), labels


def tabular_block(
    seed: int, block: int, n: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """Rows ``block * BLOCK`` onward (``n`` of them) of the tabular generator."""
    rng = np.random.default_rng([seed, block, 1])
    return rng.standard_normal((n, 64), dtype=np.float32), rng.integers(0, 1000, n, dtype=np.int64)


def _blocks(
    spec: DatasetSpec,
) -> Iterator[tuple[int, npt.NDArray[np.generic], npt.NDArray[np.int64]]]:
    make = image_block if spec.kind == "image" else tabular_block
    for block, start in enumerate(range(0, spec.samples, BLOCK)):
        data, labels = make(spec.seed, block, min(BLOCK, spec.samples - start))
        yield start, data, labels


# --------------------------------------------------------------------------------------------
# Writers


class _Writer:
    """Writes global rows ``[start, stop)`` of one data set into its files."""

    def __init__(self, files: DatasetFiles, pool: ThreadPoolExecutor) -> None:
        self.files = files
        self.spec = files.spec
        self.pool = pool
        self.starts = np.concatenate([[0], np.cumsum(files.rows)])
        self.handles: list[h5py.File] = []
        files.paths[0].parent.mkdir(parents=True, exist_ok=True)
        for path, rows in zip(files.paths, files.rows, strict=True):
            f = h5py.File(_tmp(path), "w")
            self.handles.append(f)
            if self.spec.layout == "gzip":
                kw = {
                    "chunks": (self.spec.chunk_rows, *self.spec.shape),
                    "compression": "gzip",
                    "compression_opts": GZIP_LEVEL,
                    "shuffle": True,
                }
                f.create_dataset("data", (rows, *self.spec.shape), self.spec.dtype, **kw)
                kw["chunks"] = (self.spec.chunk_rows,)
                f.create_dataset("label", (rows,), "int64", **kw)
            else:
                f.create_dataset("data", (rows, *self.spec.shape), self.spec.dtype)
                f.create_dataset("label", (rows,), "int64")

    def write(
        self, start: int, data: npt.NDArray[np.generic], labels: npt.NDArray[np.int64]
    ) -> None:
        stop = start + len(data)
        for i, f in enumerate(self.handles):
            lo, hi = max(start, int(self.starts[i])), min(stop, int(self.starts[i + 1]))
            if lo >= hi:
                continue
            rows = slice(lo - int(self.starts[i]), hi - int(self.starts[i]))
            block = slice(lo - start, hi - start)
            if self.spec.layout == "gzip":
                self._write_gzip(f["data"], rows, data[block])
            else:
                f["data"][rows] = data[block]
            f["label"][rows] = labels[block]

    def _write_gzip(self, dset: h5py.Dataset, rows: slice, data: npt.NDArray[np.generic]) -> None:
        # h5py compresses chunks one at a time on one core; the compressors release the GIL, so
        # compressing in a pool and storing the raw chunks is several times faster, and the bytes
        # are the same ones h5py's gzip filter writes. With 1-byte elements the shuffle filter is
        # the identity, so the filter mask 0 ("all filters applied") is correct.
        assert data.dtype.itemsize == 1, "direct chunk writes assume 1-byte elements"
        c = self.spec.chunk_rows
        assert rows.start % c == 0, "blocks are aligned with chunks"
        pieces = []
        for off in range(0, len(data), c):
            piece = data[off : off + c]
            if len(piece) < c:  # edge chunks are stored full size
                piece = np.concatenate(
                    [piece, np.zeros((c - len(piece), *piece.shape[1:]), piece.dtype)]
                )
            pieces.append(np.ascontiguousarray(piece).tobytes())
        compressed = self.pool.map(_compress, pieces)
        for off, chunk in zip(range(0, len(data), c), compressed, strict=True):
            dset.id.write_direct_chunk((rows.start + off, 0, 0, 0), chunk, 0)

    def finish(self) -> None:
        for index, (f, path) in enumerate(zip(self.handles, self.files.paths, strict=True)):
            f.attrs[PARAMS_ATTR] = _params_json(self.spec, index)
            if self.spec.layout == "gzip":
                f.attrs[COMPRESSOR_ATTR] = _COMPRESSOR
            f.close()
            synced_into_place(_tmp(path), path)
        if self.files.source.suffix == ".txt":
            self.files.source.write_text(
                "# generated by python -m benchmarks\n"
                + "".join(f"{p.name}\n" for p in self.files.paths)
            )


def _zlib_compressor() -> tuple[str, Callable[[bytes], bytes]]:
    # libdeflate writes the same zlib format as zlib (HDF5's gzip filter reads either), several
    # times faster at the same level: it keeps the one-time generation of the gzip set short.
    # Which one wrote a file is recorded beside the parameters, but does not decide reuse.
    try:
        import deflate
    except ImportError:

        def with_zlib(raw: bytes) -> bytes:
            return zlib.compress(raw, GZIP_LEVEL)

        return f"zlib {zlib.ZLIB_VERSION}, level {GZIP_LEVEL}", with_zlib

    def with_libdeflate(raw: bytes) -> bytes:
        return bytes(deflate.zlib_compress(raw, GZIP_LEVEL))

    return f"libdeflate, level {GZIP_LEVEL}", with_libdeflate


_COMPRESSOR, _compress = _zlib_compressor()


def _tmp(path: Path) -> Path:
    return path.with_suffix(".h5.tmp")


def synced_into_place(tmp: Path, path: Path) -> None:
    """Sync the written file ``tmp`` and rename it to ``path``: dirty pages cannot be dropped
    from the page cache, and the cold-cache measurements evict the files with posix_fadvise."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _generate(group: list[DatasetFiles]) -> None:
    # Every data set of one kind has the same sample stream; generate it once for all of them.
    samples = {f.spec.samples for f in group}
    assert len(samples) == 1, "data sets of one kind share their size"
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        writers = [_Writer(f, pool) for f in group]
        for start, data, labels in _blocks(group[0].spec):
            for w in writers:
                w.write(start, data, labels)
        for w in writers:
            w.finish()
