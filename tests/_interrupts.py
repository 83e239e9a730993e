"""Ctrl-C at every place: :func:`sweep` runs a trip with SIGINT raised at each place in turn
where CPython could run the handler, and checks an invariant after each run.

CPython runs a Python signal handler only as a function starts, at a jump back and once a call
has returned; a ``KeyboardInterrupt`` raised there can leave a lock held (as
``threading.Condition.__enter__`` returns) or an object made and not yet owned. The places are
found by tracing the trip's opcodes in the calling thread (``sys.settrace``), in the files named.
"""

from __future__ import annotations

import dis
import itertools
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["CALLS", "CHECKS", "TRIP_FILES", "sweep", "traced"]


def traced(*paths: str) -> tuple[str, ...]:
    """The files a sweep traces, each named by its path's last parts (``/``-separated, as a
    frame's file name ends)."""
    return tuple(os.path.join(*path.split("/")) for path in paths)


#: The files of the code a trip across the bridge runs in the caller's thread.
TRIP_FILES = traced(
    "asynchdf5/_sync.py",
    "asynchdf5/_interrupts.py",
    "asynchdf5/_layer.py",
    "threading.py",
    "concurrent/futures/_base.py",
    "asyncio/base_events.py",
    "contextlib.py",
    "signal.py",
)


#: Where the interpreter runs signal handlers: as a function starts, at a jump back, and once a
#: call has returned (CPython checks for pending calls there, and nowhere else).
CHECKS = {"RESUME", "JUMP_BACKWARD", "JUMP_ABSOLUTE"}
CALLS = {"CALL", "CALL_KW", "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_FUNCTION_EX", "CALL_METHOD"}


def sweep(
    trip: Callable[[], object],
    after: Callable[[int], None],
    files: tuple[str, ...] = TRIP_FILES,
) -> int:
    """Run ``trip`` with SIGINT raised at each place in turn where its code in this thread
    could take one (in ``files``: one place a run, ``after(n)`` after run ``n``) until a run
    ends before its n-th place: how many there were."""
    for n in itertools.count(1):
        reached = 0
        # Each running frame's last instruction, by the frame's id: holding the frames would
        # keep their locals (a generator, say) alive after they end, as no run without the
        # tracer does.
        ran: dict[int, str] = {}
        place = ""

        def trace(
            frame: FrameType, event: str, arg: Any, n: int = n, ran: dict[int, str] = ran
        ) -> Any:
            nonlocal reached, place
            if not frame.f_code.co_filename.endswith(files):
                return None  # not the trip's (a weakref's callback, say, run by the GC)
            frame.f_trace_opcodes = True
            key = id(frame)
            if event == "call":  # a frame starts, or a generator resumes
                ran.pop(key, None)
            elif event == "opcode":
                before, ran[key] = ran.get(key), dis.opname[frame.f_code.co_code[frame.f_lasti]]
                if before is None or before in CALLS or ran[key] in CHECKS:
                    reached += 1
                    if reached == n:
                        place = f"{frame.f_code.co_name} line {frame.f_lineno} ({ran[key]})"
                        signal.raise_signal(signal.SIGINT)
            return trace

        sys.settrace(trace)
        try:
            trip()
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        try:
            after(n)
        except Exception as exc:
            raise AssertionError(f"SIGINT at {place} (place {n}): {exc!r}") from None
        if reached < n:
            return n
    raise AssertionError("unreachable")
