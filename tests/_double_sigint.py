"""Trials of a double Ctrl-C in a sync loop, run by ``tests/test_sync.py`` as a script.

``python tests/_double_sigint.py SOURCE TRIALS SEED [process [slow-free]]`` imports the
package once, then forks one child per trial (``process``: its layer runs with ``process=True``;
``slow-free``: each slot it gives back to its helper takes 30 ms more, which widens the window
of an interrupt that lands in the finalizer giving it back). The
child opens ``HDF5DataLayer(SOURCE)`` with ``with``, says it is ready, and streams epochs with
``for``; it runs at module level, so an uncaught
``KeyboardInterrupt`` ends it as it ends any script (threads joined, then killed by SIGINT). The
parent sends it two SIGINTs a random 0.2-8 ms apart at a random moment of the loop, waits up to
``DEADLINE`` seconds, and prints one line per trial: ``ok``, ``hung``, ``did-not-start`` or
``status N``. A child
that hung has its threads' stacks written to stderr (faulthandler, on SIGUSR1) before it is
killed: what a failing run shows.
"""

from __future__ import annotations

import faulthandler
import os
import random
import select
import signal
import sys
import tempfile
import time
from typing import Any

from asynchdf5 import HDF5DataLayer

DEADLINE = 10.0  # seconds from the second SIGINT to the child's exit
#: Seconds for the child to open its layer and say it is ready: not what the trials test, and
#: on a loaded 2-core machine starting a ``process=True`` helper took more than ``DEADLINE``.
START_DEADLINE = 60.0


def _wait(pid: int, deadline: float) -> int | None:
    """The child's wait status, or None if it is still alive at ``deadline``."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            return None
        time.sleep(0.005)


def _parent(pid: int, ready: int, rng: random.Random, stacks: str) -> str:
    status = None
    try:
        if not select.select([ready], [], [], START_DEADLINE)[0] or os.read(ready, 1) != b"r":
            return "did-not-start"
        time.sleep(rng.uniform(0.0, 0.03))  # a random moment of the streaming loop
        os.kill(pid, signal.SIGINT)
        time.sleep(rng.uniform(0.0002, 0.008))
        os.kill(pid, signal.SIGINT)
        status = _wait(pid, time.monotonic() + DEADLINE)
        if status is None:
            os.kill(pid, signal.SIGUSR1)  # the child's stacks, into ``stacks``
            time.sleep(1.0)
            with open(stacks) as f:
                print(f"a hung trial's threads:\n{f.read()}", file=sys.stderr, flush=True)
            return "hung"
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT:
            return "ok"  # as an uncaught KeyboardInterrupt ends a script
        return f"status {status}"
    finally:
        os.close(ready)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


if __name__ == "__main__":
    source, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    stacks_fd, stacks = tempfile.mkstemp(prefix="double-sigint-", suffix=".txt")
    for _ in range(trials):
        ready, tell = os.pipe()
        os.ftruncate(stacks_fd, 0)
        os.lseek(stacks_fd, 0, os.SEEK_SET)
        pid = os.fork()
        if pid == 0:
            os.close(ready)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the tracebacks of the interrupts
            faulthandler.register(signal.SIGUSR1, file=stacks_fd, all_threads=True)
            break
        os.close(tell)
        print(_parent(pid, ready, rng, stacks), flush=True)
    else:
        os.close(stacks_fd)
        os.unlink(stacks)
        sys.exit(0)
    # The child (the loop above was left by `break`).
    process = sys.argv[4:5] == ["process"]  # the pipeline in a helper process (process=True)
    if sys.argv[5:] == ["slow-free"]:
        from asynchdf5._process import _parent as helper_side
        from asynchdf5._process import send

        def slow_send(sock: Any, message: tuple[Any, ...], fd: int | None = None) -> None:
            if message[0] == "free":
                time.sleep(0.03)
            send(sock, message, fd)

        helper_side.__dict__["send"] = slow_send  # what the layer side of process=True calls
    with HDF5DataLayer(source, batch_size=10, chunk_size=40, shuffle=True, process=process) as L:
        os.write(tell, b"r")
        os.close(tell)
        while True:
            for _batch in L:
                pass
