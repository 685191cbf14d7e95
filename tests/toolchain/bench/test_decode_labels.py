"""`mobc bench decode --baseline`: every baseline keeps its own row, even when two artifacts share
a recipe name."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from toolchain.bench.decode import baseline_labels


def _art(name: str, folder: str):
    return SimpleNamespace(name=name, folder=Path("/x") / folder)


def test_distinct_names_label_their_rows():
    assert baseline_labels([_art("a", "f1"), _art("b", "f2")]) == ["a", "b"]


def test_shared_names_fall_back_to_folders():
    arts = [_art("cpu", "cpu-q4"), _art("cpu", "cpu-split")]
    assert baseline_labels(arts) == ["cpu-q4", "cpu-split"]
    same = [_art("cpu", "x"), _art("cpu", "x")]  # one folder given twice
    assert len(set(baseline_labels(same))) == 2
