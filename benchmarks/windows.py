"""Language-model token windows: :class:`asynchdf5.Windows` against nanoGPT's ``get_batch``.

``python -m benchmarks run windows [--quick]``

One stream of uint16 tokens (seeded random values) is written twice with the same bytes: as the
raw file nanoGPT's ``prepare.py`` writes (``train.bin``, read with ``np.memmap``) and as the
contiguous dataset ``tokens`` of an HDF5 file. A sample is a window of ``BLOCK + 1`` tokens
(nanoGPT's inputs ``x`` and targets ``y``, shifted by one), a batch ``BATCH`` of them, and both
loaders hand over the same thing: ``x`` and ``y`` as int64 torch tensors (NumPy arrays where
torch is missing).

* **nanoGPT**: its ``get_batch`` as written: a fresh ``np.memmap`` per batch, ``BATCH`` random
  offsets, ``torch.stack`` of ``torch.from_numpy(data[i:i + BLOCK].astype(np.int64))``.
* **Windows**: ``HDF5DataLayer(tops=(Windows("tokens", BLOCK + 1, BLOCK),), shuffle=True)``
  through ``stream()``; each batch converted as nanoGPT converts its rows
  (``astype(np.int64)``, then ``x, y = t[:, :-1], t[:, 1:]``).

Measured:

* **warm** (both files read into the page cache first): both in this process, one after the
  other, a few rounds: nanoGPT for a number of batches, then a layer opened, two whole epochs
  of it (the first from the opening, its read of the stream from the page cache included; the
  second served from what the first read, where the stream fits the cache) and closed, so that
  none of its threads runs while nanoGPT is timed; the median samples/s of each, and ratios.
* **limited** (out of core): each loader in a child process that joins a 512 MiB memory cgroup
  after its imports (:mod:`benchmarks.cgroups`; where none can be made, the run says so and
  measures without), its file evicted from the page cache first, the stream several times the
  limit; samples/s over ``LIMIT_S`` seconds after the first batch, and the ratio.
* **mixing**: how well a batch spreads over the stream: each sample labelled by the tenth of the
  stream its window starts in, the mean per-batch entropy of those labels (over log 10), for the
  layer's batches and for nanoGPT's random offsets, and their ratio.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import h5py
import numpy as np
import numpy.typing as npt

from benchmarks.page_cache import evict, resident_fraction

BLOCK = 1024  # nanoGPT's block_size
BATCH = 32
ROUND = 40  # nanoGPT's warm-up batches
LIMIT_MIB = 512
REGIONS = 10  # the tenths of the stream a sample's window starts in (mixing)


class Recorder(Protocol):
    """What :func:`bench` needs of the benchmark suite's recorder (``benchmarks.report``)."""

    quick: bool
    data_dir: Path

    def figure(self, name: str, value: float | None, unit: str) -> None: ...
    def ratio(self, name: str, num: float | None, den: float | None) -> None: ...
    def param(self, **params: Any) -> None: ...
    def note(self, text: str) -> None: ...


# --- data ---------------------------------------------------------------------------------------


def write(folder: Path, tokens: int) -> tuple[Path, Path]:
    """``train.bin`` and ``tokens.h5`` holding the same ``tokens`` uint16 values (kept while
    their size and the marker file say they are complete)."""
    folder.mkdir(parents=True, exist_ok=True)
    raw, h5 = folder / "train.bin", folder / "tokens.h5"
    marker = folder / f"complete-{tokens}"
    if marker.exists() and raw.exists() and h5.exists():
        return raw, h5
    marker.unlink(missing_ok=True)
    rng = np.random.default_rng(0)
    step = 1 << 24
    with open(raw, "wb") as r, h5py.File(h5, "w") as f:
        d = f.create_dataset("tokens", (tokens,), np.uint16)  # contiguous
        for a in range(0, tokens, step):
            b = min(tokens, a + step)
            part = rng.integers(0, 50257, b - a, dtype=np.uint16)  # GPT-2's vocabulary
            r.write(part.tobytes())
            d[a:b] = part
    for p in (raw, h5):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    marker.touch()
    return raw, h5


