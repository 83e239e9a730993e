"""The catalogue of bad inputs: each raises the right error, names what is wrong, leaks nothing.

Every error below is checked for its class *and* for a message that names the file, the top, the
rows or the transformer involved. Configuration errors are raised at construction; source and
schema errors at the first call that needs the files (``len()``, ...) or when the layer is opened,
before any batch; read and transform errors from the ``async for`` (or ``for``) that was
waiting, after only complete, correct batches. After leaving ``async with`` (or ``with``) no task,
busy thread or file descriptor of ours may be left behind.

The fixture data make alignment checkable from the batch alone: row ``i`` of the source has
``label == i`` and ``data == [10 * i, 10 * i + 1]``, so a batch is correct when its labels equal
its ``indices`` and its data agree with both.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import h5py
import numpy as np
import pytest

from asynchdf5 import (
    AsyncHDF5DataLayer,
    Batch,
    ConfigurationError,
    DataLayerError,
    HDF5DataLayer,
    SchemaError,
    SourceError,
    TransformError,
)

from ._files import (
    N,
    check_batch,
    check_epoch,
    check_message,
    check_prefix,
    rows,
    write_h5,
    write_source,
)
from ._leaks import Snapshot, aassert_released, asnapshot, assert_released, snapshot

Backend = Literal["asyncio", "trio"]


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, list[Path]]:
    """A list file naming three files, 300 samples."""
    return write_source(tmp_path)


def portal_threads() -> list[threading.Thread]:
    """The sync facade's event loop threads (anyio names them ``<backend>-portal-<id>``)."""
    return [t for t in threading.enumerate() if "-portal-" in t.name]


async def open_must_fail(layer: AsyncHDF5DataLayer, exc_type: type[DataLayerError]) -> Any:
    """Open ``layer``, expecting ``exc_type`` before the body runs; check nothing is left."""
    before = await asnapshot()
    with pytest.raises(exc_type) as info:
        async with layer:
            pytest.fail("the layer opened")
    await aassert_released(before)
    return info.value


# --------------------------------------------------------------------------------------------
# Source list and files: SourceError
# --------------------------------------------------------------------------------------------


def test_list_file_missing(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(SourceError) as info:
        AsyncHDF5DataLayer(missing, batch_size=4)
    check_message(info.value, missing, "does not exist")


def test_list_file_is_a_directory(tmp_path: Path) -> None:
    # Stands in for an unreadable list file where chmod cannot make one (see the next test).
    with pytest.raises(SourceError) as info:
        AsyncHDF5DataLayer(tmp_path, batch_size=4)
    check_message(info.value, tmp_path, "directory")


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="running as root: chmod 000 does not stop root from reading a file",
)
def test_list_file_unreadable(source: tuple[Path, list[Path]]) -> None:
    lst, _ = source
    lst.chmod(0)
    try:
        with pytest.raises(SourceError) as info:
            AsyncHDF5DataLayer(lst, batch_size=4)
    finally:
        lst.chmod(0o644)
    check_message(info.value, lst)


def test_list_file_not_text(tmp_path: Path) -> None:
    lst = tmp_path / "train.txt"
    lst.write_bytes(b"\xff\xfe\x00garbage\x80")
    with pytest.raises(SourceError) as info:
        AsyncHDF5DataLayer(lst, batch_size=4)
    check_message(info.value, lst)


@pytest.mark.parametrize("text", ["", "\n\n   \n", "# only\n  # comments\n\n"])
def test_list_file_names_no_file(tmp_path: Path, text: str) -> None:
    lst = tmp_path / "train.txt"
    lst.write_text(text)
    with pytest.raises(SourceError) as info:
        AsyncHDF5DataLayer(lst, batch_size=4)
    check_message(info.value, lst, "no HDF5 file")


