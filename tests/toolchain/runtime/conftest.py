"""Shared tiny artifacts for the tree policies (lever, predictor pruning, ahasd): compiled once per session."""

from __future__ import annotations

import pytest

from tests.tiny import save_tiny, write_recipe

TREE_BASE = "  decode: {width: 1, context: 64}\n"  # the widest tree graph doubles as prefill: fewer compiles
TREE_GRAPHS = "  tree4: {width: 4, context: 64, role: tree}\n  tree8: {width: 8, context: 64, role: tree}\n"


@pytest.fixture(scope="session")
def tree_artifacts(tmp_path_factory):
    """(target, draft) folders: the target has tree widths 4/8, its lm_head split off and a cut at layer 1."""
    from toolchain.pipeline import compile_recipe

    root = tmp_path_factory.mktemp("tree_policies")
    target = write_recipe(root / "t.yaml", save_tiny(root / "t_hf", "llama", seed=0), name="target",
                          graphs=TREE_BASE + TREE_GRAPHS, extra="passes: [split_lm_head, {split_layers: {at: [1]}}]\n")
    draft = write_recipe(root / "d.yaml", save_tiny(root / "d_hf", "llama", seed=1), name="draft",
                         graphs=TREE_BASE + "  tree4: {width: 4, context: 64, role: tree}\n")
    return compile_recipe(target).out_dir, compile_recipe(draft).out_dir
