"""Ragged and sparse rows: the layer against a raw read of the same bytes, and a sparse
``.h5ad`` against AnnData's ``AnnLoader`` (``python -m benchmarks run ragged``).

Two files, made once in the data folder: token sequences of 16 to 1024 int32 values (a ragged
group, ``data`` + ``indptr``) with a label each, and a sparse count matrix written by
``anndata`` (``X`` a CSR group, float32 values, int32 column indices) with an ``obs`` column.
Each reader runs in a child process of its own, warm (the file read once before) and, where a
memory cgroup can be made (:mod:`benchmarks.cgroups`), again with the child in a 512 MiB one:

- *raw read*: the values (and column indices) read front to back with ``read_direct`` in
  64 MiB slabs, and ``indptr``: the bytes every reader must move, at the rate nothing beats;
- *asynchdf5*: shuffled epochs of ``Ragged`` (``csr_array``) batches, rows/s and bytes/s (also
  epoch 1 alone, which maps the file's pages and fills fresh buffers, and epochs 2+ alone, the
  gather), and unshuffled ones (the same order as the raw read);
- *NumPy resident* (a limit): the same shuffled batches (the layer's first epoch's order)
  gathered from values read into RAM beforehand by the plain NumPy code a user would write, on
  one thread: the faster of a slice per row joined by ``np.concatenate`` and one flat index of
  every value; what a shuffled gather of these rows costs with no file, cache or pipeline;
- *fixed rows* (a limit): the same layer over rows of one length holding the same bytes per row
  on average (a contiguous dataset: int32 token rows, or float32 rows as wide as a cell's
  values and column indices), shuffled: what the layer's gather does when rows need no spans;
- *AnnLoader*: ``anndata.experimental.AnnLoader`` over the backed file, shuffled, where
  anndata installs (it is in the ``bench`` extra).

Padding, in this process: :meth:`Ragged.to_padded <asynchdf5.Ragged.to_padded>` of 64, 256
and 1,024 token rows (to the longest row, and cut to 512) against ``np.copyto`` of its output
(a reused buffer). And, warm, in child processes: shuffled epochs of the tokens padded to 512
by the layer (``transforms.Pad`` at the head of the chain, gathered padded) against the same
epochs of ``Ragged`` batches the loop pads with ``to_padded(0, 512)``.

Out of core (:func:`_out_of_core`): a count matrix as single-cell data has one (20,000 genes,
about 1,000 non-zeros a cell, counts; :func:`counts_matrix`), written by anndata twice, as is and
with ``compression="gzip"``, the uncompressed file 3.4x the memory the reader may use: each
reader in a child in a 128 MiB memory cgroup (its modules imported before it joins), the file
evicted before it starts, so that every epoch streams the file. Readers: the stored bytes read
front to back (the read limit), the layer (epoch 1 and epochs 2+ alone), ``AnnLoader``; for the
gzip file also its decode limit (the ``layouts`` benchmark's: its chunks decoded from memory by
one loop per core).

Ratios are taken within one run, reader against reader, in the same conditions: each ratio to
the raw read beside the ratio of its limits (NumPy resident, fixed rows) to it.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from benchmarks import cgroups, page_cache
from benchmarks.report import Recorder

LIMIT_MIB = 512
#: The memory limit of the out-of-core count matrices: the full size's files are 3.4x it
#: (uncompressed) and 1.0x it gzipped (3.4x decoded).
OOC_LIMIT_MIB = 128
SLAB = 64 * 2**20


def _sizes(quick: bool) -> dict[str, int]:
    if quick:  # the counts files are smaller than the limit: the run proves the code only
        return {"docs": 2_000, "cells": 2_000, "genes": 200, "epochs": 1, "timeout": 120,
                "counts_cells": 1_000, "counts_genes": 400, "ooc_limit_mib": OOC_LIMIT_MIB,
                "ooc_epochs": 2, "ooc_cap_s": 1}  # fmt: skip
    return {"docs": 200_000, "cells": 100_000, "genes": 2_000, "epochs": 2, "timeout": 900,
            "counts_cells": 50_000, "counts_genes": 20_000, "ooc_limit_mib": OOC_LIMIT_MIB,
            "ooc_epochs": 3, "ooc_cap_s": 10}  # fmt: skip


def write_tokens(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` token sequences of 16..1024 int32 values (a ragged group) and a label each."""
    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 1025, n)
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=indptr[1:])
    tmp = path.with_suffix(".tmp")
    with h5py.File(tmp, "w") as f:
        g = f.create_group("tokens")
        data = g.create_dataset("data", (int(indptr[-1]),), np.int32)
        for a in range(0, int(indptr[-1]), SLAB // 4):
            b = min(int(indptr[-1]), a + SLAB // 4)
            data[a:b] = rng.integers(0, 50_000, b - a, dtype=np.int32)
        g["indptr"] = indptr
        f["label"] = rng.integers(0, 10, n)
    tmp.rename(path)
    return path


def write_cells(path: Path, cells: int, genes: int, seed: int = 0) -> Path | str:
    """A sparse ``.h5ad`` written by anndata (5% non-zeros), or why it cannot be."""
    if path.exists():
        return path
    try:
        import anndata
        import pandas as pd
        import scipy.sparse
    except ImportError as exc:
        return f"anndata not installed ({exc})"
    rng = np.random.default_rng(seed)
    x = scipy.sparse.random(
        cells, genes, density=0.05, format="csr", dtype=np.float32, random_state=rng
    )
    obs = pd.DataFrame({"n_counts": np.asarray(x.sum(axis=1)).ravel()})
    obs.index = obs.index.astype(str)
    tmp = path.with_name("tmp-" + path.name)
    anndata.AnnData(X=x, obs=obs).write_h5ad(tmp)
    tmp.rename(path)
    return path


def counts_matrix(cells: int, genes: int, density: float = 0.05, seed: int = 0) -> Any:
    """A count matrix as single-cell data has one (``scipy.sparse.csr_matrix``, float32 values,
    int32 column indices sorted in each row): each cell's number of detected genes drawn around
    ``density`` of them (log-normal), its columns by geometric gaps (distinct, in order), its
    counts 1 + Poisson(1) (mostly ones and twos, as UMI counts are)."""
    import scipy.sparse

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(genes * density), 0.5, cells), 1, genes)
    draws = np.ceil(lengths * 1.3 + 8).astype(np.int64)  # enough gaps to pass the last gene
    cols = np.cumsum(rng.geometric(np.repeat(lengths / genes, draws)))
    ends = np.cumsum(draws)
    cols -= np.repeat(np.concatenate(([0], cols[ends[:-1] - 1])), draws) + 1  # from 0 per row
    keep = cols < genes
    rows = np.repeat(np.arange(cells), draws)[keep]
    indptr = np.zeros(cells + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=cells), out=indptr[1:])
    indices = cols[keep].astype(np.int32)
    data = (1 + rng.poisson(1.0, len(indices))).astype(np.float32)
    return scipy.sparse.csr_matrix((data, indices, indptr), shape=(cells, genes))


