"""The catalog kept between runs (:mod:`asynchdf5._catalog_cache`): a second opening takes it
without h5py and gives the same catalog; a changed file, a corrupt cache file, a folder that
cannot be written and ranks writing at once never give another catalog than h5py's."""

from __future__ import annotations

import multiprocessing
import os
import shutil
from pathlib import Path
from typing import Any

import h5py
import pytest

import asynchdf5._catalog
from asynchdf5 import HDF5DataLayer
from asynchdf5._catalog import SHUFFLED_ATTR, Catalog, build_catalog
from asynchdf5._catalog_cache import CatalogCache
from asynchdf5._sources import LocalSource, resolve_source

from ._files import check_epoch, rows, write_h5

FILES = 20
ROWS = 12
TOPS = ("data", "label")


@pytest.fixture(autouse=True)
def _cache_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's cache folder in the test's folder; files just written may be kept."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    monkeypatch.delenv("ASYNCHDF5_CATALOG_CACHE", raising=False)
    monkeypatch.setattr(asynchdf5._catalog_cache, "RACY_NS", 0)


def _shards(folder: Path, count: int = FILES, rows: int = ROWS) -> Path:
    """``count`` files (contiguous, chunked and gzip in turn) and a list naming them."""
    folder.mkdir(parents=True, exist_ok=True)
    layouts = ("contiguous", "chunked", "gzip")
    names = [
        write_h5(folder / f"s{i:03d}.h5", i * rows, rows, layout=layouts[i % 3]).name
        for i in range(count)
    ]
    lst = folder / "train.txt"
    lst.write_text("\n".join(names) + "\n")
    return lst


