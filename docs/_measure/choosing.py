"""The measurements behind docs/choosing.md and docs/packing.md: re-run them on your machine.

    python docs/_measure/choosing.py                   # everything, data under /tmp
    python docs/_measure/choosing.py --only chunk      # one table: chunk, block, batch, codec

Every configuration runs in a fresh subprocess, so that its peak memory is its own. The data
sets are written once into ``--dir`` and kept for later runs: 3x32x32 uint8 images with int64
labels (3,080 bytes a sample), contiguous (``asynchdf5 demo``'s writer), and for the codec
table smooth images packed with ``asynchdf5 pack`` in each compression. Reads come from the
page cache when the files fit in memory (they do on the machine the pages quote), so these are
the loader's own costs, not a disk's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np

ROW_BYTES = 3 * 32 * 32 + 8


def one(config: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration (in this process): epochs through the layer, timed."""
    from asynchdf5 import AsyncHDF5DataLayer

    properties = dict(config["properties"])
    epochs = int(config.get("epochs", 1))

    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        """Resident bytes now (Linux)."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    async def run() -> dict[str, Any]:
        rss_before = peak = rss()
        start = time.perf_counter()
        layer = AsyncHDF5DataLayer(config["source"], **properties)
        out: dict[str, Any] = {"epochs": []}
        async with layer:
            out["open_s"] = time.perf_counter() - start
            for epoch in range(epochs):
                if epoch:
                    start = time.perf_counter()
                first = None
                n = 0
                async for batch in layer:
                    if first is None:
                        first = time.perf_counter() - start
                    n += batch.size
                    if n % (64 * batch.size) == 0:
                        peak = max(peak, rss())
                seconds = time.perf_counter() - start
                out["epochs"].append({"samples": n, "s": seconds, "first_batch_s": first})
            stats = layer.stats
        out["chunk_rows"] = stats.chunk_rows
        out["resident"] = stats.resident
        out["bottleneck"] = stats.bottleneck()
        out["read_paths"] = stats.read_paths
        out["rss_growth_mib"] = (max(peak, rss()) - rss_before) / 2**20
        return out

    return anyio.run(run)


#: Runs per configuration (``--repeat``).
SETTINGS = {"repeat": 5}


def measure(configs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``--repeat`` runs of each configuration, each in a fresh process. The configurations
    take turns (one run of each, then the next round), so that a change in the machine's load
    weighs on all of them alike."""
    runs: list[list[dict[str, Any]]] = [[] for _ in configs]
    for _ in range(SETTINGS["repeat"]):
        for config, done in zip(configs, runs, strict=True):
            proc = subprocess.run(
                [sys.executable, __file__, "--one", json.dumps(config)],
                capture_output=True,
                text=True,
                check=True,
            )
            done.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return runs


