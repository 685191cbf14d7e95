"""Compiling a draft head (toolchain/compile/head.py): its graphs compute its torch module, bad inputs fail clearly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tests.toolchain.head_fixtures import head_recipe, head_weights, tiny_head_world
from toolchain.cli.main import app
from toolchain.compile import head as head_mod
from toolchain.compile.export import ExportError
from toolchain.compile.head import HeadError
from toolchain.compile.pipeline import compile_recipe
from toolchain.runtime.sessions import ArtifactSessions


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tiny_head_world(tmp_path_factory.mktemp("head"))


def test_head_graphs_compute_the_module_and_carry_the_draft_vocabulary(world):
    hf, _, head = world
    sessions = ArtifactSessions(head)
    info = sessions.manifest.model.draft_head
    assert info is not None and info["target_vocab"] == 512
    np.testing.assert_array_equal(np.load(head / info["vocab_file"]), np.arange(0, 512, 2))
    v = sessions.manifest.verification["head"]
    assert v["ok"] and v["max_abs_logits"] < 1e-4 and v["argmax_identical"] == v["rows"]
    decode = sessions.chain("decode")[0]
    assert "features" in decode.input_names and decode.output_names[:2] == ["logits", "hidden"]
    assert decode.input_shape("features")[0] == [1, 1, sessions.manifest.model.hidden]
    assert sessions.manifest.model.vocab == 256  # logits over the draft vocabulary
    report = (head / "report.md").read_text()  # its own check, not an empty table of target families
    assert "## Draft head verification" in report and "Verification against transformers" not in report
    shown = CliRunner().invoke(app, ["inspect", str(head)], terminal_width=200)
    assert shown.exit_code == 0 and "Draft head verification" in shown.output, shown.output
    assert "Verification against transformers" not in shown.output


def test_a_two_layer_head_compiles_with_a_cache_per_layer_and_computes_its_module(world, tmp_path):
    hf, _, _ = world
    weights = head_weights(hf, tmp_path / "w2.safetensors", layers=2)
    out = compile_recipe(head_recipe(tmp_path, hf, weights, name="deep")).out_dir
    sessions = ArtifactSessions(out)
    assert sessions.manifest.model.n_layers == 2
    decode = sessions.chain("decode")[0]
    assert {"past_key_0", "past_key_1", "past_value_1"} <= set(decode.input_names)
    assert {"new_key_1", "new_value_1"} <= set(decode.output_names)
    v = sessions.manifest.verification["head"]
    assert v["ok"] and v["max_abs_logits"] < 1e-4 and v["argmax_identical"] == v["rows"]


def test_a_graph_that_skips_a_layer_fails_the_compile(world, tmp_path, monkeypatch):
    """The row-by-row check sees every layer: a two-layer head's graph that runs only its first differs."""
    hf, _, _ = world
    weights = head_weights(hf, tmp_path / "w2.safetensors", layers=2)
    original = head_mod.HeadStepGraph.forward

    def first_layer_twice(self, input_ids, features, mask, cos, sin, *past):
        layers = self.head.layers
        self.head.layers = torch.nn.ModuleList([layers[0], layers[0]])
        try:
            return original(self, input_ids, features, mask, cos, sin, *past)
        finally:
            self.head.layers = layers

    monkeypatch.setattr(head_mod.HeadStepGraph, "forward", first_layer_twice)
    with pytest.raises(ExportError, match="does not compute its torch module"):
        compile_recipe(head_recipe(tmp_path, hf, weights, name="skips"))
    assert not (tmp_path / "out" / "skips").exists()


def test_a_graph_that_misreads_its_features_fails_the_compile(world, tmp_path, monkeypatch):
    """A head graph that skips the final norm on its features differs from the module: the compile stops."""
    hf, _, _ = world
    weights = head_weights(hf, tmp_path / "w.safetensors")
    mix = head_mod.DraftHead.mix
    monkeypatch.setattr(head_mod.HeadStepGraph, "forward", _forward_skipping_norm(mix))
    recipe = head_recipe(tmp_path, hf, weights, name="broken")
    with pytest.raises(ExportError, match="does not compute its torch module"):
        compile_recipe(recipe)
    assert not (tmp_path / "out" / "broken").exists()  # nothing half-written that looks complete


def _forward_skipping_norm(mix):
    original = head_mod.HeadStepGraph.forward

    def forward(self, input_ids, features, *rest):
        self.head.mix = lambda f, t, normalized=False: mix(self.head, f, t, normalized=True)
        try:
            return original(self, input_ids, features, *rest)
        finally:
            del self.head.mix

    return forward


def test_weights_of_another_target_or_no_file_are_clear_errors(world, tmp_path):
    hf, _, _ = world
    with pytest.raises(HeadError, match="do not exist"):
        compile_recipe(head_recipe(tmp_path, hf, tmp_path / "missing.safetensors", name="a"))
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"fc.weight": torch.zeros(8, 16).half(), "fc.bias": torch.zeros(8).half(),
               "layer.input_layernorm.weight": torch.ones(8).half(), "vocab_ids": torch.arange(4).int()}, str(other))
    with pytest.raises(HeadError, match="trained for another target"):
        compile_recipe(head_recipe(tmp_path, hf, other, name="b"))
