"""lpbq.py on hand-built QDQ MatMuls: which weights change form, how much LPBQ moves them, and the
exact per-channel rewrite of a block indicator. (Their HTP runs: test_qnn_check.py.)"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from toolchain.errors import QuantizeError
from toolchain.quantize.lpbq import LPBQ_LEVELS, lpbq_scales, to_htp_forms

C, OUT, B = 64, 16, 16


def _qdq_matmul(act: int, weights: str, seed: int = 0) -> tuple[onnx.ModelProto, np.ndarray]:
    """x -> Q/DQ (uint8 or uint16) -> MatMul(DQ(block weights)) -> y; returns (model, float weight)."""
    rng = np.random.default_rng(seed)
    aq, anp = (TensorProto.UINT8, np.uint8) if act == 8 else (TensorProto.UINT16, np.uint16)
    lim, wt = (7, TensorProto.INT4) if weights == "int4" else (127, TensorProto.INT8)
    w = (rng.standard_normal((C, OUT)) * rng.uniform(0.01, 1.0, (C // B, 1, OUT)).repeat(B, 0).reshape(C, OUT))
    scale = (np.abs(w.reshape(C // B, B, OUT)).max(1) / lim).astype(np.float32)
    if weights == "indicator":
        scale = np.ones((C // B, OUT), np.float32)
    q = np.clip(np.round(w / np.repeat(scale, B, 0)), -lim - 1, lim).astype(np.int8)
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "as"), numpy_helper.from_array(np.array(1 << (act - 1), anp), "az"),
             helper.make_tensor("wq", wt, q.shape, q.flatten().tolist()), numpy_helper.from_array(scale, "ws"),
             helper.make_tensor("wz", wt, scale.shape, [0] * scale.size)]
    nodes = [helper.make_node("QuantizeLinear", ["x", "as", "az"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "as", "az"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0, block_size=B, name="wdq"),
             helper.make_node("MatMul", ["xd", "wd"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, OUT])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model, (q * np.repeat(scale, B, 0)).astype(np.float32)


def _weight(model: onnx.ModelProto) -> np.ndarray:
    """The MatMul's dequantized weight, as onnxruntime computes it."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(helper.make_tensor_value_info("wd", TensorProto.FLOAT, [C, OUT]))
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["wd"], {"x": np.zeros((1, C), np.float32)})[0]


def test_lpbq_scales_keep_each_channels_largest_block_and_stay_4_bit():
    scale = np.abs(np.random.default_rng(0).standard_normal((8, 5))).astype(np.float32) + 0.01
    k, per_channel = lpbq_scales(scale)
    assert k.dtype == np.uint8 and k.min() >= 1 and k.max() <= LPBQ_LEVELS
    np.testing.assert_allclose((k * per_channel).max(0), scale.max(0), rtol=1e-6)


def test_int4_blocks_next_to_8bit_inputs_become_lpbq_within_the_recorded_change():
    model, w = _qdq_matmul(8, "int4")
    (rec,) = to_htp_forms(model)
    assert rec["form"] == "lpbq int4" and rec["matmul"] == "mm"
    onnx.checker.check_model(model)
    got = _weight(model)
    assert np.abs(got - w).max() == pytest.approx(rec["max_abs_change"], rel=1e-4)
    assert 0 < rec["max_abs_change"] < np.abs(w).max()  # rounded again, not broken
    scale_dq = next(n for n in model.graph.node if n.output[0] == "ws")  # the block scales are now computed
    inits = {i.name: i for i in model.graph.initializer}
    assert inits[scale_dq.input[0]].data_type == TensorProto.UINT8


def test_16bit_inputs_keep_their_exact_block_weights():
    model, w = _qdq_matmul(16, "int4")
    assert to_htp_forms(model) == []
    np.testing.assert_array_equal(_weight(model), w)


def test_a_block_indicator_becomes_per_channel_exactly_other_int8_blocks_are_refused():
    model, w = _qdq_matmul(8, "indicator")
    (rec,) = to_htp_forms(model)
    assert rec["form"] == "per-channel int8 (exact)"
    np.testing.assert_array_equal(_weight(model), w)
    model, _ = _qdq_matmul(8, "int8")
    with pytest.raises(QuantizeError, match="'mm'.*16-bit"):
        to_htp_forms(model)


def test_int4_codes_round_trip_through_ml_dtypes():  # the rewrite stores codes as ml_dtypes.int4
    codes = np.arange(-8, 8, dtype=np.int8).astype(ml_dtypes.int4)
    assert numpy_helper.to_array(numpy_helper.from_array(codes, "c")).astype(np.int8).tolist() == list(range(-8, 8))
