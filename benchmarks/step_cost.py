"""What a loader costs the training step beside it (``python -m benchmarks.step_cost``).

A GPU job's step is mostly Python that holds the GIL (kernel launches, optimizer bookkeeping);
loader threads in the same process take GIL time and cores from it. This benchmark runs a fixed
step, pure Python calibrated to ``--step-ms`` plus a read of a few values of the batch, fed by
each loader in a fresh process per loader and repeat, on a warm (page-cached) image set, and
interleaved in the same process with as many *free* steps (one pre-made batch, reused), in
blocks of ``--block`` steps in alternating order (free-loader, loader-free, ...): the machine's
speed drifts by more than the costs measured here (a shared host), and a drift weighs on both
kinds of steps alike this way. A free block starts while the loader refills its prefetch (a
batch or two of its work); the medians do not see those steps.

It reports, per loader, the median and p90 of the loader's steps divided by the median of the
free steps (median over the repeats, and their range), the median over rounds of the same ratio
within one round (a free block and a loader block), the main thread's CPU time per step (step
and ``next()`` together) beyond the free steps', and the wall time of the loader's blocks (its
waits for batches included, start-up excluded) divided by ``steps x free median`` and by the free
blocks' wall time: whether it keeps up (flattered for a loader that does not: it refills its
prefetch during the free blocks).

Loaders (``--loaders``):

* ``free``: the free batch again, for the noise floor of the ratios;
* ``layer``: :class:`asynchdf5.HDF5DataLayer`, plain ``for``;
* ``async``: :class:`asynchdf5.AsyncHDF5DataLayer`, ``async for`` on asyncio (the step runs in
  the coroutine, as a training coroutine would);
* ``torch``: :class:`asynchdf5.torch.HDF5IterableDataset` through
  ``DataLoader(batch_size=None, num_workers=0)``;
* ``dataloader``: PyTorch ``DataLoader`` over h5py, 2 workers, a random batch sampler with one
  sorted fancy-index read per top and batch (:mod:`benchmarks.torch_loaders`);
* ``shm``: the pipeline in one helper process (the SPDL way): the process runs ``HDF5DataLayer``
  and copies each batch into a ring of shared-memory slots; the trainer reads NumPy views of a
  slot and hands it back, with a few bytes over a pipe each way (:mod:`benchmarks.shm_ring`);
* ``process``: the library's own helper process, ``HDF5DataLayer(..., process=True)``, plain
  ``for``;
* ``async_process``: ``AsyncHDF5DataLayer(..., process=True)``, ``async for`` on asyncio;
* ``torch_process``: ``asynchdf5.torch`` with ``process=True``, ``num_workers=0``;
* ``lightning``: what a ``lightning.Trainer`` iterates: ``asynchdf5.torch.StatefulDataLoader``
  over the dataset, in Lightning's ``CombinedLoader`` (the Trainer's own hooks not included);
* ``keras``: :class:`asynchdf5.keras.PyDataset` through Keras's adapter and JAX iterator (what
  ``model.fit`` iterates on the JAX backend, CPU), its ``Position`` callback told of each batch;
* ``jax``: :class:`asynchdf5.jax.Loader` over :func:`asynchdf5.jax.layer`, on the CPU device;
* ``lightning_free``, ``keras_free``, ``jax_free``: the same client fed the free batch (a plain
  ``IterableDataset`` in the same loaders; a plain ``keras.utils.PyDataset`` through the same
  adapter; ``jax.device_put`` of the free batch each step): what the client's own machinery
  costs, whatever the loader. The loader's cost through a client is its row over the client's
  free row.

A client loader whose packages are not installed (:data:`~.step_cost_loaders.NEEDS`) is skipped,
with a note saying what it needs.

Every asynchdf5 loader uses default properties with ``shuffle=True, seed=0``, ``chunk_size``
``--chunk-size`` and batches of 256. ``--switch-interval`` sets ``sys.setswitchinterval`` in the
measuring processes (Python's default 5 ms); ``ASYNCHDF5_NICE`` in the environment reaches them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from benchmarks import data, page_cache
from benchmarks.config import DEFAULT_DATA_DIR, IMAGE_SHAPE, DatasetSpec
from benchmarks.step_clock import Clock, calibrate, thread_sched, threads_snapshot
from benchmarks.step_cost_loaders import (
    BATCH,
    ENV,
    LAYER_OPTIONS,
    LOADERS,
    NEEDS,
    SYNC,
    Pair,
    async_batches,
    free_batches,
)

__all__ = ["LOADERS", "main"]

FULL = {"samples": 327_680, "chunk_size": 2**17, "steps": 1000}  # 1.01 GB
QUICK = {"samples": 6_656, "chunk_size": 2**11, "steps": 40}  # 20.5 MB
CHILD_MARK = "STEP_COST_RESULT "


# --------------------------------------------------------------------------------------------
# The child: the free step, then the step fed by one loader (:mod:`benchmarks.step_cost_loaders`)


#: ``--yield-us``: the trainer sleeps this long before asking for each batch (0: not at all).
YIELD_S = 0.0


def rounds(steps: int, block: int) -> Iterator[tuple[int, int, bool]]:
    """``(first step, steps, free block first)`` of each round: a free block and a loader block
    of ``block`` steps each, in alternating order (ABBA), so that a drift of the machine's speed
    within a round weighs on both kinds alike."""
    for r, k in enumerate(range(0, steps, block)):
        yield k, min(block, steps - k), r % 2 == 0


def free_block(clock: Clock, free: Iterator[Pair], k: int, n: int, iterations: int) -> None:
    """Steps ``k`` to ``k + n`` on the free batch (a trivial iterator, as a loader is asked)."""
    t, c = time.perf_counter(), time.thread_time()
    for j in range(k, k + n):
        d, label = next(free)
        clock.step(j, d, label, iterations)
    clock.add_block(time.perf_counter() - t, time.thread_time() - c)


def warm_up(iterations: int, block: int) -> None:
    """Free steps before the loader exists, so that neither kind pays the interpreter's and
    the caches' first steps."""
    free, clock = free_batches(), Clock(2 * block)
    free_block(clock, free, 0, 2 * block, iterations)