@pytest.mark.parametrize("empty", [[], ()])
def test_empty_sequence(empty: Sequence[str]) -> None:
    with pytest.raises(SourceError, match="empty sequence"):
        AsyncHDF5DataLayer(empty, batch_size=4)


@pytest.mark.parametrize("bad", [b"train.txt", 3, None, [Path("a.h5"), 3]])
def test_source_of_wrong_type(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="source"):
        AsyncHDF5DataLayer(bad, batch_size=4)


def _listed_bad_file(folder: Path, kind: str) -> Path:
    """Write a good source whose second file is replaced by something bad; return that path."""
    _, paths = write_source(folder)
    bad = paths[1]
    bad.unlink()
    if kind == "text":
        bad.write_text("data,label\n1,2\n")
    elif kind == "zero-byte":
        bad.touch()
    elif kind == "directory":
        bad.mkdir()
    elif kind == "corrupt":
        # The HDF5 signature, then garbage: passes the signature check, fails in HDF5.
        bad.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(range(256)) * 8)
    return bad


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("missing", "does not exist"),
        ("text", "not an HDF5 file"),
        ("zero-byte", "not an HDF5 file"),
        ("directory", "directory"),
        ("corrupt", "cannot open"),
    ],
)
async def test_listed_file_bad(tmp_path: Path, kind: str, words: str) -> None:
    bad = _listed_bad_file(tmp_path, kind)
    layer = AsyncHDF5DataLayer(tmp_path / "train.txt", batch_size=10)
    err = await open_must_fail(layer, SourceError)
    check_message(err, bad, words)


@pytest.mark.anyio
@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="running as root: chmod 000 does not stop root from reading a file",
)
async def test_listed_file_unreadable(source: tuple[Path, list[Path]]) -> None:
    lst, paths = source
    paths[1].chmod(0)
    try:
        err = await open_must_fail(AsyncHDF5DataLayer(lst, batch_size=10), SourceError)
    finally:
        paths[1].chmod(0o644)
    check_message(err, paths[1], "not readable")


# --------------------------------------------------------------------------------------------
# Tops: SchemaError
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_top_missing_from_second_file(tmp_path: Path) -> None:
    a = write_h5(tmp_path / "a.h5", 0, 100)
    b = write_h5(tmp_path / "b.h5", 100, 100, label=None)
    with h5py.File(b) as f:
        assert "label" not in f
    err = await open_must_fail(AsyncHDF5DataLayer([a, b], batch_size=10), SchemaError)
    check_message(err, b, "'label'", "missing")


@pytest.mark.parametrize(
    "ask",
    [len, lambda layer: layer.n_samples, lambda layer: layer.state_dict()],
    ids=["len", "n_samples", "state_dict"],
)
def test_schema_error_comes_at_the_first_call_that_needs_the_files(
    tmp_path: Path, ask: Callable[[AsyncHDF5DataLayer], object]
) -> None:
    # docs/errors.md, moment 2: construction opens no file; len() and the like, before
    # `async with`, read the files' metadata and raise what is wrong with them, every time.
    a = write_h5(tmp_path / "a.h5", 0, 100)
    b = write_h5(tmp_path / "b.h5", 100, 100, label=None)
    before = snapshot()
    layer = AsyncHDF5DataLayer([a, b], batch_size=10)
    for _ in range(2):
        with pytest.raises(SchemaError) as info:
            ask(layer)
        check_message(info.value, b, "'label'", "missing")
    assert_released(before)


