"""QAT: a few fake-quant steps on a tiny model; the learned clipping is what the QDQ graph carries."""

from __future__ import annotations

import json

import numpy as np
import onnx
import torch
from transformers import AutoModelForCausalLM

from tests.toolchain.quantize.test_qdq import load
from toolchain.quantize import qat as qat_mod
from toolchain.quantize.encodings import by_name
from toolchain.quantize.schema import QuantizeSpec
from toolchain.quantize.stage import quantize_artifact


def test_round_ste_passes_gradients():
    x = torch.tensor([0.2, 1.7], requires_grad=True)
    qat_mod.round_ste(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(2))


def test_mse_alpha_never_worse_than_minmax():
    w = torch.randn(8, 64)
    w[0, 0] = 12.0  # an outlier: clipping it lowers the error of the rest
    alpha = qat_mod.mse_alpha(w, 4)
    assert alpha[0] < 1.0 and (alpha <= 1.0).all()


def test_qat_scales_land_in_the_graph(artifact, tokenizer, tiny_src, monkeypatch):
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_src, attn_implementation="eager").eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    captured = {}
    real = qat_mod.run_qat

    def spy(*args, **kwargs):
        captured["result"], rec = real(*args, **kwargs)
        return captured["result"], rec

    monkeypatch.setattr(qat_mod, "run_qat", spy)
    spec = QuantizeSpec(method="qat", activations="int8", calibration={"samples": 2},
                        qat={"steps": 3, "seq_len": 16, "lr": 0.05})
    record = quantize_artifact(artifact, spec, tokenizer, model)
    assert record["qat"]["steps"] == 3 and record["qat"]["wrapped_linears"] == 15
    # the torch model is given back unwrapped and unchanged (weights frozen by default)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    res = captured["result"]
    m, arrays = load(artifact / "quantized" / "decode.onnx")
    node = next(n for n in m.graph.node if n.name == "layers.0.mlp.down_proj/MatMul")
    dq = next(n for n in m.graph.node if n.output[0] == node.input[1])
    scale = arrays[dq.input[1]]
    # onnxruntime's symmetric int4 scale of the clipped weight = learned clip / 7.5
    np.testing.assert_allclose(scale, res.weight_clip["layers.0.mlp.down_proj"] / 7.5, rtol=1e-5)
    # the learned input range is the MatMul input's 8-bit encoding
    lo, hi = res.act_range["layers.0.mlp.down_proj"]
    float_graph = onnx.load(artifact / "decode.onnx", load_external_data=False)
    act_in = next(n.input[0] for n in float_graph.graph.node if n.name == "layers.0.mlp.down_proj/MatMul")
    acts = json.loads((artifact / "quantized" / "decode.encodings.json").read_text())["activation_encodings"]
    enc = by_name(acts)[act_in]
    assert enc["bw"] == 8 and enc["enc_type"] == "PER_TENSOR"
    np.testing.assert_allclose(enc["scale"], [(hi - lo) / 255], rtol=1e-4)


def test_qat_simulates_the_graph_input_types(compiled):
    from toolchain.quantize.qdq import linear_input_types

    spec = QuantizeSpec(activations="int8", overrides={"*norm*": {"activations": "int16"}})
    types = linear_input_types(onnx.load(compiled / "decode.onnx", load_external_data=False), spec)
    assert types["layers.0.self_attn.q_proj"] == "int16"  # fed by input_layernorm
    assert types["layers.0.mlp.up_proj"] == "int16"  # fed by post_attention_layernorm
    assert types["layers.0.self_attn.o_proj"] == "int8"
    assert types["layers.1.mlp.down_proj"] == "int8"