def write_counts(path: Path, cells: int, genes: int, compression: str | None = None) -> Path | str:
    """:func:`counts_matrix` as a sparse ``.h5ad`` written by anndata (``compression="gzip"``:
    ``adata.write_h5ad(path, compression="gzip")``, ``X/data`` and ``X/indices`` in gzip
    chunks), with an ``obs`` column; or why it cannot be."""
    if path.exists():
        return path
    try:
        import anndata
        import pandas as pd
    except ImportError as exc:
        return f"anndata not installed ({exc})"
    x = counts_matrix(cells, genes)
    obs = pd.DataFrame({"n_counts": np.asarray(x.sum(axis=1)).ravel()})
    obs.index = obs.index.astype(str)
    tmp = path.with_name("tmp-" + path.name)
    anndata.AnnData(X=x, obs=obs).write_h5ad(tmp, compression=compression)
    tmp.rename(path)
    return path


def write_fixed(path: Path, ragged: Path, top: str) -> Path:
    """Rows of one length holding the bytes of ``ragged``'s top per row on average (values and
    column indices), contiguous, with a label: the fixed-row peer of the same bytes."""
    if path.exists():
        return path
    with h5py.File(ragged, "r") as f:
        g = f[top]
        rows = len(g["indptr"]) - 1
        nbytes = sum(g[m].dtype.itemsize * g[m].shape[0] for m in ("data", "indices") if m in g)
    dtype = np.dtype(np.int32) if top == "tokens" else np.dtype(np.float32)
    width = max(1, round(nbytes / max(1, rows) / dtype.itemsize))
    rng = np.random.default_rng(1)
    tmp = path.with_suffix(".tmp")
    with h5py.File(tmp, "w") as f:
        d = f.create_dataset(top, (rows, width), dtype)
        step = max(1, SLAB // (width * dtype.itemsize))
        for a in range(0, rows, step):
            b = min(rows, a + step)
            d[a:b] = rng.integers(0, 50_000, (b - a, width)).astype(dtype)
        f["label"] = rng.integers(0, 10, rows)
    tmp.rename(path)
    return path


# --- the readers, each in a child process ------------------------------------------------------


def _raw(job: dict[str, Any]) -> dict[str, Any]:
    """Every value (and column index) and ``indptr``, front to back in slabs."""
    t0 = time.perf_counter()
    moved = 0
    with h5py.File(job["path"], "r") as f:
        g = f[job["top"]]
        for name in ("data", "indices", "indptr"):
            if name not in g:
                continue
            d = g[name]
            step = max(1, SLAB // d.dtype.itemsize)
            buf = np.empty(min(step, d.shape[0]), d.dtype)
            for a in range(0, d.shape[0], step):
                b = min(d.shape[0], a + step)
                d.read_direct(buf, np.s_[a:b], np.s_[0 : b - a])
                moved += (b - a) * d.dtype.itemsize
    s = time.perf_counter() - t0
    return {"seconds": s, "bytes": moved, "rows": job["rows"]}


def _stored(job: dict[str, Any]) -> dict[str, Any]:
    """The tops' stored bytes (a sparse top's values and column indices, compressed where they
    are), front to back with ``os.preadv`` into one reused buffer: the read limit of the same
    bytes, as ``asynchdf5 bench`` reads them (:func:`asynchdf5._cli._limits.raw_read`)."""
    from asynchdf5._cli._limits import raw_read, stored_ranges_of

    ranges = stored_ranges_of([job["path"]], job["tops"])
    rate = raw_read(ranges, job["rows"])
    return {"seconds": rate.seconds, "bytes": rate.bytes, "rows": job["rows"]}


def _decode(job: dict[str, Any]) -> dict[str, Any]:
    """The decode limit of the tops' filtered chunks (the ``layouts`` benchmark's,
    :func:`benchmarks._layouts_child.loop_decode`): every stored chunk of every filtered
    dataset the tops read (a sparse top's ``data`` and ``indices``), read into memory first,
    then decoded by one loop per core; its rate in rows of the file a second."""
    from asynchdf5._catalog import build_catalog
    from asynchdf5._codecs import ChunkDecoder
    from asynchdf5._sources import LocalSource
    from benchmarks._layouts_child import _raw_chunks, loop_decode

    source = LocalSource()
    try:
        catalog = build_catalog(source, [job["path"]], tuple(job["tops"]))
        chunks: list[tuple[Any, bytearray, int]] = []
        for f in catalog.files:
            layouts = [(lay, catalog.tops[t].dtype) for t, lay in f.layouts.items()]
            for t, parts in f.ragged.items():
                index_dtype = catalog.tops[t].ragged.index_dtype  # type: ignore[union-attr]
                if parts.indices is not None and index_dtype is not None:
                    layouts.append((parts.indices, index_dtype))
            for layout, dtype in layouts:
                index = layout.chunks
                if layout.path != "chunks" or index is None or not layout.filters:
                    continue
                itemsize = dtype.itemsize
                size = itemsize * int(np.prod(index.shape))
                decoder = ChunkDecoder(layout.filters, itemsize, size, index.shape)
                chunks += [(decoder, r, m) for r, m in _raw_chunks(index, 2**62)]
    finally:
        source.close()
    threads = os.cpu_count() or 1
    seconds, cpu = loop_decode(chunks, threads)
    decoded = sum(d.chunk_bytes for d, _, _ in chunks)
    return {"seconds": seconds, "bytes": decoded, "rows": job["rows"], "cpu_s": cpu,
            "chunks": len(chunks), "threads": threads}  # fmt: skip


def _layer(job: dict[str, Any]) -> dict[str, Any]:
    from asynchdf5 import HDF5DataLayer

    tops = tuple(job["tops"])
    order: list[np.ndarray] = []
    with HDF5DataLayer(
        job["path"], tops=tops, batch_size=job["batch"], shuffle=job["shuffle"], seed=0
    ) as layer:
        times = []
        moved = rows = 0
        for epoch in range(job["epochs"]):
            t0 = time.perf_counter()
            for b in layer:
                v = b[tops[0]]
                if hasattr(v, "indices"):
                    moved += int(v.data.nbytes + v.indices.nbytes)
                elif hasattr(v, "values"):
                    moved += int(v.values.nbytes)
                else:
                    moved += int(v.nbytes)
                rows += len(b.indices)
                if epoch == 0 and job.get("order"):
                    order.append(b.indices.copy())
            times.append(time.perf_counter() - t0)
        paths = dict(layer.stats.read_paths)
    if order:  # the batches the NumPy reader gathers
        np.save(job["order"], np.concatenate(order))
    return {
        "seconds": sum(times),
        "epoch_s": times,
        "bytes": moved,
        "rows": rows,
        "read_paths": paths,
    }


def _numpy(job: dict[str, Any]) -> dict[str, Any]:
    """The layer's first epoch's batches, gathered on one thread by plain NumPy from the values
    (and column indices) read into RAM first: a slice per row joined by ``np.concatenate``, and
    one flat index of every value; the faster way's time (both epochs' worth)."""
    with h5py.File(job["path"], "r") as f:
        g = f[job["top"]]
        heaps = [g[m][()] for m in ("data", "indices") if m in g]
        indptr = np.asarray(g["indptr"][()], np.int64)
    order = np.load(job["order"])
    batches = [order[a : a + job["batch"]] for a in range(0, len(order), job["batch"])]

    def slices(idx: np.ndarray) -> int:
        starts, stops = indptr[idx].tolist(), indptr[idx + 1].tolist()
        out = [np.concatenate([h[a:b] for a, b in zip(starts, stops, strict=True)]) for h in heaps]
        np.cumsum(indptr[idx + 1] - indptr[idx])  # the batch's offsets
        return sum(o.nbytes for o in out)

    def flat(idx: np.ndarray) -> int:
        starts = indptr[idx]
        lengths = indptr[idx + 1] - starts
        ends = np.cumsum(lengths)
        at = np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]))
        return sum(h[at].nbytes for h in heaps)

    best: dict[str, float] = {}
    moved = 0
    for name, way in (("slices", slices), ("flat", flat)):
        t0 = time.perf_counter()
        moved = sum(way(idx) for _ in range(job["epochs"]) for idx in batches)
        best[name] = time.perf_counter() - t0
    fastest = min(best, key=lambda k: best[k])
    return {
        "seconds": best[fastest],
        "rows": len(order) * job["epochs"],
        "bytes": moved,
        "way": fastest,
        "ways_s": best,
    }


