"""What crosses between a layer and its helper process: control messages and batch slots.

Control is a ``SOCK_SEQPACKET`` Unix socket pair: each message is one pickled tuple (never batch
data), so message boundaries are the kernel's. A message is small (a few hundred bytes) but
grows with the tops (the layout of a batch of thousands of them, the tops found at open) and a
saved state (an elastic resume's chain); one longer than :data:`MAX_MESSAGE` goes as a
descriptor of shared memory that holds it (:func:`pack`), since a socket carries no message
longer than its send buffer (208 KiB by default on Linux). Batch data goes
through *slots*: anonymous shared memory (``memfd_create`` on Linux; elsewhere a file created
and unlinked at once), created by the helper, mapped by both sides, and passed to the layer as
a file descriptor with the message that first uses it. Nothing has a name in ``/dev/shm``, so a
process that is killed leaves nothing behind: the memory goes when the last mapping does. The
helper's stats go as one message of plain values (:func:`stats_of`).

A top's batch crosses as one or more arrays (its *parts*, :func:`parts_of`) and the *form* that
rebuilds it from them on the layer's side (:func:`value_of`): a NumPy array is one part; a
ragged top's :class:`~asynchdf5.Ragged` its values and offsets; a sparse top's scipy CSR matrix
its data, indices and indptr (with its class and shape). A batch's size varies with its rows'
lengths: each batch says how many bytes its slot needs (:func:`needed`), and the helper makes
a larger slot where one does not fit.
"""

from __future__ import annotations

import array
import ctypes
import math
import mmap
import os
import pickle
import socket
import sys
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import TransformError
from .._fileio import pread_into
from .._pages import MAP_FAILED, libc_mmap
from .._ragged import CSR_KINDS, Ragged, csr_batch

__all__ = [
    "ALIGN",
    "MAX_MESSAGE",
    "Layout",
    "Parts",
    "Segment",
    "needed",
    "pack",
    "parts_of",
    "recv",
    "refcounts_are_reliable",
    "ring_slots",
    "send",
    "socket_pair",
    "stats_of",
    "value_of",
    "write_batch",
]

#: Each array of a slot starts on a cache line.
ALIGN = 64
#: The longest control message sent as itself (well within any socket's send buffer); a longer
#: one goes through shared memory (:func:`pack`). A receiver's buffer holds this many bytes.
MAX_MESSAGE = 64 << 10
#: What a message sent through shared memory is replaced by: ``(_LONG, its pickle's length)``.
_LONG = "long"
#: A message's descriptors: a long message's memory, and the one sent with it.
_FD_SPACE = socket.CMSG_SPACE(2 * array.array("i").itemsize)
#: A top's batch as it crosses (:func:`parts_of`): its form (``"array"``, ``"ragged"``, or
#: the scipy CSR class's name), its arrays (C-contiguous), and a matrix's shape (else None).
Parts = tuple[str, tuple[np.ndarray, ...], tuple[int, int] | None]
#: One array of a slot: where it starts, its dtype and shape.
_Part = tuple[int, str, tuple[int, ...]]
#: Where each top's parts and the indices lie in a slot: ``((top, form, (part, ...), matrix
#: shape), ...)``, the indices' offset and the batch's rows.
Layout = tuple[tuple[tuple[str, str, tuple[_Part, ...], tuple[int, int] | None], ...], int, int]


