"""What a block costs in read rate (``python -m benchmarks.block_size``).

Two measurements, both timing-sensitive (run them on a quiet machine):

``read`` (the default): block-wise random reads against a sequential read of the same file, for
blocks of 64 KiB to 64 MiB, the way the layer's reader issues them: each block one range (cut
at the reader's ``PIECE_BYTES``), ranges grouped into calls of about ``PIECE_BYTES``, two threads
(``read_threads``), ``os.preadv`` into preallocated buffers, the blocks in a random permutation.
A plain file of random bytes larger than a few GiB is generated (and deleted afterwards unless
``--keep``). COLD passes evict the file from the page cache first with
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
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asynchdf5._config import BLOCK_BYTES
from asynchdf5._sources._local import PIECE_BYTES
from benchmarks.config import DEFAULT_DATA_DIR, IMAGE_SHAPE, DatasetSpec
from benchmarks.page_cache import evict, resident_fraction
from benchmarks.shuffle_quality import IMAGE_ROW_BYTES, header, utc_now

MB = 1e6
#: The layer's reader threads (``read_threads`` of :class:`asynchdf5._read.HDF5Reader`).
READ_THREADS = 2
#: The fraction of the sequential rate a block must keep to be a candidate default.
TARGET = 0.9

# --- reads as the layer issues them ------------------------------------------------------------


def split(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges no longer than ``PIECE_BYTES`` (the reader cuts contiguous rows so)."""
    out = []
    for offset, length in ranges:
        for a in range(0, length, PIECE_BYTES):
            out.append((offset + a, min(PIECE_BYTES, length - a)))
    return out


def batches(ranges: Sequence[tuple[int, int]]) -> Iterator[list[tuple[int, int]]]:
    """Consecutive ranges, about ``PIECE_BYTES`` per batch: one worker-thread call each."""
    batch: list[tuple[int, int]] = []
    size = 0
    for r in ranges:
        if batch and size + r[1] > PIECE_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(r)
        size += r[1]
    if batch:
        yield batch


