"""A remote stream beside a local one (issue 33): one stream's files on the S3 server
(``conftest.s3``), the other's on the local disk, mixed in one layer."""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest

from asynchdf5 import AsyncHDF5DataLayer, Stream
from support.s3_server import S3Server

from ._files import check_batch, check_exactly_once, write_h5
from .conftest import S3Objects

pytestmark = pytest.mark.anyio

BUCKET = "asynchdf5-streams"


@pytest.fixture(scope="module")
def s3_objects(tmp_path_factory: pytest.TempPathFactory) -> S3Objects:
    folder = tmp_path_factory.mktemp("s3-streams")
    return {BUCKET: {"r0.h5": write_h5(folder / "r0.h5", 0, 120)}}


async def test_a_remote_stream_beside_a_local_one(s3: S3Server, tmp_path: Path) -> None:
    local = [write_h5(tmp_path / "l0.h5", 120, 40)]
    source = {"remote": Stream([f"s3://{BUCKET}/r0.h5"]), "local": Stream(local)}
    layer = AsyncHDF5DataLayer(
        source,
        batch_size=16,
        shuffle=True,
        seed=1,
        chunk_size=48,
        storage_options=s3.storage_options(),
    )
    with anyio.fail_after(30):
        async with layer:
            batches = [b async for b in layer]
    for b in batches:
        check_batch(b, b.size)
        assert b.streams is not None
        got = np.bincount(b.streams, minlength=2)
        if b.size == 16:
            assert got.tolist() == [12, 4]  # 120 : 40
    check_exactly_once([b.indices for b in batches], 160)
    assert layer.stats.stream_samples == {"remote": 120, "local": 40}
