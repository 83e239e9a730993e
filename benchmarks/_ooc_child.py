"""One reader of the out-of-core benchmark, in its own process:
``python -m benchmarks._ooc_child JOB.json RESULT.json``.

The child imports what its reader needs, then joins the memory cgroup named in the job (so the
limit caps what the reader uses, not the interpreter and its libraries), then reads and writes
its figures. Every batch is touched (one byte of every sample summed) so that lazy paths are not
flattered. CPU time is the process's own and its reaped children's (DataLoader workers), over the
reading only.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

SHAPE = (3, 32, 32)
CLASSES = 10


def cpu_seconds() -> float:
    """User + system seconds of this process and its reaped children."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def label_entropy(labels: npt.NDArray[np.int64], batch_size: int) -> float:
    """Mean label entropy of the full batches (consecutive cuts of ``labels``) / log(10)."""
    nb = len(labels) // batch_size
    if nb == 0:
        return float("nan")
    rows = np.repeat(np.arange(nb, dtype=np.int64), batch_size)
    counts = np.bincount(rows * CLASSES + labels[: nb * batch_size], minlength=nb * CLASSES)
    p = counts.reshape(nb, CLASSES) / batch_size
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(p), 0.0)
    return float((-terms.sum(axis=1) / math.log(CLASSES)).mean())


def mixing(labels: npt.NDArray[np.int64], batch_size: int, seed: int) -> dict[str, float]:
    """The epoch's mean per-batch label entropy, a random permutation's of the same labels, and
    their ratio."""
    mine = label_entropy(labels, batch_size)
    full = label_entropy(np.random.default_rng(seed).permutation(labels), batch_size)
    return {"entropy": mine, "permutation_entropy": full, "ratio": mine / full}


