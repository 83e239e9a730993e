"""Leak checks: after a test, no task, busy thread or file descriptor of ours is left.

Used by every test through the autouse fixture in ``conftest.py``, and inside event loops by the
tests that check a layer released everything before the loop ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import h5py
import psutil

import asynchdf5

# Worker threads linger by design, idle, after their last job: anyio's asyncio backend keeps an
# idle "AnyIO worker thread" for up to ``WorkerThread.MAX_IDLE_TIME`` = 10 s (pruned only when a
# later job starts, and all stopped when the event loop's root task ends), and trio's thread cache
# keeps an idle "Trio thread N" for ``IDLE_TIMEOUT`` = 10 s, process-wide (anyio 4.16
# ``_backends/_asyncio.py``, trio 0.35 ``_core/_thread_cache.py``). Inside a running event loop we
# cannot wait them out in a fast test, so there the check is on *our* work instead: no thread that
# appeared during the test may still be running asynchdf5, h5py or this module's code (a
# transformer), and any other new thread — the layer's own pools, "asynchdf5-gather" and
# "asynchdf5-decode", included — must be gone. Where the event loop itself ends (the sync
# facade's own loop thread, on asyncio) every new thread must be gone.
_OUR_CODE = (
    str(Path(asynchdf5.__file__).parent),
    str(Path(h5py.__file__).parent),
    str(Path(__file__).parent),  # the tests: a transformer defined in one
)
_IDLE_POOL_NAME = re.compile(r"AnyIO worker thread|Trio thread \d+")
GRACE_S = 2.0


@dataclass(frozen=True)
class Snapshot:
    threads: frozenset[threading.Thread]
    fds: int | None
    tasks: frozenset[int] | None  # anyio task ids, inside an event loop


def _fd_count() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # pragma: no cover - not Linux
        return None


def _running_our_code(t: threading.Thread) -> bool:
    frame = sys._current_frames().get(t.ident or -1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_OUR_CODE):
            return True
        frame = frame.f_back
    return False


def snapshot() -> Snapshot:
    return Snapshot(frozenset(threading.enumerate()), _fd_count(), None)


async def asnapshot() -> Snapshot:
    tasks = frozenset(t.id for t in anyio.get_running_tasks())
    return Snapshot(frozenset(threading.enumerate()), _fd_count(), tasks)


def _leftovers(before: Snapshot, tasks: frozenset[int] | None, strict: bool) -> list[str]:
    problems = []
    for t in threading.enumerate():
        if t in before.threads or not t.is_alive():
            continue
        if not strict and _IDLE_POOL_NAME.fullmatch(t.name) and not _running_our_code(t):
            continue  # an idle pool worker, lingering by design (see above)
        problems.append(f"thread {t.name!r} (busy={_running_our_code(t)})")
    fds = _fd_count()
    if before.fds is not None and fds is not None and fds > before.fds:
        problems.append(f"{fds - before.fds} more open file descriptor(s): {_fd_names()}")
    if before.tasks is not None and tasks is not None and tasks - before.tasks:
        problems.append(f"{len(tasks - before.tasks)} more task(s)")
    return problems


def _fd_names() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since listed
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
    return out


def assert_released(before: Snapshot, *, strict: bool = True) -> None:
    """Outside an event loop: every thread and descriptor made since ``before`` is gone."""
    deadline = time.monotonic() + GRACE_S
    while (problems := _leftovers(before, None, strict)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not problems, problems


async def aassert_released(before: Snapshot) -> None:
    """Inside the event loop: no new task, no busy or unknown thread, no new descriptor."""
    deadline = time.monotonic() + GRACE_S
    while True:
        tasks = frozenset(t.id for t in anyio.get_running_tasks())
        problems = _leftovers(before, tasks, strict=False)
        if not problems or time.monotonic() >= deadline:
            break
        await anyio.sleep(0.01)
    assert not problems, problems


def helper_processes() -> list[psutil.Process]:
    """This process's ``process=True`` helper processes still alive."""
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if "asynchdf5._serve" in " ".join(p.cmdline() if p.is_running() else [])
    ]


def no_helper_left() -> None:
    """Wait (10 s at most) until no helper process of this process is alive; fail if one is."""
    deadline = time.monotonic() + 10
    while helper_processes() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not helper_processes()
