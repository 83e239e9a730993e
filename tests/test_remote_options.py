"""The layer's ``storage_options`` reach every remote read: a source list file given as a URL,
the HDF5 objects it names, with each S3 client (s3fs and obstore).

The environment points elsewhere on purpose: its endpoint refuses connections and its keys
(and session token) are wrong, while the S3 server checks signatures (moto's IAM
authentication on). A read that takes anything from the environment instead of the layer's
options fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from asynchdf5 import AsyncHDF5DataLayer
from support.s3_server import S3Server

from ._files import SIZES, check_epoch, write_source
from ._helpers import one_epoch
from .conftest import S3Objects

pytestmark = pytest.mark.anyio

BUCKET = "options"
N = sum(SIZES)
REFUSED = "http://127.0.0.1:9"  # the discard port: nothing listens, connections are refused


@pytest.fixture(scope="module")
def s3_objects(tmp_path_factory: pytest.TempPathFactory) -> S3Objects:
    """The module's server (``s3``, its authentication switched on) holds ``data/part{i}.h5``,
    the last part under ``other/`` instead, and ``lists/train.txt`` naming them (relative
    entries, and one URL)."""
    _, paths = write_source(tmp_path_factory.mktemp("s3-options"))
    objects: dict[str, Path | bytes] = {f"data/{p.name}": p for p in paths}
    objects["other/last.h5"] = objects.pop(f"data/part{len(SIZES) - 1}.h5")
    lines = [f"../data/part{i}.h5" for i in range(len(SIZES) - 1)]
    lines.append(f"s3://{BUCKET}/other/last.h5")
    objects["lists/train.txt"] = ("\n".join(lines) + "\n").encode()
    return {BUCKET: objects}


@pytest.fixture(scope="module")
def user_key(s3: S3Server) -> dict[str, str]:
    """The key of a user the server knows (made once: a user may hold two keys)."""
    with s3.client("iam") as iam:
        iam.create_user(UserName="reader")
        iam.put_user_policy(
            UserName="reader",
            PolicyName="read",
            PolicyDocument='{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", '
            '"Action": "s3:*", "Resource": "*"}]}',
        )
        key = iam.create_access_key(UserName="reader")["AccessKey"]
    return {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}


@pytest.fixture
def credentials(s3: S3Server, user_key: dict[str, str]) -> Iterator[dict[str, str]]:
    """:func:`user_key`, while the server checks every request's signature."""
    s3.reset_auth(0)
    try:
        yield user_key
    finally:
        s3.reset_auth(float("inf"))


@pytest.fixture
def misleading_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """AWS settings that lead nowhere: an endpoint that refuses connections, keys and a session
    token the server does not know; a home without ``~/.aws``, and no other AWS setting."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.setenv(name, REFUSED)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-from-the-environment")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "wrong-token-from-the-environment")


@pytest.mark.usefixtures("misleading_environment")
@pytest.mark.parametrize("client", ["s3fs", "obstore", "auto"])
async def test_a_list_file_url_and_its_objects_are_read_with_the_layers_options(
    s3: S3Server, credentials: dict[str, str], client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if client == "obstore":
        pytest.importorskip("obstore")
    monkeypatch.setenv("ASYNCHDF5_S3_CLIENT", client)
    options = {**credentials, "client_kwargs": {"endpoint_url": s3.endpoint}}
    layer = AsyncHDF5DataLayer(
        f"s3://{BUCKET}/lists/train.txt",
        batch_size=32,
        shuffle=True,
        seed=5,
        chunk_size=64,
        storage_options=options,
    )
    assert layer.paths == [
        *(f"s3://{BUCKET}/data/part{i}.h5" for i in range(len(SIZES) - 1)),
        f"s3://{BUCKET}/other/last.h5",
    ]
    assert len(layer) == -(-N // 32)
    async with layer:
        for e in range(2):
            check_epoch(await one_epoch(layer), N, 32, e)