def ring_slots(prefetch: int) -> int:
    """Slots in the ring of a layer with ``prefetch``: the batch the consumer holds, the one
    it asks for meanwhile, and room for the helper to fill ahead (at least two, at most 16)."""
    return max(4, min(16, prefetch))


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected message sockets (not inherited by other programs)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def pack(message: tuple[Any, ...], fd: int | None = None) -> tuple[bytes, list[int], int | None]:
    """What carries ``message`` (and ``fd``, if given): the bytes to send, the descriptors to
    send with them, and a descriptor for the sender to close once they are sent (or None).
    A message whose pickle is longer than :data:`MAX_MESSAGE` is written into shared memory of
    its own, sent first among the descriptors, and replaced by its length (:func:`recv`)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    fds = [] if fd is None else [fd]
    if len(data) <= MAX_MESSAGE:
        return data, fds, None
    held = _anonymous(len(data))
    try:
        view = memoryview(data)
        at = 0
        while at < len(data):
            at += os.pwrite(held, view[at:], at)
    except BaseException:
        os.close(held)
        raise
    return pickle.dumps((_LONG, len(data))), [held, *fds], held


def send(sock: socket.socket, message: tuple[Any, ...], fd: int | None = None) -> None:
    """Send ``message`` (with ``fd``, if given: the receiver gets its own copy), of any length
    (:func:`pack`)."""
    data, fds, held = pack(message, fd)
    try:
        if fds:
            socket.send_fds(sock, [data], fds)
        else:
            sock.sendall(data)
    finally:
        if held is not None:
            os.close(held)


def recv(
    sock: socket.socket, buf: bytearray, *, block: bool
) -> tuple[tuple[Any, ...] | None, int | None]:
    """The next message (read into ``buf``, of :data:`MAX_MESSAGE` bytes, the receiver's own:
    no allocation per message) and the descriptor sent with it; ``(None, None)`` once the other
    side is gone. Not blocking: :class:`BlockingIOError` when nothing is there."""
    flags = 0 if block else socket.MSG_DONTWAIT
    try:
        n, ancdata, msg_flags, _ = sock.recvmsg_into([buf], _FD_SPACE, flags)
    except ConnectionResetError:  # it died with messages of ours unread
        return None, None
    fds = [
        fd
        for level, kind, data in ancdata
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
        for fd in array.array("i", data[: len(data) - len(data) % 4])
    ]
    if not n:
        for fd in fds:
            os.close(fd)
        return None, None
    if msg_flags & socket.MSG_TRUNC:  # pragma: no cover - MAX_MESSAGE bounds every message
        for fd in fds:
            os.close(fd)
        raise RuntimeError(f"a control message over {len(buf)} bytes")
    message: tuple[Any, ...] = pickle.loads(memoryview(buf)[:n])
    if message[0] == _LONG:  # sent through shared memory (:func:`pack`)
        if not fds:  # pragma: no cover - only where this process ran out of descriptors
            raise RuntimeError("a long control message came without its shared memory")
        held = fds.pop(0)
        try:
            message = pickle.loads(_read(held, message[1]))
        finally:
            os.close(held)
    return message, fds[0] if fds else None


def _read(fd: int, n: int) -> bytes:
    """The first ``n`` bytes of ``fd`` (from its start, whatever its offset)."""
    buf = bytearray(n)
    got = pread_into(fd, memoryview(buf), 0)
    if got < n:  # pragma: no cover - the sender wrote them all
        raise EOFError(f"a long control message of {n} bytes ended at {got}")
    return bytes(buf)


def _anonymous(size: int) -> int:
    """A descriptor of ``size`` bytes of shared memory that has no name."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("asynchdf5-batch", os.MFD_CLOEXEC)
    else:  # pragma: no cover - not Linux
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="asynchdf5-batch-", dir=folder)
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


_mmap, _munmap = libc_mmap()


def _map(fd: int, size: int) -> np.ndarray:
    """``size`` bytes of ``fd`` mapped shared, as a byte array; unmapped when the last array
    that views it goes. Unlike :class:`mmap.mmap`, the mapping keeps no descriptor open: a
    batch the consumer keeps holds memory, never a file descriptor."""
    addr = _mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes of shared memory: {os.strerror(err)}")
    buf = (ctypes.c_uint8 * size).from_address(addr)
    weakref.finalize(buf, _munmap, addr, size)
    out: np.ndarray = np.frombuffer(memoryview(buf).cast("B"), np.uint8)
    return out


