"""Copying runs of values in blocks (:mod:`asynchdf5._blocks`): every run lands in its place,
whatever its length, dtype or trailing shape, and whatever the path (blocks, value by value,
a slice each)."""

from __future__ import annotations

import numpy as np
import pytest

from asynchdf5._blocks import BLOCK_BYTES, copy_runs, stage_blocks


@pytest.mark.parametrize("longest", [0, 3, 40, 700, 40_000])
@pytest.mark.parametrize("trailing", [(), (3,)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_copy_runs_puts_every_run_in_its_place(
    longest: int, trailing: tuple[int, ...], contiguous: bool
) -> None:
    """Runs read from anywhere in the source (overlapping each other too) and written to
    disjoint places of the destination, with gaps between them left as they were."""
    rng = np.random.default_rng(longest)
    n = 30
    count = rng.integers(0, longest + 1, n)
    width = int(np.prod(trailing))
    values = max(1, int(count.max(initial=0)) * 2)
    source: np.ndarray = np.arange(values * width, dtype=np.int16).reshape(values, *trailing)
    if not contiguous:  # a strided view: copied a slice a run
        source = np.repeat(source, 2, axis=0)[::2]
    start = rng.integers(0, values - count + 1)
    gaps = rng.integers(0, 3, n)
    at = np.cumsum(count + gaps) - count
    dest = np.full((int((count + gaps).sum()), *trailing), -1, np.int16)
    want = dest.copy()
    for a, b, k in zip(start, at, count, strict=True):
        want[b : b + k] = source[a : a + k]
    copy_runs([source], [dest], start.astype(np.int64), at.astype(np.int64), count)
    np.testing.assert_array_equal(dest, want)


def test_block_copies_let_go_of_the_gil() -> None:
    """Each block copy indexes more blocks than NumPy's threshold for letting go of the GIL
    (500 items), whatever the block's bytes: the other gathering thread copies meanwhile."""
    for width in (1, 2, 4, 8, 16, 24):
        for size in BLOCK_BYTES:
            assert stage_blocks(size * width) > 500


def test_copy_runs_over_many_stages() -> None:
    """Thousands of runs, copied in blocks through several temporaries each size."""
    rng = np.random.default_rng(7)
    count = rng.integers(0, 1500, 3000)
    source = rng.integers(0, 2**31, 4_000_000).astype(np.int32)
    start = rng.integers(0, len(source) - count)
    at = np.zeros(len(count), np.int64)
    np.cumsum(count[:-1], out=at[1:])
    dest = np.zeros(int(count.sum()), np.int32)
    copy_runs([source], [dest], start, at, count)
    want = np.concatenate([source[a : a + k] for a, k in zip(start, count, strict=True)])
    np.testing.assert_array_equal(dest, want)


@pytest.mark.parametrize("grain", [4, 12])
def test_runs_of_whole_values_copied_as_bytes_land_in_their_place(grain: int) -> None:
    """Runs of bytes, each whole values of ``grain`` bytes at any byte offset of the source (a
    mapped heap in chunks: :class:`~asynchdf5._read._maps.ChunkHeap`), short and long: each
    lands in its place, the short ones copied a value at a time."""
    rng = np.random.default_rng(grain)
    count = rng.integers(0, 40, 500) * grain
    source = rng.integers(0, 256, 100_000).astype(np.uint8)
    start = rng.integers(0, len(source) - count)  # any byte
    at = np.zeros(len(count), np.int64)
    np.cumsum(count[:-1], out=at[1:])
    dest = np.zeros(int(count.sum()), np.uint8)
    copy_runs([source], [dest], start, at, count, grain=grain)
    want = np.concatenate([source[a : a + k] for a, k in zip(start, count, strict=True)])
    np.testing.assert_array_equal(dest, want)


def _stored_in_chunks(
    rng: np.random.Generator, values: np.ndarray, chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """``values`` stored as the bytes of chunks of ``chunk`` values (the last one padded),
    written in a random order with gaps of random bytes of any size before some of them (other
    data, the chunk index's nodes): the bytes, and each chunk's offset in them, in value
    order."""
    vb = values.nbytes // max(1, len(values))
    count = -(-len(values) // chunk)
    at = np.zeros(count, np.int64)
    parts, pos = [], 0
    for k in rng.permutation(count).tolist():
        gap = int(rng.choice([0, 0, chunk * vb, int(rng.integers(1, 3 * vb + 1))]))
        parts.append(rng.integers(0, 256, gap, dtype=np.uint8))
        at[k] = pos = pos + gap
        stored = np.zeros(chunk * vb, np.uint8)
        own = values[k * chunk : (k + 1) * chunk].reshape(-1).view(np.uint8)
        stored[: len(own)] = own
        parts.append(stored)
        pos += chunk * vb
    return np.concatenate(parts), at


@pytest.mark.parametrize("seed", range(4))
def test_runs_out_of_values_stored_in_chunks_anywhere_are_their_values(seed: int) -> None:
    """A heap stored in chunks (:class:`~asynchdf5._read._maps.ChunkHeap`) at random places of
    its bytes, in any order, some back to back (a chunk may lie exactly where it would if the
    one before it were back to back with the one before that, the one between elsewhere): runs
    of values, short and long, empty ones among them, copied out of it alone and beside a
    second heap in other chunks (a sparse top's column indices, their runs shared) are the
    values. (A run over three chunks was copied as one span when its first and last chunk lay
    as if back to back: fixed by a run of chunks per chunk, :attr:`ChunkHeap.run`.)"""
    from asynchdf5._read._maps import ChunkHeap

    rng = np.random.default_rng(seed)
    for _ in range(25):
        n = int(rng.integers(1, 400))
        chunk = int(rng.integers(1, 12))
        shape = ((), (3,))[int(rng.integers(0, 2))]
        values = rng.integers(-(2**40), 2**40, (n, *shape)).astype(rng.choice(["i1", "i4", "f8"]))
        column = rng.integers(0, 2**31, n).astype(np.int32)
        heaps = []
        for v in (values, column):
            data, at = _stored_in_chunks(rng, v, chunk)
            heaps.append(ChunkHeap(data, at, chunk, n, v.dtype, v.shape[1:]))
        start = rng.integers(0, n, 60)
        count = np.minimum(rng.integers(0, 3 * chunk + 40, 60), n - start)
        at = np.zeros(len(count), np.int64)
        np.cumsum(count[:-1], out=at[1:])
        alone = np.empty((int(count.sum()), *shape), values.dtype)
        heaps[0].copy_into(alone, start, at, count)
        both = [np.empty_like(alone), np.empty(len(alone), np.int32)]
        heaps[0].copy_many(heaps, both, start, at, count)
        for v, got in ((values, alone), (values, both[0]), (column, both[1])):
            want = np.concatenate([v[a : a + k] for a, k in zip(start, count, strict=True)])
            np.testing.assert_array_equal(got, want)
        a = int(rng.integers(0, n))
        np.testing.assert_array_equal(heaps[0][a:], values[a:])


def test_runs_of_every_class_from_sources_with_starts_of_their_own() -> None:
    """Runs of every block class and shorter ones (runs of no values among them), in a random
    order, copied from two sources of different widths, each from starts of its own, and from a
    third sharing the first one's starts: every run of every source lands in its place (the
    runs are regrouped by class, each source's starts with them)."""
    rng = np.random.default_rng(11)
    lengths = [0, 1, 3, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1023, 1024, 1025, 3000]
    count = rng.permutation(np.repeat(np.array(lengths, np.int64), 5))
    at = np.zeros(len(count), np.int64)
    np.cumsum(count[:-1] + 2, out=at[1:])  # gaps of 2 values between the runs
    values = 20_000
    sources: list[np.ndarray] = [
        rng.integers(0, 2**31, values).astype(np.int32),
        rng.integers(0, 2**62, (values, 2)).astype(np.int64),
        rng.integers(0, 2**15, values).astype(np.int16),
    ]
    first, second = (rng.integers(0, values - count + 1) for _ in range(2))
    dests = [np.full((int(at[-1] + count[-1] + 2), *s.shape[1:]), -1, s.dtype) for s in sources]
    wants = [d.copy() for d in dests]
    for source, want, start in zip(sources, wants, (first, second, first), strict=True):
        for a, b, k in zip(start.tolist(), at.tolist(), count.tolist(), strict=True):
            want[b : b + k] = source[a : a + k]
    copy_runs(sources, dests, [first, second, first], at, count)
    for dest, want in zip(dests, wants, strict=True):
        np.testing.assert_array_equal(dest, want)
