"""Real ``torchrun`` with two streams mixed (issue 33): ``tests/_ddp_train.py`` under DDP.

Two streams of unequal sizes (600 and 90 rows, weights 0.6 and 0.4: the small one upsampled,
the large one downsampled), two processes for epochs 0 and 1, every rank exiting after batch
``CRASH_AFTER`` of epoch 1 having saved its state at batch ``SAVED``; then three processes resume
from those states (elastic) and finish epoch 1. Checked: equal batch counts per rank (the
all-reduce of every batch did not hang), each epoch's per-stream counts exact, every batch
stratified, and the resumed epoch is exactly the rest of the uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asynchdf5 import HDF5DataLayer, Stream

from ._files import write_h5, write_source
from .test_torchrun import SCRIPT, Run, finish_all, saved_seed, torchrun

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(400)]

BATCH = 20
SIZES = (600, 90)
COUNTS = (414, 276)  # 690 samples, 0.6 : 0.4
CRASH_AFTER, SAVE_EVERY = 12, 5
SAVED = 10


def sources(folder: Path) -> list[Path]:
    """Two list files, the second stream's rows after the first's (label == global index)."""
    first, _ = write_source(folder / "a", (400, 200))
    second, files = write_source(folder / "b", (90,))
    # write_source numbers rows from 0: rewrite the second stream's from 600 on.
    write_h5(files[0], 600, 90)
    return [first, second]


def expected(lists: list[Path], seed: int, epoch: int, world: int) -> list[list[list[int]]]:
    out = []
    for rank in range(world):
        source = {"a": Stream(lists[0], weight=0.6), "b": Stream(lists[1], weight=0.4)}
        layer = HDF5DataLayer(
            source, batch_size=BATCH, shuffle=True, seed=seed, rank=rank, world_size=world
        )
        layer.set_epoch(epoch)
        with layer:
            out.append([b.indices.tolist() for b in layer])
    return out


def counts(batches: list[list[int]]) -> np.ndarray:
    idx = np.concatenate([np.asarray(b, np.int64) for b in batches])
    return np.bincount((idx >= SIZES[0]).astype(np.int64), minlength=2)


def test_two_streams_under_torchrun_with_an_elastic_resume(tmp_path: Path) -> None:
    lists = sources(tmp_path / "data")
    common = [
        "--stream", f"a={lists[0]}:0.6", "--stream", f"b={lists[1]}:0.4",
        "--batch-size", str(BATCH), "--save-every", str(SAVE_EVERY),
    ]  # fmt: skip
    crash = ["--crash-epoch", "1", "--crash-after", str(CRASH_AFTER)]
    out = tmp_path / "crashed"
    args = [*common, "--out", str(out), "--epochs", "2", *crash]
    (crashed,) = finish_all([(torchrun(2, SCRIPT, args, tmp_path), out)])
    assert crashed.returncode != 0, crashed.output[-4000:]  # the deliberate crash
    seed = saved_seed(crashed)
    whole0 = expected(lists, seed, 0, 2)
    assert [crashed.epoch(r, 0) for r in (0, 1)] == whole0
    assert len(whole0[0]) == len(whole0[1])
    np.testing.assert_array_equal(counts(whole0[0] + whole0[1]), COUNTS)
    for batch in whole0[0][:-1]:  # stratified: 12 of "a" and 8 of "b", give or take one
        a, b = counts([batch])
        assert 11 <= a <= 13 and a + b == BATCH

    out2 = tmp_path / "elastic"
    args = [*common, "--out", str(out2), "--epochs", "2", "--resume", str(out)]
    (elastic,) = finish_all([(torchrun(3, SCRIPT, args, tmp_path), out2)])
    assert elastic.returncode == 0, elastic.output[-4000:]
    run = Run(out2, elastic.returncode, elastic.output)
    before = [crashed.epoch(r, 1) for r in (0, 1)]
    assert [len(b) for b in before] == [SAVED, SAVED]
    after = [run.epoch(r, 1) for r in (0, 1, 2)]
    assert len({len(b) for b in after}) == 1
    seen = [b for batches in before + after for b in batches]
    whole1 = expected(lists, seed, 1, 2)
    everything = [b for batches in whole1 for b in batches]
    np.testing.assert_array_equal(
        np.sort(np.concatenate([np.asarray(b, np.int64) for b in seen])),
        np.sort(np.concatenate([np.asarray(b, np.int64) for b in everything])),
    )
    np.testing.assert_array_equal(counts(seen), COUNTS)
