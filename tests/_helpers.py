"""Helpers that tests of several modules share and that are not data: the command line run
in-process, and a layer that must fail to open."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from asynchdf5 import AsyncHDF5DataLayer, DataLayerError
from asynchdf5._cli import main

from ._leaks import aassert_released, asnapshot


def run_main(args: Sequence[object], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``asynchdf5 ARGS`` in this process: its exit status, and what it wrote to stdout and
    stderr."""
    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


async def open_must_fail(layer: AsyncHDF5DataLayer, exc_type: type[DataLayerError]) -> Any:
    """Open ``layer``, expecting ``exc_type`` before the body runs; check nothing is left."""
    before = await asnapshot()
    with pytest.raises(exc_type) as info:
        async with layer:
            pytest.fail("the layer opened")
    await aassert_released(before)
    return info.value