def _annloader(job: dict[str, Any]) -> dict[str, Any]:
    import anndata
    from anndata.experimental import AnnLoader

    adata = anndata.read_h5ad(job["path"], backed="r")
    loader = AnnLoader(adata, batch_size=job["batch"], shuffle=True)
    t0 = time.perf_counter()
    rows = 0
    deadline = t0 + job["cap_s"]
    for b in loader:
        rows += b.X.shape[0]
        if time.perf_counter() > deadline:  # a capped epoch: its rate is what counts
            break
    return {"seconds": time.perf_counter() - t0, "rows": rows, "bytes": 0}


READERS = {
    "raw": _raw,
    "layer": lambda job: _layer({**job, "shuffle": True}),
    "layer-unshuffled": lambda job: _layer({**job, "shuffle": False}),
    "numpy": _numpy,
    "fixed": lambda job: _layer(
        {**job, "path": job["fixed"], "tops": [job["top"], "label"], "shuffle": True}
    ),
    "annloader": _annloader,
    "stored": _stored,
    "decode": _decode,
}


def _padding(
    rec: Recorder, tokens: Path, batch: int = 64, reps: int = 30, length: int | None = None
) -> None:
    """``Ragged.to_padded`` on a batch of the token rows (to the longest row's length, or cut
    to ``length``) against ``np.copyto`` of its output's bytes (the memory speed padding aims
    at), in this process, alternating, the best of ``reps`` each."""
    from asynchdf5 import Ragged

    with h5py.File(tokens, "r") as f:
        indptr = f["tokens/indptr"][: batch + 1]
        r = Ragged(f["tokens/data"][: int(indptr[-1])], indptr)
    out, _ = r.to_padded(0, length)
    src, dst = np.ones_like(out), np.empty_like(out)
    best = {"pad": math.inf, "copyto": math.inf}
    for _ in range(reps):
        for name, f in (
            ("pad", lambda: r.to_padded(0, length)),
            ("copyto", lambda: np.copyto(dst, src)),
        ):
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    cutting = "" if length is None else f" cut to {length}"
    rec.figure(f"to_padded, {batch} token rows{cutting}", out.nbytes / best["pad"] / 2**20, "MiB/s")
    rec.figure(
        f"np.copyto of its output's bytes, {batch} rows{cutting}",
        out.nbytes / best["copyto"] / 2**20,
        "MiB/s",
    )
    rec.ratio(
        f"to_padded ÷ np.copyto of its output, {batch} rows{cutting}",
        best["copyto"],
        best["pad"],
    )


