"""Resume: where a consumer is, as a small state of plain values, and the plans that continue it.

Read top to bottom: what a state holds (:data:`FORMAT`, :func:`fingerprint`), saving one
(:func:`save_state`, from the consumer's position, :meth:`~._consumer.Consumer.position`),
loading one (:func:`parse_state`, :meth:`Resume.check_resumes`, :func:`load_state`: the layer's
``load_state_dict``), and planning the epoch it resumes (:func:`resumed_plan`, over the pure
re-planning of :mod:`._replan`). The layer's :class:`~._planner.Planner` holds the loaded state.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ._config import LayerConfig
from ._errors import ConfigurationError, StateError
from ._plan import EpochPlan
from ._replan import elastic_plan, resume_plan
from ._shape import DataShape

__all__ = [
    "FORMAT",
    "Loaded",
    "Resume",
    "batches_before",
    "epoch_plan",
    "fingerprint",
    "load_state",
    "parse_state",
    "resumed_plan",
    "save_state",
]

# --- what a state holds -----------------------------------------------------------------------


FORMAT = "asynchdf5.state/1"

#: What a state's fingerprint holds, and what each entry means in an error message.
_WHAT = {
    "n_samples": "the number of samples",
    "files": "the files (names and row counts)",
    "tops": "the tops (names, dtypes, sample shapes)",
    "batch_size": "batch_size",
    "shuffle": "shuffle",
    "drop_last": "drop_last",
    "chunk_size": "chunk_size",
    "block_size": "block_size",
    "chunk_rows": "the rows per cached chunk",
    "block_rows": "the rows per shuffled block",
    "first_rows": "the rows of the first read of an epoch",
    "ramp_lanes": "the places each piece of the first read is taken from",
    "chunk_lanes": "the places each chunk is taken from",
    "streams": "the streams (names, rows, samples per epoch)",
    "batch_mode": "batch_mode",
}


def fingerprint(shape: DataShape, config: LayerConfig) -> dict[str, Any]:
    """What a saved state must agree with: the data and the properties that fix the order
    (compared when loading), and the effective sizes (adopted when loading: see
    :meth:`Resume.shapes`)."""
    mixed = (
        {
            "streams": [[s.name, s.size, s.count] for s in shape.streams],
            "batch_mode": config.batch_mode,
        }
        if shape.streams
        else {}
    )
    return mixed | {
        "n_samples": shape.n_samples,
        "files": [[name, rows] for name, rows in shape.files],
        "tops": [[name, dtype, list(sample)] for name, dtype, sample in shape.tops],
        "batch_size": config.batch_size,
        "shuffle": config.shuffle,
        "drop_last": config.drop_last,
        "chunk_size": config.chunk_size,
        "block_size": config.block_size,
        "chunk_rows": shape.chunk_rows,
        "block_rows": shape.block_rows,
        "first_rows": shape.first_rows,
        "ramp_lanes": shape.ramp_lanes,
        "chunk_lanes": shape.chunk_lanes,
    }


@dataclass(frozen=True)
class Resume:
    """A loaded state: where to continue."""

    mode: str  # "epoch" or "stream"
    epoch: int
    chain: tuple[tuple[int, int], ...]  # epoch mode: (world size, batches yielded) steps
    samples: int  # stream mode: samples of `epoch` yielded on this rank
    seed: int
    rank: int
    fingerprint: Mapping[str, Any]
    part: tuple[int, int] | None = None  # (part, parts): a worker's run of the rank's batches

    @property
    def world_size(self) -> int:
        return self.chain[-1][0]

    def shapes(self, shape: DataShape, world_size: int) -> tuple[DataShape, DataShape | None]:
        """The shapes a layer whose own is ``shape`` plans with once it resumes this state on
        ``world_size`` ranks: ``(every epoch's, the resumed epoch's where it differs)``.

        The resumed epoch is planned with the saved run's chunks, blocks, first read and
        lanes (a state saved before the ramp, or the chunks, had lanes read each in one
        stretch). On the saved world size, every later epoch is the saved run's too; after an
        elastic resume, a layer's started on ``world_size`` ranks (the saved chunks were cut
        by the old run's shares).
        """
        saved = self.fingerprint
        rows = (saved["chunk_rows"], saved["block_rows"], saved["first_rows"])
        lanes = (saved.get("ramp_lanes", 1), saved.get("chunk_lanes", 1))
        if (*rows, *lanes) == (
            shape.chunk_rows,
            shape.block_rows,
            shape.first_rows,
            shape.ramp_lanes,
            shape.chunk_lanes,
        ):
            return shape, None
        resumed = replace(
            shape,
            chunk_rows=rows[0],
            block_rows=rows[1],
            first_rows=rows[2],
            ramp_lanes=lanes[0],
            chunk_lanes=lanes[1],
        )
        if all(w == world_size for w, _ in self.chain):
            return resumed, None
        return shape, resumed

    def differences(self, now: Mapping[str, Any]) -> list[str]:
        """What differs between the saved fingerprint and ``now``'s, in words."""
        out = []
        for key, what in _WHAT.items():
            if key in ("chunk_rows", "block_rows", "first_rows", "ramp_lanes", "chunk_lanes"):
                continue  # effective values: the state's are adopted (see the layer)
            saved, current = self.fingerprint.get(key), now.get(key)
            if saved != current:
                out.append(f"{what}: saved {_short(saved)}, now {_short(current)}")
        return out

    def check_resumes(
        self,
        fingerprint: Mapping[str, Any],
        *,
        seed: int | None,
        world_size: int,
        part: tuple[int, int] | None = None,
    ) -> None:
        """:class:`ConfigurationError` unless a layer whose fingerprint is ``fingerprint`` (and
        whose seed, if given, is ``seed``) on ``world_size`` ranks can continue this state; the
        message says what differs."""
        differs = self.differences(fingerprint)
        if seed is not None and self.seed != seed:
            differs.append(f"seed: saved {self.seed}, now {seed}")
        if differs:
            raise ConfigurationError(
                "the state was saved by a layer over other data or with other properties: "
                + "; ".join(differs)
            )
        if self.part != part:
            raise ConfigurationError(
                f"the state was saved by a layer serving {_part_words(self.part)}, this one "
                f"serves {_part_words(part)}: resume a DataLoader with as many workers as the "
                "one that saved it"
            )
        if self.part is not None and any(w != world_size for w, _ in self.chain):
            raise ConfigurationError(
                f"a DataLoader worker's state (part {self.part[0]} of {self.part[1]}) resumes on "
                f"the same world size only (saved {self.world_size}, now {world_size})"
            )
        if self.mode == "stream" and self.world_size != world_size:
            raise ConfigurationError(
                f"a stream's state resumes on the same world size only (saved "
                f"{self.world_size}, now {world_size}); save it from epoch iteration instead"
            )


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


