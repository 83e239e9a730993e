"""HDF5 filter pipelines decoded outside h5py, so raw chunks decompress in parallel threads.

h5py decompresses inside its process-wide lock, on one core, one chunk after the other. Reading
the raw chunk bytes with ``os.pread`` and running the filter pipeline here, with codecs that
release the GIL, lets a pool of threads decompress at once while other h5py users go on. The
result is bit-identical to h5py's (the tests check it for every supported pipeline).

Supported filters: deflate/gzip (libdeflate through ``deflate``, a dependency, else ISA-L
through ``isal``, else the standard library's ``zlib``; all release the GIL), shuffle, fletcher32
(the checksum is verified, as HDF5 does: a mismatch is a :class:`ChecksumError`), LZF
(``imagecodecs``' liblzf, a dependency, a faster build than h5py's (docs/design-notes.md);
else h5py's own ``lzf_decompress``, called through ctypes; else ``python-lzf`` when installed;
all release the GIL), LZ4 (HDF5's filter 32004, ``imagecodecs``' liblz4), bzip2 (the standard
library's), and Blosc and Zstandard (``imagecodecs``; else ``numcodecs`` where installed). A dataset
using any other filter is read by h5py (the layer's ``stats.read_paths`` says which path each top
takes).

Where a chunk's decoded bytes are exactly the destination's (whole rows, no shuffle left to
undo), the last filter decodes straight into it (:meth:`ChunkDecoder.decode_into`): one pass
over the bytes instead of a decode and a copy.
"""

from __future__ import annotations

import bz2
import ctypes
import functools
import importlib.util
import threading
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "FILTER_NAMES",
    "FLETCHER32",
    "ChecksumError",
    "ChunkDecoder",
    "copy_elements",
    "deflate_backend",
    "fletcher32",
    "unsupported_filters",
]

DEFLATE, SHUFFLE, FLETCHER32, BZIP2 = 1, 2, 3, 307
LZF, BLOSC, LZ4, ZSTD = 32000, 32001, 32004, 32015
FILTER_NAMES = {
    DEFLATE: "gzip",
    SHUFFLE: "shuffle",
    FLETCHER32: "fletcher32",
    4: "szip",
    5: "nbit",
    6: "scaleoffset",
    BZIP2: "bzip2",
    LZF: "lzf",
    BLOSC: "blosc",
    LZ4: "lz4",
    32008: "bitshuffle",
    32013: "zfp",
    ZSTD: "zstd",
    32017: "sz",
    32018: "fcidecomp",
    32024: "sz3",
    32026: "blosc2",
    32028: "sperr",
}

#: A filter's decoding: (stored bytes, the chunk's size) -> the bytes before that filter. A
#: decoder may return a buffer of its own thread's (:func:`_scratch`), valid until its next call
#: in that thread.
Decode = Callable[[Any, int], "bytes | bytearray | memoryview | np.ndarray"]
#: A filter's decoding straight into ``out`` (a C-contiguous uint8 array of the decoded size);
#: raises where the stored bytes do not decode to exactly that size.
DecodeInto = Callable[[Any, np.ndarray], None]

_local = threading.local()


def _scratch(key: str, n: int) -> np.ndarray:
    """A buffer of ``n`` bytes of this thread's, reused by every call with ``key``: decoding into
    fresh memory for each chunk costs a page fault per page, which on some VMs is slower than
    the decoding itself."""
    bufs: dict[str, np.ndarray] | None = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.size < n:
        buf = bufs[key] = np.empty(n, np.uint8)
    return buf[:n]


class _Decompressor:
    """One thread's libdeflate decompressor, freed with the thread's local storage."""

    def __init__(self, lib: Any) -> None:
        self.handle = lib.libdeflate_alloc_decompressor()
        if not self.handle:
            raise MemoryError("libdeflate_alloc_decompressor failed")
        weakref.finalize(self, lib.libdeflate_free_decompressor, self.handle)


