"""A saved state: its format, its fingerprint, and the checks that it resumes a layer.

A state is plain values (:data:`FORMAT`): where the consumer was, plus a fingerprint of the data
and of the properties that fix the order (:func:`fingerprint`). :func:`parse_state` checks a
state's shape and :meth:`Resume.check_resumes` whether it continues a given layer, with messages
that say what differs. Kept apart from :mod:`._resume` (saving, loading and planning the resumed
epoch) so that the format and its checks read on their own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ._config import LayerConfig
from ._errors import ConfigurationError
from ._shape import DataShape

__all__ = ["FORMAT", "Resume", "fingerprint", "parse_state"]


# --- what a state holds -----------------------------------------------------------------------


FORMAT = "asynchdf5.state/1"

#: What a state's fingerprint holds, and what each entry means in an error message.
_WHAT = {
    "n_samples": "the number of samples",
    "files": "the files (names and row counts)",
    "tops": "the tops (names, dtypes, sample shapes)",
    "windows": "the windows (top, length, stride)",
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
    "ramp_top_lanes": "the most places a piece of the first read is taken from",
    "ramp_once": "whether only the first epoch's first read is ramped (resident data)",
    "even_chunks": "whether a shuffled share is cut into chunks of equal sizes",
    "streams": "the streams (names, rows, samples per epoch)",
    "batch_mode": "batch_mode",
}


#: The effective sizes a state's fingerprint holds: adopted when loading, not compared.
_ADOPTED = (
    "chunk_rows",
    "block_rows",
    "first_rows",
    "ramp_lanes",
    "chunk_lanes",
    "ramp_top_lanes",
    "ramp_once",
    "even_chunks",
)


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
    if shape.windows:  # only where there are windows: a state without them compares as before
        mixed["windows"] = [list(w) for w in shape.windows]
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
        "ramp_top_lanes": shape.ramp_top_lanes,
        "ramp_once": shape.ramp_once,
        "even_chunks": shape.even_chunks,
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
        # States saved before growing ramps and resident epochs without one lack these.
        ramp = (
            saved.get("ramp_top_lanes"),
            bool(saved.get("ramp_once", False)),
            bool(saved.get("even_chunks", False)),
        )
        if (*rows, *lanes, *ramp) == (
            shape.chunk_rows,
            shape.block_rows,
            shape.first_rows,
            shape.ramp_lanes,
            shape.chunk_lanes,
            shape.ramp_top_lanes,
            shape.ramp_once,
            shape.even_chunks,
        ):
            return shape, None
        resumed = replace(
            shape,
            chunk_rows=rows[0],
            block_rows=rows[1],
            first_rows=rows[2],
            ramp_lanes=lanes[0],
            chunk_lanes=lanes[1],
            ramp_top_lanes=ramp[0],
            ramp_once=ramp[1],
            even_chunks=ramp[2],
        )
        if all(w == world_size for w, _ in self.chain):
            return resumed, None
        return shape, resumed

    def differences(self, now: Mapping[str, Any]) -> list[str]:
        """What differs between the saved fingerprint and ``now``'s, in words."""
        out = []
        for key, what in _WHAT.items():
            if key in _ADOPTED:
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


# --- checking a state's shape -----------------------------------------------------------------


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
        ("ramp_top_lanes", True),
    ):
        if may_lack and fingerprint.get(key) is None:
            continue
        _int(fingerprint, key, 1)
    for key in ("ramp_once", "even_chunks"):
        if not isinstance(fingerprint.get(key, False), bool):
            raise ConfigurationError(
                f"the state's {key!r} must be a bool, not {fingerprint[key]!r}"
            )
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
