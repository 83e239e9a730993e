"""Shuffle quality of the planner's epoch orders (``python -m benchmarks.shuffle_quality``).

No file is read: the orders come from :func:`asynchdf5._plan.plan_epoch` alone, with the sizes an
:class:`~asynchdf5.AsyncHDF5DataLayer` would use for an image row (uint8 3x32x32 + int64 label,
3,080 bytes): batch 256, ``chunk_size`` 2**20, ``first_rows`` = max(batch, 8 MiB // row bytes),
the ramp's lanes and ``block_size`` as the layer computes them for a contiguous local file, or
other block sizes.

The data set is *class-sorted*: sample ``i`` of ``N`` has label ``i * 10 // N`` (10 classes in
contiguous runs), the worst case for a loader that reads contiguous stretches. For every mode
(no shuffle, the old contiguous-chunk mode, blocks of several sizes, and a full random
permutation cut into batches of 256) and several (seed, epoch) pairs it measures:

* the mean per-batch label entropy divided by log(10) (1: every batch holds the 10 classes in
  equal parts; a batch of 256 drawn uniformly gets about 0.98-0.99, being finite), and the 5th
  percentile over the batches;
* Mosaic streaming's shuffle-quality metric: the Shannon entropy, in bits, of the histogram of
  the absolute differences between neighbouring global indices of the epoch's order (as in
  ``get_entropy`` of mosaicml/streaming ``simulation/core/shuffle_quality.py``: ``np.diff``,
  ``abs``, ``bincount``, ``-sum(p log2 p)``). That file also takes a harmonic mean with the same
  entropy of the shard ids; there are no shards here, so only the sample-level entropy is
  reported.

The serving order of an epoch is the concatenation, in chunk order, of each chunk's
``served_indices(order())``; batches are consecutive cuts of it (``EpochPlan.batch_sizes``), as
the layer's batcher cuts them across chunk boundaries.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from asynchdf5 import CacheBudgetWarning
from benchmarks.internals import (
    RAMP_TOP_LANES,
    chunk_lanes,
    default_block_rows,
    first_read,
    plan_epoch,
    size_cache,
)
from benchmarks.report import Recorder

__all__ = [
    "BATCH_SIZE",
    "CHUNK_SIZE",
    "CLASSES",
    "IMAGE_ROW_BYTES",
    "TABULAR_ROW_BYTES",
    "Mode",
    "OrderSpec",
    "batch_label_entropy",
    "epoch_order",
    "labels_of",
    "modes",
    "mosaic_entropy",
]

#: Bytes of one image sample: uint8 3x32x32 data + int64 label.
IMAGE_ROW_BYTES = 3 * 32 * 32 + 8
#: Bytes of one tabular sample: float32 x 64 + int64 label (the benchmark suite's tabular set).
TABULAR_ROW_BYTES = 64 * 4 + 8
BATCH_SIZE = 256
CHUNK_SIZE = 2**20
CLASSES = 10
#: The start of an epoch whose batches are averaged apart (the ramp of the first chunk).
FIRST_BATCHES = 100

Kind = Literal["sequential", "planner", "permutation"]


@dataclass(frozen=True)
class Mode:
    """One way of ordering an epoch.

    ``kind``: ``"sequential"`` (``shuffle=False``), ``"planner"`` (``shuffle=True`` with
    ``block_size``; ``None`` is the old mode, one contiguous stretch per chunk) or
    ``"permutation"`` (``np.random.permutation`` of all samples).
    """

    name: str
    kind: Kind
    block_size: int | None = None
    default: bool = False
    ramp: bool = True  # the first chunk split into growing sub-chunks, as the layer does
    lanes: int | None = None  # the ramp's lanes (None: as the layer computes them)


@dataclass(frozen=True)
class OrderSpec:
    """The sizes an epoch order depends on (besides the mode, seed and epoch)."""

    n: int
    batch_size: int = BATCH_SIZE
    chunk_size: int = CHUNK_SIZE
    row_bytes: int = IMAGE_ROW_BYTES

    @property
    def first_rows(self) -> int:
        """As the layer computes it for a contiguous local file, shuffled
        (:func:`asynchdf5._sizing.first_read`)."""
        return first_read(self.batch_size, self.row_bytes, shuffle=True)[0]

    @property
    def ramp_lanes(self) -> int:
        """The same read's lanes (:func:`asynchdf5._sizing.first_read`)."""
        return first_read(self.batch_size, self.row_bytes, shuffle=True)[1]

    @property
    def default_block(self) -> int:
        """``block_size=None``'s block, in samples, as the layer computes it for a contiguous
        local file (:func:`asynchdf5._sizing.default_block_rows`)."""
        return default_block_rows(self.row_bytes, self.chunk_size)