@dataclass
class Reader:
    """``threads`` threads, each with its own preallocated (and touched) buffer."""

    fd: int
    threads: int = READ_THREADS
    _buffers: list[memoryview] = field(default_factory=list)
    _local: threading.local = field(default_factory=threading.local)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    pool: ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        for _ in range(self.threads):
            buf = np.ones(PIECE_BYTES, np.uint8)  # touched now, not during a timed pass
            self._buffers.append(memoryview(buf))
        self.pool = ThreadPoolExecutor(self.threads, "block-size-read")

    def _buffer(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            with self._lock:
                buf = self._local.buf = self._buffers.pop()
        assert isinstance(buf, memoryview)
        return buf

    def _read(self, batch: list[tuple[int, int]], deadline: float) -> int:
        if time.perf_counter() > deadline:
            return 0
        buf = self._buffer()
        done = 0
        for offset, length in batch:
            got = 0
            while got < length:
                n = os.preadv(self.fd, [buf[got:length]], offset + got)
                if n <= 0:
                    raise OSError(f"short read at byte {offset + got}")
                got += n
            done += length
        return done

    def run(self, ranges: Sequence[tuple[int, int]], max_seconds: float) -> tuple[int, float]:
        """Read the ranges (in order, ``threads`` calls in flight); stop starting new calls after
        ``max_seconds``. Returns (bytes read, seconds)."""
        t0 = time.perf_counter()
        deadline = t0 + max_seconds
        futures = [self.pool.submit(self._read, b, deadline) for b in batches(split(ranges))]
        total = sum(f.result() for f in futures)
        return total, time.perf_counter() - t0

    def close(self) -> None:
        self.pool.shutdown()


def pass_ranges(
    size: int, block: int | None, nbytes: int, rng: np.random.Generator
) -> list[tuple[int, int]]:
    """About ``nbytes`` of the file: a sequential stretch from a random offset (``block=None``)
    or blocks of ``block`` bytes, from a random rotation, in a random permutation."""
    nbytes = min(nbytes, size)
    if block is None:
        start = int(rng.integers(0, size - nbytes + 1))
        return [(start, nbytes)]
    shift = int(rng.integers(0, block))
    count = (size - shift) // block
    take = min(count, -(-nbytes // block))
    chosen = rng.permutation(count)[:take]
    return [(shift + int(k) * block, block) for k in chosen]


# --- the read measurement ----------------------------------------------------------------------


def generate(path: Path, size: int, seed: int = 0) -> float:
    """Write ``size`` random bytes to ``path`` (synced); returns the seconds it took."""
    t0 = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    rng = np.random.default_rng(seed)
    piece = 64 * 2**20
    with open(tmp, "wb") as f:
        left = size
        while left > 0:
            n = min(piece, left)
            words = rng.integers(0, 2**63, size=-(-n // 8), dtype=np.uint64)
            f.write(memoryview(words.view(np.uint8))[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
    return time.perf_counter() - t0


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


def measure_reads(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The read measurement; returns (notes, markdown table lines)."""
    path = Path(args.file)
    size = int(args.size_gib * 2**30)
    notes = []
    if path.exists() and path.stat().st_size == size:
        notes.append(f"file: {path}, {size / 2**30:g} GiB of random bytes (reused)")
    else:
        secs = generate(path, size)
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
            notes.append("the file was deleted afterwards (--keep keeps it)")
    return notes, read_table(rows, args.row_bytes)


def read_table(rows: Sequence[ReadRow], row_bytes: int) -> list[str]:
    seq = rows[0]
    seq_cold, seq_warm = _med(seq.cold), _med(seq.warm)
    lines = [
        f"| block | samples of a {row_bytes}-byte row | cold MB/s, median (min-max) "
        "| ÷ sequential, cold | MiB read per cold pass | warm MB/s, median | ÷ sequential, warm |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        samples = "—" if r.block is None else f"{r.block / row_bytes:,.1f}"
        cold = f"{_med(r.cold):,.0f} ({min(r.cold):,.0f}-{max(r.cold):,.0f})" if r.cold else "—"
        warm = f"{_med(r.warm):,.0f}" if r.warm else "—"
        lines.append(
            f"| {r.name} | {samples} | {cold} | {_med(r.cold) / seq_cold:.2f} "
            f"| {_med([float(b) for b in r.cold_bytes]) / 2**20:,.0f} | {warm} "
            f"| {f'{_med(r.warm) / seq_warm:.2f}' if r.warm else '—'} |"
        )
    # The smallest block from which on every larger block keeps the target too: one noisy pass
    # of a small block that happens to pass does not make it the answer.
    blocks = sorted((r for r in rows if r.block is not None), key=lambda r: r.block or 0)
    steady: ReadRow | None = None
    for r in reversed(blocks):
        if _med(r.cold) < TARGET * seq_cold:
            break
        steady = r
    first = next((r for r in blocks if _med(r.cold) >= TARGET * seq_cold), None)
    lines.append("")
    if steady is not None and steady.block is not None:
        lines.append(
            f"Smallest block from which every larger block keeps a cold read rate >= {TARGET:.0%} "
            f"of the sequential read: **{_size(steady.block)}** ({steady.block // row_bytes:,} "
            f"samples of {row_bytes} bytes; {_med(steady.cold) / seq_cold:.2f} of sequential)."
        )
        if first is not steady and first is not None and first.block is not None:
            lines.append(
                f"(A smaller one, {_size(first.block)}, also reached it, but some larger blocks "
                "did not: noise, or a real dip; look at the passes.)"
            )
    else:
        lines.append(
            f"The largest block measured does not reach {TARGET:.0%} of the sequential rate."
        )
    lines.append(
        f"The current default, BLOCK_BYTES = {_size(BLOCK_BYTES)}, reads at "
        f"{_default_ratio(rows, seq_cold)} of sequential (cold)."
    )
    return lines


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


def measure_layer(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The layer measurement; returns (notes, markdown table lines)."""
    import anyio

    from asynchdf5 import AsyncHDF5DataLayer
    from asynchdf5._cache import N_SLOTS
    from benchmarks import data

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
            notes.append("the generated data set was deleted afterwards (--keep keeps it)")
    base = rows[0]
    lines = [
        "| mode | cold samples/s, median | ÷ shuffle=False | reader MB/s, cold "
        "| warm samples/s, median | ÷ shuffle=False | reader MB/s, warm | first epoch s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {_med(r.cold):,.0f} | {_med(r.cold) / _med(base.cold):.2f} "
            f"| {_med(r.cold_read):,.0f} | {_med(r.warm):,.0f} "
            f"| {_med(r.warm) / _med(base.warm):.2f} | {_med(r.warm_read):,.0f} "
            f"| {r.first_epoch_s:.1f} |"
        )
    return notes, lines


# --- command line ------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.block_size",
        description="Read rate of block-wise random reads against a sequential read (read), and "
        "the layer's epoch rate per shuffle mode (layer). Prints markdown. Timing-sensitive: run "
        "on a quiet machine.",
    )
    p.add_argument("what", nargs="?", choices=("read", "layer"), default="read")
    p.add_argument("--repeats", type=int, default=3, help="passes per configuration (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the generated file(s)")
    p.add_argument("--row-bytes", type=int, default=IMAGE_ROW_BYTES, help="to express blocks")
    p.add_argument("--output", help="also write the markdown to this file")
    g = p.add_argument_group("read")
    g.add_argument(
        "--file",
        default=str(DEFAULT_DATA_DIR / "block-size-read.bin"),
        help="the file read (generated unless it exists with --size-gib)",
    )
    g.add_argument("--size-gib", type=float, default=8.0, help="file size (default 8 GiB)")
    g.add_argument(
        "--pass-gib", type=float, default=1.0, help="bytes read per pass (default 1 GiB)"
    )
    g.add_argument(
        "--pass-seconds",
        type=float,
        default=20.0,
        help="a pass stops starting reads after this long (default 20 s)",
    )
    g.add_argument("--threads", type=int, default=READ_THREADS, help="reader threads (2)")
    g.add_argument("--min-log2", type=int, default=16, help="smallest block, 2**k bytes (64 KiB)")
    g.add_argument("--max-log2", type=int, default=26, help="largest block, 2**k bytes (64 MiB)")
    g.add_argument("--no-warm", action="store_true", help="skip the warm-cache passes")
    g = p.add_argument_group("layer")
    g.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    g.add_argument(
        "--samples", type=int, default=2_000_000, help="image samples (default 2,000,000: 6.2 GB)"
    )
    g.add_argument("--chunk-size", type=int, default=2**18, help="default 2**18")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    started, t0 = utc_now(), time.perf_counter()
    load0 = os.getloadavg()
    if args.what == "read":
        notes, table = measure_reads(args)
    else:
        notes, table = measure_layer(args)
    load1 = os.getloadavg()
    notes.append(
        f"load average (1/5/15 min) at start {' / '.join(f'{x:.2f}' for x in load0)}, at end "
        f"{' / '.join(f'{x:.2f}' for x in load1)}"
    )
    lines = [
        *header(argv, "benchmarks.block_size", started, time.perf_counter() - t0),
        "",
        *(f"- {note}" for note in notes),
        "",
        *table,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
