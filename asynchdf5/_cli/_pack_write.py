"""Writing the files of ``asynchdf5 pack``: layouts the layer reads fast, committed atomically.

Layouts, chosen for the layer's fast paths (see the "Packing data" page):

* uncompressed tops are **contiguous**: the layer reads any rows of them with one ``preadv``;
* compressed tops are **chunked along the rows only**, whole samples per chunk, about
  :data:`CHUNK_BYTES` per chunk: large enough that a read moves bytes rather than seeks, small
  enough that a shuffled block read does not decode much more than it needs. The layer decodes
  such chunks in a pool of threads, outside h5py's lock (gzip; Zstd and Blosc-LZ4 with the
  ``codecs`` extra). Byte shuffle goes before the codec for multi-byte types;
* tops of fewer than :data:`COMPRESS_MIN_BYTES` bytes per sample (labels) stay contiguous and
  uncompressed even when compression is asked for: they compress little, and read directly they
  cost no chunk reads at all.

A file is written under a hidden temporary name in the output folder, flushed to disk, then
renamed to its final name (``os.replace``, atomic): an interrupted pack leaves complete files
under final names and nothing half-written under one.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import h5py
import numpy as np

from .._codecs import unsupported_filters

__all__ = [
    "CHUNK_BYTES",
    "COMPRESSIONS",
    "COMPRESS_MIN_BYTES",
    "Compression",
    "FileWriter",
    "PackError",
    "TopSpec",
    "commit_text",
    "temporary_prefix",
]

#: Bytes per chunk of a compressed top (whole samples; at least one sample).
CHUNK_BYTES = 2 * 2**20
#: Tops with fewer bytes per sample stay contiguous and uncompressed.
COMPRESS_MIN_BYTES = 64
#: Rows are written in blocks of about this many bytes (a whole number of chunks).
BLOCK_BYTES = 32 * 2**20
COMPRESSIONS = ("none", "gzip", "lz4", "zstd")


class PackError(Exception):
    """A problem with the input or the options: reported in one line, exit status 1."""


@dataclass(frozen=True)
class TopSpec:
    """A top to write: its sample shape and dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def row_bytes(self) -> int:
        return int(self.dtype.itemsize * math.prod(self.shape))


@dataclass(frozen=True)
class Compression:
    """``--compression`` and ``--level``, as h5py dataset options."""

    name: str = "none"
    level: int | None = None

    def __post_init__(self) -> None:
        if self.name in ("lz4", "zstd"):
            try:
                import hdf5plugin  # noqa: F401 - registers the filters with HDF5
            except ImportError as exc:
                raise PackError(
                    f"--compression {self.name} needs hdf5plugin, which is not installed: "
                    'pip install ".[codecs]" in the asynchdf5 checkout'
                ) from exc

    def applies(self, spec: TopSpec) -> bool:
        return self.name != "none" and spec.row_bytes >= COMPRESS_MIN_BYTES

    def options(self, spec: TopSpec) -> dict[str, Any]:
        """The h5py ``create_dataset`` filter options for ``spec`` (empty: uncompressed)."""
        if not self.applies(spec):
            return {}
        shuffle = spec.dtype.itemsize > 1
        if self.name == "gzip":
            level = 4 if self.level is None else self.level
            return {"compression": "gzip", "compression_opts": level, "shuffle": shuffle}
        import hdf5plugin

        if self.name == "lz4":
            # Blosc with its LZ4 codec, not the bare LZ4 filter: Blosc shuffles bytes itself
            # (the layer decodes both outside h5py's lock).
            level = 5 if self.level is None else self.level
            mode = hdf5plugin.Blosc.SHUFFLE if shuffle else hdf5plugin.Blosc.NOSHUFFLE
            return dict(hdf5plugin.Blosc(cname="lz4", clevel=level, shuffle=mode))
        level = 3 if self.level is None else self.level
        return {**dict(hdf5plugin.Zstd(clevel=level)), "shuffle": shuffle}

    def decoders_missing(self) -> list[str]:
        """Codecs the layer cannot decode outside h5py here (it would fall back to h5py)."""
        ids = {"gzip": 1, "lz4": 32001, "zstd": 32015}
        return unsupported_filters([ids[self.name]]) if self.name in ids else []