@pytest.mark.anyio
async def test_tops_of_one_file_have_different_row_counts(tmp_path: Path) -> None:
    a = write_h5(tmp_path / "a.h5", 0, 100)
    b = write_h5(tmp_path / "b.h5", 100, 100, label=np.arange(99, dtype=np.int64))
    err = await open_must_fail(AsyncHDF5DataLayer([a, b], batch_size=10), SchemaError)
    check_message(err, b, "'data': 100", "'label': 99")


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("data", "words"),
    [
        (np.zeros((100, 3), np.float32), ["(3,)", "(2,)"]),  # sample shape differs
        (np.zeros((100, 2, 1), np.float32), ["(2, 1)", "(2,)"]),  # rank differs
        (np.zeros((100, 2), np.float64), ["float64", "float32"]),  # dtype differs
    ],
)
async def test_top_sample_shape_or_dtype_differs_between_files(
    tmp_path: Path, data: np.ndarray, words: list[str]
) -> None:
    a = write_h5(tmp_path / "a.h5", 0, 100)
    b = write_h5(tmp_path / "b.h5", 100, 100, data=data)
    err = await open_must_fail(AsyncHDF5DataLayer([a, b], batch_size=10), SchemaError)
    check_message(err, a, b, "'data'", *words)


def _bad_top(f: h5py.File, kind: str) -> None:
    if kind == "0-d":
        f.create_dataset("label", data=7)
    elif kind == "empty dataspace":
        f.create_dataset("label", data=h5py.Empty("i8"))
    elif kind == "compound":
        f.create_dataset("label", data=np.zeros(100, [("a", "i4"), ("b", "f4")]))
    elif kind == "fixed string":
        f.create_dataset("label", data=np.array([b"abc"] * 100, "S3"))
    elif kind == "vlen string":
        f.create_dataset("label", data=["abc"] * 100, dtype=h5py.string_dtype())
    elif kind == "vlen":
        d = f.create_dataset("label", (100,), dtype=h5py.vlen_dtype(np.int32))
        d[0] = np.arange(3, dtype=np.int32)
    elif kind == "group":
        f.create_group("label")
    elif kind == "array dtype":
        f.create_dataset("label", (100,), dtype=np.dtype(("i4", (2,))))


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("0-d", "0-d"),
        ("empty dataspace", "0-d"),
        ("compound", "compound"),
        ("fixed string", "strings"),
        ("vlen string", "strings"),
        ("vlen", "variable-length"),
        ("group", "Group"),
        ("array dtype", "dtype"),
    ],
)
async def test_unsupported_top(tmp_path: Path, kind: str, words: str) -> None:
    a = write_h5(tmp_path / "a.h5", 0, 100)
    b = tmp_path / "b.h5"
    with h5py.File(b, "w") as f:
        f.create_dataset("data", data=rows(100, 100)["data"])
        _bad_top(f, kind)
    err = await open_must_fail(AsyncHDF5DataLayer([a, b], batch_size=10), SchemaError)
    check_message(err, b, "'label'", words)


@pytest.mark.anyio
async def test_every_file_empty(tmp_path: Path) -> None:
    a = write_h5(tmp_path / "a.h5", 0, 0)
    err = await open_must_fail(AsyncHDF5DataLayer([a], batch_size=10), SourceError)
    check_message(err, "no samples")


# --------------------------------------------------------------------------------------------
# Keyword properties: ConfigurationError at construction
# --------------------------------------------------------------------------------------------

LayerClass = Callable[..., Any]
LAYERS: list[LayerClass] = [AsyncHDF5DataLayer, HDF5DataLayer]


def _ident(x: object) -> object:
    return x


