"""Batches: gathering rows from loaded chunks, the transformer chain, and the Batch mapping."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ._errors import TransformError
from ._plan import ChunkPlan

__all__ = [
    "Batch",
    "BatchSpec",
    "Buffers",
    "Carry",
    "Finisher",
    "LoadedChunk",
    "apply_transformers",
    "carry",
    "describe_transformer",
    "gather_batches",
]

Transformer = Callable[[Any], Any]


class Batch(Mapping[str, Any]):
    """One minibatch: a read-only mapping from top name to an array whose rows are samples.

    Attributes
    ----------
    indices : numpy.ndarray
        int64, the global index of each row's sample, in row order.
    epoch : int
        The epoch the batch belongs to (for :meth:`AsyncHDF5DataLayer.stream`, the epoch it
        started in).
    """

    __slots__ = ("_data", "epoch", "indices")

    def __init__(self, data: dict[str, Any], indices: np.ndarray, epoch: int) -> None:
        self._data = data
        self.indices = indices
        self.epoch = epoch

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    @property
    def size(self) -> int:
        """Rows in the batch."""
        return len(self.indices)

    def __repr__(self) -> str:
        tops = ", ".join(
            f"{k!r}: {type(v).__module__.split('.')[0]}{tuple(v.shape)} {v.dtype}"
            for k, v in self._data.items()
        )
        return f"Batch(epoch={self.epoch}, rows={self.size}, {{{tops}}})"


@dataclass(eq=False)
class LoadedChunk:
    """A chunk whose rows are in memory.

    ``arrays`` are a cache slot's arrays (rows at slot positions) or, for in-memory data, the
    whole arrays (rows at global indices: ``rows_are_global``).
    """

    plan: ChunkPlan
    order: np.ndarray | None
    arrays: Mapping[str, np.ndarray]
    rows_are_global: bool = False
    release: Callable[[], None] | None = None
    refs: int = 0  # batches cut from it and not yet gathered
    cut: bool = False  # every row has been cut into a batch (or dropped)

    @property
    def size(self) -> int:
        return self.plan.size

    def done_with(self) -> None:
        """Give the slot back once it is fully cut and every batch from it gathered."""
        if self.cut and self.refs == 0 and self.release is not None:
            release, self.release = self.release, None
            release()


@dataclass(eq=False)
class Carry:
    """Rows of an incomplete batch copied out of the chunks they came from (see :func:`carry`),
    in serving order, with their global indices."""

    arrays: Mapping[str, np.ndarray]
    indices: np.ndarray
    refs: int = 0

    def done_with(self) -> None:
        """Nothing to give back: the carry is the batch's own memory."""


Piece = tuple["LoadedChunk | Carry", int, int]


@dataclass(eq=False)
class BatchSpec:
    """A batch to gather: pieces ``(chunk, start, stop)`` of chunks' serving orders."""

    epoch: int
    pieces: list[Piece] = field(default_factory=list)
    rows: int = 0
    ends_epoch: int | None = None  # an epoch whose last sample is in this batch


def describe_transformer(fn: object) -> str:
    """A short name for ``fn`` in error messages."""
    name = getattr(fn, "__qualname__", None)
    if name is not None and not isinstance(fn, type):
        mod = getattr(fn, "__module__", None)
        return f"{mod}.{name}" if mod and mod != "builtins" else str(name)
    return repr(fn)


class Finisher(Protocol):
    """The last stage of a batch when a device is set (see ``_device.DeviceStage``)."""

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """Host memory to gather a top's rows into (e.g. page-locked staging)."""
        ...

    def finish(self, data: dict[str, Any], indices: np.ndarray, epoch: int) -> dict[str, Any]:
        """Upload ``data`` and run the transformers on the device (worker thread)."""
        ...

    def ready(self, batch: Batch) -> None:
        """Called on the consumer's thread just before ``batch`` is yielded."""
        ...

    def abandon(self) -> None:
        """The batch being gathered or finished failed: take back what ``alloc`` gave for it."""
        ...

    def close(self) -> None: ...