class Described:
    """Counts the tops described through h5py (a cache miss), by file name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.files: list[str] = []
        real = asynchdf5._catalog._layout_of

        def spy(source: Any, file: Any, dset: Any, name: str, *rest: Any) -> Any:
            if name == TOPS[0]:
                self.files.append(os.path.basename(file.name))
            return real(source, file, dset, name, *rest)

        monkeypatch.setattr(asynchdf5._catalog, "_layout_of", spy)


@pytest.fixture
def described(monkeypatch: pytest.MonkeyPatch) -> Described:
    return Described(monkeypatch)


def _catalog(source: Any, *, keep: bool = True) -> tuple[Catalog, list[Any]]:
    """The catalog of ``source`` and what it says, in plain values; its files closed."""
    entries = resolve_source(source)
    files = LocalSource()
    try:
        catalog = build_catalog(files, entries, TOPS, keep=keep)
        return catalog, _plain(catalog)
    finally:
        files.close()


def _plain(catalog: Catalog) -> list[Any]:
    out: list[Any] = [{t: (i.dtype.str, i.sample_shape) for t, i in catalog.tops.items()}]
    for f in catalog.files:
        for top, lay in sorted(f.layouts.items()):
            chunks = lay.chunks
            out.append(
                (
                    f.name,
                    f.nrows,
                    f.start,
                    f.shuffled,
                    top,
                    lay.path,
                    lay.storage,
                    lay.filters,
                    lay.swap,
                    [(e.file.name, e.offset, e.start, e.size) for e in lay.extents],
                    None
                    if chunks is None
                    else (
                        chunks.file.name,
                        chunks.rows,
                        chunks.offsets.tolist(),
                        chunks.sizes.tolist(),
                        chunks.masks.tolist(),
                        chunks.shape,
                        chunks.sample_shape,
                    ),
                )
            )
    return out


def _kept(lst: Path) -> Path:
    return lst.parent / f".{lst.name}.asynchdf5-catalog"


def _epochs(source: Any, n: int) -> None:
    with HDF5DataLayer(source, batch_size=7, shuffle=True, seed=3, chunk_size=50) as layer:
        for epoch in range(2):
            check_epoch(list(layer), n, 7, epoch)


@pytest.mark.timeout(60)
def test_a_second_opening_takes_the_same_catalog_without_h5py(
    tmp_path: Path, described: Described
) -> None:
    lst = _shards(tmp_path / "d")
    _, fresh = _catalog(lst, keep=False)
    assert len(described.files) == FILES and not _kept(lst).exists()
    _, first = _catalog(lst)
    assert _kept(lst).is_file() and first == fresh
    described.files.clear()
    _, second = _catalog(lst)
    assert described.files == [] and second == fresh
    # The whole pipeline over the kept catalog: every sample once, data with its label.
    _epochs(lst, FILES * ROWS)
    assert described.files == []


@pytest.mark.timeout(60)
def test_a_kept_catalog_keeps_that_the_files_were_packed_shuffled(
    tmp_path: Path, described: Described
) -> None:
    """Whether a file was written in random order decides every epoch's order: an opening from
    the kept catalog must plan as the opening through h5py did."""
    lst = _shards(tmp_path / "d")
    for name in lst.read_text().split():
        with h5py.File(lst.parent / name, "a") as f:
            f.attrs[SHUFFLED_ATTR] = True
    fresh_catalog, fresh = _catalog(lst)
    assert all(f.shuffled for f in fresh_catalog.files)
    described.files.clear()
    kept_catalog, kept = _catalog(lst)
    assert described.files == [] and kept == fresh
    assert all(f.shuffled for f in kept_catalog.files)


def _same_size_other_rows(path: Path) -> None:
    """Rewrite the file (a new one in its place, same name) with other rows of the same count."""
    path.unlink()
    write_h5(path, 50_000, ROWS, layout="contiguous")


def _touched(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def _copied_over(path: Path) -> None:
    """The same bytes and times in a new inode (another file renamed into its place)."""
    other = path.with_suffix(".copy")
    shutil.copy2(path, other)
    os.replace(other, path)


def _resized(path: Path) -> None:
    path.unlink()
    write_h5(path, 60_000, ROWS + 5, layout="contiguous")


CHANGES = {
    "resized": _resized,
    "modified (mtime)": _touched,
    "replaced (inode)": _copied_over,
    "replaced by another file": _same_size_other_rows,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_file_is_described_again(
    tmp_path: Path, described: Described, change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No digest of the head: each change must be seen by the file's fingerprint alone.
    monkeypatch.setattr(asynchdf5._catalog_cache, "HEAD_BYTES", 0)
    lst = _shards(tmp_path / "d")
    _catalog(lst)
    CHANGES[change](tmp_path / "d" / "s003.h5")  # contiguous
    _, fresh = _catalog(lst, keep=False)
    described.files.clear()
    _, got = _catalog(lst)
    assert described.files == ["s003.h5"]
    assert got == fresh
    described.files.clear()
    _, again = _catalog(lst)  # kept anew
    assert described.files == [] and again == fresh


def _reordered_in_place(path: Path, start: int) -> None:
    """Rewrite the file in place with the same rows stored the other way round (the label
    first: other offsets), keeping its size and modification time."""
    other = path.with_suffix(".other")
    with h5py.File(other, "w") as f:
        for name, arr in reversed(list(rows(start, ROWS).items())):
            f.create_dataset(name, data=arr)
    st = path.stat()
    data = other.read_bytes()
    other.unlink()
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("head", [0, 4096], ids=["fingerprint only", "with the head digest"])
def test_a_file_rewritten_in_place_with_its_size_and_mtime_is_described_again(
    tmp_path: Path, described: Described, monkeypatch: pytest.MonkeyPatch, head: int
) -> None:
    """The stale entry would read the label's bytes as data: its change time tells."""
    monkeypatch.setattr(asynchdf5._catalog_cache, "HEAD_BYTES", head)
    lst = _shards(tmp_path / "d")
    _, before = _catalog(lst)
    _reordered_in_place(tmp_path / "d" / "s003.h5", 3 * ROWS)
    _, fresh = _catalog(lst, keep=False)
    assert fresh != before  # other offsets
    described.files.clear()
    _, got = _catalog(lst)
    assert described.files == ["s003.h5"] and got == fresh
    _epochs(lst, FILES * ROWS)


def _corrupt(kind: str, path: Path) -> None:
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "a byte flipped":
        at = len(data) - 10
        path.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text('{"entries": "no"}')
    elif kind == "a directory":
        path.unlink()
        path.mkdir()
        (path / "x").write_text("x")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["truncated", "a byte flipped", "empty", "text", "a directory"])
