"""Re-planning is pure: an epoch resumed part-way, or re-split over another world size, is
checked here against the whole epoch's plan, without any file. (``test_resume.py`` checks the
same through saved states and real files.)"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from asynchdf5 import ConfigurationError
from asynchdf5._plan import EpochPlan, plan_epoch
from asynchdf5._replan import elastic_plan, resume_plan, skip_samples, split_plan

from ._helpers import examples
from .test_plan import served


def _plans(n: int, batch_size: int, world_size: int, drop_last: bool, seed: int) -> list[EpochPlan]:
    return [
        plan_epoch(
            n,
            epoch=1,
            batch_size=batch_size,
            chunk_size=3 * batch_size,
            shuffle=True,
            seed=seed,
            rank=r,
            world_size=world_size,
            drop_last=drop_last,
            first_rows=5,
            block_size=7,
        )
        for r in range(world_size)
    ]


@settings(max_examples=examples(100), deadline=None)
@given(
    n=st.integers(1, 800),
    batch_size=st.integers(1, 50),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
    data=st.data(),
)
def test_a_resumed_plan_serves_the_rest_of_the_epoch_in_the_same_batches(
    n: int, batch_size: int, drop_last: bool, seed: int, data: st.DataObject
) -> None:
    assume(not drop_last or n >= batch_size)  # else the planner refuses (test_plan checks it)
    (plan,) = _plans(n, batch_size, 1, drop_last, seed)
    sizes = list(plan.batch_sizes())
    k = data.draw(st.integers(0, len(sizes)), label="batches done")
    rest = resume_plan(plan, k)
    assert list(rest.batch_sizes()) == sizes[k:]
    done = sum(sizes[:k])
    np.testing.assert_array_equal(served(rest), served(plan)[done:])
    assert [c.index for c in rest.chunks] == list(range(len(rest.chunks)))


@settings(max_examples=examples(100), deadline=None)
@given(
    n=st.integers(1, 800), batch_size=st.integers(1, 50), seed=st.integers(0, 2**32), data=st.data()
)
def test_skipping_samples_serves_the_rest_in_order(
    n: int, batch_size: int, seed: int, data: st.DataObject
) -> None:
    (plan,) = _plans(n, batch_size, 1, False, seed)
    k = data.draw(st.integers(0, plan.n_samples), label="samples done")
    rest = skip_samples(plan, k)
    np.testing.assert_array_equal(served(rest), served(plan)[k:])
    assert rest.full_batches == (plan.n_samples - k) // batch_size


def test_resuming_past_the_end_is_a_configuration_error() -> None:
    (plan,) = _plans(100, 8, 1, False, 0)
    with pytest.raises(ConfigurationError, match="after 14 batches: it has 13"):
        resume_plan(plan, 14)
    with pytest.raises(ConfigurationError, match="after 101 samples: the share has 100"):
        skip_samples(plan, 101)


@settings(max_examples=examples(100), deadline=None)
@given(
    n=st.integers(1, 1500),
    batch_size=st.integers(1, 40),
    old_world=st.integers(1, 5),
    new_world=st.integers(1, 5),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
    data=st.data(),
)
def test_an_elastic_plan_serves_every_sample_left_once_in_equal_batch_counts(
    n: int,
    batch_size: int,
    old_world: int,
    new_world: int,
    drop_last: bool,
    seed: int,
    data: st.DataObject,
) -> None:
    try:
        old = _plans(n, batch_size, old_world, drop_last, seed)
    except ConfigurationError:
        return  # a split the planner refuses (test_plan checks which)
    k = data.draw(st.integers(0, old[0].n_batches), label="batches done on every rank")
    left = np.sort(np.concatenate([served(resume_plan(p, k)) for p in old]))
    try:
        new = [
            elastic_plan(old, k, rank=r, world_size=new_world, drop_last=drop_last)
            for r in range(new_world)
        ]
    except ConfigurationError:
        # Only a rest that cannot be cut into equal batch counts without repeating samples.
        q, r = divmod(len(left), new_world * batch_size)
        assert not drop_last and 0 < r < new_world and (q == 0 or batch_size == 1)
        return
    assert len({p.n_batches for p in new}) == 1
    got = np.sort(np.concatenate([served(p)[: p.n_served] for p in new]))
    if drop_last:  # less than a batch per rank may be left out, as an epoch's leftover is
        assert np.isin(got, left).all() and len(np.unique(got)) == len(got)
        assert len(left) - len(got) < new_world * batch_size
    else:
        np.testing.assert_array_equal(got, left)


@settings(max_examples=examples(100), deadline=None)
@given(
    n=st.integers(1, 800),
    batch_size=st.integers(1, 50),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
    parts=st.integers(1, 6),
)
def test_the_parts_of_a_plan_are_contiguous_runs_of_its_batches(
    n: int, batch_size: int, drop_last: bool, seed: int, parts: int
) -> None:
    """DataLoader workers' shares: in order, the parts serve the plan's samples in its batches,
    their batch counts differ by one at most, the longer ones first."""
    assume(not drop_last or n >= batch_size)
    (plan,) = _plans(n, batch_size, 1, drop_last, seed)
    split = [split_plan(plan, p, parts) for p in range(parts)]
    assert [s for part in split for s in part.batch_sizes()] == list(plan.batch_sizes())
    counts = [part.n_batches for part in split]
    assert counts == sorted(counts, reverse=True) and counts[0] - counts[-1] <= 1
    np.testing.assert_array_equal(np.concatenate([served(p) for p in split]), served(plan))
    for part in split:
        assert part.n_served == sum(part.batch_sizes())
        assert [c.index for c in part.chunks] == list(range(len(part.chunks)))
