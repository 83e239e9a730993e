"""Real ``torchrun``: data-parallel training with ``HDF5IterableDataset`` across processes.

``torchrun --nproc_per_node N`` (the venv's, as ``python -m torch.distributed.run``) runs
``tests/_ddp_train.py`` on CPU with the gloo backend: a tiny model under
``DistributedDataParallel``, one all-reduce per batch, rank and world size detected from the
process group, ``seed=None`` (rank 0's seed, broadcast). The files have unequal sizes (700, 13
and 1290 rows), so the shards cut across files and the ranks' last batches differ in size. Each
rank writes the indices of every batch it saw; the tests read them back.

The runs (a module fixture; two at a time, since each spends most of its time importing torch):

1. ``crashed``: 2 processes, epochs 0 and 1 whole, then every rank exits (``os._exit``) after
   batch 12 of epoch 2, having saved its state at batch 10: a job dying between checkpoints;
2. ``resumed``: 2 processes resume from those states and finish epoch 2;
3. ``elastic``: 3 processes resume from the same states (rank ``r`` loads the state of old rank
   ``r % 2``), finish epoch 2, then run epoch 3;
4. the torchrun example of ``docs/pytorch.md``, as written there (with run 1).

Slow (every process imports torch): these run in ``nox -s integration``, which CI runs after
``nox -s tests``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from asynchdf5 import HDF5DataLayer

from ._files import check_exactly_once, write_source
from ._helpers import TORCH_EXIT_ABORT, kill_session, pytorch_aborted_at_exit

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(400)]

SCRIPT = Path(__file__).with_name("_ddp_train.py")
DOCS = Path(__file__).parents[1] / "docs" / "pytorch.md"
SIZES = (700, 13, 1290)
N = sum(SIZES)
BATCH = 32
CRASH_EPOCH, CRASH_AFTER, SAVE_EVERY = 2, 12, 5
SAVED = 10  # the last checkpoint before the crash: batch 10 of epoch 2
RUN_TIMEOUT = 180


@dataclass
class Run:
    out: Path
    returncode: int
    output: str

    def epoch(self, rank: int, epoch: int) -> list[list[int]]:
        batches: list[list[int]] = json.loads(
            (self.out / f"rank{rank}-epoch{epoch}.json").read_text()
        )
        return batches

    def done(self, rank: int) -> dict[str, Any]:
        done: dict[str, Any] = json.loads((self.out / f"rank{rank}-done.json").read_text())
        return done


@dataclass(frozen=True)
class Launch:
    """A ``torchrun`` command, to start (and start again, see :func:`finish_all`)."""

    command: list[str]
    cwd: Path
    env: dict[str, str]

    def start(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.command,
            cwd=self.cwd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # so that a hung run is killed whole, workers included
        )


def torchrun(nproc: int, script: Path, args: Sequence[str], cwd: Path) -> Launch:
    """``torchrun --nproc_per_node nproc script args``, run in its own process group."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port of its own: runs may go on side by side
        "--nproc_per_node",
        str(nproc),
        "--monitor-interval",
        "0.1",
        str(script),
        *args,
    ]
    return Launch(command, cwd, env)


def finish(proc: subprocess.Popen[str], out: Path) -> Run:
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        output, _ = kill_session(proc)
        pytest.fail(f"torchrun hung for {RUN_TIMEOUT} s; its output:\n{output[-4000:]}")
    return Run(out, proc.returncode, output)


def finish_all(launches: Sequence[tuple[Launch, Path]]) -> list[Run]:
    """Start the runs side by side and wait for them; none is left running, whatever happens.

    A run that ended in PyTorch's abort at interpreter exit (:data:`TORCH_EXIT_ABORT`) runs
    once more, alone: that abort happens after the script's last statement, in torch's own
    threads, and says nothing of the layer. Its output stays in front of the rerun's."""
    runs = _side_by_side(launches)
    for k, ((launch, out), run) in enumerate(zip(launches, runs, strict=True)):
        if pytorch_aborted_at_exit(run.returncode, run.output):
            (again,) = _side_by_side([(launch, out)])
            note = "\n--- PyTorch aborted at exit (TORCH_EXIT_ABORT); run again ---\n"
            runs[k] = Run(out, again.returncode, run.output + note + again.output)
    return runs


