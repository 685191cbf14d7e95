"""ArtifactSessions under a resident-bytes budget: same outputs, never more than the budget open."""

from __future__ import annotations

import numpy as np

from toolchain.runtime.cache import KVCache
from toolchain.runtime.sessions import ArtifactSessions


def test_budget_closes_least_recently_used_sessions(tree_artifacts):
    folder = tree_artifacts[0]  # three stages: part 0, part 1, lm_head
    free = ArtifactSessions(folder)
    fam = free.families()[0]
    layout = free.layout(fam)
    feeds = KVCache(layout, free.rope).step_inputs([1] * layout.width, layout.width)
    want = free.run_family(fam, feeds)
    smallest = min(s.weight_bytes for s in free.stages.values())
    tight = ArtifactSessions(folder, max_resident_bytes=smallest)
    for _ in range(2):
        got = tight.run_family(fam, feeds)
        for name, arr in want.items():
            np.testing.assert_allclose(got[name], arr, rtol=0, atol=1e-5)  # no prepacked kernels: rounding differs
        assert len(tight._sessions) == 1
    assert len(free._sessions) == len(free.chain(fam))
