"""The clock of :mod:`benchmarks.step_cost`: the step, and what it measures around it.

A step is pure Python that holds the GIL throughout; around it, the clock takes the step's wall
and CPU time, the main thread's context switches and page faults (``getrusage(RUSAGE_THREAD)``,
which does not release the GIL, so measuring adds no switch point the loader's threads could
use), the CPU it ran on (``sched_getcpu``, called with the GIL held), and, at the start and end
of a run only, every thread's CPU time and switches (from ``/proc``).

The CPU matters on a virtual machine: its virtual CPUs need not run at the same speed (the host
shares their cores with other guests), and a loader's threads move the main thread between
them, so a step's time depends on where it ran as much as on the loader. Hence the ratio of
loader to free steps taken on the same CPU (:meth:`Clock.summary`).
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Clock", "calibrate", "python_step", "thread_sched", "threads_delta", "threads_snapshot"]

RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # Linux: the thread

# --------------------------------------------------------------------------------------------
# The step


def python_step(data: npt.NDArray[Any], label: npt.NDArray[Any], iterations: int) -> int:
    """A training step's Python: the GIL held throughout (no sleep, no call that releases it),
    ``iterations`` rounds of integer arithmetic, then a read of a few values of the batch."""
    acc = 0
    for i in range(iterations):
        acc += (i * i) & 7
    n = len(label)
    for k in (0, n // 3, n // 2, n - 1):
        acc += int(data[k, 0, 0, 0]) + int(label[k])
    return acc


def calibrate(step_ms: float, batch: int, shape: tuple[int, ...]) -> int:
    """Iterations of :func:`python_step` that take ``step_ms`` (median of a few tries)."""
    d = np.zeros((batch, *shape), np.uint8)
    label = np.zeros(batch, np.int64)
    iterations = 10_000
    for _ in range(3):
        times = []
        for _ in range(15):
            t = time.perf_counter()
            python_step(d, label, iterations)
            times.append(time.perf_counter() - t)
        per = float(np.median(times)) / iterations
        iterations = max(1, round(step_ms / 1e3 / per))
    return iterations


# --------------------------------------------------------------------------------------------
# Driving the step (in the child process)


def _cpu_getter() -> Any:
    """glibc's ``sched_getcpu`` through ``PyDLL`` (which keeps the GIL, unlike ``CDLL``), or
    ``None`` where there is none."""
    try:
        getcpu = ctypes.PyDLL(None).sched_getcpu
    except (AttributeError, OSError):
        return None
    getcpu.restype, getcpu.argtypes = ctypes.c_int, []
    return getcpu


_GETCPU = _cpu_getter()


def current_cpu() -> int:
    """The CPU the calling thread runs on, without releasing the GIL; -1 where unknown."""
    return int(_GETCPU()) if _GETCPU is not None else -1


def thread_sched() -> tuple[float, float, int, int]:
    """The calling thread's run-queue wait (s) and its CPU time (s) from ``schedstat``, and its
    voluntary and involuntary context switches (Linux; zeros elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns, _ = (int(x) for x in f.read().split())
        with open("/proc/thread-self/status") as f:
            fields = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
    except OSError:
        return 0.0, 0.0, 0, 0
    return (
        wait_ns / 1e9,
        run_ns / 1e9,
        int(fields["voluntary_ctxt_switches"]),
        int(fields["nonvoluntary_ctxt_switches"]),
    )


def threads_snapshot() -> dict[str, list[float]]:
    """Per thread of this process (by Python name, else ``tid N``): CPU seconds, voluntary and
    involuntary context switches, summed over threads of the same name (Linux; else empty)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, list[float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run_ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        except (OSError, ValueError):
            continue
        name = names.get(int(tid), f"tid {tid}")
        name = re.sub(r"[-_ ]?[0-9a-f]*[0-9][0-9a-f]*$", "", name) or name  # pools as one
        row = out.setdefault(name, [0.0, 0.0, 0.0, 0.0])
        row[0] += run_ns / 1e9
        row[1] += int(fields["voluntary_ctxt_switches"])
        row[2] += int(fields["nonvoluntary_ctxt_switches"])
        row[3] += 1
    return out


def threads_delta(
    before: dict[str, list[float]], after: dict[str, list[float]], batches: int
) -> dict[str, dict[str, float]]:
    """Per thread name over a run: CPU seconds, and switches per batch."""
    out = {}
    for name, row in after.items():
        b = before.get(name, [0.0, 0.0, 0.0, 0.0])
        out[name] = {
            "threads": row[3],
            "cpu_s": row[0] - b[0],
            "voluntary_per_batch": (row[1] - b[1]) / batches,
            "involuntary_per_batch": (row[2] - b[2]) / batches,
        }
    return out


class Clock:
    """Per-step wall and CPU times, the waits for batches, and the main thread's scheduling
    counters over one run of ``steps`` steps (first batch to last step), taken in blocks
    (:meth:`add_block`: each block's wall time, the waits for batches in it, and the main
    thread's CPU time, steps and waits together)."""

    def __init__(self, steps: int) -> None:
        self.step_s = np.empty(steps)
        self.cpu_s = np.empty(steps)
        self.blocked = np.zeros(steps, np.int64)  # voluntary switches in the step: GIL waits
        self.preempted = np.zeros(steps, np.int64)  # involuntary switches in the step
        self.faults = np.zeros(steps, np.int64)  # page faults of the main thread in the step
        self.cpu = np.full(steps, -1, np.int64)  # the CPU the step ran on (-1: moved, unknown)
        self.wait_s = np.zeros(steps)
        self.started = self.first = self.end = 0.0
        self.sched0 = self.sched1 = (0.0, 0.0, 0, 0)
        self.threads0: dict[str, list[float]] = {}
        self.threads1: dict[str, list[float]] = {}
        self.wall_s = 0.0  # the blocks' wall time
        self.block_cpu_s = 0.0  # the main thread's CPU time in the blocks

    def add_block(self, wall_s: float, cpu_s: float) -> None:
        """Count one block of steps: its wall time and the main thread's CPU time in it."""
        self.wall_s += wall_s
        self.block_cpu_s += cpu_s

    def step(self, k: int, d: npt.NDArray[Any], label: npt.NDArray[Any], iterations: int) -> None:
        # getrusage keeps the GIL (a file read would let the loader's threads in here).
        r0 = resource.getrusage(RUSAGE_THREAD)
        cpu = current_cpu()
        t, c = time.perf_counter(), time.thread_time()
        python_step(d, label, iterations)
        self.cpu_s[k] = time.thread_time() - c
        self.step_s[k] = time.perf_counter() - t
        self.cpu[k] = cpu if current_cpu() == cpu else -1
        r1 = resource.getrusage(RUSAGE_THREAD)
        self.blocked[k] = r1.ru_nvcsw - r0.ru_nvcsw
        self.preempted[k] = r1.ru_nivcsw - r0.ru_nivcsw
        self.faults[k] = r1.ru_minflt - r0.ru_minflt + r1.ru_majflt - r0.ru_majflt

    def same_cpu_ratio(self, free: Clock) -> float:
        """The median step over the free median step on the same CPU, weighted by this clock's
        steps on each CPU (CPUs where either clock has fewer than 10 steps left out); NaN where
        none is left."""
        num = den = 0.0
        for c in np.unique(self.cpu[self.cpu >= 0]):
            mine, theirs = self.step_s[self.cpu == c], free.step_s[free.cpu == c]
            if len(mine) >= 10 and len(theirs) >= 10:
                num += len(mine) * float(np.median(mine)) / float(np.median(theirs))
                den += len(mine)
        return num / den if den else float("nan")

    def summary(self, free: Clock | None = None) -> dict[str, Any]:
        steps = len(self.step_s)
        wall = self.wall_s
        median = float(np.median(self.step_s))
        ref = float(np.median(free.step_s)) if free is not None else median
        ref_cpu = float(np.median(free.cpu_s)) if free is not None else float(np.median(self.cpu_s))
        off = self.step_s - self.cpu_s
        # Off-CPU time of the steps that were not preempted: the GIL waits, nothing else.
        calm = self.preempted == 0
        gil_ms = float(off[calm].mean()) * 1e3 if calm.any() else float("nan")
        return {
            "first_batch_s": self.first - self.started,
            "step_median_ms": median * 1e3,
            "step_p90_ms": float(np.percentile(self.step_s, 90)) * 1e3,
            "cpu_median_ms": float(np.median(self.cpu_s)) * 1e3,
            "off_cpu_median_ms": float(np.median(off)) * 1e3,
            "off_cpu_total_s": float(off.sum()),
            "gil_waits_per_step": float(self.blocked.mean()),
            "steps_with_gil_wait": float((self.blocked > 0).mean()),
            "gil_wait_ms_per_step": gil_ms,
            "preempted_steps": float((self.preempted > 0).mean()),
            "faults_per_step": float(self.faults.mean()),
            "steps_with_fault": float((self.faults > 0).mean()),
            "steps_per_cpu": {str(c): int((self.cpu == c).sum()) for c in np.unique(self.cpu)},
            "same_cpu_ratio": self.same_cpu_ratio(free) if free is not None else 1.0,
            "wait_total_s": float(self.wait_s.sum()),
            "wait_p90_ms": float(np.percentile(self.wait_s, 90)) * 1e3,
            "wall_s": wall,
            "median_ratio": median / ref,
            "p90_ratio": float(np.percentile(self.step_s, 90)) / ref,
            "cpu_ratio": float(np.median(self.cpu_s)) / ref_cpu,
            "epoch_ratio": wall / (steps * ref),
            "runqueue_wait_s": self.sched1[0] - self.sched0[0],
            "voluntary_switches": self.sched1[2] - self.sched0[2],
            "involuntary_switches": self.sched1[3] - self.sched0[3],
            "threads": threads_delta(self.threads0, self.threads1, steps),
        }