def _libdeflate_c() -> DecodeInto | None:
    """libdeflate's C API, where the ``deflate`` package's extension exports it (its Linux and
    macOS builds), called through ctypes (without the GIL) into a reused buffer: the package's
    own ``zlib_decompress`` returns fresh memory per chunk, and decodes on one thread at a time
    (measured: two threads inflated no faster than one)."""
    try:
        spec = importlib.util.find_spec("deflate._deflate")
        if spec is None or spec.origin is None:
            return None
        lib = ctypes.CDLL(spec.origin)
        alloc, free = lib.libdeflate_alloc_decompressor, lib.libdeflate_free_decompressor
        fn = lib.libdeflate_zlib_decompress
    except (ImportError, OSError, AttributeError):
        return None
    alloc.argtypes, alloc.restype = [], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.argtypes += [ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
    fn.restype = ctypes.c_int

    def into(raw: Any, out: np.ndarray) -> None:
        d: _Decompressor | None = getattr(_local, "inflater", None)
        if d is None:
            d = _local.inflater = _Decompressor(lib)
        src, size = _span(raw)
        dst, n = _span(out)
        got = ctypes.c_size_t(0)
        status = fn(d.handle, src, size, dst, n, ctypes.byref(got))
        if status != 0 or got.value != n:  # 1: bad data, 2: short output, 3: no room
            raise ValueError(f"libdeflate: zlib data does not inflate to {n} bytes ({status})")

    return into


def _span(buf: Any) -> tuple[int, int]:
    """The address and size in bytes of a C-contiguous buffer, for a C call. Not numpy's
    ``.ctypes.data``: it builds an object of several microseconds per call, and a decoder is
    called per stored chunk (tens of thousands an epoch), holding the GIL meanwhile."""
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view)), view.nbytes
    except (TypeError, ValueError):  # read-only (bytes), or empty
        array = np.frombuffer(view, np.uint8)
        return (array.__array_interface__["data"][0] if array.size else 0), array.size


def _scratched(into: DecodeInto, key: str) -> Decode:
    """``into`` as a :data:`Decode` into this thread's buffer ``key``."""

    def decode(raw: Any, n: int) -> np.ndarray:
        out = _scratch(key, n)
        into(raw, out)
        return out

    return decode


def _inflate() -> tuple[str, Decode, DecodeInto | None]:
    found = _libdeflate_c()
    if found is not None:
        return "libdeflate", _scratched(found, "inflate"), found
    try:
        import deflate

        return "libdeflate", lambda raw, n: deflate.zlib_decompress(raw, n), None
    except ImportError:
        pass
    try:
        from isal import isal_zlib

        return "isal", lambda raw, n: isal_zlib.decompress(raw, bufsize=n), None
    except ImportError:
        pass
    return "zlib", lambda raw, n: zlib.decompress(raw, bufsize=n), None


_DEFLATE_BACKEND, _inflate_fn, _inflate_into = _inflate()


def deflate_backend() -> str:
    """Which library inflates gzip chunks: ``libdeflate``, ``isal`` or ``zlib``."""
    return _DEFLATE_BACKEND


@functools.cache
def _imagecodecs_lzf() -> DecodeInto | None:
    """``imagecodecs``' LZF decoder (liblzf, a faster build than h5py's copy of it), which
    releases the GIL; None where imagecodecs is not installed."""
    try:
        from imagecodecs import lzf_decode
    except ImportError:
        return None

    def into(raw: Any, out: np.ndarray) -> None:
        n = out.size
        try:
            got = len(lzf_decode(raw, out=out.data)) if len(raw) else 0
        except RuntimeError as exc:  # imagecodecs.LzfError: bad data, or more than n bytes
            raise ValueError(f"LZF data does not decode to {n} bytes: {exc}") from exc
        if got != n:
            raise ValueError(f"LZF data decodes to {got} bytes, expected {n}")

    return into


@functools.cache
def _h5py_lzf() -> DecodeInto | None:
    """h5py's own LZF decoder (``lzf_decompress`` of liblzf, compiled into ``h5py.h5z`` for its
    LZF filter), through ctypes: the very code h5py decodes with, called without the GIL."""
    try:
        from h5py import h5z

        fn = ctypes.CDLL(h5z.__file__).lzf_decompress
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_uint

    def into(raw: Any, out: np.ndarray) -> None:
        src, size = _span(raw)
        dst, n = _span(out)
        got = fn(src, size, dst, n) if size else 0
        if got != n:
            raise ValueError(f"LZF data decodes to {got} bytes, expected {n}")

    return into


