"""The command line: ``inspect`` (read paths, hints and problems in the layer's own words, as a
table and as JSON), ``bench`` end to end, ``demo`` ended by Ctrl-C, SIGTERM or SIGHUP, and what
every command shares (signals, exit statuses)."""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import h5py
import numpy as np
import pytest

from asynchdf5 import DataLayerError, HDF5DataLayer
from asynchdf5._cli._hints import SEEK_BYTES
from asynchdf5._cli._util import run_async, size_in_bytes

from ._files import LAYOUTS, N, write_h5, write_source
from ._helpers import run_main

REPO = Path(__file__).resolve().parent.parent


def inspect_json(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, dict[str, Any]]:
    status, out, _ = run_main(["inspect", "--json", *args], capsys)
    doc: dict[str, Any] = json.loads(out)
    return status, doc


def layer_error(source: Path | list[str]) -> str:
    """The message the layer raises for ``source`` (at construction or at ``with``)."""
    with pytest.raises(DataLayerError) as info:
        with HDF5DataLayer(source, batch_size=4):
            pass
    return str(info.value)


# --- inspect -----------------------------------------------------------------------------------

TOP_KEYS = {
    "name", "rows", "sample_shape", "dtype", "bytes", "stored_bytes", "storage", "chunk_shape",
    "chunk_bytes", "filters", "read_path", "reason", "hints", "stored_in", "error", "form",
    "form_note",
}  # fmt: skip
DOC_KEYS = {
    "format", "source", "tops", "ok", "samples", "sample_bytes", "sample_bytes_vary", "bytes",
    "read_paths", "mmap", "files", "hints", "problems", "offered",
}  # fmt: skip


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_inspect_shows_the_layers_read_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str
) -> None:
    source, paths = write_source(tmp_path, layout=layout)
    status, doc = inspect_json(capsys, source)
    assert status == 0 and doc["ok"] and doc["problems"] == []
    assert set(doc) == DOC_KEYS and doc["format"] == "asynchdf5.inspect/1"
    assert doc["samples"] == N and doc["sample_bytes"] == 2 * 4 + 8
    assert doc["read_paths"]["data"] == LAYOUTS[layout]  # the layer's own choice
    assert [f["path"] for f in doc["files"]] == [str(p) for p in paths]
    top = doc["files"][0]["tops"][0]
    assert set(top) == TOP_KEYS
    assert top["name"] == "data" and top["rows"] == 100 and top["sample_shape"] == [2]
    assert top["dtype"] == "float32" and top["bytes"] == 800 and top["reason"]
    if layout.endswith("-split"):
        assert top["read_path"] == "chunks" and top["chunk_shape"] == [8, 1]
        assert "band" in top["reason"]
        assert any("splits each sample" in h and "asynchdf5 pack" in h for h in top["hints"])
    if layout == "gzip":
        assert top["filters"] == ["shuffle", "gzip"] or "gzip" in top["filters"]
    status, text, _ = run_main(["inspect", source], capsys)
    assert status == 0
    assert f"source {source}: 3 files, {N} samples of 16 bytes" in text
    assert re.search(r"data\s+100\s+\(2\)\s+float32", text)
    if layout in ("contiguous", "chunked"):  # mapped by default (mmap="auto"): local, leased
        assert "OK: the layer maps the file" in text
        assert f"reads data by {LAYOUTS[layout]}" in text
    else:
        assert "OK: the layer reads data by " + LAYOUTS[layout] in text


@pytest.mark.parametrize(("chunks", "hint"), [((313, 63), False), ((16, 8), True)])
def test_split_sample_chunks_are_read_in_bands_and_hinted_only_when_small(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chunks: tuple[int, int], hint: bool
) -> None:
    """AnnData's gzip ``X`` (chunks of 313 x 63) is read a band at a time, as fast as whole-sample
    chunks of its rows: repacking would not pay. Chunks of a few KiB still cost a call each."""
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f.create_dataset(
            "data", data=np.zeros((700, 100), np.float32), chunks=chunks, compression="gzip"
        )
        f.create_dataset("label", data=np.arange(700))
    status, doc = inspect_json(capsys, tmp_path / "x.h5")
    assert status == 0
    data = doc["files"][0]["tops"][0]
    assert data["read_path"] == "chunks" and "band" in data["reason"]
    assert bool(data["hints"]) is hint
    assert not hint or "splits each sample" in data["hints"][0]


