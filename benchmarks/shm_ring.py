"""A prototype: the layer in one helper process, batches in a ring of shared-memory slots.

The way SPDL keeps a loader's Python off the trainer's GIL: the pipeline runs in another
process, and batches cross without pickling. Here a spawned process runs
:class:`asynchdf5.HDF5DataLayer` and copies each batch into a free slot of one
``multiprocessing.shared_memory`` block; the trainer's process reads NumPy views of the slot.
Control is a few bytes over a pipe each way: ``(slot, rows)`` when a slot is filled, ``slot``
when the trainer is done with it (when it asks for the next batch), ``-1`` to stop. The batch
a trainer holds is valid until its next ``next()``.

Used by :mod:`benchmarks.step_cost`; a measurement, not a library feature (one process, one
consumer, the tops ``data`` and ``label`` of fixed shapes, no resume).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import struct
from collections import deque
from collections.abc import Iterator
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["ShmRing"]

SLOTS = 4
_ALIGN = 4096
_FILLED = struct.Struct("ii")
_FREE = struct.Struct("i")

Pair = tuple[npt.NDArray[Any], npt.NDArray[Any]]


def _layout(batch: int, shape: tuple[int, ...]) -> tuple[int, int]:
    """Offset of the labels in a slot, and the slot's size (page-aligned)."""
    data_bytes = batch * int(np.prod(shape))
    label_at = -(-data_bytes // 64) * 64
    slot = -(-(label_at + 8 * batch) // _ALIGN) * _ALIGN
    return label_at, slot


def _views(buf: Any, batch: int, shape: tuple[int, ...], slots: int) -> list[Pair]:
    label_at, size = _layout(batch, shape)
    return [
        (
            np.ndarray((batch, *shape), np.uint8, buffer=buf, offset=i * size),
            np.ndarray((batch,), np.int64, buffer=buf, offset=i * size + label_at),
        )
        for i in range(slots)
    ]


def _serve(
    conn: Connection,
    name: str,
    source: str,
    kwargs: dict[str, Any],
    batch: int,
    shape: tuple[int, ...],
    slots: int,
) -> None:
    """The helper process: fill free slots with the layer's batches, epoch after epoch."""
    from asynchdf5 import HDF5DataLayer

    shm = SharedMemory(name=name)
    # The creator owns the block; without this the tracker would unlink it when we exit.
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    views = _views(shm.buf, batch, shape, slots)
    free = deque(range(slots))
    try:
        with HDF5DataLayer(source, **kwargs) as layer:
            while True:
                for b in layer:
                    while not free or conn.poll():
                        (slot,) = _FREE.unpack(conn.recv_bytes())
                        if slot < 0:
                            return
                        free.append(slot)
                    slot = free.popleft()
                    d, label = views[slot]
                    n = len(b.indices)
                    d[:n] = b["data"]
                    label[:n] = b["label"]
                    conn.send_bytes(_FILLED.pack(slot, n))
    except (EOFError, BrokenPipeError):  # the trainer went away
        pass
    except BaseException as exc:
        conn.send_bytes(_FILLED.pack(-1, 0))
        conn.send(repr(exc))
        raise
    finally:
        del views
        shm.close()


class ShmRing:
    """Batches from a helper process through shared memory (see the module docstring)."""

    def __init__(
        self,
        source: str,
        kwargs: dict[str, Any],
        batch: int,
        shape: tuple[int, ...],
        slots: int = SLOTS,
    ) -> None:
        ctx = mp.get_context("spawn")
        _, size = _layout(batch, shape)
        self._shm = SharedMemory(create=True, size=slots * size)
        self._views = _views(self._shm.buf, batch, shape, slots)
        self._conn, theirs = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve,
            args=(theirs, self._shm.name, source, kwargs, batch, shape, slots),
            name="shm-ring-loader",
            daemon=True,
        )
        self._proc.start()
        theirs.close()
        self._held: int | None = None

    def __iter__(self) -> Iterator[Pair]:
        while True:
            yield self.next()

    def next(self) -> Pair:
        """The next batch; the one returned before is given back."""
        if self._held is not None:
            self._conn.send_bytes(_FREE.pack(self._held))
            self._held = None
        slot, rows = _FILLED.unpack(self._conn.recv_bytes())
        if slot < 0:
            raise RuntimeError(f"the loader process failed: {self._conn.recv()}")
        self._held = slot
        d, label = self._views[slot]
        return d[:rows], label[:rows]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send_bytes(_FREE.pack(-1))
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join()
        self._conn.close()
        del self._views
        # The caller may still hold a view of the last batch: then it is unmapped at exit.
        with contextlib.suppress(BufferError):
            self._shm.close()
        self._shm.unlink()

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
