"""From an image folder to training: ``asynchdf5 pack``, ``inspect``, ``bench``, then train.

The walkthrough of the "Packing data" page, as one script. Each step is the command a user
types, printed and then run:

1. ``asynchdf5 pack IMAGES OUT --size 32 --shuffle --val 0.1``: decode and resize every image
   (in a pool of processes), shuffle them (the folder is sorted by class), hold out a tenth of
   each class for validation, and write HDF5 files whose layout the layer reads directly, with
   ``OUT/train.txt`` and ``OUT/val.txt`` naming them;
2. ``asynchdf5 inspect OUT/train.txt``: what the layer finds, and how it will read it;
3. ``asynchdf5 bench OUT/train.txt``: one shuffled epoch through the layer, beside the raw read
   of the same bytes and the in-RAM ceiling;
4. ``python examples/train_torch.py OUT/train.txt --val OUT/val.txt``: a small CNN (with
   PyTorch), or ``examples/sync_loop.py`` without it.

Without an image folder of your own, ``--make-images N`` first makes one: N images in three
classes (reddish, greenish and bluish noise, in PNG and JPEG, of assorted sizes)::

    python examples/image_folder_to_training.py --make-images 300 work/
    python examples/image_folder_to_training.py ~/data/flowers work/ --size 64 --epochs 10
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def make_images(folder: Path, n: int, seed: int = 0) -> None:
    """``n`` images in three classes whose colour tells the class, of assorted sizes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    tints = {"red": (170, 60, 60), "green": (60, 170, 60), "blue": (60, 60, 170)}
    for i in range(n):
        name, tint = list(tints.items())[i % 3]
        (folder / name).mkdir(parents=True, exist_ok=True)
        h, w = (int(s) for s in rng.integers(24, 96, 2))
        pixels = np.clip(np.array(tint) + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
        suffix = ".jpg" if i % 2 else ".png"
        Image.fromarray(pixels).save(folder / name / f"{i:05d}{suffix}")


def step(*command: object) -> None:
    """Print a command as a user would type it, then run it (stopping at a failure)."""
    words = [str(c) for c in command]
    shown = ["asynchdf5", *words[3:]] if words[1:3] == ["-m", "asynchdf5"] else words[1:]
    print("\n$ " + " ".join(["python", *shown] if shown[0].endswith(".py") else shown), flush=True)
    subprocess.run(words, check=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "images", nargs="?", type=Path, help="an image folder, one subfolder per class"
    )
    parser.add_argument("work", type=Path, help="where the packed files go (WORK/packed)")
    parser.add_argument("--make-images", type=int, metavar="N", help="make N images first")
    parser.add_argument("--size", type=int, default=32, help="images are resized to SIZE x SIZE")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    images = args.images
    if args.make_images:
        images = args.work / "images"
        make_images(images, args.make_images)
        print(f"made {args.make_images} images in {images}")
    elif images is None:
        parser.error("give an image folder, or --make-images N")
    packed = args.work / "packed"
    python = sys.executable
    step(python, "-m", "asynchdf5", "pack", images, packed, "--size", args.size,
         "--shuffle", "--val", "0.1", "--on-error", "skip", "--overwrite")  # fmt: skip
    step(python, "-m", "asynchdf5", "inspect", packed / "train.txt")
    step(python, "-m", "asynchdf5", "bench", packed / "train.txt", "--batch-size", "64")
    if importlib.util.find_spec("torch") is not None:
        step(python, HERE / "train_torch.py", packed / "train.txt", "--val", packed / "val.txt",
             "--epochs", args.epochs)  # fmt: skip
    else:
        print("\n(PyTorch is not installed: a plain loop over the data instead)")
        step(python, HERE / "sync_loop.py", packed / "train.txt", "--epochs", args.epochs)


if __name__ == "__main__":
    main()
