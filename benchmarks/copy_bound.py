"""What streaming can reach when it copies: ``python -m benchmarks.copy_bound``.

Streaming from a local file without ``mmap=True``, every byte is copied twice: the read copies a
chunk out of the page cache into a cache slot (``preadv``), and the gather copies its rows, in a
random order, into batch buffers. The in-RAM ceiling of ``benchmarks.speed`` (section 2) copies
each byte once. On a machine with few cores the two copies of a streaming pipeline run at the
same time, beside each other, and they share the caches and the memory bus: each is slower than
alone. This measures both copies on their own and side by side, on the image set and the
streaming configuration of ``benchmarks.speed`` (chunks of 65,536 samples, batch 256), all in one
run:

1. **ceiling**: an epoch of ``np.take`` over the arrays in RAM, one thread (``speed.py``'s), the
   best of 3 (it swings by up to 1.5x from one epoch to the next on the 2-vCPU VMs);
2. **gather**: the rows of one chunk in a page-aligned slot, in a random order, into rotating
   buffers of 10 batches (as the layer gathers a group), alone;
3. **read**: ``preadv`` of one chunk of the file (warm page cache) into a slot, alone;
4. the same two on two threads at once, each going for ~2 s: chunks per second of each;
5. the same two alone on two threads each (the chunk's rows or bytes split in halves);
6. the **bound**: a pipeline on two cores spends its time in some mix of three ways to use
   them: both copies side by side (one core each), the gather alone on both, the read alone on
   both (more threads than cores add no throughput). The best mix for a chunk's two copies
   (:func:`_best_mix`, a small linear program), times the chunks of an epoch, divided into the
   ceiling's epoch: the most of the ceiling a copying pipeline can stream at here, with no cost
   of its own;
7. 2-6 again with the slots on transparent huge pages (as NumPy gives the ceiling's arrays; the
   layer's are on 4 KiB pages, see ``asynchdf5._cache._anonymous``): the gather is faster
   there, the read slower; the better of the two bounds is the copying pipeline's;
8. ``AsyncHDF5DataLayer`` streaming, copying (``mmap=False``) and ``mmap=True``, in the same run.

Not a proof for every machine: a machine with more cores and memory channels, or a pipeline
that copies once (``mmap=True``), is not bound by it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import mmap
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from benchmarks.config import DEFAULT_DATA_DIR
from benchmarks.data import DatasetFiles, ensure
from benchmarks.speed import (
    Array,
    SpeedConfig,
    _ceiling_1,
    _header,
    _image_layer_kwargs,
    _load,
    _median,
    _run_async,
    _suite_set,
    _sync_deadline,
    _table,
)

#: Batches per gathered group (the layer's groups of images hold about 8 MiB: 10 batches).
GROUP = 10
#: Group buffers the gather rotates through (the layer's pool holds a few groups).
DEPTH = 6
#: Seconds each side-by-side measurement runs.
SIDE_BY_SIDE_S = 2.0


def _slot(nbytes: int, huge: bool = False) -> Array:
    """Page-aligned anonymous memory, touched: a cache slot as the layer allocates it (on 4 KiB
    pages), or with ``huge`` on transparent huge pages where the kernel gives them (as the
    ceiling's arrays, which NumPy allocates, are)."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(buf, np.uint8)
    a[:] = 0
    return a


class _Copies:
    """The two copies of a streaming pipeline over one chunk of ``rows`` samples of ``data``."""

    def __init__(
        self, files: DatasetFiles, rows: int, batch: int, seed: int, huge: bool = False
    ) -> None:
        with h5py.File(files.paths[0], "r") as f:
            ds = f["data"]
            self.offset = ds.id.get_offset()
            if self.offset is None or ds.chunks is not None:
                raise RuntimeError("the image set's data must be contiguous")
            self.row_bytes = int(np.prod(ds.shape[1:])) * ds.dtype.itemsize
            self.n = len(ds)
        self.fd = os.open(files.paths[0], os.O_RDONLY)
        self.rows, self.batch = rows, batch
        self.slots = [_slot(rows * self.row_bytes, huge) for _ in range(2)]
        group = GROUP * batch * self.row_bytes
        # Batch buffers start where the slot's rows do within a cache line (as the layer's).
        self.out = [_slot(group).reshape(GROUP * batch, self.row_bytes) for _ in range(DEPTH)]
        self.rng = np.random.default_rng(seed)
        self.chunks = (self.n - rows) // rows + 1  # chunk positions to read from

    def close(self) -> None:
        os.close(self.fd)

    def read(self, slot: int, k: int, part: tuple[int, int] = (0, 1)) -> None:
        """Part ``part[0]`` of ``part[1]`` of chunk ``k`` (mod the file) into slot ``slot``."""
        dest = self.slots[slot].data
        nbytes = self.rows * self.row_bytes
        a, b = nbytes * part[0] // part[1], nbytes * (part[0] + 1) // part[1]
        base = self.offset + (k % self.chunks) * nbytes
        pos = a
        while pos < b:
            end = min(b, pos + 32 * 2**20)
            got = os.preadv(self.fd, [dest[pos:end]], base + pos)
            if got <= 0:
                raise OSError(f"short read at {base + pos}")
            pos += got

    def gather(self, slot: int, part: tuple[int, int] = (0, 1)) -> None:
        """Part ``part[0]`` of ``part[1]`` of one chunk's groups, from slot ``slot``."""
        rows = self.slots[slot].reshape(self.rows, self.row_bytes)
        order = self.rng.permutation(self.rows)
        step = GROUP * self.batch
        mine = range(0, self.rows, step)[part[0] :: part[1]]
        for i, a in enumerate(mine):
            idx = order[a : a + step]
            out = self.out[i % DEPTH][: len(idx)]
            np.take(rows, idx, axis=0, out=out, mode="clip")


#: The ceiling of a round: the best of this many epochs (a limit is the best the machine does).
CEILING_EPOCHS = 3


def _best(fn: Callable[[], None], repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _halves(pool: ThreadPoolExecutor, fn: Callable[[tuple[int, int]], None]) -> None:
    list(pool.map(fn, [(0, 2), (1, 2)]))


def _side_by_side(c: _Copies) -> tuple[float, float]:
    """Seconds per chunk of the gather and of the read, each on its own thread, at once."""
    stop = threading.Event()
    counts: dict[str, tuple[int, float]] = {}

    def loop(name: str, step: Callable[[int], None]) -> None:
        k = 0
        t0 = time.perf_counter()
        while not stop.is_set():
            step(k)
            k += 1
        counts[name] = (k, time.perf_counter() - t0)

    threads = [
        threading.Thread(target=loop, args=("gather", lambda k: c.gather(0))),
        threading.Thread(target=loop, args=("read", lambda k: c.read(1, k))),
    ]
    for t in threads:
        t.start()
    time.sleep(SIDE_BY_SIDE_S)
    stop.set()
    for t in threads:
        t.join()
    (kg, sg), (kr, sr) = counts["gather"], counts["read"]
    return sg / kg, sr / kr


def _best_mix(g_side: float, r_side: float, g_two: float, r_two: float) -> tuple[float, float]:
    """The least time per chunk for both copies of a chunk on two cores, mixing three ways to
    use them: the two copies side by side (one core each, at their side-by-side rates), the
    gather alone on both, the read alone on both. A linear program in the time ``t`` spent side
    by side (the rest of each copy then runs alone on two threads): piecewise linear in ``t``,
    so least at ``t = 0``, ``g_side`` or ``r_side``. Returns (seconds, that ``t``)."""

    def total(t: float) -> float:
        return t + max(0.0, 1 - t / g_side) * g_two + max(0.0, 1 - t / r_side) * r_two

    return min((total(t), t) for t in (0.0, g_side, r_side))


async def _layer_epochs(kwargs: dict[str, Any], epochs: int) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds of each epoch of one opening."""
    import asynchdf5

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    out = []
    async with asynchdf5.AsyncHDF5DataLayer(**kwargs) as layer:
        for _ in range(epochs):
            t0, c0 = time.perf_counter(), cpu()
            async for _batch in layer:
                pass
            out.append((time.perf_counter() - t0, cpu() - c0))
    return out


def _copy_times(copies: _Copies, pool: ThreadPoolExecutor) -> dict[str, float]:
    """Seconds per chunk of each copy alone, side by side, and alone on two threads."""
    out = {
        "gather": _best(lambda: copies.gather(0)),
        "read": _best(lambda: copies.read(1, 2)),
    }
    out["gather beside read"], out["read beside gather"] = _side_by_side(copies)
    out["gather, 2 threads"] = _best(lambda: _halves(pool, lambda p: copies.gather(0, p)))
    out["read, 2 threads"] = _best(lambda: _halves(pool, lambda p: copies.read(1, 3, p)))
    return out


def run(cfg: SpeedConfig, rounds: int, argv: list[str]) -> str:
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    (files,) = ensure([_suite_set("contiguous", cfg.image_samples, cfg.tabular_rows)], cfg.data_dir)
    data, label = _load(files)
    n, b, rows = len(data), cfg.image_batch, min(cfg.image_chunk, len(data))
    kinds = {"4 KiB pages": _Copies(files, rows, b, cfg.seed)}
    kinds["huge pages"] = _Copies(files, rows, b, cfg.seed, huge=True)
    rng = np.random.default_rng(cfg.seed)
    kwargs = _image_layer_kwargs(files, cfg)
    m: dict[str, list[float]] = {}
    layers: dict[str, list[tuple[float, float]]] = {"copying": [], "mmap=True": []}
    try:
        with ThreadPoolExecutor(2) as pool:
            for copies in kinds.values():
                copies.read(0, 0)
                copies.read(1, 1)
            for _ in range(rounds):
                with _sync_deadline(cfg.deadline_s):
                    ceiling = min(_ceiling_1(data, label, b, rng) for _ in range(CEILING_EPOCHS))
                    m.setdefault("ceiling", []).append(ceiling)
                    for kind, copies in kinds.items():
                        for k, v in _copy_times(copies, pool).items():
                            m.setdefault(f"{k} ({kind})", []).append(v)
                for name, extra in (("copying", {"mmap": False}), ("mmap=True", {"mmap": True})):
                    runs = _run_async(
                        lambda extra=extra: _layer_epochs(  # type: ignore[misc]
                            {**kwargs, **extra}, cfg.layer_epochs
                        ),
                        cfg.deadline_s,
                    )
                    layers[name] += runs[1:]  # later epochs: the first opens the files
    finally:
        for copies in kinds.values():
            copies.close()

    med = {k: _median(v) for k, v in m.items()}
    per_epoch = n / rows
    ceiling = med["ceiling"]
    bounds: dict[str, tuple[float, float]] = {}  # kind: (s per chunk, time side by side)
    for kind in kinds:
        bounds[kind] = _best_mix(
            med[f"gather beside read ({kind})"],
            med[f"read beside gather ({kind})"],
            med[f"gather, 2 threads ({kind})"],
            med[f"read, 2 threads ({kind})"],
        )
    # The layer's slots are on 4 KiB pages: its bound is that kind's; the best copying
    # pipeline's is the better kind's.
    bound_epoch = bounds["4 KiB pages"][0] * per_epoch
    best_kind = min(bounds, key=lambda k: bounds[k][0])
    best_epoch = bounds[best_kind][0] * per_epoch
    row_bytes = kinds["4 KiB pages"].row_bytes
    lines = [
        "## The copying path's bound",
        "",
        f"image set: {n:,} x uint8 {'x'.join(map(str, data.shape[1:]))} + int64 label, "
        f"{files.paths[0].name} (contiguous, page cache warm); chunks of {rows:,} samples "
        f"({rows * row_bytes / 2**20:.0f} MiB of `data`), {per_epoch:.2f} per epoch; "
        f"batch {b}; medians over {rounds} round(s) (each single-copy time the best of 5, the "
        f"ceiling the best of {CEILING_EPOCHS} epochs). The slots on 4 KiB pages, as the "
        "layer's, and on huge pages, as the ceiling's arrays.",
        "",
        *_table(
            ["measurement", "s per chunk", "s per epoch", "÷ ceiling epoch"],
            [
                (k, f"{v:.4f}", f"{v * per_epoch:.3f}", f"{v * per_epoch / ceiling:.2f}")
                for k, v in med.items()
                if k != "ceiling"
            ]
            + [
                (
                    f"**the best mix, {kind}** (side by side {side:.4f} s, then the rest of "
                    "each copy alone on 2 threads)",
                    f"{chunk:.4f}",
                    f"{chunk * per_epoch:.3f}",
                    f"{chunk * per_epoch / ceiling:.2f}",
                )
                for kind, (chunk, side) in bounds.items()
            ],
        ),
        "",
        f"In-RAM ceiling (1 thread, whole arrays): {ceiling:.3f} s an epoch "
        f"({n / ceiling:,.0f} samples/s). Slowed beside the read (4 KiB pages), the gather took "
        f"{med['gather beside read (4 KiB pages)'] / med['gather (4 KiB pages)']:.2f} times as "
        "long as alone, and the read "
        f"{med['read beside gather (4 KiB pages)'] / med['read (4 KiB pages)']:.2f} times.",
        "",
        f"**Bound: a copying pipeline streams at most {ceiling / best_epoch:.2f} of the "
        f"ceiling here** (its slots on {best_kind}: {best_epoch:.3f} s an epoch, with no cost "
        f"of its own); on 4 KiB pages, as the layer's, at most {ceiling / bound_epoch:.2f}.",
        "",
    ]
    rows_out = []
    for name, runs in layers.items():
        wall = _median([w for w, _ in runs])
        cpu = _median([c for _, c in runs])
        rows_out.append(
            (
                f"`AsyncHDF5DataLayer`, {name}",
                f"{wall:.3f}",
                f"{ceiling / wall:.2f}",
                f"{bound_epoch / wall:.2f}",
                f"{cpu:.3f}",
                f"{cpu / wall:.2f}",
            )
        )
    lines += _table(
        ["layer (later epochs)", "s per epoch", "÷ ceiling", "÷ bound", "CPU s", "cores busy"],
        rows_out,
    )
    header = _header(argv, started, load0, time.perf_counter() - t_start)
    header[0] = "# asynchdf5: the copying path's bound (benchmarks.copy_bound)"
    header = [h.replace("benchmarks.speed", "benchmarks.copy_bound") for h in header]
    return "\n".join([*header, "", *lines]) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.copy_bound", description=__doc__)
    p.add_argument("--quick", action="store_true", help="20,000 images: a smoke test")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output", type=Path)
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    args = p.parse_args(argv)
    cfg = SpeedConfig(data_dir=args.data_dir)
    if args.quick:
        cfg = SpeedConfig(data_dir=args.data_dir, image_samples=20_000, image_chunk=2**12)
    text = run(cfg, 1 if args.quick else args.rounds, argv)
    print(text)
    if args.output:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
