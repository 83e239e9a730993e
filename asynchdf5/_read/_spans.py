"""Row or byte spans: sorted, disjoint ``(start, stop)`` intervals (what a reader has loaded or
mapped, and what it still needs)."""

from __future__ import annotations

import bisect
import math

__all__ = ["merged", "uncovered"]


def merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted and merged into disjoint intervals."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
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