def _bunzip2(raw: Any, n: int) -> bytes:
    """HDF5's bzip2 filter (307, PyTables' and hdf5plugin's): one bzip2 stream per chunk, which
    the standard library decodes without the GIL."""
    try:
        return bz2.decompress(raw)
    except (OSError, ValueError, EOFError) as exc:  # not bzip2 data, or cut short
        raise ValueError(f"bzip2: {exc}") from exc


def _imagecodecs_lz4() -> DecodeInto | None:
    """HDF5's LZ4 filter (32004, hdf5plugin's ``LZ4``) decoded by ``imagecodecs``' liblz4,
    which releases the GIL; None where imagecodecs is not installed.

    The filter's format (H5Zlz4.c): the decoded size (8 bytes, big-endian), the block size (4
    bytes, big-endian; the last block holds what is left), then each block as its stored size
    (4 bytes, big-endian) and its bytes: raw where that size is the block's, else one LZ4 block
    (no frame). Anything else is an error, never a guess."""
    try:
        from imagecodecs import lz4_decode
    except ImportError:
        return None

    def into(raw: Any, out: np.ndarray) -> None:
        src: Any = memoryview(raw).cast("B")
        n = out.size
        if len(src) < 12:
            raise ValueError(f"lz4: a chunk of {len(src)} bytes has no room for its header")
        total = int.from_bytes(src[:8], "big")
        block = min(int.from_bytes(src[8:12], "big"), total)
        if total != n or (n and block == 0):
            raise ValueError(f"lz4: the chunk says {total} bytes (block {block}), not {n}")
        at, done = 12, 0
        while done < n:
            size = min(block, n - done)
            if at + 4 > len(src):
                raise ValueError(f"lz4: the chunk ends before its block at byte {done}")
            stored = int.from_bytes(src[at : at + 4], "big")
            at += 4
            if at + stored > len(src):
                raise ValueError(f"lz4: a block of {stored} bytes runs past the chunk's end")
            dest = out[done : done + size]
            if stored == size:  # stored raw: compressing it did not save a byte
                dest[:] = np.frombuffer(src[at : at + stored], np.uint8)
            else:
                try:
                    got = len(lz4_decode(src[at : at + stored], out=dest.data))
                except RuntimeError as exc:  # imagecodecs.Lz4Error: bad data, or too long
                    raise ValueError(f"lz4: {exc}") from exc
                if got != size:
                    raise ValueError(f"lz4: a block decoded to {got} bytes, not {size}")
            at += stored
            done += size
        if at != len(src):
            raise ValueError(f"lz4: {len(src) - at} bytes past the chunk's last block")

    return into


def _imagecodecs_into(filter_id: int) -> DecodeInto | None:
    """Blosc (32001: one Blosc buffer a chunk) or Zstandard (32015: one zstd frame a chunk),
    hdf5plugin's filters, decoded by ``imagecodecs`` (a dependency), which releases the GIL,
    straight into the caller's buffer; None where imagecodecs lacks the codec. Blosc decodes
    on the calling thread alone (the reader's threads are the parallelism)."""
    try:
        import imagecodecs
    except ImportError:
        return None
    name = FILTER_NAMES[filter_id]
    if filter_id == BLOSC and imagecodecs.BLOSC.available:
        fn: Any = functools.partial(imagecodecs.blosc_decode, numthreads=1)
    elif filter_id == ZSTD and imagecodecs.ZSTD.available:
        fn = imagecodecs.zstd_decode
    else:
        return None

    def into(raw: Any, out: np.ndarray) -> None:
        try:
            got = len(fn(raw, out=out.data))
        except RuntimeError as exc:  # imagecodecs' BloscError, ZstdError: bad data, too long
            raise ValueError(f"{name}: {exc}") from exc
        if got != out.size:
            raise ValueError(f"{name}: the chunk decoded to {got} bytes, not {out.size}")

    return into


def _lzf_into() -> DecodeInto | None:
    """The fastest LZF decoder into a buffer that is installed (see the module's docstring)."""
    found = _imagecodecs_lzf()
    return found if found is not None else _h5py_lzf()


