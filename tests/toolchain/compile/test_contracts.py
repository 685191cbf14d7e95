"""The argmax-exact contract (a pass that may move non-argmax logits within a bound): the gated
difference is the one at each row's argmax, a moved argmax is infinitely different unless the
reference has a near tie there, and the pass runner names it."""

from __future__ import annotations

import numpy as np
import pytest

from toolchain.compile.contracts import argmax_exact_diff
from toolchain.compile.pass_runner import compare_outputs
from toolchain.errors import PassError


def _logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, 50)).astype(np.float32)


def test_other_entries_may_move_the_argmax_may_not():
    ref = _logits()
    got = ref.copy()
    top = ref.argmax(-1)
    low = ref.argmin(-1)
    got[0, np.arange(3), low] += 0.5  # a non-argmax entry moves, staying below the top
    assert argmax_exact_diff(ref, got, 1e-4) == 0.0
    got[0, 1, top[0, 1]] += 1e-3  # the argmax's own value moves: that is what is gated
    assert argmax_exact_diff(ref, got, 1e-4) == pytest.approx(1e-3, rel=1e-3)
    moved = ref.copy()
    moved[0, 2, low[0, 2]] = ref[0, 2].max() + 1.0  # another token overtakes the argmax
    assert argmax_exact_diff(ref, moved, 1e-4) == float("inf")


def test_a_near_tie_may_resolve_either_way():
    ref = _logits()
    i = ref[0, 0].argmax()
    j = np.argsort(ref[0, 0])[-2]
    ref[0, 0, j] = ref[0, 0, i] - 1e-6  # the reference's top-2 within the tie
    got = ref.copy()
    got[0, 0, j] = ref[0, 0, i] + 1e-6  # ... and the pass picked the other one
    assert argmax_exact_diff(ref, got, 1e-4) < 1e-5
    assert argmax_exact_diff(ref, got, 1e-7) == float("inf")


def test_the_pass_runner_applies_the_contract_only_where_declared():
    ref = {"decode": {"logits": _logits(), "new_key_0": np.zeros((2, 2), np.float32)}}
    got = {"decode": {"logits": ref["decode"]["logits"].copy(), "new_key_0": np.zeros((2, 2), np.float32)}}
    low = ref["decode"]["logits"].argmin(-1)
    got["decode"]["logits"][0, np.arange(3), low] += 0.5
    with pytest.raises(PassError, match="logits"):
        compare_outputs("p", ref, got, 1e-4)  # undeclared: every entry is gated
    assert compare_outputs("p", ref, got, 1e-4, frozenset({"logits"}))["decode"]["logits"] == 0.0
    got["decode"]["logits"][0, 0, low[0, 0]] += 100.0
    with pytest.raises(PassError, match="argmax"):
        compare_outputs("p", ref, got, 1e-4, frozenset({"logits"}))