#: The length the padded epochs pad (and cut) the token rows to.
PAD_LENGTH = 512


def _layer_padded(job: dict[str, Any]) -> dict[str, Any]:
    """Shuffled epochs of the token rows as ``(batch, PAD_LENGTH)`` arrays: padded by the layer
    (``job["fused"]``: ``transforms.Pad`` first in the chain, gathered padded) or by the loop
    (``Ragged.to_padded`` on each batch)."""
    from asynchdf5 import HDF5DataLayer
    from asynchdf5 import transforms as T

    fused = job["fused"]
    transformers = [(job["top"], T.Pad(0, length=PAD_LENGTH))] if fused else []
    with HDF5DataLayer(
        job["path"],
        tops=tuple(job["tops"]),
        batch_size=job["batch"],
        shuffle=True,
        seed=0,
        transformers=transformers,
    ) as layer:
        times = []
        rows = 0
        for _ in range(job["epochs"]):
            t0 = time.perf_counter()
            for b in layer:
                x = b[job["top"]] if fused else b[job["top"]].to_padded(0, PAD_LENGTH)[0]
                assert x.shape == (len(b.indices), PAD_LENGTH)
                rows += len(b.indices)
            times.append(time.perf_counter() - t0)
    return {"seconds": sum(times), "epoch_s": times, "rows": rows}