def _mib(nbytes: float) -> str:
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.4g} MiB"
    return f"{nbytes / 2**10:g} KiB"


def modes(
    spec: OrderSpec, block_bytes: Sequence[int] | None = None, *, extra: bool = True
) -> list[Mode]:
    """The modes compared: no shuffle, the old mode, blocks of ``block_bytes`` (default 64 KiB to
    256 MiB, x4), and a full permutation; with ``extra``, also the default block of a tabular row
    and the old and default modes without the first chunk's ramp."""
    if block_bytes is None:
        block_bytes = [2**16 * 4**k for k in range(7)]  # 64 KiB ... 256 MiB
    out = [
        Mode("no shuffle (shuffle=False)", "sequential"),
        Mode("old mode: one contiguous stretch per chunk", "planner", None),
    ]
    blocks: dict[int, Mode] = {}
    for nbytes in block_bytes:
        rows = max(1, nbytes // spec.row_bytes)
        blocks[rows] = Mode(f"blocks of {_mib(nbytes)} ({rows:,} samples)", "planner", rows)
    rows = spec.default_block
    blocks[rows] = Mode(
        f"blocks of {_mib(rows * spec.row_bytes)} ({rows:,} samples) **default**",
        "planner",
        rows,
        default=True,
    )
    tab = default_block_rows(TABULAR_ROW_BYTES, spec.chunk_size)
    if extra and spec.row_bytes != TABULAR_ROW_BYTES and tab not in blocks:
        blocks[tab] = Mode(
            f"blocks of {tab:,} samples (the default for a {TABULAR_ROW_BYTES}-byte tabular row)",
            "planner",
            tab,
        )
    out += [blocks[k] for k in sorted(blocks)]
    if not extra:
        return [*out, Mode(f"full random permutation, batches of {spec.batch_size}", "permutation")]
    # The first chunk's ramp (sub-chunks of first_rows, doubling) serves its first rows from a
    # few blocks (or short stretches): the same two modes without it show what it costs.
    out.append(Mode("old mode, without the first-chunk ramp", "planner", None, ramp=False))
    default_rows = spec.default_block
    out.append(
        Mode(
            f"default blocks ({default_rows:,}), the ramp in one lane (before it had lanes)",
            "planner",
            default_rows,
            lanes=1,
        )
    )
    out.append(
        Mode(
            f"default blocks ({default_rows:,}), without the ramp",
            "planner",
            default_rows,
            ramp=False,
        )
    )
    out.append(Mode(f"full random permutation, batches of {spec.batch_size}", "permutation"))
    return out


def epoch_order(mode: Mode, spec: OrderSpec, seed: int, epoch: int) -> npt.NDArray[np.int64]:
    """The global indices of epoch ``epoch`` in the order they are served."""
    if mode.kind == "permutation":
        rng = np.random.default_rng((seed, epoch, 12345))
        perm: npt.NDArray[np.int64] = rng.permutation(spec.n).astype(np.int64)
        return perm
    plan = plan_epoch(
        spec.n,
        epoch=epoch,
        batch_size=spec.batch_size,
        chunk_size=spec.chunk_size,
        shuffle=mode.kind == "planner",
        seed=seed,
        first_rows=spec.first_rows if mode.ramp else None,
        block_size=mode.block_size,
        ramp_lanes=spec.ramp_lanes if mode.lanes is None else mode.lanes,
        # The layer's ramp (more places each piece), but for the fixed lanes of older modes.
        ramp_top_lanes=RAMP_TOP_LANES if mode.lanes is None else None,
        even_chunks=mode.lanes is None,
    )
    out = np.empty(sum(c.size for c in plan.chunks), np.int64)
    at = 0
    for chunk in plan.chunks:
        served = chunk.served_indices(chunk.order())
        out[at : at + len(served)] = served
        at += len(served)
    return out


def labels_of(indices: npt.NDArray[np.int64], n: int) -> npt.NDArray[np.int64]:
    """Labels of a class-sorted data set: sample ``i`` of ``n`` is class ``i * 10 // n``."""
    labels: npt.NDArray[np.int64] = indices * CLASSES // n
    return labels


def batch_label_entropy(labels: npt.NDArray[np.int64], batch_size: int) -> npt.NDArray[np.float64]:
    """Label entropy of each full batch (consecutive cuts of ``labels``) divided by log(10)."""
    nb = len(labels) // batch_size
    rows = np.repeat(np.arange(nb, dtype=np.int64), batch_size)
    counts = np.bincount(rows * CLASSES + labels[: nb * batch_size], minlength=nb * CLASSES)
    p = counts.reshape(nb, CLASSES) / batch_size
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(p), 0.0)
    h: npt.NDArray[np.float64] = -terms.sum(axis=1) / math.log(CLASSES)
    return h


