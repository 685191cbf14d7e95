"""Masked attention slots weigh exactly zero in quantized graphs (toolchain/quantize/exact_mask.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from toolchain.artifact.layout import MASK_MIN
from toolchain.quantize import qdq
from toolchain.quantize.encodings import by_name
from toolchain.quantize.exact_mask import exact_attention_masks
from toolchain.quantize.schema import QuantizeSpec
from toolchain.quantize.stage import quantize_artifact
from toolchain.runtime.model import StepModel

W4A16 = dict(weights="int4", granularity="block", block_size=16, activations="int16", kv_cache="int8",
             calibration={"samples": 4}, eval_tokens=0)


def attention_graph() -> onnx.ModelProto:
    """softmax(q k^T + mask) v over 6 slots, the mask reaching the Add through a Slice."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Slice", ["attention_mask", "starts", "ends", "axes"], ["mask_cut"]),
        helper.make_node("MatMul", ["q", "k"], ["scores"]),
        helper.make_node("Add", ["scores", "mask_cut"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["probs", "v"], ["out"]),
    ]
    inits = [helper.make_tensor(n, TensorProto.INT64, [1], [v]) for n, v in
             (("starts", 0), ("ends", 6), ("axes", 3))]
    graph = helper.make_graph(
        nodes, "attn",
        [helper.make_tensor_value_info("q", f, [1, 1, 3, 4]), helper.make_tensor_value_info("k", f, [1, 1, 4, 6]),
         helper.make_tensor_value_info("v", f, [1, 1, 6, 4]),
         helper.make_tensor_value_info("attention_mask", f, [1, 1, 3, 8])],
        [helper.make_tensor_value_info("out", f, [1, 1, 3, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["out"], feeds)[0]


def test_rewrite_is_the_identity_in_float_and_finds_the_mask_through_carriers():
    rng = np.random.default_rng(0)
    mask = np.zeros((1, 1, 3, 8), np.float32)
    mask[..., 4:] = MASK_MIN
    mask[0, 0, 0, 1:] = MASK_MIN  # row 0 sees slot 0 only
    feeds = {"q": rng.normal(size=(1, 1, 3, 4)).astype(np.float32),
             "k": rng.normal(size=(1, 1, 4, 6)).astype(np.float32),
             "v": rng.normal(size=(1, 1, 6, 4)).astype(np.float32), "attention_mask": mask}
    model = attention_graph()
    before = run(model, feeds)
    assert exact_attention_masks(model) == 1
    onnx.checker.check_model(model)
    after = run(model, feeds)
    np.testing.assert_allclose(after, before, atol=1e-5)
    # a fully masked row stays finite (pad rows exist in every width-N call)
    feeds["attention_mask"] = np.full_like(mask, MASK_MIN)
    assert np.isfinite(run(model, feeds)).all()


def test_softmax_without_a_mask_input_is_left_alone():
    model = attention_graph()
    model.graph.input[3].name = "bias"
    model.graph.node[0].input[0] = "bias"
    assert exact_attention_masks(model) == 0


def prompt_ids(model: StepModel) -> list[int]:
    return model.tokenizer("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)").input_ids


def leaks(folder: Path) -> tuple[float, float]:
    """(max |logits change| of a prompt's first rows when only *future* tokens change,
    max |logits change| of a decode step when only masked cache slots change)."""
    m = StepModel(folder, io_binding=False)
    ids = prompt_ids(m)
    m.reset()
    short = m.forward(ids[:3])
    m.reset()
    longer = m.forward(ids[:7])
    future = float(np.abs(short - longer[:3]).max())
    m.prefill(ids[:-1])
    fresh = m.forward([ids[-1]])
    rng = np.random.default_rng(1)
    n = m.length
    for keys, values in zip(m.cache.keys, m.cache.values, strict=True):
        keys[..., n:] = rng.normal(0, 3 * np.abs(keys[..., :n]).max(), keys[..., n:].shape)
        values[:, :, n:] = rng.normal(0, 3 * np.abs(values[:, :, :n]).max(), values[:, :, n:].shape)
    stale = m.forward([ids[-1]])
    return future, float(np.abs(fresh - stale).max())


@pytest.fixture
def narrow_softmax_grid(monkeypatch):
    """The tiny model's scores span a few units, so the Softmax-input clip (hi - SOFTMAX_SPAN) never
    engages; a span of 2 puts the grid's floor above many rows' maxima, as on real models."""
    monkeypatch.setattr(qdq, "SOFTMAX_SPAN", 2.0)


def test_quantized_graph_ignores_future_tokens_and_masked_cache_slots(artifact, tokenizer, narrow_softmax_grid):
    quantize_artifact(artifact, QuantizeSpec(**W4A16), tokenizer)
    assert leaks(artifact / "quantized") == (0.0, 0.0)


@pytest.fixture
def without_rewrite(monkeypatch):
    monkeypatch.setattr(qdq, "exact_attention_masks", lambda model, span: 0)


def test_without_the_rewrite_the_quantized_graph_leaks(artifact, tokenizer, narrow_softmax_grid, without_rewrite):
    """The failure the rewrite exists for, on the same tiny model (so the test above can fail)."""
    quantize_artifact(artifact, QuantizeSpec(**W4A16), tokenizer)
    future, stale = leaks(artifact / "quantized")
    assert max(future, stale) > 1e-3


def _w4a8_kv_steps_after_attention(artifact: Path, tokenizer, tmp: Path) -> float:
    """Quantizes the tiny model W4A8 (SmolLM2's scheme), builds its decode binary and returns how many
    8-bit steps layer 1's K/V rows differ between the HTP and the CPU on a decode call with a real
    cache behind it (layer 1 reads layer 0's attention over that cache)."""
    from toolchain.qnn import context as qnn
    from toolchain.quantize.calibrate import corpus_tokens, family_feeds
    from toolchain.runtime.sessions import ArtifactSessions

    spec = QuantizeSpec(weights="int4", granularity="block", block_size=16, activations="int8", kv_cache="int8",
                        overrides={"*norm*": {"activations": "int16"}}, calibration={"samples": 2}, lpbq=True)
    quantize_artifact(artifact, spec, tokenizer)
    q = artifact / "quantized"
    src = q / "decode.onnx"
    feeds = list(family_feeds(ArtifactSessions(q), "decode", corpus_tokens(tokenizer, "heldout", 256), 4, seed=1))
    assert (feeds[-1]["attention_mask"] == 0).sum() > 8  # a decode call with a cache behind it
    cmp = qnn.run_and_compare(src, qnn.build_context_binary(src, tmp, fp16=False).model, feeds[-1],
                              qnn.provider_options(57, 75, False))
    encodings = by_name(json.loads((q / "decode.encodings.json").read_text())["activation_encodings"])
    return max(cmp.max_abs[name] / encodings[name]["scale"][0] for name in ("new_key_1", "new_value_1"))


@pytest.mark.qnn
def test_the_htp_adds_the_shallow_mask_as_the_cpu_does(artifact, tokenizer, tmp_path):
    """Measured on this tiny model: 3 steps (with the mask at MASK_MIN's depth, 11: the test below)."""
    assert _w4a8_kv_steps_after_attention(artifact, tokenizer, tmp_path) <= 4


@pytest.fixture
def deep_mask(monkeypatch, tmp_path):
    from toolchain.quantize import calibrate

    deep = exact_attention_masks
    monkeypatch.setattr(qdq, "exact_attention_masks", lambda model, span: deep(model, -MASK_MIN))
    # the cached ranges were collected on the shallow mask (the cache key names the rewrite's version)
    monkeypatch.setattr(calibrate, "CACHE_DIR", tmp_path / "ranges")


@pytest.mark.qnn
def test_a_mask_at_mask_min_depth_loses_bits_in_the_htp_add(artifact, tokenizer, tmp_path, deep_mask):
    """The failure the shallow mask exists for (so the test above can fail)."""
    assert _w4a8_kv_steps_after_attention(artifact, tokenizer, tmp_path) >= 8
