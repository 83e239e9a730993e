"""Why the layer reads a top the way it does, and what would make a slow layout fast: the
words of ``asynchdf5 inspect`` (and of ``bench``'s layout hints)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .._codecs import deflate_backend
from .._layout import ChunkIndex, Layout
from ._util import mib, plural

if TYPE_CHECKING:
    from ._inspect import TopReport

__all__ = ["LARGE_CHUNK_BYTES", "PATH_WORDS", "SEEK_BYTES", "explain"]

#: A chunk smaller than this is a seek per read: the disk's time goes to finding bytes, not
#: moving them (about 64 KiB moves in the time of one seek on a fast SSD; far less on a disk).
SEEK_BYTES = 64 * 2**10
#: Compressed chunks larger than this decode much more than a shuffled block read needs.
LARGE_CHUNK_BYTES = 16 * 2**20
PATH_WORDS = {
    "pread": "direct read",
    "chunks": "raw-chunk parallel decode",
    "h5py": "h5py fallback",
}
_PACK = "repack with `asynchdf5 pack` (whole samples per chunk, about 1-4 MiB per chunk)"
_CODECS = 'pip install ".[codecs]" in the asynchdf5 checkout'


def _h5py_hints(t: TopReport, note: str) -> list[str]:
    """What to do about a top that only h5py can read (``note``: the layout's reason)."""
    lock = "h5py reads it holding its process-wide lock, decoding on one thread"
    if "no GIL-free decoder" in note:
        missing = note.split("for", 1)[-1].strip()
        if "lz4" in missing:
            fix = (
                "repack with `asynchdf5 pack --compression lz4` (Blosc-LZ4, which the layer "
                "decodes in parallel) or `--compression zstd`"
            )
        elif any(m in missing for m in ("blosc", "zstd", "lzf")):
            fix = f"install the decoders ({_CODECS}), or repack with `asynchdf5 pack`"
        else:
            fix = "repack with `asynchdf5 pack --compression gzip` (or zstd, lz4)"
        return [f"no decoder outside h5py for {missing}: {lock}; {fix}"]
    if "conversion" in note:
        return [
            f"the stored type is not the standard {t.dtype} (another precision, padding or "
            f"bit layout): h5py converts every read, holding its lock; {_PACK}"
        ]
    if "virtual" in note:
        return [
            "a virtual dataset: h5py assembles it from its sources, holding its lock; name the "
            "source files in the source list instead, or repack with `asynchdf5 pack`"
        ]
    if "compact" in note:
        size = t.stored_bytes or 0
        return [] if size < SEEK_BYTES else [f"a compact dataset read by h5py; {_PACK}"]
    if "fill values" in note:
        return [
            "some or all of its rows were never written: they read as the fill value, "
            "through h5py; check how the file was made"
        ]
    return [f"{lock}; {_PACK}"]


def _adjacent(index: ChunkIndex) -> bool:
    """Whether most stored chunks start where another ends (h5py writes them so in order)."""
    offsets, sizes = index.offsets.ravel(), index.sizes.ravel()
    order = np.argsort(offsets)
    ends = (offsets + sizes)[order][:-1]
    return bool(len(order) < 2 or np.mean(offsets[order][1:] == ends) >= 0.9)


def explain(t: TopReport, layout: Layout, unit: str = "sample") -> None:
    """Fill in ``t.reason`` (why this read path) and ``t.hints`` (what would make it faster).

    ``unit``: what one row of the described dataset is, in the words shown: a sample, a
    ``"value"`` of a ragged or sparse top (its ``data``, whose rows are not the samples), or an
    ``"element"`` of a Windows top's stream."""
    # A ragged top's chunks hold values: pack sizes them in bytes, not in whole samples.
    pack = _PACK if unit == "sample" else "repack with `asynchdf5 pack` (about 1-4 MiB per chunk)"
    swap = "; stored in the other byte order: swapped in place after each read" * layout.swap
    if layout.path == "pread":
        where = "in external raw files" if layout.storage.startswith("external") else ""
        t.reason = (
            f"stored contiguously{' ' + where if where else ''}: read with preadv straight into "
            f"the cache, outside h5py's lock{swap}"
        )
        return
    if layout.path == "chunks":
        assert layout.chunks is not None
        index = layout.chunks
        rows, size = index.rows, t.chunk_bytes or 0
        decode = f"decoded ({', '.join(t.filters)})" if t.filters else "copied (no filters)"
        if index.splits_samples:
            t.reason = (
                f"chunks of {t.chunk_shape} split each {unit} of shape {t.sample_shape}: read a "
                f"band at a time ({plural(index.band, 'chunk')} of {mib(size)}, "
                f"{plural(rows, unit)}), raw chunks {decode} by a pool of threads, outside "
                f"h5py's lock{swap}"
            )
        elif not t.filters:
            t.reason = (
                f"whole {unit}s per chunk ({plural(rows, unit)}, {mib(size)}): the rows read "
                "with preadv straight into the cache, chunks adjacent in the file as one read, "
                f"outside h5py's lock{swap}"
            )
        else:
            t.reason = (
                f"whole {unit}s per chunk ({plural(rows, unit)}, {mib(size)}): raw chunks "
                f"read and {decode} by a pool of threads, outside h5py's lock{swap}"
            )
        if index.splits_samples and size < SEEK_BYTES:
            # A band is decoded chunk by chunk: small chunks cost a call (and, where a band's
            # chunks are not one after the other in the file, a seek) per few KiB.
            t.hints.append(
                f"chunk shape {t.chunk_shape} splits each {unit} of shape {t.sample_shape} into "
                f"{plural(index.band, 'chunk')} of {mib(size)}: a decode call per few KiB; {pack}"
            )
        elif size < SEEK_BYTES and rows < (t.rows or 0):  # one chunk for all rows: one read
            cost = (
                "chunks adjacent in the file are read as one request, but each is planned and "
                "copied (or decoded) on its own"
                if _adjacent(index)
                else "every read is a seek"
            )
            # Mapped (unfiltered chunks of whole samples), rows are taken where they lie: no
            # read per chunk, so this cost is the copying reader's only.
            hint = f"chunk shape {t.chunk_shape} is {plural(rows, unit)} ({mib(size)}) per "
            hint += f"chunk: {cost}; {pack}"
            t.hints.append(hint)
            t.copying_hints.add(hint)
        elif t.filters and size > LARGE_CHUNK_BYTES:
            t.hints.append(
                f"compressed chunks of {mib(size)}: a shuffled read of a block decodes whole "
                f"chunks, far more than the block; {pack}"
            )
        if "gzip" in t.filters and deflate_backend() == "zlib":
            t.hints.append(
                "gzip chunks are inflated by the standard library's zlib; libdeflate or ISA-L "
                f"are about twice as fast ({_CODECS})"
            )
        return
    t.reason = layout.note or "read by h5py"
    t.hints.extend(_h5py_hints(t, layout.note))
