"""lora_inputs on tiny models of every architecture: zero = base exactly, bound = merged weights,
per-row slots (mixed batch), and composition with mha_to_sha (per-head B inputs)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from passes import build
from passes.lora_inputs import site_of
from tests.lora_tiny import MAX_RANK, SLOTS, lora_feeds, merged, random_adapter, run_graph
from tests.passes.tiny import feeds_for, tiny
from toolchain.errors import RecipeError


def _apply(model: ir.Model, targets: list[str], sha: bool = False) -> ir.Model:
    m = model.clone()
    if sha:
        build("mha_to_sha")(m)
    p = build({"lora_inputs": {"targets": targets, "max_rank": MAX_RANK, "slots": SLOTS}})
    p(m)  # PassBase.__call__ runs requires, call and ensures
    return m


def _close(got: dict, want: dict, atol: float = 2e-4) -> None:
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, atol=atol, rtol=1e-4, err_msg=name)


def test_zero_inputs_reproduce_base_exactly(arch):
    layout, base = tiny(arch)
    feeds = feeds_for(layout)
    lora = _apply(base, ["all-linear"])
    n_sites = 7 * layout.n_layers
    assert sum(1 for v in lora.graph.inputs if v.name.startswith("lora_B.")) == n_sites
    want, got = run_graph(base, feeds), run_graph(lora, lora_feeds(lora, feeds, [None, None], 0))
    for name, w in want.items():
        assert np.array_equal(got[name], w), f"{name} differs with zero adapters"
    # the original I/O is untouched; the new inputs come after it
    assert [v.name for v in lora.graph.inputs][: len(base.graph.inputs)] == [v.name for v in base.graph.inputs]
    assert [v.name for v in lora.graph.outputs] == [v.name for v in base.graph.outputs]


def test_bound_adapter_equals_merged_weights(arch):
    layout, base = tiny(arch)
    feeds = feeds_for(layout)
    lora = _apply(base, ["q_proj", "v_proj", "down_proj"])
    ad = random_adapter(base, ["q_proj", "v_proj", "down_proj"], rank=3, seed=1)
    # slot 1 holds the adapter, every row selects slot 1
    got = run_graph(lora, lora_feeds(lora, feeds, [None, ad], 1))
    _close(got, run_graph(merged(base, ad), feeds))


def test_composes_with_mha_to_sha_per_head_b(arch):
    layout, base = tiny(arch)
    feeds = feeds_for(layout)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    lora = _apply(base, targets, sha=True)
    heads_b = [v.name for v in lora.graph.inputs if v.name.startswith("lora_B.layers.0.self_attn.q_proj")]
    assert len(heads_b) == layout.n_heads and heads_b[0].endswith(".head0")
    # one x @ A per projection, not per head
    a_nodes = [n for n in lora.graph if n.name.startswith("layers.0.self_attn.q_proj.lora/MatMul_A")]
    assert len(a_nodes) == 1
    ad = random_adapter(base, targets, rank=4, seed=2)
    _close(run_graph(lora, lora_feeds(lora, feeds, [ad, None], 0)), run_graph(merged(base, ad), feeds))


def test_mixed_rows_use_their_own_adapter():
    """Row i of one call with adapter X and row j with adapter Y equal separate merged runs."""
    layout, base = tiny("llama")
    feeds = feeds_for(layout)
    past = layout.context - layout.width
    mask = feeds["attention_mask"]
    for i in range(layout.width):  # rows independent of each other (as in CTG's per-style rows)
        mask[0, 0, i, past:] = -1.0e4
        mask[0, 0, i, past + i] = 0.0
    lora = _apply(base, ["q_proj", "v_proj"])
    x = random_adapter(base, ["q_proj", "v_proj"], 4, seed=3)
    y = random_adapter(base, ["q_proj", "v_proj"], 2, seed=4)
    rows = [0, 1, None, 0]
    got = run_graph(lora, lora_feeds(lora, feeds, [x, y], rows))
    refs = {0: run_graph(merged(base, x), feeds), 1: run_graph(merged(base, y), feeds), None: run_graph(base, feeds)}
    for i, s in enumerate(rows):
        np.testing.assert_allclose(got["logits"][0, i], refs[s]["logits"][0, i], atol=2e-4)
        np.testing.assert_allclose(got["new_value_0"][:, :, i], refs[s]["new_value_0"][:, :, i], atol=2e-4)
    assert not np.allclose(refs[0]["logits"][0, 0], refs[1]["logits"][0, 0], atol=1e-2)


def test_bad_options_and_missing_targets():
    with pytest.raises(RecipeError, match="unknown targets"):
        build({"lora_inputs": {"targets": ["qkv"]}})
    with pytest.raises(RecipeError, match="max_rank"):
        build({"lora_inputs": {"max_rank": 0}})
    _, base = tiny("llama")
    m = base.clone()
    build("mha_to_sha")(m)
    build("lora_inputs")(m)
    with pytest.raises(Exception, match="already has LoRA inputs"):
        build("lora_inputs")(m)


def test_lora_before_linear_to_conv_keeps_branches_as_matmul():
    """Recipe order mha_to_sha -> lora_inputs -> linear_to_conv: base weights become Convs, the
    LoRA branches (weights are inputs) stay MatMuls, and the adapter still equals merged weights."""
    layout, base = tiny("qwen2")
    feeds = feeds_for(layout)
    lora = _apply(base, ["q_proj", "v_proj"], sha=True)
    build("linear_to_conv")(lora)
    assert not [n for n in lora.graph if site_of(n)], "a constant-weight projection MatMul survived"
    assert any(n.name.endswith("lora/MatMul_B") for n in lora.graph)
    ad = random_adapter(base, ["q_proj", "v_proj"], rank=4, seed=5)
    _close(run_graph(lora, lora_feeds(lora, feeds, [ad, None], 0)), run_graph(merged(base, ad), feeds))
