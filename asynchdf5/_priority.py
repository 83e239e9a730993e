"""An opt-in: the pipeline's bulk-work threads below the consumer's scheduling priority (Linux).

A streaming layer keeps more threads busy than a small machine has cores: the reads (the copy out
of the page cache), the gather, decompression. The consumer's thread, which runs the training step
and the event loop, then waits in the kernel's run queue behind them, and the event loop's long
gaps are that wait. With ``ASYNCHDF5_NICE=N`` (1 to 19), threads
started by asynchdf5 for bulk work lower their own priority by ``N`` nice steps, so that a busy
core goes to the consumer first and to them otherwise.

Not the default (:data:`DEFAULT_STEPS` is 0): a nice value is not relative to the consumer only
but to every thread on the machine (every one in the same session, with autogroup scheduling).
Beside other busy processes (other ranks of a job, another job's workers) the lowered threads
get a fraction of a core, and the consumer's thread waits on the GIL that a preempted one holds:
an epoch then takes several times as long, with longer loop gaps, not shorter. On a machine
that runs nothing else it shortens the gaps (docs/design-notes.md has the figures).

Linux only: elsewhere (and where the kernel refuses), nothing changes. A thread's nice value is
set once, when it starts, relative to the process's main thread, and only ever raised: an
unprivileged process cannot take it back down. Threads that are not ours (anyio's worker
threads, which the application shares) are never changed; and since a thread inherits its
creator's priority, the gather thread keeps the consumer's when it runs code that is not ours
(transformers, a device library), which may start thread pools of its own there.
"""

from __future__ import annotations

import functools
import os
import sys
import threading

from ._errors import ConfigurationError

__all__ = ["VARIABLE", "background", "nice_steps"]

#: The environment variable that sets how many nice steps below the main thread they run.
VARIABLE = "ASYNCHDF5_NICE"
#: Nice steps by default: none (see the module docstring). With 10, a thread of ours has about a
#: tenth of the CPU share of a thread at the main thread's priority when they compete for a core.
DEFAULT_STEPS = 0


@functools.cache
def _parse(raw: str) -> int:
    try:
        steps = int(raw)
    except ValueError:
        steps = -1
    if not 0 <= steps <= 19:
        raise ConfigurationError(f"{VARIABLE}={raw!r}: expected a whole number from 0 to 19")
    return steps


def nice_steps() -> int:
    """How many nice steps below the main thread the pipeline's threads run;
    :class:`~asynchdf5.ConfigurationError` when ``ASYNCHDF5_NICE`` is not a number from 0 to 19.
    Called when a layer opens, so that a bad value fails there."""
    raw = os.environ.get(VARIABLE, "").strip()
    return _parse(raw) if raw else DEFAULT_STEPS


def background() -> None:
    """Lower the calling thread's priority (see the module docstring); call it first thing in a
    thread of ours, or as a thread pool's ``initializer``."""
    if not sys.platform.startswith("linux"):
        return
    try:
        steps = nice_steps()
    except ConfigurationError:  # reported when the layer opened; not here, in a thread
        steps = DEFAULT_STEPS
    if steps == 0:
        return
    try:
        # The main thread's id is the process id; PRIO_PROCESS with a thread id is that thread.
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + steps)
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError:  # a kernel or sandbox that refuses: priorities stay as they are
        pass
