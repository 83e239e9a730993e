"""Lightning: a real ``lightning.Trainer`` on CPU, fed by a ``LightningDataModule`` that returns
torchdata's ``StatefulDataLoader`` over :class:`~asynchdf5.torch.HDF5IterableDataset`, crashes
mid-epoch and resumes from a mid-epoch ``ModelCheckpoint`` with ``ckpt_path=``: the batches after
the checkpoint are exactly the uninterrupted run's, with and without DataLoader workers.

Skipped where Lightning (or torchdata) is not installed. Rows encode their global index
(``label == i``), so the batches are compared by their indices.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

from asynchdf5.torch import HDF5IterableDataset

from ._files import write_source
from ._helpers import run_python

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SIZES = (40, 13, 27)  # 80 samples, 10 batches of 8 per epoch
BATCH = 8
EPOCHS = 2


class Crash(RuntimeError):
    """The job dies."""


class Data(pl.LightningDataModule):
    def __init__(self, source: Path, workers: int) -> None:
        super().__init__()
        self.source, self.workers = source, workers
        self.dataset: HDF5IterableDataset | None = None

    def train_dataloader(self) -> StatefulDataLoader:
        self.dataset = HDF5IterableDataset(
            self.source, batch_size=BATCH, shuffle=True, seed=5, indices=True
        )
        return StatefulDataLoader(self.dataset, batch_size=None, num_workers=self.workers)

    def teardown(self, stage: str) -> None:
        if self.dataset is not None:
            self.dataset.close()


class Model(pl.LightningModule):
    def __init__(self, crash_at: int | None = None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.crash_at = crash_at
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == self.crash_at:
            raise Crash(f"at step {self.global_step}")
        assert torch.equal(batch["label"], batch["indices"])  # aligned
        self.seen.append((self.current_epoch, batch["indices"].tolist()))
        prediction = self.linear(batch["data"]).squeeze(1)
        return torch.nn.functional.mse_loss(prediction, batch["label"].float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def trainer(folder: Path, **kw: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder,
        **kw,
    )


# Resuming into the folder of the checkpoints, as a restarted job does: Lightning notes it.
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("saved", [4, 13])  # in epoch 0; in epoch 1
def test_trainer_resumes_mid_epoch_exactly(tmp_path: Path, workers: int, saved: int) -> None:
    """Crash three steps after a mid-epoch checkpoint; ``fit(ckpt_path=...)`` goes on with the
    very batch after the checkpoint's, and the rest of the two epochs is the uninterrupted
    run's (no batch replayed or skipped). No warning from Lightning (warnings are errors)."""
    source, _ = write_source(tmp_path / "data", SIZES)
    whole = Model()
    trainer(tmp_path, enable_checkpointing=False).fit(whole, Data(source, workers))
    reference = whole.seen
    per_epoch = sum(SIZES) // BATCH
    assert len(reference) == EPOCHS * per_epoch
    for e in range(EPOCHS):
        indices = sorted(i for epoch, b in reference if epoch == e for i in b)
        assert indices == list(range(sum(SIZES)))  # exactly once

    def every(folder: Path) -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=folder, filename="{step}", every_n_train_steps=saved, save_top_k=-1
        )

    crashed, data = Model(crash_at=saved + 3), Data(source, workers)
    with pytest.raises(Crash):
        trainer(tmp_path, callbacks=[every(tmp_path / "ckpt")]).fit(crashed, data)
    assert data.dataset is not None
    data.dataset.close()  # a real job's process would be gone: Lightning tears nothing down
    assert crashed.seen == reference[: saved + 3]

    resumed = Model()
    trainer(tmp_path, callbacks=[every(tmp_path / "ckpt")]).fit(
        resumed, Data(source, workers), ckpt_path=tmp_path / "ckpt" / f"step={saved}.ckpt"
    )
    assert resumed.seen == reference[saved:]
    del whole, crashed, resumed, data
    gc.collect()  # the trainers, their loaders and their workers' tensors form cycles


@pytest.mark.slow  # two Lightning processes start, on gloo
@pytest.mark.timeout(360)  # a run PyTorch aborted at exit runs twice
def test_ddp_ranks_train_on_disjoint_shares_of_equal_length(tmp_path: Path) -> None:
    """``Trainer(strategy="ddp", devices=2)`` on CPU, the DataModule of docs/lightning.md: each
    rank's dataset takes its shard from the process group Lightning set up; the two ranks
    trained on as many batches, on disjoint samples that together are the epoch."""
    source, _ = write_source(tmp_path / "data", SIZES)
    run_python(["-m", "tests._lightning_ddp", source, tmp_path], 170, torch_ddp=True)
    ranks = [(tmp_path / f"rank{r}.txt").read_text().split("\n")[:-1] for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == sum(SIZES) // BATCH // 2
    shares = [{int(v) for line in lines for v in line.split()} for lines in ranks]
    assert not shares[0] & shares[1]
    assert sorted(shares[0] | shares[1]) == list(range(sum(SIZES)))
