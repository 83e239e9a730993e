"""``asynchdf5 bench``: one shuffled epoch of your own files through the layer, against limits.

Three measurements of the same samples, in this order:

1. **raw read**: the tops' stored bytes (contiguous extents, stored chunks) read with large
   ``os.preadv`` calls into one reused buffer, in file order, on one thread: what the storage
   gives with no HDF5, no decoding and no shuffle (local files only);
2. **the layer**: ``AsyncHDF5DataLayer`` with your properties, epochs timed from ``async with``,
   a consumer that does nothing with the batches (so the numbers are the loader's), and the
   layer's own stats: where each stage's time went and which one held the others up;
3. **in RAM**: every top loaded into memory (untimed), then one random permutation served with
   ``np.take`` into reused batch buffers: the ceiling of any loader on this machine (only when
   the data fits in a fraction of the memory).

The page cache is not dropped: on a second run, or for data smaller than the memory, reads come
from memory, and the raw read shows it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .. import AsyncHDF5DataLayer, DataLayerError
from .._catalog import Catalog, build_catalog
from .._config import DEFAULT_TOPS
from .._machine import memory_bytes
from .._sources import is_url, open_source
from ._inspect import Report, add_windows_argument, named_tops, render, report_on
from ._limits import Rate, in_ram, raw_read, stored_ranges
from ._util import (
    mib,
    plural,
    positive,
    progress_bar,
    run_async,
    size_in_bytes,
    table,
    write_json,
)

__all__ = ["add_parser", "run"]

FORMAT = "asynchdf5.bench/1"


# --- the layer ---------------------------------------------------------------------------------


def _properties(args: argparse.Namespace, tops: Sequence[str]) -> dict[str, Any]:
    return {
        "batch_size": args.batch_size,
        "tops": tuple(tops),
        "shuffle": args.shuffle,
        "seed": args.seed,
        "chunk_size": args.chunk_size,
        "block_size": args.block_size,
        "cache_bytes": args.cache_bytes,
        "prefetch": args.prefetch,
    }


async def layer_epochs(
    paths: Sequence[str], properties: dict[str, Any], epochs: int, row_bytes: int
) -> tuple[list[Rate], float, Any]:
    """Epochs through the layer: a rate per epoch, the time to open, the layer's stats."""
    layer = AsyncHDF5DataLayer(list(paths), **properties)
    rates: list[Rate] = []
    start = time.perf_counter()
    async with layer:
        opened = time.perf_counter() - start
        for epoch in range(epochs):
            if epoch:
                start = time.perf_counter()
            first: float | None = None
            samples = 0
            with progress_bar(
                layer.n_samples, f"epoch {epoch + 1}/{epochs}", "sample", leave=False
            ) as bar:
                async for batch in layer:
                    if first is None:
                        first = time.perf_counter() - start
                    samples += batch.size
                    bar.update(batch.size)
            seconds = time.perf_counter() - start
            rates.append(Rate(samples, samples * row_bytes, seconds, first, {"epoch": epoch + 1}))
        stats = layer.stats
    return rates, opened, stats


# --- the command -------------------------------------------------------------------------------


def _catalog(report: Report) -> tuple[Catalog, list[tuple[str, int, int]]]:
    files = open_source(report.entries)
    try:
        catalog = build_catalog(files, report.entries, report.tops)
        return catalog, stored_ranges(catalog)
    finally:
        files.close()


