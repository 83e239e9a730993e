"""How often a consumer that never awaits lets the event loop run (:class:`Pace`).

A consumer takes ready batches without a trip through the event loop; one whose own step never
awaits would then keep every other task of the loop waiting for a whole epoch. So, after
:data:`PAUSE_EVERY_S` without one, taking a batch lets the loop run (and honours cancellation),
at the cost of two loop round trips, small beside that time.
"""

from __future__ import annotations

import time

import anyio
import anyio.lowlevel

__all__ = ["PAUSE_EVERY_S", "PAUSE_TIMER_S", "Pace"]

#: The longest a consumer that takes ready batches back to back keeps the event loop from other
#: tasks (those whose timers came due meanwhile too).
PAUSE_EVERY_S = 0.001
#: The timer the consumer waits for when it lets the loop run (see :meth:`Pace.pause`): past at
#: once.
PAUSE_TIMER_S = 1e-6


def _clock_runs(loop_elapsed: float, real_elapsed: float) -> bool:
    """Whether the event loop's clock moved about as real time did (0.5x to 2x): a virtual
    clock that stands still or only jumps (trio's ``MockClock``, as test suites use) would
    never fire the pause's timer, and the consumer would wait for it forever."""
    return 0.5 * real_elapsed <= loop_elapsed <= 2 * real_elapsed


class Pace:
    """When the consumer last let the event loop run, on both clocks."""

    def __init__(self) -> None:
        #: ``time.perf_counter()`` then.
        self.paused = time.perf_counter()
        self._paused_loop: float | None = None  # the event loop's clock then (None: unknown)

    def mark(self) -> float:
        """The event loop has just run other tasks: note when; returns the time."""
        self._paused_loop = anyio.current_time()
        self.paused = now = time.perf_counter()
        return now

    async def pause(self, now: float) -> None:
        """Let the other tasks of the loop run, if :data:`PAUSE_EVERY_S` passed without it.

        Tasks whose timers came due during the consumer's step are not ready yet: on asyncio a
        timer completes a future, which then queues its task, behind us. Waiting for a timer of
        our own lets every timer due before it fire first, and the checkpoint after it lets the
        tasks they woke run (on trio, whatever order a batch of tasks runs in). Only where the
        loop's clock runs: no timer comes due on one that stands still.
        """
        if now - self.paused < PAUSE_EVERY_S:
            return
        then = self._paused_loop
        if then is not None:
            # Both clocks read here, side by side: the caller's ``now`` may be long past on a
            # loaded machine (the process descheduled since), and would make the loop's clock
            # look fast, skipping the timer that lets the due tasks run first.
            loop_elapsed = anyio.current_time() - then
            if _clock_runs(loop_elapsed, time.perf_counter() - self.paused):
                await anyio.sleep(PAUSE_TIMER_S)
        await anyio.lowlevel.checkpoint()
        self.mark()