# --- the two loaders ----------------------------------------------------------------------------


def _torch(use: bool = True) -> Any:
    """torch, or None where it is missing or not ``use``d (the quick run: its import alone
    takes seconds in each child)."""
    if not use:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch


def nanogpt(raw: Path, seed: int, torch: Any) -> Iterator[tuple[Any, Any, npt.NDArray[np.int64]]]:
    """nanoGPT's ``get_batch`` (train split), endlessly: ``(x, y, offsets)``."""
    rng = np.random.default_rng(seed)
    if torch is not None:
        torch.manual_seed(seed)
    while True:
        data = np.memmap(raw, dtype=np.uint16, mode="r")  # fresh each batch, as nanoGPT does
        if torch is not None:
            ix = torch.randint(len(data) - BLOCK, (BATCH,))
            x = torch.stack([torch.from_numpy(data[i : i + BLOCK].astype(np.int64)) for i in ix])
            y = torch.stack(
                [torch.from_numpy(data[i + 1 : i + 1 + BLOCK].astype(np.int64)) for i in ix]
            )
            yield x, y, ix.numpy()
        else:
            ixn = rng.integers(0, len(data) - BLOCK, BATCH)
            x = np.stack([data[i : i + BLOCK].astype(np.int64) for i in ixn])
            y = np.stack([data[i + 1 : i + 1 + BLOCK].astype(np.int64) for i in ixn])
            yield x, y, ixn


def windows_layer(h5: Path, seed: int) -> Any:
    from asynchdf5 import HDF5DataLayer, Windows

    top = Windows("tokens", length=BLOCK + 1, stride=BLOCK)
    return HDF5DataLayer(h5, tops=(top,), batch_size=BATCH, shuffle=True, seed=seed)


def windows(
    layer: Any, torch: Any, endless: bool = True
) -> Iterator[tuple[Any, Any, npt.NDArray[np.int64]]]:
    """The layer's batches (``stream()``, or one epoch) as nanoGPT's ``(x, y)``, with the
    windows' start offsets."""
    for batch in layer.stream() if endless else layer:
        t = batch["tokens"].astype(np.int64)
        if torch is not None:
            t = torch.from_numpy(t)
        yield t[:, :-1], t[:, 1:], np.asarray(batch.indices) * BLOCK


# --- warm ---------------------------------------------------------------------------------------


def _timed(batches: Iterator[Any], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        x, _, _ = next(batches)
        _ = x[0, 0]  # (touched)
    return n * BATCH / (time.perf_counter() - t0)


def page_in(paths: tuple[Path, ...]) -> dict[str, float | None]:
    """Read each file once (into the page cache); the share of its pages resident after."""
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass
    return {p.name: resident_fraction(p) for p in paths}


def layer_epochs(h5: Path, torch: Any, seed: int) -> tuple[float, float]:
    """A layer opened now and two whole epochs of it: samples/s of the first from the opening,
    its read of the stream included (nothing of it read ahead while something else was timed),
    and of the second (served from what the first read, where the stream fits the cache)."""
    rates = []
    t0 = time.perf_counter()
    with windows_layer(h5, seed) as layer:
        for _ in range(2):
            n = 0
            for x, _, _ in windows(layer, torch, endless=False):
                _ = x[0, 0]  # (touched)
                n += len(x)
            t1 = time.perf_counter()
            rates.append(n / (t1 - t0))
            t0 = t1
    return rates[0], rates[1]


def warm(raw: Path, h5: Path, rounds: int, nano_batches: int, torch: Any) -> dict[str, Any]:
    """Both loaders in this process, one after the other, ``rounds`` times: nanoGPT for
    ``nano_batches`` batches, then a layer's whole epoch (opened and closed in the round, so
    that no reader thread of it runs while nanoGPT is timed); medians of samples/s."""
    theirs = nanogpt(raw, 0, torch)
    _timed(theirs, ROUND)  # warm-up: imports, the first maps
    rates: dict[str, list[float]] = {"windows": [], "windows_again": [], "nanogpt": []}
    for k in range(rounds):
        rates["nanogpt"].append(_timed(theirs, nano_batches))
        first, again = layer_epochs(h5, torch, seed=k)
        rates["windows"].append(first)
        rates["windows_again"].append(again)
    return {k: statistics.median(v) for k, v in rates.items()} | {"rates": rates}


# --- mixing -------------------------------------------------------------------------------------


def _entropy(labels: npt.NDArray[np.int64]) -> float:
    """Mean per-batch entropy of region labels (batches of BATCH), over log(REGIONS)."""
    nb = len(labels) // BATCH
    rows = np.repeat(np.arange(nb, dtype=np.int64), BATCH)
    counts = np.bincount(rows * REGIONS + labels[: nb * BATCH], minlength=nb * REGIONS)
    p = counts.reshape(nb, REGIONS) / BATCH
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(p), 0.0)
    return float((-terms.sum(axis=1) / math.log(REGIONS)).mean())