def _side_by_side(launches: Sequence[tuple[Launch, Path]]) -> list[Run]:
    started: list[tuple[subprocess.Popen[str], Path]] = []
    try:
        for launch, out in launches:
            started.append((launch.start(), out))
        return [finish(proc, out) for proc, out in started]
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                kill_session(proc)


def write_images(folder: Path, sizes: Sequence[int] = (1024, 1024)) -> None:
    """``train.txt`` as the docs' examples find it: uint8 3x32x32 images, int64 labels 0-9."""
    rng = np.random.default_rng(0)
    names = []
    for k, n in enumerate(sizes):
        names.append(f"train-{k:03d}.h5")
        with h5py.File(folder / names[-1], "w") as f:
            f["data"] = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
            f["label"] = rng.integers(0, 10, n, dtype=np.int64)
    (folder / "train.txt").write_text("\n".join(names) + "\n")


def docs_script() -> str:
    """The torchrun example of docs/pytorch.md: the Python block after the skip marker that
    names this module."""
    text = DOCS.read_text()
    marker = r"<!-- skip: next [^\n]*tests/test_torchrun\.py[^\n]*-->"
    m = re.search(marker + r"\s*```python\n(.*?)```", text, re.S)
    assert m is not None, "docs/pytorch.md has no torchrun example marked for this test"
    return m.group(1)


@dataclass
class Runs:
    source: Path
    crashed: Run
    resumed: Run
    elastic: Run
    docs: Run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    folder = tmp_path_factory.mktemp("torchrun")
    (folder / "data").mkdir()
    source, _ = write_source(folder / "data", SIZES)
    common = ["--source", str(source), "--batch-size", str(BATCH), "--save-every", str(SAVE_EVERY)]

    docs = folder / "docs"
    docs.mkdir()
    write_images(docs)
    (docs / "train_ddp.py").write_text(docs_script())

    def train(nproc: int, out: str, epochs: int, *extra: str) -> tuple[Launch, Path]:
        args = [*common, "--out", str(folder / out), "--epochs", str(epochs), *extra]
        return torchrun(nproc, SCRIPT, args, folder), folder / out

    crash = ["--crash-epoch", str(CRASH_EPOCH), "--crash-after", str(CRASH_AFTER)]
    first = [train(2, "crashed", 3, *crash), (torchrun(2, docs / "train_ddp.py", [], docs), docs)]
    crashed, docs_run = finish_all(first)
    saved = ["--resume", str(folder / "crashed")]
    second = [train(2, "resumed", 3, *saved), train(3, "elastic", 4, *saved)]
    resumed, elastic = finish_all(second)
    return Runs(source, crashed, resumed, elastic, docs_run)


def expected(source: Path, seed: int, epoch: int, world_size: int) -> list[list[list[int]]]:
    """Every rank's batches of ``epoch``, uninterrupted, from the layer in this process."""
    out = []
    for rank in range(world_size):
        layer = HDF5DataLayer(
            source, batch_size=BATCH, shuffle=True, seed=seed, rank=rank, world_size=world_size
        )
        layer.set_epoch(epoch)
        with layer:
            out.append([b.indices.tolist() for b in layer])
    return out


def check_ranks(per_rank: Sequence[Sequence[Sequence[int]]]) -> None:
    """Every sample once in the union of the ranks' batches, equal batch counts per rank."""
    assert len({len(batches) for batches in per_rank}) == 1, [len(b) for b in per_rank]
    check_exactly_once((b for batches in per_rank for b in batches), N)


def saved_seed(run: Run) -> int:
    seeds = {json.loads((run.out / f"state-rank{r}.json").read_text())["seed"] for r in (0, 1)}
    assert len(seeds) == 1, seeds  # seed=None: rank 0's seed, broadcast to rank 1
    (seed,) = seeds
    return int(seed)


def test_two_ranks_over_unequal_files_same_batch_counts_every_sample_once(runs: Runs) -> None:
    """Epochs 0 and 1 of two DDP ranks over files of unequal sizes: equal counts (the
    all-reduce of every batch did not hang), each epoch every sample exactly once, and the
    batches are the layer's own plan for the broadcast seed."""
    run = runs.crashed
    assert run.returncode != 0, run.output[-4000:]  # the deliberate crash in epoch 2
    seed = saved_seed(run)
    for epoch in (0, 1):
        per_rank = [run.epoch(rank, epoch) for rank in (0, 1)]
        check_ranks(per_rank)
        assert len(per_rank[0]) == N // (2 * BATCH) + 1  # the shard rule: 31 full + 1 partial
        assert per_rank == expected(runs.source, seed, epoch, 2)
    assert [len(run.epoch(rank, CRASH_EPOCH)) for rank in (0, 1)] == [SAVED, SAVED]