def _merge(pieces: Sequence[Piece]) -> list[Piece]:
    """Join pieces that continue each other (consecutive batches of one chunk): one ``take``."""
    out: list[Piece] = []
    for chunk, a, b in pieces:
        if out and out[-1][0] is chunk and out[-1][2] == a:
            out[-1] = (chunk, out[-1][1], b)
        else:
            out.append((chunk, a, b))
    return out


def _split(pieces: Sequence[Piece], rows: int) -> tuple[list[Piece], list[Piece]]:
    """The first ``rows`` rows of ``pieces``, and the rest."""
    head: list[Piece] = []
    tail: list[Piece] = []
    left = rows
    for chunk, a, b in pieces:
        if left >= b - a:
            head.append((chunk, a, b))
            left -= b - a
        elif left > 0:
            head.append((chunk, a, a + left))
            tail.append((chunk, a + left, b))
            left = 0
        else:
            tail.append((chunk, a, b))
    return head, tail


def _gather(
    pieces: Sequence[Piece], out: dict[str, np.ndarray], indices: np.ndarray, at: int = 0
) -> None:
    """Copy the rows of ``pieces`` into ``out`` and their global indices into ``indices``,
    from row ``at`` on."""
    for chunk, a, b in pieces:
        n = b - a
        idx = indices[at : at + n]
        rows: np.ndarray | slice
        if isinstance(chunk, Carry):  # rows and indices in serving order
            idx[:] = chunk.indices[a:b]
            for name, dest in out.items():
                dest[at : at + n] = chunk.arrays[name][a:b]
            at += n
            continue
        pos = np.arange(a, b) if chunk.order is None else chunk.order[a:b]
        chunk.plan.global_indices(pos, out=idx)
        if chunk.rows_are_global:
            rows = idx
        else:
            rows = slice(a, b) if chunk.order is None else pos
        for name, dest in out.items():
            src = chunk.arrays[name]
            if isinstance(rows, slice):
                dest[at : at + n] = src[rows]
            else:
                np.take(src, rows, axis=0, out=dest[at : at + n])
        at += n


def carry(spec: BatchSpec, tops: Mapping[str, tuple[tuple[int, ...], np.dtype[Any]]]) -> Carry:
    """Copy the rows cut so far into an incomplete batch out of the chunks they are in.

    The batcher calls this when it has cut every row of a chunk and the batch it is building
    still needs rows from the next one: the copy (fewer than ``batch_size`` rows) lets the
    chunk's cache slot go back to the reader without waiting for that next chunk. Blocking:
    run in a worker thread.
    """
    arrays = {name: np.empty((spec.rows, *shape), dtype) for name, (shape, dtype) in tops.items()}
    indices = np.empty(spec.rows, np.int64)
    _gather(spec.pieces, arrays, indices)
    return Carry(arrays, indices)


#: Below this many bytes a group is gathered on one thread: handing half to another thread costs
#: more than it saves (and the two would contend for the GIL between small copies).
PARALLEL_BYTES = 2 * 2**20


def apply_transformers(
    data: dict[str, Any],
    transformers: Sequence[tuple[str, Transformer]],
    epoch: int,
    indices: np.ndarray,
) -> None:
    """Run the transformer chain in place on ``data``; wrap any failure in TransformError."""
    for top, fn in transformers:
        x = data[top]
        rows = len(indices)
        where = f"top {top!r}, transformer {describe_transformer(fn)}, epoch {epoch}"
        try:
            y = fn(x)
        except Exception as exc:
            raise TransformError(
                f"{where}: raised {type(exc).__name__}: {exc} (batch of {rows} rows, first "
                f"global index {int(indices[0]) if rows else None})"
            ) from exc
        shape = getattr(y, "shape", None)
        if shape is None or len(shape) == 0:
            raise TransformError(f"{where}: returned {type(y).__name__}, not an array of rows")
        if shape[0] != rows:
            raise TransformError(
                f"{where}: returned {shape[0]} rows for a batch of {rows}; a transformer must "
                "keep the number of rows"
            )
        data[top] = y


