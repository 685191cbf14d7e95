"""Weights already on a GGUF block grid keep their exact codes through int4/int8 quantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.tiny import tiny_model, tiny_tokenizer, write_recipe
from toolchain.quantize.ppl import eval_artifact
from toolchain.quantize.schema import QuantizeSpec
from toolchain.quantize.source_grid import fit_block_grid
from toolchain.quantize.stage import quantize_artifact

BLOCK = 16


def q4_1(w: np.ndarray, block: int) -> np.ndarray:
    """What llama.cpp's Q4_1 does to a [in, out] weight (blocks along the input axis), in float16 params."""
    b = w.reshape(-1, block, w.shape[1])
    mn = b.min(1, keepdims=True).astype(np.float16).astype(np.float32)
    d = ((b.max(1, keepdims=True) - mn) / 15).astype(np.float16).astype(np.float32)
    d[d == 0] = 1.0
    q = np.clip(np.round((b - mn) / d), 0, 15)
    return (d * q + mn).reshape(w.shape)


def q8_0(w: np.ndarray, block: int) -> np.ndarray:
    b = w.reshape(-1, block, w.shape[1])
    d = (np.abs(b).max(1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    d[d == 0] = 1.0  # an all-zero block (the padding token's row)
    return (d * np.round(b / d)).reshape(w.shape)


def test_fit_recovers_q4_1_q4_0_and_q8_0_grids():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 24)).astype(np.float32)
    fit = fit_block_grid(q4_1(w, 32), 32, "int4")
    assert fit is not None and fit.offset is not None
    assert fit.codes.min() >= -8 and fit.codes.max() <= 7
    rebuilt = np.repeat(fit.scale, 32, 0) * fit.codes + np.repeat(fit.offset, 32, 0)
    np.testing.assert_allclose(rebuilt, q4_1(w, 32), atol=1e-6)
    codes = rng.integers(-8, 8, size=w.shape)
    codes[::32] = -8  # Q4_0: the block's largest |w| sits at code -8
    q40 = np.repeat(np.abs(w).reshape(2, 32, 24).max(1) / 8, 32, 0) * codes
    fit = fit_block_grid(q40.astype(np.float32), 32, "int4")
    assert fit is not None and fit.offset is None  # symmetric: no offset branch
    fit = fit_block_grid(q8_0(w, 32), 32, "int8")
    assert fit is not None and fit.offset is None and np.abs(fit.codes).max() == 127
    assert fit_block_grid(w, 32, "int4") is None  # plain float weights are off-grid
    assert fit_block_grid(q4_1(w, 16), 32, "int4") is None  # other block boundaries: not this grid


@pytest.fixture(scope="module")
def gridded(tmp_path_factory):
    """A tiny llama whose linear weights are Q4_1 and embedding/lm_head Q8_0 (like the SmolLM2 GGUF)."""
    from toolchain.compile.pipeline import compile_recipe

    model = tiny_model("llama")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:  # torch [out, in]: blocks run along `in`
                grid = q8_0 if "embed" in name or "lm_head" in name else q4_1
                p.copy_(torch.from_numpy(grid(p.numpy().T.copy(), BLOCK).T.copy()))
    root = tmp_path_factory.mktemp("grid")
    model.save_pretrained(root / "llama")
    tiny_tokenizer().save_pretrained(root / "llama")
    recipe = write_recipe(root / "g.yaml", root / "llama", name="tinygrid",
                          graphs="  decode: {width: 1, context: 64}\n  prefill: {width: 8, context: 64}\n")
    recipe.write_text(recipe.read_text().replace("greedy_tokens: 12", "greedy_tokens: 2"))
    return compile_recipe(recipe).out_dir


def _quantized_logits_gap(artifact, tokenizer, **spec) -> float:
    quantize_artifact(artifact, QuantizeSpec(weights="int4", granularity="block", block_size=BLOCK,
                                             activations="int16", calibration={"samples": 4}, **spec), tokenizer)
    rows = eval_artifact(artifact, 160, tokenizer=tokenizer)["rows"]
    return abs(rows["w4a16"]["ppl"] / rows["float"]["ppl"] - 1)


def test_source_grid_is_exact_and_beats_requantizing(gridded, tmp_path):
    import json
    import shutil

    import onnx
    from onnx import numpy_helper

    from toolchain.quantize.source_grid import dequantized

    tok = tiny_tokenizer()
    art = tmp_path / "a"
    shutil.copytree(gridded, art)
    overrides = {"lm_head*": {"weights": "int8"}}
    exact = _quantized_logits_gap(art, tok, overrides=overrides)
    man = json.loads((art / "quantized" / "manifest.json").read_text())
    schemes = man["quantization"]["weights_by_graph"]["decode"]
    kept = [n for n, s in schemes.items() if s.get("source_grid")]
    assert len(kept) == 2 * 7 + 1  # every linear of both layers + the lm_head (int8 blocks)
    assert all(schemes[n]["source_grid"].endswith("block offset") for n in kept if "lm_head" not in n)
    # the dequantized int4 weight plus its block offset is the float graph's weight
    q = onnx.load(art / "quantized" / "decode.onnx")
    f = onnx.load(art / "decode.onnx")
    fw = {i.name: numpy_helper.to_array(i) for i in f.graph.initializer}
    name = next(n for n in kept if "q_proj" in n)
    off = dequantized(q, f"{name}.block_offset")
    got = dequantized(q, name) + np.repeat(off, BLOCK, axis=0)
    np.testing.assert_allclose(got, fw[name], atol=2e-3 * np.abs(fw[name]).max())
    requant = _quantized_logits_gap(art, tok, overrides=overrides, source_grid=False)
    assert exact < requant, (exact, requant)


