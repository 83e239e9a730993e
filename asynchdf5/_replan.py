"""Re-planning: an epoch's plan continued part-way, or re-split over another world size.

A resumed run does not re-plan from scratch: it takes the epoch's plan (:mod:`._plan`, the same
on every rank) and drops what was already served, so that the next batch is the one that would
have come next. :func:`skip_samples` and :func:`resume_plan` do that for one rank (a stream, cut
by samples; an epoch, cut by batches); :func:`elastic_plan` re-splits the rest of an epoch that
every rank of an old run had served the same batches of over the ranks of a new run;
:func:`split_plan` cuts a rank's plan into contiguous runs of batches (DataLoader workers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ._errors import ConfigurationError
from ._plan import ChunkPlan, EpochPlan, batch_layout, shard_share

__all__ = ["elastic_plan", "resume_plan", "skip_samples", "split_plan", "take_batches"]


def _skip(chunks: Sequence[ChunkPlan], samples: int) -> list[ChunkPlan]:
    """The chunks left once ``samples`` of their served samples have been served."""
    out = []
    for chunk in chunks:
        if samples >= chunk.size:
            samples -= chunk.size
            continue
        if samples > 0:
            a, _ = chunk.serve or (0, chunk.rows)
            b = a + chunk.size
            chunk = replace(chunk, serve=(a + samples, b))
            samples = 0
        out.append(chunk)
    return [replace(c, index=i) for i, c in enumerate(out)]


def skip_samples(plan: EpochPlan, samples: int) -> EpochPlan:
    """``plan`` once its first ``samples`` served samples are done (a stream resumed mid-epoch:
    stream batches are cut by size, so only the samples matter)."""
    if not 0 <= samples <= plan.n_samples:
        raise ConfigurationError(
            f"cannot resume epoch {plan.epoch} after {samples} samples: the share has "
            f"{plan.n_samples}"
        )
    left = plan.n_samples - samples
    return EpochPlan(
        plan.epoch,
        left,
        tuple(_skip(plan.chunks, samples)),
        plan.batch_size,
        left // plan.batch_size,
    )


def resume_plan(plan: EpochPlan, batches: int) -> EpochPlan:
    """``plan`` once its first ``batches`` batches have been yielded: the next batch is the one
    that would have come next, with the same rows."""
    sizes = list(plan.batch_sizes())
    if not 0 <= batches <= len(sizes):
        raise ConfigurationError(
            f"cannot resume epoch {plan.epoch} after {batches} batches: it has {len(sizes)}"
        )
    done = sum(sizes[:batches])
    rest = sizes[batches:]
    full = max(0, plan.full_batches - batches)
    tail = tuple(rest[full:])
    chunks = _skip(plan.chunks, done)
    return EpochPlan(plan.epoch, plan.n_samples - done, tuple(chunks), plan.batch_size, full, tail)


def take_batches(plan: EpochPlan, batches: int) -> EpochPlan:
    """``plan``'s first ``batches`` batches only (all of them when it has no more): the same
    rows in the same order, ending after the last of them."""
    sizes = list(plan.batch_sizes())
    if batches >= len(sizes):
        return plan
    left = sum(sizes[:batches])
    full = min(plan.full_batches, batches)
    chunks: list[ChunkPlan] = []
    for chunk in plan.chunks:
        if left <= 0:
            break
        if chunk.size > left:
            a, _ = chunk.serve or (0, chunk.rows)
            chunk = replace(chunk, serve=(a, a + left))
        chunks.append(chunk)
        left -= chunk.size
    return EpochPlan(
        plan.epoch,
        sum(sizes[:batches]),
        tuple(chunks),
        plan.batch_size,
        full,
        tuple(sizes[full:batches]),
    )


def split_plan(plan: EpochPlan, part: int, parts: int) -> EpochPlan:
    """Part ``part`` of ``parts`` of ``plan``: a contiguous run of its batches, the first
    ``n % parts`` parts one batch longer. The parts in order are ``plan`` (each sample in
    exactly one part), and each part reads only the chunks its batches come from (a chunk cut
    by a part boundary is read by both, each serving its rows)."""
    if not 0 <= part < parts:
        raise ConfigurationError(f"part {part} is outside 0 ... {parts - 1}")
    q, r = divmod(plan.n_batches, parts)
    start = part * q + min(part, r)
    return take_batches(resume_plan(plan, start), q + (part < r))


def elastic_plan(
    old: Sequence[EpochPlan],
    batches: int,
    *,
    rank: int,
    world_size: int,
    drop_last: bool,
) -> EpochPlan:
    """The rest of an epoch that ``old`` (the plans of every rank of a run with another world
    size) had served ``batches`` batches of on every rank, re-split over ``world_size`` ranks.

    What the old ranks had not yet yielded is walked in old rank order (each old rank's chunks
    from where it stood, a chunk partly served keeping the rest of its serving order), and cut
    into this run's shares and batches by the same rules as an epoch (:func:`shard_share`,
    equal batch counts, the remainder rule). A chunk cut by a share boundary is read by both
    ranks, each serving its part. With ``drop_last``, a rest smaller than a batch per rank is
    left out, as any epoch's leftover is; without it, a rest that cannot be split in equal batch
    counts without repeating samples is a :class:`ConfigurationError` (on every rank alike).
    """
    batch_size = old[0].batch_size
    rest = [resume_plan(p, batches) for p in old]
    walk: list[ChunkPlan] = [c for p in rest for c in p.chunks]
    total = sum(p.n_served for p in rest)
    if total == 0 or (drop_last and total < world_size * batch_size):
        # Nothing left, or (drop_last) less than a batch per rank: the leftover is left out.
        return EpochPlan(old[0].epoch, 0, (), batch_size, 0, ())
    full, tail = batch_layout(total, batch_size, rank, world_size, drop_last)
    start, size = shard_share(total, batch_size, rank, world_size, drop_last)
    mine: list[ChunkPlan] = []
    pos = 0
    for chunk in walk:  # keep the part of the walk in [start, start + size)
        a, b = max(start, pos), min(start + size, pos + chunk.size)
        if a < b:
            first = (chunk.serve or (0, chunk.rows))[0]
            serve = (first + a - pos, first + b - pos)
            mine.append(replace(chunk, serve=None if serve == (0, chunk.rows) else serve))
        pos += chunk.size
    chunks = tuple(replace(c, index=i) for i, c in enumerate(mine))
    return EpochPlan(old[0].epoch, size, chunks, batch_size, full, tail)
