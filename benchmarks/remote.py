"""Remote sources against an S3 API on localhost: ``python -m benchmarks run remote``.

The server is moto's, in a subprocess (``support/s3_server.py``), with a latency injected into
every request: its WSGI middleware sleeps 20 ms ( a realistic object
store round trip) in the request's own server thread before handling it, so concurrent requests
wait concurrently, as on a real link. moto reads a whole object for every ranged GET; the server
runs with ``--fast-ranges``, which serves ranged GETs of stored objects in O(range) straight from
moto's store (the same for every loader measured).

For each data set (the suite's image set, contiguous; and its gzip set), stored in one object:

* **parallel download** (the limit: the faster of two clients): the object's bytes fetched into
  memory with ranged GETs of 8 MiB, 16 in flight, each piece copied once into a buffer allocated
  and touched beforehand, best of three; with aiobotocore (s3fs's client) on one event loop, and
  with obstore (HTTP in Rust threads, outside the GIL) (:mod:`benchmarks.s3_download`);
* **asynchdf5 remote**, with each S3 client (obstore, the default where it may; s3fs):
  ``AsyncHDF5DataLayer`` on the ``s3://`` URL, shuffled, batches of 256,
  ``chunk_size`` 2^16 (streamed through the cache, as a set larger than memory must be): epoch 1
  from the layer's construction (the open included), then epoch 2, best of two layers; and with
  a ``remote_cache``, whose epoch 2 reads local disk;
* **a busy consumer**: the same, epoch 2, with 1 ms of pure Python per batch in
  the consumer, holding the GIL as a Python-heavy training step does;
* **h5py over an fsspec file object** (the usual user path): ``h5py.File(fs.open(url))`` with
  s3fs, a sorted fancy-index read per shuffled batch; with s3fs's default file cache (readahead,
  50 MiB blocks) and with small blocks (``block_size=256 KiB``, ``cache_type="blockcache"``),
  each time-bounded (20 s) and extrapolated to an epoch;
* **download first, then train locally**: the object downloaded to a local file (as the limit
  does, written with ``pwrite``), then the same layer over the local file, to the end of its
  first epoch; its second epoch is shown as the pipeline's own pace on this machine.

``--quick``: the contiguous set at 8,192 samples, no busy consumer, 0.3 s budgets.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import h5py
import numpy as np

from asynchdf5 import AsyncHDF5DataLayer
from benchmarks import data
from benchmarks.config import IMAGE_SHAPE, DatasetSpec
from benchmarks.report import Recorder
from benchmarks.s3_download import BUCKET, CPU, IN_FLIGHT, PART, download_limit, download_to
from support.s3_server import S3Server

#: The environment variable that chooses the S3 client (documented in docs/remote.md).
CLIENT_VARIABLE = "ASYNCHDF5_S3_CLIENT"
BATCH = 256
CHUNK = 2**16


@dataclass
class Row:
    """One measurement."""

    set: str
    loader: str
    seconds: float  # an epoch (extrapolated where ``extrapolated``)
    samples: int
    stored_bytes: int
    first_batch: float | None = None
    extrapolated: bool = False
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    cpu: tuple[float, float] | None = None  # CPU seconds of the client and of the server

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.stored_bytes / self.seconds / 1e6


def _spec(name: str, samples: int) -> DatasetSpec:
    gzip = name == "gzip"
    return DatasetSpec(
        name=name,
        title=f"image, {samples:,} x uint8 3x32x32 + int64 label, "
        + ("chunked (1024 samples), gzip 4 + shuffle" if gzip else "contiguous"),
        kind="image",
        samples=samples,
        shape=IMAGE_SHAPE,
        dtype="uint8",
        layout="gzip" if gzip else "contiguous",
    )


def _options(server: S3Server) -> dict[str, Any]:
    return server.storage_options()


# --- asynchdf5 --------------------------------------------------------------------------------


def python_step(seconds: float) -> None:
    """A training step's Python: the GIL held, ``seconds`` long (no sleep, no C call)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def asynchdf5_epochs(
    source: Any,
    epochs: int = 2,
    cpu: CPU | None = None,
    client: str = "auto",
    busy: float = 0.0,
    **kw: Any,
) -> tuple[list[float], float, dict[str, Any]]:
    """Seconds of each epoch (the first from construction), the first batch, and the stats
    (with ``cpu``, ``stats["cpu"]``: each epoch's CPU seconds, client and server). ``client``:
    the S3 client (``ASYNCHDF5_S3_CLIENT``); ``busy``: seconds of Python per batch in the
    consumer."""
    times: list[float] = []
    first: list[float] = []
    stats: dict[str, Any] = {"cpu": []}

    async def run() -> None:
        c0, t0 = cpu() if cpu else (0.0, 0.0), time.perf_counter()
        layer = AsyncHDF5DataLayer(
            source, batch_size=BATCH, shuffle=True, seed=0, chunk_size=CHUNK, **kw
        )
        async with layer:
            for _ in range(epochs):
                async for _batch in layer:
                    if not first:
                        first.append(time.perf_counter() - t0)
                    if busy:
                        python_step(busy)
                times.append(time.perf_counter() - t0)
                if cpu:
                    c1 = cpu()
                    stats["cpu"].append(CPU.since(c0, c1))
                    c0 = c1
                t0 = time.perf_counter()
            s = layer.stats
            stats.update(read_retries=s.read_retries, read_paths=s.read_paths)

    before = os.environ.get(CLIENT_VARIABLE)
    os.environ[CLIENT_VARIABLE] = client
    try:
        anyio.run(run)
    finally:
        if before is None:
            del os.environ[CLIENT_VARIABLE]
        else:
            os.environ[CLIENT_VARIABLE] = before
    gc.collect()
    return times, first[0], stats


