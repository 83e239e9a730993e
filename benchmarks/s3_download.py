"""The limit the ``remote`` benchmark measures against: a plain parallel ranged download.

The object's bytes in ranged GETs of :data:`PART`, :data:`IN_FLIGHT` at a time, each piece
copied once as it arrives, with aiobotocore (s3fs's client) or obstore
(:func:`download_limit`), or into a local file (:func:`download_to`, the "download first"
path); :class:`CPU` counts the CPU seconds of this process and of the server. Kept apart from the
loaders measured: this is the yardstick, with no asynchdf5 in it.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from support.s3_server import KEY_ID, REGION, SECRET, S3Server

__all__ = ["BUCKET", "CPU", "IN_FLIGHT", "PART", "download_limit", "download_to"]

BUCKET = "bench"
PART = 8 * 2**20
IN_FLIGHT = 16


class CPU:
    """CPU seconds (user + system, every thread) of this process and of the server's."""

    def __init__(self, server: S3Server) -> None:
        self.server = server
        self.tick = os.sysconf("SC_CLK_TCK")

    def __call__(self) -> tuple[float, float]:
        t = os.times()
        pid = self.server.pid
        server = 0.0
        if pid is not None:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            server = (int(fields[11]) + int(fields[12])) / self.tick  # utime, stime
        return t.user + t.system, server

    @staticmethod
    def since(before: tuple[float, float], after: tuple[float, float]) -> tuple[float, float]:
        return after[0] - before[0], after[1] - before[1]


def _client(server: S3Server) -> Any:
    from aiobotocore.config import AioConfig  # type: ignore[import-untyped]
    from aiobotocore.session import get_session  # type: ignore[import-untyped]

    config = AioConfig(max_pool_connections=IN_FLIGHT, retries={"total_max_attempts": 3})
    return get_session().create_client(
        "s3",
        endpoint_url=server.endpoint,
        region_name=REGION,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
        config=config,
    )


async def _in_parts(size: int, part: Callable[[int, int], Awaitable[None]]) -> None:
    """``part(start, stop)`` for each ``PART`` of ``size`` bytes, ``IN_FLIGHT`` at a time."""
    sem = asyncio.Semaphore(IN_FLIGHT)

    async def bounded(start: int) -> None:
        async with sem:
            await part(start, min(size, start + PART))

    await asyncio.gather(*(bounded(a) for a in range(0, size, PART)))


async def _download(s3: Any, key: str, size: int, into: Callable[[int, memoryview], None]) -> None:
    """The object's bytes in ranged GETs of ``PART``, ``IN_FLIGHT`` at a time, each piece handed
    to ``into`` as it arrives (copied once, as asynchdf5 does)."""

    async def part(start: int, stop: int) -> None:
        resp = await s3.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={start}-{stop - 1}")
        body = resp["Body"]
        try:
            content = body.raw_stream.content
            pos = start
            while piece := await content.readany():
                into(pos, memoryview(piece))
                pos += len(piece)
        finally:
            body.close()

    await _in_parts(size, part)


async def _download_obstore(
    store: Any, key: str, size: int, into: Callable[[int, memoryview], None]
) -> None:
    """As :func:`_download`, through obstore (its HTTP in Rust threads, outside the GIL): each
    part's body arrives whole and is copied once."""
    import obstore

    async def part(start: int, stop: int) -> None:
        resp = await obstore.get_async(store, key, options={"range": (start, stop)})
        into(start, memoryview(await resp.bytes_async()))

    await _in_parts(size, part)


def _obstore_store(server: S3Server) -> Any:
    from obstore.store import S3Store

    config: Any = {  # the keys asynchdf5 passes (obstore takes them with or without "aws_")
        "aws_access_key_id": KEY_ID,
        "aws_secret_access_key": SECRET,
        "aws_endpoint": server.endpoint,
        "aws_region": REGION,
    }
    return S3Store(BUCKET, config=config, client_options={"allow_http": True})


def download_limit(
    server: S3Server, key: str, size: int, runs: int = 3, client: str = "aiobotocore"
) -> tuple[float, tuple[float, float]]:
    """Seconds to fetch the object's bytes into memory with ``client`` (``aiobotocore`` or
    ``obstore``): best of ``runs``, into a buffer allocated and touched beforehand, with a
    client made beforehand (neither is timed); and the CPU seconds of that run (client,
    server)."""
    buf = np.ones(size, np.uint8)  # touched: the first touch of fresh pages is not timed
    view = buf.data

    def into(start: int, piece: memoryview) -> None:
        view[start : start + len(piece)] = piece

    cpu = CPU(server)

    async def best_of(download: Callable[[], Awaitable[None]]) -> tuple[float, tuple[float, float]]:
        best: tuple[float, tuple[float, float]] = (float("inf"), (0.0, 0.0))
        for _ in range(runs):
            c0, t0 = cpu(), time.perf_counter()
            await download()
            best = min(best, (time.perf_counter() - t0, CPU.since(c0, cpu())))
        return best

    async def run() -> tuple[float, tuple[float, float]]:
        if client == "obstore":
            import obstore

            store = _obstore_store(server)
            await obstore.head_async(store, key)  # connects
            return await best_of(lambda: _download_obstore(store, key, size, into))
        async with _client(server) as s3:
            await s3.head_object(Bucket=BUCKET, Key=key)  # connects
            return await best_of(lambda: _download(s3, key, size, into))

    best = asyncio.run(run())
    gc.collect()
    return best


def download_to(server: S3Server, key: str, size: int, path: Path) -> float:
    """Seconds to download the object into a local file (from a fresh client, as a script
    would)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def into(start: int, piece: memoryview) -> None:
        os.pwrite(fd, piece, start)

    async def run() -> None:
        async with _client(server) as s3:
            await _download(s3, key, size, into)

    try:
        t0 = time.perf_counter()
        asyncio.run(run())
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
