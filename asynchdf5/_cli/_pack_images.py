"""Image folders for ``asynchdf5 pack``: one subfolder per class, decoded and resized with
Pillow in a pool of processes.

The layout is the usual one (torchvision's ``ImageFolder``): ``ROOT/CLASS/.../IMAGE``. Class
names are the subfolders' names, sorted; a sample's label is its class's index in that order.
Images are read in sorted path order within each class, converted to RGB (or grayscale, with
``--channels 1``), resized to one size, and stored as uint8 ``(channels, height, width)``.
Without ``--size`` that size is the images' own, when every image has the same one.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._pack_inputs import Block, Index
from ._pack_write import PackError, TopSpec

__all__ = ["IMAGE_SUFFIXES", "ImageInput", "ImageOptions", "common_size", "decode_image"]

IMAGE_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm"}
)
#: Images decoded per task of a worker process (a task's results travel back together).
TASK_IMAGES = 32
#: Fewer images than this are decoded in this process by default: starting worker processes
#: (each imports NumPy, h5py and Pillow) takes longer than decoding a few hundred images.
POOL_MIN_IMAGES = 256


@dataclass(frozen=True)
class ImageOptions:
    """How every image is made into a sample."""

    height: int
    width: int
    channels: int = 3  # 3: RGB, 1: grayscale
    resize: str = "crop"  # "crop": keep the aspect ratio, crop the middle; "stretch"


def _pillow() -> Any:
    try:
        from PIL import Image, ImageOps
    except ImportError as exc:
        raise PackError(
            "packing an image folder needs Pillow, which is not installed: "
            'pip install ".[pack]" in the asynchdf5 checkout'
        ) from exc
    return Image, ImageOps


def decode_image(path: str, opts: ImageOptions) -> np.ndarray:
    """One image as uint8 ``(channels, height, width)`` (raises what Pillow raises)."""
    Image, ImageOps = _pillow()
    size = (opts.width, opts.height)
    with Image.open(path) as im:
        im.draft(None, size)  # JPEG: decode at a reduced scale when the image is much larger
        im = ImageOps.exif_transpose(im)  # as the camera held it
        im = im.convert("RGB" if opts.channels == 3 else "L")
        if opts.resize == "crop":
            im = ImageOps.fit(im, size, method=Image.Resampling.BILINEAR)
        elif im.size != size:
            im = im.resize(size, Image.Resampling.BILINEAR)
        a = np.asarray(im, dtype=np.uint8)
    return np.ascontiguousarray(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))


def image_size(path: str) -> tuple[int, int]:
    """``(height, width)`` of an image as :func:`decode_image` sees it (EXIF orientation applied),
    from its header only."""
    Image, _ = _pillow()
    with Image.open(path) as im:
        width, height = im.size
        if im.getexif().get(0x0112) in (5, 6, 7, 8):  # Orientation: turned a quarter
            width, height = height, width
    return height, width


def common_size(paths: Sequence[str]) -> tuple[int, int]:
    """The ``(height, width)`` every image has; a :class:`PackError` naming two images that
    differ (and ``--size``) when they do not agree. An image whose header cannot be read is
    left to the decoding, which reports it as ``--on-error`` says."""
    first: tuple[str, tuple[int, int]] | None = None
    unreadable: tuple[str, str] | None = None
    for path in paths:
        try:
            size = image_size(path)
        except Exception as exc:  # Pillow raises OSError, ValueError, SyntaxError, ...
            unreadable = unreadable or (path, f"{type(exc).__name__}: {exc}")
            continue
        if first is None:
            first = (path, size)
        elif size != first[1]:
            raise PackError(
                f"the images differ in size: {first[0]} is {_hw(first[1])} and {path} is "
                f"{_hw(size)} (height x width); give --size HEIGHT [WIDTH] to resize every "
                "image to one size"
            )
    if first is None:
        assert unreadable is not None
        raise PackError(
            f"no image's size could be read (first: {unreadable[0]}: {unreadable[1]}); "
            "give --size HEIGHT [WIDTH]"
        )
    return first[1]


def _hw(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


def decode_images(
    paths: Sequence[str], opts: ImageOptions
) -> tuple[np.ndarray, list[int], list[tuple[int, str]]]:
    """Decode ``paths``: the images stacked, the positions of those that decoded, and
    ``(position, why)`` for those that did not. Runs in a worker process."""
    out = np.empty((len(paths), opts.channels, opts.height, opts.width), np.uint8)
    good: list[int] = []
    bad: list[tuple[int, str]] = []
    for i, path in enumerate(paths):
        try:
            out[len(good)] = decode_image(path, opts)
        except Exception as exc:  # Pillow raises OSError, ValueError, SyntaxError, ...
            bad.append((i, f"{type(exc).__name__}: {exc}"))
        else:
            good.append(i)
    return out[: len(good)], good, bad


def _worker_init() -> None:
    # Ctrl-C reaches every process of the terminal's group: the parent alone stops the pack
    # (and the pool), so that a worker does not die with a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def scan(root: Path) -> tuple[list[str], list[str], Index]:
    """Class names (sorted subfolders), image paths, and the class index of each image."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise PackError(
            f"{root}: no class subfolders; an image folder holds one subfolder per class, "
            "e.g. images/cat/001.jpg, images/dog/002.png"
        )
    paths: list[str] = []
    labels: list[int] = []
    for k, name in enumerate(classes):
        for folder, subfolders, files in os.walk(root / name, followlinks=True):
            subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
            for f in sorted(files):
                if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_SUFFIXES:
                    paths.append(os.path.join(folder, f))
                    labels.append(k)
    if not paths:
        suffixes = ", ".join(sorted(IMAGE_SUFFIXES))
        raise PackError(f"{root}: no image files ({suffixes}) in its class subfolders")
    return classes, paths, np.array(labels, dtype=np.int64)


