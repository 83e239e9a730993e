"""The iterator over one epoch or the endless stream (:class:`EpochIterator`): a view on the
layer's :class:`~._consumer.Consumer`, which holds the consumer's state. The iterator's own
fields (its mode, whether a ``for`` loop drives it, the opening it serves, whether it is done)
are written here only, from what the consumer answers."""

from __future__ import annotations

import contextlib
import inspect
import time
import weakref
from collections.abc import Generator, Iterator

from anyio.from_thread import BlockingPortal

from ._batch import Batch
from ._consumer import Consumer
from ._pipeline import Mode
from ._process import forget_kept_interrupts, raise_kept_interrupt
from ._sync import BRIDGE_BATCHES, call_or_cancel

__all__ = ["EpochIterator"]


class EpochIterator:
    """Iterates one epoch (``async for batch in layer``) or the endless stream
    (``layer.stream()``), yielding :class:`~asynchdf5.Batch` objects.

    Made by the layer; a layer serves one live iterator at a time. The iteration ends at the end
    of the epoch (``StopAsyncIteration``), with the error that stopped the pipeline (after every
    complete batch before it), or when closed with :meth:`aclose`; leaving an ``async for`` with
    ``break`` drops the iterator, which ends it too. The next iteration then starts the next
    epoch. Using an iterator after its layer was closed is a :class:`~asynchdf5.StateError`.

    Attributes
    ----------
    mode : {"epoch", "stream"}
        One epoch, or the endless stream of full batches across epochs.
    """

    def __init__(self, consumer: Consumer, mode: Mode) -> None:
        #: The layer's consumer, which this iterator is a view on.
        self.consumer = consumer
        self.mode: Mode = mode
        #: Driven by a ``for`` loop, which hands batches over in its own thread (:mod:`._sync`).
        self.bridged = False
        #: The iteration is over (finished, failed, closed).
        self.done = False
        #: The consumer's opening this iterator serves (None: not started).
        self.opening: int | None = None
        # The generator of the ``for`` loop that drives it (bridged only).
        self._driver: weakref.ReferenceType[Generator[Batch, None, None]] | None = None

    def __repr__(self) -> str:
        state = "done" if self.done else "open"
        return f"<asynchdf5.EpochIterator mode={self.mode!r} {state}>"

    def __aiter__(self) -> EpochIterator:
        return self

    async def __anext__(self) -> Batch:
        if not self.bridged:  # a for loop's: raised in its thread, never on the bridge's loop
            raise_kept_interrupt()  # a Ctrl-C that came while a batch was let go of
        consumer = self.consumer
        try:
            batch = consumer.next_ready(self)  # a ready batch, without a trip through the loop
            if batch is not None:
                return batch
            if self.done:
                raise StopAsyncIteration
            if self.opening is None:
                self.opening = await consumer.begin(self)
            return await consumer.next(self)
        except StopAsyncIteration:
            self.done = True
            raise
        except BaseException:
            # Cancelled, or failed: like an async generator, the iteration is over.
            self.done = True
            consumer.leave(self)
            raise

    async def aclose(self) -> None:
        """End this iteration before its end (what leaving ``async for`` with ``break`` does)."""
        self.close()

    def close(self) -> None:
        """:meth:`aclose` for sync code."""
        self.done = True
        self.consumer.leave(self)

    def __iter__(self) -> Iterator[Batch]:
        """Iterate with ``for`` (the layer must be open with ``with``): batches come across the
        opening's portal (:mod:`._sync`) and are handed over in the loop's thread."""
        portal = self.consumer.portal()
        self.bridged = True
        driver = self._bridged(portal)
        self._driver = weakref.ref(driver)
        return driver

    @property
    def abandoned(self) -> bool:
        """The ``for`` loop's generator is over (or gone) and this iteration was not closed: a
        Ctrl-C can land anywhere in the generator's ``finally``, before its close. The
        iteration is over all the same (the place no longer takes it for live)."""
        driver = self._driver
        if driver is None:
            return False
        generator = driver()
        return generator is None or inspect.getgeneratorstate(generator) == inspect.GEN_CLOSED

    async def _next_group(self, limit: int) -> list[Batch]:
        """On the loop: the next batch and up to ``limit - 1`` more that are ready now; ``[]``
        at the end. One trip across the bridge per group of ready batches, never more than are
        already gathered (an epoch is never collected)."""
        try:
            first = await self.__anext__()
        except StopAsyncIteration:
            return []
        return [first, *self.consumer.ready_now(self, limit - 1)]

    async def _fail(self) -> None:
        """On the loop: a batch could not be handed over (see :meth:`Consumer.fail`)."""
        self.consumer.fail(self)

    def _bridged(self, portal: BlockingPortal) -> Generator[Batch, None, None]:
        """This iteration in a ``for`` loop: each batch is handed over (and counted for
        ``state_dict()``) in the loop's thread as the loop takes it."""
        consumer = self.consumer
        forget_kept_interrupts()  # those of no loop: see raise_kept_interrupt
        stepped = 0.0  # the loop's seconds on the batch before, counted with the next one
        try:
            while True:
                batches = call_or_cancel(portal, self._next_group, BRIDGE_BATCHES)
                if not batches:
                    raise_kept_interrupt()
                    return
                batches.reverse()
                while batches:  # popped: a batch the loop is done with is not held here
                    batch = batches.pop()
                    step, stepped = stepped, 0.0
                    try:
                        consumer.deliver(self, batch, step)  # counts once the loop has it
                    except BaseException:
                        call_or_cancel(portal, self._fail)
                        raise
                    t0 = time.perf_counter()
                    yield batch
                    stepped = time.perf_counter() - t0
                    raise_kept_interrupt()  # a Ctrl-C that came while a batch was let go of
        finally:
            if stepped:  # the last batch's step: no batch after it to count it with
                consumer.stepped(stepped)
            if not self.done:  # left early (break) or failed in the loop's body
                with contextlib.suppress(Exception):  # the bridge may be gone already
                    call_or_cancel(portal, self.aclose)