def _steps(steps: int, iterations: int, block: int) -> Generator[None, Pair, tuple[Clock, Clock]]:
    """The loop of :func:`drive` and :func:`drive_async`, one for both: it yields where it
    takes the loader's next batch and is sent that batch (timed from before the yield to after
    it); it returns the loader's clock and the free one."""
    warm_up(iterations, block)
    clock, free_clock, free = Clock(steps), Clock(steps), free_batches()
    clock.started = time.perf_counter()
    d, label = yield
    clock.threads0 = threads_snapshot()
    clock.sched0 = thread_sched()
    clock.first = time.perf_counter()
    for k, n, free_first in rounds(steps, block):
        if free_first:
            free_block(free_clock, free, k, n, iterations)
        t, c = time.perf_counter(), time.thread_time()
        for j in range(k, k + n):
            if j:
                w = time.perf_counter()
                if YIELD_S:
                    time.sleep(YIELD_S)
                d, label = yield
                clock.wait_s[j] = time.perf_counter() - w
            clock.step(j, d, label, iterations)
        clock.add_block(time.perf_counter() - t, time.thread_time() - c)
        if not free_first:
            free_block(free_clock, free, k, n, iterations)
    clock.end = time.perf_counter()
    clock.sched1 = thread_sched()
    clock.threads1 = threads_snapshot()
    return clock, free_clock


def drive(batches: Iterator[Pair], steps: int, iterations: int, block: int) -> tuple[Clock, Clock]:
    """``steps`` steps fed by ``batches`` interleaved with as many free steps, in blocks (see
    :func:`rounds`): the loader's clock and the free one."""
    loop = _steps(steps, iterations, block)
    next(loop)
    try:
        while True:
            pair = next(batches)
            try:
                loop.send(pair)
            except StopIteration as done:
                clocks: tuple[Clock, Clock] = done.value
                return clocks
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