def mosaic_entropy(order: npt.NDArray[np.int64]) -> float:
    """Mosaic streaming's metric: entropy (bits) of the histogram of ``|diff(order)|``."""
    freqs = np.bincount(np.abs(np.diff(order)))
    freqs = freqs[freqs != 0]
    p = freqs / (len(order) - 1)
    return float(-(p * np.log2(p)).sum())


@dataclass(frozen=True)
class Quality:
    """One mode's figures, averaged over the (seed, epoch) pairs."""

    mode: Mode
    entropy: float  # mean per-batch label entropy / log(10)
    entropy_sd: float  # standard deviation of that mean over the pairs
    entropy_p5: float  # 5th percentile of the per-batch entropies, pooled
    entropy_first: float  # mean over the first FIRST_BATCHES batches of each epoch
    mosaic_bits: float
    orders: int
    seconds: float  # per order: planning, chunk permutations, global indices


def measure(mode: Mode, spec: OrderSpec, pairs: Sequence[tuple[int, int]]) -> Quality:
    """Average one mode's figures over the (seed, epoch) pairs."""
    means, mosaic, pooled, first = [], [], [], []
    plan_s = 0.0
    for seed, epoch in pairs:
        t0 = time.perf_counter()
        order = epoch_order(mode, spec, seed, epoch)
        plan_s += time.perf_counter() - t0
        h = batch_label_entropy(labels_of(order, spec.n), spec.batch_size)
        means.append(float(h.mean()))
        pooled.append(h)
        first.append(float(h[:FIRST_BATCHES].mean()))
        mosaic.append(mosaic_entropy(order))
    return Quality(
        mode=mode,
        entropy=float(np.mean(means)),
        entropy_sd=float(np.std(means)),
        entropy_p5=float(np.percentile(np.concatenate(pooled), 5)) + 0.0,
        entropy_first=float(np.mean(first)) + 0.0,
        mosaic_bits=float(np.mean(mosaic)),
        orders=len(pairs),
        seconds=plan_s / len(pairs),
    )


def pairs_of(seeds: int, epochs: int) -> list[tuple[int, int]]:
    return [(s, e) for s in range(seeds) for e in range(epochs)]


