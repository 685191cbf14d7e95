"""Quantization pre-processing: masked attention slots get exactly zero weight.

Why (measured): the float graphs mask with an additive MASK_MIN, but a quantized Softmax input
cannot hold it. Its grid is clipped to [hi - SOFTMAX_SPAN, hi] (qdq.py) for precision, so a masked
score lands on the grid's floor, and a row whose own maximum sits far below the tensor's global
`hi` (early rows of a prompt, heads without an attention sink) gives every masked slot real weight.
On SmolLM2 W4A16 the prompt's first rows changed by up to 2.5 in the logits when *future* tokens
changed, and an onnxruntime-genai bundle (pads on the left instead of the right) generated other
tokens from the first one on.

The rewrite, per Softmax whose input is `scores + mask` with the mask coming from an
`attention_mask*` graph input:

    keep = mask / |MASK_MIN| + 1                    (exactly 1 where attended, 0 where masked)
    p    = Softmax(scores + (keep - 1) * SPAN)
    out  = p * keep / (ReduceSum(p * keep) + eps)   (renormalised over the attended slots)

The additive mask the Softmax sees is -SPAN, not MASK_MIN: the Softmax input's grid is clipped to
[hi - SPAN, hi] (qdq.py), so a masked score lands on the grid's floor either way and the CPU's QDQ
arithmetic is unchanged (measured: bit-identical on SmolLM2 W4A8). But the HTP adds two quantized
tensors at a common scale: with the mask's grid at 1e4/255 per step, 333x the sum's, the sum lost
3 bits (attended scores came out in multiples of 8 steps; W4A8 decode K/V 16 steps off the CPU from
layer 1 on). With the mask on a grid the sum's size, the Add is within a step.

Every tensor stays quantizable (Mul, Add, ReduceSum, Div: QNN HTP runs them all quantized) and 0 is
exact on every grid, so a masked slot multiplies its value row by exactly 0: the output no longer
depends on what the masked cache slots or future rows hold. In float the rewrite is the identity
(up to rounding): `p` of a masked slot is already exp(MASK_MIN) = 0. eps keeps a fully masked row
(a pad row) finite during calibration; such rows are never read.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from toolchain.artifact.layout import MASK_MIN

MASK_INPUT_PREFIX = "attention_mask"
# ops that carry the mask input to the Add without changing its values
MASK_CARRIERS = {"Slice", "Expand", "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Identity", "Cast",
                 "DequantizeLinear", "QuantizeLinear", "Concat", "Tile"}
RENORM_EPS = 1e-6
# attention logits further below the row max than this weigh exp(-30) ~ 1e-13: the Softmax input's
# grid is clipped there (qdq.py) and the additive mask is this deep
SOFTMAX_SPAN = 30.0
EXACT_MASK_VERSION = 2  # in the calibration cache key: ranges of another rewrite must not be reused


def _from_mask_input(name: str, producer: dict[str, onnx.NodeProto], inputs: set[str]) -> bool:
    seen = set()
    stack = [name]
    while stack:
        cur = stack.pop()
        if cur in inputs:
            return cur.startswith(MASK_INPUT_PREFIX)
        node = producer.get(cur)
        if node is None or node.op_type not in MASK_CARRIERS or cur in seen:
            continue
        seen.add(cur)
        stack.append(node.input[0])
    return False


def _last_axis(node: onnx.NodeProto) -> bool:
    axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
    return axis == -1  # step graphs softmax over the context axis, written as -1 by the exporter


def exact_attention_masks(model: onnx.ModelProto, span: float = SOFTMAX_SPAN) -> int:
    """Rewrites every masked Softmax of `model` in place (see module doc); returns how many.

    span: the depth of the additive mask; at least the Softmax input grid's span, or a masked score
    would sit above that grid's floor."""
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    inputs = {i.name for i in g.input}
    consts = {
        "mobc_mask_inv": np.array(-1.0 / MASK_MIN, np.float32),
        "mobc_mask_one": np.array(1.0, np.float32),
        "mobc_mask_span": np.array(span, np.float32),
        "mobc_mask_eps": np.array(RENORM_EPS, np.float32),
        "mobc_mask_axes": np.array([-1], np.int64),
    }
    keep_of: dict[str, str] = {}
    out_nodes: list[onnx.NodeProto] = []
    rewritten = 0
    for node in g.node:
        out_nodes.append(node)
        if node.op_type != "Softmax" or not _last_axis(node):
            continue
        add = producer.get(node.input[0])
        if add is None or add.op_type != "Add":
            continue
        mask = next((i for i in add.input if _from_mask_input(i, producer, inputs)), None)
        if mask is None:
            continue
        if mask not in keep_of:
            keep_of[mask] = f"{mask}_keep"
            scaled = f"{mask}_keep_scaled"  # exactly -1 where masked, 0 where attended
            # before the Add, which reads the shallow mask
            at = out_nodes.index(add)
            out_nodes[at:at] = [
                helper.make_node("Mul", [mask, "mobc_mask_inv"], [scaled], name=f"{mask}/keep_scale"),
                helper.make_node("Add", [scaled, "mobc_mask_one"], [keep_of[mask]], name=f"{mask}/keep"),
                helper.make_node("Mul", [scaled, "mobc_mask_span"], [f"{mask}_shallow"], name=f"{mask}/shallow"),
            ]
        add.input[list(add.input).index(mask)] = f"{mask}_shallow"
        probs = node.output[0]
        base = node.name or probs
        raw, kept, total, denom = (f"{probs}_{s}" for s in ("unmasked", "kept", "sum", "denom"))
        node.output[0] = raw
        out_nodes.extend([
            helper.make_node("Mul", [raw, keep_of[mask]], [kept], name=f"{base}/exact_mask"),
            helper.make_node("ReduceSum", [kept, "mobc_mask_axes"], [total], name=f"{base}/exact_mask_sum",
                             keepdims=1),
            helper.make_node("Add", [total, "mobc_mask_eps"], [denom], name=f"{base}/exact_mask_eps"),
            helper.make_node("Div", [kept, denom], [probs], name=f"{base}/exact_mask_renorm"),
        ])
        rewritten += 1
    if rewritten:
        del g.node[:]
        g.node.extend(out_nodes)
        have = {i.name for i in g.initializer}
        g.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items() if k not in have)
    return rewritten