def chunk_rows(specs: Mapping[str, TopSpec], compression: Compression, rows: int) -> int:
    """Rows per chunk of a file's compressed tops: about :data:`CHUNK_BYTES` of the widest."""
    widest = max((s.row_bytes for s in specs.values() if compression.applies(s)), default=0)
    if widest == 0:
        return 0
    return max(1, min(rows, CHUNK_BYTES // widest))


def temporary_prefix() -> str:
    """How the names of this process's temporary files in the output folder start."""
    return f".pack-{os.getpid()}-"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform or file system allows it
        _fsync(folder)


def commit_file(tmp: Path, final: Path) -> None:
    """Move the written file ``tmp`` to ``final`` atomically: its bytes on disk first, then the
    rename, then the folder's entry on disk (a crash leaves the old name or the whole file)."""
    _fsync(tmp)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def commit_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary name, then rename)."""
    tmp = path.with_name(f"{temporary_prefix()}{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        commit_file(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class FileWriter:
    """One output file: rows appended in blocks, then committed under its final name.

    The file is created under a hidden temporary name in ``folder`` with room for ``rows`` rows
    per top; fewer may be appended (inputs skipped), and the file is then rewritten with only
    those. Leaving the ``with`` block without :meth:`commit` (an error, Ctrl-C) removes it.
    """

    def __init__(
        self,
        folder: Path,
        specs: Mapping[str, TopSpec],
        rows: int,
        compression: Compression,
        attrs: Mapping[str, Any],
    ) -> None:
        self.folder, self.specs, self.rows = folder, dict(specs), rows
        self.compression, self.attrs = compression, dict(attrs)
        self.tmp = folder / f"{temporary_prefix()}{id(self):x}.h5.tmp"
        self.chunk_rows = chunk_rows(self.specs, compression, rows)
        widest = max(s.row_bytes for s in self.specs.values())
        block = max(1, BLOCK_BYTES // max(1, widest))
        if self.chunk_rows:
            block = max(1, block // self.chunk_rows) * self.chunk_rows
        self.block_rows = min(rows, block)
        self.written = 0
        self._fill = 0
        self._buffers = {
            name: np.empty((self.block_rows, *s.shape), s.dtype) for name, s in self.specs.items()
        }
        self._h5: h5py.File | None = self._create(self.tmp, rows)

    @property
    def appended(self) -> int:
        """Rows appended so far."""
        return self.written + self._fill

    def _create(self, path: Path, rows: int) -> h5py.File:
        try:
            h5 = h5py.File(path, "w", rdcc_nbytes=4 * CHUNK_BYTES + 2**20)
        except BaseException:  # Ctrl-C while HDF5 created the file
            path.unlink(missing_ok=True)
            raise
        try:
            for key, value in self.attrs.items():
                h5.attrs[key] = value
            for name, s in self.specs.items():
                options = self.compression.options(s)
                chunks = (min(self.chunk_rows, rows), *s.shape) if options and rows else None
                h5.create_dataset(
                    name, shape=(rows, *s.shape), dtype=s.dtype, chunks=chunks, **options
                )
        except BaseException:
            h5.close()
            path.unlink(missing_ok=True)
            raise
        return h5

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.discard()

    def append(self, block: Mapping[str, np.ndarray]) -> None:
        """Append the rows of ``block`` (one array per top, the same number of rows each)."""
        n = len(next(iter(block.values()))) if block else 0
        done = 0
        while done < n:
            take = min(n - done, self.block_rows - self._fill)
            for name, buf in self._buffers.items():
                buf[self._fill : self._fill + take] = block[name][done : done + take]
            self._fill += take
            done += take
            if self._fill == self.block_rows:
                self._flush()

    def _flush(self) -> None:
        if self._fill == 0:
            return
        assert self._h5 is not None
        if self.written + self._fill > self.rows:
            raise PackError(f"more rows than planned for one file ({self.rows})")
        for name, buf in self._buffers.items():
            self._h5[name][self.written : self.written + self._fill] = buf[: self._fill]
        self.written += self._fill
        self._fill = 0

    def _shrink(self) -> None:
        """Rewrite the temporary file with only the rows written (contiguous datasets cannot
        shrink in place)."""
        assert self._h5 is not None
        old, self._h5 = self._h5, None
        path = self.tmp.with_name(self.tmp.name + "2")
        new = self._create(path, self.written)
        try:
            for name in self.specs:
                src, dst = old[name], new[name]
                for lo in range(0, self.written, self.block_rows):
                    hi = min(lo + self.block_rows, self.written)
                    dst[lo:hi] = src[lo:hi]
        except BaseException:
            new.close()
            path.unlink(missing_ok=True)
            raise
        finally:
            old.close()
        new.close()
        os.replace(path, self.tmp)

    def commit(self, final: Path) -> int:
        """Flush, close and move the file to ``final``; the rows it holds."""
        self._flush()
        if self.written < self.rows:
            self._shrink()
        elif self._h5 is not None:
            self._h5.close()
        self._h5 = None
        commit_file(self.tmp, final)
        return self.written

    def discard(self) -> None:
        """Close and remove the temporary file, if still there (after a commit: nothing)."""
        h5, self._h5 = self._h5, None
        if h5 is not None:
            with contextlib.suppress(Exception):
                h5.close()
        self.tmp.unlink(missing_ok=True)
        self.tmp.with_name(self.tmp.name + "2").unlink(missing_ok=True)