async def drive_async(
    batches: AsyncIterator[Pair], steps: int, iterations: int, block: int
) -> tuple[Clock, Clock]:
    """:func:`drive` for ``async for``: the steps run in the coroutine."""
    loop = _steps(steps, iterations, block)
    next(loop)
    try:
        while True:
            pair = await anext(batches)
            try:
                loop.send(pair)
            except StopIteration as done:
                clocks: tuple[Clock, Clock] = done.value
                return clocks
    finally:
        await batches.aclose()  # type: ignore[attr-defined]


def round_ratios(clock: Clock, free: Clock, steps: int, block: int) -> npt.NDArray[np.float64]:
    """Per round, the loader's median step over the free median step of the same round."""
    return np.array(
        [
            np.median(clock.step_s[k : k + n]) / np.median(free.step_s[k : k + n])
            for k, n, _ in rounds(steps, block)
        ]
    )


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One loader's run: its steps interleaved with free steps, in blocks."""
    global YIELD_S
    if spec["switch_interval_ms"]:
        sys.setswitchinterval(spec["switch_interval_ms"] / 1e3)
    LAYER_OPTIONS.update(spec["layer"])
    YIELD_S = spec["yield_us"] / 1e6
    steps, iterations, block = spec["steps"], spec["iterations"], spec["block"]
    cpu0, load0 = os.times(), os.getloadavg()
    name, source, chunk = spec["loader"], spec["source"], spec["chunk_size"]
    if name in ("async", "async_process"):
        extra = {"process": True} if name == "async_process" else {}
        batches = async_batches(source, chunk, **extra)
        clock, free = asyncio.run(drive_async(batches, steps, iterations, block))
    else:
        clock, free = drive(SYNC[name](source, chunk), steps, iterations, block)
    cpu1 = os.times()
    ratios = round_ratios(clock, free, steps, block)
    return (
        {
            "loader": name,
            "repeat": spec["repeat"],
            "free": free.summary(),
            "free_median_ms": float(np.median(free.step_s)) * 1e3,
            "round_ratio_median": float(np.median(ratios)),
            "round_ratio_iqr": [float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))],
            "main_cpu_per_step_ms": clock.block_cpu_s / steps * 1e3,
            "free_main_cpu_per_step_ms": free.block_cpu_s / steps * 1e3,
            "cpu_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
            "children_cpu_s": (cpu1.children_user + cpu1.children_system)
            - (cpu0.children_user + cpu0.children_system),
            "load_start": load0[0],
            "load_end": os.getloadavg()[0],
        }
        | clock.summary(free)
        | {"free_epoch_ratio": clock.wall_s / free.wall_s}
    )


# --------------------------------------------------------------------------------------------
# The parent: data, calibration, one child per loader and repeat, the report


def run_child(spec: dict[str, Any], files: data.DatasetFiles, timeout: float) -> dict[str, Any]:
    env = (
        os.environ | {"STEP_COST_FILES": json.dumps(files.to_json())} | ENV.get(spec["loader"], {})
    )
    cmd = [sys.executable, "-m", "benchmarks.step_cost", "--child", json.dumps(spec)]
    root = Path(__file__).resolve().parent.parent
    try:
        proc = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"loader": spec["loader"], "repeat": spec["repeat"], "error": "timed out"}
    for line in proc.stdout.splitlines():
        if line.startswith(CHILD_MARK):
            result: dict[str, Any] = json.loads(line[len(CHILD_MARK) :])
            return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"loader": spec["loader"], "repeat": spec["repeat"], "error": " | ".join(tail)}


def missing(name: str) -> list[str]:
    """The packages loader ``name`` needs that are not installed."""
    return [m for m in NEEDS.get(name, ()) if importlib.util.find_spec(m) is None]