def test_a_corrupt_cache_file_is_ignored(tmp_path: Path, kind: str, described: Described) -> None:
    lst = _shards(tmp_path / "d")
    _, fresh = _catalog(lst)
    _corrupt(kind, _kept(lst))
    described.files.clear()
    _, got = _catalog(lst)
    assert described.files == [f"s{i:03d}.h5" for i in range(FILES)] and got == fresh
    _epochs(lst, FILES * ROWS)


def _rewrite_entries(path: Path, edit: Any) -> None:
    """Edit the cache file's entries and sign it again as the package does (a cache file that
    passes the whole-file checks with entries that make no sense)."""
    import hashlib
    import json
    import zlib

    from asynchdf5._catalog_cache import _MAGIC

    data = path.read_bytes()
    body = data[len(_MAGIC) + 33 :]
    entries = json.loads(zlib.decompress(body))
    edit(entries)
    body = zlib.compress(json.dumps(entries).encode())
    digest = hashlib.blake2b(body, digest_size=16).hexdigest().encode()
    path.write_bytes(_MAGIC + digest + b"\n" + body)


def _edit_data(entries: dict[str, Any], edit: Any) -> None:
    import json

    for entry in entries.values():
        record = json.loads(entry[6]["data"])
        edit(entry, record)
        entry[6]["data"] = json.dumps(record)


def _beyond_the_end(entries: dict[str, Any]) -> None:
    def edit(entry: list[Any], record: list[Any]) -> None:
        layout = record[2]
        if layout[0] == "pread":
            layout[1][0][0] = entry[1]  # the data's offset: the file's size
        else:
            layout[1][0] = 0  # chunks of 0 rows

    _edit_data(entries, edit)


def _another_dtype(entries: dict[str, Any]) -> None:
    def edit(entry: list[Any], record: list[Any]) -> None:
        record[0] = "|O"

    _edit_data(entries, edit)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("edit", [_beyond_the_end, _another_dtype], ids=["extents", "dtype"])
def test_entries_that_make_no_sense_are_ignored(
    tmp_path: Path, described: Described, edit: Any
) -> None:
    lst = _shards(tmp_path / "d")
    _, fresh = _catalog(lst)
    _rewrite_entries(_kept(lst), edit)
    described.files.clear()
    _, got = _catalog(lst)
    assert len(described.files) == FILES and got == fresh


@pytest.mark.timeout(60)
def test_a_folder_that_cannot_be_written_keeps_it_in_the_user_cache(
    tmp_path: Path, described: Described
) -> None:
    lst = _shards(tmp_path / "d")
    blocked = _kept(lst)
    blocked.mkdir()  # a non-empty folder in its place: cannot be read, nor renamed over
    (blocked / "x").write_text("x")
    _, fresh = _catalog(lst)
    kept = list((tmp_path / "user-cache" / "asynchdf5" / "catalogs").glob("*.catalog"))
    assert len(kept) == 1
    described.files.clear()
    _, got = _catalog(lst)
    assert described.files == [] and got == fresh


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
@pytest.mark.timeout(60)
def test_a_read_only_folder_keeps_it_in_the_user_cache(
    tmp_path: Path, described: Described
) -> None:
    lst = _shards(tmp_path / "d")
    (tmp_path / "d").chmod(0o555)
    try:
        _, fresh = _catalog(lst)
        assert not _kept(lst).exists()
        described.files.clear()
        _, got = _catalog(lst)
        assert described.files == [] and got == fresh
    finally:
        (tmp_path / "d").chmod(0o755)


@pytest.mark.timeout(60)
def test_nowhere_to_keep_it_still_opens(
    tmp_path: Path, described: Described, monkeypatch: pytest.MonkeyPatch
) -> None:
    lst = _shards(tmp_path / "d")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ASYNCHDF5_CATALOG_CACHE", str(tmp_path / "file" / "below-a-file"))
    _, fresh = _catalog(lst, keep=False)
    _, got = _catalog(lst)
    assert got == fresh


@pytest.mark.timeout(60)
def test_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCHDF5_CATALOG_CACHE", "0")
    lst = _shards(tmp_path / "d")
    _catalog(lst)
    assert not _kept(lst).exists() and not (tmp_path / "user-cache").exists()


