"""Overlap of two paths' busy intervals against a brute-force reference."""

from __future__ import annotations

import numpy as np

from toolchain.runtime.spans import overlapped_seconds


def _spans(rng: np.random.Generator, n: int) -> list[tuple[float, float]]:
    edges = np.sort(rng.uniform(0, 10, 2 * n))
    return [(float(edges[2 * i]), float(edges[2 * i + 1])) for i in range(n)]


def test_overlap_equals_pairwise_sum():
    rng = np.random.default_rng(0)
    for _ in range(50):
        main, side = _spans(rng, int(rng.integers(0, 6))), _spans(rng, int(rng.integers(0, 6)))
        ref = sum(max(0.0, min(e, b) - max(s, a)) for s, e in side for a, b in main)
        assert abs(overlapped_seconds(main, side) - ref) < 1e-9
    assert overlapped_seconds([(0.0, 1.0), (2.0, 3.0)], [(0.5, 2.5)]) == 1.0
