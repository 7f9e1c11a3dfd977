"""Unions of time intervals (trace_tools/intervals.py), checked against a per-microsecond mask of the same intervals."""
import random

import numpy as np

from trace_tools.intervals import BusyTime, clip_intervals, merge_intervals, subtract_intervals, total_length

SPAN = 400


def _mask(intervals) -> np.ndarray:
    mask = np.zeros(SPAN, dtype=bool)
    for start, end in intervals:
        mask[max(start, 0):max(end, 0)] = True
    return mask


def _random_intervals(rng: random.Random, count: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(count):
        start = rng.randrange(0, SPAN - 1)
        out.append((start, min(SPAN, start + rng.choice((0, 1, 3, 20, 90)))))
    return out


def test_a_union_is_sorted_disjoint_and_drops_empty_intervals():
    assert merge_intervals([(5, 9), (1, 3), (2, 4), (9, 12), (7, 7), (20, 20)]) == [(1, 4), (5, 12)]


def test_difference_and_clip_on_a_small_case():
    a = merge_intervals([(0, 10), (20, 30)])
    b = merge_intervals([(2, 4), (8, 22), (29, 40)])
    assert subtract_intervals(a, b) == [(0, 2), (4, 8), (22, 29)]
    assert clip_intervals(a, 5, 25) == [(5, 10), (20, 25)]
    assert total_length(a) == 20


def test_union_difference_and_busy_time_match_a_mask_of_the_same_intervals():
    rng = random.Random(7)
    for _ in range(200):
        a = _random_intervals(rng, rng.randrange(0, 12))
        b = _random_intervals(rng, rng.randrange(0, 12))
        union_a, union_b = merge_intervals(a), merge_intervals(b)
        assert _mask(union_a).tolist() == _mask(a).tolist()
        assert all(e1 < s2 for (_, e1), (s2, _) in zip(union_a, union_a[1:]))  # disjoint, not even touching
        assert _mask(subtract_intervals(union_a, union_b)).tolist() == (_mask(a) & ~_mask(b)).tolist()
        lo, hi = sorted(rng.sample(range(SPAN + 1), 2))
        busy = BusyTime([s for s, _ in a], [e for _, e in a])
        assert busy.overlap(lo, hi) == int(_mask(a)[lo:hi].sum())
        assert busy.overlap(lo, hi) == total_length(clip_intervals(union_a, lo, hi))
        assert busy.overlap(hi, lo) == 0.0
