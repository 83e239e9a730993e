"""Small helpers of the command line: argument types, sizes in words, tables, progress bars,
Ctrl-C at safe points, and the event loop run with it."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import anyio

try:  # the `cli` and `pack` extras; the command line runs without a bar when it is missing
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is installed where the tests run
    tqdm = None

__all__ = [
    "Bar",
    "checkpoints",
    "fraction",
    "mib",
    "non_negative",
    "plural",
    "positive",
    "progress_bar",
    "run_async",
    "size_in_bytes",
    "table",
    "write_json",
]


def plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text}")
    return value


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def fraction(text: str) -> float:
    """A fraction in ``[0, 1)``."""
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and less than 1, not {text}")
    return value


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS.update({"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40})


def size_in_bytes(text: str) -> int:
    """A byte count such as ``4GiB``, ``512MiB``, ``2e9`` or ``1000000``."""
    t = text.strip().lower().removesuffix("b")
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if u and t.endswith(u)), "")
    try:
        value = float(t[: len(t) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size in bytes: {text!r} (e.g. 4GiB, 512MiB, 2e9)"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, not {text}")
    return int(value)


def mib(nbytes: float) -> str:
    """A byte count for people: ``12.3 MiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:,.0f} B"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> str:
    """A plain-text table with left-aligned columns."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        lines.append(
            indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        )
    return "\n".join(lines)


def write_json(document: object) -> None:
    """Print ``document`` as indented JSON on stdout (the ``--json`` output of a command)."""
    json.dump(document, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")
    sys.stdout.flush()


class Bar(Protocol):
    """What the commands use of a progress bar."""

    def update(self, n: int) -> Any: ...

    def write(self, text: str) -> None:
        """Print a line without breaking the bar."""
        ...


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)


class _TqdmBar:
    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def update(self, n: int) -> None:
        self._bar.update(n)

    def write(self, text: str) -> None:
        self._bar.write(text, file=sys.stderr)


@contextmanager
def progress_bar(total: int, desc: str, unit: str, *, leave: bool = True) -> Iterator[Bar]:
    """A tqdm bar on stderr with rate and ETA, shown only on a terminal and only when tqdm is
    installed (the ``cli`` or ``pack`` extra); otherwise nothing is drawn."""
    # No bar when stderr is not a terminal (logs, pipes, tests). Decided here rather than with
    # tqdm's disable=None: a disabled tqdm still starts its monitor thread, and leaves it running.
    if tqdm is None or not sys.stderr.isatty():
        yield _NoBar()
        return
    with tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=True,
        leave=leave,
        file=sys.stderr,
        dynamic_ncols=True,
    ) as bar:
        yield _TqdmBar(bar)


@contextmanager
def checkpoints() -> Iterator[Callable[[], None]]:
    """A check that raises KeyboardInterrupt if Ctrl-C came and was lost.

    Python drops an exception raised where it cannot propagate (a weakref callback, a
    ``__del__``: h5py's objects run such code as they are closed), so a Ctrl-C landing there
    would be lost and the command would go on. Inside this block Ctrl-C is also recorded, and the
    check raises it again; long loops call it at safe points.
    """
    came: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    ours = threading.current_thread() is threading.main_thread() and callable(previous)

    def on_sigint(signum: int, frame: Any) -> None:
        came.append(signum)
        assert callable(previous)
        previous(signum, frame)  # the default handler: raises KeyboardInterrupt

    def check() -> None:
        if came:
            raise KeyboardInterrupt

    def unraisable(u: Any) -> None:
        if not (came and isinstance(u.exc_value, KeyboardInterrupt)):
            hook(u)  # else: not lost, check() raises it again; and no "Exception ignored" noise

    hook = sys.unraisablehook
    if ours:
        signal.signal(signal.SIGINT, on_sigint)
        sys.unraisablehook = unraisable
    try:
        yield check
    finally:
        if ours:
            signal.signal(signal.SIGINT, previous)
            sys.unraisablehook = hook


def run_async(fn: Callable[..., Any], *args: object, backend: str) -> Any:
    """``anyio.run(fn, *args, backend=backend)``, with Ctrl-C (and the signals that stand for
    it) raised only where the program can take it.

    asyncio's runner turns SIGINT into a cancellation of the main task. trio raises
    KeyboardInterrupt at once in code it does not protect, and anyio's cancel scopes (its
    wrappers of trio's) are such code: one landing between a trio scope's ``__enter__`` and the
    ``with`` block leaves the scope open, and the next scope to close finds trio's stack
    corrupted (a RuntimeError instead of the command's clean end). With
    ``restrict_keyboard_interrupt_to_checkpoints``, trio raises it in the main task at its next
    checkpoint, as a cancellation."""
    options = {"restrict_keyboard_interrupt_to_checkpoints": True} if backend == "trio" else {}
    return anyio.run(fn, *args, backend=backend, backend_options=options)