CONFIG_CASES: list[tuple[dict[str, Any], list[str]]] = [
    ({"batch_size": 0}, ["batch_size", ">= 1", "0"]),
    ({"batch_size": -3}, ["batch_size", "-3"]),
    ({"batch_size": 4.0}, ["batch_size", "int", "float"]),
    ({"batch_size": True}, ["batch_size", "int", "bool"]),
    ({"batch_size": "4"}, ["batch_size", "int", "str"]),
    ({"batch_size": None}, ["batch_size", "int"]),
    ({"batch_size": 10, "chunk_size": 9}, ["chunk_size=9", "batch_size=10"]),
    ({"batch_size": 10, "chunk_size": 0}, ["chunk_size", ">= 1"]),
    ({"batch_size": 4, "tops": ()}, ["tops", "empty"]),
    ({"batch_size": 4, "tops": ("data", "label", "data")}, ["'data'", "twice"]),
    ({"batch_size": 4, "tops": ("data", 3)}, ["tops"]),
    ({"batch_size": 4, "transformers": [("nope", _ident)]}, ["transformers[0]", "'nope'"]),
    ({"batch_size": 4, "transformers": [("label", 3)]}, ["transformers[0]", "'label'", "callable"]),
    ({"batch_size": 4, "transformers": [_ident]}, ["transformers[0]", "pair"]),
    ({"batch_size": 4, "transformers": [("label",)]}, ["transformers[0]", "pair"]),
    ({"batch_size": 4, "transformers": [("label", _ident, 1)]}, ["transformers[0]", "pair"]),
    (
        {"batch_size": 4, "transformers": [("label", _ident), ("data", None)]},
        ["transformers[1]", "'data'", "callable"],
    ),
    ({"batch_size": 4, "transformers": ("label", _ident)}, ["transformers[0]", "pair"]),
    ({"batch_size": 4, "transformers": _ident}, ["transformers", "sequence"]),
    ({"batch_size": 4, "transformers": {"label": _ident}}, ["transformers", "sequence"]),
    ({"batch_size": 4, "rank": 2, "world_size": 2}, ["rank=2", "world_size"]),
    ({"batch_size": 4, "rank": -1, "world_size": 2}, ["rank", "-1"]),
    ({"batch_size": 4, "rank": 0, "world_size": 0}, ["world_size", "0"]),
    ({"batch_size": 4, "rank": 1.0, "world_size": 2}, ["rank", "int"]),
    ({"batch_size": 4, "shuffle": True, "world_size": 2}, ["shuffle", "world_size", "seed"]),
    ({"batch_size": 4, "shuffle": "yes"}, ["shuffle"]),
    ({"batch_size": 4, "drop_last": 1}, ["drop_last"]),
    ({"batch_size": 4, "seed": -1}, ["seed", "-1"]),
    ({"batch_size": 4, "prefetch": 0}, ["prefetch"]),
    ({"batch_size": 4, "cache_bytes": 0}, ["cache_bytes"]),
]


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("kwargs", "words"), CONFIG_CASES)
def test_bad_keyword_property(
    source: tuple[Path, list[Path]], cls: LayerClass, kwargs: dict[str, Any], words: list[str]
) -> None:
    before = snapshot()
    with pytest.raises(ConfigurationError) as info:
        cls(source[0], **kwargs)
    assert isinstance(info.value, ValueError)
    check_message(info.value, *words)
    assert_released(before)


def test_shuffle_with_world_size_and_a_seed_is_fine(source: tuple[Path, list[Path]]) -> None:
    AsyncHDF5DataLayer(source[0], batch_size=4, shuffle=True, world_size=2, rank=1, seed=3)


# --- needs the sample count: ConfigurationError when the layer opens --------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("batch_size", "rank", "world_size"),
    [(N + 1, 0, 1), (N, 1, 2), (100, 3, 4)],  # the last: 75 samples a rank, fewer than a batch
)
async def test_drop_last_leaves_no_batch(
    source: tuple[Path, list[Path]], batch_size: int, rank: int, world_size: int
) -> None:
    layer = AsyncHDF5DataLayer(
        source[0], batch_size=batch_size, drop_last=True, rank=rank, world_size=world_size
    )
    err = await open_must_fail(layer, ConfigurationError)
    check_message(err, "drop_last", f"batch_size={batch_size}")


@pytest.mark.anyio
async def test_drop_last_error_names_the_sample_count(source: tuple[Path, list[Path]]) -> None:
    layer = AsyncHDF5DataLayer(source[0], batch_size=N + 1, drop_last=True)
    err = await open_must_fail(layer, ConfigurationError)
    check_message(err, f"{N} samples")