def bench(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    """Every measurement, as the JSON document (raises DataLayerError: the files changed)."""
    catalog, ranges = _catalog(report)
    # A ragged or sparse top's values count, on average (as inspect's sample bytes).
    n, row_bytes = catalog.n_samples, catalog.mean_row_bytes
    stored = sum(size for _, _, size in ranges)
    doc: dict[str, Any] = {
        "format": FORMAT,
        "source": report.source,
        "files": len(report.entries),
        "samples": n,
        "sample_bytes": row_bytes,
        "bytes": n * row_bytes,
        "stored_bytes": stored,
        "properties": {
            **_properties(args, report.tops),
            "tops": list(report.tops),
            "backend": args.backend,
        },
        "read_paths": report.read_paths,
        # Without --tops, on a file that lacks the default tops: what it offers (the largest
        # set benched).
        "offered": None if report.offered is None else report.offered.to_json(),
    }
    remote = any(is_url(e) for e in report.entries)
    # A variable-length dataset's stored bytes are its rows' references: its values lie in
    # HDF5's heap, where no raw read of the dataset reaches (nor a ratio to one means much).
    heaps = [t.name for t in catalog.tops.values() if t.ragged is not None and t.ragged.vlen]
    doc["heap_tops"] = heaps
    raw: Rate | None = None
    if args.raw_read and not remote and not heaps:
        raw = raw_read(ranges, n)
    doc["raw_read"] = raw and raw.to_json()
    skipped = None if raw else "remote source" if remote else "--no-raw-read"
    if heaps and not raw and not remote and args.raw_read:
        skipped = (
            f"{', '.join(heaps)}: variable-length, whose values lie in HDF5's heap, outside the "
            "dataset's stored bytes (its rows' references); `asynchdf5 pack` rewrites it as a "
            "ragged group, which a raw read measures"
        )
    doc["raw_read_skipped"] = skipped
    rates, opened, stats = run_async(
        layer_epochs,
        report.entries,
        _properties(args, report.tops),
        args.epochs,
        row_bytes,
        backend=args.backend,
    )
    samples, seconds = sum(r.samples for r in rates), sum(r.seconds for r in rates)
    doc["layer"] = {
        "open_seconds": opened,
        "first_batch_seconds": rates[0].first_batch_seconds,
        "samples_per_s": samples / max(seconds, 1e-9),
        "mb_per_s": samples * row_bytes / max(seconds, 1e-9) / 1e6,
        "epochs": [r.to_json() for r in rates],
    }
    ram: Rate | None = None
    budget = int(args.ram_fraction * memory_bytes())
    ragged = [t.name for t in catalog.tops.values() if t.ragged is not None]
    if not args.in_ram:
        doc["in_ram_skipped"] = "--no-in-ram"
    elif remote:
        doc["in_ram_skipped"] = "remote source"
    elif ragged:
        doc["in_ram_skipped"] = (
            f"{', '.join(ragged)}: ragged or sparse, where the in-RAM ceiling gathers rows of "
            "one shape"
        )
    elif n * row_bytes > budget:
        doc["in_ram_skipped"] = (
            f"{mib(n * row_bytes)} of samples is more than --ram-fraction {args.ram_fraction} "
            f"of the memory ({mib(budget)})"
        )
    else:
        ram = in_ram(catalog, args.batch_size, args.seed)
        doc["in_ram_skipped"] = None
    doc["in_ram"] = ram and ram.to_json()
    rate = doc["layer"]["samples_per_s"]
    doc["ratios"] = {
        "layer_to_raw_read": raw and rate / raw.samples_per_s,
        "layer_to_in_ram": ram and rate / ram.samples_per_s,
    }
    doc["stats"] = {
        "stages": {k: asdict(v) for k, v in stats.stages.items()},
        "bottleneck": stats.bottleneck(),
        "read_paths": stats.read_paths,
        "read_notes": stats.read_notes,
        "resident": stats.resident,
        "chunk_rows": stats.chunk_rows,
        "chunks_read": stats.chunks_read,
        "bytes_read": stats.bytes_read,
    }
    doc["hints"] = report.hints(report.tops)
    doc["layout_is_bottleneck"] = bool(doc["hints"]) and stats.bottleneck().startswith("reading")
    return doc


def _row(label: str, r: dict[str, Any] | None, raw: dict[str, Any] | None) -> list[str]:
    if r is None:
        return [label, "-", "-", "-", "-", "-"]
    first = r.get("first_batch_seconds")
    ratio = f"{r['samples_per_s'] / raw['samples_per_s']:.2f}x" if raw else "-"
    return [
        label,
        f"{r['samples_per_s']:,.0f}",
        f"{r['mb_per_s']:,.1f}",
        f"{r['seconds']:.3f}",
        "-" if first is None else f"{first * 1e3:.1f} ms",
        ratio,
    ]


def render_bench(doc: dict[str, Any]) -> str:
    props = ", ".join(f"{k}={v!r}" for k, v in doc["properties"].items())
    out = [
        f"bench {doc['source']}: {plural(doc['files'], 'file')}, "
        f"{plural(doc['samples'], 'sample')} of {doc['sample_bytes']:,} bytes "
        f"({mib(doc['bytes'])}; {mib(doc['stored_bytes'])} stored"
        + (f", besides the heap of {', '.join(doc['heap_tops'])})" if doc["heap_tops"] else ")"),
        f"properties: {props}",
        "",
    ]
    if doc["offered"] is not None:  # the tops were chosen here: say which, and how to choose
        found = doc["offered"]
        out[-1:-1] = [
            f"{found['path']} has no top {' or '.join(DEFAULT_TOPS)} (the default; --tops "
            f"names others): benched the largest set of tops it offers, as "
            f"`asynchdf5 inspect {doc['source']}` lists them:",
            f"  {found['layer']}",
        ]
    raw = doc["raw_read"]
    rows = [_row(f"layer, epoch {e['epoch']}", e, raw) for e in doc["layer"]["epochs"]]
    rows.append(_row("raw read (preadv, 1 thread)", raw, raw))
    rows.append(_row("in RAM (np.take ceiling)", doc["in_ram"], raw))
    out.append(table(["", "samples/s", "MB/s", "seconds", "first batch", "vs raw read"], rows))
    for what, words in (("raw_read", "raw read"), ("in_ram", "in RAM")):
        if doc[f"{what}_skipped"]:
            out.append(f"  ({words} skipped: {doc[f'{what}_skipped']})")
    lay, st = doc["layer"], doc["stats"]
    out += [
        "",
        f"layer: opened in {lay['open_seconds'] * 1e3:.0f} ms; chunks of "
        f"{st['chunk_rows']:,} samples"
        + (" (resident: read once, then served from memory)" if st["resident"] else "")
        + f"; read paths: {', '.join(f'{t} by {p}' for t, p in st['read_paths'].items())}",
        "where the time went (seconds, summed over the run):",
        table(
            ["stage", "busy", "starved", "blocked"],
            [
                [
                    k,
                    f"{v['busy_seconds']:.3f}",
                    f"{v['starved_seconds']:.3f}",
                    f"{v['blocked_seconds']:.3f}",
                ]
                for k, v in st["stages"].items()
            ],
            indent="    ",
        ),
        f"bottleneck: {st['bottleneck']}",
    ]
    if doc["hints"]:
        lead = (
            "the files' layout holds the reader back:"
            if doc["layout_is_bottleneck"]
            else "layout hints:"
        )
        out += ["", lead] + [f"  {h}" for h in doc["hints"]]
    return "\n".join(out)


def add_parser(commands: Any) -> None:
    """Register ``bench`` with the command line's subcommands."""
    p = commands.add_parser(
        "bench",
        help="time an epoch of your files through the layer, beside the raw read and in-RAM",
        description=(
            "One shuffled epoch (or more) of SOURCE through AsyncHDF5DataLayer with the given "
            "properties, beside the raw read of the same stored bytes (os.preadv) and, when the "
            "data fits in memory, the in-RAM ceiling (np.take of random batches): samples/s, "
            "MB/s, the first batch, where the layer's time went and which stage is the "
            "bottleneck, with a hint when the files' layout is why. No timing is reliable on a "
            "busy machine: compare runs made side by side."
        ),
    )
    p.add_argument("source", nargs="+", metavar="SOURCE", help="a source list file or HDF5 files")
    p.add_argument("--batch-size", type=positive, default=256, help="(default: %(default)s)")
    p.add_argument(
        "--tops",
        nargs="+",
        metavar="TOP",
        help=f"(default: {' '.join(DEFAULT_TOPS)}; where the file has no such top, the largest "
        "set of tops it offers, as `asynchdf5 inspect SOURCE` shows)",
    )
    add_windows_argument(p)
    p.add_argument(
        "--shuffle", action=argparse.BooleanOptionalAction, default=True, help="(default: on)"
    )
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--chunk-size", type=positive, default=2**20, help="(default: %(default)s)")
    p.add_argument(
        "--block-size",
        type=positive,
        default=None,
        help="(default: about 32 MiB of samples, at most chunk_size / 192)",
    )
    p.add_argument(
        "--cache-bytes", type=size_in_bytes, default=None, help="e.g. 2GiB (default: 1/3 of RAM)"
    )
    p.add_argument("--prefetch", type=positive, default=8, help="(default: %(default)s)")
    p.add_argument("--epochs", type=positive, default=1, help="(default: %(default)s)")
    p.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    p.add_argument(
        "--raw-read",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the raw read of the stored bytes (default: on)",
    )
    p.add_argument(
        "--in-ram",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the in-RAM ceiling when the data fits --ram-fraction (default: on)",
    )
    p.add_argument(
        "--ram-fraction",
        type=float,
        default=0.25,
        help="the in-RAM ceiling loads the data only if it fits this fraction of the physical "
        "memory (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON document instead")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    sources: list[str] = args.source
    try:
        tops = named_tops(args)
    except argparse.ArgumentTypeError as exc:
        print(f"asynchdf5 bench: error: {exc}", file=sys.stderr)
        return 2
    report = report_on(sources[0] if len(sources) == 1 else sources, tops)
    if not report.ok:  # what inspect says, and nothing measured
        if args.json:
            write_json({"format": FORMAT, "ok": False, "inspect": report.to_json()})
        else:
            print(render(report))
        return 1
    try:
        doc = bench(args, report)
    except DataLayerError as exc:
        print(f"asynchdf5 bench: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        write_json({"ok": True, **doc})
    else:
        print(render_bench(doc))
    return 0
