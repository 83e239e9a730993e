"""Ctrl-C held back (:func:`interrupts_held`) and raised only where it is safe
(:func:`raise_held`).

A ``KeyboardInterrupt`` is raised wherever CPython runs SIGINT's handler: as a function starts,
at a jump back, once a call has returned. There it can leave a lock held by this thread (as
``threading.Condition.__enter__`` returns, before the ``with`` owns it) while another thread
waits on it for ever, or an object made and not yet owned. Code that must not be cut at such a
place holds SIGINT back and raises it at its waits, which hold nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["interrupts_held", "raise_held"]

#: The Ctrl-Cs held back by the outermost :func:`interrupts_held` block now running in the main
#: thread (None: none runs), and SIGINT's handler before it.
_held: list[int] | None = None
_handler: Callable[[int, FrameType | None], Any] | None = None


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold back SIGINT in the block and deliver it (to the handler it had) once it ends, or at
    a :func:`raise_held` in it. Blocks nest (the outermost one holds and delivers).

    A ``KeyboardInterrupt`` raised at any instruction can leave a lock held by this thread (as
    ``threading.Condition.__enter__`` returns, say), or an object made and not yet owned; held
    back, it is raised only at the places that call :func:`raise_held`, which hold nothing.
    Only the main thread receives SIGINT, and only a handler written in Python can be held:
    elsewhere this does nothing.
    """
    global _held, _handler
    if threading.current_thread() is not threading.main_thread() or _held is not None:
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    signal.signal(signal.SIGINT, hold)
    _held, _handler = held, previous
    try:
        yield
    finally:
        _held = _handler = None
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)


def raise_held() -> None:
    """Hand the Ctrl-Cs held back so far to SIGINT's handler now (which raises
    ``KeyboardInterrupt``, unless it is the user's own): a wait in an :func:`interrupts_held`
    block calls this, where an interrupt is safe and must not wait for the block's end."""
    held, handler = _held, _handler
    if held and handler is not None and threading.current_thread() is threading.main_thread():
        held.clear()
        handler(signal.SIGINT, None)
