"""``asynchdf5 pack`` end to end: real inputs (an image folder of PNG and JPEG files made with
Pillow, .npy, .npz, CSV, Parquet, HDF5) packed, inspected, and loaded by the layer with every
sample checked exactly once; compression, the split, errors, and an interrupted pack."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from asynchdf5 import HDF5DataLayer

from ._helpers import run_main

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CLASSES = ("bird", "cat", "dog")  # sorted: label k is CLASSES[k]
PER_CLASS = 9


@pytest.fixture(scope="module", autouse=True)
def process_wide_helpers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Started before any test's leak check takes its snapshot, being process-wide by design
    and not the pack's to close: multiprocessing's resource tracker (a helper process, with a
    pipe open for the rest of the process's life), which the image decoders' process pool
    starts; and pyarrow's self-pipe for Ctrl-C, which its first CSV read opens."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    if has_module("pyarrow"):
        path = tmp_path_factory.mktemp("warm") / "warm.csv"
        path.write_text("a\n1\n")
        importlib.import_module("pyarrow.csv").read_csv(path)


def has_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


# --- an image folder whose every image says who it is ------------------------------------------


def color_of(label: int, i: int) -> tuple[int, int, int]:
    """Image ``i`` of class ``label`` is this solid color: red encodes ``i``, green the class
    (spaced out so that JPEG's small errors cannot blur one into another)."""
    return (8 * i + 4, 60 * label + 20, 128)


def make_image_folder(root: Path, *, corrupt: bool = True) -> dict[tuple[int, int], str]:
    """Images of odd sizes in PNG and JPEG, in every Pillow mode a folder holds (RGB, RGBA,
    palette, grayscale), some in a nested folder; plus a corrupt JPEG, a text file and a hidden
    file, which are not samples. Returns (label, i) -> path of every good image."""
    good: dict[tuple[int, int], str] = {}
    for label, name in enumerate(CLASSES):
        folder = root / name
        (folder / "more").mkdir(parents=True)
        for i in range(PER_CLASS):
            size = (13 + 7 * i, 29 - 2 * i)  # odd sizes, wide and tall
            im = Image.new("RGB", size, color_of(label, i))
            if i == 3:  # grayscale: red = green = blue = the red value
                im, suffix = Image.new("L", size, color_of(label, i)[0]), ".png"
            elif i == 4:
                im, suffix = im.convert("RGBA"), ".png"
            elif i == 5:
                im, suffix = im.convert("P"), ".png"
            else:
                suffix = ".jpg" if i % 2 else ".png"
            where = folder / "more" if i == 7 else folder
            path = where / f"img{i:02d}{suffix.upper() if i == 8 else suffix}"
            im.save(path, quality=95) if suffix == ".jpg" else im.save(path)
            good[(label, i)] = str(path)
        (folder / "notes.txt").write_text("not an image")
        (folder / ".hidden.png").write_bytes(b"")
    if corrupt:
        (root / "dog" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a JPEG")
    return good


def identify(data: np.ndarray, labels: np.ndarray) -> list[tuple[int, int]]:
    """(label, i) of each sample, from its pixels; checks the colour says the same class."""
    out = []
    for image, label in zip(data, labels, strict=True):
        red, green = float(image[0].mean()), float(image[1].mean())
        i = round((red - 4) / 8)
        assert abs(red - (8 * i + 4)) < 3, red
        if abs(red - green) > 3:  # a colour image: green says the class
            assert round((green - 20) / 60) == label, (green, label)
        out.append((int(label), i))
    return out


def epoch(
    source: Path | Sequence[str], tops: Sequence[str] = ("data", "label"), **kw: Any
) -> dict[str, np.ndarray]:
    """One shuffled epoch through the layer: every top's rows in the order served, with the
    global indices, each checked to come exactly once."""
    rows: dict[str, list[np.ndarray]] = {t: [] for t in (*tops, "indices")}
    with HDF5DataLayer(source, batch_size=5, tops=tuple(tops), shuffle=True, seed=3, **kw) as layer:
        n = layer.n_samples
        for batch in layer:
            for t in tops:
                rows[t].append(np.array(batch[t]))
            rows["indices"].append(np.array(batch.indices))
    out = {k: np.concatenate(v) for k, v in rows.items()}
    np.testing.assert_array_equal(np.sort(out["indices"]), np.arange(n))
    return out


def inspect_json(source: Path, capsys: pytest.CaptureFixture[str], *tops: str) -> dict[str, Any]:
    status, out, _ = run_main(
        ["inspect", source, "--json", *(["--tops", *tops] if tops else [])], capsys
    )
    doc: dict[str, Any] = json.loads(out)
    assert status == (0 if doc["ok"] else 1)
    return doc


def no_leftovers(folder: Path) -> None:
    """No temporary file of a pack is left."""
    hidden = [p.name for p in folder.iterdir() if p.name.startswith(".") or p.suffix == ".tmp"]
    assert not hidden, hidden


# --- image folders -----------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_image_folder_packed_inspected_and_loaded_exactly_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = make_image_folder(tmp_path / "images")
    out = tmp_path / "packed"
    status, stdout, stderr = run_main(
        ["pack", tmp_path / "images", out, "--size", 16, 20, "--shuffle", "--seed", 1,
         "--val", 0.25, "--on-error", "skip", "--samples-per-file", 7, "--workers", 2],
        capsys,
    )  # fmt: skip
    assert status == 0, stderr
    assert "skipped" in stderr and str(tmp_path / "images" / "dog" / "corrupt.jpg") in stderr
    assert "classes (3" in stdout
    no_leftovers(out)
    train = (out / "train.txt").read_text().split()
    val = (out / "val.txt").read_text().split()
    assert train[0] == "train-00000.h5" and val[0] == "val-00000.h5"
    for name in train + val:
        with h5py.File(out / name, "r") as f:
            assert list(f.attrs["classes"]) == list(CLASSES)
            assert f["data"].dtype == np.uint8 and f["data"].shape[1:] == (3, 16, 20)
            assert f["label"].dtype == np.int64
            assert f["data"].chunks is None and f["label"].chunks is None  # contiguous
            assert len(f["data"]) <= 7
    # inspect: the table and the JSON agree with the layer: direct reads, no problems.
    doc = inspect_json(out / "train.txt", capsys)
    assert doc["ok"] and doc["read_paths"] == {"data": "pread", "label": "pread"}
    assert doc["files"][0]["tops"][0]["sample_shape"] == [3, 16, 20]
    status, table, _ = run_main(["inspect", out / "train.txt"], capsys)
    assert status == 0 and "direct read (pread)" in table and "OK: the layer " in table
    # Every good image exactly once over train + val, with its own label; val is stratified.
    seen = {}
    for split in ("train", "val"):
        rows = epoch(out / f"{split}.txt")
        ids = identify(rows["data"], rows["label"])
        assert len(set(ids)) == len(ids)
        seen[split] = set(ids)
    assert not seen["train"] & seen["val"]
    assert seen["train"] | seen["val"] == set(good)
    assert {label for label, _ in seen["val"]} == {0, 1, 2}
    # A quarter of each class's 9 or 10 items (the corrupt image counts, then is skipped).
    assert len(seen["val"]) in (5, 6)


@pytest.mark.timeout(60)
def test_image_folder_as_a_subprocess_stops_at_a_corrupt_image(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "images")
    out = tmp_path / "packed"
    proc = subprocess.run(
        [sys.executable, "-m", "asynchdf5", "pack", str(tmp_path / "images"), str(out),
         "--size", "8", "--channels", "1", "--workers", "1"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert str(tmp_path / "images" / "dog" / "corrupt.jpg") in proc.stderr
    assert "--on-error skip" in proc.stderr
    assert not (out / "train.txt").exists()  # an incomplete pack names no files
    no_leftovers(out)
    # The same in grayscale, skipping it: 1 channel, every class.
    proc = subprocess.run(
        [sys.executable, "-m", "asynchdf5", "pack", str(tmp_path / "images"), str(out),
         "--size", "8", "--channels", "1", "--on-error", "skip", "--overwrite",
         "--resize", "stretch"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = epoch(out / "train.txt")
    assert rows["data"].shape[1:] == (1, 8, 8)
    assert sorted(np.bincount(rows["label"])) == [PER_CLASS] * 3


def test_image_folder_options_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "images").mkdir()
    status, _, err = run_main(["pack", tmp_path / "images", tmp_path / "out", "--size", 8], capsys)
    assert status == 1 and "no class subfolders" in err
    make_image_folder(tmp_path / "images2", corrupt=False)
    status, _, err = run_main(["pack", tmp_path / "images2", tmp_path / "out"], capsys)
    assert status == 1 and "the images differ in size" in err and "give --size" in err
    status, _, err = run_main(
        ["pack", tmp_path / "images2", tmp_path / "out", "--size", 8, "--labels", "x.npy"], capsys
    )
    assert status == 1 and "--labels does not apply to images" in err


def test_image_folder_of_one_size_needs_no_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every image is 12 high and 20 wide as decoded: PNG, JPEG, and a JPEG stored 20 high and
    # 12 wide whose EXIF orientation (6: turned a quarter) makes it 12 x 20 too.
    root = tmp_path / "images"
    for label, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(4):
            im = Image.new("RGB", (20, 12), color_of(label, i))
            if i == 3:
                exif = Image.Exif()
                exif[0x0112] = 6
                im.transpose(Image.Transpose.ROTATE_90).save(
                    root / name / f"{i}.jpg", quality=95, exif=exif
                )
            else:
                im.save(root / name / (f"{i}.jpg" if i % 2 else f"{i}.png"), quality=95)
    status, stdout, err = run_main(["pack", root, tmp_path / "out", "--workers", 0], capsys)
    assert status == 0, err
    assert "data uint8(3, 12, 20)" in stdout
    rows = epoch(tmp_path / "out" / "train.txt")
    assert sorted(identify(rows["data"], rows["label"])) == [
        (label, i) for label in range(len(CLASSES)) for i in range(4)
    ]
    # One image of another size: refused, naming it and the first image, with both sizes.
    Image.new("RGB", (21, 12), color_of(1, 9)).save(root / CLASSES[1] / "9.png")
    status, _, err = run_main(["pack", root, tmp_path / "out2"], capsys)
    assert status == 1
    for part in (
        f"the images differ in size: {root / CLASSES[0] / '0.png'} is 12x20 and",
        f"{root / CLASSES[1] / '9.png'} is 12x21 (height x width)",
        "give --size HEIGHT [WIDTH]",
    ):
        assert part in err, err
    # --size still resizes them all.
    status, stdout, err = run_main(["pack", root, tmp_path / "out2", "--size", 6, 10], capsys)
    assert status == 0 and "data uint8(3, 6, 10)" in stdout, err


# --- arrays, tables, HDF5 ----------------------------------------------------------------------


def test_npy_with_labels_shuffled_and_gzip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n = 1000
    index = np.arange(n)
    data = (index[:, None, None] + np.zeros((1, 4, 5))).astype(np.float32)
    np.save(tmp_path / "a.npy", data[:600])
    np.save(tmp_path / "b.npy", data[600:])
    np.save(tmp_path / "labels.npy", index % 7)
    out = tmp_path / "out"
    status, stdout, err = run_main(
        ["pack", tmp_path / "a.npy", tmp_path / "b.npy", out, "--labels", tmp_path / "labels.npy",
         "--shuffle", "--compression", "gzip", "--samples-per-file", 300],
        capsys,
    )  # fmt: skip
    assert status == 0, err
    assert "data: chunked, gzip; label: contiguous" in stdout
    names = (out / "train.txt").read_text().split()
    assert len(names) == 4
    with h5py.File(out / names[0], "r") as f:
        assert f["data"].compression == "gzip" and f["data"].chunks[1:] == (4, 5)
        assert f["data"][:].mean(axis=(1, 2)).tolist() != sorted(f["data"][:].mean(axis=(1, 2)))
    doc = inspect_json(out / "train.txt", capsys)
    assert doc["read_paths"] == {"data": "chunks", "label": "pread"}
    assert doc["hints"] == []  # one chunk per file here: no seek per read
    rows = epoch(out / "train.txt")
    original = rows["data"][:, 0, 0].astype(np.int64)
    assert sorted(original) == list(range(n))
    np.testing.assert_array_equal(rows["label"], original % 7)


def test_npz_arrays_become_tops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = np.arange(200, dtype=np.int32).reshape(100, 2)
    np.savez(tmp_path / "part.npz", x=x, y=np.arange(100) * 3)
    out = tmp_path / "out"
    status, _, err = run_main(
        ["pack", tmp_path / "part.npz", out, "--val", 0.1, "--seed", 5], capsys
    )
    assert status == 0, err
    train = epoch(out / "train.txt", tops=("x", "y"))
    val = epoch(out / "val.txt", tops=("x", "y"))
    assert len(val["y"]) == 10
    both = np.concatenate([train["x"], val["x"]])
    np.testing.assert_array_equal(np.sort(both[:, 0]), np.arange(0, 200, 2))
    np.testing.assert_array_equal(np.concatenate([train["y"], val["y"]]), both[:, 0] // 2 * 3)
    doc = inspect_json(out / "train.txt", capsys, "x", "y")
    assert doc["ok"] and doc["samples"] == 90
    status, _, err = run_main(["pack", tmp_path / "part.npz", out], capsys)
    assert status == 1 and "--overwrite" in err  # an earlier pack is not replaced silently


def write_table(path: Path, n: int) -> None:
    """A table with an id, two features, a string label and a text column."""
    # pyarrow has no type information: its modules are Any here.
    pa = importlib.import_module("pyarrow")

    species = np.array(["setosa", "virginica", "versicolor"])
    table = pa.table(
        {
            "id": np.arange(n),
            "width": np.arange(n) * 0.5,
            "height": np.arange(n) % 11,
            "species": species[np.arange(n) % 3],
            "note": [f"row {i}" for i in range(n)],
        }
    )
    if path.suffix == ".csv":
        importlib.import_module("pyarrow.csv").write_csv(table, path)
    else:
        importlib.import_module("pyarrow.parquet").write_table(table, path)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str) -> None:
    pytest.importorskip("pyarrow")
    path = tmp_path / f"table{suffix}"
    write_table(path, 90)
    out = tmp_path / "out"
    status, _, err = run_main(
        ["pack", path, out, "--columns", "id", "width", "height", "--label-column", "species",
         "--shuffle", "--samples-per-file", 40],
        capsys,
    )  # fmt: skip
    assert status == 0, err
    with h5py.File(out / "train-00000.h5", "r") as f:
        assert list(f.attrs["classes"]) == ["setosa", "versicolor", "virginica"]
        assert list(f.attrs["columns"]) == ["id", "width", "height"]
        assert f["data"].dtype == np.float32 and f["data"].shape[1:] == (3,)
    rows = epoch(out / "train.txt")
    ids = rows["data"][:, 0].astype(np.int64)
    assert sorted(ids) == list(range(90))
    np.testing.assert_array_equal(rows["data"][:, 1], ids * 0.5)
    names = ["setosa", "versicolor", "virginica"]
    expected = [names.index(["setosa", "virginica", "versicolor"][i % 3]) for i in ids]
    np.testing.assert_array_equal(rows["label"], expected)
    # Without --columns: every numeric column but the label; a text column is refused by name.
    status, _, err = run_main(["pack", path, tmp_path / "o2", "--label-column", "id"], capsys)
    assert status == 0, err
    with h5py.File(tmp_path / "o2" / "train-00000.h5", "r") as f:
        assert list(f.attrs["columns"]) == ["width", "height"] and f["label"].dtype == np.int64
    status, _, err = run_main(["pack", path, tmp_path / "o3", "--columns", "note"], capsys)
    assert status == 1 and "'note'" in err


@pytest.mark.parametrize("shuffle", [False, True])
def test_hdf5_repacked_from_tiny_chunks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], shuffle: bool
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    names = []
    for k in range(2):
        names.append(f"slow{k}.h5")
        with h5py.File(src / names[-1], "w") as f:
            idx = np.arange(k * 300, (k + 1) * 300)
            f.create_dataset(
                "data",
                data=np.repeat(idx, 48).reshape(300, 3, 4, 4).astype(">f4"),
                chunks=(1, 3, 4, 4),
            )
            f.create_dataset("label", data=idx, chunks=(10,))
            f.attrs["classes"] = ["a", "b"]
    (src / "list.txt").write_text("\n".join(names))
    doc = inspect_json(src / "list.txt", capsys)
    assert doc["read_paths"] == {"data": "chunks", "label": "chunks"}
    assert any("1 sample" in h and "per chunk" in h for h in doc["hints"])  # 192-byte chunks
    out = tmp_path / "out"
    status, _, err = run_main(
        [
            "pack",
            src / "list.txt",
            out,
            *(["--shuffle"] if shuffle else []),
            "--samples-per-file",
            250,
        ],
        capsys,
    )
    assert status == 0, err
    no_leftovers(out)  # the shuffled repack's staging copies are gone
    doc = inspect_json(out / "train.txt", capsys)
    assert doc["read_paths"] == {"data": "pread", "label": "pread"} and doc["hints"] == []
    assert doc["files"][0]["tops"][0]["dtype"] == "float32"  # native byte order
    rows = epoch(out / "train.txt")
    np.testing.assert_array_equal(rows["data"][:, 0, 0, 0], rows["label"])
    assert sorted(rows["label"]) == list(range(600))
    with h5py.File(out / "train-00000.h5", "r") as f:
        assert list(f.attrs["classes"]) == ["a", "b"]
        first = f["label"][:10]
    assert (list(first) == list(range(10))) != shuffle


# --- compression -------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["none", "gzip", "lz4", "zstd"])
def test_compression_layouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], codec: str
) -> None:
    if codec in ("lz4", "zstd") and not has_module("hdf5plugin"):
        pytest.skip("hdf5plugin is not installed")
    n = 3000
    data = np.arange(n * 3 * 32 * 32, dtype=np.int64).reshape(n, 3, 32, 32) // 1000 % 251
    np.save(tmp_path / "x.npy", data.astype(np.uint16))
    np.save(tmp_path / "y.npy", np.arange(n))
    out = tmp_path / "out"
    status, _, err = run_main(
        ["pack", tmp_path / "x.npy", out, "--labels", tmp_path / "y.npy", "--compression", codec],
        capsys,
    )
    assert status == 0, err
    with h5py.File(out / "train-00000.h5", "r") as f:
        d = f["data"]
        if codec == "none":
            assert d.chunks is None
        else:
            # Whole samples per chunk, about 2 MiB: the layer's raw-chunk path, large reads.
            assert d.chunks[1:] == (3, 32, 32)
            assert 2**20 <= d.chunks[0] * 3 * 32 * 32 * 2 <= 4 * 2**20
        assert f["label"].chunks is None  # 8 bytes a sample: never worth compressing
    doc = inspect_json(out / "train.txt", capsys)
    decoders = {"lz4": "numcodecs", "zstd": "numcodecs"}
    fast = has_module(decoders.get(codec, "numpy"))
    expected = "pread" if codec == "none" else ("chunks" if fast else "h5py")
    assert doc["read_paths"]["data"] == expected
    rows = epoch(out / "train.txt")
    np.testing.assert_array_equal(rows["data"], data[rows["label"]])


def test_compression_needs_hdf5plugin_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from asynchdf5._cli._pack_write import Compression

    if has_module("hdf5plugin"):
        Compression("zstd")  # accepted
        pytest.skip("hdf5plugin is installed: the message is for when it is not")
    status, _, err = run_main(["pack", "x.npy", tmp_path, "--compression", "zstd"], capsys)
    assert status == 1 and '".[codecs]"' in err


# --- files under their final names are whole ---------------------------------------------------


@pytest.mark.timeout(90)
def test_interrupted_pack_leaves_no_half_written_file(tmp_path: Path) -> None:
    n, per_file = 24_000, 500
    rng = np.random.default_rng(0)  # random bytes: gzip is slow on them, so the pack takes time
    np.save(tmp_path / "x.npy", rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8))
    np.save(tmp_path / "y.npy", np.arange(n))
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "asynchdf5", "pack", str(tmp_path / "x.npy"), str(out),
         "--labels", str(tmp_path / "y.npy"), "--samples-per-file", str(per_file),
         "--compression", "gzip", "--level", "6"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        # Wait until some files are final and one is being written, then Ctrl-C.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            names = os.listdir(out) if out.exists() else []
            if "train-00001.h5" in names and any(p.endswith(".tmp") for p in names):
                break
            time.sleep(0.005)
        assert proc.poll() is None, "the pack ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        _stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "asynchdf5 pack: interrupted (SIGINT)"
    assert "Traceback" not in stderr
    no_leftovers(out)
    assert not (out / "train.txt").exists()
    finals = sorted(out.glob("train-*.h5"))
    assert 2 <= len(finals) < n // per_file
    for k, path in enumerate(finals):  # each whole: every row, the right ones
        with h5py.File(path, "r") as f:
            np.testing.assert_array_equal(
                f["label"][:], np.arange(k * per_file, (k + 1) * per_file)
            )
            assert f["data"].shape == (per_file, 3, 32, 32)
            f["data"][-1]  # the last chunk decodes