def test_qat_keeps_source_grid_weights_exact(gridded, tmp_path):
    """QAT learns activation encodings on the QDQ graph; grid weights keep their exact codes."""
    import shutil

    import onnx
    from transformers import AutoModelForCausalLM

    from toolchain.quantize.source_grid import dequantized, fit_block_grid

    torch.set_num_threads(1)
    art = tmp_path / "a"
    shutil.copytree(gridded, art)
    model = AutoModelForCausalLM.from_pretrained(gridded.parent.parent / "llama", attn_implementation="eager")
    spec = QuantizeSpec(method="qat", weights="int4", granularity="block", block_size=BLOCK, activations="int8",
                        calibration={"samples": 2}, qat={"steps": 2, "feeds": 1, "lr": 0.05})
    quantize_artifact(art, spec, tiny_tokenizer())
    q = onnx.load(art / "quantized" / "decode.onnx")
    w = model.model.layers[0].mlp.down_proj.weight.detach().numpy().T  # [in, out]
    fit = fit_block_grid(w, BLOCK, "int4")
    name = "layers.0.mlp.down_proj.weight"
    np.testing.assert_allclose(dequantized(q, name), np.repeat(fit.scale, BLOCK, 0) * fit.codes, atol=1e-6)


@pytest.mark.qnn
def test_source_grid_graphs_run_correctly_on_htp(gridded, tmp_path):
    """The offset branch's C must be per output channel: HTP computed output-axis blocks wrongly
    (logits off by 2.7 and 0% argmax agreement on this model before the fix)."""
    import shutil

    import onnx

    from toolchain.quantize.qnn_check import check_quantized

    art = tmp_path / "a"
    shutil.copytree(gridded, art)
    quantize_artifact(art, QuantizeSpec(weights="int4", granularity="block", block_size=BLOCK, activations="int16",
                                        kv_cache="int8", overrides={"lm_head*": {"weights": "int8"}},
                                        calibration={"samples": 2}), tiny_tokenizer())
    q = onnx.load(art / "quantized" / "decode.onnx", load_external_data=False)
    dq = next(n for n in q.graph.node if n.op_type == "DequantizeLinear" and "block_offset" in n.input[0])
    assert {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute} == {"axis": 1}
    r = check_quantized(art / "quantized", tmp_path / "qnn", greedy_tokens=4)
    # near-tied logits of a random tiny model may flip one argmax within the diff
    assert r["greedy"]["argmax_agreement"] >= 0.75 and r["greedy"]["logits_max_abs"] < 0.1
    assert all(g["logits_max_abs"] < 0.1 for g in r["graphs"].values())


def test_an_8bit_cache_row_summed_from_16bit_partials_is_written_at_16_bits_and_converted(gridded, tmp_path):
    """W4A8 (8-bit KV): v_proj ends in the source grid's Add of two 16-bit partial sums. That Add writes
    16 bits and a Convert makes the 8-bit cache row: HTP's u16 + u16 -> u8 Add put SmolLM2's layer-0 value
    row 17 steps off (measured). Without the rule this Add writes the cache's 8-bit encoding directly."""
    import shutil

    import onnx

    art = tmp_path / "a"
    shutil.copytree(gridded, art)
    quantize_artifact(art, QuantizeSpec(weights="int4", granularity="block", block_size=BLOCK, activations="int8",
                                        kv_cache="int8", calibration={"samples": 2}), tiny_tokenizer())
    m = onnx.load(art / "quantized" / "decode.onnx", load_external_data=False)
    zero_type = {i.name: i.data_type for i in m.graph.initializer}
    readers = {}
    for n in m.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def written_type(node_name: str) -> int:
        out = next(n for n in m.graph.node if n.name == node_name).output[0]
        q = next(r for r in readers[out] if r.op_type == "QuantizeLinear")
        return zero_type[q.input[2]]

    assert written_type("layers.0.self_attn.v_proj/grid_add") == onnx.TensorProto.UINT16
    # the cache row itself keeps the tied 8-bit encoding
    cache_q = next(n for n in m.graph.node if n.op_type == "QuantizeLinear" and n.output[0].startswith("new_value_0"))
    assert zero_type[cache_q.input[2]] == onnx.TensorProto.UINT8
