"""A plain ``for`` loop over HDF5 files: :class:`asynchdf5.HDF5DataLayer`, no async code.

The layer runs its pipeline on an event loop in a background thread; the loop below only takes
batches. Each epoch checks the layer's promise: every sample exactly once.

Run it on any source list, for instance the demo's data set::

    python -m asynchdf5 demo --dir data --epochs 1     # writes data/train.txt
    python examples/sync_loop.py data/train.txt --epochs 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np

from asynchdf5 import HDF5DataLayer
from asynchdf5 import transforms as T


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a source list file (or an HDF5 file)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)

    with HDF5DataLayer(
        args.source,
        batch_size=args.batch_size,
        shuffle=True,
        seed=0,
        transformers=[("data", T.Scale(1 / 255))],  # uint8 pixels to float32 in [0, 1]
    ) as layer:
        n = layer.n_samples
        print(f"{n:,} samples, {len(layer)} batches per epoch")
        for epoch in range(args.epochs):
            seen = np.zeros(n, np.int64)
            total = 0.0
            start = time.perf_counter()
            for batch in layer:  # one epoch
                x, y = batch["data"], batch["label"]
                total += float(x.mean()) * len(y)  # your training step goes here
                seen[batch.indices] += 1
            seconds = time.perf_counter() - start
            assert (seen == 1).all(), "every sample exactly once"
            print(
                f"epoch {epoch}: {n:,} samples in {seconds:.2f} s ({n / seconds:,.0f} samples/s), "
                f"mean pixel {total / n:.3f}; every sample seen exactly once"
            )
        print("bottleneck:", layer.stats.bottleneck())


if __name__ == "__main__":
    main()
