"""Where the time goes: counters that each stage writes into its own part of, and the snapshot
that a layer hands out (:class:`LayerStats`).

One owner (a layer's :class:`Stats`), one writer per part: the reader writes :class:`ReadStats`,
the gathering stage :class:`GatherStats`, the consumer (:mod:`._consumer`)
:class:`ConsumerStats`. A snapshot copies them into a frozen :class:`LayerStats`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "ConsumerStats",
    "GatherStats",
    "LayerStats",
    "ReadStats",
    "StageClock",
    "StageStats",
    "StageTimes",
    "Stats",
]


@dataclass
class StageTimes:
    """Where one stage's time went (written by that stage only)."""

    busy: float = 0.0  # doing its own work
    starved: float = 0.0  # waiting for its input: the stage before it is slower
    blocked: float = 0.0  # waiting for room downstream: the stage after it is slower


class StageClock:
    """A stage's busy time (some of its work in flight: overlapping units count once) and idle
    time (none), in wall time, into ``times``. Idle time is *blocked* (waiting for room
    downstream) or *starved* (waiting for input), as the last :meth:`stop` said (``blocked``
    before the first). Thread-safe: the units may run on several threads."""

    __slots__ = ("active", "blocked", "lock", "since", "times")

    def __init__(self, times: StageTimes, blocked: bool) -> None:
        self.times = times
        self.lock = threading.Lock()
        self.active = 0
        self.since = time.perf_counter()
        self.blocked = blocked

    def start(self) -> None:
        with self.lock:
            if self.active == 0:
                now = time.perf_counter()
                if self.blocked:
                    self.times.blocked += now - self.since
                else:
                    self.times.starved += now - self.since
                self.since = now
            self.active += 1

    def stop(self, blocked: bool) -> None:
        """A unit is done; if it was the last, the stage is idle from now on, ``blocked`` or
        starved."""
        with self.lock:
            self.active -= 1
            if self.active == 0:
                now = time.perf_counter()
                self.times.busy += now - self.since
                self.since = now
                self.blocked = blocked


@dataclass(frozen=True)
class StageStats:
    """Seconds one stage of the pipeline spent working and waiting (see :class:`LayerStats`).

    Attributes
    ----------
    busy_seconds
        Doing its own work: reading chunks, gathering and transforming batches; for the
        consumer, its own training step (the time between taking a batch and asking for the
        next).
    starved_seconds
        Waiting for its input, because the stage before it was slower (the consumer: waiting
        for a batch).
    blocked_seconds
        Waiting for room downstream, because the stage after it was slower (the reader: for a
        free cache slot).
    """

    busy_seconds: float
    starved_seconds: float
    blocked_seconds: float


def _stage(t: StageTimes) -> StageStats:
    return StageStats(t.busy, t.starved, t.blocked)


@dataclass
class ReadStats:
    """Written by the chunk reader (``stage``: by the pipeline's reader task)."""

    stage: StageTimes = field(default_factory=StageTimes)
    seconds: float = 0.0
    bytes: int = 0
    chunks: int = 0
    retries: int = 0  # transient errors of a remote source, retried


@dataclass
class GatherStats:
    """Written by the gathering stage (the delivery and ``stage``: by the gather thread)."""

    stage: StageTimes = field(default_factory=StageTimes)
    gather_seconds: float = 0.0
    transform_seconds: float = 0.0


@dataclass
class ConsumerStats:
    """Written by the consumer (:class:`~._consumer.Consumer`) only, as batches are handed over."""

    wait_seconds: float = 0.0
    step_seconds: float = 0.0  # between handing a batch over and being asked for the next
    batches: int = 0
    samples: int = 0
    first_batch_seconds: float | None = None
    stream_samples: dict[str, int] = field(default_factory=dict)  # per stream, when mixed