# --- h5py over an fsspec file object ----------------------------------------------------------


def h5py_fsspec(
    server: S3Server, url: str, n: int, budget: float, **open_kw: Any
) -> tuple[float, int, float]:
    """A shuffled epoch of sorted fancy-index batch reads through ``fs.open(url)``, time-bounded:
    (seconds per sample, samples read, first batch seconds)."""
    import s3fs  # type: ignore[import-untyped]

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **_options(server))
    perm = np.random.default_rng(0).permutation(n)
    read = 0
    t0 = time.perf_counter()
    first = 0.0
    with fs.open(url, "rb", **open_kw) as f, h5py.File(f, "r") as h5:
        dset, label = h5["data"], h5["label"]
        for b in range(0, n, BATCH):
            idx = np.sort(perm[b : b + BATCH])
            dset[idx]
            label[idx]
            read += len(idx)
            elapsed = time.perf_counter() - t0
            if not first:
                first = elapsed
            if elapsed > budget:
                break
    elapsed = time.perf_counter() - t0
    del fs
    gc.collect()
    return elapsed / read, read, first


# --- the run ------------------------------------------------------------------------------------


def measure(
    server: S3Server, spec: DatasetSpec, files: data.DatasetFiles, args: argparse.Namespace
) -> list[Row]:
    """Every loader on one data set, its object uploaded first (then the latency is on)."""
    path = files.paths[0]
    key = f"{spec.name}-{spec.samples}/{path.name}"
    url = f"s3://{BUCKET}/{key}"
    size = path.stat().st_size
    n = spec.samples
    rows: list[Row] = []

    def row(loader: str, seconds: float, **kw: Any) -> None:
        rows.append(Row(spec.name, loader, seconds, n, size, **kw))

    def log(what: str) -> None:
        print(f"# {spec.name}: {what}", file=sys.stderr, flush=True)

    server.faults(latency=0)
    with server.client() as s3:
        from boto3.s3.transfer import TransferConfig  # type: ignore[import-untyped]

        config = TransferConfig(multipart_chunksize=64 * 2**20)
        s3.upload_file(str(path), BUCKET, key, Config=config)
    server.faults(latency=args.latency)

    for client in ("aiobotocore", "obstore"):
        log(f"parallel download, {client}")
        limit, limit_cpu = download_limit(server, key, size, runs=args.repeats + 1, client=client)
        row(
            f"parallel download ({client}): {PART >> 20} MiB ranged GETs, {IN_FLIGHT} in flight "
            f"(best of {args.repeats + 1})",
            limit,
            cpu=limit_cpu,
        )

    opts = _options(server)
    cpu = CPU(server)
    for client in ("obstore", "s3fs"):
        log(f"asynchdf5 remote, {client}")
        runs = [
            asynchdf5_epochs([url], cpu=cpu, client=client, storage_options=opts)
            for _ in range(args.repeats)
        ]
        e1 = min(runs, key=lambda r: r[0][0])
        e2 = min(runs, key=lambda r: r[0][1])
        row(
            f"asynchdf5 remote ({client}), epoch 1 from construction (best of {args.repeats})",
            e1[0][0],
            first_batch=e1[1],
            cpu=e1[2]["cpu"][0],
        )
        row(
            f"asynchdf5 remote ({client}), epoch 2 (best of {args.repeats})",
            e2[0][1],
            extra=e2[2],
            cpu=e2[2]["cpu"][1],
        )
    if args.busy_ms:
        busy = args.busy_ms / 1000
        steps = -(-n // BATCH) * busy
        for client in ("obstore", "s3fs"):
            log(f"asynchdf5 remote, {client}, consumer busy {args.busy_ms:g} ms per batch")
            (_, b2), _, bs = asynchdf5_epochs(
                [url], cpu=cpu, client=client, busy=busy, storage_options=opts
            )
            row(
                f"asynchdf5 remote ({client}), epoch 2, consumer busy in Python "
                f"{args.busy_ms:g} ms per batch",
                b2,
                cpu=bs["cpu"][1],
                note=f"the steps alone: {steps:.2f} s",
            )

    log("asynchdf5 remote with remote_cache")
    cache = Path(tempfile.mkdtemp(prefix="asynchdf5-remote-cache-", dir=args.data_dir))
    try:
        (c1, c2), c_first, cs = asynchdf5_epochs(
            [url], cpu=cpu, storage_options=opts, remote_cache=cache
        )  # the default client
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    row("asynchdf5 remote + remote_cache, epoch 1", c1, first_batch=c_first, cpu=cs["cpu"][0])
    row("asynchdf5 remote + remote_cache, epoch 2 (from local disk)", c2, cpu=cs["cpu"][1])

    for label, kw in (
        ("s3fs defaults: readahead, 50 MiB blocks", {}),
        ("256 KiB blocks, blockcache", {"block_size": 2**18, "cache_type": "blockcache"}),
    ):
        log(f"h5py over fs.open, {label}")
        per, read, h_first = h5py_fsspec(server, url, n, args.budget, **kw)
        part = read < n
        row(
            f"h5py over fs.open(url) ({label}), a fancy-index read per batch",
            per * n,
            first_batch=h_first,
            extrapolated=part,
            note=f"extrapolated from {read:,} samples" if part else "",
        )

    log("download, then local")
    local = Path(args.data_dir) / f"remote-download-{spec.name}.h5"
    try:
        t_dl = download_to(server, key, size, local)
        (l1, l2), _, ls = asynchdf5_epochs(local, cpu=cpu)
    finally:
        local.unlink(missing_ok=True)
    note = f"download {t_dl:.2f} s + local epoch {l1:.2f} s"
    row("download to local disk, then asynchdf5 epoch 1 on it", t_dl + l1, note=note)
    row(
        "(reference) asynchdf5 on the local file, epoch 2",
        l2,
        note="the pipeline's own pace",
        cpu=ls["cpu"][1],
    )
    server.faults(latency=0)
    with server.client() as s3:
        s3.delete_object(Bucket=BUCKET, Key=key)
    return rows


def bench(rec: Recorder) -> None:
    """Every loader on the contiguous and gzip image sets (``--quick``: the contiguous one,
    small): epoch time, samples/s, first batch, the ratio to the faster parallel download and
    the client's and server's CPU seconds."""
    quick = rec.quick
    args = argparse.Namespace(
        samples=8192 if quick else 200_000,
        latency=0.02,
        busy_ms=0.0 if quick else 1.0,
        budget=0.3 if quick else 20.0,
        repeats=1 if quick else 2,
        data_dir=rec.data_dir,
    )
    sets = ["contiguous"] if quick else ["contiguous", "gzip"]
    rec.param(samples=args.samples, latency_s=args.latency, busy_ms=args.busy_ms, sets=sets)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    specs = [_spec(name, args.samples) for name in sets]
    located = data.ensure(specs, args.data_dir)
    rows: list[Row] = []
    with S3Server(fast_ranges=True) as server:
        server.upload(BUCKET, {})
        for spec, files in zip(specs, located, strict=True):
            rows += measure(server, spec, files, args)
    for name in dict.fromkeys(r.set for r in rows):
        mine = [r for r in rows if r.set == name]
        limit = min(
            (r.seconds for r in mine if r.loader.startswith("parallel download")), default=None
        )
        for r in mine:
            star = ", extrapolated" if r.extrapolated else ""
            rec.figure(f"{name}: {r.loader}{star}", r.samples_per_s, "samples/s")
            rec.figure(f"{name}: {r.loader}, first batch", r.first_batch, "s")
            rec.ratio(f"{name}: {r.loader}: limit's time ÷ this time", limit, r.seconds)
            if r.cpu is not None and r.cpu[1] > 0:  # the server ran in this measurement
                rec.figure(f"{name}: {r.loader}: client CPU", r.cpu[0], "CPU-s")
                rec.figure(f"{name}: {r.loader}: server CPU", r.cpu[1], "CPU-s")
            if r.note:
                rec.note(f"{name}: {r.loader}: {r.note}")


if __name__ == "__main__":  # what the docs named before ``python -m benchmarks run remote``
    from benchmarks.__main__ import main

    sys.exit(main(["run", "remote", *sys.argv[1:]]))