@pytest.mark.anyio
async def test_world_size_larger_than_sample_count(source: tuple[Path, list[Path]]) -> None:
    layer = AsyncHDF5DataLayer(source[0], batch_size=1, rank=0, world_size=N + 1)
    err = await open_must_fail(layer, ConfigurationError)
    check_message(err, f"{N} samples", f"world_size={N + 1}")


@pytest.mark.anyio
async def test_batch_larger_than_data_without_drop_last_is_one_batch(
    source: tuple[Path, list[Path]],
) -> None:
    async with AsyncHDF5DataLayer(source[0], batch_size=N + 1) as layer:
        batches = [b async for b in layer]
    check_epoch(batches, N, N + 1, 0)
    assert len(batches) == 1


# --------------------------------------------------------------------------------------------
# During an epoch: TransformError and ReadError, after only complete batches
# --------------------------------------------------------------------------------------------


async def collect_until_error(
    layer: AsyncHDF5DataLayer,
    exc_type: type[DataLayerError],
    on_batch: Callable[[int], None] = lambda i: None,
) -> tuple[list[Batch], Any]:
    """Iterate one epoch of the open ``layer`` until it raises ``exc_type``."""
    got: list[Batch] = []
    with pytest.raises(exc_type) as info:
        async for b in layer:
            got.append(b)
            on_batch(len(got))
    return got, info.value


@pytest.mark.anyio
@pytest.mark.parametrize("fail_at", [0, 200])
async def test_transformer_raises(source: tuple[Path, list[Path]], fail_at: int) -> None:
    raised: list[BaseException] = []

    def explode_on_row(x: np.ndarray) -> np.ndarray:
        if x.max() >= fail_at:
            raised.append(KeyError(f"row {fail_at}"))
            raise raised[-1]
        return x

    before = await asnapshot()
    layer = AsyncHDF5DataLayer(
        source[0], batch_size=10, chunk_size=50, transformers=[("label", explode_on_row)]
    )
    async with layer:
        got, err = await collect_until_error(layer, TransformError)
    await aassert_released(before)
    seen = check_prefix(got, 10)
    # Batches are cut per chunk of 50, so every batch of the chunks before the failing row is
    # delivered before the error.
    assert len(seen) == fail_at
    check_message(err, "'label'", "explode_on_row", "KeyError")
    assert err.__cause__ is raised[0]


@pytest.mark.anyio
async def test_transformer_changes_row_count(source: tuple[Path, list[Path]]) -> None:
    def drop_a_row(x: np.ndarray) -> np.ndarray:
        return x[:-1] if x.max() >= 1200 else x  # data are 10 * index: from row 120 on

    before = await asnapshot()
    layer = AsyncHDF5DataLayer(
        source[0], batch_size=10, chunk_size=20, transformers=[("data", drop_a_row)]
    )
    async with layer:
        got, err = await collect_until_error(layer, TransformError)
    await aassert_released(before)
    assert len(check_prefix(got, 10)) == 120
    check_message(err, "'data'", "drop_a_row", "9 rows", "batch of 10")


@pytest.mark.anyio
async def test_transformer_returns_no_array(source: tuple[Path, list[Path]]) -> None:
    def to_list(x: np.ndarray) -> Any:
        return x.tolist()

    layer = AsyncHDF5DataLayer(source[0], batch_size=10, transformers=[("label", to_list)])
    async with layer:
        got, err = await collect_until_error(layer, TransformError)
    assert got == []
    check_message(err, "'label'", "to_list", "list")


# The source for mid-epoch file faults: 3 files of 400 rows, read in chunks of 20 rows. The
# pipeline runs ahead of the consumer by at most a few dozen batches (its item buffer and two
# cache slots), so after the first batch the last file is not read yet.
BIG = (400, 400, 400)


