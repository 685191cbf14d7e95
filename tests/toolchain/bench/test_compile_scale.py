"""The scale bench's parts: streamed random checkpoints of a shape, and a measured child compile."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import yaml

from toolchain.bench.checkpoints import SHAPES, Shape, write_random_llama
from toolchain.bench.compile_scale import recipe_for, run_compile, verification


def test_random_checkpoint_loads_in_transformers_with_the_shape(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = Shape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, mlp=96, tied=False)
    folder = write_random_llama(tmp_path / "m", shape)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.num_parameters() == shape.parameters()
    assert model.config.num_key_value_heads == 2 and not model.config.tie_word_embeddings
    w = model.model.layers[1].mlp.down_proj.weight
    assert tuple(w.shape) == (64, 96) and 0.015 < float(w.std()) < 0.025  # HF's initializer range
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    assert len(AutoTokenizer.from_pretrained(folder)) == shape.vocab


def test_published_shapes():
    assert abs(SHAPES["1.2b"].parameters() - 1.174e9) < 1e6  # the 1.17B (4.7 GB fp32)
    assert 2.95e9 < SHAPES["3b"].parameters() < 3.0e9  # Llama-3.2-3B's 3.21B minus 79k fewer vocab rows
    assert SHAPES["8b"].hidden == 4096 and SHAPES["8b"].mlp == 14336


def test_child_compile_is_measured_and_verified(tmp_path):
    shape = Shape("tiny", hidden=64, layers=2, heads=4, kv_heads=2, mlp=96)
    ckpt = write_random_llama(tmp_path / "m", shape)
    recipe = recipe_for("tiny", ckpt, "npu", context=64, prefill=8)
    recipe["verify"]["greedy_tokens"] = 4
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run = run_compile(path, tmp_path / "out", tmp_path / "log.txt")
    assert run["exit_code"] == 0, (tmp_path / "log.txt").read_text()[-2000:]
    assert 100e6 < run["peak_rss_bytes"] < 8e9  # the child's own peak, not this process's
    assert run["peak_after_stage"]  # sampled while it ran: the stage holding the peak is named
    v = verification(tmp_path / "out")
    assert v["greedy_identical"] is True and v["logits_max_abs"] < 1e-3 and v["parts"] >= 4
    passes = [p["pass"] for p in json.loads((tmp_path / "out" / "manifest.json").read_text())["passes"]]
    assert passes == ["fold_constants", "scale_rmsnorm", "mha_to_sha", "linear_to_conv", "split_lm_head",
                      "split_parts", "check_htp"]
    assert not np.isnan(v["logits_max_abs"])


def test_recipe_names_its_checkpoint_absolutely(tmp_path, monkeypatch):
    """`--work build/x` is relative to the cwd, the recipe's source path to the recipe's folder:
    a relative checkpoint path doubled into build/x/build/x/... and every compile failed."""
    monkeypatch.chdir(tmp_path)
    recipe = recipe_for("tiny", Path("work") / "llama-tiny", "npu", context=64, prefill=8)
    assert recipe["source"]["path"] == str(tmp_path / "work" / "llama-tiny")