@dataclass
class GatherTimes:
    gather: float = 0.0
    transform: float = 0.0


class Buffers(Protocol):
    """Where gathered rows go: ``acquire(rows)`` gives one array per top."""

    def acquire(self, rows: int) -> dict[str, np.ndarray]: ...


def gather_batches(
    specs: Sequence[BatchSpec],
    buffers: Buffers,
    transformers: Sequence[tuple[str, Transformer]],
    times: GatherTimes,
    finisher: Finisher | None = None,
    pool: Executor | None = None,
) -> tuple[list[Batch], Exception | None]:
    """Gather and transform ``specs`` (blocking; runs in a worker thread).

    Returns the batches and ``None`` or, when a batch fails, the complete batches before it and
    the error, so that those are still delivered ahead of the error.

    With a ``pool`` and a group of at least ``PARALLEL_BYTES``, half of the rows are gathered on
    the pool's thread (``np.take`` releases the GIL). Transformers always run here, one batch
    after the other: a transformer is never called from two threads at once.
    """
    if finisher is not None:
        return _gather_and_finish(specs, buffers, finisher, times)
    t0 = time.perf_counter()
    # The whole group in one buffer, with one `take` per top per run of rows: per-batch Python
    # work is what limits small batches. The batches are views of the buffer.
    total = sum(spec.rows for spec in specs)
    group = buffers.acquire(total)
    indices = np.empty(total, np.int64)
    pieces = _merge([p for spec in specs for p in spec.pieces])
    nbytes = sum(a.nbytes for a in group.values())
    future = None
    if pool is not None and nbytes >= PARALLEL_BYTES:
        head, pieces = _split(pieces, total // 2)
        future = pool.submit(_gather, head, group, indices)
        at = total // 2
    else:
        at = 0
    try:
        _gather(pieces, group, indices, at)
    finally:
        if future is not None:
            future.result()
    parts: list[tuple[dict[str, np.ndarray], np.ndarray]] = []
    at = 0
    for spec in specs:
        end = at + spec.rows
        parts.append(({k: v[at:end] for k, v in group.items()}, indices[at:end]))
        at = end
    t1 = time.perf_counter()
    out: list[Batch] = []
    error: Exception | None = None
    for spec, (data, indices) in zip(specs, parts, strict=True):
        result: dict[str, Any] = dict(data)
        try:
            apply_transformers(result, transformers, spec.epoch, indices)
        except Exception as exc:
            error = exc
            break
        out.append(Batch(result, indices, spec.epoch))
    times.gather += t1 - t0
    times.transform += time.perf_counter() - t1
    return out, error


def _gather_and_finish(
    specs: Sequence[BatchSpec], buffers: Buffers, finisher: Finisher, times: GatherTimes
) -> tuple[list[Batch], Exception | None]:
    """Device batches: each is gathered into its own staging buffers and its upload queued at
    once, so copies start early; a failure (staging, upload, transformer) keeps the complete
    batches before it, and gives the failed batch's buffers back."""
    out: list[Batch] = []
    for spec in specs:
        t0 = time.perf_counter()
        try:
            staging = buffers.acquire(spec.rows)
            indices = np.empty(spec.rows, np.int64)
            _gather(spec.pieces, staging, indices)
            t1 = time.perf_counter()
            data = finisher.finish(dict(staging), indices, spec.epoch)
        except Exception as exc:
            finisher.abandon()
            return out, exc
        times.gather += t1 - t0
        times.transform += time.perf_counter() - t1
        out.append(Batch(data, indices, spec.epoch))
    return out, None
