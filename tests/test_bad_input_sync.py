"""Bad inputs, part 4 (the sync facade: the same errors, and its event loop thread is gone
after ``with``): each raises the right error, names what is wrong, leaks nothing.

What every part checks, and the data they read: part 1, ``test_bad_input_sources``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from asynchdf5 import (
    Batch,
    ConfigurationError,
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
    write_bad_file,
    write_h5,
)
from ._leaks import Snapshot, assert_released, snapshot


def portal_threads() -> list[threading.Thread]:
    """The sync facade's event loop threads (``asynchdf5-asyncio-bridge``)."""
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith("asynchdf5-") and t.name.endswith("-bridge")
    ]


# --------------------------------------------------------------------------------------------
# The sync facade: the same errors, and its event loop thread is gone after `with`
# --------------------------------------------------------------------------------------------


def assert_facade_released(before: Snapshot) -> None:
    assert not [t for t in portal_threads() if t not in before.threads]
    assert_released(before)


def test_facade_open_error(tmp_path: Path) -> None:
    bad = write_bad_file(tmp_path, "text")
    before = snapshot()
    layer = HDF5DataLayer(tmp_path / "train.txt", batch_size=10)
    with pytest.raises(SourceError) as info:
        with layer:
            pytest.fail("the layer opened")
    check_message(info.value, bad, "not an HDF5 file")
    assert_facade_released(before)


def test_facade_schema_error(tmp_path: Path) -> None:
    a = write_h5(tmp_path / "a.h5", 0, 100)
    b = write_h5(tmp_path / "b.h5", 100, 100, label=None)
    before = snapshot()
    with pytest.raises(SchemaError) as info:
        with HDF5DataLayer([a, b], batch_size=10):
            pytest.fail("the layer opened")
    check_message(info.value, b, "'label'")
    assert_facade_released(before)


def test_facade_open_config_error(source: tuple[Path, list[Path]]) -> None:
    before = snapshot()
    with pytest.raises(ConfigurationError, match="world_size"):
        with HDF5DataLayer(source[0], batch_size=1, world_size=N + 1):
            pytest.fail("the layer opened")
    assert_facade_released(before)


def test_facade_transform_error(source: tuple[Path, list[Path]]) -> None:
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
    ) as layer:
        assert [t for t in portal_threads() if t not in before.threads]
        with pytest.raises(TransformError) as info:
            for b in layer:
                got.append(b)
    assert_facade_released(before)
    assert len(check_prefix(got, 10)) == 150
    check_message(info.value, "'label'", "explode_on_row_150", "ArithmeticError")
    assert isinstance(info.value.__cause__, ArithmeticError)


def test_facade_break_then_next_epoch_is_whole(source: tuple[Path, list[Path]]) -> None:
    before = snapshot()
    with HDF5DataLayer(source[0], batch_size=16, chunk_size=64, shuffle=True, seed=1) as layer:
        for i, b in enumerate(layer):
            check_batch(b, 16)
            if i == 2:
                break
        check_epoch(list(layer), N, 16, 1)
        for _ in layer:
            break
    assert_facade_released(before)


def test_facade_error_in_the_body(source: tuple[Path, list[Path]]) -> None:
    before = snapshot()
    with pytest.raises(RuntimeError, match="user code"):
        with HDF5DataLayer(source[0], batch_size=10) as layer:
            for _ in layer:
                raise RuntimeError("user code")
    assert_facade_released(before)