@pytest.mark.anyio
async def test_every_batch_before_a_transform_error_is_delivered(
    source: tuple[Path, list[Path]],
) -> None:
    def explode_on_row_230(x: np.ndarray) -> np.ndarray:
        if x.max() >= 230:
            raise ValueError("row 230")
        return x

    # Chunks of 100 rows: batches 20-29 are gathered in one worker-thread call.
    layer = AsyncHDF5DataLayer(
        source[0], batch_size=10, chunk_size=100, transformers=[("label", explode_on_row_230)]
    )
    async with layer:
        got, _ = await collect_until_error(layer, TransformError)
    assert len(check_prefix(got, 10)) == 230


# --------------------------------------------------------------------------------------------
# Leaving early: break and cancellation
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("shuffle", [False, True])
async def test_break_then_next_epoch_is_whole(
    source: tuple[Path, list[Path]], shuffle: bool
) -> None:
    before = await asnapshot()
    async with AsyncHDF5DataLayer(
        source[0], batch_size=16, chunk_size=64, shuffle=shuffle, seed=5
    ) as layer:
        got = []
        async for b in layer:
            check_batch(b, 16)
            got.append(b)
            if len(got) == 3:
                break
        assert {b.epoch for b in got} == {0}
        epoch1 = [b async for b in layer]
        check_epoch(epoch1, N, 16, 1)
        epoch2 = [b async for b in layer]
        check_epoch(epoch2, N, 16, 2)
        assert layer.epoch == 3
        async for _ in layer:
            break  # and leave `async with` from the middle of an epoch
    await aassert_released(before)


@pytest.mark.anyio
async def test_break_in_the_last_batch_and_in_the_first(source: tuple[Path, list[Path]]) -> None:
    async with AsyncHDF5DataLayer(source[0], batch_size=100) as layer:
        async for b in layer:
            if b.indices[-1] == N - 1:
                break  # the epoch's last batch: the epoch is over anyway
        async for b in layer:
            assert b.epoch == 1
            break
        check_epoch([b async for b in layer], N, 100, 2)


@pytest.mark.anyio
async def test_cancel_scope_around_the_loop(source: tuple[Path, list[Path]]) -> None:
    before = await asnapshot()
    async with AsyncHDF5DataLayer(source[0], batch_size=10, chunk_size=30) as layer:
        got = []
        with anyio.CancelScope() as scope:
            async for b in layer:
                got.append(b)
                if len(got) == 2:
                    scope.cancel()
                await anyio.sleep(0)
        assert scope.cancelled_caught
        check_prefix(got, 10)
        check_epoch([b async for b in layer], N, 10, 1)
    await aassert_released(before)


def _slow(x: np.ndarray) -> np.ndarray:
    time.sleep(0.01)
    return x


@pytest.mark.anyio
@pytest.mark.parametrize("deadline", [0.0, 0.005, 0.05])
async def test_move_on_after_while_waiting_for_a_batch(
    source: tuple[Path, list[Path]], deadline: float
) -> None:
    before = await asnapshot()
    async with AsyncHDF5DataLayer(
        source[0], batch_size=50, chunk_size=50, transformers=[("data", _slow)]
    ) as layer:
        got = []
        with anyio.move_on_after(deadline):
            async for b in layer:
                got.append(b)
        check_prefix(got, 50)
        # Whatever was cut short, the next epoch is whole (or, if nothing was yielded, the
        # same epoch starts over from its first batch).
        epoch = 1 if got else 0
        check_epoch([b async for b in layer], N, 50, epoch)
    await aassert_released(before)


@pytest.mark.anyio
@pytest.mark.parametrize("deadline", [0.0, 0.003, 0.03])
async def test_move_on_after_around_async_with(
    source: tuple[Path, list[Path]], deadline: float
) -> None:
    before = await asnapshot()
    got = []
    with anyio.move_on_after(deadline):
        async with AsyncHDF5DataLayer(
            source[0], batch_size=50, chunk_size=50, transformers=[("data", _slow)]
        ) as layer:
            for _ in range(100):
                async for b in layer:
                    got.append(b)
    await aassert_released(before)
    for b in got:
        check_batch(b, 50)


