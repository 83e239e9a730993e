"""Threads or a helper process: first batch, plain throughput and memory
(``python -m benchmarks.process_start``).

The same layer (``HDF5DataLayer``, shuffled, default properties, ``--chunk-size``, batch 256)
on the image set of :mod:`benchmarks.step_cost`, warm, with its pipeline in threads of the
consumer's process (``threads``) or in one helper process (``process``: ``process=True``). Each
run is a fresh process, the two modes taking turns (``--repeats``). A run reports the time from
constructing the layer to the first batch, the samples per second of the rest of epoch 1 and of
epoch 2 for a consumer that does nothing with its batches, and the resident memory (RSS) of the
consumer's process and of its helper at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import data
from benchmarks.config import DEFAULT_DATA_DIR, IMAGE_SHAPE, DatasetSpec
from benchmarks.report import Recorder

__all__ = ["bench", "main", "run"]

MODES = ("threads", "process")
MARK = "PROCESS_START_RESULT "


def child(source: str, mode: str, chunk_size: int) -> dict[str, Any]:
    import psutil

    from asynchdf5 import HDF5DataLayer

    t0 = time.perf_counter()
    layer = HDF5DataLayer(
        source,
        batch_size=256,
        shuffle=True,
        seed=0,
        chunk_size=chunk_size,
        process=mode == "process",
    )
    out: dict[str, Any] = {"mode": mode}
    with layer:
        it = iter(layer)
        first = next(it)
        out["first_batch_s"] = time.perf_counter() - t0
        t1, n = time.perf_counter(), len(first.indices)
        del first
        for batch in it:
            n += len(batch.indices)
        out["epoch1_samples_s"] = (n - 256) / (time.perf_counter() - t1)
        t2, n = time.perf_counter(), 0
        for batch in layer:
            n += len(batch.indices)
        out["epoch2_samples_s"] = n / (time.perf_counter() - t2)
        me = psutil.Process()
        out["rss_mib"] = me.memory_info().rss / 2**20
        out["helper_rss_mib"] = sum(c.memory_info().rss for c in me.children()) / 2**20
    return out


def run(samples: int, repeats: int, chunk_size: int, data_dir: Path) -> list[dict[str, Any]]:
    """``repeats`` rounds of a fresh process per mode, taking turns; one result per run."""
    spec = DatasetSpec(
        name="contiguous",
        title="image, uint8 3x32x32 + int64 label, contiguous, one file",
        kind="image",
        samples=samples,
        shape=IMAGE_SHAPE,
        dtype="uint8",
    )
    (files,) = data.ensure([spec], data_dir)
    root = Path(__file__).resolve().parent.parent
    runs = []
    for repeat in range(repeats):
        for mode in MODES:
            cmd = [sys.executable, "-m", "benchmarks.process_start", "--child",
                   str(files.source), mode, str(chunk_size)]  # fmt: skip
            load = os.getloadavg()[0]
            proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
            lines = [x for x in proc.stdout.splitlines() if x.startswith(MARK)]
            if not lines:
                print(proc.stderr[-2000:], file=sys.stderr)
                continue
            result = json.loads(lines[0][len(MARK) :]) | {"repeat": repeat, "load": load}
            runs.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    return runs


def bench(rec: Recorder) -> None:
    """The suite's entry (``python -m benchmarks run process-start``): per mode, the median of
    each run's figures."""
    samples, repeats, chunk = (20_480, 1, 2**13) if rec.quick else (327_680, 3, 2**17)
    rec.param(samples=samples, repeats=repeats, chunk_size=chunk, batch_size=256)
    runs = run(samples, repeats, chunk, rec.data_dir)
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            rec.note(f"{mode}: no run finished (its stderr is above)")
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "mode"}
        rec.figure(f"{mode}, first batch", med["first_batch_s"], "s")
        rec.figure(f"{mode}, epoch 1", med["epoch1_samples_s"], "samples/s")
        rec.figure(f"{mode}, epoch 2", med["epoch2_samples_s"], "samples/s")
        rec.figure(f"{mode}, RSS of the consumer's process", med["rss_mib"], "MiB")
        if mode == "process":
            rec.figure("process, RSS of the helper", med["helper_rss_mib"], "MiB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.process_start", description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samples", type=int, default=327_680)
    p.add_argument("--chunk-size", type=int, default=2**17)
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--output", type=Path)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        source, mode, chunk = args.child
        print(MARK + json.dumps(child(source, mode, int(chunk))), flush=True)
        return 0
    runs = run(args.samples, args.repeats, args.chunk_size, args.data_dir)
    print("| mode | first batch (s) | epoch 1, samples/s | epoch 2, samples/s | RSS MiB "
          "(consumer + helper) | load avg |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:
            continue

        def rng(key: str, fmt: str, rs: list[dict[str, Any]] = rs) -> str:
            values = [r[key] for r in rs]
            return f"{fmt.format(min(values))}–{fmt.format(max(values))}"

        mem = [r["rss_mib"] + r["helper_rss_mib"] for r in rs]
        print(
            f"| {mode} | {rng('first_batch_s', '{:.2f}')} | {rng('epoch1_samples_s', '{:,.0f}')} "
            f"| {rng('epoch2_samples_s', '{:,.0f}')} | {rng('rss_mib', '{:.0f}')} + "
            f"{rng('helper_rss_mib', '{:.0f}')} (total {min(mem):.0f}–{max(mem):.0f}) | "
            f"{rng('load', '{:.1f}')} |"
        )
    if args.output:
        args.output.write_text(json.dumps(runs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
