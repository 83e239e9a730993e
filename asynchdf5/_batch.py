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
    "Finisher",
    "LoadedChunk",
    "apply_transformers",
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
class BatchSpec:
    """A batch to gather: pieces ``(chunk, start, stop)`` of chunks' serving orders."""

    epoch: int
    pieces: list[tuple[LoadedChunk, int, int]] = field(default_factory=list)
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

    def close(self) -> None: ...


def _gather_one(
    spec: BatchSpec, out: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Copy the rows of ``spec`` into ``out`` (one array per top); returns it and the indices."""
    indices = np.empty(spec.rows, np.int64)
    at = 0
    for chunk, a, b in spec.pieces:
        n = b - a
        if chunk.order is None:
            pos = np.arange(a, b)
            indices[at : at + n] = chunk.plan.global_indices(pos)
            rows: np.ndarray | slice = (
                indices[at : at + n] if chunk.rows_are_global else slice(a, b)
            )
        else:
            pos = chunk.order[a:b]
            indices[at : at + n] = chunk.plan.global_indices(pos)
            rows = indices[at : at + n] if chunk.rows_are_global else pos
        for name, dest in out.items():
            src = chunk.arrays[name]
            if isinstance(rows, slice):
                dest[at : at + n] = src[rows]
            else:
                np.take(src, rows, axis=0, out=dest[at : at + n])
        at += n
    return out, indices


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

    With a ``pool``, half of the gathering runs on the pool's thread (``np.take`` releases the
    GIL). Transformers always run here, one batch after the other: a transformer is never called
    from two threads at once.
    """
    t0 = time.perf_counter()
    outs = [buffers.acquire(spec.rows) for spec in specs]
    half = len(specs) // 2 if pool is not None else 0
    future = pool.submit(_gather_many, specs[:half], outs[:half]) if half and pool else None
    try:
        gathered = _gather_many(specs[half:], outs[half:])
    finally:
        before = future.result() if future is not None else []
    t1 = time.perf_counter()
    out = []
    error: Exception | None = None
    for spec, (data, indices) in zip(specs, before + gathered, strict=True):
        result: dict[str, Any] = dict(data)
        try:
            if finisher is not None:
                result = finisher.finish(result, indices, spec.epoch)
            else:
                apply_transformers(result, transformers, spec.epoch, indices)
        except Exception as exc:
            error = exc
            break
        out.append(Batch(result, indices, spec.epoch))
    times.gather += t1 - t0
    times.transform += time.perf_counter() - t1
    return out, error


def _gather_many(
    specs: Sequence[BatchSpec], outs: Sequence[dict[str, np.ndarray]]
) -> list[tuple[dict[str, np.ndarray], np.ndarray]]:
    return [_gather_one(spec, out) for spec, out in zip(specs, outs, strict=True)]