def _optional_decoder(filter_id: int) -> Decode | None:
    if filter_id == LZF:
        found = _lzf_into()
        if found is not None:
            return _scratched(found, "lzf")
        try:
            import lzf
        except ImportError:
            return None
        return lambda raw, n: lzf.decompress(bytes(raw), n)
    if filter_id == LZ4:
        found = _imagecodecs_lz4()
        return None if found is None else _scratched(found, "lz4")
    if filter_id == BZIP2:
        return _bunzip2
    if filter_id in (BLOSC, ZSTD):
        into = _imagecodecs_into(filter_id)
        if into is not None:
            return _scratched(into, FILTER_NAMES[filter_id])
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
    return lambda raw, n: codec.decode(raw)


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


def _check_fletcher32(raw: Any, n: int) -> memoryview:
    """``raw`` without its 4 checksum bytes, after checking them."""
    raw = memoryview(raw).cast("B")
    if len(raw) < 4:
        raise ChecksumError(f"a fletcher32 chunk of {len(raw)} bytes has no room for a checksum")
    body = memoryview(raw)[:-4]
    stored = int.from_bytes(raw[-4:].tobytes(), "little")
    computed = fletcher32(body)
    # HDF5 before 1.6.3 wrote the checksum with the bytes of each half swapped; HDF5 accepts both.
    legacy = (_swap16(computed >> 16) << 16) | _swap16(computed & 0xFFFF)
    if stored not in (computed, legacy):
        raise ChecksumError(
            f"Fletcher-32 checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): "
            "the chunk is corrupt"
        )
    return body


def _decoder(filter_id: int) -> Decode | None:
    if filter_id == DEFLATE:
        return _inflate_fn
    if filter_id == FLETCHER32:
        return _check_fletcher32
    return _optional_decoder(filter_id)


def _decoder_into(filter_id: int) -> DecodeInto | None:
    """The filter's decoding straight into a buffer, where its decoder has one."""
    if filter_id == DEFLATE:
        return _inflate_into
    if filter_id == LZF:
        return _lzf_into()
    if filter_id == LZ4:
        return _imagecodecs_lz4()
    if filter_id in (BLOSC, ZSTD):
        return _imagecodecs_into(filter_id)
    return None


def unsupported_filters(filters: Sequence[int]) -> list[str]:
    """Names of the filters in ``filters`` that cannot be decoded here."""
    return [
        FILTER_NAMES.get(f, f"filter {f}") for f in filters if f != SHUFFLE and _decoder(f) is None
    ]


#: One step of a pipeline's decoding: the filter's place in the pipeline, its decoding (None:
#: shuffle) and its decoding into a buffer (where it has one).
_Step = tuple[int, "Decode | None", "DecodeInto | None"]


