"""``asynchdf5 pack`` of HDF5 files with h5py variable-length tops (issue 41): streamed, a
block at a time, into scratch files in the output folder, and written from there as ragged
groups (``data`` + ``indptr``) beside the other tops' rows, in bounded memory; the scratch is
gone afterwards, also after an error."""

from __future__ import annotations

import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from asynchdf5 import HDF5DataLayer
from asynchdf5._cli._pack import split

from ._helpers import peak_growth, run_main


def _vlen_files(tmp_path: Path, sizes: tuple[int, ...]) -> tuple[list[Path], list[np.ndarray]]:
    """Files of ``sizes`` rows: ``tokens`` (int32 rows of 0-6 values, some empty), ``label``
    (the sample's number over all files) and ``emb`` (the label, 3 times, float32)."""
    rng = np.random.default_rng(3)
    truth: list[np.ndarray] = []
    paths = []
    for k, n in enumerate(sizes):
        p = tmp_path / f"v{k}.h5"
        with h5py.File(p, "w") as f:
            d = f.create_dataset("tokens", (n,), dtype=h5py.vlen_dtype(np.int32))
            for i in range(n):
                row = rng.integers(0, 1000, rng.integers(0, 7) if i % 5 else 0).astype(np.int32)
                d[i] = row
                truth.append(row)
            f["label"] = np.arange(len(truth) - n, len(truth), dtype=np.int64)
            f["emb"] = np.repeat(f["label"][()][:, None], 3, axis=1).astype(np.float32)
        paths.append(p)
    return paths, truth


def _scratch(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(".pack-"))


@pytest.mark.timeout(60)
def test_pack_writes_every_variable_length_sample_once_in_the_seeded_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Several files (one of zero rows, empty rows), --shuffle --seed --val, files of 7
    samples: each file holds the rows the in-memory path wrote there (the split and the
    permutations drawn from the seed as it drew them), and the layer reads every sample once,
    its tokens beside its label."""
    paths, truth = _vlen_files(tmp_path, (30, 0, 25, 12))
    n, out = len(truth), tmp_path / "out"
    args = ["pack", *paths, out, "--tops", "tokens", "label", "emb", "--shuffle", "--seed", "5"]
    status, text, err = run_main([*args, "--val", "0.2", "--samples-per-file", "7"], capsys)
    assert status == 0, err
    assert f"packing {n} samples" in text and "tokens ragged, label, emb" in text
    rng = np.random.default_rng(5)
    train, val = split(n, None, 0.2, rng)
    expected = {"train": rng.permutation(train), "val": rng.permutation(val)}
    assert _scratch(out) == []
    for name, order in expected.items():
        files = (out / f"{name}.txt").read_text().split()
        assert files == [f"{name}-{k:05d}.h5" for k in range(-(-len(order) // 7))]
        for k, file in enumerate(files):
            with h5py.File(out / file) as f:
                assert f.attrs["shuffled"] and "asynchdf5" in str(f.attrs["packed_by"])
                want = order[7 * k : 7 * k + 7]
                np.testing.assert_array_equal(f["label"][()], want)
                np.testing.assert_array_equal(f["emb"][()], np.repeat(want[:, None], 3, 1))
                g = f["tokens"]
                assert set(g.keys()) == {"data", "indptr"} and dict(g.attrs) == {}
                data, indptr = g["data"], g["indptr"][()]
                assert data.dtype == np.int32 and indptr.dtype == np.int64
                assert data.chunks is None and f["label"].chunks is None
                lengths = [len(truth[r]) for r in want]
                np.testing.assert_array_equal(indptr, np.concatenate([[0], np.cumsum(lengths)]))
                values = np.concatenate([truth[r] for r in want])
                np.testing.assert_array_equal(data[()], values)
    for name, order in expected.items():
        seen: list[int] = []
        with HDF5DataLayer(out / f"{name}.txt", tops=("tokens", "label"), batch_size=4) as layer:
            for batch in layer:
                for label, row in zip(batch["label"], batch["tokens"], strict=True):
                    np.testing.assert_array_equal(row, truth[label])
                    seen.append(int(label))
        assert sorted(seen) == sorted(order.tolist())
    # In order and in one file when the samples fit (the default size of a file).
    status, _, err = run_main(["pack", *paths, tmp_path / "o2", "--tops", "tokens"], capsys)
    assert status == 0, err
    assert (tmp_path / "o2" / "train.txt").read_text().split() == ["train-00000.h5"]
    with h5py.File(tmp_path / "o2" / "train-00000.h5") as f:
        assert "shuffled" not in f.attrs
        np.testing.assert_array_equal(f["tokens/data"][()], np.concatenate(truth))


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_pack_of_variable_length_rows_runs_in_bounded_memory(tmp_path: Path) -> None:
    """64 MiB of variable-length values pack (shuffled) within 32 MiB more memory: each file
    is staged and each output file gathered a block at a time (reading them whole took over
    128 MiB: the rows, their concatenation, the Arrow table, the shuffled take)."""
    path = tmp_path / "v.h5"
    rows = 4096
    with h5py.File(path, "w") as f:
        d = f.create_dataset("tok", (rows,), dtype=h5py.vlen_dtype(np.int32))
        d[...] = [np.full(4096, i, np.int32) for i in range(rows)]
        f["label"] = np.arange(rows, dtype=np.int64)
    out = tmp_path / "out"
    grew = peak_growth(
        "import sys\nfrom asynchdf5._cli import main",
        "status = main(['pack', sys.argv[1], sys.argv[2], '--tops', 'tok', 'label', '--shuffle'])\n"
        "assert status == 0, status",
        [path, out],
        timeout=100,
    )
    assert grew < 32 << 20, f"packing grew the process by {grew >> 20} MiB"
    assert _scratch(out) == []
    with h5py.File(out / "train-00000.h5") as f:
        labels, indptr = f["label"][()], f["tok/indptr"][()]
        assert sorted(labels.tolist()) == list(range(rows))
        np.testing.assert_array_equal(indptr, np.arange(rows + 1) * 4096)
        for r in (0, 1, rows // 2, rows - 1):
            np.testing.assert_array_equal(f["tok/data"][indptr[r] : indptr[r + 1]], labels[r])


def test_pack_leaves_no_scratch_after_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A later file whose top holds variable-length strings is a PackError naming it and the
    top, as is a split that leaves no training sample (found once all is staged); neither
    leaves scratch files or packed files behind."""
    paths, _ = _vlen_files(tmp_path, (10, 8))
    bad = tmp_path / "strings.h5"
    with h5py.File(bad, "w") as f:
        f.create_dataset("tokens", data=["a", "bc"], dtype=h5py.string_dtype())
        f["label"] = np.arange(2, dtype=np.int64)
    out = tmp_path / "out"
    status, _, err = run_main(["pack", *paths, bad, out, "--tops", "tokens", "label"], capsys)
    assert status == 1
    assert "strings.h5: top 'tokens' holds variable-length" in err and "not numbers" in err, err
    assert sorted(p.name for p in out.iterdir()) == []
    status, _, err = run_main(["pack", *paths, out, "--tops", "tokens", "--val", "0.99"], capsys)
    assert status == 1 and "leave none for training" in err, err
    assert sorted(p.name for p in out.iterdir()) == []
