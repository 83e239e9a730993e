"""Remote sources: fsspec URLs, against a real S3 API (moto's server, see
``support/s3_server``) and fsspec's ``memory://``.

The same guarantees as for local files: every epoch yields every sample exactly once, data and
label aligned, on every read path (contiguous, chunked, gzip, and the h5py fallback over a file
object); shuffles are reproducible and shards disjoint; resume works. Faults: an object deleted
or overwritten mid-epoch is a ReadError naming the URL, the top and the rows; injected 5xx and
slow responses are retried and counted, a ReadError after the last attempt; a server killed and
restarted mid-epoch is ridden out; a missing object or bucket, or bad credentials, is a
SourceError at ``async with`` that shows no secret. Cancelling an epoch cancels the requests in
flight (the server sees the client hang up), and nothing is left running or open afterwards (the
``no_leaks`` fixture: the source's own event loop thread, its pools and its sockets all end with
the layer).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import fsspec  # type: ignore[import-untyped]
import h5py
import numpy as np
import pytest

from asynchdf5 import (
    AsyncHDF5DataLayer,
    HDF5DataLayer,
    ReadError,
    SourceError,
)
from asynchdf5._sources import resolve_source
from asynchdf5._sources._entries import join_url
from asynchdf5._sources._remote import RemoteSource, Transfer, _fetch, _transfer
from asynchdf5._sources._remote._errors import Secrets, classify
from asynchdf5._sources._remote._fetch import spans
from asynchdf5._sources._remote._obstore import CLIENT_VARIABLE
from support.s3_server import SECRET, S3Server

from ._files import (
    LAYOUTS,
    SIZES,
    check_batch,
    check_epoch,
    check_message,
    check_prefix,
    rows,
    write_h5,
    write_source,
)
from ._helpers import epoch_until_error, one_epoch
from ._leaks import aassert_released, asnapshot
from .conftest import S3Objects

pytestmark = pytest.mark.anyio

N = sum(SIZES)
BUCKET = "asynchdf5-test"
DEADLINE = 30  # seconds: any test that iterates fails instead of hanging
#: Three objects of 400 rows; with batches of 10 and chunks of 20 the pipeline runs a few dozen
#: batches ahead of the consumer, so after the first batch the last object is not read yet.
BIG = (400, 400, 400)
_counter = itertools.count()


@pytest.fixture(scope="module")
def s3_objects(tmp_path_factory: pytest.TempPathFactory) -> S3Objects:
    """The module's server (``s3``) holds the data sets of every layout."""
    folder = tmp_path_factory.mktemp("s3-data")
    objects: dict[str, Path | bytes] = {}
    for layout in LAYOUTS:
        objects.update(source_objects(f"layouts/{layout}", SIZES, layout, folder / layout))
    return {BUCKET: objects}


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> Transfer:
    """Retries within milliseconds, and few of them."""
    t = Transfer(attempts=3, backoff=0.01, max_backoff=0.05, timeout=2.0)
    monkeypatch.setattr(_transfer, "TRANSFER", t)
    return t


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test against the S3 server runs with each S3 client (see ``_s3_client``)."""
    if "s3" in metafunc.fixturenames:
        metafunc.parametrize("_s3_client", ["obstore", "s3fs"], indirect=True)


@pytest.fixture(autouse=True)
def _s3_client(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The S3 client the layers of a test use: obstore (where the options allow it, the default
    when it is installed) or s3fs. Without obstore installed, its runs are skipped."""
    client = str(getattr(request, "param", "auto"))
    if client == "obstore":
        pytest.importorskip("obstore")
    monkeypatch.setenv(CLIENT_VARIABLE, client)
    return client


@pytest.fixture(autouse=True)
def _no_faults_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that injects faults into the module's server leaves none behind."""
    yield
    if "s3" in request.fixturenames:
        server: S3Server = request.getfixturevalue("s3")
        server.faults(clear=True)


def source_objects(
    prefix: str, sizes: tuple[int, ...], layout: str, folder: Path
) -> dict[str, Path | bytes]:
    """``part{i}.h5`` (written into ``folder``) and a list file ``train.txt`` naming them, as
    objects under ``prefix``."""
    _, paths = write_source(folder, sizes, layout=layout)
    objects: dict[str, Path | bytes] = {f"{prefix}/{p.name}": p for p in paths}
    objects[f"{prefix}/train.txt"] = "\n".join(p.name for p in paths).encode() + b"\n"
    return objects


