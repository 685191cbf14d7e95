"""The residual stream, its norms and outlier tensors of a QDQ graph in float (float_residual.py)."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from toolchain.quantize.float_residual import _Index, float_residual, has_float_tensors
from toolchain.runtime.sessions import session_options

LAYERS, WIDTH = 5, 32


def _qdq(src: str, dst: str, bound: float, inits: list) -> list[onnx.NodeProto]:
    inits += [nh.from_array(np.array(2 * bound / 65535, np.float32), f"{dst}_s"),
              nh.from_array(np.array(32768, np.uint16), f"{dst}_z")]
    return [h.make_node("QuantizeLinear", [src, f"{dst}_s", f"{dst}_z"], [f"{dst}_q"]),
            h.make_node("DequantizeLinear", [f"{dst}_q", f"{dst}_s", f"{dst}_z"], [dst])]


def stack_model(outlier_layer: int, widen: float) -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """x -> LAYERS x (16-bit QDQ input @ int8 weight -> 16-bit QDQ output), encodings from this call's
    own ranges except one layer's output, `widen` times wider (as a massive activation of some other
    calibration token widens it). Returns (model, x, float output)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4, WIDTH)).astype(np.float32)
    inits: list = []
    nodes = _qdq("x", "h0", float(np.abs(x).max()), inits)
    cur, val = "h0", x
    for i in range(LAYERS):
        codes = rng.integers(-127, 128, (WIDTH, WIDTH)).astype(np.int8)
        scale = np.float32(1 / 127 / np.sqrt(WIDTH))
        inits += [nh.from_array(codes, f"w{i}"), nh.from_array(scale, f"w{i}_s"), nh.from_array(np.int8(0), f"w{i}_z")]
        nodes.append(h.make_node("DequantizeLinear", [f"w{i}", f"w{i}_s", f"w{i}_z"], [f"w{i}d"]))
        nodes.append(h.make_node("MatMul", [cur, f"w{i}d"], [f"y{i}"], name=f"layers.{i}.mlp/MatMul"))
        val = val @ (codes.astype(np.float32) * scale)
        nodes += _qdq(f"y{i}", f"h{i + 1}", float(np.abs(val).max()) * (widen if i == outlier_layer else 1.05), inits)
        cur = f"h{i + 1}"
    graph = h.make_graph(nodes, "stack", [h.make_tensor_value_info("x", T.FLOAT, [1, 4, WIDTH])],
                         [h.make_tensor_value_info(cur, T.FLOAT, [1, 4, WIDTH])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21)])
    model.ir_version = 10
    return model, x, val


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def test_a_tensor_far_outside_its_role_s_range_runs_float_with_float_weights():
    model, x, ref = stack_model(outlier_layer=2, widen=400.0)
    before = _run(model, {"x": x})
    r = float_residual(model, outlier_ratio=16.0, kv_tensors=set())
    assert r["outliers"] == ["y2"] and r["residual_adds"] == 0
    idx = _Index(model)
    # layer 2 writes and layer 3 reads the float tensor: both run float, with float weights (HTP refuses a
    # standalone DequantizeLinear of quantized weights), the other layers keep their DQ'd int8 weights
    assert r["float_weights"] == 2
    for i in range(LAYERS):
        w = idx.producer.get(next(n for n in model.graph.node if n.name == f"layers.{i}.mlp/MatMul").input[1])
        assert (w is None) == (i in (2, 3)), i
    # one rounding fewer, on the tensor whose step is 400x the others': closer to the float result
    after = _run(model, {"x": x})
    assert np.abs(after - ref).max() < 0.5 * np.abs(before - ref).max()


def test_a_uniform_stack_has_no_outliers():
    model, _, _ = stack_model(outlier_layer=-1, widen=1.0)
    assert float_residual(model, outlier_ratio=16.0, kv_tensors=set())["outliers"] == []