def test_small_chunks_not_adjacent_in_the_file_are_a_seek_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with h5py.File(tmp_path / "rev.h5", "w") as f:
        d = f.create_dataset("data", (64, 8), np.float32, chunks=(4, 8))
        other = f.create_dataset("other", (0,), np.uint8, chunks=(256,), maxshape=(None,))
        for r in range(0, 64, 4):  # a chunk of another dataset after each one
            d[r : r + 4] = r
            other.resize((other.shape[0] + 256,))
            other[-256:] = 1
            f.flush()
        f.create_dataset("label", data=np.arange(64, dtype=">i8"))  # swapped: copied, not mapped
    status, doc = inspect_json(capsys, tmp_path / "rev.h5")
    assert status == 0 and doc["mmap"].startswith("copied")
    data = doc["files"][0]["tops"][0]
    assert data["read_path"] == "chunks" and "every read is a seek" in data["hints"][0]


def test_small_chunks_served_mapped_are_not_hinted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Mapped, rows are taken where they lie in the chunks: the per-chunk cost that the hint
    describes is the copying reader's, so the hint shows only where the source is copied."""
    with h5py.File(tmp_path / "m.h5", "w") as f:
        f.create_dataset("data", data=np.zeros((64, 8), np.float32), chunks=(4, 8))
        f.create_dataset("label", data=np.arange(64))
    status, doc = inspect_json(capsys, tmp_path / "m.h5")
    assert status == 0 and doc["mmap"].startswith("mapped")
    data = doc["files"][0]["tops"][0]
    assert data["read_path"] == "chunks" and data["chunk_bytes"] == 128 < SEEK_BYTES
    assert data["hints"] == [] and doc["hints"] == []
    status, text, _ = run_main(["inspect", tmp_path / "m.h5"], capsys)
    assert status == 0 and "OK: the layer maps the file" in text and "hints:" not in text


def test_inspect_hints_for_slow_layouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    n = 400
    with h5py.File(tmp_path / "slow.h5", "w") as f:
        f.create_dataset("data", data=np.zeros((n, 3, 8, 8), np.uint8), chunks=(1, 3, 8, 8))
        f.create_dataset("label", data=np.arange(n, dtype=">i8"))  # big-endian: swapped
    status, doc = inspect_json(capsys, tmp_path / "slow.h5")
    assert status == 0
    data, label = doc["files"][0]["tops"]
    assert data["read_path"] == "chunks" and data["chunk_bytes"] == 192 < SEEK_BYTES
    assert doc["hints"] == ["data: " + data["hints"][0]]
    assert "(1, 3, 8, 8)" in data["hints"][0]  # written in order: adjacent, one request
    assert "each is planned and copied" in data["hints"][0]
    assert label["read_path"] == "pread" and "swapped" in label["reason"]
    status, text, _ = run_main(["inspect", tmp_path / "slow.h5"], capsys)
    assert "hints:\n  data: chunk shape (1, 3, 8, 8) is 1 sample" in text


def test_inspect_plugin_filter_without_a_fast_decoder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hdf5plugin = pytest.importorskip("hdf5plugin")
    with h5py.File(tmp_path / "zfp.h5", "w") as f:
        zfp = hdf5plugin.Zfp(reversible=True)
        f.create_dataset("data", data=np.zeros((100, 64)), chunks=(50, 64), **zfp)
        f.create_dataset("label", data=np.arange(100))
    status, doc = inspect_json(capsys, tmp_path / "zfp.h5")
    assert status == 0  # slow, but the layer reads it
    top = doc["files"][0]["tops"][0]
    assert top["read_path"] == "h5py" and top["filters"] == ["zfp"]
    assert "zfp" in top["reason"]
    assert "asynchdf5 pack --compression gzip" in top["hints"][0]


def test_inspect_external_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_h5(tmp_path / "target.h5", 0, 50)
    with h5py.File(tmp_path / "links.h5", "w") as f:
        f["data"] = h5py.ExternalLink("target.h5", "/data")
        f["label"] = h5py.ExternalLink("target.h5", "/label")
    status, doc = inspect_json(capsys, tmp_path / "links.h5")
    assert status == 0 and doc["read_paths"] == {"data": "pread", "label": "pread"}
    assert doc["files"][0]["tops"][0]["stored_in"] == str(tmp_path / "target.h5")


