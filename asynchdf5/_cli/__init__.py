"""The command line: ``asynchdf5 COMMAND`` (also ``python -m asynchdf5 COMMAND``).

Each command lives in its own module and registers its subparser here: ``inspect`` (what the
layer will find in a source, and how it will read it), ``pack`` (write training files that load
fast), ``bench`` (one epoch of your files through the layer, against the limits) and ``demo``.

Ctrl-C, SIGTERM and SIGHUP end a command the same way: the clean-ups run (temporary files and
folders are removed, worker processes stopped), one line says what happened, and the exit status
is 128 + the signal's number (130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

from . import _bench, _demo, _inspect, _pack_args

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

__all__ = ["build_parser", "main"]

#: Signals that end a command like Ctrl-C does (where the platform has them).
_ENDING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command."""
    parser = argparse.ArgumentParser(
        prog="asynchdf5",
        description=(
            "asynchdf5: an anyio-based chunked HDF5 data layer for NN training. From raw data "
            "to training: `pack` your data into HDF5, `inspect` how the layer reads it, `bench` "
            "an epoch of it."
        ),
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log what the layer does (the `asynchdf5` logger at INFO; -vv: DEBUG)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _inspect.add_parser(commands)
    _pack_args.add_parser(commands)
    _bench.add_parser(commands)
    _demo.add_parser(commands)
    return parser


@dataclass
class _Interrupt:
    """The signal that interrupted the command (SIGINT unless SIGTERM or SIGHUP came)."""

    signum: int = signal.SIGINT


@contextmanager
def _signals_interrupt() -> Iterator[_Interrupt]:
    """SIGTERM and SIGHUP interrupt the command as Ctrl-C does, so that the same clean-ups run.

    The handler calls the handler of SIGINT of the moment, with the interrupted frame, so that
    whoever handles Ctrl-C then does it as usual (an asyncio runner cancels its main task, trio
    delivers KeyboardInterrupt where it is safe, plain code gets KeyboardInterrupt); where
    SIGINT is ignored (a background job of a shell script), it raises KeyboardInterrupt. Only
    the main thread can install handlers; the previous ones are put back afterwards.
    """
    caught = _Interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        caught.signum = signum
        on_sigint = signal.getsignal(signal.SIGINT)
        if not callable(on_sigint):
            raise KeyboardInterrupt
        on_sigint(signal.SIGINT, frame)  # as if Ctrl-C had come at the same point

    previous = {s: signal.signal(s, interrupt) for s in _ENDING}
    try:
        yield caught
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is Ctrl-C: a KeyboardInterrupt, or (on trio, which raises it in the
    task it interrupts) a group of exceptions holding one."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    return isinstance(exc, BaseExceptionGroup) and exc.split(KeyboardInterrupt)[0] is not None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit status."""
    args = build_parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(format="%(name)s: %(levelname)s: %(message)s")
        level = logging.INFO if args.verbose == 1 else logging.DEBUG
        logging.getLogger("asynchdf5").setLevel(level)
    with _signals_interrupt() as caught:
        try:
            status: int = args.run(args)
        except BaseException as exc:
            if not _interrupted(exc):
                raise
            name = signal.Signals(caught.signum).name
            print(f"asynchdf5 {args.command}: interrupted ({name})", file=sys.stderr, flush=True)
            return 128 + int(caught.signum)
        except BrokenPipeError:  # `asynchdf5 inspect ... | head`: the reader left, so do we
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout
            os.close(devnull)
            return 141  # 128 + SIGPIPE, as a shell reports it
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
