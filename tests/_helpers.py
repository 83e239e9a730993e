"""Helpers that tests of several modules share and that are not data: the command line run
in-process."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from asynchdf5._cli import main


def run_main(args: Sequence[object], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``asynchdf5 ARGS`` in this process: its exit status, and what it wrote to stdout and
    stderr."""
    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err
