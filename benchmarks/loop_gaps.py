"""Event-loop gaps while the consumer trains (``python -m benchmarks run loop-gaps``).

A task that sleeps 1 ms in a loop records the gaps between its wake-ups while ``async for``
streams the image file. The CPU step runs on the event loop's thread, as a training step written
in the coroutine would. ``full GCs`` (in the notes): the collector's full passes, which stop the
event loop for as long as the heap takes to walk.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import numpy as np

from benchmarks import sources
from benchmarks.data import DatasetFiles
from benchmarks.layer_runs import (
    Array,
    Sizes,
    image_layer_kwargs,
    image_set,
    rate,
    run_async,
    sizes,
)
from benchmarks.measure import describe
from benchmarks.probes import IDLE_S, TICK_S, gap_stats
from benchmarks.report import Recorder


def _cpu_step(seconds: float, scratch: Array) -> None:
    """~``seconds`` of work that holds the GIL: a small NumPy op in a loop (too small for NumPy
    to release the GIL), as a Python-side training step would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.multiply(scratch, 1.000001, out=scratch)


@contextlib.contextmanager
def _full_collections() -> Iterator[list[float]]:
    """The durations (s) of the garbage collector's full (generation 2) passes meanwhile: they
    stop every thread that needs the GIL, the event loop's too, for as long as the process's
    heap takes to walk (10-20 ms for this benchmark's ~40,000 objects on the 2-vCPU VMs)."""
    out: list[float] = []
    started: list[float] = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                out.append(time.perf_counter() - started.pop())

    gc.callbacks.append(note)
    try:
        yield out
    finally:
        gc.callbacks.remove(note)


async def _probe_run(
    kwargs: dict[str, Any], consumer: str, step_s: float, max_batches: int, epochs: int = 1
) -> tuple[dict[str, float], dict[str, float], dict[str, float], float, int, list[float]]:
    """One opening of ``epochs`` epochs beside the ticker: the gaps before it (the idle floor),
    in its first epoch (opening included), in the later ones; seconds and samples in all; the
    full garbage collections of the opening (their durations)."""
    import asynchdf5

    gaps: list[float] = []
    running = True
    scratch = np.ones(16, np.float64)

    async def ticker() -> None:
        last = time.perf_counter()
        while running:
            await anyio.sleep(TICK_S)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    samples = 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(IDLE_S)
        idle = len(gaps)
        later = None  # where the second epoch's gaps begin
        t0 = time.perf_counter()
        with _full_collections() as collections:
            async with asynchdf5.AsyncHDF5DataLayer(**kwargs) as layer:
                for epoch in range(epochs):
                    if epoch == 1:
                        later = len(gaps)
                    taken = 0
                    async for batch in layer:
                        taken += batch.size
                        if consumer == "sleep":
                            await anyio.sleep(step_s)
                        elif consumer == "cpu":
                            _cpu_step(step_s, scratch)
                        if max_batches and taken >= max_batches * kwargs["batch_size"]:
                            break
                    samples += taken
        elapsed = time.perf_counter() - t0
        running = False
    first = gaps[idle:later]
    rest = gaps[later:] if later is not None else []
    stats = gap_stats(gaps[:idle]), gap_stats(first), gap_stats(rest)
    return (*stats, elapsed, samples, collections)


#: A process that spins until its standard input closes: when the benchmark ends, however it
#: ends (the hard stop's ``_exit`` included), its end of the pipe closes and the spinner exits.
_SPINNER = (
    "import os, sys, threading\n"
    "threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()\n"
    "while True: pass\n"
)