def upload(
    server: S3Server, prefix: str, sizes: tuple[int, ...], layout: str, folder: Path
) -> list[str]:
    """Upload ``part{i}.h5`` and a list file ``train.txt`` under ``prefix``; the files' URLs."""
    objects = source_objects(prefix, sizes, layout, folder)
    server.upload(BUCKET, objects)
    return [f"s3://{BUCKET}/{key}" for key in objects if key.endswith(".h5")]


def fresh(server: S3Server, tmp_path: Path, layout: str = "contiguous") -> list[str]:
    """A data set of its own (BIG), for a test that changes it."""
    prefix = f"t{next(_counter)}-{layout}"
    return upload(server, prefix, BIG, layout, tmp_path / prefix)


def key_of(url: str) -> str:
    return url.split(f"{BUCKET}/", 1)[1]


def _layouts() -> list[str]:
    return ["contiguous", "chunked", "gzip", "gzip-split", "scaleoffset"]


# --- exactly once, aligned, on every read path ---------------------------------------------------


@pytest.mark.parametrize("layout", _layouts())
async def test_every_sample_once_and_aligned(s3: S3Server, layout: str) -> None:
    urls = [f"s3://{BUCKET}/layouts/{layout}/part{i}.h5" for i in range(len(SIZES))]
    before = await asnapshot()
    async with AsyncHDF5DataLayer(
        urls, batch_size=32, chunk_size=64, storage_options=s3.storage_options()
    ) as layer:
        assert layer.stats.read_paths["data"] == LAYOUTS[layout]
        got = await one_epoch(layer)
        check_epoch(got, N, 32, 0)
        assert np.concatenate([b.indices for b in got]).tolist() == list(range(N))  # in order
        check_epoch(await one_epoch(layer), N, 32, 1)
    await aassert_released(before)


async def test_shuffle_is_reproducible_and_shards_are_disjoint(s3: S3Server) -> None:
    urls = [f"s3://{BUCKET}/layouts/gzip/part{i}.h5" for i in range(len(SIZES))]
    opts = s3.storage_options()
    seen: list[np.ndarray] = []
    runs: list[list[list[int]]] = []
    for rank in (0, 1, 0):
        async with AsyncHDF5DataLayer(
            urls,
            batch_size=16,
            shuffle=True,
            seed=7,
            chunk_size=64,
            rank=rank,
            world_size=2,
            storage_options=opts,
        ) as layer:
            got = await one_epoch(layer)
        for b in got:
            check_batch(b, b.size)
        seen.append(np.concatenate([b.indices for b in got]))
        runs.append([b.indices.tolist() for b in got])
    assert runs[0] == runs[2]  # the same seed, the same batches
    assert not set(seen[0].tolist()) & set(seen[1].tolist())
    assert sorted(np.concatenate(seen[:2]).tolist()) == list(range(N))
    assert seen[0].tolist() != sorted(seen[0].tolist())  # shuffled


async def test_resume_gives_the_next_batch(s3: S3Server) -> None:
    urls = [f"s3://{BUCKET}/layouts/chunked/part{i}.h5" for i in range(len(SIZES))]
    kw: dict[str, Any] = dict(
        batch_size=20, shuffle=True, seed=3, chunk_size=64, storage_options=s3.storage_options()
    )
    async with AsyncHDF5DataLayer(urls, **kw) as layer:
        reference = await one_epoch(layer)
    async with AsyncHDF5DataLayer(urls, **kw) as layer:
        taken = 0
        with anyio.fail_after(DEADLINE):
            async for _ in layer:
                taken += 1
                if taken == 5:
                    state = layer.state_dict()  # in the epoch: leaving it ends it
                    break
    async with AsyncHDF5DataLayer(urls, **kw) as layer:
        layer.load_state_dict(state)
        rest = await one_epoch(layer)
    assert [b.indices.tolist() for b in rest] == [b.indices.tolist() for b in reference[5:]]
    for b in rest:
        check_batch(b, b.size)