def test_has_float_tensors_reads_the_manifest_record():
    assert not has_float_tensors(None) and not has_float_tensors({"float_residual_by_graph": {}})
    rec = {"float_residual_by_graph": {"decode": {"residual_adds": 4, "outliers": []}}}
    assert has_float_tensors(rec)


@pytest.fixture(scope="module")
def w4a16_pair(compiled, tmp_path_factory, tokenizer):
    """The tiny artifact quantized W4A16 (block 16) twice: as calibrated, and with float_residual."""
    import json
    import shutil

    from toolchain.quantize.schema import QuantizeSpec
    from toolchain.quantize.stage import quantize_artifact

    out = {}
    for flag in (False, True):
        dst = tmp_path_factory.mktemp(f"fr{int(flag)}") / "art"
        shutil.copytree(compiled, dst, ignore=shutil.ignore_patterns("quantized"))
        manifest = json.loads((dst / "manifest.json").read_text())
        for key in ("files", "sizes"):
            manifest[key] = {k: v for k, v in manifest[key].items() if not k.startswith("quantized/")}
        (dst / "manifest.json").write_text(json.dumps(manifest, indent=1))
        rec = quantize_artifact(dst, QuantizeSpec(weights="int4", granularity="block", block_size=16,
                                                  activations="int16", calibration={"samples": 2},
                                                  float_residual=flag), tokenizer)
        out[flag] = (dst, rec)
    return out


def _logits(folder, name, feeds):
    from toolchain.qnn import context as qnn

    sess = qnn.session(folder / f"{name}.onnx", "cpu")
    return qnn.run(sess, feeds)["logits"]


def test_the_residual_stream_runs_float_and_its_norms_read_it_in_l2_form(w4a16_pair, tokenizer):
    from toolchain.quantize.calibrate import corpus_tokens, family_feeds
    from toolchain.runtime.sessions import ArtifactSessions

    dst, rec = w4a16_pair[True]
    fr = rec["float_residual_by_graph"]
    # 2 layers x 2 residual Adds; the norms reading them: layer 0's post-attention, layer 1's two, the final one
    assert {g: (r["residual_adds"], r["norms"]) for g, r in fr.items()} == {"decode": (4, 4), "prefill": (4, 4)}
    from toolchain.quantize.stage import report_section

    assert "| prefill | 4 | 4 | 0 | 0 |" in report_section({**rec, "folder": "quantized"})
    assert "Float residual" not in report_section({**w4a16_pair[False][1], "folder": "quantized"})
    model = onnx.load(dst / "quantized" / "prefill.onnx")
    idx = _Index(model)
    adds = [n for n in model.graph.node if re.fullmatch(r"layers\.\d+/Add(_1)?", n.name)]
    assert len(adds) == 4 and all(c.op_type != "QuantizeLinear" for a in adds for c in idx.consumers[a.output[0]])
    assert sum(n.op_type == "ReduceL2" for n in model.graph.node) == 4
    assert sum(n.op_type == "SimplifiedLayerNormalization" for n in model.graph.node) == 1  # layer 0 reads the embedding

    # numerics: the rewrite only drops roundings of the residual stream, so the CPU run of the rewritten
    # graph stays within a sliver of the int4 weights' own error (a wrong gamma, prescale or L2 form is
    # far off); no massive activation here, so no gain to show: the real model's is in the module doc
    sessions = ArtifactSessions(dst)
    held = corpus_tokens(tokenizer, "heldout", 512)
    feeds = next(iter(family_feeds(sessions, "prefill", held, 1, seed=1)))
    from toolchain.qnn import context as qnn

    ref = qnn.run(qnn.session(dst / "prefill.onnx", "cpu"), feeds)["logits"]
    plain = _logits(w4a16_pair[False][0] / "quantized", "prefill", feeds)
    floated = _logits(dst / "quantized", "prefill", feeds)
    assert np.abs(floated - plain).mean() < 0.05 * np.abs(plain - ref).mean()
