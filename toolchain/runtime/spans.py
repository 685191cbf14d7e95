"""Busy intervals of two threads: how much of one path's work ran while the other was in a call."""

from __future__ import annotations

from collections.abc import Sequence


def overlapped_seconds(main: Sequence[tuple[float, float]], side: Sequence[tuple[float, float]]) -> float:
    """Seconds of the side path's (start, end) intervals that fall inside the main path's.

    Both lists are in time order and neither overlaps itself (each path makes one call at a time).
    """
    both = 0.0
    j = 0
    for s, e in side:
        while j < len(main) and main[j][1] <= s:
            j += 1
        k = j
        while k < len(main) and main[k][0] < e:
            both += max(0.0, min(e, main[k][1]) - max(s, main[k][0]))
            k += 1
    return both