READERS["padded-fused"] = lambda job: _layer_padded({**job, "fused": True})
READERS["padded-loop"] = lambda job: _layer_padded({**job, "fused": False})


def _padded_epochs(rec: Recorder, tokens: Path, work: Path, size: dict[str, int]) -> None:
    """The tokens padded to :data:`PAD_LENGTH` by the layer's fused ``Pad`` and by
    ``to_padded`` in the loop, warm, each in a child process, alternating."""
    page_cache.warm(tokens)
    job = {
        "path": str(tokens),
        "top": "tokens",
        "tops": ["tokens", "label"],
        "batch": 64,
        "epochs": size["epochs"],
        "timeout": size["timeout"],
    }
    rates: dict[str, float] = {}
    for reader in ("padded-loop", "padded-fused"):
        r, error = cgroups.run_child(
            "benchmarks.ragged", {**job, "reader": reader}, work, reader, None
        )
        if error is not None:
            rec.note(f"tokens {reader}: {error}")
            continue
        rates[reader] = r["rows"] / r["seconds"]
        rec.figure(f"tokens, {reader} (length {PAD_LENGTH}), warm", rates[reader], "samples/s")
    rec.ratio(
        f"tokens: Pad(0, length={PAD_LENGTH}) fused ÷ to_padded in the loop, warm",
        rates.get("padded-fused"),
        rates.get("padded-loop"),
    )


