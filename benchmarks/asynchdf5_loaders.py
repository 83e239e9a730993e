"""asynchdf5 itself: shuffled epochs of ``AsyncHDF5DataLayer`` and of its sync ``HDF5DataLayer``.

The consumer does nothing with a batch, so the rate is the loader's own. The clock starts before
the layer is constructed: time to first batch includes opening the files and the first read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio

from benchmarks.measure import EpochClock, Job, Outcome, Skip


def import_asynchdf5() -> Any:
    try:
        import asynchdf5
    except ImportError as exc:
        raise Skip(f"asynchdf5 is not importable: {exc}") from exc
    if not hasattr(asynchdf5, "AsyncHDF5DataLayer"):
        raise Skip("asynchdf5 has no AsyncHDF5DataLayer yet")
    return asynchdf5


def layer_kwargs(job: Job) -> dict[str, Any]:
    """The layer configuration every asynchdf5 measurement uses."""
    return {
        "source": str(job.files.source),
        "batch_size": job.batch_size,
        "tops": ("data", "label"),
        "shuffle": True,
        "seed": job.seed,
        "chunk_size": job.chunk_size,
    } | dict(job.params.get("layer", {}))


def stats_summary(layer: Any) -> Any:
    """``layer.stats`` in a JSON-able form (it is reported, never interpreted)."""
    stats = getattr(layer, "stats", None)
    if stats is None:
        return None
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        stats = dataclasses.asdict(stats)
    if isinstance(stats, dict):
        return {
            str(k): v if isinstance(v, int | float | str | None) else repr(v)
            for k, v in stats.items()
        }
    return repr(stats)[:2000]


def _later_epoch(clock: EpochClock) -> dict[str, float]:
    o = clock.outcome()
    return {"samples_per_s": o.samples_per_s, "epoch_s": o.epoch_s}


def async_layer(job: Job) -> Outcome:
    """Shuffled epochs of ``AsyncHDF5DataLayer`` with ``async for``.

    params: ``backend`` (``asyncio``), ``epochs`` (1). The outcome is the first epoch, from
    construction on; later epochs (buffers allocated, first chunk prefetched) go to
    ``extra["later_epochs"]``, each timed from its ``async for``.
    """
    asynchdf5 = import_asynchdf5()
    n = job.files.spec.samples
    clock = EpochClock(n, job.budget_s)

    async def epochs() -> Outcome:
        clock.start()
        layer = asynchdf5.AsyncHDF5DataLayer(**layer_kwargs(job))
        async with layer:
            async for batch in layer:
                if not clock.batch(len(batch.indices)):
                    break
            outcome = clock.outcome()
            later = []
            for _ in range(1, int(job.params.get("epochs", 1))):
                again = EpochClock(n, None)
                again.start()
                async for batch in layer:
                    again.batch(len(batch.indices))
                later.append(_later_epoch(again))
            outcome.extra |= {"later_epochs": later, "stats": stats_summary(layer)}
            return outcome

    backend = job.params.get("backend", "asyncio")
    outcome: Outcome = anyio.run(epochs, backend=backend)
    outcome.extra["backend"] = backend
    return outcome


def sync_layer(job: Job) -> Outcome:
    """Shuffled epochs of the sync facade ``HDF5DataLayer`` with plain ``for`` (as above)."""
    asynchdf5 = import_asynchdf5()
    n = job.files.spec.samples
    clock = EpochClock(n, job.budget_s)
    clock.start()
    with asynchdf5.HDF5DataLayer(**layer_kwargs(job)) as layer:
        for batch in layer:
            if not clock.batch(len(batch.indices)):
                break
        outcome = clock.outcome()
        later = []
        for _ in range(1, int(job.params.get("epochs", 1))):
            again = EpochClock(n, None)
            again.start()
            for batch in layer:
                again.batch(len(batch.indices))
            later.append(_later_epoch(again))
        outcome.extra |= {"later_epochs": later, "stats": stats_summary(layer)}
        return outcome
