"""Does the epoch order matter to training? (``python -m benchmarks.shuffle_training``).

A small model is trained with SGD on *class-sorted* synthetic data, once per epoch order of
:mod:`benchmarks.shuffle_quality` (the planner's orders, with the sizes of the image rows the
entropy table uses, and a full random permutation), and evaluated on a held-out i.i.d. test set.

The data: 10 classes, each a Gaussian cloud (identity covariance) around a mean drawn from
``N(0, separation^2 / dim I)`` in ``dim`` dimensions, so the classes overlap: the Bayes classifier
(the nearest true mean) is right on only part of the test set, and that share is reported
beside the model's accuracy. Sample ``i`` of ``N`` belongs to class ``i * 10 // N``, as in the
entropy benchmark. The model is logistic regression (``--hidden 0``) or an MLP with one hidden
ReLU layer, trained with SGD + momentum at a constant learning rate, batches of 256 cut from the
epoch's serving order; the same initial weights for every mode of a seed.

NumPy's BLAS runs on one thread (``OPENBLAS_NUM_THREADS=1`` unless set), so the run leaves the
machine's other core alone.
"""

from __future__ import annotations

import os

# The SGD steps multiply small matrices: one BLAS thread is fastest, and leaves the other core
# alone. Set before NumPy is first imported (as when run with ``python -m``); otherwise no effect.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import itertools
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from benchmarks.internals import BLOCK_BYTES
from benchmarks.report import Recorder
from benchmarks.shuffle_quality import (
    BATCH_SIZE,
    CHUNK_SIZE,
    CLASSES,
    IMAGE_ROW_BYTES,
    Mode,
    OrderSpec,
    epoch_order,
    modes,
)

__all__ = ["MLP", "Data", "TrainResult", "make_data", "train"]

F32 = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Data:
    """Class-sorted training set, i.i.d. test set, and the Bayes classifier's test accuracy."""

    x: F32  # (N, dim), class-sorted
    y: npt.NDArray[np.int64]  # (N,)
    x_test: F32
    y_test: npt.NDArray[np.int64]
    bayes_accuracy: float


def make_data(n: int, n_test: int, dim: int, separation: float, seed: int = 1234) -> Data:
    """Gaussian clouds around random means; the training set sorted by class."""
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, separation / np.sqrt(dim), (CLASSES, dim)).astype(np.float32)
    y = np.arange(n, dtype=np.int64) * CLASSES // n
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x += means[y]
    y_test = rng.integers(0, CLASSES, n_test).astype(np.int64)
    x_test = rng.standard_normal((n_test, dim), dtype=np.float32) + means[y_test]
    # Equal priors, identity covariance: the Bayes rule is the nearest true mean.
    d2 = ((x_test[:, None, :] - means[None, :, :]) ** 2).sum(axis=2)
    bayes = float((d2.argmin(axis=1) == y_test).mean())
    return Data(x, y, x_test, y_test, bayes)


class MLP:
    """Softmax regression (``hidden=0``) or one hidden ReLU layer, trained by SGD with momentum
    (PyTorch's rule: ``v = mu v + g; w -= lr v``), in NumPy float32. Weights and biases start
    uniform in +-1/sqrt(fan_in), as PyTorch's ``nn.Linear``."""

    def __init__(self, dim: int, hidden: int, seed: int, lr: float, momentum: float) -> None:
        rng = np.random.default_rng((seed, 777))
        sizes = [dim, hidden, CLASSES] if hidden > 0 else [dim, CLASSES]
        self.params: list[F32] = []
        for fan_in, fan_out in itertools.pairwise(sizes):
            bound = 1 / np.sqrt(fan_in)
            self.params.append(rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32))
            self.params.append(rng.uniform(-bound, bound, fan_out).astype(np.float32))
        self.velocity = [np.zeros_like(p) for p in self.params]
        self.lr, self.momentum = np.float32(lr), np.float32(momentum)

    def logits(self, x: F32) -> F32:
        a = x
        for i in range(0, len(self.params) - 2, 2):
            a = np.maximum(a @ self.params[i] + self.params[i + 1], 0)
        out: F32 = a @ self.params[-2] + self.params[-1]
        return out

    def step(self, x: F32, y: npt.NDArray[np.int64]) -> None:
        """One SGD step on the mean cross-entropy of the batch."""
        hidden = len(self.params) == 4
        if hidden:
            w1, b1, w2, b2 = self.params
            z1 = x @ w1
            z1 += b1
            a1 = np.maximum(z1, 0)
        else:
            w2, b2 = self.params
            a1 = x
        z = a1 @ w2
        z += b2
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1
        p /= np.float32(len(y))  # d loss / d logits
        grads = [a1.T @ p, p.sum(axis=0)]
        if hidden:
            d1 = p @ w2.T
            d1 *= z1 > 0
            grads = [x.T @ d1, d1.sum(axis=0), *grads]
        for w, v, g in zip(self.params, self.velocity, grads, strict=True):
            v *= self.momentum
            v += g
            w -= self.lr * v

    def accuracy(self, x: F32, y: npt.NDArray[np.int64]) -> float:
        hits = 0
        for i in range(0, len(x), 65536):
            hits += int((self.logits(x[i : i + 65536]).argmax(axis=1) == y[i : i + 65536]).sum())
        return hits / len(x)


