"""Cost-model arithmetic on hand-computed cases, profile loading, and costs read off ONNX graphs."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from toolchain.cost.model import (
    CostModel,
    DeviceProfile,
    DeviceProfileError,
    GraphCost,
    available_profiles,
    load_profile,
    plan_residency,
    save_profile,
)
from toolchain.cost.onnx_graph import graph_cost, layer_index
from toolchain.errors import MobcError

# Round numbers so every expectation below can be checked by hand.
TOY = DeviceProfile(
    name="toy",
    flash_read_gbps=1.0,  # 1e9 B/s
    dram_peak_gbps=20.0,
    dram_efficiency=0.5,  # 1e10 B/s effective
    npu_int8_tops=10.0,
    npu_efficiency=0.1,  # 1e12 op/s at int8
    call_overhead_ms=1.0,
    precision_scale={"int8": 1.0, "int16": 0.5},
    dram_app_budget_gb=0.25,
)

# 4 layers of 100 MB, 50 MB shared (lm_head), 1 GFLOP per token, 10 MB KV, 1 MB other I/O.
MB = 1_000_000
MODEL = GraphCost(
    layer_weight_bytes={0: 100 * MB, 1: 100 * MB, 2: 100 * MB, 3: 100 * MB},
    shared_weight_bytes=50 * MB,
    flops_per_token=1e9,
    width=1,
    kv_bytes=10 * MB,
    io_bytes=1 * MB,
)


def test_all_resident_decode_is_dram_bound():
    lat = CostModel(TOY, dram_budget=1.0).call_latency(MODEL)
    # DRAM: 450 + 10 + 1 = 461 MB at 1e10 B/s = 46.1 ms; compute 1e9/1e12 = 1 ms; no flash.
    assert lat.flash_bytes == 0
    assert lat.dram_bytes == 461 * MB
    assert lat.dram_s == pytest.approx(0.0461)
    assert lat.compute_s == pytest.approx(0.001)
    assert lat.total_s == pytest.approx(0.001 + 0.0461)
    assert lat.bound == "dram"


def test_flash_ar_streams_everything_synchronously():
    lat = CostModel(TOY, dram_budget=0.0).call_latency(MODEL)
    # 450 MB from flash at 1e9 B/s = 450 ms, then 46.1 ms of DRAM reads, + 1 ms overhead.
    assert lat.flash_bytes == 450 * MB
    assert lat.flash_s == pytest.approx(0.450)
    assert lat.total_s == pytest.approx(0.001 + 0.450 + 0.0461)
    assert lat.bound == "flash"


def test_partial_budget_keeps_shared_then_layer_prefix():
    # 260 MB: lm_head (50) + layers 0 and 1 (200) fit; 10 MB left cannot hold layer 2.
    res = plan_residency(MODEL, 260 * MB)
    assert res.shared_resident and res.resident_layers == frozenset({0, 1})
    lat = CostModel(TOY, dram_budget=260 * MB).call_latency(MODEL)
    assert lat.flash_bytes == 200 * MB
    assert lat.total_s == pytest.approx(0.001 + 0.200 + 0.0461)


def test_fraction_budget_and_device_default():
    # 0.5 of 450 MB = 225 MB: shared + layer 0 (150 MB); layer 1 would make 250.
    assert CostModel(TOY, 0.5).place(MODEL).resident_layers == frozenset({0})
    # None -> the device's app budget: 0.25 GB = 250 MB -> shared + layers 0, 1.
    assert CostModel(TOY).place(MODEL).resident_layers == frozenset({0, 1})


def test_wide_call_becomes_compute_bound_and_precision_scales():
    wide = GraphCost(layer_weight_bytes={0: 10 * MB}, flops_per_token=1e9, width=128, precision="int16")
    lat = CostModel(TOY, 1.0).call_latency(wide)
    # 128 GFLOP at 1e12 * 0.5 op/s = 256 ms; DRAM 10 MB = 1 ms.
    assert lat.compute_s == pytest.approx(0.256)
    assert lat.total_s == pytest.approx(0.001 + 0.256)
    assert lat.bound == "compute"


def test_flash_overlap_hides_streaming_behind_compute():
    from dataclasses import replace

    half = replace(TOY, flash_overlap=0.5)
    cost = GraphCost(layer_weight_bytes={0: 100 * MB}, flops_per_token=2e11, width=1)
    lat = CostModel(half, 0.0).call_latency(cost)
    # flash 100 ms, compute 200 ms, DRAM 10 ms: 1 + 0.5*100 + max(200, 50) = 251 ms.
    assert lat.total_s == pytest.approx(0.251)


def test_placed_residency_is_shared_by_parts_and_chains_add_overheads():
    part1 = GraphCost(layer_weight_bytes={0: 100 * MB, 1: 100 * MB}, flops_per_token=1e9, name="p1")
    part2 = GraphCost(layer_weight_bytes={2: 100 * MB, 3: 100 * MB}, shared_weight_bytes=50 * MB, name="p2")
    whole = part1 + part2
    assert whole.calls == 2 and whole.weight_bytes == 450 * MB and whole.name == "p1+p2"
    cm = CostModel(TOY, 260 * MB)
    cm.place(whole)
    # part2 alone would fit 260 MB entirely; placed on the whole model its layers stream.
    assert cm.call_latency(part2).flash_bytes == 200 * MB
    assert cm.call_latency(part1).flash_bytes == 0
    assert cm.call_latency(whole).overhead_s == pytest.approx(0.002)
    with pytest.raises(ValueError):
        part1 + GraphCost(precision="int16")


def test_builtin_profiles_and_aliases():
    assert {"snapdragon-8-gen-3", "snapdragon-8-elite"} <= set(available_profiles())
    p = load_profile("Samsung Galaxy S24 (Family)")
    assert p.name == "snapdragon-8-gen-3"
    assert p.flash_read_gbps == pytest.approx(4.2)
    assert 77 <= round(p.dram_peak_gbps) <= 85
    assert load_profile("SM8750").dram_peak_gbps == pytest.approx(84.8)


def test_measured_profile_overrides_base(tmp_path):
    f = tmp_path / "s24.yaml"
    f.write_text("base: snapdragon-8-gen-3\nname: s24-measured\nnpu_efficiency: 0.5\n")
    p = load_profile(f)
    assert p.name == "s24-measured" and p.npu_efficiency == 0.5
    assert p.dram_peak_gbps == pytest.approx(76.8)
    # round trip: only the differing fields are written next to base
    out = save_profile(p, tmp_path / "out.yaml", base="snapdragon-8-gen-3")
    text = out.read_text()
    assert "npu_efficiency: 0.5" in text and "dram_peak_gbps" not in text
    assert load_profile(out) == p


@pytest.mark.parametrize(
    "text, msg",
    [
        ("base: pixel-9\n", "not a known device"),
        ("base: snapdragon-8-gen-3\nnpu_tops: 3\n", r"unknown field\(s\) npu_tops"),
        ("flash_read_gbps: 4\n", "missing"),
        ("base: snapdragon-8-gen-3\nflash_overlap: 2\n", "between 0 and 1"),
    ],
)
def test_bad_profiles_name_the_problem(tmp_path, text, msg):
    f = tmp_path / "p.yaml"
    f.write_text(text)
    with pytest.raises(MobcError, match=msg):
        load_profile(f)


def test_unknown_device_and_precision():
    with pytest.raises(DeviceProfileError, match="snapdragon-8-gen-3"):
        load_profile("iphone")
    with pytest.raises(DeviceProfileError, match="precision 'fp8'"):
        CostModel(TOY, 1.0).call_latency(GraphCost(flops_per_token=1.0, precision="fp8"))


# ---- GraphCost from ONNX ---------------------------------------------------------------------


def _toy_lm(width: int = 4, quant_bits: int | None = None) -> onnx.ModelProto:
    """input_ids -> Gather(embed) -> MatMul(layer 0) -> MatMul(layer 1) -> MatMul(lm_head)."""
    f32 = np.float32
    inits = [
        numpy_helper.from_array(np.zeros((100, 8), f32), "model.embed_tokens.weight"),
        numpy_helper.from_array(np.zeros((8, 16), f32), "model.layers.0.mlp.up_proj.weight"),
        # an exporter-invented name: the layer comes from the reading node's name
        numpy_helper.from_array(np.zeros((16, 8), f32), "val_7"),
        numpy_helper.from_array(np.zeros((8, 100), f32), "lm_head.weight"),
    ]
    nodes = [
        helper.make_node("Gather", ["model.embed_tokens.weight", "input_ids"], ["h0"]),
        helper.make_node("MatMul", ["h0", "model.layers.0.mlp.up_proj.weight"], ["h1"]),
        helper.make_node("MatMul", ["h1", "val_7"], ["h2"], name="layers.1.mlp.down_proj/MatMul"),
        helper.make_node("MatMul", ["h2", "lm_head.weight"], ["logits"]),
    ]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT32, [1, width]),
        helper.make_tensor_value_info("past_key_0", TensorProto.FLOAT, [1, 1, 8, 10]),
    ]
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, width, 100]),
        helper.make_tensor_value_info("new_key_0", TensorProto.FLOAT, [1, 1, 8, width]),
    ]
    nodes.append(helper.make_node("Identity", ["past_key_0"], ["unused"]))
    nodes.append(helper.make_node("Slice", ["h0", "s0", "s1", "s2"], ["new_key_0"]))
    inits += [
        numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("s0", [0]), ("s1", [8]), ("s2", [2]))
    ]
    if quant_bits:
        zp_type = TensorProto.UINT16 if quant_bits == 16 else TensorProto.UINT8
        inits += [
            numpy_helper.from_array(np.array(0.1, f32), "qs"),
            helper.make_tensor("qz", zp_type, [], [0]),
        ]
        nodes[1].input[0] = "h0_dq"
        nodes += [
            helper.make_node("QuantizeLinear", ["h0", "qs", "qz"], ["h0_q"]),
            helper.make_node("DequantizeLinear", ["h0_q", "qs", "qz"], ["h0_dq"]),
        ]
    graph = helper.make_graph(nodes, "toy", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return onnx.shape_inference.infer_shapes(model)


def test_graph_cost_from_onnx_hand_computed(tmp_path):
    path = tmp_path / "decode.onnx"
    onnx.save(_toy_lm(width=4), path)
    cost = graph_cost(path)
    assert cost.name == "decode" and cost.width == 4
    # a float graph runs in fp16 on HTP: layers 8*16*2 = 256 B each; shared: lm_head 8*100*2 B
    # + 4 gathered embedding rows of 8*2 B + 3 int64 slice constants
    assert cost.layer_weight_bytes == {0: 256, 1: 256}
    assert cost.shared_weight_bytes == 1600 + 4 * 16 + 3 * 8
    # 2*4*8*16 + 2*4*16*8 + 2*4*8*100 = 8448 FLOPs per call
    assert cost.flops == pytest.approx(8448)
    assert cost.flops_per_token == pytest.approx(2112)
    # KV: past_key 80 floats + new_key 32 floats; I/O: ids 16 B + logits 1600 B
    assert cost.kv_bytes == (80 + 32) * 4
    assert cost.io_bytes == 16 + 4 * 100 * 4
    assert cost.precision == "fp16"


def test_graph_cost_precision_from_qdq_and_in_memory_model():
    q16 = graph_cost(ir.from_proto(_toy_lm(quant_bits=16)))
    assert q16.precision == "int16"
    assert q16.layer_weight_bytes == {0: 512, 1: 512}  # not a float graph: bytes as stored
    assert graph_cost(ir.from_proto(_toy_lm(quant_bits=8)), width=4).precision == "int8"


def test_layer_index_names():
    assert layer_index("model.layers.3.self_attn.q_proj.weight") == 3
    assert layer_index("model_layers_12_mlp_down_proj_weight") == 12
    assert layer_index("transformer.h.7.attn.c_attn.weight") == 7
    assert layer_index("lm_head.weight") is None
    assert layer_index("model.norm.weight") is None


def test_missing_onnx_file_is_a_clear_error(tmp_path):
    with pytest.raises(MobcError, match="no such .onnx file"):
        graph_cost(tmp_path / "nope.onnx")


def test_chaining_a_narrower_stage_adds_its_total_flops():
    # a prefill split into a width-128 body and an lm_head that scores only the last row
    body = GraphCost(layer_weight_bytes={0: 10 * MB}, flops_per_token=1e9, width=128)
    head = GraphCost(shared_weight_bytes=5 * MB, flops_per_token=6e7, width=1)
    total = body + head
    assert total.width == 128 and total.calls == 2
    assert total.flops == pytest.approx(128 * 1e9 + 6e7)
    assert total.weight_bytes == 15 * MB
