"""The helper process of a layer opened with ``process=True`` (``python -m asynchdf5._serve FD``).

It reads what to serve from its standard input (:func:`asynchdf5._process.payload`), opens the
same layer (without ``process``) and serves it over the socket ``FD``: for each run the layer
asks for, it loads the layer's saved state (where the consumer is) and iterates from there,
copying each batch into a free slot of shared memory and saying so in a few bytes; an epoch's
end, a failure (with its exception) and the pipeline's stats go the same way.

It ends when the layer says so, when the socket closes (the layer's process is gone), or when
its parent changes (a watchdog, in case the socket was inherited by another process); it ignores
Ctrl-C, which the layer's process handles and then closes it.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing.spawn
import os
import pickle
import signal
import socket
import sys
import time
from typing import Any

import anyio

from ._batch import Batch
from ._hdf5 import AsyncHDF5DataLayer
from ._process import (
    IMPORTING_MAIN,
    MAX_MESSAGE,
    Segment,
    error_blob,
    needed,
    pack,
    parts_of,
    ring_slots,
    stats_of,
    write_batch,
)
from ._process import recv as _recv
from ._process import send as _send
from ._ragged_tops import RaggedInfo

__all__ = ["main"]

#: The helper sends its layer's stats at most this often (with a batch, or an epoch's end).
STATS_EVERY_S = 0.25
#: How often the watchdog looks whether the parent process is still there.
WATCH_S = 0.5


class Helper:
    """Serves one open layer to the socket (see the module docstring)."""

    def __init__(self, sock: socket.socket, layer: AsyncHDF5DataLayer) -> None:
        self.sock = sock
        self.layer = layer
        slots = ring_slots(layer.config.prefetch)
        self.segments: list[Segment | None] = [None] * slots
        self.free = collections.deque(range(slots))
        self.freed = anyio.Event()
        self.producer: anyio.CancelScope | None = None
        self.produced = anyio.Event()
        self.produced.set()
        self.stats_at = 0.0
        self.buf = bytearray(MAX_MESSAGE)

    async def send(self, message: tuple[Any, ...], fd: int | None = None) -> None:
        data, fds, held = pack(message, fd)  # a long message through shared memory
        try:
            while True:
                try:
                    if fds:
                        socket.send_fds(self.sock, [data], fds)
                    else:
                        self.sock.send(data)
                    return
                except BlockingIOError:
                    await anyio.wait_writable(self.sock)
        finally:
            if held is not None:
                os.close(held)

    async def serve(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_parent, tg.cancel_scope)
            while True:
                try:
                    message, fd = _recv(self.sock, self.buf, block=False)
                except BlockingIOError:
                    await anyio.wait_readable(self.sock)
                    continue
                if fd is not None:
                    os.close(fd)
                if message is None or message[0] == "close":
                    tg.cancel_scope.cancel()
                    return
                if message[0] == "free":
                    self.free.extend(message[1])
                    self.freed.set()
                elif message[0] == "start":
                    await self.stop()
                    scope, done = anyio.CancelScope(), anyio.Event()
                    self.producer, self.produced = scope, done
                    tg.start_soon(self.produce, scope, done, *message[1:])

    async def stop(self) -> None:
        if self.producer is not None:
            self.producer.cancel()
            await self.produced.wait()
            self.producer = None

    async def produce(
        self,
        scope: anyio.CancelScope,
        done: anyio.Event,
        token: int,
        mode: str,
        state: dict[str, Any] | None,
    ) -> None:
        layer = self.layer
        try:
            with scope:
                try:
                    if state is not None:
                        layer.load_state_dict(state)
                    if mode == "epoch":
                        while True:
                            it = layer.__aiter__()
                            try:
                                async for batch in it:
                                    await self.put(token, batch)
                            finally:
                                await it.aclose()
                            await self.send(("end", token, layer.epoch - 1))
                            await self.send_stats(force=True)
                    else:
                        epoch = layer.epoch
                        it = layer.stream()
                        try:
                            async for batch in it:
                                for ended in range(epoch, layer.epoch):
                                    await self.send(("end", token, ended))
                                epoch = layer.epoch
                                await self.put(token, batch)
                        finally:
                            await it.aclose()
                except Exception as exc:
                    await self.send_stats(force=True)
                    await self.send(("fail", token, error_blob(exc)))
        finally:
            done.set()

    async def put(self, token: int, batch: Batch) -> None:
        """Copy ``batch`` into a free slot and tell the layer."""
        while not self.free:
            self.freed = anyio.Event()
            await self.freed.wait()
        data = {top: parts_of(top, value) for top, value in batch.items()}
        slot = self.free.popleft()
        size = needed(data, batch.size)
        segment, fd = self.segments[slot], None
        if segment is None or segment.size < size:
            segment, fd = Segment.create(size)
            self.segments[slot] = segment
        try:
            layout = write_batch(segment, data, batch.indices)
            await self.send(("batch", token, slot, batch.epoch, layout, segment.size), fd)
        finally:
            if fd is not None:
                os.close(fd)
        await self.send_stats()

    async def send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.stats_at >= STATS_EVERY_S:
            self.stats_at = now
            await self.send(("stats", stats_of(self.layer.stats)))


def _ragged_tops(layer: AsyncHDF5DataLayer) -> dict[str, RaggedInfo]:
    """What the layer's process keeps of each ragged or sparse top (to check its delivery at
    open and upload its batches to a device: :meth:`RaggedInfo.for_batches`)."""
    opened = layer._consumer.opened
    assert opened is not None
    rows = layer.config.batch_size
    return {
        name: t.ragged.for_batches(rows)
        for name, t in opened.reader.tops.items()
        if t.ragged is not None
    }


async def _watch_parent(scope: anyio.CancelScope) -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        await anyio.sleep(WATCH_S)
    scope.cancel()


async def _serve(
    sock: socket.socket,
    source: Any,
    config: Any,
    part: tuple[int, int] | None,
    state: dict[str, Any] | None,
) -> None:
    opened = False
    try:
        # Exactly the parent's configuration (its drawn seed included), without process=True.
        layer = AsyncHDF5DataLayer._with_config(source, dataclasses.replace(config, process=False))
        if part is not None:
            layer._set_part(*part)
        if state is not None:
            layer.load_state_dict(state)
        async with layer:
            opened = True
            helper = Helper(sock, layer)
            stats = layer.stats
            ragged = _ragged_tops(layer)
            shape = layer._data_shape()
            await helper.send(("open", shape, stats.read_paths, stats.read_notes, ragged))
            await helper.serve()
    except Exception as exc:
        if opened:
            raise
        sock.setblocking(True)
        _send(sock, ("failed", error_blob(exc)))  # of any length


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the layer's process handles Ctrl-C
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        prep, blob = pickle.loads(sys.stdin.buffer.read())
        IMPORTING_MAIN.append(True)
        try:
            multiprocessing.spawn.prepare(prep)  # the main module, as spawn imports it
        finally:
            IMPORTING_MAIN.clear()
        source, config, part, state = pickle.loads(blob)
    except Exception as exc:  # e.g. a transformer's class that the main module no longer has
        _send(sock, ("failed", error_blob(exc)))  # of any length
        sock.close()
        return
    sock.setblocking(False)
    try:
        anyio.run(_serve, sock, source, config, part, state)
    finally:
        sock.close()


if __name__ == "__main__":
    main()