#: Row widths of ``--widths`` (bytes of a sample, label included), and memory budgets.
WIDTHS = (9, 64, IMAGE_ROW_BYTES, 150 * 2**10 + 8)
BUDGETS = {"24 GiB machine": 24 * 2**30 // 3, "512 MiB process": 512 * 2**20 // 3}


def widths(rec: Recorder, n: int, seeds: int, epochs: int) -> None:
    """The default shuffle's quality at each row width and budget: the cache's chunk rows,
    the default blocks, the chunks' lanes (as :class:`~asynchdf5.AsyncHDF5DataLayer` computes
    them for a local contiguous file), the batch label entropy against a full permutation's,
    and the median read (a range of a chunk)."""
    perm_mode = Mode("permutation", "permutation")
    for row_bytes in WIDTHS:
        for name, budget in BUDGETS.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CacheBudgetWarning)
                cache = size_cache(
                    n, row_bytes, batch_size=BATCH_SIZE, world_size=1, chunk_size=CHUNK_SIZE,
                    cache_bytes=budget,
                )  # fmt: skip
            spec = OrderSpec(n, BATCH_SIZE, cache.chunk_rows, row_bytes)
            block = default_block_rows(row_bytes, CHUNK_SIZE)
            lanes = chunk_lanes(cache.chunk_rows, block, row_bytes)
            ent, first, reads = [], [], []
            for seed, epoch in pairs_of(seeds, epochs):
                plan = plan_epoch(
                    n, epoch=epoch, batch_size=BATCH_SIZE, chunk_size=cache.chunk_rows,
                    shuffle=True, seed=seed, first_rows=spec.first_rows, block_size=block,
                    ramp_lanes=spec.ramp_lanes, chunk_lanes=lanes, ramp_top_lanes=RAMP_TOP_LANES,
                    even_chunks=True,
                )  # fmt: skip
                order = np.concatenate([c.served_indices(c.order()) for c in plan.chunks])
                h = batch_label_entropy(labels_of(order, n), BATCH_SIZE)
                p = batch_label_entropy(
                    labels_of(epoch_order(perm_mode, spec, seed, epoch), n), BATCH_SIZE
                )
                ent.append(h.mean() / p.mean())
                first.append(h[:FIRST_BATCHES].mean() / p[:FIRST_BATCHES].mean())
                reads += [b - a for c in plan.chunks for a, b in c.ranges]
            what = f"default shuffle, {row_bytes:,}-byte rows, {name}"
            rec.figure(f"{what}: batch label entropy ÷ permutation's", np.mean(ent), "ratio")
            rec.figure(f"{what}: first {FIRST_BATCHES} batches, the same", np.mean(first), "ratio")
            rec.figure(f"{what}: median read", np.median(reads) * row_bytes / 2**20, "MiB")
            rec.note(f"{what}: chunk rows {cache.chunk_rows:,}, block rows {block:,}, {lanes=}")


def bench(rec: Recorder) -> None:
    """Every mode's label entropy and Mosaic entropy against a full permutation's, then the
    default shuffle at several row widths and memory budgets."""
    n, seeds, epochs = (200_000, 1, 1) if rec.quick else (2_000_000, 3, 2)
    spec = OrderSpec(n, chunk_size=2**15 if rec.quick else CHUNK_SIZE)
    rec.param(samples=n, seeds=seeds, epochs=epochs, batch_size=spec.batch_size,
              chunk_size=spec.chunk_size, row_bytes=spec.row_bytes, classes=CLASSES)  # fmt: skip
    pairs = pairs_of(seeds, epochs)
    results = [measure(mode, spec, pairs) for mode in modes(spec)]
    full = next(r for r in results if r.mode.kind == "permutation")
    for r in results:
        rec.figure(f"{r.mode.name}: batch label entropy / log 10", r.entropy, "ratio")
        rec.ratio(f"{r.mode.name}: batch label entropy ÷ permutation's", r.entropy, full.entropy)
        rec.figure(f"{r.mode.name}: Mosaic entropy", r.mosaic_bits, "bits")
        rec.figure(f"{r.mode.name}: one epoch's order computed in", r.seconds, "s")
    widths(rec, n, seeds, epochs)