class ImageInput:
    """An image folder: ``data`` uint8 (N, C, H, W), ``label`` int64, classes sorted.

    ``size`` is ``(height, width)``; None: the images' own (:func:`common_size`).
    """

    def __init__(
        self,
        root: Path,
        size: tuple[int, int] | None,
        channels: int,
        resize: str,
        workers: int | None,
    ) -> None:
        _pillow()
        classes, self.paths, labels = scan(root)
        height, width = common_size(self.paths) if size is None else size
        opts = ImageOptions(height, width, channels, resize)
        self.classes: list[str] | None = classes
        self.labels: Index | None = labels
        if workers is None:
            workers = 0 if len(self.paths) < POOL_MIN_IMAGES else os.cpu_count() or 1
        self.opts, self.workers = opts, workers
        self.description = f"{root} ({len(classes)} classes)"
        self.n = len(self.paths)
        shape = (opts.channels, opts.height, opts.width)
        self.specs = {
            "data": TopSpec(shape, np.dtype(np.uint8)),
            "label": TopSpec((), np.dtype(np.int64)),
        }
        self.attrs: dict[str, Any] = {}
        self._pool: ProcessPoolExecutor | None = None

    def _tasks(self, order: Index, cuts: Sequence[int]) -> Iterator[Index]:
        start = 0
        for cut in cuts:
            for lo in range(start, cut, TASK_IMAGES):
                yield order[lo : min(lo + TASK_IMAGES, cut)]
            start = cut

    def _block(
        self, items: Index, result: tuple[np.ndarray, list[int], list[tuple[int, str]]]
    ) -> Block:
        images, good, bad = result
        assert self.labels is not None
        labels = self.labels[items[good]]
        skipped = [(self.paths[items[i]], why) for i, why in bad]
        return Block({"data": images, "label": labels}, len(items), skipped)

    def blocks(self, order: Index, cuts: Sequence[int]) -> Generator[Block, None, None]:
        tasks = self._tasks(order, cuts)
        if self.workers == 0:  # in this process (debugging; tiny inputs)
            for items in tasks:
                yield self._block(items, decode_images([self.paths[i] for i in items], self.opts))
            return
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
            )
        window: deque[tuple[Index, Future[Any]]] = deque()
        limit = 4 * self.workers  # tasks in flight: the workers never wait, memory stays bounded
        for items in tasks:
            window.append(
                (items, self._pool.submit(decode_images, [self.paths[i] for i in items], self.opts))
            )
            if len(window) >= limit:
                items, future = window.popleft()
                yield self._block(items, future.result())
        while window:
            items, future = window.popleft()
            yield self._block(items, future.result())

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
