"""Items from a worker thread to one task in the event loop, without waiting for either.

The pipeline's gathering runs in a long-lived thread of its own; what it finishes goes to the
consumer through a :class:`Handoff`. A worker that had to call into the event loop for every
group would wait for the loop thread to be scheduled each time (on a busy machine, a large part
of a millisecond); a consumer that had to wait for a loop round trip for every group would pay
that too. Here neither does: :meth:`Handoff.put` appends to a deque and returns, and
:meth:`Handoff.get` takes a ready item without a checkpoint. Only a consumer that finds nothing
ready waits, on a socket the producer writes one byte to when (and only when) someone waits:
the same self-pipe that event loops use to be woken from other threads, here through anyio's
:func:`anyio.wait_readable`, so it works on asyncio and trio alike. Items that may wait a little
(``put(..., urgent=False)``) do not wake a consumer that looks again every so often
(``get(poll=...)``): one wake-up costs about as much as handing over a small batch.
"""

from __future__ import annotations

import collections
import contextlib
import socket
from typing import Generic, TypeVar

import anyio

__all__ = ["Handoff"]

T = TypeVar("T")


class Handoff(Generic[T]):
    """A queue from producer threads to one consumer task in the event loop.

    Producer side: :meth:`put` (any thread; never blocks), :meth:`finish` (event-loop thread,
    once no producer can put again). Consumer side (event-loop thread): :meth:`get_nowait`,
    :meth:`get`, :meth:`close`. The queue is unbounded: whoever feeds the producer bounds it.
    The socket pair it waits on is closed by :meth:`finish`.
    """

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._recv, self._send = socket.socketpair()
        self._recv.setblocking(False)
        self._send.setblocking(False)
        self._waiting = False  # the consumer is parked in get(): put() must wake it
        self._polling = False  # ... and looks again soon by itself: only urgent puts wake it
        self._finished = False  # no more items will come
        self._closed = False  # the consumer is gone: items are dropped

    def __len__(self) -> int:
        """Items queued and not yet taken (any thread: a snapshot)."""
        return len(self._items)

    def put(self, item: T, *, urgent: bool = True) -> None:
        """Queue ``item`` (from any thread; returns at once). Dropped once the consumer closed.
        Not ``urgent``: a consumer waiting with ``poll`` takes it when it looks again."""
        if self._closed:
            return
        self._items.append(item)
        if self._waiting and (urgent or not self._polling):
            self._wake()

    def _wake(self) -> None:
        # A full buffer means a wake-up is pending already; a closed pair, that nobody waits.
        with contextlib.suppress(BlockingIOError, OSError):
            self._send.send(b"\0")

    def finish(self) -> None:
        """The producers are done: the consumer gets what is queued, then
        :class:`anyio.EndOfStream`. Call in the event loop's thread, after the last :meth:`put`
        returned; releases the socket pair."""
        if self._finished:
            return
        self._finished = True
        anyio.notify_closing(self._recv)  # a parked consumer wakes and sees the end
        self._recv.close()
        self._send.close()

    def close(self) -> None:
        """The consumer is gone (event-loop thread): queued and later items are dropped, and a
        consumer parked in :meth:`get` gets :class:`anyio.ClosedResourceError`."""
        self._closed = True
        self._items.clear()
        if not self._finished:
            anyio.notify_closing(self._recv)

    def peek(self) -> T | None:
        """The next item without taking it, or None when none is ready (consumer side: only the
        consumer takes items, so it stays the next one)."""
        items = self._items
        return items[0] if items and not self._closed else None

    def get_nowait(self) -> T:
        """The next item; :class:`anyio.WouldBlock` when none is ready, :class:`anyio.EndOfStream`
        after the last one, :class:`anyio.ClosedResourceError` once :meth:`close` was called."""
        if self._closed:
            raise anyio.ClosedResourceError
        if self._items:
            return self._items.popleft()
        if self._finished:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def get(self, poll: float | None = None) -> T:
        """The next item, waiting for one when none is ready (a cancellation point only then).

        ``poll``: wait at most that long (an urgent put wakes it at once), then raise
        :class:`anyio.WouldBlock` if nothing came.
        """
        while True:
            try:
                return self.get_nowait()
            except anyio.WouldBlock:
                if poll == 0:
                    raise
            self._polling = poll is not None  # before _waiting: put() reads them in turn
            self._waiting = True
            try:
                if self._items:  # put() ran before it could see that we wait
                    continue
                try:
                    if poll is None:
                        await anyio.wait_readable(self._recv)
                    else:
                        with anyio.move_on_after(poll):
                            await anyio.wait_readable(self._recv)
                        poll = 0  # looked again: an item, or WouldBlock
                except anyio.ClosedResourceError:
                    continue  # finish() or close(): get_nowait says which
                if self._finished or self._closed:
                    # Readable, and then finished or closed (the socket with it) before this
                    # task went on: get_nowait says which.
                    continue
                with contextlib.suppress(BlockingIOError):
                    self._recv.recv(4096)  # wake-ups of puts already taken do no harm
            finally:
                self._waiting = self._polling = False