def test_inspect_reports_problems_in_the_layers_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_h5(tmp_path / "a.h5", 0, 10)
    write_h5(tmp_path / "wide.h5", 10, 10, data=np.zeros((10, 3), np.float32))
    write_h5(tmp_path / "nolabel.h5", 20, 10, label=None, other=np.arange(10))
    (tmp_path / "notes.h5").write_text("not HDF5")
    cases = {
        "shape": ["a.h5", "wide.h5"],
        "missing top": ["a.h5", "nolabel.h5"],
        "not hdf5": ["a.h5", "notes.h5"],
        "missing file": ["a.h5", "gone.h5"],
    }
    for case, names in cases.items():
        source = tmp_path / f"{case}.txt"
        source.write_text("\n".join(names))
        expected = layer_error(source)
        status, doc = inspect_json(capsys, source)
        assert status == 1 and not doc["ok"], case
        assert expected in doc["problems"], (case, expected, doc["problems"])
        status, text, err = run_main(["inspect", source], capsys)
        assert status == 1 and expected in text and "FAILED" in text and not err
    status, doc = inspect_json(capsys, tmp_path / "nowhere.txt")  # no source at all
    assert status == 1 and doc["problems"] == [layer_error(tmp_path / "nowhere.txt")]
    assert doc["files"] == []


def test_inspect_several_files_and_tops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, paths = write_source(tmp_path)
    status, doc = inspect_json(capsys, *paths, "--tops", "label")
    assert status == 0 and doc["tops"] == ["label"] and doc["sample_bytes"] == 8
    assert len(doc["files"]) == 3 and doc["samples"] == N


