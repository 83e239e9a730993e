"""Lightning's side of ``test_lightning``'s DDP test: ``python -m tests._lightning_ddp SOURCE OUT``.

A ``Trainer(strategy="ddp", devices=2)`` on CPU (Lightning starts the second process by running
this module again), one epoch; each rank writes the indices of the batches it trained on to
``OUT/rank{r}.txt``, one batch a line."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from asynchdf5.torch import HDF5IterableDataset

warnings.filterwarnings("ignore", "'set_vital' is deprecated")
warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated")


class Data(pl.LightningDataModule):
    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source
        self.dataset: HDF5IterableDataset | None = None

    def train_dataloader(self) -> StatefulDataLoader:
        self.dataset = HDF5IterableDataset(self.source, batch_size=8, shuffle=True, indices=True)
        return StatefulDataLoader(self.dataset, batch_size=None)

    def teardown(self, stage: str) -> None:
        if self.dataset is not None:
            self.dataset.close()


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["indices"].tolist())
        out = self.linear(batch["data"]).squeeze(1)
        return torch.nn.functional.mse_loss(out, batch["label"].float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def main(source: str, out: Path) -> None:
    model = Model()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=out,
    )
    trainer.fit(model, Data(source))
    rank = dist.get_rank() if dist.is_initialized() else trainer.global_rank
    lines = [" ".join(map(str, b)) for b in model.seen]
    (out / f"rank{rank}.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