@dataclass(frozen=True)
class TrainResult:
    mode: Mode
    seed: int
    accuracy: tuple[float, ...]  # test accuracy after each epoch
    seconds: float


def train(
    mode: Mode,
    spec: OrderSpec,
    data: Data,
    *,
    seed: int,
    epochs: int,
    hidden: int,
    lr: float,
    momentum: float,
) -> TrainResult:
    """Train a fresh model (initial weights from ``seed``) on ``epochs`` epochs of ``mode``."""
    t0 = time.perf_counter()
    model = MLP(data.x.shape[1], hidden, seed, lr, momentum)
    accs = []
    for epoch in range(epochs):
        order = epoch_order(mode, spec, seed, epoch)
        for start in range(0, len(order), spec.batch_size):
            idx = order[start : start + spec.batch_size]
            model.step(data.x[idx], data.y[idx])
        accs.append(model.accuracy(data.x_test, data.y_test))
    return TrainResult(mode, seed, tuple(accs), time.perf_counter() - t0)


def training_modes(spec: OrderSpec) -> list[Mode]:
    """No shuffle, the old mode, the default blocks and blocks 4x and 16x as large, and the full
    permutation (smaller blocks mix as well as the permutation: see the entropy table)."""
    return modes(spec, [BLOCK_BYTES, 4 * BLOCK_BYTES, 16 * BLOCK_BYTES], extra=False)


def bench(rec: Recorder) -> None:
    """Test accuracy after the last epoch per mode and seed (MLP 64-64-10, SGD lr 0.05 momentum
    0.9, batch 256, class-sorted Gaussian classes of separation 2.5), and each mode's final
    accuracy minus the full permutation's, in points (mean over seeds; a note when negative)."""
    n, test, seeds, epochs = (20_000, 2_000, 1, 1) if rec.quick else (2_000_000, 50_000, 3, 3)
    dim, hidden, separation = 64, 64, 2.5
    spec = OrderSpec(n, BATCH_SIZE, 2**13 if rec.quick else CHUNK_SIZE, IMAGE_ROW_BYTES)
    data = make_data(n, test, dim, separation)
    rec.param(samples=n, test=test, seeds=seeds, epochs=epochs, dim=dim, hidden=hidden,
              separation=separation, chunk_size=spec.chunk_size)  # fmt: skip
    rec.figure("Bayes classifier, test accuracy", 100 * data.bayes_accuracy, "%")
    finals: dict[str, list[float]] = {}
    for seed in range(seeds):
        for mode in training_modes(spec):
            r = train(mode, spec, data, seed=seed, epochs=epochs, hidden=hidden, lr=0.05,
                      momentum=0.9)  # fmt: skip
            finals.setdefault(mode.name, []).append(100 * r.accuracy[-1])
    full = next(np.mean(v) for k, v in finals.items() if "permutation" in k)
    for name, accs in finals.items():
        rec.figure(f"{name}: final test accuracy", float(np.mean(accs)), "%")
        gap = float(np.mean(accs)) - full
        if gap < 0:
            rec.figure(f"{name}: below the full permutation", -gap, "points")
        else:
            rec.note(f"{name}: {gap:+.2f} points against the full permutation")
