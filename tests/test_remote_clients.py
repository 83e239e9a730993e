"""Which S3 client reads (obstore or s3fs), and obstore's translation of ``storage_options``.

obstore is used only where it does what s3fs would (``_obstore.obstore_settings``); every test
of ``test_remote`` against the S3 server runs with both clients. Here: the choice itself, the
translation and its refusals, errors that name the option but never its value, and a process
that ends while obstore's requests are in flight (its threads call back into Python).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import pytest

from asynchdf5 import AsyncHDF5DataLayer, SourceError
from asynchdf5._sources._remote import RemoteFile, RemoteSource, Transfer
from asynchdf5._sources._remote._obstore import (
    CLIENT_VARIABLE,
    NotTranslated,
    obstore_settings,
    translate,
)
from support.s3_server import KEY_ID, SECRET, S3Server

from ._files import SIZES, check_epoch, check_message, write_source
from ._leaks import aassert_released, asnapshot
from .conftest import S3Objects

pytest.importorskip("obstore")
pytestmark = pytest.mark.anyio

BUCKET = "clients"
T = Transfer()
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def s3_objects(tmp_path_factory: pytest.TempPathFactory) -> S3Objects:
    """The module's server (``s3``) holds ``part{i}.h5``."""
    _, paths = write_source(tmp_path_factory.mktemp("s3-clients"))
    return {BUCKET: {p.name: p for p in paths}}


def urls() -> list[str]:
    return [f"s3://{BUCKET}/part{i}.h5" for i in range(len(SIZES))]


def clean_env(tmp_path: Path, **env: str) -> dict[str, str]:
    """An environment of no AWS settings and a home without ``~/.aws``, plus ``env``."""
    return {"HOME": str(tmp_path), **env}


# --- the translation --------------------------------------------------------------------------


def test_explicit_credentials_and_endpoint(tmp_path: Path) -> None:
    got = obstore_settings(
        {"key": "k1", "secret": "s1", "endpoint_url": "http://127.0.0.1:9000"},
        T,
        clean_env(tmp_path),
    )
    assert got["config"] == {
        "aws_region": "us-east-1",
        "aws_endpoint": "http://127.0.0.1:9000",
        "aws_endpoint_url_s3": "http://127.0.0.1:9000",  # obstore prefers it to aws_endpoint
    }
    creds = got["credential_provider"]
    assert creds() == {
        "access_key_id": "k1",
        "secret_access_key": "s1",
        "token": None,
        "expires_at": None,
    }
    assert "s1" not in repr(creds)
    assert got["client_options"]["allow_http"] is True
    assert got["retry_config"]["max_retries"] == 0  # ours are counted and bounded


def test_credentials_region_and_endpoint_from_the_environment(tmp_path: Path) -> None:
    env = clean_env(
        tmp_path,
        AWS_ACCESS_KEY_ID="k2",
        AWS_SECRET_ACCESS_KEY="s2",
        AWS_SESSION_TOKEN="t2",
        AWS_REGION="eu-west-3",
        AWS_ENDPOINT_URL_S3="https://s3.example.com",
    )
    got = obstore_settings({}, T, env)
    assert got["config"] == {
        "aws_region": "eu-west-3",
        "aws_endpoint": "https://s3.example.com",
        "aws_endpoint_url_s3": "https://s3.example.com",
    }
    assert got["credential_provider"]() == {
        "access_key_id": "k2",
        "secret_access_key": "s2",
        "token": "t2",
        "expires_at": None,
    }


def test_keys_in_the_options_take_no_token_from_the_environment(tmp_path: Path) -> None:
    # As botocore: keys given explicitly are used alone (obstore would add the variable's token).
    env = clean_env(tmp_path, AWS_SESSION_TOKEN="t3", AWS_ENDPOINT_URL_S3="http://127.0.0.1:9")
    options = {"key": "k3", "secret": "s3", "endpoint_url": "http://h:1"}
    got = obstore_settings(options, T, env)
    assert got["credential_provider"]()["token"] is None
    assert got["config"]["aws_endpoint_url_s3"] == "http://h:1"


def test_anonymous_needs_no_credentials(tmp_path: Path) -> None:
    config = obstore_settings({"anon": True}, T, clean_env(tmp_path, AWS_REGION="us-west-2"))
    assert config["config"] == {"aws_region": "us-west-2", "aws_skip_signature": True}
    assert "credential_provider" not in config


@pytest.mark.parametrize(
    ("options", "env", "named"),
    [
        (
            {"key": "k", "secret": "s", "config_kwargs": {"signature_version": "s3"}},
            {},
            "config_kwargs",
        ),
        (
            {"key": "k", "secret": "s", "client_kwargs": {"verify": False}},
            {},
            "client_kwargs['verify']",
        ),
        ({"key": "k", "secret": "s", "requester_pays": True}, {}, "requester_pays"),
        ({"key": "k", "secret": "s"}, {"AWS_PROFILE": "p"}, "AWS_PROFILE"),
        ({"key": "k", "secret": "s"}, {"AWS_ROLE_ARN": "r"}, "AWS_ROLE_ARN"),
        ({}, {"AWS_REGION": "us-east-1"}, "credentials"),
        ({"key": "k", "secret": "s"}, {}, "no region"),
        (
            {"anon": True, "endpoint_url": "https://s3.example.com"},
            {"AWS_CA_BUNDLE": "/ca"},
            "AWS_CA_BUNDLE",
        ),
    ],
)
def test_what_only_s3fs_does_is_left_to_it(
    tmp_path: Path, options: dict[str, object], env: dict[str, str], named: str
) -> None:
    with pytest.raises(NotTranslated) as info:
        obstore_settings(options, T, clean_env(tmp_path, **env))
    assert named in str(info.value)
    assert "'s'" not in str(info.value) and "'k'" not in str(info.value)  # names, not values