class ChunkDecoder:
    """Decodes the raw bytes of one chunk through a dataset's filter pipeline (in reverse).

    ``shape``: the chunk's shape, for :meth:`elements` (default: ``chunk_bytes // itemsize``
    elements in one dimension).
    """

    def __init__(
        self,
        filters: Sequence[int],
        itemsize: int,
        chunk_bytes: int,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        self.filters = tuple(filters)
        self.itemsize = itemsize
        self.chunk_bytes = chunk_bytes
        self.shape = shape if shape is not None else (chunk_bytes // max(1, itemsize),)
        self._steps: list[_Step] = []
        for i in reversed(range(len(self.filters))):
            f = self.filters[i]
            decode = None if f == SHUFFLE else _decoder(f)
            if f != SHUFFLE and decode is None:
                raise ValueError(f"unsupported filter {FILTER_NAMES.get(f, f)}")
            self._steps.append((i, decode, None if decode is None else _decoder_into(f)))
        # The common pipeline, one decompressor alone (gzip, lzf): :meth:`elements` decodes
        # straight into this thread's buffer, without walking the steps (once per chunk).
        self._plain = self._steps[0][2] if len(self._steps) == 1 else None
        self._element_shape = (*self.shape, itemsize)

    def decode(self, raw: bytes | bytearray | memoryview, filter_mask: int) -> np.ndarray:
        """The chunk's bytes, as a uint8 array of ``chunk_bytes``."""
        data, shuffled = self._run(raw, filter_mask)
        if shuffled:
            return _unshuffle(data, self.itemsize)
        return np.array(data)  # not a buffer the next decode in this thread reuses

    def decode_into(
        self, raw: bytes | bytearray | memoryview, filter_mask: int, out: np.ndarray
    ) -> bool:
        """Decode the chunk straight into ``out`` (a C-contiguous uint8 array of
        ``chunk_bytes``) where the pipeline's last step can write there (a decompressor with a
        buffer of its own to fill: no shuffle left to undo). False: nothing was written, use
        :meth:`elements`."""
        steps = self._active(filter_mask)
        if not steps or steps[-1][2] is None or out.size != self.chunk_bytes:
            return False
        into = steps[-1][2]
        data = self._apply(raw, steps[:-1])
        into(data, out)
        return True

    def elements(self, raw: bytes | bytearray | memoryview, filter_mask: int) -> np.ndarray:
        """The chunk's elements as a uint8 array of shape ``(*shape, itemsize)``: a view of the
        decoded bytes, strided where a last shuffle is left to the copy that reads it (one pass
        over the bytes instead of two; :func:`copy_elements`). It may view a buffer of this
        thread's: valid until the thread's next decode."""
        if self._plain is not None and not filter_mask:
            out = _scratch("elements", self.chunk_bytes)
            self._plain(raw, out)  # raises unless the chunk decodes to exactly its size
            return out.reshape(self._element_shape)
        data, shuffled = self._run(raw, filter_mask)
        n = self.chunk_bytes // max(1, self.itemsize)
        if shuffled and self.itemsize > 1 and n * self.itemsize == data.size:
            return np.moveaxis(data.reshape(self.itemsize, *self.shape), 0, -1)
        if shuffled:
            data = _unshuffle(data, self.itemsize)
        return data.reshape(*self.shape, self.itemsize)

    def _active(self, filter_mask: int) -> list[_Step]:
        """The steps of a chunk whose filter mask says which filters HDF5 skipped for it."""
        if not filter_mask:
            return self._steps
        return [step for step in self._steps if not filter_mask & (1 << step[0])]

    def _apply(self, raw: bytes | bytearray | memoryview, steps: Sequence[_Step]) -> Any:
        """``raw`` through ``steps``, in order."""
        data: Any = raw
        last: Decode | None = None
        for _, decode, _ in steps:
            if decode is None:
                data = _unshuffle(np.frombuffer(data, np.uint8), self.itemsize)
            else:
                if decode is last:  # the same filter twice: its buffer is its input
                    data = np.array(np.frombuffer(data, np.uint8))
                data = decode(data, self.chunk_bytes)
                last = decode
        return data

    def _run(
        self, raw: bytes | bytearray | memoryview, filter_mask: int
    ) -> tuple[np.ndarray, bool]:
        """The chunk's bytes after every step but a last shuffle, and whether that is left."""
        steps = self._active(filter_mask)
        shuffled = bool(steps) and steps[-1][1] is None
        if shuffled:
            steps = steps[:-1]
        out = np.frombuffer(self._apply(raw, steps), np.uint8)
        if out.size != self.chunk_bytes:
            raise ValueError(f"decoded chunk has {out.size} bytes, expected {self.chunk_bytes}")
        return out, shuffled


def copy_elements(into: np.ndarray, elements: np.ndarray) -> None:
    """Copy ``elements`` (``(..., itemsize)`` uint8, from :meth:`ChunkDecoder.elements`) into
    ``into``, byte plane by byte plane where the elements are still shuffled: numpy copies a
    plane (contiguous in, every ``itemsize``-th byte out) several times faster than it gathers
    the bytes of each element from ``itemsize`` planes."""
    k = elements.shape[-1]
    if k > 1 and elements.strides[-1] != 1:
        for j in range(k):
            np.copyto(into[..., j], elements[..., j])
    elif k in (2, 4, 8) and into.strides[-1] == 1:
        # Whole elements at once (numpy copies a row of them faster than a row of their bytes;
        # each element's bytes are together on both sides).
        np.copyto(into.view(_UINT[k]), elements.view(_UINT[k]))
    else:
        np.copyto(into, elements)


#: An unsigned integer of each element size, to copy elements whole.
_UINT: dict[int, np.dtype[Any]] = {
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


def _unshuffle(buf: np.ndarray, itemsize: int) -> np.ndarray:
    """Undo HDF5's byte shuffle: byte j of every element was stored together."""
    if itemsize == 1:
        return buf
    n = buf.size // itemsize
    body = buf[: n * itemsize].reshape(itemsize, n).T.reshape(-1)
    if n * itemsize == buf.size:
        return np.ascontiguousarray(body)
    return np.concatenate([body, buf[n * itemsize :]])