@pytest.mark.timeout(60)
def test_a_sequence_of_paths_is_kept_in_the_user_cache(
    tmp_path: Path, described: Described
) -> None:
    lst = _shards(tmp_path / "d")
    paths = [str(tmp_path / "d" / line) for line in lst.read_text().split()]
    _, fresh = _catalog(paths)
    assert not _kept(lst).exists()
    assert len(list((tmp_path / "user-cache" / "asynchdf5" / "catalogs").iterdir())) == 1
    described.files.clear()
    _, got = _catalog(paths)
    assert described.files == [] and got == fresh
    _epochs(paths, FILES * ROWS)
    described.files.clear()
    _catalog(paths[:-1])  # another source: another cache
    assert len(described.files) == FILES - 1


@pytest.mark.timeout(60)
def test_files_changed_just_before_are_not_kept(
    tmp_path: Path, described: Described, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change time as recent as the description could come again with a later change (a
    coarse file-system clock): such files are described again next time."""
    monkeypatch.setattr(asynchdf5._catalog_cache, "RACY_NS", 3600 * 10**9)
    lst = _shards(tmp_path / "d")
    _catalog(lst)
    described.files.clear()
    _catalog(lst)
    assert len(described.files) == FILES


@pytest.mark.timeout(120)
def _rank_building(lst: str, start: Any, out: Any) -> None:
    """One rank (a process of its own, as torchrun's): three catalogs of ``lst``, each kept anew."""
    try:
        asynchdf5._catalog_cache.RACY_NS = 0  # the files were just written
        start.wait(60)
        for _ in range(3):
            _kept(Path(lst)).unlink(missing_ok=True)
            out.put(_catalog(lst)[1])
    except BaseException as exc:  # reported by the test
        out.put(f"{type(exc).__name__}: {exc}")


@pytest.mark.timeout(180)
@pytest.mark.leaks_ok  # the spawn context's resource tracker lives as long as the process
def test_ranks_writing_at_once_leave_a_whole_file(tmp_path: Path, described: Described) -> None:
    """Four processes (not threads: h5py 3.16 with HDF5 2.0 is not safe to call from several
    threads at once) keep the same catalog at the same time."""
    lst = _shards(tmp_path / "d")
    _, fresh = _catalog(lst, keep=False)
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(4), ctx.Queue()
    ranks = [ctx.Process(target=_rank_building, args=(str(lst), start, out)) for _ in range(4)]
    for r in ranks:
        r.start()
    results = [out.get(timeout=90) for _ in range(12)]
    for r in ranks:
        r.join(30)
    out.close()
    out.join_thread()
    assert all(r == fresh for r in results), [r for r in results if r != fresh][:1]
    assert sorted(p.name for p in lst.parent.iterdir() if p.name.startswith(".")) == [
        _kept(lst).name
    ]  # no temporary file left
    described.files.clear()
    _, got = _catalog(lst)
    assert described.files == [] and got == fresh


def test_small_sources_are_not_kept(tmp_path: Path) -> None:
    lst = _shards(tmp_path / "d", count=3)
    entries = resolve_source(lst)
    assert CatalogCache.for_entries(entries) is None
    _catalog(lst)
    assert not _kept(lst).exists()


def test_entries_remember_their_list_file(tmp_path: Path) -> None:
    import pickle

    lst = _shards(tmp_path / "d", count=2)
    entries = resolve_source(lst)
    assert {getattr(e, "list_file", None) for e in entries} == {str(lst)}
    again = resolve_source(pickle.loads(pickle.dumps(entries)))
    assert [getattr(e, "list_file", None) for e in again] == [str(lst)] * 2
    assert [getattr(e, "where", None) for e in again] == [
        "train.txt, line 1",
        "train.txt, line 2",
    ]


@pytest.mark.timeout(60)
def test_other_tops_are_added_to_the_entries(tmp_path: Path, described: Described) -> None:
    lst = _shards(tmp_path / "d")
    entries = resolve_source(lst)
    for tops in (("label",), ("data",)):  # the second adds its top to the first's
        files = LocalSource()
        try:
            build_catalog(files, entries, tops, keep=True)
        finally:
            files.close()
    described.files.clear()
    _, got = _catalog(lst)
    assert described.files == [] and got == _catalog(lst, keep=False)[1]