def test_an_aws_folder_is_left_to_s3fs(tmp_path: Path) -> None:
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws/config").write_text("[default]\nregion = eu-west-1\n")
    options = {"key": "k", "secret": "s", "endpoint_url": "http://h:1"}
    with pytest.raises(NotTranslated, match="config"):
        obstore_settings(options, T, clean_env(tmp_path))
    # Chosen explicitly, obstore reads without it.
    assert obstore_settings(options, T, clean_env(tmp_path), strict=False)["config"]


def test_errors_keep_their_status_and_code() -> None:
    class GenericError(Exception):
        pass

    raw = GenericError(
        "Generic S3 error: Error performing GET http://h/b/x in 1.2ms - Server returned non-2xx "
        'status code: 503 Service Unavailable: <?xml version="1.0"?><Error><Code>SlowDown</Code>'
        "<Message>Please reduce your request rate.</Message></Error>\n\nDebug source:\nGeneric {}"
    )
    err = translate(raw)
    assert (getattr(err, "status", None), getattr(err, "code", None)) == (503, "SlowDown")
    assert str(err) == (
        "Generic S3 error: Error performing GET http://h/b/x: SlowDown: Please reduce your "
        "request rate."
    )
    lost = translate(
        GenericError(
            "Generic S3 error: Error performing GET http://h/b/x in 3ms - "
            "HTTP error: error sending request\n\nDebug source:\n..."
        )
    )
    assert isinstance(lost, ConnectionError)  # transient: retried


# --- the choice, against the S3 server --------------------------------------------------------


@pytest.mark.parametrize(
    ("client", "extra", "store"),
    [
        ("auto", {}, "ObstoreS3"),
        ("auto", {"config_kwargs": {"connect_timeout": 5}}, "S3Store"),
        ("obstore", {}, "ObstoreS3"),
        ("s3fs", {}, "S3Store"),
    ],
)
def test_the_client_chosen(
    s3: S3Server,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    client: str,
    extra: dict[str, object],
    store: str,
) -> None:
    monkeypatch.setenv(CLIENT_VARIABLE, client)
    # The machine's own AWS settings would rightly send "auto" to s3fs: none here.
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    source = RemoteSource(s3.storage_options(**extra))
    try:
        f = source.open(urls()[0])
        assert isinstance(f, RemoteFile)
        assert type(f.store).__name__ == store
    finally:
        source.close()


async def test_obstore_chosen_where_it_cannot_translate_is_a_source_error(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CLIENT_VARIABLE, "obstore")
    options = s3.storage_options(config_kwargs={"signature_version": "s3v4-secretish"})
    before = await asnapshot()
    with pytest.raises(SourceError) as info:
        async with AsyncHDF5DataLayer(urls(), batch_size=10, storage_options=options):
            pytest.fail("the layer opened")
    await aassert_released(before)
    check_message(info.value, urls()[0], "ASYNCHDF5_S3_CLIENT=obstore", "config_kwargs")
    shown = "".join(traceback.format_exception(info.value))
    assert SECRET not in shown and KEY_ID not in shown and "secretish" not in shown


async def test_an_epoch_through_obstore(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CLIENT_VARIABLE, "obstore")
    with anyio.fail_after(30):
        async with AsyncHDF5DataLayer(
            urls(),
            batch_size=16,
            shuffle=True,
            seed=2,
            chunk_size=64,
            storage_options=s3.storage_options(),
        ) as layer:
            check_epoch([b async for b in layer], sum(SIZES), 16, 0)
            assert layer.stats.read_retries == 0


# --- a process that ends with requests in flight ----------------------------------------------

_ENDS_MID_EPOCH = """
import os, sys, anyio
from asynchdf5 import AsyncHDF5DataLayer

async def main():
    layer = AsyncHDF5DataLayer({urls!r}, batch_size=4, chunk_size=8, shuffle=True,
                               storage_options={options!r})
    await layer.__aenter__()
    async for _ in layer:
        break
    {ending}

anyio.run(main)
"""


@pytest.mark.parametrize("ending", ["os._exit(0)", "sys.exit(0)", "raise KeyboardInterrupt"])
def test_a_process_ending_mid_epoch_exits_cleanly(
    s3: S3Server, tmp_path: Path, ending: str
) -> None:
    """obstore's threads deliver each answer through Python: one that arrived while the
    interpreter shut down once aborted a process (SIGABRT) in an experiment. The layer is left
    open with requests in flight (each held up by the server) and the process ends: it must end
    as Python says, every time."""
    script = tmp_path / "ends.py"
    script.write_text(
        textwrap.dedent(_ENDS_MID_EPOCH).format(
            urls=urls(), options=s3.storage_options(), ending=ending
        )
    )
    s3.faults(latency=0.05)

    def run() -> None:
        proc = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            timeout=60,
            cwd=ROOT,
            env={**os.environ, CLIENT_VARIABLE: "obstore"},
        )
        want = -2 if "KeyboardInterrupt" in ending else 0  # Python ends by SIGINT then
        assert proc.returncode == want, (proc.returncode, proc.stderr.decode()[-2000:])
        assert b"Fatal Python error" not in proc.stderr

    try:  # four processes, side by side (the server is threaded): most of each is its start
        with ThreadPoolExecutor(4) as pool:
            for done in [pool.submit(run) for _ in range(4)]:
                done.result()
    finally:
        s3.faults(clear=True)