class Clock:
    """Samples, time to the first batch and the touch checksum of one pass."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.first: float | None = None
        self.samples = 0
        self.first_samples = 0
        self.touched = 0

    def batch(self, data: Any) -> None:
        now = time.perf_counter()
        n = len(data)
        if self.first is None:
            self.first, self.first_samples = now, n
        self.touched += int(np.asarray(data[:, 0, 0, 0]).sum())
        self.samples += n


# --- readers -----------------------------------------------------------------------------------


def sequential(job: dict[str, Any]) -> dict[str, Any]:
    """One thread, ``os.preadv`` of the whole file (each of ``files``, one after the other) in
    pieces of ``piece_bytes``."""
    buf = bytearray(int(job["piece_bytes"]))
    view = memoryview(buf)
    view[:] = b"\1" * len(buf)  # touched before the clock starts
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    nbytes, touched = 0, 0
    for path in job.get("files") or [job["path"]]:
        fd = os.open(path, os.O_RDONLY)
        at = 0
        try:
            while True:
                n = os.preadv(fd, [view], at)
                if n <= 0:
                    break
                touched += int(buf[0])
                at += n
        finally:
            os.close(fd)
        nbytes += at
    secs = time.perf_counter() - t0
    samples = nbytes / job["sample_bytes"]  # sample-equivalents of the bytes read
    return {
        "passes": [{"samples": samples, "seconds": secs, "rate": samples / secs}],
        "bytes": nbytes,
        "first_batch_s": None,
        "cpu_s": cpu_seconds() - c0,
        "touched": touched,
    }


def random_reads(job: dict[str, Any]) -> dict[str, Any]:
    """The device's random-read rate at one read size: ``read_bytes`` at random offsets of the
    ``data`` dataset (aligned to 4 KiB), ``threads`` threads each with its reads in flight one
    at a time, read-ahead off (``POSIX_FADV_RANDOM``), until ``bound_s`` or the dataset's size
    has been read."""
    size = int(job["read_bytes"])
    span = int(job["n"]) * (int(job["sample_bytes"]) - 8)  # the data top's bytes
    starts = np.arange(0, max(1, span - size), 4096, dtype=np.int64)
    rng = np.random.default_rng(job["seed"])
    threads = int(job.get("threads", 8))
    count = max(threads, span // size)
    offsets = rng.choice(starts, size=min(count, len(starts)), replace=False)
    offsets += int(job["data_offset"])
    fd = os.open(job["path"], os.O_RDONLY)
    with contextlib.suppress(OSError):  # advice only
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    bufs = [bytearray(size) for _ in range(threads)]
    for b in bufs:
        b[:] = b"\1" * size  # touched before the clock starts
    bound = float(job["bound_s"])
    c0 = cpu_seconds()
    t0 = time.perf_counter()

    def worker(k: int) -> int:
        view, done = memoryview(bufs[k]), 0
        for off in offsets[k::threads]:
            if time.perf_counter() - t0 > bound:
                break
            done += os.preadv(fd, [view], int(off))
        return done

    try:
        with ThreadPoolExecutor(threads) as pool:
            nbytes = sum(pool.map(worker, range(threads)))
    finally:
        os.close(fd)
    secs = time.perf_counter() - t0
    samples = nbytes / job["sample_bytes"]
    return {
        "passes": [{"samples": samples, "seconds": secs, "rate": samples / secs}],
        "bytes": nbytes,
        "read_bytes": size,
        "first_batch_s": None,
        "cpu_s": cpu_seconds() - c0,
    }


def layer(job: dict[str, Any]) -> dict[str, Any]:
    """``AsyncHDF5DataLayer`` with default properties (and the job's ``layer_props``); ``epochs``
    epochs in one open."""
    import anyio

    from asynchdf5 import AsyncHDF5DataLayer
    from benchmarks.page_cache import resident_fraction

    shuffle = bool(job["shuffle"])
    out: dict[str, Any] = {"passes": []}
    files = job.get("files") or [job["path"]]

    async def run() -> None:
        t0 = time.perf_counter()
        lay = AsyncHDF5DataLayer(
            _source(job), batch_size=job["batch_size"], shuffle=shuffle, **job["layer_props"]
        )
        async with lay:
            start = t0
            for epoch in range(job["epochs"]):
                residency = None
                if epoch > 0:
                    sizes = {f: os.path.getsize(f) for f in files}
                    parts = [(resident_fraction(f) or 0.0) * b for f, b in sizes.items()]
                    residency = sum(parts) / max(1, sum(sizes.values()))
                    start = time.perf_counter()
                clock, labels = Clock(start), []
                async for batch in lay:
                    clock.batch(batch["data"])
                    labels.append(np.array(batch["label"], dtype=np.int64))
                end = time.perf_counter()
                p = {
                    "samples": clock.samples,
                    "seconds": end - start,
                    "rate": clock.samples / (end - start),
                    "first_batch_s": None if clock.first is None else clock.first - start,
                    "resident_before": residency,
                    "mixing": mixing(np.concatenate(labels), job["batch_size"], job["seed"])
                    if job.get("mixing", True)
                    else None,
                }
                out["passes"].append(p)
                if epoch == 0:
                    out["first_batch_s"] = p["first_batch_s"]
                start = time.perf_counter()
            s = lay.stats
            out["stats"] = {
                "read_paths": dict(s.read_paths),
                "read_notes": dict(s.read_notes),
                "chunk_rows": s.chunk_rows,
                "resident": s.resident,
                "bytes_read": s.bytes_read,
                "chunks_read": s.chunks_read,
                "read_seconds": s.read_seconds,
                "bottleneck": s.bottleneck(),
            }
            try:
                state = lay.state_dict()
                fp = state.get("fingerprint", state) if isinstance(state, dict) else {}
                out["stats"]["block_rows"] = fp.get("block_rows") if isinstance(fp, dict) else None
            except Exception as exc:  # the figure is extra; never lose the run for it
                out["stats"]["block_rows"] = f"unknown ({type(exc).__name__})"

    c0 = cpu_seconds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        anyio.run(run)
    out["cpu_s"] = cpu_seconds() - c0
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return out


def _source(job: dict[str, Any]) -> Any:
    """The layer's source: ``job["path"]``; or ``job["source"]``, a list of paths or
    ``{"streams": {name: {"paths": [...], "weight": w or None}}}``."""
    from asynchdf5 import Stream

    source = job.get("source", job["path"])
    if isinstance(source, dict):
        return {
            name: Stream(s["paths"], weight=s.get("weight"))
            for name, s in source["streams"].items()
        }
    return source


class H5BatchDataset:
    """A map-style dataset over h5py: ``__getitems__`` reads a batch with one sorted fancy-index
    read per top. The file is opened in whichever process first reads (each worker its own)."""

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n = path, n
        self.dsets: tuple[Any, Any] | None = None

    def __len__(self) -> int:
        return self.n

    def _open(self) -> tuple[Any, Any]:
        if self.dsets is None:
            import h5py

            f = h5py.File(self.path, "r")
            self.dsets = (f["data"], f["label"])
        return self.dsets

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        data, label = self._open()
        return data[i], label[i]

    def __getitems__(self, indices: list[int]) -> tuple[Any, Any]:
        import torch

        data, label = self._open()
        idx = np.sort(np.asarray(indices, dtype=np.int64))
        return torch.from_numpy(data[idx]), torch.from_numpy(label[idx])


def _as_is(x: Any) -> Any:
    return x


def _bounded(job: dict[str, Any], batches: Callable[[], Any]) -> dict[str, Any]:
    """Iterate ``batches()`` until ``bound_s`` seconds or one epoch of samples; the rate is
    taken from the first batch on (start-up is the time to the first batch)."""
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    clock = Clock(t0)
    it = batches()
    for data in it:
        clock.batch(data)
        if clock.samples >= job["n"] or time.perf_counter() - t0 > job["bound_s"]:
            break
    end = time.perf_counter()
    del it
    steady = clock.samples - clock.first_samples
    span = end - (clock.first or end)
    cpu = cpu_seconds() - c0
    return {
        "passes": [
            {
                "samples": clock.samples,
                "seconds": end - t0,
                "rate": steady / span if span > 0 else float("nan"),
                "first_batch_s": None if clock.first is None else clock.first - t0,
            }
        ],
        "first_batch_s": None if clock.first is None else clock.first - t0,
        "cpu_s": cpu,
        "touched": clock.touched,
    }


def torch_h5py(job: dict[str, Any]) -> dict[str, Any]:
    """``DataLoader`` (``workers`` workers) over :class:`H5BatchDataset`, random batches."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    def batches() -> Any:
        ds = H5BatchDataset(job["path"], job["n"])
        g = torch.Generator().manual_seed(job["seed"])
        sampler = BatchSampler(RandomSampler(ds, generator=g), job["batch_size"], drop_last=False)
        loader: Any = DataLoader(
            ds,  # type: ignore[arg-type]  # duck-typed map-style dataset
            batch_sampler=sampler,
            num_workers=job["workers"],
            collate_fn=_as_is,
        )
        for data, _label in loader:
            yield data.numpy()

    out = _bounded(job, batches)
    out["torch"] = torch.__version__
    # The workers have been joined: the largest of them (h5py's import runs a short-lived
    # subprocess too, of about 40 MiB, so smaller figures mean nothing).
    out["workers_maxrss_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return out


def memmap(job: dict[str, Any]) -> dict[str, Any]:
    """nanoGPT's ``get_batch``: a fresh ``np.memmap`` per batch, random indices (with
    replacement, unsorted), fancy-indexed."""
    rng = np.random.default_rng(job["seed"])
    n, b = job["n"], job["batch_size"]

    def batches() -> Any:
        while True:
            data = np.memmap(job["path"], np.uint8, "r", job["data_offset"], (n, *SHAPE))
            label = np.memmap(job["path"], np.int64, "r", job["label_offset"], (n,))
            ix = rng.integers(0, n, b)
            x, y = data[ix], label[ix]
            del data, label
            assert len(y) == len(x)
            yield x

    return _bounded(job, batches)


READERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "sequential": sequential,
    "random": random_reads,
    "layer": layer,
    "torch_h5py": torch_h5py,
    "memmap": memmap,
}


def _preload(kind: str) -> None:
    """Import the reader's libraries before joining the cgroup."""
    import h5py  # noqa: F401

    if kind == "layer":
        import anyio  # noqa: F401

        import asynchdf5  # noqa: F401
        import benchmarks.page_cache  # noqa: F401
    elif kind == "torch_h5py":
        import torch
        import torch.utils.data  # noqa: F401


def main(argv: list[str]) -> int:
    job_path, result_path = argv
    with open(job_path) as f:
        job = json.load(f)
    _preload(job["kind"])
    if job.get("cgroup_procs"):
        from benchmarks.cgroups import join

        join(job["cgroup_procs"])
    with open("/proc/self/cgroup") as f:
        where = [line.strip() for line in f if ":memory:" in line or line.startswith("0::")]
    out = READERS[job["kind"]](job)
    out["cgroup_seen"] = where
    out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(result_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
