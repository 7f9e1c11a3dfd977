"""Time intervals: unions, differences and how long a set of intervals kept something busy.

The linker asks "how long was this lane busy between a and b" thousands of times (`BusyTime`, O(log n) a question);
the report builds step breakdowns from unions and differences of the `.et` nodes' work intervals. Both rest on one
union, `merge_intervals`.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable

Interval = tuple[float, float]


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of (start, end) intervals; empty ones are dropped."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1][1] = end
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def subtract_intervals(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """a minus b, both merged (sorted, disjoint)."""
    out = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        cursor = start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def clip_intervals(a: list[Interval], lo: float, hi: float) -> list[Interval]:
    """The parts of a inside [lo, hi]."""
    return [(max(s, lo), min(e, hi)) for s, e in a if e > lo and s < hi]


def total_length(a: Iterable[Interval]) -> float:
    return sum(e - s for s, e in a)


class BusyTime:
    """Union of time intervals, answering 'how long was it busy between a and b' in O(log n)."""

    def __init__(self, starts: list[float], ends: list[float]):
        merged = merge_intervals(zip(starts, ends))
        self.starts = [start for start, _ in merged]
        self.ends = [end for _, end in merged]
        self.before = [0.0]  # busy time before interval k
        for start, end in merged:
            self.before.append(self.before[-1] + end - start)

    def busy_until(self, t: float) -> float:
        k = bisect.bisect_right(self.starts, t)
        if k == 0:
            return 0.0
        return self.before[k - 1] + min(t, self.ends[k - 1]) - self.starts[k - 1]

    def overlap(self, a: float, b: float) -> float:
        return max(0.0, self.busy_until(b) - self.busy_until(a)) if b > a else 0.0
