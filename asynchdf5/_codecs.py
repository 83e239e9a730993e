"""HDF5 filter pipelines decoded outside h5py, so raw chunks decompress in parallel threads.

h5py decompresses inside its process-wide lock, on one core, one chunk after the other. Reading
the raw chunk bytes with ``os.pread`` and running the filter pipeline here, with codecs that
release the GIL, lets a pool of threads decompress at once while other h5py users go on. The
result is bit-identical to h5py's (the tests check it for every supported pipeline).

Supported filters: deflate/gzip (libdeflate through ``deflate`` when installed, else ISA-L
through ``isal``, else the standard library's ``zlib``; all release the GIL), shuffle, fletcher32
(the checksum is stripped, not verified), LZF (through ``python-lzf`` when installed), and Blosc
and Zstandard through ``numcodecs`` when installed. A dataset using any other filter is read by
h5py (the layer's ``stats.read_paths`` says which path each top takes).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["FILTER_NAMES", "ChunkDecoder", "deflate_backend", "unsupported_filters"]

DEFLATE, SHUFFLE, FLETCHER32, LZF, BLOSC, ZSTD = 1, 2, 3, 32000, 32001, 32015
FILTER_NAMES = {
    DEFLATE: "gzip",
    SHUFFLE: "shuffle",
    FLETCHER32: "fletcher32",
    4: "szip",
    5: "nbit",
    6: "scaleoffset",
    LZF: "lzf",
    BLOSC: "blosc",
    32004: "lz4",
    32008: "bitshuffle",
    ZSTD: "zstd",
}

Decode = Callable[[bytes, int], "bytes | bytearray"]


def _inflate() -> tuple[str, Decode]:
    try:
        import deflate

        return "libdeflate", lambda raw, n: deflate.zlib_decompress(raw, n)
    except ImportError:
        pass
    try:
        from isal import isal_zlib

        return "isal", lambda raw, n: isal_zlib.decompress(raw, bufsize=n)
    except ImportError:
        pass
    return "zlib", lambda raw, n: zlib.decompress(raw, bufsize=n)


_DEFLATE_BACKEND, _inflate_fn = _inflate()


def deflate_backend() -> str:
    """Which library inflates gzip chunks: ``libdeflate``, ``isal`` or ``zlib``."""
    return _DEFLATE_BACKEND


def _optional_decoder(filter_id: int) -> Decode | None:
    if filter_id == LZF:
        try:
            import lzf
        except ImportError:
            return None
        return lambda raw, n: lzf.decompress(raw, n)
    try:
        import numcodecs
    except ImportError:
        return None
    if filter_id == BLOSC:
        codec: Any = numcodecs.Blosc()
    elif filter_id == ZSTD:
        codec = numcodecs.Zstd()
    else:
        return None
    return lambda raw, n: bytes(codec.decode(raw))


def _decoder(filter_id: int) -> Decode | None:
    if filter_id == DEFLATE:
        return _inflate_fn
    if filter_id == FLETCHER32:
        return lambda raw, n: raw[:-4]
    return _optional_decoder(filter_id)


def unsupported_filters(filters: Sequence[int]) -> list[str]:
    """Names of the filters in ``filters`` that cannot be decoded here."""
    return [
        FILTER_NAMES.get(f, f"filter {f}") for f in filters if f != SHUFFLE and _decoder(f) is None
    ]


class ChunkDecoder:
    """Decodes the raw bytes of one chunk through a dataset's filter pipeline (in reverse)."""

    def __init__(self, filters: Sequence[int], itemsize: int, chunk_bytes: int) -> None:
        self.filters = tuple(filters)
        self.itemsize = itemsize
        self.chunk_bytes = chunk_bytes
        self._steps: list[tuple[int, Decode | None]] = []
        for i in reversed(range(len(self.filters))):
            f = self.filters[i]
            decode = None if f == SHUFFLE else _decoder(f)
            if f != SHUFFLE and decode is None:
                raise ValueError(f"unsupported filter {FILTER_NAMES.get(f, f)}")
            self._steps.append((i, decode))

    def decode(self, raw: bytes, filter_mask: int) -> np.ndarray:
        """The chunk's bytes, as a uint8 array of ``chunk_bytes``."""
        data: bytes | bytearray | np.ndarray = raw
        for i, decode in self._steps:
            if filter_mask & (1 << i):
                continue  # HDF5 skipped this filter for this chunk
            if decode is None:
                data = _unshuffle(np.frombuffer(data, np.uint8), self.itemsize)
            else:
                data = decode(
                    data.tobytes() if isinstance(data, np.ndarray) else bytes(data),
                    self.chunk_bytes,
                )
        out = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        if out.size != self.chunk_bytes:
            raise ValueError(f"decoded chunk has {out.size} bytes, expected {self.chunk_bytes}")
        return out


def _unshuffle(buf: np.ndarray, itemsize: int) -> np.ndarray:
    """Undo HDF5's byte shuffle: byte j of every element was stored together."""
    if itemsize == 1:
        return buf
    n = buf.size // itemsize
    body = buf[: n * itemsize].reshape(itemsize, n).T.reshape(-1)
    if n * itemsize == buf.size:
        return np.ascontiguousarray(body)
    return np.concatenate([body, buf[n * itemsize :]])
