"""What a block costs in read rate (``python -m benchmarks run block-size``).

Two measurements, both timing-sensitive (run them on a quiet machine):

``read``: block-wise random reads against a sequential read of the same file, for
blocks of 64 KiB to 64 MiB, the way the layer's reader issues them: each block one range (cut
at the reader's ``PIECE_BYTES``), ranges grouped into calls of about ``PIECE_BYTES``, two threads
(``read_threads``), ``os.preadv`` into preallocated buffers, the blocks in a random permutation
(:mod:`benchmarks.block_reads`).
A plain file of random bytes larger than a few GiB is generated (and deleted
afterwards). COLD passes evict the file from the page cache first with
``posix_fadvise(POSIX_FADV_DONTNEED)``; whether that works here is checked first (the share of
the file's pages resident, from ``mincore``, and the rate of a re-read). WARM passes read their
ranges once, untimed, then time them. Each configuration is repeated (3 times by default, in a
new random order each round); the report gives the median MB/s, its ratio to the sequential
read, and the smallest block whose cold rate is at least 90 % of the sequential one: the
measured choice for ``BLOCK_BYTES``.

``layer``: the cost of the shuffle modes through :class:`asynchdf5.AsyncHDF5DataLayer` on a
generated image set (the benchmark suite's contiguous layout) larger than the layer's
``cache_bytes``, so every epoch streams: ``shuffle=False`` against the default blocks, other
block sizes and the old mode (``block_size`` >= the data set: one contiguous stretch per chunk).
Per mode, a warm-up epoch (it also faults in the cache slots), then cold epochs (the files
evicted first) and warm epochs; the epoch rate in samples/s and the reader's own rate (bytes
read over the time spent reading chunks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import data, data_special
from benchmarks.block_reads import READ_THREADS, Reader, pass_ranges
from benchmarks.config import IMAGE_SHAPE, DatasetSpec
from benchmarks.internals import BLOCK_BYTES, N_SLOTS
from benchmarks.page_cache import evict, resident_fraction
from benchmarks.report import Recorder
from benchmarks.shuffle_quality import IMAGE_ROW_BYTES

MB = 1e6
#: The fraction of the sequential rate a block must keep to be a candidate default.
TARGET = 0.9

# --- the read measurement ----------------------------------------------------------------------


@dataclass(frozen=True)
class EvictionCheck:
    resident_before: float | None
    resident_after: float | None
    warm_mb_s: float
    cold_mb_s: float

    def verdict(self) -> str:
        after = self.resident_after
        ratio = self.cold_mb_s / self.warm_mb_s
        if after is None:
            left = "mincore unavailable: residency not checked"
        else:
            left = f"{100 * after:.1f} % of the file's pages resident after eviction"
        if after is not None and after > 0.05:
            return f"{left}: eviction does NOT work here, the cold figures are not cold"
        return (
            f"{left}; the re-read ran at {ratio:.2f} of the warm rate (a cold rate above what "
            "the disk can deliver would mean a cache below this machine's, such as a VM host's)"
        )


def check_eviction(path: Path, reader: Reader, nbytes: int) -> EvictionCheck:
    """Read a stretch twice (warm rate), evict, read it again (cold rate)."""
    ranges = [(0, min(nbytes, os.path.getsize(path)))]
    reader.run(ranges, 1e9)
    got, warm_s = reader.run(ranges, 1e9)
    before = resident_fraction(path)
    evict(path)
    after = resident_fraction(path)
    got, cold_s = reader.run(ranges, 1e9)
    return EvictionCheck(before, after, got / warm_s / MB, got / cold_s / MB)


@dataclass
class ReadRow:
    block: int | None  # bytes; None: sequential
    cold: list[float] = field(default_factory=list)  # MB/s per repeat
    warm: list[float] = field(default_factory=list)
    cold_bytes: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "sequential" if self.block is None else _size(self.block)


def _size(nbytes: int) -> str:
    return f"{nbytes // 2**20} MiB" if nbytes >= 2**20 else f"{nbytes // 2**10} KiB"


def _med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def measure_reads(rec: Recorder, args: argparse.Namespace) -> None:
    """The read measurement."""
    path = Path(args.file)
    size = int(args.size_gib * 2**30)
    notes = []
    if path.exists() and path.stat().st_size == size:
        notes.append(f"file: {path}, {size / 2**30:g} GiB of random bytes (reused)")
    else:
        secs = data_special.random_bytes(path, size)
        notes.append(
            f"file: {path}, {size / 2**30:g} GiB of random bytes (written in {secs:.0f} s)"
        )
    pass_bytes = int(args.pass_gib * 2**30)
    blocks = [2**k for k in range(args.min_log2, args.max_log2 + 1)]
    rows = [ReadRow(None), *(ReadRow(b) for b in blocks)]
    fd = os.open(path, os.O_RDONLY)
    reader = Reader(fd, args.threads)
    try:
        check = check_eviction(path, reader, min(pass_bytes, 256 * 2**20))
        notes.append(
            f"eviction check (posix_fadvise DONTNEED, {min(pass_bytes, 256 * 2**20) / 2**20:.0f} "
            f"MiB): warm {check.warm_mb_s:,.0f} MB/s, after eviction {check.cold_mb_s:,.0f} MB/s; "
            + check.verdict()
        )
        rng = np.random.default_rng(args.seed)
        for rep in range(args.repeats):
            for i in rng.permutation(len(rows)):
                row = rows[int(i)]
                ranges = pass_ranges(size, row.block, pass_bytes, rng)
                evict(path)
                got, secs = reader.run(ranges, args.pass_seconds)
                row.cold.append(got / secs / MB)
                row.cold_bytes.append(got)
                print(
                    f"# cold {rep} {row.name}: {got / secs / MB:,.0f} MB/s "
                    f"({got / 2**20:,.0f} MiB in {secs:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        if not args.no_warm:
            for row in rows:
                ranges = pass_ranges(size, row.block, pass_bytes, rng)
                reader.run(ranges, 1e9)  # into the page cache, untimed
                for _ in range(args.repeats):
                    got, secs = reader.run(ranges, 1e9)
                    row.warm.append(got / secs / MB)
                print(f"# warm {row.name}: {_med(row.warm):,.0f} MB/s", file=sys.stderr)
    finally:
        reader.close()
        os.close(fd)
        if not args.keep:
            path.unlink(missing_ok=True)
            notes.append("the file was deleted afterwards")
    for note in notes:
        rec.note(note)
    record_reads(rec, rows, args.row_bytes)


def record_reads(rec: Recorder, rows: Sequence[ReadRow], row_bytes: int) -> None:
    """Each block's cold (and warm) read rate and its ratio to the sequential read's; the
    smallest block from which every larger block keeps :data:`TARGET` of it, cold."""
    seq = rows[0]
    seq_cold, seq_warm = _med(seq.cold), _med(seq.warm)
    for r in rows:
        what = (
            r.name if r.block is None else f"blocks of {r.name} ({r.block / row_bytes:,.1f} rows)"
        )
        rec.figure(f"{what}: cold read", _med(r.cold), "MB/s")
        if r.block is not None:
            rec.ratio(f"{what}: cold ÷ sequential", _med(r.cold), seq_cold)
        if r.warm:
            rec.figure(f"{what}: warm read", _med(r.warm), "MB/s")
            if r.block is not None:
                rec.ratio(f"{what}: warm ÷ sequential", _med(r.warm), seq_warm)
    # The smallest block from which on every larger block keeps the target too: one noisy pass
    # of a small block that happens to pass does not make it the answer.
    blocks = sorted((r for r in rows if r.block is not None), key=lambda r: r.block or 0)
    steady: ReadRow | None = None
    for r in reversed(blocks):
        if _med(r.cold) < TARGET * seq_cold:
            break
        steady = r
    if steady is not None and steady.block is not None:
        rec.figure(
            f"smallest block keeping {TARGET:.0%} of sequential, cold", steady.block / 2**20, "MiB"
        )
    else:
        rec.note(f"no block measured reaches {TARGET:.0%} of the sequential rate, cold")
    rec.note(f"the default BLOCK_BYTES is {_size(BLOCK_BYTES)}")


def _default_ratio(rows: Sequence[ReadRow], seq_cold: float) -> str:
    for r in rows:
        if r.block == BLOCK_BYTES:
            return f"{_med(r.cold) / seq_cold:.2f}"
    return "(not measured)"


# --- the layer measurement ---------------------------------------------------------------------


@dataclass
class LayerRow:
    name: str
    kwargs: dict[str, Any]
    first_epoch_s: float = 0.0
    cold: list[float] = field(default_factory=list)  # samples/s
    warm: list[float] = field(default_factory=list)
    cold_read: list[float] = field(default_factory=list)  # reader MB/s
    warm_read: list[float] = field(default_factory=list)
    chunk_rows: int = 0


def layer_modes(n: int, row_bytes: int) -> list[tuple[str, dict[str, Any]]]:
    """``shuffle=False``, blocks of 1, 4, 16 and 64 MiB (the default among them), and the old
    mode."""
    out: list[tuple[str, dict[str, Any]]] = [("shuffle=False", {"shuffle": False})]
    for nbytes in sorted({2**20, 4 * 2**20, BLOCK_BYTES, 16 * 2**20, 64 * 2**20}):
        rows = max(1, nbytes // row_bytes)
        if nbytes == BLOCK_BYTES:
            out.append((f"default blocks ({rows:,} samples, {_size(nbytes)})", {"shuffle": True}))
        else:
            out.append(
                (
                    f"blocks of {rows:,} samples ({_size(nbytes)})",
                    {"shuffle": True, "block_size": rows},
                )
            )
    out.append(
        (
            "old mode: one contiguous stretch per chunk (block_size = N)",
            {"shuffle": True, "block_size": n},
        )
    )
    return out


async def _epoch(layer: Any) -> tuple[float, int, float]:
    """One epoch: (seconds, bytes the reader read, seconds it spent reading)."""
    s0 = layer.stats
    t0 = time.perf_counter()
    async for _batch in layer:
        pass
    secs = time.perf_counter() - t0
    s1 = layer.stats
    return secs, s1.bytes_read - s0.bytes_read, s1.read_seconds - s0.read_seconds


def measure_layer(rec: Recorder, args: argparse.Namespace) -> None:
    """The layer measurement: each mode's cold and warm epochs, and the reader's rate."""
    import anyio

    from asynchdf5 import AsyncHDF5DataLayer

    spec = DatasetSpec(
        name="contiguous",
        title=f"image, {args.samples:,} x uint8 3x32x32 + int64 label, contiguous, one file",
        kind="image",
        samples=args.samples,
        shape=IMAGE_SHAPE,
        dtype="uint8",
    )
    located = data.locate(spec, Path(args.data_dir))
    existed = data.is_current(located)
    (files,) = data.ensure([spec], Path(args.data_dir))
    notes = [
        f"data set: {files.source} ({spec.total_bytes / 1e9:.2f} GB{', reused' if existed else ''})"
    ]
    cache_bytes = N_SLOTS * args.chunk_size * spec.sample_bytes + 64 * 2**20
    notes.append(
        f"chunk_size {args.chunk_size:,}, cache_bytes {cache_bytes / 2**30:.2f} GiB "
        f"({'smaller' if cache_bytes < spec.total_bytes else 'NOT smaller'} than the data set)"
    )
    n = spec.samples
    rows = [LayerRow(name, kw) for name, kw in layer_modes(n, spec.sample_bytes)]

    async def one(row: LayerRow) -> None:
        layer = AsyncHDF5DataLayer(
            str(files.source),
            batch_size=256,
            seed=args.seed,
            chunk_size=args.chunk_size,
            cache_bytes=cache_bytes,
            **row.kwargs,
        )
        async with layer:
            secs, _, _ = await _epoch(layer)  # faults in the slots; the file may be cold or warm
            row.first_epoch_s = secs
            row.chunk_rows = layer.stats.chunk_rows
            for _ in range(args.repeats):
                for path in files.paths:
                    evict(path)
                secs, nbytes, read_s = await _epoch(layer)
                row.cold.append(n / secs)
                row.cold_read.append(nbytes / read_s / MB if read_s else float("nan"))
                secs, nbytes, read_s = await _epoch(layer)  # the cold epoch left it cached
                row.warm.append(n / secs)
                row.warm_read.append(nbytes / read_s / MB if read_s else float("nan"))
        print(
            f"# {row.name}: cold {_med(row.cold):,.0f} samples/s, warm {_med(row.warm):,.0f}",
            file=sys.stderr,
            flush=True,
        )

    try:
        for row in rows:
            anyio.run(one, row)
    finally:
        if not args.keep and not existed:
            for path in files.paths:
                path.unlink(missing_ok=True)
            notes.append("the generated data set was deleted afterwards")
    base = rows[0]
    for note in notes:
        rec.note(note)
    for r in rows:
        rec.figure(f"layer, {r.name}: cold epoch", _med(r.cold), "samples/s")
        rec.ratio(f"layer, {r.name}: cold ÷ shuffle=False", _med(r.cold), _med(base.cold))
        rec.figure(f"layer, {r.name}: reader while cold", _med(r.cold_read), "MB/s")
        rec.figure(f"layer, {r.name}: warm epoch", _med(r.warm), "samples/s")
        rec.ratio(f"layer, {r.name}: warm ÷ shuffle=False", _med(r.warm), _med(base.warm))


# --- the benchmark ---------------------------------------------------------------------------


def bench(rec: Recorder) -> None:
    """Both measurements. Full: an 8 GiB file of random bytes, 1 GiB per pass, blocks of 64 KiB
    to 64 MiB, 3 repeats; the layer on 2,000,000 images (6.2 GB) with chunks of 2**18.
    ``--quick``: a 64 MiB file, blocks of 1 to 4 MiB, and 8,192 images."""
    quick = rec.quick
    args = argparse.Namespace(
        repeats=1 if quick else 3, seed=0, keep=False, row_bytes=IMAGE_ROW_BYTES,
        file=str(rec.data_dir / "block-size-read.bin"), size_gib=1 / 16 if quick else 8.0,
        pass_gib=1 / 64 if quick else 1.0, pass_seconds=20.0, threads=READ_THREADS,
        min_log2=20 if quick else 16, max_log2=22 if quick else 26, no_warm=quick,
        data_dir=str(rec.data_dir), samples=8192 if quick else 2_000_000,
        chunk_size=2**11 if quick else 2**18,
    )  # fmt: skip
    rec.param(**{k: v for k, v in vars(args).items() if k not in ("keep", "file", "data_dir")})
    rec.data_dir.mkdir(parents=True, exist_ok=True)
    measure_reads(rec, args)
    measure_layer(rec, args)
