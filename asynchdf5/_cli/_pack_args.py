"""``asynchdf5 pack``'s command line: its arguments and their help, and the exit status (what
the packing does is in :mod:`._pack`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ._pack import pack
from ._pack_images import POOL_MIN_IMAGES
from ._pack_write import COMPRESSIONS, PackError
from ._util import fraction, non_negative, positive

__all__ = ["add_parser", "run"]


def add_parser(commands: Any) -> None:
    """Register ``pack`` with the command line's subcommands."""
    p = commands.add_parser(
        "pack",
        help="write HDF5 training files that load fast (from images, arrays, tables or HDF5)",
        description=(
            "Write training files that load fast, and the source list naming them (train.txt; "
            "val.txt with --val), into OUT_DIR. INPUT is an image folder (one subfolder per "
            "class), .npy or .npz files, CSV or Parquet tables, or HDF5 files (or a source list) "
            "to repack. Files are written under a temporary name and renamed when complete."
        ),
    )
    p.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="what to pack")
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the folder to write to")
    g = p.add_argument_group("output")
    g.add_argument(
        "--samples-per-file",
        type=positive,
        metavar="N",
        help="samples per output file (default: about 1 GiB of samples per file)",
    )
    g.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="write the samples in a random order (recommended for class-sorted inputs such as "
        "image folders; default: input order)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of --shuffle and --val (default: 0)")
    g.add_argument(
        "--val",
        type=fraction,
        default=0.0,
        metavar="FRACTION",
        help="hold out this fraction of the samples (of each class, when labels are known) as "
        "a validation set: val-*.h5 and val.txt (default: 0)",
    )
    g.add_argument(
        "--compression",
        choices=COMPRESSIONS,
        default="none",
        help="none (contiguous; fastest to read), gzip, or lz4 (Blosc-LZ4) and zstd (these "
        "two need the `codecs` extra); compressed tops are chunked, whole samples per chunk, "
        "about 2 MiB per chunk (default: none)",
    )
    g.add_argument("--level", type=non_negative, help="compression level (default: the codec's)")
    g.add_argument(
        "--overwrite", action="store_true", help="replace the files of an earlier pack in OUT_DIR"
    )
    g = p.add_argument_group("image folders")
    g.add_argument(
        "--size",
        type=positive,
        nargs="+",
        metavar="PIXELS",
        help="HEIGHT [WIDTH] every image is resized to (default: the images' own size, when "
        "they all have the same one)",
    )
    g.add_argument(
        "--channels", type=int, choices=(1, 3), default=3, help="3: RGB; 1: grayscale (default: 3)"
    )
    g.add_argument(
        "--resize",
        choices=("crop", "stretch"),
        default="crop",
        help="crop: keep the aspect ratio and crop the middle; stretch: ignore it (default: crop)",
    )
    g.add_argument(
        "--workers",
        type=non_negative,
        help="processes that decode images (default: one per core, or none for fewer than "
        f"{POOL_MIN_IMAGES} images; 0: in this process)",
    )
    g.add_argument(
        "--on-error",
        choices=("stop", "skip"),
        default="stop",
        help="an image that cannot be read stops the pack, or is skipped (reported by path); "
        "default: stop",
    )
    g = p.add_argument_group(".npy files")
    g.add_argument(
        "--labels", type=Path, nargs="+", metavar="NPY", help=".npy files of the labels (`label`)"
    )
    g = p.add_argument_group("CSV and Parquet tables")
    g.add_argument(
        "--columns",
        nargs="+",
        metavar="COLUMN",
        help="feature columns, stored as `data` of shape (rows, columns) (default: every "
        "numeric column but the label)",
    )
    g.add_argument("--label-column", metavar="COLUMN", help="the column stored as `label`")
    g.add_argument(
        "--dtype", default="float32", help="dtype of the feature columns (default: float32)"
    )
    g = p.add_argument_group("HDF5 files")
    g.add_argument(
        "--tops", nargs="+", metavar="TOP", help="datasets to repack (default: data label)"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        return pack(args)
    except PackError as exc:
        print(f"asynchdf5 pack: error: {exc}", file=sys.stderr)
        return 1