def spread(values: list[float], scale: float = 1e3, unit: str = "k") -> str:
    """The median, and the range in brackets: ``440k (400k-480k)``."""
    v = sorted(values)
    mid = v[len(v) // 2]
    if len(v) == 1:
        return f"{mid / scale:,.0f}{unit}"
    return f"{mid / scale:,.0f}{unit} ({v[0] / scale:,.0f}-{v[-1] / scale:,.0f})"


# --- data --------------------------------------------------------------------------------------


def image_set(folder: Path, samples: int) -> Path:
    source = folder / "train.txt"
    if not source.exists():
        from asynchdf5._cli._sample import write_dataset

        write_dataset(folder, samples, 8, 0)
    return source


def smooth_images(path: Path, samples: int) -> None:
    """Images that compress as photos roughly do: smooth gradients plus a little noise."""
    rng = np.random.default_rng(0)
    data = np.lib.format.open_memmap(path, "w+", np.uint8, (samples, 3, 32, 32))
    yy, xx = np.mgrid[0:32, 0:32].astype(np.float32)
    for lo in range(0, samples, 8192):
        n = min(8192, samples - lo)
        a, b, c = (rng.uniform(0, 4, (n, 3, 1, 1)).astype(np.float32) for _ in range(3))
        img = 128 + 60 * np.sin(a * xx / 8 + b * yy / 8 + c) + rng.normal(0, 3, (n, 3, 32, 32))
        data[lo : lo + n] = np.clip(img, 0, 255).astype(np.uint8)
    data.flush()
    np.save(path.with_name("labels.npy"), np.arange(samples) % 10)


def codec_sets(folder: Path, samples: int, codecs: list[str]) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    npy = folder / "smooth.npy"
    if not npy.exists():
        smooth_images(npy, samples)
    out = {}
    for codec in codecs:
        target = folder / codec
        if not (target / "train.txt").exists():
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "asynchdf5", "pack", str(npy), str(target), "--labels",
                 str(folder / "labels.npy"), "--compression", codec, "--overwrite"],
                check=True, capture_output=True,
            )  # fmt: skip
            print(f"  packed {codec} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        out[codec] = target / "train.txt"
    return out


# --- tables ------------------------------------------------------------------------------------


def rates(runs: list[dict[str, Any]], epoch: int = 0) -> list[float]:
    return [r["epochs"][epoch]["samples"] / r["epochs"][epoch]["s"] for r in runs]


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def chunk_table(source: Path, samples: int) -> list[str]:
    rows = [
        "| chunk_size | cache | memory growth | first batch | samples/s, epoch 1 | epoch 2 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    chunks = (2**10, 2**12, 2**14, 2**16, 2**17)
    props = {"batch_size": 256, "shuffle": True, "seed": 0}
    configs = [
        {"source": str(source), "properties": {**props, "chunk_size": c}, "epochs": 2}
        for c in chunks
    ]
    for chunk, runs in zip(chunks, measure(configs), strict=True):
        cache = 2 * min(chunk, samples) * ROW_BYTES / 2**20
        first = [r["epochs"][0]["first_batch_s"] for r in runs]
        growth = median([r["rss_growth_mib"] for r in runs])
        rows.append(
            f"| 2**{chunk.bit_length() - 1} | {cache:,.0f} MiB | {growth:,.0f} MiB "
            f"| {spread(first, 1e-3, ' ms')} | {spread(rates(runs))} | {spread(rates(runs, 1))} |"
        )
    return rows


def block_table(source: Path) -> list[str]:
    rows = ["| block_size | bytes per block | samples/s |", "| ---: | ---: | ---: |"]
    blocks = (16, 64, 256, None, 8192)
    props = {"batch_size": 256, "shuffle": True, "seed": 0, "chunk_size": 2**16}
    configs = [{"source": str(source), "properties": {**props, "block_size": b}} for b in blocks]
    for block, runs in zip(blocks, measure(configs), strict=True):
        rows_per_block = block or (4 * 2**20) // ROW_BYTES
        shown = f"None ({rows_per_block:,})" if block is None else f"{block:,}"
        size = rows_per_block * ROW_BYTES / 2**10
        rows.append(f"| {shown} | {size:,.0f} KiB | {spread(rates(runs))} |")
    return rows


def batch_table(source: Path) -> list[str]:
    rows = ["| batch_size | samples/s | batches/s |", "| ---: | ---: | ---: |"]
    batches = (16, 64, 256, 1024, 4096)
    props = {"shuffle": True, "seed": 0, "chunk_size": 2**16}
    configs = [{"source": str(source), "properties": {**props, "batch_size": b}} for b in batches]
    for batch, runs in zip(batches, measure(configs), strict=True):
        per_batch = [r / batch for r in rates(runs)]
        rows.append(f"| {batch:,} | {spread(rates(runs))} | {spread(per_batch, 1, '')} |")
    return rows


def codec_table(folder: Path, samples: int) -> list[str]:
    codecs = ["none", "gzip", "lz4", "zstd"]
    sets = codec_sets(folder, samples, codecs)
    rows = [
        "| --compression | stored | read path | samples/s, epoch 1 | epoch 2 |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    props = {"batch_size": 256, "shuffle": True, "seed": 0, "chunk_size": 2**16}
    configs = [{"source": str(s), "properties": props, "epochs": 2} for s in sets.values()]
    for (codec, source), runs in zip(sets.items(), measure(configs), strict=True):
        stored = sum(p.stat().st_size for p in source.parent.glob("train-*.h5"))
        rows.append(
            f"| {codec} | {stored / 2**20:,.0f} MiB | {runs[0]['read_paths']['data']} "
            f"| {spread(rates(runs))} | {spread(rates(runs, 1))} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/asynchdf5-measure"))
    parser.add_argument("--samples", type=int, default=600_000)
    parser.add_argument("--codec-samples", type=int, default=200_000)
    parser.add_argument("--only", choices=("chunk", "block", "batch", "codec"))
    parser.add_argument("--repeat", type=int, default=5, help="runs per configuration")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    SETTINGS["repeat"] = args.repeat
    source = image_set(args.dir / f"images-{args.samples}", args.samples)
    print(
        f"<!-- {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}: {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f} at start; "
        f"{args.samples:,} samples of {ROW_BYTES:,} bytes "
        f"({args.samples * ROW_BYTES / 2**30:.2f} GiB); median (min-max) of {args.repeat} runs -->"
    )
    tables: dict[str, Callable[[], list[str]]] = {
        "chunk": lambda: chunk_table(source, args.samples),
        "block": lambda: block_table(source),
        "batch": lambda: batch_table(source),
        "codec": lambda: codec_table(args.dir / f"codecs-{args.codec_samples}", args.codec_samples),
    }
    for name, table in tables.items():
        if args.only in (None, name):
            print(f"\n{name}:\n")
            print("\n".join(table()), flush=True)
    print(f"\n<!-- load average {os.getloadavg()[0]:.1f} at the end -->")


if __name__ == "__main__":
    main()
