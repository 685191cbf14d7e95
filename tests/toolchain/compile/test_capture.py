"""Capture + export on every supported architecture: the ONNX step graph equals the HF model.

The reference is transformers' own eager forward over a real past cache with a tree-shaped
mask (toolchain.compile.verify.reference_case), so both the step-graph wrapper and the runtime's
mask/RoPE construction are checked.
"""

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from tests.tiny import FAMILIES, tiny_model
from toolchain.compile.capture import layout_for, rope_tables
from toolchain.compile.export import export_step_graph
from toolchain.compile.verify import compare, real_text, reference_case
from toolchain.errors import UnsupportedModelError


def _run(model: ir.Model, feeds, tmp_path):
    path = tmp_path / "g.onnx"
    ir.save(model, path, external_data="g.bin")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("width,context", [(1, 32), (6, 48)])
def test_step_graph_matches_transformers(family, width, context, tmp_path):
    model = tiny_model(family)
    layout = layout_for(model.config, width, context)
    onnx_model = export_step_graph(model, layout)
    assert [v.name for v in onnx_model.graph.inputs] == [n for n, _, _ in layout.inputs()]
    assert [v.name for v in onnx_model.graph.outputs] == [n for n, _, _ in layout.outputs()]
    tokens = list(np.random.default_rng(0).integers(3, model.config.vocab_size, 200))
    case = reference_case(model, tokens, layout, rope_tables(model, layout, context), seed=width)
    figures = compare(_run(onnx_model, case.feeds, tmp_path), case.expected)
    assert figures["logits_max_abs"] < 1e-4, figures
    assert figures["kv_max_abs"] < 1e-4, figures


def test_gemma3_sliding_layers_get_their_own_mask_and_rope():
    model = tiny_model("gemma3")
    layout = layout_for(model.config, 4, 64)  # context far above the window of 8
    names = [n for n, _, _ in layout.inputs()]
    assert {"attention_mask", "attention_mask_sliding", "position_cos_sliding"} <= set(names)
    assert layout.layer_kinds == ("sliding", "sliding", "full")


def test_names_carry_layer_and_projection():
    model = tiny_model("llama")
    onnx_model = export_step_graph(model, layout_for(model.config, 1, 16))
    node_names = [n.name for n in onnx_model.graph]
    assert any(n.startswith("layers.1.self_attn.q_proj/") for n in node_names)
    assert any(n.startswith("layers.0.mlp.down_proj/") for n in node_names)
    assert "layers.0.self_attn.q_proj.weight" in onnx_model.graph.initializers
    assert len(set(node_names)) == len(node_names)


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match=r"'gpt2' is not supported.*llama.*qwen3.*gemma3_text"):
        layout_for(GPT2Config(), 1, 16)


def test_verification_text_is_real():
    assert "import" in real_text() and len(real_text()) > 10_000
