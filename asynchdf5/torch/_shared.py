"""Batches from DataLoader workers to the main process through shared memory, never pickled.

PyTorch sends a worker's tensors by moving each into *fresh* shared memory (``share_memory_``)
and pickling a handle to it: a new allocation, first-touched, per tensor, per batch. Here a
worker's layer gathers its batches straight into shared memory: its pool of batch buffers
(:class:`~asynchdf5._delivery.BatchBuffers`) takes its memory from the worker's :class:`Ring`
(:meth:`Ring.empty`: a :class:`~asynchdf5._process.Segment`, the helper-process mode's), so a
batch is already where the main process reads it, and crosses as a :class:`SharedBatch`: where
each array lies (segment, offset, dtype, shape) and the batch's indices. Unpickled in the main
process it *is* the batch: a dict of tensors viewing the segments. A batch that is not in the
pool's memory (a transformer's fresh output; a pool exhausted by a loop that keeps batches) is
copied into one of the ring's own slots and crosses the same way; with no slot free either, it
goes as plain tensors: nothing waits.

Each array sent holds a *ticket*: a flag byte in a small segment of the ring's, set by the
worker when it sends the array and cleared by the main process once the last tensor viewing it
(or any view of one) is gone. Until then the worker keeps a reference to the array, so the pool
(which reuses a buffer once nothing refers to it) never overwrites a batch the main process
still reads; the worker looks at the flags each time it sends.

A segment's descriptor travels only with the first batch that uses it (``multiprocessing``'s
``DupFd``, as torch's own tensors travel: a connection to the worker per descriptor, far dearer
than the batch's message), as the helper-process mode passes a slot's descriptor with the
message that first uses it. The main process keeps each segment mapped (:data:`_MAPPED`) and
rebuilds the later batches from its mapping: a worker's messages reach the main process in the
order it sent them, so the descriptor is always there first. A segment the worker lets go of (a
pool replaced, a slot grown) is named in its next message and forgotten; the mappings of a
worker that has ended are dropped when a new ring first sends (its segments free no memory
before: the main process's mappings hold it).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import weakref
from collections.abc import Mapping
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np
import torch

from .._batch import Batch
from .._process import Segment

#: The most slots of its own a worker copies batches into (those not gathered into the pool's
#: shared memory): the DataLoader's batches in flight (``prefetch_factor``, 2 by default, which
#: a worker cannot see), the one the loop holds, one being pinned, and room. A slot is made
#: only when every one made is in use.
SLOTS = 16

#: Arrays a worker may have sent and the main process not yet let go of (one flag byte each).
TICKETS = 4096

#: Groups of batch buffers a worker's pool keeps beyond its layer's own: the batches on their
#: way to the main process or held there (``prefetch_factor`` of them and the loop's, a group
#: holding one batch or more). With more held, batches are copied into slots.
HELD_GROUPS = 4

#: A ring's name: its worker's process id, and a number of its own (process ids are reused).
Token = tuple[int, int]

#: The segment id of a ring's flags.
_FLAGS = -1
#: Where each array of a batch lies: (name, segment id, byte offset, dtype, shape, ticket).
Place = tuple[str, int, int, str, tuple[int, ...], int]

#: In the main process: the segments mapped, by ring and segment id.
_MAPPED: dict[tuple[Token, int], Segment] = {}
_MAPPING = threading.Lock()

_ALIGN = 64


class SharedBatch:
    """A batch whose arrays lie in a ring's segments: pickles as where they lie (with the
    descriptors of segments not sent before) and rebuilds as a dict of tensors."""

    def __init__(
        self,
        token: Token,
        new: list[tuple[int, int, int]],
        dropped: list[int],
        places: list[Place],
        extra: dict[str, np.ndarray],
    ) -> None:
        self.token, self.new, self.dropped = token, new, dropped
        self.places, self.extra = places, extra

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        new = [(i, DupFd(fd), size) for i, fd, size in self.new]
        return _rebuild, (self.token, new, self.dropped, self.places, self.extra)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a process of another user has the pid
        return True
    return True


def _map(token: Token, new: list[tuple[int, Any, int]], dropped: list[int]) -> None:
    """Map the segments sent with this batch and forget those the worker let go of."""
    segments = []
    for i, dup, size in new:
        fd = dup.detach()
        try:
            segments.append((i, Segment(fd, size)))
        finally:
            os.close(fd)
    with _MAPPING:  # loaders with pin_memory unpickle in threads of their own
        if segments and all(t != token for t, _ in _MAPPED):
            # A new ring: forget the segments of ended workers.
            for gone in [k for k in _MAPPED if not _alive(k[0][0])]:
                del _MAPPED[gone]
        for i, segment in segments:
            _MAPPED[(token, i)] = segment
        for i in dropped:
            _MAPPED.pop((token, i), None)


def _free(flags: np.ndarray, ticket: int) -> None:
    flags[ticket] = 0  # the worker may reuse this array's memory


def _rebuild(
    token: Token,
    new: list[tuple[int, Any, int]],
    dropped: list[int],
    places: list[Place],
    extra: dict[str, np.ndarray],
) -> dict[str, torch.Tensor]:
    if new or dropped:
        _map(token, new, dropped)
    try:
        with _MAPPING:
            flags = _MAPPED[(token, _FLAGS)].owner
            owners = {i: _MAPPED[(token, i)].owner for i in {p[1] for p in places}}
    except KeyError:  # a worker's messages arrive in order: never expected
        raise RuntimeError(
            f"asynchdf5.torch: a batch of DataLoader worker process {token[0]} came before "
            "the shared memory it lies in"
        ) from None
    out: dict[str, torch.Tensor] = {}
    for name, i, offset, dtype, shape, ticket in places:
        dt = np.dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        # An array of its own over the bytes: it dies with the last view of it (a tensor made
        # from it holds it), and then the worker may write there again.
        region = np.frombuffer(owners[i].data[offset : offset + n], np.uint8)
        weakref.finalize(region, _free, flags, ticket).atexit = False
        out[name] = torch.from_numpy(region.view(dt).reshape(shape))
    for name, array in extra.items():
        out[name] = torch.from_numpy(array)
    return out


class Ring:
    """A worker's shared memory: its pool's batch buffers (:meth:`empty`, a
    :class:`~asynchdf5._delivery.BatchMemory`), its own slots for batches outside them, and
    the tickets of the arrays sent."""

    #: Groups the pool keeps beyond its layer's own (:class:`~asynchdf5._delivery.BatchMemory`).
    held = HELD_GROUPS

    def __init__(self) -> None:
        self._token: Token = (os.getpid(), int.from_bytes(os.urandom(8), "little"))
        # Buffers are made and let go of in the layer's threads; reentrant: letting go of one
        # (a finalizer) may happen anywhere.
        self._lock = threading.RLock()
        self._ids = 0
        #: Live segments: id(owner) -> (segment id, owner's address).
        self._where: dict[int, tuple[int, int]] = {}
        #: Live segments whose descriptor has not crossed yet: id -> (descriptor, size).
        self._unsent: dict[int, tuple[int, int]] = {}
        self._dropped: list[int] = []
        self._flags: np.ndarray | None = None  # made with the first batch sent
        self._held: dict[int, np.ndarray] = {}  # ticket -> the array it keeps from reuse
        self._tickets = list(range(TICKETS - 1, -1, -1))
        self._slots: list[np.ndarray] = []

    def empty(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of shared memory, as a byte array that views of it refer to (the
        descriptor is closed, and the main process told to forget it, once it is gone)."""
        segment, fd = Segment.create(nbytes)
        owner = segment.owner
        address = int(owner.__array_interface__["data"][0])
        with self._lock:
            i = self._ids
            self._ids += 1
            self._where[id(owner)] = (i, address)
            self._unsent[i] = (fd, segment.size)
        weakref.finalize(owner, self._gone, id(owner), i, fd)
        return owner

    def _gone(self, key: int, i: int, fd: int) -> None:
        with self._lock:
            self._where.pop(key, None)
            if self._unsent.pop(i, None) is None:
                self._dropped.append(i)
        os.close(fd)

    def pack(self, batch: Batch, indices: str | None) -> SharedBatch | None:
        """``batch`` as where its arrays lie in shared memory (copied into a slot where they
        are not in the pool's); None where it cannot be (no slot or ticket free, arrays that
        are not plain host arrays, several streams): then the caller sends tensors."""
        if batch.streams is not None:
            return None
        data: dict[str, np.ndarray] = {}
        for name, array in batch.items():
            if type(array) is not np.ndarray or array.dtype.hasobject:
                return None
            data[name] = array
        self._reap()
        if len(self._tickets) < len(data):
            return None
        places = self._places(data)
        if places is None:
            slot = self._slot(data)
            if slot is None:
                return None
            places = self._places(slot)
            assert places is not None, "a slot is shared memory"
            data = slot
        extra = {indices: batch.indices} if indices is not None else {}
        return self._send(data, places, extra)

    def _reap(self) -> None:
        """Let go of the arrays the main process is done with."""
        flags = self._flags
        if flags is None:
            return
        done = [t for t in self._held if flags[t] == 0]
        for t in done:
            del self._held[t]
        self._tickets += done

    def _places(self, data: Mapping[str, np.ndarray]) -> list[tuple[str, int, int]] | None:
        """Per array, its segment and offset; None unless every one lies in the ring's."""
        out = []
        with self._lock:
            for name, a in data.items():
                where = self._where.get(id(a.base))
                if where is None or not a.flags.c_contiguous:
                    return None
                i, address = where
                out.append((name, i, int(a.__array_interface__["data"][0]) - address))
        return out

    def _slot(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """``data`` copied into a free slot of the ring's own (made, or grown, as needed)."""
        size = sum(-(-a.nbytes // _ALIGN) * _ALIGN for a in data.values())
        slots = self._slots
        pick = None
        for i in range(len(slots)):
            # Two references when free: the list's and getrefcount's argument (a ticket's
            # array holds a third).
            if sys.getrefcount(slots[i]) <= 2:
                if len(slots[i]) < size:
                    slots[i] = self.empty(size)
                pick = slots[i]
                break
        if pick is None:
            if len(slots) >= SLOTS:
                return None
            slots.append(self.empty(size))
            pick = slots[-1]
        out = {}
        at = 0
        for name, a in data.items():
            view = pick[at : at + a.nbytes].view(a.dtype).reshape(a.shape)
            np.copyto(view, a, casting="no")
            out[name] = view
            at += -(-a.nbytes // _ALIGN) * _ALIGN
        return out

    def _send(
        self,
        data: Mapping[str, np.ndarray],
        places: list[tuple[str, int, int]],
        extra: dict[str, np.ndarray],
    ) -> SharedBatch:
        new = []
        if self._flags is None:
            segment, fd = Segment.create(TICKETS)
            self._flags = segment.owner
            weakref.finalize(self, os.close, fd)
            new.append((_FLAGS, fd, TICKETS))
        flags = self._flags
        out: list[Place] = []
        for name, i, offset in places:
            a = data[name]
            ticket = self._tickets.pop()
            flags[ticket] = 1  # the main process clears it
            self._held[ticket] = a
            out.append((name, i, offset, a.dtype.str, tuple(a.shape), ticket))
        with self._lock:
            for i in {p[1] for p in places}:
                unsent = self._unsent.pop(i, None)
                if unsent is not None:
                    new.append((i, *unsent))
            dropped, self._dropped = self._dropped, []
        return SharedBatch(self._token, new, dropped, out, extra)