@contextlib.contextmanager
def _busy_processes(n: int) -> Iterator[None]:
    """``n`` other Python processes spinning on a core each (this process's priority, same
    session): other ranks of a job, another job's workers, a compile."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _SPINNER], stdin=subprocess.PIPE))
        time.sleep(0.2)  # running before the layer opens
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()


@contextlib.contextmanager
def _nice_setting(value: str) -> Iterator[None]:
    """``ASYNCHDF5_NICE=value`` while the layers made meanwhile start their threads."""
    before = os.environ.get("ASYNCHDF5_NICE")
    os.environ["ASYNCHDF5_NICE"] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ["ASYNCHDF5_NICE"]
        else:
            os.environ["ASYNCHDF5_NICE"] = before


def _fmt_gcs(durations: list[float]) -> str:
    return f"{len(durations)} ({max(durations) * 1e3:.1f})" if durations else "0"


def loop_gaps(rec: Recorder, cfg: Sizes, files: DatasetFiles) -> None:
    """Gaps of a 1 ms ticker while ``async for`` streams the image file (the streaming
    configuration of ``ceilings``) to a consumer that does nothing, awaits a simulated GPU step
    or holds the GIL for ``cfg.step_s`` per batch, with the pipeline's threads at the process's
    priority and below it (``ASYNCHDF5_NICE``); the first epoch (opening and ramp) apart from
    the later ones (steady state); then beside one busy process per core."""
    kwargs = image_layer_kwargs(files, cfg)
    # none: the consumer does nothing; sleep: `await anyio.sleep(step_s)` (a GPU-style step);
    # cpu: step_s of GIL-holding work on the event loop's thread.
    for backend in cfg.probe_backends:
        for consumer in cfg.probe_consumers:
            for nice in cfg.probe_nice:  # alternating, so that both see the same machine
                sources.warm(files)
                try:
                    with _nice_setting(nice):
                        idle, busy, steady, elapsed, samples, full_gcs = run_async(
                            partial(
                                _probe_run,
                                kwargs,
                                consumer,
                                cfg.step_s,
                                cfg.probe_batches,
                                cfg.probe_epochs,
                            ),
                            cfg.deadline_s,
                            backend,
                        )
                except Exception as exc:
                    rec.note(f"{backend}, {consumer}, nice {nice}: failed: {describe(exc)}")
                    continue
                what = f"{backend}, consumer {consumer}, ASYNCHDF5_NICE={nice}"
                rec.figure(f"{what}: epoch 1 gap p99", busy.get("p99_ms"), "ms")
                rec.figure(f"{what}: epoch 1 gap max", busy.get("max_ms"), "ms")
                rec.figure(f"{what}: later epochs gap p99", steady.get("p99_ms"), "ms")
                rec.figure(f"{what}: later epochs gap max", steady.get("max_ms"), "ms")
                rec.figure(f"{what}: idle gap p99", idle.get("p99_ms"), "ms")
                rec.figure(f"{what}: samples/s", rate(samples, elapsed), "samples/s")
                rec.note(f"{what}: full GCs (longest ms): {_fmt_gcs(full_gcs)}")
    busy_n = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    for nice in cfg.busy_nice:
        sources.warm(files)
        try:
            with _nice_setting(nice), _busy_processes(busy_n):
                _, busy, _, elapsed, samples, _ = run_async(
                    partial(_probe_run, kwargs, "none", cfg.step_s, cfg.probe_batches),
                    cfg.deadline_s,
                )
        except Exception as exc:
            rec.note(f"beside {busy_n} busy processes, nice {nice}: failed: {describe(exc)}")
            continue
        what = f"beside {busy_n} busy processes, ASYNCHDF5_NICE={nice}"
        rec.figure(f"{what}: gap p99", busy.get("p99_ms"), "ms")
        rec.figure(f"{what}: gap max", busy.get("max_ms"), "ms")
        rec.figure(f"{what}: samples/s", rate(samples, elapsed), "samples/s")


def bench(rec: Recorder) -> None:
    """The measurement on the suite's image set at this run's size."""
    cfg = sizes(rec)
    rec.param(samples=cfg.image_samples, chunk=cfg.image_chunk, step_s=cfg.step_s,
              probe_batches=cfg.probe_batches, probe_epochs=cfg.probe_epochs)  # fmt: skip
    loop_gaps(rec, cfg, image_set(cfg))
