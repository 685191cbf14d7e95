"""The pass check's comparison: logits and caches by absolute difference, the exposed residual
stream (`hidden`) relative to its largest entry."""

from __future__ import annotations

import numpy as np
import pytest

from toolchain.compile.pass_runner import compare_outputs
from toolchain.errors import PassError


def _outs(hidden: np.ndarray, logits: np.ndarray) -> dict:
    return {"decode": {"hidden": hidden, "logits": logits}}


def test_hidden_is_compared_relative_to_its_magnitude():
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, 4, 8)).astype(np.float32)
    hidden[0, 0, 0] = 2.0e4  # an attention-sink entry
    logits = rng.standard_normal((1, 4, 16)).astype(np.float32)
    reordered = hidden.copy()
    reordered[0, 0, 0] += 2e-3  # float32 reordering of a 2e4 entry: relative 1e-7
    diffs = compare_outputs("p", _outs(hidden, logits), _outs(reordered, logits), 1e-3)
    assert diffs["decode"]["hidden"] == pytest.approx(2e-3, rel=0.1)  # reported as measured
    broken = hidden.copy()
    broken[0, 1, :] += 50.0  # a pass that breaks a row: 2.5e-3 of the largest entry
    with pytest.raises(PassError, match="'hidden' relative to its largest entry"):
        compare_outputs("p", _outs(hidden, logits), _outs(broken, logits), 1e-3)


def test_logits_stay_absolute():
    hidden = np.full((1, 1, 8), 2.0e4, np.float32)
    logits = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(PassError, match="output 'logits' by 0.002"):
        compare_outputs("p", _outs(hidden, logits), _outs(hidden, logits + 2e-3), 1e-3)