class Segment:
    """One slot's shared memory, mapped; ``owner`` is the byte array every view comes from (the
    descriptor can be closed once this is made)."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self.owner: np.ndarray = _map(fd, size)

    @classmethod
    def create(cls, size: int) -> tuple[Segment, int]:
        """A new segment of at least ``size`` bytes, and its descriptor (to send, then close)."""
        size = max(mmap.PAGESIZE, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
        fd = _anonymous(size)
        try:
            return cls(fd, size), fd
        except BaseException:
            os.close(fd)
            raise

    def views(
        self, layout: Layout, release: Callable[[], None] | None = None, *, copy: bool = False
    ) -> tuple[dict[str, Any], np.ndarray]:
        """The values of a batch written with ``layout`` (:func:`value_of`), and its indices.
        ``release``: called once the last of them (and of every view made from them: a Ragged,
        a CSR matrix, a tensor sharing their memory) is gone; their arrays view one array of
        their own, which holds :attr:`owner` as long as it lives. ``copy``: the values are
        made of copies of the slot's arrays instead (nothing of them refers to the slot)."""
        tops, at, rows = layout
        end = at + 8 * rows
        region = self.owner
        if release is not None:
            region = np.frombuffer(self.owner.data[:end], np.uint8)
            weakref.finalize(region, release).atexit = False
        out = {}
        for name, form, parts, matrix in tops:
            arrays = []
            for offset, dtype, shape in parts:
                dt = np.dtype(dtype)
                n = math.prod(shape) * dt.itemsize
                a = region[offset : offset + n].view(dt).reshape(shape)
                arrays.append(a.copy() if copy else a)
            out[name] = value_of(form, arrays, matrix)
        indices = region[at:end].view(np.int64)
        return out, indices.copy() if copy else indices


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def parts_of(top: str, value: Any) -> Parts:
    """Top ``top``'s batch ``value`` as it crosses (:data:`Parts`): a :class:`~asynchdf5.Ragged`
    (its values and int64 offsets), a scipy CSR matrix (its data, indices and indptr, as they
    are), or anything NumPy makes an array of. :class:`~asynchdf5.TransformError` for what
    holds Python objects (a transformer's output: the layer's own batches never do), which no
    shared memory can carry."""
    matrix: tuple[int, int] | None = None
    arrays: tuple[Any, ...]
    if isinstance(value, Ragged):
        form, arrays = "ragged", (value.values, value.offsets)
    elif type(value).__module__.startswith("scipy.sparse") and type(value).__name__ in CSR_KINDS:
        form, arrays = type(value).__name__, (value.data, value.indices, value.indptr)
        matrix = (int(value.shape[0]), int(value.shape[1]))
    else:
        form, arrays = "array", (value,)
    out = tuple(np.ascontiguousarray(a) for a in arrays)
    if any(a.dtype.hasobject for a in out):
        raise TransformError(
            f"top {top!r}: a batch of {type(value).__name__} of dtype object (Python objects) "
            "cannot go through shared memory (process=True): return numeric arrays, an "
            "asynchdf5.Ragged or a scipy CSR matrix from the transformers"
        )
    return form, out, matrix


def value_of(form: str, arrays: Sequence[np.ndarray], matrix: tuple[int, int] | None) -> Any:
    """The batch value :func:`parts_of` took apart, over ``arrays`` (not copies): the same
    type, dtypes and shapes."""
    if form == "array":
        return arrays[0]
    if form == "ragged":
        return Ragged._trusted(arrays[0], arrays[1])
    assert matrix is not None
    data, indices, indptr = arrays
    m = csr_batch(data, indices, indptr, matrix[1], form)
    if m.indices.dtype != indices.dtype or m.indptr.dtype != indptr.dtype:
        # scipy's constructor chose other index dtypes (``csr_matrix`` narrows int64 ones
        # that fit int32, into copies): the batch keeps those it was sent with, the slot's.
        m.indices, m.indptr = indices, indptr
    return m


def needed(data: Mapping[str, Parts], rows: int) -> int:
    """The bytes a slot needs for a batch of these parts (:func:`parts_of`)."""
    return sum(_up(a.nbytes) for _, arrays, _ in data.values() for a in arrays) + 8 * rows


def write_batch(segment: Segment, data: Mapping[str, Parts], indices: np.ndarray) -> Layout:
    """Copy a batch (each top's :func:`parts_of`) into ``segment`` (which must hold
    :func:`needed` bytes); its layout."""
    tops = []
    at = 0
    for name, (form, arrays, matrix) in data.items():
        parts = []
        for a in arrays:
            view = segment.owner[at : at + a.nbytes].view(a.dtype).reshape(a.shape)
            np.copyto(view, a, casting="no")
            parts.append((at, a.dtype.str, tuple(a.shape)))
            at += _up(a.nbytes)
        tops.append((name, form, tuple(parts), matrix))
    segment.owner[at : at + indices.nbytes].view(np.int64)[:] = indices
    return tuple(tops), at, len(indices)


def refcounts_are_reliable() -> bool:
    """Whether a reference count says that nobody else holds an array (a GIL build)."""
    gil = getattr(sys, "_is_gil_enabled", None)
    return gil is None or bool(gil())


def stats_of(stats: Any) -> dict[str, Any]:
    """What the helper sends of its layer's :class:`~asynchdf5.LayerStats`."""
    return {
        "read_seconds": stats.read_seconds,
        "bytes_read": stats.bytes_read,
        "chunks_read": stats.chunks_read,
        "read_retries": stats.read_retries,
        "gather_seconds": stats.gather_seconds,
        "transform_seconds": stats.transform_seconds,
        "stages": {
            k: (s.busy_seconds, s.starved_seconds, s.blocked_seconds)
            for k, s in stats.stages.items()
        },
    }
