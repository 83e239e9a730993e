"""Access to a data set's files for the baselines: page-cache control, h5py rows (the stored
byte ranges are the package's: :func:`asynchdf5._cli._limits.stored_ranges`).

This is benchmark plumbing, deliberately plain: the baselines are what a careful user would write
with h5py, over the same files the library reads.
"""

from __future__ import annotations

from types import TracebackType

import h5py
import numpy as np
import numpy.typing as npt

from benchmarks import page_cache
from benchmarks.data import DatasetFiles


def evict(files: DatasetFiles) -> None:
    """Drop the files' pages from the page cache (they must be clean: the generator syncs)."""
    for path in files.paths:
        page_cache.evict(path)


def warm(files: DatasetFiles) -> None:
    """Read every file once so that its pages are in the page cache."""
    for path in files.paths:
        page_cache.warm(path)


class H5Rows:
    """Rows of one top over all files of a data set, read through h5py.

    Global row ``i`` is row ``i - start[f]`` of file ``f``; reads that straddle files are split.
    """

    def __init__(self, files: DatasetFiles, top: str, rdcc_nbytes: int | None = None) -> None:
        kw = {} if rdcc_nbytes is None else {"rdcc_nbytes": rdcc_nbytes}
        self.files = [h5py.File(p, "r", **kw) for p in files.paths]
        self.dsets: list[h5py.Dataset] = [f[top] for f in self.files]
        self.starts = np.concatenate([[0], np.cumsum([len(d) for d in self.dsets])]).astype(
            np.int64
        )
        self.shape: tuple[int, ...] = (int(self.starts[-1]), *self.dsets[0].shape[1:])
        self.dtype = self.dsets[0].dtype

    def __len__(self) -> int:
        return self.shape[0]

    def empty(self, n: int) -> npt.NDArray[np.generic]:
        """An uninitialised array for ``n`` rows."""
        return np.empty((n, *self.shape[1:]), self.dtype)

    def read_direct(self, start: int, stop: int, out: npt.NDArray[np.generic]) -> None:
        """Read rows ``[start, stop)`` into ``out[: stop - start]`` with ``Dataset.read_direct``."""
        for f, dset in enumerate(self.dsets):
            lo, hi = max(start, int(self.starts[f])), min(stop, int(self.starts[f + 1]))
            if lo < hi:
                base = int(self.starts[f])
                dset.read_direct(out, np.s_[lo - base : hi - base], np.s_[lo - start : hi - start])

    def slab(self, start: int, stop: int) -> npt.NDArray[np.generic]:
        """Rows ``[start, stop)`` by slicing (``dset[a:b]``), the way most code reads."""
        parts = []
        for f, dset in enumerate(self.dsets):
            lo, hi = max(start, int(self.starts[f])), min(stop, int(self.starts[f + 1]))
            if lo < hi:
                base = int(self.starts[f])
                parts.append(dset[lo - base : hi - base])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def fancy(self, sorted_idx: npt.NDArray[np.int64]) -> npt.NDArray[np.generic]:
        """Rows at increasing indices, one h5py fancy-index read per file touched."""
        cuts = np.searchsorted(sorted_idx, self.starts)
        parts = []
        for f, dset in enumerate(self.dsets):
            sel = sorted_idx[cuts[f] : cuts[f + 1]]
            if len(sel):
                parts.append(dset[sel - self.starts[f]])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def row(self, i: int) -> npt.NDArray[np.generic]:
        """One row (``dset[i]``), as a per-sample ``__getitem__`` reads it."""
        f = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.dsets[f][i - int(self.starts[f])]  # type: ignore[no-any-return]

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> H5Rows:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
