"""HDF5 filter pipelines decoded outside h5py, so raw chunks decompress in parallel threads.

h5py decompresses inside its process-wide lock, on one core, one chunk after the other. Reading
the raw chunk bytes with ``os.pread`` and running the filter pipeline here, with codecs that
release the GIL, lets a pool of threads decompress at once while other h5py users go on. The
result is bit-identical to h5py's (the tests check it for every supported pipeline).

Supported filters: deflate/gzip (libdeflate through ``deflate`` when installed, else ISA-L
through ``isal``, else the standard library's ``zlib``; all release the GIL), shuffle, fletcher32
(the checksum is verified, as HDF5 does: a mismatch is a :class:`ChecksumError`),
LZF (through ``python-lzf`` when installed), and Blosc
and Zstandard through ``numcodecs`` when installed. A dataset using any other filter is read by
h5py (the layer's ``stats.read_paths`` says which path each top takes).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "FILTER_NAMES",
    "FLETCHER32",
    "ChecksumError",
    "ChunkDecoder",
    "deflate_backend",
    "fletcher32",
    "unsupported_filters",
]

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


class ChecksumError(ValueError):
    """A chunk's stored Fletcher-32 checksum does not match its bytes: the chunk is corrupt."""


#: Words per block of the checksum: bounds its temporaries (8 bytes per word, twice).
_FLETCHER_BLOCK = 2**20


def fletcher32(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """HDF5's Fletcher-32 checksum of ``data`` (``H5_checksum_fletcher32``).

    HDF5 sums big-endian 16-bit words (an odd last byte is the high byte of a last word) into
    ``sum1`` and the running ``sum1`` into ``sum2``, folding both with ones'-complement
    reductions, and returns ``sum2 << 16 | sum1``. Folding keeps each sum's value modulo 65535
    and keeps a positive sum positive, in ``1 ... 65535``; so the result follows from the plain
    sums: ``sum1 = sum(w)`` and ``sum2 = sum(w[i] * (m - i))`` over the ``m`` words.
    """
    b = np.frombuffer(data, np.uint8)
    words = b[: b.size - b.size % 2].view(">u2")
    m = words.size + b.size % 2
    if m == 0:
        return 0
    s1 = 0
    s2 = 0  # modulo 65535: the weights are reduced, so the products and their sum fit 64 bits
    for at in range(0, words.size, _FLETCHER_BLOCK):
        w = words[at : at + _FLETCHER_BLOCK].astype(np.uint64)
        weights = np.arange(m - at, m - at - w.size, -1, dtype=np.uint64) % 65535
        s1 += int(w.sum())
        s2 = (s2 + int((w * weights).sum()) % 65535) % 65535
    if b.size % 2:  # the odd byte, weight 1
        s1 += int(b[-1]) << 8
        s2 = (s2 + (int(b[-1]) << 8)) % 65535
    if s1 == 0:  # every word zero: both sums stay 0
        return 0
    return (((s2 - 1) % 65535 + 1) << 16) | ((s1 - 1) % 65535 + 1)


def _swap16(x: int) -> int:
    return ((x & 0xFF) << 8) | (x >> 8)


def _check_fletcher32(raw: bytes, n: int) -> bytes:
    """``raw`` without its 4 checksum bytes, after checking them."""
    if len(raw) < 4:
        raise ChecksumError(f"a fletcher32 chunk of {len(raw)} bytes has no room for a checksum")
    body = memoryview(raw)[:-4]
    stored = int.from_bytes(raw[-4:], "little")
    computed = fletcher32(body)
    # HDF5 before 1.6.3 wrote the checksum with the bytes of each half swapped; HDF5 accepts both.
    legacy = (_swap16(computed >> 16) << 16) | _swap16(computed & 0xFFFF)
    if stored not in (computed, legacy):
        raise ChecksumError(
            f"Fletcher-32 checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): "
            "the chunk is corrupt"
        )
    return bytes(body)


def _decoder(filter_id: int) -> Decode | None:
    if filter_id == DEFLATE:
        return _inflate_fn
    if filter_id == FLETCHER32:
        return _check_fletcher32
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

    def decode(self, raw: bytes | bytearray | memoryview, filter_mask: int) -> np.ndarray:
        """The chunk's bytes, as a uint8 array of ``chunk_bytes``."""
        data: bytes | bytearray | memoryview | np.ndarray = raw
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