def test_sync_facade(s3: S3Server) -> None:
    urls = [f"s3://{BUCKET}/layouts/gzip/part{i}.h5" for i in range(len(SIZES))]
    with HDF5DataLayer(
        urls, batch_size=50, shuffle=True, seed=1, storage_options=s3.storage_options()
    ) as layer:
        check_epoch(list(layer), N, 50, 0)


async def test_local_files_and_file_urls_mix_with_remote_ones(s3: S3Server, tmp_path: Path) -> None:
    _, local = write_source(tmp_path, SIZES, layout="gzip")
    urls = [
        str(local[0]),
        f"s3://{BUCKET}/layouts/contiguous/part1.h5",
        local[2].as_uri(),  # file:// is a local file
    ]
    async with AsyncHDF5DataLayer(
        urls, batch_size=25, storage_options=s3.storage_options()
    ) as layer:
        check_epoch(await one_epoch(layer), N, 25, 0)


# --- source list files given as URLs -------------------------------------------------------------


def test_a_list_file_url_names_urls_relative_to_it(s3: S3Server) -> None:
    got = resolve_source(
        f"s3://{BUCKET}/layouts/gzip/train.txt", storage_options=s3.storage_options()
    )
    assert got == [f"s3://{BUCKET}/layouts/gzip/part{i}.h5" for i in range(len(SIZES))]


async def test_a_layer_reads_a_list_file_url(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # Credentials and endpoint from the environment, as botocore reads them: the list file is
    # read when the layer is constructed.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.storage_options()["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    async with AsyncHDF5DataLayer(
        f"s3://{BUCKET}/layouts/chunked/train.txt", batch_size=30
    ) as layer:
        check_epoch(await one_epoch(layer), N, 30, 0)


def test_missing_list_file_url_is_a_source_error(s3: S3Server) -> None:
    url = f"s3://{BUCKET}/nowhere/train.txt"
    with pytest.raises(SourceError) as info:
        resolve_source(url, storage_options=s3.storage_options())
    check_message(info.value, url, "does not exist", "listing HDF5 files")


def test_join_url() -> None:
    base = "s3://b/data/train/list.txt"
    assert join_url(base, "a.h5") == "s3://b/data/train/a.h5"
    assert join_url(base, "../val/a.h5") == "s3://b/data/val/a.h5"
    assert join_url(base, "/x/a.h5") == "s3://b/x/a.h5"
    assert join_url("https://h:8/l.txt", "a.h5") == "https://h:8/a.h5"


