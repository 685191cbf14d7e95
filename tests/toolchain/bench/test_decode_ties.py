"""The decode bench tells a greedy output that leaves ar's at a float tie from a real mismatch."""

from __future__ import annotations

import io

import numpy as np

from tests.tiny import tiny_tokenizer
from toolchain.bench.decode import first_divergence
from toolchain.runtime.model import StepModel
from toolchain.runtime.policies import Sampler, make_policy


def test_first_divergence_measures_the_targets_gap_between_the_two_tokens(tree_artifacts):
    target_dir, _ = tree_artifacts
    target = StepModel(target_dir)
    ids = tiny_tokenizer()("def f(x):\n    return").input_ids
    ref = [t for c in make_policy("ar", target).generate(ids, 12, Sampler()) for t in c]
    d = 5
    target.reset()
    logits = target.prefill([*ids, *ref[:d]])
    runner_up, last = (int(t) for t in np.argsort(-logits)[[1, -1]])
    want = float(logits[ref[d]] - logits[runner_up])
    assert want > 0
    out = [*ref[:d], runner_up, *ref[d + 1 :]]
    div = first_divergence(target, ids, ref, out, tol=want * 1.01)
    assert div["position"] == d and abs(div["gap"] - want) < 1e-5 and div["tie"]
    assert not first_divergence(target, ids, ref, out, tol=want * 0.5)["tie"]
    # the target's least likely token there: far from a tie at the default tolerance
    far = first_divergence(target, ids, ref, [*ref[:d], last, *ref[d + 1 :]])
    assert far["gap"] > 1.0 and not far["tie"]
    # an output that stops early is no tie between two tokens
    assert first_divergence(target, ids, ref, ref[:7]) == {"position": 7, "gap": None, "tie": False}
    assert target.length == 0  # left reset for the next policy


def test_the_greedy_verdict_names_ties_apart_from_mismatches(monkeypatch):
    from rich.console import Console

    from toolchain.cli import bench

    lines: list[str] = []
    monkeypatch.setattr(bench, "console", Console(width=400, record=True, file=io.StringIO()))

    def verdict(rows):
        bench.print_greedy_verdict(rows)
        lines.append(bench.console.export_text())

    verdict([("ar", 3, 0, 3), ("chain", 3, 0, 3)])
    verdict([("ar", 3, 0, 3), ("chain", 2, 1, 3)])
    verdict([("ar", 3, 0, 3), ("chain", 2, 1, 3), ("lever", 2, 0, 3)])
    assert "reproduces ar token for token on every prompt" in lines[0]
    assert "except 1 output(s)" in lines[1] and "mismatch" not in lines[1]
    assert "greedy mismatch vs ar: lever" in lines[2] and "chain" not in lines[2]