def test_inspect_ragged_top_speaks_of_values_and_average_sample_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ragged top's ``data`` rows are values, not samples: the header gives a sample's bytes
    on average (values' bytes over samples), and the chunk words count values."""
    lens = np.arange(500) % 7  # 3 values a row on average
    path = tmp_path / "r.h5"
    with h5py.File(path, "w") as f:
        g = f.create_group("tok")
        g.create_dataset("data", data=np.ones(int(lens.sum()), np.int32), chunks=(100,))
        g["indptr"] = np.concatenate([[0], np.cumsum(lens)])
        f["label"] = np.arange(500)
    status, doc = inspect_json(capsys, path, "--tops", "tok", "label")
    assert status == 0 and doc["samples"] == 500 and doc["sample_bytes_vary"] is True
    # A row's values (int32) on average, its offset in the batch (int64), and the label's.
    assert doc["sample_bytes"] == round(lens.sum() * 4 / 500 + 8 + 8)
    tok = doc["files"][0]["tops"][0]
    words = " ".join([tok["reason"], *tok["hints"]])
    assert "100 values" in words and "sample" not in words, words
    status, text, _ = run_main(["inspect", path, "--tops", "tok", "label"], capsys)
    assert f"500 samples of about {doc['sample_bytes']} bytes on average" in text
    status, doc = inspect_json(capsys, path, "--tops", "label")
    assert doc["sample_bytes"] == 8 and doc["sample_bytes_vary"] is False


# --- bench -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"chunks": (50,), "compression": "gzip"}])
def test_stored_ranges_of_a_sparse_top_hold_its_values_and_column_indices(
    tmp_path: Path, kw: dict[str, Any]
) -> None:
    """The raw read's ranges (``asynchdf5 bench`` and the benchmarks) hold every stored byte of
    a sparse top: its column indices besides its values, contiguous or chunked and filtered."""
    from asynchdf5._cli._limits import read_ranges, stored_ranges_of

    rng = np.random.default_rng(0)
    indptr = np.concatenate(([0], np.cumsum(rng.integers(0, 9, 300))))
    path = tmp_path / "cells.h5"
    with h5py.File(path, "w") as f:
        g = f.create_group("X")
        g.create_dataset("data", data=rng.random(indptr[-1], np.float32), **kw)
        g.create_dataset("indices", data=rng.integers(0, 40, indptr[-1], np.int32), **kw)
        g["indptr"] = indptr
        g.attrs["shape"], g.attrs["encoding-type"] = (300, 40), "csr_matrix"
        f["label"] = np.arange(300)
        stored = sum(f[n].id.get_storage_size() for n in ("X/data", "X/indices", "label"))
    ranges = stored_ranges_of([str(path)], ["X", "label"])
    assert sum(size for _, _, size in ranges) == stored
    assert read_ranges(ranges, memoryview(bytearray(4096)))[0] == stored


@pytest.mark.timeout(60)
def test_bench_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, _ = write_source(tmp_path)
    status, out, err = run_main(
        ["bench", source, "--json", "--batch-size", 32, "--chunk-size", 64, "--epochs", 2], capsys
    )
    assert status == 0, err
    doc = json.loads(out)
    assert doc["ok"] and doc["format"] == "asynchdf5.bench/1"
    assert doc["samples"] == N and doc["bytes"] == N * 16 and doc["stored_bytes"] == N * 16
    assert doc["properties"]["batch_size"] == 32 and doc["properties"]["chunk_size"] == 64
    layer = doc["layer"]
    assert [e["epoch"] for e in layer["epochs"]] == [1, 2]
    assert all(e["samples"] == N for e in layer["epochs"])
    for key in ("open_seconds", "first_batch_seconds", "samples_per_s", "mb_per_s"):
        assert layer[key] > 0
    assert doc["raw_read"]["bytes"] == N * 16 and doc["raw_read"]["samples_per_s"] > 0
    assert doc["in_ram"]["samples"] == N and doc["in_ram"]["load_seconds"] >= 0
    assert doc["raw_read_skipped"] is None and doc["in_ram_skipped"] is None
    assert set(doc["ratios"]) == {"layer_to_raw_read", "layer_to_in_ram"}
    stats = doc["stats"]
    assert set(stats["stages"]) == {"read", "gather", "consumer"}
    assert set(stats["stages"]["read"]) == {"busy_seconds", "starved_seconds", "blocked_seconds"}
    # The default, mmap="auto", maps local contiguous files.
    assert stats["bottleneck"] and stats["read_paths"] == {"data": "mmap", "label": "mmap"}
    assert stats["chunk_rows"] == 64 and not stats["resident"]
    assert doc["hints"] == [] and doc["layout_is_bottleneck"] is False


@pytest.mark.timeout(60)
def test_bench_skips_the_raw_read_of_a_variable_length_top(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An h5py variable-length top's stored bytes are its rows' references (16 bytes a row):
    a raw read of them, and a ratio to it, would not measure its values (in HDF5's heap)."""
    path = tmp_path / "vlen.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("tokens", (50,), dtype=h5py.vlen_dtype(np.int32))
        for i in range(50):
            d[i] = np.arange(100 + i, dtype=np.int32)
        f["label"] = np.arange(50)
    status, out, err = run_main(["bench", path, "--json", "--tops", "tokens", "label"], capsys)
    assert status == 0, err
    doc = json.loads(out)
    assert doc["raw_read"] is None and doc["ratios"]["layer_to_raw_read"] is None
    assert doc["heap_tops"] == ["tokens"] and "HDF5's heap" in doc["raw_read_skipped"]
    assert doc["layer"]["epochs"][0]["samples"] == 50
    status, out, err = run_main(["bench", path, "--tops", "tokens", "label"], capsys)
    assert status == 0, err
    assert "stored, besides the heap of tokens" in out and "raw read skipped: tokens" in out


@pytest.mark.timeout(60)
def test_bench_cuts_windows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A language model's token stream is benched as the windows it trains on (as inspect
    takes them), not as single tokens; the in-RAM ceiling gathers the same windows."""
    path = tmp_path / "tokens.h5"
    with h5py.File(path, "w") as f:
        f["tokens"] = np.arange(20_000, dtype=np.uint16)
    from asynchdf5._cli import _limits

    gathered: list[np.ndarray] = []

    def gather(arrays: list[np.ndarray], *args: Any) -> None:
        gathered.extend(np.array(a) for a in arrays)
        real_gather(arrays, *args)

    real_gather = _limits.gather_epoch
    monkeypatch.setattr(_limits, "gather_epoch", gather)
    args = ["bench", path, "--json", "--windows", "tokens:1025:1024", "--batch-size", 8]
    status, out, err = run_main(args, capsys)
    assert status == 0, err
    doc = json.loads(out)
    n = (20_000 - 1025) // 1024 + 1
    assert doc["samples"] == n and doc["sample_bytes"] == 1025 * 2
    assert doc["layer"]["epochs"][0]["samples"] == n and doc["in_ram"]["samples"] == n
    assert doc["raw_read"]["bytes"] == 40_000
    (windows,) = gathered  # window r is stream[r * 1024 : r * 1024 + 1025]
    assert windows.shape == (n, 1025)
    np.testing.assert_array_equal(windows, np.arange(n)[:, None] * 1024 + np.arange(1025))
    status, _, err = run_main(["bench", path, "--windows", "tokens:x"], capsys)
    assert status == 2 and "TOP:LENGTH" in err


@pytest.mark.timeout(60)
def test_bench_text_with_a_slow_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, _ = write_source(tmp_path, layout="gzip-split")
    status, out, err = run_main(
        ["bench", source, "--batch-size", 16, "--no-in-ram", "--backend", "trio"], capsys
    )
    assert status == 0, err
    assert re.search(r"layer, epoch 1\s+[\d,]+\s+[\d,.]+", out)
    assert "raw read (preadv, 1 thread)" in out and "in RAM skipped: --no-in-ram" in out
    assert "bottleneck: " in out and "where the time went" in out
    assert "splits each sample" in out  # the layout hint
    assert "read paths: data by chunks, label by chunks" in out


def test_bench_refuses_a_bad_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "list.txt").write_text("missing.h5\n")
    status, out, _ = run_main(["bench", tmp_path / "list.txt"], capsys)
    assert status == 1 and "does not exist" in out and "FAILED" in out
    status, out, _ = run_main(["bench", tmp_path / "list.txt", "--json"], capsys)
    doc = json.loads(out)
    assert status == 1 and not doc["ok"] and doc["inspect"]["problems"]


# --- demo and signals --------------------------------------------------------------------------


def _demo(args: Sequence[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "asynchdf5", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_commands_take_ctrl_c_where_their_event_loop_can(backend: str) -> None:
    """Ctrl-C inside an anyio cancel scope, in code the loop does not protect: the command's
    loop raises it at the next checkpoint (trio would raise it at once, and a KeyboardInterrupt
    there can leave trio's scope open: the demo's SIGTERM once ended in "Cancel scope stack
    corrupted")."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler in this process")
    reached = []

    async def main() -> None:
        with anyio.CancelScope():
            signal.raise_signal(signal.SIGINT)
            reached.append("after the signal")
            await anyio.sleep(0)
            reached.append("after the checkpoint")

    with pytest.raises(KeyboardInterrupt):
        run_async(main, backend=backend)
    assert reached == ["after the signal"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("sig", "args", "when"),
    [
        ("SIGINT", [], "epoch 1/"),
        ("SIGTERM", ["--backend", "trio"], "epoch 1/"),
        ("SIGTERM", ["--sync"], "epoch 1/"),
        ("SIGHUP", ["--samples", "300000"], "writing"),
    ],
)
def test_demo_ends_on_a_signal_with_one_line_and_no_temporary_folder(
    sig: str, args: list[str], when: str
) -> None:
    if not hasattr(signal, sig):
        pytest.skip(f"no {sig} here")
    signum = getattr(signal, sig)
    proc = _demo(["--samples", "20000", "--epochs", "1000", *args])
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(when):
                break
        folder = re.search(r"to (\S+asynchdf5-demo-\S+)$", lines[0].strip())
        assert folder is not None, lines
        assert Path(folder.group(1)).is_dir()
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signum, stderr
    assert stderr.strip() == f"asynchdf5 demo: interrupted ({sig})"
    assert not Path(folder.group(1)).exists()


def test_main_puts_the_signal_handlers_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    write_h5(tmp_path / "a.h5", 0, 10)
    assert run_main(["inspect", tmp_path / "a.h5"], capsys)[0] == 0
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.timeout(60)
def test_python_m_asynchdf5_lists_the_commands() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asynchdf5", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0
    for command in ("inspect", "pack", "bench", "demo"):
        assert command in proc.stdout


def test_sizes_in_bytes() -> None:
    assert size_in_bytes("4GiB") == 4 * 2**30
    assert size_in_bytes("512mib") == 512 * 2**20
    assert size_in_bytes("2e9") == 2 * 10**9
    assert size_in_bytes("1.5kB") == 1500
    with pytest.raises(argparse.ArgumentTypeError):
        size_in_bytes("lots")
