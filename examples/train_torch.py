"""Training a small CNN with PyTorch: ``asynchdf5.torch.HDF5IterableDataset`` in a plain
``torch.utils.data.DataLoader`` (CPU is fine).

The dataset yields whole batches as dicts of tensors, so the loader is made with
``batch_size=None``, and ``num_workers=0``: the layer already reads, shuffles and gathers on
threads of its own. ``asynchdf5 pack`` writes the ``classes`` attribute this script takes the
number of classes from.

Run it on a source list written by ``asynchdf5 pack``::

    python -m asynchdf5 pack images/ packed/ --size 32 --shuffle --val 0.1
    python examples/train_torch.py packed/train.txt --val packed/val.txt --epochs 5
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import h5py
import torch
from torch import nn
from torch.utils.data import DataLoader

from asynchdf5 import transforms as T
from asynchdf5.torch import HDF5IterableDataset


def describe(source: str) -> tuple[int, int]:
    """Channels and classes, from the first file of a source list (or an HDF5 file)."""
    path = Path(source)
    if not h5py.is_hdf5(path):
        lines = [s.strip() for s in path.read_text().splitlines()]
        path = path.parent / next(s for s in lines if s and not s.startswith("#"))
    with h5py.File(path, "r") as f:
        classes = f.attrs.get("classes")
        return int(f["data"].shape[1]), len(classes) if classes is not None else 10


def tiny_cnn(channels: int, classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, classes),
    )


def evaluate(model: nn.Module, loader: DataLoader[dict[str, torch.Tensor]]) -> float:
    model.eval()
    right = seen = 0
    with torch.no_grad():
        for batch in loader:
            predicted = model(batch["data"]).argmax(dim=1)
            right += int((predicted == batch["label"]).sum())
            seen += len(predicted)
    model.train()
    return right / max(seen, 1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="the training set's source list file")
    parser.add_argument("--val", help="the validation set's source list file")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    channels, classes = describe(args.source)
    scale = [("data", T.Scale(1 / 255))]  # uint8 pixels to float32 in [0, 1]
    train = HDF5IterableDataset(
        args.source, batch_size=args.batch_size, shuffle=True, seed=0, transformers=scale
    )
    loader = DataLoader(train, batch_size=None)  # the dataset yields whole batches
    val = HDF5IterableDataset(args.val, batch_size=256, transformers=scale) if args.val else None
    model = tiny_cnn(channels, classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    print(f"{len(train)} batches per epoch, {classes} classes, {channels} channel(s)")
    try:
        for epoch in range(args.epochs):
            start, total, samples = time.perf_counter(), 0.0, 0
            for batch in loader:  # one epoch
                optimizer.zero_grad()
                loss = loss_fn(model(batch["data"]), batch["label"])
                loss.backward()
                optimizer.step()
                total += loss.item() * len(batch["label"])
                samples += len(batch["label"])
            rate = samples / (time.perf_counter() - start)
            line = f"epoch {epoch}: loss {total / samples:.3f} ({rate:,.0f} samples/s)"
            if val is not None:
                accuracy = evaluate(model, DataLoader(val, batch_size=None))
                line += f", validation accuracy {accuracy:.3f}"
            print(line, flush=True)
    finally:
        train.close()  # the layers' background threads stop now (else at exit)
        if val is not None:
            val.close()


if __name__ == "__main__":
    main()
