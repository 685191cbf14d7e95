"""The small graphs an onnxruntime-genai decoder pipeline runs around mobc's step graphs.

onnxruntime-genai's decoder-pipeline (what Qualcomm AI Hub Models ships for Snapdragon apps)
feeds prompts in windows of W tokens, left-padded with the pad token to a multiple of W
(`sliding_window.window_size` = the prefill width), then generated tokens one at a time. Its
inputs differ from the step graph's, so three small stages translate, one of each per width:

- position processor: genai gives `attention_mask_window` [1, CL] int32 (right-aligned: the last
  W columns are this call's rows, 1 = a real token; the ones before count the tokens already in
  the cache) and `position_ids` [1, W]. The step graph wants additive masks [1,1,W,CL] over its
  own columns (cache slots [0, CL-W), then the W new rows): a slot is seen if it holds a token,
  new rows causally, Gemma 3's sliding layers only within the window; and RoPE cos/sin rows
  gathered from the artifact's own tables by position.
- KV unpack / pack: on the CPU, genai keeps one float cache buffer per layer shared by the past
  input and the present output ([1, Hkv, CL, D], detected from the fixed shape), laid out like
  mobc's own cache: the token at position p in slot p. Unpack hands the step graph its
  pre-transposed past (the first CL-W slots); pack scatters the W new rows into their slots
  (padding rows into the last slot, which no call reads as past before a real token overwrites it).

So the step graphs see the same cache, masks and positions as under `mobc run`; no value is
rounded on the way (genai's sliding uint8 cache is not used: slide_key_value_cache is off).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from toolchain.artifact.layout import MASK_MIN, StepLayout

OPSET = 21
IR_VERSION = 10
GENAI_MASK = "attention_mask_window"  # genai's own [1, CL] mask (the step graph's name is taken)
GENAI_POSITIONS = "position_ids"


def genai_kv_name(kind: str, direction: str, layer: int) -> str:
    """genai's name for a layer's cache buffer: kind key|value, direction past|present."""
    return f"{direction}_{kind}_cache_{layer}"


def genai_kv_pattern(kind: str, direction: str) -> str:
    return f"{direction}_{kind}_cache_%d"


def _model(nodes, name, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="mobc")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def _const(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def _common(layout: StepLayout) -> tuple[list, list]:
    """Nodes and constants both the position processor and the pack stage need: which of this call's
    rows hold real tokens (`row_valid` [W] bool), their positions (`pos` [1, W], `pos_1d` [W], int64)
    and how many tokens the cache holds (`cached` [])."""
    w, cl = layout.width, layout.context
    inits = [_const("past_cols", np.array([0, 0], np.int64)), _const("past_end", np.array([1, cl - w], np.int64)),
             _const("rows_start", np.array([cl - w], np.int64)), _const("rows_end", np.array([cl], np.int64)),
             _const("axis1", np.array([1], np.int64)), _const("axis0", np.array([0], np.int64))]
    nodes = [helper.make_node("Slice", [GENAI_MASK, "rows_start", "rows_end", "axis1"], ["row_mask"]),
             helper.make_node("Squeeze", ["row_mask", "axis0"], ["row_mask_1d"]),
             helper.make_node("Cast", ["row_mask_1d"], ["row_valid"], to=TensorProto.BOOL),
             helper.make_node("Slice", [GENAI_MASK, "past_cols", "past_end"], ["past_mask"]),
             helper.make_node("ReduceSum", ["past_mask"], ["cached_i32"], keepdims=0),
             helper.make_node("Cast", ["cached_i32"], ["cached"], to=TensorProto.INT64),
             helper.make_node("Cast", [GENAI_POSITIONS], ["pos"], to=TensorProto.INT64),
             helper.make_node("Squeeze", ["pos", "axis0"], ["pos_1d"])]
    return nodes, inits


def position_processor(layout: StepLayout, rope: dict[str, np.ndarray]) -> onnx.ModelProto:
    w, cl, half = layout.width, layout.context, layout.head_dim // 2
    nodes, inits = _common(layout)
    inits += [_const("slot_index", np.arange(cl - w, dtype=np.int64)), _const("zero", np.float32(0.0)),
              _const("mask_min", np.float32(MASK_MIN)), _const("causal", np.tril(np.ones((w, w), bool))),
              _const("eye", np.eye(w, dtype=bool)), _const("shape_wn", np.array([w, cl - w], np.int64)),
              _const("axis_last", np.array([-1], np.int64)), _const("axes01", np.array([0, 1], np.int64))]
    nodes += [
        # cache slots [0, CL-W): slot s holds position s; seen while s < cached
        helper.make_node("Less", ["slot_index", "cached"], ["slot_filled"]),  # [CL-W]
        helper.make_node("Expand", ["slot_filled", "shape_wn"], ["past_seen"]),  # [W, CL-W]
        # new rows: causal among real rows; every row sees itself (a padding row then attends to
        # something, as in mobc's runtime)
        helper.make_node("And", ["causal", "row_valid"], ["new_causal"]),
        helper.make_node("Or", ["new_causal", "eye"], ["new_seen"]),
        helper.make_node("Concat", ["past_seen", "new_seen"], ["seen"], axis=1),  # [W, CL]
        helper.make_node("Concat", ["slot_index", "pos_1d"], ["key_pos"], axis=0),  # [CL]
        helper.make_node("Unsqueeze", ["pos_1d", "axis_last"], ["row_pos"]),  # [W, 1]
        helper.make_node("Sub", ["row_pos", "key_pos"], ["distance"]),  # [W, CL]
    ]
    outputs = []
    for kind in layout.kinds:
        sfx = StepLayout.suffix(kind)
        allowed = "seen"
        if kind == "sliding" and layout.sliding_window:
            inits.append(_const("window", np.int64(layout.sliding_window)))
            nodes += [helper.make_node("Less", ["distance", "window"], ["in_window"]),
                      helper.make_node("And", ["seen", "in_window"], ["seen_sliding"])]
            allowed = "seen_sliding"
        nodes += [helper.make_node("Where", [allowed, "zero", "mask_min"], [f"mask2d{sfx}"]),
                  helper.make_node("Unsqueeze", [f"mask2d{sfx}", "axes01"], [f"attention_mask{sfx}"])]
        outputs.append(helper.make_tensor_value_info(f"attention_mask{sfx}", TensorProto.FLOAT, [1, 1, w, cl]))
    for kind in layout.rope_kinds:
        sfx = StepLayout.suffix(kind)
        for fn in ("cos", "sin"):
            table = np.ascontiguousarray(rope[f"{fn}{sfx}"][:cl].reshape(-1, half), dtype=np.float32)
            inits.append(_const(f"{fn}{sfx}_table", table))
            nodes += [helper.make_node("Gather", [f"{fn}{sfx}_table", "pos"], [f"{fn}{sfx}_rows"], axis=0),
                      helper.make_node("Unsqueeze", [f"{fn}{sfx}_rows", "axis1"], [f"position_{fn}{sfx}"])]
            outputs.append(helper.make_tensor_value_info(f"position_{fn}{sfx}", TensorProto.FLOAT, [1, 1, w, half]))
    return _model(nodes, f"position_processor_w{w}", _window_inputs(layout), outputs, inits)


def _window_inputs(layout: StepLayout) -> list:
    return [helper.make_tensor_value_info(GENAI_MASK, TensorProto.INT32, [1, layout.context]),
            helper.make_tensor_value_info(GENAI_POSITIONS, TensorProto.INT32, [1, layout.width])]


def _buffer_info(layout: StepLayout, name: str):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, layout.n_kv, layout.context, layout.head_dim])


# step graph layout <-> genai buffer [1, Hkv, S, D] (keys are stored pre-transposed [Hkv, 1, D, S]);
# each permutation is its own inverse, so one table serves both directions
_SWAP = {"key": [1, 0, 3, 2], "value": [1, 0, 2, 3]}


def _step_shape(layout: StepLayout, kind: str, rows: int) -> list[int]:
    """A step graph's key/value tensor of `rows` sequence rows (StepLayout's convention)."""
    d = layout.head_dim
    return [layout.n_kv, 1, d, rows] if kind == "key" else [layout.n_kv, 1, rows, d]


def kv_unpack(layout: StepLayout) -> onnx.ModelProto:
    """genai's cache buffers -> the step graph's past_key_i [Hkv,1,D,CL-W] / past_value_i [Hkv,1,CL-W,D]."""
    past = layout.context - layout.width
    inits = [_const("zero", np.array([0], np.int64)), _const("past_len", np.array([past], np.int64)),
             _const("axis2", np.array([2], np.int64))]
    nodes, inputs, outputs = [], [], []
    for i in range(layout.n_layers):
        for kind in ("key", "value"):
            src, dst = genai_kv_name(kind, "past", i), f"past_{kind}_{i}"
            nodes += [helper.make_node("Slice", [src, "zero", "past_len", "axis2"], [f"{dst}_slots"]),
                      helper.make_node("Transpose", [f"{dst}_slots"], [dst], perm=_SWAP[kind])]
            inputs.append(_buffer_info(layout, src))
            outputs.append(helper.make_tensor_value_info(dst, TensorProto.FLOAT, _step_shape(layout, kind, past)))
    return _model(nodes, f"kv_unpack_w{layout.width}", inputs, outputs, inits)


def kv_pack(layout: StepLayout) -> onnx.ModelProto:
    """Scatters the step graph's new_key_i / new_value_i (W rows) into genai's cache buffers at
    their positions; padding rows go to the last slot."""
    w, cl, d = layout.width, layout.context, layout.head_dim
    nodes, inits = _common(layout)
    inits += [_const("last_slot", np.int64(cl - 1)),
              _const("rows_shape", np.array([1, layout.n_kv, w, d], np.int64)),
              _const("idx_shape", np.array([1, 1, w, 1], np.int64))]
    nodes += [helper.make_node("Where", ["row_valid", "pos_1d", "last_slot"], ["slot"]),
              helper.make_node("Reshape", ["slot", "idx_shape"], ["slot4"]),
              helper.make_node("Expand", ["slot4", "rows_shape"], ["slots"])]
    inputs, outputs = _window_inputs(layout), []
    for i in range(layout.n_layers):
        for kind in ("key", "value"):
            new, past, present = f"new_{kind}_{i}", genai_kv_name(kind, "past", i), genai_kv_name(kind, "present", i)
            nodes += [helper.make_node("Transpose", [new], [f"{new}_rows"], perm=_SWAP[kind]),
                      helper.make_node("ScatterElements", [past, "slots", f"{new}_rows"], [present], axis=2)]
            inputs += [helper.make_tensor_value_info(new, TensorProto.FLOAT, _step_shape(layout, kind, w)),
                       _buffer_info(layout, past)]
            outputs.append(_buffer_info(layout, present))
    return _model(nodes, f"kv_pack_w{w}", inputs, outputs, inits)
