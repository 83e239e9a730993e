"""The command line: ``asynchdf5 COMMAND`` (also ``python -m asynchdf5 COMMAND``).

Each command lives in its own module and registers its subparser here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import _demo

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command."""
    parser = argparse.ArgumentParser(
        prog="asynchdf5",
        description="asynchdf5: an anyio-based chunked HDF5 data layer for NN training.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _demo.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit status."""
    args = build_parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