def _record(
    rec: Recorder,
    what: str,
    reader: str,
    label: str,
    r: dict[str, Any],
    rates: dict[str, float],
    firsts: dict[str, float],
    laters: dict[str, float],
) -> None:
    """One reader's figures (samples/s; epoch 1 and epochs 2+ alone where it ran more than one
    epoch; the bytes it moved a second), its rates kept in ``rates``, ``firsts``, ``laters``."""
    if "read_paths" in r:
        rec.note(f"{what} {reader} read paths: {r['read_paths']}")
    if "way" in r:
        ways = ", ".join(f"{k} {v:.3f} s" for k, v in r["ways_s"].items())
        rec.note(f"{what} NumPy resident ({label}): {ways}")
    rates[reader] = r["rows"] / r["seconds"]
    rec.figure(f"{what}, {reader}, {label}", rates[reader], "samples/s")
    epochs = r.get("epoch_s", ())
    if len(epochs) > 1:  # the first epoch alone (it maps and reads), the rest
        per_epoch = r["rows"] / len(epochs)
        firsts[reader] = per_epoch / epochs[0]
        laters[reader] = per_epoch * (len(epochs) - 1) / sum(epochs[1:])
        rec.figure(f"{what}, {reader}, {label}, epoch 1", firsts[reader], "samples/s")
        rec.figure(f"{what}, {reader}, {label}, epochs 2+", laters[reader], "samples/s")
    if r["bytes"]:
        rec.figure(f"{what}, {reader}, {label}, values", r["bytes"] / r["seconds"] / 2**20, "MiB/s")


#: Imported by the out-of-core children before they join the memory cgroup (their memory is
#: not the data's): each reader's modules.
_IMPORTS = ["h5py", "scipy.sparse", "asynchdf5", "asynchdf5._cli._limits"]
_ANN_IMPORTS = [*_IMPORTS, "anndata", "torch", "anndata.experimental.pytorch"]


