"""Row or byte spans: sorted, disjoint ``(start, stop)`` intervals (what a reader has loaded or
mapped, and what it still needs)."""

from __future__ import annotations

import bisect
import math

import numpy as np

__all__ = ["gaps", "merged", "uncovered"]


def merged(spans: list[tuple[int, int]], bridge: int = 0) -> list[tuple[int, int]]:
    """``spans`` sorted and merged into disjoint intervals, those at most ``bridge`` apart
    joined with what lies between them."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1] + bridge:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def uncovered(spans: list[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """The parts of ``a:b`` that none of ``spans`` (sorted, disjoint) covers."""
    out = []
    pos = a
    first = max(0, bisect.bisect_right(spans, (a, math.inf)) - 1)
    for s, e in spans[first:]:
        if s >= b:
            break
        if e <= pos:
            continue
        if s > pos:
            out.append((pos, s))
        pos = e
        if pos >= b:
            break
    if pos < b:
        out.append((pos, b))
    return out


def gaps(lo: np.ndarray, hi: np.ndarray, a: int, b: int) -> list[tuple[int, int]]:
    """The parts of ``a:b`` that no span ``lo[i]:hi[i]`` covers (spans in any order, overlapping
    or not): :func:`uncovered` of the :func:`merged` spans, for many spans at once."""
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    if len(lo) == 0:
        return [(a, b)] if a < b else []
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], np.maximum.accumulate(hi[order])  # hi: the furthest reach so far
    new = np.flatnonzero(lo[1:] > hi[:-1]) + 1  # where a span starts past all before it
    starts = np.r_[a, hi[new - 1], hi[-1]]  # a gap starts where a merged span ends ...
    stops = np.r_[lo[0], lo[new], b]  # ... and stops where the next one starts
    np.clip(starts, a, b, out=starts)
    np.clip(stops, a, b, out=stops)
    keep = starts < stops
    return list(zip(starts[keep].tolist(), stops[keep].tolist(), strict=True))
