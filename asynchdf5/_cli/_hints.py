"""Why the layer reads a top the way it does, and what would make a slow layout fast: the
words of ``asynchdf5 inspect`` (and of ``bench``'s layout hints)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._codecs import deflate_backend
from .._layout import Layout
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
    if "split the samples" in note:
        return [
            f"chunk shape {t.chunk_shape} splits each sample of shape {t.sample_shape}: {lock}, "
            f"assembling every sample from pieces of chunks; {_PACK}"
        ]
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


def explain(t: TopReport, layout: Layout) -> None:
    """Fill in ``t.reason`` (why this read path) and ``t.hints`` (what would make it faster)."""
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
        rows, size = layout.chunks.rows, t.chunk_bytes or 0
        decode = f"decoded ({', '.join(t.filters)})" if t.filters else "copied (no filters)"
        t.reason = (
            f"whole samples per chunk ({plural(rows, 'sample')}, {mib(size)}): raw chunks read "
            f"and {decode} by a pool of threads, outside h5py's lock{swap}"
        )
        if size < SEEK_BYTES and rows < (t.rows or 0):  # one chunk for all rows: one read
            t.hints.append(
                f"chunk shape {t.chunk_shape} is {plural(rows, 'sample')} ({mib(size)}) per "
                f"chunk: every read is a seek; {_PACK}"
            )
        elif t.filters and size > LARGE_CHUNK_BYTES:
            t.hints.append(
                f"compressed chunks of {mib(size)}: a shuffled read of a block decodes whole "
                f"chunks, far more than the block; {_PACK}"
            )
        if "gzip" in t.filters and deflate_backend() == "zlib":
            t.hints.append(
                "gzip chunks are inflated by the standard library's zlib; libdeflate or ISA-L "
                f"are about twice as fast ({_CODECS})"
            )
        return
    t.reason = layout.note or "read by h5py"
    t.hints.extend(_h5py_hints(t, layout.note))