def test_killed_mid_epoch_and_resumed_completes_the_epoch_exactly(runs: Runs) -> None:
    """The batches before the last checkpoint and those of the resumed run are exactly the
    uninterrupted run's epoch (the two after the checkpoint are served again)."""
    assert runs.resumed.returncode == 0, runs.resumed.output[-4000:]
    seed = saved_seed(runs.crashed)
    whole = expected(runs.source, seed, CRASH_EPOCH, 2)
    for rank in (0, 1):
        before = runs.crashed.epoch(rank, CRASH_EPOCH)
        after = runs.resumed.epoch(rank, CRASH_EPOCH)
        assert before + after == whole[rank]
        assert runs.resumed.done(rank)["seed"] == seed  # seed=None took the saved one
    check_ranks(whole)


def test_resumed_on_three_processes_completes_the_epoch_exactly(runs: Runs) -> None:
    """Elastic: the states of two ranks, loaded by three, finish epoch 2 with every sample not
    yet seen exactly once, in equal batch counts; epoch 3 is a normal three-rank epoch."""
    run = runs.elastic
    assert run.returncode == 0, run.output[-4000:]
    before = [runs.crashed.epoch(rank, CRASH_EPOCH) for rank in (0, 1)]
    after = [run.epoch(rank, CRASH_EPOCH) for rank in (0, 1, 2)]
    assert len({len(b) for b in after}) == 1
    seen = np.concatenate([np.asarray(b, np.int64) for batches in before + after for b in batches])
    assert np.array_equal(np.sort(seen), np.arange(N))
    next_epoch = [run.epoch(rank, CRASH_EPOCH + 1) for rank in (0, 1, 2)]
    check_ranks(next_epoch)
    assert next_epoch == expected(runs.source, saved_seed(runs.crashed), CRASH_EPOCH + 1, 3)
    done = [run.done(rank) for rank in (0, 1, 2)]
    assert [d["world_size"] for d in done] == [3, 3, 3]


def test_ddp_replicas_stay_in_step(runs: Runs) -> None:
    """DDP averaged the gradients of every batch: the replicas end with the same weights."""
    for run, world in ((runs.resumed, 2), (runs.elastic, 3)):
        checksums = {run.done(rank)["checksum"] for rank in range(world)}
        assert len(checksums) == 1, checksums


def test_docs_example_runs_under_torchrun(runs: Runs) -> None:
    assert runs.docs.returncode == 0, runs.docs.output[-4000:]
    assert "epoch 1:" in runs.docs.output


def test_a_run_pytorch_aborted_at_exit_runs_once_more(tmp_path: Path) -> None:
    """:func:`finish_all` runs again only what ended in PyTorch's exit abort, and only once:
    a script that aborts so while ``tries`` holds fewer than ``n`` lines."""
    script = tmp_path / "abort.py"
    script.write_text(
        "import os, sys\n"
        "tries = open(sys.argv[1], 'a+'); tries.write('x\\n'); tries.seek(0)\n"
        "if len(tries.readlines()) < int(sys.argv[2]):\n"
        f"    print({TORCH_EXIT_ABORT!r}, flush=True)\n"
        "    os.abort()\n"
        "if sys.argv[3] == 'fail':\n"
        "    sys.exit(3)\n"
    )

    def launch(name: str, n: int, end: str = "ok") -> tuple[Launch, Path]:
        command = [sys.executable, str(script), str(tmp_path / name), str(n), end]
        return Launch(command, tmp_path, dict(os.environ)), tmp_path / name

    once, twice, failed = finish_all(
        [launch("once", 2), launch("twice", 3), launch("no", 0, "fail")]
    )
    assert once.returncode == 0 and once.output.count(TORCH_EXIT_ABORT) == 1
    assert twice.returncode == -signal.SIGABRT and twice.output.count(TORCH_EXIT_ABORT) == 2
    assert failed.returncode == 3  # any other failure stands
    assert [len(p.read_text().split()) for p in (once.out, twice.out, failed.out)] == [2, 2, 1]