@pytest.mark.anyio
async def test_error_in_the_body_closes_everything(source: tuple[Path, list[Path]]) -> None:
    before = await asnapshot()
    with pytest.raises(RuntimeError, match="user code"):
        async with AsyncHDF5DataLayer(source[0], batch_size=10, chunk_size=20) as layer:
            async for _ in layer:
                raise RuntimeError("user code")
    await aassert_released(before)


@pytest.mark.anyio
async def test_error_in_the_body_is_not_wrapped(source: tuple[Path, list[Path]]) -> None:
    with pytest.raises(RuntimeError, match="user code"):
        async with AsyncHDF5DataLayer(source[0], batch_size=10) as layer:
            async for _ in layer:
                raise RuntimeError("user code")


@pytest.mark.anyio
async def test_uncaught_library_error_leaves_async_with_unwrapped(
    source: tuple[Path, list[Path]],
) -> None:
    def explode(x: np.ndarray) -> np.ndarray:
        raise ValueError("boom")

    with pytest.raises(TransformError, match="explode"):
        async with AsyncHDF5DataLayer(
            source[0], batch_size=10, transformers=[("label", explode)]
        ) as layer:
            async for _ in layer:
                pass


# --------------------------------------------------------------------------------------------
# The sync facade: the same errors, and its event loop thread is gone after `with`
# --------------------------------------------------------------------------------------------


@pytest.fixture(params=["asyncio", "trio"])
def facade_backend(request: pytest.FixtureRequest) -> Backend:
    return "trio" if request.param == "trio" else "asyncio"


def assert_facade_released(before: Snapshot, backend: str) -> None:
    assert not [t for t in portal_threads() if t not in before.threads]
    # On asyncio the facade's loop stops its worker threads when it ends; trio's thread cache is
    # process-wide and keeps idle workers for 10 s (see above), so there only our code is checked.
    assert_released(before, strict=backend == "asyncio")


def test_facade_open_error(tmp_path: Path, facade_backend: Backend) -> None:
    bad = _listed_bad_file(tmp_path, "text")
    before = snapshot()
    layer = HDF5DataLayer(tmp_path / "train.txt", batch_size=10, backend=facade_backend)
    with pytest.raises(SourceError) as info:
        with layer:
            pytest.fail("the layer opened")
    check_message(info.value, bad, "not an HDF5 file")
    assert_facade_released(before, facade_backend)


def test_facade_schema_error(tmp_path: Path, facade_backend: Backend) -> None:
    a = write_h5(tmp_path / "a.h5", 0, 100)
    b = write_h5(tmp_path / "b.h5", 100, 100, label=None)
    before = snapshot()
    with pytest.raises(SchemaError) as info:
        with HDF5DataLayer([a, b], batch_size=10, backend=facade_backend):
            pytest.fail("the layer opened")
    check_message(info.value, b, "'label'")
    assert_facade_released(before, facade_backend)


def test_facade_open_config_error(source: tuple[Path, list[Path]], facade_backend: Backend) -> None:
    before = snapshot()
    with pytest.raises(ConfigurationError, match="world_size"):
        with HDF5DataLayer(source[0], batch_size=1, world_size=N + 1, backend=facade_backend):
            pytest.fail("the layer opened")
    assert_facade_released(before, facade_backend)