def mixing(raw: Path, h5: Path, batches: int) -> dict[str, float]:
    n_tokens = os.path.getsize(raw) // 2
    with windows_layer(h5, seed=1) as layer:
        it = windows(layer, None)
        mine = np.concatenate([next(it)[2] for _ in range(batches)])
        it.close()  # type: ignore[attr-defined]
    theirs_it = nanogpt(raw, 1, None)
    theirs = np.concatenate([next(theirs_it)[2] for _ in range(batches)])

    def region(offsets: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        return (offsets * REGIONS // n_tokens).astype(np.int64)

    a, b = _entropy(region(mine)), _entropy(region(theirs))
    return {"windows": a, "nanogpt": b, "ratio": a / b}


# --- limited (a child process in a memory cgroup) -----------------------------------------------


def child(job_file: str) -> None:
    """One loader, in this process: imports, then joins the cgroup, then reads for the job's
    seconds after the first batch; prints its figures as JSON."""
    job = json.loads(Path(job_file).read_text())
    torch = _torch(job["torch"])
    import asynchdf5  # noqa: F401  (imported before the limit applies, as the interpreter is)

    if job["procs"]:
        from benchmarks import cgroups

        cgroups.join(job["procs"])
    t0 = time.perf_counter()
    layer = None
    if job["reader"] == "windows":
        layer = windows_layer(Path(job["h5"]), seed=2)
        layer.__enter__()
        it = windows(layer, torch)
    else:
        it = nanogpt(Path(job["raw"]), 2, torch)
    next(it)
    first = time.perf_counter() - t0
    n, t1 = 0, time.perf_counter()
    while time.perf_counter() - t1 < job["seconds"]:
        next(it)
        n += 1
    rate = n * BATCH / (time.perf_counter() - t1)
    if layer is not None:
        it.close()  # type: ignore[attr-defined]
        layer.__exit__(None, None, None)
    print(json.dumps({"samples_per_s": rate, "first_batch_s": first, "batches": n}))


def limited(raw: Path, h5: Path, seconds: float, work: Path, torch: bool) -> dict[str, Any]:
    from benchmarks import cgroups

    out: dict[str, Any] = {}
    for reader in ("windows", "nanogpt"):
        evict(raw)
        evict(h5)
        made = cgroups.make(f"asynchdf5-windows-{os.getpid()}-{reader}", LIMIT_MIB * 2**20)
        group = None if isinstance(made, str) else made
        out["cgroup"] = made if isinstance(made, str) else f"cgroup v{made.version}"
        job = work / f"windows-{reader}.json"
        job.write_text(
            json.dumps(
                {
                    "reader": reader,
                    "raw": str(raw),
                    "h5": str(h5),
                    "seconds": seconds,
                    "torch": torch,
                    "procs": str(group.procs) if group else None,
                }
            )
        )
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.windows", "--child", str(job)],
                capture_output=True,
                text=True,
                timeout=seconds * 4 + 120,
                cwd=Path(__file__).resolve().parent.parent,
            )
            if proc.returncode != 0:
                out[reader] = {"error": (proc.stderr or proc.stdout)[-1500:]}
            else:
                out[reader] = json.loads(proc.stdout.strip().splitlines()[-1])
            if group is not None:
                peak = group.peak_bytes()
                out[reader]["cgroup_peak_mib"] = None if peak is None else peak / 2**20
        finally:
            if group is not None:
                group.remove()
            job.unlink(missing_ok=True)
    return out


# --- the suite's entry --------------------------------------------------------------------------


def bench(rec: Recorder) -> None:
    """Warm, limited and mixing figures, as ratios of the layer to nanoGPT in one run."""
    tokens = (16 << 20) // 2 if rec.quick else (2 << 30) // 2
    rounds, nano, seconds, mix = (2, 40, 0.5, 50) if rec.quick else (3, 600, 20.0, 2000)
    torch = _torch(not rec.quick)
    rec.param(
        tokens=tokens,
        stream_mib=tokens * 2 / 2**20,
        block=BLOCK,
        batch_size=BATCH,
        rounds=rounds,
        nanogpt_batches_per_round=nano,
        limit_mib=LIMIT_MIB,
        limited_seconds=seconds,
        mixing_batches=mix,
        torch=torch is not None,
        load_average=list(os.getloadavg()),
    )
    raw, h5 = write(rec.data_dir / "windows", tokens)
    before = page_in((raw, h5))
    w = warm(raw, h5, rounds, nano, torch)
    after = {p.name: resident_fraction(p) for p in (raw, h5)}
    rec.note(
        "warm: the files read once first; pages resident before / after the rounds: "
        + ", ".join(f"{k} {before[k] or 0:.0%} / {after[k] or 0:.0%}" for k in before)
    )
    rec.figure("warm, Windows, first epoch from opening", w["windows"], "samples/s")
    rec.figure("warm, Windows, second epoch", w["windows_again"], "samples/s")
    rec.figure("warm, nanoGPT get_batch", w["nanogpt"], "samples/s")
    rec.ratio("warm, Windows first epoch ÷ nanoGPT", w["windows"], w["nanogpt"])
    rec.ratio("warm, Windows second epoch ÷ nanoGPT", w["windows_again"], w["nanogpt"])
    m = mixing(raw, h5, mix)
    rec.figure("mixing, Windows (region entropy)", m["windows"], "entropy")
    rec.figure("mixing, nanoGPT random offsets (region entropy)", m["nanogpt"], "entropy")
    rec.ratio("mixing, Windows ÷ random offsets", m["windows"], m["nanogpt"])
    lim = limited(raw, h5, seconds, rec.data_dir, torch is not None)
    rec.note(f"limited runs: {lim.get('cgroup')}, {LIMIT_MIB} MiB, load {os.getloadavg()}")
    rates = {}
    for reader in ("windows", "nanogpt"):
        r = lim.get(reader, {})
        if "error" in r:
            rec.note(f"limited, {reader} failed: {r['error'].strip().splitlines()[-1:]}")
            continue
        rates[reader] = r.get("samples_per_s")
        rec.figure(f"limited, {reader}", rates[reader], "samples/s")
        rec.figure(f"limited, {reader}, cgroup peak", r.get("cgroup_peak_mib"), "MiB")
    rec.ratio("limited, Windows ÷ nanoGPT", rates.get("windows"), rates.get("nanogpt"))


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--child":
        child(argv[1])
        return 0
    print("run it through the suite: python -m benchmarks run windows [--quick]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
