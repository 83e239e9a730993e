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

import argparse
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from asynchdf5._config import BLOCK_BYTES
from benchmarks.shuffle_quality import (
    BATCH_SIZE,
    CHUNK_SIZE,
    CLASSES,
    IMAGE_ROW_BYTES,
    Mode,
    OrderSpec,
    epoch_order,
    header,
    modes,
    utc_now,
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


def _pm(values: Sequence[float]) -> str:
    a = 100 * np.asarray(values)
    return f"{a.mean():.2f} ± {a.std():.2f}"


def results_table(results: Sequence[TrainResult], epochs: int) -> list[str]:
    """Markdown rows: test accuracy (%) after each epoch, mean ± sd over the seeds."""
    by_mode: dict[str, list[TrainResult]] = {}
    for r in results:
        by_mode.setdefault(r.mode.name, []).append(r)
    full = next(rs for rs in by_mode.values() if rs[0].mode.kind == "permutation")
    full_final = {r.seed: r.accuracy[-1] for r in full}
    cols = [f"epoch {e + 1}" for e in range(epochs)]
    lines = [
        f"| mode | {' | '.join(cols)} | final − full permutation (points) | s per run |",
        "|---|" + "---|" * (epochs + 2),
    ]
    for name, rs in by_mode.items():
        per_epoch = [_pm([r.accuracy[e] for r in rs]) for e in range(epochs)]
        diff = [100 * (r.accuracy[-1] - full_final[r.seed]) for r in rs]
        lines.append(
            f"| {name} | {' | '.join(per_epoch)} | {np.mean(diff):+.2f} "
            f"(seeds: {', '.join(f'{d:+.2f}' for d in diff)}) "
            f"| {np.mean([r.seconds for r in rs]):.0f} |"
        )
    return lines


def verdict(results: Sequence[TrainResult]) -> str:
    """The issue's claim, checked on the final accuracies (mean over the seeds)."""

    def final(pred: Callable[[Mode], bool]) -> float:
        return float(np.mean([r.accuracy[-1] for r in results if pred(r.mode)]))

    full = final(lambda m: m.kind == "permutation")
    default = final(lambda m: m.default)
    gap = 100 * (full - default)
    met = "met" if gap <= 1.0 else "NOT met"
    return (
        f"Target (default blocks within 1 point of the full permutation's final accuracy): "
        f"{met}: {100 * default:.2f} % against {100 * full:.2f} % ({-gap:+.2f} points)."
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.shuffle_training",
        description="Train a small model on class-sorted data with each shuffle mode's epoch "
        "order (from the planner) and report held-out accuracy. Prints markdown.",
    )
    p.add_argument("--samples", type=int, default=2_000_000, help="training samples N")
    p.add_argument("--test", type=int, default=50_000, help="i.i.d. test samples")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument(
        "--separation",
        type=float,
        default=2.5,
        help="scale of the class means (smaller: more overlap; default 2.5)",
    )
    p.add_argument("--hidden", type=int, default=64, help="hidden units (0: logistic regression)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--chunk-size", type=int, default=CHUNK_SIZE)
    p.add_argument("--row-bytes", type=int, default=IMAGE_ROW_BYTES)
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="train only the modes whose name contains TEXT (repeatable)",
    )
    p.add_argument("--output", help="also write the markdown to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    started, t0 = utc_now(), time.perf_counter()
    spec = OrderSpec(args.samples, BATCH_SIZE, args.chunk_size, args.row_bytes)
    data = make_data(args.samples, args.test, args.dim, args.separation)
    print(f"# data ready, Bayes accuracy {data.bayes_accuracy:.4f}", file=sys.stderr, flush=True)
    selected = [
        m for m in training_modes(spec) if not args.only or any(t in m.name for t in args.only)
    ]
    results = []
    for seed in range(args.seeds):
        for mode in selected:
            r = train(
                mode,
                spec,
                data,
                seed=seed,
                epochs=args.epochs,
                hidden=args.hidden,
                lr=args.lr,
                momentum=args.momentum,
            )
            accs = ", ".join(f"{a:.4f}" for a in r.accuracy)
            print(
                f"# seed {seed} {mode.name}: {accs} ({r.seconds:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            results.append(r)
    model = "logistic regression" if args.hidden <= 0 else f"MLP {args.dim}-{args.hidden}-10 (ReLU)"
    about = (
        f"{model}, SGD lr {args.lr:g} momentum {args.momentum:g} (constant), batch "
        f"{BATCH_SIZE}, {args.epochs} epochs over N = {args.samples:,} class-sorted samples "
        f"(10 Gaussian classes in {args.dim}-d, separation {args.separation:g}); orders from the "
        f"planner with chunk_size {spec.chunk_size:,}, first_rows {spec.first_rows:,} and the "
        f"blocks of a {spec.row_bytes}-byte row; test accuracy (%) on {args.test:,} i.i.d. "
        f"samples, mean ± sd over {args.seeds} seeds (seed = order seed = initial weights). "
        f"Bayes classifier on the test set: {100 * data.bayes_accuracy:.2f} %."
    )
    lines = [
        *header(argv, "benchmarks.shuffle_training", started, time.perf_counter() - t0),
        "",
        about,
        "",
        *results_table(results, args.epochs),
        "",
        verdict(results),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