def _out_of_core(rec: Recorder, size: dict[str, int], folder: Path, work: Path) -> None:
    """Sparse ``.h5ad`` count matrices larger than the memory the reader may use (the case
    single-cell users have: every epoch streams the file), uncompressed and as anndata writes
    them with ``compression="gzip"``: each reader in a child in a memory cgroup of
    ``ooc_limit_mib``, the file evicted from the page cache before it starts. Readers: the
    stored bytes read front to back (the read limit, both files; before and after the others,
    the faster kept), the layer (shuffled, epoch 1 and epochs 2+ alone) and ``AnnLoader`` over
    the backed file (capped at ``ooc_cap_s``); for the gzip file also the decode limit (its
    chunks decoded from memory by one loop per core, outside the cgroup: it holds them all)."""
    cells, genes, limit = size["counts_cells"], size["counts_genes"], size["ooc_limit_mib"]
    files: dict[str, Path] = {}
    for what, compression in (("cells out of core", None), ("cells gzip out of core", "gzip")):
        suffix = f"-{compression}" if compression else ""
        made = write_counts(folder / f"counts-{cells}x{genes}{suffix}.h5ad", cells, genes,
                            compression)  # fmt: skip
        if isinstance(made, str):
            rec.note(f"{what}: {made}")
            return
        files[what] = made
    group = cgroups.make(f"asynchdf5-ragged-ooc-{os.getpid()}", limit * 2**20)
    if isinstance(group, str):
        rec.note(f"out of core: no {limit} MiB cgroup: {group}")
        return
    label = f"{limit} MiB cgroup, cold"
    tops = ["X", "obs/n_counts"]
    try:
        for what, path in files.items():
            mib = path.stat().st_size / 2**20
            rec.figure(f"{what}: file ÷ memory limit", mib / limit, "ratio")
            job = {
                "path": str(path), "top": "X", "tops": tops, "batch": 256, "rows": cells,
                "epochs": size["ooc_epochs"], "timeout": size["timeout"],
                "cap_s": size["ooc_cap_s"],
            }  # fmt: skip
            rates: dict[str, float] = {}
            firsts: dict[str, float] = {}
            laters: dict[str, float] = {}
            # The read limit before and after the others (the faster counts: a virtual disk's
            # rate varies from one read of the file to the next).
            readers = ["stored", "layer", "annloader", "stored"]
            best_stored: dict[str, Any] | None = None
            for reader in readers:
                page_cache.evict(path)
                imports = _ANN_IMPORTS if reader == "annloader" else _IMPORTS
                job_r = {**job, "reader": reader, "imports": imports}
                name = f"{reader}-ooc"
                for attempt in (1, 2):  # AnnLoader on the gzip file is killed now and then
                    kills = group.oom_kills() or 0
                    r, error = cgroups.run_child("benchmarks.ragged", job_r, work, name, group)
                    killed = (group.oom_kills() or 0) - kills
                    if error is None or killed <= 0:
                        break
                    rec.note(f"{what} {reader} ({label}): killed for memory (try {attempt})")
                if error is not None:
                    rec.note(f"{what} {reader} ({label}): failed: {error.strip()[-300:]}")
                    continue
                if reader == "stored":
                    rec.note(f"{what}: stored bytes read in {r['seconds']:.3f} s")
                    if best_stored is None or r["seconds"] < best_stored["seconds"]:
                        best_stored = r
                    continue
                _record(rec, what, reader, label, r, rates, firsts, laters)
            if best_stored is not None:
                _record(rec, what, "stored", label, best_stored, rates, firsts, laters)
            if "gzip" in what:  # warm, no cgroup: the chunks are held in memory
                page_cache.warm(path)
                r, error = cgroups.run_child(
                    "benchmarks.ragged", {**job, "reader": "decode"}, work, "decode", None
                )
                if error is not None:
                    rec.note(f"{what} decode limit: {error}")
                else:
                    rec.note(
                        f"{what}: decode limit: {r['chunks']} chunks, {r['threads']} threads, "
                        f"{r['cpu_s']:.2f} s CPU in {r['seconds']:.2f} s"
                    )
                    _record(rec, what, "decode", "from memory", r, rates, firsts, laters)
            for when, layer in (("epoch 1", firsts), ("epochs 2+", laters)):
                rec.ratio(
                    f"{what}: asynchdf5 {when} ÷ raw read of the stored bytes, {label}",
                    layer.get("layer"), rates.get("stored"),
                )  # fmt: skip
                rec.ratio(
                    f"{what}: asynchdf5 {when} ÷ decode limit, {label}",
                    layer.get("layer"), rates.get("decode"),
                )  # fmt: skip
                rec.ratio(
                    f"{what}: asynchdf5 {when} ÷ AnnLoader (backed), {label}",
                    layer.get("layer"), rates.get("annloader"),
                )  # fmt: skip
        peak = group.peak_bytes()
        if peak:
            rec.note(f"out of core: the {limit} MiB cgroup's peak {peak / 2**20:.0f} MiB")
    finally:
        group.remove()


