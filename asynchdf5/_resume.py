"""Resume: where a consumer is, as a small state of plain values, and the plans that continue it.

Read top to bottom: saving a state (:func:`save_state`, from the consumer's position,
:meth:`~._consumer.Consumer.position`), loading one (:func:`load_state`: the layer's
``load_state_dict``), and planning the epoch it resumes (:func:`resumed_plan`, over the pure
re-planning of :mod:`._replan`). What a state holds and how it is checked (:data:`FORMAT`,
:func:`fingerprint`, :func:`parse_state`, :meth:`Resume.check_resumes`) is :mod:`._state`.
The layer's :class:`~._planner.Planner` holds the loaded state.

Because the planner is pure, a position is a handful of integers (the epoch, the batches yielded
in it) plus what is needed to check that the files and properties are the same. Loading a state
makes the next batch exactly the one that would have come next: same indices, same bytes.

Elastic resume: a state saved by every rank of a run at the same batch count, loaded into a run
of another world size, continues the epoch over the new ranks: every sample the old run had not
yet yielded, each exactly once, in equal batch counts per rank (:func:`~._replan.elastic_plan`). A
run resumed that way may itself be saved and resumed again, so a state carries the *chain* of
(world size, batches) steps of its epoch.

A layer that serves one *part* of its rank's plan (a DataLoader worker's contiguous run of
batches, :func:`~._replan.split_plan`) saves ``part: [part, parts]``, its chain counting the
batches of that part: such a state resumes only a layer serving the same part of the same ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._config import LayerConfig
from ._errors import ConfigurationError, StateError
from ._plan import EpochPlan
from ._replan import elastic_plan, resume_plan
from ._shape import DataShape
from ._state import FORMAT, Resume, fingerprint, parse_state

__all__ = [
    "FORMAT",
    "Loaded",
    "Resume",
    "batches_before",
    "fingerprint",
    "load_state",
    "parse_state",
    "resumed_plan",
    "save_state",
]

# --- saving -----------------------------------------------------------------------------------


def save_state(
    resume: Resume | None,
    position: tuple[str, int, int, int],
    *,
    seed: int,
    rank: int,
    world_size: int,
    fingerprint: Mapping[str, Any],
    part: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The state of a consumer at ``position`` (mode, epoch, and the batches and samples of that
    epoch yielded on this rank) on ``world_size`` ranks: when the run resumed from ``resume``
    in this same epoch, the steps of that state's chain come first."""
    mode, epoch, batches, samples = position
    r = resume
    chain: list[list[int]] = [[world_size, batches]]
    if r is not None and epoch == r.epoch and r.mode != mode and not (batches or samples):
        mode = r.mode  # nothing yielded since the state was loaded: still exactly that state
    if r is not None and epoch == r.epoch:
        if r.mode != mode:
            # Its position counts from the loaded state's, which the other mode's cannot say
            # exactly (an epoch's batches are not a stream's samples): refused, never a state
            # that would replay or skip samples.
            raise StateError(
                f"a state saved in {r.mode} mode was loaded and this epoch is iterated in "
                f"{mode} mode: it cannot be saved before the epoch is over (iterate it in "
                f"{r.mode} mode to save part-way)"
            )
        if r.mode == "stream" or mode == "stream":
            if r.world_size != world_size:
                raise StateError(
                    "a stream resumed on another world size cannot be saved before the "
                    "epoch it resumed in is over"
                )
            if r.mode == "stream" and mode == "stream":
                samples += r.samples
        else:
            steps = [list(step) for step in r.chain]
            if steps[-1][0] == world_size:
                steps[-1][1] += batches
            else:
                steps.append([world_size, batches])
            chain = steps
    out: dict[str, Any] = {
        "format": FORMAT,
        "mode": mode,
        "epoch": epoch,
        "batches": chain[-1][1],
        "samples": samples,
        "chain": chain,
        "seed": seed,
        "rank": rank,
        "world_size": world_size,
        "fingerprint": fingerprint,
    }
    if part is not None:
        out["part"] = list(part)
    return out


# --- loading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Loaded:
    """A state loaded into a layer (:func:`load_state`)."""

    resume: Resume
    shape: DataShape  # every epoch's, from now on
    resumed: DataShape | None  # the resumed epoch's, where it differs (an elastic resume)


def load_state(
    state: object,
    *,
    shape: DataShape,
    config: LayerConfig,
    part: tuple[int, int] | None,
    open_rows: int | None,
) -> Loaded:
    """``state`` checked against a layer whose data has ``shape``, with ``config``, serving
    ``part``; ``open_rows``: the rows its cache slots hold when it is open (None: closed).

    A state from other files or other properties is a :class:`ConfigurationError` that says
    what differs; so is one whose chunks do not fit the open layer's cache (load it before
    opening, and the cache is sized for them).
    """
    r = parse_state(state)
    r.check_resumes(
        fingerprint(shape, config),
        seed=config.seed if config.seed_given else None,
        world_size=config.world_size,
        part=part,
    )
    saved_rows = r.fingerprint["chunk_rows"]
    if open_rows is not None and saved_rows > open_rows:
        raise ConfigurationError(
            f"the saved run cached chunks of {saved_rows} rows, this open layer's cache "
            f"holds {open_rows}: load the state before opening it"
        )
    every, resumed = r.shapes(shape, config.world_size)
    return Loaded(r, every, resumed)


def batches_before(state: Mapping[str, Any]) -> int:
    """The batches of the resumed epoch yielded before ``state`` was saved, over every step of
    its chain (what ``StatefulDataLoader`` counts among the epoch's batches); 0 for a stream."""
    if state["mode"] != "epoch":
        return 0
    return sum(int(batches) for _, batches in state["chain"])


# --- planning the resumed epoch ---------------------------------------------------------------


def resumed_plan(
    resume: Resume,
    plan: Callable[[int, int], EpochPlan],
    *,
    rank: int,
    world_size: int,
    drop_last: bool,
) -> EpochPlan:
    """The plan of this rank, ``world_size`` ranks, for the epoch ``resume`` resumes, in epoch
    mode (a stream's is the fresh plan less the samples yielded: :func:`~._replan.skip_samples`);
    ``plan(rank, world_size)`` gives the epoch's plans from the start. Each step ``(w, k)`` of
    ``resume.chain``: ``w`` ranks yielded ``k`` batches each, then the rest was re-split."""
    chain = resume.chain
    (first_world, _), *_ = chain
    plans = [plan(r, first_world) for r in range(first_world)]
    for (_, batches), (next_world, _) in itertools.pairwise(chain):
        plans = [
            elastic_plan(plans, batches, rank=r, world_size=next_world, drop_last=drop_last)
            for r in range(next_world)
        ]
    last_world, batches = chain[-1]
    if world_size == last_world:
        return resume_plan(plans[rank], batches)
    return elastic_plan(plans, batches, rank=rank, world_size=world_size, drop_last=drop_last)