@dataclass(frozen=True)
class LayerStats:
    """A snapshot of a layer's pipeline counters (:attr:`AsyncHDF5DataLayer.stats`).

    Times are seconds summed over the layer's life (worker-thread time for the stages).
    ``resident`` is True when the whole data set fits one chunk and the cache budget: it is then
    read once and later epochs are served from memory. ``bytes_read`` counts what was read into
    the cache (mapped: what was mapped; pages kept mapped are not read again).
    ``read_paths`` says how each top is read:
    ``"pread"`` (stored bytes read straight into the cache, outside h5py's lock),
    ``"chunks"`` (raw chunks read and decoded by a pool of threads, outside h5py's lock),
    ``"h5py"`` (h5py reads it, holding its lock; the reason is in ``read_notes``) or ``"mmap"``
    (served from the mapped file, no cache). Unless ``mmap=False``, ``read_notes`` says under
    each top whether the source is mapped and why, ``"mapped: ..."`` or ``"copied: why"``,
    followed by what concerns that top alone (a note about one top is not repeated under the
    others).
    ``consumer_wait_seconds`` is the time ``async for`` waited for a batch. With a ``device``,
    ``device_bytes`` (held now), ``device_bytes_in_use``, ``device_bytes_peak`` and
    ``pinned_bytes`` report the device stage's memory (all 0 without one). ``read_retries``
    counts the transient errors (timeouts, throttling, 5xx) a remote source retried.
    """

    read_seconds: float
    gather_seconds: float
    transform_seconds: float
    consumer_wait_seconds: float
    bytes_read: int
    chunks_read: int
    batches: int
    samples: int
    first_batch_seconds: float | None
    chunk_rows: int
    resident: bool
    device_bytes: int = 0
    device_bytes_in_use: int = 0
    device_bytes_peak: int = 0
    pinned_bytes: int = 0
    read_retries: int = 0
    read_paths: dict[str, str] = field(default_factory=dict)
    read_notes: dict[str, str] = field(default_factory=dict)
    #: ``"read"``, ``"gather"`` and ``"consumer"``: where each stage's time went.
    stages: dict[str, StageStats] = field(default_factory=dict)
    #: With several streams: the samples handed over from each, by name (empty without).
    stream_samples: dict[str, int] = field(default_factory=dict)

    def bottleneck(self) -> str:
        """In words, which stage holds the others up (from :attr:`stages`).

        The consumer, when it waited for batches less than a tenth of its own steps; else the
        busier of reading and gathering (busy seconds, as the stages' table shows them): the
        stage working most of the time is the one the others wait for.
        """
        if not self.stages or self.batches == 0:
            return "no batch yet"
        consumer = self.stages["consumer"]
        if consumer.starved_seconds <= 0.1 * max(consumer.busy_seconds, 1e-9):
            return (
                "your training step: the pipeline keeps ahead of it (the consumer waited "
                f"{consumer.starved_seconds:.3g} s for batches in {consumer.busy_seconds:.3g} s "
                "of steps)"
            )
        read, gather = self.stages["read"].busy_seconds, self.stages["gather"].busy_seconds
        if read >= gather:
            return (
                f"reading: the reader was busy {read:.3g} s, gathering and transforming "
                f"{gather:.3g} s (disk, network or decompression on the h5py path; see "
                "read_paths); the batches waited for chunks"
            )
        return (
            f"gathering and transforming: {gather:.3g} s in the worker thread (gather "
            f"{self.gather_seconds:.3g} s, transformers {self.transform_seconds:.3g} s), "
            f"reading {read:.3g} s"
        )


@dataclass
class Stats:
    """A layer's counters; each stage is given its own part to write."""

    read: ReadStats = field(default_factory=ReadStats)
    gather: GatherStats = field(default_factory=GatherStats)
    consumer: ConsumerStats = field(default_factory=ConsumerStats)

    def snapshot(
        self,
        *,
        chunk_rows: int,
        resident: bool,
        device: Mapping[str, int],
        read_paths: Mapping[str, str],
        read_notes: Mapping[str, str],
    ) -> LayerStats:
        return LayerStats(
            read_seconds=self.read.seconds,
            gather_seconds=self.gather.gather_seconds,
            transform_seconds=self.gather.transform_seconds,
            consumer_wait_seconds=self.consumer.wait_seconds,
            bytes_read=self.read.bytes,
            chunks_read=self.read.chunks,
            batches=self.consumer.batches,
            samples=self.consumer.samples,
            first_batch_seconds=self.consumer.first_batch_seconds,
            chunk_rows=chunk_rows,
            resident=resident,
            read_retries=self.read.retries,
            read_paths=dict(read_paths),
            read_notes=dict(read_notes),
            stream_samples=dict(self.consumer.stream_samples),
            stages={
                "read": _stage(self.read.stage),
                "gather": _stage(self.gather.stage),
                "consumer": StageStats(self.consumer.step_seconds, self.consumer.wait_seconds, 0.0),
            },
            **device,
        )