def _range(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "—"
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def _spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """The median of ``values`` and, where there are several, their range in brackets."""
    if len(values) < 2:
        return _range(values, fmt)
    return f"{fmt.format(float(np.median(values)))} ({_range(values, fmt)})"


def _row(name: str, runs: list[dict[str, Any]], failed: int) -> str:
    def col(key: str, fmt: str = "{:.3f}", free: bool = False) -> str:
        return _range([float((r["free"] if free else r)[key]) for r in runs], fmt)

    def spread(key: str, fmt: str = "{:.3f}") -> str:
        return _spread([float(r[key]) for r in runs], fmt)

    extra_cpu = _spread(
        [r["main_cpu_per_step_ms"] - r["free_main_cpu_per_step_ms"] for r in runs], "{:.2f}"
    )

    cpu = _range([r["cpu_s"] + r["children_cpu_s"] for r in runs], "{:.1f}")
    load = _range([r["load_start"] for r in runs] + [r["load_end"] for r in runs], "{:.1f}")
    return (
        f"| {name}{f' ({failed} failed)' if failed else ''} | {spread('median_ratio')} | "
        f"{spread('round_ratio_median')} | {extra_cpu} | "
        f"{col('p90_ratio')} | {col('epoch_ratio')} | {col('free_epoch_ratio')} | "
        f"{col('cpu_ratio')} | {col('gil_waits_per_step', '{:.2f}')} "
        f"({col('steps_with_gil_wait', '{:.0%}')}) | {col('gil_wait_ms_per_step')} | "
        f"{col('preempted_steps', '{:.0%}')} ({col('preempted_steps', '{:.0%}', True)}) | "
        f"{col('wait_total_s', '{:.2f}')} | {col('first_batch_s', '{:.2f}')} | {cpu} | {load} |"
    )


def render(out: dict[str, Any]) -> str:
    """The markdown report of one run: ranges over the repeats."""
    cfg = out["config"]
    lines = [
        f"Step: {cfg['step_ms']:g} ms of GIL-holding Python ({cfg['iterations']:,} iterations), "
        f"{cfg['steps']:,} steps, batch {BATCH}, chunk_size {cfg['chunk_size']:,}, "
        f"{cfg['samples']:,} samples ({cfg['bytes'] / 1e9:.2f} GB, warm); "
        f"{cfg['repeats']} repeat(s), ranges over them; blocks of {cfg['block']} steps; "
        "switch interval "
        f"{cfg['switch_interval_ms'] or 5:g} ms; ASYNCHDF5_NICE={cfg['nice'] or 'unset'}; "
        f"extra layer properties {cfg['layer'] or 'none'}; trainer yields "
        f"{cfg['yield_us']:g} µs before each batch. "
        "Each ratio is against the free steps interleaved with the loader's in the same "
        "process (median over the repeats, their range in brackets); a round's ratio is the "
        "loader's median step over the free one within one round (a block of each); the main "
        "thread's CPU per step counts the step and the loader's next() together. A GIL "
        "wait is a voluntary context switch of the main thread inside a step (the step never "
        "blocks otherwise); its time is the mean off-CPU time of the steps not preempted.",
        "",
        "| loader | median step ÷ free | median of round ratios | main-thread CPU per step "
        "beyond free, ms | p90 step ÷ free median | epoch ÷ ideal | "
        "epoch ÷ free epoch | step CPU ÷ free | GIL waits per step (steps with one) | "
        "GIL wait per step, ms | steps preempted (free) | waits for batches (s) | "
        "first batch (s) | CPU-s (+ children) | load avg (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in cfg["loaders"]:
        runs = [r for r in out["runs"] if r["loader"] == name and "median_ratio" in r]
        errors = [r["error"] for r in out["runs"] if r["loader"] == name and "error" in r]
        skipped = [r["skipped"] for r in out["runs"] if r["loader"] == name and "skipped" in r]
        if runs:
            lines.append(_row(name, runs, len(errors)))
        elif skipped:
            lines.append(f"| {name} | skipped: {skipped[0]} |" + " |" * 13)
        else:
            lines.append(f"| {name} | error: {'; '.join(errors)} |" + " |" * 13)
    lines += [
        "",
        "Where the steps ran: the main thread's page faults per step and its steps per CPU "
        "(loader / free; -1: moved during the step), and the loader's median step over the free "
        "median on the same CPU (weighted by the loader's steps there): virtual CPUs need not "
        "run at one speed, and the loader moves the main thread between them.",
        "",
        "| loader | median step ÷ free, same CPU | page faults per step (free) | "
        "steps per CPU (free) |",
        "|---|---|---|---|",
    ]
    for name in cfg["loaders"]:
        runs = [r for r in out["runs"] if r["loader"] == name and "median_ratio" in r]
        if not runs or "same_cpu_ratio" not in runs[0]:
            continue
        where = "; ".join(
            ", ".join(
                f"{c}: {r['steps_per_cpu'].get(c, 0)}/{r['free']['steps_per_cpu'].get(c, 0)}"
                for c in sorted(set(r["steps_per_cpu"]) | set(r["free"]["steps_per_cpu"]), key=int)
            )
            for r in runs
        )
        lines.append(
            f"| {name} | {_spread([float(r['same_cpu_ratio']) for r in runs])} | "
            f"{_range([r['faults_per_step'] for r in runs], '{:.2f}')} "
            f"({_range([r['free']['faults_per_step'] for r in runs], '{:.2f}')}) | {where} |"
        )
    lines += [
        "",
        "Threads of the measuring process over the run (the loader's, and the main thread that "
        "runs the steps): CPU seconds, context switches per batch.",
        "",
        "| loader | thread (count) | CPU-s | voluntary switches per batch | involuntary |",
        "|---|---|---|---|---|",
    ]
    for name in cfg["loaders"]:
        runs = [r for r in out["runs"] if r["loader"] == name and "median_ratio" in r]
        names = sorted(
            {t for r in runs for t in r["threads"]}, key=lambda t: (t != "MainThread", t)
        )
        for t in names:
            rows = [r["threads"][t] for r in runs if t in r["threads"]]
            lines.append(
                f"| {name} | {t} ({_range([x['threads'] for x in rows], '{:.0f}')}) | "
                f"{_range([x['cpu_s'] for x in rows], '{:.2f}')} | "
                f"{_range([x['voluntary_per_batch'] for x in rows], '{:.2f}')} | "
                f"{_range([x['involuntary_per_batch'] for x in rows], '{:.2f}')} |"
            )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_cost", description=__doc__)
    p.add_argument("--quick", action="store_true", help="20 MB, 40 steps: a smoke test")
    p.add_argument("--steps", type=int, help=f"steps per run (default {FULL['steps']})")
    p.add_argument("--step-ms", type=float, default=3.0, help="the step's time (default 3)")
    p.add_argument("--samples", type=int, help=f"image samples (default {FULL['samples']:,})")
    p.add_argument("--chunk-size", type=int, help=f"default {FULL['chunk_size']:,}")
    p.add_argument("--repeats", type=int, default=3, help="runs of each loader (interleaved)")
    p.add_argument("--block", type=int, default=25, help="steps per block of free / loader steps")
    p.add_argument("--loaders", default=",".join(LOADERS), help="comma-separated subset")
    p.add_argument("--switch-interval", type=float, default=0.0, help="ms (default: Python's)")
    p.add_argument(
        "--layer", default="{}", help="extra asynchdf5 properties, JSON: '{\"mmap\": true}'"
    )
    p.add_argument(
        "--yield-us",
        type=float,
        default=0.0,
        help="the trainer sleeps this long before asking for each batch (a GIL switch point)",
    )
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--timeout", type=float, default=300.0, help="s per child process")
    p.add_argument("--output", type=Path, help="write the results as JSON to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        result = child(json.loads(args.child))
        print(CHILD_MARK + json.dumps(result), flush=True)
        return 0
    size = QUICK if args.quick else FULL
    loaders = [n.strip() for n in args.loaders.split(",") if n.strip()]
    unknown = set(loaders) - set(LOADERS)
    if unknown:
        raise SystemExit(f"--loaders: unknown {sorted(unknown)}; known: {', '.join(LOADERS)}")
    spec = DatasetSpec(
        name="contiguous",
        title="image, uint8 3x32x32 + int64 label, contiguous, one file",
        kind="image",
        samples=args.samples or size["samples"],
        shape=IMAGE_SHAPE,
        dtype="uint8",
    )
    (files,) = data.ensure([spec], args.data_dir)
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    iterations = calibrate(args.step_ms, BATCH, IMAGE_SHAPE)
    config = {
        "argv": sys.argv[1:] if argv is None else argv,
        "started": started,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "step_ms": args.step_ms,
        "iterations": iterations,
        "steps": args.steps or size["steps"],
        "samples": spec.samples,
        "bytes": spec.total_bytes,
        "chunk_size": args.chunk_size or size["chunk_size"],
        "repeats": args.repeats,
        "block": args.block,
        "loaders": loaders,
        "switch_interval_ms": args.switch_interval,
        "layer": json.loads(args.layer),
        "yield_us": args.yield_us,
        "nice": os.environ.get("ASYNCHDF5_NICE", ""),
        "load_start": list(os.getloadavg()),
    }
    runs = []
    for repeat in range(args.repeats):
        for name in loaders:
            absent = missing(name)
            if absent:
                runs.append(
                    {"loader": name, "repeat": repeat, "skipped": f"needs {', '.join(absent)}"}
                )
                print(f"# {name} #{repeat}: skipped, needs {absent}", file=sys.stderr)
                continue
            for path in files.paths:
                page_cache.warm(path)
            job = {
                "loader": name,
                "repeat": repeat,
                "source": str(files.source),
                "steps": config["steps"],
                "iterations": iterations,
                "chunk_size": config["chunk_size"],
                "switch_interval_ms": args.switch_interval,
                "layer": json.loads(args.layer),
                "yield_us": args.yield_us,
                "block": args.block,
            }
            result = run_child(job, files, args.timeout)
            runs.append(result)
            what = result.get("error") or (
                f"median x{result['median_ratio']:.3f}, epoch x{result['epoch_ratio']:.3f}"
            )
            print(f"# {name} #{repeat}: {what}", file=sys.stderr, flush=True)
    config["load_end"] = list(os.getloadavg())
    out = {"config": config, "runs": runs}
    print(render(out))
    if args.output:
        args.output.write_text(json.dumps(out, indent=1) + "\n")
    return 0


def bench(rec: Any) -> None:
    """``python -m benchmarks run step-cost``: :func:`main` at the run's size, every loader, its
    JSON output recorded as figures (median and p90 step ÷ free, epoch ÷ ideal, the main
    thread's CPU per step beyond the free steps', per loader)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="step-cost-") as tmp:
        out = Path(tmp) / "step_cost.json"
        argv = ["--data-dir", str(rec.data_dir), "--output", str(out)]
        argv += (
            ["--quick", "--steps", "10", "--repeats", "1", "--timeout", "60"] if rec.quick else []
        )
        with contextlib.redirect_stdout(sys.stderr):
            main(argv)
        result = json.loads(out.read_text())
    cfg = result["config"]
    rec.param(**{k: cfg[k] for k in ("step_ms", "steps", "samples", "chunk_size", "repeats")})
    for r in result["runs"]:
        if "error" in r or "skipped" in r:
            rec.note(f"{r['loader']}: {r.get('error') or 'skipped, ' + r['skipped']}")
            continue
        rec.figure(f"{r['loader']}: median step ÷ free step", r["median_ratio"], "ratio")
        rec.figure(
            f"{r['loader']}: median step ÷ free step, same CPU", r["same_cpu_ratio"], "ratio"
        )
        rec.figure(f"{r['loader']}: p90 step ÷ free median", r["p90_ratio"], "ratio")
        rec.figure(f"{r['loader']}: epoch ÷ ideal", r["epoch_ratio"], "ratio")
        extra = r["main_cpu_per_step_ms"] - r["free_main_cpu_per_step_ms"]
        rec.figure(f"{r['loader']}: main-thread CPU per step beyond free", extra, "ms")
        rec.figure(f"{r['loader']}: first batch", r["first_batch_s"], "s")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
