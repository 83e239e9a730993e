"""The layer's side of ``process=True``: the helper process (started as ``spawn`` starts one,
and reaped), and the runs it serves.

:class:`ProcessReader` stands where the reader stands in a layer that runs its pipeline itself:
the layer's :class:`~asynchdf5._consumer.Consumer` opens it, asks it for runs
(:meth:`ProcessReader.new_run`) and closes it. A :class:`~._runs.RemoteRun` has the consumer's
side of a :class:`~asynchdf5._pipeline.Run`, so the consumer, the epoch iterator and the sync
bridge work unchanged: every position, epoch count and saved state is the layer's own, counted
from the batches handed over here.

Starting a run tells the helper where to start: the layer's state at that moment (the next
batch the consumer must get; in the epoch of a state loaded, that state, whatever the run's
mode), and the run's mode. The helper loads it into its own layer and iterates from there;
batches of a run replaced since are dropped on arrival (their slots go back
at once), so only the current run's batches are handed over.

Slots: a batch handed over is a set of views of one slot (a ragged top's
:class:`~asynchdf5.Ragged` and a sparse top's CSR matrix over views of it too), which goes back
to the helper once nothing refers to them any more (as host batch buffers are reused, see
:class:`~asynchdf5._delivery.BatchBuffers`). The consumer may keep batches: when it holds all
but one slot, the next batch is copied out of its slot, so the helper always has one to fill.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from .._batch import Batch
from .._catalog import TopInfo
from .._errors import ReadError
from .._gathering import EpochEnd, Failure, Item
from .._interrupts import interrupts_held
from .._stats import GatherStats, Stats
from .._thread_call import release_whole, run_sync_whole
from ._errors import rebuild
from ._runs import RemoteRun, Uploader
from ._wire import MAX_MESSAGE, Segment, recv, refcounts_are_reliable, send, socket_pair

if TYPE_CHECKING:
    from .._delivery import Delivery
    from .._pipeline import Mode

__all__ = ["EXIT_WAIT_S", "ProcessReader", "forget_kept_interrupts", "raise_kept_interrupt"]

_log = logging.getLogger("asynchdf5")

#: Ctrl-Cs that came while a finalizer of ours ran (:meth:`ProcessReader._released`), where
#: Python would print "Exception ignored" and the loop would go on. Only the main thread gets
#: them; the loop raises them at its next batch.
_KEPT: list[KeyboardInterrupt] = []


def forget_kept_interrupts() -> None:
    """Drop the Ctrl-Cs kept outside any loop (a batch let go of after its loop ended): a new
    loop does not end for them, as Python itself would have dropped them there."""
    _KEPT.clear()


def raise_kept_interrupt() -> None:
    """Raise the Ctrl-C that a finalizer of ours kept, if one came (the iterators call it at
    each batch and at the end of each iteration: every Ctrl-C ends the loop)."""
    if _KEPT:
        _KEPT.clear()
        raise KeyboardInterrupt


#: Slots given back in one message (fewer wake-ups of the helper).
FREE_TOGETHER = 2


class ProcessReader:
    """The helper process of a layer opened with ``process=True`` (see the module docstring)."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        sock: socket.socket,
        stats: Stats,
        slots: int,
        uploader: Uploader | None = None,
    ) -> None:
        self._uploader = uploader
        self._proc = proc
        self._sock = sock
        self._stats = stats
        self._slots = slots
        self._segments: list[Segment | None] = [None] * slots
        self._out: set[int] = set()  # slots the helper filled and has not got back
        self._token = 0  # the current run's
        #: A batch received and not handed over yet: its slot would be the consumer's last.
        self._pending: tuple[Any, ...] | None = None
        self._freed: list[int] = []  # slots given back, not yet told
        #: ``_out`` and the socket's sends are shared with the threads that drop batches.
        self._lock = threading.Lock()
        self._reuse = refcounts_are_reliable()
        self._closed = False
        self._buf = bytearray(MAX_MESSAGE)
        self.tops: Mapping[str, TopInfo] = {}
        self.n_samples = 0
        self.read_paths: Mapping[str, str] = {}
        self.read_notes: Mapping[str, str] = {}

    @classmethod
    async def start(
        cls,
        payload: bytes,
        stats: Stats,
        slots: int,
        device: tuple[Delivery, int] | None = None,
    ) -> tuple[ProcessReader, Any]:
        """Start the helper with ``payload`` (see :func:`~._errors.payload`), wait until its
        layer is open; the reader, and the shape of the data the helper found. ``device``: the
        layer's delivery and batch size, to upload the helper's host batches with."""
        ours, theirs = socket_pair()
        try:
            # Waited for whole: a helper started for a caller cancelled meanwhile is killed.
            proc = await run_sync_whole(spawn, theirs, payload, release=_kill)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        reader = cls(proc, ours, stats, slots)
        try:
            message = await reader._next()
            if message[0] == "failed":
                raise rebuild(message[1])
            _, shape, reader.read_paths, reader.read_notes, ragged = message
        except BaseException:
            with anyio.CancelScope(shield=True):
                await reader.aclose()
            raise
        reader.n_samples = shape.n_samples
        reader.tops = {  # a ragged top's: its values' (RaggedInfo.for_batches)
            name: TopInfo(name, np.dtype(dtype), tuple(sample), ragged=ragged.get(name))
            for name, dtype, sample in shape.tops
        }
        if device is not None:
            delivery, rows = device
            reader._uploader = Uploader(delivery, reader.tops, rows, slots + 2)
        return reader, shape

    async def _next(self) -> tuple[Any, ...]:
        """The next message, waiting for it (not a batch: only while starting)."""
        while True:
            try:
                message, fd = recv(self._sock, self._buf, block=False)
            except BlockingIOError:
                await _wait_readable(self._sock)
                continue
            if fd is not None:
                os.close(fd)
            if message is None:
                raise self._gone()
            return message

    def _gone(self) -> ReadError:
        code = self._proc.poll()
        how = "is gone" if code is None else f"exited with status {code}"
        return ReadError(f"the layer's helper process (pid {self._proc.pid}) {how}")

    # --- runs -----------------------------------------------------------------------------------

    def new_run(self, mode: Mode, start_epoch: int, state: dict[str, Any]) -> RemoteRun:
        """A run in ``mode`` from ``state``: where the layer's consumer is now (the consumer's
        :meth:`~asynchdf5._consumer.Consumer.run_state`)."""
        self._token += 1
        with contextlib.suppress(OSError):  # the helper is gone: the run's first take says so
            send(self._sock, ("start", self._token, mode, state))
        return RemoteRun(self, mode, start_epoch, self._token, self._uploader)

    def take_nowait(self, token: int) -> list[Item]:
        """The next item of run ``token``; :class:`anyio.WouldBlock` if none is there yet, or
        if the next batch could only be handed over as a copy (the consumer holds every other
        slot: see :meth:`take`)."""
        self._give_back()
        while True:
            if self._pending is not None:
                batch = self._batch(self._pending, token, copy=False)
                if batch is None:
                    self._flush()
                    raise anyio.WouldBlock
                return [batch]
            try:
                message, fd = recv(self._sock, self._buf, block=False)
            except BlockingIOError:
                self._flush()  # nothing ready: the helper gets every slot there is
                raise anyio.WouldBlock from None
            if message is None:
                return [Failure(self._gone())]
            kind = message[0]
            if kind == "batch":
                _, run, slot, _, _, size = message
                if fd is not None:
                    try:
                        self._segments[slot] = Segment(fd, size)
                    finally:
                        os.close(fd)
                self._out.add(slot)
                if run != token:
                    self._free(slot)  # a replaced run's
                else:
                    self._pending = message
            elif kind == "stats":
                self._take_stats(message[1])
            elif message[1] != token:
                continue  # a replaced run's end or failure
            elif kind == "end":
                return [EpochEnd(message[2])]
            else:
                return [Failure(rebuild(message[2]))]

    def _batch(self, message: tuple[Any, ...], token: int, *, copy: bool) -> Batch | None:
        """The pending batch ``message``: views of its slot, or (``copy``) a copy, its slot
        given back at once; None (still pending) when only a copy would do and ``copy`` is
        False."""
        _, run, slot, epoch, layout, _ = message
        if run != token:  # the run was replaced while its batch waited
            self._pending = None
            self._free(slot)
            return None
        segment = self._segments[slot]
        assert segment is not None
        with self._lock:
            held = sum(1 for s in self._out if s != slot)
        copy = copy or not self._reuse
        if not copy and held >= self._slots - 1:
            return None
        self._pending = None
        release = None if copy else functools.partial(self._released, slot)
        # copy: the consumer keeps every other slot: a copy, so that the helper has one to fill.
        data, indices = segment.views(layout, release, copy=copy)
        if copy:
            self._free(slot, now=True)
        return Batch(data, indices, epoch)

    def _released(self, slot: int) -> None:
        """The last view of the batch in ``slot`` is gone (in whichever thread dropped it): the
        helper gets the slot back now, not at the consumer's next ask, so it fills the ring
        while the consumer works on the batches it took. A finalizer: a Ctrl-C that lands here
        is kept for the loop (:func:`raise_kept_interrupt`), never printed and dropped.

        The garbage collector can run it in any thread at any allocation, also inside a block
        of this reader's that holds the lock: so it never waits for the lock (when the lock is
        busy, :meth:`_give_back` frees the slot at the consumer's next ask), and holds Ctrl-C
        back from the lock's taking to its release."""
        try:
            with interrupts_held():
                if not self._lock.acquire(blocking=False):
                    return
                try:
                    if slot in self._out and not self._closed:
                        self._out.discard(slot)
                        with contextlib.suppress(OSError):
                            send(self._sock, ("free", (slot,)))
                finally:
                    self._lock.release()
        except KeyboardInterrupt:
            _KEPT.append(KeyboardInterrupt())

    def _give_back(self) -> None:
        """Give the helper back each slot no batch refers to any more (those whose last view
        went without :meth:`_released`: kept for any other way a view can go)."""
        pending = self._pending[2] if self._pending is not None else None
        with self._lock:
            out = list(self._out)
        for slot in out:
            if slot == pending:
                continue  # no views yet: its batch is still to be handed over
            segment = self._segments[slot]
            # The list's reference and getrefcount's argument: nobody else's.
            if segment is not None and sys.getrefcount(segment.owner) <= 2:
                self._free(slot)

    def _free(self, slot: int, *, now: bool = False) -> None:
        """Give ``slot`` back: with the next ones, unless ``now`` (each message wakes the
        helper; it is told at the latest when the consumer finds no batch ready)."""
        with self._lock:
            if slot not in self._out:
                return  # released meanwhile
            self._out.discard(slot)
            self._freed.append(slot)
        if now or len(self._freed) >= FREE_TOGETHER:
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            if self._freed and not self._closed:
                with contextlib.suppress(OSError):  # the helper is gone: the next receive says
                    send(self._sock, ("free", tuple(self._freed)))
            self._freed.clear()

    def _take_stats(self, stats: dict[str, Any]) -> None:
        read, gather = self._stats.read, self._stats.gather
        read.seconds, read.bytes = stats["read_seconds"], stats["bytes_read"]
        read.chunks, read.retries = stats["chunks_read"], stats["read_retries"]
        own = self._uploader.stats if self._uploader is not None else GatherStats()
        gather.gather_seconds = stats["gather_seconds"] + own.gather_seconds
        gather.transform_seconds = stats["transform_seconds"] + own.transform_seconds
        for times, key in ((read.stage, "read"), (gather.stage, "gather")):
            busy, starved, blocked = stats["stages"][key]
            times.busy, times.starved, times.blocked = busy, starved, blocked

    async def take(self, token: int) -> list[Item]:
        """:meth:`take_nowait`, waiting for the helper (on the socket: no polling). A batch
        that only a copy can hand over (the consumer keeps every other slot) is copied now:
        the consumer has nothing else to take, and the helper needs that slot."""
        while True:
            try:
                return self.take_nowait(token)
            except anyio.WouldBlock:
                if self._pending is not None:
                    batch = self._batch(self._pending, token, copy=True)
                    if batch is not None:
                        return [batch]
                    continue
                await _wait_readable(self._sock)

    # --- closing --------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop the helper and wait for it to exit (killed if it does not, in time)."""
        if self._closed:
            return
        with self._lock:  # a batch released in another thread sends nothing from now on
            self._closed = True
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(OSError):
                send(self._sock, ("close",))
            try:
                await release_whole(reap, self._proc)
            finally:
                self._sock.close()
                self._segments = [None] * self._slots  # batches still held keep their mapping