def parse_state(state: object) -> Resume:
    """Check a state's shape (:class:`ConfigurationError` when it is not one of ours)."""
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        raise ConfigurationError(
            f"not an asynchdf5 layer state (expected a dict with format={FORMAT!r}, as "
            "layer.state_dict() returns)"
        )
    mode = state.get("mode")
    if mode not in ("epoch", "stream"):
        raise ConfigurationError(f"the state's mode must be 'epoch' or 'stream', not {mode!r}")
    chain_in = state.get("chain")
    if (
        not isinstance(chain_in, Sequence)
        or not chain_in
        or not all(
            isinstance(step, Sequence) and len(step) == 2 and all(isinstance(x, int) for x in step)
            for step in chain_in
        )
    ):
        raise ConfigurationError(f"the state's 'chain' is malformed: {chain_in!r}")
    chain = tuple((int(w), int(k)) for w, k in chain_in)
    fingerprint = state.get("fingerprint")
    if not isinstance(fingerprint, Mapping):
        raise ConfigurationError("the state has no fingerprint")
    # The sizes a resumed run adopts as saved (not compared with this layer's): checked here,
    # so that a bad one fails at loading and not when the epoch is planned.
    for key, may_lack in (
        ("chunk_rows", False),
        ("block_rows", True),
        ("first_rows", True),
        ("ramp_lanes", True),
        ("chunk_lanes", True),
    ):
        if may_lack and fingerprint.get(key) is None:
            continue
        _int(fingerprint, key, 1)
    part_in = state.get("part")
    part: tuple[int, int] | None = None
    if part_in is not None:
        if (
            not isinstance(part_in, Sequence)
            or len(part_in) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in part_in)
            or not 0 <= part_in[0] < part_in[1]
        ):
            raise ConfigurationError(f"the state's 'part' is malformed: {part_in!r}")
        part = (int(part_in[0]), int(part_in[1]))
    return Resume(
        mode=str(mode),
        epoch=_int(state, "epoch"),
        chain=chain,
        samples=_int(state, "samples"),
        seed=_int(state, "seed"),
        rank=_int(state, "rank"),
        fingerprint=dict(fingerprint),
        part=part,
    )


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


def epoch_plan(
    chain: Sequence[tuple[int, int]],
    plan: Callable[[int, int], EpochPlan],
    *,
    rank: int,
    world_size: int,
    drop_last: bool,
) -> EpochPlan:
    """The plan of this rank, ``world_size`` ranks, for an epoch whose first steps were
    ``chain``: ``plan(rank, world_size)`` gives the epoch's plans from the start; each step
    ``(w, k)``: ``w`` ranks yielded ``k`` batches each, then the rest was re-split."""
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


def resumed_plan(
    resume: Resume,
    plan: Callable[[int, int], EpochPlan],
    *,
    rank: int,
    world_size: int,
    drop_last: bool,
) -> EpochPlan:
    """The plan of the epoch ``resume`` resumes, in epoch mode (a stream's is the fresh plan
    less the samples yielded: :func:`~._replan.skip_samples`); ``plan(rank, world_size)`` gives
    the epoch's plans from the start."""
    return epoch_plan(resume.chain, plan, rank=rank, world_size=world_size, drop_last=drop_last)


# --- words in messages ------------------------------------------------------------------------


def _part_words(part: tuple[int, int] | None) -> str:
    return "its rank's whole epochs" if part is None else f"part {part[0]} of {part[1]} of them"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _int(state: Mapping[str, Any], key: str, minimum: int = 0) -> int:
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"the state's {key!r} must be an int >= {minimum}, not {value!r}")
    return value
