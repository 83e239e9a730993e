"""The examples run, at small sizes, as a user runs them: each script in its own process.
(``train_torch.py`` runs as the last step of ``image_folder_to_training.py``.) Each starts an
interpreter and imports its libraries: they run in ``nox -s integration``."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asynchdf5._cli._sample import write_dataset

from .test_pack import make_image_folder

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(*args: object, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, *(str(a) for a in args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=EXAMPLES.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stdout


def needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


@pytest.fixture
def packed_images(tmp_path: Path) -> Path:
    """A packed image folder: packed/train.txt and packed/val.txt (3 classes)."""
    from asynchdf5._cli import main

    make_image_folder(tmp_path / "images", corrupt=False)
    out = tmp_path / "packed"
    assert main([
        "pack", str(tmp_path / "images"), str(out), "--size", "16", "--shuffle", "--val", "0.2"
    ]) == 0  # fmt: skip
    return out


@pytest.mark.timeout(120)
def test_sync_loop(tmp_path: Path) -> None:
    source = write_dataset(tmp_path, 3000, 2, 0)
    out = run_example(EXAMPLES / "sync_loop.py", source, "--epochs", 2, "--batch-size", 100)
    assert out.count("every sample seen exactly once") == 2
    assert "bottleneck:" in out


@pytest.mark.timeout(120)
def test_train_trio(packed_images: Path) -> None:
    needs("trio")
    out = run_example(
        EXAMPLES / "train_trio.py", packed_images / "train.txt", "--epochs", 3, "--classes", 3
    )
    accuracies = [float(a) for a in re.findall(r"training accuracy ([\d.]+)", out)]
    assert len(accuracies) == 3


@pytest.mark.timeout(180)
def test_image_folder_to_training(tmp_path: Path) -> None:
    needs("PIL")
    out = run_example(
        EXAMPLES / "image_folder_to_training.py",
        tmp_path,
        "--make-images",
        60,
        "--size",
        16,
        "--epochs",
        1,
        timeout=180,
    )
    for command in ("$ asynchdf5 pack", "$ asynchdf5 inspect", "$ asynchdf5 bench"):
        assert command in out
    # Mapped by default where the folder is local (mmap="auto"), else read by pread.
    assert "OK: the layer " in out and "reads data by pread, label by pread" in out
    assert "bottleneck:" in out
    if importlib.util.find_spec("torch") is not None:  # train_torch.py, with validation
        assert "3 classes, 3 channel(s)" in out
        assert re.search(r"epoch 0: loss [\d.]+ .*validation accuracy [\d.]+", out)
    else:  # sync_loop.py
        assert "every sample seen exactly once" in out