def test_memory_list_file(tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe("/lists/sub/train.txt", b"# a list\n\na.h5\n../b.h5\ns3://other/c.h5\n")
    fs.pipe("/lists/sub/one", write_h5(tmp_path / "x.h5", 0, 5).read_bytes())
    assert resolve_source("memory://lists/sub/train.txt") == [
        "memory://lists/sub/a.h5",
        "memory://lists/b.h5",
        "s3://other/c.h5",
    ]
    assert resolve_source("memory://lists/sub/one") == ["memory://lists/sub/one"]  # HDF5


# --- changes mid-epoch ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "gzip", "scaleoffset"])
@pytest.mark.parametrize("fault", ["deleted", "overwritten"])
async def test_object_changed_mid_epoch_is_a_read_error(
    s3: S3Server, tmp_path: Path, layout: str, fault: str
) -> None:
    urls = fresh(s3, tmp_path, layout)
    victim = urls[2]

    def act(i: int) -> None:
        if i != 1:
            return
        if fault == "deleted":
            s3.delete(BUCKET, key_of(victim))
        else:
            other = write_h5(tmp_path / "other.h5", 5000, 400, layout=layout)
            s3.upload(BUCKET, {key_of(victim): other})

    before = await asnapshot()
    async with AsyncHDF5DataLayer(
        urls, batch_size=10, chunk_size=20, storage_options=s3.storage_options()
    ) as layer:
        got, err = await epoch_until_error(layer, act)
    await aassert_released(before)
    assert isinstance(err, ReadError), err
    assert 10 <= len(check_prefix(got, 10)) <= 800
    check_message(err, victim, "'data'" if layout != "scaleoffset" else "top", "rows ")
    check_message(err, "deleted" if fault == "deleted" else "changed")


# --- transient faults ----------------------------------------------------------------------------


async def test_injected_5xx_are_retried_and_counted(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_transfer, "TRANSFER", Transfer(attempts=4, backoff=0.01))
    urls = [f"s3://{BUCKET}/layouts/gzip/part{i}.h5" for i in range(len(SIZES))]
    async with AsyncHDF5DataLayer(
        urls, batch_size=25, chunk_size=50, storage_options=s3.storage_options()
    ) as layer:
        s3.faults(fail={"status": 503, "count": 2, "method": "GET"})
        s3.faults(fail={"status": 500, "count": 1, "method": "GET"})
        check_epoch(await one_epoch(layer), N, 25, 0)
        assert layer.stats.read_retries == 3


async def test_5xx_past_the_last_attempt_is_a_read_error(s3: S3Server, fast: Transfer) -> None:
    urls = [f"s3://{BUCKET}/layouts/contiguous/part{i}.h5" for i in range(len(SIZES))]
    async with AsyncHDF5DataLayer(
        urls, batch_size=25, chunk_size=50, storage_options=s3.storage_options()
    ) as layer:
        s3.faults(fail={"status": 503, "count": 1000, "method": "GET", "match": "part2"})
        got, err = await epoch_until_error(layer)
        assert layer.stats.read_retries >= fast.attempts - 1
    assert isinstance(err, ReadError), err
    check_message(err, urls[2], "'data'", "rows 0:", f"after {fast.attempts} attempts", "503")
    assert len(check_prefix(got, 25)) <= SIZES[0] + SIZES[1]


async def test_slow_response_is_timed_out_and_retried(s3: S3Server, monkeypatch: Any) -> None:
    """A request the server holds longer than the test may run is cut by the transfer's timeout
    and retried, and the epoch is whole; the server sees the client hang up on it.

    Nothing here depends on a healthy request finishing within the timeout: one that a loaded
    machine serves slower is retried too, so the check is that the stalled one was (at least one
    retry, the stalled request abandoned), with tries enough that no healthy request runs out of
    them. The clients have timeouts of their own (obstore's: ours plus 5 s, aiobotocore's), which
    would also end the stall: so the retries' causes are recorded, and one of them must be the
    transfer's own timeout (a plain ``TimeoutError``), not a client's error."""
    t = Transfer(attempts=50, backoff=0.01, max_backoff=0.05, timeout=0.5)
    monkeypatch.setattr(_transfer, "TRANSFER", t)
    causes: list[type[BaseException]] = []

    def recorded(exc: BaseException) -> str:
        causes.append(type(exc))
        return classify(exc)

    monkeypatch.setattr(_fetch, "classify", recorded)
    urls = [f"s3://{BUCKET}/layouts/chunked/part{i}.h5" for i in range(len(SIZES))]
    async with AsyncHDF5DataLayer(
        urls, batch_size=25, chunk_size=50, storage_options=s3.storage_options()
    ) as layer:
        s3.counts(reset=True)
        s3.faults(stall={"seconds": 2 * DEADLINE, "count": 1, "method": "GET"})
        check_epoch(await one_epoch(layer), N, 25, 0)
        assert layer.stats.read_retries >= 1
    assert TimeoutError in causes, causes
    assert s3.counts().get("stalled", 0) == 1
    # Polled: the server notices the hang-up within 20 ms of it, or when the machine lets it.
    assert await _eventually(lambda: s3.counts().get("abandoned", 0) == 1, seconds=DEADLINE)


async def _eventually(check: Callable[[], bool], seconds: float = 3.0) -> bool:
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            return False
        await anyio.sleep(0.05)
    return True


@pytest.mark.both_backends
async def test_cancelling_an_epoch_cancels_the_requests_in_flight(s3: S3Server) -> None:
    urls = [f"s3://{BUCKET}/layouts/contiguous/part{i}.h5" for i in range(len(SIZES))]
    before = await asnapshot()
    async with AsyncHDF5DataLayer(
        urls, batch_size=25, chunk_size=50, storage_options=s3.storage_options()
    ) as layer:
        s3.counts(reset=True)
        s3.faults(stall={"seconds": 20, "count": 1000, "method": "GET"})
        # Cancelled once the server holds a request (not after a fixed time, which a loaded
        # machine can spend before the first request is sent).
        t0 = math.inf  # when cancelled
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:

                async def cancel_when_stalled() -> None:
                    nonlocal t0
                    while (await anyio.to_thread.run_sync(s3.counts)).get("stalled", 0) < 1:
                        await anyio.sleep(0.02)
                    t0 = time.monotonic()
                    tg.cancel_scope.cancel()

                tg.start_soon(cancel_when_stalled)
                await one_epoch(layer)
                pytest.fail("the epoch ended though the server held its reads")
    assert time.monotonic() - t0 < 5  # cancelled and closed at once, not after the server's 20 s
    await aassert_released(before)
    # The server saw the client hang up on the stalled requests.
    assert await _eventually(lambda: s3.counts().get("abandoned", 0) >= 1)


async def test_server_killed_mid_epoch_is_a_read_error(tmp_path: Path, fast: Transfer) -> None:
    with S3Server(log=tmp_path / "server.log") as server:
        urls = fresh(server, tmp_path)
        async with AsyncHDF5DataLayer(
            urls, batch_size=10, chunk_size=20, storage_options=server.storage_options()
        ) as layer:
            got, err = await epoch_until_error(layer, lambda i: server.stop() if i == 1 else None)
            assert layer.stats.read_retries >= fast.attempts - 1
    assert isinstance(err, ReadError), err
    check_message(err, "s3://", "'data'", "rows ", "attempts")
    check_prefix(got, 10)


async def test_server_restarted_mid_epoch_is_ridden_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Retries for 7 s at least (20 s at most): time enough for the server to come back (a fresh
    # moto, which has to import itself, on a loaded machine) and for its objects to be uploaded.
    monkeypatch.setattr(_transfer, "TRANSFER", Transfer(attempts=30, backoff=0.05, max_backoff=0.5))
    with S3Server(log=tmp_path / "server.log") as server:
        urls = fresh(server, tmp_path)
        files = sorted((tmp_path).glob("t*/part*.h5"))

        def restart() -> None:
            time.sleep(0.3)  # the pipeline's requests are stalled in the server meanwhile
            server.stop()
            # The same port. moto's objects are gone: reads are answered 503 (as by a store
            # still coming up) until they are uploaded again, the same bytes (same ETags).
            server.start(faults={"fail": {"status": 503, "count": 10**9, "method": "GET"}})
            prefix = key_of(urls[0]).rsplit("/", 1)[0]
            server.upload(BUCKET, {f"{prefix}/{p.name}": p for p in files})
            server.faults(clear=True)

        # In a thread, so that the pipeline keeps requesting while the server is down.
        restarter = threading.Thread(target=restart)

        def on_batch(i: int) -> None:
            if i == 1:
                server.faults(stall={"seconds": 60, "count": 10**9, "method": "GET"})
                restarter.start()

        async with AsyncHDF5DataLayer(
            urls, batch_size=10, chunk_size=20, storage_options=server.storage_options()
        ) as layer:
            try:
                got, err = await epoch_until_error(layer, on_batch)
            finally:
                await anyio.to_thread.run_sync(restarter.join)
            retries = layer.stats.read_retries
    assert err is None, err
    check_epoch(got, sum(BIG), 10, 0)
    assert retries >= 1


# --- errors at open ------------------------------------------------------------------------------


async def open_fails(urls: list[str], **kw: Any) -> SourceError:
    before = await asnapshot()
    with pytest.raises(SourceError) as info:
        async with AsyncHDF5DataLayer(urls, batch_size=10, **kw):
            pytest.fail("the layer opened")
    await aassert_released(before)
    return info.value


async def test_missing_object_is_a_source_error(s3: S3Server) -> None:
    url = f"s3://{BUCKET}/layouts/gzip/missing.h5"
    err = await open_fails([url], storage_options=s3.storage_options())
    check_message(err, url, "does not exist")


async def test_missing_bucket_is_a_source_error(s3: S3Server) -> None:
    url = "s3://no-such-bucket/data.h5"
    err = await open_fails([url], storage_options=s3.storage_options())
    check_message(err, url, "does not exist", "no bucket 'no-such-bucket'")


async def test_object_not_hdf5_is_a_source_error(s3: S3Server) -> None:
    url = f"s3://{BUCKET}/layouts/gzip/train.txt"
    err = await open_fails([url], storage_options=s3.storage_options())
    check_message(err, url, "not an HDF5 file")


async def test_unknown_protocol_is_a_source_error() -> None:
    err = await open_fails(["nosuchprotocol://b/x.h5"])
    check_message(err, "nosuchprotocol://b/x.h5", "Protocol not known")


async def test_bad_credentials_are_a_source_error_without_secrets(s3: S3Server) -> None:
    """moto's IAM authentication on: a known user's key works, a wrong secret or an unknown key
    is refused, and the error shows neither the key id nor the secret (nor a password in the
    URL of an endpoint)."""
    user = f"reader{next(_counter)}"
    with s3.client("iam") as iam:
        iam.create_user(UserName=user)
        iam.put_user_policy(
            UserName=user,
            PolicyName="read",
            PolicyDocument='{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", '
            '"Action": "s3:*", "Resource": "*"}]}',
        )
        key = iam.create_access_key(UserName=user)["AccessKey"]
    url = f"s3://{BUCKET}/layouts/contiguous/part0.h5"
    s3.reset_auth(0)
    try:
        good = {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
        async with AsyncHDF5DataLayer(
            [url], batch_size=10, storage_options={**good, "endpoint_url": s3.endpoint}
        ) as layer:
            assert sum([b.size async for b in layer]) == SIZES[0]
        secret = "wrong-secret-Zq81xv0b"
        bad = [
            {"key": key["AccessKeyId"], "secret": secret},
            {"key": "AKIAUNKNOWNKEY999999", "secret": secret},
        ]
        for options in bad:
            err = await open_fails([url], storage_options={**options, "endpoint_url": s3.endpoint})
            check_message(err, url, "access denied")
            shown = "".join(traceback.format_exception(type(err), err, err.__traceback__))
            assert secret not in shown and options["key"] not in shown, shown
    finally:
        s3.reset_auth(float("inf"))


def test_secrets_are_scrubbed() -> None:
    scrub = Secrets(
        {
            "key": "AKIA123",
            "secret": "s3cr3t!",
            "client_kwargs": {"aws_session_token": "tok-en"},
            "endpoint_url": "https://u:pw@example.com",
            "anon": False,
        }
    )
    text = "AKIA123 s3cr3t! tok-en https://u:pw@example.com/x s3://b/k"
    assert scrub(text) == "*** *** *** https://***@example.com/x s3://b/k"


# --- layouts that name other files ----------------------------------------------------------------


async def test_default_blocks_of_a_remote_object_are_a_whole_request(tmp_path: Path) -> None:
    """Each block is at least a request: 8 MiB of samples, not the 1 MiB floor of local files
    (with a chunk that still holds 16 of them)."""
    path = write_h5(tmp_path / "blocks.h5", 0, 50)
    fsspec.filesystem("memory").pipe("/blocks/blocks.h5", path.read_bytes())
    with h5py.File(path) as f:
        row = sum(f[top].dtype.itemsize * int(np.prod(f[top].shape[1:])) for top in f)
    chunk = 2**28 // row  # local blocks: chunk / 192 (1.3 MiB); remote: 8 MiB (chunk / 32)
    blocks = {}
    for name in (str(path), "memory://blocks/blocks.h5"):
        async with AsyncHDF5DataLayer(name, batch_size=10, shuffle=True, chunk_size=chunk) as L:
            blocks[name] = L.state_dict()["fingerprint"]["block_rows"]
            assert len([b async for b in L]) == 5
    assert blocks == {str(path): chunk // 192, "memory://blocks/blocks.h5": 8 * 2**20 // row}


async def test_external_link_in_a_remote_file_is_refused(tmp_path: Path) -> None:
    """The link's target exists locally, by that very name: HDF5 must not read it."""
    target = write_h5(tmp_path / "target.h5", 0, 50)
    linked = tmp_path / "linked.h5"
    with h5py.File(linked, "w") as f:
        f["data"] = h5py.ExternalLink(str(target), "/data")
        f["alias"] = h5py.SoftLink("/data")
        f.create_dataset("label", data=rows(0, 50)["label"])
    fsspec.filesystem("memory").pipe("/refuse/linked.h5", linked.read_bytes())
    for top in ("data", "alias"):
        err = await open_fails(["memory://refuse/linked.h5"], tops=(top, "label"))
        check_message(err, "memory://refuse/linked.h5", f"top {top!r}", "external link")


async def test_external_storage_and_virtual_datasets_in_a_remote_file_are_refused(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "raw.bin"
    raw.write_bytes(rows(0, 50)["data"].tobytes())
    ext = tmp_path / "ext.h5"
    with h5py.File(ext, "w") as f:
        f.create_dataset("data", shape=(50, 2), dtype=np.float32, external=[(str(raw), 0, 400)])
        f.create_dataset("label", data=rows(0, 50)["label"])
    src = write_h5(tmp_path / "src.h5", 0, 50)
    vds = tmp_path / "vds.h5"
    with h5py.File(vds, "w") as f:
        layout = h5py.VirtualLayout(shape=(50, 2), dtype=np.float32)
        layout[:] = h5py.VirtualSource(str(src), "data", shape=(50, 2))
        f.create_virtual_dataset("data", layout)
        f.create_dataset("label", data=rows(0, 50)["label"])
    fs = fsspec.filesystem("memory")
    for path, what in ((ext, "external raw files"), (vds, "virtual dataset")):
        fs.pipe(f"/refuse/{path.name}", path.read_bytes())
        url = f"memory://refuse/{path.name}"
        check_message(await open_fails([url]), url, "'data'", what, "not supported")


# --- the remote cache ----------------------------------------------------------------------------


async def test_remote_cache_serves_later_epochs(s3: S3Server, tmp_path: Path) -> None:
    urls = [f"s3://{BUCKET}/layouts/gzip/part{i}.h5" for i in range(len(SIZES))]
    kw: dict[str, Any] = dict(
        batch_size=25,
        chunk_size=50,  # streamed every epoch: not resident
        shuffle=True,
        seed=5,
        storage_options=s3.storage_options(),
        remote_cache=tmp_path / "cache",
    )
    async with AsyncHDF5DataLayer(urls, **kw) as layer:
        check_epoch(await one_epoch(layer), N, 25, 0)
        s3.counts(reset=True)
        check_epoch(await one_epoch(layer), N, 25, 1)
        assert s3.counts().get("GET", 0) == 0  # epoch 2: no request at all
    assert list((tmp_path / "cache").glob("*.blk"))
    s3.counts(reset=True)
    async with AsyncHDF5DataLayer(urls, **kw) as layer:  # a later run: only metadata is read
        check_epoch(await one_epoch(layer), N, 25, 0)
        opened = s3.counts()
        assert opened.get("GET", 0) == len(urls)  # the first block of each object, at open


async def test_remote_cache_never_serves_a_changed_object(s3: S3Server, tmp_path: Path) -> None:
    urls = fresh(s3, tmp_path, "gzip")
    kw: dict[str, Any] = dict(
        batch_size=40, storage_options=s3.storage_options(), remote_cache=tmp_path / "cache"
    )
    async with AsyncHDF5DataLayer(urls, **kw) as layer:
        check_epoch(await one_epoch(layer), sum(BIG), 40, 0)
    other = write_h5(tmp_path / "other.h5", 800, 400, layout="gzip")
    with h5py.File(other, "a") as f:  # the same rows, other data
        f["data"][...] = -f["data"][...]
    s3.upload(BUCKET, {key_of(urls[2]): other})
    async with AsyncHDF5DataLayer(urls, **kw) as layer:
        got = await one_epoch(layer)
    data = np.concatenate([b["data"] for b in got])
    np.testing.assert_array_equal(data[800:, 0], -np.arange(800, 1200) * 10.0)
    np.testing.assert_array_equal(data[:800, 0], np.arange(800) * 10.0)


async def test_remote_cache_stays_within_its_bound(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_transfer, "TRANSFER", Transfer(cache_block=2048))
    urls = [f"s3://{BUCKET}/layouts/contiguous/part{i}.h5" for i in range(len(SIZES))]
    bound = 6 * 2048
    async with AsyncHDF5DataLayer(
        urls,
        batch_size=10,
        chunk_size=20,
        storage_options=s3.storage_options(),
        remote_cache=tmp_path / "cache",
        remote_cache_bytes=bound,
    ) as layer:
        for epoch in range(2):
            check_epoch(await one_epoch(layer), N, 10, epoch)
            used = sum(p.stat().st_size for p in (tmp_path / "cache").glob("*.blk"))
            assert 0 < used <= bound
    assert not list((tmp_path / "cache").glob(".tmp-*"))


# --- memory:// (no server): the generic fsspec path ----------------------------------------------


def memory_source(
    tmp_path: Path, name: str, layout: str, sizes: tuple[int, ...] = BIG
) -> list[str]:
    fs = fsspec.filesystem("memory")
    urls = []
    for p in write_source(tmp_path / name, sizes, layout=layout)[1]:
        fs.pipe(f"/{name}/{p.name}", p.read_bytes())
        urls.append(f"memory://{name}/{p.name}")
    return urls


@pytest.mark.parametrize("layout", _layouts())
async def test_memory_urls(tmp_path: Path, layout: str) -> None:
    urls = memory_source(tmp_path, f"m{next(_counter)}", layout, SIZES)
    async with AsyncHDF5DataLayer(
        urls, batch_size=16, shuffle=True, seed=2, chunk_size=64
    ) as layer:
        assert layer.stats.read_paths["data"] == LAYOUTS[layout]
        check_epoch(await one_epoch(layer), N, 16, 0)


@pytest.mark.parametrize("fault", ["deleted", "overwritten"])
async def test_memory_object_changed_mid_epoch(tmp_path: Path, fault: str) -> None:
    name = f"m{next(_counter)}"
    urls = memory_source(tmp_path, name, "gzip")
    fs = fsspec.filesystem("memory")
    other = write_h5(tmp_path / "other.h5", 5000, 400, layout="gzip").read_bytes()

    def act(i: int) -> None:
        if i == 1:
            if fault == "deleted":
                fs.rm(f"/{name}/part2.h5")
            else:
                fs.pipe(f"/{name}/part2.h5", other)

    async with AsyncHDF5DataLayer(urls, batch_size=10, chunk_size=20) as layer:
        got, err = await epoch_until_error(layer, act)
    assert isinstance(err, ReadError), err
    check_message(err, urls[2], "'data'", "deleted" if fault == "deleted" else "changed")
    check_prefix(got, 10)


def test_spans_coalesce_near_ranges_and_split_long_ones() -> None:
    from asynchdf5._sources._base import ByteRange

    f: Any = object()
    ranges = [ByteRange(f, o, s, "") for o, s in ((0, 20), (25, 20), (200, 250), (460, 5))]
    assert spans(ranges, 100, 10) == [(0, 45), (200, 289), (289, 378), (378, 465)]


def test_remote_source_is_cheap_to_make_and_close() -> None:
    with contextlib.closing(RemoteSource({"anon": True})) as source:
        assert source.requests == 0  # nothing started, nothing to stop
    assert os.environ.get("ASYNCHDF5_NEVER_SET") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux thread priorities")
async def test_decoding_runs_below_the_consumer_for_remote_objects_too(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Raw chunks of remote objects are decoded on threads the remote source's own threads start,
    # not the (lowered) local read threads: the decode pool lowers its threads itself.
    monkeypatch.setenv("ASYNCHDF5_NICE", "10")
    urls = [f"s3://{BUCKET}/layouts/gzip/part{i}.h5" for i in range(len(SIZES))]
    want = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + 10)
    decoders: set[int] = set()
    with anyio.fail_after(30):
        async with AsyncHDF5DataLayer(
            urls, batch_size=25, chunk_size=50, storage_options=s3.storage_options()
        ) as layer:
            async for _ in layer:
                decoders |= {
                    os.getpriority(os.PRIO_PROCESS, t.native_id)
                    for t in threading.enumerate()
                    if t.name.startswith("asynchdf5-decode") and t.native_id is not None
                }
    assert decoders == {want}
