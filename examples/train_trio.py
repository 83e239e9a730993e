"""Training inside a trio program: :class:`asynchdf5.AsyncHDF5DataLayer` with ``async for``.

A softmax regression on 4x4-pooled pixels, in NumPy, trained by SGD, beside a second task that
reports progress every half second: the layer's reads, gathers and transforms run in worker
threads, so the event loop stays free for whatever else the program does (here, reporting;
elsewhere, talking to a parameter server or a web UI). The same code runs on asyncio with
``anyio.run(main, backend="asyncio")``.

Run it on a source list written by ``asynchdf5 pack`` (or by ``asynchdf5 demo --dir``)::

    python examples/train_trio.py packed/train.txt --epochs 3
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import trio

from asynchdf5 import AsyncHDF5DataLayer
from asynchdf5 import transforms as T

F32 = npt.NDArray[np.float32]


def features(x: F32) -> F32:
    """Images (N, C, H, W) to 4x4 average-pooled features (N, C * 16), plus a bias column."""
    n, c, h, w = x.shape
    pooled = x[:, :, : h - h % 4, : w - w % 4].reshape(n, c, 4, h // 4, 4, w // 4).mean((3, 5))
    return np.concatenate([pooled.reshape(n, -1), np.ones((n, 1), np.float32)], axis=1)


@dataclass
class Model:
    """Softmax regression, trained by plain SGD."""

    weights: F32
    lr: float = 0.5

    def step(self, x: F32, y: npt.NDArray[np.int64]) -> tuple[float, float]:
        """One SGD step on a batch; its loss and accuracy (before the step)."""
        logits = x @ self.weights
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        loss = float(-np.log(p[np.arange(len(y)), y] + 1e-9).mean())
        accuracy = float((p.argmax(axis=1) == y).mean())
        p[np.arange(len(y)), y] -= 1
        self.weights -= self.lr * (x.T @ p / len(y)).astype(np.float32)
        return loss, accuracy


@dataclass
class Progress:
    batches: int = 0
    loss: float = 0.0
    accuracy: float = 0.0


async def report(progress: Progress) -> None:
    """A second task on the same event loop: it runs while the training loop waits for
    batches and trains."""
    while True:
        await trio.sleep(0.5)
        print(f"  ... {progress.batches} batches, loss {progress.loss:.3f}", flush=True)


async def train(source: str, epochs: int, batch_size: int, classes: int) -> float:
    layer = AsyncHDF5DataLayer(
        source,
        batch_size=batch_size,
        shuffle=True,
        seed=0,
        transformers=[("data", T.Scale(1 / 255)), ("data", features)],
    )
    progress = Progress()
    model: Model | None = None
    async with layer, trio.open_nursery() as nursery:
        nursery.start_soon(report, progress)
        for epoch in range(epochs):
            losses, accuracies = [], []
            async for batch in layer:  # one epoch
                x, y = batch["data"], batch["label"]
                if model is None:
                    model = Model(np.zeros((x.shape[1], classes), np.float32))
                loss, accuracy = model.step(x, y)
                losses.append(loss)
                accuracies.append(accuracy)
                progress.batches += 1
                progress.loss = loss
            print(
                f"epoch {epoch}: loss {np.mean(losses):.3f}, "
                f"training accuracy {np.mean(accuracies):.3f}",
                flush=True,
            )
        nursery.cancel_scope.cancel()  # the training is over: stop the reporter
    return float(np.mean(accuracies))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a source list file (or an HDF5 file)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10, help="at least the largest label + 1")
    args = parser.parse_args(argv)
    trio.run(train, args.source, args.epochs, args.batch_size, args.classes)


if __name__ == "__main__":
    main()