def test_facade_transform_error(source: tuple[Path, list[Path]], facade_backend: Backend) -> None:
    def explode_on_row_150(x: np.ndarray) -> np.ndarray:
        if x.max() >= 150:
            raise ArithmeticError("row 150")
        return x

    before = snapshot()
    got: list[Batch] = []
    with HDF5DataLayer(
        source[0],
        batch_size=10,
        chunk_size=50,
        transformers=[("label", explode_on_row_150)],
        backend=facade_backend,
    ) as layer:
        assert [t for t in portal_threads() if t not in before.threads]
        with pytest.raises(TransformError) as info:
            for b in layer:
                got.append(b)
    assert_facade_released(before, facade_backend)
    assert len(check_prefix(got, 10)) == 150
    check_message(info.value, "'label'", "explode_on_row_150", "ArithmeticError")
    assert isinstance(info.value.__cause__, ArithmeticError)


def test_facade_break_then_next_epoch_is_whole(
    source: tuple[Path, list[Path]], facade_backend: Backend
) -> None:
    before = snapshot()
    with HDF5DataLayer(
        source[0], batch_size=16, chunk_size=64, shuffle=True, seed=1, backend=facade_backend
    ) as layer:
        for i, b in enumerate(layer):
            check_batch(b, 16)
            if i == 2:
                break
        check_epoch(list(layer), N, 16, 1)
        for _ in layer:
            break
    assert_facade_released(before, facade_backend)


def test_facade_error_in_the_body(source: tuple[Path, list[Path]], facade_backend: Backend) -> None:
    before = snapshot()
    with pytest.raises(RuntimeError, match="user code"):
        with HDF5DataLayer(source[0], batch_size=10, backend=facade_backend) as layer:
            for _ in layer:
                raise RuntimeError("user code")
    assert_facade_released(before, facade_backend)


# --------------------------------------------------------------------------------------------
# Checks that must agree across ranks, budgets, and messages that say what the user needs
# --------------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("sizes", "batch_size", "world_size", "drop_last"),
    [
        ((3,), 4, 2, False),  # q == 0, leftover 3 >= 2: every rank gets one partial batch
        ((1,), 4, 2, False),  # fewer samples than ranks
        ((5,), 1, 3, False),  # batch_size 1, leftover 2 < 3: impossible
        ((7,), 4, 2, True),  # drop_last leaves no batch
        ((9,), 4, 2, False),  # leftover 1 < 2 with q == 1: the (B-1, 1) split
    ],
)
async def test_every_rank_gets_the_same_answer(
    tmp_path: Path, sizes: tuple[int, ...], batch_size: int, world_size: int, drop_last: bool
) -> None:
    """An impossible split fails on every rank, or on none: a rank failing alone would leave
    the others waiting in their collectives forever."""
    lst, _ = write_source(tmp_path, sizes)
    outcomes = []
    counts = []
    for rank in range(world_size):
        layer = AsyncHDF5DataLayer(
            lst, batch_size=batch_size, rank=rank, world_size=world_size, drop_last=drop_last
        )
        try:
            async with layer:
                counts.append(len([b async for b in layer]))
            outcomes.append("ok")
        except ConfigurationError as exc:
            outcomes.append(str(exc))
    assert len(set(outcomes)) == 1, outcomes
    assert len(set(counts)) <= 1


@pytest.mark.anyio
async def test_a_sample_larger_than_the_cache_budget(tmp_path: Path) -> None:
    path = write_h5(tmp_path / "big.h5", 0, 10, data=np.zeros((10, 1000), np.float64))
    layer = AsyncHDF5DataLayer([path], batch_size=1, cache_bytes=4000)
    err = await open_must_fail(layer, ConfigurationError)
    check_message(err, "cache_bytes=4000", "8008 bytes", "raise cache_bytes")


@pytest.mark.anyio
async def test_a_missing_top_lists_the_datasets_the_file_has(tmp_path: Path) -> None:
    path = tmp_path / "nested.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("images/train", data=np.zeros((5, 2)))
        f.create_dataset("meta/labels", data=np.arange(5))
    layer = AsyncHDF5DataLayer([path], batch_size=2, tops=("images/train", "label"))
    err = await open_must_fail(layer, SchemaError)
    check_message(err, path, "'label'", "'/images/train'", "'/meta/labels'")