def bench(rec: Recorder) -> None:
    size = _sizes(rec.quick)
    folder = rec.data_dir / "ragged"
    folder.mkdir(parents=True, exist_ok=True)
    tokens = write_tokens(folder / f"tokens-{size['docs']}.h5", size["docs"])
    cells = write_cells(
        folder / f"cells-{size['cells']}x{size['genes']}.h5ad", size["cells"], size["genes"]
    )
    fixed = {"tokens": write_fixed(folder / f"tokens-{size['docs']}-fixed.h5", tokens, "tokens")}
    if not isinstance(cells, str):
        cells_fixed = folder / f"cells-{size['cells']}x{size['genes']}-fixed.h5"
        fixed["cells"] = write_fixed(cells_fixed, cells, "X")
    rec.param(**size, limit_mib=LIMIT_MIB, load=os.getloadavg()[0])
    for batch, reps in ((64, 30), (256, 20), (1024, 10)):
        _padding(rec, tokens, batch, reps)
        _padding(rec, tokens, batch, reps, PAD_LENGTH)
    work = folder / f"work-{os.getpid()}"
    work.mkdir(exist_ok=True)
    _padded_epochs(rec, tokens, work, size)
    base = {"epochs": size["epochs"], "timeout": size["timeout"], "cap_s": 60}
    sets: list[tuple[str, dict[str, Any], list[str]]] = [
        (
            "tokens",
            {
                **base,
                "path": str(tokens),
                "top": "tokens",
                "tops": ["tokens", "label"],
                "batch": 64,
                "rows": size["docs"],
                "fixed": str(fixed["tokens"]),
            },
            ["raw", "layer", "numpy", "fixed", "layer-unshuffled"],
        ),
    ]
    if isinstance(cells, str):
        rec.note(f"sparse .h5ad: {cells}")
    else:
        sets.append(
            (
                "cells",
                {
                    **base,
                    "path": str(cells),
                    "top": "X",
                    "tops": ["X", "obs/n_counts"],
                    "batch": 256,
                    "rows": size["cells"],
                    "fixed": str(fixed["cells"]),
                },
                ["raw", "layer", "numpy", "fixed", "layer-unshuffled", "annloader"],
            )
        )
    try:
        with cgroups.warm_and_capped(
            f"asynchdf5-ragged-{os.getpid()}", LIMIT_MIB, rec.note
        ) as groups:
            for what, job, readers in sets:
                for label, group in groups:
                    page_cache.warm(job["path"])
                    rates: dict[str, float] = {}
                    firsts: dict[str, float] = {}  # epoch 1 alone, and epochs 2+ alone
                    laters: dict[str, float] = {}
                    for reader in readers:
                        name = f"{reader}-{what}-{'cg' if group else 'warm'}"
                        order = str(work / f"order-{what}-{label}.npy")
                        job_r = {**job, "reader": reader, "what": what, "order": order}
                        r, error = cgroups.run_child("benchmarks.ragged", job_r, work, name, group)
                        if error is not None:
                            rec.note(f"{what} {reader} ({label}): {error}")
                            continue
                        _record(rec, what, reader, label, r, rates, firsts, laters)
                    rec.ratio(
                        f"{what}: asynchdf5 ÷ raw read, {label}",
                        rates.get("layer"),
                        rates.get("raw"),
                    )
                    # The limits of the shuffled ratio, in the same run: what a plain NumPy gather
                    # from RAM and the layer's fixed rows of the same bytes reach.
                    rec.ratio(
                        f"{what}: NumPy resident (1 thread) ÷ raw read, {label}",
                        rates.get("numpy"),
                        rates.get("raw"),
                    )
                    rec.ratio(
                        f"{what}: asynchdf5 fixed rows ÷ raw read, {label}",
                        rates.get("fixed"),
                        rates.get("raw"),
                    )
                    rec.ratio(
                        f"{what}: asynchdf5 ÷ NumPy resident (1 thread), {label}",
                        rates.get("layer"),
                        rates.get("numpy"),
                    )
                    # The gather alone (epochs 2+: the file mapped, the buffers reused) and the
                    # first epoch (mapping the file's pages, filling fresh buffers) against the
                    # NumPy gather, which reads nothing and reuses its memory every epoch.
                    rec.ratio(
                        f"{what}: asynchdf5 epochs 2+ ÷ NumPy resident (1 thread), {label}",
                        laters.get("layer"),
                        rates.get("numpy"),
                    )
                    rec.ratio(
                        f"{what}: asynchdf5 epoch 1 ÷ NumPy resident (1 thread), {label}",
                        firsts.get("layer"),
                        rates.get("numpy"),
                    )
                    rec.ratio(
                        f"{what}: asynchdf5 ÷ asynchdf5 fixed rows, {label}",
                        rates.get("layer"),
                        rates.get("fixed"),
                    )
                    rec.ratio(
                        f"{what}: asynchdf5 unshuffled ÷ raw read, {label}",
                        rates.get("layer-unshuffled"),
                        rates.get("raw"),
                    )
                    rec.ratio(
                        f"{what}: asynchdf5 ÷ AnnLoader (backed), {label}",
                        rates.get("layer"),
                        rates.get("annloader"),
                    )
        _out_of_core(rec, size, folder, work)
    finally:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
    rec.note(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    cgroups.child(sys.argv[1], READERS)