async def _wait_readable(sock: socket.socket) -> None:
    await anyio.wait_readable(sock)


# --- starting and reaping the helper ----------------------------------------------------------

#: How long closing waits for the helper to exit before it is killed.
EXIT_WAIT_S = 10.0


def spawn(sock: socket.socket, payload: bytes) -> subprocess.Popen[bytes]:
    """Start ``python -m asynchdf5._serve FD`` (a fresh interpreter: fork and exec at once, as
    the ``spawn`` start method does, never a fork of this process and its threads) and write
    ``payload`` to its standard input."""
    fd = sock.fileno()
    proc = subprocess.Popen(
        [sys.executable, "-m", "asynchdf5._serve", str(fd)],
        stdin=subprocess.PIPE,
        pass_fds=(fd,),
        env=_child_env(),
    )
    assert proc.stdin is not None
    try:
        proc.stdin.write(payload)
        proc.stdin.close()
    except BaseException:
        reap(proc, 0)
        raise
    return proc


def _child_env() -> dict[str, str]:
    """This process's environment, with this package importable from where it was imported."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` and reap it (a helper nobody waits for any more: its opening was cancelled)."""
    proc.kill()
    proc.wait()


def reap(proc: subprocess.Popen[bytes], wait: float = EXIT_WAIT_S) -> None:
    """Wait for ``proc`` to exit; kill it after ``wait`` seconds."""
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        _log.warning("asynchdf5: the helper process %d did not exit: killed", proc.pid)
        proc.kill()
        proc.wait()
