"""The sync interface of the layers: ``with`` / ``for``, through one bridge.

A layer opened with ``with`` runs its async pipeline on an event loop in a background thread
(one anyio blocking portal per opening; ``backend=`` picks asyncio or trio). Every call crosses
that one bridge: opening and closing, and iterating, which takes at most :data:`BRIDGE_BATCHES`
batches that are already gathered per trip (never an epoch: nothing is collected ahead of what
the pipeline has ready). Batches are handed over (for a device: made ready on the current CUDA
stream) in the ``for`` loop's own thread, not the bridge's.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal

from ._batch import Batch
from ._errors import StateError
from ._iterator import EpochIterator

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover
    from typing_extensions import Self

__all__ = ["BRIDGE_BATCHES", "SyncInterface"]

#: Batches taken per trip across the bridge, at most (only those gathered already). A trip costs
#: about 0.1 ms on the 2-vCPU machines: tiny batches (32 of 24 bytes, ``MemoryDataLayer``, the
#: loop does nothing) cost 8.4 µs each at 16 a trip, 3.6 at 64, 2.4 at 256 (a group's most).
BRIDGE_BATCHES = 256


class SyncInterface:
    """``with`` / ``for`` for a layer whose async side provides ``_opened(sync=True)``."""

    _portal: BlockingPortal | None = None
    _portal_cm: Any = None
    _opening: Any = None

    def _opened(self, *, sync: bool) -> contextlib.AbstractAsyncContextManager[Any]:
        raise NotImplementedError

    def _backend(self) -> str:
        raise NotImplementedError

    def __enter__(self) -> Self:
        if self._portal is not None:
            raise StateError("the layer is already open")
        cm = start_blocking_portal(self._backend())
        portal = cm.__enter__()
        try:
            opening = portal.wrap_async_context_manager(self._opened(sync=True))
            opening.__enter__()
        except BaseException:
            cm.__exit__(*sys.exc_info())
            raise
        self._portal_cm, self._portal, self._opening = cm, portal, opening
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the pipeline and its event loop thread; release everything (idempotent)."""
        cm, opening = self._portal_cm, self._opening
        self._portal_cm = self._portal = self._opening = None
        if cm is None:
            return
        try:
            opening.__exit__(None, None, None)
        finally:
            cm.__exit__(None, None, None)

    def _iterate_sync(self, it: EpochIterator) -> Iterator[Batch]:
        portal = self._portal
        if portal is None:
            raise StateError("the layer is not open: iterate inside `with layer:`")
        it.bridged = True  # batches are handed over here, in the loop's thread
        return _bridged(portal, it)


def _bridged(portal: BlockingPortal, it: EpochIterator) -> Iterator[Batch]:
    delivery = portal.call(_delivery_of, it)
    try:
        while True:
            batches = portal.call(it.next_batches, BRIDGE_BATCHES)
            if not batches:
                return
            batches.reverse()
            while batches:  # popped: a batch the loop is done with is not held here
                batch = batches.pop()
                try:
                    delivery.hand_off(batch)
                except BaseException:
                    portal.call(it.fail)
                    raise
                it.yielded(batch)  # counts for state_dict() once the loop has it
                t0 = time.perf_counter()
                yield batch
                it.stepped(time.perf_counter() - t0)
    finally:
        if not it.done:  # left early (break) or failed in the loop's body
            with contextlib.suppress(Exception):  # the bridge may be gone already
                portal.call(it.aclose)


async def _delivery_of(it: EpochIterator) -> Any:
    """The delivery of ``it``'s session (which ``it`` binds to, on the loop's thread)."""
    session = it._owner._session_for(it)
    return session.delivery
